"""Stand-in for flashinfer 0.7.2's PcieIpcAllReduceWorkspace (tests only).

The same constructor, `supports`, `tune`, `prepare`, `rebind_stream`, `all_reduce` and `destroy`
as the real class, collective where the real one is; the reduction itself (CUDA IPC kernels in
the real one) goes through torch.distributed on the workspace's group."""

import json
import os

import torch
import torch.distributed as dist

_SUPPORTED_WORLD_SIZES = (2, 4, 8)


class PcieIpcAllReduceWorkspace:
    def __init__(self, group, max_numel, dtype=torch.bfloat16, max_blocks=36, profile=None, tune_batches=None,
                 tune_cache=None):
        from .pcie_ipc_tuning import default_cache_path

        self.group = group
        self.rank = dist.get_rank(group=group)
        self.world_size = dist.get_world_size(group=group)
        if self.world_size not in _SUPPORTED_WORLD_SIZES:
            raise ValueError(f"world size {self.world_size} unsupported")
        if max_numel <= 0 or max_numel % 8:
            raise ValueError(f"max_numel must be a positive multiple of 8, got {max_numel}")
        self.max_numel = max_numel
        self._tune_batches = tuple(tune_batches) if tune_batches is not None else None
        self._tune_cache = tune_cache or default_cache_path(self.world_size)
        self._wrong = os.environ.get("SGLPATCH_STANDIN_PCIE_IPC") == "wrong"
        dist.barrier(group=group)

    def supports(self, inp):
        return (inp.dtype in (torch.bfloat16, torch.float16) and inp.is_contiguous()
                and inp.numel() <= self.max_numel and (inp.numel() * inp.element_size()) % 16 == 0)

    def tune(self, hiddens, *, dtype=torch.bfloat16, cache=None, tune_group=None, warmup=None, repeat=None):
        path = cache or self._tune_cache
        batches = self._tune_batches or (1,)
        if self.rank == 0:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                json.dump({"standin": True, "hiddens": list(hiddens), "batches": list(batches)}, f)
        dist.barrier(group=self.group)
        return {(h, b): "standin" for h in hiddens for b in batches}

    def prepare(self, shapes, *, dtype=torch.bfloat16):
        dist.barrier(group=self.group)
        return {tuple(s): "standin" for s in shapes}

    def rebind_stream(self):
        pass

    def all_reduce(self, inp, *, out=None, config=None, enable_pdl=False):
        if not self.supports(inp):
            raise ValueError(f"unsupported shape {tuple(inp.shape)}; check supports() first")
        out = torch.empty_like(inp) if out is None else out
        out.copy_(inp)
        dist.all_reduce(out, group=self.group)
        if self._wrong and self.rank == self.world_size - 1:
            out.view(-1)[0] += 1
        return out

    def destroy(self):
        dist.barrier(group=self.group)
