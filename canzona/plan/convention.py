"""Planning conventions: the paper authors' (a named preset) beside canzona's own.

The paper's Figure 3 numbers come from the authors' Megatron implementation, whose planning
conventions differ from canzona's on every point below. :data:`PAPER` names them as one preset;
:func:`authors_plan` re-implements that planning logic (pure, offline) so that the paper's
numbers can be recomputed and read next to canzona's.

The ``paper`` convention:

* **matrix-only buffer** -- only matrix-optimizer parameters (2-D, name without
  ``word_embeddings`` / ``output_layer`` / ``router`` / ``gate_weight``) enter the Canzona buffer;
  embeddings, the output layer and norms stay in the ordinary element-wise optimizer's buffer
  (``buffers="matrix-only"``; ``"joint"`` is canzona's single buffer).
* **Megatron-Core registration order** -- the attention module registers ``linear_proj`` before
  ``linear_qkv``; the buffer holds parameters in reverse registration order.
* **400M-element buckets** -- the authors' run script sets the bucket size to 400,000,000
  elements; a bucket closes at the first parameter that brings it to at least that size.
* **Algorithm 1 in elements, kept only if better** -- loads are TP-local element counts; the
  configured cost model only decides whether the balanced plan replaces the baseline (it does
  when its largest rank load is strictly smaller). Cumulative targets snap to the nearest
  parameter end at or after the previous cut (ties to the earlier end); the last rank takes the rest.
* **Baseline** (``asc``, "before") -- a parameter belongs to the rank whose equal slice of the
  bucket holds its first element.
* **Algorithm 2, "global" mode** -- each DP rank schedules its TP-split parameters sorted by
  (cost, buffer index) descending; a group grows while an LPT re-solve from zero keeps every host
  at or below C_max, which is in *cost units* (400 x 2^20 TP-local elements with the numel cost),
  not bytes. The "no" mode (the TP baseline) takes chunks of ``tp`` parameters in buffer order,
  host = position in the chunk.
* **Ratios** -- max / mean on TP-local shapes: memory = numel, FLOPs = the optimizer's FLOPs on
  the shard shape (Muon: 20 max * min^2). DP ratios over the DP ranks; TP ratios over the ``tp``
  hosts of one micro-group of DP rank 0 (the authors log from global rank 0 only).

canzona's own convention (:data:`CANZONA`) plans every parameter in one buffer, costs a TP task on
the full shape its host really processes and reports TP ratios over every GPU of the mesh next to
the atomic lower bound (largest task / mean), see :func:`lower_bound`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from canzona.cost import matrix_flops
from canzona.plan.plan import PlanError
from canzona.specs import ParamSpec, split_task_name

__all__ = [
    "Convention",
    "PAPER",
    "CANZONA",
    "CONVENTIONS",
    "AUTHORS_MATRIX_EXCLUDE",
    "authors_matrix_param",
    "megatron_core_order",
    "AuthorsPlan",
    "authors_plan",
    "lower_bound",
    "worst_tp_group_bound",
    "convention_plan",
]

#: name fragments that keep a 2-D weight out of the authors' matrix buffer
AUTHORS_MATRIX_EXCLUDE: tuple[str, ...] = ("word_embeddings", "output_layer", "router", "gate_weight")


@dataclass(frozen=True, slots=True)
class Convention:
    """A named set of planning and measuring conventions (one preset, not scattered flags)."""

    name: str
    #: "matrix-only" (the authors' separate matrix-optimizer buffer) or "joint" (one buffer)
    buffers: str
    #: "megatron-core" (linear_proj registered before linear_qkv) or "canzona" (qkv first)
    registration: str
    #: bucket size in TP-local elements; None: canzona's default max(40M, 1M * dp)
    bucket_numel: int | None
    #: Algorithm 1 loads: "elements" (kept only if better by the cost model) or "cost"
    dp_loads: str
    #: C_max and its unit: "cost" (2^20 TP-local elements per host with the numel cost: both conventions)
    cmax: int
    cmax_unit: str
    #: shapes the FLOPs ratios are taken on: "local" (the shard) or "full" (what the host runs)
    flops_shape: str
    #: TP ratio reported: "dp-rank-0-group" (one micro-group of DP rank 0) or "all-gpus"
    tp_ratio_scope: str
    description: str = ""


PAPER = Convention(
    name="paper", buffers="matrix-only", registration="megatron-core", bucket_numel=400_000_000,
    dp_loads="elements", cmax=400 * 2**20, cmax_unit="cost", flops_shape="local", tp_ratio_scope="dp-rank-0-group",
    description="the paper authors' Megatron code: matrix-only buffer, Megatron-Core order, 400M-element buckets, "
                "Algorithm 1 on element loads kept only if better, C_max = 400 x 2^20 cost units, TP-local shapes, "
                "TP ratios of DP rank 0's group",
)
CANZONA = Convention(
    name="canzona", buffers="joint", registration="canzona", bucket_numel=None, dp_loads="cost",
    cmax=512 * 2**20, cmax_unit="cost", flops_shape="full", tp_ratio_scope="all-gpus",
    description="canzona's defaults: one buffer for every parameter, Megatron-Core's default bucket size, "
                "C_max = 512 x 2^20 TP-local elements per host (the paper's unit) with host loads carried across "
                "micro-groups, full (host) shapes, TP ratios over every GPU next to the bound",
)
CONVENTIONS: dict[str, Convention] = {c.name: c for c in (PAPER, CANZONA)}


def authors_matrix_param(spec: ParamSpec) -> bool:
    """True when the authors' code puts ``spec`` in the matrix-optimizer buffer."""
    return len(spec.shape) == 2 and not any(x in spec.name for x in AUTHORS_MATRIX_EXCLUDE)


