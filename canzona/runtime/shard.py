"""The FSDP2 exchange engine: Canzona's micro-group step over pieces of any rectangular layout.

Under ``fully_shard`` a parameter is a DTensor whose local tensor on each rank of its shard group
(``dp_shard x tp`` of one replica) is a rectangular block of the full tensor: FSDP2 cuts dim 0
with ``torch.chunk`` semantics (so trailing ranks may hold fewer rows, or none), TP cuts its
split dim first, and a parameter replicated over ``tp`` has the same block on several ranks.
:class:`PieceLayout` records every rank's block (offset and shape, read from the DTensor
placements and exchanged once), and marks one *source* rank per distinct block.

The step is the paper's TP engine (Section 4.1, Algorithm 2's micro-groups) with the pieces of
a matrix spread over that group: :class:`FSDPEngine` is
:class:`canzona.runtime.exchange.MicroGroupEngine`, the exchange engine the TP path uses too
(block copies worked out once, two exchange slots reserved once and reused by every group of
every step, the pipelined schedule :func:`~canzona.runtime.exchange.pipeline`), in its ``direct``
mode: a host's own blocks of the matrices it hosts are copied in place, not exchanged with itself
(see :func:`~canzona.runtime.exchange.describe_group`). Per micro-group:

1. gather   one fused ``all_to_all_single``: every source sends its block of every task in the
            group to the task's host (``canzona/shard/gather/group<k>``, launch and wait stages);
2. compute  the host writes the blocks into a full-shape gradient and runs the ordinary
            per-parameter optimizer on its full master (state lives only there);
3. scatter  one fused ``all_to_all_single`` returns to every rank its block of each updated
            value (values, not deltas), asynchronously: it lands while the next group computes;
4. apply    every rank copies its blocks into the destinations it was given (the model's local
            tensors), casting to their dtype.

Group ``k+1``'s gather is in flight while group ``k`` computes, and group ``k-1``'s scatter too
(applied right after). A task is a matrix parameter or one expert ``stack[e]`` of a stack cut by
its shard (its piece: each rank's block of the stack at expert ``e``, a view of the stack's local
tensor). Under ``sc`` every rank is the host of every task (host ``-1``): the
gather all-gathers the full gradient everywhere, every rank computes every update with its own
full state, keeps its block, and nothing is scattered.

:class:`FSDPRuntime` is one rank's whole step: the status exchange of the ZeRO-1 path
(:func:`canzona.runtime.agree.agree`) before anything changes, the element-wise pieces, the
matrix micro-groups, and a second exchange for errors raised while updating.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from canzona.optim import finite_grads_verified
from canzona.phase_names import exchange_phases
from canzona.runtime.hooks import RemovableHandle, UpdateHook
from canzona.runtime.agree import (
    AgreementTimeout,
    PendingAgreement,
    ReplicaGuard,
    agree,
    agree_start,
    check_step_flags,
    nonfinite,
    status_group,
    step_flags,
)
from canzona.runtime.comm import Comm
from canzona.runtime.dp import elementwise_groups, update_groups
from canzona.runtime.exchange import ExchangeTask, MicroGroupEngine, PieceLayout
from canzona.runtime.phases import phase
from canzona.settings import OptimizerSettings
from canzona.specs import split_task_name

__all__ = ["FSDPEngine", "FSDPRuntime", "local_block"]


class _Refused(Exception):
    """The step's status exchange refused it (the cause is in :class:`_StepState`). After a
    timeout the process group is unusable, so the engine leaves without landing its gather
    (``abandon_exchanges``: waiting for a rank that never came would outlast the status bound)."""

    def __init__(self, abandon: bool) -> None:
        super().__init__("the status exchange refused the step")
        self.abandon_exchanges = abandon


class _StepState:
    """What one step learns while it runs: the parameters without a gradient anywhere (``skip``),
    the tasks the engine must not step (read at each compute), a refusal, an element-wise error."""

    __slots__ = ("ew_error", "matrix_skip", "refused", "skip")

    def __init__(self) -> None:
        self.skip: frozenset[str] = frozenset()
        self.matrix_skip: set[str] = set()
        self.refused: list[BaseException] = []
        self.ew_error: list[Exception] = []


class FSDPEngine(MicroGroupEngine):
    """The matrix step over one shard group (see the module docstring).

    ``groups`` are the plan's micro-groups as :class:`ExchangeTask` lists (hosts are group ranks of
    ``comm``). ``initial`` maps every task's name to this rank's block of its current value (any
    float dtype): hosts assemble their full fp32 (``master_dtype``) masters from it with one
    exchange per group. ``optimizer_factory`` builds ONE per-parameter optimizer over the hosted
    full masters (not called when this rank hosts nothing).
    """

    def __init__(self, groups: Sequence[Sequence[ExchangeTask]], *, master_dtype: torch.dtype = torch.float32, **kw: Any) -> None:
        # kw: comm, optimizer_factory, initial (see MicroGroupEngine)
        # direct: a host's own blocks never go through the exchanges (see describe_group)
        super().__init__(groups, dtype=master_dtype, direct=True, phases=exchange_phases("canzona/shard/gather", "canzona/shard/compute", "canzona/shard/scatter", "canzona/shard/apply"), **kw)

    def step(self, grads: Mapping[str, torch.Tensor], dest: Mapping[str, torch.Tensor], *, skip: Collection[str] = (),
             overlap: Callable[[], None] | None = None) -> None:
        """One matrix step (:meth:`~canzona.runtime.exchange.MicroGroupEngine.run`): ``grads[name]``
        is this rank's gradient block, ``dest[name]`` the tensor that receives this rank's block of
        the new value; tasks in ``skip`` are not stepped (their values return unchanged);
        ``overlap`` runs while the first gather is in flight."""
        self.run(grads, dest, skip=skip, overlap=overlap)

    def load_state_dict(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Restore :meth:`state_dict`'s output for the hosted parameters (others are ignored; a
        hosted parameter absent from ``states`` gets an empty state)."""
        super().load_state_dict({name: states.get(name, {}) for name in self.state_names})


