"""Muon against torch.optim.Muon (bitwise), Newton-Schulz math, batching, lr scalings."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import canzona.optim.muon as muon_mod
from canzona.optim import Muon, adjust_lr, batched_newton_schulz, newton_schulz

# _single_thread is an autouse fixture, active here once imported
from test_optim_common import _single_thread  # noqa: F401


SHAPES = {"square": (24, 24), "wide": (12, 40), "tall": (40, 12), "row": (1, 40)}


def _grads(shape: tuple[int, int], steps: int, seed: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(steps)]


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
def test_bitwise_equal_to_torch_muon(shape_name: str, nesterov: bool, weight_decay: float, adjust_lr_fn: str) -> None:
    shape = SHAPES[shape_name]
    init = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = init.clone().requires_grad_()
    ref = init.clone().requires_grad_()
    kwargs = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay, adjust_lr_fn=adjust_lr_fn)
    opt = Muon([ours], **kwargs)
    ref_opt = torch.optim.Muon([ref], **kwargs)
    for g in _grads(shape, 10, seed=2):
        ours.grad = g.clone()
        ref.grad = g.clone()
        opt.step()
        ref_opt.step()
    assert torch.equal(ours, ref)
    assert torch.equal(opt.state[ours]["momentum_buffer"], ref_opt.state[ref]["momentum_buffer"])
    assert not torch.equal(ours, init)


def test_default_arguments_match_torch() -> None:
    p = torch.zeros(3, 3, requires_grad=True)
    ours, ref = Muon([p]).defaults, torch.optim.Muon([p]).defaults
    for key in ("lr", "weight_decay", "momentum", "nesterov", "eps", "ns_steps", "adjust_lr_fn"):
        assert ours[key] == ref[key], key
    assert tuple(ours["ns_coefficients"]) == tuple(ref["ns_coefficients"])


def test_torch_private_helpers_agree() -> None:
    """Our Newton-Schulz and lr scalings are op-for-op torch's private helpers."""
    muon_mod = pytest.importorskip("torch.optim._muon")
    ns = getattr(muon_mod, "_zeropower_via_newtonschulz", None)
    torch_adjust = getattr(muon_mod, "_adjust_lr", None)
    if ns is None or torch_adjust is None:
        pytest.skip("torch's private Muon helpers moved")
    for shape in [(24, 24), (12, 40), (40, 12), (1, 40), (40, 1), (7, 5)]:
        g = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        assert torch.equal(newton_schulz(g), ns(g, (3.4445, -4.7750, 2.0315), 5, 1e-7))
        for fn in (None, "original", "match_rms_adamw"):
            assert adjust_lr(0.02, fn, torch.Size(shape)) == torch_adjust(0.02, fn, torch.Size(shape))


def test_cubic_newton_schulz_converges_to_polar_factor() -> None:
    """(1.5, -0.5, 0) is the classical cubic iteration X <- 1.5X - 0.5 X X^T X -> U V^T."""
    gen = torch.Generator().manual_seed(3)
    for shape in [(6, 6), (4, 9), (9, 4)]:
        u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=gen, dtype=torch.float64))
        v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=gen, dtype=torch.float64))
        k = min(shape)
        s = torch.linspace(1.0, 3.0, k, dtype=torch.float64)  # condition number 3: fast convergence
        g = u[:, :k] @ torch.diag(s) @ v[:, :k].T
        polar = u[:, :k] @ v[:, :k].T
        x = newton_schulz(g, steps=40, coefficients=(1.5, -0.5, 0.0), dtype=None)
        assert x.dtype == torch.float64
        torch.testing.assert_close(x, polar, rtol=0, atol=1e-12)


