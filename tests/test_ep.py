"""Expert parallelism on canzona's ZeRO-1 path, bitwise against the single-device optimizer.

A small model (an embedding, a router, a projection with bias, a norm, two ``(E, M, N)`` expert
stacks of 4 experts) with its stacks sharded as torchtitan shards them: a DTensor with
``Shard(0)`` on the mesh's ``ep`` dimension. ``("ep",)`` at world 2 (each rank updates its own two
experts alone) and ``("dp", "ep")`` at world 4 (each pair of ranks holding the same experts splits
them). Gradients are injected integers: every rank r has a full-model gradient G_r; the dense
parameters receive G_r, an expert holder receives the sum over its EP group of G_r restricted to
its experts (what the dispatch all-to-all's backward delivers). The reference is the
single-device optimizer applied to every matrix task alone with the mean of all G_r. Checked with
``torch.equal``: every parameter, every expert's Muon momentum (each held by exactly one rank),
a step where one expert got no tokens (a zero gradient), a NaN in one expert refused on every
rank naming the parameter and the expert with nothing changed (and the next step still exact),
accumulation in no_sync(), clip_grad_norm_ (within the split-parameter bound of torch's norm,
the clipped step bitwise), checkpoints across layouts, and layout mistakes refused in one line.
Beside tensor parallelism, in the world-4 spawn: ``("ep", "tp") = (2, 2)``, ``("dp", "ep", "tp")
= (1, 2, 2)`` (experts on ``("ep", "tp")``, Replicate on ``tp``) and ``(2, 2, 1)``, the dense layers
TP'd with ``parallelize_module``; each data rank's gradient is seen by all its TP ranks (a TP
shard of it, and equal copies of the expert sums), and the same checks hold, plus the checkpoint
round trip to plain ZeRO-1 x TP, clipping, and what is not served (some stacks TP-cut and others
not, another order of the mesh dimensions) refused in one line. Expert tensor parallelism (ETP,
torchtitan's): ``("ep", "tp") = (2, 2)`` (and ``("dp", "ep", "tp") = (1, 2, 2)``) with every stack ``(Shard(0), Shard(d))``, ``gate_up_proj``
cut on its rows and ``down_proj`` on its columns: each TP rank receives its shard of the EP
group's sum, every expert is assembled whole on one TP host, and the same checks hold (every
expert's momentum held once, on its host), with clipping and checkpoints to plain ZeRO-1 x TP and
back. One spawn per world size.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from canzona.runtime.launch import run_workers
from canzona.specs import module_roles
from harness import consolidated_on_every_rank
from moe_models import Experts, TaskReference
from validation.harness import integer_grads, mean_grads, pack, unpack

pytestmark = pytest.mark.slow

MKW = {"lr": 0.05, "adjust_lr_fn": "spectral"}
EKW = {"lr": 0.01, "weight_decay": 0.1}
STEPS = 3
IDLE_EXPERT = 2  # global expert routed no token at step 1
NAN_EXPERT = 3  # global expert of experts.down_proj with a NaN gradient
STACKS = ("experts.gate_up_proj", "experts.down_proj")
E = 4
#: the dim each stack is cut on over tp under expert tensor parallelism (rows of gate_up, columns of down)
ETP_DIM = {"experts.gate_up_proj": 1, "experts.down_proj": 2}


class EPToy(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(16, 8)
        self.gate = nn.Linear(8, E, bias=False)
        self.experts = Experts(E, 8, 6)
        self.proj = nn.Linear(8, 10)
        self.norm = nn.LayerNorm(10)


def _shard_experts(model: nn.Module, mesh, ep_rank: int, ep: int, placement=None, on_ep_tp: bool = False,
                   etp: bool = False) -> None:
    """Each stack ``Shard(0)`` on the mesh's ``ep`` sub-mesh (``on_ep_tp``: on ``("ep", "tp")``,
    Replicate on ``tp``; ``etp``: on ``("ep", "tp")``, cut over ``tp`` on :data:`ETP_DIM`;
    ``placement``: a mistake, on ``ep`` or, with ``on_ep_tp``, on ``tp``, for ``down_proj`` only
    when ``etp``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    on_ep_tp = on_ep_tp or etp
    ep_mesh = mesh if mesh.ndim == 1 else mesh["ep", "tp"] if on_ep_tp else mesh["ep"]
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(model.experts, name).detach()
        local = full.chunk(ep)[ep_rank].clone()
        if etp and (placement is None or name == "gate_up_proj"):
            d = ETP_DIM[f"experts.{name}"]
            local = local.chunk(mesh["tp"].size(), dim=d)[mesh.get_local_rank("tp")].clone()
            setattr(model.experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0), Shard(d)], run_check=False)))
            continue
        if on_ep_tp:
            tp_pl = Replicate() if placement is None else placement
            if isinstance(placement, Shard):  # a layout mistake: each rank's experts TP-cut too
                local = local.chunk(mesh["tp"].size(), dim=placement.dim)[mesh.get_local_rank("tp")].clone()
            setattr(model.experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0), tp_pl], run_check=False)))
            continue
        if placement is not None:  # a layout mistake: cut each expert instead of the stack
            local = full.chunk(ep, dim=1)[ep_rank].clone()
        setattr(model.experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [placement or Shard(0)], run_check=False)))


