"""Expert parallelism in the planner: the preload hook of the DP partitioners, the EP plan of the
runtime's layout (dense over dp x ep ranks, experts over the expert-DP group), the per-GPU
accounting, and ``canzona plan --ep`` (report, bounds, one-line refusals with exit 2)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from canzona.plan import make_plan
from canzona.plan.buckets import layout_buffer
from canzona.plan.dp import layerwise, lb_asc
from canzona.plan.ep import EPPlan, gpu_loads, local_expert_specs, plan_ep, plan_model_ep
from canzona.plan.errors import PlanError
from canzona.plan.plan import PlanInputs
from canzona.specs import ParamSpec


def _specs() -> list[ParamSpec]:
    out = [ParamSpec("embed", (64, 16), "elementwise")]
    for i in range(4):
        out += [ParamSpec(f"l{i}.attn", (48, 16), "matrix"), ParamSpec(f"l{i}.norm", (16,), "elementwise"),
                ParamSpec(f"l{i}.experts.up", (8, 24, 16), "experts"), ParamSpec(f"l{i}.experts.down", (8, 16, 12), "experts")]
    return out


def _inputs(dp: int, strategy: str = "lb-asc") -> PlanInputs:
    return PlanInputs(model="toy", layout="module", dp=dp, tp=1, optimizer="muon", strategy=strategy, tp_schedule="sync", bucket_numel=2000)


# ------------------------------------------------------------------------------ the preload hook
def test_preload_fills_ranks_around_their_initial_load() -> None:
    specs = [s for s in _specs() if s.kind != "experts"]
    layout = layout_buffer(specs, 2000)
    load = layout.numel.astype(np.float64)
    plain = lb_asc(layout, 4, load)
    same = lb_asc(layout, 4, load, preload=np.full(4, 123.0))
    assert plain.cuts == same.cuts  # an equal preload changes nothing
    heavy = lb_asc(layout, 4, load, preload=np.array([float(load.sum()), 0, 0, 0]))
    got = np.zeros(4)
    for b, c in enumerate(heavy.cuts):
        got += np.diff(np.asarray(c))
    assert got[0] < got[1:].min()  # the preloaded rank takes the least new work
    lw = layerwise(layout, 4, load, [s.name for s in specs], preload=np.array([float(load.sum()), 0, 0, 0]))
    assert 0 not in lw.owner.tolist()
    with pytest.raises(ValueError, match="preload must be 4 finite loads"):
        lb_asc(layout, 4, load, preload=np.array([1.0, -1.0, 0, 0]))


def test_make_plan_with_preload_is_a_valid_plan_that_differs() -> None:
    specs = [s for s in _specs() if s.kind != "experts"]
    a = make_plan(specs, _inputs(4))
    b = make_plan(specs, _inputs(4), preload=[1e4, 0.0, 0.0, 0.0])
    assert a.fingerprint != b.fingerprint
    assert b.metrics.details["dp_cost_loads"][0] < min(b.metrics.details["dp_cost_loads"][1:])


# ------------------------------------------------------------------------------ the layout's EP plan
@pytest.mark.parametrize("dp,ep", [(1, 2), (2, 2), (2, 4)])
def test_ep_plan_parts_and_preload(dp: int, ep: int) -> None:
    dense, local = local_expert_specs(_specs(), ep)
    assert {s.name: s.shape[0] for s in local} == {s.name: 8 // ep for s in _specs() if s.kind == "experts"}
    plan = plan_ep(dense, local, _inputs(dp * ep), ep=ep)
    assert isinstance(plan, EPPlan) and plan.dense.inputs.dp == dp * ep and plan.experts.inputs.dp == dp
    loads = plan.experts.metrics.details["dp_cost_loads"]
    assert plan.expert_preload().tolist() == [loads[r // ep] for r in range(dp * ep)]
    # dense load + expert preload: what lb-asc balanced, never worse than the dense plan alone on top
    total = np.asarray(plan.dense.metrics.details["dp_cost_loads"]) + plan.expert_preload()
    alone = make_plan(dense, _inputs(dp * ep))
    assert total.max() <= (np.asarray(alone.metrics.details["dp_cost_loads"]) + plan.expert_preload()).max()
    assert plan.fingerprint != plan_ep(dense, local, _inputs(dp * ep, "sc"), ep=ep).fingerprint
    assert plan.plan_of("l0.experts.up") is plan.experts and plan.plan_of("l0.attn") is plan.dense


@pytest.mark.parametrize("dp,ep,tp", [(1, 2, 2), (2, 2, 2)])
def test_ep_plan_beside_tp(dp: int, ep: int, tp: int) -> None:
    """Mesh ("dp", "ep", "tp"): the dense plan over dp x ep DP ranks x tp, the experts over the
    dp x tp holders without TP; dense rank r's preload is the mean of its TP ranks' expert loads."""
    from dataclasses import replace

    specs = [replace(s, tp_dim=0, tp=tp) if s.name.endswith(".attn") else s for s in _specs()]
    dense, local = local_expert_specs(specs, ep)
    plan = plan_ep(dense, local, replace(_inputs(dp * ep), tp=tp), ep=ep)
    assert (plan.tp, plan.dense.inputs.dp, plan.dense.inputs.tp) == (tp, dp * ep, tp)
    assert (plan.experts.inputs.dp, plan.experts.inputs.tp) == (dp * tp, 1)
    assert any(pp.role == "tp-task" for pp in plan.dense.params)
    loads = plan.experts.metrics.details["dp_cost_loads"]
    assert plan.expert_preload().tolist() == [sum(loads[(r // ep) * tp + t] for t in range(tp)) / tp for r in range(dp * ep)]
    flat = plan_ep([replace(s, tp_dim=None, tp=1) for s in dense], local, _inputs(dp * ep), ep=ep)
    assert plan.fingerprint != flat.fingerprint and f"dp x tp = {dp * tp} ranks" in plan.describe()
    with pytest.raises(PlanError, match="an EP plan needs"):
        EPPlan(dense=plan.dense, experts=plan.experts, dp=dp, ep=ep)  # tp left out


@pytest.mark.parametrize("dp,ep,tp", [(1, 2, 2), (2, 2, 2)])
def test_ep_plan_with_expert_tensor_parallelism(dp: int, ep: int, tp: int) -> None:
    """Every local stack TP-split (ETP): the expert plan is a ZeRO-1 x TP plan over the dp ranks of
    an (ep, tp) coordinate, every expert a TP task; dense rank r's preload is expert rank r // ep's
    load (both plans per TP rank). A mix of split and whole stacks is refused in one line."""
    from dataclasses import replace

    specs = [replace(s, tp_dim=1 if s.name.endswith(".up") else 2, tp=tp) if s.kind == "experts" else s for s in _specs()]
    dense, local = local_expert_specs(specs, ep, etp=True)
    plan = plan_ep(dense, local, replace(_inputs(dp * ep), tp=tp), ep=ep)
    assert plan.etp and (plan.experts.inputs.dp, plan.experts.inputs.tp) == (dp, tp)
    assert plan.experts.params and all(pp.role == "experts" and pp.spec.tp_split for pp in plan.experts.params)
    loads = plan.experts.metrics.details["dp_cost_loads"]
    assert plan.expert_preload().tolist() == [loads[r // ep] for r in range(dp * ep)]
    whole = plan_ep(dense, [replace(s, tp_dim=None, tp=1) for s in local], replace(_inputs(dp * ep), tp=tp), ep=ep)
    assert not whole.etp and plan.fingerprint != whole.fingerprint
    assert "expert tensor parallelism" in plan.describe() and "expert tensor parallelism" not in whole.describe()
    with pytest.raises(PlanError, match="l0.experts.down: not TP-split while other expert stacks are"):
        plan_ep(dense, [replace(s, tp_dim=None, tp=1) if s.name.endswith(".down") else s for s in local],
                replace(_inputs(dp * ep), tp=tp), ep=ep)
    with pytest.raises(PlanError, match="an EP plan needs"):
        EPPlan(dense=plan.dense, experts=plan.experts, dp=dp, ep=ep, tp=tp)  # etp left out
    with pytest.raises(PlanError, match="every expert stack must be TP-split"):
        local_expert_specs([replace(s, tp_dim=None, tp=1) if s.name.endswith(".down") else s for s in specs], ep, etp=True)
    with pytest.raises(PlanError, match="without expert tensor parallelism"):
        local_expert_specs(specs, ep)


def test_ep_plan_refusals() -> None:
    with pytest.raises(PlanError, match="8 experts do not divide by ep=3"):
        local_expert_specs(_specs(), 3)
    with pytest.raises(PlanError, match="the model has none"):
        local_expert_specs([s for s in _specs() if s.kind != "experts"], 2)
    dense, local = local_expert_specs(_specs(), 2)
    with pytest.raises(PlanError, match="does not divide the 3"):
        plan_ep(dense, local, _inputs(3), ep=2)


# ------------------------------------------------------------------------------ cluster scale
@pytest.fixture(scope="module")
def a3b():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model_ep("qwen3-30b-a3b", dp=32, tp=4, ep=8)


def test_gpu_loads_reproduce_the_plans_all_gpu_ratios(a3b) -> None:
    d = a3b.plain.metrics.details
    g = gpu_loads(a3b.plain)
    assert g["flops"].shape == (32, 4)
    for key in ("flops", "memory"):
        v = g[key]
        # the same sums in another order: equal to the last few ulps
        assert float(v.max() / v.mean()) == pytest.approx(d[f"tp_{key}_ratio_global"], rel=1e-12)


@pytest.fixture(scope="module")
def a3b_etp():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model_ep("qwen3-30b-a3b", dp=32, tp=4, ep=8, experts="stacked-tp")


def test_gpu_loads_host_every_expert_task_of_tp_split_stacks(a3b_etp) -> None:
    """Each expert of a TP-split stack is a TP task hosted whole on one TP rank: the per-GPU loads
    reproduce the plan's own all-GPU ratio (which counts those hosts) and conserve the total."""
    plain = a3b_etp.plain
    g, d = gpu_loads(plain), plain.metrics.details
    assert any(pp.role == "experts" and pp.spec.tp_split for pp in plain.params)
    for key in ("flops", "memory"):
        assert float(g[key].max() / g[key].mean()) == pytest.approx(d[f"tp_{key}_ratio_global"], rel=1e-12)
        assert float(g[key].sum()) == pytest.approx(4 * sum(d[f"dp_{key}_loads"]), rel=1e-12)


