"""``--with-flashinfer``: the flashinfer for P1 and P5 on the pinned release, as one set read from
``deps/flashinfer.toml`` (its header documents the format): flashinfer-python==version, the
requirements installed in the same resolver call (``override``), the packages that go (``remove``).

Into an existing Python (``apply --python P --with-flashinfer``, ``scripts/apply.sh``): what P has
is read first; when it already holds the set nothing is installed. Otherwise pip's plan with the
user's pip configuration comes first (``plan_first``, sglpatch.pythonenv.pip_config: added, changed, removed,
sizes; refused when it would install or upgrade torch, and before that, from the set's own
metadata, when P has no torch), then one installer call (uv when found,
handed pip's configuration, else pip) installs exactly that plan, then
the packages to remove are uninstalled, then ``pip check`` runs: a line of it that names a package
of the set fails the step (the others are P's own and are listed). The versions P had are printed
first as the command that puts them back. A dry run prints the installer's own dry-run plan.

The way back is also recorded in the workdir (``record_way_back``): after the install,
``sglpatch.pythonenv.jit_kernels`` builds the JIT kernels that include flashinfer's headers, and a kernel that
does not build names it, as ``sglpatch doctor`` does later.

Into a new venv (``apply --venv DIR --with-flashinfer``): ``rewrite`` turns the release's pins into
the set before the venv's plan is resolved; the same ``pip check`` rule runs on the new venv.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from sglpatch.pythonenv import pip_config as pipconf
from sglpatch import redact, toml
from sglpatch.errors import SglpatchError, say
from sglpatch.pythonenv.interpreter import find_uv, installed_distributions
from sglpatch.pythonenv.interpreter import norm_name as norm

TABLE = Path("deps") / "flashinfer.toml"
PACKAGE = "flashinfer-python"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
_INDEX = re.compile(r"^(https://[A-Za-z0-9.-]+|http://(127\.0\.0\.1|localhost|\[::1\]))(:\d{1,5})?(/[A-Za-z0-9._~/-]*)?$")




@dataclass
class FlashinferSet:
    version: str
    index: str = ""
    why: str = ""
    override: dict[str, str] = field(default_factory=dict)  # normalized name -> specifier
    remove: dict[str, str] = field(default_factory=dict)  # normalized name -> why

    @property
    def requirements(self) -> list[str]:
        return [f"{PACKAGE}=={self.version}"] + [f"{n}{s}" for n, s in self.override.items()]

    @property
    def names(self) -> set[str]:
        return {PACKAGE, *self.override, *self.remove}


def read(project: Path) -> FlashinferSet:
    """The project's deps/flashinfer.toml, every field checked; one-line errors."""
    path = Path(project) / TABLE
    try:
        data = toml.loads(path.read_text())["flashinfer"]
        version = str(data["version"])
        Version(version)
        if not re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", version):
            raise ValueError(f"version {version!r}")
        index = str(data.get("index", ""))
        if index and not _INDEX.match(index):
            raise ValueError(f"index {index!r}: not an https URL (http only on a loopback address)")
        override, remove = {}, {}
        for name, spec in (data.get("override") or {}).items():
            if not _NAME.match(name) or norm(name) == PACKAGE:
                raise ValueError(f"override: {name!r} is not a package name other than {PACKAGE}")
            override[norm(name)] = str(SpecifierSet(str(spec)))
        for name, why in (data.get("remove") or {}).items():
            if not _NAME.match(name) or norm(name) in (PACKAGE, *override):
                raise ValueError(f"remove: {name!r} is not a package name outside flashinfer-python and the overrides")
            remove[norm(name)] = str(why)
        return FlashinferSet(version, index, str(data.get("why", "")), override, remove)
    except FileNotFoundError:
        raise SglpatchError(f"--with-flashinfer needs {path} (which flashinfer, what it overrides and removes); the project has none")
    except KeyError as e:
        raise SglpatchError(f"{path}: no {e.args[0]!r} in [flashinfer] (see the format in its header)")
    except (OSError, ValueError, TypeError, AttributeError, InvalidVersion, InvalidSpecifier, toml.TOMLDecodeError) as e:
        raise SglpatchError(f"{path}: {e}")


