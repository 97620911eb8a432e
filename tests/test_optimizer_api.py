"""``DistributedOptimizer``'s torch-optimizer API details, in a one-rank group."""

from __future__ import annotations

import pytest
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


def _toy_opt(**kw):
    import canzona

    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", bucket_numel=40, optimizer_kwargs={"lr": 0.02}, **kw)
    return model, opt


def _backward(model) -> None:
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randint(-8, 9, p.shape, generator=g).float() / 16


def test_out_of_range_hyperparameters_set_after_construction_are_refused_before_any_change(single_rank_group) -> None:
    """A NaN, infinite or negative ``lr``/``weight_decay`` written into a group after construction
    (by a scheduler or by hand) is refused at ``step()`` before any parameter or state changes;
    restoring the value, the same step goes through."""
    model, opt = _toy_opt()
    _backward(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for group, key, value, text in ((0, "lr", float("nan"), "lr must be a finite number >= 0, got nan"),
                                    (1, "lr", -1e-3, "lr must be a finite number >= 0, got -0.001"),
                                    (1, "weight_decay", float("inf"), "weight_decay must be a finite number >= 0, got inf"),
                                    (0, "lr", torch.tensor(float("nan")), "lr must be a finite number >= 0")):
        old = opt.param_groups[group][key]
        opt.param_groups[group][key] = value
        with pytest.raises(ValueError, match=f"parameter group '{opt.param_groups[group]['name']}': {text}"):
            opt.step()
        opt.param_groups[group][key] = old
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "a refused step changed a parameter"
        assert opt.steps == 0 and opt.state_bytes() == 0, "a refused step changed the optimizer state"
    opt.step()
    assert opt.steps == 1 and any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_out_of_range_optimizer_arguments_are_refused_at_construction(single_rank_group) -> None:
    import canzona

    from validation.harness import ToyModel as Toy

    # torch's AdamW accepts eps=0 (a division by zero where the second moment is zero); canzona refuses it
    with pytest.raises(ValueError, match="elementwise_kwargs: eps must be a finite number > 0, got 0.0"):
        canzona.DistributedOptimizer(Toy(), "muon", strategy="lb-asc", elementwise_kwargs={"lr": 0.01, "eps": 0.0})
    from canzona.settings import check_hyperparams

    for values, text in (({"betas": (0.9, 1.0)}, "betas must each be in"), ({"betas": (float("nan"), 0.9)}, "betas must each be in"),
                         ({"eps": -1.0}, "eps must be"), ({"lr": "fast"}, "lr must be"), ({"weight_decay": float("nan")}, "weight_decay must be")):
        with pytest.raises(ValueError, match=f"here: {text}"):
            check_hyperparams(values, "here")
    check_hyperparams({"lr": 0.0, "weight_decay": 0.0, "betas": (0.0, 0.999), "eps": 1e-30, "momentum": 0.95}, "here")


def test_settings_are_validated_once_and_frozen(single_rank_group) -> None:
    """The keywords become one frozen OptimizerSettings; the runtime reads it and re-checks nothing."""
    import dataclasses

    from canzona.settings import OptimizerSettings

    model, opt = _toy_opt(status_timeout_s=7, grad_reduce="sum")
    assert isinstance(opt.settings, OptimizerSettings)
    assert opt.runtime.status_timeout_s == opt.status_timeout_s == 7.0 and opt.runtime.grad_reduce == "sum"
    assert opt.settings.changed() == ("bucket_numel", "grad_reduce", "status_timeout_s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opt.settings.grad_reduce = "mean"  # type: ignore[misc]
    for kw, text in (({"grad_reduce": "max"}, "grad_reduce must be"), ({"param_sync": "soon"}, "param_sync must be"),
                     ({"status_timeout_s": 0}, "status_timeout_s must be"), ({"status_timeout_s": float("inf")}, "status_timeout_s must be"),
                     ({"master_dtype": torch.float16}, "master_dtype must be")):
        with pytest.raises(ValueError, match=text):
            OptimizerSettings(**kw)
    with pytest.raises(TypeError, match="param_views must be True or False"):
        OptimizerSettings(param_views=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bound_fsdp_collectives must be True or False"):
        OptimizerSettings(bound_fsdp_collectives="no")  # type: ignore[arg-type]
    assert "layout=dp" in repr(opt) and opt.layout.engine == "dp" and (opt.dp, opt.tp, opt.dp_rank, opt.tp_rank) == (1, 1, 0, 0)
    with pytest.raises(AttributeError):
        opt.group_rank  # an FSDP2 layout's attribute: not on the ZeRO-1 layout
