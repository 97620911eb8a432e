"""``no_weight_decay``: element-wise parameters stepped without weight decay, bitwise against the
single-device optimizers with the same two param groups (as ``transformers.Trainer`` groups
AdamW), on the ZeRO-1 path (lb-asc, dp 2) and under FSDP2 (dp_shard 2), with a scheduled weight
decay change that must leave the exempt group at 0; names that are not element-wise parameters
are refused in one line. One spawn (world 2, gloo)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from canzona.runtime.launch import run_workers

pytestmark = pytest.mark.slow

MKW = {"lr": 0.02, "weight_decay": 0.1}
EKW = {"lr": 1e-2, "weight_decay": 0.2}
EXEMPT = ["l1.bias", "norm.weight", "norm.bias", "l2.bias"]
MATRICES = ("l1.weight", "l2.weight")


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 8)
        self.l1 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.l2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.norm(torch.tanh(self.l1(self.emb(x))))).square().mean()


def _run(rank: int, world: int, fsdp: bool) -> list[str]:
    """Three steps (the weight decay halved by the user before the second) against the reference;
    the names of the parameters that differ."""
    import canzona
    from canzona.optim import Muon

    model, ref = Toy(), Toy()
    mesh = None
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        fully_shard(model.l1, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = canzona.DistributedOptimizer(model, "muon", mesh=mesh, optimizer_kwargs=MKW, elementwise_kwargs=EKW, no_weight_decay=EXEMPT)
    named = dict(ref.named_parameters())
    muon = Muon([named[n] for n in MATRICES], **MKW)
    rest = [n for n in named if n not in MATRICES]
    adamw = torch.optim.AdamW([{"params": [named[n] for n in rest if n not in EXEMPT]},
                               {"params": [named[n] for n in EXEMPT], "weight_decay": 0.0}], **EKW)
    for s in range(3):
        xs = [torch.randint(0, 32, (4,), generator=torch.Generator().manual_seed(10 * s + r)) for r in range(world)]
        model(xs[rank]).backward()
        ref.zero_grad()
        for x in xs:
            (ref(x) / world).backward()  # the mean of the ranks' gradients
        if s == 1:  # a schedule's weight decay: the exempt group stays at 0
            for g in opt.param_groups:
                g["weight_decay"] *= 0.5
            muon.param_groups[0]["weight_decay"] *= 0.5
            adamw.param_groups[0]["weight_decay"] *= 0.5
        opt.step()
        opt.zero_grad()
        muon.step()
        adamw.step()

    def full(p: torch.Tensor) -> torch.Tensor:
        return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()

    return [n for n, p in model.named_parameters() if not torch.equal(full(p), named[n].detach())]


def worker(rank: int, world: int) -> dict:
    import canzona

    out: dict = {"zero1": _run(rank, world, False), "fsdp2": _run(rank, world, True)}
    for case, names in (("unknown", ["l1.bias", "nope"]), ("matrix", ["l1.weight"])):
        try:
            canzona.DistributedOptimizer(Toy(), "muon", no_weight_decay=names)
            out[case] = "accepted"
        except ValueError as exc:
            out[case] = str(exc)
    try:
        canzona.DistributedOptimizer(Toy(), "muon", no_weight_decay="norm.weight")
        out["string"] = "accepted"
    except TypeError as exc:
        out["string"] = str(exc)
    return out


@pytest.fixture(scope="module")
def res() -> list[dict]:
    return run_workers(worker, 2, timeout_s=180)


@pytest.mark.parametrize("layout", ["zero1", "fsdp2"])
def test_exempt_parameters_step_without_weight_decay_bitwise(res, layout: str) -> None:
    for rank, r in enumerate(res):
        assert r[layout] == [], f"rank {rank}: {r[layout]} differ from AdamW with the exempt group at weight_decay 0"


def test_names_that_are_not_elementwise_parameters_are_refused(res) -> None:
    for r in res:
        assert r["unknown"].startswith("no_weight_decay names ['nope'], which are not trainable parameters"), r["unknown"]
        assert r["matrix"].startswith("no_weight_decay names ['l1.weight'], which the matrix optimizer updates"), r["matrix"]
        assert "collection of parameter names" in r["string"], r["string"]
        assert all("\n" not in r[k] for k in ("unknown", "matrix", "string"))
