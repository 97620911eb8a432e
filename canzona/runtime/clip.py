"""Gradient clipping by the total norm, over gradients that no single rank holds whole.

``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` computes one norm per gradient,
the norm of those norms (stacked in parameter order) as the total, and multiplies every gradient
by ``min(max_norm / (total + 1e-6), 1)``. Under canzona the reduced gradients are spread over
ranks: on the ZeRO-1 path (the paper's Section 3) each DP owner holds its pieces of the
reduce-scattered buffer (every rank holds every bucket under the all-reduce strategies), TP-split
parameters (Section 4) are TP shards until the step's gather; under FSDP2 each rank holds its
block of every ``p.grad``. This module computes torch's total over them with **one** small
collective and clips in place, before the step:

1. every gradient *piece* (a whole parameter, a DP-cut range of an element-wise parameter, a TP
   shard, an FSDP2 block) has a fixed *slot* in a vector every rank lays out identically; exactly
   one rank (the piece's canonical holder) writes the piece's norm into its slot, every other
   rank writes zero;
2. one status exchange (:func:`canzona.runtime.agree.agree`, a MAX all-reduce of int64 words over
   the world group, bounded in time, raising a failure on one rank on every rank) carries the
   slots as the bit patterns of the norms (unsigned 32-bit words: ``max(bits, 0, ..., 0)`` is the
   bits, whatever the reduction order) and, per parameter, whether some rank received a gradient
   for it (torch skips ``p.grad is None``);
3. every rank combines the slots the same way: a parameter with one slot takes that norm as is,
   a parameter with several takes the ``norm_type`` norm of its pieces' norms (``||x||_p`` equals
   the p-norm of the p-norms of any partition of ``x``, for every ``p != 0``); the total is the
   norm of the stacked per-parameter norms in parameter order, on the gradients' device, as
   torch computes it. Every rank holds the same total bit for bit, so every rank clips alike.

Exactness. Where every parameter's reduced gradient is whole on one rank (``asc``, ``lb-asc``,
``layerwise``, ``sc`` without TP), each slot holds the norm torch computes for that gradient with
the same kernel (``torch._foreach_norm`` / ``linalg.vector_norm``, chosen as torch chooses), and the
total is formed from the same values in the same order by the same call: the result equals
``torch.nn.utils.clip_grad_norm_`` on the single-process reduced gradients bit for bit, and so do
the clipped gradients (one multiplication by the same coefficient). The inf-norm (and -inf) is
exact everywhere, since a maximum of maxima rounds nothing.

Split parameters (2-norm, or any finite p). A parameter cut into ``K`` pieces (``zero1``'s cuts of
an element-wise parameter, ``K`` TP shards, FSDP2 blocks) has its norm formed as
``sqrt(sum_k fl(n_k)^2)`` instead of ``sqrt(sum_i x_i^2)``, so the rounding differs. Bound, with
``u`` the unit roundoff of the gradients' dtype and ``gamma_m = m u / (1 - m u)``
(Higham, Accuracy and Stability of Numerical Algorithms, Lemma 3.1 and Section 4.2: any
summation order of ``m`` non-negative terms has relative error at most ``gamma_{m-1}``; products
of ``(1 + delta_i)^{+-1}`` with ``|delta_i| <= u`` over ``m`` roundings stay within ``1 + theta_m``,
``|theta_m| <= gamma_m``): for a tensor of ``n`` elements, the squares (1 rounding each), their sum
(``n - 1``) and the square root (1, and ``sqrt(1 + theta) = 1 + theta'`` with
``|theta'| <= |theta|``) give ``fl(norm) = norm (1 + theta_{n+1})``. torch's total over ``P``
parameters of at most ``n`` elements then is ``T (1 + theta_{2n+P+3})`` (each per-parameter norm
squared again: ``2(n+1) + 1``; the sum over ``P``: ``P - 1``; the root: 1). canzona's per-parameter
norm of ``K`` pieces is ``N (1 + theta_{2n+K+3})`` (the pieces' norms: ``n + 1``, squared: ``2(n+1)
+ 1``, summed: ``K - 1``, root: 1), and its total ``T (1 + theta_M)`` with ``M = 2(2n+K+3) + 1 + (P
- 1) + 1 = 4n + 2K + P + 7``. Both lie within ``gamma_M`` of the exact ``T``, so
``|canzona - torch| <= 2 gamma_M T <= 2 gamma_M / (1 - gamma_M) * torch`` (:func:`split_bound`,
which the tests check against). With integer-valued gradients every sum of squares below 2**24 is
exact, so in the tests only the combination of pieces rounds. The clip coefficient inherits the
relative difference of the total (one division, same rounding on both sides up to that input).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support

from canzona.runtime.agree import STATUS_TIMEOUT_S, agree
from canzona.runtime.buffer import local_tensor
from canzona.runtime.comm import Comm

__all__ = ["NormSlots", "check_args", "clip_fsdp", "clip_pieces", "clip_zero1", "slots_fsdp", "slots_zero1", "split_bound"]

_WORD = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class NormSlots:
    """The exchanged vector's layout: parameter ``j`` (``names[j]``, torch's parameter order) owns
    slots ``starts[j] .. starts[j+1]``; ``mine`` lists this rank's pieces as (slot, key) pairs, the
    key telling the caller which local gradient tensor fills the slot."""

    names: tuple[str, ...]
    starts: tuple[int, ...]
    mine: tuple[tuple[int, Any], ...]

    def __post_init__(self) -> None:
        if len(self.starts) != len(self.names) + 1 or any(b <= a for a, b in zip(self.starts, self.starts[1:])):
            raise ValueError("every parameter needs at least one norm slot, in increasing order")
        if len({s for s, _ in self.mine}) != len(self.mine) or any(not 0 <= s < self.starts[-1] for s, _ in self.mine):
            raise ValueError("this rank's slots must be distinct and inside the vector")

    @property
    def n_slots(self) -> int:
        return self.starts[-1]


def split_bound(max_numel: int, max_pieces: int, n_params: int, dtype: torch.dtype = torch.float32) -> float:
    """Relative bound on ``|canzona total - torch total| / torch total`` for a finite-p norm when
    parameters are split into at most ``max_pieces`` pieces (the module docstring proves it)."""
    u = torch.finfo(dtype).eps / 2
    m = 4 * max_numel + 2 * max_pieces + n_params + 7
    gamma = m * u / (1 - m * u)
    return 2 * gamma / (1 - gamma)


def _norms(tensors: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """One norm per tensor with the kernel ``torch.nn.utils.get_total_norm`` would pick for it
    (grouped by device and dtype, as torch groups), returned in the order given."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for k, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(k)
    for (device, _), idx in groups.items():
        ts = [tensors[k] for k in idx]
        if (foreach is None and _has_foreach_support(ts, device)) or (foreach and _device_has_foreach_support(device)):
            norms = list(torch._foreach_norm(ts, norm_type))
        elif foreach:
            raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
        else:
            norms = [torch.linalg.vector_norm(t, norm_type) for t in ts]
        for k, n in zip(idx, norms):
            out[k] = n
    return out  # type: ignore[return-value]


