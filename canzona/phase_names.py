"""The registry of phase names: every NVTX / ``torch.profiler.record_function`` range canzona opens.

The runtime opens these ranges (:mod:`canzona.runtime.phases`); the trace summary, the figures
and the training loop read them. Call sites spell a name *literally*
(``phase(f"canzona/dp/all_gather/bucket{i}/wait")``), so a grep for the text of a name in a trace
(``dp/all_gather``) lands on the line that opens it; this module lists the names that may be
opened, and ``tests/test_phase_names.py`` checks both ways (every literal in the code is
registered here, every registered name is opened somewhere).

Shape of a name: ``canzona/<dimension>/<what>[/<index>][/<stage>]``

- ``<dimension>/<what>`` says what moves or runs on which dimension of the mesh: ``dp/...`` the
  ZeRO-1 buffer's collectives over the data-parallel group (Section 3 of the paper), ``tp/...``
  the micro-group exchange over a TP group (Section 4), ``shard/...`` the same exchange over an
  FSDP2 parameter's shard group (``dp_shard``, flattened with ``tp`` when the mesh has one),
  ``layerwise/broadcast`` the NV-layerwise baseline, ``status`` the agreement of errors and
  flags; ``forward``, ``backward`` and ``optimizer/step`` frame an iteration.
- The micro-group exchange engine (:mod:`canzona.runtime.exchange`) is shared by TP and FSDP2:
  its owner hands it an :class:`ExchangePhases` spelled out in full (``runtime/tp.py`` the
  ``canzona/tp/...`` names, ``runtime/shard.py`` the ``canzona/shard/...`` ones), so an FSDP2 run
  without TP opens no ``canzona/tp/*`` range and the grep lands on the layout that chose it.
- ``<index>`` is ``bucket<i>`` or ``group<k>`` where the phase runs once per bucket or micro-group.
- ``<stage>`` is ``launch`` or ``wait`` for a collective that is started asynchronously: the
  launch range covers only issuing the collective (packing included), the wait range covers
  blocking until it has landed. A collective run synchronously has no stage suffix.

So ``canzona/dp/reduce_scatter/bucket3/wait`` is the wait for bucket 3's reduce-scatter.
:data:`COMM_PHASES` is the one definition of which phases move bytes between ranks.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "PHASES",
    "COMM_PHASES",
    "COMPUTE_PHASES",
    "OPTIMIZER_COMM_PHASES",
    "ExchangePhases",
    "FORWARD",
    "BACKWARD",
    "DP_REDUCE_SCATTER",
    "DP_ALL_REDUCE",
    "OPTIMIZER_STEP",
    "DP_LOCAL_UPDATE",
    "TP_GATHER",
    "TP_COMPUTE",
    "TP_SCATTER",
    "TP_APPLY",
    "SHARD_GATHER",
    "SHARD_COMPUTE",
    "SHARD_SCATTER",
    "SHARD_APPLY",
    "DP_ALL_GATHER",
    "LAYERWISE_BROADCAST",
    "STATUS",
    "LAUNCH",
    "WAIT",
    "PhaseName",
    "base_phase",
    "parse",
    "exchange_phases",
    "is_communication",
    "indexed",
]

FORWARD = "canzona/forward"
BACKWARD = "canzona/backward"
DP_REDUCE_SCATTER = "canzona/dp/reduce_scatter"
DP_ALL_REDUCE = "canzona/dp/all_reduce"
OPTIMIZER_STEP = "canzona/optimizer/step"
DP_LOCAL_UPDATE = "canzona/dp/local_update"
TP_GATHER = "canzona/tp/gather"
TP_COMPUTE = "canzona/tp/compute"
TP_SCATTER = "canzona/tp/scatter"
TP_APPLY = "canzona/tp/apply"
SHARD_GATHER = "canzona/shard/gather"
SHARD_COMPUTE = "canzona/shard/compute"
SHARD_SCATTER = "canzona/shard/scatter"
SHARD_APPLY = "canzona/shard/apply"
DP_ALL_GATHER = "canzona/dp/all_gather"
LAYERWISE_BROADCAST = "canzona/layerwise/broadcast"
#: the status exchanges (canzona.runtime.agree): errors, flags and digests agreed across ranks
STATUS = "canzona/status"

PHASES: tuple[str, ...] = (
    FORWARD,
    BACKWARD,
    DP_REDUCE_SCATTER,
    DP_ALL_REDUCE,
    OPTIMIZER_STEP,
    DP_LOCAL_UPDATE,
    TP_GATHER,
    TP_COMPUTE,
    TP_SCATTER,
    TP_APPLY,
    SHARD_GATHER,
    SHARD_COMPUTE,
    SHARD_SCATTER,
    SHARD_APPLY,
    DP_ALL_GATHER,
    LAYERWISE_BROADCAST,
    STATUS,
)

#: Bases whose ranges move bytes between ranks (their launch and wait stages included): the one
#: definition of "communication" that the trace summary, the figures and the benchmarks use.
COMM_PHASES: frozenset[str] = frozenset(
    {DP_REDUCE_SCATTER, DP_ALL_REDUCE, TP_GATHER, TP_SCATTER, SHARD_GATHER, SHARD_SCATTER, DP_ALL_GATHER,
     LAYERWISE_BROADCAST, STATUS}
)
#: The communication phases that move optimizer data inside the step (the micro-group exchanges
#: and the layerwise broadcast); not the parameter return (``dp/all_gather``) nor ``status``.
OPTIMIZER_COMM_PHASES: frozenset[str] = frozenset({TP_GATHER, TP_SCATTER, SHARD_GATHER, SHARD_SCATTER, LAYERWISE_BROADCAST})
#: Bases whose ranges are the optimizer math that canzona distributes (an owner's update, a host's).
COMPUTE_PHASES: frozenset[str] = frozenset({DP_LOCAL_UPDATE, TP_COMPUTE, SHARD_COMPUTE})

LAUNCH = "launch"
WAIT = "wait"

_NAME = re.compile(r"^(?P<base>.+?)(?:/(?P<index>(?:bucket|group)\d+))?(?:/(?P<stage>launch|wait))?$")


class PhaseName(NamedTuple):
    """``(base, index, stage)`` of a phase name; ``index`` and ``stage`` are ``None`` when absent."""

    base: str
    index: str | None
    stage: str | None


def parse(name: str) -> PhaseName:
    """Split a phase name into its base, its ``bucket<i>``/``group<k>`` index and its stage."""
    m = _NAME.match(name)
    if m is None:  # pragma: no cover - the pattern matches every non-empty string
        return PhaseName(name, None, None)
    return PhaseName(m["base"], m["index"], m["stage"])


def base_phase(name: str) -> str:
    """The fixed phase name without its index and stage suffixes."""
    return parse(name).base


def indexed(base: str, index: str | None = None, stage: str | None = None) -> str:
    """Compose ``base[/index][/stage]``; ``indexed(TP_SCATTER, "group0", WAIT)``."""
    parts = [base]
    if index:
        parts.append(index)
    if stage:
        if stage not in (LAUNCH, WAIT):
            raise ValueError(f"phase stage must be {LAUNCH!r} or {WAIT!r}, got {stage!r}")
        parts.append(stage)
    return "/".join(parts)


class ExchangePhases(NamedTuple):
    """The four phase bases of one micro-group exchange engine, named by the layout that owns it
    (spelled out in full there, so that a grep for a name finds that layout). Each must be a
    registered name of :data:`PHASES`; see :func:`exchange_phases`."""

    gather: str
    compute: str
    scatter: str
    apply: str


def exchange_phases(gather: str, compute: str, scatter: str, apply: str) -> ExchangePhases:
    """An :class:`ExchangePhases` whose four names are registered bases of one dimension
    (``canzona/<dim>/gather|compute|scatter|apply``); ValueError otherwise."""
    names = ExchangePhases(gather, compute, scatter, apply)
    dims = {n.rsplit("/", 1)[0] for n in names}
    if any(n not in PHASES for n in names) or len(dims) != 1 or [n.rsplit("/", 1)[1] for n in names] != list(ExchangePhases._fields):
        raise ValueError(f"exchange phases must be the registered gather/compute/scatter/apply of one dimension, got {names}")
    return names


def is_communication(name: str) -> bool:
    """True for ranges that move bytes (or wait for bytes to move): every stage of a comm phase."""
    return parse(name).base in COMM_PHASES
