"""Test-only fault injection: plant a defect inside the runtime to prove the exactness suite catches it.

The runtime calls :func:`on_update` once for every parameter right after its owner (DP) or host
(TP) has computed the updated value and before that value is sent anywhere, and
:func:`on_state` after each local optimizer step with the optimizer holding that parameter's state.
With no fault armed both are a dictionary lookup and return at once.

A fault is armed per process (never from a file or the network): ``arm(Fault(...))`` in code, or
the environment variable ``CANZONA_FAULT`` read when a worker starts, e.g.
``CANZONA_FAULT="kind=ulp,param=model.layers.0.mlp.down_proj.weight,step=2,index=5"``.

Kinds:

- ``ulp``: add one unit in the last place to element ``index`` of the flattened updated value at
  step ``step`` (1-based count of updates of that parameter in this process).
- ``stale_state``: at step ``step`` undo the optimizer-state change of that step for ``param``
  (the state keeps its previous values), modelling a host that lost an update of its state.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = ["Fault", "arm", "disarm", "armed", "fired", "around_step", "on_update", "snapshot_state", "on_state", "from_env"]

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


_fault: Fault | None = None
_updates: dict[str, int] = defaultdict(int)
_states: dict[str, int] = defaultdict(int)
_snapshots: dict[str, dict[str, torch.Tensor]] = {}


def arm(fault: Fault) -> None:
    global _fault
    _fault = fault
    _updates.clear()
    _states.clear()
    _snapshots.clear()


def disarm() -> None:
    global _fault
    _fault = None
    _updates.clear()
    _states.clear()
    _snapshots.clear()


def armed() -> Fault | None:
    return _fault


def fired(name: str | None = None) -> bool:
    """True once the armed fault (on ``name``, default its own parameter) has been applied."""
    f = _fault
    if f is None or (name is not None and name != f.param):
        return False
    count = _updates.get(f.param, 0) if f.kind == "ulp" else _states.get(f.param, 0)
    return count >= f.step


@contextlib.contextmanager
def around_step(optimizer: torch.optim.Optimizer, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Wrap one local optimizer step over ``named`` (name, master) pairs with the fault hooks.

    Costs one global read when no fault is armed. With a fault armed: snapshot before the step,
    then (possibly) restore the state and perturb the freshly updated value, before anything is sent.
    """
    if _fault is None:
        yield
        return
    pairs = [(n, p) for n, p in named if n == _fault.param]
    for n, p in pairs:
        snapshot_state(n, optimizer, p)
    yield
    for n, p in pairs:
        on_state(n, optimizer, p)
        on_update(n, p.detach())


def from_env(var: str = "CANZONA_FAULT") -> Fault | None:
    """Arm the fault described in the environment variable, if set; return it."""
    text = os.environ.get(var, "").strip()
    if not text:
        return None
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{var}: expected key=value pairs, got {part!r}")
        fields[key.strip()] = value.strip()
    unknown = set(fields) - {"kind", "param", "step", "index"}
    if unknown or "kind" not in fields or "param" not in fields:
        raise ValueError(f"{var}: needs kind= and param= (optional step=, index=), got {text!r}")
    fault = Fault(fields["kind"], fields["param"], int(fields.get("step", 1)), int(fields.get("index", 0)))
    arm(fault)
    return fault


def on_update(name: str, value: torch.Tensor) -> None:
    """Called with the freshly computed full (or owned) value of ``name``; may perturb it in place."""
    f = _fault
    if f is None or f.kind != "ulp" or f.param != name:
        return
    _updates[name] += 1
    if _updates[name] != f.step:
        return
    flat = value.view(-1)
    if f.index >= flat.numel():
        raise ValueError(f"fault index {f.index} outside {name} ({flat.numel()} elements)")
    with torch.no_grad():
        x = flat[f.index : f.index + 1]
        x.copy_(torch.nextafter(x, torch.full_like(x, float("inf"))))


def snapshot_state(name: str, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Called before a local optimizer step; remembers ``param``'s state when a stale-state fault targets it."""
    f = _fault
    if f is None or f.kind != "stale_state" or f.param != name:
        return
    state = optimizer.state.get(param, {})
    _snapshots[name] = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def on_state(name: str, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> None:
    """Called after a local optimizer step; restores the snapshot (a lost state update) at the armed step."""
    f = _fault
    if f is None or f.kind != "stale_state" or f.param != name:
        return
    _states[name] += 1
    snap = _snapshots.pop(name, None)
    if _states[name] != f.step or snap is None:
        return
    state = optimizer.state[param]
    with torch.no_grad():
        for k, v in snap.items():
            if k == "step":
                continue  # the step counter advancing is not the defect we model
            state[k].copy_(v)
