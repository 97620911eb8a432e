"""CUDA / NCCL checks (skipped without CUDA; the multi-rank ones need one GPU per rank).

Bitwise exactness of the DP strategies on NCCL against a single-device run on the same kind of
device, the uneven collectives in their NCCL forms, the stream ordering of asynchronous waits,
the pipelined TP engine on NCCL, and the number of host synchronizations in one optimizer step.
``profiling/gpu_check.py`` runs the same checks as one command. Never run on a GPU so far: no
machine of this project has one (see README, "GPU check").
"""

from __future__ import annotations

import pytest
import torch

from validation import gpu
from canzona.runtime.launch import run_workers
from validation.harness import tensors_equal

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _need(world: int) -> None:
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs (NCCL: one per rank), found {_gpus()}")


@pytest.mark.parametrize("world", [1, 2, 4])
def test_nccl_strategies_match_single_device_bitwise(world: int) -> None:
    _need(world)
    got = run_workers(gpu.exactness_worker, world, backend="nccl", timeout_s=300)
    want = gpu.reference_params(world)
    for case, params in want.items():
        for rank, res in enumerate(got):
            assert tensors_equal(params, res[case]) == [], f"{case} rank {rank} differs from the single-device run"


@pytest.mark.parametrize("world", [2, 4])
def test_nccl_uneven_collectives(world: int) -> None:
    _need(world)
    res = run_workers(gpu.uneven_collectives_worker, world, backend="nccl", timeout_s=120)
    sizes = res[0]["sizes"]
    want_gather = torch.cat([torch.arange(s, dtype=torch.float32) + 100 * r for r, s in enumerate(sizes)])
    total = sum(range(1, world + 1))
    flat = torch.arange(sum(sizes), dtype=torch.float32) * total
    for r, out in enumerate(res):
        assert torch.equal(out["gathered"], want_gather)
        start = sum(sizes[:r])
        assert torch.equal(out["shard"], flat[start : start + sizes[r]])
        assert out["a2a_in_place"]
        # rank r receives, from each source j, the slice j sent to r
        pieces = []
        for j, o in enumerate(res):
            offs = sum(o["send_sizes"][:r])
            pieces.append(torch.arange(sum(o["send_sizes"]), dtype=torch.float32)[offs : offs + o["send_sizes"][r]] + 1000 * j)
        assert torch.equal(out["a2a"], torch.cat(pieces))


@pytest.mark.parametrize("world", [2])
def test_async_wait_orders_the_stream(world: int) -> None:
    _need(world)
    for r in run_workers(gpu.stream_order_worker, world, backend="nccl", timeout_s=120):
        assert not r["nan"] and r["sum"] == r["want"], r


@pytest.mark.parametrize("world", [2, 4])
def test_pipelined_tp_engine_on_nccl(world: int) -> None:
    _need(world)
    for r in run_workers(gpu.tp_engine_worker, world, backend="nccl", timeout_s=180):
        assert r["groups"] > 2 and r["mismatched"] == [], r


def test_host_syncs_per_step_are_bounded() -> None:
    _need(1)
    (res,) = run_workers(gpu.host_sync_worker, 1, backend="nccl", timeout_s=120)
    for step in res["steps"]:
        # one finiteness read per inner optimizer step() call; nothing per parameter
        assert step["syncs"] <= step["optimizer_steps"], step

