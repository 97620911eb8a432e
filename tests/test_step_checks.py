"""The step's own checks (quick gate): the finiteness flags of the reduced gradients (one test
per bucket region, per piece when one is non-finite), the check that the model still has the
parameters its plan was made for (:class:`canzona.distributed.ParamWatch`), and the host reads
of a step (one spawned run at world 2: their number must not grow with the model, since on CUDA
each one is a host synchronization)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from harness import HostReads, attempt, case_results
from validation.harness import ToyModel, inject_grads, integer_grads


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


# ------------------------------------------------------------------------------ host reads of a step

#: (strategy, matrix optimizer) of the DP cases; each runs on a stack of 4 and of 16 matrices
READ_CASES = (("lb-asc", "muon"), ("asc", "muon"), ("sc", "muon"), ("layerwise", "muon"), ("lb-asc", "soap"), ("lb-asc", "shampoo"))
#: at most this many host reads in one step of a model without element-wise parameters (not
#: counting :data:`CPU_ONLY`): the finiteness flag of the buckets (the one read of device data),
#: the two status exchanges' error flags, and the step flags' digests and their ``tolist`` (CPU
#: vectors in every run)
MAX_READS = 6


def _reads_dp(rank: int, strategy: str, optname: str, depth: int) -> dict:
    import canzona
    from canzona.profiling.vs_torch import LinearStack

    torch.manual_seed(0)
    model = LinearStack(depth, 16)
    opt = canzona.DistributedOptimizer(model, optname, strategy=strategy, optimizer_kwargs={"lr": 0.02}, bucket_numel=600)
    return {"buckets": len(opt.plan.buckets), "steps": _steps_reads(opt, _stack_backward(model, rank))}


def _stack_backward(model: torch.nn.Module, rank: int) -> Callable[[int], None]:
    return lambda step: model.loss(torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))).backward()


def _steps_reads(opt, backward: Callable[[int], None]) -> list:
    """Three steps, each after ``backward(step)``; each step's (host reads, reads by line), but the
    first's (which creates the optimizer state)."""
    per_step = []
    for step in range(3):
        backward(step)
        with HostReads() as reads:
            opt.step()
        opt.zero_grad()
        per_step.append((reads.total, dict(reads.where)))
    return per_step[1:]


