"""The command-line options of the GPU suite's two commands, `sglpatch doctor` and `sglpatch regress`
(also `python -m sglpatch.gpu.doctor` / `.regress`), and their descriptions: apart from the code that
runs them, so that building the CLI's parser imports none of it."""

from __future__ import annotations

import argparse

from sglpatch.argtypes import deprecated, positive, python_path, python_paths

TIERS = ("cpu", "kernel", "server")

DOCTOR_DESCRIPTION = ("Check the box before a load: stale GPU processes, the serving Python and what it sees, driver and "
                      "toolkits, topology and a real P2P copy per GPU pair, free GPU memory. Exit 0: nothing failed; 1: a "
                      "check failed; 125: no GPU visible here (checks that failed are listed); 2: a usage error.")


def doctor_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `sglpatch doctor` (also `python -m sglpatch.gpu.doctor`)."""
    p.add_argument("--python", type=python_path, help="the interpreter that serves (default: the profile's [server] python, else this one)")
    p.add_argument("--profile", help="targets/NAME.toml or NAME: its [env], [server] and [model] are compared")
    p.add_argument("--project", help="the sglpatch checkout (series, targets/; default: found from cwd)")
    p.add_argument("--json", metavar="FILE", help="also write every check as JSON to FILE ('-': standard output, after the lines)")
    p.add_argument("--kill-stale", action="store_true", help="end the stale SGLang / torch workers (parent gone, "
                   "holding a GPU) first: process group, then PID; asks unless --yes")
    p.add_argument("--yes", action="store_true", help="with --kill-stale: do not ask")
    p.add_argument("--kernel-report", metavar="DIR", help="a kernel-tier report folder: its measured decision is cited")
    p.add_argument("--nvidia-smi", metavar="PATH", help="the nvidia-smi to run (default: the one on PATH)")
    p.add_argument("--no-p2p", action="store_true", help="skip the P2P copy test")
    p.add_argument("--no-jit", action="store_true", help="skip building the JIT kernels that include flashinfer headers "
                   "(not built anyway where no GPU is visible: the doctor exits 125 there)")
    p.add_argument("--recheck-jit", action="store_true", help="build them again, not the verdict kept for this tree, flashinfer, "
                   "nvcc and arch (also SGLPATCH_RECHECK_JIT=1, e.g. for regress --tier server's doctor)")
    p.add_argument("--p2p-timeout", type=positive, default=20.0, metavar="SEC", help="deadline per GPU pair, in seconds")
    p.add_argument("--dev-glob", default="/dev/nvidia*", help=argparse.SUPPRESS)
    p.add_argument("--proc-root", default="/proc", help=argparse.SUPPRESS)
    p.add_argument("--shm", default="/dev/shm", help=argparse.SUPPRESS)
    p.add_argument("--p2p-probe", help=argparse.SUPPRESS)  # default: the doctor's own p2p_probe.py
    p.add_argument("--reapers", default="0,1", help=argparse.SUPPRESS)


REGRESS_DESCRIPTION = ("Run the patch tests (cpu), the allreduce kernels (kernel, >= 2 GPUs) or the patched server (server) "
                       "against the installed sglang; report.json + report.md. Exit 0 when every tier that ran passed, "
                       "1 on a regression, 125 when the tier cannot run here (git bisect run skips).")


def _stress_count(text: str) -> int:
    n = int(text) if text.isdigit() else 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"--stress wants a positive number of iterations, not {text!r}")
    return n


def regress_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `sglpatch regress` (also `python -m sglpatch.gpu.regress` on a GPU box)."""
    p.add_argument(
        "--tier",
        choices=[*TIERS, "all"],
        default="all",
        help="cpu: the patch tests on the installed sglang; kernel: allreduce latency and correctness (>= 2 GPUs); "
        "server: the patched server's tok/s against the baseline; all: each in turn",
    )
    p.add_argument("--profile", help="targets/NAME.toml, or NAME of a file in targets/ (e.g. rtx6000x8-kimi-k25)")
    p.add_argument("--report-dir", metavar="DIR", help="where the report folder goes (default: ./regress-<UTC time>)")
    deprecated(p, "--report", "--report-dir", dest="report_dir", metavar="DIR")
    p.add_argument("--baseline", help="a previous report.json to compare kernel latencies with (same hardware only)")
    p.add_argument("--project", help="the sglpatch checkout holding targets/ and tests/ (default: found from cwd)")
    p.add_argument("--python", type=python_paths, metavar="PATH",
                   help="the Python under test, every tier (default: cpu tier: the one `apply` installed the workdir "
                   "into, else the profile's; kernel/server: the profile's); A,B is the old spelling of --ab A,B (warned)")
    p.add_argument("--workdir", help="the workdir whose recorded install the cpu tier uses (default: $SGLANG_FORK_DIR or ~/sglang-fork)")
    p.add_argument("--stress", type=_stress_count, nargs="?", const=-1, default=None, metavar="N",
                   help="tier kernel also runs N allreduces per non-NCCL backend and mode, each compared exactly "
                   "with NCCL (N omitted: the profile's [kernel] stress_iterations, 1000000 on the target)")
    p.add_argument("--quick", action="store_true",
                   help="kernel tier: the decision sizes only (batch, batch x draft tokens), few samples: a smoke run")
    p.add_argument("--with-profile", metavar="REPORT",
                   help="kernel tier: project from a server-tier report's measured step and P4 draft/verify/extend ms "
                   "instead of the profile's [kernel.decision] numbers")
    p.add_argument("--modes", help="server tier: run these [[server.modes]] (comma-separated, or 'all'); "
                   "default: every mode not marked optional")
    p.add_argument("--parity-with", metavar="REPORT_DIR",
                   help="server tier: greedy outputs of each mode must equal those of the same mode in REPORT_DIR")
    p.add_argument("--ab", type=python_paths, metavar="A_PYTHON,B_PYTHON",
                   help="compare two installs (e.g. the 0.5.9 and the 0.5.23 venv), the one spelling on every tier "
                   "that compares: kernel tier: the bench runs in each interpreter and the rows merge, each labelled "
                   "with its versions; server tier: the same modes, profile and prompts with A's, then B's "
                   "interpreter, side by side with B/A ratios (each side gated as usual; the comparison only "
                   "reports); the cpu tier tests one install (--python)")
    p.add_argument("--no-doctor", action="store_true",
                   help="server tier: do not run `sglpatch doctor` first (by default a failed check refuses the load)")
