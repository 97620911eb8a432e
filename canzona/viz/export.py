"""The main figures of the notebooks in one call, and writing them as files
(``canzona figures --out DIR [--format html|png|svg|pdf]``).

HTML files share one ``plotly.min.js`` written beside them by default (a few hundred kB each
instead of ~5 MB with plotly.js inlined). PNG, SVG and PDF go through plotly's static exporter,
kaleido (an optional dependency: ``pip install "canzona[figures]"``), which drives a
Chrome/Chromium it finds on ``PATH`` or at ``BROWSER_PATH``; :func:`static_export_problem` says
in one line what is missing when it cannot run.

Planner figures are always produced. Figures that need data (a profiler trace summary, a
validation report) are produced when that data exists; :func:`main_figures` returns which were
skipped and why, so the command can say so instead of failing or silently leaving them out.
"""

from __future__ import annotations

import html
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import plotly.graph_objects as go

from canzona.plan.plan import DEFAULT_FLOPS_SHAPE
from canzona.fileio import atomic_write
from canzona.viz.exactness import DEFAULT_REPORT, SAMPLE_REPORT, fig_loss_trajectories, fig_validation_matrix, load_validation_report, resolve_report
from canzona.viz.microgroups import cmax_sweep, fig_cmax_sweep, fig_microgroup_gantt, fig_tp_sweep, microgroup_summary, tp_sweep
from canzona.viz.partition import fig_balance_vs_paper, fig_partition_map, fig_strategy_comparison, strategy_summary
from canzona.viz.scaling import SCALING_MODELS, fig_alpha_tradeoff, fig_sweep, plan_sweep
from canzona.viz.timeline import fig_critical_path, fig_timeline, load_profile, resolve_profile

__all__ = [
    "FORMATS",
    "LATEST",
    "PLOTLYJS_MODES",
    "FigureSet",
    "FIGURE_NAMES",
    "StaticExportError",
    "main_figures",
    "static_export_problem",
    "write_figures",
]

#: how the plotly.js library reaches the page: inlined in every file (works offline, ~5 MB per
#: file), one plotly.min.js beside the files (offline, small files), or the plotly CDN (online)
PLOTLYJS_MODES: dict[str, bool | str] = {"inline": True, "directory": "directory", "cdn": "cdn"}

#: output formats of :func:`write_figures`; all but html need the static exporter
FORMATS: tuple[str, ...] = ("html", "png", "svg", "pdf")

#: size of a static picture when the figure does not set one (CSS pixels; PNG is drawn at 2x)
STATIC_WIDTH, STATIC_HEIGHT, PNG_SCALE = 1200, 600, 2


class StaticExportError(RuntimeError):
    """PNG/SVG/PDF export cannot run here; the message says what is missing, in one line."""


def static_export_problem() -> str | None:
    """None when plotly's static exporter can run here, else one line saying what is missing
    (kaleido, or a Chrome/Chromium for it to drive) and how to get it."""
    try:
        import kaleido  # noqa: F401 - only its presence is checked here
    except ImportError:
        return 'kaleido is not installed (pip install "canzona[figures]", or pip install "kaleido>=1")'
    try:
        from choreographer.browsers.chromium import Chromium

        browser = Chromium.find_browser(skip_local=False)
    except Exception as exc:  # noqa: BLE001 - any failure to look means export cannot run
        return f"kaleido cannot look for a browser ({type(exc).__name__}: {exc})"
    if browser is None:
        return ("kaleido found no Chrome/Chromium: install one (e.g. apt-get install chromium, or "
                "plotly_get_chrome) or point BROWSER_PATH at its executable")
    return None

#: ``main_figures(profile=LATEST)``: the newest run under runs/, else the shipped sample
LATEST = "latest"

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
    "loss_curves",
)


