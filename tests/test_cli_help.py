"""CLI consistency: every option of every command has a help text that shows its default, and
one FLOPs-shape default serves the planner, the commands, the figures and the notebooks."""

from __future__ import annotations

import argparse
import inspect

import pytest

from canzona.cli import COMMANDS, command_parser


def _options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_has_help_and_shows_its_default(name: str) -> None:
    _, parser = command_parser(name)
    fmt = parser._get_formatter()
    for a in _options(parser):
        flag = a.option_strings[-1]
        assert a.help, f"canzona {name} {flag}: no help text"
        shown = fmt._expand_help(a) if a.help else ""
        meaningful = not (a.default is None or a.default is False or a.default == [] or a.required)
        if meaningful:
            assert "default" in shown.lower(), f"canzona {name} {flag}: --help does not show its default {a.default!r}"
    text = parser.format_help()
    assert "(default: %(default)s)" not in text  # every placeholder expanded


def test_one_flops_shape_default_everywhere() -> None:
    from canzona.plan.build import plan_model
    from canzona.plan.plan import DEFAULT_FLOPS_SHAPE, PlanInputs
    from canzona.viz import export, microgroups, scaling, widgets

    assert DEFAULT_FLOPS_SHAPE == "full"
    assert PlanInputs.__dataclass_fields__["flops_shape"].default == DEFAULT_FLOPS_SHAPE
    for fn in (plan_model, export.main_figures, microgroups.cmax_sweep, microgroups.tp_sweep, scaling.plan_sweep,
               widgets.partition_explorer, widgets.strategy_explorer, widgets.microgroup_explorer):
        assert inspect.signature(fn).parameters["flops_shape"].default == DEFAULT_FLOPS_SHAPE, fn.__qualname__
    for name in ("plan", "figures"):
        _, parser = command_parser(name)
        assert parser.get_default("flops_shape") == DEFAULT_FLOPS_SHAPE, name
    # the two explorers on the partition notebook's first page start from the same inputs
    p, s = (inspect.signature(f).parameters for f in (widgets.partition_explorer, widgets.strategy_explorer))
    for k in ("model", "dp", "tp", "optimizer", "alpha", "cost", "flops_shape", "memory"):
        assert p[k].default == s[k].default, k


def test_readme_hardware_profiles_exist() -> None:
    import re
    from pathlib import Path

    from canzona.sim.hardware import available_hardware

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    names = re.findall(r"--hardware (\S+?)`", text)
    assert names and set(names) <= set(available_hardware())
