"""Step-time model of one training iteration at cluster scale, per strategy.

What it predicts, for one (model, DP, TP, optimizer, strategy) plan on one hardware profile:

* **fwd-bwd**: forward and backward compute (model FLOPs / (peak x MFU)) plus the exposed TP
  activation collectives (Megatron sequence parallel: all-gather + reduce-scatter around attention
  and MLP, forward and backward, on NVLink), plus whatever part of the DP gradient
  reduce-scatter / all-reduce (backward) and parameter all-gather (next forward) the bucketed
  overlap pipeline (:func:`canzona.sim.comm.flow_shop`) cannot hide.
* **optimizer step**: the makespan over DP ranks of each rank's own work -- element-wise AdamW
  (HBM-bound), matrix updates (FLOPs from :mod:`canzona.cost` / achieved throughput per shape),
  TP exchanges (fused all-to-all per micro-group for asc / lb-asc, pipelined against host compute;
  per-parameter all-gather with redundant compute for sc / layerwise) -- plus exposed DP
  communication inside the step (NV-layerwise's per-parameter broadcast loop).
* **iteration** = fwd-bwd + optimizer step (the ZeRO-1 parameter all-gather is charged to the
  forward it overlaps, as Megatron's ``overlap_param_gather`` does and as the paper measures).

Section references: DP runtime Section 3.3 (variable-size reduce-scatter / all-gather overlapped
with backward / forward, zero-communication step), TP runtime Section 4.1 (gather -> compute ->
scatter -> apply per micro-group), baselines Section 5.1 / Appendix D.2 (SC all-reduce and
redundant compute; NV-layerwise all-reduce plus broadcast loop).

Every number that is not derived from the plan and the model shapes is a named constant: the
hardware profile (:mod:`canzona.sim.hardware`) or a :class:`Setup` field, each with its source in
:data:`SETUP_SOURCES`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from canzona.config import ModelConfig
from canzona.cost import matrix_flops, state_bytes
from canzona.optimizers import ELEMENTWISE_DEFAULT, get_optimizer, optimizer_names
from canzona.plan import Plan, plan_model
from canzona.plan.strategies import get_strategy
from canzona.sim.comm import (
    Link,
    Op,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    broadcast_time,
    flow_shop,
    list_schedule,
    reduce_scatter_time,
)
from canzona.sim.configs import resolve_sim_model
from canzona.sim.hardware import FLOPS_PER_MAC, HardwareProfile, ns_efficiency, peak_flops
from canzona.specs import split_task_name

__all__ = [
    "SIM_STRATEGIES",
    "TP_OVERLAPS",
    "VARSIZE_MODELS",
    "Setup",
    "SETUP_SOURCES",
    "ADAMW_BYTES_PER_ELEMENT",
    "MATRIX_ELEMENTWISE_BYTES",
    "APPLY_BYTES_PER_ELEMENT",
    "StepBreakdown",
    "fwd_flops_per_gpu",
    "simulate_plan",
    "plan_for",
    "simulate",
    "PipelineBreakdown",
    "simulate_pipeline",
]

#: strategies the simulator compares (zero1 is the AdamW reference, the others run the matrix optimizer)
SIM_STRATEGIES: tuple[str, ...] = ("sc", "layerwise", "asc", "lb-asc", "zero1")
TP_OVERLAPS: tuple[str, ...] = ("pipelined", "free", "serial")
VARSIZE_MODELS: tuple[str, ...] = ("grouped", "padded")

#: HBM bytes per element of one fused AdamW step with fp32 master weights: read grad, master, m, v
#: (4 x 4), write master, m, v (3 x 4), cast the master to the bf16 model weight (read 4, write 2).
ADAMW_BYTES_PER_ELEMENT = 34
#: HBM bytes per element of a matrix optimizer's element-wise work around its matrix products:
#: momentum (read grad 4, m 4, write m 4) and the update of the fp32 master + bf16 copy (4+4+4+2).
MATRIX_ELEMENTWISE_BYTES = 26
#: HBM bytes per element to apply a received update shard: read update 4, master 4, write master 4,
#: write the bf16 model weight 2.
APPLY_BYTES_PER_ELEMENT = 14


@dataclass(frozen=True, slots=True)
class Setup:
    """The training setup and runtime choices (named assumptions; sources in :data:`SETUP_SOURCES`)."""

    seq_len: int = 4096
    micro_batch: int = 1
    grad_accum: int = 1
    recompute: str = "none"
    sequence_parallel: bool = True
    causal_attention_factor: float = 0.5
    grad_bytes: int = 4
    param_bytes: int = 2
    act_bytes: int = 2
    update_bytes: int = 4
    ns_dtype: str = "bf16"
    tp_overlap: str = "pipelined"
    varsize_collective: str = "grouped"

    def __post_init__(self) -> None:
        for k in ("seq_len", "micro_batch", "grad_accum"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{k} must be an integer >= 1, got {v!r}")
        if self.recompute not in ("none", "full"):
            raise ValueError(f"recompute must be 'none' or 'full', got {self.recompute!r}")
        if self.tp_overlap not in TP_OVERLAPS:
            raise ValueError(f"tp_overlap must be one of {', '.join(TP_OVERLAPS)}, got {self.tp_overlap!r}")
        if self.varsize_collective not in VARSIZE_MODELS:
            raise ValueError(f"varsize_collective must be one of {', '.join(VARSIZE_MODELS)}, got {self.varsize_collective!r}")
        if self.ns_dtype not in ("bf16", "tf32", "fp32"):
            raise ValueError(f"ns_dtype must be bf16, tf32 or fp32, got {self.ns_dtype!r}")
        for k in ("grad_bytes", "param_bytes", "act_bytes", "update_bytes"):
            if getattr(self, k) not in (1, 2, 4, 8):
                raise ValueError(f"{k} must be 1, 2, 4 or 8 bytes, got {getattr(self, k)!r}")
        if not 0 < self.causal_attention_factor <= 1:
            raise ValueError("causal_attention_factor must be in (0, 1]")


SETUP_SOURCES: dict[str, str] = {
    "seq_len": "paper Section 5.1: sequence length 4096",
    "micro_batch": "paper Section 5.1: batch size per DP rank 1",
    "grad_accum": "assumption: the paper's 'batch size per DP rank of 1' read as one micro-batch per iteration (no gradient accumulation); DP communication then overlaps a single backward",
    "recompute": "assumption: no activation recomputation (the paper does not mention it)",
    "sequence_parallel": "assumption: Megatron sequence parallelism with TP (the usual pairing); same activation bytes as all-reduce without it",
    "causal_attention_factor": "assumption: FlashAttention skips fully masked blocks, so causal attention costs half of the full s^2 product",
    "grad_bytes": "Megatron-LM arguments.py: bf16 training forces accumulate_allreduce_grads_in_fp32, so the DP gradient buffer and its reduce-scatter / all-reduce are fp32",
    "param_bytes": "Megatron: bf16 model weights are what the ZeRO-1 all-gather and the layer-wise optimizer's broadcast loop move (Float16OptimizerWithFloat16Params)",
    "act_bytes": "bf16 activations (the paper trains in bf16)",
    "update_bytes": "assumption: hosts send updated shards back in fp32 (the gradient's precision)",
    "ns_dtype": "assumption: Newton-Schulz in bf16, as the reference Muon (Jordan et al.) does; the paper does not say",
    "varsize_collective": "assumption: PyTorch's NCCL backend runs uneven reduce-scatter / all-gather as grouped per-rank reduce / broadcast rings, so link load is the bucket minus one shard; 'padded' (lockstep ring at the pace of the largest shard) is the alternative, and with 40M-element buckets and 33M-element fc1 shards it would make every atomic partition several times slower than the paper's Figure 7 shows",
    "tp_overlap": "what canzona's runtime realizes (canzona/runtime/tp.py): group k+1's gather is launched before group k's compute and the scatter of group k is asynchronous, so one exchange each way overlaps the next group's compute ('pipelined'). 'free' (every gather issued ahead, hosts run free, per-host totals matter) is a what-if the runtime does not implement; 'serial' (blocking all-to-alls, per-group makespans add up) is what the authors' Megatron executor does",
}


# --------------------------------------------------------------------------- fwd-bwd compute
def _layer_matmul_params(cfg: ModelConfig) -> tuple[float, float]:
    """(attention projection parameters, MLP parameters active per token) of one layer."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    attn = h * (q + 2 * kv) + q * h
    if cfg.moe is None:
        mlp = 3 * h * cfg.intermediate_size
    else:
        m = cfg.moe
        mlp = h * m.num_experts + m.num_experts_per_tok * 3 * h * m.moe_intermediate_size
    return float(attn), float(mlp)