def megatron_core_order(specs: Sequence[ParamSpec]) -> list[ParamSpec]:
    """``specs`` in Megatron-Core's registration order: within each attention block the output
    projection (``linear_proj``) comes before ``linear_qkv`` (the attention base class builds the
    projection, the self-attention subclass then builds qkv). Other parameters keep their order."""
    out = list(specs)
    for i in range(len(out) - 1):
        a, b = out[i].name, out[i + 1].name
        if a.endswith("linear_qkv.weight") and b.endswith("linear_proj.weight") and a.rsplit(".", 2)[0] == b.rsplit(".", 2)[0]:
            out[i], out[i + 1] = out[i + 1], out[i]
    # q/k layernorms sit between qkv and proj in canzona's listing: move proj ahead of qkv there too
    by_block: dict[str, list[int]] = {}
    for i, s in enumerate(out):
        if s.name.endswith(("linear_qkv.weight", "linear_proj.weight")):
            by_block.setdefault(s.name.rsplit(".", 2)[0], []).append(i)
    for idx in by_block.values():
        if len(idx) == 2 and out[idx[0]].name.endswith("linear_qkv.weight"):
            qkv, proj = out[idx[0]], out[idx[1]]
            del out[idx[1]]
            out.insert(idx[0], proj)
            assert out[idx[0] + 1] is qkv
    return out


def _flops(optimizer: str, shape: tuple[int, ...]) -> float:
    # canzona.cost counts multiply-adds; the authors count 2 FLOPs each (Muon: 20 * max * min^2)
    return 2.0 * float(matrix_flops(optimizer, shape))


def _lpt(costs: Sequence[float], tp: int) -> list[int]:
    """LPT from zero loads onto ``tp`` heap slots, ties to the lower rank (items in given order
    for equal costs)."""
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    heap = [(0.0, r) for r in range(tp)]
    hosts = [0] * len(costs)
    for i in order:
        load, r = heapq.heappop(heap)
        hosts[i] = r
        heapq.heappush(heap, (load + costs[i], r))
    return hosts


