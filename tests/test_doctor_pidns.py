"""Issue 28, faults 1 and 2: `doctor --kill-stale` in real PID namespaces (`unshare --pid --fork
--mount-proc`, as a container runs), on real processes holding a fake /dev/nvidia* file.

1. A live server that is PID 1 (a container without an init): its workers' parent is PID 1 and
   alive; that is no evidence the server is gone: they are kept, and the doctor says why.
2. A worker whose process group lies outside the namespace (getpgid says 0, as under `docker exec
   -d`, `kubectl exec`, nsenter): os.killpg(0) would signal the doctor's own group. It is ended by
   its PID only, and the doctor lives to say so.
Skipped where the namespace cannot be made (not root, no unshare)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import psutil
import pytest

from conftest import ROOT
from sglpatch import proctree


def _pidns_ok() -> bool:
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return r.returncode == 0


needs_pidns = pytest.mark.skipif(not _pidns_ok(), reason="needs `unshare --pid --fork --mount-proc` (root)")

HOLD = "import sys, time\nf = open(sys.argv[1])\nprint('held', flush=True)\ntime.sleep(600)\n"


def _in_namespace(tmp_path, body: str) -> dict:
    """Run body as PID 1 of a new PID namespace; it writes its findings to result.json."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_text("")
    script = tmp_path / "pid1.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, subprocess, sys, time
        DEV, OUT, HOLD = {str(dev)!r}, {str(tmp_path / 'result.json')!r}, {HOLD!r}
        def worker():
            w = subprocess.Popen(["sglang::scheduler_TP0", "-c", HOLD, DEV + "/nvidia0"], executable=sys.executable,
                                 stdout=subprocess.PIPE, text=True)
            assert w.stdout.readline() == "held\\n"
            return w
        def alive(p):
            return p.poll() is None
    """) + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(script)], env=env,
                       capture_output=True, text=True, timeout=300, start_new_session=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((tmp_path / "result.json").read_text())


DOCTOR = """
def doctor():
    d = subprocess.run([sys.executable, "-m", "sglpatch.gpu.doctor", "--dev-glob", DEV + "/nvidia*", "--no-p2p",
                        "--nvidia-smi", "/nonexistent/nvidia-smi", "--kill-stale", "--yes"],
                       capture_output=True, text=True, timeout=200)
    return d.returncode, d.stdout + d.stderr
"""


@needs_pidns
@pytest.mark.parametrize("session", ["own session (docker's PID 1)", "group outside the namespace"])
def test_the_workers_of_a_live_server_that_is_pid_1_are_kept(tmp_path, session):
    lead = "os.setsid()" if session.startswith("own") else "pass"
    res = _in_namespace(tmp_path, DOCTOR + f"""
{lead}
assert os.getpid() == 1
w = worker()
rc, out = doctor()
json.dump({{"rc": rc, "out": out, "worker": w.pid, "alive": alive(w), "pgid": os.getpgid(w.pid)}}, open(OUT, "w"))
w.kill()
""")
    out = res["out"]
    assert res["alive"], out
    assert "ended pid" not in out and "STALE" not in out and "stale worker(s) to end" not in out, out
    if session.startswith("own"):
        assert res["pgid"] == 1
        why = "its parent PID 1 leads its process group: the server itself runs as PID 1"
    else:
        assert res["pgid"] == 0
        why = "its parent PID 1 is alive and its process group is outside this PID namespace: no evidence its server is gone"
    line = next(ln for ln in out.splitlines() if " gpu-procs: " in ln)
    assert line.startswith("warn gpu-procs: 1 live process(es) hold the GPUs, none stale: "), out
    assert line.startswith(f"warn gpu-procs: 1 live process(es) hold the GPUs, none stale: pid {res['worker']} "
                           f"(sglang::scheduler_TP0; kept: {why}); fix: "), out


@needs_pidns
def test_a_stale_worker_in_a_group_outside_the_namespace_is_ended_by_pid_and_the_doctor_lives(tmp_path):
    res = _in_namespace(tmp_path, """
w = worker()  # its process group is the one outside (getpgid: 0)
os.setsid()   # PID 1 leaves it: the worker is that group's only member here
code = (
    "import json, sys\\n"
    "from sglpatch.gpu.doctor import gpu_holders as dp\\n"
    f"gp = dp.describe({w.pid}, ['dev'], {{}})\\n"
    "gp.parent_gone = True  # taken as stale, to reach end_stale's group rule\\n"
    "print(json.dumps({'pgid': gp.pgid, 'lines': dp.end_stale([gp], grace=5.0)}))\\n"
)
d = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, start_new_session=True)
time.sleep(0.2)
json.dump({"rc": d.returncode, "out": d.stdout, "err": d.stderr, "worker_alive": alive(w), "worker": w.pid}, open(OUT, "w"))
w.kill()
""")
    assert res["rc"] == 0, res  # before the fix: -15, os.killpg(0, SIGTERM) ended the doctor's own group
    got = json.loads(res["out"])
    assert got["pgid"] == 0 and not res["worker_alive"]
    assert len(got["lines"]) == 1 and got["lines"][0].startswith(
        f"ended pid {res['worker']} (sglang::scheduler_TP0 -c import sys, time\\nf = open(sys.argv[1])\\n"), got
    assert got["lines"][0].endswith("by its PID (its process group (0) cannot be named from this PID namespace)")
    assert "\n" not in got["lines"][0]  # the command line's newlines are escaped


def test_unsafe_group_names_ours_and_our_callers_and_zero(tmp_path):
    """Real processes: a caller in its own session starts a checker in another; the caller's group is refused."""
    assert proctree.unsafe_group(0) == "its process group (0) cannot be named from this PID namespace"
    assert proctree.unsafe_group(os.getpgrp()) == f"its process group {os.getpgrp()} holds this process"
    code = ("import os, subprocess, sys\n"
            "r = subprocess.run([sys.executable, '-c', 'import os, sys; from sglpatch.proctree import unsafe_group; "
            "print(unsafe_group(int(sys.argv[1])))', str(os.getpgrp())], capture_output=True, text=True, "
            "start_new_session=True)\n"
            "print(os.getpid(), r.stdout.strip(), r.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, start_new_session=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=60)
    pid, _, rest = r.stdout.partition(" ")
    assert rest.strip() == f"its process group {pid} holds pid {pid}, which started this process", r.stdout + r.stderr
    assert proctree.unsafe_group(psutil.Process().pid) in (None, f"its process group {os.getpgrp()} holds this process")
