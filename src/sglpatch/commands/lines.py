"""`sglpatch lines`: every line the checkout supports (sglpatch.lines), each with its pin, the
patches it carries, what upstream superseded or absorbed of the primary's, what it needs from the
NVIDIA driver (read from the release's own Requires-Dist, in the cache), and its default workdir. It
reads what is on disk and fetches nothing."""

from __future__ import annotations

import re
from pathlib import Path

from sglpatch import cliargs, lines
from sglpatch.errors import SglpatchError
from sglpatch.series import read_patch, read_series

NAME = "lines"
HELP = "list the lines the checkout supports: pin, patches, what upstream superseded, the driver each needs (CUDA 12 / 13)"
_CU = re.compile(r"(\[[^\]]*\bcu(1\d)\b[^\]]*\]|-cu(1\d)\b)")
_MAJOR = re.compile(r"^(cuda-python|cuda-bindings)\s*(==|>=|~=)\s*(\d+)")


def cuda_of(reqs: list[str]) -> tuple[int | None, str]:
    """The CUDA major a release's requirements select, and the requirement that says so: a cuXY extra
    or -cuXY package, or the cuda-python / cuda-bindings pin (their version major is the CUDA major,
    deps/cuda12.toml [major]); the highest wins."""
    best, why = None, ""
    for r in reqs:
        r = r.split(";")[0].strip()
        m = _CU.search(r)
        major = int(m.group(2) or m.group(3)) if m else None
        mm = _MAJOR.match(r)
        if mm:
            major = int(mm.group(3))
        if major is not None and (best is None or major > best):
            best, why = major, r
    return best, why


def driver(line: lines.Line) -> str:
    """What the line's release needs of the driver, read from its artifact when the cache holds it (a
    listing fetches nothing: the 0.5.23 wheel is 39 MB)."""
    from sglpatch.pythonenv import new_venv, preflight
    from sglpatch.upstream import artifacts

    try:
        art = artifacts.cached(line.lock)
        if art is None:
            opt = "" if line.primary else f" --line {line.release}"
            return f"not read: {line.lock.sdist_filename} is not in the cache (`sglpatch apply{opt} --venv NEWDIR --dry-run` fetches it and reads it)"
        _, _, reqs = new_venv.release_metadata(art)
    except (SglpatchError, OSError) as e:
        return f"unknown: the release's Requires-Dist could not be read ({e})"
    major, why = cuda_of(reqs)
    if major is None:
        return "unknown: no requirement of the release names a CUDA major"
    floor = ".".join(map(str, preflight.DRIVER_FLOOR.get(major, ("?",))))
    text = f"CUDA {major}: an NVIDIA driver >= {floor} (Requires-Dist: {why})"
    if major >= 13:
        text += (f"; below that, `sglpatch apply --line {line.release} --venv DIR --dry-run --cuda 12.8` checks for CUDA 12 "
                 "builds (docs/rebase.md, \"CUDA 12 driver\")")
    return text


def dropped(checkout: Path, line: lines.Line) -> list[str]:
    """The primary's patches the line leaves out, each with what upstream has instead: the recorded
    decision (resolutions/R/), the patch's X-Superseded-By, or its Applied-Upstream."""
    from sglpatch.rebase.resolutions import lenient_resolutions

    if line.primary:
        return []
    primary = read_series(checkout)
    keep = set(read_series(line.root).names)
    recs, _ = lenient_resolutions(checkout, line.release)
    out = []
    for entry in primary.entries:
        if entry.name in keep:
            continue
        dep3 = read_patch(checkout, entry).dep3
        rec = recs.get(entry.name)
        if rec is not None and rec.action == "drop":
            why = f"{re.split(r' [(]|; |[.] ', rec.why)[0]} (recorded: resolutions/{line.release}/)"
        elif dep3.get("X-Superseded-By"):
            why = f"superseded by {dep3['X-Superseded-By']}"
        else:
            why = "absorbed upstream" + (f" ({dep3['Applied-Upstream']})" if dep3.get("Applied-Upstream") else "")
        out.append(f"{entry.name}: {why}")
    return out


def run(args) -> int:
    checkout = lines.checkout_of(cliargs.project(args))
    base = cliargs.workdir(args)
    for ln in lines.all_lines(checkout):
        names = lines.carried(ln)
        lock = ln.lock
        print(f"{ln.release}{' (primary)' if ln.primary else ''}: {ln.where}")
        print(f"  pin:      {lock.describe()}, {lock.artifact_kind} {lock.sdist_filename}")
        print(f"  patches:  {len(names)}" + "".join(f"\n    {n}" for n in names))
        gone = dropped(checkout, ln)
        print(f"  upstream: {'nothing of the primary series' if not gone else len(gone)}" + "".join(f"\n    {g}" for g in gone))
        print(f"  driver:   {driver(ln)}")
        wd = lines.default_workdir(base, ln)
        print(f"  workdir:  {wd} (sglpatch apply{'' if ln.primary else ' --line ' + ln.release})")
    return 0


def register(p) -> None:
    cliargs.add_workdir(p)
