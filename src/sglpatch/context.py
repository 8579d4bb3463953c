"""The one answer to "which line, which tree": resolved once, before a command runs, from
--project, --line and --workdir (sglpatch.cli.main puts it on args.ctx for every command that
takes --line), as Yocto devtool resolves its workspace before dispatch. Commands and scripts ask
it; none re-derives a path (the naming rule is sglpatch.linepath's)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sglpatch import exitcodes, linepath, lines
from sglpatch.errors import SglpatchError
from sglpatch.project import find_project


@dataclass
class Context:
    checkout: Path      # the checkout (the primary's project root)
    line: lines.Line    # --line's, else the line of --project (the primary)
    workdir: Path       # --workdir as given, else the line's own beside the base
    workdir_given: bool
    line_given: bool

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
    return Context(checkout, line, wd, bool(given), bool(release))
