"""``canzona simulate``: predict one training iteration per strategy at cluster scale.

    canzona simulate --model qwen3-32b --dp 32 --tp 8 --optimizer muon --hardware h800-ib400

prints fwd-bwd / optimizer / iteration per strategy with their breakdown; on the paper's
configuration it also prints the paper's Figure 4 beside the predictions, the ratios, and which
assumption dominates each ratio's error. ``--json PATH`` writes everything (inputs, the hardware
profile with sources, setup with sources, per-strategy results, comparison, sweeps).

    canzona simulate --model qwen3-32b --fsdp 32 --tp 8 --hardware h800-ib400

predicts the FSDP2 optimizer step instead: every FSDP2 strategy planned for ``dp_replicate x fsdp x
tp`` ranks (:func:`canzona.plan.plan_fsdp_model`), its step predicted by
:func:`canzona.sim.shard.simulate_fsdp` (slowest rank, mean and imbalance, host compute, exchange
time) next to the plan's FLOPs max/mean and atomic bound. Forward/backward is FSDP2's and not
modelled there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import fields
from typing import Any

from canzona.errors import UserError
from canzona.commands._args import add_cmax_argument, file_path, output_path, positive_float, write_output
from canzona.plan.build import DEFAULT_CMAX, cmax_to_bytes
from canzona.config import check_tp_degree
from canzona.paper import paper_value
from canzona.plan.strategies import get_strategy

__all__ = ["add_arguments", "run"]

#: the fwd-bwd time ``--fit-fwd-bwd`` fits to: the paper's lb-asc, Figure 4
_FIT_TARGET_S = paper_value("fwd_bwd_s_lb-asc").value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from canzona.commands.plan import one_line_errors
    from canzona.sim.model import SIM_STRATEGIES, TP_OVERLAPS, VARSIZE_MODELS

    one_line_errors(parser)
    g = parser.add_argument_group("configuration")
    g.add_argument("--model", default="qwen3-32b", help="shipped model name, config path, or qwen3-moe-1t (default: qwen3-32b)")
    g.add_argument("--dp", type=int, default=32, help="data-parallel size (default 32)")
    g.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
    g.add_argument("--fsdp", type=int, default=None, help="simulate FSDP2 instead: dp_shard size (ranks per replica = fsdp x tp)")
    g.add_argument("--dp-replicate", type=int, default=1, help="with --fsdp: HSDP replicas (default 1)")
    g.add_argument("--ep", type=int, default=None,
                   help="also predict the optimizer step with expert parallelism over EP ranks taken from --dp (MoE models)")
    g.add_argument("--optimizer", default="muon", help="matrix optimizer: muon, shampoo, soap (zero1 always runs AdamW)")
    g.add_argument("--hardware", default="h800-ib400", help="profile name in canzona/data/hardware or a profile JSON path (default h800-ib400)")
    g.add_argument("--strategies", default=",".join(SIM_STRATEGIES), help=f"comma list of registered strategies (default {','.join(SIM_STRATEGIES)})")
    g.add_argument("--alpha", type=float, default=1.0, help="Algorithm 1 balance factor for lb-asc (default 1.0)")
    g.add_argument("--lb-tp-schedule", default=None,
                   help="TP schedule for lb-asc (default: the planner's, lpt-carry); 'lpt' is Algorithm 2 as written")
    add_cmax_argument(g, None, default_text=f"the planner's {DEFAULT_CMAX:g}")
    g.add_argument("--bucket-numel", type=int, default=None, help="ZeRO-1 bucket size in elements (default: Megatron's max(40M, 1M x dp))")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B; each stage planned on its own; default 1)")
    g.add_argument("--microbatches", type=int, default=None, help="micro-batches per iteration with --pp (default: grad-accum if > 1, else pp)")
    g.add_argument("--experts", choices=("stacked", "separate"), default="stacked",
                   help="a MoE model's experts: (E, M, N) stacks of E tasks, replicated over TP (default, what canzona "
                        "runs), or 'separate' TP-split 2-D matrices per expert")

    from dataclasses import fields

    from canzona.sim.model import Setup

    d = {f.name: f.default for f in fields(Setup)}
    s = parser.add_argument_group("training setup (named assumptions)")
    s.add_argument("--seq-len", type=int, default=None, help=f"tokens per sequence (default: {d['seq_len']})")
    s.add_argument("--micro-batch", type=int, default=None, help=f"sequences per micro-batch per DP rank (default: {d['micro_batch']})")
    s.add_argument("--grad-accum", type=int, default=None, help=f"micro-batches accumulated per optimizer step (default: {d['grad_accum']})")
    s.add_argument("--recompute", choices=("none", "full"), default=None,
                   help=f"activation recomputation in the backward: none or full (default: {d['recompute']})")
    s.add_argument("--grad-bytes", type=int, default=None,
                   help=f"bytes per gradient element in DP collectives (Megatron bf16: 4; default: {d['grad_bytes']})")
    s.add_argument("--ns-dtype", choices=("bf16", "tf32", "fp32"), default=None,
                   help=f"precision of the optimizer's matrix products (default: {d['ns_dtype']})")
    s.add_argument("--tp-overlap", choices=TP_OVERLAPS, default=None,
                   help=f"how TP micro-group exchanges overlap host compute (default: {d['tp_overlap']})")
    s.add_argument("--varsize", choices=VARSIZE_MODELS, default=None,
                   help=f"model of variable-size reduce-scatter / all-gather (default: {d['varsize_collective']})")

    h = parser.add_argument_group("hardware constants")
    h.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="override one profile constant (repeatable)")
    h.add_argument("--calibration", default=None, metavar="CSV", help="fit optimizer matmul efficiency to measured timings (optimizer,m,n,dtype,seconds)")
    h.add_argument("--fit-fwd-bwd", action="store_true",
                   help=f"fit fwd_bwd_mfu to the paper's lb-asc fwd-bwd {_FIT_TARGET_S:g} s (paper configuration only)")

    o = parser.add_argument_group("output")
    o.add_argument("--paper", action="store_true", help="require the paper configuration and print the Figure 4 comparison")
    o.add_argument("--no-sensitivity", action="store_true", help="skip the assumption sensitivities of the paper comparison")
    o.add_argument("--sweep-dp", default=None, metavar="LIST", help="also simulate these DP sizes, e.g. 32,64,128,256,512,1024")
    o.add_argument("--sweep-alpha", default=None, metavar="LIST", help="also sweep lb-asc's alpha, e.g. 0,0.25,0.5,0.75,1")
    o.add_argument("--json", type=file_path, default=None, metavar="PATH", help="write all results as JSON")


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"{what} must list integers >= 1, got {text!r}")
    return vals


def _float_list(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of numbers, got {text!r}") from None
    if not vals or any(not 0.0 <= v <= 1.0 for v in vals):
        raise ValueError(f"{what} must list numbers in [0, 1], got {text!r}")
    return vals


def _setup(args: argparse.Namespace):
    from canzona.sim.model import Setup

    changes = {
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum,
        "recompute": args.recompute,
        "grad_bytes": args.grad_bytes,
        "ns_dtype": args.ns_dtype,
        "tp_overlap": args.tp_overlap,
        "varsize_collective": args.varsize,
    }
    return Setup(**{k: v for k, v in changes.items() if v is not None})


def _hardware(args: argparse.Namespace):
    from canzona.sim.hardware import calibrate, load_hardware

    hw = load_hardware(args.hardware)
    over: dict[str, float] = {}
    for item in args.set:
        name, sep, val = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects NAME=VALUE, got {item!r}")
        try:
            v = float(val)
        except ValueError:
            raise ValueError(f"--set {name}: {val!r} is not a number") from None
        if not math.isfinite(v):
            raise ValueError(f"--set {name}: value must be finite")
        over[name.strip()] = v
    if over:
        hw = hw.with_values(**over)
    if args.calibration:
        hw = calibrate(hw, args.calibration)
    return hw


def _fmt(x: float) -> str:
    return f"{x:8.3f}"


def _print_results(cfg, args, hw, setup, results) -> None:
    gpus = args.dp * args.tp
    print(f"canzona simulate: {cfg.name}, DP{args.dp} x TP{args.tp} = {gpus} GPUs, {args.optimizer}, hardware {hw.name}")
    print(
        f"setup: seq {setup.seq_len} x micro-batch {setup.micro_batch} x grad-accum {setup.grad_accum} tokens per DP rank, "
        f"recompute {setup.recompute}, grads {setup.grad_bytes} B, Newton-Schulz {setup.ns_dtype}, "
        f"TP overlap {setup.tp_overlap}, variable-size collectives {setup.varsize_collective}, fwd-bwd MFU {hw.fwd_bwd_mfu.value:.3f}"
    )
    print()
    head = (
        f"{'strategy':<10} {'fwd_bwd':>8} {'optim':>8} {'iter':>8} | {'fwd':>7} {'bwd':>7} {'tp-act':>7} {'grad':>7} {'g-exp':>7} "
        f"{'param':>7} {'p-exp':>7} | {'ew':>7} {'matrix':>7} {'tp-comm':>7} {'dp-comm':>7} {'R_max/avg':>9} {'mem GB':>7}"
    )
    print(head)
    print("-" * len(head))
    for s, b in results.items():
        mem = f"{b.memory_gb:7.1f}" + ("" if b.memory_fits else "!")
        print(
            f"{s:<10} {_fmt(b.fwd_bwd_s)} {_fmt(b.optimizer_s)} {_fmt(b.iteration_s)} | "
            f"{b.fwd_compute_s:7.3f} {b.bwd_compute_s:7.3f} {b.tp_activation_comm_s:7.3f} {b.dp_grad_comm_s:7.3f} {b.dp_grad_exposed_s:7.3f} "
            f"{b.dp_param_comm_s:7.3f} {b.dp_param_exposed_s:7.3f} | {b.opt_elementwise_s:7.3f} {b.opt_matrix_compute_s:7.3f} "
            f"{b.opt_tp_comm_s:7.3f} {b.opt_dp_comm_s:7.3f} {b.opt_rank_imbalance:9.2f} {mem}"
        )
    print(
        "seconds; grad/param = DP reduce-scatter (all-reduce) / all-gather busy time, g-exp/p-exp = the part the bucket "
        "pipeline exposes; optimizer columns are the critical DP rank's; '!' = model state exceeds "
        f"{hw.hbm_gb.value:g} GB HBM (activations not counted). zero1 runs AdamW (the reference)."
    )


def _print_paper(pc, variants) -> None:
    from canzona.sim.analysis import PAPER_RATIOS

    print()
    print("Paper Figure 4 (Qwen3-32B, Muon, DP32 x TP8 = 256 GPUs): NV-layerwise vs Canzona lb-asc")
    fit = f"fitted to the paper's lb-asc fwd-bwd {_FIT_TARGET_S:g} s" if pc.fitted else "from the hardware profile (not fitted)"
    print(f"fwd-bwd MFU {pc.hardware.fwd_bwd_mfu.value:.3f} {fit}; lb-asc TP schedule {pc.lb_schedule}")
    hdr = f"{'phase':<12} {'paper lw':>9} {'pred lw':>9} {'paper lb':>9} {'pred lb':>9} {'paper x':>8} {'pred x':>8} {'error':>7}"
    print(hdr)
    print("-" * len(hdr))
    from canzona.sim.analysis import PAPER_FIGURE4

    for phase, label in (("optimizer_s", "optimizer"), ("fwd_bwd_s", "fwd-bwd"), ("iteration_s", "iteration")):
        print(
            f"{label:<12} {PAPER_FIGURE4['layerwise'][phase]:9.3f} {getattr(pc.predicted['layerwise'], phase):9.3f} "
            f"{PAPER_FIGURE4['lb-asc'][phase]:9.3f} {getattr(pc.predicted['lb-asc'], phase):9.3f} "
            f"{PAPER_RATIOS[phase]:7.2f}x {pc.ratios[phase]:7.2f}x {pc.ratio_error(phase):+7.0%}"
        )
    if pc.sensitivities:
        print("which assumption dominates each ratio (the one change that moves it most; constants lowered 20%, choices switched):")
        for phase, label in (("optimizer_s", "optimizer"), ("fwd_bwd_s", "fwd-bwd"), ("iteration_s", "iteration")):
            d = pc.dominant(phase)
            cont = [s for s in pc.sensitivities if s.change.startswith("-20%")]
            dc = max(cont, key=lambda s: abs(math.log(s.ratios[phase] / pc.ratios[phase])))
            print(
                f"  {label:<10} {d.name} ({d.change}) -> {d.ratios[phase]:.2f}x; "
                f"largest constant: {dc.name} ({dc.change}) -> {dc.ratios[phase]:.2f}x"
            )
    if variants:
        print("variants (the two choices that move the ratios most without touching the model): ratios optimizer / fwd-bwd / iteration")
        for label, v in variants:
            r = v.ratios
            print(
                f"  {label:<64} {r['optimizer_s']:5.2f}x {r['fwd_bwd_s']:5.2f}x {r['iteration_s']:5.2f}x   "
                f"errors {v.ratio_error('optimizer_s'):+.0%} {v.ratio_error('fwd_bwd_s'):+.0%} {v.ratio_error('iteration_s'):+.0%}"
            )


def _print_assumptions(hw, setup) -> None:
    from canzona.sim.model import SETUP_SOURCES

    print()
    assumed = [(k, c) for k, c in hw.constants().items() if c.assumed]
    print("assumptions (named; full sources in --json and canzona/data/hardware/" + hw.name + ".json):")
    for k, c in assumed:
        print(f"  hardware.{k} = {c.value:g}")
    for f in fields(setup):
        src = SETUP_SOURCES[f.name]
        tag = "assumption" if src.startswith("assumption") else "sourced"
        if tag == "assumption":
            print(f"  setup.{f.name} = {getattr(setup, f.name)}")
    fitted = [k for k, c in hw.constants().items() if c.source.startswith(("fitted", "override"))]
    if fitted:
        print("  fitted / overridden: " + ", ".join(f"{k} = {hw.constants()[k].value:.4g} ({hw.constants()[k].source})" for k in fitted))


def _strategies(args: argparse.Namespace) -> list[str]:
    """Check the numeric options and parse ``--strategies`` (ValueError naming the bad value)."""
    from canzona.optimizers import optimizer_names
    from canzona.plan.strategies import strategy_names

    if args.dp < 1 or args.tp < 1:
        raise ValueError("--dp and --tp must be >= 1")
    if args.optimizer not in optimizer_names(matrix=True):
        raise ValueError(f"--optimizer must be a matrix optimizer: {', '.join(optimizer_names(matrix=True))}")
    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"--alpha must be in [0, 1], got {args.alpha}")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in strategy_names()]
    if bad or not strategies:
        raise ValueError(f"unknown strategy {', '.join(bad) or '(none)'}; choose from {', '.join(strategy_names())}")
    return strategies


def _plan_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Planner overrides shared by every strategy (C_max, bucket size)."""
    plan_kw: dict[str, Any] = {}
    if args.cmax is not None:
        if not args.cmax > 0:
            raise ValueError("--cmax must be > 0")
        plan_kw["cmax_bytes"] = cmax_to_bytes(args.cmax, args.tp)  # the plan counts fp32 gradient (grad_bytes 4)
    if args.bucket_numel is not None:
        plan_kw["bucket_numel"] = args.bucket_numel
    if args.experts != "stacked":
        plan_kw["experts"] = args.experts
    return plan_kw