def fwd_flops_per_gpu(cfg: ModelConfig, setup: Setup, tp: int) -> float:
    """Forward FLOPs of one micro-batch on one GPU (the TP group splits it evenly).

        dense   2 * tokens * (L * (attention projections + active MLP) + vocab * hidden)
        attn    L * 2 * (2 * seq^2 * q_dim) * micro_batch * causal_factor   (QK^T and PV)

    The embedding lookup is free; norms, RoPE and softmax are left out (element-wise, a few %).
    Backward costs twice the forward.
    """
    s, b = setup.seq_len, setup.micro_batch
    tokens = s * b
    attn_p, mlp_p = _layer_matmul_params(cfg)
    L = cfg.num_hidden_layers
    dense = 2.0 * tokens * (L * (attn_p + mlp_p) + cfg.vocab_size * cfg.hidden_size)
    q_dim = cfg.num_attention_heads * cfg.head_dim
    attn = L * 2.0 * (2.0 * s * s * q_dim) * b * setup.causal_attention_factor
    return (dense + attn) / tp


def _param_fwd_work(plan: Plan, cfg: ModelConfig, setup: Setup) -> np.ndarray:
    """Forward work per parameter (relative units), so a bucket's backward share is known.

    A matrix's work is proportional to its active elements (experts: numel * top-k / experts);
    a layer's attention core is spread over that layer's attention projections. Norms and the
    embedding table have no matmul work (their gradients arrive with their layer's / at the end).
    """
    s = setup.seq_len * setup.micro_batch
    q_dim = cfg.num_attention_heads * cfg.head_dim
    attn_core = 2.0 * (2.0 * s * s * q_dim) * setup.causal_attention_factor
    frac = 1.0 if cfg.moe is None else cfg.moe.num_experts_per_tok / cfg.moe.num_experts
    work = np.zeros(len(plan.params))
    attn_idx: dict[int, list[int]] = {}
    for i, p in enumerate(plan.params):
        sp = p.spec
        if (len(sp.shape) != 2 and sp.kind != "experts") or "embed" in sp.name:
            continue
        w = 2.0 * s * sp.numel
        if ".experts." in sp.name:
            w *= frac
        work[i] = w
        if sp.layer is not None and ("attention" in sp.name or "self_attn" in sp.name):
            attn_idx.setdefault(sp.layer, []).append(i)
    for idx in attn_idx.values():
        tot = work[idx].sum()
        if tot > 0:
            work[idx] += attn_core * work[idx] / tot
    return work


