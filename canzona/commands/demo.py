"""``canzona demo``: the whole story on one CPU machine, in three acts.

1. Plan: Qwen3-32B at DP32 x TP8 (Muon, Megatron layout) -- the paper's Figure 3 load-balance
   ratios beside ours (``canzona reproduce fig3``), then canzona's own ``lb-asc-joint`` planner.
2. Train: the tiny Qwen3 model with ``lb-asc`` on a dp2 x tp2 gloo mesh (4 processes) under
   ``torch.profiler`` (one TensorBoard trace per rank); loss per step, the per-phase breakdown read
   back from the traces, and the bytes each phase moved.
3. Verify: the exactness gate for the same configuration -- injected gradients that sum exactly in
   any order, distributed parameters and optimizer states against the single-device optimizer with
   ``torch.equal`` -- and the verdict.

Exit code 0 when the verdict is exact, 1 when any check differs.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from canzona.optimizers import optimizer_names

__all__ = ["add_arguments", "fig3_table", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=4, help="active profiled training steps (default 4)")
    parser.add_argument("--optimizer", default="muon", choices=optimizer_names(matrix=True), help="matrix optimizer (default muon)")
    parser.add_argument("--out", default="runs/demo", help="directory for the traces and the phase table (default runs/demo)")
    parser.add_argument("--skip-train", action="store_true", help="only plan and verify (no profiled training run)")
    parser.add_argument("--skip-verify", action="store_true", help="skip the exactness check")


def _banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 92 - len(text)), flush=True)


def fig3_table(fig: Any) -> str:
    """Figure 3 as the demo shows it: one ratio per quantity, the paper's value beside canzona's
    reproduction under the paper's own conventions, and the verdict. The rows canzona adds, the
    reasons and canzona's own conventions are in ``canzona reproduce fig3``."""
    rows = [r for r in fig.rows if r.paper is not None and not isinstance(r.ours, str)]
    width = max(len(r.label) for r in rows)
    head = f"  {'max/mean ratio':<{width}}{'paper':>8}{'canzona':>9}  verdict"
    out = [head, "  " + "-" * (len(head) - 2)]
    for r in rows:
        out.append(f"  {r.label:<{width}}{r.paper:>8.3f}{r.ours:>9.3f}  {r.verdict}")
    return "\n".join(out)


