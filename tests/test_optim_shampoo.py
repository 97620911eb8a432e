"""Shampoo against independent formulas (float64): roots, directions, grafting, invariance, speed."""

from __future__ import annotations

import pytest
import torch

from canzona.optim import Shampoo, matrix_inverse_root

# shared helpers; _single_thread is an autouse fixture, active here once imported
from test_optim_common import F64, LR_GRID, _gen, _least_squares_loss, _orthogonal, _single_thread  # noqa: F401


def _root_from_stack(blocks: torch.Tensor, eps: float) -> torch.Tensor:
    """(B B^T + eps I)^{-1/4} from the SVD of B = [G_1 ... G_t] (never forms B B^T, never eigh)."""
    u, s, _ = torch.linalg.svd(blocks, full_matrices=True)
    eig = torch.zeros(u.size(0), dtype=F64)
    eig[: s.numel()] = s.square()
    return (u * (eig + eps).pow(-0.25)) @ u.T


def test_matrix_inverse_root_fourth_power_inverts() -> None:
    a = torch.randn(7, 5, generator=_gen(0), dtype=F64)
    stat = a @ a.T  # rank 5 of 7: eps regularization is what makes it invertible
    eps = 1e-3
    root = matrix_inverse_root(stat, 4, eps)
    identity = torch.eye(7, dtype=F64)
    torch.testing.assert_close(torch.linalg.matrix_power(root, 4) @ (stat + eps * identity), identity, rtol=0, atol=1e-10)
    torch.testing.assert_close(root, root.T, rtol=0, atol=1e-14)
    assert torch.linalg.eigvalsh(root).min() > 0


def test_matrix_inverse_root_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="square"):
        matrix_inverse_root(torch.zeros(2, 3, dtype=F64), 4, 0.0)
    with pytest.raises(ValueError, match="root"):
        matrix_inverse_root(torch.eye(2, dtype=F64), 0, 0.0)


def test_first_step_is_polar_factor() -> None:
    """With one gradient, L^{-1/4} G R^{-1/4} = U (S^2+eps)^{-1/2} S V^T -> U V^T (eps -> 0)."""
    g = torch.randn(5, 5, generator=_gen(1), dtype=F64)
    w = torch.zeros(5, 5, dtype=F64, requires_grad=True)
    w.grad = g.clone()
    Shampoo([w], lr=1.0, grafting=None, eps=1e-12).step()
    u, _, vh = torch.linalg.svd(g)
    torch.testing.assert_close(-w.detach(), u @ vh, rtol=0, atol=1e-9)


@pytest.mark.parametrize("shape", [(6, 4), (4, 6)])
def test_direction_matches_stacked_svd_formula(shape: tuple[int, int]) -> None:
    """After t steps the direction is (sum G G^T + eps)^{-1/4} G_t (sum G^T G + eps)^{-1/4}; the
    reference roots come from SVDs of [G_1..G_t] and [G_1; ..; G_t]."""
    eps, lr = 1e-4, 0.1
    grads = [torch.randn(shape, generator=_gen(10 + i), dtype=F64) for i in range(4)]
    w = torch.zeros(shape, dtype=F64, requires_grad=True)
    opt = Shampoo([w], lr=lr, grafting=None, eps=eps)
    expected = torch.zeros(shape, dtype=F64)
    for t, g in enumerate(grads, start=1):
        w.grad = g.clone()
        opt.step()
        left = _root_from_stack(torch.cat(grads[:t], dim=1), eps)
        right = _root_from_stack(torch.cat(grads[:t], dim=0).T, eps)
        expected -= lr * left @ g @ right
        torch.testing.assert_close(w.detach(), expected, rtol=1e-10, atol=1e-12)


