"""Stand-in for flashinfer.comm 0.7.2: only PcieIpcAllReduceWorkspace (tests only; see ../../README.md)."""

from .pcie_ipc_ar import PcieIpcAllReduceWorkspace as PcieIpcAllReduceWorkspace  # noqa: F401
