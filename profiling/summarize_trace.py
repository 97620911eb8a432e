"""Summarize a torch.profiler trace directory: phase table, per-phase statistics, step makespans,
the optimizer step's critical path (a thin CLI over ``canzona.profiling.traces``).

    .venv/bin/python profiling/summarize_trace.py runs/prof                       # print
    .venv/bin/python profiling/summarize_trace.py runs/prof --out data/profiles/mine

Launch and wait stages of asynchronous collectives are separate rows; ``comm_exposure`` reports
per communication phase how long ranks were blocked on it (exposed) and how much of its flight
time the rank spent working (hidden). Shares print as percentages with one decimal below 10 %.

``--out`` writes ``phases.csv`` (and ``phases.parquet`` when pyarrow is installed),
``phase_stats.csv``, ``step_makespans.csv``, ``critical_path.csv``, ``comm_exposure.csv`` and copies the run's
``meta.json`` (written by ``canzona profile`` beside the traces); the timeline notebook opens that
directory (``canzona.viz.timeline.load_profile``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pandas as pd

from canzona.profiling.traces import (
    comm_exposure,
    critical_path,
    load_traces,
    phase_stats,
    read_meta,
    step_makespans,
    write_meta,
    write_summary,
)


def share_text(v: float) -> str:
    """A share as a percentage precise enough that a 3 % (or 0.3 %) phase never prints as 0."""
    if pd.isna(v):
        return "-"
    pct = 100.0 * float(v)
    return f"{pct:.1f} %" if pct >= 10 or pct == 0 else f"{pct:.2g} %"


def table_text(df: pd.DataFrame) -> str:
    """A summary table as text: microseconds with thousands separators, shares as percentages."""
    fmt = {c: share_text for c in df.columns if "share" in c}
    return df.to_string(index=False, formatters=fmt, float_format=lambda v: f"{v:,.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="summarize torch.profiler traces of canzona phases")
    p.add_argument("trace_dir", help="directory holding one *.pt.trace.json per rank")
    p.add_argument("--out", default=None, help="write the summary CSVs (+ meta.json) here")
    args = p.parse_args(argv)
    try:
        df = load_traces(args.trace_dir)
        meta_path = Path(args.trace_dir) / "meta.json"
        meta = read_meta(meta_path) if meta_path.is_file() else None
    except (FileNotFoundError, ValueError) as exc:
        print(f"summarize_trace: error: {exc}", file=sys.stderr)
        return 2
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        if meta:
            print(f"{meta['model']} {meta['optimizer']} {meta['strategy']} dp{meta['dp']} x tp{meta['tp']}, {meta['steps']} steps")
        print(f"{len(df)} phase ranges, ranks {sorted(df['rank'].unique().tolist())}, steps {sorted(df['step'].unique().tolist())}\n")
        for title, frame in (
            ("phases (launch and wait stages apart)", phase_stats(df)),
            ("per step (us)", step_makespans(df)),
            ("optimizer step of the critical rank", critical_path(df)),
            ("communication: exposed (blocked) and hidden (overlapped) time per rank and step (us)", comm_exposure(df)),
        ):
            print(f"== {title}")
            print(table_text(frame), end="\n\n")
    if args.out:
        written = write_summary(df, args.out)
        if meta:
            write_meta(args.out, **meta)
        print(f"\nwrote {', '.join(sorted(written))}{' + meta.json' if meta else ''} under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
