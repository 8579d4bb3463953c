"""Regression profiles (targets/*.toml): defaults, loading and checking, the project folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from sglpatch import exitcodes
from sglpatch.errors import SglpatchError

try:
    import tomllib
except ModuleNotFoundError:  # python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULT_SIZES = [1, 2, 3, 4, 8, 16, 64, 512, 2048]
EXIT_USAGE = exitcodes.USAGE


def usage_error(msg: str) -> SglpatchError:
    """A user error (bad profile, bad flag): exit 2, so bisect does not read it as a regression."""
    return SglpatchError(msg, exit_code=EXIT_USAGE)


DEFAULTS: dict = {
    # cuda_arch: TVM_FFI_CUDA_ARCH_LIST for the doctor's JIT build check (sglpatch.pythonenv.jit_kernels; None: 12.0)
    "target": {"name": "local", "description": "", "gpu_name": None, "gpus": None, "nvlink": None, "cuda_arch": None},
    "env": {},
    "cpu": {"python": None, "pytest_python": None, "tests": "tests/patches", "import_check": "sglang", "timeout_s": 1800,
            "pytest_args": []},
    "kernel": {"python": None, "world_size": None, "sizes": DEFAULT_SIZES, "hidden": 7168,
               "backends": ["nccl", "symm_mem", "custom_ar", "flashinfer_fused"],
               "p2p_disabled_run": True, "required_backends": ["nccl"], "samples": 50, "inner": 10,
               "timeout_s": 420, "tolerance": 0.15, "abs_floor_us": 2.0, "baseline": None,
               "env": {}, "device": "cuda",
               # PCIe-IPC as P5 serves it (kernel/pcie_tune.py): the server's buckets (None: one row
               # count, pcie_ipc_max_rows); the tuned leg against seed only when asked; clocks it pins
               "pcie_ipc_rows": None, "pcie_ipc_tune": False, "pin_clocks_mhz": None,
               # --stress [N]: N iterations per backend and mode (N omitted: stress_iterations)
               "stress_iterations": 10000, "stress_backends": ["custom_ar", "symm_mem"],
               "stress_required": [], "stress_sizes": [1, 2, 3, 4, 8, 16], "stress_modes": ["eager", "graph"],
               "stress_step_timeout_s": 120, "stress_timeout_s": 0,
               # every backend's op captured in a CUDA graph, replayed back to back, each replay compared
               # with NCCL (kernel/microbench/replay.py); 0: off; sizes None: stress_sizes
               "replay_iterations": 64, "replay_sizes": None},
    "server": None,
    # the served model's size, for `sglpatch doctor`'s free-memory check: each GPU needs
    # weights_gib / [server] tp + margin_gib free before a load
    "model": {"weights_gib": None, "margin_gib": 6.0},
}
SERVER_DEFAULTS: dict = {
    "python": None, "host": "127.0.0.1", "port": 30000, "tp": 1, "model_path": "", "seed": 1234,
    "command": ["{python}", "-m", "sglang.launch_server", "--model-path", "{model_path}",
                "--tp", "{tp}", "--host", "{host}", "--port", "{port}", "--random-seed", "{seed}"],
    "launch_args": [], "health_timeout_s": 3600, "stop_grace_s": 30,
    "poll_s": 2.0, "env": {},
    # measured with `python -m sglang.bench_serving` (see gpu.server.bench_command);
    # num_requests None = one request per prompt (prompts are distinct: no radix-cache hits)
    "benchmark": {"num_requests": None, "warmup_requests": 1, "max_new_tokens": 256, "tokenizer": None,
                  "apply_chat_template": True, "timeout_s": 1800, "env": {}, "extra_args": [],
                  "prompts": ["Write a detailed explanation of how a transformer language model "
                              "generates text, step by step."]},
    "baselines": {"no_spec_tok_s": None, "tolerance": 0.05},
    "modes": [{"name": "no_spec", "args": [], "env": {}, "gate": True}],
    # [{name, a, b, backends?, accept_tolerance?}]: modes whose greedy outputs must be identical (and,
    # speculating, their accept lengths within a tolerance); backends: the kernel-tier backends b serves
    "parity": [],
    # [{min_version, max_version?, env, why?}]: env added to [server.env] when the served sglang's
    # version is in [min_version, max_version) (e.g. PCIe-IPC allreduce on from 0.5.21)
    "version_env": [],
    # --ab A_PY,B_PY: env added per side ([server.ab.a.env], [server.ab.b.env])
    "ab": {"a": {"env": {}}, "b": {"env": {}}},
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def find_project_root(start: Path | None = None) -> Path:
    """The sglpatch checkout holding targets/ and tests/, walking up from cwd; outside one,
    a one-line error (never the folder an editable install happens to point at)."""
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "targets").is_dir() and (d / "tests").is_dir():
            return d
    raise usage_error(f"no sglpatch project here ({here}): run from the sglpatch checkout or pass --project DIR")


def resolve_profile_path(name: str, project: Path) -> Path:
    p = Path(name).expanduser()
    if p.is_file():
        return p
    cand = project / "targets" / (name if name.endswith(".toml") else f"{name}.toml")
    if cand.is_file():
        return cand
    known = sorted(x.stem for x in (project / "targets").glob("*.toml")) if (project / "targets").is_dir() else []
    raise usage_error(f"profile {name!r} not found (looked at {p} and {cand}); known: {', '.join(known) or 'none'}")


def load_profile(path: Path | None) -> dict:
    prof = json.loads(json.dumps(DEFAULTS))
    if path is None:
        prof["_path"] = None
        return prof
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise usage_error(f"cannot read profile {path}: {e}") from None
    unknown = set(data) - set(DEFAULTS)
    if unknown:
        raise usage_error(f"profile {path}: unknown section(s) {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    prof = _merge(prof, {k: v for k, v in data.items() if k != "server"})
    if "server" in data:
        srv = _merge(json.loads(json.dumps(SERVER_DEFAULTS)), data["server"])
        for i, m in enumerate(srv["modes"]):
            if "name" not in m:
                raise usage_error(f"profile {path}: server.modes[{i}] has no name")
            m.setdefault("args", [])
            m.setdefault("env", {})
            m.setdefault("gate", True)
        names = [m["name"] for m in srv["modes"]]
        for i, pair in enumerate(srv["parity"]):
            if not all(k in pair for k in ("name", "a", "b")) or pair["a"] not in names or pair["b"] not in names:
                raise usage_error(f"profile {path}: server.parity[{i}] needs name, a and b naming modes {names}")
            tol, bk = pair.get("accept_tolerance"), pair.get("backends", [])
            if tol is not None and (isinstance(tol, bool) or not isinstance(tol, (int, float)) or tol <= 0):
                raise usage_error(f"profile {path}: server.parity[{i}] accept_tolerance must be a positive number")
            if not isinstance(bk, list) or not all(isinstance(x, str) for x in bk):
                raise usage_error(f"profile {path}: server.parity[{i}] backends must be a list of kernel-tier backend names")
        for i, rule in enumerate(srv["version_env"]):
            if not isinstance(rule, dict) or "min_version" not in rule or not isinstance(rule.get("env"), dict):
                raise usage_error(f"profile {path}: server.version_env[{i}] needs min_version and an env table")
        if set(srv["ab"]) - {"a", "b"}:
            raise usage_error(f"profile {path}: [server.ab] has only the sides a and b, not {sorted(set(srv['ab']) - {'a', 'b'})}")
        prof["server"] = srv
    for sec in ("env",):
        bad = {k: v for k, v in prof[sec].items() if not isinstance(v, (str, int, float))}
        if bad:
            raise usage_error(f"profile {path}: [{sec}] values must be strings or numbers: {sorted(bad)}")
    prof["_path"] = str(path)
    return prof


def expand(v):
    return os.path.expanduser(str(v))
