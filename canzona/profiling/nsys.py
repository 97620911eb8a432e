"""Nsight Systems (``nsys``) profiling of training steps: NVTX phase ranges over CUDA activity.

The phases of :mod:`canzona.runtime.phases` are NVTX ranges (domain ``canzona``) whenever the
``nvtx`` package is present, so an ``nsys`` timeline shows the paper's iteration anatomy (bucket
reduce-scatters in backward, micro-group gather / compute / scatter / apply in the optimizer step)
above the CUDA kernels and NCCL calls. Only the profiled steps are captured: the command runs under
``--capture-range=cudaProfilerApi`` and the training workers call ``cudaProfilerStart`` /
``cudaProfilerStop`` around the active steps (:class:`canzona.profiling.run.CudaCaptureRange`).

Nothing here pretends: without ``nsys`` on ``PATH`` or without a CUDA device,
:func:`unavailable_reason` says which one is missing and the script exits non-zero.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["NSYS_TRACE", "nsys_command", "run_nsys", "unavailable_reason"]

#: what nsys records: CUDA API and kernels, NVTX ranges, OS runtime calls (waits, locks)
NSYS_TRACE = "cuda,nvtx,osrt"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def unavailable_reason(*, nsys: str = "nsys") -> str | None:
    """None when ``nsys`` is on PATH and a CUDA device is visible, else one line saying what is missing."""
    if shutil.which(nsys) is None:
        return f"nsys profiling unavailable: '{nsys}' is not on PATH (install NVIDIA Nsight Systems); nothing was profiled"
    if not _cuda_available():
        return "nsys profiling unavailable: no CUDA device (torch.cuda.is_available() is False); nothing was profiled"
    return None


def nsys_command(
    output: str | Path,
    profile_args: Sequence[str],
    *,
    nsys: str = "nsys",
    python: str | None = None,
) -> list[str]:
    """The ``nsys profile`` command line around ``canzona profile --cuda-capture <profile_args>``.

    ``output`` is the report path without extension (nsys adds ``.nsys-rep``). Child processes
    (one per rank) are followed by nsys by default; capture starts at the first
    ``cudaProfilerStart`` and ends at ``cudaProfilerStop``.
    """
    return [
        nsys,
        "profile",
        f"--trace={NSYS_TRACE}",
        "--capture-range=cudaProfilerApi",
        "--capture-range-end=stop",
        "--force-overwrite=true",
        "--output",
        str(output),
        python or sys.executable,
        "-m",
        "canzona",
        "profile",
        "--cuda-capture",
        *profile_args,
    ]


def run_nsys(output: str | Path, profile_args: Sequence[str], *, nsys: str = "nsys") -> int:
    """Check availability, then run :func:`nsys_command`; returns its exit code. When nsys or CUDA
    is missing, prints the reason on stderr and returns 1 without running anything."""
    reason = unavailable_reason(nsys=nsys)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    cmd = nsys_command(output, profile_args, nsys=nsys)
    print("+ " + " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)