def _paper(args: argparse.Namespace, hw: Any, setup: Any) -> tuple[Any, list[tuple[str, Any]]]:
    """The Figure 4 comparison and, unless ``--no-sensitivity``, its variants (lb-asc host
    schedule x fitted or profiled fwd-bwd MFU)."""
    from canzona.sim.analysis import paper_comparison

    pc = paper_comparison(hw, setup, lb_schedule=args.lb_tp_schedule, fit_fwd_bwd=args.fit_fwd_bwd, sensitivity=not args.no_sensitivity)
    variants = []
    if not args.no_sensitivity:
        for sched in ("lpt", "lpt-carry"):
            for fit in (False, True):
                label = f"lb-asc hosts {sched}, fwd-bwd MFU " + (f"fitted to {_FIT_TARGET_S:g} s" if fit else "from profile")
                if sched == pc.lb_schedule and fit == pc.fitted:
                    variants.append((label + "  <- table above", pc))
                else:
                    variants.append((label, paper_comparison(hw, setup, lb_schedule=sched, fit_fwd_bwd=fit, sensitivity=False)))
    return pc, variants


def _simulate_strategies(args: argparse.Namespace, cfg: Any, hw: Any, setup: Any, strategies: list[str], plan_kw: dict[str, Any]) -> dict[str, Any]:
    from canzona.sim.model import plan_for, simulate_plan

    results = {}
    for s in strategies:
        kw = dict(plan_kw)
        tuned = get_strategy(s).uses_alpha  # --alpha and --lb-tp-schedule tune the alpha-balanced strategy
        if tuned and args.lb_tp_schedule:
            kw["tp_schedule"] = args.lb_tp_schedule
        alpha = args.alpha if tuned else 1.0
        results[s] = simulate_plan(plan_for(cfg, s, dp=args.dp, tp=args.tp, optimizer=args.optimizer, alpha=alpha, **kw), cfg, hw, setup)
    return results


