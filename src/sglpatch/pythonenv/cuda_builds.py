"""``apply --venv DIR --cuda 12.N``: the release's CUDA-specific requirements rewritten to their
CUDA 12 builds, for a host whose driver is below CUDA 13's floor (580).

The project's ``deps/cuda12.toml`` says how each package names its CUDA builds and where they
are: a local version tag on an index of its own (``torch==2.14.1+cu126`` from
``https://download.pytorch.org/whl/cu126``; those indexes are read for the pinned version's
builds, highest CUDA 12.x first: minor-version compatibility runs any of them on a CUDA 12
driver), an extra (``flashinfer-python[cu13]`` ->
``[cu12]``), a ``-cu13`` package name (-> ``-cu12``), or a version major that is the CUDA major
(``cuda-python>=13.0``: none). The resolver then gets the rewritten requirements and those
indexes. What has no CUDA 12 build is a ``Missing``: the preflight refuses with one line per
package naming both ways out (a driver >= 580, or the table's alternative).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from sglpatch import toml
from sglpatch.upstream import pkgindex
from sglpatch.errors import SglpatchError


TABLE = Path("deps") / "cuda12.toml"
_REQ = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*(.*?)\s*(;.*)?$")
_TAG = re.compile(r"^cu12\d$")
# an index URL from the table: https, or http on a loopback address (a test's local index); one
# {tag}; nothing a command line could read as an option
_INDEX = re.compile(r"^(https://[A-Za-z0-9.-]+|http://(127\.0\.0\.1|localhost|\[::1\]))(:\d{1,5})?/[A-Za-z0-9._~/-]*\{tag\}[A-Za-z0-9._~/-]*$")
WAY_OUT = "a driver >= 580 runs the release as pinned (drop --cuda)"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_cuda(text: str) -> tuple[int, int]:
    m = re.fullmatch(r"12\.(\d{1,2})", text or "")
    if not m:
        raise SglpatchError(f"--cuda {text!r}: give the CUDA 12 release to build for, e.g. --cuda 12.8 (CUDA 13 is the release's own default)")
    return 12, int(m.group(1))


@dataclass
class Local:
    index: str
    tags: list[str]
    max_sm: dict[str, tuple[int, ...]] = field(default_factory=dict)
    follows: str = ""
    alternative: str = ""


@dataclass
class Table:
    local: dict[str, Local]
    extra: dict[str, str]
    major: dict[str, str]


def _sm(text: str) -> tuple[int, ...]:
    if not re.fullmatch(r"\d{1,2}\.\d", str(text)):
        raise ValueError(f"max_sm {text!r} is not MAJOR.MINOR")
    return tuple(int(x) for x in str(text).split("."))


def load(project: Path) -> Table:
    """The project's table, every field checked (it is untrusted input like any project file)."""
    from sglpatch.project import checkout_of

    path = checkout_of(Path(project)) / TABLE  # a line folder (lines/R/) reads the checkout's table
    try:
        data = toml.loads(path.read_text())
        local = {}
        for name, e in data.get("local", {}).items():
            index, tags = str(e["index"]), [str(t) for t in e.get("tags", [])]
            if not _INDEX.match(index) or index.count("{tag}") != 1:
                raise ValueError(f"local.{name}.index {index!r}: not an https URL with one {{tag}}")
            if not tags or not all(_TAG.match(t) for t in tags):
                raise ValueError(f"local.{name}.tags {tags!r}: cu12X tags only")
            follows = norm(str(e.get("follows", "")))
            local[norm(name)] = Local(index, tags, {t: _sm(v) for t, v in e.get("max_sm", {}).items() if _TAG.match(t)},
                                      follows, str(e.get("alternative", "")))
        extra = {norm(k): str(v) for k, v in data.get("extra", {}).items()}
        if not all(re.fullmatch(r"[a-z0-9]*", v) for v in extra.values()):
            raise ValueError("extra: values are extra names")
        return Table(local, extra, {norm(k): str(v) for k, v in data.get("major", {}).items()})
    except FileNotFoundError:
        raise SglpatchError(f"--cuda needs {path} (how the CUDA 12 builds are named and where they are); the project has none")
    except (OSError, KeyError, ValueError, TypeError, toml.TOMLDecodeError) as e:
        raise SglpatchError(f"{path}: {e}")


@dataclass
class Missing:
    name: str
    what: str  # "sglang-kernel 0.4.10 has no CUDA 12 build (none on ...)"
    alternative: str

    def line(self) -> str:
        return f"{self.what}: {WAY_OUT}" + (f", or {self.alternative}" if self.alternative else "")


@dataclass
class Selection:
    cuda: tuple[int, int]
    reqs: list[str]
    chosen: dict[str, str]  # name -> the CUDA 12 spelling taken ("+cu126 from URL", "[cu12] extra", ...)
    indexes: list[str]
    missing: list[Missing]
    table: Table

    @property
    def label(self) -> str:
        return f"{self.cuda[0]}.{self.cuda[1]}"


