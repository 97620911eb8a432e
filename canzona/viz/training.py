"""The loss and step times of several training runs, from the metrics logs that ``canzona train``
and ``canzona profile`` write (:mod:`canzona.runs`): find the runs, read their tables, plot their
losses on one chart."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from canzona.phase_names import PHASES, SHARD_APPLY, SHARD_COMPUTE, SHARD_GATHER, SHARD_SCATTER
from canzona.runs import METRICS_COLUMNS, METRICS_CSV, RUN_JSON, find_runs
from canzona.viz._style import categorical_colors, finish, line_style
from canzona.fileio import read_json

__all__ = ["discover_runs", "fig_loss_curves", "load_metrics", "run_label"]


#: the metrics-log header before the ``canzona/shard/*`` phases were registered (still read)
_SHARD_COLUMNS = frozenset(f"{p}_ms" for p in (SHARD_GATHER, SHARD_COMPUTE, SHARD_SCATTER, SHARD_APPLY))
#: the header of the logs written before this version: one column per phase (the FSDP2 shard-group
#: phases had no names yet), no launch/wait columns, no exposed communication
_LEGACY_COLUMNS: tuple[str, ...] = ("step", "loss", "wall_ms", *(f"{p}_ms" for p in PHASES if f"{p}_ms" not in _SHARD_COLUMNS))


def _from_legacy(df: pd.DataFrame) -> pd.DataFrame:
    """A legacy log in this version's columns: the shard-group phases took no time there (0 ms);
    launch, wait and exposed communication were not recorded (NaN, not a made-up 0)."""
    df = df.reindex(columns=list(METRICS_COLUMNS))
    for col in _SHARD_COLUMNS:
        df[col] = 0.0
    return df


def load_metrics(path: str | Path) -> pd.DataFrame:
    """Read a run's ``metrics.csv`` (the file or its directory) strictly: the documented header,
    integer steps in increasing order, finite losses. One clear error otherwise."""
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_CSV
    if not p.is_file():
        raise FileNotFoundError(f"metrics log not found: {p}")
    try:
        df = pd.read_csv(p)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p}: cannot read the metrics log ({exc})") from None
    if tuple(df.columns) == _LEGACY_COLUMNS:
        df = _from_legacy(df)
    if tuple(df.columns) != METRICS_COLUMNS:
        raise ValueError(f"{p}: not a canzona metrics log of this version (expected the columns step, loss, wall_ms, <phase>_ms, "
                         "<comm phase>/launch_ms, <comm phase>/wait_ms, comm_exposed_ms, or the earlier one column per phase)")
    for col in df.columns:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    steps = df["step"].to_numpy()
    if np.isnan(steps).any() or (steps != np.floor(steps)).any() or (np.diff(steps) <= 0).any():
        raise ValueError(f"{p}: steps must be increasing integers")
    if not np.isfinite(df["loss"].to_numpy()).all():
        raise ValueError(f"{p}: a loss is missing or not finite")
    return df.astype({"step": "int64"})


def run_label(directory: str | Path) -> str:
    """``<strategy> dp<d>xtp<t> <optimizer> (<directory name>)`` from the run's ``run.json`` (or
    the profile's ``meta.json``); the directory name alone when there is neither."""
    d = Path(directory)
    for name in (RUN_JSON, "meta.json"):
        f = d / name
        if f.is_file():
            try:
                doc = read_json(f)
            except (OSError, json.JSONDecodeError):
                break
            if isinstance(doc, dict) and {"strategy", "dp", "tp", "optimizer"} <= set(doc):
                return f"{doc['strategy']} dp{doc['dp']}xtp{doc['tp']} {doc['optimizer']} ({d.name})"
    return d.name


def discover_runs(root: str | Path | None = None) -> dict[str, Path]:
    """Runs with a metrics log under ``root`` (default: :func:`canzona.runs.runs_roots`), any
    depth, oldest first, labelled by :func:`run_label`. Empty when there are none."""
    return {run_label(d): d for d in find_runs("metrics", None if root is None else [Path(root)])}


def fig_loss_curves(runs: Mapping[str, pd.DataFrame | str | Path], *, time: bool = True) -> go.Figure:
    """Training loss per step of several runs on one chart (top) and, with ``time``, each
    step's wall time (bottom). ``runs``: label -> metrics table or run directory."""
    if not runs:
        raise ValueError("no runs to plot (train with `canzona train`, which logs under runs/)")
    tables = {k: (v if isinstance(v, pd.DataFrame) else load_metrics(v)) for k, v in runs.items()}
    rows = 2 if time else 1
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        row_heights=[0.65, 0.35] if time else [1.0],
                        subplot_titles=("training loss", "wall time per step") if time else ("training loss",))
    colors = categorical_colors(len(tables))
    for i, (label, df) in enumerate(tables.items()):
        style = line_style(i)
        # identical runs (exact strategies) coincide: dashes and marker sizes keep each visible
        fig.add_trace(go.Scatter(x=df["step"], y=df["loss"], mode="lines+markers", name=label, legendgroup=label,
                                 line=dict(color=colors[i], dash=style["dash"]),
                                 marker=dict(symbol=style["symbol"], size=style["size"])), row=1, col=1)
        if time:
            fig.add_trace(go.Scatter(x=df["step"], y=df["wall_ms"], mode="lines+markers", name=label, legendgroup=label,
                                     showlegend=False, line=dict(color=colors[i], dash=style["dash"]),
                                     marker=dict(symbol=style["symbol"], size=style["size"] - 1)), row=2, col=1)
    fig.update_yaxes(title_text="loss (nats per token)", row=1, col=1)
    if time:
        fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_xaxes(title_text="training step", row=rows, col=1)
    longest = max((int(df["step"].max()) + 1 for df in tables.values() if len(df)), default=1)
    fig.update_xaxes(tickmode="linear", tick0=0, dtick=max(1, math.ceil(longest / 12)))  # whole steps only
    last = {k: float(df["loss"].iloc[-1]) for k, df in tables.items() if len(df)}
    best = min(last, key=last.get) if last else ""
    sub = f"<br><sup>lowest final loss: {best} ({last[best]:.4f})</sup>" if best else ""
    return finish(fig, title=f"Training loss of {len(tables)} run{'s' if len(tables) != 1 else ''}{sub}",
                  legend_title="run", height=560 if time else 420, legend_below=True)
