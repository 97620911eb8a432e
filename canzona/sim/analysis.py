"""Analyses on top of the step model: the paper's Figure 4 comparison, which assumption dominates
a ratio, DP and alpha sweeps, and pandas DataFrames ready to plot.

Every function here only calls :func:`canzona.sim.model.simulate_plan` on planner output; no
number is fitted unless the caller asks (``fit_fwd_bwd``) and the result says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd

from canzona.config import ModelConfig
from canzona.paper import paper_value
from canzona.plan import Plan
from canzona.plan.build import resolve_model
from canzona.plan.strategies import get_strategy
from canzona.sim.configs import MOE_1T_NAME, moe_1t_config, resolve_sim_model
from canzona.sim.hardware import Constant, HardwareProfile
from canzona.sim.model import SIM_STRATEGIES, Setup, StepBreakdown, plan_for, simulate_plan

__all__ = [
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

_PHASES = ("optimizer_s", "fwd_bwd_s", "iteration_s")
#: Figure 4 of the paper (Qwen3-32B, Muon, 256 GPUs = DP32 x TP8): seconds per phase, read from
#: :mod:`canzona.paper` (keys ``<phase>_<strategy>``)
PAPER_FIGURE4: dict[str, dict[str, float]] = {
    s: {phase: paper_value(f"{phase}_{s}").value for phase in _PHASES} for s in ("layerwise", "lb-asc")
}
#: the speedups the paper states (layerwise / lb-asc, Section 5.2), from :mod:`canzona.paper`
PAPER_RATIOS: dict[str, float] = {
    phase: paper_value(f"{phase.removesuffix('_s')}_speedup_dp32_tp8").value for phase in _PHASES
}
#: the configuration Figure 4 was measured on
_FIG4 = paper_value("iteration_s_lb-asc")
PAPER_CONFIG: dict[str, Any] = {"model": _FIG4.model, "dp": _FIG4.dp, "tp": _FIG4.tp, "optimizer": _FIG4.optimizer}

# --------------------------------------------------------------------------- calibration to the paper
def fit_fwd_bwd_mfu(plan: Plan, cfg: ModelConfig, hw: HardwareProfile, setup: Setup, target_s: float) -> HardwareProfile:
    """The profile with ``fwd_bwd_mfu`` set so that ``plan``'s predicted fwd-bwd equals ``target_s``.

    fwd-bwd decreases monotonically in MFU (compute shrinks, exposed communication can only grow
    by less), so bisection finds the unique value; a target below what MFU = 1 reaches is an error.
    """
    def fb(mfu: float) -> float:
        return simulate_plan(plan, cfg, hw.with_values(fwd_bwd_mfu=mfu), setup).fwd_bwd_s

    lo, hi = 1e-3, 1.0
    if fb(hi) > target_s:
        raise ValueError(f"fwd-bwd cannot reach {target_s} s even at MFU 1.0 on {hw.name}: communication alone exceeds it")
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if fb(mid) > target_s:
            lo = mid
        else:
            hi = mid
    src = f"fitted: fwd-bwd MFU chosen so that {plan.inputs.strategy}'s predicted fwd-bwd equals the paper's {target_s} s (Figure 4)"
    return hw.with_values(fwd_bwd_mfu=Constant(hi, src))


# --------------------------------------------------------------------------- paper comparison
@dataclass(frozen=True, slots=True)
class Sensitivity:
    """How the layerwise / lb-asc ratios move when one assumption changes."""

    name: str
    change: str
    ratios: dict[str, float]


@dataclass(frozen=True, slots=True)
class PaperComparison:
    """Figure 4 predicted beside the paper, with the ratios and what dominates their error."""

    hardware: HardwareProfile
    setup: Setup
    lb_schedule: str
    fitted: bool
    predicted: dict[str, StepBreakdown]
    ratios: dict[str, float]
    sensitivities: tuple[Sensitivity, ...]

    def ratio_error(self, phase: str) -> float:
        """Predicted ratio / paper ratio - 1."""
        return self.ratios[phase] / PAPER_RATIOS[phase] - 1.0

    def dominant(self, phase: str) -> Sensitivity:
        """The single change that moves this ratio the most (|log| of the factor)."""
        base = self.ratios[phase]
        return max(self.sensitivities, key=lambda s: abs(math.log(s.ratios[phase] / base)))

    def table(self) -> pd.DataFrame:
        rows = []
        for phase in _PHASES:
            row: dict[str, Any] = {"phase": phase}
            for s in ("layerwise", "lb-asc"):
                row[f"paper_{s}"] = PAPER_FIGURE4[s][phase]
                row[f"pred_{s}"] = getattr(self.predicted[s], phase)
            row["paper_ratio"] = PAPER_RATIOS[phase]
            row["pred_ratio"] = self.ratios[phase]
            row["ratio_error"] = self.ratio_error(phase)
            if self.sensitivities:
                d = self.dominant(phase)
                row["dominant_assumption"] = f"{d.name} ({d.change}: ratio {d.ratios[phase]:.2f})"
            rows.append(row)
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        return {
            "fitted_fwd_bwd_mfu": self.fitted,
            "fwd_bwd_mfu": self.hardware.fwd_bwd_mfu.value,
            "lb_asc_tp_schedule": self.lb_schedule,
            "paper": PAPER_FIGURE4,
            "paper_ratios": PAPER_RATIOS,
            "predicted": {s: {p: getattr(b, p) for p in _PHASES} for s, b in self.predicted.items()},
            "predicted_ratios": self.ratios,
            "ratio_errors": {p: self.ratio_error(p) for p in _PHASES},
            "dominant_assumptions": (
                {p: {"name": self.dominant(p).name, "change": self.dominant(p).change, "ratio": self.dominant(p).ratios[p]} for p in _PHASES}
                if self.sensitivities else {}
            ),
            "sensitivities": [{"name": s.name, "change": s.change, "ratios": s.ratios} for s in self.sensitivities],
        }


def _ratios(lw: StepBreakdown, lb: StepBreakdown) -> dict[str, float]:
    return {p: getattr(lw, p) / getattr(lb, p) for p in _PHASES}


#: discrete alternatives tried for the named setup assumptions
_SETUP_ALTERNATIVES: dict[str, tuple[Any, ...]] = {
    "tp_overlap": ("pipelined", "free", "serial"),
    "varsize_collective": ("padded",),
    "grad_bytes": (2,),
    "ns_dtype": ("fp32", "tf32"),
    "recompute": ("full",),
}
#: hardware constants that cannot matter here or are not assumptions about performance
_SKIP_CONSTANTS = ("gpus_per_node", "hbm_gb", "peak_tf32_tflops", "peak_fp32_tflops")


def paper_comparison(
    hw: HardwareProfile,
    setup: Setup = Setup(),
    *,
    lb_schedule: str | None = None,
    fit_fwd_bwd: bool = False,
    sensitivity: bool = True,
) -> PaperComparison:
    """Simulate the paper's Figure 4 configuration (layerwise vs lb-asc) and explain the ratios.

    ``lb_schedule`` overrides lb-asc's TP schedule (default: the planner's paper-faithful ``lpt``).
    ``fit_fwd_bwd`` fits the one constant ``fwd_bwd_mfu`` to the paper's lb-asc fwd-bwd (0.811 s).
    Sensitivities: every hardware constant lowered by 20 %, every named setup alternative, and the
    other lb-asc TP schedule; the ratios are recomputed for each.
    """
    cfg = resolve_model(PAPER_CONFIG["model"])
    kw = {k: PAPER_CONFIG[k] for k in ("dp", "tp", "optimizer")}
    lw_plan = plan_for(cfg, "layerwise", **kw)
    sched_kw = {"tp_schedule": lb_schedule} if lb_schedule else {}
    lb_plan = plan_for(cfg, "lb-asc", **kw, **sched_kw)
    if fit_fwd_bwd:
        hw = fit_fwd_bwd_mfu(lb_plan, cfg, hw, setup, PAPER_FIGURE4["lb-asc"]["fwd_bwd_s"])

    def run(hardware: HardwareProfile, run_setup: Setup, lbp: Plan = lb_plan) -> tuple[StepBreakdown, StepBreakdown]:
        return simulate_plan(lw_plan, cfg, hardware, run_setup), simulate_plan(lbp, cfg, hardware, run_setup)

    lw, lb = run(hw, setup)
    sens: list[Sensitivity] = []
    if sensitivity:
        for name, c in hw.constants().items():
            if name in _SKIP_CONSTANTS:
                continue
            h2 = hw.with_values(**{name: c.value * 0.8})
            sens.append(Sensitivity(name, f"-20% ({c.value:g} -> {c.value * 0.8:g})", _ratios(*run(h2, setup))))
        for name, alts in _SETUP_ALTERNATIVES.items():
            for v in alts:
                if getattr(setup, name) == v:
                    continue
                sens.append(Sensitivity(name, f"{getattr(setup, name)} -> {v}", _ratios(*run(hw, replace(setup, **{name: v})))))
        cur = lb_plan.inputs.tp_schedule
        for alt in ("lpt", "lpt-carry"):
            if alt != cur:
                p2 = plan_for(cfg, "lb-asc", **kw, tp_schedule=alt)
                sens.append(Sensitivity("lb-asc tp_schedule", f"{cur} -> {alt}", _ratios(*run(hw, setup, p2))))
    return PaperComparison(hw, setup, lb_plan.inputs.tp_schedule, fit_fwd_bwd, {"layerwise": lw, "lb-asc": lb}, _ratios(lw, lb), tuple(sens))


# --------------------------------------------------------------------------- frames
_FWD_PARTS = ("fwd_compute_s", "bwd_compute_s", "tp_activation_comm_s", "dp_grad_exposed_s", "dp_param_exposed_s")


def breakdown_frame(results: Mapping[str, StepBreakdown], **extra: Any) -> pd.DataFrame:
    """One row per strategy, every summary column (plus constant ``extra`` columns)."""
    rows = [{**extra, **b.summary()} for b in results.values()]
    return pd.DataFrame(rows)


def breakdown_long(results: Mapping[str, StepBreakdown], **extra: Any) -> pd.DataFrame:
    """Long form for stacked bars: (strategy, phase, component, seconds); components add up to
    fwd_bwd_s and optimizer_s, so each strategy's bar totals iteration_s."""
    rows = []
    for s, b in results.items():
        for comp in _FWD_PARTS:
            rows.append({**extra, "strategy": s, "phase": "fwd_bwd", "component": comp.removesuffix("_s"), "seconds": getattr(b, comp)})
        crit = b.per_rank_optimizer_s[b.opt_critical_rank] if b.per_rank_optimizer_s else b.optimizer_s - b.opt_dp_comm_s
        other = max(0.0, crit - b.opt_elementwise_s - b.opt_matrix_compute_s)
        for comp, v in (
            ("opt_elementwise", b.opt_elementwise_s),
            ("opt_matrix_compute", b.opt_matrix_compute_s),
            ("opt_tp_comm_exposed", other),
            ("opt_dp_comm", b.opt_dp_comm_s),
        ):
            rows.append({**extra, "strategy": s, "phase": "optimizer", "component": comp, "seconds": v})
    return pd.DataFrame(rows)


