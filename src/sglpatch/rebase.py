"""Move the series onto a new upstream release: classify, 3-way, stop resumably, record.

    sglpatch rebase --workdir DIR --onto 0.5.10.post1 [--source sdist|git] [--dry-run]
    sglpatch rebase --workdir DIR --continue | --skip | --abort

Every patch is classified on the new upstream (in series order, each on top of the ones
kept before it):

* ``upstream``  the change is already in the new tree, verified (never on the DEP-3
  ``Applied-Upstream`` hint alone): the patch reverse-applies, or its 3-way result equals
  the tree, or every definition it adds or changes exists there with the same behaviour
  (normalized AST, or the same calls/returns/exceptions when run against recording
  stand-ins, following the class's own helpers) and it changes nothing else;
* ``exact``     applies with no offset and no fuzz;
* ``3way``      applies with a 3-way merge against the old stack (offsets, moved code);
* ``conflict``  the 3-way merge leaves conflicts;
* ``obsolete``  every file it modifies is gone from the new tree (no longer needed).

Recorded resolutions live in the project, ``resolutions/<version>/``::

    resolutions.toml   [patch."NAME"] action = "replace" | "drop", why = "...",
                       patch_sha256 = sha256 of the series patch this resolves,
                       conflict = the conflict it resolves (see below)
    NAME               for "replace": the patch as it applies to the new upstream
    target.toml        optional recorded pin: tag, commit, sdist_sha256

A recorded resolution is keyed by the conflict it resolves (``conflict``: files and both sides
of every conflict region, hashed, like git rerere): any release that shows the same conflict gets
it offered and merge-checked before use; another conflict refuses it (a record without a key is
used only for the exact patch bytes, ``patch_sha256``, it was made for). Patches resolved by
hand during a rebase (``--continue``) or dropped (``--skip``) are recorded there on success, with
the key of the conflict they resolve (a "3-way but broken" stop has no conflict: its record is
keyed by ``patch_sha256`` only), so the next person replays the same rebase with one command.

A real rebase builds the new stack off to the side; on a conflict it puts DIR on a detached
HEAD at the new stack so far, applies the patch with ``git apply --3way`` (markers in place)
and saves its state in ``DIR/.git/sglpatch-rebase/``. ``--abort`` restores DIR's refs, HEAD
and files and the project's files exactly. Only the finishing step writes the project:
patches/ + series (export), upstream.lock, CHANGELOG.md, the report under
``rebase-reports/`` (outcomes and per-patch ``git range-diff``).
"""

from __future__ import annotations

import ast
import builtins
import functools
import hashlib
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from sglpatch import mergecheck, stack, treecache
from sglpatch import upstream as up
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint, exclusive, write_if_changed
from sglpatch.gitcmd import FIXED_DATE, Git
from sglpatch.lock import Lock, write_lock
from sglpatch.series import PATCH_DIR, SERIES_NAME, Entry, PatchFile, hunks_by_path, parse_patch, read_series

RESOLUTIONS_DIR = "resolutions"
REPORTS_DIR = "rebase-reports"
CHANGELOG = "CHANGELOG.md"
STATE_DIR = "sglpatch-rebase"
REF_PREFIX = "refs/sglpatch/rebase"

# dry-run exit codes (errors stay 1)
EXIT_NOTHING = 0  # every patch applies exactly
EXIT_UNATTENDED = 2  # work, but `rebase` does it alone (3-way, drops, recorded resolutions)
EXIT_HUMAN = 3  # a conflict or an obsolete patch without a recorded resolution


class RebaseError(SglpatchError):
    pass


class RebaseStopped(SglpatchError):
    """The rebase stopped for a human; the message says what to do next (exit 3)."""

    exit_code = 3


# --------------------------------------------------------------------------------------
# outcomes


@dataclass
class Outcome:
    name: str
    subject: str
    status: str  # upstream | exact | 3way | conflict | obsolete
    action: str = ""  # keep | refresh | drop | recorded | hand | skip | stop
    how: str = ""  # how it was verified / resolved
    files: list[str] = field(default_factory=list)  # conflicting files
    hunks: list[str] = field(default_factory=list)  # conflicting hunks / regions
    hint: str = ""  # Applied-Upstream
    note: str = ""
    new_commit: str = ""
    conflict: str = ""  # conflict_key() of a conflict / obsolete result ("" otherwise)

    @property
    def needs_human(self) -> bool:
        return self.action in ("stop",)


def _table(outcomes: list[Outcome]) -> list[str]:
    lines = [f"{'#':>2}  {'patch':<46} {'on new upstream':<16} plan"]
    for k, o in enumerate(outcomes, 1):
        plan = {
            "keep": "keep as is",
            "refresh": "keep, refreshed by the 3-way merge",
            "drop": "drop (already upstream)",
            "recorded": "use the recorded resolution",
            "recorded-drop": "drop (recorded decision)",
            "hand": "resolved by hand",
            "skip": "dropped by hand (--skip)",
            "stop": "needs you: resolve, then --continue",
        }.get(o.action, o.action)
        lines.append(f"{k:>2}  {o.name[:46]:<46} {o.status:<16} {plan}")
        if o.how:
            lines.append(f"      {o.how}")
        for f in o.files:
            lines.append(f"      conflict: {f}")
        for h in o.hunks:
            lines.append(f"        {h}")
        if o.note:
            lines.append(f"      note: {o.note}")
    return lines


# --------------------------------------------------------------------------------------
# git helpers (all through gitcmd.Git)


def _tree(git: Git, commit: str) -> str:
    return git.tree_of(commit)


def _blob(git: Git, commit: str, path: str) -> str | None:
    return git.blob_text(commit, path)


def _fixed_commit(git: Git, tree: str, parents: list[str], message: str) -> str:
    key = (str(git.workdir), tree, tuple(parents), message)  # fixed identity and dates: the same id every time
    if key not in _FIXED:
        args = ["commit-tree", tree]
        for p in parents:
            args += ["-p", p]
        _FIXED[key] = git.run(*args, input=message, env={"GIT_AUTHOR_DATE": FIXED_DATE, "GIT_COMMITTER_DATE": FIXED_DATE})
    return _FIXED[key]


_FIXED: dict[tuple, str] = {}


_LIKE: dict[tuple, tuple[str, str, str, str]] = {}  # (repository, commit) -> author name, email, date, message


def _commit_like(git: Git, tree: str, parent: str, like: str) -> str:
    """A commit of tree on parent with the message and author of commit `like` (as git am would)."""
    key = (str(git.workdir), like)
    if key not in _LIKE:
        fmt = git.run("log", "-1", "--format=%an%x00%ae%x00%aI", like)
        _LIKE[key] = (*fmt.split("\0"), git.run("log", "-1", "--format=%B", like, strip=False))
    name, email, date, message = _LIKE[key]
    env = {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_DATE": date,
    }
    return git.run("commit-tree", tree, "-p", parent, input=message, env=env)


def _three_way(git: Git, head: str, old_parent: str, old_commit: str) -> tuple[bool, str, list[str]]:
    """3-way merge of old_parent..old_commit onto head, off to the side (no worktree, no refs).

    Synthetic commits give `git merge-tree --write-tree` the old parent as merge base
    (git < 2.40 has no --merge-base). Returns (clean, tree, conflicting paths).
    """
    base = _fixed_commit(git, _tree(git, old_parent), [], "merge base\n")
    ours = _fixed_commit(git, _tree(git, head), [base], "ours\n")
    theirs = _fixed_commit(git, _tree(git, old_commit), [base], "theirs\n")
    rc, out, err = git.run("merge-tree", "--write-tree", "--name-only", "--no-messages", ours, theirs, check=False)
    lines = out.strip().splitlines()
    if rc not in (0, 1) or not lines:
        last = [x for x in err.strip().splitlines() if x.strip()]
        raise RebaseError(f"git merge-tree failed: {last[-1] if last else 'exit ' + str(rc)}")
    tree = lines[0].strip()
    files = []
    for x in lines[1:]:
        if not x.strip():
            break
        if x not in files:
            files.append(x)
    return rc == 0, tree, files


