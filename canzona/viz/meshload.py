"""The optimizer load of every GPU of the mesh, with the atomic lower bound.

Companion to the micro-group Gantt (:mod:`canzona.viz.microgroups`): the Gantt shows one DP
rank's TP group; this view shows all ``dp x tp`` GPUs, so a reader sees whether one group's
imbalance is the plan's or the model's. The dashed lines are the mean GPU load and the atomic
lower bound (the largest single matrix update over the mean, :func:`canzona.plan.convention.lower_bound`):
no schedule that keeps matrices whole can bring the busiest GPU below it.

:func:`illustrative_dp_rank` picks the DP rank a Gantt should open on (one that shows the
schedule's character rather than DP rank 0 by default), and :func:`one_host_groups` lists the
micro-groups that hold a single task because that task alone exceeds C_max, with the reason
(defined in :mod:`canzona.viz.microgroups`, which draws the reason on the Gantt).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from canzona.plan import Plan
from canzona.plan.convention import lower_bound
from canzona.viz._style import GIB
# one_host_groups lives with the micro-group figures (this module builds on them, never the reverse)
from canzona.viz.microgroups import one_host_groups, tp_host_loads
from canzona.viz.partition import plan_label

__all__ = ["gpu_loads", "mesh_lower_bound", "illustrative_dp_rank", "fig_gpu_loads"]


def gpu_loads(plan: Plan, metric: str = "flops") -> pd.DataFrame:
    """One row per GPU (``dp_rank``, ``tp_rank``) with its cumulative optimizer ``flops`` or
    ``memory_bytes`` over the step (the same per-host accounting as the Gantt's host loads)."""
    if metric not in ("flops", "memory_bytes"):
        raise ValueError(f"metric must be 'flops' or 'memory_bytes', got {metric!r}")
    rows = []
    for r in range(plan.inputs.dp):
        h = tp_host_loads(plan, r)
        for t, v in enumerate(h[metric].tolist()):
            rows.append({"dp_rank": r, "tp_rank": t, "gpu": r * plan.inputs.tp + t, metric: v})
    return pd.DataFrame(rows)


def mesh_lower_bound(plan: Plan) -> float:
    """max / mean of the GPU loads cannot go below this when matrices stay whole (full shapes)."""
    i = plan.inputs
    return lower_bound(plan.specs, i.dp, i.tp, i.optimizer if i.optimizer != "adamw" else "muon")


def illustrative_dp_rank(plan: Plan) -> int:
    """The DP rank whose TP schedule shows the plan's character: the busiest GPU's DP rank among
    those with more than one micro-group (ties: more tasks, then the lower rank); rank 0 without
    micro-groups."""
    if not plan.micro_groups or not any(plan.micro_groups):
        return 0
    df = gpu_loads(plan)
    peak = df.groupby("dp_rank")["flops"].max()
    n_groups = {r: len(g) for r, g in enumerate(plan.micro_groups)}
    n_tasks = {r: sum(len(x.params) for x in g) for r, g in enumerate(plan.micro_groups)}
    cands = [r for r in range(plan.inputs.dp) if n_groups[r] > 1] or list(range(plan.inputs.dp))
    return max(cands, key=lambda r: (float(peak[r]), n_tasks[r], -r))


def fig_gpu_loads(plan: Plan, metric: str = "flops") -> go.Figure:
    """Bars of every GPU's load in mesh order (coloured by DP rank), the mean and the atomic
    lower bound as dashed lines; the title gives max / mean beside the bound."""
    df = gpu_loads(plan, metric)
    vals = df[metric].to_numpy(dtype=float)
    mean = float(vals.mean()) if len(vals) else 0.0
    ratio = float(vals.max()) / mean if mean > 0 else 1.0
    bound = mesh_lower_bound(plan)
    scale, unit = (1e12, "TFLOP") if metric == "flops" else (GIB, "GiB")
    fig = go.Figure()
    fig.add_trace(go.Bar(x=df["gpu"], y=vals / scale, name="GPU load", marker=dict(color=df["dp_rank"], colorscale="Viridis"),
                         customdata=np.stack([df["dp_rank"], df["tp_rank"]], axis=1),
                         hovertemplate="DP %{customdata[0]} TP %{customdata[1]}: %{y:.3f} " + unit + "<extra></extra>"))
    for y, name, dash in ((mean, "mean", "dash"), (mean * bound, f"atomic lower bound ({bound:.2f} x mean)", "dot")):
        fig.add_trace(go.Scatter(x=[df["gpu"].min(), df["gpu"].max()], y=[y / scale] * 2, mode="lines", name=name,
                                 line=dict(dash=dash, color="black")))
    fig.update_layout(
        title=f"Optimizer {metric.replace('_bytes', '')} of every GPU: max/mean {ratio:.2f} (bound {bound:.2f})"
              f"<br><sup>{plan_label(plan)}, TP schedule {plan.inputs.tp_schedule}</sup>",
        xaxis_title="GPU (dp_rank x tp + tp_rank)", yaxis_title=f"{metric.replace('_bytes', '')} per step ({unit})",
        legend_title="load", bargap=0.05,
    )
    return fig
