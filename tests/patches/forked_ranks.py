"""The one rank runner of the patch tests that need a real multi-process group (P2's
CustomAllreduce constructor, P5's PCIe-IPC decision): `run_ranks(ws, child, deadline, *args)`
forks ws ranks that meet on a free local port, each running `child(rank, port, outdir, *args)`.
A rank writes `{rank}.json` when it has a result and `{rank}.done` once it is past the barrier
after it; one that raises leaves `{rank}.err`; one still running at the deadline is blocked
(SIGKILL). It answers {"blocked": N, "ranks": {"0": result or {"error": ...}, with "in_step"}}.

The tests' scripts run in the patched tree's venv, which has no tests/ on its path, so this is
source text that each script puts before its own code."""

RANK_RUNNER = r'''
import json as _json, os as _os, signal as _signal, socket as _socket, tempfile as _tempfile, time as _time


def run_ranks(ws, child, deadline, *args):
    outdir = _tempfile.mkdtemp()
    s = _socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    pids = []
    for rank in range(ws):
        pid = _os.fork()
        if pid == 0:
            code = 0
            try:
                child(rank, port, outdir, *args)
            except BaseException as e:
                code = 1
                with open(_os.path.join(outdir, f"{rank}.err"), "w") as f:
                    f.write(repr(e))
            _os._exit(code)
        pids.append(pid)
    end = _time.time() + deadline
    alive = set(pids)
    while alive and _time.time() < end:
        for pid in list(alive):
            if _os.waitpid(pid, _os.WNOHANG)[0]:
                alive.discard(pid)
        _time.sleep(0.05)
    for pid in alive:  # still blocked at the deadline
        _os.kill(pid, _signal.SIGKILL)
        _os.waitpid(pid, 0)
    ranks = {}
    for rank in range(ws):
        p, e = (_os.path.join(outdir, f"{rank}.{ext}") for ext in ("json", "err"))
        r = _json.load(open(p)) if _os.path.exists(p) else {"error": open(e).read() if _os.path.exists(e) else "blocked"}
        r["in_step"] = _os.path.exists(_os.path.join(outdir, f"{rank}.done"))
        ranks[str(rank)] = r
    return {"blocked": len(alive), "ranks": ranks}
'''


# CUDA tensors on the CPU, for the scripts that drive GroupCoordinator (P5's and P7's tests): a CudaLike
# says it lives on a CUDA device (DEVICES[rank], or the device it was made for) and computes on its CPU
# elem; SGLang's own custom ops (namespace "sglang") are logged in OPS and redispatched to their CUDA
# kernel registration; on_cpu(torch.empty) makes one where the code asks for a CUDA tensor. Source text
# as RANK_RUNNER is: the script defines torch, dist, tree_map, DEVICES and OPS before it.
CUDA_LIKE = r'''
class CudaLike(torch.Tensor):
    @staticmethod
    def __new__(cls, elem, device=None):
        device = device or torch.device("cuda", DEVICES[dist.get_rank()])
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(), dtype=elem.dtype, device=device)
    def __init__(self, elem, device=None):
        self.elem = elem
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func.namespace == "sglang":
            OPS.append([func.__name__.split(".")[0]] + [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, str)])
            return func.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA), *args, **(kwargs or {}))
        un = lambda x: x.elem if isinstance(x, CudaLike) else x
        return func(*tree_map(un, args), **tree_map(un, kwargs or {}))
def on_cpu(make):
    def alloc(*a, device=None, **k):
        cuda = device is not None and torch.device(device).type == "cuda"
        return CudaLike(make(*a, **k), torch.device(device)) if cuda else make(*a, device=device, **k)
    return alloc
'''
