"""Summarize an EAGLE cycle profile written by patch 0004 (SGLANG_VERIFY_PROFILE_FILE).

Each line of the file is one JSON object covering `cycles` speculative cycles of one
replica (`dp_rank`, `pid`; several replicas may append to the same file): per-phase times
(`draft_ms_*`, `verify_ms_*`, `extend_ms_*`, `cycle_ms_*` with `_median`, `_p90`, `_mean`),
`accept_length`, committed `tokens` over `requests` (request-steps, the sum of the batch
sizes), `by_batch_size` and `baseline_step_ms` (decode step without speculation, batch 1).
Version-1 lines (no tokens/requests/by_batch_size) are read too.

The arithmetic (also in docs/p4-verify-profiling.md):
  L  = accept length as SGLang defines it: committed tokens / request-steps (weighted by requests)
  T  = mean cycle time in ms over all cycles (interval means weighted by cycles)
  B  = baseline decode step in ms, single stream (82 tok/s -> 12.2 ms)
  tok/s per request = 1000 * L / T
  throughput        = 1000 * tokens / cycle ms, per replica; summed over the replicas
  verify fraction   = sum of verify time / sum of cycle time
  break-even L*     = T1 / B, from the batch-1 cycles only (B is a batch-1 step): speculation
                      wins iff L1 > L* (30 ms / 12.2 ms = 2.46); no verdict without batch-1 cycles
  predicted tok/s for another accept length X = 1000 * X / T1 (T when there are no batch-1 cycles)
Time the scheduler spends between cycles is not in T, so the rates are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from sglpatch.argtypes import positive, write_json
from sglpatch.errors import SglpatchError

DEFAULT_BASELINE_STEP_MS = 12.2
PHASES = ("draft", "verify", "extend", "cycle")
REQUIRED = ("cycles", "accept_length") + tuple(f"{p}_ms_mean" for p in PHASES)


def load(path: str | Path) -> list[dict]:
    """Read the JSONL file; raise SglpatchError with a one-line reason if unusable."""
    path = Path(path)
    hint = "write one by launching SGLang with SGLANG_VERIFY_PROFILE=1 SGLANG_VERIFY_PROFILE_FILE=<file> (patch 0004)"
    if path.exists() and not path.is_file() and not path.is_dir():  # /dev/zero, a FIFO: read forever
        raise SglpatchError(f"{path}: not a regular file (a device, a FIFO or a socket); copy the profile to a file and pass that")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SglpatchError(f"{path}: no such file; {hint}") from None
    except IsADirectoryError:
        raise SglpatchError(f"{path}: is a directory, expected a JSONL profile file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SglpatchError(f"{path}: cannot read: {e}") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise SglpatchError(f"{path}:{lineno}: not valid JSON ({e.msg}); is this a verify-profile file?") from None
        if not isinstance(rec, dict):
            raise SglpatchError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
        missing = [k for k in REQUIRED if k not in rec]
        if missing:
            raise SglpatchError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}; {hint}")
        for k in REQUIRED + ("baseline_step_ms",):
            if k in rec and not _is_number(rec[k]):
                raise SglpatchError(f"{path}:{lineno}: field {k} is {rec[k]!r}, expected a number")
        if rec["cycles"] <= 0 or rec["cycle_ms_mean"] <= 0:
            raise SglpatchError(f"{path}:{lineno}: cycles and cycle_ms_mean must be > 0")
        for k in ("batch_size",):  # a divisor: 0 gave a ZeroDivisionError
            if k in rec and not (_is_number(rec[k]) and rec[k] > 0):
                raise SglpatchError(f"{path}:{lineno}: field {k} is {rec[k]!r}, expected a number > 0")
        records.append(rec)
    if not records:
        raise SglpatchError(f"{path}: empty; the server writes a line every SGLANG_VERIFY_PROFILE_INTERVAL cycles")
    return records


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def break_even_accept_length(cycle_ms: float, baseline_step_ms: float) -> float:
    """L* = T / B: the accept length at which a speculative cycle matches the baseline."""
    return cycle_ms / baseline_step_ms


def predicted_tok_s(cycle_ms: float, accept_length: float) -> float:
    """Single-stream decode rate of cycles of `cycle_ms` committing `accept_length` tokens."""
    return 1000.0 * accept_length / cycle_ms


def _tokens_requests(r: dict) -> tuple[float, float]:
    requests = r.get("requests")
    if not _is_number(requests) or requests <= 0:  # version 1: mean batch size x cycles
        requests = r["cycles"] * (r.get("batch_size") if _is_number(r.get("batch_size")) else 1.0)
    tokens = r.get("tokens")
    if not _is_number(tokens):
        tokens = r["accept_length"] * requests
    return tokens, requests


def _batch_buckets(r: dict) -> dict[int, list[float]]:
    """bs -> [cycles, cycle ms, tokens] of one record; version-1 records only if all batch 1."""
    by_bs = r.get("by_batch_size")
    if isinstance(by_bs, dict):
        out = {}
        for bs, b in by_bs.items():
            if (
                str(bs).isdigit()
                and int(bs) > 0  # a batch of 0 requests commits nothing
                and isinstance(b, dict)
                and all(_is_number(b.get(k)) for k in ("cycles", "cycle_ms_mean", "accept_length"))
                and b["cycles"] > 0  # no cycles of that size in the interval: no data, no verdict from it
            ):
                out[int(bs)] = [b["cycles"], b["cycles"] * b["cycle_ms_mean"], b["accept_length"] * b["cycles"] * int(bs)]
        return out
    if r.get("batch_size", 1.0) == 1.0:
        return {1: [r["cycles"], r["cycles"] * r["cycle_ms_mean"], r["accept_length"] * r["cycles"]]}
    return {}


def _rates(cycles: float, cycle_ms_total: float, tokens: float, requests: float) -> dict:
    accept = tokens / requests if requests else 0.0
    cycle_ms = cycle_ms_total / cycles if cycles else 0.0
    return {
        "cycles": cycles,
        "cycle_ms_mean": cycle_ms,
        "accept_length": accept,
        "tok_s_per_request": predicted_tok_s(cycle_ms, accept) if cycle_ms > 0 else 0.0,
        "throughput_tok_s": 1000.0 * tokens / cycle_ms_total if cycle_ms_total > 0 else 0.0,
    }


def summarize(records: list[dict], baseline_step_ms: float | None = None) -> dict:
    """Combine interval records into one summary (phase times weighted by cycles, accept
    length by requests, throughput summed over replicas, break-even from batch 1 only)."""
    if not records:
        raise SglpatchError("no profile records to summarize")
    n = sum(r["cycles"] for r in records)

    def wmean(key: str) -> float:
        return sum(r[key] * r["cycles"] for r in records) / n

    if baseline_step_ms is None:
        baselines = {r.get("baseline_step_ms", DEFAULT_BASELINE_STEP_MS) for r in records}
        baseline_step_ms = records[-1].get("baseline_step_ms", DEFAULT_BASELINE_STEP_MS)
        baseline_source = "file" if len(baselines) == 1 else "file (last record; records disagree)"
    else:
        baseline_source = "command line"
    if not baseline_step_ms > 0:
        raise SglpatchError(f"baseline step must be > 0 ms, got {baseline_step_ms}")

    s: dict = {"intervals": len(records), "cycles": n}
    for p in PHASES:
        s[f"{p}_ms_mean"] = wmean(f"{p}_ms_mean")
        p90s = [r[f"{p}_ms_p90"] for r in records if _is_number(r.get(f"{p}_ms_p90"))]
        s[f"{p}_ms_p90_max"] = max(p90s) if p90s else None
    cycle_ms = s["cycle_ms_mean"]
    s["verify_frac"] = s["verify_ms_mean"] / cycle_ms

    replicas: dict[tuple, list[float]] = {}  # (name, dp_rank, pid) -> [cycles, cycle ms, tokens, requests]
    buckets: dict[int, list[float]] = {}
    for r in records:
        tokens, requests = _tokens_requests(r)
        acc = replicas.setdefault((r.get("name"), r.get("dp_rank"), r.get("pid")), [0, 0.0, 0.0, 0.0])
        for i, v in enumerate((r["cycles"], r["cycles"] * r["cycle_ms_mean"], tokens, requests)):
            acc[i] += v
        for bs, b in _batch_buckets(r).items():
            tot = buckets.setdefault(bs, [0, 0.0, 0.0])
            for i in range(3):
                tot[i] += b[i]
    s["replicas"] = [
        {"name": name, "dp_rank": dp, "pid": pid, **_rates(*acc)}
        for (name, dp, pid), acc in sorted(replicas.items(), key=lambda kv: tuple(str(x) for x in kv[0]))
    ]
    tokens = sum(acc[2] for acc in replicas.values())
    requests = sum(acc[3] for acc in replicas.values())
    s["tokens"], s["requests"] = tokens, requests
    s["batch_size"] = requests / n
    s["accept_length"] = tokens / requests
    s["tok_s_per_request"] = predicted_tok_s(cycle_ms, s["accept_length"])
    s["throughput_tok_s"] = sum(rep["throughput_tok_s"] for rep in s["replicas"])
    s["by_batch_size"] = {str(bs): _rates(c, ms, tok, c * bs) for bs, (c, ms, tok) in sorted(buckets.items())}
    s["baseline_step_ms"] = baseline_step_ms
    s["baseline_source"] = baseline_source
    s["baseline_tok_s"] = 1000.0 / baseline_step_ms
    bs1 = s["by_batch_size"].get("1")
    if bs1:
        s["break_even_accept_length"] = break_even_accept_length(bs1["cycle_ms_mean"], baseline_step_ms)
        s["speedup"] = bs1["tok_s_per_request"] / s["baseline_tok_s"]
    else:
        s["break_even_accept_length"] = s["speedup"] = None
    s["prediction_cycle_ms"] = bs1["cycle_ms_mean"] if bs1 else cycle_ms
    return s


def predictions(summary: dict, accept_lengths: list[float]) -> list[dict]:
    """Predicted tok/s per request at the batch-1 cycle time (else the mean cycle time)."""
    out = []
    for x in accept_lengths:
        tok_s = predicted_tok_s(summary["prediction_cycle_ms"], x)
        out.append({"accept_length": x, "tok_s": tok_s, "speedup": tok_s / summary["baseline_tok_s"]})
    return out


def format_text(path: str, summary: dict, preds: list[dict]) -> str:
    s = summary
    nrep = len(s["replicas"])
    lines = [
        f"{path}: {s['cycles']} cycles in {s['intervals']} interval(s) from {nrep} replica(s)",
        "  mean ms per cycle: draft {:.2f}  verify {:.2f}  extend {:.2f}  cycle {:.2f}".format(
            s["draft_ms_mean"], s["verify_ms_mean"], s["extend_ms_mean"], s["cycle_ms_mean"]
        ),
    ]
    if s["cycle_ms_p90_max"] is not None:
        lines.append(f"  worst interval p90 cycle: {s['cycle_ms_p90_max']:.2f} ms")
    lines += [
        f"  verify share of cycle: {100 * s['verify_frac']:.1f}%",
        f"  accept length: {s['accept_length']:.2f} (committed tokens / request-steps; mean batch {s['batch_size']:.2f})",
        f"  tok/s: {s['tok_s_per_request']:.1f} per request, {s['throughput_tok_s']:.1f} throughput"
        + (f" (sum of {nrep} replicas)" if nrep > 1 else ""),
    ]
    if nrep > 1:
        for rep in s["replicas"]:
            lines.append(
                f"    replica dp_rank {rep['dp_rank']} pid {rep['pid']}: {rep['cycles']} cycles, accept length "
                f"{rep['accept_length']:.2f}, {rep['tok_s_per_request']:.1f} tok/s per request, "
                f"{rep['throughput_tok_s']:.1f} throughput"
            )
    for bs, b in s["by_batch_size"].items():
        lines.append(
            f"  batch {bs}: {b['cycles']} cycles, cycle {b['cycle_ms_mean']:.2f} ms, accept length {b['accept_length']:.2f}, "
            f"{b['tok_s_per_request']:.1f} tok/s per request, {b['throughput_tok_s']:.1f} throughput"
        )
    lines.append(f"  baseline: {s['baseline_step_ms']:g} ms/step = {s['baseline_tok_s']:.1f} tok/s ({s['baseline_source']}, single stream)")
    bs1 = s["by_batch_size"].get("1")
    if bs1 is None:
        lines.append(
            "  break-even accept length: not computed (no batch-1 cycles; the baseline is a single-stream step, "
            "measure a baseline at your batch size to compare)"
        )
    else:
        lines.append(
            f"  break-even accept length (batch 1): {s['break_even_accept_length']:.2f} "
            f"(= cycle {bs1['cycle_ms_mean']:.2f} ms / baseline {s['baseline_step_ms']:g} ms)"
        )
        if bs1["accept_length"] > s["break_even_accept_length"]:
            lines.append(f"  verdict (batch 1): speculation is {s['speedup']:.2f}x the baseline")
        else:
            lines.append(
                f"  verdict (batch 1): speculation is SLOWER ({s['speedup']:.2f}x the baseline); raise the accept length above "
                f"{s['break_even_accept_length']:.2f} or cut verify time, else serve without speculation"
            )
    basis = "batch-1 cycle" if bs1 else "mean cycle"
    for p in preds:
        lines.append(
            f"  predicted at accept length {p['accept_length']:g}: {p['tok_s']:.1f} tok/s per request "
            f"({p['speedup']:.2f}x baseline; {basis} {s['prediction_cycle_ms']:.2f} ms)"
        )
    return "\n".join(lines)


DESCRIPTION = (
    "Summarize a JSONL file written with SGLANG_VERIFY_PROFILE=1: time split of a "
    "speculative cycle, share spent in verify, break-even accept length against the baseline "
    "decode step, and predicted tok/s for given accept lengths."
)


_BARE = "\0bare"  # --json given without FILE


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`sglpatch profile-report`'s arguments; run() reads them."""
    p.add_argument("file", help="JSONL file written by the server (SGLANG_VERIFY_PROFILE_FILE)")
    p.add_argument(
        "--accept-length",
        type=positive,
        nargs="+",
        metavar="X",
        help="also predict tok/s at these accept lengths (tokens per cycle, bonus included)",
    )
    p.add_argument(
        "--baseline-step-ms",
        type=positive,
        metavar="MS",
        help="decode step without speculation, ms (default: the file's value, 12.2 = 82 tok/s)",
    )
    p.add_argument("--json", metavar="FILE", nargs="?", const=_BARE, help="also write the summary as JSON to FILE "
                   "('-': standard output, instead of the text)")


def run(args) -> int:
    """CLI entry: args.file, args.accept_length (list or None), args.baseline_step_ms, args.json."""
    records = load(args.file)
    summary = summarize(records, args.baseline_step_ms)
    preds = predictions(summary, list(args.accept_length or []))
    if args.json is _BARE:  # the old spelling: a flag for standard output
        print("sglpatch: warning: --json without FILE is an old spelling of --json -; it still works, and will be removed",
              file=sys.stderr)
        args.json = "-"
    if args.json != "-":
        print(format_text(str(args.file), summary, preds))
    if args.json:
        write_json(args.json, json.dumps({"file": str(args.file), "summary": summary, "predictions": preds}, indent=2))
    return 0
