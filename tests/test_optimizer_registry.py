"""The optimizer registry: one source for names, classes, cost-model keys and defaults."""

from __future__ import annotations

import pytest
import torch

from canzona.optimizers import (
    ELEMENTWISE_DEFAULT,
    OptimizerEntry,
    check_strategy_optimizer,
    cost_key_for_class,
    get_optimizer,
    optimizer_names,
    register_optimizer,
)


def test_shipped_entries():
    from canzona.optim import SOAP, Muon, Shampoo

    assert optimizer_names() == ("muon", "shampoo", "soap", "adamw")
    assert optimizer_names(matrix=True) == ("muon", "shampoo", "soap")
    assert optimizer_names(matrix=False) == (ELEMENTWISE_DEFAULT,)
    assert [get_optimizer(n).load() for n in optimizer_names()] == [Muon, Shampoo, SOAP, torch.optim.AdamW]
    assert get_optimizer("MUON") is get_optimizer("muon")
    assert {n: get_optimizer(n).defaults["lr"] for n in optimizer_names()} == {
        "muon": 0.02, "shampoo": 0.003, "soap": 0.003, "adamw": 0.003
    }
    with pytest.raises(TypeError):
        get_optimizer("muon").defaults["lr"] = 1.0  # read-only


def test_cost_keys_by_class():
    from canzona.optim import SOAP, Muon, Shampoo

    assert [cost_key_for_class(c) for c in (Muon, Shampoo, SOAP, torch.optim.AdamW, torch.optim.Adam)] == [
        "muon", "shampoo", "soap", "adamw", "adamw"
    ]
    assert cost_key_for_class(torch.optim.SGD) == "muon"  # unknown classes are costed as Muon


def test_front_ends_read_the_registry():
    from canzona.distributed import resolve_optimizer
    from canzona.train import DEFAULT_LR, OPTIMIZERS, TrainConfig
    from validation.matrix import OPTIMIZERS as VALIDATED

    assert OPTIMIZERS == VALIDATED == optimizer_names()
    assert DEFAULT_LR == {n: get_optimizer(n).defaults["lr"] for n in optimizer_names()}
    assert resolve_optimizer("soap") is get_optimizer("soap").load()
    assert TrainConfig(optimizer="shampoo").matrix_lr == 0.003 and TrainConfig(lr=0.5).matrix_lr == 0.5


def test_refusals():
    with pytest.raises(ValueError, match="unknown optimizer 'lion'; choose one of muon, shampoo, soap, adamw"):
        get_optimizer("lion")
    with pytest.raises(ValueError, match="already registered"):
        register_optimizer(get_optimizer("muon"))
    with pytest.raises(ValueError, match="cost_key must be one of"):
        OptimizerEntry("lion", "torch.optim:SGD", "lion", False)
    with pytest.raises(ValueError, match="lower case"):
        OptimizerEntry("Lion", "torch.optim:SGD", "adamw", False)
    with pytest.raises(ValueError, match="module:Class"):
        OptimizerEntry("lion", "SGD", "adamw", False)


def test_strategy_optimizer_rule():
    check_strategy_optimizer("zero1", "adamw")
    check_strategy_optimizer("lb-asc", "muon")
    with pytest.raises(ValueError, match=r"zero1 cuts matrices at equal chunks, so it runs only an element-wise optimizer \(adamw\)"):
        check_strategy_optimizer("zero1", "muon")
    from canzona.train import TrainConfig

    with pytest.raises(ValueError, match="zero1 cuts matrices"):
        TrainConfig(strategy="zero1", optimizer="soap")
