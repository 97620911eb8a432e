"""``opt.clip_grad_norm_`` in one process (a one-rank group): torch's semantics, call order, refusals.

The multi-process exactness cases are in tests/test_clip.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import canzona
from canzona.optim import Muon
from canzona.runtime.buffer import GradSyncError
from validation.harness import ReferenceRunner, ToyModel, integer_grads, inject_grads

KW = {"lr": 0.02}
EW = {"lr": 0.01, "weight_decay": 0.1}


def _setup(strategy: str = "lb-asc"):
    model = ToyModel(seed=1)
    ref = ReferenceRunner(copy.deepcopy(model), Muon, KW, torch.optim.AdamW, EW)
    opt = canzona.DistributedOptimizer(model, "muon", strategy=strategy, optimizer_kwargs=KW, elementwise_kwargs=EW)
    return model, ref, opt


def _torch_total(grads: dict[str, torch.Tensor], max_norm: float, norm: float = 2.0):
    ps = []
    for g in grads.values():
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        ps.append(p)
    return [torch.nn.utils.clip_grad_norm_(ps, max_norm, norm)], {n: p.grad for n, p in zip(grads, ps)}


@pytest.mark.parametrize("strategy", ["lb-asc", "sc"])
def test_clip_matches_torch_then_step(single_rank_group, strategy: str) -> None:
    model, ref, opt = _setup(strategy)
    for step in range(2):
        grads = integer_grads(model, step=step, rank=0)
        inject_grads(model, grads)
        total = opt.clip_grad_norm_(0.5)
        (want,), clipped = _torch_total(grads, 0.5)
        assert torch.equal(total, want) and total.item() > 0.5
        opt.step()
        opt.zero_grad()
        ref.step(clipped)
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), ref.params()[n]), (step, n)


def test_second_clip_sees_the_clipped_gradients(single_rank_group) -> None:
    """Two calls clip twice, as two torch calls on p.grad do (the second total is the clipped norm)."""
    model, _, opt = _setup()
    grads = integer_grads(model, step=0, rank=0)
    inject_grads(model, grads)
    got = [opt.clip_grad_norm_(0.5), opt.clip_grad_norm_(0.5, math.inf)]
    ps = []
    for g in grads.values():
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        ps.append(p)
    want = [torch.nn.utils.clip_grad_norm_(ps, 0.5), torch.nn.utils.clip_grad_norm_(ps, 0.5, math.inf)]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)


def test_torch_clip_refuses_what_the_zero1_path_holds(single_rank_group) -> None:
    """After backward ``p.grad`` is None on every parameter (the gradients are in canzona's buffer),
    so torch's function would return 0 and clip nothing: it refuses in one line, however it was
    imported, naming ``opt.clip_grad_norm_``; before any backward, and on tensors canzona does not
    hold, it runs as torch's."""
    from torch.nn.utils import clip_grad_norm_ as imported_early  # the name a user may hold

    model, _, opt = _setup()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item() == 0.0  # no gradient yet: torch's answer
    inject_grads(model, integer_grads(model, step=0, rank=0))
    assert all(p.grad is None for p in model.parameters())
    for clip in (torch.nn.utils.clip_grad_norm_, imported_early):
        with pytest.raises(RuntimeError, match=r"sees no gradient for \d+ parameters whose gradients canzona's .* call opt.clip_grad_norm_"):
            clip(model.parameters(), 0.5)
    other = torch.nn.Parameter(torch.zeros(3))
    other.grad = torch.ones(3)
    assert torch.nn.utils.clip_grad_norm_([other], 0.5).item() == pytest.approx(3 ** 0.5)
    assert torch.allclose(other.grad, torch.full((3,), 0.5 / (3 ** 0.5 + 1e-6)))
    assert opt.clip_grad_norm_(0.5).item() > 0.5
    opt.step()
    opt.zero_grad()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item() == 0.0  # nothing held after zero_grad


def test_grad_scaler_is_refused_in_one_line(single_rank_group) -> None:
    """torch.amp.GradScaler would find no p.grad on the ZeRO-1 path (torch's own error: "No inf
    checks were recorded"); canzona refuses it in one line at scaler.step, nothing changed."""
    model, _, opt = _setup()
    before = [p.detach().clone() for p in model.parameters()]
    inject_grads(model, integer_grads(model, step=0, rank=0))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(torch.ones(()))  # what scaler.scale(loss).backward() does first: the scale exists
    with pytest.raises(TypeError, match=r"^torch.amp.GradScaler is not supported: .* train with bf16 autocast and no scaler") as err:
        scaler.step(opt)
    assert "\n" not in str(err.value)
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")  # the scaler's attributes are gone
    opt.step()  # the plain step still works afterwards
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


def test_refusals(single_rank_group) -> None:
    model, _, opt = _setup()
    grads = integer_grads(model, step=0, rank=0)
    with opt.no_sync():
        inject_grads(model, grads)
        with pytest.raises(RuntimeError, match="inside no_sync"):
            opt.clip_grad_norm_(1.0)
    inject_grads(model, grads)
    opt.clip_grad_norm_(1.0)
    with pytest.raises(GradSyncError, match="arrived after its bucket"):
        inject_grads(model, grads)  # a backward between clip_grad_norm_ and step()
    opt.zero_grad()
    inject_grads(model, grads)
    with pytest.raises(ValueError, match="norm_type 0"):
        opt.clip_grad_norm_(1.0, norm_type=0)
    assert opt.clip_grad_norm_(1.0).item() > 0  # nothing was left half-done by the refusal


def test_no_gradient_anywhere_gives_zero(single_rank_group) -> None:
    model, _, opt = _setup()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert opt.clip_grad_norm_(1.0).item() == 0.0
    opt.step()
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())


def test_split_bound_grows_with_the_sizes() -> None:
    from canzona.runtime.clip import split_bound

    small, large = split_bound(100, 2, 10), split_bound(10_000, 8, 100)
    assert 0 < small < large < 1e-2
    assert split_bound(100, 2, 10, torch.float64) < small * 1e-8
