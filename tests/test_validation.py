"""The exactness-validation suite (``validation/``, ``canzona validate``): it passes on the real
runtime, it fails on a planted defect naming exactly the cell and parameter, and bad input ends in
one line with exit code 2 and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from canzona.runtime.faults import Fault
from validation import PlantedFault, Selection, build_matrix, load_report, run_suite
from validation.cli import main as validate_main
from validation.compare import Comparator, compare_tensors
from validation.matrix import OPTIMIZERS, STANDARD_MESHES, parse_mesh
from validation.models import AWKWARD_TP_DIMS, AwkwardModel, shard_plain
from validation.report import CSV_COLUMNS, build_report, format_table, report_paths, write_report

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "canzona" / "data" / "validation-sample" / "report.json"


# ------------------------------------------------------------------------------ matrix and models


def test_quick_matrix_covers_every_optimizer_strategy_and_mesh() -> None:
    cells = build_matrix(Selection(level="quick"))
    names = [c.name for c in cells]
    assert len(names) == len(set(names))
    seen = {(c.optimizer, c.strategy, c.mesh) for c in cells if c.check == "injected"}
    for mesh in STANDARD_MESHES:
        strategies = ("sc", "layerwise", "asc", "lb-asc") + (("no-fuse",) if parse_mesh(mesh).tp > 1 else ())
        for opt in OPTIMIZERS:
            for s in strategies:
                assert (opt, s, mesh) in seen, (opt, s, mesh)
    assert not any(c.strategy == "no-fuse" and parse_mesh(c.mesh).tp == 1 for c in cells)
    assert {c.dtype for c in cells} == {"float32", "bfloat16"}
    assert {c.check for c in cells} == {"injected", "training"}
    full = build_matrix(Selection(level="full"))
    assert set(names) < {c.name for c in full}


def test_parse_mesh_canonical_names() -> None:
    assert parse_mesh("DP2xTP2") == parse_mesh("dp2xtp2")
    assert (parse_mesh("tp2").dp, parse_mesh("tp2").tp) == (1, 2)
    for bad in ("dp3", "tp4", "pp2", "", "dp1"):
        with pytest.raises(ValueError):
            parse_mesh(bad)


def test_awkward_model_has_the_promised_shapes() -> None:
    m = AwkwardModel()
    named = dict(m.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in named.items()}
    assert m.lm_head.weight is m.embed.weight and "lm_head.weight" not in named  # tied, listed once
    assert (1, 37) in shapes.values()  # 1 x n matrix
    assert shapes["tall.weight"][0] > shapes["tall.weight"][1] and shapes["wide.weight"][1] > shapes["wide.weight"][0]
    total = sum(p.numel() for p in named.values())
    assert named["big.weight"].numel() > total / 2  # larger than any rank's share at dp >= 2
    local = AwkwardModel()
    dims = shard_plain(local, AWKWARD_TP_DIMS, 1, 2)
    assert local.lm_head.weight is local.embed.weight and local.embed.weight.shape == (11, 9)
    full_big = named["big.weight"].detach()
    assert torch.equal(local.big.weight.detach(), full_big[24:]) and dims == AWKWARD_TP_DIMS


# ------------------------------------------------------------------------------ comparison


def test_compare_finds_one_ulp_and_its_index() -> None:
    a = torch.randn(5, 7)
    b = a.clone()
    b.view(-1)[13] = torch.nextafter(b.view(-1)[13], torch.tensor(float("inf")))
    c = compare_tensors("w", "value", a, b)
    assert not c.equal and c.mismatch is not None and c.mismatch.index == 13
    assert c.max_abs_diff == pytest.approx(abs(float(b.view(-1)[13]) - float(a.view(-1)[13])))
    assert compare_tensors("w", "value", a, a.clone()).equal
    assert not compare_tensors("w", "value", a, a.double()).equal  # dtype matters
    cmp = Comparator()
    cmp.states("w", {"exp_avg": a, "step": torch.tensor(2.0)}, {"exp_avg": a.clone()})
    assert cmp.first is not None and cmp.first.what == "state.step" and cmp.names() == ["w"]


def _fake_results(n_fail: int) -> list[dict]:
    out = []
    for i in range(3):
        bad = i < n_fail
        out.append(
            {
                "cell": f"injected/awkward/muon/sc/dp2/float32#{i}",
                "check": "injected",
                "model": "awkward",
                "optimizer": "muon",
                "strategy": "sc",
                "mesh": "dp2",
                "dtype": "float32",
                "steps": 3,
                "passed": not bad,
                "max_abs_diff": 2.0**-24 if bad else 0.0,
                "first_mismatch": {"param": "big.weight", "what": "value", "index": 5, "expected": 1.0, "got": 1.0000001} if bad else None,
                "seconds": 0.1,
            }
        )
    return out


def test_report_roundtrip_and_strict_loading(tmp_path: Path) -> None:
    rep = build_report(_fake_results(1), level="quick", command="test", seconds=1.0, settings={})
    assert rep["summary"] == {"cells": 3, "passed": 2, "failed": 1, "errors": 0, "seconds": 1.0}
    js, cs = write_report(rep, tmp_path / "r")
    assert (js.name, cs.name) == ("r.json", "r.csv")
    assert load_report(js)["cells"] == rep["cells"]
    header = cs.read_text().splitlines()[0].split(",")
    assert header == list(CSV_COLUMNS)
    assert "big.weight value[5]" in format_table(rep)
    bad = json.loads(js.read_text())
    bad["summary"]["passed"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="summary"):
        load_report(tmp_path / "bad.json")
    (tmp_path / "nan.json").write_text(js.read_text().replace('"seconds": 0.1', '"seconds": NaN', 1))
    with pytest.raises(ValueError):
        load_report(tmp_path / "nan.json")
    assert report_paths("x.csv")[0].name == "x.json"


def test_committed_sample_report_is_valid() -> None:
    doc = load_report(SAMPLE)
    assert doc["summary"]["cells"] > 0 and doc["summary"]["failed"] == 0
    assert (SAMPLE.with_suffix(".csv")).is_file()


# ------------------------------------------------------------------------------ bad input


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--optimizer", "adamax"], "unknown optimizer 'adamax'"),
        (["--strategy", "lb-asc,zigzag"], "unknown strategy 'zigzag'"),
        (["--mesh", "dp8"], "needs 8 processes"),
        (["--mesh", "dp2xtp2", "--max-procs", "2"], "needs 4 processes"),
        (["--mesh", "dp3"], "power of two"),
    ],
)
def test_bad_names_exit_2_with_one_line(argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = validate_main([*argv, "--report", str(tmp_path / "out" / "r.json")])
    assert rc == 2
    assert needle in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_canzona_validate_bad_input_goes_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from canzona.cli import main as canzona_main

    assert canzona_main(["validate", "--optimizer", "lion", "--report", str(tmp_path / "r.json")]) == 2
    assert _one_line_error(capsys).startswith("canzona validate: error: unknown optimizer 'lion'")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_report_path_exits_2_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    rc = validate_main(["--mesh", "dp2", "--optimizer", "adamw", "--strategy", "sc", "--report", str(blocker / "r.json")])
    assert rc == 2
    assert "cannot create the report directory" in _one_line_error(capsys)
    (tmp_path / "d.json").mkdir()
    rc = validate_main(["--mesh", "dp2", "--optimizer", "adamw", "--strategy", "sc", "--report", str(tmp_path / "d.json")])
    assert rc == 2
    assert "is a directory" in _one_line_error(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.json", "file"]
    assert list((tmp_path / "d.json").iterdir()) == []


# ------------------------------------------------------------------------------ the suite itself


@pytest.mark.slow
def test_quick_suite_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``canzona validate --quick`` on the real runtime: every cell bit-exact (training within its
    documented bound where bitwise equality is not expected), exit code 0, report written."""
    rc = validate_main(["--quick", "-q", "--report", str(tmp_path / "quick.json")])
    out = capsys.readouterr().out
    doc = load_report(tmp_path / "quick.json")
    failed = [c["cell"] + ": " + str(c.get("error") or c.get("first_mismatch")) for c in doc["cells"] if not c["passed"]]
    assert rc == 0, "\n".join(failed) + "\n" + out
    assert doc["summary"]["cells"] == len(build_matrix(Selection(level="quick")))
    assert doc["summary"]["failed"] == 0
    injected = [c for c in doc["cells"] if c["check"] == "injected"]
    assert all(c["max_abs_diff"] == 0.0 and c["compared"] > 0 for c in injected)
    assert (tmp_path / "quick.csv").is_file()


