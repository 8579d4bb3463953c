"""Summarize an EAGLE cycle profile written by patch 0004 (SGLANG_VERIFY_PROFILE_FILE).

Each line of the file is one JSON object covering `cycles` speculative cycles:
per-phase times (`draft_ms_*`, `verify_ms_*`, `extend_ms_*`, `cycle_ms_*` with
`_median`, `_p90`, `_mean`), `accept_length` (tokens committed per request per
cycle, bonus token included) and `baseline_step_ms` (decode step without
speculation).

The arithmetic (also in docs/p4-verify-profiling.md):
  T  = mean cycle time in ms over all cycles (interval means weighted by cycles)
  L  = mean accept length (weighted the same way)
  B  = baseline decode step in ms (82 tok/s -> 12.2 ms)
  tok/s           = 1000 * L / T
  verify fraction = sum of verify time / sum of cycle time
  break-even L*   = T / B      (speculation wins iff L > L*; 30 ms / 12.2 ms = 2.46)
  predicted tok/s for another accept length X at the same T = 1000 * X / T
Time the scheduler spends between cycles is not in T, so tok/s is an upper bound.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from sglpatch.errors import SglpatchError

DEFAULT_BASELINE_STEP_MS = 12.2
PHASES = ("draft", "verify", "extend", "cycle")
REQUIRED = ("cycles", "accept_length") + tuple(f"{p}_ms_mean" for p in PHASES)


def load(path: str | Path) -> list[dict]:
    """Read the JSONL file; raise SglpatchError with a one-line reason if unusable."""
    path = Path(path)
    hint = "write one by launching SGLang with SGLANG_VERIFY_PROFILE=1 SGLANG_VERIFY_PROFILE_FILE=<file> (patch 0004)"
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


def summarize(records: list[dict], baseline_step_ms: float | None = None) -> dict:
    """Combine interval records into one summary (weights: cycles per interval)."""
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
    s["accept_length"] = wmean("accept_length")
    s["tok_s"] = predicted_tok_s(cycle_ms, s["accept_length"])
    s["baseline_step_ms"] = baseline_step_ms
    s["baseline_source"] = baseline_source
    s["baseline_tok_s"] = 1000.0 / baseline_step_ms
    s["break_even_accept_length"] = break_even_accept_length(cycle_ms, baseline_step_ms)
    s["speedup"] = s["tok_s"] / s["baseline_tok_s"]
    return s


def predictions(summary: dict, accept_lengths: list[float]) -> list[dict]:
    """Predicted tok/s at the measured cycle time for each hypothetical accept length."""
    out = []
    for x in accept_lengths:
        tok_s = predicted_tok_s(summary["cycle_ms_mean"], x)
        out.append({"accept_length": x, "tok_s": tok_s, "speedup": tok_s / summary["baseline_tok_s"]})
    return out


def format_text(path: str, summary: dict, preds: list[dict]) -> str:
    s = summary
    lines = [
        f"{path}: {s['cycles']} cycles in {s['intervals']} interval(s)",
        "  mean ms per cycle: draft {:.2f}  verify {:.2f}  extend {:.2f}  cycle {:.2f}".format(
            s["draft_ms_mean"], s["verify_ms_mean"], s["extend_ms_mean"], s["cycle_ms_mean"]
        ),
    ]
    if s["cycle_ms_p90_max"] is not None:
        lines.append(f"  worst interval p90 cycle: {s['cycle_ms_p90_max']:.2f} ms")
    lines += [
        f"  verify share of cycle: {100 * s['verify_frac']:.1f}%",
        f"  accept length: {s['accept_length']:.2f} -> {s['tok_s']:.1f} tok/s",
        f"  baseline: {s['baseline_step_ms']:g} ms/step = {s['baseline_tok_s']:.1f} tok/s ({s['baseline_source']})",
        f"  break-even accept length: {s['break_even_accept_length']:.2f} (= cycle {s['cycle_ms_mean']:.2f} ms / baseline {s['baseline_step_ms']:g} ms)",
    ]
    if s["accept_length"] > s["break_even_accept_length"]:
        lines.append(f"  verdict: speculation is {s['speedup']:.2f}x the baseline")
    else:
        lines.append(
            f"  verdict: speculation is SLOWER ({s['speedup']:.2f}x the baseline); raise the accept length above "
            f"{s['break_even_accept_length']:.2f} or cut verify time, else serve without speculation"
        )
    for p in preds:
        lines.append(
            f"  predicted at accept length {p['accept_length']:g}: {p['tok_s']:.1f} tok/s ({p['speedup']:.2f}x baseline)"
        )
    return "\n".join(lines)


def run(args) -> int:
    """CLI entry: args.file, args.accept_length (list or None), args.baseline_step_ms, args.json."""
    records = load(args.file)
    summary = summarize(records, args.baseline_step_ms)
    preds = predictions(summary, list(args.accept_length or []))
    if args.json:
        print(json.dumps({"file": str(args.file), "summary": summary, "predictions": preds}, indent=2))
    else:
        print(format_text(str(args.file), summary, preds))
    return 0
