"""P5's flashinfer set on 0.5.9: one release for P1 and P5, and 0.5.9's flashinfer calls against it.

* deps/flashinfer.toml (what `--with-flashinfer` installs) and P5's python/pyproject.toml hunk
  name the same flashinfer-python, and the patched tree pins none of what the set removes, nor
  imports quack anywhere (quack-kernels 0.2.4 needs nvidia-cutlass-dsl<4.4, flashinfer 0.7.2 >=4.6.2).
* Every flashinfer name the patched 0.5.9 tree imports resolves in flashinfer 0.7.2's real module
  (the 0.5.23 test venv has it), but one under try/except; every call through such a name (functions
  and constructors; methods of wrapper objects are not followed) in the files on Kimi-K2.5's SM120
  serving path binds to 0.7.2's real signature. Stand-in: pynvml (NVML needs a GPU), empty.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT, venv_0523

P5 = ROOT / "patches" / "0005-parallel_state-opt-in-FlashInfer-PCIe-IPC-allreduce.patch"
SERVING = [  # Kimi-K2.5 (MLA, EAGLE-3 drafter) on SM120 with P1 and P5
    "layers/flashinfer_comm_fusion.py",
    "distributed/device_communicators/pcie_ipc_allreduce.py",
    "layers/attention/flashinfer_mla_backend.py",
    "layers/attention/flashinfer_backend.py",
    "layers/attention/utils.py",
    "layers/layernorm.py",
    "layers/moe/topk.py",
    "model_executor/model_runner.py",
    "server_args.py",
]
# what 0.5.9 imports that flashinfer 0.7.2 lacks: (file, guarded by try/except)
MISSING = {
    # for flashinfer <= 0.1.6: imported and called inside a try whose except takes the other branch
    "flashinfer.decode._grouped_size_compiled_for_decode_kernels": ("layers/attention/flashinfer_backend.py", True),
    # moved to flashinfer.gemm in 0.7: this module breaks with 0.7.2. Only modelopt_quant's NVFP4
    # cutedsl MoE imports it, inside a function: not Kimi-K2.5 INT4's path (P5's header says so)
    "flashinfer.cute_dsl.blockscaled_gemm.grouped_gemm_nt_masked": ("layers/moe/flashinfer_cutedsl_moe.py", False),
}


def tree_version(tree: Path) -> str:
    text = (tree / "python" / "sglang" / "_version.py").read_text()
    return re.search(r"__version__ = version = '([^']+)'", text).group(1)


def fiset() -> dict:
    return tomllib.loads((ROOT / "deps" / "flashinfer.toml").read_text())["flashinfer"]


def hunk(path: str) -> list[str]:
    text = P5.read_text()
    start = text.index(f"diff --git a/{path} b/{path}")
    end = text.find("\ndiff --git ", start + 1)
    return text[start : end if end > 0 else len(text)].splitlines()


def test_p5_pins_the_flashinfer_of_the_set_and_drops_what_it_removes():
    fs = fiset()
    lines = hunk("python/pyproject.toml")
    added = [ln[1:].strip() for ln in lines if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln[1:].strip() for ln in lines if ln.startswith("-") and not ln.startswith("---")]
    pins = {re.split(r"[=<>!~ ;]", s.strip('",'))[0].replace("_", "-").lower(): s for s in added}
    assert list(pins) == ["flashinfer-python"] and f'"flashinfer_python=={fs["version"]}"' in pins["flashinfer-python"]
    gone = {re.split(r"[=<>!~ ;]", s.strip('",'))[0].replace("_", "-").lower() for s in removed}
    assert gone == {"flashinfer-python", "flashinfer-cubin", "quack-kernels"} and gone - {"flashinfer-python"} <= set(fs["remove"])
    assert "-from quack import copy_utils as quack_copy_utils" in hunk("python/sglang/jit_kernel/flash_attention/cute/flash_fwd.py")


def test_cutedsl_moe_is_imported_only_inside_a_function(patched_tree):
    srt = patched_tree / "python" / "sglang" / "srt"
    users = [p for p in srt.rglob("*.py") if b"flashinfer_cutedsl_moe import" in p.read_bytes()]
    assert [str(p.relative_to(srt)) for p in users] == ["layers/quantization/modelopt_quant.py"]
    line = next(ln for ln in users[0].read_text().splitlines() if "flashinfer_cutedsl_moe import" in ln)
    assert line.startswith("        from ")  # inside a method, not at module level


def test_patched_tree_pins_the_set_and_imports_no_quack(patched_tree):
    fs = fiset()
    deps = tomllib.loads((patched_tree / "python" / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[=<>!~ ;\[]", d)[0].replace("_", "-").lower(): d for d in deps}
    assert names["flashinfer-python"] == f"flashinfer_python=={fs['version']}"
    kept = set(names) & set(fs["remove"])
    if tree_version(patched_tree) == "0.5.9":
        assert not kept
    else:  # 0.5.10.post1's port keeps quack-kernels>=0.3.0 (0.6.5 needs cutlass-dsl>=4.7: 0.7.2 allows it)
        assert kept <= {"quack-kernels"} and "==0.2" not in names.get("quack-kernels", "")
    quack = [str(p) for p in (patched_tree / "python" / "sglang").rglob("*.py") if re.search(r"^\s*(from|import) quack\b", p.read_text(), re.M)]
    assert quack == []


def scan(path: Path) -> tuple[list[dict], list[dict]]:
    """(imports, calls) of flashinfer in one file: each imported dotted name with its line and
    whether a try guards it; each call through such a name with its positional count and keywords."""
    tree = ast.parse(path.read_bytes())  # bytes: a BOM is allowed, as for the interpreter
    bound, imports, guarded = {}, [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for sub in node.body:
                guarded.update(id(n) for n in ast.walk(sub))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flashinfer" and not node.level:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
                imports.append({"name": f"{node.module}.{a.name}", "line": node.lineno, "guarded": id(node) in guarded})
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "flashinfer":
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else "flashinfer"
    for node in ast.walk(tree):  # one level of aliasing: _flashinfer_comm = comm
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in bound:
            for t in node.targets:
                if isinstance(t, ast.Name):
                    bound.setdefault(t.id, bound[node.value.id])
    returns = {}  # a function that returns an imported name: _workspace_class()(...) calls that name
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for r in ast.walk(node):
                if isinstance(r, ast.Return) and isinstance(r.value, ast.Name) and r.value.id in bound:
                    returns[node.name] = bound[r.value.id]
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts, f = [], node.func
        if isinstance(f, ast.Call) and isinstance(f.func, ast.Name) and f.func.id in returns:
            bound.setdefault(f"{f.func.id}()", returns[f.func.id])
            f = ast.Name(id=f"{f.func.id}()")
        while isinstance(f, ast.Attribute):
            parts.insert(0, f.attr)
            f = f.value
        if not isinstance(f, ast.Name) or f.id not in bound:
            continue
        star = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        calls.append({"target": ".".join([bound[f.id], *parts]), "line": node.lineno, "npos": len(node.args),
                      "kw": [k.arg for k in node.keywords if k.arg], "star": star})
    return imports, calls


CHECK = r"""
import importlib, inspect, json, sys, types
sys.modules["pynvml"] = types.ModuleType("pynvml")  # NVML needs a GPU; nothing here calls it
import flashinfer
def resolve(dotted):
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for p in parts[k:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(dotted)
spec = json.load(sys.stdin)
out = {"version": flashinfer.__version__, "imports": {}, "calls": []}
for name in spec["imports"]:
    try:
        resolve(name); out["imports"][name] = None
    except Exception as e:
        out["imports"][name] = type(e).__name__
for c in spec["calls"]:
    try:
        obj = resolve(c["target"])
        sig = inspect.signature(obj)
        if not c["star"]:
            sig.bind(*[None] * c["npos"], **{k: None for k in c["kw"]})
        elif not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            assert set(c["kw"]) <= set(sig.parameters), sorted(set(c["kw"]) - set(sig.parameters))
        problem = None
    except Exception as e:
        problem = f"{type(e).__name__}: {e}"
    out["calls"].append([c["file"], c["line"], c["target"], problem])
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def checked(patched_tree):
    if tree_version(patched_tree) != "0.5.9":
        pytest.skip("the names and calls are 0.5.9's (the line the user runs)")
    py = venv_0523()  # $SGLPATCH_TEST_VENV_0523, else .venv-0523 (also where the variable is unset: the mutants' runs)
    if not py.exists():  # the suite's own venv (scripts/test.sh builds it), not the code under test: the user's cpu tier has none
        pytest.skip("needs the 0.5.23 test venv (scripts/test.sh builds it) for flashinfer 0.7.2")
    srt = patched_tree / "python" / "sglang" / "srt"
    imports, calls = {}, []
    for path in sorted(srt.rglob("*.py")):
        if b"flashinfer" not in path.read_bytes():
            continue
        rel = str(path.relative_to(srt))
        imps, cs = scan(path)
        for i in imps:
            imports.setdefault(i["name"], []).append([rel, i["line"], i["guarded"]])
        if rel in SERVING:
            calls += [dict(c, file=rel) for c in cs]
    spec = {"imports": sorted(imports), "calls": calls}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(py), "-c", CHECK], input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[6:])
    return imports, calls, res


