"""The TP side of Canzona: asynchronous micro-group compute for TP-split matrix parameters (Section 4).

Tensor parallelism splits a weight matrix across the TP ranks of a DP rank, which breaks the
atomicity a matrix optimizer needs. Canzona makes each TP-split matrix parameter a *task* with one
*host* TP rank (Section 4.1) that keeps the task's full-shape fp32 master and its whole optimizer
state. For each micro-group of the plan (Algorithm 2, ``plan.micro_groups[dp_rank]``), in order:

1. gather   one fused ``all_to_all_single``: every TP rank sends its gradient shard of every task
            in the group to that task's host (``canzona/tp/gather/group<k>``);
2. compute  each host concatenates the shards along the split dim into the full gradient and runs
            the ordinary per-parameter optimizer on the full master (``canzona/tp/compute/group<k>``);
3. scatter  one fused ``all_to_all_single`` returns every TP rank its slice of the updated
            parameter, as *values*, not deltas (``canzona/tp/scatter/group<k>``);
4. apply    every rank copies its slices into its TP-local masters (``canzona/tp/apply/group<k>``).

``no-fuse`` (the fusion ablation) is the same code with one task per group. ``sync`` (the SC and
NV-layerwise baselines) instead all-gathers full gradients on every TP rank, every rank computes
every update redundantly (so each holds full masters and state for all of them) and keeps its
shard; its exchanges are chunked into consecutive groups bounded by C_max as well.

Which parameters a TP group handles is decided by DP ownership (the caller passes the TP-local
masters of the TP-split matrix parameters its DP rank updates); which TP rank hosts each one, and
how tasks batch, by the plan's micro-groups for that DP rank. The engine never re-plans.

Overlap (the schedule is :func:`pipeline`, recorded per step in ``TPEngine.last_events``). While
group k computes, gather k+1 and scatter k-1 are in flight; group k-1's values are applied
right after compute k, when its scatter has had a whole compute to land, and scatter k is then
launched to land during compute k+1. Every exchange is ``async_op=True`` with its own
``.../launch`` and ``.../wait`` phase ranges (``canzona/tp/scatter/group3/wait``), so a trace shows
how long the host was really blocked (exposed communication) apart from issue cost. On NCCL the
all-to-alls run on NCCL's stream and ``wait`` only orders the compute stream after them, so the
host's Newton-Schulz / eigh kernels overlap the exchanges for real. On gloo an async collective
runs on the process group's worker threads, so it overlaps the compute only as far as free CPU
cores allow (with one core per rank, as in the tests, the exchange and the compute share it).
``PhaseTimer`` keys the stages apart (``canzona/tp/gather/launch``, ``canzona/tp/gather/wait``);
``CommStats`` counts one collective per exchange under the base name. The compute phase of a
group is entered twice: once to copy the gathered shards out of the gather slot (which the next
gather reuses at once), once for the optimizer.

Memory. Two exchange slots are reserved at construction and reused by every group of every step
(:class:`ExchangeSlots`, ``reserved_exchange_bytes``): the gather slot (shard-side send buffer,
full-side receive buffer) and the scatter slot (full-side send, shard-side receive), each buffer
as long as the largest group needs. ``state_bytes()`` is this rank's optimizer-state bytes
(full-shape state of the tasks it hosts); ``peak_exchange_bytes`` the largest single exchange
buffer of one group on this rank. The plan's C_max bounds the bytes of full gradient a host
receives per group, hence every full-side buffer; a shard-side buffer holds one shard of each task
of the group, a 1/tp share of every host's bytes, so it is bounded by C_max too. Only a task larger
than C_max by itself (given its own group by the planner, with a warning) exceeds it. What is
still allocated per group: the full gradients unpacked on the host (they become ``.grad`` of the
full masters and must outlive the gather slot's reuse) and, under ``sync``, each rank's full copies.

Byte accounting comes from :class:`canzona.runtime.comm.Comm` (files bytes under the open phase).
Construction assembles full masters with one exchange per group outside any phase (filed under
``unphased``); callers that report per-step bytes reset the stats after construction.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from canzona.plan.plan import Plan
from canzona.runtime.hooks import RemovableHandle, UpdateHook, UpdateHooks
from canzona.runtime.comm import Comm
from canzona.phase_names import LAUNCH, WAIT, indexed
from canzona.runtime.phases import TP_APPLY, TP_COMPUTE, TP_GATHER, TP_SCATTER, phase

__all__ = [
    "TPTask",
    "TPEngine",
    "pack_gather",
    "gather_recv_sizes",
    "unpack_gather",
    "pack_scatter",
    "scatter_recv_sizes",
    "unpack_scatter",
    "all_to_all_reference",
    "sync_groups",
    "pipeline",
    "ExchangeSlots",
]


# ============================================================================ packing (pure)


@dataclass(frozen=True, slots=True)
class TPTask:
    """One TP-split parameter in an exchange: its host TP rank, shard shape and split dim."""

    name: str
    host: int
    local_shape: tuple[int, ...]
    tp_dim: int

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


def _hosted(tasks: Sequence[TPTask], rank: int) -> list[TPTask]:
    return [t for t in tasks if t.host == rank]


def _into(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``out[:numel]`` (a reserved exchange buffer), or a fresh buffer when ``out`` is None."""
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if out.numel() < numel or out.dtype != dtype or out.dim() != 1:
        raise ValueError(f"exchange buffer of {out.numel()} {out.dtype} elements cannot hold {numel} {dtype}")
    return out[:numel]


