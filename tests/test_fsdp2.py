"""Canzona on FSDP2 (``fully_shard``): packing, planning, and bitwise equality with single-device
optimizers on dp_shard 2, dp_shard 4, dp_shard 2 x tp 2 and dp_replicate 2 x dp_shard 2.

One spawned run per mesh (module-scoped fixtures) serves all of that mesh's cases; each case is
its own test and fails on its own. Gradients are injected through a real FSDP2 forward/backward
(``sum(p * g)`` per parameter, whose gradient is ``g`` exactly) with integer-valued ``g``, so
FSDP2's reduce-scatter (and HSDP's all-reduce) are exact and the reference is the mean.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from canzona.plan import FSDP_STRATEGIES, Plan, piece_numels, plan_shard, shard_inputs
from canzona.specs import ParamSpec
from canzona.runtime.exchange import (
    Block,
    ExchangeTask,
    PieceLayout,
    assemble_at_host,
    from_hosts_recv_sizes,
    pack_from_hosts,
    pack_to_hosts,
    to_hosts_recv_sizes,
    unpack_from_hosts,
)
from canzona.runtime.launch import run_workers
from canzona.runtime.tp import all_to_all_reference
from harness import raised
from validation.harness import pack, tensors_equal, unpack
from validation.fsdp_harness import FSDP_MESHES, FSDP_TOY_SHAPES, build_fsdp_toy, fsdp_local_grads, run_fsdp_case

STEPS = 3

SHAPES = FSDP_TOY_SHAPES


# ============================================================================ pure parts


def _layout(name: str, shape: tuple[int, ...], rows: list[tuple[int, int]], dup: int = 1) -> PieceLayout:
    blocks = []
    for off, k in rows:
        for _ in range(dup):
            blocks.append(Block((off, 0), (k, shape[1])))
    return PieceLayout(name, shape, tuple(blocks))


def test_exchange_packing_round_trip_is_bitwise_with_uneven_empty_and_duplicate_pieces() -> None:
    n = 4
    layouts = [
        _layout("a", (7, 3), [(0, 2), (2, 2), (4, 2), (6, 1)]),
        _layout("b", (1, 5), [(0, 1), (1, 0), (1, 0), (1, 0)]),
        _layout("c", (3, 2), [(0, 2), (2, 1)], dup=2),  # replicated over "tp": ranks 0/1 and 2/3 hold the same block
        PieceLayout("d", (4, 4), tuple(Block((2 * (r // 2), 2 * (r % 2)), (2, 2)) for r in range(n))),  # 2-D blocks
    ]
    assert layouts[2].sources == (True, False, True, False)
    g = torch.Generator().manual_seed(1)
    full = {lay.name: torch.randn(lay.full_shape, generator=g) for lay in layouts}
    pieces = [{lay.name: full[lay.name][lay.blocks[r].index()].clone() for lay in layouts} for r in range(n)]
    for hosts in ([0, 1, 2, 3], [3, 3, 0, 1], [-1, -1, -1, -1]):
        tasks = [ExchangeTask(lay, h) for lay, h in zip(layouts, hosts)]
        sends = [pack_to_hosts(tasks, pieces[r], r, n) for r in range(n)]
        recvs = all_to_all_reference([s for s, _ in sends], [z for _, z in sends])
        for r in range(n):
            assert recvs[r].numel() == sum(to_hosts_recv_sizes(tasks, r, n))
            got = assemble_at_host(recvs[r], tasks, r, n)
            assert sorted(got) == sorted(t.name for t in tasks if t.hosted_by(r))
            assert not tensors_equal(got, {k: full[k] for k in got})
        if hosts[0] == -1:
            continue
        # values back: host r sends each rank its block; every rank gets exactly its pieces
        updated = {k: v * 3 + 1 for k, v in full.items()}
        sends = [pack_from_hosts(tasks, {t.name: updated[t.name] for t in tasks if t.host == r}, r, n) for r in range(n)]
        recvs = all_to_all_reference([s for s, _ in sends], [z for _, z in sends])
        for r in range(n):
            assert recvs[r].numel() == sum(from_hosts_recv_sizes(tasks, r, n))
            got = unpack_from_hosts(recvs[r], tasks, r, n)
            want = {lay.name: updated[lay.name][lay.blocks[r].index()] for lay in layouts}
            assert not tensors_equal(got, want)


def test_direct_groups_keep_own_blocks_out_of_the_exchanges_and_round_trip_bitwise() -> None:
    """``direct`` (the FSDP engine's mode): a host's own blocks skip both exchanges (split 0 to
    itself) and are copied in place; with the exchanged blocks they rebuild every full tensor and
    return every rank exactly its block, the same values as the exchanged route."""
    from canzona.runtime.exchange import _assemble, _pack_blocks, _pack_pieces, describe_group

    n = 4
    layouts = [
        _layout("a", (7, 3), [(0, 2), (2, 2), (4, 2), (6, 1)]),
        _layout("b", (1, 5), [(0, 1), (1, 0), (1, 0), (1, 0)]),
        _layout("c", (3, 2), [(0, 2), (2, 1)], dup=2),
        PieceLayout("d", (4, 4), tuple(Block((2 * (r // 2), 2 * (r % 2)), (2, 2)) for r in range(n))),
    ]
    g = torch.Generator().manual_seed(2)
    full = {lay.name: torch.randn(lay.full_shape, generator=g) for lay in layouts}
    updated = {k: v * 3 + 1 for k, v in full.items()}
    pieces = [{lay.name: full[lay.name][lay.blocks[r].index()].clone() for lay in layouts} for r in range(n)]
    for hosts in ([0, 1, 2, 3], [3, 3, 0, 1], [1, 0, 1, 2]):  # c on 1: a duplicate holder, not its source
        tasks = [ExchangeTask(lay, h) for lay, h in zip(layouts, hosts)]
        groups = [describe_group(0, tasks, r, n, direct=True) for r in range(n)]
        plain = [describe_group(0, tasks, r, n) for r in range(n)]
        for r, (dg, pg) in enumerate(zip(groups, plain)):
            assert dg.gather_send[r] == dg.gather_recv[r] == dg.scatter_send[r] == dg.scatter_recv[r] == 0
            own_in = sum(c.numel for c in dg.local_in)
            own_back = sum(c.numel for c in dg.local_back)
            assert sum(pg.gather_send) - sum(dg.gather_send) == own_in == pg.gather_send[r]
            assert sum(pg.scatter_send) - sum(dg.scatter_send) == own_back == pg.scatter_send[r]
            assert (own_back > 0) == any(t.host == r and t.layout.blocks[r].numel for t in tasks)
        sends = []
        for r, dg in enumerate(groups):
            buf = torch.empty(sum(dg.gather_send))
            _pack_pieces(buf, dg.pack, pieces[r])
            sends.append(buf)
        recvs = all_to_all_reference(sends, [list(dg.gather_send) for dg in groups])
        back = []
        for r, dg in enumerate(groups):
            got = _assemble(recvs[r], dg.assemble, dict(dg.full_shapes), torch.float32)
            for c in dg.local_in:
                got[c.name][c.index] = pieces[r][c.name]
            assert sorted(got) == sorted(t.name for t in tasks if t.host == r)
            assert not tensors_equal(got, {k: full[k] for k in got})
            buf = torch.empty(sum(dg.scatter_send))
            _pack_blocks(buf, dg.pack_back, updated)
            back.append(buf)
        recvs = all_to_all_reference(back, [list(dg.scatter_send) for dg in groups])
        for r, dg in enumerate(groups):
            dest = {lay.name: torch.zeros(lay.blocks[r].shape) for lay in layouts}
            for c in dg.unpack_back:
                dest[c.name].copy_(recvs[r][c.offset : c.offset + c.numel].view(c.shape))
            for c in dg.local_back:
                dest[c.name].copy_(updated[c.name][c.index])
            want = {lay.name: updated[lay.name][lay.blocks[r].index()] for lay in layouts}
            assert not tensors_equal(dest, want)


def test_nonfinite_check_is_exact_for_nan_inf_and_overflowing_sums() -> None:
    from canzona.runtime.agree import nonfinite

    big = torch.full((4, 3), 3e38)  # finite, but its sum overflows to inf: not a non-finite gradient
    cases = [torch.ones(3, 2), big, None, torch.zeros(0, 5), torch.ones(2, 2), torch.ones(2, 2), torch.ones(5).bfloat16()]
    cases[4][1, 0] = float("nan")
    cases[5][0, 1] = float("-inf")
    cases[6][3] = float("inf")
    assert nonfinite(cases).tolist() == [False, False, False, False, True, True, True]
    both = torch.ones(4)
    both[0], both[1] = float("inf"), float("-inf")  # the sum is NaN
    assert nonfinite([both]).tolist() == [True] and nonfinite([]).tolist() == []
    # large pieces take the sum-first path (small ones share a fused max-abs): the same answers
    n = 1 << 17
    large = [torch.full((n,), 3e38), torch.ones(n), torch.ones(n), torch.ones(n, dtype=torch.float64), torch.ones(n)]
    large[1][n - 1] = float("nan")
    large[2][0], large[2][1] = float("inf"), float("-inf")
    large[3][7] = float("-inf")
    mixed = [large[0], torch.ones(3), large[1], cases[4], large[2], large[3], large[4], cases[6]]
    assert nonfinite(mixed).tolist() == [False, False, True, True, True, True, False, True]


def test_layout_refuses_gaps_and_overlaps() -> None:
    with pytest.raises(ValueError, match="do not tile"):
        PieceLayout("x", (4, 2), (Block((0, 0), (2, 2)), Block((1, 0), (2, 2))))
    with pytest.raises(ValueError, match="do not tile"):
        PieceLayout("x", (4, 2), (Block((0, 0), (2, 2)), Block((2, 0), (1, 2))))
    with pytest.raises(ValueError, match="inside"):
        PieceLayout("x", (4, 2), (Block((0, 0), (2, 2)), Block((2, 0), (3, 2))))


def test_piece_numels_follow_fsdp2_chunking() -> None:
    # TP chunks dim 0 into 4 and 3 rows, FSDP2 then chunks each: (2, 2) and (2, 1); group rank = d * tp + t
    assert piece_numels((7, 6), 0, 2, 2) == [12, 12, 12, 6]
    assert piece_numels((1, 6), None, 4, 1) == [6, 0, 0, 0]
    assert sum(piece_numels((13, 6), None, 4, 2)) == 2 * 13 * 6  # replicated over tp: two copies


def _params() -> list[ParamSpec]:
    out = []
    for name, (shape, tp_dim) in SHAPES.items():
        kind = "matrix" if len(shape) == 2 and not name.startswith("embed") else "elementwise"
        out.append(ParamSpec(name, shape, kind, tp_dim))
    return out


def test_plan_strategies_hosts_and_document_round_trip(tmp_path) -> None:
    for strategy in FSDP_STRATEGIES:
        plan = plan_shard(_params(), shard_inputs("toy", dp_shard=2, tp=2, strategy=strategy, cost="flops"))
        hosts = plan.hosts()
        assert sorted(hosts) == sorted(p.name for p in _params() if p.kind == "matrix")
        if strategy == "sc":
            assert set(hosts.values()) == {-1}
            # every rank computes every matrix; only the uneven element-wise pieces differ
            assert plan.metrics.details["flops_ratio"] < 1.01
        else:
            assert all(0 <= h < 4 for h in hosts.values())
            assert plan.metrics.details["flops_ratio"] >= plan.metrics.details["flops_bound"] - 1e-12
        if strategy == "no-fuse":
            assert len(plan.micro_groups[0]) == len(hosts)
        path = tmp_path / f"{strategy}.json"
        plan.to_json(path)
        back = Plan.from_dict(__import__("json").loads(path.read_text()))
        assert back == plan and back.fingerprint == plan.fingerprint
    doc = plan.to_dict()
    g0 = doc["micro_groups"]["0"][0]
    g0["hosts"][0] = 0 if g0["hosts"][0] != 0 else 1
    with pytest.raises(ValueError):
        Plan.from_dict(doc)
    with pytest.raises(ValueError, match="does not run on FSDP2"):
        shard_inputs("toy", dp_shard=2, strategy="zero1")


def test_lb_asc_carries_host_loads_across_one_task_groups() -> None:
    # eight equal matrices, each above C_max: one task per group. Algorithm 2 from zero loads would
    # put all eight on host 0; carried loads spread them one per host.
    params = [ParamSpec(f"layers.{i}.w", (64, 64), "matrix") for i in range(8)]
    plan = plan_shard(params, shard_inputs("toy", dp_shard=8, strategy="lb-asc", cmax_bytes=1024))
    assert len(plan.micro_groups[0]) == 8
    assert sorted(plan.hosts().values()) == list(range(8))
    assert plan.metrics.details["flops_ratio"] == pytest.approx(1.0)
    asc = plan_shard(params, shard_inputs("toy", dp_shard=8, strategy="asc", cmax_bytes=1024))
    assert sorted(asc.hosts().values()) == list(range(8))


def test_planner_at_cluster_scale_sits_at_the_atomic_bound() -> None:
    from canzona.plan.build import resolve_model
    from canzona.plan import shard_specs
    from canzona.specs import specs_from_config

    specs = specs_from_config(resolve_model("qwen3-32b"), tp=8, layout="hf")
    lb = plan_shard(shard_specs(specs), shard_inputs("qwen3-32b", dp_shard=32, tp=8, strategy="lb-asc", cost="flops"))
    asc = plan_shard(shard_specs(specs), shard_inputs("qwen3-32b", dp_shard=32, tp=8, strategy="asc", cost="flops"))
    m = lb.metrics.details
    assert m["ranks"] == 256 and len(m["flops_per_rank"]) == 256
    # at the bound: the host of the largest matrix carries nothing else but its element-wise pieces
    assert m["flops_bound"] <= m["flops_ratio"] <= m["flops_bound"] * 1.001
    assert asc.metrics.details["flops_ratio"] > 1.2 * m["flops_ratio"]


# ============================================================================ distributed (gloo)

MESHES = FSDP_MESHES

# (label, optimizer, optimizer kwargs, strategy, dtype[+mp: FSDP2 MixedPrecisionPolicy bf16 compute, fp32 reduce])
CASES: dict[str, list[tuple[str, str, dict, str, str]]] = {
    "dp_shard2": [
        ("muon/lb-asc", "muon", {"lr": 0.02}, "lb-asc", "float32"),
        ("muon/asc", "muon", {"lr": 0.02}, "asc", "float32"),
        ("muon/sc", "muon", {"lr": 0.02}, "sc", "float32"),
        ("muon/no-fuse", "muon", {"lr": 0.02}, "no-fuse", "float32"),
        ("shampoo/lb-asc", "shampoo", {"lr": 0.01}, "lb-asc", "float32"),
        ("soap/lb-asc", "soap", {"lr": 0.01}, "lb-asc", "float32"),
        ("sgd/lb-asc", "sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, "lb-asc", "float32"),
        ("muon/lb-asc/bf16", "muon", {"lr": 0.02}, "lb-asc", "bfloat16"),
    ],
    "dp_shard4": [
        ("muon/lb-asc", "muon", {"lr": 0.02}, "lb-asc", "float32"),
        ("soap/asc", "soap", {"lr": 0.01}, "asc", "float32"),
        ("shampoo/lb-asc", "shampoo", {"lr": 0.01}, "lb-asc", "float32"),
        ("sgd/sc", "sgd", {"lr": 0.1, "momentum": 0.9}, "sc", "float32"),
    ],
    "dp_shard2_tp2": [
        ("muon/lb-asc", "muon", {"lr": 0.02}, "lb-asc", "float32"),
        ("muon/sc", "muon", {"lr": 0.02}, "sc", "float32"),
        ("shampoo/asc", "shampoo", {"lr": 0.01}, "asc", "float32"),
        ("soap/lb-asc", "soap", {"lr": 0.01}, "lb-asc", "float32"),
        ("sgd/no-fuse", "sgd", {"lr": 0.1, "momentum": 0.9}, "no-fuse", "float32"),
        ("muon/lb-asc/mixed-precision", "muon", {"lr": 0.02}, "lb-asc", "float32+mp"),
    ],
    "dp_replicate2_dp_shard2": [
        ("muon/lb-asc", "muon", {"lr": 0.02}, "lb-asc", "float32"),
        ("shampoo/lb-asc", "shampoo", {"lr": 0.01}, "lb-asc", "float32"),
        ("soap/asc", "soap", {"lr": 0.01}, "asc", "float32"),
        ("sgd/lb-asc", "sgd", {"lr": 0.1, "momentum": 0.9}, "lb-asc", "float32"),
    ],
}
EW_KWARGS = {"lr": 0.01, "weight_decay": 0.1}


def _optimizer(name: str):
    if name == "sgd":
        return torch.optim.SGD
    return name


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def _run(model, opt, mesh, steps: range) -> None:
    for s in steps:
        model(fsdp_local_grads(mesh, s)).backward()
        opt.step()
        opt.zero_grad()


def _one_mesh(rank: int, mesh_key: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import canzona

    shape, names = MESHES[mesh_key]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    out: dict[str, object] = {}
    for label, opt_name, kw, strategy, dtype_name in CASES[mesh_key]:
        dtype, _, mp = dtype_name.partition("+")
        res = run_fsdp_case(mesh, _optimizer(opt_name), strategy, kw, EW_KWARGS, dtype=getattr(torch, dtype), steps=STEPS, mixed_precision=mp == "mp")
        out[label] = {"mismatches": res.mismatches, "params": res.params, "state": res.document, "hosted": res.hosted,
                      "group": (res.group_rank, res.group_size), "state_bytes": res.state_bytes, "stats": res.comm}
        dist.barrier()
    if mesh_key == "dp_shard2":
        # canzona validate's entry point, with planted defects inside the FSDP2 engine: one ulp on a
        # hosted update, one lost state update; and a clean case
        from validation.fsdp_harness import fsdp_mesh_worker

        base = {"optimizer": "muon", "strategy": "lb-asc", "optimizer_kwargs": {"lr": 0.02}}
        out["validation"] = fsdp_mesh_worker(rank, 2, "dp_shard2", [
            {"label": "clean", "optimizer": "soap", "strategy": "asc", "optimizer_kwargs": {"lr": 0.01}, "steps": 2},
            dict(base, label="ulp", fault={"kind": "ulp", "param": "layers.1.up", "step": 2, "index": 3}),
            dict(base, label="stale_state", fault={"kind": "stale_state", "param": "layers.0.o", "step": 2, "index": 3}),
        ])
    # resume: save after 2 steps, load into a fresh model and optimizer, step once; compare with
    # 3 uninterrupted steps (the first case above)
    label, opt_name, kw, strategy, dtype_name = CASES[mesh_key][0]
    model = build_fsdp_toy(mesh, torch.float32)
    opt = canzona.DistributedOptimizer(model, _optimizer(opt_name), strategy=strategy, mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=EW_KWARGS)
    _run(model, opt, mesh, range(2))
    # through a checkpoint file (rank 0 writes atomically, every rank reads with weights_only=True)
    import os
    import tempfile

    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint

    path = [os.path.join(tempfile.mkdtemp(prefix="canzona-fsdp2-"), "opt.pt") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    save_checkpoint(opt, path[0])
    fresh = build_fsdp_toy(mesh, torch.float32)  # initial values: the load must write the step-2 pieces
    opt2 = canzona.DistributedOptimizer(fresh, _optimizer(opt_name), strategy=strategy, mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=EW_KWARGS)
    load_checkpoint(opt2, path[0])
    dist.barrier()
    if rank == 0:
        os.unlink(path[0])
        os.rmdir(os.path.dirname(path[0]))
    _run(fresh, opt2, mesh, range(2, STEPS))
    out["resume"] = {"params": _full_params(fresh), "state": opt2.consolidated_state_dict(), "steps": opt2.steps}
    # refusals (same on every rank, before any collective)
    errors = {}
    for key, kwargs in {"zero1": {"strategy": "zero1"}, "zero1_option": {"bucket_numel": 10}, "no_mesh": {"mesh": None}}.items():
        m = build_fsdp_toy(mesh, torch.float32)
        args = {"mesh": mesh, **kwargs}
        try:
            canzona.DistributedOptimizer(m, "muon", **args)
            errors[key] = None
        except (ValueError, TypeError) as exc:
            errors[key] = str(exc)
    if mesh_key == "dp_shard2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        from validation.fsdp_harness import FSDPToy

        # canzona's own ZeRO-1 mesh on an FSDP2 model
        try:
            canzona.DistributedOptimizer(build_fsdp_toy(mesh), "muon", mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))
            errors["dp_mesh"] = None
        except ValueError as exc:
            errors["dp_mesh"] = str(exc)
        # FSDP2 sharding matrices on dim 1: a placement the path does not serve
        m = FSDPToy()
        fully_shard(m, mesh=mesh["dp_shard"], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None)
        try:
            canzona.DistributedOptimizer(m, "muon", mesh=mesh)
            errors["shard1"] = None
        except ValueError as exc:
            errors["shard1"] = str(exc)
    out["errors"] = errors
    if mesh_key == "dp_shard2":
        out["robust"] = _robust_cases(rank, mesh)
        out["legacy_names"] = _legacy_names_case(mesh)
    if rank != 0:  # only rank 0 holds the consolidated documents; the others report where state lives
        keep = {k: {"hosted": v["hosted"], "group": v["group"], "state_bytes": v["state_bytes"], "stats": v["stats"]}
                for k, v in out.items() if isinstance(v, dict) and "hosted" in v}
        return keep | {k: out[k] for k in ("robust", "legacy_names") if k in out}
    return out



def _legacy_names_case(mesh) -> dict:
    """The first dp_shard2 case on a mesh named as torchtitan's legacy mesh, ``('fsdp',)``: the
    role comes from the placements and the run is the dp_shard2 run, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import canzona
    from validation.fsdp_harness import FSDPToy

    label, opt_name, kw, strategy, _ = CASES["dp_shard2"][0]
    legacy = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    model = FSDPToy(torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=legacy)
    fully_shard(model, mesh=legacy)
    opt = canzona.DistributedOptimizer(model, _optimizer(opt_name), strategy=strategy, mesh=legacy, optimizer_kwargs=kw, elementwise_kwargs=EW_KWARGS)
    _run(model, opt, mesh, range(STEPS))  # the dp_shard mesh's gradients: the same ranks in the same order
    i = opt.plan.inputs
    return {"label": label, "roles": dict(opt.layout.roles), "sizes": [i.dp_shard, i.tp, i.dp_replicate], "params": _full_params(model)}


# ============================================================================ status agreement (world 2)


def _flaky(base: type, what: str) -> type:
    """``base`` raising ``ArithmeticError`` in ``step`` while its class flag ``fail`` is set (on one rank)."""

    class Flaky(base):  # type: ignore[misc, valid-type]
        fail = False

        def step(self, closure=None):
            if type(self).fail:
                raise ArithmeticError(f"flaky {what} optimizer refused this step")
            return super().step(closure)

    return Flaky


def _local_snapshot(opt) -> dict[str, object]:
    """Everything a step may change on this rank: the model's pieces, the element-wise masters and
    state, the hosted full masters and state, the step count (cloned)."""
    from canzona.runtime.shard import local_block

    rt = opt.runtime
    snap: dict[str, object] = {"steps": opt.steps}
    for n, p in rt.params.items():
        snap[f"param:{n}"] = local_block(p.detach()).clone()
    for n, m in rt.ew_masters.items():
        snap[f"ew_master:{n}"] = m.detach().clone()
        for k, v in (rt.ew_optimizer.state.get(m, {}) if rt.ew_optimizer is not None else {}).items():
            snap[f"ew_state:{n}[{k}]"] = v.clone() if torch.is_tensor(v) else v
    for n in rt.engine.hosted:
        snap[f"master:{n}"] = rt.engine.masters[n].detach().clone()
    for n, st in rt.engine.state_dict().items():
        for k, v in st.items():
            snap[f"state:{n}[{k}]"] = v
    return snap


def _changed(a: dict, b: dict) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or not (
        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k])]




