"""DP partitioners: who updates which part of each ZeRO-1 bucket (Section 3).

Every function takes the buffer layout (:mod:`canzona.plan.buckets`) and per-parameter loads in
buffer order and returns a :class:`DPAssignment`: per-bucket cut points (``dp + 1`` monotone
element offsets relative to the bucket start, or none for all-reduce strategies) and, per buffer
position, the owning DP rank (``-1`` when the parameter is cut across ranks or, for ``sc``, owned by
everyone). All of them are deterministic; ties go to the lower rank, the earlier boundary or the
smaller parameter name.

* ``zero1``      Megatron's equal chunks |B|/R per bucket (the AdamW reference; cuts split tensors).
* ``asc``        Static partitioning, Section 3.1 Eq. 1: a parameter belongs to the rank whose
                 geometric slice [r S, (r+1) S), S = |B|/R, holds its first element (0-based r).
* ``lb-asc``     Algorithm 1, alpha-balanced greedy LPT over buckets with atomic snapping.
* ``layerwise``  NV-layerwise baseline: LPT of whole parameters to ranks, blind to buffer position.
* ``sc``         synchronous compute: every rank updates everything.
* ``lb-asc-joint`` canzona's planner beyond the paper: FLOPs and memory balanced together, matrix
                 parameters atomic, element-wise parameters divisible (see :func:`lb_asc_joint`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from canzona.plan.buckets import BufferLayout

__all__ = [
    "DPAssignment",
    "zero1",
    "asc",
    "lb_asc",
    "layerwise",
    "sc",
    "lb_asc_joint",
    "owners_from_cuts",
    "cut_ranges",
]


@dataclass(frozen=True, slots=True, eq=False)
class DPAssignment:
    """Result of a DP partitioner (see the module docstring for the conventions)."""

    cuts: tuple[tuple[int, ...], ...]
    owner: np.ndarray


def owners_from_cuts(layout: BufferLayout, cuts: Sequence[Sequence[int]]) -> np.ndarray:
    """Owner of each buffer position under ``cuts``: the rank whose interval holds the whole
    parameter, or -1 when the cuts split it. Empty intervals never own anything: the owner is the
    last rank whose cut is at or before the parameter's first element."""
    owner = np.full(layout.n_params, -1, dtype=np.int64)
    for b, (i0, i1) in enumerate(layout.bounds):
        c = np.asarray(cuts[b], dtype=np.int64)
        off = layout.offset[i0:i1]
        end = off + layout.numel[i0:i1]
        r = np.searchsorted(c, off, side="right") - 1
        whole = end <= c[r + 1]
        owner[i0:i1] = np.where(whole, r, -1)
    return owner


def cut_ranges(cuts: Sequence[int], offset: int, numel: int) -> tuple[tuple[int, int, int], ...]:
    """``(rank, start, end)`` element ranges of a parameter at ``offset`` split by ``cuts``
    (relative to the parameter's first element, tiling ``[0, numel)``, empty ranges skipped)."""
    c = np.asarray(cuts, dtype=np.int64)
    end = offset + numel
    r = int(np.searchsorted(c, offset, side="right")) - 1
    out: list[tuple[int, int, int]] = []
    pos = offset
    while pos < end:
        hi = min(int(c[r + 1]), end)
        if hi > pos:
            out.append((r, pos - offset, hi - offset))
            pos = hi
        r += 1
    return tuple(out)


def zero1(layout: BufferLayout, dp: int) -> DPAssignment:
    """Megatron ZeRO-1: bucket ``B`` is cut into ``dp`` chunks of ``|B| // dp`` elements, the first
    ``|B| % dp`` ranks taking one more, blind to tensor boundaries (Appendix B.1)."""
    cuts = []
    r = np.arange(dp + 1, dtype=np.int64)
    for size in layout.bucket_numel.tolist():
        q, rem = divmod(size, dp)
        cuts.append(tuple((r * q + np.minimum(r, rem)).tolist()))
    return DPAssignment(tuple(cuts), owners_from_cuts(layout, cuts))


