"""``DistributedOptimizer``'s torch-optimizer API details, in a one-rank group."""

from __future__ import annotations

import torch

from validation.harness import ToyModel


def test_zero_grad_sets_to_none_or_zeroes_in_place(single_rank_group) -> None:
    import canzona

    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", bucket_numel=40)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.ones_like(p)
    kept = [p.grad for p in params]
    opt.zero_grad(set_to_none=False)
    for p, g in zip(params, kept):
        assert p.grad is g and torch.equal(g, torch.zeros_like(g)), "set_to_none=False zeroes the same tensor"
    opt.zero_grad()
    assert all(p.grad is None for p in params)
