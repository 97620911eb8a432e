"""Quiet, readable output: no kineto status lines on the terminal, no FSDP2 warning from the
model's forward, per-step lines under 100 characters. One process, no spawn."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist


def test_profiler_status_lines_never_reach_stderr(capfd) -> None:
    """kineto prints ``USDT:... profiler_start`` on file descriptor 2 whatever its log level;
    :func:`quiet_kineto` drops those lines and passes every other one."""
    import os

    from torch.profiler import ProfilerActivity, profile

    from canzona.profiling.run import quiet_kineto

    with quiet_kineto():
        with profile(activities=[ProfilerActivity.CPU]):
            torch.ones(4).sum()
        os.write(2, b"a line of ours\n")
    err = capfd.readouterr().err
    assert "USDT:" not in err and "profiler_start" not in err and "STAGE:" not in err, err
    assert "a line of ours" in err


@pytest.fixture()
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_forward_has_nothing_to_warn_about(one_rank) -> None:
    """FSDP2 warns when the root module returns a view (an in-place op on it would skip the
    pre-backward all-gather); the model's logits are a tensor of their own, bitwise equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from canzona.config import load_model_config
    from canzona.models import Qwen3, parallelize
    from canzona.models.data import batch

    ids, labels = batch(0, 0, 1, 2, 8, 0)
    plain = Qwen3(load_model_config("qwen3-tiny"))(ids)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_shard", "tp"))
    model = parallelize(Qwen3(load_model_config("qwen3-tiny")), mesh["tp"])
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logits = model(ids)
        model.loss(ids, labels).backward()
    assert not [w for w in seen if "view tensor" in str(w.message)], [str(w.message)[:120] for w in seen]
    assert torch.equal(logits.detach(), plain.detach())


def test_step_lines_are_short_with_a_legend() -> None:
    import io

    from canzona.phase_names import PHASES
    from canzona.train import Progress, TrainConfig

    out = io.StringIO()
    p = Progress(TrainConfig(steps=100000), out=out, bar=False)
    # every phase, communication split in launch and wait parts as the runtime reports them
    phases = {name: 12.345678 for name in PHASES}  # seconds: long steps, wide columns
    phases |= {f"{n}/launch": 1.0 for n in PHASES if "/dp/" in n or "/tp/g" in n} | {"canzona/tp/scatter/wait": 2.0}
    p(99998, 12.3456, phases)
    legend, line = out.getvalue().splitlines()
    assert len(legend) < 100 and len(line) < 100, (legend, line)
    assert line.startswith("step  99999/100000  loss 12.3456  fwd ")
    assert [w for w in legend.split(": ", 1)[1].split(", ")] == [
        "fwd forward", "bwd backward", "opt optimizer", "comm collectives", "stat status"]
