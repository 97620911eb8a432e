"""``canzona figures``: write the notebooks' main figures as files (HTML, PNG, SVG or PDF).

Examples::

    canzona figures --out figures/                                  # HTML sharing one plotly.min.js
    canzona figures --out figures/ --format png                     # static images (kaleido + Chromium)
    canzona figures --out figures/ --model qwen3-14b --dp 16 --tp 4
    canzona figures --out figures/ --only partition_map microgroup_gantt
    canzona figures --out figures/ --profile runs/prof              # a raw trace directory or a summary

Timeline figures read the newest profile under ``runs/`` when there is one, else the shipped
sample (and say so).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from canzona.commands._args import positive_int
from canzona.commands.plan import one_line_errors
from canzona.config import available_models
from canzona.optimizers import optimizer_names

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from canzona.plan.plan import DEFAULT_FLOPS_SHAPE, FLOPS_SHAPES
    from canzona.viz.export import FIGURE_NAMES, FORMATS, PLOTLYJS_MODES

    one_line_errors(parser)
    parser.add_argument("--out", required=True, type=Path, help="directory to write <figure>.<format> files and index.html into")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="html",
                        help="html (interactive) or a static picture: png, svg, pdf (needs kaleido and a Chrome/Chromium)")
    parser.add_argument("--model", default="qwen3-32b", help=f"shipped model ({', '.join(available_models())}) or config JSON path")
    parser.add_argument("--dp", type=positive_int, default=32, help="DP size; the paper ran 32")
    parser.add_argument("--tp", type=positive_int, default=8, help="TP size; the paper ran 8")
    parser.add_argument("--optimizer", choices=optimizer_names(matrix=True), default="muon", help="matrix optimizer")
    parser.add_argument("--flops-shape", choices=FLOPS_SHAPES, default=DEFAULT_FLOPS_SHAPE,
                        help="FLOPs of TP-split matrices on the full shape their host processes, or on the TP shard (the paper's accounting)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="trace summary directory or raw trace directory (*.pt.trace.json) for the timeline figures "
                             "(default: the newest run under runs/, else the shipped sample)")
    parser.add_argument("--no-profile", action="store_true", help="skip the timeline figures")
    parser.add_argument("--report", type=Path, default=None,
                        help="validation report JSON (default: the newest under runs/, else the shipped sample)")
    parser.add_argument("--only", nargs="+", choices=FIGURE_NAMES, metavar="NAME", help="build only these figures: " + ", ".join(FIGURE_NAMES))
    parser.add_argument("--plotlyjs", choices=tuple(PLOTLYJS_MODES), default="directory",
                        help="HTML only: directory: one plotly.min.js beside the files (offline, small files); "
                             "inline: every file self-contained (~5 MB each); cdn: loaded from the plotly CDN (online)")


def run(args: argparse.Namespace) -> int:
    from canzona.commands._args import output_dir
    from canzona.viz.export import LATEST, StaticExportError, main_figures, static_export_problem, write_figures

    if args.fmt != "html" and (problem := static_export_problem()) is not None:
        # before minutes of planning: the user learns at once what to install
        print(f"canzona figures: error: cannot write {args.fmt}: {problem}", file=sys.stderr)
        return 2
    output_dir(args.out, "--out")  # before building the figures: a bad folder fails at once
    for flag, given in (("--profile", args.profile), ("--report", args.report)):
        if given is not None and not given.exists():
            # a named input that is missing is a mistake, not a figure to skip
            print(f"canzona figures: error: {flag} {given}: no such file or directory", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    profile = None if args.no_profile else (args.profile or LATEST)
    figs = main_figures(
        model=args.model,
        dp=args.dp,
        tp=args.tp,
        optimizer=args.optimizer,
        flops_shape=args.flops_shape,
        profile=profile,
        report=args.report,
        only=args.only,
    )
    try:
        paths = write_figures(figs, args.out, fmt=args.fmt, plotlyjs=args.plotlyjs)
    except StaticExportError as exc:
        print(f"canzona figures: error: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    for note in figs.notes:
        print(note, file=sys.stderr)
    for name, why in figs.skipped.items():
        print(f"skipped {name}: {why}", file=sys.stderr)
    print(f"{len(figs.figures)} figures in {time.perf_counter() - t0:.1f} s -> {args.out}/index.html", file=sys.stderr)
    return 0