ROBUST_STRATEGIES = ("lb-asc", "sc")
#: (parameter, kind) that holds a NaN on rank 1's gradient piece only
NAN_AT = {"matrix": "layers.1.up", "elementwise": "layers.0.norm"}
#: parameters whose gradient is dropped on every rank at step 0 (skipped as torch.optim skips them)
UNUSED = ("layers.0.q", "layers.0.bias")


def _robust_cases(rank: int, mesh) -> dict:
    """The ZeRO-1 path's status agreement on the FSDP2 path, each case recorded on its own."""
    import torch.distributed as dist

    import canzona
    from canzona.optim import Muon
    from canzona.runtime.shard import local_block
    from validation.harness import ReferenceRunner, integer_grads, mean_grads
    from validation.fsdp_harness import FSDPToy, compare_with_reference, fsdp_reference

    kw = {"lr": 0.02}

    def build(strategy, **extra):
        model = build_fsdp_toy(mesh, torch.float32)
        opt = canzona.DistributedOptimizer(model, "muon", strategy=strategy, mesh=mesh, optimizer_kwargs=kw,
                                           elementwise_kwargs=EW_KWARGS, **extra)
        return model, opt

    def backward(model, s):
        model(fsdp_local_grads(mesh, s)).backward()

    out: dict = {}
    for strategy in ROBUST_STRATEGIES:
        for kind, name in NAN_AT.items():
            def nonfinite():
                # step 0 clean; step 1 with a NaN in rank 1's piece of one gradient: refused on every
                # rank, nothing changed; then steps 1 and 2 clean must equal 3 uninterrupted steps
                model, opt = build(strategy)
                backward(model, 0)
                opt.step()
                opt.zero_grad()
                before = _local_snapshot(opt)
                backward(model, 1)
                if rank == 1:
                    local_block(dict(model.named_parameters())[name].grad).view(-1)[0] = float("nan")
                got = raised(opt.step)
                res = {"raised": got, "changed": _changed(before, _local_snapshot(opt)),
                       "grads_dropped": all(p.grad is None for p in model.parameters())}
                _run(model, opt, mesh, range(1, STEPS))
                params, doc = _full_params(model), opt.consolidated_state_dict()  # collectives: every rank
                if rank == 0:
                    ref = fsdp_reference(Muon, kw, EW_KWARGS, dtype=torch.float32, dp=2, steps=STEPS)
                    res["mismatches"] = compare_with_reference(params, doc, ref)
                return res

            out[f"nonfinite/{strategy}/{kind}"] = _attempt(nonfinite)

        def unused(**extra):
            # step 0 with no gradient anywhere for UNUSED: skipped (no update, no state), as torch.optim skips
            model, opt = build(strategy, **extra)
            named = dict(model.named_parameters())
            for s in range(STEPS):
                backward(model, s)
                if s == 0:
                    for n in UNUSED:
                        named[n].grad = None
                opt.step()
                opt.zero_grad()
            params, doc = _full_params(model), opt.consolidated_state_dict()  # collectives: every rank
            if rank != 0:
                return {}
            ref = ReferenceRunner(FSDPToy(torch.float32), Muon, kw, torch.optim.AdamW, EW_KWARGS)
            shapes = {n: shape for n, (shape, _) in SHAPES.items()}
            for s in range(STEPS):
                grads = mean_grads([integer_grads(shapes, step=s, rank=r) for r in range(2)])
                if s == 0:
                    for n in UNUSED:
                        grads.pop(n)
                ref.step(grads)
            return {"mismatches": compare_with_reference(params, doc, ref)}

        out[f"unused/{strategy}"] = _attempt(unused)
        # the split step with one matrix per micro-group: the whole inputs of consecutive groups
        # live in the two reserved assembly buffers, a skipped matrix's input among them
        out[f"unused/{strategy}/ns-input"] = _attempt(lambda: unused(exchange="ns-input", cmax=1e-4))
        dist.barrier()

    def hyper():
        # a learning rate set on one rank only: refused on every rank before anything changes
        model, opt = build("lb-asc")
        backward(model, 0)
        if rank == 1:
            opt.param_groups[0]["lr"] = 0.03
        before = _local_snapshot(opt)
        return {"raised": raised(opt.step), "changed": _changed(before, _local_snapshot(opt))}

    out["hyper"] = _attempt(hyper)
    dist.barrier()

    def accumulate(strategy):
        # two micro-batches per step, the first under no_sync(): FSDP2 reduces nothing inside the
        # block (no p.grad appears), the second backward reduces the accumulated sum. The
        # gradients are integers times 2**-4, so every partial sum is exact in fp32 and the order
        # of FSDP2's accumulation and reduction cannot change a bit: bitwise against the
        # single-device optimizers fed the mean over ranks of each rank's two micro-batches.
        model, opt = build(strategy)
        reduced_inside = []
        for s in range(STEPS):
            with opt.no_sync():
                backward(model, 2 * s)
                reduced_inside.append(any(p.grad is not None for p in model.parameters()))
            backward(model, 2 * s + 1)
            opt.step()
            opt.zero_grad()
        params, doc = _full_params(model), opt.consolidated_state_dict()  # collectives: every rank
        res = {"reduced_inside": reduced_inside}
        if rank == 0:
            ref = ReferenceRunner(FSDPToy(torch.float32), Muon, kw, torch.optim.AdamW, EW_KWARGS)
            shapes = {n: shape for n, (shape, _) in SHAPES.items()}
            for s in range(STEPS):
                per_rank = []
                for r in range(2):
                    a, b = integer_grads(shapes, step=2 * s, rank=r), integer_grads(shapes, step=2 * s + 1, rank=r)
                    per_rank.append({n: a[n] + b[n] for n in a})
                ref.step(mean_grads(per_rank))
            res["mismatches"] = compare_with_reference(params, doc, ref)
        return res

    for strategy in ("lb-asc", "sc"):
        out[f"no_sync/{strategy}"] = _attempt(lambda: accumulate(strategy))
        dist.barrier()

    def bad_hyper():
        # out-of-range values set on every rank after construction: refused on every rank before
        # anything changes; restored, the same gradients then give three uninterrupted steps
        model, opt = build("lb-asc", status_timeout_s=20)
        backward(model, 0)
        opt.step()
        opt.zero_grad()
        backward(model, 1)
        before = _local_snapshot(opt)
        got = {}
        for label, group, key, value in (("nan_lr", 0, "lr", float("nan")), ("neg_wd", 1, "weight_decay", -0.1),
                                         ("inf_lr", 1, "lr", float("inf"))):
            old = opt.param_groups[group][key]
            opt.param_groups[group][key] = value
            got[label] = raised(opt.step)
            opt.param_groups[group][key] = old
        got["changed"] = _changed(before, _local_snapshot(opt))
        got["timeout"] = (opt.status_timeout_s, opt.runtime.status_timeout_s)
        opt.step()
        opt.zero_grad()
        _run(model, opt, mesh, range(2, STEPS))
        params, doc = _full_params(model), opt.consolidated_state_dict()
        if rank == 0:
            ref = fsdp_reference(Muon, kw, EW_KWARGS, dtype=torch.float32, dp=2, steps=STEPS)
            got["mismatches"] = compare_with_reference(params, doc, ref)
        return got

    out["bad_hyper"] = _attempt(bad_hyper)
    dist.barrier()

    def plan_fails():
        # a planning failure on one rank only reaches every rank through the fingerprint agreement
        model = build_fsdp_toy(mesh, torch.float32)
        return {"raised": raised(lambda: canzona.DistributedOptimizer(model, "muon", mesh=mesh, plan="nonsense" if rank == 1 else None))}

    out["plan_fails"] = _attempt(plan_fails)
    dist.barrier()

    def read_error():
        # rank 1 fails while reading its gradient pieces, before the status exchange: it joins the
        # first gather (overlapped with the exchange) with zero pieces; every rank raises the same
        # RankFailure before anything changes, and the next step runs as if nothing had happened
        model, opt = build("lb-asc")
        backward(model, 0)
        rt = opt.runtime
        if rank == 1:
            def broken():
                raise OSError(f"cannot read the gradient of {rt.names[0]}")
            rt._grads = broken
        before = _local_snapshot(opt)
        got = raised(opt.step)
        rt.__dict__.pop("_grads", None)
        res = {"raised": got, "changed": _changed(before, _local_snapshot(opt)),
               "grads_dropped": all(p.grad is None for p in model.parameters())}
        _run(model, opt, mesh, range(STEPS))
        params, doc = _full_params(model), opt.consolidated_state_dict()  # collectives: every rank
        if rank == 0:
            ref = fsdp_reference(Muon, kw, EW_KWARGS, dtype=torch.float32, dp=2, steps=STEPS)
            res["mismatches"] = compare_with_reference(params, doc, ref)
        return res

    out["read_error"] = _attempt(read_error)
    dist.barrier()

    def ew_error():
        flaky = _flaky(torch.optim.AdamW, "element-wise")
        model, opt = build("lb-asc", elementwise_optimizer=flaky)
        backward(model, 0)
        flaky.fail = rank == 1
        try:
            got = raised(opt.step)
        finally:
            flaky.fail = False
        return {"raised": got}

    out["ew_error"] = _attempt(ew_error)
    dist.barrier()

    def host_error():
        flaky = _flaky(Muon, "host")
        model = build_fsdp_toy(mesh, torch.float32)
        opt = canzona.DistributedOptimizer(model, flaky, strategy="lb-asc", mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=EW_KWARGS)
        backward(model, 0)
        flaky.fail = rank == 1 and bool(opt.runtime.engine.hosted)
        try:
            got = raised(opt.step)
        finally:
            flaky.fail = False
        return {"raised": got, "hosts": bool(opt.runtime.engine.hosted)}

    out["host_error"] = _attempt(host_error)
    dist.barrier()

    def sc_error():
        # under sc (sync schedule) every rank computes every matrix: a failure on rank 1 leaves the
        # copies different, so steps and saves are refused on every rank until a load
        flaky = _flaky(Muon, "sync")
        model = build_fsdp_toy(mesh, torch.float32)
        opt = canzona.DistributedOptimizer(model, flaky, strategy="sc", mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=EW_KWARGS)
        doc = opt.consolidated_state_dict()  # before the failure (rank 0 holds it; every rank loads it)
        shared = [doc]
        dist.broadcast_object_list(shared, src=0)
        backward(model, 0)
        flaky.fail = rank == 1
        try:
            got = {"raised": raised(opt.step)}
        finally:
            flaky.fail = False
        opt.zero_grad()
        backward(model, 1)
        got["step_after"] = raised(opt.step)
        got["save_after"] = raised(opt.consolidated_state_dict)
        # the Stateful form still serves dcp.load's targets (the way back to a good checkpoint),
        # with a format code that no load accepts, so what dcp.save makes of it is unloadable
        got["stateful_format"] = int(opt.state_dict()["canzona.format"])
        opt.zero_grad()
        opt.load_state_dict(shared[0])
        backward(model, 1)
        got["step_after_load"] = raised(opt.step)
        return got

    out["sc_error"] = _attempt(sc_error)
    dist.barrier()
    return out