def test_cluster_plan_with_expert_tensor_parallelism(a3b_etp) -> None:
    """``--experts stacked-tp`` with ``--ep``: every EP coordinate's experts over its dp/ep DP ranks
    x tp, each expert a TP task; every expert counted once per EP coordinate."""
    c = a3b_etp
    assert c.etp and (c.experts.inputs.dp, c.experts.inputs.tp) == (32 // 8, 4)
    per_gpu = gpu_loads(c.experts)["flops"]
    dense = gpu_loads(c.dense)["flops"]
    assert float(c.flops.sum()) == pytest.approx(float(dense.sum()) + 8 * float(per_gpu.sum()), rel=1e-12)
    assert c.flops.max() / c.flops.mean() >= c.bound - 1e-12


def test_every_expert_counted_once_per_ep_coordinate(a3b) -> None:
    experts = a3b.experts
    assert experts.inputs.dp == 32 // 8 * 4  # the GPUs holding one EP coordinate's experts
    per_gpu = np.asarray(experts.metrics.details["dp_flops_loads"])
    dense = gpu_loads(a3b.dense)["flops"]
    assert float(a3b.flops.sum()) == pytest.approx(float(dense.sum()) + 8 * float(per_gpu.sum()), rel=1e-12)
    assert a3b.n_experts == 48 * 2 * 128 and a3b.n_stacks == 96
    assert a3b.bound >= 1.0 and a3b.flops.max() / a3b.flops.mean() >= a3b.bound - 1e-12
    # without EP every TP rank of an owner recomputes its whole stacks: more work on the busiest GPU
    assert a3b.flops.max() < a3b.plain_flops.max()


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from canzona.cli import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_plan_ep_report(capsys) -> None:
    code, out, _ = _cli(["plan", "--model", "qwen3-235b-a22b", "--dp", "32", "--tp", "4", "--ep", "8"], capsys)
    assert code == 0
    assert "DP 32 x TP 4 with EP 8 (mesh ('dp', 'ep', 'tp') = (4, 8, 4), 128 GPUs)" in out
    for row in ("FLOPs max/mean, all GPUs", "atomic lower bound", "state max/mean, all GPUs", "planned in"):
        assert row in out
    assert "expert tensor parallelism" not in out
    code, out, _ = _cli(["plan", "--model", "qwen3-30b-a3b", "--dp", "32", "--tp", "4", "--ep", "8", "--experts", "stacked-tp"], capsys)
    assert code == 0 and "each cut over TP 4 (expert tensor parallelism) and planned over the 4 DP ranks x TP 4" in out, out


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--model", "qwen3-30b-a3b", "--dp", "32", "--ep", "3"], "--ep 3 must divide --dp 32"),
        (["--model", "qwen3-30b-a3b", "--dp", "96", "--ep", "96"], "128 experts do not divide by ep=96"),
        (["--model", "qwen3-32b", "--dp", "8", "--ep", "2"], "the model has none"),
        (["--model", "qwen3-30b-a3b", "--dp", "8", "--ep", "2", "--compare"], "drop --compare"),
        (["--model", "qwen3-30b-a3b", "--dp", "8", "--ep", "0"], "--ep must be >= 1"),
        (["--model", "qwen3-30b-a3b", "--dp", "8", "--ep", "2", "--experts", "separate"], "drop --experts separate"),
    ],
)
def test_cli_plan_ep_refusals_one_line_exit_2(argv: list[str], match: str, capsys) -> None:
    code, out, err = _cli(["plan", *argv], capsys)
    assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # about 4 s: two plans and three step models of a 30B MoE
