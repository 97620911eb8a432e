"""TP micro-groups: Algorithm 2 (greedy packing with rollback) with Algorithm 4 (MinHeapSolver)."""

from __future__ import annotations

import heapq
import random
import warnings

import pytest

from canzona.plan import PlanError, PlanInputs, make_plan, plan_model
from canzona.plan.tp import Task, min_heap_solver, schedule_tasks
from canzona.specs import ParamSpec


def _literal_algorithm2(tasks, tp, cmax):
    """Algorithm 3 as written: re-solve every candidate group from scratch with Algorithm 4."""

    def solve(group):
        order = sorted(range(len(group)), key=lambda i: -group[i].cost)  # stable: keeps global order
        pq = [(0.0, r) for r in range(tp)]
        hosts, nbytes = [0] * len(group), [0] * tp
        for i in order:
            load, r = heapq.heappop(pq)
            hosts[i] = r
            nbytes[r] += group[i].nbytes
            heapq.heappush(pq, (load + group[i].cost, r))
        return hosts, max(nbytes)

    ordered = sorted(tasks, key=lambda t: (-t.cost, t.name))
    groups, cur, i = [], [], 0
    while i < len(ordered):
        test = cur + [ordered[i]]
        _, lmax = solve(test)
        if lmax <= cmax or not cur:
            cur = test
            i += 1
        else:
            groups.append(cur)
            cur = []
    if cur:
        groups.append(cur)
    return [([t.name for t in g], solve(g)[0]) for g in groups]


def test_min_heap_solver_lpt_and_ties():
    hosts, loads = min_heap_solver([5, 3, 3, 2], 2)
    assert hosts == [0, 1, 1, 0] and loads == [7.0, 6.0]
    hosts, loads = min_heap_solver([1, 1], 4)
    assert hosts == [0, 1] and loads == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("seed", range(25))
def test_incremental_lpt_equals_literal_algorithm(seed):
    rng = random.Random(seed)
    tp = rng.choice([2, 3, 4, 8])
    tasks = [Task(f"t{i:02d}", float(rng.choice([1, 2, 3, 5, 8, 8])), 4 * rng.randint(1, 20)) for i in range(rng.randint(1, 30))]
    cmax = rng.choice([4, 20, 40, 100, 10**6])
    got = [(list(g.names), list(g.hosts)) for g in schedule_tasks(tasks, tp, "lpt", cmax)]
    assert got == _literal_algorithm2(tasks, tp, cmax)


def test_rollback_closes_group_and_capacity_holds():
    tasks = [Task("a", 4, 4), Task("b", 4, 4), Task("c", 2, 2), Task("d", 1, 1)]
    groups = schedule_tasks(tasks, 2, "lpt", 5)
    # a -> 0, b -> 1; c would make host 0 hold 6 bytes > 5 -> new group {c, d}
    assert [g.names for g in groups] == [("a", "b"), ("c", "d")]
    assert [g.hosts for g in groups] == [(0, 1), (0, 1)]
    assert groups[0].loads == (4.0, 4.0) and groups[1].loads == (2.0, 1.0)


def test_task_above_cmax_gets_its_own_group_on_host_0_but_carry_spreads():
    tasks = [Task(n, 10, 100) for n in ("a", "b", "c")] + [Task("s", 1, 1)]
    lpt = schedule_tasks(tasks, 2, "lpt", 50)
    assert [g.names for g in lpt] == [("a",), ("b",), ("c",), ("s",)]
    assert [g.hosts for g in lpt] == [(0,), (0,), (0,), (0,)]  # zero-start heap: always host 0
    carry = schedule_tasks(tasks, 2, "lpt-carry", 50)
    assert [g.hosts for g in carry] == [(0,), (1,), (0,), (1,)]


