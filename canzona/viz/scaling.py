"""The paper's scaling studies (Appendix C.3, C.5, D.5) redone with canzona's planner.

:func:`plan_sweep` plans every combination of the axes it is given and returns one row of
balance metrics per plan; the figure functions draw a metric against one axis with one line
per strategy (or another column) and the paper's reported values as open diamonds wherever a
row is the paper's configuration (Qwen3-32B, Muon, DP32 x TP8, numel cost, alpha = 1).
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from canzona.paper import paper_values
from canzona.plan.build import plan_model, resolve_model
from canzona.plan.plan import DEFAULT_FLOPS_SHAPE
from canzona.specs import specs_from_config
from canzona.viz._style import PAPER_MARKER, categorical_colors, finish, line_style, log_ticks, ratio_axis, strategy_color
from canzona.viz.partition import PAPER_COLUMNS

__all__ = [
    "SCALING_MODELS",
    "METRIC_LABELS",
    "model_params_b",
    "paper_table",
    "plan_sweep",
    "paper_points",
    "fig_sweep",
    "fig_alpha_tradeoff",
    "fig_cost_models",
]

#: the paper's model-size study (Figure 9): Qwen3 1.7B to 32B
SCALING_MODELS: tuple[str, ...] = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")

#: column -> axis label (dimensionless ratios unless stated)
METRIC_LABELS: dict[str, str] = {
    "dp_flops_ratio": "DP FLOPs R_LB (max / mean)",
    "dp_memory_ratio": "DP optimizer-state R_LB (max / mean)",
    "dp_numel_ratio": "DP numel R_LB (max / mean; the paper's memory)",
    "tp_flops_ratio": "TP FLOPs R_LB (max / mean, worst TP group)",
    "tp_memory_ratio": "TP optimizer-state R_LB (max / mean, worst TP group)",
    "tp_numel_ratio": "TP numel R_LB (max / mean, worst TP group)",
    "comm_balance": "largest shard / mean shard of the worst bucket",
    "j_comm_rel": "J_Comm / buffer elements",
    "groups_max": "micro-groups of the busiest DP rank",
    "plan_ms": "planning time (ms)",
}

_X_LABELS: dict[str, str] = {
    "dp": "DP size (ranks per DP group)",
    "tp": "TP size (ranks per TP group)",
    "params_b": "model size (billion parameters)",
    "alpha": "alpha (0: equal shards, 1: balance compute)",
    "gpus": "GPUs (DP x TP)",
}

_PAPER_SOURCE = {v: k for k, v in PAPER_COLUMNS.items()}  # our column -> paper metric


@lru_cache(maxsize=32)
def model_params_b(model: str) -> float:
    """Total parameters of a shipped model (or config path), in billions, from its specs."""
    cfg = resolve_model(model)
    return sum(s.numel for s in specs_from_config(cfg, tp=1)) / 1e9


def paper_table() -> pd.DataFrame:
    """Every reference value of :mod:`canzona.paper` as a table (one row per value)."""
    from dataclasses import asdict

    from canzona.paper import PAPER_VALUES

    rows = [{**asdict(v), "config": v.config} for v in PAPER_VALUES]
    return pd.DataFrame(rows)


def plan_sweep(
    *,
    models: Sequence[str] = ("qwen3-32b",),
    dps: Sequence[int] = (32,),
    tps: Sequence[int] = (8,),
    strategies: Sequence[str] = ("asc", "lb-asc"),
    alphas: Sequence[float] = (1.0,),
    costs: Sequence[str] = ("numel",),
    optimizer: str = "muon",
    flops_shape: str = DEFAULT_FLOPS_SHAPE,
    tp_schedule: str | None = None,
) -> pd.DataFrame:
    """Plan every combination of the axes; one row per plan.

    ``alphas`` only applies to ``lb-asc`` (the other strategies are planned once, alpha NaN).
    Columns: ``model``, ``params_b``, ``dp``, ``tp``, ``gpus``, ``strategy``, ``tp_schedule``,
    ``alpha``, ``cost``, ``optimizer``, ``flops_shape``, the R_LB ratios of :data:`METRIC_LABELS`,
    ``comm_balance`` (max over buckets of largest shard / mean shard: the communication imbalance
    alpha trades against), ``j_comm_rel``, ``groups_max``, ``plan_ms`` and ``oversize_warned``
    (micro-group tasks larger than C_max on their own, which the planner warns about).
    """
    for name, axis in (("models", models), ("dps", dps), ("tps", tps), ("strategies", strategies), ("alphas", alphas), ("costs", costs)):
        if isinstance(axis, (str, bytes)) or not len(axis):
            raise ValueError(f"{name} must be a non-empty sequence")
    rows = []
    for model, dp, tp, strategy, cost in itertools.product(models, dps, tps, strategies, costs):
        for alpha in (alphas if strategy == "lb-asc" else (None,)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plan = plan_model(
                    model, dp=int(dp), tp=int(tp), optimizer=optimizer, strategy=strategy,
                    alpha=1.0 if alpha is None else float(alpha), cost=cost, flops_shape=flops_shape, tp_schedule=tp_schedule,
                )
            m, d = plan.metrics, plan.metrics.details
            rows.append({
                "model": plan.inputs.model,
                "params_b": model_params_b(model),
                "dp": int(dp),
                "tp": int(tp),
                "gpus": int(dp) * int(tp),
                "strategy": strategy,
                "tp_schedule": plan.inputs.tp_schedule,
                "alpha": np.nan if alpha is None else float(alpha),
                "cost": cost,
                "optimizer": optimizer,
                "flops_shape": flops_shape,
                "dp_flops_ratio": m.dp_flops_ratio,
                "dp_memory_ratio": m.dp_memory_ratio,
                "dp_numel_ratio": float(d.get("dp_numel_ratio", np.nan)),
                "tp_flops_ratio": m.tp_flops_ratio,
                "tp_memory_ratio": m.tp_memory_ratio,
                "tp_numel_ratio": float(d.get("tp_numel_ratio", np.nan)),
                "comm_balance": float(d.get("max_bucket_comm_balance", np.nan)),
                "j_comm_rel": m.j_comm / plan.buffer_numel,
                "groups_max": int(d.get("max_micro_groups_per_rank", 0)),
                "plan_ms": m.plan_seconds * 1e3,
                "oversize_warned": len(caught),
            })
    return pd.DataFrame(rows)


def paper_points(df: pd.DataFrame, metric: str, x: str) -> pd.DataFrame:
    """The paper's values of our column ``metric`` at the rows of ``df`` that are the paper's
    configuration (for FLOPs ratios: with the paper's TP-local FLOPs accounting): columns ``x``
    (the row's value), ``value``, ``strategy``, ``label``."""
    src = _PAPER_SOURCE.get(metric)
    out = []
    if src is None:
        return pd.DataFrame(columns=[x, "value", "strategy", "label"])
    for _, row in df.iterrows():
        alpha = row.get("alpha", np.nan)
        if src.endswith("flops_ratio") and row.get("flops_shape", "local") != "local":
            continue  # the paper's FLOPs ratios are on TP-local shards: not beside full-shape ratios
        for v in paper_values(metric=src, strategy=row["strategy"], ablation=""):
            if v.matches(model=str(row["model"]), dp=int(row["dp"]), tp=int(row["tp"]), optimizer=str(row["optimizer"]),
                         alpha=None if pd.isna(alpha) else float(alpha), cost=str(row.get("cost", "numel"))):
                out.append({x: row[x], "value": v.value, "strategy": row["strategy"], "label": v.label})
    return pd.DataFrame(out, columns=[x, "value", "strategy", "label"]).drop_duplicates()


def _color_of(key: str, values: list) -> dict:
    if key == "strategy":
        return {v: strategy_color(str(v)) for v in values}
    return dict(zip(values, categorical_colors(len(values))))


def fig_sweep(
    df: pd.DataFrame,
    *,
    x: str,
    metrics: Sequence[str] = ("dp_flops_ratio", "dp_numel_ratio"),
    color: str = "strategy",
    log_x: bool = False,
    title: str,
) -> go.Figure:
    """One panel per metric, ``metric`` against column ``x``, one line per value of ``color``;
    the paper's values (open diamonds) where a row is the paper's configuration."""
    for col in (x, color, *metrics):
        if col not in df:
            raise ValueError(f"column {col!r} not in the sweep table")
    if df.empty:
        raise ValueError("the sweep table is empty")
    groups = list(dict.fromkeys(df[color]))
    colors = _color_of(color, groups)
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[METRIC_LABELS.get(m, m) for m in metrics], horizontal_spacing=0.1)
    paper_shown = False
    for c, metric in enumerate(metrics, start=1):
        for i, gval in enumerate(groups):
            d = df[df[color] == gval].sort_values(x)
            st = line_style(i)
            fig.add_trace(
                go.Scatter(x=d[x], y=d[metric], mode="lines+markers", name=str(gval), legendgroup=str(gval), showlegend=c == 1,
                           line=dict(color=colors[gval], dash=st["dash"]), marker=dict(symbol=st["symbol"], size=st["size"]),
                           customdata=d[["model", "dp", "tp"]].to_numpy(),
                           hovertemplate=f"{gval}<br>%{{customdata[0]}} DP%{{customdata[1]}} x TP%{{customdata[2]}}<br>{x} %{{x}}: %{{y:.3f}}<extra></extra>"),
                row=1, col=c,
            )
        pts = paper_points(df, metric, x)
        if len(pts):
            # each diamond names its strategy: at the paper's configuration several sit on one x
            fig.add_trace(
                go.Scatter(x=pts[x], y=pts["value"], mode="markers+text", marker=PAPER_MARKER, name="paper (reported)",
                           legendgroup="paper", showlegend=not paper_shown, text=pts["strategy"], textposition="middle right", cliponaxis=False,
                           textfont=dict(size=10), customdata=pts[["label"]].to_numpy(),
                           hovertemplate="paper, %{text} (%{customdata[0]}): %{y:.2f}<extra></extra>"),
                row=1, col=c,
            )
            paper_shown = True
        fig.update_yaxes(title_text=METRIC_LABELS.get(metric, metric), row=1, col=c,
                         **(ratio_axis([*df[metric], *pts["value"]]) if metric.endswith("_ratio") else {}))
        fig.update_xaxes(title_text=_X_LABELS.get(x, x), row=1, col=c)
        if log_x:
            fig.update_xaxes(type="log", row=1, col=c, **log_ticks(df[x]))
    return finish(fig, title=title, legend_title=color.replace("_", " "), height=440)


def fig_alpha_tradeoff(df: pd.DataFrame) -> go.Figure:
    """Algorithm 1's alpha trade-off (Appendix C.5): compute balance (DP FLOPs and numel R_LB)
    against communication balance (largest shard / mean shard of the worst bucket), for the
    ``lb-asc`` rows of a sweep over ``alphas``."""
    d = df[df["strategy"] == "lb-asc"].sort_values("alpha")
    if d.empty or d["alpha"].isna().all():
        raise ValueError("need lb-asc rows with alpha values (plan_sweep(strategies=['lb-asc'], alphas=[...]))")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("compute / memory balance across DP ranks", "communication balance inside buckets"))
    for key, col in (("dp_flops_ratio", "#2ca02c"), ("dp_numel_ratio", "#1f77b4"), ("dp_memory_ratio", "#9467bd")):
        fig.add_trace(go.Scatter(x=d["alpha"], y=d[key], mode="lines+markers", name=METRIC_LABELS[key], line_color=col), row=1, col=1)
    fig.add_trace(go.Scatter(x=d["alpha"], y=d["comm_balance"], mode="lines+markers", name=METRIC_LABELS["comm_balance"],
                             line=dict(color="#d62728")), row=1, col=2)
    shown = False
    for key in ("dp_flops_ratio", "dp_numel_ratio"):
        pts = paper_points(d, key, "alpha")
        if len(pts):
            fig.add_trace(go.Scatter(x=pts["alpha"], y=pts["value"], mode="markers", marker=PAPER_MARKER, name="paper (alpha = 1, Figure 3c)",
                                     legendgroup="paper", showlegend=not shown, text=[METRIC_LABELS[key]] * len(pts),
                                     hovertemplate="paper %{text}: %{y:.2f}<extra></extra>"), row=1, col=1)
            shown = True
    fig.update_xaxes(title_text=_X_LABELS["alpha"])
    fig.update_yaxes(title_text="R_LB (max / mean)", row=1, col=1,
                     **ratio_axis(d[["dp_flops_ratio", "dp_numel_ratio", "dp_memory_ratio"]].to_numpy().ravel()))
    fig.update_yaxes(title_text="largest / mean shard", row=1, col=2)
    r = d.iloc[0]
    return finish(fig, title=f"alpha sweep: {r['model']}, {r['optimizer']}, DP{r['dp']} x TP{r['tp']}, cost {r['cost']}",
                  legend_title="quantity", height=440)