def rewrite(reqs: list[str], fs: FlashinferSet) -> tuple[list[str], list[str]]:
    """A release's requirements with the set in place (--venv's plan) and one note per change."""
    out, notes = [], []
    seen = set()
    for req in reqs:
        try:
            r = Requirement(req)
        except InvalidRequirement:
            out.append(req)
            continue
        name = norm(r.name)
        if name == PACKAGE:
            out.append(f"{PACKAGE}{'[' + ','.join(sorted(r.extras)) + ']' if r.extras else ''}=={fs.version}"
                       + (f"; {r.marker}" if r.marker else ""))
            notes.append(f"{PACKAGE} {r.specifier or '(any)'} -> =={fs.version} (deps/flashinfer.toml)")
        elif name in fs.override:
            out.append(f"{r.name}{fs.override[name]}" + (f"; {r.marker}" if r.marker else ""))
            notes.append(f"{name} {r.specifier or '(any)'} -> {fs.override[name]} (flashinfer {fs.version} needs it)")
        elif name in fs.remove:
            notes.append(f"{name}{r.specifier} dropped ({fs.remove[name]})")
        else:
            out.append(req)
            continue
        seen.add(name)
    for name in (PACKAGE, *fs.override):
        if name not in seen:
            out.append(f"{PACKAGE}=={fs.version}" if name == PACKAGE else f"{name}{fs.override[name]}")
            notes.append(f"{out[-1]} added (deps/flashinfer.toml)")
    return out, notes


def tree_conflicts(workdir: Path, fs: FlashinferSet) -> list[str]:
    """The patched tree's own pins (python/pyproject.toml) that the set breaks: `pip check` would
    name them after the install. [] for a wheel-sourced tree (no pyproject.toml: its METADATA is the
    release's) or a tree that agrees."""
    path = Path(workdir) / "python" / "pyproject.toml"
    try:
        deps = toml.loads(path.read_text()).get("project", {}).get("dependencies", [])
    except FileNotFoundError:
        return []
    except (OSError, toml.TOMLDecodeError) as e:
        raise SglpatchError(f"{path}: {e}")
    out = []
    for req in deps:
        try:
            r = Requirement(str(req))
        except InvalidRequirement:
            continue
        name = norm(r.name)
        if name == PACKAGE and not r.specifier.contains(Version(fs.version), prereleases=True):
            out.append(f"{r.name}{r.specifier} (the set installs {fs.version})")
        elif name in fs.remove:
            out.append(f"{r.name}{r.specifier} (the set removes it)")
    return out


def installed(python: str) -> dict[str, str]:
    """{normalized name: version} of what python has installed (read only, nothing imported)."""
    have = installed_distributions(python)
    if have is None:
        raise SglpatchError(f"cannot read what {python} has installed; pass --python with a working interpreter")
    return have


def _satisfied(spec: str, version: str | None) -> bool:
    if version is None:
        return False
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


@dataclass
class Todo:
    install: list[str]  # requirements P does not satisfy yet
    remove: list[str]  # names P has that go
    rollback: str  # the requirements that put P back as it was

    @property
    def nothing(self) -> bool:
        return not self.install and not self.remove


def todo(fs: FlashinferSet, have: dict[str, str]) -> Todo:
    wants = [(PACKAGE, f"=={fs.version}")] + list(fs.override.items())
    install = [f"{n}{s}" for n, s in wants if not _satisfied(s, have.get(n))]
    remove = [n for n in fs.remove if n in have]
    if install:  # with a change the whole set goes in together: one consistent resolution
        install = fs.requirements
    touched = [n for n in (PACKAGE, *fs.override, *fs.remove) if n in have and (install or n in remove)]
    return Todo(install, remove, " ".join(f"{n}=={have[n]}" for n in touched))


