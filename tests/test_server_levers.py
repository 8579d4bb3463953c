"""The user's other levers as server-tier modes (targets/rtx6000x8-kimi-k25.toml): expert
parallelism with each MoE all-to-all backend that can run on PCIe, a lowered
--cuda-graph-max-bs, PCIe-IPC on/off on 0.5.23, one mode per allreduce candidate; a mode's
`requires_import` / `min_sglang` are checked with the serving interpreter before any load."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from sglpatch.gpu import regress

from sglpatch.gpu.server import modes as mode_requires

from sglpatch.gpu.shared import profile as profiles

from sglpatch.gpu.server import mode as server_mode

ROOT = Path(__file__).resolve().parents[1]


def target():
    return profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")


def test_the_levers_are_modes_of_the_target():
    srv = target()["server"]
    modes = {m["name"]: m for m in srv["modes"]}
    assert modes["no_spec_ep8"]["args"] == ["--ep-size", "8"]
    assert modes["no_spec_ep8_deepep"]["args"][-4:] == ["--moe-a2a-backend", "deepep", "--deepep-mode", "low_latency"]
    assert modes["no_spec_ep8_deepep"]["requires_import"] == ["deep_ep"]
    assert modes["no_spec_ep8_mooncake"]["requires_import"] == ["mooncake.ep"]
    assert modes["no_spec_cgbs1"]["args"] == ["--cuda-graph-max-bs", "1"]
    # the mode's --cuda-graph-max-bs comes after launch_args' 8, so it is the one SGLang keeps
    cmd = server_mode.server_command(srv, modes["eagle3_cgbs1"], "py")
    last = max(i for i, a in enumerate(cmd) if a == "--cuda-graph-max-bs")
    assert cmd[last + 1] == "1" and cmd.count("--cuda-graph-max-bs") == 2
    for name in ("no_spec_pcie_ipc_off", "eagle3_pcie_ipc_off"):
        assert modes[name]["min_sglang"] == "0.5.21" and modes[name]["env"]["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "0"
    assert modes["eagle3_pcie_ipc_off"]["args"] == modes["eagle3"]["args"]
    for name in ("no_spec_mscclpp", "no_spec_symm_mem", "no_spec_nccl_p2p_off"):
        assert modes[name]["env"]["SGLANG_ENABLE_PCIE_CUSTOM_AR"] == "0"
    assert all(m.get("optional") and not m["gate"] for n, m in modes.items() if n not in ("no_spec", "eagle3"))
    # every confirm command of the decision table names modes that exist
    for cmd in target()["kernel"]["decision"]["confirm"].values():
        named = cmd.split("--modes ")[1].split()[0].split(",")
        assert set(named) <= set(modes), cmd


def test_requirements_are_checked_with_the_serving_interpreter():
    py = sys.executable
    assert mode_requires.unmet({"requires_import": ["json", "email.mime"]}, py, {}, "0.5.9") is None
    why = mode_requires.unmet({"requires_import": ["json", "deep_ep"]}, py, {}, "0.5.9")
    assert why == f"does not import in {py}: deep_ep: ModuleNotFoundError: No module named 'deep_ep'"
    assert mode_requires.unmet({"min_sglang": "0.5.21"}, py, {}, "0.5.23") is None
    assert mode_requires.unmet({"min_sglang": "0.5.21"}, py, {}, "0.5.9") == \
        f"needs sglang >= 0.5.21; {py} serves sglang 0.5.9"
    assert mode_requires.unmet({"min_sglang": "0.5.21"}, py, {}, None).endswith("serves sglang ?")


def test_a_tier_whose_modes_cannot_run_here_says_why_and_loads_nothing(tmp_path):
    proj = tmp_path / "proj"
    (proj / "targets").mkdir(parents=True)
    (proj / "tests").mkdir()
    (proj / "targets" / "s.toml").write_text(textwrap.dedent(f"""
        [server]
        python = "{sys.executable}"
        port = 1
        [[server.modes]]
        name = "ep8_deepep"
        args = ["--ep-size", "8"]
        requires_import = ["deep_ep"]
        [[server.modes]]
        name = "ipc_off"
        min_sglang = "0.5.21"
        """))
    res = regress.run_regress("server", "s", str(tmp_path / "r"), str(proj), modes="ep8_deepep,ipc_off")
    s = json.loads((tmp_path / "r" / "report.json").read_text())["tiers"]["server"]
    assert res["exit_code"] == regress.EXIT_CANNOT_RUN and s["status"] == "cannot_run"
    assert [m["mode"] for m in s["skipped_modes"]] == ["ep8_deepep", "ipc_off"]
    assert "No module named 'deep_ep'" in s["skipped_modes"][0]["why"]
    assert s["skipped_modes"][1]["why"].startswith("needs sglang >= 0.5.21")
    assert not list((tmp_path / "r").glob("server-*.log"))  # nothing was launched


def test_pcie_ipc_modes_for_both_lines_and_whose_pcie_ipc_serves(tmp_path):
    """no_spec_nccl / no_spec_pcie_ipc (and the eagle3 pair) run on 0.5.9 + P5 and on 0.5.23; a
    *_pcie_ipc mode needs a PCIe-IPC adapter in the served sglang (P5, or >= 0.5.22) and says so."""
    from sglpatch.gpu.shared import served as served_mod

    modes = {m["name"]: m for m in target()["server"]["modes"]}
    for line in ("no_spec", "eagle3"):
        nccl, ipc = modes[f"{line}_nccl"], modes[f"{line}_pcie_ipc"]
        assert nccl["env"]["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "0" and nccl["env"]["SGLANG_ENABLE_PCIE_CUSTOM_AR"] == "0"
        assert ipc["env"]["SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"] == "1" and ipc["env"]["SGLANG_ENABLE_PCIE_CUSTOM_AR"] == "0"
        assert ipc["requires_pcie_ipc"] is True and "min_sglang" not in ipc and "min_sglang" not in nccl
        assert nccl["args"] == ipc["args"] == modes[line]["args"]
    assert target()["kernel"]["decision"]["confirm"]["pcie_ipc"].endswith(
        "--modes no_spec_nccl,no_spec_pcie_ipc,eagle3_nccl,eagle3_pcie_ipc")

    def sglang(version, module):
        pkg = tmp_path / version / "sglang"
        if module:
            (pkg / module).parent.mkdir(parents=True)
            (pkg / module).write_text("")
        return {"sglang_file": str(pkg / "__init__.py"), "sglang_version": version}

    py, mode = sys.executable, {"requires_pcie_ipc": True}
    p5, up23, up21, plain = (sglang("0.5.9", served_mod.P5_MODULE), sglang("0.5.23", served_mod.UPSTREAM_MODULE),
                             sglang("0.5.21", served_mod.UPSTREAM_MODULE), sglang("0.5.9b", None))
    assert [served_mod.pcie_ipc_server(s) for s in (p5, up23, up21, plain)] == ["P5", "upstream", "upstream", None]
    # P5's module in a tree that says 0.5.22+ (never the rebase's result: P5 is dropped there) is upstream's;
    # 0.5.21.1 (below 0.5.22 whatever its digits) with it is P5's, and 0.5.100 reads as a newer release
    odd = [sglang(v, served_mod.P5_MODULE) for v in ("0.5.22", "0.5.21.1", "0.5.100")]
    assert [served_mod.pcie_ipc_server(s) for s in odd] == ["upstream", "P5", "upstream"]
    assert mode_requires.unmet(mode, py, {}, "0.5.9", p5) is None
    assert mode_requires.unmet(mode, py, {}, "0.5.23", up23) is None
    assert mode_requires.unmet(mode, py, {}, "0.5.22", up23) is None  # the first native release (flashinfer 0.7.1)
    need = "needs a PCIe-IPC allreduce: sglang 0.5.9 + P5 (`scripts/apply.sh --with-flashinfer`) or sglang >= 0.5.22; "
    assert mode_requires.unmet(mode, py, {}, "0.5.21", up21) == f"{need}{py} serves sglang 0.5.21 whose pinned flashinfer has no PCIe-IPC module"
    assert mode_requires.unmet(mode, py, {}, "0.5.9", plain) == f"{need}{py} serves sglang 0.5.9 without one"
    assert mode_requires.split([{"name": "x", **mode}], py, {}, "0.5.9", plain)[1] == [{"mode": "x", "why": f"{need}{py} serves sglang 0.5.9 without one"}]


def test_p5s_own_lines_are_the_allreduce_evidence(tmp_path):
    """P5 prints 0.5.23's start-up line; on an install that carries P5 its PCIe-IPC is named P5's."""
    from sglpatch.gpu.server.evidence import IPC_NAME, NCCL_NAME, P5_IPC_NAME, allreduce_backend, describe
    from sglpatch.gpu.server.ab import install_label

    on = ("[2026-12-03 TP0] PCIe-IPC allreduce on 8 GPUs for bf16 reductions up to 21504 elements (3 rows of 7168, "
          "captured batch 1 x 3 tokens); larger ones stay on the next backend.")
    startup = "[2026-12-03 TP0] Decode/verify allreduce: PCIe-IPC (world_size=8)."
    off = ("[2026-12-03 TP0] PCIe-IPC allreduce is off on all 8 ranks because rank 3: the workspace failed: oom. Reductions "
           "stay on custom allreduce/NCCL; unset SGLANG_ENABLE_PCIE_IPC_ALLREDUCE to silence this warning.")
    nccl = "[2026-12-03 TP0] Decode/verify allreduce: NCCL (world_size=8)."
    log = tmp_path / "server.log"
    env = {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1", "SGLANG_ENABLE_PCIE_CUSTOM_AR": "0"}
    log.write_text(f"{on}\n{startup}\n")
    ev = allreduce_backend(log, env, [], "P5")
    assert (ev["backend"], ev["evidence"]) == (P5_IPC_NAME, startup) and describe(ev) == "PCIe-IPC (P5, the 0.5.9 backport)"
    assert ev["selected_by"] == env
    assert allreduce_backend(log, env, [], "upstream")["backend"] == IPC_NAME  # 0.5.23's own
    log.write_text(f"{off}\n{nccl}\n")
    assert allreduce_backend(log, env, [], "P5")["backend"] == NCCL_NAME
    log.write_text(f"{on}\n")  # no start-up line (an older P5, a cut log): its enable line
    assert (allreduce_backend(log, env, [], "P5")["backend"], allreduce_backend(log, env, [], "P5")["evidence"]) == (P5_IPC_NAME, on)
    log.write_text(f"{on}\n{off}\n")  # its give-up overrules the enable line
    assert (allreduce_backend(log, env, [], "P5")["backend"], allreduce_backend(log, env, [], "P5")["evidence"]) == (NCCL_NAME, off)
    assert install_label("/opt/ml-env/bin/python3", "0.5.9", True) == "0.5.9 + P5 (/opt/ml-env)"


P5_WORKSPACE = ("[2026-12-03 TP0] PCIe-IPC allreduce on 8 GPUs: workspace 11.1 MiB per GPU, bf16 reductions up to 172032 "
                "elements (24 rows of 7168, widest captured reduction 24 rows); buckets [3, 6, 12, 24]; seed launch "
                "configurations (SGLANG_PCIE_IPC_TUNE; the tuning step: python -m "
                "sglang.srt.distributed.device_communicators.pcie_ipc_tune --tp 8 --hidden 7168 --rows 3,6,12,24).")


def test_p5s_workspace_line_of_today_and_p7s_start_up_line_are_evidence(tmp_path):
    """P5's start-up lines as the patch prints them now (issue 53): the workspace line alone names P5's
    PCIe-IPC, and its buckets and launch configurations are read; P7's `b12x one-shot` is a path."""
    from sglpatch.gpu.server.evidence import B12X_NAME, NCCL_NAME, P5_IPC_NAME, allreduce_backend, describe, served_as

    log = tmp_path / "server.log"
    env = {"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE": "1", "SGLANG_PCIE_IPC_TUNE": "seed"}
    log.write_text(f"{P5_WORKSPACE}\n")  # a cut log: no start-up line, the workspace line is the evidence
    ev = allreduce_backend(log, env, [], "P5")
    assert (ev["backend"], ev["evidence"]) == (P5_IPC_NAME, P5_WORKSPACE.strip())
    assert ev["pcie_ipc"]["buckets"] == [3, 6, 12, 24] and ev["pcie_ipc"]["launch_configurations"] == "seed"
    assert ev["pcie_ipc"]["workspace_mib"] == 11.1 and ev["selected_by"] == env
    for policy in ("cache", "tune"):
        log.write_text(P5_WORKSPACE.replace("; seed launch", f"; {policy} launch") + "\n")
        assert allreduce_backend(log, env, [], "P5")["pcie_ipc"]["launch_configurations"] == policy
    startup = "[2026-12-03 TP0] Decode/verify allreduce: PCIe-IPC (world_size=8)."
    log.write_text(f"{P5_WORKSPACE}\n{startup}\n")
    ev = allreduce_backend(log, env, [], "P5")
    assert (ev["backend"], ev["evidence"]) == (P5_IPC_NAME, startup) and served_as(ev, "pcie_ipc") is True
    assert served_as(ev, "b12x_oneshot") is False and served_as(ev, "mscclpp") is None
    b12x = "[2026-12-03 TP0] Decode/verify allreduce: b12x one-shot (world_size=8)."
    log.write_text(f"{b12x}\n")
    ev = allreduce_backend(log, {"SGLANG_ENABLE_B12X_ALLREDUCE": "1"}, [], None)
    assert (ev["backend"], describe(ev)) == (B12X_NAME, "b12x one-shot (P7)")
    assert ev["selected_by"] == {"SGLANG_ENABLE_B12X_ALLREDUCE": "1"}
    assert served_as(ev, "b12x_oneshot") and served_as(ev, "b12x_fused") and not served_as(ev, "pcie_ipc")
    log.write_text("[2026-12-03 TP0] Decode/verify allreduce: NCCL (world_size=8).\n")
    assert allreduce_backend(log, {"SGLANG_ENABLE_B12X_ALLREDUCE": "1"}, [], None)["backend"] == NCCL_NAME
