"""DP partitioners on small hand-checked cases (Section 3, Algorithm 1)."""

from __future__ import annotations

import numpy as np
import pytest

from canzona.plan import PlanError, PlanInputs, make_plan
from canzona.plan import dp as D
from canzona.plan.buckets import layout_buffer
from canzona.specs import ParamSpec


def _buffer(sizes, kinds=None, bucket_numel=10**9):
    """Specs whose *buffer* order is ``sizes`` (registration order is the reverse)."""
    kinds = kinds or ["matrix"] * len(sizes)
    specs = [
        ParamSpec(f"p{i}", (n, 1) if k == "matrix" else (n,), k) for i, (n, k) in enumerate(zip(sizes, kinds))
    ][::-1]
    return specs, layout_buffer(specs, bucket_numel)


def _plan(specs, strategy, dp, bucket_numel=10**9, **kw):
    inp = PlanInputs(model="t", layout="megatron", dp=dp, tp=1, optimizer="muon", strategy=strategy,
                     tp_schedule="sync", bucket_numel=bucket_numel, **kw)
    return make_plan(specs, inp)


def test_zero1_equal_chunks_cut_tensors():
    specs, lay = _buffer([4, 3, 3])
    a = D.zero1(lay, 3)
    assert a.cuts == ((0, 4, 7, 10),)  # 10 = 3 * 3 + 1: rank 0 takes the extra element
    plan = _plan(specs, "zero1", 3)
    assert plan.param("p0").dp_owner == 0 and plan.param("p1").dp_owner == 1
    specs, lay = _buffer([5, 5])
    plan = _plan(specs, "zero1", 4)  # chunks 3, 3, 2, 2
    assert plan.buckets[0].cuts == (0, 3, 6, 8, 10)
    assert plan.param("p0").dp_owner is None and plan.param("p0").dp_ranges == ((0, 0, 3), (1, 3, 5))
    assert plan.param("p1").dp_ranges == ((1, 0, 1), (2, 1, 3), (3, 3, 5))


def test_asc_start_index_rule():
    specs, lay = _buffer([4, 4, 2])  # S = 5: offsets 0, 4 -> rank 0; 8 -> rank 1
    a = D.asc(lay, 2)
    assert a.cuts == ((0, 8, 10),) and a.owner.tolist() == [0, 0, 1]
    specs, lay = _buffer([5, 5])  # offset 5 == 1 * S belongs to rank 1 (r S <= start < (r+1) S)
    assert D.asc(lay, 2).owner.tolist() == [0, 1]


def test_asc_empty_ranks_and_single_large_parameter():
    specs, lay = _buffer([10])
    a = D.asc(lay, 4)
    assert a.cuts == ((0, 10, 10, 10, 10),) and a.owner.tolist() == [0]
    specs, lay = _buffer([1, 9])  # the 9 starts in rank 0's slice (S = 2.5) and is owned whole
    a = D.asc(lay, 4)
    assert a.cuts == ((0, 10, 10, 10, 10),)
    plan = _plan(specs, "asc", 4)
    assert plan.metrics.details["dp_numel_loads"] == [10, 0, 0, 0]


def test_lb_asc_snaps_to_nearest_boundary_ties_to_earlier():
    specs, lay = _buffer([3, 3, 2, 2])  # mu = 5, C = 5, Phi = 0 3 6 8 10 -> |6 - 5| wins
    a = D.lb_asc(lay, 2, lay.numel.astype(float))
    assert a.cuts == ((0, 6, 10),)
    specs, lay = _buffer([1, 2, 1])  # C = 2, Phi = 0 1 3 4: |1-2| == |3-2| -> earlier boundary
    assert D.lb_asc(lay, 2, lay.numel.astype(float)).cuts == ((0, 1, 4),)


