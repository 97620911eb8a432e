"""The one exchange engine behind Canzona's micro-groups: pieces of a matrix go to one host, the
host updates the whole matrix, the values come back.

Both optimizer engines that update matrices whole are this engine with different layouts:

- :class:`canzona.runtime.tp.TPEngine` (Section 4): the equal ``torch.chunk`` shards of a TP
  group, tasks and micro-groups from a ZeRO-1 :class:`~canzona.plan.plan.Plan`;
- :class:`canzona.runtime.shard.FSDPEngine`: FSDP2's pieces over a shard group, which may be
  uneven (padding), empty, 2-D blocks (FSDP x TP) or duplicated (replicated over ``tp``).

A :class:`PieceLayout` records every rank's block of one parameter (offset and shape in the full
tensor) and one *source* rank per distinct block; an :class:`ExchangeTask` is a layout plus its
host (``-1``: every rank computes it, the ``sync``/``sc`` baselines). What each rank copies where
is worked out once per micro-group when the engine is built (:class:`ExchangeGroup`: split sizes
and a list of block copies per direction), so a step only copies and launches.

Per micro-group ``k`` (the schedule is :func:`pipeline`, executed as listed and recorded in
``last_events``):

1. gather   the sources pack their blocks into the gather slot (grouped by destination host) and
            one fused ``all_to_all_single`` delivers them; ``sync`` groups all-gather every block
            to every rank instead;
2. compute  each host writes the blocks into fresh full-shape gradients and runs the ordinary
            per-parameter optimizer on its full masters;
3. scatter  the host packs each rank's block of every updated value into the scatter slot and one
            fused ``all_to_all_single`` returns them (values, not deltas);
4. apply    every rank copies its blocks into the destination tensors it was given, casting to
            their dtype; ``sync`` groups apply their own blocks straight from the full result.

Each stage opens the phase its owner names (``phases=``, spelled in full by the owner so that a
grep for the name lands there): ``canzona/tp/{gather,compute,scatter,apply}/group<k>`` from
:mod:`canzona.runtime.tp`, ``canzona/shard/...`` from :mod:`canzona.runtime.shard`.

With ``direct`` (the FSDP2 engine) a host's own blocks of the tasks it hosts skip both
collectives: they are copied from its piece into the full tensor at unpack, and from the result
into its destination at apply.

Gather ``k+1`` is in flight while ``k`` computes, scatter ``k-1`` is waited for and applied after
compute ``k``, and scatter ``k`` lands during compute ``k+1``. At most one gather and one scatter
are in flight, so two exchange slots (:class:`ExchangeSlots`) reserved at construction, each
buffer as long as the largest group needs, serve every group of every step.

The split step (``exchange="ns-input"``, an optimizer with ``matrix_input`` / ``matrix_output`` /
``matrix_apply`` such as :class:`canzona.optim.Muon`): every rank computes the element-wise part
before the matrix operation on its own pieces, the gather carries only the matrix operation's
input (in its compute dtype) to the host, the host runs that operation on the whole matrix, the
scatter returns its result, led by one flag element per peer (did the host compute the group),
and every rank finishes the element-wise update on its own piece masters. The element-wise state
(Muon's momentum) then lives with the pieces; the values are bitwise those of the whole-matrix
step (see ``docs/runtime.md``, "The split step").

:meth:`MicroGroupEngine.run` walks the schedule and hands each event to its handler
(``_gather_launch``, ``_gather_wait``, ``_compute_event``, ``_scatter_launch``, ``_scatter_wait``,
``_apply``); what one step carries between events is a :class:`_Run`.

Errors: an exception in one host's compute does not stop the exchanges (the other ranks wait in
them): that host returns unchanged values for the group, runs the remaining exchanges and raises
the first error at the end; on any exception the collectives still in flight are waited for
before it leaves, so no later step shares a slot with a stale transfer.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from canzona.phase_names import ExchangePhases
from canzona.runtime.hooks import RemovableHandle, UpdateHook, UpdateHooks
from canzona.runtime.phases import phase

__all__ = [
    "APPLY",
    "COMPUTE",
    "GATHER_LAUNCH",
    "GATHER_WAIT",
    "SCATTER_LAUNCH",
    "SCATTER_WAIT",
    "Block",
    "ExchangeGroup",
    "ExchangeSlots",
    "EXCHANGES",
    "ExchangeTask",
    "MicroGroupEngine",
    "PieceLayout",
    "assemble_at_host",
    "describe_group",
    "from_hosts_recv_sizes",
    "pack_from_hosts",
    "pack_to_hosts",
    "pipeline",
    "split_dtype",
    "to_hosts_recv_sizes",
    "unpack_from_hosts",
]


# ============================================================================ layouts (pure)


@dataclass(frozen=True, slots=True)
class Block:
    """A rectangular block of a full tensor: ``offset`` and ``shape`` per dim (numel may be 0)."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def index(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape))


@dataclass(frozen=True, slots=True)
class PieceLayout:
    """Every exchange-group rank's block of one parameter; ``sources[r]`` is True for the first
    rank (in group order) holding each distinct non-empty block. Validates that the source blocks
    tile the full tensor exactly (no gap, no overlap): any other layout is not a sharding we serve."""

    name: str
    full_shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    sources: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not self.sources:
            seen: set[Block] = set()
            src = []
            for b in self.blocks:
                src.append(b.numel > 0 and b not in seen)
                seen.add(b)
            object.__setattr__(self, "sources", tuple(src))
        if len(self.sources) != len(self.blocks):
            raise ValueError(f"{self.name}: one source flag per block expected")
        nd = len(self.full_shape)
        for b in self.blocks:
            if len(b.offset) != nd or len(b.shape) != nd or any(
                o < 0 or s < 0 or o + s > f for o, s, f in zip(b.offset, b.shape, self.full_shape)
            ):
                raise ValueError(f"{self.name}: block {b} does not lie inside the full shape {self.full_shape}")
        cover = torch.zeros(self.full_shape, dtype=torch.int32) if math.prod(self.full_shape) <= 1 << 22 else None
        total = 0
        for b, s in zip(self.blocks, self.sources):
            if s:
                total += b.numel
                if cover is not None:
                    cover[b.index()] += 1
        if total != math.prod(self.full_shape) or (cover is not None and not bool((cover == 1).all())):
            raise ValueError(
                f"{self.name}: the ranks' pieces do not tile the full tensor {self.full_shape} exactly "
                "(an unsupported placement?)"
            )

    @property
    def size(self) -> int:
        return len(self.blocks)


@dataclass(frozen=True, slots=True)
class ExchangeTask:
    """One matrix parameter in an exchange: its layout and host (-1: every rank, ``sync``/``sc``)."""

    layout: PieceLayout
    host: int

    @property
    def name(self) -> str:
        return self.layout.name

    def hosted_by(self, rank: int) -> bool:
        return self.host == rank or self.host == -1


