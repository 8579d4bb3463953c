"""The one place that picks the TOML reader: the standard library's ``tomllib`` from Python 3.11,
else ``tomli`` (the same API; pyproject requires it on 3.10). Everything reads TOML through here."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

loads = tomllib.loads
TOMLDecodeError = tomllib.TOMLDecodeError

__all__ = ["TOMLDecodeError", "loads"]
