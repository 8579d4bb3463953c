"""The series on sglang 0.5.23 (issue 12): the recorded rebase replays, and P1/P4 work there.

* Replay: `scripts/rebase.sh --onto 0.5.23` from a fresh copy of the project (0.5.9 pin, the
  committed resolutions/0.5.23/) finishes unattended, `sglpatch check` passes on the result,
  and a stop + `--abort` restores the workdir and the project byte for byte.
* P1/P4 on the rebased 0.5.23 tree, in isolation: 0.5.23 does not import on this venv
  (transformers 5.x, sglang-kernel), so the patched functions are compiled from the rebased
  files (ast) with stand-ins for the runtime context; environ.py and spec_profiler.py import
  only the stdlib and torch and are loaded as they are.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from conftest import ROOT, copy_project, sglpatch
from test_rebase import snapshot

TARGET = "0.5.23"
RES = ROOT / "resolutions" / TARGET
SRT = "python/sglang/srt"
P1 = "0001-sm120-flashinfer-allreduce-fusion.patch"
P4 = "0004-eagle-verify-profiling.patch"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (RES / "resolutions.toml").is_file(), reason="no recorded rebase onto 0.5.23"),
]


def rebase_sh(workdir: Path, project: Path, *args: str):
    import os
    import subprocess

    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "rebase.sh"), "--workdir", str(workdir), "--project", str(project), *args],
        capture_output=True, text=True, env=env, timeout=900,
    )


@pytest.fixture(scope="module")
def base_059(tmp_path_factory):
    """The committed series applied on 0.5.9 (project copy + workdir), to be copied per test."""
    from sglpatch import stack

    top = tmp_path_factory.mktemp("p0523")
    project = copy_project(top / "project")
    stack.apply(project, top / "wd", source="sdist")
    return project, top / "wd"


@pytest.fixture(scope="module")
def rebased(base_059, tmp_path_factory):
    import shutil

    top = tmp_path_factory.mktemp("replay")
    project = Path(shutil.copytree(base_059[0], top / "project", symlinks=True))
    workdir = Path(shutil.copytree(base_059[1], top / "wd", symlinks=True))
    res = rebase_sh(workdir, project, "--onto", TARGET)
    return project, workdir, res


# --------------------------------------------------------------------------------------
# the replay


def test_replay_is_unattended_and_the_result_checks(rebased):
    from sglpatch import stack
    from sglpatch.series import read_series

    project, workdir, res = rebased
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert read_series(project).names == [P1, P4]
    for name in (P1, P4):  # the recorded ports, byte for byte
        assert (project / "patches" / name).read_bytes() == (RES / name).read_bytes()
    assert 'version = "0.5.23"' in (project / "upstream.lock").read_text()
    log = (project / "CHANGELOG.md").read_text()
    assert "superseded by upstream's FlashInfer PCIe-IPC allreduce" in log and "pull/19689" in log
    assert stack.check(project, workdir) == []
    check = sglpatch("check", "--project", str(project), "--workdir", str(workdir))
    assert check.returncode == 0, check.stdout + check.stderr


def test_stop_then_abort_restores_bytes(base_059, tmp_path):
    import shutil

    project = Path(shutil.copytree(base_059[0], tmp_path / "project", symlinks=True))
    workdir = Path(shutil.copytree(base_059[1], tmp_path / "wd", symlinks=True))
    toml = project / "resolutions" / TARGET / "resolutions.toml"
    toml.write_text(toml.read_text().split(f'[patch."{P4}"]')[0])  # P4 unrecorded: the replay stops there
    before = snapshot(workdir, project)
    res = rebase_sh(workdir, project, "--onto", TARGET)
    assert res.returncode == 3, res.stdout[-3000:] + res.stderr[-2000:]
    assert f"rebase stopped at patch 4/4: {P4}" in res.stdout
    res = rebase_sh(workdir, project, "--abort")
    assert res.returncode == 0, res.stderr
    assert snapshot(workdir, project) == before


# --------------------------------------------------------------------------------------
# loading patched code from the rebased tree


def defs(path: Path, names: list[str], ns: dict, cls: str | None = None) -> dict:
    """Compile the named top-level functions (or methods of cls) of path into ns."""
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body
    if cls:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = [n for n in body if isinstance(n, (ast.FunctionDef, ast.Assign)) and getattr(n, "name", None) in names]
    for n in found:
        n.decorator_list = []
    assert {n.name for n in found} == set(names), f"{names} not all in {path}"
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), ns)
    return ns


def platform(sm: int):
    return types.SimpleNamespace(is_sm90=sm == 9, is_sm100=sm == 10, is_sm120=sm == 12)


@pytest.fixture(scope="module")
def tree(rebased) -> Path:
    project, workdir, res = rebased
    assert res.returncode == 0
    return workdir


@pytest.fixture
def fake_sglang(monkeypatch):
    """Empty sglang packages in sys.modules, so the patched code's lazy imports land on stand-ins."""
    for name in ("sglang", "sglang.srt", "sglang.srt.arg_groups", "sglang.srt.speculative"):
        mod = types.ModuleType(name)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, name, mod)

    def put(name: str, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    return put


# --------------------------------------------------------------------------------------
# P1 on 0.5.23


@pytest.fixture
def overrides(tree):
    ns = {"Optional": __import__("typing").Optional, "Any": object}
    names = ["FLASHINFER_ALLREDUCE_FUSION_SM120_MIN_VERSION", "get_flashinfer_allreduce_fusion_blocker",
             "get_flashinfer_allreduce_fusion_max_tokens", "_tp_ranks_have_p2p", "_flashinfer_allreduce_fusion_sm120_gate"]
    tree_ = ast.parse((tree / SRT / "arg_groups/overrides.py").read_text())
    body = [n for n in tree_.body if (isinstance(n, ast.FunctionDef) and n.name in names)
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", "") in names for t in n.targets))]
    for n in body:
        if isinstance(n, ast.FunctionDef):
            n.decorator_list = []
    assert len(body) == len(names)
    exec(compile(ast.Module(body=body, type_ignores=[]), "overrides.py", "exec"), ns)
    return ns


def test_p1_blocker_rules(overrides):
    block = overrides["get_flashinfer_allreduce_fusion_blocker"]
    assert "no fusion backend" in block(12, "0.7.2", False, True)
    assert block(9, None, True, False) is None and block(10, None, True, False, pcie_ipc_on=True) is None
    assert "SM90, SM100 and SM120 only" in block(8, "0.7.2", True, True)
    assert "flashinfer-python>=0.6.17 (installed: not installed)" in block(12, None, True, True)
    assert "installed: 0.6.16" in block(12, "0.6.16", True, True, pcie_ipc_on=True)  # version first
    assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" in block(12, "0.7.2", True, False, pcie_ipc_on=True)
    assert "P2P" in block(12, "0.7.2", True, False)
    assert block(12, "0.6.17", True, True) is None and block(12, "0.7.2", True, True, pcie_ipc_on=False) is None


def test_p1_token_limit(overrides):
    limit = overrides["get_flashinfer_allreduce_fusion_max_tokens"]
    assert limit(12, 8, 4, 2048) == 32  # batch 8 x 4 draft tokens (verify)
    assert limit(12, 160, 4, 2048) == 640 and limit(12, 1024, 4, 2048) == 2048
    assert limit(12, None, 1, 2048) == 1 and limit(12, 8, 0, 2048) == 8
    assert limit(9, 8, 4, 2048) == 2048 and limit(10, 8, 4, 2048) == 2048


@pytest.mark.parametrize("sm, fi, pcie, p2p, cleared, probed", [
    (12, "0.7.2", False, True, False, True),    # opt-in honoured
    (12, "0.7.2", True, True, True, False),     # both on: PCIe-IPC wins, no probe
    (12, "0.6.16", False, True, True, False),   # old flashinfer, no probe
    (12, None, False, True, True, False),       # no flashinfer
    (12, "0.7.2", False, False, True, True),    # no P2P
    (10, None, True, False, False, False),      # SM100 untouched
])  # fmt: skip
def test_p1_gate_pass_decides_which_path_serves(overrides, monkeypatch, sm, fi, pcie, p2p, cleared, probed):
    import importlib.metadata as md
    import logging

    def version(name):
        if fi is None:
            raise md.PackageNotFoundError(name)
        return fi

    monkeypatch.setattr(md, "version", version)
    probes = []
    ns = dict(overrides, get_platform=lambda: platform(sm), logger=logging.getLogger("t"),
              envs=types.SimpleNamespace(SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=types.SimpleNamespace(get=lambda: pcie)),
              _tp_ranks_have_p2p=lambda view: probes.append(view) or p2p)
    gate = types.FunctionType(overrides["_flashinfer_allreduce_fusion_sm120_gate"].__code__, ns)
    view = types.SimpleNamespace(flashinfer_allreduce_fusion_backend="auto")
    assert gate(view) == ({"flashinfer_allreduce_fusion_backend": None} if cleared else {})
    assert bool(probes) == probed
    assert gate(types.SimpleNamespace(flashinfer_allreduce_fusion_backend=None)) == {}


def test_p1_p2p_probe_all_pairs_single_node(overrides, fake_sglang):
    pairs = []
    fake_sglang("sglang.srt.distributed")
    fake_sglang("sglang.srt.distributed.device_communicators")
    fake_sglang("sglang.srt.distributed.device_communicators.custom_all_reduce_utils",
                gpu_p2p_access_check=lambda s, t: pairs.append((s, t)) or (s, t) != (3, 1))
    probe = overrides["_tp_ranks_have_p2p"]
    view = types.SimpleNamespace(nnodes=1, base_gpu_id=0, gpu_id_step=1, tp_size=4)
    assert probe(view) is False and (3, 1) in pairs
    pairs.clear()
    assert probe(types.SimpleNamespace(nnodes=1, base_gpu_id=2, gpu_id_step=2, tp_size=2)) is True
    assert sorted(pairs) == [(2, 4), (4, 2)]
    assert probe(types.SimpleNamespace(nnodes=2, base_gpu_id=0, gpu_id_step=1, tp_size=8)) is False


def test_p1_gate_runs_between_auto_enable_and_enforce_disable(tree):
    src = ast.parse((tree / SRT / "arg_groups/model_hook.py").read_text())
    order = [c.args[1].id for c in ast.walk(src) if isinstance(c, ast.Call)
             and getattr(c.func, "id", "") == "run_post_process_pass" and isinstance(c.args[1], ast.Name)]
    fusion = [n for n in order if "allreduce_fusion" in n]
    assert fusion == ["_flashinfer_allreduce_fusion_auto_enable", "_flashinfer_allreduce_fusion_sm120_gate",
                      "_enforce_disable_allreduce_fusion"]


def test_p1_backend_resolution(tree):
    ns = {}
    defs(tree / SRT / "layers/flashinfer_comm_fusion.py", ["_resolve_backend", "_mnnvl_supported"], ns)
    resolve = ns["_resolve_backend"]
    ns["get_platform"] = lambda: platform(12)
    assert resolve("auto") == "trtllm" and resolve("trtllm") == "trtllm"
    for bad, multi in (("mnnvl", False), ("cutedsl", False), ("auto", True), ("trtllm", True)):
        with pytest.raises(ValueError, match="SM120"):
            resolve(bad, multi)
    ns["get_platform"] = lambda: platform(9)  # upstream behaviour kept
    assert resolve("auto") == "trtllm"
    ns["get_platform"] = lambda: platform(10)
    assert resolve("auto") == "mnnvl" and resolve("cutedsl") == "cutedsl"
    ns["get_platform"] = lambda: platform(8)
    with pytest.raises(ValueError, match="requires SM90"):
        resolve("auto")


def test_p1_layer_boundary_gate_and_workspace_size(tree, overrides, fake_sglang):
    spec = types.SimpleNamespace(speculative_algorithm="EAGLE3", speculative_num_draft_tokens=4)
    fake_sglang("sglang.srt.arg_groups.overrides",
                get_flashinfer_allreduce_fusion_max_tokens=overrides["get_flashinfer_allreduce_fusion_max_tokens"])
    fake_sglang("sglang.srt.runtime_context", get_spec=lambda: spec)
    unavailable = [False]
    exec_ = types.SimpleNamespace(
        comm=types.SimpleNamespace(flashinfer_allreduce_fusion_backend="trtllm"),
        graph=types.SimpleNamespace(cuda_graph_config=types.SimpleNamespace(decode=types.SimpleNamespace(max_bs=8))),
    )
    ns = dict(Optional=__import__("typing").Optional, _is_sm90_supported=False, _is_sm100_supported=False, _is_sm120_supported=True,
              _is_flashinfer_available=True, is_dp_attention_enabled=lambda: False, get_exec=lambda: exec_,
              uses_cutedsl_ar_fusion=lambda: False, is_flashinfer_allreduce_unavailable=lambda: unavailable[0])
    path = tree / SRT / "layers/layer_boundary/residual/add_norm.py"
    tree_ = ast.parse(path.read_text())
    keep = {"get_fuse_allreduce_max_tokens", "flashinfer_ar_fusion_applies", "FUSE_ALLREDUCE_MAX_BATCH_SIZE",
            "_sm120_fuse_allreduce_max_tokens"}
    body = [n for n in tree_.body if getattr(n, "name", None) in keep
            or getattr(getattr(n, "target", None), "id", None) in keep
            or any(getattr(t, "id", None) in keep for t in getattr(n, "targets", []))]
    assert len(body) == 4, [ast.unparse(n)[:60] for n in body]
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), ns)
    applies, limit = ns["flashinfer_ar_fusion_applies"], ns["get_fuse_allreduce_max_tokens"]
    assert limit() == 32  # 8 captured requests x 4 draft tokens: the workspace base_runner pre-allocates
    assert applies(32) and applies(1) and not applies(33) and not applies(2048)  # prefill stays on NCCL
    unavailable[0] = True  # flashinfer.comm or its workspace failed: never skip the allreduce
    assert not applies(32)
    unavailable[0] = False
    exec_.comm.flashinfer_allreduce_fusion_backend = None  # the gate pass cleared it (e.g. PCIe-IPC on)
    assert not applies(32)
    ns.update(_is_sm120_supported=False, _is_sm90_supported=True, _sm120_fuse_allreduce_max_tokens=None)
    exec_.comm.flashinfer_allreduce_fusion_backend = "trtllm"
    assert limit() == 2048 and applies(2048)  # SM90 unchanged
    runner = (tree / SRT / "model_executor/runner/base_runner.py").read_text()
    assert "max_token_num=get_fuse_allreduce_max_tokens()," in runner


