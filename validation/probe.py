"""Can this optimizer be exact under distribution at all? Probes run before any process starts.

Canzona runs the user's optimizer on the parameters one rank owns (Sections 3-4 of the paper:
whole matrices on their owner or TP host), stepping one instance once per bucket and micro-group.
That reproduces the single-device run bit for bit only when the optimizer is *separable*: the
update of a parameter depends on that parameter's value, gradient and state alone, all of it kept
in ``self.state[p]``, computed deterministically. An optimizer that is not separable cannot pass
the gate however correct the runtime is, so the suite refuses it up front with the reason, in
the optimizer's terms rather than as a mismatch in some cell:

- **reads other parameters**: the update of one parameter changes when only *another*
  parameter's gradient or value changes (a global gradient norm, gradient clipping inside
  ``step``, a trust ratio over all parameters);
- **per-call value in param_groups**: ``step`` changes a param-group entry (a shared step
  counter); the runtime calls ``step`` several times per training step;
- **state outside self.state**: ``step`` changes an attribute of the optimizer other than
  ``state`` and ``param_groups`` (canzona moves, consolidates and checkpoints ``self.state``
  per parameter; anything else is lost or shared wrongly);
- **not deterministic**: two runs on the same inputs differ (random numbers from the global
  generator, or another source of randomness); every rank must compute the same bits.

What probing in one process cannot see (randomness seeded per process, say) is caught by the run
itself: the failing cell names the parameter and the first differing entry.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["NotSeparableError", "probe_separable"]

#: Attributes torch's Optimizer base class manages itself (hook registries, profiling names).
_TORCH_ATTRS = frozenset({"state", "param_groups", "defaults", "_opt_called", "_zero_grad_profile_name", "_warned_capturable_if_run_uncaptured"})
_SHAPES: tuple[tuple[int, int], ...] = ((6, 4), (5, 7), (4, 4))


class NotSeparableError(ValueError):
    """The optimizer cannot be exact under distribution; ``kind`` is a short tag, the message the reason."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _inputs(seed: int = 0, steps: int = 3) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Values and per-step gradients (different at every step, so momentum mixes them)."""
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=g) for s in _SHAPES]
    grads = [[torch.randn(s, generator=g) for s in _SHAPES] for _ in range(steps)]
    return values, grads


def _run(
    cls: type[torch.optim.Optimizer],
    kwargs: Mapping[str, Any],
    values: Sequence[torch.Tensor],
    grads: Sequence[Sequence[torch.Tensor]],
) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(v.clone()) for v in values]
    opt = cls(ps, **dict(kwargs))
    for step_grads in grads:
        for p, gr in zip(ps, step_grads):
            p.grad = gr.clone()
        opt.step()
    return [p.detach().clone() for p in ps]


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable objects: treat as unchanged, the behavioural probes still run
        return True


def _attrs(opt: torch.optim.Optimizer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in vars(opt).items():
        if k in _TORCH_ATTRS or k.startswith("_optimizer_") or callable(v):
            continue
        try:
            out[k] = copy.deepcopy(v)
        except Exception:  # noqa: BLE001 - not copyable: cannot be compared, skip it
            continue
    return out


def _groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _introspect(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any], label: str) -> None:
    values, grads = _inputs()
    ps = [torch.nn.Parameter(v.clone()) for v in values]
    opt = cls(ps, **dict(kwargs))
    attrs0, groups0 = _attrs(opt), _groups(opt)
    for step_grads in grads:
        for p, gr in zip(ps, step_grads):
            p.grad = gr.clone()
        opt.step()
    groups1 = _groups(opt)
    for g0, g1 in zip(groups0, groups1):
        changed = sorted(k for k in set(g0) | set(g1) if k not in g0 or k not in g1 or not _same(g0[k], g1[k]))
        if changed:
            raise NotSeparableError(
                "param-group-counter",
                f"{label} is not separable: step() changes param_groups entry {changed[0]!r} "
                f"({g0.get(changed[0])!r} -> {g1.get(changed[0])!r}), a value shared by all parameters of the group. "
                "Canzona calls step() once per bucket and per TP micro-group, so it would advance several times per "
                "training step; keep per-parameter counters in self.state[p] (as torch's Adam keeps 'step')",
            )
    attrs1 = _attrs(opt)
    changed = sorted(k for k in set(attrs0) | set(attrs1) if k not in attrs0 or k not in attrs1 or not _same(attrs0[k], attrs1[k]))
    if changed:
        raise NotSeparableError(
            "state-outside-self-state",
            f"{label} is not separable: step() changes the attribute self.{changed[0]}, state kept outside self.state. "
            "Canzona moves, consolidates and checkpoints only self.state[p], per parameter, on the rank that owns p; "
            "keep everything a parameter's update needs in self.state[p]",
        )


