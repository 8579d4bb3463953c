"""Stand-in for flashinfer-python 0.7.2 (tests only; see ../README.md)."""

__version__ = "0.7.2"
