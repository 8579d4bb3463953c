"""Stand-in for Hugging Face `datasets`, for the server-tier tests only.

`sglang.bench_serving` (0.5.9) imports `datasets.load_dataset` at module level but calls it only
for the `mmmu` dataset; the tier uses the offline `custom` dataset.  The test venv does not carry
`datasets` (it would pull pyarrow/pandas and a huggingface_hub that transformers 4.57 refuses), so
the tests put this folder on the benchmark's PYTHONPATH when the interpreter lacks the real one.
"""


def load_dataset(*args, **kwargs):
    raise RuntimeError("tests/shims/datasets: the real `datasets` package is not installed here")