def _reads_tp(rank: int, cmax: float) -> dict:
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.config import load_model_config
    from canzona.models import Qwen3
    from canzona.models.tp import parallelize
    from validation.harness import tp_local

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize(Qwen3(load_model_config("qwen3-tiny"), seed=0), mesh["tp"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tasks over a tiny C_max get a micro-group each: wanted here
        opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs={"lr": 0.02},
                                           elementwise_kwargs={"lr": 1e-3}, bucket_numel=4096, cmax=cmax)
    shapes = {sp.name: sp.shape for sp in opt.plan.specs}

    def backward(step: int) -> None:
        inject_grads(model, tp_local(integer_grads(shapes, step=step, rank=0), opt.plan.specs, mesh.get_local_rank("tp")))

    return {"groups": len(opt.runtime.tp_engine.groups), "steps": _steps_reads(opt, backward)}


def _reads_fsdp(rank: int, depth: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import canzona
    from canzona.profiling.vs_torch import LinearStack

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(0)
    model = LinearStack(depth, 16)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs={"lr": 0.02})
    return {"steps": _steps_reads(opt, _stack_backward(model, rank))}


def reads_worker(rank: int, world: int) -> dict:
    out: dict = {"dp": {}, "tp": {}, "fsdp": {depth: attempt(_reads_fsdp, rank, depth) for depth in (4, 16)}}
    for strategy, optname in READ_CASES:
        for depth in (4, 16):
            out["dp"][(strategy, optname, depth)] = attempt(_reads_dp, rank, strategy, optname, depth)
    for cmax in (0.01 / (4 * 2), 512.0):  # 0.01 MiB of fp32 gradient at TP 2: one task per group
        out["tp"][cmax] = attempt(_reads_tp, rank, cmax)
    return out


@pytest.fixture(scope="module")
def reads_run() -> list:
    from canzona.runtime.launch import run_workers

    return run_workers(reads_worker, 2, timeout_s=240)


#: the reads of the CPU-only finiteness pre-tests: the large tensors' sums' ``nonzero``, which
#: comes with the first tensor of 512 elements or more, and the one sum of a dtype's small
#: tensors, which comes with the second small tensor; so small and large models differ by them.
#: Neither is made for a CUDA tensor (both run under ``where.type == "cpu"``)
CPU_ONLY = ("_common.py:_finite_sums:", "_common.py:_finite_sum:")


def _device_reads(where: dict) -> int:
    return sum(n for line, n in where.items() if not line.startswith(CPU_ONLY))


def _same_reads(small: dict, large: dict, what: str) -> None:
    for (_, where_small), (_, where_large) in zip(small["steps"], large["steps"]):
        n_small, n_large = _device_reads(where_small), _device_reads(where_large)
        assert n_small == n_large, f"{what}: {n_small} host reads in a step of the small model, {n_large} in the large one " \
                                   f"(small: {where_small}; large: {where_large})"


@pytest.mark.slow
@pytest.mark.parametrize("strategy,optname", READ_CASES, ids=[f"{s}-{o}" for s, o in READ_CASES])
def test_host_reads_of_a_step_do_not_grow_with_parameters_or_buckets(reads_run, strategy: str, optname: str) -> None:
    """The same number of host reads (on CUDA: synchronizations) in a step of 4 and of 16
    matrices, with several times the buckets, at most :data:`MAX_READS`: nothing per parameter,
    per piece or per bucket reads a value back."""
    small = case_results(reads_run, "dp", (strategy, optname, 4))
    large = case_results(reads_run, "dp", (strategy, optname, 16))
    assert large[0]["buckets"] >= 3 * small[0]["buckets"], (small[0]["buckets"], large[0]["buckets"])
    for rank, (a, b) in enumerate(zip(small, large)):
        _same_reads(a, b, f"{strategy}/{optname} rank {rank}")
        for _, where in a["steps"] + b["steps"]:
            assert 0 < _device_reads(where) <= MAX_READS, where


@pytest.mark.slow
def test_host_reads_of_a_tp_step_do_not_grow_with_micro_groups(reads_run) -> None:
    """DP1 x TP2, the tiny Qwen3: 12 micro-groups or 1, the same host reads in a step (those of
    the element-wise pieces' AdamW, whose step counter is a CPU tensor, included)."""
    many, one = case_results(reads_run, "tp", 0.01 / (4 * 2)), case_results(reads_run, "tp", 512.0)
    assert many[0]["groups"] >= 10 and one[0]["groups"] == 1, (many[0]["groups"], one[0]["groups"])
    for rank, (a, b) in enumerate(zip(many, one)):
        _same_reads(a, b, f"TP rank {rank}")


@pytest.mark.slow
def test_host_reads_of_an_fsdp2_step_do_not_grow_with_parameters(reads_run) -> None:
    """FSDP2 (``fully_shard`` per layer, dp_shard 2), lb-asc: a step of 4 and of 16 matrices
    reads the same values back, at most :data:`MAX_READS`."""
    small, large = case_results(reads_run, "fsdp", 4), case_results(reads_run, "fsdp", 16)
    for rank, (a, b) in enumerate(zip(small, large)):
        _same_reads(a, b, f"FSDP2 rank {rank}")
        for _, where in a["steps"]:
            assert 0 < _device_reads(where) <= MAX_READS, where


def test_host_reads_counts_each_read_by_the_line_that_asked() -> None:
    x = torch.randn(10)
    real = torch.Tensor.tolist
    with HostReads() as reads:
        bool(x.sum() > 0)
        x.nonzero()
        torch.equal(x, x)
        assert x.tolist() == real(x)
        x.cpu()
    x[0].item()  # outside: not counted
    x.tolist()
    assert torch.Tensor.tolist is real  # the wrapped methods are restored
    assert reads.total == 5 and set(reads.ops) == {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.equal.default",
                                                   "Tensor.tolist", "Tensor.cpu"}
    assert len(reads.where) == 5 and all(k.startswith("test_step_checks.py:test_host_reads_counts") for k in reads.where)
