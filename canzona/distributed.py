"""``canzona.DistributedOptimizer``: Canzona's runtime behind an ordinary optimizer interface.

Usage (every rank runs the same code)::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))   # or None: 1-D DP
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh,
                                       optimizer_kwargs={"lr": 0.02},
                                       elementwise_kwargs={"lr": 3e-4})
    for batch in data:
        loss(model(batch)).backward()   # hooks reduce-scatter each bucket as soon as it is complete
        opt.step()                      # owners update, values return; the model is updated
        opt.zero_grad()

What happens (the paper's Sections 3 and 4; see :mod:`canzona.runtime.dp` for the phases):

- Construction reads parameter specs from the model (:func:`canzona.specs.specs_from_module`,
  DTensor placements or ``tp_dims`` for Megatron-style plain shards), makes the plan
  (:func:`canzona.plan.make_plan`, or takes ``plan=``), checks on the world group that every rank
  holds the same plan fingerprint (any mismatch or failure raises on every rank, with a bounded
  wait), builds fp32 master copies of what this rank owns and registers the backward hooks.
- ``step()`` waits for the bucket collectives one bucket at a time, in launch order, and runs the
  optimizer on that bucket's owned masters as soon as its collective has arrived (matrix
  parameters whole; element-wise parameters whole or as flat pieces), while later buckets are
  still in flight; then it runs the TP micro-group engine for TP-split matrix parameters and
  returns updated values to every rank. Parameter
  return is *eager* by default (``param_sync="eager"``): when ``step()`` returns, every model
  parameter holds its new value. ``param_sync="lazy"`` (reduce-scatter strategies) launches the
  per-bucket all-gathers asynchronously at the end of ``step()`` and waits for each bucket in a
  forward pre-hook of the first module that uses it, overlapping the gathers with the next
  forward; parameters read outside a forward need ``opt.finish_param_sync()`` first.
- Gradients live in the ZeRO-1 buffer, not in ``p.grad`` (the hooks move them there and free
  ``p.grad`` once every other hook on the parameter has run: hooks registered before or after
  canzona's, e.g. transformers' TP-plan gradient all-reduce, see ``p.grad`` set and canzona takes
  what they leave; :mod:`canzona.runtime.buffer`); ``zero_grad()`` discards them. Gradients
  assigned directly to ``p.grad`` (no backward) are taken in at ``step()``. For gradient accumulation wrap all but the last
  micro-batch in ``opt.no_sync()``. By default autograd accumulates straight into the buffer and the
  parameters are views of a parameter buffer the all-gather writes into (``grad_views``,
  ``param_views``; docs/runtime.md lists the copies that remain).
- Missing gradients follow ``torch.optim``: a parameter without a gradient on every rank is
  skipped (agreed across ranks in the step's first status exchange), ``step()`` without a
  backward changes nothing, and a second ``step()`` after one backward re-applies the same
  reduced gradient (docs/robustness.md). ``overlap_updates=True`` trades these checks for the
  per-bucket pipeline (each bucket updated as soon as its collective lands).
- Errors reach every rank: construction, ``step()``, ``state_dict()`` and checkpoint loads join
  small status exchanges (:mod:`canzona.runtime.agree`, each bounded by ``status_timeout_s``), so
  an exception on one rank is raised on all of them within seconds, naming the rank; non-finite
  gradients are refused on every rank before any state changes; ranks whose replicas or
  hyperparameters differ are refused.
- Gradients are averaged over DP (``grad_reduce="mean"``: sum, then divide by the DP size, exact
  when it is a power of two) or summed (``"sum"``).

Learning-rate schedules: ``DistributedOptimizer`` is a ``torch.optim.Optimizer`` with two
parameter groups, ``opt.param_groups[0]`` (``"name": "matrix"``) and ``opt.param_groups[1]``
(``"name": "elementwise"``), so ``torch.optim.lr_scheduler`` (``LambdaLR``, ``CosineAnnealingLR``,
``LinearLR``, ``SequentialLR`` ...) drives it as it drives any torch optimizer::

    sched = torch.optim.lr_scheduler.LambdaLR(opt, [matrix_schedule, elementwise_schedule])
    ...
    opt.step(); sched.step(); opt.zero_grad()

The groups hold the model's trainable parameters by role (``"param_names"`` lists their names) and
carry ``lr`` and, where the optimizer class has one, ``weight_decay``; at the start of every
``step()`` those values are written into every inner optimizer of the role: the DP owner's matrix
and element-wise optimizers and the TP hosts' matrix optimizer. Other hyperparameters (betas,
momentum ...) are fixed at construction (schedulers that cycle momentum refuse this optimizer,
since its ``defaults`` name none). ``zero1`` runs the element-wise optimizer on every parameter, so
its ``"matrix"`` group is empty and its values reach no optimizer. The scheduler's own state
(``sched.state_dict()``) is the user's to save; ``opt.state_dict()`` holds the groups' current
``lr``/``weight_decay`` (in its ``"hyper"`` section) and ``opt.load_state_dict`` restores them.

``optimizer`` is a name (``muon``, ``shampoo``, ``soap``: :mod:`canzona.optim`; ``adamw``) or any
per-parameter ``torch.optim.Optimizer`` subclass (e.g. ``torch.optim.Muon``); element-wise
parameters (embeddings, output head, norms, biases) get ``elementwise_optimizer`` (AdamW by
default). ``zero1`` cuts matrices at equal chunks, so it runs the element-wise optimizer on every
parameter and accepts only an element-wise ``optimizer`` (``"adamw"``): it is the paper's
communication reference, not a way to run Muon.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.optimizers import ELEMENTWISE_DEFAULT, cost_key_for_class, get_optimizer, optimizer_names
from canzona.plan.plan import Plan, PlanInputs
from canzona.plan.strategies import get_strategy, strategy_names
from canzona.runtime.agree import STATUS_TIMEOUT_S, RankFailure, agree, mark_arrival, missing_ranks, new_tag, status_group
from canzona.runtime.buffer import local_tensor
from canzona.runtime.checkpoint import GROUP_NAMES, SCHEDULED_KEYS, Held, ModelPiece, ParamRecord, flat_range_boxes, inner_hyperparams, whole_box
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.dp import DPRuntime, OptimizerFactory, elementwise_role
from canzona.runtime.integrity import tensor_checksum
from canzona.runtime.phases import PhaseTimer, timing
from canzona.specs import ParamSpec, specs_from_module

__all__ = [
    "GROUP_NAMES",
    "NAMED_OPTIMIZERS",
    "SCHEDULED_KEYS",
    "DistributedOptimizer",
    "ParamWatch",
    "check_per_parameter",
    "exchange_fingerprints",
    "resolve_optimizer",
    "scheduled_hyperparams",
]

#: Optimizers known not to keep per-parameter state (they cannot run on a subset of parameters).
_NOT_PER_PARAMETER: tuple[str, ...] = ("LBFGS",)
FINGERPRINT_TIMEOUT_S = 60.0


#: the registered optimizer names (:mod:`canzona.optimizers`) at import time
NAMED_OPTIMIZERS: tuple[str, ...] = optimizer_names()


def resolve_optimizer(optimizer: Any, what: str = "optimizer") -> type[torch.optim.Optimizer]:
    """The optimizer class for a name or class; TypeError for instances and non-optimizers."""
    if isinstance(optimizer, str):
        try:
            return get_optimizer(optimizer).load()
        except ValueError:
            raise ValueError(
                f"unknown {what} {optimizer!r}; choose one of {', '.join(optimizer_names())} or pass a torch.optim.Optimizer subclass"
            ) from None
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"{what} must be an optimizer class or name, not an instance ({type(optimizer).__name__}): "
            "DistributedOptimizer builds its own instances over the parameters each rank owns"
        )
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(f"{what} must be a torch.optim.Optimizer subclass or one of {', '.join(NAMED_OPTIMIZERS)}, got {optimizer!r}")
    if optimizer.__name__ in _NOT_PER_PARAMETER:
        raise TypeError(
            f"{optimizer.__name__} is not a per-parameter optimizer (it keeps one state for all parameters "
            "and needs a closure), so it cannot run on the subset of parameters each rank owns"
        )
    return optimizer


def check_per_parameter(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any], what: str = "optimizer") -> None:
    """Probe ``cls`` on two small matrices: it must step without a closure and key its state by
    parameter (one entry per parameter with a gradient, or none at all for stateless optimizers).
    Canzona runs the optimizer on the parameters one rank owns, which is exact only then."""
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(4, 3, generator=g), torch.randn(3, 5, generator=g)]
    init = [p.clone() for p in ps]
    grads = [torch.randn(p.shape, generator=g) for p in ps]
    for p, gr in zip(ps, grads):
        p.grad = gr.clone()
    opt = cls(ps, **dict(kwargs))
    try:
        opt.step()
    except Exception as exc:  # noqa: BLE001 - any failure here means it is not a plain per-parameter step
        raise TypeError(
            f"{what} {cls.__name__} cannot take a plain per-parameter step without a closure "
            f"({type(exc).__name__}: {exc}); DistributedOptimizer needs a per-parameter torch.optim.Optimizer"
        ) from None
    keys = list(opt.state.keys())
    if keys and (len(keys) != len(ps) or any(all(k is not p for p in ps) for k in keys)):
        raise TypeError(f"{what} {cls.__name__} does not keep its state per parameter, so it cannot run on a subset of parameters")
    # The runtime steps one instance once per bucket (and per TP micro-group) with only that
    # bucket's gradients set; that must equal one step over all of them, bit for bit. A counter or
    # other per-call state kept in param_groups would break it, so probe it: twice, to reach state.
    whole = [t.detach().clone() for t in init]
    split = [t.detach().clone() for t in init]
    opt_w, opt_s = cls(whole, **dict(kwargs)), cls(split, **dict(kwargs))
    for _ in range(2):
        for p, gr in zip(whole, grads):
            p.grad = gr.clone()
        opt_w.step()
        for p, gr in zip(split, grads):
            p.grad = gr.clone()
            opt_s.step()
            p.grad = None
    if any(not torch.equal(a, b) for a, b in zip(whole, split)):
        raise TypeError(
            f"{what} {cls.__name__} gives different results when stepped once per subset of its parameters "
            "(per-call state outside the per-parameter state?); DistributedOptimizer steps it once per bucket"
        )


def scheduled_hyperparams(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`SCHEDULED_KEYS` values ``cls(params, **kwargs)`` puts in its param group (its own
    defaults filled in), read from a throw-away instance over one small tensor."""
    group = cls([torch.zeros(4, 3)], **dict(kwargs)).param_groups[0]
    return {k: group[k] for k in SCHEDULED_KEYS if k in group}


