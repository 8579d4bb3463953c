"""`--tier server --ab A_PYTHON,B_PYTHON`: the server tier once per install, one comparison.

The same selected modes, the same profile and the same prompts run first with A's interpreter
(its `sglang.launch_server` and its `sglang.bench_serving`), then with B's: one server at a time,
every process of a mode ended before the next starts (the port is checked free before each
launch).  Each side is gated against the profile's baseline exactly as a plain server-tier run
(its failures are the tier's, prefixed with the side); the A/B table itself only reports: B/A
ratios never fail the tier.  Each side's files are in DIR/A and DIR/B.
"""

from __future__ import annotations

import os
from pathlib import Path

from sglpatch.errors import say
from sglpatch.gpu.server.evidence import describe
from sglpatch.gpu.shared.profile import expand, usage_error
from sglpatch.gpu.shared.report import TierResult, fmt
from sglpatch.gpu.shared.served import imported_sglang, pcie_ipc_server
from sglpatch.gpu.server.tier import ServerTier
from sglpatch.gpu.shared.plan import Tier
from sglpatch.gpu.server.report import verify_ms_of

# (key in a side's row, label, digits); B/A is given for each
METRICS = (("single_stream_tok_s", "single-stream tok/s (1000/median TPOT)", 1),
           ("output_throughput", "output throughput tok/s", 1),
           ("accept_length", "accept length", 2),
           ("verify_ms_p4", "verify ms (P4, median; lower is better)", 2))


def parse_ab(spec: str) -> list[str]:
    parts = [x.strip() for x in str(spec).split(",")]
    if len(parts) != 2 or not all(parts):
        raise usage_error(f"--ab {spec!r}: give two interpreters, A_PYTHON,B_PYTHON (e.g. "
                          "~/ml-env/bin/python3,~/ml-env-0.5.23/bin/python3)")
    return [expand(p) for p in parts]


def install_label(python: str, version: str | None, p5: bool = False) -> str:
    """'0.5.9 (~/ml-env)': the sglang version and the venv folder of the interpreter; '0.5.9 + P5
    (~/ml-env)' when its sglang carries P5 (the PCIe-IPC backport)."""
    p = Path(python)
    d = str(p.parent.parent if p.parent.name == "bin" else p.parent)
    home = str(Path.home())
    if d == home or d.startswith(home + "/"):
        d = "~" + d[len(home):]
    return f"{version or 'sglang ?'}{' + P5' if p5 else ''} ({d})"


def side_row(m: dict) -> dict:
    b = m.get("benchmark") or {}
    acc = b.get("accept_length") or (m.get("served") or {}).get("avg_spec_accept_length")
    return {"status": m.get("status"), "single_stream_tok_s": b.get("single_stream_tok_s"),
            "output_throughput": b.get("output_throughput"), "accept_length": acc,
            "median_tpot_ms": b.get("median_tpot_ms"), "verify_ms_p4": verify_ms_of(m.get("verify_profile")),
            "allreduce": m.get("allreduce")}


def ratio(a, b) -> float | None:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
        return round(b / a, 3)
    return None


class ServerABTier(Tier):
    """The server tier once per install (A, then B), each a ServerTier of its own, one comparison."""

    name = "server"

    def check(self) -> bool:
        plan = self.plan
        if plan.parity_with:
            raise usage_error("--ab and --parity-with do not go together: compare the two installs with --ab alone")
        self.pythons = parse_ab(plan.ab)
        if not plan.profile.get("server"):
            side = ServerTier(plan)
            side.check()
            self.result = side.result
            return False
        # both installs are checked before A's first (hour-long) load, not after it
        for key, python in zip(("A", "B"), self.pythons):
            if not (Path(python).is_file() and os.access(python, os.X_OK)):
                raise usage_error(f"--ab: {key}'s interpreter {python} is not an executable file")
            by = imported_sglang(python, plan.base_env, plan.project)
            if by.get("error"):
                raise usage_error(f"--ab: {key} ({python}): {by['error']}")
        return True

    def run(self) -> None:
        plan = self.plan
        srv = plan.profile["server"]
        self.sides = []
        for key, python in zip(("A", "B"), self.pythons):
            side_dir = plan.report_dir / key
            side_dir.mkdir(parents=True, exist_ok=True)
            say(f"regress: server tier, side {key}: {python}")
            side_plan = plan.replace(profile={**plan.profile, "server": {**srv, "python": python}}, report_dir=side_dir)
            side = ServerTier(side_plan, side_env=srv.get("ab", {}).get(key.lower(), {}).get("env") or {})
            if side.check():
                side.run()
            t = side.report()
            by = t.data.get("served_by", {})
            label = f"{key}: {install_label(python, by.get('sglang_version'), pcie_ipc_server(by) == 'P5')}"
            self.sides.append({"side": key, "label": label, "python": python, "dir": key, "tier": t})

    def report(self) -> TierResult:
        if getattr(self, "sides", None):
            self.result = combine(self.sides)
        return self.result