def asc(layout: BufferLayout, dp: int) -> DPAssignment:
    """Static partitioning without balancing (Section 3.1, Eq. 1, with 0-based ranks): parameter
    ``p`` goes to rank ``r`` with ``r S <= Start_Index(p) < (r + 1) S``, ``S = |B| / R``.

    Integer form: ``r = floor(offset * R / |B|)``; the cut of rank ``r`` is the offset of the first
    parameter whose rank is ``>= r`` (``|B|`` if none), so ranks whose slice holds no parameter
    start are empty.
    """
    cuts = []
    ranks = np.arange(dp + 1, dtype=np.int64)
    for b, (i0, i1) in enumerate(layout.bounds):
        size = int(layout.bucket_numel[b])
        off = layout.offset[i0:i1]
        edges = np.append(off, size)
        # first parameter with offset * R >= r * |B|
        idx = np.searchsorted(off * dp, ranks * size, side="left")
        c = edges[idx]
        c[0], c[-1] = 0, size
        cuts.append(tuple(c.tolist()))
    return DPAssignment(tuple(cuts), owners_from_cuts(layout, cuts))


def _snap(phi: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Parameter boundary u minimising |phi[u] - C| for each cumulative target C, ties to the
    earlier boundary (Algorithm 1, atomic discretisation). ``phi`` is non-decreasing, phi[0] = 0."""
    n = len(phi) - 1
    hi = np.searchsorted(phi, targets, side="left")  # first u with phi[u] >= C
    hi = np.clip(hi, 0, n)
    lo = np.maximum(hi - 1, 0)
    take_lo = (targets - phi[lo]) <= (phi[hi] - targets)
    u = np.where(take_lo, lo, hi)
    # among boundaries with the same cumulative load (zero-cost parameters) take the earliest
    return np.searchsorted(phi, phi[u], side="left")


def _preload(preload: np.ndarray | Sequence[float] | None, dp: int) -> np.ndarray:
    """Each rank's load before planning (zeros without one); checked: ``dp`` finite values >= 0."""
    if preload is None:
        return np.zeros(dp)
    out = np.asarray(preload, dtype=np.float64)
    if out.shape != (dp,) or not np.all(np.isfinite(out)) or np.any(out < 0):
        raise ValueError(f"preload must be {dp} finite loads >= 0, one per DP rank")
    return out.copy()


def lb_asc(layout: BufferLayout, dp: int, load: np.ndarray, alpha: float = 1.0, preload: np.ndarray | None = None) -> DPAssignment:
    """Algorithm 1 (alpha-balanced greedy LPT), as published.

    Buckets are visited in descending load W^k (ties: lower index). With accumulated rank loads
    L and mu = sum(W) / R, the deficit is d_r = max(0, mu - L_r); the bucket's target share is
    W^k * ((1 - alpha) / R + alpha * d_r / sum(d)), or W^k / R when sum(d) = 0. Each cumulative
    target C_r (r = 0 .. R-2) snaps to the parameter boundary u minimising |Phi_k(u) - C_r| (ties to
    the earlier boundary); the last rank takes the remainder. Parameters stay atomic.

    ``preload``: work each rank has before any bucket (expert parallelism: the experts it holds,
    :mod:`canzona.plan.ep`), in the same cost unit; L starts from it and mu counts it, so the
    buckets fill the ranks around it. None (or all equal): the published algorithm.

    Cost: O(N log N) for the bucket sort plus O(R + n_k log n_k) per bucket (vectorised).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    load = np.asarray(load, dtype=np.float64)
    nb = layout.n_buckets
    w_bucket = np.array([load[i0:i1].sum() for i0, i1 in layout.bounds])
    acc = _preload(preload, dp)
    mu = (float(w_bucket.sum()) + float(acc.sum())) / dp
    even = np.full(dp, 1.0 / dp)
    cuts: list[tuple[int, ...]] = [()] * nb
    for k in np.argsort(-w_bucket, kind="stable").tolist():
        i0, i1 = layout.bounds[k]
        phi = np.concatenate(([0.0], np.cumsum(load[i0:i1])))
        edges = np.append(layout.offset[i0:i1], int(layout.bucket_numel[k]))
        deficit = np.maximum(0.0, mu - acc)
        total = float(deficit.sum())
        v = even if total <= 0.0 else (1.0 - alpha) * even + alpha * (deficit / total)
        targets = np.cumsum(w_bucket[k] * v)[:-1]
        u = np.concatenate(([0], _snap(phi, targets), [i1 - i0]))
        acc += phi[u[1:]] - phi[u[:-1]]
        cuts[k] = tuple(edges[u].tolist())
    return DPAssignment(tuple(cuts), owners_from_cuts(layout, cuts))


def layerwise(layout: BufferLayout, dp: int, load: np.ndarray, names: Sequence[str], preload: np.ndarray | None = None) -> DPAssignment:
    """NV-layerwise baseline: whole parameters to ranks by LPT on ``load`` (descending load, ties
    by name), each to the least-loaded rank (ties: lower rank), ignoring buffer position. Buckets
    are all-reduced, so there are no cuts and ownership interleaves inside buckets. ``preload``:
    each rank's load before the first parameter (see :func:`lb_asc`)."""
    load = np.asarray(load, dtype=np.float64)
    order = sorted(range(layout.n_params), key=lambda i: (-load[i], names[i]))
    heap = [(float(v), r) for r, v in enumerate(_preload(preload, dp))]
    heapq.heapify(heap)
    owner = np.empty(layout.n_params, dtype=np.int64)
    for i in order:
        l, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (l + float(load[i]), r))
    return DPAssignment(tuple(() for _ in layout.bounds), owner)


