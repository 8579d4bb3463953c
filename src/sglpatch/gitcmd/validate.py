"""What may be handed to git as a ref, a commit id or a remote URL: checks made before any git runs.

Refs and ids that git could read as options (``-x``), revision ranges and reflog syntax are
refused, and URLs are limited to https://, ssh://, scp-like git@host:path, file:// and local
paths (no ``ext::``/``fd::`` transport helpers, no ssh option smuggled in as a host or user).
Untrusted input (the lock, the series, a command line) passes through here first.
"""

from __future__ import annotations

import re

from sglpatch.errors import SglpatchError

_SHA_RE = re.compile(r"^[0-9a-f]{7,40}$")
_REF_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._/+@^~-]*$")
_SCP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*@[A-Za-z0-9][A-Za-z0-9.-]*:[A-Za-z0-9._/~-]+$")


def validate_ref(ref: str, what: str = "ref") -> str:
    """Refuse refs that git could read as options or that are not plain names/ids."""
    if not isinstance(ref, str) or not ref:
        raise SglpatchError(f"invalid {what}: empty")
    if ref.startswith("-"):
        raise SglpatchError(f"invalid {what} {ref!r}: must not start with '-'")
    if not _REF_RE.match(ref) or ".." in ref or "@{" in ref or ref.endswith((".lock", "/", ".")):
        raise SglpatchError(f"invalid {what} {ref!r}: use a tag, branch or commit id")
    return ref


def validate_sha(sha: str, what: str = "commit") -> str:
    if not isinstance(sha, str) or not _SHA_RE.match(sha):
        raise SglpatchError(f"invalid {what} {sha!r}: expected 7-40 lowercase hex digits")
    return sha


def validate_url(url: str) -> str:
    """Only https://, ssh://, scp-like git@host:path and file:// (or a local path) are accepted."""
    if not isinstance(url, str) or not url.strip():
        raise SglpatchError("invalid upstream url: empty")
    if url != url.strip() or any(c.isspace() for c in url):
        raise SglpatchError(f"invalid upstream url {url!r}: contains whitespace")
    if url.startswith("-"):
        raise SglpatchError(f"invalid upstream url {url!r}: must not start with '-'")
    if "::" in url:
        raise SglpatchError(f"invalid upstream url {url!r}: transport helpers (ext::, fd::) are not allowed")
    lowered = url.lower()
    if lowered.startswith(("https://", "ssh://", "file://")):
        # ssh://-oProxyCommand=... style: a host or user that ssh would read as an option
        authority = url.split("://", 1)[1].split("/", 1)[0]
        if any(part.startswith("-") for part in re.split(r"[@:\[]", authority)):
            raise SglpatchError(f"invalid upstream url {url!r}: host or user must not start with '-'")
        return url
    if _SCP_RE.match(url):
        return url
    if url.startswith("/"):
        return url
    raise SglpatchError(f"invalid upstream url {url!r}: only https://, ssh://, git@host:path and file:// are accepted")
