"""Wheels as an upstream source, index-verified artifacts, supersession, resolutions reused
across releases, and `sglpatch watch`, on real registry artifacts with real git.

Three releases at most (the CI budget of issue 11): 0.5.10 (sdist; the dry run without a
commit id), 0.5.21 (a wheel) and 0.5.23 (the newest when this was written; wheel-only). The
committed 0.5.10.post1 records are read, never its tree. Trees are cached in
$SGLPATCH_CACHE/trees.git.
"""

from __future__ import annotations

import json
import shutil
import uuid

import pytest

from conftest import ROOT, SERIES, copy_project, sglpatch
from sglpatch.upstream import artifacts, pkgindex, treecache
from sglpatch import series
from sglpatch.watch import matrix
from sglpatch.rebase import resolutions, classify
from sglpatch.upstream import materialize as up
from sglpatch.gitcmd import Git
from sglpatch.upstream.pin import UNKNOWN_COMMIT, Lock
from sglpatch.project import Project
from sglpatch.rebase import target
from sglpatch.watch import supersede

SDIST = "0.5.10"
WHEEL = "0.5.21"
NEWEST = "0.5.23"
P2 = "0002-pcie-custom-allreduce.patch"
P5 = "0005-parallel_state-opt-in-FlashInfer-PCIe-IPC-allreduce.patch"
P6 = "0006-jit_kernel-flashinfer-bundled-CCCL-for-rope.patch"
PCIE_IPC = "python/sglang/srt/distributed/device_communicators/pcie_ipc_ar.py"


@pytest.fixture(scope="session")
def trees():
    """version -> (git of the cache repo, tree commit, artifact path)."""
    cg = treecache.cache_repo()
    out = {}
    for v, kind in ((SDIST, "sdist"), (WHEEL, "wheel"), (NEWEST, "wheel")):
        art, path = artifacts.fetch("sglang", v, kind)
        out[v] = (cg, treecache.tree_commit(cg, kind, path, art.sha256), path)
    return out


def p2() -> series.PatchFile:
    return series.parse_patch(P2, (ROOT / "patches" / P2).read_bytes())


def p5() -> series.PatchFile:
    return series.parse_patch(P5, (ROOT / "patches" / P5).read_bytes())


def test_index_lists_wheel_only_releases():
    assert pkgindex.kinds_offered("sglang", SDIST)[0] == "sdist"
    assert pkgindex.kinds_offered("sglang", WHEEL) == ["wheel"]
    art = pkgindex.choose("sglang", WHEEL, "wheel")
    assert art.filename.endswith("-cp311-cp311-manylinux_2_34_x86_64.whl") and len(art.sha256) == 64
    assert NEWEST in pkgindex.releases("sglang", after="0.5.9")


def test_wheel_tree_placement(trees, tmp_path):
    cg, commit, path = trees[WHEEL]
    files = cg.run("ls-tree", "-r", "--name-only", commit).splitlines()
    assert files and all(f.startswith("python/sglang/") for f in files)
    assert PCIE_IPC in files and not any(".dist-info" in f for f in files)
    import zipfile

    shipped = {n for n in zipfile.ZipFile(path).namelist() if n.startswith("sglang/") and not n.endswith("/")}
    assert {f[len("python/"):] for f in files} == shipped  # exactly the files the wheel ships
    # the rebase path (a workdir's upstream branch) gives the same tree, pinned with commit = unknown
    g = Git(tmp_path / "wd")
    (tmp_path / "wd").mkdir()
    g.run("init", "-q")
    art = pkgindex.choose("sglang", WHEEL, "wheel")
    lock = Lock("sglang", "https://github.com/sgl-project/sglang", f"v{WHEEL}", UNKNOWN_COMMIT, WHEEL, art.filename, art.sha256, "python")
    lock.validate()
    built = up.build_from_wheel(g, lock)
    assert g.run("rev-parse", f"{built}^{{tree}}") == cg.run("rev-parse", f"{commit}^{{tree}}")
    assert 'commit = "unknown"' in lock.dumps()


