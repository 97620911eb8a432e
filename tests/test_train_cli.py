"""``canzona train`` and ``canzona.train.train``: the tiny model trains, strategies agree bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from canzona.cli import main
from canzona.runtime.launch import run_workers
from canzona.train import TrainConfig, TrainResult, format_summary, train

TINY = {"steps": 3, "batch_size": 4, "seq_len": 16, "progress": False}


def test_single_process_loss_goes_down() -> None:
    result = train(TrainConfig(steps=10, batch_size=8, seq_len=32, progress=False))
    assert isinstance(result, TrainResult)
    assert len(result.losses) == 10 and all(math.isfinite(x) for x in result.losses)
    assert abs(result.losses[0] - math.log(256)) < 0.1  # untrained: close to uniform over 256 tokens
    assert result.losses[-1] < result.losses[0] - 0.3
    assert sum(b < a for a, b in zip(result.losses, result.losses[1:])) >= 7  # mostly monotone
    assert result.phase_times["canzona/optimizer/step"]["calls"] == 10
    assert result.phase_times["canzona/forward"]["calls"] == 10
    assert len(result.params_fingerprint) == 16
    assert "loss: first" in format_summary(result)


def _strategies_worker(rank: int, world: int, runs: list[TrainConfig]) -> list[TrainResult]:
    return [train(cfg) for cfg in runs]


@pytest.mark.slow
def test_dp2_tp2_strategies_train_to_identical_parameters() -> None:
    # Also across TP styles: DTensor and Megatron-style TP run the same local matmuls and sum the
    # same two partial products per all-reduce. With dp = 2 every gradient element is a sum of exactly two contributions (a + b == b + a in
    # IEEE arithmetic) and every optimizer step is exact, so all Canzona strategies -- whatever
    # their partition, hosts and micro-groups -- must end with bitwise identical parameters.
    strategies = ["lb-asc", "sc", "asc", "layerwise", "lb-asc", "lb-asc"]
    runs = [
        # C_max of 50 KiB: several micro-groups per DP rank, gathers prefetched during compute
        TrainConfig(dp=2, tp=2, strategy="lb-asc", cmax=0.05 / (4 * 2), **TINY),
        TrainConfig(dp=2, tp=2, strategy="sc", **TINY),
        TrainConfig(dp=2, tp=2, strategy="asc", **TINY),
        TrainConfig(dp=2, tp=2, strategy="layerwise", **TINY),
        TrainConfig(dp=2, tp=2, strategy="lb-asc", tp_schedule="no-fuse", **TINY),
        # Megatron-style plain shards with declared split dims: the same computation, same bits.
        TrainConfig(dp=2, tp=2, strategy="lb-asc", tp_style="megatron", **TINY),
    ]
    results = run_workers(_strategies_worker, 4, runs, timeout_s=170)
    for rank_results in results:
        for r, s in zip(rank_results, strategies):
            assert r.config.strategy == s
            assert len(r.losses) == 3 and all(math.isfinite(x) for x in r.losses)
            assert r.losses[-1] < r.losses[0]
    fps = {r.params_fingerprint for rank_results in results for r in rank_results}
    assert len(fps) == 1, fps
    # Losses are global means: the same on every rank.
    for i in range(len(strategies)):
        assert len({tuple(rank_results[i].losses) for rank_results in results}) == 1
    lb = results[0][0]
    # The TP micro-group engine ran under lb-asc (gather/scatter bytes, compute without any) ...
    assert lb.comm_bytes["canzona/tp/gather"]["sent"] > 0 and lb.comm_bytes["canzona/tp/scatter"]["recv"] > 0
    assert lb.comm_bytes.get("canzona/tp/compute", {"sent": 0})["sent"] == 0
    assert "canzona/dp/reduce_scatter" in lb.comm_bytes
    # ... and sc all-reduces and all-gathers TP gradients, with no scatter back.
    sc = results[0][1]
    assert "canzona/dp/all_reduce" in sc.comm_bytes and "canzona/tp/scatter" not in sc.comm_bytes
    # Optimizer state: lb-asc keeps each TP-split state on one host, sc everywhere.
    assert sum(lb.state_bytes_per_rank) < sum(sc.state_bytes_per_rank) / 2
    assert lb.state_bytes_per_rank == tuple(r[0].state_bytes for r in results)
    # C_max bounds every rank's exchange buffers (the largest task, 45,056 bytes, fits in 50 KiB).
    assert 0 < max(lb.peak_exchange_bytes_per_rank) <= 0.05 * 2**20


def test_cli_single_process_prints_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--optimizer", "soap"]) == 0
    out = capsys.readouterr().out
    assert "step 1/2" in out and "step 2/2" in out
    assert "strategy=lb-asc dp=1 tp=1" in out and "canzona/optimizer/step" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dp", "0"], "positive integer"),
        (["--dp", "2", "--tp", "2", "--nproc", "3"], "--nproc 3 must equal dp*tp"),
        (["--tp", "4", "--nproc", "4"], "num_key_value_heads"),
        (["--strategy", "zero1"], "zero1"),
        (["--dp", "2", "--batch-size", "3", "--nproc", "2"], "multiple of dp"),
        (["--model", "no-such-model"], "unknown model"),
        (["--model", "qwen3-30b-a3b"], "mixture-of-experts"),
        (["--steps", "0"], "positive integer"),
        (["--lr", "-1"], "positive number"),
        (["--strategy", "fast"], "invalid choice"),
        (["--tp-style", "fsdp"], "invalid choice"),
    ],
)
def test_cli_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(["train", *argv])
    except SystemExit as exc:  # argparse errors
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1, err


def test_train_rejects_bad_config() -> None:
    with pytest.raises(ValueError, match="backend"):
        TrainConfig(backend="mpi")
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(dtype="float16")
    with pytest.raises(ValueError, match="needs 4 processes"):
        train(TrainConfig(dp=2, tp=2, **TINY))


def test_torchrun_entry_single_process(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``torchrun -m canzona train`` is the command line with WORLD_SIZE set: one rank joins via env://."""
    for var in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    # one rank: port 0 lets the store bind whatever port is free at that moment (nobody else connects)
    monkeypatch.setenv("MASTER_PORT", "0")
    assert main(["train", "--steps", "1", "--batch-size", "2", "--seq-len", "8", "--no-progress"]) == 0
    assert "loss: first" in capsys.readouterr().out
    assert not torch.distributed.is_initialized()
    assert main(["train", "--dp", "2", "--no-progress"]) == 2
    assert "must equal WORLD_SIZE (1)" in capsys.readouterr().err
