"""Every figure of the paper, recomputed at the paper's configuration, with a verdict per row.

``canzona reproduce FIG`` prints what :func:`reproduce` returns: for each number the paper gives
(from :mod:`canzona.paper`) the value canzona computes at the same configuration, and for each
trend the paper states (a :class:`canzona.paper.PaperTrend`) whether canzona's numbers show it.
Every row carries a verdict:

* ``reproduced``      within the row's stated tolerance;
* ``trend holds``     the stated trend is visible in canzona's numbers (trend rows);
* ``not reproduced``  outside the tolerance or the trend does not hold; the row says why;
* ``ours only``       a number the paper does not give, shown for context (no verdict).

Planner figures (3, 8a, 8b, 9, 12) use the ``paper`` convention (:mod:`canzona.plan.convention`,
the authors' own planning and measuring rules) and print canzona's own convention beside it.
Step-time figures (4, 6, 7, 10a, 11a, 13, 14, 16) use canzona's planner and the step-time
simulator (:mod:`canzona.sim`) with the h800-ib400 profile; their absolute seconds rest on named
hardware assumptions, so their tolerance is relative (:data:`TIME_TOLERANCE`). Pipeline-parallel
configurations (Figures 8b, 10a, 11a, 13) are planned per stage (:mod:`canzona.plan.pipeline`)
and simulated under 1F1B (:func:`canzona.sim.simulate_pipeline`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from canzona.paper import PaperTrend, paper_trend, paper_value
from canzona.plan import Plan, plan_model
from canzona.plan.build import cmax_to_bytes, resolve_model
from canzona.plan.convention import CANZONA, PAPER, authors_plan, lower_bound
from canzona.plan.pipeline import plan_stages
from canzona.specs import specs_from_config

__all__ = [
    "REPRODUCED",
    "TREND_HOLDS",
    "NOT_REPRODUCED",
    "OURS_ONLY",
    "RATIO_TOLERANCE",
    "TIME_TOLERANCE",
    "Row",
    "Figure",
    "FIGURES",
    "reproduce",
    "fig3",
    "tp_before_readings",
    "paper_cmax_bytes",
]

REPRODUCED = "reproduced"
TREND_HOLDS = "trend holds"
NOT_REPRODUCED = "not reproduced"
OURS_ONLY = "ours only"
#: load-balance ratios the paper prints to two decimals: +-0.01 (half a unit of the last digit, plus rounding)
RATIO_TOLERANCE = 0.01
#: simulated seconds and speedups: +-25 % (the simulator's hardware constants are named assumptions)
TIME_TOLERANCE = 0.25
HARDWARE = "h800-ib400"


@dataclass(frozen=True, slots=True)
class Row:
    """One compared quantity. ``paper`` is a number or, for a trend row, the claim in words;
    ``ours`` canzona's value (paper convention for planner figures); ``canzona`` the same quantity
    under canzona's own convention, when it differs, with ``why`` saying how the two differ."""

    key: str
    label: str
    paper: float | str | None
    ours: float | str | None
    verdict: str
    tolerance: str = ""
    reason: str = ""
    canzona: float | None = None
    why: str = ""
    #: the :mod:`canzona.paper` value (key) or trend the row checks; "" for context rows
    paper_key: str = ""


@dataclass(frozen=True, slots=True)
class Figure:
    key: str
    title: str
    config: str
    rows: tuple[Row, ...]
    notes: tuple[str, ...] = ()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.verdict] = out.get(r.verdict, 0) + 1
        return out

    def frame(self) -> Any:
        """The rows as a pandas DataFrame (label, paper, ours, canzona, verdict, reason), for notebooks."""
        import pandas as pd

        return pd.DataFrame([{"row": r.label, "paper": r.paper, "ours": r.ours, "canzona": r.canzona,
                              "verdict": r.verdict, "tolerance": r.tolerance, "why not": r.reason} for r in self.rows])

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "title": self.title, "config": self.config,
                "rows": [asdict(r) for r in self.rows], "notes": list(self.notes), "verdicts": self.counts()}


# ------------------------------------------------------------------------------------ helpers
def _quiet_plan(model: Any, **kw: Any) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model(model, **kw)


def _value_row(key: str, label: str, paper_key: str, ours: float, *, tol: float = RATIO_TOLERANCE,
               relative: bool = False, miss: str = "", canzona: float | None = None, why: str = "") -> Row:
    """A row comparing a :mod:`canzona.paper` value with ours under an absolute or relative tolerance."""
    p = paper_value(paper_key).value
    ok = abs(ours - p) <= (tol * abs(p) if relative else tol + 1e-12)
    tol_s = f"+-{tol:.0%}" if relative else f"+-{tol:g}"
    return Row(key, label, p, ours, REPRODUCED if ok else NOT_REPRODUCED, tol_s, "" if ok else miss, canzona, why, paper_key)


def _trend_row(trend_key: str, holds: bool, ours: str, miss: str = "") -> Row:
    t: PaperTrend = paper_trend(trend_key)
    return Row(trend_key, t.claim, t.claim, ours, TREND_HOLDS if holds else NOT_REPRODUCED, "trend", "" if holds else miss,
               paper_key=trend_key)


def _info(key: str, label: str, ours: float | str, why: str = "") -> Row:
    return Row(key, label, None, ours, OURS_ONLY, "", "", None, why)


def paper_cmax_bytes(tp: int, grad_bytes: int = 4) -> int:
    """The authors' C_max (400 x 2^20 TP-local elements per host with the numel cost) expressed in
    canzona's unit, bytes of full gradient a host receives: a task of ``n`` TP-local elements
    brings ``n * tp * grad_bytes`` bytes, so the two capacity tests agree exactly."""
    return PAPER.cmax * tp * grad_bytes


def _hw():
    from canzona.sim import load_hardware
    return load_hardware(HARDWARE)


def _sim(model: str, strategy: str, *, dp: int, tp: int, optimizer: str = "muon", setup: Any = None, **plan_kw: Any):
    from canzona.sim import Setup, plan_for, simulate_plan
    cfg = resolve_model(model)
    plan = plan_for(cfg, strategy, dp=dp, tp=tp, optimizer=optimizer, **plan_kw)
    return simulate_plan(plan, cfg, _hw(), setup or Setup())


