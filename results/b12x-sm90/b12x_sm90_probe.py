#!/usr/bin/env python3
"""P7's b12x one-shot allreduce on ONE Hopper GPU under MPS, its SM120 check bypassed: a test harness only.

Correctness only, never timing. WS ranks share one GPU (CUDA MPS daemon started by run.sh); the CPU groups
are gloo. What is real: the patched 0.5.9 adapter (sglang/srt/distributed/device_communicators/
b12x_allreduce.py, carried in the kit), sglang's environ.py, flashinfer 0.7.2's vendored b12x (imported as
``b12x``), nvidia-cutlass-dsl 4.7.1 (CuTe DSL) compiling for this GPU, CUDA IPC, CUDA graphs. Stand-ins: P5's
module (its P2P row: every rank is on the same GPU; server flags: graphs on, not deterministic), and the
arch check: the adapter's B12X_CAPABILITIES gets this GPU's capability appended (b12x itself only checks
SM120 in is_supported(), which the adapter never calls).

Phases (each rank, each under the run's deadline; a hang dumps the stacks and exits non-zero):
  agree     B12xAllReduce(group, cuda:0): blockers + P2P agreed over gloo
  serve     serve(rows 3/6/12/24, hidden 7168): b12x's OneshotAllReduce.from_exchange_group (IPC), 24 plain
            and 24 fused plans declared
  prepare   prepare(): b12x's PreparationSession compiles (CuTe DSL) and binds every plan, no launch
  eager     plain allreduce and fused allreduce+residual+RMSNorm at rows 1, 2, 3, 5, 7, 12, 17, 24 against an
            fp32 reference (gloo allreduce of the exact bf16 inputs on the CPU)
  graph     one CUDA graph (after an eager warm-up, as SGLang captures) with plain + fused at 3 and 24 rows,
            replayed with fresh inputs, then eager calls again (device slot selection after capture)
  destroy   the session and the runtime closed (a collective)

  python3 b12x_sm90_probe.py WS > wsWS.json 2> wsWS.log      (env: B12X_KIT, DEADLINE, REPLAYS)
Exit 0 only when every rank finished and every check passed on every rank.
"""

import faulthandler
import importlib.util
import json
import logging
import math
import os
import sys
import tempfile
import time
import traceback
import types

H = 7168
ROWS = [bs * 3 for bs in (1, 2, 4, 8)]  # EAGLE-3 verify at batches 1-8 x 3 draft tokens: 24 rows
EAGER_ROWS = [1, 2, 3, 5, 7, 12, 17, 24]
ULPS = {2: 2, 4: 3, 8: 5}
EPS = 1e-6


def load_adapter(kit):
    import torch

    # environ.py's last import (a CUDA core-dump hook, off unless SGLANG_CUDA_COREDUMP=1) stays empty here
    for name in ("sglang", "sglang.srt", "sglang.srt.distributed", "sglang.srt.distributed.device_communicators",
                 "sglang.srt.debug_utils", "sglang.srt.debug_utils.cuda_coredump"):
        mod = types.ModuleType(name)
        mod.__path__ = []
        sys.modules[name] = mod

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    load("sglang.srt.environ", os.path.join(kit, "environ.py"))
    p5 = types.ModuleType("sglang.srt.distributed.device_communicators.pcie_ipc_allreduce")
    p5._p2p_row = lambda device, devices: [d == device or torch.cuda.can_device_access_peer(device, d) for d in devices]
    p5._server_flags = lambda: (False, True)
    p5.log_decode_allreduce_path = lambda group: LINES.append(f"decode/verify path decided (rank {group.rank_in_group})")
    sys.modules[p5.__name__] = p5
    ps = types.ModuleType("sglang.srt.distributed.parallel_state")
    ps._TP = None
    sys.modules[ps.__name__] = ps
    sys.modules["sglang.srt.distributed"].parallel_state = ps
    return load("sglang.srt.distributed.device_communicators.b12x_allreduce", os.path.join(kit, "b12x_allreduce.py"))


