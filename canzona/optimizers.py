"""The optimizer registry: one entry per named optimizer (class, cost-model key, defaults).

Every front end (the :class:`canzona.DistributedOptimizer`, the training loop, the CLI, the
simulator, validation) looks names up here instead of keeping its own list. Importing this module
does not import torch: an entry names its class by ``"module:attribute"`` and :meth:`OptimizerEntry.load`
imports it on demand, so the planner and the simulator stay torch-free.

``matrix`` says whether the optimizer needs whole matrices (Muon, Shampoo, SOAP: Newton-Schulz or
eigendecompositions over the full tensor) or works element by element (AdamW), which is what
decides whether a strategy that cuts matrices (``zero1``) can run it. ``cost_key`` names the cost
model of :mod:`canzona.cost` the planner charges the optimizer's update with.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from canzona.cost import OPTIMIZERS as COST_KEYS

__all__ = [
    "OptimizerEntry",
    "register_optimizer",
    "get_optimizer",
    "optimizer_names",
    "cost_key_for_class",
    "ELEMENTWISE_DEFAULT",
    "check_strategy_optimizer",
]

#: the element-wise optimizer the front ends pair with a matrix optimizer by default
ELEMENTWISE_DEFAULT = "adamw"


@dataclass(frozen=True, slots=True)
class OptimizerEntry:
    """One named optimizer. ``target`` is ``"module:Class"``; ``defaults`` are the hyperparameters
    the training loop uses when the user gives none (``lr`` tuned on the tiny model);
    ``class_aliases`` are further class names costed like this entry (``Adam`` like ``AdamW``)."""

    name: str
    target: str
    cost_key: str
    matrix: bool
    defaults: Mapping[str, Any] = field(default_factory=dict)
    class_aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower():
            raise ValueError(f"optimizer names are non-empty and lower case, got {self.name!r}")
        if ":" not in self.target:
            raise ValueError(f"{self.name}: target must be 'module:Class', got {self.target!r}")
        if self.cost_key not in COST_KEYS:
            raise ValueError(f"{self.name}: cost_key must be one of {', '.join(COST_KEYS)}, got {self.cost_key!r}")
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))

    @property
    def class_name(self) -> str:
        return self.target.rpartition(":")[2]

    def load(self) -> type:
        """The optimizer class (imported on first use)."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


_REGISTRY: dict[str, OptimizerEntry] = {}


def register_optimizer(entry: OptimizerEntry, *, replace: bool = False) -> OptimizerEntry:
    """Add ``entry`` (``replace=True`` to overwrite a name); returns it."""
    if not isinstance(entry, OptimizerEntry):
        raise TypeError(f"register_optimizer takes an OptimizerEntry, got {type(entry).__name__}")
    if entry.name in _REGISTRY and not replace:
        raise ValueError(f"optimizer {entry.name!r} is already registered")
    _REGISTRY[entry.name] = entry
    return entry


def get_optimizer(name: str) -> OptimizerEntry:
    """The entry of optimizer ``name`` (case-insensitive); ValueError naming the choices when unknown."""
    entry = _REGISTRY.get(name.lower()) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(_REGISTRY)}")
    return entry


def optimizer_names(*, matrix: bool | None = None) -> tuple[str, ...]:
    """Registered names in registration order; ``matrix=True`` only matrix optimizers, ``False``
    only element-wise ones."""
    return tuple(n for n, e in _REGISTRY.items() if matrix is None or e.matrix == matrix)


def cost_key_for_class(cls: type, default: str = "muon") -> str:
    """The cost-model key of an optimizer class, by class name (entries and their aliases); classes
    the registry does not know are costed as ``default``."""
    name = cls.__name__
    for e in _REGISTRY.values():
        if name == e.class_name or name in e.class_aliases:
            return e.cost_key
    return default


def check_strategy_optimizer(strategy: str, optimizer: str) -> None:
    """ValueError when ``strategy`` cuts matrices (its record is element-wise only) but
    ``optimizer`` needs whole ones: the one place that rule is worded."""
    from canzona.plan.strategies import get_strategy, strategy_names

    record = get_strategy(strategy)
    entry = get_optimizer(optimizer)
    if record.elementwise_only and entry.matrix:
        ok = ", ".join(optimizer_names(matrix=False))
        others = ", ".join(n for n in strategy_names() if not get_strategy(n).elementwise_only)
        raise ValueError(
            f"{strategy} cuts matrices at equal chunks, so it runs only an element-wise optimizer ({ok}): "
            f"use one with {strategy}, or a strategy that keeps matrices whole ({others}) for {optimizer}"
        )


for _e in (
    OptimizerEntry("muon", "canzona.optim:Muon", "muon", True, {"lr": 0.02}),
    OptimizerEntry("shampoo", "canzona.optim:Shampoo", "shampoo", True, {"lr": 0.003}),
    OptimizerEntry("soap", "canzona.optim:SOAP", "soap", True, {"lr": 0.003}),
    OptimizerEntry("adamw", "torch.optim:AdamW", "adamw", False, {"lr": 0.003}, ("Adam",)),
):
    register_optimizer(_e)
