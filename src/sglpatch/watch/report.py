"""The watch's report: the rows (matrix.run) with the checkout's lines, printed, and written as JSON and
markdown when asked; exit 3 when the newest release needs a human."""

from __future__ import annotations

import json
import time
from pathlib import Path

from sglpatch import exitcodes
from sglpatch.fsutil import write_if_changed
from sglpatch.errors import SglpatchError, say
from sglpatch.watch.matrix import run
from sglpatch.watch.render import markdown, terminal

EXIT_OK = exitcodes.OK
EXIT_HUMAN = exitcodes.HUMAN


def checkout_lines(project_root: Path) -> list[dict]:
    """The checkout's lines besides the primary (sglpatch.lines): the watch names them beside the
    releases it classifies, and says which release still has none."""
    from sglpatch import lines

    damaged: list[str] = []  # a damaged line folder is named, and the finished report kept
    out = []
    for ln in lines.all_lines(lines.checkout_of(Path(project_root)), damaged)[1:]:
        try:
            out.append({"release": ln.release, "dir": ln.where, "patches": lines.carried(ln)})
        except SglpatchError as e:
            damaged.append(f"{ln.where}: {e}")
    for d in damaged:
        say(f"warning: a line folder is left out of the report: {d}")
    return out


def main(project_root: Path, releases: str | None = None, json_out: str | None = None, md_out: str | None = None,
         command: str | None = None, jobs: int | None = None, recheck: bool = False) -> int:
    report = run(project_root, releases, jobs, recheck)
    report["lines"] = checkout_lines(project_root)
    if json_out != "-":  # --json -: the JSON instead of the table
        print("\n".join(terminal(report)))
    if json_out:
        data = dict(report, command=command, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        text = json.dumps(data, indent=1) + "\n"
        if json_out == "-":
            print(text, end="")
        else:
            write_if_changed(Path(json_out), text.encode())
    if md_out:
        write_if_changed(Path(md_out), markdown(report, command).encode())
    return EXIT_HUMAN if report["newest_verdict"] == "human" else EXIT_OK
