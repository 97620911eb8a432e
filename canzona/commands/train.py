"""``canzona train``: train the tiny Qwen3 model on a DP x TP mesh with a Canzona strategy.

Examples::

    canzona train --dp 2 --tp 2 --optimizer muon --strategy lb-asc --steps 20   # spawns dp*tp = 4 workers
    canzona train --steps 30                              # one process, dp = tp = 1
    torchrun --nproc-per-node 4 -m canzona train --dp 2 --tp 2                   # torchrun starts the ranks
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \
        --rdzv-backend c10d --rdzv-endpoint $HEAD_NODE:29500 -m canzona train --dp 4 --tp 4

Without torchrun, ``canzona train`` is its own launcher: ``--nproc`` defaults to ``dp * tp`` (and
must equal it); SIGINT or SIGTERM stops every worker within seconds and exits with 128 + the signal
number and one line; a worker that dies makes the others stop (see :mod:`canzona.runtime.launch`).
Under torchrun (``WORLD_SIZE`` set) this process is one rank and torchrun supervises the ranks.

Rank 0 prints a legend of the per-step columns, one line per step (global loss, wall ms per
phase; a tqdm bar as well only on a terminal) and a final summary: first/last loss, per-phase
times (``DistributedOptimizer.phase_times``) and bytes per phase
(``DistributedOptimizer.comm_stats``). Each run logs its loss and phase times to
``runs/train-<strategy>-dp<d>xtp<t>-<time>/metrics.csv`` (and TensorBoard scalars when
tensorboard is installed; ``--log-dir`` chooses the directory, ``--no-log`` turns it off).
Under torchrun :func:`canzona.train.train_from_env` joins the job.
"""

from __future__ import annotations

import argparse
import os
import sys

from canzona.commands._args import add_cmax_argument, positive_float, positive_int
from canzona.plan.build import cmax_to_bytes
from canzona.plan.plan import TP_SCHEDULES
from canzona.plan.strategies import strategy_names
from canzona.train import (
    BACKENDS,
    DEFAULT_ELEMENTWISE_LR,
    DEFAULT_LR,
    DTYPES,
    OPTIMIZERS,
    TP_STYLES,
    TrainConfig,
    train_from_env,
    train_worker,
)

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``canzona train``."""
    parser.add_argument("--model", default="qwen3-tiny", help="model config name or path (default: qwen3-tiny)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="muon", help="matrix optimizer (adamw: only for zero1)")
    parser.add_argument("--strategy", choices=strategy_names(), default="lb-asc", help="DP strategy (default: lb-asc)")
    parser.add_argument("--tp-schedule", choices=TP_SCHEDULES, default=None, help="TP micro-group schedule (default: the strategy's)")
    parser.add_argument("--dp", type=positive_int, default=1, help="data-parallel degree")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree")
    parser.add_argument("--steps", type=positive_int, default=10, help="training steps (default: 10)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="global batch size in sequences (default: 8)")
    parser.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence (default: 64)")
    parser.add_argument(
        "--lr", type=positive_float, default=None,
        help="matrix-optimizer learning rate (default: " + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")",
    )
    parser.add_argument(
        "--elementwise-lr", type=positive_float, default=DEFAULT_ELEMENTWISE_LR,
        help=f"AdamW lr for embeddings, head, norms (default: {DEFAULT_ELEMENTWISE_LR:g})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model init and the synthetic data (default: 0)")
    parser.add_argument("--bucket-numel", type=positive_int, default=None, help="ZeRO-1 bucket size in elements (default: planner's)")
    add_cmax_argument(parser, 512.0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="model parameter dtype (masters stay fp32)")
    parser.add_argument("--backend", choices=BACKENDS, default=None, help="collective backend (default: nccl with CUDA, else gloo)")
    parser.add_argument(
        "--tp-style", choices=TP_STYLES, default="dtensor",
        help="dtensor: DTensor parallelize_module; megatron: plain local shards + declared split dims (default: dtensor)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar or per-step lines")
    parser.add_argument("--log-dir", default=None,
                        help="write metrics.csv (+ TensorBoard scalars) here (default: runs/train-<strategy>-dp<d>xtp<t>-<time>)")
    parser.add_argument("--no-log", action="store_true", help="write no metrics log")
    parser.add_argument("--nproc", type=positive_int, default=None, help="spawn this many local worker processes (= dp * tp)")
    parser.add_argument("--timeout-s", type=positive_float, default=900.0, help="kill the workers after this many seconds (default: 900)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Build a validated :class:`canzona.train.TrainConfig` (ValueError on a bad combination)."""
    return TrainConfig(
        model=args.model,
        optimizer=args.optimizer,
        strategy=args.strategy,
        dp=args.dp,
        tp=args.tp,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        elementwise_lr=args.elementwise_lr,
        seed=args.seed,
        bucket_numel=args.bucket_numel,
        tp_schedule=args.tp_schedule,
        cmax=args.cmax,
        dtype=args.dtype,
        backend=args.backend,
        tp_style=args.tp_style,
        progress=not args.no_progress,
        log_dir=_log_dir(args),
    )