def test_p1_layernorm_workspace_sized_and_fallback_reduces(tree, fake_sglang):
    """Issue 13 on 0.5.23: the workspace layernorm asks for is the SM120 decode/verify size
    (upstream asks for 2048 tokens: ~0.94 GB per GPU at TP8), and when the kernel declines
    (flashinfer.comm unavailable) the reduction still runs (upstream's own fallback)."""
    import torch

    calls = []
    fake_sglang("sglang.srt.distributed", tensor_model_parallel_all_reduce=None, tensor_model_parallel_fused_allreduce_rmsnorm=None,
                attention_tensor_model_parallel_all_reduce=lambda x: calls.append("allreduce") or x * 8)
    declined = [True]

    def fused(**kw):
        calls.append(("fused", kw["max_token_num"]))
        return (None, None) if declined[0] else ("out", "res")

    for pkg in ("sglang.srt.layers", "sglang.srt.layers.layer_boundary", "sglang.srt.layers.layer_boundary.residual", "sglang.srt.layers.moe"):
        fake_sglang(pkg)
    fake_sglang("sglang.srt.layers.flashinfer_comm_fusion", flashinfer_allreduce_residual_rmsnorm=fused)
    fake_sglang("sglang.srt.layers.layer_boundary.residual.add_norm", get_fuse_allreduce_max_tokens=lambda: 32)
    fake_sglang("sglang.srt.layers.moe.utils", deferred_post_experts_all_reduce=None)
    ns = dict(Optional=__import__("typing").Optional, Union=__import__("typing").Union, Tuple=tuple, torch=torch, _use_aiter=False,
              get_parallel=lambda: types.SimpleNamespace(attn_tp_size=8))
    f = defs(tree / SRT / "layers/layernorm.py", ["_forward_with_allreduce_fusion"], ns)["_forward_with_allreduce_fusion"]
    norm = types.SimpleNamespace(variance_epsilon=1e-6, forward=lambda x, r, p: (x, r))
    x, res = torch.ones(4, 16), torch.zeros(4, 16)
    out, _ = f(norm, x, res, None, torch.ones(16))
    assert calls == [("fused", 32), "allreduce"] and torch.equal(out, x * 8)  # reduced, not skipped
    calls.clear()
    declined[0] = False
    assert f(norm, torch.ones(40, 16), res, None, torch.ones(16)) == ("out", "res") and calls == [("fused", 40)]


