"""Shared validation and bookkeeping for the single-device matrix optimizers.

The matrix optimizers in :mod:`canzona.optim` are the ground truth of the exactness suite: a
distributed run (Canzona, arXiv 2602.06079, Sec. 3) must reproduce them bit for bit. Two rules
follow from that and are enforced here once for all three optimizers:

* Each parameter's update reads only its own gradient and state, so validation is per parameter
  and never looks at the rest of the group.
* A bad gradient (NaN/inf) must be rejected *before* any state is touched, so a failed ``step()``
  leaves the optimizer exactly as it was and the caller can skip the batch and continue.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "MatrixOptimizerMixin",
    "check_beta",
    "check_grads_finite",
    "check_lr",
    "check_nonnegative",
    "check_nonnegative_int",
    "check_positive_int",
    "finite_grads_verified",
    "nonfinite_flags",
    "param_label",
]


def _is_real_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_lr(lr: object) -> None:
    """Learning rates are plain non-negative, finite Python numbers (schedulers write floats)."""
    if not _is_real_number(lr):
        raise TypeError(f"lr must be a Python int or float, got {type(lr).__name__}")
    if not math.isfinite(lr) or lr < 0.0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr}")


def check_nonnegative(name: str, value: object) -> None:
    """For eps and weight decay: finite and >= 0."""
    if not _is_real_number(value):
        raise TypeError(f"{name} must be a Python int or float, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def check_beta(name: str, value: object) -> None:
    """Decay rates of exponential moving averages live in [0, 1)."""
    if not _is_real_number(value):
        raise TypeError(f"{name} must be a Python int or float, got {type(value).__name__}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")


def check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_nonnegative_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def param_label(group_index: int, param_index: int, group: Mapping[str, Any], p: Tensor) -> str:
    """Human-readable handle for error messages: position, name when known, shape and dtype."""
    label = f"param_groups[{group_index}]['params'][{param_index}]"
    names = group.get("param_names")
    if names is not None and param_index < len(names):
        label += f" ({names[param_index]!r})"
    return f"{label} of shape {tuple(p.shape)} and dtype {p.dtype}"


def check_grads_finite(optimizer_name: str, param_groups: Iterable[Mapping[str, Any]]) -> None:
    """Reject sparse, misshapen or non-finite gradients before the step mutates anything.

    The finiteness check reduces every gradient to a few 0-d tensors (max-abs or min/max, see
    :func:`_all_finite`) and reads them ONCE per device, instead of a host sync per parameter: on
    CUDA every sync stalls the stream, and on CPU the per-parameter calls were most of a small
    matrix's step. The detailed NaN/inf counts are computed only on
    the failure path, for the first offending parameter in group order.
    """
    dense: list[tuple[int, int, Mapping[str, Any], Tensor, Tensor]] = []
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise TypeError(
                    f"{optimizer_name}: {param_label(gi, pi, group, p)} has a sparse gradient; "
                    "matrix optimizers need dense gradients"
                )
            if grad.shape != p.shape:
                raise ValueError(
                    f"{optimizer_name}: {param_label(gi, pi, group, p)} has a gradient of shape "
                    f"{tuple(grad.shape)}, expected the parameter's shape"
                )
            if grad.numel():
                dense.append((gi, pi, group, p, grad))
    if not dense or getattr(_verified, "depth", 0) or _all_finite([d[4] for d in dense]):
        return
    for gi, pi, group, p, grad in dense:
        if not bool(torch.isfinite(grad).all()):
            n_nan = int(torch.isnan(grad).sum())
            n_pos = int(torch.isposinf(grad).sum())
            n_neg = int(torch.isneginf(grad).sum())
            raise ValueError(
                f"{optimizer_name}: the gradient of {param_label(gi, pi, group, p)} is not "
                f"finite: found {n_nan} NaN, {n_pos} +inf and {n_neg} -inf of {grad.numel()} "
                "entries; no parameter or optimizer state was modified"
            )


_verified = threading.local()


@contextlib.contextmanager
def finite_grads_verified() -> Iterator[None]:
    """Inside this block (this thread only) :func:`check_grads_finite` skips its finiteness test;
    sparse and misshapen gradients are still refused. For a caller that has already tested exactly
    the gradients the optimizers will read: canzona's runtimes do, on every rank, before any update
    (the status exchange of ``step()``), so the hosts' optimizers need not read them again."""
    _verified.depth = getattr(_verified, "depth", 0) + 1
    try:
        yield
    finally:
        _verified.depth -= 1


#: below this many elements (``_FUSED_BELOW_CPU`` for CPU tensors) a tensor's test shares one fused
#: max-abs call (``torch._foreach_norm(..., inf)``) with the other small tensors of its device and
#: dtype; from this size on, a test of its own (``aminmax``; on CPU a sum first). On CUDA the
#: fused call saves a kernel launch per tensor; on CPU its max-abs costs several times aminmax's
#: time per element above a few hundred elements (``profiling/bench_optimizers.py`` prints the
#: comparison), hence the lower CPU threshold.
_FUSED_BELOW_CPU = 1 << 9
_FUSED_BELOW = 1 << 16


