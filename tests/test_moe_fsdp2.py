"""Expert stacks on the FSDP2 path: ``Shard(0)`` gives each rank whole experts, which it updates
where they live, one matrix task per expert, bitwise against the single-device optimizer applied to
each expert alone (4 experts over 2 ranks, and 3 experts: 2 and 1), including a step where one
expert got no tokens; every expert's momentum in the consolidated state; a stack cut on another
dimension and a Conv1D refused in one line; under lb-asc a sharded (DCP) checkpoint of ranks
holding several experts of a stack loads back equal to the saved state. One world-2 spawn."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

from canzona.runtime.launch import run_workers
from canzona.specs import module_roles
from validation.harness import integer_grads, mean_grads, pack, unpack
from moe_models import FSDPMoE, TaskReference

pytestmark = pytest.mark.slow

STEPS = 3
MKW = {"lr": 0.05, "adjust_lr_fn": "spectral"}
EKW = {"lr": 0.01, "weight_decay": 0.1}
STRATEGIES = ("lb-asc", "sc")
STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.experts.odd")


def _shapes() -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in FSDPMoE().named_parameters()}


def _grads(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = integer_grads(_shapes(), step=step, rank=rank)
    if step == 1:  # expert 1 of every stack routed no token on any rank: a zero gradient
        for n in STACKS:
            g[n][1].zero_()
    return g


def _sharded(mesh):
    from torch.distributed.fsdp import fully_shard

    model = FSDPMoE()
    fully_shard(model.mlp.experts, mesh=mesh)
    fully_shard(model.proj, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _case(rank: int, strategy: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import canzona

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = _sharded(mesh)
    opt = canzona.DistributedOptimizer(model, "muon", strategy=strategy, mesh=mesh, optimizer_kwargs=MKW, elementwise_kwargs=EKW)
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if n in STACKS}
    for s in range(STEPS):
        model(_grads(s, rank)).backward()
        opt.step()
        opt.zero_grad()
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    doc = opt.consolidated_state_dict()
    out = {"params": params, "local": local, "experts_local": len(opt.runtime.expert_masters), "exchanged": list(opt.runtime.engine.hosted)}
    if rank == 0:
        out["state"] = {n: {k: v for k, v in st.items() if torch.is_tensor(v)} for n, st in doc["state"].items()}
    if strategy == "lb-asc":  # each rank holds several whole experts of a stack: the sharded round trip
        import torch.distributed as dist

        from canzona.runtime.dcp import load_sharded, save_sharded
        from harness import doc_differences

        folder = [tempfile.mkdtemp(prefix="canzona-fsdp-experts-") if rank == 0 else None]
        dist.broadcast_object_list(folder, src=0)
        save_sharded(opt, f"{folder[0]}/experts.dcp")
        again = canzona.DistributedOptimizer(_sharded(mesh), "muon", strategy=strategy, mesh=mesh, optimizer_kwargs=MKW, elementwise_kwargs=EKW)
        load_sharded(again, f"{folder[0]}/experts.dcp")
        boxes = [again.consolidated_state_dict() or None, doc or None]
        dist.broadcast_object_list(boxes, src=0)
        out["sharded"] = doc_differences(*boxes)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    return out


def _refusals(rank: int) -> dict:
    """A stack sharded on another dimension than its experts' is refused in one line on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    import canzona

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = FSDPMoE()
    fully_shard(model.mlp.experts, mesh=mesh, shard_placement_fn=lambda p: Shard(2))
    fully_shard(model, mesh=mesh)
    try:
        canzona.DistributedOptimizer(model, "muon", mesh=mesh)
        return {"error": None}
    except ValueError as exc:
        return {"error": str(exc)}


def worker(rank: int, world: int) -> bytes:
    out = {s: _case(rank, s) for s in STRATEGIES}
    out["refused"] = _refusals(rank)
    return pack(out)


_RUN: list[dict] = []


def _results() -> list[dict]:
    if not _RUN:
        _RUN.extend(unpack(r) for r in run_workers(worker, 2, timeout_s=300))
    return _RUN


def _reference() -> TaskReference:
    from canzona.optim import Muon

    model = FSDPMoE()
    ref = TaskReference(model, module_roles(model), Muon, MKW, torch.optim.AdamW, EKW)
    for s in range(STEPS):
        ref.step(mean_grads([_grads(s, r) for r in range(2)]))
    return ref


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp2_experts_local_and_bitwise(strategy: str) -> None:
    res = [r[strategy] for r in _results()]
    ref = _reference()
    want = ref.params()
    for r in res:
        bad = [n for n in want if not torch.equal(r["params"][n], want[n])]
        assert bad == [], bad
        assert not set(STACKS) & set(r["exchanged"])  # experts never go through the exchange
    assert [r["local"]["mlp.experts.odd"] for r in res] == [(2, 5, 4), (1, 5, 4)]
    assert [r["experts_local"] for r in res] == [2 + 2 + 2, 2 + 2 + 1]
    if strategy == "lb-asc":  # the sharded checkpoint loads back equal to the saved state
        assert all(r["sharded"] == [] for r in res), [r["sharded"] for r in res]
    state = res[0]["state"]
    for n in STACKS:
        for e, m in enumerate(ref.momentum(n)):
            assert torch.equal(state[n]["momentum_buffer"][e], m), (n, e)


def test_fsdp2_stack_cut_inside_experts_refused() -> None:
    for r in _results():
        msg = r["refused"]["error"]
        assert msg is not None and "mlp.experts." in msg and "\n" not in msg, msg
