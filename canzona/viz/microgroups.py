"""TP micro-groups of a plan (Section 4, Algorithm 2): Gantt charts, makespans and sweeps.

Inside one DP rank every TP-split matrix parameter is a task whose host TP rank runs the full
update. Two readings of a schedule's length:

* ``sync``: micro-groups run one after the other, each ending when its busiest host finishes
  (every group is bracketed by its fused all-to-alls): makespan = sum over groups of max host load;
* ``free``: exchanges are issued ahead and hosts run free: makespan = busiest host's total.

Durations are in work units of the chosen metric (FLOPs by default: multiply-adds, see
:mod:`canzona.cost`), on the shape the host really processes (full, or the shard under the
paper's ``flops_shape="local"`` accounting); communication is not drawn here (that is the
simulator's and the profiler's job).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from canzona.cost import matrix_flops, param_flops, param_memory, state_bytes
from canzona.paper import paper_value
from canzona.plan.build import cmax_from_bytes, cmax_to_bytes, plan_model
from canzona.plan.plan import DEFAULT_FLOPS_SHAPE, Plan
from canzona.specs import ParamSpec, split_task_name
from canzona.viz._style import GFLOP, GIB, MEGA, categorical_colors, finish, line_style, log_ticks
from canzona.viz.partition import load_ratio, plan_label, rank_experts, rank_loads

__all__ = [
    "LEGEND_MAX_GROUPS",
    "TASK_METRICS",
    "task_work",
    "task_table",
    "tp_host_loads",
    "one_host_groups",
    "microgroup_summary",
    "cmax_sweep",
    "tp_sweep",
    "fig_microgroup_gantt",
    "fig_tp_host_loads",
    "fig_cmax_sweep",
    "fig_tp_sweep",
]

#: what a task's bar length measures: optimizer FLOPs, optimizer-state bytes, or elements
TASK_METRICS: dict[str, tuple[float, str]] = {
    "flops": (GFLOP, "GFLOP, multiply-adds"),
    "memory": (GIB, "GiB of optimizer state"),
    "numel": (MEGA, "million elements"),
}


#: a Gantt chart with more micro-groups than this alternates two shades instead of one colour each
LEGEND_MAX_GROUPS = 10


def _num(x: float) -> str:
    """Readable magnitude: 6,711 rather than 6.71e+03; 3 significant digits below 100."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _check_metric(metric: str) -> None:
    if metric not in TASK_METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(TASK_METRICS)}")


def task_work(spec: ParamSpec, optimizer: str, flops_shape: str, metric: str = "flops") -> float:
    """Work of one task on its host: the optimizer on the full tensor (``flops_shape="full"``) or on
    the shard shape (``local``, the paper's accounting)."""
    _check_metric(metric)
    shape = spec.shape if flops_shape == "full" else spec.local_shape
    if metric == "flops":
        return float(matrix_flops(optimizer, shape))
    if metric == "memory":
        return float(state_bytes(optimizer, shape))
    return float(np.prod(shape))


def _task_spec(by_name: Mapping[str, Any], task: str) -> ParamSpec:
    """The spec of one micro-group task: its parameter's, or for ``stack[e]`` (an expert of a
    TP-split stack) the ``(M, N)`` matrix of that expert with the stack's TP split."""
    base, expert = split_task_name(task)
    spec = by_name[base].spec
    if expert is None:
        return spec
    return ParamSpec(task, spec.task_shape, "matrix", spec.task_tp_dim, spec.tp)


def _check_rank(plan: Plan, dp_rank: int) -> None:
    if not isinstance(dp_rank, (int, np.integer)) or not 0 <= dp_rank < plan.inputs.dp:
        raise ValueError(f"dp_rank must be in [0, {plan.inputs.dp}), got {dp_rank!r}")