def test_cli_simulate_ep_predicts_both(capsys) -> None:
    code, out, _ = _cli(["simulate", "--model", "qwen3-30b-a3b", "--dp", "16", "--tp", "2", "--ep", "4"], capsys)
    assert code == 0 and "without EP" in out and "with EP 4" in out and "on its busiest GPU" in out
    code, _, err = _cli(["simulate", "--model", "qwen3-32b", "--dp", "16", "--tp", "2", "--ep", "4"], capsys)
    assert code == 2 and "has no experts" in err and len(err.strip().splitlines()) == 1


def test_expert_seconds_count_every_expert_once() -> None:
    """Split over ranks (lb-asc cuts stacks between experts) the expert times add up to what one
    rank updating everything (sc) needs."""
    from canzona.sim.ep import expert_seconds
    from canzona.sim.hardware import load_hardware
    from canzona.sim.model import Setup

    hw = load_hardware("h800-ib400")
    _, local = local_expert_specs(_specs(), 2)
    split = expert_seconds(make_plan(local, _inputs(3)), hw, Setup(), "muon")
    every = expert_seconds(make_plan(local, _inputs(3, "sc")), hw, Setup(), "muon")
    assert split.shape == (3,) and (split > 0).sum() >= 2
    assert np.allclose(every, every[0]) and float(split.sum()) == pytest.approx(float(every[0]), rel=1e-12)
