"""The FSDP2 exchange engine: Canzona's micro-group step over pieces of any rectangular layout.

Under ``fully_shard`` a parameter is a DTensor whose local tensor on each rank of its shard group
(``dp_shard x tp`` of one replica) is a rectangular block of the full tensor: FSDP2 cuts dim 0
with ``torch.chunk`` semantics (so trailing ranks may hold fewer rows, or none), TP cuts its
split dim first, and a parameter replicated over ``tp`` has the same block on several ranks.
:class:`PieceLayout` records every rank's block (offset and shape, read from the DTensor
placements and exchanged once), and marks one *source* rank per distinct block.

The step is the paper's TP engine (Section 4.1, Algorithm 2's micro-groups) with the pieces of
a matrix spread over that group (DESIGN: "one exchange engine"). Per micro-group of the plan:

1. gather   one fused ``all_to_all_single``: every source sends its block of every task in the
            group to the task's host (``canzona/tp/gather/group<k>``, launch and wait stages);
2. compute  the host writes the blocks into a full-shape gradient and runs the ordinary
            per-parameter optimizer on its full master (state lives only there);
3. scatter  one fused ``all_to_all_single`` returns to every rank its block of each updated
            value (values, not deltas);
4. apply    every rank copies its blocks into the destinations it was given (the model's local
            tensors), casting to their dtype.

Group ``k+1``'s gather is launched before group ``k`` computes and group ``k-1``'s scatter is
still in flight while it does (applied right after), so a host's compute overlaps an exchange in
each direction (the pattern of the authors' FSDP executor; :class:`canzona.runtime.tp.TPEngine`
waits for each scatter). Under ``sc`` every rank is
the host of every task (host ``-1``): the gather all-gathers the full gradient everywhere, every
rank computes every update with its own full state, keeps its block, and nothing is scattered.

Why not :class:`canzona.runtime.tp.TPEngine` itself: its packing assumes equal ``torch.chunk``
shards along one dim of one group of ``tp`` ranks (``spec.local_shape`` identical on every rank)
and takes its groups from a ZeRO-1 :class:`~canzona.plan.plan.Plan`. FSDP2's pieces are uneven
(padding), may be empty, may be 2-D blocks (FSDP x TP) and may be duplicated (replicated over
``tp``); the pure packing here generalizes the TP engine's with per-rank block offsets, and the
engine keeps the same phases, overlap and state interface.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from canzona.phase_names import LAUNCH, TP_APPLY, TP_COMPUTE, TP_GATHER, TP_SCATTER, WAIT
from canzona.runtime.hooks import RemovableHandle, UpdateHook, UpdateHooks
from canzona.runtime.comm import Comm
from canzona.runtime.phases import phase

__all__ = [
    "Block",
    "PieceLayout",
    "ExchangeTask",
    "FSDPEngine",
    "pack_to_hosts",
    "to_hosts_recv_sizes",
    "assemble_at_host",
    "pack_from_hosts",
    "from_hosts_recv_sizes",
    "unpack_from_hosts",
    "FSDPRuntime",
    "local_block",
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
    """Every shard-group rank's block of one parameter; ``sources[r]`` is True for the first rank
    (in group order) holding each distinct non-empty block. Validates that the source blocks tile
    the full tensor exactly (no gap, no overlap): any other layout is not a sharding we serve."""

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
    """One matrix parameter in an exchange: its layout and host (-1: every rank, ``sc``)."""

    layout: PieceLayout
    host: int

    @property
    def name(self) -> str:
        return self.layout.name

    def hosted_by(self, rank: int) -> bool:
        return self.host == rank or self.host == -1


def _flat(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([p.reshape(-1).to(dtype) for p in parts])


def pack_to_hosts(
    tasks: Sequence[ExchangeTask],
    pieces: Mapping[str, torch.Tensor],
    rank: int,
    n: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, list[int]]:
    """Gather send buffer on ``rank``: for each destination (rank order) this rank's source blocks
    of the tasks that destination hosts, in task order. Returns (flat buffer, send split sizes)."""
    parts: list[torch.Tensor] = []
    sizes: list[int] = []
    for dest in range(n):
        k = 0
        for t in tasks:
            if t.hosted_by(dest) and t.layout.sources[rank]:
                b = t.layout.blocks[rank]
                x = pieces[t.name]
                if tuple(x.shape) != b.shape:
                    raise ValueError(f"{t.name}: local piece has shape {tuple(x.shape)}, layout says {b.shape}")
                parts.append(x)
                k += b.numel
        sizes.append(k)
    return _flat(parts, dtype, device), sizes


def to_hosts_recv_sizes(tasks: Sequence[ExchangeTask], rank: int, n: int) -> list[int]:
    """Gather receive split sizes on ``rank``: from each source, its blocks of the tasks hosted here."""
    return [sum(t.layout.blocks[s].numel for t in tasks if t.hosted_by(rank) and t.layout.sources[s]) for s in range(n)]


def assemble_at_host(
    recv: torch.Tensor, tasks: Sequence[ExchangeTask], rank: int, n: int, *, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Full tensors of the tasks hosted on ``rank`` from the gather's receive buffer (blocks in
    source order, tasks in task order within a source), written into place by offset."""
    mine = [t for t in tasks if t.hosted_by(rank)]
    out = {t.name: torch.empty(t.layout.full_shape, dtype=dtype, device=recv.device) for t in mine}
    off = 0
    for s in range(n):
        for t in mine:
            if t.layout.sources[s]:
                b = t.layout.blocks[s]
                out[t.name][b.index()] = recv[off : off + b.numel].view(b.shape)
                off += b.numel
    if off != recv.numel():
        raise ValueError(f"gather receive buffer has {recv.numel()} elements, expected {off}")
    return out