def task_table(plan: Plan, dp_rank: int = 0, *, metric: str = "flops") -> pd.DataFrame:
    """One row per task of DP rank ``dp_rank``'s micro-groups, in group then scheduling order.

    Columns: ``group``, ``host``, ``param``, ``shape``, ``work`` (in ``metric`` units, raw: FLOPs,
    bytes or elements), ``grad_bytes`` (full gradient the host receives), ``start`` / ``end`` on
    the ``sync`` timeline and ``start_free`` / ``end_free`` on the ``free`` one (see the module
    docstring). Empty when the plan has no micro-groups (TP 1, schedule ``sync``, ``zero1``).
    """
    _check_metric(metric)
    _check_rank(plan, dp_rank)
    inp = plan.inputs
    cols = ["group", "host", "param", "shape", "work", "grad_bytes", "start", "end", "start_free", "end_free"]
    if not plan.micro_groups:
        return pd.DataFrame(columns=cols)
    by_name = plan.by_name()
    rows = []
    t0 = 0.0
    free = np.zeros(inp.tp)
    for g in plan.micro_groups[dp_rank]:
        clock = np.zeros(inp.tp)
        for n, h in zip(g.params, g.hosts):
            spec = _task_spec(by_name, n)
            w = task_work(spec, inp.optimizer, inp.flops_shape, metric)
            rows.append(
                (g.index, h, n, " x ".join(map(str, spec.shape)), w, inp.grad_bytes * spec.numel,
                 t0 + clock[h], t0 + clock[h] + w, free[h], free[h] + w)
            )
            clock[h] += w
            free[h] += w
        t0 += float(clock.max())
    return pd.DataFrame(rows, columns=cols)


def _owned_tasks(plan: Plan) -> dict[int, list]:
    """TP-split matrix parameters each DP rank is responsible for (all of them for every rank
    under ``sc``; a matrix cut by ``zero1`` belongs to no single rank and is no task)."""
    inp = plan.inputs
    tasks = [p for p in plan.params if p.spec.kind == "matrix" and p.spec.tp_split]
    if plan.every_rank_updates:
        return {r: list(tasks) for r in range(inp.dp)}
    out: dict[int, list] = {r: [] for r in range(inp.dp)}
    for p in tasks:
        if p.dp_owner is not None:
            out[p.dp_owner].append(p)
    return out


def _host_loads(plan: Plan, base: pd.Series, owned: list) -> pd.DataFrame:
    inp = plan.inputs
    tp = inp.tp
    opt, shape = inp.optimizer, inp.flops_shape
    shared_f = float(base["flops"]) - sum(param_flops(p.spec, opt, shape) for p in owned)
    shared_m = float(base["memory_bytes"]) - sum(param_memory(p.spec, opt, shape) for p in owned)
    flops = np.full(tp, shared_f)
    memory = np.full(tp, shared_m)
    tasks = np.zeros(tp, dtype=np.int64)
    for p in owned:
        f = task_work(p.spec, opt, shape, "flops")
        m = task_work(p.spec, opt, shape, "memory")
        if p.tp_host is None:  # sync: everyone recomputes it
            flops += f
            memory += m
            tasks += 1
        else:
            flops[p.tp_host] += f
            memory[p.tp_host] += m
            tasks[p.tp_host] += 1
    df = pd.DataFrame({"flops": flops, "memory_bytes": memory, "tasks": tasks})
    df.index.name = "tp_rank"
    return df


def tp_host_loads(plan: Plan, dp_rank: int = 0) -> pd.DataFrame:
    """Cumulative optimizer load of each TP rank of DP rank ``dp_rank`` over the whole step.

    Every TP rank does the work that never leaves it (element-wise parameters on its shard,
    replicated matrices); a host adds the full update of each task it hosts; under the ``sync``
    TP schedule every TP rank recomputes every task. Columns (index ``tp_rank``): ``flops``,
    ``memory_bytes``, ``tasks``. The planner's TP ratios are max/mean of these for its worst DP
    rank.
    """
    _check_rank(plan, dp_rank)
    return _host_loads(plan, rank_loads(plan).loc[dp_rank], _owned_tasks(plan)[dp_rank])


