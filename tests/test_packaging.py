"""The conda environment and pyproject list the same dependencies; everything the package reads
is package data; the CLI front door works."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from canzona.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent


def _names(reqs: list[str]) -> set[str]:
    out = set()
    for r in reqs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)", r)
        if m and m.group(1) not in ("python", "pip", "-e"):
            out.add(m.group(1).lower().replace("_", "-"))
    return out


def test_environment_yml_matches_pyproject() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    declared = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        declared += extra
    env_lines = (ROOT / "environment.yml").read_text().splitlines()
    env_reqs = [ln.strip()[2:].strip() for ln in env_lines if ln.strip().startswith("- ")]
    env_reqs = [r for r in env_reqs if r not in ("conda-forge", "pip:") and not r.startswith("-e")]
    assert _names(declared) == _names(env_reqs)


def test_package_data_globs_cover_canzona_data() -> None:
    """Every file under canzona/data/ matches a package-data glob, so the wheel ships it (a new
    sample or config cannot be forgotten); tests/test_wheel.py checks the built wheel itself."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["canzona"]
    pkg = ROOT / "canzona"
    shipped = {p for g in globs for p in pkg.glob(g) if p.is_file()}
    on_disk = {p for p in (pkg / "data").rglob("*") if p.is_file()}
    assert sorted(str(p.relative_to(pkg)) for p in on_disk - shipped) == []
    assert all(any(pkg.glob(g)) for g in globs), "a package-data glob matches nothing"


def test_default_inputs_live_in_the_package() -> None:
    """The files the library opens when the user names none resolve inside the installed package,
    never relative to a checkout's top-level data/ or the working directory, and they load."""
    from canzona.config import MODELS_DIR, PACKAGE_DATA, available_models
    from canzona.sim.hardware import HARDWARE_DIR
    from canzona.viz.exactness import SAMPLE_REPORT, load_validation_report
    from canzona.viz.timeline import DEFAULT_PROFILE_DIR, load_profile

    assert PACKAGE_DATA == Path(__import__("canzona").__file__).resolve().parent / "data"
    for path in (MODELS_DIR, HARDWARE_DIR, DEFAULT_PROFILE_DIR, SAMPLE_REPORT):
        assert path.is_relative_to(PACKAGE_DATA) and path.exists(), path
    assert "qwen3-32b" in available_models()
    assert load_validation_report(SAMPLE_REPORT)["summary"]["cells"] > 0
    prof = load_profile(DEFAULT_PROFILE_DIR)
    assert len(prof.phases) > 0 and prof.meta["strategy"] == "lb-asc"


def test_torch_requirement_is_a_range_not_a_bare_name() -> None:
    # A bare `torch` would let pip choose a multi-GB CUDA build on a fresh machine.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_reqs = [d for d in deps if d.startswith("torch")]
    assert torch_reqs and all(any(op in d for op in (">=", "==", "~=")) for d in torch_reqs)


def test_every_cli_command_module_exists() -> None:
    import importlib

    for name, (module, _) in COMMANDS.items():
        mod = importlib.import_module(module)
        assert callable(mod.add_arguments) and callable(mod.run), name


def test_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown command" in err[0]


def test_top_level_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_readme_names_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci


@pytest.mark.parametrize("text", ["0", "-3", "x", "1.5"])
def test_positive_int_refuses(text: str) -> None:
    import argparse

    from canzona.commands._args import positive_int

    with pytest.raises(argparse.ArgumentTypeError):
        positive_int(text)


@pytest.mark.parametrize("text", ["0", "-1e-3", "nan", "inf", "x"])
def test_positive_float_refuses(text: str) -> None:
    import argparse

    from canzona.commands._args import positive_float

    with pytest.raises(argparse.ArgumentTypeError):
        positive_float(text)


def test_positive_values_pass() -> None:
    from canzona.commands._args import positive_float, positive_int

    assert positive_int("4") == 4 and positive_float("0.25") == 0.25


def test_bad_number_on_the_command_line_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "nan"])
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "positive integer" in err[0]
