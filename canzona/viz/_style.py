"""Shared look of canzona's figures: colours, units and the finishing touches every figure gets.

Every figure leaves here with a title, axis titles that carry units and a titled legend, so a
reader who has not seen the code can read it; tests check those three on every figure function.
"""

from __future__ import annotations

import math
import re

import plotly.colors as pc
import plotly.graph_objects as go

__all__ = [
    "GIB",
    "GFLOP",
    "MEGA",
    "STRATEGY_COLORS",
    "PAPER_MARKER",
    "RANK_COLORSCALE",
    "LEGEND_MAX_RANKS",
    "rank_colors",
    "distinct_colors",
    "color_distance",
    "DISTINCT_MAX",
    "PASS_STATES",
    "categorical_colors",
    "strategy_color",
    "line_style",
    "LOG_RATIO_ABOVE",
    "ratio_axis",
    "log_ticks",
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

#: the validation matrix's cell states, in colour-bar order: (label, colour)
PASS_STATES: tuple[tuple[str, str], ...] = (
    ("none passed", "#d62728"),
    ("some failed", "#ffbf00"),
    ("all passed", "#2ca02c"),
)

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


#: kept for callers that colour a continuous rank axis (the partition map no longer does)
RANK_COLORSCALE = "Turbo"
#: up to this many ranks get plotly's default qualitative colours
LEGEND_MAX_RANKS = 10


def rank_colors(n: int) -> list[str]:
    """Colour of each of ``n`` ranks (rank r -> element r), every one far from every other:
    plotly's qualitative palette up to :data:`LEGEND_MAX_RANKS` ranks, then that palette
    extended greedily, each next colour the candidate farthest (CIELAB distance) from all colours
    chosen so far (:func:`distinct_colors`). Greys stay free for "every rank" and "other ranks".
    Beyond :data:`DISTINCT_MAX` ranks no palette keeps every pair apart; hues then step by the
    golden angle with alternating lightness, so at least neighbouring ranks differ."""
    if n < 0:
        raise ValueError(f"need a non-negative number of colours, got {n}")
    if n <= LEGEND_MAX_RANKS:
        return categorical_colors(n)
    if n <= DISTINCT_MAX:
        return distinct_colors(n)
    return [f"hsl({(r * 137.508) % 360:.1f},{70 - 10 * (r % 2)}%,{(38, 58, 48)[r % 3]}%)" for r in range(n)]


#: up to this many ranks every pair of rank colours is kept apart (min CIELAB distance > 15)
DISTINCT_MAX = 48


def _srgb_to_lab(rgb):
    """CIELAB (D65) of sRGB colours in [0, 1], shape (..., 3)."""
    import numpy as np

    c = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = c @ np.array([[0.4124, 0.2126, 0.0193], [0.3576, 0.7152, 0.1192], [0.1805, 0.0722, 0.9505]])
    xyz = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1)


def _hex_rgb(color: str):
    import numpy as np

    h = color.lstrip("#")
    return np.array([int(h[i:i + 2], 16) / 255 for i in (0, 2, 4)])


def color_distance(a: str, b: str) -> float:
    """CIE76 distance between two ``#rrggbb`` colours (about 2.3: just noticeable; over 15:
    clearly different at a glance)."""
    import numpy as np

    la, lb = _srgb_to_lab(np.stack([_hex_rgb(a), _hex_rgb(b)]))
    return float(np.linalg.norm(la - lb))


def distinct_colors(n: int) -> list[str]:
    """``n`` colours (``#rrggbb``), the first ten plotly's qualitative ones, each further one the
    sRGB grid point (16 levels per channel) farthest in CIELAB from all chosen so far. Candidates
    that read as grey (chroma < 20) or that vanish on white (L > 88) or swallow black text
    (L < 30) are left out. Deterministic; about a millisecond."""
    import numpy as np

    if n < 0:
        raise ValueError(f"need a non-negative number of colours, got {n}")
    chosen = list(pc.qualitative.Plotly[: min(n, 10)])
    levels = np.linspace(0.0, 1.0, 16)
    grid = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), axis=-1).reshape(-1, 3)
    lab = _srgb_to_lab(grid)
    keep = (np.hypot(lab[:, 1], lab[:, 2]) >= 20) & (lab[:, 0] <= 88) & (lab[:, 0] >= 30)
    grid, lab = grid[keep], lab[keep]
    picked = _srgb_to_lab(np.stack([_hex_rgb(c) for c in chosen])) if chosen else np.zeros((0, 3))
    nearest = np.min(np.linalg.norm(lab[:, None, :] - picked[None, :, :], axis=-1), axis=1) if len(picked) else np.full(len(lab), np.inf)
    while len(chosen) < n:
        k = int(np.argmax(nearest))
        chosen.append("#" + "".join(f"{round(v * 255):02x}" for v in grid[k]))
        nearest = np.minimum(nearest, np.linalg.norm(lab - lab[k], axis=1))
    return chosen


_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
_SYMBOLS = ("circle", "square", "triangle-up", "x", "star", "triangle-down")


def line_style(i: int) -> dict:
    """Dash pattern, marker symbol and size of the ``i``-th line of a figure: lines that coincide
    (schedules or strategies with equal results) stay visible as dashes over solid, smaller
    markers inside larger ones."""
    return dict(dash=_DASHES[i % len(_DASHES)], symbol=_SYMBOLS[i % len(_SYMBOLS)], size=max(5, 10 - 1.5 * (i % 4)))


#: a ratio axis (R_LB, max / mean >= 1) switches to a log scale above this value, so one badly
#: balanced baseline does not flatten the ratios near 1 that a comparison is about
LOG_RATIO_ABOVE = 4.0


def ratio_axis(values) -> dict:
    """``update_yaxes`` settings for an axis of max / mean ratios: linear while every value is at
    most :data:`LOG_RATIO_ABOVE`, else log with readable ticks (1, 1.2, 1.5, 2, 3, 5, 10, ...)."""
    vals = [float(v) for v in values if not math.isnan(float(v))]
    top = max([1.0, *vals])
    if top <= LOG_RATIO_ABOVE:
        return {}
    ticks = [t for t in (1, 1.2, 1.5, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000) if t <= top * 1.5]
    return dict(type="log", tickvals=ticks, ticktext=[f"{t:g}" for t in ticks])


def log_ticks(values) -> dict:
    """Tick values and short labels (3 significant digits below 100, whole numbers above) for a
    log axis over ``values``, so the axis shows the swept points (16, 32, 64; 1.72, 4.02 B;
    1,024 MiB) instead of minor log ticks and six-digit model sizes."""
    vals = sorted({float(v) for v in values if not math.isnan(float(v))})
    return dict(tickvals=vals, ticktext=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in vals])


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
    legend_below: bool = False,
) -> go.Figure:
    """Set title, axis titles (only the primary axes; subplot axes are titled by their builder)
    and the legend title, with a white template so HTML exports read well in print.
    ``legend_below``: a horizontal legend under the plot, for figures whose legend entries are
    long sentences that would otherwise take a third of the width from side-by-side panels."""
    # a subtitle (<br><sup>...) needs room above subplot titles
    top = 90 + 20 * min(title.count("<br>"), 3)
    legend: dict = dict(title=dict(text=legend_title))
    bottom = 60
    if legend_below:
        legend.update(orientation="h", yanchor="top", y=-0.2, x=0, xanchor="left")
        bottom = 150
    fig.update_layout(
        title=dict(text=title, x=0.01, xanchor="left"),
        legend=legend,
        template="plotly_white",
        margin=dict(t=top, l=70, r=30, b=bottom),
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