@dataclass(slots=True)
class FigureSet:
    """Figures by name, in production order, the names skipped with the reason, and notes for the
    user (which profile was read)."""

    figures: dict[str, go.Figure] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


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
    flops_shape: str = DEFAULT_FLOPS_SHAPE,
    profile: str | Path | None = LATEST,
    report: str | Path | None = None,
    only: Sequence[str] | None = None,
) -> FigureSet:
    """Build the main figures for one configuration (the paper's, Qwen3-32B Muon DP32 x TP8, by
    default; FLOPs on :data:`~canzona.plan.plan.DEFAULT_FLOPS_SHAPE` shapes like the planner).

    ``profile``: a trace summary or raw trace directory, :data:`LATEST` (the default: the newest run
    under ``runs/``, else the shipped sample, with a note in ``notes``) or None (no timeline
    figures); ``report``: a
    validation report (None: the newest run's, found like every view finds runs,
    :func:`~canzona.viz.exactness.resolve_report`, else the shipped sample; the note says which).
    ``loss_curves`` draws every run with a metrics log under ``runs/`` (skipped when there is none).
    ``only``: names from :data:`FIGURE_NAMES` to build (all by default).
    """
    wanted = _wanted_figures(only)
    out = FigureSet()
    builders = _plan_builders(model, dp=dp, tp=tp, optimizer=optimizer, flops_shape=flops_shape)
    _add_profile_builders(builders, out, wanted, profile)
    _add_report_builders(builders, out, wanted, report)
    _add_loss_curves_builder(builders, out, wanted)
    for name in FIGURE_NAMES:
        if name in wanted and name in builders:
            out.figures[name] = builders[name]()
    return out


def _wanted_figures(only: Sequence[str] | None) -> list[str]:
    """The figure names to build, in the caller's order; unknown names are refused."""
    wanted = list(FIGURE_NAMES if only is None else only)
    unknown = [n for n in wanted if n not in FIGURE_NAMES]
    if unknown:
        raise ValueError(f"unknown figure(s) {', '.join(unknown)}; choose from {', '.join(FIGURE_NAMES)}")
    return wanted


