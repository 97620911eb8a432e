"""Cluster-scale prediction of the FSDP2 optimizer step (``canzona simulate --fsdp N``).

Models one optimizer step of :mod:`canzona.runtime.shard` for an :class:`~canzona.plan.fsdp.FSDPPlan`
on a hardware profile, with the cost constants of :mod:`canzona.sim.model`:

* element-wise parameters: AdamW on each rank's own piece (memory-bound, no communication);
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
from canzona.plan.fsdp import FSDPPlan, piece_numels
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


def simulate_fsdp(plan: FSDPPlan, hw: HardwareProfile, setup: Setup = Setup(tp_overlap="pipelined")) -> FSDPStepPrediction:
    """Predict one optimizer step of ``plan`` (see the module docstring)."""
    inp = plan.inputs
    n = inp.group_size
    link = _link(hw, n)
    hbm = hw.hbm_bytes_per_s
    ns_peak = peak_flops(hw, setup.ns_dtype)
    params = plan.params
    index = {p.name: i for i, p in enumerate(params)}
    ns_time = np.zeros(len(params))
    for i, p in enumerate(params):
        if p.kind == "matrix":
            fl = FLOPS_PER_MAC * matrix_flops(inp.optimizer, p.shape)
            ns_time[i] = fl / (ns_peak * ns_efficiency(hw, p.shape)) + MATRIX_ELEMENTWISE_BYTES * math.prod(p.shape) / hbm
    piece = np.array([p.numel / n for p in params])
    apply_local = APPLY_BYTES_PER_ELEMENT * piece / hbm
    ew = np.zeros(n)
    for p in params:
        if p.kind != "matrix":
            ew += ADAMW_BYTES_PER_ELEMENT * np.array(piece_numels(p.shape, p.tp_dim, inp.dp_shard, inp.tp), dtype=np.float64) / hbm
    local_work = float(ew.max())
    if inp.schedule == "sync":
        gathers = [sum(all_gather_time(link, n, params[index[m]].numel * setup.grad_bytes) for m in g.names) for g in plan.groups]
        computes = [float(sum(ns_time[index[m]] for m in g.names)) for g in plan.groups]
        # gather k+1 overlaps compute k; the first gather is exposed
        total = local_work + (gathers[0] if gathers else 0.0)
        for k in range(len(plan.groups)):
            total += max(computes[k], gathers[k + 1] if k + 1 < len(gathers) else 0.0)
        per_rank = np.full(n, total) - local_work + ew
        comm, comp = float(sum(gathers)), float(sum(computes))
    else:
        groups = [SimpleNamespace(params=g.names, hosts=g.hosts) for g in plan.groups]
        shim = [SimpleNamespace(spec=SimpleNamespace(local_numel=float(x))) for x in piece]
        total, comm, comp = _tp_pipeline(groups, index, shim, ns_time, apply_local, n, link, setup, local_work)
        # per-rank view: element-wise work plus the matrix tasks the rank hosts and applies
        per_rank = ew.copy()
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
        n_micro_groups=len(plan.groups),
        per_rank_s=tuple(float(x) for x in per_rank),
    )
