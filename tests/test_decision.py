"""gpu/decision: the projection arithmetic, with numbers checked by hand (written out in the
comments), the interpolation, the fused backends' fair comparison, the ranking, and the
baseline read from a server-tier report."""

from __future__ import annotations

import json

import pytest

from sglpatch.errors import SglpatchError
from sglpatch.gpu.kernel import decision
from sglpatch.gpu.shared import profile as profiles

CFG = {**decision.DEFAULTS, "hidden": 7168}  # 61 layers x 2, bs 1, 3 draft tokens, 12.2 ms, 30 ms


def rows(backend, install, pts, status="ok", fused=False, mode="graph"):
    out = []
    for n, us in pts.items():
        r = {"backend": backend, "install": install, "mode": mode, "rows": n, "hidden": 7168, "status": status,
             "median_us": us}
        if fused:
            r["fused"] = True
        out.append(r)
    return out


def measured():
    return (rows("nccl", "A", {1: 60.0, 3: 150.0, 4: 160.0})
            + rows("nccl", "A", {1: 1.0, 3: 1.0}, mode="eager")  # eager rows are not what decode runs
            + rows("custom_ar", "A", {1: 20.0, 3: 40.0})
            + rows("symm_mem", "A", {1: 5.0}) + rows("symm_mem", "A", {3: 5.0}, status="wrong")
            + rows("pcie_ipc", "B", {1: 10.0, 2: 12.0, 4: 16.0})  # [3] interpolated: 12 + (16 - 12) / 2 = 14
            + rows("nccl", "B", {1: 62.0, 3: 152.0})
            + rows("nccl_add_rmsnorm", "B", {1: 70.0, 3: 162.0}, fused=True)
            + rows("b12x_fused", "B", {1: 15.0, 3: 20.0}, fused=True)
            + rows("b12x_twoshot", "B", {1: 9.0}) + [{"backend": "b12x_twoshot", "install": "B", "mode": "graph",
                                                     "rows": 3, "status": "declined", "detail": "accepts() declined"}])


def by_name(d):
    return {(c["backend"], c["install"]): c for c in d["candidates"]}


def test_interpolation_is_linear_between_measured_sizes_and_never_extrapolated():
    assert decision.latency_at({1: 10.0, 4: 16.0}, 1) == (10.0, "measured")
    assert decision.latency_at({1: 10.0, 4: 16.0}, 3) == (14.0, "interpolated 1..4")
    assert decision.latency_at({2: 10.0, 4: 16.0}, 1) is None
    assert decision.latency_at({1: 10.0, 2: 12.0}, 3) is None


def test_projection_by_hand():
    d = decision.project(measured(), CFG)
    assert d["R"] == 122 and d["served"] == "nccl [A]" and d["warnings"] == []
    c = by_name(d)
    # pcie_ipc: decode 122 x (60 - 10) us = 6.1 ms off 12.2 -> 6.1 ms = 163.9 tok/s;
    # verify 122 x (150 - 14) us = 16.592 ms off 30 -> 13.408 ms: 2.0 -> 149.2, 2.5 -> 186.5, 3.0 -> 223.7;
    # break-even 13.408 / 6.1 = 2.20
    p = c[("pcie_ipc", "B")]
    assert (p["t_decode_us"], p["t_verify_us"], p["t_verify_how"]) == (10.0, 14.0, "interpolated 2..4")
    assert (p["ar_ms_decode"], p["ar_ms_verify"]) == (1.22, 1.708)  # 122 x 10 us, 122 x 14 us
    assert (p["step_ms"], p["cycle_ms"], p["tok_s_no_spec"]) == (6.1, 13.408, 163.9)
    assert p["tok_s_eagle3"] == {"2": 149.2, "2.5": 186.5, "3": 223.7} and p["break_even_accept"] == 2.2
    # custom_ar: 122 x 40 us = 4.88 ms -> 7.32 ms = 136.6 tok/s; 122 x 110 us = 13.42 ms -> 16.58 ms:
    # 2.5 -> 150.8; break-even 16.58 / 7.32 = 2.27
    a = c[("custom_ar", "A")]
    assert (a["step_ms"], a["cycle_ms"], a["tok_s_no_spec"], a["tok_s_eagle3"]["2.5"]) == (7.32, 16.58, 136.6, 150.8)
    assert a["break_even_accept"] == 2.27
    # NCCL as served is the baseline itself: 82.0 tok/s, 2.5 x 1000 / 30 = 83.3, break-even 2.46
    n = c[("nccl", "A")]
    assert n["served"] and (n["tok_s_no_spec"], n["tok_s_eagle3"]["2.5"], n["break_even_accept"]) == (82.0, 83.3, 2.46)
    # NCCL of install B is 2 us slower: 12.2 + 0.244 = 12.444 ms -> 80.4 tok/s
    assert c[("nccl", "B")]["step_ms"] == 12.444 and c[("nccl", "B")]["tok_s_no_spec"] == 80.4


