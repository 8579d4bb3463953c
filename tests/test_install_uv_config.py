"""Issue 52: the editable install of the patched tree with uv (`apply --installer uv`, and `auto` where
uv is found) hands uv the user's pip configuration, as `apply --venv` does: uv reads no pip.conf and no
PIP_* variable, and the build's own requirements (setuptools) must come from the user's index. The
credential in the index URL is never shown.

sglpatch.pythonenv.install.install runs for real on a real git workdir; `uv` is a stand-in first on
PATH that logs its argv and succeeds (what is under test is what uv is handed; test_venv_pip_config.py
runs the real uv with the same translation)."""

from __future__ import annotations

import json
import subprocess
import sys

from sglpatch.pythonenv import install

SECRET = "s3cr3t"


def test_the_editable_install_gets_the_users_index_find_links_and_constraints(tmp_path, monkeypatch, capfd):
    wd = tmp_path / "fork"
    (wd / "python").mkdir(parents=True)
    (wd / "python" / "pyproject.toml").write_text("[project]\nname = 'sglang'\nversion = '0.5.9'\n")
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tree"]):
        subprocess.run(["git", *cmd], cwd=wd, check=True)
    log, bin_ = tmp_path / "uv-argv.jsonl", tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "uv").write_text(f"#!{sys.executable}\nimport json, sys\n"
                             f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    (bin_ / "uv").chmod(0o755)
    links, constraints = tmp_path / "links", tmp_path / "constraints.txt"
    links.mkdir()
    constraints.write_text("setuptools<99\n")
    index = f"https://alice:{SECRET}@pypi.example.invalid/simple"
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONSTRAINT", str(constraints))
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    said = install.install(wd, python=sys.executable, installer="uv", version="0.5.9")
    assert said == f"installed sglang editable from {wd.resolve() / 'python'} into {sys.executable}"
    argv = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(argv) == 1 and argv[0][:5] == ["pip", "install", "--python", sys.executable, "--no-deps"]
    a = argv[0]
    assert a[-2:] == ["-e", str(wd.resolve() / "python")]
    pairs = list(zip(a, a[1:]))
    assert ("--default-index", index) in pairs and ("--find-links", str(links)) in pairs
    assert ("--constraints", str(constraints)) in pairs
    err = capfd.readouterr().err
    assert "sglpatch: installing: " in err and SECRET not in err
