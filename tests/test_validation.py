"""The exactness-validation suite (``validation/``, ``canzona validate``): it passes on the real
runtime, it fails on a planted defect naming exactly the cell and parameter, and bad input ends in
one line with exit code 2 and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from validation.faults import Fault
from validation import PlantedFault, Selection, build_matrix, load_report, run_suite
from validation.cli import main as validate_main
from validation.compare import Comparator, compare_tensors
from validation.matrix import FSDP_MESH_NAMES, OPTIMIZERS, STANDARD_MESHES, parse_mesh, process_groups
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
    assert not any(c.strategy == "no-fuse" and parse_mesh(c.mesh).tp == 1 and parse_mesh(c.mesh).fsdp is None for c in cells)
    assert {c.dtype for c in cells} == {"float32", "bfloat16", "bf16-mixed"}
    assert {c.check for c in cells} == {"injected", "training"}
    full = build_matrix(Selection(level="full"))
    assert set(names) < {c.name for c in full}


def test_moe_cells_one_in_quick_and_the_dp_meshes_in_full() -> None:
    """--quick has one MoE cell (ZeRO-1 lb-asc at dp2, Muon); --full runs the tiny Qwen3-MoE at dp2
    and dp4 with sc, asc and lb-asc under every optimizer (Shampoo and SOAP on its non-square
    (8, 64, 32) stacks included), never on a TP mesh; asking for one there is one line."""
    quick = [c.name for c in build_matrix(Selection(level="quick")) if c.model == "qwen3-moe"]
    assert quick == ["injected/qwen3-moe/muon/lb-asc/dp2/float32"]
    full = [c for c in build_matrix(Selection(level="full")) if c.model == "qwen3-moe"]
    got = {(c.mesh, c.strategy, c.optimizer) for c in full}
    for mesh in ("dp2", "dp4"):
        for opt in ("muon", "shampoo", "soap", "adamw"):
            for strategy in ("sc", "asc", "lb-asc"):
                assert (mesh, strategy, opt) in got
        assert (mesh, "zero1", "adamw") in got
    assert {(c.check, c.dtype) for c in full} == {("injected", "float32")}
    assert all(parse_mesh(c.mesh).tp == 1 and parse_mesh(c.mesh).fsdp is None for c in full)
    with pytest.raises(ValueError, match="qwen3-moe runs on DP meshes"):
        build_matrix(Selection(meshes=("tp2",), models=("qwen3-moe",)))


def test_comparator_names_the_expert_of_a_stack() -> None:
    """A mismatch in an (E, M, N) stack, in its values or in a per-expert state stacked as
    (E, M, M), names the expert the flat index falls in; other tensors name none."""
    a = torch.zeros(8, 4, 3)
    b = a.clone()
    b[5, 2, 1] = 1.0
    cmp = Comparator(experts={"mlp.experts.w": 8})
    cmp.tensors("mlp.experts.w", "value", a, b)
    assert cmp.first.expert == 5 and cmp.first.index == 5 * 12 + 2 * 3 + 1
    assert "mlp.experts.w expert 5 value[67]" in str(cmp.first) and cmp.first.as_dict()["expert"] == 5
    sq, sq2 = torch.zeros(8, 4, 4), torch.zeros(8, 4, 4)
    sq2[7, 0, 0] = 1.0
    cmp = Comparator(experts={"mlp.experts.w": 8})
    cmp.states("mlp.experts.w", {"L": sq}, {"L": sq2})
    assert (cmp.first.what, cmp.first.expert) == ("state.L", 7)
    cmp = Comparator(experts={"mlp.experts.w": 8})
    cmp.tensors("dense.weight", "value", torch.zeros(8, 2), torch.ones(8, 2))
    assert cmp.first.expert is None and "expert" not in cmp.first.as_dict()


def test_fsdp_moe_comparison_names_the_expert() -> None:
    """The FSDP2 MoE cells' comparison: the reference of FSDPMoEToy steps every expert alone, a
    run equal to it passes, and one element changed in expert 2 of a stack is named there."""
    from canzona.optim import Shampoo
    from validation.fsdp2_cells import compare_fsdp
    from validation.fsdp_harness import fsdp_reference

    ref = fsdp_reference(Shampoo, {"lr": 0.01, "precondition_frequency": 1}, {"lr": 0.01}, dtype=torch.float32, dp=2, steps=2, model="fsdp-moe")
    assert {n: len(t) for n, t in ref.experts.items()} == {"layers.0.experts.gate_up": 4, "layers.1.experts.down": 3}
    assert ref.states()["layers.1.experts.down"]["L"].shape == (3, 6, 6)
    params = ref.params()
    doc = {"params": ref.master_values(), "state": ref.states()}
    assert compare_fsdp(params, doc, ref).equal
    params["layers.1.experts.down"] = params["layers.1.experts.down"].clone()
    params["layers.1.experts.down"][2, 1, 1] += 1.0
    cmp = compare_fsdp(params, doc, ref)
    assert (cmp.first.param, cmp.first.expert, cmp.first.index) == ("layers.1.experts.down", 2, 2 * 30 + 6)


def test_reference_steps_each_expert_alone_and_stacks_its_state() -> None:
    """ReferenceRunner with kinds={stack: "experts"}: each expert is stepped by its own optimizer
    state, bitwise what the optimizer does to that (M, N) matrix alone; the state comes back
    stacked along the expert index, for Shampoo's (M, M) and (N, N) preconditioners too."""
    from canzona.optim import Shampoo
    from validation.harness import ReferenceRunner

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0)))
    kw = {"lr": 0.01, "precondition_frequency": 1}
    ref = ReferenceRunner(model, Shampoo, kw, kinds={"w": "experts"})
    alone = [model.w.detach()[e].clone() for e in range(3)]
    opts = [Shampoo([t], **kw) for t in alone]
    for step in range(2):
        g = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(10 + step))
        ref.step({"w": g})
        for e, (t, o) in enumerate(zip(alone, opts)):
            t.grad = g[e].clone()
            o.step()
    assert torch.equal(ref.params()["w"], torch.stack(alone))
    st = ref.states()["w"]
    assert st["L"].shape == (3, 5, 5) and st["R"].shape == (3, 4, 4)
    for e, o in enumerate(opts):
        assert torch.equal(st["L"][e], o.state[alone[e]]["L"]) and torch.equal(st["R"][e], o.state[alone[e]]["R"])