def dp_sweep(
    model: str | ModelConfig,
    dps: Iterable[int],
    *,
    tp: int,
    optimizer: str,
    hardware: HardwareProfile,
    setup: Setup = Setup(),
    strategies: Sequence[str] = SIM_STRATEGIES,
    alpha: float = 1.0,
    lb_tp_schedule: str | None = None,
    **plan_kwargs: Any,
) -> pd.DataFrame:
    """Breakdowns per (DP size, strategy): one row each, ready to plot against ``dp``.
    ``alpha`` and ``lb_tp_schedule`` apply to the strategies whose partitioner reads alpha
    (``Strategy.uses_alpha``: lb-asc); the others have no such knob."""
    cfg = resolve_sim_model(model)
    frames = []

    def kw(s: str) -> dict[str, Any]:
        if not get_strategy(s).uses_alpha:
            return dict(plan_kwargs)
        extra = {"tp_schedule": lb_tp_schedule} if lb_tp_schedule else {}
        return {**plan_kwargs, "alpha": alpha, **extra}

    for dp in dps:
        res = {s: simulate_plan(plan_for(cfg, s, dp=dp, tp=tp, optimizer=optimizer, **kw(s)), cfg, hardware, setup) for s in strategies}
        frames.append(breakdown_frame(res, model=cfg.name, gpus=dp * tp, hardware=hardware.name))
    return pd.concat(frames, ignore_index=True)


