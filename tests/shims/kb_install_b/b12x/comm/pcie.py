"""Stand-in for b12x.comm.pcie (flashinfer 0.7.2): OneshotAllReduce (plain and fused add-RMSNorm),
plan / query_from_runtime, is_supported; PCIeTwoShotBF16 supports world size 4 only, as the
real one.  The contract is the real one's: a plain all_reduce needs its shape bound during
preparation ("oneshot graph resources were not bound during preparation" otherwise), the fused
op takes at most 36 rows; the reductions go through torch.distributed (the real kernels need
CUDA GPUs)."""

from contextlib import contextmanager

import torch
import torch.distributed as dist

from b12x.preparation import Plan, require_prepared

SURFACES = ("OneshotAllReduce.all_reduce", "OneshotAllReduce.all_reduce_fused_add_rms_norm")


def is_supported(device=None) -> bool:
    return True


class _Query:
    def __init__(self, surface, shape):
        self.surface, self.shape = surface, shape


class _State:
    def __init__(self, runtime, query):
        self.runtime, self.query, self.bound = runtime, query, False

    def bind_input(self, inp):
        if tuple(inp.shape) != self.query.shape:
            raise ValueError("oneshot input metadata differs from the declaration")
        self.bound = True

    def run_plain(self, inp, out):
        if not self.bound:
            raise RuntimeError("oneshot graph resources were not bound during preparation")
        out.copy_(inp)
        dist.all_reduce(out, group=self.runtime.exchange_group)

    def run_fused(self, inp, residual, weight, out, residual_out, epsilon):
        s = inp.clone()
        dist.all_reduce(s, group=self.runtime.exchange_group)
        residual_out.copy_(s + residual)
        y = residual_out.float()
        out.copy_((y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + epsilon) * weight.float()).to(out.dtype))


def query_from_runtime(runtime, *, surface, call):
    inp = call["inp"]
    if surface not in SURFACES:
        raise ValueError(f"unknown native PCIe execution surface {surface!r}")
    if not runtime.should_allreduce(inp):
        raise ValueError("input does not satisfy PCIe oneshot requirements")
    if surface.endswith("fused_add_rms_norm") and inp.numel() // inp.shape[-1] > 36:
        raise ValueError("fused allreduce RMSNorm supports at most 36 rows")
    return _Query(surface, tuple(inp.shape))


def plan(query, *, runtime=None, **_):
    if runtime is None:
        raise TypeError("oneshot declarations require the existing native runtime owner")
    return Plan(query, runtime, lambda: _State(runtime, query))


class OneshotAllReduce:
    def __init__(self, group, device, max_size):
        self.exchange_group, self.device, self.max_size = group, device, max_size
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    @classmethod
    def from_exchange_group(cls, *, exchange_group, device, eager_buffer_bytes=8 << 20, max_size=8 << 20,
                            stream_affine=True, **_):
        dist.barrier(group=exchange_group)
        return cls(exchange_group, device, max_size)

    def should_allreduce(self, inp):
        n = inp.numel() * inp.element_size()
        return inp.dtype in (torch.float16, torch.bfloat16, torch.float32) and n <= self.max_size and n % 16 == 0

    def all_reduce(self, inp, *, plan, out=None, peer_input_ptrs=None):
        out = torch.empty_like(inp) if out is None else out
        require_prepared(plan).run_plain(inp, out)
        return out

    def all_reduce_fused_add_rms_norm(self, inp, residual, weight, epsilon, *, plan, out=None, residual_out=None,
                                      peer_input_ptrs=None):
        out = torch.empty_like(inp) if out is None else out
        residual_out = torch.empty_like(inp) if residual_out is None else residual_out
        require_prepared(plan).run_fused(inp, residual, weight, out, residual_out, float(epsilon))
        return out, residual_out

    @contextmanager
    def capture(self, stream=None):
        yield

    def close(self):
        dist.barrier(group=self.exchange_group)


class PCIeTwoShotBF16:
    @classmethod
    def from_exchange_group(cls, *, exchange_group, **_):
        raise ValueError(f"PCIeTwoShotBF16 supports only world size 4, got {dist.get_world_size(exchange_group)}")