def _dp_sweep(args: argparse.Namespace, cfg: Any, hw: Any, setup: Any, strategies: list[str], plan_kw: dict[str, Any], sweep_dp: list[int]) -> list[dict]:
    """Print iteration / optimizer seconds per (DP size, strategy); return the rows."""
    from canzona.sim.analysis import dp_sweep

    frame = dp_sweep(cfg, sweep_dp, tp=args.tp, optimizer=args.optimizer, hardware=hw, setup=setup, strategies=strategies, alpha=args.alpha, lb_tp_schedule=args.lb_tp_schedule, **plan_kw)
    print()
    print(f"DP sweep (TP{args.tp}): iteration / optimizer seconds per strategy")
    piv = frame.pivot(index="dp", columns="strategy", values="iteration_s")
    opt = frame.pivot(index="dp", columns="strategy", values="optimizer_s")
    print(f"{'dp':>6} " + " ".join(f"{s:>18}" for s in strategies))
    for dp in sweep_dp:
        print(f"{dp:>6} " + " ".join(f"{piv.loc[dp, s]:8.3f} / {opt.loc[dp, s]:7.3f}" for s in strategies))
    return frame.to_dict(orient="records")


def _alpha_sweep(args: argparse.Namespace, cfg: Any, hw: Any, setup: Any, plan_kw: dict[str, Any], dps: list[int], sweep_alpha: list[float]) -> dict[str, Any]:
    """Print, per DP size, whether alpha = 1's communication imbalance hides under the overlap
    window and which alpha is best; return the report and rows per DP size."""
    from canzona.sim.analysis import alpha_report, alpha_sweep

    out: dict[str, Any] = {}
    print()
    print("alpha sweep (lb-asc): does alpha = 1's communication imbalance still hide under the overlap window?")
    print(f"{'dp':>6} {'exposed DP comm: zero1':>23} {'alpha=1':>8} {'extra':>8} {'hidden':>7} {'best alpha':>10} {'iteration':>10}")
    for dp in dps:
        kw = dict(plan_kw)
        if args.lb_tp_schedule:
            kw["tp_schedule"] = args.lb_tp_schedule
        a = sorted(set(sweep_alpha) | {1.0})
        frame = alpha_sweep(cfg, a, dp=dp, tp=args.tp, optimizer=args.optimizer, hardware=hw, setup=setup, **kw)
        rep = alpha_report(frame)
        print(
            f"{dp:>6} {rep['zero1_exposed_dp_comm_s']:23.3f} {rep['alpha1_exposed_dp_comm_s']:8.3f} "
            f"{rep['alpha1_imbalance_exposed_s']:8.3f} {str(rep['alpha1_imbalance_hidden']):>7} {rep['recommended_alpha']:10.2f} "
            f"{rep['iteration_at_recommended_s']:10.3f}"
        )
        out[str(dp)] = {"report": rep, "rows": frame.to_dict(orient="records")}
    return out


