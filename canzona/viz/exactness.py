"""The exactness-validation report as tables and figures.

A report (``runs/validation/<time>/report.json``, written by ``canzona validate``; the newest one
is found as every view finds runs, :func:`resolve_report`) is strict JSON::

    {"summary": {"cells": int, "passed": int, "failed": int, ...},
     "cells": [{"optimizer", "strategy", "mesh", "dtype", "check", "passed", "max_abs_diff",
                "first_mismatch", "seconds", ...}, ...],
     "losses": {"<strategy>": [loss per step, ...], ...}}

Each cell compares a distributed run with the single-device optimizer (``torch.equal``);
``max_abs_diff`` is 0.0 for a bitwise pass and null when nothing was compared (an error cell).
Loss trajectories come from the top-level ``losses`` map when the report has one, or else from
the training cells that carry their own ``losses`` (and ``reference_losses``: the ``sc``
baseline, or for the ``sc`` cell the single-process run), grouped by (optimizer, mesh, dtype).
Extra keys (``schema``, ``cell``, ``model``, ``steps``, ``reason``, ``error``, ...) are kept.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from canzona.config import DATA_DIR, PACKAGE_DATA
from canzona.runs import choose_run
from canzona.viz._style import PASS_STATES, finish, strategy_color
from canzona.fileio import read_json

__all__ = [
    "DEFAULT_REPORT",
    "SAMPLE_REPORT",
    "CELL_KEYS",
    "default_report_path",
    "resolve_report",
    "validate_report",
    "load_validation_report",
    "validation_table",
    "validation_matrix",
    "SINGLE_PROCESS",
    "loss_groups",
    "report_losses",
    "loss_table",
    "loss_deviation",
    "pass_state",
    "fig_validation_matrix",
    "fig_loss_trajectories",
    "loss_views",
]

#: where older versions of ``canzona validate`` wrote their report (a checkout's ``data/``)
DEFAULT_REPORT = DATA_DIR / "validation" / "report.json"
#: a real ``canzona validate --quick`` report shipped with the package
SAMPLE_REPORT = PACKAGE_DATA / "validation-sample" / "report.json"
CELL_KEYS: tuple[str, ...] = ("optimizer", "strategy", "mesh", "dtype", "check", "passed", "max_abs_diff", "first_mismatch", "seconds")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate_report(doc: Any, *, source: str = "validation report") -> dict[str, Any]:
    """Check a parsed report against the format above; raise ValueError naming the problem.
    ``max_abs_diff`` may be null (nothing compared) and ``first_mismatch`` anything JSON."""
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: a validation report is a JSON object")
    for key in ("summary", "cells"):
        if key not in doc:
            raise ValueError(f"{source}: missing {key!r}")
    s = doc["summary"]
    if not isinstance(s, dict) or not all(_is_int(s.get(k)) and s.get(k) >= 0 for k in ("cells", "passed", "failed")):
        raise ValueError(f"{source}: summary must hold non-negative integers cells, passed, failed")
    cells = doc["cells"]
    if not isinstance(cells, list):
        raise ValueError(f"{source}: cells must be a list")
    for i, c in enumerate(cells):
        if not isinstance(c, dict):
            raise ValueError(f"{source}: cell {i} is not an object")
        missing = [k for k in CELL_KEYS if k not in c]
        if missing:
            raise ValueError(f"{source}: cell {i} lacks {', '.join(missing)}")
        for k in ("optimizer", "strategy", "dtype", "check"):
            if not isinstance(c[k], str):
                raise ValueError(f"{source}: cell {i}: {k} must be a string")
        if c["passed"] is not None and not isinstance(c["passed"], bool):
            raise ValueError(f"{source}: cell {i}: passed must be true, false or null")
        if c["max_abs_diff"] is not None and not (_is_num(c["max_abs_diff"]) and c["max_abs_diff"] >= 0):
            raise ValueError(f"{source}: cell {i}: max_abs_diff must be a non-negative number or null")
        if c["seconds"] is not None and not (_is_num(c["seconds"]) and c["seconds"] >= 0):
            raise ValueError(f"{source}: cell {i}: seconds must be a non-negative number or null")
    passed = sum(1 for c in cells if c["passed"] is True)
    if (s["cells"], s["passed"], s["failed"]) != (len(cells), passed, len(cells) - passed):
        raise ValueError(
            f"{source}: summary says {s['cells']} cells / {s['passed']} passed / {s['failed']} failed, "
            f"the cells say {len(cells)} / {passed} / {len(cells) - passed}"
        )
    losses = doc.get("losses", {})
    if not isinstance(losses, dict):
        raise ValueError(f"{source}: losses must map strategy -> list of numbers")
    for k, v in losses.items():
        if not isinstance(v, list) or not all(_is_num(x) for x in v):
            raise ValueError(f"{source}: losses[{k!r}] must be a list of finite numbers")
    for i, c in enumerate(cells):
        for key in ("losses", "reference_losses"):
            if key in c and not (isinstance(c[key], list) and all(_is_num(x) for x in c[key])):
                raise ValueError(f"{source}: cell {i}: {key} must be a list of finite numbers")
    return doc


def _report_roots(root: str | Path | None) -> list[Path] | None:
    return None if root is None else [Path(root) / "runs"]


def resolve_report(path: str | Path | None = None, *, root: str | Path | None = None) -> tuple[Path, str]:
    """The validation report to show and the note naming it (:func:`canzona.runs.choose_run`):
    ``path``, else the newest ``report.json`` under the runs folders (``root``/runs when given,
    else :func:`canzona.runs.runs_roots`), else ``data/validation/report.json`` where an older
    version wrote it, else the shipped sample (the note says so)."""
    choice = choose_run("validation", path, sample=SAMPLE_REPORT, roots=_report_roots(root))
    if choice.sample and DEFAULT_REPORT.is_file():
        return DEFAULT_REPORT, f"validation report: {DEFAULT_REPORT} (an older `canzona validate` wrote it there; no newer run found)"
    return choice.path, choice.note


def default_report_path(root: str | Path | None = None) -> Path:
    """The path :func:`resolve_report` picks when given none."""
    return resolve_report(root=root)[0]


def load_validation_report(path: str | Path = DEFAULT_REPORT) -> dict[str, Any]:
    """Read and validate a report file (strict JSON: NaN / Infinity are rejected)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"validation report not found: {p} (run `canzona validate`, or open {SAMPLE_REPORT})")

    try:
        doc = read_json(p)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from None
    return validate_report(doc, source=str(p))


