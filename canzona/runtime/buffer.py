"""The ZeRO-1 gradient buffer in plan geometry, filled by backward hooks (Section 2.2, Appendix B.1).

Megatron-Core keeps every gradient in one flat, bucketed ``param_and_grad_buffer`` so that a whole
bucket can be reduced by one coalesced collective as soon as the backward pass has produced all of
its gradients, overlapping communication with the rest of backward. Canzona keeps that buffer and
its bucket order unchanged and only moves the per-bucket cut points (Section 3.1); this module is
the buffer side of that contract:

- :class:`GradBuffer` lays out one flat tensor (``plan.buffer_numel`` elements of ``dtype``,
  fp32 by default) with the plan's bucket starts and parameter offsets. Each parameter's slot holds
  its TP-local gradient shard, flattened.
- :meth:`GradBuffer.attach` registers a ``post_accumulate_grad`` hook on every parameter. The hook
  does *not* take the gradient: it only marks the parameter as finished by autograd (see "Other
  code's hooks" below). The gradient is taken later, once every other hook on that parameter has
  run: ``p.grad`` (``.to_local()`` for DTensor parameters) is added into the slot in the buffer's
  dtype, ``p.grad`` is freed and the parameter is reported. When every parameter of a bucket has
  reported, the bucket is *ready*; ready buckets are handed to ``on_ready`` strictly in bucket
  index order, so every rank launches its collectives in the same order even if hooks fire in a
  different order (gloo and NCCL both require one collective order per group).
- :meth:`GradBuffer.no_sync` accumulates gradients of several micro-batches without reporting, for
  gradient accumulation: the backward pass after the block reports and launches.

Other code's hooks (the rule). Libraries register their own gradient hooks on the same parameters,
before or after canzona does: a tensor-parallel plan that all-reduces the gradients of replicated
parameters over the TP group (transformers' ``replicated_with_grad_allreduce``, registered at the
first forward, i.e. *after* the optimizer was built), DDP-style reducers, user clipping or logging
hooks. canzona must see the *final* gradient and must never leave ``p.grad`` as None for any of
them. The autograd engine runs all hooks of one parameter (its ``register_hook`` tensor hooks, then
every ``post_accumulate_grad`` hook in registration order, then the hooks of its ``AccumulateGrad``
node) as one uninterrupted block when that parameter's gradient is accumulated, before it runs any
other node of the graph. So canzona's hook records the parameter as *pending* and takes it in
(1) when the next parameter's canzona hook fires: by then the pending parameter's whole block of
hooks has finished, or (2) in a callback queued on the autograd engine
(``Variable._execution_engine.queue_callback``) that runs when the whole backward pass has
finished, for the last parameters. A bucket is therefore launched at most one parameter later than
if canzona took the gradient first, which keeps the per-bucket overlap with the rest of backward.
The block-of-hooks argument holds for the parameters of one device (the engine processes one
device's nodes on one thread); :meth:`flush` at ``step()`` takes in anything still pending.

Gradients straight into the buffer (``grad_views=True``, Megatron's ``main_grad`` without a
second field). For a plain (non-DTensor) parameter whose dtype and device are the buffer's, a
pre-hook on the parameter's ``AccumulateGrad`` node sets ``p.grad`` to the parameter's slot (a
view of the buffer, zero at that point) just before autograd accumulates, so autograd adds the
gradient into the slot in place (``slot += g``: the same addition the copy path makes, bit for
bit) and every hook after it sees ``p.grad`` set, as the rule above requires. The view is handed
out only while the slot is known to be zero: no gradient taken since the last :meth:`reset`, the
bucket not launched, the last step's gradients not retained, ``p.grad`` None. So under
:meth:`no_sync` only the first micro-batch lands in place and later ones take the copy path: every
hook sees this backward's gradient, never the sum so far, exactly as without views. When the
gradient is taken, ``p.grad`` still being the slot means it is already there (hooks that edited it
in place edited the slot); a ``p.grad`` that a hook replaced (or ``create_graph=True`` rebuilt out
of place) is copied over the slot, which was zero before this backward. A node pre-hook (not a
tensor hook) is used because tensor hooks also fire for ``torch.autograd.grad``, which never
accumulates into ``p.grad``. Other parameters (DTensor, another dtype such as bf16 with fp32
masters) keep the copy path.

The buffer never communicates; whoever owns it (:mod:`canzona.runtime.dp`) launches the
collectives from ``on_ready``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch

from canzona.plan.plan import Plan

__all__ = ["GradBuffer", "GradSyncError", "guard_torch_clip", "held_gradients", "is_plain", "local_tensor", "same_view"]

#: every live buffer (weakly: it goes with its optimizer), for :func:`guard_torch_clip`
_LIVE: weakref.WeakSet[GradBuffer] = weakref.WeakSet()


def held_gradients(parameters: object) -> list[str]:
    """The names of those of ``parameters`` (a tensor or an iterable of them) whose gradient of
    this iteration a live :class:`GradBuffer` holds while their ``p.grad`` is None: what
    ``torch.nn.utils.clip_grad_norm_`` cannot see."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)  # type: ignore[call-overload]
    out: list[str] = []
    for buf in list(_LIVE):
        if not buf.received:
            continue
        ids = buf.param_ids
        out += [ids[id(p)] for p in params if p.grad is None and ids.get(id(p)) in buf.received]
    return out