def _plan_builders(model: str, *, dp: int, tp: int, optimizer: str, flops_shape: str) -> dict[str, Callable[[], go.Figure]]:
    """Builders of the figures drawn from plans and sweeps (no input files); each plan is made once."""
    base = dict(dp=dp, tp=tp, optimizer=optimizer, flops_shape=flops_shape)
    plans: dict[str, object] = {}

    def plan(strategy: str):
        if strategy not in plans:
            plans[strategy] = _plan(model, strategy=strategy, **base)
        return plans[strategy]

    return {
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


def _add_profile_builders(builders: dict[str, Callable[[], go.Figure]], out: FigureSet, wanted: list[str],
                          profile: str | Path | None) -> None:
    """Add the timeline figures from ``profile`` (resolving :data:`LATEST`), or record why they are skipped."""
    prof = None
    if profile == LATEST and any(n in wanted for n in ("timeline", "critical_path")):
        profile, note = resolve_profile(None)
        out.notes.append(note)
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


def _add_report_builders(builders: dict[str, Callable[[], go.Figure]], out: FigureSet, wanted: list[str],
                         report: str | Path | None) -> None:
    """Add the validation-report figures (resolving ``report=None`` to the newest run's or the sample)."""
    rep_path = Path(report) if report is not None else SAMPLE_REPORT
    if any(n in wanted for n in ("validation_matrix", "loss_trajectories")):
        if report is None:
            rep_path, rep_note = resolve_report()
            out.notes.append(rep_note)
        if rep_path.is_file():
            rep = load_validation_report(rep_path)
            builders["validation_matrix"] = lambda: fig_validation_matrix(rep)
            builders["loss_trajectories"] = lambda: fig_loss_trajectories(rep)
        elif report is not None:
            raise FileNotFoundError(f"validation report not found: {report}")
        else:
            for n in ("validation_matrix", "loss_trajectories"):
                out.skipped[n] = f"no validation report at {DEFAULT_REPORT} or {SAMPLE_REPORT}"


def _add_loss_curves_builder(builders: dict[str, Callable[[], go.Figure]], out: FigureSet, wanted: list[str]) -> None:
    """Add the loss-curve figure over every run with a metrics log, or record that there is none."""
    if "loss_curves" in wanted:
        from canzona.viz.training import discover_runs, fig_loss_curves

        runs = discover_runs()
        if runs:
            builders["loss_curves"] = lambda: fig_loss_curves(runs)
        else:
            out.skipped["loss_curves"] = "no metrics logs under runs/ (canzona train writes them)"


def _time_breakdown(model: str, dp: int, tp: int, optimizer: str) -> go.Figure:
    from canzona.viz.simulation import fig_time_breakdown, simulate_breakdown

    return fig_time_breakdown(simulate_breakdown(model, dp=dp, tp=tp, optimizer=optimizer))


def _time_components(model: str, dp: int, tp: int, optimizer: str) -> go.Figure:
    from canzona.viz.simulation import fig_time_components, simulate_components

    return fig_time_components(simulate_components(model, dp=dp, tp=tp, optimizer=optimizer))


def _write_static(figs: dict[str, go.Figure], paths: list[Path], fmt: str) -> None:
    """Export static pictures into a private folder beside the targets, then rename each into
    place (a failed export leaves the old files and nothing half-written)."""
    import shutil
    import tempfile

    import plotly.io as pio

    out = paths[0].parent
    tmp = Path(tempfile.mkdtemp(prefix=".figures.", dir=out))
    try:
        staged = [tmp / p.name for p in paths]
        # one call for all figures: kaleido starts its browser once
        pio.write_images(
            list(figs.values()), staged, format=fmt,
            width=[f.layout.width or STATIC_WIDTH for f in figs.values()],
            height=[f.layout.height or STATIC_HEIGHT for f in figs.values()],
            scale=PNG_SCALE if fmt == "png" else 1,
        )
        for src, dst in zip(staged, paths):
            try:
                os.replace(src, dst)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror or str(exc), str(dst)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_figures(
    figures: FigureSet | dict[str, go.Figure], out_dir: str | Path, *, fmt: str = "html", plotlyjs: str = "directory",
) -> list[Path]:
    """Write each figure to ``out_dir/<name>.<fmt>`` plus an ``index.html`` linking them; returns
    the paths written. ``fmt`` is one of :data:`FORMATS`; ``plotlyjs`` (HTML only) one of
    :data:`PLOTLYJS_MODES`: ``directory`` writes one ``plotly.min.js`` that every file loads.
    Raises :class:`StaticExportError` (before writing anything) when a static format cannot be
    exported here."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if plotlyjs not in PLOTLYJS_MODES:
        raise ValueError(f"plotlyjs must be one of {', '.join(PLOTLYJS_MODES)}, got {plotlyjs!r}")
    if fmt != "html" and (problem := static_export_problem()) is not None:
        raise StaticExportError(f"cannot write {fmt}: {problem}")
    figs = figures.figures if isinstance(figures, FigureSet) else dict(figures)
    skipped = figures.skipped if isinstance(figures, FigureSet) else {}
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.{fmt}" for name in figs]
    if fmt == "html":
        if plotlyjs == "directory":
            from plotly.offline import get_plotlyjs

            atomic_write(out / "plotly.min.js", get_plotlyjs())
        for p, fig in zip(paths, figs.values()):
            # the page is built in memory and renamed into place: never a half-written page
            atomic_write(p, fig.to_html(include_plotlyjs=PLOTLYJS_MODES[plotlyjs], full_html=True))
    elif figs:
        _write_static(figs, paths, fmt)
    items = []
    for name, fig in figs.items():
        title = html.escape((fig.layout.title.text or name).split("<br>")[0])
        items.append(f'<li><a href="{name}.{fmt}">{title}</a></li>')
    for name, why in skipped.items():
        items.append(f"<li>{html.escape(name)}: not written ({html.escape(why)})</li>")
    index = out / "index.html"
    atomic_write(
        index,
        "<!doctype html><html><head><meta charset='utf-8'><title>canzona figures</title></head><body>"
        "<h1>canzona figures</h1><ul>" + "".join(items) + "</ul></body></html>\n",
    )
    extra = [out / "plotly.min.js"] if fmt == "html" and plotlyjs == "directory" else []
    return [*paths, *extra, index]
