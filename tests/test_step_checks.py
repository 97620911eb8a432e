"""The step's own checks, single process (quick gate): the finiteness flags of the reduced
gradients (one test per bucket region, per piece when one is non-finite) and the check that the
model still has the parameters its plan was made for (:class:`canzona.distributed.ParamWatch`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from canzona.testing import ToyModel, inject_grads, integer_grads


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_step_flags_test_each_bucket_once_and_name_the_non_finite_parameter_exactly(single_rank_group, monkeypatch, value: float) -> None:
    """The step's finiteness flags: one test per bucket region when every gradient is finite (not
    one per piece); a non-finite entry anywhere falls back to the per-piece test, which names
    exactly the parameter that holds it, whichever bucket it is in."""
    import canzona
    import canzona.runtime.dp as dpmod
    from canzona.runtime.agree import NonFiniteGradient

    calls: list[int] = []
    real = dpmod.nonfinite
    monkeypatch.setattr(dpmod, "nonfinite", lambda ts, device="cpu": calls.append(len(ts)) or real(ts, device))
    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", bucket_numel=40)
    buckets, pieces = len(opt.plan.buckets), len(opt.runtime.pieces)
    assert 1 < buckets < pieces
    names = [n for n, _ in model.named_parameters()]
    for step, culprit in enumerate([None, *names]):
        calls.clear()
        grads = integer_grads(model, step=step, rank=0)
        if culprit is not None:
            grads[culprit].view(-1)[-1] = value
        inject_grads(model, grads)
        if culprit is None:
            opt.step()
            assert calls == [buckets], calls
        else:
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with pytest.raises(NonFiniteGradient, match=f"non-finite gradient in {culprit};"):
                opt.step()
            assert calls == [buckets, pieces], calls
            assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), culprit
        opt.zero_grad()


def _watch_cases() -> dict[str, Callable[[torch.nn.Module], None]]:
    def replace_param(m):
        m.up.weight = torch.nn.Parameter(m.up.weight.detach().clone())

    def add_param(m):
        m.up.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))

    def add_module(m):
        m.extra = torch.nn.Linear(2, 2)

    def replace_module(m):
        new = torch.nn.Module()
        new.weight, new.bias = m.up.weight, m.up.bias  # the same parameters, now under another module
        new.weight2 = torch.nn.Parameter(torch.zeros(1))
        m.up = new

    def dict_write(m):
        m.up._parameters["weight"] = torch.nn.Parameter(torch.zeros_like(m.up.weight))

    def reshape(m):
        m.up.weight.data = torch.zeros(m.up.weight.numel())

    def recast(m):
        m.up.weight.data = m.up.weight.data.double()

    def delete(m):
        del m.up.bias

    return {f.__name__: f for f in (replace_param, add_param, add_module, replace_module, dict_write, reshape, recast, delete)}


@pytest.mark.parametrize("change", list(_watch_cases()))
def test_param_watch_quick_test_sees_every_change_the_full_one_sees(change: str) -> None:
    """``step()`` checks the model's parameters with a quick test of saved module dicts, shapes and
    dtypes; each way of changing a parameter fails it, and the full ``named_parameters()`` test
    then names the change. A change undone again passes, and the saved layout is refreshed."""
    from canzona.distributed import ParamWatch

    model = ToyModel()
    watch = ParamWatch(model)
    watch.check()
    assert list(watch.parameters()) == list(model.parameters())
    _watch_cases()[change](model)
    assert not watch._same()
    with pytest.raises(RuntimeError, match="parameters changed after the plan was made"):
        watch.check()
    assert [id(p) for p in watch.parameters()] == [id(p) for p in model.parameters()]


def test_param_watch_accepts_a_change_undone_and_saves_the_layout_again() -> None:
    from canzona.distributed import ParamWatch

    model = ToyModel()
    watch = ParamWatch(model)
    model.up.register_parameter("extra", None)  # a None entry: no parameter, nothing to plan
    assert not watch._same()
    watch.check()
    assert watch._same()
    weight = model.up.weight
    model.up.weight = torch.nn.Parameter(weight.detach().clone())
    model.up.weight = weight
    watch.check()
    assert watch._same()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_param_watch_falls_back_to_the_full_test_on_modules_with_other_dicts() -> None:
    """A TorchScript module's parameter and child dicts are wrappers without ``.get``: the quick
    test gives way to the full one, which still passes an unchanged model and names a change."""
    from canzona.distributed import ParamWatch

    model = torch.jit.script(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)))
    watch = ParamWatch(model)
    watch.check()
    assert [id(p) for p in watch.parameters()] == [id(p) for p in model.parameters()]
    model[0].weight.data = torch.zeros(9)
    with pytest.raises(RuntimeError, match=r"replaced or reshaped \['0.weight'\]"):
        watch.check()
