"""TP engine (Section 4): packing round trips, and bitwise equality with single-device optimizers."""

from __future__ import annotations

import types
import warnings
import zlib
from dataclasses import replace

import pytest
import torch

from canzona.config import load_model_config
from canzona.models import Qwen3, shard_megatron
from canzona.plan import MicroGroup, Plan, PlanInputs, make_plan
from canzona.runtime.launch import run_workers
from canzona.runtime.tp import (
    TPEngine,
    TPTask,
    all_to_all_reference,
    gather_recv_sizes,
    pack_gather,
    pack_scatter,
    scatter_recv_sizes,
    sync_groups,
    unpack_gather,
    unpack_scatter,
)
from canzona.specs import specs_from_config
from harness import attempt, case_results

CFG = load_model_config("qwen3-tiny")
STEPS = 3


# =========================================================================== packing (pure)


def _tasks(tp: int) -> list[TPTask]:
    # Uneven hosts: rank 0 hosts two, rank tp-1 one, the ranks between none (idle hosts).
    return [
        TPTask("a", 0, (3, 5), 0),
        TPTask("b", tp - 1, (4, 2), 1),
        TPTask("c", 0, (1, 7), 1),
    ]


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_gather_then_scatter_round_trip_is_bitwise(tp: int) -> None:
    tasks = _tasks(tp)
    gen = torch.Generator().manual_seed(tp)
    shards = [{t.name: torch.randn(t.local_shape, generator=gen) for t in tasks} for _ in range(tp)]
    packed = [pack_gather(tasks, shards[r], tp) for r in range(tp)]
    recv = all_to_all_reference([p[0] for p in packed], [p[1] for p in packed])
    full: dict[str, torch.Tensor] = {}
    for r in range(tp):
        assert recv[r].numel() == sum(gather_recv_sizes(tasks, r, tp))
        got = unpack_gather(recv[r], tasks, r, tp)
        assert set(got) == {t.name for t in tasks if t.host == r}  # idle hosts receive nothing
        full.update(got)
    for t in tasks:
        assert torch.equal(full[t.name], torch.cat([shards[r][t.name] for r in range(tp)], dim=t.tp_dim))
    # Reverse: hosts send each rank its slice of the full tensors; every rank gets back its input.
    packed = [pack_scatter(tasks, {n: v for n, v in full.items() if any(t.name == n and t.host == r for t in tasks)}, r, tp) for r in range(tp)]
    back = all_to_all_reference([p[0] for p in packed], [p[1] for p in packed])
    for r in range(tp):
        assert back[r].numel() == sum(scatter_recv_sizes(tasks, r, tp))
        mine = unpack_scatter(back[r], tasks, r, tp)
        for t in tasks:
            assert torch.equal(mine[t.name], shards[r][t.name]), (r, t.name)


def test_packing_rejects_wrong_shapes() -> None:
    tasks = _tasks(2)
    shards = {"a": torch.zeros(3, 5), "b": torch.zeros(2, 4), "c": torch.zeros(1, 7)}
    with pytest.raises(ValueError, match="b: shard has shape"):
        pack_gather(tasks, shards, 2)
    with pytest.raises(ValueError, match="receive buffer"):
        unpack_gather(torch.zeros(5), tasks, 0, 2)


def test_sync_groups_respect_cmax() -> None:
    tasks = [TPTask(n, -1, (4, 4), 0) for n in "abcd"]  # 16 local elements, 128 bytes full (tp 2, fp32)
    assert [[t.name for t in g] for g in sync_groups(tasks, 2, 256, 4)] == [["a", "b"], ["c", "d"]]
    assert [[t.name for t in g] for g in sync_groups(tasks, 2, 100, 4)] == [["a"], ["b"], ["c"], ["d"]]


# =========================================================================== plans


def _plan(dp: int, tp: int, strategy: str, schedule: str, optimizer: str = "muon", cmax: int = 512 * 2**20) -> Plan:
    specs = specs_from_config(CFG, tp=tp, layout="hf")
    inputs = PlanInputs(
        model=CFG.name, layout="hf", dp=dp, tp=tp, optimizer=optimizer, strategy=strategy,
        tp_schedule=schedule, bucket_numel=20_000, cmax_bytes=cmax,
    )
    return make_plan(specs, inputs)