def _parallelize_dense(model: nn.Module, mesh) -> None:
    """The dense layers TP'd as ``parallelize_module`` does it on the mesh's ``tp`` dimension:
    ``proj`` column-wise (weight and bias ``Shard(0)``), the router ``gate`` row-wise (``Shard(1)``);
    the embedding and the norm stay plain tensors, replicated."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh["tp"], {"proj": ColwiseParallel(), "gate": RowwiseParallel()})


def _tp_slice(p, full: torch.Tensor) -> torch.Tensor:
    """This rank's TP-local slice of a dense parameter's full tensor (the whole tensor when plain)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return full
    (pl,) = p.placements
    if not isinstance(pl, Shard):
        return full
    return full.chunk(p.device_mesh.size(), dim=pl.dim)[p.device_mesh.get_local_rank()]


def _all_grads(world: int, step: int, nan: bool = False) -> list[dict[str, torch.Tensor]]:
    shapes = {n: tuple(p.shape) for n, p in EPToy().named_parameters()}
    out = [integer_grads(shapes, step=step, rank=r) for r in range(world)]
    for g in out:
        if step == 1:
            for n in STACKS:
                g[n][IDLE_EXPERT].zero_()
        if nan:
            g["experts.down_proj"][NAN_EXPERT, 1, 2] = float("nan")
    return out


