"""The fixtures of the failure-mode cases (defined in world.py and faults.py, each session one built
once per run: world.once), and the venv tests' ``env``."""

from failure_modes.faults import index  # noqa: F401
from failure_modes.world import case, fresh, golden, rb_after, rb_conflict, rb_golden  # noqa: F401
from test_venv_preflight import env  # noqa: F401