def _rehost(plan: Plan, dp_rank: int, groups: list[list[tuple[str, int]]]) -> Plan:
    """The same plan with dp rank ``dp_rank``'s micro-groups replaced by hand (hosts and grouping)."""
    tp = plan.inputs.tp
    where = {n: (k, h) for k, g in enumerate(groups) for n, h in g}
    params = tuple(
        replace(p, tp_host=where[p.name][1], micro_group=where[p.name][0]) if p.name in where else p for p in plan.params
    )
    mgs = list(plan.micro_groups)
    mgs[dp_rank] = tuple(
        MicroGroup(
            index=k,
            params=tuple(n for n, _ in g),
            hosts=tuple(h for _, h in g),
            loads=tuple(float(sum(1 for _, h in g if h == r)) for r in range(tp)),
        )
        for k, g in enumerate(groups)
    )
    return replace(plan, params=params, micro_groups=tuple(mgs))


# =========================================================================== distributed worker


def _factory(name: str):
    from canzona.optim import SOAP, Muon, Shampoo

    if name == "muon":
        return lambda ps: Muon(ps, lr=0.02, weight_decay=0.01)
    if name == "shampoo":
        return lambda ps: Shampoo(ps, lr=0.01, momentum=0.9)
    if name == "soap":
        return lambda ps: SOAP(ps, lr=0.01, precondition_frequency=2)
    raise AssertionError(name)


def _grad(name: str, shape: tuple[int, ...], step: int, dp_rank: int) -> torch.Tensor:
    # Integers in [-8, 8) scaled by 2^-4: any sum of a few of them is exact in fp32, so the DP
    # reduction gives the same full gradient in every order (and equals the reference's sum).
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}/{dp_rank}".encode()))
    return torch.randint(-8, 8, shape, generator=gen).to(torch.float32) * 2.0**-4


def _run_case(plan: Plan, optimizer: str, dp_rank: int, tp_group) -> dict:
    from canzona.runtime.comm import Comm, CommStats
    from canzona.runtime.phases import timing

    tp = plan.inputs.tp
    comm = Comm(tp_group, CommStats())
    tp_rank = comm.rank
    full = {n: p.detach().clone() for n, p in Qwen3(CFG, seed=5).named_parameters()}
    mine = [
        p for p in plan.params
        if p.spec.kind == "matrix" and p.spec.tp_split and (plan.inputs.strategy == "sc" or p.dp_owner == dp_rank)
    ]
    local = {p.name: full[p.name].chunk(tp, dim=p.spec.tp_dim)[tp_rank].clone() for p in mine}
    engine = TPEngine(plan, dp_rank=dp_rank, comm=comm, optimizer_factory=_factory(optimizer), local_masters=local)
    comm.stats.reset()
    # Single-device reference: one optimizer over the full tensors, the same full gradients.
    ref = {p.name: torch.nn.Parameter(full[p.name].clone()) for p in mine}
    ref_opt = _factory(optimizer)(list(ref.values())) if ref else None
    dp = plan.inputs.dp
    with timing():
        for step in range(STEPS):
            local_grads = {}
            for p in mine:
                if plan.inputs.strategy == "sc":
                    # every DP rank computes everything: its gradient is already the reduced one
                    g_full = sum(_grad(p.name, p.spec.shape, step, d) for d in range(dp))
                    local_grads[p.name] = g_full.chunk(tp, dim=p.spec.tp_dim)[tp_rank].clone()
                    continue
                shard = torch.zeros(p.spec.local_shape)
                for d in range(dp):
                    shard += _grad(p.name, p.spec.shape, step, d).chunk(tp, dim=p.spec.tp_dim)[tp_rank]
                local_grads[p.name] = shard
            engine.step(local_grads)
            if ref_opt is not None:
                for p in mine:
                    ref[p.name].grad = sum(_grad(p.name, p.spec.shape, step, d) for d in range(dp))
                ref_opt.step()
    mismatched = [
        p.name for p in mine if not torch.equal(local[p.name], ref[p.name].detach().chunk(tp, dim=p.spec.tp_dim)[tp_rank])
    ]
    state_mismatch = []
    for name, st in engine.state_dict().items():
        rst = ref_opt.state[ref[name]]
        if set(st) != set(rst) or any(
            (torch.equal(v, rst[k]) if isinstance(v, torch.Tensor) else v == rst[k]) is False for k, v in st.items()
        ):
            state_mismatch.append(name)
    stats = comm.stats.as_dict()
    return {
        "dp_rank": dp_rank,
        "tp_rank": tp_rank,
        "owned": sorted(p.name for p in mine),
        "hosted": sorted(engine.state_dict()),
        "mismatched": mismatched,
        "state_mismatch": state_mismatch,
        "changed": all(not torch.equal(local[p.name], full[p.name].chunk(tp, dim=p.spec.tp_dim)[tp_rank]) for p in mine),
        "state_bytes": engine.state_bytes(),
        "peak": engine.peak_exchange_bytes,
        "n_groups": len(engine.groups),
        "stats": {k: dict(v) for k, v in stats.items()},
    }


