"""The FSDP2 exactness case: a model, its injected gradients, one run and its reference, callable
from any spawned rank (the tests and ``canzona validate``'s FSDP2 cells).

Importing this module has no side effects. :func:`run_fsdp_case` runs on every rank of an
initialized process group:

1. builds :class:`FSDPToy` (odd shapes that FSDP2 pads, a ``1 x n`` matrix whose row lives on
   one rank, tied embedding and head, norms and biases), TP-parallelizes it when the mesh has a
   ``tp`` dimension (DTensor ``Shard(0|1)``; uneven TP chunks too) and shards it with
   ``fully_shard`` (per layer, then the root; HSDP on a ``dp_replicate x dp_shard`` mesh);
2. runs ``steps`` steps of ``canzona.DistributedOptimizer`` with integer-valued gradients
   injected through a real FSDP2 backward (``sum(p * g)``), so FSDP2's reduce-scatter and HSDP's
   all-reduce are exact;
3. on world rank 0, replays the same steps with the single-device optimizers on full tensors
   (:class:`validation.harness.ReferenceRunner`) and compares parameters, fp32 masters and every
   optimizer-state entry with ``torch.equal``.

``model="fsdp-moe"`` runs :class:`FSDPMoEToy` instead: each layer holds an expert stack (4 and 3
experts, non-square), sharded with FSDP2's ``Shard(0)`` so that every rank holds whole experts
(uneven counts too) and updates them where they live; its reference steps each expert alone.

It returns, on every rank, a :class:`FSDPCaseResult`; on rank 0 ``mismatches`` lists what
differs (empty: bitwise equal). Meshes: :data:`FSDP_MESHES` (the four the suite runs); any
mesh with dimensions from ``("dp_replicate", "dp_shard", "tp")`` works.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from validation.harness import ReferenceRunner, integer_grads, mean_grads, tensors_equal

__all__ = [
    "FSDP_MESHES",
    "FSDP_TOY_SHAPES",
    "FSDPCaseResult",
    "FSDPToy",
    "FSDPMoEToy",
    "FSDP_MOE_SHAPES",
    "build_fsdp_toy",
    "compare_with_reference",
    "fsdp_local_grads",
    "fsdp_mesh_worker",
    "fsdp_reference",
    "run_fsdp_case",
]

#: the FSDP2 meshes of the suite: name -> (shape, dimension names)
FSDP_MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "dp_shard2": ((2,), ("dp_shard",)),
    "dp_shard4": ((4,), ("dp_shard",)),
    "dp_shard2_tp2": ((2, 2), ("dp_shard", "tp")),
    "dp_replicate2_dp_shard2": ((2, 2), ("dp_replicate", "dp_shard")),
}

#: name -> (full shape, TP split dim under a ``tp`` mesh: 0/1 = ``Shard(d)``, None = not TP-split)
FSDP_TOY_SHAPES: dict[str, tuple[tuple[int, ...], int | None]] = {
    "embed.weight": ((13, 6), None),  # tied with head.weight; element-wise
    "layers.0.q": ((7, 6), 0),  # uneven under dp 2 x tp 2 (TP chunks 4/3, then FSDP chunks)
    "layers.0.o": ((6, 7), 1),
    "layers.0.norm": ((6,), None),
    "layers.0.bias": ((5,), None),
    "layers.1.up": ((10, 6), 0),
    "layers.1.down": ((6, 10), 1),
    "layers.1.row": ((1, 9), None),  # 1 x n: one rank holds the row, the others empty pieces
    "layers.1.mix": ((9, 5), None),
}


#: :class:`FSDPMoEToy`'s parameters (no TP): an embedding, a matrix, a norm, a router and one
#: non-square expert stack per layer (4 experts: whole pairs at dp_shard 2, one each at dp_shard 4;
#: 3 experts: 2 and 1, then 1, 1, 1 and none)
FSDP_MOE_SHAPES: dict[str, tuple[tuple[int, ...], int | None]] = {
    "embed.weight": ((13, 6), None),
    "layers.0.q": ((7, 6), None),
    "layers.0.norm": ((6,), None),
    "layers.0.experts.gate_up": ((4, 10, 6), None),
    "layers.1.router": ((4, 6), None),
    "layers.1.experts.down": ((3, 6, 5), None),
}
#: model name -> its parameter table
_SHAPES = {"fsdp-toy": FSDP_TOY_SHAPES, "fsdp-moe": FSDP_MOE_SHAPES}


class _Leaf(nn.Module):
    """Parameters whose forward returns ``sum(p * g[name])`` (plus its child leaves'): the gradient
    of ``p`` is ``g`` exactly."""

    def __init__(self, prefix: str, names: list[str], gen: torch.Generator, dtype: torch.dtype,
                 shapes: Mapping[str, tuple[tuple[int, ...], int | None]] = FSDP_TOY_SHAPES) -> None:
        super().__init__()
        self.prefix = prefix
        for n in names:
            shape = shapes[f"{prefix}{n}"][0]
            self.register_parameter(n, nn.Parameter((torch.randn(shape, generator=gen) * 0.5).to(dtype)))

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(())
        for n, p in self.named_parameters(recurse=False):
            key = f"{self.prefix}{n}"
            if key in grads:
                loc = p.to_local() if hasattr(p, "to_local") else p
                total = total + (loc * grads[key].to(loc.dtype)).sum().float()
        for child in self.children():
            total = total + child(grads)
        return total


class FSDPToy(nn.Module):
    """Embedding, two layers of :data:`FSDP_TOY_SHAPES` parameters and a head tied to the
    embedding; ``forward(grads)`` injects ``grads`` (TP-local shapes) as the gradients."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = _Leaf("embed.", ["weight"], g, dtype)
        self.layers = nn.ModuleList(
            [_Leaf("layers.0.", ["q", "o", "norm", "bias"], g, dtype), _Leaf("layers.1.", ["up", "down", "row", "mix"], g, dtype)]
        )
        self.head = nn.Module()
        self.head.weight = self.embed.weight  # tied: named_parameters yields it once, as embed.weight

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.embed(grads) + sum(layer(grads) for layer in self.layers)


class FSDPMoEToy(nn.Module):
    """:data:`FSDP_MOE_SHAPES` as an embedding and two layers, each with an ``experts`` child (3-D
    stacks under a module path containing ``experts``: expert stacks by the default role rule);
    ``forward(grads)`` injects ``grads`` as the gradients."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = _Leaf("embed.", ["weight"], g, dtype, FSDP_MOE_SHAPES)
        self.layers = nn.ModuleList([_Leaf("layers.0.", ["q", "norm"], g, dtype, FSDP_MOE_SHAPES), _Leaf("layers.1.", ["router"], g, dtype, FSDP_MOE_SHAPES)])
        self.layers[0].experts = _Leaf("layers.0.experts.", ["gate_up"], g, dtype, FSDP_MOE_SHAPES)
        self.layers[1].experts = _Leaf("layers.1.experts.", ["down"], g, dtype, FSDP_MOE_SHAPES)

    def forward(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.embed(grads) + sum(layer(grads) for layer in self.layers)


def _new_model(model: str, dtype: torch.dtype) -> nn.Module:
    if model not in _SHAPES:
        raise ValueError(f"unknown FSDP2 model {model!r}; choose one of {', '.join(_SHAPES)}")
    return FSDPToy(dtype) if model == "fsdp-toy" else FSDPMoEToy(dtype)


def build_fsdp_toy(mesh: Any, dtype: torch.dtype = torch.float32, *, mixed_precision: bool = False, model: str = "fsdp-toy") -> nn.Module:
    """:class:`FSDPToy`, TP-parallelized on ``mesh["tp"]`` when present, then ``fully_shard`` per
    layer and at the root on ``dp_shard`` (``dp_replicate x dp_shard`` for HSDP). With
    ``mixed_precision``, FSDP2's ``MixedPrecisionPolicy`` computes in bf16 and reduces in fp32 (the
    sharded parameters stay in ``dtype``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    shapes = _SHAPES[model]
    model = _new_model(model, dtype)
    names = mesh.mesh_dim_names
    if "tp" in names:
        for layer in model.layers:
            for n, p in list(layer.named_parameters(recurse=False)):
                tp_dim = shapes[f"{layer.prefix}{n}"][1]
                if tp_dim is not None:
                    setattr(layer, n, nn.Parameter(distribute_tensor(p.detach(), mesh["tp"], [Shard(tp_dim)])))
    shard_mesh = mesh["dp_replicate", "dp_shard"] if "dp_replicate" in names else mesh["dp_shard"]
    kw: dict[str, Any] = {"mesh": shard_mesh}
    if mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _dp(mesh: Any) -> tuple[int, int]:
    """(this rank's data-parallel index, data-parallel size) over ``dp_replicate x dp_shard``."""
    names = mesh.mesh_dim_names
    shard, n_shard = mesh.get_local_rank("dp_shard"), mesh.size(names.index("dp_shard"))
    rep = mesh.get_local_rank("dp_replicate") if "dp_replicate" in names else 0
    n_rep = mesh.size(names.index("dp_replicate")) if "dp_replicate" in names else 1
    return rep * n_shard + shard, n_rep * n_shard


def _full_shapes(model: str = "fsdp-toy") -> dict[str, tuple[int, ...]]:
    return {n: s for n, (s, _) in _SHAPES[model].items()}


def fsdp_local_grads(mesh: Any, step: int, model: str = "fsdp-toy") -> dict[str, torch.Tensor]:
    """This rank's injected gradients at ``step``: its data-parallel index's integer gradients,
    cut to the TP-local piece (``torch.chunk``) on a ``tp`` mesh."""
    dp_rank, _ = _dp(mesh)
    full = integer_grads(_full_shapes(model), step=step, rank=dp_rank)
    if "tp" not in mesh.mesh_dim_names:
        return full
    t, tp = mesh.get_local_rank("tp"), mesh.size(mesh.mesh_dim_names.index("tp"))
    out = {}
    for n, g in full.items():
        dim = _SHAPES[model][n][1]
        out[n] = g.chunk(tp, dim=dim)[t].contiguous() if dim is not None else g
    return out


def fsdp_reference(
    matrix_cls: type[torch.optim.Optimizer],
    matrix_kwargs: Mapping[str, Any],
    elementwise_kwargs: Mapping[str, Any],
    *,
    dtype: torch.dtype,
    dp: int,
    steps: int,
    model: str = "fsdp-toy",
) -> ReferenceRunner:
    """The single-device ground truth: the same optimizers on full tensors (each expert of a stack
    alone), fed the mean of the ``dp`` data-parallel ranks' gradients."""
    experts = {n: "experts" for n, (shape, _) in _SHAPES[model].items() if len(shape) == 3}
    ref = ReferenceRunner(_new_model(model, dtype), matrix_cls, matrix_kwargs, torch.optim.AdamW, elementwise_kwargs, kinds=experts)
    for s in range(steps):
        ref.step(mean_grads([integer_grads(_full_shapes(model), step=s, rank=r) for r in range(dp)]))
    return ref


@dataclass
class FSDPCaseResult:
    """What one rank saw. ``mismatches`` (rank 0 only) names every parameter, master or state
    entry that differs from the single-device optimizer; ``document`` is the consolidated state
    (rank 0 only); ``hosted`` the matrices whose state this rank holds."""

    mismatches: list[str] = field(default_factory=list)
    hosted: list[str] = field(default_factory=list)
    group_rank: int = 0
    group_size: int = 1
    state_bytes: int = 0
    comm: dict[str, dict[str, int]] = field(default_factory=dict)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    document: dict[str, Any] = field(default_factory=dict)


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, for the comparison. A dp_shard x tp parameter (``_StridedShard`` on
    dp_shard, ``Shard`` on tp) is gathered in two steps, which torch's redistribute logs as a
    warning on every rank per parameter: about this check's gather, not the step under test, so
    the suite's output leaves it out."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    finally:
        log.setLevel(level)


def run_fsdp_case(
    mesh: Any,
    optimizer: Any = "muon",
    strategy: str = "lb-asc",
    optimizer_kwargs: Mapping[str, Any] | None = None,
    elementwise_kwargs: Mapping[str, Any] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    steps: int = 3,
    compare: bool = True,
    mixed_precision: bool = False,
    update_hooks: Sequence[Any] = (),
    model_name: str = "fsdp-toy",
) -> FSDPCaseResult:
    """Run one exactness case on every rank of ``mesh`` (collective; see the module docstring).
    ``update_hooks`` are registered on the optimizer for the case's steps
    (:meth:`canzona.DistributedOptimizer.register_update_hook`)."""
    import torch.distributed as dist

    import canzona
    from canzona.distributed import resolve_optimizer

    kw = dict(optimizer_kwargs or {"lr": 0.02})
    ew = dict(elementwise_kwargs or {"lr": 0.01, "weight_decay": 0.1})
    model = build_fsdp_toy(mesh, dtype, mixed_precision=mixed_precision, model=model_name)
    opt = canzona.DistributedOptimizer(model, optimizer, strategy=strategy, mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=ew)
    handles = [opt.register_update_hook(h) for h in update_hooks]
    try:
        for s in range(steps):
            model(fsdp_local_grads(mesh, s, model_name)).backward()
            opt.step()
            opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
    params = _full_params(model)
    doc = opt.consolidated_state_dict()
    res = FSDPCaseResult(
        hosted=list(opt.runtime.engine.hosted),
        group_rank=opt.group_rank,
        group_size=opt.group_size,
        state_bytes=opt.state_bytes(),
        comm=opt.comm_stats.as_dict(),
    )
    if dist.get_rank() != 0:
        return res
    res.params, res.document = params, doc
    if compare:
        _, dp = _dp(mesh)
        ref = fsdp_reference(resolve_optimizer(optimizer), kw, ew, dtype=dtype, dp=dp, steps=steps, model=model_name)
        res.mismatches = compare_with_reference(params, doc, ref)
    return res


def compare_with_reference(params: Mapping[str, torch.Tensor], doc: Mapping[str, Any], ref: ReferenceRunner) -> list[str]:
    """Names (``param:``, ``master:``, ``state:<name>[<key>]``) that differ from ``ref`` in any bit."""
    bad = [f"param:{n}" for n in tensors_equal(params, ref.params())]
    bad += [f"master:{n}" for n in tensors_equal(doc["params"], ref.master_values())]
    ref_states = ref.states()
    bad += [f"state:{n}" for n in sorted(set(doc["state"]) ^ set(ref_states))]
    for name, st in ref_states.items():
        got_st = doc["state"].get(name, {})
        for k, v in st.items():
            got = got_st.get(k)
            same = (isinstance(got, torch.Tensor) and got.dtype == v.dtype and torch.equal(got, v)) if isinstance(v, torch.Tensor) else got == v
            if not same:
                bad.append(f"state:{name}[{k}]")
    return bad



def fsdp_mesh_worker(rank: int, world: int, mesh_name: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A :func:`canzona.runtime.launch.run_workers` target: every case of one mesh of
    :data:`FSDP_MESHES` on ``world`` spawned ranks. A case is a dict with ``label``, ``optimizer``
    (name), ``strategy`` and optionally ``optimizer_kwargs``, ``dtype`` (``"float32"``/``"bfloat16"``),
    ``mixed_precision`` (bool), ``steps``, ``model`` (``fsdp-toy``, the default, or ``fsdp-moe``), ``fault`` (the fields of a
    :class:`validation.faults.Fault`, registered as an update hook on every rank's optimizer
    for that case only: a planted defect the comparison must name; the case fails when it never
    fired). Returns, per case, ``{"label", "mismatches"}`` plus ``"params"`` and ``"document"``
    (rank 0's full parameters and consolidated state, for a per-tensor report); all three are
    filled on rank 0 only, other ranks return empty ones::

        run_workers(fsdp_mesh_worker, 4, "dp_shard2_tp2", [{"label": "muon/lb-asc", "optimizer": "muon", "strategy": "lb-asc"}])
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape, names = FSDP_MESHES[mesh_name]
    if math.prod(shape) != world:
        raise ValueError(f"mesh {mesh_name} needs {math.prod(shape)} ranks, the world has {world}")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    from validation.faults import Fault, FaultHook

    out = []
    for case in cases:
        planted = FaultHook(Fault(**case["fault"])) if case.get("fault") else None
        res = run_fsdp_case(
            mesh,
            case["optimizer"],
            case["strategy"],
            case.get("optimizer_kwargs"),
            dtype=getattr(torch, case.get("dtype", "float32")),
            steps=int(case.get("steps", 3)),
            mixed_precision=bool(case.get("mixed_precision", False)),
            update_hooks=() if planted is None else (planted,),
            model_name=case.get("model", "fsdp-toy"),
        )
        if planted is not None:
            # a defect that never fired proves nothing: name it, so the case cannot pass cleanly
            fired = torch.tensor([int(planted.fired)])
            dist.all_reduce(fired)
            if not int(fired) and dist.get_rank() == 0:
                f = planted.fault
                res.mismatches.append(f"fault:{f.kind} on {f.param} (step {f.step}) never fired")
        out.append({"label": case["label"], "mismatches": res.mismatches, "params": res.params, "document": res.document})
        dist.barrier()
    return out