def test_tampered_cached_artifact_is_refused(tmp_path, monkeypatch):
    art, real = artifacts.fetch("sglang", WHEEL, "wheel")
    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "cache" / "wheel" / art.filename
    fake.parent.mkdir(parents=True)
    shutil.copy2(real, fake)
    with open(fake, "ab") as f:
        f.write(b"\0")
    before = fake.read_bytes()
    with pytest.raises(pkgindex.ArtifactError) as e:
        artifacts.fetch("sglang", WHEEL, "wheel")
    msg = str(e.value)
    assert "\n" not in msg and art.filename in msg and art.sha256 in msg
    assert fake.read_bytes() == before and sorted(p.name for p in fake.parent.iterdir()) == [art.filename]
    assert not (tmp_path / "cache" / "trees.git").exists()


def test_dry_run_onto_0510_needs_no_commit(tmp_path):
    project = copy_project(tmp_path / "project")
    res = sglpatch("rebase", "--project", str(project), "--workdir", str(tmp_path / "none"), "--onto", "0.5.10", "--dry-run", "--source", "auto")
    assert res.returncode in (0, 3), res.stdout + res.stderr
    assert "pass --commit" not in res.stderr
    assert "source: sdist (" in res.stderr  # auto: GitHub does not answer here, the sdist exists
    assert "commit unknown" in res.stdout and "upstream.commit = 'unknown'" in res.stderr
    assert "0.5.10 (v0.5.10, commit unknown)" in res.stdout


def test_supersession_holds_only_with_the_dependency(trees):
    cg, newest, path = trees[NEWEST]
    r = supersede.probe(cg, newest, p2(), matrix.dep_pins(path, NEWEST))
    assert r.holds, r
    assert "PcieIpcCommunicator" in r.evidence and "flashinfer-python 0.7.2 ships PcieIpcAllReduceWorkspace" in r.evidence
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" in r.switch
    # 0.5.21 has upstream's file, symbol and env switch, but pins flashinfer-python 0.6.18
    cg, wheel, path = trees[WHEEL]
    deps = matrix.dep_pins(path, WHEEL)
    assert deps["flashinfer-python"] == "==0.6.18"
    r = supersede.probe(cg, wheel, p2(), deps)
    assert not r.holds and "0.6.18 has no PcieIpcAllReduceWorkspace" in r.evidence and "dependency missing" in r.evidence
    # 0.5.10: upstream has no replacement: nothing to say
    cg, old, path = trees[SDIST]
    r = supersede.probe(cg, old, p2(), matrix.dep_pins(path, SDIST))
    assert not r.holds and r.evidence == ""


def test_p5_is_superseded_on_0_5_23_by_its_probe_not_on_0_5_21(trees):
    """P5 backports upstream's PCIe-IPC allreduce to 0.5.9: its X-Superseded-By holds where
    upstream's adapter and a flashinfer with the workspace are both there, and only there."""
    cg, newest, path = trees[NEWEST]
    r = supersede.probe(cg, newest, p5(), matrix.dep_pins(path, NEWEST))
    assert r.holds and "PcieIpcCommunicator" in r.evidence and "flashinfer-python 0.7.2 ships PcieIpcAllReduceWorkspace" in r.evidence
    assert r.switch == "use SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 (same switch upstream)"
    cg, wheel, path = trees[WHEEL]
    r = supersede.probe(cg, wheel, p5(), matrix.dep_pins(path, WHEEL))
    assert not r.holds and "0.6.18 has no PcieIpcAllReduceWorkspace" in r.evidence and "dependency missing" in r.evidence
    cg, old, path = trees[SDIST]
    assert supersede.probe(cg, old, p5(), matrix.dep_pins(path, SDIST)).evidence == ""


