"""`sglpatch apply`: build branch patched in the line's workdir and install it (the work is done in
sglpatch.stack.build, upstream, install and newvenv). It decides where the upstream tree comes from
(--source auto probes the git URL), names the --venv workdir, installs and prints the summary.
The modules that do the work are imported when apply runs: every sglpatch command builds this
parser, and a `sglpatch rebase` step (git bisect run, a script) need not load the Python
environment code (0.05 CPU-s of each start)."""

from __future__ import annotations

import sys

from sglpatch import cliargs, exitcodes
from sglpatch.argtypes import python_path
from sglpatch.errors import SglpatchError, say

NAME = "apply"
HELP = "build branch patched in the workdir from upstream.lock + series, and install it"
FLASHINFER_HELP = ("also install the flashinfer set of deps/flashinfer.toml for P1 and P5 (into --python, or into --venv's plan), "
                   "then pip check; into --python it then builds the JIT kernels that include flashinfer headers for sm_120 "
                   "(compile and link only); the JIT needs nvcc >= 12.8 on CUDA_HOME")
VENV_HELP = ("build a NEW venv in DIR (must not exist or be empty) from --python with the release's full pinned dependency set "
             "(resolved by uv or pip) plus the patched tree, after a preflight (driver, Python wheels, disk, nvcc for P1); "
             "no other venv is touched; the tree goes to its own workdir (default: the usual one with -VERSION appended)")


def register(p) -> None:
    """apply's options in --help's groups: which tree, the upstream tree, where it is installed, a new venv."""
    tree = p.add_argument_group("which tree")
    cliargs.add_workdir(tree)
    cliargs.add_line(tree)
    tree.add_argument("--force", action="store_true", help="rebuild even over unexported commits (kept as a backup ref)")
    up = p.add_argument_group("the upstream tree")
    cliargs.add_source(up, "auto", "what you serve is built from git when upstream.url answers within --probe-timeout, else "
                       "from the registry, also when the git tree fails a lock check")
    up.add_argument("--upstream-url", help="override upstream.url (a mirror); https, ssh or file URLs only")
    cliargs.add_timeout(up, "--probe-timeout", "how long --source auto waits for the git URL", default=8.0)
    inst = p.add_argument_group("where it is installed")
    inst.add_argument("--no-install", action="store_true", help="only build the tree: nothing is installed anywhere")
    inst.add_argument("--python", type=python_path, help="interpreter to install into, a venv's (default: this one; refused when it is the system's, PEP 668)")
    inst.add_argument("--installer", choices=["auto", "pip", "uv"], default="auto", help="auto: uv when found, else pip")
    inst.add_argument("--other-release", action="store_true", help="install into a --python that serves another SGLang release "
                      "(its dependencies stay that release's); refused without it: use --venv NEWDIR for a complete venv")
    inst.add_argument("--with-flashinfer", action="store_true", help=FLASHINFER_HELP)
    inst.add_argument("--recheck-jit", action="store_true", help="with --with-flashinfer: build the JIT kernels again, not the "
                      "verdict kept for this tree, flashinfer, nvcc and arch (also SGLPATCH_RECHECK_JIT=1)")
    inst.add_argument("--dry-run", action="store_true", help="with --venv: print the preflight verdict and the resolved plan; with "
                      "--with-flashinfer: print the flashinfer plan; change nothing")
    venv = p.add_argument_group("a new venv")
    venv.add_argument("--venv", metavar="DIR", help=VENV_HELP)
    venv.add_argument("--cuda", metavar="12.N", help="with --venv: the CUDA 12 builds of the release's CUDA-specific requirements "
                      "(for a driver below 580), from the indexes deps/cuda12.toml names; the plan shows each one's build and index, "
                      "the preflight refuses what has none (default: the release's own builds)")
    venv.add_argument("--release-artifact", metavar="PATH", help="with --venv: the release's sdist or wheel to read the pins from "
                      "(default: the locked sdist or wheel, index-verified)")