def guard_torch_clip() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` refuse, in one line, parameters whose gradients a
    canzona buffer holds (idempotent). On the ZeRO-1 path the gradients live in the buffer and
    ``p.grad`` is None after backward, so torch's function would return 0 and clip nothing,
    silently. It wraps ``torch.nn.utils.clip_grad._clip_grads_with_norm_``, the module global
    ``clip_grad_norm_`` calls with its parameter list, so the guard holds however the function
    was imported; parameters no buffer holds a gradient for pass through unchanged. Without that
    function (another torch) nothing is installed."""
    import functools

    import torch.nn.utils.clip_grad as clip_grad

    inner = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if inner is None or getattr(inner, "_canzona_guard", False):
        return

    @functools.wraps(inner)
    def guarded(parameters: object, *args: object, **kwargs: object) -> object:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)  # type: ignore[call-overload]
        held = held_gradients(params)
        if held:
            raise RuntimeError(
                f"torch.nn.utils.clip_grad_norm_ sees no gradient for {len(held)} parameters whose gradients canzona's "
                f"DistributedOptimizer holds in its buffer ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): it would "
                "return 0 and clip nothing; call opt.clip_grad_norm_(max_norm) instead"
            )
        return inner(params, *args, **kwargs)

    guarded._canzona_guard = True  # type: ignore[attr-defined]
    clip_grad._clip_grads_with_norm_ = guarded


class GradSyncError(RuntimeError):
    """A gradient arrived when its bucket's collective was already in flight."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise)."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is an ordinary tensor (not a DTensor, whose local shard DTensor owns)."""
    return not callable(getattr(t, "to_local", None))


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (pointer, shape, strides, dtype)."""
    return (
        a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and a.device == b.device
    )


class GradBuffer:
    """Flat gradient buffer with the plan's bucket geometry and readiness tracking.

    ``params`` maps every plan parameter name to the model's parameter (plain tensor or DTensor).
    ``on_ready(i)`` is called once per bucket and step, in increasing ``i``, when bucket ``i`` and
    every bucket before it hold all their gradients (or when :meth:`flush` forces them).
    ``grad_views``: let autograd accumulate straight into the slots of the parameters that allow it
    (:attr:`viewable`; see the module docstring); False copies every gradient in.
    """

    def __init__(
        self,
        plan: Plan,
        params: Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        on_ready: Callable[[int], None] | None = None,
        grad_views: bool = True,
    ) -> None:
        missing = [p.name for p in plan.params if p.name not in params]
        if missing:
            raise ValueError(f"plan parameters missing from the model: {missing}")
        self.plan = plan
        self.params = dict(params)
        #: parameter object id -> plan name (for :func:`held_gradients`)
        self.param_ids = {id(p): n for n, p in self.params.items()}
        _LIVE.add(self)
        guard_torch_clip()
        self.dtype = dtype
        if device is None:
            first = next(iter(self.params.values()))
            device = local_tensor(first.detach()).device
        self.data = torch.zeros(plan.buffer_numel, dtype=dtype, device=device)
        self.slots: dict[str, torch.Tensor] = {}
        self.bucket_of: dict[str, int] = {}
        for pp in plan.params:
            start = plan.buckets[pp.bucket].start + pp.offset
            self.slots[pp.name] = self.data[start : start + pp.numel]
            self.bucket_of[pp.name] = pp.bucket
            local = local_tensor(self.params[pp.name].detach())
            if tuple(local.shape) != tuple(pp.spec.local_shape):
                raise ValueError(
                    f"{pp.name}: model holds a shard of shape {tuple(local.shape)}, the plan expects {pp.spec.local_shape}"
                )
        #: parameters whose gradient autograd may accumulate straight into their slot: plain tensors
        #: of the buffer's dtype and device (the others are copied in when taken)
        self.viewable: frozenset[str] = frozenset(
            n for n, p in self.params.items()
            if grad_views and is_plain(p) and p.dtype == dtype and p.device == self.data.device
        )
        #: the slot of each viewable parameter in the parameter's shape: what ``p.grad`` is set to
        self._views = {n: self.slots[n].view(self.params[n].shape) for n in self.viewable}
        self.on_ready = on_ready
        #: called when a gradient arrives while :attr:`retained` is set (a backward after ``step()``
        #: without ``zero_grad()``); the owner drops the retained gradients there
        self.on_release: Callable[[], None] | None = None
        self._size = [len(b.params) for b in plan.buckets]
        self._handles: list[object] = []
        self._acc_nodes: list[object] = []  # AccumulateGrad nodes carrying the view pre-hooks, kept alive
        self._installed: set[str] = set()
        self._syncing = True
        self.reset()

    # --------------------------------------------------------------------------------- views
    def bucket(self, i: int) -> torch.Tensor:
        b = self.plan.buckets[i]
        return self.data[b.start : b.start + b.numel]

    @property
    def n_buckets(self) -> int:
        return len(self.plan.buckets)

    # --------------------------------------------------------------------------------- state
    def reset(self) -> None:
        """Zero the gradients and forget which parameters reported (start of an iteration)."""
        for name in self._installed:  # a slot handed to p.grad but never taken (a failed backward)
            p = self.params[name]
            if p.grad is not None and same_view(p.grad, self._views[name]):
                p.grad = None  # its slot is zeroed below: drop it rather than leave p.grad aliasing it
        self._installed = set()
        self.data.zero_()
        #: the last step's reduced gradients are kept (``step()`` may run again on them, as
        #: ``torch.optim`` re-applies ``p.grad`` until ``zero_grad()``)
        self.retained = False
        #: parameters that received a gradient since the last reset (with or without ``no_sync``)
        self.received: set[str] = set()
        #: parameters whose gradient autograd accumulated straight into the slot (no copy) since the last reset
        self.in_place: set[str] = set()
        self._reported: set[str] = set()
        #: parameters whose canzona hook fired but whose gradient is not taken yet (name, param, syncing)
        self._pending: list[tuple[str, torch.Tensor, bool]] = []
        self._callback_task = -1  # graph task of the backward pass whose end-of-backward callback is queued
        self._count = [0] * len(self._size)
        self._ready = [False] * len(self._size)
        self._next = 0  # first bucket not yet handed to on_ready

    def launched(self, i: int) -> bool:
        return i < self._next

    @property
    def all_launched(self) -> bool:
        return self._next == len(self._size)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reporting them (gradient accumulation over micro-batches)."""
        prev, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = prev

    # --------------------------------------------------------------------------------- hooks
    def attach(self) -> None:
        """Register one post-accumulate-grad hook per parameter, and on the :attr:`viewable` ones a
        pre-hook on their ``AccumulateGrad`` node that hands autograd the slot (idempotent)."""
        if self._handles:
            return
        for name, p in self.params.items():
            if not p.requires_grad:
                raise ValueError(f"{name} does not require grad; the plan covers only trainable parameters")
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(name)))
            if name in self.viewable:
                with torch.enable_grad():
                    node = p.view_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr]
                # the parameter holds its AccumulateGrad node weakly: keep it, or the hook goes with it
                self._acc_nodes.append(node)
                self._handles.append(node.register_prehook(self._make_prehook(name, p)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()  # type: ignore[attr-defined]
        self._handles.clear()
        self._acc_nodes.clear()

    # Both hooks hold the buffer weakly. They live in C++ (the parameter's autograd metadata, the
    # AccumulateGrad node), where Python's garbage collector cannot see them, so a strong reference
    # would make buffer -> parameters -> hooks -> buffer a cycle it can never free: every model and
    # optimizer built in a process would stay in memory (with their process groups) until exit.
    def _make_prehook(self, name: str, p: torch.Tensor) -> Callable[[object], None]:
        slot = self._views[name]
        bucket = self.bucket_of[name]
        me = weakref.ref(self)

        def prehook(_grad_outputs: object) -> None:
            buf = me()
            # only while the slot is zero: what autograd then leaves in it is this backward's gradient
            if buf is not None and p.grad is None and not buf.retained and bucket >= buf._next and name not in buf.received:
                p.grad = slot
                buf._installed.add(name)

        return prehook

    def _make_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        me = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            buf = me()
            if buf is not None:
                buf.defer(name, p)

        return hook

    def defer(self, name: str, p: torch.Tensor) -> None:
        """canzona's ``post_accumulate_grad`` hook: autograd has finished ``p``, other hooks on ``p``
        may still be running. Take in the parameters pending before it (their hooks have all run,
        see the module docstring), then leave ``p`` pending until the next hook or the end of the
        backward pass."""
        self.take_pending()
        self._pending.append((name, p, self._syncing))
        task = torch._C._current_graph_task_id()
        if task < 0:  # not inside a backward pass (the hook was called directly): take it in now
            self.take_pending()
        elif task != self._callback_task:
            # once per backward pass (keyed by the engine's graph task, so a pass that failed before
            # its callbacks ran cannot leave a stale flag behind)
            from torch.autograd import Variable

            Variable._execution_engine.queue_callback(self.take_pending)
            self._callback_task = task

    def take_pending(self) -> None:
        """Take in the gradients of every pending parameter (their other hooks have all run)."""
        while self._pending:
            name, p, syncing = self._pending.pop(0)
            prev, self._syncing = self._syncing, syncing
            try:
                self.accumulate(name, p)
            finally:
                self._syncing = prev

    def accumulate(self, name: str, p: torch.Tensor) -> None:
        """Add ``p.grad`` into its slot, free it, and report the parameter unless in :meth:`no_sync`."""
        grad = p.grad
        if grad is None:
            return
        if self.retained and self.on_release is not None:
            self.on_release()  # resets this buffer: a new backward starts a new gradient
        if self.launched(self.bucket_of[name]):
            raise GradSyncError(
                f"gradient of {name} arrived after its bucket's collective was launched: call step() or "
                "zero_grad() between backward passes, or wrap all but the last micro-batch in no_sync(); "
                "a DistributedDataParallel wrapper writes gradients after canzona took them: do not wrap the "
                "model in DDP (with transformers use canzona.hf.Trainer)"
            )
        slot, view = self.slots[name], self._views.get(name)
        if view is not None and (grad is view or same_view(grad, view)):
            # autograd accumulated into the slot (and hooks edited it there): nothing to copy
            self.in_place.add(name)
        else:
            placements = getattr(p, "placements", None)
            if placements is not None and tuple(getattr(grad, "placements", placements)) != tuple(placements):
                # DTensor autograd may leave a gradient Replicate or Partial (e.g. a vocab-parallel
                # embedding's); the buffer holds the parameter's own shard, so redistribute to it.
                grad = grad.redistribute(p.device_mesh, placements)
            with torch.no_grad():
                if name in self._installed:
                    # the slot was handed to autograd, then p.grad was replaced (a hook, or create_graph's
                    # out-of-place sum): the slot was zero before this backward, so start from zero again
                    if grad.untyped_storage().data_ptr() == self.data.untyped_storage().data_ptr():
                        grad = grad.clone()  # the replacement reads the buffer: keep it before zeroing
                    slot.zero_()
                slot.add_(local_tensor(grad).reshape(-1))
        self._installed.discard(name)
        p.grad = None
        self.received.add(name)
        if self._syncing:
            self._report(name)

    def _report(self, name: str) -> None:
        if name in self._reported:
            return
        self._reported.add(name)
        i = self.bucket_of[name]
        self._count[i] += 1
        if self._count[i] == self._size[i]:
            self._ready[i] = True
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._size) and self._ready[self._next]:
            i = self._next
            self._next += 1
            if self.on_ready is not None:
                self.on_ready(i)

    def flush(self) -> None:
        """Make every bucket ready: gradients set directly on ``p.grad`` (no backward hook fired) are
        taken in, parameters that got no gradient hold zeros (:attr:`received` tells them apart), and
        the remaining buckets launch."""
        self.take_pending()
        for name, p in self.params.items():
            if p.grad is not None:  # set directly (no hook fired); an error if its bucket already left
                self.accumulate(name, p)
        for i in range(len(self._size)):
            self._ready[i] = True
        self._launch_ready()