def _attempt(fn):
    import traceback

    try:
        return fn()
    except Exception:  # noqa: BLE001 - recorded for the parent, which fails that case only
        return {"__error__": traceback.format_exc()}


def _mesh_worker(rank: int, world: int, keys: tuple[str, ...]) -> bytes:
    """Every mesh of one world size in one spawned run (imports and process start-up are most of
    the cost); a failure in one mesh is reported under its key, so the others' tests still run."""
    import traceback

    import torch.distributed as dist

    out = {}
    for key in keys:
        try:
            out[key] = _one_mesh(rank, key)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails that mesh's tests only
            out[key] = {"__error__": traceback.format_exc()}
            break  # the ranks may be out of step now: do not start another collective
        dist.barrier()
    return pack(out)




_results: dict[int, list[dict]] = {}


def _mesh_results(key: str) -> list[dict]:
    world = math.prod(MESHES[key][0])
    if world not in _results:
        keys = tuple(k for k in MESHES if math.prod(MESHES[k][0]) == world)
        _results[world] = [unpack(b) for b in run_workers(_mesh_worker, world, keys, timeout_s=300)]
    per_rank = [r.get(key, {"__error__": "not run (an earlier mesh failed)"}) for r in _results[world]]
    for r in per_rank:
        assert "__error__" not in r, f"mesh {key} failed: {r['__error__']}"
    return per_rank


