"""``canzona plan`` and ``canzona reproduce`` in-process: output, exit codes, one-line errors."""

from __future__ import annotations

import json

import pytest

from canzona.cli import main
from canzona.commands.reproduce import PAPER_FIG3, fig3
from canzona.plan import STRATEGIES, Plan


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_table(capsys):
    code, out, err = _run(capsys, "plan", "--model", "qwen3-tiny", "--dp", "2", "--tp", "2", "--bucket-numel", "20000")
    assert code == 0 and err == ""
    assert "DP FLOPs ratio" in out and "micro-groups" in out and "fingerprint" in out


def test_plan_json_round_trips(capsys, tmp_path):
    path = tmp_path / "p.json"
    code, out, _ = _run(capsys, "plan", "--model", "qwen3-tiny", "--dp", "4", "--tp", "2", "--strategy",
                        "lb-asc-joint", "--bucket-numel", "5000", "--json", str(path))
    assert code == 0 and str(path) in out
    plan = Plan.from_json(path)
    assert plan.inputs.strategy == "lb-asc-joint" and plan.inputs.dp == 4
    assert json.loads(path.read_text())["schema"] == "canzona.plan"


def test_plan_accepts_config_path(capsys, tmp_path):
    from canzona.config import MODELS_DIR

    cfg = tmp_path / "m.json"
    cfg.write_text((MODELS_DIR / "qwen3-tiny.json").read_text())
    code, out, _ = _run(capsys, "plan", "--model", str(cfg), "--dp", "2")
    assert code == 0 and "qwen3-tiny" in out


def test_compare_has_one_row_per_strategy(capsys):
    code, out, _ = _run(capsys, "plan", "--model", "qwen3-32b", "--dp", "32", "--tp", "8", "--compare")
    assert code == 0
    rows = [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in STRATEGIES]
    assert rows == list(STRATEGIES)


def test_list_strategies(capsys):
    code, out, _ = _run(capsys, "plan", "--list-strategies")
    assert code == 0 and out.split() == list(STRATEGIES)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "qwen3-nope", "--dp", "2"], "unknown model"),
        (["--model", "qwen3-tiny", "--dp", "0"], "--dp"),
        (["--model", "qwen3-tiny", "--dp", "2", "--alpha", "1.5"], "alpha"),
        (["--model", "qwen3-tiny", "--dp", "x"], "integer"),
        (["--model", "qwen3-tiny", "--dp", "2", "--strategy", "greedy"], "invalid choice"),
        (["--model", "qwen3-tiny", "--dp", "2", "--json", "/nonexistent-dir/p.json"], "does not exist"),
        (["--model", "qwen3-tiny", "--dp", "2", "--strategy", "sc", "--tp", "2", "--tp-schedule", "lpt"], "sync"),
        (["--dp", "2"], "--model"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(main(["plan", *argv]))
    _, err = capsys.readouterr()
    assert exc.value.code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err and "Traceback" not in err


def test_malformed_config_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "hidden_size": "big"}')
    code, _, err = _run(capsys, "plan", "--model", str(bad), "--dp", "2")
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_unwritable_json_path_is_a_directory(capsys, tmp_path):
    code, _, err = _run(capsys, "plan", "--model", "qwen3-tiny", "--dp", "2", "--json", str(tmp_path))
    assert code == 2 and "directory" in err


def test_fig3_after_ratios_reproduce_the_paper():
    rows = {r.key: r for r in fig3().rows}
    assert abs(rows["dp_flops_after"].ours - 1.43) <= 0.03
    assert abs(rows["dp_memory_after"].ours - 1.11) <= 0.03
    assert rows["dp_flops_after"].paper == PAPER_FIG3["dp_flops_after"]
    # the joint planner (beyond the paper) balances FLOPs and state memory together
    assert max(rows["joint_flops"].ours, rows["joint_memory"].ours) <= 1.10


def test_reproduce_cli(capsys):
    code, out, _ = _run(capsys, "reproduce", "fig3")
    assert code == 0 and "paper" in out and "1.43" in out and "note:" in out
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "fig99"])
    assert exc.value.code == 2
