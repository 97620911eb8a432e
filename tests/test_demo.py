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


def test_demo_shows_one_ratio_per_quantity(capsys) -> None:
    """Figure 3 in the demo: one reproduction column beside the paper's (no second convention's
    column), and the TP ratio of canzona's own table is the over-all-GPUs one for every planner."""
    import warnings

    from canzona.plan import plan_model

    assert main(["demo", "--skip-train", "--skip-verify"]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if "max/mean ratio" in line)
    assert head.split()[-3:] == ["paper", "canzona", "verdict"], head
    assert " ours " not in out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        m = plan_model("qwen3-32b", dp=32, tp=8, strategy="lb-asc", optimizer="muon").metrics
    row = next(line for line in out.splitlines() if line.split()[:1] == ["lb-asc"])
    assert row.split()[4] == f"{m.details['tp_flops_ratio_global']:.3f}", row
    # aligned: every row's verdict starts under the header's "verdict"
    lines = out.splitlines()
    i = lines.index(head)
    col = head.index("verdict")
    rows = lines[i + 2 : i + 9]
    assert all(r[col - 2 : col] == "  " and r[col] != " " for r in rows), rows
