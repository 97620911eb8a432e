"""ZeRO-1 buffer geometry (Appendix B.1): reverse registration order, buckets close at >= size."""

from __future__ import annotations

import pytest

from canzona.plan import default_bucket_numel
from canzona.plan.buckets import layout_buffer
from canzona.specs import ParamSpec


def _specs(sizes):
    return [ParamSpec(f"p{i}", (n,), "elementwise") for i, n in enumerate(sizes)]


def test_default_bucket_numel():
    assert default_bucket_numel(1) == 40_000_000
    assert default_bucket_numel(32) == 40_000_000
    assert default_bucket_numel(64) == 64_000_000
    assert default_bucket_numel(1024) == 1_024_000_000
    with pytest.raises(ValueError):
        default_bucket_numel(0)


def test_reverse_order_and_closing_rule():
    # registration p0..p4 = 3, 4, 2, 5, 1; buffer order p4 p3 p2 p1 p0 = 1, 5, 2, 4, 3
    lay = layout_buffer(_specs([3, 4, 2, 5, 1]), bucket_numel=6)
    assert lay.order.tolist() == [4, 3, 2, 1, 0]
    # bucket 0: 1 + 5 = 6 >= 6 closes; bucket 1: 2 + 4 = 6 closes; bucket 2: 3 (the rest)
    assert lay.bounds == ((0, 2), (2, 4), (4, 5))
    assert lay.bucket_numel.tolist() == [6, 6, 3]
    assert lay.bucket_start.tolist() == [0, 6, 12]
    assert lay.offset.tolist() == [0, 1, 0, 2, 0]


def test_bucket_never_splits_a_parameter_and_may_overshoot():
    lay = layout_buffer(_specs([10, 1, 1]), bucket_numel=3)  # buffer: 1, 1, 10
    assert lay.bounds == ((0, 3),)  # 1 + 1 = 2 < 3, then the 10 closes it at 12
    assert lay.bucket_numel.tolist() == [12]


def test_one_parameter_per_bucket_when_every_parameter_is_large():
    lay = layout_buffer(_specs([5, 7, 9]), bucket_numel=1)
    assert lay.n_buckets == 3 and lay.bucket_numel.tolist() == [9, 7, 5]


def test_sizes_are_tp_local():
    specs = [ParamSpec("w", (8, 4), "matrix", 0, 4), ParamSpec("n", (4,), "elementwise")]
    lay = layout_buffer(specs, bucket_numel=100)
    assert lay.numel.tolist() == [4, 8]


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        layout_buffer(_specs([1]), 0)
    with pytest.raises(ValueError):
        layout_buffer([], 10)