def test_fused_backend_is_compared_with_nccl_then_the_separate_norm():
    c = by_name(decision.project(measured(), CFG))[("b12x_fused", "B")]
    # the separate add-RMSNorm costs 70 - 62 = 8 us at [1], 162 - 152 = 10 us at [3] (install B):
    # allreduce-equivalent 15 - 8 = 7 us and 20 - 10 = 10 us;
    # step 12.2 - 122 x 53 us = 5.734 ms -> 174.4 tok/s; cycle 30 - 122 x 140 us = 12.92 ms -> 2.5: 193.5
    assert (c["t_decode_us"], c["t_verify_us"], c["fused"]) == (7.0, 10.0, True)
    assert (c["step_ms"], c["cycle_ms"], c["tok_s_no_spec"], c["tok_s_eagle3"]["2.5"]) == (5.734, 12.92, 174.4, 193.5)
    assert "less the separate add-RMSNorm (8.0 us)" in c["t_decode_how"]
    alone = [r for r in measured() if r["backend"] != "nccl_add_rmsnorm"]
    why = {x["backend"]: x["why"] for x in decision.project(alone, CFG)["not_ranked"]}
    assert why["b12x_fused"].startswith("fused with add-RMSNorm, and no nccl_add_rmsnorm")


def test_ranking_and_what_is_not_a_candidate():
    d = decision.project(measured(), CFG)
    order = [(c["backend"], c["install"]) for c in d["candidates"]]
    # by EAGLE-3 tok/s at accept length 2.5: 193.5, 186.5, 150.8, 83.3, 82.7
    assert order == [("b12x_fused", "B"), ("pcie_ipc", "B"), ("custom_ar", "A"), ("nccl", "A"), ("nccl", "B")]
    assert [c["rank"] for c in d["candidates"]] == [1, 2, 3, 4, 5]
    # at 2.5 even NCCL's cycle pays (83.3 > 82.0: break-even 2.46), PCIe-IPC's too (186.5 > 163.9); at 2.0
    # neither does: a faster allreduce speeds up plain decode as well, break-even 2.20
    assert d["candidates"][3]["eagle3_pays_at_rank_accept"] and d["candidates"][1]["eagle3_pays_at_rank_accept"]
    at2 = {c["backend"] + c["install"]: c for c in decision.project(measured(), {**CFG, "rank_accept_length": 2.0})["candidates"]}
    assert not at2["ncclA"]["eagle3_pays_at_rank_accept"] and not at2["pcie_ipcB"]["eagle3_pays_at_rank_accept"]
    why = {x["backend"]: x["why"] for x in d["not_ranked"]}
    assert why["symm_mem"].startswith("a WRONG result")  # fast (5 us) but wrong: never ranked
    assert why["b12x_twoshot"] == "declined at [3] rows: accepts() declined"
    assert "nccl_add_rmsnorm" not in why and ("nccl_add_rmsnorm", "B") not in by_name(d)
    assert [c["backend"] for c in at2.values()][:2] == ["b12x_fused", "pcie_ipc"]


