"""What an optimizer leaves behind once it and its model are dropped: nothing. canzona's gradient
hooks live in C++ (a parameter's autograd metadata, its AccumulateGrad node), out of the garbage
collector's sight, so they hold the buffer weakly; a strong reference made model, masters and
process-group handles of every optimizer built in a process live until exit. And the status
exchanges' record of the process group does not keep it alive after ``destroy_process_group``."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import attempt, case_results


def _stack_case(mesh: Any = None) -> tuple[Any, ...]:
    import canzona
    from canzona.profiling.vs_torch import LinearStack

    model = LinearStack(4, 16)
    if mesh is not None:  # FSDP2: fully_shard per layer, then the root
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs={"lr": 0.02})
    for step in range(2):
        model.loss(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).backward()
        opt.step()
        opt.zero_grad()
    return weakref.ref(opt), weakref.ref(model), [weakref.ref(p) for p in model.parameters()]


def _tp_case() -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.config import load_model_config
    from canzona.models import Qwen3, batch
    from canzona.models.tp import parallelize

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    cfg = load_model_config("qwen3-tiny")
    model = parallelize(Qwen3(cfg, seed=0), mesh["tp"])
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs={"lr": 0.02},
                                       elementwise_kwargs={"lr": 1e-3})
    for step in range(2):
        ids, labels = batch(step, 0, 1, 2, 8, 0, vocab=cfg.vocab_size)
        model.loss(ids, labels).backward()
        opt.step()
        opt.zero_grad()
    return weakref.ref(opt), weakref.ref(model), [weakref.ref(p) for p in model.parameters()]


def _fsdp_case() -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh

    return _stack_case(init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)))


def _alive(make: Any) -> dict[str, int]:
    opt, model, params = make()
    gc.collect()
    return {"optimizer": int(opt() is not None), "model": int(model() is not None), "parameters": sum(p() is not None for p in params)}


CASES = {"zero1-dp": _stack_case, "dp1xtp2": _tp_case, "fsdp2": _fsdp_case}


def lifetime_worker(rank: int, world: int) -> dict:
    return {"alive": {name: attempt(_alive, make) for name, make in CASES.items()}}


@pytest.fixture(scope="module")
def lifetime_run() -> list:
    from canzona.runtime.launch import run_workers

    return run_workers(lifetime_worker, 2, timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_dropped_optimizer_and_model_are_freed(lifetime_run, case: str) -> None:
    """Two steps of lb-asc (ZeRO-1 DP at world 2, DTensor TP dp1 x tp2, FSDP2), then every
    reference dropped and one ``gc.collect()``: optimizer, model and every parameter are gone."""
    for rank, alive in enumerate(case_results(lifetime_run, "alive", case)):
        assert alive == {"optimizer": 0, "model": 0, "parameters": 0}, (case, rank, alive)


def test_the_status_group_record_does_not_keep_a_destroyed_group_alive(tmp_path: Path) -> None:
    import torch.distributed as dist

    from canzona.runtime.agree import status_group
    from canzona.runtime.launch import file_init_method, process_group

    with process_group(file_init_method(tmp_path)):
        assert status_group() is None  # one rank: the default group itself
        default = weakref.ref(dist.distributed_c10d._get_default_group())
    gc.collect()
    assert default() is None



_PINNED_SCRIPT = r"""
import gc, json, sys, weakref
import torch, torch.distributed as dist

if sys.argv[1] == "late":  # the group first (as accelerate does), canzona imported after it
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from canzona.distributed import DistributedOptimizer
from canzona.profiling.vs_torch import LinearStack

if sys.argv[1] == "first":  # as a user's torchrun script: canzona imported, then the group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
model = LinearStack(2, 8)
opt = DistributedOptimizer(model, "muon")
model(torch.ones(2, 8)).sum().backward()
opt.step()
group = weakref.ref(dist.distributed_c10d._get_default_group())
del opt, model
dist.destroy_process_group()
gc.collect()
import torch.distributed.nn.functional as F  # imported by torch's FSDP package, which canzona loads
print(json.dumps({"group_alive": group() is not None, "defaults": repr(F.broadcast.__defaults__)}))
"""


@pytest.mark.parametrize("order", ["first", "late"])
def test_a_destroyed_group_is_not_pinned_to_interpreter_exit(order: str) -> None:
    """torch.distributed.nn.functional binds ``group.WORLD`` as a default argument when first
    imported, and canzona loads torch's FSDP package (which imports it) after the group forms.
    Left so, the destroyed group would live to interpreter shutdown and its gloo threads could
    abort a finished run (the flaky SIGABRT of a torchrun job). canzona imports it before any group
    (``first``), or unpins the group where it formed before canzona was imported (``late``). A
    fresh interpreter each, since this one may have imported the module already."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _PINNED_SCRIPT, order], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"group_alive": False, "defaults": "(None,)"}, out