def exchange_fingerprints(
    fingerprint: str | None, *, device: torch.device, timeout_s: float = FINGERPRINT_TIMEOUT_S, comm: Comm | None = None
) -> list[str | None]:
    """All-gather every rank's 16-hex plan fingerprint (None: that rank failed to plan) on the world
    group (or ``comm``'s group), waiting at most ``timeout_s``; returns them by rank. Goes through
    :class:`~canzona.runtime.comm.Comm` so its bytes are counted like every other collective. Each
    rank first marks its arrival in the process group's store, so a timeout names the ranks that
    never came. Once every rank has arrived, the status exchanges' group is settled
    (:func:`canzona.runtime.agree.status_group`; making a gloo group for an NCCL-only world is a
    collective, so it comes at this fixed point of every rank's construction, after the exchange
    has shown all ranks present)."""
    buf = torch.zeros(17, dtype=torch.uint8, device=device)
    if fingerprint is not None:
        raw = fingerprint.encode("ascii")[:16]
        buf[0] = 1
        buf[1 : 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    comm = comm if comm is not None else Comm(None)
    tag = new_tag("fingerprint")
    mark_arrival(tag)
    out, work = comm.all_gather_equal(buf, async_op=True)
    ok = True
    if work is not None:
        try:
            ok = work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # gloo raises on timeout
            if "timed out" not in str(exc).lower():
                raise
            ok = False
    if not ok:
        missing = missing_ranks(tag)
        who = f"rank(s) {missing} never joined it" if missing else "some rank never joined it"
        raise RuntimeError(
            f"plan fingerprint exchange did not complete within {timeout_s:g} s: {who} "
            "(every rank must build the DistributedOptimizer; a rank that died, hangs or skipped it stops the others here)"
        )
    status_group()
    fps: list[str | None] = []
    for t in out.view(comm.size, 17):
        vals = t.cpu().tolist()
        fps.append(bytes(vals[1:]).rstrip(b"\0").decode("ascii") if vals[0] else None)
    return fps


class ParamWatch:
    """The parameters a model had when its plan was made, checked at every ``step()``.

    The full test compares ``(name, id, shape, dtype)`` of every ``named_parameters()`` entry, a
    walk over every module (about 1.5 ms at 500 parameters). The quick test (0.45 ms), tried
    first, reads the same facts from what it saved: every module's parameter and child dicts
    (same sizes, the same objects under the same names) and every parameter's shape and dtype. A
    parameter or module added, removed or replaced by any means shows in those dicts, and a
    tensor swapped in through ``p.data`` shows in the shape or dtype, so when the quick test
    passes the full one would too; when it fails, the full test decides (and, passing, saves the
    new layout)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.signature = self._signature()
        self._save()

    def _signature(self) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
        return [(n, id(p), tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()]

    def _save(self) -> None:
        self._tree = [(m, tuple(m._parameters.items()), tuple(m._modules.items())) for m in self.model.modules()]
        self._params = [(p, p.shape, p.dtype) for _, p in self.model.named_parameters()]

    def _same(self) -> bool:
        try:
            for m, params, children in self._tree:
                now_p, now_c = m._parameters, m._modules
                if len(now_p) != len(params) or len(now_c) != len(children):
                    return False
                for k, v in params:
                    if now_p.get(k) is not v:
                        return False
                for k, c in children:
                    if now_c.get(k) is not c:
                        return False
        except (AttributeError, TypeError):  # dicts of another kind (a TorchScript module's): the full test decides
            return False
        return all(p.shape == shape and p.dtype is dtype for p, shape, dtype in self._params)

    def parameters(self) -> list[torch.Tensor] | Iterator[torch.Tensor]:
        """The model's parameters now (the saved list while the model is unchanged)."""
        return [p for p, _, _ in self._params] if self._same() else self.model.parameters()

    def check(self) -> None:
        """RuntimeError naming what changed when the model's parameters differ from the plan's."""
        if self._same():
            return
        now = self._signature()
        if now == self.signature:
            self._save()
            return
        before = {n: s for n, *s in self.signature}
        after = {n: s for n, *s in now}
        added = sorted(set(after) - set(before))
        removed = sorted(set(before) - set(after))
        changed = sorted(n for n in set(before) & set(after) if before[n] != after[n])
        raise RuntimeError(
            "the model's parameters changed after the plan was made "
            f"(added {added}, removed {removed}, replaced or reshaped {changed}); "
            "build a new DistributedOptimizer for the new parameters"
        )


def _plain(value: Any) -> Any:
    """``value`` with everything but numbers, strings and containers of them replaced by the type
    name: a stable form to compare across processes (a function's repr holds its address)."""
    if isinstance(value, Mapping):
        return sorted((str(k), _plain(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() <= 16:
        return value.detach().cpu().tolist()
    return type(value).__name__


class DistributedOptimizer(torch.optim.Optimizer):
    """Run a per-parameter optimizer under ZeRO-1 DP (and TP) exactly, with a Canzona plan.

    See the module docstring for the semantics.

    Why a ``torch.optim.Optimizer`` subclass rather than a duck type: every torch LR scheduler
    checks ``isinstance(optimizer, torch.optim.Optimizer)`` in its constructor, and ``Optimizer``
    is a plain class (no ABC registration, no ``__subclasshook__``), so a duck type would have to
    fake ``__class__``. Subclassing is the honest way, and ``Optimizer.__init__`` builds exactly the
    ``param_groups`` schedulers edit. What it brings and how it is used:

    - ``param_groups``: two groups, ``"matrix"`` and ``"elementwise"`` (see the module docstring);
      ``step()`` pushes their ``lr``/``weight_decay`` into the inner optimizers before updating.
      ``add_param_group`` is refused: the parameters are fixed by the plan.
    - ``step`` is wrapped by ``Optimizer`` (``profile_hook_step``: a ``record_function`` named
      ``Optimizer.step#DistributedOptimizer.step`` around it, and the step pre/post hooks of
      ``register_step_pre_hook``/``register_step_post_hook``); a scheduler additionally wraps it per
      instance to set ``_opt_called``, which only records that ``step()`` ran (its "step order"
      warning). Neither touches what ``step()`` computes.
    - ``state`` stays empty: the optimizer state lives in the inner optimizers, per owner;
      ``state_dict``/``load_state_dict``/``zero_grad`` are this class's own (consolidated,
      plan-independent documents; the ``Optimizer`` state-dict hooks are not called).
    - ``defaults`` is empty: each group carries its own values.
     Attributes: ``plan`` (the frozen
    :class:`~canzona.plan.plan.Plan`), ``comm_stats`` (:class:`~canzona.runtime.comm.CommStats`,
    bytes per rank per phase; cleared after construction), ``phase_times``
    (:class:`~canzona.runtime.phases.PhaseTimer` of the phases this object opens, accumulated
    across steps), ``dp_rank``/``tp_rank``/``dp``/``tp``, ``runtime`` (the
    :class:`~canzona.runtime.dp.DPRuntime`), ``steps``, ``status_timeout_s``.

    Robustness arguments (docs/robustness.md): ``status_timeout_s`` bounds every wait for the other
    ranks in canzona's status exchanges (plan fingerprints, replica check, the step's two
    exchanges, checkpoint save/load; default 60 s); ``overlap_updates=True`` updates each bucket as
    soon as its collective lands instead of after the step's first exchange, giving up the
    torch-style skipping of parameters without a gradient and the pre-update non-finite check.

    Copies (docs/runtime.md): ``param_views=True`` (default) makes every parameter of the
    all-gather strategies (``zero1``, ``asc``, ``lb-asc``, ``lb-asc-joint``) a view of a flat
    parameter buffer in the plan's geometry, so the all-gather writes straight into the model
    (``p.data`` is rebound once, at construction; for a DTensor parameter its local tensor;
    parameters whose dtype differs from their bucket's, or that are not contiguous, keep the copy,
    listed in ``runtime.copied_params``).
    ``grad_views=True`` (default) lets autograd accumulate the gradients of plain parameters of the
    master dtype straight into the gradient buffer. Both are exact (the same values bit for bit);
    False restores the copies.
    """

    def __new__(cls, model: Any = None, *args: Any, **kwargs: Any) -> DistributedOptimizer:
        """A model holding FSDP2 (``fully_shard``) modules gets the FSDP2 engine
        (:class:`canzona.fsdp.FSDPDistributedOptimizer`, a subclass); any other the ZeRO-1 path."""
        if cls is DistributedOptimizer:
            from canzona.fsdp import FSDPDistributedOptimizer, is_fsdp2_model

            if is_fsdp2_model(model):
                return super().__new__(FSDPDistributedOptimizer)
        return super().__new__(cls)

    def __init__(
        self,
        model: nn.Module,
        optimizer: str | type[torch.optim.Optimizer] = "muon",
        *,
        strategy: str = "lb-asc",
        mesh: Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        elementwise_optimizer: str | type[torch.optim.Optimizer] = torch.optim.AdamW,
        elementwise_kwargs: Mapping[str, Any] | None = None,
        tp_schedule: str | None = None,
        tp_dims: Mapping[str, int | None] | None = None,
        bucket_numel: int | None = None,
        alpha: float = 1.0,
        cost: str = "numel",
        cmax_mb: float = 512,
        master_dtype: torch.dtype = torch.float32,
        grad_reduce: str = "mean",
        param_sync: str = "eager",
        plan: Plan | None = None,
        status_timeout_s: float = STATUS_TIMEOUT_S,
        overlap_updates: bool = False,
        param_views: bool = True,
        grad_views: bool = True,
    ) -> None:
        # ---- checks that every rank makes identically, before any collective
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        try:
            record = get_strategy(strategy)
        except ValueError as exc:  # a PlanError: a user's bad argument is a plain ValueError here
            raise ValueError(str(exc)) from None
        if grad_reduce not in ("mean", "sum"):
            raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {grad_reduce!r}")
        if param_sync not in ("eager", "lazy"):
            raise ValueError(f"param_sync must be 'eager' or 'lazy', got {param_sync!r}")
        if master_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"master_dtype must be torch.float32 or torch.float64, got {master_dtype}")
        for flag, value in (("param_views", param_views), ("grad_views", grad_views)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be True or False, got {value!r}")
        if not (isinstance(status_timeout_s, (int, float)) and 0 < status_timeout_s < float("inf")):
            raise ValueError(f"status_timeout_s must be a positive number of seconds, got {status_timeout_s!r}")
        self.status_timeout_s = float(status_timeout_s)
        matrix_cls = resolve_optimizer(optimizer, "optimizer")
        ew_cls = resolve_optimizer(elementwise_optimizer, "elementwise_optimizer")
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.elementwise_kwargs = dict(elementwise_kwargs or {})
        if record.elementwise_only and matrix_cls is not ew_cls and matrix_cls is not torch.optim.AdamW:
            others = ", ".join(n for n in strategy_names() if not get_strategy(n).elementwise_only)
            raise ValueError(
                f"{strategy} cuts matrices at equal chunks, so it can only run an element-wise optimizer; got {matrix_cls.__name__}. "
                f"Use optimizer='adamw' or a strategy that keeps matrices whole ({others}) for matrix optimizers"
            )
        check_per_parameter(matrix_cls, self.optimizer_kwargs, "optimizer")
        if ew_cls is not matrix_cls or self.elementwise_kwargs != self.optimizer_kwargs:
            check_per_parameter(ew_cls, self.elementwise_kwargs, "elementwise_optimizer")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        world = dist.get_world_size()
        first = next(iter(model.parameters()), None)
        if first is None:
            raise ValueError("the model has no parameters")
        meta = [n for n, p in model.named_parameters() if local_tensor(p.detach()).is_meta]
        if meta:
            raise ValueError(
                f"the model has {len(meta)} parameter(s) on the meta device (e.g. {meta[0]}): they hold no values; "
                "materialize and initialize them (model.to_empty(device=...) then your init) before building the optimizer"
            )
        device = local_tensor(first).device
        mesh = self._check_mesh(mesh, world, device)
        self.mesh = mesh
        names = mesh.mesh_dim_names or ("dp",)
        self.dp = mesh.size(names.index("dp"))
        self.tp = mesh.size(names.index("tp")) if "tp" in names else 1
        self.dp_rank = mesh.get_local_rank("dp") if mesh.ndim > 1 else dist.get_rank(mesh.get_group())
        self.tp_rank = mesh.get_local_rank("tp") if "tp" in names else 0
        self.model = model
        self.strategy = strategy
        self.matrix_cls, self.elementwise_cls = matrix_cls, ew_cls
        self.master_dtype = master_dtype

        # ---- specs and plan; a failure on some ranks only surfaces through the fingerprint exchange
        err: Exception | None = None
        fp: str | None = None
        try:
            # frozen parameters (requires_grad=False) are not the optimizer's: no buffer slot, no owner
            trainable = {n for n, p in model.named_parameters() if p.requires_grad}
            specs = [s for s in specs_from_module(model, tp_dims=tp_dims, tp=self.tp) if s.name in trainable]
            if not specs:
                raise ValueError("the model has no trainable parameters")
            if plan is None:
                plan = self._make_plan(specs, matrix_cls, strategy, tp_schedule, bucket_numel, alpha, cost, cmax_mb, master_dtype)
            else:
                self._check_given_plan(plan, specs, strategy)
            fp = plan.fingerprint
        except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange below
            # Whatever went wrong here, this rank enters the fingerprint exchange (with None) before
            # re-raising: skipping it would leave the other ranks waiting, or pair their exchange with
            # a later collective of this rank.
            err = exc
        fps = exchange_fingerprints(fp, device=device, timeout_s=self.status_timeout_s)
        failed = [r for r, f in enumerate(fps) if f is None]
        if failed:
            # every rank learns the failing ranks' messages (the failing rank re-raises its own error)
            try:
                agree(err, "building the plan", timeout_s=self.status_timeout_s)
            except RankFailure as exc:
                if err is not None:
                    raise err from None
                raise RankFailure("building the plan (no rank proceeds)", exc.failures) from None
        assert err is None
        if len(set(fps)) != 1:
            groups: dict[str, list[int]] = {}
            for r, f in enumerate(fps):
                groups.setdefault(str(f), []).append(r)
            raise RuntimeError(f"plan fingerprints differ across ranks: {groups}; every rank must plan the same model with the same inputs")
        assert plan is not None
        self.plan = plan
        self._init_param_groups(model, plan, matrix_cls, ew_cls)
        self._check_replicas(model, device)
        # every rank's optimizer arguments, folded into the per-step hyperparameter digest
        self._kwargs_repr = repr((_plain(self.optimizer_kwargs), _plain(self.elementwise_kwargs)))

        # ---- runtime
        self.comm_stats = CommStats()
        self.phase_times = PhaseTimer()
        dp_group = mesh.get_group("dp") if mesh.ndim > 1 else mesh.get_group()
        self.dp_comm = Comm(dp_group, self.comm_stats)
        self.tp_comm = Comm(mesh.get_group("tp"), self.comm_stats) if self.tp > 1 else None
        named = dict(model.named_parameters())
        self._watch = ParamWatch(model)
        params = {p.name: named[p.name] for p in plan.params}
        self.runtime = DPRuntime(
            plan,
            params,
            dp_comm=self.dp_comm,
            matrix_factory=self._factory(matrix_cls, self.optimizer_kwargs),
            elementwise_factory=self._factory(ew_cls, self.elementwise_kwargs),
            tp_engine_factory=self._tp_engine_factory(),
            master_dtype=master_dtype,
            grad_reduce=grad_reduce,
            param_sync=param_sync,
            status_timeout_s=self.status_timeout_s,
            overlap_updates=overlap_updates,
            param_views=param_views,
            grad_views=grad_views,
        )
        self.runtime.timer = self.phase_times
        self.runtime.attach()
        if self.runtime.lazy:
            self.runtime.install_forward_hooks(model)
        self.comm_stats.reset()

    # ------------------------------------------------------------------------------ construction
    def _init_param_groups(
        self, model: nn.Module, plan: Plan, matrix_cls: type[torch.optim.Optimizer], ew_cls: type[torch.optim.Optimizer]
    ) -> None:
        """``Optimizer.__init__`` over the plan's parameters, split by the role their inner
        optimizer has (under ``zero1`` every parameter is element-wise, the matrix group empty)."""
        planned = {pp.name for pp in plan.params}
        hyper = {
            "matrix": scheduled_hyperparams(matrix_cls, self.optimizer_kwargs),
            "elementwise": scheduled_hyperparams(ew_cls, self.elementwise_kwargs),
        }
        members: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name in GROUP_NAMES}
        for n, p in model.named_parameters():
            if n in planned:
                members["elementwise" if elementwise_role(plan, n) else "matrix"].append((n, p))
        groups = [{"name": name, "params": [p for _, p in members[name]], **hyper[name]} for name in GROUP_NAMES]
        self._groups_fixed = False
        super().__init__(groups, {})
        self._groups_fixed = True
        # set here, not through (name, tensor) pairs: Optimizer refuses to mix a named group with an
        # empty (hence unnamed) one, and zero1's matrix group is empty
        for group in self.param_groups:
            group["param_names"] = [n for n, _ in members[group["name"]]]
        self._scheduled = {name: tuple(hyper[name]) for name in GROUP_NAMES}

    def _check_replicas(self, model: nn.Module, device: torch.device) -> None:
        """Replicas must start equal: every DP rank's copy of each parameter (its TP-local shard)
        is compared through a 62-bit checksum of its bytes (one all-reduce over the world group,
        once). Different seeds or a skipped broadcast are refused on every rank, naming the
        parameters; under ``sc`` they would otherwise stay different forever."""
        planned = [pp.name for pp in self.plan.params]
        named = dict(model.named_parameters())
        n = len(planned)
        lowest = torch.iinfo(torch.int64).min
        flags = torch.full((self.tp, n, 2), lowest, dtype=torch.int64)
        for k, name in enumerate(planned):
            c = tensor_checksum(local_tensor(named[name].detach()))
            flags[self.tp_rank, k, 0], flags[self.tp_rank, k, 1] = c, -c
        reduced = agree(None, "checking parameter replicas", flags=flags.reshape(-1), timeout_s=self.status_timeout_s)
        assert reduced is not None
        r = reduced.cpu().view(self.tp, n, 2)
        differ = sorted({planned[k] for t in range(self.tp) for k in range(n) if int(r[t, k, 0]) != -int(r[t, k, 1])})
        if differ:
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            raise RuntimeError(
                f"parameter values differ across DP ranks at construction: {', '.join(differ[:3])}{more}; "
                "every DP rank must start from the same model (same seed, or broadcast the parameters first)"
            )

    def _digest(self) -> int:
        """62-bit hash of this rank's hyperparameters (the groups' scheduled values, exact float
        reprs, and the optimizers' constructor arguments); compared across ranks at every step."""
        vals = [(g["name"], [(k, g[k]) for k in self._scheduled[g["name"]]]) for g in self.param_groups]
        raw = repr((vals, self._kwargs_repr)).encode()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & ((1 << 62) - 1)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: the plan fixed who owns which parameter."""
        if getattr(self, "_groups_fixed", False):
            raise TypeError(
                "DistributedOptimizer's parameter groups are fixed by its plan (\"matrix\", \"elementwise\"); "
                "build a new DistributedOptimizer for other parameters"
            )
        super().add_param_group(param_group)

    def _push_hyperparams(self) -> None:
        """Write each group's scheduled hyperparameters into the inner optimizers of its role (a few
        dict writes; every rank holds the same groups, so every inner optimizer sees the same values)."""
        for group in self.param_groups:
            name = group["name"]
            self.runtime.set_hyperparams(name, {k: group[k] for k in self._scheduled[name]})

    @staticmethod
    def _check_mesh(mesh: Any, world: int, device: torch.device) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if mesh is None:
            return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed DeviceMesh (or None for 1-D DP), got {type(mesh).__name__}")
        if mesh.size() != world:
            raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {world}; the mesh must cover the whole world")
        names = mesh.mesh_dim_names
        if names is not None and "dp_shard" in names:
            raise ValueError(
                f"the mesh {names} names FSDP2 dimensions but the model holds no fully_shard module; shard the model "
                "with fully_shard first, or use a ('dp',) / ('dp', 'tp') mesh for canzona's own ZeRO-1 path"
            )
        if mesh.ndim == 1 and names not in (None, ("dp",)):
            raise ValueError(f"a 1-D mesh must be named ('dp',), got {names}")
        if mesh.ndim > 1 and (names is None or "dp" not in names or set(names) - {"dp", "tp"} or mesh.ndim != 2):
            raise ValueError(f"a 2-D mesh needs dimensions named ('dp', 'tp'), got {names}")
        return mesh

    def _make_plan(
        self,
        specs: list[ParamSpec],
        matrix_cls: type[torch.optim.Optimizer],
        strategy: str,
        tp_schedule: str | None,
        bucket_numel: int | None,
        alpha: float,
        cost: str,
        cmax_mb: float,
        master_dtype: torch.dtype,
    ) -> Plan:
        from canzona.plan import default_bucket_numel, default_tp_schedule, make_plan

        inputs = PlanInputs(
            model=type(self.model).__name__,
            layout="module",
            dp=self.dp,
            tp=self.tp,
            # the registry's cost key of the class (classes it does not know are costed as Muon); an
            # element-wise-only strategy runs every parameter through the element-wise optimizer
            optimizer=ELEMENTWISE_DEFAULT if get_strategy(strategy).elementwise_only else cost_key_for_class(matrix_cls),
            strategy=strategy,
            tp_schedule=tp_schedule or default_tp_schedule(strategy),
            bucket_numel=bucket_numel if bucket_numel is not None else default_bucket_numel(self.dp),
            alpha=alpha,
            cost=cost,
            cmax_bytes=max(1, int(cmax_mb * 2**20)),
            grad_bytes=torch.empty((), dtype=master_dtype).element_size(),
        )
        return make_plan(specs, inputs)

    def _check_given_plan(self, plan: Plan, specs: list[ParamSpec], strategy: str) -> None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a canzona Plan, got {type(plan).__name__}")
        if plan.inputs.dp != self.dp or plan.inputs.tp != self.tp:
            raise ValueError(f"the plan is for dp={plan.inputs.dp} x tp={plan.inputs.tp}, the mesh is dp={self.dp} x tp={self.tp}")
        if plan.inputs.strategy != strategy:
            raise ValueError(f"the plan is for strategy {plan.inputs.strategy!r}, not {strategy!r}")
        if {s.name: s for s in plan.specs} != {s.name: s for s in specs}:
            raise ValueError("the plan was made for other parameters than this model's (names, shapes, kinds or TP splits differ)")

    def _factory(self, cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> OptimizerFactory:
        kw = dict(kwargs)
        return lambda ts: cls(ts, **kw)

    def _tp_engine_factory(self) -> Any:
        if self.tp == 1:
            return None
        from canzona.runtime.tp import TPEngine

        factory = self._factory(self.matrix_cls, self.optimizer_kwargs)
        plan, dp_rank, comm = self.plan, self.dp_rank, self.tp_comm
        return lambda masters: TPEngine(plan, dp_rank=dp_rank, comm=comm, optimizer_factory=factory, local_masters=masters)

    def _check_params_unchanged(self) -> None:
        self._watch.check()

    # ------------------------------------------------------------------------------ torch-like API
    def step(self, closure: Any = None) -> Any:
        """Wait for gradients, update owned parameters, return values to every rank (eager)."""
        if closure is not None:
            raise TypeError("DistributedOptimizer.step does not take a closure (per-parameter optimizers only)")
        self._check_params_unchanged()
        self._push_hyperparams()
        with timing(self.phase_times):
            self.runtime.step(self._digest())
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard gradients: the buffer's, and every ``p.grad`` of the model, which becomes None or,
        with ``set_to_none=False``, is zeroed in place as ``torch.optim.Optimizer.zero_grad`` does
        (detached from its graph first)."""
        with timing(self.phase_times):
            self.runtime.discard_grads()
        for p in self._watch.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the reduced gradients (collective: every rank,
        between ``backward()`` and ``step()``); returns the total norm. See :mod:`canzona.runtime.clip`."""
        from canzona.runtime.clip import clip_zero1

        with timing(self.phase_times):
            return clip_zero1(self.runtime, self.tp_rank, max_norm, norm_type, error_if_nonfinite, foreach)

    def finish_param_sync(self) -> None:
        """``param_sync="lazy"``: wait for the pending parameter all-gathers now (the forward does it
        bucket by bucket otherwise); call before reading parameters outside a forward pass."""
        with timing(self.phase_times):
            self.runtime.finish_param_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over micro-batches without launching collectives."""
        with self.runtime.buffer.no_sync():
            yield

    def register_update_hook(self, hook: Any) -> Any:
        """Call ``hook(name, param, optimizer)`` on the rank that computed it, for every parameter
        updated whole, right after its update and before the value is sent to the other ranks
        (``param``: the full-shape master; ``optimizer``: the inner optimizer holding its state).
        An optional ``hook.before_update`` with the same signature runs just before the update.
        Returns a handle; ``handle.remove()`` detaches the hook. See :mod:`canzona.runtime.hooks`
        (e.g. :class:`~canzona.runtime.hooks.UpdateNormLog`)."""
        return self.runtime.register_update_hook(hook)

    @property
    def steps(self) -> int:
        return self.runtime.steps

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (local optimizers plus hosted TP tasks)."""
        return self.runtime.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        """The consolidated optimizer state (collective: call on every rank; rank 0 gets it, other
        ranks an empty dict). Format: :mod:`canzona.runtime.checkpoint`.

        The groups' current ``lr``/``weight_decay`` (a scheduler may have changed them since the last
        ``step()``) are pushed into the inner optimizers first, so the document's ``"hyper"`` section
        holds them. A scheduler's own state is not included: save ``sched.state_dict()`` beside it.
        ``canzona.runtime.checkpoint.save_checkpoint`` / ``load_checkpoint`` go through these methods."""
        from canzona.runtime.checkpoint import consolidated_state_dict

        self.finish_param_sync()
        self._push_hyperparams()
        return consolidated_state_dict(self)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load a consolidated state (every rank passes the whole document); re-shards to this layout.

        The groups' ``lr``/``weight_decay`` and the inner optimizers' other hyperparameters are
        restored from the document's ``"hyper"`` section
        (:func:`canzona.runtime.checkpoint.restore_hyperparams`); a group the document has no values
        for keeps its own. Load a scheduler's state after this."""
        from canzona.runtime.checkpoint import load_consolidated_state_dict

        self.finish_param_sync()
        load_consolidated_state_dict(self, state)

    # ------------------------------------------------------------------------------ checkpoint source
    # What canzona.runtime.checkpoint and canzona.runtime.dcp read (their Checkpointable protocol).
    def checkpoint_params(self) -> list[ParamRecord]:
        return [ParamRecord(s.name, tuple(s.shape), s.kind, s.tp_dim, elementwise_role(self.plan, s.name)) for s in self.plan.specs]

    def checkpoint_describe(self) -> dict[str, Any]:
        from dataclasses import fields

        inp = self.plan.inputs
        return {
            "engine": "dp",
            "strategy": inp.strategy,
            "dp": inp.dp,
            "tp": inp.tp,
            "fingerprint": self.plan.fingerprint,
            "plan_inputs": {f.name: getattr(inp, f.name) for f in fields(inp)},
        }

    def _tp_box(self, spec: ParamSpec, box: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """A box of this rank's TP-local shard of ``spec`` in the full tensor's coordinates."""
        if not spec.tp_split:
            return box
        off = list(box[0])
        off[spec.tp_dim] += self.tp_rank * spec.local_shape[spec.tp_dim]  # type: ignore[index]
        return tuple(off), box[1]

    def held(self) -> list[Held]:
        rt = self.runtime
        # every DP rank holds the same values under sc: DP rank 0's copy is canonical
        replica = rt.plan.every_rank_updates and rt.dp_rank != 0
        out: list[Held] = []
        for pc in rt.pieces:
            spec = rt.specs[pc.name]
            region = tuple(self._tp_box(spec, b) for b in flat_range_boxes(tuple(spec.local_shape), pc.start, pc.end))
            m = rt.masters[pc]
            opt = {"elementwise": rt.elementwise_opt, "matrix": rt.matrix_opt}.get(pc.role)
            # replicated across TP: TP rank 0's copy is canonical
            canonical = not replica and (spec.tp_split or self.tp_rank == 0)
            out.append(Held(pc.name, region, m, opt, m if opt is not None else None, pc.role == "elementwise", canonical))
        eng = rt.tp_engine
        if eng is not None:
            # TP hosts hold each task's full state (its full master is re-assembled from the shards);
            # under the sync schedule every TP rank holds it: TP rank 0's is canonical
            for name in eng.hosted:
                canonical = not replica and (not eng.sync or self.tp_rank == 0)
                out.append(Held(name, (whole_box(rt.specs[name].shape),), None, eng.optimizer, eng.masters[name], False, canonical))
        return out

    def model_pieces(self) -> list[ModelPiece]:
        rt = self.runtime
        return [
            ModelPiece(name, local_tensor(p.detach()), self._tp_box(rt.specs[name], whole_box(rt.specs[name].local_shape)))
            for name, p in rt.params.items()
        ]

    def hyperparams(self) -> dict[str, dict[str, Any]]:
        inner = getattr(self, "_inner_hyper", None)
        if inner is None:
            inner = self._inner_hyper = {
                "matrix": inner_hyperparams(self.matrix_cls, self.optimizer_kwargs),
                "elementwise": inner_hyperparams(self.elementwise_cls, self.elementwise_kwargs),
            }
        return {g["name"]: {**inner[g["name"]], **{k: g[k] for k in self._scheduled[g["name"]]}} for g in self.param_groups}

    def status_device(self) -> torch.device:
        return self.runtime.buffer.data.device

    def finish_load(self, steps: int) -> None:
        rt = self.runtime
        if rt.tp_engine is not None:
            rt.tp_engine.refresh_masters()  # hosts re-assemble their full masters from the loaded shards
        rt.steps = int(steps)
        rt.discard_grads()
        rt.replicas.clear()  # every rank holds the loaded state

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({self.matrix_cls.__name__} + {self.elementwise_cls.__name__}, strategy={self.strategy!r}, "
            f"dp={self.dp}, tp={self.tp}, plan={self.plan.fingerprint})"
        )