def pack_from_hosts(
    tasks: Sequence[ExchangeTask],
    full: Mapping[str, torch.Tensor],
    rank: int,
    n: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, list[int]]:
    """Scatter send buffer on host ``rank``: for each destination, its block of each task hosted
    here (task order). Values are copied (duplicate blocks are sent to every holder)."""
    mine = [t for t in tasks if t.host == rank]
    parts: list[torch.Tensor] = []
    sizes: list[int] = []
    for dest in range(n):
        k = 0
        for t in mine:
            b = t.layout.blocks[dest]
            parts.append(full[t.name][b.index()])
            k += b.numel
        sizes.append(k)
    return _flat(parts, dtype, device), sizes


def from_hosts_recv_sizes(tasks: Sequence[ExchangeTask], rank: int, n: int) -> list[int]:
    """Scatter receive split sizes on ``rank``: from each host, this rank's blocks of its tasks."""
    return [sum(t.layout.blocks[rank].numel for t in tasks if t.host == s) for s in range(n)]


def unpack_from_hosts(recv: torch.Tensor, tasks: Sequence[ExchangeTask], rank: int, n: int) -> dict[str, torch.Tensor]:
    """This rank's updated block of every task (views into ``recv``)."""
    out: dict[str, torch.Tensor] = {}
    off = 0
    for s in range(n):
        for t in tasks:
            if t.host == s:
                b = t.layout.blocks[rank]
                out[t.name] = recv[off : off + b.numel].view(b.shape)
                off += b.numel
    if off != recv.numel():
        raise ValueError(f"scatter receive buffer has {recv.numel()} elements, expected {off}")
    return out


# ============================================================================ the engine


@dataclass(frozen=True, slots=True)
class _Group:
    index: int
    tasks: tuple[ExchangeTask, ...]
    hosted: tuple[str, ...]  # names this rank computes in this group


