"""`sglpatch doctor`, check 1: the processes holding the GPUs, and ending the stale workers.

A process holds a GPU when one of its open file descriptors is a `/dev/nvidia*` device (read
from `/proc/PID/fd`: psutil's `open_files()` leaves character devices out). psutil gives the
rest (user, command line, age, parent); `nvidia-smi --query-compute-apps` the GPU memory by PID
(in a container nvidia-smi may name host PIDs, or none: those are listed as not visible here).

A *stale worker* is a process that (a) holds a GPU, (b) is an SGLang or torch worker by its own
command line or environment (`sglang::scheduler_TP0`-style titles that SGLang sets, a
multiprocessing spawn/fork child, a torchrun worker with TORCHELASTIC_RUN_ID), and (c) whose
owning server is gone, on evidence (`owner_gone`): its parent is a zombie or has exited, or it
was re-parented to a reaper (PID 1, a subreaper) *and* the leader of the process group it
inherited from its server has exited. A living PID 1 as parent is no evidence by itself: in a
container without an init the server *is* PID 1; a process group outside this PID namespace
(getpgid 0) cannot tell either. A server itself, an orphan that is not a worker, a worker whose
server is alive or cannot be shown gone: never stale, and each says why it was left alone.
`end_stale` ends exactly the stale ones (and the processes they started): the process group
when every live member of it is one of them and the group can be named (`proctree.unsafe_group`:
never group 0, the doctor's own or one holding its caller), else each PID alone; psutil's
Process objects guard against a PID recycled since the scan. Nothing is found or signalled by name.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from sglpatch.proctree import Tree, unsafe_group

WORKER_TITLES = ("sglang::", "sgl_diffusion::")  # SGLang's setproctitle() names (scheduler, detokenizer, ...)
MP_MARKERS = ("multiprocessing.spawn", "multiprocessing.forkserver", "--multiprocessing-fork")
REAPER_PIDS = frozenset({0, 1})


@dataclass
class GpuProc:
    pid: int
    devices: list[str]
    user: str = "?"
    cmdline: str = ""
    age_s: float | None = None
    ppid: int | None = None
    parent_gone: bool = False
    worker: str | None = None  # why it counts as an SGLang / torch worker; None: it does not
    pgid: int | None = None
    gpu_mem_mib: int | None = None
    evidence: str = ""  # why its server is gone, or why that is not shown (owner_gone)
    proc: psutil.Process | None = field(default=None, repr=False)

    @property
    def stale(self) -> bool:
        return bool(self.worker) and self.parent_gone

    def line(self) -> str:
        mem = f"{self.gpu_mem_mib} MiB" if self.gpu_mem_mib is not None else "GPU memory ?"
        parent = ("parent gone" if self.parent_gone else f"parent {self.ppid}") + (f" ({self.evidence})" if self.evidence else "")
        kind = f"{self.worker}" if self.worker else "not an SGLang/torch worker"
        verdict = "STALE" if self.stale else "kept"
        return (f"pid {self.pid} {verdict}: user {self.user}, {mem}, age {age(self.age_s)}, {parent}, {kind}; "
                f"`{one_line(self.cmdline)[:160]}`; holds {', '.join(sorted(self.devices))}")

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in ("pid", "devices", "user", "cmdline", "age_s", "ppid", "parent_gone",
                                               "worker", "pgid", "gpu_mem_mib", "evidence")} | {"stale": self.stale}


def one_line(text: str) -> str:
    """A command line as one printable line: newlines and other control characters escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(seconds)
    return f"{s // 86400}d{s % 86400 // 3600}h" if s >= 86400 else (
        f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s")


def holders(dev_glob: str = "/dev/nvidia*", proc_root: str = "/proc") -> tuple[dict[int, list[str]], int]:
    """{pid: [device paths it holds open]} and the number of processes whose fds could not be
    read (another user's, without root)."""
    devices = {os.path.realpath(p): p for p in glob.glob(dev_glob)}
    out: dict[int, list[str]] = {}
    unreadable = 0
    if not devices:
        return out, 0
    me = os.getpid()
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fds = os.listdir(os.path.join(entry.path, "fd"))
        except PermissionError:
            unreadable += 1
            continue
        except OSError:  # gone meanwhile
            continue
        held = set()
        for fd in fds:
            try:
                target = os.readlink(os.path.join(entry.path, "fd", fd))
            except OSError:
                continue
            if target in devices:
                held.add(devices[target])
        if held:
            out[int(entry.name)] = sorted(held)
    return out, unreadable


def worker_kind(cmdline: list[str], name: str, environ: dict | None) -> str | None:
    """Why this process is an SGLang / torch worker, or None."""
    title = cmdline[0] if cmdline else ""
    for t in WORKER_TITLES:
        if title.startswith(t) or name.startswith(t):
            return f"SGLang worker ({(title or name).split()[0]})"
    joined = " ".join(cmdline)
    if "python" in (Path(title).name or name) and any(m in joined for m in MP_MARKERS):
        return "multiprocessing worker (SGLang / torch spawn child)"
    if environ and environ.get("TORCHELASTIC_RUN_ID"):
        return f"torchrun worker (LOCAL_RANK={environ.get('LOCAL_RANK', '?')})"
    return None


def compute_apps(nvidia_smi: str | None, timeout: float = 30.0) -> tuple[dict[int, int], str | None]:
    """{pid: used MiB} from `nvidia-smi --query-compute-apps=pid,used_memory` (summed over GPUs);
    and an error line when nvidia-smi could not answer."""
    if not nvidia_smi:
        return {}, "no nvidia-smi"
    try:
        r = subprocess.run([nvidia_smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, errors="replace", timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return {}, f"{nvidia_smi} failed: {e}"
    if r.returncode != 0:
        return {}, f"{nvidia_smi} --query-compute-apps exited {r.returncode}"
    out: dict[int, int] = {}
    for line in r.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit():
            out[int(parts[0])] = out.get(int(parts[0]), 0) + (int(parts[1]) if parts[1].isdigit() else 0)
    return out, None


def describe(pid: int, devices: list[str], mem: dict[int, int], reapers=REAPER_PIDS) -> GpuProc | None:
    gp = GpuProc(pid, devices, gpu_mem_mib=mem.get(pid))
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            gp.proc = p
            gp.ppid = p.ppid()
            gp.cmdline = " ".join(p.cmdline()) or f"[{p.name()}]"
            gp.age_s = max(0.0, time.time() - p.create_time())
            gp.user = p.username()
            name = p.name()
            cmd = p.cmdline()
        try:
            environ = p.environ()
        except (psutil.AccessDenied, psutil.ZombieProcess):
            environ = None
        gp.pgid = os.getpgid(pid)
    except (psutil.NoSuchProcess, ProcessLookupError):
        return None
    except psutil.AccessDenied:
        return gp
    gp.parent_gone, gp.evidence = owner_gone(p, gp.ppid, gp.pgid, reapers)
    gp.worker = worker_kind(cmd, name, environ)
    return gp


def _exited(pid: int, born: float) -> str | None:
    """How process pid (expected to be older than `born`) is gone: 'a zombie', 'gone', or None (alive)."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return "exited (a zombie)"
        return "exited (its PID now names a newer process)" if p.create_time() > born + 1e-3 else None
    except psutil.NoSuchProcess:
        return "exited"
    except psutil.Error:
        return None


def owner_gone(p: psutil.Process, ppid: int | None, pgid: int | None, reapers=REAPER_PIDS) -> tuple[bool, str]:
    """(the server that started p is gone, the evidence or why there is none)."""
    try:
        born = p.create_time()
    except psutil.Error:
        return False, "cannot read its start time"
    if not ppid:
        return False, "its parent is outside this PID namespace: no evidence its server is gone"
    if ppid not in reapers:
        how = _exited(ppid, born)
        return (True, f"its parent {ppid} {how}") if how else (False, "")
    # a reaper's child: adopted after its server died, or started by a server that is the reaper (PID 1)
    if pgid is None or pgid <= 0:
        return False, (f"its parent PID {ppid} is alive and its process group is outside this PID namespace: "
                       "no evidence its server is gone")
    if pgid == ppid:
        return False, f"its parent PID {ppid} leads its process group: the server itself runs as PID {ppid}"
    how = _exited(pgid, born)
    if how:
        return True, f"re-parented to PID {ppid}; its process group's leader {pgid} {how}"
    return False, f"its parent is PID {ppid}, but its process group's leader {pgid} is alive: no evidence its server is gone"


def scan(dev_glob: str, proc_root: str, nvidia_smi: str | None, reapers=REAPER_PIDS) -> dict:
    """{"procs": [GpuProc], "unreadable": n, "smi_only": {pid: MiB} (PIDs nvidia-smi names that
    are not visible here), "smi_error": str | None}."""
    held, unreadable = holders(dev_glob, proc_root)
    mem, err = compute_apps(nvidia_smi)
    procs = [gp for pid, devs in sorted(held.items()) if (gp := describe(pid, devs, mem, reapers))]
    seen = {gp.pid for gp in procs}
    smi_only = {pid: mib for pid, mib in mem.items() if pid not in seen and not psutil.pid_exists(pid)}
    for pid in mem:  # nvidia-smi names it, it is here, but no fd on a device matched
        if pid not in seen and pid not in smi_only and (gp := describe(pid, [], mem, reapers)):
            procs.append(gp)
    return {"procs": procs, "unreadable": unreadable, "smi_only": smi_only, "smi_error": err,
            "devices": sorted(glob.glob(dev_glob))}


def _group_members(pgid: int) -> set[int]:
    out = set()
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except (psutil.Error, OSError):
            continue
    return out


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _not_permitted(p: psutil.Process) -> str | None:
    """Why this doctor may not signal p (another user's process, not root), or None."""
    try:
        os.kill(p.pid, 0)
        return None
    except PermissionError:
        try:
            owner = p.username()
        except psutil.Error:
            owner = "another user"
        return (f"not permitted (EPERM: it belongs to {owner}, this doctor runs as uid {os.geteuid()}): "
                f"run `sglpatch doctor --kill-stale` as root or as {owner}")
    except ProcessLookupError:
        return None


def end_stale(stale: list[GpuProc], grace: float = 10.0) -> list[str]:
    """End the stale workers and what they started; one line per process ended (or not)."""
    targets: dict[int, psutil.Process] = {}
    why: dict[int, str] = {}
    lines, done = [], set()
    for gp in stale:
        if gp.proc is None or not _alive(gp.proc):  # e.g. during the [y/N] prompt
            lines.append(f"pid {gp.pid} ({one_line(gp.cmdline)[:80]}) exited by itself before it was signalled: nothing sent")
            continue
        denied = _not_permitted(gp.proc)
        if denied:
            lines.append(f"pid {gp.pid} ({one_line(gp.cmdline)[:80]}) not ended: {denied}")
            continue
        targets[gp.pid] = gp.proc
        why[gp.pid] = one_line(gp.cmdline)[:80]
        try:
            for child in gp.proc.children(recursive=True):
                targets.setdefault(child.pid, child)
                why.setdefault(child.pid, f"started by stale pid {gp.pid}")
        except psutil.Error:
            pass
    groups: dict[int, set[int]] = {}
    for pid in targets:
        try:
            groups.setdefault(os.getpgid(pid), set()).add(pid)
        except OSError:
            continue
    for pgid, pids in sorted(groups.items()):
        unsafe = unsafe_group(pgid)
        if not unsafe and _group_members(pgid) <= set(targets):  # the whole group is stale: the group, then each PID
            tree = Tree(pgid)
            for pid in pids:
                tree.seen.setdefault(pid, targets[pid])
            left = set(tree.kill(grace=grace))
            how = f"process group {pgid}"
        else:  # the group holds others too: these PIDs only
            procs = [targets[p] for p in pids]
            for sig, wait_s in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                for p in procs:
                    try:
                        p.send_signal(sig)  # psutil refuses a PID that now belongs to another process
                    except psutil.Error:
                        pass
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline and any(_alive(p) for p in procs):
                    time.sleep(0.05)
                if not any(_alive(p) for p in procs):
                    break
            left = {p.pid for p in procs if _alive(p)}
            how = f"its PID ({unsafe or 'its process group holds other processes too'})"
        for pid in sorted(pids):
            done.add(pid)
            denied = _not_permitted(targets[pid]) if pid in left else None
            lines.append(f"ended pid {pid} ({why[pid]}) by {how}" if pid not in left else
                         f"pid {pid} ({why[pid]}) not ended: {denied}" if denied else
                         f"pid {pid} ({why[pid]}) is still alive after SIGKILL: stuck in the driver "
                         f"(state D)? check `cat /proc/{pid}/stack`; only a GPU reset or reboot frees it")
    return lines