@dataclass(frozen=True, slots=True, eq=False)
class AuthorsPlan:
    """The authors' plan of one (pipeline stage of a) model: buffer, buckets, owners, groups.

    ``params`` are in buffer order; ``bounds[b] = (i0, i1)`` the buffer positions of bucket ``b``;
    ``owner[i]`` the DP rank of position ``i``; ``groups[r]`` DP rank r's micro-groups as lists of
    (buffer position, host) pairs. ``kept_balanced`` says whether Algorithm 1's plan replaced the
    baseline (only when strictly better by the cost model).
    """

    params: tuple[ParamSpec, ...]
    dp: int
    tp: int
    optimizer: str
    bounds: tuple[tuple[int, int], ...]
    owner: tuple[int, ...]
    groups: tuple[tuple[tuple[tuple[int, int], ...], ...], ...]
    kept_balanced: bool
    dp_mode: str
    tp_mode: str
    flops_local: np.ndarray = field(repr=False)
    numel_local: np.ndarray = field(repr=False)

    # ---------------------------------------------------------------- DP
    def dp_loads(self, metric: str) -> np.ndarray:
        """Per-DP-rank sum of ``flops`` or ``memory`` (= numel) on TP-local shapes."""
        vals = self.flops_local if metric == "flops" else self.numel_local
        return np.bincount(np.asarray(self.owner), weights=vals, minlength=self.dp).astype(np.float64)

    def dp_ratio(self, metric: str) -> float:
        return _ratio(self.dp_loads(metric))

    # ---------------------------------------------------------------- TP
    def group_loads(self, rank: int, group: int, metric: str, shape: str = "local") -> np.ndarray:
        """Per-host load of one micro-group of DP rank ``rank``."""
        out = np.zeros(self.tp)
        for i, h in self.groups[rank][group]:
            out[h] += self._task(i, metric, shape)
        return out

    def host_loads(self, rank: int, metric: str, shape: str = "local") -> np.ndarray:
        """Per-host load of DP rank ``rank``'s TP group summed over its micro-groups."""
        out = np.zeros(self.tp)
        for g in self.groups[rank]:
            for i, h in g:
                out[h] += self._task(i, metric, shape)
        return out

    def _task(self, i: int, metric: str, shape: str) -> float:
        s = self.params[i]
        if shape == "local":
            return float(self.flops_local[i] if metric == "flops" else self.numel_local[i])
        return _flops(self.optimizer, s.shape) if metric == "flops" else float(s.numel)

    def tp_ratio_rank0(self, metric: str, group: int = 0) -> float:
        """The authors' reading: max / mean over the hosts of DP rank 0's micro-group ``group``."""
        if not self.groups[0]:
            return 1.0
        return _ratio(self.group_loads(0, group, metric))

    def tp_ratios_per_rank(self, metric: str, shape: str = "local") -> np.ndarray:
        """Each DP rank's TP-group ratio (cumulative over its groups); NaN for a DP rank that owns
        no TP-split parameter (its TP group has nothing to balance)."""
        return np.array([_ratio(self.host_loads(r, metric, shape)) if self.groups[r] else np.nan for r in range(self.dp)])

    def tp_bounds_per_rank(self, metric: str, shape: str = "local") -> np.ndarray:
        """Each DP rank's lower bound on its TP-group ratio: max(1, largest task / mean host load)."""
        out = []
        for r in range(self.dp):
            tasks = [self._task(i, metric, shape) for g in self.groups[r] for i, _ in g]
            out.append(max(1.0, max(tasks) / (sum(tasks) / self.tp)) if tasks and sum(tasks) > 0 else np.nan)
        return np.array(out)

    def gpu_loads(self, metric: str, shape: str = "full") -> np.ndarray:
        """Load of every GPU (dp x tp) from the matrix tasks it runs: a hosted TP-split task at its
        ``shape`` cost, a replicated matrix on every TP rank of its owner."""
        out = np.zeros((self.dp, self.tp))
        hosted = set()
        for r in range(self.dp):
            for g in self.groups[r]:
                for i, h in g:
                    out[r, h] += self._task(i, metric, shape)
                    hosted.add(i)
        for i, s in enumerate(self.params):
            if i not in hosted:
                out[self.owner[i], :] += self._task(i, metric, "local")
        return out.ravel()

    def all_gpu_ratio(self, metric: str, shape: str = "full") -> float:
        return _ratio(self.gpu_loads(metric, shape))

    def summary(self) -> dict[str, Any]:
        per = self.tp_ratios_per_rank("flops")
        return {
            "dp_flops_ratio": self.dp_ratio("flops"),
            "dp_memory_ratio": self.dp_ratio("memory"),
            "tp_flops_ratio_dp_rank0": self.tp_ratio_rank0("flops"),
            "tp_memory_ratio_dp_rank0": self.tp_ratio_rank0("memory"),
            "tp_flops_ratio_per_rank_max": float(np.nanmax(per)) if np.isfinite(per).any() else 1.0,
            "tp_flops_ratio_per_rank_median": float(np.nanmedian(per)) if np.isfinite(per).any() else 1.0,
            "tp_flops_ratio_all_gpus_full": self.all_gpu_ratio("flops", "full"),
            "tp_flops_lower_bound_full": lower_bound(self.params, self.dp, self.tp, self.optimizer),
            "n_buckets": len(self.bounds),
            "bucket_params": [e - s for s, e in self.bounds],
            "micro_groups_dp_rank0": len(self.groups[0]),
            "kept_balanced": self.kept_balanced,
        }


