r"""Full-matrix Shampoo for 2-D parameters (Gupta, Koren, Singer 2018; Anil et al. 2020).

* V. Gupta, T. Koren, Y. Singer, "Shampoo: Preconditioned Stochastic Tensor Optimization",
  ICML 2018, arXiv 1802.09568, Algorithm 1 (matrix case): with ``L_0 = eps I_m``, ``R_0 = eps I_n``

  .. math::
      L_t = L_{t-1} + G_t G_t^\top,\quad R_t = R_{t-1} + G_t^\top G_t,\quad
      W_{t+1} = W_t - \eta\, L_t^{-1/4} G_t R_t^{-1/4}.

  For an order-k tensor the exponent is ``-1/(2k)``; only k = 2 is implemented here and other
  orders are rejected at construction.
* R. Anil, V. Gupta, T. Koren, K. Regan, Y. Singer, "Scalable Second Order Optimization for Deep
  Learning", arXiv 2002.09018: inverse roots recomputed every ``precondition_frequency`` steps
  (stale roots used in between) and *layer-wise grafting*: the step takes Shampoo's direction and
  the grafted optimizer's norm, ``D = ||A_t||_F / ||P_t||_F * P_t``.
* Canzona (arXiv 2602.06079) hosts the full ``L``/``R`` state of a parameter on one rank, which is
  why every quantity below is per parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from ._common import (
    MatrixOptimizerMixin,
    check_beta,
    check_grads_finite,
    check_lr,
    check_nonnegative,
    check_positive_int,
)

__all__ = ["GRAFTING_TYPES", "Shampoo", "matrix_inverse_root"]

GRAFTING_TYPES: tuple[str | None, ...] = ("adam", "sgd", None)


def matrix_inverse_root(stat: Tensor, root: int, eps: float) -> Tensor:
    """``(stat + eps I)^{-1/root}`` of a symmetric positive semi-definite matrix via ``eigh``.

    ``stat`` is a sum of outer products, hence PSD; eigenvalues that rounding pushed below zero
    are clamped to 0 before ``eps`` is added, so the result equals ``(stat + eps I)^{-1/root}``
    exactly in real arithmetic (Gupta et al.'s ``L_0 = eps I`` regularization).
    """
    if stat.ndim != 2 or stat.size(0) != stat.size(1):
        raise ValueError(f"matrix_inverse_root expects a square matrix, got {tuple(stat.shape)}")
    if not isinstance(root, int) or isinstance(root, bool) or root < 1:
        raise ValueError(f"root must be a positive int, got {root!r}")
    check_nonnegative("eps", eps)
    eigenvalues, eigenvectors = torch.linalg.eigh(stat)
    scale = (eigenvalues.clamp(min=0) + eps).pow(-1.0 / root)
    return (eigenvectors * scale) @ eigenvectors.mT


class Shampoo(MatrixOptimizerMixin, Optimizer):
    r"""Full-matrix Shampoo with optional grafting, momentum and decoupled weight decay.

    Per parameter ``W`` (``m x n``) and step ``t`` (1-based):

    1. ``L += G G^T``, ``R += G^T G`` (every step).
    2. If ``(t - 1) % precondition_frequency == 0``: ``L_root = (L + eps I)^{-1/4}``,
       ``R_root = (R + eps I)^{-1/4}`` (:func:`matrix_inverse_root`); otherwise the cached roots.
    3. ``P = L_root G R_root``.
    4. Grafting (Anil et al. 2020): ``"sgd"``: ``A = G``; ``"adam"``: ``v = b2 v + (1 - b2) G*G``,
       ``A = G / (sqrt(v / (1 - b2^t)) + graft_eps)`` (Adam's second-moment normalization, its
       first moment being the shared momentum of step 5); then ``D = ||A||_F / ||P||_F * P``
       (``D = 0`` if ``P = 0``). ``None``: ``D = P``.
    5. Momentum (if ``momentum > 0``): ``M = momentum * M + D``, and ``D = M`` or, with
       ``nesterov``, ``D = D + momentum * M``.
    6. ``W = (1 - lr * weight_decay) W - lr * D`` (decoupled weight decay).

    Only float32/float64 2-D parameters are accepted (``eigh`` has no bfloat16 kernel); the
    statistics live in the parameter's dtype.
    """

    _name = "Shampoo"
    _allowed_dtypes = (torch.float32, torch.float64)

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.0,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        eps: float = 1e-8,
        precondition_frequency: int = 1,
        grafting: str | None = "adam",
        graft_beta2: float = 0.999,
        graft_eps: float = 1e-8,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "eps": eps,
            "precondition_frequency": precondition_frequency,
            "grafting": grafting,
            "graft_beta2": graft_beta2,
            "graft_eps": graft_eps,
        }
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        check_beta("momentum", group["momentum"])
        if not isinstance(group["nesterov"], bool):
            raise TypeError(f"nesterov must be a bool, got {group['nesterov']!r}")
        check_nonnegative("weight_decay", group["weight_decay"])
        check_nonnegative("eps", group["eps"])
        check_positive_int("precondition_frequency", group["precondition_frequency"])
        if group["grafting"] not in GRAFTING_TYPES:
            raise ValueError(f"grafting must be one of {GRAFTING_TYPES}, got {group['grafting']!r}")
        check_beta("graft_beta2", group["graft_beta2"])
        check_nonnegative("graft_eps", group["graft_eps"])

    def _init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:
            m, n = p.shape
            state["step"] = 0
            state["L"] = torch.zeros(m, m, dtype=p.dtype, device=p.device)
            state["R"] = torch.zeros(n, n, dtype=p.dtype, device=p.device)
        if group["grafting"] == "adam" and "graft_exp_avg_sq" not in state:
            state["graft_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if group["momentum"] > 0 and "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @staticmethod
    def _graft(group: dict[str, Any], state: dict[str, Any], grad: Tensor, direction: Tensor) -> Tensor:
        if group["grafting"] is None:
            return direction
        if group["grafting"] == "sgd":
            graft_norm = torch.linalg.vector_norm(grad)
        else:
            beta2 = group["graft_beta2"]
            v = state["graft_exp_avg_sq"]
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            bias_correction2 = 1 - beta2 ** state["step"]
            adam = grad / (v / bias_correction2).sqrt_().add_(group["graft_eps"])
            graft_norm = torch.linalg.vector_norm(adam)
        direction_norm = torch.linalg.vector_norm(direction)
        # A zero gradient gives a zero direction; the graft norm is then zero too, so 0 is right.
        ratio = torch.where(direction_norm > 0, graft_norm / direction_norm, torch.zeros_like(graft_norm))
        return direction * ratio

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Shampoo step over every parameter that has a gradient."""
        loss = self._run_closure(closure)
        check_grads_finite(self._name, self.param_groups)
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = self._init_state(group, p)
                state["step"] += 1
                state["L"].addmm_(grad, grad.mT)
                state["R"].addmm_(grad.mT, grad)
                if (state["step"] - 1) % group["precondition_frequency"] == 0:
                    state["L_inv_root"] = matrix_inverse_root(state["L"], 4, group["eps"])
                    state["R_inv_root"] = matrix_inverse_root(state["R"], 4, group["eps"])
                direction = state["L_inv_root"] @ grad @ state["R_inv_root"]
                direction = self._graft(group, state, grad, direction)
                momentum = group["momentum"]
                if momentum > 0:
                    buf = state["momentum_buffer"]
                    buf.mul_(momentum).add_(direction)
                    direction = direction.add(buf, alpha=momentum) if group["nesterov"] else buf
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(direction, alpha=-group["lr"])
        return loss
