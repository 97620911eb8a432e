"""Bounds, one-line errors and atomic outputs of the commands (no process group).

Every bad input here ends with exit code 2, exactly one line on stderr, no traceback, and fast
(the bound is generous: a correctness bound against minutes-long runs, not a speed test). A
failed write (full disk simulated by a failing fsync, a folder where a file is expected, a path
under a file) leaves the old file intact and no temporary file, and the results computed before
it are still printed.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
import torch

from canzona.cli import main
from canzona.fileio import atomic_write

FAST_S = 10.0


def _config(tmp_path: Path, **over) -> str:
    doc = {
        "name": "probe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "tie_word_embeddings": False,
    }
    doc.update(over)
    p = tmp_path / "cfg.json"
    p.write_text(json.dumps(doc).replace('"VOCAB"', "1e30"))
    return str(p)


def _one_line(capsys, argv: list[str]) -> tuple[str, str, float]:
    t0 = time.monotonic()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit from inside main
        code = exc.code
    took = time.monotonic() - t0
    out, err = capsys.readouterr()
    assert code == 2, (argv, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert took < FAST_S, f"{argv}: {took:.1f} s"
    return out, lines[0], took


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--model", "qwen3-tiny", "--dp", "2", "--tp", "16"], "tp=16 does not divide num_key_value_heads=2"),
        (["plan", "--model", "qwen3-32b", "--dp", "2", "--tp", "3"], "tp=3 does not divide"),
        (["plan", "--model", "qwen3-tiny", "--dp", "2", "--cmax", "inf"], "--cmax: expected a positive number, got inf"),
        (["plan", "--model", "qwen3-tiny", "--dp", "2", "--cmax-mb", "512"], "--cmax-mb: the flag is gone: use --cmax"),
        (["train", "--cmax-mb", "512"], "--cmax-mb: the flag is gone: use --cmax"),
        (["plan", "--model", "qwen3-tiny", "--dp", "100000000"], "dp must be an integer in [1, 131072]"),
        (["simulate", "--dp", "100000000"], "dp must be an integer in [1, 131072]"),
        (["simulate", "--cmax", "inf"], "--cmax: expected a positive number"),
        (["simulate", "--cmax-mb", "512"], "--cmax-mb: the flag is gone: use --cmax"),
        (["train", "--strategy", "sc", "--tp-schedule", "lpt", "--tp", "2", "--nproc", "2"], "its TP schedule must be 'sync', got 'lpt'"),
    ],
)
def test_bad_sizes_one_line(capsys, argv: list[str], needle: str) -> None:
    _, line, _ = _one_line(capsys, argv)
    assert needle in line, line


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"num_hidden_layers": 1_000_000}, "num_hidden_layers = 1000000 is above canzona's bound 4096"),
        ({"vocab_size": "VOCAB"}, "vocab_size must be a positive integer, got 1e+30"),
        ({"vocab_size": 10**30}, "is above canzona's bound"),
        ({"hidden_size": 1 << 25, "intermediate_size": 1 << 25, "num_hidden_layers": 4000}, "parameters, above canzona's bound"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "train"])
def test_absurd_configs_one_line(capsys, tmp_path: Path, over: dict, needle: str, command: str) -> None:
    argv = [command, "--model", _config(tmp_path, **over)] + (["--dp", "2"] if command == "plan" else ["--steps", "1"])
    _, line, _ = _one_line(capsys, argv)
    assert needle in line, line


def _no_temp(folder: Path) -> None:
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")], list(folder.iterdir())


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "doc.json"
    atomic_write(target, "old\n")
    assert oct(target.stat().st_mode & 0o777) != "0o600"  # an ordinary file, not mkstemp's private mode

    def boom(f) -> None:
        f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as info:
        atomic_write(target, boom)
    assert info.value.filename == str(target) and info.value.errno == errno.ENOSPC
    assert target.read_text() == "old\n"
    _no_temp(tmp_path)
    # a device or a pipe is never renamed over
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        atomic_write(fifo, "x")
    assert fifo.exists() and not fifo.is_file()
    _no_temp(tmp_path)


def _full_disk(monkeypatch) -> None:
    import canzona.fileio

    def fsync(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(canzona.fileio.os, "fsync", fsync)


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_full_disk_keeps_old_output_and_prints_results(capsys, tmp_path: Path, monkeypatch, command: str) -> None:
    out_file = tmp_path / "out.json"
    out_file.write_text("previous\n")
    _full_disk(monkeypatch)
    argv = (
        ["plan", "--model", "qwen3-tiny", "--dp", "2", "--json", str(out_file)]
        if command == "plan"
        else ["simulate", "--model", "qwen3-tiny", "--dp", "2", "--tp", "1", "--no-sensitivity", "--json", str(out_file)]
    )
    out, line, _ = _one_line(capsys, argv)
    assert f"cannot write {out_file}: No space left on device" in line, line
    assert out_file.read_text() == "previous\n"
    _no_temp(tmp_path)
    # the results computed before the write are on stdout
    assert ("fingerprint" in out) if command == "plan" else ("lb-asc" in out), out[:300]


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_unwritable_output_refused_before_the_work(capsys, tmp_path: Path, command: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for bad, why in ((blocker / "out.json", "does not exist"), (tmp_path, "is a directory")):
        base = ["plan", "--model", "qwen3-tiny", "--dp", "2"] if command == "plan" else ["simulate", "--model", "qwen3-tiny", "--dp", "2", "--tp", "1"]
        out, line, _ = _one_line(capsys, [*base, "--json", str(bad)])
        assert str(bad) in line and why in line, line
        assert out == "", "the work ran before the output was checked"


def test_validate_report_dir_and_failed_write(capsys, tmp_path: Path, monkeypatch) -> None:
    from validation import report as vr
    from validation import suite

    # --report DIR: the pair goes inside DIR, never DIR.json beside the folder
    folder = tmp_path / "out"
    folder.mkdir()
    assert vr.report_dir_paths(folder) == (folder / "report.json", folder / "report.csv")
    rep = vr.build_report([], level="quick", command="test", seconds=0.0, settings={})
    js, cs = vr.write_report(rep, vr.report_dir_paths(folder)[0])
    assert js.parent == folder and cs.parent == folder
    assert not (tmp_path / "out.json").exists() and not (tmp_path / "out.csv").exists()
    # a failed report write keeps the computed results: the table is printed, then one line, exit 1
    target = tmp_path / "r"
    monkeypatch.setattr(suite, "run_suite", lambda *a, **k: suite.SuiteResult(rep, None, f"cannot write the report {target}: No space left on device"))
    code = main(["validate", "--quick", "-q", "--report", str(target)])
    out, err = capsys.readouterr()
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and str(target) in lines[0], err
    assert out.strip(), "the results table was not printed"


def test_validate_report_write_is_atomic(tmp_path: Path, monkeypatch) -> None:
    from validation import report as vr

    rep = vr.build_report([], level="quick", command="test", seconds=0.0, settings={})
    js, cs = vr.write_report(rep, tmp_path / "report")
    assert js.is_file() and cs.is_file()
    before = js.read_text()
    monkeypatch.setattr(vr.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError):
        vr.write_report({**rep, "command": "changed"}, tmp_path / "report")
    assert js.read_text() == before
    _no_temp(tmp_path)


@pytest.mark.parametrize("command", ["figures", "profile"])
def test_output_folders_checked_before_the_work(capsys, tmp_path: Path, command: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    argv = ["figures", "--out", str(blocker / "figs")] if command == "figures" else ["profile", "--summary", str(blocker / "s")]
    if command == "profile":
        argv += ["--tensorboard", str(tmp_path / "tb")]
    out, line, _ = _one_line(capsys, argv)
    assert f"cannot create {blocker / ('figs' if command == 'figures' else 's')}: {blocker} is not a folder" in line, line
    assert out == "" and not (tmp_path / "tb").exists()


# ----------------------------------------------------------------------------- strict JSON everywhere

DEEP = "[" * 200_000 + "]" * 200_000  # a RecursionError in json.loads without the depth limit
DEEP_ARG = "[" * 60_000 + "]" * 60_000  # fits in one command-line argument


def _write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "where",
    ["plan --model", "simulate --model", "train --model", "simulate --hardware", "figures --report", "figures --profile",
     "validate --optimizer-kwargs", "validate --model-kwargs"],
)
def test_deep_json_is_one_line_at_every_parse(capsys, tmp_path: Path, where: str) -> None:
    command, flag = where.split()
    if flag.endswith("kwargs"):
        value = DEEP_ARG
    elif flag == "--profile":
        d = tmp_path / "prof"
        d.mkdir()
        (d / "rank0.1.pt.trace.json").write_text(DEEP)  # a raw trace directory
        value = str(d)
    else:
        value = _write(tmp_path, "deep.json", DEEP)
    argv = [command, flag, value]
    if command == "figures":
        argv += ["--out", str(tmp_path / "figs"), "--only", "validation_matrix" if flag == "--report" else "timeline"]
    if flag == "--model-kwargs":
        argv += ["--model", "examples.tiny_mlp:tiny_mlp"]
    if command == "plan":
        argv += ["--dp", "2"]
    _, line, _ = _one_line(capsys, argv)
    assert "nested deeper than 64 levels" in line, line


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (DEEP, "nested deeper than 64 levels"),
        ('{"version": 1e999}', "overflows a float"),
        ('{"version": NaN}', "NaN is not a finite number"),
        ('{"version": ' + "9" * 5000 + "}", "integer of 5000 digits"),
    ],
)
def test_plan_from_json_refuses_in_one_error(tmp_path: Path, text: str, needle: str) -> None:
    from canzona.plan import PlanError
    from canzona.plan.plan import Plan

    with pytest.raises(PlanError, match=needle):
        Plan.from_json(_write(tmp_path, "plan.json", text))


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ('"rms_norm_eps": NaN', "NaN is not a finite number"),
        ('"rms_norm_eps": Infinity', "Infinity is not a finite number"),
        ('"rope_theta": 1e999', "number 1e999 overflows a float"),
        ('"rope_theta": -Infinity', "-Infinity is not a finite number"),
    ],
)
def test_non_finite_config_values_refused(capsys, tmp_path: Path, raw: str, needle: str) -> None:
    base = json.loads(Path(_config(tmp_path)).read_text())
    text = json.dumps(base)[:-1] + ", " + raw + "}"
    _, line, _ = _one_line(capsys, ["plan", "--model", _write(tmp_path, "c.json", text), "--dp", "2"])
    assert needle in line, line
    # and from Python: the dataclass itself refuses a non-finite value
    from canzona.config import ConfigError, ModelConfig

    with pytest.raises(ConfigError, match="finite positive number"):
        ModelConfig.from_dict({**base, "rms_norm_eps": float("nan")})


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--model", "qwen3-tiny", "--fsdp", "1000000000"], "1 x 1000000000 data-parallel ranks, above canzona's bound 131072"),
        (["plan", "--model", "qwen3-tiny", "--fsdp", "1024", "--dp-replicate", "1024"], "above canzona's bound 131072"),
        (["simulate", "--model", "qwen3-tiny", "--fsdp", "1000000000"], "above canzona's bound 131072"),
        (["simulate", "--model", "qwen3-tiny", "--fsdp", "2", "--tp", "100000"], "--tp 100000 is above canzona's bound 4096"),
        (["plan", "--model", "qwen3-tiny", "--dp", "2", "--json", ""], "--json: expected a file path, got an empty string"),
        (["simulate", "--model", "qwen3-tiny", "--json", ""], "--json: expected a file path"),
        (["reproduce", "fig3", "--json", ""], "--json: expected a file path"),
        (["simulate", "--model", "qwen3-tiny", "--sweep-dp", ""], "--sweep-dp must list integers >= 1, got ''"),
        (["simulate", "--model", "qwen3-tiny", "--sweep-alpha", ""], "--sweep-alpha"),
        (["train", "--lr", "1e308"], "lr must be a number in (0, 1000], got 1e+308"),
        (["train", "--elementwise-lr", "1e308"], "elementwise_lr must be a number in (0, 1000]"),
        (["validate", "--quick", "--optimizer-kwargs", '{"lr": 1e308}'], "lr = 1e+308 is above canzona's bound 1000"),
        (["validate", "--quick", "--optimizer-kwargs", '{"lr": 1e999}'], "overflows a float"),
        (["train", "--dp", "2", "--log-dir", "/proc/canzona-no-such-dir"], "/proc/canzona-no-such-dir: cannot create --log-dir"),
    ],
)
def test_bounds_and_empty_values_one_line(capsys, argv: list[str], needle: str) -> None:
    _, line, _ = _one_line(capsys, argv)
    assert needle in line, line


def test_named_inputs_that_are_missing(capsys, tmp_path: Path) -> None:
    for flag in ("--profile", "--report"):
        out, line, _ = _one_line(capsys, ["figures", "--out", str(tmp_path / "f"), flag, str(tmp_path / "MISSING")])
        assert f"{flag} {tmp_path / 'MISSING'}: no such file or directory" in line, line
        assert not (tmp_path / "f").exists()


def test_validate_report_folder_holding_a_report(capsys, tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text("{}")
    _, line, _ = _one_line(capsys, ["validate", "--quick", "--report", str(tmp_path)])
    assert "already holds report.json" in line, line
    assert (tmp_path / "report.json").read_text() == "{}"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--batch-size", "1000000000"], "batch 1000000000 x 64 tokens needs at least"),
        (["--seq-len", "1000000000"], "batch 8 x 1000000000 tokens needs at least"),
        (["--model", "qwen3-32b"], "qwen3-32b with batch 8 x 64 tokens needs at least 5"),
        # 2.6 GiB of parameters and gradients, but two float64 151936^2 tables of synthetic data
        (["--model", "qwen3-0.6b"], "qwen3-0.6b with batch 8 x 64 tokens needs at least 349.2 GiB of memory"),
    ],
)
def test_train_refuses_what_cannot_fit_in_memory(capsys, monkeypatch, argv: list[str], needle: str) -> None:
    """The estimate is arithmetic (nothing allocated): a 16 GiB machine refuses these at once."""
    import canzona.train

    monkeypatch.setattr(canzona.train, "available_memory_bytes", lambda: 16 << 30)
    _, line, took = _one_line(capsys, ["train", "--backend", "gloo", *argv])
    assert needle in line and "this machine has 16.0 GiB available" in line, line
    assert took < 5.0, took


def test_memory_estimate_accepts_the_default_run() -> None:
    from canzona.train import TrainConfig, check_memory, check_model

    cfg = TrainConfig(backend="gloo")
    est = check_memory(cfg, check_model(cfg), available=1 << 30)  # the default run fits in 1 GiB
    assert 0 < est.total < 1 << 28


def _fake_gpu(monkeypatch, free: int, count: int = 1) -> None:
    """The in-process train sees a GPU: its device is cuda:0 (the gloo group still gathers on the
    host) with ``free`` bytes free; the host has plenty."""
    import canzona.train

    monkeypatch.setattr(canzona.train, "available_memory_bytes", lambda: 1 << 50)
    monkeypatch.setattr(canzona.train, "_device", lambda backend: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 141 << 30))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_train_refuses_what_cannot_fit_on_the_gpu(capsys, monkeypatch) -> None:
    """Each rank reads its GPU's free memory before the mesh or the model is allocated."""
    _fake_gpu(monkeypatch, 16 << 30)
    _, line, _ = _one_line(capsys, ["train", "--backend", "gloo", "--no-log", "--model", "qwen3-32b"])
    assert line.endswith(
        "qwen3-32b with batch 8 x 64 tokens needs at least 247.2 GiB of memory on GPU cuda:0 of rank 0 (244.1 GiB of "
        "parameters and gradients and 3.1 GiB of activations per rank); it has 16.0 GiB free: use a smaller model, "
        "--batch-size or --seq-len"
    ), line


