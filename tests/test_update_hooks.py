"""Per-update hooks on the runtimes (ZeRO-1 DP, TP engine, FSDP2), world 2 on gloo.

Every case checks, from its own result: the hook is called exactly once per parameter per step,
on exactly the ranks the plan says compute that parameter's full value (none for parameters cut
into element ranges); ``handle.remove()`` stops the calls; and :class:`UpdateNormLog`'s gathered
norms equal the norms of the single-device optimizer's updates bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

# one spawned world-2 group for every case (~20 s on 2 cores); the fast suite covers the hooks in
# one rank (tests/test_runtime_core.py)
pytestmark = pytest.mark.slow

from canzona.runtime.hooks import UpdateNormLog
from canzona.runtime.launch import run_workers
from harness import attempt, case_results
from validation.harness import ReferenceRunner, inject_grads, integer_grads, mean_grads, pack, tp_cut, unpack

STEPS = 2
#: case -> (dp, tp, strategy); "fsdp": FSDP2 on a 2-rank dp_shard mesh
CASES: dict[str, tuple[int, int, str]] = {
    "dp-lb-asc": (2, 1, "lb-asc"),
    "dp-zero1": (2, 1, "zero1"),  # element-wise everything, some parameters cut: those are not reported
    "tp-lb-asc": (1, 2, "lb-asc"),
    "fsdp": (2, 1, "lb-asc"),
}


class _Calls:
    """Records (name, number of this name's calls so far) and checks what a hook is handed."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        assert param in optimizer.state, f"{name}: the optimizer handed to the hook does not hold its state"
        self.calls.append(name)


def _ref_rows(runner: ReferenceRunner, grads_per_step: list[dict[str, torch.Tensor]], names: set[str]) -> dict[str, list[tuple[int, float, float]]]:
    """(step, ||update||, ||param||) of the single-device masters, for ``names``."""
    rows: dict[str, list[tuple[int, float, float]]] = {n: [] for n in sorted(names)}
    for k, grads in enumerate(grads_per_step, start=1):
        before = runner.master_values()
        runner.step(grads)
        after = runner.master_values()
        for n in rows:
            rows[n].append((k, float(torch.linalg.vector_norm(after[n] - before[n])), float(torch.linalg.vector_norm(after[n]))))
    return rows


def _zero1_case(rank: int, world: int, case: str) -> dict[str, Any]:
    import torch.distributed as dist

    from torch.distributed.device_mesh import init_device_mesh

    from canzona.distributed import DistributedOptimizer
    from validation.checks import ELEMENTWISE_KWARGS, OPTIMIZER_KWARGS
    from validation.models import build_model

    dp, tp, strategy = CASES[case]
    dp_rank, tp_rank = divmod(rank, tp)
    model, full, tp_dims, bucket_numel = build_model("awkward", torch.float32, tp_rank=tp_rank, tp=tp)
    from canzona.optim import Muon

    # zero1 cuts matrices too, so it runs AdamW on everything
    cls, kw = (torch.optim.AdamW, ELEMENTWISE_KWARGS) if strategy == "zero1" else (Muon, OPTIMIZER_KWARGS["muon"])
    mesh = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",)) if tp == 1 else init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    opt = DistributedOptimizer(
        model, cls, strategy=strategy, mesh=mesh, optimizer_kwargs=kw,
        elementwise_kwargs=ELEMENTWISE_KWARGS, tp_dims=tp_dims or None, bucket_numel=bucket_numel,
        roles=getattr(model, "canzona_roles", None),
    )
    calls, log = _Calls(), UpdateNormLog()
    handles = [opt.register_update_hook(calls), opt.register_update_hook(log)]
    shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}

    def grads(step: int, d: int) -> dict[str, torch.Tensor]:
        return integer_grads(shapes, step=step, rank=d, exponent=-6)

    for step in range(1, STEPS + 1):
        inject_grads(model, tp_cut(grads(step, dp_rank), tp_dims, tp_rank, tp))
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    seen = list(calls.calls)
    inject_grads(model, tp_cut(grads(STEPS + 1, dp_rank), tp_dims, tp_rank, tp))
    opt.step()  # after remove(): no call
    opt.zero_grad()
    after_remove = len(calls.calls) - len(seen)
    # who computes each parameter's full value, read from the plan
    expected = []
    cut = []
    for pp in opt.plan.params:
        whole = {r for r, s, e in pp.dp_ranges if s == 0 and e == pp.numel}
        owners = set(range(dp)) if pp.replicated else ({pp.dp_owner} if pp.dp_owner is not None else whole)
        if pp.spec.tp_split and pp.tp_host is None:
            owners = set()  # a TP-split element-wise parameter: each TP rank updates its own shard
        if not owners:
            cut.append(pp.name)
        if dp_rank in owners and (pp.tp_host is None or pp.tp_host == tp_rank):
            expected.append(pp.name)
    gathered = log.gather()
    out: dict[str, Any] = {"seen": seen, "expected": expected, "cut": cut, "after_remove": after_remove, "gathered": gathered}
    if rank == 0:
        runner = ReferenceRunner(full, cls, kw, torch.optim.AdamW, ELEMENTWISE_KWARGS,
                                 all_elementwise=opt.plan.strategy.elementwise_only)
        out["reference"] = _ref_rows(runner, [mean_grads([grads(s, d) for d in range(dp)]) for s in range(1, STEPS + 1)], set(gathered))
    opt.runtime.detach()
    dist.barrier()
    return out