# --------------------------------------------------------------------------------------
# P4 on 0.5.23

FIELDS = {
    "version", "name", "dp_rank", "pid", "timer", "cycles", "batch_size", "tokens", "requests",
    "draft_ms_median", "draft_ms_p90", "verify_ms_median", "verify_ms_p90",
    "extend_ms_median", "extend_ms_p90", "cycle_ms_median", "cycle_ms_p90",
    "cycle_ms_mean", "verify_frac", "accept_length", "tok_s_per_request", "throughput_tok_s",
    "by_batch_size", "baseline_step_ms", "break_even_accept_length",
}  # fmt: skip  (the version-2 record of the hardened 0.5.9 patch, issue 13 item 5)
ENV = ("SGLANG_VERIFY_PROFILE", "SGLANG_VERIFY_PROFILE_INTERVAL", "SGLANG_VERIFY_PROFILE_FILE",
       "SGLANG_VERIFY_PROFILE_BASELINE_STEP_MS", "SGLANG_BASELINE_STEP_MS")


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def p4(tree, fake_sglang, monkeypatch):
    """environ.py and spec_profiler.py of the rebased tree, and EAGLEWorkerV2's cycle around stand-ins."""
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    env = load("sglang.srt.environ", tree / SRT / "environ.py")
    sp = load("sglang.srt.speculative.spec_profiler", tree / SRT / "speculative/spec_profiler.py")
    trace = []
    commits = []  # per verify: the committed tokens per request (bonus included); default [2, 3]

    class Draft:  # stands in for EagleDraftWorker
        parallel_layout = None

        def draft(self, batch, *, with_topology=False):
            trace.append("draft")
            return types.SimpleNamespace(is_verify_input=lambda: True, kv_loc_plan=None)

        def _draft_extend_for_decode(self, batch, out, kv_loc_plan=None):
            trace.append("extend")

    class Worker:  # stands in for the model-dependent parts of EAGLEWorkerV2
        speculative_num_steps = 3
        speculative_algorithm = None
        enable_dp_spec_prefill_coordination = False

        def __init__(self):
            self._draft_worker, self._hosts_draft = Draft(), True

        draft_worker = property(lambda self: self._draft_worker)

        def activate_step_by_batch(self, n):
            pass

        def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
            import torch

            trace.append("verify")
            lens = commits.pop(0) if commits else [2, 3]
            return types.SimpleNamespace(accept_lens=torch.tensor(lens, dtype=torch.int32), new_seq_lens=None)

    nullctx = lambda *a, **k: contextlib.nullcontext()  # noqa: E731
    parallel = types.SimpleNamespace(tp_rank=0, pp_size=1, dp_rank=3)
    ns = dict(draft_tp_context=nullctx, speculative_moe_backend_context=nullctx, spec_stage_span=nullctx,
              speculative_moe_a2a_backend_context=nullctx, envs=env.envs, get_parallel=lambda: parallel,
              PPProxyTensors=object, ScheduleBatch=object, EagleVerifyInput=object,
              Optional=__import__("typing").Optional)
    worker_py = tree / SRT / "speculative/eagle_worker_v2.py"
    Worker.forward_batch_generation = defs(worker_py, ["forward_batch_generation"], ns, cls="EAGLEWorkerV2")[
        "forward_batch_generation"]
    init = next(n for n in next(n for n in ast.parse(worker_py.read_text()).body if getattr(n, "name", "") == "EAGLEWorkerV2").body
                if getattr(n, "name", "") == "__init__")
    hook = [s for s in init.body if "maybe_profile_spec_worker" in ast.unparse(s)]
    assert len(hook) == 1, "EAGLEWorkerV2.__init__ must call maybe_profile_spec_worker once"

    def make(tp_rank=0):
        parallel.tp_rank = tp_rank
        w = Worker()
        exec(compile(ast.Module(body=hook, type_ignores=[]), str(worker_py), "exec"),
             {"self": w, "get_parallel": lambda: parallel, "maybe_profile_spec_worker": sp.maybe_profile_spec_worker})
        return w

    def batch():
        mode = types.SimpleNamespace(is_extend=lambda: False, is_idle=lambda: False)
        return types.SimpleNamespace(forward_mode=mode, is_extend_in_batch=False, seq_lens=__import__("torch").ones(2),
                                     spec_info=types.SimpleNamespace(is_verify_input=lambda: False))

    return types.SimpleNamespace(env=env, sp=sp, make=make, batch=batch, trace=trace, commits=commits)


