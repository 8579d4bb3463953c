"""The lines the checkout supports, side by side: the primary (``series``, ``patches/``,
``upstream.lock`` at the top: what the container runs) and one folder per newer release under
``lines/<release>/`` holding the same three things for that release. ``sglpatch rebase --onto R``
writes ``lines/R/`` (the primary is rewritten only with ``--promote``); ``resolutions/R/`` stays
the rebase's replay input, ``lines/R/`` is its result. A line folder is a project root of its own
(sglpatch.project reads it like the primary); the checkout's other files (``deps/``,
``resolutions/``, ``targets/``) are read from the checkout above it.

Each line builds into a workdir of its own: the primary into ``$SGLANG_FORK_DIR`` or
``~/sglang-fork``, release R into that path with ``-R`` appended (an explicit ``--workdir`` is
taken as given). Which line a workdir holds is read from its upstream pin."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sglpatch import exitcodes, linepath
from sglpatch.errors import SglpatchError
from sglpatch.fsutil import inside, write_if_changed
from sglpatch.upstream.pin import LOCK_NAME, Lock, read_lock
from sglpatch.project import LINES_DIR, checkout_of
from sglpatch.series import SERIES_NAME, patch_path, read_series

_RELEASE = linepath.RELEASE


@dataclass
class Line:
    release: str
    root: Path  # the project root of the line: the checkout for the primary, else lines/<release>
    primary: bool
    lock: Lock

    @property
    def where(self) -> str:
        return "series, patches/, upstream.lock" if self.primary else f"{LINES_DIR}/{self.release}/"


def dest(release: str) -> str:
    """Where `rebase --onto release` writes the line, relative to the checkout."""
    if not _RELEASE.match(release or ""):
        raise SglpatchError(f"line {release!r}: not a release version (e.g. 0.5.23)", exitcodes.USAGE)
    return f"{LINES_DIR}/{release}"


def all_lines(checkout: Path, damaged: list[str] | None = None) -> list[Line]:
    """The primary first, then lines/<R>/ in version order; a folder that is not a line (no lock or
    series, a link, a name that is no release) is left out. A damaged line folder raises, unless
    damaged is a list: then it is left out and its one-line error appended there (for a command
    that only lists the lines, e.g. watch)."""
    checkout = Path(checkout)
    out = [Line(read_lock(checkout).version, checkout, True, read_lock(checkout))]
    base = checkout / LINES_DIR
    if base.is_dir() and not base.is_symlink():
        found = []
        for d in base.iterdir():
            if d.is_symlink() or not d.is_dir() or not _RELEASE.match(d.name):
                continue
            if not ((d / LOCK_NAME).is_file() and (d / SERIES_NAME).is_file()):
                continue
            try:
                found.append(_line_at(checkout, d))
            except SglpatchError as e:
                if damaged is None:
                    raise
                damaged.append(str(e))
        out += sorted(found, key=lambda ln: _vkey(ln.release))
    return out


def _line_at(checkout: Path, d: Path) -> Line:
    inside(checkout, d)
    lock = read_lock(d)
    if lock.version != d.name:
        raise SglpatchError(f"{d}/{LOCK_NAME} pins {lock.version}, not the line's release {d.name}; re-run "
                            f"`sglpatch rebase --onto {d.name}`")
    return Line(d.name, d, False, lock)


def _vkey(v: str):
    """PEP 440 order: 0.5.23rc1 < 0.5.23 < 0.5.23.post1."""
    from packaging.version import Version

    return Version(v)


def at(root: Path) -> Line:
    """The line whose project root is root (the checkout: the primary; lines/R: R), read from root
    alone: a damaged line folder elsewhere does not stop it."""
    root = Path(root)
    lock = read_lock(root)
    return Line(lock.version, root, checkout_of(root) == root, lock)


def find(checkout: Path, release: str | None) -> Line:
    """The line of release (None: the primary); an unknown one is a usage error naming those there are."""
    lines = all_lines(checkout, damaged=[])  # another line's damaged folder does not stop this one
    rel = release[1:] if release.startswith("v") else release
    for ln in lines:
        if ln.release == rel:
            return ln
    own = checkout / LINES_DIR / rel
    if linepath.is_release(rel) and (own / LOCK_NAME).is_file() and (own / SERIES_NAME).is_file():
        _line_at(checkout, own)  # its own folder is damaged: that one line says how
    have = ", ".join(f"{ln.release}{' (primary)' if ln.primary else ''}" for ln in lines)
    hint = f"; `sglpatch rebase --onto {rel}` makes it" if linepath.is_release(rel) else " (a line is named by its release, e.g. 0.5.23)"
    raise SglpatchError(f"no line {release} in {checkout} (lines: {have}){hint}", exitcodes.USAGE)


def default_workdir(base: Path, line: Line) -> Path:
    """The primary's workdir is base ($SGLANG_FORK_DIR or ~/sglang-fork); another line's is base-R."""
    return linepath.workdir_of(base, None if line.primary else line.release)


def holding(checkout: Path, pin: str | None) -> Line | None:
    """The line whose upstream.lock pins the tree of pin (a workdir's upstream pin digest)."""
    if not pin:
        return None
    try:  # a damaged line folder is left out (`sglpatch lines` says which): the others still answer
        return next((ln for ln in all_lines(checkout, damaged=[]) if ln.lock.pin_digest() == pin), None)
    except SglpatchError:  # the primary's own lock
        return None


def held_by(project_root: Path, workdir: Path) -> Line | None:
    """The line a workdir holds (its upstream pin), None when it holds none or is not set up."""
    from sglpatch.upstream import materialize as upstream
    from sglpatch.gitcmd import Git
    from sglpatch.workdir import MANAGED_KEY

    if not (Path(workdir) / ".git").is_dir():
        return None
    git = Git(Path(workdir))
    if git.config_get(MANAGED_KEY) != "true":
        return None
    return holding(checkout_of(project_root), upstream.upstream_pin(git))


def status_line(held: Line | None) -> str:
    """`sglpatch status`'s line: which of the checkout's lines the workdir's upstream pins."""
    if held is None:
        return "line:     none of this checkout's lines (`sglpatch lines` lists them)"
    return f"line:     {held.release}{' (primary)' if held.primary else ''}, from {held.where}"


def guard_move(git, project_root: Path, lock: Lock) -> None:
    """Before apply (or a rebase) moves git's workdir onto lock's release: refused while the
    interpreter the tree was installed into still imports it (sglpatch.pythonenv.install.guard_serving)."""
    from sglpatch.pythonenv import install
    from sglpatch.upstream import materialize as upstream

    pin = upstream.upstream_pin(git)
    if not pin or pin == lock.pin_digest():
        return
    checkout = checkout_of(project_root)
    held = holding(checkout, pin)
    opt = f" --line {lock.version}" if checkout != Path(project_root) else ""
    fix = f"`sglpatch apply{opt} --workdir {linepath.workdir_of(git.workdir, lock.version)} --no-install` (then --python or --venv NEWDIR to install it)"
    install.guard_serving(git.workdir, f"from {held.release if held else 'another release'} to {lock.version}", fix)


def seed(checkout: Path, line_root: Path, old_version: str, new_version: str) -> None:
    """A new line folder starts as a copy of the primary's series, patches and lock (so that the
    rebase's export keeps their names), its title moved to the new release; the rebase's finishing
    step then rewrites all three."""
    if (line_root / SERIES_NAME).is_file():
        return
    text = (checkout / SERIES_NAME).read_text(encoding="utf-8")
    title = f"# SGLang v{old_version} "
    if text.startswith(title):
        text = f"# SGLang v{new_version} " + text[len(title):]
    for name in read_series(checkout).names:
        write_if_changed(patch_path(line_root, name), patch_path(checkout, name).read_bytes(), within=checkout)
    if not (line_root / LOCK_NAME).is_file():  # replaced by the new release's right after the export
        write_if_changed(line_root / LOCK_NAME, (checkout / LOCK_NAME).read_bytes(), within=checkout)
    write_if_changed(line_root / SERIES_NAME, text.encode(), within=checkout)


def carried(line: Line) -> list[str]:
    return read_series(line.root).names