def test_p6_is_superseded_on_0_5_23_where_sglangs_own_rope_kernel_needs_no_flashinfer_header(trees):
    """P6 (flashinfer's bundled CCCL for 0.5.9's flashinfer-based rope kernel): its probe holds where
    SGLang builds its own rope kernel from a header that includes none of flashinfer's; there is
    nothing to switch on. Not on 0.5.10, whose rope.py lives elsewhere (a recorded drop there)."""
    p6 = series.parse_patch(P6, (ROOT / "patches" / P6).read_bytes())
    cg, newest, path = trees[NEWEST]
    r = supersede.probe(cg, newest, p6, matrix.dep_pins(path, NEWEST))
    assert r.holds and r.switch == "" and r.evidence.endswith("rope.py, _jit_fused_rope_module"), r
    cuh = cg.blob_text(newest, "python/sglang/kernels/jit/csrc/elementwise/rope.cuh")
    assert cuh and "#include <flashinfer/" not in cuh and "FusedRopeKernel" in cuh
    assert cg.blob_text(newest, "python/sglang/jit_kernel/rope.py") is None  # the file P6 changes is gone
    cg, old, path = trees[SDIST]
    assert supersede.probe(cg, old, p6, matrix.dep_pins(path, SDIST)).evidence == ""


def test_recorded_resolution_reused_for_same_conflict_refused_for_another(trees, tmp_path):
    """The committed 0.5.10.post1 record of P2 is keyed by its conflict (sglpatch rebase
    --continue, scripts/rerecord.sh); 0.5.10 shows the same conflict: offered, merge-checked,
    used; the newest shows another: refused."""
    recs = resolutions.read_resolutions(ROOT, "0.5.10.post1")[0]
    assert all(len(r.conflict) == 64 for r in recs.values()), recs  # every committed record is keyed
    project = copy_project(tmp_path / "project")
    shutil.rmtree(project / "resolutions" / NEWEST)  # the newest's own records (issue 12) would answer first
    res = matrix.run(project, SDIST)
    cell = res["rows"][0]["cells"][P2]
    assert cell["status"] == "recorded" and cell["text"] == "resolved (recorded for 0.5.10.post1)", cell
    # without the key (a record made for other patch bytes), the same conflict is not enough
    recs[P2].conflict, recs[P2].patch_sha256 = "", "0" * 64
    resolutions.write_resolutions(project, "0.5.10.post1", recs)
    cell = matrix.run(project, SDIST)["rows"][0]["cells"][P2]
    assert cell["status"] == "conflict" and cell["needs_human"], cell
    # on the newest release P2 conflicts differently: the keyed recording is refused there
    resolutions.write_resolutions(project, "0.5.10.post1", resolutions.read_resolutions(ROOT, "0.5.10.post1")[0])
    res = matrix.run(project, NEWEST)
    cell = res["rows"][0]["cells"][P2]
    assert cell["status"] == "superseded"  # the probe holds on the newest release
    assert any("the recorded resolution for 0.5.10.post1 is for another conflict: not used" in d for d in cell["details"]), cell


