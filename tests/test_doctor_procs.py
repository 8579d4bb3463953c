"""sglpatch doctor, check 1: the processes holding the GPUs, on real processes.

A fake device folder (regular files named like /dev/nvidia*) is held open by real child
processes: stale SGLang workers whose launcher exited (one sharing its process group with an
unrelated orphan, one alone in its group with a child of its own), a real multiprocessing spawn
child whose parent was SIGKILLed, a worker whose parent is alive, and an unrelated live
process. `--kill-stale` must end the stale ones (and what they started) and nothing else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import wait_pid

from sglpatch.gpu.doctor import run as doctor

from sglpatch.gpu.doctor import gpu_holders as doctor_procs

HOLD = "import os, sys, time\nf = open(sys.argv[1])\nopen(sys.argv[2], 'w').write(str(os.getpid()))\ntime.sleep(600)\n"


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def box(tmp_path):
    """Started processes: {role: pid}; every one still alive is ended at teardown."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_text("")
    pids: dict[str, int] = {}
    keep: list[subprocess.Popen] = []
    t = tmp_path

    # group 1: a launcher (its own session) starts a stale 'sglang::scheduler_TP0' and an unrelated
    # orphan (`sleep` holding the device) in its group, then exits: both parents are gone
    launcher = textwrap.dedent(f"""
        import subprocess, sys
        subprocess.Popen(["sglang::scheduler_TP0", "-c", {HOLD!r}, {str(dev / 'nvidia0')!r}, {str(t / 'w1')!r}],
                         executable=sys.executable)
        subprocess.Popen(["sh", "-c", "exec 3<{dev / 'nvidia0'}; echo $$ > {t / 'u1'}; exec sleep 600"])
    """)
    subprocess.run([sys.executable, "-c", launcher], start_new_session=True, check=True)
    # group 2: a stale 'sglang::detokenizer' alone in its group, with a child of its own (no device)
    holder2 = HOLD.replace("time.sleep(600)", f"import subprocess; c = subprocess.Popen(['sleep', '600']); "
                           f"open({str(t / 'c2')!r}, 'w').write(str(c.pid)); time.sleep(600)")
    launcher2 = (f"import subprocess, sys; subprocess.Popen(['sglang::detokenizer', '-c', {holder2!r}, "
                 f"{str(dev / 'nvidiactl')!r}, {str(t / 'w2')!r}], executable=sys.executable)")
    subprocess.run([sys.executable, "-c", launcher2], start_new_session=True, check=True)
    # a real multiprocessing spawn child holding the device; its parent is SIGKILLed below
    spawner = textwrap.dedent(f"""
        import multiprocessing as mp, os, time
        def hold(dev, out):
            f = open(dev)
            open(out, "w").write(str(os.getpid()))
            time.sleep(600)
        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=hold, args=({str(dev / 'nvidia-uvm')!r}, {str(t / 's3')!r}))
            p.start()
            time.sleep(600)
    """)
    (t / "spawner.py").write_text(spawner)
    sp = subprocess.Popen([sys.executable, str(t / "spawner.py")], start_new_session=True)
    keep.append(sp)
    # a worker whose server (parent) is alive
    parent = (f"import subprocess, sys, time; subprocess.Popen(['sglang::scheduler_TP1', '-c', {HOLD!r}, "
              f"{str(dev / 'nvidia1')!r}, {str(t / 'l4')!r}], executable=sys.executable); time.sleep(600)")
    p4 = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    keep.append(p4)
    # an unrelated live process holding the device
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(dev / "nvidia0"), str(t / "o5")], start_new_session=True)
    keep.append(other)
    for role in ("w1", "u1", "w2", "c2", "s3", "l4", "o5"):
        pids[role] = wait_pid(t / role)
    pids["p4"], pids["spawner"] = p4.pid, sp.pid
    sp.send_signal(signal.SIGKILL)
    sp.wait()
    # the launchers are gone: who adopted their children (PID 1 here; a subreaper where one runs)
    reapers = {0, 1, psutil.Process(pids["w1"]).ppid(), psutil.Process(pids["s3"]).ppid()}
    yield {"dev": dev, "pids": pids, "reapers": frozenset(reapers), "tmp": t}
    for pid in pids.values():
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    for p in keep:
        p.kill()
        p.wait()


