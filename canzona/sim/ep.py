"""The optimizer step with and without expert parallelism, at cluster scale (``canzona simulate --ep``).

Without EP every expert of a MoE config is a 2-D matrix task of the ordinary plan (the
simulator's usual model, :func:`canzona.sim.model.simulate_plan`): an expert owned by a DP rank is
updated whole by every TP rank of its group. With EP (:func:`canzona.plan.ep.plan_cluster_ep`)
each expert is updated once, on one of the GPUs holding it; the dense plan is balanced around
that preload. Predicted step: for every DP rank its dense optimizer time (the same step model)
plus the expert time of its busiest GPU (each expert's full-shape matrix time, as the step model
prices a matrix: Newton-Schulz FLOPs at the calibrated throughput plus its element-wise passes),
then the slowest rank, plus the dense step's parameter return. What it leaves out, said in the
report: the forward-backward difference of EP (the dispatch all-to-all, the expert gradients'
smaller reduction group) is not modelled; the iteration uses the plain forward-backward.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from canzona.cost import matrix_flops
from canzona.plan import Plan, plan_model
from canzona.plan.ep import ClusterEP, plan_cluster_ep
from canzona.plan.errors import PlanError
from canzona.sim.configs import resolve_sim_model
from canzona.sim.hardware import FLOPS_PER_MAC, HardwareProfile, ns_efficiency, peak_flops
from canzona.sim.model import MATRIX_ELEMENTWISE_BYTES, Setup, StepBreakdown, plan_for, simulate_plan

__all__ = ["EPStep", "expert_seconds", "format_ep_step", "run_simulate_ep", "simulate_ep"]


@dataclass(frozen=True, slots=True)
class EPStep:
    """Predicted optimizer steps (seconds) of one configuration with and without EP."""

    without: StepBreakdown
    dense: StepBreakdown
    cluster: ClusterEP
    expert_gpu_s: np.ndarray  # (dp, tp): each GPU's expert update time
    with_ep_s: float
    critical_rank: int


def expert_seconds(plan: Plan, hw: HardwareProfile, setup: Setup, optimizer: str) -> np.ndarray:
    """Per rank of an expert plan (``tp = 1``): the time to update the experts it owns."""
    peak = peak_flops(hw, setup.ns_dtype)
    out = np.zeros(plan.inputs.dp)
    for pp in plan.params:
        shape = tuple(pp.spec.task_shape)
        t = FLOPS_PER_MAC * matrix_flops(optimizer, shape) / (peak * ns_efficiency(hw, shape))
        t += MATRIX_ELEMENTWISE_BYTES * math.prod(shape) / hw.hbm_bytes_per_s
        unit = pp.numel // pp.spec.shape[0]
        if pp.replicated:
            out += t * pp.spec.shape[0]
        elif pp.dp_owner is not None:
            out[pp.dp_owner] += t * pp.spec.shape[0]
        else:
            for r, s, e in pp.dp_ranges:
                out[r] += t * ((e - s) // unit)
    return out


def simulate_ep(model: Any, *, dp: int, tp: int, ep: int, optimizer: str, hardware: HardwareProfile, setup: Setup = Setup(),
                strategy: str = "lb-asc", alpha: float = 1.0, **plan_kwargs: Any) -> EPStep:
    """Predict the optimizer step of ``model`` at DP ``dp`` x TP ``tp`` with and without EP ``ep``."""
    cfg = resolve_sim_model(model)
    if cfg.moe is None:
        raise PlanError(f"{cfg.name} has no experts; --ep needs a MoE model (qwen3-30b-a3b, qwen3-235b-a22b, ...)")
    without = simulate_plan(plan_for(cfg, strategy, dp=dp, tp=tp, optimizer=optimizer, alpha=alpha, **plan_kwargs), cfg, hardware, setup)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        stacked = plan_model(cfg, dp=dp, tp=tp, optimizer=optimizer, strategy=strategy, alpha=alpha, **plan_kwargs)
        cluster = plan_cluster_ep(stacked.specs, stacked.inputs, ep=ep, plain=stacked)
    dense = simulate_plan(cluster.dense, cfg, hardware, setup)
    per_holder = expert_seconds(cluster.experts, hardware, setup, optimizer)
    index = np.array([[(d // ep) * tp + t for t in range(tp)] for d in range(dp)], dtype=np.int64)
    gpu = per_holder[index]
    total = np.asarray(dense.per_rank_optimizer_s, dtype=np.float64) + gpu.max(axis=1)
    crit = int(np.argmax(total))
    return EPStep(without=without, dense=dense, cluster=cluster, expert_gpu_s=gpu,
                  with_ep_s=float(total[crit]) + dense.opt_dp_comm_s, critical_rank=crit)


def format_ep_step(s: EPStep, hw_name: str) -> str:
    i = s.cluster.dense.inputs
    ep = s.cluster.ep
    w = s.without
    lines = [
        f"{i.model}, DP {i.dp} x TP {i.tp} ({i.dp * i.tp} GPUs), {i.optimizer}, strategy {i.strategy}, hardware {hw_name}",
        f"  {'':<22}{'optimizer step':>15}{'iteration':>11}",
        f"  {'without EP':<22}{w.optimizer_s * 1e3:>12.1f} ms{w.iteration_s * 1e3:>8.0f} ms",
        f"  {f'with EP {ep}':<22}{s.with_ep_s * 1e3:>12.1f} ms{(w.fwd_bwd_s + s.with_ep_s) * 1e3:>8.0f} ms   "
        f"(slowest DP rank {s.critical_rank}: dense {s.dense.per_rank_optimizer_s[s.critical_rank] * 1e3:.1f} ms + experts "
        f"{s.expert_gpu_s[s.critical_rank].max() * 1e3:.1f} ms on its busiest GPU)",
        f"  the iteration with EP reuses the forward-backward without EP ({w.fwd_bwd_s * 1e3:.0f} ms): the dispatch all-to-all "
        "and the smaller expert-gradient reduction are not modelled",
    ]
    return "\n".join(lines)


def run_simulate_ep(args: Any, setup: Setup, hw: HardwareProfile, plan_kwargs: dict[str, Any]) -> int:
    """``canzona simulate --ep N``: lb-asc (or the one strategy ``--strategies`` names), printed."""
    if args.ep < 1:
        raise PlanError(f"--ep must be >= 1, got {args.ep}")
    if args.dp % args.ep:
        raise PlanError(f"--ep {args.ep} must divide --dp {args.dp} (expert parallelism takes its ranks from data parallelism)")
    clash = [f for f, on in (("--pp", args.pp != 1), ("--paper", args.paper), ("--sweep-dp", args.sweep_dp is not None),
                             ("--sweep-alpha", args.sweep_alpha is not None), ("--json", args.json is not None)) if on]
    if clash:
        raise PlanError(f"--ep simulates one configuration with and without EP; drop {', '.join(clash)}")
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    strategy = names[0] if len(names) == 1 else "lb-asc"
    s = simulate_ep(args.model, dp=args.dp, tp=args.tp, ep=args.ep, optimizer=args.optimizer, hardware=hw, setup=setup,
                    strategy=strategy, alpha=args.alpha, **plan_kwargs)
    print(format_ep_step(s, getattr(hw, "name", str(args.hardware))))
    return 0
