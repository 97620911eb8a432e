"""FSDP2 plans as the one Plan: inputs, validation, document versions, the rank bound, and expert
stacks costed as E tasks of (M, N) by the planner and the FSDP2 step simulator, and each layout's
refusal of the other's plan. No process group: about a second each at most."""

from __future__ import annotations

import json
import math

import pytest

from canzona.cost import adamw_flops, matrix_flops, state_bytes
from canzona.plan import (
    FSDP_STRATEGIES,
    Plan,
    PlanError,
    PlanInputs,
    make_plan,
    piece_numels,
    plan_fsdp_model,
    plan_model,
    plan_shard,
    shard_inputs,
    shard_specs,
)
from canzona.plan.build import MAX_DP, MAX_TP, resolve_model
from canzona.specs import ParamSpec, specs_from_config

TOY = [
    ParamSpec("embed.weight", (13, 6), "elementwise"),
    ParamSpec("layers.0.q", (7, 6), "matrix", 0),  # uneven TP chunks (4 / 3) under tp 2
    ParamSpec("layers.0.o", (6, 7), "matrix", 1),
    ParamSpec("layers.0.norm", (6,), "elementwise"),
    ParamSpec("layers.0.experts", (5, 4, 3), "experts"),  # 5 experts over dp_shard 2: 3 and 2
    ParamSpec("layers.1.up", (10, 6), "matrix", 0),
]


def _toy(strategy: str = "lb-asc", **kw) -> Plan:
    return plan_shard(TOY, shard_inputs("toy", dp_shard=2, tp=2, strategy=strategy, cost="flops", **kw))


@pytest.mark.parametrize("strategy", FSDP_STRATEGIES)
def test_an_fsdp2_plan_is_the_one_plan_and_round_trips(strategy: str) -> None:
    plan = _toy(strategy)
    i = plan.inputs
    assert isinstance(plan, Plan) and i.layout_kind == "fsdp2" and (i.dp, i.dp_shard, i.dp_replicate, i.group_size) == (2, 2, 1, 4)
    assert plan.buckets == () and len(plan.micro_groups) == 1
    roles = {p.name: p.role for p in plan.params}
    assert roles == {"embed.weight": "elementwise", "layers.0.q": "shard-task", "layers.0.o": "shard-task",
                     "layers.0.norm": "elementwise", "layers.0.experts": "experts", "layers.1.up": "shard-task"}
    hosts = plan.hosts()
    assert sorted(hosts) == ["layers.0.o", "layers.0.q", "layers.1.up"]  # experts are updated where they live
    assert set(hosts.values()) == {-1} if strategy == "sc" else all(0 <= h < 4 for h in hosts.values())
    doc = json.loads(plan.to_json())
    assert doc["schema"] == "canzona.plan" and doc["version"] == 3 and doc["buckets"] == []
    back = Plan.from_dict(doc)
    assert back == plan and back.fingerprint == plan.fingerprint
    # make_plan is the one entry point: it dispatches on layout_kind
    assert make_plan(TOY, plan.inputs) == plan


def test_fsdp2_plans_refuse_what_they_cannot_be() -> None:
    doc = _toy().to_dict()
    for edit, msg in (
        (lambda d: d["micro_groups"]["0"][0]["hosts"].__setitem__(0, 9), "out of range for a shard group of 4"),
        (lambda d: d["params"][1].__setitem__("bucket", 0), "places no parameter in a buffer"),
        (lambda d: d["params"][1].__setitem__("role", "tp-task"), "expected 'shard-task'"),
        (lambda d: d["inputs"].__setitem__("dp", 4), "dp = dp_replicate x dp_shard"),
        (lambda d: d["inputs"].__setitem__("bucket_numel", 10), "bucket_numel must be 0"),
        (lambda d: d["inputs"].__setitem__("strategy", "zero1"), "does not run on FSDP2"),
        (lambda d: d.__setitem__("version", 2), "version-3 document"),
    ):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        with pytest.raises(PlanError, match=msg):
            Plan.from_dict(bad)
    with pytest.raises(PlanError, match="a zero1 plan has 1 for both"):
        PlanInputs("m", "hf", 2, 1, "muon", "lb-asc", "lpt", 100, dp_shard=2)
    with pytest.raises(PlanError, match="tp 1"):
        plan_shard(specs_from_config(resolve_model("qwen3-tiny"), tp=2), shard_inputs("t", dp_shard=2, tp=2))


