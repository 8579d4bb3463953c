"""The report: the lines `sglpatch bisect` prints (and keeps as report.txt), steps.txt and
report.json in the log folder."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from sglpatch.bisect.model import BisectResult, Step


def write_log(log_dir: Path, steps: list[Step], result: BisectResult | None) -> None:
    with open(log_dir / "steps.txt", "w") as f:
        f.write("run  phase   patch  exit -> verdict, seconds\n")
        f.writelines(s.line() + "\n" for s in steps)
    if result is not None:
        data = asdict(result)
        data["log_dir"] = str(log_dir)
        (log_dir / "report.json").write_text(json.dumps(data, indent=2) + "\n")


def format_report(result: BisectResult) -> list[str]:
    lines = ["steps (run, phase, patch, exit -> verdict, seconds):"]
    lines += [f"  {s.line()}" for s in result.steps] or ["  (none: the range has a single commit)"]
    lines.append(f"CMD runs: {result.runs} (bound for {result.n} patch(es): ceil(log2({result.n}+1)) + 2 = {result.bound})")
    lines.append(result.message)
    fb = result.first_bad
    if fb is not None:
        lines.append(f"  patch:       {fb.name}" + (f" (#{fb.index} of {fb.total})" if fb.index else ""))
        lines.append(f"  commit:      {fb.commit}")
        lines.append(f"  subject:     {fb.subject}")
        if fb.description:
            desc = fb.description.splitlines()
            lines.append(f"  description: {desc[0]}")
            lines += [f"               {d}" for d in desc[1:]]
    for c in result.candidates:
        lines.append(f"  candidate:   {c.label}: {c.subject}")
    if result.log_dir is not None:
        lines.append(f"logs: {result.log_dir}")
    return lines
