"""The one exception type of a user's mistake on the command line.

A subcommand raises :class:`UserError` for input the user can fix (a path that cannot be written,
a flag that contradicts another); :func:`canzona.cli.main` prints its message as one line and
exits 2. It lives in its own module so that the CLI and the argument helpers of
:mod:`canzona.commands` both import it without importing each other.
"""

from __future__ import annotations

__all__ = ["UserError"]


class UserError(Exception):
    """Raised by a subcommand for a mistake the user can fix; printed as one line, exit 2."""