# --------------------------------------------------------------------------- results
@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """One strategy's predicted iteration (seconds) and where the time goes."""

    strategy: str
    optimizer: str
    dp: int
    tp: int
    alpha: float
    fwd_bwd_s: float
    optimizer_s: float
    iteration_s: float
    fwd_compute_s: float
    bwd_compute_s: float
    tp_activation_comm_s: float
    dp_grad_comm_s: float
    dp_grad_exposed_s: float
    dp_param_comm_s: float
    dp_param_exposed_s: float
    opt_elementwise_s: float
    opt_matrix_compute_s: float
    opt_tp_comm_s: float
    opt_dp_comm_s: float
    opt_critical_rank: int
    opt_rank_mean_s: float
    opt_rank_imbalance: float
    memory_gb: float
    memory_fits: bool
    n_buckets: int
    n_micro_groups: int
    per_rank_optimizer_s: tuple[float, ...] = field(repr=False, default=())

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("per_rank_optimizer_s")
        return d


# --------------------------------------------------------------------------- simulation
def _links(hw: HardwareProfile, dp: int, tp: int) -> tuple[Link, Link]:
    """(DP link, TP link). A group whose ranks all sit in one node uses NVLink, else the network
    (a ring is as fast as its slowest hop). TP groups are packed inside nodes first."""
    launch = hw.collective_launch_us.value * 1e-6
    nvl = Link("nvlink", hw.nvlink_bytes_per_s, hw.nvlink_alpha_us.value * 1e-6, launch)
    net = Link("network", hw.net_bytes_per_s, hw.net_alpha_us.value * 1e-6, launch)
    gpn = int(hw.gpus_per_node.value)
    tp_link = nvl if tp <= gpn else net
    dp_link = nvl if dp * tp <= gpn else net
    return dp_link, tp_link


@dataclass(frozen=True, slots=True)
class _FwdBwd:
    """The forward-backward part of one iteration (seconds; see :func:`_fwd_bwd`)."""

    t_fwd: float  # compute of one micro-batch's forward
    t_bwd: float  # compute of one micro-batch's backward (recomputation included)
    t_tp_fwd: float  # TP activation collectives of one forward
    t_tp_bwd: float  # ... and of one backward
    grad_comm: list[float]  # per bucket: the gradient collective
    param_comm: list[float]  # per bucket: the parameter all-gather (0 without reduce-scatter)
    grad_exposed: float  # gradient communication the backward does not hide
    param_exposed: float  # parameter all-gathers the next forward does not hide
    total: float  # the whole fwd-bwd span over every micro-batch


