"""Strategy benchmark: sc, layerwise, asc and lb-asc on the same model and mesh, in one invocation.

For each strategy the tiny Qwen3 model trains for ``--warmup + --steps`` steps on ``dp * tp`` local
processes (gloo on CPU, NCCL with CUDA) and the benchmark prints:

- the optimizer-step makespan (slowest rank, median over steps), also with the parameter return;
- per-rank optimizer compute (``dp/local_update`` + ``tp/compute``): thread CPU time on CPU, CUDA
  events on GPU; its total over ranks, its maximum and max/mean;
- fwd-bwd and iteration time;
- bytes moved per phase per step (sum over ranks);
- ratios of all of these against sc and against layerwise.

On 2 CPU cores with 4 processes the wall times are noisy; trust the compute and byte ratios: sc
recomputes every update on every rank, so lb-asc's total optimizer compute should approach
1/world of sc's. Every strategy ends with the same parameters (checked: one fingerprint).

Run from the repository root::

    .venv/bin/python profiling/bench_strategies.py                 # dp2 x tp2, muon, 2 + 6 steps
    .venv/bin/python profiling/bench_strategies.py --json data/profiles/bench_strategies.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canzona.optimizers import optimizer_names
from canzona.plan.strategies import get_strategy, strategy_names
from canzona.profiling.bench import (
    BENCH_STRATEGIES,
    format_report,
    ratios,
    run_strategy,
    summarize,
)

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--optimizer", default="muon", choices=optimizer_names(matrix=True))
    p.add_argument("--strategies", default=",".join(BENCH_STRATEGIES), help="comma-separated (default: sc,layerwise,asc,lb-asc)")
    p.add_argument("--steps", type=int, default=6, help="measured steps per strategy (default: 6)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured first steps (default: 2)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--backend", default=None, choices=("gloo", "nccl"))
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from canzona.train import TrainConfig, check_model

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    # the benchmark runs a matrix optimizer: strategies that cut matrices cannot take part
    bad = [s for s in strategies if s not in strategy_names() or get_strategy(s).elementwise_only]
    if bad or not strategies:
        print(f"bench_strategies: unknown or unsupported strategy {bad or strategies}; choose from {', '.join(BENCH_STRATEGIES)}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.warmup < 1:
        print("bench_strategies: --steps and --warmup must be >= 1 (step 0 builds the optimizer state)", file=sys.stderr)
        return 2
    try:
        configs = [
            TrainConfig(
                model=args.model, optimizer=args.optimizer, strategy=s, dp=args.dp, tp=args.tp,
                steps=args.warmup + args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                backend=args.backend, progress=False,
            )
            for s in strategies
        ]
        check_model(configs[0])
    except ValueError as exc:
        print(f"bench_strategies: {exc}", file=sys.stderr)
        return 2
    results = []
    t0 = time.perf_counter()
    for s, cfg in zip(strategies, configs):
        t = time.perf_counter()
        per_rank = run_strategy(cfg, timeout_s=args.timeout_s)
        results.append(summarize(s, per_rank, warmup=args.warmup))
        print(f"  {s}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    header = (f"bench_strategies: {args.model} {args.optimizer} dp{args.dp} x tp{args.tp}, "
              f"{args.steps} measured steps after {args.warmup} warm-up (wall {time.perf_counter() - t0:.0f} s)")
    print(format_report(results, header=header))
    fps = {r.params_fingerprint for r in results}
    print(f"\nfinal parameters: {'identical across strategies' if len(fps) == 1 else 'DIFFER: ' + str(sorted(fps))} ({', '.join(sorted(fps))})")
    if args.json:
        doc = {
            "config": {k: getattr(args, k) for k in ("model", "optimizer", "dp", "tp", "steps", "warmup", "batch_size", "seq_len")},
            "results": [dict(asdict(r), compute_total_ms=r.compute_total_ms, compute_max_ms=r.compute_max_ms, bytes_total=r.bytes_total) for r in results],
            "ratios": {b: ratios(results, b) for b in ("sc", "layerwise") if b in strategies},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0 if len(fps) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
