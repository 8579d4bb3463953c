"""flashinfer's allreduce backends, each only where it imports, written from flashinfer 0.7.2's
and SGLang 0.5.23's sources (none of them could run where this was written; each result is
still checked exactly against the sum of the inputs, i.e. NCCL's result):

- `flashinfer_fused`: `comm.trtllm_allreduce_fusion` (allreduce + residual + RMSNorm, P1's path)
- `pcie_ipc`, `pcie_ipc_tuned`: `comm.PcieIpcAllReduceWorkspace` (flashinfer >= 0.7.0) as P5
  serves it, seed and tuned (microbench/pcie_ipc.py)
- `b12x_oneshot` / `b12x_fused`: `experimental.b12x.comm.pcie.OneshotAllReduce` (`all_reduce`,
  `all_reduce_fused_add_rms_norm`: at most 36 rows), SM120/SM121 only
- `b12x_twoshot`: `experimental.b12x.comm.pcie.PCIeTwoShotBF16.all_reduce` (world size 4 only)

The b12x plans are declared per shape (`pcie.plan(pcie.query_from_runtime(...))`) and prepared
with flashinfer's default configuration (`b12x.preparation.prepare_default`, no autotune) on their
first eager use; the measurement warms every shape up eagerly before any CUDA-graph capture.
"""

from __future__ import annotations

from sglpatch.gpu.kernel.microbench.common import RMS_EPS, Backend, FusedBackend, Unavailable, import_first


class FlashinferFusedBackend(FusedBackend):
    """flashinfer fused allreduce + residual add + RMSNorm (P1's path, trtllm one-shot)."""

    name = "flashinfer_fused"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        comm = import_first(["flashinfer.comm"])
        if not hasattr(comm, "trtllm_allreduce_fusion"):
            raise Unavailable("this flashinfer has no comm.trtllm_allreduce_fusion")
        if not ctx.is_cuda:
            raise Unavailable("flashinfer's trtllm fusion needs CUDA devices")
        self.comm = comm
        self.max_tokens = max(ctx.sizes)
        self.ipc_handles, self.workspace = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            ctx.rank, ctx.world_size, self.max_tokens, ctx.hidden, group=ctx.cpu_group,
            use_fp32_lamport=False)

    def supports(self, rows):
        return None if rows <= self.max_tokens else f"above the workspace's {self.max_tokens} tokens"

    def op(self, k):
        self.fused_op(self.pristine[k], self.residual, self.gamma, self.res_outs[k], self.norm_outs[k])
        return k

    def fused_op(self, x, residual, gamma, res_out, norm_out):
        c = self.ctx
        self.comm.trtllm_allreduce_fusion(
            allreduce_in=x, world_size=c.world_size, world_rank=c.rank,
            token_num=x.shape[0], hidden_dim=c.hidden, workspace_ptrs=self.workspace,
            launch_with_pdl=True, use_oneshot=True, trigger_completion_at_end=False, fp32_acc=False,
            pattern_code=self.comm.AllReduceFusionPattern.kARResidualRMSNorm,
            allreduce_out=None, residual_in=residual, residual_out=res_out,
            norm_out=norm_out, quant_out=None, scale_out=None, rms_gamma=gamma,
            rms_eps=RMS_EPS, scale_factor=None, layout_code=None)


def b12x_pcie(ctx):
    """flashinfer's experimental b12x PCIe collectives (SM120/SM121), or Unavailable."""
    pcie = import_first(["flashinfer.experimental.b12x.comm.pcie", "b12x.comm.pcie"])
    try:
        supported = pcie.is_supported(ctx.device)
    except Exception as e:  # noqa: BLE001 — the lazy API imports cutlass-dsl here
        raise Unavailable(f"b12x comm.pcie does not load ({type(e).__name__}: {e})")
    if not supported:
        raise Unavailable("flashinfer's b12x PCIe kernels run on SM120/SM121 with >= 2 GPUs only")
    return pcie


