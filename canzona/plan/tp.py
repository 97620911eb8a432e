"""TP micro-groups: which TP rank hosts each TP-split matrix update, batched how (Section 4).

Within one DP rank, every owned TP-split matrix parameter is a *task*: one host TP rank gathers
the full gradient (fused all-to-all), runs the optimizer on the full tensor with state it keeps
for good, and scatters the updated shards back (Section 4.1). Replicated parameters need no
task: their DP owner updates them on every TP rank, each rank holding the same replica. An
expert stack split over TP (rows or columns of every expert) is one task per expert, named
``stack[e]`` (:func:`canzona.specs.expert_task_name`), costed on that expert's ``(M, N)`` matrix
and scheduled like any other task; a stack replicated over TP needs none.

Schedules (``PlanInputs.tp_schedule``):

* ``lpt``         Algorithm 2 (with Algorithms 3 and 4 of Appendix D.3): global sort by
                  (cost desc, name asc); greedy packing with rollback; each candidate group is
                  checked by the MinHeapSolver, an LPT assignment starting from zero loads.
* ``lpt-carry``   canzona's variant: the same packing, but the solver breaks ties between
                  equally loaded hosts by the load they carry from earlier groups, so one-task
                  groups (tasks above C_max) no longer all land on host 0.
* ``round-robin`` the ASC baseline: tasks in name order, host = task index mod tp, groups packed
                  in that order under C_max.
* ``no-fuse``     the fusion ablation: exactly ``lpt``'s hosts and task order, but every task is
                  exchanged on its own (one group per task), so the ablation differs from the
                  fused schedule in fusion only (not in host placement).
* ``sync``        no groups: every TP rank all-gathers and recomputes every update (SC).

Capacity: C_max bounds the bytes of full gradient a host receives in one group
(``grad_bytes * numel`` per task, the all-to-all buffer, Section 4.2); loads are in the cost
model's units.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Task", "Group", "GROUP_SCHEDULES", "schedule_tasks", "min_heap_solver", "expert_tp_summary", "expert_hosts"]

GROUP_SCHEDULES: tuple[str, ...] = ("lpt", "lpt-carry", "round-robin", "no-fuse")


@dataclass(frozen=True, slots=True)
class Task:
    """One TP-split matrix update: ``cost`` in the cost model's units, ``nbytes`` of full gradient."""

    name: str
    cost: float
    nbytes: int


@dataclass(frozen=True, slots=True)
class Group:
    """A finished micro-group: tasks in scheduling order, their hosts, per-host loads."""

    names: tuple[str, ...]
    hosts: tuple[int, ...]
    loads: tuple[float, ...]


def min_heap_solver(costs: Sequence[float], tp: int) -> tuple[list[int], list[float]]:
    """Algorithm 4 (MinHeapSolver): LPT of ``costs`` onto ``tp`` hosts from zero loads.

    Items are taken in descending cost (stable, so equal costs keep the caller's order), each
    popped onto the least-loaded host of a heap of (load, rank): ties go to the lower rank.
    Returns (host per item in the given order, per-host loads). O(K log K + K log R).
    """
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    heap = [(0.0, r) for r in range(tp)]
    hosts = [0] * len(costs)
    for i in order:
        load, r = heap[0]
        heapq.heapreplace(heap, (load + costs[i], r))
        hosts[i] = r
    loads = [0.0] * tp
    for load, r in heap:
        loads[r] = load
    return hosts, loads


def _lpt(tasks: Sequence[Task], tp: int, cmax_bytes: int, carry: bool) -> list[Group]:
    """Algorithm 2 / 3: greedy packing with rollback.

    Tasks arrive in the global order (cost desc, name asc), so the solver's local sort of
    M_curr + {p} is M_curr's order followed by p, and LPT on it equals LPT on M_curr followed by
    placing p on the current heap minimum. The heap is therefore kept incrementally: each test
    costs O(log R) instead of re-solving the group (identical decisions; tests check it against
    a literal re-solve).
    """
    groups: list[Group] = []
    total = [0.0] * tp  # load carried across groups (lpt-carry tie-break, and reporting)

    def fresh() -> list[tuple[float, float, int]]:
        # (group load, carried load or 0, rank): Algorithm 4 starts every group from zero; the
        # carry variant only changes which of several equally loaded hosts is popped first
        heap = [(0.0, total[r] if carry else 0.0, r) for r in range(tp)]
        heapq.heapify(heap)
        return heap

    heap = fresh()
    gbytes = [0] * tp
    gmax = 0
    names: list[str] = []
    hosts: list[int] = []

    def close() -> None:
        loads = [0.0] * tp
        for load, _, r in heap:
            loads[r] = load
        for r in range(tp):
            total[r] += loads[r]
        groups.append(Group(tuple(names), tuple(hosts), tuple(loads)))

    for t in tasks:
        load, carried, r = heap[0]
        if names and max(gmax, gbytes[r] + t.nbytes) > cmax_bytes:
            # rollback: M_curr is final, p seeds the next group
            close()
            heap, gbytes, gmax, names, hosts = fresh(), [0] * tp, 0, [], []
            load, carried, r = heap[0]
        heapq.heapreplace(heap, (load + t.cost, carried, r))
        gbytes[r] += t.nbytes
        gmax = max(gmax, gbytes[r])
        names.append(t.name)
        hosts.append(r)
    if names:
        close()
    return groups