def _check_case(key: str, label: str) -> None:
    results = _mesh_results(key)
    rank0 = results[0][label]
    strategy = next(c for c in CASES[key] if c[0] == label)[3]
    assert not rank0["mismatches"], f"{key} {label}: differs from the single-device optimizer on {rank0['mismatches']}"
    assert rank0["params"] and rank0["state"]["state"], f"{key} {label}: nothing compared"
    doc = rank0["state"]
    # where the state lives: each matrix on its one host per replica (all ranks under sc)
    hosted = [n for r in results for n in r[label]["hosted"]]
    replicas = len(results) // results[0][label]["group"][1]
    matrices = sorted(n for n in doc["meta"]["params"] if doc["meta"]["params"][n]["kind"] == "matrix")
    if strategy == "sc":
        assert sorted(hosted) == sorted(matrices * len(results))
    else:
        assert sorted(hosted) == sorted(matrices * replicas)
        # the host optimizer's math never communicates; values come back by scatter
        assert all("canzona/shard/compute" not in r[label]["stats"] for r in results)
        assert any(r[label]["stats"].get("canzona/shard/scatter", {}).get("sent", 0) > 0 for r in results)
    # the shard group's exchange is named for its dimension: an FSDP2 run opens no canzona/tp/* range
    assert not [k for r in results for k in r[label]["stats"] if k.startswith("canzona/tp/")]


