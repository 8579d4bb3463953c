#!/usr/bin/env python3
"""Edge probe for sglpatch P5 (FlashInfer PCIe-IPC allreduce backport onto SGLang 0.5.9).

Correctness only, never timing. By default WS ranks share ONE GPU under CUDA MPS (start the MPS
daemon first); P5_DEVICES=spread puts rank r on cuda:r (a real multi-GPU box, no MPS needed).

What is real: the patched 0.5.9 GroupCoordinator / parallel_state / pcie_ipc_allreduce, flashinfer
0.7.2's PcieIpcAllReduceWorkspace JIT-built on the machine, CUDA graphs, CUDA IPC. Stand-in: the
global server args (captured batches 1/2/4/8, EAGLE-3 with 3 draft tokens, hidden 7168: width 24
rows). The device groups are gloo by default (NCCL refuses two ranks on one GPU), so "NCCL" below
means the coordinator's torch.distributed fallback on its device group; with P5_DEVICES=spread
P5_DEVICE_BACKEND=nccl it is real NCCL.

Reference: every checked reduction is recomputed in fp32 on the CPU (gloo allreduce of the exact
inputs each rank fed in, snapshotted before the call). Bound: ULPS[ws] units in the last place of
max|ref| in the reduction's dtype (bf16: 8-bit significand); exact zeros must stay exactly zero;
any NaN/Inf fails.

Phases (each under a faulthandler watchdog; a hang dumps the stacks and exits non-zero):
  build      every tp coordinator gets its workspace through the graph runner's real hook
             (serve_captured_graphs, captured batches x 3 tokens). A = tp (width 24 rows, buckets
             3/6/12/24, seed: no cache read, no tuning, the size line), B = tp with
             SGLANG_PCIE_IPC_MAX_NUMEL = 4 rows (a second workspace on the same ranks), C = tp
             with SGLANG_PCIE_IPC_MAX_NUMEL below one row (off on every rank, one warning),
             D = tp with it not a multiple of 8 (rounded up to a pack), an "attention_tp" group
             (must get no workspace), world-size-1 groups.
  eager      sizes at / just over the cap, 3-D, other hidden, 1-D, fp16 / fp32, all-zero, signed
             zero, zero-padded rows (must stay exactly 0), large values: the route (PCIe-IPC or
             not) must match upstream 0.5.23's rule, the result the reference, and a served
             reduction must leave its input untouched (out-of-place). Non-contiguous inputs (slice,
             transpose) are only decided, not run: c10d (gloo and NCCL) refuses a non-dense
             fallback in stock 0.5.9 too.
  capture    decisions inside a capture for the same edge tensors (upstream rule: contiguous bf16
             [.., hidden] with numel <= width); graphs of 24/12/8/3/2/1 rows (3 chained
             reductions each, the last one 3-D), a second graph_capture() with draft-like 3/1
             rows, graphs on B.
  interleave seeded, rank-identical random batches of: graph replays (any order), eager served,
             eager over the cap, fp16/fp32, non-contiguous, direct device-group allreduces,
             reductions on B, eager on the default stream between forward-stream work (rebind);
             each batch verified against the reference; periodic recapture of a graph.
  teardown   destroy every coordinator (collective) without a hang.

  python3 p5_edges_mps.py WS [--mode main|cache] > wsWS.json 2> wsWS.log
  main: a server's start with the defaults (seed, no tuning, no cache read); cache:
  SGLANG_PCIE_IPC_TUNE=cache (EXPECT_CACHE=1: the tuning step wrote a cache for this workspace).
  env: SGLANG_TREE (patched workdir), FLASHINFER_KIT (kit from mk-flashinfer-pcie-kit.sh),
       DEADLINE (s, whole run), BUDGET_S (s of interleaving), BUILD_TIMEOUT_S, PHASE_TIMEOUT_S,
       P5_DEVICES=one|spread, P5_DEVICE_BACKEND=gloo|nccl, SEED, REPLAY_BURST, RECAPTURE_EVERY,
       P5_CUSTOM_AR=1 (coordinator A with custom allreduce: a real box with sgl_kernel; with
       SGLANG_ENABLE_PCIE_CUSTOM_AR=1 it checks that P5 closes P2 there).
Exit 0 only when every rank finished, every check passed on every rank and every rank took the
same routes. ALLOW=check1,check2 reports those checks but keeps them out of the exit code (e.g.
ALLOW=capture_noncontig_falls_back: P5 serves a non-contiguous tensor inside a capture, upstream
does not).
"""

