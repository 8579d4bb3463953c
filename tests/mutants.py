"""Planted faults in each line's patches and in the tool, and the tests that must catch them (issues 18, 29).

    python tests/mutants.py [--line 0.5.23|0.5.9|tool|all] [--only ID[,ID...]] [--check] [--out results/mutants]

The faults are listed in tests/mutant_faults.py. For each mutant: copy the patched tree (a
patch line) or src/ (the tool), apply the fault (text edits that must each match exactly once),
run only the test files named for it, and record killed (a test failed) or SURVIVED. --check
only verifies that every mutant still applies to the current series and tool (what CI runs on
every push, through tests/test_port_0523.py). The 0.5.23 mutants run tests/real_0523/ in the
0.5.23 venv (SGLang 0.5.23's own modules); the 0.5.9 ones run tests/patches/ in the main venv
against the mutated tree (SGLPATCH_PATCHED_TREE); the tool's run its test files with the
mutated src/ first on PYTHONPATH (the CLI subprocesses the tests start inherit it).
Writes <out>/mutants.json and <out>/mutants.md (with --only: merged into the existing table).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutant_faults import BASE, MUTANTS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LINES = ("0.5.23", "0.5.9", "tool")


def plant(tree: Path, line: str, file: str, edits: list) -> None:
    path = tree / BASE[line] / file
    text = path.read_text()
    for old, new in edits:
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"mutants: error: {file}: {old.strip()[:60]!r} occurs {n} times (the code changed; update the mutant)")
        text = text.replace(old, new)
    path.write_text(text)


def check(line: str, tree: Path) -> list[str]:
    """Every mutant of line applies once to tree (the patched tree; the checkout for the tool): [] or the problems."""
    bad = []
    for m in MUTANTS[line]:
        path = tree / BASE[line] / m.file
        text = path.read_text() if path.is_file() else ""
        bad += [f"{m.id}: {m.file}: {old.strip()[:60]!r} occurs {text.count(old)} times" for old, _ in m.edits if text.count(old) != 1]
        bad += [f"{m.id}: no test file {t}" for t in m.tests if not (ROOT / t).is_file()]
    ids = [m.id for m in MUTANTS[line]]
    bad += [f"{i}: listed twice in line {line}" for i in sorted({i for i in ids if ids.count(i) > 1})]
    return bad


def pytest_cmd(line: str, tree: Path, tests: list[str]) -> tuple[list[str], dict]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    py = sys.executable
    if line == "0.5.23":
        py = os.environ.get("SGLPATCH_TEST_VENV_0523", str(ROOT / ".venv-0523")) + "/bin/python"
        env.update(PYTHONPATH=str(tree / "python"), SGLPATCH_REAL_0523=str(tree / "python"))
    elif line == "0.5.9":
        env.update(SGLPATCH_PATCHED_TREE=str(tree))
    else:
        env.update(PYTHONPATH=str(tree / "src"))
    # a basetemp of its own: a pytest that numbers its folder prunes the older numbered ones at its exit
    return [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore",
            "--basetemp", str(tree.parent / f"{tree.name}-pytest"), *tests], env


def build_tree(line: str, top: Path) -> Path:
    """The committed line's patched tree, as `sglpatch apply --line` builds it (the line and its tree
    resolved by sglpatch.context: lines/0.5.23/ on its pin, the primary on 0.5.9); src/ for the tool."""
    if line == "tool":
        shutil.copytree(ROOT / "src", top / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        return top
    sys.path.insert(0, str(ROOT / "src"))
    from conftest import copy_project

    from sglpatch import context
    from sglpatch.stack import build

    project = copy_project(top / "project")
    ctx = context.resolve(argparse.Namespace(project=str(project), line=None if line == "0.5.9" else line, workdir=str(top / "wd")))
    print(f"mutants: {ctx.named()} ({ctx.line.where}), tree {ctx.workdir}", file=sys.stderr, flush=True)
    build.apply(ctx.project, ctx.workdir, source="sdist")
    return ctx.workdir


def copy_tree(line: str, tree: Path, dest: Path) -> None:
    sub = "src" if line == "tool" else "python"
    shutil.copytree(tree / sub, dest / sub, symlinks=True)


def run_line(line: str, tmp: Path, only: set[str] | None) -> list[dict]:
    mutants = [m for m in MUTANTS[line] if not only or m.id in only]
    if not mutants:
        return []
    print(f"mutants: building the {line} tree", file=sys.stderr, flush=True)
    tree = build_tree(line, tmp / line)
    if bad := check(line, tree):
        raise SystemExit("mutants: error: " + "; ".join(bad))
    cmd, env = pytest_cmd(line, tree, sorted({t for m in mutants for t in m.tests}))
    base = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if base.returncode != 0:
        raise SystemExit(f"mutants: error: the {line} tests fail without a fault: {base.stdout.strip()[-500:]}")
    rows = []
    for m in mutants:
        mtree = tmp / f"m-{line}-{m.id}"
        copy_tree(line, tree, mtree)
        plant(mtree, line, m.file, m.edits)
        cmd, env = pytest_cmd(line, mtree, m.tests)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        failed = [ln.split(" - ")[0] for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
        row = dict(line=line, id=m.id, patch=m.area, kind=m.kind, fault=m.fault, file=BASE[line] + m.file, tests=m.tests,
                   killed=proc.returncode != 0, failed=failed[:3], seconds=round(time.monotonic() - t0, 1))
        print(f"mutants: {line} {m.id}: {'killed' if row['killed'] else 'SURVIVED'} ({row['seconds']} s)", file=sys.stderr, flush=True)
        rows.append(row)
        shutil.rmtree(mtree, ignore_errors=True)
    return rows


def write_table(rows: list[dict], out: Path, seconds: float, partial: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    order = {(line, m.id): i for i, (line, m) in enumerate((ln, m) for ln in LINES for m in MUTANTS[ln])}
    rows = sorted(rows, key=lambda r: order.get((r["line"], r["id"]), len(order)))
    (out / "mutants.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = ["# Planted faults (mutants) and the tests that catch them", "",
          "Rebuild: `scripts/mutants.sh` (all lines; `--line 0.5.23`, `--line 0.5.9` or `--line tool` for one; "
          "`--only ID,...` for some, merged into this table). The faults: `tests/mutant_faults.py`.", "",
          "| line | area | kind | mutant | fault | killed by | result |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['line']} | {r['patch']} | {r.get('kind', '')} | `{r['id']}` | {r['fault']} | {'<br>'.join(r['failed']) or '—'} | "
                  f"{'killed' if r['killed'] else '**SURVIVED**'} |")
    killed = sum(r["killed"] for r in rows)
    md += ["", f"{killed} of {len(rows)} killed. ERROR: the fault broke a fixture that runs the patched code (a kill as well).",
           "Kinds (issue 29): default = a rule tested only at default/convenient values; number = a number handed on; "
           "verdict = a verdict or advice sentence; ordering = events completing late or out of order; "
           "rule / name = a rule inverted or dropped, an upstream name misspelt (issue 18).",
           f"{'Last partial run (--only)' if partial else 'Whole run'}: {seconds:.0f} s (trees built, the mutants' tests run) on this machine."]
    if partial:
        md.append("Rows not re-run keep their result from the run before (the sum of their per-mutant seconds is in mutants.json).")
    (out / "mutants.md").write_text("\n".join(md) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mutants", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--line", choices=(*LINES, "all"), default="all", help="which line's mutants (default: all)")
    ap.add_argument("--only", help="only these mutant ids (comma-separated), merged into the existing table")
    ap.add_argument("--check", action="store_true", help="only check that every mutant applies (builds the trees)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "mutants", help="where the table goes (default: results/mutants)")
    a = ap.parse_args(argv)
    lines = list(LINES) if a.line == "all" else [a.line]
    only = set(a.only.split(",")) if a.only else None
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sglpatch-mutants-") as tmp:
        if a.check:
            bad = [b for line in lines for b in check(line, build_tree(line, Path(tmp) / line))]
            print("mutants: every mutant applies" if not bad else "mutants: error: " + "; ".join(bad))
            return 1 if bad else 0
        rows = [r for line in lines for r in run_line(line, Path(tmp), only)]
    if only:
        old = json.loads((a.out / "mutants.json").read_text()) if (a.out / "mutants.json").is_file() else []
        new = {(r["line"], r["id"]) for r in rows}
        rows = [r for r in old if (r["line"], r["id"]) not in new] + rows
    write_table(rows, a.out, time.monotonic() - start, bool(only))
    survived = [r["id"] for r in rows if not r["killed"]]
    print(f"mutants: {len(rows) - len(survived)}/{len(rows)} killed" + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
