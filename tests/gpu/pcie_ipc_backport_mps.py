"""P5 on a GPU: the patched 0.5.9 GroupCoordinator("tp") with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1,
WS ranks on ONE GPU under MPS. Correctness only, never timing.

Real: SGLang 0.5.9's patched parallel_state / pcie_ipc_allreduce, flashinfer's PcieIpcAllReduceWorkspace
JIT-built here, CUDA graphs. Stand-in: the global server args (a namespace with the fields the width
rule reads). The device groups are gloo (NCCL refuses several ranks on one GPU), so the fallback path
is torch.distributed over gloo. Reference: a gloo fp32 allreduce of the same bf16 inputs on the CPU.

  nvidia-cuda-mps-control -d
  FLASHINFER_KIT=KIT SGLANG_TREE=DIR python3 tests/gpu/pcie_ipc_backport_mps.py WS [REPLAYS] > ws.json
  (FLASHINFER_KIT: a kit from mk-flashinfer-pcie-kit.sh, unset: the installed flashinfer; SGLANG_TREE:
  the patched workdir, whose python/ goes first on sys.path, unset: the installed sglang)
results/p5-mps-h200/ holds the run on one H200 (prepare.sh builds what it carries, run.sh runs it).

Bound: the reference sums the same bf16 inputs in fp32; the kernel's result is bf16, and its
reduction may round more than once, so the eager bound is a few bf16 ulps of the largest sum
(|sum| < 16 at WS 8 for N(0, 1) inputs: ulp 0.0625): BOUND[WS]. A graph chains 4 reductions, each
followed by a bf16 multiply by 1/WS: 2 x BOUND[WS].
"""

import json
import logging
import os
import sys
import time
import traceback
import types

HIDDEN = 7168
BS, TOKENS = 8, 3  # captured batch 8 x 3 EAGLE-3 verify tokens: 24 rows
ROWS = BS * TOKENS
BOUND = {2: 0.03, 4: 0.08, 8: 0.16}
MIN_REPLAYS = int(os.environ.get("MIN_REPLAYS", "10000"))  # at the decode (BS) and verify (ROWS) shapes  # eager; graphs (4 chained reductions, each / WS in bf16): 2x


def stub_flashinfer() -> None:
    tree = os.environ.get("SGLANG_TREE")
    if tree:
        sys.path.insert(0, os.path.join(tree, "python"))
    kit = os.environ.get("FLASHINFER_KIT")
    if not kit:
        return
    site = os.path.join(kit, "site")
    sys.path.insert(0, site)
    for name, path in (("flashinfer", "flashinfer"), ("flashinfer.comm", "flashinfer/comm")):
        m = types.ModuleType(name)
        m.__path__ = [os.path.join(site, path)]
        sys.modules[name] = m


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        msg = record.getMessage()
        if "PCIe-IPC" in msg or "Decode/verify allreduce" in msg:
            self.lines.append(f"{record.levelname}: {msg}")


def coordinator(ws):
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator(
        group_ranks=[list(range(ws))], local_rank=0, torch_distributed_backend="gloo",
        use_pynccl=False, use_pymscclpp=False, use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
        use_xpu_communicator=False, use_npu_communicator=False, group_name="tp",
    )


def check(g, x, dist, torch, with_ref_max=False):
    ref = x.float().cpu()
    dist.all_reduce(ref)  # gloo fp32 on the CPU
    y = g.all_reduce(x)
    torch.cuda.synchronize()
    err = float((y.float().cpu() - ref).abs().max())
    return (err, float(ref.abs().max())) if with_ref_max else err