def _strategy_optimizer(strategy: str, optimizer: str) -> str:
    """The optimizer a strategy's plan is costed with: an element-wise-only strategy (zero1) runs
    the element-wise default, as :func:`canzona.sim.plan_for` does."""
    from canzona.optimizers import ELEMENTWISE_DEFAULT
    from canzona.plan.strategies import get_strategy
    return ELEMENTWISE_DEFAULT if get_strategy(strategy).elementwise_only else optimizer


def _sim_pp(model: str, strategy: str, *, pp: int, dp: int, tp: int, optimizer: str = "muon", setup: Any = None, **plan_kw: Any):
    from canzona.sim import Setup, simulate_pipeline
    cfg = resolve_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        staged = plan_stages(cfg, pp=pp, dp=dp, tp=tp, strategy=strategy,
                             optimizer=_strategy_optimizer(strategy, optimizer), **plan_kw)
    return simulate_pipeline(staged.stages, cfg, _hw(), setup or Setup())


# ------------------------------------------------------------------------------------ Figure 3
def tp_before_readings(model: str = "qwen3-32b", dp: int = 32, tp: int = 8) -> dict[str, float]:
    """Readings tried for the paper's TP "before" value (3.24): the authors' "no" TP mode (chunks of
    ``tp`` in buffer order) on their DP plans, measured every way the code or the paper allows."""
    specs = specs_from_config(resolve_model(model), tp=tp)
    base = authors_plan(specs, dp=dp, tp=tp, dp_mode="baseline", tp_mode="no")
    bal_no = authors_plan(specs, dp=dp, tp=tp, dp_mode="balanced", tp_mode="no")
    base_per = base.tp_ratios_per_rank("flops")  # NaN: a DP rank without TP tasks
    groups0 = [float(_r(base.group_loads(0, k, "flops"))) for k in range(len(base.groups[0]))]
    return {
        "no-mode, DP baseline, DP rank 0, first micro-group (the authors' log)": groups0[0],
        "no-mode, DP baseline, DP rank 0, worst micro-group": max(groups0),
        "no-mode, DP baseline, DP rank 0, all micro-groups summed": float(base_per[0]),
        "no-mode, DP baseline, mean over the DP ranks that own TP tasks": float(np.nanmean(base_per)),
        "no-mode, DP baseline, mean over all DP ranks (an idle group counts 1)": float(np.mean(np.nan_to_num(base_per, nan=1.0))),
        "no-mode, DP baseline, median over the DP ranks that own TP tasks": float(np.nanmedian(base_per)),
        "no-mode, DP baseline, over all GPUs (TP-local shapes)": base.all_gpu_ratio("flops", "local"),
        "no-mode, DP baseline, over all GPUs (full shapes)": base.all_gpu_ratio("flops", "full"),
        "no-mode, balanced DP plan, DP rank 0, first micro-group": float(_r(bal_no.group_loads(0, 0, "flops"))),
        "no-mode, balanced DP plan, DP rank 0, summed": float(bal_no.tp_ratios_per_rank("flops")[0]),
        "DP FLOPs ratio before (the DP bar's value)": base.dp_ratio("flops"),
    }


def _r(a: np.ndarray) -> float:
    m = float(np.mean(a))
    return float(np.max(a)) / m if m > 0 else 1.0


