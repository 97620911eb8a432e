"""Collectives with byte accounting: the only place the runtime talks to torch.distributed.

Every call files the bytes this rank sends and receives under the phase that is open when the
call is made (:func:`canzona.runtime.phases.current_phase`, suffix stripped), so tests and
benchmarks can check the paper's structural claims: ``lb-asc`` moves a reduce-scatter's worth of
bytes in fwd-bwd, half of ``sc``'s all-reduce, and nothing inside its optimizer step.

Byte counts are *logical point-to-point volumes* of a direct algorithm, independent of how the
backend routes them (ring, tree, NVLink SHARP): for a buffer of N elements split into shards
S_0..S_{R-1}, a reduce-scatter makes rank r send N - S_r elements and receive (R-1) S_r; an
all-gather is the reverse; an all-reduce is a reduce-scatter plus an all-gather over equal shards
(2 N (R-1)/R each way, the textbook figure). Self-copies are free.

Collectives per backend (Section 3.1 needs one coalesced *variable-size* collective per bucket):

- reduce-scatter to uneven cut points: on NCCL the list form (``dist.reduce_scatter``); on gloo an
  ``all_to_all_single`` that sends every rank its slice (a reduce-scatter's bytes exactly),
  followed at ``wait()`` by the sum of the R received slices in rank order, starting from zero (the
  reference reduction of the exactness suite, bit for bit), because gloo's list form is several
  times slower (docs/runtime.md, "Collectives per backend", measured with
  ``profiling/bench_collectives.py``). The price is a receive
  buffer of R slices, which callers reserve once (:meth:`Comm.reduce_scatter_scratch`).
- uneven all-gather: on NCCL the list form ``dist.all_gather`` into views of the output (NCCL runs
  it as grouped broadcasts straight into the output): no staging buffer. gloo has no uneven list
  form; it gets ``all_to_all_single`` over this rank's shard repeated once per peer, the cheapest
  of the three gloo forms (the others: one broadcast per owner into views of the output, an equal
  all-gather of padded shards plus a compaction copy; measured in docs/runtime.md), so the R-fold send
  buffer stays on gloo only. Equal sizes use
  ``all_gather_single`` (one call, both backends).
- all-to-all with split sizes: ``all_to_all_single`` on both backends (one fused call over one
  flat send buffer; the list form would only add per-peer tensors the engine already packs).
  Callers may pass ``out=`` to receive into a buffer they keep across steps.
- objects (checkpoint traffic, consolidated on rank 0): :meth:`Comm.gather_object` counts the
  pickled bytes; the plan fingerprint exchange is an equal all-gather through this class.
- the status exchanges (:func:`canzona.runtime.agree.agree`): an ``all_reduce`` with ``op="max"``
  of a small int64 vector and, only after a failure, an equal all-gather of messages, filed under
  their own phase ``canzona/status`` (control traffic, apart from the paper's phases).

Ranks are group-local everywhere in this API.
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime.phases import base_phase, current_phase

__all__ = ["CommStats", "Comm", "even_sizes"]

UNPHASED = "unphased"
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; keep torch >= 2.9 working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def even_sizes(n: int, parts: int) -> list[int]:
    """Split n elements into ``parts`` contiguous sizes differing by at most one (first ones larger)."""
    q, r = divmod(n, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


@dataclass
class CommStats:
    """Bytes sent / received and collective calls per base phase name, for one rank."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recv: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, sent: int, recv: int) -> None:
        key = base_phase(current_phase() or UNPHASED)
        self.sent[key] += int(sent)
        self.recv[key] += int(recv)
        self.calls[key] += 1

    def reset(self) -> None:
        self.sent.clear()
        self.recv.clear()
        self.calls.clear()

    def phases(self) -> list[str]:
        return sorted(set(self.sent) | set(self.recv))

    def total_sent(self, *phases: str) -> int:
        return sum(v for k, v in self.sent.items() if not phases or k in phases)

    def total_recv(self, *phases: str) -> int:
        return sum(v for k, v in self.recv.items() if not phases or k in phases)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"sent": self.sent.get(k, 0), "recv": self.recv.get(k, 0), "calls": self.calls.get(k, 0)} for k in self.phases()}


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of ``a`` and ``b`` (contiguous) intersects."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _wait_for(work: Any, timeout: Any) -> None:
    """``work.wait()``, passing ``timeout`` only when one is given (torch's works take none by default)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


class _ThenWork:
    """An asynchronous collective whose ``wait()`` also runs a local step on its result, once."""

    def __init__(self, work: Any, then: Any) -> None:
        self._work, self._then = work, then

    def wait(self, timeout: Any = None) -> bool:
        if self._work is not None:
            _wait_for(self._work, timeout)
            self._work = None
            self._then()
        return True

    def is_completed(self) -> bool:
        """True once the result is ready (running the local step if the transfer has landed)."""
        if self._work is not None and self._work.is_completed():
            self.wait()
        return self._work is None


class _TwoStageWork:
    """A collective made of two: ``advance()`` waits the first, runs ``then()``, which launches the
    second asynchronously and returns its work; ``wait()`` advances if needed and waits the
    second. A caller holding several can advance them all first, so the second stages overlap
    each other (every rank must advance them in the same order: they are collectives, which is
    why nothing here polls and launches on its own)."""

    def __init__(self, first: Any, then: Any) -> None:
        self._first, self._then, self._second = first, then, None

    def advance(self, timeout: Any = None) -> None:
        if self._first is not None:
            _wait_for(self._first, timeout)
            self._first = None
            self._second = self._then()

    def wait(self, timeout: Any = None) -> bool:
        self.advance(timeout)
        if self._second is not None:
            _wait_for(self._second, timeout)
            self._second = None
        return True


class Comm:
    """Collectives over one process group (None: the default group), counted into ``stats``."""

    def __init__(self, group: Any = None, stats: CommStats | None = None) -> None:
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        #: backend name of the group ("gloo", "nccl", or a device map such as "cpu:gloo,cuda:nccl")
        self.backend = str(dist.get_backend(group))

    def _nccl(self, t: torch.Tensor) -> bool:
        """Whether a collective on ``t`` runs on NCCL (CUDA tensor on a group with an NCCL backend)."""
        return t.is_cuda and "nccl" in self.backend

    def _global(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _check_sizes(self, sizes: Sequence[int], total: int, what: str) -> list[int]:
        sizes = [int(s) for s in sizes]
        if len(sizes) != self.size or any(s < 0 for s in sizes) or sum(sizes) != total:
            raise ValueError(f"{what}: split sizes {sizes} do not match {self.size} ranks and {total} elements")
        return sizes

    # --------------------------------------------------------------------------------- reductions
    def all_reduce(self, t: torch.Tensor, *, op: str = "sum", async_op: bool = False) -> Any:
        """In-place reduction over the group: ``op`` is ``"sum"`` or ``"max"`` (the status exchange)."""
        reduce_op = _REDUCE_OPS.get(op)
        if reduce_op is None:
            raise ValueError(f"all_reduce: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
        self._record_all_reduce(t)
        if self.size == 1:
            return None
        return dist.all_reduce(t, op=reduce_op, group=self.group, async_op=async_op)

    def _record_all_reduce(self, t: torch.Tensor) -> list[int]:
        """Count an all-reduce of ``t`` (a reduce-scatter over even slices plus an all-gather of
        them, each rank's volume); returns those slice sizes."""
        n, es = t.numel(), t.element_size()
        sizes = even_sizes(n, self.size)
        own = sizes[self.rank]
        moved = (n - own) + (self.size - 1) * own
        self.stats.record(moved * es, moved * es)
        return sizes

    def sums_in_rank_order(self, t: torch.Tensor) -> bool:
        """Whether :meth:`all_reduce_in_rank_order` on ``t`` needs its own two-step form: on gloo
        with 3 or more ranks. With 2 ranks gloo's all-reduce is already exact (one addition per
        element, and ``a + b == b + a``); NCCL keeps its own order, fastest there."""
        return self.size > 2 and not self._nccl(t)

    def rank_order_scratch(self, flat: torch.Tensor) -> int:
        """Elements of the ``scratch`` buffer :meth:`all_reduce_in_rank_order` needs for ``flat``
        (0 where it runs as a plain all-reduce)."""
        if not self.sums_in_rank_order(flat):
            return 0
        return self.reduce_scatter_scratch(flat, even_sizes(flat.numel(), self.size))

    def all_reduce_in_rank_order(self, flat: torch.Tensor, *, scratch: torch.Tensor | None = None, async_op: bool = False) -> Any:
        """Sum ``flat`` over the group in place, as :meth:`all_reduce` does, but where
        :meth:`sums_in_rank_order` says so with every element summed in rank order from zero:
        the sum a single device makes of the ranks' gradients, bit for bit, whatever the ring
        order of gloo's all-reduce would have been. It is :meth:`reduce_scatter_v` into this
        rank's own even slice of ``flat`` (``scratch``: its receive buffer,
        :meth:`rank_order_scratch` elements), then :meth:`all_gather_v` of the slices into
        ``flat`` in place, launched by the returned work's ``advance()`` (or ``wait()``). Counted
        once, at launch, as the all-reduce whose bytes it moves (the same per rank: a
        reduce-scatter plus an all-gather)."""
        if not self.sums_in_rank_order(flat):
            return self.all_reduce(flat, async_op=async_op)
        sizes = self._record_all_reduce(flat)
        start = sum(sizes[: self.rank])
        quiet = self._uncounted()
        mine = flat[start : start + sizes[self.rank]]  # its values are sent by the reduce-scatter before the sum lands there
        _, work = quiet.reduce_scatter_v(flat, sizes, out=mine, scratch=scratch, async_op=True)
        both = _TwoStageWork(work, lambda: quiet.all_gather_v(mine, sizes, out=flat, async_op=True)[1])
        if not async_op:
            both.wait()
            return None
        return both

    def _uncounted(self) -> "Comm":
        """A Comm over the same group whose traffic goes uncounted (for collectives made of others,
        counted once by the caller)."""
        quiet = getattr(self, "_quiet", None)
        if quiet is None:
            quiet = self._quiet = Comm(self.group, CommStats())
        return quiet

    def reduce_scatter_scratch(self, flat: torch.Tensor, sizes: Sequence[int]) -> int:
        """Elements of the receive buffer :meth:`reduce_scatter_v` needs for ``flat`` cut at
        ``sizes`` (0 where it needs none: NCCL, one rank): R slices of this rank's size on gloo."""
        if self.size == 1 or self._nccl(flat):
            return 0
        return self.size * int(sizes[self.rank])

    def reduce_scatter_v(
        self,
        flat: torch.Tensor,
        sizes: Sequence[int],
        *,
        out: torch.Tensor | None = None,
        scratch: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """Sum ``flat`` over the group; rank r receives the r-th slice of ``sizes`` (which may be uneven
        or 0), into ``out`` (contiguous, ``sizes[rank]`` elements) when given. ``scratch``: a 1-D
        buffer of at least :meth:`reduce_scatter_scratch` elements of ``flat``'s dtype for the gloo
        form to receive into (allocated per call when not given). With ``async_op`` the slices are
        summed into ``out`` by the returned work's ``wait()``."""
        sizes = self._check_sizes(sizes, flat.numel(), "reduce_scatter_v")
        es, own = flat.element_size(), sizes[self.rank]
        if out is not None and (out.numel() != own or not out.is_contiguous() or out.dtype != flat.dtype):
            raise ValueError(f"reduce_scatter_v: out must be contiguous {flat.dtype} with {own} elements")
        self.stats.record((flat.numel() - own) * es, (self.size - 1) * own * es)
        if self.size == 1:
            if out is None:
                return flat[:own].clone(), None
            out.copy_(flat[:own])
            return out, None
        if out is None:
            out = torch.empty(own, dtype=flat.dtype, device=flat.device)
        if self._nccl(flat):
            work = dist.reduce_scatter(out, list(flat.split(sizes)), op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
            return out, work
        n_recv = self.size * own
        if scratch is None:
            scratch = torch.empty(n_recv, dtype=flat.dtype, device=flat.device)
        elif scratch.dim() != 1 or scratch.numel() < n_recv or scratch.dtype != flat.dtype or not scratch.is_contiguous():
            raise ValueError(f"reduce_scatter_v: scratch must be contiguous 1-D {flat.dtype} with at least {n_recv} elements")
        recv = scratch[:n_recv]
        work = dist.all_to_all_single(
            recv, flat.contiguous(), output_split_sizes=[own] * self.size, input_split_sizes=sizes, group=self.group, async_op=async_op
        )

        def total() -> None:
            # rank order from zero, as a single device summing the ranks' gradients would
            out.zero_()
            for part in recv.view(self.size, own):
                out.add_(part)

        if not async_op:
            total()
            return out, None
        return out, _ThenWork(work, total)

    # --------------------------------------------------------------------------------- gathers
    def all_gather_v(
        self, local: torch.Tensor, sizes: Sequence[int], *, out: torch.Tensor | None = None, async_op: bool = False
    ) -> tuple[torch.Tensor, Any]:
        """Concatenate every rank's 1-D ``local`` (rank r contributes ``sizes[r]`` elements) on every rank."""
        total = sum(int(s) for s in sizes)
        sizes = self._check_sizes(sizes, total, "all_gather_v")
        if local.numel() != sizes[self.rank]:
            raise ValueError(f"all_gather_v: local shard has {local.numel()} elements, sizes say {sizes[self.rank]}")
        es = local.element_size()
        self.stats.record((self.size - 1) * local.numel() * es, (total - local.numel()) * es)
        if out is None:
            out = torch.empty(total, dtype=local.dtype, device=local.device)
        elif out.numel() != total or not out.is_contiguous():
            raise ValueError(f"all_gather_v: out must be contiguous with {total} elements")
        if self.size == 1:
            out.copy_(local.reshape(-1))
            return out, None
        flat = local.reshape(-1).contiguous()
        # ``local`` may be this rank's own region of ``out`` (the DP runtime sends parameter-buffer
        # slots in place): NCCL gathers in place (an in-place all-gather, or an in-place broadcast
        # from the root for the list form), and so does gloo's equal all-gather (nothing but this
        # rank's own values is ever written there; tests/test_runtime_async.py checks it with
        # several gathers in flight). Any other overlap would be a caller's bug: gloo gets a copy.
        if len(set(sizes)) == 1:
            es = flat.element_size()
            own = flat.data_ptr() == out.data_ptr() + sum(sizes[: self.rank]) * es
            if not self._nccl(local) and not own and _overlaps(flat, out):
                flat = flat.clone()
            work = _all_gather_single(out, flat, group=self.group, async_op=async_op)
            return out, work
        if self._nccl(local):
            work = dist.all_gather(list(out.split(sizes)), flat, group=self.group, async_op=async_op)
            return out, work
        # gloo has no uneven list form: all_to_all_single with this rank's shard once per peer
        send = flat.repeat(self.size)
        work = dist.all_to_all_single(
            out, send, output_split_sizes=sizes, input_split_sizes=[flat.numel()] * self.size, group=self.group, async_op=async_op
        )
        return out, work

    def all_gather_equal(
        self, local: torch.Tensor, *, out: torch.Tensor | None = None, async_op: bool = False
    ) -> tuple[torch.Tensor, Any]:
        """All-gather equal-size tensors; returns a flat tensor of ``size * local.numel()`` elements in
        rank order (``out`` when given)."""
        return self.all_gather_v(local.reshape(-1), [local.numel()] * self.size, out=out, async_op=async_op)

    def all_to_all_v(
        self,
        send: torch.Tensor,
        send_sizes: Sequence[int],
        recv_sizes: Sequence[int],
        *,
        out: torch.Tensor | None = None,
        async_op: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """One fused exchange: ``send_sizes[j]`` elements go to rank j, ``recv_sizes[j]`` come from rank j.
        ``out`` (contiguous, ``sum(recv_sizes)`` elements) receives in place when given."""
        send_sizes = self._check_sizes(send_sizes, send.numel(), "all_to_all_v (send)")
        recv_sizes = [int(s) for s in recv_sizes]
        recv_sizes = self._check_sizes(recv_sizes, sum(recv_sizes), "all_to_all_v (recv)")
        es = send.element_size()
        self.stats.record((send.numel() - send_sizes[self.rank]) * es, (sum(recv_sizes) - recv_sizes[self.rank]) * es)
        if out is None:
            out = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
        elif out.numel() != sum(recv_sizes) or not out.is_contiguous():
            raise ValueError(f"all_to_all_v: out must be contiguous with {sum(recv_sizes)} elements")
        if self.size == 1:
            out.copy_(send)
            return out, None
        work = dist.all_to_all_single(
            out, send.contiguous(), output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=self.group, async_op=async_op
        )
        return out, work

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        """Send ``t`` from group rank ``src`` to every rank in place (direct volume: src sends R-1 copies)."""
        nbytes = t.numel() * t.element_size()
        if self.rank == src:
            self.stats.record((self.size - 1) * nbytes, 0)
        else:
            self.stats.record(0, nbytes)
        if self.size == 1:
            return None
        return dist.broadcast(t, src=self._global(src), group=self.group, async_op=async_op)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)

    # --------------------------------------------------------------------------------- objects
    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Pickle-gather ``obj`` from every rank onto group rank ``dst`` (checkpoint consolidation;
        objects come from our own ranks, never from a file). Counts the pickled bytes, which costs
        one extra ``pickle.dumps`` per call: fine for checkpoints, not for a hot path."""
        nbytes = len(pickle.dumps(obj))
        if self.rank == dst:
            self.stats.record(0, 0)  # what arrives is counted by the senders
        else:
            self.stats.record(nbytes, 0)
        got: list[Any] | None = [None] * self.size if self.rank == dst else None
        if self.size == 1:
            return [obj]
        dist.gather_object(obj, got, dst=self._global(dst), group=self.group)
        return got
