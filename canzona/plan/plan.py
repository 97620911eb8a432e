"""The frozen Plan: what the offline planner decides and the runtime executes.

A plan is pure data, deterministic for its inputs, validates itself on construction
(:meth:`Plan.validate`), round-trips through a versioned JSON document (version 3; version 2 is read, version 1 migrated,
the separate FSDP2 document of earlier versions refused with the command that plans it again) and carries a fingerprint that every rank compares before the
first step. Besides the geometry (buckets, cut points, owners, TP hosts) it carries what the
strategy means per bucket (``Bucket.collective``, ``Bucket.param_return``) and per parameter
(``ParamPlan.role``), so nothing downstream branches on a strategy's name. Every field and its
conventions (sizes in elements of the TP-local shard, cut points relative to the bucket start):
``docs/plan-format.md``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from canzona.fileio import atomic_write, read_json
from canzona.plan.errors import PlanError
from canzona.plan.strategies import (
    GRAD_COLLECTIVES,
    PARAM_RETURNS,
    ROLES,
    FSDP_STRATEGIES,
    Strategy,
    get_strategy,
    paper_strategy_names,
    param_role,
    fsdp_schedule,
    strategy_names,
)
from canzona.specs import ParamSpec, expert_task_name, split_task_name

__all__ = [
    "SCHEMA",
    "VERSION",
    "STRATEGIES",
    "PAPER_STRATEGIES",
    "TP_SCHEDULES",
    "COSTS",
    "BUFFERS",
    "LAYOUT_KINDS",
    "SHARD_ROLES",
    "FSDP_STRATEGIES",
    "FLOPS_SHAPES",
    "DEFAULT_FLOPS_SHAPE",
    "PlanError",
    "PlanInputs",
    "ParamPlan",
    "Bucket",
    "MicroGroup",
    "Metrics",
    "Plan",
    "ROLES",
    "GRAD_COLLECTIVES",
    "PARAM_RETURNS",
]

SCHEMA = "canzona.plan"
VERSION = 3
#: the schema of the separate FSDP2 plan document earlier versions wrote (refused, naming the re-plan command)
OLD_SHARD_SCHEMA = "canzona.fsdp_plan"
#: the layouts a plan is made for: canzona's ZeRO-1 buffer (with or without DTensor TP), or FSDP2's
#: ``fully_shard`` pieces (no buffer; matrices hosted in the ``dp_shard x tp`` shard group)
LAYOUT_KINDS: tuple[str, ...] = ("zero1", "fsdp2")
#: the shipped DP strategy names (the registry, :func:`canzona.plan.strategies.strategy_names`,
#: also holds any registered later), one name per strategy everywhere (CLI, JSON, NVTX ranges,
#: notebooks). ``lb-asc-joint`` is canzona's planner beyond the paper.
STRATEGIES: tuple[str, ...] = strategy_names()
PAPER_STRATEGIES: tuple[str, ...] = paper_strategy_names()
#: TP schedules: ``lpt`` (Algorithm 2 micro-groups), ``round-robin`` (ASC baseline hosts),
#: ``no-fuse`` (one task per group, the fusion ablation), ``sync`` (all-gather, every TP rank
#: recomputes: the SC baseline), ``lpt-carry`` (canzona's variant of Algorithm 2 whose
#: MinHeapSolver breaks ties by the load hosts carry from earlier groups).
TP_SCHEDULES: tuple[str, ...] = ("lpt", "round-robin", "no-fuse", "sync", "lpt-carry")
COSTS: tuple[str, ...] = ("numel", "memory", "flops")
#: a parameter's role in an FSDP2 plan, by kind: a matrix is a task hosted in the shard group, an
#: expert stack is updated where FSDP2 leaves it (whole experts per rank), the rest element-wise
SHARD_ROLES: dict[str, str] = {"matrix": "shard-task", "experts": "experts", "elementwise": "elementwise"}
BUFFERS: tuple[str, ...] = ("joint", "split")
FLOPS_SHAPES: tuple[str, ...] = ("full", "local")
#: the one FLOPs-shape default of the planner, the CLI, the figures and the notebooks: the work a
#: host really does (full shapes after the micro-group gather); ``local`` is the paper's accounting
DEFAULT_FLOPS_SHAPE = "full"


def _untimed(m: Metrics) -> tuple:
    """A metrics record without its wall-clock field, for plan equality."""
    return tuple(getattr(m, f.name) for f in fields(m) if f.name != "plan_seconds")


def _flag(value: Any) -> bool:
    _check(isinstance(value, bool), f"'transposed' must be true or false, got {value!r}")
    return value


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise PlanError(msg)


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """Everything a plan is a function of (besides the parameter specs)."""

    model: str
    layout: str
    dp: int
    tp: int
    optimizer: str
    strategy: str
    tp_schedule: str
    bucket_numel: int
    alpha: float = 1.0
    cost: str = "numel"
    flops_shape: str = DEFAULT_FLOPS_SHAPE
    cmax_bytes: int = 512 * 2**20
    grad_bytes: int = 4
    #: "joint": one buffer for every parameter; "split": matrix-optimizer parameters and element-wise
    #: ones in buffers of their own (the paper authors' layout), element-wise buckets in equal chunks
    buffers: str = "joint"
    #: the layout the plan is for (:data:`LAYOUT_KINDS`): "zero1" or "fsdp2". An FSDP2 plan has no
    #: buffer (``bucket_numel`` 0), ``dp = dp_replicate x dp_shard``, ``tp_schedule`` its strategy's
    #: schedule over the shard group (:func:`~canzona.plan.strategies.fsdp_schedule`), and costs
    #: full shapes (``flops_shape`` "full", ``alpha`` 1, ``buffers`` "joint")
    layout_kind: str = "zero1"
    #: FSDP2: ``fully_shard``'s dimension and the HSDP replicas (both 1 on the ZeRO-1 layout)
    dp_shard: int = 1
    dp_replicate: int = 1

    def __post_init__(self) -> None:
        _check(isinstance(self.dp, int) and self.dp >= 1, f"dp must be an integer >= 1, got {self.dp!r}")
        _check(isinstance(self.tp, int) and self.tp >= 1, f"tp must be an integer >= 1, got {self.tp!r}")
        _check(self.layout_kind in LAYOUT_KINDS, f"layout_kind must be one of {', '.join(LAYOUT_KINDS)}, got {self.layout_kind!r}")
        for k in ("dp_shard", "dp_replicate"):
            v = getattr(self, k)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{k} must be an integer >= 1, got {v!r}")
        if self.layout_kind == "fsdp2":
            self._check_fsdp2()
        else:
            _check(self.dp_shard == 1 and self.dp_replicate == 1, "dp_shard and dp_replicate are FSDP2 sizes; a zero1 plan has 1 for both")
            get_strategy(self.strategy)  # PlanError naming the registered strategies
            _check(self.tp_schedule in TP_SCHEDULES, f"unknown TP schedule {self.tp_schedule!r}; choose one of {', '.join(TP_SCHEDULES)}")
            _check(isinstance(self.bucket_numel, int) and self.bucket_numel >= 1, "bucket_numel must be a positive integer")
        _check(self.cost in COSTS, f"unknown cost model {self.cost!r}; choose one of {', '.join(COSTS)}")
        _check(self.flops_shape in FLOPS_SHAPES, f"flops_shape must be one of {', '.join(FLOPS_SHAPES)}")
        _check(
            isinstance(self.alpha, (int, float)) and 0.0 <= float(self.alpha) <= 1.0,
            f"alpha must be in [0, 1], got {self.alpha!r}",
        )
        _check(isinstance(self.cmax_bytes, int) and self.cmax_bytes >= 1, "cmax_bytes must be a positive integer")
        _check(self.grad_bytes in (2, 4, 8), "grad_bytes must be 2, 4 or 8")
        _check(self.buffers in BUFFERS, f"buffers must be one of {', '.join(BUFFERS)}, got {self.buffers!r}")

    def _check_fsdp2(self) -> None:
        fsdp_schedule(self.strategy)  # PlanError naming the FSDP2 strategies
        _check(
            self.dp == self.dp_shard * self.dp_replicate,
            f"an FSDP2 plan has dp = dp_replicate x dp_shard = {self.dp_replicate} x {self.dp_shard}, got dp={self.dp}",
        )
        _check(
            self.tp_schedule == fsdp_schedule(self.strategy),
            f"an FSDP2 {self.strategy} plan schedules {fsdp_schedule(self.strategy)!r}, got {self.tp_schedule!r}",
        )
        _check(self.bucket_numel == 0, "an FSDP2 plan has no ZeRO-1 buffer: bucket_numel must be 0")
        _check(
            self.flops_shape == "full" and self.alpha == 1.0 and self.buffers == "joint",
            "an FSDP2 plan costs full shapes with neither alpha nor split buffers (flops_shape 'full', alpha 1, buffers 'joint')",
        )

    @property
    def group_size(self) -> int:
        """Ranks among which a task's host is chosen: the TP group (zero1), the ``dp_shard x tp``
        shard group of one replica (fsdp2)."""
        return self.dp_shard * self.tp if self.layout_kind == "fsdp2" else self.tp

    @property
    def world(self) -> int:
        """Every rank the plan covers (``dp x tp``)."""
        return self.dp * self.tp


@dataclass(frozen=True, slots=True)
class ParamPlan:
    """Where one parameter lives in the buffer and who updates it."""

    spec: ParamSpec
    bucket: int | None  # None: no buffer (an FSDP2 plan)
    offset: int | None
    dp_owner: int | None
    role: str
    dp_ranges: tuple[tuple[int, int, int], ...] = ()
    tp_host: int | None = None
    micro_group: int | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def replicated(self) -> bool:
        """Every DP rank updates this parameter (no owner, no cut): the ``sc`` baseline."""
        return self.dp_owner is None and not self.dp_ranges

    @property
    def numel(self) -> int:
        """Elements in the buffer (the TP-local shard)."""
        return self.spec.local_numel


@dataclass(frozen=True, slots=True)
class Bucket:
    """One ZeRO-1 bucket: a contiguous slice of the flat buffer, its parameters, its DP cut points,
    the collective that combines its gradients (``reduce-scatter`` / ``all-reduce``) and how its
    updated values return (``all-gather`` / ``broadcast`` / ``none``)."""

    index: int
    start: int
    numel: int
    params: tuple[str, ...]
    collective: str
    param_return: str
    cuts: tuple[int, ...] = ()

    @property
    def reduce_scatter(self) -> bool:
        """Gradients are reduce-scattered on the cut points (else all-reduced whole)."""
        return self.collective == "reduce-scatter"

    def shard_sizes(self) -> tuple[int, ...]:
        """Elements each DP rank receives from this bucket's reduce-scatter (empty without cuts)."""
        return tuple(b - a for a, b in zip(self.cuts, self.cuts[1:]))


