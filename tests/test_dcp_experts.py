"""Sharded checkpoints (both DCP forms) of expert stacks where a rank holds several experts.

canzona's tiny Qwen3-MoE (two layers, stacks ``(8, 64, 64)`` and ``(8, 64, 32)``) trained under
``lb-asc`` at dp 2 with Muon: each rank owns several experts of every stack, so each rank writes
several 3-D pieces of every master and momentum key. One world-2 run saves it with
``save_sharded`` and with ``dcp.save({"model": ..., "optim": opt})``, loads both under ``asc`` at
dp 2 (then steps the loaded and the uninterrupted run on the same gradients) and under the EP
layout (``("ep",)``, four experts per rank), whose own save loads back under ``lb-asc``. One
world-4 run loads them under ``lb-asc`` at dp 4 and under ``("dp", "ep")``, whose save loads back
at dp 4; the test process loads them on one device. Every load is compared with the saved
consolidated document (every master, every state tensor, its memory layout, the step count and
the hyperparameters) with ``torch.equal``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from canzona.runtime.launch import run_workers
from harness import attempt, case_results, consolidated_on_every_rank, doc_differences
from validation.harness import inject_grads, integer_grads, pack, unpack

pytestmark = pytest.mark.slow

MKW = {"lr": 0.05, "adjust_lr_fn": "spectral"}
EKW = {"lr": 0.01, "weight_decay": 0.1}
STEPS = 2


def _model(seed: int):
    from canzona.config import load_model_config
    from canzona.models import Qwen3MoE

    return Qwen3MoE(load_model_config("qwen3-moe-tiny"), seed=seed)


def _opt(model, strategy: str = "lb-asc", mesh=None):
    import canzona

    return canzona.DistributedOptimizer(model, "muon", strategy=strategy, mesh=mesh, optimizer_kwargs=MKW, elementwise_kwargs=EKW, bucket_numel=20_000)


def _stacks(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.dim() == 3]


def _ep_model(seed: int, mesh):
    """The tiny Qwen3-MoE with every stack a DTensor ``Shard(0)`` on the mesh's ``ep`` dimension."""
    from torch import nn
    from torch.distributed.tensor import DTensor, Shard

    model = _model(seed)
    ep_mesh = mesh if mesh.ndim == 1 else mesh["ep"]
    ep, ep_rank = ep_mesh.size(), ep_mesh.get_local_rank()
    for layer in model.model.layers:
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(layer.mlp.experts, name).detach().chunk(ep)[ep_rank].clone()
            setattr(layer.mlp.experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))
    return model


def _loads(opt, folder: Path, name: str) -> list[str]:
    """Load the sharded checkpoint ``name`` into ``opt``: how it differs from the saved document."""
    from canzona.runtime.dcp import load_sharded

    load_sharded(opt, folder / f"{name}.dcp")
    return doc_differences(consolidated_on_every_rank(opt), torch.load(folder / "ref.pt", weights_only=True))


def _stateful(opt, model, folder: Path, name: str) -> list[str]:
    """Load ``name``'s Stateful form (model and optimizer) with ``dcp.load``: how ``opt`` differs
    from the saved document."""
    import torch.distributed.checkpoint as dcp

    dcp.load({"model": model.state_dict(), "optim": opt}, checkpoint_id=str(folder / f"{name}.stateful"))
    return doc_differences(consolidated_on_every_rank(opt), torch.load(folder / "ref.pt", weights_only=True))


def _save(opt, model, folder: Path, name: str) -> None:
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.dcp import save_sharded

    save_sharded(opt, folder / f"{name}.dcp")
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=str(folder / f"{name}.stateful"))


def _train_and_resume(rank: int, folder: Path) -> dict:
    """lb-asc at dp 2, saved in both forms; loaded under asc at dp 2; both runs then take one step
    on the same gradients."""
    import torch.distributed as dist

    model = _model(1)
    opt = _opt(model)
    for s in range(STEPS):
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        opt.zero_grad()
    several = {n: sum(1 for pc in opt.runtime.pieces if pc.name == n and pc.expert is not None) for n in _stacks(model)}
    doc = consolidated_on_every_rank(opt)
    if rank == 0:
        torch.save(doc, folder / "ref.pt")
    dist.barrier()
    _save(opt, model, folder, "lb")
    asc_model = _model(2)  # other values: the load must bring the saved ones
    asc = _opt(asc_model, "asc")
    out = {"several": several, "asc": _loads(asc, folder, "lb")}
    again_model = _model(3)
    out["asc_stateful"] = _stateful(_opt(again_model, "asc"), again_model, folder, "lb")
    for m, o in ((model, opt), (asc_model, asc)):
        inject_grads(m, integer_grads(m, step=STEPS, rank=rank))
        o.step()
    out["next_step"] = [n for (n, p), q in zip(model.named_parameters(), asc_model.parameters()) if not torch.equal(p, q)]
    return out


