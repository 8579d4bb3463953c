"""The JIT build check's verdicts, kept (sglpatch.pythonenv.jit_kernels): a pass or a "does not build"
holds while the tree, flashinfer, nvcc and the arch are the same, so `apply --with-flashinfer` and
the doctor build the kernels once, not on every call (about 20 s each).

One JSON file in the tool's cache folder, ``$SGLPATCH_CACHE/jit-kernels.json`` (else
``$XDG_CACHE_HOME/sglpatch``, ``~/.cache/sglpatch``), written atomically; read as untrusted input: a
file that is not this one's shape (garbage, another tool's, a link) is not read, and the next
write replaces it, never what a link points at. The key (``key``): the serving Python, where its
sglang is, the tree's commit and a digest of its jit_kernel sources, the flashinfer-python and
apache-tvm-ffi versions, the nvcc and its release, the arch. ``--recheck-jit`` or
``SGLPATCH_RECHECK_JIT=1`` builds again (and keeps the new verdict).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

NAME = "jit-kernels.json"
SCHEMA = "sglpatch.jit-kernels/1"
KEEP = 64  # entries, the newest kept
MAX_BYTES = 1 << 20
STATES = ("ok", "fail")
SOURCES = (".py", ".cuh", ".cu", ".h", ".hpp", ".cpp")
_FACTS = ("import importlib.metadata as m, importlib.util as u, json, os\n"
          "def v(n):\n    try:\n        return m.version(n)\n    except Exception:\n        return None\n"
          "s = u.find_spec('sglang')\n"
          "print(json.dumps({'sglang': os.path.dirname(s.origin) if s and s.origin else None,\n"
          "                  'flashinfer': v('flashinfer-python'), 'tvm_ffi': v('apache-tvm-ffi')}))\n")


def recheck_asked() -> bool:
    return os.environ.get("SGLPATCH_RECHECK_JIT", "") not in ("", "0")


def _file() -> Path:
    from sglpatch.upstream.cachedir import cache_dir

    return cache_dir() / NAME


def _commit(tree: Path) -> str:
    """The commit of the git work tree holding tree ("" when none, or no GitPython here)."""
    top = next((d for d in (tree, *tree.parents) if (d / ".git").exists()), None)
    if top is None:
        return ""
    try:
        from sglpatch.errors import SglpatchError
        from sglpatch.gitcmd import Git

        return Git(top).rev("HEAD") or ""
    except (ImportError, SglpatchError, OSError):
        return ""


def _digest(jit_kernel: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(jit_kernel.rglob("*")):
        if p.suffix in SOURCES and p.is_file():
            h.update(str(p.relative_to(jit_kernel)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def key(python: str, arch: str, nvcc: str, release: str, env: dict) -> dict | None:
    """What the verdict depends on; None when the serving Python does not say where its sglang is."""
    try:
        p = subprocess.run([python, "-c", _FACTS], capture_output=True, text=True, timeout=120, env=env, cwd="/",
                           stdin=subprocess.DEVNULL)
        facts = json.loads((p.stdout.strip().splitlines() or ["null"])[-1])
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if not isinstance(facts, dict) or not isinstance(facts.get("sglang"), str):
        return None
    sglang = Path(facts["sglang"]).resolve()
    try:
        digest = _digest(sglang / "jit_kernel")
    except OSError:
        return None
    return {"python": os.path.abspath(python), "sglang": str(sglang), "tree": _commit(sglang), "sources": digest,
            "flashinfer": facts.get("flashinfer"), "tvm_ffi": facts.get("tvm_ffi"), "nvcc": nvcc, "release": release,
            "arch": arch}


def _id(k: dict) -> str:
    return hashlib.sha256(json.dumps(k, sort_keys=True).encode()).hexdigest()


def _entries() -> dict:
    """The file's entries, {} when it is missing or not what this module writes."""
    from sglpatch.errors import SglpatchError
    from sglpatch.fsutil import open_regular

    try:
        with open_regular(_file()) as f:
            raw = f.read(MAX_BYTES + 1)
        data = json.loads(raw) if len(raw) <= MAX_BYTES else None
    except (OSError, SglpatchError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
        return {}
    return {i: e for i, e in data["entries"].items() if _valid(i, e)}


def _valid(i, e) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("key"), dict) and i == _id(e["key"]) and e.get("state") in STATES
            and isinstance(e.get("text"), str) and "\n" not in e["text"] and len(e["text"]) < 4000
            and isinstance(e.get("when"), (int, float)) and isinstance(e.get("data", {}), dict))


def get(k: dict) -> dict | None:
    """The kept verdict for k: {state, text, data, when}, or None."""
    e = _entries().get(_id(k))
    return e if e is not None and e["key"] == k else None


def put(k: dict, state: str, text: str, data: dict) -> None:
    """Keep a verdict for k (a pass or a "does not build"): a new file renamed over the old one (over a
    link, not through it); a cache that cannot be written is passed over."""
    entries = _entries()
    entries[_id(k)] = {"key": k, "state": state, "text": text, "data": data, "when": time.time()}
    newest = dict(sorted(entries.items(), key=lambda ie: ie[1]["when"])[-KEEP:])
    path = _file()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{NAME}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"schema": SCHEMA, "entries": newest}, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError:
        if tmp:
            Path(tmp).unlink(missing_ok=True)


def when(e: dict) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(e["when"]))