def _mesh_text(mesh: Any) -> str:
    if isinstance(mesh, str):
        return mesh
    if isinstance(mesh, dict):
        return " x ".join(f"{k}{v}" for k, v in mesh.items())
    if isinstance(mesh, (list, tuple)):
        return " x ".join(str(x) for x in mesh)
    return json.dumps(mesh)


_EXTRA_COLUMNS = ("cell", "model", "steps", "bitwise_expected", "bound", "reason", "error")


def validation_table(report: dict[str, Any]) -> pd.DataFrame:
    """The cells as a table, failures first: the required columns, then whichever of ``cell``,
    ``model``, ``steps``, ``bitwise_expected``, ``bound``, ``reason``, ``error`` the report has;
    ``mesh`` and ``first_mismatch`` rendered as text, ``passed`` null counted as not passed."""
    cells = report["cells"]
    extra = [k for k in _EXTRA_COLUMNS if any(k in c for c in cells)]
    df = pd.DataFrame([{k: c.get(k) for k in (*CELL_KEYS, *extra)} for c in cells], columns=[*CELL_KEYS, *extra])
    if df.empty:
        return df
    df["mesh"] = df["mesh"].map(_mesh_text)
    df["first_mismatch"] = df["first_mismatch"].map(lambda x: "" if x is None else (x if isinstance(x, str) else json.dumps(x)))
    df["max_abs_diff"] = df["max_abs_diff"].astype("float64")
    df["passed"] = df["passed"].map(lambda x: x is True).astype(bool)
    return df.sort_values(["passed", "optimizer", "strategy", "mesh", "check"], kind="stable").reset_index(drop=True)


def validation_matrix(report: dict[str, Any]) -> pd.DataFrame:
    """Cells per (strategy, optimizer): columns ``strategy``, ``optimizer``, ``passed``,
    ``bitwise`` (passed with ``max_abs_diff`` exactly 0), ``total`` and ``max_abs_diff`` (largest
    over the cells, NaN if none). ``passed - bitwise`` cells passed within the bound the suite
    documents where bitwise equality is not expected."""
    df = validation_table(report)
    if df.empty:
        return pd.DataFrame(columns=["strategy", "optimizer", "passed", "bitwise", "total", "max_abs_diff"])
    df = df.assign(bitwise=df["passed"] & (df["max_abs_diff"] == 0.0))
    g = df.groupby(["strategy", "optimizer"], sort=True)
    out = g.agg(passed=("passed", "sum"), bitwise=("bitwise", "sum"), total=("passed", "size"),
                max_abs_diff=("max_abs_diff", "max")).reset_index()
    out[["passed", "bitwise"]] = out[["passed", "bitwise"]].astype("int64")
    return out


#: label of the single-process trajectory recovered from the ``sc`` cell's reference
SINGLE_PROCESS = "single process"


