"""Issue 53, the server side: no allreduce counts as faster until it has said the same thing as NCCL.
A parity pair compares the greedy texts and, when its modes speculate, the EAGLE-3 accept length
within a tolerance derived from the run's own size (server/parity.py); a pair counts for the
kernel-tier backends it names only when its mode b's log shows that path serving; the target
profile pairs P5 and P7 with NCCL on the same install, without speculation and with EAGLE-3."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from sglpatch.errors import SglpatchError
from sglpatch.gpu.server import modes as mode_requires
from sglpatch.gpu.server import parity
from sglpatch.gpu.server.evidence import B12X_NAME, NCCL_NAME, P5_IPC_NAME
from sglpatch.gpu.shared import profile as profiles
from sglpatch.gpu.shared.report import TierResult

ROOT = Path(__file__).resolve().parents[1]
EAGLE = ["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3"]
SRV = {"seed": 1234, "benchmark": {"prompts": ["p0", "p1"], "num_requests": None}}


def mode(tmp_path, name, texts, accept=None, tokens=512, spec=True, served=NCCL_NAME, p4=None):
    """A mode's record as server/mode.py leaves it, its bench_serving JSONL written."""
    (tmp_path / f"bench-{name}.jsonl").write_text(json.dumps({"generated_texts": texts}) + "\n")
    m = {"mode": name, "status": "ok", "bench_file": f"bench-{name}.jsonl",
         "command": ["python", "-m", "sglang.launch_server", *(EAGLE if spec else [])],
         "benchmark": {"accept_length": accept, "total_output_tokens": tokens},
         "allreduce": {"backend": served, "evidence": f"Decode/verify allreduce: {served} (world_size=8)."}}
    if p4:
        m["verify_profile"] = {"records": 3, "sums": p4}
    return m


def pairs(tmp_path, a, b, **pair):
    tr = TierResult("server")
    srv = {**SRV, "parity": [{"name": "P5 vs NCCL", "a": a["mode"], "b": b["mode"], **pair}]}
    (res,) = parity.parity_checks(tr, srv, tmp_path, [a, b], None, None, "sha")
    return tr, res


def test_the_tolerance_comes_from_the_runs_own_size():
    """d = 3 draft tokens, 2048 tokens at accept 2.5: n = 819.2 verify steps, tol = 2 / sqrt(819.2) = 0.0699;
    a tenth of that many steps widens it sqrt(10)-fold; a huge run stops at the floor."""
    a = {"command": EAGLE, "benchmark": {"accept_length": 2.5, "total_output_tokens": 2048}}
    b = {"command": EAGLE, "benchmark": {"accept_length": 2.45, "total_output_tokens": 2048}}
    got = parity.compare_accept(a, b, "eagle3_nccl", "eagle3_pcie_ipc")
    assert got["tolerance"] == round(2 / math.sqrt(2048 / 2.5), 3) == 0.07 and got["status"] == "same"
    assert got["detail"] == ("accept length 2.500 (eagle3_nccl) vs 2.450 (eagle3_pcie_ipc), bench_serving: within "
                             "±0.070 (max(0.02, (3 - 1) / sqrt(819 verify steps)))")
    b["benchmark"]["accept_length"] = 2.42  # 0.08 lower
    assert parity.compare_accept(a, b, "x", "y")["status"] == "differ"
    assert parity.compare_accept(a, {**b, "benchmark": {"accept_length": 2.58, "total_output_tokens": 2048}}, "x",
                                 "y")["status"] == "differ"  # two-sided: more accepts is another answer too
    small = {"command": EAGLE, "benchmark": {"accept_length": 2.5, "total_output_tokens": 204.8}}
    assert parity.compare_accept(small, small, "x", "y")["tolerance"] == round(2 / math.sqrt(81.92), 3)
    huge = {"command": EAGLE, "benchmark": {"accept_length": 2.5, "total_output_tokens": 10 ** 8}}
    assert parity.compare_accept(huge, huge, "x", "y")["tolerance"] == parity.ACCEPT_FLOOR
    assert parity.compare_accept(a, b, "x", "y", tolerance=0.1)["status"] == "same"  # the pair's own bound


