"""``canzona validate``: the exactness suite (``validation/``, reached through :func:`canzona.lab.suite`): distributed updates vs single-device
optimizers, bit for bit. Exit 0 all cells passed, 1 any mismatch, 2 bad input."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from canzona.lab import suite

    suite().add_cli_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from canzona.lab import suite

    return suite().run_cli(args)