def _engine_worker(rank: int, world: int, cases: list[tuple[str, Plan, str]]) -> dict[str, dict[str, dict]]:
    """Every case in one spawned run; each case's outcome is recorded on its own, by label."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh2d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp")) if world > 2 else None
    for label, plan, optimizer in cases:
        if plan.inputs.dp == 1:
            res = _attempt_case(plan, optimizer, 0, None)  # TP over the whole world
        else:
            assert mesh2d is not None
            res = _attempt_case(plan, optimizer, mesh2d.get_local_rank("dp"), mesh2d["tp"].get_group())
        out[label] = res
        dist.barrier()
    return {"cases": out}


def _attempt_case(plan: Plan, optimizer: str, dp_rank: int, tp_group) -> dict:
    return attempt(_run_case, plan, optimizer, dp_rank, tp_group)


def _check(per_rank: list[dict], label: str, plan: Plan) -> None:
    """One case's results on every rank: bitwise against single-device, state where the plan puts it."""
    grouped = plan.inputs.tp_schedule != "sync"
    for r in per_rank:
        assert r["owned"], f"{label}: rank owns nothing (the comparison would be vacuous)"
        assert not r["mismatched"], f"{label}: rank {r['dp_rank']}/{r['tp_rank']} differs from single-device on {r['mismatched']}"
        assert not r["state_mismatch"], f"{label}: optimizer state differs on {r['state_mismatch']}"
        assert r["changed"], f"{label}: the step left some master unchanged"
        # Optimizer math never communicates.
        assert r["stats"].get("canzona/tp/compute", {"sent": 0})["sent"] == 0
        assert ("canzona/tp/scatter" in r["stats"]) == grouped
    by_dp: dict[int, list[dict]] = {}
    for r in per_rank:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    for ranks in by_dp.values():
        hosted = [n for r in ranks for n in r["hosted"]]
        if grouped:
            # Each TP-split parameter's state lives on exactly one TP rank: its planned host.
            assert sorted(hosted) == ranks[0]["owned"], label
            for r in ranks:
                assert all(plan.param(n).tp_host == r["tp_rank"] for n in r["hosted"]), label
                assert (r["state_bytes"] > 0) == bool(r["hosted"]), label
        else:
            # sync (SC baseline): every TP rank holds the full state of everything it updates.
            for r in ranks:
                assert r["hosted"] == r["owned"], label


def _cases_tp2() -> list[tuple[str, Plan, str]]:
    cases = []
    for opt in ("muon", "shampoo", "soap"):
        cases.append((f"{opt}/sc/sync", _plan(1, 2, "sc", "sync", opt), opt))
        cases.append((f"{opt}/asc/round-robin", _plan(1, 2, "asc", "round-robin", opt), opt))
        cases.append((f"{opt}/lb-asc/lpt", _plan(1, 2, "lb-asc", "lpt", opt), opt))
        cases.append((f"{opt}/lb-asc/no-fuse", _plan(1, 2, "lb-asc", "no-fuse", opt), opt))
    return cases


