"""canzona.viz: tables agree with the plans and the planner's metrics, figures draw exactly those
tables and are readable (title, axis titles, legend), data files are parsed strictly."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from canzona import paper
from canzona.plan import plan_model
from canzona.plan.plan import STRATEGIES
from canzona.viz import exactness as ve
from canzona.viz import microgroups as vm
from canzona.viz import partition as vp
from canzona.viz import scaling as vs
from canzona.viz import timeline as vt
from canzona.viz._style import figure_problems


def _plan(model: str = "qwen3-tiny", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return plan_model(model, **kw)


def _readable(fig: go.Figure) -> None:
    assert isinstance(fig, go.Figure)
    assert figure_problems(fig) == []


def _bars(fig: go.Figure) -> list:
    return [t for t in fig.data if t.type == "bar"]


# ------------------------------------------------------------------------------------------ style
def test_figure_problems_catches_an_unlabelled_figure() -> None:
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
    problems = figure_problems(fig)
    assert "no title" in problems and "legend has no title" in problems
    assert any("xaxis" in p for p in problems) and any("yaxis" in p for p in problems)
    assert any("no name" in p for p in problems)


# ------------------------------------------------------------------------------------------ paper
def test_paper_values_are_the_brief_numbers() -> None:
    v = {x.key: x.value for x in paper.PAPER_VALUES}
    assert len(v) == len(paper.PAPER_VALUES)
    assert (v["dp_flops_ratio_asc"], v["dp_memory_ratio_asc"], v["dp_flops_ratio_lb-asc"], v["dp_memory_ratio_lb-asc"]) == (3.24, 2.46, 1.43, 1.11)
    assert (v["tp_flops_ratio_asc"], v["tp_flops_ratio_lb-asc"], v["tp_memory_ratio_lb-asc"]) == (3.24, 2.46, 1.16)
    assert (v["optimizer_s_layerwise"], v["optimizer_s_lb-asc"]) == (0.383, 0.066)
    assert (v["fwd_bwd_s_layerwise"], v["fwd_bwd_s_lb-asc"], v["iteration_s_layerwise"], v["iteration_s_lb-asc"]) == (0.998, 0.811, 1.381, 0.877)
    assert (v["optimizer_s_no_fuse"], v["optimizer_s_fused"], v["cmax_plateau_mb"]) == (0.11, 0.073, 512.0)
    assert (v["optimizer_s_cost_numel"], v["optimizer_s_cost_flops"]) == (0.0718, 0.0717)
    for x in paper.PAPER_VALUES:
        assert x.strategy in STRATEGIES and x.source and x.unit


def test_paper_matching() -> None:
    p = paper.paper_value("dp_flops_ratio_lb-asc")
    assert p.matches(model="qwen3-32b", dp=32, tp=8, optimizer="muon", alpha=1.0, cost="numel")
    assert not p.matches(model="qwen3-32b", dp=16, tp=8, optimizer="muon")
    assert not p.matches(model="qwen3-32b", dp=32, tp=8, optimizer="muon", alpha=0.5)
    assert not p.matches(model="qwen3-32b", dp=32, tp=8, optimizer="muon", cost="flops")
    assert {x.key for x in paper.paper_values(metric="optimizer_s", ablation="fusion")} == {"optimizer_s_no_fuse", "optimizer_s_fused"}
    with pytest.raises(KeyError, match="known"):
        paper.paper_value("nope")
    assert len(vs.paper_table()) == len(paper.PAPER_VALUES)


# ------------------------------------------------------------------------------------------ partition
SMALL = [dict(strategy=s, dp=4, tp=2) for s in STRATEGIES if s not in ("sc", "zero1")] + [
    dict(strategy="sc", dp=4, tp=2),
    dict(strategy="zero1", dp=4, tp=2),
    dict(strategy="lb-asc", dp=3, tp=1, alpha=0.5),
]


@pytest.mark.parametrize("kw", SMALL, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_rank_loads_match_planner_metrics(kw) -> None:
    plan = _plan("qwen3-tiny", bucket_numel=3000, **kw)
    loads = vp.rank_loads(plan)
    d = plan.metrics.details
    np.testing.assert_allclose(loads["flops"], d["dp_flops_loads"], rtol=1e-12)
    np.testing.assert_allclose(loads["memory_bytes"], d["dp_memory_loads"], rtol=1e-12)
    np.testing.assert_allclose(loads["numel"], d["dp_numel_loads"], rtol=1e-12)
    assert math.isclose(vp.load_ratio(loads["flops"]), plan.metrics.dp_flops_ratio, rel_tol=1e-12)
    assert math.isclose(vp.load_ratio(loads["memory_bytes"]), plan.metrics.dp_memory_ratio, rel_tol=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ownership_pieces_tile_every_bucket(strategy: str) -> None:
    plan = _plan("qwen3-tiny", dp=4, tp=2, strategy=strategy, bucket_numel=3000)
    pieces = vp.ownership_pieces(plan)
    by_name = plan.by_name()
    for b in plan.buckets:
        p = pieces[pieces["bucket"] == b.index].sort_values("start")
        assert p["start"].iloc[0] == 0 and p["end"].iloc[-1] == b.numel
        assert (p["start"].to_numpy()[1:] == p["end"].to_numpy()[:-1]).all()
        assert (p["end"] - p["start"] == p["numel"]).all()
        if b.cuts:
            for _, row in p.iterrows():
                assert b.cuts[row["owner"]] <= row["start"] and row["end"] <= b.cuts[row["owner"] + 1]
    if strategy == "sc":
        assert (pieces["owner"] == vp.EVERY_RANK).all()
    else:
        assert (pieces["owner"] >= 0).all()
    cut = pieces[~pieces["whole"]]
    if strategy != "zero1":
        assert (cut["kind"] == "elementwise").all()
    for name, grp in pieces.groupby("param"):
        assert grp["numel"].sum() == by_name[name].numel


def test_partition_map_draws_the_pieces() -> None:
    plan = _plan("qwen3-tiny", dp=4, tp=2, strategy="zero1", bucket_numel=3000)
    fig = vp.fig_partition_map(plan)
    _readable(fig)
    bars = _bars(fig)
    assert {t.name for t in bars} == {f"DP rank {r}" for r in range(4)}
    scale = 1e3 if "thousand" in fig.layout.xaxis.title.text else 1.0
    total = sum(float(np.sum(t.x)) for t in bars) * scale
    assert round(total) == plan.buffer_numel
    # hover names every parameter it shows
    shown = {c[0] for t in bars for c in t.customdata}
    assert shown == {p.name for p in plan.params}
    sub = vp.fig_partition_map(plan, buckets=[0])
    assert {y for t in _bars(sub) for y in t.y} == {"bucket 0"}
    with pytest.raises(ValueError, match="out of range"):
        vp.fig_partition_map(plan, buckets=[99])
    sc = vp.fig_partition_map(_plan("qwen3-tiny", dp=4, tp=2, strategy="sc", bucket_numel=3000))
    assert [t.name for t in _bars(sc)] == ["every rank (sc)"]


def test_experts_grouped_per_stack() -> None:
    """A MoE plan (Qwen3-30B-A3B: 48 layers x 2 stacks of 128 experts) reads as one row per expert
    stack: every expert of a stack on exactly one DP rank (lb-asc) or on every rank (sc), the
    partition map's hover names the experts of each piece, the heatmap's rows sum to the stack's
    experts and hovering lists their indices; the micro-group chart says which experts it leaves
    out; a dense plan has no expert stack to draw."""
    plan = _plan("qwen3-30b-a3b", dp=8, tp=1, strategy="lb-asc")
    groups = vp.expert_groups(plan)
    assert len(groups) == 96 and set(groups["experts"]) == {128}
    assert groups["layer"].nunique() == 48 and groups["layer"].iloc[0] == "decoder.layers.0.mlp.experts"
    for owners in groups["owners"]:
        got = []
        for part in owners.split(" | "):
            rank, _, ranges = part.partition(": ")
            for r in ranges.split(", "):
                a, _, b = r.partition("-")
                got.extend(range(int(a), int(b or a) + 1))
        assert sorted(got) == list(range(128)), owners
    pieces = vp.ownership_pieces(plan)
    stack = pieces[pieces["kind"] == "experts"]
    assert stack["experts"].str.match(r"^experts? \d+(-\d+)? of 128$").all() and (pieces[pieces["kind"] != "experts"]["experts"] == "").all()
    hover = {c[7] for t in _bars(vp.fig_partition_map(plan, buckets=[1])) for c in t.customdata}
    assert any("of 128" in h for h in hover)
    fig = vp.fig_expert_groups(plan)
    _readable(fig)
    z = np.asarray(fig.data[0].z)
    assert z.shape == (96, 8) and (z.sum(axis=1) == 128).all()
    assert groups["max_per_rank"].tolist() == z.max(axis=1).astype(int).tolist()
    assert fig.data[0].customdata[0][0].startswith("0-")
    sc = vp.expert_groups(_plan("qwen3-30b-a3b", dp=8, tp=1, strategy="sc"))
    assert set(sc["owners"]) == {"every rank"} and set(sc["ranks"]) == {8}
    assert vp.rank_experts(plan, 0)[0] > 0
    gantt = vm.fig_microgroup_gantt(_plan("qwen3-30b-a3b", dp=8, tp=2, strategy="lb-asc"), 0)
    assert "experts of" in gantt.layout.title.text and "updated whole by this DP rank" in gantt.layout.title.text
    with pytest.raises(ValueError, match="no expert stack"):
        vp.fig_expert_groups(_plan("qwen3-tiny", dp=4, tp=1, strategy="lb-asc"))
    assert vp.expert_groups(_plan("qwen3-tiny", dp=4, tp=1, strategy="lb-asc")).empty


def test_rank_load_figures_show_the_loads() -> None:
    plan = _plan("qwen3-tiny", dp=4, tp=2, strategy="lb-asc", bucket_numel=3000)
    loads = vp.rank_loads(plan)
    for memory, col, scale in (("state", "memory_bytes", 2**30), ("numel", "numel", 1e6)):
        fig = vp.fig_rank_loads(plan, memory=memory)
        _readable(fig)
        bars = _bars(fig)
        np.testing.assert_allclose(bars[0].y, loads["flops"] / 1e9)
        np.testing.assert_allclose(bars[1].y, loads[col] / scale)
        means = [t for t in fig.data if t.name == "mean over ranks"]
        assert len(means) == 2 and math.isclose(means[0].y[0], loads["flops"].mean() / 1e9)
        assert f"R_LB FLOPs {vp.load_ratio(loads['flops']):.2f}" in fig.layout.title.text
    with pytest.raises(ValueError, match="memory"):
        vp.fig_rank_loads(plan, memory="nope")
    plans = [_plan("qwen3-tiny", dp=4, tp=2, strategy=s, bucket_numel=3000) for s in ("zero1", "asc", "lb-asc", "layerwise")]
    fig = vp.fig_strategy_comparison(plans)
    _readable(fig)
    assert len(_bars(fig)) == 8 and len(fig.data) == 16
    assert [a.text.split("<br>")[0] for a in fig.layout.annotations[:4]] == ["zero1", "asc", "lb-asc", "layerwise"]
    with pytest.raises(ValueError):
        vp.fig_strategy_comparison([])


def test_paper_values_beside_the_paper_configuration_only() -> None:
    plans = [_plan("qwen3-32b", dp=32, tp=8, strategy=s, flops_shape="local") for s in ("asc", "lb-asc", "layerwise")]
    summary = vp.strategy_summary(plans)
    row = summary.set_index("strategy")
    assert row.at["lb-asc", "paper_dp_flops_ratio"] == 1.43 and row.at["lb-asc", "paper_dp_numel_ratio"] == 1.11
    assert row.at["asc", "paper_dp_flops_ratio"] == 3.24 and row.at["lb-asc", "paper_tp_memory_ratio"] == 1.16
    assert pd.isna(row.at["layerwise", "paper_dp_flops_ratio"])
    np.testing.assert_allclose(row["dp_flops_ratio"], [p.metrics.dp_flops_ratio for p in plans], rtol=1e-12)
    np.testing.assert_allclose(row["dp_numel_ratio"], [p.metrics.details["dp_numel_ratio"] for p in plans], rtol=1e-12)
    fig = vp.fig_balance_vs_paper(summary)
    _readable(fig)
    diamonds = [t for t in fig.data if t.type == "scatter"]
    assert sorted(v for t in diamonds for v in t.y) == sorted([3.24, 2.46, 1.43, 1.11, 3.24, 2.46, 1.16])
    # full-shape FLOPs are not the paper's accounting: no FLOPs diamond beside them, memory still
    full = vp.strategy_summary([_plan("qwen3-32b", dp=32, tp=8, strategy="lb-asc", flops_shape="full")]).iloc[0]
    assert pd.isna(full["paper_dp_flops_ratio"]) and full["paper_dp_numel_ratio"] == 1.11
    other = vp.strategy_summary([_plan("qwen3-32b", dp=16, tp=8, strategy="lb-asc")])
    assert other.filter(like="paper_").isna().all(axis=None)
    assert not [t for t in vp.fig_balance_vs_paper(other).data if t.type == "scatter"]


# ------------------------------------------------------------------------------------------ micro-groups
def test_task_table_matches_the_micro_groups() -> None:
    plan = _plan("qwen3-1.7b", dp=4, tp=4, strategy="lb-asc", cost="flops", cmax_bytes=64 * 2**20)
    assert all(len(g) >= 2 for g in plan.micro_groups)
    for r in range(plan.inputs.dp):
        t = vm.task_table(plan, r)
        groups = plan.micro_groups[r]
        assert sorted(t["param"]) == sorted(n for g in groups for n in g.params)
        t0 = 0.0
        for g in groups:
            rows = t[t["group"] == g.index]
            per_host = rows.groupby("host")["work"].sum().reindex(range(plan.inputs.tp), fill_value=0.0)
            # the planner's group loads are the same full-shape FLOPs when it plans by FLOPs
            np.testing.assert_allclose(per_host.to_numpy(), g.loads, rtol=1e-12)
            assert math.isclose(rows["start"].min(), t0)
            for _, h in rows.groupby("host"):
                h = h.sort_values("start")
                assert np.allclose(h["start"].to_numpy()[1:], h["end"].to_numpy()[:-1])
            t0 += max(g.loads)
        s = vm.microgroup_summary(plan).loc[r]
        assert math.isclose(s["makespan_sync"], sum(max(g.loads) for g in groups), rel_tol=1e-12)
        assert math.isclose(s["makespan_free"], float(np.sum([g.loads for g in groups], axis=0).max()), rel_tol=1e-12)
    d = plan.metrics.details
    assert math.isclose(vm.microgroup_summary(plan)["makespan_sync"].max(), d["makespan_group_sum"], rel_tol=1e-12)


@pytest.mark.parametrize("schedule", ["lpt", "round-robin", "no-fuse", "lpt-carry"])
def test_tp_host_loads_match_planner(schedule: str) -> None:
    plan = _plan("qwen3-1.7b", dp=4, tp=4, strategy="lb-asc", tp_schedule=schedule)
    d = plan.metrics.details
    w = d["tp_worst_dp_rank_flops"]
    h = vm.tp_host_loads(plan, w)
    np.testing.assert_allclose(h["flops"], d["tp_host_flops_loads"], rtol=1e-12)
    np.testing.assert_allclose(vm.tp_host_loads(plan, d["tp_worst_dp_rank_memory"])["memory_bytes"], d["tp_host_memory_loads"], rtol=1e-12)
    assert math.isclose(vp.load_ratio(h["flops"]), plan.metrics.tp_flops_ratio, rel_tol=1e-12)
    # every TP rank's load averages back to the DP rank's per-TP-rank load
    assert math.isclose(h["flops"].mean(), vp.rank_loads(plan).at[w, "flops"], rel_tol=1e-12)


def test_sync_schedule_has_no_groups_but_a_makespan() -> None:
    plan = _plan("qwen3-tiny", dp=2, tp=2, strategy="layerwise")
    assert vm.task_table(plan, 0).empty
    s = vm.microgroup_summary(plan)
    assert (s["groups"] == 0).all() and (s["makespan_sync"] > 0).all()
    assert (s["makespan_sync"] == s["makespan_free"]).all()
    fig = vm.fig_microgroup_gantt(plan, 0)
    _readable(fig)
    assert not _bars(fig) and "no micro-groups" in fig.layout.title.text
    assert f"makespan {vm._num(s.at[0, 'makespan_sync'] / 1e9)} GFLOP" in fig.layout.title.text


def test_gantt_draws_every_task() -> None:
    plan = _plan("qwen3-1.7b", dp=2, tp=4, strategy="lb-asc", cmax_bytes=128 * 2**20)
    t = vm.task_table(plan, 1)
    for timeline in ("sync", "free"):
        fig = vm.fig_microgroup_gantt(plan, 1, timeline=timeline)
        _readable(fig)
        bars = _bars(fig)
        assert sum(len(b.x) for b in bars) == len(t)
        assert math.isclose(sum(float(np.sum(b.x)) for b in bars), t["work"].sum() / 1e9, rel_tol=1e-9)
    many = _plan("qwen3-1.7b", dp=2, tp=4, strategy="lb-asc", tp_schedule="no-fuse")
    assert vm.task_table(many, 0)["group"].nunique() > 24
    assert [b.name for b in _bars(vm.fig_microgroup_gantt(many, 0))] == ["even micro-groups", "odd micro-groups"]
    with pytest.raises(ValueError, match="dp_rank"):
        vm.task_table(plan, 5)
    with pytest.raises(ValueError, match="metric"):
        vm.task_table(plan, 0, metric="seconds")
    with pytest.raises(ValueError, match="timeline"):
        vm.fig_microgroup_gantt(plan, 0, timeline="later")
    _readable(vm.fig_tp_host_loads(plan, 1))


def test_cmax_and_tp_sweeps() -> None:
    df = vm.cmax_sweep("qwen3-1.7b", dp=2, tp=4, cmax=(1, 16))  # 16 and 256 MiB of fp32 gradient at TP 4
    assert list(df["schedule"]) == ["lpt-carry", "lpt-carry", "no-fuse"]
    nofuse = df.iloc[-1]
    plan = _plan("qwen3-1.7b", dp=2, tp=4, strategy="lb-asc", tp_schedule="no-fuse")
    tasks = max(len(g) for g in plan.micro_groups)
    assert nofuse["groups_max"] == tasks and nofuse["all_to_alls"] == 2 * tasks
    assert (df["all_to_alls"] == 2 * df["groups_max"]).all()
    fig = vm.fig_cmax_sweep(df)
    _readable(fig)
    assert any(t.name.startswith("paper") for t in fig.data)
    with pytest.raises(ValueError):
        vm.cmax_sweep("qwen3-1.7b", dp=2, tp=4, cmax=())
    tp = vm.tp_sweep("qwen3-1.7b", dp=2, tps=(2, 4), schedules=("lpt", "sync"))
    assert len(tp) == 4
    _readable(vm.fig_tp_sweep(tp))


# ------------------------------------------------------------------------------------------ timeline
def _phases(steps: int = 2, ranks: int = 4) -> pd.DataFrame:
    """A small trace summary: rank r's optimizer step lasts 1000 + 500 r us, so the last rank is
    critical; inside it gather / compute / scatter with known gaps."""
    rows = []
    for step in range(steps):
        for rank in range(ranks):
            t = step * 10_000.0 + rank * 3
            rows += [
                (rank, step, "canzona/forward", "", t, 2000.0, 0),
                (rank, step, "canzona/backward", "", t + 2000, 3000.0, 0),
                (rank, step, "canzona/dp/reduce_scatter", "bucket0", t + 3000, 1500.0 + rank, 1),
            ]
            ot, od = t + 5000, 1000.0 + 500 * rank
            rows += [
                (rank, step, "canzona/optimizer/step", "", ot, od, 0),
                (rank, step, "canzona/tp/gather", "group0", ot + 10, 200.0, 1),
                (rank, step, "canzona/tp/compute", "group0", ot + 250, od - 600, 1),
                (rank, step, "canzona/tp/scatter", "group0", ot + od - 300, 200.0, 1),
            ]
    return pd.DataFrame(rows, columns=list(vt.PHASE_COLUMNS))


def test_phase_table_validation() -> None:
    df = vt.validate_phase_table(_phases())
    assert list(df.columns) == list(vt.PHASE_COLUMNS) and df["rank"].dtype == np.int64
    with pytest.raises(ValueError, match="missing column"):
        vt.validate_phase_table(_phases().drop(columns="depth"))
    bad = _phases()
    bad.loc[3, "dur_us"] = -1.0
    with pytest.raises(ValueError, match="negative duration"):
        vt.validate_phase_table(bad)
    bad = _phases()
    bad["rank"] = bad["rank"].astype(float)
    bad.loc[0, "rank"] = 0.5
    with pytest.raises(ValueError, match="rank"):
        vt.validate_phase_table(bad)
    bad = _phases()
    bad.loc[0, "start_us"] = np.inf
    with pytest.raises(ValueError, match="finite"):
        vt.validate_phase_table(bad)
    nan_part = _phases()
    nan_part.loc[0, "part"] = np.nan
    assert vt.validate_phase_table(nan_part)["part"].iloc[0] == ""
    with pytest.raises(TypeError):
        vt.validate_phase_table([1, 2])


def test_load_profile_csv_parquet_and_meta(tmp_path: Path) -> None:
    df = _phases()
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    df.to_csv(run / "phases.csv", index=False)
    (run / "meta.json").write_text(json.dumps({"strategy": "lb-asc", "optimizer": "muon", "dp": 2, "tp": 2, "steps": 2, "model": "qwen3-tiny"}))
    prof = vt.load_profile(run)
    pd.testing.assert_frame_equal(prof.phases, vt.validate_phase_table(df))
    assert prof.meta["strategy"] == "lb-asc" and "DP2 x TP2" in prof.label
    other = tmp_path / "runs" / "b"
    other.mkdir()
    df.to_parquet(other / "phases.parquet")
    pd.testing.assert_frame_equal(vt.load_phase_table(other), prof.phases)
    assert vt.load_profile(other / "phases.parquet").meta == {}
    found = vt.discover_profiles(tmp_path / "runs")
    assert found == {"lb-asc": run}  # b recorded no configuration: it is not a strategy
    (run / "meta.json").write_text('{"strategy": "x", "dp": NaN}')
    with pytest.raises(ValueError, match="NaN"):
        vt.load_profile(run)
    (run / "meta.json").write_text('{"dp": "2"}')
    with pytest.raises(ValueError, match="integers"):
        vt.load_profile(run)
    with pytest.raises(FileNotFoundError):
        vt.load_profile(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no phases"):
        vt.load_phase_table(tmp_path)
    (tmp_path / "x.txt").write_text("rank\n")
    with pytest.raises(ValueError, match="csv or .parquet"):
        vt.load_phase_table(tmp_path / "x.txt")
    (tmp_path / "broken.csv").write_text("rank,step\n1,2\n")
    with pytest.raises(ValueError, match="missing column"):
        vt.load_phase_table(tmp_path / "broken.csv")


def test_reads_what_the_profiling_package_writes(tmp_path: Path) -> None:
    from canzona.profiling.traces import critical_path, write_meta, write_summary

    df = vt.validate_phase_table(_phases())
    write_summary(df, tmp_path)
    write_meta(tmp_path, strategy="lb-asc", optimizer="muon", dp=2, tp=2, steps=2, model="qwen3-tiny")
    prof = vt.load_profile(tmp_path)
    pd.testing.assert_frame_equal(prof.phases, df)
    assert prof.meta["strategy"] == "lb-asc"
    # both packages name the same critical rank and optimizer time
    theirs = critical_path(prof.phases)
    for step in (0, 1):
        ours = vt.optimizer_critical_path(prof.phases, step=step)
        row = theirs[theirs["step"] == step].iloc[0]
        assert row["rank"] == ours.attrs["critical_rank"] and row["optimizer_us"] == pytest.approx(ours.attrs["total_us"])


def test_breakdown_and_critical_path() -> None:
    df = vt.validate_phase_table(_phases())
    b = vt.phase_breakdown(df).set_index("phase")
    assert b.at["canzona/optimizer/step", "ms"] == pytest.approx(2.5)  # slowest rank, 1000 + 500 * 3 us
    assert b.at["canzona/forward", "ms"] == pytest.approx(2.0)
    assert b["share"].sum() == pytest.approx(1.0)
    mean = vt.phase_breakdown(df, reduce="mean").set_index("phase")
    assert mean.at["canzona/optimizer/step", "ms"] == pytest.approx(1.75)
    inner = vt.phase_breakdown(df, depth=1).set_index("phase")
    assert inner.at["canzona/dp/reduce_scatter", "ms"] == pytest.approx(1.503)
    with pytest.raises(ValueError):
        vt.phase_breakdown(df, reduce="median")
    cp = vt.optimizer_critical_path(df, step=0)
    assert cp.attrs["critical_rank"] == 3 and cp.attrs["total_us"] == 2500.0
    assert cp["dur_us"].sum() == pytest.approx(2500.0)
    assert list(cp["kind"]) == ["gap", "phase", "gap", "phase", "gap", "phase", "gap"]
    assert list(cp[cp["kind"] == "phase"]["segment"]) == ["canzona/tp/gather/group0", "canzona/tp/compute/group0", "canzona/tp/scatter/group0"]
    assert cp.attrs["per_rank_us"] == {0: 1000.0, 1: 1500.0, 2: 2000.0, 3: 2500.0}
    assert vt.optimizer_critical_path(df).attrs["step"] == 1
    with pytest.raises(ValueError, match="step 7"):
        vt.optimizer_critical_path(df, step=7)
    with pytest.raises(ValueError, match="no 'x'"):
        vt.optimizer_critical_path(df, phase="x")


def test_timeline_figures() -> None:
    df = vt.validate_phase_table(_phases())
    fig = vt.fig_timeline(df)
    _readable(fig)
    bars = _bars(fig)
    assert len(bars) == df["phase"].nunique() and sum(len(b.x) for b in bars) == len(df)
    one = vt.fig_timeline(df, step=1, max_depth=0)
    assert sum(len(b.x) for b in _bars(one)) == len(df[(df["step"] == 1) & (df["depth"] == 0)])
    assert min(float(np.min(b.base)) for b in _bars(one)) == 0.0
    widths = {w for b in _bars(fig) for w in b.width}
    assert widths == {0.8, 0.55}
    with pytest.raises(ValueError, match="no phases"):
        vt.fig_timeline(df[df["depth"] > 5])
    bd = vt.breakdown_by_strategy({"lb-asc": df, "layerwise": df})
    fig = vt.fig_phase_breakdown(bd)
    _readable(fig)
    assert len(fig.data) == df[df["depth"] == 0]["phase"].nunique()
    fig = vt.fig_phase_breakdown(bd, paper={"lb-asc": {"optimizer step": 0.066}})
    assert fig.data[-1].y[0] == pytest.approx(66.0)
    fig = vt.fig_critical_path(df)
    _readable(fig)
    assert list(fig.data[0].marker.color).count("#d62728") == 1


# ------------------------------------------------------------------------------------------ exactness
def _report(losses: dict[str, list[float]] | None = None, failed: int = 1) -> dict:
    cells = []
    for opt in ("muon", "shampoo"):
        for st in ("asc", "lb-asc"):
            cells.append({"optimizer": opt, "strategy": st, "mesh": {"dp": 2, "tp": 2}, "dtype": "float32", "check": "params",
                          "passed": True, "max_abs_diff": 0.0, "first_mismatch": None, "seconds": 1.5})
    for i in range(failed):
        cells[i] = {**cells[i], "passed": False, "max_abs_diff": 2.5e-7, "first_mismatch": {"param": "w", "index": [0, 1]}}
    losses = losses if losses is not None else {"sc": [5.0, 4.5, 4.25], "lb-asc": [5.0, 4.5, 4.25], "asc": [5.0, 4.5, 4.2500001]}
    return {"summary": {"cells": len(cells), "passed": len(cells) - failed, "failed": failed}, "cells": cells, "losses": losses}


def test_report_validation(tmp_path: Path) -> None:
    rep = _report()
    assert ve.validate_report(rep) is rep
    bad = _report()
    bad["summary"]["passed"] += 1
    with pytest.raises(ValueError, match="summary says"):
        ve.validate_report(bad)
    bad = _report()
    del bad["cells"][0]["seconds"]
    with pytest.raises(ValueError, match="lacks seconds"):
        ve.validate_report(bad)
    bad = _report()
    bad["cells"][0]["passed"] = "yes"
    with pytest.raises(ValueError, match="passed"):
        ve.validate_report(bad)
    bad = _report()
    bad["losses"]["sc"] = [1.0, "x"]
    with pytest.raises(ValueError, match="losses"):
        ve.validate_report(bad)
    with pytest.raises(ValueError, match="JSON object"):
        ve.validate_report([])
    p = tmp_path / "r.json"
    p.write_text(json.dumps(_report()))
    assert ve.load_validation_report(p)["summary"]["failed"] == 1
    p.write_text(json.dumps(_report()).replace("2.5e-07", "NaN"))
    with pytest.raises(ValueError, match="NaN"):
        ve.load_validation_report(p)
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ve.load_validation_report(p)
    with pytest.raises(FileNotFoundError):
        ve.load_validation_report(tmp_path / "missing.json")


def test_report_tables_and_figures() -> None:
    rep = _report()
    t = ve.validation_table(rep)
    assert not t["passed"].iloc[0] and t["passed"].iloc[1:].all()
    assert t["mesh"].iloc[0] == "dp2 x tp2" and "index" in t["first_mismatch"].iloc[0]
    m = ve.validation_matrix(rep).set_index(["strategy", "optimizer"])
    assert m.at[("asc", "muon"), "passed"] == 0 and m.at[("lb-asc", "shampoo"), "passed"] == 1
    assert (m["bitwise"] == m["passed"]).all()
    dev = ve.loss_deviation(rep).set_index("strategy")
    assert dev.at["lb-asc", "identical"] and not dev.at["asc", "identical"]
    assert dev.at["asc", "max_abs_diff"] == pytest.approx(1e-7, rel=1e-3) and dev["reference"].iloc[0] == "sc"
    fig = ve.fig_validation_matrix(rep)
    _readable(fig)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert np.nanmin(z) == 0.0 and np.nanmax(z) == 2.0  # none passed ... all passed
    _colour_bar_matches_cells(fig, rep)
    fig = ve.fig_loss_trajectories(rep)
    _readable(fig)
    assert len(fig.data) == 6 and "identical to sc: lb-asc" in fig.layout.title.text and "different: asc" in fig.layout.title.text
    same = _report({"sc": [1.0, 0.5], "lb-asc": [1.0, 0.5]})
    assert "bitwise identical" in ve.fig_loss_trajectories(same).layout.title.text
    with pytest.raises(ValueError, match="reference"):
        ve.loss_deviation(rep, reference="nope")


def _colour_bar_matches_cells(fig, rep: dict) -> None:
    """Every cell's colour (its z looked up in the colour scale, as plotly does) is the colour the
    bar shows at the tick that names the cell's state, and green means all passed."""
    from canzona.viz._style import PASS_STATES

    h = fig.data[0]
    lo, hi = h.zmin, h.zmax
    stops = [(float(p), c) for p, c in h.colorscale]

    def colour_at(v: float) -> set[str]:
        t = (v - lo) / (hi - lo)
        return {c for p, c in stops if abs(p - t) < 1e-9} or {c for (p0, c), (p1, _) in zip(stops, stops[1:]) if p0 <= t <= p1}

    bar = {label: colour_at(v) for v, label in zip(h.colorbar.tickvals, h.colorbar.ticktext)}
    assert {k: v for k, v in bar.items()} == {label: {c} for label, c in PASS_STATES}
    m = ve.validation_matrix(rep)
    z = np.asarray(h.z, dtype=float)
    for _, row in m.iterrows():
        i, j = list(h.y).index(row["strategy"]), list(h.x).index(row["optimizer"])
        state = "all passed" if row["passed"] == row["total"] else "none passed" if row["passed"] == 0 else "some failed"
        assert colour_at(z[i, j]) == bar[state], (row["strategy"], row["optimizer"], state)
    assert bar["all passed"] == {"#2ca02c"}