def microgroup_summary(plan: Plan, *, metric: str = "flops") -> pd.DataFrame:
    """Per DP rank: ``groups``, ``tasks``, ``makespan_sync`` and ``makespan_free`` (raw ``metric``
    units, TP-split matrix tasks only), ``host_ratio`` (max/mean of hosted work) and the TP R_LB of
    the rank's whole optimizer load, ``tp_flops_ratio`` / ``tp_memory_ratio`` (see
    :func:`tp_host_loads`). Without micro-groups (TP schedule ``sync``) every TP rank runs every
    task, so both makespans are the rank's total task work."""
    _check_metric(metric)
    inp = plan.inputs
    loads = rank_loads(plan)
    owned = _owned_tasks(plan)
    rows = []
    for r in range(inp.dp):
        t = task_table(plan, r, metric=metric)
        hosts = _host_loads(plan, loads.loc[r], owned[r])
        per_host = np.zeros(inp.tp)
        if len(t):
            np.add.at(per_host, t["host"].to_numpy(dtype=np.int64), t["work"].to_numpy(dtype=np.float64))
            span_sync, span_free = float(t["end"].max()), float(t["end_free"].max())
        else:
            total = sum(task_work(p.spec, inp.optimizer, inp.flops_shape, metric) for p in owned[r])
            per_host += total
            span_sync = span_free = float(total)
        rows.append({
            "dp_rank": r,
            "groups": int(t["group"].nunique()) if len(t) else 0,
            "tasks": len(t) if len(t) else len(owned[r]),
            "makespan_sync": span_sync,
            "makespan_free": span_free,
            "host_ratio": load_ratio(per_host),
            "tp_flops_ratio": load_ratio(hosts["flops"]),
            "tp_memory_ratio": load_ratio(hosts["memory_bytes"]),
        })
    return pd.DataFrame(rows).set_index("dp_rank")


