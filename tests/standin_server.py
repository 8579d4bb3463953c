"""A small real HTTP server standing in for `python -m sglang.launch_server` in tests.

It speaks every endpoint `python -m sglang.bench_serving --backend sglang` (0.5.9) calls:
GET /health (200 once "loaded", 503 before), GET /v1/models (the --model-path as the
served model), POST /generate (non-streaming JSON, or `"stream": true` server-sent events
with the cumulative text and meta_info.completion_tokens, spec_verify_ct when speculating,
ending in `data: [DONE]`), GET|POST /flush_cache, and GET /get_server_info (the server
args it was started with as SGLang's flat dict, internal_states[0].avg_spec_accept_length,
version).  Each request is logged ("standin: POST /generate prompt=...") so a test can see
what the benchmark sent.

Output is greedy-like: the words of a completion are a fixed function of the prompt and
the position (sha256), so two runs give the same text.  --perturb-env NAME changes the
word at --perturb-pos when the environment variable NAME is set to a value other than
"" / "0" (a stand-in for a patch that changes the numerics), for the parity tests.
--fail-after N logs "RuntimeError: NCCL error" at request N+1 and never answers it;
--hang-after N never answers request N+1 and logs nothing (a silent deadlock).
--accept-drop-env NAME lowers a speculating server's accept length by --accept-drop (0.5) when NAME
is on, the text unchanged: corrupted hidden states handed to the drafter (issue 53).

Modes (--mode):
  fast   healthy at once
  slow   loads for --load-s seconds printing harmless warnings that contain the word
         "Exception" and even a top-level Traceback of an optional import, then healthy
  crash  prints a Traceback after --load-s and exits 1 (like a failed weight load)
  oom    prints "torch.OutOfMemoryError: CUDA out of memory" and stays alive, never healthy
  hang   stays alive, never healthy

At start it spawns a child in its own process group and, from that child, a grandchild
that leaves the session (setsid) and ignores SIGTERM, like a stubborn worker; their PIDs
go to --pid-file as JSON so a test can prove that the orchestrator ended them all.
With SGLANG_VERIFY_PROFILE=1 and SGLANG_VERIFY_PROFILE_FILE set and --accept-length > 1
it appends one JSON line per request in P4's format (version 2: `verify_ms_median`, ...).

A second "install" for the A/B tests: STANDIN_SGLANG_VERSION (default 0.0.0-standin) is the
version /get_server_info reports and picks the series the stand-in plays: below 0.5.21 it
carries P2 and P5 (with SGLANG_ENABLE_PCIE_CUSTOM_AR=1 it logs P2's custom-allreduce line, else
with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 P5's workspace and start-up lines), from 0.5.21 P2 is gone
and SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 gives upstream's PCIe-IPC lines;
otherwise SGLang's "Custom allreduce is disabled" warning (NCCL serves).  The lines are the
real modules' messages.  STANDIN_SPEED multiplies --tok-s, STANDIN_ACCEPT_LENGTH replaces
--accept-length where it is above 1 (a speculating mode).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOADED = threading.Event()
ARGS = None
GENERATED = [0]
COUNT_LOCK = threading.Lock()

GRANDCHILD = (
    "import signal, time, os\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "while True: time.sleep(1)\n"
)
CHILD = (
    "import subprocess, sys, time, json, os\n"
    "g = subprocess.Popen([sys.executable, '-c', sys.argv[1]], start_new_session=True)\n"
    "open(sys.argv[2], 'w').write(json.dumps({'child': os.getpid(), 'grandchild': g.pid}))\n"
    "while True: time.sleep(1)\n"
)


def log(msg: str) -> None:
    print(msg, flush=True)


def version() -> str:
    return os.environ.get("STANDIN_SGLANG_VERSION", "0.0.0-standin")


def _on(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0", "false")


def log_allreduce_init() -> None:
    """What SGLang's allreduce set-up logs on TP0 (the messages of the real modules)."""
    rel = tuple(int(x) for x in version().split("-")[0].split(".")[:3] if x.isdigit())
    world = ARGS.tp
    pre = "[2026-01-01 00:00:00 TP0] "
    if rel < (0, 5, 21) and _on("SGLANG_ENABLE_PCIE_CUSTOM_AR"):  # P2 (patches/0002)
        log(pre + f"Custom allreduce on {world} PCIe-only GPUs for tensors up to 65536 bytes "
            "(captured batch 8 x 4 tokens x hidden 7168 x 2 bytes, at most 8388608 (one-stage kernel)), NCCL above.")
        return
    log(pre + "Custom allreduce is disabled because it's not supported on more than two PCIe-only GPUs. "
        "To silence this warning, specify disable_custom_all_reduce=True explicitly.")
    if rel < (0, 5, 21) and _on("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"):  # P5 (patches/0005)
        log(pre + f"PCIe-IPC allreduce on {world} GPUs: workspace 11.1 MiB per GPU, bf16 reductions up to 172032 "
            "elements (24 rows of 7168, widest captured reduction 24 rows); buckets [3, 6, 12, 24]; seed launch "
            "configurations (SGLANG_PCIE_IPC_TUNE; the tuning step: python -m "
            "sglang.srt.distributed.device_communicators.pcie_ipc_tune).")
        log(pre + f"Decode/verify allreduce: PCIe-IPC (world_size={world}).")
        return
    if rel >= (0, 5, 21) and _on("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"):  # upstream pcie_ipc_ar.py
        log(pre + f"FlashInfer PCIe-IPC all-reduce enabled (world={world}, workspace sized on first reduction)")
        log(pre + f"FlashInfer PCIe-IPC workspace built (world={world}, max_numel=57344, hidden=7168)")