def worker(rank, ws, initf, replays, q):
    out = {"rank": rank}
    try:
        stub_flashinfer()
        os.environ["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] = "1"
        os.environ["SGLANG_PCIE_IPC_TUNE"] = "0"  # tune() under MPS crashed at ws 8: seed configs
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("gloo", init_method="file://" + initf, rank=rank, world_size=ws)
        import sglang.srt.server_args as sa

        cap = Capture()
        logging.getLogger("sglang").addHandler(cap)
        logging.getLogger("sglang").setLevel(logging.INFO)

        class MC:
            hidden_size = HIDDEN

        sa._global_server_args = types.SimpleNamespace(
            cuda_graph_bs=[1, 2, 4, BS], cuda_graph_max_bs=BS, speculative_algorithm="EAGLE3",
            speculative_num_draft_tokens=TOKENS, get_model_config=lambda: MC,
            enable_deterministic_inference=False, enable_flashinfer_allreduce_fusion=False,
        )
        import sglang

        out["sglang"] = sglang.__version__
        out["sglang_file"] = sglang.__file__
        g = coordinator(ws)
        comm = g.pcie_ipc_comm
        out["enabled"] = comm is not None and not comm.disabled
        out["max_numel"] = comm.max_numel if comm else None
        ws_obj = getattr(comm, "_workspace", None)
        out["profile"] = getattr(ws_obj, "profile", None)
        import flashinfer.comm.pcie_ipc_ar as ar_mod

        out["flashinfer_file"] = ar_mod.__file__
        served = [0]
        real = comm.all_reduce
        comm.all_reduce = lambda x: (served.__setitem__(0, served[0] + 1), real(x))[1]
        eager = {}
        for rows in (1, 3, 8, 16, ROWS, ROWS + 1, 64):
            gen = torch.Generator().manual_seed(1000 * rows + rank)
            x = torch.randn(rows, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
            before = served[0]
            err, ref_max = check(g, x, dist, torch, with_ref_max=True)
            eager[rows] = {"err": err, "pcie_ipc": served[0] > before, "max_abs_sum": ref_max}
        out["eager"] = eager
        # graphs: decode (bs x 1) and verify (bs x 3) shapes, 4 chained reductions per graph
        graphs = {}
        with g.graph_capture() as ctx:
            for rows in (BS, ROWS, 1, TOKENS):  # decode bs 8, verify 8 x 3; then bs 1, 1 x 3
                xs = torch.zeros(rows, HIDDEN, dtype=torch.bfloat16, device="cuda")
                with torch.cuda.stream(ctx.stream):
                    g.all_reduce(xs)  # warm-up outside the graph, on the capture stream
                torch.cuda.synchronize()
                gr = torch.cuda.CUDAGraph()
                before = served[0]
                with torch.cuda.graph(gr, stream=ctx.stream):
                    y = xs
                    for _ in range(4):
                        y = g.all_reduce(y) * (1.0 / ws)
                graphs[rows] = (gr, xs, y, served[0] - before)
        # SHAPE_BUDGET_S bounds one shape's replays (0: none): the ranks agree at each check whether to
        # stop, as a replay is a collective; the counts made are what the report gives.
        budget = float(os.environ.get("SHAPE_BUDGET_S", "0"))
        worst, counts, checked = {}, {}, 0
        for rows, (gr, xs, y, _) in graphs.items():
            w, i, start = 0.0, 0, time.monotonic()
            while i < replays:
                gen = torch.Generator(device="cuda").manual_seed(7 * i + rank)
                xs.copy_(torch.randn(rows, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16))
                gr.replay()
                i += 1
                if i % 500 == 1 or i == replays:
                    torch.cuda.synchronize()
                    ref = xs.float().cpu()
                    for _ in range(4):
                        dist.all_reduce(ref)
                        ref = ref / ws
                    w = max(w, float((y.float().cpu() - ref).abs().max()))
                    checked += 1
                    stop = torch.tensor([float(budget > 0 and time.monotonic() - start > budget)])
                    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
                    if stop.item():
                        break
            worst[rows], counts[rows] = w, i
        torch.cuda.synchronize()
        out["graph"] = {r: {"pcie_ipc_in_graph": graphs[r][3], "max_abs_err": worst[r], "replays": counts[r]}
                        for r in graphs}
        out["graph_replays"] = sum(counts.values())
        out["graph_checks"] = checked
        out["log"] = cap.lines
        g.destroy()
        # forced failures on one rank: flashinfer unimportable there; then its JIT build failing there
        for case in ("import", "jit"):
            cap.lines = []
            saved = {}
            if rank == 1 and case == "import":
                saved["mod"] = sys.modules.get("flashinfer.comm.pcie_ipc_ar")
                sys.modules["flashinfer.comm.pcie_ipc_ar"] = None
            if rank == ws - 1 and case == "jit":
                import flashinfer.comm.pcie_ipc_ar as ar

                saved["jit"] = ar.get_pcie_ipc_comm_module

                def broken():
                    raise RuntimeError("planted JIT failure")

                ar.get_pcie_ipc_comm_module = broken
            g2 = coordinator(ws)
            x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).cuda()
            out[f"fail_{case}"] = {
                "enabled": g2.pcie_ipc_comm is not None and not g2.pcie_ipc_comm.disabled,
                "err": check(g2, x, dist, torch),
                "log": cap.lines,
            }
            g2.destroy()
            if "mod" in saved:
                sys.modules["flashinfer.comm.pcie_ipc_ar"] = saved["mod"]
            if "jit" in saved:
                ar.get_pcie_ipc_comm_module = saved["jit"]
        dist.destroy_process_group()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:600]
        out["tb"] = traceback.format_exc()[-6000:]
    q.put(out)