def _run_pipeline(cfg, args, hw, setup, strategies, plan_kw) -> int:
    """``--pp N``: every strategy planned per stage and simulated under 1F1B."""
    import warnings

    from canzona.optimizers import ELEMENTWISE_DEFAULT
    from canzona.plan.pipeline import plan_stages
    from canzona.plan.strategies import get_strategy
    from canzona.sim.model import simulate_pipeline

    out = {}
    for st in strategies:
        kw = dict(plan_kw)
        tuned = get_strategy(st).uses_alpha  # --alpha and --lb-tp-schedule tune the alpha-balanced strategy
        if tuned and args.lb_tp_schedule:
            kw["tp_schedule"] = args.lb_tp_schedule
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            staged = plan_stages(cfg, pp=args.pp, dp=args.dp, tp=args.tp, strategy=st,
                                 optimizer=ELEMENTWISE_DEFAULT if get_strategy(st).elementwise_only else args.optimizer,
                                 alpha=args.alpha if tuned else 1.0, **kw)
        out[st] = simulate_pipeline(staged.stages, cfg, hw, setup, microbatches=args.microbatches)
    m = next(iter(out.values())).microbatches
    print(f"canzona simulate: {cfg.name}, PP{args.pp} x DP{args.dp} x TP{args.tp} = {args.pp * args.dp * args.tp} GPUs, "
          f"{args.optimizer}, hardware {hw.name}, 1F1B with {m} micro-batches, TP overlap {setup.tp_overlap}")
    head = f"{'strategy':<10} {'fwd_bwd':>8} {'optim':>8} {'iter':>8} {'bubble':>8} {'p2p':>8} {'slowest stage':>14}"
    print(head)
    print("-" * len(head))
    for st, r in out.items():
        print(f"{st:<10} {_fmt(r.fwd_bwd_s)} {_fmt(r.optimizer_s)} {_fmt(r.iteration_s)} {_fmt(r.bubble_s)} "
              f"{r.p2p_s * 1e3:6.2f}ms {r.critical_stage:>14}")
    print("seconds; optim = the slowest stage's optimizer step (stages step in parallel); bubble = 1F1B fill and drain")
    if args.json:
        doc = {"inputs": {"model": cfg.name, "pp": args.pp, "dp": args.dp, "tp": args.tp, "optimizer": args.optimizer, **plan_kw},
               "hardware": hw.to_dict(), "strategies": {st: r.summary() for st, r in out.items()}}
        write_output(args.json, json.dumps(doc, indent=1) + "\n")
    return 0


