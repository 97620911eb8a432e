"""Command line of the exactness suite: ``canzona validate`` and ``python -m validation``.

Exit codes: 0 every cell passed, 1 at least one cell failed (a mismatch, an error, a hung group)
or the optimizer cannot be exact under distribution (refused before running, with the reason),
2 bad input (unknown optimizer/strategy/mesh/dtype, an optimizer or model path that cannot be
imported or constructed, a mesh larger than the processes available, a report path that cannot
be written), reported in one line before anything runs or is written.

Output: a progress display per cell on stderr (a tqdm bar on a terminal, one plain line per cell
otherwise; none with ``-q``), then the compact summary on stdout (failing cells in full, passes
counted; ``--table`` prints every row).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from validation.matrix import CHECKS, DTYPES, FSDP_MESH_NAMES, MODELS, OPTIMIZERS, STANDARD_MESHES, STRATEGIES, Selection, build_matrix, default_max_procs, parse_mesh, parse_names

__all__ = ["add_arguments", "selection_from_args", "run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    level = parser.add_mutually_exclusive_group()
    level.add_argument("--quick", action="store_const", const="quick", dest="level", help="the CI subset (default; a few minutes on 2 CPU cores)")
    level.add_argument("--full", action="store_const", const="full", dest="level", help="the whole matrix (see docs/validation.md for its runtime)")
    parser.set_defaults(level="quick")
    parser.add_argument(
        "--optimizer",
        action="append",
        metavar="NAMES",
        help=f"optimizers (comma-separated or repeated): {', '.join(OPTIMIZERS)}, or your own per-parameter torch.optim.Optimizer "
        "class as an import path package.module:Name (importable in every worker: an installed package or PYTHONPATH); default: the built-ins",
    )
    parser.add_argument("--optimizer-kwargs", metavar="JSON", default=None, help="keyword arguments for the optimizer as a JSON object, e.g. '{\"lr\": 0.01}' (default: the suite's settings for built-ins, none for yours)")
    parser.add_argument("--model-kwargs", metavar="JSON", default=None, help="keyword arguments for a model given as an import path, as a JSON object (default: none)")
    parser.add_argument(
        "--strategy", action="append", metavar="NAMES", help=f"only these strategies: {', '.join(STRATEGIES)} (FSDP2 meshes: sc, asc, lb-asc, no-fuse)"
    )
    parser.add_argument(
        "--mesh",
        action="append",
        metavar="NAMES",
        help=f"only these meshes: ZeRO-1 dp<N>, tp<M>, dp<N>xtp<M> (standard: {', '.join(STANDARD_MESHES)}) and FSDP2 "
        f"{', '.join(FSDP_MESH_NAMES)} (dp_shard 2, dp_shard 4, dp_shard 2 x tp 2, dp_replicate 2 x dp_shard 2); default: all eight",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        metavar="NAMES",
        help=f"only these parameter dtypes: {', '.join(DTYPES)} (bf16-mixed: FSDP2 meshes only, fp32 parameters with "
        "FSDP2's MixedPrecisionPolicy, bf16 compute and fp32 gradient reduction)",
    )
    parser.add_argument("--check", action="append", metavar="NAMES", help=f"only these checks: {', '.join(CHECKS)}")
    parser.add_argument(
        "--model",
        action="append",
        metavar="NAMES",
        help=f"models: {', '.join(MODELS)} (fsdp-toy, fsdp-moe: the FSDP2 meshes' models, and theirs only; qwen3-moe: DP meshes only), or an import path "
        "package.module:factory to a callable returning an nn.Module (injected check on ZeRO-1 meshes; optional attribute "
        "canzona_tp_dims declares its TP splits); default: the built-ins",
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per cell (default: 3 quick, 4-5 full)")
    parser.add_argument("--max-procs", type=int, default=None, help="processes the suite may start at once (default: CPU count, at least 4)")
    parser.add_argument("--report", default=None, metavar="DIR", help="write report.json and report.csv into DIR (a path ending in .json or .csv names the pair instead; default: runs/validation/<timestamp>/)")
    parser.add_argument("--no-report", action="store_true", help="do not write report files")
    parser.add_argument("--list", action="store_true", help="print the selected cells and exit")
    parser.add_argument("--table", action="store_true", help="print every cell's row (default: failing cells in full, passes counted)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress display, summary only")


def selection_from_args(args: argparse.Namespace) -> Selection:
    """Validate the filters (ValueError with one readable line on bad input)."""
    from validation.targets import parse_kwargs

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
        optimizers=parse_names(args.optimizer, OPTIMIZERS, "optimizer", paths=True),
        strategies=parse_names(args.strategy, STRATEGIES, "strategy"),
        meshes=meshes,
        dtypes=parse_names(args.dtype, DTYPES, "dtype"),
        checks=parse_names(args.check, CHECKS, "check"),
        models=parse_names(args.model, MODELS, "model", paths=True),
        steps=args.steps,
        max_procs=max_procs,
        optimizer_kwargs=parse_kwargs(getattr(args, "optimizer_kwargs", None), "--optimizer-kwargs") or None,
        model_kwargs=parse_kwargs(getattr(args, "model_kwargs", None), "--model-kwargs") or None,
    )


class _Progress:
    """One update per finished cell: a tqdm bar on a terminal, plain lines otherwise (pipes, CI logs)."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.done = 0
        self.bar = None
        if self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="cell", file=self.stream, dynamic_ncols=True)

    def cell(self, r: dict[str, Any]) -> None:
        from validation.report import result_label

        self.done += 1
        label = result_label({"passed": r.get("passed"), "error": r.get("error"), "bitwise_expected": r.get("bitwise_expected"), "bitwise": r.get("bitwise")})
        if self.bar is not None:
            self.bar.set_postfix_str(f"{label} {r.get('cell')}", refresh=False)
            self.bar.update(1)
            if label in ("FAIL", "ERROR"):
                self.bar.write(f"{label} {r.get('cell')}")
        else:
            width = len(str(self.total))
            seconds = r.get("seconds")
            t = f" {seconds:.2f}s" if isinstance(seconds, (int, float)) else ""
            print(f"[{self.done:>{width}}/{self.total}] {label:<5} {r.get('cell')}{t}", file=self.stream, flush=True)

    def mesh(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the suite for parsed arguments; ValueError for bad input (the caller prints it, exit 2);
    an optimizer that cannot be exact is refused with its reason (exit 1)."""
    from validation.probe import NotSeparableError
    from validation.report import default_report_path, report_dir_paths
    from validation.suite import fault_from_env, run_suite

    sel = selection_from_args(args)
    cells = build_matrix(sel)
    if args.list:
        for c in cells:
            print(c.name)
        return 0
    report_path = None if args.no_report else (report_dir_paths(args.report)[0] if args.report else default_report_path())
    fault = fault_from_env()
    if argv is not None:  # python -m validation
        command = "python -m validation " + " ".join(shlex.quote(a) for a in argv)
    else:  # canzona validate: sys.argv[1:] starts with the subcommand
        command = "canzona " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    bar = None if args.quiet else _Progress(len(cells))
    try:
        res = run_suite(
            sel,
            report_path=report_path,
            fault=fault,
            command=command.strip(),
            progress=bar.mesh if bar is not None else None,
            on_cell=bar.cell if bar is not None else None,
        )
    except NotSeparableError as exc:
        print(f"canzona validate: refused: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    print(res.table(full=args.table), end="")
    if res.paths is not None:
        print(f"report: {res.paths[0]} and {res.paths[1]}")
    if res.write_error is not None:
        print(f"canzona validate: error: {res.write_error}", file=sys.stderr)
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