def test_parse_mesh_canonical_names() -> None:
    assert parse_mesh("DP2xTP2") == parse_mesh("dp2xtp2")
    assert (parse_mesh("tp2").dp, parse_mesh("tp2").tp) == (1, 2)
    assert parse_mesh("dp2").fsdp is None
    for bad in ("dp3", "tp4", "pp2", "", "dp1"):
        with pytest.raises(ValueError):
            parse_mesh(bad)


def test_parse_mesh_fsdp_names_match_the_fsdp_meshes() -> None:
    """The four FSDP2 names map onto validation.fsdp_harness's meshes, with their process count; any
    other fsdp/hsdp spelling is refused in one line that lists the four."""
    import math

    from validation.fsdp_harness import FSDP_MESHES

    want = {"fsdp2": "dp_shard2", "fsdp4": "dp_shard4", "fsdp2xtp2": "dp_shard2_tp2", "hsdp2x2": "dp_replicate2_dp_shard2"}
    assert FSDP_MESH_NAMES == tuple(want)
    for name, key in want.items():
        spec = parse_mesh(name.upper())
        assert (spec.name, spec.fsdp) == (name, key)
        shape, dims = FSDP_MESHES[key]
        assert spec.world == math.prod(shape)
        assert spec.tp == (shape[dims.index("tp")] if "tp" in dims else 1)
    for bad in ("fsdp8", "fsdp3", "fsdp", "hsdp2", "hsdp4x2", "fsdp2xtp4", "fsdp2x tp2", "fsdp2xdp2", "hsdp2x2xtp2"):
        with pytest.raises(ValueError) as info:
            parse_mesh(bad)
        msg = str(info.value)
        assert "\n" not in msg and f"unknown FSDP2 mesh {bad!r}" in msg and "fsdp2, fsdp4, fsdp2xtp2, hsdp2x2" in msg
    with pytest.raises(ValueError, match="or an FSDP2 mesh \\(fsdp2, fsdp4, fsdp2xtp2, hsdp2x2\\)"):
        parse_mesh("pp2")


