"""Expert parallelism in the planner: each rank's experts are a fixed preload, the dense tasks are
balanced around it (the paper's Algorithm 1, Section 3, with an initial load per rank).

Under expert parallelism (torchtitan's ``ep`` mesh dimension) an ``(E, M, N)`` expert stack is
sharded along its expert dim: EP coordinate ``e`` holds experts ``[e E/ep, (e+1) E/ep)`` whole,
and those are updated only by the ranks holding them. So the optimizer work splits in two plans:

- the *expert* plan: the local stacks ``(E/ep, M, N)`` (E/ep matrix tasks each) over the ranks
  that hold the same experts (the expert-DP group: the ``dp`` mesh dimension at a fixed ``ep``
  coordinate; one rank when the mesh is ``("ep",)``). Every EP coordinate has the same shapes, so
  one plan serves all of them;
- the *dense* plan: every other parameter over all data-parallel ranks (``dp x ep`` of them),
  planned with each rank's expert load as its ``preload`` (:func:`canzona.plan.dp.lb_asc`): the
  load-balancing strategies fill the ranks around the work they already have.

Rank numbering (the runtime's and the CLI's): dense rank ``r`` is the world rank of a row-major
``("dp", "ep")`` mesh, so its EP coordinate is ``r % ep`` and its expert-DP rank ``r // ep``.

With a ``tp`` dimension beside ``ep`` (mesh ``("dp", "ep", "tp")``, experts not TP-cut) the dense
plan is a ZeRO-1 x TP plan over ``dp x ep`` DP ranks and ``tp``, and the experts of one EP
coordinate are held whole by the ``dp x tp`` GPUs at that coordinate: the expert plan spans
``dp x tp`` ranks (expert rank ``d * tp + t``, no TP split), and dense rank ``r``'s preload is the
mean of its ``tp`` GPUs' expert loads (the dense plan's cost is per TP rank).

Expert tensor parallelism (ETP, torchtitan's ``(Shard(0), Shard(d))`` on ``("ep", "tp")``: every
expert's rows or columns cut over ``tp``): every local stack is TP-split, so the expert plan is
itself a ZeRO-1 x TP plan over the ``dp`` ranks of each ``(ep, tp)`` coordinate and ``tp`` (each
expert one TP task, hosted whole on one TP rank), and dense rank ``r``'s preload is expert rank
``r // ep``'s load (both plans' costs are per TP rank). A mix of TP-split and whole stacks is
refused: the two need different expert groups.

Pure: shapes and ints in, frozen records out; no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from canzona.cost import matrix_flops
from canzona.plan.build import _task_metric, make_plan
from canzona.plan.errors import PlanError
from canzona.plan.plan import Plan, PlanInputs
from canzona.specs import ParamSpec

__all__ = ["ClusterEP", "EPPlan", "expert_rank_of", "format_cluster_ep", "gpu_loads", "local_expert_specs", "plan_cluster_ep", "plan_ep", "plan_model_ep", "run_plan_ep"]


@dataclass(frozen=True, slots=True)
class EPPlan:
    """The two plans of an expert-parallel layout (see the module docstring). ``dp`` is the size
    of the mesh's ``dp`` dimension, ``ep`` the EP size, ``tp`` the TP size; the dense plan spans
    ``dp * ep`` DP ranks (x ``tp``), the expert plan the ``dp * tp`` ranks holding the same experts."""

    dense: Plan
    experts: Plan
    dp: int
    ep: int
    tp: int = 1
    #: expert tensor parallelism: the expert plan is over ``dp`` ranks x ``tp`` (every stack TP-split)
    etp: bool = False

    def __post_init__(self) -> None:
        want = (self.dp, self.tp) if self.etp else (self.dp * self.tp, 1)
        if self.etp and self.tp == 1:
            raise PlanError("an EP plan with expert tensor parallelism needs tp > 1")
        if (self.dense.inputs.dp != self.dp * self.ep or self.dense.inputs.tp != self.tp
                or (self.experts.inputs.dp, self.experts.inputs.tp) != want):
            holders = f"dp = {self.dp} ranks x tp = {self.tp}" if self.etp else f"dp x tp = {self.dp * self.tp} ranks without TP"
            raise PlanError(
                f"an EP plan needs a dense plan over dp x ep = {self.dp * self.ep} ranks x tp = {self.tp} and an expert plan over "
                f"{holders}; got {self.dense.inputs.dp} x {self.dense.inputs.tp} "
                f"and {self.experts.inputs.dp} x {self.experts.inputs.tp}"
            )
        common = {p.name for p in self.dense.params} & {p.name for p in self.experts.params}
        if common:
            raise PlanError(f"{sorted(common)[0]}: in both the dense and the expert plan")

    @property
    def fingerprint(self) -> str:
        """sha256 over both plans' fingerprints and the mesh sizes."""
        mesh = f"{self.dp}/{self.ep}" if self.tp == 1 else f"{self.dp}/{self.ep}/{'etp' if self.etp else 'tp'}{self.tp}"
        raw = f"ep/{mesh}/{self.dense.fingerprint}/{self.experts.fingerprint}".encode()
        return hashlib.sha256(raw).hexdigest()

    @property
    def params(self) -> tuple:
        return self.dense.params + self.experts.params

    @property
    def specs(self) -> tuple[ParamSpec, ...]:
        return tuple(self.dense.specs) + tuple(self.experts.specs)

    def describe(self) -> str:
        """The role table of both parts (:func:`canzona.plan.describe.describe_plan`); expert
        owners are expert-DP ranks, the same on every EP coordinate."""
        from canzona.plan.describe import describe_plan

        holders = f"dp = {self.dp}" if self.tp == 1 or self.etp else f"dp x tp = {self.dp * self.tp}"
        tp = "" if self.tp == 1 else f" x tp = {self.tp}"
        cut = f" x tp = {self.tp} (each expert TP-split: expert tensor parallelism)" if self.etp else ""
        return (f"dense parameters, over all dp x ep = {self.dp * self.ep} ranks{tp}:\n{describe_plan(self.dense)}\n"
                f"expert stacks as each EP rank holds them (E/ep experts), over the {holders} ranks holding the same "
                f"experts{cut}:\n{describe_plan(self.experts)}\nEP plan {self.fingerprint}")

    def plan_of(self, name: str) -> Plan:
        """The plan (dense or expert) that holds parameter ``name``."""
        return self.experts if any(p.name == name for p in self.experts.params) else self.dense

    def expert_preload(self) -> np.ndarray:
        """Each dense rank's expert load in the planning cost (what the dense plan was balanced around)."""
        return _preload(self.experts, self.dp, self.ep, 1 if self.etp else self.tp)


