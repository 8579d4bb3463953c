"""The watch's matrix: one row per release after the pin, one cell per patch (the classification
is rebase's own, ``classify.classify``; "superseded" is the ``X-Superseded-By`` probe's, watch.supersede),
each release's dependency pins, and the newest release of each pinned dependency with what it
changes of what the release uses (watch.depwatch). Trees come from the tree cache
(``sglpatch.upstream.treecache``); a release classified before with the same inputs is read back from its facts."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglpatch.upstream import artifacts, pkgindex, treecache
from sglpatch import exitcodes
from sglpatch.rebase import classify, outcome
from sglpatch.stack import build
from sglpatch.upstream import materialize as up
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import private_tmpdir
from sglpatch.gitcmd import Git
from sglpatch.upstream.pin import UNKNOWN_COMMIT, Lock
from sglpatch.project import Project
from sglpatch.rebase.outcome import Action, Status
from sglpatch.rebase.resolutions import lenient_resolutions
from sglpatch.watch import depwatch, supersede

DEPS = ("torch", "flashinfer-python", "sgl-kernel", "sglang-kernel", "transformers")
VERDICT = {"nothing": "nothing to do", "unattended": "rebase does it unattended", "human": "NEEDS A HUMAN"}


@dataclass
class Cell:
    status: Status
    text: str  # the words the issue uses
    details: list[str] = field(default_factory=list)
    needs_human: bool = False


@dataclass
class Row:
    version: str
    source: str
    artifact: str
    sha256: str
    commit: str
    cells: dict[str, Cell]
    deps: dict[str, str]
    verdict: str  # nothing | unattended | human


def _release_lock(current: Lock, version: str, art: pkgindex.Artifact, commit: str) -> Lock:
    return Lock(name=current.name, url=current.url, tag=f"v{version}", commit=commit or UNKNOWN_COMMIT, version=version,
                sdist_filename=art.filename, sdist_sha256=art.sha256, sdist_subdir=current.sdist_subdir)


# --------------------------------------------------------------------------------------
# dependency pins


def dep_pins(path: Path, version: str, name: str = "sglang") -> dict[str, str]:
    meta = artifacts.metadata(path)
    return pins(meta.get_all("Requires-Dist") or [], meta.get("Requires-Python", "") or "", version, name)


def pins(requires_dist: list[str], requires_python: str, version: str, name: str = "sglang") -> dict[str, str]:
    """The dependency pins the watch shows, from the release's core metadata and the index."""
    out: dict[str, str] = {}
    for req in requires_dist:
        if "extra ==" in req:
            continue
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*(.*)$", req)
        dist = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        if dist in DEPS:
            out[dist] = (m.group(3).split(";")[0].strip().strip("()") or "any")
    out["python"] = requires_python or "?"
    tags = sorted({a.filename[:-4].split("-")[-3] for a in pkgindex.index_files(name) if a.version == version and a.kind == "wheel"})
    out["tags"] = ",".join(tags) or "-"
    return out


# --------------------------------------------------------------------------------------
# the matrix


def _cell(o: outcome.Outcome, version: str) -> Cell:
    if o.action == Action.RECORDED:
        return Cell(Status.RECORDED, f"resolved (recorded for {o.how.split('/')[1] if '/' in o.how else version})", [o.how])
    details = list(o.hunks) or list(o.files)
    if o.status == Status.EXACT:
        return Cell(Status.EXACT, "applies exactly")
    if o.status == Status.THREE_WAY:
        return Cell(Status.THREE_WAY, "3-way clean")
    if o.status == Status.BROKEN:
        return Cell(Status.BROKEN, o.how, details, True)
    if o.status == Status.UPSTREAM:
        return Cell(Status.UPSTREAM, "already upstream", [o.how])
    if o.status == Status.OBSOLETE:
        return Cell(Status.OBSOLETE, "target file gone", details, o.action == Action.STOP)
    text = f"conflict ({', '.join(o.files)})"
    if o.note:
        details.append(o.note)
    return Cell(Status.CONFLICT, text, details, o.action == Action.STOP)


