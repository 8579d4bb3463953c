"""Which allreduce the decision table may recommend: no path counts as faster until it has said the
same thing as NCCL (issue 53).

- NCCL itself (`nccl`, `nccl_p2p_off`, `nccl_default_env`) is the reference: eligible.
- A backend that was wrong in this run -- a WRONG latency row, or a back-to-back CUDA-graph replay
  that differed from NCCL on the same inputs (microbench/replay.py) -- is never a candidate
  (decision.project lists it under "Not projected", not eligible).
- Any other backend is eligible only once every server-tier parity pair that names it
  (`[[server.parity]] backends = [...]`, server/parity.py) passed in the server report given with
  `--with-profile REPORT`: the same greedy text as NCCL and, with EAGLE-3, the same accept length
  within its tolerance, with its path serving.  A pair that failed makes it not eligible and is
  named; a pair not run (modes not selected, accept length unreadable, the path not serving)
  leaves it "not yet"; so does no report, or no pair naming it.

Read from report.json only (the kernel tier never imports the server tier).
"""

from __future__ import annotations

import json
from pathlib import Path

REFERENCE = ("nccl", "nccl_p2p_off", "nccl_default_env")
BAD = ("differ", "fail")


def parity_from_report(path: str | Path) -> dict:
    """{"source", "pairs": [{name, status, detail, backends, why, side}]} of a server-tier report.json
    (or its folder; each side of an --ab report)."""
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        srv = (json.loads(p.read_text()).get("tiers") or {}).get("server") or {}
    except (OSError, ValueError):
        return {"source": str(p), "pairs": []}
    sides = [({"side": None}, srv)] + [({"side": s.get("label") or s.get("side")}, s)
                                       for s in (srv.get("ab") or {}).get("sides", [])]
    pairs = [{**tag, **{k: x.get(k) for k in ("name", "status", "detail", "why")}, "backends": x.get("backends") or []}
             for tag, s in sides for x in s.get("parity") or []]
    return {"source": str(p), "pairs": pairs}


def verdicts(parity: dict | None) -> dict[str, dict]:
    """{backend: {"eligible": True | False | None, "why": str}} from the pairs that name it; None =
    not yet.  Per pair name across the --ab sides: failed on any side fails it, passed on one and
    failed on none passes it, else it was not run."""
    by_pair: dict[str, list[dict]] = {}
    for x in (parity or {}).get("pairs", []):
        if x["backends"]:
            by_pair.setdefault(x["name"], []).append(x)
    out: dict[str, dict] = {}
    for name, runs in by_pair.items():
        bad = next((r for r in runs if r["status"] in BAD), None)
        ok = next((r for r in runs if r["status"] == "same"), None)
        where = lambda r: f" on side {r['side']}" if r.get("side") else ""  # noqa: E731
        for b in runs[0]["backends"]:
            v = out.setdefault(b, {"failed": [], "passed": [], "not_run": []})
            if bad:
                v["failed"].append(f"pair '{name}' failed{where(bad)}" + (f" ({bad['why']})" if bad.get("why") else "")
                                   + f": {bad['detail']}")
            elif ok:
                v["passed"].append(f"'{name}'")
            else:
                v["not_run"].append(f"pair '{name}' not run: {runs[0]['detail']}")
    res = {}
    for b, v in out.items():
        if v["failed"]:
            res[b] = {"eligible": False, "why": "; ".join(v["failed"])}
        elif v["not_run"]:
            res[b] = {"eligible": None, "why": "; ".join(v["not_run"])}
        else:
            res[b] = {"eligible": True, "why": f"pair(s) {', '.join(v['passed'])} passed"}
    return res


def of(backend: str, parity: dict | None, confirm: str | None = None) -> dict:
    """{"eligible": True | False | None, "why"} of one candidate (the reference, or its pairs)."""
    if backend in REFERENCE:
        return {"eligible": True, "why": "NCCL itself: the reference every other path is compared with"}
    got = verdicts(parity).get(backend)
    if got:
        return got
    hint = f"; run `{confirm}` and pass its report with --with-profile" if confirm else ""
    if parity is None:
        return {"eligible": None, "why": "no server-tier parity yet (--with-profile REPORT)" + hint}
    return {"eligible": None, "why": f"no parity pair in {parity['source']} names {backend} "
                                     "([[server.parity]] backends)" + hint}


def replay_failures(replay: list[dict]) -> dict[tuple[str, str], str]:
    """{(backend, install): why} of the backends whose back-to-back replays differed or raised."""
    out: dict[tuple[str, str], str] = {}
    for r in replay or []:
        if r.get("status") in ("mismatch", "error"):
            out.setdefault((r["backend"], r.get("install", "A")), replay_line(r))
    return out


def replay_line(r: dict) -> str:
    """One line naming the replay, rank and element of a mismatch (or the error)."""
    where = f"{r['backend']} [{r['rows']},{r.get('hidden')}] x {r.get('replays')} back-to-back CUDA-graph replays"
    if r.get("status") == "error":
        return f"{where} raised: {r.get('detail')}"
    f = r.get("first_mismatch") or {}
    el = f.get("element") or ["?", "?"]
    return (f"{where}: {r.get('mismatched_replays')} differ from NCCL on the same inputs, first replay {f.get('replay')} "
            f"on rank {f.get('rank')}, {f.get('output', 'output')} element [{el[0]},{el[1]}]: got {f.get('got')}, "
            f"NCCL {f.get('nccl')}")
