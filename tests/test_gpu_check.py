"""profiling/gpu_check.py and the GPU helpers' pure parts, on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from canzona.profiling.gpu import cells_for, ns_tflops, overlap_fraction

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_without_gpu_says_so_and_does_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, str(ROOT / "profiling" / "gpu_check.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    lines = [ln for ln in run.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "nothing done" in lines[0]
    assert not out.exists()  # nothing written


def test_overlap_fraction_arithmetic() -> None:
    assert overlap_fraction([(0, 10)], [(5, 20)]) == 0.5
    assert overlap_fraction([(0, 10), (20, 30)], [(0, 40)]) == 1.0
    assert overlap_fraction([(0, 10)], [(2, 4), (3, 6), (8, 9)]) == 0.5  # overlapping compute merged
    assert overlap_fraction([(0, 10)], []) == 0.0
    assert overlap_fraction([], [(0, 1)]) == 0.0


def test_cells_and_flop_count() -> None:
    assert cells_for(0) == [] and cells_for(1) == [1] and cells_for(3) == [1, 2] and cells_for(8) == [1, 2, 4]
    (row,) = ns_tflops([("muon", 4, 8, "bf16", 1.0)])
    assert row["tflops"] == 5 * (4 * 4 * 4 * 8 + 2 * 4**3) / 1e12  # flops in one second