def _ratio(a: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    m = float(a.mean()) if a.size else 0.0
    return float(a.max()) / m if m > 0 else 1.0


def lower_bound(specs: Sequence[ParamSpec], dp: int, tp: int, optimizer: str = "muon") -> float:
    """The atomic lower bound on the max / mean optimizer FLOPs over all ``dp * tp`` GPUs when
    matrices are atomic: the largest single task (full shape; one expert of a stack) over the mean
    GPU load. Replicated matrices and expert stacks (never TP-split) cost their full shape on every
    TP rank; only matrix-optimizer parameters count."""
    mats = [s for s in specs if s.kind in ("matrix", "experts")]
    if not mats:
        return 1.0
    task = [_flops(optimizer, s.task_shape if s.kind == "experts" else s.shape) for s in mats]
    # a replicated matrix (not TP-split) is computed by every TP rank of its owner: tp copies;
    # an expert stack is n_tasks such matrices
    total = sum(t * s.n_tasks * (1 if s.tp_split else s.tp) for t, s in zip(task, mats))
    # max / mean is at least 1 whatever the tasks
    return max(1.0, max(task) / (total / (dp * tp)))


def worst_tp_group_bound(plan: Any) -> float:
    """The floor under the plan's "TP FLOPs ratio" (max / mean over the hosts of the worst DP
    rank's TP group) whatever the TP schedule: that DP rank's largest micro-group task (full shape,
    one host computes it) over the mean of its hosts' loads, at least 1. A DP rank that owns one
    large matrix and little else sits at about ``tp``. Read on a plan with ``flops_shape="full"``."""
    d = plan.metrics.details
    rank, hosts = d.get("tp_worst_dp_rank_flops"), np.asarray(d.get("tp_host_flops_loads", ()), dtype=np.float64)
    names = [n for g in plan.micro_groups[rank] for n in g.params] if rank is not None and rank < len(plan.micro_groups) else []
    if not names or not hosts.size or hosts.mean() <= 0:
        return 1.0
    by = {s.name: s for s in plan.specs}
    # an expert task (name[e]) of a TP-split stack is one (M, N) matrix of its stack
    largest = max(float(matrix_flops(plan.inputs.optimizer, by[split_task_name(n)[0]].task_shape)) for n in names)
    return max(1.0, largest / float(hosts.mean()))


def _buckets(numel: np.ndarray, bucket_numel: int) -> list[tuple[int, int]]:
    bounds: list[tuple[int, int]] = []
    start, acc = 0, 0
    for i, n in enumerate(numel.tolist()):
        acc += n
        if acc >= bucket_numel:
            bounds.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(numel):
        bounds.append((start, len(numel)))
    return bounds


def _baseline(numel: np.ndarray, bounds: Sequence[tuple[int, int]], dp: int) -> list[int]:
    """Static partition: a parameter belongs to the rank whose equal slice holds its first element."""
    owner = [0] * len(numel)
    for i0, i1 in bounds:
        size = int(numel[i0:i1].sum())
        off = 0
        for i in range(i0, i1):
            owner[i] = min(off * dp // size, dp - 1)
            off += int(numel[i])
    return owner


def _balanced(numel: np.ndarray, bounds: Sequence[tuple[int, int]], dp: int, alpha: float) -> list[int]:
    """Algorithm 1 as the authors code it: element loads, buckets by size descending (stable),
    deficit shares, each cumulative target snapped to the nearest parameter end at or after the
    previous cut (ties to the earlier end), the last rank takes the rest."""
    owner = [0] * len(numel)
    load = np.zeros(dp)
    mean = float(numel.sum()) / dp
    sizes = [int(numel[a:b].sum()) for a, b in bounds]
    even = np.full(dp, 1.0 / dp)
    for k in sorted(range(len(bounds)), key=lambda k: -sizes[k]):
        i0, i1 = bounds[k]
        ends = np.concatenate(([0], np.cumsum(numel[i0:i1])))  # ends[u]: end of the first u params
        deficit = np.maximum(0.0, mean - load)
        tot = float(deficit.sum())
        share = (1 - alpha) * even + alpha * (deficit / tot if tot > 1e-9 else even)
        targets = np.cumsum(sizes[k] * share)
        cut = [0]
        for r in range(dp - 1):
            prev = cut[-1]
            cand = ends[prev:]
            d = np.abs(cand - targets[r])
            cut.append(prev + int(np.argmin(d)))  # argmin: the first (earlier) of equal distances
        cut.append(i1 - i0)
        for r in range(dp):
            for u in range(cut[r], cut[r + 1]):
                owner[i0 + u] = r
                load[r] += numel[i0 + u]
    return owner


def authors_plan(
    specs: Sequence[ParamSpec],
    *,
    dp: int,
    tp: int,
    optimizer: str = "muon",
    alpha: float = 1.0,
    cost: str = "numel",
    dp_mode: str = "balanced",
    tp_mode: str = "global",
    convention: Convention = PAPER,
) -> AuthorsPlan:
    """Plan ``specs`` (canzona's registration order, as :func:`canzona.specs.specs_from_config`
    lists them) the way the authors' code does (see the module docstring).

    ``dp_mode``: ``balanced`` (Algorithm 1, kept only if better by ``cost``) or ``baseline``
    (the static partition, "before"). ``tp_mode``: ``global`` (Algorithm 2) or ``no`` (chunks of
    ``tp`` in buffer order, the TP "before"). ``cost``: ``numel`` or ``flops`` (TP-local shapes).
    """
    if dp < 1 or tp < 1:
        raise PlanError(f"dp and tp must be >= 1, got dp={dp}, tp={tp}")
    if dp_mode not in ("balanced", "baseline") or tp_mode not in ("global", "no"):
        raise PlanError(f"dp_mode must be balanced|baseline and tp_mode global|no, got {dp_mode!r}, {tp_mode!r}")
    if cost not in ("numel", "flops"):
        raise PlanError(f"the authors' planner takes cost numel or flops, got {cost!r}")
    ordered = megatron_core_order(specs) if convention.registration == "megatron-core" else list(specs)
    if convention.buffers == "matrix-only":
        ordered = [s for s in ordered if authors_matrix_param(s)]
    else:
        ordered = [s for s in ordered if s.kind == "matrix"]
    if not ordered:
        raise PlanError("no matrix-optimizer parameters to plan")
    buf = tuple(ordered[::-1])
    numel = np.array([s.local_numel for s in buf], dtype=np.float64)
    flops = np.array([_flops(optimizer, s.local_shape) for s in buf])
    costv = numel if cost == "numel" else flops
    bounds = _buckets(numel, convention.bucket_numel or 400_000_000)
    base = _baseline(numel, bounds, dp)
    kept = False
    owner = base
    if dp_mode == "balanced":
        bal = _balanced(numel, bounds, dp, alpha)
        lb = np.bincount(bal, weights=costv, minlength=dp).max()
        lo = np.bincount(base, weights=costv, minlength=dp).max()
        if lb < lo:
            owner, kept = bal, True
    groups: list[tuple[tuple[tuple[int, int], ...], ...]] = []
    cmax = float(convention.cmax)
    for r in range(dp):
        items = [i for i in range(len(buf)) if owner[i] == r and buf[i].tp_split]
        if tp_mode == "no":
            gs = tuple(tuple((i, j) for j, i in enumerate(items[c:c + tp])) for c in range(0, len(items), tp))
            groups.append(gs)
            continue
        srt = sorted(items, key=lambda i: (costv[i], i), reverse=True)
        closed: list[list[int]] = []
        cur: list[int] = []
        for i in srt:
            if costv[i] > cmax:
                raise PlanError(f"{buf[i].name}: its cost {costv[i]:.0f} alone exceeds C_max = {cmax:.0f}")
            cand = cur + [i]
            h = _lpt([costv[x] for x in cand], tp)
            loads = np.zeros(tp)
            for x, hh in zip(cand, h):
                loads[hh] += costv[x]
            if loads.max() <= cmax:
                cur = cand
            else:
                closed.append(cur)
                cur = [i]
        if cur:
            closed.append(cur)
        groups.append(tuple(tuple(zip(g, _lpt([costv[x] for x in g], tp))) for g in closed))
    return AuthorsPlan(buf, dp, tp, optimizer, tuple(bounds), tuple(owner), tuple(groups), kept, dp_mode, tp_mode,
                       flops, numel)


def convention_plan(
    model: Any,
    *,
    dp: int,
    tp: int = 1,
    convention: Convention = PAPER,
    **kwargs: Any,
) -> Any:
    """A canzona :class:`~canzona.plan.Plan` (runnable by the runtime) under ``convention``.

    ``PAPER``: split buffers (the matrix buffer first), Megatron-Core registration order, the
    authors' 400M-element buckets, C_max equal to their 400 x 2^20 TP-local elements per host
    (``400 * 2^20 * tp * grad_bytes`` bytes of gathered gradient: the same capacity test) and FLOPs
    on TP-local shapes. Algorithm 1 runs on the matrix buffer in element loads (the numel cost);
    the authors' keep-only-if-better rule and their snapping tie rule are not part of canzona's
    ``lb-asc`` (:func:`authors_plan` has both). ``CANZONA``: :func:`canzona.plan.plan_model`'s
    defaults. ``kwargs`` (strategy, optimizer, alpha, cost, ...) pass through.
    """
    from canzona.plan.build import make_plan, plan_model, resolve_model
    from canzona.plan.plan import PlanInputs
    from canzona.plan.strategies import get_strategy
    from canzona.specs import specs_from_config

    if convention.name == "canzona":
        return plan_model(model, dp=dp, tp=tp, **kwargs)
    if convention.name != "paper":
        raise PlanError(f"unknown convention {convention.name!r}; choose one of {', '.join(CONVENTIONS)}")
    cfg = resolve_model(model)
    layout = kwargs.pop("layout", "megatron")
    specs = specs_from_config(cfg, tp=tp, layout=layout)
    if convention.registration == "megatron-core":
        specs = megatron_core_order(specs)
    strategy = kwargs.pop("strategy", "lb-asc")
    grad_bytes = kwargs.pop("grad_bytes", 4)
    inputs = PlanInputs(
        model=cfg.name, layout=layout, dp=dp, tp=tp, strategy=strategy,
        optimizer=kwargs.pop("optimizer", "muon"),
        tp_schedule=kwargs.pop("tp_schedule", None) or get_strategy(strategy).default_tp_schedule,
        bucket_numel=kwargs.pop("bucket_numel", None) or convention.bucket_numel or 400_000_000,
        cmax_bytes=kwargs.pop("cmax_bytes", None) or convention.cmax * tp * grad_bytes,
        grad_bytes=grad_bytes,
        flops_shape=kwargs.pop("flops_shape", convention.flops_shape),
        buffers="split" if convention.buffers == "matrix-only" else "joint",
        **kwargs,
    )
    return make_plan(specs, inputs)