# ============================================================================ routes (pure)


@dataclass(frozen=True, slots=True)
class _Copy:
    """One block copy between a flat exchange buffer (``offset``, ``numel``) and a tensor of task
    ``name``: the whole tensor (a piece) or its ``index`` (a block of a full tensor)."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    index: tuple[slice, ...]


def _copy(name: str, offset: int, b: Block) -> _Copy:
    return _Copy(name, offset, b.numel, b.shape, b.index())


def _routes(
    tasks: Sequence[ExchangeTask], n: int, take: Callable[[ExchangeTask, int], bool], block: Callable[[ExchangeTask, int], Block],
    lead: int = 0,
) -> tuple[list[_Copy], list[int]]:
    """Block copies into one flat buffer, peer by peer (rank order) and task by task within a peer:
    ``take(task, peer)`` says whether the task has a block in that peer's part, ``block(task,
    peer)`` which; ``lead`` elements are kept free at the start of every peer's part (a flag).
    Returns (copies, split size per peer)."""
    copies: list[_Copy] = []
    sizes: list[int] = []
    off = 0
    for peer in range(n):
        k = lead
        off += lead
        for t in tasks:
            if take(t, peer):
                b = block(t, peer)
                copies.append(_copy(t.name, off, b))
                off += b.numel
                k += b.numel
        sizes.append(k)
    return copies, sizes


def _to_hosts_send(tasks: Sequence[ExchangeTask], rank: int, n: int, skip_self: bool = False) -> tuple[list[_Copy], list[int]]:
    """Gather send on ``rank``: per destination its source blocks of the tasks that destination hosts
    (``skip_self``: none to ``rank`` itself, whose split is then 0)."""
    return _routes(tasks, n, lambda t, dest: not (skip_self and dest == rank) and t.hosted_by(dest) and t.layout.sources[rank],
                   lambda t, _: t.layout.blocks[rank])


def _own_sources(tasks: Sequence[ExchangeTask], rank: int) -> list[_Copy]:
    """``rank``'s source blocks of ``tasks``, once each, in task order (a ``sync`` all-gather's send)."""
    return _routes(tasks, 1, lambda t, _: t.layout.sources[rank], lambda t, _: t.layout.blocks[rank])[0]


def _to_hosts_recv(tasks: Sequence[ExchangeTask], rank: int, n: int, skip_self: bool = False) -> tuple[list[_Copy], list[int]]:
    """Gather receive on ``rank``: from each source its blocks of the tasks hosted here; each copy
    lands at the block's place in the full tensor (``skip_self``: nothing from ``rank`` itself)."""
    return _routes(tasks, n, lambda t, src: not (skip_self and src == rank) and t.hosted_by(rank) and t.layout.sources[src],
                   lambda t, src: t.layout.blocks[src])


def _from_hosts_send(tasks: Sequence[ExchangeTask], rank: int, n: int, skip_self: bool = False, lead: int = 0) -> tuple[list[_Copy], list[int]]:
    """Scatter send on host ``rank``: per destination its block of each task hosted here; duplicated
    blocks go to every rank holding one (``skip_self``: none to ``rank`` itself)."""
    return _routes(tasks, n, lambda t, dest: not (skip_self and dest == rank) and t.host == rank, lambda t, dest: t.layout.blocks[dest], lead)


def _from_hosts_recv(tasks: Sequence[ExchangeTask], rank: int, n: int, skip_self: bool = False, lead: int = 0) -> tuple[list[_Copy], list[int]]:
    """Scatter receive on ``rank``: from each host this rank's block of its tasks (``skip_self``:
    nothing from ``rank`` itself)."""
    return _routes(tasks, n, lambda t, host: not (skip_self and host == rank) and t.host == host, lambda t, _: t.layout.blocks[rank], lead)


