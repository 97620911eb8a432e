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

Pure: shapes and ints in, frozen records out; no torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from canzona.plan.build import make_plan
from canzona.plan.errors import PlanError
from canzona.plan.plan import Plan, PlanInputs
from canzona.specs import ParamSpec

__all__ = ["EPPlan", "expert_rank_of", "local_expert_specs", "plan_ep"]


@dataclass(frozen=True, slots=True)
class EPPlan:
    """The two plans of an expert-parallel layout (see the module docstring). ``dp`` is the
    expert-DP size (the mesh's ``dp`` dimension), ``ep`` the EP size; the dense plan spans
    ``dp * ep`` ranks, the expert plan ``dp``."""

    dense: Plan
    experts: Plan
    dp: int
    ep: int

    def __post_init__(self) -> None:
        if self.dense.inputs.dp != self.dp * self.ep or self.experts.inputs.dp != self.dp:
            raise PlanError(
                f"an EP plan needs a dense plan over dp x ep = {self.dp * self.ep} ranks and an expert plan over "
                f"dp = {self.dp}; got {self.dense.inputs.dp} and {self.experts.inputs.dp}"
            )
        common = {p.name for p in self.dense.params} & {p.name for p in self.experts.params}
        if common:
            raise PlanError(f"{sorted(common)[0]}: in both the dense and the expert plan")

    @property
    def fingerprint(self) -> str:
        """sha256 over both plans' fingerprints and the mesh sizes."""
        raw = f"ep/{self.dp}/{self.ep}/{self.dense.fingerprint}/{self.experts.fingerprint}".encode()
        return hashlib.sha256(raw).hexdigest()

    @property
    def params(self) -> tuple:
        return self.dense.params + self.experts.params

    @property
    def specs(self) -> tuple[ParamSpec, ...]:
        return tuple(self.dense.specs) + tuple(self.experts.specs)

    def plan_of(self, name: str) -> Plan:
        """The plan (dense or expert) that holds parameter ``name``."""
        return self.experts if any(p.name == name for p in self.experts.params) else self.dense

    def expert_preload(self) -> np.ndarray:
        """Each dense rank's expert load in the planning cost (what the dense plan was balanced around)."""
        loads = np.asarray(self.experts.metrics.details["dp_cost_loads"], dtype=np.float64)
        return loads[np.asarray(expert_rank_of(self.dp, self.ep), dtype=np.int64)]


def expert_rank_of(dp: int, ep: int) -> tuple[int, ...]:
    """The expert-DP rank of every dense rank (row-major ``("dp", "ep")``: ``r // ep``)."""
    return tuple(r // ep for r in range(dp * ep))


def local_expert_specs(specs: Sequence[ParamSpec], ep: int) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """Split ``specs`` into the dense ones and the expert stacks as one EP rank holds them
    (``(E/ep, M, N)``); PlanError when ``ep`` does not divide a stack's expert count, or when
    there is no stack to shard."""
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
        if s.tp_split:
            raise PlanError(f"{s.name}: a TP-split expert stack cannot also be sharded over ep")
        local.append(replace(s, shape=(s.shape[0] // ep, *s.shape[1:])))
    if not local:
        raise PlanError("expert parallelism needs expert stacks ((E, M, N) parameters of kind 'experts'); the model has none")
    return dense, local


def plan_ep(dense_specs: Sequence[ParamSpec], expert_specs: Sequence[ParamSpec], inputs: PlanInputs, *, ep: int,
            expert_bucket_numel: int | None = None) -> EPPlan:
    """Plan both parts. ``inputs`` describe the dense plan (``inputs.dp`` = dp x ep ranks); the
    expert plan takes the same inputs over ``inputs.dp // ep`` ranks (``expert_bucket_numel``:
    its bucket size, default the dense one). ``expert_specs`` are the local stacks
    (:func:`local_expert_specs`)."""
    if inputs.dp % ep:
        raise PlanError(f"ep={ep} does not divide the {inputs.dp} data-parallel ranks")
    dp = inputs.dp // ep
    experts = make_plan(expert_specs, replace(inputs, dp=dp, bucket_numel=expert_bucket_numel or inputs.bucket_numel))
    loads = np.asarray(experts.metrics.details["dp_cost_loads"], dtype=np.float64)
    preload = loads[np.asarray(expert_rank_of(dp, ep), dtype=np.int64)]
    dense = make_plan(dense_specs, inputs, preload=preload.tolist()) if dense_specs else _no_dense(inputs)
    return EPPlan(dense=dense, experts=experts, dp=dp, ep=ep)


def _no_dense(inputs: PlanInputs) -> Plan:
    raise PlanError("expert parallelism with no dense parameter is not supported (the model holds only experts)")