def _act_plan() -> None:
    from canzona.commands.reproduce import fig3
    from canzona.plan import plan_model

    _banner("1. Plan: Qwen3-32B, Muon, DP32 x TP8 (Figure 3 of the paper beside ours)")
    print("Figure 3 under the paper's conventions (TP-local shapes, DP rank 0's TP group):")
    print(fig3_table(fig3()))
    print("  (every row, the reasons and canzona's own conventions: canzona reproduce fig3)")
    print("\ncanzona's planners under its own conventions (full-shape FLOPs, ratios over all 256 GPUs):")
    head = f"  {'strategy':<14}{'TP schedule':<13}{'DP FLOPs':>10}{'DP memory':>11}{'TP FLOPs':>10}{'plan ms':>9}"
    print(head)
    print("  " + "-" * (len(head) - 2))
    for strategy in ("lb-asc", "lb-asc-joint"):
        with warnings.catch_warnings():
            # the oversize-task warning is explained by `canzona reproduce fig3`
            warnings.simplefilter("ignore", UserWarning)
            p = plan_model("qwen3-32b", dp=32, tp=8, strategy=strategy, optimizer="muon")
        m = p.metrics
        # the TP ratio over every GPU (the same quantity for both planners), not the worst group's
        tp_all = float(m.details.get("tp_flops_ratio_global", m.tp_flops_ratio))
        print(
            f"  {strategy:<14}{p.inputs.tp_schedule:<13}{m.dp_flops_ratio:>10.3f}{m.dp_memory_ratio:>11.3f}"
            f"{tp_all:>10.3f}{1e3 * m.plan_seconds:>9.1f}"
        )
    from canzona.plan.convention import lower_bound
    print(f"  (TP FLOPs over all 256 GPUs; the atomic lower bound, largest task / mean, is "
          f"{lower_bound(p.specs, 32, 8, 'muon'):.3f})")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _act_train(optimizer: str, steps: int, out: Path) -> None:
    from canzona.profiling.run import ProfileSchedule, ProfileSpec, profile_run
    from canzona.profiling.traces import load_traces, phase_stats, write_summary
    from canzona.train import TrainConfig

    _banner(f"2. Train: tiny Qwen3, lb-asc, {optimizer}, dp2 x tp2 on gloo, under torch.profiler")
    cfg = TrainConfig(model="qwen3-tiny", optimizer=optimizer, strategy="lb-asc", dp=2, tp=2, steps=steps + 2, bucket_numel=20_000)
    spec = ProfileSpec(train=cfg, schedule=ProfileSchedule(wait=1, warmup=1, active=steps), tensorboard_dir=str(out / "traces"))
    t0 = time.perf_counter()
    run = profile_run(spec, overwrite=True)
    r0 = run.results[0]
    print(f"{cfg.world_size} ranks, {len(r0.losses)} steps in {time.perf_counter() - t0:.1f} s; plan fingerprint {r0.plan_fingerprint}")
    print("loss: " + "  ".join(f"{x:.4f}" for x in r0.losses))

    df = load_traces(out / "traces")
    write_summary(df, out / "summary")
    stats = phase_stats(df)
    print(f"\nphase breakdown over the {steps} profiled steps, read back from the traces (ms):")
    print(f"  {'phase (/launch, /wait: async stages)':<36}{'calls':>7}{'per rank-step':>15}{'median':>10}{'max':>10}")
    for row in stats.itertuples():
        name = f"{row.phase}/{row.stage}" if row.stage else row.phase
        print(
            f"  {name:<36}{row.calls:>7}{row.per_rank_step_us / 1e3:>15.2f}"
            f"{row.median_us / 1e3:>10.2f}{row.max_us / 1e3:>10.2f}"
        )

    phases = sorted({k for r in run.results for k in r.comm_bytes})
    print("\nbytes moved per phase (sent, summed over ranks, all steps):")
    for ph in phases:
        sent = sum(r.comm_bytes.get(ph, {}).get("sent", 0) for r in run.results)
        print(f"  {ph:<32}{_fmt_bytes(sent):>14}")
    rs = sum(r.comm_bytes.get("canzona/dp/reduce_scatter", {}).get("sent", 0) for r in run.results)
    step_bytes = sum(
        r.comm_bytes.get(ph, {}).get("sent", 0)
        for r in run.results
        for ph in ("canzona/optimizer/step", "canzona/dp/local_update")
    )
    print(
        f"  optimizer step outside the TP exchanges moved {_fmt_bytes(step_bytes)}; fwd-bwd moved one reduce-scatter "
        f"({_fmt_bytes(rs)}); sc's all-reduce of the same buckets moves twice that (tests/test_runtime_accounting.py)"
    )
    print(f"traces: {out / 'traces'} (tensorboard --logdir {out / 'traces'}); phase table: {out / 'summary'}")


def _act_verify(optimizer: str) -> bool:
    from canzona.lab import suite

    Selection, format_table, run_suite = suite().Selection, suite().format_table, suite().run_suite

    _banner("3. Verify: lb-asc at dp2 x tp2 against the single-device optimizer, bit for bit")
    sel = Selection(level="quick", optimizers=(optimizer,), strategies=("lb-asc",), meshes=("dp2xtp2",), checks=("injected",))
    res = run_suite(sel, report_path=None)
    print(format_table(res.report))
    s = res.report["summary"]
    verdict = "EXACT" if res.ok else "MISMATCH"
    print(f"\nexactness verdict: {verdict} ({s['passed']} of {s['cells']} cells bitwise equal)")
    return res.ok


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    out = Path(args.out)
    _act_plan()
    if not args.skip_train:
        _act_train(args.optimizer, args.steps, out)
    ok = True
    if not args.skip_verify:
        ok = _act_verify(args.optimizer)
    sys.stdout.flush()
    return 0 if ok else 1