def test_watch_cli_matrix_json_markdown(trees, tmp_path):
    out_json, out_md = tmp_path / "w.json", tmp_path / "w.md"
    project = copy_project(tmp_path / "project")
    shutil.rmtree(project / "resolutions" / NEWEST, ignore_errors=True)  # without the recorded rebase (issue 12)
    res = sglpatch("watch", "--project", str(project), "--releases", f"{WHEEL},{NEWEST}", "--json", str(out_json), "--markdown", str(out_md))
    assert res.returncode == 3, res.stdout + res.stderr  # the newest needs a human (P1/P4 conflict)
    assert res.stdout.splitlines()[1].split()[:5] == ["release", "P1", "P2", "P3", "P4"]
    rows = {line.split()[0]: line.split()[1:6] for line in res.stdout.splitlines() if line[:5] == "0.5.2"}
    assert set(rows) == {WHEEL, NEWEST}  # the list, not the range (no 0.5.22)
    assert rows[NEWEST][1] == "superseded" and rows[WHEEL][1] != "superseded" and rows[NEWEST][2] == "upstream"
    assert rows[NEWEST][4] == "superseded" and rows[WHEEL][4] == "CONFLICT"  # P5: its probe holds on 0.5.23 only
    data = json.loads(out_json.read_text())
    assert data["newest"] == NEWEST and data["newest_verdict"] == "human"
    assert data["rows"][0]["deps"]["torch"] == "==2.13.0" and data["pinned"]["deps"]["torch"] == "==2.9.1"
    md = out_md.read_text()
    header = " | ".join(f"P{k}" for k in range(1, len(SERIES) + 1))
    assert f"| release | source | {header} | verdict |" in md and "superseded by upstream" in md
    # the watch reads every line of the checkout (issue 27): the newest has one, built by one command
    names = series.read_series(project / "lines" / NEWEST).names
    assert data["lines"] == [{"release": NEWEST, "dir": f"lines/{NEWEST}/", "patches": names}]
    note = f"line {NEWEST} in the checkout (lines/{NEWEST}/, 2 patches: P1 P4): scripts/apply.sh --line {NEWEST} --venv NEWDIR"
    assert note in res.stdout.splitlines() and f"- {note}" in md and "no line for" not in res.stdout
    shutil.rmtree(project / "lines")
    res = sglpatch("watch", "--project", str(project), "--releases", f"{WHEEL},{NEWEST}")
    assert f"no line for {NEWEST} yet: scripts/rebase.sh --onto {NEWEST} writes lines/{NEWEST}/" in res.stdout.splitlines()


