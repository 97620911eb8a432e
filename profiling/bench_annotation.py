"""What the phase annotations cost when no profiler is attached (the claim under test: annotation is free).

Two measurements, both with no profiler and no nsys attached:

1. Per call: ``with phase(name): pass`` (NVTX range via the nvtx package + record_function +
   phase stack, with and without the PhaseTimer that DistributedOptimizer.step activates), beside
   its parts, in this process.
2. On real training steps (tiny Qwen3, dp2 x tp2 lb-asc by default): the same run alternates
   blocks of annotated steps and bare steps (every module's ``phase`` swapped for a do-nothing
   context manager), so both see the same background load. Printed: median step time per mode,
   the difference, and the estimate calls-per-step x cost-per-call / step time, which does not
   depend on run-to-run noise.

    .venv/bin/python profiling/bench_annotation.py                  # ~1-2 minutes on 2 cores
    .venv/bin/python profiling/bench_annotation.py --dp 1 --tp 1    # one process: less noise
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canzona.profiling.overhead import ab_summary, ab_worker, annotation_cost


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="annotation overhead with no profiler attached")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--strategy", default="lb-asc")
    p.add_argument("--optimizer", default="muon")
    p.add_argument("--steps", type=int, default=17, help="training steps (first is skipped; default 17)")
    p.add_argument("--block", type=int, default=2, help="steps per A/B block (default 2)")
    p.add_argument("--calls", type=int, default=20000, help="calls per micro-benchmark sample")
    args = p.parse_args(argv)
    from canzona.train import TrainConfig, check_model

    if args.block < 1 or args.calls < 1:
        p.error("--block and --calls must be >= 1")
    if args.steps < 1 + 2 * args.block:
        p.error(f"--steps must be at least 1 + 2 x --block = {1 + 2 * args.block} (one skipped step, then an annotated and a bare block)")
    try:
        cfg = TrainConfig(optimizer=args.optimizer, strategy=args.strategy, dp=args.dp, tp=args.tp, steps=args.steps, progress=False)
        check_model(cfg)  # e.g. a TP degree the model cannot split
    except ValueError as exc:
        p.error(str(exc))

    cost = annotation_cost(n=args.calls)
    print("per call, no profiler attached (median of 7 samples, this process):")
    print(f"  {'variant':<16}{'wall us':>9}{'cpu us':>9}")
    for k, v in cost.items():
        print(f"  {k:<16}{v['wall_us']:>9.2f}{v['cpu_us']:>9.2f}")

    from canzona.runtime.launch import run_workers

    per_rank = run_workers(ab_worker, cfg.world_size, cfg, args.block, 1, timeout_s=900)
    print(f"\ntraining steps, {cfg.model} {cfg.optimizer} {cfg.strategy} dp{cfg.dp} x tp{cfg.tp}, "
          f"{args.steps} steps in blocks of {args.block}, annotated and bare alternating (medians per mode):")
    print(f"{'rank':>4}{'wall ann ms':>13}{'bare ms':>9}{'diff %':>8}{'cpu ann ms':>12}{'bare ms':>9}{'diff %':>8}"
          f"{'phases/step':>13}{'cpu us/phase':>14}{'estimate %':>12}")
    est_all, wall_all, cpu_all = [], [], []
    for out in per_rank:
        w = ab_summary(out["times"])
        c = ab_summary(out["cpu_times"])
        per_call = out["cost_us"]["phase+timer"]["cpu_us"]
        # CPU cost of the annotations per step over the step's CPU time on this (the training) thread
        est = out["calls_per_step"] * per_call / (c["bare_ms"] * 1e3)
        est_all.append(est)
        wall_all.append(w["overhead"])
        cpu_all.append(c["overhead"])
        print(f"{out['rank']:>4}{w['annotated_ms']:>13.2f}{w['bare_ms']:>9.2f}{w['overhead'] * 100:>8.2f}"
              f"{c['annotated_ms']:>12.2f}{c['bare_ms']:>9.2f}{c['overhead'] * 100:>8.2f}"
              f"{out['calls_per_step']:>13.1f}{per_call:>14.2f}{est * 100:>12.3f}")
    print(f"\nannotation overhead per training step, no profiler attached: estimate {statistics.median(est_all) * 100:.2f} % "
          f"(phases per step x CPU cost per phase / step CPU time, median over ranks); "
          f"A/B medians: wall {statistics.median(wall_all) * 100:+.2f} %, thread CPU {statistics.median(cpu_all) * 100:+.2f} % "
          f"(noise on a loaded machine can exceed the effect)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
