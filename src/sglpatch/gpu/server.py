"""Tier server: the patched SGLang server, measured with SGLang's own `bench_serving`.

For each selected `[[server.modes]]`: launch the server (own session, profile env), wait for
`/health` reacting only to real crash lines, run

    python -m sglang.bench_serving --backend sglang --dataset-name custom --apply-chat-template
        --max-concurrency 1 --flush-cache --warmup-requests N --output-file bench-MODE.jsonl ...

from the same interpreter that serves (so the installed, patched sglang's tool), parse its
JSONL (never its stdout), stop every process started.  The report gives SGLang's metrics by
their names plus the derived single-stream tok/s = 1000 / median TPOT, which is what the
profile's baseline (82 tok/s) is compared with; what served (`/get_server_info`, the
patches the imported sglang carries, the env); and output parity between pairs of modes
(`[[server.parity]]`) or against an earlier report (`--parity-with`): greedy outputs that
differ fail the tier and the first difference is shown.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglpatch.gpu.allreduce_evidence import allreduce_backend, describe
from sglpatch.gpu.procs import ManagedProcess, tail
from sglpatch.gpu.profiles import expand, usage_error
from sglpatch.gpu.report import TierResult, fmt

# the numbers bench_serving writes to --output-file, by its own names
BENCH_METRICS = ("completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                 "output_throughput", "median_tpot_ms", "mean_tpot_ms", "p99_tpot_ms", "median_ttft_ms",
                 "mean_ttft_ms", "median_itl_ms", "median_e2e_latency_ms", "accept_length", "max_concurrency")
# server args worth a line in the report (the whole /get_server_info goes to server_info-MODE.json)
SERVER_ARG_KEYS = ("model_path", "tp_size", "dp_size", "ep_size", "random_seed", "mem_fraction_static",
                   "cuda_graph_max_bs", "attention_backend", "disable_custom_all_reduce",
                   "enable_flashinfer_allreduce_fusion", "disable_radix_cache", "chunked_prefill_size")

# =========================================================================== launch + health

FATAL_ANYWHERE = [re.compile(p) for p in (r"CUDA out of memory", r"torch\.OutOfMemoryError",
                                          r"RuntimeError: NCCL", r"NCCL error:? .*(unhandled|internal|invalid)")]
TRACEBACK = re.compile(r"^Traceback \(most recent call last\):")


class CrashScanner:
    """Reads a server log incrementally.  Reacts to real crash lines only: fatal patterns
    (CUDA OOM, NCCL runtime errors) at once; a top-level Traceback only together with
    the process exiting.  The word "Exception" in a warning means nothing."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.partial = ""
        self.in_tb = False
        self.last_exception_line: str | None = None
        self.last_line = ""

    def scan(self) -> str | None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
                self.offset = f.tell()
        except OSError:
            return None
        text = self.partial + chunk.decode(errors="replace")
        lines = text.split("\n")
        self.partial = lines.pop()
        fatal = None
        for ln in lines:
            ln = ln.rstrip("\r")
            if ln.strip():
                self.last_line = ln
            if TRACEBACK.match(ln):
                self.in_tb = True
                continue
            if self.in_tb and ln and not ln[0].isspace():
                self.last_exception_line = ln
                self.in_tb = False
            if fatal is None and any(p.search(ln) for p in FATAL_ANYWHERE):
                fatal = ln.strip()
        return fatal


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        return 0, b""


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, port)) == 0


def wait_healthy(mp: ManagedProcess, base_url: str, timeout_s: float, poll_s: float = 2.0,
                 scanner: CrashScanner | None = None) -> tuple[str, str]:
    """('healthy'|'crash'|'timeout', detail)."""
    scanner = scanner or CrashScanner(mp.log_path)
    t0 = time.monotonic()
    while True:
        mp.snapshot()
        fatal = scanner.scan()
        if fatal:
            return "crash", fatal
        rc = mp.poll()
        if rc is not None:
            scanner.scan()
            why = scanner.last_exception_line or scanner.last_line or "no output"
            return "crash", f"server exited with code {rc} while loading: {why}"
        code, _ = http_get(base_url + "/health", timeout=min(5.0, poll_s + 3))
        if code == 200:
            return "healthy", f"healthy after {time.monotonic() - t0:.1f} s"
        if time.monotonic() - t0 > timeout_s:
            return "timeout", (f"not healthy after {timeout_s} s (process alive); last log line: "
                               f"{scanner.last_line[:300]}")
        time.sleep(poll_s)


