"""Tier cpu: the patch tests (tests/patches) against the installed, patched sglang (`tier`)."""