def _case_ids(key: str) -> list[str]:
    return [c[0] for c in CASES[key]]


@pytest.mark.slow
@pytest.mark.parametrize("label", _case_ids("dp_shard2"))
def test_dp_shard2_matches_single_device(label: str) -> None:
    _check_case("dp_shard2", label)


@pytest.mark.slow
@pytest.mark.parametrize("label", _case_ids("dp_shard4"))
def test_dp_shard4_matches_single_device(label: str) -> None:
    _check_case("dp_shard4", label)


@pytest.mark.slow
@pytest.mark.parametrize("label", _case_ids("dp_shard2_tp2"))
def test_dp_shard2_tp2_matches_single_device(label: str) -> None:
    _check_case("dp_shard2_tp2", label)


@pytest.mark.slow
@pytest.mark.parametrize("label", _case_ids("dp_replicate2_dp_shard2"))
def test_hsdp_matches_single_device(label: str) -> None:
    _check_case("dp_replicate2_dp_shard2", label)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(MESHES))
def test_state_dict_round_trip_resumes_bitwise(key: str) -> None:
    results = _mesh_results(key)
    label = CASES[key][0][0]
    cont, resumed = results[0][label], results[0]["resume"]
    assert resumed["steps"] == STEPS
    assert not tensors_equal(resumed["params"], cont["params"])
    for name, st in cont["state"]["state"].items():
        for k, v in st.items():
            got = resumed["state"]["state"][name][k]
            assert (torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v), f"{key}: resumed state {name}[{k}] differs"