def completion(prompt: str, n: int) -> str:
    """The first n words of the completion of prompt: fixed per (prompt, position)."""
    words = []
    perturb = ARGS.perturb_env and os.environ.get(ARGS.perturb_env, "") not in ("", "0")
    for i in range(n):
        k = int(hashlib.sha256(f"{prompt}\0{i}".encode()).hexdigest()[:8], 16) % 200
        if perturb and i == ARGS.perturb_pos:
            k = (k + 1) % 200
        words.append(f"w{k}")
    return " ".join(words)


def server_info() -> dict:
    """Like SGLang's: the server args (flat), scheduler info, internal states, version."""
    st = {"avg_spec_accept_length": ARGS.accept_length} if ARGS.accept_length > 1 else {}
    args = {"model_path": ARGS.model_path, "tp_size": ARGS.tp, "random_seed": ARGS.random_seed,
            "speculative_algorithm": ARGS.speculative_algorithm,
            "speculative_num_steps": ARGS.speculative_num_steps,
            "speculative_eagle_topk": ARGS.speculative_eagle_topk,
            "speculative_num_draft_tokens": ARGS.speculative_num_draft_tokens,
            "speculative_draft_model_path": ARGS.speculative_draft_model_path,
            "enable_flashinfer_allreduce_fusion": ARGS.enable_flashinfer_allreduce_fusion,
            "cuda_graph_max_bs": 8}
    return {**args, "max_total_num_tokens": 4096, "internal_states": [st], "version": version()}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *a):  # keep the log to what the server itself says
        pass

    def _json(self, code: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _text(self, code: int, text: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self._json(200 if LOADED.is_set() else 503, {})
        elif self.path in ("/get_server_info", "/server_info"):
            self._json(200, server_info())
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": ARGS.model_path, "object": "model",
                                                         "root": ARGS.model_path, "max_model_len": 4096}]})
        elif self.path == "/flush_cache":
            self._flush()
        else:
            self._json(404, {"error": self.path})

    def _flush(self) -> None:
        log("standin: POST /flush_cache")
        self._text(200, "Cache flushed.\n")

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(n) if n else b""
        if self.path == "/flush_cache":
            self._flush()
            return
        if self.path != "/generate":
            self._json(404, {"error": self.path})
            return
        req = json.loads(body or b"{}")
        with COUNT_LOCK:
            GENERATED[0] += 1
            nth = GENERATED[0]
        if ARGS.fail_after is not None and nth > ARGS.fail_after:
            # like a rank dying mid-run: a fatal line in the log, the request never answered
            log("RuntimeError: NCCL error: unhandled system error (standin --fail-after)")
            while True:
                time.sleep(1)
        if ARGS.hang_after is not None and nth > ARGS.hang_after:
            while True:  # a silent deadlock: nothing in the log, no answer
                time.sleep(1)
        prompt = req.get("text", req.get("input_ids", ""))
        max_new = int(req.get("sampling_params", {}).get("max_new_tokens", 16))
        log(f"standin: POST /generate max_new_tokens={max_new} prompt={str(prompt)[:80]!r}")
        spec = ARGS.accept_length > 1
        step_tokens = max(1, int(round(ARGS.accept_length))) if spec else 1
        step_s = step_tokens / ARGS.tok_s
        t0 = time.perf_counter()
        time.sleep(ARGS.ttft_s)
        produced, verify_ct = 0, 0
        chunks = []
        while produced < max_new:
            time.sleep(step_s)
            produced = min(max_new, produced + step_tokens)
            verify_ct += 1 if spec else 0
            meta = {"completion_tokens": produced, "prompt_tokens": 8, "e2e_latency": time.perf_counter() - t0}
            if spec:
                meta["spec_verify_ct"] = verify_ct
            chunks.append({"text": completion(str(prompt), produced), "meta_info": meta})
            if req.get("stream"):
                if len(chunks) == 1:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    self.end_headers()
                self.wfile.write(b"data: " + json.dumps(chunks[-1]).encode() + b"\n\n")
                self.wfile.flush()
        self._write_profile(verify_ct, time.perf_counter() - t0, produced)
        if req.get("stream"):
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True
        else:
            self._json(200, chunks[-1])

    def _write_profile(self, verify_ct: int, dt: float, produced: int) -> None:
        path = os.environ.get("SGLANG_VERIFY_PROFILE_FILE")
        if os.environ.get("SGLANG_VERIFY_PROFILE") != "1" or not path or not verify_ct:
            return
        cycle = dt * 1000 / verify_ct
        rec = {"version": 2, "name": "standin", "dp_rank": 0, "cycles": verify_ct, "tokens": produced,
               "requests": verify_ct, "accept_length": produced / verify_ct, "break_even_accept_length": 2.46}
        for phase, ms in (("draft", 2.0), ("verify", cycle - 3.0), ("extend", 1.0), ("cycle", cycle)):
            rec.update({f"{phase}_ms_median": ms, f"{phase}_ms_p90": ms * 1.1, f"{phase}_ms_mean": ms})
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def main() -> int:
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=["fast", "slow", "crash", "oom", "hang"], default="fast")
    p.add_argument("--load-s", type=float, default=1.0)
    p.add_argument("--tok-s", type=float, default=400.0)
    p.add_argument("--ttft-s", type=float, default=0.01)
    p.add_argument("--accept-length", type=float, default=1.0)
    p.add_argument("--pid-file")
    p.add_argument("--model-path", default="standin")
    p.add_argument("--perturb-env", default="")
    p.add_argument("--perturb-pos", type=int, default=7)
    p.add_argument("--fail-after", type=int, help="log an NCCL error and hang from the request after N")
    p.add_argument("--hang-after", type=int, help="hang silently from the request after N")
    p.add_argument("--accept-drop-env", default="", help="when this variable is on, accept fewer drafts")
    p.add_argument("--accept-drop", type=float, default=0.5)
    # SGLang flags recorded in /get_server_info
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--random-seed", type=int)
    p.add_argument("--speculative-algorithm")
    p.add_argument("--speculative-num-steps", type=int)
    p.add_argument("--speculative-eagle-topk", type=int)
    p.add_argument("--speculative-num-draft-tokens", type=int)
    p.add_argument("--speculative-draft-model-path")
    p.add_argument("--enable-flashinfer-allreduce-fusion", action="store_true")
    ARGS, _extra = p.parse_known_args()  # accept SGLang-style flags we do not use
    ARGS.tok_s *= float(os.environ.get("STANDIN_SPEED", "1"))
    if os.environ.get("STANDIN_ACCEPT_LENGTH") and ARGS.accept_length > 1:  # speculating modes only
        ARGS.accept_length = float(os.environ["STANDIN_ACCEPT_LENGTH"])
    if ARGS.accept_drop_env and _on(ARGS.accept_drop_env) and ARGS.accept_length > 1:
        ARGS.accept_length -= ARGS.accept_drop  # the same text, fewer accepted drafts

    log(f"standin server pid {os.getpid()} mode {ARGS.mode} args {sys.argv[1:]}")
    if ARGS.pid_file:
        subprocess.Popen([sys.executable, "-c", CHILD, GRANDCHILD, ARGS.pid_file])
    srv = ThreadingHTTPServer((ARGS.host, ARGS.port), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    log_allreduce_init()
    if ARGS.mode == "fast":
        LOADED.set()
    elif ARGS.mode == "slow":
        t_end = time.time() + ARGS.load_s
        i = 0
        log("Traceback (most recent call last):")
        log('  File "vllm_compat.py", line 3, in <module>')
        log("ImportError: optional kernel package missing; falling back (harmless)")
        while time.time() < t_end:
            log(f"UserWarning: Exception ignored in weight loader hook {i} (harmless); loading shard {i}")
            log(f"WARNING  ... TypedStorage is deprecated. Exception: none, loading {i}")
            i += 1
            time.sleep(0.1)
        LOADED.set()
        log("The server is fired up and ready to roll!")
    elif ARGS.mode == "crash":
        time.sleep(ARGS.load_s)
        log("Traceback (most recent call last):")
        log('  File "/root/sglang/python/sglang/srt/model_loader/loader.py", line 42, in load_weights')
        log("    raise ValueError(msg)")
        log("ValueError: weight shape mismatch for model.layers.3.mlp.experts.w13_weight")
        return 1
    elif ARGS.mode == "oom":
        time.sleep(ARGS.load_s)
        log("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    # serve until killed
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