def test_quick_and_full_select_the_fsdp_cells() -> None:
    """--full: every FSDP2 mesh x FSDP2 strategy x optimizer x dtype on the FSDP2 toy (injected
    check only); --quick: a few of them on every FSDP2 mesh; nothing FSDP2-only leaks onto a
    ZeRO-1 mesh. FSDP2 meshes share the process group of the ZeRO-1 mesh of their size."""
    full = build_matrix(Selection(level="full"))
    moe = [c for c in full if parse_mesh(c.mesh).fsdp is not None and c.model == "fsdp-moe"]
    assert {(c.mesh, c.strategy, c.optimizer, c.dtype) for c in moe} == {
        (m, s, o, "float32") for m in ("fsdp2", "fsdp4") for s in ("sc", "lb-asc") for o in OPTIMIZERS
    }
    fsdp = [c for c in full if parse_mesh(c.mesh).fsdp is not None and c.model != "fsdp-moe"]
    assert {(c.mesh, c.strategy, c.optimizer, c.dtype) for c in fsdp} == {
        (m, s, o, d) for m in FSDP_MESH_NAMES for s in ("sc", "asc", "lb-asc", "no-fuse") for o in OPTIMIZERS for d in ("float32", "bfloat16", "bf16-mixed")
    }
    assert {(c.check, c.model) for c in fsdp} == {("injected", "fsdp-toy")} and len(fsdp) == len({c.name for c in fsdp})
    zero1 = [c for c in full if parse_mesh(c.mesh).fsdp is None]
    assert not any(c.model in ("fsdp-toy", "fsdp-moe") or c.dtype == "bf16-mixed" for c in zero1)
    quick = [c for c in build_matrix(Selection(level="quick")) if parse_mesh(c.mesh).fsdp is not None]
    assert {c.mesh for c in quick} == set(FSDP_MESH_NAMES) and 4 <= len(quick) <= 16
    assert {c.dtype for c in quick} == {"float32", "bfloat16", "bf16-mixed"}
    assert {c.optimizer for c in quick if c.mesh == "fsdp2"} == set(OPTIMIZERS)
    assert {c.strategy for c in quick if c.mesh == "fsdp2"} == {"sc", "asc", "lb-asc", "no-fuse"}
    assert {c.name for c in quick} < {c.name for c in fsdp}
    # the user's optimizer takes Muon's FSDP2 cells
    sign = "examples.sign_momentum:SignMomentum"
    custom = build_matrix(Selection(optimizers=(sign,), meshes=("fsdp2", "hsdp2x2")))
    assert {c.optimizer for c in custom} == {sign} and {c.mesh for c in custom} == {"fsdp2", "hsdp2x2"}
    with pytest.raises(ValueError, match="FSDP2 meshes run only the fsdp-toy and fsdp-moe models"):
        build_matrix(Selection(meshes=("fsdp2",), models=("awkward",)))
    assert process_groups(["dp2", "tp2", "dp2xtp2", "dp4", *FSDP_MESH_NAMES]) == [["dp2", "fsdp2"], ["tp2"], ["dp2xtp2", "fsdp4", "fsdp2xtp2", "hsdp2x2"], ["dp4"]]
    assert process_groups(["hsdp2x2", "fsdp2", "fsdp4", "dp4"]) == [["dp4", "hsdp2x2", "fsdp4"], ["fsdp2"]]


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
        (["--mesh", "fsdp8"], "unknown FSDP2 mesh 'fsdp8'; the FSDP2 meshes are fsdp2, fsdp4, fsdp2xtp2, hsdp2x2"),
        (["--mesh", "hsdp2x2", "--max-procs", "2"], "needs 4 processes"),
        (["--mesh", "fsdp2", "--dtype", "bf16"], "unknown dtype 'bf16'"),
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
    """``canzona validate --quick`` on the real runtime: every cell bit-exact (training: gradients
    against one process within their documented bound, parameters bitwise), exit code 0, report
    written."""
    rc = validate_main(["--quick", "-q", "--report", str(tmp_path / "quick.json")])
    out = capsys.readouterr().out
    doc = load_report(tmp_path / "quick.json")
    failed = [c["cell"] + ": " + str(c.get("error") or c.get("first_mismatch")) for c in doc["cells"] if not c["passed"]]
    assert rc == 0, "\n".join(failed) + "\n" + out
    assert doc["summary"]["cells"] == len(build_matrix(Selection(level="quick")))
    assert doc["summary"]["failed"] == 0
    injected = [c for c in doc["cells"] if c["check"] == "injected"]
    assert all(c["max_abs_diff"] == 0.0 and c["compared"] > 0 for c in injected)
    # training: parameters bitwise equal to the single-device optimizer on the run's DP-mean
    # gradients, and every strategy bitwise equal to sc, at every DP size (dp4 included: every
    # DP reduction sums in rank order)
    training = [c for c in doc["cells"] if c["check"] == "training"]
    assert {c["mesh"] for c in training} >= {"dp2", "dp4"}
    assert all(c["params_identical"] and c["rtol"]["value"] == 0.0 for c in training), [c["cell"] for c in training if not c["params_identical"]]
    assert all(c["vs_sc_identical"] for c in training if c["strategy"] != "sc"), [c["cell"] for c in training if not c.get("vs_sc_identical")]
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