def test_the_old_fsdp2_document_is_refused_with_the_command_that_plans_it_again() -> None:
    old = {"schema": "canzona.fsdp_plan", "version": 1, "inputs": {"model": "qwen3-32b", "dp_shard": 32, "tp": 8, "dp_replicate": 2,
           "optimizer": "muon", "strategy": "asc", "cost": "numel", "cmax_bytes": 1, "grad_bytes": 4}, "params": [], "groups": [], "metrics": {}}
    with pytest.raises(PlanError) as err:
        Plan.from_dict(old)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and "no longer reads" in msg
    assert "canzona plan --model qwen3-32b --fsdp 32 --tp 8 --dp-replicate 2 --strategy asc --json PATH" in msg


def test_zero1_fingerprints_do_not_change_with_the_layout_fields() -> None:
    plan = plan_model("qwen3-tiny", dp=2, tp=2)
    doc = plan.to_dict()
    assert (doc["inputs"]["layout_kind"], doc["inputs"]["dp_shard"], doc["inputs"]["dp_replicate"]) == ("zero1", 1, 1)
    # the digest leaves the three out for a ZeRO-1 plan, so version-2 documents keep their fingerprint
    assert plan._digest(2) == plan.fingerprint


def test_plan_fsdp_model_has_the_cli_rank_bound() -> None:
    assert MAX_DP == 131072
    for kw, msg in (
        ({"dp_shard": MAX_DP, "dp_replicate": 2}, f"dp_replicate 2 x dp_shard {MAX_DP} = {2 * MAX_DP} data-parallel ranks, above canzona's bound {MAX_DP}"),
        ({"dp_shard": MAX_DP + 1}, "above canzona's bound"),
        ({"dp_shard": 2, "tp": MAX_TP * 2}, f"tp {MAX_TP * 2} is above canzona's bound {MAX_TP}"),
        ({"dp_shard": 0}, "dp_shard must be an integer >= 1"),
    ):
        with pytest.raises(ValueError, match=msg) as err:
            plan_fsdp_model("qwen3-tiny", **kw)
        assert len(str(err.value).splitlines()) == 1
    # the bound itself is allowed (replicas are cheap to plan: one shard group's plan serves them all)
    assert plan_fsdp_model("qwen3-tiny", dp_shard=2, dp_replicate=MAX_DP // 2).inputs.world == MAX_DP


def test_expert_stacks_are_e_tasks_on_the_ranks_that_hold_them() -> None:
    plan = _toy("lb-asc")
    d = plan.metrics.details
    per_expert_f, per_expert_b = matrix_flops("muon", (4, 3)), state_bytes("muon", (4, 3))
    assert d["n_expert_tasks"] == 5 and d["n_matrix_tasks"] == 3
    # rank d * tp + t holds experts of chunk d (3 on d = 0, 2 on d = 1), replicated over tp
    expert_f = [3 * per_expert_f] * 2 + [2 * per_expert_f] * 2
    ew = [0.0] * 4
    for s in TOY:
        if s.kind == "elementwise":
            ew = [a + adamw_flops(k) for a, k in zip(ew, piece_numels(s.shape, s.tp_dim, 2, 2))]
    hosted = [0.0] * 4
    for name, h in plan.hosts().items():
        hosted[h] += matrix_flops("muon", next(s.shape for s in TOY if s.name == name))
    assert d["flops_per_rank"] == pytest.approx([a + b + c for a, b, c in zip(expert_f, ew, hosted)], rel=0, abs=0)
    assert sum(d["state_bytes_per_rank"]) >= 2 * 5 * per_expert_b  # every expert's state on both of its tp ranks


def test_cli_plan_fsdp_of_a_moe_model_hosts_experts_individually(capsys) -> None:
    from canzona.cli import main

    cfg = resolve_model("qwen3-moe-tiny")
    code = main(["plan", "--model", "qwen3-moe-tiny", "--fsdp", "4", "--cost", "flops"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    plan = plan_fsdp_model("qwen3-moe-tiny", dp_shard=4, cost="flops")
    d = plan.metrics.details
    stacks = [p for p in plan.params if p.spec.kind == "experts"]
    assert stacks and d["n_expert_tasks"] == len(stacks) * cfg.moe.num_experts
    assert f"{d['n_expert_tasks']} expert tasks" in out
    assert f"FLOPs ratio (max/mean)    {d['flops_ratio']:.3f}   (atomic bound {d['flops_bound']:.3f})" in out
    # the bound takes one expert as a task: at most the largest (M, N) expert or matrix over the mean
    largest = max(matrix_flops("muon", p.spec.task_shape) for p in plan.params if p.spec.kind != "elementwise")
    assert d["flops_bound"] == pytest.approx(max(1.0, largest / d["flops_mean"]))


def test_simulate_fsdp_prices_each_rank_s_own_experts() -> None:
    from canzona.sim.hardware import load_hardware
    from canzona.sim.model import Setup
    from canzona.sim.shard import _ns_seconds, simulate_fsdp

    hw, setup = load_hardware("h800-ib400"), Setup(tp_overlap="pipelined")
    stacked = plan_fsdp_model("qwen3-moe-tiny", dp_shard=4, strategy="lb-asc", cost="flops")
    bare = plan_shard(
        [s for s in stacked.specs if s.kind != "experts"],
        stacked.inputs,
    )
    a, b = simulate_fsdp(stacked, hw, setup), simulate_fsdp(bare, hw, setup)
    stacks = [s for s in stacked.specs if s.kind == "experts"]
    # each of the 4 ranks holds a quarter of every stack's experts (qwen3-moe-tiny's counts divide)
    own = sum(s.shape[0] // 4 * _ns_seconds(hw, setup, "muon", s.task_shape) for s in stacks)
    assert own > 0 and math.isclose(a.elementwise_s - b.elementwise_s, own, rel_tol=1e-9)
    # per rank, exactly its own experts more (the pipelined exchange may hide it in the step time)
    assert [x - y for x, y in zip(a.per_rank_s, b.per_rank_s)] == pytest.approx([own] * 4, rel=1e-9)
    with pytest.raises(ValueError, match="FSDP2 plans"):
        simulate_fsdp(plan_model("qwen3-tiny", dp=2), hw, setup)


def test_shard_specs_keep_tp_split_dims_with_tp_one() -> None:
    specs = specs_from_config(resolve_model("qwen3-tiny"), tp=2, layout="hf")
    out = shard_specs(specs)
    assert all(s.tp == 1 for s in out)
    assert [s.tp_dim for s in out] == [s.tp_dim if s.tp_split else None for s in specs]


def test_each_layout_refuses_the_other_layout_s_plan() -> None:
    from types import SimpleNamespace

    from canzona.layouts.fsdp2 import FSDP2Layout
    from canzona.layouts.zero1 import Zero1Layout

    shard, zero1 = plan_fsdp_model("qwen3-tiny", dp_shard=2), plan_model("qwen3-tiny", dp=2, layout="hf")
    # tp 1, dp 2, lb-asc: a live model without TP has these very specs on both layouts, so without the
    # layout check an FSDP2 plan would pass for a ZeRO-1 one (and the reverse)
    assert (shard.inputs.dp, shard.inputs.tp, shard.inputs.strategy) == (zero1.inputs.dp, zero1.inputs.tp, zero1.inputs.strategy)
    with pytest.raises(TypeError, match="for the ZeRO-1 layout, got an FSDP2 plan"):
        Zero1Layout._check_given_plan(SimpleNamespace(dp=2, tp=1), shard, list(shard.specs))
    with pytest.raises(TypeError, match="made for FSDP2 .* got a ZeRO-1 Plan"):
        FSDP2Layout._check_given_plan(zero1, list(zero1.specs), shard.inputs)
