"""Interactive explorers for the notebooks: ipywidgets controls over canzona's figure functions.

An :class:`Explorer` builds its figures once, eagerly, when it is created (so a headless run
fails loudly on a bad configuration) and replaces them in place whenever a control changes.
Changing a control to a configuration the planner rejects shows the error beside the controls
and keeps the last good figures.

Each figure lives in an ``ipywidgets.Output`` whose ``outputs`` the kernel sets directly (the
figure's full MIME bundle: plotly JSON plus the HTML copy of :mod:`canzona.viz.notebook`), so a
new figure reaches the page as widget state, which every widget front end syncs from a callback.
JupyterLab is checked in a browser (tests/test_jupyterlab.py); Notebook 7 runs JupyterLab's
front end; VS Code's widget renderer draws Output widgets too (not tested here). Display handles
updated from a widget callback, the earlier way, never reached JupyterLab's page. Plotly's
``FigureWidget`` would also work but needs anywidget and a per-figure diff of traces; a whole
new figure is simpler and is what a changed plan is.
"""

from __future__ import annotations

import html
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go

from canzona.config import available_models
from canzona.optimizers import optimizer_names
from canzona.plan.build import cmax_to_bytes
from canzona.plan.plan import COSTS, DEFAULT_FLOPS_SHAPE, FLOPS_SHAPES, STRATEGIES, TP_SCHEDULES

__all__ = [
    "EXPLORER_CLASS",
    "Explorer",
    "figure_output",
    "model_control",
    "partition_explorer",
    "strategy_explorer",
    "microgroup_explorer",
    "timeline_explorer",
]

Figures = Sequence[go.Figure]

PLOTLY_MIME = "application/vnd.plotly.v1+json"
#: CSS class of every explorer's outer box on the page
EXPLORER_CLASS = "canzona-explorer"

_LAYOUT = W.Layout(width="260px")
_STYLE = {"description_width": "90px"}


class Explorer:
    """Controls plus figures that follow them.

    ``build(**values)`` returns one figure or a sequence of figures, ``values`` being the
    controls' current values by name. ``figures`` always holds the latest successful build;
    ``error`` the message of the latest failed one (None after a success).
    """

    def __init__(self, build: Callable[..., go.Figure | Figures], controls: Mapping[str, W.ValueWidget], *, columns: int = 4) -> None:
        if not controls:
            raise ValueError("an explorer needs at least one control")
        self.build = build
        self.controls = dict(controls)
        self.status = W.HTML(value="")
        self.error: str | None = None
        self.figures: list[go.Figure] = self._build()
        self.outputs: list[W.Output] = [W.Output() for _ in self.figures]
        self._show()
        for w in self.controls.values():
            w.observe(self._on_change, names="value")
        boxes = list(self.controls.values())
        grid = W.GridBox(boxes, layout=W.Layout(grid_template_columns=f"repeat({columns}, 270px)"))
        self.ui = W.VBox([grid, self.status, *self.outputs])
        # a stable hook for styling and for the browser test that drives an explorer
        self.ui.add_class(EXPLORER_CLASS)

    def values(self) -> dict[str, Any]:
        return {k: w.value for k, w in self.controls.items()}

    def _build(self) -> list[go.Figure]:
        out = self.build(**self.values())
        figs = [out] if isinstance(out, go.Figure) else list(out)
        if not figs or not all(isinstance(f, go.Figure) for f in figs):
            raise TypeError("an explorer's build function must return plotly figures")
        return figs

    def refresh(self) -> list[go.Figure]:
        """Rebuild from the current control values and update the shown figures in place.
        Raises what the build raises (the control callback catches it and shows it instead)."""
        figs = self._build()
        if len(figs) != len(self.outputs):
            raise RuntimeError("the build function changed its number of figures")
        self.figures = figs
        self.error = None
        self.status.value = ""
        self._show()
        return figs

    def _show(self) -> None:
        """Put each figure's MIME bundle into its Output widget (one state change per figure)."""
        for out, fig in zip(self.outputs, self.figures):
            out.outputs = (figure_output(fig),)

    def _on_change(self, _change: Mapping[str, Any]) -> None:
        try:
            self.refresh()
        except (ValueError, TypeError, KeyError, RuntimeError, OSError) as exc:
            # a configuration the planner rejects: say so next to the controls, keep the old figures
            self.error = f"{type(exc).__name__}: {exc}"
            self.status.value = f"<span style='color:#b00'>cannot draw this configuration: {html.escape(str(exc))}</span>"

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.ui)


