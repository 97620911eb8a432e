"""Summarize a torch.profiler trace directory: phase table, per-phase statistics, step makespans,
the optimizer step's critical path (a thin CLI over ``canzona.profiling.traces``).

    .venv/bin/python profiling/summarize_trace.py runs/prof                       # print
    .venv/bin/python profiling/summarize_trace.py runs/prof --out data/profiles/mine

``--out`` writes ``phases.csv`` (and ``phases.parquet`` when pyarrow is installed),
``phase_stats.csv``, ``step_makespans.csv``, ``critical_path.csv`` and copies the run's
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
    critical_path,
    load_traces,
    phase_stats,
    read_meta,
    step_makespans,
    write_meta,
    write_summary,
)


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
    fmt = {"float_format": lambda v: f"{v:,.1f}", "index": False}
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        if meta:
            print(f"{meta['model']} {meta['optimizer']} {meta['strategy']} dp{meta['dp']} x tp{meta['tp']}, {meta['steps']} steps")
        print(f"{len(df)} phase ranges, ranks {sorted(df['rank'].unique().tolist())}, steps {sorted(df['step'].unique().tolist())}\n")
        print(phase_stats(df).to_string(**fmt), end="\n\n")
        print(step_makespans(df).to_string(**fmt), end="\n\n")
        print(critical_path(df).to_string(**fmt))
    if args.out:
        written = write_summary(df, args.out)
        if meta:
            write_meta(args.out, **meta)
        print(f"\nwrote {', '.join(sorted(written))}{' + meta.json' if meta else ''} under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
