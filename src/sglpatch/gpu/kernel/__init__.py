"""Tier kernel: the face and the launches (`tier`, `launch`), the report (`md`), the decision table (`decision`),
and the worker under torchrun (`bench`, `python -m sglpatch.gpu.kernel.bench`, with its parts in `microbench/`)."""
