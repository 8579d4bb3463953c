"""The driver: ``sglpatch bisect``'s ``run``. It checks the workdir (on patched, clean, no bisect
in progress) and CMD, writes the state the step runner reads, runs the triage here and ``git
bisect run`` in a thread, reads the verdict back, and whatever happens (CMD hangs, Ctrl-C,
SIGTERM, SIGHUP, an error) leaves DIR on branch ``patched``, clean, with no bisect in progress."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from sglpatch import exitcodes, proctree
from sglpatch.bisect.command import describe, estimate, read_steps, run_cmd, say, stopped
from sglpatch.bisect.model import BisectError, BisectResult, Step, log2_steps, run_bound
from sglpatch.bisect.report import format_report, write_log
from sglpatch.bisect.step import raise_interrupt, restore_tracked
from sglpatch.errors import SglpatchError
from sglpatch.fsutil import clean_stale_tmp, tmp_prefix
from sglpatch.gitcmd import Git, last_line, validate_ref
from sglpatch.project import Project, find_project
from sglpatch.series import parse_dep3, slug
from sglpatch.workdir import PATCHED_BRANCH, UPSTREAM_BRANCH, Workdir, edits, line_opt, open_workdir


def _series_map(git: Git, project_root: Path | None) -> tuple[dict[str, dict], str | None, int]:
    """commit -> {index, total, name, subject, description} for upstream..patched."""
    base, head = git.rev(UPSTREAM_BRANCH), git.rev(PATCHED_BRANCH)
    if not base or not head:
        raise BisectError(f"{git.workdir} has no {UPSTREAM_BRANCH}/{PATCHED_BRANCH} branches; run `sglpatch apply --workdir {git.workdir}` first")
    commits = git.commits(base, head)
    entries = None
    if project_root is not None:
        try:
            project = Project.load(project_root)
            entries = list(zip(project.series.entries, project.patches))
        except SglpatchError:
            entries = None
    result: dict[str, dict] = {}
    for i, c in enumerate(commits):
        message = git.run("log", "-1", "--format=%B", c)
        lines = message.splitlines()
        subject = lines[0] if lines else ""
        description = parse_dep3(lines[1:]).get("Description", "")
        name = f"{i + 1:04d}-{slug(subject)}.patch"
        if entries is not None and len(entries) == len(commits) and entries[i][1].subject == subject:
            name = entries[i][0].name
            description = description or entries[i][1].description
        result[c] = {"index": i + 1, "total": len(commits), "name": name, "subject": subject, "description": description}
    return result, base, len(commits)


def _git_path(git: Git, name: str) -> Path:
    p = Path(git.run("rev-parse", "--git-path", name))
    return p if p.is_absolute() else git.workdir / p


def _bisecting(git: Git) -> bool:
    return _git_path(git, "BISECT_START").exists()


def _guard(git: Git) -> None:
    if _bisecting(git):
        raise BisectError(f"a git bisect is already in progress in {git.workdir}; finish it or run `git -C {git.workdir} bisect reset`, then re-run")
    branch = git.current_branch()  # refused first, before anything in DIR is touched
    if branch != PATCHED_BRANCH:
        raise BisectError(f"{git.workdir} is on {branch or 'a detached HEAD'}, not {PATCHED_BRANCH}; `git -C {git.workdir} checkout {PATCHED_BRANCH}` and re-run")
    dirty = edits(git, put_back=True)[0]
    if dirty:
        shown = ", ".join(dirty[:3]) + (f" and {len(dirty) - 3} more" if len(dirty) > 3 else "")
        raise BisectError(
            f"{git.workdir} has uncommitted changes ({shown}); commit them on {PATCHED_BRANCH} and `sglpatch export`, or `git stash` them, then re-run"
        )


def _resolve(git: Git, ref: str, what: str) -> str:
    validate_ref(ref, what)
    sha = git.rev(ref)
    if not sha:
        raise BisectError(f"--{what} {ref}: no such commit in {git.workdir}")
    return sha


def _find_cmd(cmd: list[str], cwd: Path, env: dict) -> None:
    if not cmd:
        raise BisectError("no command given; usage: sglpatch bisect [options] -- CMD [ARGS...]")
    exe = cmd[0]
    if "/" in exe:
        p = Path(exe) if Path(exe).is_absolute() else cwd / exe
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise BisectError(f"command {exe!r} is not an executable file (relative to {cwd})")
    elif shutil.which(exe, path=env.get("PATH")) is None:
        raise BisectError(f"command {exe!r} not found on PATH")


def _check_install(git: Git, err) -> None:
    """Warn when the Python the workdir was installed into (apply's record) does not import sglang from
    the workdir's tree (the steps would all test one tree), or when no install is recorded."""
    from sglpatch.pythonenv import install

    try:
        python = install.recorded(git.workdir)
    except SglpatchError:
        python = None
    fix = f"`sglpatch apply{line_opt(git.workdir)} --workdir {git.workdir} --python PY` installs it editable into PY"
    if not python:
        say(err, f"note: no Python has {git.workdir} installed (apply records it); if CMD imports sglang, {fix}")
        return
    if not install.serves_from(python, git.workdir):
        say(err, f"warning: {python} (the Python apply installed {git.workdir} into) does not import sglang from "
                 f"{git.workdir / 'python'} now: a CMD using it would not test each step's tree; {fix}")


def _restore(git: Git) -> str | None:
    """Back to branch patched, no bisect in progress. Returns a problem, or None."""
    problems = []
    if _bisecting(git):
        rc, _, e = git.run("bisect", "reset", PATCHED_BRANCH, check=False)
        if rc != 0:
            problems.append(f"git bisect reset failed: {last_line(e, str(rc))}")
    if git.current_branch() != PATCHED_BRANCH:
        rc, _, e = git.run("checkout", "-q", PATCHED_BRANCH, check=False)
        if rc != 0:
            problems.append(f"git checkout {PATCHED_BRANCH} failed: {last_line(e, str(rc))}")
    if problems:
        return "; ".join(problems) + f"; run `git -C {git.workdir} bisect reset && git -C {git.workdir} checkout {PATCHED_BRANCH}`"
    return None


def _tail(paths_sinks, positions) -> None:
    for i, (path, sink) in enumerate(paths_sinks):
        try:
            with open(path, "rb") as f:
                f.seek(positions[i])
                data = f.read()
        except FileNotFoundError:
            continue
        if data:
            positions[i] += len(data)
            try:
                sink.write(data)
                sink.flush()
            except (OSError, ValueError):
                pass


def _kill_current(sd: Path) -> None:
    try:
        pgid = int((sd / "current-pgid").read_text())
    except (FileNotFoundError, ValueError):
        return
    proctree.kill_group(pgid, grace=2.0)


def run(
    workdir: Path,
    cmd: list[str],
    good: str = UPSTREAM_BRANCH,
    bad: str = PATCHED_BRANCH,
    timeout: float | None = None,
    triage: bool = False,
    on_timeout: str = "bad",
    project_root: Path | None = None,
    log_dir: Path | None = None,
    out=None,
    err=None,
) -> BisectResult:
    """Find the first bad patch; always leaves DIR on patched, clean, no bisect in progress."""

    out = out or sys.stdout.buffer
    err = err or sys.stderr.buffer
    if timeout is not None and not (timeout > 0):
        raise BisectError(f"--timeout {timeout}: must be a positive number of seconds")
    if on_timeout not in ("bad", "skip"):
        raise BisectError(f"--on-timeout {on_timeout!r}: use bad or skip")
    cwd = Path.cwd()
    cmd = list(cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    _find_cmd(cmd, cwd, dict(os.environ))
    git = open_workdir(Path(workdir).expanduser().resolve(), create=False)
    if project_root is None:
        try:
            project_root = find_project()
        except SglpatchError:
            project_root = None
    with Workdir(git.workdir).hold(git):
        _guard(git)
        good_sha, bad_sha = _resolve(git, good, "good"), _resolve(git, bad, "bad")
        if good_sha == bad_sha:
            raise BisectError(f"--good {good} and --bad {bad} are the same commit; nothing to bisect")
        rc, _, _ = git.run("merge-base", "--is-ancestor", good_sha, bad_sha, check=False)
        if rc != 0:
            raise BisectError(f"--good {good} is not an ancestor of --bad {bad}; pick a GOOD below BAD")
        series, upstream_sha, total = _series_map(git, project_root)
        n = len(git.commits(good_sha, bad_sha))
        bound = run_bound(n)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        log_dir = Path(log_dir).expanduser().resolve() if log_dir else git.workdir / ".git" / "sglpatch-bisect" / stamp
        log_dir.mkdir(parents=True, exist_ok=True)
        clean_stale_tmp()  # a killed bisect's state (its environment, tokens included) goes first
        sd = Path(tempfile.mkdtemp(prefix=tmp_prefix("bisect")))  # 0700: holds the user's environment
        state = {
            "workdir": str(git.workdir),
            "cwd": str(cwd),
            "cmd": cmd,
            "env": dict(os.environ),
            "timeout": timeout,
            "on_timeout": on_timeout,
            "state_dir": str(sd),
            "log_dir": str(log_dir),
            "series": series,
            "upstream": upstream_sha,
            "total": total,
            "bound": bound,
            "budget": bound,
        }
        state_file = sd / "state.json"
        fd = os.open(state_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f)

        _check_install(git, err)
        say(err, f"{n} commit(s) in {good}..{bad}; at most {bound} runs of CMD; logs in {log_dir}")
        old_handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                old_handlers[sig] = signal.signal(sig, raise_interrupt)
            except ValueError:  # not the main thread: leave signals alone
                pass
        holder: dict = {}  # _drive puts the git-bisect-run thread here as soon as it starts
        interrupted = False
        result: BisectResult | None = None
        steps: list[Step] = []
        problem: str | None = None
        try:
            result = _drive(git, state, state_file, good_sha, bad_sha, n, triage, out, err, holder)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            for sig in old_handlers:
                signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
            try:
                # (a done-Event, not Thread.is_alive(): a join() cut by Ctrl-C marks a live thread stopped)
                done = holder.get("done")
                running = done is not None and not done.is_set()
                if running or (sd / "current-pgid").exists():
                    (sd / "stop").touch()  # the step runner aborts git bisect run (exit 255)
                    deadline = time.monotonic() + 60
                    while running and not done.is_set() and time.monotonic() < deadline:
                        _kill_current(sd)
                        done.wait(timeout=0.2)
                    _kill_current(sd)
                steps = read_steps(sd)
                if running and not done.is_set():
                    problem = f"git bisect run did not stop within 60s; once it has, run `git -C {git.workdir} bisect reset`"
                else:
                    problem = _restore(git)
                write_log(log_dir, steps, result)
            finally:
                for sig, h in old_handlers.items():
                    signal.signal(sig, h)
                shutil.rmtree(sd, ignore_errors=True)
                if problem:
                    say(err, f"could not restore {git.workdir}: {problem}")
        if problem:
            raise BisectError(f"could not restore {git.workdir}: {problem}")
        if interrupted or result is None:
            raise BisectError(
                f"interrupted after {len(steps)} run(s) of CMD; {git.workdir} is back on {PATCHED_BRANCH}, clean; step logs in {log_dir}",
                exit_code=exitcodes.INTERRUPTED,
            )
        result.log_dir = log_dir
        (log_dir / "report.txt").write_text("\n".join(format_report(result)) + "\n")
        return result


def _drive(git, state, state_file, good_sha, bad_sha, n, triage, out, err, holder):
    sd = Path(state["state_dir"])
    bound = state["bound"]
    steps: list[Step] = []
    if triage:
        for phase_ref, sha in (("GOOD", good_sha), ("BAD", bad_sha)):
            git.run("checkout", "-q", "--detach", sha)
            ref = describe(state, sha)
            run_no = len(steps) + 1
            est = estimate(state, steps, (1 if run_no == 1 else 0) + log2_steps(n))
            say(err, f"run {run_no} (at most {bound}): triage on {phase_ref} = {ref.label}{est}")
            step = run_cmd(state, sha, ref, run_no, "triage", out, err)
            say(err, f"run {run_no}: {ref.label}: {step.outcome()}")
            steps.append(step)
            restore_tracked(git, err)
            if step.verdict == "stop":
                raise stopped(step, len(steps))
        git.run("checkout", "-q", PATCHED_BRANCH)
        g, b = steps[0].verdict, steps[1].verdict
        codes = f" (exit codes: {steps[0].code().removeprefix('exit ')} on GOOD, {steps[1].code().removeprefix('exit ')} on BAD)"
        if g == "skip" or b == "skip":  # no verdict from a step that could not run
            return _cannot_run(steps, n, bound) or _result(
                "inconclusive", f"cannot triage: CMD could not run (exit 125) on {steps[0 if g == 'skip' else 1].label}",
                n, bound, steps)
        if g == "bad":
            tail = " (and on the full stack)" if b == "bad" else "; the full stack passes (the series masks or fixes it)"
            return _result("upstream", f"regression is upstream: CMD fails on {steps[0].label} without our patches{tail}{codes}",
                           n, bound, steps)
        if b == "good":
            return _result("no-regression", f"no regression: CMD passes on upstream and on the full stack{codes}", n, bound, steps)
        say(err, f"regression is in the series{codes}: bisecting")
        state["budget"] = bound - len(steps)
        state_file.write_text(json.dumps(state))

    # git bisect start BAD GOOD: the endpoints are given (tested by the triage, or taken on trust)
    git.run("bisect", "start", bad_sha, good_sha, "--")
    cands = _candidates(git)
    git_out = ""
    if len(cands) > 1:
        box: dict = {}
        done = threading.Event()

        def target():
            try:
                box["res"] = git.run("bisect", "run", sys.executable, "-m", "sglpatch.bisect", "--step", str(state_file), check=False)
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                box["exc"] = e
            finally:
                done.set()

        holder["done"] = done
        threading.Thread(target=target, name="git-bisect-run", daemon=True).start()
        sinks = [(sd / "live.out", out), (sd / "live.err", err)]
        positions = [0, 0]
        # poll with sleep: Ctrl-C must not land inside Thread.join (it would mark the thread stopped)
        while not done.is_set():
            time.sleep(0.1)
            _tail(sinks, positions)
        _tail(sinks, positions)
        if "exc" in box:
            raise box["exc"]
        _rc, o, e = box["res"]
        git_out = o + e
        (Path(state["log_dir"]) / "git-bisect-run.log").write_text(git_out)
        if (sd / "step-error").exists():
            raise BisectError(f"the step runner failed: {(sd / 'step-error').read_text().strip()}")
    steps = read_steps(sd)
    if (sd / "cmd-stop").exists():
        raise stopped(steps[-1], len(steps))
    log_text = git.run("bisect", "log", check=False)[1]
    (Path(state["log_dir"]) / "bisect.log").write_text(log_text)
    cands = _candidates(git)
    skipped = set(git.run("for-each-ref", "--format=%(objectname)", "refs/bisect/skip-*").split())
    refs = [describe(state, c) for c in cands]
    if len(cands) == 1:
        first = refs[0]
        msg = f"first bad patch: {first.label}: {first.subject}" if first.index else f"first bad commit: {first.label}"
        if not triage:
            msg += " (taking GOOD as good and BAD as bad without running them; --triage checks both)"
        res = _result("found", msg, n, state["bound"], steps)
        res.first_bad = first
        return res
    if (gone := _cannot_run(steps, n, state["bound"])) is not None:
        return gone
    untested = [c for c in cands[:-1] if c not in skipped]
    if (sd / "budget-exhausted").exists() and untested:
        why = f"run budget of {state['bound']} reached after skipped steps"
    elif not untested:
        why = "only skipped commits are left to test"
    else:
        raise BisectError(f"git bisect run stopped: {last_line(git_out, 'no reason given')}")
    res = _result("ambiguous" if not untested else "inconclusive", f"{why}; the first bad patch is one of {len(refs)}", n, state["bound"], steps)
    res.candidates = refs
    return res


def _candidates(git: Git) -> list[str]:
    """Commits that may still be the first bad one, oldest first (the known bad one last)."""
    goods = git.run("for-each-ref", "--format=%(objectname)", "refs/bisect/good-*").split()
    return git.run("rev-list", "--reverse", "refs/bisect/bad", "--not", *goods).split()


def _result(outcome, message, n, bound, steps) -> BisectResult:
    return BisectResult(outcome=outcome, message=message, n=n, bound=bound, runs=len(steps), steps=list(steps))


def _cannot_run(steps, n, bound) -> BisectResult | None:
    """CMD could not run at any step (exit 125, 126, 127): no conclusion at all, and the whole run says so (125)."""
    if not steps or any(s.verdict != "skip" or s.rc is None for s in steps):
        return None
    codes = "/".join(str(c) for c in sorted({s.rc for s in steps}))
    return _result("cannot-run", f"CMD could not run here: all {len(steps)} run(s) exited {codes} (125 cannot run here, "
                   f"126/127 not executable / not found): no verdict; see {steps[0].log}", n, bound, steps)
