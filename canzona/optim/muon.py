"""Muon: momentum orthogonalized by Newton-Schulz (Jordan et al. 2024; Liu et al. 2025).

Reference points:

* K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024),
  https://kellerjordan.github.io/posts/muon/ -- momentum, Nesterov, the quintic Newton-Schulz
  iteration with coefficients (3.4445, -4.7750, 2.0315) run in bfloat16, and the
  ``sqrt(max(1, rows/cols))`` scaling ("original").
* J. Liu et al., "Muon is Scalable for LLM Training", arXiv 2502.16982 -- decoupled weight decay
  and the ``0.2 * sqrt(max(rows, cols))`` scaling that matches AdamW's update RMS
  ("match_rms_adamw").
* G. Yang, J. Simon, J. Bernstein, "A Spectral Condition for Feature Learning", arXiv 2310.17813
  -- updates with spectral norm ``sqrt(fan_out / fan_in)`` ("spectral").
* Canzona (arXiv 2602.06079), Sec. 3.3 -- a TP host runs this optimizer on full-shape matrices;
  micro-groups can batch same-shape Newton-Schulz calls (:func:`batched_newton_schulz`).

With its defaults, :class:`Muon` is bitwise identical to ``torch.optim.Muon`` of torch 2.13 on
float32 CPU parameters (tested). The Newton-Schulz iteration is our own code rather than a call into
torch's private ``torch.optim._muon._zeropower_via_newtonschulz``: we need a configurable compute
dtype and a batched variant that must match it bit for bit, and a private helper may change between
torch releases. ``tests/test_optim_muon.py`` pins both our iteration and our lr scalings against
torch's private helpers (skipping only if they disappear) and the whole optimizer against the public
``torch.optim.Muon``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ._common import _verified as _finite_verified
from ._common import (
    MatrixOptimizerMixin,
    check_beta,
    check_grads_finite,
    check_lr,
    check_nonnegative,
    check_nonnegative_int,
)

__all__ = [
    "ADJUST_LR_FNS",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_EPS",
    "DEFAULT_NS_STEPS",
    "Muon",
    "MATRIX_INPUT_DTYPES",
    "adjust_lr",
    "batched_newton_schulz",
    "newton_schulz",
    "scale_",
]

# Jordan's quintic coefficients, tuned for bfloat16: they maximize the slope at zero so five steps
# push every singular value of a unit-Frobenius-norm matrix into roughly [0.7, 1.2].
DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_NS_EPS = 1e-7

ADJUST_LR_FNS: tuple[str, ...] = ("original", "match_rms_adamw", "spectral", "unit_rms", "none")

#: parameter (master) dtypes for which :class:`Muon`'s split step (:meth:`Muon.matrix_input` ...)
#: is bitwise equal to :meth:`Muon.step`: its element-wise kernels (``lerp``, ``mul``, ``add`` with
#: ``alpha``, the cast to the Newton-Schulz dtype) give every element the same bits whatever its
#: position in the tensor (vectorized body or scalar tail; measured on AVX2/AVX512 CPU and pinned by
#: ``tests/test_ns_exchange.py``). bfloat16 parameters are not: ``add_`` with ``alpha`` rounds
#: differently in the scalar tail there.
MATRIX_INPUT_DTYPES = (torch.float32, torch.float64)


def _check_ns_args(
    coefficients: Sequence[float], steps: int, eps: float, dtype: torch.dtype | None
) -> tuple[float, float, float]:
    check_nonnegative_int("ns_steps", steps)
    check_nonnegative("eps", eps)
    if len(coefficients) != 3:
        raise ValueError(f"ns_coefficients must hold exactly 3 numbers (a, b, c), got {coefficients!r}")
    for value in coefficients:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"ns_coefficients must be finite numbers, got {coefficients!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"ns_dtype must be a floating torch.dtype or None, got {dtype!r}")
    a, b, c = coefficients
    return float(a), float(b), float(c)


def newton_schulz(
    grad: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = DEFAULT_NS_EPS,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Tensor:
    """Approximate the orthogonal polar factor ``U V^T`` of ``grad = U S V^T`` (Jordan et al. 2024).

    ``X_0 = G / max(||G||_F, eps)`` (so every singular value is <= 1), then ``steps`` times
    ``A = X X^T;  X <- a X + (b A + c A^2) X``, on the wide orientation (a tall matrix is
    transposed first, so the Gram matrix is the small side). The iteration runs in ``dtype``
    (bfloat16 by default, like Jordan's and torch's; ``None`` keeps ``grad.dtype``) and the result
    is returned in that dtype. With the defaults the arithmetic is op-for-op that of
    ``torch.optim.Muon`` in torch 2.13, hence bitwise equal to it.

    ``(a, b, c) = (1.5, -0.5, 0)`` is the classical cubic iteration, which converges to ``U V^T``
    for full-rank inputs as ``steps`` grows.
    """
    if not isinstance(grad, Tensor):
        raise TypeError(f"newton_schulz expects a Tensor, got {type(grad).__name__}")
    if grad.ndim != 2:
        raise ValueError(f"newton_schulz expects a 2-D matrix, got shape {tuple(grad.shape)}")
    return _newton_schulz(grad, steps, _check_ns_args(coefficients, steps, eps, dtype), eps, dtype)


def _newton_schulz(grad: Tensor, steps: int, abc: tuple[float, float, float], eps: float, dtype: torch.dtype | None,
                   owned: bool = False) -> Tensor:
    """:func:`newton_schulz` on arguments already checked (:class:`Muon` checks them once per group
    and step, not once per matrix). ``owned``: ``grad`` is the caller's scratch and may be
    overwritten (no copy when it is already in the compute dtype; the values are the same)."""
    a, b, c = abc
    work_dtype = grad.dtype if dtype is None else dtype
    # copy=True: with a bf16 input, .to() would alias it and the in-place normalisation below
    # would overwrite the caller's tensor (torch 2.13 does exactly that to the bf16 momentum buffer).
    # (keyword form: torch's fastest overload of .to for a plain dtype conversion)
    x = grad if owned and grad.dtype == work_dtype else grad.to(dtype=work_dtype, copy=True)
    tall = grad.shape[0] > grad.shape[1]
    if tall:
        x = x.T
    # The norm is taken on the (possibly transposed) view, as torch does: a reduction over a
    # differently strided tensor may sum in another order and round differently. x.norm() is
    # this same vector_norm call behind a Python wrapper (torch.functional.norm).
    x.div_(torch.linalg.vector_norm(x).clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    if tall:
        x = x.T
    return x


def batched_newton_schulz(
    grads: Tensor | Sequence[Tensor],
    steps: int = DEFAULT_NS_STEPS,
    coefficients: Sequence[float] = DEFAULT_NS_COEFFICIENTS,
    eps: float = DEFAULT_NS_EPS,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Tensor:
    """:func:`newton_schulz` over a stack of same-shape matrices with ``bmm``/``baddbmm``.

    Used for Canzona's micro-groups (arXiv 2602.06079, Sec. 3.3), where a host computes many
    updates of identical shape. ``grads`` is a ``[k, m, n]`` tensor or a sequence of ``[m, n]``
    tensors; the result is ``[k, m, n]`` in ``dtype``.

    **Not bitwise equal to a loop of** :func:`newton_schulz` **in general**, which is why
    :class:`Muon` loops by default (``batched=False``) and batches only when asked
    (``batched=True``). What matches and what does not (torch 2.13, x86 CPU, MKL/oneDNN):

    * The per-matrix Frobenius norms are taken one slice at a time on views with the loop's
      strides, so the normalized inputs are identical (a batched ``vector_norm`` may reduce in
      another order).
    * The products can differ, and whether they do depends on the CPU, the thread count, the
      shape, the batch count and the values. ``baddbmm`` and ``addmm`` may round the
      ``beta * C + alpha * (A @ B)`` combination differently in bfloat16 (one rounding or two), so a
      difference appears for some inputs only; ATen sends a batched product whose
      ``contraction*rows*cols`` is below 400 through its own naive kernel; the batched BLAS call can
      block or split its threads differently from the single one. Measured on an AVX-512 Xeon
      (``profiling/bench_batched_ns.py --shapes 24x16,96x64 --experts 8 --inputs 12``, with
      ``--threads 2 --ns-dtype fp32`` for the second figure): bf16 stacks of eight 24 x 16
      matrices differ from the loop for 1 of 12 random inputs on one thread; float32 stacks of
      96 x 64 match on one thread and differ for all 12 on two. An earlier measurement on another
      CPU had found every side of 12 or more bitwise; a rule by shape does not carry across
      machines, so none is assumed.
    * Bound where it differs: each product differs by at most the dot-product rounding bound
      ``gamma_K |A||B|`` (``K`` = contraction length, ``u`` = unit roundoff), and Newton-Schulz is
      a fixed polynomial applied ``steps`` times to matrices of spectral norm <= ~1.2, so the
      outputs differ by a modest multiple of ``u``. Measured over 192 random shape/scale cases:
      <= 23 u in float32 and float64, <= 0.25 u in bfloat16; ``tests/test_optim_muon.py`` asserts
      <= 64 u.
    """
    if isinstance(grads, Tensor):
        if grads.ndim != 3:
            raise ValueError(f"batched_newton_schulz expects a [k, m, n] tensor, got {tuple(grads.shape)}")
        stack = grads
    else:
        mats = list(grads)
        if not mats:
            raise ValueError("batched_newton_schulz needs at least one matrix")
        shape = mats[0].shape
        for i, m in enumerate(mats):
            if not isinstance(m, Tensor) or m.ndim != 2:
                raise ValueError(f"batched_newton_schulz: entry {i} is not a 2-D tensor")
            if m.shape != shape:
                raise ValueError(
                    f"batched_newton_schulz: entry {i} has shape {tuple(m.shape)}, expected {tuple(shape)}"
                )
        stack = torch.stack(mats)
    if stack.size(0) == 0:
        raise ValueError("batched_newton_schulz needs at least one matrix")
    a, b, c = _check_ns_args(coefficients, steps, eps, dtype)
    work_dtype = stack.dtype if dtype is None else dtype
    # a stack built here is already a copy: no second one (the values are the same)
    x = stack.to(work_dtype, copy=isinstance(grads, Tensor))
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    for i in range(x.size(0)):
        xi = x[i]
        xi.div_(xi.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.mT
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    if tall:
        x = x.mT
    return x


#: how many lists of pieces the split step's grouping answers are kept for (:meth:`Muon._by_group`)
SPLIT_CACHE_LISTS = 64
#: the split step keeps the momenta of a param group's pieces (one list an engine passes every
#: step) in one flat buffer when they hold at most this many elements in all (:class:`_FlatMomenta`)
FLAT_MOMENTA_NUMEL = 1 << 20
#: and while all such buffers of an optimizer hold at most this many elements (four buffers each:
#: two of momenta, the gradient pieces and the Newton-Schulz input pieces)
FLAT_MOMENTA_BUDGET = 1 << 23


class _FlatMomenta:
    """The momenta of one list of many small pieces as views of two flat buffers, used in turn.

    Muon's split step advances each piece's momentum (``lerp`` towards the gradient) and its
    Nesterov input (``lerp`` of the gradient towards the new momentum): element-wise, so the
    pieces laid end to end in one flat tensor give the same values as one kernel call per piece
    (CPU; the position-independence ``tests/test_ns_exchange.py`` measures), at one call for all of
    them. The state entries are views of ``bufs[c]``; a step packs the gradient pieces into ``g``,
    writes the new momenta into ``bufs[1 - c]`` (which no state entry references) and the inputs
    into ``inp``, and :meth:`Muon.matrix_apply` stores the new views as the state, as it stores
    fresh tensors otherwise. Whenever the state entries are not exactly one buffer's views (a
    load, a piece left out of an apply), the next step copies them into new buffers first."""

    __slots__ = ("idx", "bufs", "views", "g", "gviews", "inp", "iviews", "numel")

    def __init__(self, idx: list[int], grads: Sequence[Tensor]) -> None:
        self.idx = idx  # the list :meth:`Muon._by_group` keeps (held, so its id stays this entry's)
        self.numel = sum(g.numel() for g in grads)
        made = [_flat_views(self.numel, grads) for _ in range(4)]
        self.bufs, self.views = [made[0][0], made[1][0]], [made[0][1], made[1][1]]
        (self.g, self.gviews), (self.inp, self.iviews) = made[2], made[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.g.dtype

    def advance(self, bufs: list[Tensor | None], grads: Sequence[Tensor], w: float, nesterov: float | None
                ) -> tuple[list[Tensor], list[Tensor]] | None:
        """``(new momenta, inputs)`` for the pieces whose state entries are ``bufs``, or None when
        some pieces have a momentum and some do not (the per-piece path decides those)."""
        c = next((k for k in (0, 1) if all(b is v for b, v in zip(bufs, self.views[k]))), None)
        if c is None:
            if all(b is None for b in bufs):
                c = 0
                self.bufs[0].zero_()  # no state entry references a buffer: a fresh start from zeros
            elif all(b is not None and b.dtype == self.dtype for b in bufs):
                # other tensors (a load, a partial apply): two new buffers, the momenta copied in
                # (the old buffers live on only while some state entry still views them)
                for k in (0, 1):
                    self.bufs[k], self.views[k] = _flat_views(self.numel, grads)
                torch._foreach_copy_(self.views[0], bufs)  # type: ignore[arg-type]
                c = 0
            else:
                return None
        torch._foreach_copy_(self.gviews, list(grads))
        new = self.bufs[1 - c]
        torch.lerp(self.bufs[c], self.g, w, out=new)
        if nesterov is None:
            return self.views[1 - c], self.views[1 - c]
        torch.lerp(self.g, new, nesterov, out=self.inp)
        return self.views[1 - c], self.iviews


def _flat_views(numel: int, like: Sequence[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """A new flat tensor of ``numel`` elements (dtype and device of ``like[0]``) and its consecutive
    views of the shapes of ``like``."""
    flat = torch.empty(numel, dtype=like[0].dtype, device=like[0].device)
    shapes = [t.shape for t in like]
    return flat, [t.view(shape) for t, shape in zip(flat.split([math.prod(shape) for shape in shapes]), shapes)]


def scale_(tensors: Sequence[Tensor], factor: float) -> None:
    """``t.mul_(factor)`` for every tensor of ``tensors``, bitwise, in one call where that is exact.

    On CPU tensors of float32 or float64: one ``torch._foreach_mul_`` with the factor as a 0-dim
    tensor of their own dtype. torch's CPU kernel reads a Python-number factor in the tensor's
    compute type (float32's is float32, float64's is float64), and a 0-dim tensor of the same dtype
    holds exactly that value, so every product is the same rounding of the same two operands; the
    tensor form skips the scalar's per-tensor wrapping (about 3.5x cheaper for 500 tensors of
    8 x 16, 0.24 against 0.86 ms). Anything else is one ``mul_`` per tensor: on CPU, bfloat16 and
    float16 products of ``_foreach_mul_`` differ from ``mul_``'s with either form of the factor
    (``tests/test_optim_muon.py`` checks every dtype)."""
    if not tensors:
        return
    dtype = tensors[0].dtype
    if dtype in MATRIX_INPUT_DTYPES and all(t.dtype == dtype and t.is_cpu for t in tensors):
        torch._foreach_mul_(list(tensors), torch.tensor(factor, dtype=dtype))
        return
    for t in tensors:
        t.mul_(factor)


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Per-matrix learning-rate scale for an ``[A, B]`` (rows = fan_out, cols = fan_in) matrix.

    * ``None`` / ``"original"``: ``lr * sqrt(max(1, A / B))`` (Jordan et al. 2024).
    * ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(A, B))`` (Liu et al. 2025): an orthogonal
      ``A x B`` matrix has RMS ``1 / sqrt(max(A, B))``, so this gives update RMS 0.2, AdamW's
      typical value.
    * ``"spectral"``: ``lr * sqrt(A / B)`` (Yang, Simon, Bernstein 2023): the update's spectral norm
      is ``sqrt(fan_out / fan_in)``; unlike ``"original"`` it also shrinks wide matrices.
    * ``"unit_rms"``: ``lr * sqrt(max(A, B))``: update RMS exactly 1 for an orthogonal update.
    * ``"none"``: ``lr``.

    The float expressions of the first two are written exactly as torch 2.13 writes them, so the
    resulting Python floats are identical.
    """
    rows, cols = int(shape[0]), int(shape[1])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    elif adjust_lr_fn == "spectral":
        ratio = math.sqrt(rows / cols)
    elif adjust_lr_fn == "unit_rms":
        ratio = math.sqrt(max(rows, cols))
    elif adjust_lr_fn == "none":
        ratio = 1.0
    else:
        raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
    return lr * ratio


