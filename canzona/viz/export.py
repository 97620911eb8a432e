"""The main figures of the notebooks in one call, and writing them as standalone HTML files
(``canzona figures --out DIR``).

Planner figures are always produced. Figures that need data (a profiler trace summary, a
validation report) are produced when that data exists; :func:`main_figures` returns which were
skipped and why, so the command can say so instead of failing or silently leaving them out.
"""

from __future__ import annotations

import html
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go

from canzona.fileio import atomic_write
from canzona.viz.exactness import DEFAULT_REPORT, SAMPLE_REPORT, fig_loss_trajectories, fig_validation_matrix, load_validation_report
from canzona.viz.microgroups import cmax_sweep, fig_cmax_sweep, fig_microgroup_gantt, fig_tp_sweep, microgroup_summary, tp_sweep
from canzona.viz.partition import fig_balance_vs_paper, fig_partition_map, fig_strategy_comparison, strategy_summary
from canzona.viz.scaling import SCALING_MODELS, fig_alpha_tradeoff, fig_sweep, plan_sweep
from canzona.viz.timeline import DEFAULT_PROFILE_DIR, fig_critical_path, fig_timeline, load_profile

__all__ = ["PLOTLYJS_MODES", "FigureSet", "FIGURE_NAMES", "main_figures", "write_figures"]

#: how the plotly.js library reaches the page: inlined in every file (works offline, ~5 MB per
#: file), one plotly.min.js beside the files (offline, small files), or the plotly CDN (online)
PLOTLYJS_MODES: dict[str, bool | str] = {"inline": True, "directory": "directory", "cdn": "cdn"}

#: every figure main_figures can produce, in order
FIGURE_NAMES: tuple[str, ...] = (
    "partition_map",
    "strategy_loads",
    "balance_vs_paper",
    "microgroup_gantt",
    "cmax_sweep",
    "tp_sweep",
    "dp_scaling",
    "model_scaling",
    "alpha_sweep",
    "time_breakdown",
    "time_components",
    "timeline",
    "critical_path",
    "validation_matrix",
    "loss_trajectories",
)


@dataclass(slots=True)
class FigureSet:
    """Figures by name, in production order, and the names skipped with the reason."""

    figures: dict[str, go.Figure] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _plan(model: str, **kw):
    from canzona.plan.build import plan_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return plan_model(model, **kw)