def _round_robin(tasks: Sequence[Task], tp: int, cmax_bytes: int) -> list[Group]:
    groups: list[Group] = []
    names: list[str] = []
    hosts: list[int] = []
    loads = [0.0] * tp
    gbytes = [0] * tp
    gmax = 0
    for i, t in enumerate(sorted(tasks, key=lambda t: t.name)):
        r = i % tp
        if names and max(gmax, gbytes[r] + t.nbytes) > cmax_bytes:
            groups.append(Group(tuple(names), tuple(hosts), tuple(loads)))
            names, hosts, loads, gbytes, gmax = [], [], [0.0] * tp, [0] * tp, 0
        names.append(t.name)
        hosts.append(r)
        loads[r] += t.cost
        gbytes[r] += t.nbytes
        gmax = max(gmax, gbytes[r])
    if names:
        groups.append(Group(tuple(names), tuple(hosts), tuple(loads)))
    return groups


def _no_fuse(tasks: Sequence[Task], tp: int, cmax_bytes: int) -> list[Group]:
    """The fused ``lpt`` schedule with every group split into one-task groups (same hosts, same
    order): what fusion alone buys, placement held fixed."""
    cost = {t.name: t.cost for t in tasks}
    groups = []
    for g in _lpt(tasks, tp, cmax_bytes, carry=False):
        for n, h in zip(g.names, g.hosts):
            loads = [0.0] * tp
            loads[h] = cost[n]
            groups.append(Group((n,), (h,), tuple(loads)))
    return groups


def schedule_tasks(tasks: Sequence[Task], tp: int, schedule: str, cmax_bytes: int) -> list[Group]:
    """Micro-groups of one DP rank's tasks under ``schedule`` (see the module docstring)."""
    if schedule not in GROUP_SCHEDULES:
        raise ValueError(f"unknown micro-group schedule {schedule!r}; choose one of {', '.join(GROUP_SCHEDULES)}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    ordered = sorted(tasks, key=lambda t: (-t.cost, t.name))
    if schedule == "lpt":
        return _lpt(ordered, tp, cmax_bytes, carry=False)
    if schedule == "lpt-carry":
        return _lpt(ordered, tp, cmax_bytes, carry=True)
    if schedule == "no-fuse":
        return _no_fuse(ordered, tp, cmax_bytes)
    return _round_robin(tasks, tp, cmax_bytes)


def expert_tp_summary(params: Sequence[Any], tp: int) -> str | None:
    """One line on a plan's expert stacks (``params``: its ParamPlans): how many are split over TP
    (each expert a TP task with a host) and how many replicated (every TP rank updates every expert
    of its DP share); None without expert stacks. Expert tasks are named ``stack[e]`` in the
    micro-groups and scheduled like any other task (cost of one ``(M, N)`` expert)."""
    stacks = [p.spec for p in params if p.role == "experts"]
    if not stacks:
        return None
    split = [s for s in stacks if s.tp_split]
    n_split = sum(s.shape[0] for s in split)
    parts = []
    if split:
        dims = sorted({("rows" if s.tp_dim == 1 else "columns") for s in split})
        parts.append(f"{len(split)} stacks TP-split over tp={tp} ({' and '.join(dims)}): {n_split} expert tasks with TP hosts")
    if len(split) < len(stacks):
        rest = len(stacks) - len(split)
        parts.append(f"{rest} stacks replicated over TP ({sum(s.shape[0] for s in stacks if not s.tp_split)} experts)")
    return "; ".join(parts)


def expert_hosts(micro_groups: Sequence[Sequence[Any]], name: str) -> str:
    """Where the expert tasks of TP-split stack ``name`` are hosted, from a plan's micro-groups
    (per DP rank, groups with ``params`` and ``hosts``): ``"TP hosts 0: 3 experts, 1: 5 experts"``;
    ``"every TP rank"`` when no group names them (the ``sync`` schedule)."""
    count: dict[int, int] = {}
    prefix = f"{name}["
    for groups in micro_groups:
        for g in groups:
            for t, h in zip(g.params, g.hosts):
                if t.startswith(prefix):
                    count[h] = count.get(h, 0) + 1
    if not count:
        return "every TP rank"
    return "TP hosts " + ", ".join(f"{h}: {n} expert{'s' if n > 1 else ''}" for h, n in sorted(count.items()))
