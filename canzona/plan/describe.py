"""The table of roles a plan decided: per parameter its role, shape, matrix tasks, cost and owners.

Roles are data the user can see and change (``roles=`` on the optimizer); this table is the
seeing part, printed by ``DistributedOptimizer.describe()`` and ``canzona plan --roles``. Costs are
the planner's own (:func:`canzona.cost.param_flops` / :func:`canzona.cost.param_memory` for the
plan's optimizer), so the table shows what the partitioners balanced.
"""

from __future__ import annotations

from dataclasses import dataclass

from canzona.cost import param_flops, param_memory
from canzona.plan.plan import ParamPlan, Plan
from canzona.plan.tp import expert_hosts

__all__ = ["RoleRow", "describe_plan", "role_rows"]


@dataclass(frozen=True, slots=True)
class RoleRow:
    """One parameter as :func:`describe_plan` prints it."""

    name: str
    role: str
    shape: tuple[int, ...]
    tasks: str
    flops: float
    state_bytes: float
    owners: str


def _tasks(pp: ParamPlan) -> str:
    s = pp.spec
    if s.kind == "elementwise" or pp.role == "elementwise":
        return "-"
    m, n = s.task_shape
    note = " (stored transposed)" if s.transposed else (" (reshaped)" if s.kind == "matrix" and len(s.shape) > 2 else "")
    return f"{s.n_tasks} x ({m}, {n}){note}"


def _owners(pp: ParamPlan) -> str:
    if pp.replicated:
        who = "every DP rank"
    elif pp.dp_owner is not None:
        who = f"dp {pp.dp_owner}"
    else:
        unit = pp.numel // pp.spec.shape[0] if pp.role == "experts" else 0
        parts = []
        for r, a, b in pp.dp_ranges:
            parts.append(f"dp {r}: experts {a // unit}-{b // unit - 1}" if unit else f"dp {r}: [{a}, {b})")
        who = "; ".join(parts)
    if pp.tp_host is not None:
        who += f", TP host {pp.tp_host} (group {pp.micro_group})"
    return who


def role_rows(plan: Plan) -> list[RoleRow]:
    """One :class:`RoleRow` per planned parameter, in registration order."""
    opt, shape = plan.inputs.optimizer, plan.inputs.flops_shape
    out = []
    for pp in plan.params:
        spec = pp.spec
        flops = param_flops(spec, "adamw" if pp.role == "elementwise" else opt, shape)
        mem = param_memory(spec, "adamw" if pp.role == "elementwise" else opt, shape)
        owners = _owners(pp)
        if pp.role == "experts" and spec.tp_split:  # each expert a TP task: where they are hosted
            owners += f", TP-split on dim {spec.tp_dim}, {expert_hosts(plan.micro_groups, pp.name)}"
        out.append(RoleRow(pp.name, pp.role, tuple(spec.shape), _tasks(pp), flops, mem, owners))
    return out


def describe_plan(plan: Plan) -> str:
    """The role table of ``plan`` as aligned text (one line per parameter, a header and a total)."""
    rows = role_rows(plan)
    head = ("parameter", "role", "shape", "matrix tasks", "GFLOP/step", "state MiB", "updated by")
    cells = [head] + [
        (r.name, r.role, "x".join(map(str, r.shape)), r.tasks, f"{r.flops / 1e9:.4g}", f"{r.state_bytes / 2**20:.4g}", r.owners)
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head) - 1)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1] for c in cells]
    counts = {role: sum(r.role == role for r in rows) for role in ("matrix", "experts", "tp-task", "elementwise")}
    inp = plan.inputs
    lines.insert(1, "-" * len(lines[0]))
    lines.append(
        f"{len(rows)} parameters ({', '.join(f'{v} {k}' for k, v in counts.items() if v)}); optimizer {inp.optimizer}, "
        f"strategy {inp.strategy}, dp={inp.dp} tp={inp.tp}, plan {plan.fingerprint}"
    )
    return "\n".join(lines)
