"""A real rebase's state in DIR/.git/sglpatch-rebase/: the plan (state.json), where DIR and the
project were before (orig.json), the project's files before (project/), and the journal of what
the finishing step wrote in the project (written.json), which is what --abort undoes. Where the
folder is, and whether a rebase is in progress (state.json is there), is sglpatch.workdir's.

    state.json     the Plan, saved after every step (--continue goes on from it); its "format"
                   (rebase_plan_file.PLAN_FORMAT, now 1) must be this sglpatch's, else it is refused
    orig.json      DIR's branch, HEAD, upstream, patched, applied record, and the project path
    project/       manifest.json + files/: the project files the rebase may write, as they were
    written.json   {path: sha256 written | null (removed)}, each entry recorded before the write
    abort.started  written before --abort resets anything: a killed abort is finished by --abort,
                   never continued (--continue / --skip / a new rebase say so)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict
from pathlib import Path

from sglpatch.fsutil import inside, read_journal, write_if_changed
from sglpatch.gitcmd import Git
from sglpatch import rebase_plan_file
from sglpatch.rebase.outcome import CHANGELOG, REPORTS_DIR, RESOLUTIONS_DIR
from sglpatch.rebase_plan_file import Plan, RebaseError
from sglpatch.series import PATCH_DIR, SERIES_NAME
from sglpatch.workdir import REBASE_STATE_FILE, rebase_state_dir

def journal_file(git: Git) -> Path:
    return rebase_state_dir(git) / "written.json"


def save(git: Git, plan: Plan) -> None:
    write_if_changed(rebase_state_dir(git) / REBASE_STATE_FILE, json.dumps(asdict(plan), indent=1, sort_keys=True).encode())


def load(git: Git) -> Plan:
    return rebase_plan_file.load(rebase_state_dir(git) / REBASE_STATE_FILE, git.workdir)


ABORT_MARK = "abort.started"  # written before --abort moves anything; the folder goes last


def mark_abort(git: Git) -> None:
    write_if_changed(rebase_state_dir(git) / ABORT_MARK, b"an --abort began; --abort again finishes it\n")


def abort_started(git: Git) -> bool:
    return (rebase_state_dir(git) / ABORT_MARK).is_file()


# --------------------------------------------------------------------------------------
# where DIR and the project were


def save_orig(git: Git, orig: dict, project_root: Path) -> None:
    write_if_changed(rebase_state_dir(git) / "orig.json", json.dumps({"orig": orig, "project": str(project_root)}, indent=1).encode())


def _orig_problem(orig) -> str | None:
    """Why orig (where DIR's refs were) is not the record save_orig writes, or None."""
    if not isinstance(orig, dict):
        return "not a JSON object"
    for key in ("head", "upstream", "patched"):
        if not (isinstance(orig.get(key), str) and re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", orig[key])):
            return f"no commit id under {key!r}"
    if orig.get("branch") is not None and not isinstance(orig["branch"], str):
        return "'branch' is not a name"
    return None


def load_orig(git: Git) -> tuple[dict, Path]:
    """(orig, project) for --abort: from orig.json, which a damaged state.json does not touch;
    refused in one line (nothing changed) when neither says where DIR's branches were."""
    f = rebase_state_dir(git) / "orig.json"
    why = "missing"
    try:
        data = json.loads(f.read_text())
        if not (isinstance(data, dict) and isinstance(data.get("project"), str)):
            why = "not the record sglpatch writes"
        elif not (why := _orig_problem(data.get("orig"))):
            return data["orig"], Path(data["project"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        why = str(e)
    try:
        plan = load(git)  # a rebase started by an older sglpatch: orig is in its state
        bad = _orig_problem(plan.orig) or (None if plan.project else "no project path")
    except RebaseError:
        bad = f"{REBASE_STATE_FILE} is damaged too"
    if bad:
        raise RebaseError(
            f"cannot abort the rebase in {git.workdir}: {f} is damaged ({why}) and cannot be stood in for ({bad}), so where the "
            f"branches were is lost; nothing was changed: find them in `git -C {git.workdir} reflog`, reset them by hand, "
            f"then delete {f.parent}"
        )
    return plan.orig, Path(plan.project)


def check_abortable(git: Git, project: Path, here: Path | None) -> None:
    """What --abort restores from, checked before it moves anything: the project is the one this
    command runs in (here, when known) and a project at all, the snapshot of its files is whole,
    and every journal entry names a path inside it."""
    wd, folder = git.workdir, rebase_state_dir(git)
    if here is not None and os.path.realpath(here) != os.path.realpath(project):
        raise RebaseError(f"the rebase in {wd} was started from the project {project}, not {here}: nothing was changed; "
                          f"run the abort there (--project {project})")
    if not ((project / SERIES_NAME).is_file() and (project / "upstream.lock").is_file()):
        raise RebaseError(f"{folder}/orig.json names {project} as the project, which is not an sglpatch project (no "
                          f"series + upstream.lock): nothing was changed; run the abort from the project the rebase started in")
    snap = folder / "project"
    try:
        manifest = json.loads((snap / "manifest.json").read_text())
        missing = [rel for rel in manifest["present"] if not (snap / "files" / rel).is_file()]
        if missing or not all(isinstance(manifest[k], list) for k in ("files", "dirs", "present")):
            raise ValueError(f"{missing[0]} is missing" if missing else "not the record sglpatch writes")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RebaseError(
            f"cannot abort the rebase in {wd}: the snapshot of the project's files {snap} is damaged or gone "
            f"({getattr(e, 'strerror', None) or e}); nothing was changed: restore {project}'s series, patches/ and "
            f"upstream.lock from your own copy, then delete {folder}"
        ) from None
    for rel in read_journal(journal_file(git)):
        if not rel or os.path.isabs(rel) or ".." in Path(rel).parts:
            raise RebaseError(f"{journal_file(git)} is damaged: its entry {rel!r} is not a path inside the project; "
                              "nothing was changed: remove that entry and re-run")


# --------------------------------------------------------------------------------------
# the project: what the rebase may write, checked before anything moves; snapshot and restore


def managed_paths(version: str, report_name: str, dest: str = "") -> tuple[list[str], list[str]]:
    """The files and folders the finishing step may write; dest: the line folder ("" the primary)."""
    at = f"{dest}/" if dest else ""
    return ([f"{at}{SERIES_NAME}", f"{at}upstream.lock", f"{at}{CHANGELOG}"],
            [f"{at}{PATCH_DIR}", f"{RESOLUTIONS_DIR}/{version}", f"{REPORTS_DIR}/{report_name}"])


def check_project(project_root: Path, dirs: list[str]) -> None:
    """Every folder the rebase writes in stays inside the project and can be written: checked
    before a branch moves, so that a read-only or linked-away project stops nothing half-way."""
    for rel in dirs:
        path = project_root / rel
        inside(project_root, path, f"{project_root}/{rel}")
        probe = path
        while not probe.exists() and probe != project_root:
            probe = probe.parent
        try:
            fd, tmp = tempfile.mkstemp(prefix=".sglpatch-probe-", dir=probe)
            os.close(fd)
            os.unlink(tmp)
        except OSError as e:
            raise RebaseError(
                f"cannot write in {probe} ({e.strerror}); the rebase writes the project {project_root} when it ends: "
                "make it writable and re-run (no branch was moved)"
            ) from None


def _files_under(project_root: Path, rel: str) -> list[str]:
    root = project_root / rel
    if not root.is_dir() or root.is_symlink():
        return []
    return sorted(str(p.relative_to(project_root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def snapshot(git: Git, project_root: Path, version: str, report_name: str, dest: str = "") -> None:
    import shutil

    snap = rebase_state_dir(git) / "project"
    if snap.exists():
        shutil.rmtree(snap)
    snap.mkdir(parents=True)
    files, dirs = managed_paths(version, report_name, dest)
    present = [rel for rel in files if (project_root / rel).is_file() and not (project_root / rel).is_symlink()]
    folders = set()
    for d in dirs:
        present += _files_under(project_root, d)
        for p in (project_root / d, *(project_root / d).parents):
            if p.is_dir() and p != project_root and p.is_relative_to(project_root):
                folders.add(str(p.relative_to(project_root)))
        if (project_root / d).is_dir():
            folders.update(str(p.relative_to(project_root)) for p in (project_root / d).rglob("*") if p.is_dir())
    for rel in present:
        dest = snap / "files" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project_root / rel, dest)
    manifest = {"files": files, "dirs": dirs, "present": present, "folders": sorted(folders)}
    (snap / "manifest.json").write_text(json.dumps(manifest))


def restore(git: Git, project_root: Path) -> list[str]:
    """Undo what the rebase wrote in the project (its journal), byte for byte, and nothing else:
    returns what of the user's it kept (added or changed during the rebase), one entry each."""
    import shutil

    snap = rebase_state_dir(git) / "project"
    manifest = json.loads((snap / "manifest.json").read_text())
    present = set(manifest["present"])
    written = read_journal(journal_file(git))
    kept = []
    for rel, digest in sorted(written.items()):
        path = project_root / rel
        inside(project_root, path.parent)
        old = (snap / "files" / rel).read_bytes() if rel in present else None
        cur = path.read_bytes() if path.is_file() else None
        if cur == old:
            continue
        if cur is not None and (digest is None or hashlib.sha256(cur).hexdigest() != digest):
            kept.append(f"{rel} (changed after the rebase wrote it: kept as it is)")
        elif old is None:
            path.unlink()
        else:
            write_if_changed(path, old)
            shutil.copystat(snap / "files" / rel, path)
    folders = set(manifest.get("folders", []))
    for rel in sorted(written, key=lambda r: -r.count("/")):  # the folders the rebase made, now empty
        for p in (project_root / rel).parents:
            if p == project_root or str(p.relative_to(project_root)) in folders or not p.is_dir() or any(p.iterdir()):
                break
            p.rmdir()
    for rel in manifest["files"] + [f for d in manifest["dirs"] for f in _files_under(project_root, d)]:
        if rel in written or not (project_root / rel).is_file():
            continue
        if rel not in present:
            kept.append(f"{rel} (added)")
        elif (project_root / rel).read_bytes() != (snap / "files" / rel).read_bytes():
            kept.append(f"{rel} (changed)")
    kept += [f"{rel} (deleted)" for rel in sorted(present - set(written)) if not (project_root / rel).exists()]
    return sorted(set(kept))
