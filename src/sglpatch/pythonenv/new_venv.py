"""``apply --venv DIR``: a NEW venv holding the pinned release's full dependency set (its own
Requires-Dist, read from the release artifact: the sdist's PKG-INFO or a wheel's METADATA) and
the patched tree (editable, --no-deps). No other environment is touched.

The install plan comes from the installer's own resolver (``uv pip compile --format
pylock.toml`` when uv is found, else ``pip install --dry-run --report``) for the interpreter
the venv is made from; the venv then receives exactly that plan. uv is handed the user's pip
configuration (index, extra indexes, find-links, constraints, no-index) with the tool's own
indexes in both calls, compile and install, from the one translation
(sglpatch.pythonenv.pip_config.uv_args: what wins is said there); pip reads its own. The preflight
(sglpatch.pythonenv.preflight) reads the plan before anything is created. ``--cuda 12.N`` resolves the
CUDA 12 builds instead (sglpatch.pythonenv.cuda_builds: the rewritten requirements and their indexes).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from pathlib import Path
from urllib.parse import unquote, urlparse

from sglpatch import redact
from sglpatch.upstream import artifacts
from sglpatch.pythonenv import cuda_builds as cudavariant, flashinfer_set, pip_config, preflight
from sglpatch import toml
from sglpatch.errors import SglpatchError, say
from sglpatch.fsutil import crashpoint, private_tmpdir
from sglpatch.pythonenv.install import find_uv
from sglpatch.upstream.pin import read_lock
from sglpatch.pythonenv.interpreter import installed_distributions
from sglpatch.pythonenv.interpreter import norm_name as norm


_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")




def pinned_version(req: str) -> str | None:
    m = _REQ.match(req)
    spec = m.group(3) if m else ""
    pin = re.fullmatch(r"==\s*([^,\s]+)", spec or "")
    return pin.group(1) if pin else None


def release_metadata(artifact: Path) -> tuple[str, str, list[str]]:
    """(name, version, requirements without extras) from an sdist's PKG-INFO or a wheel's METADATA."""
    artifact = Path(artifact)
    what = "METADATA" if artifact.name.endswith(".whl") else "PKG-INFO"
    if artifact.exists() and not artifact.is_file():  # a FIFO or a device would be read forever
        raise SglpatchError(f"{artifact} is not a regular file: pass the release's own sdist or wheel (--release-artifact)")
    try:
        if artifact.name.endswith(".whl"):
            with zipfile.ZipFile(artifact) as zf:
                names = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
                text = zf.read(names[0]).decode("utf-8") if names else ""
        else:
            with tarfile.open(artifact, "r:*") as tf:
                member = next((m for m in tf if re.fullmatch(r"[^/]+/PKG-INFO", m.name) and m.isfile()), None)
                text = tf.extractfile(member).read().decode("utf-8") if member else ""
    except UnicodeDecodeError as e:
        raise SglpatchError(f"{artifact}: its {what} is not UTF-8 text ({e.reason} at byte {e.start}): "
                            "pass the release's own sdist or wheel (--release-artifact)")
    except (OSError, tarfile.TarError, zipfile.BadZipFile) as e:
        raise SglpatchError(f"cannot read the release metadata from {artifact}: {e}")
    if not text:
        raise SglpatchError(f"{artifact} has no PKG-INFO / METADATA; pass the release's sdist or wheel")
    msg = Parser().parsestr(text)
    reqs = [r.strip() for r in msg.get_all("Requires-Dist") or [] if "extra ==" not in r.replace("extra==", "extra ==")]
    return msg.get("Name", ""), msg.get("Version", ""), reqs


@dataclass
class Package:
    name: str
    version: str
    wheel: bool
    size: int | None
    pinned: bool = False
    url: str = ""  # where the resolver takes it from (a wheel's or sdist's URL)


@dataclass
class Plan:
    installer: str  # "uv" or "pip"
    python: str
    python_version: str
    command: str
    packages: list[Package] = field(default_factory=list)
    lockfile: Path | None = None  # what the venv is installed from
    indexes: list[str] = field(default_factory=list)  # extra indexes (--cuda: the CUDA 12 builds')
    pip_conf: dict[str, list[str]] = field(default_factory=dict)  # the user's pip configuration, read once (uv gets it)

    def uv_args(self, constraints: bool = True) -> list[str]:
        """The options uv gets in both calls: pip's configuration and the tool's indexes (pip_config.uv_args)."""
        return pip_config.uv_args(self.pip_conf, self.indexes, constraints)

    @property
    def sources(self) -> str:
        """Where packages come from, credentials masked."""
        return pip_config.describe(self.pip_conf, self.indexes)

    @property
    def download_bytes(self) -> int:
        sizes = [p.size for p in self.packages]
        return sum(sizes) if sizes and all(s is not None for s in sizes) else 0


def python_version(python: str) -> str:
    try:
        proc = subprocess.run([python, "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True, timeout=60)
    except OSError as e:
        raise SglpatchError(f"python interpreter {python} does not run ({e.strerror}); pass --python PATH")
    if proc.returncode != 0:
        raise SglpatchError(f"python interpreter {python} does not run; pass --python PATH")
    return proc.stdout.strip()


def _one_line(text: str) -> str:
    lines = [re.sub(r"^[\s×╰─▶│]+", "", ln).strip() for ln in text.splitlines()]
    lines = [re.sub(r"^(error|cause|hint|ERROR): ", "", ln) for ln in lines if ln and not ln.startswith("help:")]
    joined = " ".join(lines)
    return joined if len(joined) <= 600 else joined[:597] + "..."


def _size(artifact: dict) -> int | None:
    """An artifact's size from the lock, or from the file itself for a local (file://) one."""
    if artifact.get("size") is not None:
        return int(artifact["size"])
    url = artifact.get("url", "")
    if url.startswith("file://"):
        path = Path(unquote(urlparse(url).path))
        return path.stat().st_size if path.is_file() else None
    return None


