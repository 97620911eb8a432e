"""``canzona plan``: plan DP partitioning and TP micro-groups for a model, print or save the plan.

Examples::

    canzona plan --model qwen3-32b --dp 32 --tp 8
    canzona plan --model qwen3-32b --dp 32 --tp 8 --compare --flops-shape full
    canzona plan --model path/to/config.json --dp 8 --tp 2 --strategy lb-asc-joint --json plan.json
    canzona plan --list-strategies
    canzona plan --model qwen3-32b --fsdp 32 --tp 8          # FSDP2 (see canzona.commands.plan_fsdp)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import NoReturn

from canzona.cli import UserError
from canzona.config import available_models
from canzona.cost import COST_MODELS
from canzona.plan import (
    FLOPS_SHAPES,
    TP_SCHEDULES,
    Plan,
    default_tp_schedule,
    plan_model,
)
from canzona.optimizers import optimizer_names
from canzona.plan.fsdp import FSDP_STRATEGIES
from canzona.plan.strategies import get_strategy, strategy_names
from canzona.specs import LAYOUTS

__all__ = ["add_arguments", "run", "one_line_errors", "format_plan", "format_compare"]



def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make argparse report a bad option as one line (``canzona <cmd>: error: ...``), exit 2."""
    prog = parser.prog

    def error(message: str) -> NoReturn:
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser)
    parser.add_argument("--model", help=f"shipped model ({', '.join(available_models())}) or a config JSON path")
    parser.add_argument("--dp", type=_int, default=None, help="data-parallel size (ZeRO-1 ranks)")
    parser.add_argument("--tp", type=_int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--fsdp", type=_int, default=None, help="plan FSDP2 instead: dp_shard size (ranks per replica = fsdp x tp)")
    parser.add_argument("--dp-replicate", type=_int, default=1, help="with --fsdp: HSDP replicas (default 1)")
    parser.add_argument("--layout", choices=LAYOUTS, default=None, help="parameter layout (default megatron; hf with --fsdp)")
    parser.add_argument("--optimizer", choices=optimizer_names(matrix=True), default="muon", help="matrix optimizer (default muon)")
    parser.add_argument("--strategy", choices=tuple(dict.fromkeys(strategy_names() + FSDP_STRATEGIES)), default="lb-asc",
                        help="DP strategy (default lb-asc); with --fsdp one of " + ", ".join(FSDP_STRATEGIES))
    parser.add_argument("--alpha", type=_float, default=1.0, help="Algorithm 1 balance factor in [0, 1] (default 1.0)")
    parser.add_argument("--cost", choices=COST_MODELS, default="numel", help="planning cost model W(p) (default numel)")
    parser.add_argument("--flops-shape", choices=FLOPS_SHAPES, default="full",
                        help="cost TP-split matrices on their full shape (default) or the TP-local shard (paper)")
    parser.add_argument("--cmax-mb", type=_float, default=512.0, help="micro-group capacity C_max in MiB of gathered gradient (default 512)")
    parser.add_argument("--bucket-numel", type=_int, default=None, help="ZeRO-1 bucket size in elements (default max(4e7, 1e6 * dp))")
    parser.add_argument("--tp-schedule", choices=TP_SCHEDULES, default=None, help="TP schedule (default: the strategy's own)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the plan document (docs/plan-format.md) to PATH")
    parser.add_argument("--compare", action="store_true", help="plan every strategy and print one row each")
    parser.add_argument("--list-strategies", action="store_true", help="print the DP strategy names, one per line")


def _cmax_bytes(mb: float) -> int:
    if not mb > 0:
        raise UserError(f"--cmax-mb must be > 0, got {mb}")
    return max(1, int(round(mb * 2**20)))


def _plan(args: argparse.Namespace, strategy: str, schedule: str | None) -> tuple[Plan, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_model(
            args.model,
            dp=args.dp,
            tp=args.tp,
            layout=args.layout,
            optimizer=args.optimizer,
            strategy=strategy,
            alpha=args.alpha,
            cost=args.cost,
            flops_shape=args.flops_shape,
            cmax_bytes=_cmax_bytes(args.cmax_mb),
            bucket_numel=args.bucket_numel,
            tp_schedule=schedule,
        )
    return plan, [str(w.message) for w in caught]


def format_plan(plan: Plan, notes: list[str] = ()) -> str:  # type: ignore[assignment]
    """The readable summary ``canzona plan`` prints."""
    i, m, d = plan.inputs, plan.metrics, plan.metrics.details
    lines = [
        f"{i.model} ({i.layout} layout), DP {i.dp} x TP {i.tp}, {i.optimizer}, strategy {i.strategy}, TP schedule {i.tp_schedule}",
        f"cost {i.cost}, FLOPs on {i.flops_shape} shapes, alpha {i.alpha:g}, buckets of >= {i.bucket_numel:,} elements, "
        f"C_max {i.cmax_bytes / 2**20:g} MiB",
        "",
        f"  {'buckets':<24}{d['n_buckets']}",
        f"  {'micro-groups':<24}{d['n_micro_groups']} (at most {d['max_micro_groups_per_rank']} per DP rank)",
        f"  {'DP FLOPs ratio':<24}{m.dp_flops_ratio:.3f}",
        f"  {'DP memory ratio':<24}{m.dp_memory_ratio:.3f}   (numel ratio {d['dp_numel_ratio']:.3f})",
        f"  {'TP FLOPs ratio':<24}{m.tp_flops_ratio:.3f}   (worst DP rank's TP group)",
        f"  {'TP memory ratio':<24}{m.tp_memory_ratio:.3f}",
        f"  {'J_DP':<24}{m.j_dp:.4g}   ({i.cost} units)",
        f"  {'J_Comm':<24}{m.j_comm:.4g}   (elements; worst bucket shard {d['max_bucket_comm_balance']:.2f}x mean)",
        f"  {'TP makespan':<24}groups in step {d['makespan_group_sum']:.4g}, hosts free {d['makespan_host_total']:.4g} ({i.cost} units)",
        f"  {'plan time':<24}{m.plan_seconds * 1e3:.1f} ms",
        f"  {'fingerprint':<24}{plan.fingerprint}",
    ]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def format_compare(rows: list[tuple[Plan, list[str]]]) -> str:
    """One row per strategy (the ``--compare`` table)."""
    head = (
        f"{'strategy':<14}{'tp sched':<13}{'DP flops':>9}{'DP mem':>8}{'DP numel':>9}{'TP flops':>9}{'TP mem':>8}"
        f"{'J_DP':>11}{'J_Comm':>11}{'buckets':>8}{'groups':>7}{'ms':>7}"
    )
    i = rows[0][0].inputs
    out = [
        f"{i.model} ({i.layout}), DP {i.dp} x TP {i.tp}, {i.optimizer}, cost {i.cost}, FLOPs on {i.flops_shape} shapes, alpha {i.alpha:g}",
        head,
        "-" * len(head),
    ]
    notes: list[str] = []
    for plan, ns in rows:
        p, m, d = plan.inputs, plan.metrics, plan.metrics.details
        out.append(
            f"{p.strategy:<14}{p.tp_schedule:<13}{m.dp_flops_ratio:>9.3f}{m.dp_memory_ratio:>8.3f}{d['dp_numel_ratio']:>9.3f}"
            f"{m.tp_flops_ratio:>9.3f}{m.tp_memory_ratio:>8.3f}{m.j_dp:>11.4g}{m.j_comm:>11.4g}{d['n_buckets']:>8}"
            f"{d['n_micro_groups']:>7}{m.plan_seconds * 1e3:>7.1f}"
        )
        notes += [f"{p.strategy}: {n}" for n in ns]
    out += [f"note: {n}" for n in dict.fromkeys(notes)]
    return "\n".join(out)


def _check_json_path(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        raise UserError(f"--json {path}: is a directory")
    if not p.parent.is_dir():
        raise UserError(f"--json {path}: directory {p.parent} does not exist")
    return p


def run(args: argparse.Namespace) -> int:
    if args.list_strategies:
        print("\n".join(strategy_names()))
        return 0
    if args.model is None:
        raise UserError("--model is required (a shipped model name or a config JSON path)")
    if args.fsdp is not None:
        from canzona.commands.plan_fsdp import run_fsdp

        return run_fsdp(args, _check_json_path(args.json) if args.json else None)
    if args.strategy not in strategy_names():
        raise UserError(f"strategy {args.strategy!r} runs on FSDP2 only (--fsdp); choose one of {', '.join(strategy_names())}")
    args.layout = args.layout or "megatron"
    if args.dp is None:
        raise UserError("--dp is required")
    if args.dp < 1:
        raise UserError(f"--dp must be >= 1, got {args.dp}")
    if args.tp < 1:
        raise UserError(f"--tp must be >= 1, got {args.tp}")
    if not 0.0 <= args.alpha <= 1.0:
        raise UserError(f"--alpha must be in [0, 1], got {args.alpha}")
    if args.bucket_numel is not None and args.bucket_numel < 1:
        raise UserError(f"--bucket-numel must be >= 1, got {args.bucket_numel}")
    json_path = _check_json_path(args.json) if args.json else None
    if args.compare:
        if json_path is not None:
            raise UserError("--json writes one plan; drop --compare or --json")
        rows = []
        for st in strategy_names():
            sched = args.tp_schedule
            if sched is None or (get_strategy(st).sync_tp_only and sched != "sync"):
                sched = default_tp_schedule(st)
            rows.append(_plan(args, st, sched))
        print(format_compare(rows))
        return 0
    plan, notes = _plan(args, args.strategy, args.tp_schedule)
    if json_path is not None:
        try:
            plan.to_json(json_path)
        except OSError as exc:
            raise UserError(f"cannot write --json {args.json}: {exc.strerror or exc}") from None
        notes.append(f"plan document written to {json_path}")
    print(format_plan(plan, notes))
    return 0