def test_p4_env_switches_on_0523(p4, monkeypatch):
    envs = p4.env.envs
    assert envs.SGLANG_VERIFY_PROFILE.get() is False and envs.SGLANG_VERIFY_PROFILE_INTERVAL.get() == 100
    assert envs.SGLANG_VERIFY_PROFILE_FILE.get() == "" and envs.SGLANG_VERIFY_PROFILE_BASELINE_STEP_MS.get() == 12.2
    monkeypatch.setenv("SGLANG_VERIFY_PROFILE", "1")
    assert envs.SGLANG_VERIFY_PROFILE.get() is True
    # the baseline under P4's own prefix; the old name is a deprecated alias (issue 13 item 5)
    baseline = p4.sp.baseline_step_ms_from_env
    assert envs.SGLANG_BASELINE_STEP_MS.get() is None and baseline() == 12.2
    monkeypatch.setenv("SGLANG_BASELINE_STEP_MS", "20")
    warned = []
    monkeypatch.setattr(p4.sp.logger, "warning", lambda msg, *a: warned.append(msg))
    assert baseline() == 20.0 and "SGLANG_BASELINE_STEP_MS is deprecated" in warned[0]
    monkeypatch.setenv("SGLANG_VERIFY_PROFILE_BASELINE_STEP_MS", "15")
    assert baseline() == 15.0 and len(warned) == 1  # the new name wins, no warning