def _quiet_plan(model: str, **kw) -> tuple[Plan, int]:
    """A plan and the number of warnings the planner raised (tasks above C_max): sweeps report
    the count in a column instead of printing one warning per configuration."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_model(model, **kw)
    return plan, len(caught)


def _sweep_row(plan: Plan, n_warn: int, metric: str) -> dict:
    s = microgroup_summary(plan, metric=metric)
    worst = int(s["makespan_sync"].idxmax())
    return {
        "groups_max": int(s["groups"].max()),
        "groups_total": int(s["groups"].sum()),
        "all_to_alls": 2 * int(s["groups"].max()),
        "makespan_sync": float(s["makespan_sync"].max()),
        "makespan_free": float(s["makespan_free"].max()),
        "worst_dp_rank": worst,
        "tp_flops_ratio": plan.metrics.tp_flops_ratio,
        "tp_memory_ratio": plan.metrics.tp_memory_ratio,
        "oversize_tasks_warned": n_warn,
        "plan_ms": plan.metrics.plan_seconds * 1e3,
    }


def cmax_sweep(
    model: str = "qwen3-32b",
    *,
    dp: int = 16,
    tp: int = 8,
    cmax: Sequence[float] = (4, 8, 16, 32, 64, 128, 512, 2048),
    optimizer: str = "muon",
    strategy: str = "lb-asc",
    tp_schedule: str | None = None,
    include_no_fuse: bool = True,
    metric: str = "flops",
    flops_shape: str = DEFAULT_FLOPS_SHAPE,
) -> pd.DataFrame:
    """The fusion-capacity ablation (Appendix C.6, Figure 14) redone with the planner.

    One row per C_max (in :data:`canzona.plan.CMAX_UNIT`, 2^20 TP-local gradient elements a host
    may receive per micro-group) plus one for the ``no-fuse`` schedule (one task per group);
    ``tp_schedule`` None: the strategy's default. Columns: ``schedule``, ``cmax`` (NaN for
    no-fuse), ``groups_max`` (micro-groups of the busiest DP rank), ``groups_total``,
    ``all_to_alls`` (2 per group: gather and scatter), ``makespan_sync`` / ``makespan_free`` (worst
    DP rank, raw ``metric`` units), ``tp_flops_ratio``, ``tp_memory_ratio``,
    ``oversize_tasks_warned``, ``plan_ms``. The default DP16 x TP8 is the paper's configuration.
    ``flops_shape``: task work on the full matrix a host processes (default) or on the shard
    (``local``, the paper's accounting); it is recorded in ``attrs`` and the figure's title.
    """
    if not cmax:
        raise ValueError("cmax needs at least one capacity")
    rows = []
    for c in cmax:
        if not c > 0:
            raise ValueError(f"C_max must be positive, got {c}")
        plan, nw = _quiet_plan(model, dp=dp, tp=tp, optimizer=optimizer, strategy=strategy, flops_shape=flops_shape,
                               tp_schedule=tp_schedule, cmax_bytes=cmax_to_bytes(c, tp))
        rows.append({"schedule": plan.inputs.tp_schedule, "cmax": float(c), **_sweep_row(plan, nw, metric)})
    if include_no_fuse:
        plan, nw = _quiet_plan(model, dp=dp, tp=tp, optimizer=optimizer, strategy=strategy, flops_shape=flops_shape, tp_schedule="no-fuse")
        rows.append({"schedule": "no-fuse", "cmax": np.nan, **_sweep_row(plan, nw, metric)})
    df = pd.DataFrame(rows)
    df.attrs.update(model=model, dp=dp, tp=tp, optimizer=optimizer, strategy=strategy, metric=metric, flops_shape=flops_shape)
    return df


def tp_sweep(
    model: str = "qwen3-32b",
    *,
    dp: int = 32,
    tps: Sequence[int] = (2, 4, 8),
    schedules: Sequence[str] = ("round-robin", "lpt", "lpt-carry", "no-fuse", "sync"),
    optimizer: str = "muon",
    strategy: str = "lb-asc",
    metric: str = "flops",
    flops_shape: str = DEFAULT_FLOPS_SHAPE,
) -> pd.DataFrame:
    """TP scaling (Appendix C.3, Figure 8b) with the DP partition fixed to ``strategy`` so only the
    TP schedule changes. One row per (tp, schedule); columns as in :func:`cmax_sweep` plus ``tp``;
    ``flops_shape`` as there."""
    rows = []
    for t in tps:
        for sch in schedules:
            plan, nw = _quiet_plan(model, dp=dp, tp=int(t), optimizer=optimizer, strategy=strategy, tp_schedule=sch, flops_shape=flops_shape)
            rows.append({"tp": int(t), "schedule": sch, **_sweep_row(plan, nw, metric)})
    df = pd.DataFrame(rows)
    df.attrs.update(model=model, dp=dp, optimizer=optimizer, strategy=strategy, metric=metric, flops_shape=flops_shape)
    return df


# ------------------------------------------------------------------------------------------ figures
def fig_microgroup_gantt(plan: Plan, dp_rank: int = 0, *, metric: str = "flops", timeline: str = "sync") -> go.Figure:
    """Gantt chart of DP rank ``dp_rank``'s micro-groups: one row per TP host rank, one bar per
    task, coloured by micro-group; dotted lines mark group boundaries on the ``sync`` timeline.
    The title gives the makespan and the TP R_LB ratios."""
    if timeline not in ("sync", "free"):
        raise ValueError(f"timeline must be 'sync' or 'free', got {timeline!r}")
    t = task_table(plan, dp_rank, metric=metric)
    scale, unit = TASK_METRICS[metric]
    inp = plan.inputs
    fig = go.Figure()
    s_col, e_col = ("start", "end") if timeline == "sync" else ("start_free", "end_free")
    if len(t):
        _add_task_bars(fig, t, s_col, e_col, scale, unit)
        if timeline == "sync":
            bounds = t.groupby("group")["end"].max().sort_index().to_numpy() / scale
            for x in bounds[:-1]:
                fig.add_vline(x=float(x), line_dash="dot", line_color="gray", line_width=1)
        span = float(t[e_col].max()) / scale
    else:
        # no micro-groups (TP schedule sync): every TP rank runs every task this DP rank owns,
        # so the makespan is their total work, as microgroup_summary reports it
        owned = _owned_tasks(plan)[dp_rank]
        span = sum(task_work(p.spec, inp.optimizer, inp.flops_shape, metric) for p in owned) / scale
        if span > 0:
            fig.update_xaxes(range=[0, span * 1.05])
    rows = [f"TP rank {h}" for h in range(inp.tp)]
    # an invisible point per TP rank keeps idle hosts on the chart: a category axis only shows
    # categories that hold data, and an idle host is exactly what a bad schedule looks like
    fig.add_trace(go.Scatter(x=[0.0] * inp.tp, y=rows, mode="markers", marker=dict(opacity=0), showlegend=False,
                             hoverinfo="skip", name="TP ranks"))
    fig.update_layout(barmode="overlay", bargap=0.3, showlegend=True, uniformtext=dict(minsize=8, mode="hide"))
    fig.update_yaxes(categoryorder="array", categoryarray=rows[::-1])
    return finish(
        fig,
        title=_gantt_title(plan, dp_rank, has_groups=bool(len(t)), span=span, unit=unit, timeline=timeline),
        x_title=f"optimizer work on the host ({unit}), {timeline} timeline",
        y_title="host TP rank",
        legend_title="micro-group (gK on bars)",
        height=max(360, 40 * inp.tp + 180),
    )


def _group_series(t: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """(legend name, colour, rows) per bar series: one per micro-group, or even/odd groups when
    there are too many for distinct colours."""
    groups = sorted(int(k) for k in t["group"].unique())
    # beyond a qualitative palette's worth of groups distinct colours stop being readable (and
    # the legend scrolls): alternate two shades; the group number is printed on every bar
    many = len(groups) > LEGEND_MAX_GROUPS
    palette = categorical_colors(2 if many else len(groups))
    if many:
        parity = t["group"].to_numpy() % 2
        return [(f"{'even' if k == 0 else 'odd'} micro-groups", palette[k], t[parity == k]) for k in (0, 1)]
    return [(f"micro-group {k}", palette[i], t[t["group"] == k]) for i, k in enumerate(groups)]


def _add_task_bars(fig: go.Figure, t: pd.DataFrame, s_col: str, e_col: str, scale: float, unit: str) -> None:
    """One horizontal bar per task of ``t`` on its host's row, from ``s_col`` to ``e_col``."""
    for name, color, g in _group_series(t):
        if not len(g):
            continue
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[f"TP rank {h}" for h in g["host"]],
                x=(g["work"] / scale).to_numpy(),
                base=(g[s_col] / scale).to_numpy(),
                name=name,
                marker=dict(color=color, line=dict(color="white", width=0.6)),
                text=[f"g{k}" for k in g["group"]],
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,
                customdata=np.stack(
                    [g["param"], g["shape"], g["group"], g["grad_bytes"] / 2**20, g[s_col] / scale, g[e_col] / scale], axis=-1
                ),
                hovertemplate=(
                    "%{customdata[0]}<br>full shape %{customdata[1]}<br>micro-group %{customdata[2]}, "
                    "%{customdata[3]:.0f} MiB gradient<br>%{customdata[4]:.4g} .. %{customdata[5]:.4g} " + unit
                    + " (%{x:.4g})<extra>%{y}</extra>"
                ),
            )
        )


