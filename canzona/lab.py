"""The one door from the product to its lab: the exactness suite (the ``validation`` package).

The installed ``canzona`` package is the library, the CLI, the simulator and the figures; the
exactness suite (``validation/``: the single-device reference, the planted defects, the
distributed checks) is shipped beside it and imports ``canzona``, never the reverse. The few
product features that run the suite (``canzona validate``, ``canzona demo``'s verify act and the
``canzona_exact`` pytest fixture of :mod:`canzona.pytest_plugin`) reach it only through
:func:`suite`, imported when called, so importing any ``canzona`` module never imports the suite
and no import cycle can form between the two packages. ``tests/test_architecture.py`` enforces
that this module is the only one under ``canzona/`` that names ``validation``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from canzona.errors import UserError

__all__ = ["SUITE", "suite"]

#: the import name of the exactness suite's package
SUITE = "validation"


def suite() -> ModuleType:
    """The exactness suite's package, imported on first use: its public API is the names of
    ``validation.__all__`` (``run``, ``run_suite``, ``Selection``, ``format_table``, the CLI's
    ``add_arguments`` / ``run_cli`` ...). A :class:`~canzona.errors.UserError` with one line when the
    suite is not installed beside canzona."""
    try:
        return importlib.import_module(SUITE)
    except ModuleNotFoundError as exc:
        if exc.name != SUITE:
            raise
        raise UserError(f"the exactness suite ({SUITE!r}) is not installed beside canzona: reinstall canzona (pip install canzona) to get it") from None
