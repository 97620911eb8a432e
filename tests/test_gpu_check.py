"""profiling/gpu_check.py and the GPU helpers' pure parts, on a machine without a GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from validation.gpu import cells_for, ns_tflops, overlap_fraction

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "profiling" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_without_gpu_says_so_and_does_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _script().main(["--out", str(out)]) == 0
    captured = capsys.readouterr()
    lines = [ln for ln in captured.out.splitlines() if ln.strip()]
    assert len(lines) == 1 and "no CUDA device" in lines[0] and "nothing done" in lines[0]
    assert captured.err == ""
    assert not out.exists()  # nothing written


def test_gpu_check_rejects_bad_arguments() -> None:
    with pytest.raises(SystemExit) as exc:
        _script().main(["--budget-s", "soon"])
    assert exc.value.code == 2


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