@pytest.mark.slow
def test_validation_worker_names_planted_defects() -> None:
    """validation.fsdp_harness.fsdp_mesh_worker (what ``canzona validate`` calls): a clean case is
    empty, a planted one-ulp error and a lost state update are named, nothing else."""
    out = {c["label"]: c["mismatches"] for c in _mesh_results("dp_shard2")[0]["validation"]}

    def names(mismatches: list[str]) -> set[str]:
        return {m.split(":", 1)[1].split("[")[0] for m in mismatches}

    assert out["clean"] == []
    assert names(out["ulp"]) == {"layers.1.up"} and "param:layers.1.up" in out["ulp"]
    assert names(out["stale_state"]) == {"layers.0.o"}
    assert any(m.startswith("state:layers.0.o[") for m in out["stale_state"])


@pytest.mark.slow
def test_refusals_are_one_clear_error() -> None:
    errors = _mesh_results("dp_shard2")[0]["errors"]
    assert "zero1" in errors["zero1"] and "FSDP2" in errors["zero1"]
    assert "bucket_numel" in errors["zero1_option"]
    assert "mesh=" in errors["no_mesh"]
    assert "'dp'" in errors["dp_mesh"] and "mixing" in errors["dp_mesh"]
    assert "Shard(dim=1)" in errors["shard1"] and "not supported" in errors["shard1"]


