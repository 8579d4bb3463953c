"""Credentials never printed or written: an index URL's user and password shown as pip shows them
(`https://user:****@host/`, a token alone as `****`), in one URL or anywhere in a command line."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")


def _hide(m: re.Match) -> str:
    user, sep, _ = m.group("userinfo").partition(":")
    return f"{m.group('scheme')}{user + ':****' if sep else '****'}@"


def url(text: str) -> str:
    """text with the userinfo of every URL in it redacted."""
    return _USERINFO.sub(_hide, text)


def args(cmd: list[str]) -> list[str]:
    """A command's arguments, each redacted (for the lines that show what runs)."""
    return [url(str(a)) for a in cmd]


def shown(cmd: list[str]) -> str:
    return " ".join(args(cmd))
