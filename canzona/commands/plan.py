"""``canzona plan``: plan DP partitioning and TP micro-groups for a model, print or save the plan.

Examples::

    canzona plan --model qwen3-32b --dp 32 --tp 8
    canzona plan --model qwen3-32b --dp 32 --tp 8 --compare --flops-shape full
    canzona plan --model path/to/config.json --dp 8 --tp 2 --strategy lb-asc-joint --json plan.json
    canzona plan --model qwen3-32b --dp 4 --tp 8 --pp 4
    canzona plan --model qwen3-32b --dp 32 --tp 8 --convention paper
    canzona plan --list-strategies
    canzona plan --model qwen3-32b --fsdp 32 --tp 8          # FSDP2
    canzona plan --model qwen3-32b --fsdp 16 --dp-replicate 2 --tp 8 --strategy asc --json fsdp.json

With ``--fsdp N`` the plan is FSDP2's over all ``dp_replicate x fsdp x tp`` ranks: every matrix is
a task hosted by one rank of its shard group (``fsdp x tp`` ranks), expert stacks are E tasks
updated where FSDP2 leaves them, element-wise parameters stay on every rank's own piece. It prints
the max/mean optimizer FLOPs and state bytes over every GPU next to the atomic lower bound (the
largest single task / mean); ``--json`` writes the same versioned plan document.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from canzona.errors import UserError
from canzona.commands._args import one_line_errors  # re-exported: other subcommands import it from here
from canzona.commands._args import add_cmax_argument, file_path, output_path, positive_float, write_output
from canzona.config import available_models, check_tp_degree
from canzona.cost import COST_MODELS
from canzona.plan.plan import DEFAULT_FLOPS_SHAPE
from canzona.plan import (
    FLOPS_SHAPES,
    TP_SCHEDULES,
    Plan,
    DEFAULT_CMAX,
    cmax_from_bytes,
    cmax_to_bytes,
    default_tp_schedule,
    plan_model,
)
from canzona.optimizers import optimizer_names
from canzona.plan.build import plan_fsdp_model, resolve_model
from canzona.plan.convention import PAPER, AuthorsPlan, authors_plan, convention_plan, lower_bound, worst_tp_group_bound
from canzona.plan.pipeline import StagedPlan, plan_stages, split_stages
from canzona.plan.strategies import FSDP_STRATEGIES
from canzona.plan.strategies import get_strategy, strategy_names
from canzona.plan.tp import expert_tp_summary
from canzona.specs import EXPERT_LAYOUTS, LAYOUTS, specs_from_config

__all__ = [
    "add_arguments",
    "run",
    "one_line_errors",
    "format_plan",
    "format_compare",
    "format_stages",
    "format_authors",
    "format_fsdp_plan",
    "check_fsdp_ranks",
]


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
    parser.add_argument("--model", help=f"shipped model ({', '.join(available_models())}) or a config JSON path")
    parser.add_argument("--dp", type=_int, default=None, help="data-parallel size (ZeRO-1 ranks)")
    parser.add_argument("--tp", type=_int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--fsdp", type=_int, default=None, help="plan FSDP2 instead: dp_shard size (ranks per replica = fsdp x tp)")
    parser.add_argument("--dp-replicate", type=_int, default=1, help="with --fsdp: HSDP replicas (default 1)")
    parser.add_argument("--ep", type=_int, default=None,
                        help="expert parallelism: shard every expert stack over EP ranks taken from --dp (must divide --dp and the experts)")
    parser.add_argument("--layout", choices=LAYOUTS, default=None, help="parameter layout (default megatron; hf with --fsdp)")
    parser.add_argument("--optimizer", choices=optimizer_names(matrix=True), default="muon", help="matrix optimizer (default muon)")
    parser.add_argument("--strategy", choices=tuple(dict.fromkeys(strategy_names() + FSDP_STRATEGIES)), default="lb-asc",
                        help="DP strategy (default lb-asc); with --fsdp one of " + ", ".join(FSDP_STRATEGIES))
    parser.add_argument("--alpha", type=_float, default=1.0, help="Algorithm 1 balance factor in [0, 1] (default 1.0)")
    parser.add_argument("--cost", choices=COST_MODELS, default="numel", help="planning cost model W(p) (default numel)")
    parser.add_argument("--flops-shape", choices=FLOPS_SHAPES, default=DEFAULT_FLOPS_SHAPE,
                        help="cost TP-split matrices on their full shape or the TP-local shard (the paper's accounting)")
    add_cmax_argument(parser, DEFAULT_CMAX)
    parser.add_argument("--bucket-numel", type=_int, default=None, help="ZeRO-1 bucket size in elements (default max(4e7, 1e6 * dp))")
    parser.add_argument("--tp-schedule", choices=TP_SCHEDULES, default=None, help="TP schedule (default: the strategy's own)")
    parser.add_argument("--grad-bytes", type=_int, choices=(2, 4), default=4,
                        help="bytes per gradient element the TP exchanges carry; C_max counts elements, so its byte "
                             "bound scales with it (default 4: fp32, as Megatron's bf16 "
                             "training holds its main gradients; 2: bf16)")
    parser.add_argument("--buffers", choices=("joint", "split"), default="joint",
                        help="'split': matrix-optimizer and element-wise parameters in buffers of their own (the paper "
                             "authors' layout; element-wise buckets in equal chunks); default one joint buffer")
    parser.add_argument("--experts", choices=EXPERT_LAYOUTS, default="stacked",
                        help="MoE experts: (E, M, N) stacks replicated over TP (stacked, default), stacks split over TP "
                             "with each expert a TP task (stacked-tp, Megatron's expert tensor parallelism), or 2-D matrices (separate)")
    parser.add_argument("--pp", type=_int, default=1,
                        help="pipeline stages: layers split evenly as Megatron does, embedding on the first stage, "
                             "output layer on the last; each stage planned on its own (default 1)")
    parser.add_argument("--convention", choices=("canzona", "paper"), default="canzona",
                        help="'paper': the authors' planning and measuring rules (matrix-only buffer, Megatron-Core "
                             "order, 400M-element buckets, C_max in cost units, DP rank 0's TP ratios); default canzona")
    parser.add_argument("--json", metavar="PATH", type=file_path, default=None, help="write the plan document (docs/plan-format.md) to PATH")
    parser.add_argument("--compare", action="store_true", help="plan every strategy and print one row each")
    parser.add_argument("--list-strategies", action="store_true", help="print the DP strategy names, one per line")


def _cmax_bytes(args: argparse.Namespace) -> int:
    if not args.cmax > 0:
        raise UserError(f"--cmax must be > 0, got {args.cmax}")
    return cmax_to_bytes(args.cmax, args.tp, args.grad_bytes)


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
            cmax_bytes=_cmax_bytes(args),
            bucket_numel=args.bucket_numel,
            tp_schedule=schedule,
            grad_bytes=args.grad_bytes,
            buffers=args.buffers,
            experts=args.experts,
        )
    return plan, [str(w.message) for w in caught]


def format_stages(staged: StagedPlan) -> str:
    """Per-stage ratios and the worst stage (``canzona plan --pp N``)."""
    i = staged.stages[0].inputs
    head = f"{'stage':<7}{'params':>7}{'buckets':>8}{'groups':>7}{'DP flops':>9}{'DP mem':>8}{'TP flops':>9}{'TP mem':>8}"
    out = [f"{i.model} ({i.layout}), PP {staged.pp} x DP {i.dp} x TP {i.tp}, {i.optimizer}, strategy {i.strategy}, "
           f"TP schedule {i.tp_schedule}", head, "-" * len(head)]
    for k, p in enumerate(staged.stages):
        m, d = p.metrics, p.metrics.details
        out.append(f"{k:<7}{len(p.params):>7}{d['n_buckets']:>8}{d['n_micro_groups']:>7}{m.dp_flops_ratio:>9.3f}"
                   f"{m.dp_memory_ratio:>8.3f}{m.tp_flops_ratio:>9.3f}{m.tp_memory_ratio:>8.3f}")
    w = {k: staged.worst(k) for k in ("dp_flops_ratio", "dp_memory_ratio", "tp_flops_ratio", "tp_memory_ratio")}
    out.append(f"{'worst':<7}{'':>7}{'':>8}{'':>7}" + "".join(
        f"{v:>{n}.3f}" for (_, v), n in zip(w.values(), (9, 8, 9, 8))))
    out.append("worst stage: " + ", ".join(f"{k} stage {s}" for k, (s, _) in w.items()))
    return "\n".join(out)


def format_authors(plans: list[AuthorsPlan], model: str) -> str:
    """The paper convention's view of a plan (``canzona plan --convention paper``), per stage."""
    p0 = plans[0]
    out = [f"{model}, PP {len(plans)} x DP {p0.dp} x TP {p0.tp}, {p0.optimizer}: paper convention ({PAPER.description})"]
    keys = ("dp_flops_ratio", "dp_memory_ratio", "tp_flops_ratio_dp_rank0", "tp_memory_ratio_dp_rank0",
            "tp_flops_ratio_per_rank_max", "tp_flops_ratio_all_gpus_full", "tp_flops_lower_bound_full")
    for k, p in enumerate(plans):
        s = p.summary()
        out.append(f"stage {k}: {len(p.params)} matrices, {s['n_buckets']} buckets, Algorithm 1 kept: {s['kept_balanced']}, "
                   f"DP rank 0 micro-groups: {s['micro_groups_dp_rank0']}")
        out += [f"  {key:<32}{s[key]:.3f}" for key in keys]
    return "\n".join(out)


