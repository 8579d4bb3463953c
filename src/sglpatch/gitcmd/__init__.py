"""The only place that runs git: fixed flags, validated refs and URLs.

Everyone constructs :class:`Git` (git in one directory) and imports the names below from
here; the parts, after StGit's typed git layer (stgit/lib/git), each own one concern:

* runner: the fixed flags, environment, identity and dates; run(), the object model (repo),
  GitError and last_line; nothing else builds a git command line or environment;
* refs: rev, current_branch, head_commit, update_ref, config_get/config_set;
* objects: cat, tree_of, blob_text, blob_id, commits, subject, commit_tree;
* worktree: is_repo, dirty_files, temp_index (the checkout and the index);
* validate: validate_ref, validate_sha, validate_url (before any git runs);
* patchpaths: patch_paths, read_together (the files a patch writes and reads, as git apply
  reads them; read_together for a whole series at once).
"""

from __future__ import annotations

from sglpatch.gitcmd.objects import Objects
from sglpatch.gitcmd.patchpaths import patch_paths, read_together
from sglpatch.gitcmd.refs import Refs
from sglpatch.gitcmd.runner import FIXED_DATE, IDENTITY_EMAIL, IDENTITY_NAME, GitError, Runner, last_line
from sglpatch.gitcmd.validate import validate_ref, validate_sha, validate_url
from sglpatch.gitcmd.worktree import Worktree

__all__ = [
    "FIXED_DATE",
    "IDENTITY_EMAIL",
    "IDENTITY_NAME",
    "Git",
    "GitError",
    "Runner",
    "last_line",
    "patch_paths",
    "read_together",
    "validate_ref",
    "validate_sha",
    "validate_url",
]


class Git(Refs, Objects, Worktree):
    """git in one directory, with the fixed flags (runner): refs, objects, worktree and index."""
