"""How a subcommand's failure reaches the terminal: one line and an exit code, never a traceback.

:func:`run_command` runs a subcommand and turns what can go wrong into one line on stderr:

- a user mistake (:class:`canzona.cli.UserError`, ``ValueError``, an ``OSError`` on a file the
  user named) exits 2;
- a worker that failed, died, froze or ran past ``--timeout-s``
  (:class:`canzona.runtime.launch.WorkerError`) exits 1 with the rank and the cause; the worker's
  traceback is printed only with ``--debug`` (or ``CANZONA_DEBUG=1``);
- SIGINT or SIGTERM exits 128 + the signal number, after the launcher has stopped the workers.

With ``--debug`` every failure also prints its traceback, for bug reports.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import traceback
from typing import Any

__all__ = ["Terminated", "debug_enabled", "run_command"]


class Terminated(BaseException):  # noqa: N818 - named after the signal, as KeyboardInterrupt is
    """SIGTERM reached a command outside the launcher (which handles it itself)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def debug_enabled(args: argparse.Namespace | None = None) -> bool:
    """``--debug`` on the command line or ``CANZONA_DEBUG`` set to a non-empty value other than 0."""
    return bool(getattr(args, "debug", False)) or os.environ.get("CANZONA_DEBUG", "") not in ("", "0")


def _on_term(signum: int, _frame: Any) -> None:
    raise Terminated(signum)


def _say(name: str, line: str, exc: BaseException | None, debug: bool) -> None:
    if debug and exc is not None:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"canzona {name}: {line}", file=sys.stderr)


def run_command(name: str, module: Any, args: argparse.Namespace) -> int:
    """``module.run(args)`` with every failure reported as one line (see the module docstring)."""
    from canzona.errors import UserError
    from canzona.runtime.launch import LaunchInterrupted, WorkerError

    debug = debug_enabled(args)
    old = None
    if threading.current_thread() is threading.main_thread():
        old = signal.signal(signal.SIGTERM, _on_term)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt as exc:
        _say(name, "interrupted by SIGINT", exc, debug)
        return 128 + signal.SIGINT
    except Terminated as exc:
        _say(name, f"stopped by {signal.Signals(exc.signum).name}", exc, debug)
        return 128 + exc.signum
    except LaunchInterrupted as exc:
        _say(name, str(exc), exc, debug)
        return 128 + exc.signum
    except WorkerError as exc:
        hint = " (--debug prints the worker's traceback)" if not debug and "\n" in str(exc).strip() else ""
        _say(name, f"error: {exc.summary}{hint}", exc, debug)
        return 1
    except (UserError, ValueError) as exc:
        _say(name, f"error: {_one_line(exc)}", exc, debug)
        return 2
    except OSError as exc:  # a file the user named (or an output folder): one line naming the path
        where = f"{exc.filename}: " if exc.filename else ""
        _say(name, f"error: {where}{exc.strerror or exc}", exc, debug)
        return 2
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return " ".join(text.split("\n")) if text.count("\n") < 3 else text.splitlines()[0]
