"""Allreduce backends of the worker that come with torch or SGLang: NCCL (and NCCL followed by
SGLang's separate fused add-RMSNorm, the reference cost for the fused kernels), torch symmetric
memory, SGLang's custom allreduce (P2's PCIe switch), SGLang's MSCCL++ communicator, the
self-test backends, and the registry of every backend (flashinfer's are in fi_backends and pcie_ipc)."""

from __future__ import annotations

import contextlib
import inspect
import os
import time

from sglpatch.gpu.kernel.microbench.common import RMS_EPS, Backend, FusedBackend, InPlaceBackend, Unavailable, import_first


class NcclBackend(InPlaceBackend):
    name = "nccl"

    def op(self, k):
        self.dist.all_reduce(self.bufs[k])
        return self.bufs[k]

    def stress_op(self, x, it):
        y = x.clone()
        self.dist.all_reduce(y)
        return y


class NcclAddRmsnormBackend(FusedBackend):
    """What SGLang serves without a fused kernel: NCCL's allreduce, then RMSNorm's forward with a
    residual, `sgl_kernel.fused_add_rmsnorm(x, residual, weight, eps)` (in place: x becomes the
    normed output, residual becomes x + residual).  A fused kernel's time compares with this."""

    name = "nccl_add_rmsnorm"
    in_place = True

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        try:
            from sgl_kernel import fused_add_rmsnorm
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"sgl_kernel.fused_add_rmsnorm does not import ({type(e).__name__}: {e})")
        self.fused_add_rmsnorm = fused_add_rmsnorm

    def prepare(self, rows, inner):
        super().prepare(rows, inner)
        self.bufs = [p.clone() for p in self.pristine]
        self.res_outs = [self.residual.clone() for _ in range(inner)]
        self.norm_outs = self.bufs

    def refill(self):
        for b, p, r in zip(self.bufs, self.pristine, self.res_outs):
            b.copy_(p)
            r.copy_(self.residual)

    def op(self, k):
        self.dist.all_reduce(self.bufs[k])
        self.fused_add_rmsnorm(self.bufs[k], self.res_outs[k], self.gamma, RMS_EPS)
        return k

    def fused_op(self, x, residual, gamma, res_out, norm_out):
        norm_out.copy_(x)
        self.dist.all_reduce(norm_out)
        res_out.copy_(residual)
        self.fused_add_rmsnorm(norm_out, res_out, gamma, RMS_EPS)


class SymmMemBackend(Backend):
    """torch symmetric memory one-shot allreduce (P2P loads, no multicast); drop-in cost: the
    input is copied into the symmetric buffer first, like SGLang's eager custom allreduce does."""

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
    """SGLang's CustomAllreduce through the installed tree, P2's PCIe switch on (0.5.9 + series)."""

    name = "custom_ar"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        if not ctx.is_cuda:
            raise Unavailable("SGLang's custom allreduce needs CUDA devices")
        os.environ.setdefault("SGLANG_ENABLE_PCIE_CUSTOM_AR", "1")
        # measure past the shipped cap so the crossover can be found
        os.environ.setdefault("SGLANG_PCIE_CUSTOM_AR_MAX_BYTES", str(ctx.custom_ar_max_bytes))
        try:
            import sgl_kernel  # noqa: F401
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"sgl_kernel does not import ({type(e).__name__}: {e})")
        try:
            from sglang.srt.distributed.device_communicators import custom_all_reduce as mod
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"sglang CustomAllreduce does not import ({type(e).__name__}: {e})")
        self.ca = mod.CustomAllreduce(group=ctx.cpu_group, device=ctx.device, max_size=ctx.custom_ar_max_bytes)
        if getattr(self.ca, "disabled", False):
            with contextlib.suppress(OSError, TypeError):
                if "SGLANG_ENABLE_PCIE_CUSTOM_AR" not in inspect.getsource(mod):
                    raise Unavailable("this sglang has no P2 PCIe switch (SGLANG_ENABLE_PCIE_CUSTOM_AR): its "
                                      "CustomAllreduce disabled itself (it needs NVLink or P2)")
            raise RuntimeError(
                "CustomAllreduce constructed but disabled itself with SGLANG_ENABLE_PCIE_CUSTOM_AR=1 "
                "(see the worker log for SGLang's reason)")

    def supports(self, rows):
        x = self.probe(rows)
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


