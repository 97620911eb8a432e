"""FSDP2 plans: which rank of a shard group hosts each matrix update, batched how (as a :class:`Plan`).

Under PyTorch's FSDP2 (``fully_shard``) every parameter is a DTensor cut along dim 0 over the
``dp_shard`` mesh dimension (and, with tensor parallelism, along its TP dim over ``tp``), so no
rank holds a whole matrix. Canzona applies its TP answer (Section 4 of the paper, Algorithm 2) to
the shard dimension: every matrix parameter is a *task* with one *host* in its *shard group* (the
``dp_shard x tp`` ranks of one replica, flattened), which receives the pieces in one fused
all-to-all per micro-group, runs the optimizer on the full tensor with state it keeps, and sends
the updated values back. Expert stacks are E tasks of ``(M, N)`` each. A stack whose shard holds
whole experts (``Shard(0)``, with or without an ``ep`` dimension) is updated where FSDP2 leaves it,
no exchange. A stack *cut* by its shard (``Shard(1)`` on the FSDP dimension, torchtitan's choice
when the experts are fewer than the ranks sharding them) or by TP (``Shard(1)``/``Shard(2)`` on
``tp``, torchtitan's colwise/rowwise experts without ep; its spec's ``tp_dim`` is 1 either way,
the mark of a layout that cuts every expert) is E hosted tasks ``stack[e]`` (:func:`canzona.specs.expert_task_name`),
costed on one ``(M, N)`` expert and scheduled with the matrices. Element-wise parameters are
updated where they lie, on every rank's own piece. Each ``dp_replicate`` replica runs the same step
on identical gradients (HSDP all-reduces them), so one replica's plan is every replica's plan.

The plan is the one :class:`~canzona.plan.plan.Plan` with ``inputs.layout_kind == "fsdp2"``: no
buckets, one list of micro-groups (the shard group's), ``tp_host`` a shard-group rank (-1: every
rank, ``sc``). Strategies map onto the micro-group schedules of :mod:`canzona.plan.tp` through
:func:`~canzona.plan.strategies.fsdp_schedule`. A task's load is :func:`canzona.cost.param_cost`
on its full shape (the host computes the whole update); C_max bounds the bytes of full gradient a
host receives in one group.

Metrics count every rank of the shard group: per rank, optimizer FLOPs and state bytes of the
matrices it hosts, of the experts it holds and of AdamW on its pieces of the element-wise
parameters; the max/mean ratios; and the atomic lower bound (largest single task, one matrix or
one expert, over the mean: tasks are not cut, so no schedule can go below it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from canzona.cost import OPTIMIZERS, adamw_flops, matrix_flops, param_cost, state_bytes
from canzona.plan.errors import PlanError
from canzona.plan.plan import SHARD_ROLES, Metrics, MicroGroup, ParamPlan, Plan, PlanInputs
from canzona.plan.strategies import FSDP_STRATEGIES, fsdp_schedule
from canzona.plan.tp import Task, schedule_tasks
from canzona.specs import ParamSpec, expert_task_name

__all__ = ["FSDP_STRATEGIES", "chunk_sizes", "cut_experts", "hosted_tasks", "piece_numels", "shard_inputs", "shard_specs", "plan_shard"]


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk(n, parts)`` (ceil-sized chunks; trailing ones may be short or empty),
    FSDP2's and DTensor's ``Shard`` layout."""
    size = -(-n // parts) if n else 0
    return [max(0, min(size, n - i * size)) for i in range(parts)]


def piece_numels(shape: Sequence[int], tp_dim: int | None, dp_shard: int, tp: int) -> list[int]:
    """Elements each rank of a shard group holds (group rank = d * tp + t): TP chunks ``tp_dim``
    first, then FSDP2 chunks dim 0 of the TP-local piece over ``dp_shard``."""
    tp_pieces = []
    for t in range(tp):
        s = list(shape)
        if tp_dim is not None and tp > 1:
            s[tp_dim] = chunk_sizes(shape[tp_dim], tp)[t]
        tp_pieces.append((chunk_sizes(s[0], dp_shard), math.prod(s[1:])))
    return [rows[d] * rest for d in range(dp_shard) for rows, rest in tp_pieces]


def shard_inputs(
    model: str,
    *,
    dp_shard: int,
    tp: int = 1,
    dp_replicate: int = 1,
    layout: str = "hf",
    optimizer: str = "muon",
    strategy: str = "lb-asc",
    cost: str = "numel",
    cmax_bytes: int = 512 * 2**20,
    grad_bytes: int = 4,
) -> PlanInputs:
    """The :class:`PlanInputs` of an FSDP2 plan over ``dp_replicate x dp_shard x tp`` ranks."""
    for k, v in (("dp_shard", dp_shard), ("tp", tp), ("dp_replicate", dp_replicate)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise PlanError(f"{k} must be an integer >= 1, got {v!r}")
    return PlanInputs(
        model=model, layout=layout, dp=dp_replicate * dp_shard, tp=tp, optimizer=optimizer, strategy=strategy,
        tp_schedule=fsdp_schedule(strategy), bucket_numel=0, cost=cost, cmax_bytes=cmax_bytes, grad_bytes=grad_bytes,
        layout_kind="fsdp2", dp_shard=dp_shard, dp_replicate=dp_replicate,
    )


def shard_specs(specs: Sequence[ParamSpec]) -> list[ParamSpec]:
    """Planner specs as an FSDP2 plan holds them: TP's split dim kept (None when not split), ``tp`` 1.
    A TP-split expert stack (``experts="stacked-tp"``: torchtitan's colwise/rowwise experts without
    ep) cuts every expert, so it is marked cut (``tp_dim`` 1), as the FSDP2 layout records it: one
    hosted task per expert."""
    return [ParamSpec(s.name, tuple(s.shape), s.kind, (1 if s.kind == "experts" else s.tp_dim) if s.tp_split else None) for s in specs]


def _check_specs(specs: Sequence[ParamSpec], inputs: PlanInputs) -> None:
    if inputs.layout_kind != "fsdp2":
        raise PlanError("plan_shard plans FSDP2 inputs (layout_kind 'fsdp2'); make_plan plans the ZeRO-1 layout")
    if not specs:
        raise PlanError("cannot plan a model without parameters")
    if inputs.optimizer not in OPTIMIZERS:
        raise PlanError(f"unknown optimizer {inputs.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for s in specs:
        if s.tp != 1 or s.transposed:
            raise PlanError(f"{s.name}: FSDP2 specs have tp 1 (tp_dim names TP's split dim) and no transposed weights (see shard_specs)")
        if s.kind == "matrix" and len(s.shape) != 2:
            raise PlanError(f"{s.name}: a matrix parameter must be 2-D on FSDP2, got {s.shape}")
        # an expert stack sharded on its expert dim gives each rank whole experts: updated where
        # they live, no micro-group; one whose layout cuts every expert (by its shard or by TP:
        # tp_dim 1 marks it) is one hosted task per expert
        if s.kind == "experts" and s.tp_dim is not None and s.tp_dim != 1:
            raise PlanError(f"{s.name}: an FSDP2 expert spec is whole (tp_dim None) or cut (tp_dim 1, every expert one hosted "
                            f"task, see shard_specs), got tp_dim {s.tp_dim}")


def cut_experts(spec: ParamSpec) -> bool:
    """Whether an FSDP2 spec is an expert stack cut by its shard or by TP (one hosted task per expert)."""
    return spec.kind == "experts" and spec.tp_dim is not None


def hosted_tasks(specs: Sequence[ParamSpec]) -> list[ParamSpec]:
    """The tasks an FSDP2 plan hosts, in registration order: every matrix, and every expert of a
    stack cut by its shard or by TP as an ``(M, N)`` matrix named ``stack[e]``."""
    out: list[ParamSpec] = []
    for s in specs:
        if s.kind == "matrix":
            out.append(s)
        elif cut_experts(s):
            out += [ParamSpec(expert_task_name(s.name, e), tuple(s.shape[1:]), "matrix") for e in range(s.shape[0])]
    return out


def _sync_groups(tasks: Sequence[ParamSpec], cost: Sequence[float], inputs: PlanInputs) -> list[MicroGroup]:
    """``sc``: every rank gathers and computes every task; exchanges chunked under C_max."""
    n = inputs.group_size
    chunks: list[list[int]] = []
    size = 0
    for i, t in enumerate(tasks):
        nbytes = t.numel * inputs.grad_bytes
        if not chunks or (chunks[-1] and size + nbytes > inputs.cmax_bytes):
            chunks.append([])
            size = 0
        chunks[-1].append(i)
        size += nbytes
    return [
        MicroGroup(k, tuple(tasks[i].name for i in c), (-1,) * len(c), (float(sum(cost[i] for i in c)),) * n)
        for k, c in enumerate(chunks)
    ]


def _rank_loads(params: Sequence[ParamPlan], inputs: PlanInputs, hosts: dict[str, int]) -> tuple[dict[str, list[float]], list[float], list[float]]:
    """Per shard-group rank: optimizer FLOPs, state bytes, elements and planning cost; and every
    task's FLOPs and state (one matrix, or one expert), for the atomic bounds. ``hosts``: the
    micro-groups' host of every hosted task (-1: every rank). Whole experts are counted on the
    ranks of their dim-0 chunk (``torch.chunk`` over the shard group, as without ``ep``; with
    ``ep`` the experts of a rank differ but their count is the same whenever the experts divide
    by the group)."""
    n, opt, cost = inputs.group_size, inputs.optimizer, inputs.cost
    loads = {k: [0.0] * n for k in ("flops", "memory", "numel", "cost")}
    task_flops: list[float] = []
    task_mem: list[float] = []

    def add(r: int, f: float, b: float, k: float, c: float) -> None:
        for key, v in (("flops", f), ("memory", b), ("numel", k), ("cost", c)):
            loads[key][r] += v

    for p in params:
        s = p.spec
        if s.kind == "elementwise":
            # AdamW on each rank's own piece: 13 flops and two fp32 moments per element
            for r, k in enumerate(piece_numels(s.shape, s.tp_dim, inputs.dp_shard, inputs.tp)):
                f, b = float(adamw_flops(k)), 2.0 * k * 4
                add(r, f, b, k, {"flops": f, "memory": b, "numel": float(k)}[cost])
            continue
        shape = s.task_shape
        f, b, c = float(matrix_flops(opt, shape)), float(state_bytes(opt, shape)), param_cost(ParamSpec(s.name, tuple(shape), "matrix"), cost, opt)
        if s.kind == "matrix" or cut_experts(s):
            names = [s.name] if s.kind == "matrix" else [expert_task_name(s.name, e) for e in range(s.shape[0])]
            for t in names:
                task_flops.append(f)
                task_mem.append(b)
                for r in range(n) if hosts[t] == -1 else [hosts[t]]:
                    add(r, f, b, math.prod(shape), c)
        else:  # experts: rank (d, t) updates the whole experts of its dim-0 chunk (replicated over tp)
            task_flops += [f] * s.shape[0]
            task_mem += [b] * s.shape[0]
            for d, count in enumerate(chunk_sizes(s.shape[0], inputs.dp_shard)):
                for t in range(inputs.tp):
                    add(d * inputs.tp + t, count * f, count * b, count * math.prod(shape), count * c)
    return loads, task_flops, task_mem


def _metrics(params: Sequence[ParamPlan], inputs: PlanInputs, groups: Sequence[MicroGroup], plan_seconds: float) -> Metrics:
    """The ratios over the shard group (every replica is the same). ``dp_*`` and ``tp_*`` ratios
    are both the shard group's (its ranks are FSDP2's data-parallel and tensor-parallel ranks at
    once); ``j_dp`` is max_r |L_r - mu| in the planning cost; ``j_comm`` 0 (FSDP2 cuts no buffer)."""
    hosts = {t: h for g in groups for t, h in zip(g.params, g.hosts)}
    loads, task_flops, task_mem = _rank_loads(params, inputs, hosts)
    flops, mem = loads["flops"], loads["memory"]
    n, n_groups = inputs.group_size, len(groups)

    def mean(xs: Sequence[float]) -> float:
        return sum(xs) / len(xs)

    def ratio(xs: Sequence[float]) -> float:
        return max(xs) / mean(xs) if mean(xs) > 0 else 1.0

    def bound(largest: float, xs: Sequence[float]) -> float:
        return max(1.0, largest / mean(xs)) if mean(xs) > 0 else 1.0

    details: dict[str, Any] = {
        "ranks": inputs.world,
        "group_size": n,
        "n_matrix_tasks": sum(p.spec.kind == "matrix" for p in params),
        "n_expert_tasks": sum(p.spec.shape[0] for p in params if p.spec.kind == "experts"),
        "n_cut_expert_tasks": sum(p.spec.shape[0] for p in params if cut_experts(p.spec)),
        "n_micro_groups": n_groups,
        "flops_per_rank": flops,
        "state_bytes_per_rank": mem,
        "flops_max": max(flops),
        "flops_mean": mean(flops),
        "flops_ratio": ratio(flops),
        "flops_bound": bound(max(task_flops, default=0.0), flops),
        "memory_max": max(mem),
        "memory_mean": mean(mem),
        "memory_ratio": ratio(mem),
        "memory_bound": bound(max(task_mem, default=0.0), mem),
        "numel_ratio": ratio(loads["numel"]),
    }
    mu = mean(loads["cost"])
    return Metrics(
        dp_memory_ratio=details["memory_ratio"], dp_flops_ratio=details["flops_ratio"],
        tp_memory_ratio=details["memory_ratio"], tp_flops_ratio=details["flops_ratio"],
        j_dp=max(abs(x - mu) for x in loads["cost"]), j_comm=0.0, plan_seconds=plan_seconds, details=details,
    )


def plan_shard(specs: Sequence[ParamSpec], inputs: PlanInputs) -> Plan:
    """Plan the FSDP2 optimizer step of ``specs`` (see :func:`shard_specs`; registration order)
    under ``inputs`` (see :func:`shard_inputs`); PlanError for inputs it cannot plan."""
    t0 = time.perf_counter()
    specs = list(specs)
    _check_specs(specs, inputs)
    matrices = hosted_tasks(specs)
    costs = [param_cost(s, inputs.cost, inputs.optimizer) for s in matrices]  # full shape: the host runs all of it
    if inputs.tp_schedule == "sync":
        groups = _sync_groups(matrices, costs, inputs)
    else:
        tasks = [Task(s.name, c, s.numel * inputs.grad_bytes) for s, c in zip(matrices, costs)]
        scheduled = schedule_tasks(tasks, inputs.group_size, inputs.tp_schedule, inputs.cmax_bytes)
        groups = [MicroGroup(k, g.names, g.hosts, g.loads) for k, g in enumerate(scheduled)]
    where = {n: (h, k) for g in groups for n, h, k in zip(g.params, g.hosts, [g.index] * len(g.params))}
    params = tuple(
        ParamPlan(s, None, None, None, SHARD_ROLES[s.kind], (), *where.get(s.name, (None, None))) for s in specs
    )
    metrics = _metrics(params, inputs, groups, time.perf_counter() - t0)
    return Plan(inputs=inputs, params=params, buckets=(), micro_groups=(tuple(groups),), metrics=metrics)
