"""Plans for the FSDP2 path: which rank of a shard group hosts each matrix update, batched how.

Under PyTorch's FSDP2 (``fully_shard``) every parameter is a DTensor cut along dim 0 over the
``dp_shard`` mesh dimension (and, with tensor parallelism, along its TP dim over ``tp``), so no
rank holds a whole matrix. Canzona applies its TP answer (Section 4 of the paper) to the shard
dimension: every matrix parameter is a *task* with one *host* in its *shard group* (the
``dp_shard x tp`` ranks of one replica, flattened), which receives the pieces in one fused
all-to-all per micro-group, runs the optimizer on the full tensor with state it keeps, and sends
the updated values back. Element-wise parameters are updated where they lie, on every rank's
own piece. Each ``dp_replicate`` replica runs the same step on identical gradients (HSDP
all-reduces them), so one replica's plan is every replica's plan.

Strategies map onto the micro-group schedules of :mod:`canzona.plan.tp`
(:func:`fsdp_schedule` is the one place that reads a strategy name):

* ``lb-asc``  Algorithm 2 micro-groups with host loads carried across groups (``lpt-carry``);
* ``asc``     round-robin hosts in name order (the peers' scheme: muon-fsdp2, dion), groups
              packed under C_max;
* ``no-fuse`` one task per exchange, hosts by least cumulative load (the fusion ablation);
* ``sc``      no hosts: every rank all-gathers every full gradient and recomputes every update
              (full state on every rank); exchanges chunked under C_max.

Costs: a task's load is :func:`canzona.cost.param_cost` on its full shape (the host computes the
whole update). C_max bounds the bytes of full gradient a host receives in one group.

The plan is pure (no torch.distributed), deterministic (ties by name), frozen and versioned:
``to_dict``/``to_json`` write document ``schema = "canzona.fsdp_plan"``, ``version = 1``, with a
fingerprint over everything but the planning time. Its metrics count every rank of the mesh:
per rank, optimizer FLOPs and state bytes of the matrices it hosts plus AdamW on its pieces of
the element-wise parameters, the max/mean ratios, and the atomic lower bound (largest single
matrix task / mean: matrices are not cut, so no schedule can go below it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from canzona.cost import COST_MODELS, OPTIMIZERS, adamw_flops, matrix_flops, param_cost, state_bytes
from canzona.plan.tp import Task, schedule_tasks
from canzona.specs import ParamSpec

__all__ = [
    "FSDP_STRATEGIES",
    "SCHEMA",
    "VERSION",
    "FSDPGroup",
    "FSDPInputs",
    "FSDPParam",
    "FSDPPlan",
    "fsdp_schedule",
    "piece_numels",
    "params_from_specs",
    "plan_fsdp",
    "plan_fsdp_model",
]

SCHEMA = "canzona.fsdp_plan"
VERSION = 1
#: strategies the FSDP2 path serves (``zero1``/``layerwise`` need canzona's own ZeRO-1 buffer)
FSDP_STRATEGIES: tuple[str, ...] = ("lb-asc", "asc", "sc", "no-fuse")
_SCHEDULES = {"lb-asc": "lpt-carry", "asc": "round-robin", "no-fuse": "no-fuse", "sc": "sync"}


def fsdp_schedule(strategy: str) -> str:
    """The micro-group schedule of an FSDP2 strategy (the only strategy-name read on this path)."""
    if strategy not in _SCHEDULES:
        raise ValueError(f"strategy {strategy!r} does not run on FSDP2; choose one of {', '.join(FSDP_STRATEGIES)}")
    return _SCHEDULES[strategy]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


@dataclass(frozen=True, slots=True)
class FSDPInputs:
    """What a plan was made from. ``dp_shard * tp`` ranks form one shard group (one replica);
    ``dp_replicate`` replicas repeat it. ``cmax_bytes`` bounds a host's received full gradients
    per micro-group (``grad_bytes`` per element)."""

    model: str
    dp_shard: int
    tp: int = 1
    dp_replicate: int = 1
    optimizer: str = "muon"
    strategy: str = "lb-asc"
    cost: str = "numel"
    cmax_bytes: int = 512 * 2**20
    grad_bytes: int = 4

    def __post_init__(self) -> None:
        for k in ("dp_shard", "tp", "dp_replicate", "cmax_bytes", "grad_bytes"):
            v = getattr(self, k)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{k} must be an int >= 1, got {v!r}")
        _check(self.optimizer in OPTIMIZERS, f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        _check(self.cost in COST_MODELS, f"unknown cost model {self.cost!r}; choose one of {', '.join(COST_MODELS)}")
        fsdp_schedule(self.strategy)

    @property
    def group_size(self) -> int:
        """Ranks of one shard group (``dp_shard x tp``)."""
        return self.dp_shard * self.tp

    @property
    def world(self) -> int:
        return self.dp_replicate * self.group_size

    @property
    def schedule(self) -> str:
        return fsdp_schedule(self.strategy)


@dataclass(frozen=True, slots=True)
class FSDPParam:
    """One parameter: full shape, kind, TP split dim (None: replicated over ``tp``) and, for a
    matrix, its host's rank in the shard group (-1: every rank computes it, under ``sc``)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    tp_dim: int | None = None
    host: int | None = None
    group: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class FSDPGroup:
    """One micro-group: tasks in exchange order and their hosts (-1: all ranks, ``sc``)."""

    names: tuple[str, ...]
    hosts: tuple[int, ...]