def fig3() -> Figure:
    """Figure 3 (b, c): DP and TP load balance before/after, Qwen3-32B, Muon, DP32 x TP8."""
    model, dp, tp = "qwen3-32b", 32, 8
    cfg = resolve_model(model)
    specs = specs_from_config(cfg, tp=tp)
    before = authors_plan(specs, dp=dp, tp=tp, dp_mode="baseline", tp_mode="no")
    after = authors_plan(specs, dp=dp, tp=tp)
    qkv_first = authors_plan(specs, dp=dp, tp=tp, convention=replace(PAPER, registration="canzona"))
    # canzona's own convention: one buffer, default buckets, full (host) shapes, all GPUs
    cz = dict(model=cfg, dp=dp, tp=tp, optimizer="muon", flops_shape="full")
    cz_before = _quiet_plan(strategy="asc", **cz)
    cz_after = _quiet_plan(strategy="lb-asc", **cz)
    joint = _quiet_plan(strategy="lb-asc-joint", **cz)
    cb, ca = cz_before.metrics, cz_after.metrics
    bound = lower_bound(specs, dp, tp)
    bound_hf = lower_bound(specs_from_config(cfg, tp=tp, layout="hf"), dp, tp)
    readings = tp_before_readings(model, dp, tp)
    closest = min(((k, v) for k, v in readings.items() if not k.startswith("DP")), key=lambda kv: abs(kv[1] - 3.24))
    buffer_why = ("canzona's buffer also holds the embedding, output layer and norms (AdamW state, 2x per element) in "
                  f"{cb.details['n_buckets']} buckets of >= 40M elements, and it reports optimizer-state bytes and full-shape FLOPs")
    rows = (
        _value_row("dp_flops_before", "DP FLOPs ratio, before (static partition)", "dp_flops_ratio_asc",
                   before.dp_ratio("flops"), canzona=cb.dp_flops_ratio,
                   why="with 40M-element buckets the Start_Index rule leaves most ranks of a bucket empty; " + buffer_why),
        _value_row("dp_memory_before", "DP memory ratio, before", "dp_memory_ratio_asc", before.dp_ratio("memory"),
                   canzona=cb.dp_memory_ratio, why="same partition as the row above, memory as optimizer-state bytes"),
        _value_row("dp_flops_after", "DP FLOPs ratio, after (Algorithm 1, alpha = 1)", "dp_flops_ratio_lb-asc",
                   after.dp_ratio("flops"), canzona=ca.dp_flops_ratio,
                   why="canzona costs a TP-split matrix on the full shape its host runs (divided by tp), which "
                       "evens out the qkv/fc1 shard shapes the paper's TP-local FLOPs penalise"),
        _value_row("dp_memory_after", "DP memory ratio, after", "dp_memory_ratio_lb-asc", after.dp_ratio("memory"),
                   canzona=ca.dp_memory_ratio,
                   why="canzona counts optimizer-state bytes, and the embedding/output layer's AdamW state (2x) "
                       "sits on the ranks that own them in its single buffer"),
        _value_row("tp_flops_before", "TP FLOPs ratio, before (no TP balancing)", "tp_flops_ratio_asc",
                   readings["no-mode, DP baseline, DP rank 0, first micro-group (the authors' log)"],
                   canzona=cb.details.get("tp_flops_ratio_global"),
                   miss=f"no reading of the authors' code gives 3.24: the closest is '{closest[0]}' = {closest[1]:.3f}; "
                        f"the paper's 3.24 equals its DP FLOPs 'before' ({readings['DP FLOPs ratio before (the DP bar' + chr(39) + 's value)']:.3f}), "
                        "which suggests the TP 'before' bar repeats the DP number",
                   why="canzona's column is the ratio over all 256 GPUs with full host shapes (round-robin hosts)"),
        _value_row("tp_flops_after", "TP FLOPs ratio, after (Algorithm 2), DP rank 0's micro-group",
                   "tp_flops_ratio_lb-asc", after.tp_ratio_rank0("flops"),
                   canzona=ca.details.get("tp_flops_ratio_global"),
                   why=f"canzona's column is over all 256 GPUs on full shapes (canzona's default: C_max 512 in the "
                       f"paper's unit, host loads carried across groups), at the atomic lower bound {bound:.2f}; "
                       f"the paper's is one TP group of DP rank 0 on TP-local shapes"),
        _value_row("tp_memory_after", "TP memory ratio, after, DP rank 0's micro-group", "tp_memory_ratio_lb-asc",
                   after.tp_ratio_rank0("memory"), canzona=ca.details.get("tp_memory_ratio_global"),
                   why="same reading difference as the row above, memory as optimizer-state bytes"),
        Row("step_time_tflops_equiv", "LB-ASC lowest maximum step time (Figure 3a)",
            paper_value("step_time_tflops_equiv_lb-asc").value, "-", NOT_REPRODUCED, "unit",
            "the paper does not define its 'TFLOPS equivalent' unit, so no canzona quantity can be set beside it; "
            "the busiest rank's FLOPs over the mean (the rows above) is the nearest one",
            paper_key="step_time_tflops_equiv_lb-asc"),
        _info("tp_flops_after_all_gpus", "TP FLOPs ratio, after, authors' plan over all 256 GPUs (full shapes)",
              after.all_gpu_ratio("flops", "full")),
        _info("tp_flops_lower_bound", "atomic lower bound over all GPUs (largest task / mean), fused qkv/fc1", bound),
        _info("tp_flops_lower_bound_hf", "atomic lower bound with q/k/v and gate/up as separate matrices", bound_hf),
        _info("tp_flops_after_rank_max", "TP FLOPs ratio, after, worst DP rank's group (authors' plan)",
              float(np.nanmax(after.tp_ratios_per_rank("flops")))),
        _info("tp_flops_after_rank_median", "TP FLOPs ratio, after, median over the 32 DP ranks",
              float(np.nanmedian(after.tp_ratios_per_rank("flops")))),
        _info("canzona_tp_lpt_small_cmax", "canzona lpt (Algorithm 2 as written), C_max 16, TP FLOPs over all GPUs",
              _quiet_plan(strategy="lb-asc", tp_schedule="lpt", cmax_bytes=cmax_to_bytes(16, tp), **cz)
              .metrics.details["tp_flops_ratio_global"]),
        _info("canzona_tp_carry_small_cmax", "canzona lpt-carry, C_max 16, TP FLOPs over all GPUs",
              _quiet_plan(strategy="lb-asc", cmax_bytes=cmax_to_bytes(16, tp), **cz).metrics.details["tp_flops_ratio_global"],
              why="C_max 16 is 512 MiB of fp32 gradient at TP 8, below one fc1: every fc1 is a one-task group, which "
                  "Algorithm 2's zero-start heap hosts on TP rank 0 and lpt-carry spreads"),
        _info("joint_flops", "canzona lb-asc-joint DP FLOPs ratio (full shapes)", joint.metrics.dp_flops_ratio),
        _info("joint_memory", "canzona lb-asc-joint DP optimizer-state bytes ratio", joint.metrics.dp_memory_ratio),
    )
    notes = (
        "paper convention: " + PAPER.description,
        f"canzona convention: {CANZONA.description}",
        f"the authors' buffer holds {len(after.params)} matrices in {len(after.bounds)} buckets "
        f"({'/'.join(str(e - s) for s, e in after.bounds)} parameters); Algorithm 1's plan was kept: {after.kept_balanced}",
        f"registration order matters: listing linear_qkv before linear_proj (canzona's order) gives DP memory "
        f"{qkv_first.dp_ratio('memory'):.3f} and TP {qkv_first.tp_ratio_rank0('flops'):.3f} / "
        f"{qkv_first.tp_ratio_rank0('memory'):.3f} instead of {after.dp_ratio('memory'):.3f} and "
        f"{after.tp_ratio_rank0('flops'):.3f} / {after.tp_ratio_rank0('memory'):.3f}",
        "TP 'before' readings tried: " + "; ".join(f"{k} = {v:.3f}" for k, v in readings.items()),
    )
    return Figure("fig3", "Figure 3: load balance before/after", "qwen3-32b, muon, DP32 x TP8 (256 GPUs)", rows, notes)


