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
    assert doc["schema"] == "canzona.plan" and doc["version"] == 1
    assert {"model", "layout", "dp", "tp", "optimizer", "strategy", "alpha", "cost", "cmax_bytes", "bucket_numel"} <= set(doc["inputs"])
    p = doc["params"][0]
    assert {"name", "shape", "local_shape", "tp_dim", "kind", "bucket", "offset", "numel", "dp_owner", "dp_ranges",
            "tp_host", "micro_group"} <= set(p)
    assert {"index", "numel", "cuts"} <= set(doc["buckets"][0])
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
    wrong = dict(doc, version=2)
    with pytest.raises(PlanError, match="version"):
        Plan.from_dict(wrong)
