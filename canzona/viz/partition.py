"""Partition maps and per-rank loads of a DP plan (Section 3, Figure 3 of the paper).

Tables first, figures from the tables: :func:`ownership_pieces` lists who owns which elements of
every bucket, :func:`rank_loads` sums optimizer FLOPs and state memory per DP rank from the plan
and :mod:`canzona.cost`, independently of the planner's own metrics (tests check that both agree).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from canzona.cost import param_flops, param_memory
from canzona.paper import PaperValue, paper_values
from canzona.plan.plan import Plan
from canzona.viz._style import GFLOP, GIB, MEGA, PAPER_MARKER, finish, rank_colors, ratio_axis, strategy_color

__all__ = [
    "EVERY_RANK",
    "plan_label",
    "ownership_pieces",
    "expert_groups",
    "rank_experts",
    "fig_expert_groups",
    "rank_loads",
    "load_ratio",
    "strategy_summary",
    "PAPER_COLUMNS",
    "paper_reference",
    "MEMORY_VIEWS",
    "fig_partition_map",
    "fig_rank_loads",
    "fig_strategy_comparison",
    "fig_balance_vs_paper",
]

#: owner value of a piece every DP rank updates (strategy ``sc``)
EVERY_RANK = -1


def plan_label(plan: Plan) -> str:
    """One line naming a plan's configuration, used in figure titles."""
    i = plan.inputs
    alpha = f", alpha={i.alpha:g}" if i.strategy == "lb-asc" else ""
    return f"{i.model}, {i.optimizer}, DP{i.dp} x TP{i.tp}, {i.strategy}{alpha}, cost={i.cost}"


def _shape(shape: Sequence[int]) -> str:
    return " x ".join(str(d) for d in shape)


def ownership_pieces(plan: Plan) -> pd.DataFrame:
    """Every (parameter, owner) piece of the flat buffer, in buffer order.

    Columns: ``bucket``, ``param``, ``kind``, ``shape`` (global, as text), ``local_shape``,
    ``start`` / ``end`` (element offsets inside the bucket, TP-local elements), ``numel``,
    ``owner`` (DP rank, or :data:`EVERY_RANK` under ``sc``), ``param_start`` (offset of the piece
    inside its parameter), ``whole`` (the piece is the entire parameter) and ``experts`` (for an
    ``(E, M, N)`` expert stack, which experts the piece holds: ``"experts 0-63 of 128"``; empty
    otherwise). A parameter cut by ZeRO-1 shows as several pieces, one per owner; an expert stack
    is one piece per owner too (its experts grouped), never one per expert.
    """
    by_name = plan.by_name()
    rows: list[tuple] = []
    for b in plan.buckets:
        for n in b.params:
            p = by_name[n]
            spec = p.spec
            common = (b.index, n, spec.kind, _shape(spec.shape), _shape(spec.local_shape))
            if p.dp_owner is not None:
                rows.append((*common, p.offset, p.offset + p.numel, p.numel, p.dp_owner, 0, True, _experts_text(p, 0, p.numel)))
            elif p.dp_ranges:
                for r, s, e in p.dp_ranges:
                    rows.append((*common, p.offset + s, p.offset + e, e - s, r, s, False, _experts_text(p, s, e)))
            else:
                rows.append((*common, p.offset, p.offset + p.numel, p.numel, EVERY_RANK, 0, True, _experts_text(p, 0, p.numel)))
    cols = ["bucket", "param", "kind", "shape", "local_shape", "start", "end", "numel", "owner", "param_start", "whole", "experts"]
    df = pd.DataFrame(rows, columns=cols)
    return df.astype({"bucket": "int64", "start": "int64", "end": "int64", "numel": "int64", "owner": "int64", "param_start": "int64"})


def _expert_range(p, start: int, end: int) -> tuple[int, int] | None:
    """The experts ``[first, last)`` of stack ``p`` that its elements ``[start, end)`` hold (None:
    not an expert stack)."""
    if p.spec.kind != "experts" or not p.spec.shape:
        return None
    unit = p.numel // p.spec.shape[0]
    return start // unit, -(-end // unit)


