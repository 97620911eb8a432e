"""Predicted iteration breakdowns from canzona's cluster-scale simulator (:mod:`canzona.sim`),
as tables and figures with the paper's measured times beside them. The numbers come from the
simulator's own functions (:mod:`canzona.sim.model`, :mod:`canzona.sim.analysis`); this module
only selects configurations and draws.

The simulator predicts seconds from a plan, the model shapes and a hardware profile (its
assumptions are named constants in :mod:`canzona.sim`); the paper's numbers were measured on
its cluster. Diamonds mark the paper's values only where a row is the paper's configuration.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from canzona.paper import paper_value, paper_values
from canzona.plan.build import cmax_to_bytes, default_tp_schedule
from canzona.viz._style import PAPER_MARKER, categorical_colors, finish, line_style, log_ticks, strategy_color
from canzona.viz.scaling import model_params_b

__all__ = [
    "DEFAULT_HARDWARE",
    "TIME_COLUMNS",
    "simulate_breakdown",
    "simulate_sweep",
    "simulate_cmax",
    "simulate_costs",
    "simulate_components",
    "simulate_alpha",
    "paper_comparison_table",
    "fig_time_breakdown",
    "fig_time_sweep",
    "fig_cmax_time",
    "fig_cost_time",
    "fig_time_components",
    "fig_alpha_time",
]

#: the hardware profile closest to the paper's cluster (its description says why)
DEFAULT_HARDWARE = "h800-ib400"
#: predicted times, seconds per iteration
TIME_COLUMNS: dict[str, str] = {
    "fwd_bwd_s": "forward + backward",
    "optimizer_s": "optimizer step",
    "iteration_s": "iteration",
}
_SWEEP_AXES = ("dp", "tp", "model", "alpha", "cost")


def _simulate(model: str, *, dp: int, tp: int, optimizer: str, hardware: str, strategies: Sequence[str] | None,
              alpha: float, **plan_kwargs: Any) -> pd.DataFrame:
    from canzona.sim.analysis import breakdown_frame
    from canzona.sim.hardware import load_hardware
    from canzona.sim.model import SIM_STRATEGIES, simulate

    hw = load_hardware(hardware)
    with warnings.catch_warnings():
        # oversized micro-group tasks are expected at this scale; the planner notebooks show them
        warnings.simplefilter("ignore", UserWarning)
        res = simulate(model, dp=dp, tp=tp, optimizer=optimizer, hardware=hw,
                       strategies=tuple(strategies) if strategies is not None else SIM_STRATEGIES, alpha=alpha, **plan_kwargs)
    return breakdown_frame(res, model=str(model), params_b=model_params_b(str(model)), hardware=hardware,
                           cost=plan_kwargs.get("cost", "numel"), tp_schedule=plan_kwargs.get("tp_schedule") or "default")


def simulate_breakdown(
    model: str = "qwen3-32b",
    *,
    dp: int = 32,
    tp: int = 8,
    optimizer: str = "muon",
    hardware: str = DEFAULT_HARDWARE,
    strategies: Sequence[str] | None = None,
    alpha: float = 1.0,
    **plan_kwargs: Any,
) -> pd.DataFrame:
    """One row per strategy: the simulator's :class:`canzona.sim.model.StepBreakdown` fields
    (``fwd_bwd_s``, ``optimizer_s``, ``iteration_s`` and their parts, seconds) plus ``model``,
    ``params_b``, ``hardware``, ``cost``, ``tp_schedule``. ``plan_kwargs`` go to the planner."""
    return _simulate(model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware, strategies=strategies, alpha=alpha, **plan_kwargs)


def simulate_sweep(
    axis: str,
    values: Sequence[Any],
    *,
    model: str = "qwen3-32b",
    dp: int = 32,
    tp: int = 8,
    optimizer: str = "muon",
    hardware: str = DEFAULT_HARDWARE,
    strategies: Sequence[str] = ("layerwise", "asc", "lb-asc"),
    alpha: float = 1.0,
    **plan_kwargs: Any,
) -> pd.DataFrame:
    """:func:`simulate_breakdown` along one ``axis`` (``dp``, ``tp``, ``model``, ``alpha`` or
    ``cost``), the other settings fixed; one row per (value, strategy) with the axis as a column."""
    if axis not in _SWEEP_AXES:
        raise ValueError(f"axis must be one of {', '.join(_SWEEP_AXES)}, got {axis!r}")
    if not len(values):
        raise ValueError("values must not be empty")
    parts = []
    for v in values:
        kw: dict[str, Any] = dict(model=model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware,
                                  strategies=strategies, alpha=alpha, **plan_kwargs)
        kw[axis] = v
        df = _simulate(kw.pop("model"), **kw)
        parts.append(df)
    out = pd.concat(parts, ignore_index=True)
    out.attrs.update(axis=axis, model=model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware)
    return out


def simulate_cmax(
    cmax: Sequence[float] = (4, 8, 16, 32, 64, 128, 512, 2048),
    *,
    model: str = "qwen3-32b",
    dp: int = 16,
    tp: int = 8,
    optimizer: str = "muon",
    hardware: str = DEFAULT_HARDWARE,
) -> pd.DataFrame:
    """The fusion ablation (Figure 14, DP16 x TP8) predicted: lb-asc (its default TP schedule) at each
    C_max (2^20 TP-local gradient elements per host, :data:`canzona.plan.CMAX_UNIT`) plus the
    no-fuse schedule (``cmax`` NaN)."""
    rows = []
    for c in cmax:
        df = _simulate(model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware, strategies=("lb-asc",), alpha=1.0,
                       cmax_bytes=cmax_to_bytes(float(c), tp))
        df["cmax"] = float(c)
        df["tp_schedule"] = default_tp_schedule("lb-asc")
        rows.append(df)
    df = _simulate(model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware, strategies=("lb-asc",), alpha=1.0, tp_schedule="no-fuse")
    df["cmax"] = np.nan
    rows.append(df)
    out = pd.concat(rows, ignore_index=True)
    out.attrs.update(model=model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware)
    return out


def simulate_costs(
    costs: Sequence[str] = ("numel", "flops"),
    *,
    model: str = "qwen3-32b",
    dp: int = 32,
    tp: int = 8,
    optimizer: str = "muon",
    hardware: str = DEFAULT_HARDWARE,
) -> pd.DataFrame:
    """The cost-model ablation (Figure 16) predicted: lb-asc planned with each cost model."""
    return simulate_sweep("cost", costs, model=model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware, strategies=("lb-asc",))


def simulate_components(
    model: str = "qwen3-32b",
    *,
    dp: int = 32,
    tp: int = 8,
    optimizer: str = "muon",
    hardware: str = DEFAULT_HARDWARE,
    strategies: Sequence[str] = ("sc", "layerwise", "asc", "lb-asc"),
    alpha: float = 1.0,
) -> pd.DataFrame:
    """Where each strategy's predicted iteration goes, in the simulator's long form
    (:func:`canzona.sim.analysis.breakdown_long`): ``strategy``, ``phase`` (fwd_bwd / optimizer),
    ``component``, ``seconds``; the components of a strategy add up to its iteration time."""
    from canzona.sim.analysis import breakdown_long
    from canzona.sim.hardware import load_hardware
    from canzona.sim.model import simulate

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        res = simulate(model, dp=dp, tp=tp, optimizer=optimizer, hardware=load_hardware(hardware), strategies=tuple(strategies), alpha=alpha)
    out = breakdown_long(res, model=str(model), dp=dp, tp=tp, optimizer=optimizer, hardware=hardware)
    out.attrs.update(model=model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware,
                     iteration_s={k: b.iteration_s for k, b in res.items()})
    return out


def simulate_alpha(
    alphas: Sequence[float] = tuple(i / 10 for i in range(11)),
    *,
    model: str = "qwen3-32b",
    dp: int = 32,
    tp: int = 8,
    optimizer: str = "muon",
    hardware: str = DEFAULT_HARDWARE,
) -> pd.DataFrame:
    """Predicted lb-asc iteration per alpha (:func:`canzona.sim.analysis.alpha_sweep`), with the
    exposed DP communication and what ZeRO-1's equal chunks expose on the same buckets."""
    from canzona.sim.analysis import alpha_sweep
    from canzona.sim.hardware import load_hardware

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        out = alpha_sweep(model, alphas, dp=dp, tp=tp, optimizer=optimizer, hardware=load_hardware(hardware))
    out.attrs.update(model=model, dp=dp, tp=tp, optimizer=optimizer, hardware=hardware)
    return out


