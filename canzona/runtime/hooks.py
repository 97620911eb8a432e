"""Per-update hooks: see each parameter's freshly updated value on the rank that computed it.

A hook is registered on a runtime (``DPRuntime``, ``TPEngine``, ``FSDPRuntime``) or on the front
end (``DistributedOptimizer.register_update_hook``), in the manner of torch's
``Optimizer.register_step_post_hook``, and returns a handle whose ``remove()`` detaches it.

After every local optimizer step the runtime calls ``hook(name, param, optimizer)`` once per
parameter that this rank has just updated *whole* (the DP owner of a whole parameter, every TP
rank of the owner's replica for a parameter that is not TP-split, the TP or FSDP host of a
matrix), before the value is sent anywhere:

- ``name``: the parameter's name in the plan;
- ``param``: the full-shape master holding the updated value (fp32 by default); the hook may
  change it in place and the change travels to every replica like the update itself;
- ``optimizer``: the optimizer holding the parameter's state (``optimizer.state[param]``).

A hook that also defines ``before_update(name, param, optimizer)`` is called with the same
arguments just before the step (``param`` still holds the old value). Both run under
``torch.no_grad()``. Parameters cut into element ranges (``zero1``'s element-wise parameters,
FSDP2's element-wise pieces) are updated piecewise and no rank computes their full value: hooks
do not see them. With no hook registered a step pays one truth test per local optimizer step.

Two clients: :class:`UpdateNormLog` (below) and the planted defects of
:mod:`validation.faults` that the exactness suite must catch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["RemovableHandle", "UpdateHook", "UpdateHooks", "UpdateNormLog"]

#: ``hook(name, param, optimizer)``; optionally with a ``before_update`` method of the same signature
UpdateHook = Callable[[str, torch.Tensor, torch.optim.Optimizer], None]


class UpdateHooks(OrderedDict):
    """The hooks registered on one runtime (shared with the engines it drives), by handle id.
    A plain (ordered) dict underneath, so the call sites' ``if hooks:`` is the dict's own
    emptiness test; :class:`RemovableHandle` deletes its entry on ``remove()``."""

    def register(self, hook: UpdateHook) -> RemovableHandle:
        if not callable(hook):
            raise TypeError(f"an update hook must be callable as hook(name, param, optimizer), got {type(hook).__name__}")
        before = getattr(hook, "before_update", None)
        if before is not None and not callable(before):
            raise TypeError(f"{type(hook).__name__}.before_update must be callable")
        handle = RemovableHandle(self)
        self[handle.id] = hook
        return handle

    def step(self, optimizer: torch.optim.Optimizer, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """``optimizer.step()`` (in the caller's grad mode) with every hook around it, for the
        ``(name, master)`` pairs in ``named``."""
        hooks = list(self.values())
        with torch.no_grad():
            for hook in hooks:
                before = getattr(hook, "before_update", None)
                if before is not None:
                    for name, p in named:
                        before(name, p, optimizer)
        optimizer.step()
        with torch.no_grad():
            for hook in hooks:
                for name, p in named:
                    hook(name, p, optimizer)


class UpdateNormLog:
    """Records ``||update||`` and ``||param||`` (2-norms over the whole parameter, in the master
    dtype) of every parameter a rank updates, per update, as an update hook::

        log = UpdateNormLog()
        handle = opt.register_update_hook(log)
        ...train...
        table = log.gather()          # collective: every rank gets every parameter's rows
        table["layers.0.mlp.up_proj.weight"][-1]   # (step, ||update||, ||param||) of the last step

    ``step`` counts this parameter's updates on this rank from 1; it equals the training step
    unless a step left the parameter alone (no gradient on any rank). The norms stay 0-dim
    tensors on the parameter's device until :meth:`rows` or :meth:`gather` reads them, so
    recording adds no host synchronisation to a step. The old value is copied before each step
    (one copy of the parameters this rank updates, while the hook is registered).
    """

    def __init__(self) -> None:
        self._before: dict[str, torch.Tensor] = {}
        self._records: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def before_update(self, name: str, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self._before[name] = param.detach().clone()

    def __call__(self, name: str, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        old = self._before.pop(name)
        new = param.detach()
        self._records.setdefault(name, []).append((torch.linalg.vector_norm(new - old), torch.linalg.vector_norm(new)))

    def clear(self) -> None:
        self._records.clear()

    def rows(self) -> dict[str, list[tuple[int, float, float]]]:
        """This rank's records: name -> [(step, ||update||, ||param||), ...] in update order."""
        return {
            n: [(k, float(u), float(p)) for k, (u, p) in enumerate(recs, start=1)] for n, recs in sorted(self._records.items())
        }

    def ratios(self) -> dict[str, list[float]]:
        """This rank's ``||update|| / ||param||`` per parameter and update (inf for a zero parameter)."""
        return {n: [u / p if p else float("inf") for _, u, p in rows] for n, rows in self.rows().items()}

    def gather(self, group: Any = None) -> dict[str, list[tuple[int, float, float]]]:
        """Every rank's :meth:`rows`, merged (collective over ``group``, default the world). A
        parameter that several ranks update (TP ranks of the owner's replica, for a parameter
        that is not TP-split) computes bitwise-equal values on each; the lowest rank's rows are kept."""
        import torch.distributed as dist

        mine = self.rows()
        if not dist.is_available() or not dist.is_initialized():
            return mine
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
        out: dict[str, list[tuple[int, float, float]]] = {}
        for part in parts:
            for n, rows in part.items():
                out.setdefault(n, rows)
        return dict(sorted(out.items()))
