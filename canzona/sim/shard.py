"""Cluster-scale prediction of the FSDP2 optimizer step (``canzona simulate --fsdp N``).

Models one optimizer step of :mod:`canzona.runtime.shard` for an FSDP2 :class:`~canzona.plan.plan.Plan`
(``inputs.layout_kind == "fsdp2"``) on a hardware profile, with the cost constants of :mod:`canzona.sim.model`:

* element-wise parameters: AdamW on each rank's own piece (memory-bound, no communication);
* expert stacks: E tasks of ``(M, N)``; each rank runs the optimizer on the whole experts of its
  dim-0 chunk, where FSDP2 leaves them (no communication);
* matrix tasks (``lb-asc``, ``asc``, ``no-fuse``): the micro-group pipeline of the TP engine
  (:func:`canzona.sim.model._tp_pipeline`) over the whole shard group (``dp_shard x tp`` ranks):
  a fused all-to-all of gradient pieces to the hosts per group, host compute (Newton-Schulz or
  eigendecompositions on the full shape), a fused all-to-all of values back, apply; gathers one
  group ahead (``pipelined``, what the runtime does) unless ``setup.tp_overlap`` says otherwise.
  Pieces are taken as ``numel / group`` per rank (FSDP2's padding is ignored);
* ``sc``: every rank all-gathers every full gradient (chunked like the plan's groups, the next
  gather overlapping the current compute) and computes every update.

The shard group's link is NVLink when it fits in one node, the network otherwise. FSDP2's own
forward/backward collectives are outside this model (they are the same for every strategy).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from canzona.cost import matrix_flops
from canzona.plan.plan import Plan
from canzona.plan.shard import chunk_sizes, piece_numels
from canzona.sim.comm import Link, all_gather_time
from canzona.sim.hardware import FLOPS_PER_MAC, HardwareProfile, ns_efficiency, peak_flops
from canzona.sim.model import (
    ADAMW_BYTES_PER_ELEMENT,
    APPLY_BYTES_PER_ELEMENT,
    MATRIX_ELEMENTWISE_BYTES,
    Setup,
    _tp_pipeline,
)

__all__ = ["FSDPStepPrediction", "simulate_fsdp"]


@dataclass(frozen=True, slots=True)
class FSDPStepPrediction:
    """Predicted FSDP2 optimizer step (seconds) of one strategy, slowest rank and mean."""

    strategy: str
    optimizer: str
    ranks: int
    group_size: int
    link: str
    optimizer_s: float
    rank_mean_s: float
    rank_imbalance: float
    host_compute_max_s: float
    exchange_s: float
    elementwise_s: float
    n_micro_groups: int
    per_rank_s: tuple[float, ...] = field(repr=False, default=())

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("per_rank_s")
        return d


def _link(hw: HardwareProfile, n: int) -> Link:
    launch = hw.collective_launch_us.value * 1e-6
    if n <= int(hw.gpus_per_node.value):
        return Link("nvlink", hw.nvlink_bytes_per_s, hw.nvlink_alpha_us.value * 1e-6, launch)
    return Link("network", hw.net_bytes_per_s, hw.net_alpha_us.value * 1e-6, launch)


def _ns_seconds(hw: HardwareProfile, setup: Setup, optimizer: str, shape: tuple[int, ...]) -> float:
    """One matrix task's host compute: the optimizer's products at the matmul efficiency of its
    shape, plus its element-wise passes over HBM."""
    fl = FLOPS_PER_MAC * matrix_flops(optimizer, shape)
    return fl / (peak_flops(hw, setup.ns_dtype) * ns_efficiency(hw, shape)) + MATRIX_ELEMENTWISE_BYTES * math.prod(shape) / hw.hbm_bytes_per_s


def _local_work(plan: Plan, hw: HardwareProfile, setup: Setup) -> np.ndarray:
    """Per shard-group rank, the work done where the pieces lie: AdamW on the element-wise pieces
    and the optimizer on the rank's own whole experts."""
    inp = plan.inputs
    out = np.zeros(inp.group_size)
    for p in plan.params:
        s = p.spec
        if s.kind == "elementwise":
            out += ADAMW_BYTES_PER_ELEMENT * np.array(piece_numels(s.shape, s.tp_dim, inp.dp_shard, inp.tp), dtype=np.float64) / hw.hbm_bytes_per_s
        elif s.kind == "experts":
            one = _ns_seconds(hw, setup, inp.optimizer, s.task_shape)
            out += np.repeat(np.array(chunk_sizes(s.shape[0], inp.dp_shard), dtype=np.float64) * one, inp.tp)
    return out


def simulate_fsdp(plan: Plan, hw: HardwareProfile, setup: Setup = Setup(tp_overlap="pipelined")) -> FSDPStepPrediction:
    """Predict one optimizer step of the FSDP2 ``plan`` (see the module docstring)."""
    inp = plan.inputs
    if inp.layout_kind != "fsdp2":
        raise ValueError("simulate_fsdp predicts FSDP2 plans (layout_kind 'fsdp2'); canzona.sim.model simulates ZeRO-1 plans")
    n = inp.group_size
    link = _link(hw, n)
    params = plan.params
    groups = plan.micro_groups[0]
    index = {p.name: i for i, p in enumerate(params)}
    ns_time = np.array([_ns_seconds(hw, setup, inp.optimizer, p.spec.shape) if p.spec.kind == "matrix" else 0.0 for p in params])
    piece = np.array([p.spec.numel / n for p in params])
    apply_local = APPLY_BYTES_PER_ELEMENT * piece / hw.hbm_bytes_per_s
    local = _local_work(plan, hw, setup)
    local_work = float(local.max())
    if inp.tp_schedule == "sync":
        gathers = [sum(all_gather_time(link, n, params[index[m]].spec.numel * setup.grad_bytes) for m in g.params) for g in groups]
        computes = [float(sum(ns_time[index[m]] for m in g.params)) for g in groups]
        # gather k+1 overlaps compute k; the first gather is exposed
        total = local_work + (gathers[0] if gathers else 0.0)
        for k in range(len(groups)):
            total += max(computes[k], gathers[k + 1] if k + 1 < len(gathers) else 0.0)
        per_rank = np.full(n, total) - local_work + local
        comm, comp = float(sum(gathers)), float(sum(computes))
    else:
        shim = [SimpleNamespace(spec=SimpleNamespace(local_numel=float(x))) for x in piece]
        total, comm, comp = _tp_pipeline(groups, index, shim, ns_time, apply_local, n, link, setup, local_work)
        # per-rank view: local work plus the matrix tasks the rank hosts and applies
        per_rank = local.copy()
        hosts = plan.hosts()
        for name, h in hosts.items():
            per_rank[h] += ns_time[index[name]]
        per_rank += float(sum(apply_local[index[m]] for m in hosts))
    mean = float(np.mean(per_rank))
    return FSDPStepPrediction(
        strategy=inp.strategy,
        optimizer=inp.optimizer,
        ranks=inp.world,
        group_size=n,
        link=link.name,
        optimizer_s=float(total),
        rank_mean_s=mean,
        rank_imbalance=float(per_rank.max() / mean) if mean > 0 else 1.0,
        host_compute_max_s=float(comp),
        exchange_s=float(comm),
        elementwise_s=local_work,
        n_micro_groups=len(groups),
        per_rank_s=tuple(float(x) for x in per_rank),
    )