def run(args) -> int:
    from sglpatch import lineguard, linepath
    from sglpatch.pythonenv import flashinfer_set, install, new_venv as newvenv
    from sglpatch.stack import build, status
    from sglpatch.upstream import materialize as upstream

    if (args.release_artifact or args.cuda) and not args.venv:
        raise SglpatchError("--release-artifact and --cuda go with --venv DIR", exitcodes.USAGE)
    if args.dry_run and not (args.venv or args.with_flashinfer):
        raise SglpatchError("--dry-run goes with --venv DIR or --with-flashinfer", exitcodes.USAGE)
    if args.venv and args.no_install:
        raise SglpatchError("--venv DIR installs into a new venv; --no-install contradicts it", exitcodes.USAGE)
    if args.with_flashinfer and args.no_install:
        raise SglpatchError("--with-flashinfer installs flashinfer into the Python; --no-install contradicts it", exitcodes.USAGE)
    if args.recheck_jit and not args.with_flashinfer:
        raise SglpatchError("--recheck-jit goes with --with-flashinfer (the JIT check runs after the set is installed)", exitcodes.USAGE)
    install.check_target(args.python, installs=not (args.venv or args.no_install))  # before any work
    ctx = cliargs.ctx(args)
    line, project, workdir = ctx.line, ctx.project, ctx.workdir
    try:
        checkout = ctx.checkout.resolve()
        if workdir.resolve().is_relative_to(checkout):
            raise SglpatchError(f"--workdir {args.workdir or workdir} is inside the sglpatch checkout {checkout} (a git repository "
                                "inside it): pass a folder outside it, e.g. --workdir ~/sglang-fork; nothing was changed", exitcodes.USAGE)
        prep = fs = fplan = None
        if args.venv:
            base = ctx.python
            if not args.workdir and line.primary:  # its own tree: the serving venv's editable install must not move under it
                workdir = linepath.workdir_of(workdir, line.release)
            newvenv.guard_workdir(workdir, base)
            prep = newvenv.prepare(project, args.venv, base, args.installer, args.with_flashinfer, args.release_artifact, args.dry_run,
                                   cuda=args.cuda)
            if prep.refused:  # no driver here: 125, also when other conditions failed (the doctor's rule, the exit-code table)
                here = any(c.cannot_run for c in prep.refused)
                raise SglpatchError(f"preflight refused: {len(prep.refused)} condition(s) failed (the FAIL lines above); nothing was created"
                                    + (f"; no NVIDIA driver answers here: cannot run here (exit {exitcodes.CANNOT_RUN})" if here else ""),
                                    exitcodes.CANNOT_RUN if here else exitcodes.ERROR)
            # a new venv of base's CPython: a line's tree from another CPython's wheel takes this one's extensions
            args.compiled_for = lineguard.guard_wheel_python(base, line, ctx.opt)
            if args.dry_run:
                return 0
        elif not args.no_install:  # before any work: the serving Python keeps its release and can load the tree
            lineguard.guard_release(ctx.python, line, ctx.opt, args.other_release, workdir)
            args.compiled_for = lineguard.guard_wheel_python(ctx.python, line, ctx.opt)  # the cpXY to take extensions for
        if args.with_flashinfer and not args.venv:  # into --python: the set is read (and checked), and its plan shown, before any work
            fs = flashinfer_set.read(project)
            if args.dry_run:
                print("dry run: the tree is not built and nothing is installed")
                print("\n".join(flashinfer_set.install_into(ctx.python, fs, args.installer, dry_run=True)))
                return 0
            fplan = flashinfer_set.plan_first(ctx.python, fs)
        if args.upstream_url:
            upstream.validate_url(args.upstream_url)
        source = ctx.source(args.source, args.upstream_url, args.probe_timeout, built_in=workdir)
        print(f"sglpatch: {ctx.named()}, workdir {workdir}", file=sys.stderr, flush=True)

        def install_step(result) -> None:  # inside the workdir's lock: nothing moves the tree or clears its scratch meanwhile
            print(result.message)
            _install(args, ctx, workdir, prep, fs, fplan)

        build.apply(project, workdir, source=source, force=args.force, python=args.python, url=args.upstream_url,
                    sdist_fallback=args.source == "auto", then=install_step)
        patches = status.carried(project, workdir)
        print(f"{workdir} (branch patched, {ctx.named()}) carries {len(patches)} patches:")
        for p in patches:
            print(f"  {p}")
        if args.with_flashinfer and (prep or not args.no_install):  # the new venv's set too (--venv)
            _jit_check(str(prep.python) if prep else ctx.python, workdir, new_venv=prep is not None, recheck=args.recheck_jit)
        return 0
    except OSError as e:
        raise cliargs.os_error(e) from None


