"""Alpha-beta communication model and the overlap rule.

Every collective costs ``launch + steps * alpha + bytes_on_the_critical_link / beta`` on one link
class (:class:`Link`): NVLink within a node (TP), the inter-node network (DP). ``beta`` is the
achieved bus bandwidth (line rate times an efficiency, both named in the hardware profile),
``alpha`` the latency of one algorithm step (a ring hop), ``launch`` the cost of issuing the call.

Ring algorithms (NCCL's large-message choice), R ranks, S bytes in total:

    reduce-scatter / all-gather   (R - 1) steps, each link carries (R - 1) / R * S
    all-reduce                    2 (R - 1) steps, each link carries 2 (R - 1) / R * S
    broadcast (pipelined ring)    (R - 1) steps of pipeline fill, each link carries S
    all-to-all (direct, NVSwitch) (R - 1) steps, time set by the busiest rank's send/recv bytes

Variable-size reduce-scatter / all-gather (Section 3.1: non-uniform shard sizes S_r), two models:

* ``grouped`` (default): what PyTorch's NCCL backend does for uneven shards -- one ring reduce
  (broadcast) per destination (source) rank inside one NCCL group, all concurrent. The ring to
  root r loads every link except r's outgoing one with S_r, so link j carries S - S_j and the call
  costs ``(S - min_r S_r) / beta``: imbalance costs at most a factor R / (R - 1).
* ``padded``: a lockstep ring moving one shard per rank per step; every step lasts as long as the
  largest shard, ``(R - 1) * max_r S_r / beta`` -- the same as padding every shard to the largest.

Both reduce to the uniform formula ``(R - 1) / R * S / beta`` for equal shards.

The overlap rule (:func:`flow_shop`) is a two-stage pipeline over buckets: a bucket's
communication starts when its producer stage finished it and the communication stream is free;
the consumer of a bucket starts when the bucket is ready and the consumer is free. Exposed time
is what the pipeline adds to the compute stream alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "VARSIZE",
    "Link",
    "reduce_scatter_time",
    "all_gather_time",
    "all_reduce_time",
    "broadcast_time",
    "all_to_all_time",
    "flow_shop",
    "Op",
    "list_schedule",
]


@dataclass(frozen=True, slots=True)
class Link:
    """One link class: achieved bandwidth (bytes/s), per-step latency and launch cost (seconds)."""

    name: str
    bandwidth: float
    alpha: float
    launch: float

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"link {self.name}: bandwidth must be > 0, got {self.bandwidth!r}")
        if self.alpha < 0 or self.launch < 0:
            raise ValueError(f"link {self.name}: latencies must be >= 0")


def _check_ranks(ranks: int) -> None:
    if not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")


VARSIZE: tuple[str, ...] = ("grouped", "padded")


def _link_bytes(total_bytes: float | None, shard_bytes: Sequence[float] | None, ranks: int, varsize: str) -> float:
    """Bytes on the busiest link of a (variable-size) ring reduce-scatter / all-gather."""
    if varsize not in VARSIZE:
        raise ValueError(f"varsize must be one of {', '.join(VARSIZE)}, got {varsize!r}")
    if shard_bytes is None:
        if total_bytes is None or total_bytes < 0:
            raise ValueError("give total_bytes >= 0 or shard_bytes")
        return (ranks - 1) / ranks * float(total_bytes)
    if len(shard_bytes) != ranks:
        raise ValueError(f"need one shard size per rank ({ranks}), got {len(shard_bytes)}")
    if any(s < 0 for s in shard_bytes):
        raise ValueError("shard sizes must be >= 0")
    if varsize == "padded":
        return (ranks - 1) * float(max(shard_bytes))
    return float(sum(shard_bytes)) - float(min(shard_bytes))


def reduce_scatter_time(
    link: Link,
    ranks: int,
    total_bytes: float | None = None,
    shard_bytes: Sequence[float] | None = None,
    varsize: str = "grouped",
) -> float:
    """Ring reduce-scatter: ``launch + (R-1) alpha + busiest-link bytes / beta`` (0 for one rank).

    Uniform shards (``total_bytes``): the busiest link carries (R-1)/R S. Given ``shard_bytes``,
    ``varsize`` picks the variable-size model (module docstring).
    """
    _check_ranks(ranks)
    if ranks == 1:
        return 0.0
    load = _link_bytes(total_bytes, shard_bytes, ranks, varsize)
    return link.launch + (ranks - 1) * link.alpha + load / link.bandwidth


def all_gather_time(
    link: Link,
    ranks: int,
    total_bytes: float | None = None,
    shard_bytes: Sequence[float] | None = None,
    varsize: str = "grouped",
) -> float:
    """Ring all-gather: the reduce-scatter's cost shape (the reverse data flow)."""
    return reduce_scatter_time(link, ranks, total_bytes, shard_bytes, varsize)