def paper_comparison_table(hardware: str = DEFAULT_HARDWARE, *, sensitivity: bool = True) -> pd.DataFrame:
    """The simulator's Figure 4 comparison (:func:`canzona.sim.analysis.paper_comparison`):
    predicted and paper seconds for layerwise and lb-asc, the ratios, and the assumption that
    moves each ratio most."""
    from canzona.sim.analysis import paper_comparison
    from canzona.sim.hardware import load_hardware

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return paper_comparison(load_hardware(hardware), sensitivity=sensitivity).table()


# ------------------------------------------------------------------------------------------ figures
def _paper_time(row: pd.Series, metric: str) -> float | None:
    alpha = float(row["alpha"]) if row["strategy"] == "lb-asc" and "alpha" in row else None
    for v in paper_values(metric=metric, strategy=row["strategy"], ablation=""):
        if v.matches(model=str(row["model"]), dp=int(row["dp"]), tp=int(row["tp"]), optimizer=str(row["optimizer"]),
                     alpha=alpha, cost=str(row.get("cost", "numel"))):
            return v.value
    return None


def fig_time_breakdown(df: pd.DataFrame) -> go.Figure:
    """Grouped bars per strategy: predicted forward+backward, optimizer step and iteration
    (seconds), with the paper's measured times (Figure 4) as diamonds where it has them."""
    if df.empty:
        raise ValueError("empty breakdown table")
    fig = go.Figure()
    labels = list(TIME_COLUMNS.values())
    for _, row in df.iterrows():
        st = row["strategy"]
        ys = [row[c] for c in TIME_COLUMNS]
        fig.add_trace(go.Bar(x=labels, y=ys, name=f"canzona sim: {st}", marker_color=strategy_color(st),
                             offsetgroup=st, hovertemplate=f"{st} %{{x}}: %{{y:.3f}} s<extra></extra>",
                             text=[f"{v:.3g}" for v in ys], textposition="outside", textfont=dict(size=10), cliponaxis=False))
    shown = False
    for _, row in df.iterrows():
        xs, ys = [], []
        for c, lab in TIME_COLUMNS.items():
            v = _paper_time(row, c)
            if v is not None:
                xs.append(lab)
                ys.append(v)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", marker=PAPER_MARKER, name="paper, Figure 4 (measured)",
                                     offsetgroup=row["strategy"], legendgroup="paper", showlegend=not shown,
                                     hovertemplate=f"paper {row['strategy']} %{{x}}: %{{y:.3f}} s<extra></extra>"))
            shown = True
    fig.update_layout(barmode="group", scattermode="group")
    r = df.iloc[0]
    return finish(fig, title=f"Predicted iteration breakdown: {r['model']}, {r['optimizer']}, DP{r['dp']} x TP{r['tp']} on {r['hardware']}",
                  x_title="part of the iteration", y_title="seconds per iteration", legend_title="strategy", height=460)