def _gantt_title(plan: Plan, dp_rank: int, *, has_groups: bool, span: float, unit: str, timeline: str) -> str:
    """The Gantt chart's title: makespan, plan, C_max, what the makespan means, the TP R_LB
    ratios, and why one-host groups and whole experts appear (or do not)."""
    inp = plan.inputs
    host_loads = tp_host_loads(plan, dp_rank)
    what = "sum over micro-groups of each group's busiest host" if timeline == "sync" else "busiest host, hosts running free"
    empty = "" if has_groups else " (no micro-groups)"
    if not has_groups:
        what = "TP schedule sync or TP 1, every TP rank runs every task this DP rank owns"
    lone = one_host_groups(plan, dp_rank)
    why = ""
    if lone:
        more = f" (and {len(lone) - 1} more such group(s))" if len(lone) > 1 else ""
        why = f"<br>one-host {lone[0]}{more}"
    stacks, experts = rank_experts(plan, dp_rank)
    if stacks:  # experts are whole on their DP owner: no micro-group carries them
        why += f"<br>not on the chart: {experts} experts of {stacks} expert stacks, updated whole by this DP rank (viz.expert_groups)"
    return (
        f"Micro-group schedule of DP rank {dp_rank}{empty}: makespan {_num(span)} {unit}<br>"
        f"<sup>{plan_label(plan)}, FLOPs on {inp.flops_shape} shapes, TP schedule {inp.tp_schedule}, "
        f"C_max {cmax_from_bytes(inp.cmax_bytes, inp.tp, inp.grad_bytes):g} (2^20 TP-local elements per host)<br>makespan: {what}; this rank's TP R_LB FLOPs "
        f"{load_ratio(host_loads['flops']):.2f}, memory {load_ratio(host_loads['memory_bytes']):.2f}{why}</sup>"
    )


