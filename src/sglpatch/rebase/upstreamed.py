""""Already upstream", verified: normalized AST, or the same trace against recording stand-ins."""

from __future__ import annotations

import ast
import builtins
import functools
import sys

from sglpatch.gitcmd import Git
from sglpatch.series import Entry, PatchFile
from sglpatch.rebase.merge import new_sides_present, reverse_applies


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
        pre_text = git.blob_text(old_parent, path) or ""
        post_text = git.blob_text(old_commit, path)
        new_text = git.blob_text(head, path)
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


def upstream_evidence(git: Git, head: str, old_parent: str, old_commit: str, entry: Entry, patch: PatchFile) -> str:
    """Why the change is already in head ('' when it is not)."""
    if new_sides_present(git, head, patch, entry.strip) and reverse_applies(git, head, patch.data, entry.strip):
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
