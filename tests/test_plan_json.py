"""Plan documents: JSON round trip, required keys, fingerprint stability."""

from __future__ import annotations

import json
import warnings

import pytest

from canzona.plan import STRATEGIES, Plan, PlanError, plan_model


def _plan(strategy="lb-asc", **kw):
    base = dict(dp=2, tp=2, bucket_numel=20_000, strategy=strategy)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model("qwen3-tiny", **base)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_round_trip(strategy, tmp_path):
    plan = _plan(strategy)
    path = tmp_path / "plan.json"
    plan.to_json(path)
    back = Plan.from_json(path)
    assert back.fingerprint == plan.fingerprint
    assert back.params == plan.params and back.buckets == plan.buckets and back.micro_groups == plan.micro_groups
    assert back.metrics.dp_flops_ratio == plan.metrics.dp_flops_ratio


def test_document_keys():
    doc = json.loads(_plan().to_json())
    assert doc["schema"] == "canzona.plan" and doc["version"] == 3 and doc["inputs"]["layout_kind"] == "zero1"
    assert {"model", "layout", "dp", "tp", "optimizer", "strategy", "alpha", "cost", "cmax_bytes", "bucket_numel"} <= set(doc["inputs"])
    p = doc["params"][0]
    assert {"name", "shape", "local_shape", "tp_dim", "kind", "bucket", "offset", "numel", "dp_owner", "dp_ranges",
            "tp_host", "micro_group", "role"} <= set(p)
    assert {"index", "numel", "cuts", "collective", "param_return"} <= set(doc["buckets"][0])
    assert set(doc["micro_groups"]) == {"0", "1"}
    assert {"index", "params", "hosts", "loads"} <= set(doc["micro_groups"]["0"][0])
    assert {"dp_memory_ratio", "dp_flops_ratio", "tp_memory_ratio", "tp_flops_ratio", "j_dp", "j_comm",
            "plan_seconds"} <= set(doc["metrics"])


def test_fingerprint_stable_and_sensitive():
    a, b = _plan(), _plan()
    assert a.fingerprint == b.fingerprint and a.metrics.plan_seconds >= 0
    assert _plan(alpha=0.5).fingerprint != a.fingerprint
    assert _plan(tp_schedule="round-robin").fingerprint != a.fingerprint
    big = plan_model("qwen3-32b", dp=32, tp=8, cmax_bytes=2**31)
    assert big.fingerprint == plan_model("qwen3-32b", dp=32, tp=8, cmax_bytes=2**31).fingerprint


def test_tampered_documents_rejected():
    doc = _plan().to_dict()
    bad = json.loads(json.dumps(doc))
    bad["params"][0]["dp_owner"] = 1 - (bad["params"][0]["dp_owner"] or 0)
    with pytest.raises(PlanError):
        Plan.from_dict(bad)
    for version in (4, 0, "2", True):
        with pytest.raises(PlanError, match=r"unsupported plan version .* \(this canzona reads 3 and 2, and migrates 1\)"):
            Plan.from_dict(dict(doc, version=version))
    # the contract fields are checked against the strategy's record, not trusted
    bad = json.loads(json.dumps(doc))
    bad["buckets"][0]["collective"] = "all-reduce"
    with pytest.raises(PlanError, match="bucket 0: collective 'all-reduce'"):
        Plan.from_dict(bad)
    bad = json.loads(json.dumps(doc))
    bad["params"][0]["role"] = "tp-task" if bad["params"][0]["role"] != "tp-task" else "matrix"
    with pytest.raises(PlanError, match="role"):
        Plan.from_dict(bad)


def _as_version_1(plan):
    """The document canzona wrote before version 2: no roles, no bucket collectives, and the
    fingerprint of that format."""
    doc = plan.to_dict()
    doc["version"] = 1
    doc["fingerprint"] = plan._digest(1)
    for q in doc["params"]:
        del q["role"]
    for b in doc["buckets"]:
        del b["collective"], b["param_return"]
    return doc


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_version_1_documents_migrate(strategy):
    plan = _plan(strategy)
    old = _as_version_1(plan)
    back = Plan.from_dict(old)
    assert back == plan and back.fingerprint == plan.fingerprint
    assert back.to_dict()["version"] == 3 and plan.fingerprint != old["fingerprint"]
    tampered = json.loads(json.dumps(old))
    tampered["fingerprint"] = plan.fingerprint  # a version-1 document is checked with its own formula
    with pytest.raises(PlanError, match="fingerprint does not match"):
        Plan.from_dict(tampered)


@pytest.mark.parametrize("strategy", ["lb-asc", "zero1"])
def test_version_2_documents_are_read_with_their_fingerprint(strategy):
    # version 2 had no layout fields: a ZeRO-1 plan's fingerprint leaves them out, so a version-2
    # document reads back as the same plan with the same fingerprint
    plan = _plan(strategy)
    doc = plan.to_dict()
    doc["version"] = 2
    for k in ("layout_kind", "dp_shard", "dp_replicate"):
        del doc["inputs"][k]
    back = Plan.from_dict(json.loads(json.dumps(doc)))
    assert back == plan and back.fingerprint == plan.fingerprint == doc["fingerprint"]