def expert_rank_of(dp: int, ep: int) -> tuple[int, ...]:
    """The expert-DP rank of every dense rank (row-major ``("dp", "ep")``: ``r // ep``)."""
    return tuple(r // ep for r in range(dp * ep))


def _preload(experts: Plan, dp: int, ep: int, tp: int) -> np.ndarray:
    """Each dense rank's expert load: dense rank ``r = d * ep + e`` is the ``tp`` GPUs of expert
    ranks ``d * tp + t``; the mean over them (one value when ``tp = 1``, and under expert tensor
    parallelism, whose expert plan is per TP rank already: pass ``tp = 1``)."""
    loads = np.asarray(experts.metrics.details["dp_cost_loads"], dtype=np.float64)
    index = np.array([[(r // ep) * tp + t for t in range(tp)] for r in range(dp * ep)], dtype=np.int64)
    return loads[index].mean(axis=1)


def local_expert_specs(specs: Sequence[ParamSpec], ep: int, *, etp: bool = False) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """Split ``specs`` into the dense ones and the expert stacks as one EP rank holds them
    (``(E/ep, M, N)``); PlanError when ``ep`` does not divide a stack's expert count, or when
    there is no stack to shard. A TP-split stack is refused unless ``etp`` (expert tensor
    parallelism, where every stack must be TP-split)."""
    if not isinstance(ep, int) or ep < 1:
        raise PlanError(f"ep must be an integer >= 1, got {ep!r}")
    dense: list[ParamSpec] = []
    local: list[ParamSpec] = []
    for s in specs:
        if s.kind != "experts":
            dense.append(s)
            continue
        if s.shape[0] % ep:
            raise PlanError(f"{s.name}: {s.shape[0]} experts do not divide by ep={ep}")
        if s.tp_split != etp:
            raise PlanError(f"{s.name}: a TP-split expert stack cannot also be sharded over ep without expert tensor parallelism"
                            if s.tp_split else f"{s.name}: under expert tensor parallelism every expert stack must be TP-split")
        local.append(replace(s, shape=(s.shape[0] // ep, *s.shape[1:])))
    if not local:
        raise PlanError("expert parallelism needs expert stacks ((E, M, N) parameters of kind 'experts'); the model has none")
    return dense, local


def plan_ep(dense_specs: Sequence[ParamSpec], expert_specs: Sequence[ParamSpec], inputs: PlanInputs, *, ep: int,
            expert_bucket_numel: int | None = None) -> EPPlan:
    """Plan both parts. ``inputs`` describe the dense plan (``inputs.dp`` = dp x ep ranks, and
    ``inputs.tp``); the expert plan takes the same inputs over the ``inputs.dp // ep x inputs.tp``
    ranks holding the same experts, without TP (``expert_bucket_numel``: its bucket size, default
    the dense one); when every local stack is TP-split (expert tensor parallelism) it is a ZeRO-1
    x TP plan over the ``inputs.dp // ep`` ranks and ``inputs.tp``. ``expert_specs`` are the local
    stacks (:func:`local_expert_specs`)."""
    if inputs.dp % ep:
        raise PlanError(f"ep={ep} does not divide the {inputs.dp} data-parallel ranks")
    dp, tp = inputs.dp // ep, inputs.tp
    split = {s.tp_split for s in expert_specs}
    if len(split) > 1:
        mixed = next(s.name for s in expert_specs if not s.tp_split)
        raise PlanError(f"{mixed}: not TP-split while other expert stacks are; under expert tensor parallelism every stack is cut over tp")
    etp = split == {True}
    if etp and any(s.tp != tp for s in expert_specs):
        raise PlanError(f"expert tensor parallelism: every expert stack must be split over the layout's tp={tp}")
    holders = replace(inputs, dp=dp, bucket_numel=expert_bucket_numel or inputs.bucket_numel)
    if tp > 1 and not etp:
        holders = replace(holders, dp=dp * tp, tp=1)
    experts = make_plan(expert_specs, holders)
    preload = _preload(experts, dp, ep, 1 if etp else tp)
    dense = make_plan(dense_specs, inputs, preload=preload.tolist()) if dense_specs else _no_dense(inputs)
    return EPPlan(dense=dense, experts=experts, dp=dp, ep=ep, tp=tp, etp=etp)


def _no_dense(inputs: PlanInputs) -> Plan:
    raise PlanError("expert parallelism with no dense parameter is not supported (the model holds only experts)")


# ------------------------------------------------------------------------------ cluster scale
def gpu_loads(plan: Plan) -> dict[str, np.ndarray]:
    """Optimizer FLOPs and state bytes of every GPU of ``plan``, shape ``(dp, tp)``: each DP
    rank's load per TP rank, with every TP task (a TP-split matrix, or one expert of a TP-split
    stack) moved from its per-rank average to its host at full cost (the accounting of
    :func:`canzona.plan.metrics.tp_host_loads`; under the ``sync`` schedule every TP rank
    recomputes it)."""
    from canzona.cost import cost_arrays

    inp, d = plan.inputs, plan.metrics.details
    tasks = _tp_task_hosts(plan) if inp.tp > 1 else []
    out: dict[str, np.ndarray] = {}
    for j, key in enumerate(("flops", "memory")):
        host = np.repeat(np.asarray(d[f"dp_{key}_loads"], dtype=np.float64)[:, None], inp.tp, axis=1)
        for r, spec, at in tasks:
            avg = float(cost_arrays([spec], inp.optimizer, inp.flops_shape)[j][0]) / spec.n_tasks
            full = _task_metric(spec, inp.optimizer, inp.flops_shape)[j]
            host[r, :] -= avg
            if at is None:
                host[r, :] += full
            else:
                host[r, at] += full
        out[key] = host
    return out


def _tp_task_hosts(plan: Plan) -> list[tuple[int, ParamSpec, int | None]]:
    """Every TP task of ``plan`` as (DP rank, its parameter's spec, TP host or None when every TP
    rank recomputes it): from the micro-groups, or under ``sync`` (no groups) from what each DP
    rank updates (an expert of a stack per the plan's ranges)."""
    from canzona.specs import split_task_name

    by = plan.by_name()
    if any(plan.micro_groups):
        return [(r, by[split_task_name(n)[0]].spec, h) for r, groups in enumerate(plan.micro_groups)
                for g in groups for n, h in zip(g.params, g.hosts)]
    out: list[tuple[int, ParamSpec, int | None]] = []
    every = plan.every_rank_updates
    for pp in plan.params:
        if not pp.spec.tp_split or pp.role not in ("tp-task", "experts"):
            continue
        for r in range(plan.inputs.dp):
            if every or pp.dp_owner == r:
                count = pp.spec.n_tasks
            elif pp.role == "experts":
                unit = pp.numel // pp.spec.shape[0]
                count = sum(len(range(s // unit, e // unit)) for rr, s, e in pp.dp_ranges if rr == r)
            else:
                count = 0
            out += [(r, pp.spec, None)] * count
    return out


def _ratio(v: np.ndarray) -> float:
    m = float(v.mean())
    return float(v.max()) / m if m > 0 else 1.0


@dataclass(frozen=True, slots=True)
class ClusterEP:
    """A planned cluster with expert parallelism (:func:`plan_cluster_ep`) beside the same cluster
    without it (``plain``). ``experts`` is the plan of one EP coordinate's local stacks over the
    ``dp/ep x tp`` GPUs holding them. Loads are per GPU, shape ``(dp, tp)``."""

    dense: Plan
    experts: Plan
    plain: Plan
    ep: int
    tp: int
    flops: np.ndarray
    memory: np.ndarray
    plain_flops: np.ndarray
    plain_memory: np.ndarray
    bound: float
    plain_bound: float
    n_stacks: int
    n_experts: int
    seconds: float
    #: expert tensor parallelism: every stack TP-split, its experts planned over dp/ep DP ranks x tp
    etp: bool = False


def _bound(specs: Sequence[ParamSpec], optimizer: str, total: float, gpus: int) -> float:
    """The atomic bound on max / mean FLOPs over all GPUs: the largest single task (one expert of a
    stack, full shape) over the mean GPU load, at least 1."""
    tasks = [matrix_flops(optimizer, s.task_shape if s.kind == "experts" else s.shape) for s in specs if s.kind in ("matrix", "experts")]
    return max(1.0, max(tasks, default=0) / (total / gpus)) if total > 0 else 1.0


def plan_cluster_ep(specs: Sequence[ParamSpec], inputs: PlanInputs, *, ep: int, plain: Plan | None = None) -> ClusterEP:
    """``canzona plan --ep``: ``inputs.dp`` data-parallel ranks x ``inputs.tp``, of which ``ep``
    shard the experts (EP borrows from data parallelism, as torchtitan does: mesh
    ``("dp", "ep", "tp") = (dp/ep, ep, tp)``). Each EP coordinate's local experts are planned over
    the ``dp/ep x tp`` GPUs holding them (each expert whole on one GPU); when the stacks are
    TP-split (``--experts stacked-tp``: expert tensor parallelism) over the ``dp/ep`` DP ranks x
    ``tp`` instead, each expert a TP task hosted whole on one TP rank. Each DP rank's expert load
    (per TP rank) is the dense plan's preload. Also plans the same cluster without EP (every expert
    of every stack a task of the dense plan), unless ``plain`` (that plan, made already) is given."""
    import time

    t0 = time.perf_counter()
    if inputs.dp % ep:
        raise PlanError(f"ep={ep} must divide dp={inputs.dp} (expert parallelism borrows its ranks from data parallelism)")
    dp, tp = inputs.dp, inputs.tp
    etp = tp > 1 and any(s.kind == "experts" and s.tp_split for s in specs)
    dense, local = local_expert_specs(specs, ep, etp=etp)
    if etp:  # one EP coordinate's experts over its dp/ep DP ranks x tp, each expert a TP task
        experts = make_plan(local, replace(inputs, dp=dp // ep))
        expert_gpu = gpu_loads(experts)  # (dp/ep, tp): the TP hosts at full cost
        preload = np.asarray(experts.metrics.details["dp_cost_loads"], dtype=np.float64)[[d // ep for d in range(dp)]]
        rows = [d // ep for d in range(dp)]
        per_gpu_flops, per_gpu_memory = expert_gpu["flops"][rows], expert_gpu["memory"][rows]
    else:
        holders = dp // ep * tp  # the GPUs holding one EP coordinate's experts
        experts = make_plan(local, replace(inputs, dp=holders, tp=1))
        per_gpu = {k: np.asarray(experts.metrics.details[f"dp_{k}_loads"], dtype=np.float64) for k in ("cost", "flops", "memory")}
        # GPU (d, t) holds the experts of EP coordinate d % ep; its place in their plan is (d // ep) * tp + t
        index = np.array([[(d // ep) * tp + t for t in range(tp)] for d in range(dp)], dtype=np.int64)
        preload = per_gpu["cost"][index].mean(axis=1)  # the dense plan's cost is per TP rank
        per_gpu_flops, per_gpu_memory = per_gpu["flops"][index], per_gpu["memory"][index]
    dense_plan = make_plan(dense, inputs, preload=preload.tolist())
    dense_gpu = gpu_loads(dense_plan)
    flops = dense_gpu["flops"] + per_gpu_flops
    memory = dense_gpu["memory"] + per_gpu_memory
    plain = plain if plain is not None else make_plan(specs, inputs)
    plain_gpu = gpu_loads(plain)
    return ClusterEP(
        dense=dense_plan, experts=experts, plain=plain, ep=ep, tp=tp, flops=flops, memory=memory, plain_flops=plain_gpu["flops"], plain_memory=plain_gpu["memory"],
        bound=_bound(specs, inputs.optimizer, float(flops.sum()), dp * tp),
        plain_bound=_bound(specs, inputs.optimizer, float(plain_gpu["flops"].sum()), dp * tp),
        n_stacks=len(local), n_experts=sum(s.shape[0] for s in local) * ep, seconds=time.perf_counter() - t0, etp=etp,
    )


def plan_model_ep(model: Any, *, ep: int, **kwargs: Any) -> ClusterEP:
    """:func:`plan_cluster_ep` for a shipped model or config (``kwargs`` as
    :func:`canzona.plan.build.plan_model` takes them)."""
    import time

    from canzona.plan.build import plan_model

    t0 = time.perf_counter()
    plain = plan_model(model, **kwargs)
    out = plan_cluster_ep(plain.specs, plain.inputs, ep=ep, plain=plain)
    return replace(out, seconds=time.perf_counter() - t0)


def run_plan_ep(args: Any) -> int:
    """``canzona plan --ep N`` (the command's other arguments already checked): plan, print the
    report; PlanError (one line, exit 2) for an EP size that does not divide ``--dp`` or the
    experts, a model without experts, or an option this report does not combine with."""
    import warnings

    if args.ep < 1:
        raise PlanError(f"--ep must be >= 1, got {args.ep}")
    clash = [flag for flag, on in (("--pp", args.pp > 1), ("--compare", args.compare), ("--json", args.json is not None),
                                    ("--convention paper", args.convention == "paper"),
                                    ("--experts separate", getattr(args, "experts", "stacked") == "separate")) if on]
    if clash:
        raise PlanError(f"--ep plans one layout and prints its report; drop {', '.join(clash)}")
    if args.dp % args.ep:
        raise PlanError(f"--ep {args.ep} must divide --dp {args.dp} (expert parallelism takes its ranks from data parallelism)")
    from canzona.plan.build import DEFAULT_CMAX, cmax_to_bytes

    if not args.cmax > 0:
        raise PlanError(f"--cmax must be > 0, got {args.cmax}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = plan_model_ep(
            args.model, ep=args.ep, dp=args.dp, tp=args.tp, layout=args.layout, optimizer=args.optimizer, strategy=args.strategy,
            alpha=args.alpha, cost=args.cost, flops_shape=args.flops_shape, cmax_bytes=cmax_to_bytes(args.cmax or DEFAULT_CMAX, args.tp, args.grad_bytes),
            bucket_numel=args.bucket_numel, tp_schedule=args.tp_schedule, grad_bytes=args.grad_bytes, buffers=args.buffers,
            experts=args.experts,
        )
    print(format_cluster_ep(c))
    return 0


def format_cluster_ep(c: ClusterEP) -> str:
    """The report of ``canzona plan --ep`` (max / mean over every GPU next to the atomic bound)."""
    i = c.dense.inputs
    dp, tp, ep = i.dp, c.tp, c.ep
    per_rank = c.n_experts // ep
    lines = [
        f"{i.model} ({i.layout}), DP {dp} x TP {tp} with EP {ep} (mesh ('dp', 'ep', 'tp') = ({dp // ep}, {ep}, {tp}), {dp * tp} GPUs), "
        f"{i.optimizer}, strategy {i.strategy}",
        f"  experts: {c.n_stacks} stacks, {c.n_experts} expert tasks; each EP rank holds {per_rank} "
        f"({per_rank // max(c.n_stacks, 1)} per stack), "
        + (f"each cut over TP {tp} (expert tensor parallelism) and planned over the {dp // ep} DP ranks x TP {tp} that hold them, "
           f"every expert hosted whole on one TP rank; " if c.etp else f"planned over the {dp // ep * tp} GPUs that hold them; ")
        + "the dense plan is balanced around that preload",
        f"  {'':<26}{'with EP':>10}{'without EP':>12}",
        f"  {'FLOPs max/mean, all GPUs':<26}{_ratio(c.flops):>10.3f}{_ratio(c.plain_flops):>12.3f}",
        f"  {'atomic lower bound':<26}{c.bound:>10.3f}{c.plain_bound:>12.3f}   (largest task / mean GPU load)",
        f"  {'state max/mean, all GPUs':<26}{_ratio(c.memory):>10.3f}{_ratio(c.plain_memory):>12.3f}",
        f"  {'max GPU GFLOPs':<26}{c.flops.max() / 1e9:>10.1f}{c.plain_flops.max() / 1e9:>12.1f}",
        f"  {'max GPU state GiB':<26}{c.memory.max() / 2**30:>10.3f}{c.plain_memory.max() / 2**30:>12.3f}",
        f"  planned in {c.seconds * 1e3:.0f} ms (both layouts)",
    ]
    return "\n".join(lines)
