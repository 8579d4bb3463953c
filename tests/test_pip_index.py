"""Which package index sglpatch reads (sglpatch.upstream.pkgindex.index_url), as `pip download`
does: PIP_INDEX_URL, else the index-url of a real pip.conf as a real pip reads it ([download] over
[global]; PIP_CONFIG_FILE's file, which `pip config get` does not see), else PyPI. The rest of the
suite gets the answer handed on in PIP_INDEX_URL (tests/conftest.py), so the lookup runs here."""

from __future__ import annotations

import os

import pytest

from sglpatch.upstream import pkgindex


@pytest.fixture
def asked(monkeypatch):
    """index_url() asked afresh (it answers once per process) with the given environment."""

    def ask(**env) -> str:
        for k in ("PIP_INDEX_URL", "PIP_CONFIG_FILE"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        pkgindex.index_url.cache_clear()
        return pkgindex.index_url()

    yield ask
    monkeypatch.undo()
    pkgindex.index_url.cache_clear()


def test_the_index_is_pips_own(tmp_path, asked):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = http://mirror.example:3141/root/simple/\n")
    assert asked(PIP_CONFIG_FILE=str(conf)) == "http://mirror.example:3141/root/simple"
    assert asked(PIP_CONFIG_FILE=str(conf), PIP_INDEX_URL="http://env.example/simple/") == "http://env.example/simple"
    assert asked(PIP_CONFIG_FILE=os.devnull) == "https://pypi.org/simple"
    conf.write_text("[global]\nindex-url = http://global.example/simple\n[download]\nindex-url = http://download.example/simple\n"
                    "[install]\nindex-url = http://install.example/simple\n")
    assert asked(PIP_CONFIG_FILE=str(conf)) == "http://download.example/simple"
    conf.write_text("[install]\nindex-url = http://install.example/simple\n")  # pip install's, not pip download's
    assert asked(PIP_CONFIG_FILE=str(conf)) == "https://pypi.org/simple"


def test_uv_is_handed_pip_installs_settings(tmp_path, monkeypatch):
    """sglpatch.pythonenv.pip_config reads the same settings as pip install does: [install] over
    [global], a PIP_* variable over both; extra indexes and find-links keep their order."""
    from sglpatch.pythonenv import pip_config

    path = tmp_path / "pip.conf"
    path.write_text("[global]\nindex-url = http://global.example/simple\n"
                    "extra-index-url = http://a.example/simple http://b.example/simple\n"
                    "[download]\nfind-links = /download-only\n[install]\nindex-url = http://install.example/simple\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(path))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", "/wheels")
    conf = {k: v for k, v in pip_config.config().items() if k != "constraint"}  # the machine's own files count too
    assert conf == {"index-url": ["http://install.example/simple"], "find-links": ["/wheels"],
                    "extra-index-url": ["http://a.example/simple", "http://b.example/simple"]}
    assert pip_config.uv_args()[:6] == ["--default-index", "http://install.example/simple", "--extra-index-url", "http://a.example/simple",
                                        "--extra-index-url", "http://b.example/simple"]


def test_an_index_with_credentials_is_named_without_them():
    """Issue 52: the index URL in a message keeps its user, never its password or token."""
    from sglpatch.errors import SglpatchError
    from sglpatch.upstream import pkgindex

    with pytest.raises(SglpatchError) as e:
        pkgindex.files_at("http://alice:s3cr3t@127.0.0.1:9/simple", "sglang")
    assert "s3cr3t" not in str(e.value) and "http://alice:****@127.0.0.1:9/simple" in str(e.value), str(e.value)