def test_every_imported_flashinfer_name_resolves_in_0_7_2_but_one_guarded(checked):
    imports, _, res = checked
    assert res["version"] == fiset()["version"]
    missing = {name: (ws[0][0], ws[0][2]) for name, ws in imports.items() if res["imports"][name]}
    assert missing == MISSING
    assert not {f for f, _ in MISSING.values()} - {"layers/attention/flashinfer_backend.py"} & set(SERVING)
    assert len(imports) >= 40  # the scan saw the tree's imports (51 names in 0.5.9 + P5's two)


def test_every_call_on_the_serving_path_binds_to_0_7_2_signatures(checked):
    _, calls, res = checked
    guarded = {n for n, (_, g) in MISSING.items() if g}
    assert [c for c in res["calls"] if c[3] and c[2] not in guarded] == []
    targets = {c[2] for c in res["calls"]}
    # the calls that matter most are among the checked ones: P1's fusion and workspace, P5's workspace
    assert {"flashinfer.comm.trtllm_allreduce_fusion", "flashinfer.comm.trtllm_create_ipc_workspace_for_all_reduce_fusion",
            "flashinfer.comm.pcie_ipc_ar.PcieIpcAllReduceWorkspace"} <= targets, sorted(targets)
    assert len(calls) == len(res["calls"]) >= 10
