"""Layouts: the ways a model's parameters can be laid out across ranks, one module each.

:class:`canzona.DistributedOptimizer` is one front end; it asks :func:`choose_layout` which layout
the model has and builds that layout object (interface: :class:`canzona.layouts.base.Layout`):

- :class:`~canzona.layouts.ep.EPLayout` for models holding expert stacks sharded over an ``ep``
  mesh dimension and no FSDP2 module (expert parallelism on canzona's ZeRO-1 path);
- :class:`~canzona.layouts.fsdp2.FSDP2Layout` for models holding FSDP2 ``fully_shard`` modules,
  with or without expert parallelism (expert stacks on their own ``ep`` mesh);
- :class:`~canzona.layouts.zero1.Zero1Layout` (canzona's ZeRO-1 buffer, the paper's Sections 3 and
  4) for every other model, plain or DTensor tensor-parallel.

The choice is read from the model itself, never from an option, so the user never describes the
layout twice. A new layout goes in its own module here and in :data:`LAYOUTS`, ahead of the ZeRO-1
fallback. Submodules are imported on demand: choosing needs neither FSDP2 nor the planner loaded.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["LAYOUTS", "choose_layout"]

#: (module, class) of every layout, in the order they are asked; the last one serves any model
LAYOUTS: tuple[tuple[str, str], ...] = (
    ("canzona.layouts.ep", "EPLayout"),
    ("canzona.layouts.fsdp2", "FSDP2Layout"),
    ("canzona.layouts.zero1", "Zero1Layout"),
)


def choose_layout(model: Any) -> type:
    """The :class:`~canzona.layouts.base.Layout` subclass that serves ``model``."""
    for module, name in LAYOUTS:
        cls = getattr(import_module(module), name)
        if cls.serves(model):
            return cls
    raise AssertionError("the ZeRO-1 layout serves every model")  # unreachable: the last entry says yes
