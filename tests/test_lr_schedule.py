"""torch LR schedulers drive ``canzona.DistributedOptimizer`` exactly.

The optimizer is a ``torch.optim.Optimizer`` with a ``"matrix"`` and an ``"elementwise"`` group;
``step()`` pushes their ``lr``/``weight_decay`` into the inner optimizers (DP owners' and TP
hosts'). Checked bitwise against a single process whose two optimizers are driven by two
schedulers with the same schedule, on injected integer gradients (exact in any reduction order):

- DP4, ``lb-asc`` (DP owners), ``LambdaLR`` with one schedule per group, plus ``zero1`` (every
  parameter element-wise: the matrix group is empty and its schedule reaches nothing);
- DP2 x TP2 (DTensor TP, LPT micro-groups, TP host optimizers), ``CosineAnnealingLR``; the
  scheduled lr is seen in the TP host optimizer's param groups.

Also: the normal order (``opt.step(); sched.step()``) raises no scheduler warning while the wrong
order does; ``state_dict`` carries the groups' current lr and a resumed run (new model, new
optimizer, ``load_state_dict`` + the scheduler's own ``load_state_dict``) continues bitwise.

One spawned world-4 group runs every case (:data:`CASES`); each test reads its own case's result,
so a broken case fails its own tests by name.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

from canzona.runtime.launch import run_workers
from harness import attempt, case_results
from validation.harness import ReferenceRunner, ToyModel, inject_grads, integer_grads, mean_grads, pack, params_of, tensors_equal, unpack
from tiny_qwen3 import tiny, tiny_grads

pytestmark = pytest.mark.slow

STEPS, MORE = 4, 2
GRAD_SEED = 3  # the DP2 x TP2 case's gradients (tiny_qwen3's checkpoint cases use another seed)
WORLD = 4
DP = WORLD  # the ZeRO-1 cases run data parallel over the whole world
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


# ------------------------------------------------------------------------------ DP cases (world 4 = DP4)


def _lb_asc(model=None):
    import canzona
    from canzona.optim import Muon

    model = ToyModel() if model is None else model
    return model, canzona.DistributedOptimizer(model, Muon, strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)


def _train(model, opt, sched, steps: range, rank: int, record: list | None = None) -> None:
    for s in steps:
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        if record is not None:
            rt = opt.runtime
            record.append(
                (
                    [g["lr"] for g in opt.param_groups],
                    rt.matrix_opt.param_groups[0]["lr"] if rt.matrix_opt is not None else None,
                    rt.elementwise_opt.param_groups[0]["lr"] if rt.elementwise_opt is not None else None,
                )
            )
        sched.step()
        opt.zero_grad()


def case_lb_asc(rank: int) -> dict:
    """STEPS then MORE scheduled steps in the normal order: groups, warnings, lrs used, values."""
    model, opt = _lb_asc()
    sched = _lambda(opt)
    out: dict = {"groups": [(g["name"], list(g["param_names"])) for g in opt.param_groups]}
    used: list[tuple] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, opt, sched, range(STEPS), rank, used)
        out["at_save"] = params_of(model)
        _train(model, opt, sched, range(STEPS, STEPS + MORE), rank)
    out.update(order_warnings=_order_warnings(caught), used=used, final=params_of(model))
    return out


def case_checkpoint(rank: int) -> dict:
    """Save after STEPS (state_dict and the file checkpoint), then resume a fresh model and optimizer."""
    import os
    import tempfile

    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint

    model, opt = _lb_asc()
    sched = _lambda(opt)
    _train(model, opt, sched, range(STEPS), rank)
    doc = opt.consolidated_state_dict()
    box = [doc, sched.state_dict(), [g["lr"] for g in opt.param_groups]]
    torch.distributed.broadcast_object_list(box, src=0)
    doc, sched_state, lrs_at_save = box
    out: dict = {"lrs_at_save": lrs_at_save, "hyper_lrs": [doc["hyper"]["matrix"]["lr"], doc["hyper"]["elementwise"]["lr"]]}
    # the file-based checkpoint goes through the same path and records the scheduler's latest lr
    tmp = tempfile.TemporaryDirectory(prefix="canzona-lr-") if rank == 0 else None
    where = [tmp.name if tmp is not None else None]
    torch.distributed.broadcast_object_list(where, src=0)
    try:
        ckpt = os.path.join(where[0], "opt.pt")
        save_checkpoint(opt, ckpt)
        saved = torch.load(ckpt, map_location="cpu", weights_only=True)
        out["file_hyper_lrs"] = [saved["hyper"]["matrix"]["lr"], saved["hyper"]["elementwise"]["lr"]]
        _, probe = _lb_asc(ToyModel(seed=9))
        load_checkpoint(probe, ckpt)
        out["file_lrs_after_load"] = [g["lr"] for g in probe.param_groups]
        torch.distributed.barrier()  # every rank has read the file before rank 0 removes it
    finally:
        if tmp is not None:
            tmp.cleanup()
    # resume: another initialization, a fresh optimizer and scheduler, then both states loaded
    model, opt = _lb_asc(ToyModel(seed=5))
    sched = _lambda(opt)
    opt.load_state_dict(doc)
    sched.load_state_dict(sched_state)
    out["lrs_after_load"] = [g["lr"] for g in opt.param_groups]
    _train(model, opt, sched, range(STEPS, STEPS + MORE), rank)
    out["resumed"] = params_of(model)
    return out


def case_zero1(rank: int) -> dict:
    """AdamW on everything under zero1: the matrix group is empty."""
    import canzona

    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "adamw", strategy="zero1", optimizer_kwargs=EW_KW, elementwise_kwargs=EW_KW, bucket_numel=40)
    sched = _lambda(opt)
    groups = [(g["name"], len(g["params"])) for g in opt.param_groups]
    _train(model, opt, sched, range(STEPS), rank)
    return {"groups": groups, "params": params_of(model)}


def case_wrong_order(rank: int) -> list[str]:
    """``sched.step()`` before any ``opt.step()``: torch's order warning (so the normal-order check can fail)."""
    _, opt = _lb_asc()
    sched = _lambda(opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched.step()
    return _order_warnings(caught)


def case_add_group(rank: int) -> str:
    _, opt = _lb_asc()
    try:
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    except TypeError as exc:
        return str(exc)
    return "no error"


# ------------------------------------------------------------------------------ DP2 x TP2 case


def _cosine(opt) -> torch.optim.lr_scheduler.CosineAnnealingLR:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-3)


