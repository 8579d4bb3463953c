"""The user's other levers as server-tier modes (targets/rtx6000x8-kimi-k25.toml): expert
parallelism with each MoE all-to-all backend that can run on PCIe, a lowered
--cuda-graph-max-bs, PCIe-IPC on/off on 0.5.23, one mode per allreduce candidate; a mode's
`requires_import` / `min_sglang` are checked with the serving interpreter before any load."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from sglpatch.gpu import mode_requires, profiles, regress, server

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
    cmd = server.server_command(srv, modes["eagle3_cgbs1"], "py")
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
