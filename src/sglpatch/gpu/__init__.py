"""The GPU suite: `regress` (tiers cpu / kernel / server, report.json + report.md), its
profiles, process control and report (`profiles`, `procs`, `report`), the tiers (`tier_cpu`,
`kernel`, `server`), `kernel_bench` (runs alone under torchrun: only the standard library and
torch), `profile_report` (P4's JSONL) and `plot`.

It sees the series side only through `series_side` (which patches an installed workdir
carries), imported lazily, so the suite also runs on a GPU box without GitPython. Nothing here
imports `sglpatch.cli`.
"""