def check_args(max_norm: float, norm_type: float) -> None:
    """Refuse arguments torch's function would take but the piece-wise total cannot serve (the
    same on every rank, so raised before any collective)."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or math.isnan(max_norm):
        raise TypeError(f"max_norm must be a number, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or math.isnan(norm_type):
        raise TypeError(f"norm_type must be a number or inf, got {norm_type!r}")
    if norm_type == 0:
        raise ValueError("norm_type 0 (the count of non-zeros) does not combine over pieces; use a p-norm or inf")


def _encode(vals: torch.Tensor) -> torch.Tensor:
    """Float bit patterns as non-negative int64 words (fp32: one word per value, fp64: two)."""
    return vals.contiguous().view(torch.int32).to(torch.int64) & _WORD


def _decode(words: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    signed = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return signed.view(dtype)


def clip_pieces(
    slots: NormSlots,
    local: Sequence[torch.Tensor],
    received: Iterable[str],
    scale: Sequence[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    comm: Comm | None = None,
    timeout_s: float = STATUS_TIMEOUT_S,
) -> torch.Tensor:
    """The total norm (see the module docstring) and the clip, in place on ``scale``.

    ``local[k]`` is the gradient piece of ``slots.mine[k]``; ``received`` the parameters this rank
    got a gradient for; ``scale`` every gradient tensor this rank holds (all multiplied by the
    clip coefficient); ``dtype`` the gradients' dtype (the slots' encoding). Collective: every
    rank of ``comm`` (default: the status group) calls it with the same ``slots`` layout."""
    norm_type = float(norm_type)
    error: BaseException | None = None
    n = len(slots.names)
    flags = torch.zeros(n + slots.n_slots * (torch.finfo(dtype).bits // 32), dtype=torch.int64)
    check_args(max_norm, norm_type)
    try:
        vals = torch.zeros(slots.n_slots, dtype=dtype, device=device)
        # an empty piece adds nothing (and torch's inf-norm kernels refuse empty tensors): its slot stays 0
        filled = [(s, t) for (s, _), t in zip(slots.mine, local) if t.numel()]
        if filled:
            norms = _norms([t for _, t in filled], norm_type, foreach)
            vals[torch.tensor([s for s, _ in filled], device=device)] = torch.stack(norms).to(dtype)
        index = {name: j for j, name in enumerate(slots.names)}
        got = torch.zeros(n, dtype=torch.int64)
        got[[index[name] for name in received]] = 1
        flags = torch.cat([got, _encode(vals.cpu())])  # the norms' one device-to-host copy
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    reduced = agree(error, "clip_grad_norm_", flags=flags, comm=comm, timeout_s=timeout_s)
    assert reduced is not None
    live = reduced[:n] > 0
    vals = _decode(reduced[n:], dtype).to(device)
    per_param = []
    for j in range(n):
        if bool(live[j]):
            lo, hi = slots.starts[j], slots.starts[j + 1]
            per_param.append(vals[lo] if hi - lo == 1 else torch.linalg.vector_norm(vals[lo:hi], norm_type))
    if not per_param:
        return torch.tensor(0.0, device=device)  # torch: no gradient anywhere gives tensor(0.)
    total = torch.linalg.vector_norm(torch.stack(per_param), norm_type)
    if error_if_nonfinite and bool(torch.logical_or(total.isnan(), total.isinf())):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for t in scale:
            if t.numel():
                t.mul_(coef.to(t.device))
    return total


# --------------------------------------------------------------------------------- the ZeRO-1 path
_SLOTS: weakref.WeakKeyDictionary[Any, NormSlots] = weakref.WeakKeyDictionary()


def slots_zero1(rt: Any, tp_rank: int) -> NormSlots:
    """The slot layout of a :class:`~canzona.runtime.dp.DPRuntime` (fixed by its plan; cached).

    A parameter's pieces are its owners' pieces (``pieces_for_rank`` over every DP rank, in flat
    order; DP rank 0's under ``sc``, where every rank holds every piece), each once per TP rank
    when the parameter is TP-split (TP rank 0's copy when it is replicated over TP)."""
    cached = _SLOTS.get(rt)
    if cached is not None:
        return cached
    from canzona.runtime.dp import pieces_for_rank

    plan = rt.plan
    tp = plan.inputs.tp
    every = plan.every_rank_updates
    holders = [0] if every else list(range(rt.dp))
    pieces: dict[str, list[tuple[int, int]]] = {pp.name: [] for pp in plan.params}
    for r in holders:
        for pc in pieces_for_rank(plan, r):
            pieces[pc.name].append((pc.start, r))
    starts = [0]
    mine = []
    names = tuple(pp.name for pp in plan.params)
    for name in names:
        order = sorted(pieces[name])
        copies = tp if rt.specs[name].tp_split else 1
        for k, (start, r) in enumerate(order):
            if r == rt.dp_rank and (copies > 1 or tp_rank == 0):
                mine.append((starts[-1] + k * copies + (tp_rank if copies > 1 else 0), (name, start)))
        starts.append(starts[-1] + len(order) * copies)
    slots = NormSlots(names, tuple(starts), tuple(mine))
    _SLOTS[rt] = slots
    return slots


def clip_zero1(rt: Any, tp_rank: int, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
               foreach: bool | None = None) -> torch.Tensor:
    """``clip_grad_norm_`` on the ZeRO-1 path: finish every bucket's gradient collective (wait,
    average; the next ``step()`` reuses them), then :func:`clip_pieces` over the owned pieces and
    scale every reduced region this rank holds (the TP engine later gathers the clipped shards)."""
    check_args(max_norm, norm_type)
    if not rt.buffer._syncing:  # inside buffer.no_sync()
        raise RuntimeError(
            "clip_grad_norm_ inside no_sync(): the gradients are not reduced yet; call it after the last "
            "micro-batch's backward, outside no_sync(), before step()"
        )
    rt.finish_grad_syncs()
    slots = slots_zero1(rt, tp_rank)
    by_key = {(pc.name, pc.start): g for pc, g in rt.reduced_grads()}
    local = [by_key[key] for _, key in slots.mine]
    return clip_pieces(
        slots, local, rt.buffer.received, rt.reduced_regions(), max_norm, norm_type, error_if_nonfinite, foreach,
        device=rt.buffer.data.device, dtype=rt.master_dtype, comm=rt.status_comm, timeout_s=rt.status_timeout_s,
    )


# --------------------------------------------------------------------------------- FSDP2
def slots_fsdp(rt: Any, replica: int) -> NormSlots:
    """The slot layout of a :class:`~canzona.runtime.shard.FSDPRuntime`: one slot per distinct block
    of each parameter (its layout's sources), filled by the source rank of replica 0."""
    cached = _SLOTS.get(rt)
    if cached is not None:
        return cached
    starts, mine = [0], []
    for name in rt.names:
        sources = rt.layouts[name].sources
        if replica == 0 and sources[rt.rank]:
            mine.append((starts[-1] + sum(sources[: rt.rank]), name))
        starts.append(starts[-1] + sum(sources))
    slots = NormSlots(tuple(rt.names), tuple(starts), tuple(mine))
    _SLOTS[rt] = slots
    return slots


def clip_fsdp(rt: Any, replica: int, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
              foreach: bool | None = None) -> torch.Tensor:
    """``clip_grad_norm_`` under FSDP2: the gradients are ``p.grad`` (DTensor blocks); the same
    one-exchange total as the ZeRO-1 path, and every local block scaled in place."""
    check_args(max_norm, norm_type)
    grads = {name: rt.params[name].grad for name in rt.names}
    received = [name for name, g in grads.items() if g is not None]
    slots = slots_fsdp(rt, replica)
    local = []
    for _, name in slots.mine:
        g = grads[name]
        local.append(local_tensor(g) if g is not None else torch.zeros(rt.layouts[name].blocks[rt.rank].shape,
                                                                        dtype=rt.master_dtype, device=rt._device))
    scale = [local_tensor(g) for g in grads.values() if g is not None]
    dtypes = {t.dtype for t in scale} | {rt.master_dtype}
    if len(dtypes) != 1:
        raise TypeError(f"clip_grad_norm_ needs every gradient in one dtype, got {sorted(map(str, dtypes))}")
    return clip_pieces(
        slots, local, received, scale, max_norm, norm_type, error_if_nonfinite, foreach,
        device=rt._device, dtype=rt.master_dtype, comm=rt.status_comm, timeout_s=rt.status_timeout_s,
    )