def case_tp(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.models.tp import parallelize
    from canzona.optim import Muon
    from validation.harness import tp_local

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = parallelize(tiny(0), mesh["tp"])
    opt = canzona.DistributedOptimizer(
        model, Muon, strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=4096
    )
    sched = _cosine(opt)
    eng = opt.runtime.tp_engine
    seen: list[tuple] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(STEPS):
            full = tiny_grads(s, dp_rank, seed=GRAD_SEED)
            partial = {n for n in full if n.endswith(("q_norm.weight", "k_norm.weight"))}  # TP all-reduced in backward
            inject_grads(model, tp_local(full, opt.plan.specs, tp_rank, partial=partial))
            opt.step()
            host = eng.optimizer if eng is not None else None
            seen.append((opt.param_groups[0]["lr"], [g["lr"] for g in host.param_groups] if host is not None else None))
            sched.step()
            opt.zero_grad()
    full = {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in model.named_parameters()}
    return {"params": full, "seen": seen, "hosted": list(eng.hosted) if eng is not None else [], "order_warnings": _order_warnings(caught)}


CASES = {
    "lb-asc": case_lb_asc,
    "checkpoint": case_checkpoint,
    "zero1": case_zero1,
    "wrong-order": case_wrong_order,
    "add-group": case_add_group,
    "tp": case_tp,
}


def worker(rank: int, world: int) -> bytes:
    out = {}
    for name, fn in CASES.items():
        out[name] = attempt(fn, rank)
        torch.distributed.barrier()
    return pack({"cases": out})


@pytest.fixture(scope="module")
def case():
    cache: list[list] = []

    def get(name: str) -> list:
        if not cache:
            cache.append([unpack(r) for r in run_workers(worker, WORLD, timeout_s=240)])
        return case_results(cache[0], "cases", name)

    return get


# ------------------------------------------------------------------------------ references (parent)


@functools.cache
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
        ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(DP)]))
        if scheduled:
            for sc in scheds:
                sc.step()
    return ref.params()