def main_figures(
    *,
    model: str = "qwen3-32b",
    dp: int = 32,
    tp: int = 8,
    optimizer: str = "muon",
    flops_shape: str = "local",
    profile: str | Path | None = DEFAULT_PROFILE_DIR,
    report: str | Path | None = None,
    only: Sequence[str] | None = None,
) -> FigureSet:
    """Build the main figures for one configuration (the paper's, Qwen3-32B Muon DP32 x TP8, by
    default, with its FLOPs accounting on TP-local shapes).

    ``profile``: a trace summary directory (None: no timeline figures); ``report``: a validation
    report (None: ``data/validation/report.json`` if present, else the shipped sample).
    ``only``: names from :data:`FIGURE_NAMES` to build (all by default).
    """
    wanted = list(FIGURE_NAMES if only is None else only)
    unknown = [n for n in wanted if n not in FIGURE_NAMES]
    if unknown:
        raise ValueError(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURE_NAMES)}")
    out = FigureSet()
    base = dict(dp=dp, tp=tp, optimizer=optimizer, flops_shape=flops_shape)
    plans: dict[str, object] = {}

    def plan(strategy: str):
        if strategy not in plans:
            plans[strategy] = _plan(model, strategy=strategy, **base)
        return plans[strategy]

    builders: dict[str, Callable[[], go.Figure]] = {
        "partition_map": lambda: fig_partition_map(plan("lb-asc")),
        "strategy_loads": lambda: fig_strategy_comparison([plan(s) for s in ("zero1", "asc", "lb-asc", "layerwise")], memory="numel"),
        "balance_vs_paper": lambda: fig_balance_vs_paper(strategy_summary([plan(s) for s in ("asc", "lb-asc", "lb-asc-joint", "layerwise")])),
        "microgroup_gantt": lambda: fig_microgroup_gantt(
            plan("lb-asc"), int(microgroup_summary(plan("lb-asc"))["makespan_sync"].idxmax())
        ),
        "cmax_sweep": lambda: fig_cmax_sweep(cmax_sweep(model, dp=16, tp=tp, optimizer=optimizer, flops_shape=flops_shape)),
        "tp_sweep": lambda: fig_tp_sweep(
            tp_sweep(model, dp=dp, optimizer=optimizer, schedules=("round-robin", "lpt", "lpt-carry", "no-fuse"), flops_shape=flops_shape)
        ),
        "dp_scaling": lambda: fig_sweep(
            plan_sweep(models=(model,), dps=(16, 32, 64, 128), tps=(tp,), strategies=("asc", "lb-asc", "lb-asc-joint", "layerwise"),
                       optimizer=optimizer, flops_shape=flops_shape),
            x="dp", log_x=True, title=f"DP scaling of load balance: {model}, {optimizer}, TP{tp} (FLOPs on {flops_shape} shapes)",
        ),
        "model_scaling": lambda: fig_sweep(
            plan_sweep(models=SCALING_MODELS, dps=(dp,), tps=(tp,), strategies=("asc", "lb-asc", "lb-asc-joint", "layerwise"),
                       optimizer=optimizer, flops_shape=flops_shape),
            x="params_b", log_x=True, title=f"Model-size scaling of load balance: Qwen3 1.7B..32B, {optimizer}, DP{dp} x TP{tp}",
        ),
        "alpha_sweep": lambda: fig_alpha_tradeoff(
            plan_sweep(models=(model,), dps=(dp,), tps=(tp,), strategies=("lb-asc",), alphas=[i / 10 for i in range(11)],
                       optimizer=optimizer, flops_shape=flops_shape)
        ),
        "time_breakdown": lambda: _time_breakdown(model, dp, tp, optimizer),
        "time_components": lambda: _time_components(model, dp, tp, optimizer),
    }
    prof = None
    if profile is not None and any(n in wanted for n in ("timeline", "critical_path")):
        if Path(profile).exists():
            prof = load_profile(profile)
            builders["timeline"] = lambda: fig_timeline(prof.phases, step=int(prof.phases["step"].max()), title=prof.label)
            builders["critical_path"] = lambda: fig_critical_path(prof.phases)
        else:
            for n in ("timeline", "critical_path"):
                out.skipped[n] = f"no trace summary at {profile}"
    elif profile is None:
        for n in ("timeline", "critical_path"):
            out.skipped[n] = "no profile given"
    rep_path = Path(report) if report is not None else (DEFAULT_REPORT if DEFAULT_REPORT.is_file() else SAMPLE_REPORT)
    if any(n in wanted for n in ("validation_matrix", "loss_trajectories")):
        if rep_path.is_file():
            rep = load_validation_report(rep_path)
            builders["validation_matrix"] = lambda: fig_validation_matrix(rep)
            builders["loss_trajectories"] = lambda: fig_loss_trajectories(rep)
        elif report is not None:
            raise FileNotFoundError(f"validation report not found: {report}")
        else:
            for n in ("validation_matrix", "loss_trajectories"):
                out.skipped[n] = f"no validation report at {DEFAULT_REPORT} or {SAMPLE_REPORT}"
    for name in FIGURE_NAMES:
        if name in wanted and name in builders:
            out.figures[name] = builders[name]()
    return out


def _time_breakdown(model: str, dp: int, tp: int, optimizer: str) -> go.Figure:
    from canzona.viz.simulation import fig_time_breakdown, simulate_breakdown

    return fig_time_breakdown(simulate_breakdown(model, dp=dp, tp=tp, optimizer=optimizer))


def _time_components(model: str, dp: int, tp: int, optimizer: str) -> go.Figure:
    from canzona.viz.simulation import fig_time_components, simulate_components

    return fig_time_components(simulate_components(model, dp=dp, tp=tp, optimizer=optimizer))


def write_figures(figures: FigureSet | dict[str, go.Figure], out_dir: str | Path, *, plotlyjs: str = "inline") -> list[Path]:
    """Write each figure to ``out_dir/<name>.html`` plus an ``index.html`` linking them; returns
    the paths written. ``plotlyjs`` is one of :data:`PLOTLYJS_MODES`."""
    if plotlyjs not in PLOTLYJS_MODES:
        raise ValueError(f"plotlyjs must be one of {', '.join(PLOTLYJS_MODES)}, got {plotlyjs!r}")
    figs = figures.figures if isinstance(figures, FigureSet) else dict(figures)
    skipped = figures.skipped if isinstance(figures, FigureSet) else {}
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figs.items():
        p = out / f"{name}.html"
        atomic_write(p, fig.to_html(include_plotlyjs=PLOTLYJS_MODES[plotlyjs], full_html=True))
        paths.append(p)
    items = []
    for name, fig in figs.items():
        title = html.escape((fig.layout.title.text or name).split("<br>")[0])
        items.append(f'<li><a href="{name}.html">{title}</a></li>')
    for name, why in skipped.items():
        items.append(f"<li>{html.escape(name)}: not written ({html.escape(why)})</li>")
    index = out / "index.html"
    atomic_write(
        index,
        "<!doctype html><html><head><meta charset='utf-8'><title>canzona figures</title></head><body>"
        "<h1>canzona figures</h1><ul>" + "".join(items) + "</ul></body></html>\n",
    )
    return [*paths, index]
