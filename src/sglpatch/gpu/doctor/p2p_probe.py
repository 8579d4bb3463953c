"""Run by `sglpatch doctor` with the serving interpreter: a real peer-to-peer copy per GPU pair.

    python doctor_p2p_probe.py --pairs 0-1,0-2,... [--mib 64]

Prints one JSON line per event, flushed, so that the doctor can hold each pair to a deadline
and name the pair that hangs: {"event": "ready", "gpus": N}, then per pair {"event": "start",
"a": A, "b": B} and {"event": "done", "a": A, "b": B, "ok": bool, ...}.

Per pair and direction (A->B, B->A): `torch.cuda.can_device_access_peer`, a contiguous copy
(the copy engines; peer access is enabled by torch when the pair can have it) timed as GB/s,
and a converting copy int32 -> int64 across the devices (a kernel that reads the peer's memory
with loads, the path a custom allreduce takes); both are checked value by value. NCCL itself
is not exercised (the kernel tier does that).
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]


def say(**kw):
    print(json.dumps(kw), flush=True)


def one_way(torch, src, dst, n, reps=5):
    x = (torch.arange(n, dtype=torch.int32, device=f"cuda:{src}") * 7 + src * 31 + dst)
    torch.cuda.synchronize(src)
    y = x.to(f"cuda:{dst}")  # warm-up (peer access enabled here)
    torch.cuda.synchronize(dst)
    t0 = time.perf_counter()
    for _ in range(reps):
        y = x.to(f"cuda:{dst}")
    torch.cuda.synchronize(dst)
    dt = (time.perf_counter() - t0) / reps
    copy_ok = bool(torch.equal(y.to(f"cuda:{src}"), x))
    z = torch.empty(n, dtype=torch.int64, device=f"cuda:{dst}")
    z.copy_(x)  # dtype conversion across devices: a kernel reading the peer's memory
    torch.cuda.synchronize(dst)
    load_ok = bool(torch.equal(z.to(torch.int32), y))
    return {"peer": bool(torch.cuda.can_device_access_peer(src, dst)), "gbps": round(n * 4 / dt / 1e9, 2),
            "copy_ok": copy_ok, "load_ok": load_ok}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", required=True, help="A-B,C-D,... or 'all'")
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        say(event="ready", gpus=0, error=f"torch {torch.__version__} sees no CUDA device")
        return 0
    count = torch.cuda.device_count()
    for d in range(count):  # contexts up front: the per-pair deadline then measures the pair only
        torch.empty(1, device=f"cuda:{d}")
        torch.cuda.synchronize(d)
    say(event="ready", gpus=count, torch=torch.__version__, cuda=torch.version.cuda)
    if args.pairs == "all":
        pairs = [(a, b) for a in range(count) for b in range(a + 1, count)]
    else:
        pairs = [tuple(int(x) for x in p.split("-")) for p in args.pairs.split(",") if p]
    n = args.mib * 2**20 // 4
    for a, b in pairs:
        say(event="start", a=a, b=b)
        if max(a, b) >= count:
            say(event="done", a=a, b=b, ok=False, detail=f"GPU {max(a, b)} not visible to torch ({count} GPUs)")
            continue
        try:
            ab, ba = one_way(torch, a, b, n), one_way(torch, b, a, n)
        except Exception as e:  # noqa: BLE001 - one pair's error, the next pair still runs
            say(event="done", a=a, b=b, ok=False, detail=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        ok = all(d["copy_ok"] and d["load_ok"] for d in (ab, ba))
        say(event="done", a=a, b=b, ok=ok, ab=ab, ba=ba,
            detail="" if ok else "values differ after the copy: P2P corrupts data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