# ============================================================================ the whole step


def local_block(p: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor parameter (shares storage with it: writes go to the model).

    A DTensor's own ``_local_tensor``: what ``to_local()`` returns under ``no_grad``, read without
    the call's dispatch and, for a parameter, the fresh view it makes each time (a few
    microseconds, paid twice per parameter per step). No autograd link either way: callers use
    it under ``no_grad`` or on ``p.detach()``."""
    return p._local_tensor if isinstance(p, _dtensor()) else p


def _piece_master(piece: torch.Tensor, master_dtype: torch.dtype) -> nn.Parameter:
    """The split step's master of one piece (this rank's block of a matrix, or of one expert of a
    stack): the model's own storage where it already is a contiguous block in the master dtype
    (fp32 parameters under FSDP2), else a copy in the master dtype.

    Aliased, the update lands in the model's shard in place: no copy back after every step and no
    second fp32 copy of every matrix parameter (4 bytes per element). What stays the same: the
    masters hold exactly the values a separate master would (the step writes its value into the
    model either way), and the checks before the step still run before anything changes. What
    changes: an in-place edit of a matrix parameter (``load_state_dict`` into the model,
    ``p.data.mul_``) reaches its master at once instead of waiting for ``refresh_masters`` (which
    stays needed for the element-wise masters and after a storage swap). When FSDP2 re-allocates
    a shard (``model.to``, ``reset_sharded_param``) the alias no longer is the model's storage:
    it then acts as a separate master and the step copies its value over, as before."""
    if piece.numel() and piece.dtype == master_dtype and piece.is_contiguous():
        return nn.Parameter(piece.detach())  # shares the model's storage
    return nn.Parameter(piece.to(master_dtype, copy=True))


def _dtensor() -> type:
    """torch's DTensor class (imported on first use: this module is imported without a process group too)."""
    global _DTENSOR
    if _DTENSOR is None:
        from torch.distributed.tensor import DTensor

        _DTENSOR = DTensor
    return _DTENSOR


_DTENSOR: type | None = None


