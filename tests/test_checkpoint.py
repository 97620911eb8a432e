"""Checkpoints: save at DP=2, load at DP=1 and DP=4, continue bitwise equal to an uninterrupted run.

Also: the tiny Qwen3 model saved under DP2 x TP2 (DTensor TP, LPT micro-groups: TP shards and
host-held full-shape state) resumes bitwise under DP2 x TP2 and under pure DP4 (no TP).

The uninterrupted run is one process running the same optimizers on the same reduced gradients
(integers times 2**-4: any reduction order and any DP size give the exact mean): three steps with
the two-rank means, then two with the means of the resuming world. The resumed models start from
a different random initialization, so equality also shows the checkpoint restored the parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from canzona.runtime.launch import run_workers
from canzona.testing import (
    ReferenceRunner,
    ToyModel,
    inject_grads,
    integer_grads,
    mean_grads,
    pack,
    params_of,
    tensors_equal,
    unpack,
)

pytestmark = pytest.mark.slow

SAVE_STEPS, MORE_STEPS = 3, 2
MATRIX_KW = {"lr": 0.05}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}
CASES = (("lb-asc", "muon"), ("zero1", "adamw"), ("layerwise", "shampoo"), ("lb-asc-joint", "soap"))


def _cls(name: str) -> type[torch.optim.Optimizer]:
    from canzona.optim import SOAP, Muon, Shampoo

    return {"adamw": torch.optim.AdamW, "muon": Muon, "shampoo": Shampoo, "soap": SOAP}[name]


def _opt(model, strategy: str, optname: str):
    import canzona

    return canzona.DistributedOptimizer(
        model, optname, strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40
    )


def save_worker(rank: int, world: int, folder: str) -> None:
    from canzona.runtime.checkpoint import save_checkpoint

    for strategy, optname in CASES:
        model = ToyModel()
        opt = _opt(model, strategy, optname)
        for s in range(SAVE_STEPS):
            inject_grads(model, integer_grads(model, step=s, rank=rank))
            opt.step()
            opt.zero_grad()
        save_checkpoint(opt, Path(folder) / f"{strategy}.pt")


def resume_worker(rank: int, world: int, folder: str) -> bytes:
    from canzona.runtime.checkpoint import CheckpointError, load_checkpoint

    out: dict = {}
    for strategy, optname in CASES:
        model = ToyModel(seed=5)
        opt = _opt(model, strategy, optname)
        load_checkpoint(opt, Path(folder) / f"{strategy}.pt")
        assert opt.steps == SAVE_STEPS
        # a round trip through the new plan's owners reproduces the saved document
        again = opt.state_dict()
        if rank == 0:
            saved = torch.load(Path(folder) / f"{strategy}.pt", weights_only=True)
            out[(strategy, "roundtrip")] = tensors_equal(saved["params"], again["params"]) + [
                f"{n}.{k}"
                for n, st in saved["state"].items()
                for k, v in st.items()
                if not (torch.equal(v, again["state"][n][k]) if torch.is_tensor(v) else v == again["state"][n][k])
            ]
        for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS):
            inject_grads(model, integer_grads(model, step=s, rank=rank))
            opt.step()
            opt.zero_grad()
        out[strategy] = params_of(model)
    if world == 4:
        out["tp"] = _tp_resume(rank, folder)
    if world == 1:
        model = ToyModel()
        wrong = _opt(model, "lb-asc", "shampoo")
        try:
            load_checkpoint(wrong, Path(folder) / "lb-asc.pt")
        except CheckpointError as exc:
            out["wrong_optimizer"] = str(exc)
        junk = Path(folder) / "junk.pt"
        torch.save({"hello": torch.zeros(1)}, junk)
        try:
            load_checkpoint(wrong, junk)
        except CheckpointError as exc:
            out["junk"] = str(exc)
        # a mis-shaped state of the last parameter is refused before any master is written
        fresh = _opt(ToyModel(seed=7), "zero1", "adamw")
        before = [m.clone() for m in fresh.runtime.masters.values()]
        bad = torch.load(Path(folder) / "zero1.pt", weights_only=True)
        last = list(fresh.plan.buffer_order())[-1].name
        bad["state"][last]["exp_avg"] = bad["state"][last]["exp_avg"].reshape(-1)[1:]
        try:
            fresh.load_state_dict(bad)
        except CheckpointError as exc:
            out["bad_state"] = str(exc)
        out["bad_state_untouched"] = all(torch.equal(a, m) for a, m in zip(before, fresh.runtime.masters.values()))
    return pack(out)


# ------------------------------------------------------------------------------ TP shards re-sharded


def _tiny(seed: int):
    from canzona.config import load_model_config
    from canzona.models import Qwen3

    cfg = load_model_config("qwen3-tiny")
    torch.manual_seed(seed)
    return Qwen3(cfg)


def _tiny_grads(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    shapes = {n: tuple(p.shape) for n, p in _tiny(0).named_parameters()}
    return integer_grads(shapes, step=step, rank=dp_rank, seed=11)


def _qk_norms(names) -> set[str]:
    """The tiny Qwen3 all-reduces its per-head q/k norm gradients over TP (canzona.models.tp)."""
    return {n for n in names if n.endswith(("q_norm.weight", "k_norm.weight"))}


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in model.named_parameters()}


def _tp_resume(rank: int, folder: str) -> dict:
    """Save under DP2 x TP2 (DTensor TP, micro-groups), resume under DP2 x TP2 and under pure DP4."""
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.models.tp import parallelize
    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint
    from canzona.testing import tp_local

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    path = Path(folder) / "tp.pt"

    def tp_opt(seed: int):
        model = parallelize(_tiny(seed), mesh["tp"])
        return model, canzona.DistributedOptimizer(
            model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=4096
        )

    def run(model, opt, steps, dp: int, r: int, tp_r: int) -> None:
        for s in steps:
            full = _tiny_grads(s, r)
            inject_grads(model, tp_local(full, opt.plan.specs, tp_r, partial=_qk_norms(full)) if opt.tp > 1 else full)
            opt.step()
            opt.zero_grad()

    model, opt = tp_opt(0)
    run(model, opt, range(SAVE_STEPS), 2, dp_rank, tp_rank)
    save_checkpoint(opt, path)
    out = {}
    model, opt = tp_opt(5)
    load_checkpoint(opt, path)
    run(model, opt, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS), 2, dp_rank, tp_rank)
    out["dp2xtp2"] = _full(model)
    model = _tiny(5)
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=4096)
    load_checkpoint(opt, path)
    run(model, opt, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS), 4, rank, 0)
    out["dp4"] = _full(model)
    return out


def _tp_reference(resume_dp: int) -> dict[str, torch.Tensor]:
    from canzona.optim import Muon

    ref = ReferenceRunner(_tiny(0), Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    for s in range(SAVE_STEPS + MORE_STEPS):
        dp = 2 if s < SAVE_STEPS else resume_dp
        ref.step(mean_grads([_tiny_grads(s, r) for r in range(dp)]))
    return ref.params()


def _reference(strategy: str, optname: str, resume_world: int) -> dict[str, torch.Tensor]:
    model = ToyModel()
    ref = ReferenceRunner(model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1")
    for s in range(SAVE_STEPS + MORE_STEPS):
        world = 2 if s < SAVE_STEPS else resume_world
        ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(world)]))
    return ref.params()


def test_save_dp2_resume_dp1_and_dp4_bitwise(tmp_path: Path) -> None:
    run_workers(save_worker, 2, str(tmp_path), timeout_s=120)
    doc = torch.load(tmp_path / "lb-asc.pt", weights_only=True)
    assert doc["format"] == "canzona.optimizer_state" and doc["meta"]["dp"] == 2 and doc["meta"]["steps"] == SAVE_STEPS
    import json

    json.dumps(doc["meta"])  # metadata is JSON-able
    for resume_world in (1, 4):
        res = [unpack(r) for r in run_workers(resume_worker, resume_world, str(tmp_path), timeout_s=150)]
        for strategy, optname in CASES:
            assert res[0][(strategy, "roundtrip")] == [], f"{strategy}: state changed in a load/save round trip"
            want = _reference(strategy, optname, resume_world)
            for rank, r in enumerate(res):
                assert tensors_equal(want, r[strategy]) == [], f"{strategy} resumed at DP={resume_world}, rank {rank}"
        if resume_world == 4:
            for key, dp in (("dp2xtp2", 2), ("dp4", 4)):
                want = _tp_reference(dp)
                for rank, r in enumerate(res):
                    assert tensors_equal(want, r["tp"][key]) == [], f"TP checkpoint resumed as {key}, rank {rank}"
        if resume_world == 1:
            assert "written by matrix_optimizer 'Muon'" in res[0]["wrong_optimizer"]
            assert "not a canzona optimizer checkpoint" in res[0]["junk"]
            assert "state 'exp_avg' has shape" in res[0]["bad_state"]
            assert res[0]["bad_state_untouched"], "a refused checkpoint overwrote masters"