import faulthandler
import hashlib
import json
import logging
import math
import os
import random
import runpy
import sys
import time
import traceback
import types
from datetime import timedelta

HIDDEN = 7168
CG_BS = [1, 2, 4, 8]
TOKENS = 3
MAX_ROWS = max(CG_BS) * TOKENS  # 24 rows: the width P5 derives
ROWS = [bs * TOKENS for bs in CG_BS]  # what the target's graph runner captures: 3, 6, 12, 24
B_ROWS = 4
C_NUMEL = HIDDEN - 1  # below one row: refused with one line on every rank
D_NUMEL = 2 * HIDDEN + 4  # not a multiple of 8 bf16 (one 16-byte pack): rounded up
ULPS = {2: 2, 4: 3, 6: 4, 8: 5}
K_STAGES = 3


def env_f(name, default):
    return float(os.environ.get(name, default))


def stub_flashinfer():
    tree = os.environ.get("SGLANG_TREE")
    if tree:
        sys.path.insert(0, os.path.join(tree, "python"))
    # the kit's flashinfer without its __init__: the same stub the tuning step's processes load
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub", "sitecustomize.py"))


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        msg = record.getMessage()
        if "PCIe-IPC" in msg or "Decode/verify allreduce" in msg or "pcie" in msg.lower():
            self.lines.append(f"{record.levelname}: {msg}")


class Probe:
    def __init__(self, rank, ws):
        self.rank, self.ws = rank, ws
        self.checks, self.failures, self.info = {}, [], {}
        self.routes = []  # (label, served): must be identical on every rank

    def check(self, name, ok, detail=""):
        self.checks[name] = self.checks.get(name, True) and bool(ok)
        if not ok and len(self.failures) < 60:
            self.failures.append(f"{name}: {detail}"[:400])

    def watchdog(self, seconds):
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback_later(seconds, exit=True)