def test_markdown_names_the_projection_the_switch_and_the_confirm_command():
    d = decision.project(measured(), CFG)
    md = "\n".join(decision.markdown(d, {"A": "A: sglang 0.5.9 (~/ml-env)", "B": "B: sglang 0.5.23 (~/ml-env-0.5.23)"},
                                     {"b12x_fused": "scripts/regress.sh --tier server --modes x"}))
    assert "a PROJECTION" in md and "the server tier confirms it" in md
    assert "| 2 | **pcie_ipc** | B | 10.0 / 14.0 (interp.) | 1.22 / 1.71 | 6.10 | 163.9 | 149.2 | 186.5 | 223.7 | 2.20 | " \
           "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1" in md
    assert "**nccl** (as served)" in md and "confirm on the server: `scripts/regress.sh --tier server --modes x`" in md
    assert "- symm_mem [A]: a WRONG result" in md and "B: sglang 0.5.23 (~/ml-env-0.5.23)" in md


def test_a_bench_nccl_slower_than_the_whole_step_is_flagged_and_nothing_served_means_no_table():
    slow = rows("nccl", "A", {1: 120.0, 3: 150.0}) + rows("pcie_ipc", "A", {1: 10.0, 3: 14.0})
    d = decision.project(slow, CFG)  # 122 x 120 us = 14.6 ms > 12.2 ms
    assert any("more than the measured step or cycle" in w for w in d["warnings"])
    d = decision.project(rows("pcie_ipc", "A", {1: 10.0, 3: 14.0}), CFG)
    assert d["candidates"] == [] and "nothing to project from" in d["warnings"][0]


def test_baseline_from_a_server_report(tmp_path):
    rep = {"tiers": {"server": {"modes": [
        {"mode": "no_spec", "benchmark": {"median_tpot_ms": 12.6}, "verify_profile": {"records": 0}},
        {"mode": "eagle3", "benchmark": {"median_tpot_ms": 16.0, "accept_length": 2.05},
         "verify_profile": {"median_of_records": {"draft_ms_median": 0.8, "verify_ms_median": 29.0,
                                                  "extend_ms_median": 0.6}}}]}}}
    (tmp_path / "report.json").write_text(json.dumps(rep))
    base = decision.baseline_from_report(tmp_path)
    assert (base["decode_step_ms"], base["spec_cycle_ms"], base["accept_length"]) == (12.6, 30.4, 2.05)
    assert (base["mode_decode"], base["mode_spec"], base["verify_ms"]) == ("no_spec", "eagle3", 29.0)
    p = by_name(decision.project(measured(), CFG, base))[("pcie_ipc", "B")]
    # step 12.6 - 6.1 = 6.5 ms -> 153.8 tok/s; cycle 30.4 - 16.592 = 13.808 ms -> at the measured 2.05: 148.5
    assert (p["step_ms"], p["tok_s_no_spec"], p["cycle_ms"], p["tok_s_eagle3"]["2.05"]) == (6.5, 153.8, 13.808, 148.5)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SglpatchError, match="no server-tier modes"):
        decision.baseline_from_report(tmp_path / "bad.json")
    with pytest.raises(SglpatchError, match="cannot read"):
        decision.baseline_from_report(tmp_path / "missing")


def test_the_target_profile_carries_the_decision_config():
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    cfg = decision.config(profiles.load_profile(root / "targets" / "rtx6000x8-kimi-k25.toml"))
    assert (cfg["layers"], cfg["hidden"], cfg["batch_size"], cfg["draft_tokens"]) == (61, 7168, 1, 3)
    assert (cfg["decode_step_ms"], cfg["spec_cycle_ms"], cfg["accept_lengths"]) == (12.2, 30.0, [2.0, 2.5, 3.0])
    assert decision.config(profiles.load_profile(None)) is None
    with pytest.raises(SglpatchError, match="layers must be a positive integer"):
        decision.config({"kernel": {"hidden": 7168, "decision": {"layers": 0}}})


