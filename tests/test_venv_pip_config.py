"""Issue 52: `apply --venv` with uv hands uv the user's pip configuration (uv reads no pip.conf and
no PIP_* variable): the index, extra indexes, find-links, constraints and no-index, in the
resolution (uv pip compile) and in the install (uv pip install -r pylock.toml), from the one
translation (sglpatch.pythonenv.pip_config.uv_args), and never an index credential in what is shown.

Real uv, through a stand-in `uv` first on PATH that logs its argv and execs the real one. The
user's index is a PEP 503 index on an http.server on 127.0.0.1 that answers only with a user and
password (alice:s3cr3t), holding sglpatch-fake-dep 1.0 and 2.0; a find-links folder holds a package
the index does not; a constraints file pins sglpatch-fake-dep==1.0 (the best version is 2.0). All of
it is set as pip is set: PIP_INDEX_URL, PIP_FIND_LINKS, PIP_CONSTRAINT (the machine's pip.conf left
out); uv's own default index is an empty folder, so uv finds nothing it is not handed.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_venv_preflight import env, fails, release, tmp_path, tool, wheel  # noqa: F401  (env, tmp_path: the fixtures)

from conftest import ROOT, run_cli, sglpatch
from sglpatch.pythonenv import pip_config

REAL_UV = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
pytestmark = pytest.mark.skipif(not Path(REAL_UV).exists(), reason="needs uv (requirements-test.txt installs it)")
SECRET = "s3cr3t"


@pytest.fixture
def pipconf(env):  # noqa: F811
    """The stand-in uv, the password-only index, the find-links folder and the constraints, as pip's configuration."""
    log = env["tmp"] / "uv-argv.jsonl"
    (env["fake"] / "uv").write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                                    f"with open({str(log)!r}, 'a') as f:\n    f.write(json.dumps(sys.argv[1:]) + '\\n')\n"
                                    f"os.execv({REAL_UV!r}, [{REAL_UV!r}, *sys.argv[1:]])\n")
    (env["fake"] / "uv").chmod(0o755)
    web = env["tmp"] / "web"
    for version in ("1.0", "2.0"):
        wheel(web / "simple" / "sglpatch-fake-dep", "sglpatch-fake-dep", version)
    page = "".join(f'<a href="{p.name}">{p.name}</a>\n' for p in sorted((web / "simple" / "sglpatch-fake-dep").glob("*.whl")))
    (web / "simple" / "sglpatch-fake-dep" / "index.html").write_text(page)
    (web / "simple" / "index.html").write_text('<a href="sglpatch-fake-dep/">sglpatch-fake-dep</a>\n')
    links = env["tmp"] / "links"
    wheel(links, "sglpatch-fake-links", "1.0")  # on the find-links folder only
    constraints = env["tmp"] / "constraints.txt"
    constraints.write_text("sglpatch-fake-dep==1.0\n")
    want = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()

    class Guarded(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **k):
            super().__init__(*a, directory=str(web), **k)

        def send_head(self):
            if self.headers.get("Authorization") != want:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="index"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            return super().send_head()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Guarded)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    index = f"http://alice:{SECRET}@127.0.0.1:{srv.server_port}/simple"
    env["env"].pop("UV_FIND_LINKS")  # uv's own settings name nothing: what it finds, it was handed
    env["env"].update(PIP_INDEX_URL=index, PIP_FIND_LINKS=str(links), PIP_CONSTRAINT=str(constraints),
                      UV_CACHE_DIR=str(env["tmp"] / "uv-cache"))
    tool(env["fake"], "nvidia-smi", "570.133.20, 12.0")
    yield dict(env, log=log, index=index, links=links, constraints=constraints)
    srv.shutdown()


def uv_calls(ctx, sub: str) -> list[list[str]]:
    """The argv of each `uv pip SUB` the tool ran."""
    calls = [json.loads(ln) for ln in ctx["log"].read_text().splitlines()] if ctx["log"].exists() else []
    return [c for c in calls if c[:2] == ["pip", sub]]


def dry_run(ctx, requires: list[str]) -> subprocess.CompletedProcess:
    art = release(ctx["tmp"], requires)
    args = ["apply", "--project", str(ctx["project"]), "--workdir", str(ctx["tmp"] / "fork"), "--venv", str(ctx["tmp"] / "new-venv"),
            "--dry-run", "--release-artifact", str(art), "--python", sys.executable, "--installer", "uv"]
    e = dict(os.environ, **ctx["env"])
    e.pop("CUDA_HOME", None)
    return run_cli(args, e, ROOT, 300)


def pairs(argv: list[str], opt: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == opt]


