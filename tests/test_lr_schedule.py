"""torch LR schedulers drive ``canzona.DistributedOptimizer`` exactly.

The optimizer is a ``torch.optim.Optimizer`` with a ``"matrix"`` and an ``"elementwise"`` group;
``step()`` pushes their ``lr``/``weight_decay`` into the inner optimizers (DP owners' and TP
hosts'). Checked bitwise against a single process whose two optimizers are driven by two
schedulers with the same schedule, on injected integer gradients (exact in any reduction order):

- world 2, ``lb-asc`` (DP owners), ``LambdaLR`` with one schedule per group, plus ``zero1`` (every
  parameter element-wise: the matrix group is empty and its schedule reaches nothing);
- world 4, DP2 x TP2 (DTensor TP, LPT micro-groups, TP host optimizers), ``CosineAnnealingLR``;
  the scheduled lr is seen in the TP host optimizer's param groups.

Also: the normal order (``opt.step(); sched.step()``) raises no scheduler warning while the wrong
order does; ``state_dict`` carries the groups' current lr and a resumed run (new model, new
optimizer, ``load_state_dict`` + the scheduler's own ``load_state_dict``) continues bitwise.
"""

from __future__ import annotations

import warnings

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

STEPS, MORE = 4, 2
MATRIX_KW = {"lr": 0.05}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}
ORDER_WARNING = "lr_scheduler.step()"


def matrix_factor(step: int) -> float:
    return 0.5**step


def elementwise_factor(step: int) -> float:
    return 1.0 / (1 + 3 * step)


def _lambda(opt) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, [matrix_factor, elementwise_factor])


def _order_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if ORDER_WARNING in str(w.message) or "overridden" in str(w.message)]


# ------------------------------------------------------------------------------ world 2: DP


def dp_worker(rank: int, world: int) -> bytes:
    import canzona
    from canzona.optim import Muon

    out: dict = {}
    # lb-asc: whole matrices on their DP owners; save after STEPS, continue MORE
    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, Muon, strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)
    sched = _lambda(opt)
    out["groups"] = [(g["name"], list(g["param_names"])) for g in opt.param_groups]
    used: list[tuple] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(STEPS):
            inject_grads(model, integer_grads(model, step=s, rank=rank))
            opt.step()
            rt = opt.runtime
            used.append(
                (
                    [g["lr"] for g in opt.param_groups],
                    rt.matrix_opt.param_groups[0]["lr"] if rt.matrix_opt is not None else None,
                    rt.elementwise_opt.param_groups[0]["lr"] if rt.elementwise_opt is not None else None,
                )
            )
            sched.step()
            opt.zero_grad()
    out["order_warnings"] = _order_warnings(caught)
    out["used"] = used
    out["lb-asc@save"] = params_of(model)
    doc = opt.state_dict()
    box = [doc, sched.state_dict(), [g["lr"] for g in opt.param_groups]]
    torch.distributed.broadcast_object_list(box, src=0)
    doc, sched_state, lrs_at_save = box
    out["hyper_lrs"] = [doc["hyper"]["matrix"]["lr"], doc["hyper"]["elementwise"]["lr"]]
    out["lrs_at_save"] = lrs_at_save
    # the file-based checkpoint goes through the same path and records the scheduler's latest lr
    import os
    import tempfile

    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint

    where = [tempfile.mkdtemp(prefix="canzona-lr-") if rank == 0 else None]
    torch.distributed.broadcast_object_list(where, src=0)
    ckpt = os.path.join(where[0], "opt.pt")
    save_checkpoint(opt, ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    out["file_hyper_lrs"] = [saved["hyper"]["matrix"]["lr"], saved["hyper"]["elementwise"]["lr"]]
    probe = canzona.DistributedOptimizer(ToyModel(seed=9), Muon, strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)
    load_checkpoint(probe, ckpt)
    out["file_lrs_after_load"] = [g["lr"] for g in probe.param_groups]
    for s in range(STEPS, STEPS + MORE):
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        sched.step()
        opt.zero_grad()
    out["lb-asc"] = params_of(model)

    # resume: another initialization, a fresh optimizer and scheduler, then both states loaded
    model = ToyModel(seed=5)
    opt = canzona.DistributedOptimizer(model, Muon, strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)
    sched = _lambda(opt)
    opt.load_state_dict(doc)
    sched.load_state_dict(sched_state)
    out["lrs_after_load"] = [g["lr"] for g in opt.param_groups]
    for s in range(STEPS, STEPS + MORE):
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        sched.step()
        opt.zero_grad()
    out["resumed"] = params_of(model)

    # zero1: AdamW on everything; the matrix group is empty
    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "adamw", strategy="zero1", optimizer_kwargs=EW_KW, elementwise_kwargs=EW_KW, bucket_numel=40)
    sched = _lambda(opt)
    out["zero1_groups"] = [(g["name"], len(g["params"])) for g in opt.param_groups]
    for s in range(STEPS):
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        sched.step()
        opt.zero_grad()
    out["zero1"] = params_of(model)

    # the wrong order is detected (the check above can fail), and groups cannot be added
    opt = canzona.DistributedOptimizer(ToyModel(), Muon, strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)
    sched = _lambda(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
    out["wrong_order_warnings"] = _order_warnings(caught)
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    except TypeError as exc:
        out["add_group"] = str(exc)
    return pack(out)


def _dp_reference(steps: int, *, all_elementwise: bool = False, scheduled: bool = True) -> dict[str, torch.Tensor]:
    from canzona.optim import Muon

    model = ToyModel()
    if all_elementwise:
        ref = ReferenceRunner(model, torch.optim.AdamW, EW_KW, torch.optim.AdamW, EW_KW, all_elementwise=True)
        factors = [elementwise_factor]
    else:
        ref = ReferenceRunner(model, Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
        factors = [matrix_factor, elementwise_factor]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, f) for o, f in zip(ref.optimizers, factors, strict=True)]
    for s in range(steps):
        ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(2)]))
        if scheduled:
            for sc in scheds:
                sc.step()
    return ref.params()


