"""flashinfer's allreduce backends, each only where it imports, written from flashinfer 0.7.2's
and SGLang 0.5.23's sources (none of them could run where this was written; each result is
still checked exactly against the sum of the inputs, i.e. NCCL's result):

- `flashinfer_fused`: `comm.trtllm_allreduce_fusion` (allreduce + residual + RMSNorm, P1's path)
- `pcie_ipc`: `comm.PcieIpcAllReduceWorkspace` (flashinfer >= 0.7.0), through SGLang's own
  `PcieIpcCommunicator` (sglang >= 0.5.21: `pcie_ipc_ar.py`) when that imports, else built the
  way that file builds it: max_numel = widest decode rows x hidden, tune_batches of those rows,
  tuned once over the CPU group, stream re-bound on a stream change
- `b12x_oneshot` / `b12x_fused`: `experimental.b12x.comm.pcie.OneshotAllReduce` (`all_reduce`,
  `all_reduce_fused_add_rms_norm`: at most 36 rows), SM120/SM121 only
- `b12x_twoshot`: `experimental.b12x.comm.pcie.PCIeTwoShotBF16.all_reduce` (world size 4 only)

The b12x plans are declared per shape (`pcie.plan(pcie.query_from_runtime(...))`) and prepared
with flashinfer's default configuration (`b12x.preparation.prepare_default`, no autotune) on their
first eager use; the measurement warms every shape up eagerly before any CUDA-graph capture.
"""

from __future__ import annotations

import os

from sglpatch.gpu.kernel.kbench.common import RMS_EPS, Backend, FusedBackend, Unavailable, import_first


def _dist_version(name: str) -> str:
    try:
        import importlib.metadata as md

        return md.version(name)
    except Exception:  # noqa: BLE001
        return "?"


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

    def op(self, k):
        c = self.ctx
        self.comm.trtllm_allreduce_fusion(
            allreduce_in=self.pristine[k], world_size=c.world_size, world_rank=c.rank,
            token_num=self.rows, hidden_dim=c.hidden, workspace_ptrs=self.workspace,
            launch_with_pdl=True, use_oneshot=True, trigger_completion_at_end=False, fp32_acc=False,
            pattern_code=self.comm.AllReduceFusionPattern.kARResidualRMSNorm,
            allreduce_out=None, residual_in=self.residual, residual_out=self.res_outs[k],
            norm_out=self.norm_outs[k], quant_out=None, scale_out=None, rms_gamma=self.gamma,
            rms_eps=RMS_EPS, scale_factor=None, layout_code=None)
        return k


def pcie_ipc_tune_batches(max_rows: int) -> tuple[int, ...]:
    """SGLang 0.5.23's `_tune_batches`: powers of two up to max_rows, and max_rows itself."""
    rows = [r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if r <= max_rows]
    if max_rows >= 1 and max_rows not in rows:
        rows.append(max_rows)
    return tuple(rows)


class PcieIpcBackend(Backend):
    """flashinfer's PCIe-IPC allreduce as SGLang >= 0.5.21 serves it (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1)."""

    name = "pcie_ipc"

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        comm = import_first(["flashinfer.comm"])
        cls = getattr(comm, "PcieIpcAllReduceWorkspace", None)
        if cls is None:
            raise Unavailable(f"flashinfer {_dist_version('flashinfer-python')} has no "
                              "comm.PcieIpcAllReduceWorkspace (needs flashinfer >= 0.7.0)")
        if ctx.world_size not in (2, 4, 8):
            raise Unavailable(f"PCIe-IPC builds its channels for 2, 4 or 8 ranks, not {ctx.world_size}")
        # tune into the run's own folder, never over the server's cache in ~/.cache/flashinfer
        os.environ["FLASHINFER_AUTOTUNE_DIR"] = os.path.join(ctx.scratch_dir, "flashinfer-autotune")
        self.max_rows = int(ctx.args.pcie_ipc_max_rows)
        self.max_numel = self.max_rows * ctx.hidden
        self.bound = None
        self.comm = None
        try:
            from sglang.srt.distributed.device_communicators.pcie_ipc_ar import PcieIpcCommunicator
        except Exception:  # noqa: BLE001 — an sglang without pcie_ipc_ar: build it as that file does
            PcieIpcCommunicator = None
        if PcieIpcCommunicator is not None:
            self.how = "SGLang's PcieIpcCommunicator"
            self.comm = PcieIpcCommunicator(group=dist.group.WORLD, device=ctx.device, cpu_group=ctx.cpu_group)
            if self.comm.disabled:
                raise Unavailable("SGLang's PcieIpcCommunicator disabled itself (see the worker log)")
            self.comm.prepare(hidden=ctx.hidden, max_rows=self.max_rows)  # build + tune, as at server start
            if self.comm.disabled or self.comm._workspace is None:
                raise RuntimeError("SGLang's PcieIpcCommunicator could not build its workspace (see the worker log)")
            self.ws = self.comm._workspace
            self.max_numel = int(self.comm.max_numel)  # SGLANG_PCIE_IPC_MAX_NUMEL may override it
            self.max_rows = self.max_numel // ctx.hidden
        else:
            self.how = ("flashinfer's workspace, built as sglang 0.5.23's pcie_ipc_ar.py builds it (the one P5 serves on "
                        "0.5.9 with SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1)")
            tuning = import_first(["flashinfer.comm.pcie_ipc_tuning"])
            self.ws = cls(group=dist.group.WORLD, max_numel=self.max_numel, dtype=torch.bfloat16,
                          tune_batches=pcie_ipc_tune_batches(self.max_rows),
                          tune_cache=str(tuning.default_cache_path(ctx.world_size)))
            if ctx.args.pcie_ipc_tune:
                self.ws.tune([ctx.hidden], dtype=torch.bfloat16, tune_group=ctx.cpu_group)
        # resolve every shape now: a shape first seen inside a capture cannot be captured
        self.ws.prepare([(n, ctx.hidden) for n in ctx.all_rows if n <= self.max_rows], dtype=torch.bfloat16)

    def _should(self, x) -> bool:
        if self.comm is not None:
            return bool(self.comm.should_pcie_ipc_ar(x))
        return x.numel() <= self.max_numel and bool(self.ws.supports(x))

    def _call(self, x):
        if self.comm is not None:
            return self.comm.pcie_ipc_all_reduce(x)
        if self.ctx.is_cuda:  # one workspace serves one stream: move it with the caller (as SGLang does)
            stream = self.torch.cuda.current_stream()
            if self.bound is None or stream != self.bound:
                self.ws.rebind_stream()
                self.bound = stream
        return self.ws.all_reduce(x)

    def supports(self, rows):
        if rows * self.ctx.hidden > self.max_numel:
            return (f"above the workspace SGLang sizes ({self.max_rows} rows = --cuda-graph-max-bs x draft "
                    "tokens): served by NCCL there")
        x = self.probe(rows)
        return None if self._should(x) else "the workspace's supports() declined this shape"

    def op(self, k):
        return self._call(self.pristine[k])

    def stress_op(self, x, it):
        return self._call(x)

    def close(self):
        if self.comm is not None:
            self.comm.destroy()
        else:
            self.ws.destroy()


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
        x = self.pristine[k]
        self.rt.all_reduce_fused_add_rms_norm(x, self.residual, self.gamma, RMS_EPS, plan=self.plan(x),
                                              out=self.norm_outs[k], residual_out=self.res_outs[k])
        return k


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
