"""The GPU suite, as its tiers, with `regress` on top choosing them.

- `regress`: the flags, the profile and the Python(s) under test resolved once into one
  `shared.plan.RunPlan`; each tier asked in turn through its face (`check`, `run`, `report`);
  report.json + report.md.
- `cpu/`: the patch tests against the installed, patched sglang.
- `kernel/`: allreduce latency and correctness per backend and install (`tier`, `launch`, `md`,
  `decision`), and its worker under torchrun (`bench`, with its parts in `microbench/`: only the
  standard library, torch and this package).
- `server/`: the patched server mode by mode (`tier`, `mode`, `modes`, `report`, `evidence`),
  and `--ab` (`ab`).
- `doctor/`: `sglpatch doctor`, and the gate before a server-tier load.
- `shared/`: what every tier uses: the plan and the face (`plan`), the target profiles
  (`profile`), managed processes (`procs`), the report (`report`), plots (`plot`), which sglang
  an interpreter serves (`served`), the GPU topology (`topology`), and `series_side`.

It sees the series side only through `shared.series_side` (which patches an installed workdir
carries), imported lazily, so the suite also runs on a GPU box without GitPython. Nothing here
imports `sglpatch.cli`. P4's verify-cycle report is `sglpatch.gpu.profile_report` (any machine).
"""
