"""Shared look of canzona's figures: colours, units and the finishing touches every figure gets.

Every figure leaves here with a title, axis titles that carry units and a titled legend, so a
reader who has not seen the code can read it; tests check those three on every figure function.
"""

from __future__ import annotations

import re

import plotly.colors as pc
import plotly.graph_objects as go

__all__ = [
    "GIB",
    "GFLOP",
    "MEGA",
    "STRATEGY_COLORS",
    "PAPER_MARKER",
    "rank_colors",
    "categorical_colors",
    "strategy_color",
    "finish",
    "figure_problems",
]

GIB = float(2**30)
GFLOP = 1e9
MEGA = 1e6

#: one colour per strategy, the same in every notebook (names from canzona.plan.STRATEGIES)
STRATEGY_COLORS: dict[str, str] = {
    "zero1": "#7f7f7f",
    "sc": "#8c564b",
    "layerwise": "#d62728",
    "asc": "#ff7f0e",
    "lb-asc": "#2ca02c",
    "lb-asc-joint": "#1f77b4",
}

#: how paper reference values are drawn wherever they appear: open black diamonds
PAPER_MARKER = dict(symbol="diamond-open", size=12, color="black", line=dict(width=2))


def categorical_colors(n: int) -> list[str]:
    """``n`` distinguishable colours: a qualitative palette while it lasts, then samples of a
    perceptually ordered scale (DP 128 has more ranks than any qualitative palette has colours)."""
    if n < 0:
        raise ValueError(f"need a non-negative number of colours, got {n}")
    if n <= 10:
        return list(pc.qualitative.Plotly[:n])
    if n <= 24:
        return list(pc.qualitative.Light24[:n])
    return pc.sample_colorscale("Turbo", [i / max(n - 1, 1) for i in range(n)])


def rank_colors(n: int) -> list[str]:
    """Colour of each of ``n`` ranks (rank r -> element r)."""
    return categorical_colors(n)


def strategy_color(strategy: str) -> str:
    return STRATEGY_COLORS.get(strategy, "#9467bd")


def finish(
    fig: go.Figure,
    *,
    title: str,
    x_title: str | None = None,
    y_title: str | None = None,
    legend_title: str,
    height: int | None = None,
) -> go.Figure:
    """Set title, axis titles (only the primary axes; subplot axes are titled by their builder)
    and the legend title, with a white template so HTML exports read well in print."""
    fig.update_layout(
        title=dict(text=title, x=0.01, xanchor="left"),
        legend=dict(title=dict(text=legend_title)),
        template="plotly_white",
        margin=dict(t=90, l=70, r=30, b=60),
    )
    if x_title is not None:
        fig.update_xaxes(title_text=x_title)
    if y_title is not None:
        fig.update_yaxes(title_text=y_title)
    if height is not None:
        fig.update_layout(height=height)
    return fig


def figure_problems(fig: go.Figure) -> list[str]:
    """What keeps ``fig`` from being readable by a newcomer: a missing title, an axis without a
    title (every x/y axis that exists in the layout), a legend without a title, or a visible
    legend entry without a name. Empty list: the figure is fine. Tests run it on every figure."""
    problems: list[str] = []
    layout = fig.layout.to_plotly_json()
    if not (layout.get("title") or {}).get("text"):
        problems.append("no title")
    for key, ax in layout.items():
        if re.fullmatch(r"[xy]axis\d*", key) and ax.get("visible", True):
            # an axis shared with another (make_subplots(shared_yaxes=...)) is titled by that one
            shared = ax.get("matches")
            if shared and ((layout.get(key[0] + "axis" + shared[1:]) or {}).get("title") or {}).get("text"):
                continue
            if not ((ax.get("title") or {}).get("text")):
                problems.append(f"{key} has no title")
    # axes that traces draw on but the layout never mentions have no title either
    for tr in fig.data:
        for attr in ("xaxis", "yaxis"):
            if attr in tr:
                ref = tr[attr] or attr[0]
                key = attr[0] + "axis" + ref[1:]
                if key in layout:
                    continue  # checked above
                if not ((layout.get(key) or {}).get("title") or {}).get("text") and f"{key} has no title" not in problems:
                    problems.append(f"{key} has no title")
    if not ((layout.get("legend") or {}).get("title") or {}).get("text"):
        problems.append("legend has no title")
    for i, tr in enumerate(fig.data):
        if tr.showlegend is not False and not tr.name:
            problems.append(f"trace {i} ({tr.type}) has no name for the legend")
    return problems