@dataclass(frozen=True, slots=True)
class MicroGroup:
    """One TP micro-group (Algorithm 2): tasks exchanged by one fused all-to-all each way."""

    index: int
    params: tuple[str, ...]
    hosts: tuple[int, ...]
    loads: tuple[float, ...]

    def __post_init__(self) -> None:
        _check(len(self.params) == len(self.hosts), f"micro-group {self.index}: params and hosts differ in length")


@dataclass(frozen=True, slots=True)
class Metrics:
    """Balance metrics (R_LB = max/mean) and objectives of Section 3.2; ``details`` holds
    JSON-serializable extras (per-rank loads, per-bucket communication balance, makespans)."""

    dp_memory_ratio: float
    dp_flops_ratio: float
    tp_memory_ratio: float
    tp_flops_ratio: float
    j_dp: float
    j_comm: float
    plan_seconds: float
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """A validated, deterministic partition plan for one (model, dp, tp, optimizer, strategy).

    Two plans are equal when they make the same decisions with the same metrics, whatever the time
    planning took (``metrics.plan_seconds`` is ignored); ``hash`` is the fingerprint's.
    """

    inputs: PlanInputs
    params: tuple[ParamPlan, ...]
    buckets: tuple[Bucket, ...]
    micro_groups: tuple[tuple[MicroGroup, ...], ...]
    metrics: Metrics

    #: name -> ParamPlan, built once on construction (not an input: excluded from __init__,
    #: equality and repr; to_dict and the fingerprint never read it)
    _index: dict[str, ParamPlan] = field(init=False, repr=False, compare=False)
    #: the fingerprint, computed once on first use (a plan is immutable)
    _fingerprint: str | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {p.spec.name: p for p in self.params})
        self.validate()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        if self is other:
            return True
        return (
            self.inputs == other.inputs
            and self.params == other.params
            and self.buckets == other.buckets
            and self.micro_groups == other.micro_groups
            and _untimed(self.metrics) == _untimed(other.metrics)
        )

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    @property
    def strategy(self) -> Strategy:
        """The record of the plan's strategy (for reports and the planner; the runtime reads the
        per-bucket and per-parameter fields instead)."""
        return get_strategy(self.inputs.strategy)

    @property
    def reduce_scatter(self) -> bool:
        """Whether the buckets reduce-scatter gradients (a plan's buckets all share one collective)."""
        return self.buckets[0].reduce_scatter

    @property
    def param_return(self) -> str:
        """How updated values return: ``all-gather``, ``broadcast`` or ``none`` (shared by all buckets)."""
        return self.buckets[0].param_return

    @property
    def every_rank_updates(self) -> bool:
        """Every DP rank updates every parameter (nothing returns; ``ParamPlan.replicated`` holds for all)."""
        return self.buckets[0].param_return == "none"

    # ----------------------------------------------------------------------------- lookups
    def param(self, name: str) -> ParamPlan:
        """The plan of parameter ``name`` (O(1)); KeyError when the plan has no such parameter."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(name) from None

    def by_name(self) -> dict[str, ParamPlan]:
        """A fresh name -> ParamPlan dict (the caller may change it)."""
        return dict(self._index)

    @property
    def specs(self) -> tuple[ParamSpec, ...]:
        return tuple(p.spec for p in self.params)

    def buffer_order(self) -> Iterator[ParamPlan]:
        """Parameters in flat-buffer order (bucket, then offset)."""
        return iter(sorted(self.params, key=lambda p: (p.bucket, p.offset)))

    @property
    def buffer_numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    # ----------------------------------------------------------------------------- invariants
    def validate(self) -> None:
        """Check the invariants every runtime relies on; raise :class:`PlanError` naming the first broken one.

        Each check is a named method, run in this order:

        - :meth:`_check_buckets`: buckets tile the buffer contiguously and hold exactly their
          parameters, back to back, with the collective and roles their strategy's record implies;
          cut points are monotone, span the bucket and exist exactly for reduce-scatter buckets;
        - :meth:`_check_owners`: every element of every bucket is covered exactly once by its
          owners (or every rank updates every parameter, when the strategy says so); only
          element-wise-role parameters are cut;
        - :meth:`_check_micro_groups` and :meth:`_check_tp_hosts`: each TP-split matrix parameter of
          a micro-group schedule is in exactly one group of its owner, hosted on a valid TP rank.

        Linear in the plan's size: a 1T-parameter MoE at DP 1024 has ~70k parameters and ~1M cut
        points, so every check is a dict lookup or a comparison, and an error message is only
        formatted once its check has failed (``if not ...: raise``, never an eager f-string).
        """
        if len(self._index) != len(self.params):
            raise PlanError("duplicate parameter names in plan")
        if self.inputs.layout_kind == "fsdp2":
            self._check_shard_params()
            self._check_shard_groups()
            return
        record = get_strategy(self.inputs.strategy)
        size = self._check_buckets(record)
        self._check_owners(record, size)
        grouped = self.inputs.tp > 1 and self.inputs.tp_schedule != "sync" and not record.sync_tp_only
        seen = self._check_micro_groups(grouped)
        self._check_tp_hosts(grouped, seen)

    def _check_buckets(self, record: Strategy) -> dict[str, int]:
        """Buckets tile the buffer and hold every parameter once; returns each parameter's local
        numel (a product over the shape, computed once here and read by the later checks)."""
        size: dict[str, int] = {}
        pos = 0
        for i, b in enumerate(self.buckets):
            if b.index != i:
                raise PlanError(f"bucket {i} has index {b.index}")
            if b.collective != record.grad_collective or b.param_return != record.param_return:
                raise PlanError(
                    f"bucket {i}: collective {b.collective!r} / params return {b.param_return!r}, but strategy "
                    f"{record.name} uses {record.grad_collective!r} / {record.param_return!r}"
                )
            if b.start != pos:
                raise PlanError(f"bucket {i} starts at {b.start}, expected {pos}")
            if not (b.numel >= 1 and b.params):
                raise PlanError(f"bucket {i} is empty")
            self._check_bucket_params(i, b, record, size)
            self._check_cuts(i, b, record)
            pos += b.numel
        if len(size) != len(self._index):  # size only holds known names, so this is set equality
            raise PlanError("some parameters are in no bucket")
        return size

    def _check_bucket_params(self, i: int, b: Bucket, record: Strategy, size: dict[str, int]) -> None:
        """Bucket ``i``'s parameters are known, placed back to back, met once, with their record's role."""
        off = 0
        for n in b.params:
            p = self._index.get(n)
            if p is None:
                raise PlanError(f"bucket {i} lists unknown parameter {n!r}")
            if p.role != param_role(record, p.spec.kind, p.spec.tp_split):
                raise PlanError(
                    f"{n}: role {p.role!r}, expected {param_role(record, p.spec.kind, p.spec.tp_split)!r} "
                    f"for a {p.spec.kind} parameter under {record.name}"
                )
            if p.bucket != i or p.offset != off:
                raise PlanError(f"{n}: placed at bucket {p.bucket} offset {p.offset}, expected bucket {i} offset {off}")
            if n in size:
                raise PlanError(f"{n} appears in two buckets")
            pn = size[n] = p.spec.local_numel
            off += pn
        if off != b.numel:
            raise PlanError(f"bucket {i}: parameters hold {off} elements, bucket says {b.numel}")

    def _check_cuts(self, i: int, b: Bucket, record: Strategy) -> None:
        """Reduce-scatter buckets have dp + 1 monotone cut points spanning the bucket; others none."""
        if not record.reduce_scatter:
            if b.cuts != ():
                raise PlanError(f"bucket {i}: strategy {record.name} all-reduces whole buckets and has no cuts")
            return
        c, dp = b.cuts, self.inputs.dp
        if len(c) != dp + 1:
            raise PlanError(f"bucket {i}: {len(c)} cut points, expected dp + 1 = {dp + 1}")
        if c[0] != 0 or c[-1] != b.numel:
            raise PlanError(f"bucket {i}: cuts must start at 0 and end at {b.numel}")
        # non-decreasing <=> already sorted (ints); timsort checks a sorted run in C
        if sorted(c) != list(c):
            raise PlanError(f"bucket {i}: cut points are not monotone: {c}")

    def _check_owners(self, record: Strategy, size: dict[str, int]) -> None:
        """Every parameter is updated by exactly the ranks its record says: all of them, one owner
        whose cut holds it, or (element-wise role only) ranges that tile it inside the owners' cuts."""
        if record.every_rank_updates:
            for p in self.params:
                if not p.replicated:
                    raise PlanError(f"{p.name}: every rank updates every parameter under {record.name}, so it has no owner")
            return
        for p in self.params:
            if p.dp_owner is not None:
                self._check_whole_owner(p, record, size[p.spec.name])
            else:
                self._check_ranges(p, record, size[p.spec.name])

    def _check_whole_owner(self, p: ParamPlan, record: Strategy, numel: int) -> None:
        n, owner, dp = p.spec.name, p.dp_owner, self.inputs.dp
        assert owner is not None
        if not 0 <= owner < dp:
            raise PlanError(f"{n}: owner {owner} outside dp={dp}")
        if p.dp_ranges:
            raise PlanError(f"{n}: has both an owner and ranges")
        if record.reduce_scatter:
            c = self.buckets[p.bucket].cuts
            lo, hi = c[owner], c[owner + 1]
            if not (lo <= p.offset and p.offset + numel <= hi):
                raise PlanError(f"{n}: owner {owner} holds [{lo}, {hi}) but the parameter spans [{p.offset}, {p.offset + numel})")

    def _check_ranges(self, p: ParamPlan, record: Strategy, numel: int) -> None:
        n, dp = p.spec.name, self.inputs.dp
        if not record.reduce_scatter:
            raise PlanError(f"{n}: {record.name} needs one owner per parameter")
        if not p.dp_ranges:
            raise PlanError(f"{n}: no owner and no ranges")
        unit = 1
        if p.role == "experts":
            unit = p.spec.local_numel // p.spec.shape[0]  # one expert: cuts only between experts
        elif p.role != "elementwise":
            raise PlanError(f"{n}: matrix parameters must be atomic under {record.name}")
        c = self.buckets[p.bucket].cuts
        expect = 0
        for r, s, e in p.dp_ranges:
            if not (s == expect and e > s):
                raise PlanError(f"{n}: ranges {p.dp_ranges} do not tile the parameter")
            if e % unit:
                raise PlanError(f"{n}: range {(r, s, e)} cuts an expert (experts hold {unit} elements each)")
            if not 0 <= r < dp:
                raise PlanError(f"{n}: range owner {r} outside dp={dp}")
            lo, hi = c[r], c[r + 1]
            if not (lo <= p.offset + s and p.offset + e <= hi):
                raise PlanError(f"{n}: range {(r, s, e)} outside rank {r}'s cut")
            expect = e
        if expect != numel:
            raise PlanError(f"{n}: ranges cover {expect} of {numel} elements")

    def _check_micro_groups(self, grouped: bool) -> set[str]:
        """One list of groups per DP rank (when grouped), each task once, hosted on a valid TP rank
        and agreeing with its parameter's plan; returns the grouped parameter names."""
        dp, tp = self.inputs.dp, self.inputs.tp
        if len(self.micro_groups) not in ((dp,) if grouped else (0, dp)):
            raise PlanError(f"micro_groups must have one entry per DP rank ({dp})")
        seen: set[str] = set()
        for r, groups in enumerate(self.micro_groups):
            for k, g in enumerate(groups):
                if g.index != k:
                    raise PlanError(f"dp rank {r}: micro-group {k} has index {g.index}")
                if len(g.loads) != tp:
                    raise PlanError(f"dp rank {r} group {k}: loads must have one entry per TP rank")
                for n, h in zip(g.params, g.hosts):
                    self._check_task(r, k, n, h, seen)
        return seen

    def _check_task(self, r: int, k: int, n: str, h: int, seen: set[str]) -> None:
        base, expert = split_task_name(n)
        p = self._index.get(base)
        if p is None:
            raise PlanError(f"micro-group lists unknown parameter {n!r}")
        if n in seen:
            raise PlanError(f"{n} is in two micro-groups")
        seen.add(n)
        if not 0 <= h < self.inputs.tp:
            raise PlanError(f"{n}: host {h} outside tp={self.inputs.tp}")
        if expert is not None:
            self._check_expert_task(r, n, p, expert)
            return
        if p.tp_host != h or p.micro_group != k:
            raise PlanError(f"{n}: tp_host/micro_group disagree with group {k}")
        if not p.replicated and p.dp_owner != r:
            raise PlanError(f"{n}: in a micro-group of dp rank {r} but owned by {p.dp_owner}")

    def _check_expert_task(self, r: int, n: str, p: ParamPlan, expert: int) -> None:
        """Task ``n`` is expert ``expert`` of a TP-split stack that dp rank ``r`` updates."""
        if p.role != "experts" or not p.spec.tp_split:
            raise PlanError(f"{n}: names an expert of {p.name}, which is not a TP-split expert stack")
        if not 0 <= expert < p.spec.shape[0]:
            raise PlanError(f"{n}: expert index outside the stack's {p.spec.shape[0]} experts")
        if p.replicated or p.dp_owner == r:
            return
        unit = p.spec.local_numel // p.spec.shape[0]
        if not any(q == r and a <= expert * unit < b for q, a, b in p.dp_ranges):
            raise PlanError(f"{n}: in a micro-group of dp rank {r}, which does not update that expert")

    def _check_tp_hosts(self, grouped: bool, seen: set[str]) -> None:
        """Every TP task of a grouped schedule is in a group (each expert of a TP-split stack
        too); nothing else has a host (an expert stack's hosts are its experts' groups)."""
        for p in self.params:
            if grouped and p.role == "experts" and p.spec.tp_split:
                lost = [k for k in range(p.spec.shape[0]) if expert_task_name(p.name, k) not in seen]
                if lost:
                    raise PlanError(f"{p.name}: expert {lost[0]} of a TP-split expert stack in no micro-group")
            if grouped and p.role == "tp-task":
                if p.spec.name not in seen:
                    raise PlanError(f"{p.spec.name}: TP-split matrix parameter in no micro-group")
            elif p.tp_host is not None or p.micro_group is not None:
                raise PlanError(f"{p.spec.name}: has a TP host but needs none")

    # ----------------------------------------------------------------------------- FSDP2 invariants
    def _check_shard_params(self) -> None:
        """An FSDP2 plan has no buffer: no bucket, offset, owner or ranges; each parameter's role is
        its kind's (``shard-task`` for a matrix); specs carry TP's split dim with ``tp`` 1 (TP's
        chunks may be uneven, :func:`canzona.plan.shard.piece_numels`)."""
        if self.buckets:
            raise PlanError("an FSDP2 plan has no ZeRO-1 buckets")
        for p in self.params:
            n, s = p.name, p.spec
            if (p.bucket, p.offset, p.dp_owner, p.dp_ranges) != (None, None, None, ()):
                raise PlanError(f"{n}: an FSDP2 plan places no parameter in a buffer (bucket, offset, owner and ranges must be empty)")
            if s.tp != 1 or s.transposed:
                raise PlanError(f"{n}: an FSDP2 plan's specs have tp 1 (tp_dim names TP's split dim) and no transposed weights")
            if p.role != SHARD_ROLES[s.kind]:
                raise PlanError(f"{n}: role {p.role!r}, expected {SHARD_ROLES[s.kind]!r} for a {s.kind} parameter on FSDP2")
            if s.kind == "matrix" and len(s.shape) != 2:
                raise PlanError(f"{n}: a matrix task on FSDP2 must be 2-D, got {s.shape}")
            if s.kind == "experts" and s.tp_dim not in (None, 1):
                raise PlanError(f"{n}: an expert stack on FSDP2 is whole per rank or cut, by its shard or by TP (tp_dim 1), got tp_dim {s.tp_dim}")

    def _check_shard_groups(self) -> None:
        """One list of micro-groups (the shard group's; every replica runs the same); each matrix, and
        each expert ``stack[e]`` of a stack cut (by its shard or by TP), in exactly one group, hosted on a rank of the shard group (-1, every rank, under ``sync``)."""
        if len(self.micro_groups) != 1:
            raise PlanError("an FSDP2 plan has one list of micro-groups (the shard group's)")
        n, sync = self.inputs.group_size, self.inputs.tp_schedule == "sync"
        seen: dict[str, tuple[int, int]] = {}
        for k, g in enumerate(self.micro_groups[0]):
            if g.index != k or len(g.loads) != n:
                raise PlanError(f"FSDP2 micro-group {k}: index {g.index}, {len(g.loads)} loads (expected index {k}, {n} loads)")
            for name, h in zip(g.params, g.hosts):
                if not ((h == -1) if sync else (0 <= h < n)):
                    raise PlanError(f"{name}: host {h} out of range for a shard group of {n}" + (" (sc: -1)" if sync else ""))
                if name in seen:
                    raise PlanError(f"{name} is in two micro-groups")
                seen[name] = (h, k)
        for p in self.params:
            if p.spec.kind == "experts" and p.spec.tp_dim is not None:  # cut (by its shard or TP): one task per expert
                missing = [t for e in range(p.spec.shape[0]) if seen.pop(t := expert_task_name(p.name, e), None) is None]
                if missing or (p.tp_host, p.micro_group) != (None, None):
                    raise PlanError(f"{p.name}: every expert of a cut stack is one micro-group task (missing {missing[:3]}), the stack itself none")
                continue
            want = seen.pop(p.name, (None, None))
            if (p.spec.kind == "matrix") != (want != (None, None)):
                raise PlanError(f"{p.name}: every matrix parameter of an FSDP2 plan is in exactly one micro-group, nothing else")
            if (p.tp_host, p.micro_group) != want:
                raise PlanError(f"{p.name}: host/group {(p.tp_host, p.micro_group)} disagree with the micro-groups {want}")
        if seen:
            raise PlanError(f"micro-group lists unknown parameter {next(iter(seen))!r}")

    def hosts(self) -> dict[str, int]:
        """Name -> host rank of every task in a micro-group (a TP rank under zero1, a shard-group
        rank under fsdp2, -1 for every rank under FSDP2's ``sc``)."""
        return {n: h for groups in self.micro_groups for g in groups for n, h in zip(g.params, g.hosts)}

    # ----------------------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        """The versioned plan document (see README, "Plan documents")."""
        inp = self.inputs
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "inputs": {f.name: getattr(inp, f.name) for f in fields(inp)},
            "params": [
                {
                    "name": p.name,
                    "shape": list(p.spec.shape),
                    "local_shape": list(p.spec.local_shape),
                    "tp_dim": p.spec.tp_dim,
                    "kind": p.spec.kind,
                    **({"transposed": True} if p.spec.transposed else {}),
                    **({"tp_blocks": p.spec.tp_blocks} if p.spec.tp_blocks > 1 else {}),
                    "bucket": p.bucket,
                    "offset": p.offset,
                    "numel": p.numel,
                    "dp_owner": p.dp_owner,
                    "role": p.role,
                    "dp_ranges": [list(r) for r in p.dp_ranges],
                    "tp_host": p.tp_host,
                    "micro_group": p.micro_group,
                }
                for p in self.params
            ],
            "buckets": [
                {"index": b.index, "start": b.start, "numel": b.numel, "collective": b.collective,
                 "param_return": b.param_return, "cuts": list(b.cuts), "params": list(b.params)}
                for b in self.buckets
            ],
            "micro_groups": {
                str(r): [
                    {"index": g.index, "params": list(g.params), "hosts": list(g.hosts), "loads": list(g.loads)}
                    for g in groups
                ]
                for r, groups in enumerate(self.micro_groups)
            },
            "metrics": {
                **{f.name: getattr(self.metrics, f.name) for f in fields(self.metrics) if f.name != "details"},
                "details": dict(self.metrics.details),
            },
        }

    @property
    def fingerprint(self) -> str:
        """sha256 over the plan's decisions (inputs, geometry, owners, roles, collectives, hosts);
        metrics excluded. Computed once per plan."""
        fp = self._fingerprint
        if fp is None:
            fp = self._digest(VERSION)
            object.__setattr__(self, "_fingerprint", fp)
        return fp

    def _digest(self, version: int) -> str:
        """The fingerprint as document ``version`` defined it (version 1 had no roles or collectives:
        a migrated version-1 document is checked against the fingerprint it was written with)."""
        inputs = {f.name: getattr(self.inputs, f.name) for f in fields(self.inputs)}
        if inputs["buffers"] == "joint":
            # added after documents were first written: a joint-buffer plan keeps the fingerprint it had
            del inputs["buffers"]
        if inputs["layout_kind"] == "zero1":
            # added with FSDP2 plans (version 3): a ZeRO-1 plan keeps the fingerprint it had
            for k in ("layout_kind", "dp_shard", "dp_replicate"):
                del inputs[k]
        doc: dict[str, Any] = {
            "inputs": inputs,
            "params": [
                [p.name, list(p.spec.shape), p.spec.tp_dim, p.spec.tp, p.spec.kind, p.bucket, p.offset, p.dp_owner,
                 [list(r) for r in p.dp_ranges], p.tp_host, p.micro_group]
                for p in self.params
            ],
            "buckets": [[b.start, b.numel, list(b.cuts), list(b.params)] for b in self.buckets],
            "groups": [[[list(g.params), list(g.hosts)] for g in gs] for gs in self.micro_groups],
        }
        transposed = [p.name for p in self.params if p.spec.transposed]
        if transposed:  # added later: plans without a stored-transposed weight keep their fingerprint
            doc["transposed"] = transposed
        packed = [[p.name, p.spec.tp_blocks] for p in self.params if p.spec.tp_blocks > 1]
        if packed:  # added later, the same way: plans without a packed stack keep their fingerprint
            doc["tp_blocks"] = packed
        if version >= 2:
            doc["roles"] = [p.role for p in self.params]
            doc["collectives"] = [[b.collective, b.param_return] for b in self.buckets]
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self, path: str | Path | None = None, *, indent: int | None = 1) -> str:
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            atomic_write(path, text + "\n")  # a failed write leaves the old document intact
        return text

    @classmethod
    def from_dict(cls, doc: Any) -> Plan:
        """Rebuild a plan from its document, strictly: wrong schema, version or shape is a PlanError.

        A version-1 document (no roles, no bucket collectives) is migrated: the missing fields are
        derived from its strategy's record, and its fingerprint is checked with the version-1 formula.
        """
        _check(isinstance(doc, dict), "a plan document must be a JSON object")
        _refuse_old_shard_document(doc)
        _check(doc.get("schema") == SCHEMA, f"not a plan document (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
        version = doc.get("version")
        _check(
            version in (1, 2, VERSION) and not isinstance(version, bool),
            f"unsupported plan version {version!r} (this canzona reads {VERSION} and 2, and migrates 1)",
        )
        try:
            inputs = PlanInputs(**doc["inputs"])
            shard = inputs.layout_kind == "fsdp2"
            _check(version == VERSION or not shard, f"an FSDP2 plan is a version-{VERSION} document, this one says {version}")
            tp = 1 if shard else inputs.tp  # FSDP2 specs keep TP's split dim with tp 1 (chunks may be uneven)
            record = None if shard else get_strategy(inputs.strategy)
            params = _params_from_doc(doc["params"], tp, version, record)
            buckets = tuple(
                Bucket(
                    index=int(b["index"]),
                    start=int(b["start"]),
                    numel=int(b["numel"]),
                    params=tuple(b["params"]),
                    collective=b["collective"] if version >= 2 else record.grad_collective,
                    param_return=b["param_return"] if version >= 2 else record.param_return,
                    cuts=tuple(int(c) for c in b["cuts"]),
                )
                for b in doc["buckets"]
            )
            mg = doc["micro_groups"]
            groups = tuple(
                tuple(
                    MicroGroup(
                        index=int(g["index"]),
                        params=tuple(g["params"]),
                        hosts=tuple(int(h) for h in g["hosts"]),
                        loads=tuple(float(x) for x in g["loads"]),
                    )
                    for g in mg[str(r)]
                )
                for r in range(len(mg))
            )
            m = dict(doc["metrics"])
            metrics = Metrics(**m)
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"malformed plan document: {type(exc).__name__}: {exc}") from None
        plan = cls(inputs=inputs, params=params, buckets=buckets, micro_groups=groups, metrics=metrics)
        if "fingerprint" in doc:
            _check(doc["fingerprint"] == plan._digest(version), "plan document fingerprint does not match its contents")
        return plan

    @classmethod
    def from_json(cls, path: str | Path) -> Plan:
        try:
            doc = read_json(path)
        except FileNotFoundError:
            raise PlanError(f"plan file not found: {path}") from None
        except OSError as exc:
            raise PlanError(f"cannot read plan file {path}: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise PlanError(str(exc)) from None
        return cls.from_dict(doc)


def _params_from_doc(rows: Any, tp: int, version: int, record: Strategy | None) -> tuple[ParamPlan, ...]:
    """The ``params`` entries of a document (a version-1 document's roles from its strategy's record)."""
    specs = [
        ParamSpec(
            name=q["name"], shape=tuple(q["shape"]), kind=q["kind"], tp_dim=q["tp_dim"], tp=tp,
            transposed=_flag(q.get("transposed", False)), tp_blocks=q.get("tp_blocks", 1),
        )
        for q in rows
    ]
    return tuple(
        ParamPlan(
            spec=spec,
            bucket=_opt_int(q["bucket"]),
            offset=_opt_int(q["offset"]),
            dp_owner=q["dp_owner"],
            role=q["role"] if version >= 2 else param_role(record, spec.kind, spec.tp_split),  # type: ignore[arg-type]
            dp_ranges=tuple(tuple(int(x) for x in r) for r in q["dp_ranges"]),  # type: ignore[misc]
            tp_host=q["tp_host"],
            micro_group=q["micro_group"],
        )
        for spec, q in zip(specs, rows)
    )


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


def _refuse_old_shard_document(doc: dict[str, Any]) -> None:
    """The separate FSDP2 plan document of earlier versions is not read: one line saying how to
    plan again (FSDP2 plans are now version-3 ``canzona.plan`` documents)."""
    if doc.get("schema") != OLD_SHARD_SCHEMA:
        return
    i = doc.get("inputs") if isinstance(doc.get("inputs"), dict) else {}
    flags = " ".join(
        f"--{flag} {i[k]}" for flag, k in (("model", "model"), ("fsdp", "dp_shard"), ("tp", "tp"), ("dp-replicate", "dp_replicate"), ("strategy", "strategy"))
        if isinstance(i.get(k), (str, int))
    )
    raise PlanError(
        f"this is an FSDP2 plan document of an earlier canzona (schema {OLD_SHARD_SCHEMA!r}, version {doc.get('version')!r}), "
        f"which this canzona no longer reads; plan again with `canzona plan {flags or '--model M --fsdp N'} --json PATH` "
        "(or let DistributedOptimizer plan with plan=None)"
    )
