"""FSDP2 with expert parallelism, and expert stacks cut by their FSDP2 shard, built the way
torchtitan users build them: experts made ``Shard(0)`` DTensors on the ``ep`` dimension of the
sparse mesh ``("efsdp", "ep")``, then torchtitan's own ``apply_fsdp_to_decoder`` (one
``fully_shard`` per block, the experts on the ``efsdp`` mesh through ``shard_placement_fn``, FSDP's
gradient division off: ``p.grad`` is the sum of the ranks' gradients).

Cases (one spawn per world size, each case reported on its own):

- world 2: ``ep2`` (efsdp 1, whole experts; ``ep2-titan`` the same through
  ``canzona.torchtitan.CanzonaOptimizers``, which reads the dense mesh from the parameters), ``cut1`` (ep 1, one expert: torchtitan picks
  ``Shard(1)``, the expert is cut over both ranks);
- world 4: ``ep2x2`` (efsdp 2 x ep 2, four experts: ``_StridedShard(0)``, whole experts),
  ``cut2x2`` (efsdp 2 x ep 2, two experts: ``Shard(1)`` on efsdp), ``cut4`` (ep 1, two experts
  over four ranks: ``Shard(1)``), ``cut2x2-sc`` (the ``sc`` baseline on the cut layout),
  ``hsdp2-ep2`` (HSDP: dp_replicate 2 x (efsdp 1 x ep 2), four experts, the dense mesh
  ``("dp_replicate", "fsdp")``, the experts on ``("dp_replicate", "efsdp", "ep")`` with
  ``(Replicate(), _StridedShard(0), Shard(0))``, whole; ``hsdp2-ep2-titan`` the same through the
  container), ``hsdp2-cut2`` (HSDP without ep: dp_replicate 2 x fsdp 2, two experts
  ``(Replicate(), Shard(1))``, hosted within each replica), ``tp2-ep2`` (FSDP2 x TP x EP as
  torchtitan 0.3.0 builds it, meshes from its ``ParallelDims``: the dense parameters TP'd and on
  ``("fsdp", "tp")``, four experts on ``("efsdp", "ep")`` over the same four ranks, whole and not
  cut by TP; ``tp2-ep2-titan`` the same through the container; ``tp2-cut2x2`` two experts,
  ``Shard(1)`` on efsdp, hosted within the fsdp x tp shard group), ``tp2-etp`` (torchtitan 0.3.0
  with tp and without ep: fsdp 2 x tp 2, two experts cut by TP on the dense ``tp``, ``w1``
  ``(Shard(0), Shard(1))`` colwise and ``w2`` ``(Shard(0), Shard(2))`` rowwise, each rank one
  expert's TP-cut columns, every expert hosted within fsdp x tp; ``tp2-etp1`` one expert, so
  fully_shard's ``Shard(1)`` on top: ``(_StridedShard(1), Shard(1))`` and ``(Shard(1),
  Shard(2))``; ``tp2-etp-ns`` under ``ns-input``; ``tp2-etp-titan`` through the container);
- ``-ns`` (``cut1-ns`` world 2, ``cut2x2-ns`` and ``cut2x2-sc-ns`` world 4): ``exchange="ns-input"``,
  Muon's split step (momentum on each rank's rows of every expert, the Newton-Schulz input to the
  expert's host; under ``sc`` to every rank).

Each: three Muon steps (AdamW element-wise) with integer gradients, expert 1 of every stack with a
zero gradient at step 1, every parameter and every expert's momentum bitwise equal to the
single-device optimizer fed the same summed gradients; a NaN in one expert refused on every rank
naming the expert, nothing changed. World 4 also loads the consolidated checkpoint of ``cut2x2``
into ``cut4`` (another layout of the same model) and both take the same next step, under
gradients, from ``ns-input`` into gradients and back (:data:`ACROSS`); ``exchange="auto"`` takes
the split step with cut experts; refusals of ``ns-input`` with an optimizer that has no split step
(Shampoo), of an expert mesh beside HSDP that spans the whole world (not one replica's ranks),
beside TP of an expert mesh carrying ``tp`` (expert tensor parallelism), of one over fewer ranks
than fsdp x tp, of experts split on their expert dim by the dense ``tp`` (``Shard(0)``) and of
experts cut by their shard but replicated over ``tp`` are one line.
The sharded forms (``save_sharded`` / ``load_sharded`` and DCP's Stateful ``dcp.save`` /
``dcp.load``) of a two-expert model cross its cut, whole, HSDP and split-step layouts
(:data:`SHARDED_CHAINS`), each chain's next step bitwise equal; a four-expert model refuses them
and a flipped byte in a stored expert is refused, nothing changed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import nn

from canzona.runtime.launch import run_workers
from canzona.specs import module_roles
from harness import attempt, case_results
from moe_models import TaskReference
from validation.harness import integer_grads, pack, unpack

MKW = {"lr": 0.05, "adjust_lr_fn": "spectral"}
EKW = {"lr": 0.01, "weight_decay": 0.1}
STEPS = 3
PREFIX = "layers.0.moe.routed_experts.inner_experts."
STACKS = (PREFIX + "w1", PREFIX + "w2")
#: case -> (world, ep, experts, strategy)
CASES: dict[str, tuple[int, int, int, str]] = {
    "ep2": (2, 2, 4, "lb-asc"),
    "ep2-titan": (2, 2, 4, "lb-asc"),  # built and stepped by canzona.torchtitan's container
    "cut1": (2, 1, 1, "lb-asc"),
    "ep2x2": (4, 2, 4, "lb-asc"),
    "cut2x2": (4, 2, 2, "lb-asc"),
    "cut4": (4, 1, 2, "lb-asc"),
    "cut2x2-sc": (4, 2, 2, "sc"),
    "hsdp2-ep2": (4, 2, 4, "lb-asc"),  # dp_replicate 2 x (efsdp 1 x ep 2): HSDP beside the expert mesh
    "hsdp2-ep2-titan": (4, 2, 4, "lb-asc"),  # the same through canzona.torchtitan's container
    "hsdp2-cut2": (4, 1, 2, "lb-asc"),  # dp_replicate 2 x fsdp 2, no ep: experts Shard(1), hosted within each replica
    "cut1-ns": (2, 1, 1, "lb-asc"),  # "-ns": exchange="ns-input" (Muon's split step)
    "cut2x2-ns": (4, 2, 2, "lb-asc"),
    "cut2x2-sc-ns": (4, 2, 2, "sc"),
    "tp2-ep2": (4, 2, 4, "lb-asc"),  # fsdp 2 x tp 2 dense, efsdp 2 x ep 2 sparse (torchtitan's ParallelDims): whole experts
    "tp2-ep2-titan": (4, 2, 4, "lb-asc"),  # the same through canzona.torchtitan's container (mesh ("fsdp", "tp"))
    "tp2-cut2x2": (4, 2, 2, "lb-asc"),  # the same meshes, two experts: Shard(1) on efsdp, hosted within fsdp x tp
    "tp2-etp": (4, 1, 2, "lb-asc"),  # fsdp 2 x tp 2, ep 1: experts TP-cut (w1 Shard(1), w2 Shard(2) on tp), Shard(0) on fsdp
    "tp2-etp1": (4, 1, 1, "lb-asc"),  # one expert: fsdp's Shard(1) over TP's (w1 _StridedShard(1), w2 Shard(1))
    "tp2-etp-ns": (4, 1, 2, "lb-asc"),  # tp2-etp under exchange="ns-input"
    "tp2-etp-titan": (4, 1, 2, "lb-asc"),  # tp2-etp through canzona.torchtitan's container (one mesh, ("fsdp", "tp"))
}
#: torchtitan 0.3.0's TP placements of the toy's dense parameters (tp dim; None: Replicate): embedding,
#: colwise attention projection and lm_head Shard(0); router gate and norm Replicate
TP_DIMS: dict[str, int | None] = {"tok_embeddings.weight": 0, "layers.0.attention.wq": 0, "layers.0.moe.router.gate": None,
                                  "norm.weight": None, "lm_head.weight": 0}
#: (saving exchange, loading exchange) of the checkpoint of cut experts loaded into another layout
#: torchtitan 0.3.0's TP dims of the routed experts without ep: qwen3/sharding.py's _GROUPED_EXPERTS_PARAM_LAYOUT
#: (w1_EFD S(1) colwise, w2_EDF S(2) rowwise) through moe_sharding.expert_param_placement_dense, Shard on the dense
#: tp and Replicate on the data-parallel axes (torchtitan.models imports triton, absent on CPU: the dims are stated)
EXPERT_TP_DIMS: dict[str, int] = {PREFIX + "w1": 1, PREFIX + "w2": 2}
ACROSS: tuple[tuple[str, str], ...] = (("gradients", "gradients"), ("ns-input", "gradients"), ("gradients", "ns-input"))


def _exchange(key: str) -> str:
    return "ns-input" if key.endswith("-ns") else "gradients"


def _replicate(key: str) -> int:
    """A case's ``dp_replicate`` degree (HSDP): the ``hsdpN-`` prefix of its key, else 1."""
    return int(key[4:key.index("-")]) if key.startswith("hsdp") else 1