def format_plan(plan: Plan, notes: list[str] = ()) -> str:  # type: ignore[assignment]
    """The readable summary ``canzona plan`` prints."""
    i, m, d = plan.inputs, plan.metrics, plan.metrics.details
    lines = [
        f"{i.model} ({i.layout} layout), DP {i.dp} x TP {i.tp}, {i.optimizer}, strategy {i.strategy}, TP schedule {i.tp_schedule}",
        f"cost {i.cost}, FLOPs on {i.flops_shape} shapes, alpha {i.alpha:g}, buckets of >= {i.bucket_numel:,} elements, "
        f"C_max {cmax_from_bytes(i.cmax_bytes, i.tp, i.grad_bytes):g} x 2^20 TP-local elements per host "
        f"({i.cmax_bytes / 2**20:g} MiB of gathered gradient)",
        "",
        f"  {'buckets':<24}{d['n_buckets']}",
        f"  {'micro-groups':<24}{d['n_micro_groups']} (at most {d['max_micro_groups_per_rank']} per DP rank)",
        *([f"  {'experts':<24}{ex}"] if (ex := expert_tp_summary(plan.params, i.tp)) else []),
        f"  {'DP FLOPs ratio':<24}{m.dp_flops_ratio:.3f}",
        f"  {'DP memory ratio':<24}{m.dp_memory_ratio:.3f}   (numel ratio {d['dp_numel_ratio']:.3f})",
        f"  {'TP FLOPs ratio':<24}{m.tp_flops_ratio:.3f}   (worst DP rank's TP group"
        + (f"; that DP rank's own floor {worst_tp_group_bound(plan):.3f} = its largest task / its host mean)"
           if i.flops_shape == "full" and d.get("n_micro_groups") else ")"),
        f"  {'TP memory ratio':<24}{m.tp_memory_ratio:.3f}",
        *([f"  {'TP FLOPs, all GPUs':<24}{d['tp_flops_ratio_global']:.3f}   (over all {i.dp * i.tp} GPUs; atomic lower bound "
           f"{lower_bound(plan.specs, i.dp, i.tp, i.optimizer):.3f} = largest full-shape task / mean)"]
          if "tp_flops_ratio_global" in d and i.flops_shape == "full" else []),
        *([f"  {'TP state, all GPUs':<24}{d['tp_memory_ratio_global']:.3f}   (optimizer state max / mean over all {i.dp * i.tp} GPUs)"]
          if "tp_memory_ratio_global" in d else []),
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


def run(args: argparse.Namespace) -> int:
    if args.list_strategies:
        print("\n".join(strategy_names()))
        return 0
    if args.model is None:
        raise UserError("--model is required (a shipped model name or a config JSON path)")
    if args.fsdp is not None:
        return _run_fsdp(args, output_path(args.json, "--json") if args.json is not None else None)
    _check_zero1_args(args)
    if args.ep is not None:
        from canzona.plan.ep import run_plan_ep

        return run_plan_ep(args)
    json_path = output_path(args.json, "--json") if args.json is not None else None
    if (args.pp > 1 and json_path is not None) or ((args.pp > 1 or args.convention == "paper") and args.compare):
        raise UserError("--json and --compare describe one canzona plan; drop --compare with --convention paper, both with --pp > 1")
    if args.convention == "paper":
        return _run_paper_convention(args, json_path)
    if args.pp > 1:
        return _run_stages(args)
    if args.compare:
        return _run_compare(args, json_path)
    plan, notes = _plan(args, args.strategy, args.tp_schedule)
    if json_path is not None:
        try:
            write_output(json_path, plan.to_json() + "\n")
        except UserError:
            print(format_plan(plan, notes))  # the plan is computed: show it, then fail
            raise
        notes.append(f"plan document written to {json_path}")
    print(format_plan(plan, notes))
    return 0


def _check_zero1_args(args: argparse.Namespace) -> None:
    """The ZeRO-1 planner's flags, each refused in one line (``--layout`` defaults to megatron)."""
    if args.strategy not in strategy_names():
        raise UserError(f"strategy {args.strategy!r} runs on FSDP2 only (--fsdp); choose one of {', '.join(strategy_names())}")
    args.layout = args.layout or "megatron"
    if args.dp is None:
        raise UserError("--dp is required")
    if args.dp < 1:
        raise UserError(f"--dp must be >= 1, got {args.dp}")
    if args.tp < 1:
        raise UserError(f"--tp must be >= 1, got {args.tp}")
    # the TP degrees `canzona train` refuses (heads, KV heads, MLP rows, vocabulary must divide)
    check_tp_degree(resolve_model(args.model), args.tp)
    if not 0.0 <= args.alpha <= 1.0:
        raise UserError(f"--alpha must be in [0, 1], got {args.alpha}")
    if args.bucket_numel is not None and args.bucket_numel < 1:
        raise UserError(f"--bucket-numel must be >= 1, got {args.bucket_numel}")
    if args.pp < 1:
        raise UserError(f"--pp must be >= 1, got {args.pp}")


def _run_paper_convention(args: argparse.Namespace, json_path: Path | None) -> int:
    """``--convention paper``: the authors' plan per pipeline stage; with ``--json``, the runnable
    plan under the same conventions."""
    cfg = resolve_model(args.model)
    specs = specs_from_config(cfg, tp=args.tp, layout=args.layout)
    stages = split_stages(specs, args.pp, cfg.num_hidden_layers)
    plans = [authors_plan(s, dp=args.dp, tp=args.tp, optimizer=args.optimizer, alpha=args.alpha,
                          cost="flops" if args.cost == "flops" else "numel") for s in stages]
    print(format_authors(plans, cfg.name))
    if json_path is not None:
        # the same conventions as a plan canzona's runtime executes (split buffers, the authors'
        # buckets and C_max, Megatron-Core order)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runnable = convention_plan(cfg, dp=args.dp, tp=args.tp, layout=args.layout, optimizer=args.optimizer,
                                       strategy=args.strategy, alpha=args.alpha, cost=args.cost, grad_bytes=args.grad_bytes)
        try:
            runnable.to_json(json_path)
        except OSError as exc:
            raise UserError(f"cannot write --json {args.json}: {exc.strerror or exc}") from None
        print(f"note: runnable plan under the paper convention written to {json_path} (fingerprint {runnable.fingerprint})")
    return 0


