"""Planted faults in each line's patches, and the tests that must catch them (issue 18).

    python tests/mutants.py [--line 0.5.23|0.5.9|all] [--check] [--out results/mutants]

For each mutant: copy the patched tree, apply the fault (text edits that must each match
exactly once), run only the test files named for it, and record killed (a test failed) or
SURVIVED. --check only verifies that every mutant still applies to the current series (what
CI runs on every push, through tests/test_port_0523.py). The 0.5.23 mutants run
tests/real_0523/ in the 0.5.23 venv (SGLang 0.5.23's own modules); the 0.5.9 ones run
tests/patches/ in the main venv against the mutated tree (SGLPATCH_PATCHED_TREE).
Writes <out>/mutants.json and <out>/mutants.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRT = "python/sglang/srt/"
HOOK_0523 = """        # SGLANG_VERIFY_PROFILE=1 times each cycle's phases; off: nothing is wrapped.
        # Only the pipeline stage that hosts the draft runs whole cycles.
        self.spec_profiler = (
            maybe_profile_spec_worker(
                "eagle_v2",
                get_parallel().tp_rank,
                draft=(self._draft_worker, "draft"),
                verify=(self, "verify"),
                extend=(self._draft_worker, "_draft_extend_for_decode"),
                accept_lens=lambda out: out.accept_lens,
                dp_rank=get_parallel().dp_rank,
            )
            if self._hosts_draft
            else None
        )
