"""Running CMD once, shared by the triage (in the driver's process) and by the step runner under
git: in its own process group, stdin closed, its descendants recorded as they come and ended
with it, its output shown live and kept in one log file per step; plus what both read back
(the steps so far, a commit's name in the series, the time left)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from dataclasses import asdict
from pathlib import Path

from sglpatch import exitcodes, proctree
from sglpatch.workdir import UPSTREAM_BRANCH
from sglpatch.bisect.model import (
    ENV_COMMIT,
    ENV_PATCH,
    EXIT_BAD,
    EXIT_SKIP,
    KILL_GRACE_S,
    BisectError,
    SNAPSHOT_EVERY_S,
    PatchRef,
    Step,
)


def say(stream, msg: str) -> None:
    data = f"sglpatch bisect: {msg}\n".encode()
    try:
        stream.write(data)
        stream.flush()
    except (OSError, ValueError):
        pass


def _pump(src, sinks) -> None:
    try:
        while True:
            chunk = os.read(src.fileno(), 65536)
            if not chunk:
                break
            for s in sinks:
                try:
                    s.write(chunk)
                    s.flush()
                except (OSError, ValueError):
                    pass
    except (OSError, ValueError):
        pass


NOT_STARTED = {126: "not executable", 127: "command not found"}
NO_VERDICT = {  # why an exit stops the bisect: no verdict from a run that could not run
    exitcodes.USAGE: "a usage error: it could not run as given",
    exitcodes.INTERRUPTED: "interrupted",
    None: "not a verdict: 0 passes, 1 fails, 125 cannot run here",
}


def stopped(step: Step, runs: int) -> BisectError:
    """The one line for a run whose exit is no verdict (NO_VERDICT): the bisect stops there. Exit 2
    when CMD's own was a usage error, else 1."""
    fix = (f"run it by hand to see why (its output: {step.log}), fix the command and re-run" if step.rc == exitcodes.USAGE else
           f"make CMD exit 1 on a regression, e.g. `sh -c 'CMD || exit 1'` (its output: {step.log})")
    return BisectError(f"CMD exited {step.rc} ({step.note}) on {step.label}: stopped after {runs} run{'s' if runs > 1 else ''}, "
                         f"no verdict; {fix}", exitcodes.USAGE if step.rc == exitcodes.USAGE else exitcodes.ERROR)


def run_cmd(
    state: dict,
    commit: str,
    ref: PatchRef,
    run_no: int,
    phase: str,
    out,
    err,
) -> Step:
    """Run CMD once at the checked-out commit; tee its output; kill its group on timeout."""
    sd = Path(state["state_dir"])
    log_path = Path(state["log_dir"]) / f"step-{run_no:02d}.log"
    env = dict(state["env"])
    env[ENV_COMMIT] = commit
    env[ENV_PATCH] = ref.name if ref.index else "upstream"
    env.setdefault("PYTHONUNBUFFERED", "1")  # its output goes through a pipe: show it as it comes
    # regress's reports under this bisect's log folder, a folder a step, not regress-<time>/ in the checkout
    env.setdefault("SGLPATCH_REGRESS_DIR", str(Path(state["log_dir"]) / f"step-{run_no:02d}-regress"))
    timeout = state.get("timeout")
    with open(log_path, "wb") as log:
        log.write(f"# run {run_no} ({phase}) {ref.label} {commit}\n# cmd: {state['cmd']!r}\n".encode())
        log.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(
            state["cmd"],
            cwd=state["cwd"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
        pgid = proc.pid
        tree = proctree.Tree(pgid)
        (sd / "current-pgid").write_text(str(pgid))
        readers = [
            threading.Thread(target=_pump, args=(proc.stdout, [log, out]), daemon=True),
            threading.Thread(target=_pump, args=(proc.stderr, [log, err]), daemon=True),
        ]
        for t in readers:
            t.start()
        timed_out = False
        try:
            if (sd / "stop").exists():
                raise KeyboardInterrupt
            rc: int | None = None
            deadline = None if timeout is None else t0 + timeout
            while rc is None:
                # remember CMD's descendants as they come: one that leaves the group is still ended
                tree.snapshot()
                left = SNAPSHOT_EVERY_S if deadline is None else min(SNAPSHOT_EVERY_S, deadline - time.monotonic())
                try:
                    rc = proc.wait(timeout=max(left, 0.0))
                except subprocess.TimeoutExpired:
                    if deadline is not None and time.monotonic() >= deadline:
                        timed_out = True
                        tree.kill(KILL_GRACE_S, reap=proc)
                        if proc.poll() is None:  # the group could not be signalled: at least the CMD itself
                            proc.kill()
                        proc.wait()
                        rc = None
                        break
        except BaseException:
            tree.kill(1.0, reap=proc)
            raise
        finally:
            # whatever CMD left running (servers, workers holding GPU memory) goes too
            tree.kill(1.0, reap=proc)
            try:
                (sd / "current-pgid").unlink()
            except FileNotFoundError:
                pass
            for t in readers:
                t.join(timeout=2.0)
        seconds = time.monotonic() - t0
        note = ""
        if timed_out:
            verdict = state["on_timeout"]
            note = f"timed out after {timeout:g}s; process group killed"
        elif rc == 0:
            verdict = "good"
        elif rc == EXIT_SKIP:
            verdict = "skip"
        elif rc in NOT_STARTED:  # the shell's "not executable" / "not found": CMD did not run at all
            verdict = "skip"
            note = f"exit {rc}: {NOT_STARTED[rc]}: could not run, counted as skip"
        elif rc == EXIT_BAD:  # only the command's own failure is a verdict
            verdict = "bad"
        elif rc is not None and (rc < 0 or rc >= 128) and rc != exitcodes.INTERRUPTED:
            verdict, note = "bad", "crashed (signal or exit >= 128): counted as bad"
        else:  # 2 (a usage error), 3-124, 130: the run says nothing about the code under test
            verdict, note = "stop", NO_VERDICT.get(rc, NO_VERDICT[None])
        log.write(f"\n# result: rc={rc} verdict={verdict} seconds={seconds:.2f} {note}\n".encode())
    step = Step(run_no, phase, commit, ref.label, rc, verdict, round(seconds, 3), str(log_path), note)
    with open(sd / "steps.jsonl", "a") as f:
        f.write(json.dumps(asdict(step)) + "\n")
    return step


def read_steps(state_dir: Path) -> list[Step]:
    p = Path(state_dir) / "steps.jsonl"
    if not p.exists():
        return []
    return [Step(**json.loads(line)) for line in p.read_text().splitlines() if line.strip()]


def describe(state: dict, commit: str) -> PatchRef:
    info = state["series"].get(commit)
    if info:
        return PatchRef(commit=commit, **info)
    if commit == state.get("upstream"):
        return PatchRef(commit, 0, state["total"], UPSTREAM_BRANCH, "pristine upstream")
    return PatchRef(commit, 0, state["total"], commit[:12], "")


def estimate(state: dict, steps: list[Step], runs_left: int) -> str:
    if not steps or runs_left <= 0:
        return ""
    first = steps[0].seconds
    return f"; about {runs_left} more run(s) after this, ~{_fmt_s(first * runs_left)} at {_fmt_s(first)} per run (the first run)"


def _fmt_s(s: float) -> str:
    if s < 90:
        return f"{s:.0f}s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"
