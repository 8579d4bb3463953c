"""P1 on SGLang 0.5.23's own modules (issue 18): the SM120 gate through ServerArgs and the real
post-process passes, backend resolution, the workspace pre-check without multicast, the
start-up line naming the decode/verify allreduce, and the allreduce dispatch with PCIe-IPC."""

from __future__ import annotations

import json
import logging
import os
import types

import pytest
import torch

from sglang.srt.arg_groups import overrides as ov
from sglang.srt.arg_groups.model_hook import handle_model_specific_adjustments
from sglang.srt.distributed.device_communicators import custom_all_reduce_utils
from sglang.srt.layers import flashinfer_comm_fusion as fcf
from sglang.srt.server_args import ServerArgs


def resolved_backend(model_dir, **kw):
    """handle_model_specific_adjustments (all its post-process passes, in upstream's order) on a
    real ServerArgs; the backend as the passes left it."""
    sa = ServerArgs(model_path=str(model_dir), tp_size=4, **kw)
    handle_model_specific_adjustments(sa)
    return ov.ResolvedView(sa, overlay=ov._declaration_overlay(sa)).flashinfer_allreduce_fusion_backend


@pytest.fixture
def p2p(monkeypatch):
    """gpu_p2p_access_check needs CUDA: the pairs answer as told (recorded)."""
    state = types.SimpleNamespace(ok=True, pairs=[])

    def check(src, tgt):
        state.pairs.append((src, tgt))
        return state.ok

    monkeypatch.setattr(custom_all_reduce_utils, "gpu_p2p_access_check", check)
    return state


@pytest.mark.parametrize("pcie_ipc, p2p_ok, backend, probed", [
    (None, True, "auto", True),     # opt-in honoured: flashinfer 0.7.2, P2P on all pairs
    ("1", True, None, False),       # PCIe-IPC on: it serves decode/verify, fusion cleared, no probe
    (None, False, None, True),      # no P2P between two TP GPUs
])  # fmt: skip
def test_sm120_gate_through_server_args(model_dir, sm, p2p, monkeypatch, caplog, pcie_ipc, p2p_ok, backend, probed):
    if pcie_ipc:
        monkeypatch.setenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", pcie_ipc)
    else:
        monkeypatch.delenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", raising=False)
    p2p.ok = p2p_ok
    sm(12)
    with caplog.at_level(logging.WARNING):
        assert resolved_backend(model_dir, flashinfer_allreduce_fusion_backend="auto") == backend
    assert bool(p2p.pairs) == probed
    if probed and p2p_ok:
        assert len(p2p.pairs) == 12 and (3, 0) in p2p.pairs  # every ordered pair of 4 GPUs
    warned = [r.getMessage() for r in caplog.records if "allreduce fusion is disabled" in r.getMessage()]
    assert len(warned) == (backend is None)
    if pcie_ipc:
        assert "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 hands the decode/verify reductions" in warned[0]


def test_sm120_gate_needs_fixed_flashinfer(model_dir, sm, p2p, monkeypatch):
    import importlib.metadata as md

    real = md.version
    monkeypatch.setattr(md, "version", lambda name: "0.6.16" if name == "flashinfer-python" else real(name))
    sm(12)
    assert resolved_backend(model_dir, flashinfer_allreduce_fusion_backend="auto") is None
    assert not p2p.pairs  # the version is checked before the probe


def test_sm120_never_auto_enabled_and_sm100_untouched(model_dir, sm, p2p, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "1")
    sm(12)
    assert resolved_backend(model_dir) is None
    sm(10)
    assert resolved_backend(model_dir, flashinfer_allreduce_fusion_backend="trtllm") == "trtllm"
    assert not p2p.pairs


def test_backend_resolution(sm):
    sm(12)
    assert fcf._resolve_backend("auto") == "trtllm" and fcf._resolve_backend("trtllm") == "trtllm"
    for bad, multi in (("mnnvl", False), ("cutedsl", False), ("auto", True)):
        with pytest.raises(ValueError, match="SM120"):
            fcf._resolve_backend(bad, multi)
    sm(8)
    with pytest.raises(ValueError, match="requires SM90"):
        fcf._resolve_backend("auto")