@functools.cache
def _tp_reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    from canzona.optim import Muon

    ref = ReferenceRunner(tiny(0), Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    scheds = [_cosine(o) for o in ref.optimizers]
    lrs = []
    for s in range(STEPS):
        lrs.append(ref.optimizers[0].param_groups[0]["lr"])
        ref.step(mean_grads([tiny_grads(s, r, seed=GRAD_SEED) for r in range(2)]))
        for sc in scheds:
            sc.step()
    return ref.params(), lrs


# ------------------------------------------------------------------------------ DP tests


def test_param_groups_are_matrix_then_elementwise(case) -> None:
    from canzona.specs import is_matrix_param

    model = ToyModel()
    names = [n for n, _ in model.named_parameters()]
    matrix = [n for n, p in model.named_parameters() if is_matrix_param(n, p.shape)]
    for rank, r in enumerate(case("lb-asc")):
        assert r["groups"] == [("matrix", matrix), ("elementwise", [n for n in names if n not in matrix])], f"rank {rank}"


def test_normal_order_raises_no_scheduler_warning(case) -> None:
    for rank, r in enumerate(case("lb-asc")):
        assert r["order_warnings"] == [], f"rank {rank}: {r['order_warnings']}"


def test_wrong_order_is_detected(case) -> None:
    for rank, w in enumerate(case("wrong-order")):
        assert any("before `optimizer.step()`" in x for x in w), f"rank {rank}: {w}"


def test_scheduled_lb_asc_is_bitwise(case) -> None:
    want_save, want = _dp_reference(STEPS), _dp_reference(STEPS + MORE)
    # the schedule matters: a constant-lr run ends elsewhere, so equality below is not vacuous
    assert tensors_equal(want, _dp_reference(STEPS + MORE, scheduled=False)) != []
    for rank, r in enumerate(case("lb-asc")):
        assert tensors_equal(want_save, r["at_save"]) == [], f"rank {rank}: scheduled lb-asc run differs"
        assert tensors_equal(want, r["final"]) == [], f"rank {rank}: scheduled lb-asc run differs after {STEPS} steps"


def test_scheduled_lr_reaches_the_owners_optimizers(case) -> None:
    res = case("lb-asc")
    for rank, r in enumerate(res):
        # step s used the schedule's value at s, in the front groups and in the owners' optimizers
        for s, (front, mat, ew) in enumerate(r["used"]):
            expect = [MATRIX_KW["lr"] * matrix_factor(s), EW_KW["lr"] * elementwise_factor(s)]
            assert front == pytest.approx(expect, rel=1e-12), f"rank {rank} step {s}"
            assert mat in (None, front[0]) and ew in (None, front[1]), f"rank {rank} step {s}"
    # some rank owns matrix parameters and some owns element-wise ones: the pushes were exercised
    assert any(u[1] is not None for r in res for u in r["used"]) and any(u[2] is not None for r in res for u in r["used"])


def test_state_dict_carries_the_scheduled_lr(case) -> None:
    for rank, r in enumerate(case("checkpoint")):
        # the saved document holds the lr the scheduler set after the last step, and loading restores it
        assert r["hyper_lrs"] == r["lrs_at_save"] == r["lrs_after_load"], f"rank {rank}"
        assert r["lrs_at_save"] == pytest.approx([MATRIX_KW["lr"] * matrix_factor(STEPS), EW_KW["lr"] * elementwise_factor(STEPS)], rel=1e-12)


def test_file_checkpoint_carries_the_scheduled_lr(case) -> None:
    for rank, r in enumerate(case("checkpoint")):
        assert r["file_hyper_lrs"] == r["lrs_at_save"] == r["file_lrs_after_load"], f"rank {rank}"


def test_resumed_run_continues_bitwise(case) -> None:
    want = _dp_reference(STEPS + MORE)
    for rank, r in enumerate(case("checkpoint")):
        assert tensors_equal(want, r["resumed"]) == [], f"rank {rank}: resumed run differs"


def test_zero1_matrix_group_is_empty_and_schedule_is_bitwise(case) -> None:
    want = _dp_reference(STEPS, all_elementwise=True)
    n = len(list(ToyModel().parameters()))
    for rank, r in enumerate(case("zero1")):
        assert r["groups"] == [("matrix", 0), ("elementwise", n)], f"rank {rank}"
        assert tensors_equal(want, r["params"]) == [], f"rank {rank}: scheduled zero1 run differs"


def test_param_groups_cannot_be_added(case) -> None:
    for rank, msg in enumerate(case("add-group")):
        assert "fixed by its plan" in msg, f"rank {rank}: {msg}"


# ------------------------------------------------------------------------------ DP2 x TP2 tests


def test_cosine_schedule_on_dp2_tp2_is_bitwise(case) -> None:
    want, lrs = _tp_reference()
    assert len(set(lrs)) == STEPS, "the cosine schedule should change the lr every step"
    for rank, r in enumerate(case("tp")):
        assert r["order_warnings"] == [], f"rank {rank}: {r['order_warnings']}"
        assert tensors_equal(want, r["params"]) == [], f"rank {rank}: DP2 x TP2 run under CosineAnnealingLR differs"


def test_scheduled_lr_reaches_the_tp_hosts(case) -> None:
    _, lrs = _tp_reference()
    res = case("tp")
    assert sum(len(r["hosted"]) for r in res) > 0, "no rank hosts a TP task: the host path was not exercised"
    for rank, r in enumerate(res):
        for s, (front, host) in enumerate(r["seen"]):
            assert front == lrs[s], f"rank {rank} step {s}"
            if r["hosted"]:
                assert host == [lrs[s]], f"rank {rank} step {s}: the TP host optimizer ran with lr {host}, the schedule says {lrs[s]}"
