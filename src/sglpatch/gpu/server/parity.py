"""Tier server, output parity: no allreduce counts as faster until it has said the same thing as NCCL
(issue 53).  Two runs on the same prompts, greedy -- a `[[server.parity]]` pair of modes, or a mode
and the same mode of an earlier report (`--parity-with`) -- must give

- the same generated text, request by request (report.compare_outputs shows the first difference);
- when a mode speculates, the same EAGLE-3 accept length within a tolerance: corrupted hidden states
  handed to the drafter lower the accept length while the greedy text can stay the same (a fused
  allreduce + add without an end barrier did exactly that under CUDA graphs).

The accept length of a run is bench_serving's (`accept_length` = the server's
avg_spec_accept_length over the measured requests: `--flush-cache` resets its counters), else
P4's records (committed tokens / request-steps).  Both sides of a pair are read from the same
source.  The tolerance, unless the pair sets `accept_tolerance`, is

    tol = max(ACCEPT_FLOOR, (d - 1) / sqrt(n))

with d = `--speculative-num-draft-tokens` (a verify step accepts 1..d tokens, so one step's count
spreads at most sigma = (d - 1) / 2) and n = verify steps of the smaller run (output tokens /
accept length): two standard errors of an n-step mean at that largest spread.  Runs on the same
prompts with the same greedy text take the same steps except where a bf16 rounding flips one of
the drafter's near-ties, far less than that; corrupted hidden states lower the accepts of every
step.  On the target (8 x 256 tokens, d = 3, accept ~2.5: n ~ 820) tol = 0.07.

A pair beyond its tolerance fails the tier whatever the speed; a speculating pair whose accept
length cannot be read is "not run" (no verdict, never a pass).  A pair that names the kernel-tier
backends its mode b serves (`backends = ["pcie_ipc"]`) counts for them only when b's server log
shows that path serving (evidence.served_as): a switch that an install ignores is NCCL against
NCCL.  The kernel tier's decision table reads these verdicts (kernel/decision.py, --with-profile).
"""

from __future__ import annotations

import math
from pathlib import Path

from sglpatch.gpu.server.evidence import describe, served_as
from sglpatch.gpu.server.report import bench_order, compare_outputs, num_requests, read_texts
from sglpatch.gpu.shared.report import TierResult, fmt

ACCEPT_FLOOR = 0.02  # below this a difference is within what bf16 flips of the drafter's near-ties can do
SPEC_FLAG, DRAFT_FLAG = "--speculative-algorithm", "--speculative-num-draft-tokens"
BAD = ("differ", "fail")


def _flag(cmd: list, flag: str) -> str | None:
    cmd = [str(a) for a in cmd or []]
    hits = [cmd[i + 1] for i, a in enumerate(cmd[:-1]) if a == flag]
    hits += [a.split("=", 1)[1] for a in cmd if a.startswith(flag + "=")]
    return hits[-1] if hits else None


def speculative(m: dict) -> bool:
    """The mode ran with speculative decoding (its command names an algorithm, or the server said so)."""
    return bool(_flag(m.get("command"), SPEC_FLAG) or ((m.get("served") or {}).get("speculative") or {})
                .get("speculative_algorithm"))


def accept_readings(m: dict) -> dict:
    """{source: (accept length, verify steps)} of one mode's run: "bench_serving" and/or "P4"."""
    out = {}
    b = m.get("benchmark") or {}
    acc, toks = b.get("accept_length"), b.get("total_output_tokens")
    if isinstance(acc, (int, float)) and acc > 0:
        out["bench_serving"] = (float(acc), toks / acc if isinstance(toks, (int, float)) and toks > 0 else None)
    sums = (m.get("verify_profile") or {}).get("sums") or {}
    if sums.get("requests") and sums.get("tokens"):
        out["P4"] = (sums["tokens"] / sums["requests"], float(sums["requests"]))
    return out


