"""Subcommands of the ``canzona`` CLI, one module each (see :mod:`canzona.cli`)."""