def run(args: argparse.Namespace) -> int:
    from canzona.sim.analysis import PAPER_CONFIG, resolve_sim_model

    if args.json:
        output_path(args.json, "--json")  # before the work: an unwritable output fails at once
    if args.fsdp is not None:
        from canzona.sim.model import SIM_STRATEGIES

        return _run_fsdp(args, _setup(args), _hardware(args), ",".join(SIM_STRATEGIES))
    if args.ep is not None:
        from canzona.sim.ep import run_simulate_ep

        check_tp_degree(resolve_sim_model(args.model), args.tp)
        return run_simulate_ep(args, _setup(args), _hardware(args), _plan_kwargs(args))
    strategies = _strategies(args)
    sweep_dp = _int_list(args.sweep_dp, "--sweep-dp") if args.sweep_dp is not None else None
    sweep_alpha = _float_list(args.sweep_alpha, "--sweep-alpha") if args.sweep_alpha is not None else None
    setup = _setup(args)
    hw = _hardware(args)
    cfg = resolve_sim_model(args.model)
    check_tp_degree(cfg, args.tp)  # a TP degree the model cannot run, as `canzona train` refuses
    plan_kw = _plan_kwargs(args)
    if args.pp != 1 or args.microbatches is not None:
        if args.pp < 1 or (args.microbatches is not None and args.microbatches < 1):
            raise ValueError("--pp and --microbatches must be >= 1")
        if args.paper or args.fit_fwd_bwd or args.sweep_dp is not None or args.sweep_alpha is not None:
            raise ValueError("--pp simulates one pipeline configuration; drop --paper, --fit-fwd-bwd and the sweeps")
        return _run_pipeline(cfg, args, hw, setup, strategies, plan_kw)
    is_paper = (cfg.name == PAPER_CONFIG["model"] and args.dp == PAPER_CONFIG["dp"] and args.tp == PAPER_CONFIG["tp"]
                and args.optimizer == PAPER_CONFIG["optimizer"] and not plan_kw and args.alpha == 1.0)
    if (args.paper or args.fit_fwd_bwd) and not is_paper:
        raise ValueError("--paper / --fit-fwd-bwd need the paper configuration: --model qwen3-32b --dp 32 --tp 8 --optimizer muon, default alpha, C_max and buckets")

    pc, variants = _paper(args, hw, setup) if is_paper else (None, [])
    if pc is not None:
        hw = pc.hardware  # fitted when --fit-fwd-bwd
    results = _simulate_strategies(args, cfg, hw, setup, strategies, plan_kw)
    _print_results(cfg, args, hw, setup, results)
    if pc is not None:
        _print_paper(pc, variants)

    doc = _document(args, cfg, hw, setup, strategies, plan_kw, results, pc, variants, sweep_dp, sweep_alpha)
    _print_assumptions(hw, setup)

    if args.json:
        # the results are printed above; a failed write says so in one line and keeps the old file
        path = write_output(args.json, json.dumps(doc, indent=1, default=_json_default) + "\n")
        print(f"wrote {path}")
    return 0