def test_projection_at_batch_2_reads_verify_rows_batch_times_draft_tokens():
    """Not only at batch 1 (where batch x k and batch + k - 1 agree): batch 2, 3 draft tokens ->
    decode rows [2], verify rows [6] (issue 29)."""
    pts = rows("nccl", "A", {1: 60.0, 2: 80.0, 4: 120.0, 6: 200.0, 8: 240.0}) + rows("custom_ar", "A", {1: 20.0, 2: 30.0, 4: 50.0, 6: 70.0, 8: 90.0})
    d = decision.project(pts, {**CFG, "batch_size": 2})
    assert (d["decode_rows"], d["verify_rows"]) == (2, 6)
    a = by_name(d)[("custom_ar", "A")]
    # decode 122 x (80 - 30) us = 6.1 ms off 12.2 -> 6.1 ms; verify 122 x (200 - 70) us = 15.86 ms off 30 -> 14.14 ms
    assert (a["t_decode_us"], a["t_verify_us"], a["t_verify_how"]) == (30.0, 70.0, "measured")
    assert (a["step_ms"], a["cycle_ms"], a["break_even_accept"]) == (6.1, 14.14, 2.32)


def test_pcie_ipc_switch_names_what_serves_it_on_each_line():
    """The same candidate on 0.5.9 + P5, on 0.5.23 natively, and on an install with neither."""
    pts = {1: 10.0, 3: 14.0}
    got = rows("nccl", "A", {1: 60.0, 3: 150.0}) + rows("pcie_ipc", "A", pts) + rows("pcie_ipc", "B", pts) + rows("pcie_ipc", "C", pts)
    versions = {"A": {"sglang": "0.5.9", "flashinfer-python": "0.7.2", "sglang_pcie_ipc": "P5"},
                "B": {"sglang": "0.5.23", "flashinfer-python": "0.7.2", "sglang_pcie_ipc": "upstream"},
                "C": {"sglang": "0.5.9", "flashinfer-python": "0.7.2"}}
    c = by_name(decision.project(got, CFG, None, versions))
    assert c[("pcie_ipc", "A")]["switch"] == ("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 on 0.5.9 + P5 (the series' backport; off by "
                                              "default; flashinfer 0.7.2, from `scripts/apply.sh --with-flashinfer`)")
    assert c[("pcie_ipc", "B")]["switch"] == ("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 on sglang 0.5.23 natively (flashinfer 0.7.2; "
                                              "on by [[server.version_env]] there)")
    assert c[("pcie_ipc", "C")]["switch"] == ("none on this install (sglang 0.5.9): SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 needs "
                                              "0.5.9 + P5 (`scripts/apply.sh --with-flashinfer`) or sglang >= 0.5.22")
    assert c[("nccl", "A")]["switch"] == decision.SWITCHES["nccl"]  # only pcie_ipc depends on the line
    md = "\n".join(decision.markdown(decision.project(got, CFG, None, versions), {}, {}))
    assert "| 1 | **pcie_ipc** | A | 10.0 / 14.0 | 1.22 / 1.71 | 6.10 | 163.9 |" in md and "on 0.5.9 + P5 (the series'" in md
    # without the workers' versions (an older report): the generic text names both lines
    assert by_name(decision.project(got, CFG))[("pcie_ipc", "A")]["switch"] == (
        "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 (0.5.9 + P5 with `scripts/apply.sh --with-flashinfer`, or sglang >= 0.5.22 "
        "natively: flashinfer >= 0.7.0 either way)")


