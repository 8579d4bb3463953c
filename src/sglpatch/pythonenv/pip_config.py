"""The user's pip configuration, whichever installer runs, and the plan of an install into an
existing Python, shown before anything is installed.

pip reads its configuration itself (pip.conf, PIP_* variables). uv does not: its indexes,
find-links, constraints and no-index setting are handed to uv as options (``uv_args``, the one
translation: the flashinfer set's installs, ``apply --venv``'s resolution and install, and
scripts/test.sh for the test venvs), together with the tool's own indexes where pip's
configuration lets pip search them (``uv_args``' docstring says what wins). The plan is pip's own resolution with that
configuration (``pip --python P install --dry-run --report``: what pip, set up as the user set it
up, would add or change in P), each file's size from the file or the index's answer to a HEAD
request. Installing it exactly (``--no-deps``, the planned pins) makes uv install what pip chose.
Torch is never installed or upgraded here: a plan that would is refused in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch import redact
from sglpatch.errors import SglpatchError
from sglpatch.pythonenv.interpreter import norm_name as norm
from sglpatch.upstream import pkgindex

NEVER = ("torch",)  # an install into the serving Python never installs or upgrades these


def pip_cmd(python: str) -> list[str]:
    """pip for python: its own when it has one, else this one's, run for it (``pip --python``)."""
    if subprocess.run([python, "-m", "pip", "--version"], capture_output=True, cwd="/").returncode == 0:
        return [python, "-m", "pip"]
    return [sys.executable, "-m", "pip", "--python", python]


def config() -> dict[str, list[str]]:
    """pip's settings that decide where packages come from and which versions may come, as pip
    install reads them: {name: values}, a PIP_* variable over [install] over [global]."""
    return pkgindex.pip_settings("install")


def no_index(conf: dict[str, list[str]]) -> bool:
    """pip's no-index setting (PIP_NO_INDEX=1, ``no-index = true`` in pip.conf)."""
    return (conf.get("no-index") or ["0"])[-1].strip().lower() in ("1", "true", "yes", "on", "y", "t")


def _local(value: str) -> str:
    """A find-links or constraint value as uv must get it: a path made absolute (pip reads it from
    the directory the tool was started in; uv may run elsewhere, e.g. cwd=/), a URL as it is."""
    return value if "://" in value else os.path.abspath(os.path.expanduser(value))


def uv_args(conf: dict[str, list[str]] | None = None, indexes: Sequence[str] = (), constraints: bool = True) -> list[str]:
    """pip's configuration as uv options (uv reads none of it), choosing like pip among indexes
    (the best version from any of them); indexes: the tool's own extra indexes (``apply --venv
    --cuda``'s deps/cuda12.toml, the flashinfer set's), which pip would get as --extra-index-url.

    What wins, as for pip with those indexes on its command line:
    - the user's index-url replaces uv's default index (PyPI), as it replaces pip's: given as
      --default-index, which (unlike uv's --index-url) also wins over a UV_DEFAULT_INDEX;
    - the tool's indexes are extra indexes next to the user's extra-index-url ones (listed first:
      uv takes a tie from the first index), every one searched, none replacing the user's;
    - the user's no-index wins over every index, the tool's included: pip's --no-index ignores the
      --extra-index-url on its own command line too, so only find-links (and constraints) are handed
      over, and a --cuda build must then lie in a find-links folder;
    - find-links and constraints always apply; constraints=False leaves the constraints out for an
      install from a resolved lock (pylock.toml: uv refuses constraints there, the lock obeyed them).
    Where pip's configuration says nothing, uv's own (UV_*, uv.toml) stays in force."""
    conf = config() if conf is None else conf
    offline = no_index(conf)
    args = [] if offline else [a for v in conf.get("index-url", [])[-1:] for a in ("--default-index", v)]
    if not offline:
        args += [a for v in [*indexes, *conf.get("extra-index-url", [])] for a in ("--extra-index-url", v)]
    args += [a for v in conf.get("find-links", []) for a in ("--find-links", _local(v))]
    if constraints:
        args += [a for v in conf.get("constraint", []) for a in ("--constraints", _local(v))]
    if offline:
        args.append("--no-index")
    return args + ["--index-strategy", "unsafe-best-match"]


def describe(conf: dict[str, list[str]], indexes: Sequence[str] = ()) -> str:
    """Where packages come from, as uv_args hands it on (credentials masked)."""
    offline = no_index(conf)
    names = ("find-links", "constraint") if offline else ("index-url", "extra-index-url", "find-links", "constraint")
    parts = [f"{name} {' '.join(conf[name])}" for name in names if conf.get(name)]
    if offline:
        parts.append("no-index (no index searched" + (f", not the tool's {' '.join(indexes)} either)" if indexes else ")"))
    elif indexes:
        parts.append(f"the tool's extra-index-url {' '.join(indexes)}")
    return redact.url("; ".join(parts) if parts else "pip's defaults")