def _fwd_bwd(plan: Plan, cfg: ModelConfig, hw: HardwareProfile, setup: Setup, dp_link: Link, tp_link: Link, whole_model: bool) -> _FwdBwd:
    """Forward and backward compute, the TP activation collectives, and the DP bucket collectives
    overlapped with them as a two-machine flow shop (buckets fill in buffer order in backward; the
    first layers' parameters are needed first in the next forward)."""
    dp, tp = plan.inputs.dp, plan.inputs.tp
    n_layers = cfg.num_hidden_layers
    if whole_model:
        f_fwd = fwd_flops_per_gpu(cfg, setup, tp)
    else:
        f_fwd = float(_param_fwd_work(plan, cfg, setup).sum()) / tp
        n_layers = len({p.spec.layer for p in plan.params if p.spec.layer is not None})
    rate = hw.peak_bf16_tflops.value * 1e12 * hw.fwd_bwd_mfu.value
    t_fwd = f_fwd / rate
    t_bwd = 2.0 * f_fwd / rate + (t_fwd if setup.recompute == "full" else 0.0)
    # TP activation collectives: per layer, all-gather + reduce-scatter before/after attention and
    # MLP = 4 collectives forward, 4 backward, each over the full [tokens, hidden] activation.
    act_bytes = setup.seq_len * setup.micro_batch * cfg.hidden_size * setup.act_bytes
    if setup.sequence_parallel:
        one = all_gather_time(tp_link, tp, act_bytes)
        per_layer = 4 * one
    else:
        per_layer = 2 * all_reduce_time(tp_link, tp, act_bytes)
    t_tp_fwd = n_layers * per_layer
    t_tp_bwd = n_layers * per_layer * (2 if setup.recompute == "full" else 1)
    fwd_stream = t_fwd + t_tp_fwd
    bwd_stream = t_bwd + t_tp_bwd

    work = _param_fwd_work(plan, cfg, setup)
    index = {p.name: i for i, p in enumerate(plan.params)}
    bucket_work = np.array([work[[index[x] for x in b.params]].sum() for b in plan.buckets])
    share = bucket_work / bucket_work.sum() if bucket_work.sum() > 0 else np.full(len(plan.buckets), 1 / len(plan.buckets))

    reduce_scatter = plan.reduce_scatter
    if reduce_scatter:
        vs = setup.varsize_collective
        grad_comm = [reduce_scatter_time(dp_link, dp, shard_bytes=[s * setup.grad_bytes for s in b.shard_sizes()], varsize=vs) for b in plan.buckets]
        param_comm = [all_gather_time(dp_link, dp, shard_bytes=[s * setup.param_bytes for s in b.shard_sizes()], varsize=vs) for b in plan.buckets]
    else:
        grad_comm = [all_reduce_time(dp_link, dp, b.numel * setup.grad_bytes) for b in plan.buckets]
        param_comm = [0.0 for _ in plan.buckets]
    # backward: buckets fill in buffer order (bucket 0 holds the last layers)
    bwd_span, _ = flow_shop(list(share * bwd_stream), grad_comm)
    grad_exposed = bwd_span - bwd_stream
    # forward: the first layers (last buckets) are needed first
    if reduce_scatter:
        fwd_span, _ = flow_shop(param_comm[::-1], list((share * fwd_stream)[::-1]))
        param_exposed = fwd_span - fwd_stream
    else:
        param_exposed = 0.0
    total = setup.grad_accum * (fwd_stream + bwd_stream) + grad_exposed + param_exposed
    return _FwdBwd(t_fwd, t_bwd, t_tp_fwd, t_tp_bwd, grad_comm, param_comm, grad_exposed, param_exposed, total)


@dataclass(frozen=True, slots=True)
class _StepLoads:
    """The optimizer step per DP rank (seconds): element-wise updates, matrix compute, TP
    exchanges, and the rank's whole step (its TP pipeline's span); plus the layerwise broadcast
    after the step and the number of micro-groups (see :func:`_step_loads`)."""

    elementwise: np.ndarray
    matrix: np.ndarray
    tp_comm: np.ndarray
    total: np.ndarray
    dp_comm: float
    n_groups: int


#: the kinds the matrix optimizer updates: a matrix is one task, an ``(E, M, N)`` expert stack E tasks
_MATRIX_KINDS = ("matrix", "experts")


def _matrix_times(plan: Plan, hw: HardwareProfile, setup: Setup, matrix_opt: str) -> np.ndarray:
    """Per parameter: the full-shape matrix optimizer's time on one GPU (its FLOPs at the
    calibrated Newton-Schulz / eigh throughput, plus its element-wise passes over HBM); an expert
    stack is E such tasks of its ``(M, N)`` expert shape; 0 for element-wise parameters."""
    ns_peak = peak_flops(hw, setup.ns_dtype)
    ns_time = np.zeros(len(plan.params))
    for i, p in enumerate(plan.params):
        if p.spec.kind in _MATRIX_KINDS and matrix_opt != "adamw":
            shp = p.spec.shape if p.spec.kind == "matrix" else p.spec.task_shape
            fl = FLOPS_PER_MAC * matrix_flops(matrix_opt, shp)
            one = fl / (ns_peak * ns_efficiency(hw, shp)) + MATRIX_ELEMENTWISE_BYTES * math.prod(shp) / hw.hbm_bytes_per_s
            ns_time[i] = one if p.spec.kind == "matrix" else p.spec.n_tasks * one
    return ns_time


def _add_elementwise(ew_rank: np.ndarray, params: Sequence[Any], matrix: np.ndarray, adamw_local: np.ndarray, hbm: float) -> None:
    """Add each DP rank's element-wise update time to ``ew_rank``: a parameter owned whole goes to
    its owner, one cut across ranks (zero1-style ranges) to every rank by its share; parameters
    flagged in ``matrix`` are the matrix optimizer's."""
    for i, p in enumerate(params):
        if matrix[i]:
            continue
        if p.dp_owner is not None:
            ew_rank[p.dp_owner] += adamw_local[i]
        else:
            for r, s0, s1 in p.dp_ranges:
                ew_rank[r] += ADAMW_BYTES_PER_ELEMENT * (s1 - s0) / hbm