class FSDPRuntime:
    """One rank's optimizer step on an FSDP2 model: the element-wise optimizer on this rank's own
    pieces (fp32 masters of the pieces), the matrix parameters through :class:`FSDPEngine`.

    ``params`` maps plan names to the model's DTensor parameters, ``layouts`` gives every
    parameter's :class:`PieceLayout` over ``comm``'s group, ``groups`` the plan's micro-groups as
    (name, host) lists. ``expert_names``: the expert stacks whose blocks hold whole experts
    (updated where they live); ``expert_layouts``: the ``(M, N)`` layout of every expert
    ``stack[e]`` of the stacks cut by their shard, hosted tasks like the matrices. Gradients are read from ``p.grad`` (FSDP2's reduce-scattered DTensor) at
    :meth:`step`. As on the ZeRO-1 path, a parameter without a gradient on any rank is skipped (as
    ``torch.optim`` skips ``p.grad is None``) and one with a gradient on some ranks only counts the
    others' pieces as zero. ``settings`` (:class:`canzona.settings.OptimizerSettings`) gives the
    master dtype and ``status_timeout_s``, the bound on each wait in the step's status exchanges.
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
        settings: OptimizerSettings | None = None,
        expert_names: Sequence[str] = (),
        expert_layouts: Mapping[str, PieceLayout] = {},
    ) -> None:
        # the options were validated once, when the settings record was built
        settings = settings if settings is not None else OptimizerSettings()
        master_dtype, status_timeout_s = settings.master_dtype, settings.status_timeout_s
        self.params = dict(params)
        self.layouts = dict(layouts)
        self.comm = comm
        self.rank = comm.rank
        self.master_dtype = master_dtype
        self.status_timeout_s = float(status_timeout_s)
        #: the status exchanges run over the world, counted in ``comm``'s stats
        self.status_comm = Comm(status_group(), comm.stats)
        self.matrix_names = tuple(n for g in groups for n, _ in g)
        self.expert_names = tuple(expert_names)
        self._init_tasks(expert_layouts)
        self.elementwise_names = tuple(n for n in self.params if n not in set(self._task_of.values()) | set(self.expert_names))
        #: every parameter in a fixed order shared by all ranks (the status flags follow ``_flag_items``)
        self.names = tuple(self.params)
        #: (name, parameter, this rank's piece shape) in :attr:`names` order, read by :meth:`_grads`
        self._grad_items = tuple((n, self.params[n], self.layouts[n].blocks[self.rank].shape) for n in self.names)
        self._device = local_block(next(iter(self.params.values())).detach()).device if self.params else torch.device("cpu")
        # element-wise: fp32 masters of this rank's non-empty pieces, one optimizer over them
        self.ew_masters: dict[str, nn.Parameter] = {}
        for n in self.elementwise_names:
            loc = local_block(self.params[n].detach())
            if loc.numel():
                self.ew_masters[n] = nn.Parameter(loc.to(master_dtype, copy=True))
        self.ew_optimizer = (elementwise_factory(elementwise_groups(list(self.ew_masters.values()), list(self.ew_masters), settings.no_weight_decay))
                             if self.ew_masters else None)
        self._init_experts(matrix_factory)
        tasks = [[ExchangeTask(self.task_layouts[n], h) for n, h in g] for g in groups]
        initial = self._pieces({n: local_block(p.detach()) for n, p in self.params.items()})
        if settings.exchange != "gradients":
            # the split step's piece masters (every matrix, empty pieces too: a piece stands for
            # its matrix's param group on the host); unused and dropped on the other path
            initial = {n: _piece_master(t, master_dtype) for n, t in initial.items()}
        self.engine = FSDPEngine(tasks, comm=comm, optimizer_factory=matrix_factory, initial=initial, master_dtype=master_dtype,
                                 exchange=settings.exchange)
        self.update_hooks = self.engine.update_hooks  # one registry for the whole step
        #: under the sync schedule every rank computes every matrix, keeping its own copy of their
        #: masters and state: after an update that failed on some ranks only, steps are refused
        self.replicas = ReplicaGuard(self.engine.sync, "the 'sync' schedule (strategy 'sc')")
        self.steps = 0

    # ---- hosted tasks: whole matrices, and the experts of stacks cut by their shard (stack[e])
    def _init_tasks(self, expert_layouts: Mapping[str, PieceLayout]) -> None:
        """Each hosted task's layout and parameter, each parameter's tasks, and the names the step's
        status flags use: one per parameter, one per expert for a stack (so a non-finite gradient
        is named down to its expert)."""
        self._task_of: dict[str, str] = {}  # task -> its parameter
        self._expert_of: dict[str, int] = {}  # expert task -> its index in the stack
        self.task_layouts: dict[str, PieceLayout] = {}
        for t in self.matrix_names:
            if t in expert_layouts:  # stack[e] (a parameter name never holds brackets)
                base, e = split_task_name(t)
                assert e is not None and base in self.params, t
                self._task_of[t], self._expert_of[t], self.task_layouts[t] = base, e, expert_layouts[t]
            else:
                self._task_of[t], self.task_layouts[t] = t, self.layouts[t]
        self._task_items = [(t, n, self._expert_of.get(t)) for t, n in self._task_of.items()]
        self._tasks_of: dict[str, list[str]] = {}
        for t, n in self._task_of.items():
            self._tasks_of.setdefault(n, []).append(t)
        stacks = set(self.expert_names) | {self._task_of[t] for t in self._expert_of}
        self._flag_items = [(f"{n} (expert {e})", n, e) if n in stacks else (n, n, None)
                            for n in self.params for e in (range(self.layouts[n].full_shape[0]) if n in stacks else [None])]

    def _expert_piece(self, name: str, e: int, local: torch.Tensor) -> torch.Tensor | None:
        """Expert ``e`` of this rank's block ``local`` of stack ``name`` (a view), None when the
        block holds none of it."""
        b = self.layouts[name].blocks[self.rank]
        k = e - b.offset[0]
        return local[k] if b.numel and 0 <= k < b.shape[0] else None

    def _pieces(self, local: Mapping[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
        """Every hosted task's piece of this rank's blocks ``local`` (parameter name -> its block,
        None: zeros): the block itself for a matrix, the block's part of expert ``e`` (a view, or an
        empty tensor where the block holds none of it) for ``stack[e]``."""
        out = {}
        for t, n, e in self._task_items:  # (task, parameter, expert or None), made once
            block = local.get(n)
            if block is None:
                out[t] = torch.zeros(self.task_layouts[t].blocks[self.rank].shape, dtype=self.master_dtype, device=self._device)
            elif e is None:
                out[t] = block
            else:
                piece = self._expert_piece(n, e, block)
                out[t] = piece if piece is not None else block.new_empty(self.task_layouts[t].blocks[self.rank].shape)
        return out

    # ---- expert stacks (Shard(0): this rank's block holds whole experts), updated where they live
    def _init_experts(self, matrix_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        """One ``(M, N)`` master per local expert and one matrix optimizer over them: each expert
        is its own matrix task, with its own state, and needs no exchange."""
        self.expert_masters: dict[tuple[str, int], nn.Parameter] = {}
        for n in self.expert_names:
            loc = local_block(self.params[n].detach())
            for k in range(loc.shape[0]):
                self.expert_masters[(n, k)] = nn.Parameter(loc[k].to(self.master_dtype, copy=True))
        self.expert_optimizer = matrix_factory(list(self.expert_masters.values())) if self.expert_masters else None

    def _update_experts(self, grads: Mapping[str, torch.Tensor | None], skip: Collection[str]) -> None:
        """Step every local expert of the stacks not in ``skip`` (an expert no token reached has
        a zero gradient, which the optimizer steps as the single-device one would)."""
        live = [((n, k), m) for (n, k), m in self.expert_masters.items() if n not in skip]
        if self.expert_optimizer is None or not live:
            return
        try:
            for (n, k), m in live:
                g = grads[n]
                m.grad = g[k] if g is not None else torch.zeros_like(m)
            self.expert_optimizer.step()
        finally:
            for _, m in live:
                m.grad = None

    def _write_experts(self, skip: Collection[str]) -> None:
        for (n, k), m in self.expert_masters.items():
            if n not in skip:
                local_block(self.params[n].detach())[k].copy_(m)

    def _grads(self) -> dict[str, torch.Tensor | None]:
        """This rank's gradient piece of every parameter in the master dtype (None: the parameter
        has no ``p.grad``); a piece of another shape than the parameter's is an error. One pass over
        ``(name, parameter, piece shape)`` triples made once (the parameters are the plan's:
        ``DistributedOptimizer`` checks that before each step); a piece already in the master
        dtype is taken as it is (what ``Tensor.to`` returns for it too)."""
        md, dtensor, out = self.master_dtype, _dtensor(), {}
        for name, p, shape in self._grad_items:
            g = p.grad
            if g is None:
                out[name] = None
                continue
            loc = g._local_tensor if isinstance(g, dtensor) else g
            if loc.shape != shape:
                raise RuntimeError(f"{name}: gradient piece has shape {tuple(loc.shape)}, the parameter's piece is {tuple(shape)}")
            out[name] = loc if loc.dtype == md else loc.to(md)
        return out

    def _zeros(self, name: str) -> torch.Tensor:
        return torch.zeros(self.layouts[name].blocks[self.rank].shape, dtype=self.master_dtype, device=self._device)

    def _local_flags(self, grads: Mapping[str, torch.Tensor | None], digest: int) -> torch.Tensor:
        """:func:`~canzona.runtime.agree.step_flags` in :attr:`names` order: whether this rank has
        a gradient for each parameter and whether its piece holds NaN or inf (a CPU tensor: the
        device's finiteness flags are its one device-to-host copy)."""
        received = torch.tensor([grads[n] is not None for _, n, _ in self._flag_items], dtype=torch.int64)
        pieces = [g if (g := grads[n]) is None or e is None else self._expert_piece(n, e, g) for _, n, e in self._flag_items]
        return step_flags(digest, received, nonfinite(pieces, self._device))

    @torch.no_grad()
    def step(self, digest: int = 0) -> None:
        """One step, as on the ZeRO-1 path: read the gradient pieces, then one status exchange over
        the world (a fused ``all_reduce(MAX)`` of a small int64 vector) settles, on every rank and
        before anything changes, errors so far, which parameters have a gradient anywhere,
        non-finite gradients and ``digest`` (the caller's hash of the hyperparameters); then the
        matrix micro-groups, with the element-wise pieces (no communication) updated while the
        first gather is in flight; a second exchange carries errors raised while updating.

        The status exchange is launched before the first gather and waited for right after it is
        launched, before any update (:meth:`_settle`): the gather only moves gradient pieces into
        the exchange slot, so the two transfers overlap and the step pays one round trip less,
        with the same guarantee. A refused step leaves every parameter and optimizer state
        untouched on every rank and drops the gradients (``p.grad`` becomes None); a rank that
        failed before the exchange joins the first gather with zero pieces. Under the sync
        schedule a failed update makes later steps raise
        :class:`~canzona.runtime.agree.ReplicasDiverged` until a checkpoint is loaded."""
        self.replicas.check("optimizer step")
        n = len(self._flag_items)
        error: BaseException | None = None
        flags = torch.zeros(2 * n + 2, dtype=torch.int64)
        grads: dict[str, torch.Tensor | None] = {}
        with phase("canzona/optimizer/step"):
            try:
                grads = self._grads()
                flags = self._local_flags(grads, digest)
            except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
                error = exc
            pending = agree_start(error, "optimizer step", flags=flags, comm=self.status_comm, timeout_s=self.status_timeout_s)
            state = _StepState()
            try:
                # Always: the other ranks wait in the engine's exchanges. After an error this rank
                # joins them without computing (every task it hosts skipped).
                mgrads = self._pieces(grads)
                # (under no_grad a DTensor's to_local() is its local tensor: no detach, no dispatch)
                dest = self._pieces({n: local_block(self.params[n]) for n in self._tasks_of})
                # the gradients were found finite on every rank in the status exchange: canzona's
                # optimizers need not test them again (the overlap below runs in this thread)
                with finite_grads_verified():
                    self.engine.step(mgrads, dest, skip=state.matrix_skip, overlap=lambda: self._settle(pending, grads, state))
            except _Refused:
                self.drop_grads()
                raise state.refused[0]  # keeps its cause (a failing rank's own exception)
            except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
                error = exc
            if state.ew_error:
                error = state.ew_error[0]
            try:
                agree(error, "optimizer step (update)", comm=self.status_comm, timeout_s=self.status_timeout_s)
            except BaseException as exc:
                self.drop_grads()
                self.replicas.failed(exc)
                raise
            # element-wise values reach the model only once every rank has updated without error
            for n, m in self.ew_masters.items():
                if n not in state.skip:
                    local_block(self.params[n]).copy_(m)
            self._write_experts(state.skip)
        self.steps += 1

    def _settle(self, pending: PendingAgreement, grads: Mapping[str, torch.Tensor | None], state: _StepState) -> None:
        """Run by the engine right after the first gather is launched, before any update: finish
        the status exchange (every rank receives the same reduced flags, so every rank refuses
        alike, and the engine lands the gather before the refusal leaves), then the element-wise
        update, which overlaps the rest of that gather."""
        try:
            reduced = pending.finish()
            assert reduced is not None
            unreached = check_step_flags(reduced, [label for label, _, _ in self._flag_items])
            state.skip = frozenset(n for label, n, _ in self._flag_items if label in unreached)
        except BaseException as exc:
            state.refused.append(exc)
            raise _Refused(isinstance(exc, AgreementTimeout)) from exc
        state.matrix_skip.update(t for n in state.skip for t in self._tasks_of.get(n, ()))
        self._elementwise(grads, state)

    def _elementwise(self, grads: Mapping[str, torch.Tensor | None], state: _StepState) -> None:
        """The element-wise optimizer on this rank's pieces; must not raise (the other ranks wait in
        the engine's exchanges): an error is kept and every task is skipped on this rank."""
        live = {n: m for n, m in self.ew_masters.items() if n not in state.skip}
        try:
            with phase("canzona/dp/local_update"):
                for n, m in live.items():
                    g = grads[n]
                    m.grad = g if g is not None else self._zeros(n)
                if self.ew_optimizer is not None:
                    if self.update_hooks:  # whole pieces only: a rank holding all of a parameter
                        whole = [(n, m) for n, m in self.ew_masters.items() if tuple(m.shape) == self.layouts[n].full_shape]
                        self.update_hooks.step(self.ew_optimizer, whole)
                    else:
                        self.ew_optimizer.step()
                self._update_experts(grads, state.skip)
        except Exception as exc:  # noqa: BLE001 - this rank now joins the exchanges without computing
            state.ew_error.append(exc)
            state.matrix_skip.update(self.matrix_names)
        finally:
            for m in live.values():
                m.grad = None

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """Call ``hook(name, param, optimizer)`` after each local step for every parameter this
        rank updated whole, before the value is sent (:mod:`canzona.runtime.hooks`); returns a
        handle whose ``remove()`` detaches it."""
        return self.engine.register_update_hook(hook)

    def discard_grads(self) -> None:
        """Nothing to discard: gradients live in ``p.grad`` (the front end clears them)."""

    def drop_grads(self) -> None:
        """Drop every parameter's gradient (``p.grad = None``), as a refused step does: the next
        backward starts afresh instead of adding to a gradient no rank used."""
        for p in self.params.values():
            p.grad = None

    def finish_param_sync(self) -> None:
        """Parameters are written back eagerly at the end of :meth:`step`; nothing is pending."""

    def set_hyperparams(self, role: str, values: Mapping[str, Any]) -> None:
        """Write scheduled values into the inner optimizers of ``role`` (``matrix``/``elementwise``)."""
        if role == "matrix":
            self.engine.set_hyperparams(values)
            if self.expert_optimizer is not None:
                for group in self.expert_optimizer.param_groups:
                    group.update(values)
        elif self.ew_optimizer is not None:
            update_groups(self.ew_optimizer, values)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank: hosted full-shape matrix state plus element-wise pieces."""
        ew = 0
        for opt in (self.ew_optimizer, self.expert_optimizer):
            if opt is not None:
                ew += sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
        return ew + self.engine.state_bytes()

    def aliases_model(self, name: str, local: torch.Tensor) -> bool:
        """Whether the split step's piece masters of parameter ``name`` are the model's storage
        ``local`` (this rank's block of it, as :func:`local_block` reads it now): the masters
        :func:`_piece_master` aliased, and FSDP2 has not re-allocated the shard since. A load then
        writes those values once, through the master, never from a separate model entry."""
        pieces = self.engine.pieces if self.engine.split else {}
        tasks = [pieces[t] for t in self._tasks_of.get(name, ()) if t in pieces and pieces[t].numel()]
        return bool(tasks) and local.numel() > 0 and all(
            m.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() for m in tasks)

    def refresh_masters(self) -> None:
        """Re-read every master from the model's current values (collective: the hosts re-assemble)."""
        with torch.no_grad():
            for n, m in self.ew_masters.items():
                m.copy_(local_block(self.params[n].detach()))
            for (n, k), m in self.expert_masters.items():
                m.copy_(local_block(self.params[n].detach())[k])
        self.engine.refresh_masters(self._pieces({n: local_block(self.params[n].detach()) for n in self._tasks_of}))
