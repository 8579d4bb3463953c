"""The package's layout, read from the source with `ast` (nothing is imported):

- no import cycle among sglpatch's modules; an import inside a function counts (it is how a
  circle hides), and importing `a.b.c` from outside `a.b` also runs `a.b`'s `__init__`;
- no file of the series side (src/sglpatch outside gpu/) over MAX_LINES lines, no test file over
  TEST_MAX_LINES.

Each exception still standing is named below, and one that no longer stands fails too, so the
lists say what is left to do."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
MAX_LINES = 450

KNOWN_CYCLES: list[set[str]] = []  # none left (issue 23 part C: workdir.py out of stack ended the last)
KNOWN_LONG: set[str] = set()  # none left (issue 23 part G: pkgindex.py out of artifacts ended the last)


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """{module: the sglpatch modules it imports anywhere in its file}."""
    files = {module_name(p, src): p for p in sorted((src / "sglpatch").rglob("*.py"))}

    def known(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # from . import x / from ..y import z
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets |= {known(f"{base}.{a.name}") if f"{base}.{a.name}" in files else known(base)
                            for a in node.names}
        edges = set()
        for t in targets - {"", name}:
            edges.add(t)
            parent = t.rpartition(".")[0]
            while parent and not (name == parent or name.startswith(parent + ".")):
                edges.add(parent)  # its __init__ runs first
                parent = parent.rpartition(".")[0]
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_no_import_cycle_but_the_known_ones():
    found = cycles(import_graph())
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not new, f"import cycle(s) among sglpatch's modules: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"KNOWN_CYCLES lists {gone}, no longer a cycle: take it off the list"


def test_the_cycle_finder_sees_a_function_local_circle(tmp_path):
    """The finder itself, on a made-up package: a function-local import closes a circle; importing
    `sub.c` from outside `sub` runs `sub`'s __init__ too, from inside it does not."""
    pkg = tmp_path / "sglpatch"
    (pkg / "sub").mkdir(parents=True)
    files = {"__init__.py": "", "a.py": "from sglpatch import b\n",
             "b.py": "def f():\n    from sglpatch.sub.c import g\n    return g\n",
             "sub/__init__.py": "from sglpatch.sub.c import g\n", "sub/c.py": "import sglpatch.a\n\ndef g(): pass\n",
             "d.py": "from sglpatch.sub import c\n"}
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["sglpatch.d"] == {"sglpatch.sub", "sglpatch.sub.c"}
    assert graph["sglpatch.sub.c"] == {"sglpatch.a"}
    assert cycles(graph) == [{"sglpatch.a", "sglpatch.b", "sglpatch.sub", "sglpatch.sub.c"}]


def test_no_series_side_file_over_max_lines_but_the_known_ones():
    long = {str(p.relative_to(SRC)): len(p.read_text().splitlines())
            for p in sorted((SRC / "sglpatch").rglob("*.py")) if "gpu" not in p.relative_to(SRC).parts[1:-1]}
    over = {f: n for f, n in long.items() if n > MAX_LINES}
    new = {f: n for f, n in over.items() if f not in KNOWN_LONG}
    assert not new, f"series-side file(s) over {MAX_LINES} lines: {new}"
    gone = sorted(KNOWN_LONG - set(over))
    assert not gone, f"KNOWN_LONG lists {gone}, now at most {MAX_LINES} lines (or gone): take it off the list"


GPU_MAX_LINES = 400  # issue 30: no file of the GPU suite over 400 lines
TIER_PACKAGES = ("sglpatch.gpu.cpu", "sglpatch.gpu.kernel", "sglpatch.gpu.server", "sglpatch.gpu.doctor")


def test_no_gpu_file_over_its_max_lines():
    long = {str(p.relative_to(SRC)): n for p in sorted((SRC / "sglpatch" / "gpu").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > GPU_MAX_LINES}
    assert not long, f"GPU-suite file(s) over {GPU_MAX_LINES} lines: {long}"


def test_regress_reaches_each_tier_only_through_its_face():
    """gpu/regress.py takes from a tier package nothing but its Tier class (check, run, report);
    a tier package never imports regress; the tiers share only what shared/ holds (and the
    server tier's gate, the doctor)."""
    tree = ast.parse((SRC / "sglpatch" / "gpu" / "regress.py").read_text())
    taken = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
             for a in n.names if n.module.startswith(TIER_PACKAGES)}
    assert taken and all(name.endswith("Tier") for _, name in taken), taken
    graph = import_graph()
    for mod, deps in graph.items():
        if not mod.startswith(TIER_PACKAGES):
            continue
        own = next(p for p in TIER_PACKAGES if mod.startswith(p))
        other = {d for d in deps if d.startswith(TIER_PACKAGES) and not d.startswith(own)}
        assert "sglpatch.gpu.regress" not in deps, mod
        assert other <= {"sglpatch.gpu.doctor", "sglpatch.gpu.doctor.run"} and (not other or own.endswith("server")), \
            (mod, other)


TESTS = ROOT / "tests"
TEST_MAX_LINES = 450  # issue 39: the test files too, the failure-mode cases one file per concern
KNOWN_LONG_TESTS: set[str] = {"test_doctor.py"}  # 529 lines, not yet split


def test_no_test_file_over_max_lines_but_the_known_ones():
    """tests/*.py and tests/failure_modes/*.py (the harness and conftest among them); tests/patches,
    tests/gpu and tests/real_0523 have owners of their own."""
    files = [*TESTS.glob("*.py"), *(TESTS / "failure_modes").glob("*.py")]
    over = {str(p.relative_to(TESTS)): n for p in sorted(files) if (n := len(p.read_text().splitlines())) > TEST_MAX_LINES}
    new = {f: n for f, n in over.items() if f not in KNOWN_LONG_TESTS}
    assert not new, f"test file(s) over {TEST_MAX_LINES} lines: {new}"
    gone = sorted(KNOWN_LONG_TESTS - set(over))
    assert not gone, f"KNOWN_LONG_TESTS lists {gone}, now at most {TEST_MAX_LINES} lines (or gone): take it off the list"
    assert (TESTS / "failure_modes").is_dir() and not list(TESTS.glob("test_failure_modes*.py")), "the failure-mode cases live in tests/failure_modes/"