def server_command(srv: dict, mode: dict, python: str) -> list[str]:
    subs = {"python": python, "model_path": expand(srv["model_path"]), "tp": srv["tp"], "host": srv["host"],
            "port": srv["port"], "seed": srv["seed"]}
    fmt = lambda a: expand(str(a).format(**subs))  # noqa: E731
    return [fmt(a) for a in srv["command"]] + [fmt(a) for a in srv["launch_args"]] + [fmt(a) for a in mode["args"]]


# =========================================================================== the benchmark


def write_prompts(path: Path, prompts: list[str]) -> str:
    """bench_serving's `custom` dataset: one JSON line per prompt, a user turn and an (unused,
    --sharegpt-output-len fixes the length) assistant turn.  Returns the prompt set's digest."""
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"conversations": [{"role": "user", "content": p},
                                                  {"role": "assistant", "content": "(fixed length)"}]}) + "\n")
    return hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]


def bench_command(srv: dict, python: str, prompts_file: Path | str, out_file: Path | str) -> list[str]:
    b = srv["benchmark"]
    cmd = [python, "-m", "sglang.bench_serving", "--backend", "sglang",
           "--host", str(srv["host"]), "--port", str(srv["port"]),
           "--model", expand(srv["model_path"])]
    if b.get("tokenizer"):
        cmd += ["--tokenizer", expand(b["tokenizer"])]
    cmd += ["--dataset-name", "custom", "--dataset-path", str(prompts_file),
            "--num-prompts", str(num_requests(b)), "--sharegpt-output-len", str(b["max_new_tokens"])]
    if b.get("apply_chat_template", True):
        cmd.append("--apply-chat-template")
    cmd += ["--max-concurrency", "1", "--flush-cache", "--warmup-requests", str(b["warmup_requests"]),
            "--seed", str(srv["seed"]), "--output-file", str(out_file), "--output-details", "--disable-tqdm"]
    return cmd + [str(a) for a in b.get("extra_args", [])]


def num_requests(bench: dict) -> int:
    n = bench.get("num_requests")
    return len(bench["prompts"]) if n is None else int(n)


def bench_order(n_prompts: int, n: int, seed: int) -> list[int]:
    """Which prompt each of bench_serving's requests carries: its custom sampler runs after
    `random.seed(--seed)` and shuffles the prompts once (sglang 0.5.9)."""
    idx = list(range(n_prompts))
    random.Random(seed).shuffle(idx)
    return idx[:n]


