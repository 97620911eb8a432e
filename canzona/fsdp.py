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
- ``state_dict()`` is consolidated on world rank 0 (one ``gather_object``) in the ZeRO-1 path's
  document family (``canzona.optimizer_state``, ``meta["engine"] = "fsdp2"``), full-shape
  masters and state per parameter name; ``load_state_dict`` takes it on every rank, re-slices it
  to this mesh and writes the model's pieces from the masters.
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
    _plain,
    check_per_parameter,
    exchange_fingerprints,
    resolve_optimizer,
    scheduled_hyperparams,
)
from canzona.optimizers import cost_key_for_class
from canzona.plan.fsdp import FSDP_STRATEGIES, FSDPInputs, FSDPParam, FSDPPlan, plan_fsdp
from canzona.runtime.agree import STATUS_TIMEOUT_S
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.exchange import Block, PieceLayout
from canzona.runtime.fsdp import FSDPRuntime, local_block
from canzona.runtime.phases import PhaseTimer, timing
from canzona.specs import is_matrix_param

__all__ = ["FSDP_MESH_DIMS", "FSDPDistributedOptimizer", "is_fsdp2_model", "fsdp_group_ranks"]

#: mesh dimension names of the FSDP2 path (torchtitan's), outermost first
FSDP_MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp")
GROUP_TIMEOUT_S = 300.0
STATE_FORMAT, STATE_VERSION = "canzona.optimizer_state", 1


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
        self._signature = self._param_signature()
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

    def refresh_masters(self) -> None:
        """Re-read the fp32 masters from the model (collective): call after overwriting parameters."""
        self.runtime.refresh_masters()

    def state_dict(self) -> dict[str, Any]:
        """The consolidated optimizer state (collective; world rank 0 gets it, other ranks ``{}``):
        full-shape masters and optimizer state per parameter name, the groups' hyperparameters."""
        self._push_hyperparams()
        rt = self.runtime
        contrib: dict[str, Any] = {"matrix": {}, "pieces": {}}
        if self.replica == 0:
            for name in rt.engine.hosted:
                if rt.engine.tasks[name].host == -1 and self.group_rank != 0:
                    continue  # sc: every rank holds the same; rank 0 of the group reports it
                contrib["matrix"][name] = (rt.engine.masters[name].detach().clone(), rt.engine.state_dict()[name])
            ew_state = rt.ew_optimizer.state if rt.ew_optimizer is not None else {}
            for name, m in rt.ew_masters.items():
                if rt.layouts[name].sources[self.group_rank]:
                    st = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in ew_state.get(m, {}).items()}
                    contrib["pieces"][name] = (rt.layouts[name].blocks[self.group_rank], m.detach().clone(), st)
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(contrib, gathered, dst=0)
        if gathered is None:
            return {}
        params: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, Any]] = {}
        by_name = self.plan.by_name()
        for c in gathered:
            for name, (master, st) in c["matrix"].items():
                params[name], state[name] = master, st
            for name, (block, piece, st) in c["pieces"].items():
                shape = by_name[name].shape
                if name not in params:
                    params[name] = torch.empty(shape, dtype=piece.dtype)
                    state[name] = {}
                params[name][block.index()] = piece
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == block.shape and v.ndim > 0:
                        state[name].setdefault(k, torch.empty(shape, dtype=v.dtype))[block.index()] = v
                    elif isinstance(v, torch.Tensor) and v.ndim > 0:
                        raise ValueError(f"{name}: element-wise state {k!r} of shape {tuple(v.shape)} cannot be assembled from pieces")
                    else:
                        state[name][k] = v
        hyper = {g["name"]: {k: g[k] for k in self._scheduled[g["name"]]} for g in self.param_groups}
        meta = {
            "engine": "fsdp2",
            "strategy": self.strategy,
            "fingerprint": self.plan.fingerprint,
            "steps": self.steps,
            "matrix_optimizer": self.matrix_cls.__name__,
            "elementwise_optimizer": self.elementwise_cls.__name__,
            "master_dtype": str(self.master_dtype).removeprefix("torch."),
            "params": {p.name: {"shape": list(p.shape), "kind": p.kind, "tp_dim": p.tp_dim} for p in self.plan.params},
        }
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "meta": meta, "params": params, "state": state, "hyper": hyper}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict`'s document (every rank passes the whole document): masters and
        optimizer state re-sliced to this mesh, the model's pieces written from the masters."""
        doc = state
        if not isinstance(doc, Mapping) or doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
            raise ValueError(f"not a canzona optimizer state document (format {STATE_FORMAT!r} version {STATE_VERSION})")
        meta = doc.get("meta")
        if not isinstance(meta, Mapping) or meta.get("engine") != "fsdp2":
            raise ValueError("this optimizer state was written by canzona's ZeRO-1 path; load it into an FSDP2 optimizer is not supported")
        want = {p.name: {"shape": list(p.shape), "kind": p.kind} for p in self.plan.params}
        got = {n: {"shape": list(v["shape"]), "kind": v["kind"]} for n, v in dict(meta["params"]).items()}
        if want != got:
            raise ValueError("the optimizer state was saved for other parameters (names, shapes or kinds differ)")
        params, states = doc["params"], doc["state"]
        for name in want:
            t = params.get(name)
            if not isinstance(t, torch.Tensor) or list(t.shape) != want[name]["shape"]:
                raise ValueError(f"{name}: the document's master is missing or has the wrong shape")
        rt = self.runtime
        # the model's pieces from the masters (then every master re-read from them, exactly)
        for name in want:
            block = rt.layouts[name].blocks[self.group_rank]
            local_block(rt.params[name].detach()).copy_(params[name][block.index()])
        ew_state = rt.ew_optimizer.state if rt.ew_optimizer is not None else None
        for name, m in rt.ew_masters.items():
            block = rt.layouts[name].blocks[self.group_rank]
            m.copy_(params[name][block.index()])
            if ew_state is not None:
                ew_state[m] = {
                    k: (v[block.index()].clone() if isinstance(v, torch.Tensor) and v.ndim > 0 else (v.clone() if isinstance(v, torch.Tensor) else v))
                    for k, v in dict(states.get(name, {})).items()
                }
        for name in rt.engine.hosted:
            rt.engine.masters[name].copy_(params[name])
        rt.engine.load_state_dict({n: dict(states.get(n, {})) for n in rt.engine.hosted})
        rt.steps = int(meta.get("steps", 0))
        hyper = doc.get("hyper", {})
        for group in self.param_groups:
            saved = hyper.get(group["name"], {})
            for k in self._scheduled[group["name"]]:
                if k in saved:
                    group[k] = saved[k]

    def __repr__(self) -> str:
        i = self.plan.inputs
        return (
            f"FSDPDistributedOptimizer({self.matrix_cls.__name__} + {self.elementwise_cls.__name__}, strategy={self.strategy!r}, "
            f"dp_replicate={i.dp_replicate}, dp_shard={i.dp_shard}, tp={i.tp}, plan={self.plan.fingerprint})"
        )
