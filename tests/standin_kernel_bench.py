"""Stand-in for `python -m torch.distributed.run ... kernel_bench.py --stress N ...` in the
regress wiring tests (no torch needed).  What it does comes from SGLPATCH_STANDIN_KB:

  record  write its argv to $SGLPATCH_STANDIN_ARGV and a passing stress result to --out
  silent  print one progress line, then hang without a word (a stuck torchrun)
"""

from __future__ import annotations

import json
import os
import sys
import time

argv = sys.argv[1:]
mode = os.environ.get("SGLPATCH_STANDIN_KB", "record")
out = argv[argv.index("--out") + 1]
n = int(argv[argv.index("--stress") + 1])
if mode == "silent":
    print("[kernel_bench] stress selftest_wrong eager: 0/10 iterations", flush=True)
    while True:
        time.sleep(1)
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
