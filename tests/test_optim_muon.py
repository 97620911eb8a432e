"""Muon against torch.optim.Muon (bitwise), Newton-Schulz math, batching, lr scalings."""

from __future__ import annotations

import math

import pytest
import torch

import canzona.optim.muon as muon_mod
from canzona.optim import Muon, adjust_lr, batched_newton_schulz, newton_schulz
from canzona.optim.muon import AUTO_BATCH_MIN_SIDE, batching_is_bitwise

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


# Shapes of the benchmark's Qwen3-like layers scaled down, where bf16 batching is bitwise exact.
@pytest.mark.parametrize("shape", [(96, 64), (64, 64), (64, 176), (352, 64)])
def test_batched_newton_schulz_bf16_bitwise_on_model_shapes(shape: tuple[int, int]) -> None:
    mats = _grads(shape, 3, seed=5)
    loop = torch.stack([newton_schulz(m) for m in mats])
    assert torch.equal(batched_newton_schulz(mats), loop)
    assert torch.equal(batched_newton_schulz(torch.stack(mats)), loop)


@pytest.mark.parametrize("shape", [(33, 2), (1, 40), (40, 1), (7, 5), (9, 73), (20, 11), (24, 24), (12, 40), (40, 12)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_batched_newton_schulz_within_bound_of_loop(shape: tuple[int, int], dtype: torch.dtype) -> None:
    """Batched and looped products may sum in different orders (see batched_newton_schulz's
    docstring); the outputs have spectral norm <= ~1.2, so an absolute bound of 64 unit roundoffs
    of the compute dtype is the documented worst case (measured <= 23 u)."""
    mats = _grads(shape, 4, seed=6, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    loop = torch.stack([newton_schulz(m, dtype=dtype) for m in mats])
    batched = batched_newton_schulz(mats, dtype=dtype)
    assert batched.dtype == loop.dtype == dtype
    diff = (batched.double() - loop.double()).abs().max().item()
    assert diff <= 64 * torch.finfo(dtype).eps


def test_batched_newton_schulz_rejects_mixed_shapes() -> None:
    with pytest.raises(ValueError, match="shape"):
        batched_newton_schulz([torch.randn(3, 4), torch.randn(4, 3)])
    with pytest.raises(ValueError, match="at least one"):
        batched_newton_schulz([])


# The expert shapes of Qwen3-30B-A3B scaled down, a square expert, and Mixtral's tiny (E, 192, 64).
EXPERT_SHAPES = [(96, 64), (64, 96), (384, 256), (256, 384), (64, 64), (192, 64), (64, 192)]
NS_DTYPE_CASES = {  # (input dtype, Newton-Schulz compute dtype)
    "bf16-in-bf16-ns": (torch.bfloat16, torch.bfloat16),
    "fp32-in-bf16-ns": (torch.float32, torch.bfloat16),
    "fp32-in-fp32-ns": (torch.float32, None),
}


@pytest.mark.parametrize("shape", EXPERT_SHAPES)
@pytest.mark.parametrize("case", list(NS_DTYPE_CASES))
@pytest.mark.parametrize("count", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_batched_ns_bitwise_at_expert_shapes(shape: tuple[int, int], case: str, count: int) -> None:
    """The claim behind Muon's ``batched="auto"`` default: at the expert shapes, on CPU, the whole
    batched Newton-Schulz chain (bmm/baddbmm over a stacked buffer) is bitwise the per-matrix one."""
    in_dtype, ns_dtype = NS_DTYPE_CASES[case]
    mats = _grads(shape, count, seed=11, dtype=in_dtype)
    loop = torch.stack([newton_schulz(m, dtype=ns_dtype) for m in mats])
    assert batching_is_bitwise(shape, loop.dtype, "cpu")
    assert torch.equal(batched_newton_schulz(mats, dtype=ns_dtype), loop)


@pytest.mark.slow
@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, None], ids=["bf16-ns", "fp32-ns"])
def test_batched_ns_bitwise_over_the_auto_regime(ns_dtype: torch.dtype | None) -> None:
    """Every smaller side from AUTO_BATCH_MIN_SIDE to 40 against a random longer side, tall and
    wide, batches of 2 and 5: where batching_is_bitwise says yes, the chain must be bitwise."""
    gen = torch.Generator().manual_seed(12)
    for side in range(AUTO_BATCH_MIN_SIDE, 41):
        long = int(torch.randint(side, 200, (1,), generator=gen))
        for shape in ((side, long), (long, side)):
            mats = [torch.randn(shape, generator=gen) for _ in range(2 + side % 4)]
            loop = torch.stack([newton_schulz(m, dtype=ns_dtype) for m in mats])
            assert batching_is_bitwise(shape, loop.dtype, "cpu")
            assert torch.equal(batched_newton_schulz(mats, dtype=ns_dtype), loop), shape


def test_batching_is_bitwise_regime() -> None:
    assert batching_is_bitwise((96, 64), torch.bfloat16, "cpu")
    assert batching_is_bitwise((16, 300), torch.float32, torch.device("cpu"))
    assert not batching_is_bitwise((15, 300), torch.bfloat16, "cpu")  # thin: loops
    assert not batching_is_bitwise((96, 64), torch.float64, "cpu")  # not measured
    assert not batching_is_bitwise((96, 64), torch.bfloat16, "meta")  # CUDA and others: not assumed


def _run_three(shapes: list[tuple[int, int]], ns_dtype: torch.dtype | None, monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Step the same parameters under batched=False, "auto" (default) and True; count the matrices
    of every batched chain the default runs."""
    gen = torch.Generator().manual_seed(7)
    inits = [torch.randn(s, generator=gen) for s in shapes]
    runs = [[t.clone().requires_grad_() for t in inits] for _ in range(3)]
    opts = [Muon(runs[0], lr=0.05, ns_dtype=ns_dtype, batched=False), Muon(runs[1], lr=0.05, ns_dtype=ns_dtype),
            Muon(runs[2], lr=0.05, ns_dtype=ns_dtype, batched=True)]
    chain_sizes: list[int] = []
    real = muon_mod.batched_newton_schulz

    def counting(grads, *args):  # type: ignore[no-untyped-def]
        chain_sizes.append(len(grads))
        return real(grads, *args)

    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for run in runs:
            for p, g in zip(run, grads):
                p.grad = g.clone()
        opts[0].step()
        with monkeypatch.context() as m:
            m.setattr(muon_mod, "batched_newton_schulz", counting)
            opts[1].step()
        opts[2].step()
    return runs, chain_sizes


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, None], ids=["bf16-ns", "fp32-ns"])
def test_auto_batches_same_shape_experts_bitwise(ns_dtype: torch.dtype | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default runs one chain per same-shape set in the bitwise regime (6 experts of 96 x 64,
    3 of 64 x 192) and loops the rest (a lone shape, thin 9 x 73 matrices); every parameter ends
    bitwise equal to the one-at-a-time loop. batched=True also batches the thin ones."""
    shapes = [(96, 64)] * 4 + [(64, 192), (9, 73), (96, 64), (64, 192), (9, 73), (96, 64), (64, 192), (40, 24)]
    (loop, auto, forced), chain_sizes = _run_three(shapes, ns_dtype, monkeypatch)
    assert sorted(chain_sizes) == [3, 3, 3, 6, 6, 6]  # 3 steps x (64 x 192 chain, 96 x 64 chain)
    for pl, pa in zip(loop, auto):
        assert torch.equal(pl, pa)
    for shape, pl, pf in zip(shapes, loop, forced):
        if batching_is_bitwise(shape, torch.bfloat16 if ns_dtype else torch.float32, "cpu"):
            assert torch.equal(pl, pf)


def test_auto_chains_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(muon_mod, "AUTO_BATCH_MAX", 4)
    (loop, auto, _), chain_sizes = _run_three([(16, 16)] * 10, torch.bfloat16, monkeypatch)
    assert sorted(chain_sizes) == [2, 2, 2, 4, 4, 4, 4, 4, 4]
    for pl, pa in zip(loop, auto):
        assert torch.equal(pl, pa)


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