def _cmds(python: str, installer: str) -> tuple[str | None, list[str], list[str]]:
    """(uv, uninstall prefix, check command) for python (installs: pip_config.install_cmd)."""
    uv = find_uv() if installer in ("auto", "uv") else None
    if installer == "uv" and not uv:
        raise SglpatchError("--installer uv: uv not found on PATH or in ~/.local/bin")
    if uv:
        return uv, [uv, "pip", "uninstall", "--python", python], [uv, "pip", "check", "--python", python]
    pip = pipconf.pip_cmd(python)
    return None, [*pip, "uninstall", "-y"], [*pip, "check"]


def check(python: str, fs: FlashinferSet, installer: str = "auto") -> tuple[list[str], list[str]]:
    """`pip check` of python: (its lines naming a package of the set, the other lines)."""
    *_, cmd = _cmds(python, installer)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/")
    lines = [ln.strip() for ln in (proc.stdout + "\n" + proc.stderr).splitlines() if ln.strip()]
    quiet = r"^(No broken requirements found|Checked \d+ packages?|All installed packages are compatible|Using Python .* environment at|Found \d+ incompatibilit)"
    lines = [ln for ln in lines if not re.match(quiet, ln)]
    names = {n for n in fs.names} | {n.replace("-", "_") for n in fs.names}
    ours = [ln for ln in lines if any(re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w-])", ln, re.I) for n in names)]
    return ours, [ln for ln in lines if ln not in ours]


def verdict(python: str, fs: FlashinferSet, installer: str = "auto", rollback: str = "") -> str:
    """pip check's verdict as one line; raises (one line) when a line names the set."""
    ours, others = check(python, fs, installer)
    back = f"; the way back: {rollback}" if rollback else ""
    if ours:
        raise SglpatchError(f"pip check in {python} after --with-flashinfer: {len(ours)} conflict(s) with the flashinfer set: "
                            + "; ".join(ours[:4]) + (" ..." if len(ours) > 4 else "") + back)
    return "pip check: no conflict with the flashinfer set" + (
        f" ({len(others)} line(s) about other packages: {'; '.join(others[:2])}{' ...' if len(others) > 2 else ''})"
        if others else " (clean)")


