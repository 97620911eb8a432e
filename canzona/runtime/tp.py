"""The TP side of Canzona: asynchronous micro-group compute for TP-split matrix parameters (Section 4).

Tensor parallelism splits a weight matrix across the TP ranks of a DP rank, which breaks the
atomicity a matrix optimizer needs. Canzona makes each TP-split matrix parameter a *task* with one
*host* TP rank (Section 4.1) that keeps the task's full-shape fp32 master and its whole optimizer
state. For each micro-group of the plan (Algorithm 2, ``plan.micro_groups[dp_rank]``), in order:

1. gather   one fused ``all_to_all_single``: every TP rank sends its gradient shard of every task
            in the group to that task's host (``canzona/tp/gather/group<k>``);
2. compute  each host writes the shards at their places along the split dim of the full gradient and runs
            the ordinary per-parameter optimizer on the full master (``canzona/tp/compute/group<k>``);
3. scatter  one fused ``all_to_all_single`` returns every TP rank its slice of the updated
            parameter, as *values*, not deltas (``canzona/tp/scatter/group<k>``);
4. apply    every rank copies its slices into its TP-local masters (``canzona/tp/apply/group<k>``).

``no-fuse`` (the fusion ablation) is the same code with one task per group. ``sync`` (the SC and
NV-layerwise baselines) instead all-gathers full gradients on every TP rank, every rank computes
every update redundantly (so each holds full masters and state for all of them) and keeps its
shard; its exchanges are chunked into consecutive groups bounded by C_max as well.

The exchange itself (block copies, slots, the pipelined schedule, error handling) is
:class:`canzona.runtime.exchange.MicroGroupEngine`, shared with the FSDP2 engine: a TP task is a
:class:`~canzona.runtime.exchange.PieceLayout` of ``tp`` equal blocks along its split dim.

Which parameters a TP group handles is decided by DP ownership (the caller passes the TP-local
masters of the TP-split matrix parameters its DP rank updates); which TP rank hosts each one, and
how tasks batch, by the plan's micro-groups for that DP rank. The engine never re-plans.

Overlap (the schedule is :func:`canzona.runtime.exchange.pipeline`, recorded per step in
``TPEngine.last_events``). While
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
(:class:`canzona.runtime.exchange.ExchangeSlots`, ``reserved_exchange_bytes``): the gather slot (shard-side send buffer,
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

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from canzona.phase_names import exchange_phases
from canzona.plan.plan import Plan
from canzona.runtime.comm import Comm
from canzona.runtime.exchange import Block, ExchangeTask, MicroGroupEngine, PieceLayout, assemble_at_host, from_hosts_recv_sizes
from canzona.runtime.exchange import pack_from_hosts, pack_to_hosts, to_hosts_recv_sizes, unpack_from_hosts
from canzona.specs import split_task_name

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
    "tp_layout",
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


def tp_layout(task: TPTask, tp: int) -> PieceLayout:
    """The task's layout over a TP group: ``tp`` equal blocks along its split dim, rank order."""
    d = task.tp_dim
    full = tuple(s * tp if i == d else s for i, s in enumerate(task.local_shape))
    blocks = tuple(
        Block(tuple(r * task.local_shape[d] if i == d else 0 for i in range(len(full))), task.local_shape) for r in range(tp)
    )
    return PieceLayout(task.name, full, blocks)


def _exchange(tasks: Sequence[TPTask], tp: int) -> list[ExchangeTask]:
    return [ExchangeTask(tp_layout(t, tp), t.host) for t in tasks]


def pack_gather(tasks: Sequence[TPTask], shards: Mapping[str, torch.Tensor], tp: int, **kw: Any) -> tuple[torch.Tensor, list[int]]:
    """Send buffer of the gather all-to-all: this rank's shard of each task, grouped by destination
    host (rank order), tasks in group order within a host. Returns (flat buffer, send split sizes).
    ``kw``: ``dtype``, ``device`` and ``out`` of :func:`~canzona.runtime.exchange.pack_to_hosts`."""
    for t in tasks:
        s = shards[t.name]
        if tuple(s.shape) != t.local_shape:
            raise ValueError(f"{t.name}: shard has shape {tuple(s.shape)}, expected {t.local_shape}")
    # every TP rank is a source of an equal block of every task: the packing is the same on every rank
    return pack_to_hosts(_exchange(tasks, tp), shards, 0, tp, **kw)


def gather_recv_sizes(tasks: Sequence[TPTask], rank: int, tp: int) -> list[int]:
    """Receive split sizes of the gather on ``rank``: the same block (its hosted tasks' shards) from every rank."""
    return to_hosts_recv_sizes(_exchange(tasks, tp), rank, tp)