def _suite_report() -> dict:
    """The validation suite's own format: schema fields, per-cell losses, an error cell."""
    def cell(strategy, opt, losses, ref, passed=True, **kw):
        return {"cell": f"training/{opt}/{strategy}", "check": "training", "model": "qwen3-tiny", "optimizer": opt,
                "strategy": strategy, "mesh": "dp2xtp2", "dtype": "float32", "steps": 3, "passed": passed,
                "max_abs_diff": 0.0, "first_mismatch": None, "seconds": 0.4, "losses": losses, "reference_losses": ref, **kw}
    sc, single = [5.0, 4.5, 4.25], [5.0, 4.5, 4.2500002]
    cells = [
        cell("sc", "muon", sc, single, bitwise_expected=False, reason="reassociation", max_abs_diff=2e-7),
        cell("lb-asc", "muon", sc, sc),
        cell("asc", "soap", [6.0, 5.0], [6.0, 5.0]),
        {"cell": "injected/muon/layerwise", "check": "injected", "optimizer": "muon", "strategy": "layerwise", "mesh": "dp2xtp1",
         "dtype": "bfloat16", "passed": False, "max_abs_diff": None, "first_mismatch": None, "seconds": 0.1, "error": "RuntimeError: boom"},
    ]
    return {"schema": "canzona.validation", "version": 1, "cells": cells,
            "summary": {"cells": 4, "passed": 3, "failed": 1, "errors": 1, "seconds": 1.0}}