class Muon(MatrixOptimizerMixin, Optimizer):
    r"""Muon for 2-D parameters (Jordan et al. 2024; Liu et al. 2025), per parameter:

    .. math::
        B_t = \mu B_{t-1} + (1-\mu) g_t \quad(\text{lerp}),\qquad
        \tilde B_t = \begin{cases} g_t + \mu (B_t - g_t) & \text{nesterov} \\ B_t \end{cases}

        O_t = \mathrm{NS}_k^{(a,b,c)}(\tilde B_t),\qquad
        \theta_t = (1 - \gamma\lambda)\,\theta_{t-1} - \mathrm{adjust}(\gamma, \text{shape})\,O_t

    Weight decay uses the unadjusted ``lr`` (as torch does). The defaults and argument order are
    ``torch.optim.Muon``'s; with them the result is bitwise equal to torch 2.13 on float32.

    Extra keyword-only options:

    * ``adjust_lr_fn`` additionally accepts ``"spectral"``, ``"unit_rms"`` and ``"none"``
      (see :func:`adjust_lr`).
    * ``ns_dtype``: Newton-Schulz compute dtype (bfloat16 like torch; ``None`` = parameter dtype,
      useful for float64 tests).
    * ``batched``: ``False`` (default) orthogonalizes one matrix at a time, so every update is
      bitwise equal to that parameter stepped alone (the exactness suite relies on this: an
      expert's update must not depend on which experts share its owner). ``True`` groups
      same-shape, same-dtype parameters of a param group and orthogonalizes each group of at least
      two with one :func:`batched_newton_schulz` chain: faster for many small matrices (experts,
      the q/k/v of many layers), within the bound documented there, not bitwise. ``"auto"`` (the
      default of an earlier release) is accepted and means ``False``: no shape is known to batch
      bitwise on every machine.

    * a param group with ``"transposed": True`` holds weights stored ``(in, out)`` (GPT-2's
      ``Conv1D``): each is updated as its ``(out, in)`` transpose would be, bit for bit (the momentum
      is element-wise; Newton-Schulz runs on a contiguous copy of the transposed momentum, exactly
      the tensor the single-device optimizer would orthogonalize, and the learning rate is scaled
      on the ``(out, in)`` shape). Canzona's front end puts such weights there.

    Parameters may be float32, float64 or bfloat16 (as in torch; with bfloat16 torch divides the
    momentum buffer in place inside Newton-Schulz, we do not). ``step()`` skips parameters without
    a gradient and raises ``ValueError`` on a non-finite gradient before touching any state.
    """

    _name = "Muon"
    _allowed_dtypes = (torch.float32, torch.float64, torch.bfloat16)
    #: understands param groups marked ``"transposed": True`` (see the class docstring)
    updates_transposed = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_NS_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        ns_dtype: torch.dtype | None = torch.bfloat16,
        batched: bool | str = False,
    ) -> None:
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": ns_dtype,
            "batched": batched,
        }
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_nonnegative("weight_decay", group["weight_decay"])
        check_beta("momentum", group["momentum"])
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov must be a bool, got {group['nesterov']!r}")
        if not isinstance(group["batched"], bool) and group["batched"] != "auto":
            raise TypeError(f"batched must be True, False or 'auto', got {group['batched']!r}")
        fn = group["adjust_lr_fn"]
        if fn is not None and fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {fn!r}")
        _check_ns_args(group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])

    def _momentum_update(self, group: dict[str, Any], p: Tensor) -> Tensor:
        """Advance the momentum buffer of ``p`` and return the matrix to orthogonalize."""
        grad = p.grad
        assert grad is not None
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        momentum = group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf

    @staticmethod
    def _apply(group: dict[str, Any], p: Tensor, ortho: Tensor) -> None:
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-adjust_lr(lr, group["adjust_lr_fn"], p.shape))

    @staticmethod
    def _apply_transposed(group: dict[str, Any], p: Tensor, ortho: Tensor) -> None:
        """``_apply`` for a weight stored as the transpose of the ``ortho``-shaped matrix: every
        operation is element-wise, so each element gets the value the ``(out, in)`` update gives."""
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho.T, alpha=-adjust_lr(lr, group["adjust_lr_fn"], ortho.shape))

    @staticmethod
    def _chains(tensors: Sequence[Tensor], items: Sequence[Any]) -> list[list[Any]]:
        """Split ``items`` (one per tensor of ``tensors``) into the lists ``batched=True`` runs as
        one chain each: one per shape, dtype and device."""
        by_shape: dict[tuple[torch.Size, torch.dtype, torch.device], list[Any]] = {}
        for t, item in zip(tensors, items):
            by_shape.setdefault((t.shape, t.dtype, t.device), []).append(item)
        return list(by_shape.values())

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon step over every parameter that has a gradient."""
        loss = self._run_closure(closure)
        check_grads_finite(self._name, self.param_groups)
        for group in self.param_groups:
            ns_args = (group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_dtype"])
            params = [p for p in group["params"] if p.grad is not None]
            if group.get("transposed", False):
                abc = _check_ns_args(group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])
                for p in params:
                    if p.ndim != 2:
                        raise ValueError(f"a 'transposed' param group holds 2-D weights, got shape {tuple(p.shape)}")
                    logical = self._momentum_update(group, p).T.contiguous()
                    ortho = _newton_schulz(logical, group["ns_steps"], abc, group["eps"], group["ns_dtype"])
                    self._apply_transposed(group, p, ortho)
                continue
            # checked once for the group (a group may have been edited since it was added)
            abc = _check_ns_args(group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])
            checked = (group["ns_steps"], abc, group["eps"], group["ns_dtype"])
            if group["batched"] is not True:  # False, or the old "auto", which means the same
                # One parameter at a time keeps peak memory at one update, as torch does.
                for p in params:
                    self._apply(group, p, _newton_schulz(self._momentum_update(group, p), *checked))
                continue
            for chain in self._chains(params, params):
                updates = [self._momentum_update(group, p) for p in chain]
                if len(updates) == 1:
                    ortho: Sequence[Tensor] = [_newton_schulz(updates[0], *checked)]
                else:
                    ortho = batched_newton_schulz(updates, *ns_args).unbind(0)
                for p, o in zip(chain, ortho):
                    self._apply(group, p, o)
        return loss

    # ------------------------------------------------------------------ the split step
    # Muon is element-wise before and after one whole-matrix operation (Newton-Schulz). A
    # distributed engine may therefore keep the momentum on the shards where the gradient lies,
    # move only the pieces of the Newton-Schulz input to the matrix's host (in the dtype
    # Newton-Schulz computes in), orthogonalize there and send the result back for the
    # element-wise update on the shards. The three methods below are that step cut in three,
    # each doing op for op what :meth:`step` does on the whole matrix, so the result is bitwise
    # :meth:`step`'s (for :data:`MATRIX_INPUT_DTYPES`). Nothing changes state before
    # :meth:`matrix_apply`.

    def _split_index(self) -> dict[int, dict[str, Any]]:
        """Parameter id -> its param group, rebuilt whenever the param groups are not the ones it
        was built from (a group added, or replaced as torch's ``load_state_dict`` does); the
        per-list answers of :meth:`_by_group` are dropped with it."""
        token = tuple(map(id, self.param_groups))
        if getattr(self, "_split_token", None) != token:
            self._split_groups = {id(q): g for g in self.param_groups for q in g["params"]}
            self._split_lists: dict[tuple[int, ...], list[tuple[dict[str, Any], list[int]]]] = {}
            self._split_shapes: dict[tuple[int, bool], dict[tuple[int, ...], list[int]]] = {}
            self._split_flat: dict[int, tuple[list[int], _FlatMomenta | None]] = {}
            self._split_token = token
        return self._split_groups

    def _group_of(self, p: Tensor) -> dict[str, Any]:
        index = self._split_index()
        if id(p) not in index:  # a parameter added to a group's list in place
            self._split_token = None
            index = self._split_index()
        return index[id(p)]

    def matrix_input_dtype(self) -> torch.dtype | None:
        """The dtype the split step exchanges (the Newton-Schulz compute dtype), or None when it is
        not known to be bitwise equal to :meth:`step` here (a parameter dtype outside
        :data:`MATRIX_INPUT_DTYPES`, a parameter off the CPU, or param groups with different
        compute dtypes)."""
        dtypes = set()
        for g in self.param_groups:
            for p in g["params"]:
                # CPU only: the position-independence of the element-wise kernels is measured
                # there; on CUDA it has not been checked yet, so the whole-matrix step stays
                if p.dtype not in MATRIX_INPUT_DTYPES or p.device.type != "cpu":
                    return None
                dtypes.add(p.dtype if g["ns_dtype"] is None else g["ns_dtype"])
        return dtypes.pop() if len(dtypes) == 1 else None

    def _by_group(self, params: Sequence[Tensor]) -> list[tuple[dict[str, Any], list[int]]]:
        """Indices of ``params`` per param group, groups in first-seen order. An engine passes the
        same lists every step, so the answer is kept per list of parameters (and dropped with the
        parameter index, :meth:`_split_index`)."""
        self._split_index()
        key = tuple(map(id, params))
        found = self._split_lists.get(key)
        if found is None:
            out: dict[int, tuple[dict[str, Any], list[int]]] = {}
            for i, p in enumerate(params):
                g = self._group_of(p)
                out.setdefault(id(g), (g, []))[1].append(i)
            if len(self._split_lists) >= SPLIT_CACHE_LISTS:  # lists that changed (skipped pieces) are not kept forever
                self._split_lists.clear()
                self._split_shapes.clear()
                self._split_flat.clear()
            found = self._split_lists[key] = list(out.values())
        return found

    def _by_shape(self, group: dict[str, Any], idx: list[int], full_shapes: Sequence[Sequence[int]]) -> dict[tuple[int, ...], list[int]]:
        """``idx`` (the pieces of ``group``, a list :meth:`_by_group` keeps) by the logical
        ``(out, in)`` shape of each piece's whole matrix; kept beside that list, and dropped with it
        (a piece's matrix never changes)."""
        transposed = bool(group.get("transposed", False))
        key = (id(idx), transposed)
        found = self._split_shapes.get(key)
        if found is None:
            found = {}
            for i in idx:
                shape = tuple(full_shapes[i])[::-1] if transposed else tuple(full_shapes[i])
                found.setdefault(shape, []).append(i)
            self._split_shapes[key] = found
        return found

    @torch.no_grad()
    def matrix_input(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """For the pieces ``params`` with gradient pieces ``grads``: ``(new momenta, Newton-Schulz
        input pieces)``, the momentum advanced out of place (``state`` is not touched; pass the
        first list to :meth:`matrix_apply`). One ``torch._foreach_*`` call per param group and
        kind instead of one call per piece: on CPU the same per-tensor kernels, hence the same bits."""
        moms: list[Tensor | None] = [None] * len(params)
        inputs: list[Tensor | None] = [None] * len(params)
        state = self.state
        for group, idx in self._by_group(params):
            w = 1 - group["momentum"]
            bufs = [state[params[i]].get("momentum_buffer") for i in idx]  # one state lookup per piece
            flat = self._flat_momenta(idx, grads)
            done = flat.advance(bufs, [grads[i] for i in idx], w, group["momentum"] if group["nesterov"] else None) if flat else None
            if done is not None:
                for i, m, x in zip(idx, *done):
                    moms[i], inputs[i] = m, x
                continue
            have = [i for i, b in zip(idx, bufs) if b is not None]
            fresh = [i for i, b in zip(idx, bufs) if b is None]
            if have:
                new = torch._foreach_lerp([b for b in bufs if b is not None], [grads[i] for i in have], w)
                for i, m in zip(have, new):
                    moms[i] = m
            if fresh:
                new = [torch.zeros_like(grads[i], memory_format=torch.preserve_format) for i in fresh]
                torch._foreach_lerp_(new, [grads[i] for i in fresh], w)
                for i, m in zip(fresh, new):
                    moms[i] = m
            if group["nesterov"]:
                for i, x in zip(idx, torch._foreach_lerp([grads[i] for i in idx], [moms[i] for i in idx], group["momentum"])):
                    inputs[i] = x
            else:
                for i in idx:
                    inputs[i] = moms[i]
        return moms, inputs  # type: ignore[return-value]

    def _flat_momenta(self, idx: list[int], grads: Sequence[Tensor]) -> _FlatMomenta | None:
        """The flat momenta of the pieces ``idx`` (a list :meth:`_by_group` keeps), made on first
        use; None where the per-piece path runs: more than :data:`FLAT_MOMENTA_NUMEL` elements, the
        budget spent, a single piece, or gradient pieces that are not contiguous CPU tensors of one
        dtype."""
        known = self._split_flat.get(id(idx))
        if known is not None and known[0] is idx:  # decided for this list before (the answer is kept with it)
            found = known[1]
            return found if found is not None and grads[idx[0]].dtype == found.dtype else None
        gs = [grads[i] for i in idx]
        first = gs[0]
        numel = sum(g.numel() for g in gs)
        spent = sum(f.numel for _, f in self._split_flat.values() if f is not None)
        eligible = (len(idx) > 1 and first.device.type == "cpu" and numel <= FLAT_MOMENTA_NUMEL and spent + numel <= FLAT_MOMENTA_BUDGET
                    and all(g.dtype == first.dtype and g.device == first.device and g.is_contiguous() for g in gs))
        made = _FlatMomenta(idx, gs) if eligible else None
        self._split_flat[id(idx)] = (idx, made)
        return made

    @torch.no_grad()
    def matrix_output(self, params: Sequence[Tensor], inputs: Sequence[Tensor]) -> list[Tensor]:
        """Host side: Newton-Schulz of each whole input (stored shape, in the compute dtype) as
        :meth:`step` runs it for the parameter ``params[i]`` belongs to (any piece of it stands
        for its param group), batched where :meth:`step` would batch; results in stored shape.
        The inputs are the caller's scratch: they may be overwritten."""
        out: list[Tensor | None] = [None] * len(inputs)
        by_group: dict[int, list[int]] = {}
        groups: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(params):
            g = self._group_of(p)
            by_group.setdefault(id(g), []).append(i)
            groups[id(g)] = g
        if not getattr(_finite_verified, "depth", 0):
            for i, x in enumerate(inputs):
                if x.numel() and not bool(torch.isfinite(x).all()):
                    raise ValueError(f"{self._name}: the Newton-Schulz input of matrix {i} (shape {tuple(x.shape)}) is not finite")
        for gid, idx in by_group.items():
            group = groups[gid]
            abc = _check_ns_args(group["ns_coefficients"], group["ns_steps"], group["eps"], group["ns_dtype"])
            checked = (group["ns_steps"], abc, group["eps"], group["ns_dtype"])
            if group.get("transposed", False):
                for i in idx:
                    out[i] = _newton_schulz(inputs[i].T.contiguous(), *checked, owned=True).T
                continue
            if group["batched"] is not True:
                for i in idx:
                    out[i] = _newton_schulz(inputs[i], *checked, owned=True)
                continue
            ns_args = (group["ns_steps"], group["ns_coefficients"], group["eps"], group["ns_dtype"])
            for chain in self._chains([inputs[i] for i in idx], idx):
                if len(chain) == 1:
                    out[chain[0]] = _newton_schulz(inputs[chain[0]], *checked, owned=True)
                else:
                    for i, o in zip(chain, batched_newton_schulz([inputs[i] for i in chain], *ns_args).unbind(0)):
                        out[i] = o
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def matrix_apply(self, params: Sequence[Tensor], momenta: Sequence[Tensor], outputs: Sequence[Tensor],
                     full_shapes: Sequence[Sequence[int]]) -> None:
        """Commit ``momenta`` (from :meth:`matrix_input`) and update each piece ``params[i]`` with
        its block ``outputs[i]`` of the Newton-Schulz result of its ``full_shapes[i]`` (stored)
        matrix: weight decay, then the update scaled by the full shape's learning rate, as
        :meth:`step` (one ``_foreach`` call per group, per learning-rate scale)."""
        for group, idx in self._by_group(params):
            state = self.state
            for i in idx:
                state[params[i]]["momentum_buffer"] = momenta[i]
            lr = group["lr"]
            scale_([params[i] for i in idx], 1 - lr * group["weight_decay"])
            # one _foreach_add_ per matrix shape (its learning-rate scale; on CPU the same
            # per-tensor kernel whatever the grouping, so the same bits as step()'s add_)
            for shape, same in self._by_shape(group, idx, full_shapes).items():
                alpha = -adjust_lr(lr, group["adjust_lr_fn"], shape)
                torch._foreach_add_([params[i] for i in same], [outputs[i] for i in same], alpha=alpha)