def _starts(sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each peer's part of a flat buffer split by ``sizes`` begins."""
    out, off = [], 0
    for s in sizes:
        out.append(off)
        off += s
    return tuple(out)


def _into(out: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str) -> Callable[[int], torch.Tensor]:
    """A maker of ``out[:numel]`` (a reserved exchange buffer), or of a fresh buffer when ``out`` is None."""

    def make(numel: int) -> torch.Tensor:
        if out is None:
            return torch.empty(numel, dtype=dtype, device=device)
        if out.numel() < numel or out.dtype != dtype or out.dim() != 1:
            raise ValueError(f"exchange buffer of {out.numel()} {out.dtype} elements cannot hold {numel} {dtype}")
        return out[:numel]

    return make


def _packed(route: tuple[list[_Copy], list[int]], pack: Callable[..., None], src: Mapping[str, torch.Tensor],
            make: Callable[[int], torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    copies, sizes = route
    buf = make(sum(sizes))
    pack(buf, copies, src)
    return buf, sizes


def _received(recv: torch.Tensor, route: tuple[list[_Copy], list[int]], what: str) -> list[_Copy]:
    copies, sizes = route
    if recv.numel() != sum(sizes):
        raise ValueError(f"{what} receive buffer has {recv.numel()} elements, expected {sum(sizes)}")
    return copies


def _slot_view(buf: torch.Tensor, c: _Copy) -> torch.Tensor:
    """The place of copy ``c`` in the flat exchange buffer ``buf``, shaped as its block (a view)."""
    return buf[c.offset : c.offset + c.numel].view(c.shape)


def _checked(names: Sequence[str], shapes: Sequence[torch.Size], pieces: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """``pieces[name]`` for every name, each checked to have its block's shape."""
    srcs = [pieces[n] for n in names]
    for n, x, shape in zip(names, srcs, shapes):
        if x.shape != shape:
            raise ValueError(f"{n}: local piece has shape {tuple(x.shape)}, layout says {tuple(shape)}")
    return srcs


def _pack_pieces(buf: torch.Tensor, copies: Sequence[_Copy], pieces: Mapping[str, torch.Tensor]) -> None:
    """Copy whole pieces (each of its block's shape) into ``buf`` (casting to its dtype)."""
    srcs = _checked([c.name for c in copies], [torch.Size(c.shape) for c in copies], pieces)
    for c, x in zip(copies, srcs):
        _slot_view(buf, c).copy_(x)


def _pack_blocks(buf: torch.Tensor, copies: Sequence[_Copy], full: Mapping[str, torch.Tensor]) -> None:
    """Copy blocks of full tensors into ``buf``."""
    for c in copies:
        if c.numel:
            _slot_view(buf, c).copy_(full[c.name][c.index])


def _assemble(
    recv: torch.Tensor, copies: Sequence[_Copy], shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Fresh full tensors (``shapes``) with every received block written into its place."""
    out = {name: torch.empty(shape, dtype=dtype, device=recv.device) for name, shape in shapes.items()}
    for c in copies:
        out[c.name][c.index] = recv[c.offset : c.offset + c.numel].view(c.shape)
    return out


def _views(recv: torch.Tensor, copies: Sequence[_Copy]) -> dict[str, torch.Tensor]:
    return {c.name: _slot_view(recv, c) for c in copies}


def pack_to_hosts(tasks: Sequence[ExchangeTask], pieces: Mapping[str, torch.Tensor], rank: int, n: int, *, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """Gather send buffer on ``rank``: for each destination (rank order) this rank's source blocks
    of the tasks that destination hosts, in task order. Returns (flat buffer, send split sizes);
    with ``out`` (1-D, ``dtype``, long enough) the blocks are copied into its front."""
    return _packed(_to_hosts_send(tasks, rank, n), _pack_pieces, pieces, _into(out, dtype, device))


def to_hosts_recv_sizes(tasks: Sequence[ExchangeTask], rank: int, n: int) -> list[int]:
    """Gather receive split sizes on ``rank``: from each source, its blocks of the tasks hosted here."""
    return _to_hosts_recv(tasks, rank, n)[1]


def assemble_at_host(
    recv: torch.Tensor, tasks: Sequence[ExchangeTask], rank: int, n: int, *, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Full tensors (fresh) of the tasks hosted on ``rank`` from the gather's receive buffer (blocks
    in source order, tasks in task order within a source), each block written into its place."""
    copies = _received(recv, _to_hosts_recv(tasks, rank, n), "gather")
    return _assemble(recv, copies, {t.name: t.layout.full_shape for t in tasks if t.hosted_by(rank)}, dtype)


def pack_from_hosts(tasks: Sequence[ExchangeTask], full: Mapping[str, torch.Tensor], rank: int, n: int, *, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """Scatter send buffer on host ``rank``: for each destination, its block of each task hosted
    here (task order). Values are copied (duplicate blocks are sent to every holder)."""
    return _packed(_from_hosts_send(tasks, rank, n), _pack_blocks, full, _into(out, dtype, device))


def from_hosts_recv_sizes(tasks: Sequence[ExchangeTask], rank: int, n: int) -> list[int]:
    """Scatter receive split sizes on ``rank``: from each host, this rank's blocks of its tasks."""
    return _from_hosts_recv(tasks, rank, n)[1]


def unpack_from_hosts(recv: torch.Tensor, tasks: Sequence[ExchangeTask], rank: int, n: int) -> dict[str, torch.Tensor]:
    """This rank's updated block of every hosted task (views into ``recv``)."""
    return _views(recv, _received(recv, _from_hosts_recv(tasks, rank, n), "scatter"))


# ============================================================================ the schedule (pure)

#: Events of one step, in the order :meth:`MicroGroupEngine.run` executes them (see :func:`pipeline`).
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

    Two exchange slots, each reserved once: the *gather slot* (piece-side send, full-side
    receive) and the *scatter slot* (full-side send, piece-side receive). At most one collective
    is in flight per slot, so at most two groups' exchanges are in flight at any time and the
    reserved exchange memory is two slots, each buffer bounded by C_max (Algorithm 2's bound on one
    group's bytes per host). Per group ``k``:

    1. wait for gather ``k`` (it was launched during the previous group);
    2. launch gather ``k+1`` into the gather slot, just freed: it is in flight while ``k`` computes;
    3. compute ``k`` (the host's optimizer step on full tensors);
    4. wait for scatter ``k-1`` and apply its values (it was in flight during compute ``k``), which
       frees the scatter slot;
    5. launch scatter ``k`` into it: it lands while group ``k+1`` computes.

    After the last group, the last scatter is waited for and applied. ``sync`` (every rank computes
    everything) has no scatter: each group applies its own blocks right after its compute.
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


# ============================================================================ the engine


@dataclass(frozen=True, slots=True)
class ExchangeSlots:
    """The engine's exchange buffers, reserved once and reused by every group of every step.

    ``gather_shard`` (gather send: this rank's pieces) and ``scatter_shard`` (scatter receive) hold
    pieces, ``gather_full`` (gather receive) and ``scatter_full`` (scatter send) a group's full
    tensors on their host; each is as long as the largest group needs. ``sync`` engines have no
    scatter slot (empty tensors)."""

    gather_shard: torch.Tensor
    gather_full: torch.Tensor
    scatter_full: torch.Tensor
    scatter_shard: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.gather_shard, self.gather_full, self.scatter_full, self.scatter_shard)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(frozen=True, slots=True)
class ExchangeGroup:
    """One micro-group as this rank executes it: its tasks, the names it computes, and per
    direction the split sizes (elements per peer) and block copies, worked out once."""

    index: int
    tasks: tuple[ExchangeTask, ...]
    hosted: tuple[str, ...]
    sync: bool
    gather_send: tuple[int, ...]
    gather_recv: tuple[int, ...]
    scatter_send: tuple[int, ...]
    scatter_recv: tuple[int, ...]
    pack: tuple[_Copy, ...]  # pieces -> gather send (sync: this rank's sources once)
    replicate: bool  # sync with uneven pieces: the send holds the sources once per peer (all-to-all)
    assemble: tuple[_Copy, ...]  # gather receive -> full tensors of the hosted tasks
    full_shapes: tuple[tuple[str, tuple[int, ...]], ...]
    pack_back: tuple[_Copy, ...]  # hosted full tensors -> scatter send
    unpack_back: tuple[_Copy, ...]  # scatter receive -> this rank's blocks
    own: tuple[_Copy, ...]  # sync: this rank's block of every task, from the full result
    #: ``direct``: this host's own source blocks (piece -> full tensor) and its own block of each task
    #: it hosts (full result -> destination), copied in place instead of through the exchanges
    local_in: tuple[_Copy, ...] = ()
    local_back: tuple[_Copy, ...] = ()
    #: ``flags`` (the split step): where each peer's part of the scatter send / receive begins; its
    #: first element says whether the host computed the group (1) or not (0: leave the tasks alone)
    flag_send: tuple[int, ...] = ()
    flag_recv: tuple[int, ...] = ()

    @property
    def phase_index(self) -> str:
        return f"group{self.index}"

    @property
    def send_numel(self) -> int:
        """Elements of this rank's gather send buffer."""
        return sum(self.gather_send)

    def numels(self) -> tuple[int, int, int, int]:
        """Elements of the four exchange buffers (gather send, gather receive, scatter send, scatter receive)."""
        return sum(self.gather_send), sum(self.gather_recv), sum(self.scatter_send), sum(self.scatter_recv)


def describe_group(k: int, tasks: Sequence[ExchangeTask], rank: int, n: int, *, direct: bool = False, flags: bool = False) -> ExchangeGroup:
    """What ``rank`` of ``n`` copies and exchanges for micro-group ``k`` of ``tasks`` (all hosted,
    or all ``-1``: every rank computes every task).

    ``direct`` (hosted groups only): a host's own blocks of the tasks it hosts skip the exchanges
    (their split is 0): its piece is copied straight into the full tensor (``local_in``) and the
    block of the result straight into the destination (``local_back``). One copy each way instead
    of three (pack, the collective's copy to itself, unpack); the values are the same, since every
    route copies them unchanged (a cast to the exchange dtype either way).

    ``flags`` (hosted groups only): every peer's part of the scatter starts with one flag element
    (``flag_send`` / ``flag_recv``), the host's word on whether it computed the group."""
    tasks = tuple(tasks)
    sync = bool(tasks) and all(t.host == -1 for t in tasks)
    if not sync and any(t.host == -1 for t in tasks):
        raise ValueError(f"micro-group {k} mixes tasks computed everywhere (host -1) with hosted tasks")
    direct = direct and not sync
    assemble, recv = _to_hosts_recv(tasks, rank, n, direct)
    hosted = tuple(t.name for t in tasks if t.hosted_by(rank))
    shapes = tuple((t.name, t.layout.full_shape) for t in tasks if t.hosted_by(rank))
    if sync:
        pack = _own_sources(tasks, rank)
        own_n = sum(c.numel for c in pack)
        replicate = len(set(recv)) > 1
        send = [own_n] * n if replicate else [own_n]
        own = tuple(_copy(t.name, 0, t.layout.blocks[rank]) for t in tasks if t.layout.blocks[rank].numel)
        return ExchangeGroup(k, tasks, hosted, True, tuple(send), tuple(recv), (), (), tuple(pack), replicate,
                             tuple(assemble), shapes, (), (), own)
    pack, send = _to_hosts_send(tasks, rank, n, direct)
    lead = int(flags)
    pack_back, back_send = _from_hosts_send(tasks, rank, n, direct, lead)
    unpack_back, back_recv = _from_hosts_recv(tasks, rank, n, direct, lead)
    mine = [t for t in tasks if direct and t.host == rank and t.layout.blocks[rank].numel]
    local_in = tuple(_copy(t.name, 0, t.layout.blocks[rank]) for t in mine if t.layout.sources[rank])
    local_back = tuple(_copy(t.name, 0, t.layout.blocks[rank]) for t in mine)
    return ExchangeGroup(k, tasks, hosted, False, tuple(send), tuple(recv), tuple(back_send), tuple(back_recv),
                         tuple(pack), False, tuple(assemble), shapes, tuple(pack_back), tuple(unpack_back), (),
                         local_in, local_back, _starts(back_send) if flags else (), _starts(back_recv) if flags else ())


#: byte alignment of every full tensor carved out of an assembly buffer: the CPU allocator's, so a
#: view starts on the same boundary as a fresh ``torch.empty`` would (BLAS kernels may choose
#: their path by alignment, and the split step's results must not depend on where a matrix lies)
ASSEMBLY_ALIGN_BYTES = 64


class _GroupViews:
    """One micro-group's block copies as views into the engine's reserved buffers, made once when
    the engine is built: a step then copies each direction with one ``torch._foreach_copy_``
    instead of a slice, a view and a copy per block (the per-piece Python work that dominates a
    step of many small matrices). The copied values are the same; only who slices changes.

    - ``pack``: the gather send slot's view of each ``g.pack`` copy (its name and shape beside it,
      checked against the piece before copying: ``_foreach_copy_`` would broadcast a wrong shape);
    - ``back_send`` / ``back_recv``: the scatter slot's views of ``g.pack_back`` / ``g.unpack_back``
      (non-empty copies only);
    - split step only (``full`` non-empty): the group's hosted full tensors as views into one of
      two assembly buffers (by group parity, so a group's inputs are never the next group's), and
      the views of every received (``assemble``) and own (``local_in``) block inside them."""

    __slots__ = ("pack", "pack_names", "pack_shapes", "back_send", "back_send_copies", "back_recv", "back_recv_copies",
                 "back_recv_hosts", "apply_names", "apply_unique", "full", "assemble_dst", "assemble_src", "local_dst", "local_names", "local_shapes")

    def __init__(self, g: ExchangeGroup, slots: ExchangeSlots, assembly: torch.Tensor | None) -> None:
        self.pack = [_slot_view(slots.gather_shard, c) for c in g.pack]
        self.pack_names = [c.name for c in g.pack]
        self.pack_shapes = [torch.Size(c.shape) for c in g.pack]
        self.back_send_copies = [c for c in g.pack_back if c.numel]
        self.back_send = [_slot_view(slots.scatter_full, c) for c in self.back_send_copies]
        self.back_recv_copies = [c for c in g.unpack_back if c.numel]
        self.back_recv = [_slot_view(slots.scatter_shard, c) for c in self.back_recv_copies]
        host = {t.name: t.host for t in g.tasks}
        #: the host of each received copy's task (whose ``computed`` flag the split step reads)
        self.back_recv_hosts = [host[c.name] for c in self.back_recv_copies]
        #: the task of each block the split step applies, in block order (received, then this host's own)
        self.apply_names = [c.name for c in self.back_recv_copies] + [c.name for c in g.local_back]
        self.apply_unique = len(set(self.apply_names)) == len(self.apply_names)
        self.full: dict[str, torch.Tensor] = {}
        self.assemble_dst: list[torch.Tensor] = []
        self.assemble_src: list[torch.Tensor] = []
        self.local_dst: list[torch.Tensor] = []
        self.local_names: list[str] = []
        self.local_shapes: list[torch.Size] = []
        if assembly is None:
            return
        off = 0
        for name, shape in g.full_shapes:
            self.full[name] = assembly[off : off + math.prod(shape)].view(shape)
            off += _aligned(math.prod(shape), assembly.element_size())
        for c in g.assemble:
            if c.numel:
                self.assemble_dst.append(self.full[c.name][c.index])
                self.assemble_src.append(_slot_view(slots.gather_full, c))
        for c in g.local_in:
            self.local_dst.append(self.full[c.name][c.index])
            self.local_names.append(c.name)
            self.local_shapes.append(torch.Size(c.shape))


def _aligned(numel: int, element_size: int) -> int:
    """``numel`` rounded up so that the next tensor starts on an :data:`ASSEMBLY_ALIGN_BYTES` boundary."""
    per = max(1, ASSEMBLY_ALIGN_BYTES // element_size)
    return -(-numel // per) * per


def _assembly_numel(g: ExchangeGroup, element_size: int) -> int:
    return sum(_aligned(math.prod(shape), element_size) for _, shape in g.full_shapes)


def _copy_all(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    if dst:
        torch._foreach_copy_(list(dst), list(src))


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` view the same elements of one storage (a copy between them changes
    nothing): the same dtype, start, shape and strides, a stride of a one-element dim aside (it
    never moves)."""
    if a.data_ptr() != b.data_ptr() or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return all(n == 1 or sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()))


class _Run:
    """What one :meth:`MicroGroupEngine.run` carries from event to event."""

    __slots__ = ("dest", "error", "events", "full", "grads", "inputs", "momenta", "overlap", "own_results", "skip",
                 "updated", "valid", "works")

    def __init__(self, grads: Mapping[str, torch.Tensor], dest: Mapping[str, torch.Tensor], skip: Collection[str],
                 overlap: Callable[[], None] | None) -> None:
        self.grads, self.dest, self.skip, self.overlap = grads, dest, skip, overlap
        self.events: list[tuple[str, int]] = []
        self.works: dict[tuple[str, int], Any] = {}
        self.full: dict[str, torch.Tensor] = {}  # the full tensors of the group about to compute
        self.updated: dict[str, torch.Tensor] = {}  # its results, until the scatter is packed
        self.own_results: dict[int, dict[str, torch.Tensor]] = {}  # direct: group -> results its own blocks come from
        self.error: Exception | None = None
        # the split step only: this rank's matrix-input pieces (until unpacked), the advanced
        # momenta (until applied) and whether this rank computed each group it hosts
        self.inputs: dict[str, torch.Tensor] = {}
        self.momenta: dict[str, torch.Tensor] = {}
        self.valid: dict[int, bool] = {}


#: what ``exchange=`` may ask for (:class:`canzona.settings.OptimizerSettings`)
EXCHANGES = ("auto", "ns-input", "gradients")


def split_dtype(optimizer: Any) -> torch.dtype | None:
    """The dtype an optimizer's split step exchanges (:meth:`canzona.optim.Muon.matrix_input_dtype`),
    or None when it has no split step, or none that is bitwise equal to its ``step()`` here."""
    probe = getattr(optimizer, "matrix_input_dtype", None)
    if not callable(probe) or not all(callable(getattr(optimizer, m, None)) for m in ("matrix_input", "matrix_output", "matrix_apply")):
        return None
    return probe()


class MicroGroupEngine:
    """The matrix step over one exchange group (see the module docstring).

    ``groups``: the plan's micro-groups as :class:`ExchangeTask` lists, in execution order; hosts
    are group ranks of ``comm`` (a :class:`canzona.runtime.comm.Comm`). ``initial`` maps every
    task's name to this rank's block of its current value (any float dtype): hosts assemble their
    full masters (``dtype``) from it with one exchange per group. ``optimizer_factory`` builds ONE
    per-parameter optimizer over the hosted full masters (not called when this rank hosts
    nothing). :meth:`run` is one step.

    ``exchange``: ``"gradients"`` is the step above. ``"ns-input"`` is the split step, for an
    optimizer that is element-wise before and after one whole-matrix operation (Muon): then
    ``initial`` holds this rank's piece masters (``dtype``; the engine updates them in place),
    ``optimizer_factory`` builds the optimizer over them (its element-wise state is sharded like
    them), only the matrix operation's input pieces travel to the host and its result back, in the
    dtype it computes in (:func:`split_dtype`), and a host keeps no full master. ``"auto"`` takes
    the split step where the optimizer offers a bitwise one and the other otherwise.
    """

    def __init__(
        self,
        groups: Sequence[Sequence[ExchangeTask]],
        *,
        comm: Any,
        optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        initial: Mapping[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        direct: bool = False,
        phases: ExchangePhases,
        exchange: str = "gradients",
    ) -> None:
        self.phases = phases  # the owner's names for the four phases (canzona.phase_names)
        self.comm = comm
        self.rank, self.n = comm.rank, comm.size
        self.master_dtype = dtype
        #: per-update hooks (:mod:`canzona.runtime.hooks`); a runtime driving this engine may share its own
        self.update_hooks = UpdateHooks()
        if device is None:
            device = next(iter(initial.values())).device if initial else torch.device("cpu")
        self._device = torch.device(device)
        self._check_tasks(groups)
        self.masters: dict[str, nn.Parameter] = {}
        #: the split step: this rank's piece master of every task (the caller's tensors)
        self.pieces: dict[str, torch.Tensor] = {}
        self._opt_params: dict[str, torch.Tensor] = {}  # what stands for each piece in the optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        self.split = self._try_split(groups, exchange, optimizer_factory, initial)
        #: dtype of the exchange buffers (the masters' or, split, the matrix operation's)
        self.dtype = split_dtype(self.optimizer) if self.split else dtype
        self._es = torch.empty(0, dtype=self.dtype).element_size()
        #: a host copies its own blocks in place instead of sending them to itself (see :func:`describe_group`)
        self.direct = bool(direct)
        self.groups: tuple[ExchangeGroup, ...] = tuple(
            describe_group(k, g, self.rank, self.n, direct=self.direct, flags=self.split) for k, g in enumerate(groups)
        )
        kinds = {g.sync for g in self.groups}
        if len(kinds) > 1:
            raise ValueError("either every micro-group is computed everywhere (sync) or every one is hosted")
        #: every rank computes every task (no scatter)
        self.sync: bool = kinds == {True}
        self.tasks: dict[str, ExchangeTask] = {t.name: t for g in self.groups for t in g.tasks}
        self._full_shapes: dict[str, tuple[int, ...]] = {n: t.layout.full_shape for n, t in self.tasks.items()}
        #: names whose matrix operation runs on this rank (and, unless split, whose full master and state live here)
        self.hosted: tuple[str, ...] = tuple(n for g in self.groups for n in g.hosted)
        self._reserve_slots()
        #: ``(event, group)`` as the last :meth:`run` executed them (equals ``schedule_events``)
        self.last_events: list[tuple[str, int]] = []
        self._handlers: dict[str, Callable[[_Run, ExchangeGroup], None]] = {
            GATHER_LAUNCH: self._gather_launch, GATHER_WAIT: self._gather_wait, COMPUTE: self._compute_event,
            SCATTER_LAUNCH: self._scatter_launch, SCATTER_WAIT: self._scatter_wait, APPLY: self._apply,
        }
        if not self.split:
            self.refresh_masters(initial)
            params = [self.masters[n] for n in self.hosted]
            self.optimizer = optimizer_factory(params) if params else None
            self._check_optimizer(params)

    def _check_tasks(self, groups: Sequence[Sequence[ExchangeTask]]) -> None:
        for g in groups:
            for t in g:
                if t.layout.size != self.n:
                    raise ValueError(f"{t.name}: layout has {t.layout.size} blocks, the exchange group {self.n} ranks")
                if not (t.host == -1 or 0 <= t.host < self.n):
                    raise ValueError(f"{t.name}: host {t.host} out of range for {self.n} ranks")

    def _check_optimizer(self, params: Sequence[torch.Tensor]) -> None:
        if self.optimizer is not None:
            got = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
            if got != {id(p) for p in params}:
                raise ValueError("optimizer_factory must build an optimizer over exactly the parameters it is given")

    def _try_split(self, groups: Sequence[Sequence[ExchangeTask]], exchange: str,
                   factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], initial: Mapping[str, torch.Tensor]) -> bool:
        """Build the optimizer over the piece masters and keep it when the split step is asked for
        (``ns-input``, or ``auto``) and the optimizer offers a bitwise one; refuse ``ns-input``
        otherwise. The answer is the same on every rank (it depends on the options and dtypes only)."""
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        names = [t.name for g in groups for t in g]
        if exchange == "gradients" or not names:
            return False
        pieces = {n: initial[n] for n in names}
        for n, t in pieces.items():
            if t.dtype != self.master_dtype:
                raise TypeError(f"{n}: the split step updates piece masters of {self.master_dtype}, got {t.dtype}")
        # an empty piece (FSDP2's trailing ranks) enters the optimizer as a 1 x 1 stand-in: every
        # rank then builds the same param groups (optimizers refuse empty tensors), and a host
        # holding no rows of a matrix still finds its group; a stand-in never gets state
        self._opt_params = {n: t if t.numel() else nn.Parameter(torch.zeros(1, 1, dtype=t.dtype, device=t.device))
                            for n, t in pieces.items()}
        opt = factory(list(self._opt_params.values()))
        if split_dtype(opt) is None:
            if exchange == "ns-input":
                raise ValueError(
                    f"exchange='ns-input' needs a matrix optimizer with a bitwise split step (canzona's Muon on "
                    f"float32/float64 masters, one Newton-Schulz dtype); {type(opt).__name__} has none here: use exchange='gradients'"
                )
            return False
        self.optimizer, self.pieces = opt, pieces
        self._check_optimizer(list(self._opt_params.values()))
        return True

    def _reserve_slots(self) -> None:
        sizes = [g.numels() for g in self.groups] or [(0, 0, 0, 0)]
        biggest = [max(s[i] for s in sizes) for i in range(4)]
        #: largest single exchange buffer (bytes) of one group on this rank
        self.peak_exchange_bytes: int = max(biggest) * self._es
        #: the schedule :meth:`run` executes (see :func:`pipeline`)
        self.schedule_events: tuple[tuple[str, int], ...] = tuple(pipeline(len(self.groups), sync=self.sync))
        #: exchange buffers reserved once (two slots; ``reserved_exchange_bytes`` in total)
        self.slots = ExchangeSlots(*(torch.empty(n, dtype=self.dtype, device=self._device) for n in biggest))
        # the split step assembles each group's whole inputs in one of two reserved buffers (the
        # inputs are scratch its matrix operation may overwrite; the other path hands the full
        # gradients to an arbitrary optimizer as p.grad, so it keeps fresh tensors)
        assembly: list[torch.Tensor | None] = [None, None]
        if self.split and self.groups:
            numel = max(_assembly_numel(g, self._es) for g in self.groups)
            for k in range(min(2, len(self.groups))):  # one group needs one buffer; more alternate
                assembly[k] = torch.empty(numel, dtype=self.dtype, device=self._device)
        self._views = tuple(_GroupViews(g, self.slots, assembly[g.index % 2]) for g in self.groups)
        self.reserved_exchange_bytes: int = self.slots.nbytes + sum(a.numel() * self._es for a in assembly if a is not None)

    # ------------------------------------------------------------------------- masters
    @torch.no_grad()
    def refresh_masters(self, values: Mapping[str, torch.Tensor]) -> None:
        """(Re)assemble the hosted full masters from every rank's blocks ``values`` (one exchange
        per group, through the gather slot). Optimizer state is kept. Split step: copy ``values``
        into the piece masters (no exchange)."""
        if self.split:
            for name, piece in self.pieces.items():
                if not same_elements(values[name], piece):  # an aliased piece master is the value
                    piece.copy_(values[name])
            return
        for g in self.groups:
            self._wait(self._launch_gather(g, values))
            for name, t in self._unpack_gather(g, values).items():
                if name in self.masters:
                    self.masters[name].copy_(t)
                else:
                    self.masters[name] = nn.Parameter(t)

    # ------------------------------------------------------------------------- the step
    def run(
        self,
        grads: Mapping[str, torch.Tensor],
        dest: Mapping[str, torch.Tensor],
        *,
        skip: Collection[str] = (),
        overlap: Callable[[], None] | None = None,
    ) -> None:
        """One optimizer step: gather -> compute -> scatter -> apply per micro-group, pipelined as
        :func:`pipeline` says. ``grads[name]`` is this rank's gradient block of every task,
        ``dest[name]`` the tensor that receives this rank's block of the new value. ``skip``: tasks
        without a gradient on any rank; hosts do not step them (their values return unchanged);
        it is read at each compute, so a caller may add to a set it passed. ``overlap``: the
        caller's own work (e.g. the element-wise update), run once right after the first gather is
        launched so that it overlaps the first transfer. If it raises, the step stops there on
        this rank (in-flight exchanges landed first, unless the exception's ``abandon_exchanges``
        is true): only for an outcome every rank reaches alike, such as a refusal by a status
        exchange; a rank-local error must be kept and reported later instead (the other ranks are
        waiting in the exchanges)."""
        r = _Run(grads, dest, skip, overlap)
        self.last_events = r.events
        try:
            for ev, k in self.schedule_events:
                r.events.append((ev, k))
                self._handlers[ev](r, self.groups[k])
            if r.overlap is not None:  # no micro-group at all
                r.overlap()
        except BaseException as exc:
            self._land(r.works, exc)
            raise
        if r.error is not None:
            raise r.error

    def _land(self, works: Mapping[tuple[str, int], Any], exc: BaseException) -> None:
        """Exchanges still in flight write into the reserved slots: let them land before an error
        leaves, so a later step never shares a buffer with a stale collective. Every peer launched
        them before its own compute, so these waits cannot hang on a live group. An error that
        marks the group unusable (``abandon_exchanges``: a status timeout, some rank never came)
        leaves at once; the group must be destroyed anyway."""
        if not getattr(exc, "abandon_exchanges", False):
            for w in works.values():
                with contextlib.suppress(Exception):
                    self._wait(w)

    def _gather_launch(self, r: _Run, g: ExchangeGroup) -> None:
        pieces = self._split_inputs(r, g) if self.split else r.grads
        with phase(f"{self.phases.gather}/{g.phase_index}/launch", bytes=g.send_numel * self._es, group=g.index, peers=self.n):
            r.works[GATHER_WAIT, g.index] = self._launch_gather(g, pieces)
        if r.overlap is not None:
            overlap, r.overlap = r.overlap, None
            overlap()

    def _gather_wait(self, r: _Run, g: ExchangeGroup) -> None:
        with phase(f"{self.phases.gather}/{g.phase_index}/wait", bytes=sum(g.gather_recv) * self._es, group=g.index, peers=self.n):
            self._wait(r.works.pop((GATHER_WAIT, g.index)))
        # unpacking copies out of the gather slot, which the next launch reuses at once
        with phase(f"{self.phases.compute}/{g.phase_index}"):
            r.full = self._unpack_gather(g, r.inputs if self.split else r.grads)
            if self.split:
                for t in g.tasks:
                    r.inputs.pop(t.name, None)

    def _compute_event(self, r: _Run, g: ExchangeGroup) -> None:
        with phase(f"{self.phases.compute}/{g.phase_index}"):
            try:
                if r.error is not None:
                    raise r.error
                r.updated = self._split_compute(g, r.full, r.skip) if self.split else self._compute(g, r.full, r.skip)
                r.valid[g.index] = True
            except Exception as exc:  # noqa: BLE001 - finish the exchanges, raise afterwards
                r.error = r.error or exc
                r.valid[g.index] = False
                # unchanged values (split: anything of the right shape, flagged as not computed)
                r.updated = dict(r.full) if self.split else {name: self.masters[name].detach() for name in g.hosted}
        r.full = {}

    def _scatter_launch(self, r: _Run, g: ExchangeGroup) -> None:
        with phase(f"{self.phases.scatter}/{g.phase_index}/launch", bytes=sum(g.scatter_send) * self._es, group=g.index, peers=self.n):
            r.works[SCATTER_WAIT, g.index] = self._launch_scatter(g, r.updated, r.valid.get(g.index, False))
        if g.local_back:
            # the hosted results (or the error path's unchanged values); a later group's compute
            # steps only its own parameters, so they hold until APPLY
            r.own_results[g.index] = r.updated
        r.updated = {}

    def _scatter_wait(self, r: _Run, g: ExchangeGroup) -> None:
        with phase(f"{self.phases.scatter}/{g.phase_index}/wait", bytes=sum(g.scatter_recv) * self._es, group=g.index, peers=self.n):
            self._wait(r.works.pop((SCATTER_WAIT, g.index)))

    @torch.no_grad()
    def _apply(self, r: _Run, g: ExchangeGroup) -> None:
        with phase(f"{self.phases.apply}/{g.phase_index}"):
            if self.split:
                self._split_apply(r, g)
                return
            dest = r.dest
            if g.sync:
                for c in g.own:
                    dest[c.name].copy_(r.updated[c.name][c.index])
                r.updated = {}
                return
            v = self._views[g.index]
            _copy_all([dest[c.name] for c in v.back_recv_copies], v.back_recv)
            mine = r.own_results.pop(g.index, {})
            _copy_all([dest[c.name] for c in g.local_back], [mine[c.name][c.index] for c in g.local_back])

    # ------------------------------------------------------------------------- the split step
    def _split_inputs(self, r: _Run, g: ExchangeGroup) -> dict[str, torch.Tensor]:
        """This rank's matrix-input piece of every task of ``g`` (the momentum advanced out of place
        and kept for :meth:`_split_apply`; nothing changes before it). A rank-local error is kept
        (the step then computes nothing here and reports it at the end)."""
        opt = self.optimizer
        assert opt is not None
        with phase(f"{self.phases.compute}/{g.phase_index}"):
            live = []
            for t in g.tasks:
                r.inputs[t.name] = r.grads[t.name]  # empty pieces (and the error path) send the gradient as it is
                if r.grads[t.name].numel() and r.error is None:
                    live.append(t.name)
            if live:
                try:
                    moms, inputs = opt.matrix_input([self.pieces[n] for n in live], [r.grads[n] for n in live])  # type: ignore[attr-defined]
                except Exception as exc:  # noqa: BLE001 - the other ranks wait in the exchanges
                    r.error = exc
                else:
                    r.momenta.update(zip(live, moms))
                    r.inputs.update(zip(live, inputs))
        return r.inputs

    def _split_compute(self, g: ExchangeGroup, full: Mapping[str, torch.Tensor], skip: Collection[str]) -> dict[str, torch.Tensor]:
        """Host side of the split step: the matrix operation on the whole inputs of the group's
        live tasks hosted here (skipped ones return their input, which nobody applies)."""
        live = [n for n in g.hosted if n not in skip]
        out = dict(full)
        if live:
            results = self.optimizer.matrix_output([self._opt_params[n] for n in live], [full[n] for n in live])  # type: ignore[union-attr]
            out.update(zip(live, results))
        return out

    def _split_apply(self, r: _Run, g: ExchangeGroup) -> None:
        """The element-wise update of this rank's pieces from their blocks of the results, where the
        host computed them (flag) and the task is not skipped; then into ``dest``."""
        if g.sync:
            ok = r.valid.get(g.index, False)
            blocks = [(c.name, r.updated[c.name][c.index], ok) for c in g.own]
            r.updated = {}
        else:
            recv = self.slots.scatter_shard
            computed = [bool(f) for f in recv[list(g.flag_recv)].tolist()] if g.flag_recv else []
            v = self._views[g.index]
            mine = r.own_results.pop(g.index, {})
            ok = r.valid.get(g.index, False)
            outs = v.back_recv + [mine[c.name][c.index] for c in g.local_back]
            momenta = r.momenta
            if v.apply_unique and ok and all(computed) and not r.skip and all(n in momenta for n in v.apply_names):
                # every block computed, none skipped: the lists made once with the views
                names = v.apply_names
                moms = [momenta.pop(n) for n in names]
                if self._reshapes_blocks:
                    outs = [self._split_block(n, b) for n, b in zip(names, outs)]
                self._apply_blocks(r, g, names, moms, outs)
                return
            flags = [computed[h] for h in v.back_recv_hosts] + [ok] * len(g.local_back)
            blocks = list(zip(v.apply_names, outs, flags))
        names, moms, outs = [], [], []
        for name, block, computed_ok in blocks:
            momentum = r.momenta.pop(name, None)
            if computed_ok and momentum is not None and name not in r.skip:
                names.append(name)
                moms.append(momentum)
                outs.append(self._split_block(name, block))
        self._apply_blocks(r, g, names, moms, outs)

    def _apply_blocks(self, r: _Run, g: ExchangeGroup, names: Sequence[str], moms: Sequence[torch.Tensor],
                      outs: Sequence[torch.Tensor]) -> None:
        """:meth:`_split_apply`'s update of the pieces of tasks ``names`` from their result blocks,
        then into ``dest``; the group's momenta left over (blocks not applied) are dropped."""
        if r.momenta:  # tasks this rank has no block of, skipped ones, blocks not computed
            for t in g.tasks:
                r.momenta.pop(t.name, None)
        if not names:
            return
        pieces = [self.pieces[n] for n in names]
        shapes = self._full_shapes
        self.optimizer.matrix_apply(pieces, moms, outs, [shapes[n] for n in names])  # type: ignore[union-attr]
        dest = r.dest
        # a piece master that is the model's own storage (FSDPRuntime aliases them where it can)
        # is updated in place already; one whose destination moved (FSDP2 re-allocated the
        # shard, a dtype change) or differs in dtype is copied, as a separate master always is
        copy = [(dest[n], piece) for n, piece in zip(names, pieces) if not same_elements(dest[n], piece)]
        if copy:
            torch._foreach_copy_([d for d, _ in copy], [piece for _, piece in copy])

    @property
    def _reshapes_blocks(self) -> bool:
        """Whether this engine lays some received blocks out otherwise (:meth:`_split_block` overridden)."""
        return type(self)._split_block is not MicroGroupEngine._split_block

    def _split_block(self, name: str, block: torch.Tensor) -> torch.Tensor:
        """A received block of the split step as the piece it updates (the same shape here; an
        engine whose exchange lays some pieces out otherwise views them back)."""
        return block

    @staticmethod
    def _wait(work: Any) -> None:
        # NCCL: makes the current stream wait for the collective's stream (host does not block);
        # gloo: blocks this thread until the worker thread has finished the transfer.
        if work is not None:
            work.wait()

    @torch.no_grad()
    def _launch_gather(self, g: ExchangeGroup, pieces: Mapping[str, torch.Tensor]) -> Any:
        """Pack this rank's blocks of the group into the gather slot and start its collective
        (async): the all-to-all to hosts, or the all-gather of a ``sync`` group."""
        slots = self.slots
        send = slots.gather_shard[: sum(g.gather_send)]
        out = slots.gather_full[: sum(g.gather_recv)]
        v = self._views[g.index]
        _copy_all(v.pack, _checked(v.pack_names, v.pack_shapes, pieces))
        if g.sync and not g.replicate:
            _, work = self.comm.all_gather_v(send, list(g.gather_recv), out=out, async_op=True)
            return work
        if g.replicate:  # uneven sync pieces: this rank's sources once per peer, one all-to-all
            m = g.gather_send[0]
            for i in range(1, self.n):
                send[i * m : (i + 1) * m].copy_(send[:m])
        _, work = self.comm.all_to_all_v(send, list(g.gather_send), list(g.gather_recv), out=out, async_op=True)
        return work

    def _unpack_gather(self, g: ExchangeGroup, pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full tensors (fresh copies) of the group's tasks computed on this rank, from the gather
        slot and (``direct``) this rank's own ``pieces``; the split step's are views into its
        reserved assembly buffer, filled with two ``_foreach_copy_`` calls."""
        v = self._views[g.index]
        if v.full:
            _copy_all(v.assemble_dst, v.assemble_src)
            _copy_all(v.local_dst, _checked(v.local_names, v.local_shapes, pieces))
            return dict(v.full)
        full = _assemble(self.slots.gather_full, g.assemble, dict(g.full_shapes), self.dtype)
        for c, x in zip(g.local_in, _checked([c.name for c in g.local_in], [torch.Size(c.shape) for c in g.local_in], pieces)):
            full[c.name][c.index] = x
        return full

    def _compute(self, g: ExchangeGroup, full_grads: Mapping[str, torch.Tensor], skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
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

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """Call ``hook(name, param, optimizer)`` after each local step for every parameter this
        rank updated whole, before the value is sent (:mod:`canzona.runtime.hooks`); returns a
        handle whose ``remove()`` detaches it. The split step updates no matrix whole: refused."""
        if self.split:
            raise ValueError("update hooks see each matrix updated whole, which exchange='ns-input' never does: use exchange='gradients'")
        return self.update_hooks.register(hook)

    @torch.no_grad()
    def _launch_scatter(self, g: ExchangeGroup, updated: Mapping[str, torch.Tensor], computed: bool = True) -> Any:
        """Pack this host's updated values into the scatter slot and start the fused all-to-all back
        to every rank (async). Values, never deltas; the slot holds copies, so the masters may
        change before it lands. Split step: the results of the matrix operation, each peer's part
        led by the flag ``computed``."""
        slots = self.slots
        send = slots.scatter_full[: sum(g.scatter_send)]
        v = self._views[g.index]
        _copy_all(v.back_send, [updated[c.name][c.index] for c in v.back_send_copies])
        for at in g.flag_send:
            send[at] = 1.0 if computed else 0.0
        out = slots.scatter_shard[: sum(g.scatter_recv)]
        _, work = self.comm.all_to_all_v(send, list(g.scatter_send), list(g.scatter_recv), out=out, async_op=True)
        return work

    # ------------------------------------------------------------------------- hyperparameters, state
    def set_hyperparams(self, values: Mapping[str, Any]) -> None:
        """Write ``values`` (e.g. a scheduled ``lr``) into the host optimizer's param groups (nothing
        when this rank hosts no task)."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group.update(values)

    @property
    def state_names(self) -> tuple[str, ...]:
        """The parameters whose optimizer state this rank holds: the hosted ones (full shape) or,
        split, every task's non-empty piece (shaped like the piece)."""
        return tuple(n for n, t in self.pieces.items() if t.numel()) if self.split else self.hosted

    def _state_param(self, name: str) -> torch.Tensor:
        return self.pieces[name] if self.split else self.masters[name]

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Optimizer state of :attr:`state_names` (full-shape, or piece-shaped under the split step), keyed by parameter name
        (tensors cloned; non-tensor entries such as integer step counters kept as they are)."""
        if self.optimizer is None:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for name in self.state_names:
            st = self.optimizer.state.get(self._state_param(name), {})
            out[name] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        return out

    def load_state_dict(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s output (names must be exactly the hosted parameters)."""
        mine = set(self.state_names)
        if set(states) != mine:
            raise ValueError(
                f"state names differ from the parameters hosted on this rank: missing {sorted(mine - set(states))[:3]}, "
                f"unexpected {sorted(set(states) - mine)[:3]}"
            )
        if self.optimizer is None:
            return
        for name, st in states.items():
            p = self._state_param(name)
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