def _tp(key: str) -> int:
    """A case's ``tp`` degree (dense FSDP2 x TP beside the expert mesh): the ``tpN-`` prefix, else 1."""
    return int(key[2:key.index("-")]) if key.startswith("tp") else 1


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


class Inject(nn.Module):
    """Parameters of the given shapes; ``forward(grads)`` is ``sum(p * g)`` over them, so the
    backward gives each (unsharded, EP-local) parameter exactly its injected gradient."""

    def __init__(self, prefix: str, **shapes: tuple[int, ...]) -> None:
        super().__init__()
        self.prefix = prefix
        for k, s in shapes.items():
            setattr(self, k, nn.Parameter(torch.randn(*s) * 0.2))

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(())
        for n, p in self.named_parameters(recurse=False):
            if self.prefix + n in grads:
                total = total + (_local(p) * grads[self.prefix + n]).sum()
        return total


class InjectEmbedding(nn.Embedding):
    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return (_local(self.weight) * grads["tok_embeddings.weight"]).sum()


class Block(nn.Module):
    """One MoE transformer block (its forward runs inside FSDP2's unshard of the block)."""

    moe_enabled = True

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.attention = Inject("layers.0.attention.", wq=(8, 8))
        self.moe = nn.Module()
        self.moe.router = Inject("layers.0.moe.router.", gate=(experts, 8))
        self.moe.routed_experts = nn.Module()
        self.moe.routed_experts.inner_experts = Inject(PREFIX, w1=(experts, 8, 4), w2=(experts, 4, 8))
        self.moe.routed_experts.inner_experts.num_experts = experts

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.attention(grads) + self.moe.router(grads) + self.moe.routed_experts.inner_experts(grads)