def test_the_resolution_gets_the_index_find_links_and_constraints(pipconf, project_copy):
    ctx = dict(pipconf, project=project_copy)
    proc = dry_run(ctx, ["sglpatch-fake-dep", "sglpatch-fake-links"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    (compile_,) = uv_calls(ctx, "compile")
    assert pairs(compile_, "--default-index") == [ctx["index"]]  # the real URL went to uv, with its credential
    assert pairs(compile_, "--find-links") == [str(ctx["links"])]
    assert pairs(compile_, "--constraints") == [str(ctx["constraints"])]
    assert "--no-index" not in compile_
    assert "  sglpatch-fake-dep==1.0 " in out and "sglpatch-fake-dep==2.0" not in out  # the constraint is obeyed
    assert "  sglpatch-fake-links==1.0 " in out  # from find-links
    shown = ctx["index"].replace(f":{SECRET}@", ":****@")
    (resolved,) = [ln for ln in proc.stdout.splitlines() if "resolved by: " in ln]
    assert f"--default-index {shown} " in resolved and f"--constraints {ctx['constraints']}" in resolved, resolved
    assert f"plan: packages from: index-url {shown}; find-links {ctx['links']}; constraint {ctx['constraints']} " in proc.stdout
    assert SECRET not in out


def test_a_failed_resolution_names_no_credential(pipconf, project_copy):
    """The constraint against the release's own pin: uv's refusal (it had the constraints), as the
    preflight's one line, without the password."""
    ctx = dict(pipconf, project=project_copy)
    proc = dry_run(ctx, ["sglpatch-fake-dep==2.0"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = fails(proc)
    assert line.startswith("preflight: FAIL python: ") and "sglpatch-fake-dep" in line, line
    assert "you require sglpatch-fake-dep==2.0 and sglpatch-fake-dep==1.0" in line, line  # uv had the constraints
    assert SECRET not in proc.stdout + proc.stderr


def test_no_index_wins_over_every_index_the_tools_too(pipconf, project_copy):
    """PIP_NO_INDEX: uv gets --no-index and no index at all, as pip ignores every index then, those on
    its command line included (the tool's --cuda / flashinfer indexes); find-links still count."""
    ctx = dict(pipconf, project=project_copy)
    ctx["env"]["PIP_NO_INDEX"] = "1"
    proc = dry_run(ctx, ["sglpatch-fake-links"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (compile_,) = uv_calls(ctx, "compile")
    assert "--no-index" in compile_ and not pairs(compile_, "--default-index") and not pairs(compile_, "--extra-index-url")
    assert pairs(compile_, "--find-links") == [str(ctx["links"])]
    assert f"plan: packages from: find-links {ctx['links']}; constraint {ctx['constraints']}; no-index (no index searched) (" in proc.stdout
    conf = {"index-url": ["https://u:p@mirror/simple"], "extra-index-url": ["https://extra/simple"], "find-links": ["/w"],
            "constraint": ["/c.txt"], "no-index": ["true"]}
    assert pip_config.uv_args(conf, ["https://cuda/cu126"]) == ["--find-links", "/w", "--constraints", "/c.txt", "--no-index",
                                                               "--index-strategy", "unsafe-best-match"]
    assert pip_config.describe(conf, ["https://cuda/cu126"]) == "find-links /w; constraint /c.txt; no-index (no index searched, not the tool's https://cuda/cu126 either)"
    conf["no-index"] = ["0"]
    assert pip_config.uv_args(conf, ["https://cuda/cu126"], constraints=False) == [
        "--default-index", "https://u:p@mirror/simple", "--extra-index-url", "https://cuda/cu126", "--extra-index-url", "https://extra/simple",
        "--find-links", "/w", "--index-strategy", "unsafe-best-match"]


def test_the_install_gets_them_too(pipconf, project_copy):
    """A real build: the install from the lock is handed the index (its credential: the lock's URLs
    carry none, and the index answers nothing without it) and find-links, not the constraints
    (uv refuses them with a pylock.toml; the lock obeyed them)."""
    ctx = dict(pipconf, project=project_copy)
    art = release(ctx["tmp"], ["sglpatch-fake-dep", "sglpatch-fake-links"])
    new = ctx["tmp"] / "new"
    e = dict(ctx["env"])
    e.pop("UV_DEFAULT_INDEX")
    e.pop("UV_CACHE_DIR")
    # the editable build of the patched tree is handed the same configuration: its setuptools comes from an
    # extra index beside the user's (the run's registry), as a user's public extra index serves it
    e["PIP_EXTRA_INDEX_URL"] = os.environ["PIP_INDEX_URL"]
    proc = sglpatch("apply", "--project", str(project_copy), "--workdir", str(ctx["tmp"] / "fork"), "--source", "sdist", "--venv", str(new),
                    "--release-artifact", str(art), "--python", sys.executable, "--installer", "uv", env=e)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    (install,) = [c for c in uv_calls(ctx, "install") if "-r" in c]
    assert pairs(install, "--default-index") == [ctx["index"]] and pairs(install, "--find-links") == [str(ctx["links"])], install
    assert "--constraints" not in install
    shown = ctx["index"].replace(f":{SECRET}@", ":****@")
    assert f"--default-index {shown} " in out and SECRET not in out
    assert SECRET not in (new / "sglpatch-plan.toml").read_text()
    listing = subprocess.run([REAL_UV, "pip", "list", "--format", "json", "--python", str(new / "bin" / "python")],
                             capture_output=True, text=True).stdout
    have = {p["name"]: p["version"] for p in json.loads(listing)}
    assert have["sglpatch-fake-dep"] == "1.0" and have["sglpatch-fake-links"] == "1.0", have  # the constraint, in the venv