def fig_time_sweep(df: pd.DataFrame, *, x: str | None = None, metrics: Sequence[str] = ("optimizer_s", "iteration_s"), log_x: bool = True) -> go.Figure:
    """Predicted times against the sweep axis (from :func:`simulate_sweep`), one line per strategy,
    the paper's times as diamonds where a row is its configuration."""
    x = x or df.attrs.get("axis")
    if x == "model":
        x = "params_b"
    if x is None or x not in df:
        raise ValueError(f"no column {x!r} to draw against")
    label = {"dp": "DP size", "tp": "TP size", "params_b": "model size (billion parameters)", "alpha": "alpha",
             "cost": "planner cost model"}.get(x, x)
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[TIME_COLUMNS.get(m, m) for m in metrics])
    shown = False
    for c, m in enumerate(metrics, start=1):
        for i, st in enumerate(dict.fromkeys(df["strategy"])):
            d = df[df["strategy"] == st].sort_values(x)
            ls = line_style(i)
            fig.add_trace(go.Scatter(x=d[x], y=d[m], mode="lines+markers", name=st, legendgroup=st, showlegend=c == 1,
                                     line=dict(color=strategy_color(st), dash=ls["dash"]), marker=dict(symbol=ls["symbol"], size=ls["size"]),
                                     hovertemplate=f"{st}, {label} %{{x}}: %{{y:.3f}} s<extra></extra>"), row=1, col=c)
        px_, py_, pt_ = [], [], []
        for _, row in df.iterrows():
            v = _paper_time(row, m)
            if v is not None:
                px_.append(row[x])
                py_.append(v)
                pt_.append(row["strategy"])
        if px_:
            # diamonds name their strategy: several share the paper's x
            fig.add_trace(go.Scatter(x=px_, y=py_, mode="markers+text", marker=PAPER_MARKER, name="paper (measured)", legendgroup="paper",
                                     showlegend=not shown, text=pt_, textposition="middle right", textfont=dict(size=10), cliponaxis=False,
                                     hovertemplate="paper, %{text}: %{y:.3f} s<extra></extra>"), row=1, col=c)
            shown = True
        fig.update_yaxes(title_text="seconds per iteration", row=1, col=c)
        fig.update_xaxes(title_text=label, row=1, col=c)
        if log_x and x in ("dp", "tp", "params_b"):
            fig.update_xaxes(type="log", row=1, col=c, **log_ticks(df[x]))
    a = df.attrs
    return finish(fig, title=f"Predicted times vs {label}: {a.get('model', '')}, {a.get('optimizer', '')}, on {a.get('hardware', '')}",
                  legend_title="strategy", height=430)