def sc(layout: BufferLayout, dp: int) -> DPAssignment:
    """Synchronous compute: gradients all-reduced, every rank updates every parameter."""
    return DPAssignment(tuple(() for _ in layout.bounds), np.full(layout.n_params, -1, dtype=np.int64))


#: ranks a first-fit pass tries one by one before it searches the rest with numpy: one numpy
#: search costs about as much as ~50 interpreted steps (measured: 8 made DP 32 plans 50% slower)
_SHORT_WALK = 64


def _first_fit(lf: np.ndarray, lm: np.ndarray, start: int, fi: float, mi: float, cap: float) -> int:
    """The first rank ``>= start`` whose loads stay ``<= cap`` after adding ``(fi, mi)``, or
    ``len(lf)`` when none does: the same test as the pass's Python walk, ``not (l + x > cap)``,
    on the same float64 values (the loads are finite, so ``<=`` is its exact negation)."""
    if start >= len(lf):
        return len(lf)
    fits = (lf[start:] + fi <= cap) & (lm[start:] + mi <= cap)
    j = int(fits.argmax())
    return start + j if fits[j] else len(lf)


def _joint_pass(
    layout: BufferLayout,
    dp: int,
    order: Sequence[int],
    f: Sequence[float],
    m: Sequence[float],
    numel: Sequence[int],
    divisible: Sequence[bool],
    spread: Sequence[bool],
    ecap: float,
    cap: float,
) -> tuple[float, list[tuple[int, ...]]] | None:
    """One first-fit pass at level ``cap`` (normalised units, mean = 1 in both dimensions).

    Buckets in ``order``; inside a bucket a rank pointer only moves forward (monotone cuts). A
    matrix parameter goes to the first rank at or after the pointer where both its FLOPs and its
    memory stay <= cap; an element-wise parameter fills the current rank up to cap and spills the
    rest forward (cut at element granularity). Returns (the highest rank level reached, cuts), or
    None when something does not fit.

    Per-parameter inputs are plain lists (indexing a numpy array per element costs more than the
    arithmetic); bisection runs this pass ~20 times over every parameter, ~70k of them for a
    1T-parameter MoE. The current rank's loads live in locals while the pointer stays on it: the
    float operations and their order are exactly those of a direct ``lf[r] += fi``.
    """
    lf = [0.0] * dp
    lm = [0.0] * dp
    # numpy mirrors of lf / lm for long searches, brought up to date only when one runs: ranks
    # whose loads changed since the last search are listed in ``stale``
    lf_np = np.zeros(dp)
    lm_np = np.zeros(dp)
    stale: list[int] = []
    le = [0.0] * dp  # memory each rank took from spread (large element-wise) parameters
    cuts: list[tuple[int, ...]] = [()] * layout.n_buckets
    bounds = layout.bounds
    sizes = layout.bucket_numel.tolist()
    inf = float("inf")
    for k in order:
        i0, i1 = bounds[k]
        size = sizes[k]
        c = [0] * (dp + 1)
        r = 0  # r < dp at the start of every parameter: reaching dp returns None
        pos = 0  # element offset inside the bucket where rank r's interval currently ends
        cf, cm = lf[0], lm[0]  # rank r's loads
        for fi, mi, n, div, wide in zip(f[i0:i1], m[i0:i1], numel[i0:i1], divisible[i0:i1], spread[i0:i1]):
            if not div:
                if cf + fi > cap or cm + mi > cap:
                    # walk to the first later rank where both loads stay <= cap. Every bucket
                    # restarts at rank 0, so at DP 1024 walking over already full ranks is the
                    # pass's main cost: past _SHORT_WALK steps numpy finishes the walk (the same
                    # float64 sums and comparisons, so the same rank)
                    lf[r], lm[r] = cf, cm
                    stale.append(r)
                    far = r + _SHORT_WALK
                    r += 1
                    c[r] = pos
                    while r < dp and (lf[r] + fi > cap or lm[r] + mi > cap):
                        if r == far:
                            if stale:
                                lf_np[stale] = [lf[x] for x in stale]
                                lm_np[stale] = [lm[x] for x in stale]
                                stale.clear()
                            q = _first_fit(lf_np, lm_np, r + 1, fi, mi, cap)
                            c[r + 1 : q + 1] = [pos] * (q - r)
                            r = q
                            break
                        r += 1
                        c[r] = pos
                    if r == dp:
                        return None
                    cf, cm = lf[r], lm[r]
                cf += fi
                cm += mi
                pos += n
                continue
            lf[r], lm[r] = cf, cm
            r0 = r
            fe, me = fi / n, mi / n
            left = n
            while left:
                if r == dp:
                    return None
                room_f = (cap - lf[r]) / fe if fe > 0 else inf
                room_m = (cap - lm[r]) / me if me > 0 else inf
                room = min(room_f, room_m)
                if wide and r < dp - 1 and me > 0:
                    # a large element-wise tensor (embedding, output head) is spread so that no
                    # rank holds more than its fair share of such state: pouring it to the brim
                    # would leave those ranks no memory for matrices and starve them of FLOPs
                    room = min(room, (ecap - le[r]) / me)
                take = min(left, int(max(0.0, room)))
                if r == dp - 1 and take < left:
                    return None
                lf[r] += take * fe
                lm[r] += take * me
                if wide:
                    le[r] += take * me
                pos += take
                left -= take
                if left:
                    r += 1
                    c[r] = pos
            stale.extend(range(r0, r))  # the ranks it spilled over (rank r stays current)
            cf, cm = lf[r], lm[r]
        lf[r], lm[r] = cf, cm
        stale.append(r)
        c[r + 1 :] = [size] * (dp - r)
        cuts[k] = tuple(c)
    return max(max(lf), max(lm)), cuts


