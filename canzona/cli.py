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

from canzona.commands._args import one_line_errors
from canzona.errors import UserError  # re-exported: subcommands raise canzona.cli.UserError

__all__ = ["COMMANDS", "DefaultsHelpFormatter", "command_parser", "main", "UserError"]

#: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("canzona.commands.demo", "the whole story on this machine: plan Qwen3-32B, train the tiny model, verdict"),
    "plan": ("canzona.commands.plan", "plan DP partitioning and TP micro-groups for a model (offline, milliseconds)"),
    "reproduce": ("canzona.commands.reproduce", "print a paper figure's numbers beside canzona's"),
    "train": ("canzona.commands.train", "train the tiny Qwen3 model on a DP x TP gloo/NCCL mesh"),
    "validate": ("canzona.commands.validate", "exactness suite: distributed updates vs single-device optimizers, bit for bit"),
    "profile": ("canzona.commands.profile", "profile training steps with torch.profiler (TensorBoard traces per rank)"),
    "simulate": ("canzona.commands.simulate", "predict iteration time per strategy at cluster scale"),
    "figures": ("canzona.commands.figures", "write the main figures as HTML, PNG, SVG or PDF files"),
    "timeline": ("canzona.commands.timeline", "write a profiled run's per-rank timeline as one offline HTML page"),
}


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows every option's default: "(default: X)" is appended to a help text that
    does not already name its default; flags (default False), options without a default (None)
    and required options are left as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if "default" in text.lower() or action.required or d is None or d is False or d == [] or d is argparse.SUPPRESS:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def command_parser(name: str) -> tuple[object, argparse.ArgumentParser]:
    """The module of subcommand ``name`` and its argument parser."""
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"canzona {name}", description=COMMANDS[name][1], formatter_class=DefaultsHelpFormatter)
    one_line_errors(parser)
    module.add_arguments(parser)
    parser.add_argument("--debug", action="store_true", help="on a failure, also print its traceback (or set CANZONA_DEBUG=1)")
    return module, parser


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
    module, parser = command_parser(name)
    args = parser.parse_args(argv[1:])
    from canzona.commands._run import run_command

    return run_command(name, module, args)  # every failure: one line and an exit code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
