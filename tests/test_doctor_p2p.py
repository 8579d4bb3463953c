"""sglpatch doctor, check 4: the P2P copy test's runner, with a torch-free fake probe that speaks
the real probe's protocol and hangs, dies or answers per pair; every child it starts is ended."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psutil

from sglpatch.gpu.doctor import gpu as doctor_gpu

FAKE = """\
import json, os, sys, time
args = sys.argv[sys.argv.index("--pairs") + 1]
open(os.environ["FAKE_PIDS"], "a").write(f"{os.getpid()}\\n")
if os.environ.get("FAKE_NO_START"):
    time.sleep(600)
n = int(os.environ.get("FAKE_GPUS", "4"))
print(json.dumps({"event": "ready", "gpus": n}), flush=True)
pairs = ([(a, b) for a in range(n) for b in range(a + 1, n)] if args == "all"
         else [tuple(int(x) for x in p.split("-")) for p in args.split(",")])
hang, die = os.environ.get("FAKE_HANG", ""), os.environ.get("FAKE_DIE", "")
nopeer = os.environ.get("FAKE_NOPEER", "")
for a, b in pairs:
    print(json.dumps({"event": "start", "a": a, "b": b}), flush=True)
    if f"{a}-{b}" == hang:
        time.sleep(600)
    if f"{a}-{b}" == die:
        print("CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
        os._exit(3)
    way = {"peer": f"{a}-{b}" != nopeer, "gbps": 20.0 + a + b, "copy_ok": True, "load_ok": True}
    print(json.dumps({"event": "done", "a": a, "b": b, "ok": True, "ab": way, "ba": way}), flush=True)
"""


def probe(tmp_path: Path) -> Path:
    p = tmp_path / "fake_probe.py"
    p.write_text(FAKE)
    return p


def run(tmp_path, pairs, timeout=1.5, start=5.0, **fake):
    pids = tmp_path / "pids"
    env = {"PATH": "/usr/bin:/bin", "FAKE_PIDS": str(pids), **{f"FAKE_{k.upper()}": str(v) for k, v in fake.items()}}
    t0 = time.monotonic()
    res = doctor_gpu.run_p2p(sys.executable, env, pairs, probe(tmp_path), pair_timeout=timeout, start_timeout=start)
    started = [int(x) for x in pids.read_text().split()] if pids.exists() else []
    assert not [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    return res, time.monotonic() - t0, started


def test_a_pair_that_hangs_is_named_killed_and_the_rest_still_run(tmp_path):
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    res, took, started = run(tmp_path, pairs, hang="1-2", start=60.0)
    assert res["pairs"][(1, 2)] == {"hung": 1.5}
    assert all(res["pairs"][p]["ok"] for p in pairs if p != (1, 2)) and not res["untested"]
    assert len(started) == 2  # the hung child was ended, a new one ran the pairs after it
    assert took < 1.5 + 5  # the pair's deadline (not the start's), once (not once per remaining pair)
    (tmp_path / "cmdline").write_text("BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on quiet\n")
    c = doctor_gpu.check_p2p(res, (tmp_path / "cmdline").read_text())
    assert c.state == "fail"
    assert c.line().startswith("fail p2p-copy: pair(s) 1<->2 hung past 2 s: P2P between them is broken: ACS on a "
                               "bridge above them redirects peer traffic")
    assert "`sudo lspci -vvv | grep -i acsctl`" in c.text and "this kernel has: intel_iommu=on" in c.text
    assert c.fix.startswith("fix ACS / IOMMU on the host") and "NCCL_P2P_DISABLE=1" in c.fix
    assert "1<->2: HUNG" in c.details


def test_a_probe_that_dies_on_a_pair_names_it_with_its_last_error(tmp_path):
    res, _, started = run(tmp_path, None, gpus=3, die="0-2")
    assert set(res["pairs"]) == {(0, 1), (0, 2), (1, 2)} and len(started) == 2
    assert res["pairs"][(0, 2)] == {"ok": False, "detail": "the probe died during the pair: CUDA error: an illegal "
                                    "memory access was encountered"}
    c = doctor_gpu.check_p2p(res, "")
    assert c.state == "fail" and "0<->2: the probe died during the pair: CUDA error" in c.text


def test_all_pairs_fine_is_ok_and_no_peer_access_warns(tmp_path):
    res, _, started = run(tmp_path, [(0, 1), (0, 2), (1, 2)])
    c = doctor_gpu.check_p2p(res, "")
    assert c.line() == "ok   p2p-copy: 3 pairs copied both ways, values exact; slowest 21.0 GB/s (0<->1)"
    assert len(started) == 1
    res, _, _ = run(tmp_path, [(0, 1), (0, 2)], nopeer="0-2")
    c = doctor_gpu.check_p2p(res, "")
    assert c.state == "warn" and "no peer access for 0<->2 (copies went through host memory)" in c.text


def test_a_probe_that_never_starts_fails_after_the_start_deadline(tmp_path):
    res, took, _ = run(tmp_path, [(0, 1)], start=1.0, no_start=1)
    assert took < 5
    c = doctor_gpu.check_p2p(res, "")
    assert c.line().startswith("fail p2p-copy: the P2P probe did not start within 1 s (CUDA initialisation hung?)")


def test_a_probe_that_crashes_before_it_starts_fails(tmp_path):
    bad = tmp_path / "crash.py"
    bad.write_text("import sys\nprint('RuntimeError: CUDA driver initialization failed', file=sys.stderr)\nsys.exit(1)\n")
    res = doctor_gpu.run_p2p(sys.executable, {"PATH": "/usr/bin:/bin"}, [(0, 1)], bad, 1.0, 5.0)
    assert doctor_gpu.check_p2p(res, "").line().startswith(
        "fail p2p-copy: the P2P probe ended before it started: RuntimeError: CUDA driver initialization failed")


def test_no_gpu_and_skips(tmp_path):
    res, _, _ = run(tmp_path, None, gpus=0)
    assert doctor_gpu.check_p2p(res, "").state == "skip"
    assert doctor_gpu.check_p2p(None, "", "not run (--no-p2p)").line() == "skip p2p-copy: not run (--no-p2p)"


def test_the_real_probe_without_cuda_says_so(tmp_path):
    """The shipped probe (torch, no CUDA here) reports no device instead of failing."""
    res = doctor_gpu.run_p2p(sys.executable, {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""}, [(0, 1)],
                             start_timeout=120)
    assert res["ready"]["gpus"] == 0 and "sees no CUDA device" in res["ready"]["error"], json.dumps(res)
    assert doctor_gpu.check_p2p(res, "").state == "skip"
