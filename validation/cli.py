"""Command line of the exactness suite: ``canzona validate`` and ``python -m validation``.

Exit codes: 0 every cell passed, 1 at least one cell failed (a mismatch, an error, a hung group),
2 bad input (unknown optimizer/strategy/mesh/dtype, a mesh larger than the processes available,
a report path that cannot be written), reported in one line before anything runs or is written.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from validation.matrix import CHECKS, DTYPES, MODELS, OPTIMIZERS, STANDARD_MESHES, STRATEGIES, Selection, build_matrix, default_max_procs, parse_mesh, parse_names

__all__ = ["add_arguments", "selection_from_args", "run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    level = parser.add_mutually_exclusive_group()
    level.add_argument("--quick", action="store_const", const="quick", dest="level", help="the CI subset (default; a few minutes on 2 CPU cores)")
    level.add_argument("--full", action="store_const", const="full", dest="level", help="the whole matrix (see docs/validation.md for its runtime)")
    parser.set_defaults(level="quick")
    parser.add_argument("--optimizer", action="append", metavar="NAMES", help=f"only these optimizers (comma-separated or repeated): {', '.join(OPTIMIZERS)}")
    parser.add_argument("--strategy", action="append", metavar="NAMES", help=f"only these strategies: {', '.join(STRATEGIES)}")
    parser.add_argument("--mesh", action="append", metavar="NAMES", help=f"only these meshes: dp<N>, tp<M>, dp<N>xtp<M> (standard: {', '.join(STANDARD_MESHES)})")
    parser.add_argument("--dtype", action="append", metavar="NAMES", help=f"only these parameter dtypes: {', '.join(DTYPES)}")
    parser.add_argument("--check", action="append", metavar="NAMES", help=f"only these checks: {', '.join(CHECKS)}")
    parser.add_argument("--model", action="append", metavar="NAMES", help=f"only these models: {', '.join(MODELS)}")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per cell (default: 3 quick, 4-5 full)")
    parser.add_argument("--max-procs", type=int, default=None, help="processes the suite may start at once (default: CPU count, at least 4)")
    parser.add_argument("--report", default=None, metavar="PATH", help="write PATH.json and PATH.csv (default: data/validation/report.json/.csv)")
    parser.add_argument("--no-report", action="store_true", help="do not write report files")
    parser.add_argument("--list", action="store_true", help="print the selected cells and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines, table only")


def selection_from_args(args: argparse.Namespace) -> Selection:
    """Validate the filters (ValueError with one readable line on bad input)."""
    max_procs = default_max_procs() if args.max_procs is None else args.max_procs
    if not isinstance(max_procs, int) or max_procs < 1:
        raise ValueError(f"--max-procs must be a positive integer, got {max_procs!r}")
    meshes = None
    if args.mesh:
        names: list[str] = []
        for v in args.mesh:
            for part in v.split(","):
                if part.strip():
                    spec = parse_mesh(part)
                    if spec.name not in names:
                        names.append(spec.name)
        if not names:
            raise ValueError("empty mesh list")
        meshes = tuple(names)
    return Selection(
        level=args.level,
        optimizers=parse_names(args.optimizer, OPTIMIZERS, "optimizer"),
        strategies=parse_names(args.strategy, STRATEGIES, "strategy"),
        meshes=meshes,
        dtypes=parse_names(args.dtype, DTYPES, "dtype"),
        checks=parse_names(args.check, CHECKS, "check"),
        models=parse_names(args.model, MODELS, "model"),
        steps=args.steps,
        max_procs=max_procs,
    )


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the suite for parsed arguments; ValueError for bad input (the caller prints it, exit 2)."""
    from validation.report import default_report_path, format_table
    from validation.suite import fault_from_env, run_suite

    sel = selection_from_args(args)
    if args.list:
        for c in build_matrix(sel):
            print(c.name)
        return 0
    report_path = None if args.no_report else (args.report or default_report_path())
    fault = fault_from_env()
    if argv is not None:  # python -m validation
        command = "python -m validation " + " ".join(shlex.quote(a) for a in argv)
    else:  # canzona validate: sys.argv[1:] starts with the subcommand
        command = "canzona " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    progress = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    res = run_suite(sel, report_path=report_path, fault=fault, command=command.strip(), progress=progress)
    print(format_table(res.report), end="")
    if res.write_error is not None:
        raise ValueError(res.write_error)  # after the table: the results computed are shown
    if res.paths is not None:
        print(f"report: {res.paths[0]} and {res.paths[1]}")
    return res.exit_code


def main(argv: list[str] | None = None) -> int:
    """``python -m validation [options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m validation", description="Canzona exactness suite: distributed updates vs single-device optimizers, bit for bit.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args, argv)
    except KeyboardInterrupt:
        print("validation: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        print(f"validation: error: {exc}", file=sys.stderr)
        return 2
