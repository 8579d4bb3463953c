"""The one answer to "which line, which tree, which Python, which source": resolved once, before a
command runs, from --project, --line, --workdir and --python (sglpatch.cli.main puts it on args.ctx
for every command that takes --line), as Yocto devtool resolves its workspace before dispatch.
Commands and scripts ask it; none re-derives a path (the naming rule is sglpatch.linepath's), and
`--source auto` is decided here only (Context.source, the rule in sglpatch.upstream.materialize)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch import exitcodes, linepath, lines
from sglpatch.errors import SglpatchError, say
from sglpatch.project import find_project


@dataclass
class Context:
    checkout: Path      # the checkout (the primary's project root)
    line: lines.Line    # --line's, else the line of --project (the primary)
    workdir: Path       # --workdir as given, else the line's own beside the base
    workdir_given: bool
    line_given: bool
    python: str = sys.executable  # the serving Python: --python, else this interpreter
    chosen: dict = field(default_factory=dict)  # --source auto, decided once per target: {(tag, version): source}

    @property
    def project(self) -> Path:
        return self.line.root

    @property
    def opt(self) -> str:
        """` --line R` for advice that must build this line again (empty for the primary)."""
        return "" if self.line.primary else f" --line {self.line.release}"

    def named(self, line: lines.Line | None = None) -> str:
        ln = line or self.line
        return f"line {ln.release}{' (primary)' if ln.primary else ''}"

    def held(self) -> lines.Line | None:
        """The line the workdir's upstream pin holds (None: none, or not set up)."""
        return lines.held_by(self.project, self.workdir)

    def tree_line(self) -> tuple[lines.Line, lines.Line | None]:
        """(the line a command on the tree as it is acts on, the line it holds): --line's when given,
        else the one the tree holds (a line's commits and status are that line's, never another's),
        else the context's."""
        held = self.held()
        return (held if held and not self.line_given else self.line), held

    def source(self, given: str, url: str | None = None, timeout: float = 8.0, onto: tuple[str, str] | None = None,
               built_in: Path | None = None) -> str:
        """given (git, sdist, wheel; registry is `sdist`, which every consumer takes as the registry's
        artifact), else for `auto` the one decision (git when the URL answers, else the registry; said
        once): for the line's own pin, or for onto (tag, version: a rebase's target). built_in: the
        workdir the line's tree is built in; when its upstream branch holds the pin already, nothing is
        fetched and the URL is not probed (materialize reuses that branch)."""
        if given == "registry":  # the registry's artifact: the lock's, whatever its kind; a new release's sdist, else its wheel
            return "sdist"
        if given != "auto":
            return given
        from sglpatch.upstream import materialize as upstream

        lock = self.line.lock
        if built_in is not None and not onto and upstream.holds_pin(built_in, lock):
            say(f"source: the workdir's upstream branch (it holds {lock.describe()} already; {url or lock.url} not probed)")
            return lock.artifact_kind
        tag, version = onto or (lock.tag, lock.version)
        if (tag, version) not in self.chosen:
            chosen, why = upstream.choose_source(url or lock.url, tag, lock.name, version, timeout=timeout,
                                                 pinned=None if onto else lock.sdist_filename)
            say(f"source: {chosen} ({why})")
            self.chosen[(tag, version)] = chosen
        return self.chosen[(tag, version)]


def resolve(args) -> Context | None:
    """The context of args; None when no project is found and none was asked for (a command that
    can run without one, bisect, finds it later or says why)."""
    try:
        root = Path(args.project).resolve() if getattr(args, "project", None) else find_project()
    except SglpatchError:
        if getattr(args, "line", None):
            raise
        return None
    checkout = lines.checkout_of(root)
    release = getattr(args, "line", None)
    if release is not None and not release.strip():
        raise SglpatchError("--line needs a release (e.g. 0.5.23; `sglpatch lines` lists them)", exitcodes.USAGE)
    line = lines.find(checkout, release) if release else lines.at(root)
    given = getattr(args, "workdir", None)
    if given:
        wd = linepath.base(given)
    else:
        wd = linepath.workdir_of(linepath.base(), None if line.primary else line.release)
    return Context(checkout, line, wd, bool(given), bool(release), getattr(args, "python", None) or sys.executable)
