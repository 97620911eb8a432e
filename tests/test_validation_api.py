"""The gate for the user's own optimizer and model: ``validation.run``, ``canzona validate
--optimizer/--model PATH``, separability probes, the training gate's independent oracle and its
planted defects, the pytest plugin, progress and report wording."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest
import torch

from validation import NotSeparableError, PlantedFault, Selection, TargetError, build_matrix, load_report, probe_separable, run, run_suite
from validation.cli import _Progress
from validation.cli import main as validate_main
from validation.report import build_report, cell_detail, default_report_path, format_summary, latest_report, report_dir_paths, result_label

ROOT = Path(__file__).resolve().parents[1]
SIGN = "examples.sign_momentum:SignMomentum"
MLP = "examples.tiny_mlp:tiny_mlp"


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------------------ import paths, bad input


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--optimizer", "nosuch_pkg.mod:Opt"], "optimizer nosuch_pkg.mod:Opt: cannot import module 'nosuch_pkg.mod'"),
        (["--optimizer", "examples.sign_momentum:Nope"], "optimizer examples.sign_momentum:Nope: module 'examples.sign_momentum' has no attribute 'Nope'"),
        (["--optimizer", "examples.tiny_mlp:tiny_mlp"], "expected a torch.optim.Optimizer subclass"),
        (["--optimizer", SIGN, "--optimizer-kwargs", '{"lr": -1}'], f"optimizer {SIGN}: construction with kwargs"),
        (["--optimizer", SIGN, "--optimizer-kwargs", "[1, 2]"], "--optimizer-kwargs: expected a JSON object"),
        (["--optimizer", SIGN, "--optimizer-kwargs", "{lr: 1}"], "--optimizer-kwargs: not valid JSON"),
        (["--model", "examples.tiny_mlp:nothing"], "model examples.tiny_mlp:nothing: module 'examples.tiny_mlp' has no attribute"),
        (["--model", MLP, "--model-kwargs", '{"width": 3}'], f"model {MLP}: construction failed (TypeError"),
        (["--model", "examples.sign_momentum:SignMomentum"], "construction failed"),
        (["--optimizer", "not a path"], "unknown optimizer 'not a path'"),
    ],
)
def test_bad_paths_exit_2_with_one_line_naming_the_path(argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from canzona.cli import main as canzona_main

    rc = canzona_main(["validate", *argv, "--mesh", "dp2", "--report", str(tmp_path / "out")])
    assert rc == 2
    line = _one_line(capsys)
    assert line.startswith("canzona validate: error:") and needle in line, line
    assert not (tmp_path / "out").exists()


def test_run_refuses_classes_workers_cannot_import() -> None:
    class Local(torch.optim.SGD):
        pass

    with pytest.raises(TargetError, match="module level in an importable module"):
        run(Local, meshes="dp2")


def test_run_takes_fsdp_mesh_names_strictly() -> None:
    """``validation.run`` reads FSDP2 mesh names as ``--mesh`` does: any case, exact names only,
    one-line errors before any process starts."""
    with pytest.raises(ValueError, match="^unknown FSDP2 mesh 'fsdp8'; the FSDP2 meshes are fsdp2, fsdp4, fsdp2xtp2, hsdp2x2$"):
        run("muon", meshes="dp2,fsdp8")
    with pytest.raises(ValueError, match="FSDP2 meshes run only the fsdp-toy and fsdp-moe models"):
        run("muon", "awkward", meshes=["FSDP2"])
    cells = build_matrix(Selection(optimizers=(SIGN,), meshes=("fsdp2xtp2",), level="full"))
    assert {(c.model, c.check) for c in cells} == {("fsdp-toy", "injected")} and {c.optimizer for c in cells} == {SIGN}
    assert {c.strategy for c in cells} == {"sc", "asc", "lb-asc", "no-fuse"} and {c.dtype for c in cells} == {"float32", "bfloat16", "bf16-mixed"}


def test_custom_names_build_the_quick_subset_on_the_meshes_asked_for() -> None:
    cells = build_matrix(Selection(optimizers=(SIGN,), meshes=("dp2", "dp2xtp2")))
    assert {c.optimizer for c in cells} == {SIGN} and {c.mesh for c in cells} == {"dp2", "dp2xtp2"}
    assert {c.check for c in cells} == {"injected", "training"}
    assert not any(c.strategy in ("zero1", "lb-asc-joint") for c in cells)
    model_cells = build_matrix(Selection(models=(MLP,), meshes=("dp2",)))
    assert {c.model for c in model_cells} == {MLP} and {c.check for c in model_cells} == {"injected"}  # no forward/data: injected only


# ------------------------------------------------------------------------------ separability probes


@pytest.mark.parametrize(
    ("name", "kind", "words"),
    [
        ("GlobalNormClipped", "reads-other-parameters", "global gradient norm"),
        ("SharedCounter", "param-group-counter", "param_groups entry 't'"),
        ("OutsideState", "state-outside-self-state", "self.momenta"),
        ("UnseededNoise", "non-deterministic", "not deterministic"),
    ],
)
def test_probe_names_the_reason(name: str, kind: str, words: str) -> None:
    import examples.nonseparable as ns

    with pytest.raises(NotSeparableError, match=words) as info:
        probe_separable(getattr(ns, name), {})
    assert info.value.kind == kind


def test_probe_accepts_separable_optimizers() -> None:
    from canzona.optim import SOAP, Muon, Shampoo
    from examples.nonseparable import PerProcessNoise  # deterministic within one process: only the run can tell
    from examples.sign_momentum import ClippedSignMomentum, SignMomentum
    from validation.checks import OPTIMIZER_KWARGS

    for cls, kw in ((Muon, OPTIMIZER_KWARGS["muon"]), (Shampoo, OPTIMIZER_KWARGS["shampoo"]), (SOAP, OPTIMIZER_KWARGS["soap"]), (torch.optim.AdamW, {}), (SignMomentum, {}), (PerProcessNoise, {})):
        probe_separable(cls, kw)
    with pytest.raises(NotSeparableError, match="reads other parameters"):
        probe_separable(ClippedSignMomentum, {})


def test_cli_refuses_a_non_separable_optimizer_before_any_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = validate_main(["--optimizer", "examples.sign_momentum:ClippedSignMomentum", "--mesh", "dp2", "--report", str(tmp_path / "r")])
    assert rc == 1
    line = _one_line(capsys)
    assert line.startswith("canzona validate: refused:") and "reads other parameters" in line and "clipping inside step()" in line
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------------------ report: place, wording, summary


def test_report_goes_under_runs_by_default_and_into_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for var in ("CANZONA_RUNS_DIR", "CANZONA_RUNS"):
        monkeypatch.delenv(var, raising=False)
    p = default_report_path()
    assert p.name == "report.json" and p.parent.parent == tmp_path / "runs" / "validation"
    assert report_dir_paths(tmp_path / "d") == (tmp_path / "d" / "report.json", tmp_path / "d" / "report.csv")
    assert report_dir_paths("x.json")[1].name == "x.csv"
    from validation.report import write_report

    rep = build_report([], level="quick", command="t", seconds=0.0, settings={})
    write_report(rep, p)
    assert latest_report(tmp_path) == p
    # with $CANZONA_RUNS_DIR the report goes where every results view looks for it
    monkeypatch.setenv("CANZONA_RUNS_DIR", str(tmp_path / "elsewhere"))
    assert default_report_path().parent.parent == (tmp_path / "elsewhere" / "validation").resolve()


def _cell(**kw: object) -> dict:
    base = {"cell": "c", "check": "training", "model": "qwen3", "optimizer": "muon", "strategy": "sc", "mesh": "dp2", "dtype": "float32", "steps": 3, "seconds": 0.5, "first_mismatch": None}
    base.update(kw)
    return base


def test_wording_tells_bit_identical_from_bounded_and_the_summary_is_compact() -> None:
    exact = _cell(cell="a", passed=True, max_abs_diff=0.0, bitwise_expected=True, bitwise=True, compared=12)
    bounded = _cell(cell="b", passed=True, max_abs_diff=3e-7, bitwise_expected=False, bitwise=False, worst={"param": "w", "what": "grad@step2", "diff": 3e-7, "bound": 1e-4})
    failed = _cell(cell="f", passed=False, max_abs_diff=0.5, first_mismatch={"param": "q_norm", "what": "grad@step1", "index": 3, "expected": 1.0, "got": 0.5})
    assert (result_label(exact), result_label(bounded), result_label(failed)) == ("PASS", "PASS~", "FAIL")
    assert cell_detail(exact).startswith("bit-identical")
    assert "within bound" in cell_detail(bounded) and "3e-07 <= 0.0001" in cell_detail(bounded) and "identical" not in cell_detail(bounded)
    assert cell_detail(failed) == "q_norm grad@step1[3]: expected 1, got 0.5"
    text = format_summary(build_report([exact, bounded, failed], level="custom", command="t", seconds=1.0, settings={}))
    assert "\nf " in text and "\na " not in text and "\nb " not in text  # failures in full, passes counted
    assert "3 cells: 2 passed (1 bit-identical, 1 within a documented bound), 1 failed" in text


def test_progress_prints_one_plain_line_per_cell_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    bar = _Progress(2, stream=sys.stderr)
    bar.cell({"cell": "injected/x", "passed": True, "bitwise_expected": True, "bitwise": True, "seconds": 0.25})
    bar.cell({"cell": "training/y", "passed": False, "error": "boom", "seconds": 1.0})
    bar.close()
    assert capsys.readouterr().err.splitlines() == ["[1/2] PASS  injected/x 0.25s", "[2/2] ERROR training/y 1.00s"]


def test_pytest_plugin_is_declared_as_an_entry_point() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\ncanzona = "canzona.pytest_plugin"' in text


# ------------------------------------------------------------------------------ multi-process


@pytest.mark.slow
def test_cli_custom_optimizer_on_custom_model_with_tp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The user's optimizer on the user's model (its canzona_tp_dims split over TP), through the
    CLI: every cell bit-identical, report in the directory asked for."""
    rc = validate_main(["--optimizer", SIGN, "--optimizer-kwargs", '{"lr": 0.01, "weight_decay": 0.1}', "--model", MLP, "--mesh", "tp2", "--strategy", "sc,lb-asc", "--dtype", "float32", "-q", "--report", str(tmp_path / "rep")])
    out = capsys.readouterr().out
    doc = load_report(tmp_path / "rep" / "report.json")
    assert rc == 0, out
    assert [c["cell"] for c in doc["cells"]] == [f"injected/{MLP}/{SIGN}/{s}/tp2/float32" for s in ("sc", "lb-asc")]
    assert all(c["max_abs_diff"] == 0.0 and c["replicas_checked"] > 0 for c in doc["cells"])
    assert "2 passed (2 bit-identical" in out


