"""`canzona demo` without its 4-process acts: the planning act prints Figure 3 beside the paper."""

from __future__ import annotations

import pytest

from canzona.cli import main


def test_demo_plan_act_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--skip-train", "--skip-verify"]) == 0
    out = capsys.readouterr().out
    assert "1. Plan: Qwen3-32B" in out
    assert "DP FLOPs ratio, after (Algorithm 1, alpha = 1)" in out and "1.43" in out
    assert "lb-asc-joint" in out and "lpt-carry" in out
    assert "2. Train" not in out and "3. Verify" not in out


def test_demo_rejects_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
