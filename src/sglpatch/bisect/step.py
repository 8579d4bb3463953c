"""The step runner ``git bisect run`` calls at every step: ``python -m sglpatch.bisect --step STATE``
(``__main__``). It runs CMD at the checked-out commit, logs the step and hands git its verdict;
anything unexpected, a stop asked by the driver, or the run budget spent aborts git bisect run."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from sglpatch.bisect.command import describe, estimate, read_steps, run_cmd, say
from sglpatch.bisect.model import EXIT_ABORT, VERDICT_EXIT, log2_steps
from sglpatch.gitcmd import Git


def step_main(state_file: str) -> int:
    state = json.loads(Path(state_file).read_text())
    sd = Path(state["state_dir"])
    with open(sd / "live.out", "ab", buffering=0) as out, open(sd / "live.err", "ab", buffering=0) as err:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, raise_interrupt)
        try:
            if (sd / "stop").exists():
                return EXIT_ABORT
            steps = read_steps(sd)
            done_bisect = sum(1 for s in steps if s.phase == "bisect")
            if done_bisect >= state["budget"]:
                (sd / "budget-exhausted").write_text(str(len(steps)))
                say(err, f"run budget reached ({len(steps)} runs, bound {state['bound']}): stopping with the candidates left")
                return EXIT_ABORT
            git = Git(state["workdir"])
            commit = git.head_commit() or ""
            ref = describe(state, commit)
            goods = git.run("for-each-ref", "--format=%(objectname)", "refs/bisect/good-*").split()
            left = int(git.run("rev-list", "--count", "refs/bisect/bad", "--not", *goods))
            runs_left = min(log2_steps(left) - 1, state["budget"] - done_bisect - 1)
            run_no = len(steps) + 1
            say(err, f"run {run_no} (at most {state['bound']}): testing {ref.label} {commit[:12]}{estimate(state, steps, runs_left)}")
            step = run_cmd(state, commit, ref, run_no, "bisect", out, err)
            say(err, f"run {run_no}: {ref.label}: {step.outcome()}")
            restore_tracked(git, err)
            if step.verdict == "stop":  # the driver reads it and stops with one line
                (sd / "cmd-stop").write_text(str(run_no))
            if (sd / "stop").exists():
                return EXIT_ABORT
            return VERDICT_EXIT[step.verdict]
        except KeyboardInterrupt:
            return EXIT_ABORT
        except Exception as e:  # noqa: BLE001 - anything unexpected aborts git bisect run; sglpatch reports it
            (sd / "step-error").write_text(f"{type(e).__name__}: {e}")
            say(err, f"step runner failed: {type(e).__name__}: {e}")
            return EXIT_ABORT


def raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def restore_tracked(git: Git, err) -> None:
    """CMD changed tracked files in DIR (e.g. a build rewrote _version.py): put them back."""
    dirty = git.dirty_files()
    if dirty:
        say(err, f"CMD modified {len(dirty)} tracked file(s) in the workdir ({', '.join(dirty[:3])}); restoring them")
        git.run("reset", "-q", "--hard", "HEAD")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--step":
        return step_main(argv[1])
    print("usage: sglpatch bisect ... (this module's own entry point is for git bisect run)", file=sys.stderr)
    return EXIT_ABORT
