"""``canzona simulate --fsdp N``: predicted FSDP2 optimizer step per strategy at cluster scale.

Example::

    canzona simulate --model qwen3-32b --fsdp 32 --tp 8 --hardware h800-ib400

Plans every FSDP2 strategy (:mod:`canzona.plan.fsdp`) for ``dp_replicate x fsdp x tp`` ranks and
predicts its optimizer step with :func:`canzona.sim.fsdp.simulate_fsdp`: slowest rank, mean and
imbalance, host compute, exchange time. Forward/backward is FSDP2's and not modelled here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from canzona.errors import UserError
from canzona.commands._args import write_output
from canzona.commands.plan_fsdp import check_fsdp_ranks
from canzona.plan.build import cmax_to_bytes

__all__ = ["run_fsdp_sim"]


def run_fsdp_sim(args: argparse.Namespace, setup: Any, hw: Any, default_strategies: str) -> int:
    """The ``--fsdp`` branch of ``canzona simulate`` (setup and hardware parsed by the caller)."""
    from canzona.plan.fsdp import FSDP_STRATEGIES, plan_fsdp_model
    from canzona.sim.fsdp import simulate_fsdp

    check_fsdp_ranks(args.fsdp, args.dp_replicate, args.tp)
    if args.paper or args.sweep_dp is not None or args.sweep_alpha is not None:
        raise UserError("--paper, --sweep-dp and --sweep-alpha simulate canzona's ZeRO-1 path; drop them with --fsdp")
    if args.strategies == default_strategies:
        strategies = list(FSDP_STRATEGIES)
    else:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in FSDP_STRATEGIES]
    if bad or not strategies:
        raise UserError(f"unknown FSDP2 strategy {', '.join(bad) or '(none)'}; choose from {', '.join(FSDP_STRATEGIES)}")
    if args.tp_overlap is None:
        setup = dataclasses.replace(setup, tp_overlap="pipelined")  # what the runtime does
    cmax = {} if args.cmax is None else {"cmax_bytes": cmax_to_bytes(args.cmax, args.tp)}
    rows = []
    for s in strategies:
        plan = plan_fsdp_model(
            args.model, dp_shard=args.fsdp, tp=args.tp, dp_replicate=args.dp_replicate, optimizer=args.optimizer,
            strategy=s, cost="flops", **cmax,
        )
        rows.append((plan, simulate_fsdp(plan, hw, setup)))
    i = rows[0][0].inputs
    print(
        f"{i.model}, FSDP2 dp_replicate {i.dp_replicate} x dp_shard {i.dp_shard} x tp {i.tp} = {i.world} GPUs, {i.optimizer}, "
        f"hardware {hw.name}, shard group of {i.group_size} on {rows[0][1].link}, overlap {setup.tp_overlap}"
    )
    head = f"{'strategy':<10}{'step s':>9}{'mean s':>9}{'max/mean':>9}{'host s':>9}{'exchange s':>11}{'groups':>7}{'FLOPs ratio':>12}{'bound':>7}"
    print(head)
    print("-" * len(head))
    base = next((r for p, r in rows if p.inputs.strategy == "lb-asc"), None)
    for plan, r in rows:
        m = plan.metrics
        print(
            f"{r.strategy:<10}{r.optimizer_s:>9.4f}{r.rank_mean_s:>9.4f}{r.rank_imbalance:>9.3f}{r.host_compute_max_s:>9.4f}"
            f"{r.exchange_s:>11.4f}{r.n_micro_groups:>7}{m['flops_ratio']:>12.3f}{m['flops_bound']:>7.3f}"
        )
    if base is not None:
        print("step relative to lb-asc: " + ", ".join(f"{r.strategy} {r.optimizer_s / base.optimizer_s:.2f}x" for _, r in rows))
    if args.json:
        doc: dict[str, Any] = {"schema": "canzona.fsdp_simulation", "version": 1, "hardware": hw.name,
                               "results": {r.strategy: r.summary() for _, r in rows}}
        write_output(args.json, json.dumps(doc, indent=1) + "\n")  # atomic, names the path on failure
        print(f"note: results written to {args.json}")
    return 0
