"""Bad input gives one clear error on every rank and never a hang.

All cases run in one spawned world of two ranks (bounded by the launcher's timeout); each case
records, per rank, the exception type and message, and the parent checks every rank raised the
expected error. Later cases run after earlier failures, which also shows a failed construction
leaves the process group usable (no rank is stuck in a collective).
"""

from __future__ import annotations

import pytest
import torch

from canzona.runtime.launch import run_workers
from validation.harness import ToyModel, inject_grads, integer_grads

pytestmark = pytest.mark.slow


class GlobalStateSGD(torch.optim.Optimizer):
    """Keeps one state entry for all parameters (like LBFGS): not per-parameter."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        st = self.state["global"]
        st["calls"] = st.get("calls", 0) + 1
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


def _catch(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc)
    return None


def errors_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from canzona import DistributedOptimizer

    out: dict[str, tuple[str, str] | None] = {}
    D = DistributedOptimizer
    out["mesh_size"] = _catch(lambda: D(ToyModel(), "muon", mesh=DeviceMesh("cpu", [rank], mesh_dim_names=("dp",), _init_backend=False)))
    out["mesh_names"] = _catch(
        lambda: D(ToyModel(), "muon", mesh=DeviceMesh("cpu", [0, 1], mesh_dim_names=("data",), _init_backend=False))
    )
    out["lbfgs"] = _catch(lambda: D(ToyModel(), torch.optim.LBFGS))
    out["instance"] = _catch(lambda: D(ToyModel(), torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)))
    out["not_optimizer"] = _catch(lambda: D(ToyModel(), torch.nn.Linear))
    out["global_state"] = _catch(lambda: D(ToyModel(), GlobalStateSGD))
    out["zero1_matrix"] = _catch(lambda: D(ToyModel(), "muon", strategy="zero1"))
    out["strategy"] = _catch(lambda: D(ToyModel(), "muon", strategy="fsdp"))
    out["name"] = _catch(lambda: D(ToyModel(), "lion"))
    # an element-wise optimizer whose update of a piece differs from the whole tensor's (fused CPU kernels)
    out["fused"] = _catch(lambda: D(ToyModel(), "muon", elementwise_kwargs={"fused": True}))
    out["fused_zero1"] = _catch(lambda: D(ToyModel(), "adamw", strategy="zero1", optimizer_kwargs={"fused": True}))
    # ... refused on one rank only (another CPU): the other rank learns it at once
    out["fused_one_rank"] = _catch(lambda: D(ToyModel(), "muon", elementwise_kwargs={"fused": True} if rank == 1 else None))
    # different plans on different ranks: caught by the fingerprint exchange on every rank
    out["fingerprint"] = _catch(lambda: D(ToyModel(), "muon", bucket_numel=40 + 10 * rank))
    # a planning failure on one rank only: that rank raises its ValueError, the other a RuntimeError
    out["one_rank_fails"] = _catch(lambda: D(ToyModel(), "muon", tp_dims={"no.such.param": 0} if rank == 1 else None))
    # an unexpected kind of error while planning on one rank: the others still learn of it at once
    from canzona.layouts.zero1 import Zero1Layout

    original = Zero1Layout._plan

    def _explode(self, *args, **kwargs):
        raise RuntimeError("planner exploded")

    if rank == 1:
        Zero1Layout._plan = _explode
    try:
        out["one_rank_crashes"] = _catch(lambda: D(ToyModel(), "muon"))
    finally:
        Zero1Layout._plan = original

    # parameters changed after the plan was made
    model = ToyModel()
    opt = D(model, "muon", bucket_numel=40)
    model.up.weight = torch.nn.Parameter(torch.zeros(10, 6))
    out["replaced"] = _catch(opt.step)
    model = ToyModel()
    opt = D(model, "muon", bucket_numel=40)
    model.extra = torch.nn.Parameter(torch.zeros(3))
    out["added"] = _catch(opt.step)

    # a second backward while the first one's collectives are in flight
    model = ToyModel()
    opt = D(model, "muon", bucket_numel=40)
    inject_grads(model, integer_grads(model, step=0, rank=rank))
    out["double_backward"] = _catch(lambda: inject_grads(model, integer_grads(model, step=1, rank=rank)))
    opt.zero_grad()
    # ... and the optimizer still works afterwards
    inject_grads(model, integer_grads(model, step=2, rank=rank))
    opt.step()
    dist.barrier()
    out["recovered"] = None
    return out


EXPECT: dict[str, tuple[str, str]] = {
    "mesh_size": ("ValueError", "the mesh has 1 ranks but the world has 2"),
    "mesh_names": ("ValueError", "must be named ('dp',)"),
    "lbfgs": ("TypeError", "LBFGS is not a per-parameter optimizer"),
    "instance": ("TypeError", "not an instance"),
    "not_optimizer": ("TypeError", "must be a torch.optim.Optimizer subclass"),
    "global_state": ("TypeError", "does not keep its state per parameter"),
    "zero1_matrix": ("ValueError", "zero1 cuts matrices"),
    "strategy": ("ValueError", "unknown strategy 'fsdp'"),
    "name": ("ValueError", "unknown optimizer 'lion'"),
    "fused": ("TypeError", "elementwise_optimizer AdamW with {'fused': True} updates a piece of a tensor differently"),
    "fused_zero1": ("TypeError", "optimizer AdamW with {'fused': True} updates a piece of a tensor differently"),
    "fingerprint": ("RuntimeError", "plan fingerprints differ across ranks"),
    "replaced": ("RuntimeError", "replaced or reshaped ['up.weight']"),
    "added": ("RuntimeError", "added ['extra']"),
    "double_backward": ("GradSyncError", "arrived after its bucket's collective was launched"),
}


def test_bad_input_raises_on_every_rank_without_hanging() -> None:
    res = run_workers(errors_worker, 2, timeout_s=120, pg_timeout_s=30)
    for case, (etype, text) in EXPECT.items():
        for rank in range(2):
            got = res[rank][case]
            assert got is not None, f"{case}: rank {rank} raised nothing"
            assert got[0] == etype and text in got[1], f"{case}: rank {rank} raised {got}"
    # one rank's planning failure: its own ValueError there, a RuntimeError naming it elsewhere
    assert res[1]["one_rank_fails"][0] == "ValueError" and "no.such.param" in res[1]["one_rank_fails"][1]
    # ... and the other rank names the failing rank and carries its message
    etype, text = res[0]["one_rank_fails"]
    assert etype == "RankFailure" and text.startswith("building the plan (no rank proceeds) failed on 1 rank(s); rank 1: ValueError:")
    assert "no.such.param" in text
    assert res[1]["one_rank_crashes"] == ("RuntimeError", "planner exploded")
    assert res[0]["one_rank_crashes"] == (
        "RankFailure", "building the plan (no rank proceeds) failed on 1 rank(s); rank 1: RuntimeError: planner exploded"
    )
    assert all("recovered" in r for r in res)
    assert res[1]["fused_one_rank"][0] == "TypeError" and "drop fused=True" in res[1]["fused_one_rank"][1]
    etype, text = res[0]["fused_one_rank"]
    assert etype == "RankFailure" and "rank 1: TypeError: elementwise_optimizer AdamW" in text and "\n" not in text, text


def test_piecewise_probe_refuses_what_updates_pieces_otherwise() -> None:
    """canzona updates the pieces of a tensor each rank holds: an element-wise optimizer must give
    every piece those elements of the whole tensor's update. torch's fused CPU Adam/AdamW (vector
    body with fused multiply-adds, scalar tail without) does not, nor SGD with Nesterov momentum
    in bfloat16; plain and foreach AdamW do, in float32 and bfloat16."""
    from canzona.distributed import check_piecewise

    cpu = torch.device("cpu")
    for kwargs, dtype in (({}, torch.float32), ({}, torch.bfloat16), ({"foreach": True}, torch.float32), ({"weight_decay": 0.1}, torch.float32)):
        check_piecewise(torch.optim.AdamW, kwargs, "elementwise_optimizer", device=cpu, dtype=dtype)
    check_piecewise(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "x", device=cpu, dtype=torch.float32)
    # a pass is remembered per (class, arguments, device, dtype): the probe runs once per process
    from canzona.distributed import _PIECEWISE_OK

    assert (torch.optim.AdamW, repr([("weight_decay", 0.1)]), "cpu", torch.float32) in _PIECEWISE_OK
    with pytest.raises(TypeError, match=r"AdamW with \{'fused': True\} updates a piece .* drop fused=True"):
        check_piecewise(torch.optim.AdamW, {"fused": True}, "elementwise_optimizer", device=cpu, dtype=torch.float32)
    with pytest.raises(TypeError, match="torch.bfloat16 on cpu.*use master_dtype=torch.float32"):
        check_piecewise(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "x", device=cpu, dtype=torch.bfloat16)


def test_requires_initialized_process_group() -> None:
    import torch.distributed as dist

    from canzona import DistributedOptimizer

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="not initialized"):
        DistributedOptimizer(ToyModel(), "muon")
