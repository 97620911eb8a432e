"""The tiny Qwen3 under lb-asc Muon, shared by the checkpoint test modules (imported by name, as
``test_optim_common`` is; spawned workers find it on the same ``sys.path``): the model, its
integer gradients (TP-cut on a TP mesh), a few steps of training, and the single-device reference.
"""

from __future__ import annotations

import torch

from validation.harness import ReferenceRunner, inject_grads, integer_grads, mean_grads, tp_local

SAVE_STEPS, MORE_STEPS = 3, 2
MATRIX_KW = {"lr": 0.05}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}


def tiny(seed: int):
    from canzona.config import load_model_config
    from canzona.models import Qwen3

    torch.manual_seed(seed)
    return Qwen3(load_model_config("qwen3-tiny"))


def tiny_grads(step: int, dp_rank: int, *, seed: int = 11) -> dict[str, torch.Tensor]:
    shapes = {n: tuple(p.shape) for n, p in tiny(0).named_parameters()}
    return integer_grads(shapes, step=step, rank=dp_rank, seed=seed)


def qk_norms(names) -> set[str]:
    """The tiny Qwen3 all-reduces its per-head q/k norm gradients over TP (canzona.models.tp)."""
    return {n for n in names if n.endswith(("q_norm.weight", "k_norm.weight"))}


def tiny_opt(seed: int, dp: int, tp: int):
    """The tiny Qwen3 on a dp x tp mesh (DTensor TP when tp > 1) with lb-asc Muon."""
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.models.tp import parallelize

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
    model = parallelize(tiny(seed), mesh["tp"]) if tp > 1 else tiny(seed)
    opt = canzona.DistributedOptimizer(
        model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=4096
    )
    return model, opt


def tiny_run(model, opt, steps) -> None:
    for s in steps:
        full = tiny_grads(s, opt.dp_rank)
        inject_grads(model, tp_local(full, opt.plan.specs, opt.tp_rank, partial=qk_norms(full)) if opt.tp > 1 else full)
        opt.step()
        opt.zero_grad()


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in model.named_parameters()}


def tiny_reference(resume_dp: int, steps: int = SAVE_STEPS + MORE_STEPS) -> ReferenceRunner:
    """Single-device Muon/AdamW on the mean gradients of DP 2 for the first SAVE_STEPS, then of ``resume_dp``."""
    from canzona.optim import Muon

    ref = ReferenceRunner(tiny(0), Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    for s in range(steps):
        dp = 2 if s < SAVE_STEPS else resume_dp
        ref.step(mean_grads([tiny_grads(s, r) for r in range(dp)]))
    return ref
