"""``canzona timeline``: a run's profiler timeline as one self-contained HTML page that works offline.

Examples::

    canzona timeline runs/prof                        # writes runs/prof/timeline.html
    canzona timeline runs/prof --out prof.html --step 2
    canzona timeline runs/prof/phases.csv             # a trace summary instead of the raw traces

RUN is what ``canzona profile --tensorboard RUN`` wrote (one ``*.pt.trace.json`` per rank,
summarised here by :func:`canzona.profiling.traces.load_traces`) or a trace summary
(``phases.csv`` / ``phases.parquet``, or its directory). The page draws one row per rank, a bar per
phase range, and every communication phase split into its launch (dotted) and wait (hatched)
stages, so exposed communication is visible at a glance. plotly.js is inlined into the page (about
5 MB) and the page references nothing on the network: unlike the TensorBoard profiler plugin, whose
views fetch a chart library from a CDN, it opens from a laptop without internet.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from canzona.commands.plan import one_line_errors

__all__ = ["add_arguments", "run", "timeline_html", "TIMELINE_HTML"]

#: the page's file name inside RUN when ``--out`` is not given
TIMELINE_HTML = "timeline.html"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser)
    parser.add_argument("run", type=Path, metavar="RUN",
                        help="a profile directory (*.pt.trace.json per rank) or a trace summary (phases.csv/.parquet or its directory)")
    parser.add_argument("--out", type=Path, default=None, help=f"HTML file to write (default: RUN/{TIMELINE_HTML}, beside a summary file)")
    parser.add_argument("--step", type=int, default=None, help="draw only this profiled step (default: every profiled step)")


def timeline_html(run: str | Path, *, step: int | None = None) -> str:
    """The self-contained HTML page of ``run``'s timeline (see the module docstring).

    Raises FileNotFoundError for a missing RUN and ValueError for one that holds no timeline."""
    from canzona.phase_names import COMM_PHASES
    from canzona.profiling.traces import stage_of
    from canzona.viz.timeline import fig_timeline, load_profile

    p = Path(run)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    prof = load_profile(p)
    phases = prof.phases.copy()
    if step is not None and step not in set(phases["step"]):
        raise ValueError(f"{p}: step {step} was not profiled (profiled steps: {', '.join(map(str, sorted(set(phases['step']))))})")
    # a communication phase's launch and wait are separate series: same colour, different texture
    stages = phases["part"].map(stage_of)
    comm = phases["phase"].isin(COMM_PHASES) & (stages != "")
    phases.loc[comm, "phase"] = phases.loc[comm, "phase"] + "/" + stages[comm]
    what = ", ".join(f"{k} {prof.meta[k]}" for k in ("strategy", "optimizer", "dp", "tp") if k in prof.meta)
    fig = fig_timeline(phases, step=step, title=what or p.name)
    for trace in fig.data:
        if trace.name.endswith("/wait"):
            trace.marker.pattern.shape = "/"
        elif trace.name.endswith("/launch"):
            trace.marker.pattern.shape = "."
    # include_plotlyjs=True inlines plotly.js; no MathJax, no CDN, no plotly logo link
    return fig.to_html(full_html=True, include_plotlyjs=True, include_mathjax=False,
                       config={"displaylogo": False})


def run(args: argparse.Namespace) -> int:
    from canzona.fileio import atomic_write

    if not args.run.exists():
        print(f"canzona timeline: error: {args.run}: no such file or directory", file=sys.stderr)
        return 2
    out = args.out or (args.run / TIMELINE_HTML if args.run.is_dir() else args.run.with_name(TIMELINE_HTML))
    if out.is_dir():
        print(f"canzona timeline: error: --out {out} is a directory; name the HTML file", file=sys.stderr)
        return 2
    page = timeline_html(args.run, step=args.step)
    atomic_write(out, page)
    print(f"timeline: {out} ({len(page) / 1e6:.1f} MB, self-contained: opens offline in any browser)")
    return 0
