"""Stand-in for flashinfer.comm.pcie_ipc_tuning 0.7.2: where tuned configurations are persisted."""

import os
import pathlib


def default_cache_path(world_size: int) -> str:
    override = os.getenv("FLASHINFER_AUTOTUNE_DIR")
    base = pathlib.Path(override) if override else pathlib.Path.home() / ".cache" / "flashinfer" / "autotune"
    return str(base / f"pcie_ipc_all_reduce_ws{world_size}.json")