#: one runtime fault per mesh, both planted in one run: dp2 and tp2 are both 2-rank meshes, so
#: their cells share one spawned group; each test reads its own mesh's cells
_RUNTIME_FAULTS = {
    "tp2": Fault("ulp", "big.weight", step=3, index=7),
    "dp2": Fault("stale_state", "odd.weight", step=2),
}


@pytest.fixture(scope="module")
def runtime_fault_run():
    faults = [PlantedFault(f"injected/awkward/muon/lb-asc/{mesh}/float32", fault, "runtime") for mesh, fault in _RUNTIME_FAULTS.items()]
    return run_suite(Selection(level="quick", meshes=tuple(_RUNTIME_FAULTS), steps=3, **_FAULT_SEL), report_path=None, fault=faults)


def _runtime_fault(res, mesh: str) -> dict:
    cell = f"injected/awkward/muon/lb-asc/{mesh}/float32"
    assert res.exit_code == 1
    cells = [c for c in res.report["cells"] if c["mesh"] == mesh]
    assert sorted(c["strategy"] for c in cells) == ["lb-asc", "sc"]
    failed = [c for c in cells if not c["passed"]]
    assert [c["cell"] for c in failed] == [cell]  # the clean sc cell still passes
    got = failed[0]
    # the fault is an update hook on the cell's optimizer, called after every owner/host step: it must fire
    assert got["fault"]["fired"], got.get("error")
    return got


@pytest.mark.slow
def test_planted_ulp_in_a_host_update_is_reported_exactly(runtime_fault_run) -> None:
    """One ulp in the TP host's full update of big.weight at the last step (a FaultHook on the TP engine's update)."""
    got = _runtime_fault(runtime_fault_run, "tp2")
    assert got["mismatched_params"] == ["big.weight"]
    assert (got["first_mismatch"]["param"], got["first_mismatch"]["index"]) == ("big.weight", 7)


@pytest.mark.slow
def test_planted_stale_state_on_an_owner_is_reported_exactly(runtime_fault_run) -> None:
    """odd.weight's owner loses its step-2 optimizer-state update (a FaultHook undoing that state change)."""
    got = _runtime_fault(runtime_fault_run, "dp2")
    assert got["mismatched_params"] == ["odd.weight"] and got["first_mismatch"]["param"] == "odd.weight"


# ------------------------------------------------------------------------------ FSDP2 cells


_FSDP_CELL = "injected/fsdp-toy/muon/lb-asc/fsdp2/float32"


def test_fsdp_judgement_needs_both_comparisons_and_a_visible_fault() -> None:
    """An FSDP2 cell passes only when the per-tensor comparison and validation.fsdp_harness's agree
    that nothing differs; a planted fault that left no trace fails it; a differing state entry is
    named with its element."""
    from validation.fsdp2_cells import compare_fsdp, judge_fsdp
    from validation.matrix import Cell

    cell = Cell("injected", "fsdp-toy", "muon", "lb-asc", "fsdp2", "float32", 3)
    w = torch.arange(6.0).reshape(2, 3)

    class Ref:
        def params(self) -> dict:
            return {"w": w}

        def master_values(self) -> dict:
            return {"w": w}

        def states(self) -> dict:
            return {"w": {"momentum_buffer": w * 2}}

    clean = compare_fsdp({"w": w.clone()}, {"params": {"w": w.clone()}, "state": {"w": {"momentum_buffer": w * 2}}}, Ref())
    assert clean.equal and clean.compared == 3
    ok = judge_fsdp(cell, clean, [], None, 0.5)
    assert ok["passed"] and ok["max_abs_diff"] == 0.0 and ok["bitwise_expected"] and ok["cell"] == _FSDP_CELL
    disagree = judge_fsdp(cell, clean, ["param:w"], None, 0.5)
    assert not disagree["passed"] and "validation.fsdp_harness's comparison" in disagree["error"]
    silent = judge_fsdp(cell, clean, [], Fault("ulp", "nosuch", step=2, index=0), 0.5)
    assert not silent["passed"] and "left no trace" in silent["error"] and silent["fault"]["detected"] is False
    off = (w * 2).clone()
    off.view(-1)[4] = torch.nextafter(off.view(-1)[4], torch.tensor(float("inf")))
    bad = compare_fsdp({"w": w.clone()}, {"params": {"w": w.clone()}, "state": {"w": {"momentum_buffer": off}}}, Ref())
    caught = judge_fsdp(cell, bad, ["state:w[momentum_buffer]"], Fault("stale_state", "w", step=2), 0.5)
    assert not caught["passed"] and caught.get("error") is None and caught["fault"]["detected"]
    assert (caught["first_mismatch"]["param"], caught["first_mismatch"]["what"], caught["first_mismatch"]["index"]) == ("w", "state.momentum_buffer", 4)
    missing = compare_fsdp({"w": w.clone()}, {"params": {}, "state": {}}, Ref())
    assert [m.what for m in missing.mismatches] == ["master", "state.momentum_buffer"]


