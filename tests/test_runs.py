"""Per-run metrics logs (canzona.runs), their figure (canzona.viz.training) and train's progress
display: a legend, plain lines under a pipe, a tqdm bar only on a terminal."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd
import pytest

from canzona.phase_names import BACKWARD, COMM_PHASES, DP_REDUCE_SCATTER, FORWARD, OPTIMIZER_STEP, PHASES, STATUS, TP_GATHER
from canzona.runs import METRICS_COLUMNS, METRICS_CSV, RUN_JSON, MetricsLog, new_run_dir, runs_dir, step_metrics
from canzona.viz import figure_problems
from canzona.viz.training import discover_runs, fig_loss_curves, load_metrics, run_label


def _log(d: Path, strategy: str, losses: list[float], *, tensorboard: bool = False) -> Path:
    with MetricsLog(d, run={"strategy": strategy, "dp": 2, "tp": 2, "optimizer": "muon"}, tensorboard=tensorboard) as log:
        for i, v in enumerate(losses):
            log.log(i, v, float("nan") if i == 0 else 0.02, {FORWARD: 0.004, BACKWARD: 0.008, "not/a/phase": 1.0,
                                                             f"{DP_REDUCE_SCATTER}/launch": 0.001, f"{DP_REDUCE_SCATTER}/wait": 0.194})
    return d


@pytest.mark.slow  # importing torch.utils.tensorboard takes seconds
def test_metrics_log_csv_and_tensorboard(tmp_path: Path) -> None:
    d = _log(tmp_path / "a", "lb-asc", [5.5, 5.25, 5.0], tensorboard=None)
    df = load_metrics(d)
    assert tuple(df.columns) == METRICS_COLUMNS and len(METRICS_COLUMNS) == 3 + len(PHASES) + 2 * len(COMM_PHASES) + 1
    assert df[f"{DP_REDUCE_SCATTER}/wait_ms"].tolist() == pytest.approx([194.0] * 3)
    assert df[f"{DP_REDUCE_SCATTER}/launch_ms"].tolist() == pytest.approx([1.0] * 3)
    assert df[f"{DP_REDUCE_SCATTER}_ms"].tolist() == pytest.approx([195.0] * 3)
    assert df["comm_exposed_ms"].tolist() == pytest.approx([194.0] * 3)
    assert df["loss"].tolist() == [5.5, 5.25, 5.0] and df["step"].tolist() == [0, 1, 2]
    assert pd.isna(df.at[0, "wall_ms"]) and df.at[1, "wall_ms"] == pytest.approx(20.0)
    assert df[f"{FORWARD}_ms"].tolist() == pytest.approx([4.0] * 3) and (df[f"{OPTIMIZER_STEP}_ms"] == 0).all()
    assert json.loads((d / RUN_JSON).read_text())["strategy"] == "lb-asc"
    assert run_label(d) == "lb-asc dp2xtp2 muon (a)"
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == [5.5, 5.25, 5.0]
    tags = acc.Tags()["scalars"]
    assert {"time/forward_ms", "time/dp/reduce_scatter_ms", "comm/dp/reduce_scatter/wait_ms",
            "comm/dp/reduce_scatter/launch_ms", "comm/exposed_ms"} <= set(tags)
    assert [e.value for e in acc.Scalars("comm/dp/reduce_scatter/wait_ms")] == pytest.approx([194.0] * 3)
    with pytest.raises(ValueError, match="already exists"):
        MetricsLog(d, tensorboard=False)


def test_step_metrics_split_communication_into_launch_wait_and_exposed() -> None:
    # timer keys as canzona.runtime.phases.timer_key writes them: stages kept, indices dropped;
    # an index-suffixed name is accepted too (it counts under its base)
    m = step_metrics({FORWARD: 0.5, f"{TP_GATHER}/launch": 0.01, f"{TP_GATHER}/wait": 0.03, f"{TP_GATHER}/group2/wait": 0.02,
                      STATUS: 0.004, f"{DP_REDUCE_SCATTER}/launch": 0.002, "canzona/unknown/launch": 9.0})
    assert m[FORWARD] == 0.5 and m[OPTIMIZER_STEP] == 0.0
    assert m[f"{TP_GATHER}/launch"] == 0.01 and m[f"{TP_GATHER}/wait"] == pytest.approx(0.05)
    assert m[TP_GATHER] == pytest.approx(0.06) and m[STATUS] == 0.004 and m[f"{STATUS}/wait"] == 0.0
    # exposed: every wait and every synchronous collective, never a launch
    assert m["comm_exposed"] == pytest.approx(0.05 + 0.004)
    assert [f"{k}_ms" for k in m] == list(METRICS_COLUMNS[3:])


def test_metrics_are_read_strictly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_metrics(tmp_path)
    (tmp_path / METRICS_CSV).write_text("step,loss\n0,1.0\n")
    with pytest.raises(ValueError, match="not a canzona metrics log"):
        load_metrics(tmp_path)
    rows = [",".join(METRICS_COLUMNS), ",".join(["1", "5.0"] + ["0"] * (len(METRICS_COLUMNS) - 2)),
            ",".join(["0", "5.0"] + ["0"] * (len(METRICS_COLUMNS) - 2))]
    (tmp_path / METRICS_CSV).write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match="increasing"):
        load_metrics(tmp_path)


def test_loss_curves_of_several_runs(tmp_path: Path) -> None:
    _log(tmp_path / "r1", "sc", [5.5, 5.0, 4.5])
    _log(tmp_path / "sub" / "r2", "lb-asc", [5.5, 5.1, 4.4])
    runs = discover_runs(tmp_path)
    assert sorted(runs) == ["lb-asc dp2xtp2 muon (r2)", "sc dp2xtp2 muon (r1)"]
    fig = fig_loss_curves(runs)
    assert figure_problems(fig) == []
    loss = [t for t in fig.data if t.showlegend is not False]
    assert [list(t.y) for t in loss] == [[5.5, 5.0, 4.5], [5.5, 5.1, 4.4]]
    assert "lowest final loss: lb-asc dp2xtp2 muon (r2) (4.4000)" in fig.layout.title.text
    assert len(fig.data) == 4  # loss and step time per run
    assert discover_runs(tmp_path / "nothing") == {}
    with pytest.raises(ValueError, match="no runs"):
        fig_loss_curves({})


def test_runs_dir_follows_the_environment(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("CANZONA_RUNS_DIR", str(tmp_path))
    monkeypatch.setattr("canzona.runs.time.strftime", lambda fmt, t=None: "20260101-000000")
    assert runs_dir() == tmp_path
    a = new_run_dir("train-x")
    assert a == tmp_path / "train-x-20260101-000000" and not a.exists()
    a.mkdir()
    assert new_run_dir("train-x") == tmp_path / "train-x-20260101-000000-2"


def test_every_view_finds_the_newest_run_the_same_way(tmp_path: Path, monkeypatch) -> None:
    """A notebook runs in notebooks/; the user's runs are in the repository's runs/ (the parent's):
    the profile, the validation report and the metrics logs are all found there, each view's note
    names the file, and the shipped sample is shown only with a note that says so."""
    import json
    import os

    from canzona.runs import choose_run, find_runs
    from canzona.viz import exactness as ve
    from canzona.viz import timeline as vt

    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    monkeypatch.delenv("CANZONA_RUNS_DIR", raising=False)
    monkeypatch.chdir(repo / "notebooks")
    runs = repo / "runs"
    path, note = ve.resolve_report()
    assert path == ve.SAMPLE_REPORT and "NOTE no validation report of yours" in note and str(runs) in note
    assert vt.resolve_profile()[0] == vt.DEFAULT_PROFILE_DIR
    old = runs / "validation" / "20260101T000000Z" / "report.json"
    new = runs / "validation" / "20260102T000000Z" / "report.json"
    for i, f in enumerate((old, new)):
        f.parent.mkdir(parents=True)
        f.write_text(ve.SAMPLE_REPORT.read_text())
        os.utime(f, (1_000_000 + i, 1_000_000 + i))
    path, note = ve.resolve_report()
    assert path == new.resolve() and note == f"validation report: {new.resolve()} (your newest, of 2 under {runs.parent / 'notebooks' / 'runs'} or {runs})"
    assert ve.default_report_path() == new.resolve()
    prof = runs / "prof"
    prof.mkdir()
    (prof / "phases.csv").write_bytes(vt.DEFAULT_PROFILE_DIR.joinpath("phases.csv").read_bytes())
    assert vt.resolve_profile() == (prof.resolve(), f"profile: {prof.resolve()} (your newest, of 1 under {runs.parent / 'notebooks' / 'runs'} or {runs})")
    _log(runs / "train-sc", "sc", [5.0, 4.0])
    assert find_runs("metrics") == [(runs / "train-sc").resolve()]
    assert list(discover_runs()) == ["sc dp2xtp2 muon (train-sc)"]
    # $CANZONA_RUNS_DIR, when set, is where runs are (and the only place looked at)
    monkeypatch.setenv("CANZONA_RUNS_DIR", str(tmp_path / "elsewhere"))
    assert ve.resolve_report()[0] == ve.SAMPLE_REPORT and find_runs("metrics") == []
    # $CANZONA_RUNS, the shorter name, is read the same when $CANZONA_RUNS_DIR is not set
    monkeypatch.delenv("CANZONA_RUNS_DIR")
    monkeypatch.setenv("CANZONA_RUNS", str(tmp_path / "elsewhere"))
    assert ve.resolve_report()[0] == ve.SAMPLE_REPORT and find_runs("metrics") == []
    monkeypatch.delenv("CANZONA_RUNS")
    monkeypatch.setenv("CANZONA_RUNS_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="profile not found"):
        choose_run("profile", tmp_path / "missing", sample=vt.DEFAULT_PROFILE_DIR)
    with pytest.raises(ValueError, match="kind must be one of"):
        find_runs("nope")
    assert json.loads(new.read_text())["summary"]


def test_profiles_are_labelled_by_their_recorded_strategy(tmp_path: Path) -> None:
    """A run's summary/ and traces/ folders are one run labelled by the strategy it recorded;
    folders without a recorded configuration are not strategies."""
    import json

    from canzona.viz import timeline as vt

    table = vt.DEFAULT_PROFILE_DIR.joinpath("phases.csv").read_bytes()
    meta = {"strategy": "lb-asc", "optimizer": "muon", "dp": 2, "tp": 2, "steps": 3, "model": "qwen3-tiny"}
    run = tmp_path / "lb-asc"
    (run / "summary").mkdir(parents=True)
    (run / "summary" / "phases.csv").write_bytes(table)
    (run / "summary" / "meta.json").write_text(json.dumps(meta))
    (run / "traces").mkdir()
    (run / "traces" / "rank0.1.pt.trace.json").write_text("{}")
    (run / "traces" / "meta.json").write_text(json.dumps(meta))
    sc = tmp_path / "sc-run"
    sc.mkdir()
    (sc / "phases.csv").write_bytes(table)
    (sc / "run.json").write_text(json.dumps({**meta, "strategy": "sc"}))
    stray = tmp_path / "scratch"
    stray.mkdir()
    (stray / "phases.csv").write_bytes(table)
    assert vt.discover_profiles(tmp_path) == {"lb-asc": run / "summary", "sc": sc}
    other = tmp_path / "again"
    other.mkdir()
    (other / "phases.csv").write_bytes(table)
    (other / "meta.json").write_text(json.dumps({**meta, "steps": 4}))
    assert vt.discover_profiles(tmp_path) == {"lb-asc (summary)": run / "summary", "lb-asc (again)": other, "sc": sc}


# ------------------------------------------------------------------------------------ progress display


def _config(steps: int = 2):
    from canzona.train import TrainConfig

    return TrainConfig(steps=steps, batch_size=2, seq_len=8)


def test_progress_is_plain_lines_with_a_legend_under_a_pipe(capsys) -> None:
    from canzona.train import Progress

    out = io.StringIO()
    p = Progress(_config(), out=out, bar=None)  # pytest's captured streams are not terminals
    assert p.bar is None
    phases = {FORWARD: 0.01, BACKWARD: 0.02, "canzona/dp/reduce_scatter": 0.001, OPTIMIZER_STEP: 0.03}
    p(0, 5.5, phases)
    p(1, 5.4, phases)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("per step")
    assert "comm collectives" in lines[0] and "fwd forward" in lines[0]
    assert lines[1].startswith("step 1/2  loss 5.5000  fwd   10.0") and lines[2].startswith("step 2/2")
    assert "comm    1.0" in lines[1] and max(map(len, lines)) < 100
    assert capsys.readouterr().err == ""  # no bar anywhere


def test_progress_bar_on_a_terminal_keeps_lines_apart(capsys) -> None:
    from canzona.train import Progress

    out = io.StringIO()
    p = Progress(_config(), out=out, bar=True)
    p(0, 5.5, {FORWARD: 0.01})
    p(1, 5.4, {FORWARD: 0.01})
    p.close()
    assert out.getvalue().splitlines()[1].startswith("step 1/2")
    err = capsys.readouterr().err
    assert "2/2" in err and "step 1/2" not in err  # the bar on stderr, the step lines on out only


@pytest.mark.slow
def test_train_command_logs_the_run(capsys) -> None:
    from canzona.cli import main

    assert main(["train", "--steps", "2", "--batch-size", "2", "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("per step (rank 0, ms)") and "step 2/2" in out
    runs = sorted(runs_dir().glob("train-lb-asc-dp1xtp1-*"))
    assert len(runs) == 1 and f"metrics: {runs[0] / METRICS_CSV}" in out
    assert load_metrics(runs[0])["step"].tolist() == [0, 1]


def test_every_phase_has_a_column_name_and_a_meaning() -> None:
    from canzona.train import _SHORT, step_legend

    assert set(_SHORT) == set(PHASES)
    assert len({short for short, _ in _SHORT.values()}) == len(PHASES)  # no two columns share a name
    legend = step_legend(list(PHASES))
    assert len(legend) < 100 and all(f"{c} " in legend for c in ("fwd", "bwd", "opt", "comm", "stat")), legend


def test_a_log_of_the_previous_version_still_reads(tmp_path) -> None:
    """Logs written before this version have one column per phase, no FSDP2 shard-group phases
    and no launch/wait columns: they read with the shard phases at 0 ms and launch, wait and
    exposed communication as not recorded (NaN); any other header is still refused."""
    import math

    from canzona.phase_names import PHASES
    from canzona.runs import METRICS_COLUMNS
    from canzona.viz.training import load_metrics

    old = ["step", "loss", "wall_ms", *(f"{p}_ms" for p in PHASES if not p.startswith("canzona/shard/"))]
    (tmp_path / "metrics.csv").write_text(",".join(old) + "\n" + ",".join(["1", "2.5"] + ["1.0"] * (len(old) - 2)) + "\n", encoding="utf-8")
    df = load_metrics(tmp_path)
    assert tuple(df.columns) == METRICS_COLUMNS and df["canzona/shard/gather_ms"].tolist() == [0.0] and df["loss"].tolist() == [2.5]
    assert df["canzona/forward_ms"].tolist() == [1.0] and math.isnan(df["comm_exposed_ms"].iloc[0])
    (tmp_path / "metrics.csv").write_text(",".join(old[:-1]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="not a canzona metrics log"):
        load_metrics(tmp_path)