def test_second_run_reuses_the_classification_recheck_and_new_inputs_redo_it(trees, tmp_path, monkeypatch):
    project = copy_project(tmp_path / "project")
    spec = SDIST
    first = matrix.run(project, spec, recheck=True)
    calls = []
    real = classify.classify
    monkeypatch.setattr(classify, "classify", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert matrix.run(project, spec)["rows"] == first["rows"] and calls == []  # same inputs, same tree: reused
    assert matrix.run(project, spec, recheck=True)["rows"] == first["rows"] and calls == [1]
    toml = project / "resolutions" / "0.5.10.post1" / "resolutions.toml"
    # another input, never seen before (the facts cache outlives test runs: a fixed text would be)
    toml.write_text(toml.read_text() + f"\n# another resolution file: another input {uuid.uuid4()}\n")
    assert matrix.run(project, spec)["rows"] == first["rows"] and calls == [1, 1]


def test_dry_run_takes_the_tree_from_the_cache(trees, tmp_path):
    """The dry run's registry trees are the cached ones (nothing unpacked again), byte for byte
    the tree a real rebase commits (up.build_registry)."""
    lock = target.target_lock(Lock.parse((ROOT / "upstream.lock").read_text(), "lock"), WHEEL, "wheel", ls_remote=False)
    g = Git(tmp_path / "scratch")
    g.workdir.mkdir()
    g.run("init", "-q", "--bare")
    cached = treecache.registry_commit(g, lock)
    assert cached == trees[WHEEL][1]
    w = Git(tmp_path / "real")
    w.workdir.mkdir()
    w.run("init", "-q")
    built = up.build_registry(w, lock)
    assert w.tree_of(built) == g.tree_of(cached)


def test_hostile_index_entries_are_ignored_and_nothing_leaves_the_cache(tmp_path, monkeypatch):
    """The index is untrusted: a file name with a path in it, or a download URL with another scheme,
    is never used (a real local HTTP index; the good entry next to them still works)."""
    import hashlib
    import http.server
    import threading

    good = b"not really a wheel"
    files = [
        {"filename": "../../escaped-0.9.1.tar.gz", "url": "/f/x.tar.gz", "hashes": {"sha256": "0" * 64}},
        {"filename": "hostile-0.9.1.tar.gz", "url": "file:///etc/passwd", "hashes": {"sha256": "0" * 64}},
        {"filename": "hostile-0.9.2.tar.gz", "url": "/f/hostile-0.9.2.tar.gz", "hashes": {"sha256": hashlib.sha256(good).hexdigest()}},
    ]

    class Index(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body, ctype = (good, "application/octet-stream") if self.path.startswith("/f/") else (
                json.dumps({"files": files}).encode(), "application/vnd.pypi.simple.v1+json")
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{srv.server_port}/simple")
    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    pkgindex.index_url.cache_clear()
    pkgindex.index_files.cache_clear()
    try:
        listed = pkgindex.index_files("hostile")
        assert [a.filename for a in listed] == ["hostile-0.9.2.tar.gz"]
        assert pkgindex.releases("hostile") == ["0.9.2"]
        art, path = artifacts.fetch("hostile", "0.9.2", "sdist")
        assert path.read_bytes() == good and (tmp_path / "cache") in path.parents
        assert not (tmp_path / "escaped-0.9.1.tar.gz").exists() and not list(tmp_path.rglob("escaped*"))
    finally:
        srv.shutdown()
        pkgindex.index_url.cache_clear()
        pkgindex.index_files.cache_clear()


# --------------------------------------------------------------------------------------
# dependencies newer than the pins (sglpatch.watch.depwatch, deps/newer.toml)


def _fake_flashinfer(path, comm_init: str, tuning: str):
    import zipfile

    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("flashinfer/__init__.py", "from .comm import *  # noqa\n")
        zf.writestr("flashinfer/comm/__init__.py", comm_init)
        zf.writestr("flashinfer/comm/pcie_ipc_tuning.py", tuning)
        zf.writestr("flashinfer/comm/pcie_ipc_ar.py", "def get_pcie_ipc_comm_module():\n    pass\n\nclass PcieIpcAllReduceWorkspace:\n    pass\n")
    return path


def test_depwatch_reports_what_the_newer_wheel_drops_of_what_the_tree_uses(tmp_path, monkeypatch):
    """Two small wheels (real zips, read with ast) and a real git tree that imports from them: a
    name the tree uses and the newer wheel lacks is reported with file:line (series-marked when a
    series file uses it), dropped exports and a changed constant with the table's note."""
    from sglpatch.watch import depwatch

    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))  # the facts cache outlives runs; this tree's id does not change
    old = _fake_flashinfer(tmp_path / "old.whl", (
        "from .pcie_ipc_ar import PcieIpcAllReduceWorkspace as PcieIpcAllReduceWorkspace\n"
        "from .pcie_ipc_ar import get_pcie_ipc_comm_module as get_pcie_ipc_comm_module\n"
        "try:\n    from .moe import MoeAlltoAll\nexcept ImportError:\n    MoeAlltoAll = None\n"), "_PCIE_IPC_MEMOP_TUNE_VERSION = 4\n")
    new = _fake_flashinfer(tmp_path / "new.whl", "from .pcie_ipc_ar import PcieIpcAllReduceWorkspace as PcieIpcAllReduceWorkspace\n",
                           "_PCIE_IPC_MEMOP_TUNE_VERSION = 5\n")
    g = Git(tmp_path / "repo")
    g.workdir.mkdir()
    g.run("init", "-q")
    src = g.workdir / "python" / "sglang"
    src.mkdir(parents=True)
    (src / "pcie.py").write_text("def f():\n    from flashinfer.comm import PcieIpcAllReduceWorkspace\n    return PcieIpcAllReduceWorkspace\n")
    (src / "moe.py").write_text("import flashinfer.comm as c\n\n\ndef g():\n    return c.MoeAlltoAll\n")
    (src / "other.py").write_text("import flashinfer\n\nx = flashinfer.comm.get_pcie_ipc_comm_module\ny = flashinfer.get_pcie_ipc_comm_module\n")
    g.run("add", "-A")
    g.run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "tree")
    tree = g.run("rev-parse", "HEAD")
    cfg = {"module": "flashinfer", "why": "", "exports": ["flashinfer/comm/__init__.py"],
           "constants": [("flashinfer/comm/pcie_ipc_tuning.py", "_PCIE_IPC_MEMOP_TUNE_VERSION", "re-tunes")]}
    uses = depwatch.tree_uses(g, tree, "flashinfer")
    assert uses["flashinfer.comm:PcieIpcAllReduceWorkspace"] == ["python/sglang/pcie.py", 2]
    assert uses["flashinfer.comm:MoeAlltoAll"] == ["python/sglang/moe.py", 5]  # an attribute of an imported module
    o, n = depwatch.wheel_names(old, "", "flashinfer"), depwatch.wheel_names(new, "", "flashinfer")
    assert depwatch.has(o, "flashinfer.comm", "MoeAlltoAll") and not depwatch.has(n, "flashinfer.comm", "MoeAlltoAll")
    got = depwatch.changes(cfg, o, n, uses, {"python/sglang/moe.py"}, "9.9")
    assert [(c["kind"], c["series"], c["text"]) for c in got] == [
        ("gone", True, "flashinfer.comm.MoeAlltoAll is gone in 9.9 (used at python/sglang/moe.py:5)"),
        ("gone", False, "flashinfer.comm.get_pcie_ipc_comm_module is gone in 9.9 (used at python/sglang/other.py:3)"),
        ("gone", False, "flashinfer.get_pcie_ipc_comm_module is gone in 9.9 (used at python/sglang/other.py:4)"),  # through a star import
        ("exports", False, "flashinfer.comm no longer exports MoeAlltoAll, get_pcie_ipc_comm_module (imported: MoeAlltoAll)"),
        ("constant", True, "flashinfer/comm/pcie_ipc_tuning.py: _PCIE_IPC_MEMOP_TUNE_VERSION 4 -> 5: re-tunes"),
    ]
    assert depwatch.changes(cfg, o, o, uses, set(), "9.9")[0]["kind"] == "same"