def test_p4_off_wraps_nothing(p4):
    w = p4.make()
    assert w.spec_profiler is None and "verify" not in vars(w) and "draft" not in vars(w._draft_worker)
    w.forward_batch_generation(p4.batch())
    assert p4.trace == ["draft", "verify", "extend"]


def test_p4_on_times_eagle_v2_cycles(p4, monkeypatch, tmp_path):
    out = tmp_path / "profile.jsonl"
    monkeypatch.setenv("SGLANG_VERIFY_PROFILE", "1")
    monkeypatch.setenv("SGLANG_VERIFY_PROFILE_INTERVAL", "2")
    monkeypatch.setenv("SGLANG_VERIFY_PROFILE_FILE", str(out))
    assert p4.make(tp_rank=1).spec_profiler is None  # rank 0 only
    w = p4.make()
    prof = w.spec_profiler
    assert prof is not None and prof.name == "eagle_v2"
    for _ in range(4):
        w.forward_batch_generation(p4.batch())
    prof.poll()
    assert p4.trace == ["draft", "verify", "extend"] * 4
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert recs and FIELDS <= set(recs[0])
    assert recs[0]["version"] == 2 and recs[0]["dp_rank"] == 3 and recs[0]["pid"] == __import__("os").getpid()
    assert recs[0]["accept_length"] == pytest.approx(2.5) and recs[0]["batch_size"] == 2
    assert recs[0]["baseline_step_ms"] == 12.2 and prof.num_events_created <= 4 * 9
    assert recs[0]["break_even_accept_length"] is None  # no batch-1 cycle: no break-even verdict