def one_host_groups(plan: Plan, dp_rank: int) -> list[str]:
    """Why each one-task micro-group of ``dp_rank`` exists: the task's gathered gradient alone
    exceeds C_max (``grad_bytes * numel`` of the full matrix), so Algorithm 2 cannot pair it."""
    i = plan.inputs
    out = []
    groups = plan.micro_groups[dp_rank] if plan.micro_groups else ()
    for g in groups:
        if len(g.params) != 1:
            continue
        spec = _task_spec(plan.by_name(), g.params[0])
        nbytes = i.grad_bytes * spec.numel
        if nbytes > i.cmax_bytes:
            out.append(f"group {g.index}: {spec.name} alone is {nbytes / GIB:.2f} GiB of gathered gradient "
                       f"> C_max {i.cmax_bytes / GIB:.2f} GiB, so it is a group of its own (host TP {g.hosts[0]})")
    return out


def fig_tp_host_loads(plan: Plan, dp_rank: int = 0) -> go.Figure:
    """Cumulative optimizer FLOPs and state memory per TP rank of one DP rank (bars) with the
    mean (dashed): the TP load balance of Figure 3b."""
    loads = tp_host_loads(plan, dp_rank)
    rf, rm = load_ratio(loads["flops"]), load_ratio(loads["memory_bytes"])
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"FLOPs (R_LB {rf:.2f})", f"optimizer-state memory (R_LB {rm:.2f})"))
    x = loads.index.to_numpy()
    for c, (key, scale, label) in enumerate((("flops", GFLOP, "FLOPs per TP rank"), ("memory_bytes", GIB, "memory per TP rank")), start=1):
        v = loads[key].to_numpy() / scale
        unit = "GFLOP" if key == "flops" else "GiB"
        fig.add_trace(go.Bar(x=x, y=v, name=label, marker_color=categorical_colors(2)[c - 1],
                             hovertemplate=f"TP rank %{{x}}: %{{y:.4g}} {unit} (mean {v.mean():.4g})<extra></extra>"), row=1, col=c)
        fig.add_trace(
            go.Scatter(x=[x.min() - 0.5, x.max() + 0.5], y=[v.mean()] * 2, mode="lines", line=dict(dash="dash", color="black"),
                       name="mean over TP ranks", legendgroup="mean", showlegend=c == 1),
            row=1, col=c,
        )
        fig.update_xaxes(title_text="TP rank", row=1, col=c, tickmode="array", tickvals=list(x))
    fig.update_yaxes(title_text="GFLOP per step", row=1, col=1)
    fig.update_yaxes(title_text="GiB", row=1, col=2)
    return finish(
        fig,
        title=f"TP load of DP rank {dp_rank}: R_LB FLOPs {rf:.2f}, memory {rm:.2f}<br><sup>{plan_label(plan)}, TP schedule {plan.inputs.tp_schedule}</sup>",
        legend_title="quantity",
        height=400,
    )


