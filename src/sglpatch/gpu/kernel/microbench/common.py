"""The Backend contract of the allreduce worker, its exact inputs and references, and the check
of a fused allreduce + residual add + RMSNorm."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback

# A bf16 RMSNorm output is rounded once by the kernel and once by the reference: two bf16 ulps
# (2 * 2**-8 relative) plus the same absolute slack for values near zero.  The residual output
# (allreduce + residual) is a sum of small integers and must be exact.
BF16_NORM_RTOL = 2.0 ** -6
BF16_NORM_ATOL = 2.0 ** -6
RMS_EPS = 1e-6


class Unavailable(Exception):
    """Backend not present here; str() is the reason."""


class Ctx:
    """Run context: torch, dist, args, rank, world_size, device, cpu_group, hidden, sizes, is_cuda."""


def gather(ctx, obj):
    out = [None] * ctx.world_size
    ctx.dist.all_gather_object(out, obj, group=ctx.cpu_group)
    return out


def on_every_rank(ctx, work, failed: dict | None = None, sync: bool = True):
    """Run work() (a dict) on this rank and gather every rank's: (results, the first rank's exception
    or None). A raise is one line in its result's `exc` ({**failed, exc}), its traceback printed; after
    it, on CUDA, the device is synchronized (sync) so that the next collective starts clean."""
    try:
        local = {**work(), "exc": None}
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        local = {**(failed or {}), "exc": f"{type(e).__name__}: {e}"}
        if sync and ctx.is_cuda:
            ctx.torch.cuda.synchronize()
    allr = gather(ctx, local)
    return allr, next((a["exc"] for a in allr if a["exc"]), None)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile (q in 0..100)."""
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def make_input(torch, rank: int, k: int, rows: int, hidden: int, device):
    """Small integers in [-3, 3]; depend on rank and on the op index k."""
    idx = torch.arange(rows * hidden, device=device, dtype=torch.int64)
    v = (idx * 3 + rank * 5 + k * 11) % 7 - 3
    return v.to(torch.bfloat16).view(rows, hidden)


def make_reference(torch, world_size: int, k: int, rows: int, hidden: int, device):
    """The exact sum over the ranks of make_input (what NCCL returns for these inputs: every
    partial sum is a small integer, exact in bf16 in any order)."""
    acc = None
    for r in range(world_size):
        x = make_input(torch, r, k, rows, hidden, device).float()
        acc = x if acc is None else acc + x
    return acc.to(torch.bfloat16)


def norm_inputs(torch, rows: int, hidden: int, device):
    """(gamma, residual) for the fused paths: integers, the same on every rank."""
    gamma = (torch.arange(hidden, device=device) % 3 + 1).to(torch.bfloat16)
    residual = ((torch.arange(rows * hidden, device=device) % 5) - 2).to(torch.bfloat16).view(rows, hidden)
    return gamma, residual


def add_rmsnorm_reference(torch, summed, residual, gamma, eps: float = RMS_EPS):
    """(residual_out, norm_out) as fp32 from the exact sum: residual_out = sum + residual
    (exact), norm_out = RMSNorm(residual_out) * gamma in fp32."""
    y = (summed.float() + residual.float()).to(torch.bfloat16).float()
    n = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()
    return y, n


def check_fused(torch, k: int, res_out, norm_out, res_ref, norm_ref) -> tuple[bool, float, str]:
    """Residual output exact; normed output within BF16_NORM_RTOL / ATOL elementwise."""
    r, n = res_out.float(), norm_out.float()
    if not bool(torch.isfinite(r).all()) or not bool(torch.isfinite(n).all()):
        return False, float("inf"), f"op {k}: non-finite values"
    e_res = float((r - res_ref).abs().max())
    err = (n - norm_ref).abs()
    bound = BF16_NORM_ATOL + BF16_NORM_RTOL * norm_ref.abs()
    e_norm = float(err.max())
    over = int((err > bound).sum())
    if e_res != 0.0 or over:
        return False, max(e_res, e_norm), (f"op {k}: residual max err {e_res} (must be exact), norm max err "
                                            f"{e_norm:.3g}, {over} elements over {BF16_NORM_RTOL:g}*|ref|+"
                                            f"{BF16_NORM_ATOL:g}")
    return True, max(e_res, e_norm), ""