def test_validation_suite_report_format() -> None:
    rep = ve.validate_report(_suite_report())
    assert ve.loss_groups(rep) == [("muon", "dp2xtp2", "float32"), ("soap", "dp2xtp2", "float32")]
    losses = ve.report_losses(rep)
    assert list(losses) == [ve.SINGLE_PROCESS, "sc", "lb-asc"]
    dev = ve.loss_deviation(rep).set_index("strategy")
    assert dev["reference"].iloc[0] == "sc" and dev.at["lb-asc", "identical"] and not dev.at[ve.SINGLE_PROCESS, "identical"]
    assert list(ve.report_losses(rep, ("soap", "dp2xtp2", "float32"))) == ["asc"]
    with pytest.raises(ValueError, match="no loss trajectories for"):
        ve.report_losses(rep, ("muon", "dp4", "float32"))
    t = ve.validation_table(rep)
    assert t["error"].iloc[0] == "RuntimeError: boom" and {"cell", "reason", "bitwise_expected"} <= set(t.columns)
    views = ve.loss_views(rep)
    assert [v[0] for v in views] == ["muon / dp2xtp2 / float32", "soap / dp2xtp2 / float32"]
    for _, _, fig in views:
        _readable(fig)
    fig = ve.fig_validation_matrix(rep)
    _readable(fig)
    assert "2 bitwise equal, 1 within a documented bound" in fig.layout.title.text
    assert "1/1 (1 bound)" in [t for row in fig.data[0].text for t in row]
    injected_only = {"cells": rep["cells"][3:], "summary": {"cells": 1, "passed": 0, "failed": 1}}
    assert ve.loss_views(ve.validate_report(injected_only)) == []
    bad = _suite_report()
    bad["cells"][0]["losses"] = [1.0, None]
    with pytest.raises(ValueError, match="losses"):
        ve.validate_report(bad)