def _add_ungrouped_matrices(mat_rank: np.ndarray, tpc_rank: np.ndarray, params: Sequence[Any], which: np.ndarray, ns_time: np.ndarray, sync_ag: np.ndarray) -> None:
    """Matrices handled without micro-groups, on their owner: replicated ones (every TP rank updates
    its replica), TP-split ones under the sync schedule (all-gather, redundant compute), and expert
    stacks (an owner's whole stack, or, for a stack cut between experts, each rank its ranges' experts)."""
    for i in which.tolist():
        p = params[i]
        if p.dp_owner is not None:
            mat_rank[p.dp_owner] += ns_time[i]
            tpc_rank[p.dp_owner] += sync_ag[i]
        else:
            for r, s0, s1 in p.dp_ranges:
                mat_rank[r] += ns_time[i] * (s1 - s0) / p.spec.local_numel


def _step_loads(plan: Plan, hw: HardwareProfile, setup: Setup, matrix_opt: str, dp_link: Link, tp_link: Link) -> _StepLoads:
    """The optimizer step of every DP rank: equal chunks of AdamW (element-wise-only strategies),
    everything on every rank (``sc``), or each rank's owned parameters plus its TP micro-group
    pipeline (Section 4); the layerwise baseline adds one broadcast per parameter afterwards."""
    dp, tp = plan.inputs.dp, plan.inputs.tp
    hbm = hw.hbm_bytes_per_s
    params = plan.params
    n = len(params)
    ew_rank = np.zeros(dp)
    mat_rank = np.zeros(dp)
    tpc_rank = np.zeros(dp)
    if plan.strategy.elementwise_only:
        # every element of the rank's equal chunk gets AdamW
        owned = np.zeros(dp)
        for b in plan.buckets:
            owned += np.array(b.shard_sizes(), dtype=np.float64)
        ew_rank = ADAMW_BYTES_PER_ELEMENT * owned / hbm
        return _StepLoads(ew_rank, mat_rank, tpc_rank, ew_rank.copy(), 0.0, 0)
    local_numel = np.array([p.spec.local_numel for p in params], dtype=np.float64)
    is_matrix = np.array([p.spec.kind in _MATRIX_KINDS for p in params])
    tp_split = np.array([p.spec.tp_split for p in params])
    ns_time = _matrix_times(plan, hw, setup, matrix_opt)
    adamw_local = ADAMW_BYTES_PER_ELEMENT * local_numel / hbm  # element-wise update of the local shard
    # per-parameter TP all-gather of the gradient (sync schedule)
    sync_ag = np.array([all_gather_time(tp_link, tp, local_numel[i] * tp * setup.grad_bytes)
                        if is_matrix[i] and tp_split[i] and matrix_opt != "adamw" else 0.0 for i in range(n)])
    if plan.every_rank_updates:
        # every DP rank all-reduced the gradients and updates everything, every TP rank the full matrix
        e = float(adamw_local[~is_matrix].sum())
        m = float(ns_time[is_matrix].sum())
        c = float(sync_ag.sum())
        ew_rank[:] = e
        mat_rank[:] = m
        tpc_rank[:] = c
        return _StepLoads(ew_rank, mat_rank, tpc_rank, np.full(dp, e + m + c), 0.0, 0)
    total_rank = np.zeros(dp)
    _add_elementwise(ew_rank, params, is_matrix & (matrix_opt != "adamw"), adamw_local, hbm)
    grouped = np.array([p.tp_host is not None for p in params])
    _add_ungrouped_matrices(mat_rank, tpc_rank, params, np.flatnonzero(is_matrix & ~grouped & (matrix_opt != "adamw")), ns_time, sync_ag)
    apply_local = APPLY_BYTES_PER_ELEMENT * local_numel / hbm
    index = {p.name: i for i, p in enumerate(params)}
    n_groups = 0
    for r in range(dp):
        groups = plan.micro_groups[r] if plan.micro_groups else ()
        n_groups += len(groups)
        pipe, comm, comp = _tp_pipeline(groups, index, params, ns_time, apply_local, tp, tp_link, setup, ew_rank[r] + mat_rank[r] + tpc_rank[r])
        tpc_rank[r] += comm
        mat_rank[r] += comp
        total_rank[r] = pipe
    dp_comm = 0.0
    if plan.param_return == "broadcast":
        # Megatron LayerWiseDistributedOptimizer.broadcast_params: after the step, a loop of one
        # broadcast per parameter from its owner (bf16 model weights), serialized.
        dp_comm = float(sum(broadcast_time(dp_link, dp, ln * setup.param_bytes) for ln in local_numel))
    return _StepLoads(ew_rank, mat_rank, tpc_rank, total_rank, dp_comm, n_groups)