def torch_wanted(python: str, fs: FlashinferSet) -> list[str]:
    """What the set's own packages ask of torch, from their metadata as pip finds them with the user's
    pip configuration (one `--no-deps` report: no resolution): ["flashinfer-python 0.7.2 requires torch
    (any version)"]; [] when none asks or pip cannot say."""
    extra = ["--extra-index-url", fs.index] if fs.index else []
    cmd = [*pipconf.pip_cmd(python), "install", "--dry-run", "--no-deps", "--ignore-installed", "-q", "--disable-pip-version-check",
           "--report", "-", *extra, *fs.requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/")
    try:
        report = json.loads(proc.stdout[proc.stdout.index("{"):]) if proc.returncode == 0 else {}
        env = dict(report.get("environment") or {}, extra="")
        out = []
        for item in report.get("install", []):
            meta = item["metadata"]
            for text in meta.get("requires_dist") or []:
                r = Requirement(text)
                if norm(r.name) == "torch" and (r.marker is None or r.marker.evaluate(env)):
                    out.append(f"{meta['name']} {meta['version']} requires torch{r.specifier or ' (any version)'}")
        return out
    except (ValueError, KeyError, TypeError, AttributeError, InvalidRequirement):
        return []


def plan_first(python: str, fs: FlashinferSet, have: dict[str, str] | None = None) -> pipconf.InstallPlan | None:
    """Before anything is built or installed: pip's plan for the set in python with the user's pip
    configuration (added, changed, removed, sizes), printed; one line when it needs another torch,
    and before any resolution when python has no torch and the set's packages ask for one."""
    have = installed(python) if have is None else have
    t = todo(fs, have)
    if t.nothing:
        return None
    wanted = torch_wanted(python, fs) if t.install and "torch" not in have else []
    if wanted:
        raise SglpatchError(f"flashinfer: {python} has no torch, and {'; '.join(wanted)}: --with-flashinfer never installs or "
                            f"upgrades torch; install the torch you serve with into {python} first, then re-run; nothing was installed")
    p = pipconf.plan(python, t.install, have, fs.index, "flashinfer") if t.install else pipconf.InstallPlan(python)
    p.removed = [(n, have[n], fs.remove[n]) for n in t.remove]
    print("\n".join(p.lines("flashinfer")), flush=True)
    pipconf.refuse_never(p, "flashinfer", "--with-flashinfer")
    return p


def record_way_back(workdir: Path, command: str) -> None:
    """Remember in the workdir the command that puts back what --with-flashinfer replaced."""
    from sglpatch.gitcmd import Git
    from sglpatch.workdir import FLASHINFER_BACK_KEY

    Git(Path(workdir)).config_set(FLASHINFER_BACK_KEY, command)


def recorded_way_back(workdir: Path) -> str | None:
    """The command record_way_back kept in workdir, as it is shown (index credentials masked), or None
    (nothing replaced yet, not a workdir). The workdir's git config holds it as it runs."""
    from sglpatch.gitcmd import Git
    from sglpatch.workdir import FLASHINFER_BACK_KEY

    workdir = Path(workdir).expanduser()
    kept = Git(workdir).config_get(FLASHINFER_BACK_KEY) if (workdir / ".git").is_dir() else None
    return redact.url(kept) if kept else kept


def install_into(python: str, fs: FlashinferSet, installer: str = "auto", dry_run: bool = False,
                 plan: pipconf.InstallPlan | None = None, record=None) -> list[str]:
    """Bring python to the set (progress on stderr); the summary lines for stdout. plan: plan_first's,
    when the caller showed it before other work (else it is made and shown here). record(command):
    called with the way back once the set has replaced something."""
    have = installed(python)
    t = todo(fs, have)
    now = ", ".join(f"{n} {have[n]}" for n in (PACKAGE, *fs.override, *fs.remove) if n in have) or "none of its packages"
    say(f"flashinfer: {python} has {now}; deps/flashinfer.toml wants {' '.join(fs.requirements)}"
        + (f" without {', '.join(fs.remove)}" if fs.remove else "") + (f" ({fs.why})" if fs.why else ""))
    uv, uninst, _ = _cmds(python, installer)
    if t.nothing:
        return [f"flashinfer: {python} already has flashinfer-python {fs.version} and the set; nothing to change",
                verdict(python, fs, installer)]
    plan = plan or plan_first(python, fs, have)
    if dry_run:
        return [f"flashinfer (dry run): would install {' '.join(t.install) or 'nothing'}"
                + (f", then remove {', '.join(f'{n} {have[n]}' for n in t.remove)}" if t.remove else "")
                + f" in {python} (the plan above); the way back: {t.rollback or '(nothing installed before)'}"]
    # the way back: exactly the recorded versions (--no-deps), from the user's own index (uv is handed pip's
    # configuration), quoted; recorded as it runs, shown with any index credentials masked
    back = shlex.join(pipconf.install_cmd(python, uv, t.rollback.split())) if t.rollback else ""
    say(f"flashinfer: the way back, should you need it: {redact.url(back)}" if back else
        "flashinfer: none of the set was installed before")
    if plan.items:  # exactly the plan, with the user's pip configuration whichever installer runs
        cmd = pipconf.install_cmd(python, uv, plan.pins, fs.index)
        say(f"flashinfer: installing: {redact.shown(cmd)}")
        proc = subprocess.run(cmd, cwd="/")
        if proc.returncode != 0:
            raise SglpatchError(f"flashinfer: installing {' '.join(t.install)} into {python} failed (exit {proc.returncode}, see above); "
                                "nothing was removed")
    if record and back:
        record(back)
    for name in t.remove:
        say(f"flashinfer: removing {name} {have[name]} ({fs.remove[name]})")
        if subprocess.run([*uninst, name], cwd="/").returncode != 0:
            raise SglpatchError(f"flashinfer: removing {name} from {python} failed (see above); the way back: {redact.url(back)}")
    now = installed(python)
    line = f"flashinfer: {python} now has flashinfer-python {now.get(PACKAGE, '(none)')}"
    line += "".join(f", {n} {now[n]}" for n in fs.override if n in now)
    line += (f"; removed {', '.join(t.remove)}" if t.remove else "") + (f"; the way back: {redact.url(back)}" if back else "")
    return [line, verdict(python, fs, installer, redact.url(back))]