def probe_separable(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any] | None = None, label: str | None = None) -> None:
    """Raise :class:`NotSeparableError` with the reason when ``cls(**kwargs)`` cannot be exact under
    distribution (see the module docstring); return quietly otherwise. Runs on three small
    matrices in this process, in well under a second."""
    kwargs = dict(kwargs or {})
    label = label or f"optimizer {cls.__module__}.{cls.__qualname__}"
    _introspect(cls, kwargs, label)
    values, grads = _inputs()
    base = _run(cls, kwargs, values, grads)
    # the same inputs again, from a different global RNG position (ranks draw different numbers)
    torch.manual_seed(12345)
    again = _run(cls, kwargs, values, grads)
    if not all(torch.equal(a, b) for a, b in zip(base, again)):
        i = next(i for i, (a, b) in enumerate(zip(base, again)) if not torch.equal(a, b))
        raise NotSeparableError(
            "non-deterministic",
            f"{label} is not deterministic: two runs on the same parameters and gradients gave different values "
            f"(probe parameter {i}). It draws random numbers from the global generator or another unseeded source; "
            "each rank would draw different numbers. Use a torch.Generator seeded from the step and the parameter's "
            "shape or name, kept in self.state[p]",
        )
    # only the last parameter's gradient changes: the others' updates must not move
    # (at one step only: a scale-invariant rule such as sign() would hide a change at every step)
    other_grads = [list(gs) for gs in grads]
    other_grads[1][-1] = other_grads[1][-1] * 4.0
    moved = _run(cls, kwargs, values, other_grads)
    for i in range(len(values) - 1):
        if not torch.equal(base[i], moved[i]):
            raise NotSeparableError(
                "reads-other-parameters",
                f"{label} is not separable: the update of one parameter changed when only another parameter's gradient "
                f"changed (probe parameters {i} and {len(values) - 1}). Its step reads other parameters, e.g. a global "
                "gradient norm or gradient clipping inside step(); under Canzona each rank steps only the parameters it "
                "owns, so that quantity would be computed over a different set on every rank. Clip before "
                "DistributedOptimizer.step() instead (over the full gradients), or keep the rule per parameter",
            )
    other_values = [*values[:-1], values[-1] * 2.0 + 1.0]
    moved = _run(cls, kwargs, other_values, grads)
    for i in range(len(values) - 1):
        if not torch.equal(base[i], moved[i]):
            raise NotSeparableError(
                "reads-other-parameters",
                f"{label} is not separable: the update of one parameter changed when only another parameter's value "
                f"changed (probe parameters {i} and {len(values) - 1}). Its step reads other parameters (a norm or "
                "statistic over all of them); under Canzona each rank steps only the parameters it owns",
            )
    # finally the runtime's own contract (one instance stepped once per subset, no closure)
    from canzona.distributed import check_per_parameter

    try:
        check_per_parameter(cls, kwargs, label)
    except TypeError as exc:
        raise NotSeparableError("not-per-parameter", str(exc)) from None