def run_bench(server: ManagedProcess, scanner: CrashScanner, cmd: list[str], env: dict, log: Path,
              timeout_s: float) -> dict:
    """Run bench_serving while watching the server: a crash line or the server's death stops it."""
    t0 = time.monotonic()
    bp = ManagedProcess(cmd, env, log)
    why = None
    try:
        while bp.poll() is None:
            bp.snapshot()
            server.snapshot()
            fatal = scanner.scan()
            if fatal or server.poll() is not None:
                why = f"server crashed during the benchmark: {fatal or scanner.last_exception_line or scanner.last_line}"
                break
            if time.monotonic() - t0 > timeout_s:
                why = f"benchmark still running after {timeout_s} s (killed)"
                break
            time.sleep(0.2)
    finally:
        survivors = bp.stop(grace_s=5)
    return {"rc": bp.popen.returncode, "error": why, "survivors": survivors, "wall_s": round(time.monotonic() - t0, 1)}


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
    return {"records": len(recs), "last": recs[-1], "median_of_records": med,
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


def version_tuple(v: str | None) -> tuple[int, ...]:
    """"0.5.10.post1" -> (0, 5, 10); "" -> ()."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(v or ""))
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def version_env(srv: dict, version: str | None) -> tuple[dict, list[str]]:
    """The env [[server.version_env]] adds for this sglang version, and why (one line per rule)."""
    env, why = {}, []
    have = version_tuple(version)
    if not have:
        return env, why
    for rule in srv.get("version_env", []):
        lo, hi = version_tuple(rule["min_version"]), version_tuple(rule.get("max_version"))
        if have >= lo and (not hi or have < hi):
            env.update({k: str(v) for k, v in rule["env"].items()})
            why.append(f"sglang {version} >= {rule['min_version']}"
                       + (f" and < {rule['max_version']}" if hi else "") + f": {rule['env']}"
                       + (f" ({rule['why']})" if rule.get("why") else ""))
    return env, why


# =========================================================================== what served


def imported_sglang(python: str, env: dict, project: Path) -> dict:
    """Which sglang the server's interpreter imports and, when it is an sglpatch workdir
    (<workdir>/python/sglang), the patches it carries (stack.carried / stack.status)."""
    code = "import sglang, sys; print(sglang.__file__); print(getattr(sglang, '__version__', '?'))"
    try:
        p = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"python": python, "error": f"cannot run {python}: {e}"}
    if p.returncode != 0:
        return {"python": python, "error": "sglang does not import: " + (p.stderr.strip().splitlines() or ["?"])[-1]}
    lines = p.stdout.strip().splitlines()
    file, version = Path(lines[-2]).resolve(), lines[-1]
    out = {"python": python, "sglang_file": str(file), "sglang_version": version}
    workdir = file.parents[2] if len(file.parents) > 2 else file.parent
    if not (workdir / ".git").exists():
        out["patches_note"] = f"{file} is not in an sglpatch workdir (<workdir>/python/sglang): patches unknown"
        return out
    out["workdir"] = str(workdir)
    try:
        if not (project / "series").is_file():
            raise RuntimeError(f"no sglpatch series in {project} (pass --project)")
        from sglpatch.gpu.series_side import patches_of

        out.update(patches_of(project, workdir))
    except Exception as e:  # noqa: BLE001 — a record, not a verdict (GitPython may be absent on the box)
        out["patches_note"] = f"cannot read the workdir's patches: {type(e).__name__}: {e}"
    return out


# =========================================================================== one mode


def run_server_mode(srv: dict, mode: dict, report_dir: Path, base_env: dict, python: str,
                    prompts_file: Path) -> dict:
    name = mode["name"]
    out: dict = {"mode": name}
    host, port = srv["host"], int(srv["port"])
    if port_in_use(host, port):
        out.update(status="fail", error=f"port {host}:{port} already in use before launch (a server still "
                                        "running?); stop it or change server.port")
        return out
    env = dict(base_env)
    added = {k: str(v) for k, v in {**srv.get("env", {}), **mode.get("env", {})}.items()}
    env.update(added)
    out["env_added"] = added
    vp = report_dir / f"verify_profile-{name}.jsonl"
    with contextlib.suppress(FileNotFoundError):
        vp.unlink()
    # P4's verify profile is switched on per mode (SGLANG_VERIFY_PROFILE=1 in the mode's env);
    # the file always goes to the report folder
    env["SGLANG_VERIFY_PROFILE_FILE"] = str(vp)
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = server_command(srv, mode, python)
    out["command"] = cmd
    log = report_dir / f"server-{name}.log"
    out["log"] = log.name
    base_url = f"http://{host}:{port}"
    t0 = time.monotonic()
    mp = ManagedProcess(cmd, env, log)
    scanner = CrashScanner(log)
    try:
        state, detail = wait_healthy(mp, base_url, float(srv["health_timeout_s"]), float(srv["poll_s"]), scanner)
        out["health"] = {"state": state, "detail": detail, "after_s": round(time.monotonic() - t0, 1)}
        if state != "healthy":
            out.update(status="fail", error=f"{state}: {detail}")
            return out
        bench_out = report_dir / f"bench-{name}.jsonl"
        with contextlib.suppress(FileNotFoundError):
            bench_out.unlink()  # bench_serving appends
        bcmd = bench_command(srv, python, prompts_file, bench_out)
        benv = dict(base_env)
        benv.update({k: str(v) for k, v in srv["benchmark"].get("env", {}).items()})
        benv.setdefault("PYTHONUNBUFFERED", "1")
        out["bench_command"] = bcmd
        out["bench_log"] = f"bench-{name}.log"
        run = run_bench(mp, scanner, bcmd, benv, report_dir / out["bench_log"],
                        float(srv["benchmark"]["timeout_s"]))
        out["bench_run"] = run
        rec = read_bench(bench_out)
        if rec is not None:
            out["bench_file"] = bench_out.name
            out["benchmark"] = bench_metrics(rec)
            info = rec.get("server_info")
            if isinstance(info, dict):
                (report_dir / f"server_info-{name}.json").write_text(json.dumps(info, indent=1, default=str) + "\n")
            out["served"] = served_summary(info)
            errs = [e for e in rec.get("errors") or [] if e]
            if errs:
                out["bench_errors"] = [e.strip().splitlines()[-1][:300] for e in errs[:3]]
        error = run["error"]
        if error is None and run["rc"] != 0:
            error = (f"bench_serving exited {run['rc']}: "
                     f"{tail(report_dir / out['bench_log'], 3).strip() or 'no output'}")
        if error is None and rec is None:
            error = f"bench_serving wrote no result to {bench_out.name}"
        want = num_requests(srv["benchmark"])
        if error is None and (rec.get("completed") or 0) < want:
            error = (f"{rec.get('completed')}/{want} requests completed"
                     + (f": {out['bench_errors'][0]}" if out.get("bench_errors") else ""))
        if error:
            out.update(status="fail", error=error + f"; server alive: {mp.poll() is None}")
            return out
        mp.snapshot()
        out["status"] = "ok"
        return out
    finally:
        survivors = mp.stop(float(srv["stop_grace_s"]))
        out["tracked_pids"] = sorted(mp.seen)
        out["survivors"] = survivors
        if survivors:
            out["status"] = "fail"
            out["error"] = (out.get("error", "") + f"; processes {survivors} survived the stop").lstrip("; ")
        out["verify_profile"] = read_verify_profile(vp)
        out["allreduce"] = allreduce_backend(log, env, cmd)


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


# =========================================================================== the tier


def select_modes(srv: dict, modes: str | None) -> list[dict]:
    if not modes:
        return [m for m in srv["modes"] if not m.get("optional")]
    names = [x.strip() for x in modes.split(",") if x.strip()]
    if names == ["all"]:
        return list(srv["modes"])
    known = {m["name"]: m for m in srv["modes"]}
    bad = [n for n in names if n not in known]
    if bad:
        raise usage_error(f"--modes: unknown mode(s) {bad}; the profile has {sorted(known)}")
    return [known[n] for n in names]


def tier_server(prof: dict, project: Path, report_dir: Path, base_env: dict, modes: str | None = None,
                parity_with: str | None = None, side_env: dict | None = None, doctor: bool = False) -> TierResult:
    """side_env: the env of one side of an A/B run (server_ab), over [server.env] and the
    version rules, under each mode's env. doctor: `sglpatch doctor` first; a failed check refuses the load."""
    tr = TierResult("server")
    srv = prof.get("server")
    if not srv:
        tr.status = "cannot_run"
        tr.summary = f"profile {prof.get('_path') or '(none)'} has no [server] section"
        return tr
    selected = select_modes(srv, modes)
    old = None
    if parity_with:
        old_path = Path(parity_with) / "report.json"
        if not old_path.is_file():
            raise usage_error(f"--parity-with {parity_with}: no report.json there")
        old = json.loads(old_path.read_text())
    bench = srv["benchmark"]
    if num_requests(bench) > len(bench["prompts"]) or num_requests(bench) < 1:
        raise usage_error(f"[server.benchmark] num_requests = {num_requests(bench)} needs as many distinct prompts "
                     f"(has {len(bench['prompts'])}); repeated prompts would hit the radix cache")
    python = expand(srv["python"] or sys.executable)
    if doctor:
        from sglpatch.gpu.doctor import gate_server

        refused = gate_server(prof, python, project, report_dir, {**base_env, **srv.get("env", {})})
        if refused is not None:
            return refused
    prompts_file = report_dir / "bench-prompts.jsonl"
    digest = write_prompts(prompts_file, bench["prompts"])
    tr.data["prompts"] = {"file": prompts_file.name, "sha": digest, "count": len(bench["prompts"])}
    tr.data["profile_env"] = prof.get("env", {})
    tr.data["served_by"] = imported_sglang(python, base_env, project)
    venv, why = version_env(srv, tr.data["served_by"].get("sglang_version"))
    if venv or side_env:
        srv = {**srv, "env": {**srv.get("env", {}), **venv, **{k: str(v) for k, v in (side_env or {}).items()}}}
    tr.data["version_env"] = why
    tr.data["side_env"] = side_env or {}
    from sglpatch.gpu.mode_requires import split  # a mode's requires_import / min_sglang, before any load

    selected, tr.data["skipped_modes"] = split(selected, python, base_env, tr.data["served_by"].get("sglang_version"))
    if not selected:
        tr.status, tr.summary = "cannot_run", "; ".join(f"{m['mode']}: {m['why']}" for m in tr.data["skipped_modes"])
        return tr
    results = [run_server_mode(srv, mode, report_dir, base_env, python, prompts_file) for mode in selected]
    tr.data["modes"] = results
    tr.md = mode_table(tr, srv, selected, results)
    tr.md += [f"\n- mode {m['mode']} not run: {m['why']}" for m in tr.data["skipped_modes"]]
    first_token = token_differ(python, expand(bench.get("tokenizer") or srv["model_path"]), base_env)
    tr.data["parity"] = parity_checks(tr, srv, report_dir, results, old, parity_with, digest, first_token)
    tr.md += parity_markdown(tr.data["parity"]) + served_markdown(tr.data["served_by"], results)
    tr.md += [f"- env by version ([[server.version_env]]): {w}" for w in why]
    if side_env:
        tr.md.append(f"- env of this A/B side: {side_env}")
    tr.md += ["", "Commands and logs (rerun a benchmark by hand against a running server with the "
              "bench command):"]
    for m in results:
        tr.md.append(f"- {m['mode']}: server `{shlex.join(m.get('command', []))}` (log `{m.get('log')}`, "
                     f"tracked pids {len(m.get('tracked_pids', []))}, survivors {m.get('survivors')}); env added "
                     f"{m.get('env_added')}")
        if m.get("bench_command"):
            benv = srv["benchmark"].get("env") or {}
            tr.md.append(f"  - bench: `{shlex.join(m['bench_command'])}` (log `{m.get('bench_log')}`"
                         + (f", env added {benv}" if benv else "") + ")")
    if tr.status != "fail":
        tr.status = "pass"
    tr.summary = "; ".join(f"{m['mode']}: {fmt((m.get('benchmark') or {}).get('single_stream_tok_s'))} tok/s"
                           + ("" if m.get("status") == "ok" else " (failed)") for m in results)
    bad = [p["name"] for p in tr.data["parity"] if p["status"] != "same"]
    if tr.data["parity"]:
        tr.summary += "; parity " + (f"FAILED: {', '.join(bad)}" if bad else "same")
    return tr


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
                        "detail": "not both modes ran (select them with --modes " f"{pair['a']},{pair['b']})"})
            continue
        out.append(compare_outputs(pair["name"], pair["a"], read_texts(report_dir, a), pair["b"],
                                   read_texts(report_dir, b), bench["prompts"], order, first_token))
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
                out.append(compare_outputs(name, f"{old_dir}:{m['mode']}", read_texts(old_dir, old_modes[m["mode"]]),
                                           f"this run:{m['mode']}", read_texts(report_dir, m),
                                           bench["prompts"], order, first_token))
    for p in out:
        if p["status"] in ("differ", "fail"):
            tr.fail(f"parity {p['name']}: {p['detail']}")
    return out


def parity_markdown(checks: list[dict]) -> list[str]:
    if not checks:
        return []
    md = ["", "### Output parity (greedy, same prompts; text as bench_serving records it)", "",
          "| check | a | b | result |", "|---|---|---|---|"]
    for p in checks:
        verdict = {"same": "SAME", "differ": "**DIFFERS**", "fail": "**FAILED**", "not_run": "not run"}[p["status"]]
        md.append(f"| {p['name']} | {p.get('a', '')} | {p.get('b', '')} | {verdict}: {p['detail']} |")
    return md


def served_markdown(by: dict, modes: list[dict]) -> list[str]:
    md = ["", "### What served", ""]
    if by.get("error"):
        md.append(f"- imported sglang: {by['error']}")
    else:
        md.append(f"- `{by.get('python')}` imports sglang {by.get('sglang_version')} from `{by.get('sglang_file')}`")
    if by.get("carried") is not None:
        md.append(f"- workdir `{by['workdir']}` carries {len(by['carried'])} patch(es): "
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