def test_precondition_frequency_reuses_cached_roots() -> None:
    eps, f = 1e-4, 3
    grads = [torch.randn(4, 3, generator=_gen(20 + i), dtype=F64) for i in range(5)]
    w = torch.zeros(4, 3, dtype=F64, requires_grad=True)
    opt = Shampoo([w], lr=1.0, grafting=None, eps=eps, precondition_frequency=f)
    expected = torch.zeros(4, 3, dtype=F64)
    for t, g in enumerate(grads, start=1):
        w.grad = g.clone()
        opt.step()
        fresh = ((t - 1) // f) * f + 1  # roots were last computed at step 1, 4, 7, ...
        left = _root_from_stack(torch.cat(grads[:fresh], dim=1), eps)
        right = _root_from_stack(torch.cat(grads[:fresh], dim=0).T, eps)
        expected -= left @ g @ right
        torch.testing.assert_close(w.detach(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("grafting", ["sgd", "adam"])
def test_grafting_takes_norm_of_grafted_update_and_direction_of_shampoo(grafting: str) -> None:
    eps, beta2, graft_eps = 1e-6, 0.9, 1e-8
    grads = [torch.randn(5, 3, generator=_gen(30 + i), dtype=F64) for i in range(3)]
    w = torch.zeros(5, 3, dtype=F64, requires_grad=True)
    opt = Shampoo([w], lr=1.0, grafting=grafting, eps=eps, graft_beta2=beta2, graft_eps=graft_eps)
    v = torch.zeros(5, 3, dtype=F64)
    prev = torch.zeros(5, 3, dtype=F64)
    for t, g in enumerate(grads, start=1):
        w.grad = g.clone()
        opt.step()
        step = prev - w.detach()
        prev = w.detach().clone()
        left = _root_from_stack(torch.cat(grads[:t], dim=1), eps)
        right = _root_from_stack(torch.cat(grads[:t], dim=0).T, eps)
        shampoo_dir = left @ g @ right
        if grafting == "sgd":
            graft = g
        else:
            v = beta2 * v + (1 - beta2) * g * g
            graft = g / (torch.sqrt(v / (1 - beta2**t)) + graft_eps)
        expected = shampoo_dir * (graft.norm() / shampoo_dir.norm())
        torch.testing.assert_close(step, expected, rtol=1e-9, atol=1e-12)


def test_momentum_and_nesterov_and_weight_decay() -> None:
    grads = [torch.randn(3, 3, generator=_gen(40 + i), dtype=F64) for i in range(3)]
    init = torch.randn(3, 3, generator=_gen(49), dtype=F64)
    plain = init.clone().requires_grad_()
    heavy = init.clone().requires_grad_()
    opt_plain = Shampoo([plain], lr=0.1, grafting="sgd")
    opt_heavy = Shampoo([heavy], lr=0.1, grafting="sgd", momentum=0.5, nesterov=True, weight_decay=0.2)
    buf = torch.zeros(3, 3, dtype=F64)
    expected = init.clone()
    for g in grads:
        before = plain.detach().clone()
        plain.grad, heavy.grad = g.clone(), g.clone()
        opt_plain.step()
        opt_heavy.step()
        direction = (before - plain.detach()) / 0.1  # grafted Shampoo direction of this step
        buf = 0.5 * buf + direction
        expected = expected * (1 - 0.1 * 0.2) - 0.1 * (direction + 0.5 * buf)
    torch.testing.assert_close(heavy.detach(), expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("grafting", [None, "sgd"])
def test_orthogonal_change_of_basis_invariance(grafting: str | None) -> None:
    """W' = U W V^T with gradients U G V^T gives iterates U W_t V^T (Adam grafting is elementwise,
    hence basis-dependent, and excluded)."""
    m, n = 5, 4
    u, v = _orthogonal(m, 50), _orthogonal(n, 51)
    grads = [torch.randn(m, n, generator=_gen(60 + i), dtype=F64) for i in range(6)]
    w0 = torch.randn(m, n, generator=_gen(59), dtype=F64)
    w = w0.clone().requires_grad_()
    w_rot = (u @ w0 @ v.T).requires_grad_()
    kw = dict(lr=0.05, grafting=grafting, momentum=0.9, weight_decay=0.1, precondition_frequency=2, eps=1e-6)
    opt, opt_rot = Shampoo([w], **kw), Shampoo([w_rot], **kw)
    for g in grads:
        w.grad, w_rot.grad = g.clone(), u @ g @ v.T
        opt.step()
        opt_rot.step()
    # Invariance holds in real arithmetic; in float64 the two runs differ by rounding amplified by
    # the preconditioners' conditioning. At t = 1 the statistic L = G G^T (5 x 4 gradient) has a
    # zero eigenvalue, computed by eigh (backward stable) only to within u * ||L||, and matrix_inverse_root
    # raises (that value + eps) to -1/4: a relative change of order u * ||L|| / eps in the largest
    # root, hence in the step. The bound below is that amplification, kappa = max ||L_t||, ||R_t||
    # over the preconditioner updates divided by eps, times a small constant for the 6 steps of
    # momentum and decay; it depends on the data, not on the machine's BLAS kernels.
    stats_l = torch.cumsum(torch.stack([g @ g.T for g in grads]), 0)
    stats_r = torch.cumsum(torch.stack([g.T @ g for g in grads]), 0)
    kappa = max(torch.linalg.matrix_norm(stats_l, 2).max(), torch.linalg.matrix_norm(stats_r, 2).max()).item() / kw["eps"]
    bound = 8 * torch.finfo(F64).eps * kappa * w_rot.detach().abs().max().item()
    assert bound < 1e-6  # the check stays meaningful: far below the size of one step (lr 0.05)
    torch.testing.assert_close(w_rot.detach(), u @ w.detach() @ v.T, rtol=0, atol=bound)


def test_beats_sgd_on_ill_conditioned_least_squares() -> None:
    best_sgd = min(_least_squares_loss(lambda p, lr: torch.optim.SGD(p, lr=lr), lr) for lr in LR_GRID)
    best_shampoo = min(_least_squares_loss(lambda p, lr: Shampoo(p, lr=lr, grafting=None), lr) for lr in LR_GRID)
    best_grafted = min(_least_squares_loss(lambda p, lr: Shampoo(p, lr=lr), lr) for lr in LR_GRID)
    assert best_shampoo < 0.5 * best_sgd
    assert best_grafted < 0.5 * best_sgd
