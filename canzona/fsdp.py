"""``canzona.DistributedOptimizer`` on FSDP2 models (``fully_shard``; FSDP, HSDP, FSDP x TP).

``DistributedOptimizer(model, ...)`` returns an :class:`FSDPDistributedOptimizer` when the model
holds ``fully_shard`` modules. Usage (every rank)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = parallelize(Qwen3(cfg), mesh["tp"])            # optional TP (DTensor Shard(0|1))
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh)
    loss.backward(); opt.step(); opt.zero_grad()           # FSDP2 does its own reduce-scatter

The mesh dimensions are named as in torchtitan: ``dp_shard`` (required), ``tp`` and
``dp_replicate`` (HSDP) optional. Layouts are read from each parameter's DTensor placements
(``Shard(0)`` on ``dp_shard``, ``Shard(d)`` or ``Replicate`` on ``tp``, ``Replicate`` on
``dp_replicate``); any other placement (``Partial``, ``Shard`` on another dim of ``dp_shard``)
or a non-DTensor parameter is refused with one error naming the parameter.

What differs from the ZeRO-1 path (:mod:`canzona.distributed`):

- No canzona gradient buffer, no hooks: FSDP2 reduce-scatters (HSDP also all-reduces) the
  gradients into ``p.grad`` as it always does, and ``step()`` reads them there; ``zero_grad()``
  clears ``p.grad``. Gradient accumulation is FSDP2's business (``set_requires_gradient_sync``).
- Element-wise parameters (embeddings, heads, norms, biases): the element-wise optimizer runs on
  each rank's own piece (fp32 masters of the piece).
- Matrix parameters: a task per parameter, hosted by one rank of its *shard group* (the
  ``dp_shard x tp`` ranks of one replica, flattened), planned by :mod:`canzona.plan.fsdp`
  (strategies ``lb-asc``, ``asc``, ``sc``, ``no-fuse``) and stepped by
  :class:`canzona.runtime.fsdp.FSDPEngine`: per micro-group one fused all-to-all brings the
  pieces to the hosts, the host runs the per-parameter optimizer on its full fp32 master (its
  state lives only there), one fused all-to-all returns the values, every rank writes its piece.
- HSDP: every ``dp_replicate`` replica runs the same step on its own (identical gradients after
  HSDP's all-reduce, identical results bit for bit). Spreading hosts over the replicas as well
  (``dp_replicate x dp_shard x tp`` hosts instead of ``dp_shard x tp``) would cut each rank's
  matrix compute and state by the replica count, at the price of one more exchange of the
  updated values across replicas; it is not done here.
- Uneven shards (FSDP2 pads dim 0) and empty pieces are served: blocks are exchanged with
  per-rank sizes.
- Checkpoints: the same formats as the ZeRO-1 path (:mod:`canzona.runtime.checkpoint`, one
  consolidated ``torch.save`` document with ``meta["engine"] = "fsdp2"``; :mod:`canzona.runtime.dcp`,
  a sharded DCP directory where each rank writes its element-wise blocks and hosted matrices),
  with the same checks and refusals; both re-slice to any mesh and load across the two paths.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.distributed import (
    GROUP_NAMES,
    DistributedOptimizer,
    ParamWatch,
    _plain,
    check_per_parameter,
    exchange_fingerprints,
    resolve_optimizer,
    scheduled_hyperparams,
)
from canzona.optimizers import cost_key_for_class
from canzona.plan.fsdp import FSDP_STRATEGIES, FSDPInputs, FSDPParam, FSDPPlan, plan_fsdp
from canzona.runtime.agree import STATUS_TIMEOUT_S
from canzona.runtime.checkpoint import Held, ModelPiece, ParamRecord, whole_box
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.exchange import Block, PieceLayout
from canzona.runtime.fsdp import FSDPRuntime, local_block
from canzona.runtime.phases import PhaseTimer, timing
from canzona.specs import is_matrix_param

__all__ = ["FSDP_MESH_DIMS", "FSDPDistributedOptimizer", "is_fsdp2_model", "fsdp_group_ranks"]

#: mesh dimension names of the FSDP2 path (torchtitan's), outermost first
FSDP_MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp")
GROUP_TIMEOUT_S = 300.0


def is_fsdp2_model(model: Any) -> bool:
    """True when ``model`` (an ``nn.Module``) contains a module wrapped by FSDP2's ``fully_shard``."""
    if not isinstance(model, nn.Module):
        return False
    # a model can only hold fully_shard modules once torch.distributed.fsdp is loaded: do not pay
    # its import (seconds) on canzona's ZeRO-1 path
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_cls = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return module_cls is not None and any(isinstance(m, module_cls) for m in model.modules())


