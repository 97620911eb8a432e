"""Planted defects that the training gate must catch: the suite's own proof that it can fail.

Each defect reproduces a class of bug an earlier gate missed (one that compared every
strategy with ``sc``, which shares the model's TP code, and read state from DP rank 0 only). They
are armed for one cell inside the validation worker (``PlantedFault(cell, "<name>", "defect")``
or ``CANZONA_FAULT="defect=<name>"``), never in the runtime's hot path:

- ``qk-norm-unreduced``: the tiny Qwen3's per-head q/k-norm gradients are no longer summed over
  the TP ranks (``canzona.models.tp``'s all-reduce hook becomes the identity): each TP rank
  steps its replica with a partial gradient;
- ``state-on-dp1``: after the last step, DP rank 1 doubles every floating-point optimizer-state
  tensor it holds (a replica that drifted where a ``state_dict`` never looks);
- ``lr-on-dp1``: DP rank 1 runs with 1.5 x the matrix learning rate (ranks disagree on a
  hyperparameter);
- ``expert-gradient-swap`` (for a model with expert stacks on the ZeRO-1 path): the owner of
  expert :data:`SWAPPED_EXPERT` of the first expert stack steps it with its neighbour's gradient
  (an off-by-one in the expert index), so that one expert's update, and nothing else, is wrong:
  the injected check names the stack and the expert (``first_mismatch["expert"]``).

A defect with a ``fired`` attribute reports whether it could be planted (the cell fails when it
never fired on any rank: a defect that did nothing proves nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEFECTS", "SWAPPED_EXPERT", "Defect"]


class Defect:
    """Hooks the worker calls around one cell: ``setup`` before the model is built (returns an
    undo callable), ``before_step``/``after_step`` around each optimizer step."""

    name = ""

    def setup(self) -> Callable[[], None]:
        return lambda: None

    def before_step(self, step: int, dopt: Any, dp_rank: int) -> None:
        pass

    def after_step(self, step: int, steps: int, dopt: Any, dp_rank: int) -> None:
        pass


class QKNormUnreduced(Defect):
    name = "qk-norm-unreduced"

    def setup(self) -> Callable[[], None]:
        from canzona.models import tp as model_tp

        original = model_tp._allreduce_grad_hook
        model_tp._allreduce_grad_hook = lambda group: (lambda grad: grad)

        def undo() -> None:
            model_tp._allreduce_grad_hook = original

        return undo


class StateOnDP1(Defect):
    name = "state-on-dp1"

    def after_step(self, step: int, steps: int, dopt: Any, dp_rank: int) -> None:
        if step != steps or dp_rank != 1:
            return
        rt = dopt.runtime
        opts = [rt.matrix_opt, rt.elementwise_opt] + ([rt.tp_engine.optimizer] if rt.tp_engine is not None else [])
        with torch.no_grad():
            for opt in opts:
                if opt is None:
                    continue
                for st in opt.state.values():
                    for v in st.values():
                        if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                            v.mul_(2.0)


class LROnDP1(Defect):
    name = "lr-on-dp1"

    def before_step(self, step: int, dopt: Any, dp_rank: int) -> None:
        if step == 1 and dp_rank == 1:
            dopt.param_groups[0]["lr"] *= 1.5


#: the expert of the first expert stack whose update ``expert-gradient-swap`` computes from another's gradient
SWAPPED_EXPERT = 3


class ExpertGradientSwap(Defect):
    name = "expert-gradient-swap"

    def __init__(self) -> None:
        self.fired = False
        self._armed = False

    def before_step(self, step: int, dopt: Any, dp_rank: int) -> None:
        if self._armed:
            return
        self._armed = True
        rt = dopt.runtime
        stacks = [p.name for p in dopt.plan.params if p.role == "experts"]
        if not stacks or rt.matrix_opt is None:
            return
        held = {pc.expert: rt.masters[pc] for pc in rt.pieces if pc.name == stacks[0] and pc.expert is not None}
        k = SWAPPED_EXPERT
        partner = k - 1 if k - 1 in held else k + 1 if k + 1 in held else None
        if k not in held or partner is None:
            return  # another rank owns that expert (or not its neighbour): it plants the defect
        target, source, opt = held[k], held[partner], rt.matrix_opt
        real = opt.step

        def step_with_swapped_gradient(*args: Any, **kwargs: Any) -> Any:
            if target.grad is not None and source.grad is not None:
                target.grad = source.grad.clone()
                self.fired = True
            return real(*args, **kwargs)

        opt.step = step_with_swapped_gradient  # this cell's optimizer instance only


DEFECTS: dict[str, type[Defect]] = {d.name: d for d in (QKNormUnreduced, StateOnDP1, LROnDP1, ExpertGradientSwap)}
