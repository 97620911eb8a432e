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

Bounded waits. A rank that skips or adds a ``step()`` leaves the others in a collective that will
never match; torch would keep them there for the process group's timeout (30 minutes by
default) and then report a transport error naming nobody. A :class:`Comm` built with
``wait_timeout_s`` (the optimizers pass their ``status_timeout_s``) returns works whose ``wait()``
blocks at most that long, in slices of :data:`POLL_S`; between slices it looks at one key of the
default store. The first rank whose bound runs out writes there where it was waiting; every other
rank inside a bounded wait sees the key within a slice, adds where *it* was waiting, and all of
them raise :class:`CollectiveTimeout` with the same line naming each rank and its position (a rank
that never answers within :data:`GATHER_S`: dead, frozen, or busy outside canzona's collectives)
and, when the ranks have begun different numbers of ``step()`` calls, those counts and the ranks
ahead. FSDP2's own collectives on gloo wait through :func:`wait_bounded` too
(:mod:`canzona.runtime.fsdp_comm`).
The store is only read when a slice ran out, so a collective that completes in time costs one
``wait`` as before. A timed-out gloo wait leaves the work intact (it can be waited again), which
is what the slices rely on.

On NCCL (a CUDA tensor on an NCCL group) the works are returned as they are: a bounded
``wait(timeout)`` there makes the host block until the GPU collective finishes, which would undo
the overlap the runtime is built on. The bound there is torch's: the process group's ``timeout=``
enforced by the NCCL watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default, aborts the
communicator and ends the process once a collective outlives it); docs/robustness.md says how to
set it.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import time
import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime.phases import base_phase, current_phase

__all__ = ["GATHER_S", "POLL_S", "CollectiveTimeout", "Comm", "CommStats", "count_step", "default_store", "even_sizes", "record_process", "steps_begun", "wait_bounded"]

UNPHASED = "unphased"
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single; keep torch >= 2.9 working.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: seconds of one slice of a bounded wait (the store is read between slices)
POLL_S = 0.25
#: seconds a rank that gives up waits for the other ranks to say where they are waiting
GATHER_S = 1.5
_ABORT = "canzona.abort"  # store key: how many ranks gave up; ``_ABORT/<rank>``: where each waited


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


class CollectiveTimeout(RuntimeError):
    """A bounded wait ran out, or another rank gave up on this process group (the message names
    every rank and where it was waiting). The group cannot be used further: destroy it.
    ``abandon_exchanges``: in-flight collectives are not waited for on the way out."""

    abandon_exchanges = True


def default_store() -> Any:
    """The default process group's store (None when there is none)."""
    try:
        return dist.distributed_c10d._get_default_store()  # noqa: SLF001 - control keys beside torch's
    except Exception:  # noqa: BLE001 - no store: the bound still holds, only the naming is lost
        return None


#: (weak reference to the default process group, the line raised there): once a world gave up,
#: every later bounded wait in it raises the same line at once
_verdict: tuple[Any, str] | None = None


def _timed_out(exc: RuntimeError) -> bool:
    # c10d's Work::wait(timeout) raises exactly this when the slice ran out and the work goes on
    return "operation timed out" in str(exc).lower()


def wait_bounded(wait: Any, timeout_s: float, where: str) -> None:
    """Call ``wait(timedelta)`` (a work's ``wait`` or ``advance``) in slices of :data:`POLL_S` until
    it returns, at most ``timeout_s`` seconds; raise :class:`CollectiveTimeout` when the bound runs
    out or another rank gave up (module docstring). ``where``: this rank's position, for the line."""
    earlier = _earlier_verdict()
    if earlier is not None:
        raise CollectiveTimeout(earlier)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            wait(timedelta(seconds=max(0.001, min(POLL_S, left))))
            return
        except RuntimeError as exc:
            if not _timed_out(exc):
                raise
        store = default_store()
        told = store is not None and _check(store, _ABORT)
        if told or time.monotonic() >= deadline:
            raise CollectiveTimeout(_give_up(store, where, None if told else timeout_s))


def _earlier_verdict() -> str | None:
    if _verdict is None or not dist.is_initialized():
        return None
    ref, line = _verdict
    return line if ref() is dist.distributed_c10d._get_default_group() else None  # noqa: SLF001