def test_schedulers_drive_dp_owners_bitwise_and_checkpoints_carry_the_lr() -> None:
    res = [unpack(r) for r in run_workers(dp_worker, 2, timeout_s=150)]
    model = ToyModel()
    want_save = _dp_reference(STEPS)
    want = _dp_reference(STEPS + MORE)
    # the schedule matters: a constant-lr run ends elsewhere, so equality below is not vacuous
    assert tensors_equal(want, _dp_reference(STEPS + MORE, scheduled=False)) != []
    want_zero1 = _dp_reference(STEPS, all_elementwise=True)
    from canzona.specs import is_matrix_param

    names = [n for n, _ in model.named_parameters()]
    matrix = [n for n, p in model.named_parameters() if is_matrix_param(n, p.shape)]
    for rank, r in enumerate(res):
        assert r["groups"] == [("matrix", matrix), ("elementwise", [n for n in names if n not in matrix])]
        assert r["order_warnings"] == [], f"rank {rank}: {r['order_warnings']}"
        assert tensors_equal(want_save, r["lb-asc@save"]) == [], f"rank {rank}: scheduled lb-asc run differs"
        assert tensors_equal(want, r["lb-asc"]) == [], f"rank {rank}: scheduled lb-asc run differs after the save"
        assert tensors_equal(want, r["resumed"]) == [], f"rank {rank}: resumed run differs"
        assert r["zero1_groups"] == [("matrix", 0), ("elementwise", len(names))]
        assert tensors_equal(want_zero1, r["zero1"]) == [], f"rank {rank}: scheduled zero1 run differs"
        # step s used the schedule's value at s, in the front groups and in the owners' optimizers
        for s, (front, mat, ew) in enumerate(r["used"]):
            expect = [MATRIX_KW["lr"] * matrix_factor(s), EW_KW["lr"] * elementwise_factor(s)]
            assert front == pytest.approx(expect, rel=1e-12)
            assert mat in (None, front[0]) and ew in (None, front[1])
        # the saved document holds the lr the scheduler set after the last step, and loading restores it
        assert r["hyper_lrs"] == r["lrs_at_save"] == r["lrs_after_load"]
        assert r["file_hyper_lrs"] == r["lrs_at_save"] == r["file_lrs_after_load"]
        assert r["lrs_at_save"] == pytest.approx([MATRIX_KW["lr"] * matrix_factor(STEPS), EW_KW["lr"] * elementwise_factor(STEPS)], rel=1e-12)
        assert any("before `optimizer.step()`" in w for w in r["wrong_order_warnings"])
        assert "fixed by its plan" in r["add_group"]
    # some rank owns matrix parameters and some owns element-wise ones: the pushes were exercised
    assert any(u[1] is not None for r in res for u in r["used"]) and any(u[2] is not None for r in res for u in r["used"])


