"""DP strategies as data: one frozen record per strategy and a registry the planner dispatches through.

A :class:`Strategy` says how a strategy moves things (the gradient collective of every bucket, how
updated parameters return, who updates what) and which partitioner places parameters on DP ranks.
The planner copies what the runtime needs into the plan itself (per bucket its collective, per
parameter its role and owner), so nothing downstream of the planner reads a strategy's name: a new
strategy is a planner-only change, :func:`register_strategy` with a record and a partitioner.

The shipped strategies (Section 5 of the paper compares the first five):

======================  ==============  =============  ========  ========  ===========  =========
name                    gradients       params return  everyone  atomic    elementwise  TP
======================  ==============  =============  ========  ========  ===========  =========
``zero1``               reduce-scatter  all-gather     no        no        yes          sync
``sc``                  all-reduce      none           yes       yes       no           sync
``layerwise``           all-reduce      broadcast      no        yes       no           sync
``asc``                 reduce-scatter  all-gather     no        yes       no           round-robin
``lb-asc``              reduce-scatter  all-gather     no        yes       no           lpt-carry
``lb-asc-joint``        reduce-scatter  all-gather     no        yes       no           lpt-carry
======================  ==============  =============  ========  ========  ===========  =========

``lb-asc`` runs Algorithm 2 with host loads carried across micro-groups (``lpt-carry``): the
algorithm as written (``lpt``, still selectable) restarts every group's heap from zero, so each
one-task group (a matrix larger than C_max) lands on TP rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from canzona.plan import dp as dpmod
from canzona.plan.buckets import BufferLayout
from canzona.plan.dp import DPAssignment
from canzona.plan.errors import PlanError

__all__ = [
    "GRAD_COLLECTIVES",
    "PARAM_RETURNS",
    "ROLES",
    "PartitionInput",
    "Partitioner",
    "Strategy",
    "register_strategy",
    "unregister_strategy",
    "get_strategy",
    "strategy_names",
    "paper_strategy_names",
    "param_role",
    "FSDP_STRATEGIES",
    "fsdp_schedule",
]

#: how a bucket's gradients are combined across DP ranks
GRAD_COLLECTIVES: tuple[str, ...] = ("reduce-scatter", "all-reduce")
#: how updated parameter values reach the ranks that did not compute them
PARAM_RETURNS: tuple[str, ...] = ("all-gather", "broadcast", "none")
#: a parameter's role in the optimizer step: a matrix updated whole by its DP owner, a TP-split
#: matrix (a task: gathered to a host, or to every TP rank under the ``sync`` schedule), or an
#: element-wise parameter (any optimizer that may see a cut piece, AdamW by default), or a stack of
#: expert matrices (``E`` matrix tasks of shape ``(M, N)``, owned whole or cut at expert boundaries)
ROLES: tuple[str, ...] = ("matrix", "tp-task", "elementwise", "experts", "shard-task")
# (``shard-task`` is a role of FSDP2 plans only: a matrix hosted by one rank of its shard group)

#: the strategies an FSDP2 plan serves, each with the micro-group schedule of its matrix tasks
#: over the shard group (``zero1`` and ``layerwise`` need canzona's own ZeRO-1 buffer):
#: ``lb-asc`` Algorithm 2 with host loads carried across groups, ``asc`` round-robin hosts in name
#: order (the peers' scheme: muon-fsdp2, dion), ``no-fuse`` one task per exchange (the fusion
#: ablation), ``sc`` no hosts (every rank gathers every full gradient and recomputes every update)
_FSDP_SCHEDULES = {"lb-asc": "lpt-carry", "asc": "round-robin", "sc": "sync", "no-fuse": "no-fuse"}
FSDP_STRATEGIES: tuple[str, ...] = tuple(_FSDP_SCHEDULES)


@dataclass(frozen=True, slots=True, eq=False)
class PartitionInput:
    """What a DP partitioner may read: the buffer layout and per-parameter arrays in buffer order."""

    layout: BufferLayout
    dp: int
    cost: np.ndarray  # W(p) under the plan's cost model
    flops: np.ndarray
    memory: np.ndarray
    alpha: float
    names: Sequence[str]
    elementwise: np.ndarray  # bool: parameter is element-wise (may be cut)
    #: each DP rank's load before planning (expert parallelism's experts, canzona.plan.ep); None: zeros
    preload: np.ndarray | None = None


#: a partitioner places parameters on DP ranks: cut points per bucket (empty for all-reduce
#: strategies) and an owner per parameter in buffer order (-1: cut, or updated by every rank)
Partitioner = Callable[[PartitionInput], DPAssignment]


@dataclass(frozen=True, slots=True)
class Strategy:
    """One DP strategy's semantics. ``partition`` is excluded from equality (functions compare by identity)."""

    name: str
    grad_collective: str
    param_return: str
    every_rank_updates: bool
    atomic_matrices: bool
    elementwise_only: bool
    default_tp_schedule: str
    in_paper: bool
    description: str
    partition: Partitioner = field(compare=False, repr=False)
    #: the partitioner reads ``PlanInputs.alpha`` (Algorithm 1's blend of load and communication
    #: balance); front ends offer the alpha knob (and sweeps) only for such strategies
    uses_alpha: bool = False

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise PlanError("a strategy needs a non-empty name")
        if self.grad_collective not in GRAD_COLLECTIVES:
            raise PlanError(f"strategy {self.name}: grad_collective must be one of {', '.join(GRAD_COLLECTIVES)}")
        if self.param_return not in PARAM_RETURNS:
            raise PlanError(f"strategy {self.name}: param_return must be one of {', '.join(PARAM_RETURNS)}")
        # the buffer's collectives fix what can come back: a reduce-scatter leaves each rank its own
        # cut, so values return by the matching all-gather; an all-reduce leaves every rank the whole
        # gradient, so either every rank updates (nothing returns) or owners broadcast
        if self.grad_collective == "reduce-scatter" and self.param_return != "all-gather":
            raise PlanError(f"strategy {self.name}: a reduce-scatter strategy returns parameters by all-gather")
        if self.grad_collective == "all-reduce" and self.param_return == "all-gather":
            raise PlanError(f"strategy {self.name}: an all-reduce strategy has no cuts to all-gather")
        if self.every_rank_updates != (self.param_return == "none"):
            raise PlanError(f"strategy {self.name}: parameters return by 'none' exactly when every rank updates")
        if not self.atomic_matrices and not self.elementwise_only:
            raise PlanError(f"strategy {self.name}: a matrix optimizer cannot update a cut matrix (set elementwise_only)")
        if not callable(self.partition):
            raise PlanError(f"strategy {self.name}: partition must be callable")

    @property
    def reduce_scatter(self) -> bool:
        return self.grad_collective == "reduce-scatter"

    @property
    def sync_tp_only(self) -> bool:
        """Whether the only TP schedule is ``sync``: when every rank recomputes every update, or when
        no parameter is a matrix task (element-wise only), there is nothing to host."""
        return self.every_rank_updates or self.elementwise_only