class _B12xOneshot(Backend):
    surface = "OneshotAllReduce.all_reduce"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        self.pcie = b12x_pcie(ctx)
        self.prep = import_first(["b12x.preparation"])
        self.max_bytes = int(ctx.args.b12x_max_bytes)
        # stream_affine=False: the bench runs one op at a time, eager on the current stream and the
        # graph's warm-up on a side stream, synchronized in between
        self.rt = self.pcie.OneshotAllReduce.from_exchange_group(
            exchange_group=dist.group.WORLD, device=ctx.device, eager_buffer_bytes=self.max_bytes,
            max_size=self.max_bytes, stream_affine=False)
        self.plans: dict[tuple, object] = {}

    def plan(self, x):
        """The shape's plan, prepared on first (eager, never captured) use on every rank: its
        prepare call binds the shape, which installs its graph plan in the native runtime (what
        flashinfer's `_oneshot_preparation._prepare_plain_call` does; b12x's lazy default
        preparation does not, and a plain all_reduce then finds no graph resources), and the
        session primes it with one call."""
        key = tuple(x.shape)
        if key not in self.plans:
            q = self.pcie.query_from_runtime(self.rt, surface=self.surface, call={"inp": x})
            p = self.pcie.plan(q, runtime=self.rt)
            probe = self.torch.zeros_like(x)
            prime = self.primer(probe)

            def prepare_call(state):
                state.bind_input(probe)
                return self.prep.PreparedCall(run=lambda: prime(state))

            self.prep.prepare_default(p.request(name=f"sglpatch.kbench.{self.name}.{'x'.join(map(str, key))}",
                                                prepare_call=prepare_call))
            self.plans[key] = p
        return self.plans[key]

    def primer(self, probe):
        out = self.torch.empty_like(probe)
        return lambda state: state.run_plain(probe, out)

    def supports(self, rows):
        x = self.probe(rows)
        if not self.rt.should_allreduce(x):
            return f"should_allreduce() declined {x.numel() * 2} bytes (max_size {self.max_bytes})"
        return None

    def capture_ctx(self):
        return self.rt.capture()

    def close(self):
        self.rt.close()


class B12xOneshotBackend(_B12xOneshot):
    name = "b12x_oneshot"

    def op(self, k):
        x = self.pristine[k]
        return self.rt.all_reduce(x, plan=self.plan(x))

    def stress_op(self, x, it):
        return self.rt.all_reduce(x, plan=self.plan(x))


class B12xFusedBackend(_B12xOneshot, FusedBackend):
    """One-shot allreduce + residual add + RMSNorm in one kernel (compare with nccl_add_rmsnorm)."""

    name = "b12x_fused"
    surface = "OneshotAllReduce.all_reduce_fused_add_rms_norm"

    def supports(self, rows):
        if rows > 36:
            return "the fused add-RMSNorm kernel takes at most 36 rows"
        return super().supports(rows)

    def primer(self, probe):
        t = self.torch
        res, res_out, out = t.zeros_like(probe), t.empty_like(probe), t.empty_like(probe)
        weight = t.ones(probe.shape[-1], dtype=probe.dtype, device=probe.device)
        return lambda state: state.run_fused(probe, res, weight, out, res_out, RMS_EPS)

    def op(self, k):
        self.fused_op(self.pristine[k], self.residual, self.gamma, self.res_outs[k], self.norm_outs[k])
        return k

    def fused_op(self, x, residual, gamma, res_out, norm_out):
        self.rt.all_reduce_fused_add_rms_norm(x, residual, gamma, RMS_EPS, plan=self.plan(x), out=norm_out,
                                              residual_out=res_out)


class B12xTwoshotBackend(Backend):
    """PCIeTwoShotBF16.all_reduce: bf16 packs, fp32 accumulation in a fixed rank order, one
    rounding.  Its transport rows are hidden / world_size wide so every decode row count fits."""

    name = "b12x_twoshot"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        if ctx.world_size != 4:
            raise Unavailable(f"PCIeTwoShotBF16 supports world size 4 only (flashinfer 0.7.2), not {ctx.world_size}")
        self.pcie = b12x_pcie(ctx)
        ws, h = ctx.world_size, ctx.hidden
        self.row_elems = h // ws if h % (8 * ws) == 0 else h
        per_row = h // self.row_elems
        cap_rows = max(1, int(ctx.args.b12x_max_bytes) // (2 * h))
        self.max_rows = min(max(ctx.all_rows), cap_rows)
        native = self.max_rows * per_row
        native += (-native) % ws
        self.rt = self.pcie.PCIeTwoShotBF16.from_exchange_group(
            exchange_group=dist.group.WORLD, device=ctx.device, max_rows=native, row_elems=self.row_elems)
        self.plans: dict[tuple, object] = {}

    def plan(self, x, out):
        key = tuple(x.shape)
        if key not in self.plans:
            q = self.pcie.query_from_runtime(self.rt, surface="PCIeTwoShotBF16.all_reduce",
                                             call={"inp": x, "out": out})
            self.plans[key] = self.pcie.plan(q, runtime=self.rt)
        return self.plans[key]

    def supports(self, rows):
        x = self.probe(rows)
        return None if self.rt.accepts(x) else f"accepts() declined [{rows},{self.ctx.hidden}] (max rows {self.max_rows})"

    def prepare(self, rows, inner):
        super().prepare(rows, inner)
        self.outs = [self.torch.empty_like(p) for p in self.pristine]

    def capture_ctx(self):
        # any prepared plan of this runtime opens its capture context; the warm-up made them
        return self.rt.capture(plan=next(iter(self.plans.values())))

    def op(self, k):
        x, o = self.pristine[k], self.outs[k]
        return self.rt.all_reduce(x, o, plan=self.plan(x, o))

    def stress_op(self, x, it):
        out = self.torch.empty_like(x)  # caller-owned, as a capture requires
        return self.rt.all_reduce(x, out, plan=self.plan(x, out))

    def close(self):
        self.rt.close()
