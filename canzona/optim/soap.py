r"""SOAP: Adam in the eigenbasis of Shampoo's preconditioner (Vyas et al. 2024), 2-D parameters.

N. Vyas, D. Morwani, R. Zhao, I. Shapira, D. Brandfonbrener, L. Janson, S. Kakade, "SOAP: Improving
and Stabilizing Shampoo using Adam", arXiv 2409.11321, Algorithms 3 and 4. For ``W`` (``m x n``)
with gradient ``G``:

.. math::
    G' = Q_L^\top G Q_R,\quad M = \beta_1 M + (1-\beta_1) G,\quad M' = Q_L^\top M Q_R,\quad
    V' = \beta_2 V' + (1-\beta_2)\, G' \odot G',

    W \leftarrow W - \eta\,\frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\;
        Q_L \Big(\frac{M'}{\sqrt{V'}+\epsilon}\Big) Q_R^\top,\qquad
    L = \beta_s L + (1-\beta_s) G G^\top,\quad R = \beta_s R + (1-\beta_s) G^\top G,

and every ``precondition_frequency`` steps the bases are refreshed by one power iteration with QR
(Algorithm 4, :func:`refresh_eigenbasis`). The bases are first computed exactly with ``eigh``
(:func:`eigenbasis`). A side longer than ``max_precond_dim`` keeps the identity basis (no ``L`` or
``R`` is stored for it); if both sides do, the update is Adam's.

Decisions (documented because the paper leaves room):

* First moment: kept in the original space and projected with the current basis every step, as in
  the paper and the authors' code. So it is *exactly* rotated whenever the basis changes.
* Second moment: lives in the rotated space and has no exact rotation. ``second_moment_refresh=
  "permute"`` (default, the authors' code and Algorithm 4) reorders it with the same permutation
  that sorts the basis columns by estimated eigenvalue. ``"rotate"`` maps it through the change of
  basis ``O = Q_new^T Q_old`` elementwise-squared, ``V' <- (O_L*O_L) V' (O_R*O_R)^T``, the diagonal
  of the rotated second-moment matrix under an independence assumption; it reduces to the
  permutation when ``O`` is one.
* First step: the paper's loop updates the bases *after* each Adam step, so step 1 needs a basis
  before any statistics exist. With ``skip_first_step=True`` (default, the authors' code) the first
  gradient only initializes ``L``, ``R`` and the ``eigh`` bases; parameters and Adam moments are
  untouched and the Adam step counter does not advance. With ``False`` the first gradient builds
  ``L``, ``R`` and the bases and is then used for an Adam step in that basis (its statistics are
  not added a second time).
* Weight decay is decoupled and applied before the update, as AdamW does:
  ``W <- (1 - lr wd) W - s N``. The authors' code decays after the update,
  ``W <- (1 - lr wd)(W - s N)``, which differs by ``lr wd s N``, second order in the learning rate.
"""

from __future__ import annotations

import math
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

__all__ = ["SECOND_MOMENT_REFRESH", "SOAP", "eigenbasis", "refresh_eigenbasis"]

SECOND_MOMENT_REFRESH: tuple[str, ...] = ("permute", "rotate")


def eigenbasis(stat: Tensor) -> Tensor:
    """Eigenvectors of a symmetric matrix as columns, eigenvalues in descending order (``eigh``)."""
    if stat.ndim != 2 or stat.size(0) != stat.size(1):
        raise ValueError(f"eigenbasis expects a square matrix, got {tuple(stat.shape)}")
    return torch.linalg.eigh(stat).eigenvectors.flip(-1)


def refresh_eigenbasis(stat: Tensor, basis: Tensor) -> tuple[Tensor, Tensor]:
    """One power iteration with QR towards the eigenbasis of ``stat`` (Vyas et al., Algorithm 4).

    The columns of ``basis`` are ordered by their Rayleigh quotients ``q_j^T stat q_j`` (estimated
    eigenvalues), descending; then ``Q_new = qr(stat @ basis[:, order]).Q``. Returns
    ``(Q_new, order)``; ``order`` is what the second moment is permuted with.
    """
    if stat.ndim != 2 or stat.shape != basis.shape or stat.size(0) != stat.size(1):
        raise ValueError(
            f"refresh_eigenbasis expects square matrices of one shape, got {tuple(stat.shape)} "
            f"and {tuple(basis.shape)}"
        )
    power = stat @ basis
    estimated = (basis * power).sum(dim=0)
    order = torch.argsort(estimated, descending=True, stable=True)
    q, _ = torch.linalg.qr(power[:, order])
    return q, order