_FAULT_SEL = dict(optimizers=("muon",), strategies=("sc", "lb-asc"), dtypes=("float32",), checks=("injected",), models=("awkward",))


@pytest.mark.slow
def test_planted_ulp_after_the_step_is_reported_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A one-ulp error in one TP shard of one returned value (post-step hook, via the documented
    environment variables): exit 1, and the report names exactly that cell, parameter and index."""
    cell = "injected/awkward/muon/lb-asc/tp2/float32"
    # big.weight is 48 x 41, split over rows: flat index 1500 (row 36) lives on TP rank 1's shard
    monkeypatch.setenv("CANZONA_FAULT", "kind=ulp,param=big.weight,step=3,index=1500")
    monkeypatch.setenv("CANZONA_FAULT_CELL", cell)
    monkeypatch.setenv("CANZONA_FAULT_MODE", "post-step")
    rc = validate_main(["--mesh", "tp2", "--optimizer", "muon", "--strategy", "sc,lb-asc", "--check", "injected", "--model", "awkward", "--dtype", "float32", "--steps", "3", "-q", "--report", str(tmp_path / "f.json")])
    capsys.readouterr()
    assert rc == 1
    doc = load_report(tmp_path / "f.json")
    failed = [c for c in doc["cells"] if not c["passed"]]
    assert [c["cell"] for c in failed] == [cell]
    assert failed[0]["mismatched_params"] == ["big.weight"]
    assert failed[0]["first_mismatch"]["param"] == "big.weight" and failed[0]["first_mismatch"]["index"] == 1500
    assert 0 < failed[0]["max_abs_diff"] < 1e-6


def _runtime_fault(mesh: str, fault: Fault) -> dict:
    cell = f"injected/awkward/muon/lb-asc/{mesh}/float32"
    res = run_suite(Selection(level="quick", meshes=(mesh,), steps=3, **_FAULT_SEL), report_path=None, fault=PlantedFault(cell, fault, "runtime"))
    failed = [c for c in res.report["cells"] if not c["passed"]]
    assert res.exit_code == 1
    assert [c["cell"] for c in failed] == [cell]  # the clean sc cell still passes
    got = failed[0]
    # the fault is an update hook on the cell's optimizer, called after every owner/host step: it must fire
    assert got["fault"]["fired"], got.get("error")
    return got


@pytest.mark.slow
def test_planted_ulp_in_a_host_update_is_reported_exactly() -> None:
    """One ulp in the TP host's full update of big.weight at the last step (a FaultHook on the TP engine's update)."""
    got = _runtime_fault("tp2", Fault("ulp", "big.weight", step=3, index=7))
    assert got["mismatched_params"] == ["big.weight"]
    assert (got["first_mismatch"]["param"], got["first_mismatch"]["index"]) == ("big.weight", 7)


@pytest.mark.slow
def test_planted_stale_state_on_an_owner_is_reported_exactly() -> None:
    """odd.weight's owner loses its step-2 optimizer-state update (a FaultHook undoing that state change)."""
    got = _runtime_fault("dp2", Fault("stale_state", "odd.weight", step=2))
    assert got["mismatched_params"] == ["odd.weight"] and got["first_mismatch"]["param"] == "odd.weight"