def test_fsdp_cells_refuse_post_step_faults_before_any_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    sel = Selection(meshes=("fsdp2",), optimizers=("muon",), strategies=("lb-asc",), dtypes=("float32",))
    with pytest.raises(ValueError, match="runtime faults only"):
        run_suite(sel, report_path=None, fault=PlantedFault(_FSDP_CELL, Fault("ulp", "layers.1.up"), "post-step"))
    monkeypatch.setenv("CANZONA_FAULT", "kind=ulp,param=layers.1.up,step=2,index=3")
    monkeypatch.setenv("CANZONA_FAULT_CELL", _FSDP_CELL)
    monkeypatch.setenv("CANZONA_FAULT_MODE", "post-step")
    rc = validate_main(["--mesh", "fsdp2", "--optimizer", "muon", "--strategy", "lb-asc", "--dtype", "float32", "--report", str(tmp_path / "out" / "r.json")])
    assert rc == 2
    assert "is on an FSDP2 mesh, which takes runtime faults only" in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_fsdp_cells_pass_and_a_planted_ulp_fails_only_its_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """One spawned group of 2 processes: dp2's ZeRO-1 cells, then fsdp2's FSDP2 cells (built-in
    and the user's optimizer) in the same processes. A one-ulp error planted through the documented
    environment variables in one FSDP2 cell's hosted update fails that cell alone; the report names
    the parameter and element, the FSDP2 cells around it are bit-identical."""
    sign = "examples.sign_momentum:SignMomentum"
    monkeypatch.setenv("CANZONA_FAULT", "kind=ulp,param=layers.1.up,step=2,index=3")
    monkeypatch.setenv("CANZONA_FAULT_CELL", _FSDP_CELL)
    monkeypatch.delenv("CANZONA_FAULT_MODE", raising=False)
    argv = ["--mesh", "dp2,fsdp2", "--optimizer", f"muon,{sign}", "--strategy", "sc,lb-asc", "--check", "injected", "--model", "awkward,fsdp-toy"]
    rc = validate_main([*argv, "--dtype", "float32", "--steps", "3", "--report", str(tmp_path / "f.json")])
    captured = capsys.readouterr()
    assert rc == 1, captured.out + captured.err
    assert "mesh dp2 + fsdp2: 8 cells on 2 processes" in captured.err
    doc = load_report(tmp_path / "f.json")
    assert len(doc["cells"]) == 8 and {c["mesh"] for c in doc["cells"]} == {"dp2", "fsdp2"}
    failed = [c for c in doc["cells"] if not c["passed"]]
    assert [c["cell"] for c in failed] == [_FSDP_CELL], [(c["cell"], c.get("error")) for c in failed]
    got = failed[0]
    assert got["mismatched_params"] == ["layers.1.up"] and got["fault"]["detected"]
    assert (got["first_mismatch"]["param"], got["first_mismatch"]["what"], got["first_mismatch"]["index"]) == ("layers.1.up", "value", 3)
    assert 0 < got["max_abs_diff"] < 1e-6
    assert f"{_FSDP_CELL}  FAIL    layers.1.up value[3]" in captured.out
    clean = [c for c in doc["cells"] if c["mesh"] == "fsdp2" and c["passed"]]
    assert {c["optimizer"] for c in clean} == {"muon", sign} and len(clean) == 3
    assert all(c["max_abs_diff"] == 0.0 and c["compared"] >= 27 for c in clean)