def test_depwatch_reads_only_the_modules_looked_up_and_a_warm_check_opens_no_wheel(tmp_path, monkeypatch):
    """A wheel's modules are read when first looked up (flashinfer-python 0.7 ships 3,500): a
    module whose file does not parse is not there; what was read is kept under the wheel's sha256,
    so the same look-ups again need no wheel at all, and a new look-up reads the wheel again."""
    import zipfile

    from sglpatch.watch import depwatch

    monkeypatch.setenv("SGLPATCH_CACHE", str(tmp_path / "cache"))
    whl = _fake_flashinfer(tmp_path / "w.whl", "from .pcie_ipc_ar import PcieIpcAllReduceWorkspace\n", "X = 1\n")
    with zipfile.ZipFile(whl, "a") as zf:
        zf.writestr("flashinfer/broken.py", "def f(:\n")
        zf.writestr("flashinfer/unread.py", "Y = 2\n")
    sha = "ab" * 32
    mods = depwatch.wheel_names(whl, sha, "flashinfer")
    assert "flashinfer.broken" not in mods and not depwatch.has(mods, "flashinfer.broken", None)
    assert depwatch.has(mods, "flashinfer", "PcieIpcAllReduceWorkspace")  # through the star import of flashinfer.comm
    assert mods["flashinfer.comm.pcie_ipc_tuning"]["consts"] == {"X": "1"}
    mods.save()
    saved = json.loads((tmp_path / "cache" / "trees.git" / "facts" / "wheel-modules" / f"{sha}.json").read_text())["flashinfer"]
    assert sorted(saved["members"]) == ["flashinfer", "flashinfer.broken", "flashinfer.comm", "flashinfer.comm.pcie_ipc_ar",
                                        "flashinfer.comm.pcie_ipc_tuning", "flashinfer.unread"]
    assert sorted(k for k, v in saved["parsed"].items() if v) == ["flashinfer", "flashinfer.comm", "flashinfer.comm.pcie_ipc_tuning"]
    assert saved["parsed"]["flashinfer.broken"] is None and "flashinfer.comm.pcie_ipc_ar" not in saved["parsed"]
    whl.rename(tmp_path / "gone.whl")
    warm = depwatch.wheel_names(whl, sha, "flashinfer")  # the facts answer: the wheel is not opened
    assert depwatch.has(warm, "flashinfer", "PcieIpcAllReduceWorkspace") and "flashinfer.broken" not in warm
    with pytest.raises(FileNotFoundError):
        _ = "flashinfer.unread" in warm  # never read: needs the wheel
    (tmp_path / "gone.whl").rename(whl)
    assert depwatch.has(depwatch.wheel_names(whl, sha, "flashinfer"), "flashinfer.unread", "Y")