def all_reduce_time(link: Link, ranks: int, total_bytes: float) -> float:
    """Ring all-reduce = reduce-scatter + all-gather: ``launch + 2(R-1) alpha + 2 (R-1)/R S / beta``."""
    _check_ranks(ranks)
    if total_bytes < 0:
        raise ValueError("total_bytes must be >= 0")
    if ranks == 1:
        return 0.0
    return link.launch + 2 * (ranks - 1) * link.alpha + 2 * (ranks - 1) / ranks * total_bytes / link.bandwidth


def broadcast_time(link: Link, ranks: int, total_bytes: float) -> float:
    """Pipelined ring broadcast: ``launch + (R-1) alpha + S / beta``."""
    _check_ranks(ranks)
    if total_bytes < 0:
        raise ValueError("total_bytes must be >= 0")
    if ranks == 1:
        return 0.0
    return link.launch + (ranks - 1) * link.alpha + total_bytes / link.bandwidth


def all_to_all_time(link: Link, send_bytes: Sequence[float], recv_bytes: Sequence[float]) -> float:
    """Direct all-to-all over a switch: ``launch + (R-1) alpha + max_r max(send_r, recv_r) / beta``."""
    ranks = len(send_bytes)
    if ranks != len(recv_bytes) or ranks < 1:
        raise ValueError("send_bytes and recv_bytes need one entry per rank")
    if ranks == 1:
        return 0.0
    busiest = max(max(s, r) for s, r in zip(send_bytes, recv_bytes))
    return link.launch + (ranks - 1) * link.alpha + busiest / link.bandwidth


def flow_shop(first: Sequence[float], second: Sequence[float]) -> tuple[float, float]:
    """Two-stage pipeline over jobs in order: job j runs on stage 1, then on stage 2.

    Stage 1 and stage 2 are two streams (compute and communication, in either role); each runs
    its jobs in order, one at a time. Returns (makespan, stage-1 busy time).

    Backward: stage 1 = backward compute of the parameters of bucket j, stage 2 = bucket j's
    gradient reduce-scatter / all-reduce; exposed = makespan - sum(stage 1).
    Forward: stage 1 = bucket j's parameter all-gather, stage 2 = forward compute that needs it;
    exposed = makespan - sum(stage 2).
    """
    if len(first) != len(second):
        raise ValueError("both stages need one duration per job")
    if any(x < 0 for x in first) or any(x < 0 for x in second):
        raise ValueError("durations must be >= 0")
    end1 = end2 = 0.0
    for a, b in zip(first, second):
        end1 += a
        end2 = max(end2, end1) + b
    return end2, end1


@dataclass(frozen=True, slots=True)
class Op:
    """One operation on a FIFO resource, started when the resource is free and its deps are done."""

    name: str
    resource: str
    duration: float
    deps: tuple[str, ...] = ()


def list_schedule(ops: Sequence[Op]) -> tuple[float, dict[str, float]]:
    """Run ops in issue order on FIFO resources; returns (makespan, end time per op name)."""
    free: dict[str, float] = {}
    end: dict[str, float] = {}
    for op in ops:
        if op.duration < 0:
            raise ValueError(f"{op.name}: negative duration")
        start = max([free.get(op.resource, 0.0)] + [end[d] for d in op.deps])
        end[op.name] = start + op.duration
        free[op.resource] = end[op.name]
    return (max(end.values()) if end else 0.0), end
