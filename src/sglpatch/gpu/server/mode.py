"""Tier server, one mode: launch the patched SGLang server, wait for `/health`, run SGLang's own
`bench_serving` against it, stop every process started, and read back what the run left.

Launch in its own session with the profile's env; `/health` is waited for reacting only to real
crash lines (`CrashScanner`); the benchmark is

    python -m sglang.bench_serving --backend sglang --dataset-name custom --apply-chat-template
        --max-concurrency 1 --flush-cache --warmup-requests N --output-file bench-MODE.jsonl ...

from the same interpreter that serves (so the installed, patched sglang's tool).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import re
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglpatch.gpu.server.evidence import allreduce_backend
from sglpatch.gpu.server.report import bench_metrics, num_requests, read_bench, read_verify_profile, served_summary
from sglpatch.gpu.shared.step_runner import ManagedProcess, tail
from sglpatch.gpu.shared.profile import expand

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


# =========================================================================== env by sglang version


# =========================================================================== one mode


def run_server_mode(srv: dict, mode: dict, report_dir: Path, base_env: dict, python: str,
                    prompts_file: Path, ipc_by: str | None = None) -> dict:
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
        out["allreduce"] = allreduce_backend(log, env, cmd, ipc_by)
