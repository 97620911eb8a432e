"""``canzona validate``: the exactness suite (``validation/``, reached through :func:`canzona.lab.suite`): distributed updates vs single-device
optimizers, bit for bit. Exit 0 all cells passed, 1 any mismatch, 2 bad input."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from canzona.lab import suite

    suite().add_cli_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from canzona.lab import suite

    _check_report(args.report)
    _check_kwargs(args.optimizer_kwargs, "--optimizer-kwargs")
    return suite().run_cli(args)


def _check_report(report: str | None) -> None:
    """``--report DIR``: a folder that already holds a report is refused before any work (the
    earlier report would be replaced without a word); a new or empty folder receives the pair."""
    from canzona.errors import UserError

    if report is None:
        return
    folder = Path(report)
    if folder.suffix.lower() in (".json", ".csv") or not folder.is_dir():
        return
    held = [n for n in ("report.json", "report.csv") if (folder / n).exists()]
    if held:
        raise UserError(f"--report {folder}: the folder already holds {' and '.join(held)}; name a new folder or a .json file")


def _check_kwargs(text: str | None, flag: str) -> None:
    """Learning rates and the like that no run can use (non-finite, or above
    :data:`canzona.train.MAX_LR`), refused in one line before any worker starts: inside a worker
    they end as an overflow deep in an optimizer. Negative values are left to the optimizer's
    constructor, which names them."""
    from canzona.errors import UserError
    from canzona.fileio import loads_json
    from canzona.train import MAX_LR

    if text is None:
        return
    doc = loads_json(text, flag, max_bytes=1 << 20)
    if not isinstance(doc, dict):
        return  # the suite names a document that is not an object
    for key in ("lr", "weight_decay"):
        v = doc.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not abs(v) <= MAX_LR:
            raise UserError(f"{flag}: {key} = {v:g} is above canzona's bound {MAX_LR:g} (a typo, or an overflow waiting to happen)")
