"""A regression run's report: one TierResult per tier, written as report.json and report.md."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TierResult:
    name: str
    status: str = "skipped"  # pass | fail | skipped | cannot_run
    summary: str = ""
    failures: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    md: list[str] = field(default_factory=list)

    def fail(self, msg: str) -> None:
        self.failures.append(msg)
        self.status = "fail"


def fmt(v, nd=1):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def write_report(report_dir: Path, doc: dict, tiers: list[TierResult]) -> None:
    report_dir.mkdir(parents=True, exist_ok=True)
    doc = dict(doc)
    doc["tiers"] = {t.name: {"status": t.status, "summary": t.summary, "failures": t.failures, **t.data}
                    for t in tiers}
    (report_dir / "report.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = [f"# sglpatch regress — {doc['status'].upper()}", "",
          f"- date (UTC): {doc['started_utc']} … {doc['finished_utc']}",
          f"- command: `{doc['command']}`",
          f"- profile: {doc.get('profile') or '(none)'} — target: {doc.get('target', {}).get('name')}",
          f"- exit status: {doc['exit_code']}", ""]
    md.append("| tier | status | summary |")
    md.append("|---|---|---|")
    for t in tiers:
        md.append(f"| {t.name} | {t.status} | {t.summary} |")
    md.append("")
    for t in tiers:
        if t.status == "skipped" and not t.md:
            continue
        md.append(f"## tier {t.name}: {t.status}")
        md.append("")
        if t.failures:
            md.append("Failures:")
            md += [f"- {f}" for f in t.failures]
            md.append("")
        md += t.md
        md.append("")
    (report_dir / "report.md").write_text("\n".join(md) + "\n")
