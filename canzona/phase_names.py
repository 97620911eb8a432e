"""Phase names of an iteration, in one torch-free module.

The runtime opens these names as NVTX ranges and ``torch.profiler.record_function`` ranges
(:mod:`canzona.runtime.phases`); the trace summary, the figures and the training loop read them
from here, so a name is spelled once.

Shape of a name: ``<base>[/<index>][/<stage>]``

- ``<base>`` is one of :data:`PHASES` (``canzona/tp/scatter``).
- ``<index>`` is ``bucket<i>`` or ``group<k>`` where the phase runs once per bucket or micro-group.
- ``<stage>`` is ``launch`` or ``wait`` for a collective that is started asynchronously: the
  launch range covers only issuing the collective (packing included), the wait range covers
  blocking until it has landed. A collective run synchronously has no stage suffix.

So ``canzona/dp/reduce_scatter/bucket3/wait`` is the wait for bucket 3's reduce-scatter.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = [
    "PHASES",
    "COMM_PHASES",
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
    "DP_ALL_GATHER",
    "LAYERWISE_BROADCAST",
    "STATUS",
    "LAUNCH",
    "WAIT",
    "PhaseName",
    "base_phase",
    "parse",
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
    DP_ALL_GATHER,
    LAYERWISE_BROADCAST,
    STATUS,
)

# Bases whose ranges move bytes between ranks (their launch and wait stages included).
COMM_PHASES: frozenset[str] = frozenset(
    {DP_REDUCE_SCATTER, DP_ALL_REDUCE, TP_GATHER, TP_SCATTER, DP_ALL_GATHER, LAYERWISE_BROADCAST, STATUS}
)

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


def is_communication(name: str) -> bool:
    """True for ranges that move bytes (or wait for bytes to move): every stage of a comm phase."""
    return parse(name).base in COMM_PHASES
