"""What every tier shares: the run plan and the tier face (`plan`), the target profiles (`profile`), managed
processes (`procs`), the report (`report`), plots (`plot`), which sglang an interpreter serves (`served`),
the GPU topology (`topology`), and the one window on the series side (`series_side`)."""
