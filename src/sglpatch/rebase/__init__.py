"""Move the series onto a new upstream release: classify, 3-way, stop resumably, record.

    sglpatch rebase --workdir DIR --onto 0.5.10.post1 [--source sdist|git] [--dry-run]
    sglpatch rebase --workdir DIR --continue | --skip | --abort

Every patch is classified on the new upstream (in series order, each on top of the ones
kept before it):

* ``upstream``  the change is already in the new tree, verified (never on the DEP-3
  ``Applied-Upstream`` hint alone): the patch reverse-applies, or its 3-way result equals
  the tree, or every definition it adds or changes exists there with the same behaviour
  (normalized AST, or the same calls/returns/exceptions when run against recording
  stand-ins, following the class's own helpers) and it changes nothing else;
* ``exact``     applies with no offset and no fuzz;
* ``3way``      applies with a 3-way merge against the old stack (offsets, moved code);
* ``conflict``  the 3-way merge leaves conflicts;
* ``obsolete``  every file it modifies is gone from the new tree (no longer needed).

Recorded resolutions live in the project, ``resolutions/<version>/``::

    resolutions.toml   [patch."NAME"] action = "replace" | "drop", why = "...",
                       patch_sha256 = sha256 of the series patch this resolves,
                       conflict = the conflict it resolves (see below)
    NAME               for "replace": the patch as it applies to the new upstream
    target.toml        optional recorded pin: tag, commit, sdist_sha256

A recorded resolution is keyed by the conflict it resolves (``conflict``: files and both sides
of every conflict region, hashed, like git rerere): any release that shows the same conflict gets
it offered and merge-checked before use; another conflict refuses it (a record without a key is
used only for the exact patch bytes, ``patch_sha256``, it was made for). Patches resolved by
hand during a rebase (``--continue``) or dropped (``--skip``) are recorded there on success, with
the key of the conflict they resolve (a "3-way but broken" stop has no conflict: its record is
keyed by ``patch_sha256`` only), so the next person replays the same rebase with one command.

A real rebase builds the new stack off to the side; on a conflict it puts DIR on a detached
HEAD at the new stack so far, applies the patch with ``git apply --3way`` (markers in place)
and saves its state in ``DIR/.git/sglpatch-rebase/``. ``--abort`` restores DIR's refs, HEAD
and files and the project's files exactly. Only the finishing step writes the project:
patches/ + series (export), upstream.lock, CHANGELOG.md, the report under
``rebase-reports/`` (outcomes and per-patch ``git range-diff``).

Modules, in the order a rebase uses them: ``outcome`` (the words: a patch's status and action,
the Outcome and its table; exit codes, names), ``target`` (the ``--onto`` pin), ``merge`` (git
helpers: fixed commits, 3-way), ``mergecheck`` (is a clean merge working?), ``upstreamed`` (is the
change already there?), ``resolutions`` (recorded, conflict-keyed), ``plan`` (preparing the plan:
old stack, target, new upstream), ``classify`` (the engine, the dry run), ``state`` (what
DIR/.git/sglpatch-rebase/ holds), ``session`` (a real rebase: stop, continue, abort, finish), ``finish_report``
(the CHANGELOG section and the range-diff a finished rebase writes).
Outside the package: ``sglpatch.rebase_plan_file`` (the saved plan's fields and format, its reader,
RebaseError) and ``sglpatch.workdir`` (the state's place and names, the "rebase in progress"
check), which the stack commands read without running the rebase.
"""