def _bisect(
    layout: BufferLayout,
    dp: int,
    order: Sequence[int],
    fl: Sequence[float],
    ml: Sequence[float],
    numel: Sequence[int],
    divisible: Sequence[bool],
    spread: Sequence[bool],
    ecap: float,
    lo: float,
    tolerance: float,
) -> tuple[float, list[tuple[int, ...]]]:
    """Bisection on the cap: the best (lowest reached level, cuts) over the feasible passes."""
    hi = lo
    while True:
        res = _joint_pass(layout, dp, order, fl, ml, numel, divisible, spread, ecap, hi)
        if res is not None:
            break
        lo, hi = hi, hi * 1.25
    best = res
    while hi - lo > tolerance * lo:
        mid = 0.5 * (lo + hi)
        res = _joint_pass(layout, dp, order, fl, ml, numel, divisible, spread, ecap, mid)
        if res is None:
            lo = mid
        else:
            hi = mid
            if res[0] < best[0]:
                best = res
    return best


def lb_asc_joint(
    layout: BufferLayout,
    dp: int,
    flops: np.ndarray,
    memory: np.ndarray,
    divisible: np.ndarray,
    *,
    tolerance: float = 1e-3,
) -> DPAssignment:
    """canzona's joint FLOPs + memory partitioner (beyond the paper).

    Same geometric constraints as Algorithm 1 (one monotone cut vector per bucket, matrix
    parameters atomic) plus the divisibility of element-wise parameters, which ZeRO-1 already
    relies on: an embedding or output head may be cut across ranks like AdamW state is.

    Objective: minimise the level ``T`` such that every rank's FLOPs and memory, each divided by
    its mean, stay <= T, i.e. ``max(R_LB^flops, R_LB^memory)``. For a given cap a first-fit pass
    (buckets in descending combined load, LPT as in Algorithm 1; ranks filled in order inside a
    bucket, so cuts stay monotone; element-wise parameters poured up to the cap) decides
    feasibility; bisection on the cap finds the smallest feasible level. Feasibility is not
    strictly monotone in the cap for first fit, so the best pass seen is kept. Large element-wise
    tensors are poured two ways, capped near their fair share per rank (so the ranks holding an
    embedding keep memory for matrices and get their share of FLOPs) or freely; the lower
    level wins.

    Cost: O(log(1/tolerance) * (P + N * R)) for P parameters, N buckets, R ranks.
    """
    f = np.asarray(flops, dtype=np.float64)
    m = np.asarray(memory, dtype=np.float64)
    divisible = np.asarray(divisible, dtype=bool)
    if dp == 1:
        cuts = [(0, int(s)) for s in layout.bucket_numel.tolist()]
        return DPAssignment(tuple(cuts), owners_from_cuts(layout, cuts))
    # normalise so that the mean rank load is 1 in both dimensions
    fs, ms = float(f.sum()), float(m.sum())
    fn = f * (dp / fs) if fs > 0 else np.zeros_like(f)
    mn = m * (dp / ms) if ms > 0 else np.zeros_like(m)
    combined = np.array([fn[i0:i1].sum() + mn[i0:i1].sum() for i0, i1 in layout.bounds])
    order = np.argsort(-combined, kind="stable").tolist()
    atomic = ~divisible
    lo = max(1.0, float(np.max(np.maximum(fn, mn)[atomic], initial=0.0)))
    fl, ml = fn.tolist(), mn.tolist()
    # element-wise tensors worth spreading: more than 1% of a rank's mean memory
    spread = divisible & (mn > 0.01)
    fair = float(mn[spread].sum()) / dp
    numel, div, wide = layout.numel.tolist(), divisible.tolist(), spread.tolist()
    best: list[tuple[int, ...]] | None = None
    best_level = float("inf")
    # two passes: large element-wise tensors spread over ranks at ~ their fair share (what a
    # model with a big vocabulary needs), or poured freely (better when they share a bucket with
    # the matrices that must follow them); the lower level wins
    for ecap in ((fair * 1.02, float("inf")) if spread.any() else (float("inf"),)):
        if best_level <= lo * (1.0 + tolerance):
            break  # already at the lower bound: nothing left to win
        level, cuts = _bisect(layout, dp, order, fl, ml, numel, div, wide, ecap, lo, tolerance)
        if level < best_level:
            best_level, best = level, cuts
    assert best is not None
    return DPAssignment(tuple(best), owners_from_cuts(layout, best))