# ------------------------------------------------------------------------------------ Figure 4
def fig4() -> Figure:
    """Figure 4: iteration breakdown, NV-layerwise vs Canzona, Qwen3-32B, Muon, DP32 x TP8."""
    from canzona.sim import Setup
    dp, tp = 32, 8
    kw = dict(bucket_numel=PAPER.bucket_numel, cmax_bytes=paper_cmax_bytes(tp))
    lw = _sim("qwen3-32b", "layerwise", dp=dp, tp=tp, **kw)
    lb = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, **kw)
    lb_serial = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, setup=Setup(tp_overlap="serial"), **kw)
    lb_free = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, setup=Setup(tp_overlap="free"), **kw)
    miss = (f"simulated with assumed constants (h800-ib400): layerwise's step includes {lw.opt_dp_comm_s * 1e3:.0f} ms of "
            f"per-parameter broadcast loop whose latency part rests on the assumed net_alpha_us, and fwd-bwd uses the "
            f"assumed MFU 0.35 (lb-asc fwd-bwd {lb.fwd_bwd_s:.3f} s vs the paper's 0.811 s); "
            "`canzona simulate --fit-fwd-bwd` fits that one constant")
    rows = []
    for phase in ("optimizer_s", "fwd_bwd_s", "iteration_s"):
        for st, b in (("layerwise", lw), ("lb-asc", lb)):
            rows.append(_value_row(f"{phase}_{st}", f"{phase.removesuffix('_s')} seconds, {st}", f"{phase}_{st}",
                                   getattr(b, phase), tol=TIME_TOLERANCE, relative=True, miss=miss))
    for phase in ("optimizer", "fwd_bwd", "iteration"):
        ratio = getattr(lw, f"{phase}_s") / getattr(lb, f"{phase}_s")
        rows.append(_value_row(f"{phase}_speedup", f"{phase} speedup, layerwise / lb-asc", f"{phase}_speedup_dp32_tp8",
                               ratio, tol=TIME_TOLERANCE, relative=True, miss=miss))
    rows.append(_info("optimizer_s_lb-asc_serial", "lb-asc optimizer seconds with blocking all-to-alls (the authors' executor)",
                      lb_serial.optimizer_s))
    rows.append(_info("optimizer_s_lb-asc_free", "lb-asc optimizer seconds, what-if 'free' overlap (not realized by the runtime)",
                      lb_free.optimizer_s))
    notes = ("plans: canzona's planner with the paper's 400M-element buckets and C_max (400 x 2^20 TP-local "
             "elements = 400 MiB x tp x 4 bytes of fp32 gradient); TP overlap as canzona's runtime realizes it (pipelined)",)
    return Figure("fig4", "Figure 4: iteration time, NV-layerwise vs Canzona", "qwen3-32b, muon, DP32 x TP8 (256 GPUs)",
                  tuple(rows), notes)


# ------------------------------------------------------------------------------------ Figure 6
_FAMILY = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b")


def fig6() -> Figure:
    """Figure 6: NV-layerwise vs Canzona across the Qwen3 family (DP16 x TP8) and splits."""
    rows: list[Row] = []
    res: dict[tuple[str, int, int], tuple[Any, Any]] = {}
    configs = [(m, 16, 8) for m in _FAMILY] + [("qwen3-32b", 32, 4)]
    for m, dp, tp in configs:
        kw = dict(bucket_numel=PAPER.bucket_numel, cmax_bytes=paper_cmax_bytes(tp))
        res[(m, dp, tp)] = (_sim(m, "layerwise", dp=dp, tp=tp, **kw), _sim(m, "lb-asc", dp=dp, tp=tp, **kw))
    lw32, lb32 = res[("qwen3-32b", 16, 8)]
    rows.append(_value_row("optimizer_speedup_dp16_tp8", "Qwen3-32B DP16 x TP8 optimizer speedup, layerwise / lb-asc",
                           "optimizer_speedup_dp16_tp8", lw32.optimizer_s / lb32.optimizer_s, tol=TIME_TOLERANCE,
                           relative=True, miss="simulated with assumed hardware constants"))
    wins = {k: (a.iteration_s, b.iteration_s) for k, (a, b) in res.items()}
    all_win = all(b < a for a, b in wins.values())
    rows.append(_trend_row("fig6_lb_beats_layerwise", all_win,
                           "; ".join(f"{m} DP{dp}xTP{tp}: {a:.3f} vs {b:.3f} s" for (m, dp, tp), (a, b) in wins.items())))
    sp = [res[(m, 16, 8)][0].optimizer_s / res[(m, 16, 8)][1].optimizer_s for m in _FAMILY]
    gaps = [res[(m, 16, 8)][0].optimizer_s - res[(m, 16, 8)][1].optimizer_s for m in _FAMILY]
    grows = all(b >= a for a, b in zip(gaps, gaps[1:]))
    rows.append(_trend_row("fig6_gap_grows_with_size", grows,
                           "optimizer gap (s): " + ", ".join(f"{m} {g:.3f}" for m, g in zip(_FAMILY, gaps))
                           + "; speedups " + ", ".join(f"{x:.1f}x" for x in sp),
                           miss="the absolute gap does not grow monotonically with model size"))
    a, b = res[("qwen3-32b", 32, 4)]
    rows.append(_trend_row("fig6_robust_to_split", a.iteration_s > b.iteration_s and lw32.iteration_s > lb32.iteration_s,
                           f"DP16xTP8 {lw32.iteration_s / lb32.iteration_s:.2f}x, DP32xTP4 {a.iteration_s / b.iteration_s:.2f}x (iteration)"))
    return Figure("fig6", "Figure 6: NV-layerwise vs Canzona across model sizes and splits",
                  "Qwen3 1.7B..32B, muon, DP16 x TP8; Qwen3-32B also DP32 x TP4", tuple(rows))


# ------------------------------------------------------------------------------------ Figure 7
def fig7() -> Figure:
    """Figure 7: fwd-bwd against AdamW all-reduce (DDP) and reduce-scatter (ZeRO-1) references."""
    from canzona.sim import Setup, plan_for, simulate_plan
    dp, tp = 32, 8
    cfg = resolve_model("qwen3-32b")
    kw = dict(bucket_numel=PAPER.bucket_numel)
    hw = _hw()
    ar = simulate_plan(plan_for(cfg, "sc", dp=dp, tp=tp, optimizer="adamw", **kw), cfg, hw, Setup()).fwd_bwd_s
    rs = simulate_plan(plan_for(cfg, "zero1", dp=dp, tp=tp, **kw), cfg, hw, Setup()).fwd_bwd_s
    lw = _sim("qwen3-32b", "layerwise", dp=dp, tp=tp, **kw).fwd_bwd_s
    lb = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, cmax_bytes=paper_cmax_bytes(tp), **kw).fwd_bwd_s
    rows = (
        _info("fwd_bwd_adamw_all_reduce", "AdamW all-reduce (DDP) fwd-bwd, s", ar),
        _info("fwd_bwd_adamw_reduce_scatter", "AdamW reduce-scatter (ZeRO-1) fwd-bwd, s", rs),
        _trend_row("fig7_layerwise_tracks_allreduce", abs(lw - ar) < abs(lw - rs),
                   f"layerwise {lw:.3f} s: {abs(lw - ar) / ar:.1%} from all-reduce, {abs(lw - rs) / rs:.1%} from reduce-scatter"),
        _trend_row("fig7_canzona_tracks_reduce_scatter", abs(lb - rs) < abs(lb - ar) and lb >= rs - 1e-9,
                   f"lb-asc {lb:.3f} s: {(lb - rs) / rs:+.1%} vs reduce-scatter, {(lb - ar) / ar:+.1%} vs all-reduce",
                   miss="lb-asc is not between the references as the paper shows"),
    )
    return Figure("fig7", "Figure 7: fwd-bwd communication against AdamW references",
                  "qwen3-32b, DP32 x TP8 (256 GPUs), 400M-element buckets", rows)


