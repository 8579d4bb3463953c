"""Tier server: the patched SGLang server, measured mode by mode (server/mode.py) with SGLang's own
`bench_serving`, against the profile's baseline.

check: the modes asked for, the prompts, `--parity-with`, the doctor before the load, and what
each mode needs from the install (server/modes.py); run: each mode in turn; report: bench_serving's
JSONL (never its stdout) with SGLang's metrics by their names plus the derived single-stream
tok/s = 1000 / median TPOT, which is what the profile's baseline (82 tok/s) is compared with;
what served (`/get_server_info`, the patches the imported sglang carries, the env); and output
parity between pairs of modes (`[[server.parity]]`) or against an earlier report
(`--parity-with`): greedy outputs that differ, or EAGLE-3 accept lengths beyond their tolerance,
fail the tier and the first difference is shown (server/parity.py).  `--ab A,B` runs this tier
once per install (server/ab.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sglpatch.gpu.doctor.run import gate_server
from sglpatch.gpu.server.mode import run_server_mode, write_prompts
from sglpatch.gpu.server.modes import split
from sglpatch.gpu.server.parity import parity_checks, parity_markdown, tier_summary
from sglpatch.gpu.server.report import mode_table, num_requests, tier_markdown, token_differ
from sglpatch.gpu.shared.plan import Tier
from sglpatch.gpu.shared.profile import expand, usage_error
from sglpatch.gpu.shared.report import TierResult
from sglpatch.gpu.shared.served import imported_sglang, pcie_ipc_server, version_tuple

def version_env(srv: dict, version: str | None) -> tuple[dict, list[str]]:
    """The env [[server.version_env]] adds for this sglang version, and why (one line per rule)."""
    env, why = {}, []
    have = version_tuple(version)
    if not have:
        return env, why
    for rule in srv.get("version_env", []):
        lo, hi = version_tuple(rule["min_version"]), version_tuple(rule.get("max_version"))
        if have >= lo and (not hi or have < hi):
            env.update({k: str(v) for k, v in rule["env"].items()})
            why.append(f"sglang {version} >= {rule['min_version']}"
                       + (f" and < {rule['max_version']}" if hi else "") + f": {rule['env']}"
                       + (f" ({rule['why']})" if rule.get("why") else ""))
    return env, why


# =========================================================================== the tier


def select_modes(srv: dict, modes: str | None) -> list[dict]:
    if not modes:
        return [m for m in srv["modes"] if not m.get("optional")]
    names = [x.strip() for x in modes.split(",") if x.strip()]
    if names == ["all"]:
        return list(srv["modes"])
    known = {m["name"]: m for m in srv["modes"]}
    bad = [n for n in names if n not in known]
    if bad:
        raise usage_error(f"--modes: unknown mode(s) {bad}; the profile has {sorted(known)}")
    return [known[n] for n in names]


class ServerTier(Tier):
    """One install's server tier. side_env: the env of one side of an A/B run (server/ab.py), over
    [server.env] and the version rules, under each mode's env."""

    name = "server"

    def __init__(self, plan, side_env: dict | None = None):
        super().__init__(plan)
        self.side_env = side_env

    def check(self) -> bool:
        plan = self.plan
        srv = self.srv = plan.profile.get("server")
        if not srv:
            return self.cannot_run(f"profile {plan.profile.get('_path') or '(none)'} has no [server] section")
        self.selected = select_modes(srv, plan.modes)
        self.old = None
        if plan.parity_with:
            old_path = Path(plan.parity_with) / "report.json"
            if not old_path.is_file():
                raise usage_error(f"--parity-with {plan.parity_with}: no report.json there")
            self.old = json.loads(old_path.read_text())
        bench = srv["benchmark"]
        if num_requests(bench) > len(bench["prompts"]) or num_requests(bench) < 1:
            raise usage_error(f"[server.benchmark] num_requests = {num_requests(bench)} needs as many distinct "
                              f"prompts (has {len(bench['prompts'])}); repeated prompts would hit the radix cache")
        self.python = expand(srv["python"] or sys.executable)
        if plan.doctor:
            refused = gate_server(plan.profile, self.python, plan.project, plan.report_dir,
                                  {**plan.base_env, **srv.get("env", {})})
            if refused is not None:
                self.result = refused
                return False
        return True

    def run(self) -> None:
        plan, tr, srv, python = self.plan, self.result, self.srv, self.python
        report_dir, base_env, bench = plan.report_dir, plan.base_env, srv["benchmark"]
        prompts_file = report_dir / "bench-prompts.jsonl"
        self.digest = write_prompts(prompts_file, bench["prompts"])
        tr.data["prompts"] = {"file": prompts_file.name, "sha": self.digest, "count": len(bench["prompts"])}
        tr.data["profile_env"] = plan.profile.get("env", {})
        tr.data["served_by"] = imported_sglang(python, base_env, plan.project)
        venv, why = version_env(srv, tr.data["served_by"].get("sglang_version"))
        side_env = self.side_env
        if venv or side_env:
            srv = self.srv = {**srv, "env": {**srv.get("env", {}), **venv,
                                             **{k: str(v) for k, v in (side_env or {}).items()}}}
        tr.data["version_env"] = why
        tr.data["side_env"] = side_env or {}
        # a mode's requires_import / min_sglang, before any load
        self.selected, tr.data["skipped_modes"] = split(self.selected, python, base_env,
                                                        tr.data["served_by"].get("sglang_version"),
                                                        tr.data["served_by"])
        if not self.selected:
            self.cannot_run("; ".join(f"{m['mode']}: {m['why']}" for m in tr.data["skipped_modes"]))
            return
        ipc_by = pcie_ipc_server(tr.data["served_by"])
        tr.data["modes"] = [run_server_mode(srv, mode, report_dir, base_env, python, prompts_file, ipc_by)
                            for mode in self.selected]

    def report(self) -> TierResult:
        tr, srv = self.result, self.srv
        if "modes" not in tr.data:
            return tr
        results = tr.data["modes"]
        tr.md = mode_table(tr, srv, self.selected, results)
        bench, plan = srv["benchmark"], self.plan
        first_token = token_differ(self.python, expand(bench.get("tokenizer") or srv["model_path"]), plan.base_env)
        tr.data["parity"] = parity_checks(tr, srv, plan.report_dir, results, self.old, plan.parity_with, self.digest,
                                          first_token)
        tr.md += tier_markdown(srv, tr.data, parity_markdown(tr.data["parity"]))
        if tr.status != "fail":
            tr.status = "pass"
        tr.summary = tier_summary(results, tr.data["parity"])
        return tr