def _experts_text(p, start: int, end: int) -> str:
    got = _expert_range(p, start, end)
    if got is None:
        return ""
    first, last = got
    which = f"expert {first}" if last - first == 1 else f"experts {first}-{last - 1}"
    return f"{which} of {p.spec.shape[0]}"


def _ranges_text(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _expert_holders(p, dp: int) -> dict[int, list[int]]:
    """DP rank -> the expert indices of stack ``p`` it updates (every rank all of them under ``sc``)."""
    n = int(p.spec.shape[0])
    if p.dp_owner is not None:
        return {p.dp_owner: list(range(n))}
    if not p.dp_ranges:
        return {r: list(range(n)) for r in range(dp)}
    held: dict[int, list[int]] = {}
    for r, s, e in p.dp_ranges:
        first, last = _expert_range(p, s, e)  # type: ignore[misc]
        held.setdefault(r, []).extend(range(first, last))
    return held


def rank_experts(plan: Plan, dp_rank: int) -> tuple[int, int]:
    """(expert stacks, experts) that DP rank ``dp_rank`` updates: DP-owned whole, outside TP
    micro-groups (every rank all of them under ``sc``)."""
    stacks = experts = 0
    for p in plan.params:
        if p.spec.kind == "experts":
            mine = _expert_holders(p, plan.inputs.dp).get(dp_rank, [])
            stacks += bool(mine)
            experts += len(mine)
    return stacks, experts


def expert_groups(plan: Plan) -> pd.DataFrame:
    """One row per expert stack (per MoE layer and projection), its experts grouped, so that a
    model with 128 experts per layer stays one readable row per stack.

    Columns: ``layer`` (the stack's module path, e.g. ``model.layers.3.mlp.experts``), ``param``,
    ``experts`` (E), ``expert_shape`` (each expert's ``M x N``), ``ranks`` (DP ranks holding any of
    its experts; every rank under ``sc``), ``max_per_rank`` (most experts of it on one rank) and
    ``owners`` (``"0: 0-63 | 1: 64-127"``: DP rank, then the expert indices it updates; ``"every
    rank"`` under ``sc``). Empty (with these columns) when the plan has no expert stack.
    """
    rows = []
    for p in plan.params:
        if p.spec.kind != "experts":
            continue
        held = _expert_holders(p, plan.inputs.dp)
        every = p.dp_owner is None and not p.dp_ranges
        owners = "every rank" if every else " | ".join(f"{r}: {_ranges_text(ix)}" for r, ix in sorted(held.items()))
        cut = p.name.find("experts")
        layer = p.name[: cut + len("experts")] if cut >= 0 else p.name.rpartition(".")[0]
        rows.append((layer, p.name, int(p.spec.shape[0]), _shape(p.spec.shape[1:]), len(held),
                     max(len(ix) for ix in held.values()), owners))
    cols = ["layer", "param", "experts", "expert_shape", "ranks", "max_per_rank", "owners"]
    return pd.DataFrame(rows, columns=cols).astype({"experts": "int64", "ranks": "int64", "max_per_rank": "int64"})


def fig_expert_groups(plan: Plan) -> go.Figure:
    """Experts per DP rank, one row per expert stack (layers and projections), one column per DP
    rank: the cell's number is how many of that stack's experts the rank updates, and hovering it
    lists their indices. A model with 128 experts per layer stays one row per stack."""
    groups = expert_groups(plan)
    if groups.empty:
        raise ValueError(f"{plan_label(plan)}: the plan has no expert stack (no parameter of kind 'experts')")
    dp = plan.inputs.dp
    counts = np.zeros((len(groups), dp))
    hover = np.full((len(groups), dp), "", dtype=object)
    by_name = plan.by_name()
    for i, name in enumerate(groups["param"]):
        for r, ix in _expert_holders(by_name[name], dp).items():
            counts[i, r] = len(ix)
            hover[i, r] = _ranges_text(ix)
    fig = go.Figure(
        go.Heatmap(
            z=counts,
            x=[str(r) for r in range(dp)],
            y=list(groups["param"]),
            customdata=hover,
            name="experts per DP rank",
            colorscale="Blues",
            colorbar=dict(title="experts"),
            hovertemplate="%{y}<br>DP rank %{x}: %{z:.0f} experts<br>experts %{customdata}<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")
    n_e = int(groups["experts"].max())
    return finish(
        fig,
        title=(
            f"Experts per DP rank: {plan_label(plan)}<br><sup>{len(groups)} expert stacks of up to {n_e} experts; "
            "hover a cell for the expert indices</sup>"
        ),
        x_title="DP rank",
        y_title="expert stack (layer, projection)",
        legend_title="experts on the rank",
        height=max(360, 14 * len(groups) + 170),
    )


def rank_loads(plan: Plan) -> pd.DataFrame:
    """Per-DP-rank optimizer load, summed over the parameters (or pieces) each rank updates.

    Columns (index ``dp_rank``): ``flops`` (optimizer FLOPs per step, per TP rank on average, as
    :func:`canzona.cost.param_flops` defines it), ``memory_bytes`` (optimizer-state bytes, same
    averaging), ``numel`` (buffer elements) and ``params`` (parameters touched). A piece of a cut
    parameter counts in proportion to its elements; under ``sc`` every rank carries everything.
    """
    inp = plan.inputs
    dp = inp.dp
    flops = np.zeros(dp)
    memory = np.zeros(dp)
    numel = np.zeros(dp)
    count = np.zeros(dp, dtype=np.int64)
    for p in plan.params:
        f = param_flops(p.spec, inp.optimizer, inp.flops_shape)
        m = param_memory(p.spec, inp.optimizer, inp.flops_shape)
        n = p.numel
        if p.dp_owner is not None:
            parts = [(p.dp_owner, 1.0)]
        elif p.dp_ranges:
            parts = [(r, (e - s) / n) for r, s, e in p.dp_ranges]
        else:  # sc: every rank recomputes every update
            parts = [(r, 1.0) for r in range(dp)]
        for r, frac in parts:
            flops[r] += f * frac
            memory[r] += m * frac
            numel[r] += n * frac
            count[r] += 1
    df = pd.DataFrame({"flops": flops, "memory_bytes": memory, "numel": numel, "params": count})
    df.index.name = "dp_rank"
    return df


def load_ratio(values: Iterable[float]) -> float:
    """R_LB = max / mean (1.0 when everything is zero)."""
    a = np.asarray(list(values), dtype=np.float64)
    mean = float(a.mean()) if a.size else 0.0
    return float(a.max()) / mean if mean > 0 else 1.0


#: which of canzona's columns each paper ratio is compared with. The paper's DP "memory" is
#: proportional to numel (Section 5.2: "memory cost is strictly proportional to numel"), so it
#: sits beside the numel ratio; its TP memory ratio beside the optimizer-state ratio (the same
#: pairing as ``canzona reproduce fig3``).
PAPER_COLUMNS: dict[str, str] = {
    "dp_flops_ratio": "dp_flops_ratio",
    "dp_memory_ratio": "dp_numel_ratio",
    "tp_flops_ratio": "tp_flops_ratio",
    "tp_memory_ratio": "tp_memory_ratio",
}


def paper_reference(plan: Plan, metric: str) -> PaperValue | None:
    """The paper's value of ``metric`` (a paper metric name, see :data:`PAPER_COLUMNS`) for this
    plan's strategy when the plan is the paper's configuration (model, DP, TP, optimizer, cost
    model, alpha for ``lb-asc``, and for FLOPs ratios the paper's TP-local FLOPs accounting);
    otherwise None."""
    i = plan.inputs
    if metric.endswith("flops_ratio") and i.flops_shape != "local":
        return None  # the paper counts FLOPs on TP-local shards: full-shape ratios are another quantity
    alpha = float(i.alpha) if i.strategy == "lb-asc" else None
    for v in paper_values(metric=metric, strategy=i.strategy, ablation=""):
        if v.matches(model=i.model, dp=i.dp, tp=i.tp, optimizer=i.optimizer, alpha=alpha, cost=i.cost):
            return v
    return None


def strategy_summary(plans: Sequence[Plan]) -> pd.DataFrame:
    """One row per plan: R_LB ratios and the paper's where it reports them.

    Columns: ``strategy``, ``tp_schedule``, ``flops_shape``, ``dp_flops_ratio``,
    ``dp_memory_ratio`` (optimizer-state bytes), ``dp_numel_ratio`` (buffer elements) -- all three
    from :func:`rank_loads` -- then the planner's ``tp_flops_ratio``, ``tp_memory_ratio``,
    ``tp_numel_ratio`` (worst TP group), ``j_comm_elements``, ``plan_ms``, and
    ``paper_<column>`` for each column the paper has a value for in this configuration (NaN where
    it has none; see :data:`PAPER_COLUMNS` for the pairing).
    """
    rows = []
    for plan in plans:
        loads = rank_loads(plan)
        m = plan.metrics
        row = {
            "strategy": plan.inputs.strategy,
            "tp_schedule": plan.inputs.tp_schedule,
            "flops_shape": plan.inputs.flops_shape,
            "dp_flops_ratio": load_ratio(loads["flops"]),
            "dp_memory_ratio": load_ratio(loads["memory_bytes"]),
            "dp_numel_ratio": load_ratio(loads["numel"]),
            "tp_flops_ratio": m.tp_flops_ratio,
            "tp_memory_ratio": m.tp_memory_ratio,
            "tp_numel_ratio": float(m.details.get("tp_numel_ratio", np.nan)),
            "j_comm_elements": m.j_comm,
            "plan_ms": m.plan_seconds * 1e3,
        }
        for metric, col in PAPER_COLUMNS.items():
            ref = paper_reference(plan, metric)
            row[f"paper_{col}"] = ref.value if ref is not None else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------ figures
def _owner_name(owner: int) -> str:
    return "every rank (sc)" if owner == EVERY_RANK else f"DP rank {owner}"


#: a segment gets its rank number printed when it is at least this fraction of the widest bucket
#: (smaller ones would show a clipped digit or force every label down to an unreadable size)
LABEL_MIN_FRACTION = 0.02
#: colour of the ranks left out by ``fig_partition_map(ranks=...)``
OTHER_RANKS_COLOR = "#d9d9d9"


def fig_partition_map(plan: Plan, *, buckets: Sequence[int] | None = None, ranks: Sequence[int] | None = None) -> go.Figure:
    """Bucket x rank ownership map: each bucket a horizontal bar over its elements, segments
    coloured by the DP rank that updates them; hovering a segment names the parameter, its shape
    and the element range, so parameter boundaries are visible (thin white separators).

    One legend entry per rank, in colours that tell neighbouring ranks apart
    (:func:`~canzona.viz._style.rank_colors`): click an entry to hide that rank, double-click to
    show it alone. Segments wide enough carry their rank number.
    ``buckets`` restricts the map to some bucket indices (all by default); ``ranks`` colours only
    these DP ranks and greys the others out (one "other ranks" entry).
    """
    pieces = ownership_pieces(plan)
    if buckets is not None:
        wanted = sorted(set(int(b) for b in buckets))
        bad = [b for b in wanted if not 0 <= b < len(plan.buckets)]
        if bad:
            raise ValueError(f"bucket indices {bad} out of range: the plan has {len(plan.buckets)} buckets")
        pieces = pieces[pieces["bucket"].isin(wanted)]
    dp = plan.inputs.dp
    chosen: set[int] | None = None
    if ranks is not None:
        chosen = {int(r) for r in ranks}
        bad = sorted(r for r in chosen if not 0 <= r < dp)
        if bad or not chosen:
            raise ValueError(f"ranks must be DP ranks in 0..{dp - 1}, got {sorted(chosen)}")
    colors = rank_colors(dp)
    # million elements for real models; plain elements / thousands for toy ones
    biggest = max(b.numel for b in plan.buckets)
    scale, unit = (MEGA, "million") if biggest >= MEGA else (1e3, "thousand") if biggest >= 1e4 else (1.0, "")
    min_label = LABEL_MIN_FRACTION * float(pieces["end"].max() if len(pieces) else 1)
    fig = go.Figure()
    key = pieces["owner"].map(lambda o: o if chosen is None or o == EVERY_RANK or o in chosen else -2)
    for owner, grp in pieces.groupby(key, sort=True):
        owner = int(owner)
        if owner == -2:
            name, color = f"other ranks ({dp - len(chosen or ())})", OTHER_RANKS_COLOR
        else:
            name, color = _owner_name(owner), "#999999" if owner == EVERY_RANK else colors[owner]
        labels = grp["owner"].map(lambda o: "all" if o == EVERY_RANK else str(o)).where(grp["numel"] >= min_label, "")
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[f"bucket {b}" for b in grp["bucket"]],
                x=(grp["numel"] / scale).to_numpy(),
                base=(grp["start"] / scale).to_numpy(),
                name=name,
                legendrank=1000 + owner,
                marker=dict(color=color, line=dict(color="white", width=0.5)),
                text=labels.to_numpy(),
                textposition="inside",
                insidetextanchor="middle",
                textangle=0,
                textfont=dict(size=10),
                constraintext="none",
                customdata=np.stack(
                    [grp["param"], grp["shape"], grp["start"], grp["end"], grp["param_start"], grp["whole"].map({True: "whole", False: "piece"}),
                     grp["owner"].map(_owner_name), grp["experts"].map(lambda t: f"<br>{t}" if t else "")],
                    axis=-1,
                ),
                hovertemplate=(
                    "%{customdata[0]}<br>shape %{customdata[1]} (%{customdata[5]})%{customdata[7]}<br>"
                    "elements [%{customdata[2]}, %{customdata[3]}) of %{y}<br>"
                    "%{customdata[6]}<extra></extra>"
                ),
            )
        )
    n_b = pieces["bucket"].nunique()
    order = [f"bucket {b}" for b in sorted(pieces["bucket"].unique())]
    fig.update_layout(barmode="overlay", bargap=0.2)
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1])
    loads = rank_loads(plan)
    which = "" if chosen is None else f"; coloured: DP rank{'s' if len(chosen) > 1 else ''} {', '.join(map(str, sorted(chosen)))}"
    return finish(
        fig,
        title=(
            f"Partition map: {plan_label(plan)}<br><sup>{n_b} bucket{'s' if n_b != 1 else ''}; R_LB FLOPs {load_ratio(loads['flops']):.2f}, "
            f"state memory {load_ratio(loads['memory_bytes']):.2f}, elements {load_ratio(loads['numel']):.2f}{which}; "
            "numbers on segments: DP rank; legend: click hides a rank, double-click shows it alone</sup>"
        ),
        x_title=f"offset inside the bucket ({unit + ' ' if unit else ''}TP-local elements)",
        y_title="ZeRO-1 bucket (buffer order)",
        legend_title="updated by",
        height=max(420, 18 * n_b + 170),
    )


