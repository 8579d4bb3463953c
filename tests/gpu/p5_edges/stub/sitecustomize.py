"""On the GPU machine only: import flashinfer's PCIe-IPC kit without flashinfer/__init__.py (it
imports cutlass-dsl, not on the device), in every process the tuning step spawns too. Active only
when FLASHINFER_KIT names the kit (results/p5-mps-h200/mk-flashinfer-pcie-kit.sh)."""
import os
import sys
import types

_kit = os.environ.get("FLASHINFER_KIT")
if _kit:
    _site = os.path.join(_kit, "site")
    sys.path.insert(0, _site)
    for _name, _path in (("flashinfer", "flashinfer"), ("flashinfer.comm", "flashinfer/comm")):
        _m = types.ModuleType(_name)
        _m.__path__ = [os.path.join(_site, _path)]
        sys.modules[_name] = _m