class Backend:
    """One allreduce implementation.  `prepare(rows, inner)` allocates; `op(k)` runs op k and
    returns its output; `refill()` restores inputs before a sample; `capture_ctx()` wraps
    CUDA-graph capture; `check(outs)` compares with the exact reference (for every op k).

    `fused = True`: op k is allreduce + residual add + RMSNorm (its time is compared with
    `nccl_add_rmsnorm`, NCCL then SGLang's separate fused add-RMSNorm), and `fused_op(x, residual,
    gamma, res_out, norm_out)` is that op on given tensors (capturable: the replay check).
    `stress_op(x, it)`: the allreduce of `x` for --stress and the replay check (capturable), when
    the backend has one."""

    name = "?"
    in_place = False
    fused = False

    def __init__(self, torch, dist, ctx):
        self.torch, self.dist, self.ctx = torch, dist, ctx

    def supports(self, rows: int) -> str | None:  # None = yes, else reason
        return None

    def probe(self, rows: int):
        """An empty [rows, hidden] bf16 tensor on the device: what `supports` asks a library about."""
        return self.torch.empty((rows, self.ctx.hidden), dtype=self.torch.bfloat16, device=self.ctx.device)

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
        raise Unavailable(f"{self.name} has no stress mode")

    def before_iteration(self, i: int) -> None:
        """Host hook run before stress iteration i (eager and graph alike)."""

    def check(self, outs) -> tuple[bool, float, str]:
        worst = 0.0
        for k, (o, ref) in enumerate(zip(outs, self.refs)):
            if o is None:
                return False, float("inf"), f"op {k} returned no output"
            if not bool(self.torch.isfinite(o.float()).all()):
                return False, float("inf"), f"op {k}: non-finite values"
            worst = max(worst, float((o.float() - ref.float()).abs().max()))
        return worst == 0.0, worst, "" if worst == 0.0 else f"max abs error {worst}"

    def close(self) -> None:
        pass


class InPlaceBackend(Backend):
    """op(k) reduces bufs[k] in place: `prepare` copies the inputs, `refill` restores them."""

    in_place = True

    def prepare(self, rows, inner):
        super().prepare(rows, inner)
        self.bufs = [p.clone() for p in self.pristine]

    def refill(self):
        for b, p in zip(self.bufs, self.pristine):
            b.copy_(p)


class FusedBackend(Backend):
    """Allreduce + residual add + RMSNorm in one op: op(k) writes res_outs[k] and norm_outs[k]."""

    fused = True

    def prepare(self, rows, inner):
        super().prepare(rows, inner)
        t, c = self.torch, self.ctx
        self.gamma, self.residual = norm_inputs(t, rows, c.hidden, c.device)
        refs = [add_rmsnorm_reference(t, r, self.residual, self.gamma) for r in self.refs]
        self.res_refs = [a for a, _ in refs]
        self.norm_refs = [b for _, b in refs]
        self.res_outs = [t.empty_like(self.residual) for _ in range(inner)]
        self.norm_outs = [t.empty_like(self.residual) for _ in range(inner)]

    def refill(self):
        for o in self.res_outs + self.norm_outs:
            o.fill_(float("nan"))

    def check(self, outs):
        worst = 0.0
        for k in range(len(self.refs)):
            ok, err, detail = check_fused(self.torch, k, self.res_outs[k], self.norm_outs[k],
                                          self.res_refs[k], self.norm_refs[k])
            worst = max(worst, err)
            if not ok:
                return False, worst, detail
        return True, worst, ""


def import_first(names: list[str]):
    """The first of the dotted module names that imports; Unavailable naming each failure."""
    import importlib

    why = []
    for n in names:
        try:
            return importlib.import_module(n)
        except Exception as e:  # noqa: BLE001 — an optional library, any import failure is a reason
            why.append(f"{n}: {type(e).__name__}: {e}")
    raise Unavailable("; ".join(why))


def set_up_backend(ctx, cls, label: str, log, every_rank_traceback: bool = False):
    """Construct on every rank and agree on the outcome, so nobody enters a collective alone:
    (backend, None) or (None, (kind, reason)) with kind absent | error.  An error's traceback is
    printed by rank 0 (the latency run) or by each rank it happened on (the stress run)."""
    state, msg, backend = "ok", "", None
    try:
        backend = cls(ctx.torch, ctx.dist, ctx)
    except Unavailable as e:
        state, msg = "absent", str(e)
    except Exception as e:  # noqa: BLE001
        state, msg = "error", f"{type(e).__name__}: {e}"
        if every_rank_traceback or ctx.rank == 0:
            traceback.print_exc()
    bad = [s for s in gather(ctx, (state, msg)) if s[0] != "ok"]
    if not bad:
        return backend, None
    kind = "error" if any(s[0] == "error" for s in bad) else "absent"
    reason = next(s[1] for s in bad if s[0] == kind)
    log(f"{label}: {kind}: {reason}")
    if backend is not None:
        backend.close()
    return None, (kind, reason)


EXIT_HANG = 3


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