def test_plan_equality_ignores_timing_and_hashes():
    from dataclasses import replace

    a, b = _plan(), _plan()
    b = replace(b, metrics=replace(b.metrics, plan_seconds=b.metrics.plan_seconds + 1.0))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    c = _plan(alpha=0.5)
    assert a != c and len({a, c}) == 2
    other_metrics = replace(a.metrics, dp_flops_ratio=a.metrics.dp_flops_ratio + 1.0)
    assert replace(a, metrics=other_metrics) != a


def test_fingerprint_is_computed_once(monkeypatch):
    plan = _plan()
    calls = []
    digest = Plan._digest
    monkeypatch.setattr(Plan, "_digest", lambda self, v: calls.append(v) or digest(self, v))
    first = plan.fingerprint
    assert plan.fingerprint == first and hash(plan) == hash(first) and calls == [3]


# ------------------------------------------------------------------------------------------ validate
def _corrupt(plan, *, params=None, buckets=None, micro_groups=None):
    """A Plan built from ``plan`` with some parts replaced (validated on construction)."""
    return Plan(
        inputs=plan.inputs,
        params=plan.params if params is None else tuple(params),
        buckets=plan.buckets if buckets is None else tuple(buckets),
        micro_groups=plan.micro_groups if micro_groups is None else tuple(micro_groups),
        metrics=plan.metrics,
    )


def test_param_lookup_is_the_plan_index():
    plan = _plan()
    assert all(plan.param(p.name) is p for p in plan.params)
    assert plan.by_name() == {p.name: p for p in plan.params}
    plan.by_name().clear()  # a copy: the plan's own index is untouched
    assert plan.param(plan.params[0].name) is plan.params[0]
    with pytest.raises(KeyError):
        plan.param("no.such.weight")
    # the index is no input: equality, repr and the document ignore it
    assert _corrupt(plan) == plan and "_index" not in repr(plan) and "_index" not in plan.to_dict()


def test_validate_names_the_broken_invariant():
    from dataclasses import replace

    plan = _plan("lb-asc")
    ps, bs = list(plan.params), list(plan.buckets)
    with pytest.raises(PlanError, match="duplicate parameter names"):
        _corrupt(plan, params=ps + ps[:1])
    b0 = bs[0]
    with pytest.raises(PlanError, match="bucket 0 starts at 1, expected 0"):
        _corrupt(plan, buckets=[replace(b0, start=1)] + bs[1:])
    with pytest.raises(PlanError, match="bucket 0 lists unknown parameter 'nope'"):
        _corrupt(plan, buckets=[replace(b0, params=b0.params + ("nope",))] + bs[1:])
    with pytest.raises(PlanError, match="bucket 0: cut points are not monotone"):
        _corrupt(plan, buckets=[replace(b0, cuts=(0, b0.numel + 1, b0.numel))] + bs[1:])
    with pytest.raises(PlanError, match="bucket 0: 2 cut points, expected dp \\+ 1 = 3"):
        _corrupt(plan, buckets=[replace(b0, cuts=b0.cuts[:2])] + bs[1:])
    i = next(i for i, p in enumerate(ps) if p.dp_owner is not None)
    with pytest.raises(PlanError, match=f"{ps[i].name}: owner 2 outside dp=2"):
        _corrupt(plan, params=ps[:i] + [replace(ps[i], dp_owner=2)] + ps[i + 1:])
    j = next(j for j, p in enumerate(ps) if p.spec.kind == "matrix")
    r = ps[j].dp_owner
    with pytest.raises(PlanError, match=f"{ps[j].name}: matrix parameters must be atomic under lb-asc"):
        _corrupt(plan, params=ps[:j] + [replace(ps[j], dp_owner=None, dp_ranges=((r, 0, ps[j].numel),))] + ps[j + 1:])
    k = next(k for k, p in enumerate(ps) if p.tp_host is not None)
    with pytest.raises(PlanError, match=f"{ps[k].name}: tp_host/micro_group disagree"):
        _corrupt(plan, params=ps[:k] + [replace(ps[k], tp_host=1 - ps[k].tp_host)] + ps[k + 1:])
    with pytest.raises(PlanError, match="micro_groups must have one entry per DP rank"):
        _corrupt(plan, micro_groups=plan.micro_groups[:1])
    e = next(e for e, p in enumerate(ps) if p.tp_host is None)
    with pytest.raises(PlanError, match=f"{ps[e].name}: has a TP host but needs none"):
        _corrupt(plan, params=ps[:e] + [replace(ps[e], tp_host=0, micro_group=0)] + ps[e + 1:])