def _check(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001 - naming is best effort
        return False


def _give_up(store: Any, where: str, timeout_s: float | None) -> str:
    """Post where this rank waited (and, when its own bound ran out, that it gave up), collect the
    other ranks' positions for up to :data:`GATHER_S`, and return the line every rank raises: each
    rank's position, and which ranks have begun fewer or more ``step()`` calls than the others."""
    global _verdict
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = f"waited {timeout_s:g} s in {where} and gave up" if timeout_s is not None else f"was waiting in {where}"
    posted = _exchange_positions(store, rank, world, f"{steps_begun()}\n{mine}", first=timeout_s is not None)
    steps: dict[int, int] = {}
    parts = []
    for r in range(world):
        if r not in posted:
            parts.append(f"rank {r} {_silent(store, r)}")
            continue
        count, text = posted[r].split("\n", 1)
        steps[r] = int(count)
        parts.append(f"rank {r} {text}")
    line = "canzona's collectives stopped matching across ranks: " + "; ".join(parts) + ". "
    if len(set(steps.values())) > 1:
        line += "Optimizer steps begun: " + ", ".join(f"rank {r} {n}" for r, n in sorted(steps.items())) + ". "
        most = max(steps.values())
        line += "Ahead of the others: " + ", ".join(f"rank {r}" for r, n in sorted(steps.items()) if n == most) + ". "
    line += (
        "A rank skipped or added a step() or another collective call, or stopped, or worked alone for longer than "
        "status_timeout_s (a save or an evaluation on one rank: raise status_timeout_s or call dist.barrier() after it); "
        "this process group cannot be used further"
    )
    _verdict = (weakref.ref(dist.distributed_c10d._get_default_group()), line)  # noqa: SLF001
    return line


def _exchange_positions(store: Any, rank: int, world: int, mine: str, *, first: bool) -> dict[int, str]:
    """Write this rank's record (``first``: and count a rank that gave up), then read every rank's
    until all have written or :data:`GATHER_S` passed; rank -> record."""
    posted: dict[int, str] = {}
    if store is not None:
        try:
            store.set(f"{_ABORT}/{rank}", mine)
            if first:
                store.add(_ABORT, 1)
            end = time.monotonic() + GATHER_S
            while True:
                posted = {r: store.get(f"{_ABORT}/{r}").decode("utf-8", "replace") for r in range(world) if _check(store, f"{_ABORT}/{r}")}
                if len(posted) == world or time.monotonic() >= end:
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - naming is best effort
            posted = {}
    posted[rank] = mine
    return posted


#: (weak reference to the default process group, optimizer steps begun in it by this rank)
_steps: tuple[Any, int] | None = None


def count_step() -> None:
    """Count one optimizer ``step()`` begun in the current world (the step's status exchange
    calls it), for the line a rank that gives up raises."""
    global _steps
    default = dist.distributed_c10d._get_default_group()  # noqa: SLF001 - identity of the current world
    _steps = (weakref.ref(default), steps_begun() + 1)


def steps_begun() -> int:
    """Optimizer steps this rank has begun in the current world (:func:`count_step`)."""
    if _steps is None or not dist.is_initialized():
        return 0
    ref, n = _steps
    return n if ref() is dist.distributed_c10d._get_default_group() else 0  # noqa: SLF001


def record_process(rank: int) -> None:
    """Record this rank's host and process id in the default store (once per world, best effort),
    so that a rank giving up can tell a stopped peer on its own host (:func:`_silent`)."""
    store = default_store()
    if store is not None:
        try:
            store.set(f"canzona.proc/{rank}", f"{socket.gethostname()}\n{os.getpid()}")
        except Exception:  # noqa: BLE001 - naming is best effort
            pass


def _silent(store: Any, rank: int) -> str:
    """Words for a rank that did not say where it waits. A peer on this host whose process the
    kernel reports stopped (state ``T``: SIGSTOP, or Ctrl-Z) is killed with SIGKILL: a stopped
    process acts on no other signal, so its launcher (torchrun sends SIGTERM, then waits 30 s
    before SIGKILL; a launcher that is itself killed never does) would otherwise wait for it or
    leave it behind, and its process group is already beyond use. Nothing is done to any other
    process (running, sleeping, traced by a debugger: state ``t``)."""
    try:
        host, pid_text = store.get(f"canzona.proc/{rank}").decode("utf-8").split("\n")
        pid = int(pid_text)
        if host != socket.gethostname() or pid == os.getpid():
            raise LookupError(host)
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except Exception:  # noqa: BLE001 - another host, no record, no /proc: only name it
        return "did not answer (dead, frozen, or busy outside canzona's collectives)"
    if state != "T":
        return f"did not answer (process {pid} on this host, state {state}: busy outside canzona's collectives, or frozen)"
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError as exc:
        return f"is stopped (process {pid} on this host, SIGSTOP; could not kill it: {exc.strerror})"
    return f"is stopped (process {pid} on this host, SIGSTOP) and was killed (SIGKILL), so that no launcher waits for it"


class _BoundedWork:
    """A work whose ``wait()`` with no argument is :func:`wait_bounded` (an explicit timeout is passed on)."""

    __slots__ = ("_work", "_timeout_s", "_where")

    def __init__(self, work: Any, timeout_s: float, where: str) -> None:
        self._work, self._timeout_s, self._where = work, timeout_s, where

    def wait(self, timeout: Any = None) -> bool:
        if timeout is not None:
            _wait_for(self._work, timeout)
        else:
            wait_bounded(self._work.wait, self._timeout_s, self._where)
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class _BoundedTwoStage(_BoundedWork):
    """:class:`_BoundedWork` over a :class:`_TwoStageWork`: ``advance()`` is bounded too."""

    __slots__ = ()

    def advance(self, timeout: Any = None) -> None:
        if timeout is not None:
            self._work.advance(timeout)
        else:
            wait_bounded(self._work.advance, self._timeout_s, self._where)


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
    """Collectives over one process group (None: the default group), counted into ``stats``.
    ``wait_timeout_s``: the bound on each ``wait()`` of the works it returns (None: torch's own,
    the process group's timeout; see the module docstring, "Bounded waits")."""

    def __init__(self, group: Any = None, stats: CommStats | None = None, *, wait_timeout_s: float | None = None) -> None:
        self.group = group
        self.stats = stats if stats is not None else CommStats()
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        #: backend name of the group ("gloo", "nccl", or a device map such as "cpu:gloo,cuda:nccl")
        self.backend = str(dist.get_backend(group))
        if wait_timeout_s is not None and not wait_timeout_s > 0:
            raise ValueError(f"wait_timeout_s must be a positive number of seconds, got {wait_timeout_s!r}")
        #: bound (seconds) on each wait of an asynchronous collective launched here (None: unbounded)
        self.wait_timeout_s = None if wait_timeout_s is None else float(wait_timeout_s)

    def _bounded(self, work: Any, t: torch.Tensor, op: str) -> Any:
        """``work`` with its waits bounded by :attr:`wait_timeout_s` (as it is: none set, a
        synchronous call, or NCCL, whose watchdog bounds it)."""
        if work is None or self.wait_timeout_s is None or self._nccl(t):
            return work
        launched = current_phase()
        where = f"{launched.removesuffix('/launch')} ({op})" if launched else op
        kind = _BoundedTwoStage if isinstance(work, _TwoStageWork) else _BoundedWork
        return kind(work, self.wait_timeout_s, where)

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
        return self._bounded(dist.all_reduce(t, op=reduce_op, group=self.group, async_op=async_op), t, "all_reduce")

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
        return self._bounded(both, flat, "all_reduce in rank order")

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
        return out, self._bounded(_ThenWork(work, total), flat, "reduce_scatter")

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
            return out, self._bounded(work, flat, "all_gather")
        if self._nccl(local):
            work = dist.all_gather(list(out.split(sizes)), flat, group=self.group, async_op=async_op)
            return out, work
        # gloo has no uneven list form: all_to_all_single with this rank's shard once per peer
        send = flat.repeat(self.size)
        work = dist.all_to_all_single(
            out, send, output_split_sizes=sizes, input_split_sizes=[flat.numel()] * self.size, group=self.group, async_op=async_op
        )
        return out, self._bounded(work, flat, "all_gather")

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
        return out, self._bounded(work, send, "all_to_all")

    def broadcast(self, t: torch.Tensor, src: int, *, async_op: bool = False) -> Any:
        """Send ``t`` from group rank ``src`` to every rank in place (direct volume: src sends R-1 copies)."""
        nbytes = t.numel() * t.element_size()
        if self.rank == src:
            self.stats.record((self.size - 1) * nbytes, 0)
        else:
            self.stats.record(0, nbytes)
        if self.size == 1:
            return None
        return self._bounded(dist.broadcast(t, src=self._global(src), group=self.group, async_op=async_op), t, "broadcast")

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
