"""Bisect: find the first bad patch of the stack with real ``git bisect run``.

    sglpatch bisect --workdir DIR [--good REF] [--bad REF] [--timeout SEC] [--triage] -- CMD [ARGS...]

How it works
* The workdir's ``sglang`` is installed editable (``pip install -e DIR/python``), so checking
  out a commit in DIR makes the imported sglang exactly that commit's tree. ``git bisect run``
  checks out each step; at every step it calls this module (``python -m sglpatch.bisect
  --step STATE``), which runs CMD, logs the step and hands git its verdict.
* CMD's exit status follows git's convention: 0 good, 125 skip, 1-127 bad. A CMD killed by a
  signal or exiting >= 128 (git would abort the bisect) counts as bad: a crash is a regression.
  A CMD that runs past ``--timeout`` has its whole process group killed and counts as bad (a
  hang is a regression) or, with ``--on-timeout skip``, as untestable.
* ``--triage`` first runs CMD on GOOD (pristine upstream) and BAD (the full stack): "regression
  is upstream", "no regression", or "regression is in the series" and then bisects, reusing the
  two results as git's endpoints (``git bisect start BAD GOOD``), so for n patches CMD runs at
  most ceil(log2(n+1)) + 2 times in all; skips can only stop the search early, never exceed it.
* CMD runs in the user's working directory with the user's environment plus
  ``SGLPATCH_BISECT_COMMIT`` (the commit under test) and ``SGLPATCH_BISECT_PATCH`` (the series
  name of the topmost patch in it, or ``upstream``), in its own process group, stdin closed; its
  stdout/stderr are shown live and kept in one log file per step.
* Whatever happens (CMD hangs, Ctrl-C, SIGTERM, SIGHUP, an error) DIR ends back on branch
  ``patched``, clean, with no bisect in progress.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglpatch import exitcodes, proctree
from sglpatch.errors import SglpatchError
from sglpatch.fsutil import exclusive
from sglpatch.gitcmd import Git, last_line, validate_ref
from sglpatch.series import parse_dep3, slug

UPSTREAM_BRANCH = "upstream"  # same names as sglpatch.upstream / sglpatch.stack
PATCHED_BRANCH = "patched"
ENV_COMMIT = "SGLPATCH_BISECT_COMMIT"
ENV_PATCH = "SGLPATCH_BISECT_PATCH"
KILL_GRACE_S = 5.0  # SIGTERM to the CMD's process group, then SIGKILL after this
SNAPSHOT_EVERY_S = 0.5  # how often the CMD's descendants are recorded while it runs
# git bisect run's CMD protocol: good, bad, skip ("cannot run here"), abort (git's own 255)
EXIT_GOOD, EXIT_BAD, EXIT_SKIP, EXIT_ABORT = exitcodes.OK, exitcodes.ERROR, exitcodes.CANNOT_RUN, 255
VERDICT_EXIT = {"good": EXIT_GOOD, "bad": EXIT_BAD, "skip": EXIT_SKIP}


class BisectError(SglpatchError):
    pass


# --------------------------------------------------------------------------------------
# data


@dataclass
class PatchRef:
    """A commit of the range, named as a series entry when it is one."""

    commit: str
    index: int  # 1-based position in upstream..patched; 0 when it is not a series commit
    total: int  # number of series commits (upstream..patched)
    name: str  # series name, or "upstream" / the short commit id
    subject: str
    description: str = ""

    @property
    def label(self) -> str:
        if self.index:
            return f"[{self.index}/{self.total}] {self.name}"
        return f"{self.name} ({self.commit[:12]})"


@dataclass
class Step:
    run: int  # 1-based count of CMD runs
    phase: str  # "triage" or "bisect"
    commit: str
    label: str
    rc: int | None  # CMD's exit status; None when it timed out; -N when killed by signal N
    verdict: str  # good / bad / skip
    seconds: float
    log: str
    note: str = ""

    def outcome(self) -> str:
        rc = "timeout" if self.rc is None else (f"signal {-self.rc}" if self.rc < 0 else f"exit {self.rc}")
        note = f" ({self.note})" if self.note else ""
        return f"{rc} -> {self.verdict}, {self.seconds:.1f}s{note}"

    def line(self) -> str:
        return f"{self.run:>3}  {self.phase:<6}  {self.label}  {self.outcome()}"


@dataclass
class BisectResult:
    outcome: str  # found | upstream | no-regression | ambiguous | inconclusive
    message: str
    n: int  # commits in good..bad
    bound: int  # ceil(log2(n+1)) + 2
    runs: int  # CMD runs made, triage included
    steps: list[Step] = field(default_factory=list)
    first_bad: PatchRef | None = None
    candidates: list[PatchRef] = field(default_factory=list)
    log_dir: Path | None = None

    @property
    def exit_code(self) -> int:
        """0 when a conclusion was reached, 1 when skips/timeouts left it open."""
        return exitcodes.OK if self.outcome in ("found", "upstream", "no-regression") else exitcodes.ERROR


def run_bound(n: int) -> int:
    """Most CMD runs for n patches, the two triage runs included."""
    return math.ceil(math.log2(n + 1)) + 2


def _log2_steps(candidates: int) -> int:
    return math.ceil(math.log2(candidates)) if candidates > 1 else 0


# --------------------------------------------------------------------------------------
# running CMD once (shared by the triage, in this process, and by the step runner under git)


def _say(stream, msg: str) -> None:
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
        else:
            verdict = "bad"
            if rc is not None and (rc < 0 or rc >= 128):
                note = "crashed (signal or exit >= 128): counted as bad"
        log.write(f"\n# result: rc={rc} verdict={verdict} seconds={seconds:.2f} {note}\n".encode())
    step = Step(run_no, phase, commit, ref.label, rc, verdict, round(seconds, 3), str(log_path), note)
    with open(sd / "steps.jsonl", "a") as f:
        f.write(json.dumps(asdict(step)) + "\n")
    return step


def _read_steps(state_dir: Path) -> list[Step]:
    p = Path(state_dir) / "steps.jsonl"
    if not p.exists():
        return []
    return [Step(**json.loads(line)) for line in p.read_text().splitlines() if line.strip()]


def _describe(state: dict, commit: str) -> PatchRef:
    info = state["series"].get(commit)
    if info:
        return PatchRef(commit=commit, **info)
    if commit == state.get("upstream"):
        return PatchRef(commit, 0, state["total"], UPSTREAM_BRANCH, "pristine upstream")
    return PatchRef(commit, 0, state["total"], commit[:12], "")


def _estimate(state: dict, steps: list[Step], runs_left: int) -> str:
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


# --------------------------------------------------------------------------------------
# the step runner git bisect run calls: python -m sglpatch.bisect --step STATE


def _step_main(state_file: str) -> int:
    state = json.loads(Path(state_file).read_text())
    sd = Path(state["state_dir"])
    with open(sd / "live.out", "ab", buffering=0) as out, open(sd / "live.err", "ab", buffering=0) as err:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise_interrupt)
        try:
            if (sd / "stop").exists():
                return EXIT_ABORT
            steps = _read_steps(sd)
            done_bisect = sum(1 for s in steps if s.phase == "bisect")
            if done_bisect >= state["budget"]:
                (sd / "budget-exhausted").write_text(str(len(steps)))
                _say(err, f"run budget reached ({len(steps)} runs, bound {state['bound']}): stopping with the candidates left")
                return EXIT_ABORT
            git = Git(state["workdir"])
            commit = git.head_commit() or ""
            ref = _describe(state, commit)
            goods = git.run("for-each-ref", "--format=%(objectname)", "refs/bisect/good-*").split()
            left = int(git.run("rev-list", "--count", "refs/bisect/bad", "--not", *goods))
            runs_left = min(_log2_steps(left) - 1, state["budget"] - done_bisect - 1)
            run_no = len(steps) + 1
            _say(err, f"run {run_no} (at most {state['bound']}): testing {ref.label} {commit[:12]}{_estimate(state, steps, runs_left)}")
            step = run_cmd(state, commit, ref, run_no, "bisect", out, err)
            _say(err, f"run {run_no}: {ref.label}: {step.outcome()}")
            _restore_tracked(git, err)
            if (sd / "stop").exists():
                return EXIT_ABORT
            return VERDICT_EXIT[step.verdict]
        except KeyboardInterrupt:
            return EXIT_ABORT
        except Exception as e:  # noqa: BLE001 - anything unexpected aborts git bisect run; sglpatch reports it
            (sd / "step-error").write_text(f"{type(e).__name__}: {e}")
            _say(err, f"step runner failed: {type(e).__name__}: {e}")
            return EXIT_ABORT


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _restore_tracked(git: Git, err) -> None:
    """CMD changed tracked files in DIR (e.g. a build rewrote _version.py): put them back."""
    dirty = git.dirty_files()
    if dirty:
        _say(err, f"CMD modified {len(dirty)} tracked file(s) in the workdir ({', '.join(dirty[:3])}); restoring them")
        git.run("reset", "-q", "--hard", "HEAD")


# --------------------------------------------------------------------------------------
# the driver


def _series_map(git: Git, project_root: Path | None) -> tuple[dict[str, dict], str | None, int]:
    """commit -> {index, total, name, subject, description} for upstream..patched."""
    base, head = git.rev(UPSTREAM_BRANCH), git.rev(PATCHED_BRANCH)
    if not base or not head:
        raise BisectError(f"{git.workdir} has no {UPSTREAM_BRANCH}/{PATCHED_BRANCH} branches; run `sglpatch apply --workdir {git.workdir}` first")
    commits = git.commits(base, head)
    entries = None
    if project_root is not None:
        try:
            from sglpatch.stack import Project

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
    dirty = git.dirty_files()
    if dirty:
        shown = ", ".join(dirty[:3]) + (f" and {len(dirty) - 3} more" if len(dirty) > 3 else "")
        raise BisectError(
            f"{git.workdir} has uncommitted changes ({shown}); commit them on {PATCHED_BRANCH} and `sglpatch export`, or `git stash` them, then re-run"
        )
    branch = git.current_branch()
    if branch != PATCHED_BRANCH:
        raise BisectError(f"{git.workdir} is on {branch or 'a detached HEAD'}, not {PATCHED_BRANCH}; `git -C {git.workdir} checkout {PATCHED_BRANCH}` and re-run")


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
    """Warn when this interpreter's sglang is not the workdir's editable tree (steps would all test one tree)."""
    code = "import importlib.util as u; s = u.find_spec('sglang'); print(s.origin if s and s.origin else '')"
    try:
        proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60, cwd="/")
        origin = proc.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return
    src = (git.workdir / "python").resolve()
    if not origin:
        _say(err, f"note: {sys.executable} does not import sglang; if CMD needs it, `sglpatch apply --workdir {git.workdir}` installs the workdir editable")
    elif not Path(origin).resolve().is_relative_to(src):
        _say(
            err,
            f"warning: {sys.executable} imports sglang from {Path(origin).parent}, not from {src}: a CMD using it would test "
            f"the same tree at every step; `sglpatch apply --workdir {git.workdir}` installs the workdir editable",
        )


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
    from sglpatch.stack import find_project, open_workdir

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
    with exclusive(git.workdir / ".git" / "sglpatch.lock", str(git.workdir)):
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
        sd = Path(tempfile.mkdtemp(prefix="sglpatch-bisect-"))  # 0700: holds the user's environment
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
        _say(err, f"{n} commit(s) in {good}..{bad}; at most {bound} runs of CMD; logs in {log_dir}")
        old_handlers = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                old_handlers[sig] = signal.signal(sig, _raise_interrupt)
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
                steps = _read_steps(sd)
                if running and not done.is_set():
                    problem = f"git bisect run did not stop within 60s; once it has, run `git -C {git.workdir} bisect reset`"
                else:
                    problem = _restore(git)
                _write_log(log_dir, steps, result)
            finally:
                for sig, h in old_handlers.items():
                    signal.signal(sig, h)
                shutil.rmtree(sd, ignore_errors=True)
                if problem:
                    _say(err, f"could not restore {git.workdir}: {problem}")
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
            ref = _describe(state, sha)
            run_no = len(steps) + 1
            est = _estimate(state, steps, (1 if run_no == 1 else 0) + _log2_steps(n))
            _say(err, f"run {run_no} (at most {bound}): triage on {phase_ref} = {ref.label}{est}")
            step = run_cmd(state, sha, ref, run_no, "triage", out, err)
            _say(err, f"run {run_no}: {ref.label}: {step.outcome()}")
            steps.append(step)
            _restore_tracked(git, err)
        git.run("checkout", "-q", PATCHED_BRANCH)
        g, b = steps[0].verdict, steps[1].verdict
        if g == "bad":
            tail = " (and on the full stack)" if b == "bad" else "; the full stack passes (the series masks or fixes it)"
            return _result("upstream", f"regression is upstream: CMD fails on {steps[0].label} without our patches{tail}", n, bound, steps)
        if g == "skip" or b == "skip":
            where = steps[0].label if g == "skip" else steps[1].label
            return _result("inconclusive", f"cannot triage: CMD skipped (exit 125) on {where}", n, bound, steps)
        if b == "good":
            return _result("no-regression", "no regression: CMD passes on upstream and on the full stack", n, bound, steps)
        _say(err, "regression is in the series: bisecting")
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
    steps = _read_steps(sd)
    log_text = git.run("bisect", "log", check=False)[1]
    (Path(state["log_dir"]) / "bisect.log").write_text(log_text)
    cands = _candidates(git)
    skipped = set(git.run("for-each-ref", "--format=%(objectname)", "refs/bisect/skip-*").split())
    refs = [_describe(state, c) for c in cands]
    if len(cands) == 1:
        first = refs[0]
        msg = f"first bad patch: {first.label}: {first.subject}" if first.index else f"first bad commit: {first.label}"
        if not triage:
            msg += " (taking GOOD as good and BAD as bad without running them; --triage checks both)"
        res = _result("found", msg, n, state["bound"], steps)
        res.first_bad = first
        return res
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


def _write_log(log_dir: Path, steps: list[Step], result: BisectResult | None) -> None:
    with open(log_dir / "steps.txt", "w") as f:
        f.write("run  phase   patch  exit -> verdict, seconds\n")
        f.writelines(s.line() + "\n" for s in steps)
    if result is not None:
        data = asdict(result)
        data["log_dir"] = str(log_dir)
        (log_dir / "report.json").write_text(json.dumps(data, indent=2) + "\n")


def format_report(result: BisectResult) -> list[str]:
    lines = ["steps (run, phase, patch, exit -> verdict, seconds):"]
    lines += [f"  {s.line()}" for s in result.steps] or ["  (none: the range has a single commit)"]
    lines.append(f"CMD runs: {result.runs} (bound for {result.n} patch(es): ceil(log2({result.n}+1)) + 2 = {result.bound})")
    lines.append(result.message)
    fb = result.first_bad
    if fb is not None:
        lines.append(f"  patch:       {fb.name}" + (f" (#{fb.index} of {fb.total})" if fb.index else ""))
        lines.append(f"  commit:      {fb.commit}")
        lines.append(f"  subject:     {fb.subject}")
        if fb.description:
            desc = fb.description.splitlines()
            lines.append(f"  description: {desc[0]}")
            lines += [f"               {d}" for d in desc[1:]]
    for c in result.candidates:
        lines.append(f"  candidate:   {c.label}: {c.subject}")
    if result.log_dir is not None:
        lines.append(f"logs: {result.log_dir}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--step":
        return _step_main(argv[1])
    print("usage: sglpatch bisect ... (this module's own entry point is for git bisect run)", file=sys.stderr)
    return EXIT_ABORT


if __name__ == "__main__":
    sys.exit(main())