@pytest.mark.slow
def test_training_gate_catches_planted_defects_on_every_rank() -> None:
    """Issue 17's defects, each planted in one cell of one process group: a missing TP reduction of
    the q/k-norm gradients (caught by the single-process oracle on the gradients), optimizer
    state doubled on DP rank 1 after the last step (caught by the replica check), a learning rate
    1.5x on DP rank 1 (caught by the bitwise comparison with the single-device optimizer). The
    clean cells of the same groups pass."""
    qk = "training/qwen3/muon/lb-asc/dp2xtp2/float32"
    state = "training/qwen3/muon/sc/dp2/float32"
    lr = "training/qwen3/muon/lb-asc/dp2/float32"
    injected = "injected/awkward/muon/sc/dp2/float32"  # the injected check reads every replica too
    expert = "injected/qwen3-moe/muon/lb-asc/dp2/float32"  # one expert stepped with its neighbour's gradient
    res = run_suite(
        Selection(optimizers=("muon",), strategies=("sc", "lb-asc"), meshes=("dp2", "dp2xtp2"), dtypes=("float32",),
                  models=("awkward", "qwen3", "qwen3-moe"), steps=2),
        report_path=None,
        fault=[
            PlantedFault(qk, "qk-norm-unreduced", "defect"),
            PlantedFault(state, "state-on-dp1", "defect"),
            PlantedFault(lr, "lr-on-dp1", "defect"),
            PlantedFault(injected, "state-on-dp1", "defect"),
            PlantedFault(expert, "expert-gradient-swap", "defect"),
        ],
    )
    by = {c["cell"]: c for c in res.report["cells"]}
    assert sorted(c["cell"] for c in res.failures) == sorted([qk, state, lr, injected, expert]), res.table(full=True)
    # the gate names the stack and the expert, and only that expert's values differ
    from validation.defects import SWAPPED_EXPERT

    e = by[expert]
    assert e["fault"]["fired"] and e["first_mismatch"]["param"] == "model.layers.0.mlp.experts.gate_up_proj", e
    assert e["first_mismatch"]["expert"] == SWAPPED_EXPERT and e["mismatched_params"] == ["model.layers.0.mlp.experts.gate_up_proj"], e
    assert f"gate_up_proj expert {SWAPPED_EXPERT} value" in res.table()
    assert by["injected/qwen3-moe/muon/sc/dp2/float32"]["passed"]
    assert by[injected]["first_mismatch"]["what"].startswith("replica@rank1:state."), by[injected]
    assert by["training/qwen3/muon/sc/dp2xtp2/float32"]["measured"]["grad"] < 1e-5  # the oracle's rounding, not a defect
    m = by[qk]
    assert m["measured"]["grad"] > 0.1 and any("norm" in p for p in m["mismatched_params"]), m
    s = by[state]["first_mismatch"]
    assert s["what"].startswith("replica@rank1:state.") and s["got"] == 2 * s["expected"], s
    # a learning rate that differs per rank is refused by the runtime itself at the step (every
    # rank's hyperparameter digest is compared, canzona.runtime.dp.HyperparameterMismatch) before
    # any value moves; the gate reports that cell as failed with the runtime's reason
    assert "hyperparameters differ" in (by[lr].get("error") or ""), by[lr]
    assert all(c.get("error") is None for c in res.report["cells"] if c["cell"] != lr)