def _local_grads(per_rank: list[dict], rank: int, dp: int, ep: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` (row-major (dp, ep)) receives: its own dense gradient; for its experts
    the sum over the ranks of its EP group (same dp coordinate) of their gradients there."""
    d, e = divmod(rank, ep)
    g = {n: t.clone() for n, t in per_rank[rank].items() if n not in STACKS}
    for n in STACKS:
        acc = torch.zeros_like(per_rank[0][n].chunk(ep)[e])
        for e2 in range(ep):
            acc += per_rank[d * ep + e2][n].chunk(ep)[e]
        g[n] = acc
    return g


def _expert_state(opt, ep_rank: int) -> dict[str, torch.Tensor]:
    """Every expert momentum this rank holds, by global expert: of its own whole experts, and under
    ETP of the experts its TP engine hosts (each assembled whole there)."""
    from canzona.specs import split_task_name

    rt = opt.runtime.experts
    out = {}
    for pc, m in rt.masters.items():
        st = rt.matrix_opt.state.get(m, {}) if rt.matrix_opt is not None and pc.role == "matrix" else {}
        if "momentum_buffer" in st:
            out[f"{pc.name}/{ep_rank * (E // opt.ep) + pc.expert}"] = st["momentum_buffer"].clone()
    eng = rt.tp_engine
    if eng is not None and eng.split:  # the split step: each TP shard's momentum lives with the shard
        tp_rank = eng.tp_rank
        for task, m in eng.local_masters.items():
            name, k = split_task_name(task)
            st = eng.optimizer.state.get(m, {})
            if "momentum_buffer" in st:
                out[f"{name}/{ep_rank * (E // opt.ep) + k}/tp{tp_rank}"] = st["momentum_buffer"].clone()
        return out
    for task in eng.hosted if eng is not None else ():
        name, k = split_task_name(task)
        st = eng.optimizer.state.get(eng.masters[task], {})
        if "momentum_buffer" in st:
            out[f"{name}/{ep_rank * (E // opt.ep) + k}"] = st["momentum_buffer"].clone()
    return out


def _etp_slice(n: str, t: torch.Tensor, mesh) -> torch.Tensor:
    """This TP rank's ETP shard of an EP-local stack ``t``."""
    return t.chunk(mesh["tp"].size(), dim=ETP_DIM[n])[mesh.get_local_rank("tp")]


def _inject(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    from validation.harness import inject_grads

    inject_grads(model, grads)


def _train(rank: int, world: int, names: tuple[str, ...], shape: tuple[int, ...], on_ep_tp: bool = False, etp: bool = False,
           exchange: str = "gradients") -> dict:
    """Training against the single-device reference. With a ``tp`` dimension the dense layers are
    TP'd (:func:`_parallelize_dense`) and the experts are whole on every TP rank; the ``dp x ep``
    data ranks (world rank // tp) each draw a gradient, which every TP rank of theirs sees (TP ranks
    share the tokens): a TP shard of it for a TP'd parameter, and for the experts the same sum over
    the EP group on every TP rank (equal copies), or under ``etp`` this TP rank's shard of that
    sum. The reference takes the mean over the data ranks. ``exchange``: the TP engines' exchange
    (``"ns-input"``: the split step, each expert's momentum kept with its TP shards)."""
    import canzona
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.optim import Muon
    from canzona.runtime.agree import NonFiniteGradient

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ep = mesh.size(names.index("ep"))
    tp = mesh.size(names.index("tp")) if "tp" in names else 1
    dp, data = world // ep // tp, rank // tp
    ep_rank = mesh.get_local_rank("ep")
    model = EPToy()
    ref = TaskReference(model, module_roles(model), Muon, MKW, torch.optim.AdamW, EKW)
    _shard_experts(model, mesh, ep_rank, ep, on_ep_tp=on_ep_tp, etp=etp)
    if "tp" in names:
        _parallelize_dense(model, mesh)
    named = dict(model.named_parameters())

    def stack(n: str, t: torch.Tensor) -> torch.Tensor:  # an EP-local stack as this rank holds it
        return _etp_slice(n, t, mesh) if etp else t
    opt = canzona.DistributedOptimizer(model, "muon", mesh=mesh if len(names) > 1 else None, optimizer_kwargs=MKW,
                                       elementwise_kwargs=EKW, bucket_numel=300, exchange=exchange)
    out: dict = {"bad": [], "state": {}}

    def local(n: str, full: torch.Tensor) -> torch.Tensor:
        return stack(n, full.chunk(ep)[ep_rank]) if n in STACKS else _tp_slice(named[n], full)

    def mine(n: str) -> torch.Tensor:
        p = named[n]
        return (p.to_local() if hasattr(p, "to_local") else p).detach()

    def grads(per_rank: list[dict]) -> dict[str, torch.Tensor]:
        g = _local_grads(per_rank, data, dp, ep)
        return {n: stack(n, v) if n in STACKS else _tp_slice(named[n], v) for n, v in g.items()}

    def check(step: int) -> None:
        want = ref.params()
        out["bad"] += [f"step {step}: {n}" for n in named if not torch.equal(mine(n), local(n, want[n]))]

    for s in range(STEPS):
        per_rank = _all_grads(dp * ep, s)
        _inject(model, grads(per_rank))
        opt.step()
        opt.zero_grad()
        ref.step(mean_grads(per_rank))
        check(s)
    # a NaN in one expert: refused on every rank, nothing changed
    before = {n: mine(n).clone() for n in named}
    state_before = _expert_state(opt, ep_rank)
    _inject(model, grads(_all_grads(dp * ep, STEPS, nan=True)))
    try:
        opt.step()
        out["nan"] = "not refused"
    except NonFiniteGradient as exc:
        out["nan"] = str(exc)
    opt.zero_grad()
    out["unchanged"] = all(torch.equal(mine(n), before[n]) for n in named)
    out["state_unchanged"] = all(torch.equal(v, state_before[k]) for k, v in _expert_state(opt, ep_rank).items())
    # the next step is exact again
    per_rank = _all_grads(dp * ep, STEPS + 1)
    _inject(model, grads(per_rank))
    opt.step()
    opt.zero_grad()
    ref.step(mean_grads(per_rank))
    check(STEPS + 1)
    out["state"] = _expert_state(opt, ep_rank)
    out["ref_state"] = {f"{n}/{k}": m for n in STACKS for k, m in enumerate(ref.momentum(n))}
    if etp and exchange == "ns-input":  # shards of each expert's momentum: this TP rank's slice of the reference's
        tp = mesh["tp"].size()
        out["ref_state"] = {f"{key}/tp{t}": m.chunk(tp, dim=ETP_DIM[key.split("/")[0]] - 1)[t]
                            for key, m in out["ref_state"].items() for t in range(tp)}
    out["repr"] = repr(opt)
    out["expert_comm"] = opt.expert_comm.size
    out["dense_comm"] = opt.dense_comm.size
    out["tp_pieces"] = sum(pc.role == "tp" for pc in opt.runtime.dense.pieces)  # TP-split pieces this rank updates
    out["expert_tp_pieces"] = sum(pc.role == "tp" for pc in opt.runtime.experts.pieces)
    return out


def _mistakes(rank: int, world: int) -> dict:
    """Layout mistakes, each refused on every rank with one line."""
    import canzona
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = {}
    cases = {
        "cut_experts": lambda m: _shard_experts(m, mesh, rank, world, placement=Shard(1)),
        "overlap": lambda m: _shard_experts(m, mesh, rank, world),
    }
    for case, prep in cases.items():
        model = EPToy()
        prep(model)
        kw = {"overlap_updates": True} if case == "overlap" else {}
        try:
            canzona.DistributedOptimizer(model, "muon", **kw)
            out[case] = "accepted"
        except (ValueError, TypeError, RuntimeError) as exc:
            out[case] = str(exc)
    from torch.distributed.fsdp import fully_shard

    model = EPToy()
    _shard_experts(model, mesh, rank, world)
    fully_shard(model.proj, mesh=mesh)
    try:
        canzona.DistributedOptimizer(model, "muon")
        out["fsdp2"] = "accepted"
    except (ValueError, TypeError, RuntimeError) as exc:
        out["fsdp2"] = str(exc)
    model = EPToy(seed=rank)  # replicas that start different: the dense parameters are compared
    _shard_experts(model, mesh, rank, world)
    try:
        canzona.DistributedOptimizer(model, "muon")
        out["seeds"] = "accepted"
    except (ValueError, TypeError, RuntimeError) as exc:
        out["seeds"] = str(exc)
    dpmesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = EPToy()
    _shard_experts(model, mesh, rank, world)
    try:
        canzona.DistributedOptimizer(model, "muon", mesh=dpmesh)
        out["dp_mesh"] = "accepted"
    except (ValueError, TypeError, RuntimeError) as exc:
        out["dp_mesh"] = str(exc)
    return out


def _tp_mistakes(rank: int, world: int) -> dict:
    """What expert parallelism beside ``tp`` does not serve, each refused on every rank in one line:
    one stack TP-cut on ``("ep", "tp")`` and the other whole (``mixed``), a stack cut on its expert
    dim over ``tp`` too (``cut_dim0``), an expert stack TP-cut on the ``tp`` sub-mesh, and the mesh
    dimensions in another order."""
    import canzona
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ep_rank = mesh.get_local_rank("ep")

    def mixed(m: nn.Module) -> None:
        from torch.distributed.tensor import Replicate

        _shard_experts(m, mesh, ep_rank, 2, placement=Replicate(), etp=True)

    def cut_dim0(m: nn.Module) -> None:
        _shard_experts(m, mesh, ep_rank, 2, placement=Shard(0), on_ep_tp=True)

    def stack_on_tp(m: nn.Module) -> None:
        _shard_experts(m, mesh, ep_rank, 2)
        full = m.experts.down_proj.full_tensor().detach()
        local = full.chunk(2, dim=1)[mesh.get_local_rank("tp")].clone()
        m.experts.down_proj = nn.Parameter(DTensor.from_local(local, mesh["tp"], [Shard(1)], run_check=False))

    out = {}
    for case, prep, m in (("mixed", mixed, mesh), ("cut_dim0", cut_dim0, mesh), ("stack_on_tp", stack_on_tp, mesh),
                          ("order", None, init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "ep")))):
        model = EPToy()
        if prep is not None:
            prep(model)
        else:
            _shard_experts(model, m, m.get_local_rank("ep"), 2)
        try:
            canzona.DistributedOptimizer(model, "muon", mesh=m)
            out[case] = "accepted"
        except (ValueError, TypeError, RuntimeError) as exc:
            out[case] = str(exc)
    return out


def _extras(rank: int, world: int) -> dict:
    """Gradient accumulation in no_sync (bitwise), describe(), and clip_grad_norm_ followed by
    the step on the clipped gradients."""
    import canzona
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.optim import Muon

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    model = EPToy(seed=1)
    ref = TaskReference(model, module_roles(model), Muon, MKW, torch.optim.AdamW, EKW)
    _shard_experts(model, mesh, rank, world)
    opt = canzona.DistributedOptimizer(model, "muon", optimizer_kwargs=MKW, elementwise_kwargs=EKW, bucket_numel=300)
    a, b = _all_grads(world, 5), _all_grads(world, 6)
    with opt.no_sync():
        _inject(model, _local_grads(a, rank, 1, world))
    _inject(model, _local_grads(b, rank, 1, world))
    opt.step()
    opt.zero_grad()
    ref.step(mean_grads([{n: x[n] + y[n] for n in x} for x, y in zip(a, b)]))
    want = ref.params()
    out = {"no_sync_bad": [n for n, p in model.named_parameters()
                           if not torch.equal((p.to_local() if n in STACKS else p).detach(), want[n].chunk(world)[rank] if n in STACKS else want[n])]}
    out["describe"] = opt.describe()
    # clipping (active: max_norm far below the norm), then the step on the clipped gradients
    per_rank = _all_grads(world, 7)
    _inject(model, _local_grads(per_rank, rank, 1, world))
    total = opt.clip_grad_norm_(0.05)
    opt.step()
    opt.zero_grad()
    mean = mean_grads(per_rank)
    names = [n for n, _ in ref.model.named_parameters()]
    out["torch_total"] = torch.nn.utils.get_total_norm([mean[n] for n in names])
    out["total"] = total
    coef = torch.clamp(0.05 / (total + 1e-6), max=1.0)
    ref.step({n: g * coef for n, g in mean.items()})
    want = ref.params()
    out["clip_bad"] = [n for n, p in model.named_parameters()
                       if not torch.equal((p.to_local() if n in STACKS else p).detach(), want[n].chunk(world)[rank] if n in STACKS else want[n])]
    return out


def _tp_clip(rank: int, world: int, etp: bool = False) -> dict:
    """clip_grad_norm_ under ep 2 x tp 2 (active), then the step on the clipped gradients (``etp``:
    the experts TP-cut, each TP rank's shard counted once)."""
    import canzona
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.optim import Muon

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    ep_rank, data = mesh.get_local_rank("ep"), rank // 2
    model = EPToy(seed=1)
    ref = TaskReference(model, module_roles(model), Muon, MKW, torch.optim.AdamW, EKW)
    _shard_experts(model, mesh, ep_rank, 2, etp=etp)
    _parallelize_dense(model, mesh)
    named = dict(model.named_parameters())

    def stack(n: str, t: torch.Tensor) -> torch.Tensor:
        return _etp_slice(n, t, mesh) if etp else t

    opt = canzona.DistributedOptimizer(model, "muon", mesh=mesh, optimizer_kwargs=MKW, elementwise_kwargs=EKW, bucket_numel=300)
    per_rank = _all_grads(2, 7)
    _inject(model, {n: stack(n, v) if n in STACKS else _tp_slice(named[n], v) for n, v in _local_grads(per_rank, data, 1, 2).items()})
    total = opt.clip_grad_norm_(0.05)
    opt.step()
    mean = mean_grads(per_rank)
    out = {"total": total, "torch_total": torch.nn.utils.get_total_norm([mean[n] for n, _ in ref.model.named_parameters()])}
    coef = torch.clamp(0.05 / (total + 1e-6), max=1.0)
    ref.step({n: g * coef for n, g in mean.items()})
    want = ref.params()
    out["clip_bad"] = [n for n, p in named.items()
                       if not torch.equal(p.to_local().detach() if hasattr(p, "to_local") else p.detach(),
                                          stack(n, want[n].chunk(2)[ep_rank]) if n in STACKS else _tp_slice(p, want[n]))]
    return out


def _full_copy(model: nn.Module, ep: int, tp: int = 1, etp: bool = False) -> nn.Module:
    """A plain model holding the EP model's values (the expert stacks gathered over ``ep``, and
    under ``etp`` over ``tp``; TP'd dense parameters over ``tp``)."""
    import torch.distributed as dist

    full = EPToy()
    named = dict(full.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in STACKS:
                parts = [torch.empty_like(p.to_local()) for _ in range(dist.get_world_size())]
                dist.all_gather(parts, p.to_local().contiguous())
                # row-major (dp, ep, tp): ranks 0, tp, .. (ep-1) tp hold the EP coordinates of dp row 0, TP rank 0
                if etp:  # and ranks e tp .. e tp + tp - 1 the TP shards of EP coordinate e
                    named[n].copy_(torch.cat([torch.cat(parts[e * tp:(e + 1) * tp], dim=ETP_DIM[n]) for e in range(ep)]))
                else:
                    named[n].copy_(torch.cat(parts[: ep * tp : tp]))
            else:
                named[n].copy_(p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach())
    return full


def _checkpoints(rank: int, world: int, names: tuple[str, ...], shape: tuple[int, ...], etp: bool = False) -> dict:
    """A consolidated checkpoint saved under EP loads under plain ZeRO-1, whose own checkpoint
    loads back under EP (into other starting values); the sharded forms saved under EP
    (``save_sharded`` and DCP's Stateful) load under EP and (``load_sharded``) under plain ZeRO-1;
    the next step is bitwise the same on every optimizer."""
    import shutil
    import tempfile
    from pathlib import Path

    import canzona
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.runtime.dcp import load_sharded, save_sharded

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    ep = mesh.size(names.index("ep"))
    tp = mesh.size(names.index("tp")) if "tp" in names else 1
    dp, ep_rank, data = world // ep // tp, mesh.get_local_rank("ep"), rank // tp
    kw = dict(optimizer_kwargs=MKW, elementwise_kwargs=EKW, bucket_numel=300)

    def ep_model(seed: int) -> nn.Module:
        m = EPToy(seed=seed)
        _shard_experts(m, mesh, ep_rank, ep, etp=etp)
        if tp > 1:
            _parallelize_dense(m, mesh)
        return m

    def ep_opt(model: nn.Module):
        return canzona.DistributedOptimizer(model, "muon", mesh=mesh if len(names) > 1 else None, **kw)

    def stack(n: str, t: torch.Tensor) -> torch.Tensor:
        return _etp_slice(n, t, mesh) if etp else t

    def grads(m: nn.Module, per_rank: list[dict]) -> dict[str, torch.Tensor]:
        named = dict(m.named_parameters())
        return {n: stack(n, v) if n in STACKS else _tp_slice(named[n], v) for n, v in _local_grads(per_rank, data, dp, ep).items()}

    model = ep_model(2)
    opt = ep_opt(model)
    for s in range(2):
        _inject(model, grads(model, _all_grads(dp * ep, 10 + s)))
        opt.step()
        opt.zero_grad()
    doc = consolidated_on_every_rank(opt)
    plain = _full_copy(model, ep, tp, etp)
    # plain ZeRO-1 over the dp x ep data ranks (each TP group of ranks a replica with the same gradient)
    pmesh = None if tp == 1 else init_device_mesh("cpu", (dp * ep, tp), mesh_dim_names=("dp", "tp"))
    popt = canzona.DistributedOptimizer(plain, "muon", mesh=pmesh, **kw)
    popt.load_state_dict(doc)
    doc = consolidated_on_every_rank(popt)
    back = ep_model(3)  # other values: the load must bring the saved ones
    bopt = ep_opt(back)
    bopt.load_state_dict(doc)
    # the sharded forms: canzona's own (save_sharded) and DCP's Stateful, saved under EP, loaded
    # under EP (other values) and under the plain layout
    folder = [tempfile.mkdtemp(prefix="canzona-ep-") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    where = Path(folder[0])
    save_sharded(opt, where / "ep.dcp")
    dcp.save({"optim": opt}, checkpoint_id=str(where / "ep.stateful"))
    sharded, stateful = ep_model(4), ep_model(5)
    sopt, topt = ep_opt(sharded), ep_opt(stateful)
    load_sharded(sopt, where / "ep.dcp")
    dcp.load({"optim": topt}, checkpoint_id=str(where / "ep.stateful"))
    plain_sharded = _full_copy(ep_model(6), ep, tp, etp)
    psopt = canzona.DistributedOptimizer(plain_sharded, "muon", mesh=pmesh, **kw)
    load_sharded(psopt, where / "ep.dcp")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(where, ignore_errors=True)
    per_rank = _all_grads(dp * ep, 12)
    for m, o in ((model, opt), (back, bopt), (sharded, sopt), (stateful, topt)):
        _inject(m, grads(m, per_rank))
        o.step()
    for m, o in ((plain, popt), (plain_sharded, psopt)):
        _inject(m, per_rank[data])
        o.step()
    want = dict(plain.named_parameters())
    bad = [f"plain from sharded: {n}" for n, p in plain_sharded.named_parameters() if not torch.equal(p.detach(), want[n].detach())]
    for label, m in (("ep", model), ("loaded back", back), ("sharded", sharded), ("stateful", stateful)):
        for n, p in m.named_parameters():
            mine = p.to_local() if hasattr(p, "to_local") else p
            full = stack(n, want[n].detach().chunk(ep)[ep_rank]) if n in STACKS else _tp_slice(p, want[n].detach())
            if not torch.equal(mine.detach(), full):
                bad.append(f"{label}: {n}")
    return {"bad": bad}


def ep_worker(rank: int, world: int) -> bytes:
    if world == 2:
        out = {"ep": _train(rank, world, ("ep",), (2,)), "mistakes": _mistakes(rank, world), "extras": _extras(rank, world),
               "ckpt": _checkpoints(rank, world, ("ep",), (2,))}
    else:
        out = {"dp_ep": _train(rank, world, ("dp", "ep"), (2, 2)), "ckpt": _checkpoints(rank, world, ("dp", "ep"), (2, 2)),
               "ep_tp": _train(rank, world, ("ep", "tp"), (2, 2)), "ckpt_tp": _checkpoints(rank, world, ("ep", "tp"), (2, 2)),
               "dp_ep_tp": _train(rank, world, ("dp", "ep", "tp"), (1, 2, 2), on_ep_tp=True),
               "dp_ep_tp1": _train(rank, world, ("dp", "ep", "tp"), (2, 2, 1)),
               "tp_mistakes": _tp_mistakes(rank, world), "tp_clip": _tp_clip(rank, world),
               "etp": _train(rank, world, ("ep", "tp"), (2, 2), etp=True),
               "etp_ns": _train(rank, world, ("ep", "tp"), (2, 2), etp=True, exchange="ns-input"),
               "dp_etp": _train(rank, world, ("dp", "ep", "tp"), (1, 2, 2), etp=True), "ckpt_etp": _checkpoints(rank, world, ("ep", "tp"), (2, 2), etp=True),
               "etp_clip": _tp_clip(rank, world, etp=True)}
    return pack(out)


_RUNS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def runs():
    def get(world: int) -> list[dict]:
        if world not in _RUNS:
            _RUNS[world] = [unpack(r) for r in run_workers(ep_worker, world, timeout_s=240)]
        return _RUNS[world]

    return get


CASES = [(2, "ep"), (4, "dp_ep"), (4, "ep_tp"), (4, "dp_ep_tp"), (4, "dp_ep_tp1"), (4, "etp"), (4, "etp_ns"), (4, "dp_etp")]


@pytest.mark.parametrize("world,case", CASES)
def test_every_parameter_bitwise(runs, world: int, case: str) -> None:
    for r, res in enumerate(runs(world)):
        assert res[case]["bad"] == [], f"rank {r}"


@pytest.mark.parametrize("world,case", CASES)
def test_every_expert_state_held_once_and_bitwise(runs, world: int, case: str) -> None:
    held: dict[str, int] = {}
    for res in runs(world):
        for key, m in res[case]["state"].items():
            held[key] = held.get(key, 0) + 1
            assert torch.equal(m, res[case]["ref_state"][key]), key
    # world 2: each rank holds its experts alone; world 4: each expert on one rank of its pair;
    # under the split step (etp_ns) each expert's momentum in two TP shards, each held once
    shards = ("/tp0", "/tp1") if case == "etp_ns" else ("",)
    assert held == {f"{n}/{k}{s}": 1 for n in STACKS for k in range(E) for s in shards}


@pytest.mark.parametrize("world,case", CASES)
def test_nan_in_one_expert_refused_everywhere_naming_it(runs, world: int, case: str) -> None:
    for res in runs(world):
        msg = res[case]["nan"]
        assert f"experts.down_proj (expert {NAN_EXPERT})" in msg and "\n" not in msg, msg
        assert "gate_up_proj" not in msg
        assert res[case]["unchanged"] and res[case]["state_unchanged"]


def test_expert_dp_group_sizes(runs) -> None:
    assert [r["ep"]["expert_comm"] for r in runs(2)] == [1, 1]  # no optimizer communication for experts
    assert [r["dp_ep"]["expert_comm"] for r in runs(4)] == [2, 2, 2, 2]
    assert "layout=ep, dp=2, ep=2" in runs(4)[0]["dp_ep"]["repr"]


@pytest.mark.parametrize("case", ["ep_tp", "dp_ep_tp", "dp_ep_tp1", "etp", "dp_etp"])
def test_groups_beside_tp(runs, case: str) -> None:
    """Dense: ZeRO-1 over the dp x ep ranks of each TP coordinate, TP-split matrices through the TP
    engine; experts: the dp x tp ranks of each EP coordinate, under ETP the dp ranks (here one) of
    each (ep, tp) coordinate, every expert a TP task."""
    res = [r[case] for r in runs(4)]
    tp = 1 if case == "dp_ep_tp1" else 2
    assert [r["dense_comm"] for r in res] == [4 // tp] * 4
    etp = case in ("etp", "dp_etp")
    assert [r["expert_comm"] for r in res] == [1 if etp else 2] * 4
    assert (sum(r["tp_pieces"] for r in res) > 0) == (tp > 1)
    # ETP: each rank holds the TP shard of every local expert (2 stacks x 2 experts)
    assert [r["expert_tp_pieces"] for r in res] == [4 if etp else 0] * 4
    assert f"ep=2, tp={tp}" in res[0]["repr"], res[0]["repr"]
    assert ("etp" in res[0]["repr"]) == etp, res[0]["repr"]


def test_unserved_beside_tp_one_line(runs) -> None:
    for res in runs(4):
        m = res["tp_mistakes"]
        assert m["mixed"].startswith("experts.down_proj: whole on every TP rank while experts.gate_up_proj is TP-cut"), m["mixed"]
        assert "(Shard(0), Shard(1))" in m["cut_dim0"] and m["cut_dim0"].startswith("experts.gate_up_proj:"), m["cut_dim0"]
        assert m["stack_on_tp"].startswith("experts.down_proj:") and "TP-cut on 'tp'" in m["stack_on_tp"], m["stack_on_tp"]
        assert "('tp', 'ep') are not supported" in m["order"] and "('dp', 'ep', 'tp')" in m["order"], m["order"]
        assert all("\n" not in v for v in m.values()), m


def test_layout_mistakes_one_line(runs) -> None:
    for res in runs(2):
        m = res["mistakes"]
        assert "Shard(0) on 'ep'" in m["cut_experts"] and "\n" not in m["cut_experts"], m["cut_experts"]
        assert "overlap_updates" in m["overlap"] and "expert parallelism" in m["overlap"], m["overlap"]
        assert "('dp',)" in m["dp_mesh"] and "supported" in m["dp_mesh"], m["dp_mesh"]
        # an FSDP2 model with ep is the FSDP2 layout's, which wants the mesh it was sharded on
        assert m["fsdp2"].startswith("an FSDP2 model needs mesh=") and "\n" not in m["fsdp2"], m["fsdp2"]
        # each rank holds other experts at ep 2, so only the dense parameters can differ: named, one line
        assert m["seeds"].startswith("parameter values differ across the ranks that hold them at construction: embed.weight"), m["seeds"]
        assert "(EP rank" not in m["seeds"] and "\n" not in m["seeds"], m["seeds"]


def test_no_sync_accumulates_bitwise_and_describe_names_both_parts(runs) -> None:
    for res in runs(2):
        x = res["extras"]
        assert x["no_sync_bad"] == []
        assert "experts.down_proj" in x["describe"] and "over all dp x ep = 2 ranks" in x["describe"] and "EP plan" in x["describe"]


def test_clip_grad_norm_within_the_split_bound_and_the_clipped_step_bitwise(runs) -> None:
    from canzona.runtime.clip import split_bound

    totals = [res["extras"]["total"] for res in runs(2)]
    assert torch.equal(totals[0], totals[1])  # every rank the same total, bit for bit
    x = runs(2)[0]["extras"]
    want = x["torch_total"]
    assert float(want) > 0.05 * 10  # the clip is active
    # each expert stack is split over the two EP ranks (2 pieces); everything else is whole
    bound = split_bound(max(p.numel() for p in EPToy().parameters()), 2, len(list(EPToy().parameters())))
    assert abs(float(x["total"]) - float(want)) <= bound * float(want)
    for res in runs(2):
        assert res["extras"]["clip_bad"] == []


@pytest.mark.parametrize("case", ["tp_clip", "etp_clip"])
def test_clip_grad_norm_beside_tp_within_the_split_bound_and_the_clipped_step_bitwise(runs, case: str) -> None:
    """ep 2 x tp 2: the experts split over EP (and under ETP over TP), the TP'd dense parameters
    over TP; each TP rank's copy of a replicated parameter and of whole experts counted once."""
    from canzona.runtime.clip import split_bound

    res = [r[case] for r in runs(4)]
    assert all(torch.equal(r["total"], res[0]["total"]) for r in res)
    want = res[0]["torch_total"]
    assert float(want) > 0.05 * 10  # the clip is active
    # an expert stack under ETP is in 4 pieces (2 EP x 2 TP)
    bound = split_bound(max(p.numel() for p in EPToy().parameters()), 4 if case == "etp_clip" else 2, len(list(EPToy().parameters())))
    assert abs(float(res[0]["total"]) - float(want)) <= bound * float(want)
    for r in res:
        assert r["clip_bad"] == []


@pytest.mark.parametrize("world,case", [(2, "ckpt"), (4, "ckpt"), (4, "ckpt_tp"), (4, "ckpt_etp")])
def test_checkpoints_cross_layouts_bitwise(runs, world: int, case: str) -> None:
    """World 4 ``ckpt_tp``: saved under ep 2 x tp 2, loaded under plain ZeRO-1 x TP (dp 2 x tp 2)
    and back; the sharded forms too (fails when a TP shard or an expert loses its global offset);
    ``ckpt_etp`` the same with the experts TP-cut (ETP), whose momenta live on their TP hosts."""
    for r, res in enumerate(runs(world)):
        assert res[case]["bad"] == [], f"rank {r}"