def figure_output(fig: go.Figure) -> dict[str, Any]:
    """``fig`` as one nbformat ``display_data`` output: the MIME bundle plotly's current default
    renderer makes (with :func:`canzona.viz.notebook.use_notebook_renderer`: the plotly JSON and
    an HTML copy). Not ``IPython.display``'s formatter: a plotly figure displays itself
    (``_ipython_display_``), so the formatter hands back nothing and would publish the figure
    as a side effect."""
    data = dict(fig._repr_mimebundle_())
    # a renderer that is no MIME type (browser, png files) adds nothing: the page still needs the JSON
    data.setdefault(PLOTLY_MIME, json.loads(fig.to_json()))
    data.setdefault("text/plain", f"<plotly figure: {fig.layout.title.text or 'untitled'}>")
    return {"output_type": "display_data", "data": data, "metadata": {}}


# ------------------------------------------------------------------------------------------ controls
def _dropdown(name: str, options: Sequence[Any], value: Any) -> W.Dropdown:
    if value not in options:
        raise ValueError(f"{name}: {value!r} is not one of {list(options)}")
    return W.Dropdown(options=list(options), value=value, description=name, layout=_LAYOUT, style=_STYLE)


def model_control(value: str = "qwen3-32b") -> W.Dropdown:
    return _dropdown("model", available_models(), value)


_DP_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_TP_CHOICES = (1, 2, 4, 8)


def _plan_controls(model: str, dp: int, tp: int, optimizer: str) -> dict[str, W.Widget]:
    """The controls every planning explorer starts with: model, DP size, TP size, matrix optimizer."""
    return {
        "model": model_control(model),
        "dp": _dropdown("dp", _DP_CHOICES, dp),
        "tp": _dropdown("tp", _TP_CHOICES, tp),
        "optimizer": _dropdown("optimizer", list(optimizer_names(matrix=True)), optimizer),
    }


def _alpha(value: float) -> W.FloatSlider:
    return W.FloatSlider(value=value, min=0.0, max=1.0, step=0.05, description="alpha", continuous_update=False, layout=_LAYOUT, style=_STYLE)


def partition_explorer(
    *, model: str = "qwen3-32b", dp: int = 32, tp: int = 8, optimizer: str = "muon", alpha: float = 1.0,
    strategy: str = "lb-asc", cost: str = "numel", flops_shape: str = DEFAULT_FLOPS_SHAPE, memory: str = "numel",
) -> Explorer:
    """Partition map and per-rank loads of one plan, with controls for every planner input."""
    from canzona.viz.partition import MEMORY_VIEWS, fig_partition_map, fig_rank_loads

    def build(model: str, dp: int, tp: int, optimizer: str, alpha: float, strategy: str, cost: str, flops_shape: str, memory: str) -> Figures:
        plan = _quiet_plan(model, dp=dp, tp=tp, optimizer=optimizer, alpha=alpha, strategy=strategy, cost=cost, flops_shape=flops_shape)
        return [fig_partition_map(plan), fig_rank_loads(plan, memory=memory)]

    return Explorer(build, {
        **_plan_controls(model, dp, tp, optimizer),
        "alpha": _alpha(alpha),
        "strategy": _dropdown("strategy", STRATEGIES, strategy),
        "cost": _dropdown("cost", COSTS, cost),
        "flops_shape": _dropdown("flops shape", FLOPS_SHAPES, flops_shape),
        "memory": _dropdown("memory view", list(MEMORY_VIEWS), memory),
    })


def strategy_explorer(
    *, model: str = "qwen3-32b", dp: int = 32, tp: int = 8, optimizer: str = "muon", alpha: float = 1.0,
    strategies: Sequence[str] = ("zero1", "asc", "lb-asc", "layerwise"), cost: str = "numel", flops_shape: str = DEFAULT_FLOPS_SHAPE,
    memory: str = "numel",
) -> Explorer:
    """Several strategies side by side (per-rank loads) and their R_LB ratios beside the paper's."""
    from canzona.viz.partition import MEMORY_VIEWS, fig_balance_vs_paper, fig_strategy_comparison, strategy_summary

    chosen = tuple(strategies)

    def build(model: str, dp: int, tp: int, optimizer: str, alpha: float, cost: str, flops_shape: str, memory: str) -> Figures:
        plans = [_quiet_plan(model, dp=dp, tp=tp, optimizer=optimizer, alpha=alpha, strategy=s, cost=cost, flops_shape=flops_shape) for s in chosen]
        return [fig_strategy_comparison(plans, memory=memory), fig_balance_vs_paper(strategy_summary(plans))]

    return Explorer(build, {
        **_plan_controls(model, dp, tp, optimizer),
        "alpha": _alpha(alpha),
        "cost": _dropdown("cost", COSTS, cost),
        "flops_shape": _dropdown("flops shape", FLOPS_SHAPES, flops_shape),
        "memory": _dropdown("memory view", list(MEMORY_VIEWS), memory),
    })


