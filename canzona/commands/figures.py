"""``canzona figures``: write the notebooks' main figures as standalone HTML files.

Examples::

    canzona figures --out figures/
    canzona figures --out figures/ --model qwen3-14b --dp 16 --tp 4 --plotlyjs directory
    canzona figures --out figures/ --only partition_map microgroup_gantt
    canzona figures --out figures/ --profile data/profiles/sample --report data/validation/report.json
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
    from canzona.viz.export import FIGURE_NAMES, PLOTLYJS_MODES
    from canzona.viz.timeline import DEFAULT_PROFILE_DIR

    one_line_errors(parser)
    parser.add_argument("--out", required=True, type=Path, help="directory to write <figure>.html files and index.html into")
    parser.add_argument("--model", default="qwen3-32b", help=f"shipped model ({', '.join(available_models())}) or config JSON path")
    parser.add_argument("--dp", type=positive_int, default=32, help="DP size (default 32, the paper's)")
    parser.add_argument("--tp", type=positive_int, default=8, help="TP size (default 8, the paper's)")
    parser.add_argument("--optimizer", choices=optimizer_names(matrix=True), default="muon")
    parser.add_argument("--flops-shape", choices=("local", "full"), default="local",
                        help="FLOPs of TP-split matrices on the shard (the paper's accounting, default) or the full shape")
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE_DIR,
                        help=f"trace summary directory for the timeline figures (default {DEFAULT_PROFILE_DIR})")
    parser.add_argument("--no-profile", action="store_true", help="skip the timeline figures")
    parser.add_argument("--report", type=Path, default=None,
                        help="validation report JSON (default data/validation/report.json, else the shipped sample)")
    parser.add_argument("--only", nargs="+", choices=FIGURE_NAMES, metavar="NAME", help="build only these figures: " + ", ".join(FIGURE_NAMES))
    parser.add_argument("--plotlyjs", choices=tuple(PLOTLYJS_MODES), default="inline",
                        help="inline: every file self-contained (~5 MB each, offline); directory: one plotly.min.js beside them; cdn: online")


def run(args: argparse.Namespace) -> int:
    from canzona.commands._args import output_dir
    from canzona.viz.export import main_figures, write_figures

    output_dir(args.out, "--out")  # before building the figures: a bad folder fails at once
    t0 = time.perf_counter()
    figs = main_figures(
        model=args.model,
        dp=args.dp,
        tp=args.tp,
        optimizer=args.optimizer,
        flops_shape=args.flops_shape,
        profile=None if args.no_profile else args.profile,
        report=args.report,
        only=args.only,
    )
    paths = write_figures(figs, args.out, plotlyjs=args.plotlyjs)
    for p in paths:
        print(p)
    for name, why in figs.skipped.items():
        print(f"skipped {name}: {why}", file=sys.stderr)
    print(f"{len(figs.figures)} figures in {time.perf_counter() - t0:.1f} s -> {args.out}/index.html", file=sys.stderr)
    return 0
