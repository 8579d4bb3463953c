"""Stand-in for `python -m torch.distributed.run ... kernel_bench.py [--stress N] ...` in the
regress wiring tests (no torch needed).  What it does comes from SGLPATCH_STANDIN_KB:

  record   write its argv to $SGLPATCH_STANDIN_ARGV and a passing stress result to --out
  silent   print one progress line, then hang without a word (a stuck torchrun)

Without --stress (a latency launch) it writes a latency result for the backends of --backends
(nccl at 60 / 150 us at rows 1 / 3, every other backend at 10 / 14 us: fast), each with its
back-to-back replay rows (--replay N, --replay-sizes); SGLPATCH_STANDIN_KB says how they went:

  latency          every replay the same as NCCL
  replay_mismatch  the first backend other than nccl differs from NCCL at replay 17 of rows 3 on
                   rank 1 (the hazard an end barrier guards: fast, right in every sample, wrong
                   when its graph is replayed back to back)
"""

from __future__ import annotations

import json
import os
import sys
import time

argv = sys.argv[1:]
mode = os.environ.get("SGLPATCH_STANDIN_KB", "record")
out = argv[argv.index("--out") + 1]


def arg(name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


if mode == "silent":
    print("[kernel_bench] stress selftest_wrong eager: 0/10 iterations", flush=True)
    while True:
        time.sleep(1)

if "--stress" not in argv:  # a latency launch
    hidden, suffix = int(arg("--hidden", "7168")), arg("--name-suffix", "")
    sizes = [int(x) for x in arg("--sizes", "1,3").split(",")]
    n = int(arg("--replay", "0"))
    replay_sizes = [int(x) for x in arg("--replay-sizes", "1,3").split(",")]
    results, replay, bad = [], [], None
    for b in arg("--backends", "nccl").split(","):
        label = b + suffix
        for rows in sizes:
            us = {1: 60.0, 3: 150.0}.get(rows, 200.0) if b == "nccl" else {1: 10.0, 3: 14.0}.get(rows, 30.0)
            for m in ("eager", "graph"):
                results.append({"backend": label, "mode": m, "rows": rows, "hidden": hidden, "bytes": rows * hidden * 2,
                                "status": "ok", "median_us": us, "p90_us": us * 1.1, "min_us": us, "samples": 4,
                                "max_abs_err": 0.0, "detail": ""})
        if bad is None and b != "nccl" and mode == "replay_mismatch":
            bad = label
        for rows in replay_sizes if n else []:
            row = {"backend": label, "rows": rows, "hidden": hidden, "replays": n, "graph_impl": "cuda_graph",
                   "status": "ok", "first_mismatch": None, "mismatched_replays": 0}
            if label == bad and rows == 3:
                row.update(status="mismatch", mismatched_replays=5, first_mismatch={
                    "replay": 17, "rank": 1, "output": "output", "element": [2, 4402], "got": 7.0, "nccl": 6.0})
            replay.append(row)
    with open(out, "w") as f:
        json.dump({"schema": "sglpatch.kernel_bench/2", "results": results, "replay": replay, "absent": {},
                   "errors": {}, "done": [b + suffix for b in arg("--backends", "nccl").split(",")],
                   "in_progress": None, "complete": True,
                   "hardware": {"gpu_name": "stand-in", "world_size": 2, "versions": {"sglang": "0.5.9",
                                                                                      "sglang_pcie_ipc": "P5"}}}, f)
    sys.exit(0)

n = int(argv[argv.index("--stress") + 1])
with open(os.environ["SGLPATCH_STANDIN_ARGV"], "w") as f:
    json.dump(argv, f)
row = {"backend": "symm_mem", "mode": "graph", "graph_impl": "cuda_graph", "sizes": [1, 3], "hidden": 64,
       "iterations_requested": n, "iterations_done": n, "mismatched_iterations": 0, "mismatched_elements": 0,
       "mismatch_ranks": {}, "first_mismatch": None, "stopped_early": False, "elapsed_s": 1.0, "status": "ok",
       "it_per_s": float(n)}
with open(out, "w") as f:
    json.dump({"schema": "sglpatch.kernel_bench.stress/1", "stress": [row], "absent": {}, "errors": {},
               "hardware": {"gpu_name": "stand-in", "world_size": 2}, "reference": "nccl", "sizes": [1, 3],
               "value_bound": 8}, f)