class TitanToy(nn.Module):
    """The attributes torchtitan's ``apply_fsdp_to_decoder`` walks, one MoE block."""

    def __init__(self, experts: int, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.enable_weight_tying = False
        self.tok_embeddings = InjectEmbedding(16, 8)
        self.layers = nn.ModuleDict({"0": Block(experts)})
        self.norm = Inject("norm.", weight=(8,))
        self.lm_head = Inject("lm_head.", weight=(16, 8))

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.tok_embeddings(grads) + self.layers["0"](grads) + self.norm(grads) + self.lm_head(grads)


def _titan(world: int, ep: int, experts: int, seed: int = 0, replicate: int = 1, tp: int = 1) -> tuple[nn.Module, Any]:
    """The toy sharded by torchtitan (EP first, then its FSDP2 wrapping); returns it and the dense
    mesh. ``replicate`` > 1 is HSDP as torchtitan's legacy (``partial_dtensor``) meshes make it: the
    dense mesh ``("dp_replicate", "fsdp")``, the sparse ``("dp_replicate", "efsdp", "ep")`` (EP on
    its ``ep``, the experts' FSDP2 on its ``("dp_replicate", "efsdp")``). ``tp`` > 1: :func:`_titan_tp`."""
    if tp > 1:
        return _titan_tp(world, ep, experts, seed, tp)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    model = TitanToy(experts, seed)
    rep = ("dp_replicate",) if replicate > 1 else ()
    lead = (replicate,) if replicate > 1 else ()
    dense = init_device_mesh("cpu", (*lead, world // replicate), mesh_dim_names=(*rep, "fsdp"))
    kw: dict[str, Any] = {}
    if ep > 1:
        sparse = init_device_mesh("cpu", (*lead, world // replicate // ep, ep), mesh_dim_names=(*rep, "efsdp", "ep"))
        inner = model.layers["0"].moe.routed_experts.inner_experts
        for n in ("w1", "w2"):
            setattr(inner, n, nn.Parameter(distribute_tensor(getattr(inner, n).detach(), sparse["ep"], [Shard(0)])))
        kw = {"ep_degree": ep, "edp_mesh": sparse[(*rep, "efsdp")]}
    apply_fsdp_to_decoder(model, dense, torch.float32, torch.float32, False, **kw)
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # gloo has no PREMUL_SUM (NCCL multiplies by 1 inside it): plain sums
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model, dense


def _titan_tp(world: int, ep: int, experts: int, seed: int, tp: int) -> tuple[nn.Module, Any]:
    """The toy as torchtitan 0.3.0 shards a MoE under FSDP2 x TP x EP: meshes from its
    ``ParallelDims`` (legacy ``partial_dtensor`` names: dense ``("fsdp", "tp")``, sparse
    ``("efsdp", "ep")`` with efsdp = fsdp x tp / ep, so EP borrows TP's ranks), the dense
    parameters TP'd on ``tp`` (:data:`TP_DIMS`, through ``distribute_module``: the toy has no
    ``nn.Linear`` for ``ColwiseParallel``), the experts ``Shard(0)`` on ``ep`` and not cut by TP
    (``ep`` 1: TP-cut on the dense ``tp`` as torchtitan places them, :data:`EXPERT_TP_DIMS`),
    then torchtitan's ``apply_fsdp_to_decoder``. Returns the model and the dense mesh."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend ParallelDims gives size-1 dims
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    parallel_dims.device_type = "cpu"  # a module global, "cuda" on import
    dims = parallel_dims.ParallelDims(dp_replicate=1, dp_shard=world // tp, cp=1, tp=tp, pp=1, ep=ep, world_size=world,
                                      spmd_backend="partial_dtensor")
    dims.build_mesh()
    model = TitanToy(experts, seed)
    tp_mesh = dims.get_mesh("tp")
    for name, dim in TP_DIMS.items():
        path, _, leaf = name.rpartition(".")

        def cut(_n: str, m: nn.Module, mesh: Any, leaf: str = leaf, dim: int | None = dim) -> None:
            p = getattr(m, leaf)
            setattr(m, leaf, nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate() if dim is None else Shard(dim)])))

        distribute_module(model.get_submodule(path), tp_mesh, cut)
    inner = model.layers["0"].moe.routed_experts.inner_experts
    for n in ("w1", "w2"):
        pl, on = ([Shard(0)], dims.get_mesh("ep")) if ep > 1 else ([Shard(_expert_tp_dim(PREFIX + n))], tp_mesh)
        setattr(inner, n, nn.Parameter(distribute_tensor(getattr(inner, n).detach(), on, pl)))
    apply_fsdp_to_decoder(model, dims.get_mesh("fsdp"), torch.float32, torch.float32, False, ep_degree=ep, edp_mesh=dims.get_optional_mesh("efsdp"))
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():  # gloo has no PREMUL_SUM: plain sums
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    return model, dims.get_mesh(["fsdp", "tp"])


def _expert_tp_dim(name: str) -> int:
    """The dim TP cuts a routed-expert stack on without ep, as torchtitan 0.3.0 places them
    (:data:`EXPERT_TP_DIMS`)."""
    return EXPERT_TP_DIMS[name]


def _dense_index_grads(experts: int, step: int, d: int) -> dict[str, torch.Tensor]:
    """The full gradients of data-parallel index ``d`` (every TP rank of it sees the same tokens),
    expert 1 of every stack zero at step 1."""
    g = integer_grads({n: tuple(p.shape) for n, p in TitanToy(experts).named_parameters()}, step=step, rank=d)
    for n in STACKS:
        if step == 1:
            g[n][min(1, experts - 1)].zero_()
    return g


def _grads(world: int, ep: int, experts: int, step: int, rank: int, tp: int = 1) -> dict[str, torch.Tensor]:
    """What rank ``rank`` injects: full shapes, EP-local stacks (EP rank ``rank % ep``'s experts).
    ``tp`` > 1: the dense gradients are the data-parallel index's (``rank // tp``, the same on
    every TP rank), cut to the TP-local piece (:data:`TP_DIMS`); the stacks stay the rank's own
    (EP borrows TP's ranks: each routes its own tokens); ``ep`` 1 beside ``tp`` (experts TP-cut):
    the stacks too are the data-parallel index's, cut to the TP-local piece."""
    shapes = {n: tuple(p.shape) for n, p in TitanToy(experts).named_parameters()}
    g = integer_grads(shapes, step=step, rank=rank)
    if tp > 1:
        dense = _dense_index_grads(experts, step, rank // tp)
        for n, dim in TP_DIMS.items():
            g[n] = dense[n] if dim is None else dense[n].chunk(tp, dim)[rank % tp].contiguous()
        if ep == 1:
            return g | {n: dense[n].chunk(tp, _expert_tp_dim(n))[rank % tp].contiguous() for n in STACKS}
    for n in STACKS:
        if step == 1:  # expert 1 (the only one of a one-expert stack) routed no token on any rank
            g[n][min(1, experts - 1)].zero_()
        g[n] = g[n].chunk(ep)[rank % ep].clone()
    return g


def _summed(world: int, ep: int, experts: int, step: int, tp: int = 1) -> dict[str, torch.Tensor]:
    """The full gradients the single device sees: dense ones summed over every rank (over every
    data-parallel index under TP), expert ``e`` over every rank of the EP index holding it (rank =
    (replica * efsdp + efsdp index) * ep + EP index: under HSDP the replicas' all-reduce sums it
    over them too); with experts TP-cut (tp > 1, ep 1) the stacks like the dense parameters."""
    per = [_grads(world, ep, experts, step, r) for r in range(world)]
    out = {n: sum((g[n] for g in per[1:]), per[0][n].clone()) for n in per[0] if n not in STACKS}
    if tp > 1:
        dense = [_dense_index_grads(experts, step, d) for d in range(world // tp)]
        out |= {n: sum((g[n] for g in dense[1:]), dense[0][n].clone()) for n in TP_DIMS}
        if ep == 1:  # experts TP-cut: summed over the data-parallel indices like the dense parameters
            return out | {n: sum((g[n] for g in dense[1:]), dense[0][n].clone()) for n in STACKS}
    for n in STACKS:
        parts = [sum((per[i * ep + j][n] for i in range(1, world // ep)), per[j][n].clone()) for j in range(ep)]
        out[n] = torch.cat(parts)
    return out


def _reference(world: int, ep: int, experts: int, tp: int = 1) -> TaskReference:
    from canzona.optim import Muon

    model = TitanToy(experts)
    ref = TaskReference(model, module_roles(model), Muon, MKW, torch.optim.AdamW, EKW)
    for s in range(STEPS):
        ref.step(_summed(world, ep, experts, s, tp))
    return ref


def _optimizer(model: nn.Module, mesh: Any, strategy: str = "lb-asc", **kw: Any) -> Any:
    import canzona

    return canzona.DistributedOptimizer(model, "muon", strategy=strategy, mesh=mesh, optimizer_kwargs=MKW, elementwise_kwargs=EKW, **kw)


def _train(rank: int, key: str) -> dict[str, Any]:
    world, ep, experts, strategy = CASES[key]
    model, mesh = _titan(world, ep, experts, replicate=_replicate(key), tp=_tp(key))
    if key.endswith("-titan"):  # torchtitan's optimizer container, the mesh read from the parameters
        from canzona.torchtitan import CanzonaOptimizers

        stepper = CanzonaOptimizers(CanzonaOptimizers.Config(name="muon", strategy=strategy, optimizer_kwargs=dict(MKW),
                                                             elementwise_kwargs=dict(EKW)), model_parts=[model])
        opt = stepper.optimizer
    else:
        stepper = opt = _optimizer(model, mesh, strategy, exchange=_exchange(key))
    placements = {n: repr(tuple(p.placements)) for n, p in model.named_parameters()}
    for s in range(STEPS):
        model(_grads(world, ep, experts, s, rank, _tp(key))).backward()
        stepper.step()
        stepper.zero_grad()
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    doc = opt.consolidated_state_dict()
    out: dict[str, Any] = {"params": params, "placements": placements, "hosted": sorted(opt.runtime.engine.hosted),
                           "local_experts": len(opt.runtime.expert_masters),
                           "split": opt.runtime.engine.split, "nan": _nan_refused(rank, model, opt, key)}
    if rank == 0:
        out["state"] = {n: {k: v for k, v in st.items() if torch.is_tensor(v)} for n, st in doc["state"].items()}
    return out


def _nan_refused(rank: int, model: nn.Module, opt: Any, key: str) -> dict[str, Any]:
    """A NaN in expert 1 of the first stack, on rank 0's injected gradient: refused on every rank."""
    world, ep, experts, _ = CASES[key]
    before = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
    g = _grads(world, ep, experts, STEPS, rank, _tp(key))
    if rank == 0:
        g[STACKS[0]][min(1, g[STACKS[0]].shape[0] - 1)][0, 0] = float("nan")
    model(g).backward()
    try:
        opt.step()
        msg = "stepped"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        msg = f"{type(exc).__name__}: {exc}"
    opt.zero_grad()
    same = all(torch.equal(_local(p).detach(), before[n]) for n, p in model.named_parameters())
    return {"error": msg, "unchanged": same}


def _across_layouts(rank: int, saving: str, loading: str) -> dict[str, Any]:
    """The consolidated state of ``cut2x2`` (efsdp 2 x ep 2, exchange ``saving``) loaded into
    ``cut4`` (ep 1, four ranks cut each expert, exchange ``loading``); both then take the same step
    and must agree bit for bit."""
    import torch.distributed as dist

    world, _, experts, _ = CASES["cut2x2"]
    src, smesh = _titan(world, 2, experts)
    sopt = _optimizer(src, smesh, exchange=saving)
    src(_grads(world, 2, experts, 0, rank)).backward()
    sopt.step()
    sopt.zero_grad()
    saved = sopt.consolidated_state_dict()  # collective; the document on rank 0
    doc = [saved if rank == 0 else None]
    dist.broadcast_object_list(doc, src=0)
    dst, dmesh = _titan(world, 1, experts, seed=5)  # other values: the load must bring the saved ones
    dopt = _optimizer(dst, dmesh, exchange=loading)
    dopt.load_state_dict(doc[0])
    full = _summed(world, 2, experts, 1)
    src(_one_rank_holds(full, 2, rank)).backward()
    dst(_one_rank_holds(full, 1, rank)).backward()
    sopt.step()
    dopt.step()
    a = {n: p.full_tensor() for n, p in src.named_parameters()}
    b = {n: p.full_tensor() for n, p in dst.named_parameters()}
    sd, dd = sopt.consolidated_state_dict(), dopt.consolidated_state_dict()
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    if rank == 0:
        bad += [f"state {n}.{k}" for n, st in sd["state"].items() for k, v in st.items()
                if torch.is_tensor(v) and not torch.equal(v, dd["state"][n][k])]
    return {"bad": bad, "split": [sopt.runtime.engine.split, dopt.runtime.engine.split]}


def _one_rank_holds(full: Mapping[str, torch.Tensor], ep: int, rank: int) -> dict[str, torch.Tensor]:
    """Injected gradients whose sum over the ranks is ``full`` under any ``ep``: rank 0 injects the
    dense gradients, EP rank ``j`` of efsdp index 0 its EP-local stacks, every other rank zeros."""
    out = {}
    for n, g in full.items():
        if n in STACKS:
            out[n] = g.chunk(ep)[rank].clone() if rank < ep else torch.zeros_like(g.chunk(ep)[0])
        else:
            out[n] = g.clone() if rank == 0 else torch.zeros_like(g)
    return out


#: the layouts of a two-expert model at world 4 the sharded (DCP) checkpoints cross: name -> (ep,
#: dp_replicate, exchange). ``cut2x2`` and ``cut4`` cut each expert by its shard (``Shard(1)``; the
#: ``-ns`` ones under Muon's split step), ``hsdp2-ep2`` (dp_replicate 2 x (efsdp 1 x ep 2)) holds
#: whole experts, one per rank: at world 4 torchtitan cuts a two-expert stack in every layout
#: without HSDP (a rank's EP share of one expert is less than its efsdp degree)
SHARDED_LAYOUTS: dict[str, tuple[int, int, str]] = {
    "cut2x2": (2, 1, "gradients"),
    "cut4": (1, 1, "gradients"),
    "cut2x2-ns": (2, 1, "ns-input"),
    "cut4-ns": (1, 1, "ns-input"),
    "hsdp2-ep2": (2, 2, "gradients"),
}
#: the chains of sharded saves and loads: (saver, ((loader, form), ...)). Form ``"dcp"`` is
#: ``save_sharded`` / ``load_sharded``, ``"stateful"`` ``dcp.save({"optim": opt})`` / ``dcp.load``.
#: The first chain's saver is ``cut2x2`` after one step, each later one the ``"dcp"`` loader of its
#: name in the chain before (after that chain's next step): cut into cut (other efsdp x ep, other
#: exchange), cut into whole, whole into cut, split-step regions into whole
SHARDED_CHAINS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("cut2x2", (("cut4", "dcp"), ("hsdp2-ep2", "dcp"), ("hsdp2-ep2", "stateful"), ("cut4-ns", "stateful"))),
    ("hsdp2-ep2", (("cut2x2-ns", "dcp"), ("cut4", "stateful"))),
    ("cut2x2-ns", (("hsdp2-ep2", "dcp"),)),
)


def _built(key: str, seed: int) -> tuple[nn.Module, Any]:
    """One of :data:`SHARDED_LAYOUTS` (two experts, world 4) and its optimizer."""
    ep, replicate, exchange = SHARDED_LAYOUTS[key]
    model, mesh = _titan(4, ep, 2, seed=seed, replicate=replicate)
    return model, _optimizer(model, mesh, exchange=exchange)


def _next_step_differences(rank: int, runs: list[tuple[str, nn.Module, Any]], step: int) -> dict[str, list[str]]:
    """Every run takes the same step (the summed gradients of ``step``, whatever its layout); what
    differs from the first run afterwards, per run: parameters and every state tensor."""
    full = _summed(4, 2, 2, step)
    for key, model, opt in runs:
        model(_one_rank_holds(full, SHARDED_LAYOUTS[key][0], rank)).backward()
        opt.step()
        opt.zero_grad()
    params = [{n: p.full_tensor() for n, p in model.named_parameters()} for _, model, _ in runs]
    docs = [opt.consolidated_state_dict() for _, _, opt in runs]  # collective; the documents on rank 0
    out = {}
    for i, (key, _, _) in enumerate(runs[1:], 1):
        bad = [n for n in params[0] if not torch.equal(params[0][n], params[i][n])]
        if rank == 0:
            a, b = docs[0]["state"], docs[i]["state"]
            bad += [f"state {n}" for n in a if set(a[n]) != set(b.get(n, {}))]
            bad += [f"state {n}.{k}" for n, st in a.items() for k, v in st.items()
                    if torch.is_tensor(v) and k in b.get(n, {}) and not torch.equal(v, b[n][k])]
        out[f"{i}:{key}"] = bad
    return out


def _sharded_across_layouts(rank: int) -> dict[str, Any]:
    """Sharded checkpoints of a two-expert model across its layouts, along :data:`SHARDED_CHAINS`:
    after each chain's loads, saver and loaders take the same next step and must agree bit for bit
    (every parameter, every state tensor). Then the first chain's checkpoints are loaded into a
    four-expert model (:func:`_other_model_refused`) and a flipped byte inside a stored cut expert
    is refused (:func:`_flipped_expert_byte`). The directories live in one temporary folder that
    rank 0 makes and removes."""
    import shutil
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.dcp import load_sharded, save_sharded

    box = [tempfile.mkdtemp(prefix="canzona-fsdp2-ep-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    folder = box[0]
    try:
        model, opt = _built("cut2x2", 0)
        model(_grads(4, 2, 2, 0, rank)).backward()
        opt.step()
        opt.zero_grad()
        saver = ("cut2x2", model, opt)
        out: dict[str, Any] = {"chains": [], "layouts": {}}
        for c, (name, loaders) in enumerate(SHARDED_CHAINS):
            assert saver[0] == name, (saver[0], name)
            forms = {form for _, form in loaders} | ({"dcp", "stateful"} if c == 0 else set())  # the refusals read chain 0's
            if "dcp" in forms:
                save_sharded(saver[2], f"{folder}/{c}.dcp")
            if "stateful" in forms:
                dcp.save({"optim": saver[2]}, checkpoint_id=f"{folder}/{c}.stateful")
            runs = [saver]
            for i, (key, form) in enumerate(loaders):
                model, opt = _built(key, 10 * c + i + 1)  # other values: the load must bring the saved ones
                if form == "dcp":
                    load_sharded(opt, f"{folder}/{c}.dcp")
                else:
                    dcp.load({"optim": opt}, checkpoint_id=f"{folder}/{c}.stateful")
                runs.append((key, model, opt))
            out["chains"].append(_next_step_differences(rank, runs, c + 1))
            for key, model, opt in runs:
                out["layouts"][key] = (repr(tuple(dict(model.named_parameters())[STACKS[0]].placements)), len(opt.runtime.expert_masters),
                                       len([t for t in opt.runtime.engine.hosted if t.startswith(PREFIX)]), opt.runtime.engine.split)
            if c + 1 < len(SHARDED_CHAINS):
                saver = next(r for r, (_, form) in zip(runs[1:], loaders) if r[0] == SHARDED_CHAINS[c + 1][0] and form == "dcp")
        out["other_model"] = _other_model_refused(f"{folder}/0")
        out["flipped"] = _flipped_expert_byte(rank, f"{folder}/0.dcp", runs[-1][2])
        return out
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


def _other_model_refused(path: str) -> dict[str, Any]:
    """The two-expert checkpoints (``path.dcp``, ``path.stateful``) loaded into a four-expert model
    (``ep2x2``): ``load_sharded`` refuses it in one line; ``dcp.load`` of the Stateful form fails in
    torch's own planner (a size mismatch, a ``CheckpointException`` on every rank) before it reads
    anything or calls ``load_state_dict``. Either way nothing changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from canzona.runtime.dcp import load_sharded
    from harness import held_snapshot, load_refused, tensors_equal

    model, mesh = _titan(4, 2, 4, seed=30)
    opt = _optimizer(model, mesh)
    out: dict[str, Any] = {"dcp": load_refused(opt, lambda o: load_sharded(o, f"{path}.dcp"))}
    before = held_snapshot(opt)
    try:
        dcp.load({"optim": opt}, checkpoint_id=f"{path}.stateful")
        msg = "loaded"
    except CheckpointException as exc:  # a BaseException: attempt() would not catch it
        msg = f"{type(exc).__name__}: {exc}"
    out["stateful"] = {"error": msg, "untouched": tensors_equal(before, held_snapshot(opt)) == []}
    return out


def _flipped_expert_byte(rank: int, path: str, opt: Any) -> dict[str, Any]:
    """Rank 0 flips one byte inside the stored master of expert 1 of the first stack (a chunk a
    cut expert's host wrote); loading the directory into ``opt`` must be refused on every rank,
    nothing changed."""
    import torch.distributed as dist

    from canzona.runtime import dcp_files
    from canzona.runtime.dcp import load_sharded
    from harness import load_refused

    if rank == 0:
        md = dcp_files.read_metadata(path)
        key = f"optim.{STACKS[0]}.master"
        idx, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == key and tuple(i.offset)[0] == 1)
        with open(f"{path}/{info.relative_path}", "r+b") as f:
            f.seek(int(info.offset) + int(info.length) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    dist.barrier()
    return load_refused(opt, lambda o: load_sharded(o, path))


def _refusals(rank: int) -> dict[str, Any]:
    """One line each: exchange='ns-input' with cut experts and an optimizer without a split step
    (Shampoo); beside HSDP an expert mesh over the whole world (not one replica's ranks); an expert
    mesh that carries TP's dimension (experts cut by TP beside expert parallelism); on the dense
    mesh, experts split on their expert dim by TP (``Shard(0)`` on ``tp``) and experts cut by their
    shard but replicated over ``tp``. And exchange='auto' with cut experts takes Muon's split step."""
    import canzona
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict[str, Any] = {}
    model, mesh = _titan(4, 2, 2)
    out["ns-input"] = _message(lambda: canzona.DistributedOptimizer(model, "shampoo", mesh=mesh, exchange="ns-input"))
    model, mesh = _titan(4, 2, 2)
    out["auto"] = _optimizer(model, mesh, exchange="auto").runtime.engine.split
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    toy = TitanToy(4)
    inner = toy.layers["0"].moe.routed_experts.inner_experts
    for n in ("w1", "w2"):
        setattr(inner, n, nn.Parameter(distribute_tensor(getattr(inner, n).detach(), sparse["ep"], [Shard(0)])))
    fully_shard(inner, mesh=sparse["efsdp"])
    fully_shard(toy, mesh=hsdp)
    out["hsdp"] = _message(lambda: _optimizer(toy, hsdp))
    out["tp"] = _message(lambda: _optimizer(*_beside_tp()))
    out["tp-span"] = _message(lambda: _optimizer(*_beside_tp("span")))
    out["tp-expert-dim"] = _message(lambda: _optimizer(*_beside_tp("expert-dim")))
    out["tp-replicated-cut"] = _message(lambda: _optimizer(*_beside_tp("replicated-cut")))
    return out


def _beside_tp(kind: str = "etp") -> tuple[nn.Module, Any]:
    """The toy's dense parameters ``Replicate`` on ``tp`` of ``("dp_shard", "tp")``, its experts
    (``kind``) ``"etp"``: on an expert mesh that carries ``tp`` too, ``("efsdp", "ep", "tp")`` with
    ``Shard(0)`` on ``ep`` and ``Shard(1)`` on ``tp`` (expert tensor parallelism, not what
    torchtitan 0.3.0 builds); ``"span"``: on ``("efsdp", "ep")`` over one dp_shard index's TP
    ranks (half the world, not the shard group); on the dense mesh, then ``fully_shard`` on
    ``dp_shard`` like the rest: ``"expert-dim"``: ``Shard(0)`` on ``tp`` (TP splitting the expert
    dim, which torchtitan does not; its colwise/rowwise experts are served, ``tp2-etp``),
    ``"replicated-cut"``: ``Replicate`` on ``tp``, ``Shard(1)`` on ``dp_shard``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    if kind == "etp":
        sparse = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("efsdp", "ep", "tp"))
        on_ep, pl_ep = sparse["ep", "tp"], [Shard(0), Shard(1)]
    elif kind == "span":  # ranks (0, 1) and (2, 3): each expert mesh one dp_shard index's TP ranks
        sparse = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("half", "efsdp", "ep"))
        on_ep, pl_ep = sparse["ep"], [Shard(0)]
    else:
        on_ep, pl_ep = mesh["tp"], [Shard(0) if kind == "expert-dim" else Replicate()]
    toy = TitanToy(4)
    for m in list(toy.modules()):
        for n, p in list(m.named_parameters(recurse=False)):
            on, pl = (on_ep, pl_ep) if p.dim() == 3 else (mesh["tp"], [Replicate()])
            setattr(m, n, nn.Parameter(distribute_tensor(p.detach(), on, pl)))
    if kind in ("etp", "span"):
        fully_shard(toy.layers["0"].moe.routed_experts.inner_experts, mesh=sparse["efsdp"])
    rows = (lambda p: Shard(1) if p.dim() == 3 else None) if kind == "replicated-cut" else None
    fully_shard(toy, mesh=mesh["dp_shard"], shard_placement_fn=rows)
    return toy, mesh


def _message(fn: Any) -> str:
    try:
        fn()
        return "accepted"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"


def worker(rank: int, world: int) -> bytes:
    out: dict[str, Any] = {"train": {k: attempt(_train, rank, k) for k, c in CASES.items() if c[0] == world}}
    if world == 4:
        out["across"] = {ex: attempt(_across_layouts, rank, *ex) for ex in ACROSS}
        out["sharded"] = {None: attempt(_sharded_across_layouts, rank)}
        out["refused"] = {None: attempt(_refusals, rank)}
    return pack(out)


_RUNS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    if world not in _RUNS:
        _RUNS[world] = [unpack(r) for r in run_workers(worker, world, timeout_s=300)]
    return _RUNS[world]


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_fsdp2_experts_match_single_device(key: str) -> None:
    world, ep, experts, _ = CASES[key]
    res = case_results(_results(world), "train", key)
    ref = _reference(world, ep, experts, _tp(key))
    want = ref.params()
    cut = experts < world
    for r in res:
        bad = [n for n in want if not torch.equal(r["params"][n], want[n])]
        assert bad == [], (key, bad)
        if not cut:  # whole experts: updated where they live, never exchanged
            assert r["local_experts"] > 0 and not [t for t in r["hosted"] if t.startswith(PREFIX)], (key, r["hosted"])
        else:
            assert r["local_experts"] == 0, (key, r["local_experts"])
        assert r["split"] == (_exchange(key) == "ns-input"), (key, r["split"])
        nan = r["nan"]  # rank 0 (EP rank 0) put it in its local expert 1 (or its only one)
        assert nan["unchanged"] and "non-finite gradient in" in nan["error"], (key, nan)
        assert f"{STACKS[0]} (expert {min(1, experts // ep - 1)})" in nan["error"] and "\n" not in nan["error"], (key, nan)
    expect = "Shard(dim=1)" if cut else ("_StridedShard" if world // ep > 1 else "Shard(dim=0)")
    assert expect in res[0]["placements"][STACKS[0]], (key, res[0]["placements"])
    assert res[0]["placements"][STACKS[0]].startswith("(Replicate()") == (_replicate(key) > 1), (key, res[0]["placements"])
    if _tp(key) > 1:  # the dense parameters are TP-cut beside the expert mesh, the experts are not
        assert res[0]["placements"]["layers.0.attention.wq"].endswith(", Shard(dim=0))"), (key, res[0]["placements"])
        assert res[0]["placements"]["norm.weight"].endswith(", Replicate())"), (key, res[0]["placements"])
        for n in STACKS:  # ep 1: TP cuts the experts (colwise w1, rowwise w2), fully_shard's dim 0 (or 1) on top
            tail = f", Shard(dim={_expert_tp_dim(n)}))" if ep == 1 else ", Shard(dim=0))"
            assert res[0]["placements"][n].endswith(tail), (key, n, res[0]["placements"][n])
    state = res[0]["state"]
    for n in STACKS:
        for e, m in enumerate(ref.momentum(n)):
            assert torch.equal(state[n]["momentum_buffer"][e], m), (key, n, e)


@pytest.mark.slow
def test_cut_experts_are_hosted_once_each() -> None:
    """Every expert of a cut stack is one hosted task on exactly one rank (lb-asc)."""
    for key in ("cut1", "cut2x2", "cut4", "cut1-ns", "cut2x2-ns", "tp2-cut2x2", "tp2-etp", "tp2-etp1", "tp2-etp-ns", "tp2-etp-titan"):  # lb-asc: one host each
        world, _, experts, _ = CASES[key]
        res = case_results(_results(world), "train", key)
        hosted = sorted(t for r in res for t in r["hosted"] if t.startswith(PREFIX))
        assert hosted == sorted(f"{n}[{e}]" for n in STACKS for e in range(experts)), (key, hosted)


@pytest.mark.slow
@pytest.mark.parametrize("exchanges", ACROSS, ids=[f"{a}-to-{b}" for a, b in ACROSS])
def test_checkpoint_of_cut_experts_loads_into_another_layout(exchanges: tuple[str, str]) -> None:
    for r in case_results(_results(4), "across", exchanges):
        assert r["bad"] == [], (exchanges, r["bad"])
        assert r["split"] == [ex == "ns-input" for ex in exchanges], (exchanges, r["split"])


@pytest.mark.slow
def test_sharded_checkpoints_of_experts_cross_cut_and_whole_layouts() -> None:
    for r in case_results(_results(4), "sharded"):
        for (_, loaders), got in zip(SHARDED_CHAINS, r["chains"], strict=True):
            assert list(got) == [f"{i}:{key}" for i, (key, _) in enumerate(loaders, 1)], got
            assert all(v == [] for v in got.values()), got
        for key, (placements, local, hosted, split) in r["layouts"].items():  # what each layout really is
            cut = key.startswith("cut")
            assert ("Shard(dim=1)" in placements) == cut and (local == 0) == cut and (cut or hosted == 0), (key, r["layouts"][key])
            assert split == key.endswith("-ns"), (key, split)
        other = r["other_model"]  # another model's checkpoint (four experts, not two)
        assert other["dcp"]["error"] == "layers.0.moe.router.gate: checkpoint holds shape [2, 8], the model [4, 8]", other["dcp"]
        assert "Size mismatch" in other["stateful"]["error"], other["stateful"]["error"][:300]
        assert other["dcp"]["untouched"] and other["stateful"]["untouched"], other
        flip = r["flipped"]
        assert "fails its checksum" in flip["error"] and "\n" not in flip["error"] and flip["untouched"], flip


@pytest.mark.slow
def test_unserved_expert_layouts_are_refused_in_one_line() -> None:
    for r in case_results(_results(4), "refused"):
        assert "exchange='ns-input' needs a matrix optimizer" in r["ns-input"] and "\n" not in r["ns-input"], r["ns-input"]
        assert r["auto"] is True, r["auto"]
        assert "not the shard groups" in r["hsdp"] and "dp_replicate" in r["hsdp"] and "\n" not in r["hsdp"], r["hsdp"]
        assert "efsdp x ep = dp_shard x tp" in r["tp-span"] and "not the shard groups" in r["tp-span"] and "\n" not in r["tp-span"], r["tp-span"]
        for k, want in (("tp-expert-dim", "splits the stack on its expert dimension by TP"), ("tp-replicated-cut", "replicated over tp")):
            assert want in r[k] and "\n" not in r[k], (k, r[k])
        assert "expert tensor parallelism" in r["tp"] and "('efsdp', 'ep') spanning TP's ranks" in r["tp"] and "\n" not in r["tp"], r["tp"]
