"""PCIe-IPC in the kernel tier as P5 serves it (issue 36): buckets = the served rows, seed by
default, with `pcie_ipc_tune = true` a tuned leg against seed per served shape and a verdict.  Here
the table and verdict from figures, the profile keys, the launch plan, P5's width rule and the
clocks (a fake nvidia-smi); the real tier on torchrun is tests/test_kernel_pcie_ipc_tier.py."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from sglpatch.errors import SglpatchError
from sglpatch.gpu.kernel import launch as kernel_launch
from sglpatch.gpu.kernel import pcie_tune
from sglpatch.gpu.kernel.bench import ALL_BACKENDS, build_arg_parser
from sglpatch.gpu.kernel.microbench.pcie_ipc import pcie_ipc_width
from sglpatch.gpu.kernel.tier import stress_launch
from sglpatch.gpu.shared import profile as profiles

ROOT = Path(__file__).resolve().parents[1]
SHIM_B = ROOT / "tests" / "shims" / "kb_install_b"
TOPO = ROOT / "tests" / "fixtures" / "topo"
P5 = next((ROOT / "patches").glob("0005-*.patch"))
SERVED = [3, 6, 12, 24]  # a power-of-two ladder up to 24 would be 1, 2, 4, 8, 16, 24
SEED = {3: 10.0, 6: 12.0, 12: 16.0, 24: 20.0}
STEP = "python -m sglang.srt.pcie_ipc_tune --tp 8 --hidden 7168 --rows 3,6,12,24"


def rows_of(seed: dict, tuned: dict, install: str = "A") -> list[dict]:
    out = [{"backend": "nccl", "install": install, "mode": "graph", "rows": 3, "status": "ok", "median_us": 1.0}]
    for b, figs in (("pcie_ipc", seed), ("pcie_ipc_tuned", tuned)):
        for n, us in figs.items():
            out.append({"backend": b, "install": install, "mode": "graph", "rows": n, "status": "ok", "median_us": us})
            out.append({"backend": b, "install": install, "mode": "eager", "rows": n, "status": "ok", "median_us": 0.5})
    return out


def kernel(**extra) -> dict:
    return {"backends": ["nccl", "pcie_ipc"], "hidden": 7168, "tolerance": 0.15, "pcie_ipc_rows": SERVED,
            "pcie_ipc_tune": True, **extra}


def one(rows: list[dict], k: dict) -> dict:
    inst = {"key": "A", "label": "A: sglang 0.5.9 + P5", "errors": {}, "absent": {},
            "backend_info": {"pcie_ipc": {"rows": SERVED, "buckets": SERVED, "how": "as P5 serves it"}}}
    return pcie_tune.compare(rows, [inst], k, 8)["installs"][0]


def test_table_and_verdict_keep_when_tuned_beats_seed_beyond_the_tolerance():
    x = one(rows_of(SEED, {3: 8.4, 6: 11.9, 12: 16.2, 24: 19.0}), kernel())
    assert x["table"] == [{"rows": 3, "seed_us": 10.0, "tuned_us": 8.4, "tuned_over_seed": 0.84},
                          {"rows": 6, "seed_us": 12.0, "tuned_us": 11.9, "tuned_over_seed": 0.992},
                          {"rows": 12, "seed_us": 16.0, "tuned_us": 16.2, "tuned_over_seed": 1.012},
                          {"rows": 24, "seed_us": 20.0, "tuned_us": 19.0, "tuned_over_seed": 0.95}]
    assert x["no_verdict"] is None and x["verdict"] == (
        f"keep: tuned is faster than seed by more than 15% at 3 rows (0.840): run the tuning step (`{STEP} --pin-clocks MHZ`) "
        "and serve with SGLANG_PCIE_IPC_TUNE=cache")
    md = "\n".join(pcie_tune.markdown(pcie_tune.compare(rows_of(SEED, {3: 8.4}), [{"key": "A", "label": "A: x"}],
                                                         kernel(pin_clocks_mhz=2100), 8)))
    assert "| 3 | 10.0 | 8.4 | 0.840 |" in md and "| 6 | 12.0 | — | — |" in md
    assert f"**Verdict: keep: tuned is faster than seed by more than 15% at 3 rows (0.840): run the tuning step (`{STEP} " \
           "--pin-clocks 2100`)" in md
    assert "Served rows [3, 6, 12, 24] (`[kernel] pcie_ipc_rows`, the server's buckets)" in md


def test_seed_within_the_tolerance_at_every_served_shape_needs_no_tuning():
    x = one(rows_of(SEED, {3: 8.6, 6: 10.3, 12: 16.0, 24: 25.0}), kernel())
    assert [r["tuned_over_seed"] for r in x["table"]] == [0.86, 0.858, 1.0, 1.25]
    assert x["verdict"] == "seed is within tolerance (15%) at every served shape: no tuning needed (SGLANG_PCIE_IPC_TUNE=seed, the default)"
    # the tolerance is the profile's: 0.10 turns the same figures into keep at 3 and 6 rows
    assert one(rows_of(SEED, {3: 8.6, 6: 10.3, 12: 16.0, 24: 25.0}), kernel(tolerance=0.10))["verdict"].startswith(
        "keep: tuned is faster than seed by more than 10% at 3 rows (0.860), 6 rows (0.858): ")


def test_no_verdict_when_a_side_has_no_data():
    none_tuned = one(rows_of(SEED, {}), kernel())
    assert none_tuned["verdict"] is None and none_tuned["no_verdict"] == "no verdict: the tuned leg has no data at the served rows"
    assert [r["tuned_us"] for r in none_tuned["table"]] == [None] * 4
    none_seed = one(rows_of({}, {3: 1.0, 6: 1.0, 12: 1.0, 24: 1.0}), kernel())
    assert none_seed["verdict"] is None and none_seed["no_verdict"] == "no verdict: the seed leg has no data at the served rows"
    # half the shapes, none of them beyond the tolerance: nothing decides it
    part = one(rows_of(SEED, {3: 9.9, 6: 12.0}), kernel())
    assert part["verdict"] is None
    assert part["no_verdict"] == "no verdict: no seed and tuned pair at rows [12, 24], and none of the others decides it"
    # not asked for (the default): says so; a wrong or declined tuned row is no data either
    assert one(rows_of(SEED, {}), kernel(pcie_ipc_tune=False))["no_verdict"] == \
        "no verdict: the tuned leg was not asked for ([kernel] pcie_ipc_tune = false, the default)"
    wrong = [dict(r, status="wrong") if r["backend"] == "pcie_ipc_tuned" else r for r in rows_of(SEED, {3: 1.0})]
    assert one(wrong, kernel())["verdict"] is None
    md = "\n".join(pcie_tune.markdown(pcie_tune.compare(rows_of(SEED, {}), [{"key": "A", "label": "A"}], kernel(), 8)))
    assert "Verdict" not in md and "keep:" not in md and "seed is within" not in md
    assert "no verdict: the tuned leg has no data at the served rows." in md and "| 24 | 20.0 | — | — |" in md
    assert "Clocks: clocks were not pinned (no tuned leg)" in md


def test_profile_keys():
    s = pcie_tune.settings(kernel())
    assert s == {"rows": SERVED, "rows_given": True, "tune": True, "asked": True, "pin_mhz": None}
    d = profiles.load_profile(None)["kernel"]
    assert (d["pcie_ipc_rows"], d["pcie_ipc_tune"], d["pin_clocks_mhz"]) == (None, False, None)
    assert pcie_tune.settings({**d, "backends": ["pcie_ipc"], "pcie_ipc_max_rows": 16})["rows"] == [16]
    assert pcie_tune.settings({**d, "backends": ["pcie_ipc"]})["tune"] is False  # the default does not tune
    assert pcie_tune.settings(kernel(backends=["nccl"]))["tune"] is False  # no seed leg, no tuned leg
    target = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")["kernel"]
    assert (target["pcie_ipc_rows"], target["pcie_ipc_tune"], target["pin_clocks_mhz"]) == (SERVED, False, None)
    for bad in ({"pcie_ipc_rows": []}, {"pcie_ipc_rows": [3, 0]}, {"pcie_ipc_rows": "3,6"}, {"pcie_ipc_tune": "yes"},
                {"pin_clocks_mhz": -1}, {"backends": ["pcie_ipc", "pcie_ipc_tuned"]}):
        with pytest.raises(SglpatchError) as e:
            pcie_tune.settings(kernel(**bad))
        assert e.value.exit_code == 2


def test_launch_plan(tmp_path):
    prof = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")
    a, b = {"key": "A", "python": "/a"}, {"key": "B", "python": "/b"}
    ls = kernel_launch.kernel_launches(prof, 8, tmp_path, a, True)
    assert [L["name"] for L in ls] == ["main", "p2p_off", "default_env"] and "pcie_ipc" in ls[0]["backends"]
    cmd = ls[0]["cmd"]
    assert cmd[cmd.index("--pcie-ipc-rows") + 1] == "3,6,12,24" and "--pcie-ipc-max-rows" not in cmd
    prof["kernel"]["pcie_ipc_tune"] = True
    for interp, name in ((a, "pcie_ipc"), (b, "pcie_ipc-B")):
        ls = kernel_launch.kernel_launches(prof, 8, tmp_path, interp, interp is a)
        assert "pcie_ipc" not in ls[0]["backends"] and "nccl" in ls[0]["backends"]
        tuned = ls[-1]
        assert (tuned["name"], tuned["backends"], tuned["soft"], tuned["pin"]) == \
            (name, ["pcie_ipc", "pcie_ipc_tuned"], "pcie_ipc_tuned", True)
    stress = stress_launch(prof, 8, tmp_path, "py", 10)["cmd"]
    assert stress[stress.index("--pcie-ipc-rows") + 1] == "3,6,12,24"  # the stress run builds the served workspace too
    prof["kernel"]["pcie_ipc_rows"] = None
    cmd = kernel_launch.kernel_launches(prof, 8, tmp_path, a, True)[0]["cmd"]
    assert cmd[cmd.index("--pcie-ipc-max-rows") + 1] == "24" and "--pcie-ipc-rows" not in cmd
    assert "pcie_ipc" in ALL_BACKENDS and "pcie_ipc_tuned" not in ALL_BACKENDS  # by hand, the worker tunes nothing
    with pytest.raises(SystemExit):
        build_arg_parser().parse_args(["--out", "x", "--pcie-ipc-tune"])


def p5_source(name: str = "pcie_ipc_allreduce.py") -> str:
    """A file P5 creates, as the patch has it."""
    text = P5.read_text()
    start = text.index(f"+++ b/python/sglang/srt/distributed/device_communicators/{name}\n")
    body = text.index("\n", text.index("\n@@ ", start) + 1) + 1
    return "".join(line[1:] + "\n" for line in text[body:text.index("\ndiff --git", body)].split("\n"))


def test_the_inline_width_rule_is_p5s():
    tree = ast.parse(p5_source())
    ns: dict = {"Optional": typing.Optional, "Sequence": typing.Sequence, "Tuple": typing.Tuple}  # P5's names
    exec(compile(ast.Module([n for n in tree.body if isinstance(n, (ast.Assign, ast.FunctionDef)) and (
        getattr(n, "name", "") in ("pcie_ipc_max_numel", "pcie_ipc_width")
        or any(getattr(t, "id", "") == "PCIE_IPC_PACK_ELEMS" for t in getattr(n, "targets", [])))], []), str(P5), "exec"), ns)
    for args in ((SERVED, 7168, None), ([24, 3, 12, 6, 6], 7168, None), ([1, 2, 4, 8], 64, None), ([3], 7, None),
                 (SERVED, 7168, 57344), (SERVED, 7168, 100001), (SERVED, 7168, 3 * 7168), ([8], 7168, 7168),
                 ([3, 6], 7168, 24 * 7168)):  # an override wider than the rows: its own rows are a bucket too
        assert pcie_ipc_width(*args) == ns["pcie_ipc_width"](*args), args
    assert pcie_ipc_width(SERVED, 7168, None) == (24 * 7168, (3, 6, 12, 24), "widest captured reduction 24 rows")
    for args in (([], 7168, None), ([0, -3], 7168, None), (SERVED, 7168, 100)):
        with pytest.raises(ValueError) as mine:
            pcie_ipc_width(*args)
        with pytest.raises(ValueError) as theirs:
            ns["pcie_ipc_width"](*args)
        assert str(mine.value) == str(theirs.value)


def fake_smi(tmp_path: Path, lgc_rc: int = 0) -> tuple[str, Path]:
    log = tmp_path / "smi.log"
    p = tmp_path / "nvidia-smi"
    p.write_text(f"#!/bin/sh\ncase \"$1\" in topo) case \"$2\" in -m) cat '{TOPO}/two-sockets-no-switch.txt';; "
                 f"-p2p) cat '{TOPO}/p2p-two-sockets-cns.txt';; esac;;\n"
                 f"-i) echo \"$(date +%s.%N) $*\" >> '{log}'; case \"$3\" in -lgc) [ {lgc_rc} = 0 ] || "
                 f"{{ echo 'Setting locked GPU clocks is not supported' >&2; exit {lgc_rc}; }};; esac;; esac\n")
    p.chmod(0o755)
    return str(p), log


def smi_calls(log: Path) -> list[tuple[float, str]]:
    return [(float(t), rest) for t, _, rest in (ln.partition(" ") for ln in log.read_text().splitlines())] \
        if log.exists() else []


def test_clocks_pinned_only_when_asked_and_always_reset(tmp_path):
    smi, log = fake_smi(tmp_path)
    with pcie_tune.clocks({"nvidia_smi": smi}, 2, {}) as c:
        assert c == {"pinned": False, "line": "clocks were not pinned (no [kernel] pin_clocks_mhz): the tune ranked "
                     "its candidates and both legs ran at the GPUs' own clocks"}
    assert smi_calls(log) == []
    with pytest.raises(RuntimeError), pcie_tune.clocks({"nvidia_smi": smi, "pin_clocks_mhz": 1500}, 2,
                                                       {"CUDA_VISIBLE_DEVICES": "4,5,6"}) as c:
        assert c["pinned"] and "error" not in c
        assert [r for _, r in smi_calls(log)] == ["-i 4,5 -lgc 1500,1500"]
        raise RuntimeError("the launch died")
    assert [r for _, r in smi_calls(log)] == ["-i 4,5 -lgc 1500,1500", "-i 4,5 -rgc"]
    assert "reset_error" not in c
    (tmp_path / "x").mkdir()
    smi, log = fake_smi(tmp_path / "x", lgc_rc=9)
    with pcie_tune.clocks({"nvidia_smi": smi, "pin_clocks_mhz": 1500}, 2, {}) as c:
        pass
    assert c["error"] == (f"not run: `{smi} -i 0,1 -lgc 1500,1500` failed (exit 9: Setting locked GPU clocks is not "
                          "supported); clocks were not pinned") and not c["pinned"]
    assert [r for _, r in smi_calls(log)] == ["-i 0,1 -lgc 1500,1500", "-i 0,1 -rgc"]  # reset whatever was set
    with pcie_tune.clocks({"nvidia_smi": str(tmp_path / "none"), "pin_clocks_mhz": 1500}, 2, {}) as c:
        pass
    assert c["error"].startswith("not run: ") and c["reset_error"].endswith("the clocks may still be pinned")