def fake_smi(path: Path, apps: dict[int, int]) -> str:
    rows = "".join(f"{pid}, {mib}\\n" for pid, mib in apps.items())
    path.write_text(f"#!/bin/sh\ncase \"$1\" in --query-compute-apps=*) printf '{rows}';; *) exit 9;; esac\n")
    path.chmod(0o755)
    return str(path)


def test_scan_names_holders_and_only_stale_workers_are_stale(box):
    p = box["pids"]
    smi = fake_smi(box["tmp"] / "nvidia-smi", {p["w1"]: 81000, p["l4"]: 79000, 4194000: 1200})
    sc = doctor_procs.scan(str(box["dev"] / "nvidia*"), "/proc", smi, reapers=box["reapers"])
    by = {gp.pid: gp for gp in sc["procs"]}
    assert {p[r] for r in ("w1", "u1", "w2", "s3", "l4", "o5")} <= set(by)
    assert p["c2"] not in by and p["p4"] not in by  # they hold no device
    assert {gp.pid for gp in sc["procs"] if gp.stale} == {p["w1"], p["w2"], p["s3"]}
    assert by[p["w1"]].worker == "SGLang worker (sglang::scheduler_TP0)" and by[p["w1"]].gpu_mem_mib == 81000
    assert by[p["s3"]].worker.startswith("multiprocessing worker") and by[p["s3"]].parent_gone
    assert by[p["u1"]].parent_gone and by[p["u1"]].worker is None  # an orphan, but not a worker
    assert not by[p["l4"]].parent_gone and by[p["l4"]].ppid == p["p4"]
    assert by[p["w2"]].devices == [str(box["dev"] / "nvidiactl")]
    assert sc["smi_only"] == {4194000: 1200}
    line = doctor.check_procs(sc, []).line()
    assert line.startswith("fail gpu-procs: 3 stale SGLang/torch worker(s) (parent gone) hold the GPUs: ")
    assert f"pid {p['w1']} (sglang::scheduler_TP0, 81000 MiB, age " in line
    assert line.endswith("; fix: sglpatch doctor --kill-stale (ends exactly these: process group, then PID)")
    assert any("4194000: 1200 MiB per nvidia-smi, not visible here" in d for d in doctor.check_procs(sc, []).details)


def cli(box, *args, stdin="") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglpatch.gpu.doctor", "--dev-glob", str(box["dev"] / "nvidia*"),
                           "--no-p2p", "--reapers", ",".join(map(str, sorted(box["reapers"]))),
                           "--nvidia-smi", str(box["tmp"] / "no-nvidia-smi"), *args],
                          input=stdin, capture_output=True, text=True, timeout=180)


def test_kill_stale_asks_and_a_no_ends_nothing(box):
    r = cli(box, "--kill-stale", stdin="n\n")
    assert "end these 3 process(es)? [y/N]" in r.stdout, r.stdout + r.stderr
    assert "nothing ended (not confirmed; --yes ends without asking)" in r.stdout
    assert all(alive(pid) for pid in box["pids"].values() if pid != box["pids"]["spawner"])
    assert r.returncode == 1 and "fail gpu-procs: 3 stale" in r.stdout


def test_kill_stale_ends_exactly_the_stale_workers_and_what_they_started(box):
    p = box["pids"]
    r = cli(box, "--kill-stale", "--yes")
    out = r.stdout
    assert "[y/N]" not in out, out
    time.sleep(0.2)
    gone = {role for role, pid in p.items() if not alive(pid)}
    assert gone == {"w1", "w2", "c2", "s3", "spawner"}, (gone, out, r.stderr)
    assert f"ended pid {p['w1']} (sglang::scheduler_TP0" in out and "by its PID (its process group holds other" in out
    pg2 = os.getpgid(p["w2"]) if alive(p["w2"]) else None
    assert pg2 is None and f"ended pid {p['w2']} (sglang::detokenizer" in out and "by process group " in out
    assert f"ended pid {p['c2']} (started by stale pid {p['w2']})" in out
    assert f"ended pid {p['s3']} (" in out
    line = next(ln for ln in out.splitlines() if " gpu-procs: " in ln)
    assert line.startswith("warn gpu-procs: ended 4 stale process(es); 3 live process(es) hold the GPUs, none stale: ")
    for role in ("u1", "l4", "o5"):
        assert f"pid {p[role]} (" in line