def simulate_plan(
    plan: Plan, cfg: ModelConfig, hw: HardwareProfile, setup: Setup = Setup(), *, whole_model: bool = True
) -> StepBreakdown:
    """Predict one iteration of ``plan`` (see the module docstring for the model): the
    forward-backward span (:func:`_fwd_bwd`) plus the optimizer step of the slowest DP rank
    (:func:`_step_loads`).

    ``whole_model=False``: ``plan`` holds one pipeline stage; its forward work is that of its own
    parameters (their matmuls and their layers' attention) and its TP activation collectives those
    of its own layers (see :func:`simulate_pipeline`).
    """
    inp = plan.inputs
    dp, tp, strategy, opt = inp.dp, inp.tp, inp.strategy, inp.optimizer
    elementwise_only = plan.strategy.elementwise_only
    if elementwise_only and opt != ELEMENTWISE_DEFAULT:
        raise ValueError(
            f"{strategy} equal-chunk partitioning is exact only for element-wise optimizers; simulate it with optimizer {ELEMENTWISE_DEFAULT}"
        )
    dp_link, tp_link = _links(hw, dp, tp)
    fb = _fwd_bwd(plan, cfg, hw, setup, dp_link, tp_link, whole_model)
    matrix_opt = ELEMENTWISE_DEFAULT if elementwise_only else opt
    step = _step_loads(plan, hw, setup, matrix_opt, dp_link, tp_link)
    mem = _memory_bytes(plan, matrix_opt, setup) / 1e9
    total_rank = step.total
    crit = int(np.argmax(total_rank))
    optimizer_s = float(total_rank[crit]) + step.dp_comm
    mean = float(total_rank.mean())
    ga = setup.grad_accum
    return StepBreakdown(
        strategy=strategy,
        optimizer=matrix_opt,
        dp=dp,
        tp=tp,
        alpha=float(inp.alpha),
        fwd_bwd_s=float(fb.total),
        optimizer_s=optimizer_s,
        iteration_s=float(fb.total) + optimizer_s,
        fwd_compute_s=ga * fb.t_fwd,
        bwd_compute_s=ga * fb.t_bwd,
        tp_activation_comm_s=ga * (fb.t_tp_fwd + fb.t_tp_bwd),
        dp_grad_comm_s=float(sum(fb.grad_comm)),
        dp_grad_exposed_s=float(fb.grad_exposed),
        dp_param_comm_s=float(sum(fb.param_comm)),
        dp_param_exposed_s=float(fb.param_exposed),
        opt_elementwise_s=float(step.elementwise[crit]),
        opt_matrix_compute_s=float(step.matrix[crit]),
        opt_tp_comm_s=float(step.tp_comm[crit]),
        opt_dp_comm_s=step.dp_comm,
        opt_critical_rank=crit,
        opt_rank_mean_s=mean,
        opt_rank_imbalance=float(total_rank[crit] / mean) if mean > 0 else 1.0,
        memory_gb=mem,
        memory_fits=bool(mem <= hw.hbm_gb.value),
        n_buckets=len(plan.buckets),
        n_micro_groups=step.n_groups,
        per_rank_optimizer_s=tuple(float(x) for x in total_rank),
    )


def _memory_bytes(plan: Plan, opt: str, setup: Setup) -> float:
    """Model-state bytes on the most loaded GPU (activations excluded): bf16 weights and the fp32
    gradient buffer of the whole TP shard, plus fp32 master weights and optimizer state of what the
    GPU updates -- its DP-owned element-wise shards, its replicated matrices, the full-shape state
    of matrices it hosts (or, under the sync schedule, of every owned matrix: each TP rank keeps
    the full state), everything for ``sc``."""
    inp = plan.inputs
    dp, tp = inp.dp, inp.tp
    base = sum(p.spec.local_numel for p in plan.params) * (setup.param_bytes + setup.grad_bytes)
    per = np.zeros((dp, tp))
    for p in plan.params:
        sp = p.spec
        matrix = sp.kind in _MATRIX_KINDS and opt != "adamw"
        if matrix:
            # full-shape optimizer state where the whole update is computed (E expert tasks of a
            # stack); fp32 master of the shard
            state = state_bytes(opt, sp.shape) if sp.kind == "matrix" else sp.n_tasks * state_bytes(opt, sp.task_shape)
            full = state + 4 * sp.local_numel
            if p.tp_host is not None:
                cell = np.zeros(tp)
                cell[p.tp_host] = full
            else:
                cell = np.full(tp, float(full))
        else:
            cell = np.full(tp, float(state_bytes("adamw", sp.local_shape) + 4 * sp.local_numel))
        if p.replicated:
            per += cell
        elif p.dp_owner is not None:
            per[p.dp_owner] += cell
        else:
            for r, s0, s1 in p.dp_ranges:
                per[r] += cell * (s1 - s0) / sp.local_numel
    return float(base + per.max())


