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

One class for every layout. The model says which (:func:`canzona.layouts.choose_layout`): a
model holding FSDP2 ``fully_shard`` modules gets the FSDP2 layout
(:mod:`canzona.layouts.fsdp2`: FSDP2 reduces the gradients into ``p.grad``, matrices are hosted
over the shard group), any other model canzona's ZeRO-1 buffer layout (:mod:`canzona.layouts.zero1`),
described below. This module holds what every layout shares: the argument checks and the
:class:`~canzona.settings.OptimizerSettings` record, the optimizer probes, the plan-fingerprint
agreement, the parameter groups, the hyperparameter check, push and digest, and the torch
optimizer and checkpoint interfaces. Invariant: whatever this class raises during construction or
``step()`` before a collective, it raises on every rank alike, or through a status exchange.

What happens on the ZeRO-1 buffer layout (the paper's Sections 3 and 4; see
:mod:`canzona.runtime.dp` for the phases):

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
(``sched.state_dict()``) is the user's to save; ``opt.state_dict()`` and
``opt.consolidated_state_dict()`` hold the groups' current ``lr``/``weight_decay`` and
``opt.load_state_dict`` restores them.

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

from canzona.layouts import choose_layout
from canzona.layouts.base import Layout
from canzona.optimizers import get_optimizer, optimizer_names
from canzona.plan.strategies import FSDP_STRATEGIES, get_strategy
from canzona.runtime.agree import STATUS_TIMEOUT_S, RankFailure, agree, mark_arrival, missing_ranks, new_tag, status_group
from canzona.runtime.buffer import local_tensor
from canzona.runtime.checkpoint import GROUP_NAMES, SCHEDULED_KEYS, Held, ModelPiece, ParamRecord, inner_hyperparams
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.dp import OptimizerFactory
from canzona.runtime.phases import PhaseTimer, timing
from canzona.settings import OptimizerSettings, check_hyperparams

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


#: the piecewise probe (:func:`check_piecewise`): a tensor of this many elements, cut into pieces of
#: :data:`PROBE_PIECE` (shorter than any CPU vector, so every piece is a kernel's scalar tail while
#: the whole tensor runs its vector body), stepped :data:`PROBE_STEPS` times
PROBE_NUMEL, PROBE_PIECE, PROBE_STEPS = 256, 7, 2
#: optimizers and arguments that passed the probe in this process (it is the same answer every time)
_PIECEWISE_OK: set[tuple[Any, ...]] = set()