def fig_cmax_sweep(df: pd.DataFrame) -> go.Figure:
    """Makespan and all-to-all count against C_max (from :func:`cmax_sweep`); the no-fuse schedule
    as dashed horizontal lines; the paper's plateau C_max (Figure 14) as a vertical marker."""
    metric = df.attrs.get("metric", "flops")
    scale, unit = TASK_METRICS[metric]
    fused = df[df["schedule"] != "no-fuse"].sort_values("cmax")
    nofuse = df[df["schedule"] == "no-fuse"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("optimizer makespan of the busiest DP rank", "fused all-to-alls per step (busiest DP rank)"))
    for key, dash, label in (("makespan_sync", "solid", "groups in sequence (sync)"), ("makespan_free", "dot", "hosts run free")):
        fig.add_trace(go.Scatter(x=fused["cmax"], y=fused[key] / scale, mode="lines+markers", line=dict(dash=dash, color="#2ca02c"),
                                 name=f"micro-groups, {label}"), row=1, col=1)
    fig.add_trace(go.Scatter(x=fused["cmax"], y=fused["all_to_alls"], mode="lines+markers", line=dict(color="#2ca02c"),
                             name="micro-groups: all-to-alls"), row=1, col=2)
    if len(nofuse):
        r = nofuse.iloc[0]
        xs = [fused["cmax"].min(), fused["cmax"].max()] if len(fused) else [1, 2]
        fig.add_trace(go.Scatter(x=xs, y=[r["makespan_sync"] / scale] * 2, mode="lines", line=dict(dash="dash", color="#d62728"),
                                 name="no-fuse (one task per group)"), row=1, col=1)
        fig.add_trace(go.Scatter(x=xs, y=[r["all_to_alls"]] * 2, mode="lines", line=dict(dash="dash", color="#d62728"),
                                 name="no-fuse: all-to-alls"), row=1, col=2)
    # the paper's plateau as a vertical line drawn in data coordinates (a layout shape on a log
    # axis would need log10 coordinates)
    plateau = paper_value("cmax_plateau_mb")
    tops = (float(df[["makespan_sync", "makespan_free"]].to_numpy().max()) / scale, float(df["all_to_alls"].max()))
    for c, top in enumerate(tops, start=1):
        fig.add_trace(go.Scatter(x=[plateau.value] * 2, y=[0.0, top], mode="lines", line=dict(dash="dot", color="black"),
                                 name=f"{plateau.label}: plateau at C_max ~{plateau.value:.0f} MB", legendgroup="paper",
                                 showlegend=c == 1, hoverinfo="skip"), row=1, col=c)
    fig.update_xaxes(type="log", title_text="C_max (2^20 TP-local gradient elements per host per micro-group)",
                     **log_ticks([*df["cmax"], plateau.value]))
    fig.update_yaxes(title_text=f"makespan ({unit})", row=1, col=1)
    fig.update_yaxes(title_text="all-to-all calls per step", row=1, col=2)
    a = df.attrs
    return finish(
        fig,
        title=(f"Fusion capacity sweep: {a.get('model')}, {a.get('optimizer')}, DP{a.get('dp')} x TP{a.get('tp')}, {a.get('strategy')}"
               f"<br><sup>makespan in {unit} on {a.get('flops_shape', 'full')} shapes; hosts-run-free dotted under the sync line where they agree</sup>"),
        legend_title="schedule",
        legend_below=True,
        height=540,
    )


def fig_tp_sweep(df: pd.DataFrame) -> go.Figure:
    """TP FLOPs R_LB and makespan against TP size, one line per TP schedule (from :func:`tp_sweep`)."""
    metric = df.attrs.get("metric", "flops")
    scale, unit = TASK_METRICS[metric]
    schedules = list(dict.fromkeys(df["schedule"]))
    colors = categorical_colors(len(schedules))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TP FLOPs R_LB (worst DP rank)", "micro-group makespan (sync timeline)"))
    for i, (sch, col) in enumerate(zip(schedules, colors)):
        st = line_style(i)
        line = dict(color=col, dash=st["dash"])
        marker = dict(symbol=st["symbol"], size=st["size"])
        d = df[df["schedule"] == sch].sort_values("tp")
        fig.add_trace(go.Scatter(x=d["tp"], y=d["tp_flops_ratio"], mode="lines+markers", name=sch, legendgroup=sch, line=line,
                                 marker=marker, hovertemplate=f"{sch}, TP%{{x}}: R_LB %{{y:.3f}}<extra></extra>"), row=1, col=1)
        fig.add_trace(go.Scatter(x=d["tp"], y=d["makespan_sync"] / scale, mode="lines+markers", name=sch, legendgroup=sch,
                                 showlegend=False, line=line, marker=marker,
                                 hovertemplate=f"{sch}, TP%{{x}}: %{{y:,.0f}} {unit}<extra></extra>"), row=1, col=2)
    fig.update_xaxes(title_text="TP size (ranks per TP group)", type="log", **log_ticks(df["tp"]))
    fig.update_yaxes(title_text="R_LB (max / mean)", row=1, col=1)
    fig.update_yaxes(title_text=f"makespan ({unit})", row=1, col=2)
    a = df.attrs
    return finish(fig, title=(f"TP scaling: {a.get('model')}, {a.get('optimizer')}, DP{a.get('dp')}, DP strategy {a.get('strategy')}"
                              f"<br><sup>worst DP rank; work on {a.get('flops_shape', 'full')} shapes; coinciding schedules drawn dashed over solid</sup>"),
                  legend_title="TP schedule", height=440)