class FSDPEngine:
    """The matrix step over one shard group (see the module docstring).

    ``groups`` are the plan's micro-groups as :class:`ExchangeTask` lists (hosts are group ranks of
    ``comm``). ``initial`` maps every task's name to this rank's block of its current value (any
    float dtype): hosts assemble their full fp32 (``master_dtype``) masters from it with one
    exchange per group. ``optimizer_factory`` builds ONE per-parameter optimizer over the hosted
    full masters (not called when this rank hosts nothing).
    """

    def __init__(
        self,
        groups: Sequence[Sequence[ExchangeTask]],
        *,
        comm: Comm,
        optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        initial: Mapping[str, torch.Tensor],
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.comm = comm
        self.rank, self.n = comm.rank, comm.size
        self.dtype = master_dtype
        #: per-update hooks on the hosts' full updates (shared with the FSDPRuntime that drives it)
        self.update_hooks = UpdateHooks()
        for g in groups:
            for t in g:
                if t.layout.size != self.n:
                    raise ValueError(f"{t.name}: layout has {t.layout.size} blocks, the shard group {self.n} ranks")
                if not (t.host == -1 or 0 <= t.host < self.n):
                    raise ValueError(f"{t.name}: host {t.host} out of range for {self.n} ranks")
        self.groups: tuple[_Group, ...] = tuple(
            _Group(k, tuple(g), tuple(t.name for t in g if t.hosted_by(self.rank))) for k, g in enumerate(groups)
        )
        self.tasks: dict[str, ExchangeTask] = {t.name: t for g in self.groups for t in g.tasks}
        #: names whose full master and optimizer state live on this rank
        self.hosted: tuple[str, ...] = tuple(n for g in self.groups for n in g.hosted)
        self._device = next(iter(initial.values())).device if initial else torch.device("cpu")
        #: largest single exchange buffer (elements) of one group on this rank so far
        self.peak_exchange_numel = 0
        self.masters: dict[str, nn.Parameter] = {}
        self.refresh_masters(initial)
        params = [self.masters[n] for n in self.hosted]
        self.optimizer: torch.optim.Optimizer | None = optimizer_factory(params) if params else None
        if self.optimizer is not None:
            got = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
            if got != {id(p) for p in params}:
                raise ValueError("optimizer_factory must build an optimizer over exactly the parameters it is given")

    # ------------------------------------------------------------------------- masters
    @torch.no_grad()
    def refresh_masters(self, values: Mapping[str, torch.Tensor]) -> None:
        """(Re)assemble the hosted full masters from every rank's blocks ``values`` (one exchange
        per group). Optimizer state is kept."""
        for g in self.groups:
            full = self._wait(self._launch(g, values))
            for name, t in full.items():
                if name in self.masters:
                    self.masters[name].copy_(t)
                else:
                    self.masters[name] = nn.Parameter(t)

    # ------------------------------------------------------------------------- the step
    def step(self, grads: Mapping[str, torch.Tensor], dest: Mapping[str, torch.Tensor]) -> None:
        """One matrix step: gather -> compute -> scatter -> apply per micro-group. While group k
        computes, group k+1's gather and group k-1's scatter are in flight (the one-group lookahead
        both ways); group k-1 is applied once group k has computed. ``grads[name]`` is this rank's
        gradient block, ``dest[name]`` the tensor that receives this rank's block of the new value."""
        n = len(self.groups)
        if n == 0:
            return
        with phase(f"{TP_GATHER}/group0/{LAUNCH}"):
            pending = self._launch(self.groups[0], grads)
        returning: tuple[_Group, torch.Tensor, Any] | None = None  # the previous group's scatter
        for k, g in enumerate(self.groups):
            with phase(f"{TP_GATHER}/group{k}/{WAIT}"):
                full_grads = self._wait(pending)
            if k + 1 < n:
                with phase(f"{TP_GATHER}/group{k + 1}/{LAUNCH}"):
                    pending = self._launch(self.groups[k + 1], grads)
            with phase(f"{TP_COMPUTE}/group{k}"):
                updated = self._compute(g, full_grads)
            if returning is not None:
                self._finish_scatter(returning, dest)
                returning = None
            if any(t.host == -1 for t in g.tasks):  # sc: every rank computed everything, keeps its block
                with phase(f"{TP_APPLY}/group{k}"), torch.no_grad():
                    for t in g.tasks:
                        dest[t.name].copy_(updated[t.name][t.layout.blocks[self.rank].index()])
            else:
                with phase(f"{TP_SCATTER}/group{k}/{LAUNCH}"):
                    returning = self._launch_scatter(g, updated)
        if returning is not None:
            self._finish_scatter(returning, dest)

    def _finish_scatter(self, pending: tuple[_Group, torch.Tensor, Any], dest: Mapping[str, torch.Tensor]) -> None:
        g, out, work = pending
        with phase(f"{TP_SCATTER}/group{g.index}/{WAIT}"):
            if work is not None:
                work.wait()
        with phase(f"{TP_APPLY}/group{g.index}"), torch.no_grad():
            for name, b in unpack_from_hosts(out, g.tasks, self.rank, self.n).items():
                dest[name].copy_(b)

    def _launch(self, g: _Group, pieces: Mapping[str, torch.Tensor]) -> tuple[_Group, torch.Tensor, Any]:
        send, send_sizes = pack_to_hosts(g.tasks, pieces, self.rank, self.n, dtype=self.dtype, device=self._device)
        recv_sizes = to_hosts_recv_sizes(g.tasks, self.rank, self.n)
        self.peak_exchange_numel = max(self.peak_exchange_numel, send.numel(), sum(recv_sizes))
        out, work = self.comm.all_to_all_v(send, send_sizes, recv_sizes, async_op=True)
        return g, out, work

    def _wait(self, pending: tuple[_Group, torch.Tensor, Any]) -> dict[str, torch.Tensor]:
        g, out, work = pending
        if work is not None:
            work.wait()
        return assemble_at_host(out, g.tasks, self.rank, self.n, dtype=self.dtype)

    def _compute(self, g: _Group, full_grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the host optimizer on this group's full masters only: the other hosted masters have
        no ``.grad`` now and per-parameter optimizers skip them; grads are cleared afterwards."""
        if not g.hosted:
            return {}
        params = [self.masters[n] for n in g.hosted]
        for name, p in zip(g.hosted, params):
            p.grad = full_grads[name]
        assert self.optimizer is not None
        if self.update_hooks:
            self.update_hooks.step(self.optimizer, list(zip(g.hosted, params)))
        else:
            self.optimizer.step()
        for p in params:
            p.grad = None
        return {n: self.masters[n].detach() for n in g.hosted}

    def _launch_scatter(self, g: _Group, updated: Mapping[str, torch.Tensor]) -> tuple[_Group, torch.Tensor, Any]:
        """Start returning the hosts' new values (async; the send buffer holds copies, so the
        masters may change before it lands)."""
        send, send_sizes = pack_from_hosts(g.tasks, updated, self.rank, self.n, dtype=self.dtype, device=self._device)
        recv_sizes = from_hosts_recv_sizes(g.tasks, self.rank, self.n)
        self.peak_exchange_numel = max(self.peak_exchange_numel, send.numel(), sum(recv_sizes))
        out, work = self.comm.all_to_all_v(send, send_sizes, recv_sizes, async_op=True)
        return g, out, work

    # ------------------------------------------------------------------------- hyperparameters, state
    def set_hyperparams(self, values: Mapping[str, Any]) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group.update(values)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Full-shape optimizer state of the hosted parameters, by name (tensors cloned)."""
        if self.optimizer is None:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for name in self.hosted:
            st = self.optimizer.state.get(self.masters[name], {})
            out[name] = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
        return out

    def load_state_dict(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s output for the hosted parameters (others are ignored)."""
        if self.optimizer is None:
            return
        for name in self.hosted:
            p = self.masters[name]
            st = states.get(name, {})
            self.optimizer.state[p] = {k: (v.detach().clone().to(p.device) if isinstance(v, torch.Tensor) else v) for k, v in st.items()}

    def state_bytes(self) -> int:
        if self.optimizer is None:
            return 0
        return sum(v.numel() * v.element_size() for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))


# ============================================================================ the whole step


def local_block(p: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor parameter (shares storage with it: writes go to the model)."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


class FSDPRuntime:
    """One rank's optimizer step on an FSDP2 model: the element-wise optimizer on this rank's own
    pieces (fp32 masters of the pieces), the matrix parameters through :class:`FSDPEngine`.

    ``params`` maps plan names to the model's DTensor parameters, ``layouts`` gives every
    parameter's :class:`PieceLayout` over ``comm``'s group, ``groups`` the plan's micro-groups as
    (name, host) lists. Gradients are read from ``p.grad`` (FSDP2's reduce-scattered DTensor) at
    :meth:`step`; a parameter without a gradient counts as a zero gradient, as on the ZeRO-1 path.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        layouts: Mapping[str, PieceLayout],
        groups: Sequence[Sequence[tuple[str, int]]],
        *,
        comm: Comm,
        matrix_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        elementwise_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.params = dict(params)
        self.layouts = dict(layouts)
        self.comm = comm
        self.rank = comm.rank
        self.master_dtype = master_dtype
        self.matrix_names = tuple(n for g in groups for n, _ in g)
        self.elementwise_names = tuple(n for n in self.params if n not in set(self.matrix_names))
        # element-wise: fp32 masters of this rank's non-empty pieces, one optimizer over them
        self.ew_masters: dict[str, nn.Parameter] = {}
        for n in self.elementwise_names:
            loc = local_block(self.params[n].detach())
            if loc.numel():
                self.ew_masters[n] = nn.Parameter(loc.to(master_dtype, copy=True))
        self.ew_optimizer = elementwise_factory(list(self.ew_masters.values())) if self.ew_masters else None
        tasks = [[ExchangeTask(self.layouts[n], h) for n, h in g] for g in groups]
        initial = {n: local_block(self.params[n].detach()) for n in self.matrix_names}
        self.engine = FSDPEngine(tasks, comm=comm, optimizer_factory=matrix_factory, initial=initial, master_dtype=master_dtype)
        self.update_hooks = self.engine.update_hooks  # one registry for the whole step
        self.steps = 0

    def _grad(self, name: str) -> torch.Tensor:
        p = self.params[name]
        block = self.layouts[name].blocks[self.rank]
        g = p.grad
        if g is None:
            return torch.zeros(block.shape, dtype=self.master_dtype, device=local_block(p.detach()).device)
        loc = local_block(g)
        if tuple(loc.shape) != block.shape:
            raise RuntimeError(f"{name}: gradient piece has shape {tuple(loc.shape)}, the parameter's piece is {block.shape}")
        return loc.to(self.master_dtype)

    @torch.no_grad()
    def step(self) -> None:
        """Element-wise pieces first (no communication), then the matrix micro-groups."""
        from canzona.phase_names import DP_LOCAL_UPDATE, OPTIMIZER_STEP

        with phase(OPTIMIZER_STEP):
            with phase(DP_LOCAL_UPDATE):
                for n, m in self.ew_masters.items():
                    m.grad = self._grad(n)
                if self.ew_optimizer is not None:
                    if self.update_hooks:  # whole pieces only: a rank holding all of a parameter
                        whole = [(n, m) for n, m in self.ew_masters.items() if tuple(m.shape) == self.layouts[n].full_shape]
                        self.update_hooks.step(self.ew_optimizer, whole)
                    else:
                        self.ew_optimizer.step()
                for n, m in self.ew_masters.items():
                    m.grad = None
                    local_block(self.params[n].detach()).copy_(m)
            grads = {n: self._grad(n) for n in self.matrix_names}
            dest = {n: local_block(self.params[n].detach()) for n in self.matrix_names}
            self.engine.step(grads, dest)
        self.steps += 1

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """Call ``hook(name, param, optimizer)`` after each local step for every parameter this
        rank updated whole, before the value is sent (:mod:`canzona.runtime.hooks`); returns a
        handle whose ``remove()`` detaches it."""
        return self.update_hooks.register(hook)

    def discard_grads(self) -> None:
        """Nothing to discard: gradients live in ``p.grad`` (the front end clears them)."""

    def finish_param_sync(self) -> None:
        """Parameters are written back eagerly at the end of :meth:`step`; nothing is pending."""

    def set_hyperparams(self, role: str, values: Mapping[str, Any]) -> None:
        """Write scheduled values into the inner optimizers of ``role`` (``matrix``/``elementwise``)."""
        if role == "matrix":
            self.engine.set_hyperparams(values)
        elif self.ew_optimizer is not None:
            for group in self.ew_optimizer.param_groups:
                group.update(values)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank: hosted full-shape matrix state plus element-wise pieces."""
        ew = 0
        if self.ew_optimizer is not None:
            ew = sum(v.numel() * v.element_size() for st in self.ew_optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        return ew + self.engine.state_bytes()

    def refresh_masters(self) -> None:
        """Re-read every master from the model's current values (collective: the hosts re-assemble)."""
        with torch.no_grad():
            for n, m in self.ew_masters.items():
                m.copy_(local_block(self.params[n].detach()))
        self.engine.refresh_masters({n: local_block(self.params[n].detach()) for n in self.matrix_names})