# ------------------------------------------------------------------------------------ Figure 8
def _increasing(xs: Sequence[float], slack: float = 0.0) -> bool:
    return all(b >= a - slack for a, b in zip(xs, xs[1:])) and xs[-1] > xs[0]


def fig8a() -> Figure:
    """Figure 8a: DP scaling 16..128 at TP4, Qwen3-32B, Muon."""
    tp, dps = 4, (16, 32, 64, 128)
    specs = specs_from_config(resolve_model("qwen3-32b"), tp=tp)
    asc_f, asc_m, lb_f, lb_m, cz_f = [], [], [], [], []
    for dp in dps:
        b = authors_plan(specs, dp=dp, tp=tp, dp_mode="baseline", tp_mode="no")
        a = authors_plan(specs, dp=dp, tp=tp)
        asc_f.append(b.dp_ratio("flops")); asc_m.append(b.dp_ratio("memory"))
        lb_f.append(a.dp_ratio("flops")); lb_m.append(a.dp_ratio("memory"))
        cz_f.append(_quiet_plan("qwen3-32b", dp=dp, tp=tp, strategy="lb-asc").metrics.dp_flops_ratio)
    mem_bound = [max(1.0, max(s.local_numel for s in specs if s.kind == "matrix")
                     / (sum(s.local_numel for s in specs if s.kind == "matrix") / dp)) for dp in dps]
    n_mat = sum(1 for s in specs if s.kind == "matrix")
    kw = dict(bucket_numel=PAPER.bucket_numel, cmax_bytes=paper_cmax_bytes(tp))
    t_asc = [_sim("qwen3-32b", "asc", dp=dp, tp=tp, **kw).optimizer_s for dp in dps]
    t_lb = [_sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, **kw).optimizer_s for dp in dps]
    fmt = lambda xs: ", ".join(f"DP{d}: {x:.2f}" for d, x in zip(dps, xs))  # noqa: E731
    fmt_s = lambda xs: ", ".join(f"DP{d}: {x * 1e3:.0f} ms" for d, x in zip(dps, xs))  # noqa: E731
    rows = (
        _trend_row("fig8a_asc_degrades", _increasing(asc_f) and _increasing(asc_m),
                   f"ASC FLOPs {fmt(asc_f)}; memory {fmt(asc_m)}", miss="ASC's ratios are not increasing in DP"),
        _trend_row("fig8a_lb_flat", max(lb_m) <= 1.25,
                   f"LB-ASC memory (the balanced quantity) {fmt(lb_m)}; FLOPs {fmt(lb_f)}",
                   miss=f"with the authors' 400M-element buckets a bucket holds ~6 layers, fewer parameters than "
                        f"ranks at DP64+ ({n_mat} matrices over {dps[-1]} ranks), and Algorithm 1 snaps per bucket: "
                        f"it stays above the atomic bound ({fmt(mem_bound)})"),
        _trend_row("fig8a_opt_time", max(t_lb) <= 1.3 * min(t_lb) and t_asc[-1] > t_asc[0],
                   f"LB-ASC {fmt_s(t_lb)}; ASC {fmt_s(t_asc)}",
                   miss="in the simulator every rank's share of the matrices shrinks with DP, so both strategies get "
                        "faster; ASC stays 2.8-4x slower than LB-ASC but does not grow"),
        _info("fig8a_canzona_flops", "canzona lb-asc DP FLOPs ratio (full shapes, joint buffer)", fmt(cz_f)),
    )
    return Figure("fig8a", "Figure 8a: DP scaling", "qwen3-32b, muon, TP4, DP 16..128", rows,
                  ("ratios: paper convention (authors' planner); optimizer times: canzona's planner + simulator",))


def fig8b() -> Figure:
    """Figure 8b: TP scaling 2..8 at PP4 x DP4, Qwen3-32B, Muon; per stage, worst stage reported."""
    from canzona.plan.pipeline import split_stages
    pp, dp, tps = 4, 4, (2, 4, 8)
    cfg = resolve_model("qwen3-32b")
    base_r, lb_r, lb_all, bound, t_lb, t_asc = [], [], [], [], [], []
    for tp in tps:
        stages = split_stages(specs_from_config(cfg, tp=tp), pp, cfg.num_hidden_layers)
        b = [authors_plan(s, dp=dp, tp=tp, dp_mode="baseline", tp_mode="no") for s in stages]
        a = [authors_plan(s, dp=dp, tp=tp) for s in stages]
        base_r.append(max(float(np.nanmax(x.tp_ratios_per_rank("flops"))) for x in b))
        lb_r.append(max(float(np.nanmax(x.tp_ratios_per_rank("flops"))) for x in a))
        lb_all.append(max(x.all_gpu_ratio("flops", "full") for x in a))
        bound.append(max(lower_bound(s, dp, tp) for s in stages))
        kw = dict(bucket_numel=PAPER.bucket_numel, cmax_bytes=paper_cmax_bytes(tp))
        t_lb.append(_sim_pp("qwen3-32b", "lb-asc", pp=pp, dp=dp, tp=tp, **kw).optimizer_s)
        t_asc.append(_sim_pp("qwen3-32b", "asc", pp=pp, dp=dp, tp=tp, **kw).optimizer_s)
    fmt = lambda xs: ", ".join(f"TP{t}: {x:.2f}" for t, x in zip(tps, xs))  # noqa: E731
    rows = (
        _trend_row("fig8b_baseline_grows", base_r[-1] >= 1.5 * base_r[0],
                   f"baseline (no TP balancing, DP static), worst stage and DP rank: {fmt(base_r)}"
                   + ("" if _increasing(base_r) else " (not monotone: read as TP8 >= 1.5x TP2)"),
                   miss="the baseline's TP ratio at TP8 is not 1.5x its TP2 value"),
        _trend_row("fig8b_lb_lower", all(x < y for x, y in zip(lb_r, base_r)),
                   f"Algorithm 2, worst stage and DP rank: {fmt(lb_r)}", miss="Algorithm 2 is not below the baseline at every TP"),
        _info("fig8b_all_gpus", "Algorithm 2 over all GPUs of the worst stage (full shapes) / lower bound",
              f"{fmt(lb_all)} / bound {fmt(bound)}"),
        _info("fig8b_opt_time", "simulated optimizer seconds, lb-asc vs asc (slowest stage)",
              ", ".join(f"TP{t}: {x * 1e3:.0f} vs {y * 1e3:.0f} ms" for t, x, y in zip(tps, t_lb, t_asc))),
    )
    return Figure("fig8b", "Figure 8b: TP scaling", "qwen3-32b, muon, PP4 x DP4, TP 2..8 (per pipeline stage)", rows,
                  ("each pipeline stage planned on its own (Megatron split: 16 layers each, embedding first, output last)",))


