"""flashinfer's PCIe-IPC allreduce (`comm.PcieIpcAllReduceWorkspace`, flashinfer >= 0.7.0) as P5
serves it (patches/0005, `SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1`), written from P5's adapter and
flashinfer 0.7.2's sources:

- `pcie_ipc`: the workspace over the CPU group, width = the widest served rows x hidden and
  tune_batches = exactly the served rows, by the patched tree's own `pcie_ipc_width` when it
  imports (else the same rule inline), seed launch configurations (no tune, no cache read), every
  admitted row count prepared before any capture, stream re-bound on a stream change; on an sglang
  with its own `PcieIpcCommunicator` (>= 0.5.21: `pcie_ipc_ar.py`, no P5) that communicator, as
  that install serves it;
- `pcie_ipc_tuned`: the same workspace after `ws.tune([hidden])` into the run's folder (only when
  the profile asks: `[kernel] pcie_ipc_tune = true`; the tier runs it after the seed leg).
"""

from __future__ import annotations

import os
import time
import warnings

from sglpatch.gpu.kernel.microbench.common import Backend, Unavailable, import_first


def _dist_version(name: str) -> str:
    try:
        import importlib.metadata as md

        return md.version(name)
    except Exception:  # noqa: BLE001
        return "?"


# P5's width rule (patches/0005, pcie_ipc_allreduce.py), used when the patched tree's own module
# does not import here: the same function, so the workspace is the one P5 builds either way.
PCIE_IPC_PACK_ELEMS = 8  # the kernels address 16-byte packs: max_numel is a multiple of 8 bf16