def _fill_sizes(plan: Plan) -> None:
    """The sizes the resolver left out (pip's report has none; uv's lock only what a JSON index states),
    from the index as the flashinfer plan reads them (sglpatch.pythonenv.pip_config.size: a HEAD request)."""
    from concurrent.futures import ThreadPoolExecutor

    from sglpatch.pythonenv.pip_config import size

    todo = [p for p in plan.packages if p.size is None and p.url]
    with ThreadPoolExecutor(max_workers=8) as pool:
        for p, n in zip(todo, pool.map(size, [p.url for p in todo])):
            p.size = n


def _extra_indexes(indexes: list[str]) -> list[str]:
    return [a for url in indexes for a in ("--extra-index-url", url)]


def resolve(reqs: list[str], python: str, installer: str, tmp: Path, indexes: list[str] = ()) -> tuple[Plan, str | None]:
    """The installer's own resolution of reqs for python (indexes: the tool's extra indexes, searched
    with the user's, the best version from any, as pip chooses; uv as pip_config.uv_args hands them
    on); (plan, None) or (empty plan, error line)."""
    req_file = tmp / "requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    uv = find_uv() if installer in ("auto", "uv") else None
    if installer == "uv" and not uv:
        raise SglpatchError("--installer uv: uv not found on PATH or in ~/.local/bin")
    pins = {norm(_REQ.match(r).group(1)) for r in reqs if pinned_version(r)}
    version = python_version(python)
    conf = pip_config.config()
    if uv:
        out = tmp / "pylock.toml"
        plan = Plan("uv", python, version, "", lockfile=out, indexes=list(indexes), pip_conf=conf)
        cmd = [uv, "pip", "compile", "-q", str(req_file), "--python", python, "--format", "pylock.toml", *plan.uv_args(), "-o", str(out)]
        plan.command = redact.shown(cmd[:4] + ["requirements.txt"] + cmd[5:-1] + ["pylock.toml"])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            return plan, redact.url(_one_line(proc.stderr or proc.stdout))
        for p in toml.loads(out.read_text())["packages"]:
            wheels = p.get("wheels") or []
            sizes = [_size(w) for w in wheels] if wheels else [_size(p.get("sdist") or {})]
            size = None if None in sizes else max(sizes)
            url = (wheels[0] if wheels else p.get("sdist") or {}).get("url", "")
            plan.packages.append(Package(norm(p["name"]), str(p["version"]), bool(wheels), size, norm(p["name"]) in pins, url))
        _fill_sizes(plan)
        return plan, None
    report = tmp / "report.json"
    cmd = [python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", *_extra_indexes(indexes), "--report", str(report),
           "-r", str(req_file)]
    plan = Plan("pip", python, version, redact.shown(cmd[:-4] + ["--report", "report.json", "-r", "requirements.txt"]),
                indexes=list(indexes), pip_conf=conf)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return plan, redact.url(_one_line(proc.stderr or proc.stdout))
    for item in json.loads(report.read_text())["install"]:
        meta, url = item["metadata"], item["download_info"]["url"]
        name = norm(meta["name"])
        plan.packages.append(Package(name, meta["version"], url.endswith(".whl"), None, name in pins, url))
    plan.lockfile = tmp / "pinned.txt"
    plan.lockfile.write_text("".join(f"{p.name}=={p.version}\n" for p in plan.packages))
    _fill_sizes(plan)
    return plan, None


