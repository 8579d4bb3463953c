"""Merged is not working: what a 3-way merge or a recorded resolution put on a new upstream,
checked before it is carried unattended.

For every Python file the merged patch changes (``base`` = the new upstream with the patches
kept before it, ``merged`` = base + this patch):

1. it byte-compiles;
2. pyflakes reports nothing of the kinds that mean broken code (undefined names, redefinitions,
   unused or shadowed imports, duplicate arguments) that neither the new upstream's own file nor
   the patch's file on the old upstream already has (compared by message type and names, not
   line numbers);
3. every attribute, called function, imported name or keyword argument its added lines use
   that the old upstream defined is still defined somewhere in the merged tree (an upstream
   rename is the classic silent break): "defined" is a ``def``/``class``, an assignment, a
   parameter, a keyword or an import of that name, found with ``git grep`` over the tree.

Each hit is one line ``file:line: reason``.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections import Counter

from pyflakes import checker as _checker
from pyflakes import messages as _m

from sglpatch.gitcmd import Git

_BROKEN = (
    _m.UndefinedName,
    _m.UndefinedLocal,
    _m.UndefinedExport,
    _m.RedefinedWhileUnused,
    _m.UnusedImport,
    _m.ImportShadowedByLoopVar,
    _m.DuplicateArgument,
)


def _blob(git: Git, commit: str, path: str) -> str | None:
    rc, out, _ = git.run("cat-file", "blob", f"{commit}:{path}", check=False, strip=False)
    return out if rc == 0 else None


def _flakes(text: str, path: str) -> list:
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError:
        return []
    w = _checker.Checker(tree, filename=path)
    return [m for m in w.messages if isinstance(m, _BROKEN)]


def _key(m) -> tuple:
    # line numbers in the arguments ("redefinition of unused 'x' from line 64") move with
    # every line the patch adds above them: they do not make an upstream message new
    return (type(m).__name__, tuple("#" if isinstance(a, int) else str(a) for a in m.message_args))


def _added_lines(git: Git, base: str, merged: str, path: str) -> set[int]:
    out = git.run("diff", "--no-color", "-U0", "--no-ext-diff", base, merged, "--", path, strip=False)
    lines: set[int] = set()
    for h in re.finditer(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@", out, re.M):
        start, count = int(h.group(1)), int(h.group(2) or "1")
        lines.update(range(start, start + count))
    return lines


def _used_and_defined(tree: ast.AST, lines: set[int]) -> tuple[dict[str, tuple[int, str]], set[str]]:
    """Names the added lines use (name -> (line, what)) and the names they define themselves."""
    used: dict[str, tuple[int, str]] = {}
    own: set[str] = set()

    def use(name, node, what):
        if name and not name.startswith("__") and name not in used:
            used[name] = (node.lineno, what)

    for node in ast.walk(tree):
        ln = getattr(node, "lineno", None)
        if ln not in lines:
            continue
        if isinstance(node, ast.Attribute):
            (own.add(node.attr) if isinstance(node.ctx, ast.Store) else use(node.attr, node, "attribute"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            use(node.func.id, node, "function")
        elif isinstance(node, ast.keyword) and node.arg:
            use(node.arg, node, "keyword argument")
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                use(a.name, node, "imported name")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
            if not isinstance(node, ast.ClassDef):
                for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs:
                    own.add(a.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
    return used, own


def _def_patterns(n: str) -> list[re.Pattern]:
    e = re.escape(n)
    return [re.compile(p) for p in (
        rf"\b(?:def|class)\s+{e}\b",  # def / class
        rf"\b{e}\s*(?::[^=]*)?=(?!=)",  # assignment, annotated, default, keyword
        rf"[(,]\s*\**{e}\s*[,):]",  # parameter (or positional)
        rf"^\s*\**{e}\s*[,:)]",  # parameter on its own line, a name in an import list
        rf"^\s*{e}\s*$",
        rf"\b(?:import|as)\s+(?:.*[\s,(])?{e}\b",  # import (also `import a, b`, `as x`)
    )]


def defined_names(git: Git, commit: str, names: set[str]) -> set[str]:
    """Which of names some Python file in commit's tree defines (def/class/assignment/parameter/
    keyword/import): one fixed-string `git grep -w` over the tree, then the patterns above."""
    known = {n for n in names if (commit, n) in _MEMO}
    hits = {n for n in known if _MEMO[(commit, n)]}
    names = set(names) - known
    if not names:
        return hits
    args = ["grep", "-I", "-h", "-w", "-F"]
    for n in sorted(names):
        args += ["-e", n]
    rc, out, _ = git.run(*args, commit, "--", "*.py", check=False, strip=False)
    found = set()
    lines = out.split("\n")
    for n in names:
        pats = _def_patterns(n)
        word = re.compile(rf"\b{re.escape(n)}\b")
        _MEMO[(commit, n)] = any(word.search(line) and any(p.search(line) for p in pats) for line in lines)
        if _MEMO[(commit, n)]:
            found.add(n)
    return found | hits


_MEMO: dict[tuple[str, str], bool] = {}  # (commit, name) -> defined; commits are immutable


def check(git: Git, old_base: str, base: str, merged: str, paths: list[str]) -> list[str]:
    """Problems of merged (= base + the patch) as 'file:line: reason' ([] when it looks sound).

    old_base: the old upstream with the same earlier patches (where the patch was made)."""
    problems: list[str] = []
    uses: list[tuple[str, dict]] = []
    for path in paths:
        if not path.endswith(".py"):
            continue
        text = _blob(git, merged, path)
        if text is None:
            continue
        try:
            compile(text, path, "exec", dont_inherit=True)
        except SyntaxError as e:
            problems.append(f"{path}:{e.lineno}: does not compile ({e.msg})")
            continue
        except ValueError as e:
            problems.append(f"{path}:1: does not compile ({e})")
            continue
        known = Counter(_key(m) for m in _flakes(_blob(git, base, path) or "", path))
        known_old = Counter(_key(m) for m in _flakes(_blob(git, old_base, path) or "", path))
        for m in _flakes(text, path):
            k = _key(m)
            if known[k] > 0:
                known[k] -= 1
            elif known_old[k] > 0:
                known_old[k] -= 1
            else:
                problems.append(f"{path}:{m.lineno}: {m.message % m.message_args}")
        lines = _added_lines(git, base, merged, path)
        if lines:
            used, own = _used_and_defined(ast.parse(text), lines)
            uses.append((path, {n: u for n, u in used.items() if n not in own and not hasattr(builtins, n)}))
    cands = {n for _, used in uses for n in used}
    old_def = defined_names(git, old_base, cands)
    gone = old_def - defined_names(git, merged, old_def)
    for path, used in uses:
        for n in sorted(gone & set(used), key=lambda x: used[x][0]):
            ln, what = used[n]
            problems.append(f"{path}:{ln}: {what} {n!r} is defined in the old upstream but nowhere in the new one (renamed or removed upstream?)")
    return problems
