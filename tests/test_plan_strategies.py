"""Strategy records and the registry: shipped semantics, refused records, and a new strategy added
by registration alone (planned, serialized, simulated and run without touching the runtime)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from canzona.plan import (
    PAPER_STRATEGIES,
    STRATEGIES,
    Plan,
    PlanError,
    Strategy,
    default_tp_schedule,
    get_strategy,
    plan_model,
    register_strategy,
    strategy_names,
    unregister_strategy,
)
from canzona.plan.dp import DPAssignment
from canzona.plan.strategies import PartitionInput, param_role

TOY = "toy-round-robin"


def _round_robin(x: PartitionInput) -> DPAssignment:
    """Whole parameters dealt to DP ranks in buffer order (no balancing): a strategy the planner,
    runtime and simulator have never heard of."""
    owner = np.arange(x.layout.n_params, dtype=np.int64) % x.dp
    return DPAssignment(tuple(() for _ in x.layout.bounds), owner)


def _toy() -> Strategy:
    return Strategy(
        name=TOY,
        grad_collective="all-reduce",
        param_return="broadcast",
        every_rank_updates=False,
        atomic_matrices=True,
        elementwise_only=False,
        default_tp_schedule="lpt",
        in_paper=False,
        description="test-only: whole parameters dealt round-robin, owners broadcast",
        partition=_round_robin,
    )


@pytest.fixture
def toy():
    register_strategy(_toy())
    try:
        yield get_strategy(TOY)
    finally:
        unregister_strategy(TOY)


def _plan(strategy, **kw):
    base = dict(dp=3, tp=2, bucket_numel=20_000, strategy=strategy)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model("qwen3-tiny", **base)


def test_shipped_records():
    assert strategy_names()[: len(STRATEGIES)] == STRATEGIES
    assert PAPER_STRATEGIES == ("zero1", "sc", "layerwise", "asc", "lb-asc")
    rs = {n for n in STRATEGIES if get_strategy(n).grad_collective == "reduce-scatter"}
    assert rs == {"zero1", "asc", "lb-asc", "lb-asc-joint"}
    assert {n: get_strategy(n).param_return for n in ("sc", "layerwise")} == {"sc": "none", "layerwise": "broadcast"}
    assert [n for n in STRATEGIES if get_strategy(n).every_rank_updates] == ["sc"]
    assert [n for n in STRATEGIES if get_strategy(n).elementwise_only] == ["zero1"]
    assert [n for n in STRATEGIES if not get_strategy(n).atomic_matrices] == ["zero1"]
    assert {n: default_tp_schedule(n) for n in STRATEGIES} == {
        "zero1": "sync", "sc": "sync", "layerwise": "sync", "asc": "round-robin", "lb-asc": "lpt-carry", "lb-asc-joint": "lpt-carry"
    }
    assert all(get_strategy(n).description for n in STRATEGIES)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_plans_carry_the_record(strategy):
    plan = _plan(strategy)
    rec = get_strategy(strategy)
    assert plan.strategy is rec
    assert {(b.collective, b.param_return) for b in plan.buckets} == {(rec.grad_collective, rec.param_return)}
    for p in plan.params:
        assert p.role == param_role(rec, p.spec.kind, p.spec.tp_split)
        assert p.replicated == rec.every_rank_updates
    roles = {p.role for p in plan.params}
    # at tp=2 every qwen3-tiny matrix is TP-split (a task); at tp=1 none is
    assert roles == ({"elementwise"} if rec.elementwise_only else {"tp-task", "elementwise"})
    roles_tp1 = {p.role for p in _plan(strategy, tp=1).params}
    assert roles_tp1 == ({"elementwise"} if rec.elementwise_only else {"matrix", "elementwise"})


def test_registry_refusals():
    with pytest.raises(PlanError, match="unknown strategy 'fsdp'; choose one of zero1, sc"):
        get_strategy("fsdp")
    with pytest.raises(PlanError, match="unknown strategy 'fsdp'"):
        _plan("fsdp")
    with pytest.raises(PlanError, match="already registered"):
        register_strategy(get_strategy("lb-asc"))
    with pytest.raises(PlanError, match="ships with canzona"):
        unregister_strategy("sc")
    with pytest.raises(PlanError, match="not registered"):
        unregister_strategy(TOY)
    with pytest.raises(TypeError):
        register_strategy("lb-asc")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(grad_collective="all-gather"), "grad_collective must be one of"),
        (dict(param_return="scatter"), "param_return must be one of"),
        (dict(grad_collective="reduce-scatter"), "returns parameters by all-gather"),
        (dict(param_return="all-gather"), "no cuts to all-gather"),
        (dict(param_return="none"), "exactly when every rank updates"),
        (dict(atomic_matrices=False), "cannot update a cut matrix"),
        (dict(partition=None), "partition must be callable"),
    ],
)
def test_inconsistent_records_refused(change, message):
    from dataclasses import replace

    with pytest.raises(PlanError, match=message):
        replace(_toy(), **change)


def test_partitioner_answers_are_checked(toy):
    def bad(x: PartitionInput) -> DPAssignment:
        return DPAssignment(tuple(() for _ in x.layout.bounds), np.full(x.layout.n_params, x.dp, dtype=np.int64))

    from dataclasses import replace

    def unowned(x: PartitionInput) -> DPAssignment:
        return DPAssignment(tuple(() for _ in x.layout.bounds), np.full(x.layout.n_params, -1, dtype=np.int64))

    def short(x: PartitionInput) -> DPAssignment:
        return DPAssignment((), np.zeros(x.layout.n_params, dtype=np.int64))

    for fn, message in ((bad, "returned an owner outside -1..2"), (unowned, "every parameter needs an owner"),
                        (short, "one cut tuple per bucket")):
        register_strategy(replace(toy, partition=fn), replace=True)
        with pytest.raises(PlanError, match=f"strategy {TOY}: .*{message}"):
            _plan(TOY)


def test_a_registered_strategy_plans_and_simulates(toy, tmp_path):
    """Adding a strategy is a planner-only change: plan, document, fingerprint and simulator work."""
    from canzona.sim import simulate_plan
    from canzona.sim.configs import resolve_sim_model
    from canzona.sim.hardware import load_hardware

    plan = _plan(TOY)
    assert TOY in strategy_names() and plan.inputs.tp_schedule == "lpt"
    order = list(plan.buffer_order())
    assert [p.dp_owner for p in order] == [i % 3 for i in range(len(order))]
    assert all(b.cuts == () and b.collective == "all-reduce" for b in plan.buckets)
    assert any(p.tp_host is not None for p in plan.params)  # micro-groups ran: TP-split tasks are hosted
    path = tmp_path / "toy.json"
    plan.to_json(path)
    assert Plan.from_json(path) == plan
    # the simulator prices it from the plan's fields alone: broadcast after the step, no all-gather
    cfg = resolve_sim_model("qwen3-tiny")
    hw = load_hardware("h800-ib400")
    toy_b = simulate_plan(plan, cfg, hw)
    lw_b = simulate_plan(_plan("layerwise", tp_schedule="lpt"), cfg, hw)
    assert toy_b.opt_dp_comm_s == lw_b.opt_dp_comm_s > 0 and toy_b.dp_param_comm_s == 0.0
    # a document naming a strategy this process does not know is refused with the registry's message
    unregister_strategy(TOY)
    try:
        with pytest.raises(PlanError, match=f"unknown strategy '{TOY}'"):
            Plan.from_json(path)
    finally:
        register_strategy(_toy())


# ----------------------------------------------------------------------------- runtime, unchanged
def _toy_worker(rank: int, world: int) -> bytes:
    import canzona
    from validation.harness import ToyModel, inject_grads, integer_grads, pack, params_of

    register_strategy(_toy())  # a fresh process: the plug-in registers itself, as a user's would
    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "muon", strategy=TOY, optimizer_kwargs={"lr": 0.05},
                                     elementwise_kwargs={"lr": 0.01}, bucket_numel=40)
    for s in range(2):
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        opt.zero_grad()
    owners = sorted({p.dp_owner for p in opt.plan.params})
    return pack({"params": params_of(model), "owners": owners})


@pytest.mark.slow
def test_a_registered_strategy_runs_exactly():
    from canzona.optim import Muon
    from canzona.runtime.launch import run_workers
    from validation.harness import ReferenceRunner, ToyModel, integer_grads, mean_grads, tensors_equal, unpack

    got = [unpack(r) for r in run_workers(_toy_worker, 2, timeout_s=120)]
    model = ToyModel()
    ref = ReferenceRunner(model, Muon, {"lr": 0.05}, torch.optim.AdamW, {"lr": 0.01})
    for s in range(2):
        ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(2)]))
    want = ref.params()
    for rank, res in enumerate(got):
        assert res["owners"] == [0, 1], f"rank {rank}: both ranks should own parameters"
        assert tensors_equal(want, res["params"]) == [], f"rank {rank}: differs from the single-process run"


@pytest.mark.parametrize("name", STRATEGIES)
def test_uses_alpha_says_whether_alpha_moves_the_plan(name: str) -> None:
    """``Strategy.uses_alpha`` is what front ends read to offer the alpha knob: it must be true
    exactly for the partitioners whose decisions alpha changes (lb-asc on Qwen3-0.6B at DP 8)."""
    kw = {"dp": 8, "tp": 2, "optimizer": "adamw" if get_strategy(name).elementwise_only else "muon", "strategy": name}
    a0, a1 = plan_model("qwen3-0.6b", alpha=0.0, **kw), plan_model("qwen3-0.6b", alpha=1.0, **kw)
    moved = a0.params != a1.params or a0.buckets != a1.buckets
    assert moved == get_strategy(name).uses_alpha