@pytest.mark.slow
def test_legacy_fsdp_mesh_name_reads_the_role_from_placements() -> None:
    results = _mesh_results("dp_shard2")
    legacy = results[0]["legacy_names"]
    assert all(r["legacy_names"]["roles"] == {"fsdp": "dp_shard"} for r in results)
    assert legacy["sizes"] == [2, 1, 1]  # dp_shard, tp, dp_replicate
    # the same steps as the dp_shard2 case, which is compared with the single-device optimizer
    assert not tensors_equal(legacy["params"], results[0][legacy["label"]]["params"])


def test_mesh_dim_roles_from_placements_and_ambiguous_meshes_refused() -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from canzona.layouts.fsdp2 import mesh_dim_roles

    s0, s1, rep = Shard(0), Shard(1), Replicate()
    assert mesh_dim_roles(("fsdp",), {"fsdp": [s0, s0]}) == {"fsdp": "dp_shard"}
    assert mesh_dim_roles(("dp_replicate", "dp_shard_cp", "tp"), {"dp_replicate": [rep, rep], "dp_shard_cp": [_StridedShard(0, split_factor=2), s0], "tp": [s0, rep]}) == {
        "dp_replicate": "dp_replicate", "dp_shard_cp": "dp_shard", "tp": "tp"}
    assert mesh_dim_roles(("rep", "shard", "model"), {"rep": [rep], "shard": [s0, s0], "model": [s1, rep]}) == {"rep": "dp_replicate", "shard": "dp_shard", "model": "tp"}
    # a named dimension keeps its role (its placements are checked against it later)
    assert mesh_dim_roles(("dp_shard", "tp"), {"dp_shard": [s0], "tp": [rep]}) == {"dp_shard": "dp_shard", "tp": "tp"}
    with pytest.raises(ValueError, match=r"\['a', 'b'\] all read as 'dp_shard'.*ambiguous"):
        mesh_dim_roles(("a", "b"), {"a": [s0, s0], "b": [s0, s0]})  # TP cutting every parameter on dim 0
    with pytest.raises(ValueError, match="no role"):
        mesh_dim_roles(("fsdp",), {"fsdp": [s0, _StridedShard(1, split_factor=2)]})
    with pytest.raises(ValueError, match="no role"):
        mesh_dim_roles(("pp", "fsdp"), {"fsdp": [s0]})  # a dimension no parameter lives on
    with pytest.raises(ValueError, match="fully_shard's"):
        mesh_dim_roles(("rep",), {"rep": [rep]})
    with pytest.raises(ValueError, match="order"):
        mesh_dim_roles(("model", "fsdp"), {"model": [s1, rep], "fsdp": [s0, s0]})