def test_reads_what_the_validation_suite_writes(tmp_path: Path) -> None:
    from validation.report import build_report, write_report

    results = [{k: v for k, v in c.items()} for c in _suite_report()["cells"]]
    doc = build_report(results, level="custom", command="test", seconds=1.0, settings={})
    js, _ = write_report(doc, tmp_path / "report.json")
    rep = ve.load_validation_report(js)
    assert rep["summary"] == doc["summary"]
    assert [v[0] for v in ve.loss_views(rep)] == ["muon / dp2xtp2 / float32", "soap / dp2xtp2 / float32"]
    assert len(ve.validation_table(rep)) == len(results)


# ------------------------------------------------------------------------------------------ scaling
def test_plan_sweep_rows_and_paper_points() -> None:
    df = vs.plan_sweep(models=("qwen3-32b",), dps=(16, 32), tps=(8,), strategies=("asc", "lb-asc"), alphas=(0.5, 1.0), flops_shape="local")
    assert len(df) == 2 * (1 + 2)
    assert df[df["strategy"] == "asc"]["alpha"].isna().all()
    row = df[(df["dp"] == 32) & (df["strategy"] == "lb-asc") & (df["alpha"] == 1.0)].iloc[0]
    plan = _plan("qwen3-32b", dp=32, tp=8, strategy="lb-asc", flops_shape="local")
    assert row["dp_flops_ratio"] == plan.metrics.dp_flops_ratio and row["dp_numel_ratio"] == plan.metrics.details["dp_numel_ratio"]
    pts = vs.paper_points(df, "dp_flops_ratio", "dp")
    assert sorted(zip(pts["strategy"], pts["value"])) == [("asc", 3.24), ("lb-asc", 1.43)]
    assert set(pts["dp"]) == {32}
    full = df.assign(flops_shape="full")  # full-shape FLOPs: another quantity than the paper's
    assert vs.paper_points(full, "dp_flops_ratio", "dp").empty and len(vs.paper_points(full, "dp_numel_ratio", "dp")) == 2
    fig = vs.fig_sweep(df, x="dp", metrics=("dp_flops_ratio", "dp_numel_ratio"), log_x=True, title="t")
    _readable(fig)
    paper_traces = [t for t in fig.data if t.name == "paper (reported)"]
    assert len(paper_traces) == 2
    with pytest.raises(ValueError, match="column"):
        vs.fig_sweep(df, x="nope", title="t")
    with pytest.raises(ValueError, match="non-empty"):
        vs.plan_sweep(dps=())


