"""Tests that run inside the 0.5.23 venv (issue 18), on SGLang 0.5.23's own modules.

They import the patched 0.5.23 tree (on PYTHONPATH), so the main suite does not collect them:
tests/test_port_0523.py runs them in a subprocess with the 0.5.23 venv's python
(SGLPATCH_REAL_0523=1), and `sglpatch.mutants` runs them against planted faults.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

@pytest.fixture(scope="session", autouse=True)
def _patched_0523_tree():
    import sglang

    tree = os.environ["SGLPATCH_REAL_0523"]
    assert Path(sglang.__file__).resolve().is_relative_to(Path(tree).resolve()), (sglang.__file__, tree)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A local model folder (config.json only): the passes read the architecture from it."""
    d = tmp_path_factory.mktemp("model")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
           "max_position_embeddings": 256, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture
def sm(monkeypatch):
    """Override the platform facts (SGLang's own override_platform) to a GPU generation."""
    from sglang.srt.runtime_context import override_platform

    overrides = []

    def use(major: int):
        o = override_platform(is_sm90=major == 9, is_sm100=major == 10, is_sm120=major == 12)
        o.install()
        overrides.append(o)

    yield use
    for o in reversed(overrides):
        o.restore()