def param_role(strategy: Strategy, kind: str, tp_split: bool) -> str:
    """The role (see :data:`ROLES`) a parameter of ``kind`` plays under ``strategy``."""
    if strategy.elementwise_only or kind == "elementwise":
        return "elementwise"
    if kind == "experts":
        return "experts"
    return "tp-task" if tp_split else "matrix"


def fsdp_schedule(strategy: str) -> str:
    """The micro-group schedule of an FSDP2 strategy (the one place an FSDP2 plan reads a strategy
    name); PlanError naming the choices for any other strategy."""
    if strategy not in _FSDP_SCHEDULES:
        raise PlanError(f"strategy {strategy!r} does not run on FSDP2; choose one of {', '.join(FSDP_STRATEGIES)}")
    return _FSDP_SCHEDULES[strategy]


# ------------------------------------------------------------------------------------ registry
_REGISTRY: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy, *, replace: bool = False) -> Strategy:
    """Add ``strategy`` to the registry (``replace=True`` to overwrite a name); returns it."""
    if not isinstance(strategy, Strategy):
        raise TypeError(f"register_strategy takes a Strategy, got {type(strategy).__name__}")
    if strategy.name in _REGISTRY and not replace:
        raise PlanError(f"strategy {strategy.name!r} is already registered")
    _REGISTRY[strategy.name] = strategy
    return strategy