def _install(args, ctx, workdir, prep, fs, fplan) -> None:
    from sglpatch import lineguard
    from sglpatch.pythonenv import flashinfer_set, install, new_venv as newvenv
    from sglpatch.upstream.pin import read_lock

    lock = read_lock(ctx.project)
    if args.with_flashinfer:  # before anything is installed: the tree's own pins must admit the set
        _tree_agrees(workdir, prep.flashinfer if prep else fs)
    if prep:
        newvenv.create(prep, ctx.python)
        if getattr(args, "compiled_for", None):
            say(lineguard.compiled_for(workdir, ctx.line, args.compiled_for, str(prep.python)))
        print(install.install(workdir, python=str(prep.python), installer=prep.plan.installer, version=lock.version, lock=lock))
        if prep.flashinfer:
            print(flashinfer_set.verdict(str(prep.python), prep.flashinfer, prep.plan.installer))
        newvenv.mark_complete(prep)
        _venv_summary(prep, args)
    elif not args.no_install:
        if getattr(args, "compiled_for", None):  # the line's wheel is another CPython's: the release's own for this one
            say(lineguard.compiled_for(workdir, ctx.line, args.compiled_for, ctx.python))
        print(install.install(workdir, python=args.python, installer=args.installer, version=lock.version, lock=lock))
        py = ctx.python
        if args.with_flashinfer:
            print("\n".join(flashinfer_set.install_into(py, fs, args.installer, plan=fplan,
                                                   record=lambda cmd: flashinfer_set.record_way_back(workdir, cmd))))
        print("\n".join(install.report(py, workdir, lock.version, ctx.opt)))


def _jit_check(py: str, workdir, new_venv: bool = False, recheck: bool = False) -> None:
    """The JIT kernels that include flashinfer's headers, built in py for the target (sglpatch.pythonenv.jit_kernels):
    a line when they build or cannot be checked here; a kernel that does not build is the error,
    with the command that restores the flashinfer set this apply (or an earlier one) replaced. The
    verdict kept for the same tree, flashinfer, nvcc and arch is given again unless recheck."""
    from sglpatch.pythonenv import flashinfer_set, jit_kernels

    v = jit_kernels.run(py, recheck=recheck, on_build=lambda: say(
        f"jit-kernels: building the JIT kernels that include flashinfer headers in {py} for {jit_kernels.sm(jit_kernels.ARCH)} "
        "(compile and link only, no GPU; about 20 s each)"))
    if v.state == "fail":
        back = f"none needed, the new venv {py} is all it touched (delete it)" if new_venv else flashinfer_set.recorded_way_back(workdir)
        raise SglpatchError(v.line(back or ""))
    print(v.line())


def _tree_agrees(workdir, fs) -> None:
    from sglpatch.pythonenv import flashinfer_set

    bad = flashinfer_set.tree_conflicts(workdir, fs)
    if bad:
        raise SglpatchError(f"the patched tree's python/pyproject.toml pins {', '.join(bad)}: pip check would fail after "
                            "--with-flashinfer; the series must carry P5's pin change (deps/flashinfer.toml); nothing was installed")


def _venv_summary(prep, args) -> None:
    from sglpatch.pythonenv import install

    py = str(prep.python)
    have = install.installed_sglang(py)
    print(f"{py} imports sglang {have[1]} from {have[0]}" if have else f"warning: {py} cannot import sglang (a GPU-only dependency may need CUDA: run `{py} -c \"import sglang\"` to see which)")
    print(f"new venv {prep.venv_dir}: {len(prep.plan.packages)} packages (the plan above; recorded in {prep.venv_dir}/sglpatch-plan*)")
    print(f"serve from it: {py} -m sglang.launch_server ...; the way back: your old interpreter ({args.ctx.python}) was not touched")