def draft_tokens(m: dict) -> int | None:
    v = _flag(m.get("command"), DRAFT_FLAG) or ((m.get("served") or {}).get("speculative") or {}).get(
        "speculative_num_draft_tokens")
    try:
        return int(v) if v is not None and int(v) > 1 else None
    except (TypeError, ValueError):
        return None


def compare_accept(a: dict, b: dict, a_label: str, b_label: str, tolerance: float | None = None) -> dict:
    """{"status": same | differ | cannot_judge, "a", "b", "delta", "tolerance", "how", "source", "detail"}."""
    ra, rb = accept_readings(a), accept_readings(b)
    source = next((s for s in ("bench_serving", "P4") if s in ra and s in rb), None)
    if source is None:
        missing = [lbl for lbl, r in ((a_label, ra), (b_label, rb)) if not r]
        why = (f"no accept length from {', '.join(missing)}" if missing else
               f"{a_label} and {b_label} report it from different sources ({sorted(ra)} vs {sorted(rb)})")
        return {"status": "cannot_judge", "detail": f"accept length cannot be judged: {why}"}
    (la, na), (lb, nb) = ra[source], rb[source]
    out = {"a": round(la, 3), "b": round(lb, 3), "delta": round(lb - la, 3), "source": source}
    if tolerance is not None:
        out.update(tolerance=float(tolerance), how="the pair's accept_tolerance")
    else:
        d = draft_tokens(a) or draft_tokens(b)
        n = min(x for x in (na, nb) if x) if (na or nb) else None
        if d is None or not n:
            return {**out, "status": "cannot_judge",
                    "detail": "accept length cannot be judged: no tolerance ("
                    + ("the draft width --speculative-num-draft-tokens is unknown" if d is None
                       else "the number of verify steps is unknown") + "; or set accept_tolerance on the pair)"}
        tol = max(ACCEPT_FLOOR, (d - 1) / math.sqrt(n))
        out.update(tolerance=round(tol, 3), how=f"max({ACCEPT_FLOOR}, ({d} - 1) / sqrt({n:.0f} verify steps))")
    beyond = abs(lb - la) > out["tolerance"]
    out["status"] = "differ" if beyond else "same"
    out["detail"] = (f"accept length {la:.3f} ({a_label}) vs {lb:.3f} ({b_label}), {source}: "
                     f"{'beyond' if beyond else 'within'} ±{out['tolerance']:.3f} ({out['how']})")
    return out


def judge_pair(res: dict, a: dict, b: dict, pair: dict) -> dict:
    """A text comparison (report.compare_outputs) and, for speculating modes, the accept length;
    then whether the pair speaks for the backends it names."""
    res["text"] = {"status": res["status"], "detail": res["detail"]}
    if speculative(a) or speculative(b):
        acc = res["accept"] = compare_accept(a, b, res["a"], res["b"], pair.get("accept_tolerance"))
        if res["status"] == "same" and acc["status"] == "differ":
            res.update(status="differ", why="accept length",
                       detail=f"greedy text identical, but the {acc['detail']}: the drafter saw other hidden states")
        elif res["status"] == "same" and acc["status"] == "cannot_judge":
            res.update(status="not_run", detail=f"greedy text identical; {acc['detail']}: no verdict")
        else:
            res["detail"] += f"; {acc['detail']}"
    if res["status"] in BAD:
        res.setdefault("why", "greedy text" if res["text"]["status"] == "differ" else "no outputs")
    res["backends"] = list(pair.get("backends") or [])
    ev = b.get("allreduce")
    other = [x for x in res["backends"] if served_as(ev, x) is False]
    if other and res["status"] == "same":
        res.update(status="not_run", detail=(
            f"{res['detail']}; but {res['b']} was served by {describe(ev)}"
            + (f" (`{ev['evidence']}`)" if (ev or {}).get("evidence") else " (no allreduce line in its log)")
            + f", not by {', '.join(other)}: the pair says nothing about {', '.join(other)}"))
    return res