def combine(sides: list[dict]) -> TierResult:
    tr = TierResult("server")
    a, b = sides
    for s in sides:
        t = s["tier"]
        for f in t.failures:
            tr.fail(f"{s['label']}: {f}")
    rows = []
    a_modes = {m["mode"]: m for m in a["tier"].data.get("modes", [])}
    b_modes = {m["mode"]: m for m in b["tier"].data.get("modes", [])}
    for name in [*a_modes, *[n for n in b_modes if n not in a_modes]]:
        ra = side_row(a_modes.get(name, {}))
        rb = side_row(b_modes.get(name, {}))
        rows.append({"mode": name, "a": ra, "b": rb,
                     "ratio_b_over_a": {k: ratio(ra[k], rb[k]) for k, _, _ in METRICS}})
    tr.status = "fail" if tr.failures else "pass"
    if any(s["tier"].status == "cannot_run" for s in sides):
        tr.status = "cannot_run"
    tr.data = {"ab": {"note": "each side is gated against the baseline as a plain server-tier run; "
                              "the A/B comparison reports and never fails the tier",
                      "sides": [{"side": s["side"], "label": s["label"], "python": s["python"], "dir": s["dir"],
                                 "status": s["tier"].status, "summary": s["tier"].summary,
                                 "failures": s["tier"].failures, **s["tier"].data} for s in sides],
                      "table": rows},
               "prompts": a["tier"].data.get("prompts")}
    same = (a["tier"].data.get("prompts") or {}).get("sha") == (b["tier"].data.get("prompts") or {}).get("sha")
    tr.data["ab"]["same_prompts"] = same
    tok = "single_stream_tok_s"
    tr.summary = "; ".join(
        f"{r['mode']}: A {fmt(r['a'][tok])} / B {fmt(r['b'][tok])} tok/s"
        + (f" (B/A {r['ratio_b_over_a'][tok]:.2f}x)" if r["ratio_b_over_a"][tok] else "") for r in rows)
    tr.md = ab_markdown(sides, rows, same)
    return tr


def ab_markdown(sides: list[dict], rows: list[dict], same_prompts: bool) -> list[str]:
    a, b = sides
    md = ["### A/B: two installs, same profile, same prompts", "",
          f"A = `{a['python']}`, B = `{b['python']}`; A's modes ran first, then B's, one server at a time. "
          "Each side is gated against the baseline as a plain server-tier run (its verdicts below); "
          "**this table only reports: no B/A ratio fails the tier.** Verify ms: lower is better.",
          "" if same_prompts else "**The two sides used different prompt sets: the numbers do not compare.**", "",
          f"| mode | metric | {a['label']} | {b['label']} | B/A |", "|---|---|---|---|---|"]
    for r in rows:
        for key, label, nd in METRICS:
            rt = r["ratio_b_over_a"][key]
            md.append(f"| {r['mode']} | {label} | {fmt(r['a'][key], nd)} | {fmt(r['b'][key], nd)} | "
                      f"{f'{rt:.2f}x' if rt else '—'} |")
        md.append(f"| {r['mode']} | allreduce (decode / verify tensors) | {describe(r['a']['allreduce'])} | "
                  f"{describe(r['b']['allreduce'])} | |")
        md.append(f"| {r['mode']} | status | {r['a']['status'] or 'not run'} | {r['b']['status'] or 'not run'} | |")
    md += ["", "Allreduce evidence (the server log line that says which backend took the small tensors, and "
           "the switches that selected it):", ""]
    for r in rows:
        for s, key in ((a, "a"), (b, "b")):
            ev = r[key]["allreduce"]
            if ev:
                md.append(f"- {r['mode']}, {s['label']}: **{describe(ev)}** — "
                          + (f"`{ev['evidence']}`" if ev.get("evidence") else "no evidence in the log")
                          + (f"; fusion: `{ev['fusion']}`" if ev.get("fusion") else "")
                          + (f"; {ev['note']}" if ev.get("note") else "")
                          + f"; selected by {ev['selected_by'] or 'no switch set'}")
    md += ["", "What served:", ""]
    for s in sides:
        by = s["tier"].data.get("served_by") or {}
        carried = by.get("carried")
        md.append(f"- {s['label']}: sglang {by.get('sglang_version', '?')} from `{by.get('sglang_file', by.get('error'))}`; "
                  + (f"line {by['line']}; " if by.get("line") else "")
                  + (f"carries {len(carried)} patch(es): {'; '.join(carried) or 'none'}" if carried is not None
                     else f"patches: {by.get('patches_note', 'unknown')}"))
    for s in sides:
        md += ["", f"#### Side {s['label']}: {s['tier'].status} — {s['tier'].summary}", ""]
        if s["tier"].failures:
            md += [f"- {f}" for f in s["tier"].failures] + [""]
        md += s["tier"].md
    return md