"""
HOSTS = "        self._hosts_draft = get_parallel().pp_group.is_last_rank\n"
P1_0523, P4_0523 = "tests/real_0523/test_p1_0523.py", "tests/real_0523/test_p4_0523.py"

# (id, patch, what, file, [(old, new), ...], test files)
MUTANTS = {
    "0.5.23": [
        ("p4-hook-above-hosts-draft", "P4", "the profiling hook moved above the lines that set _hosts_draft/_draft_worker",
         "speculative/eagle_worker_v2.py", [(HOOK_0523, ""), (HOSTS, HOOK_0523 + HOSTS)], [P4_0523]),
        ("p4-accept-lens-misspelt", "P4", "upstream attribute misspelt: out.accept_len for out.accept_lens",
         "speculative/eagle_worker_v2.py", [("accept_lens=lambda out: out.accept_lens,", "accept_lens=lambda out: out.accept_len,")], [P4_0523]),
        ("p4-env-name-misspelt", "P4", "env name misspelt in environ.py: SGLANG_VERIFY_PROFILE_INTERVALS",
         "environ.py", [("    SGLANG_VERIFY_PROFILE_INTERVAL = ", "    SGLANG_VERIFY_PROFILE_INTERVALS = ")], [P4_0523]),
        ("p1-gate-removed", "P1", "the SM120 gate pass no longer run (model_hook.py)",
         "arg_groups/model_hook.py", [("    run_post_process_pass(server_args, _flashinfer_allreduce_fusion_sm120_gate)\n", "")], [P1_0523]),
        ("p1-pcie-ipc-rule-inverted", "P1", "the PCIe-IPC rule inverted: the fusion yields when PCIe-IPC is off",
         "arg_groups/overrides.py", [("    if pcie_ipc_on:\n", "    if not pcie_ipc_on:\n")], [P1_0523]),
        ("p1-base-gpu-id-misspelt", "P1", "upstream attribute misspelt: view.base_gpu for view.base_gpu_id",
         "arg_groups/overrides.py", [("view.base_gpu_id + i", "view.base_gpu + i")], [P1_0523]),
        ("p1-cuda-graph-config-misspelt", "P1", "upstream attribute misspelt: graph.cuda_graph_configs",
         "layers/layer_boundary/residual/add_norm.py", [("get_exec().graph.cuda_graph_config\n", "get_exec().graph.cuda_graph_configs\n")], [P1_0523]),
        ("p1-multicast-precheck-back", "P1", "the SM120 pre-check asks for the multicast granularity again",
         "layers/flashinfer_comm_fusion.py", [("        if get_platform().is_sm120:\n            # FlashInfer maps", "        if False:\n            # FlashInfer maps")], [P1_0523]),
        ("p1-startup-line-dropped", "P1", "BaseRunner._warmup no longer logs the decode/verify allreduce",
         "model_executor/runner/base_runner.py", [("        self._log_decode_allreduce_path()\n", "")], [P1_0523]),
        ("p1-startup-line-wrong-order", "P1", "the start-up line names PCIe-IPC ahead of the custom allreduce (not the dispatch order)",
         "layers/flashinfer_comm_fusion.py", [('    ca_comm = getattr(group, "ca_comm", None)\n', '    ca_comm = None\n')], [P1_0523]),
    ],
    "0.5.9": [
        ("p1-p2p-rule-inverted", "P1", "the P2P rule inverted in get_flashinfer_allreduce_fusion_blocker",
         "server_args.py", [("    if not p2p_ok:\n", "    if p2p_ok:\n")], ["tests/patches/test_p1_flashinfer_fusion.py"]),
        ("p2-missing-pairs-inverted", "P2", "the P2P matrix reports the pairs that work as missing",
         "distributed/device_communicators/custom_all_reduce.py", [("        if src != dst and not ok\n", "        if src != dst and ok\n")],
         ["tests/patches/test_p2_pcie_custom_ar.py"]),
        ("p3-delegation-inverted", "P3", "Kimi-K2.5 delegation raises when the language model has the method",
         "models/kimi_k25.py", [("        if method is None:\n", "        if method is not None:\n")], ["tests/patches/test_p3_kimi_k25_eagle3.py"]),
        ("p4-v1-bonus-token-dropped", "P4", "EAGLE v1 accept lengths without the bonus token",
         "speculative/eagle_worker.py", [("[n + 1 for n in out[1].accept_length_per_req_cpu]", "[n for n in out[1].accept_length_per_req_cpu]")],
         ["tests/patches/test_p4_verify_profile.py"]),
    ],
}


def plant(tree: Path, file: str, edits: list) -> None:
    path = tree / SRT / file
    text = path.read_text()
    for old, new in edits:
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"mutants: error: {file}: {old.strip()[:60]!r} occurs {n} times (the series changed; update the mutant)")
        text = text.replace(old, new)
    path.write_text(text)


def check(line: str, tree: Path) -> list[str]:
    """Every mutant of line applies once to tree (the patched tree): [] or the problems."""
    bad = []
    for mid, _, _, file, edits, tests in MUTANTS[line]:
        text = (tree / SRT / file).read_text() if (tree / SRT / file).is_file() else ""
        bad += [f"{mid}: {file}: {old.strip()[:60]!r} occurs {text.count(old)} times" for old, _ in edits if text.count(old) != 1]
        bad += [f"{mid}: no test file {t}" for t in tests if not (ROOT / t).is_file()]
    return bad


def pytest_cmd(line: str, tree: Path, tests: list[str]) -> tuple[list[str], dict]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    if line == "0.5.23":
        py = os.environ.get("SGLPATCH_TEST_VENV_0523", str(ROOT / ".venv-0523")) + "/bin/python"
        env.update(PYTHONPATH=str(tree / "python"), SGLPATCH_REAL_0523=str(tree / "python"))
    else:
        py = sys.executable
        env.update(SGLPATCH_PATCHED_TREE=str(tree))
    return [py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-W", "ignore", *tests], env


def build_tree(line: str, top: Path) -> Path:
    """The committed series on 0.5.9 (sglpatch apply), or replayed onto 0.5.23 (rebase.sh)."""
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import copy_project

    from sglpatch import stack

    project = copy_project(top / "project")
    workdir = top / "wd"
    stack.apply(project, workdir, source="sdist")
    if line == "0.5.23":
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        proc = subprocess.run(["bash", str(ROOT / "scripts/rebase.sh"), "--workdir", str(workdir), "--project", str(project),
                               "--onto", "0.5.23"], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"mutants: error: rebase.sh --onto 0.5.23 failed: {proc.stderr.strip()[-300:]}")
    return workdir


def run(lines: list[str], out: Path) -> list[dict]:
    rows, start = [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sglpatch-mutants-") as tmp:
        for line in lines:
            print(f"mutants: building the {line} tree", file=sys.stderr, flush=True)
            tree = build_tree(line, Path(tmp) / line)
            if bad := check(line, tree):
                raise SystemExit("mutants: error: " + "; ".join(bad))
            cmd, env = pytest_cmd(line, tree, sorted({t for m in MUTANTS[line] for t in m[5]}))
            base = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            if base.returncode != 0:
                raise SystemExit(f"mutants: error: the {line} tests fail without a fault: {base.stdout.strip()[-500:]}")
            for mid, patch, what, file, edits, tests in MUTANTS[line]:
                mtree = Path(tmp) / f"m-{mid}"
                shutil.copytree(tree / "python", mtree / "python", symlinks=True)
                plant(mtree, file, edits)
                cmd, env = pytest_cmd(line, mtree, tests)
                t0 = time.monotonic()
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
                failed = [ln.split(" - ")[0] for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
                row = dict(line=line, id=mid, patch=patch, fault=what, file=SRT + file, tests=tests,
                           killed=proc.returncode != 0, failed=failed[:3], seconds=round(time.monotonic() - t0, 1))
                print(f"mutants: {line} {mid}: {'killed' if row['killed'] else 'SURVIVED'} ({row['seconds']} s)", file=sys.stderr, flush=True)
                rows.append(row)
                shutil.rmtree(mtree, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutants.json").write_text(json.dumps(rows, indent=1) + "\n")
    md = ["# Planted faults (mutants) and the tests that catch them", "",
          "Rebuild: `scripts/mutants.sh` (all lines; `--line 0.5.23` or `--line 0.5.9` for one).", "",
          "| line | patch | mutant | fault | killed by | result |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['line']} | {r['patch']} | `{r['id']}` | {r['fault']} | {'<br>'.join(r['failed']) or '—'} | "
                  f"{'killed' if r['killed'] else '**SURVIVED**'} |")
    md += ["", "ERROR: the fault broke a fixture that runs the patched code (a kill as well).",
           f"Whole run: {time.monotonic() - start:.0f} s (trees built, every mutant's tests run) on this machine."]
    (out / "mutants.md").write_text("\n".join(md) + "\n")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="mutants", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--line", choices=("0.5.23", "0.5.9", "all"), default="all", help="which line's mutants (default: all)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "mutants", help="where the table goes (default: results/mutants)")
    a = ap.parse_args(argv)
    lines = ["0.5.23", "0.5.9"] if a.line == "all" else [a.line]
    rows = run(lines, a.out)
    survived = [r["id"] for r in rows if not r["killed"]]
    print(f"mutants: {len(rows) - len(survived)}/{len(rows)} killed" + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