def _with_temp_index(git: Git, base: str, fn):
    with tempfile.TemporaryDirectory(prefix="sglpatch-rb-", dir=up.scratch_dir(git)) as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git.run("read-tree", base, env=env)
        return fn(env, Path(tmp))


def _new_sides_present(git: Git, head: str, patch: PatchFile, strip: int) -> bool:
    """Whether every hunk's new side (context and added lines) is somewhere in head's file:
    without that, the patch cannot reverse-apply (git apply takes no fuzz), and git need not
    be asked."""
    diffs = patch.diffs if strip == patch.strip else parse_patch(patch.name, patch.data, strip).diffs
    for d in diffs:
        if d.new is None:
            continue  # a deleted file: git decides
        text = _blob(git, head, d.new)
        if text is None:
            return False
        lines = text.split("\n")
        for h in d.hunks:
            k = len(h.new_lines)
            if k and not any(lines[i : i + k] == h.new_lines for i in range(len(lines) - k + 1)):
                return False
    return True


def _reverse_applies(git: Git, head: str, data: bytes, strip: int) -> bool:
    def go(env, tmp):
        pf = tmp / "patch"
        pf.write_bytes(data)
        rc, _, _ = git.run("apply", "--cached", "-R", "--check", f"-p{strip}", "--", str(pf), env=env, check=False)
        return rc == 0

    return _with_temp_index(git, head, go)


def _conflict_regions(git: Git, tree: str, path: str) -> list[str]:
    text = _blob(git, tree, path)
    if text is None:
        return [f"{path}: deleted on one side, changed on the other"]
    regions, start = [], None
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("<<<<<<<"):
            start = n
        elif line.startswith(">>>>>>>") and start is not None:
            regions.append(f"{path}: lines {start}-{n} of the merged file")
            start = None
    return regions


def _failing_hunks(git: Git, head: str, patch: PatchFile, strip: int) -> list[str]:
    """Hunks of the patch whose old lines are nowhere in the new tree."""
    out = []
    for path, hunks in hunks_by_path(patch, strip).items():
        text = _blob(git, head, path)
        if text is None:
            out.append(f"{path}: file is gone from the new upstream")
            continue
        lines = text.split("\n")
        for n, h in enumerate(hunks, 1):
            k = len(h.old_lines)
            if not any(lines[i : i + k] == h.old_lines for i in range(len(lines) - k + 1)):
                out.append(f"{path}: hunk #{n} {h.header.split(' @@')[0]} @@ (context not found)")
    return out


# --------------------------------------------------------------------------------------
# "same behaviour": normalized AST, or the same trace against recording stand-ins


def _doc_stripped(body: list) -> list:
    """A body without its docstring (a lone docstring becomes `pass`)."""
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        return body[1:] or [ast.Pass()]
    return body


def _emit(x, out: list, bodies: dict) -> None:
    """The normalized dump: docstrings, annotations and string literals (messages) dropped,
    the logic kept; bodies: id(node) -> the body to use instead (shells, remainders). Reads
    the tree without copying or changing it."""
    if isinstance(x, list):
        out.append("[")
        for y in x:
            _emit(y, out, bodies)
            out.append(",")
        out.append("]")
        return
    if not isinstance(x, ast.AST):
        out.append(repr(x))
        return
    if isinstance(x, ast.JoinedStr) or isinstance(x, ast.Constant) and isinstance(x.value, str):
        out.append("Constant('')")
        return
    if isinstance(x, ast.Constant):
        out.append(f"Constant({x.value!r})")
        return
    out.append(type(x).__name__ + "(")
    fn = isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef))
    for f in x._fields:
        v = getattr(x, f, None)
        if f == "body" and isinstance(x, (ast.Module, ast.ClassDef)):
            v = bodies.get(id(x), v)
        if f == "body" and (fn or isinstance(x, ast.ClassDef)):
            v = _doc_stripped(v)
        elif (fn and f in ("returns", "type_comment")) or (isinstance(x, ast.arg) and f in ("annotation", "type_comment")):
            v = None
        elif isinstance(x, ast.AnnAssign) and f == "annotation":
            out.append("annotation=Constant(None),")
            continue
        out.append(f + "=")
        _emit(v, out, bodies)
        out.append(",")
    out.append(")")


def _norm_dump(node: ast.AST, bodies: dict | None = None) -> str:
    out: list[str] = []
    _emit(node, out, bodies or {})
    return "".join(out)


@functools.lru_cache(maxsize=64)
def _parse(text: str) -> ast.Module:
    """Parsed once per text in a run (the same upstream file is read for several patches);
    callers must not change the tree."""
    return ast.parse(text)


_DEF = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _defs(tree: ast.Module) -> dict[str, ast.AST]:
    """qualified name -> def, for module-level defs and class members (nested classes too)."""
    found: dict[str, ast.AST] = {}

    def walk(body, prefix):
        for node in body:
            if isinstance(node, _DEF):
                q = f"{prefix}{node.name}"
                found[q] = node
                if isinstance(node, ast.ClassDef):
                    walk(node.body, q + ".")

    walk(tree.body, "")
    return found


def _class_shell(node: ast.ClassDef) -> str:
    return _norm_dump(node, {id(node): [n for n in node.body if not isinstance(n, _DEF)] or [ast.Pass()]})


@functools.lru_cache(maxsize=8192)
def _fingerprint(node: ast.AST) -> str:
    return _class_shell(node) if isinstance(node, ast.ClassDef) else _norm_dump(node)


def _remainder(tree: ast.Module, drop: set[str]) -> str:
    """The module without the defs in drop, without imports: what is left to compare."""
    return _remainder_of(tree, frozenset(drop))


@functools.lru_cache(maxsize=256)
def _remainder_of(tree: ast.Module, drop: frozenset[str]) -> str:
    bodies: dict[int, list] = {}

    def strip(body, prefix):
        out = []
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, _DEF):
                q = f"{prefix}{node.name}"
                if q in drop:
                    continue
                if isinstance(node, ast.ClassDef):
                    bodies[id(node)] = strip(node.body, q + ".") or [ast.Pass()]
            out.append(node)
        return out

    bodies[id(tree)] = strip(tree.body, "")
    return _norm_dump(tree, bodies)


class _Trace:
    def __init__(self, missing: frozenset[str]):
        self.missing = missing
        self.events: list[tuple] = []
        self.seen: list[str] = []


def _shape(x):
    if isinstance(x, _Rec):
        return ("rec", object.__getattribute__(x, "_path"))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_shape(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple(sorted((repr(k), _shape(v)) for k, v in x.items())))
    if isinstance(x, (int, float, bool, type(None))):
        return ("val", x)
    if isinstance(x, str):
        return ("str",)  # messages may differ
    return ("obj", type(x).__name__)


class _Rec:
    """A stand-in that records what the code does with it."""

    def __init__(self, path: str, trace: _Trace, methods: dict | None = None):
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_trace", trace)
        object.__setattr__(self, "_methods", methods or {})

    def __getattr__(self, name):
        path = f"{object.__getattribute__(self, '_path')}.{name}"
        trace = object.__getattribute__(self, "_trace")
        methods = object.__getattribute__(self, "_methods")
        if name in methods:  # the class's own methods run for real (helpers)
            return functools.partial(methods[name], self)
        if path in trace.missing:
            raise AttributeError(path)
        if path not in trace.seen:
            trace.seen.append(path)
        return _Rec(path, trace)

    def __setattr__(self, name, value):
        trace = object.__getattribute__(self, "_trace")
        trace.events.append(("set", f"{object.__getattribute__(self, '_path')}.{name}", _shape(value)))

    def __call__(self, *args, **kwargs):
        path = object.__getattribute__(self, "_path")
        trace = object.__getattribute__(self, "_trace")
        trace.events.append(("call", path, _shape(args), _shape(kwargs)))
        return _Rec(f"{path}()", trace)

    def __getitem__(self, key):
        path = object.__getattribute__(self, "_path")
        return _Rec(f"{path}[{_shape(key)!r}]", object.__getattribute__(self, "_trace"))

    def __bool__(self):
        return True

    def __iter__(self):  # without it, iteration would go through __getitem__ forever
        return iter(())