def test_an_accept_length_that_cannot_be_read_is_no_verdict():
    a = {"command": EAGLE, "benchmark": {"accept_length": 2.5, "total_output_tokens": 2048}}
    none = {"command": EAGLE, "benchmark": {"accept_length": None}}
    got = parity.compare_accept(a, none, "eagle3_nccl", "eagle3_b12x")
    assert got == {"status": "cannot_judge", "detail": "accept length cannot be judged: no accept length from eagle3_b12x"}
    p4 = {"command": EAGLE, "benchmark": {}, "verify_profile": {"sums": {"tokens": 2000, "requests": 1000}}}
    assert "different sources" in parity.compare_accept(a, p4, "x", "y")["detail"]
    # P4's records on both sides: committed tokens / request-steps, and the request-steps are n
    p4b = {"command": EAGLE, "benchmark": {}, "verify_profile": {"sums": {"tokens": 1900, "requests": 1000}}}
    got = parity.compare_accept(p4, p4b, "x", "y")
    assert (got["source"], got["a"], got["b"], got["status"]) == ("P4", 2.0, 1.9, "differ")
    assert got["tolerance"] == round(2 / math.sqrt(1000), 3)
    nodraft = {"command": ["--speculative-algorithm", "EAGLE3"], "benchmark": a["benchmark"]}
    assert "--speculative-num-draft-tokens is unknown" in parity.compare_accept(nodraft, nodraft, "x", "y")["detail"]
    assert parity.compare_accept(nodraft, nodraft, "x", "y", tolerance=0.05)["status"] == "same"


def test_same_text_lower_acceptance_fails_the_pair_and_the_tier(tmp_path):
    texts = ["w1 w2 w3", "w4 w5"]
    a = mode(tmp_path, "eagle3_nccl", texts, accept=2.5, tokens=2048)
    b = mode(tmp_path, "eagle3_pcie_ipc", texts, accept=2.1, tokens=2048, served=P5_IPC_NAME)
    tr, res = pairs(tmp_path, a, b, backends=["pcie_ipc"])
    assert (res["status"], res["why"], res["text"]["status"], res["accept"]["status"]) == \
        ("differ", "accept length", "same", "differ")
    assert res["detail"].startswith("greedy text identical, but the accept length 2.500 (eagle3_nccl) vs 2.100 "
                                    "(eagle3_pcie_ipc), bench_serving: beyond ±0.070")
    assert tr.status == "fail" and tr.failures == [f"parity P5 vs NCCL: {res['detail']}"]
    assert res["backends"] == ["pcie_ipc"]
    assert parity.tier_summary([], [res]) == "; parity FAILED: P5 vs NCCL (accept length)"
    md = "\n".join(parity.parity_markdown([res]))
    assert "| P5 vs NCCL | eagle3_nccl | eagle3_pcie_ipc | 2.50 / 2.10 (±0.070) | **DIFFERS**: greedy text" in md


def test_a_pair_passes_only_with_the_same_text_the_same_accepts_and_its_path_serving(tmp_path):
    texts = ["w1 w2 w3", "w4 w5"]
    a = mode(tmp_path, "eagle3_nccl", texts, accept=2.5, tokens=2048)
    b = mode(tmp_path, "eagle3_pcie_ipc", texts, accept=2.48, tokens=2048, served=P5_IPC_NAME)
    tr, res = pairs(tmp_path, a, b, backends=["pcie_ipc"])
    assert res["status"] == "same" and tr.status != "fail" and "within ±0.070" in res["detail"]
    # the switch ignored (an install without the path): NCCL against NCCL says nothing about it
    b12x = mode(tmp_path, "eagle3_b12x", texts, accept=2.5, tokens=2048, served=NCCL_NAME)
    tr, res = pairs(tmp_path, a, b12x, backends=["b12x_oneshot", "b12x_fused"])
    assert res["status"] == "not_run" and tr.status != "fail"
    assert res["detail"].endswith("but eagle3_b12x was served by NCCL (`Decode/verify allreduce: NCCL (world_size=8).`), "
                                  "not by b12x_oneshot, b12x_fused: the pair says nothing about b12x_oneshot, b12x_fused")
    b12x["allreduce"]["backend"] = B12X_NAME
    assert pairs(tmp_path, a, b12x, backends=["b12x_oneshot", "b12x_fused"])[1]["status"] == "same"
    # accept length unreadable on one side: no verdict (never a pass), and no failure
    b["benchmark"]["accept_length"] = None
    tr, res = pairs(tmp_path, a, b, backends=["pcie_ipc"])
    assert res["status"] == "not_run" and tr.status != "fail"
    assert res["detail"] == "greedy text identical; accept length cannot be judged: no accept length from eagle3_pcie_ipc: no verdict"
    assert parity.tier_summary([], [res]) == "; parity not run: P5 vs NCCL"
    # a text difference stays one, and says what the accept lengths were
    c = mode(tmp_path, "eagle3_pcie_ipc", ["w1 w2 w9", "w4 w5"], accept=2.5, tokens=2048, served=P5_IPC_NAME)
    tr, res = pairs(tmp_path, a, c)
    assert (res["status"], res["why"]) == ("differ", "greedy text") and "; accept length 2.500" in res["detail"]
    # without speculation only the text counts
    n1, n2 = (mode(tmp_path, n, texts, spec=False, served=s) for n, s in (("no_spec_nccl", NCCL_NAME),
                                                                         ("no_spec_pcie_ipc", P5_IPC_NAME)))
    tr, res = pairs(tmp_path, n1, n2, backends=["pcie_ipc"])
    assert res["status"] == "same" and "accept" not in res


