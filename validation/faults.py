"""Planted defects for the exactness suite: an update hook that breaks one parameter's update.

A :class:`Fault` describes the defect; :class:`FaultHook` carries it out as an update hook
(:mod:`canzona.runtime.hooks`) registered on one optimizer for one validation case::

    hook = FaultHook(Fault("ulp", "model.layers.0.mlp.down_proj.weight", step=2, index=5))
    handle = opt.register_update_hook(hook)
    ...steps...
    handle.remove(); assert hook.fired

Nothing is process-global: the validation code arms a fault per case. From the command line the
suite reads ``CANZONA_FAULT="kind=ulp,param=NAME,step=2,index=5"`` (:func:`parse`, :func:`from_env`).

Kinds:

- ``ulp``: add one unit in the last place to element ``index`` of the flattened updated value at
  step ``step`` (1-based count of updates of that parameter the hook has seen).
- ``stale_state``: at step ``step`` undo the optimizer-state change of that step for ``param``
  (the state keeps its previous values), modelling a host that lost an update of its state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["KINDS", "Fault", "FaultHook", "from_env", "parse"]

KINDS = ("ulp", "stale_state")


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    param: str
    step: int = 1
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.step < 1 or self.index < 0:
            raise ValueError("fault step must be >= 1 and index >= 0")


def parse(text: str, var: str = "CANZONA_FAULT") -> Fault:
    """A :class:`Fault` from ``kind=...,param=...[,step=...][,index=...]``; ValueError naming ``var``."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{var}: expected key=value pairs, got {part!r}")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"kind", "param", "step", "index"}
    if unknown or "kind" not in fields or "param" not in fields:
        raise ValueError(f"{var}: needs kind= and param= (optional step=, index=), got {text!r}")
    try:
        step, index = int(fields.get("step", 1)), int(fields.get("index", 0))
    except ValueError:
        raise ValueError(f"{var}: step and index must be integers, got {text!r}") from None
    return Fault(fields["kind"], fields["param"], step, index)


def from_env(var: str = "CANZONA_FAULT") -> Fault | None:
    """The fault described in the environment variable ``var``, or None when it is unset or empty."""
    text = os.environ.get(var, "").strip()
    return parse(text, var) if text else None


class FaultHook:
    """Plants one :class:`Fault` as an update hook. ``count`` is how many updates (``ulp``) or
    state updates (``stale_state``) of ``fault.param`` it has seen; :attr:`fired` is True once the
    defect has been applied."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault
        self.count = 0
        self._snapshot: dict[str, torch.Tensor] | None = None

    @property
    def fired(self) -> bool:
        return self.count >= self.fault.step

    def before_update(self, name: str, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        f = self.fault
        if f.kind != "stale_state" or name != f.param:
            return
        state = optimizer.state.get(param, {})
        self._snapshot = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}

    def __call__(self, name: str, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        f = self.fault
        if name != f.param:
            return
        self.count += 1
        if f.kind == "stale_state":
            snap, self._snapshot = self._snapshot, None
            if self.count != f.step or snap is None:
                return
            state = optimizer.state[param]
            with torch.no_grad():
                for k, v in snap.items():
                    if k == "step":
                        continue  # the step counter advancing is not the defect we model
                    state[k].copy_(v)
            return
        if self.count != f.step:
            return
        flat = param.detach().view(-1)
        if f.index >= flat.numel():
            raise ValueError(f"fault index {f.index} outside {name} ({flat.numel()} elements)")
        with torch.no_grad():
            x = flat[f.index : f.index + 1]
            x.copy_(torch.nextafter(x, torch.full_like(x, float("inf"))))

    def __repr__(self) -> str:
        return f"FaultHook({self.fault!r}, count={self.count})"