#: memory views: column of rank_loads, scale, panel name, axis title
MEMORY_VIEWS: dict[str, tuple[str, float, str, str]] = {
    "state": ("memory_bytes", GIB, "optimizer-state memory", "state GiB (per TP rank)"),
    "numel": ("numel", MEGA, "buffer elements (the paper's memory proxy)", "million elements"),
}


def _memory_view(memory: str) -> tuple[str, float, str, str]:
    try:
        return MEMORY_VIEWS[memory]
    except KeyError:
        raise ValueError(f"memory must be one of {', '.join(MEMORY_VIEWS)}, got {memory!r}") from None


def fig_rank_loads(plan: Plan, *, memory: str = "state") -> go.Figure:
    """Per-DP-rank optimizer FLOPs and memory as bars, the mean as a dashed line, and R_LB =
    max/mean of each in the title (Figure 3c of the paper). ``memory``: ``state`` (optimizer-state
    bytes) or ``numel`` (buffer elements, what the paper calls memory)."""
    mkey, mscale, mname, maxis = _memory_view(memory)
    loads = rank_loads(plan)
    rf, rm = load_ratio(loads["flops"]), load_ratio(loads[mkey])
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=(f"optimizer FLOPs (R_LB {rf:.2f})", f"{mname} (R_LB {rm:.2f})")
    )
    ranks = loads.index.to_numpy()
    color = strategy_color(plan.inputs.strategy)
    for col, (key, scale, label, unit) in enumerate(
        (("flops", GFLOP, "FLOPs per rank", "GFLOP"), (mkey, mscale, "memory per rank", maxis)), start=1
    ):
        vals = loads[key].to_numpy() / scale
        fig.add_trace(go.Bar(x=ranks, y=vals, name=label, marker_color=color, opacity=0.85 if col == 1 else 0.55,
                             hovertemplate=f"DP rank %{{x}}: %{{y:.4g}} {unit} (mean {vals.mean():.4g})<extra></extra>"), row=1, col=col)
        fig.add_trace(
            go.Scatter(
                x=[ranks.min() - 0.5, ranks.max() + 0.5],
                y=[vals.mean()] * 2,
                mode="lines",
                line=dict(dash="dash", color="black"),
                name="mean over ranks",
                legendgroup="mean",
                showlegend=col == 1,
            ),
            row=1,
            col=col,
        )
    fig.update_xaxes(title_text="DP rank", row=1, col=1)
    fig.update_xaxes(title_text="DP rank", row=1, col=2)
    fig.update_yaxes(title_text="GFLOP per step (per TP rank)", row=1, col=1)
    fig.update_yaxes(title_text=maxis, row=1, col=2)
    return finish(
        fig,
        title=f"Per-rank optimizer load, R_LB FLOPs {rf:.2f} / memory {rm:.2f}<br><sup>{plan_label(plan)}, FLOPs on {plan.inputs.flops_shape} shapes</sup>",
        legend_title="quantity",
        height=420,
    )