def test_shard_groups_of_a_mesh() -> None:
    from canzona.layouts.fsdp2 import fsdp_group_ranks

    assert fsdp_group_ranks((4,), ("dp_shard",), [0, 1, 2, 3]) == [[0, 1, 2, 3]]
    assert fsdp_group_ranks((2, 2), ("dp_replicate", "dp_shard"), [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert fsdp_group_ranks((2, 2, 2), ("dp_replicate", "dp_shard", "tp"), list(range(8))) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_unsupported_placement_and_mixed_mesh_are_refused() -> None:
    from canzona.layouts.fsdp2 import check_fsdp2_mesh as _check_mesh, check_placements as _check_placements

    class FakeMesh:
        mesh_dim_names = ("dp", "dp_shard")

        def size(self, *_: int) -> int:
            return 2

    with pytest.raises(TypeError):
        _check_mesh(FakeMesh(), 4)
    with pytest.raises(ValueError, match="mesh="):
        _check_mesh(None, 4)
    with pytest.raises(ValueError, match="not a DTensor"):
        _check_placements("w", torch.zeros(2, 2), FakeMesh())


def test_cli_plan_fsdp_prints_ratios_and_writes_the_document(capsys, tmp_path) -> None:
    import json

    from canzona.cli import main

    path = tmp_path / "fsdp.json"
    code = main(["plan", "--model", "qwen3-32b", "--fsdp", "32", "--tp", "8", "--json", str(path)])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    assert "256 ranks" in out and "atomic bound" in out and str(path) in out
    plan = Plan.from_dict(json.loads(path.read_text()))
    assert plan.inputs.world == 256 and plan.inputs.strategy == "lb-asc" and plan.inputs.layout_kind == "fsdp2"
    assert f"{plan.metrics.details['flops_ratio']:.3f}" in out
    for argv, msg in (
        (["--fsdp", "4", "--dp", "4"], "give one of them"),
        (["--fsdp", "4", "--strategy", "zero1"], "ZeRO-1"),
        (["--dp", "4", "--strategy", "no-fuse"], "FSDP2 only"),
    ):
        code = main(["plan", "--model", "qwen3-tiny", *argv])
        out, err = capsys.readouterr()
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1


def test_simulate_fsdp_at_cluster_scale(capsys) -> None:
    from canzona.cli import main
    from canzona.plan import plan_fsdp_model
    from canzona.sim.shard import simulate_fsdp
    from canzona.sim.hardware import load_hardware

    hw = load_hardware("h800-ib400")
    pred = {s: simulate_fsdp(plan_fsdp_model("qwen3-32b", dp_shard=32, tp=8, strategy=s, cost="flops"), hw) for s in ("lb-asc", "asc", "sc")}
    assert pred["lb-asc"].ranks == 256 and len(pred["lb-asc"].per_rank_s) == 256
    assert pred["lb-asc"].optimizer_s < pred["asc"].optimizer_s < pred["sc"].optimizer_s
    assert pred["lb-asc"].rank_imbalance < pred["asc"].rank_imbalance
    code = main(["simulate", "--model", "qwen3-32b", "--fsdp", "32", "--tp", "8", "--strategies", "lb-asc,asc"])
    out, err = capsys.readouterr()
    assert code == 0 and "256 GPUs" in out and "asc" in out and "relative to lb-asc" in out
    code = main(["simulate", "--model", "qwen3-32b", "--fsdp", "32", "--strategies", "zero1"])
    out, err = capsys.readouterr()
    assert code == 2 and "FSDP2 strategy" in err


def _robust(label: str) -> list[dict]:
    per_rank = [r["robust"].get(label, {"__error__": "not run"}) for r in _mesh_results("dp_shard2")]
    for rank, r in enumerate(per_rank):
        assert "__error__" not in r, f"{label} failed on rank {rank}: {r['__error__']}"
    return per_rank


#: every wait in these cases is one status exchange or one micro-group: seconds, never a timeout
BOUND_S = 30.0


@pytest.mark.slow
@pytest.mark.parametrize("label", [f"nonfinite/{s}/{k}" for s in ROBUST_STRATEGIES for k in NAN_AT])
def test_nonfinite_gradient_on_one_rank_is_refused_everywhere_before_any_change(label: str) -> None:
    """As on the ZeRO-1 path: every rank raises the same NonFiniteGradient, no parameter, master or
    optimizer state changes on any rank (torch.equal), the gradients are dropped, and the next
    steps give exactly what three uninterrupted steps give."""
    name = NAN_AT[label.split("/")[2]]
    per_rank = _robust(label)
    for rank, r in enumerate(per_rank):
        kind, msg, seconds = r["raised"]
        assert kind == "NonFiniteGradient", (rank, r["raised"])
        assert msg.startswith(f"non-finite gradient in {name};") and "no parameter or optimizer state was changed on any rank" in msg
        assert seconds < BOUND_S
        assert r["changed"] == [], f"rank {rank}: a refused step changed {r['changed']}"
        assert r["grads_dropped"], f"rank {rank}: gradients of the refused step were kept"
    assert per_rank[0]["mismatches"] == [], per_rank[0]["mismatches"]


@pytest.mark.slow
@pytest.mark.parametrize("label", [f"unused/{s}{e}" for s in ROBUST_STRATEGIES for e in ("", "/ns-input")])
def test_parameters_without_gradient_anywhere_are_skipped_like_torch(label: str) -> None:
    per_rank = _robust(label)
    assert per_rank[0]["mismatches"] == [], per_rank[0]["mismatches"]


@pytest.mark.slow
def test_hyperparameters_that_differ_across_ranks_are_refused_before_any_change() -> None:
    for rank, r in enumerate(_robust("hyper")):
        assert r["raised"] is not None and r["raised"][0] == "HyperparameterMismatch", (rank, r["raised"])
        assert r["changed"] == [], (rank, r["changed"])


@pytest.mark.slow
def test_a_planning_failure_on_one_rank_is_raised_on_every_rank() -> None:
    """The one front end's fingerprint agreement on the FSDP2 layout: rank 1's own error there,
    a RankFailure naming rank 1 and its message on rank 0, both within seconds."""
    r0, r1 = (r["raised"] for r in _robust("plan_fails"))
    assert r1 is not None and r1[0] == "TypeError" and "plan must be a canzona Plan made for FSDP2" in r1[1], r1
    assert r0 is not None and r0[0] == "RankFailure", r0
    assert r0[1].startswith("building the plan (no rank proceeds) failed on 1 rank(s); rank 1: ") and "made for FSDP2" in r0[1], r0
    assert r0[2] < BOUND_S and r1[2] < BOUND_S


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["lb-asc", "sc"])
def test_no_sync_accumulates_micro_batches_like_a_single_device(strategy: str) -> None:
    """``opt.no_sync()`` means on FSDP2 what it means on the ZeRO-1 buffer: no gradient collective
    inside the block (no ``p.grad`` appears), and the accumulated step is bitwise the single-device
    optimizers' on the summed micro-batches."""
    per_rank = _robust(f"no_sync/{strategy}")
    for rank, r in enumerate(per_rank):
        assert r["reduced_inside"] == [False] * STEPS, (rank, r["reduced_inside"])
    assert per_rank[0]["mismatches"] == [], per_rank[0]["mismatches"]


@pytest.mark.slow
def test_out_of_range_hyperparameters_are_refused_on_every_rank_before_any_change() -> None:
    """A NaN/inf ``lr`` or a negative ``weight_decay`` set after construction is refused on every
    rank, nothing changes, and ``status_timeout_s`` reaches the FSDP2 runtime."""
    per_rank = _robust("bad_hyper")
    for rank, r in enumerate(per_rank):
        for label, text in (("nan_lr", "parameter group 'matrix': lr must be a finite number >= 0, got nan"),
                            ("neg_wd", "parameter group 'elementwise': weight_decay must be a finite number >= 0, got -0.1"),
                            ("inf_lr", "parameter group 'elementwise': lr must be a finite number >= 0, got inf")):
            assert r[label] is not None and r[label][:2] == ("ValueError", text), (rank, label, r[label])
        assert r["changed"] == [], (rank, r["changed"])
        assert r["timeout"] == (20.0, 20.0), r["timeout"]
    assert per_rank[0]["mismatches"] == [], per_rank[0]["mismatches"]


@pytest.mark.slow
@pytest.mark.parametrize("label,text", [
    ("ew_error", "ArithmeticError: flaky element-wise optimizer refused this step"),
    ("host_error", "ArithmeticError: flaky host optimizer refused this step"),
])
def test_an_optimizer_error_on_one_rank_is_raised_on_every_rank(label: str, text: str) -> None:
    per_rank = _robust(label)
    if label == "host_error":
        assert per_rank[1]["hosts"], "rank 1 hosts no matrix: the case would not fail anywhere"
    for rank, r in enumerate(per_rank):
        assert r["raised"] is not None and r["raised"][0] == "RankFailure", (rank, r["raised"])
        assert f"optimizer step (update) failed on 1 rank(s); rank 1: {text}" in r["raised"][1]
        assert r["raised"][2] < BOUND_S


@pytest.mark.slow
def test_an_error_before_the_status_exchange_is_raised_everywhere_before_any_change() -> None:
    """The status exchange overlaps the first gather: a rank that fails before it still joins the
    gather (with zero pieces), every rank raises the same RankFailure, nothing changes anywhere,
    and the following steps equal uninterrupted ones (no stale transfer in the slots)."""
    per_rank = _robust("read_error")
    for rank, r in enumerate(per_rank):
        assert r["raised"] is not None and r["raised"][0] == "RankFailure", (rank, r["raised"])
        assert "optimizer step failed on 1 rank(s); rank 1: OSError: cannot read the gradient of" in r["raised"][1]
        assert r["raised"][2] < BOUND_S
        assert r["changed"] == [], f"rank {rank}: a refused step changed {r['changed']}"
        assert r["grads_dropped"], f"rank {rank}: gradients of the refused step were kept"
    assert per_rank[0]["mismatches"] == [], per_rank[0]["mismatches"]


@pytest.mark.slow
def test_sc_refuses_to_go_on_from_replicas_a_failed_update_left_different() -> None:
    for rank, r in enumerate(_robust("sc_error")):
        assert r["raised"] is not None and r["raised"][0] == "RankFailure", (rank, r["raised"])
        for key, what in (("step_after", "optimizer step"), ("save_after", "saving the optimizer state")):
            assert r[key] is not None and r[key][0] == "ReplicasDiverged", (rank, key, r[key])
            assert r[key][1].startswith(f"{what} refused: under the 'sync' schedule"), r[key][1]
            assert "flaky sync optimizer refused this step" in r[key][1]
        assert r["stateful_format"] == -1, r["stateful_format"]
        assert r["step_after_load"] is None, (rank, r["step_after_load"])
