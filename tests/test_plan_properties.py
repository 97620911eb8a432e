"""Property tests: every strategy yields a plan that passes Plan.validate on random parameter lists,
deterministically, with the geometric guarantees each strategy promises."""

from __future__ import annotations

import warnings

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from canzona.plan import STRATEGIES, TP_SCHEDULES, PlanInputs, default_tp_schedule, make_plan
from canzona.specs import ParamSpec


@st.composite
def models(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    n = draw(st.integers(1, 14))
    specs = []
    for i in range(n):
        kind = draw(st.sampled_from(["matrix", "matrix", "elementwise"]))
        if kind == "matrix":
            shape = (tp * draw(st.integers(1, 6)), tp * draw(st.integers(1, 6)))
            tp_dim = draw(st.sampled_from([None, 0, 1]))
        else:
            shape = (tp * draw(st.integers(1, 40)),)
            tp_dim = draw(st.sampled_from([None, 0]))
        specs.append(ParamSpec(f"p{i:02d}", shape, kind, tp_dim, tp))
    dp = draw(st.integers(1, 6))
    bucket = draw(st.integers(1, 120))
    return specs, dp, tp, bucket


def _inputs(strategy, dp, tp, bucket, **kw):
    return PlanInputs(model="random", layout="megatron", dp=dp, tp=tp, optimizer="muon", strategy=strategy,
                      tp_schedule=kw.pop("tp_schedule", default_tp_schedule(strategy)), bucket_numel=bucket, **kw)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(models(), st.sampled_from(STRATEGIES), st.sampled_from(["numel", "flops", "memory"]),
       st.floats(0.0, 1.0), st.sampled_from(["full", "local"]))
def test_every_strategy_validates(model, strategy, cost, alpha, shape):
    specs, dp, tp, bucket = model
    inp = _inputs(strategy, dp, tp, bucket, cost=cost, alpha=alpha, flops_shape=shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(specs, inp)  # Plan.__post_init__ runs validate()
        again = make_plan(specs, inp)
    assert plan.fingerprint == again.fingerprint
    # every element of every bucket is owned exactly once (the union of owners tiles the bucket)
    if strategy not in ("sc", "layerwise"):
        for b in plan.buckets:
            assert b.cuts[0] == 0 and b.cuts[-1] == b.numel and list(b.cuts) == sorted(b.cuts)
    if strategy in ("asc", "lb-asc", "layerwise", "lb-asc-joint"):
        assert all(p.dp_owner is not None for p in plan.params if p.spec.kind == "matrix")
    if strategy in ("asc", "lb-asc", "layerwise"):
        assert all(p.dp_owner is not None for p in plan.params)
    m = plan.metrics
    assert m.dp_flops_ratio >= 1.0 - 1e-9 and m.dp_memory_ratio >= 1.0 - 1e-9 and m.j_dp >= 0 and m.j_comm >= 0
    assert sum(m.details["dp_numel_loads"]) == (
        sum(b.numel for b in plan.buckets) * (dp if strategy == "sc" else 1)
    )


@settings(max_examples=30, deadline=None)
@given(models(), st.sampled_from([s for s in TP_SCHEDULES if s != "sync"]), st.integers(1, 400),
       st.sampled_from(["lb-asc", "asc", "layerwise", "lb-asc-joint"]))
def test_every_tp_schedule_validates(model, schedule, cmax, strategy):
    specs, dp, tp, bucket = model
    inp = _inputs(strategy, dp, tp, bucket, tp_schedule=schedule, cmax_bytes=cmax)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = make_plan(specs, inp)
    for groups in plan.micro_groups:
        for g in groups:
            # C_max holds for every group that has more than one task
            if len(g.params) > 1:
                per_host = [0] * tp
                for n, h in zip(g.params, g.hosts):
                    per_host[h] += 4 * plan.param(n).spec.numel
                assert max(per_host) <= cmax
