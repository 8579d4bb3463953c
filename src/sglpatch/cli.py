"""Command line: argument parsing and messages only (the work is done in sglpatch.stack,
project, upstream, install, rebase, bisect, and in the GPU suite sglpatch.gpu: regress, profile_report)."""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from sglpatch import __version__, exitcodes, install, newvenv, stack, upstream
from sglpatch.errors import SglpatchError
from sglpatch.lock import read_lock
from sglpatch.project import find_project
from sglpatch.workdir import PATCHED_BRANCH, UPSTREAM_BRANCH


def _positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def _add_workdir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", help="the fork's git workdir (default: $SGLANG_FORK_DIR or ~/sglang-fork)")
    p.add_argument("--project", help="project root holding series, patches/, upstream.lock (default: found from cwd)")


DESCRIPTION = """\
Keep a patched SGLang as a patch series (patch files, in order) on one pinned SGLang release. Build
the patched tree in a git workdir (default ~/sglang-fork) and install it into your Python;
write your commits there back to patches/; move the series onto a new release; find the
patch that broke something; regression-test on the GPUs.

Start with `scripts/apply.sh` (or `sglpatch apply`); `sglpatch COMMAND --help` shows a
command's options; README.md has the workflow."""


class _Help(argparse.HelpFormatter):
    """Wrapped help that shows an option's default, unless it is empty or the help says it;
    a text of several lines (the exit-code table) is shown as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line + "\n" for line in text.splitlines())
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglpatch", description=DESCRIPTION, epilog=exitcodes.epilog(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sglpatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # --- foundation (owner: core) ---------------------------------------
    # (apply / export / status / check / lock are added by _add_core)
    _add_core(sub)

    # --- profile-report (owner: P4 helper) --------------------------------
    _add_profile_report(sub)

    # --- regress (owner: regress helper) -----------------------------------
    _add_regress(sub)

    # --- doctor (owner: issue 20) ---------------------------------------------
    _add_doctor(sub)

    # --- bisect (owner: bisect helper) -------------------------------------
    _add_bisect(sub)

    # --- rebase (owner: rebase helper) -------------------------------------
    _add_rebase(sub)
    _add_watch(sub)
    for action in sub._choices_actions:  # every command: defaults shown, its summary on top, the exit codes below
        p = sub.choices[action.dest]
        p.formatter_class = _Help
        p.epilog = exitcodes.epilog()
        if p.description is None:
            p.description = action.help
    return parser


def _workdir(args) -> Path:
    return Path(args.workdir or os.environ.get("SGLANG_FORK_DIR") or Path.home() / "sglang-fork").expanduser().absolute()


def _project(args) -> Path:
    return Path(args.project).resolve() if getattr(args, "project", None) else find_project()


def _os_error(e: OSError) -> SglpatchError:
    """A full disk, a permission: one line, not a traceback."""
    hint = "free space and re-run" if e.errno == errno.ENOSPC else "fix that and re-run"
    return SglpatchError(f"{e.strerror or e}" + (f" ({e.filename})" if e.filename else "") + f"; {hint}")


def _cmd_apply(args) -> int:
    if (args.dry_run or args.release_artifact or args.cuda) and not args.venv:
        raise SglpatchError("--dry-run, --release-artifact and --cuda go with --venv DIR", exitcodes.USAGE)
    if args.venv and args.no_install:
        raise SglpatchError("--venv DIR installs into a new venv; --no-install contradicts it", exitcodes.USAGE)
    install.check_target(args.python, installs=not (args.venv or args.no_install))  # before any work
    try:
        project, workdir = _project(args), _workdir(args)
        prep = None
        if args.venv:
            base = args.python or sys.executable
            if not args.workdir:  # its own tree: the serving venv's editable install must not move under it
                workdir = workdir.with_name(f"{workdir.name}-{read_lock(project).version}")
            newvenv.guard_workdir(workdir, base)
            prep = newvenv.prepare(project, args.venv, base, args.installer, args.with_flashinfer, args.release_artifact, args.dry_run,
                                   cuda=args.cuda)
            if prep.refused:
                raise SglpatchError(f"preflight refused: {len(prep.refused)} condition(s) failed (the FAIL lines above); nothing was created")
            if args.dry_run:
                return 0
        if args.upstream_url:
            upstream.validate_url(args.upstream_url)
        source = args.source
        if source == "auto":
            lock = read_lock(project)
            ok, why = upstream.source_reachable(args.upstream_url or lock.url, lock.tag, timeout=args.probe_timeout)
            source = "git" if ok else "sdist"
            print(f"sglpatch: source: {source} ({why})", file=sys.stderr)
        result = stack.apply(
            project, workdir, source=source, force=args.force, python=args.python, url=args.upstream_url, sdist_fallback=args.source == "auto"
        )
        print(result.message)
        if prep:
            newvenv.create(prep, args.python or sys.executable)
            print(install.install(workdir, python=str(prep.python), installer=prep.plan.installer, version=read_lock(project).version))
            newvenv.mark_complete(prep)
            _venv_summary(prep, args)
        elif not args.no_install:
            print(install.install(workdir, python=args.python, installer=args.installer, version=read_lock(project).version))
            py = args.python or sys.executable
            print("\n".join(install.report(py, workdir, read_lock(project).version)))
        patches = stack.carried(project, workdir)
        print(f"{workdir} (branch patched) carries {len(patches)} patches:")
        for line in patches:
            print(f"  {line}")
        return 0
    except OSError as e:
        raise _os_error(e) from None


def _venv_summary(prep, args) -> None:
    py = str(prep.python)
    have = install.installed_sglang(py)
    print(f"{py} imports sglang {have[1]} from {have[0]}" if have else f"warning: {py} cannot import sglang (a GPU-only dependency may need CUDA: run `{py} -c \"import sglang\"` to see which)")
    print(f"new venv {prep.venv_dir}: {len(prep.plan.packages)} packages (the plan above; recorded in {prep.venv_dir}/sglpatch-plan*)")
    print(f"serve from it: {py} -m sglang.launch_server ...; the way back: your old interpreter ({args.python or sys.executable}) was not touched")


def _cmd_export(args) -> int:
    try:
        res = stack.export(_project(args), _workdir(args))
    except OSError as e:
        raise _os_error(e) from None
    total = len(res.written) + len(res.unchanged)
    print(
        f"exported {total} patches: {len(res.written)} written, {len(res.unchanged)} unchanged, "
        f"{len(res.removed)} removed; series {'updated' if res.series_changed else 'unchanged'}"
    )
    for name in res.written:
        print(f"  wrote   patches/{name}")
    for name in res.removed:
        print(f"  removed patches/{name}")
    return 0


def _cmd_status(args) -> int:
    print("\n".join(stack.status(_project(args), _workdir(args))))
    return 0


def _cmd_check(args) -> int:
    workdir = _workdir(args) if args.workdir else None
    problems = stack.check(_project(args), workdir, source=args.source)
    for p in problems:
        print(f"FAIL {p}")
    if problems:
        print(f"check: {len(problems)} problem(s)")
        return 1
    print("check: series, patches/, upstream.lock consistent; every patch applies exactly to the pinned tree")
    return 0


def _cmd_lock(args) -> int:
    project = _project(args)
    if args.resolve:
        print(upstream.resolve_commit(project))
    if args.update_blobs:
        blobs = stack.update_blobs(project, _workdir(args))
        print(f"upstream.lock: {len(blobs)} blob ids recorded")
    if not (args.resolve or args.update_blobs):
        print(read_lock(project).dumps(), end="")
    return 0


def _add_core(sub) -> None:
    p = sub.add_parser("apply", help="build branch patched in the workdir from upstream.lock + series, and install it")
    _add_workdir(p)
    p.add_argument(
        "--source",
        choices=["auto", "git", "sdist"],
        default="auto",
        help="where the upstream tree comes from; auto: git when upstream.url answers within --probe-timeout, "
        "else the registry sdist (also when the git tree fails a lock check)",
    )
    p.add_argument("--upstream-url", help="override upstream.url (a mirror); https, ssh or file URLs only")
    p.add_argument("--probe-timeout", type=float, default=8.0, help="seconds --source auto waits for the git URL")
    p.add_argument("--no-install", action="store_true", help="only build the tree: nothing is installed anywhere")
    p.add_argument("--python", help="interpreter to install into, a venv's (default: this one; refused when it is the system's, PEP 668)")
    p.add_argument("--installer", choices=["auto", "pip", "uv"], default="auto", help="auto: uv when found, else pip")
    p.add_argument("--force", action="store_true", help="rebuild even over unexported commits (kept as a backup ref)")
    p.add_argument(
        "--venv",
        metavar="DIR",
        help="build a NEW venv in DIR (must not exist or be empty) from --python with the release's full pinned dependency set "
        "(resolved by uv or pip) plus the patched tree, after a preflight (driver, Python wheels, disk, nvcc for P1); no other venv is touched; "
        "the tree goes to its own workdir (default: the usual one with -VERSION appended)",
    )
    p.add_argument("--dry-run", action="store_true", help="with --venv: print the preflight verdict and the resolved plan; change nothing")
    p.add_argument("--with-flashinfer", action="store_true", help="with --venv: P1 will be enabled (flashinfer >= 0.6.17; nvcc >= 12.9 on SM12x)")
    p.add_argument("--cuda", metavar="12.N", help="with --venv: the CUDA 12 builds of the release's CUDA-specific requirements (for a driver "
                   "below 580), from the indexes deps/cuda12.toml names; the plan shows each one's build and index, the preflight "
                   "refuses what has none (default: the release's own builds)")
    p.add_argument("--release-artifact", metavar="PATH", help="with --venv: the release's sdist or wheel to read the pins from (default: the locked sdist or wheel, index-verified)")
    p.set_defaults(func=_cmd_apply)

    p = sub.add_parser("export", help="write upstream..patched back to patches/ and series (byte-stable)")
    _add_workdir(p)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("status", help="pin, applied patches, dirty state")
    _add_workdir(p)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("check", help="series vs patches/ vs lock; every patch applies exactly (CI gate)")
    _add_workdir(p)
    p.add_argument(
        "--source", choices=["git", "sdist"], default="sdist", help="where the pinned upstream tree is taken from: the registry sdist, or git (upstream.url)"
    )
    p.set_defaults(func=_cmd_check)

    p = sub.add_parser("lock", help="show upstream.lock, resolve the full commit id, or refresh blob ids")
    _add_workdir(p)
    p.add_argument("--resolve", action="store_true", help="replace upstream.commit by the full id (git ls-remote)")
    p.add_argument("--update-blobs", action="store_true", help="record blob ids of the files the series touches")
    p.set_defaults(func=_cmd_lock)


def _add_profile_report(sub) -> None:
    def run(args) -> int:
        from sglpatch.gpu import profile_report

        return profile_report.run(args)

    p = sub.add_parser(
        "profile-report",
        help="summarize an EAGLE cycle profile (SGLANG_VERIFY_PROFILE_FILE, patch 0004)",
        description="Summarize a JSONL file written with SGLANG_VERIFY_PROFILE=1: time split of a "
        "speculative cycle, share spent in verify, break-even accept length against the baseline "
        "decode step, and predicted tok/s for given accept lengths.",
    )
    p.add_argument("file", help="JSONL file written by the server (SGLANG_VERIFY_PROFILE_FILE)")
    p.add_argument(
        "--accept-length",
        type=_positive,
        nargs="+",
        metavar="X",
        help="also predict tok/s at these accept lengths (tokens per cycle, bonus included)",
    )
    p.add_argument(
        "--baseline-step-ms",
        type=_positive,
        metavar="MS",
        help="decode step without speculation, ms (default: the file's value, 12.2 = 82 tok/s)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _add_regress(sub) -> None:
    from sglpatch.gpu import regress

    p = sub.add_parser(
        "regress",
        help="GPU regression suite: tiers cpu, kernel, server; writes report.json + report.md",
        description=regress.DESCRIPTION,
    )
    regress.add_arguments(p)
    p.set_defaults(func=lambda args: regress.run_args(args, ["sglpatch", "regress"]))


def _add_doctor(sub) -> None:
    from sglpatch.gpu import doctor

    p = sub.add_parser("doctor", help="check the box before a load: stale GPU processes, the serving Python, "
                       "NCCL settings, driver, P2P per GPU pair, free memory (run it first on a new box)",
                       description=doctor.DESCRIPTION)
    doctor.add_arguments(p)
    p.set_defaults(func=doctor.run_args)


def _add_bisect(sub) -> None:
    p = sub.add_parser(
        "bisect",
        help="find the first bad patch with git bisect run (CMD: 0 good, 125 skip, other bad)",
        description="Run CMD at each step of `git bisect run` over GOOD..BAD in the workdir (the editable "
        "install makes the imported sglang that step's tree) and name the first bad patch by its series "
        "name, subject and DEP-3 Description. CMD runs in the current directory with "
        "SGLPATCH_BISECT_COMMIT set. The workdir always ends back on branch patched, clean.",
    )
    _add_workdir(p)
    p.add_argument("--good", default=UPSTREAM_BRANCH, help=f"a commit where CMD passes (default: {UPSTREAM_BRANCH})")
    p.add_argument("--bad", default=PATCHED_BRANCH, help=f"a commit where CMD fails (default: {PATCHED_BRANCH})")
    p.add_argument("--timeout", type=_positive, metavar="SEC", help="per-run limit; CMD's process group is killed past it")
    p.add_argument(
        "--on-timeout", choices=["bad", "skip"], default="bad", help="what a run past --timeout counts as (default: bad, a hang is a regression)"
    )
    p.add_argument(
        "--triage", action="store_true", help="first run CMD on GOOD and BAD: regression upstream, in the series, or none"
    )
    p.add_argument("--log-dir", help="where step logs and the report go (default: <workdir>/.git/sglpatch-bisect/<UTC time>)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD [ARGS...]", help="the test command")

    def _run(args) -> int:
        from sglpatch import bisect

        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise SglpatchError("no command given; usage: sglpatch bisect [options] -- CMD [ARGS...]", exitcodes.USAGE)
        project = Path(args.project).resolve() if args.project else None
        result = bisect.run(
            _workdir(args), cmd, good=args.good, bad=args.bad, timeout=args.timeout, triage=args.triage,
            on_timeout=args.on_timeout, project_root=project, log_dir=args.log_dir,
        )
        sys.stderr.flush()
        print("\n".join(bisect.format_report(result)), flush=True)
        return result.exit_code

    p.set_defaults(func=_run)


def _add_rebase(sub) -> None:
    p = sub.add_parser(
        "rebase",
        help="move the series onto a new upstream release (classify, 3-way, resumable, recorded resolutions)",
        description="Move the series onto a new upstream release: classify every patch, merge 3-way, replay recorded "
        "resolutions, stop resumably at a conflict. --dry-run (the upstream watch) exits 0 when the rebase would "
        "need nobody (also for work it does unattended) and 3 when a human is needed.",
    )
    _add_workdir(p)
    p.add_argument("--onto", metavar="VERSION|TAG|COMMIT", help="target release: 0.5.10.post1, v0.5.10.post1, or a tagged commit (git)")
    _add_rebase_source(p)
    p.add_argument("--upstream-url", help="override upstream.url (a mirror); https, ssh or file URLs only")
    p.add_argument("--commit", help="the target's commit id when neither the sdist, a recorded pin nor the network says it")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="upstream watch: classify every patch, change nothing")
    mode.add_argument("--continue", dest="cont", action="store_true", help="go on after resolving a conflict in the workdir")
    mode.add_argument("--skip", action="store_true", help="drop the patch the rebase stopped at (recorded as a decision)")
    mode.add_argument("--abort", action="store_true", help="put the workdir and the project files back exactly as before")

    def run(args) -> int:
        from sglpatch import rebase

        try:
            return go(args, rebase)
        except rebase.RebaseStopped as e:
            print(str(e))
            return e.exit_code

    def go(args, rebase) -> int:
        if args.cont or args.skip or args.abort:
            if args.onto:
                raise SglpatchError("--onto goes with a new rebase, not with --continue/--skip/--abort", exitcodes.USAGE)
            if args.abort:
                lines = rebase.abort(_workdir(args))
            else:
                lines = rebase.continue_(_workdir(args), skip=args.skip)
            print("\n".join(lines))
            return 0
        if not args.onto:
            raise SglpatchError("--onto VERSION|TAG|COMMIT is required (or --continue / --skip / --abort)", exitcodes.USAGE)
        project = _project(args)
        if args.dry_run:
            wd = _workdir(args)
            res = rebase.dry_run(project, wd if wd.exists() else None, args.onto, source=args.source,
                                 commit=args.commit, url=args.upstream_url)
            print("\n".join(res.lines))
            return res.exit_code
        lines = rebase.start(project, _workdir(args), args.onto, source=args.source, commit=args.commit, url=args.upstream_url)
        print("\n".join(lines))
        return 0

    p.set_defaults(func=run)


def _add_rebase_source(p) -> None:
    p.add_argument(
        "--source", choices=["auto", "git", "sdist", "wheel"], default="sdist",
        help="where the new upstream tree comes from; auto: git when it answers, else the sdist, else the wheel (says which)",
    )


def _add_watch(sub) -> None:
    p = sub.add_parser(
        "watch",
        help="upstream watch over every release after the pin: per-patch status matrix and dependency pins",
        description="One row per release after the pin, one column per patch, and each release's dependency pins. "
        "Exit 0 when the newest release needs nothing or only unattended work, 3 when it needs a human.",
    )
    p.add_argument("--project", help="project root holding series, patches/, upstream.lock (default: found from cwd)")
    p.add_argument("--releases", metavar="A..B|A,B", help="only these releases: a range (inclusive; either side may be empty) or a comma-separated list")
    p.add_argument("--json", metavar="FILE", help="also write the matrix as JSON")
    p.add_argument("--markdown", metavar="FILE", help="also write a markdown report")
    p.add_argument("--jobs", type=int, metavar="N", help="classify releases in N processes (default: the CPUs, at most 4)")
    p.add_argument("--recheck", action="store_true", help="classify every release again, also those a run with the same "
                   "series, resolutions and sglpatch already classified (kept in the tree cache)")
    p.add_argument("--command-line", help=argparse.SUPPRESS)

    def run(args) -> int:
        from sglpatch import watch

        if args.jobs is not None and args.jobs < 1:
            raise SglpatchError("--jobs must be 1 or more", exitcodes.USAGE)
        return watch.main(_project(args), releases=args.releases, json_out=args.json, md_out=args.markdown,
                          command=args.command_line, jobs=args.jobs, recheck=args.recheck)

    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SglpatchError as e:
        print(f"sglpatch: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("sglpatch: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