def _document(args: argparse.Namespace, cfg: Any, hw: Any, setup: Any, strategies: Any, plan_kw: dict[str, Any], results: dict[str, Any],
              pc: Any, variants: list[Any], sweep_dp: list[int] | None, sweep_alpha: list[float] | None) -> dict[str, Any]:
    """The ``--json`` document: inputs, hardware, setup (each value with its source), every
    strategy's step, the paper comparison when it ran, and the sweeps (run here, printing their tables)."""
    from canzona.sim.model import SETUP_SOURCES

    doc: dict[str, Any] = {
        "inputs": {
            "model": cfg.name,
            "dp": args.dp,
            "tp": args.tp,
            "gpus": args.dp * args.tp,
            "optimizer": args.optimizer,
            "alpha": args.alpha,
            "lb_tp_schedule": args.lb_tp_schedule,
            **plan_kw,
        },
        "hardware": hw.to_dict(),
        "setup": {f.name: {"value": getattr(setup, f.name), "source": SETUP_SOURCES[f.name]} for f in fields(setup)},
        "strategies": {s: {**b.summary(), "per_rank_optimizer_s": list(b.per_rank_optimizer_s)} for s, b in results.items()},
    }
    if pc is not None:
        doc["paper_comparison"] = pc.to_dict()
        doc["paper_variants"] = {label: v.to_dict() for label, v in variants}
    if sweep_dp:
        doc["dp_sweep"] = _dp_sweep(args, cfg, hw, setup, strategies, plan_kw, sweep_dp)
    if sweep_alpha:
        doc["alpha_sweep"] = _alpha_sweep(args, cfg, hw, setup, plan_kw, sweep_dp or [args.dp], sweep_alpha)
    return doc


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


