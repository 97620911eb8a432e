"""profiling/bench_vs_torch.py's library part (canzona.profiling.vs_torch): the summary arithmetic,
the interleaved order, and small real runs of DDP + torch.optim.Muon against canzona lb-asc in
both modes (figures not judged, byte counts exact)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from canzona.profiling.vs_torch import (
    Case,
    _train,
    add_ratios,
    as_dicts,
    format_phases,
    format_table,
    known_variant,
    median_of_runs,
    rotation,
    run_case,
    summarize,
)


def _rank(step: list[float], opt: list[float], sent: int, peak: float = 10.0) -> dict:
    return {"step_s": step, "opt_s": opt, "step_cpu_s": step, "opt_cpu_s": opt, "exposed_s": [0.0] * len(step),
            "sent": [sent] * len(step), "peak_mib": peak, "params": 4, "state_bytes": 64}


def test_summary_takes_the_slowest_rank_then_the_median() -> None:
    case = Case("c", "stack", 2, depth=4, width=4)
    # step i: slowest rank per step is 0.3, 0.2, 0.4 -> median 0.3 s
    r = summarize(case, "lb-asc", [_rank([0.1, 0.2, 0.4], [0.1, 0.1, 0.1], 5), _rank([0.3, 0.1, 0.2], [0.05, 0.2, 0.0], 7)])
    assert math.isclose(r.step_ms, 300.0) and math.isclose(r.optimizer_ms, 100.0)
    assert r.bytes_per_step == 12 and r.params == 4
    base = summarize(case, "ddp", [_rank([0.6] * 3, [0.5] * 3, 1), _rank([0.6] * 3, [0.5] * 3, 1)])
    results = [base, r]
    add_ratios(results)
    assert math.isclose(r.ratios["step"], 0.5) and base.ratios["step"] == 1.0
    table = format_table(results, title="t")
    assert table.splitlines()[0] == "t" and "lb-asc" in table and "0.50" in table


def test_copy_variants_and_the_median_of_runs() -> None:
    assert known_variant("lb-asc/copy") and known_variant("ddp") and known_variant("sc")
    assert not known_variant("ddp/copy") and not known_variant("nope/copy") and not known_variant("lb-asc/")
    case = Case("c", "stack", 2, depth=4, width=4)

    def run(t: float) -> list:
        ranks = [{**_rank([t] * 3, [t / 2] * 3, 5), "phases": [{"canzona/dp/all_gather/wait": t}] * 3}] * 2
        return [summarize(case, "ddp", [_rank([1.0] * 3, [0.5] * 3, 1)] * 2), summarize(case, "lb-asc/copy", ranks)]

    ddp, copy = median_of_runs([run(0.1), run(0.5), run(0.2)])
    assert copy.variant == "lb-asc/copy" and math.isclose(copy.step_ms, 200.0) and math.isclose(copy.ratios["step"], 0.2)
    # each run's own ratio is kept, in run order, and printed under the table
    assert [round(x, 6) for x in copy.run_ratios["step"]] == [0.1, 0.5, 0.2] and ddp.run_ratios["step"] == [1.0] * 3
    assert format_table([ddp, copy], title="t").splitlines()[-1] == (
        "  x DDP step time in each run, wall / CPU: lb-asc/copy 0.10 / 0.10, 0.50 / 0.50, 0.20 / 0.20")
    assert "each run" not in format_table(median_of_runs([run(0.1)]), title="t")
    assert copy.phases == {"canzona/dp/all_gather/wait": [200.0, 200.0]} and ddp.phases == {}
    assert "lb-asc/copy" in format_phases([ddp, copy], title="p") and "200.00" in format_phases([ddp, copy], title="p")
    with pytest.raises(ValueError, match="different variants"):
        median_of_runs([run(0.1), run(0.2)[::-1]])


def test_rotation_starts_each_step_one_variant_later() -> None:
    assert rotation(3, 0) == [0, 1, 2] and rotation(3, 1) == [1, 2, 0] and rotation(3, 2) == [2, 0, 1] and rotation(3, 3) == [0, 1, 2]
    assert rotation(1, 5) == [0]
    # over n consecutive steps every variant takes every position once
    for n in (2, 3, 5):
        for pos in range(n):
            assert sorted(rotation(n, k)[pos] for k in range(7, 7 + n)) == list(range(n))
    with pytest.raises(ValueError, match="at least one"):
        rotation(0, 0)


class _Fake:
    """A runner that logs its calls: step figures are the step index."""

    def __init__(self, name: str, log: list[tuple[str, int]]) -> None:
        self.name, self.log = name, log

    def step(self, step: int) -> dict[str, Any]:
        self.log.append((self.name, step))
        return {"step_s": float(step), "sent": 10 * step}

    def finish(self, measured: dict[str, list[Any]]) -> dict[str, Any]:
        self.log.append((self.name, -1))
        return dict(measured)


def test_interleaved_training_rotates_and_drops_the_warmup() -> None:
    case = Case("c", "stack", 2, steps=3, warmup=1)
    log: list[tuple[str, int]] = []
    out = _train({v: _Fake(v, log) for v in ("ddp", "sc", "lb-asc")}, case, interleave=True)
    assert log == [("ddp", 0), ("sc", 0), ("lb-asc", 0), ("sc", 1), ("lb-asc", 1), ("ddp", 1),
                   ("lb-asc", 2), ("ddp", 2), ("sc", 2), ("ddp", 3), ("sc", 3), ("lb-asc", 3),
                   ("ddp", -1), ("sc", -1), ("lb-asc", -1)]
    assert all(figs == {"step_s": [1.0, 2.0, 3.0], "sent": [10, 20, 30]} for figs in out.values())
    log.clear()
    out = _train({v: _Fake(v, log) for v in ("ddp", "sc")}, case, interleave=False)
    assert log == [("ddp", k) for k in range(4)] + [("sc", k) for k in range(4)] + [("ddp", -1), ("sc", -1)]
    assert out["sc"] == {"step_s": [1.0, 2.0, 3.0], "sent": [10, 20, 30]}


def test_interleaved_results_have_no_peak_per_variant() -> None:
    case = Case("c", "stack", 2, depth=4, width=4)
    nan = float("nan")

    def run(t: float) -> list:
        return [summarize(case, v, [_rank([t] * 3, [t] * 3, 1, peak=nan)] * 2, mode="interleaved", all_peak_mib=50.0 + t)
                for v in ("ddp", "lb-asc")]

    ddp, lb = median_of_runs([run(0.1), run(0.3), run(0.2)])
    assert math.isnan(lb.peak_mib) and math.isnan(lb.ratios["peak"]) and lb.all_peak_mib == 50.2 and lb.mode == "interleaved"
    assert math.isclose(lb.step_ms, 200.0) and lb.state_bytes == 64
    table = format_table([ddp, lb], title="t")
    assert [ln.split()[-3] for ln in table.splitlines()[2:4]] == ["n/a", "n/a"] and "50.2 MiB per rank" in table.splitlines()[-1]
    assert "n/a" not in format_table([summarize(case, "ddp", [_rank([0.1], [0.1], 1)] * 2)], title="t")
    dumped = json.loads(json.dumps(as_dicts([lb])), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert dumped[0]["peak_mib"] is None and dumped[0]["ratios"]["peak"] is None and dumped[0]["all_peak_mib"] == 50.2
    with pytest.raises(ValueError, match="different modes"):
        median_of_runs([run(0.1), [summarize(case, v, [_rank([0.1] * 3, [0.1] * 3, 1)] * 2) for v in ("ddp", "lb-asc")]])


# DDP all-reduces 3 matrices of 8 x 8 fp32: 2 (R-1)/R of 768 bytes per rank, two ranks; canzona's
# reduce-scatter in backward plus the all-gather after the step move the same total
SMALL_BYTES = 2 * 768
# canzona adds its two status exchanges per step: all-reduces of [error, digest, -digest, received
# (3), non-finite (3)] and of [error], int64; at world 2 each rank sends all of both: 8 * (9 + 1)
STATUS_BYTES = 2 * 8 * (9 + 1)


def _expected_bytes(variant: str) -> int:
    return SMALL_BYTES if variant == "ddp" else SMALL_BYTES + STATUS_BYTES


@pytest.mark.slow
def test_small_interleaved_run_of_ddp_and_lb_asc_with_and_without_views() -> None:
    case = Case("smoke", "stack", 2, depth=3, width=8, batch=4, steps=2, warmup=1, bucket_numel=100,
                variants=("ddp", "lb-asc", "lb-asc/copy"))
    results = run_case(case, timeout_s=240, mode="interleaved")
    assert [r.variant for r in results] == ["ddp", "lb-asc", "lb-asc/copy"]
    for r in results:
        assert r.mode == "interleaved" and r.params == 3 and r.bytes_per_step == _expected_bytes(r.variant)
        assert r.step_ms > 0 and r.optimizer_ms > 0 and r.step_cpu_ms > 0 and math.isfinite(r.exposed_comm_ms)
        assert math.isnan(r.peak_mib) and r.all_peak_mib == results[0].all_peak_mib >= 0
    # Muon's momentum: one 8 x 8 fp32 buffer per matrix, all 3 on every DDP rank, split over the two
    # canzona ranks (the rank holding the most has 2)
    assert [r.state_bytes for r in results] == [3 * 256, 2 * 256, 2 * 256]
    assert results[1].phases and not results[0].phases


@pytest.mark.slow
def test_small_separate_run_of_ddp_and_lb_asc() -> None:
    case = Case("smoke", "stack", 2, depth=3, width=8, batch=4, steps=2, warmup=1, bucket_numel=100, variants=("ddp", "lb-asc"))
    ddp, lb = run_case(case, timeout_s=240, mode="separate")
    assert (ddp.variant, lb.variant) == ("ddp", "lb-asc")
    for r in (ddp, lb):
        assert r.step_ms > 0 and r.optimizer_ms > 0 and r.step_cpu_ms > 0 and r.params == 3
        assert r.mode == "separate" and r.peak_mib == r.all_peak_mib and not math.isnan(r.peak_mib)
        assert r.bytes_per_step == _expected_bytes(r.variant)


def test_the_ideal_ratio_is_fwd_bwd_plus_a_share_of_the_optimizer() -> None:
    from canzona.profiling.vs_torch import ideal_ratio

    case = Case("c", "stack", 4, depth=4, width=4)
    # step 0.5 s of which 0.4 s optimizer (wall), 0.4 s of which 0.2 s (CPU)
    ddp = summarize(case, "ddp", [{**_rank([0.5] * 3, [0.4] * 3, 1), "step_cpu_s": [0.4] * 3, "opt_cpu_s": [0.2] * 3}] * 4)
    wall, cpu = ideal_ratio(ddp, 4)
    assert math.isclose(wall, (0.1 + 0.1) / 0.5) and math.isclose(cpu, (0.2 + 0.05) / 0.4)


def test_the_goal_lines_give_the_ratio_of_each_run() -> None:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_vs_torch", Path(__file__).resolve().parents[1] / "profiling" / "bench_vs_torch.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    case = Case("c", "stack", 2, depth=4, width=32)

    def run(t: float) -> list:
        return [summarize(case, v, [_rank([x] * 3, [x / 2] * 3, 1)] * 2) for v, x in (("ddp", 1.0), ("sc", t), ("lb-asc", t / 2))]

    lines = bench._verdicts(median_of_runs([run(1.0), run(1.2), run(1.1)]), 2)
    assert lines[0] == "  goal lb-asc <= 0.58 x DDP step time: 0.55 x wall, runs 0.50-0.60 -> met (0.55 x in CPU time)"
    assert lines[1] == "  goal sc <= 1.05 x DDP step time: 1.10 x wall, runs 1.00-1.20 -> MISSED (1.10 x in CPU time)"
    single = bench._verdicts(median_of_runs([run(1.0)]), 2)
    assert single[1] == "  goal sc <= 1.05 x DDP step time: 1.00 x wall -> met (1.00 x in CPU time)"
