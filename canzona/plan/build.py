"""Planner front end: parameter specs + inputs -> a validated :class:`Plan`.

Pipeline (pure, offline, milliseconds): buffer geometry (:mod:`.buckets`) -> DP partition
(:mod:`.dp`, Section 3) -> TP micro-groups per DP rank (:mod:`.tp`, Section 4) -> metrics
(:mod:`.metrics`). ``plan_seconds`` measures the whole pipeline up to the metrics.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from canzona.config import MODELS_DIR, ModelConfig, available_models, load_model_config
from canzona.cost import OPTIMIZERS, cost_arrays, matrix_flops, state_bytes
from canzona.plan import dp as dpmod
from canzona.plan.buckets import BufferLayout, default_bucket_numel, layout_buffer
from canzona.plan.dp import DPAssignment
from canzona.plan.metrics import LoadVectors, compute_metrics
from canzona.plan.plan import (
    DEFAULT_FLOPS_SHAPE,
    Bucket,
    MicroGroup,
    ParamPlan,
    Plan,
    PlanError,
    PlanInputs,
)
from canzona.plan.shard import plan_shard, shard_inputs, shard_specs
from canzona.plan.strategies import PartitionInput, Strategy, get_strategy, param_role
from canzona.plan.tp import Group, Task, schedule_tasks
from canzona.specs import ParamSpec, expert_task_name, specs_from_config

__all__ = [
    "MAX_DP",
    "MAX_TP",
    "CMAX_UNIT",
    "DEFAULT_CMAX",
    "cmax_to_bytes",
    "cmax_from_bytes",
    "default_bucket_numel",
    "default_tp_schedule",
    "resolve_model",
    "make_plan",
    "plan_model",
    "plan_fsdp_model",
]

#: C_max's one unit on every flag, setting and figure: 2^20 TP-local gradient elements per host
#: per micro-group, the paper's unit (its Figure 14 "MB", the authors' code's cost units with the
#: numel cost). A task of n TP-local elements brings its host n x tp gradient elements.
CMAX_UNIT = "2^20 TP-local gradient elements per host (the paper's unit)"
#: Section 4.2 / Figure 14: fused all-to-all performance plateaus around C_max = 512
DEFAULT_CMAX = 512.0


def cmax_to_bytes(cmax: float, tp: int, grad_bytes: int = 4) -> int:
    """C_max in :data:`CMAX_UNIT` as the bytes of gathered gradient the planner and runtime bound
    (``cmax x 2^20 x tp x grad_bytes``): the same capacity test, a task of ``n`` TP-local elements
    being ``n x tp x grad_bytes`` bytes on its host."""
    if not (isinstance(cmax, (int, float)) and not isinstance(cmax, bool) and cmax > 0):
        raise PlanError(f"C_max must be a positive number ({CMAX_UNIT}), got {cmax!r}")
    return max(1, int(round(float(cmax) * 2**20 * tp * grad_bytes)))


def cmax_from_bytes(nbytes: int, tp: int, grad_bytes: int = 4) -> float:
    """The inverse of :func:`cmax_to_bytes`: a plan's ``cmax_bytes`` in :data:`CMAX_UNIT`."""
    return nbytes / (2**20 * tp * grad_bytes)


def default_tp_schedule(strategy: str) -> str:
    """The TP schedule each DP strategy runs with in the paper's comparison (its record's
    ``default_tp_schedule``): Canzona (lb-asc, lb-asc-joint) uses Algorithm 2 micro-groups with host
    loads carried across groups (``lpt-carry``; Algorithm 2 as written, whose zero-start heap puts
    every one-task group on TP rank 0, is ``lpt``), ASC round-robin hosts, SC / NV-layerwise /
    ZeRO-1 synchronous TP."""
    return get_strategy(strategy).default_tp_schedule


