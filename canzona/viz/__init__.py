"""Figures (plotly) and tables (pandas) for the notebooks and ``canzona figures``.

Every piece of logic the notebooks show lives here, so it is tested like the rest of canzona;
the notebooks only choose inputs and display what these functions return.

* :mod:`.partition`    partition maps and per-rank DP loads (Section 3, Figure 3c)
* :mod:`.microgroups`  TP micro-group Gantt charts, makespans, C_max and TP sweeps (Section 4)
* :mod:`.timeline`     profiler trace summaries: per-rank timelines, breakdowns, critical path
* :mod:`.scaling`      the paper's scaling studies with the planner (Appendix C.3, C.5, D.5)
* :mod:`.simulation`   the simulator's predicted iteration times beside the paper's measured ones
* :mod:`.exactness`    the validation report: pass matrix and loss trajectories
* :mod:`.training`     loss and step time of several training runs (their metrics logs)
* :mod:`.widgets`      ipywidgets explorers over the figure functions
* :mod:`.export`       the main figures as HTML, PNG, SVG or PDF files (``canzona figures``)
* :mod:`.notebook`     the plotly renderer the notebooks use (figures survive HTML export)

Every figure has a title, axis titles with units and a titled legend
(:func:`figure_problems` checks it); the paper's reported numbers come from
:mod:`canzona.paper` and are drawn as open black diamonds.
"""

from __future__ import annotations

from canzona.viz._style import figure_problems
from canzona.viz.exactness import (
    fig_loss_trajectories,
    fig_validation_matrix,
    load_validation_report,
    loss_deviation,
    validation_matrix,
    validation_table,
)
from canzona.viz.notebook import use_notebook_renderer
from canzona.viz.microgroups import (
    cmax_sweep,
    fig_cmax_sweep,
    fig_microgroup_gantt,
    fig_tp_host_loads,
    fig_tp_sweep,
    microgroup_summary,
    task_table,
    tp_host_loads,
    tp_sweep,
)
from canzona.viz.partition import (
    fig_balance_vs_paper,
    fig_partition_map,
    fig_rank_loads,
    fig_strategy_comparison,
    ownership_pieces,
    expert_groups,
    fig_expert_groups,
    rank_loads,
    strategy_summary,
)
from canzona.viz.scaling import SCALING_MODELS, fig_alpha_tradeoff, fig_cost_models, fig_sweep, plan_sweep
from canzona.viz.training import discover_runs, fig_loss_curves, load_metrics
from canzona.viz.timeline import (
    Profile,
    breakdown_by_strategy,
    fig_critical_path,
    fig_phase_breakdown,
    fig_timeline,
    load_phase_table,
    load_profile,
    optimizer_critical_path,
    phase_breakdown,
)

__all__ = [
    "figure_problems",
    "use_notebook_renderer",
    # partition
    "ownership_pieces",
    "expert_groups",
    "fig_expert_groups",
    "rank_loads",
    "strategy_summary",
    "fig_partition_map",
    "fig_rank_loads",
    "fig_strategy_comparison",
    "fig_balance_vs_paper",
    # micro-groups
    "task_table",
    "tp_host_loads",
    "microgroup_summary",
    "cmax_sweep",
    "tp_sweep",
    "fig_microgroup_gantt",
    "fig_tp_host_loads",
    "fig_cmax_sweep",
    "fig_tp_sweep",
    # timeline
    "Profile",
    "load_phase_table",
    "load_profile",
    "phase_breakdown",
    "breakdown_by_strategy",
    "optimizer_critical_path",
    "fig_timeline",
    "fig_phase_breakdown",
    "fig_critical_path",
    # scaling
    "SCALING_MODELS",
    "plan_sweep",
    "fig_sweep",
    "fig_alpha_tradeoff",
    "fig_cost_models",
    # training runs
    "discover_runs",
    "load_metrics",
    "fig_loss_curves",
    # exactness
    "load_validation_report",
    "validation_table",
    "validation_matrix",
    "loss_deviation",
    "fig_validation_matrix",
    "fig_loss_trajectories",
]
