"""Every command block of the README and the runbook (docs/on-the-box.md) runs as the user runs it,
on the user-environment layer (tests/userenv.py): a fresh clone, a scratch HOME with a serving
venv at ~/ml-env, PATH /usr/bin:/bin, the scripts' own .tool-venv. Each command's exit code and
key lines are checked (tests/docblocks.py); the blocks of one document run in order, in one
environment, as a reader goes through it. A block that drifts from the tool fails here."""

from __future__ import annotations

import subprocess

import pytest

from conftest import ROOT
from docblocks import commands, unmatched
from userenv import User

DOCS = ("README.md", "docs/on-the-box.md")
ALL = [c for d in DOCS if (ROOT / d).exists() for c in commands(ROOT, d)]
_USERS: dict = {}


@pytest.fixture(scope="module")
def user_for(tmp_path_factory):
    def get(doc: str) -> User:
        if doc not in _USERS:
            u = User(tmp_path_factory.mktemp(doc.replace("/", "-")))
            u.serving_venv("ml-env")
            _USERS[doc] = u
        return _USERS[doc]

    yield get
    _USERS.clear()


@pytest.mark.parametrize("cmd", ALL, ids=[c.id for c in ALL])
def test_the_block_runs_as_written(cmd, user_for):
    user = user_for(cmd.doc)
    proc = subprocess.run(["bash", "-c", cmd.cmd], cwd=user.clone, env=user.env(), stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    shown = f"$ {cmd.cmd}\n{proc.stdout[-4000:]}"
    assert proc.returncode == cmd.exit, f"{cmd.id}: exit {proc.returncode}, the block says {cmd.exit}\n{shown}"
    missing = unmatched(cmd.expect, proc.stdout, user.home)
    assert missing is None, f"{cmd.id}: no output line matches {missing!r} (after the lines before it)\n{shown}"
