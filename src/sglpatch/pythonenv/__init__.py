"""Python environments: what an interpreter is and has (`interpreter`), the user's pip configuration
(`pip_config`), a new venv for the pinned release (`new_venv`, checked first by `preflight`, with the
CUDA 12 builds of `cuda_builds`), the flashinfer set (`flashinfer_set`), installing the patched tree
(`install`) and building its JIT kernels in the serving Python (`jit_kernels`)."""