def newer_than_pins(project_root: Path, project: Project, cg: Git, item: tuple, deps: dict[str, str]) -> tuple[dict, list[dict]]:
    """The newest release of each pinned dependency, and for deps/newer.toml's packages what it
    changes of what the release (item: the newest watched one) uses."""
    newest = {}
    for d in DEPS:  # a side column: an index that does not answer for one of them costs only its cell
        try:
            vs = pkgindex.releases(d)
        except pkgindex.ArtifactError as e:
            say(f"newest release of {d} unknown: {e}")
            vs = []
        newest[d] = vs[-1] if vs else "?"
    out = []
    table = depwatch.load(project_root)
    relied = depwatch.series_files(project_root, project, item[0]) if table else set()
    for dist, cfg in table.items():
        spec = deps.get(dist)
        pinned = supersede.pinned_version(spec, dist) if spec else None
        if not pinned or newest.get(dist, pinned) in (pinned, "?"):
            continue
        say(f"{dist} {newest[dist]} is newer than sglang {item[0]}'s {spec}: checking what it changes ({cfg['module']})")
        changes = depwatch.check(dist, cfg, pinned, newest[dist], cg, item[3], relied)
        out.append({"dist": dist, "release": item[0], "pin": spec, "pinned": pinned, "newest": newest[dist], "why": cfg["why"], "changes": changes})
    return newest, out


def _parse_range(spec: str | None, name: str, pinned: str) -> list[str]:
    """None: every release after the pin; "A..B": the releases from A to B (either side may be
    empty); "A,B,C": exactly these (each item may itself be a range), ascending, once each."""
    if not spec:
        return pkgindex.releases(name, after=pinned)
    from packaging.version import InvalidVersion, Version

    from sglpatch.rebase.target import no_release

    if "," in spec:
        out = {v for part in spec.split(",") if part.strip() for v in _parse_range(part.strip(), name, pinned)}
        return sorted(out, key=Version)
    if ".." not in spec:
        if spec not in {a.version for a in pkgindex.index_files(name)}:  # a usage error, as `rebase --onto` says it
            raise no_release(name, spec, f"--releases {spec}: not a release of {name} on the index")
        return [spec]
    a, b = spec.split("..", 1)
    try:
        if a and b and Version(a) > Version(b):
            raise SglpatchError(f"--releases {spec}: {a} comes after {b} (the range is inclusive, oldest first): "
                                f"did you mean {b}..{a}?", exitcodes.USAGE)
    except InvalidVersion:
        raise SglpatchError(f"--releases {spec}: not a version range (A..B, e.g. 0.5.10..0.5.12)", exitcodes.USAGE) from None
    return pkgindex.releases(name, first=a or None, upto=b or None, after=None if a else pinned)


def _classify(items: list[tuple]) -> list[Row]:
    """Rows for items (version, kind, artifact, tree commit, metadata) in the scratch repository
    of _CTX; runs in a worker process (its own Git, so its own cat-file) or in this one."""
    c = _CTX
    sg, lock, project = Git(c["scratch"]), c["project"].lock, c["project"]
    rows = []
    for v, kind, art, onto, meta in items:
        new_lock = _release_lock(lock, v, art, meta["commit"])
        key = hashlib.sha256(f"{c['inputs']} {v} {kind} {art.sha256} {meta['commit']} {sg.tree_of(onto)}".encode()).hexdigest()
        done = {} if c["recheck"] else treecache.load_facts("outcomes", key)
        if "outcomes" in done:
            lenient_resolutions(c["root"], v)  # an unreadable folder says so, as when it was classified
            outcomes = [outcome.Outcome(**d) for d in done["outcomes"]]
        else:
            outcomes = classify.classify(sg, c["root"], c["old_base"], c["old_commits"], new_lock, onto, kind)
            treecache.save_facts("outcomes", key, {"outcomes": [asdict(o) for o in outcomes]})
        deps = pins(meta["requires_dist"], meta["requires_python"], v, lock.name)
        cells = {}
        for o, patch in zip(outcomes, project.patches):
            cell = _cell(o, v)
            sup = supersede.probe(sg, onto, patch, deps)
            if sup and sup.holds:
                how = f"superseded by upstream: {sup.evidence}" + (f"; {sup.switch}" if sup.switch else "")  # P6: nothing to switch
                cell = Cell(Status.SUPERSEDED, how, [cell.text] + cell.details, False)
            elif sup and sup.evidence:
                cell.details.append(f"not superseded: {sup.evidence}")
            cells[o.name] = cell
        human = any(x.needs_human for x in cells.values())
        verdict = "human" if human else ("nothing" if all(x.status == Status.EXACT for x in cells.values()) else "unattended")
        rows.append(Row(v, kind, art.filename, art.sha256, new_lock.commit, cells, deps, verdict))
        say(f"{lock.name} {v}: {VERDICT[verdict]}")
    return rows


_CTX: dict = {}