def fig_strategy_comparison(plans: Sequence[Plan], *, memory: str = "state") -> go.Figure:
    """Per-rank FLOPs (top row) and memory (bottom row, ``memory`` as in :func:`fig_rank_loads`)
    of several plans side by side, one column per plan, mean lines dashed, R_LB in panel titles."""
    if not plans:
        raise ValueError("need at least one plan to compare")
    mkey, mscale, _, maxis = _memory_view(memory)
    n = len(plans)
    titles = []
    tables = [rank_loads(p) for p in plans]
    for p, t in zip(plans, tables):
        titles.append(f"{p.inputs.strategy}<br>FLOPs R_LB {load_ratio(t['flops']):.2f}")
    for p, t in zip(plans, tables):
        titles.append(f"{p.inputs.strategy}<br>memory R_LB {load_ratio(t[mkey]):.2f}")
    # each panel keeps its own y scale: one unbalanced strategy (asc at DP32 reaches R_LB ~20)
    # would otherwise flatten every other panel to a line along the axis
    fig = make_subplots(rows=2, cols=n, subplot_titles=titles, horizontal_spacing=0.075 if n > 1 else 0.03, vertical_spacing=0.25)
    for c, (p, t) in enumerate(zip(plans, tables), start=1):
        st = p.inputs.strategy
        ranks = t.index.to_numpy()
        for r, (key, scale) in enumerate((("flops", GFLOP), (mkey, mscale)), start=1):
            vals = t[key].to_numpy() / scale
            unit = "GFLOP" if r == 1 else maxis
            fig.add_trace(
                go.Bar(x=ranks, y=vals, name=st, legendgroup=st, showlegend=r == 1, marker_color=strategy_color(st),
                       hovertemplate=f"{st}, DP rank %{{x}}: %{{y:.4g}} {unit} (mean {vals.mean():.4g})<extra></extra>"),
                row=r,
                col=c,
            )
            fig.add_trace(
                go.Scatter(
                    x=[ranks.min() - 0.5, ranks.max() + 0.5], y=[vals.mean()] * 2, mode="lines",
                    line=dict(dash="dash", color="black", width=1), name="mean over ranks", legendgroup="mean",
                    showlegend=(r == 1 and c == 1),
                ),
                row=r,
                col=c,
            )
            fig.update_xaxes(title_text="DP rank", row=r, col=c)
        fig.update_yaxes(title_text="GFLOP per step", row=1, col=c)
        fig.update_yaxes(title_text=maxis, row=2, col=c)
    # a fixed small gap between tick labels and the y title, and two-line panel titles, keep each
    # title clear of the panel to its left down to a ~900 px wide notebook
    fig.update_yaxes(title_standoff=4, title_font_size=12)
    fig.update_xaxes(title_standoff=2, title_font_size=12)
    fig.update_annotations(font_size=12)
    i = plans[0].inputs
    return finish(
        fig,
        title=(f"Strategies side by side: {i.model}, {i.optimizer}, DP{i.dp} x TP{i.tp}<br><sup>dashed: mean over ranks; "
               "each panel has its own y scale, compare R_LB in the panel titles</sup>"),
        legend_title="strategy",
        height=720,
        legend_below=True,
    )


