"""argparse helpers shared by the subcommands: value types and the one-line error handler."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, NoReturn

from canzona.errors import UserError

__all__ = ["add_cmax_argument", "file_path", "one_line_errors", "output_dir", "output_path", "positive_int", "positive_float", "write_output"]


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make argparse report a bad option as one line (``<prog>: error: ...``) and exit 2, instead
    of printing the usage block. :func:`canzona.cli.main` installs it on every subcommand's parser."""
    prog = parser.prog

    def error(message: str) -> NoReturn:
        print(f"{prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    parser.error = error  # type: ignore[method-assign]


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (NaN and inf are refused)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v


def file_path(text: str) -> str:
    """A non-empty path (``--json ''`` would otherwise be taken as "no output" in silence)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file path, got an empty string")
    return text


def _say(exc: OSError, path: str | os.PathLike[str]) -> str:
    return f"cannot write {exc.filename or path}: {exc.strerror or exc}"


def output_path(path: str | os.PathLike[str], what: str = "output") -> Path:
    """Check before the work that ``path`` can be written (its folder exists and is writable, it is
    not a folder); a :class:`canzona.errors.UserError` naming the path otherwise."""
    from canzona.fileio import check_writable

    try:
        return check_writable(path, what)
    except OSError as exc:
        raise UserError(_say(exc, path)) from None


def write_output(path: str | os.PathLike[str], data: str | bytes | Callable[[IO[bytes]], None]) -> Path:
    """Write a command's output file atomically (:func:`canzona.runtime.integrity.atomic_write`);
    an ``OSError`` (full disk, read-only folder ...) becomes one :class:`canzona.errors.UserError`
    line naming the path, with the old file left intact and no temporary file behind."""
    from canzona.fileio import atomic_write

    try:
        return atomic_write(path, data)
    except OSError as exc:
        raise UserError(_say(exc, path)) from None


def output_dir(path: str | os.PathLike[str], what: str = "output folder") -> Path:
    """Check before the work that folder ``path`` exists or can be created (its nearest existing
    ancestor is a writable folder); a :class:`canzona.errors.UserError` naming the path otherwise.
    Creates nothing."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise UserError(f"cannot write {p}: {what} exists and is not a folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UserError(f"cannot write {p}: {what} is not writable")
        return p
    ancestor = p.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"cannot create {p}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"cannot create {p}: {ancestor} is not writable")
    return p


def _refuse_cmax_mb(text: str) -> float:
    raise argparse.ArgumentTypeError(
        "the flag is gone: use --cmax, counted in 2^20 TP-local gradient elements per host (the paper's unit; "
        "the old --cmax-mb M of fp32 gathered gradient is --cmax M/(4 x tp))")


def add_cmax_argument(parser: argparse.ArgumentParser, default: float | None, default_text: str | None = None) -> None:
    """``--cmax`` (micro-group capacity C_max in the one unit every command and figure uses) and the
    retired ``--cmax-mb``, refused with one line naming ``--cmax``."""
    from canzona.plan.build import CMAX_UNIT
    shown = default_text or (f"{default:g}" if default is not None else "the planner's")
    parser.add_argument("--cmax", type=positive_float, default=default,
                        help=f"micro-group capacity C_max in {CMAX_UNIT}; a host's group gathers at most "
                             f"C_max x 2^20 x tp x grad-bytes bytes (default {shown})")
    parser.add_argument("--cmax-mb", type=_refuse_cmax_mb, default=None, help=argparse.SUPPRESS)