# ------------------------------------------------------------------------------------ Figure 9
def fig9() -> Figure:
    """Figure 9: model-size scaling 1.7B..32B at DP16 x TP4."""
    dp, tp = 16, 4
    asc, lb, tp_base, tp_lb, gap = [], [], [], [], []
    for m in _FAMILY:
        specs = specs_from_config(resolve_model(m), tp=tp)
        b = authors_plan(specs, dp=dp, tp=tp, dp_mode="baseline", tp_mode="no")
        a = authors_plan(specs, dp=dp, tp=tp)
        asc.append(b.dp_ratio("flops")); lb.append(a.dp_ratio("memory"))
        tp_base.append(float(np.nanmedian(b.tp_ratios_per_rank("flops"))))
        tp_lb.append(float(np.nanmedian(a.tp_ratios_per_rank("flops"))))
        # how far Algorithm 2 is from each DP rank's own bound (largest task / mean host load)
        gap.append(float(np.nanmedian(a.tp_ratios_per_rank("flops") / a.tp_bounds_per_rank("flops"))))
    fmt = lambda xs: ", ".join(f"{m.removeprefix('qwen3-')}: {x:.2f}" for m, x in zip(_FAMILY, xs))  # noqa: E731
    rows = (
        _trend_row("fig9_asc_grows", asc[-1] > asc[0], f"ASC DP FLOPs {fmt(asc)}",
                   miss="ASC's 32B ratio is not above its 1.7B ratio"),
        _trend_row("fig9_lb_flat", max(lb) - min(lb) <= 0.25, f"LB-ASC DP memory (balanced quantity) {fmt(lb)}",
                   miss="LB-ASC's ratio spreads by more than 0.25 across sizes"),
        _trend_row("fig9_tp_near_optimal", all(x <= y + 1e-9 for x, y in zip(tp_lb, tp_base)) and max(gap) <= 1.34,
                   f"median TP FLOPs ratio over DP ranks, baseline {fmt(tp_base)}; Algorithm 2 {fmt(tp_lb)}; "
                   f"Algorithm 2 / each rank's bound (median) {fmt(gap)}",
                   miss="Algorithm 2 is above the baseline, or further than LPT's 4/3 guarantee from the bound"),
    )
    return Figure("fig9", "Figure 9: model-size scaling", "Qwen3 1.7B..32B, muon, DP16 x TP4 (paper convention)", rows)


# ------------------------------------------------------------------------------------ Figures 10a, 11a, 12
def _optimizer_pair(optimizer: str) -> tuple[Any, Any]:
    pp, dp, tp = 2, 32, 4
    kw = dict(bucket_numel=PAPER.bucket_numel, cmax_bytes=paper_cmax_bytes(tp))
    return (_sim_pp("qwen3-14b", "sc", pp=pp, dp=dp, tp=tp, optimizer=optimizer, **kw),
            _sim_pp("qwen3-14b", "lb-asc", pp=pp, dp=dp, tp=tp, optimizer=optimizer, **kw))


def fig10a() -> Figure:
    """Figure 10a: Shampoo optimizer step, SC vs Canzona, Qwen3-14B PP2 x DP32 x TP4."""
    sc, lb = _optimizer_pair("shampoo")
    miss = ("simulated: canzona's Shampoo cost model (eigendecompositions amortized over 100 steps) and assumed "
            "hardware constants; the paper does not state its Shampoo settings")
    rows = (
        _value_row("optimizer_s_sc", "SC optimizer seconds (slowest stage)", "optimizer_s_sc_shampoo", sc.optimizer_s,
                   tol=TIME_TOLERANCE, relative=True, miss=miss),
        _value_row("optimizer_s_lb", "LB-ASC optimizer seconds (slowest stage)", "optimizer_s_lb-asc_shampoo", lb.optimizer_s,
                   tol=TIME_TOLERANCE, relative=True, miss=miss),
        _value_row("optimizer_speedup", "speedup SC / LB-ASC", "optimizer_speedup_sc_shampoo", sc.optimizer_s / lb.optimizer_s,
                   tol=TIME_TOLERANCE, relative=True, miss=miss),
    )
    return Figure("fig10a", "Figure 10a: Shampoo efficiency", "qwen3-14b, shampoo, PP2 x DP32 x TP4 (256 GPUs)", rows)


def fig11a() -> Figure:
    """Figure 11a: SOAP optimizer step, SC vs Canzona (the paper gives the trend only)."""
    sc, lb = _optimizer_pair("soap")
    sp = sc.optimizer_s / lb.optimizer_s
    rows = (_trend_row("fig11a_soap_reduction", sp >= 10.0, f"SC {sc.optimizer_s:.3f} s -> LB-ASC {lb.optimizer_s:.3f} s ({sp:.1f}x; 'drastic' read as >= 10x)",
                       miss="the simulated reduction is below 10x"),)
    return Figure("fig11a", "Figure 11a: SOAP efficiency", "qwen3-14b, soap, PP2 x DP32 x TP4 (256 GPUs)", rows)