_BALANCE_BARS: tuple[tuple[str, str], ...] = (
    ("dp_flops_ratio", "DP FLOPs"),
    ("dp_memory_ratio", "DP state memory"),
    ("dp_numel_ratio", "DP numel (paper's memory)"),
    ("tp_flops_ratio", "TP FLOPs"),
    ("tp_memory_ratio", "TP state memory"),
)


def fig_balance_vs_paper(summary: pd.DataFrame) -> go.Figure:
    """Grouped bars of the DP and TP R_LB ratios per strategy (from :func:`strategy_summary`),
    with the paper's values as open diamonds where the paper reports them."""
    metrics = [(k, lab) for k, lab in _BALANCE_BARS if k in summary]
    fig = go.Figure()
    for _, row in summary.iterrows():
        st = row["strategy"]
        ys = [row[k] for k, _ in metrics]
        fig.add_trace(
            go.Bar(x=[lab for _, lab in metrics], y=ys, name=f"canzona {st}", marker_color=strategy_color(st), offsetgroup=st,
                   text=[f"{v:.2f}" for v in ys], textposition="outside", textfont=dict(size=10), cliponaxis=False,
                   hovertemplate=f"canzona {st}, %{{x}}: %{{y:.3f}}<extra></extra>")
        )
    shown = False
    for _, row in summary.iterrows():
        xs, ys = [], []
        for k, lab in metrics:
            v = row.get(f"paper_{k}", np.nan)
            if pd.notna(v):
                xs.append(lab)
                ys.append(v)
        if xs:
            fig.add_trace(
                go.Scatter(
                    x=xs, y=ys, mode="markers", marker=PAPER_MARKER, name="paper, Figure 3 (Qwen3-32B DP32xTP8)",
                    offsetgroup=row["strategy"], legendgroup="paper", showlegend=not shown,
                    hovertemplate=f"paper, {row['strategy']}: %{{y:.2f}}<extra></extra>",
                )
            )
            shown = True
    fig.add_hline(y=1.0, line_dash="dot", line_color="gray")
    # log scale once a baseline is badly unbalanced (asc ~20 at DP32), so the ratios near 1 the
    # comparison is about stay apart; the value labels give the exact numbers
    fig.update_layout(barmode="group", scattermode="group", uniformtext=dict(minsize=8, mode="show"))
    fig.update_yaxes(**ratio_axis([v for k, _ in metrics for v in summary[k]]))
    shapes = ", ".join(sorted(set(summary["flops_shape"]))) if "flops_shape" in summary else "?"
    return finish(
        fig,
        title=f"Load-balance ratio R_LB = max / mean per strategy (lower is better; 1 = perfect, dotted)<br><sup>FLOPs on {shapes} shapes; "
              "diamonds: the paper's reported values where it reports them (its FLOPs ratios: with flops_shape=local only)</sup>",
        x_title="quantity balanced across ranks",
        y_title="R_LB (max / mean, dimensionless)",
        legend_title="source",
        height=480,
    )
