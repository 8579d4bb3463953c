"""Tier server, the report: what a run left, read back, compared and written as markdown.

bench_serving's `--output-file` JSONL (never its stdout) gives SGLang's metrics by their names
plus the derived single-stream tok/s = 1000 / median TPOT, which is what the profile's baseline
(82 tok/s) is compared with (`mode_table` gates it); `/get_server_info` and the imported sglang's
patches say what served; P4's verify profile gives the verify ms; output parity compares the
greedy texts of two modes (`[[server.parity]]`) or of an earlier report (`--parity-with`) and
shows the first difference (server/parity.py adds the EAGLE-3 accept length and judges a pair).
`server` runs the tier and calls these.
"""

from __future__ import annotations

import contextlib
import json
import random
import shlex
import statistics
import subprocess
from pathlib import Path

from sglpatch.gpu.server.evidence import describe
from sglpatch.gpu.shared.report import TierResult, fmt

# the numbers bench_serving writes to --output-file, by its own names
BENCH_METRICS = ("completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                 "output_throughput", "median_tpot_ms", "mean_tpot_ms", "p99_tpot_ms", "median_ttft_ms",
                 "mean_ttft_ms", "median_itl_ms", "median_e2e_latency_ms", "accept_length", "max_concurrency")
# server args worth a line in the report (the whole /get_server_info goes to server_info-MODE.json)
SERVER_ARG_KEYS = ("model_path", "tp_size", "dp_size", "ep_size", "random_seed", "mem_fraction_static",
                   "cuda_graph_max_bs", "attention_backend", "disable_custom_all_reduce",
                   "enable_flashinfer_allreduce_fusion", "disable_radix_cache", "chunked_prefill_size")

# =========================================================================== what bench_serving was asked


def num_requests(bench: dict) -> int:
    n = bench.get("num_requests")
    return len(bench["prompts"]) if n is None else int(n)


def bench_order(n_prompts: int, n: int, seed: int) -> list[int]:
    """Which prompt each of bench_serving's requests carries: its custom sampler runs after
    `random.seed(--seed)` and shuffles the prompts once (sglang 0.5.9)."""
    idx = list(range(n_prompts))
    random.Random(seed).shuffle(idx)
    return idx[:n]


# =========================================================================== bench_serving's results


def read_bench(path: Path) -> dict | None:
    """The last JSON line bench_serving appended to --output-file."""
    if not path.is_file():
        return None
    for ln in reversed(path.read_text(errors="replace").splitlines()):
        with contextlib.suppress(json.JSONDecodeError):
            rec = json.loads(ln)
            if isinstance(rec, dict):
                return rec
    return None


def bench_metrics(rec: dict) -> dict:
    m = {k: rec.get(k) for k in BENCH_METRICS}
    tpot = rec.get("median_tpot_ms")
    m["single_stream_tok_s"] = round(1000.0 / tpot, 2) if tpot else None
    return m


def served_summary(info: dict | None) -> dict:
    if not isinstance(info, dict):
        return {}
    out = {"version": info.get("version")}
    out["server_args"] = {k: info[k] for k in SERVER_ARG_KEYS if k in info}
    out["speculative"] = {k: v for k, v in info.items() if k.startswith("speculative_") and v is not None}
    states = info.get("internal_states") or [{}]
    if isinstance(states, list) and states and isinstance(states[0], dict):
        out["avg_spec_accept_length"] = states[0].get("avg_spec_accept_length")
    return out


# =========================================================================== P4's verify profile


def _find_key(obj, key):
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            r = _find_key(v, key)
            if r is not None:
                return r
    elif isinstance(obj, list):
        for v in obj:
            r = _find_key(v, key)
            if r is not None:
                return r
    return None


def read_verify_profile(path: Path) -> dict | None:
    """P4's JSON lines (draft_ms/verify_ms/extend_ms/cycle_ms, accept_length, tok_s,
    break_even_accept_length); returns the last record plus medians of numeric fields."""
    if not path.is_file():
        return None
    recs = []
    for ln in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            r = json.loads(ln)
            if isinstance(r, dict):
                recs.append(r)
    if not recs:
        return {"records": 0}
    med = {}
    for key in {k for r in recs for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}:
        vals = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
        med[key] = statistics.median(vals)
    # committed tokens over request-steps, summed: the accept length over the whole file (parity.py)
    sums = {k: sum(r[k] for r in recs if isinstance(r.get(k), (int, float))) for k in ("tokens", "requests", "cycles")}
    return {"records": len(recs), "last": recs[-1], "median_of_records": med, "sums": sums,
            "break_even_accept_length": _find_key(recs[-1], "break_even_accept_length")}


def verify_ms_of(vp: dict | None) -> float | None:
    """P4's verify ms: the median over the file's records of `verify_ms_median` (P4's record,
    version 2; one record per `interval` cycles), else a nested `verify_ms.median`."""
    vp = vp or {}
    v = (vp.get("median_of_records") or {}).get("verify_ms_median")
    if v is None:
        v = (vp.get("last") or {}).get("verify_ms")
        if isinstance(v, dict):
            v = v.get("median", v.get("p50"))
    return round(float(v), 3) if isinstance(v, (int, float)) else None


