"""argparse helpers shared by the subcommands: value types and the one-line error handler."""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

__all__ = ["positive_int", "positive_float", "one_line_errors"]


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
