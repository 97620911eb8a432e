"""The data-parallel runtime: gradient collectives, owner-side updates, parameter return (Sections 2-3).

One :class:`DPRuntime` per rank executes a :class:`~canzona.plan.plan.Plan` over the DP process
group. Per iteration:

1. *Backward* (``canzona/backward``): :class:`~canzona.runtime.buffer.GradBuffer` hooks collect
   gradients into the flat buffer; each bucket launches its collective asynchronously as soon as
   it is complete, overlapping with the rest of backward:

   - ``zero1``, ``asc``, ``lb-asc``, ``lb-asc-joint``: one variable-size reduce-scatter per bucket
     to the plan's cut points (``canzona/dp/reduce_scatter/bucket<i>/launch``);
   - ``sc``, ``layerwise``: one all-reduce per bucket (``canzona/dp/all_reduce/bucket<i>/launch``).

   Every asynchronous collective has a ``.../launch`` range (issuing it, packing included) and a
   ``.../wait`` range (blocking until it lands), carrying ``bytes``, ``bucket`` and ``peers``
   arguments for the profiler (:func:`canzona.runtime.phases.phase`).

2. *Optimizer step* (``canzona/optimizer/step``), orchestrated as gather -> agree -> compute ->
   agree -> scatter -> apply. By default every bucket is gathered first, then one status exchange
   (:func:`canzona.runtime.agree.agree`) settles, on every rank and before any state changes,
   errors so far, which parameters have a gradient anywhere (the others are skipped, as
   ``torch.optim`` skips them), non-finite gradients and the hyperparameter digest; the updates
   run per bucket after it, and a second exchange after the updates carries their errors. With
   ``overlap_updates=True`` gather and compute run *per bucket*, in the order the buckets'
   collectives were launched, so the step waits only for what it needs next:

   One vocabulary for the collectives (Megatron's): :meth:`start_grad_sync` / :meth:`finish_grad_sync`
   for a bucket's gradient collective, :meth:`finish_param_sync` for the parameter return.

   - :meth:`finish_grad_sync` (bucket ``i``): wait for that bucket's collective only (the wait is a
     phase of its own, ``canzona/dp/reduce_scatter/bucket<i>/wait`` or ``canzona/dp/all_reduce/bucket<i>/wait``
     inside the step, and its wall seconds are kept in :attr:`DPRuntime.bucket_wait_s`), average
     (sum, then divide by the DP size: exact for power-of-two DP sizes) and keep each owned
     piece's gradient slice;
   - :meth:`update_bucket` (bucket ``i``): point the bucket's owned masters' ``.grad`` at their
     slices, run the local optimizers on the fp32 master copies of what this rank owns *in that
     bucket* (``canzona/dp/local_update/bucket<i>``; no communication), then clear those ``.grad``
     so nothing is stepped twice. Per-parameter optimizers skip
     parameters whose ``.grad`` is None, so stepping one instance once per bucket with only that
     bucket's gradients set computes exactly what one step over all of them would (the TP engine
     steps its micro-groups the same way);
   - :meth:`compute_tp`: the TP micro-group engine for TP-split matrix parameters
     (:mod:`canzona.runtime.tp`; it talks only over the TP group). It runs once, after every
     bucket has arrived: its micro-groups mix parameters of several buckets, and the engine's
     fused exchanges need all of a group's gradients, so waiting for the buckets of each group
     separately would buy little and cost a second ordering contract;
   - parameter return, updated *values* (never deltas): ``layerwise`` broadcasts each
     parameter from its owner inside the step (``canzona/layerwise/broadcast``); ``sc`` moves
     nothing; the reduce-scatter strategies run one variable-size all-gather per bucket
     (``canzona/dp/all_gather/bucket<i>/launch`` and ``/wait``). A bucket with no TP-split piece
     on any rank (an *early* bucket) is final once its own update ran, so its all-gather is
     launched right then, inside the step, and travels while the later buckets update (the
     updates run in bucket order for this, and every rank launches the early buckets in that
     order). The other buckets' gathers leave after the TP engine and the second status
     exchange. ``param_sync="eager"`` (default) waits for all of them before ``step()`` returns;
     ``param_sync="lazy"`` leaves them in flight and a forward pre-hook on each module waits for
     its parameters' buckets only, so the gathers overlap the next forward bucket by bucket
     (:meth:`finish_param_sync` forces them, e.g. before reading parameters outside a forward);
   - :meth:`apply_params`: with ``param_views`` (default) the all-gather already wrote into the
     parameters, which are views of a per-bucket parameter buffer (:meth:`_init_param_views`): it
     only checks they still are (rebinding replaced storage) and bumps their version counters
     (``sc``: the update itself wrote into them, see *Masters* below); the parameters that cannot
     be views (a DTensor without a rebindable local tensor, another dtype than their bucket's,
     not contiguous: :attr:`copied_params`) and every parameter without views get the values
     copied in (``to_local()`` for DTensor). docs/runtime.md lists the copies that remain.

Overlap inside the step. While bucket ``i``'s update runs, the collectives of buckets ``> i`` are
still in flight wherever backward left them unfinished (typically the last buckets: they are
launched at the very end of backward).

- gloo (CPU): an async collective runs on the process group's worker thread, so
  ``work.wait()`` really blocks the calling thread and ``bucket_wait_s[i]`` is the time the step
  spent blocked on bucket ``i``. Bucket ``i``'s update on the main thread and the transfers of later
  buckets on the worker thread run concurrently as far as free CPU cores allow; with one core per
  rank (the tests) they mostly interleave, so the gain is that no update waits for the *last*
  bucket, not that communication becomes free.
- NCCL (GPU): ``work.wait()`` does not block the host; it makes the current CUDA stream wait for
  the collective's stream. Bucket ``i``'s update kernels are queued at once and start on the
  compute stream as soon as bucket ``i``'s reduction lands, while later buckets' reductions keep
  running on the NCCL stream: a true compute/communication overlap. The host-side wait phases are
  then near zero; the real waiting shows as compute-stream idle time in nsys (an optimizer that
  syncs the host, e.g. a finiteness check, moves that wait to its own bucket's update, never
  earlier).

An error raised by a local optimizer in bucket ``k`` leaves the owned parameters of buckets ``< k``
already updated on this rank's masters. The failing rank still launches every early bucket's
all-gather the others launch (sending what its masters hold), so no collective is left unmatched;
the second status exchange then raises the error on every rank, after every rank has launched the
remaining buckets' all-gathers too and all of them have landed: every rank holds the same
parameters, each equal to its owner's master (some of this step's updates, none of the failing
bucket's on the failing rank). Non-finite gradients never get that far: the first exchange
refuses them before any update or any gather.

Masters. With ``param_views`` (the default) a bucket whose parameter buffer is in the master
dtype (fp32 parameters) has no separate masters: each owned piece's master is its slot in the
buffer (:meth:`DPRuntime._master_slot`), so the update writes into the model and the all-gather
sends this rank's region in place. ``sc`` gets parameter buffers too (every rank owns every
slot), so its update happens in the model and nothing is copied back. bf16 buffers, TP-split
pieces and ``param_views=False`` keep separate fp32 masters, packed into the send buffer (or,
under ``sc``, copied into the parameters) per step.

Who updates what follows the plan exactly: a parameter with ``dp_owner == r`` is updated whole on
rank ``r``; a cut element-wise parameter's ``dp_ranges`` pieces are updated as flat pieces by their
ranks (exact for element-wise optimizers such as AdamW: each element's update depends only on that
element); ``sc`` updates everything everywhere. Per-parameter optimizers are independent across
parameters, so one optimizer instance over all owned matrix parameters (and one element-wise
instance over all owned pieces) computes exactly what one instance per parameter would.
``zero1`` is the communication reference of the paper: equal chunks that cut matrices, so every
parameter goes to the element-wise optimizer.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from canzona.optim import finite_grads_verified
from canzona.plan.plan import Plan
from canzona.runtime.hooks import RemovableHandle, UpdateHook, UpdateHooks
from canzona.runtime.agree import (
    HyperparameterMismatch,
    NonFiniteGradient,
    RankFailure,
    ReplicaGuard,
    agree,
    check_step_flags,
    nonfinite,
    status_group,
    step_flags,
)
from canzona.runtime.buffer import GradBuffer, is_plain, local_tensor
from canzona.runtime.comm import Comm
from canzona.runtime.phases import (
    PhaseTimer,
    phase,
    timing,
)
from canzona.settings import OptimizerSettings
from canzona.specs import expert_task_name

__all__ = [
    "DPRuntime",
    "HyperparameterMismatch",
    "NonFiniteGradient",
    "OptimizerFactory",
    "Piece",
    "StepState",
    "elementwise_role",
    "pieces_for_rank",
]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]

#: the param-group key marking the element-wise group stepped without weight decay
NO_DECAY = "canzona_no_weight_decay"


def elementwise_groups(masters: list[torch.Tensor], names: list[str], no_decay: frozenset[str]) -> list[Any]:
    """``masters`` (of parameters ``names``) as the element-wise optimizer's param groups: one
    plain list, or, when some belong to ``no_decay``, a group of the rest and a group of those
    with ``weight_decay=0`` (marked :data:`NO_DECAY`)."""
    off = [m for m, n in zip(masters, names) if n in no_decay]
    if not off:
        return masters
    on = [m for m, n in zip(masters, names) if n not in no_decay]
    return ([{"params": on}] if on else []) + [{"params": off, "weight_decay": 0.0, NO_DECAY: True}]


def update_groups(opt: torch.optim.Optimizer, values: Mapping[str, Any]) -> None:
    """Write ``values`` into every param group of ``opt``; a :data:`NO_DECAY` group keeps its 0
    weight decay."""
    for group in opt.param_groups:
        group.update({k: v for k, v in values.items() if k != "weight_decay"} if group.get(NO_DECAY) else values)

#: a plan role (canzona.plan.strategies.ROLES) -> the role of a runtime piece (and of checkpoint entries)
_PIECE_ROLE = {"matrix": "matrix", "tp-task": "tp", "elementwise": "elementwise", "experts": "matrix"}


@dataclass(frozen=True, slots=True)
class Piece:
    """A part of one parameter that this rank updates.

    ``start``/``end`` index the flattened TP-local shard; ``whole`` pieces cover it all and keep the
    shard's shape (matrix optimizers need it), cut pieces are flat. ``role`` is ``matrix`` (local
    matrix optimizer), ``tp`` (TP micro-group engine) or ``elementwise``. ``src`` is the piece's
    offset in the tensor its gradient arrives in: this rank's reduce-scatter shard of the bucket, or
    the whole bucket for all-reduce strategies. ``shape``, when set, is the matrix its master is
    (a view of the same elements): one ``(M, N)`` expert of an ``(E, M, N)`` stack (``expert`` its
    index), or the ``(out, in*kh*kw)`` matrix a conv weight reshapes to.
    """

    name: str
    bucket: int
    start: int
    end: int
    whole: bool
    role: str
    src: int
    shape: tuple[int, ...] | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def task(self) -> str:
        """The name the TP engine knows this piece by: the parameter's, or ``name[e]`` for one
        expert of a TP-split stack (each expert its own TP task)."""
        return self.name if self.expert is None or self.role != "tp" else expert_task_name(self.name, self.expert)


@dataclass(slots=True)
class StepState:
    """What one ``step()`` carries between its stages (:meth:`DPRuntime.begin_step` ...
    :meth:`DPRuntime.finish`): whether it reuses final gradients, this rank's flags and error,
    the parameters to skip, and the parameter all-gathers launched so far (bucket -> (receive
    buffer, work)) with the buckets already updated."""

    reuse: bool
    flags: torch.Tensor
    error: BaseException | None = None
    skip: frozenset[str] = frozenset()
    gathers: dict[int, tuple[torch.Tensor, Any]] = field(default_factory=dict)
    updated: set[int] = field(default_factory=set)


def elementwise_role(plan: Plan, name: str) -> bool:
    """Whether parameter ``name`` goes to the element-wise optimizer under ``plan`` (its plan role;
    every parameter under an element-wise-only strategy such as ``zero1``, which cuts matrices)."""
    return plan.param(name).role == "elementwise"


def pieces_for_rank(plan: Plan, dp_rank: int) -> list[Piece]:
    """What DP rank ``dp_rank`` updates under ``plan``, in buffer order."""
    out: list[Piece] = []
    for pp in plan.buffer_order():
        bucket = plan.buckets[pp.bucket]
        base = bucket.cuts[dp_rank] if bucket.reduce_scatter else 0
        role = _PIECE_ROLE[pp.role]
        if pp.role == "experts":
            out.extend(_expert_pieces(pp, dp_rank, base))
            continue
        if pp.replicated or pp.dp_owner == dp_rank:
            if pp.spec.kind == "matrix" and len(pp.spec.shape) > 2 and role == "matrix":  # an opted-in conv weight
                out.append(Piece(pp.name, pp.bucket, 0, pp.numel, True, role, pp.offset - base, shape=pp.spec.task_shape))
                continue
            out.append(Piece(pp.name, pp.bucket, 0, pp.numel, True, role, pp.offset - base))
            continue
        for r, s, e in pp.dp_ranges:
            if r == dp_rank:
                whole = s == 0 and e == pp.numel
                out.append(Piece(pp.name, pp.bucket, s, e, whole, role, pp.offset + s - base))
    return out


def _expert_pieces(pp: Any, dp_rank: int, base: int) -> list[Piece]:
    """One matrix piece per expert of an ``(E, M, N)`` stack that DP rank ``dp_rank`` updates (the
    whole stack when it owns it, the experts of its ranges when the plan cut the stack between
    experts): each its own ``(M, N)`` master, task and optimizer state. A TP-split stack's experts
    are TP pieces (this rank's ``(M, N)`` TP shard of each, for the TP engine's expert tasks)."""
    unit = pp.numel // pp.spec.shape[0]
    mine = [(0, pp.numel)] if pp.replicated or pp.dp_owner == dp_rank else [(s, e) for r, s, e in pp.dp_ranges if r == dp_rank]
    shape = tuple(pp.spec.local_task_shape)
    role = "tp" if pp.spec.tp_split else "matrix"
    return [
        Piece(pp.name, pp.bucket, k * unit, (k + 1) * unit, False, role, pp.offset + k * unit - base, shape=shape, expert=k)
        for s, e in mine
        for k in range(s // unit, e // unit)
    ]


def _bound_storage(p: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage a parameter view replaces: the parameter, or a DTensor's local tensor
    (its ``_local_tensor``; ``to_local()`` would add an autograd node per call)."""
    return p if is_plain(p) else p._local_tensor  # type: ignore[attr-defined]