def loss_groups(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(optimizer, mesh, dtype) of every group of training cells that carry loss trajectories,
    in report order (empty when the report only has the top-level ``losses`` map)."""
    out: list[tuple[str, str, str]] = []
    for c in report["cells"]:
        if isinstance(c.get("losses"), list):
            key = (c["optimizer"], _mesh_text(c["mesh"]), c["dtype"])
            if key not in out:
                out.append(key)
    return out


def report_losses(report: dict[str, Any], group: tuple[str, str, str] | None = None) -> dict[str, list[float]]:
    """Loss per step per strategy: the top-level ``losses`` map, or (when the report has none, or
    ``group`` is given) the trajectories of one (optimizer, mesh, dtype) group of training cells,
    the first group by default, with the single-process run the ``sc`` cell was compared with."""
    top = report.get("losses") or {}
    if top and group is None:
        return {k: list(v) for k, v in top.items()}
    groups = loss_groups(report)
    if not groups:
        raise ValueError("the report holds no loss trajectories")
    key = groups[0] if group is None else tuple(group)
    if key not in groups:
        raise ValueError(f"no loss trajectories for {key}; the report has {groups}")
    out: dict[str, list[float]] = {}
    for c in report["cells"]:
        if isinstance(c.get("losses"), list) and (c["optimizer"], _mesh_text(c["mesh"]), c["dtype"]) == key:
            if c["strategy"] == "sc" and isinstance(c.get("reference_losses"), list):
                out[SINGLE_PROCESS] = list(c["reference_losses"])
            out[c["strategy"]] = list(c["losses"])
    return out


def loss_table(report: dict[str, Any], group: tuple[str, str, str] | None = None) -> pd.DataFrame:
    """Loss per step per strategy in long form: ``strategy``, ``step``, ``loss``."""
    rows = [(k, i, float(v)) for k, vs in report_losses(report, group).items() for i, v in enumerate(vs)]
    return pd.DataFrame(rows, columns=["strategy", "step", "loss"])


def _reference(losses: dict[str, list[float]], reference: str | None) -> str:
    if not losses:
        raise ValueError("the report holds no loss trajectories")
    if reference is not None:
        if reference not in losses:
            raise ValueError(f"reference {reference!r} not among the trajectories ({', '.join(losses)})")
        return reference
    # sc is what the exactness suite compares every strategy with; then a single-process run
    for name in ("sc", SINGLE_PROCESS, "single", "reference"):
        if name in losses:
            return name
    return next(iter(losses))


def loss_deviation(report: dict[str, Any], *, reference: str | None = None, group: tuple[str, str, str] | None = None) -> pd.DataFrame:
    """Per strategy: ``steps``, ``max_abs_diff`` of its trajectory from the reference's over the
    common steps, and ``identical`` (every loss bitwise equal as float64 and same length)."""
    losses = report_losses(report, group)
    ref = _reference(losses, reference)
    r = np.asarray(losses[ref], dtype=np.float64)
    rows = []
    for k, v in losses.items():
        a = np.asarray(v, dtype=np.float64)
        n = min(len(a), len(r))
        diff = float(np.max(np.abs(a[:n] - r[:n]))) if n else 0.0
        rows.append({"strategy": k, "reference": ref, "steps": len(a), "max_abs_diff": diff,
                     "identical": bool(len(a) == len(r) and np.array_equal(a, r))})
    return pd.DataFrame(rows)


def fig_validation_matrix(report: dict[str, Any]) -> go.Figure:
    """Heatmap of passed / total cells per strategy and optimizer. A cell's colour is its state
    (:data:`~canzona.viz._style.PASS_STATES`: none passed, some failed, all passed) and the colour
    bar is those three bands, so bar and cells always agree; the fraction is written in the cell."""
    m = validation_matrix(report)
    s = report["summary"]
    if m.empty:
        raise ValueError("the report has no cells to draw")
    strategies = list(dict.fromkeys(m["strategy"]))
    optimizers = list(dict.fromkeys(m["optimizer"]))
    z = np.full((len(strategies), len(optimizers)), np.nan)
    text = [["" for _ in optimizers] for _ in strategies]
    for _, row in m.iterrows():
        i, j = strategies.index(row["strategy"]), optimizers.index(row["optimizer"])
        z[i, j] = pass_state(int(row["passed"]), int(row["total"]))
        text[i][j] = f"{row['passed']}/{row['total']}" + (f" ({row['passed'] - row['bitwise']} bound)" if row["passed"] > row["bitwise"] else "")
    n = len(PASS_STATES)
    # one flat band per state: state k covers [k - 0.5, k + 0.5] of the colour axis
    scale = [[pos, color] for k, (_, color) in enumerate(PASS_STATES) for pos in (k / n, (k + 1) / n)]
    fig = go.Figure(
        go.Heatmap(
            z=z, x=optimizers, y=strategies, text=text, texttemplate="%{text}", zmin=-0.5, zmax=n - 0.5,
            colorscale=scale,
            colorbar=dict(title=dict(text="cells"), tickvals=list(range(n)), ticktext=[label for label, _ in PASS_STATES]),
            name="cells passed", xgap=2, ygap=2,
            hovertemplate="%{y} / %{x}: %{text} passed<extra></extra>",
        )
    )
    fig.update_yaxes(autorange="reversed")  # strategies read top to bottom in table order
    bitwise = int(m["bitwise"].sum())
    bound = int(m["passed"].sum()) - bitwise
    how = f"{bitwise} bitwise equal" + (f", {bound} within a documented bound where bitwise is not expected" if bound else "")
    return finish(
        fig,
        title=f"Exactness: {s['passed']} of {s['cells']} cells passed, {s['failed']} failed<br><sup>{how}</sup>",
        x_title="optimizer",
        y_title="strategy",
        legend_title="cells passed (passed / total)",
        height=max(300, 45 * len(strategies) + 180),
    )


def pass_state(passed: int, total: int) -> int:
    """Index into :data:`~canzona.viz._style.PASS_STATES`: 0 none passed, 1 some failed, 2 all passed."""
    if total <= 0 or not 0 <= passed <= total:
        raise ValueError(f"passed {passed} of {total} cells is not a count")
    return 2 if passed == total else 0 if passed == 0 else 1


def fig_loss_trajectories(report: dict[str, Any], *, reference: str | None = None, group: tuple[str, str, str] | None = None) -> go.Figure:
    """Top: training loss per step, one line per strategy. Bottom: each trajectory minus the
    reference (``sc`` when present, else the single-process run); identical runs sit on zero.
    ``group``: (optimizer, mesh, dtype) of the training cells to draw (see :func:`report_losses`)."""
    losses = report_losses(report, group)
    ref = _reference(losses, reference)
    dev = loss_deviation(report, reference=ref, group=group).set_index("strategy")
    r = np.asarray(losses[ref], dtype=np.float64)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.08,
                        subplot_titles=("training loss", f"difference from {ref}"))
    dashes = ["solid", "dash", "dot", "dashdot", "longdash", "longdashdot"]
    for i, (k, v) in enumerate(losses.items()):
        a = np.asarray(v, dtype=np.float64)
        steps = np.arange(len(a))
        c = strategy_color(k)
        tag = "identical" if dev.at[k, "identical"] else f"max |diff| {dev.at[k, 'max_abs_diff']:.3g}"
        fig.add_trace(go.Scatter(x=steps, y=a, mode="lines+markers", name=f"{k} ({tag})", legendgroup=k,
                                 line=dict(color=c, dash=dashes[i % len(dashes)]), marker=dict(size=5)), row=1, col=1)
        n = min(len(a), len(r))
        fig.add_trace(go.Scatter(x=steps[:n], y=a[:n] - r[:n], mode="lines+markers", name=k, legendgroup=k, showlegend=False,
                                 line=dict(color=c, dash=dashes[i % len(dashes)]), marker=dict(size=4)), row=2, col=1)
    all_same = bool(dev["identical"].all())
    same = [k for k in dev.index if dev.at[k, "identical"] and k != ref]
    differ = [f"{k} (max {dev.at[k, 'max_abs_diff']:.2g})" for k in dev.index if not dev.at[k, "identical"]]
    fig.update_yaxes(title_text="loss (nats per token)", row=1, col=1)
    fig.update_yaxes(title_text="loss - reference (nats)", row=2, col=1)
    # the top panel shares the bottom one's x axis: one title under the bottom panel, integer steps
    fig.update_xaxes(title_text="training step", row=2, col=1)
    fig.update_xaxes(tickmode="linear", tick0=0, dtick=max(1, int(np.ceil(max(len(v) for v in losses.values()) / 12))))
    if all_same:
        verdict = "all trajectories bitwise identical"
    else:
        verdict = f"bitwise identical to {ref}: {', '.join(same) or 'none'}<br><sup>different: {', '.join(differ)}</sup>"
    which = "" if group is None and report.get("losses") else " ({}, {}, {})".format(*(group or loss_groups(report)[0]))
    return finish(fig, title=f"Loss per strategy{which}: {verdict}", legend_title="strategy (vs reference)", height=560)


def loss_views(report: dict[str, Any]) -> list[tuple[str, pd.DataFrame, go.Figure]]:
    """Everything the report has to show about losses: one (label, deviation table, figure) for the
    top-level ``losses`` map if present and one per (optimizer, mesh, dtype) group of training
    cells. Empty when the report carries no trajectories (e.g. a run of injected-gradient checks
    only)."""
    out: list[tuple[str, pd.DataFrame, go.Figure]] = []
    if report.get("losses"):
        out.append(("losses", loss_deviation(report), fig_loss_trajectories(report)))
    for g in loss_groups(report):
        out.append((" / ".join(g), loss_deviation(report, group=g), fig_loss_trajectories(report, group=g)))
    return out
