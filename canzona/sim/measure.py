"""Measure matrix-optimizer step times per shape, for :func:`canzona.sim.hardware.calibrate`.

Run this on the GPU the profile describes; the CSV it writes (``optimizer,m,n,dtype,seconds``)
replaces the profile's assumed ``ns_efficiency_*`` constants with fitted ones:

    python -m canzona.sim.measure --out ns.csv                 # Qwen3-32B shapes, Muon bf16
    canzona simulate --hardware h200-ib400 --calibration ns.csv

One row is the median wall time of one ``step()`` of a single-parameter optimizer (canzona's
Muon / Shampoo / SOAP) on an ``m x n`` float32 parameter, after warm-up, with the device
synchronized around each step. That is the work a DP owner or TP host does per matrix.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from canzona.fileio import atomic_write
from canzona.optimizers import get_optimizer, optimizer_names

__all__ = ["QWEN3_32B_SHAPES", "measure_matrix_timings", "write_timings_csv", "main"]

#: the full matrix shapes a Qwen3-32B host updates at TP=8 (Megatron layout), plus the KV size
QWEN3_32B_SHAPES: tuple[tuple[int, int], ...] = ((10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600), (1024, 5120))


def _optimizer(name: str, param, dtype: str):
    import torch

    cls = get_optimizer(name).load()
    if name == "muon":  # the one optimizer whose Newton-Schulz iterations run in a chosen dtype
        ns = {"bf16": torch.bfloat16, "fp32": torch.float32, "tf32": torch.float32}[dtype]
        return cls([param], ns_dtype=ns)
    if dtype != "fp32":
        raise ValueError(f"{name} runs in fp32 here; dtype must be fp32")
    return cls([param])


def measure_matrix_timings(
    shapes: Iterable[Sequence[int]],
    *,
    optimizer: str = "muon",
    dtype: str = "bf16",
    device: str = "cuda",
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> list[tuple[str, int, int, str, float]]:
    """Median seconds of one optimizer step per shape, as calibration rows."""
    import torch

    if optimizer not in optimizer_names(matrix=True):
        raise ValueError(f"optimizer must be one of {', '.join(optimizer_names(matrix=True))}, got {optimizer!r}")
    if dtype not in ("bf16", "tf32", "fp32"):
        raise ValueError(f"dtype must be bf16, tf32 or fp32, got {dtype!r}")
    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be >= 1 and warmup >= 0")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows = []
    try:
        for shape in shapes:
            m, n = (int(x) for x in shape)
            p = torch.nn.Parameter(torch.randn(m, n, generator=gen).to(dev))
            p.grad = torch.randn(m, n, generator=gen).to(dev)
            opt = _optimizer(optimizer, p, dtype)
            times = []
            for i in range(warmup + repeats):
                sync()
                t0 = time.perf_counter()
                opt.step()
                sync()
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            rows.append((optimizer, m, n, dtype, statistics.median(times)))
            del opt, p
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return rows


def write_timings_csv(rows: Iterable[tuple[str, int, int, str, float]], path: str | Path) -> Path:
    """Write rows in the calibration CSV format (header ``optimizer,m,n,dtype,seconds``)."""
    p = Path(path)
    lines = ["optimizer,m,n,dtype,seconds"] + [f"{o},{m},{n},{d},{s!r}" for o, m, n, d, s in rows]
    atomic_write(p, "\n".join(lines) + "\n")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m canzona.sim.measure", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="CSV path to write")
    ap.add_argument("--optimizer", default="muon", choices=optimizer_names(matrix=True))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "tf32", "fp32"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default=None, help="comma list of MxN (default: Qwen3-32B's TP=8 host shapes)")
    a = ap.parse_args(argv)
    shapes = QWEN3_32B_SHAPES
    if a.shapes:
        try:
            shapes = tuple(tuple(int(x) for x in s.lower().split("x")) for s in a.shapes.split(","))  # type: ignore[assignment]
        except ValueError:
            ap.error(f"--shapes must look like 1024x5120,5120x5120, got {a.shapes!r}")
    rows = measure_matrix_timings(shapes, optimizer=a.optimizer, dtype=a.dtype, device=a.device, repeats=a.repeats)
    write_timings_csv(rows, a.out)
    for r in rows:
        print(",".join(map(str, r)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
