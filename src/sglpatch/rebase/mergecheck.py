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
import functools
import re
from collections import Counter

import unidiff
from pyflakes import checker as _checker
from pyflakes import messages as _m

from sglpatch.upstream import treecache
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


def _flakes(text: str, path: str) -> list:
    try:
        tree = ast.parse(text, filename=path)
    except SyntaxError:
        return []
    w = _checker.Checker(tree, filename=path)
    return [m for m in w.messages if isinstance(m, _BROKEN)]


def _flakes_of(git: Git, commit: str, path: str) -> tuple[str | None, list[list]]:
    """(text, [[kind, args, line, message], ...]) of the file at path in commit: pyflakes runs
    once per blob (kept in memory and in the tree cache's facts; blobs are immutable)."""
    got = git.cat(f"{commit}:{path}")
    if got is None or got[1] != "blob":
        return None, []
    text = got[2].decode("utf-8", "surrogateescape")
    key = f"{got[0]}-{re.sub(r'[^A-Za-z0-9_.]', '_', path.rsplit('/', 1)[-1])}"  # pyflakes reads __init__.py differently
    msgs = _FLAKES.get(key)
    if msgs is None:
        msgs = treecache.load_facts("flakes2", key).get("messages")
        if msgs is None:
            msgs = [[type(m).__name__, _args(m), m.lineno, m.message % m.message_args] for m in _flakes(text, path)]
            treecache.save_facts("flakes2", key, {"messages": msgs})
        _FLAKES[key] = msgs
    return text, msgs


_FLAKES: dict[str, list[list]] = {}


def _args(m) -> list[str]:
    # line numbers in the arguments ("redefinition of unused 'x' from line 64") move with
    # every line the patch adds above them: they do not make an upstream message new
    return ["#" if isinstance(a, int) else str(a) for a in m.message_args]


def _key(m: list) -> tuple:
    return (m[0], tuple(m[1]))


def _added_lines(git: Git, base: str, merged: str, path: str) -> set[int]:
    out = git.run("diff", "--no-color", "-U0", "--no-ext-diff", base, merged, "--", path, strip=False)
    return {ln.target_line_no for f in unidiff.PatchSet.from_string(out) for h in f for ln in h if ln.is_added}


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


def _tree_id(git: Git, commit: str) -> str:
    got = _TREES.get(commit)
    if got is None:
        got = _TREES[commit] = git.tree_of(commit)
    return got


_TREES: dict[str, str] = {}
_NAMES: dict[str, dict[str, bool]] = {}  # tree id -> name -> defined (trees are immutable)


def _lines_naming(git: Git, commit: str, names: list[str]) -> str:
    """The lines of commit's Python files that hold one of names as a word. One Perl-style
    alternation: git's -w -F with many names retries at every near miss, 10 s and more on SGLang's
    tree where the same lines take under 1 s this way. -w -F where git has no PCRE."""
    alternation = "|".join(re.escape(n) for n in names)
    rc, out, _ = git.run("grep", "-I", "-h", "-P", "-e", rf"\b(?:{alternation})\b", commit, "--", "*.py", check=False, strip=False)
    if rc in (0, 1):
        return out
    args = ["grep", "-I", "-h", "-w", "-F"]
    for n in names:
        args += ["-e", n]
    return git.run(*args, commit, "--", "*.py", check=False, strip=False)[1]


def defined_names(git: Git, commit: str, names: set[str]) -> set[str]:
    """Which of names some Python file in commit's tree defines (def/class/assignment/parameter/
    keyword/import): one `git grep` over the tree for all names not known yet (_lines_naming),
    then the patterns above on the lines each name occurs in. What is found is kept per tree
    (in memory and in the tree cache's facts), so a tree is searched once per name."""
    tree = _tree_id(git, commit)
    known = _NAMES.get(tree)
    if known is None:
        known = _NAMES[tree] = treecache.load_facts("names", tree)
    todo = sorted(set(names) - known.keys())
    if todo:
        out = _lines_naming(git, commit, todo)
        words = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(todo, key=len, reverse=True)) + r")\b")
        pats = {n: _def_patterns(n) for n in todo}
        found: set[str] = set()
        for line in out.split("\n"):
            for n in set(words.findall(line)) - found:
                if any(p.search(line) for p in pats[n]):
                    found.add(n)
        known.update({n: n in found for n in todo})
        treecache.save_facts("names", tree, known)
    return {n for n in names if known[n]}


@functools.lru_cache(maxsize=64)
def _compile_error(text: str, path: str) -> str:
    """'' when text byte-compiles, else the problem line (once per text: releases share merges)."""
    try:
        compile(text, path, "exec", dont_inherit=True)
    except SyntaxError as e:
        return f"{path}:{e.lineno}: does not compile ({e.msg})"
    except ValueError as e:
        return f"{path}:1: does not compile ({e})"
    return ""


@functools.lru_cache(maxsize=64)
def _uses(text: str, lines: frozenset[int]) -> tuple[dict[str, tuple[int, str]], set[str]]:
    return _used_and_defined(ast.parse(text), set(lines))


def check(git: Git, old_base: str, base: str, merged: str, paths: list[str]) -> list[str]:
    """Problems of merged (= base + the patch) as 'file:line: reason' ([] when it looks sound).

    old_base: the old upstream with the same earlier patches (where the patch was made)."""
    problems: list[str] = []
    uses: list[tuple[str, dict]] = []
    for path in paths:
        if not path.endswith(".py"):
            continue
        text, merged_msgs = _flakes_of(git, merged, path)
        if text is None:
            continue
        bad = _compile_error(text, path)
        if bad:
            problems.append(bad)
            continue
        known = Counter(_key(m) for m in _flakes_of(git, base, path)[1])
        known_old = Counter(_key(m) for m in _flakes_of(git, old_base, path)[1])
        for m in merged_msgs:
            k = _key(m)
            if known[k] > 0:
                known[k] -= 1
            elif known_old[k] > 0:
                known_old[k] -= 1
            else:
                problems.append(f"{path}:{m[2]}: {m[3]}")
        lines = _added_lines(git, base, merged, path)
        if lines:
            used, own = _uses(text, frozenset(lines))
            uses.append((path, {n: u for n, u in used.items() if n not in own and not hasattr(builtins, n)}))
    cands = {n for _, used in uses for n in used}
    old_def = defined_names(git, old_base, cands)
    gone = old_def - defined_names(git, merged, old_def)
    for path, used in uses:
        for n in sorted(gone & set(used), key=lambda x: used[x][0]):
            ln, what = used[n]
            problems.append(f"{path}:{ln}: {what} {n!r} is defined in the old upstream but nowhere in the new one (renamed or removed upstream?)")
    return problems