class MscclppBackend(InPlaceBackend):
    """SGLang's PyMscclppCommunicator from the installed tree (`--enable-mscclpp`), built as
    GroupCoordinator builds it (on the CPU group, default max bytes) and switched on with
    change_state(enable=True), as SGLang does around CUDA-graph capture.  0.5.9's runs
    sgl_kernel's mscclpp ops (8 or 16 ranks, out of place); 0.5.23's the `mscclpp` package
    (in place)."""

    name = "mscclpp"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        if not ctx.is_cuda:
            raise Unavailable("MSCCL++ needs CUDA devices")
        mod = import_first(["sglang.srt.distributed.device_communicators.pymscclpp"])
        kw = {"group": ctx.cpu_group, "device": ctx.device}
        if "group_name" in inspect.signature(mod.PyMscclppCommunicator.__init__).parameters:
            kw["group_name"] = "tp"
        self.comm = mod.PyMscclppCommunicator(**kw)
        usable = getattr(self.comm, "available", None)
        if usable is None:  # 0.5.9: no `available`; a context exists only when it set up
            usable = getattr(self.comm, "_context", None) is not None
        if not usable:
            raise Unavailable(f"SGLang's PyMscclppCommunicator did not set up on {ctx.world_size} ranks "
                              "(mscclpp missing, or an unsupported world size; see the worker log)")
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.comm.change_state(enable=True))

    def supports(self, rows):
        x = self.probe(rows)
        if not self.comm.should_mscclpp_allreduce(x):
            return f"should_mscclpp_allreduce() declined {x.numel() * 2} bytes"
        return None

    def poison(self, outs):
        for o, b in zip(outs, self.bufs):
            if o.data_ptr() != b.data_ptr():  # 0.5.9 returns a new tensor
                o.fill_(float("nan"))

    def op(self, k):
        return self.comm.all_reduce(self.bufs[k])

    def stress_op(self, x, it):
        return self.comm.all_reduce(x.clone())

    def close(self):
        with contextlib.suppress(Exception):
            self.stack.close()
        with contextlib.suppress(Exception):
            if hasattr(self.comm, "destroy"):
                self.comm.destroy()


class SelftestWrongBackend(NcclBackend):
    """Fast and wrong on purpose (NCCL, then one element off by one): proves the checker fails
    the tier.  Only for tests; never in a profile's backend list.  In the stress mode it is wrong
    once: at --selftest-fault ITER:RANK:ELEM (on the device, so also inside a CUDA graph)."""

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
    """Hangs on purpose: in the stress mode rank RANK stops at iteration ITER of --selftest-fault;
    in the latency run the last rank stops in set-up (a host-side stall, so its peers wait in the
    next collective).  Proves the per-step timeouts.  Only for tests."""

    name = "selftest_hang"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        if not ctx.args.stress and ctx.rank == ctx.world_size - 1:
            while True:
                time.sleep(3600)

    def before_iteration(self, i):
        f = self.ctx.fault
        if self.ctx.rank == f["rank"] and i == f["iteration"]:
            while True:
                time.sleep(3600)


def _registry() -> dict:
    from sglpatch.gpu.kernel.microbench import fi_backends as fi
    from sglpatch.gpu.kernel.microbench import pcie_ipc

    classes = (NcclBackend, NcclAddRmsnormBackend, SymmMemBackend, CustomArBackend, MscclppBackend,
               fi.FlashinferFusedBackend, pcie_ipc.PcieIpcBackend, pcie_ipc.PcieIpcTunedBackend, fi.B12xOneshotBackend, fi.B12xTwoshotBackend,
               fi.B12xFusedBackend, SelftestWrongBackend, SelftestHangBackend)
    return {c.name: c for c in classes}


BACKEND_CLASSES = _registry()
# what the tier runs when the profile names none (the self-test ones never, nor the tuned leg of
# PCIe-IPC: a tune is a deliberate step, `[kernel] pcie_ipc_tune = true`)
ALL_BACKENDS = [n for n in BACKEND_CLASSES if not n.startswith("selftest_") and n != "pcie_ipc_tuned"]


def backend_class(name: str, label: str, errors: dict[str, str]):
    """The Backend class called `name`; None (and errors[label] says why) when there is none."""
    cls = BACKEND_CLASSES.get(name)
    if cls is None:
        errors[label] = f"unknown backend {name!r}; known: {sorted(BACKEND_CLASSES)}"
    return cls