def _fsdp_case(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.optim import Muon
    from validation.fsdp_harness import FSDP_TOY_SHAPES, FSDPToy, build_fsdp_toy, fsdp_local_grads

    kw, ew = {"lr": 0.02}, {"lr": 0.01, "weight_decay": 0.1}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = build_fsdp_toy(mesh)
    opt = canzona.DistributedOptimizer(model, Muon, strategy="lb-asc", mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=ew)
    calls, log = _Calls(), UpdateNormLog()
    handles = [opt.register_update_hook(calls), opt.register_update_hook(log)]
    for s in range(STEPS):
        model(fsdp_local_grads(mesh, s)).backward()
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    seen = list(calls.calls)
    model(fsdp_local_grads(mesh, STEPS)).backward()
    opt.step()
    opt.zero_grad()
    after_remove = len(calls.calls) - len(seen)
    me = opt.group_rank
    expected, cut = [], []
    for p in opt.plan.params:
        if p.spec.kind == "matrix":
            if p.tp_host == me:
                expected.append(p.name)
            continue
        blocks = opt.runtime.layouts[p.name].blocks
        holders = [r for r, b in enumerate(blocks) if tuple(b.shape) == tuple(p.spec.shape)]
        if not holders:
            cut.append(p.name)
        if me in holders:
            expected.append(p.name)
    gathered = log.gather()
    out: dict[str, Any] = {"seen": seen, "expected": expected, "cut": cut, "after_remove": after_remove, "gathered": gathered}
    if rank == 0:
        shapes = {n: s for n, (s, _) in FSDP_TOY_SHAPES.items()}
        runner = ReferenceRunner(FSDPToy(), Muon, kw, torch.optim.AdamW, ew)
        steps = [mean_grads([integer_grads(shapes, step=s, rank=r) for r in range(2)]) for s in range(STEPS)]
        out["reference"] = _ref_rows(runner, steps, set(gathered))
    dist.barrier()
    return out


def worker(rank: int, world: int) -> bytes:
    cases = {c: attempt(_fsdp_case if c == "fsdp" else _zero1_case, rank, world, *(() if c == "fsdp" else (c,))) for c in CASES}
    return pack({"cases": cases})


@pytest.fixture(scope="module")
def runs() -> Any:
    cache: list[list[Any]] = []

    def get(case: str) -> list[Any]:
        if not cache:
            cache.append([unpack(r) for r in run_workers(worker, 2, timeout_s=300)])
        return case_results(cache[0], "cases", case)

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_hook_runs_once_per_parameter_and_step_on_the_computing_ranks(runs: Any, case: str) -> None:
    per_rank = runs(case)
    for rank, res in enumerate(per_rank):
        counts = {n: res["seen"].count(n) for n in set(res["seen"])}
        assert counts == {n: STEPS for n in res["expected"]}, f"rank {rank}"
        assert res["after_remove"] == 0, f"rank {rank}: a removed hook was called"
    # every parameter not cut into element ranges is reported by some rank
    reported = {n for res in per_rank for n in res["expected"]}
    assert reported and not reported & set(per_rank[0]["cut"])
    if case == "dp-zero1":
        assert per_rank[0]["cut"], "zero1 should cut some parameter over the DP ranks"
    if case.startswith("tp"):
        # TP-split matrices: exactly one rank (the host) reports each
        hosts = [n for n in reported if sum(n in res["expected"] for res in per_rank) == 1]
        assert hosts


@pytest.mark.parametrize("case", list(CASES))
def test_update_norm_log_equals_single_device_norms(runs: Any, case: str) -> None:
    per_rank = runs(case)
    gathered = per_rank[0]["gathered"]
    assert all(res["gathered"] == gathered for res in per_rank), "gather() must give every rank the same table"
    assert set(gathered) == {n for res in per_rank for n in res["expected"]}
    assert gathered == per_rank[0]["reference"]
    assert all(len(rows) == STEPS and all(u > 0 and p > 0 for _, u, p in rows) for rows in gathered.values())
