"""Canzona vs torch DDP + torch.optim.Muon, side by side in one invocation.

By default (``--mode interleaved``) one set of processes per case holds every variant and runs
them in turn, one step each, the order rotated every step, so the ratios to DDP are measured under
the same load (on a shared machine separate runs of the same code drift by tens of percent); peak
memory per variant is then ``n/a``. ``--mode separate`` runs each variant in its own fresh
processes, one after another, and reports each one's peak memory. Gloo on CPU with one thread per
rank, or NCCL with ``--backend nccl`` on GPUs. Cases:

- ``stack-w2``, ``stack-w4``: a stack of 384 x 384 bias-free linears (``--depth``), batch 16 per
  rank, DP = world: an optimizer-bound model where Canzona's partitioning should pay;
- ``qwen3-w4``: the tiny Qwen3, canzona at dp2 x tp2 (TP engine), DDP at dp4 (the ordinary way);
- ``tiny-w2``, ``tiny16-w2``: 500 parameters of 4 x 4 (16 x 16), where compute is negligible: the
  per-parameter Python overhead of a step (``us/param`` column = step time / parameter count;
  ``profiling/bench_fsdp2.py --tiny 500`` prints the same beside dion on FSDP2).

Variants: ``ddp`` (DDP + torch.optim.Muon on every rank), canzona ``sc``, ``layerwise``, ``asc``,
``lb-asc``; ``--views both`` runs every canzona variant twice, once as ``<variant>/copy``
(``param_views=False, grad_views=False``: the parameter copy-out and the gradient copy-in) and once
with the views (the default), printed side by side; ``--phases`` adds canzona's phase wall times
per rank (where exposed communication comes from). Printed per variant: median step time (slowest rank), optimizer time, exposed
communication, bytes sent per step (all ranks), peak memory per rank (separate mode), ratios to DDP, and the goals
(lb-asc <= 0.58 x DDP at world 2, <= 0.35 x at world 4; sc within 1.05 x). The definitions are in
``canzona/profiling/vs_torch.py``.

Run from the repository root::

    .venv/bin/python profiling/bench_vs_torch.py                       # every case
    .venv/bin/python profiling/bench_vs_torch.py --cases stack-w2 --steps 5 --json out.json
    .venv/bin/python profiling/bench_vs_torch.py --cases tiny-w2 --views both --phases
    .venv/bin/python profiling/bench_vs_torch.py --cases stack-w2 --mode separate   # with peak memory per variant
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from canzona.profiling.vs_torch import (
    COPY_SUFFIX,
    MODES,
    VARIANTS,
    Case,
    as_dicts,
    format_phases,
    format_table,
    ideal_ratio,
    known_variant,
    median_of_runs,
    run_case,
)

__all__ = ["main", "CASES"]

GOALS = {2: 0.58, 4: 0.35}


def CASES(depth: int, steps: int, warmup: int) -> dict[str, Case]:  # noqa: N802 - a table, read like a constant
    return {
        "stack-w2": Case("stack-w2", "stack", 2, depth=depth, steps=steps, warmup=warmup),
        "stack-w4": Case("stack-w4", "stack", 4, depth=depth, steps=steps, warmup=warmup),
        "qwen3-w4": Case("qwen3-w4", "qwen3", 4, tp=2, batch=4, seq_len=32, steps=steps, warmup=warmup, bucket_numel=40_000),
        "tiny-w2": Case("tiny-w2", "stack", 2, depth=500, width=4, steps=steps, warmup=warmup, bucket_numel=2_000),
        "tiny16-w2": Case("tiny16-w2", "stack", 2, depth=500, width=16, steps=steps, warmup=warmup, bucket_numel=32_000),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="stack-w2,stack-w4,qwen3-w4,tiny-w2", help="comma-separated cases to run")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants (ddp, canzona strategies, <strategy>/copy)")
    p.add_argument("--depth", type=int, default=8, help="linears in the stack cases (default 8)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per variant (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps first (default 3)")
    p.add_argument("--mode", default="interleaved", choices=MODES,
                   help="interleaved (default): every variant in the same processes, step by step in turn (same load, "
                        "no per-variant peak memory); separate: each variant in its own fresh processes, with its peak memory")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl"), help="process-group backend (default gloo)")
    p.add_argument("--views", default="on", choices=("on", "off", "both"),
                   help="canzona with parameter/gradient views (on, the default), without them (off: <variant>/copy), or both side by side")
    p.add_argument("--phases", action="store_true", help="also print canzona's phase wall times per rank")
    p.add_argument("--repeat", type=int, default=1,
                   help="run each case this many times (fresh processes each time) and report per-figure medians (steadier under a drifting load)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on each run of worker processes in seconds (a case in interleaved mode, a variant in separate mode; default 900)")
    return p.parse_args(argv)


def _verdicts(results: list, world: int) -> list[str]:
    by = {r.variant: r for r in results}
    out = []
    for variant, goal in (("lb-asc", GOALS.get(world)), ("sc", 1.05)):
        if variant in by and "ddp" in by and goal is not None:
            x, c = by[variant].ratios["step"], by[variant].ratios["step_cpu"]
            runs = by[variant].run_ratios.get("step", [])
            spread = f", runs {min(runs):.2f}-{max(runs):.2f}" if len(runs) > 1 else ""
            out.append(f"  goal {variant} <= {goal:.2f} x DDP step time: {x:.2f} x wall{spread} -> {'met' if x <= goal else 'MISSED'} "
                       f"({c:.2f} x in CPU time)")
    if "ddp" in by and "lb-asc" in by:
        wall, cpu = ideal_ratio(by["ddp"], world)
        out.append(f"  bound for this model here (DDP's fwd-bwd + its optimizer / {world}): {wall:.2f} x wall, {cpu:.2f} x CPU")
    return out


def _with_views(variants: tuple[str, ...], views: str) -> tuple[str, ...]:
    """The variants to run: canzona ones as given (``on``), as ``/copy`` (``off``), or both in a row."""
    out: list[str] = []
    for v in variants:
        if v == "ddp" or v.endswith(COPY_SUFFIX) or views == "on":
            out.append(v)
        elif views == "off":
            out.append(v + COPY_SUFFIX)
        else:
            out += [v + COPY_SUFFIX, v]
    return tuple(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    table = CASES(args.depth, args.steps, args.warmup)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in table]
    variants = tuple(v for v in args.variants.split(",") if v)
    bad = [v for v in variants if not known_variant(v)]
    variants = _with_views(variants, args.views)
    if unknown or bad or args.steps < 1 or args.warmup < 0 or args.depth < 1 or args.repeat < 1:
        print(f"bench_vs_torch: unknown cases {unknown} / variants {bad}, or steps/warmup/depth/repeat out of range", file=sys.stderr)
        return 2
    everything = []
    for name in names:
        case = table[name]
        case = Case(**{**{f: getattr(case, f) for f in case.__dataclass_fields__}, "variants": variants})
        results = median_of_runs([run_case(case, backend=args.backend, timeout_s=args.timeout_s, mode=args.mode)
                                  for _ in range(args.repeat)])
        mesh = f"dp{case.dp} x tp{case.tp} (DDP dp{case.world})" if case.tp > 1 else f"dp{case.world}"
        print(format_table(results, title=f"{name}: {case.model}, world {case.world}, {mesh}, {args.backend}, {args.mode}, "
                                          f"median of {case.steps} steps after {case.warmup}"
                                          + (f", median of {args.repeat} runs" if args.repeat > 1 else "")))
        if args.phases:
            print(format_phases(results, title="  phase wall ms per step (median), one column per rank"))
        if case.model == "stack" and case.width > 16:
            print("\n".join(_verdicts(results, case.world)))
        print()
        everything += as_dicts(results)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