def check_piecewise(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any], what: str, *, device: torch.device,
                    dtype: torch.dtype) -> None:
    """Refuse an element-wise optimizer whose update of a piece of a tensor is not, bit for bit,
    those elements of the update of the whole tensor: canzona updates the pieces each rank holds
    (a ZeRO-1 bucket's cut, an FSDP2 shard), so its result would silently differ from the
    single-device optimizer's. Probed on ``device`` in the masters' ``dtype``: a tensor of
    :data:`PROBE_NUMEL` elements against the same values in pieces of :data:`PROBE_PIECE`.

    What it catches on this package's CPUs (torch 2.13; 7 to 79 of the probe's parameter and state elements differ after two
    steps): the fused CPU kernels of Adam, AdamW and SGD (``fused=True``), whose vector body uses
    fused multiply-adds that their scalar tail does not; in bfloat16, SGD with Nesterov momentum,
    fused Adagrad and ASGD. Plain and ``foreach`` Adam/AdamW in float32 and bfloat16 pass. The
    parameters and their state tensors are compared (about 65 elements differ under fused AdamW).
    A pass is remembered for the process."""
    key = (cls, repr(sorted(kwargs.items())), str(device), dtype)
    if key in _PIECEWISE_OK:
        return
    g = torch.Generator().manual_seed(1)
    init = torch.randn(PROBE_NUMEL, generator=g).to(device=device, dtype=dtype)
    grads = [torch.randn(PROBE_NUMEL, generator=g).to(device=device, dtype=dtype) for _ in range(PROBE_STEPS)]
    whole = init.clone()
    pieces = [p.clone() for p in init.split(PROBE_PIECE)]
    opt_w, opt_p = cls([whole], **dict(kwargs)), cls(pieces, **dict(kwargs))
    for gr in grads:
        whole.grad = gr.clone()
        for p, gp in zip(pieces, gr.split(PROBE_PIECE)):
            p.grad = gp.clone()
        opt_w.step()
        opt_p.step()
    # the state too (an element-wise optimizer's state tensors are shaped like its parameter): a
    # moment that differs in its last bit often leaves a small step's parameter unchanged
    differ = int((whole != torch.cat(pieces)).sum())
    for entry, value in opt_w.state[whole].items():
        if isinstance(value, torch.Tensor) and value.shape == whole.shape:
            parts = [opt_p.state[p].get(entry) for p in pieces]
            if all(isinstance(v, torch.Tensor) and v.shape == p.shape for v, p in zip(parts, pieces)):
                differ += int((value != torch.cat(parts)).sum())
    if differ:
        hint = ("drop fused=True (torch's fused CPU kernels compute a tensor's last elements on another code path)"
                if kwargs.get("fused") else "use master_dtype=torch.float32 or another optimizer" if dtype != torch.float32
                else "use another optimizer or other arguments")
        raise TypeError(
            f"{what} {cls.__name__} with {dict(kwargs)} updates a piece of a tensor differently from the same elements of the "
            f"whole tensor ({differ} elements of the parameter and its state after {PROBE_STEPS} steps, {dtype} on {device.type}); canzona "
            f"updates the pieces each rank holds, so the result would not be bitwise the single-device optimizer's: {hint}")
    _PIECEWISE_OK.add(key)


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
    walk over every module. The quick test, a few times cheaper and tried first, reads the same facts from what it saved: every module's parameter and child dicts
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
    """Run a per-parameter optimizer exactly under ZeRO-1 DP (and TP) or on an FSDP2 model, with a Canzona plan.

    See the module docstring for the semantics. One class serves every layout: the model decides
    which (:func:`canzona.layouts.choose_layout`; canzona's ZeRO-1 buffer for plain and DTensor-TP
    models, :class:`~canzona.layouts.fsdp2.FSDP2Layout` for ``fully_shard`` models), and the layout
    object (``opt.layout``) holds what differs; everything else is written here once.

    Why a ``torch.optim.Optimizer`` subclass rather than a duck type: every torch LR scheduler
    checks ``isinstance(optimizer, torch.optim.Optimizer)`` in its constructor, and ``Optimizer``
    is a plain class (no ABC registration, no ``__subclasshook__``), so a duck type would have to
    fake ``__class__``. Subclassing is the honest way, and ``Optimizer.__init__`` builds exactly the
    ``param_groups`` schedulers edit. What it brings and how it is used:

    - ``param_groups``: two groups, ``"matrix"`` and ``"elementwise"`` (see the module docstring);
      ``step()`` checks their ``lr``/``weight_decay`` and pushes them into the inner optimizers
      before updating. ``add_param_group`` is refused: the parameters are fixed by the plan.
    - ``step`` is wrapped by ``Optimizer`` (``profile_hook_step``: a ``record_function`` named
      ``Optimizer.step#DistributedOptimizer.step`` around it, and the step pre/post hooks of
      ``register_step_pre_hook``/``register_step_post_hook``); a scheduler additionally wraps it per
      instance to set ``_opt_called``, which only records that ``step()`` ran (its "step order"
      warning). Neither touches what ``step()`` computes.
    - ``state`` stays empty: the optimizer state lives in the inner optimizers, per owner;
      ``state_dict``/``load_state_dict``/``zero_grad`` are this class's own (consolidated,
      plan-independent documents; the ``Optimizer`` state-dict hooks are not called).
    - ``defaults`` is empty: each group carries its own values.

    Attributes: ``layout`` (the :class:`~canzona.layouts.base.Layout`), ``settings`` (the
    :class:`~canzona.settings.OptimizerSettings` built from the keywords), ``plan`` (the layout's
    frozen plan: a :class:`~canzona.plan.plan.Plan`, for either layout),
    ``runtime`` (the layout's step engine: :class:`~canzona.runtime.dp.DPRuntime` or
    :class:`~canzona.runtime.shard.FSDPRuntime`), ``comm_stats``
    (:class:`~canzona.runtime.comm.CommStats`, bytes per rank per phase; cleared after
    construction), ``phase_times`` (:class:`~canzona.runtime.phases.PhaseTimer` of the phases this
    object opens, accumulated across steps), ``mesh``, ``steps``, ``strategy``, ``matrix_cls``,
    ``elementwise_cls``, ``status_timeout_s``; and the layout's own sizes and ranks (ZeRO-1:
    ``dp``, ``tp``, ``dp_rank``, ``tp_rank``; FSDP2: ``dp``, ``tp``, ``tp_rank``, ``replica``,
    ``group_rank``, ``group_size``), forwarded from ``opt.layout``.

    Robustness arguments (docs/robustness.md): ``status_timeout_s`` bounds every wait for the other
    ranks in canzona's status exchanges (plan fingerprints, replica check, the step's two
    exchanges, checkpoint save/load; default 60 s), on every layout, and on an FSDP2 model on gloo
    also the waits of FSDP2's own all-gathers and reduce-scatters (``bound_fsdp_collectives=True``,
    the default; False leaves them to the process group's timeout); ``overlap_updates=True``
    (ZeRO-1) updates each bucket as soon as its collective lands instead of after the step's first
    exchange, giving up the torch-style skipping of parameters without a gradient and the
    pre-update non-finite check.

    Copies (ZeRO-1, docs/runtime.md): ``param_views=True`` (default) makes every parameter of the
    all-gather strategies (``zero1``, ``asc``, ``lb-asc``, ``lb-asc-joint``) a view of a flat
    parameter buffer in the plan's geometry, so the all-gather writes straight into the model
    (``p.data`` is rebound once, at construction; for a DTensor parameter its local tensor;
    parameters whose dtype differs from their bucket's, or that are not contiguous, keep the copy,
    listed in ``runtime.copied_params``).
    ``grad_views=True`` (default) lets autograd accumulate the gradients of plain parameters of the
    master dtype straight into the gradient buffer. Both are exact (the same values bit for bit);
    False restores the copies.

    ``exchange`` (docs/runtime.md, "The split step"): ``"gradients"`` (default) sends fp32 gradient
    pieces to each matrix's host and its updated values back; ``"ns-input"`` keeps Muon's momentum on
    the shards and exchanges only the Newton-Schulz input and output, in its compute dtype (about
    half the bytes in bf16, momentum sharded; the same values bit for bit; no update hooks);
    ``"auto"``: ``"ns-input"`` where the matrix optimizer offers it. FSDP2 and the TP micro-groups.
    The FSDP2 layout refuses the ZeRO-1 options (``grad_reduce``,
    ``param_sync``, ``bucket_numel``, ``tp_dims``, ``param_views``, ``grad_views``,
    ``overlap_updates``, ``alpha``, ``tp_schedule``) when they differ from their defaults.

    ``no_weight_decay``: names of element-wise parameters the element-wise optimizer steps with
    ``weight_decay=0`` (its inner instances get a second param group; a scheduled weight decay
    leaves them at 0), as ``transformers.Trainer`` exempts biases and norm weights. Every name
    must be a planned parameter of the element-wise role.
    """

    #: ``torch.amp.GradScaler`` hands an optimizer with this flag its scale and ``found_inf`` and
    #: calls :meth:`step` itself, which refuses the scaler in one line (see :meth:`step`)
    _step_supports_amp_scaling = True

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
        cmax: float = 512.0,
        master_dtype: torch.dtype = torch.float32,
        grad_reduce: str = "mean",
        param_sync: str = "eager",
        plan: Any = None,
        status_timeout_s: float = STATUS_TIMEOUT_S,
        bound_fsdp_collectives: bool = True,
        overlap_updates: bool = False,
        param_views: bool = True,
        grad_views: bool = True,
        roles: Any = None,
        exchange: str = "gradients",
        no_weight_decay: Any = (),
        cmax_mb: Any = None,
    ) -> None:
        # ---- checks that every rank makes identically, before any collective
        if cmax_mb is not None:
            raise TypeError(
                "cmax_mb is retired: C_max is now cmax=, in 2**20 TP-local gradient elements per host "
                "(the paper's unit; the old cmax_mb=M of fp32 gathered gradient is cmax=M / (4 * tp))"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        settings = OptimizerSettings(
            strategy=strategy, tp_schedule=tp_schedule, tp_dims=tp_dims, bucket_numel=bucket_numel, alpha=alpha, cost=cost,
            cmax=cmax, master_dtype=master_dtype, grad_reduce=grad_reduce, param_sync=param_sync,
            status_timeout_s=status_timeout_s, bound_fsdp_collectives=bound_fsdp_collectives, overlap_updates=overlap_updates, param_views=param_views, grad_views=grad_views,
            roles=roles, exchange=exchange, no_weight_decay=no_weight_decay,
        )
        self._set_settings(settings)
        matrix_cls, ew_cls = self._resolve_optimizers(optimizer, optimizer_kwargs, elementwise_optimizer, elementwise_kwargs)
        device = self._check_model(model)
        layout = choose_layout(model)(model, mesh, settings, device=device)
        layout.check_optimizers(matrix_cls, ew_cls)
        self.layout = layout
        self.mesh = layout.mesh
        self.model = model

        # ---- plan, agreed on every rank; groups; replicas
        self.plan = self._agree_plan(layout, matrix_cls, plan, device)
        self._check_no_weight_decay(layout)
        self._init_param_groups(model, layout)
        layout.check_replicas()
        # every rank's optimizer arguments, folded into the per-step hyperparameter digest
        self._kwargs_repr = repr((_plain(self.optimizer_kwargs), _plain(self.elementwise_kwargs), sorted(settings.no_weight_decay)))

        # ---- runtime
        self.comm_stats = CommStats()
        self.phase_times = PhaseTimer()
        self._watch = ParamWatch(model)
        self.runtime = layout.build(
            matrix_factory=_factory(matrix_cls, self.optimizer_kwargs),
            elementwise_factory=_factory(ew_cls, self.elementwise_kwargs),
            comm_stats=self.comm_stats,
            phase_times=self.phase_times,
        )
        self.comm_stats.reset()

    # ------------------------------------------------------------------------------ construction
    def _set_settings(self, settings: OptimizerSettings) -> None:
        self.settings = settings
        self.strategy = settings.strategy
        self.master_dtype = settings.master_dtype
        self.status_timeout_s = settings.status_timeout_s

    def _resolve_optimizers(
        self,
        optimizer: Any,
        optimizer_kwargs: Mapping[str, Any] | None,
        elementwise_optimizer: Any,
        elementwise_kwargs: Mapping[str, Any] | None,
    ) -> tuple[type[torch.optim.Optimizer], type[torch.optim.Optimizer]]:
        """Both optimizer classes, probed to be per-parameter, with their arguments' ranges checked."""
        matrix_cls = resolve_optimizer(optimizer, "optimizer")
        ew_cls = resolve_optimizer(elementwise_optimizer, "elementwise_optimizer")
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.elementwise_kwargs = dict(elementwise_kwargs or {})
        check_per_parameter(matrix_cls, self.optimizer_kwargs, "optimizer")
        if ew_cls is not matrix_cls or self.elementwise_kwargs != self.optimizer_kwargs:
            check_per_parameter(ew_cls, self.elementwise_kwargs, "elementwise_optimizer")
        check_hyperparams(self.optimizer_kwargs, "optimizer_kwargs")
        check_hyperparams(self.elementwise_kwargs, "elementwise_kwargs")
        self.matrix_cls, self.elementwise_cls = matrix_cls, ew_cls
        return matrix_cls, ew_cls

    def _check_no_weight_decay(self, layout: Layout) -> None:
        """Every ``no_weight_decay`` name is a planned parameter of the element-wise role (the same
        answer on every rank: names and the agreed plan)."""
        nd = self.settings.no_weight_decay
        if not nd:
            return
        unknown = sorted(n for n in nd if n not in layout.planned)
        if unknown:
            raise ValueError(f"no_weight_decay names {unknown[:3]}{' ...' if len(unknown) > 3 else ''}, which are not trainable parameters "
                             "of the model (names as model.named_parameters() gives them)")
        matrices = sorted(n for n in nd if layout.role(n) != "elementwise")
        if matrices:
            raise ValueError(f"no_weight_decay names {matrices[:3]}{' ...' if len(matrices) > 3 else ''}, which the matrix optimizer "
                             "updates; only element-wise parameters can be exempt from weight decay (set the matrix "
                             "optimizer's weight_decay, or give those parameters the element-wise role with roles=)")

    @staticmethod
    def _check_model(model: nn.Module) -> torch.device:
        """The device of the model's parameters; refuses an uninitialized world and meta parameters."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        first = next(iter(model.parameters()), None)
        if first is None:
            raise ValueError("the model has no parameters")
        meta = [n for n, p in model.named_parameters() if local_tensor(p.detach()).is_meta]
        if meta:
            raise ValueError(
                f"the model has {len(meta)} parameter(s) on the meta device (e.g. {meta[0]}): they hold no values; "
                "materialize and initialize them (model.to_empty(device=...) then your init) before building the optimizer"
            )
        return local_tensor(first.detach()).device

    def _agree_plan(self, layout: Layout, matrix_cls: type[torch.optim.Optimizer], plan: Any, device: torch.device) -> Any:
        """The layout's plan, once every rank has shown the same fingerprint. A failure on some ranks
        only surfaces through the fingerprint exchange: every rank learns the failing ranks'
        messages (:func:`~canzona.runtime.agree.agree`, bounded by ``status_timeout_s``)."""
        err: Exception | None = None
        fp: str | None = None
        try:
            # a probe of the element-wise optimizer on this rank's device: its answer may differ
            # between ranks (another CPU), so a refusal travels through the exchange below
            check_piecewise(self.elementwise_cls, self.elementwise_kwargs, "elementwise_optimizer", device=device, dtype=self.master_dtype)
            if self.settings.strategy not in FSDP_STRATEGIES and get_strategy(self.settings.strategy).elementwise_only:
                # zero1 cuts the "matrix" optimizer's parameters too (FSDP2 hosts every matrix whole)
                check_piecewise(matrix_cls, self.optimizer_kwargs, "optimizer", device=device, dtype=self.master_dtype)
            plan = layout.make_plan(matrix_cls, plan)
            fp = plan.fingerprint
        except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange below
            # Whatever went wrong here, this rank enters the fingerprint exchange (with None) before
            # re-raising: skipping it would leave the other ranks waiting, or pair their exchange with
            # a later collective of this rank.
            err = exc
        fps = exchange_fingerprints(fp, device=device, timeout_s=self.status_timeout_s)
        if any(f is None for f in fps):
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
        return plan

    def _init_param_groups(self, model: nn.Module, layout: Layout) -> None:
        """``Optimizer.__init__`` over the planned parameters in model order, split by the role the
        layout gives them (under ``zero1`` every parameter is element-wise, the matrix group empty)."""
        hyper = {
            "matrix": scheduled_hyperparams(self.matrix_cls, self.optimizer_kwargs),
            "elementwise": scheduled_hyperparams(self.elementwise_cls, self.elementwise_kwargs),
        }
        planned = layout.planned
        members: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name in GROUP_NAMES}
        for n, p in model.named_parameters():
            if n in planned:
                members[layout.role(n)].append((n, p))
        groups = [{"name": name, "params": [p for _, p in members[name]], **hyper[name]} for name in GROUP_NAMES]
        self._groups_fixed = False
        super().__init__(groups, {})
        self._groups_fixed = True
        from canzona.runtime.stateful import OptimizerStateNotice

        self.state = OptimizerStateNotice()  # state lives in the inner optimizers (see its docstring)
        # set here, not through (name, tensor) pairs: Optimizer refuses to mix a named group with an
        # empty (hence unnamed) one, and zero1's matrix group is empty
        for group in self.param_groups:
            group["param_names"] = [n for n, _ in members[group["name"]]]
        self._scheduled = {name: tuple(hyper[name]) for name in GROUP_NAMES}

    def __getattr__(self, name: str) -> Any:
        # only reached when ordinary lookup fails: the layout's sizes and ranks (its ``exposed``)
        layout = self.__dict__.get("layout")
        if layout is not None and name in layout.exposed:
            return getattr(layout, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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

    def _check_hyperparams(self) -> None:
        """Refuse out-of-range scheduled values (NaN or negative ``lr`` ...) before anything changes.

        Why raising here, locally, reaches every rank: every rank runs this check on its own
        groups before joining any collective of the step. The groups were equal on every rank at
        the last step (its first status exchange compares their digest; not under
        ``overlap_updates``, which has no such exchange), and what changes them between
        steps (a scheduler, the training script) runs on every rank alike, so every rank sees the
        same values and raises the same error at the same point, none of them inside a collective.
        Should a rank-dependent edit make the values differ, the ranks that pass go on into the
        step's first status exchange, which the refusing ranks never join: they raise
        :class:`~canzona.runtime.agree.AgreementTimeout` naming those ranks within
        ``status_timeout_s``, and that exchange comes before any state changes (without
        ``overlap_updates``), so no rank applies anything."""
        for group in self.param_groups:
            check_hyperparams({k: group[k] for k in group if k != "params"}, f"parameter group {group['name']!r}")

    def _push_hyperparams(self) -> None:
        """Write each group's scheduled hyperparameters into the inner optimizers of its role (a few
        dict writes; every rank holds the same groups, so every inner optimizer sees the same values)."""
        for group in self.param_groups:
            name = group["name"]
            self.runtime.set_hyperparams(name, {k: group[k] for k in self._scheduled[name]})

    # ------------------------------------------------------------------------------ torch-like API
    def step(self, closure: Any = None) -> Any:
        """Wait for gradients, update owned parameters, return values to every rank (eager).

        The groups' hyperparameters are range-checked first, on every rank, before anything changes
        (:meth:`_check_hyperparams`); then the runtime's step joins the status exchanges that settle
        errors, missing and non-finite gradients and the hyperparameter digest on every rank."""
        if closure is not None:
            raise TypeError("DistributedOptimizer.step does not take a closure (per-parameter optimizers only)")
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            # set by torch.amp.GradScaler.step just before it calls this (the same on every rank);
            # dropped here, since the scaler deletes them only after a step that returned
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise TypeError(
                "torch.amp.GradScaler is not supported: canzona reduces the gradients in its own buffer (p.grad is None on "
                "the ZeRO-1 path) and settles their finiteness across ranks itself, so the scaler could neither unscale nor "
                "skip them correctly; train with bf16 autocast and no scaler (nothing was changed)"
            )
        self._watch.check()
        self._check_hyperparams()
        self._push_hyperparams()
        with timing(self.phase_times):
            self.runtime.step(self._digest())
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard gradients: the runtime's (the ZeRO-1 buffer), and every ``p.grad`` of the model,
        which becomes None or, with ``set_to_none=False``, is zeroed in place as
        ``torch.optim.Optimizer.zero_grad`` does (detached from its graph first)."""
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
        with timing(self.phase_times):
            return self.layout.clip_grad_norm(max_norm, norm_type, error_if_nonfinite, foreach)

    def finish_param_sync(self) -> None:
        """``param_sync="lazy"``: wait for the pending parameter all-gathers now (the forward does it
        bucket by bucket otherwise); call before reading parameters outside a forward pass. Nothing
        is pending on layouts that return values inside ``step()``."""
        with timing(self.phase_times):
            self.runtime.finish_param_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over micro-batches without launching gradient collectives: wrap
        every backward but the last of an accumulation in it. ZeRO-1: the buffer's hooks keep
        accumulating without launching the bucket collectives; FSDP2: FSDP2's gradient sync is
        off on every ``fully_shard`` module inside the block."""
        with self.layout.no_sync():
            yield

    def register_update_hook(self, hook: Any) -> Any:
        """Call ``hook(name, param, optimizer)`` on the rank that computed it, for every parameter
        updated whole, right after its update and before the value is sent to the other ranks
        (``param``: the full-shape master; ``optimizer``: the inner optimizer holding its state).
        An optional ``hook.before_update`` with the same signature runs just before the update.
        Returns a handle; ``handle.remove()`` detaches the hook. See :mod:`canzona.runtime.hooks`
        (e.g. :class:`~canzona.runtime.hooks.UpdateNormLog`)."""
        return self.runtime.register_update_hook(hook)

    def refresh_masters(self) -> None:
        """Re-read the masters from the model (collective; layouts that keep separate masters of
        the model's pieces): call after overwriting parameters outside the optimizer. (Under
        FSDP2's split step with fp32 parameters the matrix masters are the model's own shards and
        see such edits at once; the element-wise masters still need this call.)"""
        refresh = getattr(self.layout, "refresh_masters", None)
        if refresh is None:
            raise TypeError(f"the {self.layout.engine} layout has no refresh_masters (its masters are the parameter buffer's)")
        refresh()

    @property
    def steps(self) -> int:
        return self.runtime.steps

    def state_bytes(self) -> int:
        """Bytes of optimizer state on this rank (local optimizers plus hosted matrix tasks)."""
        return self.runtime.state_bytes()

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state in the shape ``torch.distributed.checkpoint`` saves and
        loads (a ``Stateful``: ``dcp.save({"optim": opt})``, ``dcp.load(...)``, re-sharded to any
        layout). Collective: every rank calls it (one that calls it alone raises within
        ``status_timeout_s``). Format: :mod:`canzona.runtime.stateful`. For one consolidated
        document (export, small models) use :meth:`consolidated_state_dict`.

        The groups' current ``lr``/``weight_decay`` (a scheduler may have changed them since the
        last ``step()``) are pushed into the inner optimizers first, so the state holds them. A
        scheduler's own state is not included: save ``sched.state_dict()`` beside it."""
        from canzona.runtime.stateful import sharded_state_dict

        self.finish_param_sync()
        self._push_hyperparams()
        return sharded_state_dict(self)

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The consolidated optimizer state (collective: call on every rank; rank 0 gets it, other
        ranks an empty dict). Format: :mod:`canzona.runtime.checkpoint`;
        ``canzona.runtime.checkpoint.save_checkpoint`` writes it to one file."""
        from canzona.runtime.checkpoint import consolidated_state_dict

        self.finish_param_sync()
        self._push_hyperparams()
        return consolidated_state_dict(self)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned on this rank (after ``dcp.load`` read into it) or
        a consolidated document (every rank passes the whole document); collective, re-shards to
        this layout (:func:`canzona.runtime.stateful.load_state`).

        The groups' ``lr``/``weight_decay`` and the inner optimizers' other hyperparameters are
        restored from the state (:func:`canzona.runtime.checkpoint.restore_hyperparams`); a group
        it has no values for keeps its own. Load a scheduler's state after this."""
        from canzona.runtime.stateful import load_state

        self.finish_param_sync()
        load_state(self, state_dict)

    # ------------------------------------------------------------------------------ checkpoint source
    # What canzona.runtime.checkpoint and canzona.runtime.dcp read (their Checkpointable protocol):
    # the layout says what this rank holds; the hyperparameters are the front end's.
    def checkpoint_params(self) -> list[ParamRecord]:
        return self.layout.checkpoint_params()

    def describe(self, *, file: Any = None) -> str:
        """The table of every parameter's role, shape, matrix tasks, cost and owner under this
        plan (:func:`canzona.plan.describe.describe_plan`); printed to ``file`` when given."""
        from canzona.plan.describe import describe_plan

        own = getattr(self.plan, "describe", None)  # a plan of several parts (expert parallelism) describes itself
        text = own() if own is not None else describe_plan(self.plan)
        if file is not None:
            print(text, file=file)
        return text

    def checkpoint_describe(self) -> dict[str, Any]:
        return self.layout.checkpoint_describe()

    def held(self) -> list[Held]:
        return self.layout.held()

    def model_pieces(self) -> list[ModelPiece]:
        return self.layout.model_pieces()

    def status_device(self) -> torch.device:
        return self.layout.status_device()

    def finish_load(self, steps: int) -> None:
        self.layout.finish_load(steps)

    def hyperparams(self) -> dict[str, dict[str, Any]]:
        inner = getattr(self, "_inner_hyper", None)
        if inner is None:
            inner = self._inner_hyper = {
                "matrix": inner_hyperparams(self.matrix_cls, self.optimizer_kwargs),
                "elementwise": inner_hyperparams(self.elementwise_cls, self.elementwise_kwargs),
            }
        return {g["name"]: {**inner[g["name"]], **{k: g[k] for k in self._scheduled[g["name"]]}} for g in self.param_groups}

    def __repr__(self) -> str:
        return (
            f"DistributedOptimizer({self.matrix_cls.__name__} + {self.elementwise_cls.__name__}, strategy={self.strategy!r}, "
            f"layout={self.layout.engine}, {self.layout.describe()}, plan={self.plan.fingerprint})"
        )


def _factory(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> OptimizerFactory:
    """``ts -> cls(ts, **kwargs)``: how the runtime builds an inner optimizer over its masters."""
    kw = dict(kwargs)
    return lambda ts: cls(ts, **kw)
