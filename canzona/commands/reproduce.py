"""``canzona reproduce FIG``: the paper's numbers beside canzona's, with a verdict per row.

``FIG`` is one of :data:`canzona.reproduce.FIGURES` (fig3, fig4, fig6, fig7, fig8a, fig8b, fig9,
fig10a, fig11a, fig12, fig13, fig14, fig16) or ``all``; ``--json PATH`` writes the same rows
(``-`` for stdout). The computations live in :mod:`canzona.reproduce`; this module only prints.
"""

from __future__ import annotations

import argparse
import json

from canzona.commands._args import file_path, output_path, write_output
from canzona.commands.plan import one_line_errors
from canzona.paper import paper_value
from canzona.reproduce import FIGURES, NOT_REPRODUCED, OURS_ONLY, Figure, Row, fig3, reproduce

__all__ = ["Row", "Figure", "FIGURES", "PAPER_FIG3", "fig3", "format_figure", "add_arguments", "run"]

#: Figure 3 row -> the paper's value (read from :mod:`canzona.paper`), kept for callers of round one
PAPER_FIG3: dict[str, float] = {
    row: paper_value(key).value
    for row, key in {
        "dp_flops_before": "dp_flops_ratio_asc",
        "dp_memory_before": "dp_memory_ratio_asc",
        "dp_flops_after": "dp_flops_ratio_lb-asc",
        "dp_memory_after": "dp_memory_ratio_lb-asc",
        "tp_flops_before": "tp_flops_ratio_asc",
        "tp_flops_after": "tp_flops_ratio_lb-asc",
        "tp_memory_after": "tp_memory_ratio_lb-asc",
    }.items()
}


def _cell(v: object, width: int) -> str:
    if v is None:
        return f"{'-':>{width}}"
    if isinstance(v, float):
        return f"{v:>{width}.3f}" if abs(v) < 1e4 else f"{v:>{width}.3g}"
    return f"{'(trend)':>{width}}" if isinstance(v, str) and len(v) > width else f"{v!s:>{width}}"


def format_figure(fig: Figure) -> str:
    """The figure as a text table: label, paper, ours (paper convention), canzona's convention, verdict;
    then, per row, the trend evidence, the reason for a miss and why the conventions differ."""
    width = max(len(r.label) for r in fig.rows) + 2
    width = min(width, 78)
    head = f"{'':<{width}}{'paper':>9}{'ours':>9}{'canzona':>9}  verdict"
    out = [f"{fig.title}  [{fig.config}]", "", head, "-" * (len(head) + 12)]
    details: list[str] = []
    for i, r in enumerate(fig.rows, 1):
        label = r.label if len(r.label) <= width - 2 else r.label[: width - 5] + "..."
        ours = r.ours if not isinstance(r.ours, str) else "(below)"
        tol = f" ({r.tolerance})" if r.tolerance and r.verdict != OURS_ONLY else ""
        out.append(f"{label:<{width}}{_cell(r.paper, 9)}{_cell(ours, 9)}{_cell(r.canzona, 9)}  {r.verdict}{tol}  [{i}]")
        if isinstance(r.ours, str):
            details.append(f"[{i}] ours: {r.ours}")
        if r.verdict == NOT_REPRODUCED and r.reason:
            details.append(f"[{i}] why not: {r.reason}")
        if r.why:
            details.append(f"[{i}] paper vs canzona convention: {r.why}")
    out.append("")
    out += details
    out += [f"note: {n}" for n in fig.notes]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    one_line_errors(parser)
    keys = list(FIGURES) + ["all"]
    parser.add_argument("figure", choices=keys, metavar="FIG",
                        help="one of " + ", ".join(keys) + "; " + "; ".join(f"{k}: {v[0]}" for k, v in FIGURES.items()))
    parser.add_argument("--json", metavar="PATH", type=file_path, default=None, help="also write the rows as JSON to PATH ('-': stdout only)")


def run(args: argparse.Namespace) -> int:
    if args.json is not None and args.json != "-":
        output_path(args.json, "--json")  # before the work: an unwritable output fails at once
    keys = list(FIGURES) if args.figure == "all" else [args.figure]
    figs = [reproduce(k) for k in keys]
    doc = {"schema": "canzona.reproduce", "version": 1, "figures": [f.to_dict() for f in figs]}
    if args.json == "-":
        print(json.dumps(doc, indent=1))
        return 0
    text = "\n\n".join(format_figure(f) for f in figs)
    if len(figs) > 1:
        tally: dict[str, int] = {}
        for f in figs:
            for k, v in f.counts().items():
                tally[k] = tally.get(k, 0) + v
        text += "\n\nall figures: " + ", ".join(f"{v} {k}" for k, v in sorted(tally.items()))
    print(text)
    if args.json is not None:
        # atomic: a failed write (full disk) keeps the old file and names the path, exit 2
        write_output(args.json, json.dumps(doc, indent=1) + "\n")
    return 0