def fig_cmax_time(df: pd.DataFrame) -> go.Figure:
    """Predicted optimizer step against C_max (from :func:`simulate_cmax`), no-fuse dashed; the
    paper's Figure 14 values (no-fuse ~0.11 s, fused ~0.073 s, plateau ~512 MB) beside them."""
    fused = df[df["cmax"].notna()].sort_values("cmax")
    nofuse = df[df["cmax"].isna()]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=fused["cmax"], y=fused["optimizer_s"], mode="lines+markers", name="canzona sim: fused micro-groups",
                             line_color="#2ca02c"))
    xs = [float(fused["cmax"].min()), float(fused["cmax"].max())]
    if len(nofuse):
        fig.add_trace(go.Scatter(x=xs, y=[float(nofuse["optimizer_s"].iloc[0])] * 2, mode="lines", line=dict(dash="dash", color="#d62728"),
                                 name="canzona sim: no-fuse"))
    nf, fu, pl = paper_value("optimizer_s_no_fuse"), paper_value("optimizer_s_fused"), paper_value("cmax_plateau_mb")
    fig.add_trace(go.Scatter(x=xs, y=[nf.value] * 2, mode="lines", line=dict(dash="dot", color="black"), name=f"paper no-fuse ~{nf.value} s ({nf.source})"))
    fig.add_trace(go.Scatter(x=[pl.value], y=[fu.value], mode="markers", marker=PAPER_MARKER, name=f"paper fused ~{fu.value} s, plateau ~{pl.value:.0f} MB"))
    fig.update_xaxes(type="log", **log_ticks([*fused["cmax"], pl.value]))
    a = df.attrs
    return finish(fig, title=f"Fusion capacity vs predicted optimizer step: {a.get('model')}, DP{a.get('dp')} x TP{a.get('tp')} on {a.get('hardware')}",
                  x_title="C_max (2^20 TP-local gradient elements per host per micro-group)", y_title="optimizer step (s)", legend_title="schedule", height=430)


def fig_cost_time(df: pd.DataFrame) -> go.Figure:
    """Predicted optimizer step of lb-asc planned with each cost model (from
    :func:`simulate_costs`), with the paper's Figure 16 values for numel and FLOPs."""
    costs = list(df["cost"])
    fig = go.Figure(go.Bar(x=costs, y=df["optimizer_s"], name="canzona sim", marker_color=categorical_colors(len(costs))))
    xs, ys = [], []
    for c in costs:
        for v in paper_values(metric="optimizer_s", strategy="lb-asc", ablation="cost-model"):
            if v.cost == c:
                xs.append(c)
                ys.append(v.value)
    if xs:
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", marker=PAPER_MARKER, name="paper, Figure 16 (measured)"))
    r = df.iloc[0]
    return finish(fig, title=f"Planner cost model vs predicted optimizer step: {r['model']}, DP{r['dp']} x TP{r['tp']}, lb-asc, on {r['hardware']}",
                  x_title="planner cost W(p)", y_title="optimizer step (s)", legend_title="source", height=400)


