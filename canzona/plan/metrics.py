"""Balance metrics of a plan (Section 3.2 objectives and the R_LB ratios of Figure 3).

* ``R_LB = max_r L_r / mean_r L_r`` of per-DP-rank loads, for optimizer-state memory and FLOPs
  (loads are per TP rank on average, see :func:`canzona.cost.param_flops`);
* TP ratios: per-host cumulative loads (over all micro-groups) inside the TP group of the worst
  DP rank, the one whose busiest host is busiest (max / mean over its ``tp`` hosts); details also
  carry the ratio over all ``dp * tp`` hosts (``tp_*_ratio_global``) and the mean over DP ranks of
  each group's ratio (``tp_*_ratio_mean``), since the paper does not say which one Figure 3b shows;
* ``J_DP = max_r |L_r - mu|`` in the planning cost's units, ``J_Comm = sum_i sum_r |S_ir - |B_i|/R|``
  in elements (zero for all-reduce strategies, which have no shards);
* details: per-rank loads, per-bucket communication balance (max shard / mean shard), the
  numel ratios (the paper's memory proxy: "memory cost is strictly proportional to numel") and
  TP makespans: the sum over groups of the busiest host (groups synchronised by their
  all-to-all) and the busiest host's total (exchanges issued ahead, hosts run free).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from canzona.plan.buckets import BufferLayout
from canzona.plan.plan import Metrics
from canzona.plan.tp import Group

__all__ = ["LoadVectors", "ratio", "dp_loads", "tp_host_loads", "compute_metrics"]


@dataclass(frozen=True, slots=True, eq=False)
class LoadVectors:
    """Per-parameter loads in buffer order: the planning cost and the three measured quantities."""

    cost: np.ndarray
    flops: np.ndarray
    memory: np.ndarray
    numel: np.ndarray


def ratio(loads: Sequence[float] | np.ndarray) -> float:
    """max / mean, 1.0 for an all-zero vector (nothing to balance)."""
    a = np.asarray(loads, dtype=np.float64)
    mean = float(a.mean()) if a.size else 0.0
    return float(a.max()) / mean if mean > 0 else 1.0


def dp_loads(
    values: np.ndarray,
    owner: np.ndarray,
    ranges: Mapping[int, tuple[tuple[int, int, int], ...]],
    numel: np.ndarray,
    dp: int,
    everyone: bool = False,
) -> np.ndarray:
    """Per-DP-rank sum of ``values``; a cut parameter contributes in proportion to its elements;
    ``everyone`` (sc) gives every rank the total."""
    if everyone:
        return np.full(dp, float(values.sum()))
    whole = owner >= 0
    out = np.bincount(owner[whole], weights=values[whole], minlength=dp).astype(np.float64)
    for i, rs in ranges.items():
        for r, s, e in rs:
            out[r] += values[i] * (e - s) / numel[i]
    return out


def tp_host_loads(
    dp_load: float,
    groups: Sequence[Group],
    task_avg: Mapping[str, float],
    task_full: Mapping[str, float],
    tp: int,
    sync_tasks: Sequence[str] = (),
) -> np.ndarray:
    """Cumulative per-host load of one DP rank's TP group.

    The rank's DP load counts each task at its per-rank average (``task_avg``); every host keeps
    that load minus the tasks (element-wise and replicated work, done on every TP rank) and adds
    the full cost (``task_full``) of the tasks it hosts. ``sync_tasks``: tasks every host recomputes.
    """
    names = [n for g in groups for n in g.names] + list(sync_tasks)
    shared = dp_load - sum(task_avg[n] for n in names)
    host = np.full(tp, shared, dtype=np.float64)
    for g in groups:
        for n, h in zip(g.names, g.hosts):
            host[h] += task_full[n]
    if sync_tasks:
        host += sum(task_full[n] for n in sync_tasks)
    return host


def _worst_group(hosts: Sequence[np.ndarray]) -> tuple[int, float]:
    """(DP rank whose TP group has the busiest host, that group's max/mean)."""
    if not hosts:
        return 0, 1.0
    worst = max(range(len(hosts)), key=lambda r: (float(hosts[r].max()), -r))
    return worst, ratio(hosts[worst])


def _comm_balance(layout: BufferLayout, cuts: Sequence[Sequence[int]], dp: int) -> tuple[float, list[float]]:
    """J_Comm (Section 3.2: total deviation of the reduce-scatter shard sizes from equal shares, in
    elements) and, per cut bucket, its largest shard over the equal share."""
    j_comm = 0.0
    comm_balance: list[float] = []
    for b, c in enumerate(cuts):
        if not c:
            continue
        s = np.diff(np.asarray(c, dtype=np.int64)).astype(np.float64)
        ideal = float(layout.bucket_numel[b]) / dp
        j_comm += float(np.abs(s - ideal).sum())
        comm_balance.append(float(s.max()) / ideal)
    return j_comm, comm_balance


def _tp_host_loads(
    per_rank: Mapping[str, np.ndarray],
    dp: int,
    tp: int,
    groups: Sequence[Sequence[Group]],
    sync_tasks: Sequence[Sequence[str]],
    task_avg: Mapping[str, tuple[float, float, float]],
    task_full: Mapping[str, tuple[float, float, float]],
) -> dict[str, list[np.ndarray]]:
    """Per measure (flops, memory, numel), per DP rank: the load of each of its TP ranks (empty
    lists without TP tasks)."""
    hosts: dict[str, list[np.ndarray]] = {"flops": [], "memory": [], "numel": []}
    if not (tp > 1 and (any(groups) or any(sync_tasks))):
        return hosts
    for j, key in enumerate(("flops", "memory", "numel")):
        avg = {n: v[j] for n, v in task_avg.items()}
        full = {n: v[j] for n, v in task_full.items()}
        for r in range(dp):
            rank_groups = groups[r] if r < len(groups) else ()
            sync = sync_tasks[r] if r < len(sync_tasks) else ()
            hosts[key].append(tp_host_loads(float(per_rank[key][r]), rank_groups, avg, full, tp, sync))
    return hosts


def _tp_spread(hosts: Mapping[str, list[np.ndarray]]) -> dict[str, float]:
    """Over all GPUs (``_global``) and averaged over TP groups (``_mean``), per measure."""
    spread: dict[str, float] = {}
    for key, hs in hosts.items():
        if hs:
            spread[f"tp_{key}_ratio_global"] = ratio(np.concatenate(hs))
            spread[f"tp_{key}_ratio_mean"] = float(np.mean([ratio(h) for h in hs]))
    return spread


def _makespans(groups: Sequence[Sequence[Group]]) -> tuple[float, float, int]:
    """(worst DP rank's sum over groups of the busiest host, worst DP rank's busiest host total,
    number of micro-groups): the two readings of a schedule's length, in the planning cost."""
    group_sum = 0.0
    host_max = 0.0
    n_groups = 0
    for gs in groups:
        n_groups += len(gs)
        if gs:
            group_sum = max(group_sum, sum(max(g.loads) for g in gs))
            tot = np.sum([g.loads for g in gs], axis=0)
            host_max = max(host_max, float(tot.max()))
    return group_sum, host_max, n_groups


def compute_metrics(
    *,
    layout: BufferLayout,
    cuts: Sequence[Sequence[int]],
    owner: np.ndarray,
    ranges: Mapping[int, tuple[tuple[int, int, int], ...]],
    loads: LoadVectors,
    dp: int,
    tp: int,
    everyone: bool,
    groups: Sequence[Sequence[Group]],
    sync_tasks: Sequence[Sequence[str]],
    task_avg: Mapping[str, tuple[float, float, float]],
    task_full: Mapping[str, tuple[float, float, float]],
    plan_seconds: float,
) -> Metrics:
    """All metrics of a plan. ``task_avg`` / ``task_full`` map a task name to its (flops, memory,
    numel) at per-rank average and at full (host) cost; ``groups[r]`` / ``sync_tasks[r]`` are DP
    rank r's micro-groups and recomputed-everywhere tasks."""
    per_rank = {
        k: dp_loads(getattr(loads, k), owner, ranges, loads.numel, dp, everyone) for k in ("cost", "flops", "memory", "numel")
    }
    mu = float(per_rank["cost"].mean())
    j_dp = float(np.max(np.abs(per_rank["cost"] - mu)))
    j_comm, comm_balance = _comm_balance(layout, cuts, dp)
    hosts = _tp_host_loads(per_rank, dp, tp, groups, sync_tasks, task_avg, task_full)
    spread = _tp_spread(hosts)
    wf, tp_flops = _worst_group(hosts["flops"])
    wm, tp_memory = _worst_group(hosts["memory"])
    _, tp_numel = _worst_group(hosts["numel"])
    group_sum, host_max, n_groups = _makespans(groups)

    details: dict[str, Any] = {
        "dp_numel_ratio": ratio(per_rank["numel"]),
        "tp_numel_ratio": tp_numel,
        "dp_cost_loads": per_rank["cost"].tolist(),
        "dp_flops_loads": per_rank["flops"].tolist(),
        "dp_memory_loads": per_rank["memory"].tolist(),
        "dp_numel_loads": per_rank["numel"].tolist(),
        "tp_worst_dp_rank_flops": wf,
        "tp_worst_dp_rank_memory": wm,
        "tp_host_flops_loads": hosts["flops"][wf].tolist() if hosts["flops"] else [],
        "tp_host_memory_loads": hosts["memory"][wm].tolist() if hosts["memory"] else [],
        **spread,
        "bucket_comm_balance": comm_balance,
        "max_bucket_comm_balance": max(comm_balance, default=1.0),
        "n_buckets": layout.n_buckets,
        "n_micro_groups": n_groups,
        "max_micro_groups_per_rank": max((len(g) for g in groups), default=0),
        "makespan_group_sum": group_sum,
        "makespan_host_total": host_max,
        "units": {
            "dp_cost_loads": "planning cost model",
            "dp_flops_loads": "flops per TP rank",
            "dp_memory_loads": "optimizer-state bytes per TP rank",
            "dp_numel_loads": "buffer elements",
            "j_dp": "planning cost model",
            "j_comm": "elements",
            "makespan_group_sum": "planning cost model, worst DP rank",
            "makespan_host_total": "planning cost model, worst DP rank",
        },
    }
    return Metrics(
        dp_memory_ratio=ratio(per_rank["memory"]),
        dp_flops_ratio=ratio(per_rank["flops"]),
        tp_memory_ratio=tp_memory,
        tp_flops_ratio=tp_flops,
        j_dp=j_dp,
        j_comm=j_comm,
        plan_seconds=plan_seconds,
        details=details,
    )
