"""Superseded, not only upstreamed: upstream solved a patch's problem differently.

A patch declares how to recognise that in its DEP-3 header::

    X-Superseded-By: FlashInfer PCIe-IPC allreduce
     file: python/sglang/srt/distributed/device_communicators/pcie_ipc_ar.py
     symbol: python/sglang/srt/distributed/device_communicators/pcie_ipc_ar.py PcieIpcCommunicator
     env: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE
     needs: flashinfer-python flashinfer/comm/__init__.py PcieIpcAllReduceWorkspace
     switch: SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1

The probe holds when every file exists in the new upstream tree, every symbol is defined
(``def``/``class``/assignment) in its file and every env name occurs in the tree. It counts as
superseded only when, in addition, each ``needs`` holds for the dependency version that release
itself pins (its Requires-Dist): that version's wheel, from the index and sha256-verified, ships
the member and the member contains the symbol.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sglpatch.upstream import artifacts, pkgindex, treecache
from sglpatch.errors import SglpatchError
from sglpatch.gitcmd import Git
from sglpatch.series import PatchFile

FIELD = "X-Superseded-By"


@dataclass
class Probe:
    title: str
    files: list[str]
    symbols: list[tuple[str, str]]
    envs: list[str]
    needs: list[tuple[str, str, str]]
    switch: str


@dataclass
class Result:
    holds: bool
    evidence: str
    switch: str


def parse(patch: PatchFile) -> Probe | None:
    text = patch.dep3.get(FIELD)
    if not text:
        return None
    lines = text.split("\n")
    p = Probe(lines[0].strip(), [], [], [], [], "")
    for line in lines[1:]:
        key, _, val = line.partition(":")
        key, val = key.strip().lower(), val.strip()
        parts = val.split()
        if key == "file" and len(parts) == 1:
            p.files.append(val)
        elif key == "symbol" and len(parts) == 2:
            p.symbols.append((parts[0], parts[1]))
        elif key == "env" and len(parts) == 1:
            p.envs.append(val)
        elif key == "needs" and len(parts) == 3:
            p.needs.append((parts[0], parts[1], parts[2]))
        elif key == "switch":
            p.switch = val
        else:
            raise SglpatchError(f"patch {patch.name}: {FIELD}: cannot read {line.strip()!r} (file: / symbol: PATH NAME / env: / needs: DIST MEMBER SYMBOL / switch:)")
    return p


def pinned_version(spec: str, dist: str) -> str | None:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    m = re.fullmatch(r"==\s*([0-9][0-9A-Za-z.]*)", spec.strip())
    if m:
        return m.group(1)
    try:
        ss = SpecifierSet(spec.replace(" ", "")) if spec not in ("", "any") else SpecifierSet()
    except Exception:
        return None
    ok = [v for v in pkgindex.releases(dist) if Version(v) in ss]
    return ok[-1] if ok else None


def _defined(text: str, name: str) -> bool:
    return re.search(rf"^\s*(?:(?:async\s+)?def|class)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*(?::[^=]*)?=", text, re.M) is not None


def _ships(dist: str, ver: str, member: str, sym: str) -> bool:
    """Whether dist ver's wheel (index-verified) has sym in member; the answer is kept in the
    tree cache's facts under the wheel's sha256, so a warm watch reads no wheel."""
    art = pkgindex.choose(dist, ver, "wheel")
    sha = art.sha256 if art is not None and re.fullmatch(r"[0-9a-f]{64}", art.sha256) else None
    facts = treecache.load_facts("ships", sha) if sha else {}
    key = f"{member} {sym}"
    if key not in facts:
        art, whl = artifacts.fetch(dist, ver, "wheel")
        text = artifacts.zip_read(whl, member)
        facts[key] = text is not None and re.search(rf"\b{re.escape(sym)}\b", text) is not None
        treecache.save_facts("ships", art.sha256, facts)
    return facts[key]


def probe(git: Git, tree: str, patch: PatchFile, deps: dict[str, str]) -> Result | None:
    """None when the patch declares nothing; else whether it is superseded on tree, and why."""
    p = parse(patch)
    if p is None:
        return None
    for f in p.files:
        if git.cat(f"{tree}:{f}") is None:
            return Result(False, "", p.switch)  # the replacement is not in this release: nothing to say
    found = [f"{f.rsplit('/', 1)[-1]}" for f in p.files]
    for path, sym in p.symbols:
        text = git.blob_text(tree, path)
        if text is None or not _defined(text, sym):
            return Result(False, f"{path} has no {sym}", p.switch)
        found.append(sym)
    for env in p.envs:
        rc, _, _ = git.run("grep", "-q", "-w", "-F", env, tree, "--", "*.py", check=False)
        if rc != 0:
            return Result(False, f"the tree never mentions {env}", p.switch)
        found.append(env)
    for dist, member, sym in p.needs:
        spec = deps.get(dist)
        if spec is None:
            return Result(False, f"{', '.join(found)} present, but this release does not pin {dist}", p.switch)
        ver = pinned_version(spec, dist)
        if ver is None:
            return Result(False, f"{', '.join(found)} present, but no {dist} release satisfies {spec}", p.switch)
        if not _ships(dist, ver, member, sym):
            return Result(False, f"{', '.join(found)} present, but its pinned {dist} {ver} has no {sym} in {member} (dependency missing)", p.switch)
        found.append(f"{dist} {ver} ships {sym}")
    return Result(True, f"{p.title}: " + ", ".join(found), f"use {p.switch}" if p.switch else "")
