"""SOAP against independent formulas (float64): first step, eigenbasis, QR refresh, moments,
max_precond_dim fallback to Adam, invariance, and speed against SGD."""

from __future__ import annotations

import math

import pytest
import torch

from canzona.optim import SOAP, eigenbasis, refresh_eigenbasis

# shared helpers; _single_thread is an autouse fixture, active here once imported
from test_optim_common import F64, LR_GRID, _gen, _least_squares_loss, _orthogonal, _single_thread  # noqa: F401


def test_first_step_only_initializes_by_default() -> None:
    g = torch.randn(4, 3, generator=_gen(0), dtype=F64)
    w0 = torch.randn(4, 3, generator=_gen(1), dtype=F64)
    w = w0.clone().requires_grad_()
    opt = SOAP([w], lr=0.1, weight_decay=0.1, shampoo_beta=0.8)
    w.grad = g
    opt.step()
    assert torch.equal(w.detach(), w0)
    state = opt.state[w]
    assert state["step"] == 0
    assert torch.equal(state["exp_avg"], torch.zeros_like(g)) and torch.equal(state["exp_avg_sq"], torch.zeros_like(g))
    torch.testing.assert_close(state["L"], 0.2 * g @ g.T, rtol=1e-14, atol=0)
    torch.testing.assert_close(state["R"], 0.2 * g.T @ g, rtol=1e-14, atol=0)
    # Q_L holds the eigenvectors of L, largest first: compare with G's left singular vectors.
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    torch.testing.assert_close((state["Q_L"][:, :3].T @ u).abs(), torch.eye(3, dtype=F64), rtol=0, atol=1e-10)
    torch.testing.assert_close((state["Q_R"].T @ vh.T).abs(), torch.eye(3, dtype=F64), rtol=0, atol=1e-10)


def _expected_first_update(g1: torch.Tensor, g2: torch.Tensor, lr: float, betas: tuple[float, float], eps: float) -> torch.Tensor:
    """Vyas et al. Algorithm 3 at Adam step 1 with the basis of G_1, written from the SVD of G_1
    (eigenvectors of G G^T and G^T G up to sign; the signs cancel between projection and back)."""
    beta1, beta2 = betas
    u, _, vh = torch.linalg.svd(g1)
    g_rot = u.T @ g2 @ vh.T
    m_rot = (1 - beta1) * g_rot
    v_rot = (1 - beta2) * g_rot.square()
    step_size = lr * math.sqrt(1 - beta2) / (1 - beta1)
    return -step_size * (u @ (m_rot / (v_rot.sqrt() + eps)) @ vh)


def test_second_step_is_adam_in_eigenbasis_of_first_gradient() -> None:
    g1, g2 = (torch.randn(5, 5, generator=_gen(s), dtype=F64) for s in (2, 3))
    w = torch.zeros(5, 5, dtype=F64, requires_grad=True)
    betas, eps, lr = (0.9, 0.99), 1e-8, 0.01
    opt = SOAP([w], lr=lr, betas=betas, eps=eps, weight_decay=0.0)
    for g in (g1, g2):
        w.grad = g.clone()
        opt.step()
    torch.testing.assert_close(w.detach(), _expected_first_update(g1, g2, lr, betas, eps), rtol=1e-9, atol=1e-12)


def test_no_skip_updates_on_first_step_with_its_own_basis() -> None:
    g1 = torch.randn(5, 5, generator=_gen(4), dtype=F64)
    w = torch.zeros(5, 5, dtype=F64, requires_grad=True)
    # G_1 in its own eigenbasis is diagonal up to rounding (~1e-16); eps = 1e-3 keeps those rounding
    # residues from being amplified by 1 / (|x| + eps).
    betas, eps, lr, beta_s = (0.9, 0.99), 1e-3, 0.01, 0.7
    opt = SOAP([w], lr=lr, betas=betas, eps=eps, weight_decay=0.0, shampoo_beta=beta_s, skip_first_step=False)
    w.grad = g1.clone()
    opt.step()
    torch.testing.assert_close(w.detach(), _expected_first_update(g1, g1, lr, betas, eps), rtol=1e-9, atol=1e-12)
    assert opt.state[w]["step"] == 1
    # The first gradient's statistics are counted once.
    torch.testing.assert_close(opt.state[w]["L"], (1 - beta_s) * g1 @ g1.T, rtol=1e-14, atol=0)