class SOAP(MatrixOptimizerMixin, Optimizer):
    """SOAP (Vyas et al. 2024) for float32/float64 2-D parameters; see the module docstring.

    State per parameter: ``step`` (Adam steps taken), ``exp_avg`` (original space),
    ``exp_avg_sq`` (rotated space), and for each preconditioned side ``L``/``Q_L``, ``R``/``Q_R``.
    ``correct_bias`` applies Adam's bias correction to the step size.
    """

    _name = "SOAP"
    _allowed_dtypes = (torch.float32, torch.float64)

    def __init__(
        self,
        params: Any,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_precond_dim: int = 10000,
        correct_bias: bool = True,
        *,
        skip_first_step: bool = True,
        second_moment_refresh: str = "permute",
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "shampoo_beta": shampoo_beta,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "max_precond_dim": max_precond_dim,
            "correct_bias": correct_bias,
            "skip_first_step": skip_first_step,
            "second_moment_refresh": second_moment_refresh,
        }
        super().__init__(params, defaults)

    def _validate_group(self, group: dict[str, Any]) -> None:
        check_lr(group["lr"])
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_beta("betas[0]", betas[0])
        check_beta("betas[1]", betas[1])
        check_beta("shampoo_beta", group["shampoo_beta"])
        check_nonnegative("eps", group["eps"])
        check_nonnegative("weight_decay", group["weight_decay"])
        check_positive_int("precondition_frequency", group["precondition_frequency"])
        check_positive_int("max_precond_dim", group["max_precond_dim"])
        for flag in ("correct_bias", "skip_first_step"):
            if not isinstance(group[flag], bool):
                raise TypeError(f"{flag} must be a bool, got {group[flag]!r}")
        if group["second_moment_refresh"] not in SECOND_MOMENT_REFRESH:
            raise ValueError(
                f"second_moment_refresh must be one of {SECOND_MOMENT_REFRESH}, "
                f"got {group['second_moment_refresh']!r}"
            )

    @staticmethod
    def _update_stats(group: dict[str, Any], state: dict[str, Any], grad: Tensor) -> None:
        weight = 1 - group["shampoo_beta"]
        if "L" in state:
            state["L"].lerp_(grad @ grad.mT, weight)
        if "R" in state:
            state["R"].lerp_(grad.mT @ grad, weight)

    @staticmethod
    def _project(state: dict[str, Any], x: Tensor) -> Tensor:
        if "Q_L" in state:
            x = state["Q_L"].mT @ x
        if "Q_R" in state:
            x = x @ state["Q_R"]
        return x

    @staticmethod
    def _project_back(state: dict[str, Any], x: Tensor) -> Tensor:
        if "Q_L" in state:
            x = state["Q_L"] @ x
        if "Q_R" in state:
            x = x @ state["Q_R"].mT
        return x

    def _init_state(self, group: dict[str, Any], p: Tensor, grad: Tensor) -> dict[str, Any]:
        state = self.state[p]
        m, n = p.shape
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if m <= group["max_precond_dim"]:
            state["L"] = torch.zeros(m, m, dtype=p.dtype, device=p.device)
        if n <= group["max_precond_dim"]:
            state["R"] = torch.zeros(n, n, dtype=p.dtype, device=p.device)
        self._update_stats(group, state, grad)
        if "L" in state:
            state["Q_L"] = eigenbasis(state["L"])
        if "R" in state:
            state["Q_R"] = eigenbasis(state["R"])
        return state

    @staticmethod
    def _refresh(group: dict[str, Any], state: dict[str, Any]) -> None:
        v = state["exp_avg_sq"]
        for side, dim in (("L", 0), ("R", 1)):
            if side not in state:
                continue
            old = state[f"Q_{side}"]
            new, order = refresh_eigenbasis(state[side], old)
            if group["second_moment_refresh"] == "permute":
                v = v.index_select(dim, order)
            else:
                mix = (new.mT @ old).square()
                v = mix @ v if dim == 0 else v @ mix.mT
            state[f"Q_{side}"] = new
        state["exp_avg_sq"].copy_(v)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One SOAP step over every parameter that has a gradient."""
        loss = self._run_closure(closure)
        check_grads_finite(self._name, self.param_groups)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = p.grad
                if grad is None:
                    continue
                state = self.state[p]
                fresh = "step" not in state
                if fresh:
                    state = self._init_state(group, p, grad)
                    if group["skip_first_step"]:
                        continue
                state["step"] += 1
                t = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                grad_rot = self._project(state, grad)
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad_rot, grad_rot, value=1 - beta2)
                denom = exp_avg_sq.sqrt().add_(group["eps"])
                update = self._project_back(state, self._project(state, exp_avg) / denom)
                step_size = group["lr"]
                if group["correct_bias"]:
                    step_size = step_size * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-step_size)
                if not fresh:
                    self._update_stats(group, state, grad)
                if t % group["precondition_frequency"] == 0:
                    self._refresh(group, state)
        return loss