def guard_workdir(workdir: Path, python: str) -> None:
    """Refuse a workdir that python's sglang is installed editable from: rebuilding it would change
    what that (serving) venv runs. Looked up without importing sglang."""
    code = "import importlib.util as u; s = u.find_spec('sglang'); print(s.origin if s and s.origin else '')"
    try:
        origin = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, cwd="/").stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return
    if origin and Path(origin).resolve().is_relative_to((Path(workdir) / "python").resolve()):
        raise SglpatchError(
            f"{python} serves sglang from {workdir} (editable): the new venv needs its own tree; pass --workdir NEWDIR "
            "(nothing was changed)"
        )


def release_artifact(lock) -> Path:
    """The locked release's own artifact, to read its Requires-Dist from: the sdist, or for a
    wheel-only release (0.5.11 on) the locked wheel, fetched and checked against the sha256 the
    index publishes and the one the lock records (sglpatch.upstream.artifacts)."""
    if lock.artifact_kind == "wheel":
        return artifacts.fetch(lock.name, lock.version, "wheel", expect_sha256=lock.sdist_sha256)[1]
    return artifacts.fetch_sdist(lock)


@dataclass
class Prepared:
    venv_dir: Path
    plan: Plan
    notes: list[str]
    checks: list[preflight.Check]
    tmp: tempfile.TemporaryDirectory
    cuda: cudavariant.Selection | None = None
    flashinfer: flashinfer_set.FlashinferSet | None = None  # --with-flashinfer: the set, for pip check after the build

    @property
    def refused(self) -> list[preflight.Check]:
        return [c for c in self.checks if c.ok is False]

    @property
    def python(self) -> Path:
        return self.venv_dir / "bin" / "python"


def prepare(project: Path, venv_dir: Path, python: str, installer: str, p1: bool, artifact: Path | None, dry_run: bool,
            cuda: str | None = None) -> Prepared:
    """Read the release's pins (--cuda: their CUDA 12 builds), resolve them, run the preflight;
    prints the plan and the verdict."""
    venv_dir = Path(venv_dir).expanduser().absolute()
    unfinished = clear_unfinished(venv_dir, dry_run)
    if not unfinished and venv_dir.exists() and (not venv_dir.is_dir() or any(venv_dir.iterdir())):
        raise SglpatchError(f"--venv {venv_dir} exists and is not empty; apply --venv only builds a NEW venv: pick a new directory")
    lock = read_lock(project)
    artifact = Path(artifact) if artifact else release_artifact(lock)
    name, version, reqs = release_metadata(artifact)
    if norm(name) != norm(lock.name) or version != lock.version:
        raise SglpatchError(f"{artifact.name} is {name} {version}, but upstream.lock pins {lock.name} {lock.version}")
    notes: list[str] = []
    fs = flashinfer_set.read(project) if p1 else None
    if fs:  # --with-flashinfer: deps/flashinfer.toml's set in place of the release's flashinfer pins
        reqs, notes = flashinfer_set.rewrite(reqs, fs)
    sel = None
    if cuda:
        say(f"--cuda {cuda}: looking up the CUDA 12 builds of the release's CUDA-specific requirements ({cudavariant.TABLE})")
        sel = cudavariant.select(project, reqs, cudavariant.parse_cuda(cuda))
        reqs = sel.reqs
    say(f"{lock.name} {version}: {len(reqs)} requirements from {artifact.name}; resolving them for {python}")
    tmp = private_tmpdir("venv")
    indexes = (sel.indexes if sel else []) + ([fs.index] if fs and fs.index else [])
    plan, error = resolve(reqs, python, installer, Path(tmp.name), indexes)
    checks = preflight.run(plan, venv_dir, p1, error, sel)
    prep = Prepared(venv_dir, plan, notes, checks, tmp, sel, fs)
    report(prep, full=dry_run)
    return prep


def installed_versions(python: str) -> dict[str, str]:
    """{normalized name: version} of what python has installed now (read only; {} when it cannot say)."""
    return installed_distributions(python) or {}