def test_train_accepts_what_fits_on_the_gpu(capsys, monkeypatch) -> None:
    """A run that fits goes on to build its mesh and model (stopped there: this machine has no GPU)."""
    import canzona.train

    _fake_gpu(monkeypatch, 1 << 30)

    def setup(*args, **kwargs):
        raise ValueError("reached the set-up")

    monkeypatch.setattr(canzona.train, "_setup", setup)
    _, line, _ = _one_line(capsys, ["train", "--backend", "gloo", "--no-log"])
    assert "reached the set-up" in line, line


def test_gpu_fit_counts_the_ranks_sharing_a_gpu() -> None:
    from canzona.train import TrainConfig, check_model, gpu_fit, memory_estimate

    config = TrainConfig(backend="gloo", dp=2)
    cfg = check_model(config)
    est = memory_estimate(config, cfg)
    gpu_fit(est, cfg, config, [(0, est.per_rank, 1), (1, est.per_rank, 1)])  # exactly enough on each
    gpu_fit(est, cfg, config, [(0, 2 * est.per_rank, 2), (0, 2 * est.per_rank, 2)])  # two ranks, one GPU
    with pytest.raises(ValueError, match=r"on GPU cuda:1 of rank 1 .*per rank\); it has") as err:
        gpu_fit(est, cfg, config, [(0, est.per_rank, 1), (1, est.per_rank - 1, 1)])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"on GPU cuda:0 of rank 0 .*per rank, 2 ranks on it\); it has"):
        gpu_fit(est, cfg, config, [(0, 2 * est.per_rank - 1, 2), (0, 2 * est.per_rank - 1, 2)])