def test_lb_asc_visits_heavy_buckets_first_and_fills_deficits():
    # buffer: bucket 0 = [6], bucket 1 = [1, 1, 2]; R = 2, mu = 5
    specs, lay = _buffer([6, 1, 1, 2], bucket_numel=6)
    assert lay.bounds == ((0, 1), (1, 4))
    load = lay.numel.astype(float)
    a = D.lb_asc(lay, 2, load, alpha=1.0)
    # bucket 0 first: C = 3 ties between 0 and 6 -> boundary 0, rank 1 takes the 6;
    # bucket 1: deficits (5, 0) -> rank 0 takes all 4
    assert a.cuts == ((0, 0, 6), (0, 4, 4))
    assert a.owner.tolist() == [1, 0, 0, 0]
    b = D.lb_asc(lay, 2, load, alpha=0.0)  # even targets: bucket 1 split 2 / 2
    assert b.cuts[1] == (0, 2, 4)


def test_lb_asc_zero_deficit_falls_back_to_even():
    specs, lay = _buffer([4, 4, 1, 1], bucket_numel=8)
    load = np.array([4.0, 4.0, 0.0, 0.0])  # second bucket weighs nothing: sum(d) = 0 there
    a = D.lb_asc(lay, 2, load)
    assert a.cuts[0] == (0, 4, 8)
    assert a.cuts[1][0] == 0 and a.cuts[1][-1] == 2


def test_lb_asc_dp1_and_more_ranks_than_parameters():
    specs, lay = _buffer([3, 2])
    assert D.lb_asc(lay, 1, lay.numel.astype(float)).cuts == ((0, 5),)
    a = D.lb_asc(lay, 5, lay.numel.astype(float))
    c = a.cuts[0]
    assert c[0] == 0 and c[-1] == 5 and list(c) == sorted(c)
    assert sorted(set(a.owner.tolist())) == sorted(set(a.owner.tolist())) and (a.owner >= 0).all()


def test_layerwise_lpt_ties_by_name():
    specs, lay = _buffer([2, 2, 2, 1])
    names = [f"p{i}" for i in range(4)]
    a = D.layerwise(lay, 2, lay.numel.astype(float), names)
    # LPT: p0 -> 0, p1 -> 1, p2 -> 0 (loads tie, lower rank), p3 -> 1
    assert a.owner.tolist() == [0, 1, 0, 1] and a.cuts == ((),)


def test_sc_has_no_owners():
    specs, lay = _buffer([2, 3])
    plan = _plan(specs, "sc", 3)
    assert all(p.dp_owner is None and not p.dp_ranges for p in plan.params)
    assert plan.buckets[0].cuts == () and plan.metrics.dp_flops_ratio == 1.0


def test_joint_cuts_elementwise_only_and_balances():
    # one huge element-wise tensor and four equal matrices on 2 ranks: Algorithm 1 cannot split
    # the embedding, the joint planner spreads it
    sizes = [8, 2, 2, 2, 2]
    kinds = ["elementwise", "matrix", "matrix", "matrix", "matrix"]
    specs, lay = _buffer(sizes, kinds)
    joint = _plan(specs, "lb-asc-joint", 2)
    alg1 = _plan(specs, "lb-asc", 2)
    assert joint.param("p0").dp_owner is None and len(joint.param("p0").dp_ranges) == 2
    assert all(joint.param(f"p{i}").dp_owner is not None for i in range(1, 5))
    jm = max(joint.metrics.dp_flops_ratio, joint.metrics.dp_memory_ratio)
    am = max(alg1.metrics.dp_flops_ratio, alg1.metrics.dp_memory_ratio)
    assert jm < am and jm <= 1.2  # 8 elements: integer cuts cannot reach the continuous optimum 1.08


def test_joint_dp1():
    specs, lay = _buffer([8, 2], ["elementwise", "matrix"])
    plan = _plan(specs, "lb-asc-joint", 1)
    assert plan.buckets[0].cuts == (0, 10)


def test_matrix_never_cut_by_paper_strategies():
    specs, lay = _buffer([7, 1, 1, 7, 3, 5], bucket_numel=9)
    for st in ("asc", "lb-asc", "layerwise", "lb-asc-joint"):
        plan = _plan(specs, st, 3, bucket_numel=9)
        assert all(p.dp_owner is not None for p in plan.params), st


def test_bad_alpha_rejected():
    specs, _ = _buffer([1, 1])
    with pytest.raises(PlanError, match="alpha"):
        _plan(specs, "lb-asc", 2, alpha=1.5)