def report(prep: Prepared, full: bool) -> None:
    plan = prep.plan
    print(f"plan: {len(plan.packages)} packages for Python {plan.python_version} ({plan.python}), resolved by: {plan.command}")
    how = "handed to uv as the options above" if plan.installer == "uv" else "pip reads it itself"
    print(f"plan: packages from: {plan.sources} (your pip configuration, {how})")
    for note in prep.notes:
        print(f"plan: override: {note}")
    if prep.cuda:
        taken = [f"{n} {how}" for n, how in prep.cuda.chosen.items()] + [f"{m.name}: none" for m in prep.cuda.missing]
        print(f"plan: CUDA {prep.cuda.label} builds (--cuda): {'; '.join(taken) if taken else 'no CUDA-specific requirement'}")
    pins = [p for p in plan.packages if p.pinned]
    print(f"plan: the release's pins: {' '.join(f'{p.name}=={p.version}' for p in pins) if pins else '(none)'}")
    have = installed_versions(plan.python)
    delta = [f"{p.name} {have.get(p.name, '(none)')} -> {p.version}" for p in pins if have.get(p.name) != p.version]
    print(f"plan: pins that differ from what {plan.python} has (it stays as it is): {', '.join(delta) if delta else 'none'}")
    if full:
        known = [p.size for p in plan.packages if p.size is not None]
        unknown = len(plan.packages) - len(known)
        print(f"plan: {preflight.size(sum(known))} to download ({len(plan.packages)} packages"
              + (f"; size unknown for {unknown}: the index did not say)" if unknown else ")"))
        for p in plan.packages:
            size = f"{p.size / 2**20:9.1f} MiB" if p.size is not None else "        ?"
            print(f"  {p.name + '==' + p.version:<48} {size}  {'wheel' if p.wheel else 'sdist only':<10}  {_source(p, plan, prep.cuda)}".rstrip())
    for check in prep.checks:
        print(check.line())
    bad = prep.refused
    print(f"preflight: verdict: {'REFUSED, ' + str(len(bad)) + ' condition(s) failed' if bad else 'pass'}")


def _source(p: Package, plan: Plan, cuda: cudavariant.Selection | None) -> str:
    """The package's CUDA build and, when it comes from an extra index, that index."""
    if cuda and any(m.name == p.name for m in cuda.missing):
        return "no CUDA 12 build (the default index's)"
    cu = cudavariant.variant(p.name, p.version)
    index = next((i for i in plan.indexes if p.url.startswith(i.rstrip("/") + "/")), "")
    return (cu + (f" from {redact.url(index)}" if index else "")).strip()


def create(prep: Prepared, base_python: str) -> None:
    """Make the venv and install exactly the plan into it (the patched tree comes after)."""
    plan, venv_dir = prep.plan, prep.venv_dir
    uv = find_uv() if plan.installer == "uv" else None
    make = [uv, "venv", "-q", "--allow-existing", "--python", base_python, str(venv_dir)] if uv else [base_python, "-m", "venv", str(venv_dir)]
    _mark(venv_dir, "building")  # first: a venv left half-built is known to be ours (clear_unfinished)
    say(f"creating {venv_dir}: {' '.join(make)}")
    if subprocess.run(make).returncode != 0:
        raise SglpatchError(f"creating the venv {venv_dir} failed (see above); nothing else was changed")
    crashpoint("venv:created")
    if uv:  # the resolution's sources again: the lock's URLs carry no credentials, the index options do
        cmd = [uv, "pip", "install", "--python", str(prep.python), *plan.uv_args(constraints=False), "-r", str(plan.lockfile)]
    else:
        cmd = [str(prep.python), "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *_extra_indexes(plan.indexes),
               "-r", str(plan.lockfile)]
    say(f"installing {len(plan.packages)} packages into {venv_dir} (the plan above): {redact.shown(cmd)}")
    if subprocess.run(cmd).returncode != 0:
        raise SglpatchError(
            f"installing the plan into {venv_dir} failed (see above); that venv is incomplete: fix the cause and re-run "
            "(the re-run builds it again); no other environment was touched"
        )
    shutil.copy2(plan.lockfile, venv_dir / f"sglpatch-plan{plan.lockfile.suffix}")  # what was installed, for the record
    _mark(venv_dir, "installed")


# --------------------------------------------------------------------------------------
# a venv this command made and did not finish (killed, or its install failed)

MARKER = "sglpatch-venv.json"


def _mark(venv_dir: Path, state: str) -> None:
    venv_dir.mkdir(parents=True, exist_ok=True)
    (venv_dir / MARKER).write_text(json.dumps({"made_by": "sglpatch apply --venv", "state": state}) + "\n")


def mark_complete(prep: Prepared) -> None:
    """After the patched tree is installed into it: the venv is finished (and no longer rebuilt)."""
    _mark(prep.venv_dir, "complete")


def clear_unfinished(venv_dir: Path, dry_run: bool = False) -> bool:
    """Remove venv_dir when an earlier `apply --venv` made it and did not finish it (its marker
    says so): the re-run that the failure message asks for then builds it again. A dry run only
    says so. Whether venv_dir was such a venv."""
    try:
        marker = json.loads((venv_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if not (isinstance(marker, dict) and marker.get("made_by") == "sglpatch apply --venv" and marker.get("state") != "complete"):
        return False
    what = "a build would remove it and build it again" if dry_run else "building it again"
    say(f"{venv_dir} is a venv an earlier `apply --venv` made and did not finish ({marker.get('state')}); {what}")
    if not dry_run:
        shutil.rmtree(venv_dir)
    return True
