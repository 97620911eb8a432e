"""``profiling/bench_optimizers.py --quick``: every section runs and prints its verdicts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("bench_optimizers", Path(__file__).resolve().parents[1] / "profiling" / "bench_optimizers.py")
assert _spec is not None and _spec.loader is not None
bench_optimizers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_optimizers)


def test_quick_run_prints_every_section_and_true_verdicts(capsys: pytest.CaptureFixture[str]) -> None:
    bench_optimizers.main(["--quick"])
    out = capsys.readouterr().out
    for header in ("== Muon vs torch.optim.Muon", "== Shampoo and SOAP", "== Batched Newton-Schulz", "== Finiteness test"):
        assert header in out, header
    assert "bitwise equal to torch.optim.Muon after 5 steps: True" in out
    assert out.count("bitwise equal: True") == 6
    assert "the three name the same tensor holding one NaN: True" in out
    finiteness = out.split("== Finiteness test", 1)[1]
    assert "canzona nonfinite_flags" in finiteness and "1.00x canzona's" in finiteness


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit) as info:
        bench_optimizers.main(["--repeats", "0"])
    assert info.value.code == 2