# ------------------------------------------------------------------------------------ --fsdp
def _fsdp_strategies(args: argparse.Namespace, default_strategies: str) -> list[str]:
    from canzona.plan.strategies import FSDP_STRATEGIES

    if args.strategies == default_strategies:
        return list(FSDP_STRATEGIES)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in FSDP_STRATEGIES]
    if bad or not strategies:
        raise UserError(f"unknown FSDP2 strategy {', '.join(bad) or '(none)'}; choose from {', '.join(FSDP_STRATEGIES)}")
    return strategies


def _run_fsdp(args: argparse.Namespace, setup: Any, hw: Any, default_strategies: str) -> int:
    """The ``--fsdp`` branch of ``canzona simulate`` (setup and hardware parsed by the caller)."""
    from canzona.commands.plan import check_fsdp_ranks
    from canzona.plan.build import plan_fsdp_model
    from canzona.sim.shard import simulate_fsdp

    check_fsdp_ranks(args.fsdp, args.dp_replicate, args.tp)
    if args.paper or args.sweep_dp is not None or args.sweep_alpha is not None:
        raise UserError("--paper, --sweep-dp and --sweep-alpha simulate canzona's ZeRO-1 path; drop them with --fsdp")
    strategies = _fsdp_strategies(args, default_strategies)
    if args.tp_overlap is None:
        setup = dataclasses.replace(setup, tp_overlap="pipelined")  # what the runtime does
    cmax = {} if args.cmax is None else {"cmax_bytes": cmax_to_bytes(args.cmax, args.tp)}
    rows = []
    for s in strategies:
        plan = plan_fsdp_model(
            args.model, dp_shard=args.fsdp, tp=args.tp, dp_replicate=args.dp_replicate, optimizer=args.optimizer,
            strategy=s, cost="flops", experts=args.experts, **cmax,
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
        d = plan.metrics.details
        print(
            f"{r.strategy:<10}{r.optimizer_s:>9.4f}{r.rank_mean_s:>9.4f}{r.rank_imbalance:>9.3f}{r.host_compute_max_s:>9.4f}"
            f"{r.exchange_s:>11.4f}{r.n_micro_groups:>7}{d['flops_ratio']:>12.3f}{d['flops_bound']:>7.3f}"
        )
    if base is not None:
        print("step relative to lb-asc: " + ", ".join(f"{r.strategy} {r.optimizer_s / base.optimizer_s:.2f}x" for _, r in rows))
    if args.json:
        doc: dict[str, Any] = {"schema": "canzona.fsdp_simulation", "version": 1, "hardware": hw.name,
                               "results": {r.strategy: r.summary() for _, r in rows}}
        write_output(args.json, json.dumps(doc, indent=1) + "\n")  # atomic, names the path on failure
        print(f"note: results written to {args.json}")
    return 0