def _uneven_plans() -> dict[str, Plan]:
    base = _plan(1, 2, "lb-asc", "lpt", "muon")
    tasks = [n for g in base.micro_groups[0] for n in g.params]
    # C_max below the largest task: the planner gives it its own group (and warns: see below).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        small = _plan(1, 2, "lb-asc", "lpt", "shampoo", cmax=_largest_task_bytes(base) - 4)
    # dp1 x tp4 with hand-placed hosts (rank 1 idle) runs with the whole world as its TP group.
    base4 = _plan(1, 4, "lb-asc", "lpt", "muon")
    t4 = [n for g in base4.micro_groups[0] for n in g.params]
    return {
        # every task on host 0 (rank 1 idle) in one group, then a group holding a single task on host 1
        "uneven": _rehost(base, 0, [[(n, 0) for n in tasks[:-1]], [(tasks[-1], 1)]]),
        "small": small,
        "bounded": _plan(1, 2, "lb-asc", "lpt", "muon", cmax=50_000),  # the largest task is 45,056 bytes
        "idle4": _rehost(base4, 0, [[(n, 0 if i % 2 else 2) for i, n in enumerate(t4[:6])], [(n, 3) for n in t4[6:]]]),
    }


def _largest_task_bytes(plan: Plan) -> int:
    return max(p.spec.numel for p in plan.params if p.spec.kind == "matrix") * 4


def _engine_cases() -> dict[int, list[tuple[str, Plan, str]]]:
    """Cases by world size (2: TP over the whole world; 4: dp2 x tp2 on a ("dp", "tp") mesh, and
    one dp1 x tp4 plan); labels are unique across worlds."""
    tp2 = _cases_tp2()
    hand = _uneven_plans()
    tp2 += [("muon/tp2/uneven", hand["uneven"], "muon"), ("shampoo/tp2/small-cmax", hand["small"], "shampoo"),
            ("muon/tp2/bounded", hand["bounded"], "muon")]
    world4 = [
        ("muon/dp2/lb-asc/lpt", _plan(2, 2, "lb-asc", "lpt", "muon"), "muon"),
        ("soap/dp2/asc/round-robin", _plan(2, 2, "asc", "round-robin", "soap"), "soap"),
        ("shampoo/dp2/sc/sync", _plan(2, 2, "sc", "sync", "shampoo"), "shampoo"),
        ("muon/dp2/layerwise/sync", _plan(2, 2, "layerwise", "sync", "muon"), "muon"),
        ("shampoo/dp2/lb-asc/no-fuse", _plan(2, 2, "lb-asc", "no-fuse", "shampoo"), "shampoo"),
        ("soap/tp4/idle-hosts", hand["idle4"], "soap"),
    ]
    return {2: tp2, 4: world4}


#: (world, label) of every engine case (tiny plans: building them at collection takes milliseconds)
ENGINE_LABELS = [(world, label) for world, cases in _engine_cases().items() for label, _, _ in cases]


@pytest.fixture(scope="module")
def engine():
    """``engine(world, label) -> (per-rank results, plan)``: one spawned run per world size for all
    of its cases (started on first use); a case that raised fails only the tests that read it."""
    cases = _engine_cases()
    runs: dict[int, list[dict]] = {}

    def get(world: int, label: str) -> tuple[list[dict], Plan]:
        if world not in runs:
            runs[world] = run_workers(_engine_worker, world, cases[world], timeout_s=170)
        plan = next(p for lab, p, _ in cases[world] if lab == label)
        return case_results(runs[world], "cases", label), plan

    return get


@pytest.mark.slow
@pytest.mark.parametrize("world,label", ENGINE_LABELS, ids=[f"world{w}-{lab}" for w, lab in ENGINE_LABELS])
def test_engine_matches_single_device(engine, world: int, label: str) -> None:
    per_rank, plan = engine(world, label)
    _check(per_rank, label, plan)
    if plan.inputs.tp_schedule == "no-fuse" and world == 2:
        assert per_rank[0]["n_groups"] == len(per_rank[0]["owned"]) == 14  # one task per group


@pytest.mark.slow
def test_idle_hosts_hold_no_state(engine) -> None:
    per_rank, _ = engine(4, "soap/tp4/idle-hosts")
    assert [bool(r["hosted"]) for r in per_rank] == [True, False, True, True]