#: components coloured by family: forward/backward compute blues, communication of the
#: fwd-bwd pass purples and teal, optimizer work reds/oranges, optimizer communication browns
_COMPONENT_COLORS: dict[str, str] = {
    "fwd_compute": "#1f77b4",
    "bwd_compute": "#9ecae1",
    "tp_activation_comm": "#17becf",
    "dp_grad_exposed": "#6a3d9a",
    "dp_param_exposed": "#cab2d6",
    "opt_elementwise": "#fdbf6f",
    "opt_matrix_compute": "#d62728",
    "opt_tp_comm_exposed": "#ff7f0e",
    "opt_dp_comm": "#8c564b",
}

_COMPONENT_LABELS: dict[str, str] = {
    "fwd_compute": "forward compute",
    "bwd_compute": "backward compute",
    "tp_activation_comm": "TP activation comm.",
    "dp_grad_exposed": "exposed DP gradient comm.",
    "dp_param_exposed": "exposed DP parameter gather",
    "opt_elementwise": "optimizer: element-wise",
    "opt_matrix_compute": "optimizer: matrix math",
    "opt_tp_comm_exposed": "optimizer: exposed TP exchange",
    "opt_dp_comm": "optimizer: DP comm. in the step",
}


def fig_time_components(df: pd.DataFrame) -> go.Figure:
    """Stacked bars per strategy: the predicted iteration split into its components (from
    :func:`simulate_components`); the paper's measured iteration times (Figure 4) as diamonds
    where the configuration is the paper's."""
    if df.empty:
        raise ValueError("empty component table")
    strategies = list(dict.fromkeys(df["strategy"]))
    comps = list(dict.fromkeys(df["component"]))
    spare = iter(categorical_colors(len(comps)))
    colors = {c: _COMPONENT_COLORS.get(c) or next(spare) for c in comps}
    fig = go.Figure()
    for comp in comps:
        d = df[df["component"] == comp].groupby("strategy")["seconds"].sum().reindex(strategies, fill_value=0.0)
        fig.add_trace(go.Bar(x=strategies, y=d.to_numpy(), name=_COMPONENT_LABELS.get(comp, comp), marker_color=colors[comp],
                             hovertemplate=_COMPONENT_LABELS.get(comp, comp) + ": %{y:.4f} s<extra>%{x}</extra>"))
    r = df.iloc[0]
    xs, ys = [], []
    for st in strategies:
        for v in paper_values(metric="iteration_s", strategy=st, ablation=""):
            if v.matches(model=str(r["model"]), dp=int(r["dp"]), tp=int(r["tp"]), optimizer=str(r["optimizer"])):
                xs.append(st)
                ys.append(v.value)
    if xs:
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", marker=PAPER_MARKER, name="paper iteration, Figure 4 (measured)"))
    fig.update_layout(barmode="stack")
    return finish(fig, title=f"Predicted iteration by component: {r['model']}, {r['optimizer']}, DP{r['dp']} x TP{r['tp']} on {r['hardware']}",
                  x_title="strategy", y_title="seconds per iteration", legend_title="component", height=480)


def fig_alpha_time(df: pd.DataFrame) -> go.Figure:
    """Predicted lb-asc times against alpha (from :func:`simulate_alpha`): optimizer step,
    iteration, and the DP communication left exposed, with ZeRO-1's exposure as the reference."""
    d = df.sort_values("alpha")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("optimizer step and iteration", "exposed DP communication"))
    for key, col, label in (("optimizer_s", "#2ca02c", "optimizer step"), ("iteration_s", "#1f77b4", "iteration")):
        fig.add_trace(go.Scatter(x=d["alpha"], y=d[key], mode="lines+markers", name=label, line_color=col), row=1, col=1)
    fig.add_trace(go.Scatter(x=d["alpha"], y=d["dp_exposed_s"], mode="lines+markers", name="lb-asc exposed DP comm.", line_color="#d62728"), row=1, col=2)
    fig.add_trace(go.Scatter(x=d["alpha"], y=d["zero1_dp_exposed_s"], mode="lines", name="zero1 equal chunks (reference)",
                             line=dict(dash="dash", color="#7f7f7f")), row=1, col=2)
    fig.update_xaxes(title_text="alpha (0: equal shards, 1: balance compute)")
    fig.update_yaxes(title_text="seconds per iteration", row=1, col=1)
    fig.update_yaxes(title_text="seconds per iteration", row=1, col=2)
    a = df.attrs
    return finish(fig, title=f"Predicted alpha trade-off (lb-asc): {a.get('model')}, DP{a.get('dp')} x TP{a.get('tp')} on {a.get('hardware')}",
                  legend_title="quantity", height=430)
