"""ZeRO-1 buffer geometry: where each parameter sits in the flat param/grad buffer (Appendix B.1).

Megatron-Core builds its ``param_and_grad_buffer`` from the parameters in *reverse* registration
order (gradients become ready back to front during the backward pass, so the first bucket to fill
is the one holding the last layers) and closes a bucket as soon as it holds at least
``bucket_numel`` elements; a bucket never splits a parameter. All sizes are TP-local element
counts: a TP rank's buffer holds its shard of every parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from canzona.specs import ParamSpec

__all__ = ["DEFAULT_BUCKET_NUMEL", "BufferLayout", "default_bucket_numel", "layout_buffer"]

#: Megatron's default ``bucket_size`` floor (40M elements) ...
DEFAULT_BUCKET_NUMEL = 40_000_000
#: ... scaled up with DP so each rank's shard stays large enough for bandwidth (1M per rank)
_PER_RANK_NUMEL = 1_000_000


def default_bucket_numel(dp: int) -> int:
    """Megatron-Core's default bucket size: ``max(40_000_000, 1_000_000 * dp)`` elements."""
    if not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an integer >= 1, got {dp!r}")
    return max(DEFAULT_BUCKET_NUMEL, _PER_RANK_NUMEL * dp)


@dataclass(frozen=True, slots=True, eq=False)
class BufferLayout:
    """The flat buffer: parameters in buffer order, grouped into buckets.

    ``order[i]`` is the spec index (registration order) of the i-th parameter in the buffer;
    ``numel[i]`` its TP-local size; ``offset[i]`` its offset inside its bucket; ``bucket[i]`` its
    bucket. ``bounds[b] = (i0, i1)``: bucket ``b`` holds buffer positions ``i0 .. i1 - 1``.
    """

    order: np.ndarray
    numel: np.ndarray
    offset: np.ndarray
    bucket: np.ndarray
    bounds: tuple[tuple[int, int], ...]
    bucket_start: np.ndarray
    bucket_numel: np.ndarray

    @property
    def n_buckets(self) -> int:
        return len(self.bounds)

    @property
    def n_params(self) -> int:
        return len(self.order)


def layout_buffer(specs: Sequence[ParamSpec], bucket_numel: int, *, separate: bool = False) -> BufferLayout:
    """Lay ``specs`` (registration order) out in a Megatron ZeRO-1 buffer of ``bucket_numel`` buckets.

    ``separate``: matrix-optimizer parameters and element-wise ones get buffers of their own, as in
    the paper authors' implementation (a Canzona buffer for the matrix optimizer, the ordinary
    distributed-optimizer buffer for the rest): the matrix buffer comes first, then the element-wise
    one, each bucketed on its own, so no bucket mixes the two kinds.
    """
    if separate:
        kinds = [[i for i, s in enumerate(specs) if (s.kind == "matrix") == want] for want in (True, False)]
        parts = [(np.asarray(idx, dtype=np.int64), layout_buffer([specs[i] for i in idx], bucket_numel)) for idx in kinds if idx]
        if len(parts) == 1:
            return layout_buffer(specs, bucket_numel)
        (ia, a), (ib, b) = parts
        shift_p, shift_b, shift_e = a.n_params, a.n_buckets, int(a.bucket_numel.sum())
        return BufferLayout(
            order=np.concatenate([ia[a.order], ib[b.order]]),
            numel=np.concatenate([a.numel, b.numel]),
            offset=np.concatenate([a.offset, b.offset]),
            bucket=np.concatenate([a.bucket, b.bucket + shift_b]),
            bounds=a.bounds + tuple((x + shift_p, y + shift_p) for x, y in b.bounds),
            bucket_start=np.concatenate([a.bucket_start, b.bucket_start + shift_e]),
            bucket_numel=np.concatenate([a.bucket_numel, b.bucket_numel]),
        )
    if not isinstance(bucket_numel, int) or isinstance(bucket_numel, bool) or bucket_numel < 1:
        raise ValueError(f"bucket_numel must be a positive integer, got {bucket_numel!r}")
    n = len(specs)
    if n == 0:
        raise ValueError("cannot plan a model without parameters")
    order = np.arange(n - 1, -1, -1, dtype=np.int64)
    numel = np.fromiter((specs[i].local_numel for i in order), dtype=np.int64, count=n)
    # A bucket closes at the first parameter that brings it to >= bucket_numel, so bucket
    # membership follows from the running total alone: walk it with searchsorted, one bucket per
    # step, instead of one Python iteration per parameter.
    csum = np.cumsum(numel)
    bounds: list[tuple[int, int]] = []
    i0, base = 0, 0
    while i0 < n:
        # first position whose running total (within this bucket) reaches bucket_numel
        i1 = int(np.searchsorted(csum, base + bucket_numel, side="left")) + 1
        i1 = min(i1, n)
        bounds.append((i0, i1))
        base = int(csum[i1 - 1])
        i0 = i1
    bucket = np.empty(n, dtype=np.int64)
    offset = np.empty(n, dtype=np.int64)
    starts = np.empty(len(bounds), dtype=np.int64)
    sizes = np.empty(len(bounds), dtype=np.int64)
    prev = 0
    for b, (a, e) in enumerate(bounds):
        bucket[a:e] = b
        start = int(csum[a - 1]) if a else 0
        offset[a:e] = csum[a:e] - numel[a:e] - start
        starts[b] = start
        sizes[b] = int(csum[e - 1]) - start
        prev = e
    assert prev == n
    return BufferLayout(order, numel, offset, bucket, tuple(bounds), starts, sizes)