def test_quintic_newton_schulz_singular_values_in_band() -> None:
    g = torch.randn(32, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    s = torch.linalg.svdvals(newton_schulz(g, dtype=None))
    # Jordan's coefficients trade exactness for speed: singular values land near [0.7, 1.2].
    assert s.min() > 0.6 and s.max() < 1.25


def test_newton_schulz_does_not_mutate_input() -> None:
    g = torch.randn(6, 4, dtype=torch.bfloat16)
    keep = g.clone()
    newton_schulz(g)
    assert torch.equal(g, keep)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    keep = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(keep)


@pytest.mark.parametrize("shape", [(33, 2), (1, 40), (40, 1), (7, 5), (9, 73), (20, 11), (24, 24), (12, 40), (40, 12),
                                   (24, 16), (96, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_newton_schulz_within_bound_of_loop(shape: tuple[int, int], dtype: torch.dtype, threads: int) -> None:
    """Batched and looped products may sum in different orders (see batched_newton_schulz's
    docstring); the outputs have spectral norm <= ~1.2, so an absolute bound of 64 unit roundoffs
    of the compute dtype is the documented worst case (measured <= 23 u). 24 x 16 in bf16 and
    96 x 64 in float32 on two threads are shapes where an AVX-512 CPU's batched chain differs."""
    mats = _grads(shape, 8, seed=6, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    with _threads(threads):
        loop = torch.stack([newton_schulz(m, dtype=dtype) for m in mats])
        batched = batched_newton_schulz(mats, dtype=dtype)
    assert batched.dtype == loop.dtype == dtype
    diff = (batched.double() - loop.double()).abs().max().item()
    assert diff <= 64 * torch.finfo(dtype).eps


def test_batched_newton_schulz_takes_a_list_or_a_stack() -> None:
    mats = _grads((24, 16), 3, seed=5)
    assert torch.equal(batched_newton_schulz(mats), batched_newton_schulz(torch.stack(mats)))


def test_batched_newton_schulz_rejects_mixed_shapes() -> None:
    with pytest.raises(ValueError, match="shape"):
        batched_newton_schulz([torch.randn(3, 4), torch.randn(4, 3)])
    with pytest.raises(ValueError, match="at least one"):
        batched_newton_schulz([])


# The expert shapes of Qwen3-30B-A3B scaled down, a square expert, Mixtral's tiny (E, 192, 64), and
# a small expert (24 x 16) whose bf16 batched chain differs from the loop for some inputs on an
# AVX-512 CPU (docs/roles.md, "Batched Newton-Schulz").
EXPERT_SHAPES = [(96, 64), (64, 96), (384, 256), (256, 384), (64, 64), (192, 64), (64, 192), (24, 16)]


def _run_modes(shapes: list[tuple[int, int]], ns_dtype: torch.dtype | None, modes: list[Any],
               monkeypatch: pytest.MonkeyPatch, steps: int = 3) -> tuple[list[list[torch.Tensor]], list[list[int]]]:
    """Step the same parameters under each ``batched`` mode of ``modes`` (``"alone"``: every
    parameter in a Muon of its own); count the matrices of every batched chain each mode runs."""
    gen = torch.Generator().manual_seed(7)
    inits = [torch.randn(s, generator=gen) for s in shapes]
    runs = [[t.clone().requires_grad_() for t in inits] for _ in modes]
    opts = [[Muon([p], lr=0.05, ns_dtype=ns_dtype) for p in run] if mode == "alone"
            else [Muon(run, lr=0.05, ns_dtype=ns_dtype, **({} if mode == "default" else {"batched": mode}))]
            for mode, run in zip(modes, runs)]
    chains: list[list[int]] = [[] for _ in modes]
    real = muon_mod.batched_newton_schulz
    for _ in range(steps):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for k, (run, group) in enumerate(zip(runs, opts)):
            for p, g in zip(run, grads):
                p.grad = g.clone()
            with monkeypatch.context() as m:
                m.setattr(muon_mod, "batched_newton_schulz", lambda grads, *a, k=k: (chains[k].append(len(grads)), real(grads, *a))[1])
                for opt in group:
                    opt.step()
    return runs, chains


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, None], ids=["bf16-ns", "fp32-ns"])
@pytest.mark.parametrize("threads", [1, 2])
def test_default_steps_every_matrix_alone(ns_dtype: torch.dtype | None, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (and the old ``"auto"``) runs no batched chain, so every parameter of a
    same-shape set (experts of 24 x 16 and 96 x 64, among others) ends bitwise equal to that
    parameter stepped by a Muon of its own, on any CPU and thread count; ``batched=True`` runs one
    chain per same-shape set and stays within the documented bound of the loop."""
    shapes = [(24, 16)] * 8 + [(96, 64)] * 4 + [(64, 192), (9, 73), (64, 192), (9, 73), (40, 24)]
    with _threads(threads):
        (alone, default, auto, forced), chains = _run_modes(shapes, ns_dtype, ["alone", "default", "auto", True], monkeypatch)
    assert chains[0] == chains[1] == chains[2] == []
    assert sorted(chains[3]) == [2, 2, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8]  # 3 steps x (9 x 73, 64 x 192, 96 x 64, 24 x 16)
    for pa, pd, pauto in zip(alone, default, auto):
        assert torch.equal(pa, pd) and torch.equal(pa, pauto)
    eps = torch.finfo(torch.bfloat16 if ns_dtype else torch.float32).eps
    for pa, pf in zip(alone, forced):
        # lr 0.05 x the 'original' scale (<= sqrt(6)) x 3 steps x 64 u bounds the parameter difference
        assert (pa - pf).abs().max().item() <= 3 * 0.05 * 6**0.5 * 64 * eps


@pytest.mark.parametrize("shape", EXPERT_SHAPES)
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, None], ids=["bf16-ns", "fp32-ns"])
def test_batched_ns_within_bound_at_expert_shapes(shape: tuple[int, int], ns_dtype: torch.dtype | None) -> None:
    """What ``batched=True`` gives at the expert shapes: the batched chain within 64 u of the loop
    (bitwise or not, depending on the machine: a finding, printed by profiling/bench_batched_ns.py)."""
    mats = _grads(shape, 4, seed=11)
    loop = torch.stack([newton_schulz(m, dtype=ns_dtype) for m in mats])
    diff = (batched_newton_schulz(mats, dtype=ns_dtype).double() - loop.double()).abs().max().item()
    assert diff <= 64 * torch.finfo(loop.dtype).eps


def test_batched_option_is_checked() -> None:
    with pytest.raises(TypeError, match="'auto'"):
        Muon([torch.zeros(4, 4, requires_grad=True)], batched="yes")


@pytest.mark.parametrize("fn", ["original", "match_rms_adamw", "spectral", "unit_rms", "none"])
@pytest.mark.parametrize("shape", [(12, 40), (40, 12)])
def test_scalings_apply_documented_formula(fn: str, shape: tuple[int, int]) -> None:
    rows, cols = shape
    expected_ratio = {
        "original": math.sqrt(max(1.0, rows / cols)),
        "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
        "spectral": math.sqrt(rows / cols),
        "unit_rms": math.sqrt(max(rows, cols)),
        "none": 1.0,
    }[fn]
    assert adjust_lr(0.5, fn, shape) == 0.5 * expected_ratio
    p = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    start = p.detach().clone()
    g = torch.randn(shape, dtype=torch.float64)
    p.grad = g
    Muon([p], lr=0.5, weight_decay=0.0, momentum=0.0, nesterov=False, adjust_lr_fn=fn, ns_dtype=None).step()
    # add(..., alpha=) may fuse multiply and add, so the reference uses the same call.
    expected = start.add(newton_schulz(g, dtype=None), alpha=-0.5 * expected_ratio)
    assert torch.equal(p.detach(), expected)


def test_unit_rms_scaling_gives_unit_rms_for_exact_polar_factor() -> None:
    for shape in [(12, 40), (40, 12)]:
        q = torch.linalg.svd(torch.randn(shape, dtype=torch.float64), full_matrices=False)
        polar = q.U @ q.Vh
        rms = (adjust_lr(1.0, "unit_rms", shape) * polar).square().mean().sqrt()
        assert rms.item() == pytest.approx(1.0, rel=1e-12)


def test_float64_and_bfloat16_params() -> None:
    p64 = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    opt = Muon([p64], lr=0.1, ns_dtype=None)
    p64.grad = torch.randn(8, 6, dtype=torch.float64)
    opt.step()
    assert p64.dtype == torch.float64 and opt.state[p64]["momentum_buffer"].dtype == torch.float64
    # bf16 params follow torch's arithmetic but keep the momentum buffer intact.
    pb = torch.randn(8, 6).bfloat16().requires_grad_()
    opt_b = Muon([pb], lr=0.1, nesterov=False, momentum=0.5)
    g = torch.randn(8, 6).bfloat16()
    pb.grad = g
    opt_b.step()
    assert torch.equal(opt_b.state[pb]["momentum_buffer"], torch.zeros_like(g).lerp_(g, 0.5))


def test_muon_rejects_bad_ns_arguments() -> None:
    p = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(ValueError, match="ns_coefficients"):
        Muon([p], ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([p], adjust_lr_fn="bogus")
    with pytest.raises(ValueError, match="ns_steps"):
        Muon([p], ns_steps=-1)
    with pytest.raises(ValueError, match="momentum"):
        Muon([p], momentum=1.0)
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.zeros(3))


def test_a_group_edited_after_construction_is_checked_at_the_step() -> None:
    """Newton-Schulz arguments are checked once per group and step (not once per matrix), so a
    group edited after it was added is still refused before anything changes."""
    p = torch.nn.Parameter(torch.ones(3, 4))
    opt = Muon([p], lr=0.1)
    p.grad = torch.ones(3, 4)
    opt.param_groups[0]["ns_coefficients"] = (1.0, 2.0)
    with pytest.raises(ValueError, match="exactly 3 numbers"):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(3, 4)) and not opt.state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_scale_is_bitwise_a_per_tensor_mul(dtype: torch.dtype) -> None:
    """``scale_`` (the split step's weight decay) equals ``t.mul_(factor)`` tensor by tensor, bit for
    bit, for factors that are not representable in the tensors' dtype (where a 0-dim factor of
    another dtype would round differently: a bfloat16 or float16 tensor keeps the Python number),
    on tensors of several sizes, signs and magnitudes."""
    g = torch.Generator().manual_seed(7)
    factors = [1 - 10 ** (-k) * (1 + torch.rand((), generator=g).item()) for k in range(1, 10)] + [0.9079942317854822, 1.0, 0.0]
    for factor in factors:
        xs = [(torch.randn(shape, generator=g) * 10 ** torch.randint(-4, 5, (), generator=g).item()).to(dtype)
              for shape in ((8, 16), (3, 5), (64, 64), (1, 7), (0, 4))]
        want = [x.clone().mul_(factor) for x in xs]
        got = [x.clone() for x in xs]
        muon_mod.scale_(got, factor)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (dtype, factor)
