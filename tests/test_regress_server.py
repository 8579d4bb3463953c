"""The server tier end to end on CPU: the real `python -m sglang.bench_serving` of the patched
sglang (the conftest's `patched_python` venv) against a real stand-in HTTP server
(tests/standin_server.py), its JSONL parsed into the report; crash, hang and cleanup; output
parity between modes and against an earlier report."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from conftest import SERIES, copy_project

from sglpatch.errors import SglpatchError
from sglpatch.gpu import regress
from sglpatch.gpu.shared import profile as profiles
from sglpatch.gpu.server import mode as regress_server
from sglpatch.gpu.server import report as server_report

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "standin_server.py"
SHIMS = ROOT / "tests" / "shims"
PROMPTS = ["Explain how experts are routed.", "Write a timestamp parser.", "Summarize the 1929 crash.",
           "Compare PCIe and NVLink allreduce."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny word-level tokenizer with a chat template, made here (nothing downloaded): the
    stand-in answers in words w0..w199, so bench_serving's retokenized counts are exact."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "<|user|>": 3, "<|assistant|>": 4}
    vocab.update({f"w{i}": 5 + i for i in range(200)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>", eos_token="</s>",
                                   chat_template=template)
    out = tmp_path_factory.mktemp("tok") / "standin-model"
    fast.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def bench_env(patched_python) -> str:
    """[server.benchmark.env] for the tests: the datasets stand-in only where the real one is absent."""
    has = subprocess.run([str(patched_python), "-c", "import datasets"], capture_output=True).returncode == 0
    return "" if has else f'PYTHONPATH = "{SHIMS}"'


def server_profile(port, standin_args, pidfile, python, model, bench_env, *, health_timeout=20, modes=None,
                   extra="", bench_timeout=120) -> str:
    modes = modes or '[[server.modes]]\nname = "no_spec"\nargs = []\n'
    return textwrap.dedent(f"""
    [target]
    name = "standin"
    [env]
    SGLPATCH_TEST_MARKER = "1"
    [server]
    python = "{python}"
    model_path = "{model}"
    port = {port}
    command = ["{{python}}", "{STANDIN}", "--port", "{{port}}", "--model-path", "{{model_path}}",
               "--random-seed", "{{seed}}", "--pid-file", "{pidfile}"]
    launch_args = {standin_args}
    health_timeout_s = {health_timeout}
    stop_grace_s = 1.0
    poll_s = 0.1
    [server.env]
    SGLANG_ENABLE_PCIE_CUSTOM_AR = "1"
    [server.benchmark]
    warmup_requests = 1
    max_new_tokens = 24
    timeout_s = {bench_timeout}
    prompts = {json.dumps(PROMPTS)}
    [server.benchmark.env]
    {bench_env}
    [server.baselines]
    no_spec_tok_s = 82.0
    tolerance = 0.05
    """) + textwrap.dedent(modes) + textwrap.dedent(extra)


@pytest.fixture
def serve(tmp_path, patched_python, tokenizer_dir, bench_env):
    """run(standin_args, report=..., **kw) -> (result, report.json, seconds, stand-in pids)."""
    port = free_port()

    def run(standin_args="[]", report="rep", modes_sel=None, parity_with=None, **kw):
        pidfile = tmp_path / f"pids-{report}.json"
        proj = tmp_path / "proj"  # a project copy: the series that says which patches the workdir carries
        if not (proj / "series").exists():
            copy_project(proj)
        (proj / "targets").mkdir(parents=True, exist_ok=True)
        (proj / "tests").mkdir(exist_ok=True)
        (proj / "targets" / "t.toml").write_text(
            server_profile(port, standin_args, pidfile, patched_python, tokenizer_dir, bench_env, **kw))
        t0 = time.monotonic()
        res = regress.run_regress("server", "t", str(tmp_path / report), str(proj), modes=modes_sel,
                                  parity_with=parity_with)
        took = time.monotonic() - t0
        doc = json.loads((tmp_path / report / "report.json").read_text())
        pids = json.loads(pidfile.read_text()) if pidfile.exists() else {}
        return res, doc, took, pids

    return run


def assert_all_gone(doc, pids):
    assert pids, "stand-in never reported its children"
    modes = doc["tiers"]["server"]["modes"]
    for m in modes:
        assert m["survivors"] == []
        assert (m.get("bench_run") or {}).get("survivors", []) == []
    # the grandchild left the session: only PID tracking can have ended it
    assert pids["grandchild"] in modes[-1]["tracked_pids"]
    for p in pids.values():
        assert not alive(p), f"pid {p} survived the stop"


# ----------------------------------------------------------------------------- units


def test_crash_scanner_ignores_exception_word(tmp_path):
    log = tmp_path / "l"
    log.write_text("UserWarning: Exception ignored in hook\nException: harmless\nTraceback (most recent call last):\n"
                   '  File "x", line 1\nImportError: optional\n')
    sc = regress_server.CrashScanner(log)
    assert sc.scan() is None and sc.last_exception_line == "ImportError: optional"
    with open(log, "a") as f:
        f.write("[rank3] torch.OutOfMemoryError: CUDA out of memory. Tried\n")
    assert "CUDA out of memory" in sc.scan()


def test_bench_command_uses_only_flags_of_the_installed_bench_serving(patched_tree):
    prof = profiles.load_profile(ROOT / "targets" / "rtx6000x8-kimi-k25.toml")
    cmd = regress_server.bench_command(prof["server"], "python3", "P.jsonl", "O.jsonl")
    assert cmd[:5] == ["python3", "-m", "sglang.bench_serving", "--backend", "sglang"]
    for flag in ("--dataset-name", "--apply-chat-template", "--flush-cache", "--output-file", "--output-details"):
        assert flag in cmd
    assert cmd[cmd.index("--dataset-name") + 1] == "custom"
    assert cmd[cmd.index("--max-concurrency") + 1] == "1"
    assert cmd[cmd.index("--num-prompts") + 1] == str(len(prof["server"]["benchmark"]["prompts"]))
    source = (patched_tree / "python" / "sglang" / "bench_serving.py").read_text()
    declared = set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', source))
    used = {a for a in cmd if a.startswith("--")}
    assert used <= declared, f"flags not in sglang's bench_serving: {used - declared}"


def test_first_difference_names_request_and_position():
    assert server_report.first_difference(["a b", "c d"], ["a b", "c d"]) is None
    d = server_report.first_difference(["a b", "c dx e"], ["a b", "c dy e"])
    assert d["request"] == 1 and d["char"] == 3 and d["common_prefix_words"] == 1
    assert server_report.bench_order(3, 3, 1) == [1, 2, 0]  # random.seed(1); shuffle, as bench_serving


# ----------------------------------------------------------------------------- end to end


def test_server_tier_runs_sglang_bench_serving(serve, tmp_path, patched_tree):
    modes = """
    [[server.modes]]
    name = "no_spec"
    args = ["--mode", "slow", "--load-s", "1.5", "--tok-s", "150"]
    [[server.modes]]
    name = "eagle3"
    args = ["--mode", "fast", "--tok-s", "50", "--accept-length", "2", "--speculative-algorithm", "EAGLE3",
            "--speculative-num-steps", "2"]
    gate = false
    [server.modes.env]
    SGLANG_VERIFY_PROFILE = "1"
    """
    res, doc, took, pids = serve(modes=modes)
    srv = doc["tiers"]["server"]
    assert srv["status"] == "pass", srv["failures"]
    no_spec, eagle = srv["modes"]
    rep = tmp_path / "rep"
    # the real tool ran and its JSONL was parsed: SGLang's names plus the derived single-stream rate
    assert no_spec["bench_command"][1:3] == ["-m", "sglang.bench_serving"]
    rec = json.loads((rep / "bench-no_spec.jsonl").read_text().splitlines()[-1])
    b = no_spec["benchmark"]
    assert b["completed"] == len(PROMPTS) and b["max_concurrency"] == 1
    assert b["median_tpot_ms"] == rec["median_tpot_ms"] and b["output_throughput"] == rec["output_throughput"]
    assert b["single_stream_tok_s"] == pytest.approx(1000 / rec["median_tpot_ms"], rel=1e-3)
    assert 60 < b["single_stream_tok_s"] < 170  # stand-in decodes at 150 tok/s (slower on a loaded 2-core box)
    assert b["output_throughput"] < b["single_stream_tok_s"]  # includes TTFT: not the comparable number
    assert no_spec["health"]["after_s"] >= 1.0 and no_spec["beats_baseline"] is True
    assert eagle["benchmark"]["accept_length"] == 2.0 and eagle["beats_baseline"] is False
    assert eagle["served"]["speculative"] == {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 2}
    assert eagle["served"]["version"] == "0.0.0-standin"
    assert json.loads((rep / "server_info-eagle3.json").read_text())["random_seed"] == 1234
    assert eagle["verify_profile"]["records"] >= len(PROMPTS) and no_spec["verify_profile"] is None
    assert eagle["env_added"] == {"SGLANG_ENABLE_PCIE_CUSTOM_AR": "1", "SGLANG_VERIFY_PROFILE": "1"}
    # what the server saw: a warm-up, the radix-cache flush, then every prompt once, chat-templated,
    # in the order the tier reconstructs from --seed
    log = (rep / "server-no_spec.log").read_text()
    calls = re.findall(r"standin: POST (/\S+)(?: max_new_tokens=(\d+) prompt='(.*)')?", log)
    assert [c[0] for c in calls] == ["/generate", "/flush_cache"] + ["/generate"] * len(PROMPTS)
    sent = [c[2] for c in calls[2:]]
    order = server_report.bench_order(len(PROMPTS), len(PROMPTS), 1234)
    assert sent == [f"<|user|> {PROMPTS[i]} <|assistant|> " for i in order]
    assert {c[1] for c in calls[2:]} == {"24"}
    # what served: the interpreter's sglang is the patched workdir, with its patches
    by = srv["served_by"]
    assert Path(by["workdir"]) == patched_tree.resolve()
    assert [c.split(":")[0] for c in by["carried"]] == SERIES and by["carried"][1].startswith("0002-pcie-custom-allreduce.patch")
    md = (rep / "report.md").read_text()
    assert "1000 / median TPOT" in md and "speculation does NOT pay" in md
    assert f"`{by['python']} -m sglang.bench_serving --backend sglang --host 127.0.0.1" in md
    assert f"carries {len(SERIES)} patch(es)" in md
    assert_all_gone(doc, pids)


def test_server_below_baseline_fails(serve):
    res, doc, took, pids = serve('["--mode", "fast", "--tok-s", "50"]')
    assert res["exit_code"] == 1
    fails = doc["tiers"]["server"]["failures"]
    assert any("(1000/median TPOT) below 77.9" in f for f in fails), fails


def test_server_dying_during_the_benchmark_stops_it_and_cleans_up(serve):
    res, doc, took, pids = serve('["--mode", "fast", "--fail-after", "2"]')
    m = doc["tiers"]["server"]["modes"][0]
    assert res["exit_code"] == 1 and took < 60
    assert "server crashed during the benchmark" in m["error"] and "NCCL error" in m["error"]
    assert_all_gone(doc, pids)


def test_server_hanging_during_the_benchmark_is_killed_and_cleaned_up(serve):
    res, doc, took, pids = serve('["--mode", "fast", "--hang-after", "2"]', bench_timeout=20)
    m = doc["tiers"]["server"]["modes"][0]
    assert res["exit_code"] == 1 and 20 <= took < 60
    assert "benchmark still running after 20.0 s (killed)" in m["error"] and "server alive: True" in m["error"]
    assert_all_gone(doc, pids)


def test_parity_between_modes_and_with_an_earlier_report(serve, tmp_path):
    modes = """
    [[server.modes]]
    name = "no_spec"
    args = []
    [[server.modes]]
    name = "no_spec_p2_off"
    args = []
    optional = true
    [server.modes.env]
    SGLANG_ENABLE_PCIE_CUSTOM_AR = "0"
    """
    extra = """
    [[server.parity]]
    name = "P2"
    a = "no_spec_p2_off"
    b = "no_spec"
    """
    perturbing = '["--perturb-env", "SGLANG_ENABLE_PCIE_CUSTOM_AR", "--perturb-pos", "5"]'
    # P2 on changes the stand-in's numerics: the pair differs, the tier fails and shows where
    res, doc, took, pids = serve(perturbing, report="r1", modes=modes, extra=extra, modes_sel="all")
    srv = doc["tiers"]["server"]
    (p2,) = srv["parity"]
    assert p2["status"] == "differ" and res["exit_code"] == 1
    first = p2["first_difference"]
    order = server_report.bench_order(len(PROMPTS), len(PROMPTS), 1234)
    assert first["request"] == 0 and first["prompt"] == PROMPTS[order[0]] and first["common_prefix_words"] == 5
    assert first["token"] == 5  # counted with the model's tokenizer (one word = one token here)
    assert any(f.startswith("parity P2: request 0") for f in srv["failures"])
    assert "**DIFFERS**" in (tmp_path / "r1" / "report.md").read_text()
    assert all(m["status"] == "ok" for m in srv["modes"])  # the speed side passed: only parity failed
    assert_all_gone(doc, pids)
    # an optional mode runs only when selected; P2 off again equals the earlier P2-off outputs
    res, doc, took, pids = serve(perturbing, report="r2", modes=modes, extra=extra, modes_sel="no_spec_p2_off",
                                 parity_with=str(tmp_path / "r1"))
    srv = doc["tiers"]["server"]
    assert [m["mode"] for m in srv["modes"]] == ["no_spec_p2_off"]
    assert srv["parity"][0]["status"] == "not_run"
    assert srv["parity"][1]["status"] == "same" and srv["status"] == "pass", srv["failures"]
    assert res["exit_code"] == 0
    assert "; parity same; parity not run: " in srv["summary"] and "FAILED" not in srv["summary"], srv["summary"]


def test_same_text_lower_acceptance_fails_the_pair_and_the_backend_is_not_eligible(serve, tmp_path):
    """Issue 53: P5's mode keeps NCCL's greedy text but its drafter accepts less (the stand-in's
    --accept-drop-env, corrupted hidden states): the EAGLE-3 pair fails the tier (exit 1) and is named,
    whatever the speed, and the kernel tier's decision table calls pcie_ipc not eligible, naming the pair."""
    from sglpatch.gpu.kernel import decision, eligibility

    eagle = ('["--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", '
             '"3", "--accept-length", "2", "--tok-s", "800"]')
    modes = f"""
    [[server.modes]]
    name = "eagle3_nccl"
    args = {eagle}
    gate = false
    [server.modes.env]
    SGLANG_ENABLE_PCIE_CUSTOM_AR = "0"
    SGLANG_ENABLE_PCIE_IPC_ALLREDUCE = "0"
    [[server.modes]]
    name = "eagle3_pcie_ipc"
    args = {eagle}
    gate = false
    [server.modes.env]
    SGLANG_ENABLE_PCIE_CUSTOM_AR = "0"
    SGLANG_ENABLE_PCIE_IPC_ALLREDUCE = "1"
    """
    extra = """
    [[server.parity]]
    name = "P5 PCIe-IPC vs NCCL, EAGLE-3"
    a = "eagle3_nccl"
    b = "eagle3_pcie_ipc"
    backends = ["pcie_ipc"]
    """
    res, doc, took, pids = serve('["--accept-drop-env", "SGLANG_ENABLE_PCIE_IPC_ALLREDUCE"]', modes=modes, extra=extra)
    srv = doc["tiers"]["server"]
    (pair,) = srv["parity"]
    assert res["exit_code"] == 1 and srv["status"] == "fail"
    assert all(m["status"] == "ok" for m in srv["modes"])  # both ran and were fast enough: only the pair failed
    assert pair["text"]["status"] == "same" and (pair["status"], pair["why"]) == ("differ", "accept length")
    # 4 prompts x 24 tokens at accept 2.0: 48 verify steps, tolerance 2 / sqrt(48) = 0.289
    assert (pair["accept"]["a"], pair["accept"]["b"], pair["accept"]["tolerance"]) == (2.0, 1.5, 0.289)
    assert srv["failures"] == [f"parity P5 PCIe-IPC vs NCCL, EAGLE-3: {pair['detail']}"]
    assert pair["detail"].startswith("greedy text identical, but the accept length 2.000 (eagle3_nccl) vs 1.500 "
                                     "(eagle3_pcie_ipc), bench_serving: beyond ±0.289")
    assert srv["summary"].endswith("; parity FAILED: P5 PCIe-IPC vs NCCL, EAGLE-3 (accept length)")
    ipc = srv["modes"][1]["allreduce"]
    assert ipc["backend"] == "PCIe-IPC (P5, the 0.5.9 backport)" and ipc["pcie_ipc"]["buckets"] == [3, 6, 12, 24]
    assert "| 2.00 / 1.50 (±0.289) | **DIFFERS**: greedy text identical" in (tmp_path / "rep" / "report.md").read_text()
    rows = [{"backend": b, "install": "A", "mode": "graph", "rows": n, "hidden": 7168, "status": "ok", "median_us": us}
            for b, pts in (("nccl", {1: 60.0, 3: 150.0}), ("pcie_ipc", {1: 10.0, 3: 14.0})) for n, us in pts.items()]
    d = decision.project(rows, {**decision.DEFAULTS, "hidden": 7168}, None, None,
                         eligibility.parity_from_report(tmp_path / "rep"))
    c = {x["backend"]: x for x in d["candidates"]}
    assert c["pcie_ipc"]["rank"] == 1 and c["pcie_ipc"]["eligible"] is False and d["winner"] == "nccl [A]"
    assert c["pcie_ipc"]["why"].startswith("pair 'P5 PCIe-IPC vs NCCL, EAGLE-3' failed (accept length): greedy text "
                                           "identical, but the accept length 2.000")
    assert "| **NO** |" in "\n".join(decision.markdown(d, {}, {}))
    assert_all_gone(doc, pids)