def _inputs(project_root: Path, project: Project, old_base: str, old_commits: list[str], git: Git) -> str:
    """Everything a release's classification depends on besides the release's own tree: the
    series and its patches, the recorded resolutions, the old stack, and the code that
    classifies (sglpatch's own sources, pyflakes, Python, git). A run with the same inputs
    on the same tree finds what an earlier one found (kept in the tree cache's facts)."""
    import pyflakes

    h = hashlib.sha256()
    here = Path(__file__).parents[1]  # the sglpatch package
    for f in sorted(here.rglob("*.py")):  # its subpackages too (sglpatch.rebase, sglpatch.watch)
        h.update(str(f.relative_to(here)).encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(f"{pyflakes.__version__} {sys.version} {git.run('version')}\0".encode())
    h.update((project_root / "series").read_bytes() + b"\0")
    for p in project.patches:
        h.update(p.name.encode() + b"\0" + p.data + b"\0")
    res = project_root / outcome.RESOLUTIONS_DIR
    for f in sorted(res.rglob("*")) if res.is_dir() else []:
        if f.is_file():
            h.update(str(f.relative_to(res)).encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(" ".join([git.tree_of(old_base)] + [git.tree_of(c) for c in old_commits]).encode())
    return h.hexdigest()


def default_jobs() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def run(project_root: Path, releases: str | None = None, jobs: int | None = None, recheck: bool = False) -> dict:
    """The matrix. Trees come first, one release after the other (downloads, unpacking); then
    the releases are classified in `jobs` worker processes (default: the CPUs, at most 4),
    each taking a run of consecutive releases (they share most files, so their checks share
    what they find). A release classified before with the same inputs (see _inputs) is not
    classified again unless recheck."""
    return treecache.healing(_run, project_root, releases, jobs, recheck)  # a damaged cached object: once more


def _run(project_root: Path, releases: str | None, jobs: int | None, recheck: bool) -> dict:
    project_root = Path(project_root).resolve()
    project = Project.load(project_root)
    lock = project.lock
    versions = _parse_range(releases, lock.name, lock.version)
    if not versions:
        raise SglpatchError(f"no releases of {lock.name} after {lock.version} on the index" if not releases else f"no release matches {releases}")
    t0 = time.monotonic()
    cg = treecache.cache_repo()
    _, old_base, pin_meta = treecache.release_tree(cg, lock.name, lock.version, lock.artifact_kind, lock.sdist_subdir, lock.sdist_sha256)
    up.verify_blobs(cg, old_base, lock, "registry")
    pinned_deps = pins(pin_meta["requires_dist"], pin_meta["requires_python"], lock.version, lock.name)
    items = []
    for k, v in enumerate(versions, 1):
        kind = "sdist" if "sdist" in pkgindex.kinds_offered(lock.name, v) else "wheel"
        say(f"[{k}/{len(versions)}] {lock.name} {v} ({kind})")
        art, onto, meta = treecache.release_tree(cg, lock.name, v, kind, lock.sdist_subdir)
        items.append((v, kind, art, onto, meta))
    jobs = max(1, min(jobs or default_jobs(), len(items)))
    say(f"classifying {len(items)} release(s) of {lock.name}" + (f" in {jobs} processes" if jobs > 1 else ""))
    with private_tmpdir("watch") as tmp:
        sg = Git(Path(tmp))
        sg.run("init", "-q", "--bare")
        treecache.borrow(sg, cg)
        old_commits = build.build_chain(sg, project, old_base, progress=False)
        _CTX.update(scratch=tmp, root=project_root, project=project, old_base=old_base, old_commits=old_commits, recheck=recheck,
                    inputs=_inputs(project_root, project, old_base, old_commits, sg))
        try:
            if jobs == 1:
                rows = _classify(items)
            else:
                chunks = [items[len(items) * i // jobs : len(items) * (i + 1) // jobs] for i in range(jobs)]
                with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
                    rows = [r for part in pool.map(_classify, chunks) for r in part]
        finally:
            _CTX.clear()
    newest_deps, newer = newer_than_pins(project_root, project, cg, items[-1], rows[-1].deps)
    return {
        "pinned": {"version": lock.version, "artifact": lock.sdist_filename, "deps": pinned_deps},
        "patches": [e.name for e in project.series.entries],
        "rows": [asdict(r) for r in rows],
        "newest": versions[-1],
        "newest_verdict": rows[-1].verdict,
        "newest_deps": newest_deps,
        "newer": newer,
        "seconds": round(time.monotonic() - t0, 1),
    }
