"""`sglpatch lock`: show upstream.lock, resolve its full commit id, or record the blob ids of the
files the series touches."""

from __future__ import annotations

from sglpatch import cliargs
from sglpatch.stack import status
from sglpatch.upstream import materialize as upstream
from sglpatch.upstream.pin import read_lock

NAME = "lock"
HELP = "show upstream.lock, resolve the full commit id, or refresh blob ids"


def register(p) -> None:
    cliargs.add_workdir(p)
    p.add_argument("--resolve", action="store_true", help="replace upstream.commit by the full id (git ls-remote)")
    p.add_argument("--update-blobs", action="store_true", help="record blob ids of the files the series touches")


def run(args) -> int:
    project = cliargs.project(args)
    if args.resolve:
        print(upstream.resolve_commit(project))
    if args.update_blobs:
        blobs = status.update_blobs(project, cliargs.workdir(args))
        print(f"upstream.lock: {len(blobs)} blob ids recorded")
    if not (args.resolve or args.update_blobs):
        print(read_lock(project).dumps(), end="")
    return 0