@pytest.mark.slow
def test_uneven_hosts_run_two_groups(engine) -> None:
    per_rank, plan = engine(2, "muon/tp2/uneven")
    last = plan.micro_groups[0][-1].params[0]
    assert per_rank[1]["hosted"] == [last] and per_rank[1]["state_bytes"] > 0
    assert per_rank[0]["n_groups"] == 2


def test_cmax_below_the_largest_task_warns() -> None:
    base = _plan(1, 2, "lb-asc", "lpt", "muon")
    with pytest.warns(UserWarning, match="C_max"):
        _plan(1, 2, "lb-asc", "lpt", "shampoo", cmax=_largest_task_bytes(base) - 4)


@pytest.mark.slow
def test_peak_exchange_is_bounded_by_cmax(engine) -> None:
    """Peak exchange buffer: bounded by C_max, except for a group that holds one oversize task."""
    small_ranks, small = engine(2, "shampoo/tp2/small-cmax")
    bounded_ranks, _ = engine(2, "muon/tp2/bounded")
    largest = _largest_task_bytes(_plan(1, 2, "lb-asc", "lpt", "muon"))
    cmax = small.inputs.cmax_bytes
    assert any(len(g.params) == 1 and small.param(g.params[0]).spec.numel * 4 > cmax for g in small.micro_groups[0])
    assert cmax < max(r["peak"] for r in small_ranks) <= largest  # hosts of oversize tasks exceed C_max
    for r in bounded_ranks:
        assert 0 < r["peak"] <= 50_000 and r["n_groups"] > 1


# =========================================================================== bad input (no processes)


def _fake_comm(rank: int = 0, size: int = 2):
    return types.SimpleNamespace(rank=rank, size=size, stats=None)


def _local_masters(plan: Plan, dp_rank: int = 0) -> dict[str, torch.Tensor]:
    return {
        p.name: torch.zeros(p.spec.local_shape)
        for p in plan.params
        if p.spec.kind == "matrix" and p.spec.tp_split and p.dp_owner == dp_rank
    }


def test_engine_rejects_bad_input_before_any_collective() -> None:
    plan = _plan(1, 2, "lb-asc", "lpt")
    masters = _local_masters(plan)
    factory = _factory("muon")
    with pytest.raises(ValueError, match="tp=2 but the TP group has 4"):
        TPEngine(plan, dp_rank=0, comm=_fake_comm(size=4), optimizer_factory=factory, local_masters=masters)
    with pytest.raises(ValueError, match="dp_rank"):
        TPEngine(plan, dp_rank=1, comm=_fake_comm(), optimizer_factory=factory, local_masters=masters)
    bad = dict(masters)
    name = next(iter(bad))
    bad[name] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="expected"):
        TPEngine(plan, dp_rank=0, comm=_fake_comm(), optimizer_factory=factory, local_masters=bad)
    missing = dict(masters)
    missing.pop(name)
    with pytest.raises(ValueError, match="disagree with the plan"):
        TPEngine(plan, dp_rank=0, comm=_fake_comm(), optimizer_factory=factory, local_masters=missing)
    with pytest.raises(ValueError, match="TP-split matrix"):
        TPEngine(plan, dp_rank=0, comm=_fake_comm(), optimizer_factory=factory,
                 local_masters={**masters, "model.norm.weight": torch.zeros(64)})
    with pytest.raises(TypeError, match="one dtype"):
        TPEngine(plan, dp_rank=0, comm=_fake_comm(), optimizer_factory=factory,
                 local_masters={**masters, name: masters[name].double()})


def test_megatron_tp_dims_feed_the_planner() -> None:
    # Plain-tensor (Megatron-style) shards with declared split dims give the same specs, hence the
    # same plan, as DTensor placements: the engine cannot tell the two apart.
    from canzona.specs import specs_from_module

    model = Qwen3(CFG, seed=0)
    tp_dims = shard_megatron(model, 0, 2, forward=False)
    specs = specs_from_module(model, tp_dims=tp_dims, tp=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = make_plan(specs, _plan(1, 2, "lb-asc", "lpt").inputs)
    assert a.fingerprint == _plan(1, 2, "lb-asc", "lpt").fingerprint