def unpack_gather(recv: torch.Tensor, tasks: Sequence[TPTask], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Full tensors of the tasks hosted on ``rank`` from the gather's receive buffer: block ``s``
    holds rank ``s``'s shards, each written at its place along the task's split dim."""
    return assemble_at_host(recv, _exchange(tasks, tp), rank, tp, dtype=recv.dtype)


def pack_scatter(tasks: Sequence[TPTask], full: Mapping[str, torch.Tensor], rank: int, tp: int, **kw: Any) -> tuple[torch.Tensor, list[int]]:
    """Send buffer of the scatter all-to-all on host ``rank``: for each destination rank (in order),
    that rank's slice of each hosted task's full tensor (group order). Values are copied; ``kw`` as
    for :func:`pack_gather`."""
    return pack_from_hosts(_exchange(tasks, tp), full, rank, tp, **kw)


def scatter_recv_sizes(tasks: Sequence[TPTask], rank: int, tp: int) -> list[int]:
    """Receive split sizes of the scatter: from each host, one shard of each task it hosts."""
    return from_hosts_recv_sizes(_exchange(tasks, tp), rank, tp)


def unpack_scatter(recv: torch.Tensor, tasks: Sequence[TPTask], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's updated shard of every task (views into ``recv``), from the scatter's receive buffer."""
    return unpack_from_hosts(recv, _exchange(tasks, tp), rank, tp)


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


def _task_order(order: Mapping[str, int], name: str) -> tuple[int, int]:
    """Plan order of a task: its parameter's index, then its expert index (experts of one stack in order)."""
    base, expert = split_task_name(name)
    return order[base], -1 if expert is None else expert


class _Packed(NamedTuple):
    """How a packed expert travels: ``piece`` (this rank's shard viewed with its blocks on their own
    dim), ``matrix`` (the ``(M, N)`` expert), ``blocks`` (what the host assembles: the matrix with
    its blocks on that dim) and ``dim`` (the dim of ``piece`` the TP ranks' pieces join on)."""

    piece: tuple[int, ...]
    matrix: tuple[int, int]
    blocks: tuple[int, ...]
    dim: int


def _packed_tasks(by_name: Mapping[str, Any], names: Collection[str], tp: int) -> dict[str, _Packed]:
    """The experts of packed stacks (``tp_blocks`` = b > 1) among ``names``. Packed on the rows
    (transformers' ``packed_colwise``, stack dim 1), rank ``r`` holds rows ``r`` of every block:
    its piece is ``(b, M / (b tp), N)`` and the host assembles ``(b, M / b, N)``. Packed on the
    columns (``packed_rowwise``, stack dim 2, Llama 4's ``(E, H, 2F)`` gate_up): ``(M, b, N / (b
    tp))`` and ``(M, b, N / b)``. Either assembly is the matrix with its rows or columns in order,
    so the update is the single-device one bit for bit."""
    out = {}
    for n in names:
        base, expert = split_task_name(n)
        spec = by_name[base].spec
        if expert is not None and spec.tp_blocks > 1:
            b, (m, k) = spec.tp_blocks, spec.task_shape
            if spec.tp_dim == 1:
                out[n] = _Packed((b, m // (b * tp), k), (m, k), (b, m // b, k), 1)
            else:
                out[n] = _Packed((m, b, k // (b * tp)), (m, k), (m, b, k // b), 2)
    return out


def _is_tp_task(p: Any, expert: int | None) -> bool:
    """Whether plan parameter ``p`` (expert ``expert`` of it, for a stack) is a TP engine task."""
    if expert is None:
        return p.role == "tp-task"
    return p.role == "experts" and p.spec.tp_split and 0 <= expert < p.spec.shape[0]


class TPEngine(MicroGroupEngine):
    """Section 4's TP optimizer step for one DP rank's TP group (see the module docstring).

    ``comm`` is a :class:`Comm` over this DP rank's TP group (group-local ranks = TP ranks).
    ``local_masters`` are the fp32 TP-local master shards (``spec.local_shape``) of the TP-split
    matrix parameters this DP rank updates, and of each expert (``stack[e]``, its ``(M, N)``
    shard) of the TP-split expert stacks it updates; :meth:`step` updates them in place. ``exchange``:
    ``"ns-input"`` (or ``"auto"``) runs the split step (:class:`~canzona.runtime.exchange.MicroGroupEngine`):
    the optimizer is built over ``local_masters`` themselves, its element-wise state (Muon's
    momentum) lives with each shard, and only the Newton-Schulz input and output are exchanged.
    ``optimizer_factory`` builds ONE per-parameter optimizer over the full-shape masters hosted
    here (not called when this rank hosts nothing). Exchange slots, schedule and state interface
    are :class:`~canzona.runtime.exchange.MicroGroupEngine`'s (``slots``,
    ``reserved_exchange_bytes``, ``peak_exchange_bytes``, ``schedule_events``, ``last_events``).
    """

    def __init__(
        self,
        plan: Plan,
        *,
        dp_rank: int,
        comm: Comm,
        optimizer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        local_masters: dict[str, torch.Tensor],
        exchange: str = "gradients",
    ) -> None:
        inp = plan.inputs
        self.plan = plan
        self.dp_rank = dp_rank
        self.tp = comm.size
        self.tp_rank = comm.rank
        self.schedule = inp.tp_schedule
        self.local_masters = local_masters
        if inp.tp != self.tp:
            raise ValueError(f"plan has tp={inp.tp} but the TP group has {self.tp} ranks")
        if not isinstance(dp_rank, int) or not 0 <= dp_rank < inp.dp:
            raise ValueError(f"dp_rank must be in [0, {inp.dp}), got {dp_rank!r}")
        by_name = plan.by_name()
        dtype = self._check_masters(by_name)
        # device of the exchange buffers (masters live on the model's device; none: nothing to exchange)
        device = next(iter(local_masters.values())).device if local_masters else torch.device("cpu")
        order = {p.name: i for i, p in enumerate(plan.params)}
        names = sorted(local_masters, key=lambda n: _task_order(order, n))
        es = torch.empty(0, dtype=dtype).element_size()

        #: packed expert tasks (transformers' packed_colwise / packed_rowwise): name -> how it travels
        self._packed = _packed_tasks(by_name, local_masters, self.tp)
        groups = self._task_groups(by_name, names, es)
        super().__init__(
            [_exchange(g, self.tp) for g in groups],
            comm=comm,
            optimizer_factory=optimizer_factory,
            initial=local_masters,
            dtype=dtype,
            device=device,
            phases=exchange_phases("canzona/tp/gather", "canzona/tp/compute", "canzona/tp/scatter", "canzona/tp/apply"),
            exchange=exchange,
        )
        self.sync = self.schedule == "sync"
        # the split step scales each update by its matrix's shape: a packed expert's is (M, N),
        # not the 3-D blocks its exchange assembles
        self._full_shapes.update({n: p.matrix for n, p in self._packed.items()})

    # ------------------------------------------------------------------------- set-up helpers
    def _task(self, by_name: dict[str, Any], name: str, host: int) -> TPTask:
        spec = by_name[split_task_name(name)[0]].spec  # an expert task (name[e]): one (M, N) expert
        if name in self._packed:  # its blocks on a dim of their own: one rectangular piece per rank
            return TPTask(name, host, self._packed[name].piece, self._packed[name].dim)
        return TPTask(name, host, spec.local_task_shape, int(spec.task_tp_dim))  # type: ignore[arg-type]

    def _task_groups(self, by_name: dict[str, Any], names: list[str], element_size: int) -> list[list[TPTask]]:
        """This DP rank's micro-groups as tasks: under ``sync`` every TP rank computes every update
        (host -1, every task local everywhere, grouped by C_max); otherwise the plan's groups, which
        must hold exactly the tasks of ``local_masters``."""
        inp = self.plan.inputs
        if self.schedule == "sync":
            return sync_groups([self._task(by_name, n, -1) for n in names], self.tp, inp.cmax_bytes, element_size)
        planned = self.plan.micro_groups[self.dp_rank] if len(self.plan.micro_groups) > self.dp_rank else ()
        in_groups = [n for g in planned for n in g.params]
        if set(in_groups) != set(names):
            missing = sorted(set(in_groups) - set(names))
            extra = sorted(set(names) - set(in_groups))
            raise ValueError(
                f"local_masters disagree with the plan's micro-groups of dp rank {self.dp_rank}: "
                f"missing {missing[:3]}{'...' if len(missing) > 3 else ''}, not in any group {extra[:3]}{'...' if len(extra) > 3 else ''}"
            )
        return [[self._task(by_name, n, h) for n, h in zip(g.params, g.hosts)] for g in planned]

    def _check_masters(self, by_name: Mapping[str, Any]) -> torch.dtype:
        dtypes = set()
        for name, t in self.local_masters.items():
            base, expert = split_task_name(name)
            if base not in by_name:
                raise ValueError(f"{name!r} is not a parameter of the plan")
            p = by_name[base]
            spec = p.spec
            if not _is_tp_task(p, expert):
                raise ValueError(f"{name}: the TP engine handles TP-split matrix parameters (and experts of TP-split stacks) only")
            if expert is None and not p.replicated and p.dp_owner != self.dp_rank:
                raise ValueError(f"{name}: owned by dp rank {p.dp_owner}, not by this rank ({self.dp_rank})")
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != spec.local_task_shape:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: local master has shape {shape}, expected {spec.local_task_shape}")
            if not t.is_floating_point():
                raise TypeError(f"{name}: masters must be floating point, got {t.dtype}")
            dtypes.add(t.dtype)
        if len(dtypes) > 1:
            raise TypeError(f"all local masters must share one dtype, got {sorted(map(str, dtypes))}")
        return dtypes.pop() if dtypes else torch.float32

    def refresh_masters(self, values: Mapping[str, torch.Tensor] | None = None) -> None:
        """(Re)assemble the full-shape masters hosted here from every rank's ``local_masters``
        (one exchange per group, through the gather slot). Called at construction; call it again
        after overwriting ``local_masters`` from outside (e.g. a checkpoint load). Optimizer state
        is kept."""
        super().refresh_masters(self._pieces(self.local_masters if values is None else values))

    # ------------------------------------------------------------------------- packed expert stacks
    def _pieces(self, tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """This rank's pieces as the exchange lays them out: a packed expert's shard (its slice of
        each block, one after another) viewed with its blocks on a dim of their own
        (:class:`_Packed`: ``(blocks, M / (blocks tp), N)`` packed on the rows, ``(M, blocks,
        N / (blocks tp))`` on the columns)."""
        if not self._packed:
            return tensors
        return {n: t.view(self._packed[n].piece) if n in self._packed else t for n, t in tensors.items()}

    def _unpack_gather(self, g: Any, pieces: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # the assembled tensor of a packed expert ((blocks, M / blocks, N), or (M, blocks, N / blocks)
        # packed on the columns) holds its rows or columns in the stack's own order ([gate; up]):
        # the optimizer sees it as the (M, N) matrix it is
        full = super()._unpack_gather(g, pieces)
        for n in self._packed.keys() & full.keys():
            full[n] = full[n].view(self._packed[n].matrix)
        return full

    def _blocks(self, values: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hosted values back in the exchange's layout (a packed expert as its stacked blocks)."""
        return {n: (v.view(self._packed[n].blocks) if n in self._packed else v) for n, v in values.items()}

    def _compute(self, g: Any, full_grads: Mapping[str, torch.Tensor], skip: Collection[str] = ()) -> dict[str, torch.Tensor]:
        return self._blocks(super()._compute(g, full_grads, skip))

    def _launch_scatter(self, g: Any, updated: Mapping[str, torch.Tensor], computed: bool = True) -> Any:
        return super()._launch_scatter(g, self._blocks(updated), computed)

    # the split step keeps Muon's momentum on the local masters as they are (the TP shard of a
    # packed expert); only what travels is laid out as stacked blocks: the Newton-Schulz input on
    # its way to the host, the host's results, and the blocks that come back
    def _launch_gather(self, g: Any, pieces: Mapping[str, torch.Tensor]) -> Any:
        return super()._launch_gather(g, self._pieces(pieces))

    def _split_compute(self, g: Any, full: Mapping[str, torch.Tensor], skip: Collection[str]) -> dict[str, torch.Tensor]:
        return self._blocks(super()._split_compute(g, full, skip))

    def _split_block(self, name: str, block: torch.Tensor) -> torch.Tensor:
        return block.reshape(self.local_masters[name].shape) if name in self._packed else block

    # ------------------------------------------------------------------------- the step
    def step(self, local_grads: Mapping[str, torch.Tensor], *, skip: Collection[str] = ()) -> None:
        """One optimizer step: gather -> compute -> scatter -> apply per micro-group, in plan order,
        pipelined as :func:`pipeline` says (gather ``k+1`` and scatter ``k-1`` in flight while
        group ``k`` computes); the new values land in ``local_masters``.

        ``skip``: parameters without a gradient on any rank; hosts do not step them (their values
        return unchanged). An error in one host's compute does not stop the exchanges (the other
        TP ranks are waiting in them): that host returns its unchanged values for the group, runs
        the remaining groups' exchanges, and raises the first error at the end."""
        self._check_grads(local_grads)
        if skip:  # a skipped expert stack skips each of its expert tasks
            skip = frozenset(n for n in self.local_masters if n in skip or split_task_name(n)[0] in skip)
        if self.split:  # the momentum and the update on the local masters themselves (see _launch_gather)
            self.run(local_grads, self.local_masters, skip=skip)
        else:
            self.run(self._pieces(local_grads), self._pieces(self.local_masters), skip=skip)

    def _check_grads(self, local_grads: Mapping[str, torch.Tensor]) -> None:
        if set(local_grads) != set(self.local_masters):
            missing = sorted(set(self.local_masters) - set(local_grads))
            extra = sorted(set(local_grads) - set(self.local_masters))
            raise ValueError(f"local_grads keys differ from local_masters: missing {missing[:3]}, unexpected {extra[:3]}")
        for name, g in local_grads.items():
            if tuple(g.shape) != tuple(self.local_masters[name].shape):
                raise ValueError(f"{name}: gradient shard has shape {tuple(g.shape)}, expected {tuple(self.local_masters[name].shape)}")