def test_the_worker_reads_the_pcie_ipc_adapter_from_the_files(tmp_path, monkeypatch):
    from sglpatch.gpu.kernel.microbench import hardware
    from sglpatch.gpu.kernel.launch import install_label

    pkg = tmp_path / "sglang"
    comm = pkg / "srt" / "distributed" / "device_communicators"
    comm.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('not imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hardware.sglang_pcie_ipc() is None
    (comm / "pcie_ipc_ar.py").write_text("")
    assert hardware.sglang_pcie_ipc() == "upstream"
    (comm / "pcie_ipc_allreduce.py").write_text("")
    assert hardware.sglang_pcie_ipc() == "P5"
    hw = {"versions": {"sglang": "0.5.9", "sglang_pcie_ipc": "P5"}}
    assert install_label("A", "/opt/ml-env/bin/python3", hw) == "A: sglang 0.5.9 + P5 (/opt/ml-env)"
    assert install_label("B", "/opt/v/bin/python3", {"versions": {"sglang": "0.5.23", "sglang_pcie_ipc": "upstream"}}) == \
        "B: sglang 0.5.23 (/opt/v)"


def test_b12x_switch_is_p7s_on_the_059_line_and_none_elsewhere():
    """P7 serves b12x's one-shot kernel and its fused add+RMSNorm under one switch, on the 0.5.9 line;
    the two-shot kernel nowhere; on 0.5.23 no patch serves any of them (issue 53)."""
    p7 = "SGLANG_ENABLE_B12X_ALLREDUCE=1 (P7, 0.5.9 line; SM120 only)"
    two = "none: P7 serves the one-shot kernel and its fused add+RMSNorm only"
    assert [decision.switch(b) for b in ("b12x_oneshot", "b12x_fused", "b12x_twoshot")] == [p7, p7, two]
    with_p7 = {"sglang": "0.5.9", "flashinfer-python": "0.7.2", "sglang_b12x": "P7"}
    assert decision.switch("b12x_oneshot", with_p7) == decision.switch("b12x_fused", with_p7) == p7
    assert decision.switch("b12x_twoshot", with_p7) == two
    assert decision.switch("b12x_fused", {"sglang": "0.5.9"}) == (
        "none on this install (sglang 0.5.9 without P7): SGLANG_ENABLE_B12X_ALLREDUCE=1 needs 0.5.9 + P7 "
        "(`scripts/apply.sh --with-flashinfer`)")
    assert decision.switch("b12x_oneshot", {"sglang": "0.5.23", "sglang_pcie_ipc": "upstream"}) == (
        "none on sglang 0.5.23: no patch serves flashinfer's b12x kernels on that line (P7, "
        "SGLANG_ENABLE_B12X_ALLREDUCE=1, is on the 0.5.9 line only)")
    assert decision.switch("b12x_twoshot", {"sglang": "0.5.23"}) == two
    assert decision.switch("b12x_oneshot", {"torch": "2.9"}).startswith("none on this install (no sglang)")
    # in the table: the same candidate on both lines of an --ab run
    got = rows("nccl", "A", {1: 60.0, 3: 150.0}) + rows("b12x_oneshot", "A", {1: 9.0, 3: 12.0}) + \
        rows("b12x_oneshot", "B", {1: 9.0, 3: 12.0})
    c = by_name(decision.project(got, CFG, None, {"A": with_p7, "B": {"sglang": "0.5.23"}}))
    assert c[("b12x_oneshot", "A")]["switch"] == p7 and c[("b12x_oneshot", "B")]["switch"].startswith("none on sglang 0.5.23")


def test_the_worker_reads_p7_from_the_files(tmp_path, monkeypatch):
    from sglpatch.gpu.kernel.microbench import hardware

    pkg = tmp_path / "sglang"
    (pkg / "srt" / "layers").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('not imported')\n")
    (pkg / "srt" / "environ.py").write_text("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hardware.sglang_b12x() is False and "sglang_b12x" not in hardware.versions()
    (pkg / "srt" / "layers" / "b12x_allreduce.py").write_text("flag = envs.SGLANG_ENABLE_B12X_ALLREDUCE.get()\n")
    assert hardware.sglang_b12x() is True and hardware.versions()["sglang_b12x"] == "P7"