def _ep_and_back(rank: int, world: int, folder: Path) -> dict:
    """Load the lb-asc checkpoint under EP, save there, load that back under lb-asc."""
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = ((2,), ("ep",)) if world == 2 else ((2, 2), ("dp", "ep"))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ep_model = _ep_model(4, mesh)
    ep_opt = _opt(ep_model, mesh=mesh if world == 4 else None)
    out = {"ep": _loads(ep_opt, folder, "lb")}
    again = _ep_model(5, mesh)
    out["ep_stateful"] = _stateful(_opt(again, mesh=mesh if world == 4 else None), again, folder, "lb")
    _save(ep_opt, ep_model, folder, f"ep{world}")
    back_model = _model(6)
    out["back"] = _loads(_opt(back_model), folder, f"ep{world}")
    back2 = _model(7)
    out["back_stateful"] = _stateful(_opt(back2), back2, folder, f"ep{world}")
    return out


def _at_dp4(rank: int, folder: Path) -> dict:
    model = _model(8)
    out = {"dp4": _loads(_opt(model), folder, "lb")}
    again = _model(9)
    out["dp4_stateful"] = _stateful(_opt(again), again, folder, "lb")
    return out


def worker(rank: int, world: int, folder: str) -> bytes:
    path = Path(folder)
    if world == 2:
        cases = {"resume": attempt(_train_and_resume, rank, path)}
        cases["ep"] = attempt(_ep_and_back, rank, world, path)
    else:
        cases = {"dp4": attempt(_at_dp4, rank, path), "ep": attempt(_ep_and_back, rank, world, path)}
    return pack({"cases": cases})


_RUNS: dict[int, list[dict]] = {}
_FOLDER: list[Path] = []


def _runs(world: int) -> list[dict]:
    if not _FOLDER:
        _FOLDER.append(Path(tempfile.mkdtemp(prefix="canzona-dcp-experts-")))
    for w in (2, world):  # the world-4 run reads the world-2 run's checkpoints
        if w not in _RUNS:
            _RUNS[w] = [unpack(r) for r in run_workers(worker, w, str(_FOLDER[0]), timeout_s=240)]
    return _RUNS[world]


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    yield
    for f in _FOLDER:
        shutil.rmtree(f, ignore_errors=True)


def test_lb_asc_save_with_several_experts_per_rank_loads_under_asc_bitwise() -> None:
    res = case_results(_runs(2), "cases", "resume")
    assert any(res[0]["several"][n] and res[1]["several"][n] for n in res[0]["several"])  # a stack split over both ranks
    for r in res:
        assert max(r["several"].values()) >= 2, r["several"]  # several experts of one stack on every rank
        assert r["asc"] == [] and r["asc_stateful"] == [], (r["asc"], r["asc_stateful"])
        assert r["next_step"] == [], r["next_step"]


@pytest.mark.parametrize("world", [2, 4])
def test_expert_checkpoints_cross_the_ep_layout_and_back_bitwise(world: int) -> None:
    for r in case_results(_runs(world), "cases", "ep"):
        assert r == {"ep": [], "ep_stateful": [], "back": [], "back_stateful": []}, r


def test_lb_asc_dp2_checkpoint_loads_at_dp4_bitwise() -> None:
    for r in case_results(_runs(4), "cases", "dp4"):
        assert r == {"dp4": [], "dp4_stateful": []}, r


def test_lb_asc_dp2_checkpoint_loads_on_one_device_bitwise(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.dcp import load_sharded
    from canzona.runtime.launch import file_init_method, process_group

    _runs(2)
    folder = _FOLDER[0]
    ref = torch.load(folder / "ref.pt", weights_only=True)
    with process_group(file_init_method(tmp_path)):
        model = _model(10)
        opt = _opt(model)
        load_sharded(opt, folder / "lb.dcp")
        assert doc_differences(opt.consolidated_state_dict(), ref) == []
        model = _model(11)
        opt = _opt(model)
        dcp.load({"model": model.state_dict(), "optim": opt}, checkpoint_id=str(folder / "lb.stateful"))
        assert doc_differences(opt.consolidated_state_dict(), ref) == []
