"""Dependencies newer than the pins, for `sglpatch watch`: the newest release of each pinned
dependency on the index, and for the packages the series relies on (the project's
``deps/newer.toml``) whether that release changes what the release's tree uses of them.

Mechanical, on the newest watched release: every name its tree imports from the package
(``from flashinfer.comm import X``, ``import flashinfer.comm as c`` ... ``c.X``) is looked up
in the pinned wheel and in the newest one (top-level definitions, re-exports, star imports and
submodules, read with ast; nothing is imported); a name the pinned wheel has and the newer one
lacks is reported with the file:line that uses it, marked when the file is one the series
patches or relies on. Also reported: names dropped from the module namespaces the table lists
(``flashinfer.comm``), and the table's constants whose value changed, with its note. Wheels are
index-verified (sglpatch.upstream.artifacts); what a wheel defines is kept in the tree cache's facts under
its sha256 (each module read when first looked up), what a tree imports under the tree id, so a
warm watch reads no wheel.
"""

from __future__ import annotations

import ast
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path

from sglpatch import toml
from sglpatch.upstream import artifacts, treecache
from sglpatch import series
from sglpatch.errors import SglpatchError
from sglpatch.gitcmd import Git
from sglpatch.watch import supersede


TABLE = Path("deps") / "newer.toml"
_MEMBER = re.compile(r"^[A-Za-z0-9_]+(/[A-Za-z0-9_]+)*\.py$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def load(project: Path) -> dict:
    """{dist: {module, why, exports, constants}} from the project's table ({} when it has none)."""
    path = Path(project) / TABLE
    if not path.is_file():
        return {}
    try:
        out = {}
        for dist, e in toml.loads(path.read_text()).items():
            module, exports = str(e["module"]), [str(x) for x in e.get("exports", [])]
            consts = [(str(c["member"]), str(c["name"]), str(c.get("note", ""))) for c in e.get("constant", [])]
            if not _IDENT.match(module) or not all(_MEMBER.match(m) for m in exports + [c[0] for c in consts]):
                raise ValueError(f"{dist}: module is an import name, members are wheel paths of .py files")
            if not all(_IDENT.match(c[1]) for c in consts):
                raise ValueError(f"{dist}: constant names are identifiers")
            out[re.sub(r"[-_.]+", "-", dist).lower()] = {"module": module, "why": str(e.get("why", "")), "exports": exports, "constants": consts}
        return out
    except (OSError, KeyError, ValueError, TypeError, toml.TOMLDecodeError) as e:
        raise SglpatchError(f"{path}: {e}")


# --------------------------------------------------------------------------------------
# what a wheel defines


def _mod_name(member: str) -> str:
    parts = member[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _bound(body: list, package: str, names: set, stars: list, consts: dict) -> None:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
                        if isinstance(node.value, ast.Constant):
                            consts[n.id] = repr(node.value.value)
        elif isinstance(node, ast.Import):
            names.update((a.asname or a.name.split(".")[0]) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                if a.name == "*":
                    stars.append(base)
                else:
                    names.add(a.asname or a.name)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]:
                _bound(block, package, names, stars, consts)
            for h in getattr(node, "handlers", []):
                _bound(h.body, package, names, stars, consts)


class WheelModules(Mapping):
    """{module: {"names", "stars", "consts", "member"}} of every module of one package in a wheel,
    each module read with ast when first looked up: a wheel such as flashinfer-python 0.7 ships
    3,500 modules (120 MB of Python; parsing them all took minutes), a check reads a few dozen.
    A module whose file does not parse is not there (importing it would fail too). What was read is
    kept in the facts under the wheel's sha256 (``save``), with the module list, so a warm check
    opens no wheel."""

    def __init__(self, path: Path, sha256: str, module: str):
        self.path, self.sha256, self.module = path, sha256, module
        self._facts = treecache.load_facts("wheel-modules", sha256) if sha256 else {}
        known = self._facts.get(module)
        if isinstance(known, dict) and isinstance(known.get("members"), dict) and isinstance(known.get("parsed"), dict):
            self._members, self._parsed = known["members"], known["parsed"]
        else:
            self._members, self._parsed = {}, {}
            with zipfile.ZipFile(path) as zf:
                for member in zf.namelist():
                    if member.startswith(module + "/") and member.endswith(".py") and _MEMBER.match(member):
                        self._members[_mod_name(member)] = member
        self._zf: zipfile.ZipFile | None = None
        self._dirty = not known

    def _read(self, name: str) -> dict | None:
        if name in self._parsed:
            return self._parsed[name]
        member = self._members[name]
        if self._zf is None:
            self._zf = zipfile.ZipFile(self.path)
        names, stars, consts = set(), [], {}
        try:
            tree = ast.parse(self._zf.read(member))
        except (SyntaxError, ValueError):
            got = None
        else:
            pkg = name if member.endswith("/__init__.py") else name.rsplit(".", 1)[0]
            _bound(tree.body, pkg, names, stars, consts)
            got = {"names": sorted(names), "stars": stars, "consts": consts, "member": member}
        self._parsed[name], self._dirty = got, True
        return got

    def __contains__(self, name) -> bool:
        return name in self._members and self._read(name) is not None

    def __getitem__(self, name: str) -> dict:
        got = self._read(name) if name in self._members else None
        if got is None:
            raise KeyError(name)
        return got

    def __iter__(self):  # every module: reads them all
        return (n for n in list(self._members) if n in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def save(self) -> None:
        """Keep what was read (best effort) and close the wheel."""
        if self._zf is not None:
            self._zf.close()
            self._zf = None
        if self.sha256 and self._dirty:
            self._facts[self.module] = {"members": self._members, "parsed": self._parsed}
            treecache.save_facts("wheel-modules", self.sha256, self._facts)
            self._dirty = False


def wheel_names(path: Path, sha256: str, module: str) -> WheelModules:
    """The modules of `module` in the wheel, each read when first looked up (cached by sha256)."""
    return WheelModules(path, sha256, module)


def has(mods: dict, module: str, name: str | None, depth: int = 0) -> bool:
    """Whether `from module import name` (name None: `import module`) works with that wheel."""
    if module not in mods:
        return False
    if name is None or f"{module}.{name}" in mods:
        return True
    m = mods[module]
    if name in m["names"]:
        return True
    return depth < 5 and any(has(mods, s, name, depth + 1) for s in m["stars"])


# --------------------------------------------------------------------------------------
# what a tree uses


def tree_uses(git: Git, tree: str, module: str) -> dict[str, list]:
    """{"module:name": [path, line]}: every import from `module` in the tree's .py files, and the
    attributes read off an imported module (`import flashinfer.comm as c` ... `c.X`), first use."""
    tid = git.tree_of(tree)
    facts = treecache.load_facts("uses", tid)
    if module in facts:
        return facts[module]
    rc, out, _ = git.run("grep", "-l", "-w", "-F", module, tree, "--", "*.py", check=False)
    uses: dict[str, list] = {}
    for spec in out.splitlines() if rc == 0 else []:
        path = spec.split(":", 1)[1]
        text = git.blob_text(tree, path)
        try:
            t = ast.parse(text or "")
        except (SyntaxError, ValueError):
            continue
        alias: dict[str, str] = {}
        for node in ast.walk(t):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == module:
                uses.setdefault(f"{node.module}:", [path, node.lineno])
                for a in node.names:
                    if a.name != "*":
                        uses.setdefault(f"{node.module}:{a.name}", [path, node.lineno])
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == module:
                        uses.setdefault(f"{a.name}:", [path, node.lineno])
                        alias[a.asname or module] = a.name if a.asname else module
        for node in ast.walk(t):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                chain, n = [], node
                while isinstance(n, ast.Attribute):
                    chain.append(n.attr)
                    n = n.value
                if isinstance(n, ast.Name) and n.id in alias:
                    chain.reverse()
                    uses.setdefault(f"{alias[n.id]}:{'.'.join(chain)}", [path, node.lineno])
    facts[module] = uses
    treecache.save_facts("uses", tid, facts)
    return uses


def _resolves(mods: dict, key: str) -> bool:
    """A use "mod:a.b.c" works when mod imports and the chain resolves through submodules."""
    mod, _, chain = key.partition(":")
    parts = chain.split(".") if chain else []
    if not parts:
        return has(mods, mod, None)
    while len(parts) > 1 and f"{mod}.{parts[0]}" in mods:
        mod, parts = f"{mod}.{parts[0]}", parts[1:]
    return has(mods, mod, parts[0])


# --------------------------------------------------------------------------------------
# the check


def series_files(project_root: Path, project, version: str) -> set[str]:
    """The paths the series patches on that release, or relies on (supersession probes)."""
    out = set()
    for p in project.patches:
        out.update(p.files)
        probe = supersede.parse(p)
        out.update(probe.files if probe else [])
    rdir = Path(project_root) / "resolutions" / version
    for f in sorted(rdir.glob("*.patch")) if rdir.is_dir() else []:
        try:
            out.update(series.parse_patch(f.name, f.read_bytes()).files)
        except SglpatchError:
            continue
    return out


def _wheel(dist: str, version: str) -> tuple[Path, str]:
    art, path = artifacts.fetch(dist, version, "wheel")
    return path, art.sha256


def check(dist: str, cfg: dict, pinned: str, newest: str, git: Git, tree: str, relied: set[str]) -> list[dict]:
    """What the newest release of dist changes against the pinned one, for that tree."""
    old_path, old_sha = _wheel(dist, pinned)
    new_path, new_sha = _wheel(dist, newest)
    old, new = wheel_names(old_path, old_sha, cfg["module"]), wheel_names(new_path, new_sha, cfg["module"])
    try:
        return changes(cfg, old, new, tree_uses(git, tree, cfg["module"]), relied, newest)
    finally:
        old.save()
        new.save()


def changes(cfg: dict, old: dict, new: dict, uses: dict, relied: set[str], newest: str) -> list[dict]:
    """The report lines: uses that stop resolving, dropped exports, changed constants."""
    out = []
    gone = sorted(k for k in uses if _resolves(old, k) and not _resolves(new, k))
    for k in gone:
        path, line = uses[k]
        mod, _, name = k.partition(":")
        what = f"{mod}.{name}" if name else mod
        out.append({"kind": "gone", "series": path in relied, "text": f"{what} is gone in {newest} (used at {path}:{line})"})
    used = {k.partition(":")[0] + "." + k.partition(":")[2].split(".")[0] for k in uses}
    for member in cfg["exports"]:
        mod = _mod_name(member)
        if mod in old:
            dropped = sorted(set(old[mod]["names"]) - set(new.get(mod, {}).get("names", [])))
            if dropped:
                hit = sorted(n for n in dropped if f"{mod}.{n}" in used)
                out.append({"kind": "exports", "series": False,
                            "text": f"{mod} no longer exports {', '.join(dropped)}"
                            + (f" (imported: {', '.join(hit)})" if hit else " (the release's tree imports none of them)")})
    for member, name, note in cfg["constants"]:
        mod = _mod_name(member)
        a, b = old.get(mod, {}).get("consts", {}).get(name), new.get(mod, {}).get("consts", {}).get(name)
        if a != b:
            out.append({"kind": "constant", "series": True,
                        "text": f"{member}: {name} {a or '(none)'} -> {b or '(none)'}" + (f": {note}" if note else "")})
    if not out:
        out.append({"kind": "same", "series": False, "text": f"nothing the release's tree uses of {cfg['module']} changed ({len(uses)} uses checked)"})
    return out
