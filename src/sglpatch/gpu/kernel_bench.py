"""Allreduce latency + correctness worker for `sglpatch regress --tier kernel`.

One process per GPU, started by torchrun (or anything that sets RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT):

    torchrun --standalone --nproc-per-node 8 -m sglpatch.gpu.kernel_bench --out kb.json
    torchrun --standalone --nproc-per-node 2 src/sglpatch/gpu/kernel_bench.py --out kb.json

Standalone on purpose: it imports only the standard library and torch (sglang,
sgl_kernel and flashinfer optionally, each guarded), so the file can be copied to a
GPU box that has no sglpatch installed.

For every backend present and every size in --sizes (rows x --hidden, bf16) it
measures the allreduce eager and captured in a CUDA graph (like SGLang's decode),
and checks every output against an exact reference: inputs are small integers,
so their bf16 sum over <= 32 ranks is exact and any difference is a wrong result.

Timing: one sample = --inner allreduces back to back (inputs rotate among --inner
different buffers) between two CUDA events, divided by --inner; ranks are aligned
on a CPU barrier before each sample; a sample's time is that of the rank whose
events show the least time (the last to arrive, which waited for no other).  The
report gives the median and p90 over --samples samples, in microseconds.

--stress N instead: every non-NCCL backend, N allreduces eager and N as CUDA-graph replays
(groups of back-to-back ops), each result compared exactly with NCCL's allreduce of the same
input; the first mismatch is named by iteration, rank and element; a step without progress
for --stress-step-timeout s ends the run with a HANG line (exit 3).  --device cpu runs it
under gloo on CPU tensors (the CPU tests).  See the "stress" section below.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a file: our own folder must not shadow stdlib modules
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse
import contextlib
import datetime
import json
import platform
import re
import statistics
import subprocess
import time
import traceback

DEFAULT_SIZES = [1, 2, 3, 4, 8, 16, 64, 512, 2048]
DEFAULT_HIDDEN = 7168
ALL_BACKENDS = ["nccl", "symm_mem", "custom_ar", "flashinfer_fused"]
SCHEMA = "sglpatch.kernel_bench/1"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile (q in 0..100)."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def parse_sizes(text: str) -> list[int]:
    out = [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
    if not out or any(n <= 0 for n in out):
        raise argparse.ArgumentTypeError(f"bad --sizes {text!r}: want positive integers like 1,2,3")
    return out


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kernel_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=parse_sizes, default=DEFAULT_SIZES, help="rows, comma separated")
    p.add_argument("--hidden", type=int, default=DEFAULT_HIDDEN)
    p.add_argument("--backends", default=",".join(ALL_BACKENDS),
                   help=f"comma separated subset of {ALL_BACKENDS}")
    p.add_argument("--modes", default="eager,graph")
    p.add_argument("--name-suffix", default="", help="appended to backend names, e.g. _p2p_off")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", required=True, help="JSON result (written by rank 0)")
    p.add_argument("--custom-ar-max-bytes", type=int, default=64 * 1024 * 1024,
                   help="max_size given to SGLang's CustomAllreduce (so every size is measured)")
    s = p.add_argument_group("stress (--stress N replaces the latency run)")
    s.add_argument("--stress", type=int, default=0, metavar="N",
                   help="N allreduces per non-NCCL backend and mode, each compared exactly with NCCL")
    s.add_argument("--stress-sizes", type=parse_sizes, default=STRESS_DEFAULT_SIZES,
                   help="rows cycled through by the stress iterations (default: decode/verify sizes)")
    s.add_argument("--stress-repeat", type=int, default=8,
                   help="back-to-back ops of each size in a group (a group = every size, this many times)")
    s.add_argument("--stress-batch", type=int, default=1024, help="iterations between host syncs")
    s.add_argument("--stress-step-timeout", type=float, default=120.0,
                   help="seconds without progress (set-up, capture or one batch) before a HANG exit 3")
    s.add_argument("--stress-progress-s", type=float, default=10.0, help="seconds between progress lines")
    s.add_argument("--stress-seed", type=int, default=1234)
    s.add_argument("--selftest-fault", default="", metavar="ITER[:RANK[:ELEM]]",
                   help="where selftest_wrong / selftest_hang misbehave (default: N/2 on the last rank)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo on CPU tensors, stress only (the tests' mode; no CUDA graphs)")
    return p


# --------------------------------------------------------------------------- hardware


def _run_quiet(cmd: list[str], timeout: float = 20.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def nvlink_from_topo(topo: str | None) -> bool | None:
    """True when `nvidia-smi topo -m` shows an NV# link between two GPUs, False when it
    shows GPUs but none, None when unknown."""
    if not topo:
        return None
    gpu_rows = [ln for ln in topo.splitlines() if re.match(r"^\s*GPU\d+\s", ln)]
    if not gpu_rows:
        return None
    return any(re.search(r"\bNV\d+\b", ln) for ln in gpu_rows)


def hardware_info(torch, world_size: int) -> dict:
    info: dict = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "world_size": world_size,
        "visible_gpus": torch.cuda.device_count(),
    }
    try:
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        info["nccl"] = f"unknown ({e})"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info["gpu_names"] = names
    info["gpu_name"] = names[0] if names and len(set(names)) == 1 else names
    cap = torch.cuda.get_device_capability(0)
    info["compute_capability"] = f"{cap[0]}.{cap[1]}"
    n = min(world_size, torch.cuda.device_count())
    p2p = {}
    for a in range(n):
        for b in range(n):
            if a != b:
                p2p[f"{a}->{b}"] = bool(torch.cuda.can_device_access_peer(a, b))
    info["p2p_access"] = p2p
    topo = _run_quiet(["nvidia-smi", "topo", "-m"])
    info["nvidia_smi_topo"] = topo
    info["nvlink"] = nvlink_from_topo(topo)
    drv = _run_quiet(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    info["driver"] = drv.strip().splitlines()[0] if drv else None
    info["env"] = {k: v for k, v in sorted(os.environ.items())
                   if k.startswith(("NCCL_", "TORCH_SYMM_MEM", "NVSHMEM_", "SGLANG_", "CUDA_VISIBLE"))}
    return info


# --------------------------------------------------------------------------- inputs


def make_input(torch, rank: int, k: int, rows: int, hidden: int, device):
    """Small integers in [-3, 3]; depend on rank and on the op index k."""
    idx = torch.arange(rows * hidden, device=device, dtype=torch.int64)
    v = (idx * 3 + rank * 5 + k * 11) % 7 - 3
    return v.to(torch.bfloat16).view(rows, hidden)


def make_reference(torch, world_size: int, k: int, rows: int, hidden: int, device):
    acc = None
    for r in range(world_size):
        x = make_input(torch, r, k, rows, hidden, device).float()
        acc = x if acc is None else acc + x
    return acc.to(torch.bfloat16)


# --------------------------------------------------------------------------- backends


class Unavailable(Exception):
    """Backend not present here; str() is the reason."""


class Backend:
    """One allreduce implementation.  `prepare(rows)` allocates; `op(k)` runs op k and
    returns its output; `refill()` restores inputs before a sample; `capture_ctx()`
    wraps CUDA-graph capture."""

    name = "?"
    in_place = False

    def __init__(self, torch, dist, ctx):
        self.torch, self.dist, self.ctx = torch, dist, ctx

    def supports(self, rows: int) -> str | None:  # None = yes, else reason
        return None

    def prepare(self, rows: int, inner: int) -> None:
        t, c = self.torch, self.ctx
        self.rows = rows
        self.pristine = [make_input(t, c.rank, k, rows, c.hidden, c.device) for k in range(inner)]
        self.refs = [make_reference(t, c.world_size, k, rows, c.hidden, c.device) for k in range(inner)]

    def refill(self) -> None:
        pass

    def capture_ctx(self):
        return contextlib.nullcontext()

    def stress_op(self, x, it):
        """Allreduce of `x` for the stress mode (capturable in a CUDA graph); `it` is the
        iteration number as a 0-d device tensor.  Returns the output."""
        raise Unavailable(f"{self.name} has no stress mode")

    def before_iteration(self, i: int) -> None:
        """Host hook run before stress iteration i (eager and graph alike)."""

    def check(self, outs) -> tuple[bool, float, str]:
        worst = 0.0
        for k, (o, ref) in enumerate(zip(outs, self.refs)):
            if o is None:
                return False, float("inf"), f"op {k} returned no output"
            d = (o.float() - ref.float()).abs()
            if not bool(self.torch.isfinite(o.float()).all()):
                return False, float("inf"), f"op {k}: non-finite values"
            m = float(d.max())
            worst = max(worst, m)
        return worst == 0.0, worst, "" if worst == 0.0 else f"max abs error {worst}"

    def close(self) -> None:
        pass


class NcclBackend(Backend):
    name = "nccl"
    in_place = True

    def prepare(self, rows, inner):
        super().prepare(rows, inner)
        self.bufs = [p.clone() for p in self.pristine]

    def refill(self):
        for b, p in zip(self.bufs, self.pristine):
            b.copy_(p)

    def op(self, k):
        self.dist.all_reduce(self.bufs[k])
        return self.bufs[k]

    def stress_op(self, x, it):
        y = x.clone()
        self.dist.all_reduce(y)
        return y


class SymmMemBackend(Backend):
    """torch symmetric memory one-shot allreduce (P2P loads, no multicast); drop-in
    cost: the input is copied into the symmetric buffer first, like SGLang's eager
    custom allreduce does."""

    name = "symm_mem"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        if not ctx.is_cuda:
            raise Unavailable("torch symmetric memory needs CUDA devices")
        try:
            import torch.distributed._symmetric_memory as symm_mem
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"torch.distributed._symmetric_memory does not import: {e}")
        if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce"):
            raise Unavailable(f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce")
        self.symm_mem = symm_mem
        self.group_name = dist.group.WORLD.group_name
        self.buffers: dict[int, object] = {}

    def prepare(self, rows, inner):
        super().prepare(rows, inner)
        if rows not in self.buffers:
            self.prepare_buffer(rows)
        self.buf = self.buffers[rows]

    def op(self, k):
        self.buf.copy_(self.pristine[k])
        return self.torch.ops.symm_mem.one_shot_all_reduce(self.buf, "sum", self.group_name)

    def stress_op(self, x, it):
        rows = x.shape[0]
        if rows not in self.buffers:  # first call is eager (warm-up), never under capture
            self.prepare_buffer(rows)
        buf = self.buffers[rows]
        buf.copy_(x)
        return self.torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name)

    def prepare_buffer(self, rows):
        t = self.torch
        buf = self.symm_mem.empty((rows, self.ctx.hidden), dtype=t.bfloat16, device=self.ctx.device)
        self.symm_mem.rendezvous(buf, self.group_name)
        self.buffers[rows] = buf


class CustomArBackend(Backend):
    """SGLang's CustomAllreduce through the patched tree, P2's PCIe switch on."""

    name = "custom_ar"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        os.environ.setdefault("SGLANG_ENABLE_PCIE_CUSTOM_AR", "1")
        # measure past the shipped cap so the crossover can be found
        os.environ.setdefault("SGLANG_PCIE_CUSTOM_AR_MAX_BYTES", str(ctx.custom_ar_max_bytes))
        try:
            import sgl_kernel  # noqa: F401
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"sgl_kernel does not import ({type(e).__name__}: {e})")
        try:
            from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"sglang CustomAllreduce does not import ({type(e).__name__}: {e})")
        self.ca = CustomAllreduce(group=ctx.cpu_group, device=ctx.device, max_size=ctx.custom_ar_max_bytes)
        if getattr(self.ca, "disabled", False):
            raise RuntimeError(
                "CustomAllreduce constructed but disabled itself with SGLANG_ENABLE_PCIE_CUSTOM_AR=1 "
                "(see the worker log for SGLang's reason)")

    def supports(self, rows):
        x = self.torch.empty((rows, self.ctx.hidden), dtype=self.torch.bfloat16, device=self.ctx.device)
        if not self.ca.should_custom_ar(x):
            return f"should_custom_ar() declined {x.numel() * 2} bytes"
        return None

    def capture_ctx(self):
        return self.ca.capture()

    def op(self, k):
        return self.ca.custom_all_reduce(self.pristine[k])

    def stress_op(self, x, it):
        out = self.ca.custom_all_reduce(x)
        if out is None:
            raise RuntimeError(f"CustomAllreduce declined a {tuple(x.shape)} input in the stress run")
        return out

    def close(self):
        with contextlib.suppress(Exception):
            self.ca.close()


class FlashinferFusedBackend(Backend):
    """flashinfer fused allreduce + residual add + RMSNorm (P1's path).  Checked: the
    residual output exactly, the normed output to 2e-2 relative."""

    name = "flashinfer_fused"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        try:
            import flashinfer.comm as comm
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"flashinfer.comm does not import ({type(e).__name__}: {e})")
        if not hasattr(comm, "trtllm_allreduce_fusion"):
            raise Unavailable("this flashinfer has no comm.trtllm_allreduce_fusion")
        self.comm = comm
        self.max_tokens = max(ctx.sizes)
        self.ipc_handles, self.workspace = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            ctx.rank, ctx.world_size, self.max_tokens, ctx.hidden, group=ctx.cpu_group,
            use_fp32_lamport=False)
        self.eps = 1e-6

    def prepare(self, rows, inner):
        super().prepare(rows, inner)
        t, c = self.torch, self.ctx
        self.gamma = (t.arange(c.hidden, device=c.device) % 3 + 1).to(t.bfloat16)
        self.residual = ((t.arange(rows * c.hidden, device=c.device) % 5) - 2).to(t.bfloat16).view(rows, c.hidden)
        self.res_refs = [(r.float() + self.residual.float()).to(t.bfloat16) for r in self.refs]
        self.norm_refs = []
        for y in self.res_refs:
            yf = y.float()
            n = yf * t.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps) * self.gamma.float()
            self.norm_refs.append(n)
        self.res_outs = [t.empty_like(self.residual) for _ in range(inner)]
        self.norm_outs = [t.empty_like(self.residual) for _ in range(inner)]

    def op(self, k):
        c = self.ctx
        self.comm.trtllm_allreduce_fusion(
            allreduce_in=self.pristine[k], world_size=c.world_size, world_rank=c.rank,
            token_num=self.rows, hidden_dim=c.hidden, workspace_ptrs=self.workspace,
            launch_with_pdl=True, use_oneshot=True, trigger_completion_at_end=False, fp32_acc=False,
            pattern_code=self.comm.AllReduceFusionPattern.kARResidualRMSNorm,
            allreduce_out=None, residual_in=self.residual, residual_out=self.res_outs[k],
            norm_out=self.norm_outs[k], quant_out=None, scale_out=None, rms_gamma=self.gamma,
            rms_eps=self.eps, scale_factor=None, layout_code=None)
        return k

    def check(self, outs):
        t = self.torch
        worst = 0.0
        for k in range(len(self.refs)):
            r = self.res_outs[k].float()
            if not bool(t.isfinite(r).all()) or not bool(t.isfinite(self.norm_outs[k].float()).all()):
                return False, float("inf"), f"op {k}: non-finite values"
            e_res = float((r - self.res_refs[k].float()).abs().max())
            ref = self.norm_refs[k]
            e_norm = float((self.norm_outs[k].float() - ref).norm() / ref.norm().clamp_min(1e-12))
            worst = max(worst, e_res, e_norm)
            if e_res != 0.0 or e_norm > 2e-2:
                return False, worst, f"op {k}: residual max err {e_res}, norm rel err {e_norm:.3g}"
        return True, worst, ""

    def refill(self):
        for o in self.res_outs + self.norm_outs:
            o.fill_(float("nan"))


class SelftestWrongBackend(NcclBackend):
    """Fast and wrong on purpose (NCCL, then one element off by one): proves the checker
    fails the tier.  Only for tests; never in a profile's backend list.  In the stress
    mode it is wrong once: at --selftest-fault ITER:RANK:ELEM (on the device, so also
    inside a CUDA graph)."""

    name = "selftest_wrong"

    def op(self, k):
        out = super().op(k)
        out[0, 0] += 1
        return out

    def stress_op(self, x, it):
        out = super().stress_op(x, it)
        f = self.ctx.fault
        if self.ctx.rank == f["rank"]:
            flat = out.view(-1)
            e = f["element"] % flat.numel()
            flat[e:e + 1] += (it == f["iteration"]).to(out.dtype)
        return out


class SelftestHangBackend(NcclBackend):
    """Hangs on purpose in the stress mode: rank RANK stops at iteration ITER of
    --selftest-fault (a host-side stall, so its peers wait in the next collective).
    Proves the per-step timeout.  Only for tests."""

    name = "selftest_hang"

    def before_iteration(self, i):
        f = self.ctx.fault
        if self.ctx.rank == f["rank"] and i == f["iteration"]:
            while True:
                time.sleep(3600)


BACKEND_CLASSES = {c.name: c for c in (NcclBackend, SymmMemBackend, CustomArBackend, FlashinferFusedBackend,
                                       SelftestWrongBackend, SelftestHangBackend)}


def backend_class(name: str, label: str, errors: dict[str, str]):
    """The Backend class called `name`; None (and errors[label] says why) when there is none."""
    cls = BACKEND_CLASSES.get(name)
    if cls is None:
        errors[label] = f"unknown backend {name!r}; known: {sorted(BACKEND_CLASSES)}"
    return cls


# --------------------------------------------------------------------------- measuring


class Ctx:
    pass


def _poison(torch, outs):
    for o in outs:
        if isinstance(o, torch.Tensor):
            o.fill_(float("nan"))


def measure(backend: Backend, ctx, rows: int, mode: str) -> dict:
    torch, dist = ctx.torch, ctx.dist
    inner = ctx.args.inner
    backend.prepare(rows, inner)
    times: list[float] = []
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)

    def sample(fn):
        torch.cuda.synchronize()
        dist.barrier(group=ctx.cpu_group)
        start.record()
        res = fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / inner)
        return res

    if mode == "eager":
        def run_all():
            return [backend.op(k) for k in range(inner)]
        for _ in range(ctx.args.warmup):
            backend.refill()
            run_all()
        outs = None
        first_check = None
        for s in range(ctx.args.samples):
            backend.refill()
            outs = sample(run_all)
            if s == 0:
                first_check = backend.check(outs)
    else:
        # warm up on a side stream as torch.cuda.graph wants, then capture `inner` ops
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                backend.refill()
                [backend.op(k) for k in range(inner)]
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        backend.refill()
        g = torch.cuda.CUDAGraph()
        with backend.capture_ctx():
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                outs = [backend.op(k) for k in range(inner)]
        torch.cuda.synchronize()
        for _ in range(ctx.args.warmup):
            backend.refill()
            g.replay()
        first_check = None
        for s in range(ctx.args.samples):
            backend.refill()
            if not backend.in_place:
                _poison(torch, outs)
            sample(g.replay)
            if s == 0:
                first_check = backend.check(outs)
        torch.cuda.synchronize()
    ok, err, detail = backend.check(outs)
    if first_check is not None and not first_check[0]:
        ok, err, detail = first_check
    if mode == "graph":
        del g
    return {"ok": ok, "max_abs_err": err, "detail": detail, "times_us": times}


def gather(ctx, obj):
    out = [None] * ctx.world_size
    ctx.dist.all_gather_object(out, obj, group=ctx.cpu_group)
    return out


# --------------------------------------------------------------------------- stress
#
# --stress N: for each non-NCCL backend, N allreduces eager and N as CUDA-graph replays,
# each compared exactly with NCCL's allreduce of the same input.  Iteration i takes the
# size sizes[i % len(sizes)] and a fresh input drawn on the device (integers in
# [-b, b] as bf16, b = min(8, 256 // world_size): every sum is exact in bf16 whatever
# the order, so any difference is a wrong result).  The checks run on the device into
# a ring of --stress-batch slots; the host reads the ring once per batch, and the ranks
# agree over the CPU group after each batch (all stop at the first batch that shows a
# mismatch on any rank).  A watchdog thread ends the process with a HANG line when a
# step (setup, capture, or one batch) makes no progress for --stress-step-timeout s.

STRESS_DEFAULT_SIZES = [1, 2, 3, 4, 8, 16]
STRESS_SCHEMA = "sglpatch.kernel_bench.stress/1"
EXIT_HANG = 3


def value_bound(world_size: int) -> int:
    """Largest |input| such that every partial sum over world_size ranks is an exact bf16
    integer (bf16 holds integers up to 256 exactly)."""
    return max(1, min(8, 256 // max(1, world_size)))


def parse_fault(text: str, n_iter: int, world_size: int) -> dict:
    """--selftest-fault ITER[:RANK[:ELEM]]; default: the middle iteration, the last rank, element 7."""
    parts = [p for p in (text or "").split(":")]
    it = int(parts[0]) if parts and parts[0] else n_iter // 2
    rank = int(parts[1]) if len(parts) > 1 and parts[1] else world_size - 1
    elem = int(parts[2]) if len(parts) > 2 and parts[2] else 7
    return {"iteration": it, "rank": rank, "element": elem}


class Watchdog:
    """Ends the process (exit 3) with one HANG line when beat() is not called for timeout_s."""

    def __init__(self, timeout_s: float, rank: int):
        import threading

        self.timeout_s, self.rank = timeout_s, rank
        self.what, self.t = "start-up", time.monotonic()
        if timeout_s and timeout_s > 0:
            threading.Thread(target=self._watch, daemon=True, name="kernel_bench-watchdog").start()

    def beat(self, what: str) -> None:
        self.what, self.t = what, time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout_s / 4))
            idle = time.monotonic() - self.t
            if idle > self.timeout_s:
                print(f"[kernel_bench] HANG rank {self.rank}: no progress for {idle:.0f} s "
                      f"(step timeout {self.timeout_s:g} s) in {self.what}", flush=True)
                sys.stderr.flush()
                os._exit(EXIT_HANG)


def group_plan(sizes: list[int], repeat: int) -> list[int]:
    """Rows of the ops of one group: each size `repeat` times back to back (as decode runs
    many allreduces of one size in a row), then the next size."""
    return [n for n in sizes for _ in range(repeat)]


class MismatchRing:
    """Check results on the device for `groups` groups of len(plan) ops each: per op, the
    number of elements that differ from the reference, the first one (index inside the op's
    output) and both values there.  A group's outputs and references are compared in one
    pass over their concatenation; nothing here syncs with the host except read()."""

    def __init__(self, torch, groups: int, plan: list[int], hidden: int, device, dtype):
        self.torch, self.plan, self.hidden = torch, plan, hidden
        g = len(plan)
        self.offsets = [0]
        for n in plan:
            self.offsets.append(self.offsets[-1] + n * hidden)
        self.numel = self.offsets[-1]
        self.seg = torch.repeat_interleave(torch.arange(g, device=device),
                                           torch.tensor([n * hidden for n in plan], device=device))
        self.pos = torch.arange(self.numel, device=device)
        self.off = torch.tensor(self.offsets[:-1], dtype=torch.int64, device=device)
        self.count = torch.zeros((groups, g), dtype=torch.int64, device=device)
        self.first = torch.zeros((groups, g), dtype=torch.int64, device=device)
        self.got = torch.zeros((groups, g), dtype=dtype, device=device)
        self.want = torch.zeros((groups, g), dtype=dtype, device=device)

    def record(self, slot: int, out_flat, ref_flat) -> None:
        """Compare one group exactly (NaN counts as different)."""
        t = self.torch
        neq = out_flat.ne(ref_flat)
        cnt, fst = self.count[slot], self.first[slot]
        cnt.zero_()
        cnt.index_add_(0, self.seg, neq.to(t.int64))
        fst.fill_(self.numel)
        fst.scatter_reduce_(0, self.seg, t.where(neq, self.pos, self.numel), "amin")
        idx = fst.clamp(max=self.numel - 1)
        t.index_select(out_flat, 0, idx, out=self.got[slot])
        t.index_select(ref_flat, 0, idx, out=self.want[slot])
        fst.sub_(self.off)

    def read(self, n: int, start: int, rank: int) -> tuple[int, int, dict | None]:
        """One host sync for n groups starting at iteration `start`: (iterations with a
        difference, differing elements, the first difference)."""
        g = len(self.plan)
        counts = self.count[:n].reshape(-1).tolist()
        bad = [k for k, c in enumerate(counts) if c]
        if not bad:
            return 0, 0, None
        k = bad[0]
        s, j = divmod(k, g)
        local = int(self.first[s, j])
        first = {"iteration": start + k, "rank": rank, "rows": self.plan[j], "hidden": self.hidden,
                 "element": [local // self.hidden, local % self.hidden], "flat_index": local,
                 "got": float(self.got[s, j]), "nccl": float(self.want[s, j]), "elements_wrong": counts[k]}
        return len(bad), sum(counts), first


def merge_stress_ranks(per_rank: list[dict]) -> dict:
    """Combine the ranks' stress results of one backend and mode into one row."""
    done = min(r["iterations_done"] for r in per_rank)
    firsts = [r["first_mismatch"] for r in per_rank if r.get("first_mismatch")]
    first = min(firsts, key=lambda f: (f["iteration"], f["rank"])) if firsts else None
    by_rank = {str(i): r["mismatched_iterations"] for i, r in enumerate(per_rank) if r["mismatched_iterations"]}
    return {
        "iterations_done": done,
        "mismatched_iterations": max((r["mismatched_iterations"] for r in per_rank), default=0),
        "mismatched_elements": sum(r["mismatched_elements"] for r in per_rank),
        "mismatch_ranks": by_rank,
        "first_mismatch": first,
        "stopped_early": any(r.get("stopped_early") for r in per_rank),
        "group": per_rank[0].get("group"),
        "elapsed_s": round(max(r["elapsed_s"] for r in per_rank), 1),
        "status": "mismatch" if first else ("ok" if done == per_rank[0]["iterations_requested"] else "incomplete"),
    }


def describe_mismatch(backend: str, mode: str, f: dict) -> str:
    r, c = f["element"]
    return (f"{backend} {mode}: first mismatch at iteration {f['iteration']} on rank {f['rank']}, "
            f"[{f['rows']},{f['hidden']}] element [{r},{c}]: got {f['got']:g}, NCCL {f['nccl']:g} "
            f"({f['elements_wrong']} elements wrong in that iteration)")


class CpuReplay:
    """--device cpu (tests): stands in for a CUDA graph by re-running the captured group into
    the same output tensors; the bookkeeping around it is the one the GPU run uses."""

    def __init__(self, fn):
        self.fn = fn
        self.outs = fn()

    def replay(self):
        for o, new in zip(self.outs, self.fn()):
            o.copy_(new)


def stress_one(backend: Backend, ctx, mode: str, sizes: list[int], wd: Watchdog) -> dict:
    """The stress run of one backend in one mode on this rank.  Iterations go in groups:
    the group's ops run back to back (fresh inputs drawn on the device, then the backend's
    allreduce; eager, or one CUDA graph of the whole group replayed), then NCCL reduces the
    same inputs in one call and one pass compares all of them on the device."""
    torch, dist, args = ctx.torch, ctx.dist, ctx.args
    hidden = ctx.hidden
    plan = group_plan(sizes, args.stress_repeat)
    g = len(plan)
    n_groups = -(-args.stress // g)  # N rounded up to whole groups
    n_iter = n_groups * g
    per_batch = max(1, args.stress_batch // g)
    label = f"stress {backend.name}{args.name_suffix} {mode}"
    torch.manual_seed(args.stress_seed * 1009 + ctx.rank)
    b = value_bound(ctx.world_size)
    its = torch.zeros(g, dtype=torch.int64, device=ctx.device)  # iteration number of each op
    steps = torch.arange(g, dtype=torch.int64, device=ctx.device)
    xs = [torch.zeros((n, hidden), dtype=torch.bfloat16, device=ctx.device) for n in plan]
    ring = MismatchRing(torch, per_batch, plan, hidden, ctx.device, torch.bfloat16)
    x_flat = torch.zeros(ring.numel, dtype=torch.bfloat16, device=ctx.device)
    out_flat = torch.zeros_like(x_flat)

    def group():  # the part under test
        outs = []
        for j, x in enumerate(xs):
            x.random_(-b, b + 1)
            outs.append(backend.stress_op(x, its[j]))
        return outs

    wd.beat(f"{label}: set-up")
    if mode == "eager":
        run_group = group
    elif ctx.is_cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                group()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        wd.beat(f"{label}: CUDA-graph capture")
        graph = torch.cuda.CUDAGraph()
        with backend.capture_ctx():
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_outs = group()
        torch.cuda.synchronize()

        def run_group():
            graph.replay()
            return static_outs
    else:
        replay = CpuReplay(group)

        def run_group():
            replay.replay()
            return replay.outs
    dist.barrier(group=ctx.cpu_group)
    res = {"iterations_requested": n_iter, "iterations_done": 0, "mismatched_iterations": 0,
           "mismatched_elements": 0, "first_mismatch": None, "stopped_early": False, "group": g}
    t0 = last = time.monotonic()
    done = 0
    while done < n_iter:
        nb = min(per_batch, (n_iter - done) // g)
        wd.beat(f"{label}: iterations {done}..{done + nb * g - 1}")
        for s in range(nb):
            start = done + s * g
            for i in range(start, start + g):
                backend.before_iteration(i)
            torch.add(steps, start, out=its)
            outs = run_group()
            torch.cat([x.view(-1) for x in xs], out=x_flat)
            torch.cat([o.reshape(-1) for o in outs], out=out_flat)
            dist.all_reduce(x_flat)  # NCCL (gloo in --device cpu) on the same inputs: the reference
            ring.record(s, out_flat, x_flat)
        n_bad, n_el, first = ring.read(nb, done, ctx.rank)
        done += nb * g
        res["iterations_done"] = done
        res["mismatched_iterations"] += n_bad
        res["mismatched_elements"] += n_el
        if first and res["first_mismatch"] is None:
            res["first_mismatch"] = first
        flag = torch.tensor([n_bad], dtype=torch.int64)
        dist.all_reduce(flag, group=ctx.cpu_group)  # every rank stops at the same batch
        now = time.monotonic()
        if int(flag) > 0:
            res["stopped_early"] = done < n_iter
            break
        if ctx.rank == 0 and (now - last >= args.stress_progress_s or done == n_iter):
            last = now
            print(f"[kernel_bench] {label}: {done}/{n_iter} iterations, 0 mismatches, "
                  f"{now - t0:.0f} s, {done / max(now - t0, 1e-9):.0f} it/s", flush=True)
    res["elapsed_s"] = round(time.monotonic() - t0, 2)
    return res


def run_stress(ctx, wanted: list[str], modes: list[str], log) -> dict:
    """Every backend in `wanted` (NCCL is the reference, not stressed), every mode."""
    torch, args = ctx.torch, ctx.args
    wd = Watchdog(args.stress_step_timeout, ctx.rank)
    rows_out: list[dict] = []
    absent: dict[str, str] = {}
    errors: dict[str, str] = {}
    for bname in wanted:
        label = bname + args.name_suffix
        cls = backend_class(bname, label, errors)
        if cls is None:
            continue
        if cls is NcclBackend or cls is FlashinferFusedBackend:
            absent[label] = ("the reference, not stressed" if cls is NcclBackend else
                             "not in the stress run (fused with RMSNorm; checked in the latency run)")
            continue
        wd.beat(f"stress {label}: backend set-up")
        state, msg, backend = "ok", "", None
        try:
            backend = cls(ctx.torch, ctx.dist, ctx)
        except Unavailable as e:
            state, msg = "absent", str(e)
        except Exception as e:  # noqa: BLE001
            state, msg = "error", f"{type(e).__name__}: {e}"
            traceback.print_exc()
        states = gather(ctx, (state, msg))
        bad = [s for s in states if s[0] != "ok"]
        if bad:
            kind = "error" if any(s[0] == "error" for s in bad) else "absent"
            (errors if kind == "error" else absent)[label] = next(s[1] for s in bad if s[0] == kind)
            log(f"stress {label}: {kind}: {(errors if kind == 'error' else absent)[label]}")
            if backend is not None:
                backend.close()
            continue
        reasons = gather(ctx, [backend.supports(n) if ctx.is_cuda else None for n in args.stress_sizes])
        sizes = [n for k, n in enumerate(args.stress_sizes) if not any(r[k] for r in reasons)]
        declined = [n for n in args.stress_sizes if n not in sizes]
        if not sizes:
            errors[label] = f"declined every stress size {args.stress_sizes}"
            backend.close()
            continue
        for mode in modes:
            log(f"stress {label} {mode}: {args.stress} iterations in groups of {len(sizes) * args.stress_repeat} "
                f"back-to-back ops (rows {sizes} x {ctx.hidden} bf16, {args.stress_repeat} each), every result "
                f"checked against NCCL")
            try:
                local = stress_one(backend, ctx, mode, sizes, wd)
                local["exc"] = None
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                local = {"exc": f"{type(e).__name__}: {e}"}
            allr = gather(ctx, local)
            row = {"backend": label, "mode": mode, "sizes": sizes, "declined_sizes": declined,
                   "hidden": ctx.hidden, "iterations_requested": args.stress,
                   "graph_impl": ("cuda_graph" if ctx.is_cuda else "cpu_replay") if mode == "graph" else None}
            excs = [a["exc"] for a in allr if a["exc"]]
            if excs:
                row.update(status="error", detail=excs[0], iterations_done=min(a.get("iterations_done", 0) for a in allr))
            else:
                row.update(merge_stress_ranks(allr))
                done = row["iterations_done"]
                row["it_per_s"] = round(done / row["elapsed_s"], 1) if row["elapsed_s"] else None
            rows_out.append(row)
            if row.get("first_mismatch"):
                log("MISMATCH " + describe_mismatch(label, mode, row["first_mismatch"]))
            log(f"stress {label} {mode}: {row['status']}: {row.get('iterations_done')}/{args.stress} iterations, "
                f"{row.get('mismatched_iterations', '-')} mismatched, {row.get('elapsed_s', '-')} s")
        backend.close()
        del backend
        if ctx.is_cuda:
            torch.cuda.empty_cache()
    wd.beat("stress: writing the result")
    return {"stress": rows_out, "absent": absent, "errors": errors}


def write_doc(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def run_stress_main(ctx, log) -> int:
    torch, dist, args = ctx.torch, ctx.dist, ctx.args
    t0 = time.time()
    if ctx.is_cuda:
        hw = hardware_info(torch, ctx.world_size) if ctx.rank == 0 else None
        warm = torch.ones(16, device=ctx.device)
        dist.all_reduce(warm)
        torch.cuda.synchronize()
    else:
        hw = {"hostname": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
              "world_size": ctx.world_size, "gpu_name": "cpu (gloo test mode)", "nvlink": None}
    modes = [m for m in args.modes.split(",") if m]
    wanted = [b for b in args.backends.split(",") if b]
    out = run_stress(ctx, wanted, modes, log)
    if ctx.rank == 0:
        doc = {"schema": STRESS_SCHEMA,
               "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "argv": sys.argv, "name_suffix": args.name_suffix, "iterations": args.stress,
               "sizes": args.stress_sizes, "hidden": args.hidden, "batch": args.stress_batch,
               "step_timeout_s": args.stress_step_timeout, "value_bound": value_bound(ctx.world_size),
               "reference": "nccl" if ctx.is_cuda else "gloo (cpu test mode)", "hardware": hw, **out,
               "elapsed_s": round(time.time() - t0, 1)}
        write_doc(args.out, doc)
        log(f"wrote {args.out}")
    dist.barrier(group=ctx.cpu_group)
    dist.destroy_process_group()
    return 0


def run(args) -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    is_cuda = args.device == "cuda"
    if is_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        try:
            dist.init_process_group("nccl", device_id=device)
        except TypeError:
            dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    cpu_group = dist.new_group(backend="gloo")

    ctx = Ctx()
    ctx.torch, ctx.dist, ctx.args = torch, dist, args
    ctx.rank, ctx.world_size, ctx.device, ctx.cpu_group = rank, world_size, device, cpu_group
    ctx.hidden, ctx.sizes = args.hidden, args.sizes
    ctx.custom_ar_max_bytes = args.custom_ar_max_bytes
    ctx.is_cuda = is_cuda
    ctx.fault = parse_fault(args.selftest_fault, args.stress, world_size)

    def log(msg):
        if rank == 0:
            print(f"[kernel_bench] {msg}", flush=True)

    if args.stress > 0:
        return run_stress_main(ctx, log)

    t0 = time.time()
    hw = hardware_info(torch, world_size) if rank == 0 else None
    # NCCL warm-up (communicator creation) outside every measurement
    warm = torch.ones(16, device=device)
    dist.all_reduce(warm)
    torch.cuda.synchronize()

    modes = [m for m in args.modes.split(",") if m]
    wanted = [b for b in args.backends.split(",") if b]
    results: list[dict] = []
    absent: dict[str, str] = {}
    errors: dict[str, str] = {}
    for bname in wanted:
        label = bname + args.name_suffix
        cls = backend_class(bname, label, errors)
        if cls is None:
            continue
        # construct on every rank; agree on the outcome so nobody enters a collective alone
        local_state, local_msg, backend = "ok", "", None
        try:
            backend = cls(torch, dist, ctx)
        except Unavailable as e:
            local_state, local_msg = "absent", str(e)
        except Exception as e:  # noqa: BLE001
            local_state, local_msg = "error", f"{type(e).__name__}: {e}"
            if rank == 0:
                traceback.print_exc()
        states = gather(ctx, (local_state, local_msg))
        bad = [s for s in states if s[0] != "ok"]
        if bad:
            kind = "error" if any(s[0] == "error" for s in bad) else "absent"
            msg = next(s[1] for s in bad if s[0] == kind)
            (errors if kind == "error" else absent)[label] = msg
            log(f"{label}: {kind}: {msg}")
            if backend is not None:
                backend.close()
            continue
        log(f"{label}: measuring {args.sizes} x {args.hidden} bf16, modes {modes}")
        for rows in args.sizes:
            reason = backend.supports(rows)
            reasons = gather(ctx, reason)
            reason = next((r for r in reasons if r), None)
            for mode in modes:
                row = {"backend": label, "mode": mode, "rows": rows, "hidden": args.hidden,
                       "bytes": rows * args.hidden * 2}
                if reason:
                    row.update(status="declined", detail=reason)
                    results.append(row)
                    continue
                try:
                    m = measure(backend, ctx, rows, mode)
                    local = {"ok": m["ok"], "err": m["max_abs_err"], "detail": m["detail"],
                             "times": m["times_us"], "exc": None}
                except Exception as e:  # noqa: BLE001
                    local = {"ok": False, "err": None, "detail": "", "times": [],
                             "exc": f"{type(e).__name__}: {e}"}
                    traceback.print_exc()
                    torch.cuda.synchronize()
                allr = gather(ctx, local)
                excs = [a["exc"] for a in allr if a["exc"]]
                if excs:
                    row.update(status="error", detail=excs[0])
                else:
                    n = min(len(a["times"]) for a in allr)
                    # the rank that reached the sample last waits for nobody: its time is the
                    # collective's latency without host skew from the CPU barrier
                    per_sample = [min(a["times"][i] for a in allr) for i in range(n)]
                    wrong = [(i, a) for i, a in enumerate(allr) if not a["ok"]]
                    row.update(
                        status="wrong" if wrong else "ok",
                        median_us=round(statistics.median(per_sample), 2),
                        p90_us=round(percentile(per_sample, 90), 2),
                        min_us=round(min(per_sample), 2),
                        samples=n,
                        max_abs_err=max((a["err"] or 0.0) for a in allr),
                        detail="; ".join(f"rank {i}: {a['detail']}" for i, a in wrong),
                    )
                results.append(row)
                log(f"{label:>22} {mode:>5} {rows:>5}x{args.hidden}: {row.get('status')} "
                    f"median {row.get('median_us', '-')} us p90 {row.get('p90_us', '-')} us")
        backend.close()
        del backend
        torch.cuda.empty_cache()

    if rank == 0:
        doc = {
            "schema": SCHEMA,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": sys.argv,
            "name_suffix": args.name_suffix,
            "sizes": args.sizes,
            "hidden": args.hidden,
            "samples": args.samples,
            "inner": args.inner,
            "hardware": hw,
            "results": results,
            "absent": absent,
            "errors": errors,
            "elapsed_s": round(time.time() - t0, 1),
        }
        write_doc(args.out, doc)
        log(f"wrote {args.out}")
    dist.barrier(group=cpu_group)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.device == "cpu" and args.stress <= 0:
        parser.error("--device cpu runs only the stress mode (give --stress N)")
    if args.stress_batch <= 0 or args.stress_repeat <= 0:
        parser.error("--stress-batch and --stress-repeat must be positive")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("kernel_bench: run me under torchrun (RANK/WORLD_SIZE unset), e.g.\n"
              "  torchrun --standalone --nproc-per-node 2 -m sglpatch.gpu.kernel_bench --out kb.json",
              file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