def test_p4_accept_length_weighted_by_requests_per_batch_size(p4, monkeypatch, tmp_path):
    """Issue 13 item 5 on 0.5.23: a batch of 1 committing 4 tokens and a batch of 3 committing
    1+1+1 is SGLang's accept len 7/4 = 1.75 (not the mean of per-cycle means, 2.5); tok/s per
    request and throughput; per batch size; the break-even from the batch-1 cycles only."""
    out = tmp_path / "profile.jsonl"
    for k, v in (("SGLANG_VERIFY_PROFILE", "1"), ("SGLANG_VERIFY_PROFILE_INTERVAL", "2"), ("SGLANG_VERIFY_PROFILE_FILE", str(out))):
        monkeypatch.setenv(k, v)
    p4.commits[:] = [[4], [1, 1, 1]]
    w = p4.make()
    for _ in range(2):
        w.forward_batch_generation(p4.batch())
    w.spec_profiler.poll()
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["accept_length"] == pytest.approx(1.75) and rec["tokens"] == 7 and rec["requests"] == 4
    assert set(rec["by_batch_size"]) == {"1", "3"}
    one, three = rec["by_batch_size"]["1"], rec["by_batch_size"]["3"]
    assert one["accept_length"] == 4 and three["accept_length"] == 1 and one["cycles"] == three["cycles"] == 1
    total_ms = one["cycle_ms_mean"] + three["cycle_ms_mean"]
    assert rec["throughput_tok_s"] == pytest.approx(1e3 * 7 / total_ms)
    assert rec["tok_s_per_request"] == pytest.approx(1e3 * 1.75 / (total_ms / 2))
    assert rec["break_even_accept_length"] == pytest.approx(one["cycle_ms_mean"] / 12.2)