def nonfinite_flags(tensors: Sequence[Tensor | None], device: torch.device | str = "cpu") -> Tensor:
    """One bool per tensor, on ``device``: does it hold NaN or inf (None or empty: False)?

    Exact, and on CUDA without a host sync: a tensor's largest absolute value (small tensors, one
    ``torch._foreach_norm(..., inf)`` per device and dtype) or its min and max (larger ones,
    ``aminmax``, stacked per device and dtype) is finite exactly when every entry is, since min
    and max propagate NaN, expose +-inf, and cannot overflow. On CPU, where nothing is queued and
    a host read costs nothing extra, a larger tensor is first summed (:func:`_finite_sums`), and
    the small ones of a dtype are first summed together (:func:`_finite_sum`): a finite sum settles
    them all, anything else goes to the exact test. Shared by the optimizers' own check and the runtimes' status exchange
    (:func:`canzona.runtime.agree.nonfinite`)."""
    bad = torch.zeros(len(tensors), dtype=torch.bool, device=device)
    small: dict[tuple[torch.device, torch.dtype], list[tuple[int, Tensor]]] = {}
    large: dict[tuple[torch.device, torch.dtype], list[tuple[int, Tensor]]] = {}
    for k, t in enumerate(tensors):
        if t is None or not t.numel():
            continue
        group = small if t.numel() < (_FUSED_BELOW_CPU if t.is_cpu else _FUSED_BELOW) else large
        group.setdefault((t.device, t.dtype), []).append((k, t))
    for (where, _), same in small.items():
        if where.type == "cpu" and len(same) > 1 and _finite_sum([t for _, t in same]):
            continue  # every entry of every tensor finite: their flags stay False
        peaks = torch._foreach_norm([t for _, t in same], float("inf"))
        bad[[k for k, _ in same]] = ~torch.isfinite(torch.stack(peaks)).to(device)
    for (where, _), same in large.items():
        if where.type == "cpu":
            same = _finite_sums(same)
            if not same:
                continue
        ends = [torch.aminmax(t) for _, t in same]
        lo_hi = torch.stack([x for lo, hi in ends for x in (lo, hi)]).view(-1, 2)
        bad[[k for k, _ in same]] = ~torch.isfinite(lo_hi).all(dim=1).to(device)
    return bad


def _finite_sum(tensors: list[Tensor]) -> bool:
    """True when the sum of every entry of ``tensors`` (CPU, one dtype) is finite, which proves every
    entry finite (see :func:`_finite_sums`); False proves nothing. For many small tensors one
    concatenation and one sum cost less than the fused max-abs call, which makes a result per
    tensor (500 of 8 x 16 fp32: about 0.6 against 0.85 ms on one thread); the exact per-tensor
    test runs only when this one fails. Tensors of one trailing shape are concatenated along their
    first dim as they are (one ``cat``, no per-tensor ``reshape``: 500 of 8 x 16 in two trailing
    shapes, 0.21 against 0.42 ms); the sum of the partial sums is finite only when each is."""
    by_tail: dict[Any, list[Tensor]] = {}
    for t in tensors:
        shape = t.shape
        by_tail.setdefault(shape[1:] if len(shape) else None, []).append(t)
    sums = [(torch.cat(same) if tail is not None else torch.stack(same)).sum() for tail, same in by_tail.items()]
    return bool(torch.isfinite(sums[0] if len(sums) == 1 else torch.stack(sums).sum()))


def _finite_sums(same: list[tuple[int, Tensor]]) -> list[tuple[int, Tensor]]:
    """The tensors of ``same`` (CPU, one dtype) whose sum is not finite: only those need the exact
    test. A finite sum proves every entry finite: a partial sum that has taken in an inf stays
    +-inf or becomes NaN (inf - inf), and NaN stays NaN, in any order of summation. A non-finite
    sum may come from finite entries that overflow, so it proves nothing. Summing is one read
    with one accumulator, about 2.5 x faster than ``aminmax`` on one CPU thread (600k fp32
    elements: 84 against 207 us), and the gradients a step tests are nearly always finite."""
    sums = torch.stack([t.sum() for _, t in same])
    suspect = (~torch.isfinite(sums)).nonzero().flatten().tolist()
    return [same[j] for j in suspect]


def _all_finite(grads: list[Tensor]) -> bool:
    """Whether every entry of every tensor is finite (:func:`nonfinite_flags`, one host read)."""
    return not bool(nonfinite_flags(grads, grads[0].device).any()) if grads else True


class MatrixOptimizerMixin:
    """Validation hooks shared by Muon, Shampoo and SOAP.

    ``add_param_group`` is the single entry point through which torch's ``Optimizer`` registers
    groups (the constructor calls it too), so validating there also covers groups that override
    the defaults, e.g. ``[{"params": ..., "lr": -1.0}]``.
    Subclasses set ``_name``, ``_allowed_dtypes`` and implement ``_validate_group``.
    """

    _name: str = "MatrixOptimizer"
    _allowed_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    param_groups: list[dict[str, Any]]

    def _validate_group(self, group: Mapping[str, Any]) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _validate_params(self, group_index: int, group: Mapping[str, Any]) -> None:
        for pi, p in enumerate(group["params"]):
            label = param_label(group_index, pi, group, p)
            if p.is_complex():
                raise TypeError(f"{self._name}: {label} is complex; only real parameters are supported")
            if p.dtype not in self._allowed_dtypes:
                allowed = ", ".join(str(d) for d in self._allowed_dtypes)
                raise TypeError(f"{self._name}: {label} has dtype {p.dtype}; supported: {allowed}")
            if p.ndim != 2:
                raise ValueError(
                    f"{self._name}: {label} is {p.ndim}-D; this optimizer only takes 2-D matrices "
                    "(use torch.optim.AdamW for vectors, embeddings and heads, see "
                    "canzona.optim.split_param_groups)"
                )
            if p.numel() == 0:
                raise ValueError(f"{self._name}: {label} is empty")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)  # type: ignore[misc]
        group = self.param_groups[-1]
        try:
            self._validate_group(group)
            self._validate_params(len(self.param_groups) - 1, group)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    @staticmethod
    def _run_closure(closure: Callable[[], Any] | None) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()