def test_statistics_are_ema_with_shampoo_beta() -> None:
    grads = [torch.randn(3, 4, generator=_gen(10 + i), dtype=F64) for i in range(4)]
    w = torch.zeros(3, 4, dtype=F64, requires_grad=True)
    opt = SOAP([w], shampoo_beta=0.6, precondition_frequency=100)
    left, right = torch.zeros(3, 3, dtype=F64), torch.zeros(4, 4, dtype=F64)
    for g in grads:
        w.grad = g.clone()
        opt.step()
        left = 0.6 * left + 0.4 * g @ g.T
        right = 0.6 * right + 0.4 * g.T @ g
    torch.testing.assert_close(opt.state[w]["L"], left, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(opt.state[w]["R"], right, rtol=1e-13, atol=1e-15)


def test_eigenbasis_descending_and_refresh_sorts_and_converges() -> None:
    q_true = _orthogonal(6, 20)
    eigenvalues = torch.tensor([9.0, 5.0, 3.0, 2.0, 1.0, 0.5], dtype=F64)
    stat = (q_true * eigenvalues) @ q_true.T
    basis = eigenbasis(stat)
    torch.testing.assert_close((basis.T @ q_true).abs(), torch.eye(6, dtype=F64), rtol=0, atol=1e-10)
    # An exact eigenbasis in scrambled order: one refresh restores descending order, same vectors.
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    refreshed, order = refresh_eigenbasis(stat, q_true[:, perm])
    assert torch.equal(perm[order], torch.arange(6))
    torch.testing.assert_close((refreshed.T @ q_true).abs(), torch.eye(6, dtype=F64), rtol=0, atol=1e-12)
    # A perturbed basis gets closer to diagonalizing stat with each power iteration.
    noisy, _ = torch.linalg.qr(q_true + 0.05 * torch.randn(6, 6, generator=_gen(21), dtype=F64))

    def off_diagonal(q: torch.Tensor) -> float:
        d = q.T @ stat @ q
        return (d - torch.diag(torch.diagonal(d))).norm().item()

    errors = [off_diagonal(noisy)]
    for _ in range(3):
        noisy, _ = refresh_eigenbasis(stat, noisy)
        errors.append(off_diagonal(noisy))
    assert errors[0] > errors[1] > errors[2] > errors[3]


def test_refresh_permutes_second_moment_with_basis() -> None:
    """A state whose basis is an exact eigenbasis in the wrong order: after the refresh the basis
    is sorted and V was permuted along, so the preconditioned update is unchanged."""
    w = torch.zeros(4, 4, dtype=F64, requires_grad=True)
    opt = SOAP([w], precondition_frequency=1, skip_first_step=False)
    w.grad = torch.randn(4, 4, generator=_gen(30), dtype=F64)
    opt.step()
    state = opt.state[w]
    perm = torch.tensor([2, 0, 3, 1])
    state["Q_L"] = state["Q_L"][:, perm]
    v_before = state["exp_avg_sq"].clone()
    q_sorted = opt.state[w]["Q_L"][:, torch.argsort(perm)].clone()
    SOAP._refresh(opt.param_groups[0], state)
    # Column i of the scrambled basis has eigenvalue rank perm[i]; sorting applies argsort(perm)
    # to the columns and, with them, to the rows of V.
    assert torch.equal(state["exp_avg_sq"], v_before[torch.argsort(perm)])
    torch.testing.assert_close((state["Q_L"].T @ q_sorted).abs(), torch.eye(4, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mode", ["permute", "rotate"])
def test_second_moment_refresh_modes_agree_on_permutation(mode: str) -> None:
    """When the new basis is a column permutation of the old one, rotating V elementwise-squared
    is that permutation, so both modes give the same state."""
    w = torch.zeros(4, 3, dtype=F64, requires_grad=True)
    opt = SOAP([w], precondition_frequency=1, skip_first_step=False, second_moment_refresh=mode)
    w.grad = torch.randn(4, 3, generator=_gen(31), dtype=F64)
    opt.step()
    state = opt.state[w]
    state["Q_L"] = state["Q_L"][:, torch.tensor([1, 3, 0, 2])]
    v_before = state["exp_avg_sq"].clone()
    SOAP._refresh(opt.param_groups[0], state)
    torch.testing.assert_close(state["exp_avg_sq"], v_before[torch.tensor([2, 0, 3, 1])], rtol=0, atol=1e-12)


def test_max_precond_dim_falls_back_to_identity_and_adam() -> None:
    w = torch.zeros(3, 20, dtype=F64, requires_grad=True)
    opt = SOAP([w], max_precond_dim=10)
    w.grad = torch.randn(3, 20, dtype=F64)
    opt.step()
    assert {"L", "Q_L"} <= opt.state[w].keys() and not {"R", "Q_R"} & opt.state[w].keys()

    # Both sides too large: SOAP is Adam (torch.optim.Adam puts eps after bias correction, so use
    # a negligible eps and compare to rounding level rather than bitwise).
    grads = [torch.randn(4, 5, generator=_gen(40 + i), dtype=F64) for i in range(6)]
    init = torch.randn(4, 5, generator=_gen(49), dtype=F64)
    a, b = init.clone().requires_grad_(), init.clone().requires_grad_()
    soap = SOAP([a], lr=0.01, betas=(0.9, 0.999), eps=1e-30, weight_decay=0.0, max_precond_dim=3, skip_first_step=False)
    adam = torch.optim.Adam([b], lr=0.01, betas=(0.9, 0.999), eps=1e-30)
    for g in grads:
        a.grad, b.grad = g.clone(), g.clone()
        soap.step()
        adam.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-13, atol=1e-15)


def test_weight_decay_is_decoupled() -> None:
    init = torch.randn(3, 3, generator=_gen(50), dtype=F64)
    a, b = init.clone().requires_grad_(), init.clone().requires_grad_()
    opt_a = SOAP([a], lr=0.1, weight_decay=0.0, skip_first_step=False)
    opt_b = SOAP([b], lr=0.1, weight_decay=0.5, skip_first_step=False)
    g = torch.randn(3, 3, generator=_gen(51), dtype=F64)
    a.grad, b.grad = g.clone(), g.clone()
    opt_a.step()
    opt_b.step()
    torch.testing.assert_close(b.detach(), a.detach() - 0.1 * 0.5 * init, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("mode", ["permute", "rotate"])
def test_orthogonal_change_of_basis_invariance(mode: str) -> None:
    """Square W (full-rank statistics, distinct eigenvalues): W' = U W V^T with gradients U G V^T
    gives U W_t V^T; eigenvector signs cancel between projection and projection back."""
    n = 5
    u, v = _orthogonal(n, 60), _orthogonal(n, 61)
    grads = [torch.randn(n, n, generator=_gen(70 + i), dtype=F64) for i in range(8)]
    w0 = torch.randn(n, n, generator=_gen(69), dtype=F64)
    w = w0.clone().requires_grad_()
    w_rot = (u @ w0 @ v.T).requires_grad_()
    kw = dict(lr=0.01, precondition_frequency=2, weight_decay=0.1, second_moment_refresh=mode)
    opt, opt_rot = SOAP([w], **kw), SOAP([w_rot], **kw)
    for g in grads:
        w.grad, w_rot.grad = g.clone(), u @ g @ v.T
        opt.step()
        opt_rot.step()
    torch.testing.assert_close(w_rot.detach(), u @ w.detach() @ v.T, rtol=1e-8, atol=1e-10)


def test_beats_sgd_on_ill_conditioned_least_squares() -> None:
    best_sgd = min(_least_squares_loss(lambda p, lr: torch.optim.SGD(p, lr=lr), lr) for lr in LR_GRID)
    best_soap = min(
        _least_squares_loss(
            lambda p, lr: SOAP(p, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, precondition_frequency=2), lr
        )
        for lr in LR_GRID
    )
    assert best_soap < 0.5 * best_sgd
