"""The watch's report: the terminal table and the markdown (the JSON is the matrix itself)."""

from __future__ import annotations

import time

from sglpatch.rebase.outcome import Status
from sglpatch.watch.matrix import DEPS, VERDICT

SHORT = {  # the matrix's column word of each status
    Status.EXACT: "exact",
    Status.THREE_WAY: "3-way",
    Status.BROKEN: "BROKEN",
    Status.CONFLICT: "CONFLICT",
    Status.OBSOLETE: "GONE",
    Status.UPSTREAM: "upstream",
    Status.RECORDED: "recorded",
    Status.SUPERSEDED: "superseded",
}


def _short_patch(name: str) -> str:
    return "P" + str(int(name.split("-", 1)[0])) if name[:4].isdigit() else name[:8]


def _dep_str(deps: dict, pinned: dict) -> str:
    parts = []
    for d in (*DEPS, "python"):
        if d in deps:
            mark = "" if deps.get(d) == pinned.get(d) else "*"
            parts.append(f"{d.replace('-python', '')} {deps[d]}{mark}")
    return "; ".join(parts)


def terminal(report: dict) -> list[str]:
    names = report["patches"]
    cols = [_short_patch(n) for n in names]
    lines = [f"upstream watch: the series on {report['pinned']['version']} against {len(report['rows'])} releases"]
    lines.append(f"{'release':<14}" + "".join(f"{c:<12}" for c in cols) + "verdict")
    for r in report["rows"]:
        lines.append(f"{r['version']:<14}" + "".join(f"{SHORT[r['cells'][n]['status']]:<12}" for n in names) + VERDICT[r["verdict"]])
    lines.append("")
    lines.append("details (what is not 'applies exactly'):")
    for r in report["rows"]:
        for n, c in zip(names, cols):
            cell = r["cells"][n]
            if cell["status"] == Status.EXACT:
                continue
            lines.append(f"  {r['version']} {c}: {cell['text']}")
            for d in cell["details"][:6]:
                lines.append(f"      {d}")
    lines.append("")
    lines.append(f"dependency pins (* = differs from the pinned {report['pinned']['version']}: {_dep_str(report['pinned']['deps'], report['pinned']['deps'])}):")
    for r in report["rows"]:
        lines.append(f"  {r['version']:<14} {r['source']:<6} {_dep_str(r['deps'], report['pinned']['deps'])}; wheels {r['deps'].get('tags')}")
    newest = report.get("newest_deps", {})
    if newest:
        lines.append("  " + f"{'newest':<21} " + "; ".join(f"{d.replace('-python', '')} {v}" for d, v in newest.items()))
    for n in report.get("newer", []):
        lines.append(f"newer than the pins: {n['dist']} {n['newest']} (sglang {n['release']} pins {n['pin']}):")
        lines += [f"  {'[series] ' if c['series'] else ''}{c['text']}" for c in n["changes"]]
    lines += _lines_note(report)
    lines.append(f"newest {report['newest']}: {VERDICT[report['newest_verdict']]} ({report['seconds']}s)")
    return lines


def _lines_note(report: dict) -> list[str]:
    """The checkout's lines (sglpatch.lines): each one's command, and whether the newest release has one."""
    out = []
    for ln in report.get("lines", []):
        out.append(f"line {ln['release']} in the checkout ({ln['dir']}, {len(ln['patches'])} patches: "
                   f"{' '.join(_short_patch(n) for n in ln['patches'])}): scripts/apply.sh --line {ln['release']} --venv NEWDIR")
    if "lines" in report and report["newest"] not in {ln["release"] for ln in report["lines"]}:
        out.append(f"no line for {report['newest']} yet: scripts/rebase.sh --onto {report['newest']} writes lines/{report['newest']}/")
    return out


def markdown(report: dict, command: str | None = None) -> str:
    names = report["patches"]
    cols = [_short_patch(n) for n in names]
    out = [f"# Upstream watch: the series on sglang {report['pinned']['version']}", ""]
    if command:
        out += [f"Command: `{command}`  ", f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    out += ["Patches: " + ", ".join(f"{c} = `{n}`" for c, n in zip(cols, names)), ""]
    out.append("| release | source | " + " | ".join(cols) + " | verdict |")
    out.append("|---|---|" + "---|" * len(cols) + "---|")
    for r in report["rows"]:
        cells = [r["cells"][n]["text"].replace("|", "\\|") for n in names]
        out.append(f"| {r['version']} | {r['source']} | " + " | ".join(cells) + f" | {VERDICT[r['verdict']]} |")
    out += ["", "## Dependency pins", "", "| release | torch | flashinfer-python | sgl-kernel | sglang-kernel | transformers | Requires-Python | wheel tags |",
            "|---|---|---|---|---|---|---|---|"]
    for label, deps in [(f"{report['pinned']['version']} (pinned)", report["pinned"]["deps"])] + [(r["version"], r["deps"]) for r in report["rows"]]:
        out.append(f"| {label} | " + " | ".join(deps.get(d, "-") for d in DEPS) + f" | {deps.get('python', '-')} | {deps.get('tags', '-')} |")
    if report.get("newest_deps"):
        out.append("| newest on the index | " + " | ".join(report["newest_deps"].get(d, "-") for d in DEPS) + " | | |")
    if report.get("newer"):
        out += ["", "## Newer than the pins", ""]
        for n in report["newer"]:
            out.append(f"**{n['dist']} {n['newest']}** (sglang {n['release']} pins `{n['pin']}`; the series relies on it: {n['why']}):")
            out += [f"- {'**series**: ' if c['series'] else ''}{c['text']}" for c in n["changes"]]
            out.append("")
    out += ["", "## Details", ""]
    for r in report["rows"]:
        for n, c in zip(names, cols):
            cell = r["cells"][n]
            if cell["status"] in (Status.EXACT, Status.THREE_WAY):
                continue
            out.append(f"- **{r['version']} {c}**: {cell['text']}")
            out += [f"  - {d}" for d in cell["details"][:8]]
    note = _lines_note(report)
    out += ["", "## Lines in the checkout", "", *[f"- {n}" for n in note]] if note else []
    out += ["", f"Newest release {report['newest']}: **{VERDICT[report['newest_verdict']]}**.", ""]
    return "\n".join(out)