def fsdp_group_ranks(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...], ranks: list[int]) -> list[list[int]]:
    """The shard groups of a mesh (one per ``dp_replicate`` index): the global ranks of its
    ``dp_shard x tp`` sub-mesh, sorted. ``ranks`` is the mesh's rank list in row-major order."""
    if "dp_replicate" not in mesh_dim_names:
        return [sorted(ranks)]
    axis = mesh_dim_names.index("dp_replicate")
    t = torch.tensor(ranks).view(mesh_shape).movedim(axis, 0)
    return [sorted(row.flatten().tolist()) for row in t]


def _check_mesh(mesh: Any, world: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None:
        raise ValueError(
            "an FSDP2 model needs mesh=: the DeviceMesh it was sharded on, with dimensions named "
            "from ('dp_replicate', 'dp_shard', 'tp') (torchtitan's names)"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if "dp" in names:
        raise ValueError(
            "the model is sharded by FSDP2 (fully_shard) but the mesh has a 'dp' dimension, which is canzona's own ZeRO-1 "
            "path: mixing the two is not supported; name the mesh dimensions ('dp_replicate', 'dp_shard', 'tp')"
        )
    if "dp_shard" not in names or set(names) - set(FSDP_MESH_DIMS) or len(set(names)) != len(names):
        raise ValueError(f"an FSDP2 mesh needs dimensions named from {FSDP_MESH_DIMS} including 'dp_shard', got {names}")
    if list(names) != [d for d in FSDP_MESH_DIMS if d in names]:
        raise ValueError(f"FSDP2 mesh dimensions must be ordered {FSDP_MESH_DIMS} (outermost first), got {names}")
    if mesh.size() != world:
        raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {world}; the mesh must cover the whole world")
    return mesh


def _check_placements(name: str, p: torch.Tensor, mesh: Any) -> int | None:
    """Refuse any layout the FSDP2 path cannot serve; return the TP split dim (None: replicated)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        raise ValueError(
            f"{name}: not a DTensor; every trainable parameter of an FSDP2 model must be sharded by fully_shard "
            "(wrap the root module too)"
        )
    pm = p.device_mesh
    pnames = tuple(pm.mesh_dim_names or ())
    if "dp_shard" not in pnames:
        raise ValueError(f"{name}: its mesh {pnames} has no 'dp_shard' dimension; shard it with fully_shard(mesh=mesh['dp_shard'])")
    tp_dim: int | None = None
    for dim_name, pl in zip(pnames, p.placements):
        names = tuple(mesh.mesh_dim_names)
        if dim_name not in names or pm.size(pnames.index(dim_name)) != mesh.size(names.index(dim_name)):
            raise ValueError(f"{name}: its mesh dimension {dim_name!r} is not a dimension of the same size in the optimizer's mesh {names}")
        kind = type(pl).__name__
        if dim_name == "dp_shard":
            # Shard(0), or FSDP2's _StridedShard(0) when TP also cuts dim 0 (FSDP chunks the TP-local rows)
            ok = (isinstance(pl, Shard) or kind == "_StridedShard") and getattr(pl, "dim", None) == 0
        elif dim_name == "tp":
            ok = isinstance(pl, Replicate) or (type(pl) is Shard and 0 <= pl.dim < p.ndim)
            if type(pl) is Shard:
                tp_dim = pl.dim
        else:
            ok = isinstance(pl, Replicate)
        if not ok:
            raise ValueError(
                f"{name}: placement {pl!r} on mesh dimension {dim_name!r} is not supported on the FSDP2 path "
                "(expected Shard(0) on dp_shard, Shard(d) or Replicate on tp, Replicate on dp_replicate)"
            )
    return tp_dim


class FSDPDistributedOptimizer(DistributedOptimizer):
    """:class:`~canzona.DistributedOptimizer` for FSDP2 models (see the module docstring).

    Built by ``DistributedOptimizer(model, ...)`` when ``model`` holds ``fully_shard`` modules.
    Attributes: ``plan`` (:class:`~canzona.plan.fsdp.FSDPPlan`), ``comm_stats`` (bytes per phase),
    ``phase_times``, ``runtime`` (:class:`~canzona.runtime.fsdp.FSDPRuntime`), ``group_rank`` and
    ``group_size`` (this rank in its shard group), ``replica`` (its ``dp_replicate`` index).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: str | type[torch.optim.Optimizer] = "muon",
        *,
        strategy: str = "lb-asc",
        mesh: Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        elementwise_optimizer: str | type[torch.optim.Optimizer] = torch.optim.AdamW,
        elementwise_kwargs: Mapping[str, Any] | None = None,
        cost: str = "numel",
        cmax_mb: float = 512,
        master_dtype: torch.dtype = torch.float32,
        plan: FSDPPlan | None = None,
        **zero1_only: Any,
    ) -> None:
        # ---- checks every rank makes identically, before any collective
        if zero1_only:
            raise ValueError(
                f"{', '.join(sorted(zero1_only))}: option(s) of canzona's ZeRO-1 path, which do not apply to an FSDP2 model "
                "(FSDP2 owns the gradients and their reduction)"
            )
        if strategy not in FSDP_STRATEGIES:
            raise ValueError(
                f"strategy {strategy!r} needs canzona's own ZeRO-1 buffer and cannot run on an FSDP2 model; "
                f"choose one of {', '.join(FSDP_STRATEGIES)}"
            )
        if master_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"master_dtype must be torch.float32 or torch.float64, got {master_dtype}")
        matrix_cls = resolve_optimizer(optimizer, "optimizer")
        ew_cls = resolve_optimizer(elementwise_optimizer, "elementwise_optimizer")
        self.optimizer_kwargs = dict(optimizer_kwargs or {})
        self.elementwise_kwargs = dict(elementwise_kwargs or {})
        # every rank's optimizer arguments, folded into the per-step hyperparameter digest
        self._kwargs_repr = repr((_plain(self.optimizer_kwargs), _plain(self.elementwise_kwargs)))
        check_per_parameter(matrix_cls, self.optimizer_kwargs, "optimizer")
        if ew_cls is not matrix_cls or self.elementwise_kwargs != self.optimizer_kwargs:
            check_per_parameter(ew_cls, self.elementwise_kwargs, "elementwise_optimizer")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
        world = dist.get_world_size()
        mesh = _check_mesh(mesh, world)
        names = tuple(mesh.mesh_dim_names)
        self.mesh = mesh
        self.model = model
        # bound on the checkpoint status exchanges (canzona.runtime.checkpoint), as on the ZeRO-1 path
        self.status_timeout_s = STATUS_TIMEOUT_S
        self.strategy = strategy
        self.matrix_cls, self.elementwise_cls = matrix_cls, ew_cls
        self.master_dtype = master_dtype
        size = {d: (mesh.size(names.index(d)) if d in names else 1) for d in FSDP_MESH_DIMS}
        self.dp, self.tp = size["dp_replicate"] * size["dp_shard"], size["tp"]
        self.dp_rank = 0  # no ZeRO-1 DP ranks on this path; kept for the shared front-end attributes
        self.tp_rank = mesh.get_local_rank("tp") if "tp" in names else 0
        self.replica = mesh.get_local_rank("dp_replicate") if "dp_replicate" in names else 0

        # ---- plan from global shapes (identical on every rank); failures join the fingerprint exchange
        err: Exception | None = None
        fp: str | None = None
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        try:
            if not trainable:
                raise ValueError("the model has no trainable parameters")
            records = []
            for n, p in trainable:
                tp_dim = _check_placements(n, p, mesh)
                shape = tuple(p.shape)
                records.append(FSDPParam(n, shape, "matrix" if is_matrix_param(n, shape) else "elementwise", tp_dim))
            inputs = FSDPInputs(
                model=type(model).__name__,
                dp_shard=size["dp_shard"],
                tp=size["tp"],
                dp_replicate=size["dp_replicate"],
                optimizer=cost_key_for_class(matrix_cls),  # classes the registry does not know are costed as Muon
                strategy=strategy,
                cost=cost,
                cmax_bytes=max(1, int(cmax_mb * 2**20)),
                grad_bytes=torch.empty((), dtype=master_dtype).element_size(),
            )
            if plan is None:
                plan = plan_fsdp(records, inputs)
            else:
                self._check_given_fsdp_plan(plan, records, inputs)
            fp = plan.fingerprint
        except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange below
            err = exc
        device = local_block(trainable[0][1]).device if trainable else torch.device("cpu")
        fps = exchange_fingerprints(fp, device=device)
        if err is not None:
            raise err
        failed = [r for r, f in enumerate(fps) if f is None]
        if failed:
            raise RuntimeError(f"rank(s) {failed} failed to build the plan (their error says why); no rank proceeds")
        if len(set(fps)) != 1:
            groups: dict[str, list[int]] = {}
            for r, f in enumerate(fps):
                groups.setdefault(str(f), []).append(r)
            raise RuntimeError(f"plan fingerprints differ across ranks: {groups}; every rank must plan the same model with the same inputs")
        assert plan is not None
        self.plan = plan

        # ---- shard group (every rank creates every replica's group, in the same order) and layouts
        shard_groups = fsdp_group_ranks(tuple(mesh.mesh.shape), names, mesh.mesh.flatten().tolist())
        me = dist.get_rank()
        group = None
        for ranks in shard_groups:
            g = dist.new_group(ranks, timeout=timedelta(seconds=GROUP_TIMEOUT_S)) if len(shard_groups) > 1 else None
            if me in ranks:
                group = g
        self.comm_stats = CommStats()
        self.phase_times = PhaseTimer()
        self.comm = Comm(group, self.comm_stats)
        self.group_rank, self.group_size = self.comm.rank, self.comm.size
        named = dict(trainable)
        layouts = self._exchange_layouts(plan, named)
        self._layouts = layouts
        self._init_fsdp_param_groups(plan, named)
        self._watch = ParamWatch(model)
        self.runtime = FSDPRuntime(
            {p.name: named[p.name] for p in plan.params},
            layouts,
            [list(zip(g.names, g.hosts)) for g in plan.groups],
            comm=self.comm,
            matrix_factory=self._factory(matrix_cls, self.optimizer_kwargs),
            elementwise_factory=self._factory(ew_cls, self.elementwise_kwargs),
            master_dtype=master_dtype,
            status_timeout_s=self.status_timeout_s,
        )
        self.comm_stats.reset()

    # ------------------------------------------------------------------------------ construction
    def _check_given_fsdp_plan(self, plan: Any, records: list[FSDPParam], inputs: FSDPInputs) -> None:
        if not isinstance(plan, FSDPPlan):
            raise TypeError(f"plan must be a canzona FSDPPlan on an FSDP2 model, got {type(plan).__name__}")
        if plan.inputs != inputs:
            raise ValueError(f"the plan was made for {plan.inputs}, this optimizer needs {inputs}")
        mine = [(p.name, p.shape, p.kind, p.tp_dim) for p in plan.params]
        if mine != [(p.name, p.shape, p.kind, p.tp_dim) for p in records]:
            raise ValueError("the plan was made for other parameters than this model's (names, shapes, kinds or TP splits differ)")

    def _exchange_layouts(self, plan: FSDPPlan, named: Mapping[str, torch.Tensor]) -> dict[str, PieceLayout]:
        """Every rank's block of every parameter, from the DTensor placements (one all-gather of
        offsets and shapes over the shard group; not counted in ``comm_stats``)."""
        # DTensor's own rule for a rank's block (it understands FSDP2's _StridedShard under TP); a
        # private helper, also what torch.distributed.checkpoint uses. PieceLayout re-checks that
        # the gathered blocks tile every tensor exactly, so a changed rule fails loudly.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        nd = max(len(p.shape) for p in plan.params)
        rows = []
        for pp in plan.params:
            p = named[pp.name]
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            if tuple(local_block(p.detach()).shape) != tuple(shape):
                raise RuntimeError(f"{pp.name}: local tensor has shape {tuple(local_block(p.detach()).shape)}, its placements say {tuple(shape)}")
            pad = nd - len(shape)
            rows.append(list(offset) + [0] * pad + list(shape) + [0] * pad)
        mine = torch.tensor(rows, dtype=torch.int64).flatten()
        n = self.comm.size
        out, work = Comm(self.comm.group).all_gather_equal(mine)
        if work is not None:
            work.wait()
        table = out.view(n, len(plan.params), 2 * nd).tolist()
        layouts = {}
        for i, pp in enumerate(plan.params):
            k = len(pp.shape)
            blocks = tuple(Block(tuple(table[r][i][:k]), tuple(table[r][i][nd : nd + k])) for r in range(n))
            layouts[pp.name] = PieceLayout(pp.name, tuple(pp.shape), blocks)
        return layouts

    def _init_fsdp_param_groups(self, plan: FSDPPlan, named: Mapping[str, torch.Tensor]) -> None:
        hyper = {
            "matrix": scheduled_hyperparams(self.matrix_cls, self.optimizer_kwargs),
            "elementwise": scheduled_hyperparams(self.elementwise_cls, self.elementwise_kwargs),
        }
        members: dict[str, list[str]] = {name: [] for name in GROUP_NAMES}
        for p in plan.params:
            members["matrix" if p.kind == "matrix" else "elementwise"].append(p.name)
        groups = [{"name": name, "params": [named[n] for n in members[name]], **hyper[name]} for name in GROUP_NAMES]
        self._groups_fixed = False
        torch.optim.Optimizer.__init__(self, groups, {})
        self._groups_fixed = True
        for group in self.param_groups:
            group["param_names"] = list(members[group["name"]])
        self._scheduled = {name: tuple(hyper[name]) for name in GROUP_NAMES}

    # ------------------------------------------------------------------------------ torch-like API
    def no_sync(self) -> Any:
        raise TypeError(
            "no_sync() belongs to canzona's ZeRO-1 path; on an FSDP2 model use FSDP2's own "
            "model.set_requires_gradient_sync(False) for gradient accumulation"
        )

    def step(self, closure: Any = None) -> Any:
        """Element-wise pieces, then the matrix micro-groups (FSDP2 has already reduced ``p.grad``).

        As on the ZeRO-1 path, one status exchange before anything changes settles errors, missing
        and non-finite gradients and the hyperparameter digest on every rank, and a second one
        carries errors raised while updating (:meth:`canzona.runtime.fsdp.FSDPRuntime.step`)."""
        if closure is not None:
            raise TypeError("DistributedOptimizer.step does not take a closure (per-parameter optimizers only)")
        self._check_params_unchanged()
        self._push_hyperparams()
        with timing(self.phase_times):
            self.runtime.step(self._digest())
        return None

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over FSDP2's ``p.grad`` with one exchange (collective)."""
        from canzona.runtime.clip import clip_fsdp

        return clip_fsdp(self.runtime, self.replica, max_norm, norm_type, error_if_nonfinite, foreach)

    def refresh_masters(self) -> None:
        """Re-read the fp32 masters from the model (collective): call after overwriting parameters."""
        self.runtime.refresh_masters()

    # ------------------------------------------------------------------------------ checkpoint source
    # state_dict / load_state_dict are DistributedOptimizer's (canzona.runtime.checkpoint's
    # consolidated document, the same family on both paths); these say what this path holds.
    def checkpoint_params(self) -> list[ParamRecord]:
        return [ParamRecord(p.name, tuple(p.shape), p.kind, p.tp_dim, p.kind != "matrix") for p in self.plan.params]

    def checkpoint_describe(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "engine": "fsdp2",
            "strategy": self.strategy,
            "dp": self.dp,
            "tp": self.tp,
            "fingerprint": self.plan.fingerprint,
            "plan_inputs": asdict(self.plan.inputs),
        }

    def held(self) -> list[Held]:
        """Element-wise pieces (this rank's block, state shaped like it) and the hosted matrices
        (full master and state). Replica 0 is canonical under HSDP; among ranks holding the same
        block (replicated over ``tp``) the layout's source; under ``sc`` group rank 0."""
        rt, eng = self.runtime, self.runtime.engine
        first = self.replica == 0
        out: list[Held] = []
        for name, m in rt.ew_masters.items():
            lay = rt.layouts[name]
            b = lay.blocks[self.group_rank]
            out.append(Held(name, ((b.offset, b.shape),), m, rt.ew_optimizer, m, True, first and lay.sources[self.group_rank]))
        for name in eng.hosted:
            m = eng.masters[name]
            canonical = first and (eng.tasks[name].host != -1 or self.group_rank == 0)
            out.append(Held(name, (whole_box(m.shape),), m, eng.optimizer, m, False, canonical))
        return out

    def model_pieces(self) -> list[ModelPiece]:
        rt = self.runtime
        out = []
        for name, p in rt.params.items():
            b = rt.layouts[name].blocks[self.group_rank]
            out.append(ModelPiece(name, local_block(p.detach()), (b.offset, b.shape)))
        return out

    def status_device(self) -> torch.device:
        return local_block(next(iter(self.runtime.params.values())).detach()).device

    def finish_load(self, steps: int) -> None:
        self.runtime.steps = int(steps)  # hosts hold full masters, loaded whole: nothing to re-assemble
        self.runtime.replicas.clear()  # every rank holds the loaded state

    def __repr__(self) -> str:
        i = self.plan.inputs
        return (
            f"FSDPDistributedOptimizer({self.matrix_cls.__name__} + {self.elementwise_cls.__name__}, strategy={self.strategy!r}, "
            f"dp_replicate={i.dp_replicate}, dp_shard={i.dp_shard}, tp={i.tp}, plan={self.plan.fingerprint})"
        )