def alpha_sweep(
    model: str | ModelConfig,
    alphas: Iterable[float],
    *,
    dp: int,
    tp: int,
    optimizer: str,
    hardware: HardwareProfile,
    setup: Setup = Setup(),
    strategy: str = "lb-asc",
    **plan_kwargs: Any,
) -> pd.DataFrame:
    """``strategy`` (lb-asc) breakdown per alpha (Algorithm 1's blend), one row each, with the
    DP communication ZeRO-1's equal chunks expose on the same buckets as a reference
    (``zero1_dp_exposed_s``: what perfectly uniform shards cost)."""
    cfg = resolve_sim_model(model)
    ref = simulate_plan(plan_for(cfg, "zero1", dp=dp, tp=tp, **{k: v for k, v in plan_kwargs.items() if k == "bucket_numel"}), cfg, hardware, setup)
    ref_exposed = ref.dp_grad_exposed_s + ref.dp_param_exposed_s
    rows = []
    for a in alphas:
        b = simulate_plan(plan_for(cfg, strategy, dp=dp, tp=tp, optimizer=optimizer, alpha=float(a), **plan_kwargs), cfg, hardware, setup)
        rows.append({
            "model": cfg.name,
            "hardware": hardware.name,
            "varsize_collective": setup.varsize_collective,
            **b.summary(),
            "dp_exposed_s": b.dp_grad_exposed_s + b.dp_param_exposed_s,
            "zero1_dp_exposed_s": ref_exposed,
        })
    return pd.DataFrame(rows)