def pack_gather(
    tasks: Sequence[TPTask],
    shards: Mapping[str, torch.Tensor],
    tp: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Send buffer of the gather all-to-all: this rank's shard of each task, grouped by destination
    host (rank order), tasks in group order within a host. Returns (flat buffer, send split sizes).
    With ``out`` (a 1-D buffer of ``dtype`` at least that long) the shards are copied into its front."""
    order: list[TPTask] = []
    sizes: list[int] = []
    for dest in range(tp):
        mine = _hosted(tasks, dest)
        order.extend(mine)
        sizes.append(sum(t.local_numel for t in mine))
    for t in order:
        s = shards[t.name]
        if tuple(s.shape) != t.local_shape:
            raise ValueError(f"{t.name}: shard has shape {tuple(s.shape)}, expected {t.local_shape}")
    buf = _into(out, sum(sizes), dtype, device)
    off = 0
    for t in order:
        buf[off : off + t.local_numel].view(t.local_shape).copy_(shards[t.name])
        off += t.local_numel
    return buf, sizes


def gather_recv_sizes(tasks: Sequence[TPTask], rank: int, tp: int) -> list[int]:
    """Receive split sizes of the gather on ``rank``: the same block (its hosted tasks' shards) from every rank."""
    return [sum(t.local_numel for t in _hosted(tasks, rank))] * tp


def unpack_gather(recv: torch.Tensor, tasks: Sequence[TPTask], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Full tensors of the tasks hosted on ``rank`` from the gather's receive buffer: block ``s``
    holds rank ``s``'s shards; shards are concatenated along each task's split dim in rank order."""
    mine = _hosted(tasks, rank)
    block = sum(t.local_numel for t in mine)
    if recv.numel() != block * tp:
        raise ValueError(f"gather receive buffer has {recv.numel()} elements, expected {block * tp}")
    return _assemble(recv, mine, tp)


def _assemble(recv: torch.Tensor, tasks: Sequence[TPTask], tp: int) -> dict[str, torch.Tensor]:
    """Full tensors of ``tasks`` from ``tp`` equal blocks of ``recv``, block ``s`` holding rank ``s``'s
    shards in task order (the gather's hosted tasks, or every task of a ``sync`` all-gather)."""
    block = sum(t.local_numel for t in tasks)
    out: dict[str, torch.Tensor] = {}
    off = 0
    for t in tasks:
        pieces = [recv[s * block + off : s * block + off + t.local_numel].view(t.local_shape) for s in range(tp)]
        out[t.name] = torch.cat(pieces, dim=t.tp_dim)
        off += t.local_numel
    return out


def pack_scatter(
    tasks: Sequence[TPTask],
    full: Mapping[str, torch.Tensor],
    rank: int,
    tp: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Send buffer of the scatter all-to-all on host ``rank``: for each destination rank (in order),
    that rank's slice of each hosted task's full tensor (group order). Values are copied (into the
    front of ``out`` when given)."""
    mine = _hosted(tasks, rank)
    block = sum(t.local_numel for t in mine)
    buf = _into(out, block * tp, dtype, device)
    off = 0
    for dest in range(tp):
        for t in mine:
            buf[off : off + t.local_numel].view(t.local_shape).copy_(full[t.name].chunk(tp, dim=t.tp_dim)[dest])
            off += t.local_numel
    return buf, [block] * tp


def scatter_recv_sizes(tasks: Sequence[TPTask], rank: int, tp: int) -> list[int]:
    """Receive split sizes of the scatter: from each host, one shard of each task it hosts."""
    del rank  # every rank receives one shard of every task
    return [sum(t.local_numel for t in _hosted(tasks, s)) for s in range(tp)]


def unpack_scatter(recv: torch.Tensor, tasks: Sequence[TPTask], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's updated shard of every task (views into ``recv``), from the scatter's receive buffer."""
    del rank
    out: dict[str, torch.Tensor] = {}
    off = 0
    for s in range(tp):
        for t in _hosted(tasks, s):
            out[t.name] = recv[off : off + t.local_numel].view(t.local_shape)
            off += t.local_numel
    if off != recv.numel():
        raise ValueError(f"scatter receive buffer has {recv.numel()} elements, expected {off}")
    return out


def all_to_all_reference(sends: Sequence[torch.Tensor], send_sizes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """What ``all_to_all_single`` delivers, computed in one process: rank r receives, in source
    order, the r-th piece of every rank's send buffer. For unit tests of the packing."""
    tp = len(sends)
    pieces = [list(s.split(list(sz))) for s, sz in zip(sends, send_sizes)]
    return [torch.cat([pieces[src][dst] for src in range(tp)]) for dst in range(tp)]


def sync_groups(tasks: Sequence[TPTask], tp: int, cmax_bytes: int, element_size: int) -> list[list[TPTask]]:
    """Chunk the ``sync`` schedule's tasks (plan order) into consecutive groups whose all-gathered
    full tensors fit in ``cmax_bytes`` (a task above it gets a group of its own)."""
    groups: list[list[TPTask]] = []
    cur: list[TPTask] = []
    size = 0
    for t in tasks:
        nbytes = t.local_numel * tp * element_size
        if cur and size + nbytes > cmax_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += nbytes
    if cur:
        groups.append(cur)
    return groups


# ============================================================================ the engine


@dataclass(frozen=True, slots=True)
class _Group:
    index: int
    tasks: tuple[TPTask, ...]
    hosted: tuple[str, ...]  # names this rank computes in this group
    send_bytes: int  # gather send buffer on this rank (= scatter receive)
    recv_bytes: int  # gather receive buffer on this rank (= scatter send)

    @property
    def phase_index(self) -> str:
        return f"group{self.index}"


#: Events of one step, in the order :meth:`TPEngine.step` runs them (see :func:`pipeline`).
GATHER_LAUNCH, GATHER_WAIT, COMPUTE, SCATTER_LAUNCH, SCATTER_WAIT, APPLY = (
    "gather/launch",
    "gather/wait",
    "compute",
    "scatter/launch",
    "scatter/wait",
    "apply",
)


def pipeline(n_groups: int, *, sync: bool = False) -> list[tuple[str, int]]:
    """The engine's schedule for ``n_groups`` micro-groups: ``(event, group)`` in execution order.

    Two exchange slots, each reserved once: the *gather slot* (shard-side send, full-side
    receive) and the *scatter slot* (full-side send, shard-side receive). At most one collective
    is in flight per slot, so at most two groups' exchanges are in flight at any time and the
    reserved exchange memory is two slots, each buffer bounded by C_max (Algorithm 2's bound on one
    group's bytes per host). Per group ``k``:

    1. wait for gather ``k`` (it was launched during the previous group);
    2. launch gather ``k+1`` into the gather slot, just freed: it is in flight while ``k`` computes;
    3. compute ``k`` (the host's optimizer step on full tensors);
    4. wait for scatter ``k-1`` and apply its values (it was in flight during compute ``k``), which
       frees the scatter slot;
    5. launch scatter ``k`` into it: it lands while group ``k+1`` computes.

    After the last group, the last scatter is waited for and applied. ``sync`` (the SC and
    NV-layerwise baselines: all-gather, every rank computes everything) has no scatter: each group
    applies its own slices right after its compute.
    """
    ev: list[tuple[str, int]] = []
    if n_groups <= 0:
        return ev
    ev.append((GATHER_LAUNCH, 0))
    for k in range(n_groups):
        ev.append((GATHER_WAIT, k))
        if k + 1 < n_groups:
            ev.append((GATHER_LAUNCH, k + 1))
        ev.append((COMPUTE, k))
        if sync:
            ev.append((APPLY, k))
            continue
        if k > 0:
            ev += [(SCATTER_WAIT, k - 1), (APPLY, k - 1)]
        ev.append((SCATTER_LAUNCH, k))
    if not sync:
        ev += [(SCATTER_WAIT, n_groups - 1), (APPLY, n_groups - 1)]
    return ev


@dataclass(frozen=True, slots=True)
class ExchangeSlots:
    """The engine's exchange buffers, reserved once and reused by every group of every step.

    ``shard`` buffers hold one TP-local shard per task of a group (gather send, scatter receive),
    ``full`` buffers a group's full tensors on their host (gather receive, scatter send); each is as
    long as the largest group needs. ``sync`` has no scatter slot (empty tensors)."""

    gather_shard: torch.Tensor
    gather_full: torch.Tensor
    scatter_full: torch.Tensor
    scatter_shard: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.gather_shard, self.gather_full, self.scatter_full, self.scatter_shard)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class TPEngine:
    """Section 4's TP optimizer step for one DP rank's TP group (see the module docstring).

    ``comm`` is a :class:`Comm` over this DP rank's TP group (group-local ranks = TP ranks).
    ``local_masters`` are the fp32 TP-local master shards (``spec.local_shape``) of the TP-split
    matrix parameters this DP rank updates; :meth:`step` updates them in place.
    ``optimizer_factory`` builds ONE per-parameter optimizer over the full-shape masters hosted
    here (not called when this rank hosts nothing).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        dp_rank: int,
        comm: Comm,
        optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        local_masters: dict[str, torch.Tensor],
    ) -> None:
        inp = plan.inputs
        self.plan = plan
        self.comm = comm
        self.dp_rank = dp_rank
        self.tp = comm.size
        self.tp_rank = comm.rank
        self.schedule = inp.tp_schedule
        self.local_masters = local_masters
        #: per-update hooks on the hosts' full updates (a DP runtime replaces it with its own)
        self.update_hooks = UpdateHooks()
        if inp.tp != self.tp:
            raise ValueError(f"plan has tp={inp.tp} but the TP group has {self.tp} ranks")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < inp.dp:
            raise ValueError(f"dp_rank must be in [0, {inp.dp}), got {dp_rank!r}")
        by_name = plan.by_name()
        self._dtype = self._check_masters(by_name)
        # device of the exchange buffers (masters live on the model's device; none: nothing to exchange)
        self._device = next(iter(local_masters.values())).device if local_masters else torch.device("cpu")
        order = {p.name: i for i, p in enumerate(plan.params)}
        names = sorted(local_masters, key=order.__getitem__)
        es = self._es = torch.empty(0, dtype=self._dtype).element_size()

        def task(name: str, host: int) -> TPTask:
            spec = by_name[name].spec
            return TPTask(name, host, spec.local_shape, int(spec.tp_dim))  # type: ignore[arg-type]

        self.sync = self.schedule == "sync"
        groups: list[list[TPTask]] = []
        if self.sync:
            # Every TP rank computes every update: "host" marks nothing here, all tasks are local.
            groups = sync_groups([task(n, -1) for n in names], self.tp, inp.cmax_bytes, es)
        else:
            planned = plan.micro_groups[dp_rank] if len(plan.micro_groups) > dp_rank else ()
            in_groups = [n for g in planned for n in g.params]
            if set(in_groups) != set(names):
                missing = sorted(set(in_groups) - set(names))
                extra = sorted(set(names) - set(in_groups))
                raise ValueError(
                    f"local_masters disagree with the plan's micro-groups of dp rank {dp_rank}: "
                    f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, not in any group {extra[:3]}{'...' if len(extra) > 3 else ''}"
                )
            groups = [[task(n, h) for n, h in zip(g.params, g.hosts)] for g in planned]
        self.groups: tuple[_Group, ...] = tuple(self._describe(k, g, es) for k, g in enumerate(groups))
        #: names of the parameters whose full master and optimizer state live on this rank
        self.hosted: tuple[str, ...] = tuple(n for g in self.groups for n in g.hosted)
        #: largest single exchange buffer (bytes) of one group on this rank
        self.peak_exchange_bytes: int = max((max(g.send_bytes, g.recv_bytes) for g in self.groups), default=0)
        #: the schedule :meth:`step` runs (see :func:`pipeline`)
        self.schedule_events: tuple[tuple[str, int], ...] = tuple(pipeline(len(self.groups), sync=self.sync))
        shard_n = max((g.send_bytes for g in self.groups), default=0) // es
        full_n = max((g.recv_bytes for g in self.groups), default=0) // es

        def reserve(n: int) -> torch.Tensor:
            return torch.empty(n, dtype=self._dtype, device=self._device)

        #: exchange buffers reserved once (two slots; ``reserved_exchange_bytes`` in total)
        self.slots = ExchangeSlots(
            reserve(shard_n), reserve(full_n), reserve(0 if self.sync else full_n), reserve(0 if self.sync else shard_n)
        )
        self.reserved_exchange_bytes: int = self.slots.nbytes
        #: ``(event, group)`` as the last :meth:`step` executed them (equals ``schedule_events``)
        self.last_events: list[tuple[str, int]] = []
        self.masters: dict[str, nn.Parameter] = {}
        self.refresh_masters()
        params = [self.masters[n] for n in self.hosted]
        self.optimizer: torch.optim.Optimizer | None = optimizer_factory(params) if params else None
        if self.optimizer is not None:
            got = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
            if got != {id(p) for p in params}:
                raise ValueError("optimizer_factory must build an optimizer over exactly the parameters it is given")

    # ------------------------------------------------------------------------- set-up helpers
    def _check_masters(self, by_name: Mapping[str, Any]) -> torch.dtype:
        dtypes = set()
        for name, t in self.local_masters.items():
            if name not in by_name:
                raise ValueError(f"{name!r} is not a parameter of the plan")
            p = by_name[name]
            spec = p.spec
            if p.role != "tp-task":
                raise ValueError(f"{name}: the TP engine handles TP-split matrix parameters only")
            if not p.replicated and p.dp_owner != self.dp_rank:
                raise ValueError(f"{name}: owned by dp rank {p.dp_owner}, not by this rank ({self.dp_rank})")
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != spec.local_shape:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: local master has shape {shape}, expected {spec.local_shape}")
            if not t.is_floating_point():
                raise TypeError(f"{name}: masters must be floating point, got {t.dtype}")
            dtypes.add(t.dtype)
        if len(dtypes) > 1:
            raise TypeError(f"all local masters must share one dtype, got {sorted(map(str, dtypes))}")
        return dtypes.pop() if dtypes else torch.float32

    def _describe(self, k: int, tasks: list[TPTask], es: int) -> _Group:
        send = sum(t.local_numel for t in tasks) * es
        if self.sync:
            hosted = tuple(t.name for t in tasks)
            recv = send * self.tp
        else:
            hosted = tuple(t.name for t in _hosted(tasks, self.tp_rank))
            recv = gather_recv_sizes(tasks, self.tp_rank, self.tp)[0] * self.tp * es
        return _Group(k, tuple(tasks), hosted, send, recv)

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """(Re)assemble the full-shape masters hosted here from every rank's ``local_masters``
        (one exchange per group, through the gather slot). Called at construction; call it again
        after overwriting ``local_masters`` from outside (e.g. a checkpoint load). Optimizer state
        is kept."""
        for g in self.groups:
            work = self._launch_gather(g, self.local_masters)
            if work is not None:
                work.wait()
            for name, t in self._unpack_gather(g).items():
                if name in self.masters:
                    self.masters[name].copy_(t)
                else:
                    self.masters[name] = nn.Parameter(t.clone(memory_format=torch.contiguous_format))

    # ------------------------------------------------------------------------- the step
    def step(self, local_grads: Mapping[str, torch.Tensor], *, skip: Collection[str] = ()) -> None:
        """One optimizer step: gather -> compute -> scatter -> apply per micro-group, in plan order,
        pipelined as :func:`pipeline` says (gather ``k+1`` and scatter ``k-1`` in flight while
        group ``k`` computes).

        ``skip``: parameters without a gradient on any rank; hosts do not step them (their values
        return unchanged). An error in one host's compute does not stop the exchanges (the other
        TP ranks are waiting in them): that host returns its unchanged values for the group, runs
        the remaining groups' exchanges, and raises the first error at the end."""
        self._check_grads(local_grads)
        self.last_events = events = []
        groups = self.groups
        works: dict[tuple[str, int], Any] = {}
        full_grads: dict[str, torch.Tensor] = {}
        updated: dict[str, torch.Tensor] = {}
        error: Exception | None = None
        try:
            for ev, k in self.schedule_events:
                g = groups[k]
                events.append((ev, k))
                if ev == GATHER_LAUNCH:
                    with phase(indexed(TP_GATHER, g.phase_index, LAUNCH), bytes=g.send_bytes, group=k, peers=self.tp):
                        works[GATHER_WAIT, k] = self._launch_gather(g, local_grads)
                elif ev == GATHER_WAIT:
                    with phase(indexed(TP_GATHER, g.phase_index, WAIT), bytes=g.recv_bytes, group=k, peers=self.tp):
                        self._wait(works.pop((GATHER_WAIT, k)))
                    # unpacking copies out of the gather slot, which the next launch reuses at once
                    with phase(indexed(TP_COMPUTE, g.phase_index)):
                        full_grads = self._unpack_gather(g)
                elif ev == COMPUTE:
                    with phase(indexed(TP_COMPUTE, g.phase_index)):
                        try:
                            if error is not None:
                                raise error
                            updated = self._compute(g, full_grads, skip)
                        except Exception as exc:  # noqa: BLE001 - finish the exchanges, raise afterwards
                            error = error or exc
                            updated = {name: self.masters[name].detach() for name in g.hosted}
                    full_grads = {}
                elif ev == SCATTER_LAUNCH:
                    with phase(indexed(TP_SCATTER, g.phase_index, LAUNCH), bytes=g.recv_bytes, group=k, peers=self.tp):
                        works[SCATTER_WAIT, k] = self._launch_scatter(g, updated)
                    updated = {}
                elif ev == SCATTER_WAIT:
                    with phase(indexed(TP_SCATTER, g.phase_index, WAIT), bytes=g.send_bytes, group=k, peers=self.tp):
                        self._wait(works.pop((SCATTER_WAIT, k)))
                else:  # APPLY
                    with phase(indexed(TP_APPLY, g.phase_index)):
                        if self.sync:
                            self._apply(self._own_slices(g, updated))
                            updated = {}
                        else:
                            self._apply(unpack_scatter(self._scatter_recv(g), g.tasks, self.tp_rank, self.tp))
        except BaseException:
            # Exchanges still in flight write into the reserved slots: let them land before the
            # error leaves, so a later step never shares a buffer with a stale collective. Every
            # peer launched them before its own compute, so these waits cannot hang on a live group.
            for w in works.values():
                with contextlib.suppress(Exception):
                    self._wait(w)
            raise
        if error is not None:
            raise error

    def _check_grads(self, local_grads: Mapping[str, torch.Tensor]) -> None:
        if set(local_grads) != set(self.local_masters):
            missing = sorted(set(self.local_masters) - set(local_grads))
            extra = sorted(set(local_grads) - set(self.local_masters))
            raise ValueError(f"local_grads keys differ from local_masters: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, g in local_grads.items():
            if tuple(g.shape) != tuple(self.local_masters[name].shape):
                raise ValueError(f"{name}: gradient shard has shape {tuple(g.shape)}, expected {tuple(self.local_masters[name].shape)}")

    @staticmethod
    def _wait(work: Any) -> None:
        # NCCL: makes the current stream wait for the collective's stream (host does not block);
        # gloo: blocks this thread until the worker thread has finished the transfer.
        if work is not None:
            work.wait()

    def _launch_gather(self, g: _Group, shards: Mapping[str, torch.Tensor]) -> Any:
        """Pack the group's shards into the gather slot and start its collective (async): the
        all-to-all to hosts, or the all-gather under ``sync``. Returns the work handle."""
        slots = self.slots
        if self.sync:
            n = g.send_bytes // self._es
            flat = slots.gather_shard[:n]
            off = 0
            for t in g.tasks:
                flat[off : off + t.local_numel].view(t.local_shape).copy_(shards[t.name])
                off += t.local_numel
            _, work = self.comm.all_gather_equal(flat, out=slots.gather_full[: n * self.tp], async_op=True)
            return work
        send, send_sizes = pack_gather(g.tasks, shards, self.tp, dtype=self._dtype, out=slots.gather_shard)
        recv_sizes = gather_recv_sizes(g.tasks, self.tp_rank, self.tp)
        out = slots.gather_full[: sum(recv_sizes)]
        _, work = self.comm.all_to_all_v(send, send_sizes, recv_sizes, out=out, async_op=True)
        return work

    def _unpack_gather(self, g: _Group) -> dict[str, torch.Tensor]:
        """Full tensors (fresh copies) of the group's tasks computed on this rank, from the gather slot."""
        recv = self.slots.gather_full[: g.recv_bytes // self._es]
        if self.sync:
            return _assemble(recv, g.tasks, self.tp)
        return unpack_gather(recv, g.tasks, self.tp_rank, self.tp)

    def _compute(self, g: _Group, full_grads: Mapping[str, torch.Tensor], skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """Host side: run the optimizer on this group's full masters only. Other hosted params have
        no ``.grad`` at this point, and per-parameter optimizers skip those, so one optimizer
        steps exactly this group; grads are cleared afterwards so a later group does not re-step it."""
        if not g.hosted:
            return {}
        live = [n for n in g.hosted if n not in skip]
        params = [self.masters[n] for n in live]
        for name, p in zip(live, params):
            p.grad = full_grads[name].to(p.dtype)
        assert self.optimizer is not None
        try:
            if params and self.update_hooks:
                self.update_hooks.step(self.optimizer, list(zip(live, params)))
            elif params:
                self.optimizer.step()
        finally:
            for p in params:
                p.grad = None
        return {n: self.masters[n].detach() for n in g.hosted}

    def _launch_scatter(self, g: _Group, updated: Mapping[str, torch.Tensor]) -> Any:
        """Pack this host's updated values into the scatter slot and start the fused all-to-all back
        to every TP rank (async). Values, never deltas."""
        slots = self.slots
        send, send_sizes = pack_scatter(g.tasks, updated, self.tp_rank, self.tp, dtype=self._dtype, out=slots.scatter_full)
        recv_sizes = scatter_recv_sizes(g.tasks, self.tp_rank, self.tp)
        _, work = self.comm.all_to_all_v(send, send_sizes, recv_sizes, out=self._scatter_recv(g), async_op=True)
        return work

    def _scatter_recv(self, g: _Group) -> torch.Tensor:
        return self.slots.scatter_shard[: g.send_bytes // self._es]

    def _own_slices(self, g: _Group, updated: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {t.name: updated[t.name].chunk(self.tp, dim=t.tp_dim)[self.tp_rank] for t in g.tasks}

    @torch.no_grad()
    def _apply(self, shards: Mapping[str, torch.Tensor]) -> None:
        for name, s in shards.items():
            self.local_masters[name].copy_(s)

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """Call ``hook(name, param, optimizer)`` after each local step for every parameter this
        rank updated whole, before the value is sent (:mod:`canzona.runtime.hooks`); returns a
        handle whose ``remove()`` detaches it."""
        return self.update_hooks.register(hook)

    # ------------------------------------------------------------------------- hyperparameters
    def set_hyperparams(self, values: Mapping[str, Any]) -> None:
        """Write ``values`` (e.g. a scheduled ``lr``) into the host optimizer's param groups (nothing
        when this rank hosts no task)."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group.update(values)

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Full-shape optimizer state of the parameters hosted here, keyed by parameter name
        (tensors cloned; non-tensor entries such as integer step counters kept as they are)."""
        if self.optimizer is None:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for name in self.hosted:
            st = self.optimizer.state.get(self.masters[name], {})
            out[name] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        return out

    def load_state_dict(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s output (names must be exactly the hosted parameters)."""
        if set(states) != set(self.hosted):
            raise ValueError(
                f"state names differ from the parameters hosted on this rank: missing {sorted(set(self.hosted) - set(states))[:3]}, "
                f"unexpected {sorted(set(states) - set(self.hosted))[:3]}"
            )
        if self.optimizer is None:
            return
        for name, st in states.items():
            p = self.masters[name]
            self.optimizer.state[p] = {
                k: (v.detach().clone().to(p.device) if isinstance(v, torch.Tensor) else v) for k, v in st.items()
            }

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (tensors of the hosted parameters' state)."""
        if self.optimizer is None:
            return 0
        return sum(
            v.numel() * v.element_size()
            for st in self.optimizer.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
