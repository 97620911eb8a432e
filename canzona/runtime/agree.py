"""Agreement across ranks at the points where one rank can fail alone.

A distributed optimizer step, checkpoint load or save runs the same code on every rank, but an
exception can still happen on one rank only: a non-finite gradient on its owner, an optimizer that
raises on the parameters one rank owns, a file one rank cannot write. If that rank simply raised,
the others would block in their next collective until the process-group timeout and then report
their own network error, never the rank that failed.

:func:`agree` is the small status exchange every rank joins at such a point, *before* the next
collective of the operation (and before any state changes where the operation allows it):

- one ``all_reduce(MAX)`` of a small int64 vector: ``[error flag, *flags]`` (``flags`` carries
  what the caller needs agreed as well, e.g. per-parameter "has a gradient" bits);
- only when some rank reports an error, one ``all_gather`` of a fixed-size message per rank.

Then every rank raises :class:`RankFailure` naming each failing rank and its message (on a failing
rank chained from its own exception), so all ranks fail within the time of two small collectives.
Both collectives wait at most ``timeout_s``; a rank that never arrives (dead, frozen, or not
running this operation) makes the others raise :class:`AgreementTimeout`, naming the missing ranks
when the default store can tell (every rank marks its arrival there first when ``mark=True``).
The waits are :func:`canzona.runtime.comm.wait_bounded`'s: the rank that gives up posts where it
waited, and every rank inside another bounded wait of the step (a gradient collective a rank that
skipped a ``step()`` sits in) raises the same line within a poll slice, naming each rank's
position. After a timeout the process group has a collective in flight that will never match:
destroy it.

The exchange runs on CPU tensors (:func:`status_group`: the default process group when it can
reduce CPU tensors, gloo or a ``cpu:gloo,cuda:nccl`` device map; otherwise, e.g. a world
initialized with ``nccl`` alone, a gloo group over every rank made once). So on GPUs it never
makes the host wait for the CUDA streams: only flags that are themselves computed on the device
(the gradients' finiteness, in the step's first exchange) are copied to the host, the one
synchronization that "refuse before anything changes" requires; the second exchange, which
carries only errors, does not touch the device. On a gloo world the exchange shares the default
group, queued behind the step's all-gathers, rather than opening a gloo group of its own whose
threads compete with the step's (measured in docs/runtime.md, "Collectives per backend").

Both collectives go through :class:`canzona.runtime.comm.Comm`, inside a phase of their own,
``canzona/status`` (an NVTX and profiler range, a :class:`~canzona.runtime.phases.PhaseTimer`
entry, and the key their bytes are filed under): control traffic, kept apart from the paper's
phases. Its wall time includes waiting for the slowest rank to arrive, so in a trace it is where
skew between ranks shows. Callers pass their own ``comm`` over :func:`status_group` (with the
optimizer's ``comm_stats``) to have the bytes counted; without one the exchange is not counted
(construction).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from canzona.optim import nonfinite_flags
from canzona.runtime.comm import CollectiveTimeout, Comm, count_step, default_store, record_process, wait_bounded
from canzona.runtime.phases import phase

__all__ = [
    "MESSAGE_BYTES",
    "STATUS_TIMEOUT_S",
    "AgreementTimeout",
    "HyperparameterMismatch",
    "NonFiniteGradient",
    "RankFailure",
    "ReplicaGuard",
    "ReplicasDiverged",
    "PendingAgreement",
    "agree",
    "agree_start",
    "check_step_flags",
    "describe",
    "mark_arrival",
    "missing_ranks",
    "nonfinite",
    "reduces_cpu_tensors",
    "status_group",
    "step_flags",
    "new_tag",
]

#: default bound (seconds) on waiting for the other ranks in one status exchange
STATUS_TIMEOUT_S = 60.0
#: bytes of each rank's error message carried by the exchange (longer messages are cut)
MESSAGE_BYTES = 1024
#: ``what`` of the optimizer step's first status exchange (every layout's step calls it once)
STEP = "optimizer step"

_seq = itertools.count()  # every rank calls agree() in the same order, so this numbers the calls alike
#: weak references to (the default process group, the status group made for it, None where the
#: default group is the status group): one status group per process group. Weak, so that after
#: ``destroy_process_group`` nothing here keeps a group (and its backend's threads) alive until
#: the interpreter shuts down; torch's own registry holds the status group while it is in use.
_status: tuple[Any, Any] | None = None


def reduces_cpu_tensors(backend: str) -> bool:
    """Whether a process group of ``backend`` (``dist.get_backend()``'s string) runs collectives on
    CPU tensors: ``gloo`` or ``mpi``, or a device map that names a backend for ``cpu``
    (``cpu:gloo,cuda:nccl``); not ``nccl`` alone."""
    b = backend.lower().replace(" ", "")
    if ":" not in b:
        return b in ("gloo", "mpi")
    return any(part.split(":", 1)[0] == "cpu" for part in b.split(","))


def status_group() -> Any:
    """The process group the status exchanges run on, with CPU tensors: the default group (None)
    when it reduces CPU tensors (:func:`reduces_cpu_tensors`) or holds one rank, else a gloo group
    over every rank.

    Decided (and the gloo group made, a collective) on the first call after the default process
    group was initialized: every rank makes that first call at the same point (the optimizers'
    constructors, in :func:`canzona.distributed.exchange_fingerprints`); later calls reuse it until
    that process group is destroyed."""
    global _status
    default = dist.distributed_c10d._get_default_group()  # noqa: SLF001 - identity of the current world
    if _status is None or _status[0]() is not default:
        own = dist.get_world_size() > 1 and not reduces_cpu_tensors(str(dist.get_backend()))
        record_process(dist.get_rank())  # once per world: lets a rank that gives up tell a stopped peer
        group = dist.new_group(backend="gloo") if own else None
        _status = (weakref.ref(default), weakref.ref(group) if group is not None else None)
    if _status[1] is None:
        return None
    group = _status[1]()
    if group is None:  # destroyed on its own while the default group lives on
        raise RuntimeError("canzona's status process group was destroyed while the default process group is still in use")
    return group


class RankFailure(RuntimeError):
    """An error on one or more ranks, raised on every rank. ``failures`` maps rank -> message."""

    def __init__(self, what: str, failures: dict[int, str]) -> None:
        self.what = what
        self.failures = dict(failures)
        parts = [f"rank {r}: {m}" for r, m in sorted(self.failures.items())]
        super().__init__(f"{what} failed on {len(parts)} rank(s); " + "; ".join(parts))


class AgreementTimeout(CollectiveTimeout):
    """Some rank did not join a status exchange within its time bound (or another rank gave up on
    the process group while this one waited in the exchange)."""


class ReplicasDiverged(RuntimeError):
    """Ranks that each keep a replica of the same state no longer agree (a step's updates failed
    on some of them); steps and saves are refused until a checkpoint is loaded."""


class PartlyLoaded(RuntimeError):
    """A refused ``load_state_dict`` of DCP's Stateful form found values that ``dcp.load`` had
    already written into this optimizer's tensors; steps and saves are refused until a load
    succeeds."""


class ReplicaGuard:
    """Refuses to go on from replicas that a failed update left different.

    Under ``sc`` (every DP rank updates every parameter) and the ``sync`` TP schedule (every TP
    rank computes every task), each rank keeps its own copy of the same masters and optimizer
    state. When the update phase fails on some ranks only, the second status exchange raises
    :class:`RankFailure` everywhere, but the ranks that did not fail have updated their copies and
    the failing ones have not (or only partly): the copies now differ, and every later step would
    silently train diverged replicas. The guard records the failure (every rank sees the same
    exchange, so every rank records it) and :meth:`check` then raises :class:`ReplicasDiverged` on
    every rank, before any collective, until :meth:`clear` (a checkpoint load) puts the same state
    on every rank again. Where each piece of state has one owner (``lb-asc``, ``asc``, ``zero1``,
    ``layerwise``, hosted TP schedules) a failed update leaves one consistent state, and the guard
    is off.
    """

    def __init__(self, replicated: bool, layout: str) -> None:
        #: whether the ranks keep replicas of the same state (the guard is off otherwise)
        self.replicated = bool(replicated)
        self.layout = layout
        #: the failure that left the replicas different (None: they agree)
        self.cause: str | None = None
        #: why a refused load left partly loaded values (None: none did); on every layout
        self.partial: str | None = None

    def failed(self, exc: BaseException) -> None:
        """Record that the update phase failed (call where the update exchange raised)."""
        if self.replicated:
            self.cause = describe(exc)

    def partly_loaded(self, cause: str) -> None:
        """Record that a refused load left this rank's tensors partly loaded (``dcp.load`` writes
        into the Stateful's tensors before ``load_state_dict`` can check them). Every rank refuses
        such a load alike (its status exchange), so every rank records it."""
        self.partial = cause

    def tripped(self) -> bool:
        """Whether :meth:`check` would raise."""
        return self.partial is not None or self.cause is not None

    def check(self, what: str) -> None:
        """Raise :class:`PartlyLoaded` when a refused load left partly loaded values, and
        :class:`ReplicasDiverged` when a recorded failure left the replicas different."""
        if self.partial is not None:
            raise PartlyLoaded(
                f"{what} refused: a refused load_state_dict left this optimizer partly loaded, since dcp.load had "
                f"already written into its tensors ({self.partial}); load a good checkpoint "
                "(dcp.load, load_checkpoint or canzona.runtime.dcp.load_sharded) to go on"
            )
        if self.cause is not None:
            raise ReplicasDiverged(
                f"{what} refused: under {self.layout} every rank keeps its own copy of the masters and "
                "optimizer state, and an earlier step's updates failed on some ranks only, so the copies "
                f"now differ ({self.cause}); load a checkpoint saved before that step "
                "(load_checkpoint, load_state_dict or canzona.runtime.dcp.load_sharded) to go on"
            )

    def clear(self) -> None:
        """Every rank holds the same state again (a checkpoint was loaded)."""
        self.cause = None
        self.partial = None


def describe(exc: BaseException) -> str:
    """``Type: message`` on one line, the form the exchange carries."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _wait(work: Any, timeout_s: float, what: str, group: Any, tag: str | None) -> None:
    if work is None:  # one rank: nothing to wait for
        return
    wait = getattr(work, "_work", work).wait  # a bounded work's own wait: the bound here is ``timeout_s``
    try:
        wait_bounded(wait, timeout_s, f"the status exchange ({what})")
    except CollectiveTimeout as exc:
        missing = _missing(group, tag)
        who = f"rank(s) {missing} did not join the status exchange within {timeout_s:g} s (dead, frozen, or not running this operation); " if missing else ""
        raise AgreementTimeout(f"{what}: {who}{exc}") from None


def _store() -> Any:
    return default_store()


def new_tag(kind: str) -> str:
    """A store key prefix for one exchange (every rank numbers its exchanges in the same order)."""
    return f"canzona/{kind}/{next(_seq)}"


def mark_arrival(tag: str) -> None:
    """Record in the default store that this rank reached the exchange ``tag`` (best effort)."""
    _mark(tag)


def missing_ranks(tag: str, group: Any = None) -> list[int]:
    """Ranks of ``group`` that did not :func:`mark_arrival` at ``tag`` (empty when unknown)."""
    return _missing(group, tag)


def _mark(tag: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(f"{tag}/{dist.get_rank()}", "1")
        except Exception:  # noqa: BLE001 - naming is best effort
            pass


def _missing(group: Any, tag: str | None) -> list[int]:
    """Global ranks of ``group`` that did not mark their arrival at ``tag`` (empty: unknown)."""
    store = _store()
    if tag is None or store is None:
        return []
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    try:
        return [r for r in ranks if not store.check([f"{tag}/{r}"])]
    except Exception:  # noqa: BLE001 - naming is best effort
        return []


def agree(
    error: BaseException | None,
    what: str,
    *,
    flags: torch.Tensor | None = None,
    comm: Comm | None = None,
    timeout_s: float = STATUS_TIMEOUT_S,
    mark: bool = False,
) -> torch.Tensor | None:
    """Join the status exchange for operation ``what`` (see the module docstring).

    ``error`` is this rank's exception (None: it succeeded). ``flags`` (int64, 1-D, same length on
    every rank, on any device) are max-reduced with the error flag; the reduced flags are returned
    (on CPU) when no rank failed. ``comm``: the :class:`~canzona.runtime.comm.Comm` to exchange
    (and count bytes) through, over a group that reduces CPU tensors (default: an uncounted one
    over :func:`status_group`). ``mark=True`` records this rank's arrival in the default store
    first, so a timeout can name the ranks that never came (a few store round trips: use it for
    rare operations).
    """
    with phase("canzona/status"):  # one range for the launch and the wait
        return _launch(error, what, flags, comm, timeout_s, mark)._settle()


class PendingAgreement:
    """A status exchange launched by :func:`agree_start`; :meth:`finish` waits for it and returns
    or raises exactly what :func:`agree` would. Every rank must call :meth:`finish` once, and
    issue the same collectives in between (a rank that failed joins them with harmless data), so
    that the exchange completes on all of them; nothing may change state in between, since the
    outcome (a refusal) is not known before :meth:`finish`."""

    __slots__ = ("comm", "error", "tag", "timeout_s", "vec", "what", "work")

    def __init__(self, error: BaseException | None, what: str, comm: Comm, timeout_s: float, tag: str | None,
                 vec: torch.Tensor, work: Any) -> None:
        self.error, self.what, self.comm, self.timeout_s, self.tag, self.vec, self.work = error, what, comm, timeout_s, tag, vec, work

    def finish(self) -> torch.Tensor | None:
        """Wait (at most ``timeout_s``); the reduced flags when no rank failed, else
        :class:`RankFailure` (after a second exchange of the failing ranks' messages)."""
        with phase("canzona/status"):
            return self._settle()

    def _settle(self) -> torch.Tensor | None:
        comm, error, what, vec = self.comm, self.error, self.what, self.vec
        group = comm.group
        _wait(self.work, self.timeout_s, what, group, self.tag)
        if int(vec[0].item()) == 0:
            return vec[1:]
        # some rank failed: every rank learns who and why
        raw = describe(error).encode("utf-8", "replace")[:MESSAGE_BYTES] if error is not None else b""
        msg = torch.zeros(MESSAGE_BYTES + 1, dtype=torch.uint8)
        if error is not None:
            msg[0] = 1
            msg[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else msg[1:1]
        out, work = comm.all_gather_equal(msg, async_op=True)
        _wait(work, self.timeout_s, what, group, self.tag)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(comm.size))
        failures: dict[int, str] = {}
        for r, t in zip(ranks, out.view(comm.size, -1)):
            vals = t.cpu()
            if int(vals[0]) == 1:
                failures[r] = bytes(vals[1:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
        failure = RankFailure(what, failures)
        if error is not None:
            raise failure from error
        raise failure


def agree_start(
    error: BaseException | None,
    what: str,
    *,
    flags: torch.Tensor | None = None,
    comm: Comm | None = None,
    timeout_s: float = STATUS_TIMEOUT_S,
    mark: bool = False,
) -> PendingAgreement:
    """Launch :func:`agree`'s exchange without waiting for it (same arguments): the caller overlaps
    it with work that changes nothing (the FSDP2 step's first gather, which only moves gradients)
    and calls :meth:`PendingAgreement.finish` before anything changes. The launch and the wait
    are two ``canzona/status`` ranges."""
    with phase("canzona/status"):
        return _launch(error, what, flags, comm, timeout_s, mark)


def _launch(error: BaseException | None, what: str, flags: torch.Tensor | None, comm: Comm | None, timeout_s: float,
            mark: bool) -> PendingAgreement:
    comm = comm if comm is not None else Comm(status_group())
    if what == STEP:
        count_step()  # names a rank that skipped or added a step when the step's collectives stop matching
    tag = new_tag("agree") if mark else None
    if tag is not None:
        _mark(tag)
    n = 0 if flags is None else int(flags.numel())
    vec = torch.zeros(1 + n, dtype=torch.int64)
    if error is not None:
        vec[0] = 1
    if flags is not None:
        vec[1:] = flags.reshape(-1).to(device="cpu", dtype=torch.int64)  # device flags: the one host sync
    work = comm.all_reduce(vec, op="max", async_op=True)
    return PendingAgreement(error, what, comm, timeout_s, tag, vec, work)


# ------------------------------------------------------------------------------ the optimizer step's status


class NonFiniteGradient(ValueError):
    """A reduced gradient holds NaN or inf; raised on every rank before anything changes."""


class HyperparameterMismatch(RuntimeError):
    """Ranks run different hyperparameters (their per-step digests differ)."""


def nonfinite(pieces: Sequence[torch.Tensor | None], device: torch.device | str = "cpu") -> torch.Tensor:
    """One bool per gradient piece: does it hold NaN or inf (None or empty: False)? The optimizers'
    own exact test (:func:`canzona.optim._common.nonfinite_flags`: max-abs or min/max per piece,
    on CPU behind a cheaper sum that settles the all-finite case; no false alarm on finite values
    whose sum would overflow, no host sync on CUDA), so the step's flags and what the optimizers
    would find agree by construction."""
    return nonfinite_flags(pieces, device)


def step_flags(digest: int, received: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """The flags a rank brings to the optimizer step's status exchange (:func:`agree`, reduced with
    MAX): ``[digest, -digest, received (n), non-finite (n)]``, ``received`` and ``bad`` one entry per
    parameter in an order every rank shares. ``digest`` and ``-digest`` reduce to the largest and
    minus the smallest digest, which are equal only when every rank hashed the same hyperparameters.
    Built on CPU, where the exchange runs: ``bad`` computed on a device is its one copy to the host."""
    head = torch.tensor([digest, -digest], dtype=torch.int64)
    return torch.cat([head, received.to(device="cpu", dtype=torch.int64), bad.to(device="cpu", dtype=torch.int64)])


def check_step_flags(reduced: torch.Tensor, names: Sequence[str]) -> frozenset[str]:
    """Act on the reduced :func:`step_flags` (identical on every rank, so every rank raises alike):
    :class:`HyperparameterMismatch` when the digests differ, :class:`NonFiniteGradient` naming the
    parameters any rank found non-finite; returns the parameters no rank had a gradient for."""
    n = len(names)
    if int(reduced[0]) != -int(reduced[1]):
        raise HyperparameterMismatch(
            "hyperparameters differ across ranks (lr, weight_decay or the optimizers' arguments); "
            "every rank must run the same optimizer settings and schedule"
        )
    flags = reduced.tolist()  # one conversion, not a tensor read per parameter
    bad = [names[k] for k in range(n) if flags[2 + n + k]]
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteGradient(
            f"non-finite gradient in {', '.join(bad[:3])}{more}; no parameter or optimizer state was "
            "changed on any rank and this step's gradients were dropped"
        )
    return frozenset(names[k] for k in range(n) if not flags[2 + k])