_PLUGIN_TESTS = '''
from examples.nonseparable import PerProcessNoise
from examples.sign_momentum import SignMomentum


def test_sign_momentum_is_exact(canzona_exact):
    res = canzona_exact(SignMomentum, meshes=["dp2"], strategies=["sc", "lb-asc"], model="awkward", checks=["injected"], dtypes=["float32"])
    assert res.ok and len(res.report["cells"]) == 2


def test_per_process_noise_is_not(canzona_exact):
    canzona_exact(PerProcessNoise, meshes=["dp2"], strategies=["sc"], model="awkward", checks=["injected"], dtypes=["float32"])
'''


@pytest.mark.slow
def test_pytest_plugin_passes_and_fails_with_the_cell_table(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A project's test file using the ``canzona_exact`` fixture: the separable optimizer passes;
    one seeded per process (its noise differs between ranks; no in-process probe can see it) fails
    with the table naming the cell, the parameter and the first differing entry."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    pytester.makepyfile(test_project=_PLUGIN_TESTS)
    loaded = any(ep.value == "canzona.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    args = [] if loaded else ["-p", "canzona.pytest_plugin"]
    result = pytester.runpytest_subprocess(*args, "-q", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    assert "canzona_exact: 1 of 1 cells failed" in text
    assert "injected/awkward/examples.nonseparable:PerProcessNoise/sc/dp2/float32" in text and "FAIL" in text
    assert "value@dp1" in text or "replica@rank1" in text


def test_a_failed_report_write_keeps_the_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A full disk while writing the report: the table is still printed, one error line, exit 1."""
    import errno

    import validation.suite as suite
    from validation import SuiteResult

    def fake_run_suite(sel, *, report_path, **kw):  # noqa: ANN001, ANN003 - stands in for the workers
        rep = build_report([_cell(cell="a", passed=True, max_abs_diff=0.0, bitwise_expected=True, bitwise=True, compared=3)], level="custom", command="t", seconds=1.0, settings={})
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            return SuiteResult(rep, None, f"cannot write the report {report_path}: {exc.strerror}")

    monkeypatch.setattr(suite, "run_suite", fake_run_suite)
    rc = validate_main(["--mesh", "dp2", "--optimizer", "adamw", "--strategy", "sc", "-q", "--report", str(tmp_path / "r")])
    captured = capsys.readouterr()
    assert rc == 1
    assert "1 cells: 1 passed" in captured.out
    assert captured.err.strip() == f"canzona validate: error: cannot write the report {tmp_path / 'r' / 'report.json'}: No space left on device"


def test_replica_comparison_names_the_rank_and_entry() -> None:
    from validation.compare import Comparator
    from validation.replicas import compare_replicas

    m = torch.arange(6.0).reshape(2, 3)
    r0 = {"owner:w[0:6]": {"master": m, "state.momentum_buffer": m * 2, "state.step": 3}, "param:b": torch.ones(2), "owner:only[0:2]": {"master": m}}
    r1 = {"owner:w[0:6]": {"master": m.clone(), "state.momentum_buffer": m * 4, "state.step": 3}, "param:b": torch.ones(2)}
    cmp = Comparator()
    assert compare_replicas([r0, r1], cmp) == 2  # 'only' is held by one rank: nothing to compare
    assert [(x.param, x.what, x.index) for x in cmp.mismatches] == [("w", "replica@rank1:state.momentum_buffer", 1)]
    cmp = Comparator()
    compare_replicas([{"param:b@tp0": torch.ones(2)}, {"param:b@tp0": torch.tensor([1.0, float("nan")])}], cmp, label="@step2")
    assert cmp.first is not None and cmp.first.what == "replica@rank1@step2:param" and cmp.first.param == "b"
