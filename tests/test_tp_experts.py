"""Expert stacks split over TP on the ZeRO-1 layout: every expert a TP task.

An ``(E, M, N)`` stack sharded ``Shard(1)`` (rows: column-parallel up projections) or ``Shard(2)``
(columns: row-parallel down projections) over the ``tp`` mesh dimension is ``E`` TP tasks of shape
``(M, N)``: the planner balances them like any TP task, the host of each expert gathers its TP
shards, updates the whole ``(M, N)`` matrix with its own state and scatters the values back.

Unit part: specs (split dims, the refusal of a TP split on the expert dim), the plan of a config
with ``experts="stacked-tp"`` (every expert in exactly one micro-group of the DP rank that updates
it, validation catching a lost or misplaced expert task), the ``canzona plan`` line.
Distributed part (one spawn per world size: dp x tp = 1 x 2 at world 2, 2 x 2 at world 4): a model
with a TP-split gate_up/down stack next to a TP-split dense matrix, stepped by Muon and Shampoo
under several strategies and TP schedules, every expert's values and state bitwise against the
single-device optimizer applied to that ``(M, N)`` matrix alone, including a step where one expert
got no tokens (a zero gradient). transformers' Qwen3-MoE under its own TP plan (a
``packed_colwise`` gate_up stack, ``_StridedShard``) likewise, and its checkpoints (each TP shard of
the packed stack two boxes of it) in every form, loaded under the TP plan and under plain ZeRO-1.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from canzona.runtime.launch import run_workers
from canzona.specs import ParamSpec, expert_task_name, split_task_name
from harness import consolidated_on_every_rank, doc_differences
from validation.harness import integer_grads, mean_grads, pack, unpack

E, H, F = 4, 8, 6
#: the expert that routes no token at step 1 (zero gradient in both stacks)
IDLE = 2
STEPS = 3
#: (case name, matrix optimizer, strategy, TP schedule or None for the strategy's own, bucket size):
#: 200-element buckets give each DP rank whole stacks, 50-element ones cut the stacks between
#: experts at dp 2 (some experts of a stack on each DP rank, each rank's in its own micro-groups)
CASES = (
    ("muon-lb-asc", "muon", "lb-asc", None, 200),
    ("muon-asc-cut", "muon", "asc", None, 50),
    ("muon-lb-asc-sync", "muon", "lb-asc", "sync", 50),
    ("muon-sc", "muon", "sc", None, 200),
    ("shampoo-lb-asc-cut", "shampoo", "lb-asc", None, 50),
)
#: Muon's split step (exchange="ns-input": momentum on the TP shards, only the Newton-Schulz input
#: and output travel) on the same stacks, whole and cut between experts
NS_CASES = (
    ("muon-lb-asc-ns", "muon", "lb-asc", None, 200),
    ("muon-asc-cut-ns", "muon", "asc", None, 50),
)
KW = {"muon": {"lr": 0.05, "adjust_lr_fn": "spectral"}, "shampoo": {"lr": 0.05}}
EKW = {"lr": 0.01, "weight_decay": 0.1}
#: the split dim of each TP-split parameter of :class:`TPExpertsModel`
SPLITS = {"experts.gate_up_proj": 1, "experts.down_proj": 2, "proj.weight": 0}


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * F, H) * 0.2)
        self.down_proj = nn.Parameter(torch.randn(E, H, F) * 0.2)


class TPExpertsModel(nn.Module):
    """A stacked-expert pair (as transformers 5.x and canzona's Qwen3MoE keep them), a dense
    matrix and a norm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = _Experts()
        self.proj = nn.Linear(H, 2 * H, bias=False)
        self.norm = nn.LayerNorm(2 * H)


def _shard(model: nn.Module, tp_mesh) -> None:
    """Each TP-split parameter becomes a ``Shard(d)`` DTensor holding this rank's ``torch.chunk``
    (what ColwiseParallel/RowwiseParallel and Megatron's expert TP lay out)."""
    from torch.distributed.tensor import DTensor, Shard

    r, tp = tp_mesh.get_local_rank(), tp_mesh.size()
    for name, d in SPLITS.items():
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        full = getattr(mod, attr).detach()
        local = full.chunk(tp, dim=d)[r].contiguous()
        setattr(mod, attr, nn.Parameter(DTensor.from_local(local, tp_mesh, [Shard(d)], run_check=False)))


def _local_grads(full: dict[str, torch.Tensor], tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    return {n: (g.chunk(tp, dim=SPLITS[n])[tp_rank].contiguous() if n in SPLITS else g) for n, g in full.items()}


def full_grads(model: nn.Module, step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    """The full-shape gradient DP rank ``dp_rank`` contributes at ``step`` (exact integers times a
    power of two, so the DP mean is exact); the idle expert gets zeros at step 1."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    g = integer_grads(shapes, step=step, rank=dp_rank)
    if step == 1:
        g["experts.gate_up_proj"][IDLE] = 0
        g["experts.down_proj"][IDLE] = 0
    return g


def _expert_state(opt, name: str, k: int) -> dict[str, torch.Tensor] | None:
    """The optimizer state of expert ``k`` of stack ``name`` on this rank, when this rank hosts it."""
    eng = opt.runtime.tp_engine
    task = expert_task_name(name, k)
    if eng is None or eng.optimizer is None or task not in eng.hosted or eng.split:  # split step: the state is on the shards
        return None
    st = eng.optimizer.state.get(eng.masters[task], {})
    return {key: v.detach().clone() for key, v in st.items() if isinstance(v, torch.Tensor) and v.dim() >= 1}


def _case(rank: int, world: int, optimizer: str, strategy: str, schedule: str | None, bucket_numel: int, exchange: str = "gradients") -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import canzona

    dp, tp = world // 2, 2
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    model = TPExpertsModel()
    _shard(model, mesh["tp"])
    opt = canzona.DistributedOptimizer(model, optimizer, strategy=strategy, mesh=mesh, tp_schedule=schedule,
                                       optimizer_kwargs=KW[optimizer], elementwise_kwargs=EKW, bucket_numel=bucket_numel, exchange=exchange)
    from validation.harness import inject_grads

    states = []
    for step in range(STEPS):
        inject_grads(model, _local_grads(full_grads(TPExpertsModel(), step, dp_rank), tp_rank, tp))
        opt.step()
        opt.zero_grad()
        states.append({(n, k): st for n in ("experts.gate_up_proj", "experts.down_proj") for k in range(E)
                       if (st := _expert_state(opt, n, k)) is not None})
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    groups = [list(g.params) for g in opt.plan.micro_groups[dp_rank]] if opt.plan.micro_groups else []
    cut = sorted(p.name for p in opt.plan.params if p.role == "experts" and p.dp_ranges)
    out = {"params": params, "states": states, "groups": groups, "dp_rank": dp_rank, "tp_rank": tp_rank, "cut": cut}
    if bucket_numel == 50:  # the cut stacks, the sync schedule's replicated hosts, and Shampoo's per-expert state
        out.update(_round_trip(mesh, opt, model, optimizer, strategy, schedule, bucket_numel, exchange))
    return out


def _round_trip(mesh, opt, model: nn.Module, optimizer: str, strategy: str, schedule: str | None, bucket_numel: int,
                exchange: str = "gradients") -> dict:
    """A consolidated checkpoint (every expert's state from its host) loaded into a fresh
    optimizer on a fresh model takes the same next step as the running one."""
    import canzona
    from validation.harness import inject_grads

    doc = consolidated_on_every_rank(opt)
    resumed = []
    for source in (doc,):
        fresh_model = TPExpertsModel()
        _shard(fresh_model, mesh["tp"])
        fresh = canzona.DistributedOptimizer(fresh_model, optimizer, strategy=strategy, mesh=mesh, tp_schedule=schedule,
                                             optimizer_kwargs=KW[optimizer], elementwise_kwargs=EKW, bucket_numel=bucket_numel,
                                             exchange=exchange)
        fresh.load_state_dict(source)
        resumed.append((fresh_model, fresh))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    for m, o in ((model, opt), *resumed):
        inject_grads(m, _local_grads(full_grads(TPExpertsModel(), STEPS, dp_rank), tp_rank, 2))
        o.step()
        o.zero_grad()
    same = [all(torch.equal(_full(a), _full(b)) for a, b in zip(model.parameters(), m.parameters())) for m, _ in resumed]
    momentum = {n: st["momentum_buffer"].clone() for n, st in doc.get("state", {}).items() if n.startswith("experts.") and "momentum_buffer" in st}
    return {"resumed_equal": same, "doc_momentum": momentum}


def _qwen3_moe_config():
    import transformers

    # sides multiple of 4: transformers' grouped_mm expert kernel needs 16-byte strides
    return transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                                       num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)


def _hf_grads(shapes: dict[str, tuple[int, ...]], step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    g = integer_grads(shapes, step=step, rank=dp_rank)
    if step == 1:  # an expert with no routed token: zero gradient in both stacks
        for n in g:
            if ".experts." in n:
                g[n][IDLE] = 0
    return g


def _qwen3_moe(rank: int, world: int, folder: Path) -> dict:
    """transformers' Qwen3MoeForCausalLM under its own TP plan (packed_colwise gate_up stack,
    rowwise down stack, colwise/rowwise attention): every parameter and expert state after a few
    steps on injected gradients, under the grouped TP schedule, the sync one and the sc baseline;
    the one-line refusal that remains (the packed stack marked element-wise) and checkpoints of
    the packed stack across layouts."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import canzona
    from canzona.hf import apply_tp_plan

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    model = apply_tp_plan(transformers.Qwen3MoeForCausalLM(_qwen3_moe_config()).float(), mesh["tp"])
    out: dict = {"placements": {n: str(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}}
    try:  # a packed stack as one (E * 2I, H) matrix: joining its shards would reorder its rows
        canzona.DistributedOptimizer(model, "muon", mesh=mesh, roles={"*experts*": "matrix"})
        out["matrix_refused"] = None
    except ValueError as exc:
        out["matrix_refused"] = str(exc)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    stacks = [n for n in shapes if ".experts." in n]

    def train(model: nn.Module, same_grads: bool = False, on=None, **kw) -> tuple[object, list[dict]]:
        # same_grads: every rank injects DP rank 0's gradients (their mean at any DP size is them)
        opt = canzona.DistributedOptimizer(model, "muon", mesh=mesh if on is None else on, optimizer_kwargs=KW["muon"], elementwise_kwargs=EKW,
                                           bucket_numel=3000, **kw)
        states = []
        for step in range(STEPS):
            full = _hf_grads(shapes, step, 0 if same_grads else dp_rank)
            _inject_full(model, full)
            opt.step()
            opt.zero_grad()
            states.append({(n, k): st for n in stacks for k in range(E) if (st := _expert_state(opt, n, k)) is not None})
        return opt, states

    opt, states = train(model)
    out["params"] = {n: _full(p).detach().clone() for n, p in model.named_parameters()}
    out["states"] = states
    out["stacks"] = {n: (opt.plan.param(n).spec.tp_dim, opt.plan.param(n).spec.tp_blocks) for n in stacks}
    # the sync TP schedule (every TP rank computes every expert), the sc baseline (every rank
    # computes every matrix) and Muon's split step (momentum on the TP shards) on the packed
    # stack: the same parameters, and the same document
    doc = consolidated_on_every_rank(opt)
    out["schedules"] = {}
    for label, kw in (("sync", {"tp_schedule": "sync"}), ("sc", {"strategy": "sc"}), ("ns-input", {"exchange": "ns-input"})):
        torch.manual_seed(0)
        other = apply_tp_plan(transformers.Qwen3MoeForCausalLM(_qwen3_moe_config()).float(), mesh["tp"])
        o, _ = train(other, **kw)
        out["schedules"][label] = {"params": {n: _full(p).detach().clone() for n, p in other.named_parameters()},
                                   "doc": doc_differences(consolidated_on_every_rank(o), doc)}
    out["round_trips"] = _packed_round_trips(world, mesh, model, opt, folder)
    out["elementwise"] = _packed_elementwise(world, mesh, train, folder)
    return out


def _packed_elementwise(world: int, mesh, train, folder: Path) -> dict:
    """The expert stacks marked element-wise (``roles``: AdamW on them) under transformers' TP plan:
    the packed gate_up stack's shards are updated where they are, as plain ZeRO-1 updates the
    unsharded stack (every parameter bitwise), and its checkpoints load across the two layouts
    (the same round trips as the matrix case)."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.hf import apply_tp_plan
    from canzona.plan.describe import role_rows

    roles = {"*experts*": "elementwise"}
    plain = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    (folder / "elementwise").mkdir(exist_ok=True)
    torch.manual_seed(0)
    tp_model = apply_tp_plan(transformers.Qwen3MoeForCausalLM(_qwen3_moe_config()).float(), mesh["tp"])
    tp_opt, _ = train(tp_model, roles=roles, same_grads=True)
    torch.manual_seed(0)
    z_model = transformers.Qwen3MoeForCausalLM(_qwen3_moe_config()).float()
    train(z_model, roles=roles, same_grads=True, on=plain)
    z = {n: p.detach() for n, p in z_model.named_parameters()}
    return {
        "roles": sorted({r.role for r in role_rows(tp_opt.plan) if ".experts." in r.name}),
        "blocks": {n: tp_opt.plan.param(n).spec.tp_blocks for n in z if ".experts." in n},
        "tp_vs_zero1": [n for n, p in tp_model.named_parameters() if not torch.equal(_full(p).detach(), z[n])],
        "round_trips": _packed_round_trips(world, mesh, tp_model, tp_opt, folder / "elementwise", roles=roles),
    }


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def _inject_full(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Set every parameter's gradient from ``full`` (whole tensors, the same on every rank): a
    DTensor parameter gets its own piece of it, cut as its placements cut the parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from validation.harness import inject_grads

    inject_grads(model, {n: (distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=None).to_local()
                             if isinstance(p, DTensor) else full[n].clone()) for n, p in model.named_parameters()})


def _packed_round_trips(world: int, mesh, model: nn.Module, opt, folder: Path, roles: dict | None = None,
                        build=None, muon_kw: dict | None = None) -> dict:
    """Checkpoints of the packed stack (each TP rank's shard is a slice of both blocks, gate and
    up): the consolidated document, canzona's sharded form and torch DCP's Stateful form, each
    loaded into a fresh model of other values under the same TP plan and under plain ZeRO-1 on
    the unsharded model (dp = world): every loaded document equals the saved one, and every run
    then takes the running optimizer's next step bit for bit."""
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.hf import apply_tp_plan
    from canzona.runtime.dcp import load_sharded, save_sharded

    doc = consolidated_on_every_rank(opt)
    save_sharded(opt, folder / "tp.dcp")
    dcp.save({"optim": opt}, checkpoint_id=str(folder / "tp.stateful"))
    plain = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    loads = {
        "tp/consolidated": lambda o: o.load_state_dict(doc),
        "tp/sharded": lambda o: load_sharded(o, folder / "tp.dcp"),
        "tp/stateful": lambda o: dcp.load({"optim": o}, checkpoint_id=str(folder / "tp.stateful")),
        "zero1/consolidated": lambda o: o.load_state_dict(doc),
        "zero1/sharded": lambda o: load_sharded(o, folder / "tp.dcp"),
    }
    out: dict = {"doc": {}}
    runs = [("running", model, opt)]
    for key, load in loads.items():
        torch.manual_seed(1)  # other initial values: the load must bring the saved ones
        m = build() if build is not None else transformers.Qwen3MoeForCausalLM(_qwen3_moe_config()).float()
        tp = key.startswith("tp/")
        if tp:
            m = apply_tp_plan(m, mesh["tp"])
        o = canzona.DistributedOptimizer(m, "muon", mesh=mesh if tp else plain, optimizer_kwargs=muon_kw or KW["muon"],
                                         elementwise_kwargs=EKW, bucket_numel=3000, roles=roles)
        load(o)
        out["doc"][key] = doc_differences(consolidated_on_every_rank(o), doc)
        runs.append((key, m, o))
    # the same integer gradients on every rank: every layout's DP mean of them is exactly them
    full = _hf_grads({n: tuple(p.shape) for n, p in model.named_parameters()}, STEPS, 0)
    for _, m, o in runs:
        _inject_full(m, full)
        o.step()
        o.zero_grad()
    want = {n: _full(p).detach() for n, p in model.named_parameters()}
    out["next_step"] = {key: [n for n, p in m.named_parameters() if not torch.equal(_full(p).detach(), want[n])] for key, m, _ in runs[1:]}
    return out


def _llama4_config():
    import transformers

    # Llama 4's experts: gate_up (E, H, 2F) packed on its columns under the TP plan (packed_rowwise)
    return transformers.Llama4TextConfig(vocab_size=64, hidden_size=16, intermediate_size=16, intermediate_size_mlp=32,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                         num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=64,
                                         interleave_moe_layer_step=1, moe_layers=[0, 1], no_rope_layers=[1, 1])


def _llama4(rank: int, world: int, folder: Path) -> dict:
    """transformers' Llama4ForCausalLM under its own TP plan: each rank holds its columns of gate
    and of up of every expert of the (E, H, 2F) gate_up stack (``_StridedShard(dim=2, sf=2)``).
    Every schedule (grouped, sync, sc, the split step and the gradients path) must step bitwise as
    plain ZeRO-1 on the unsharded model, with fp32 Newton-Schulz (in bf16 the rounding hides a
    column order that is wrong: joining the shards end to end passes there and fails here) and
    random gradients; the checkpoints load across the two layouts."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import canzona
    from canzona.hf import apply_tp_plan

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    plain = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    muon_kw = {**KW["muon"], "ns_dtype": torch.float32}

    def build() -> nn.Module:
        return transformers.Llama4ForCausalLM(_llama4_config()).float()

    def train(tp: bool, **kw) -> tuple[nn.Module, object]:
        torch.manual_seed(0)
        model = apply_tp_plan(build(), mesh["tp"]) if tp else build()
        opt = canzona.DistributedOptimizer(model, "muon", mesh=mesh if tp else plain, optimizer_kwargs=muon_kw, elementwise_kwargs=EKW,
                                           bucket_numel=3000, **kw)
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        for step in range(STEPS):  # the same random gradients on every rank: their DP mean is them
            gen = torch.Generator().manual_seed(100 + step)
            full = {n: torch.randn(shape, generator=gen) for n, shape in sorted(shapes.items())}
            _inject_full(model, full)
            opt.step()
            opt.zero_grad()
        return model, opt

    zero1, _ = train(False)
    want = {n: p.detach() for n, p in zero1.named_parameters()}
    out: dict = {"schedules": {}}
    for label, kw in (("grouped", {}), ("sync", {"tp_schedule": "sync"}), ("sc", {"strategy": "sc"}),
                      ("ns-input", {"exchange": "ns-input"}), ("gradients", {"exchange": "gradients"})):
        model, opt = train(True, **kw)
        out["schedules"][label] = [n for n, p in model.named_parameters() if not torch.equal(_full(p).detach(), want[n])]
    out["placements"] = {n: str(p.placements) for n, p in model.named_parameters() if ".experts." in n and isinstance(p, DTensor)}
    out["blocks"] = {n: (opt.plan.param(n).spec.tp_dim, opt.plan.param(n).spec.tp_blocks) for n in want if ".experts." in n}
    (folder / "llama4").mkdir(exist_ok=True)
    out["round_trips"] = _packed_round_trips(world, mesh, model, opt, folder / "llama4", build=build, muon_kw=muon_kw)
    return out


def _hf_reference(dp: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Single device: the same model unsharded, Muon on every matrix task alone (each expert its
    own (M, N) matrix with its rows in the stack's order), AdamW on the rest, stepped on the DP
    mean of the gradients the ranks injected."""
    import transformers

    from canzona.optim import Muon
    from canzona.specs import module_roles

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(_qwen3_moe_config()).float()
    roles = module_roles(model)
    named = dict(model.named_parameters())
    tasks = {n: ([p.detach()[k].clone() for k in range(p.shape[0])] if roles[n][0] == "experts" else [p.detach().clone()])
             for n, p in named.items()}
    mat = [t for n, ts in tasks.items() if roles[n][0] != "elementwise" for t in ts]
    ew = [t for n, ts in tasks.items() if roles[n][0] == "elementwise" for t in ts]
    opts = [Muon(mat, **KW["muon"]), torch.optim.AdamW(ew, **EKW)]
    shapes = {n: tuple(p.shape) for n, p in named.items()}
    states = []
    for step in range(STEPS):
        g = mean_grads([_hf_grads(shapes, step, r) for r in range(dp)])
        for n, ts in tasks.items():
            for k, t in enumerate(ts):
                t.grad = (g[n][k] if roles[n][0] == "experts" else g[n]).clone()
        for o in opts:
            o.step()
        states.append({(n, k): {key: v.clone() for key, v in opts[0].state[t].items() if isinstance(v, torch.Tensor) and v.dim() >= 1}
                       for n, ts in tasks.items() if roles[n][0] == "experts" for k, t in enumerate(ts)})
    params = {n: (torch.stack(ts) if roles[n][0] == "experts" else ts[0]) for n, ts in tasks.items()}
    return params, states


def tp_experts_worker(rank: int, world: int, folder: str) -> bytes:
    out = {}
    try:
        out["qwen3_moe"] = _qwen3_moe(rank, world, Path(folder))
    except Exception as exc:  # noqa: BLE001 - read by its own test
        out["qwen3_moe"] = f"{type(exc).__name__}: {exc}"
    try:
        out["llama4"] = _llama4(rank, world, Path(folder))
    except Exception as exc:  # noqa: BLE001 - read by its own test
        out["llama4"] = f"{type(exc).__name__}: {exc}"
    for name, optimizer, strategy, schedule, bucket_numel in CASES:
        try:
            out[name] = _case(rank, world, optimizer, strategy, schedule, bucket_numel)
        except Exception as exc:  # noqa: BLE001 - each case fails on its own, in the test that reads it
            out[name] = f"{type(exc).__name__}: {exc}"
    for name, optimizer, strategy, schedule, bucket_numel in NS_CASES:
        try:
            out[name] = _case(rank, world, optimizer, strategy, schedule, bucket_numel, exchange="ns-input")
        except Exception as exc:  # noqa: BLE001 - each case fails on its own, in the test that reads it
            out[name] = f"{type(exc).__name__}: {exc}"
    return pack(out)


@pytest.fixture(scope="module", params=[2, 4], ids=["1x2", "2x2"])
def results(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world = request.param
    folder = tmp_path_factory.mktemp(f"tp-experts-{world}")
    return world, [unpack(r) for r in run_workers(tp_experts_worker, world, str(folder), timeout_s=300)]


# ------------------------------------------------------------------------------ reference
def _reference(optimizer: str, dp: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Single device: the optimizer on every matrix task alone (each expert its own (M, N) matrix,
    the dense weight), AdamW on the norm, stepped on the DP mean of the ranks' gradients."""
    from canzona.optim import Muon, Shampoo

    cls = {"muon": Muon, "shampoo": Shampoo}[optimizer]
    model = TPExpertsModel()
    tasks = {n: ([p.detach()[k].clone() for k in range(E)] if n.startswith("experts.") else [p.detach().clone()])
             for n, p in model.named_parameters()}
    mat = [t for n, ts in tasks.items() if n != "norm.weight" and n != "norm.bias" for t in ts]
    ew = tasks["norm.weight"] + tasks["norm.bias"]
    opts = [cls(mat, **KW[optimizer]), torch.optim.AdamW(ew, **EKW)]
    states = []
    for step in range(STEPS):
        g = mean_grads([full_grads(model, step, r) for r in range(dp)])
        for n, ts in tasks.items():
            gs = [g[n][k] for k in range(E)] if n.startswith("experts.") else [g[n]]
            for t, gt in zip(ts, gs):
                t.grad = gt.clone()
        for o in opts:
            o.step()
        states.append({(n, k): {key: v.clone() for key, v in opts[0].state[tasks[n][k]].items() if isinstance(v, torch.Tensor) and v.dim() >= 1}
                       for n in ("experts.gate_up_proj", "experts.down_proj") for k in range(E)})
    params = {n: (torch.stack(ts) if n.startswith("experts.") else ts[0]) for n, ts in tasks.items()}
    return params, states


_REF: dict[tuple[str, int], tuple] = {}


def reference(optimizer: str, dp: int) -> tuple:
    if (optimizer, dp) not in _REF:
        _REF[optimizer, dp] = _reference(optimizer, dp)
    return _REF[optimizer, dp]


# ------------------------------------------------------------------------------ distributed tests
@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_expert_bitwise_against_the_single_device_optimizer(results, case: str) -> None:
    world, res = results
    optimizer = next(c[1] for c in CASES if c[0] == case)
    want, want_states = reference(optimizer, world // 2)
    for r, got in enumerate(res):
        got = got[case]
        assert not isinstance(got, str), f"rank {r}: {got}"
        for n, w in want.items():
            assert torch.equal(got["params"][n], w), f"rank {r} ({world // 2}x2, {case}): {n} differs from one device"
    # every expert's state: held by exactly the ranks that update it whole, bitwise the reference's
    for step in range(STEPS):
        held: dict[tuple, int] = {}
        for r, got in enumerate(res):
            for key, st in got[case]["states"][step].items():
                held[key] = held.get(key, 0) + 1
                want_st = want_states[step][key]
                assert st.keys() == want_st.keys(), f"rank {r} step {step}: {key} state keys {sorted(st)}"
                for sk, v in st.items():
                    assert torch.equal(v, want_st[sk]), f"rank {r} step {step}: expert {key} state {sk} differs"
        assert len(held) == 2 * E, f"step {step}: state of {2 * E - len(held)} experts held nowhere"
        # one host per expert; every TP rank of its DP owner under sync; every rank under sc
        copies = 2 if case.endswith("-sync") else world if case.endswith("-sc") else 1
        assert set(held.values()) == {copies}, f"step {step}: copies of each expert's state {sorted(set(held.values()))}, expected {copies}"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["muon-lb-asc", "muon-asc-cut"])
def test_every_expert_is_one_task_of_one_dp_rank(results, case: str) -> None:
    world, res = results
    assert not any(isinstance(r[case], str) for r in res), [r[case] for r in res if isinstance(r[case], str)]
    firsts = [r[case] for r in res if r[case]["tp_rank"] == 0]  # one TP group per DP rank
    every = [t for r in firsts for g in r["groups"] for t in g]
    experts = sorted(t for t in every if split_task_name(t)[1] is not None)
    assert experts == sorted(expert_task_name(n, k) for n in ("experts.gate_up_proj", "experts.down_proj") for k in range(E))
    if world == 4 and case.endswith("-cut"):
        # the stacks were cut between experts: both DP ranks host experts of the same stack
        assert firsts[0]["cut"], "the case meant to cut a stack between experts did not"
        for n in firsts[0]["cut"]:
            owners = [r["dp_rank"] for r in firsts for g in r["groups"] for t in g if split_task_name(t)[0] == n]
            assert len(set(owners)) == 2, f"{n}: experts on dp ranks {sorted(set(owners))}"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["muon-asc-cut", "muon-lb-asc-sync"])
def test_consolidated_checkpoint_holds_every_expert_and_resumes_bitwise(results, case: str) -> None:
    world, res = results
    _, want_states = reference("muon", world // 2)
    for r, got in enumerate(res):
        got = got[case]
        assert not isinstance(got, str), f"rank {r}: {got}"
        (consolidated,) = got["resumed_equal"]
        assert consolidated, f"rank {r}: the optimizer resumed from the consolidated document steps differently"
    doc = res[0][case]["doc_momentum"]
    assert sorted(doc) == ["experts.down_proj", "experts.gate_up_proj"], sorted(doc)
    for n, m in doc.items():
        want = torch.stack([want_states[-1][n, k]["momentum_buffer"] for k in range(E)])
        assert torch.equal(m, want), f"{n}: consolidated momentum differs from the per-expert reference"


@pytest.mark.slow
def test_shampoo_expert_checkpoint_resumes_bitwise(results) -> None:
    """Shampoo's preconditioners are not shaped like the matrix: the consolidated document keeps
    each hosted expert's state as that expert's entry (stacked along the expert index), and a
    fresh optimizer loading it takes the same next step."""
    _, res = results
    for r, got in enumerate(res):
        got = got["shampoo-lb-asc-cut"]
        assert not isinstance(got, str), f"rank {r}: {got}"
        assert got["resumed_equal"] == [True], f"rank {r}: Shampoo resumed from the consolidated document steps differently"


@pytest.mark.slow
def test_transformers_qwen3_moe_under_its_tp_plan_bitwise(results) -> None:
    """packed_colwise un-packed on the host: each expert's [gate; up] rows in the stack's order."""
    world, res = results
    want, want_states = _hf_reference(world // 2)
    for r, got in enumerate(res):
        got = got["qwen3_moe"]
        assert not isinstance(got, str), f"rank {r}: {got}"
        assert got["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == "(_StridedShard(dim=1, sf=2),)"
        assert got["stacks"] == {"model.layers.0.mlp.experts.gate_up_proj": (1, 2), "model.layers.0.mlp.experts.down_proj": (2, 1)}
        for n, w in want.items():
            assert torch.equal(got["params"][n], w), f"rank {r} ({world // 2}x2): {n} differs from one device"
    for step in range(STEPS):
        held: dict[tuple, int] = {}
        for r, got in enumerate(res):
            for key, st in got["qwen3_moe"]["states"][step].items():
                held[key] = held.get(key, 0) + 1
                for sk, v in st.items():
                    assert torch.equal(v, want_states[step][key][sk]), f"rank {r} step {step}: expert {key} state {sk} differs"
        assert sorted(held) == sorted(want_states[step]) and set(held.values()) == {1}, f"step {step}: {sorted(held.items())}"


@pytest.mark.slow
def test_packed_stack_under_sync_sc_and_the_split_step_bitwise(results) -> None:
    """The packed gate_up stack under the sync TP schedule (every TP rank assembles and updates
    every expert), the sc baseline and Muon's split step (exchange="ns-input"): every parameter
    equal to one device's, and the consolidated document equal to the grouped schedule's (masters
    and every expert's state; fails when the split step scales a packed expert's update by its
    exchange shape)."""
    world, res = results
    want, _ = _hf_reference(world // 2)
    for r, got in enumerate(res):
        got = got["qwen3_moe"]
        assert not isinstance(got, str), f"rank {r}: {got}"
        for label, run in got["schedules"].items():
            bad = [n for n, w in want.items() if not torch.equal(run["params"][n], w)]
            assert bad == [] and run["doc"] == [], f"rank {r} {label}: params {bad}, document {run['doc']}"


@pytest.mark.slow
def test_what_packed_colwise_still_refuses_in_one_line(results) -> None:
    _, res = results
    for r, got in enumerate(res):
        got = got["qwen3_moe"]
        assert not isinstance(got, str), f"rank {r}: {got}"
        msg = got["matrix_refused"]  # the stack as one matrix: its shards joined end to end would reorder its rows
        assert msg is not None and "\n" not in msg and "gate_up_proj" in msg and "packed_colwise" in msg, msg


@pytest.mark.slow
def test_packed_stack_marked_elementwise_is_updated_in_place_and_checkpoints_across_layouts(results) -> None:
    """roles={"*experts*": "elementwise"} under transformers' TP plan: the packed gate_up stack
    (each TP rank holds its rows of gate and of up) gets AdamW on its shards, bitwise what plain
    ZeRO-1 does to the unsharded stack, and its checkpoints (consolidated, sharded, Stateful) load
    under the TP plan and under ZeRO-1 with the next step equal (fails when a shard's regions are
    placed as one box)."""
    _, res = results
    for r, got in enumerate(res):
        got = got["qwen3_moe"]
        assert not isinstance(got, str), f"rank {r}: {got}"
        ew = got["elementwise"]
        assert ew["roles"] == ["elementwise"], ew["roles"]
        assert sorted(ew["blocks"].values()) == [1, 2], ew["blocks"]  # down_proj is a plain Shard(2), gate_up packed
        assert ew["tp_vs_zero1"] == [], f"rank {r}: {ew['tp_vs_zero1']}"
        trips = ew["round_trips"]
        assert sorted(trips["doc"]) == ["tp/consolidated", "tp/sharded", "tp/stateful", "zero1/consolidated", "zero1/sharded"]
        assert all(d == [] for d in trips["doc"].values()), f"rank {r}: {trips['doc']}"
        assert all(d == [] for d in trips["next_step"].values()), f"rank {r}: {trips['next_step']}"


@pytest.mark.slow
def test_packed_stack_checkpoints_load_across_layouts_and_resume_bitwise(results) -> None:
    """The packed gate_up stack's TP shards are two boxes of the stack each (rows r of gate and of
    up): consolidated, sharded and Stateful checkpoints saved under transformers' TP plan load
    under it and under plain ZeRO-1 with every master, state, step and hyperparameter equal, and
    the next step is the running optimizer's, bit for bit (fails when a shard is placed as one
    box: the document's gate_up rows come out interleaved)."""
    _, res = results
    for r, got in enumerate(res):
        got = got["qwen3_moe"]
        assert not isinstance(got, str), f"rank {r}: {got}"
        trips = got["round_trips"]
        assert sorted(trips["doc"]) == ["tp/consolidated", "tp/sharded", "tp/stateful", "zero1/consolidated", "zero1/sharded"]
        assert all(d == [] for d in trips["doc"].values()), f"rank {r}: {trips['doc']}"
        assert all(d == [] for d in trips["next_step"].values()), f"rank {r}: {trips['next_step']}"


@pytest.mark.slow
def test_llama4_column_packed_stack_under_its_tp_plan_bitwise_and_checkpoints_across_layouts(results) -> None:
    """Llama 4's (E, H, 2F) gate_up stack under transformers' packed_rowwise (each rank holds its
    columns of gate and of up): every schedule steps bitwise as plain ZeRO-1 on the unsharded
    model (fp32 Newton-Schulz, random gradients; fails when the shards are joined end to end), and
    the consolidated, sharded and Stateful checkpoints load under the TP plan and under ZeRO-1
    with the next step equal."""
    _, res = results
    for r, got in enumerate(res):
        got = got["llama4"]
        assert not isinstance(got, str), f"rank {r}: {got}"
        gate_up = [n for n in got["blocks"] if n.endswith("gate_up_proj")]
        assert gate_up and all(got["blocks"][n] == (2, 2) for n in gate_up), got["blocks"]
        assert all("_StridedShard(dim=2" in got["placements"][n] for n in gate_up), got["placements"]
        for label, bad in got["schedules"].items():
            assert bad == [], f"rank {r} {label}: differs from plain ZeRO-1 on {bad}"
        trips = got["round_trips"]
        assert sorted(trips["doc"]) == ["tp/consolidated", "tp/sharded", "tp/stateful", "zero1/consolidated", "zero1/sharded"]
        assert all(d == [] for d in trips["doc"].values()), f"rank {r}: {trips['doc']}"
        assert all(d == [] for d in trips["next_step"].values()), f"rank {r}: {trips['next_step']}"


# ------------------------------------------------------------------------------ unit tests
def test_spec_split_dims_and_the_expert_dim_refused() -> None:
    up = ParamSpec("m.experts.up", (4, 12, 8), "experts", tp_dim=1, tp=2)
    down = ParamSpec("m.experts.down", (4, 8, 6), "experts", tp_dim=2, tp=2)
    assert (up.task_tp_dim, up.local_task_shape, up.task_shape) == (0, (6, 8), (12, 8))
    assert (down.task_tp_dim, down.local_task_shape) == (1, (8, 3))
    with pytest.raises(ValueError, match="expert parallelism") as exc:
        ParamSpec("m.experts.up", (4, 12, 8), "experts", tp_dim=0, tp=2)
    assert "m.experts.up" in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="does not divide"):
        ParamSpec("m.experts.down", (4, 8, 5), "experts", tp_dim=2, tp=2)
    assert split_task_name(expert_task_name("a.b", 7)) == ("a.b", 7) and split_task_name("a.b") == ("a.b", None)


def _moe_plan(**kw):
    from canzona.plan.build import plan_model

    # small buckets: the planner cuts the stacks between experts (expert tasks on both DP ranks)
    return plan_model("qwen3-moe-tiny", dp=2, tp=2, bucket_numel=2000, **kw)


def test_stacked_tp_plan_hosts_every_expert_once_on_its_dp_owner() -> None:
    plan = _moe_plan(experts="stacked-tp")
    plan.validate()
    stacks = [p for p in plan.params if p.role == "experts"]
    assert stacks and all(p.spec.tp_split and p.spec.tp_dim in (1, 2) for p in stacks)
    assert all(p.tp_host is None for p in stacks)
    seen: dict[str, int] = {}
    for r, groups in enumerate(plan.micro_groups):
        for g in groups:
            for t in g.params:
                base, k = split_task_name(t)
                if k is not None:
                    assert t not in seen
                    seen[t] = r
    assert len(seen) == sum(p.spec.shape[0] for p in stacks)
    # each expert task sits with the DP rank whose buffer range holds that expert
    assert any(p.dp_ranges for p in stacks), "no stack was cut between experts"
    for p in stacks:
        unit = p.spec.local_numel // p.spec.shape[0]
        for k in range(p.spec.shape[0]):
            owner = p.dp_owner if p.dp_owner is not None else next(r for r, a, b in p.dp_ranges if a <= k * unit < b)
            assert seen[expert_task_name(p.name, k)] == owner
    # the host loads count every expert: the TP FLOPs ratio stays near 1 with 8 experts per stack
    assert plan.metrics.tp_flops_ratio < 1.1
    # the default keeps stacks replicated over TP, with no expert task
    default = _moe_plan()
    assert all(not p.spec.tp_split for p in default.params if p.role == "experts")
    assert not any(split_task_name(t)[1] is not None for gs in default.micro_groups for g in gs for t in g.params)


def test_plan_validation_catches_lost_and_misplaced_expert_tasks() -> None:
    from canzona.plan.plan import MicroGroup, Plan, PlanError

    plan = _moe_plan(experts="stacked-tp")
    doc = plan.to_dict()
    assert Plan.from_dict(json.loads(json.dumps(doc))) == plan
    groups = [list(gs) for gs in plan.micro_groups]
    r = next(i for i, gs in enumerate(groups) if any(split_task_name(t)[1] is not None for g in gs for t in g.params))
    g = next(g for g in groups[r] if any(split_task_name(t)[1] is not None for t in g.params))
    j = next(i for i, t in enumerate(g.params) if split_task_name(t)[1] is not None)
    lost = dataclasses.replace(g, params=g.params[:j] + g.params[j + 1:], hosts=g.hosts[:j] + g.hosts[j + 1:])
    bad = [list(gs) for gs in groups]
    bad[r][g.index] = lost
    with pytest.raises(PlanError, match="in no micro-group"):
        dataclasses.replace(plan, micro_groups=tuple(tuple(gs) for gs in bad)).validate()
    moved = [list(gs) for gs in groups]
    other = (r + 1) % len(groups)
    moved[r][g.index] = lost
    extra = MicroGroup(index=len(moved[other]), params=(g.params[j],), hosts=(0,), loads=(0.0,) * plan.inputs.tp)
    moved[other].append(extra)
    with pytest.raises(PlanError, match="does not update that expert"):
        dataclasses.replace(plan, micro_groups=tuple(tuple(gs) for gs in moved)).validate()
    wrong = [list(gs) for gs in groups]
    wrong[r][g.index] = dataclasses.replace(g, params=g.params[:j] + (expert_task_name(split_task_name(g.params[j])[0], 999),) + g.params[j + 1:])
    with pytest.raises(PlanError, match="outside the stack"):
        dataclasses.replace(plan, micro_groups=tuple(tuple(gs) for gs in wrong)).validate()


def test_canzona_plan_says_where_experts_are_tp_split(capsys) -> None:
    from canzona.cli import main

    assert main(["plan", "--model", "qwen3-moe-tiny", "--dp", "2", "--tp", "2", "--experts", "stacked-tp"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("experts"))
    assert "4 stacks TP-split over tp=2 (columns and rows): 32 expert tasks" in line, line
    assert main(["plan", "--model", "qwen3-moe-tiny", "--dp", "2", "--tp", "2"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("experts"))
    assert "4 stacks replicated over TP (32 experts)" in line, line
    # a TP degree that does not divide the experts' rows or columns: one line, exit 2
    assert main(["plan", "--model", "qwen3-moe-tiny", "--dp", "2", "--tp", "64", "--experts", "stacked-tp"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err


def test_costs_and_role_table_of_tp_split_stacks() -> None:
    import numpy as np

    from canzona.cost import cost_arrays, matrix_flops, param_flops, param_memory, state_bytes
    from canzona.plan.describe import describe_plan

    up = ParamSpec("m.experts.up", (4, 12, 8), "experts", tp_dim=1, tp=2)
    down = ParamSpec("m.experts.down", (4, 8, 6), "experts", tp_dim=2, tp=2)
    for s in (up, down):
        assert param_flops(s, "muon") == 4 * matrix_flops("muon", s.task_shape) / 2  # E full tasks over tp hosts
        assert param_flops(s, "muon", "local") == 4 * matrix_flops("muon", s.local_task_shape)
        assert param_memory(s, "shampoo") == 4 * state_bytes("shampoo", s.task_shape) / 2
    specs = list(_moe_plan(experts="stacked-tp").specs)
    for opt in ("muon", "shampoo"):
        for fs in ("full", "local"):
            f, m = cost_arrays(specs, opt, fs)  # the vectorised form the planner uses agrees
            assert np.allclose(f, [param_flops(s, opt, fs) for s in specs], rtol=1e-12, atol=0)
            assert np.allclose(m, [param_memory(s, opt, fs) for s in specs], rtol=1e-12, atol=0)
    rows = [ln for ln in describe_plan(_moe_plan(experts="stacked-tp")).splitlines() if "experts.linear_fc1" in ln]
    assert rows and all("TP-split on dim 1, TP hosts" in ln for ln in rows), rows
    rows = [ln for ln in describe_plan(_moe_plan(experts="stacked-tp", tp_schedule="sync")).splitlines() if "experts.linear_fc2" in ln]
    assert rows and all("TP-split on dim 2, every TP rank" in ln for ln in rows), rows


def test_fsdp2_planner_hosts_every_expert_of_a_tp_split_stack() -> None:
    """On FSDP2 a TP-split stack (torchtitan's colwise/rowwise experts without ep) cuts every
    expert: marked cut (tp_dim 1, as the FSDP2 layout records it), each expert one hosted task of
    the dp_shard x tp group; replicated stacks stay whole (no task)."""
    from canzona.plan.build import plan_fsdp_model

    plan = plan_fsdp_model("qwen3-moe-tiny", dp_shard=2, tp=2, experts="stacked-tp")
    stacks = [p.spec for p in plan.params if p.spec.kind == "experts"]
    assert stacks and all(s.tp_dim == 1 and s.tp == 1 for s in stacks), stacks
    hosts = {t: h for g in plan.micro_groups[0] for t, h in zip(g.params, g.hosts)}
    want = {f"{s.name}[{e}]" for s in stacks for e in range(s.shape[0])}
    assert want <= set(hosts) and {hosts[t] for t in want} <= set(range(4)), sorted(set(hosts) - want)[:3]
    assert plan.metrics.details["n_cut_expert_tasks"] == len(want)
    whole = plan_fsdp_model("qwen3-moe-tiny", dp_shard=2, tp=2)
    assert whole.metrics.details["n_cut_expert_tasks"] == 0 and not [t for g in whole.micro_groups[0] for t in g.params if "[" in t]


def test_microgroup_explorer_reads_expert_tasks() -> None:
    from canzona.cost import matrix_flops
    from canzona.viz.microgroups import task_table

    plan = _moe_plan(experts="stacked-tp")
    rows = task_table(plan, 1)
    experts = rows[rows.param.str.contains("experts.linear_fc2.weight[", regex=False)]
    assert len(experts) and set(experts["shape"]) == {"64 x 32"}  # one (M, N) expert per row
    assert set(experts["work"]) == {float(matrix_flops("muon", (64, 32)))}
    assert set(experts["grad_bytes"]) == {4 * 64 * 32}


def test_packed_stack_spec_and_plan_document() -> None:
    from canzona.plan.build import make_plan
    from canzona.plan.plan import Plan, PlanInputs

    packed = ParamSpec("m.experts.gate_up_proj", (4, 16, 8), "experts", tp_dim=1, tp=2, tp_blocks=2)
    base = dict(name="m.experts.gate_up_proj", shape=(4, 16, 8), kind="experts", tp_dim=1, tp=2, tp_blocks=2)
    for bad in (dict(tp_dim=2, shape=(4, 16, 6)), dict(shape=(4, 6, 8)), dict(kind="matrix", shape=(16, 8), tp_dim=0),
                dict(kind="elementwise", shape=(4, 6, 8))):
        with pytest.raises(ValueError, match="packed blocks"):
            ParamSpec(**{**base, **bad})
    for good in (dict(tp_dim=2), dict(kind="elementwise"), dict(kind="elementwise", tp_dim=2),
                 dict(kind="elementwise", shape=(16, 8), tp_dim=0)):
        assert ParamSpec(**{**base, **good}).tp_blocks == 2  # element-wise: any split dim that divides
    inp = PlanInputs(model="x", layout="hf", dp=2, tp=2, optimizer="muon", strategy="lb-asc", tp_schedule="lpt-carry", bucket_numel=100)
    rest = [ParamSpec("m.experts.down_proj", (4, 8, 8), "experts", tp_dim=2, tp=2), ParamSpec("m.norm.weight", (8,), "elementwise", tp=2)]
    plan = make_plan([packed, *rest], inp)
    doc = json.loads(plan.to_json())
    assert [p.get("tp_blocks") for p in doc["params"]] == [2, None, None]
    back = Plan.from_dict(doc)
    assert back == plan and back.param("m.experts.gate_up_proj").spec.tp_blocks == 2
    plain = make_plan([dataclasses.replace(packed, tp_blocks=1), *rest], inp)
    assert plain.fingerprint != plan.fingerprint  # the packing is part of what the plan is
    assert "tp_blocks" not in json.dumps(json.loads(plain.to_json())["params"])


@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in NS_CASES])
def test_split_exchange_on_tp_split_expert_stacks_bitwise(results, case: str) -> None:
    """exchange='ns-input' on TP-split stacks (rows and columns): every parameter equal to one
    device's after the steps (an idle expert among them); the cut stacks' consolidated checkpoint
    loaded into a fresh optimizer takes the same next step."""
    world, res = results
    want, _ = reference("muon", world // 2)
    for r, got in enumerate(res):
        got = got[case]
        assert not isinstance(got, str), f"rank {r}: {got}"
        bad = [n for n, w in want.items() if not torch.equal(got["params"][n], w)]
        assert bad == [], f"rank {r} ({world // 2}x2, {case}): {bad} differ from one device"
        assert got.get("resumed_equal", [True]) == [True], f"rank {r}: resumed from the consolidated document steps differently"
