"""Bisect: find the first bad patch of the stack with real ``git bisect run``.

    sglpatch bisect --workdir DIR [--good REF] [--bad REF] [--timeout SEC] [--triage] -- CMD [ARGS...]

How it works
* The workdir's ``sglang`` is installed editable (``pip install -e DIR/python``), so checking
  out a commit in DIR makes the imported sglang exactly that commit's tree. ``git bisect run``
  checks out each step; at every step it calls this package (``python -m sglpatch.bisect
  --step STATE``), which runs CMD, logs the step and hands git its verdict.
* CMD's exit status follows git's convention: 0 good, 125 skip, 1-127 bad. A CMD killed by a
  signal or exiting >= 128 (git would abort the bisect) counts as bad: a crash is a regression.
  A CMD that runs past ``--timeout`` has its whole process group killed and counts as bad (a
  hang is a regression) or, with ``--on-timeout skip``, as untestable.
* ``--triage`` first runs CMD on GOOD (pristine upstream) and BAD (the full stack): "regression
  is upstream", "no regression", or "regression is in the series" and then bisects, reusing the
  two results as git's endpoints (``git bisect start BAD GOOD``), so for n patches CMD runs at
  most ceil(log2(n+1)) + 2 times in all; skips can only stop the search early, never exceed it.
* CMD runs in the user's working directory with the user's environment plus
  ``SGLPATCH_BISECT_COMMIT`` (the commit under test) and ``SGLPATCH_BISECT_PATCH`` (the series
  name of the topmost patch in it, or ``upstream``), in its own process group, stdin closed; its
  stdout/stderr are shown live and kept in one log file per step.
* Whatever happens (CMD hangs, Ctrl-C, SIGTERM, SIGHUP, an error) DIR ends back on branch
  ``patched``, clean, with no bisect in progress.

The package's rooms: ``model`` (git bisect run's protocol numbers, the branch names, the records:
PatchRef, Step, BisectResult), ``command`` (running CMD once: its own process group, descendants
recorded and ended, output teed to a log per step), ``step`` (the step runner ``git bisect run``
re-enters: ``python -m sglpatch.bisect --step STATE``, see ``__main__``), ``driver`` (``run``: the
guards, the triage, ``git bisect run`` in a thread, the restore whatever happens) and ``report``
(``format_report`` and the files written to the log folder).
"""
