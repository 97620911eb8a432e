"""Parameter and gradient views against the copies they replace, A/B inside the same processes.

Each rank builds two identical models, one with ``param_views=False, grad_views=False`` (the
copies) and one with the views (the default), and alternates training steps between them, so both
see the same machine load step by step (separate benchmark runs on a shared machine drift by tens
of percent). Per variant and step: process CPU time of backward (the gradient copy-in) and of
``step()`` (the parameter copy-out included), slowest rank, median over steps; plus the resulting
parameters compared bitwise between the two (they must be equal).

Run from the repository root::

    .venv/bin/python profiling/bench_views.py                        # tiny (500 x 4x4) and stack (8 x 384x384), world 2
    .venv/bin/python profiling/bench_views.py --world 4 --strategy asc --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

__all__ = ["main", "views_worker"]

SHAPES = {"tiny": (500, 4, 2_000), "stack": (8, 384, 300_000)}  # depth, width, bucket_numel


def views_worker(rank: int, world: int, model_name: str, strategy: str, steps: int, warmup: int) -> dict:
    import canzona
    from canzona.profiling.vs_torch import LinearStack

    depth, width, bucket = SHAPES[model_name]
    runs = {}
    for views in (False, True):
        model = LinearStack(depth, width)
        opt = canzona.DistributedOptimizer(
            model, "muon", strategy=strategy, optimizer_kwargs={"lr": 0.02, "weight_decay": 0.01},
            elementwise_kwargs={"lr": 1e-3}, bucket_numel=bucket, param_views=views, grad_views=views,
        )
        runs[views] = (model, opt)
    times: dict[bool, dict[str, list[float]]] = {v: {"backward": [], "step": []} for v in runs}
    for s in range(warmup + steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(16, width, generator=g)
        for views, (model, opt) in runs.items():
            loss = model(x).square().mean()
            c0 = time.process_time()
            loss.backward()
            c1 = time.process_time()
            opt.step()
            opt.zero_grad()
            c2 = time.process_time()
            if s >= warmup:
                times[views]["backward"].append(c1 - c0)
                times[views]["step"].append(c2 - c1)
    same = all(torch.equal(a, b) for a, b in zip(runs[False][0].parameters(), runs[True][0].parameters()))
    return {"times": times, "same": same, "params": depth}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,stack", help="comma-separated: tiny (500 x 4x4), stack (8 x 384x384)")
    p.add_argument("--strategy", default="lb-asc", help="canzona strategy (default lb-asc)")
    p.add_argument("--world", type=int, default=2, help="DP ranks (default 2)")
    p.add_argument("--steps", type=int, default=12, help="measured steps per variant (default 12)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default 3)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on each run (seconds)")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if any(m not in SHAPES for m in models) or args.world < 1 or args.steps < 1 or args.warmup < 0 or not args.timeout_s > 0:
        print(f"bench_views: models must be among {sorted(SHAPES)}; world, steps >= 1, warmup >= 0, timeout-s > 0", file=sys.stderr)
        return 2
    from canzona.runtime.launch import run_workers

    print(f"{args.strategy}, world {args.world}, gloo, CPU ms per step (slowest rank, median of {args.steps} alternating steps)")
    print(f"  {'model':6s} {'variant':7s} {'backward':>9s} {'step()':>9s} {'both':>9s} {'us/param':>9s}")
    for m in models:
        per_rank = run_workers(views_worker, args.world, m, args.strategy, args.steps, args.warmup, timeout_s=args.timeout_s)
        n = per_rank[0]["params"]
        for views in (False, True):
            def med(key: str, views: bool = views) -> float:
                return statistics.median(max(r["times"][views][key][i] for r in per_rank) for i in range(args.steps)) * 1e3

            both = statistics.median(
                max(r["times"][views]["backward"][i] + r["times"][views]["step"][i] for r in per_rank) for i in range(args.steps)
            ) * 1e3
            print(f"  {m:6s} {'views' if views else 'copy':7s} {med('backward'):9.2f} {med('step'):9.2f} {both:9.2f} {1e3 * both / n:9.1f}")
        print(f"  {m:6s} parameters bitwise equal between the two: {all(r['same'] for r in per_rank)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
