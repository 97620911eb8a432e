"""``canzona <command>``: a bad value on any subcommand is one line on stderr and exit code 2."""

from __future__ import annotations

import pytest

from canzona.cli import COMMANDS, main

#: one bad command line per subcommand (a value argparse's own type check refuses)
BAD_VALUES: dict[str, list[str]] = {
    "demo": ["--steps", "x"],
    "plan": ["--dp", "x"],
    "reproduce": ["no-such-figure"],
    "train": ["--steps", "x"],
    "validate": ["--no-such-option"],
    "profile": ["--steps", "x"],
    "simulate": ["--dp", "x"],
    "figures": ["--out", "unused", "--dp", "x"],
    "timeline": ["unused", "--step", "x"],
}


def test_every_subcommand_has_a_bad_value_case() -> None:
    assert set(BAD_VALUES) == set(COMMANDS)


@pytest.mark.parametrize("command", sorted(BAD_VALUES))
def test_bad_value_is_one_line(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([command, *BAD_VALUES[command]])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"canzona {command}: error: "), err
    assert "usage:" not in captured.err and captured.out == ""


def test_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["no-such-command"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown command" in err