def _tags(entry: Local, cuda: tuple[int, int]) -> list[str]:
    """Every CUDA 12 tag, highest first. NVIDIA's minor-version compatibility runs a CUDA 12.x build
    on any CUDA 12 driver (>= 525.60.13), so a tag above --cuda is no reason to pass a build over:
    torch 2.12.1 and 2.13.0 have a cu129 build (SM120 kernels) and no cu128 one, and their cu126
    build has no SM120 kernels."""
    return sorted(entry.tags, key=lambda t: -int(t[4:]))


def _find(name: str, pin: str, entry: Local, cuda: tuple[int, int]) -> tuple[str, str] | None:
    """(tag, index) of the highest CUDA 12.x build of name==pin on entry's indexes."""
    for tag in _tags(entry, cuda):
        index = entry.index.replace("{tag}", tag)
        if any(a.version == f"{pin}+{tag}" and a.kind == "wheel" for a in pkgindex.files_at(index, name)):
            return tag, index
    return None


def _lower_major(spec: str) -> int | None:
    majors = [int(m.group(2)) for m in re.finditer(r"(>=|>|==|~=)\s*(\d+)", spec)]
    return max(majors) if majors else None


def select(project: Path, reqs: list[str], cuda: tuple[int, int]) -> Selection:
    table = load(project)
    out, chosen, indexes, missing = [], {}, [], []
    tags: dict[str, str] = {}
    parsed = [(r, _REQ.match(r)) for r in reqs]
    # packages that follow another's tag come after the one they follow
    order = sorted(parsed, key=lambda rm: bool(rm[1] and norm(rm[1].group(1)) in table.local and table.local[norm(rm[1].group(1))].follows))
    for req, m in order:
        if not m:
            out.append(req)
            continue
        name, extras, spec, marker = norm(m.group(1)), m.group(2) or "", m.group(3) or "", m.group(4) or ""
        pin = re.fullmatch(r"==\s*([^,\s+]+)", spec)
        entry = table.local.get(name)
        if entry and pin:
            found = None
            if entry.follows:
                tag = tags.get(entry.follows)
                found = (tag, entry.index.replace("{tag}", tag)) if tag else None
            else:
                found = _find(name, pin.group(1), entry, cuda)
            if found is None:
                looked = ", ".join(entry.index.replace("{tag}", t) for t in _tags(entry, cuda))
                missing.append(Missing(name, f"{name} {pin.group(1)} has no CUDA 12 build (none on {looked}; the default index's is the release's CUDA 13 one)",
                                       entry.alternative))
                out.append(req)
                continue
            tag, index = found
            tags[name] = tag
            out.append(f"{m.group(1)}{extras}=={pin.group(1)}+{tag}{marker}")
            chosen[name] = f"+{tag} from {index}" + (
                f" (above --cuda {cuda[0]}.{cuda[1]}: CUDA 12 minor-version compatibility)" if int(tag[4:]) > cuda[1] else "")
            if index not in indexes:
                indexes.append(index)
        elif entry and entry.follows and entry.follows in tags:
            index = entry.index.replace("{tag}", tags[entry.follows])
            # resolved like pip, the best version from any index (pip_config.uv_args): the +cuXYZ build
            # sorts above the registry's same release, and the pinned torch+cuXYZ rules out the others
            chosen[name] = f"+{tags[entry.follows]} from {index} (its +{tags[entry.follows]} build sorts above the registry's)"
            out.append(req)
        elif "cu13" in [x.strip() for x in extras.strip("[]").split(",")] and name in table.extra:
            rest = [x.strip() for x in extras.strip("[]").split(",") if x.strip() and x.strip() != "cu13"]
            new = rest + ([table.extra[name]] if table.extra[name] else [])
            out.append(f"{m.group(1)}{'[' + ','.join(new) + ']' if new else ''}{spec}{marker}")
            chosen[name] = f"[{table.extra[name]}] extra" if table.extra[name] else "default extras (CUDA 12), [cu13] dropped"
        elif "cu13" in extras:
            missing.append(Missing(name, f"{name}{extras} selects CUDA 13 and {TABLE} names no CUDA 12 extra for it", ""))
            out.append(req)
        elif name.endswith("-cu13"):
            out.append(f"{m.group(1)[:-2]}12{extras}{spec}{marker}")
            chosen[name] = f"{name[:-2]}12 (the CUDA 12 package)"
        elif name in table.major and (_lower_major(spec) or 0) >= 13:
            missing.append(Missing(name, f"{name}{spec} has no CUDA 12 build ({table.major[name]})", ""))
            out.append(req)
        else:
            out.append(req)
    return Selection(cuda, out, chosen, indexes, missing, table)


def variant(name: str, version: str) -> str:
    """The CUDA build a resolved package is, as far as its name and version say ('' = not CUDA-specific)."""
    if "+cu" in version:
        return version.split("+", 1)[1]
    m = re.search(r"-cu(\d+)$", name)
    if m:
        return f"cu{m.group(1)}"
    if name in ("nvidia-cuda-runtime", "cuda-python", "cuda-bindings", "cuda-toolkit"):
        return f"CUDA {version.split('.')[0]}"
    return ""
