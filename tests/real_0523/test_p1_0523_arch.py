"""P1 on SGLang 0.5.23's own modules, at the edges (issue 39): the fusion workspace's size that
BaseRunner hands to upstream's pre_initialize_workspaces at start-up, and the architecture flag
(add_norm's _is_sm120_supported) that picks the SM120-only limit, on each GPU generation.

add_norm computes its flags once, at import, from SGLang's own probes (is_cuda, is_sm120_supported,
...: utils/common.py, through get_platform()). Here those probes answer as a CUDA 12.8 GPU of a
given compute capability (torch.cuda.is_available, torch.version.cuda and get_device_sm, the
three facts they read, with their lru caches cleared), and a fresh copy of the real add_norm module
is executed under them, then stands in sys.modules for the lazy imports of base_runner and the
layer boundary. The one stand-in is pre_initialize_workspaces itself (it maps CUDA IPC memory):
it records what it is handed. The launch config is a real resolved ServerArgs (on CPU the decode
graphs' max_bs is --torch-compile-max-bs)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from sglang.srt.layers import flashinfer_comm_fusion as fcf
from sglang.srt.layers.layer_boundary.residual import add_norm
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import common

HIDDEN = 7168  # Kimi-K2.5's hidden size


def _clear_probe_caches():
    for probe in list(vars(common).values()):
        if hasattr(probe, "cache_clear"):
            probe.cache_clear()


@pytest.fixture
def on_gpu(monkeypatch):
    """on_gpu(major, minor): a fresh add_norm whose flags were computed on that GPU, in sys.modules."""

    def load(major: int, minor: int):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.cuda, "is_available", lambda: True)
            mp.setattr(torch.version, "cuda", "12.8")
            mp.setattr(common, "get_device_sm", lambda: major * 10 + minor)
            _clear_probe_caches()
            try:
                spec = importlib.util.spec_from_file_location(add_norm.__name__, add_norm.__file__)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            finally:
                _clear_probe_caches()  # the next reader asks the real (CPU) machine again
        monkeypatch.setitem(sys.modules, add_norm.__name__, module)
        return module

    yield load
    _clear_probe_caches()


@pytest.fixture
def launched(model_dir):
    """launched(max_bs, draft_tokens): a real resolved ServerArgs with the fusion requested, published."""
    from sglang.srt.runtime_context import create_context, get_exec, use_context

    def make(max_bs: int, draft_tokens: int | None):
        spec = {}
        if draft_tokens:
            spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(model_dir), speculative_num_steps=3,
                        speculative_eagle_topk=1, speculative_num_draft_tokens=draft_tokens)
        sa = ServerArgs(model_path=str(model_dir), tp_size=8, device="cpu", torch_compile_max_bs=max_bs,
                        max_running_requests=4096, flashinfer_allreduce_fusion_backend="trtllm", **spec)
        sa.resolve_once()
        ctx = use_context(create_context(sa, role="test"))
        ctx.__enter__()
        assert get_exec().graph.cuda_graph_config.decode.max_bs == max_bs
        assert get_exec().comm.flashinfer_allreduce_fusion_backend == "trtllm"
        return ctx

    contexts = []
    yield lambda *a: contexts.append(make(*a))
    for ctx in reversed(contexts):
        ctx.__exit__(None, None, None)


@pytest.fixture
def handed(monkeypatch):
    """What BaseRunner._pre_initialize_flashinfer_allreduce_workspace hands to upstream's
    pre_initialize_workspaces (the stand-in records it; the real one maps CUDA IPC memory)."""
    from sglang.srt.model_executor.runner.base_runner import BaseRunner

    calls = []
    monkeypatch.setattr(fcf, "pre_initialize_workspaces", lambda **kw: calls.append(kw))
    mr = types.SimpleNamespace(model_config=types.SimpleNamespace(hidden_size=HIDDEN), dtype=torch.bfloat16,
                               is_draft_worker=False, model=None, max_running_requests=4096)

    def run():
        calls.clear()
        BaseRunner._pre_initialize_flashinfer_allreduce_workspace(types.SimpleNamespace(model_runner=mr))
        return calls

    return run


# (major, minor): the SM120-only limit on SM120 (12.0, the RTX PRO 6000) and 12.1 (GB10) only;
# upstream's 2048 on SM90, SM100/SM103, SM110 and SM89.
GPUS = [(9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1), (8, 9)]
# (max_bs, draft tokens, SM120's limit): just below, at and above the 2048 cap; without speculation
LIMITS = [(511, 4, 2044), (512, 4, 2048), (513, 4, 2048), (600, 4, 2048), (511, None, 511), (2049, None, 2048), (8, 4, 32)]


@pytest.mark.parametrize("major, minor", GPUS)
@pytest.mark.parametrize("max_bs, draft, sm120_limit", LIMITS)
def test_startup_workspace_size_handed_on_each_gpu(on_gpu, launched, handed, major, minor, max_bs, draft, sm120_limit):
    """The size pre-allocated before graph capture: SM12x's decode/verify width, upstream's 2048
    everywhere else; the other numbers (hidden size, dtype) handed on unchanged."""
    launched(max_bs, draft)
    module = on_gpu(major, minor)
    expect = sm120_limit if major == 12 else 2048
    assert module._is_sm120_supported is (major == 12)
    assert (module._is_sm90_supported, module._is_sm100_supported) == (major == 9, major == 10)
    assert handed() == [dict(max_token_num=expect, hidden_dim=HIDDEN, dtype=torch.bfloat16)]
    assert module.get_fuse_allreduce_max_tokens() == expect


@pytest.mark.parametrize("major, minor", GPUS)
def test_fusion_applies_up_to_the_limit_on_each_gpu(on_gpu, launched, major, minor):
    """Both sides of each generation's limit (SM120: 511 x 4 = 2044; elsewhere 2048): SM100 fuses
    2045..2048 tokens as upstream does; SM8x/SM11x never fuse (not upstream's architectures)."""
    launched(511, 4)
    module = on_gpu(major, minor)
    applies = module.flashinfer_ar_fusion_applies
    sizes = (1, 2044, 2045, 2048, 2049)
    if major == 12:
        assert [applies(n) for n in sizes] == [True, True, False, False, False]
    elif major in (9, 10):
        assert [applies(n) for n in sizes] == [True, True, True, True, False]
    else:
        assert [applies(n) for n in sizes] == [False] * 5
    assert applies(0) is False


def test_startup_size_without_a_fusion_backend_is_not_handed(on_gpu, model_dir, handed):
    """No fusion requested: nothing is pre-allocated, on SM120 as upstream."""
    from sglang.srt.runtime_context import create_context, use_context

    sa = ServerArgs(model_path=str(model_dir), tp_size=8, device="cpu")
    sa.resolve_once()
    with use_context(create_context(sa, role="test")):
        on_gpu(12, 0)
        assert handed() == []
