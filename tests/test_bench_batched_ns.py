"""profiling/bench_batched_ns.py: a mistaken argument is one line and status 2, and a quick run
prints both variants' matrices per second and the bitwise finding (in process, seconds)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_batched_ns", ROOT / "profiling" / "bench_batched_ns.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("args,words", [
    (["--experts", "0"], "--experts must be >= 1"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--shapes", "96x"], "--shapes must be a comma list of MxN"),
    (["--device", "tpu"], "--device must be cpu or cuda"),
    (["--inputs", "0"], "--inputs must be >= 1"),
])
def test_a_mistaken_argument_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str], args: list[str], words: str) -> None:
    assert _script().main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_quick_run_prints_both_rates_and_the_finding(capsys: pytest.CaptureFixture[str]) -> None:
    threads = torch.get_num_threads()
    try:
        assert _script().main(["--quick", "--shapes", "96x64,24x16"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out.splitlines()
    assert "loop mat/s" in out[1] and "batched mat/s" in out[1] and "bitwise on" in out[1]
    rows = {line.split()[0]: line for line in out[2:]}
    assert set(rows) == {"96x64", "24x16"}
    for line in rows.values():
        m = re.fullmatch(r"\s*\d+x\d+\s+8\s+([\d.]+)\s+([\d.]+)\s+[\d.]+x\s+(\d)/4 inputs( \(max ([\d.]+) u\))?", line)
        assert m, line
        assert float(m[1]) > 0 and float(m[2]) > 0
        # all four equal, or a difference within the documented bound named beside the count
        assert (m[3] == "4") == (m[4] is None), line
        assert m[5] is None or 0 < float(m[5]) <= 64, line


def test_compare_shape_counts_equal_inputs_and_the_largest_difference() -> None:
    """A thin float32 stack (9 x 73) over three inputs: the count of bitwise-equal inputs and the
    largest difference agree, and stay within the documented bound."""
    r = _script().compare_shape((9, 73), 16, 1, torch.float32, torch.device("cpu"), inputs=3)
    assert 0 <= r["bitwise_inputs"] <= r["inputs"] == 3
    assert 0 <= r["max_diff_u"] <= 64
    assert r["bitwise"] == (r["max_diff_u"] == 0) == (r["bitwise_inputs"] == 3)