def unregister_strategy(name: str) -> None:
    """Remove a registered strategy (tests and plug-ins); unknown names raise PlanError."""
    if name in _BUILTIN:
        raise PlanError(f"strategy {name!r} ships with canzona and cannot be removed")
    if _REGISTRY.pop(name, None) is None:
        raise PlanError(f"strategy {name!r} is not registered")


def get_strategy(name: str) -> Strategy:
    """The record of strategy ``name``; PlanError naming the choices when there is none."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise PlanError(f"unknown strategy {name!r}; choose one of {', '.join(_REGISTRY)}") from None


def strategy_names() -> tuple[str, ...]:
    """Every registered strategy name, shipped ones first, in registration order."""
    return tuple(_REGISTRY)


def paper_strategy_names() -> tuple[str, ...]:
    """The strategies the paper defines (its baselines and Canzona itself)."""
    return tuple(n for n, s in _REGISTRY.items() if s.in_paper)


# ------------------------------------------------------------------------------------ shipped
def _zero1(x: PartitionInput) -> DPAssignment:
    return dpmod.zero1(x.layout, x.dp)


def _sc(x: PartitionInput) -> DPAssignment:
    return dpmod.sc(x.layout, x.dp)


def _layerwise(x: PartitionInput) -> DPAssignment:
    return dpmod.layerwise(x.layout, x.dp, x.cost, list(x.names), x.preload)


def _asc(x: PartitionInput) -> DPAssignment:
    return dpmod.asc(x.layout, x.dp)


def _lb_asc(x: PartitionInput) -> DPAssignment:
    return dpmod.lb_asc(x.layout, x.dp, x.cost, float(x.alpha), x.preload)


def _lb_asc_joint(x: PartitionInput) -> DPAssignment:
    return dpmod.lb_asc_joint(x.layout, x.dp, x.flops, x.memory, x.elementwise)


_SHIPPED = (
    Strategy(
        name="zero1",
        grad_collective="reduce-scatter",
        param_return="all-gather",
        every_rank_updates=False,
        atomic_matrices=False,
        elementwise_only=True,
        default_tp_schedule="sync",
        in_paper=True,
        description="ZeRO-1 reference: equal chunks cut anywhere, so only an element-wise optimizer (AdamW) can run",
        partition=_zero1,
    ),
    Strategy(
        name="sc",
        grad_collective="all-reduce",
        param_return="none",
        every_rank_updates=True,
        atomic_matrices=True,
        elementwise_only=False,
        default_tp_schedule="sync",
        in_paper=True,
        description="synchronous compute: all-reduce gradients, every rank recomputes every update",
        partition=_sc,
    ),
    Strategy(
        name="layerwise",
        grad_collective="all-reduce",
        param_return="broadcast",
        every_rank_updates=False,
        atomic_matrices=True,
        elementwise_only=False,
        default_tp_schedule="sync",
        in_paper=True,
        description="NV-layerwise: LPT of whole layers to ranks, all-reduce gradients, owners broadcast parameters",
        partition=_layerwise,
    ),
    Strategy(
        name="asc",
        grad_collective="reduce-scatter",
        param_return="all-gather",
        every_rank_updates=False,
        atomic_matrices=True,
        elementwise_only=False,
        default_tp_schedule="round-robin",
        in_paper=True,
        description="ASC: cut points snapped to parameter boundaries without load balancing",
        partition=_asc,
    ),
    Strategy(
        name="lb-asc",
        grad_collective="reduce-scatter",
        param_return="all-gather",
        every_rank_updates=False,
        atomic_matrices=True,
        elementwise_only=False,
        default_tp_schedule="lpt-carry",
        in_paper=True,
        description="LB-ASC (Canzona): alpha-balanced static partitioning (Algorithm 1) and micro-groups (Algorithm 2)",
        partition=_lb_asc,
        uses_alpha=True,
    ),
    Strategy(
        name="lb-asc-joint",
        grad_collective="reduce-scatter",
        param_return="all-gather",
        every_rank_updates=False,
        atomic_matrices=True,
        elementwise_only=False,
        default_tp_schedule="lpt-carry",
        in_paper=False,
        description="beyond the paper: FLOPs and memory balanced together, element-wise parameters cut, host loads carried",
        partition=_lb_asc_joint,
    ),
)
for _s in _SHIPPED:
    register_strategy(_s)
_BUILTIN = frozenset(s.name for s in _SHIPPED)
