"""The GPU suite: `regress` (tiers cpu / kernel / server, report.json + report.md), its
profiles, process control and report (`profiles`, `procs`, `report`), the tiers (`tier_cpu`,
`kernel` with `kernel_launch`, `kernel_md`, `decision` and `topology`; `server`, the run, with
`server_report`, what it left read back and written, `served`, which sglang an interpreter
imports, and `mode_requires`), `kernel_bench` (the worker under torchrun, with its parts in
`kbench`: only the standard library, torch and this package), `profile_report` (P4's JSONL)
and `plot`.

It sees the series side only through `series_side` (which patches an installed workdir
carries), imported lazily, so the suite also runs on a GPU box without GitPython. Nothing here
imports `sglpatch.cli`.
"""