def microgroup_explorer(
    *, model: str = "qwen3-32b", dp: int = 32, tp: int = 8, optimizer: str = "muon", strategy: str = "lb-asc",
    tp_schedule: str = "lpt-carry", cmax: float = 512, dp_rank: int | None = None, timeline: str = "sync", flops_shape: str = DEFAULT_FLOPS_SHAPE,
) -> Explorer:
    """Gantt chart of one DP rank's micro-groups and that rank's TP host loads. ``dp_rank`` None
    starts on the DP rank whose schedule shows the plan's character (:func:`canzona.viz.meshload.illustrative_dp_rank`)
    and adds the load over every GPU of the mesh with the atomic lower bound."""
    from canzona.viz.meshload import fig_gpu_loads, illustrative_dp_rank
    from canzona.viz.microgroups import fig_microgroup_gantt, fig_tp_host_loads

    def build(model: str, dp: int, tp: int, optimizer: str, strategy: str, tp_schedule: str, cmax: float, dp_rank: int,
              timeline: str, flops_shape: str) -> Figures:
        plan = _quiet_plan(model, dp=dp, tp=tp, optimizer=optimizer, strategy=strategy, tp_schedule=tp_schedule,
                           cmax_bytes=cmax_to_bytes(float(cmax), tp), flops_shape=flops_shape)
        r = illustrative_dp_rank(plan) if dp_rank < 0 else dp_rank
        if r >= dp:
            raise ValueError(f"dp rank {r} does not exist with dp={dp}")
        # the companion view: every GPU of the mesh with the mean and the atomic lower bound
        return [fig_microgroup_gantt(plan, r, timeline=timeline), fig_tp_host_loads(plan, r), fig_gpu_loads(plan)]

    return Explorer(build, {
        **_plan_controls(model, dp, tp, optimizer),
        "strategy": _dropdown("strategy", STRATEGIES, strategy),
        "tp_schedule": _dropdown("TP schedule", TP_SCHEDULES, tp_schedule),
        "cmax": W.BoundedFloatText(value=cmax, min=0.001, max=1 << 20, description="C_max (2^20 TP-local el.)", layout=_LAYOUT,
                                   style=_STYLE),
        "dp_rank": W.BoundedIntText(value=-1 if dp_rank is None else dp_rank, min=-1, max=1023, description="DP rank (-1: worst)",
                                    layout=_LAYOUT, style=_STYLE),
        "timeline": _dropdown("timeline", ("sync", "free"), timeline),
        "flops_shape": _dropdown("flops shape", FLOPS_SHAPES, flops_shape),
    })


def timeline_explorer(profile: Any, *, step: int | None = None, max_depth: int = 3) -> Explorer:
    """Per-rank timeline and critical path of one step of a loaded :class:`~canzona.viz.timeline.Profile`."""
    from canzona.viz.timeline import fig_critical_path, fig_timeline

    steps = sorted(int(s) for s in profile.phases["step"].unique())
    if not steps:
        raise ValueError("the profile has no phases")
    first = steps[-1] if step is None else step

    def build(step: int, max_depth: int) -> Figures:
        return [fig_timeline(profile.phases, step=step, max_depth=max_depth, title=profile.label),
                fig_critical_path(profile.phases, step=step)]

    return Explorer(build, {
        "step": _dropdown("step", steps, first),
        "max_depth": W.BoundedIntText(value=max_depth, min=0, max=16, description="max depth", layout=_LAYOUT, style=_STYLE),
    }, columns=2)


def _quiet_plan(model: str, **kw: Any):
    """A plan for an explorer; the planner's oversized-task warning is expected at 32B scale and
    already reported in the micro-group tables, so it is not repeated on every redraw."""
    from canzona.plan.build import plan_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return plan_model(model, **kw)