def test_parity_with_an_earlier_report_judges_the_accept_length_too(tmp_path):
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    texts = ["w1 w2 w3", "w4 w5"]
    old_mode = mode(old_dir, "eagle3", texts, accept=2.5, tokens=2048)
    old = {"tiers": {"server": {"modes": [old_mode], "prompts": {"sha": "sha"}}}}
    new = mode(tmp_path, "eagle3", texts, accept=1.9, tokens=2048)
    tr = TierResult("server")
    (res,) = parity.parity_checks(tr, SRV, tmp_path, [new], old, str(old_dir), "sha")
    assert res["status"] == "differ" and res["why"] == "accept length" and tr.status == "fail"


def test_the_target_pairs_p5_and_p7_with_nccl_on_the_same_install():
    prof = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")
    srv = prof["server"]
    modes = {m["name"]: m for m in srv["modes"]}
    got = {p["name"]: (p["a"], p["b"], p.get("backends")) for p in srv["parity"]}
    assert got["P5 PCIe-IPC vs NCCL, no speculation"] == ("no_spec_nccl", "no_spec_pcie_ipc", ["pcie_ipc"])
    assert got["P5 PCIe-IPC vs NCCL, EAGLE-3"] == ("eagle3_nccl", "eagle3_pcie_ipc", ["pcie_ipc"])
    assert got["P7 b12x vs NCCL, no speculation"] == ("no_spec_nccl", "no_spec_b12x", ["b12x_oneshot", "b12x_fused"])
    assert got["P7 b12x vs NCCL, EAGLE-3"] == ("eagle3_nccl", "eagle3_b12x", ["b12x_oneshot", "b12x_fused"])
    for line in ("no_spec", "eagle3"):
        nccl, b12x = modes[f"{line}_nccl"], modes[f"{line}_b12x"]
        assert b12x["env"]["SGLANG_ENABLE_B12X_ALLREDUCE"] == "1" and "SGLANG_ENABLE_B12X_ALLREDUCE" not in nccl["env"]
        assert {k: v for k, v in b12x["env"].items() if k != "SGLANG_ENABLE_B12X_ALLREDUCE"} == nccl["env"]
        assert b12x["args"] == nccl["args"] == modes[line]["args"]  # the same launch: only the allreduce differs
        assert b12x["optional"] and not b12x["gate"] and b12x["requires_switch"] == "SGLANG_ENABLE_B12X_ALLREDUCE"
    assert parity.speculative({"command": modes["eagle3_b12x"]["args"]}) and parity.draft_tokens(
        {"command": modes["eagle3_b12x"]["args"]}) == 3
    # the example appends a tuned pair to a copy of the profile; it loads
    assert all(isinstance(p.get("backends"), list) for p in srv["parity"])


def test_pair_keys_are_checked_and_a_switch_only_a_patch_reads_is_a_requirement(tmp_path):
    base = '[server]\n[[server.modes]]\nname = "a"\n[[server.modes]]\nname = "b"\n[[server.parity]]\nname = "x"\na = "a"\nb = "b"\n'
    for bad, msg in (("accept_tolerance = -1\n", "accept_tolerance must be a positive number"),
                     ('backends = "pcie_ipc"\n', "backends must be a list")):
        (tmp_path / "p.toml").write_text(base + bad)
        with pytest.raises(SglpatchError, match=msg):
            profiles.load_profile(tmp_path / "p.toml")
    pkg = tmp_path / "site" / "sglang"
    (pkg / "srt").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    served = {"sglang_file": str(pkg / "__init__.py"), "sglang_version": "0.5.9"}
    need = {"requires_switch": "SGLANG_ENABLE_B12X_ALLREDUCE"}
    py = sys.executable
    assert mode_requires.unmet(need, py, {}, "0.5.9", served) == (
        f"needs an sglang that reads SGLANG_ENABLE_B12X_ALLREDUCE (sglang 0.5.9 + P7); {py} serves sglang 0.5.9 whose "
        "sources never read it: the switch would be ignored and NCCL would serve")
    (pkg / "srt" / "environ.py").write_text("SGLANG_ENABLE_B12X_ALLREDUCE = EnvBool(False)\n")
    assert mode_requires.unmet(need, py, {}, "0.5.9", served) is None