# =========================================================================== output parity


def read_texts(report_dir: Path, mode: dict) -> list[str] | None:
    if not mode.get("bench_file"):
        return None
    rec = read_bench(Path(report_dir) / mode["bench_file"])
    texts = (rec or {}).get("generated_texts")
    return texts if isinstance(texts, list) else None


def first_difference(a: list[str], b: list[str]) -> dict | None:
    """None when equal; else the first differing request and character position."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            pos = next((k for k, (c, d) in enumerate(zip(x, y)) if c != d), min(len(x), len(y)))
            lo = max(0, pos - 40)
            words = len(x[:pos].split()) - (1 if pos and not x[pos - 1].isspace() else 0)
            return {"request": i, "char": pos, "a": x[lo:pos + 40], "b": y[lo:pos + 40],
                    "common_prefix_words": words}
    if len(a) != len(b):
        return {"request": min(len(a), len(b)), "char": 0, "a": f"{len(a)} outputs", "b": f"{len(b)} outputs",
                "common_prefix_words": 0}
    return None


def token_differ(python: str, tokenizer: str, env: dict):
    """first(a, b) -> index of the first differing token of two texts, both retokenized with the
    model's tokenizer (the one bench_serving loads), or None when it cannot be loaded; best
    effort, for the report (bench_serving records text, not token ids)."""
    code = ("import sys, json; from transformers import AutoTokenizer; "
            "t = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True); "
            "a, b = (t.encode(x, add_special_tokens=False) for x in json.load(sys.stdin)); "
            "print(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))")

    def first(a: str, b: str) -> int | None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired, ValueError, IndexError):
            p = subprocess.run([python, "-c", code, tokenizer], input=json.dumps([a, b]), env=env,
                               capture_output=True, text=True, timeout=300)
            return int(p.stdout.split()[-1]) if p.returncode == 0 else None
        return None

    return first


def compare_outputs(name: str, a_label: str, a_texts, b_label: str, b_texts, prompts: list[str],
                    order: list[int], first_token=None) -> dict:
    res = {"name": name, "a": a_label, "b": b_label}
    if a_texts is None or b_texts is None:
        missing = [lbl for lbl, t in ((a_label, a_texts), (b_label, b_texts)) if t is None]
        res.update(status="fail", detail=f"no outputs from {', '.join(missing)}")
        return res
    diff = first_difference(a_texts, b_texts)
    res["requests"] = len(a_texts)
    if diff is None:
        res.update(status="same", detail=f"{len(a_texts)} greedy outputs identical")
        return res
    i = diff["request"]
    prompt = prompts[order[i]] if i < len(order) and order[i] < len(prompts) else "?"
    if first_token and i < min(len(a_texts), len(b_texts)):
        diff["token"] = first_token(a_texts[i], b_texts[i])
    where = (f"token {diff['token']} (retokenized), " if diff.get("token") is not None else "") + \
        f"character {diff['char']}"
    res.update(status="differ", first_difference={**diff, "prompt": prompt},
               detail=(f"request {i} (prompt {prompt[:60]!r}) differs at {where} "
                       f"(after {diff['common_prefix_words']} equal words): {a_label} …{diff['a']!r}… vs "
                       f"{b_label} …{diff['b']!r}…"))
    return res


# =========================================================================== the markdown


def mode_table(tr: TierResult, srv: dict, cfgs: list[dict], modes: list[dict]) -> list[str]:
    base = srv["baselines"]
    tol = float(base.get("tolerance", 0.05))
    ref = base.get("no_spec_tok_s")
    floor = ref * (1 - tol) if ref else None
    chat = "chat-templated " if srv["benchmark"].get("apply_chat_template", True) else "raw (no chat template) "
    md = [f"Measured with SGLang's own `python -m sglang.bench_serving` (greedy, `--max-concurrency 1`, "
          f"{num_requests(srv['benchmark'])} distinct {chat}prompts, radix cache flushed after the "
          "warm-up). Columns are bench_serving's metrics by their names; **single-stream tok/s = 1000 / "
          "median TPOT** is derived here (TPOT excludes the first token) and is the number compared with the "
          f"profile's baseline of {ref} tok/s (tolerance {tol:.0%}), a single-stream decode rate. SGLang's "
          "output throughput also counts TTFT and the gaps between requests, so it is lower; it is not gated.",
          "", "| mode | status | single-stream tok/s (1000/median TPOT) | median TPOT ms | median TTFT ms | "
          "output throughput tok/s | accept length | verify ms (P4) | break-even accept | vs baseline | "
          "allreduce (from the log) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, m in zip(cfgs, modes):
        b = m.get("benchmark") or {}
        tok = b.get("single_stream_tok_s")
        spec = "--speculative-algorithm" in [str(a) for a in cfg.get("args", [])]
        vp = m.get("verify_profile") or {}
        vms = verify_ms_of(vp)
        verdict = "—"
        if m.get("status") != "ok":
            tr.fail(f"mode {m['mode']}: {m.get('error')}")
            verdict = "failed"
        elif tok is None:
            tr.fail(f"mode {m['mode']}: no TPOT measured")
        elif floor is not None:
            pays = tok > ref if spec else tok >= floor
            m["beats_baseline"] = pays
            verdict = f"{tok / ref:.2f}x of {ref}"
            if spec:
                verdict += " — speculation PAYS" if pays else " — speculation does NOT pay"
            if not pays and cfg.get("gate", True):
                tr.fail(f"mode {m['mode']}: {tok} tok/s (1000/median TPOT) "
                        + (f"does not beat the {ref} tok/s baseline" if spec
                           else f"below {floor:.1f} (baseline {ref} - {tol:.0%})"))
            elif not pays:
                verdict += " (not gated)"
        acc = b.get("accept_length") or (m.get("served") or {}).get("avg_spec_accept_length")
        md.append(f"| {m['mode']} | {m.get('status')} | {fmt(tok)} | {fmt(b.get('median_tpot_ms'), 2)} | "
                  f"{fmt(b.get('median_ttft_ms'), 1)} | {fmt(b.get('output_throughput'))} | {fmt(acc, 2)} | "
                  f"{fmt(vms, 2)} | {fmt(vp.get('break_even_accept_length'), 2)} | {verdict} | "
                  f"{describe(m.get('allreduce'))} |")
    first = modes[0] if modes else None
    t0 = ((first or {}).get("benchmark") or {}).get("single_stream_tok_s")
    for m in modes[1:]:
        t1 = (m.get("benchmark") or {}).get("single_stream_tok_s")
        if t0 and t1:
            m["speedup_vs_first_this_run"] = round(t1 / t0, 3)
            md.append(f"\n{m['mode']} vs {first['mode']} in this run: {t1 / t0:.2f}x")
    return md


def served_markdown(by: dict, modes: list[dict]) -> list[str]:
    md = ["", "### What served", ""]
    if by.get("error"):
        md.append(f"- imported sglang: {by['error']}")
    else:
        md.append(f"- `{by.get('python')}` imports sglang {by.get('sglang_version')} from `{by.get('sglang_file')}`")
    if by.get("carried") is not None:
        md.append(f"- workdir `{by['workdir']}`" + (f", line {by['line']}," if by.get("line") else "")
                  + f" carries {len(by['carried'])} patch(es): "
                  + ("; ".join(by["carried"]) or "none"))
        state = [ln for ln in by.get("status", []) if ln.startswith(("state:", "dirty:"))]
        md += [f"  - {ln}" for ln in state]
    elif by.get("patches_note"):
        md.append(f"- patches: {by['patches_note']}")
    for m in modes:
        s = m.get("served") or {}
        if s:
            md.append(f"- {m['mode']}: /get_server_info version {s.get('version')}; args {s.get('server_args')}; "
                      f"speculative {s.get('speculative') or 'off'} (full: `server_info-{m['mode']}.json`)")
        ev = m.get("allreduce")
        if ev:
            md.append(f"- {m['mode']}: allreduce **{describe(ev)}**; evidence: "
                      + (f"`{ev['evidence']}`" if ev.get("evidence") else "none in the log")
                      + (f"; fusion: `{ev['fusion']}`" if ev.get("fusion") else "")
                      + f"; selected by {ev['selected_by'] or 'no switch set'}")
    return md


def tier_markdown(srv: dict, data: dict, parity_md: list[str]) -> list[str]:
    """What follows the mode table: modes not run, parity (server/parity.py's lines), what served,
    the env by version and of an A/B side, the commands and logs (to rerun a benchmark by hand)."""
    results = data["modes"]
    md = [f"\n- mode {m['mode']} not run: {m['why']}" for m in data["skipped_modes"]]
    md += parity_md + served_markdown(data["served_by"], results)
    md += [f"- env by version ([[server.version_env]]): {w}" for w in data["version_env"]]
    if data["side_env"]:
        md.append(f"- env of this A/B side: {data['side_env']}")
    md += ["", "Commands and logs (rerun a benchmark by hand against a running server with the "
           "bench command):"]
    for m in results:
        md.append(f"- {m['mode']}: server `{shlex.join(m.get('command', []))}` (log `{m.get('log')}`, "
                  f"tracked pids {len(m.get('tracked_pids', []))}, survivors {m.get('survivors')}); env added "
                  f"{m.get('env_added')}")
        if m.get("bench_command"):
            benv = srv["benchmark"].get("env") or {}
            md.append(f"  - bench: `{shlex.join(m['bench_command'])}` (log `{m.get('bench_log')}`"
                      + (f", env added {benv}" if benv else "") + ")")
    return md
