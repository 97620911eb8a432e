"""A small custom matrix optimizer, validated with ``canzona validate`` and the pytest plugin.

:class:`SignMomentum` keeps a momentum buffer per parameter and steps along its element-wise sign,
scaled so that the update of an ``m x n`` matrix has the RMS of ``lr * sqrt(max(1, m / n))``
(the shape factor Muon uses). Everything a parameter's update needs lives in ``self.state[p]``
and depends on that parameter alone: it is *separable*, so canzona runs it exactly under ZeRO-1
DP and TP (each owner or TP host steps the whole matrix)::

    PYTHONPATH=. canzona validate --optimizer examples.sign_momentum:SignMomentum \\
        --optimizer-kwargs '{"lr": 0.01}' --mesh dp2,dp2xtp2

:class:`ClippedSignMomentum` is the same optimizer with gradient clipping by the *global* norm
inside ``step()``: the update of one matrix then depends on every other parameter's gradient,
so no partitioning of the parameters over ranks can reproduce it. The gate refuses it before
running anything and says why.
"""

from __future__ import annotations

import torch

__all__ = ["SignMomentum", "ClippedSignMomentum"]


class SignMomentum(torch.optim.Optimizer):
    """``m <- beta * m + g``; ``p <- p * (1 - lr * wd) - lr * scale * sign(m)`` with
    ``scale = sqrt(max(1, rows / cols))`` for matrices (1 for other shapes)."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9, weight_decay: float = 0.0) -> None:
        if lr <= 0 or not 0 <= beta < 1 or weight_decay < 0:
            raise ValueError(f"invalid hyperparameters lr={lr}, beta={beta}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "beta": beta, "weight_decay": weight_decay})

    @staticmethod
    def _scale(p: torch.Tensor) -> float:
        return max(1.0, p.shape[0] / p.shape[1]) ** 0.5 if p.dim() == 2 else 1.0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, p.grad, group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["momentum"] = torch.zeros_like(p)
        m = state["momentum"]
        m.mul_(group["beta"]).add_(grad)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(torch.sign(m), alpha=-group["lr"] * self._scale(p))


class ClippedSignMomentum(SignMomentum):
    """:class:`SignMomentum` on gradients clipped to a global norm of ``max_norm`` inside ``step()``.
    Deliberately *not separable*: ``canzona validate`` rejects it with the reason."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9, weight_decay: float = 0.0, max_norm: float = 1.0) -> None:
        super().__init__(params, lr=lr, beta=beta, weight_decay=weight_decay)
        self.max_norm = max_norm

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])) if grads else torch.tensor(0.0)
        factor = min(1.0, self.max_norm / (float(total) + 1e-12))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad * factor, group)
        return None
