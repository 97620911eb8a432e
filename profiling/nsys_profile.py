"""Profile training steps of the tiny model with Nsight Systems: NVTX phase ranges over CUDA activity.

Runs::

    nsys profile --trace=cuda,nvtx,osrt --capture-range=cudaProfilerApi --capture-range-end=stop \\
        --output OUT python -m canzona profile --cuda-capture [canzona profile options]

The workers call ``cudaProfilerStart`` before the first active step and ``cudaProfilerStop``
after the last (``canzona.profiling.run.CudaCaptureRange``), so the report holds exactly the
active steps; the ``canzona`` NVTX domain carries the phase names of ``canzona.runtime.phases``.
Open the report with ``nsys-ui OUT.nsys-rep`` or summarize it with ``nsys stats OUT.nsys-rep``.

Without ``nsys`` on PATH, without a CUDA device, or with fewer GPUs than ``dp * tp`` ranks (NCCL
needs one GPU per rank), it prints one line saying so and exits 1; it never pretends.

    .venv/bin/python profiling/nsys_profile.py --output runs/nsys/lb-asc -- --dp 2 --tp 2 --steps 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canzona.profiling.nsys import run_nsys, unavailable_reason


def _world(profile_args: list[str]) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--backend", default=None)
    known, _ = p.parse_known_args(profile_args)
    return known.dp * known.tp if known.backend != "gloo" else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="nsys profile of canzona training steps (NVTX + CUDA, capture range on the active steps)")
    p.add_argument("--output", default="runs/nsys/canzona", help="report path without extension (default: runs/nsys/canzona)")
    p.add_argument("--nsys", default="nsys", help="nsys executable (default: nsys on PATH)")
    p.add_argument("profile_args", nargs=argparse.REMAINDER, help="options for `canzona profile` after `--` (e.g. -- --steps 3 --strategy sc)")
    args = p.parse_args(argv)
    rest = list(args.profile_args[1:] if args.profile_args[:1] == ["--"] else args.profile_args)
    reason = unavailable_reason(nsys=args.nsys)
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    import torch

    need = _world(rest)
    if need > torch.cuda.device_count():
        print(f"nsys profiling unavailable: dp*tp = {need} NCCL ranks need {need} GPUs, this machine has {torch.cuda.device_count()}; "
              "nothing was profiled", file=sys.stderr)
        return 1
    return run_nsys(args.output, rest, nsys=args.nsys)


if __name__ == "__main__":
    sys.exit(main())