class _Budget(Exception):
    pass


def _limited(fn, *args, **kwargs):
    """Run fn with a budget of traced lines: stand-ins must not loop forever."""
    count = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != "<sglpatch-trace>":
            return None
        count[0] += 1
        if count[0] > 5000:
            raise _Budget()
        return tracer

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn(*args, **kwargs)
    finally:
        sys.settrace(old)


class _Globals(dict):
    def __missing__(self, name):
        if hasattr(builtins, name):
            return getattr(builtins, name)
        return _Rec(f"global:{name}", self["__trace__"])


def _compile_methods(cls: ast.ClassDef | None, funcs: list[ast.AST], g: _Globals) -> dict:
    import copy

    nodes = [n for n in (cls.body if cls else funcs) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out = {}
    for n in nodes:
        if any(not (isinstance(d, ast.Name) and d.id in ("staticmethod",)) for d in n.decorator_list):
            continue  # properties, caches, ...: not traced
        if n not in _CODE:  # compiled once per def (the traces run it many times)
            c = copy.copy(n)  # shallow: the parsed tree is shared (_parse), the body is only read
            c.decorator_list, c.returns, c.args = [], None, copy.copy(n.args)
            for field_ in ("args", "kwonlyargs", "posonlyargs"):
                setattr(c.args, field_, [copy.copy(a) for a in getattr(n.args, field_)])
            for a in c.args.args + c.args.kwonlyargs + c.args.posonlyargs:
                a.annotation = None
            _CODE[n] = compile(ast.Module(body=[c], type_ignores=[]), "<sglpatch-trace>", "exec")
        exec(_CODE[n], g)
        out[n.name] = g.pop(n.name)
    return out


_CODE: dict[ast.AST, object] = {}  # def node (kept alive here) -> its code, decorators and annotations dropped


def _run_traced(func_node: ast.FunctionDef, cls: ast.ClassDef | None, missing: frozenset[str]):
    trace = _Trace(missing)
    g = _Globals(__trace__=trace, __builtins__=builtins)
    try:
        methods = _compile_methods(cls, [func_node], g)
    except Exception:
        return None, trace
    fn = methods.get(func_node.name)
    if fn is None:
        return None, trace
    params = [a.arg for a in func_node.args.posonlyargs + func_node.args.args]
    args = []
    for k, p in enumerate(params):
        if k == 0 and cls is not None and p in ("self", "cls"):
            args.append(_Rec("self", trace, methods))
        else:
            args.append(_Rec(f"arg:{p}", trace))
    kwargs = {a.arg: _Rec(f"arg:{a.arg}", trace) for a in func_node.args.kwonlyargs}
    try:
        result = ("return", _shape(_limited(fn, *args, **kwargs)))
    except _Budget:
        return None, trace
    except Exception as e:  # the behaviour includes which exception is raised
        result = ("raise", type(e).__name__)
    return (result, tuple(trace.events)), trace


def _same_behaviour(mine: ast.AST, my_cls, theirs: ast.AST, their_cls) -> bool:
    if _fingerprint(mine) == _fingerprint(theirs):
        return True
    if not isinstance(mine, ast.FunctionDef) or not isinstance(theirs, ast.FunctionDef):
        return False
    def sig(f):
        return ([a.arg for a in f.args.posonlyargs + f.args.args], [a.arg for a in f.args.kwonlyargs],
                [_norm_dump(d) for d in f.args.defaults], f.args.vararg is None, f.args.kwarg is None)

    if sig(mine) != sig(theirs):
        return False
    base_mine, t1 = _run_traced(mine, my_cls, frozenset())
    base_theirs, t2 = _run_traced(theirs, their_cls, frozenset())
    if base_mine is None or base_theirs is None or base_mine != base_theirs or base_mine[0][0] != "return":
        return False
    paths = list(dict.fromkeys(t1.seen + t2.seen))[:40]
    for p in paths:  # each attribute missing in turn: the same calls and the same exception
        a, _ = _run_traced(mine, my_cls, frozenset([p]))
        b, _ = _run_traced(theirs, their_cls, frozenset([p]))
        if a is None or a != b:
            return False
    return True


def _definitions_present(git: Git, head: str, old_parent: str, old_commit: str, patch: PatchFile) -> tuple[bool, str]:
    """Every definition the patch adds or changes is in head with the same behaviour, and the
    patch changes nothing else (imports aside). Returns (verdict, explanation)."""
    checked: list[str] = []
    for path in patch.files:
        if not path.endswith(".py"):
            return False, f"{path} is not Python"
        pre_text = _blob(git, old_parent, path) or ""
        post_text = _blob(git, old_commit, path)
        new_text = _blob(git, head, path)
        if post_text is None:
            return False, f"the patch deletes {path}"
        if new_text is None:
            return False, f"{path} is not in the new upstream"
        try:
            pre, post, new = _parse(pre_text), _parse(post_text), _parse(new_text)
        except SyntaxError as e:
            return False, f"{path} does not parse ({e.msg})"
        pre_d, post_d, new_d = _defs(pre), _defs(post), _defs(new)
        changed = {q for q, n in post_d.items() if q not in pre_d or _fingerprint(pre_d[q]) != _fingerprint(n)}
        removed = {q for q in pre_d if q not in post_d}
        if _remainder(pre, changed | removed) != _remainder(post, changed | removed):
            return False, f"the patch changes {path} outside the definitions it adds"
        for q in sorted(removed):
            if q in new_d:
                return False, f"the patch removes {q}, which the new upstream still has"

        def cls_of(defs, q):
            owner = q.rsplit(".", 1)[0] if "." in q else None
            node = defs.get(owner) if owner else None
            return node if isinstance(node, ast.ClassDef) else None

        # private helpers the patch adds are compared through the public defs that call them
        public = [q for q in changed if not q.rsplit(".", 1)[-1].startswith("_") or q in new_d]
        private = [q for q in changed if q not in public]
        if not public:
            return False, f"the patch adds only private helpers to {path}"
        for q in sorted(public):
            if q not in new_d:
                return False, f"{q} is not in the new upstream"
            if not _same_behaviour(post_d[q], cls_of(post_d, q), new_d[q], cls_of(new_d, q)):
                return False, f"{q} behaves differently in the new upstream"
            checked.append(q.rsplit(".", 1)[-1])
        for q in private:
            owner = q.rsplit(".", 1)[0] if "." in q else None
            name = q.rsplit(".", 1)[-1]
            used = any(
                isinstance(n, ast.Attribute) and n.attr == name
                for p in public
                if p.startswith(f"{owner}.") or owner is None
                for n in ast.walk(post_d[p])
            )
            if not used:
                return False, f"the patch adds {q}, which is not in the new upstream and not used by what is"
    if not checked:
        return False, "the patch adds no definitions"
    return True, f"every definition it adds is there with the same behaviour ({', '.join(checked)})"


def _oid(git: Git, commit: str, path: str) -> str | None:
    got = git.cat(f"{commit}:{path}")
    return got[0] if got is not None and got[1] == "blob" else None


_DEFS_MEMO: dict[tuple, tuple[bool, str]] = {}


def _upstream_evidence(git: Git, head: str, old_parent: str, old_commit: str, entry: Entry, patch: PatchFile) -> str:
    """Why the change is already in head ('' when it is not)."""
    if _new_sides_present(git, head, patch, entry.strip) and _reverse_applies(git, head, patch.data, entry.strip):
        return "verified: the patch reverse-applies to the new upstream"
    ids = tuple((p, *(_oid(git, c, p) for c in (old_parent, old_commit, head))) for p in patch.files)
    if all(pre == new for _, pre, _, new in ids):
        return ""  # the new upstream has the very files the patch was made on: not there
    if ids not in _DEFS_MEMO:  # the same files give the same answer (the watch meets them in several releases)
        _DEFS_MEMO[ids] = _definitions_present(git, head, old_parent, old_commit, patch)
    ok, why = _DEFS_MEMO[ids]
    if ok:
        return f"verified: {why}"
    return ""


# --------------------------------------------------------------------------------------
# recorded resolutions


@dataclass
class Recorded:
    action: str  # replace | drop
    why: str
    patch_sha256: str
    data: bytes | None = None
    conflict: str = ""  # conflict_key() of the conflict it resolves (like git rerere)
    version: str = ""  # the release it was recorded for


def resolutions_dir(project: Path, version: str) -> Path:
    return Path(project) / RESOLUTIONS_DIR / version


def read_resolutions(project: Path, version: str) -> tuple[dict[str, Recorded], dict[str, str]]:
    d = resolutions_dir(project, version)
    recs: dict[str, Recorded] = {}
    target: dict[str, str] = {}
    f = d / "resolutions.toml"
    if f.is_file():
        try:
            data = tomllib.loads(f.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise RebaseError(f"{f}: not valid TOML ({e})") from None
        for name, t in (data.get("patch") or {}).items():
            action = t.get("action")
            if action not in ("replace", "drop"):
                raise RebaseError(f"{f}: patch {name!r}: action must be 'replace' or 'drop'")
            if not re.fullmatch(r"[0-9a-f]{64}", str(t.get("patch_sha256", ""))):
                raise RebaseError(f"{f}: patch {name!r}: patch_sha256 must be 64 hex digits")
            body = None
            if action == "replace":
                pf = d / name
                if not pf.is_file():
                    raise RebaseError(f"{f}: patch {name!r} is 'replace' but {pf} is missing")
                body = pf.read_bytes()
            recs[name] = Recorded(action, str(t.get("why", "")).strip(), t["patch_sha256"], body, str(t.get("conflict", "")), version)
    tf = d / "target.toml"
    if tf.is_file():
        try:
            t = tomllib.loads(tf.read_text(encoding="utf-8")).get("target", {})
        except tomllib.TOMLDecodeError as e:
            raise RebaseError(f"{tf}: not valid TOML ({e})") from None
        target = {k: str(v) for k, v in t.items() if k in ("version", "tag", "commit", "sdist_sha256")}
    return recs, target


def _toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def write_resolutions(project: Path, version: str, recs: dict[str, Recorded]) -> None:
    d = resolutions_dir(project, version)
    lines = [
        f"# Recorded resolutions for rebasing the series onto sglang {version}.",
        "# Written by `sglpatch rebase` (hand resolutions are recorded on success); see docs/rebase.md.",
        "# action = \"replace\": apply the file of the same name in this folder instead of the patch;",
        "# action = \"drop\": leave the patch out. Used only for the patch whose sha256 is patch_sha256.",
        "",
    ]
    for name in sorted(recs):
        r = recs[name]
        lines += [f"[patch.{_toml_str(name)}]", f"action = {_toml_str(r.action)}", f"patch_sha256 = {_toml_str(r.patch_sha256)}"]
        if r.conflict:
            lines.append(f"conflict = {_toml_str(r.conflict)}")
        lines.append(f"why = {_toml_str(r.why)}")
        lines.append("")
        if r.action == "replace" and r.data is not None:
            write_if_changed(d / name, r.data)
    write_if_changed(d / "resolutions.toml", "\n".join(lines).encode())


def conflict_key(git: Git, tree: str, files: list[str]) -> str:
    """The conflict itself, like git rerere: the conflicting files and the text of every
    conflict region (both sides) of the 3-way result, marker labels dropped, hashed."""
    h = hashlib.sha256()
    for path in sorted(files):
        text = _blob(git, tree, path)
        h.update(f"{path}\0".encode())
        if text is None:
            h.update(b"gone\0")
            continue
        inside = False
        for line in text.split("\n"):
            if line.startswith("<<<<<<<"):
                inside = True
                h.update(b"<<<\n")
            elif inside and line.startswith((">>>>>>>", "=======", "|||||||")):
                h.update(line[:3].encode() + b"\n")
                inside = not line.startswith(">>>>>>>")
            elif inside:
                h.update(line.encode() + b"\n")
    return h.hexdigest()


def _rerere(project: Path, name: str, key: str, sha: str, o: Outcome) -> Recorded | None:
    """A recorded resolution of this patch for the same conflict, from any release's folder."""
    root = project / RESOLUTIONS_DIR
    other = None
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if not (d / "resolutions.toml").is_file():
            continue
        rec = read_resolutions(project, d.name)[0].get(name)
        if rec is None:
            continue
        if rec.conflict == key or rec.patch_sha256 == sha and not rec.conflict:
            return rec
        other = rec
    if other is not None:
        o.note = (o.note + "; " if o.note else "") + f"the recorded resolution for {other.version} is for another conflict: not used"
    return None


# --------------------------------------------------------------------------------------
# the engine


@dataclass
class Plan:
    """Everything a rebase needs, saved as state between --continue calls."""

    project: str
    source: str
    old_lock: str  # dumps
    new_lock: str  # dumps (blobs filled at the end)
    old_base: str
    old_commits: list[str]
    names: list[str]
    strips: list[int]
    sha256s: list[str]
    onto: str
    head: str
    next: int = 0
    outcomes: list[dict] = field(default_factory=list)
    hand: dict[str, str] = field(default_factory=dict)  # name -> "replace"/"drop" resolved during this rebase
    orig: dict = field(default_factory=dict)
    stopped: dict = field(default_factory=dict)


def _step(
    git: Git,
    plan: Plan,
    i: int,
    project_patch: PatchFile,
    recs: dict[str, Recorded],
    dry_run: bool,
) -> Outcome:
    """Classify patch i on plan.head and, when it can go on alone, extend plan.head."""
    name = plan.names[i]
    entry = Entry(name=name, strip=plan.strips[i])
    old_commit = plan.old_commits[i]
    old_parent = plan.old_base if i == 0 else plan.old_commits[i - 1]
    patch = project_patch
    head = plan.head
    hint = patch.dep3.get("Applied-Upstream", "")
    o = Outcome(name=name, subject=patch.subject, status="", hint=hint)
    evidence = _upstream_evidence(git, head, old_parent, old_commit, entry, patch)
    new_commit = None
    if evidence:
        o.status, o.action, o.how = "upstream", "drop", evidence
        if not hint:
            o.note = "no Applied-Upstream field; found in the tree"
        return o
    try:
        new_commit = stack.commit_patch(git, head, entry, patch, exact=True)
        o.status = "exact"
    except SglpatchError:
        clean, tree, files = _three_way(git, head, old_parent, old_commit)
        if clean and tree == _tree(git, head):
            o.status, o.action = "upstream", "drop"
            o.how = "verified: the 3-way result equals the new upstream"
            return o
        if clean:
            o.status = "3way"
            new_commit = _commit_like(git, tree, head, old_commit)
            problems = mergecheck.check(git, old_parent, head, new_commit, patch.files)
            if problems:  # merged is not working: never carried unattended
                o.status, o.how, o.hunks = "3way-broken", f"3-way but broken: {problems[0]}", problems
                o.files = sorted({x.split(":", 1)[0] for x in problems})
        else:
            modified = [f for f in patch.files if _blob(git, old_parent, f) is not None]
            gone = [f for f in modified if _blob(git, head, f) is None]
            o.status = "obsolete" if modified and len(gone) == len(modified) else "conflict"
            o.files = files
            o.hunks = _failing_hunks(git, head, patch, entry.strip)
            for f in files:
                o.hunks += _conflict_regions(git, tree, f)
    if hint:
        o.note = f"Applied-Upstream says {hint!r}, but the change is not in the new tree: kept"
    rec = recs.get(name)
    key = conflict_key(git, tree, o.files) if o.status in ("conflict", "obsolete") else ""
    o.conflict = key
    if key and (rec is None or rec.patch_sha256 != plan.sha256s[i]):
        rec = _rerere(Path(plan.project), name, key, plan.sha256s[i], o) or rec
    if rec is not None and rec.patch_sha256 != plan.sha256s[i] and not (key and rec.conflict == key):
        o.note = (o.note + "; " if o.note else "") + (
            f"the recorded resolution in {RESOLUTIONS_DIR}/ is for another version of this patch: not used"
        )
        rec = None
    if rec is not None:
        if rec.action == "drop":
            o.action, o.how = "recorded-drop", f"recorded decision: {rec.why}" if rec.why else "recorded decision"
            return o
        rp = parse_patch(name, rec.data, entry.strip)
        try:
            new_commit = stack.commit_patch(git, head, entry, rp, exact=True)
        except SglpatchError as e:
            o.action = "stop"
            o.note = (o.note + "; " if o.note else "") + f"the recorded resolution no longer applies ({e})"
            return o
        problems = mergecheck.check(git, old_parent, head, new_commit, rp.files)
        if problems:
            o.action = "stop"
            o.hunks = o.hunks + problems
            o.note = (o.note + "; " if o.note else "") + f"the recorded resolution applies but is broken on this upstream: {problems[0]}"
            return o
        o.action = "recorded"
        o.how = f"recorded resolution {RESOLUTIONS_DIR}/{rec.version or '{version}'}/{name}" + (f": {rec.why}" if rec.why else "")
        o.new_commit = new_commit
        plan.head = new_commit
        return o
    if o.status in ("conflict", "obsolete", "3way-broken"):
        o.action = "stop"
        return o
    o.action = "keep" if o.status == "exact" else "refresh"
    o.new_commit = new_commit
    plan.head = new_commit
    return o


def _load_old_patches(project_root: Path, plan: Plan) -> list[PatchFile]:
    series = read_series(project_root)
    by = {e.name: e for e in series.entries}
    out = []
    for name in plan.names:
        out.append(parse_patch(name, (project_root / PATCH_DIR / name).read_bytes(), by[name].strip))
    return out


def _run_steps(git: Git, plan: Plan, dry_run: bool) -> list[Outcome]:
    """Go on from plan.next; returns all outcomes; stops (real rebase) at the first 'stop'."""
    project_root = Path(plan.project)
    new_lock = Lock.parse(plan.new_lock, "target")
    outcomes = [Outcome(**d) for d in plan.outcomes]
    n = len(plan.names)
    if plan.next >= n:  # all classified: a resumed finish, whose project may be exported already
        return outcomes
    recs, _ = read_resolutions(project_root, new_lock.version)
    patches = _load_old_patches(project_root, plan)
    while plan.next < n:
        i = plan.next
        o = _step(git, plan, i, patches[i], recs, dry_run)
        o.how = o.how.replace("{version}", new_lock.version)
        if not dry_run:
            say(f"[{i + 1}/{n}] {o.name}: {o.status} -> {o.action}")
        if o.action == "stop" and not dry_run:
            return outcomes + [o]
        outcomes.append(o)
        plan.outcomes.append(asdict(o))
        plan.next = i + 1
        if not dry_run:
            crashpoint(f"rebase:patch:{i + 1}")
    return outcomes


# --------------------------------------------------------------------------------------
# preparing: old stack, new upstream


def _in_sync_stack(git: Git, project: stack.Project) -> tuple[str, list[str]] | None:
    """(upstream, commits) of DIR when it holds exactly the project's series on its pin."""
    base = git.rev(up.UPSTREAM_BRANCH)
    head = git.rev(stack.PATCHED_BRANCH)
    if not base or not head or up.upstream_pin(git) != project.lock.pin_digest():
        return None
    rec_digest, rec_head = stack._recorded(git)
    if rec_head != head or rec_digest != project.digest(base):
        return None
    commits = git.commits(base, head)
    return (base, commits) if len(commits) == len(project.patches) else None


def _build_new_upstream(git: Git, lock: Lock, source: str, url: str | None) -> str:
    if source in ("sdist", "wheel"):
        return up.build_registry(git, lock)
    if source == "git":
        return up.build_from_git(git, lock, url)
    raise RebaseError(f"unknown source {source!r}; use auto, git, sdist or wheel")


def _resolve_source(project: stack.Project, onto: str, source: str, url: str | None) -> str:
    """--source auto: git when the URL answers, else the sdist, else the wheel (says which and why)."""
    if source != "auto":
        return source
    m = up._ONTO_VERSION_RE.match(onto.strip())
    if not m:
        return "git"
    tag = onto if onto.startswith("v") else f"v{m.group(1)}"
    chosen, why = up.choose_source(url or project.lock.url, tag, project.lock.name, m.group(1))
    say(f"source: {chosen} ({why})")
    return chosen


def _prepare(git: Git, project_root: Path, onto: str, source: str, commit: str | None, url: str | None, in_sync,
             cached: bool = False) -> Plan:
    """cached (dry runs): registry trees come from the tree cache (sglpatch.treecache), which git
    (a scratch repository) then borrows; a real rebase commits them into the workdir."""
    project = stack.Project.load(project_root)
    source = _resolve_source(project, onto, source, url)
    registry = treecache.registry_commit if cached else up.build_registry
    if in_sync is None:
        say(f"building the current stack on {project.lock.describe()} to compare against")
        old_base = up.build_from_git(git, project.lock, url) if source == "git" else registry(git, project.lock)
        up.verify_blobs(git, old_base, project.lock, source)
        old_commits = stack.build_chain(git, project, old_base, progress=False)
    else:
        old_base, old_commits = in_sync
    version_guess = up._ONTO_VERSION_RE.match(onto)
    recorded_target = {}
    if version_guess:
        _, recorded_target = read_resolutions(project_root, version_guess.group(1))
    new_lock = up.target_lock(project.lock, onto, source, recorded=recorded_target, commit=commit, url=url)
    if new_lock.pin_digest() == project.lock.pin_digest():
        raise RebaseError(f"the series is already pinned to {new_lock.describe()}; nothing to rebase")
    t0 = time.monotonic()
    onto_commit = registry(git, new_lock) if cached and source in ("sdist", "wheel") else _build_new_upstream(git, new_lock, source, url)
    say(f"new upstream {new_lock.describe()} ready from {source} in {time.monotonic() - t0:.1f}s")
    return Plan(
        project=str(project_root),
        source=source,
        old_lock=project.lock.dumps(),
        new_lock=new_lock.dumps(),
        old_base=old_base,
        old_commits=old_commits,
        names=[e.name for e in project.series.entries],
        strips=[e.strip for e in project.series.entries],
        sha256s=[hashlib.sha256(p.data).hexdigest() for p in project.patches],
        onto=onto_commit,
        head=onto_commit,
    )


def classify(git: Git, project_root: Path, old_base: str, old_commits: list[str], new_lock: Lock, onto: str, source: str) -> list[Outcome]:
    """Classify every patch of the project's series on `onto` (dry run; the watch calls this
    once per release with the old stack built once). git must hold all of these objects."""
    project = stack.Project.load(project_root)
    plan = Plan(
        project=str(project_root), source=source, old_lock=project.lock.dumps(), new_lock=new_lock.dumps(),
        old_base=old_base, old_commits=list(old_commits), names=[e.name for e in project.series.entries],
        strips=[e.strip for e in project.series.entries], sha256s=[hashlib.sha256(p.data).hexdigest() for p in project.patches],
        onto=onto, head=onto,
    )
    outcomes = _run_steps(git, plan, dry_run=True)
    for o in outcomes:
        o.how = o.how.replace("{version}", new_lock.version)
    return outcomes


# --------------------------------------------------------------------------------------
# dry run: the upstream watch


@dataclass
class DryRunResult:
    outcomes: list[Outcome]
    target: str
    exit_code: int
    lines: list[str]


def dry_run(
    project_root: Path, workdir: Path | None, onto: str, source: str = "sdist", commit: str | None = None, url: str | None = None
) -> DryRunResult:
    """Classify without changing anything: work happens in a scratch repository that borrows
    DIR's objects read-only (objects/info/alternates); DIR's refs, files and config stay as they are."""
    project_root = Path(project_root).resolve()
    project = stack.Project.load(project_root)
    with tempfile.TemporaryDirectory(prefix="sglpatch-watch-") as tmp:
        scratch = Path(tmp) / "repo"
        scratch.mkdir()
        sg = Git(scratch)
        sg.run("init", "-q", "--bare")
        in_sync = None
        if workdir is not None and (Path(workdir) / ".git").is_dir():
            dg = stack.open_workdir(Path(workdir), create=False)
            in_sync = _in_sync_stack(dg, project)
            if in_sync is not None:
                objects = (Path(workdir) / ".git" / "objects").resolve()
                (scratch / "objects" / "info").mkdir(parents=True, exist_ok=True)
                (scratch / "objects" / "info" / "alternates").write_text(f"{objects}\n")
        plan = _prepare(sg, project_root, onto, source, commit, url, in_sync, cached=True)
        outcomes = _run_steps(sg, plan, dry_run=True)
    new_lock = Lock.parse(plan.new_lock, "target")
    if any(o.action == "stop" for o in outcomes):
        code = EXIT_HUMAN
    elif all(o.action == "keep" for o in outcomes):
        code = EXIT_NOTHING
    else:
        code = EXIT_UNATTENDED
    verdict = {
        EXIT_NOTHING: "every patch applies exactly: `sglpatch rebase` will only move the pin",
        EXIT_UNATTENDED: "the series needs work that `sglpatch rebase` does unattended",
        EXIT_HUMAN: "the series needs a human: conflicts without a recorded resolution",
    }[code]
    lines = [f"upstream watch: {project.lock.describe()} -> {new_lock.describe()} (dry run, nothing changed)"]
    lines += _table(outcomes)
    lines.append(f"verdict: {verdict} (exit {code})")
    return DryRunResult(outcomes, new_lock.version, code, lines)


# --------------------------------------------------------------------------------------
# real rebase: state, stop, continue, abort, finish


def _state_dir(git: Git) -> Path:
    return git.workdir / ".git" / STATE_DIR


def _save(git: Git, plan: Plan) -> None:
    write_if_changed(_state_dir(git) / "state.json", json.dumps(asdict(plan), indent=1, sort_keys=True).encode())


def _load(git: Git) -> Plan:
    f = _state_dir(git) / "state.json"
    if not f.is_file():
        if _state_dir(git).exists():  # a rebase killed before it saved its state: nothing to resume or restore
            raise RebaseError(
                f"no rebase to resume in {git.workdir}: one was killed before it changed anything; "
                "re-run `sglpatch rebase --onto ...`, which clears what it left"
            )
        raise RebaseError(f"no rebase in progress in {git.workdir}")
    return Plan(**json.loads(f.read_text()))


def _in_progress(git: Git) -> str:
    """The one line for a new rebase while state.json exists: what happened, what to run."""
    wd = git.workdir
    plan = _load(git)
    if plan.stopped:
        i = plan.stopped["index"]
        return (
            f"a rebase is already in progress in {wd}, stopped at patch {i + 1}/{len(plan.names)} ({plan.names[i]}) for you; "
            f"resolve it, then `sglpatch rebase --workdir {wd} --continue` (or `--skip` / `--abort`)"
        )
    return (
        f"a rebase is already in progress in {wd}, but its process was interrupted (killed?) before it finished; "
        f"`sglpatch rebase --workdir {wd} --continue` completes it, or `--abort` puts {wd} and the project back as they were"
    )


def _managed_paths(project_root: Path, version: str, report_name: str) -> tuple[list[str], list[str]]:
    files = [SERIES_NAME, "upstream.lock", CHANGELOG]
    dirs = [PATCH_DIR, f"{RESOLUTIONS_DIR}/{version}", f"{REPORTS_DIR}/{report_name}"]
    return files, dirs


def _snapshot_project(git: Git, project_root: Path, version: str, report_name: str) -> None:
    snap = _state_dir(git) / "project"
    if snap.exists():
        shutil.rmtree(snap)
    snap.mkdir(parents=True)
    files, dirs = _managed_paths(project_root, version, report_name)
    present = []
    for rel in files:
        if (project_root / rel).is_file():
            present.append(rel)
    for d in dirs:
        root = project_root / d
        if root.is_dir():
            present += sorted(str(p.relative_to(project_root)) for p in root.rglob("*") if p.is_file())
    for rel in present:
        dest = snap / "files" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(project_root / rel, dest)
    (snap / "manifest.json").write_text(json.dumps({"files": files, "dirs": dirs, "present": present}))


def _restore_project(git: Git, project_root: Path) -> None:
    snap = _state_dir(git) / "project"
    manifest = json.loads((snap / "manifest.json").read_text())
    present = set(manifest["present"])
    for d in manifest["dirs"]:
        root = project_root / d
        if root.is_dir():
            for p in sorted(root.rglob("*"), reverse=True):
                rel = str(p.relative_to(project_root))
                if p.is_file() and rel not in present:
                    p.unlink()
                elif p.is_dir() and not any(p.iterdir()):
                    p.rmdir()
            if root.is_dir() and not any(root.iterdir()):
                root.rmdir()
    for rel in manifest["files"]:
        if rel not in present and (project_root / rel).is_file():
            (project_root / rel).unlink()
    for rel in sorted(present):
        write_if_changed(project_root / rel, (snap / "files" / rel).read_bytes())
        shutil.copystat(snap / "files" / rel, project_root / rel)


def _report_name(old: Lock, new: Lock) -> str:
    return f"{old.version}..{new.version}"


def start(
    project_root: Path, workdir: Path, onto: str, source: str = "sdist", commit: str | None = None, url: str | None = None
) -> list[str]:
    project_root = Path(project_root).resolve()
    project = stack.Project.load(project_root)
    git = stack.open_workdir(Path(workdir), create=False)
    state = _state_dir(git) / "state.json"
    if state.is_file():
        raise RebaseError(_in_progress(git))
    with exclusive(stack._lockfile(git), str(git.workdir)):
        if state.is_file():
            raise RebaseError(_in_progress(git))
        if _state_dir(git).exists():  # a rebase killed before it saved state.json: it had changed nothing yet
            say(f"removing {_state_dir(git)} left by a killed rebase (no state saved in it: nothing to resume)")
            shutil.rmtree(_state_dir(git))
        shutil.rmtree(git.workdir / ".git" / up.SCRATCH, ignore_errors=True)  # left by a killed run
        dirty = git.dirty_files()
        if dirty:
            raise RebaseError(f"{git.workdir} has uncommitted changes ({', '.join(dirty[:3])}); commit and `sglpatch export`, or stash them")
        in_sync = _in_sync_stack(git, project)
        if in_sync is None:
            raise RebaseError(
                f"{git.workdir} does not hold the project's series on its pin (unexported commits, or not applied); "
                "run `sglpatch export` or `sglpatch apply` first, then rebase"
            )
        branch = git.current_branch()
        plan = _prepare(git, project_root, onto, source, commit, url, in_sync)
        crashpoint("rebase:upstream")
        plan.orig = {
            "branch": branch,
            "head": git.head_commit(),
            "upstream": git.rev(up.UPSTREAM_BRANCH),
            "patched": git.rev(stack.PATCHED_BRANCH),
            "applied": git.config_get(stack.APPLIED_KEY),
        }
        new_lock = Lock.parse(plan.new_lock, "target")
        _state_dir(git).mkdir(parents=True, exist_ok=True)
        _snapshot_project(git, project_root, new_lock.version, _report_name(project.lock, new_lock))
        git.update_ref(f"{REF_PREFIX}/onto", plan.onto, message="sglpatch rebase: new upstream")
        crashpoint("rebase:snapshot")
        _save(git, plan)  # from here on a rebase is in progress: --continue / --abort
        crashpoint("rebase:saved")
        _drive(git, plan)
    return _finish(git, plan)


def _drive(git: Git, plan: Plan) -> list[str]:
    outcomes = _run_steps(git, plan, dry_run=False)
    git.update_ref(f"{REF_PREFIX}/head", plan.head, message="sglpatch rebase: progress")
    _save(git, plan)
    crashpoint("rebase:progress")
    if outcomes and outcomes[-1].action == "stop" and plan.next < len(plan.names):
        _stop(git, plan, outcomes[-1])  # raises RebaseStopped
    return []


def _stop(git: Git, plan: Plan, o: Outcome) -> list[str]:
    i = plan.next
    data = stack.format_patch(git, plan.old_commits[i])
    git.run("checkout", "-q", "--detach", plan.head)
    crashpoint("rebase:stop:checkout")
    with tempfile.TemporaryDirectory(prefix="sglpatch-rb-", dir=up.scratch_dir(git)) as tmp:
        pf = Path(tmp) / "patch"
        pf.write_bytes(data)
        rc, out, err = git.run("apply", "--3way", "--index", f"-p{plan.strips[i]}", "--whitespace=nowarn", "--", str(pf), check=False)
    unmerged = sorted(set(line.split("\t", 1)[1] for line in git.run("ls-files", "-u").splitlines() if "\t" in line))
    crashpoint("rebase:stop:applied")
    plan.stopped = {"index": i, "files": unmerged or o.files, "outcome": asdict(o)}
    _save(git, plan)
    crashpoint("rebase:stop:saved")
    wd = git.workdir
    lines = _table([Outcome(**d) for d in plan.outcomes] + [o])
    lines += [
        "",
        f"rebase stopped at patch {i + 1}/{len(plan.names)}: {o.name} ({o.subject})",
        f"{o.status}: " + (", ".join(plan.stopped["files"]) or "see above"),
        f"DIR {wd} is on a detached HEAD at the new stack so far, with the patch applied and conflict markers in place.",
        "next:",
        f"  1. edit the files above in {wd} (look for <<<<<<< / >>>>>>>), keeping the patch's intent on the new code",
        f"  2. sglpatch rebase --workdir {wd} --continue      # commits your resolution, records it, goes on",
        f"     sglpatch rebase --workdir {wd} --skip          # or: drop this patch (recorded as a decision)",
        f"     sglpatch rebase --workdir {wd} --abort         # or: put DIR and the project back exactly as before",
    ]
    raise RebaseStopped("\n".join(lines))


def continue_(workdir: Path, skip: bool = False) -> list[str]:
    git = stack.open_workdir(Path(workdir), create=False)
    plan = _load(git)
    with exclusive(stack._lockfile(git), str(git.workdir)):
        if not plan.stopped:  # the process was killed before it stopped or finished: resume
            if git.current_branch() is None and git.head_commit() == plan.head:
                # killed inside the stop: the half-applied patch there is ours, the stop redoes it
                git.run("reset", "-q", "--hard", plan.head)
            _drive(git, plan)
        else:
            _resolved(git, plan, skip)
    return _finish(git, plan)  # outside the lock: its export takes the lock itself


def _resolved(git: Git, plan: Plan, skip: bool) -> None:
    """--continue / --skip after a stop: record the resolution, go on."""
    i = plan.stopped["index"]
    o = Outcome(**plan.stopped["outcome"])
    if skip:
        git.run("reset", "-q", "--hard", plan.head)
        o.action, o.how = "skip", "dropped by hand (--skip)"
        plan.hand[o.name] = "drop"
    else:
        touched = sorted(set(plan.stopped["files"]) | set(git.dirty_files()))
        git.run("add", "-u")
        for f in plan.stopped["files"]:
            if (git.workdir / f).exists():
                git.run("add", "--", f)
        left = []
        for f in touched:
            p = git.workdir / f
            if p.is_file():
                text = p.read_text(errors="replace")
                if re.search(r"^(<<<<<<< |>>>>>>> )", text, re.M):
                    left.append(f)
        if left:
            raise RebaseError(f"conflict markers are still in {', '.join(left)}; resolve them, then --continue again")
        tree = git.run("write-tree")
        if tree == _tree(git, plan.head):
            o.action, o.how = "skip", "the resolution left no change: dropped"
            plan.hand[o.name] = "drop"
        else:
            new = _commit_like(git, tree, plan.head, plan.old_commits[i])
            git.run("update-ref", "--no-deref", "-m", "sglpatch rebase: resolved", "HEAD", new)
            plan.head = new
            o.action, o.how, o.new_commit = "hand", "resolved by hand", new
            plan.hand[o.name] = "replace"
    plan.outcomes.append(asdict(o))
    plan.next = i + 1
    plan.stopped = {}
    _save(git, plan)
    _drive(git, plan)


def abort(workdir: Path) -> list[str]:
    git = stack.open_workdir(Path(workdir), create=False)
    plan = _load(git)
    orig = plan.orig
    with exclusive(stack._lockfile(git), str(git.workdir)):
        # files first (HEAD may be detached at the new stack), then refs, then HEAD
        git.run("reset", "-q", "--hard", orig["head"])
        git.update_ref(f"refs/heads/{up.UPSTREAM_BRANCH}", orig["upstream"], message="sglpatch rebase --abort")
        git.update_ref(f"refs/heads/{stack.PATCHED_BRANCH}", orig["patched"], message="sglpatch rebase --abort")
        if orig.get("branch"):
            git.run("symbolic-ref", "HEAD", f"refs/heads/{orig['branch']}")
        git.run("reset", "-q", "--hard", orig["head"])
        if orig.get("applied"):
            git.config_set(stack.APPLIED_KEY, orig["applied"])
        for ref in ("onto", "head"):
            git.run("update-ref", "-d", f"{REF_PREFIX}/{ref}", check=False)
        _restore_project(git, Path(plan.project))
        shutil.rmtree(_state_dir(git))
    return [f"rebase aborted: {git.workdir} and {plan.project} are back as they were"]


def _range_diff(git: Git, plan: Plan, new_base: str, new_head: str) -> str:
    old_head = plan.old_commits[-1] if plan.old_commits else plan.old_base
    rc, out, err = git.run(
        "range-diff", "--no-color", "--creation-factor=95", f"{plan.old_base}..{old_head}", f"{new_base}..{new_head}", check=False, strip=False
    )
    return out if rc == 0 else f"(git range-diff failed: {err.strip()})\n"


def _split_range_diff(text: str) -> list[str]:
    parts, cur = [], []
    for line in text.splitlines():
        if re.match(r"^\s*(\d+|-):\s+[0-9a-f-]+ [<>=!] ", line) and cur:
            parts.append("\n".join(cur))
            cur = []
        cur.append(line)
    if cur:
        parts.append("\n".join(cur))
    return parts


def _changelog_section(old: Lock, new: Lock, source: str, outcomes: list[Outcome], report_rel: str) -> str:
    today = time.strftime("%Y-%m-%d", time.gmtime())
    lines = [
        f"## Rebase onto sglang {new.version} (from {old.version}) - {today}",
        "",
        f"- Target: {new.name} {new.version}, tag {new.tag}, commit {new.commit}, {new.artifact_kind} {new.sdist_filename} sha256 "
        f"{new.sdist_sha256} (source: {source})."
        + (" The release records no commit and GitHub did not answer: the pin says commit = unknown." if new.commit == "unknown" else ""),
    ]
    for o in outcomes:
        if o.action in ("drop", "recorded-drop", "skip"):
            pr = f" Upstream: {o.hint}." if o.hint else ""
            lines.append(f"- `{o.name}` ({o.subject}): {o.status}; dropped from the series. {o.how}.{pr}")
        elif o.action == "recorded":
            lines.append(f"- `{o.name}` ({o.subject}): {o.status}; resolved with the {o.how}.")
        elif o.action == "hand":
            lines.append(f"- `{o.name}` ({o.subject}): {o.status} in {', '.join(o.files)}; resolved by hand and recorded in {RESOLUTIONS_DIR}/{new.version}/.")
        elif o.action == "refresh":
            lines.append(f"- `{o.name}` ({o.subject}): applied with a 3-way merge; refreshed.")
        else:
            lines.append(f"- `{o.name}` ({o.subject}): applies exactly; unchanged.")
        if o.note:
            lines.append(f"  Note: {o.note}.")
    lines.append(f"- Per-patch `git range-diff` old vs new stack: `{report_rel}`.")
    return "\n".join(lines) + "\n"


def _insert_changelog(project_root: Path, section: str, before: str = "") -> None:
    path = project_root / CHANGELOG
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Changelog\n"
    lines = text.split("\n")
    title = section.split("\n", 1)[0].rsplit(" - ", 1)[0]  # the heading without its date
    if sum(x.startswith(title) for x in lines) > sum(x.startswith(title) for x in before.split("\n")):
        return  # a killed earlier run of this rebase inserted it already
    at = next((k for k, line in enumerate(lines) if line.startswith("## ")), None)
    if at is None:
        new = text.rstrip("\n") + "\n\n" + section
    else:
        new = "\n".join(lines[:at]) + ("\n" if at else "") + section + "\n" + "\n".join(lines[at:])
    write_if_changed(path, new.encode())


def _finish(git: Git, plan: Plan) -> list[str]:
    project_root = Path(plan.project)
    old_lock = Lock.parse(plan.old_lock, "old lock")
    new_lock = Lock.parse(plan.new_lock, "target")
    outcomes = [Outcome(**d) for d in plan.outcomes]
    new_base, new_head = plan.onto, plan.head
    report_name = _report_name(old_lock, new_lock)
    # 1. DIR: backups, then the branches
    stamp = time.strftime("%Y%m%d-%H%M%S")
    git.update_ref(f"{stack.BACKUP_PREFIX}/{stamp}-pre-rebase-upstream", plan.orig["upstream"], message="sglpatch rebase")
    git.update_ref(f"{stack.BACKUP_PREFIX}/{stamp}-pre-rebase-patched", plan.orig["patched"], message="sglpatch rebase")
    crashpoint("rebase:finish:backup")
    git.update_ref(f"refs/heads/{up.UPSTREAM_BRANCH}", new_base, message=f"sglpatch rebase: {new_lock.describe()}")
    crashpoint("rebase:finish:upstream")
    if plan.source == "git":
        git.config_set(f"sglpatch.pin-{up.UPSTREAM_BRANCH}", f"{new_lock.pin_digest()} {new_base}")
    if git.current_branch() == stack.PATCHED_BRANCH:
        git.run("reset", "-q", "--keep", new_head)
        git.update_ref(f"refs/heads/{stack.PATCHED_BRANCH}", new_head, message="sglpatch rebase")
    else:
        git.update_ref(f"refs/heads/{stack.PATCHED_BRANCH}", new_head, message="sglpatch rebase")
        git.run("checkout", "-q", stack.PATCHED_BRANCH)
    crashpoint("rebase:finish:patched")
    # 2. report (before export, which deletes dropped patch files)
    report_dir = project_root / REPORTS_DIR / report_name
    rd = _range_diff(git, plan, new_base, new_head)
    snap = _state_dir(git) / "project" / "files"
    for o in outcomes:
        if o.action in ("drop", "recorded-drop", "skip"):
            # from the snapshot: a killed earlier finish may have exported (removed) it already
            write_if_changed(report_dir / "dropped" / o.name, (snap / PATCH_DIR / o.name).read_bytes())
    report = [
        f"# Rebase {old_lock.describe()} -> {new_lock.describe()}",
        "",
        f"source: {plan.source}; new upstream commit in the workdir {new_base}; new patched {new_head}",
        "",
        "```",
        *_table(outcomes),
        "```",
        "",
        "## Per-patch range-diff (old stack vs new stack)",
        "",
    ]
    for part in _split_range_diff(rd):
        report += ["```diff", part, "```", ""]
    write_if_changed(report_dir / "report.md", ("\n".join(report) + "\n").encode())
    write_if_changed(report_dir / "range-diff.txt", rd.encode())
    crashpoint("rebase:finish:report")
    # 3. record hand resolutions
    if plan.hand:
        recs, _ = read_resolutions(project_root, new_lock.version)
        commits = git.commits(new_base, new_head)
        by_subject = {git.subject(c): c for c in commits}
        for k, name in enumerate(plan.names):
            action = plan.hand.get(name)
            if not action:
                continue
            o = next(o for o in outcomes if o.name == name)
            data = stack.format_patch(git, by_subject[o.subject]) if action == "replace" else None
            # keyed by the conflict it resolves (rerere-like), so any release showing the same
            # conflict is offered it; a 3-way-but-broken stop has no conflict: keyed by the patch
            recs[name] = Recorded(action, f"resolved by hand during the rebase onto {new_lock.version}", plan.sha256s[k], data, o.conflict)
        write_resolutions(project_root, new_lock.version, recs)
        crashpoint("rebase:finish:resolutions")
    # 4. patches/ + series, lock (with the blobs of the files the new series touches), CHANGELOG
    return _finish_project(git, plan, outcomes, old_lock, new_lock, new_base, report_dir)


def _finish_project(git, plan, outcomes, old_lock, new_lock, new_base, report_dir) -> list[str]:
    project_root = Path(plan.project)
    res = stack.export(project_root, git.workdir)  # takes the workdir lock itself
    crashpoint("rebase:finish:export")
    project = stack.Project.load(project_root)
    new_lock.blobs = stack.touched_blobs(git, new_base, project.patches)
    write_lock(project_root, new_lock)
    crashpoint("rebase:finish:lock")
    rel = str(report_dir.relative_to(project_root)) + "/report.md"
    before = _state_dir(git) / "project" / "files" / CHANGELOG
    _insert_changelog(
        project_root,
        _changelog_section(old_lock, new_lock, plan.source, outcomes, rel),
        before.read_text(encoding="utf-8") if before.is_file() else "",
    )
    crashpoint("rebase:finish:changelog")
    stack._record(git, project.digest(new_base), git.rev(stack.PATCHED_BRANCH))
    crashpoint("rebase:finish:recorded")
    for ref in ("onto", "head"):
        git.run("update-ref", "-d", f"{REF_PREFIX}/{ref}", check=False)
    (_state_dir(git) / "state.json").unlink()  # first: a kill in the rmtree leaves nothing to resume
    shutil.rmtree(_state_dir(git))
    lines = [f"rebased onto {new_lock.describe()}"] + _table(outcomes)
    lines.append(f"exported: {len(res.written)} written, {len(res.unchanged)} unchanged, {len(res.removed)} removed")
    lines.append(f"report: {rel}; CHANGELOG.md and upstream.lock updated (commit them)")
    return lines