def main():
    import torch.multiprocessing as mp

    ws = int(sys.argv[1])
    replays = int(sys.argv[2]) if len(sys.argv) > 2 else 10000
    initf = f"/tmp/pg-p5-{ws}-{os.getpid()}"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=worker, args=(r, ws, initf, replays, q)) for r in range(ws)]
    for p in ps:
        p.start()
    res = []
    deadline = time.time() + float(os.environ.get("DEADLINE", "400"))
    while len(res) < ws and time.time() < deadline:
        try:
            res.append(q.get(timeout=5))
        except Exception:
            pass
    for p in ps:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    ok = len(res) == ws and all([_ok(r, ws) for r in res])
    print(json.dumps({"ws": ws, "finished": len(res), "bound": BOUND[ws], "ok": ok,
                      "results": sorted(res, key=lambda r: r["rank"])}, indent=1))
    return 0 if ok else 1


def _ok(r, ws):
    """Every check of one rank's report; the failing ones are listed under r["failed"]."""
    if "error" in r or not r.get("enabled"):
        return False
    b = BOUND[ws]
    rank0 = r["rank"] == 0
    warn = f"PCIe-IPC allreduce is off on all {ws} ranks because "
    checks = {
        "eager_err": all(v["err"] <= b for v in r["eager"].values()),
        "eager_served": all(r["eager"][k]["pcie_ipc"] == (k <= ROWS) for k in r["eager"]),
        "graph_err": all(v["max_abs_err"] <= 2 * b for v in r["graph"].values()),
        "graph_served": all(v["pcie_ipc_in_graph"] == 4 for v in r["graph"].values()),
        "replays": all(v["replays"] >= MIN_REPLAYS for k, v in r["graph"].items() if k in (BS, ROWS)),
        "startup_line": not rank0 or f"INFO: Decode/verify allreduce: PCIe-IPC (world_size={ws})." in r["log"],
    }
    for case, why in (("import", "rank 1: flashinfer.comm.pcie_ipc_ar.PcieIpcAllReduceWorkspace does not import"),
                      ("jit", f"{ws - 1}: 'RuntimeError: planted JIT failure'")):
        f = r[f"fail_{case}"]
        warnings = [line for line in f["log"] if line.startswith("WARNING: ")]
        checks[f"fail_{case}"] = (not f["enabled"] and f["err"] <= b and len(warnings) == 1
                                  and warnings[0].startswith("WARNING: " + warn) and why in warnings[0])
        if rank0:
            checks[f"fail_{case}_line"] = f"INFO: Decode/verify allreduce: NCCL (world_size={ws})." in f["log"]
    r["failed"] = sorted(k for k, v in checks.items() if not v)
    return not r["failed"]


if __name__ == "__main__":
    sys.exit(main())
