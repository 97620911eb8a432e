"""``canzona validate``: the exactness suite (``validation/``): distributed updates vs single-device
optimizers, bit for bit. Exit 0 all cells passed, 1 any mismatch, 2 bad input."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from validation.cli import add_arguments as add

    add(parser)


def run(args: argparse.Namespace) -> int:
    from validation.cli import run as run_validation

    return run_validation(args)