def test_depwatch_flashinfer_072_to_074_on_the_real_0523_tree(trees):
    """The real wheels (0.7.2 is the supersession probe's; 0.7.4 the one extra download) against
    the real 0.5.23 tree: the PCIe-IPC tune-cache version goes 4 -> 5; gen_/get_pcie_ipc_comm_module
    leave flashinfer.comm's exports (0.5.23 imports neither); MoeAlltoAll, which 0.5.23's flashinfer
    MoE dispatcher imports, is gone."""
    from sglpatch.watch import depwatch

    cg, tree, _ = trees[NEWEST]
    cfg = depwatch.load(ROOT)["flashinfer-python"]
    relied = depwatch.series_files(ROOT, Project.load(ROOT), NEWEST)
    assert "python/sglang/srt/distributed/device_communicators/pcie_ipc_ar.py" in relied  # P2's supersession probe file
    got = {c["text"] for c in depwatch.check("flashinfer-python", cfg, "0.7.2", "0.7.4", cg, tree, relied)}
    assert any(t.startswith("flashinfer/comm/pcie_ipc_tuning.py: _PCIE_IPC_MEMOP_TUNE_VERSION 4 -> 5: the PCIe-IPC autotune cache key") for t in got)
    exports = next(t for t in got if t.startswith("flashinfer.comm no longer exports "))
    assert "gen_pcie_ipc_comm_module" in exports and "get_pcie_ipc_comm_module" in exports
    assert exports.endswith("(imported: MoeAlltoAll, moe_a2a_get_workspace_size_per_rank)")
    assert "flashinfer.comm.MoeAlltoAll is gone in 0.7.4 (used at python/sglang/srt/layers/moe/token_dispatcher/flashinfer.py:51)" in got
    assert not any("PcieIpcAllReduceWorkspace" in t for t in got)  # what the series relies on stays


def test_watch_shows_the_newest_dependency_releases_and_what_they_change(trees, tmp_path):
    project = copy_project(tmp_path / "project")
    shutil.copytree(ROOT / "deps", project / "deps")
    out_md = tmp_path / "w.md"
    res = sglpatch("watch", "--project", str(project), "--releases", NEWEST, "--json", str(tmp_path / "w.json"), "--markdown", str(out_md))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads((tmp_path / "w.json").read_text())
    newest = data["newest_deps"]
    assert set(newest) == set(matrix.DEPS) and newest["sglang-kernel"] == pkgindex.releases("sglang-kernel")[-1]
    assert any(line.startswith("  newest ") and f"flashinfer {newest['flashinfer-python']}" in line for line in res.stdout.splitlines())
    (fi,) = [n for n in data["newer"] if n["dist"] == "flashinfer-python"]
    assert fi["pin"] == "==0.7.2" and fi["release"] == NEWEST and fi["newest"] == newest["flashinfer-python"] != "0.7.2"
    assert f"newer than the pins: flashinfer-python {fi['newest']} (sglang {NEWEST} pins ==0.7.2):" in res.stdout
    md = out_md.read_text()
    assert "| newest on the index | " in md and "## Newer than the pins" in md and f"**flashinfer-python {fi['newest']}**" in md