def test_alpha_and_cost_figures() -> None:
    df = vs.plan_sweep(models=("qwen3-tiny",), dps=(4,), tps=(2,), strategies=("lb-asc",), alphas=(0.0, 0.5, 1.0))
    fig = vs.fig_alpha_tradeoff(df)
    _readable(fig)
    np.testing.assert_allclose(fig.data[0].y, df.sort_values("alpha")["dp_flops_ratio"])
    with pytest.raises(ValueError, match="lb-asc"):
        vs.fig_alpha_tradeoff(df.assign(strategy="asc"))
    costs = vs.plan_sweep(models=("qwen3-tiny",), dps=(4,), tps=(2,), strategies=("lb-asc",), costs=("numel", "flops"))
    fig = vs.fig_cost_models(costs)
    _readable(fig)
    assert [t.name for t in fig.data] == ["cost = numel", "cost = flops"]
    assert math.isclose(vs.model_params_b("qwen3-32b"), 32.8, rel_tol=0.02)


# ------------------------------------------------------------------------------------------ simulation
def test_simulated_breakdown_with_paper_times() -> None:
    from canzona.sim.hardware import load_hardware
    from canzona.sim.model import simulate
    from canzona.viz import simulation as vsim

    df = vsim.simulate_breakdown("qwen3-32b", dp=32, tp=8, strategies=("layerwise", "lb-asc"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        direct = simulate("qwen3-32b", dp=32, tp=8, optimizer="muon", hardware=load_hardware(vsim.DEFAULT_HARDWARE), strategies=("layerwise", "lb-asc"))
    for _, row in df.iterrows():
        assert row["optimizer_s"] == direct[row["strategy"]].optimizer_s
    fig = vsim.fig_time_breakdown(df)
    _readable(fig)
    paper_y = sorted(v for t in fig.data if t.type == "scatter" for v in t.y)
    assert paper_y == sorted([0.998, 0.383, 1.381, 0.811, 0.066, 0.877])
    off = vsim.simulate_breakdown("qwen3-32b", dp=16, tp=8, strategies=("lb-asc",))
    assert not [t for t in vsim.fig_time_breakdown(off).data if t.type == "scatter"]
    with pytest.raises(ValueError, match="axis"):
        vsim.simulate_sweep("nope", (1,))
    comp = vsim.simulate_components("qwen3-32b", dp=32, tp=8, strategies=("layerwise", "lb-asc"))
    totals = comp.groupby("strategy")["seconds"].sum()
    for st, it in comp.attrs["iteration_s"].items():
        assert totals[st] == pytest.approx(it, rel=1e-9)
    fig = vsim.fig_time_components(comp)
    _readable(fig)
    assert sorted(fig.data[-1].y) == [0.877, 1.381]
    alpha = vsim.simulate_alpha((0.0, 1.0), model="qwen3-tiny", dp=2, tp=1)
    assert list(alpha["alpha"]) == [0.0, 1.0]
    _readable(vsim.fig_alpha_time(alpha))


# ------------------------------------------------------------------------------------------ widgets
def test_explorer_rebuilds_and_reports_bad_configurations() -> None:
    from canzona.viz import widgets as vw

    ex = vw.microgroup_explorer(model="qwen3-tiny", dp=2, tp=2, strategy="lb-asc", tp_schedule="lpt")
    assert len(ex.figures) == 3 and "DP2 x TP2" in ex.figures[0].layout.title.text
    assert "lower bound" in " ".join(t.name or "" for t in ex.figures[2].data).lower() + (ex.figures[2].layout.title.text or "").lower()
    ex.controls["dp"].value = 4
    assert ex.error is None and "DP4 x TP2" in ex.figures[0].layout.title.text
    # what the page draws is the Output widgets' state: it carries the new figures
    shown = [o.outputs[0]["data"][vw.PLOTLY_MIME]["layout"]["title"]["text"] for o in ex.outputs]
    assert shown == [f.layout.title.text for f in ex.figures] and "DP4 x TP2" in shown[0]
    assert ex.ui.children[-3:] == tuple(ex.outputs) and vw.EXPLORER_CLASS in ex.ui._dom_classes
    before = ex.figures
    ex.controls["strategy"].value = "sc"  # sc recomputes everything: the planner rejects schedule lpt
    assert ex.error is not None and "sync" in ex.error and "cannot draw" in ex.status.value
    assert ex.figures is before
    ex.controls["tp_schedule"].value = "sync"
    assert ex.error is None and ex.status.value == "" and "sc" in ex.figures[0].layout.title.text
    with pytest.raises(ValueError):
        vw.partition_explorer(model="qwen3-tiny", dp=3)  # not a choice of the dp control
    with pytest.raises(ValueError):
        vw.Explorer(lambda: go.Figure(), {})
    px = vw.partition_explorer(model="qwen3-tiny", dp=4, tp=2)
    px.controls["strategy"].value = "zero1"
    assert "zero1" in px.figures[0].layout.title.text
    assert "zero1" in px.outputs[0].outputs[0]["data"][vw.PLOTLY_MIME]["layout"]["title"]["text"]


# ------------------------------------------------------------------------------------------ export + CLI
def test_main_figures_and_html(tmp_path: Path) -> None:
    from canzona.viz import export

    figs = export.main_figures(model="qwen3-tiny", dp=4, tp=2, profile=tmp_path / "none",
                               only=["partition_map", "microgroup_gantt", "timeline", "alpha_sweep"])
    assert list(figs.figures) == ["partition_map", "microgroup_gantt", "alpha_sweep"]
    assert "timeline" in figs.skipped
    for f in figs.figures.values():
        _readable(f)
    paths = export.write_figures(figs, tmp_path / "out", plotlyjs="cdn")
    assert [p.name for p in paths] == ["partition_map.html", "microgroup_gantt.html", "alpha_sweep.html", "index.html"]
    index = (tmp_path / "out" / "index.html").read_text()
    assert "partition_map.html" in index and "timeline: not written" in index
    with pytest.raises(ValueError, match="unknown figure"):
        export.main_figures(only=["nope"])
    with pytest.raises(ValueError, match="plotlyjs"):
        export.write_figures(figs, tmp_path / "out", plotlyjs="sometimes")


def test_figures_command(tmp_path: Path, capsys) -> None:
    from canzona.cli import main

    run = tmp_path / "prof"
    run.mkdir()
    _phases().to_csv(run / "phases.csv", index=False)
    rep = tmp_path / "report.json"
    rep.write_text(json.dumps(_report()))
    out = tmp_path / "figs"
    rc = main(["figures", "--out", str(out), "--model", "qwen3-tiny", "--dp", "2", "--tp", "2", "--profile", str(run),
               "--report", str(rep), "--only", "partition_map", "timeline", "critical_path", "loss_trajectories"])
    assert rc == 0
    # the HTML files share one plotly.min.js beside them (offline, no 5 MB copy per file)
    js = out / "plotly.min.js"
    assert js.is_file() and js.stat().st_size > 1_000_000
    for name in ("partition_map", "timeline", "critical_path", "loss_trajectories"):
        page = (out / f"{name}.html").read_text()
        assert 'src="plotly.min.js"' in page and len(page) < 500_000
        assert "Plotly.newPlot" in page
    # the loss of the user's runs: skipped with the reason when there are none, drawn when there are
    assert main(["figures", "--out", str(tmp_path / "nolog"), "--only", "loss_curves", "--model", "qwen3-tiny", "--dp", "2", "--tp", "1"]) == 0
    assert "skipped loss_curves: no metrics logs under runs/" in capsys.readouterr().err
    from canzona.runs import MetricsLog, runs_dir

    with MetricsLog(runs_dir() / "train-a", tensorboard=False) as log:
        log.log(0, 5.0, float("nan"), {})
    assert main(["figures", "--out", str(tmp_path / "log"), "--only", "loss_curves", "--model", "qwen3-tiny", "--dp", "2", "--tp", "1"]) == 0
    assert (tmp_path / "log" / "loss_curves.html").is_file()
    assert main(["figures", "--out", str(out), "--model", "nope", "--only", "partition_map"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["figures", "--out", str(out), "--report", str(tmp_path / "missing.json"), "--only", "loss_trajectories",
                 "--model", "qwen3-tiny", "--dp", "2", "--tp", "1"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["figures", "--out", str(out), "--dp", "0"])
    assert exc.value.code == 2


def test_static_export_problem_says_what_is_missing(tmp_path: Path, monkeypatch, capsys) -> None:
    from canzona.cli import main
    from canzona.viz import export

    # no browser anywhere: one line naming the fix, exit 2, nothing written
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-such-chrome"))
    monkeypatch.setenv("PATH", str(tmp_path))
    try:  # kaleido (and its browser driver) is an optional extra: without it, that is what is missing
        from choreographer.browsers.chromium import Chromium
    except ImportError:
        pass
    else:
        monkeypatch.setattr(Chromium, "find_browser", classmethod(lambda cls, **kw: None))
    problem = export.static_export_problem()
    assert problem is not None and ("Chrom" in problem or "kaleido" in problem)
    with pytest.raises(export.StaticExportError, match="cannot write png"):
        export.write_figures({"f": go.Figure()}, tmp_path / "x", fmt="png")
    assert not (tmp_path / "x").exists()
    rc = main(["figures", "--out", str(tmp_path / "y"), "--format", "svg", "--model", "qwen3-tiny", "--dp", "2", "--tp", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "cannot write svg" in err
    with pytest.raises(ValueError, match="format"):
        export.write_figures({}, tmp_path / "z", fmt="gif")
    import sys

    monkeypatch.setitem(sys.modules, "kaleido", None)  # as where the optional extra is not installed
    assert export.static_export_problem().startswith("kaleido is not installed (pip install \"canzona[figures]\"")


@pytest.mark.slow
def test_png_export(tmp_path: Path) -> None:
    from canzona.viz import export

    problem = export.static_export_problem()
    if problem is not None:
        pytest.skip(f"static export cannot run here: {problem}")
    figs = export.main_figures(model="qwen3-tiny", dp=2, tp=2, profile=None, only=["partition_map", "strategy_loads"])
    paths = export.write_figures(figs, tmp_path, fmt="png")
    assert [p.name for p in paths] == ["partition_map.png", "strategy_loads.png", "index.html"]
    for p in paths[:2]:
        head = p.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000
    assert 'href="partition_map.png"' in (tmp_path / "index.html").read_text()


def test_timeline_table_contract_matches_the_trace_summaries() -> None:
    # viz.timeline keeps its own copy of the phase-table columns and meta keys so that the
    # notebooks' plotting layer never imports torch (canzona.profiling.traces reads phase names
    # from the runtime); this pins the two copies to one contract
    from canzona.profiling import traces

    assert vt.PHASE_COLUMNS == traces.PHASE_COLUMNS
    assert tuple(vt._META_KEYS) == tuple(traces.META_KEYS)


# ------------------------------------------------------------------------------------------ legibility
def test_partition_map_many_ranks_tells_neighbours_apart() -> None:
    from canzona.viz._style import rank_colors

    from itertools import combinations

    from canzona.viz._style import DISTINCT_MAX, color_distance

    for n in (4, 16, 32, 48, 128):
        cols = rank_colors(n)
        assert len(set(cols)) == n, n  # every rank its own colour
        assert all(a != b for a, b in zip(cols, cols[1:]))
        if n <= DISTINCT_MAX:
            # every pair, not only neighbours, is clearly apart (DP32 once had ranks 1 and 6 both red)
            worst = min(((color_distance(a, b), i, j) for (i, a), (j, b) in combinations(enumerate(cols), 2)))
            assert worst[0] > 15, f"dp {n}: ranks {worst[1]} and {worst[2]} look alike ({cols[worst[1]]}, {cols[worst[2]]})"
            assert all(color_distance(c, "#999999") > 15 for c in cols)  # grey means every rank / other ranks
    plan = _plan("qwen3-1.7b", dp=32, tp=2, strategy="zero1")
    fig = vp.fig_partition_map(plan, buckets=range(3))
    _readable(fig)
    bars = _bars(fig)
    # one legend entry per rank (click hides one, double-click isolates it), in the rank palette
    assert [b.name for b in bars] == [f"DP rank {r}" for r in range(32)]
    assert [b.marker.color for b in bars] == rank_colors(32)
    pieces = vp.ownership_pieces(plan)
    pieces = pieces[pieces["bucket"] < 3]
    wide = pieces["numel"] >= vp.LABEL_MIN_FRACTION * pieces["end"].max()
    shown = sorted(t for b in bars for t in b.text if t)
    assert shown == sorted(str(o) for o in pieces.loc[wide, "owner"])  # wide segments carry their rank
    assert wide.sum() > 32 and (~wide).any()
    sub = vp.fig_partition_map(plan, buckets=range(3), ranks=[3, 4])
    assert [b.name for b in _bars(sub)] == ["other ranks (30)", "DP rank 3", "DP rank 4"]
    assert "coloured: DP ranks 3, 4" in sub.layout.title.text
    with pytest.raises(ValueError, match="DP ranks in 0..31"):
        vp.fig_partition_map(plan, ranks=[32])


def test_gantt_keeps_idle_hosts_on_the_chart() -> None:
    plan = _plan("qwen3-32b", dp=32, tp=8, strategy="lb-asc", flops_shape="local")
    worst = int(vm.microgroup_summary(plan)["makespan_sync"].idxmax())
    t = vm.task_table(plan, worst)
    assert t["host"].nunique() < 8  # the weak point of Algorithm 2 the chart must show
    fig = vm.fig_microgroup_gantt(plan, worst)
    _readable(fig)
    shown = {y for tr in fig.data for y in tr.y}
    assert shown == {f"TP rank {h}" for h in range(8)}
    assert {s for b in _bars(fig) for s in b.text} == {f"g{k}" for k in t["group"]}


def test_axis_helpers() -> None:
    from canzona.viz._style import line_style, log_ticks, ratio_axis

    assert log_ticks([64, 1024.0, 4096, 1.72057, float("nan")])["ticktext"] == ["1.72", "64", "1,024", "4,096"]
    assert ratio_axis([1.0, 1.4, 3.9]) == {}
    ax = ratio_axis([1.0, 22.6])
    assert ax["type"] == "log" and ax["tickvals"][0] == 1 and max(ax["tickvals"]) <= 22.6 * 1.5
    assert line_style(0)["dash"] != line_style(1)["dash"] and line_style(0)["symbol"] != line_style(1)["symbol"]


def test_comparison_panels_have_their_own_scales() -> None:
    plans = [_plan("qwen3-32b", dp=32, tp=8, strategy=s, flops_shape="local") for s in ("asc", "lb-asc")]
    fig = vp.fig_strategy_comparison(plans, memory="numel")
    _readable(fig)
    layout = fig.layout.to_plotly_json()
    assert not [k for k, ax in layout.items() if k.startswith("yaxis") and ax.get("matches")]
    bal = vp.fig_balance_vs_paper(vp.strategy_summary(plans))
    assert bal.layout.yaxis.type == "log"  # asc's ~20 must not flatten lb-asc's 1.1..1.4


def test_critical_path_left_panel_shows_when_each_rank_ends() -> None:
    df = vt.validate_phase_table(_phases())
    cp = vt.optimizer_critical_path(df, step=1)
    spans = cp.attrs["per_rank_span_us"]
    assert {r: e - b for r, (b, e) in spans.items()} == cp.attrs["per_rank_us"]
    assert max(spans, key=lambda r: spans[r][1]) == cp.attrs["critical_rank"]
    fig = vt.fig_critical_path(df, step=1)
    first = min(b for b, _ in spans.values())
    np.testing.assert_allclose(fig.data[0].base, [(spans[r][0] - first) / 1e3 for r in sorted(spans)])
    # one legend entry per base phase, not per group
    assert {t.name for t in fig.data[1:]} == {"tp/gather", "tp/compute", "tp/scatter", vt.GAP_ROW}
    # the table names every row: phases by label, gaps by the phase they precede
    assert all(cp["segment"].str.len() > 0) and not cp["segment"].str.contains("untracked").any()
    gaps = cp[cp["kind"] == "gap"]
    assert len(gaps) and all(s.startswith("gap ") for s in gaps["segment"])
    following = cp["segment"].shift(-1)
    for i, seg in gaps["segment"].items():
        if seg.startswith("gap before "):
            assert seg == "gap before " + following[i].removeprefix("canzona/")


def test_sweeps_record_their_flops_accounting() -> None:
    df = vm.cmax_sweep("qwen3-1.7b", dp=2, tp=4, cmax=(16,), include_no_fuse=False, flops_shape="local")
    full = vm.cmax_sweep("qwen3-1.7b", dp=2, tp=4, cmax=(16,), include_no_fuse=False)
    assert df.attrs["flops_shape"] == "local" and full.attrs["flops_shape"] == "full"
    assert df["makespan_sync"].iloc[0] < full["makespan_sync"].iloc[0]
    assert "local shapes" in vm.fig_cmax_sweep(df).layout.title.text
    tp = vm.tp_sweep("qwen3-1.7b", dp=2, tps=(2, 4), schedules=("lpt",), flops_shape="local")
    assert "local shapes" in vm.fig_tp_sweep(tp).layout.title.text


# ------------------------------------------------------------------------------------------ which profile
def _raw_traces(d: Path) -> Path:
    """A raw torch.profiler trace directory (one Chrome trace per rank), as `canzona profile` leaves."""
    d.mkdir(parents=True)
    for rank in range(2):
        o = 1000.0 * rank
        events = [{"ph": "X", "cat": "user_annotation", "name": n, "pid": 1, "tid": 1, "ts": o + ts, "dur": dur} for n, ts, dur in (
            ("ProfilerStep#1", 0, 900), ("canzona/forward", 1, 100), ("canzona/backward", 110, 200),
            ("canzona/dp/reduce_scatter/bucket0/launch", 150, 5), ("canzona/optimizer/step", 320, 400),
            ("canzona/dp/reduce_scatter/bucket0/wait", 330, 50), ("canzona/dp/local_update/bucket0", 390, 300),
        )]
        doc = {"schemaVersion": 1, "baseTimeNanoseconds": 0, "traceEvents": events, "distributedInfo": {"rank": rank, "world_size": 2}}
        (d / f"rank{rank}.1.pt.trace.json").write_text(json.dumps(doc))
    return d


def test_profiles_default_to_the_newest_run_and_read_raw_traces(tmp_path: Path, monkeypatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("CANZONA_RUNS_DIR", str(runs))
    path, note = vt.resolve_profile()
    assert path == vt.DEFAULT_PROFILE_DIR and "shipped sample" in note and "canzona profile --tensorboard" in note
    old = runs / "old"
    old.mkdir(parents=True)
    _phases().to_csv(old / "phases.csv", index=False)
    raw = _raw_traces(runs / "nested" / "raw")
    import os

    os.utime(old / "phases.csv", (1, 1))  # the summary is older than the raw traces
    path, note = vt.resolve_profile()
    assert path == raw.resolve() and note == f"profile: {raw.resolve()} (your newest, of 2 under $CANZONA_RUNS_DIR ({runs}))"
    assert vt.resolve_profile(old) == (old, f"profile: {old} (the one asked for)")
    prof = vt.load_profile()  # no path: the newest run, summarised on the fly
    assert set(prof.phases["rank"]) == {0, 1} and prof.source == str(raw.resolve())
    assert set(prof.phases["part"]) >= {"bucket0/launch", "bucket0/wait"}
    assert vt.discover_profiles(runs) == {}  # neither run recorded its configuration
    vt.fig_timeline(prof.phases)
    # the breakdown keeps a collective's launch (in the backward) and wait (in the step) apart
    b = vt.phase_breakdown(prof.phases, depth=1).set_index("phase")["ms"]
    assert b["canzona/dp/reduce_scatter/launch"] == pytest.approx(0.005) and b["canzona/dp/reduce_scatter/wait"] == pytest.approx(0.05)
    fig = vt.fig_phase_breakdown(vt.breakdown_by_strategy({"lb-asc": prof}, depth=1))
    _readable(fig)
    shapes = {t.name: t.marker.pattern.shape for t in fig.data}
    assert shapes["dp/reduce_scatter/wait"] == "/" and shapes["dp/reduce_scatter/launch"] == "."


def test_figures_command_reads_a_raw_trace_directory(tmp_path: Path, capsys) -> None:
    from canzona.cli import main

    raw = _raw_traces(tmp_path / "raw")
    out = tmp_path / "figs"
    assert main(["figures", "--out", str(out), "--profile", str(raw), "--only", "timeline", "critical_path",
                 "--model", "qwen3-tiny", "--dp", "2", "--tp", "1"]) == 0
    assert (out / "timeline.html").is_file() and (out / "critical_path.html").is_file()
    assert "skipped" not in capsys.readouterr().err


@pytest.mark.slow  # with a Chromium present, kaleido draws one PNG (seconds)
def test_notebook_renderer_puts_html_and_optionally_a_picture_beside_the_json(monkeypatch) -> None:
    import plotly.io as pio

    from canzona.viz import notebook
    from canzona.viz.export import static_export_problem

    before = pio.renderers.default
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]), layout=dict(title="t"))
    try:
        monkeypatch.delenv(notebook.STATIC_ENV, raising=False)
        assert notebook.use_notebook_renderer() == "plotly_mimetype+notebook"
        bundle = pio.renderers._build_mime_bundle(fig.to_dict())
        assert {"application/vnd.plotly.v1+json", "text/html"} <= set(bundle)
        monkeypatch.setenv(notebook.STATIC_ENV, "svg")
        assert notebook.notebook_renderer() == "plotly_mimetype+svg"
        with pytest.raises(ValueError, match="static"):
            notebook.notebook_renderer("gif")
        if static_export_problem() is None:
            notebook.use_notebook_renderer("png")
            bundle = pio.renderers._build_mime_bundle(fig.to_dict())
            # a picture instead of the HTML copy: GitHub and nbconvert prefer HTML, which needs JavaScript
            assert "image/png" in bundle and "text/html" not in bundle and "application/vnd.plotly.v1+json" in bundle
        else:
            with pytest.raises(RuntimeError, match="cannot embed static figures"):
                notebook.use_notebook_renderer("png")
    finally:
        pio.renderers.default = before


def test_main_figures_reads_the_newest_run_by_default(tmp_path: Path, monkeypatch) -> None:
    from canzona.viz import export

    monkeypatch.setenv("CANZONA_RUNS_DIR", str(tmp_path))
    raw = _raw_traces(tmp_path / "prof")
    figs = export.main_figures(model="qwen3-tiny", dp=2, tp=1, only=["timeline"])
    assert list(figs.figures) == ["timeline"] and figs.notes == [f"profile: {raw.resolve()} (your newest, of 1 under $CANZONA_RUNS_DIR ({tmp_path}))"]
    assert export.main_figures(model="qwen3-tiny", dp=2, tp=1, only=["partition_map"]).notes == []
    figs = export.main_figures(model="qwen3-tiny", dp=2, tp=1, only=["validation_matrix"])
    assert figs.notes == [f"validation report: NOTE no validation report of yours under $CANZONA_RUNS_DIR ({tmp_path}) "
                          f"(`canzona validate` writes one); showing the shipped sample {ve.SAMPLE_REPORT}"]
    mine = tmp_path / "validation" / "20260101T000000Z" / "report.json"
    mine.parent.mkdir(parents=True)
    mine.write_text(ve.SAMPLE_REPORT.read_text())
    figs = export.main_figures(model="qwen3-tiny", dp=2, tp=1, only=["validation_matrix"])
    assert figs.notes == [f"validation report: {mine.resolve()} (your newest, of 1 under $CANZONA_RUNS_DIR ({tmp_path}))"]


def test_gantt_states_why_a_one_host_group_exists_and_explorer_opens_on_an_illustrative_rank() -> None:
    import warnings

    from canzona.plan import cmax_to_bytes, plan_model
    from canzona.viz import meshload as vml
    from canzona.viz import microgroups as vm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp32 fc1 gradients exceed C_max: the plan warns about it
        # C_max 16 = 512 MiB of fp32 gradient at TP 8, below one fc1 (the default 512 holds a whole rank)
        plan = plan_model("qwen3-32b", dp=32, tp=8, strategy="lb-asc", tp_schedule="lpt", cmax_bytes=cmax_to_bytes(16, 8))
    r = vml.illustrative_dp_rank(plan)
    assert len(plan.micro_groups[r]) > 1
    lone = [k for k in range(plan.inputs.dp) if vm.one_host_groups(plan, k)]
    assert lone, "expected one-task groups above C_max at DP32 x TP8 with fp32 gradients"
    title = vm.fig_microgroup_gantt(plan, lone[0]).layout.title.text
    assert "alone is" in title and "C_max" in title
    # a rank without such groups says nothing about them
    quiet = [k for k in range(plan.inputs.dp) if not vm.one_host_groups(plan, k)]
    if quiet:
        assert "alone is" not in vm.fig_microgroup_gantt(plan, quiet[0]).layout.title.text


def test_viz_modules_import_one_way() -> None:
    """No import cycle among canzona.viz's modules, counting imports inside functions too (a late
    import hides a cycle from the interpreter, not from a reader)."""
    import ast

    pkg = Path(__file__).resolve().parent.parent / "canzona" / "viz"
    graph: dict[str, set[str]] = {}
    for f in pkg.glob("*.py"):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("canzona.viz."):
                deps.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names if a.name.startswith("canzona.viz."))
        graph[f.stem] = deps - {f.stem}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != 1, f"import cycle: {' -> '.join([*path, m, d])}"
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert "meshload" in graph["__init__"] or "microgroups" in graph["__init__"]