class Driver:
    """The CUDA driver bindings' calls the workspace pre-check makes, on a GPU without multicast."""

    class CUresult:
        CUDA_SUCCESS, CUDA_ERROR_NOT_SUPPORTED = 0, 801

    CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
    CUmulticastGranularity_flags = types.SimpleNamespace(CU_MULTICAST_GRANULARITY_RECOMMENDED=1)
    CUmulticastObjectProp = types.SimpleNamespace

    def __init__(self):
        self.multicast_asked = 0

    def cuMemGetAllocationGranularity(self, prop, flags):
        return 0, 2 << 20

    def cuMulticastGetGranularity(self, prop, flags):
        self.multicast_asked += 1
        return self.CUresult.CUDA_ERROR_NOT_SUPPORTED, 0


def test_workspace_precheck_on_gpus_without_multicast(sm):
    """Issue 18 (b): flashinfer maps the trtllm workspace without multicast; on SM120 the pre-check
    must not ask for the multicast granularity (it fails there and would turn P1 off)."""
    prop = types.SimpleNamespace(requestedHandleTypes=1)
    sm(12)
    drv = Driver()
    sizes = fcf._flashinfer_trtllm_workspace_allocation_sizes(drv, prop, 8, 32, 7168, torch.bfloat16)
    assert drv.multicast_asked == 0 and len(sizes) == 3 and all(s % (2 << 20) == 0 for s in sizes)
    assert sizes[2] >= 3 * 8 * 32 * 7168 * 2  # the lamport buffers, x3
    sm(10)  # upstream unchanged elsewhere
    with pytest.raises(RuntimeError, match="cuMulticastGetGranularity failed"):
        fcf._flashinfer_trtllm_workspace_allocation_sizes(Driver(), prop, 8, 32, 7168, torch.bfloat16)


@pytest.fixture
def published(model_dir):
    """A real resolved ServerArgs published into a context of SGLang's own (role "test")."""
    from sglang.srt.runtime_context import create_context, use_context

    def make(**kw):
        sa = ServerArgs(model_path=str(model_dir), tp_size=8, device="cpu", **kw)
        sa.resolve_once()
        return use_context(create_context(sa, role="test"))

    make.model = str(model_dir)
    return make


def comm(disabled=False, serves=True):
    return types.SimpleNamespace(disabled=disabled, should_pcie_ipc_ar=lambda x: serves, should_custom_ar=lambda x: serves)


def group(**kw):
    g = dict(world_size=8, rank_in_group=0, ca_comm=None, pcie_ipc_comm=None)
    g.update(kw)
    return types.SimpleNamespace(**g)