@dataclass
class Item:
    name: str
    version: str
    old: str | None  # the version python has now, None when it is added
    url: str
    size: int | None = None


@dataclass
class InstallPlan:
    python: str
    items: list[Item] = field(default_factory=list)
    removed: list[tuple[str, str, str]] = field(default_factory=list)  # (name, version, why)

    @property
    def pins(self) -> list[str]:
        return [f"{i.name}=={i.version}" for i in self.items]

    def lines(self, what: str) -> list[str]:
        added = [i for i in self.items if i.old is None]
        sizes = [i.size for i in self.items]
        total = sum(s for s in sizes if s is not None) / 2**20
        known = "" if None not in sizes else f" (size unknown for {sizes.count(None)})"
        out = [f"{what}: plan for {self.python} (pip's resolution with your pip configuration): {len(added)} to add, "
               f"{len(self.items) - len(added)} to change, {len(self.removed)} to remove, {total:.1f} MiB to download{known}"]
        for i in self.items:
            head = f"  + {i.name}=={i.version}" if i.old is None else f"  ~ {i.name} {i.old} -> {i.version}"
            out.append(f"{head:<52} " + (f"{i.size / 2**20:7.1f} MiB" if i.size is not None else "      ? MiB"))
        out += [f"  - {name} {version} ({why})" for name, version, why in self.removed]
        return out


def size(url: str) -> int | None:
    """A file's size: a local file's, else what the server answers to HEAD; None when it does not say."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = Path(urllib.parse.unquote(parts.path))
        return path.stat().st_size if path.is_file() else None
    if parts.scheme not in ("http", "https") or parts.username:
        return None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15) as resp:
            n = resp.headers.get("Content-Length")
            return int(n) if n and n.isdigit() else None
    except (OSError, ValueError):
        return None


def plan(python: str, reqs: list[str], have: dict[str, str], extra_index: str = "", what: str = "install") -> InstallPlan:
    """pip's resolution of reqs for python with the user's configuration (nothing installed), as a
    plan with sizes; one line when pip cannot resolve them."""
    extra = ["--extra-index-url", extra_index] if extra_index else []
    cmd = [*pip_cmd(python), "install", "--dry-run", "-q", "--disable-pip-version-check", "--report", "-", *extra, *reqs]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/")
    if proc.returncode != 0:
        why = " ".join(ln.strip() for ln in proc.stderr.splitlines() if ln.strip().startswith("ERROR"))
        raise SglpatchError(f"{what}: pip cannot resolve {' '.join(reqs)} for {python} with your pip configuration: "
                            f"{(why or proc.stderr.strip() or 'no reason given')[:500]}; nothing was installed")
    try:
        report = json.loads(proc.stdout[proc.stdout.index("{"):])
        items = [Item(norm(i["metadata"]["name"]), str(i["metadata"]["version"]), None, i["download_info"]["url"])
                 for i in report.get("install", [])]
    except (ValueError, KeyError, TypeError) as e:
        raise SglpatchError(f"{what}: pip's --report for {python} is not what pip writes ({e}); nothing was installed")
    for i in items:
        i.old = have.get(i.name)
    with ThreadPoolExecutor(max_workers=8) as pool:
        for i, n in zip(items, pool.map(size, [i.url for i in items])):
            i.size = n
    return InstallPlan(python, items)


def refuse_never(p: InstallPlan, what: str, why: str) -> None:
    """One line when the plan installs or upgrades a package of NEVER (why: what asks for it)."""
    for i in p.items:
        if i.name in NEVER:
            now = f"has {i.name} {i.old}" if i.old else f"has no {i.name}"
            raise SglpatchError(
                f"{what}: the set needs {i.name} {i.version} and {p.python} {now}: {why} never installs or upgrades {i.name}; "
                f"install the {i.name} you serve with into {p.python} first (one the set accepts), then re-run; nothing was installed")


def install_cmd(python: str, uv: str | None, pins: list[str], extra_index: str = "") -> list[str]:
    """The command that installs exactly pins (a plan's: --no-deps) into python with the user's
    configuration: uv gets pip's as options, pip reads its own."""
    if uv:
        return [uv, "pip", "install", "--python", python, *uv_args(indexes=[extra_index] if extra_index else []), "--no-deps", *pins]
    extra = ["--extra-index-url", extra_index] if extra_index else []
    return [*pip_cmd(python), "install", "--disable-pip-version-check", *extra, "--no-deps", *pins]