def _log_dir(args: argparse.Namespace) -> str | None:
    if args.no_log:
        return None
    if args.log_dir:
        from pathlib import Path

        from canzona.commands._args import output_dir

        output_dir(args.log_dir, "--log-dir")  # before any worker starts: one line naming the folder
        try:  # permission checks cannot see every refusal (/proc, a read-only mount): try it
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot create --log-dir: {exc.strerror or exc}", str(args.log_dir)) from None
        return str(args.log_dir)
    from canzona.runs import new_run_dir

    return str(new_run_dir(f"train-{args.strategy}-dp{args.dp}xtp{args.tp}"))


def _log_failure(log_dir: str | None, text: str) -> str | None:
    """Keep a worker's traceback in the run's folder (``error.log``); the path, or None."""
    if log_dir is None:
        return None
    from pathlib import Path

    from canzona.fileio import atomic_write

    try:
        return str(atomic_write(Path(log_dir) / "error.log", text.rstrip() + "\n"))
    except OSError:
        return None


def _check_model(config: TrainConfig) -> None:
    from canzona.train import check_memory, check_model

    cfg = check_model(config)
    # a run that cannot fit in host memory is refused before anything is allocated; each GPU's share
    # is checked in the workers (check_gpu_memory), so that the launcher never opens a CUDA context
    check_memory(config, cfg)
    # Plan once here (milliseconds for the models train runs): a combination the planner refuses
    # (e.g. --strategy sc with --tp-schedule lpt) is one line before any worker starts.
    import warnings

    from canzona.plan import plan_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        plan_model(
            cfg, dp=config.dp, tp=config.tp, layout="hf", optimizer=config.optimizer, strategy=config.strategy,
            tp_schedule=config.tp_schedule, bucket_numel=config.bucket_numel, cmax_bytes=cmax_to_bytes(config.cmax, config.tp),
        )


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    _check_model(config)
    world_env = os.environ.get("WORLD_SIZE")
    if args.nproc is not None and world_env is not None and int(world_env) > 1:
        raise ValueError("--nproc spawns its own workers; do not combine it with torchrun (WORLD_SIZE is set)")
    # Own launcher unless torchrun (WORLD_SIZE) started this process: --nproc defaults to dp * tp.
    nproc = args.nproc if args.nproc is not None else (config.world_size if world_env is None and config.world_size > 1 else None)
    if nproc is not None:
        if nproc != config.world_size:
            raise ValueError(f"--nproc {nproc} must equal dp*tp = {config.dp}*{config.tp} = {config.world_size}")
        from canzona.runtime.launch import LaunchInterrupted, WorkerError, run_workers

        try:
            run_workers(train_worker, nproc, config, backend=config.resolved_backend, timeout_s=args.timeout_s)
        except LaunchInterrupted as exc:
            # a fresh line: rank 0's progress bar may have left the cursor mid-line on stderr
            print(("\n" if config.progress else "") + f"canzona train: {exc}", file=sys.stderr)
            return 128 + exc.signum
        except WorkerError as exc:
            # The worker's traceback is in the message; the first line names the rank and the error.
            log = _log_failure(config.log_dir, str(exc))
            first = exc.summary
            if "ValueError" in first:
                raise ValueError(first.split("ValueError: ", 1)[-1]) from None
            raise WorkerError(f"{first}{f' (traceback in {log})' if log else ''}\n{exc}") from None
        return 0
    if world_env is not None:
        train_from_env(config)  # under torchrun: this process is one rank
        return 0
    train_worker(0, 1, config)
    return 0