def _tp_pipeline(groups, index, params, ns_time, apply_local, tp, tp_link, setup, local_work):
    """One DP rank's optimizer step with TP micro-groups (Section 4.1), on ``tp`` GPUs.

    Per group k: fused all-to-all of gradient shards to the hosts (G_k), each host computes its
    tasks (C_k,h on host h's compute stream), fused all-to-all of updated shards back (S_k, a
    collective: it starts when every host has finished group k), apply on every rank (A_k,t).
    Communication runs on one FIFO stream shared by the TP group (collectives synchronize it);
    each TP rank has its own FIFO compute stream that starts with the rank's local work.

    ``tp_overlap``: ``pipelined`` issues gathers one group ahead (G0, G1, S0, G2, S1, ...);
    ``free`` issues every gather first, then every scatter (hosts run free, per-host totals
    matter); ``serial`` runs G_k, C_k, S_k, A_k back to back (per-group makespans add up).
    Returns (makespan, communication busy time, host compute on the slowest host).
    """
    if not groups:
        return local_work, 0.0, 0.0
    gath, scat, host_c, appl = _group_costs(groups, index, params, ns_time, apply_local, tp, tp_link, setup)
    k = len(groups)
    comm_busy = sum(gath) + sum(scat)
    host_total = max(sum(c[t] for c in host_c) for t in range(tp))
    if setup.tp_overlap == "serial":
        total = local_work + sum(gath[j] + max(host_c[j]) + scat[j] + appl[j] for j in range(k))
        return total, comm_busy, host_total
    total, _ = list_schedule(_group_ops(gath, scat, host_c, appl, tp, local_work, setup.tp_overlap))
    return total, comm_busy, host_total


def _group_costs(groups, index, params, ns_time, apply_local, tp, tp_link, setup):
    """Per micro-group: the gather and scatter times (fused all-to-alls of the TP-local shards,
    the scatter the gather's flows reversed), each TP rank's host compute, and the apply time."""
    gath, scat, host_c, appl = [], [], [], []
    for g in groups:
        send = [0.0] * tp
        recv = [0.0] * tp
        host_t = [0.0] * tp
        a = 0.0
        for name, h in zip(g.params, g.hosts):
            base, expert = split_task_name(name)
            i = index[base]
            share = 1 if expert is None else params[i].spec.shape[0]  # one expert of a TP-split stack
            ln = params[i].spec.local_numel // share
            for t in range(tp):
                if t != h:
                    send[t] += ln
            recv[h] += ln * (tp - 1)
            host_t[h] += ns_time[i] / share
            a += apply_local[i] / share
        gath.append(all_to_all_time(tp_link, [x * setup.grad_bytes for x in send], [x * setup.grad_bytes for x in recv]))
        # the scatter reverses the flows: hosts send (tp - 1) shards, everyone receives its own
        scat.append(all_to_all_time(tp_link, [x * setup.update_bytes for x in recv], [x * setup.update_bytes for x in send]))
        host_c.append(host_t)
        appl.append(a)
    return gath, scat, host_c, appl


def _group_ops(gath, scat, host_c, appl, tp, local_work, overlap) -> list[Op]:
    """The operations of the micro-group pipeline on one comm stream and ``tp`` compute streams, in
    issue order: ``free`` every gather first, then every scatter; ``pipelined`` gathers one group ahead."""
    k = len(gath)
    ops: list[Op] = [Op(f"L{t}", f"gpu{t}", local_work) for t in range(tp)]

    def gather(j: int) -> None:
        ops.append(Op(f"G{j}", "comm", gath[j]))

    def compute(j: int) -> None:
        ops.extend(Op(f"C{j}.{t}", f"gpu{t}", host_c[j][t], (f"G{j}",)) for t in range(tp))

    def scatter(j: int) -> None:
        ops.append(Op(f"S{j}", "comm", scat[j], tuple(f"C{j}.{t}" for t in range(tp))))

    def apply(j: int) -> None:
        ops.extend(Op(f"A{j}.{t}", f"gpu{t}", appl[j], (f"S{j}",)) for t in range(tp))

    if overlap == "free":
        for j in range(k):
            gather(j)
            compute(j)
        for j in range(k):
            scatter(j)
            apply(j)
    else:  # pipelined, one group ahead
        gather(0)
        for j in range(k):
            if j + 1 < k:
                gather(j + 1)
            compute(j)
            if j >= 1:
                apply(j - 1)
            scatter(j)
        apply(k - 1)
    return ops


