"""P5 against flashinfer 0.7.2's real modules, in the 0.5.23 test venv (flashinfer-python 0.7.2 as
installed, torch 2.14.1 on the CPU; issue 52's item 0 and its "flashinfer version from a real
install"): the patched 0.5.9 tree first on PYTHONPATH.

* ``tuned_buckets`` (the tuning step's check that the cache covers every served bucket) reads the
  keys flashinfer's autotuner really saves: entries put in its profiling cache under choose_one's
  key (``AutoTuner._get_cache_key`` with the runner's ``get_cache_key_extras``, as tune() does),
  written by its real ``save_configs``. A cache saved with no entry ("Saved 0 configs", the hollow
  cache of 2026-12-06), one for part of the buckets, for another workspace (width, fabric profile,
  world size) or another dtype covers exactly what it holds for this one.
* ``cache_loaded`` (the server's start-up line) is flashinfer's own answer after its real
  ``load_configs``, as the workspace's build runs it.
* ``tune_cache_key``'s flashinfer version is the real install's metadata (the main test venv has no
  flashinfer: there it is None).

Stand-in: ``pynvml`` (flashinfer.utils imports it; NVML is used only on a GPU), an empty module.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from conftest import venv_0523

CODE = r'''
import importlib.metadata, json, os, sys, tempfile, types
sys.modules.setdefault("pynvml", types.ModuleType("pynvml"))  # imported by flashinfer.utils, used only on a GPU
import torch
from flashinfer.autotuner import AutoTuner
from flashinfer.comm.pcie_ipc_tuning import (PCIE_IPC_CUSTOM_OP, PcieIpcAllReduceRunner, pcie_ipc_tuning_config)
import sglang.srt.distributed.device_communicators.pcie_ipc_allreduce as m

BUCKETS, H = (3, 6, 12, 24), 7168
def ws(**kw):
    return types.SimpleNamespace(**dict(dict(world_size=4, profile="rootcplx", max_blocks=36, max_numel=24 * H,
                                             memop_supported=False), **kw))
tuner = AutoTuner.get()
def saved(entries, path):
    """Save entries as flashinfer's tune() leaves them: choose_one's key per bucket, then save_configs."""
    tuner.clear_cache()
    for w, rows, dtype in entries:
        runner = PcieIpcAllReduceRunner(w)
        inp = torch.empty(rows, H, dtype=dtype)
        key = AutoTuner._get_cache_key(PCIE_IPC_CUSTOM_OP, runner, ((rows, H),),
                                       pcie_ipc_tuning_config(BUCKETS), runner.get_cache_key_extras([inp]))
        tuner.profiling_cache[key] = ((1, 8, 512), None)
    tuner.save_configs(path)
    tuner.clear_cache()
    return path

out, d, bf = {}, tempfile.mkdtemp(), torch.bfloat16
cases = {"all": [(ws(), r, bf) for r in BUCKETS], "two": [(ws(), r, bf) for r in (3, 6)], "none": [],
         "other_numel": [(ws(max_numel=25 * H), r, bf) for r in BUCKETS],
         "other_profile": [(ws(profile="pcieswitch"), r, bf) for r in BUCKETS],
         "other_ranks": [(ws(world_size=8), r, bf) for r in BUCKETS],
         "fp16": [(ws(), r, torch.float16) for r in BUCKETS]}
for name, entries in cases.items():
    path = saved(entries, os.path.join(d, name + ".json"))
    tuner.clear_cache()
    tuner.load_configs(path)  # what the workspace does at its build with tune_cache=path
    out[name] = {"tuned": list(m.tuned_buckets(ws(), H, BUCKETS, path)), "loaded": m.cache_loaded(ws())}
out["key_flashinfer"] = m.tune_cache_key(4, H, 24 * H, BUCKETS)["flashinfer"]
out["installed"] = importlib.metadata.version("flashinfer-python")
print("RESULT" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def result(patched_tree, tmp_path_factory):
    py = venv_0523()  # $SGLPATCH_TEST_VENV_0523, else .venv-0523 (also where the variable is unset: the mutants' runs)
    if not py.exists():  # the suite's own venv (scripts/test.sh builds it), not the code under test: the user's cpu tier has none
        pytest.skip("needs the 0.5.23 test venv (scripts/test.sh builds it) for flashinfer 0.7.2")
    cwd = tmp_path_factory.mktemp("realfi")
    env = dict(os.environ, PYTHONPATH=str(patched_tree / "python"), CUDA_VISIBLE_DEVICES="", TMPDIR=str(cwd))
    proc = subprocess.run([str(py), "-c", CODE], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("case,tuned,loaded", [
    ("all", [3, 6, 12, 24], True),
    ("two", [3, 6], True),  # flashinfer loads them: only the step's per-bucket count refuses this cache
    ("none", [], False),  # "Saved 0 configs": the hollow cache
    ("other_numel", [], False),
    ("other_profile", [], False),
    ("other_ranks", [], False),
    ("fp16", [], True)])  # flashinfer's load ignores the dtype; the served bf16 has no entry
def test_the_coverage_is_read_from_the_keys_flashinfer_saves(result, case, tuned, loaded):
    assert result[case] == {"tuned": tuned, "loaded": loaded}


def test_the_cache_key_names_the_installed_flashinfer(result):
    assert result["installed"] == "0.7.2" and result["key_flashinfer"] == "0.7.2"
