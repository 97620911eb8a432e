"""Tests for the cluster-scale step-time simulator: hand-computed alpha-beta costs and
overlap rule, strict hardware profiles, calibration, monotonicity in bandwidth, the paper
configuration's ratios as the command prints them, and the CLI's error handling."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona import cli
from canzona.config import load_model_config
from canzona.sim import (
    PAPER_FIGURE4,
    PAPER_RATIOS,
    HardwareError,
    Link,
    Setup,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    available_hardware,
    breakdown_long,
    broadcast_time,
    calibrate,
    dp_sweep,
    flow_shop,
    fwd_flops_per_gpu,
    list_schedule,
    load_hardware,
    paper_comparison,
    parse_hardware,
    plan_for,
    reduce_scatter_time,
    simulate_plan,
)
from canzona.sim.comm import Op
from canzona.sim.hardware import FLOPS_PER_MAC, HARDWARE_DIR, ns_efficiency, peak_flops
from canzona.cost import matrix_flops
from canzona.plan.build import resolve_model

LINK = Link("test", bandwidth=1e9, alpha=1e-6, launch=1e-5)


# --------------------------------------------------------------------------- alpha-beta, by hand
def test_reduce_scatter_uniform_by_hand():
    # 4 ranks, 4 MB: launch 10 us + 3 steps x 1 us + 3/4 * 4e6 B / 1e9 B/s = 3 ms
    assert reduce_scatter_time(LINK, 4, 4e6) == pytest.approx(1e-5 + 3e-6 + 3e-3, rel=1e-12)
    assert all_gather_time(LINK, 4, 4e6) == pytest.approx(1e-5 + 3e-6 + 3e-3, rel=1e-12)


def test_variable_size_models_by_hand():
    shards = [0.0, 1e6, 2e6, 1e6]  # 4 MB in total, one rank gets nothing
    # grouped per-rank rings: busiest link carries S - min S_r = 4 MB
    assert reduce_scatter_time(LINK, 4, shard_bytes=shards, varsize="grouped") == pytest.approx(1e-5 + 3e-6 + 4e-3, rel=1e-12)
    # lockstep ring: (R - 1) * max S_r = 6 MB
    assert reduce_scatter_time(LINK, 4, shard_bytes=shards, varsize="padded") == pytest.approx(1e-5 + 3e-6 + 6e-3, rel=1e-12)
    # equal shards: both models coincide with the uniform formula
    eq = [1e6] * 4
    for vs in ("grouped", "padded"):
        assert reduce_scatter_time(LINK, 4, shard_bytes=eq, varsize=vs) == pytest.approx(reduce_scatter_time(LINK, 4, 4e6), rel=1e-12)


def test_all_reduce_broadcast_all_to_all_by_hand():
    assert all_reduce_time(LINK, 4, 4e6) == pytest.approx(1e-5 + 6e-6 + 2 * 0.75 * 4e-3, rel=1e-12)
    assert broadcast_time(LINK, 4, 4e6) == pytest.approx(1e-5 + 3e-6 + 4e-3, rel=1e-12)
    # busiest rank: rank 2 sends 3 MB / rank 0 receives 3 MB
    assert all_to_all_time(LINK, [1e6, 2e6, 3e6], [3e6, 0.0, 1e6]) == pytest.approx(1e-5 + 2e-6 + 3e-3, rel=1e-12)


def test_single_rank_collectives_are_free_and_bad_input_fails():
    assert reduce_scatter_time(LINK, 1, 1e9) == 0.0
    assert all_reduce_time(LINK, 1, 1e9) == 0.0
    assert broadcast_time(LINK, 1, 1e9) == 0.0
    assert all_to_all_time(LINK, [5.0], [5.0]) == 0.0
    with pytest.raises(ValueError):
        reduce_scatter_time(LINK, 3, shard_bytes=[1.0, 2.0])
    with pytest.raises(ValueError):
        reduce_scatter_time(LINK, 0, 1.0)
    with pytest.raises(ValueError):
        reduce_scatter_time(LINK, 2, shard_bytes=[1.0, 2.0], varsize="ring")
    with pytest.raises(ValueError):
        Link("x", 0.0, 0.0, 0.0)


# --------------------------------------------------------------------------- overlap rule, by hand
def test_flow_shop_backward_comm_bound():
    # backward compute 1 s per bucket, reduce-scatter 2 s per bucket: the comm stream is the
    # bottleneck; ends at 1 + 2 + 2 + 2 = 7, compute alone 3 -> 4 s exposed
    span, busy = flow_shop([1, 1, 1], [2, 2, 2])
    assert (span, busy) == (7, 3)


def test_flow_shop_hides_all_but_the_last_bucket():
    # comm 0.5 s per 1 s bucket: only the last bucket's reduce-scatter sticks out
    span, busy = flow_shop([1, 1, 1], [0.5, 0.5, 0.5])
    assert span - busy == pytest.approx(0.5)


def test_flow_shop_forward_first_gather_exposed():
    # forward: all-gather (stage 1) feeds compute (stage 2): the first gather is always exposed
    span, _ = flow_shop([0.2, 0.2, 0.2], [1, 1, 1])
    assert span - 3 == pytest.approx(0.2)


def test_list_schedule_by_hand():
    ops = [
        Op("G0", "comm", 1.0),
        Op("G1", "comm", 1.0),
        Op("C0", "gpu0", 3.0, ("G0",)),
        Op("C1", "gpu1", 1.0, ("G1",)),
        Op("S0", "comm", 0.5, ("C0", "C1")),
    ]
    total, end = list_schedule(ops)
    # C0 runs 1..4, C1 runs 2..3, S0 waits for both: 4..4.5
    assert end["C1"] == 3.0 and end["S0"] == 4.5 and total == 4.5


# --------------------------------------------------------------------------- hardware profiles
def _profile_doc(name: str = "h800-ib400") -> dict:
    return json.loads((HARDWARE_DIR / f"{name}.json").read_text())


def test_shipped_profiles_load_and_cite_every_constant():
    names = available_hardware()
    assert {"h100-ib400", "h800-ib400", "h200-ib400"} <= set(names)
    for n in names:
        hw = load_hardware(n)
        for k, c in hw.constants().items():
            assert c.source.strip(), k
    # H800's NVLink is the cut-down one; H200's HBM is faster than H100's
    assert load_hardware("h800-ib400").nvlink_gbps.value < load_hardware("h100-ib400").nvlink_gbps.value
    assert load_hardware("h200-ib400").hbm_gbps.value > load_hardware("h100-ib400").hbm_gbps.value


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.__setitem__("nvlink_tbps", {"value": 1, "source": "x"}), "unknown key"),
        (lambda d: d.pop("net_gbps"), "missing key"),
        (lambda d: d.__setitem__("net_gbps", {"value": 50}), "exactly 'value' and 'source'"),
        (lambda d: d.__setitem__("net_gbps", {"value": True, "source": "x"}), "must be a number"),
        (lambda d: d.__setitem__("net_gbps", {"value": 50, "source": " "}), "non-empty"),
        (lambda d: d.__setitem__("fwd_bwd_mfu", {"value": 1.5, "source": "x"}), "fraction"),
        (lambda d: d.__setitem__("net_gbps", {"value": -1, "source": "x"}), "> 0"),
        (lambda d: d.__setitem__("version", 2), "version"),
        (lambda d: d.__setitem__("schema", "other"), "schema"),
    ],
)
def test_profile_parsing_is_strict(mutate, message):
    doc = _profile_doc()
    mutate(doc)
    with pytest.raises(HardwareError, match=message):
        parse_hardware(doc)


def test_load_hardware_errors(tmp_path):
    with pytest.raises(HardwareError, match="unknown hardware"):
        load_hardware("tpu-v9")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(HardwareError, match="not valid JSON"):
        load_hardware(bad)
    nan = tmp_path / "nan.json"
    nan.write_text(json.dumps(_profile_doc()).replace('"value": 50.0', '"value": NaN'))
    with pytest.raises(HardwareError):
        load_hardware(nan)


def test_with_values_rejects_unknown_and_out_of_range():
    hw = load_hardware("h800-ib400")
    with pytest.raises(HardwareError, match="unknown hardware constant"):
        hw.with_values(warp_speed=3)
    with pytest.raises(HardwareError):
        hw.with_values(net_efficiency=0.0)
    assert hw.with_values(net_gbps=100).net_gbps.source.startswith("override")


# --------------------------------------------------------------------------- calibration hook
def test_calibration_recovers_known_throughput(tmp_path):
    hw = load_hardware("h200-ib400")
    truth = hw.with_values(ns_efficiency_max=0.6, ns_efficiency_half_dim=512)
    lines = ["optimizer,m,n,dtype,seconds"]
    for m, n in [(1024, 5120), (5120, 5120), (25600, 5120), (512, 4096), (2048, 7168), (8192, 8192)]:
        sec = FLOPS_PER_MAC * matrix_flops("muon", (m, n)) / (peak_flops(truth, "bf16") * ns_efficiency(truth, (m, n)))
        lines.append(f"muon,{m},{n},bf16,{sec!r}")
    csv = tmp_path / "ns.csv"
    csv.write_text("\n".join(lines) + "\n")
    fit = calibrate(hw, csv)
    assert fit.ns_efficiency_max.value == pytest.approx(0.6, rel=1e-9)
    assert fit.ns_efficiency_half_dim.value == pytest.approx(512, rel=1e-12)
    assert "fitted to 6 measured timings" in fit.ns_efficiency_max.source


@pytest.mark.parametrize(
    "body, message",
    [
        ("m,n,seconds\n1,2,3\n", "header"),
        ("optimizer,m,n,dtype,seconds\nadamw,4,4,bf16,1\n", "matrix optimizer"),
        ("optimizer,m,n,dtype,seconds\nmuon,4,4,fp8,1\n", "dtype"),
        ("optimizer,m,n,dtype,seconds\nmuon,4,4,bf16,-1\n", "seconds > 0"),
        ("optimizer,m,n,dtype,seconds\n", "no timing rows"),
        ("optimizer,m,n,dtype,seconds\nmuon,4,x,bf16,1\n", "integers"),
    ],
)
def test_calibration_csv_is_strict(tmp_path, body, message):
    p = tmp_path / "t.csv"
    p.write_text(body)
    with pytest.raises(HardwareError, match=message):
        calibrate(load_hardware("h100-ib400"), p)


# --------------------------------------------------------------------------- compute model
def test_fwd_flops_by_hand():
    cfg = load_model_config("qwen3-tiny")
    setup = Setup(seq_len=8, micro_batch=2)
    h, f, L, V = 64, 176, 2, 256
    q, kv = 4 * 16, 2 * 16
    tokens = 16
    dense = 2 * tokens * (L * (h * (q + 2 * kv) + q * h + 3 * h * f) + V * h)
    attn = L * 2 * (2 * 8 * 8 * q) * 2 * 0.5
    assert fwd_flops_per_gpu(cfg, setup, tp=2) == pytest.approx((dense + attn) / 2, rel=1e-12)


# --------------------------------------------------------------------------- step model structure
@pytest.fixture(scope="module")
def qwen32():
    return resolve_model("qwen3-32b")


@pytest.fixture(scope="module")
def paper_plans(qwen32):
    return {s: plan_for(qwen32, s, dp=32, tp=8) for s in ("sc", "layerwise", "asc", "lb-asc", "zero1")}


def test_paper_structure(qwen32, paper_plans):
    hw = load_hardware("h800-ib400")
    r = {s: simulate_plan(p, qwen32, hw) for s, p in paper_plans.items()}
    # all-reduce (sc, layerwise) moves twice the reduce-scatter's bytes in backward (Appendix D.2)
    assert r["layerwise"].dp_grad_comm_s > 1.8 * r["lb-asc"].dp_grad_comm_s
    assert r["layerwise"].fwd_bwd_s > r["lb-asc"].fwd_bwd_s >= r["zero1"].fwd_bwd_s
    # lb-asc's step has no DP communication; layerwise's broadcast loop is exposed
    assert r["lb-asc"].opt_dp_comm_s == 0.0 and r["layerwise"].opt_dp_comm_s > 0.0
    # sc recomputes every update everywhere: far slower step than any partitioned strategy
    assert r["sc"].optimizer_s > 5 * r["layerwise"].optimizer_s
    for b in r.values():
        assert b.iteration_s == pytest.approx(b.fwd_bwd_s + b.optimizer_s)
    # breakdown components add up to the iteration
    long = breakdown_long(r)
    sums = long.groupby("strategy")["seconds"].sum()
    for s, b in r.items():
        assert sums[s] == pytest.approx(b.iteration_s, rel=1e-9)


_BANDWIDTHS = ("nvlink_gbps", "nvlink_efficiency", "net_gbps", "net_efficiency", "hbm_gbps", "peak_bf16_tflops", "fwd_bwd_mfu", "ns_efficiency_max")


@settings(max_examples=25, deadline=None)
@given(
    strategy=st.sampled_from(("sc", "layerwise", "asc", "lb-asc", "zero1")),
    name=st.sampled_from(_BANDWIDTHS),
    factor=st.floats(min_value=1.0, max_value=4.0),
    overlap=st.sampled_from(("free", "pipelined", "serial")),
    varsize=st.sampled_from(("grouped", "padded")),
)
def test_more_bandwidth_is_never_slower(qwen32, paper_plans, strategy, name, factor, overlap, varsize):
    hw = load_hardware("h800-ib400").with_values(fwd_bwd_mfu=0.2, ns_efficiency_max=0.5, nvlink_efficiency=0.5, net_efficiency=0.5)
    setup = Setup(tp_overlap=overlap, varsize_collective=varsize)
    fast = hw.with_values(**{name: min(getattr(hw, name).value * factor, 1.0) if "efficiency" in name or "mfu" in name else getattr(hw, name).value * factor})
    a = simulate_plan(paper_plans[strategy], qwen32, hw, setup)
    b = simulate_plan(paper_plans[strategy], qwen32, fast, setup)
    for phase in ("fwd_bwd_s", "optimizer_s", "iteration_s"):
        assert getattr(b, phase) <= getattr(a, phase) * (1 + 1e-12), (phase, name)


def test_lower_latency_is_never_slower(qwen32, paper_plans):
    hw = load_hardware("h100-ib400")
    fast = hw.with_values(net_alpha_us=0.0, nvlink_alpha_us=0.0, collective_launch_us=0.0)
    for s, p in paper_plans.items():
        assert simulate_plan(p, qwen32, fast).iteration_s <= simulate_plan(p, qwen32, hw).iteration_s


def test_scale_is_fast():
    hw = load_hardware("h200-ib400")
    cfg = resolve_model("qwen3-32b")
    p = plan_for(cfg, "lb-asc", dp=1024, tp=8)
    t = time.perf_counter()
    b = simulate_plan(p, cfg, hw)
    assert time.perf_counter() - t < 5.0
    assert len(b.per_rank_optimizer_s) == 1024


def test_dp_sweep_frame():
    hw = load_hardware("h100-ib400")
    f = dp_sweep("qwen3-8b", [8, 16], tp=4, optimizer="muon", hardware=hw, strategies=("layerwise", "lb-asc"))
    assert list(f["dp"]) == [8, 8, 16, 16]
    assert {"fwd_bwd_s", "optimizer_s", "iteration_s", "gpus"} <= set(f.columns)


# --------------------------------------------------------------------------- the paper's ratios
def test_paper_comparison_fit_reproduces_the_fitted_number_only():
    pc = paper_comparison(load_hardware("h800-ib400"), fit_fwd_bwd=True, sensitivity=False)
    assert pc.predicted["lb-asc"].fwd_bwd_s == pytest.approx(PAPER_FIGURE4["lb-asc"]["fwd_bwd_s"], rel=1e-6)
    assert pc.hardware.fwd_bwd_mfu.source.startswith("fitted")
    # the ratios are predictions, not inputs
    for phase, r in pc.ratios.items():
        assert r == pytest.approx(getattr(pc.predicted["layerwise"], phase) / getattr(pc.predicted["lb-asc"], phase))


def _run_cli(capsys, *argv):
    rc = cli.main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_command_prints_paper_ratios(capsys, tmp_path):
    js = tmp_path / "sim.json"
    rc, out, _ = _run_cli(capsys, "--model", "qwen3-32b", "--dp", "32", "--tp", "8", "--optimizer", "muon", "--hardware", "h800-ib400", "--json", str(js))
    assert rc == 0
    assert "Paper Figure 4" in out
    pc = paper_comparison(load_hardware("h800-ib400"), sensitivity=False)
    for phase, label in (("optimizer_s", "optimizer"), ("fwd_bwd_s", "fwd-bwd"), ("iteration_s", "iteration")):
        line = next(l for l in out.splitlines() if re.match(rf"{label}\s+\d", l))
        assert f"{PAPER_RATIOS[phase]:.2f}x" in line
        assert f"{pc.ratios[phase]:.2f}x" in line
    assert "which assumption dominates" in out
    doc = json.loads(js.read_text())
    assert set(doc) >= {"inputs", "hardware", "setup", "strategies", "paper_comparison"}
    assert set(doc["strategies"]) == {"sc", "layerwise", "asc", "lb-asc", "zero1"}
    for s in doc["strategies"].values():
        assert {"fwd_bwd_s", "optimizer_s", "iteration_s"} <= set(s)
    assert doc["hardware"]["net_gbps"]["source"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--dp", "0"), "--dp"),
        (("--hardware", "tpu-v9"), "unknown hardware"),
        (("--optimizer", "adamw"), "matrix optimizer"),
        (("--strategies", "sc,fsdp"), "unknown strategy"),
        (("--dp", "16", "--paper"), "paper configuration"),
        (("--sweep-alpha", "0,2"), "--sweep-alpha"),
        (("--set", "fwd_bwd_mfu"), "NAME=VALUE"),
        (("--set", "warp=2"), "unknown hardware constant"),
        (("--model", "qwen3-999b"), ""),
    ],
)
def test_command_bad_input_is_one_line_exit_2(capsys, argv, message):
    rc, out, err = _run_cli(capsys, "--no-sensitivity", *argv)
    assert rc == 2
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("canzona simulate: error:")
    assert message in lines[0]


def test_measure_writes_a_calibration_csv_on_cpu(tmp_path):
    from canzona.sim.measure import measure_matrix_timings, write_timings_csv

    rows = measure_matrix_timings([(32, 48), (64, 64)], device="cpu", repeats=1, warmup=1, dtype="fp32")
    assert [(r[1], r[2]) for r in rows] == [(32, 48), (64, 64)] and all(r[4] > 0 for r in rows)
    path = write_timings_csv(rows, tmp_path / "t.csv")
    fit = calibrate(load_hardware("h100-ib400"), path)
    assert 0 < fit.ns_efficiency_max.value <= 1


def test_alpha_sweep_and_report():
    from canzona.sim import alpha_report, alpha_sweep

    hw = load_hardware("h100-ib400")
    f = alpha_sweep("qwen3-8b", [0.0, 1.0], dp=8, tp=4, optimizer="muon", hardware=hw)
    assert list(f["alpha"]) == [0.0, 1.0]
    rep = alpha_report(f)
    assert rep["recommended_alpha"] in (0.0, 1.0)
    assert rep["iteration_at_recommended_s"] == pytest.approx(f["iteration_s"].min())
    # the imbalance's exposure is measured against ZeRO-1's equal chunks on the same buckets
    assert rep["alpha1_imbalance_exposed_s"] == pytest.approx(rep["alpha1_exposed_dp_comm_s"] - rep["zero1_exposed_dp_comm_s"])
    with pytest.raises(ValueError):
        alpha_report(f[f["alpha"] == 0.0])


def test_moe_1t_config_is_a_trillion_parameters():
    from canzona.sim import moe_1t_config
    from canzona.specs import specs_from_config

    n = sum(s.numel for s in specs_from_config(moe_1t_config()))
    assert 1.0e12 < n < 1.1e12


def test_the_step_model_costs_expert_stacks_as_e_tasks_where_their_experts_are():
    """A MoE config's experts are (E, M, N) stacks, the planner's default: each is E tasks of the
    (M, N) expert shape, and a stack cut between experts runs each rank's share of them."""
    from canzona.sim.model import Setup, _links, _matrix_times, _step_loads, plan_for
    from canzona.sim.shard import _ns_seconds

    hw, setup = load_hardware("h800-ib400"), Setup()
    plan = plan_for("qwen3-moe-tiny", "lb-asc", dp=4, tp=1)
    stacks = [i for i, p in enumerate(plan.params) if p.spec.kind == "experts"]
    assert stacks and any(plan.params[i].dp_ranges for i in stacks)  # some stacks are cut between experts
    t = _matrix_times(plan, hw, setup, "muon")
    for i in stacks:
        s = plan.params[i].spec
        assert t[i] == pytest.approx(s.shape[0] * _ns_seconds(hw, setup, "muon", s.task_shape), rel=1e-12)
    # tp 1: no micro-groups, so the ranks' matrix time is every task's time, each counted once
    step = _step_loads(plan, hw, setup, "muon", *_links(hw, 4, 1))
    assert float(step.matrix.sum()) == pytest.approx(float(t.sum()), rel=1e-12)
    cut = plan.params[next(i for i in stacks if plan.params[i].dp_ranges)]
    expected = {r: t[plan.params.index(cut)] * (e - s) / cut.spec.local_numel for r, s, e in cut.dp_ranges}
    assert all(step.matrix[r] >= v for r, v in expected.items())


def test_cli_simulate_takes_either_expert_form(tmp_path, capsys):
    paths = {form: tmp_path / f"{form}.json" for form in ("stacked", "separate")}
    for form, path in paths.items():
        code = cli.main(["simulate", "--model", "qwen3-moe-tiny", "--dp", "2", "--tp", "2", "--strategies", "lb-asc",
                         "--experts", form, "--json", str(path)])
        assert code == 0, capsys.readouterr().err
    docs = {form: json.loads(p.read_text()) for form, p in paths.items()}
    assert docs["separate"]["inputs"]["experts"] == "separate" and "experts" not in docs["stacked"]["inputs"]
    # replicated stacks hold every expert on both TP ranks: more optimizer state than TP-split matrices
    mem = {form: d["strategies"]["lb-asc"]["memory_gb"] for form, d in docs.items()}
    assert mem["stacked"] > mem["separate"]
