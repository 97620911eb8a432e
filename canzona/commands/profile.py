"""``canzona profile``: profile training steps of the tiny model under torch.profiler.

Examples::

    canzona profile --tensorboard runs/prof                     # tiny model, dp2 x tp2, muon, lb-asc
    canzona profile --tensorboard runs/sc --strategy sc --steps 3 --summary data/profiles/sc
    tensorboard --logdir runs/prof                              # PyTorch Profiler tab (torch-tb-profiler)

Each rank runs :func:`canzona.train.train` under ``torch.profiler`` with a wait / warmup / active
schedule (``--wait``, ``--warmup``, ``--steps`` active steps) and the TensorBoard trace handler, and
leaves one ``rank<r>.<id>.pt.trace.json`` under the directory, plus ``meta.json``. ``--summary
OUT`` also writes the phase table and its statistics there (:mod:`canzona.profiling.traces`).
``--cuda-capture`` brackets the active steps with ``cudaProfilerStart/Stop`` for
``nsys profile --capture-range=cudaProfilerApi`` (``profiling/nsys_profile.py`` runs it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from canzona.commands._args import add_cmax_argument, positive_float
from canzona.plan.plan import TP_SCHEDULES
from canzona.plan.strategies import strategy_names

__all__ = ["add_arguments", "run", "spec_from_args"]


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {v}")
        return v

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from canzona.train import BACKENDS, OPTIMIZERS

    parser.add_argument("--tensorboard", metavar="DIR", default=None, help="write one *.pt.trace.json per rank here (TensorBoard logdir)")
    parser.add_argument("--steps", type=_int_at_least(1), default=2, help="active (recorded) steps (default: 2)")
    parser.add_argument("--wait", type=_int_at_least(0), default=1, help="unrecorded steps first (default: 1; step 0 builds the plan)")
    parser.add_argument("--warmup", type=_int_at_least(0), default=1, help="recorded-and-discarded warm-up steps (default: 1)")
    parser.add_argument("--dp", type=_int_at_least(1), default=2, help="data-parallel degree (default: 2)")
    parser.add_argument("--tp", type=_int_at_least(1), default=2, help="tensor-parallel degree (default: 2)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="muon", help="matrix optimizer (default: muon)")
    parser.add_argument("--strategy", choices=strategy_names(), default="lb-asc", help="DP strategy (default: lb-asc)")
    parser.add_argument("--tp-schedule", choices=TP_SCHEDULES, default=None, help="TP micro-group schedule (default: the strategy's)")
    parser.add_argument("--model", default="qwen3-tiny", help="model config (default: qwen3-tiny)")
    parser.add_argument("--batch-size", type=_int_at_least(1), default=8, help="global batch size (default: 8)")
    parser.add_argument("--seq-len", type=_int_at_least(1), default=64, help="tokens per sequence (default: 64)")
    parser.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")
    parser.add_argument("--bucket-numel", type=_int_at_least(1), default=None, help="ZeRO-1 bucket size in elements (default: planner's)")
    add_cmax_argument(parser, 512.0)
    parser.add_argument("--backend", choices=BACKENDS, default=None, help="collective backend (default: nccl with CUDA, else gloo)")
    parser.add_argument("--summary", metavar="OUT", default=None, help="also write the phase table + statistics + meta.json here")
    parser.add_argument("--no-parquet", action="store_true", help="--summary writes CSV only (no phases.parquet even with pyarrow)")
    parser.add_argument("--cuda-capture", action="store_true", help="cudaProfilerStart/Stop around the active steps (for nsys)")
    parser.add_argument("--force", action="store_true", help="replace trace files already in the TensorBoard directory")
    parser.add_argument("--timeout-s", type=_int_at_least(1), default=600, help="kill the workers after this many seconds (default: 600)")


def spec_from_args(args: argparse.Namespace):  # -> canzona.profiling.run.ProfileSpec
    from canzona.profiling.run import ProfileSchedule, ProfileSpec
    from canzona.train import TrainConfig

    if args.tensorboard is None and not args.cuda_capture:
        raise ValueError("give --tensorboard DIR (torch.profiler traces) and/or --cuda-capture (under nsys)")
    sch = ProfileSchedule(wait=args.wait, warmup=args.warmup, active=args.steps)
    cfg = TrainConfig(
        model=args.model,
        optimizer=args.optimizer,
        strategy=args.strategy,
        dp=args.dp,
        tp=args.tp,
        steps=sch.total,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=args.seed,
        bucket_numel=args.bucket_numel,
        cmax=args.cmax,
        tp_schedule=args.tp_schedule,
        backend=args.backend,
        progress=False,
    )
    from canzona.train import check_model

    check_model(cfg)
    return ProfileSpec(cfg, sch, args.tensorboard, bool(args.cuda_capture))


def run(args: argparse.Namespace) -> int:
    from canzona.profiling.run import profile_run
    from canzona.runtime.launch import WorkerError

    from canzona.commands._args import output_dir

    spec = spec_from_args(args)
    cfg = spec.train
    # before the (minutes-long) run: both output folders must be creatable
    if spec.tensorboard_dir is not None:
        output_dir(spec.tensorboard_dir, "--tensorboard")
    if args.summary:
        output_dir(args.summary, "--summary")
    try:
        prof = profile_run(spec, overwrite=args.force, timeout_s=float(args.timeout_s))
    except WorkerError as exc:
        from canzona.commands._run import debug_enabled

        if debug_enabled(args):
            detail = f"\n{exc}"
        else:
            detail = " (--debug prints the worker's traceback)" if "\n" in str(exc).strip() else ""
        print(f"canzona profile: a worker failed: {exc.summary}{detail}", file=sys.stderr)
        return 1
    if spec.tensorboard_dir is None:
        print(f"canzona profile: ran {cfg.steps} steps with cudaProfilerStart/Stop around steps "
              f"{spec.schedule.first_active}..{spec.schedule.last_active}")
        return 0
    return _report(args, spec, prof)


def _report(args: argparse.Namespace, spec: Any, prof: Any) -> int:
    """After a TensorBoard run: the traces' phase table and step makespans, the summary folder
    when asked for, where to look next; exit 1 when an expected phase is missing from the traces."""
    from canzona.profiling.run import expected_phases
    from canzona.profiling.traces import load_traces, phase_stats, step_makespans, write_meta, write_summary

    cfg = spec.train
    meta = {"strategy": cfg.strategy, "optimizer": cfg.optimizer, "dp": cfg.dp, "tp": cfg.tp, "steps": spec.schedule.active, "model": cfg.model}
    write_meta(spec.tensorboard_dir, **meta)
    df = load_traces(spec.tensorboard_dir)
    missing = sorted(expected_phases(cfg.strategy, dp=cfg.dp, tp=cfg.tp, tp_schedule=cfg.tp_schedule) - set(df["phase"]))
    print(f"canzona profile: {cfg.model} {cfg.optimizer} {cfg.strategy} dp{cfg.dp} x tp{cfg.tp}, "
          f"steps {spec.schedule.first_active}..{spec.schedule.last_active} recorded")
    for p in prof.traces:
        print(f"  {p}")
    stats = phase_stats(df)
    print(stats[["phase", "stage", "kind", "calls", "mean_us", "per_rank_step_us"]].to_string(index=False, float_format=lambda v: f"{v:,.0f}"))
    mk = step_makespans(df)
    print(mk[["step", "iteration_us", "fwd_bwd_us", "optimizer_us", "optimizer_compute_us", "exposed_comm_us", "param_return_us", "slowest_rank"]]
          .to_string(index=False, float_format=lambda v: f"{v:,.0f}"))
    if args.summary:
        written = write_summary(df, args.summary, parquet=False if args.no_parquet else None)
        write_meta(args.summary, **meta)
        print(f"summary: {', '.join(str(Path(args.summary) / n) for n in written)} + meta.json")
    from canzona.runs import METRICS_CSV

    print(f"metrics: {Path(spec.tensorboard_dir) / METRICS_CSV} (loss and phase times per step; TensorBoard scalars too)")
    print(f"open: tensorboard --logdir {spec.tensorboard_dir}   (PyTorch Profiler tab; pip install torch-tb-profiler; "
          "its views need the internet; offline: canzona timeline " + str(spec.tensorboard_dir) + ")")
    if missing:
        print(f"canzona profile: expected phases missing from the traces: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0