# --------------------------------------------------------------------------- front door
def plan_for(
    model: str | ModelConfig,
    strategy: str,
    *,
    dp: int,
    tp: int,
    optimizer: str = "muon",
    alpha: float = 1.0,
    **plan_kwargs: Any,
) -> Plan:
    """The plan the simulator uses for ``strategy`` (zero1 with AdamW, the reference), with the
    planner's warnings (oversized micro-group tasks) silenced: they are expected at scale."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return plan_model(
            model,
            dp=dp,
            tp=tp,
            optimizer=ELEMENTWISE_DEFAULT if get_strategy(strategy).elementwise_only else optimizer,
            strategy=strategy,
            alpha=alpha,
            **plan_kwargs,
        )


def simulate(
    model: str | ModelConfig,
    *,
    dp: int,
    tp: int,
    optimizer: str,
    hardware: HardwareProfile,
    strategies: Sequence[str] = SIM_STRATEGIES,
    setup: Setup = Setup(),
    alpha: float = 1.0,
    plans: Mapping[str, Plan] | None = None,
    **plan_kwargs: Any,
) -> dict[str, StepBreakdown]:
    """Predict one iteration per strategy. ``plans`` reuses already built plans (by strategy)."""
    cfg = resolve_sim_model(model)
    records = [get_strategy(s) for s in strategies]  # PlanError (a ValueError) for an unknown name
    if not get_optimizer(optimizer).matrix and any(not r.elementwise_only for r in records):
        matrix = ", ".join(optimizer_names(matrix=True))
        raise ValueError(
            f"optimizer {optimizer} needs no matrix strategies; use {matrix} (element-wise-only strategies always run {ELEMENTWISE_DEFAULT})"
        )
    out: dict[str, StepBreakdown] = {}
    for s in strategies:
        plan = plans[s] if plans and s in plans else plan_for(cfg, s, dp=dp, tp=tp, optimizer=optimizer, alpha=alpha, **plan_kwargs)
        out[s] = simulate_plan(plan, cfg, hardware, setup)
    return out


# --------------------------------------------------------------------------- pipeline stages
@dataclass(frozen=True, slots=True)
class PipelineBreakdown:
    """One iteration of a pipeline-parallel run (1F1B), per stage and for the whole pipeline.

    ``stages[s]`` is stage s simulated on its own for one micro-batch (its optimizer step is the
    stage's real step). ``fwd_bwd_s`` = 1F1B span + the worst stage's exposed DP communication;
    ``optimizer_s`` = the slowest stage's step (stages step in parallel); ``bubble_s`` the part of
    the span that is pipeline fill and drain rather than steady state.
    """

    pp: int
    microbatches: int
    stages: tuple[StepBreakdown, ...]
    fwd_bwd_s: float
    optimizer_s: float
    iteration_s: float
    bubble_s: float
    p2p_s: float
    critical_stage: int

    def summary(self) -> dict[str, Any]:
        return {
            "pp": self.pp, "microbatches": self.microbatches, "fwd_bwd_s": self.fwd_bwd_s,
            "optimizer_s": self.optimizer_s, "iteration_s": self.iteration_s, "bubble_s": self.bubble_s,
            "p2p_s": self.p2p_s, "critical_stage": self.critical_stage,
            "stages": [{"fwd_bwd_one_microbatch_s": b.fwd_bwd_s, "optimizer_s": b.optimizer_s} for b in self.stages],
        }


def simulate_pipeline(
    stages: Sequence[Plan], cfg: ModelConfig, hw: HardwareProfile, setup: Setup = Setup(), *,
    microbatches: int | None = None,
) -> PipelineBreakdown:
    """Predict one iteration of a pipeline of ``stages`` (one plan each, from
    :func:`canzona.plan.pipeline.plan_stages`) under Megatron's 1F1B schedule.

    Per stage s and micro-batch: c_s = forward + backward compute + TP activation collectives of
    its layers. With m micro-batches and p stages, 1F1B's span is the standard estimate

        span = sum_s c_s + (m - 1) * max_s c_s + 2 (p - 1) * p2p

    (fill and drain cross every stage once, the steady state runs at the slowest stage's pace,
    each stage boundary costs one activation send forward and one gradient send backward on the
    critical path), so the bubble is ``sum_s c_s - max_s c_s`` plus the sends. The DP gradient
    reduce-scatter of a stage overlaps only its last micro-batch's backward and the parameter
    all-gather its first forward: the worst stage's exposed part is added. ``microbatches``
    defaults to ``setup.grad_accum`` when that is above 1, else to ``p`` (assumption: the fewest
    micro-batches that fill 1F1B; the paper does not state its micro-batch count).
    """
    stages = list(stages)
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    p = len(stages)
    m = microbatches if microbatches is not None else (setup.grad_accum if setup.grad_accum > 1 else p)
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {m!r}")
    one = replace(setup, grad_accum=1)
    whole = p == 1
    per = tuple(simulate_plan(st, cfg, hw, one, whole_model=whole) for st in stages)
    c = [b.fwd_compute_s + b.bwd_compute_s + b.tp_activation_comm_s for b in per]
    tp = stages[0].inputs.tp
    # the activation crossing a stage boundary: [tokens, hidden] in bf16, split by TP under sequence
    # parallelism; stages sit on different nodes (TP fills a node), so it crosses the network
    act = setup.seq_len * setup.micro_batch * cfg.hidden_size * setup.act_bytes / (tp if setup.sequence_parallel else 1)
    net = Link("network", hw.net_bytes_per_s, hw.net_alpha_us.value * 1e-6, hw.collective_launch_us.value * 1e-6)
    p2p = (net.launch + net.alpha + act / net.bandwidth) if p > 1 else 0.0
    span = sum(c) + (m - 1) * max(c) + 2 * (p - 1) * p2p
    exposed = max(b.dp_grad_exposed_s + b.dp_param_exposed_s for b in per)
    fwd_bwd = span + exposed
    opt = [b.optimizer_s for b in per]
    crit = max(range(p), key=lambda i: (opt[i], -i))
    return PipelineBreakdown(
        pp=p, microbatches=m, stages=per, fwd_bwd_s=fwd_bwd, optimizer_s=opt[crit], iteration_s=fwd_bwd + opt[crit],
        bubble_s=sum(c) - max(c) + 2 * (p - 1) * p2p, p2p_s=p2p, critical_stage=crit,
    )
