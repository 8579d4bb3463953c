"""Every path, module, option and environment variable that README.md and docs/*.md name exists
(issue 51): in the tree, in the tool's --help, in the patches or in the patched SGLang tree.

What counts as named is read from the Markdown's code (inline code and fenced blocks, parsed by
markdown-it-py): a path under one of the tree's top folders or a file name ending in .py/.sh/.toml;
a dotted `sglpatch.` module (an attribute after it must be defined there); an `SGLPATCH_*` or
`SGLANG_*` variable; an option in a command line that starts with `sglpatch CMD` or
`scripts/NAME.sh`.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from conftest import ROOT

DOCS = sorted(["README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))])
TOP = ("src", "scripts", "tests", "docs", "results", "targets", "deps", "lines", "resolutions", "patches", ".ci")
PLACEHOLDER = re.compile(r"[<>*{}$]|\.\.\.|/R\b|/N\b|RELEASE|VERSION|NAME")
PATH = re.compile(r"(?<![\w./~-])((?:%s)/[\w./*<>{}$-]*[\w/*>}.])" % "|".join(map(re.escape, TOP)))
OUTPUTS = re.compile(r"^(?:lines|resolutions)/\d")  # a line or its resolutions, as a rebase onto that release writes them
# faults the failure-mode tests plant, named in docs/failure-modes.md as such
PLANTED = {"patches/0003-a-fifo.patch", "patches/0099", "patches/sub", "sglpatch --dryrun"}
FILE = re.compile(r"(?<![\w./~-])([\w-]+(?:/[\w-]+)*\.(?:py|sh|toml))\b")
MODULE = re.compile(r"\bsglpatch(?:\.\w+)+(?![\w-])")
NOT_MODULES = ("lock", "json", "log", "toml", "txt")  # DIR/.git/sglpatch.lock is a file
VAR = re.compile(r"\b(?:SGLPATCH|SGLANG)_[A-Z0-9_]*[A-Z0-9]\b")
COMMAND = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(sglpatch|scripts/[\w-]+\.sh)((?:\s+\S+)*)")


def code_texts(doc: str) -> list[str]:
    """The text of every inline code span and every fenced or indented block of doc."""
    out = []
    for tok in MarkdownIt("commonmark").parse((ROOT / doc).read_text()):
        if tok.type in ("fence", "code_block"):
            out.append(tok.content)
        for child in tok.children or []:
            if child.type == "code_inline":
                out.append(child.content)
    return out


def _all_text(folders: tuple[str, ...]) -> str:
    parts = []
    for f in folders:
        base = ROOT / f
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file() and p.suffix in (".py", ".sh", ".patch", ".toml", "")]
        parts += [p.read_text(errors="replace") for p in files if "__pycache__" not in p.parts]
    return "\n".join(parts)


@functools.lru_cache(maxsize=None)
def code_corpus() -> str:
    return _all_text(("src", "scripts", "tests", ".ci", "patches", "lines", "targets", "deps", "tox.ini", "pyproject.toml"))


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT / "src" / Path(*parts)
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def module_missing(name: str) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        f = _module_file(parts[:n])
        if f is None:
            continue
        rest = parts[n:]
        if rest and not re.search(rf"^\s*(?:def|class)\s+{rest[0]}\b|^{rest[0]}\b\s*[:=]|^\s*{rest[0]}\s*=", f.read_text(), re.M):
            return f"{'.'.join(rest)} is not defined in {f.relative_to(ROOT)}"
        return None
    return "no such module"


@functools.lru_cache(maxsize=None)
def help_text(prog: str, sub: str | None) -> str:
    cmd = [sys.executable, "-m", "sglpatch.cli", *([sub] if sub else []), "--help"] if prog == "sglpatch" \
        else ["bash", str(ROOT / prog), "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    return proc.stdout + proc.stderr


def options_missing(line: str) -> list[str]:
    m = COMMAND.match(line.strip().removeprefix("$ "))
    if not m:
        return []
    words = re.split(r"\s+", m.group(2).strip()) if m.group(2).strip() else []
    sub = None
    if m.group(1) == "sglpatch" and words and re.fullmatch(r"[a-z-]+", words[0]):
        sub = words.pop(0)
    text = help_text(m.group(1), sub)
    missing = []
    for w in words:
        if w in ("--", "#", "|", "&&", ";", "||") or w.startswith("#"):
            break
        opt = w.split("=")[0]
        if re.fullmatch(r"--[a-z][a-z0-9-]*", opt) and not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text):
            missing.append(f"{m.group(1)}{' ' + sub if sub else ''} {opt}")
    return missing


def names(doc: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {"path": set(), "file": set(), "module": set(), "var": set(), "option": set()}
    for text in code_texts(doc):
        for p in PATH.findall(text):
            if PLACEHOLDER.search(p):
                continue
            p = p.rstrip("/.")
            if not PLACEHOLDER.search(p) and not OUTPUTS.match(p) and p not in PLANTED:
                found["path"].add(p)
        for f in FILE.findall(text):
            if not PLACEHOLDER.search(f) and "/" not in f:
                found["file"].add(f)
        found["module"].update(m for m in MODULE.findall(text) if m.rsplit(".", 1)[1] not in NOT_MODULES)
        found["var"].update(VAR.findall(text))
        for line in text.splitlines():
            found["option"].update(o for o in options_missing(line) if o not in PLANTED)
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_a_document_gives_exists(doc, patched_tree):
    n = names(doc)
    problems = [f"path {p}: not in the tree" for p in sorted(n["path"]) if not (ROOT / p).exists()]
    src_files = {p.name for p in (ROOT / "src").rglob("*.py")} | {p.name for p in ROOT.rglob("*.sh") if ".venv" not in p.parts} \
        | {p.name for p in (ROOT / "targets").glob("*.toml")} | {p.name for p in (ROOT / "deps").glob("*.toml")} \
        | {p.name for p in (ROOT / "tests").rglob("*.py")} | {"pyproject.toml", "setup.py", "conftest.py", "sitecustomize.py", "usercustomize.py"}
    known = src_files | {p.name for p in (patched_tree / "python").rglob("*.py")} | flashinfer_files()
    problems += [f"file {f}: no such file in src/, scripts/, tests/, SGLang's or flashinfer's tree, nor named by the code"
                 for f in sorted(n["file"]) if Path(f).name not in known and not re.search(rf"\b{re.escape(f)}\b", code_corpus())]
    problems += [f"module {m}: {why}" for m in sorted(n["module"]) if (why := module_missing(m))]
    corpus, tree = code_corpus(), sgl_text(patched_tree)
    problems += [f"variable {v}: read nowhere in the code, the patches or SGLang's tree" for v in sorted(n["var"])
                 if v not in corpus and v not in tree]
    problems += [f"option {o}: not in its --help" for o in sorted(n["option"])]
    assert not problems, f"{doc} names what does not exist:\n" + "\n".join(problems)


@functools.lru_cache(maxsize=None)
def flashinfer_files() -> set[str]:
    """The file names of the flashinfer the 0.5.23 test venv holds (flashinfer-python 0.7.2), if built."""
    from conftest import venv_0523

    py = venv_0523()
    if not py.exists():
        return set()
    out = subprocess.run([str(py), "-c", "import importlib.util as u; s = u.find_spec('flashinfer'); print(s.origin if s else '')"],
                         capture_output=True, text=True).stdout.strip()
    return {p.name for p in Path(out).parent.rglob("*.py")} if out else set()


@functools.lru_cache(maxsize=None)
def sgl_text(tree: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in (tree / "python" / "sglang").rglob("*.py"))


ROW = re.compile(r"^\|\s*`([\w/]+)/`\s*\|(.*)$")


def package_rows(doc: str) -> list[tuple[str, str]]:
    """(package folder, module file) of each `| `pkg/` | ... `file.py` ... |` row of a layout table."""
    out = []
    for line in (ROOT / doc).read_text().splitlines():
        if m := ROW.match(line):
            out += [(m.group(1), f) for f in re.findall(r"`([\w/]+\.py)`", m.group(2))]
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_a_layout_tables_modules_are_in_its_package(doc):
    """In a table row for a package (`kernel/` | `tier.py`, ...), each module is a file of that package."""
    src = ROOT / "src" / "sglpatch"
    missing = [f"{pkg}/{f}" for pkg, f in package_rows(doc)
               if not any((d / f).is_file() for d in [src / pkg, *src.rglob(pkg)] if d.is_dir())]
    assert not missing, f"{doc}: modules its layout table names that their package lacks: {missing}"


def test_the_checker_sees_a_missing_name_of_each_kind(tmp_path, monkeypatch):
    assert module_missing("sglpatch.gpu.shared.verdict") is None
    assert module_missing("sglpatch.gpu.shared.verdict.TABLE") is None
    assert module_missing("sglpatch.gpu.shared.verdict.NOPE") == "NOPE is not defined in src/sglpatch/gpu/shared/verdict.py"
    assert module_missing("sglpatch.gpu.shared.procs") == "procs is not defined in src/sglpatch/gpu/shared/__init__.py"
    assert options_missing("$ scripts/regress.sh --tier cpu --no-such-flag") == ["scripts/regress.sh --no-such-flag"]
    assert options_missing("sglpatch apply --workdir D -- --not-ours") == []
    assert options_missing("sglpatch regress --ab A,B") == []
    assert PATH.findall("see src/sglpatch/gpu/shared/procs.py and docs/x.md.") == ["src/sglpatch/gpu/shared/procs.py", "docs/x.md."]
    assert MODULE.findall("sglpatch.installed-python and sglpatch.gpu") == ["sglpatch.gpu"]