@pytest.fixture
def startup(monkeypatch, caplog):
    """log_decode_allreduce_path with the module's once-per-process flag reset; the lines it logged
    are also written to $SGLPATCH_0523_OUT (tests/test_port_0523.py feeds them to the regression
    suite's evidence reader)."""
    lines = []

    def run(g, workspace_backend=None):
        monkeypatch.setattr(fcf, "_decode_allreduce_path_logged", False)
        manager = fcf._get_workspace_manager(use_attn_tp_group=True)
        monkeypatch.setattr(manager, "initialized", workspace_backend is not None)
        monkeypatch.setattr(manager, "workspace", object() if workspace_backend else None)
        monkeypatch.setattr(manager, "backend", workspace_backend)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=fcf.logger.name):
            path = fcf.log_decode_allreduce_path(g)
            assert fcf.log_decode_allreduce_path(g) == path  # once per process
        got = [r for r in caplog.records if r.getMessage().startswith("Decode/verify allreduce: ")]
        assert len(got) == 1, [r.getMessage() for r in caplog.records]
        lines.append(got[0].getMessage())
        return path, got[0]

    yield run
    out = os.environ.get("SGLPATCH_0523_OUT")
    if out:
        with open(out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


def test_startup_line_names_the_decode_path(published, sm, p2p, startup, monkeypatch):
    monkeypatch.delenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", raising=False)
    with published():
        path, rec = startup(group(pcie_ipc_comm=comm()))
        assert path == "PCIe-IPC" and rec.levelno == logging.INFO
        assert startup(group(pcie_ipc_comm=comm(disabled=True)))[0] == "NCCL"
        assert startup(group())[0] == "NCCL"
        assert startup(group(ca_comm=comm(), pcie_ipc_comm=comm()))[0] == "custom allreduce"  # ca is tried first
    sm(12)
    with published(flashinfer_allreduce_fusion_backend="trtllm"):
        path, rec = startup(group(pcie_ipc_comm=comm()), workspace_backend="trtllm")
        assert path == "trtllm fused" and rec.levelno == logging.WARNING
        assert "not measured on PCIe" in rec.getMessage() and "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" in rec.getMessage()
        path, rec = startup(group())  # requested, but the workspace was not built (pre-check, import)
        assert path == "NCCL" and rec.levelno == logging.WARNING and "requested but is unavailable" in rec.getMessage()


def test_startup_line_once_per_process_and_rank0_only(published, monkeypatch, caplog):
    monkeypatch.setattr(fcf, "_decode_allreduce_path_logged", False)
    with published(), caplog.at_level(logging.INFO, logger=fcf.logger.name):
        assert fcf.log_decode_allreduce_path(group(rank_in_group=3)) == "NCCL"
        assert fcf.log_decode_allreduce_path(group(world_size=1)) == "NCCL"
    assert not [r for r in caplog.records if r.getMessage().startswith("Decode/verify")]


def test_base_runner_logs_the_line_after_the_workspaces(published):
    """BaseRunner._warmup builds the fusion, fi-a2a and PCIe-IPC workspaces, then logs the line."""
    import ast
    import inspect

    from sglang.srt.model_executor.runner.base_runner import BaseRunner

    calls = [n.func.attr for n in ast.walk(ast.parse(inspect.getsource(BaseRunner._warmup).lstrip()))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr.startswith("_")]
    i = calls.index("_log_decode_allreduce_path")
    assert calls[i - 1] == "_pre_initialize_pcie_ipc_workspace" and calls.count("_log_decode_allreduce_path") == 1


@pytest.mark.parametrize("env, expect", [("1", "pcie_ipc"), (None, None)])
def test_allreduce_dispatch_with_pcie_ipc_on_and_off(monkeypatch, env, expect):
    """GroupCoordinator._resolve_outplace_all_reduce_method on the patched tree: with
    SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 the TP group gets a PCIe-IPC communicator (eligible_group,
    real) and the small tensors go to it; without, nothing accelerated applies (NCCL in-place).
    P2 is dropped on 0.5.23, so 'ca' (off on >2 PCIe-only GPUs) does not take them first."""
    from sglang.srt.distributed.device_communicators.pcie_ipc_ar import eligible_group
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    if env:
        monkeypatch.setenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", env)
    else:
        monkeypatch.delenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", raising=False)
    g = object.__new__(GroupCoordinator)
    g.ca_comm = g.qr_comm = g.pymscclpp_comm = g.torch_symm_mem_comm = g.pynccl_comm = None
    g.pcie_ipc_comm = comm() if eligible_group(group_name="tp", world_size=8, deterministic=False) else None
    x = torch.empty(3, 7168, dtype=torch.bfloat16)
    assert g._resolve_outplace_all_reduce_method(x) == expect
    g.ca_comm = comm(disabled=True)  # SGLang's custom allreduce, switched off on PCIe-only GPUs
    assert g._resolve_outplace_all_reduce_method(x) == expect


def test_fusion_token_limit_from_the_launch_config(published, monkeypatch):
    """SM120: fused (and the workspace sized) only up to the captured decode/verify width:
    cuda_graph_max_bs x draft tokens per request; prefill stays on NCCL."""
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.runtime_context import get_exec

    monkeypatch.setattr(add_norm, "_is_sm120_supported", True)  # computed at import from CUDA
    monkeypatch.setattr(add_norm, "_sm120_fuse_allreduce_max_tokens", None)
    with published(speculative_algorithm="EAGLE3", speculative_draft_model_path=published.model,
                   speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4):
        max_bs = get_exec().graph.cuda_graph_config.decode.max_bs
        assert max_bs and add_norm.get_fuse_allreduce_max_tokens() == max_bs * 4 < 2048
    monkeypatch.setattr(add_norm, "_sm120_fuse_allreduce_max_tokens", None)
    with published():
        assert add_norm.get_fuse_allreduce_max_tokens() == get_exec().graph.cuda_graph_config.decode.max_bs  # 1 token each
    monkeypatch.setattr(add_norm, "_is_sm120_supported", False)
    assert add_norm.get_fuse_allreduce_max_tokens() == 2048  # SM90/SM100 unchanged


# ---------------------------------------------------------------- at the edges (issue 29)


def test_p2p_probe_walks_base_gpu_id_by_gpu_id_step(model_dir, sm, p2p, monkeypatch):
    """--base-gpu-id 2 --gpu-id-step 2 on 4 TP ranks: the probe asks GPUs 2, 4, 6, 8, not 0-3 or 2-5."""
    monkeypatch.delenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", raising=False)
    sm(12)
    assert resolved_backend(model_dir, flashinfer_allreduce_fusion_backend="auto", base_gpu_id=2, gpu_id_step=2) == "auto"
    ids = [2, 4, 6, 8]
    assert sorted(p2p.pairs) == [(i, j) for i in ids for j in ids if i != j]


@pytest.mark.parametrize("version, ok", [
    (None, False), ("0.6.9", False), ("0.6.16", False), ("0.6.16.post4", False),
    ("0.6.17", True), ("0.6.17.post1", True), ("0.6.18", True), ("0.7.2", True), ("0.10.0", True), ("1.0", True),
])  # fmt: skip
def test_flashinfer_floor_on_both_sides_with_multi_digit_and_post_versions(version, ok):
    reason = ov.get_flashinfer_allreduce_fusion_blocker(12, version, True, True)
    assert (reason is None) is ok, reason
    if not ok:
        assert reason == (f"SM120 needs flashinfer-python>=0.6.17 (installed: {version or 'not installed'}); "
                          "older releases do not build or silently miscompute it on SM12x")


@pytest.mark.parametrize("sm_major", [8, 9, 10, 11, 12])
def test_other_architectures_unchanged(sm_major):
    """SM90/SM100: upstream's rule (no version, P2P or PCIe-IPC condition); SM8x/SM11x refused; the
    token limit is upstream's everywhere but SM12x."""
    for version in (None, "0.6.3", "0.7.2"):
        for p2p_ok in (False, True):
            reason = ov.get_flashinfer_allreduce_fusion_blocker(sm_major, version, True, p2p_ok, pcie_ipc_on=True)
            if sm_major in (9, 10):
                assert reason is None
            elif sm_major != 12:
                assert reason == f"it supports SM90, SM100 and SM120 only, this GPU is SM{sm_major}x"
    limit = ov.get_flashinfer_allreduce_fusion_max_tokens(sm_major, 8, 4, 2048)
    assert limit == (32 if sm_major == 12 else 2048)


def test_sm120_token_limit_just_below_at_and_above_the_cap():
    f = ov.get_flashinfer_allreduce_fusion_max_tokens
    assert [f(12, bs, 4, 2048) for bs in (511, 512, 513, 4096)] == [2044, 2048, 2048, 2048]
    assert [f(12, bs, 1, 2048) for bs in (2047, 2048, 2049)] == [2047, 2048, 2048]
    assert f(12, None, 0, 2048) == 1 and f(12, 0, 4, 2048) == 4  # no CUDA graphs: one request


def test_fusion_token_limit_without_speculation_ignores_draft_tokens(published, monkeypatch):
    """A draft-token setting left over without a speculative algorithm does not widen the limit."""
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.runtime_context import get_exec, get_spec

    monkeypatch.setattr(add_norm, "_is_sm120_supported", True)
    monkeypatch.setattr(add_norm, "_sm120_fuse_allreduce_max_tokens", None)
    with published(speculative_num_draft_tokens=4):
        assert get_spec().speculative_algorithm is None and get_spec().speculative_num_draft_tokens == 4
        assert add_norm.get_fuse_allreduce_max_tokens() == get_exec().graph.cuda_graph_config.decode.max_bs


def test_gate_warning_says_what_is_used_and_how_to_get_the_fusion(model_dir, sm, p2p, monkeypatch, caplog):
    monkeypatch.delenv("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", raising=False)
    p2p.ok = False
    sm(12)
    with caplog.at_level(logging.WARNING):
        assert resolved_backend(model_dir, flashinfer_allreduce_fusion_backend="auto") is None
    (w,) = [r.getMessage() for r in caplog.records if "allreduce fusion is disabled" in r.getMessage()]
    assert w == ("FlashInfer allreduce fusion is disabled because not all TP ranks have P2P access to each other. "
                 "Using the unfused allreduce. To use the fusion on SM120, install flashinfer-python>=0.6.17 "
                 "on a single node with P2P between all TP GPUs and leave SGLANG_ENABLE_PCIE_IPC_ALLREDUCE off; "
                 "otherwise drop --flashinfer-allreduce-fusion-backend to silence this warning.")
