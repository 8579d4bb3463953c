"""A regression run's report: one TierResult per tier, written as report.json and report.md."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch.gpu.shared import verdict


@dataclass
class TierResult:
    name: str
    status: str = "skipped"  # pass | fail | skipped | cannot_run: verdict.status_of(outcome) once one is set
    summary: str = ""
    failures: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    md: list[str] = field(default_factory=list)
    outcome: str | None = None  # a row of sglpatch.gpu.shared.verdict.TABLE

    def set_outcome(self, outcome: str) -> None:
        self.outcome, self.status = outcome, verdict.status_of(outcome)

    def fail(self, msg: str, outcome: str = "failed") -> None:
        self.failures.append(msg)
        if self.status != "fail":
            self.set_outcome(outcome)

    def final_outcome(self) -> str | None:
        """The outcome set, else the one the status stands for (tiers that set only pass/fail)."""
        return self.outcome or {"pass": "passed", "fail": "failed", "cannot_run": "cannot_start"}.get(self.status)


def fmt(v, nd=1):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def served_lines(tiers: list[TierResult]) -> list[str]:
    """The lines of the checkout that served (server tier, each A/B side), in order, each once."""
    found = []
    for t in tiers:
        for by in [t.data.get("served_by") or {}, *[s.get("served_by") or {} for s in t.data.get("ab", {}).get("sides", [])]]:
            if by.get("line") and by["line"] not in found:
                found.append(by["line"])
    return found


def write_report(report_dir: Path, doc: dict, tiers: list[TierResult]) -> None:
    report_dir.mkdir(parents=True, exist_ok=True)
    doc = dict(doc)
    doc["lines"] = served_lines(tiers)
    doc["tiers"] = {t.name: {"status": t.status, "outcome": t.final_outcome(), "summary": t.summary, "failures": t.failures,
                             **t.data}
                    for t in tiers}
    (report_dir / "report.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = [f"# sglpatch regress — {doc['status'].upper()}", "",
          f"- date (UTC): {doc['started_utc']} … {doc['finished_utc']}",
          f"- command: `{doc['command']}`",
          f"- profile: {doc.get('profile') or '(none)'} — target: {doc.get('target', {}).get('name')}",
          f"- line: {', '.join(doc['lines']) or '(no workdir of this checkout served)'}",
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
