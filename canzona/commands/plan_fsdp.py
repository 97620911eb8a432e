"""``canzona plan --fsdp N``: plan the FSDP2 optimizer step (hosts and micro-groups over every rank).

Examples::

    canzona plan --model qwen3-32b --fsdp 32 --tp 8
    canzona plan --model qwen3-32b --fsdp 16 --dp-replicate 2 --tp 8 --strategy asc --json fsdp.json

The plan covers all ``dp_replicate x fsdp x tp`` ranks: every matrix is a task hosted by one rank
of its shard group (``fsdp x tp`` ranks), element-wise parameters stay on every rank's own piece.
It prints the max/mean optimizer FLOPs and state bytes over every GPU next to the atomic lower
bound (the largest single matrix task / mean) and writes the versioned document
(``canzona.fsdp_plan``) with ``--json``.
"""

from __future__ import annotations

import argparse

from canzona.errors import UserError
from canzona.plan.build import cmax_from_bytes, cmax_to_bytes
from canzona.plan.fsdp import FSDP_STRATEGIES, FSDPPlan, plan_fsdp_model

__all__ = ["check_fsdp_ranks", "format_fsdp_plan", "run_fsdp"]


def check_fsdp_ranks(fsdp: int, dp_replicate: int, tp: int) -> None:
    """The ZeRO-1 planner's bounds, for FSDP2: ``dp_replicate x fsdp`` data-parallel ranks at most
    :data:`~canzona.plan.build.MAX_DP`, ``tp`` at most :data:`~canzona.plan.build.MAX_TP` (a
    larger figure is a typo, and planning it would take minutes and gigabytes)."""
    from canzona.plan.build import MAX_DP, MAX_TP

    for flag, v in (("--fsdp", fsdp), ("--dp-replicate", dp_replicate), ("--tp", tp)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1, got {v}")
    if fsdp * dp_replicate > MAX_DP:
        raise UserError(f"--dp-replicate x --fsdp = {dp_replicate} x {fsdp} data-parallel ranks, above canzona's bound {MAX_DP}")
    if tp > MAX_TP:
        raise UserError(f"--tp {tp} is above canzona's bound {MAX_TP}")


def format_fsdp_plan(plan: FSDPPlan, notes: list[str] = ()) -> str:  # type: ignore[assignment]
    """The readable summary ``canzona plan --fsdp`` prints."""
    i, m = plan.inputs, plan.metrics
    gib = 2**30
    lines = [
        f"{i.model}, FSDP2: dp_replicate {i.dp_replicate} x dp_shard {i.dp_shard} x tp {i.tp} = {i.world} ranks, "
        f"{i.optimizer}, strategy {i.strategy} (schedule {i.schedule})",
        f"cost {i.cost}, C_max {cmax_from_bytes(i.cmax_bytes, i.tp, i.grad_bytes):g} x 2^20 TP-local elements per host "
        f"({i.cmax_bytes / 2**20:g} MiB); shard group of {i.group_size} ranks"
        + (f", {i.dp_replicate} replicas run the same step" if i.dp_replicate > 1 else ""),
        "",
        f"  {'matrix tasks':<26}{m['n_matrix_tasks']} in {m['n_micro_groups']} micro-groups",
        f"  {'optimizer FLOPs / rank':<26}max {m['flops_max']:.4g}, mean {m['flops_mean']:.4g}",
        f"  {'FLOPs ratio (max/mean)':<26}{m['flops_ratio']:.3f}   (atomic bound {m['flops_bound']:.3f})",
        f"  {'state bytes / rank':<26}max {m['memory_max'] / gib:.3f} GiB, mean {m['memory_mean'] / gib:.3f} GiB",
        f"  {'memory ratio (max/mean)':<26}{m['memory_ratio']:.3f}   (atomic bound {m['memory_bound']:.3f})",
        f"  {'plan time':<26}{plan.plan_seconds * 1e3:.1f} ms",
        f"  {'fingerprint':<26}{plan.fingerprint}",
    ]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def run_fsdp(args: argparse.Namespace, json_path: object = None) -> int:
    """The ``--fsdp`` branch of ``canzona plan`` (arguments checked by the caller)."""
    if args.dp is not None:
        raise UserError("--dp plans canzona's own ZeRO-1 path and --fsdp plans FSDP2; give one of them")
    check_fsdp_ranks(args.fsdp, args.dp_replicate, args.tp)
    if args.strategy not in FSDP_STRATEGIES:
        raise UserError(f"strategy {args.strategy!r} needs canzona's ZeRO-1 buffer; on FSDP2 choose one of {', '.join(FSDP_STRATEGIES)}")
    if args.compare:
        raise UserError("--compare is for the ZeRO-1 planner; run --fsdp once per --strategy")
    plan = plan_fsdp_model(
        args.model,
        dp_shard=args.fsdp,
        tp=args.tp,
        dp_replicate=args.dp_replicate,
        layout=args.layout or "hf",
        optimizer=args.optimizer,
        strategy=args.strategy,
        cost=args.cost,
        **({"cmax_bytes": cmax_to_bytes(args.cmax, args.tp)} if args.cmax is not None else {}),
    )
    notes = []
    if json_path is not None:
        try:
            plan.to_json(json_path)  # type: ignore[arg-type]
        except OSError as exc:
            raise UserError(f"cannot write --json {args.json}: {exc.strerror or exc}") from None
        notes.append(f"plan document written to {json_path}")
    print(format_fsdp_plan(plan, notes))
    return 0