def test_host_check_with_cuda_counts_what_the_host_holds(monkeypatch) -> None:
    """With CUDA the parameters, gradients and activations are the GPUs'; the host keeps the
    synthetic data and the initialization draws, and is still checked for them."""
    from canzona.train import TrainConfig, check_memory, check_model, memory_estimate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_gpu, on_host = TrainConfig(model="qwen3-32b", dp=8), TrainConfig(model="qwen3-32b", dp=8, backend="gloo")
    assert on_gpu.resolved_backend == "nccl"
    cfg = check_model(on_gpu)
    gpu, host = memory_estimate(on_gpu, cfg), memory_estimate(on_host, cfg)
    assert gpu.gpu and not host.gpu and gpu.per_rank == host.per_rank
    assert host.total == 8 * (host.per_rank + host.host_data)
    assert gpu.total == 8 * gpu.host_data < host.total
    with pytest.raises(ValueError, match=r"of host memory \(.* per rank, 8 rank\(s\); the model itself lives on the GPUs\)"):
        check_memory(on_gpu, cfg, available=64 << 30)
    tiny = TrainConfig(dp=8)
    est = check_memory(tiny, check_model(tiny), available=1 << 30)
    assert est.gpu and est.total == 8 * est.host_data


def test_worker_error_summary_is_the_first_line() -> None:
    from canzona.runtime.launch import WorkerError

    exc = WorkerError("rank 1: ValueError: planted\nTraceback (most recent call last):\n  File ...")
    assert exc.summary == "rank 1: ValueError: planted"
    assert "Traceback" in str(exc)  # the whole text is still there for --debug and the run's log


def test_kineto_status_lines_are_dropped() -> None:
    from canzona.profiling.run import drop_kineto_lines

    raw = (
        b"USDT:2026-12-02 03:41:13 17603:17603 SyncActivityProfilerHandler.cpp:52] profiler_start"
        b"USDT:2026-12-02 03:41:13 17603:17603 SyncActivityProfilerHandler.cpp:59] profiler_stop\n"
        b"a line of ours\n"
        b"STAGE:2026-12-02 03:42:19 18322:18322 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n"
        b"another"
    )
    assert drop_kineto_lines(raw) == b"a line of ours\nanother"
