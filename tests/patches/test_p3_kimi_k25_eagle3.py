"""P3 (0003-kimi-k25-eagle3-delegation): KimiK25ForConditionalGeneration delegates the
EAGLE-3 hooks to its language model.

`sglang.srt.models.kimi_k25` cannot be imported without sgl_kernel's CUDA library and
the quantization stack, so the test compiles the patched methods from the patched
source file (the code under test, unchanged) into a class that derives from
torch.nn.Module like the real one, and drives them with a stand-in language model.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from sglpatch.series import read_series

PROJECT = Path(os.environ.get("SGLPATCH_PROJECT") or Path(__file__).resolve().parents[2])
P3_IN_SERIES = "0003-kimi-k25-eagle3-delegation.patch" in read_series(PROJECT).names

KIMI = "python/sglang/srt/models/kimi_k25.py"
DEEPSEEK = "python/sglang/srt/models/deepseek_v2.py"
METHODS = ("set_eagle3_layers_to_capture", "get_embed_and_head", "set_embed_and_head")

CODE = r"""
import ast, inspect, json, sys
from typing import List, Optional, Tuple
import torch
from torch import nn

PATH = {path!r}
METHODS = {methods!r}
tree = ast.parse(open(PATH).read(), PATH)
cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KimiK25ForConditionalGeneration")
funcs = {{f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}}
missing = [m for m in METHODS if m not in funcs]
assert not missing, f"patched class lacks {{missing}}"
# the public methods plus the private helpers of the class that they call on self
wanted, todo = set(), list(METHODS)
while todo:
    name = todo.pop()
    if name in wanted:
        continue
    wanted.add(name)
    for node in ast.walk(funcs[name]):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and node.attr in funcs):
            todo.append(node.attr)
cls.body = [funcs[n] for n in sorted(wanted)]
cls.bases = [ast.copy_location(ast.Name("Module", ast.Load()), cls)]
cls.decorator_list = []
ast.fix_missing_locations(cls)
ns = dict(torch=torch, Module=nn.Module, List=List, Optional=Optional, Tuple=Tuple)
exec(compile(ast.Module(body=[cls], type_ignores=[]), PATH, "exec"), ns)
Kimi = ns["KimiK25ForConditionalGeneration"]

class StandInLM(nn.Module):  # plays DeepseekV3ForCausalLM
    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.randn(8, 4))
        self.head = nn.Parameter(torch.randn(8, 4))
        self.calls = []
    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.calls.append(("capture", layer_ids))
    def get_embed_and_head(self):
        self.calls.append(("get",))
        return self.embed, self.head
    def set_embed_and_head(self, embed, head):
        self.calls.append(("set", embed, head))

def make(lm):
    m = Kimi.__new__(Kimi)
    nn.Module.__init__(m)
    m.language_model = lm
    return m

out = {{}}
lm = StandInLM()
m = make(lm)
m.set_eagle3_layers_to_capture()
m.set_eagle3_layers_to_capture([1, 29, 57])
e, h = m.get_embed_and_head()
new_e, new_h = torch.zeros(8, 4), torch.ones(8, 4)
m.set_embed_and_head(new_e, new_h)
out["capture_calls"] = [c[1] for c in lm.calls if c[0] == "capture"]
out["get_identity"] = e is lm.embed and h is lm.head
sets = [c for c in lm.calls if c[0] == "set"]
out["set_identity"] = len(sets) == 1 and sets[0][1] is new_e and sets[0][2] is new_h
out["signatures"] = {{n: list(inspect.signature(getattr(Kimi, n)).parameters) for n in METHODS}}
out["default_layer_ids"] = inspect.signature(Kimi.set_eagle3_layers_to_capture).parameters["layer_ids"].default

bare = make(nn.Linear(2, 2))  # a language model without the hooks
errors = {{}}
for name, args in (("set_eagle3_layers_to_capture", ([2],)), ("get_embed_and_head", ()),
                   ("set_embed_and_head", (new_e, new_h))):
    try:
        getattr(bare, name)(*args)
        errors[name] = None
    except AttributeError as exc:
        errors[name] = str(exc)
out["errors"] = errors
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def result(patched_tree, run_patched):
    code = CODE.format(path=str(patched_tree / KIMI), methods=METHODS)
    proc = run_patched(code, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_delegates_set_eagle3_layers_to_capture(result):
    # default (None) and explicit layer ids reach the language model unchanged
    assert result["capture_calls"] == [None, [1, 29, 57]]
    assert result["default_layer_ids"] is None


def test_delegates_embed_and_head(result):
    assert result["get_identity"], "get_embed_and_head must return the language model's own tensors"
    assert result["set_identity"], "set_embed_and_head must pass the given tensors through"


def test_same_names_and_parameters_as_upstream(result):
    # upstream PR #19689 (v0.5.10): set_eagle3_layers_to_capture(layer_ids=None),
    # get_embed_and_head(), set_embed_and_head(embed, head)
    assert result["signatures"] == {
        "set_eagle3_layers_to_capture": ["self", "layer_ids"],
        "get_embed_and_head": ["self"],
        "set_embed_and_head": ["self", "embed", "head"],
    }


@pytest.mark.parametrize("name", METHODS)
def test_clear_attribute_error_when_language_model_lacks_it(result, name):
    msg = result["errors"][name]
    assert msg is not None, f"{name} must raise AttributeError on a language model without it"
    if not P3_IN_SERIES:
        pytest.skip("P3 left the series (upstream since v0.5.10, PR #19689): the message is upstream's")
    assert name in msg and "Linear" in msg  # names the missing method and the class
    assert "--speculative-algorithm" in msg  # says what to do


def test_delegation_target_really_has_the_methods(patched_tree):
    # DeepseekV3ForCausalLM (Kimi-K2.5's language_model) inherits them from DeepseekV2ForCausalLM
    src = (patched_tree / DEEPSEEK).read_text()
    body = src[src.index("class DeepseekV2ForCausalLM(") : src.index("class DeepseekV3ForCausalLM(")]
    for name in METHODS:
        assert re.search(rf"\n    def {name}\(", body), name
    assert "class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM)" in src
