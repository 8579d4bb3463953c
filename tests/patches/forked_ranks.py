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
