"""A non-UTF-8 byte in what nvcc or nvidia-smi print (a vendor string in another code page, a
damaged install) is read with a replacement character: the doctor and `python -m
sglpatch.pythonenv.jit_kernels` (whose docstring promises it never raises) go on; issue 52 item 7."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sglpatch.pythonenv import preflight

VERSION = b"nvcc: NVIDIA (R) Cuda compiler driver\nBuilt by \xff\xfe build host\nCuda compilation tools, release 12.8, V12.8.93\n"


def _nvcc(tmp: Path) -> Path:
    home = tmp / "cuda"
    (home / "bin").mkdir(parents=True)
    out = tmp / "version.bin"
    out.write_bytes(VERSION)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\ncat {out}\n[ \"$1\" = --version ] && exit 0\nprintf 'error: \\377 no\\n' >&2; exit 1\n")
    nvcc.chmod(0o755)
    return home


def test_nvcc_version_with_a_stray_byte_is_read(tmp_path):
    assert preflight.nvcc_version(str(_nvcc(tmp_path) / "bin" / "nvcc")) == (12, 8)


def test_the_jit_check_alone_never_raises_on_it(tmp_path):
    home = _nvcc(tmp_path)
    r = subprocess.run([sys.executable, "-m", "sglpatch.pythonenv.jit_kernels", "--python", sys.executable], capture_output=True,
                       env={"PATH": f"{home / 'bin'}:/usr/bin:/bin", "CUDA_HOME": str(home), "HOME": str(tmp_path),
                            "SGLPATCH_CACHE": str(tmp_path / "cache")}, timeout=300, cwd="/")
    assert "Traceback" not in r.stderr.decode(errors="replace") and r.returncode in (0, 1, 125), r.stderr[-2000:]


def test_the_doctor_goes_on(tmp_path):
    home = _nvcc(tmp_path)
    r = subprocess.run([sys.executable, "-m", "sglpatch.gpu.doctor", "--python", sys.executable, "--no-p2p", "--no-jit",
                        "--nvidia-smi", "/nonexistent"], capture_output=True,
                       env={"PATH": f"{home / 'bin'}:/usr/bin:/bin", "CUDA_HOME": str(home), "HOME": str(tmp_path),
                            "SGLPATCH_CACHE": str(tmp_path / "cache")}, timeout=300, cwd="/")
    err = r.stderr.decode(errors="replace")
    assert "Traceback" not in err and r.returncode in (0, 1, 125), err[-2000:]
    assert b"12.8" in r.stdout, r.stdout[-2000:]