def fig12() -> Figure:
    """Figure 12: DP FLOPs load balance under Shampoo and SOAP (paper convention, worst stage)."""
    from canzona.plan.pipeline import split_stages
    pp, dp, tp = 2, 32, 4
    cfg = resolve_model("qwen3-14b")
    stages = split_stages(specs_from_config(cfg, tp=tp), pp, cfg.num_hidden_layers)
    rows: list[Row] = []
    for opt in ("shampoo", "soap"):
        b = max(authors_plan(s, dp=dp, tp=tp, optimizer=opt, dp_mode="baseline").dp_ratio("flops") for s in stages)
        a = max(authors_plan(s, dp=dp, tp=tp, optimizer=opt).dp_ratio("flops") for s in stages)
        pb = paper_value(f"dp_flops_ratio_asc_{opt}")
        rows.append(Row(f"asc_{opt}", f"{opt}: naive DP FLOPs ratio (> 2.0 in the paper), worst stage", f"> {pb.value:g}", b,
                        REPRODUCED if b > pb.value else NOT_REPRODUCED, "> 2.0",
                        "" if b > pb.value else "the static partition's ratio is not above 2.0", paper_key=pb.key))
        # canzona's own planner on the whole model (its pipeline stages would each do as well or better)
        cz = _quiet_plan("qwen3-14b", dp=dp, tp=tp, optimizer=opt, strategy="lb-asc-joint").metrics.dp_flops_ratio
        rows.append(_value_row(f"lb_{opt}", f"{opt}: LB-ASC DP FLOPs ratio, worst stage", f"dp_flops_ratio_lb-asc_{opt}", a,
                               tol=0.05, miss="Algorithm 1 balances elements; Shampoo/SOAP FLOPs grow with the cube of "
                                              "the dimensions, so element balance leaves a larger FLOPs imbalance than '~1.05'",
                               canzona=cz, why="canzona's lb-asc-joint (whole model, PP1) balances FLOPs and memory together on full shapes"))
    return Figure("fig12", "Figure 12: load balance under Shampoo and SOAP",
                  "qwen3-14b, PP2 x DP32 x TP4 (the C.4 setup; paper convention, TP-local FLOPs)", tuple(rows),
                  ("tolerance +-0.05 for the '~1.05' rows (the paper gives one digit past the point with a tilde)",))


# ------------------------------------------------------------------------------------ Figure 13
def fig13() -> Figure:
    """Figure 13: the alpha sweep, Qwen3-32B PP8 x DP16 (TP1)."""
    pp, dp, tp = 8, 16, 1
    alphas = (0.0, 0.25, 0.5, 0.75, 1.0)
    res = [_sim_pp("qwen3-32b", "lb-asc", pp=pp, dp=dp, tp=tp, alpha=a, bucket_numel=PAPER.bucket_numel) for a in alphas]
    opt = [r.optimizer_s for r in res]
    fb = [r.fwd_bwd_s for r in res]
    it = [r.iteration_s for r in res]
    fmt = lambda xs: ", ".join(f"{a:g}: {x * 1e3:.1f} ms" for a, x in zip(alphas, xs))  # noqa: E731
    best = alphas[int(np.argmin(it))]
    rows = (
        _trend_row("fig13_opt_decreases", all(b <= a + 1e-12 for a, b in zip(opt, opt[1:])), f"optimizer {fmt(opt)}",
                   miss="the simulated optimizer time is not monotone in alpha"),
        _trend_row("fig13_fwd_bwd_stable", max(fb) <= 1.05 * min(fb), f"fwd-bwd {fmt(fb)}",
                   miss="fwd-bwd moves by more than 5 % across alpha"),
        _trend_row("fig13_alpha1_best", math.isclose(best, 1.0) or it[-1] <= min(it) * 1.001, f"iteration {fmt(it)}; best alpha {best:g}",
                   miss="another alpha gives a shorter iteration"),
    )
    return Figure("fig13", "Figure 13: alpha sweep", "qwen3-32b, muon, PP8 x DP16 x TP1 (128 GPUs), 1F1B", rows,
                  (f"1F1B with {res[0].microbatches} micro-batches (assumption: the fewest that fill the pipeline)",))


# ------------------------------------------------------------------------------------ Figure 14
def cmax_sweep(cmax_mb: Sequence[float] = (64, 128, 256, 512, 1024, 2048), unit: str = "cost") -> dict[str, Any]:
    """Fused lb-asc optimizer seconds per C_max (Qwen3-32B DP16 x TP8) and the no-fuse ablation.

    ``unit``: ``cost`` (the authors' unit: 2^20 TP-local elements per host), ``fp32`` or ``bf16``
    (MiB of gathered gradient in that precision, canzona's unit)."""
    dp, tp = 16, 8
    scale = {"cost": tp * 4, "fp32": 1, "bf16": 1}[unit]
    gb = 2 if unit == "bf16" else 4
    fused = {}
    nofuse = {}
    for c in cmax_mb:
        kw = dict(bucket_numel=PAPER.bucket_numel, cmax_bytes=int(c * 2**20 * scale), grad_bytes=gb)
        fused[c] = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, **kw).optimizer_s
        nofuse[c] = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, tp_schedule="no-fuse", **kw).optimizer_s
    return {"fused": fused, "no_fuse": nofuse}


def _plateau(curve: dict[float, float], tol: float = 0.01) -> float:
    best = min(curve.values())
    return min(c for c, v in curve.items() if v <= best * (1 + tol))


def _plateau_row(holds: bool, ours: str, miss: str) -> Row:
    r = _trend_row("fig14_plateau", holds, ours, miss)
    return replace(r, paper=f"plateau around C_max = {paper_value('cmax_plateau_mb').value:g} MB", paper_key="cmax_plateau_mb")