def fig_cost_models(df: pd.DataFrame, *, metrics: Sequence[str] = ("dp_flops_ratio", "dp_numel_ratio", "dp_memory_ratio", "tp_flops_ratio")) -> go.Figure:
    """Grouped bars: the balance each planner cost model (numel, flops, memory) reaches, per
    strategy (Appendix D.5 asks whether numel is a good enough proxy for FLOPs)."""
    if "cost" not in df or df.empty:
        raise ValueError("need a sweep over costs (plan_sweep(costs=['numel', 'flops', ...]))")
    fig = go.Figure()
    costs = list(dict.fromkeys(df["cost"]))
    colors = dict(zip(costs, categorical_colors(len(costs))))
    for cost in costs:
        d = df[df["cost"] == cost]
        labels = [f"{row['strategy']}: {METRIC_LABELS[m].split(' (')[0]}" for _, row in d.iterrows() for m in metrics]
        vals = [row[m] for _, row in d.iterrows() for m in metrics]
        fig.add_trace(go.Bar(x=labels, y=vals, name=f"cost = {cost}", marker_color=colors[cost]))
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    fig.update_layout(barmode="group")
    fig.update_yaxes(**ratio_axis(df[list(metrics)].to_numpy().ravel()))
    r = df.iloc[0]
    return finish(fig, title=f"Planner cost model: numel vs FLOPs vs memory ({r['model']}, {r['optimizer']}, DP{r['dp']} x TP{r['tp']}, FLOPs on {r['flops_shape']} shapes)",
                  x_title="strategy: balanced quantity", y_title="R_LB (max / mean)", legend_title="planner cost W(p)", height=460)