def tolerance(torch, dtype, m, ws):
    if m == 0.0:
        return 0.0
    if dtype == torch.float32:
        return 1e-5 * m + 1e-6
    mant = 7 if dtype == torch.bfloat16 else 10
    return ULPS.get(ws, ws // 2 + 1) * 2.0 ** (math.floor(math.log2(m)) - mant)


def worker(rank, ws, initf, mode, q):
    P = Probe(rank, ws)
    out = {"rank": rank}
    try:
        stub_flashinfer()
        os.environ["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] = "1"
        os.environ.pop("SGLANG_PCIE_IPC_MAX_NUMEL", None)
        os.environ.pop("SGLANG_PCIE_IPC_TUNE", None)  # main: the default (seed), as a server starts
        if mode == "cache":  # the cache the tuning step wrote (run_edges.sh: FLASHINFER_AUTOTUNE_DIR)
            os.environ["SGLANG_PCIE_IPC_TUNE"] = "cache"
        import torch
        import torch.distributed as dist

        spread = os.environ.get("P5_DEVICES", "one") == "spread"
        dev_index = rank if spread else 0
        torch.cuda.set_device(dev_index)
        dev = torch.device("cuda", dev_index)
        backend = os.environ.get("P5_DEVICE_BACKEND", "nccl" if spread else "gloo")
        dist.init_process_group("gloo", init_method="file://" + initf, rank=rank, world_size=ws,
                                timeout=timedelta(seconds=env_f("GLOO_TIMEOUT_S", 300)))
        P.watchdog(env_f("BUILD_TIMEOUT_S", 420))  # the first build JIT-compiles the module
        import sglang.srt.server_args as sa

        cap = Capture()
        logging.getLogger("sglang").addHandler(cap)
        logging.getLogger("sglang").setLevel(logging.INFO)

        class MC:
            hidden_size = HIDDEN

        sa._global_server_args = types.SimpleNamespace(
            cuda_graph_bs=list(CG_BS), cuda_graph_max_bs=max(CG_BS), speculative_algorithm="EAGLE3",
            speculative_num_draft_tokens=TOKENS, get_model_config=lambda: MC,
            enable_deterministic_inference=False, enable_flashinfer_allreduce_fusion=False,
            disable_cuda_graph=False,
        )
        import sglang.srt.distributed.parallel_state as ps
        from sglang.srt.distributed.device_communicators.pcie_ipc_allreduce import serve_captured_graphs
        from sglang.srt.distributed.parallel_state import GroupCoordinator

        custom_ar = os.environ.get("P5_CUSTOM_AR") == "1"  # real box only: needs sgl_kernel and P2P

        def coordinator(name, groups=None, numel_env=None, ca=False, bs=CG_BS):
            if numel_env is None:
                os.environ.pop("SGLANG_PCIE_IPC_MAX_NUMEL", None)
            else:
                os.environ["SGLANG_PCIE_IPC_MAX_NUMEL"] = str(numel_env)
            cap.lines = []
            try:
                g = GroupCoordinator(
                    group_ranks=groups or [list(range(ws))], local_rank=dev_index,
                    torch_distributed_backend=backend, use_pynccl=False, use_pymscclpp=False,
                    use_custom_allreduce=ca, use_torch_symm_mem_all_reduce=False,
                    use_hpu_communicator=False, use_xpu_communicator=False,
                    use_npu_communicator=False, group_name=name,
                    gloo_timeout=timedelta(seconds=env_f("GLOO_TIMEOUT_S", 300)),
                )
                # the target graph runner's hook (CudaGraphRunner.__init__), with its clamped list
                ps._TP, before = g, ps._TP
                runner = types.SimpleNamespace(capture_bs=list(bs), num_tokens_per_bs=TOKENS,
                                               model_runner=types.SimpleNamespace(model_config=MC))
                serve_captured_graphs(runner)
                ps._TP = before
                return g, list(cap.lines)
            finally:
                os.environ.pop("SGLANG_PCIE_IPC_MAX_NUMEL", None)

        served = {}

        def count(g, key):
            box = [0]
            comm = g.pcie_ipc_comm
            if comm is not None:
                real = comm.all_reduce

                def wrapped(x):
                    box[0] += 1
                    return real(x)

                comm.all_reduce = wrapped
            served[key] = box
            return box

        def on(g):
            c = g.pcie_ipc_comm
            return c is not None and not c.disabled

        def expect(g, t):  # upstream 0.5.23's rule (pcie_ipc_ar.py should_pcie_ipc_ar)
            c = g.pcie_ipc_comm
            return (on(g) and t.dtype == torch.bfloat16 and t.is_contiguous() and t.dim() >= 2
                    and t.shape[-1] == c.hidden and t.numel() <= c.max_numel)

        paired = ws in (2, 4, 8)
        # ---------------------------------------------------------------- build
        A, logA = coordinator("tp", ca=custom_ar)
        if custom_ar and on(A) and ws > 2 and os.environ.get("SGLANG_ENABLE_PCIE_CUSTOM_AR") == "1":
            # P2 and P5 both on, PCIe-only GPUs: P2's PCIe custom allreduce is never built
            P.check("p2_not_built_when_p5_on", A.ca_comm is None or A.ca_comm.disabled, f"ca_comm={A.ca_comm}")
        P.info["A_ca_comm"] = None if A.ca_comm is None else f"disabled={A.ca_comm.disabled}"
        P.check("A_enabled_iff_ws_2_4_8", on(A) == paired, f"enabled={on(A)}")
        warnA = [l for l in logA if l.startswith("WARNING")]
        if paired:
            c = A.pcie_ipc_comm
            P.check("A_width", c.max_numel == MAX_ROWS * HIDDEN and list(c.buckets) == ROWS,
                    f"{c.max_numel} {c.buckets}")
            # main: seed, no cache read; cache: the tuning step's cache when it wrote one (EXPECT_CACHE=1)
            cached = mode == "cache" and os.environ.get("EXPECT_CACHE") == "1"
            P.check("tune_cache_as_asked", (c.tune_cache == os.devnull) != cached
                    and (not cached or c.tune_cache.endswith(f"sglang_pcie_ipc_ws{ws}.json")), f"{mode}: {c.tune_cache}")
            P.info["tune_cache"] = c.tune_cache
            P.check("server_start_no_tuning", not any("tuned" in l or "autotune" in l.lower() for l in logA), str(logA))
            P.check("A_no_warning", not warnA, str(warnA))
            if rank == 0:
                P.check("A_startup_line", f"INFO: Decode/verify allreduce: PCIe-IPC (world_size={ws})." in logA, str(logA))
                size = [l for l in logA if "MiB per GPU" in l]
                policy = "cache" if mode == "cache" and os.environ.get("EXPECT_CACHE") == "1" else "seed"
                P.check("A_size_line", len(size) == 1 and f"buckets {ROWS}; {policy} launch configurations" in size[0],
                        str(size))
                P.info["size_line"] = size
        else:
            P.check("A_one_warning_names_ws", len(warnA) == 1 and f"not {ws}" in warnA[0], str(warnA))
        count(A, "A")
        B, logB = coordinator("tp", numel_env=B_ROWS * HIDDEN, bs=[1, 2])  # rows 3, 6: 6 is past the cap, bucket 3
        P.check("B_enabled_iff_ws_2_4_8", on(B) == paired, f"enabled={on(B)}")
        if on(B):
            P.check("B_width", B.pcie_ipc_comm.max_numel == B_ROWS * HIDDEN and list(B.pcie_ipc_comm.buckets) == [3],
                    f"{B.pcie_ipc_comm.max_numel} {B.pcie_ipc_comm.buckets}")
        count(B, "B")
        C, logC = coordinator("tp", numel_env=C_NUMEL)
        warnC = [l for l in logC if l.startswith("WARNING")]
        P.check("C_off_everywhere", not on(C), "C enabled")
        if paired:
            P.check("C_one_warning_below_one_row", len(warnC) == 1 and "below one row" in warnC[0], str(warnC))
        count(C, "C")
        D, _ = coordinator("tp", numel_env=D_NUMEL)
        P.check("D_rounded_up_to_a_pack", not paired or (on(D) and D.pcie_ipc_comm.max_numel == 2 * HIDDEN + 8),
                f"{D.pcie_ipc_comm and D.pcie_ipc_comm.max_numel}")
        D.destroy()
        ATT, logT = coordinator("attention_tp")
        P.check("attention_tp_has_no_workspace", ATT.pcie_ipc_comm is None and not logT, str(logT))
        S, _ = coordinator("tp", groups=[[r] for r in range(ws)])
        P.check("ws1_has_no_workspace", S.pcie_ipc_comm is None)
        x1 = torch.randn(3, HIDDEN, device=dev, dtype=torch.bfloat16)
        P.check("ws1_identity", S.all_reduce(x1) is x1)
        if on(A) and rank == 0:
            try:
                from flashinfer.comm.pcie_ipc_ar import get_pcie_ipc_comm_module

                m = get_pcie_ipc_comm_module()
                P.info["workspace_bytes"] = {
                    f"{rows} rows": int(m.workspace_size(ws, rows * HIDDEN, 2, 128))
                    for rows in (MAX_ROWS, 64 * 3, 512 * 3, 512 * 4)
                }
            except Exception as e:  # informative only
                P.info["workspace_bytes"] = f"{type(e).__name__}: {e}"
        P.info["log_A"] = logA
        dist.barrier()

        # ------------------------------------------------------------ helpers
        gen = torch.Generator(device=dev)
        pending = []  # (label, snapshot-of-input, output, dtype)

        def rnd(shape, dtype=torch.bfloat16, seed=0, scale=1.0):
            gen.manual_seed(seed * 1009 + rank)
            return (torch.randn(shape, device=dev, generator=gen) * scale).to(dtype)

        def verify():
            if not pending:
                return
            torch.cuda.synchronize()
            flats = [s.float().reshape(-1).cpu() for _, s, _, _ in pending]
            ref_all = torch.cat(flats)
            dist.all_reduce(ref_all)  # fp32 on the CPU, the exact inputs of every rank
            off = 0
            for (label, _, o, dtype), f in zip(pending, flats):
                ref = ref_all[off:off + f.numel()]
                off += f.numel()
                got = o.float().reshape(-1).cpu()
                m = float(ref.abs().max())
                finite = bool(torch.isfinite(got).all())
                err = float((got - ref).abs().max()) if finite else float("inf")
                bound = tolerance(torch, dtype, m, ws)
                key = label if label.startswith("eager") else label.split(":")[0].split("_stage")[0]
                if m > 0:
                    u = 2.0 ** (math.floor(math.log2(m)) - (7 if dtype == torch.bfloat16 else 10 if dtype == torch.float16 else 23))
                    ulps = P.info.setdefault("max_err_ulps", {})
                    ulps[key] = max(ulps.get(key, 0.0), err / u)
                P.check("results_match_fp32_reference", finite and err <= bound,
                        f"{label}: err {err:.4g} > {bound:.4g} (max|ref| {m:.4g})")
                if label.endswith("zero_padded_rows"):  # rows 5..7 are +0.0 on every rank
                    P.check("padded_rows_exactly_zero", bool((got[5 * HIDDEN:] == 0).all()), label)
            pending.clear()

        def reduce(g, gkey, x, label, route_check=True, inplace_check=True):
            snap = x.clone()
            want = expect(g, x)
            before = served[gkey][0]
            y = g.all_reduce(x)
            got = served[gkey][0] > before
            P.routes.append((label, got))
            if route_check:
                P.check("route_matches_upstream_rule", got == want, f"{label}: served={got} expected={want}")
            if got and inplace_check:
                P.check("served_is_out_of_place", y.data_ptr() != x.data_ptr() and torch.equal(x, snap), label)
            pending.append((label, snap, y, x.dtype))
            return y

        # ------------------------------------------------------------ eager edges
        P.watchdog(env_f("PHASE_TIMEOUT_S", 240))
        base = torch.randn(3, HIDDEN + 8, device=dev).to(torch.bfloat16)
        pad = rnd((8, HIDDEN), seed=5)
        pad[5:] = 0
        edges = [
            ("rows1", rnd((1, HIDDEN), seed=1)), ("rows2", rnd((2, HIDDEN), seed=2)),
            ("rows3", rnd((3, HIDDEN), seed=3)), ("rows23", rnd((23, HIDDEN), seed=23)),
            ("rows24_cap", rnd((24, HIDDEN), seed=24)), ("rows25_over", rnd((25, HIDDEN), seed=25)),
            ("rows48_prefill", rnd((48, HIDDEN), seed=48)),
            ("3d_8x3", rnd((8, 3, HIDDEN), seed=83)), ("3d_9x3_over", rnd((9, 3, HIDDEN), seed=93)),
            ("hidden_x2_same_numel", rnd((12, 2 * HIDDEN), seed=122)),
            ("hidden4096", rnd((3, 4096), seed=4096)), ("1d", rnd((HIDDEN,), seed=7)),
            ("fp16", rnd((3, HIDDEN), torch.float16, seed=16)), ("fp32", rnd((3, HIDDEN), torch.float32, seed=32)),
            ("zeros", torch.zeros(3, HIDDEN, device=dev, dtype=torch.bfloat16)),
            ("neg_zeros", torch.full((3, HIDDEN), -0.0, device=dev, dtype=torch.bfloat16)),
            ("zero_padded_rows", pad), ("large_values", rnd((3, HIDDEN), seed=11, scale=3000.0)),
        ]
        for name, x in edges:
            reduce(A, "A", x, f"eager_A:{name}")
        if A.pcie_ipc_comm is not None:  # decided only: c10d (gloo and NCCL) refuse a non-dense fallback
            for name, x in (("noncontig_slice", base[:, :HIDDEN]), ("noncontig_transpose", rnd((HIDDEN, 3), seed=9).t())):
                d = bool(A.pcie_ipc_comm.should_pcie_ipc_ar(x))
                P.routes.append((f"eager_A:{name}", d))
                P.check("route_matches_upstream_rule", d == expect(A, x), f"eager {name}: P5 says {d}")
        for rows in (B_ROWS, B_ROWS + 1):
            reduce(B, "B", rnd((rows, HIDDEN), seed=400 + rows), f"eager_B:rows{rows}")
        reduce(C, "C", rnd((3, HIDDEN), seed=300), "eager_C:rows3")
        verify()
        dist.barrier()

        # ------------------------------------------------------------ capture
        graphs = {}

        def capture(g, gkey, label, rows_list):
            with g.graph_capture() as ctx:
                s = ctx.stream
                for rows in rows_list:
                    x = torch.zeros(rows, HIDDEN, device=dev, dtype=torch.bfloat16)

                    def run_once(x=x, rows=rows):
                        stages, inp = [], x
                        for k in range(K_STAGES):
                            t = inp.view(rows // TOKENS, TOKENS, HIDDEN) if (k == K_STAGES - 1 and rows % TOKENS == 0) else inp
                            o = g.all_reduce(t)
                            stages.append((t, o))
                            inp = o.view(rows, HIDDEN) * (1.0 / ws)
                        return stages

                    for _ in range(2):  # SGLang's warm-up before each capture
                        torch.cuda.synchronize()
                        g.barrier()
                        run_once()
                    torch.cuda.synchronize()
                    gr = torch.cuda.CUDAGraph()
                    before = served[gkey][0]
                    with torch.cuda.graph(gr, stream=s):
                        stages = run_once()
                    n = served[gkey][0] - before
                    P.check("every_captured_reduction_served", n == K_STAGES, f"{label}{rows}: {n}/{K_STAGES}")
                    graphs[f"{label}{rows}"] = {"graph": gr, "x": x, "stages": stages, "rows": rows}
            torch.cuda.synchronize()

        if on(A):
            P.watchdog(env_f("PHASE_TIMEOUT_S", 240))
            # decisions inside a capture (no kernel of ours is launched by asking)
            probes = {
                "rows24_cap": torch.empty(24, HIDDEN, device=dev, dtype=torch.bfloat16),
                "rows25_over": torch.empty(25, HIDDEN, device=dev, dtype=torch.bfloat16),
                "3d_8x3": torch.empty(8, 3, HIDDEN, device=dev, dtype=torch.bfloat16),
                "fp16": torch.empty(3, HIDDEN, device=dev, dtype=torch.float16),
                "hidden_x2_same_numel": torch.empty(12, 2 * HIDDEN, device=dev, dtype=torch.bfloat16),
                "noncontig_slice": base[:, :HIDDEN],
                "noncontig_transpose": torch.empty(HIDDEN, 3, device=dev, dtype=torch.bfloat16).t(),
            }
            with A.graph_capture() as ctx:
                tmp, dummy = torch.cuda.CUDAGraph(), torch.zeros(8, device=dev)
                decisions = {}
                with torch.cuda.graph(tmp, stream=ctx.stream):
                    dummy.mul_(2)
                    for name, t in probes.items():
                        decisions[name] = bool(A.pcie_ipc_comm.should_pcie_ipc_ar(t))
            del tmp
            for name, t in probes.items():
                which = "capture_noncontig_falls_back" if name.startswith("noncontig") else "capture_decision_matches_upstream_rule"
                P.check(which, decisions[name] == expect(A, t),
                        f"in capture {name}: P5 says {decisions[name]}, upstream rule {expect(A, t)}")
            P.info["capture_decisions"] = decisions
            capture(A, "A", "A", [24, 12, 8, 3, 2, 1])  # target decode/verify, large first as SGLang
            capture(A, "A", "draft", [3, 1])  # a second graph_capture() on the same group (draft)
            if on(B):
                capture(B, "B", "B", [4, 2])
        dist.barrier()

        # ------------------------------------------------------------ interleave
        P.watchdog(env_f("PHASE_TIMEOUT_S", 240) + env_f("BUDGET_S", 60))
        fs = torch.cuda.Stream(device=dev)  # SGLang's forward stream
        ds = torch.cuda.current_stream(dev)
        rng = random.Random(int(os.environ.get("SEED", "1234")) * 31 + ws)  # same on every rank
        kinds = ["replay"] * 5 + ["served"] * 2 + ["over", "dtype", "device_group", "coord_b", "default_stream"]
        budget, start, batches, actions, replays = env_f("BUDGET_S", 60), time.monotonic(), 0, 0, 0
        recapture_every = int(os.environ.get("RECAPTURE_EVERY", "10"))
        burst = int(os.environ.get("REPLAY_BURST", "24"))
        while True:
            used, on_default = set(), False
            with torch.cuda.stream(fs):
                for _ in range(rng.randint(2, 8)):
                    kind = rng.choice(kinds)
                    seed = rng.randrange(1 << 30)
                    actions += 1
                    if kind == "replay":
                        free = sorted(k for k in graphs if k not in used)
                        if not free:
                            continue
                        key = rng.choice(free)
                        used.add(key)
                        gd = graphs[key]
                        gd["x"].copy_(rnd((gd["rows"], HIDDEN), seed=seed))
                        for _ in range(rng.randint(1, burst)):  # same input: the last replay is checked
                            gd["graph"].replay()
                            replays += 1
                        P.routes.append((f"replay:{key}", True))
                        for k, (t, o) in enumerate(gd["stages"]):
                            pending.append((f"replay_{key}:stage{k}", t, o, torch.bfloat16))
                        continue
                    if kind == "default_stream":
                        on_default = True
                        continue
                    if kind == "served":
                        x, g, gk = rnd((rng.randint(1, MAX_ROWS), HIDDEN), seed=seed), A, "A"
                    elif kind == "over":
                        x, g, gk = rnd((rng.randint(MAX_ROWS + 1, MAX_ROWS + 16), HIDDEN), seed=seed), A, "A"
                    elif kind == "dtype":
                        x, g, gk = rnd((rng.randint(1, MAX_ROWS), HIDDEN), rng.choice([torch.float16, torch.float32]), seed=seed), A, "A"
                    elif kind == "coord_b":
                        x, g, gk = rnd((rng.randint(1, B_ROWS + 2), HIDDEN), seed=seed), B, "B"
                    else:  # device_group: the collective every fallback uses, straight on A's device group
                        x = rnd((rng.randint(1, MAX_ROWS), HIDDEN), seed=seed)
                        snap = x.clone()
                        dist.all_reduce(x, group=A.device_group)
                        pending.append(("device_group", snap, x, torch.bfloat16))
                        P.routes.append(("device_group", False))
                        continue
                    if on_default:  # eager work on the default stream, ordered both ways
                        ds.wait_stream(fs)
                        with torch.cuda.stream(ds):
                            reduce(g, gk, x, f"{kind}_default_stream", inplace_check=False)
                        fs.wait_stream(ds)
                        on_default = False
                    else:
                        reduce(g, gk, x, kind, inplace_check=False)
            verify()
            batches += 1
            if graphs and recapture_every and batches % recapture_every == 0:
                key = sorted(graphs)[rng.randrange(len(graphs))]
                gd = graphs.pop(key)
                label = key.rstrip("0123456789")
                del gd
                capture(B if label == "B" else A, "B" if label == "B" else "A", label, [int(key[len(label):])])
                P.info["recaptures"] = P.info.get("recaptures", 0) + 1
            stop = torch.tensor([float(time.monotonic() - start > budget)])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
        P.info.update(batches=batches, actions=actions, replays=replays)
        P.check("replayed_graphs", replays > 0 or not on(A), "no replay")
        torch.cuda.synchronize()
        dist.barrier()

        # ------------------------------------------------------------ teardown
        P.watchdog(env_f("PHASE_TIMEOUT_S", 240))
        graphs.clear()
        for g in (C, ATT, S, B, A):
            g.destroy()
        P.check("destroyed", A.pcie_ipc_comm is None and B.pcie_ipc_comm is None)
        dist.barrier()
        faulthandler.cancel_dump_traceback_later()
        out["log_A"] = logA
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:800]
        out["tb"] = traceback.format_exc()[-6000:]
    out["checks"], out["failures"], out["info"] = P.checks, P.failures, P.info
    out["routes_sha"] = hashlib.sha256(repr(P.routes).encode()).hexdigest()[:16]
    allow = {c for c in os.environ.get("ALLOW", "").split(",") if c}
    out["allowed_failures"] = sorted(c for c, v in P.checks.items() if not v and c in allow)
    out["ok"] = "error" not in out and all(v or c in allow for c, v in P.checks.items())
    q.put(out)


def main():
    import multiprocessing as mp

    ws = int(sys.argv[1])
    mode = sys.argv[sys.argv.index("--mode") + 1] if "--mode" in sys.argv else "main"
    initf = f"/tmp/pg-p5edges-{ws}-{os.getpid()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, ws, initf, mode, q)) for r in range(ws)]
    for p in ps:
        p.start()
    res, deadline = [], time.time() + env_f("DEADLINE", 560)
    while len(res) < ws and time.time() < deadline:
        try:
            res.append(q.get(timeout=5))
        except Exception:
            if all(not p.is_alive() for p in ps) and q.empty():
                break
    for p in ps:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    shas = {r.get("routes_sha") for r in res}
    ok = len(res) == ws and all(r["ok"] for r in res) and len(shas) == 1
    print(json.dumps({"ws": ws, "mode": mode, "finished": len(res), "ok": ok, "routes_agree": len(shas) == 1,
                      "exitcodes": [p.exitcode for p in ps], "results": sorted(res, key=lambda r: r["rank"])},
                     indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