def pcie_ipc_max_numel(rows: int, hidden: int) -> int:
    numel = max(0, rows) * max(0, hidden)
    return -(-numel // PCIE_IPC_PACK_ELEMS) * PCIE_IPC_PACK_ELEMS


def pcie_ipc_width(rows, hidden: int, override: int | None):
    """(max_numel, buckets, why) for the served row counts, as P5's pcie_ipc_width: width = the
    widest served rows x hidden, buckets = exactly the served rows (plus the workspace's own rows
    when an override makes it wider); ValueError when nothing can be served."""
    rows = sorted({int(r) for r in rows if int(r) > 0})
    if hidden <= 0 or not rows:
        raise ValueError(f"the decode/verify width is unknown (hidden {hidden}, rows {rows})")
    why = f"widest captured reduction {rows[-1]} rows"
    max_numel = pcie_ipc_max_numel(rows[-1], hidden)
    if override is not None:
        if override < hidden:
            raise ValueError(f"SGLANG_PCIE_IPC_MAX_NUMEL={override} is below one row of {hidden}; unset it or set "
                             f"it to at least {hidden}")
        max_numel = pcie_ipc_max_numel(1, override)
        why = f"SGLANG_PCIE_IPC_MAX_NUMEL={override}"
        if max_numel != override:
            why += f" rounded up to a 16-byte pack, {max_numel}"
    max_rows = max_numel // hidden
    buckets = [r for r in rows if r <= max_rows]
    if not buckets or max_rows > rows[-1]:
        buckets.append(max_rows)
    return max_numel, tuple(buckets), why


def p5_width_rule():
    """(pcie_ipc_width, how, from_p5): the patched tree's own function when P5's module imports
    here, else the same rule inline (how says so, and why the module did not import)."""
    try:
        from sglang.srt.distributed.device_communicators import pcie_ipc_allreduce as p5
    except Exception as e:  # noqa: BLE001 — no P5 here (another sglang, or none)
        first = (str(e).splitlines() or [""])[0]
        return pcie_ipc_width, (f"P5's width rule inline (sglang's pcie_ipc_allreduce does not import here: "
                                f"{type(e).__name__}: {first})"), False
    return p5.pcie_ipc_width, f"P5's own pcie_ipc_width ({p5.__file__})", True


def upstream_communicator():
    """sglang >= 0.5.21's PcieIpcCommunicator (pcie_ipc_ar.py), or None."""
    try:
        from sglang.srt.distributed.device_communicators.pcie_ipc_ar import PcieIpcCommunicator
    except Exception:  # noqa: BLE001
        return None
    return PcieIpcCommunicator


# flashinfer's autotuner keeps its winners in memory for the life of the process: once a tuned leg
# ran here, a later "seed" workspace would look them up.  The tier runs the seed leg first.
_TUNED_IN_THIS_PROCESS: list[str] = []


class PcieIpcBackend(Backend):
    """flashinfer's PCIe-IPC allreduce as P5 serves it (SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1, default
    SGLANG_PCIE_IPC_TUNE=seed): the workspace over the CPU group, width = the widest served rows x
    hidden, tune_batches = exactly the served rows (--pcie-ipc-rows; else one row count,
    --pcie-ipc-max-rows), seed launch configurations (no tune, no cache read), every admitted
    row count prepared before any capture.  On an sglang with its own PcieIpcCommunicator
    (>= 0.5.21, no P5) that communicator, as that install serves it (its own buckets and tuning)."""

    name = "pcie_ipc"
    tuned = False

    def __init__(self, torch, dist, ctx):
        super().__init__(torch, dist, ctx)
        comm = import_first(["flashinfer.comm"])
        cls = getattr(comm, "PcieIpcAllReduceWorkspace", None)
        if cls is None:
            raise Unavailable(f"flashinfer {_dist_version('flashinfer-python')} has no "
                              "comm.PcieIpcAllReduceWorkspace (needs flashinfer >= 0.7.0)")
        if ctx.world_size not in (2, 4, 8):
            raise Unavailable(f"PCIe-IPC builds its channels for 2, 4 or 8 ranks, not {ctx.world_size}")
        if _TUNED_IN_THIS_PROCESS and not self.tuned:
            raise Unavailable("a tuned leg ran earlier in this process and flashinfer's autotuner keeps its "
                              "winners in memory: this would not be the seed leg (run pcie_ipc first)")
        # run-private: never read or write the server's cache in ~/.cache/flashinfer
        self.folder = os.path.join(ctx.scratch_dir, "flashinfer-autotune")
        os.environ["FLASHINFER_AUTOTUNE_DIR"] = self.folder
        rows = list(ctx.args.pcie_ipc_rows or [ctx.args.pcie_ipc_max_rows])
        self.bound, self.comm = None, None
        width, how, from_p5 = p5_width_rule()
        upstream = None if from_p5 else upstream_communicator()
        if upstream is not None:
            self._upstream(upstream, dist, ctx, sorted(set(rows)))
        else:
            self.max_numel, buckets, why = width(rows, ctx.hidden, None)
            self.ws = cls(group=ctx.cpu_group, max_numel=self.max_numel, dtype=torch.bfloat16,
                          tune_batches=buckets, tune_cache=os.devnull)  # a seed start reads no cache
            self.info = {"rows": sorted(set(rows)), "buckets": list(buckets), "max_numel": self.max_numel,
                         "from_p5": from_p5, "tuned": False, "tune_cache": os.devnull}
            configs = self._tune() if self.tuned else "seed launch configurations (SGLANG_PCIE_IPC_TUNE=seed)"
            self.how = (f"as P5 serves it: {how}; {why}; buckets {list(buckets)}; workspace over the CPU group; "
                        f"{configs}")
            self.info["how"] = self.how
        self.max_rows = self.max_numel // ctx.hidden
        self.extra_rows = [n for n in sorted(set(rows)) if n <= self.max_rows]  # every served shape is measured
        with warnings.catch_warnings():  # flashinfer warns once that a workspace runs seed configurations
            warnings.filterwarnings("ignore", "PCIe IPC all-reduce is running seed")
            # every admitted row count, as P5 does before capture: one first seen in a capture cannot be
            self.ws.prepare([(n, ctx.hidden) for n in range(1, self.max_rows + 1)], dtype=torch.bfloat16)

    def _upstream(self, communicator, dist, ctx, rows):
        if self.tuned:
            raise Unavailable("this sglang serves PCIe-IPC through its own PcieIpcCommunicator (pcie_ipc_ar.py), "
                              "which tunes at start itself: its pcie_ipc rows are that; seed vs tuned is P5's")
        self.how = "sglang's own PcieIpcCommunicator (pcie_ipc_ar.py), as that install serves it: its buckets and tuning"
        self.comm = communicator(group=dist.group.WORLD, device=ctx.device, cpu_group=ctx.cpu_group)
        if self.comm.disabled:
            raise Unavailable("SGLang's PcieIpcCommunicator disabled itself (see the worker log)")
        self.comm.prepare(hidden=ctx.hidden, max_rows=rows[-1])  # build + tune, as at that server's start
        if self.comm.disabled or self.comm._workspace is None:
            raise RuntimeError("SGLang's PcieIpcCommunicator could not build its workspace (see the worker log)")
        self.ws = self.comm._workspace
        self.max_numel = int(self.comm.max_numel)  # SGLANG_PCIE_IPC_MAX_NUMEL may override it
        self.info = {"how": self.how, "rows": rows, "buckets": None, "max_numel": self.max_numel,
                     "tuned": "by sglang's communicator"}

    def _tune(self) -> str:
        """ws.tune over the CPU group into the run's own folder, timed; what it configured."""
        c = self.ctx
        cache = os.path.join(self.folder, f"pcie_ipc_tuned_ws{c.world_size}.json")
        _TUNED_IN_THIS_PROCESS.append(self.name)  # before: a tune that fails half-way may leave winners
        t0 = time.monotonic()
        got = self.ws.tune([c.hidden], dtype=self.torch.bfloat16, tune_group=c.cpu_group, cache=cache)
        self.info.update(tuned=True, tune_cache=cache, tuned_shapes=len(got or {}),
                         tune_s=round(time.monotonic() - t0, 2))
        return (f"tuned launch configurations: ws.tune([{c.hidden}]) over the CPU group into {cache} "
                f"({len(got or {})} shapes; SGLANG_PCIE_IPC_TUNE=cache after the tuning step)")

    def _should(self, x) -> bool:
        if self.comm is not None:
            return bool(self.comm.should_pcie_ipc_ar(x))
        return x.numel() <= self.max_numel and bool(self.ws.supports(x))

    def _call(self, x):
        if self.comm is not None:
            return self.comm.pcie_ipc_all_reduce(x)
        if self.ctx.is_cuda:  # one workspace serves one stream: move it with the caller (as P5 does)
            stream = self.torch.cuda.current_stream()
            if self.bound is None or stream != self.bound:
                self.ws.rebind_stream()
                self.bound = stream
        return self.ws.all_reduce(x)

    def supports(self, rows):
        if rows * self.ctx.hidden > self.max_numel:
            return (f"above the workspace ({self.max_rows} rows: the widest served reduction, P5's width; "
                    "--cuda-graph-max-bs x draft tokens): served by NCCL there")
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


class PcieIpcTunedBackend(PcieIpcBackend):
    """The same workspace (same width, same buckets), then ws.tune([hidden], tune_group=cpu_group,
    cache=<the run's folder>) before it is measured: what SGLANG_PCIE_IPC_TUNE=cache serves after
    P5's tuning step.  Only when the profile asks (`[kernel] pcie_ipc_tune = true`), in its own
    launch after the seed leg."""

    name = "pcie_ipc_tuned"
    tuned = True