def parity_checks(tr: TierResult, srv: dict, report_dir: Path, modes: list[dict], old: dict | None,
                  old_dir: str | None, digest: str, first_token=None) -> list[dict]:
    by_name = {m["mode"]: m for m in modes}
    bench = srv["benchmark"]
    order = bench_order(len(bench["prompts"]), num_requests(bench), int(srv["seed"]))
    out = []
    for pair in srv.get("parity", []):
        a, b = by_name.get(pair["a"]), by_name.get(pair["b"])
        if a is None or b is None:
            out.append({"name": pair["name"], "a": pair["a"], "b": pair["b"], "status": "not_run",
                        "backends": list(pair.get("backends") or []),
                        "detail": "not both modes ran (select them with --modes " f"{pair['a']},{pair['b']})"})
            continue
        res = compare_outputs(pair["name"], pair["a"], read_texts(report_dir, a), pair["b"],
                              read_texts(report_dir, b), bench["prompts"], order, first_token)
        out.append(judge_pair(res, a, b, pair))
    if old is not None:
        old_srv = (old.get("tiers") or {}).get("server") or {}
        old_modes = {m["mode"]: m for m in old_srv.get("modes", [])}
        same_prompts = (old_srv.get("prompts") or {}).get("sha") == digest
        for m in modes:
            name = f"{m['mode']} vs --parity-with"
            if m["mode"] not in old_modes:
                out.append({"name": name, "status": "fail", "detail": f"{old_dir} has no mode {m['mode']}"})
            elif not same_prompts:
                out.append({"name": name, "status": "fail", "detail": f"{old_dir} used another prompt set"})
            else:
                res = compare_outputs(name, f"{old_dir}:{m['mode']}", read_texts(old_dir, old_modes[m["mode"]]),
                                      f"this run:{m['mode']}", read_texts(report_dir, m), bench["prompts"], order,
                                      first_token)
                out.append(judge_pair(res, old_modes[m["mode"]], m, {}))
    for p in out:
        if p["status"] in BAD:
            tr.fail(f"parity {p['name']}: {p['detail']}")
    return out


def parity_markdown(checks: list[dict]) -> list[str]:
    if not checks:
        return []
    md = ["", "### Output parity (greedy, same prompts; text as bench_serving records it; EAGLE-3: accept length)",
          "", "| check | a | b | accept length a / b (tolerance) | result |", "|---|---|---|---|---|"]
    for p in checks:
        verdict = {"same": "SAME", "differ": "**DIFFERS**", "fail": "**FAILED**", "not_run": "not run"}[p["status"]]
        acc = p.get("accept") or {}
        cell = (f"{fmt(acc.get('a'), 2)} / {fmt(acc.get('b'), 2)} (±{fmt(acc.get('tolerance'), 3)})"
                if "a" in acc else ("cannot judge" if acc else "—"))
        md.append(f"| {p['name']} | {p.get('a', '')} | {p.get('b', '')} | {cell} | {verdict}: {p['detail']} |")
    return md


def tier_summary(results: list[dict], parity: list[dict]) -> str:
    """One line: each mode's single-stream tok/s, then the parity verdict."""
    summary = "; ".join(f"{m['mode']}: {fmt((m.get('benchmark') or {}).get('single_stream_tok_s'))} tok/s"
                        + ("" if m.get("status") == "ok" else " (failed)") for m in results)
    bad = [p["name"] + (f" ({p['why']})" if p.get("why") else "") for p in parity if p["status"] in BAD]
    unrun = [p["name"] for p in parity if p["status"] == "not_run"]  # not selected, or no verdict: never a pass
    ran = len(parity) - len(unrun)
    if ran:
        summary += "; parity " + (f"FAILED: {', '.join(bad)}" if bad else "same")
    if unrun:
        summary += f"; parity not run: {', '.join(unrun)}"
    return summary