# --------------------------------------------------------------------------------------
# apply --venv for a wheel-only release: the pins from the locked wheel


def test_venv_dry_run_reads_the_pins_from_the_locked_wheel(rebased, tmp_path):
    """`apply --venv --dry-run` on the replay's 0.5.23 project: no --release-artifact; the
    release's Requires-Dist come from the locked wheel (index-verified, sglpatch.artifacts)."""
    import os
    import shutil

    uv = shutil.which("uv") or shutil.which("uv", path=os.path.dirname(sys.executable))
    if not uv:
        pytest.skip("uv not found (the dry run resolves with uv here)")
    project = rebased[0]
    assert 'filename = "sglang-0.5.23-cp311' in (project / "upstream.lock").read_text()
    new = tmp_path / "new"
    env = dict(os.environ, PATH=f"{os.path.dirname(uv)}:{os.environ['PATH']}")
    proc = sglpatch("apply", "--project", str(project), "--workdir", str(tmp_path / "fork"), "--venv", str(new), "--dry-run",
                    "--python", sys.executable, env=env)
    assert "requirements from sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl" in proc.stderr, proc.stderr[-2000:]
    assert "pass --release-artifact" not in proc.stderr and "pip download of sglang==0.5.23 failed" not in proc.stderr
    verdict = proc.stdout.strip().splitlines()[-1]
    assert verdict.startswith("preflight: verdict: "), proc.stdout[-2000:] + proc.stderr[-2000:]
    if proc.returncode == 0:  # resolved for this interpreter: the release's own pins
        pins = proc.stdout.split("the release's pins: ", 1)[1].split("\n", 1)[0].split()
        assert {"torch==2.14.1", "flashinfer-python==0.7.2", "sglang-kernel==0.4.10", "transformers==5.19.0"} <= set(pins)
    else:  # this machine's Python cannot take the pins: one line per failed condition
        fails = [line for line in proc.stdout.splitlines() if line.startswith("preflight: FAIL")]
        assert proc.returncode == 1 and fails and all(len(line) < 400 for line in fails), proc.stdout[-2000:]
        assert "preflight refused" in proc.stderr.strip().splitlines()[-1]
    assert not new.exists() and not (tmp_path / "fork").exists()