# ----------------------------------------------------------------------------- launch failures (no benchmark)


def test_server_crash_fails_fast_with_crash_line(serve):
    res, doc, took, pids = serve('["--mode", "crash", "--load-s", "0.8"]', health_timeout=60)
    m = doc["tiers"]["server"]["modes"][0]
    assert res["exit_code"] == 1 and took < 20
    assert m["health"]["state"] == "crash"
    assert "ValueError: weight shape mismatch" in m["error"]
    assert_all_gone(doc, pids)


def test_server_oom_line_fails_fast_although_alive(serve):
    res, doc, took, pids = serve('["--mode", "oom", "--load-s", "0.5"]', health_timeout=60)
    m = doc["tiers"]["server"]["modes"][0]
    assert res["exit_code"] == 1 and took < 20
    assert m["health"]["state"] == "crash" and "CUDA out of memory" in m["error"]
    assert_all_gone(doc, pids)


def test_server_hang_times_out_and_is_cleaned_up(serve):
    res, doc, took, pids = serve('["--mode", "hang"]', health_timeout=2)
    m = doc["tiers"]["server"]["modes"][0]
    assert res["exit_code"] == 1 and m["health"]["state"] == "timeout"
    assert 2 <= took < 25
    assert_all_gone(doc, pids)


def test_server_refuses_a_busy_port(tmp_path, patched_python, tokenizer_dir, bench_env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        pidfile = tmp_path / "pids.json"
        proj = tmp_path / "proj"
        (proj / "targets").mkdir(parents=True)
        (proj / "tests").mkdir()
        (proj / "targets" / "t.toml").write_text(
            server_profile(port, '["--mode", "fast"]', pidfile, patched_python, tokenizer_dir, bench_env))
        res = regress.run_regress("server", "t", str(tmp_path / "rep"), str(proj))
    assert res["exit_code"] == 1 and "already in use" in res["tiers"][0][3][0]
    assert not pidfile.exists()


def test_unknown_mode_and_bad_parity_pair_are_usage_errors(serve, tmp_path):
    with pytest.raises(SglpatchError, match="unknown mode"):
        serve(modes_sel="nope")
    with pytest.raises(SglpatchError, match="parity"):
        serve(extra='[[server.parity]]\nname = "x"\na = "no_spec"\nb = "missing"\n')


def test_cli_modes_and_parity_with_usage_errors_are_one_line(capsys, tmp_path):
    from sglpatch.cli import main as cli_main

    base = ["regress", "--tier", "server", "--profile", "rtx6000x8-kimi-k25", "--project", str(ROOT)]
    for extra, msg in ((["--modes", "nope"], "unknown mode"), (["--parity-with", str(tmp_path)], "no report.json")):
        rc = cli_main([*base, "--report-dir", str(tmp_path / "r"), *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("sglpatch: error:") and msg in err and "\n" not in err