def _chunks(n: int, parts: int) -> list[int]:
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
            s[tp_dim] = _chunks(shape[tp_dim], tp)[t]
        tp_pieces.append((_chunks(s[0], dp_shard), math.prod(s[1:])))
    return [rows[d] * rest for d in range(dp_shard) for rows, rest in tp_pieces]


@dataclass(frozen=True, slots=True)
class FSDPPlan:
    """A frozen FSDP2 plan (see the module docstring). ``metrics`` is JSON-able."""

    inputs: FSDPInputs
    params: tuple[FSDPParam, ...]
    groups: tuple[FSDPGroup, ...]
    metrics: Mapping[str, Any] = field(default_factory=dict)
    plan_seconds: float = 0.0

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        _check(len(set(names)) == len(names), "parameter names must be unique")
        n = self.inputs.group_size
        sync = self.inputs.schedule == "sync"
        in_groups: list[str] = []
        for g in self.groups:
            _check(len(g.names) == len(g.hosts), "a micro-group needs one host per task")
            for h in g.hosts:
                _check((h == -1) if sync else (0 <= h < n), f"host {h} out of range for a shard group of {n}")
            in_groups += g.names
        matrices = [p.name for p in self.params if p.kind == "matrix"]
        _check(sorted(in_groups) == sorted(matrices), "every matrix parameter must be in exactly one micro-group")
        where = {n: (h, k) for k, g in enumerate(self.groups) for n, h in zip(g.names, g.hosts)}
        for p in self.params:
            if p.kind == "matrix":
                _check((p.host, p.group) == where[p.name], f"{p.name}: host/group {(p.host, p.group)} disagree with the micro-groups {where[p.name]}")
            else:
                _check(p.host is None and p.group is None, f"{p.name}: an element-wise parameter has no host")

    def by_name(self) -> dict[str, FSDPParam]:
        return {p.name: p for p in self.params}

    def hosts(self) -> dict[str, int]:
        """Host (shard-group rank; -1 under ``sc``) of every matrix parameter."""
        return {n: h for g in self.groups for n, h in zip(g.names, g.hosts)}

    # ---- document
    def _body(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "inputs": asdict(self.inputs),
            "params": [
                {"name": p.name, "shape": list(p.shape), "kind": p.kind, "tp_dim": p.tp_dim, "host": p.host, "group": p.group}
                for p in self.params
            ],
            "groups": [{"names": list(g.names), "hosts": list(g.hosts)} for g in self.groups],
            "metrics": dict(self.metrics),
        }

    @property
    def fingerprint(self) -> str:
        """16 hex digits over the document (planning time excluded): equal plans, equal prints."""
        text = json.dumps(self._body(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        doc = self._body()
        doc["fingerprint"] = self.fingerprint
        doc["plan_seconds"] = self.plan_seconds
        return doc

    def to_json(self, path: str | os.PathLike[str] | None = None, *, indent: int | None = 1) -> str:
        """The document as JSON text; with ``path``, also written there atomically (temp file +
        rename, so a reader never sees half a plan)."""
        text = json.dumps(self.to_dict(), indent=indent)
        if path is not None:
            target = Path(path)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    fh.write(text + "\n")
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return text

    @classmethod
    def from_dict(cls, doc: Any) -> FSDPPlan:
        """Rebuild a plan from its document, strictly (ValueError on any mismatch, including a
        fingerprint that does not match the content)."""
        _check(isinstance(doc, dict), "an FSDP plan document must be a JSON object")
        _check(doc.get("schema") == SCHEMA, f"not an FSDP plan document (schema {doc.get('schema')!r}, expected {SCHEMA!r})")
        _check(doc.get("version") == VERSION, f"unsupported FSDP plan version {doc.get('version')!r} (this canzona reads {VERSION})")
        try:
            inputs = FSDPInputs(**doc["inputs"])
            params = tuple(
                FSDPParam(q["name"], tuple(int(x) for x in q["shape"]), q["kind"], q["tp_dim"], q["host"], q["group"])
                for q in doc["params"]
            )
            groups = tuple(FSDPGroup(tuple(g["names"]), tuple(int(h) for h in g["hosts"])) for g in doc["groups"])
            plan = cls(inputs, params, groups, dict(doc["metrics"]), float(doc.get("plan_seconds", 0.0)))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed FSDP plan document: {exc}") from None
        _check(doc.get("fingerprint") == plan.fingerprint, "FSDP plan document fingerprint does not match its content")
        return plan


def _task_cost(p: FSDPParam, inputs: FSDPInputs) -> float:
    # the host processes the full tensor: cost it on the full shape, not split over tp
    return param_cost(ParamSpec(p.name, p.shape, "matrix"), inputs.cost, inputs.optimizer)


def _sync_groups(tasks: Sequence[FSDPParam], cmax_bytes: int, grad_bytes: int) -> list[FSDPGroup]:
    groups: list[FSDPGroup] = []
    cur: list[str] = []
    size = 0
    for t in tasks:
        nbytes = t.numel * grad_bytes
        if cur and size + nbytes > cmax_bytes:
            groups.append(FSDPGroup(tuple(cur), (-1,) * len(cur)))
            cur, size = [], 0
        cur.append(t.name)
        size += nbytes
    if cur:
        groups.append(FSDPGroup(tuple(cur), (-1,) * len(cur)))
    return groups


def _metrics(params: Sequence[FSDPParam], inputs: FSDPInputs) -> dict[str, Any]:
    """Per-rank optimizer FLOPs and state bytes over one shard group (every replica is the same),
    their max/mean ratios and the atomic lower bounds (largest matrix task / mean)."""
    n, opt = inputs.group_size, inputs.optimizer
    flops = [0.0] * n
    mem = [0.0] * n
    task_flops: list[float] = []
    task_mem: list[float] = []
    for p in params:
        if p.kind == "matrix":
            f, b = float(matrix_flops(opt, p.shape)), float(state_bytes(opt, p.shape))
            task_flops.append(f)
            task_mem.append(b)
            ranks = range(n) if p.host == -1 else [p.host]
            for r in ranks:
                flops[r] += f
                mem[r] += b
        else:
            # AdamW on each rank's own piece: 13 flops and two fp32 moments per element
            for r, k in enumerate(piece_numels(p.shape, p.tp_dim, inputs.dp_shard, inputs.tp)):
                flops[r] += adamw_flops(k)
                mem[r] += 2 * k * 4

    def ratio(xs: Sequence[float]) -> float:
        mean = sum(xs) / len(xs)
        return max(xs) / mean if mean > 0 else 1.0

    def bound(largest: float, xs: Sequence[float]) -> float:
        mean = sum(xs) / len(xs)
        return max(1.0, largest / mean) if mean > 0 else 1.0

    return {
        "ranks": inputs.world,
        "group_size": n,
        "n_matrix_tasks": len(task_flops),
        "n_micro_groups": 0,
        "flops_per_rank": flops,
        "state_bytes_per_rank": mem,
        "flops_max": max(flops),
        "flops_mean": sum(flops) / n,
        "flops_ratio": ratio(flops),
        "flops_bound": bound(max(task_flops, default=0.0), flops),
        "memory_max": max(mem),
        "memory_mean": sum(mem) / n,
        "memory_ratio": ratio(mem),
        "memory_bound": bound(max(task_mem, default=0.0), mem),
    }


def plan_fsdp(params: Sequence[FSDPParam], inputs: FSDPInputs) -> FSDPPlan:
    """Plan the FSDP2 optimizer step of ``params`` (hosts and groups ignored on input)."""
    t0 = time.perf_counter()
    base = [FSDPParam(p.name, tuple(p.shape), p.kind, p.tp_dim) for p in params]
    for p in base:
        _check(p.kind in ("matrix", "elementwise", "experts"), f"{p.name}: kind must be 'matrix', 'elementwise' or 'experts', got {p.kind!r}")
        _check(p.kind != "matrix" or len(p.shape) == 2, f"{p.name}: a matrix parameter must be 2-D, got {p.shape}")
        # an expert stack sharded on its expert dim gives each rank whole experts: updated where
        # they live, no micro-group (the front end refuses stacks cut any other way)
        _check(p.kind != "experts" or (len(p.shape) == 3 and p.tp_dim is None), f"{p.name}: an expert stack must be 3-D and not TP-split, got {p.shape}")
    matrices = [p for p in base if p.kind == "matrix"]
    if inputs.schedule == "sync":
        groups = _sync_groups(matrices, inputs.cmax_bytes, inputs.grad_bytes)
    else:
        tasks = [Task(p.name, _task_cost(p, inputs), p.numel * inputs.grad_bytes) for p in matrices]
        groups = [FSDPGroup(g.names, g.hosts) for g in schedule_tasks(tasks, inputs.group_size, inputs.schedule, inputs.cmax_bytes)]
    where = {n: (h, k) for k, g in enumerate(groups) for n, h in zip(g.names, g.hosts)}
    planned = tuple(
        FSDPParam(p.name, p.shape, p.kind, p.tp_dim, *where[p.name]) if p.name in where else p for p in base
    )
    metrics = _metrics(planned, inputs)
    metrics["n_micro_groups"] = len(groups)
    return FSDPPlan(inputs, planned, tuple(groups), metrics, time.perf_counter() - t0)


def params_from_specs(specs: Sequence[ParamSpec]) -> list[FSDPParam]:
    """:class:`FSDPParam` records (unplanned) from planner specs (TP split dim kept)."""
    return [FSDPParam(s.name, tuple(s.shape), s.kind, s.tp_dim if s.tp_split else None) for s in specs]



def plan_fsdp_model(
    model: Any,
    *,
    dp_shard: int,
    tp: int = 1,
    dp_replicate: int = 1,
    layout: str = "hf",
    optimizer: str = "muon",
    strategy: str = "lb-asc",
    cost: str = "numel",
    cmax_bytes: int | None = None,
    experts: str = "separate",
) -> FSDPPlan:
    """Plan a shipped model (name), a config file (path) or a ``ModelConfig`` for FSDP2 over
    ``dp_replicate x dp_shard x tp`` ranks. ``layout="hf"`` (separate q/k/v and gate/up, as
    torchtitan's models) is the FSDP default; ``megatron`` fuses them. A MoE config's experts are
    planned as ``separate`` 2-D matrices here (the FSDP2 step simulator models 2-D matrices only);
    ``experts="stacked"`` gives the ``(E, M, N)`` stacks the FSDP2 runtime updates where they live.
    ``cmax_bytes`` None: the planner's default C_max (:data:`canzona.plan.DEFAULT_CMAX` TP-local
    elements per host)."""
    from canzona.plan.build import DEFAULT_CMAX, cmax_to_bytes, resolve_model
    from canzona.specs import specs_from_config

    cfg = resolve_model(model)
    for k, v in (("dp_shard", dp_shard), ("tp", tp), ("dp_replicate", dp_replicate)):
        _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{k} must be an integer >= 1, got {v!r}")
    # ParamSpec checks TP divisibility; FSDP2's own dim-0 chunking may be uneven (any size works)
    specs = specs_from_config(cfg, tp=tp, layout=layout, experts=experts)
    if cmax_bytes is None:
        cmax_bytes = cmax_to_bytes(DEFAULT_CMAX, tp)
    inputs = FSDPInputs(cfg.name, dp_shard, tp, dp_replicate, optimizer, strategy, cost, cmax_bytes)
    return plan_fsdp(params_from_specs(specs), inputs)