def fig14() -> Figure:
    """Figure 14: micro-group fusion capacity, Qwen3-32B DP16 x TP8."""
    sweeps = {u: cmax_sweep(unit=u) for u in ("cost", "fp32", "bf16")}
    cost = sweeps["cost"]
    nf = cost["no_fuse"][512]
    fu = cost["fused"][512]
    plateau = {u: _plateau(s["fused"]) for u, s in sweeps.items()}
    miss = ("without fusion each exchange carries one host's task, and with one exchange in flight each way (the "
            "runtime's pipelined overlap) the hosts of a TP group compute one after another: the step approaches the "
            "sum of the rank's tasks instead of the busiest host's share; the paper's executor pays it less, which "
            "the simulator's launch/latency constants (assumed) do not capture")
    rows = (
        _value_row("no_fuse", "no-fuse optimizer seconds", "optimizer_s_no_fuse", nf, tol=TIME_TOLERANCE, relative=True, miss=miss),
        _value_row("fused", "fused optimizer seconds at C_max = 512", "optimizer_s_fused", fu, tol=TIME_TOLERANCE, relative=True, miss=miss),
        _trend_row("fig14_fusion_helps", all(cost["fused"][c] < cost["no_fuse"][c] for c in cost["fused"]),
                   ", ".join(f"{c:g}: {cost['fused'][c] * 1e3:.1f} vs {cost['no_fuse'][c] * 1e3:.1f} ms" for c in cost["fused"]),
                   miss="no-fuse is as fast as fused somewhere"),
        _plateau_row(256 <= plateau["cost"] <= 1024,
                   f"plateau (within 1 % of the best) from C_max = {plateau['cost']:g} (authors' unit); "
                   f"in MiB of fp32 gradient from {plateau['fp32']:g}, of bf16 gradient from {plateau['bf16']:g}",
                   miss="in the authors' unit every DP rank's tasks already fit one micro-group at the smallest C_max "
                        "shown, so the curve is flat; the paper's plateau at 512 appears when C_max counts bf16 "
                        "gradient bytes (fp32 bytes: 1024)"),
        _info("fp32_sweep", "fused / no-fuse, C_max in MiB of fp32 gradient",
              ", ".join(f"{c:g}: {v * 1e3:.1f}/{sweeps['fp32']['no_fuse'][c] * 1e3:.1f} ms" for c, v in sweeps["fp32"]["fused"].items())),
        _info("bf16_sweep", "fused / no-fuse, C_max in MiB of bf16 gradient",
              ", ".join(f"{c:g}: {v * 1e3:.1f}/{sweeps['bf16']['no_fuse'][c] * 1e3:.1f} ms" for c, v in sweeps["bf16"]["fused"].items())),
    )
    notes = ("the paper's C_max axis is in the authors' unit (2^20 TP-local elements per host with the numel cost, "
             "called MB in their README), which is canzona's unit too (--cmax); the sweeps in MiB of gathered fp32 "
             "and bf16 gradient are shown for comparison",
             "no-fuse uses exactly the fused schedule's hosts, one exchange per task (fusion is the only difference)")
    return Figure("fig14", "Figure 14: micro-group fusion capacity", "qwen3-32b, muon, DP16 x TP8 (128 GPUs)", rows, notes)


# ------------------------------------------------------------------------------------ Figure 16
def fig16() -> Figure:
    """Figure 16: numel vs FLOPs as the planning cost, Qwen3-32B DP16 x TP8."""
    dp, tp = 16, 8
    kw = dict(bucket_numel=PAPER.bucket_numel, cmax_bytes=paper_cmax_bytes(tp), flops_shape="local")
    t_n = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, cost="numel", **kw).optimizer_s
    t_f = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, cost="flops", **kw).optimizer_s
    t_ff = _sim("qwen3-32b", "lb-asc", dp=dp, tp=tp, cost="flops", **{**kw, "flops_shape": "full"}).optimizer_s
    miss = "simulated with assumed hardware constants"
    rows = (
        _value_row("numel", "optimizer seconds, cost numel", "optimizer_s_cost_numel", t_n, tol=TIME_TOLERANCE, relative=True, miss=miss),
        _value_row("flops", "optimizer seconds, cost FLOPs", "optimizer_s_cost_flops", t_f, tol=TIME_TOLERANCE, relative=True, miss=miss),
        _trend_row("fig16_numel_proxy", abs(t_n - t_f) <= 0.05 * max(t_n, t_f), f"difference {abs(t_n - t_f) * 1e3:.2f} ms ({abs(t_n - t_f) / t_n:.1%})",
                   miss="the FLOPs plan balances TP-local shard FLOPs (the authors' count), which misjudges the "
                        "full-shape work hosts run; the simulator charges the full shapes"),
        _info("flops_full", "optimizer seconds, cost FLOPs on full (host) shapes", t_ff),
    )
    return Figure("fig16", "Figure 16: cost model ablation", "qwen3-32b, muon, DP16 x TP8 (128 GPUs)", rows,
                  ("the paper's own difference is ~1e-4 s; the trend test accepts up to 5 % (simulated)",))


FIGURES: dict[str, tuple[str, Callable[[], Figure]]] = {
    "fig3": ("DP and TP load balance before/after (Qwen3-32B, DP32 x TP8)", fig3),
    "fig4": ("iteration breakdown, NV-layerwise vs Canzona (DP32 x TP8)", fig4),
    "fig6": ("NV-layerwise vs Canzona across model sizes and splits", fig6),
    "fig7": ("fwd-bwd against AdamW all-reduce / reduce-scatter references", fig7),
    "fig8a": ("DP scaling 16..128 at TP4", fig8a),
    "fig8b": ("TP scaling 2..8 at PP4 x DP4", fig8b),
    "fig9": ("model-size scaling 1.7B..32B at DP16 x TP4", fig9),
    "fig10a": ("Shampoo: SC vs Canzona, Qwen3-14B PP2 x DP32 x TP4", fig10a),
    "fig11a": ("SOAP: SC vs Canzona, Qwen3-14B PP2 x DP32 x TP4", fig11a),
    "fig12": ("DP load balance under Shampoo / SOAP", fig12),
    "fig13": ("alpha sweep, Qwen3-32B PP8 x DP16", fig13),
    "fig14": ("micro-group fusion capacity C_max, DP16 x TP8", fig14),
    "fig16": ("numel vs FLOPs planning cost, DP16 x TP8", fig16),
}


def reproduce(key: str) -> Figure:
    """The figure called ``key`` (see :data:`FIGURES`); KeyError lists the known keys."""
    try:
        return FIGURES[key][1]()
    except KeyError:
        if key in FIGURES:
            raise
        raise KeyError(f"no figure {key!r}; known: {', '.join(FIGURES)}") from None