def test_round_robin_and_no_fuse():
    tasks = [Task("b", 1, 1), Task("a", 5, 1), Task("c", 2, 1)]
    rr = schedule_tasks(tasks, 2, "round-robin", 10)
    assert [(g.names, g.hosts) for g in rr] == [(("a", "b", "c"), (0, 1, 0))]
    assert rr[0].loads == (7.0, 1.0)
    rr_small = schedule_tasks(tasks, 2, "round-robin", 1)  # host 0 can take one byte per group
    assert [g.names for g in rr_small] == [("a", "b"), ("c",)]
    nf = schedule_tasks(tasks, 2, "no-fuse", 10)
    assert [(g.names, g.hosts) for g in nf] == [(("a",), (0,)), (("c",), (1,)), (("b",), (1,))]


def test_no_fuse_differs_from_lpt_in_fusion_only():
    # same hosts and order as the fused schedule, one task per group, whatever C_max does
    tasks = [Task(f"t{i}", float(c), b) for i, (c, b) in enumerate([(9, 6), (7, 3), (7, 3), (4, 2), (2, 1), (1, 9)])]
    for cmax in (5, 9, 12, 100):
        fused = schedule_tasks(tasks, 3, "lpt", cmax)
        nf = schedule_tasks(tasks, 3, "no-fuse", cmax)
        assert [n for g in nf for n in g.names] == [n for g in fused for n in g.names]
        assert [h for g in nf for h in g.hosts] == [h for g in fused for h in g.hosts]
        assert all(len(g.names) == 1 for g in nf)
    # one-task groups under the zero-start heap: every host 0, in both
    small = schedule_tasks(tasks, 3, "no-fuse", 1)
    assert {g.hosts for g in small} == {(0,)}


def test_unknown_schedule():
    with pytest.raises(ValueError, match="schedule"):
        schedule_tasks([], 2, "fifo", 1)


def _tiny_plan(**kw):
    base = dict(dp=2, tp=2, bucket_numel=20_000)
    base.update(kw)
    return plan_model("qwen3-tiny", **base)


def test_plan_groups_cover_owned_split_matrices():
    plan = _tiny_plan(strategy="lb-asc")
    assert plan.inputs.tp_schedule == "lpt-carry" and len(plan.micro_groups) == 2
    for p in plan.params:
        if p.spec.kind == "matrix" and p.spec.tp_split:
            g = plan.micro_groups[p.dp_owner][p.micro_group]
            assert p.name in g.params and g.hosts[g.params.index(p.name)] == p.tp_host
        else:
            assert p.tp_host is None


def test_tp1_has_no_groups_and_ratio_one():
    plan = _tiny_plan(tp=1, dp=4)
    assert plan.micro_groups == () and plan.metrics.tp_flops_ratio == 1.0


def test_cmax_below_largest_task_warns_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _tiny_plan(cmax_bytes=1)
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "exceed C_max" in msgs[0]
    for groups in plan.micro_groups:
        assert all(len(g.params) == 1 for g in groups)


def test_sync_schedule_and_invalid_combinations():
    plan = _tiny_plan(strategy="lb-asc", tp_schedule="sync")
    assert plan.micro_groups == () and plan.metrics.tp_flops_ratio == 1.0
    with pytest.raises(PlanError, match="sync"):
        _tiny_plan(strategy="sc", tp_schedule="lpt")
    with pytest.raises(PlanError, match="sync"):
        _tiny_plan(strategy="zero1", tp_schedule="lpt")


def test_specs_for_another_tp_rejected():
    specs = [ParamSpec("w", (4, 4), "matrix", 0, 2)]
    inp = PlanInputs(model="t", layout="megatron", dp=1, tp=4, optimizer="muon", strategy="lb-asc",
                     tp_schedule="lpt", bucket_numel=10)
    with pytest.raises(PlanError, match="tp=2"):
        make_plan(specs, inp)


def test_tp_ratio_uses_worst_group_and_lpt_beats_one_host():
    plan = _tiny_plan(strategy="lb-asc", dp=1, tp=4, bucket_numel=10**9)
    hosts = plan.metrics.details["tp_host_flops_loads"]
    assert len(hosts) == 4
    assert plan.metrics.tp_flops_ratio == pytest.approx(max(hosts) / (sum(hosts) / 4))
    assert plan.metrics.tp_flops_ratio < 1.5
