"""The ``canzona`` command line: one entry point, one module per subcommand.

Each subcommand lives in ``canzona.commands.<name>`` and defines ``add_arguments(parser)`` and
``run(args) -> int``; it is imported only when chosen, so ``canzona plan`` never pays for torch.distributed
start-up. A user mistake (bad name, bad number, unreadable file) ends with one line on stderr and
exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["COMMANDS", "main", "UserError"]

#: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("canzona.commands.demo", "the whole story on this machine: plan Qwen3-32B, train the tiny model, verdict"),
    "plan": ("canzona.commands.plan", "plan DP partitioning and TP micro-groups for a model (offline, milliseconds)"),
    "reproduce": ("canzona.commands.reproduce", "print a paper figure's numbers beside canzona's"),
    "train": ("canzona.commands.train", "train the tiny Qwen3 model on a DP x TP gloo/NCCL mesh"),
    "validate": ("canzona.commands.validate", "exactness suite: distributed updates vs single-device optimizers, bit for bit"),
    "profile": ("canzona.commands.profile", "profile training steps with torch.profiler (TensorBoard traces per rank)"),
    "simulate": ("canzona.commands.simulate", "predict iteration time per strategy at cluster scale"),
    "figures": ("canzona.commands.figures", "write the main figures as standalone HTML"),
}


class UserError(Exception):
    """Raised by a subcommand for a mistake the user can fix; printed as one line, exit 2."""


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="canzona",
        description="Canzona: exact, load-balanced Muon/Shampoo/SOAP under ZeRO-1 DP and TP (arXiv 2602.06079).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = _top_parser()
        if argv and argv[0] not in ("-h", "--help"):
            print(f"canzona: error: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"canzona {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("canzona: interrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError) as exc:
        print(f"canzona {name}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file the user named (or an output folder): one line naming the path
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"canzona {name}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