def _bind(p: torch.Tensor, view: torch.Tensor) -> None:
    """Make ``view`` the storage of parameter ``p``: ``p.data = view`` for a plain tensor; for a
    DTensor its local tensor is replaced (the wrapper keeps its mesh, placements and global shape,
    and every DTensor op reads the local tensor, so forward, backward and in-place writes all go
    through the view). ``view`` has the local tensor's shape and strides (contiguous)."""
    with torch.no_grad():
        if is_plain(p):
            p.data = view
        else:
            p._local_tensor = view  # type: ignore[attr-defined]


class DPRuntime:
    """Executes one plan's DP side on this rank (see the module docstring for the phases).

    ``params`` maps plan names to the model's parameters. ``matrix_factory`` /
    ``elementwise_factory`` build a per-parameter optimizer over a list of master tensors.
    ``tp_engine_factory(local_masters)`` builds the TP micro-group engine over the fp32 TP-local
    masters of the TP-split matrix parameters this rank updates; it is required only when such
    parameters exist. ``settings`` (:class:`canzona.settings.OptimizerSettings`, validated when it
    was built) supplies the master dtype, the gradient reduction, parameter return, status timeout
    and the view and overlap options; None: the defaults.
    """

    def __init__(
        self,
        plan: Plan,
        params: Mapping[str, torch.Tensor],
        *,
        dp_comm: Comm,
        matrix_factory: OptimizerFactory,
        elementwise_factory: OptimizerFactory,
        tp_engine_factory: Callable[[dict[str, torch.Tensor]], Any] | None = None,
        settings: OptimizerSettings | None = None,
        grad_divisor: int | None = None,
        grad_contributes: bool = True,
    ) -> None:
        # the options were validated once, when the settings record was built
        settings = settings if settings is not None else OptimizerSettings()
        master_dtype, grad_reduce, param_sync = settings.master_dtype, settings.grad_reduce, settings.param_sync
        status_timeout_s, overlap_updates = settings.status_timeout_s, settings.overlap_updates
        param_views, grad_views = settings.param_views, settings.grad_views
        if dp_comm.size != plan.inputs.dp:
            raise ValueError(f"the plan is for dp={plan.inputs.dp} but the DP group has {dp_comm.size} ranks")
        self.plan = plan
        self.reduce_scatter = plan.reduce_scatter
        #: how updated values return: all-gather (reduce-scatter buckets), broadcast, none (every rank updates)
        self.param_return = plan.param_return
        self.comm = dp_comm
        self.dp_rank = dp_comm.rank
        self.dp = dp_comm.size
        self.grad_reduce = grad_reduce
        #: what a summed gradient is divided by under ``grad_reduce="mean"``: the DP size, or more
        #: when the gradients arriving here were already summed over other ranks (expert stacks
        #: under expert parallelism: the dispatch's all-to-all summed them over the EP ranks)
        self.grad_divisor = dp_comm.size if grad_divisor is None else int(grad_divisor)
        #: False: this rank's gradients are an equal copy of another group member's (expert stacks
        #: replicated over ``tp``, whose TP ranks saw the same tokens), so it sends them times zero
        #: (a non-finite value still shows) and the sum counts each copy once, bitwise as without it
        self.grad_contributes = bool(grad_contributes)
        self._zeroed: dict[int, torch.Tensor] = {}
        self.master_dtype = master_dtype
        #: element-wise parameters stepped without weight decay (:func:`elementwise_groups`)
        self.no_weight_decay = settings.no_weight_decay
        self.params = dict(params)
        self.specs = {pp.name: pp.spec for pp in plan.params}
        #: per-update hooks (shared with the TP engine); empty: the step only tests it
        self.update_hooks = UpdateHooks()
        # fixed by the plan, so computed once rather than per step
        self._order = list(plan.buffer_order())
        self._shard_sizes = [b.shard_sizes() for b in plan.buckets]
        #: phase timer the hook-launched collectives report to (the front end's ``phase_times``)
        self.timer: PhaseTimer | None = None
        self.buffer = GradBuffer(plan, self.params, dtype=master_dtype, on_ready=self.start_grad_sync, grad_views=grad_views)
        self.buffer.on_release = self._release
        self._warned_release = False
        #: bound (seconds) on waiting for the other ranks in the step's status exchanges
        self.status_timeout_s = float(status_timeout_s)
        #: the status exchanges run over the world (TP ranks included), counted with the DP traffic
        self.status_comm = Comm(status_group(), dp_comm.stats)
        #: update each bucket as soon as its collective lands, without the pre-update agreement
        self.overlap_updates = bool(overlap_updates)
        self._init_pieces(master_dtype)
        self._init_param_views(param_views)
        self._init_masters(master_dtype)
        self._init_optimizers(matrix_factory, elementwise_factory, tp_engine_factory)
        self._init_step_buffers(master_dtype)
        self._launched: list[int] = []  # bucket indices in collective launch order, this iteration
        self._tp_grads: dict[str, torch.Tensor] = {}
        #: this iteration's averaged gradient slice per owned (non-TP) piece, set by finish_grad_sync
        self._piece_grads: dict[Piece, torch.Tensor] = {}
        #: wall seconds the last step() spent blocked on each bucket's gradient collective
        self.bucket_wait_s: dict[int, float] = {}
        #: ``lazy``: parameter all-gathers launched by step() and finished by forward pre-hooks
        self.lazy = param_sync == "lazy" and self.reduce_scatter
        self._pending: dict[int, tuple[torch.Tensor, Any]] = {}
        self._hooks: list[Any] = []
        #: clip_grad_norm_ already finished and averaged every bucket (finish_grad_syncs): the next
        #: step() reuses them, as it reuses retained gradients
        self._grads_final = False
        self.steps = 0

    def _init_pieces(self, master_dtype: torch.dtype) -> None:
        """The pieces this rank owns, by bucket, and each bucket's dtype for returning values."""
        plan = self.plan
        self._param_names = [pp.name for pp in plan.params]
        self._param_index = {n: k for k, n in enumerate(self._param_names)}
        self.pieces = pieces_for_rank(plan, self.dp_rank)
        #: plan parameter index of each owned piece (the step's flags are per parameter)
        self._piece_param_index = torch.tensor([self._param_index[pc.name] for pc in self.pieces], dtype=torch.int64, device=self.buffer.data.device)
        self._whole_pieces = {pc.name: pc for pc in self.pieces if pc.whole}
        #: every owned piece per parameter (experts: one per expert), for writing values back
        self._owned_pieces: dict[str, list[Piece]] = {}
        for pc in self.pieces:
            self._owned_pieces.setdefault(pc.name, []).append(pc)
        self.pieces_by_bucket: list[list[Piece]] = [[] for _ in plan.buckets]
        for pc in self.pieces:
            self.pieces_by_bucket[pc.bucket].append(pc)
        # Values return in the model's dtype when a bucket holds one dtype (bf16 params: half the
        # bytes of fp32), else in the master dtype.
        self.gather_dtype: list[torch.dtype] = []
        for b in plan.buckets:
            dtypes = {local_tensor(self.params[n].detach()).dtype for n in b.params}
            self.gather_dtype.append(dtypes.pop() if len(dtypes) == 1 else master_dtype)

    def _init_masters(self, master_dtype: torch.dtype) -> None:
        """The master of every owned piece: its slot in the parameter buffer where it can alias
        one, else a copy of its values in ``master_dtype``."""
        self.masters: dict[Piece, torch.Tensor] = {}
        #: owned pieces whose master is their slot in the parameter buffer (see :meth:`_master_slot`)
        self.aliased_masters: set[Piece] = set()
        with torch.no_grad():
            for pc in self.pieces:
                local = local_tensor(self.params[pc.name].detach())
                slot = self._master_slot(pc, local)
                if slot is not None:
                    self.masters[pc] = slot
                    self.aliased_masters.add(pc)
                    continue
                if pc.whole:
                    m = local.to(master_dtype, copy=True)
                else:
                    m = local.reshape(-1)[pc.start : pc.end].to(master_dtype, copy=True)
                self.masters[pc] = m.contiguous() if pc.shape is None else m.contiguous().view(pc.shape)


    def _init_optimizers(
        self,
        matrix_factory: OptimizerFactory,
        elementwise_factory: OptimizerFactory,
        tp_engine_factory: Callable[[dict[str, torch.Tensor]], Any] | None,
    ) -> None:
        """The inner optimizers over the owned masters, their per-bucket local steps, the TP
        micro-group engine over the TP-split pieces, and the replica guard."""
        plan = self.plan
        def build(role: str, factory: OptimizerFactory) -> torch.optim.Optimizer | None:
            ts = [self.masters[pc] for pc in self.pieces if pc.role == role]
            if not ts:
                return None
            if role == "elementwise":
                return factory(elementwise_groups(ts, [pc.name for pc in self.pieces if pc.role == role], self.no_weight_decay))
            flipped = [self.masters[pc] for pc in self.pieces if pc.role == role == "matrix" and self.specs[pc.name].transposed]
            if not flipped:
                return factory(ts)
            # stored (in, out) weights (GPT-2's Conv1D): a param group the matrix optimizer reads
            # as "update the transpose" (the front end checked that its class understands it)
            ids = {id(t) for t in flipped}
            plain = [t for t in ts if id(t) not in ids]
            return factory(([{"params": plain}] if plain else []) + [{"params": flipped, "transposed": True}])

        self.matrix_opt = build("matrix", matrix_factory)
        self.elementwise_opt = build("elementwise", elementwise_factory)
        #: per bucket, the (optimizer, pieces, their masters) local steps :meth:`update_bucket` runs
        self._local_steps: list[list[tuple[torch.optim.Optimizer, list[Piece], list[torch.Tensor]]]] = []
        for pcs in self.pieces_by_bucket:
            steps = []
            for role, opt in (("matrix", self.matrix_opt), ("elementwise", self.elementwise_opt)):
                mine = [pc for pc in pcs if pc.role == role]
                if opt is not None and mine:
                    steps.append((opt, mine, [self.masters[pc] for pc in mine]))
            self._local_steps.append(steps)
        tp_masters = {pc.task: self.masters[pc] for pc in self.pieces if pc.role == "tp"}
        self.tp_engine: Any = None
        if tp_masters:
            if tp_engine_factory is None:
                raise NotImplementedError(
                    f"{len(tp_masters)} TP-split matrix parameters need the TP micro-group engine (canzona.runtime.tp)"
                )
            self.tp_engine = tp_engine_factory(tp_masters)
            self.tp_engine.update_hooks = self.update_hooks  # one registry for the whole step
        #: refuses steps after a failed update left per-rank replicas different (sc, sync TP schedule)
        self.replicas = ReplicaGuard(
            plan.every_rank_updates or (self.tp_engine is not None and self.tp_engine.sync),
            f"strategy {plan.inputs.strategy!r}" if plan.every_rank_updates else "the 'sync' TP schedule",
        )

    def _init_step_buffers(self, master_dtype: torch.dtype) -> None:
        """What every step reuses, reserved once: shards, scratch, gradient views, send buffers."""
        plan, dp_comm = self.plan, self.comm
        # Buckets whose values are final after their local update on every rank (no TP-split piece
        # anywhere in them): their all-gathers leave during the step, the others after the TP engine.
        tp_buckets = {pc.bucket for r in range(self.dp) for pc in pieces_for_rank(plan, r) if pc.role == "tp"}
        self._early_buckets = [i for i in range(len(plan.buckets)) if i not in tp_buckets]
        self._works: dict[int, Any] = {}
        # Reserved once: this rank's reduce-scatter shard of every bucket (the collective receives
        # into it every step), and each owned piece's gradient as a view into it (or into the
        # bucket itself under all-reduce), so the step only points ``.grad`` at a ready view.
        dev = self.buffer.data.device
        self._shards: dict[int, torch.Tensor] = (
            {i: torch.empty(s[self.dp_rank], dtype=master_dtype, device=dev) for i, s in enumerate(self._shard_sizes)}
            if self.reduce_scatter else {}
        )
        # Reserved once: where the gloo reduce-scatter receives every rank's slice of a bucket before
        # summing them into the shard (Comm.reduce_scatter_v); NCCL needs none.
        # All-reduce strategies on gloo with 3 or more ranks sum in rank order the same way
        # (Comm.all_reduce_in_rank_order), over even slices of the bucket.
        self._rs_scratch: dict[int, torch.Tensor] = {}
        for i in range(len(plan.buckets)):
            flat = self.buffer.bucket(i)
            if self.reduce_scatter:
                n = dp_comm.reduce_scatter_scratch(flat, self._shard_sizes[i])
            else:
                n = dp_comm.rank_order_scratch(flat)
            if n:
                self._rs_scratch[i] = torch.empty(n, dtype=flat.dtype, device=dev)
        self._grad_views: list[list[tuple[Piece, torch.Tensor]]] = [
            [(pc, self._grad_source(i)[pc.src : pc.src + pc.numel].view(self.masters[pc].shape)) for pc in pcs]
            for i, pcs in enumerate(self.pieces_by_bucket)
        ]
        # The all-gather's send buffer of every bucket (this rank's shard, in the gather dtype): its
        # own region of the parameter buffer when the bucket has one in the master dtype (the
        # aliased masters already hold their values there), else reserved once; the masters not
        # in it yet (TP-split pieces, a copy in another dtype) are packed into their slots.
        self._send: dict[int, torch.Tensor] = {}
        self._pack: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        if self.reduce_scatter:
            for i, s in enumerate(self._shard_sizes):
                pbuf = self._master_buffer(i)
                if pbuf is not None:
                    lo = self.plan.buckets[i].cuts[self.dp_rank]
                    buf = pbuf[lo : lo + s[self.dp_rank]]
                else:
                    buf = torch.empty(s[self.dp_rank], dtype=self.gather_dtype[i], device=dev)
                self._send[i] = buf
                todo = [pc for pc in self.pieces_by_bucket[i] if pc not in self.aliased_masters]
                self._pack[i] = ([buf[pc.src : pc.src + pc.numel] for pc in todo], [self.masters[pc].reshape(-1) for pc in todo])
        # sc (nothing returns): the parameters whose new value is not already in their storage
        # after the update, each with the tensor that holds it (its separate master, or its
        # master slot when the parameter could not become a view of it)
        self._sc_sources: list[tuple[Piece, torch.Tensor]] = (
            [(pc, self.masters[pc]) for pc in self.pieces if not (pc in self.aliased_masters and pc.name in self.param_views)]
            if self.param_return == "none" else []
        )

    def _init_param_views(self, enabled: bool) -> None:
        """``param_views`` (all-gather strategies, and ``sc``): one flat parameter buffer per bucket
        in the plan's geometry and the bucket's gather dtype, reserved once; the bucket's all-gather
        receives into it (``sc``: the masters that are slots are updated in it), and every
        parameter that can be (:meth:`view_refusal`) becomes a view of its slot (``p.data`` rebound
        once, here, after copying its value in), so the gather writes straight into the model. The
        others keep the copy out of the buffer."""
        #: bucket -> its flat parameter buffer (all-gather strategies and sc, with ``param_views``)
        self.param_buffers: dict[int, torch.Tensor] = {}
        #: parameter name -> its slot in :attr:`param_buffers`, which is the parameter's storage
        self.param_views: dict[str, torch.Tensor] = {}
        #: parameters whose updated values are still copied out of the parameter buffer, and why
        self.copied_params: dict[str, str] = {}
        #: how often a parameter whose storage was replaced was bound to its view again
        self.rebinds = 0
        self._warned_rebind = False
        n_buckets = len(self.plan.buckets)
        self._bucket_views: list[list[tuple[str, torch.Tensor, torch.Tensor]]] = [[] for _ in range(n_buckets)]
        self._bucket_viewed_params: list[list[torch.Tensor]] = [[] for _ in range(n_buckets)]
        #: per bucket, the storage address each viewed parameter must still have, and whether it
        #: is a plain tensor (else a DTensor, whose local tensor holds the storage)
        self._view_ptrs: list[list[int]] = [[] for _ in range(n_buckets)]
        self._view_plain: list[list[bool]] = [[] for _ in range(n_buckets)]
        self._copy_out: list[list[str]] = [list(b.params) for b in self.plan.buckets]
        if not (enabled and (self.reduce_scatter or self.param_return == "none")):
            return
        dev = self.buffer.data.device
        with torch.no_grad():
            for i, b in enumerate(self.plan.buckets):
                buf = torch.zeros(b.numel, dtype=self.gather_dtype[i], device=dev)
                self.param_buffers[i] = buf
                copy_out = []
                for n in b.params:
                    p, pp = self.params[n], self.plan.param(n)
                    local = local_tensor(p.detach())
                    # every slot starts with its parameter's value (an aliased master reads it there)
                    buf[pp.offset : pp.offset + pp.numel].copy_(local.reshape(-1))
                    why = self.view_refusal(p, buf)
                    if why:
                        self.copied_params[n] = why
                        copy_out.append(n)
                        continue
                    view = buf[pp.offset : pp.offset + pp.numel].view(local.shape)
                    _bind(p, view)
                    self.param_views[n] = view
                    self._bucket_views[i].append((n, p, view))
                    self._bucket_viewed_params[i].append(p)
                    self._view_ptrs[i].append(view.data_ptr())
                    self._view_plain[i].append(is_plain(p))
                self._copy_out[i] = copy_out

    def _master_buffer(self, i: int) -> torch.Tensor | None:
        """Bucket ``i``'s parameter buffer when it can hold the masters (it exists and is in the
        master dtype), else None. The one rule for both sides of the all-gather: masters become its
        slots (:meth:`_master_slot`), and this rank's region of it is the send buffer, so the
        masters that are slots are never packed."""
        buf = self.param_buffers.get(i)
        return buf if buf is not None and buf.dtype == self.master_dtype else None

    def _master_slot(self, pc: Piece, local: torch.Tensor) -> torch.Tensor | None:
        """Piece ``pc``'s slot in its bucket's parameter buffer, to be its fp32 master itself (as
        Megatron's distributed optimizer keeps views of fp32 parameters as their main copies), or
        None where the master stays a copy of its own: no parameter buffer (``param_views`` off,
        all-reduce strategies), a buffer in another dtype than the masters' (bf16 parameters with
        fp32 masters), or a TP-split piece (the TP engine owns those masters).

        The slot holds the parameter's value already (:meth:`_init_param_views`), the owner's update
        writes straight into it, the bucket's all-gather sends it from there without a pack copy,
        and no separate master is kept."""
        buf = self._master_buffer(pc.bucket)
        if buf is None or pc.role == "tp":
            return None
        off = self.plan.param(pc.name).offset
        slot = buf[off + pc.start : off + pc.end]
        if pc.shape is not None:
            return slot.view(pc.shape)
        return slot.view(local.shape) if pc.whole else slot

    @staticmethod
    def view_refusal(p: torch.Tensor, buf: torch.Tensor) -> str | None:
        """Why parameter ``p`` (for a DTensor: its local shard) cannot be a view of the parameter
        buffer ``buf`` (None: it can)."""
        if not is_plain(p) and not isinstance(getattr(p, "_local_tensor", None), torch.Tensor):
            return "DTensor without a local tensor canzona can rebind (this torch version)"
        local = local_tensor(p.detach())
        if local.dtype != buf.dtype:
            return f"dtype {local.dtype} differs from its bucket's gather dtype {buf.dtype} (a bucket of mixed dtypes)"
        if local.device != buf.device:
            return f"on {local.device}, the buffers on {buf.device}"
        if not local.is_contiguous():
            return "not contiguous (a view would change its strides, and with them the kernels that read it)"
        return None

    def _check_views(self, i: int) -> None:
        """Bucket ``i``'s viewed parameters must still be their views (one pointer compare each); a
        parameter whose storage was replaced (``p.data = ...``, ``vector_to_parameters``) is bound
        to its view again, which holds its updated value; one moved or cast is refused."""
        params = self._bucket_viewed_params[i]
        now = [p.data_ptr() if plain else p._local_tensor.data_ptr() for p, plain in zip(params, self._view_plain[i])]
        if now == self._view_ptrs[i]:
            return  # the common case: one address read per parameter, no per-parameter branch
        for n, p, view in self._bucket_views[i]:
            held = _bound_storage(p)
            if held.data_ptr() == view.data_ptr():
                continue
            if held.dtype != view.dtype or held.device != view.device or held.shape != view.shape:
                raise RuntimeError(
                    f"parameter {n} became {held.dtype} {tuple(held.shape)} on {held.device} after the optimizer was built "
                    f"(it was {view.dtype} {tuple(view.shape)} on {view.device}); move or cast the model before "
                    "building the DistributedOptimizer"
                )
            if not self._warned_rebind:
                self._warned_rebind = True
                warnings.warn(
                    f"parameter {n} no longer uses the optimizer's parameter buffer (its storage was replaced, "
                    "e.g. p.data = ...); canzona binds it to the buffer again, which holds its updated value "
                    "(warned once)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            _bind(p, view)
            self.rebinds += 1

    # --------------------------------------------------------------------------------- backward
    def attach(self) -> None:
        self.buffer.attach()

    def detach(self) -> None:
        self.buffer.detach()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def register_update_hook(self, hook: UpdateHook) -> RemovableHandle:
        """Call ``hook(name, param, optimizer)`` after each local step for every parameter this
        rank updated whole, before the value is sent (:mod:`canzona.runtime.hooks`); returns a
        handle whose ``remove()`` detaches it."""
        if self.tp_engine is not None and self.tp_engine.split:
            return self.tp_engine.register_update_hook(hook)  # refused: the split step updates no TP matrix whole
        return self.update_hooks.register(hook)

    def start_grad_sync(self, i: int) -> None:
        """Start bucket ``i``'s gradient collective without waiting (called by the buffer)."""
        ctx = timing(self.timer) if self.timer is not None else contextlib.nullcontext()
        with ctx:
            self._start_collective(i, self.buffer.bucket(i))

    def _start_collective(self, i: int, flat: torch.Tensor) -> None:
        if not self.grad_contributes:
            if self.reduce_scatter:  # out of place: the rank's own p.grad views keep their values
                out = self._zeroed.get(i)
                if out is None:
                    out = self._zeroed[i] = torch.empty_like(flat)
                flat = torch.mul(flat, 0, out=out)
            else:  # an all-reduce overwrites the bucket with the sum anyway
                flat.mul_(0)
        name = f"canzona/dp/reduce_scatter/bucket{i}/launch" if self.reduce_scatter else f"canzona/dp/all_reduce/bucket{i}/launch"
        with phase(name, bytes=flat.numel() * flat.element_size(), bucket=i, peers=self.dp):
            if self.reduce_scatter:
                _, work = self.comm.reduce_scatter_v(
                    flat, self._shard_sizes[i], out=self._shards[i], scratch=self._rs_scratch.get(i), async_op=True
                )
            else:
                work = self.comm.all_reduce_in_rank_order(flat, scratch=self._rs_scratch.get(i), async_op=True)
        self._works[i] = work
        self._launched.append(i)

    def wait_all(self) -> None:
        for i in sorted(self._works):
            w = self._works.pop(i)
            if w is not None:
                w.wait()

    def discard_grads(self) -> None:
        """Drop this iteration's gradients (zero_grad): finish in-flight collectives, zero the buffer."""
        self.wait_all()
        self._launched.clear()
        self._tp_grads.clear()
        self._piece_grads.clear()
        self._grads_final = False
        for m in self.masters.values():
            m.grad = None
        self.buffer.reset()

    def _release(self) -> None:
        """A gradient arrived after ``step()`` without ``zero_grad()``: drop the retained gradients."""
        if not self._warned_release:
            self._warned_release = True
            warnings.warn(
                "a backward pass after step() without zero_grad(): canzona starts a new gradient here "
                "(torch.optim would add it to the previous one); call zero_grad() after step()",
                RuntimeWarning,
                stacklevel=3,
            )
        self.discard_grads()

    # --------------------------------------------------------------------------------- step
    def step(self, digest: int = 0) -> None:
        """One optimizer step: gather every bucket, agree across ranks, update, TP engine, return values.

        Two status exchanges (:func:`canzona.runtime.agree.agree`, over the world group) bracket
        the updates, so an error on one rank is raised on every rank instead of leaving the others
        in a collective:

        1. after every bucket's gradient has arrived and before any state changes: any error so
           far, which parameters received a gradient on some rank (a parameter with none on every
           rank is skipped, as ``torch.optim`` skips ``p.grad is None``), which received
           gradients are non-finite (refused on every rank, naming them, nothing changed), and
           ``digest`` (the caller's hash of the hyperparameters; ranks that disagree are refused);
        2. after the local updates and the TP engine, before values return: any error raised there.

        The step is the composition of its stages (:meth:`begin_step`, :meth:`prepare`,
        :meth:`agree_flags`, :meth:`apply`, :meth:`agree_update`, :meth:`finish`), so that a
        runtime made of several DP runtimes (expert parallelism, :mod:`canzona.layouts.ep`) runs
        each stage on all of them and settles both exchanges once for all of them.

        The reduced gradients stay until ``zero_grad()`` (or the next backward, which drops them
        with a warning): a second ``step()`` without a new backward applies them again, as a
        single-device ``torch.optim`` optimizer applies an unchanged ``p.grad`` again.

        Under ``sc`` and the ``sync`` TP schedule, after an update that failed on some ranks only,
        further steps raise :class:`~canzona.runtime.agree.ReplicasDiverged` on every rank until a
        checkpoint is loaded (:class:`~canzona.runtime.agree.ReplicaGuard`)."""
        st = self.begin_step()
        with phase("canzona/optimizer/step"):
            self.prepare(st, digest)
            if not self.overlap_updates:
                self.agree_flags(st, self.step_names)
            self.apply(st)
            self.agree_update(st)
        self.finish(st)

    @property
    def step_names(self) -> list[str]:
        """The parameter names the step's flags are indexed by (:func:`~canzona.runtime.agree.step_flags`)."""
        return self._param_names

    def begin_step(self) -> StepState:
        """Stage 0, before the step's phase: refuse after diverged replicas, land pending parameter
        gathers, and decide whether this step reuses final gradients."""
        self.replicas.check("optimizer step")
        self.finish_param_sync()
        # reuse: the reduced gradients are final already (retained from a step, or finished by
        # clip_grad_norm_); a p.grad set since then takes the normal path (and its GradSyncError)
        reuse = (self.buffer.retained or self._grads_final) and not any(p.grad is not None for p in self.params.values())
        self._grads_final = False
        self.bucket_wait_s = {}
        return StepState(reuse, torch.zeros(2 * len(self._param_index) + 2, dtype=torch.int64))

    def prepare(self, st: StepState, digest: int) -> None:
        """Stage 1: land every bucket's gradient (averaged) and build this rank's step flags
        (``st.flags``); an error is kept in ``st.error``, never raised, so every rank still joins
        the exchange. Under ``overlap_updates`` each bucket is updated as soon as it lands."""
        try:
            if not st.reuse:
                if self.buffer.retained:
                    self._release()  # p.grad set directly after a step: a new gradient
                self.buffer.flush()
            order = self.launch_order()
            if self.overlap_updates:
                # each bucket's update as soon as its collective lands; no pre-update agreement
                for i in order:
                    self.finish_grad_sync(i, reuse=st.reuse)
                    self.update_bucket(i)
                    st.updated.add(i)
                    self._launch_ready_gathers(st.gathers, st.updated)
            else:
                if not st.reuse:
                    self._advance_grad_syncs(order)
                for i in order:
                    self.finish_grad_sync(i, reuse=st.reuse)
                st.flags = self._local_flags(digest)
        except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
            st.error = exc

    def agree_flags(self, st: StepState, names: list[str]) -> frozenset[str]:
        """The first status exchange over ``st.flags`` and ``st.error``; sets ``st.skip`` to the
        parameters no rank had a gradient for and returns it. On any refusal this runtime's
        gradients are dropped and the refusal raised (on every rank alike)."""
        try:
            reduced = agree(st.error, "optimizer step", flags=st.flags, comm=self.status_comm, timeout_s=self.status_timeout_s)
            assert reduced is not None
            st.skip = check_step_flags(reduced, names)
        except BaseException:
            self.discard_grads()
            raise
        return st.skip

    def apply(self, st: StepState) -> None:
        """Stage 2: the local updates in bucket order (each early bucket's all-gather launched as
        soon as it is final), then the TP engine. Errors go to ``st.error``; after one this rank
        still launches every early gather and joins the TP exchanges passively."""
        try:
            if st.error is not None:
                raise st.error
            if not self.overlap_updates:
                # bucket order, so each bucket's all-gather can leave as soon as it is updated;
                # the gradients were found finite on every rank in the exchange above, so
                # canzona's optimizers need not test them again
                with finite_grads_verified():
                    for i in range(len(self.plan.buckets)):
                        self.update_bucket(i, st.skip)
                        st.updated.add(i)
                        self._launch_ready_gathers(st.gathers, st.updated)
        except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
            st.error = exc
        # After an error this rank still launches every early all-gather the others launch (in
        # the same order), sending whatever its masters hold, so no collective is left unmatched.
        self._launch_ready_gathers(st.gathers, None)
        try:
            # Always: the other TP ranks wait in the engine's exchanges. After an error this rank
            # joins them without computing (its values are discarded by the exchange below).
            with finite_grads_verified() if not self.overlap_updates else contextlib.nullcontext():
                self.compute_tp(st.skip, passive=st.error is not None)
        except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
            st.error = st.error or exc

    def agree_update(self, st: StepState) -> None:
        """Stage 3: the second status exchange (errors of the updates), then the in-step parameter
        return (``layerwise``'s broadcast). A refusal lands the gathers (:meth:`update_failed`)
        before it is raised."""
        try:
            agree(st.error, "optimizer step (update)", comm=self.status_comm, timeout_s=self.status_timeout_s)
        except BaseException as exc:
            self.update_failed(st, exc)
            raise
        self.after_update()

    def after_update(self) -> None:
        """The parameter return that happens inside the step (``layerwise``'s broadcast)."""
        if self.param_return == "broadcast":
            self.broadcast_params()

    def update_failed(self, st: StepState, exc: BaseException) -> None:
        """The second exchange refused: every rank is here when it raised :class:`RankFailure`, so
        launch the remaining all-gathers too and land them all (every rank then holds the same
        parameters, each its owner's master; an aliased master already changed its owner's copy
        in place), drop the gradients and mark the replicas. After a timeout some rank is missing:
        only the gathers already launched are waited for."""
        if self.reduce_scatter and isinstance(exc, RankFailure):
            for i in range(len(self.plan.buckets)):
                if i not in st.gathers:
                    st.gathers[i] = self._pack_and_launch(i)
        self._finish_gathers(st.gathers)
        self.discard_grads()
        self.replicas.failed(exc)

    def finish(self, st: StepState) -> None:
        """Stage 4, after the step's phase: launch the remaining all-gathers (waited for now, or by
        the next forward under ``param_sync="lazy"``), keep the gradients for a repeated step."""
        if self.reduce_scatter:
            for i in range(len(self.plan.buckets)):
                if i not in st.gathers:
                    st.gathers[i] = self._pack_and_launch(i)
            if self.lazy:
                self._pending.update(st.gathers)
            else:
                self._finish_gathers(st.gathers)
        elif self.param_return == "none":
            self.apply_params({})
        self._tp_grads.clear()
        if self.buffer.received:
            self.buffer.retained = True  # a second step() re-applies them, as torch re-applies p.grad
        else:
            self.discard_grads()  # nothing to keep: the next backward starts afresh, silently
        self.steps += 1

    def _launch_ready_gathers(self, gathers: dict[int, tuple[torch.Tensor, Any]], updated: set[int] | None) -> None:
        """Launch the all-gather of every *early* bucket (no TP-split piece on any rank: its values
        are final once its local update ran) whose turn has come, in bucket order: the next early
        bucket not yet launched, as long as it is in ``updated`` (None: all of them, the
        error path). Every rank launches the same buckets in the same order, whatever its update
        order, so the gathers of the first buckets overlap the updates of the later ones."""
        if not self.reduce_scatter:
            return
        for i in self._early_buckets:
            if i in gathers:
                continue
            if updated is not None and i not in updated:
                return
            gathers[i] = self._pack_and_launch(i)

    def _finish_gathers(self, gathers: dict[int, tuple[torch.Tensor, Any]]) -> None:
        """Wait for ``gathers`` in bucket order and write each into the model."""
        for i in sorted(gathers):
            out, w = gathers.pop(i)
            self._wait_param_gather(i, w)
            self.apply_params({i: out})

    def _local_flags(self, digest: int) -> torch.Tensor:
        """:func:`~canzona.runtime.agree.step_flags` by plan parameter index: whether this rank
        received a gradient for each parameter and whether any gradient slice this rank will use is
        non-finite (a CPU tensor: reading the buckets' finiteness is its one device-to-host copy)."""
        n = len(self._param_index)
        received = torch.zeros(n, dtype=torch.int64)
        got = [self._param_index[name] for name in self.buffer.received]
        if got:
            received[got] = 1  # one indexed write, not one per parameter
        bad = torch.zeros(n, dtype=torch.int64)
        # Every gradient slice handed out is a view into its bucket's reduced region (the whole
        # bucket, or this rank's shard), so when every region is finite every slice is: one test per
        # bucket and one host read in the common case, instead of one per piece. A region with a
        # non-finite entry somewhere (maybe in a piece another rank owns) falls back to the test per
        # piece, so the flags are exactly those of the per-piece test in every case.
        if self.pieces and bool(nonfinite([self._grad_source(i) for i in range(len(self.plan.buckets))], self.buffer.data.device).any()):
            device = self.buffer.data.device
            used = [self._tp_grads.get(pc.task) if pc.role == "tp" else self._piece_grads.get(pc) for pc in self.pieces]
            # a parameter is non-finite when any of its pieces is (several cut pieces per parameter)
            bad = bad.to(device).index_add_(0, self._piece_param_index, nonfinite(used, device).to(torch.int64))
        return step_flags(digest, received, bad > 0)

    def launch_order(self) -> list[int]:
        """Buckets in the order their collectives were launched this iteration (after ``flush``: all)."""
        order = list(self._launched)
        if sorted(order) != list(range(len(self.plan.buckets))):
            # the buffer launches every bucket exactly once per iteration; anything else would skip
            # or double-step a bucket, so refuse rather than update from a partial gradient set
            raise RuntimeError(f"bucket collectives launched {order}, expected each of {len(self.plan.buckets)} buckets once")
        return order

    def _grad_source(self, i: int) -> torch.Tensor:
        return self._shards[i] if self.reduce_scatter else self.buffer.bucket(i)

    def _advance_grad_syncs(self, order: list[int]) -> None:
        """Collectives of two stages (the rank-order all-reduce on gloo,
        :meth:`~canzona.runtime.comm.Comm.all_reduce_in_rank_order`): land every bucket's first
        stage and launch its second, in launch order on every rank, so the second stages overlap
        each other instead of running one after another inside the waits."""
        for i in order:
            w = self._works.get(i)
            advance = getattr(w, "advance", None)
            if advance is not None:
                with phase(f"canzona/dp/reduce_scatter/bucket{i}/wait" if self.reduce_scatter else f"canzona/dp/all_reduce/bucket{i}/wait", bucket=i, peers=self.dp):
                    advance()

    def finish_grad_syncs(self) -> None:
        """Finish every bucket's gradient collective now (take pending gradients, launch what is
        left, wait, average), before ``step()``, which then reuses them: what
        ``clip_grad_norm_`` (:mod:`canzona.runtime.clip`) needs to see the reduced gradients.
        Retained gradients (a second call, or after a step without a new backward) are final already."""
        if (self._grads_final or self.buffer.retained) and not any(p.grad is not None for p in self.params.values()):
            return
        if self.buffer.retained:
            self._release()  # p.grad set directly after a step: a new gradient
        self.buffer.flush()
        order = self.launch_order()
        self._advance_grad_syncs(order)
        for i in order:
            self.finish_grad_sync(i)
        self._grads_final = True

    def reduced_grads(self) -> list[tuple[Piece, torch.Tensor]]:
        """Every owned piece with its reduced gradient (a view into its bucket's reduced region;
        TP-split pieces: this rank's TP shard), valid after :meth:`finish_grad_syncs`."""
        return [pg for views in self._grad_views for pg in views]

    def reduced_regions(self) -> list[torch.Tensor]:
        """The reduced gradient regions this rank holds: its shard of every bucket (the whole
        bucket under all-reduce strategies); scaling them scales every gradient the step uses."""
        return [self._grad_source(i) for i in range(len(self.plan.buckets))]

    def finish_grad_sync(self, i: int, *, reuse: bool = False) -> None:
        """Wait for bucket ``i``'s collective (only that one), average it, and keep each owned piece's
        gradient slice for :meth:`update_bucket` (TP-split pieces for :meth:`compute_tp`).
        ``reuse``: the bucket already arrived and was averaged in an earlier ``step()``; only
        hand the slices out again."""
        if not reuse:
            w = self._works.pop(i, None)
            # The wait is the collective's own ``/wait`` range (inside the step), so traces show per
            # bucket how long the step was blocked on it; on NCCL this is host time only (see module doc).
            t0 = time.perf_counter()
            with phase(f"canzona/dp/reduce_scatter/bucket{i}/wait" if self.reduce_scatter else f"canzona/dp/all_reduce/bucket{i}/wait", bucket=i, peers=self.dp):
                if w is not None:
                    w.wait()
            self.bucket_wait_s[i] = time.perf_counter() - t0
        src = self._grad_source(i)
        if not reuse and self.grad_reduce == "mean" and self.grad_divisor > 1:
            src.div_(self.grad_divisor)
        for pc, g in self._grad_views[i]:
            if pc.role == "tp":
                self._tp_grads[pc.task] = g
            else:
                self._piece_grads[pc] = g

    def update_bucket(self, i: int, skip: frozenset[str] = frozenset()) -> None:
        """Local optimizer math on the masters this rank owns in bucket ``i`` (no communication).

        Only this bucket's masters get a ``.grad`` (earlier buckets' were cleared, later ones' are
        not set yet), and per-parameter optimizers skip parameters without one, so each instance
        steps exactly this bucket's parameters; clearing the grads afterwards (also on error)
        keeps a later bucket's step from stepping them again. Parameters in ``skip`` (no gradient
        on any rank) get no ``.grad``, so the optimizer skips them as ``torch.optim`` does."""
        with phase(f"canzona/dp/local_update/bucket{i}"):
            grads = self._piece_grads
            for opt, mine, masters in self._local_steps[i]:
                try:
                    live = [(pc, m) for pc, m in zip(mine, masters) if pc.name not in skip] if skip else list(zip(mine, masters))
                    for pc, m in live:
                        m.grad = grads[pc]
                    if not live:
                        continue
                    if self.update_hooks:  # hooks see full values only: no cut or TP-sharded pieces
                        full = [(pc.name, m) for pc, m in live if pc.whole and not self.specs[pc.name].tp_split]
                        self.update_hooks.step(opt, full)
                    else:
                        opt.step()
                finally:
                    for m in masters:
                        m.grad = None

    def compute_tp(self, skip: frozenset[str] = frozenset(), *, passive: bool = False) -> None:
        """The TP micro-group engine over the TP-split matrix parameters this rank updates, once every
        bucket holding one has arrived (simplest: after all buckets; its groups span buckets).
        Parameters in ``skip`` had no gradient on any rank: their hosts do not step them.
        ``passive``: this rank already failed; it takes part in every exchange (zeros for missing
        gradients) but steps nothing, so its TP peers are not left waiting."""
        if self.tp_engine is None:
            return
        grads, self._tp_grads = self._tp_grads, {}
        if passive:
            grads = {n: grads.get(n, torch.zeros_like(m)) for n, m in self.tp_engine.local_masters.items()}
            skip = frozenset(self.tp_engine.local_masters) | skip
        self.tp_engine.step(grads, skip=skip)

    def _piece_dest(self, pc: Piece) -> torch.Tensor:
        """The part of the model's parameter (its local tensor) that piece ``pc``'s master holds,
        shaped like the master: the parameter itself, or one expert's ``(M, N)`` view of its stack."""
        local = local_tensor(self.params[pc.name].detach())
        if pc.shape is None:
            return local
        return local.view(-1)[pc.start : pc.end].view(pc.shape)

    def broadcast_params(self) -> None:
        """Params return by ``broadcast`` (``layerwise``): every owner sends its updated parameters to
        all DP ranks, inside the step."""
        works = []
        nbytes = 0
        with phase("canzona/layerwise/broadcast/launch", peers=self.dp), torch.no_grad():
            for pp in self._order:
                local = local_tensor(self.params[pp.name].detach())
                if pp.dp_owner == self.dp_rank:
                    for pc in self._owned_pieces[pp.name]:  # one piece, or one per expert of a stack
                        self._piece_dest(pc).copy_(self.masters[pc])
                    nbytes += local.numel() * local.element_size()
                works.append(self.comm.broadcast(local, pp.dp_owner, async_op=True))
        with phase("canzona/layerwise/broadcast/wait", bytes=nbytes, peers=self.dp):
            for w in works:
                if w is not None:
                    w.wait()

    def _pack_and_launch(self, i: int) -> tuple[torch.Tensor, Any]:
        sizes = self._shard_sizes[i]
        dtype = self.gather_dtype[i]
        es = dtype.itemsize
        with phase(f"canzona/dp/all_gather/bucket{i}/launch", bytes=sizes[self.dp_rank] * es, bucket=i, peers=self.dp):
            send = self._send[i]
            dst, src = self._pack[i]
            if dst:
                with torch.no_grad():
                    torch._foreach_copy_(dst, src)
            # into the parameter buffer (the viewed parameters' storage) when there is one
            return self.comm.all_gather_v(send, sizes, out=self.param_buffers.get(i), async_op=True)

    def _wait_param_gather(self, i: int, work: Any) -> None:
        with phase(f"canzona/dp/all_gather/bucket{i}/wait", bucket=i, peers=self.dp):
            if work is not None:
                work.wait()

    def finish_param_sync(self, buckets: Any = None) -> None:
        """Wait for pending parameter all-gathers (all, or ``buckets``) and write them into the model."""
        if not self._pending:
            return
        todo = {i: self._pending.pop(i) for i in (list(self._pending) if buckets is None else buckets) if i in self._pending}
        if not todo:
            return
        ctx = timing(self.timer) if self.timer is not None else contextlib.nullcontext()
        with ctx:
            self._finish_gathers(todo)

    def install_forward_hooks(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks that finish the pending all-gathers of a module's own parameters'
        buckets just before it runs, so later buckets' gathers overlap earlier modules' forward.

        A module may read a child's parameters without calling the child (``self.child.weight``
        inside its own forward): such parameters would be read stale. The root module's pre-hook
        therefore first finishes every bucket holding a parameter whose owning module did not run
        in the previous forward pass (all of them before the first observed forward)."""
        name_of = {id(t): n for n, t in self.params.items()}
        bucket_of = self.buffer.bucket_of
        owner_buckets: dict[int, tuple[int, ...]] = {}
        for module in model.modules():
            own = {bucket_of[name_of[id(p)]] for p in module.parameters(recurse=False) if id(p) in name_of}
            if own:
                owner_buckets[id(module)] = tuple(sorted(own))
        self._ran: set[int] = set()

        def root_hook(_m: torch.nn.Module, _a: Any) -> None:
            ran, self._ran = self._ran, set()
            unseen = {i for mid, bs in owner_buckets.items() if mid not in ran for i in bs}
            self.finish_param_sync(unseen)

        def module_hook(m: torch.nn.Module, _a: Any) -> None:
            self._ran.add(id(m))
            self.finish_param_sync(owner_buckets[id(m)])

        self._hooks.append(model.register_forward_pre_hook(root_hook))
        for module in model.modules():
            if id(module) in owner_buckets:
                self._hooks.append(module.register_forward_pre_hook(module_hook))

    def _views_written(self, i: int) -> None:
        """Bucket ``i``'s parameter buffer holds its viewed parameters' new values (the all-gather,
        or ``sc``'s update, wrote them there): check the parameters still use it
        (:meth:`_check_views`) and bump their version counters, as an in-place copy would."""
        if self._bucket_views[i]:
            self._check_views(i)
            torch._C._increment_version(self._bucket_viewed_params[i])

    def apply_params(self, gathered: Mapping[int, torch.Tensor]) -> None:
        """Write updated values into the model's parameters (in place; DTensor: the local shard)."""
        # one multi-tensor copy per call instead of a copy_ dispatch per parameter
        with torch.no_grad():
            if self.param_return == "none":
                # every rank updated everything: viewed parameters with their masters in their
                # slots hold the new values already; the rest get their values copied in
                for i in range(len(self._bucket_views)):
                    self._views_written(i)
                if self._sc_sources:
                    torch._foreach_copy_([self._piece_dest(pc) for pc, _ in self._sc_sources],
                                         [src for _, src in self._sc_sources])
                return
            for i, flat in gathered.items():
                self._views_written(i)  # the all-gather wrote into the viewed parameters' storage
                dst, src = [], []
                for n in self._copy_out[i]:
                    pp = self.plan.param(n)
                    local = local_tensor(self.params[n].detach())
                    dst.append(local)
                    src.append(flat[pp.offset : pp.offset + pp.numel].view(local.shape))
                if dst:
                    torch._foreach_copy_(dst, src)

    # --------------------------------------------------------------------------------- hyperparameters
    def set_hyperparams(self, role: str, values: Mapping[str, Any]) -> None:
        """Write ``values`` (e.g. a scheduled ``lr``) into every param group of the inner optimizers
        of ``role``: ``"matrix"`` (the local matrix optimizer and the TP hosts' optimizer) or
        ``"elementwise"``. Ranks without such an optimizer (``zero1`` has no matrix role) do nothing.
        Called by the front end at the start of each step; a few dict writes."""
        if role == "matrix":
            opts = (self.matrix_opt,)
        elif role == "elementwise":
            opts = (self.elementwise_opt,)
        else:
            raise ValueError(f"role must be 'matrix' or 'elementwise', got {role!r}")
        for opt in opts:
            if opt is not None:
                update_groups(opt, values)
        if role == "matrix" and self.tp_engine is not None:
            self.tp_engine.set_hyperparams(values)

    # --------------------------------------------------------------------------------- introspection
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.matrix_opt, self.elementwise_opt) if o is not None]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held on this rank (local optimizers and the TP engine)."""
        total = 0
        for opt in self.optimizers():
            for st in opt.state.values():
                for v in st.values():
                    if torch.is_tensor(v):
                        total += v.numel() * v.element_size()
        if self.tp_engine is not None:
            total += int(self.tp_engine.state_bytes())
        return total

    def master_bytes(self) -> int:
        """Bytes of masters this rank keeps apart from the model (aliased masters are parameter
        buffer slots, so they cost nothing extra)."""
        return sum(m.numel() * m.element_size() for pc, m in self.masters.items() if pc not in self.aliased_masters)