def resolve_model(model: str | Path | ModelConfig) -> ModelConfig:
    """A shipped model name (``qwen3-32b``, ``qwen3-0.6b``), a path to a config JSON, or a config."""
    if isinstance(model, ModelConfig):
        return model
    text = str(model)
    # shipped names may contain dots (qwen3-0.6b), which a path suffix test would mistake for a file
    if text.lower() in available_models():
        return load_model_config(MODELS_DIR / f"{text.lower()}.json")
    return load_model_config(model)


def _task_metric(spec: ParamSpec, optimizer: str, flops_shape: str) -> tuple[float, float, float]:
    """(flops, state bytes, numel) of a TP task as its host runs it (full shape, or the shard
    shape under the paper's ``local`` accounting)."""
    if spec.kind == "experts":  # one expert of a TP-split stack
        shape = spec.task_shape if flops_shape == "full" else spec.local_task_shape
    else:
        shape = spec.shape if flops_shape == "full" else spec.local_shape
    numel = math.prod(shape)
    return float(matrix_flops(optimizer, shape)), float(state_bytes(optimizer, shape)), float(numel)


#: where each cost model's W(p) of a TP task (Algorithm 2) sits in :func:`_task_metric`'s triple
_TASK_COST_INDEX = {"flops": 0, "memory": 1, "numel": 2}


def _check_assignment(a: object, layout: BufferLayout, dp: int, record: Strategy) -> None:
    """A partitioner's answer has the shape its record promises (a registered partitioner is user
    code: a wrong answer should name the strategy, not fail later in the metrics)."""
    name = record.name
    cuts, owner = getattr(a, "cuts", None), getattr(a, "owner", None)
    if not isinstance(cuts, tuple) or len(cuts) != len(layout.bounds):
        raise PlanError(f"strategy {name}: partitioner must return one cut tuple per bucket ({len(layout.bounds)})")
    if not isinstance(owner, np.ndarray) or owner.shape != (layout.n_params,):
        raise PlanError(f"strategy {name}: partitioner must return one owner per parameter ({layout.n_params})")
    if owner.size and (owner.min() < -1 or owner.max() >= dp):
        raise PlanError(f"strategy {name}: partitioner returned an owner outside -1..{dp - 1}")
    if not record.reduce_scatter and any(cuts):
        raise PlanError(f"strategy {name}: an all-reduce strategy has no cut points")
    if record.every_rank_updates and owner.size and owner.max() >= 0:
        raise PlanError(f"strategy {name}: every rank updates every parameter, so no parameter has an owner (-1)")
    if not record.every_rank_updates and not record.reduce_scatter and owner.size and owner.min() < 0:
        raise PlanError(f"strategy {name}: without cut points every parameter needs an owner")


def _equal_elementwise_buckets(layout, a: dpmod.DPAssignment, sp: Sequence[ParamSpec], dp: int) -> dpmod.DPAssignment:
    """``a`` with every element-wise-only bucket cut into ZeRO-1's equal chunks (split buffers)."""
    equal = dpmod.zero1(layout, dp).cuts
    cuts = tuple(
        equal[b] if all(sp[i].kind == "elementwise" for i in range(i0, i1)) else a.cuts[b]
        for b, (i0, i1) in enumerate(layout.bounds)
    )
    return dpmod.DPAssignment(cuts, dpmod.owners_from_cuts(layout, cuts))


