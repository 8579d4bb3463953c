"""Tier server: the face (`tier`), one mode launched and benchmarked (`mode`), what a mode needs from the
install (`modes`), what a run left read back and written (`report`), which allreduce served (`evidence`),
and two installs compared (`ab`)."""