LINES = []


class Keep(logging.Handler):
    def emit(self, record):
        LINES.append(f"{record.levelname}: {record.getMessage()}")


def bound(torch, m, ws):
    return 0.0 if m == 0 else ULPS[ws] * 2.0 ** (math.floor(math.log2(m)) - 7)


def worker(rank, ws, initf, q):
    out = {"rank": rank, "phases": {}, "checks": {}, "failures": [], "errors": {}}

    def check(name, ok, detail=""):
        out["checks"][name] = out["checks"].get(name, True) and bool(ok)
        if not ok and len(out["failures"]) < 40:
            out["failures"].append(f"{name}: {detail}"[:600])

    try:
        import torch
        import torch.distributed as dist

        faulthandler.dump_traceback_later(float(os.environ.get("DEADLINE", "240")), exit=True)
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        dist.init_process_group("gloo", init_method="file://" + initf, rank=rank, world_size=ws)
        group = dist.group.WORLD
        mod = load_adapter(os.environ["B12X_KIT"])
        mod.logger.addHandler(Keep())
        mod.logger.setLevel(logging.INFO)
        # the harness keeps whole tracebacks where the adapter logs one line
        mod._first_line = lambda e: "".join(traceback.format_exception(e))[-8000:]
        cap = tuple(torch.cuda.get_device_capability(dev))
        out["device"] = [torch.cuda.get_device_name(dev), list(cap), torch.cuda.get_device_properties(dev).multi_processor_count]
        mod.B12X_CAPABILITIES = mod.B12X_CAPABILITIES + (cap,)  # the bypass: harness only, never in the patch

        t = time.time()
        comm = mod.B12xAllReduce(group, dev)
        out["phases"]["agree"] = round(time.time() - t, 2)
        check("agreed", comm.agreed, LINES[-1:])
        t = time.time()
        comm.serve(ROWS, H)
        out["phases"]["serve"] = round(time.time() - t, 2)
        check("served", comm.agreed and comm._runtime is not None, LINES[-1:])
        t = time.time()
        comm.prepare(types.SimpleNamespace(rank_in_group=rank, world_size=ws))
        out["phases"]["prepare"] = round(time.time() - t, 2)
        check("prepared", not comm.disabled, LINES[-1:])
        if comm.disabled:
            raise RuntimeError("not serving after prepare")
        out["plans"] = [sorted(comm._plain), sorted(comm._fused)]

        def reference(x):
            ref = x.float().cpu()
            dist.all_reduce(ref, group=group)
            return ref

        def verify(tag, rows, x, res, w, y, o, r):
            ref = reference(x)
            m = ref.abs().max().item()
            err = (y.float().cpu() - ref).abs().max().item()
            check(f"plain_{tag}", err <= bound(torch, m, ws), f"rows {rows}: max err {err} > {bound(torch, m, ws)} (max {m})")
            ref_res = ref + res.float().cpu()
            mr = ref_res.abs().max().item()
            err_r = (r.float().cpu() - ref_res).abs().max().item()
            check(f"fused_residual_{tag}", err_r <= bound(torch, mr, ws) + 2.0 ** (math.floor(math.log2(mr)) - 7),
                  f"rows {rows}: residual err {err_r} (max {mr})")
            ref_out = ref_res * torch.rsqrt(ref_res.pow(2).mean(-1, keepdim=True) + EPS) * w.float().cpu()
            err_o = ((o.float().cpu() - ref_out).abs() / (ref_out.abs() + 1.0)).max().item()
            check(f"fused_norm_{tag}", err_o <= 0.04, f"rows {rows}: norm rel err {err_o}")
            out["errors"][f"{tag}_{rows}"] = [round(err, 5), round(err_r, 5), round(err_o, 5)]

        gen = torch.Generator(device="cpu")

        def inputs(rows, seed):
            gen.manual_seed(seed * 1009 + rank)
            x = (torch.randn(rows, H, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
            res = torch.randn(rows, H, generator=gen).to(torch.bfloat16).to(dev)
            return x, res

        gen.manual_seed(7)
        w = (torch.rand(H, generator=gen) + 0.5).to(torch.bfloat16).to(dev)  # the same weight on every rank
        t = time.time()
        for rows in EAGER_ROWS:
            x, res = inputs(rows, rows)
            check("routes", comm.should_b12x_ar(x) and comm.fuses(rows), f"rows {rows}")
            y = comm.all_reduce(x)
            o, r = comm.fused_add_rms_norm(x, res, w, EPS)
            torch.cuda.synchronize()
            check("fused_served", o is not None, f"rows {rows}")
            verify("eager", rows, x, res, w, y, o, r)
        check("not_past_width", not comm.should_b12x_ar(torch.empty(25, H, dtype=torch.bfloat16, device=dev)))
        out["phases"]["eager"] = round(time.time() - t, 2)

        t = time.time()
        static = {rows: inputs(rows, 100 + rows) for rows in (3, 24)}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up eager runs, as SGLang's runner before each capture
            for rows, (x, res) in static.items():
                comm.all_reduce(x)
                comm.fused_add_rms_norm(x, res, w, EPS)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        dist.barrier(group=group)
        graph = torch.cuda.CUDAGraph()
        outs = {}
        with torch.cuda.graph(graph, stream=stream):
            for rows, (x, res) in static.items():
                outs[rows] = (comm.all_reduce(x),) + tuple(comm.fused_add_rms_norm(x, res, w, EPS))
        torch.cuda.synchronize()
        out["phases"]["capture"] = round(time.time() - t, 2)
        replays = int(os.environ.get("REPLAYS", "20"))
        for i in range(replays):
            for rows, (x, res) in static.items():
                nx, nres = inputs(rows, 1000 + i * 7 + rows)
                x.copy_(nx)
                res.copy_(nres)
            torch.cuda.synchronize()
            graph.replay()
            torch.cuda.synchronize()
            for rows, (x, res) in static.items():
                verify("graph", rows, x, res, w, *outs[rows])
        for rows in (3, 24):  # eager again, after the capture froze the slot selection on the device
            x, res = inputs(rows, 5000 + rows)
            y = comm.all_reduce(x)
            o, r = comm.fused_add_rms_norm(x, res, w, EPS)
            torch.cuda.synchronize()
            verify("eager_after_graph", rows, x, res, w, y, o, r)
        out["replays"] = replays
        out["phases"]["graph"] = round(time.time() - t, 2)
        del graph
        t = time.time()
        comm.destroy()
        out["phases"]["destroy"] = round(time.time() - t, 2)
        dist.barrier(group=group)
    except BaseException as e:
        out["exception"] = "".join(traceback.format_exception(e))[-8000:]
    out["lines"] = LINES[:]
    out["ok"] = "exception" not in out and not out["failures"] and all(out["checks"].values())
    q.put(out)


def main():
    import multiprocessing as mp

    ws = int(sys.argv[1])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    initf = os.path.join(tempfile.mkdtemp(), "init")
    procs = [ctx.Process(target=worker, args=(r, ws, initf, q)) for r in range(ws)]
    for p in procs:
        p.start()
    deadline = time.time() + float(os.environ.get("DEADLINE", "240")) + 30
    results = []
    while len(results) < ws and time.time() < deadline:
        try:
            results.append(q.get(timeout=5))
        except Exception:
            if not any(p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    results.sort(key=lambda r: r["rank"])
    ok = len(results) == ws and all(r["ok"] for r in results)
    print(json.dumps({"ws": ws, "ok": ok, "finished": [r["rank"] for r in results],
                      "exitcodes": [p.exitcode for p in procs], "ranks": results}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
