"""`sglpatch rebase`: its arguments and run function; the rebase package (pyflakes, the classifier)
is imported only when the command runs."""

from __future__ import annotations

import argparse
import sys

from sglpatch import cliargs, exitcodes
from sglpatch.errors import SglpatchError

NAME = "rebase"
HELP = "move the series onto a new upstream release (classify, 3-way, resumable, recorded resolutions)"
DESCRIPTION = (
    "Move the series onto a new upstream release: classify every patch, merge 3-way, replay recorded "
    "resolutions, stop resumably at a conflict. --dry-run (the upstream watch) exits 0 when the rebase would "
    "need nobody (also for work it does unattended) and 3 when a human is needed. The result goes to "
    "lines/VERSION/ (--promote: over the primary series, patches/ and upstream.lock); without --workdir a real "
    "rebase works in the line's own workdir ($SGLANG_FORK_DIR or ~/sglang-fork, with -VERSION appended). "
    "--line R --dry-run classifies the line R's patches (lines/R/) instead of the primary's."
)


def register(p: argparse.ArgumentParser) -> None:
    cliargs.add_workdir(p)
    cliargs.add_line(p)
    p.add_argument("--onto", metavar="VERSION|TAG|COMMIT", help="target release: 0.5.10.post1, v0.5.10.post1, or a tagged commit (git)")
    cliargs.add_source(p, "registry", "a release move reads the release's own artifact; no network beyond the index")
    p.add_argument("--upstream-url", help="override upstream.url (a mirror); https, ssh or file URLs only")
    p.add_argument("--commit", help="the target's commit id when neither the sdist, a recorded pin nor the network says it")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="upstream watch: classify every patch, change nothing")
    mode.add_argument("--continue", dest="cont", action="store_true", help="go on after resolving a conflict in the workdir")
    mode.add_argument("--skip", action="store_true", help="drop the patch the rebase stopped at (recorded as a decision)")
    mode.add_argument("--abort", action="store_true", help="put the workdir and the project files back exactly as before")
    p.add_argument("--promote", action="store_true", help="write the result over the primary series, patches/ and upstream.lock "
                   "(default: the line folder lines/VERSION/; the primary is left as it is)")


def run(args) -> int:
    from sglpatch.rebase import outcome

    try:
        return _go(args)
    except outcome.RebaseStopped as e:
        print(str(e))
        return e.exit_code


def _go(args) -> int:
    from sglpatch.rebase import session, classify

    if args.cont or args.skip or args.abort:
        if args.onto or args.promote or args.line:
            raise SglpatchError("--onto, --promote and --line go with a new rebase, not with --continue/--skip/--abort "
                                "(those find the rebase in progress: --workdir DIR names it)", exitcodes.USAGE)
        if args.abort:
            lines = session.abort(_resuming(args), _here(args))
        else:
            lines = session.continue_(_resuming(args), skip=args.skip)
        print("\n".join(lines))
        return 0
    if not args.onto:
        raise SglpatchError("--onto VERSION|TAG|COMMIT is required (or --continue / --skip / --abort)", exitcodes.USAGE)
    ctx = cliargs.ctx(args)
    if args.dry_run:
        wd = ctx.workdir  # the line's own tree (its objects are borrowed read-only), never another line's
        print(f"sglpatch: rebase: {ctx.named()} ({ctx.line.where}), workdir {wd}", file=sys.stderr, flush=True)
        res = classify.dry_run(ctx.project, wd if wd.exists() else None, args.onto, source=_source(ctx, args),
                             commit=args.commit, url=args.upstream_url)
        print("\n".join(res.lines))
        return res.exit_code
    if not ctx.line.primary:
        raise SglpatchError(f"a rebase writes a new line from the primary series, not from the line {ctx.line.release}; nothing was "
                            f"changed: `sglpatch rebase --line {ctx.line.release} --onto {args.onto} --dry-run` classifies that line's "
                            "patches there", exitcodes.USAGE)
    wd = _workdir(args)
    print(f"sglpatch: rebase: {ctx.named()}, workdir {wd}", file=sys.stderr, flush=True)
    if not wd.exists() or (wd.is_dir() and not any(wd.iterdir())):  # a fresh box: the rebase starts from the primary series
        from sglpatch.stack import build

        print(f"sglpatch: rebase: {wd} is not set up yet: building the primary series there first (installs nothing)",
              file=sys.stderr, flush=True)
        build.apply(ctx.project, wd, source=ctx.source(args.source, args.upstream_url))
    lines = session.start(ctx.project, wd, args.onto, source=_source(ctx, args), commit=args.commit, url=args.upstream_url,
                         promote=args.promote)
    print("\n".join(lines))
    return 0


def _source(ctx, args) -> str:
    """--source for the target release: auto decided by the context (git, else the sdist, else a wheel);
    a commit or tag that names no release: only git has it."""
    from sglpatch.rebase.target import onto_release

    rel = onto_release(args.onto)
    if args.source != "auto":
        return ctx.source(args.source)
    return ctx.source("auto", args.upstream_url, onto=rel) if rel else "git"


def _here(args):
    """The project this abort runs in: --project, else the one around cwd, else None."""
    try:
        return cliargs.project(args)
    except SglpatchError:
        return None


def _workdir(args):
    """A real rebase moves its workdir to the new release: without --workdir it is the new line's own
    ($SGLANG_FORK_DIR or ~/sglang-fork, with -VERSION appended; sglpatch.lines), never the primary's
    tree, which a serving venv may import."""
    from sglpatch.rebase.target import VERSION_RE

    from sglpatch import linepath

    base = cliargs.workdir(args)
    m = VERSION_RE.match(args.onto)
    if args.workdir or not m:
        return base
    return linepath.workdir_of(base, m.group(1))


def _resuming(args):
    """--continue/--skip/--abort without --workdir: the default workdir, else the one line workdir
    beside it (base-VERSION) with a rebase in progress."""
    from sglpatch.workdir import REBASE_STATE_DIR

    base = cliargs.workdir(args)
    if args.workdir or (base / ".git" / REBASE_STATE_DIR).is_dir() or not base.parent.is_dir():
        return base
    from sglpatch import linepath

    busy = sorted(d for d in base.parent.glob(f"{base.name}-*") if linepath.release_of(base, d)
                  and (d / ".git" / REBASE_STATE_DIR).is_dir() and not d.is_symlink())
    return busy[0] if len(busy) == 1 else base
