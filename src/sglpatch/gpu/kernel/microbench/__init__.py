"""The parts of the allreduce worker `python -m sglpatch.gpu.kernel.bench` (run under torchrun).

Standard library and torch only at import time; every optional library (sglang, sgl_kernel,
flashinfer, mscclpp) is imported inside the backend that needs it, guarded, so a backend that
does not import is listed with its reason and never ends the run.

- `common`: the Backend contract, its set-up agreed on by every rank, exact integer inputs and
  references, the fused-norm check
- `backends`: NCCL (+ SGLang's separate add-RMSNorm), torch symmetric memory, SGLang's custom
  allreduce and MSCCL++, the self-test backends, the registry
- `fi_backends`: flashinfer: the trtllm fusion and the b12x PCIe kernels (one-shot, two-shot,
  fused add-RMSNorm)
- `pcie_ipc`: flashinfer's PCIe-IPC (`PcieIpcAllReduceWorkspace`) as P5 serves it, seed and tuned
- `measure`: latency samples (CUDA events / CUDA graphs; perf_counter on CPU under gloo)
- `hardware`: what the run measured on (GPUs, NCCL, versions of the interpreter's libraries)
- `stress`: --stress N, every result compared exactly with NCCL
"""
