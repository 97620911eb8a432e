"""Cluster-scale step-time simulator.

Predicts one training iteration per strategy (sc, layerwise, asc, lb-asc, zero1-AdamW) from a
canzona :class:`~canzona.plan.Plan`, a model config and a hardware profile:

* :mod:`canzona.sim.hardware` -- profiles in ``canzona/data/hardware/*.json`` (every constant with its
  source), strict parsing, the per-shape matmul efficiency model and its calibration from CSV;
* :mod:`canzona.sim.comm` -- the alpha-beta collective costs per link class and the overlap rule;
* :mod:`canzona.sim.model` -- fwd-bwd, optimizer-step and iteration per plan (:func:`simulate_plan`);
* :mod:`canzona.sim.analysis` -- the paper's Figure 4 comparison with the assumption that
  dominates each ratio, DP / alpha sweeps and pandas DataFrames for the notebooks.
"""

from __future__ import annotations

from canzona.sim.analysis import (
    MOE_1T_NAME,
    PAPER_CONFIG,
    PAPER_FIGURE4,
    PAPER_RATIOS,
    PaperComparison,
    Sensitivity,
    alpha_report,
    alpha_sweep,
    breakdown_frame,
    breakdown_long,
    dp_sweep,
    fit_fwd_bwd_mfu,
    moe_1t_config,
    paper_comparison,
    recommend_alpha,
    resolve_sim_model,
)
from canzona.sim.comm import (
    Link,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    broadcast_time,
    flow_shop,
    list_schedule,
    reduce_scatter_time,
)
from canzona.sim.hardware import (
    Constant,
    HardwareError,
    HardwareProfile,
    available_hardware,
    calibrate,
    fit_matrix_throughput,
    load_hardware,
    parse_hardware,
)
from canzona.sim.model import (
    SETUP_SOURCES,
    SIM_STRATEGIES,
    PipelineBreakdown,
    Setup,
    StepBreakdown,
    fwd_flops_per_gpu,
    plan_for,
    simulate,
    simulate_pipeline,
    simulate_plan,
)

__all__ = [
    "Constant",
    "HardwareError",
    "HardwareProfile",
    "available_hardware",
    "load_hardware",
    "parse_hardware",
    "calibrate",
    "fit_matrix_throughput",
    "Link",
    "reduce_scatter_time",
    "all_gather_time",
    "all_reduce_time",
    "broadcast_time",
    "all_to_all_time",
    "flow_shop",
    "list_schedule",
    "Setup",
    "SETUP_SOURCES",
    "SIM_STRATEGIES",
    "StepBreakdown",
    "fwd_flops_per_gpu",
    "plan_for",
    "simulate",
    "simulate_plan",
    "PipelineBreakdown",
    "simulate_pipeline",
    "PAPER_FIGURE4",
    "PAPER_RATIOS",
    "PAPER_CONFIG",
    "MOE_1T_NAME",
    "moe_1t_config",
    "resolve_sim_model",
    "fit_fwd_bwd_mfu",
    "Sensitivity",
    "PaperComparison",
    "paper_comparison",
    "breakdown_frame",
    "breakdown_long",
    "dp_sweep",
    "alpha_sweep",
    "recommend_alpha",
    "alpha_report",
]