def _run_stages(args: argparse.Namespace) -> int:
    """``--pp > 1``: one plan per pipeline stage."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        staged = plan_stages(args.model, pp=args.pp, dp=args.dp, tp=args.tp, layout=args.layout,
                             optimizer=args.optimizer, strategy=args.strategy, alpha=args.alpha, cost=args.cost,
                             flops_shape=args.flops_shape, cmax_bytes=_cmax_bytes(args),
                             bucket_numel=args.bucket_numel, tp_schedule=args.tp_schedule, grad_bytes=args.grad_bytes,
                             buffers=args.buffers)
    print(format_stages(staged))
    return 0


def _run_compare(args: argparse.Namespace, json_path: Path | None) -> int:
    """``--compare``: every ZeRO-1 strategy side by side, each with its TP schedule."""
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


# ------------------------------------------------------------------------------------ --fsdp
def check_fsdp_ranks(fsdp: int, dp_replicate: int, tp: int) -> None:
    """The planner's bounds, with the flags' names: ``dp_replicate x fsdp`` data-parallel ranks at
    most :data:`~canzona.plan.build.MAX_DP`, ``tp`` at most :data:`~canzona.plan.build.MAX_TP` (a
    larger figure is a typo, and planning it would take minutes and gigabytes)."""
    from canzona.plan.build import MAX_DP, MAX_TP

    for flag, v in (("--fsdp", fsdp), ("--dp-replicate", dp_replicate), ("--tp", tp)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1, got {v}")
    if fsdp * dp_replicate > MAX_DP:
        raise UserError(f"--dp-replicate x --fsdp = {dp_replicate} x {fsdp} data-parallel ranks, above canzona's bound {MAX_DP}")
    if tp > MAX_TP:
        raise UserError(f"--tp {tp} is above canzona's bound {MAX_TP}")


def format_fsdp_plan(plan: Plan, notes: list[str] = ()) -> str:  # type: ignore[assignment]
    """The readable summary ``canzona plan --fsdp`` prints."""
    i, m, d = plan.inputs, plan.metrics, plan.metrics.details
    gib = 2**30
    experts = f", {d['n_expert_tasks']} expert tasks on the ranks that hold them" if d["n_expert_tasks"] else ""
    lines = [
        f"{i.model}, FSDP2: dp_replicate {i.dp_replicate} x dp_shard {i.dp_shard} x tp {i.tp} = {i.world} ranks, "
        f"{i.optimizer}, strategy {i.strategy} (schedule {i.tp_schedule})",
        f"cost {i.cost}, C_max {cmax_from_bytes(i.cmax_bytes, i.tp, i.grad_bytes):g} x 2^20 TP-local elements per host "
        f"({i.cmax_bytes / 2**20:g} MiB); shard group of {i.group_size} ranks"
        + (f", {i.dp_replicate} replicas run the same step" if i.dp_replicate > 1 else ""),
        "",
        f"  {'matrix tasks':<26}{d['n_matrix_tasks']} in {d['n_micro_groups']} micro-groups{experts}",
        f"  {'optimizer FLOPs / rank':<26}max {d['flops_max']:.4g}, mean {d['flops_mean']:.4g}",
        f"  {'FLOPs ratio (max/mean)':<26}{d['flops_ratio']:.3f}   (atomic bound {d['flops_bound']:.3f})",
        f"  {'state bytes / rank':<26}max {d['memory_max'] / gib:.3f} GiB, mean {d['memory_mean'] / gib:.3f} GiB",
        f"  {'memory ratio (max/mean)':<26}{d['memory_ratio']:.3f}   (atomic bound {d['memory_bound']:.3f})",
        f"  {'plan time':<26}{m.plan_seconds * 1e3:.1f} ms",
        f"  {'fingerprint':<26}{plan.fingerprint}",
    ]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _run_fsdp(args: argparse.Namespace, json_path: object = None) -> int:
    """The ``--fsdp`` branch of ``canzona plan`` (an FSDP2 plan)."""
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