def _check_inputs(specs: Sequence[ParamSpec], inp: PlanInputs, record: Strategy) -> None:
    """Inputs the planner refuses before doing any work (each a PlanError naming the problem)."""
    if not specs:
        raise PlanError("cannot plan a model without parameters")
    if inp.optimizer not in OPTIMIZERS:
        raise PlanError(f"unknown optimizer {inp.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for s in specs:
        if s.tp_dim is not None and s.tp != inp.tp:
            raise PlanError(f"{s.name}: spec built for tp={s.tp} but the plan has tp={inp.tp}")
    if record.sync_tp_only and inp.tp_schedule != "sync" and inp.tp > 1:
        raise PlanError(
            f"strategy {inp.strategy} recomputes or cuts every update, so its TP schedule must be 'sync', got {inp.tp_schedule!r}"
        )


def _load_vectors(layout: BufferLayout, sp: Sequence[ParamSpec], inp: PlanInputs) -> LoadVectors:
    """Per-parameter loads in buffer order; ``cost`` is the plan's cost model W(p)."""
    flops, memory = cost_arrays(sp, inp.optimizer, inp.flops_shape)
    numel = layout.numel.astype(np.float64)
    cost = {"numel": numel, "flops": flops, "memory": memory}[inp.cost]
    return LoadVectors(cost=cost, flops=flops, memory=memory, numel=numel)


def _expert_units(layout: BufferLayout, counts: np.ndarray) -> tuple[BufferLayout, np.ndarray]:
    """The buffer as a partitioner sees it when expert stacks are E tasks: buffer position ``i``
    becomes ``counts[i]`` units of ``numel[i] / counts[i]`` elements (one per expert; 1 for every
    other parameter), same bucket, consecutive offsets. Returns that layout and each unit's
    buffer position."""
    unit_of = np.repeat(np.arange(layout.n_params, dtype=np.int64), counts)
    first = np.concatenate(([0], np.cumsum(counts)))
    k = np.arange(len(unit_of), dtype=np.int64) - first[unit_of]
    size = layout.numel[unit_of] // counts[unit_of]
    units = BufferLayout(
        order=layout.order[unit_of],
        numel=size,
        offset=layout.offset[unit_of] + k * size,
        bucket=layout.bucket[unit_of],
        bounds=tuple((int(first[i0]), int(first[i1])) for i0, i1 in layout.bounds),
        bucket_start=layout.bucket_start,
        bucket_numel=layout.bucket_numel,
    )
    return units, unit_of


def _partition_experts(record: Strategy, layout: BufferLayout, pin: PartitionInput, sp: Sequence[ParamSpec], roles: Sequence[str]) -> DPAssignment | None:
    """Run a cutting partitioner on expert units (:func:`_expert_units`), so that it may place the
    experts of one stack on different ranks, cutting the stack only between experts. Its answer
    is kept when the owners it gives are exactly those its cuts imply on the real buffer (a
    partitioner that interleaves owners without cuts is run on whole stacks instead); None when
    there is no stack to split or the strategy does not cut."""
    counts = np.array([s.shape[0] if r == "experts" else 1 for s, r in zip(sp, roles)], dtype=np.int64)
    if not record.reduce_scatter or record.every_rank_updates or int(counts.max(initial=1)) == 1:
        return None
    units, unit_of = _expert_units(layout, counts)
    share = counts[unit_of].astype(np.float64)
    a = record.partition(
        PartitionInput(
            layout=units, dp=pin.dp, cost=pin.cost[unit_of] / share, flops=pin.flops[unit_of] / share,
            memory=pin.memory[unit_of] / share, alpha=pin.alpha, names=[pin.names[i] for i in unit_of.tolist()],
            elementwise=pin.elementwise[unit_of], preload=pin.preload,
        )
    )
    cuts = getattr(a, "cuts", None)
    if not isinstance(cuts, tuple) or len(cuts) != layout.n_buckets:
        return None
    if not np.array_equal(np.asarray(getattr(a, "owner", ())), dpmod.owners_from_cuts(units, cuts)):
        return None
    return DPAssignment(cuts, dpmod.owners_from_cuts(layout, cuts))


def _partition(
    record: Strategy, layout: BufferLayout, sp: Sequence[ParamSpec], loads: LoadVectors, inp: PlanInputs, roles: Sequence[str],
    preload: Sequence[float] | None = None,
) -> tuple[DPAssignment, dict[int, tuple[tuple[int, int, int], ...]]]:
    """Section 3: the strategy's partitioner places parameters on DP ranks; returns its answer and
    the ``(rank, start, end)`` ranges of each cut parameter (buffer index -> ranges)."""
    elementwise = np.array([s.kind == "elementwise" for s in sp])
    split_geometry = inp.buffers == "split" and record.reduce_scatter
    pin = PartitionInput(
        layout=layout,
        dp=inp.dp,
        # split buffers: a geometric partitioner balances the matrix buffer; element-wise loads
        # leave the planning cost and their buckets are cut into equal chunks below, as the
        # ordinary distributed optimizer does
        cost=np.where(elementwise, 0.0, loads.cost) if split_geometry else loads.cost,
        flops=loads.flops,
        memory=loads.memory,
        alpha=float(inp.alpha),
        names=[s.name for s in sp],
        elementwise=elementwise,
        preload=None if preload is None else np.asarray(preload, dtype=np.float64),
    )
    # expert stacks are E tasks: a cutting partitioner may place a stack's experts on several ranks
    a = _partition_experts(record, layout, pin, sp, roles) or record.partition(pin)
    if split_geometry:
        a = _equal_elementwise_buckets(layout, a, sp, inp.dp)
    _check_assignment(a, layout, inp.dp, record)
    ranges: dict[int, tuple[tuple[int, int, int], ...]] = {}
    if not record.every_rank_updates:
        for i in np.flatnonzero(a.owner < 0).tolist():
            b = int(layout.bucket[i])
            ranges[i] = dpmod.cut_ranges(a.cuts[b], int(layout.offset[i]), int(layout.numel[i]))
            if roles[i] not in ("elementwise", "experts"):  # an expert stack may be cut between experts (validated)
                raise PlanError(f"{sp[i].name}: {record.name} cut a matrix parameter (planner bug)")
    return a, ranges


@dataclass(frozen=True, slots=True)
class _TPTasks:
    """The TP tasks each DP rank hands to its TP group, with their costs for the metrics."""

    per_rank: list[list[Task]]
    avg: dict[str, tuple[float, float, float]]  # (flops, memory, numel) as the DP loads count them
    full: dict[str, tuple[float, float, float]]  # as the host runs them (:func:`_task_metric`)


def _tp_tasks(
    sp: Sequence[ParamSpec],
    roles: Sequence[str],
    owner: Sequence[int],
    loads: LoadVectors,
    record: Strategy,
    inp: PlanInputs,
    ranges: dict[int, tuple[tuple[int, int, int], ...]],
) -> _TPTasks:
    """Every ``tp-task`` parameter becomes a task of its owner (of every rank when all update); every
    expert of a TP-split stack a task ``name[e]`` of the DP rank that updates that expert."""
    cost_at = _TASK_COST_INDEX[inp.cost]
    tasks = _TPTasks(per_rank=[[] for _ in range(inp.dp)], avg={}, full={})
    for i, s in enumerate(sp):
        if roles[i] == "experts" and s.tp_split:
            _expert_tp_tasks(tasks, s, i, owner, loads, record, inp, ranges.get(i, ()))
            continue
        if roles[i] != "tp-task":
            continue
        full = tasks.full[s.name] = _task_metric(s, inp.optimizer, inp.flops_shape)
        tasks.avg[s.name] = (float(loads.flops[i]), float(loads.memory[i]), float(loads.numel[i]))
        task = Task(s.name, full[cost_at], inp.grad_bytes * s.numel)
        if record.every_rank_updates:
            for ranks in tasks.per_rank:
                ranks.append(task)
        elif owner[i] >= 0:
            tasks.per_rank[owner[i]].append(task)
    return tasks


def _expert_tp_tasks(
    tasks: _TPTasks, s: ParamSpec, i: int, owner: Sequence[int], loads: LoadVectors, record: Strategy, inp: PlanInputs,
    ranges: tuple[tuple[int, int, int], ...],
) -> None:
    """The ``E`` experts of TP-split stack ``s`` (buffer index ``i``) as TP tasks of the DP ranks
    that update them: the owner of the whole stack, or each rank for the experts of its ranges
    (a stack is cut only between experts), every rank under an every-rank strategy."""
    e = s.shape[0]
    full = _task_metric(s, inp.optimizer, inp.flops_shape)
    avg = (float(loads.flops[i]) / e, float(loads.memory[i]) / e, float(loads.numel[i]) / e)
    nbytes = inp.grad_bytes * math.prod(s.task_shape)
    unit = s.local_numel // e
    if record.every_rank_updates:
        mine = [(r, 0, e) for r in range(inp.dp)]
    elif owner[i] >= 0:
        mine = [(owner[i], 0, e)]
    else:
        mine = [(r, a // unit, b // unit) for r, a, b in ranges]
    for r, lo, hi in mine:
        for k in range(lo, hi):
            name = expert_task_name(s.name, k)
            tasks.full[name], tasks.avg[name] = full, avg
            tasks.per_rank[r].append(Task(name, full[_TASK_COST_INDEX[inp.cost]], nbytes))


def _schedule(per_rank: list[list[Task]], inp: PlanInputs, grouped: bool) -> tuple[list[list[Group]], list[list[str]], dict[str, tuple[int, int]]]:
    """Section 4: micro-groups per DP rank (``grouped``), else the tasks every TP rank recomputes
    (``sync``). Returns (groups per rank, sync task names per rank, name -> (host, group index))."""
    dp, tp = inp.dp, inp.tp
    groups: list[list[Group]] = [[] for _ in range(dp)]
    sync_tasks: list[list[str]] = [[] for _ in range(dp)]
    host_of: dict[str, tuple[int, int]] = {}
    if grouped:
        oversize = sorted({t.name for ts in per_rank for t in ts if t.nbytes > inp.cmax_bytes})
        if oversize:
            warnings.warn(
                f"{len(oversize)} task(s) exceed C_max = {inp.cmax_bytes} bytes of gathered gradient on their own "
                f"(e.g. {oversize[0]}); each gets a micro-group of its own",
                stacklevel=3,
            )
        for r in range(dp):
            groups[r] = schedule_tasks(per_rank[r], tp, inp.tp_schedule, inp.cmax_bytes)
            for k, g in enumerate(groups[r]):
                for n, h in zip(g.names, g.hosts):
                    host_of[n] = (h, k)
    elif tp > 1:
        for r in range(dp):
            sync_tasks[r] = [t.name for t in per_rank[r]]
    return groups, sync_tasks, host_of


def _param_plans(
    specs: Sequence[ParamSpec],
    layout: BufferLayout,
    owner: Sequence[int],
    roles: Sequence[str],
    ranges: dict[int, tuple[tuple[int, int, int], ...]],
    host_of: dict[str, tuple[int, int]],
) -> tuple[ParamPlan, ...]:
    """One ParamPlan per spec, in registration order (the planner works in buffer order)."""
    pos_of = np.empty(len(specs), dtype=np.int64)
    pos_of[layout.order] = np.arange(len(specs))
    bucket_l, offset_l = layout.bucket.tolist(), layout.offset.tolist()
    params = []
    no_host = (None, None)
    for s, i in zip(specs, pos_of.tolist()):
        o = owner[i]
        h, k = host_of.get(s.name, no_host)
        params.append(
            ParamPlan(
                spec=s,
                bucket=bucket_l[i],
                offset=offset_l[i],
                dp_owner=o if o >= 0 else None,
                role=roles[i],
                dp_ranges=ranges.get(i, ()),
                tp_host=h,
                micro_group=k,
            )
        )
    return tuple(params)


def _buckets(layout: BufferLayout, sp: Sequence[ParamSpec], record: Strategy, cuts: tuple[tuple[int, ...], ...]) -> tuple[Bucket, ...]:
    return tuple(
        Bucket(
            index=b,
            start=int(layout.bucket_start[b]),
            numel=int(layout.bucket_numel[b]),
            params=tuple(sp[i].name for i in range(i0, i1)),
            collective=record.grad_collective,
            param_return=record.param_return,
            cuts=cuts[b],
        )
        for b, (i0, i1) in enumerate(layout.bounds)
    )


def _micro_groups(groups: list[list[Group]]) -> tuple[tuple[MicroGroup, ...], ...]:
    return tuple(
        tuple(MicroGroup(index=k, params=g.names, hosts=g.hosts, loads=g.loads) for k, g in enumerate(rank_groups))
        for rank_groups in groups
    )


def make_plan(specs: Sequence[ParamSpec], inputs: PlanInputs, *, preload: Sequence[float] | None = None) -> Plan:
    """Plan ``specs`` (registration order) under ``inputs``: the whole of Sections 3 and 4.
    ``preload``: each DP rank's load before planning, in the cost model's unit (expert
    parallelism's experts, :mod:`canzona.plan.ep`); the load-balancing partitioners fill around it.

    FSDP2 inputs (``layout_kind="fsdp2"``) go to :func:`canzona.plan.shard.plan_shard`.
    Raises :class:`PlanError` for inconsistent inputs (unknown optimizer, specs built for another
    tp, a TP schedule the strategy cannot run). A task whose full gradient alone exceeds C_max gets
    a micro-group of its own and one warning per plan names it.
    """
    if inputs.layout_kind == "fsdp2":
        return plan_shard(specs, inputs)
    t0 = time.perf_counter()
    inp = inputs
    specs = list(specs)
    record = get_strategy(inp.strategy)
    _check_inputs(specs, inp, record)
    layout = layout_buffer(specs, inp.bucket_numel, separate=inp.buffers == "split")
    sp = [specs[i] for i in layout.order.tolist()]  # buffer order
    loads = _load_vectors(layout, sp, inp)
    roles = [param_role(record, s.kind, s.tp_split) for s in sp]
    assignment, ranges = _partition(record, layout, sp, loads, inp, roles, preload)
    owner = assignment.owner.tolist()
    tasks = _tp_tasks(sp, roles, owner, loads, record, inp, ranges)
    grouped = inp.tp > 1 and inp.tp_schedule != "sync" and not record.sync_tp_only
    groups, sync_tasks, host_of = _schedule(tasks.per_rank, inp, grouped)
    params = _param_plans(specs, layout, owner, roles, ranges, host_of)
    buckets = _buckets(layout, sp, record, assignment.cuts)
    micro_groups = _micro_groups(groups) if grouped else ()
    plan_seconds = time.perf_counter() - t0
    metrics = compute_metrics(
        layout=layout,
        cuts=assignment.cuts,
        owner=assignment.owner,
        ranges=ranges,
        loads=loads,
        dp=inp.dp,
        tp=inp.tp,
        everyone=record.every_rank_updates,
        groups=groups,
        sync_tasks=sync_tasks,
        task_avg=tasks.avg,
        task_full=tasks.full,
        plan_seconds=plan_seconds,
    )
    return Plan(inputs=inp, params=params, buckets=buckets, micro_groups=micro_groups, metrics=metrics)


#: bounds on the parallel sizes a model config is planned for (planning memory grows with dp; a
#: larger figure is a typo): 131072 DP ranks, TP degree 4096
MAX_DP = 1 << 17
MAX_TP = 1 << 12


def plan_model(
    model: str | Path | ModelConfig,
    *,
    dp: int,
    tp: int = 1,
    layout: str = "megatron",
    optimizer: str = "muon",
    strategy: str = "lb-asc",
    alpha: float = 1.0,
    cost: str = "numel",
    flops_shape: str = DEFAULT_FLOPS_SHAPE,
    cmax_bytes: int | None = None,
    bucket_numel: int | None = None,
    tp_schedule: str | None = None,
    grad_bytes: int = 4,
    buffers: str = "joint",
    experts: str = "stacked",
) -> Plan:
    """Plan a shipped model (by name), a config file (by path) or a :class:`ModelConfig`.
    ``experts``: a MoE config's experts as ``(E, M, N)`` stacks of E tasks (default; the planner
    may cut a stack between experts) or as ``separate`` 2-D matrices (see
    :func:`canzona.specs.specs_from_config`).
    ``cmax_bytes`` defaults to :data:`DEFAULT_CMAX` converted by :func:`cmax_to_bytes`."""
    cfg = resolve_model(model)
    if not isinstance(dp, int) or isinstance(dp, bool) or not 1 <= dp <= MAX_DP:
        raise PlanError(f"dp must be an integer in [1, {MAX_DP}], got {dp!r}")
    if not isinstance(tp, int) or isinstance(tp, bool) or not 1 <= tp <= MAX_TP:
        raise PlanError(f"tp must be an integer in [1, {MAX_TP}], got {tp!r}")
    specs = specs_from_config(cfg, tp=tp, layout=layout, experts=experts)
    inputs = PlanInputs(
        model=cfg.name,
        layout=layout,
        dp=dp,
        tp=tp,
        optimizer=optimizer,
        strategy=strategy,
        tp_schedule=tp_schedule if tp_schedule is not None else default_tp_schedule(strategy),
        bucket_numel=bucket_numel if bucket_numel is not None else default_bucket_numel(dp),
        alpha=float(alpha),
        cost=cost,
        flops_shape=flops_shape,
        cmax_bytes=cmax_bytes if cmax_bytes is not None else cmax_to_bytes(DEFAULT_CMAX, tp, grad_bytes),
        grad_bytes=grad_bytes,
        buffers=buffers,
    )
    return make_plan(specs, inputs)


def _check_sizes(**sizes: int) -> None:
    """Data-parallel and TP sizes within canzona's bounds: :data:`MAX_DP` data-parallel ranks (all
    DP-like sizes together), :data:`MAX_TP` TP ranks; one PlanError line otherwise."""
    for k, v in sizes.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{k} must be an integer >= 1, got {v!r}")
    dp = math.prod(v for k, v in sizes.items() if k != "tp")
    if dp > MAX_DP:
        what = " x ".join(f"{k} {v}" for k, v in sizes.items() if k != "tp")
        raise PlanError(f"{what} = {dp} data-parallel ranks, above canzona's bound {MAX_DP}")
    if sizes.get("tp", 1) > MAX_TP:
        raise PlanError(f"tp {sizes['tp']} is above canzona's bound {MAX_TP}")


def plan_fsdp_model(
    model: str | Path | ModelConfig,
    *,
    dp_shard: int,
    tp: int = 1,
    dp_replicate: int = 1,
    layout: str = "hf",
    optimizer: str = "muon",
    strategy: str = "lb-asc",
    cost: str = "numel",
    cmax_bytes: int | None = None,
    experts: str = "stacked",
) -> Plan:
    """Plan a shipped model (name), a config file (path) or a ``ModelConfig`` for FSDP2 over
    ``dp_replicate x dp_shard x tp`` ranks (at most :data:`MAX_DP` data-parallel ranks and
    :data:`MAX_TP` TP ranks, else PlanError). ``layout="hf"`` (separate q/k/v and gate/up, as
    torchtitan's models) is the FSDP default; ``megatron`` fuses them. A MoE config's experts are
    ``(E, M, N)`` stacks of E tasks (updated where FSDP2 leaves them, as the runtime does);
    ``experts="separate"`` plans them as 2-D matrices hosted like any other. ``cmax_bytes`` None:
    :data:`DEFAULT_CMAX` TP-local elements per host."""
    _check_sizes(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp)
    cfg = resolve_model(model)
    # ParamSpec checks TP divisibility; FSDP2's own dim-0 chunking may be uneven (any size works)
    specs = specs_from_config(cfg, tp=tp, layout=layout, experts=experts)
    inputs = shard_inputs(
        cfg.name, dp_shard=dp_shard, tp=tp, dp_replicate=dp_replicate, layout=layout, optimizer=optimizer, strategy=strategy,
        cost=cost, cmax_bytes=cmax_bytes if cmax_bytes is not None else cmax_to_bytes(DEFAULT_CMAX, tp),
    )
    return plan_shard(shard_specs(specs), inputs)