# ------------------------------------------------------------------------------ world 4: DP2 x TP2


def _tiny(seed: int):
    from canzona.config import load_model_config
    from canzona.models import Qwen3

    torch.manual_seed(seed)
    return Qwen3(load_model_config("qwen3-tiny"))


def _tiny_grads(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    shapes = {n: tuple(p.shape) for n, p in _tiny(0).named_parameters()}
    return integer_grads(shapes, step=step, rank=dp_rank, seed=3)


def _cosine(opt) -> torch.optim.lr_scheduler.CosineAnnealingLR:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-3)


def tp_worker(rank: int, world: int) -> bytes:
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.models.tp import parallelize
    from canzona.optim import Muon
    from canzona.testing import tp_local

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = parallelize(_tiny(0), mesh["tp"])
    opt = canzona.DistributedOptimizer(
        model, Muon, strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=4096
    )
    sched = _cosine(opt)
    eng = opt.runtime.tp_engine
    seen: list[tuple] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(STEPS):
            full = _tiny_grads(s, dp_rank)
            partial = {n for n in full if n.endswith(("q_norm.weight", "k_norm.weight"))}  # TP all-reduced in backward
            inject_grads(model, tp_local(full, opt.plan.specs, tp_rank, partial=partial))
            opt.step()
            host = eng.optimizer if eng is not None else None
            seen.append((opt.param_groups[0]["lr"], [g["lr"] for g in host.param_groups] if host is not None else None))
            sched.step()
            opt.zero_grad()
    full = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in model.named_parameters()}
    return pack({"params": full, "seen": seen, "hosted": list(eng.hosted) if eng is not None else [], "order_warnings": _order_warnings(caught)})


def test_schedulers_reach_tp_hosts_bitwise() -> None:
    from canzona.optim import Muon

    res = [unpack(r) for r in run_workers(tp_worker, 4, timeout_s=170)]
    ref = ReferenceRunner(_tiny(0), Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    scheds = [_cosine(o) for o in ref.optimizers]
    lrs = []
    for s in range(STEPS):
        lrs.append(ref.optimizers[0].param_groups[0]["lr"])
        ref.step(mean_grads([_tiny_grads(s, r) for r in range(2)]))
        for sc in scheds:
            sc.step()
    want = ref.params()
    assert len(set(lrs)) == STEPS, "the cosine schedule should change the lr every step"
    assert sum(len(r["hosted"]) for r in res) > 0, "no rank hosts a TP task: the host path was not exercised"
    for rank, r in enumerate(res):
        assert r["order_warnings"] == [], f"rank {rank}: {r['order_warnings']}"
        assert tensors_equal(want, r["params"]) == [], f"rank {rank}: DP2 x TP2 run under CosineAnnealingLR differs"
        for s, (front, host) in enumerate(r["seen"]):
            assert front == lrs[s]
            if r["hosted"]:
                assert host == [lrs[s]], f"rank {rank} step {s}: the TP host optimizer ran with lr {host}, the schedule says {lrs[s]}"