def recommend_alpha(frame: pd.DataFrame) -> float:
    """The alpha with the shortest predicted iteration (ties: the larger alpha, the paper's choice)."""
    best = frame["iteration_s"].min()
    near = frame[frame["iteration_s"] <= best * (1 + 1e-9)]
    return float(near["alpha"].max())


def alpha_report(frame: pd.DataFrame, *, hidden_tol: float = 0.01) -> dict[str, Any]:
    """Does alpha = 1's communication imbalance still hide under the overlap window?

    The imbalance's cost is the DP communication alpha = 1 exposes beyond what ZeRO-1's equal
    chunks expose on the same buckets; it "stops hiding" when that exceeds ``hidden_tol`` of the
    alpha = 1 iteration. Also reports alpha = 0 (the paper's communication-balanced end).
    """
    f = frame.set_index("alpha")
    if 1.0 not in f.index:
        raise ValueError("alpha_report needs alpha = 1 in the sweep")
    a1 = float(f.loc[1.0, "dp_exposed_s"])
    ref = float(f.loc[1.0, "zero1_dp_exposed_s"])
    extra = a1 - ref
    out: dict[str, Any] = {
        "zero1_exposed_dp_comm_s": ref,
        "alpha1_exposed_dp_comm_s": a1,
        "alpha1_imbalance_exposed_s": extra,
        "alpha1_imbalance_hidden": bool(extra <= hidden_tol * float(f.loc[1.0, "iteration_s"])),
        "recommended_alpha": recommend_alpha(frame),
        "iteration_at_recommended_s": float(frame["iteration_s"].min()),
    }
    if 0.0 in f.index:
        out["alpha0_exposed_dp_comm_s"] = float(f.loc[0.0, "dp_exposed_s"])
    return out
