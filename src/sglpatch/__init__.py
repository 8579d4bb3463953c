"""sglpatch: maintain SGLang as a tested, rebasable patch series."""

__version__ = "0.1.0"
