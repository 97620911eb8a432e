"""The FSDP2 layout: models sharded by ``fully_shard`` (FSDP, HSDP, FSDP x TP).

Usage is the one front end's (every rank)::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = parallelize(Qwen3(cfg), mesh["tp"])            # optional TP (DTensor Shard(0|1))
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh)
    loss.backward(); opt.step(); opt.zero_grad()           # FSDP2 does its own reduce-scatter

Each mesh dimension plays one of three roles, read from the placements of the trainable
parameters on it (:func:`mesh_dim_roles`), so any naming works (torchtitan's legacy ``fsdp``,
``dp_shard_cp``, ...):

- ``dp_shard`` (fully_shard's dimension, required, exactly one): every parameter is ``Shard(0)``
  on it (FSDP2's ``_StridedShard(0)`` when TP also cuts dim 0);
- ``dp_replicate`` (HSDP, optional): every parameter is ``Replicate`` on it;
- ``tp`` (optional): TP's placements, ``Shard(d)`` on some parameters and ``Replicate`` or
  ``Shard(d)`` on the others.

A dimension *named* ``dp_shard``, ``dp_replicate`` or ``tp`` declares that role and its placements
are checked against it. A mesh whose placements leave a role open (two dimensions that both read
as ``dp_shard``, say: a TP plan that cuts every parameter on dim 0) or give none to a dimension is
refused in one line that names the dimensions. Roles come outermost first (``dp_replicate``,
``dp_shard``, ``tp``). Each parameter's piece is read from its placements; any other placement or
a non-DTensor parameter is refused, naming the parameter.

How it differs from the ZeRO-1 buffer layout (:mod:`canzona.layouts.zero1`):

- gradients arrive in ``p.grad``: FSDP2 reduce-scatters them (HSDP also all-reduces) as it always
  does; ``no_sync()`` turns FSDP2's gradient sync off on every ``fully_shard`` module for its
  duration (``set_requires_gradient_sync``), so micro-batches accumulate unreduced;
- element-wise parameters (embeddings, heads, norms, biases): the element-wise optimizer runs on
  each rank's own piece (fp32 masters of the piece);
- matrix parameters: one task per parameter, hosted by one rank of its *shard group* (the
  ``dp_shard x tp`` ranks of one replica, flattened), planned by :mod:`canzona.plan.shard` and stepped
  by :class:`canzona.runtime.shard.FSDPRuntime`: the paper's micro-group exchange (Section 4.1,
  Algorithm 2) with the pieces of a matrix spread over that group;
- expert stacks (role ``experts``, :func:`check_expert_placements`): on the optimizer's mesh, or on
  an expert mesh of their own (expert parallelism as torchtitan builds it: ``Shard(0)`` on ``ep``,
  then ``fully_shard`` on ``efsdp`` through ``shard_placement_fn``, giving ``("efsdp", "ep")`` with
  ``(_StridedShard(0) or Shard(1), Shard(0))``; under HSDP ``fully_shard`` on
  ``("dp_replicate", "efsdp")``, giving ``("dp_replicate", "efsdp", "ep")`` with ``Replicate`` in
  front; beside ``tp`` on the dense mesh the same ``("efsdp", "ep")`` with efsdp x ep =
  dp_shard x tp, the experts not cut by TP) whose own dimensions span exactly the shard groups
  (one replica's ``dp_shard x tp`` ranks each); an expert mesh's own dimensions take no part in
  :func:`mesh_dim_roles`. Blocks holding whole experts are updated where they live; a stack cut
  by its shard (``Shard(1)``) is one hosted task per expert ``name[e]`` (:func:`expert_layouts`)
  within the shard group, under either exchange (``"ns-input"``: each rank keeps the momentum of
  its rows of expert ``e``, and only the Newton-Schulz input of the expert travels to its host).
  Experts cut by TP on the optimizer's mesh (torchtitan 0.3.0 with tp > 1 and ep 1: ``Shard(1)``
  colwise ``w1``/``w3``, ``Shard(2)`` rowwise ``w2`` on ``tp``, then ``fully_shard``'s ``Shard(0)``
  on ``dp_shard``, or its ``Shard(1)`` when the experts are fewer than the dp_shard ranks, which
  over TP's ``Shard(1)`` reads ``_StridedShard(1)``) are cut experts too: one hosted task per
  expert within the ``dp_shard x tp`` shard group, each rank's piece its block intersected with
  the expert (also where the block holds whole experts along dim 0 but TP-cut columns).
  Refused in one line: an expert mesh whose ranks are not the shard groups' (beside
  ``dp_replicate`` without it, beside ``tp`` over fewer ranks), ``Shard(0)`` on ``tp`` (TP
  splitting the expert dim), an expert mesh carrying ``tp``, experts cut by their shard but
  replicated over ``tp`` on the optimizer's mesh, any other expert placement;
- HSDP: every ``dp_replicate`` replica runs the same step on its own (identical gradients after
  HSDP's all-reduce, identical results bit for bit);
- uneven shards (FSDP2 pads dim 0) and empty pieces are served: blocks are exchanged with per-rank
  sizes;
- FSDP2's own all-gathers and reduce-scatters wait at most ``status_timeout_s`` on gloo
  (:mod:`canzona.runtime.fsdp_comm`, installed at :meth:`FSDP2Layout.build` on every
  ``fully_shard`` module with one parameter group and torch's default comms; the same collectives,
  the same bits; ``bound_fsdp_collectives=False`` turns it off; :attr:`bounded_modules` lists the
  modules): a rank that skipped a ``step()`` and waits in FSDP2's next all-gather raises with the
  others, naming every rank's position. Not on NCCL (the watchdog is the bound), nor on modules
  with several parameter groups (per-parameter meshes from ``shard_placement_fn``: torch refuses
  custom comms there), nor where the user installed a comm.

Invariants: every rank holds one block per parameter; the blocks gathered once at construction
tile every tensor exactly (:class:`canzona.runtime.exchange.PieceLayout` checks it); a hosted
matrix's full master and state live on its host only (on every rank under ``sc``).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.layouts.base import Layout, OptimizerFactory
from canzona.optimizers import cost_key_for_class
from canzona.plan.build import cmax_to_bytes
from canzona.plan.plan import Plan, PlanInputs
from canzona.plan.shard import plan_shard, shard_inputs
from canzona.plan.strategies import FSDP_STRATEGIES
from canzona.runtime.checkpoint import Held, ModelPiece, ParamRecord, whole_box
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.exchange import Block, PieceLayout
from canzona.runtime.shard import FSDPRuntime, local_block
from canzona.runtime.phases import PhaseTimer
from canzona.settings import OptimizerSettings
from canzona.specs import ParamSpec, RoleError, expert_task_name, module_roles, split_task_name

__all__ = [
    "FSDP_MESH_DIMS",
    "FSDP2Layout",
    "check_fsdp2_mesh",
    "check_placements",
    "dim_role_from_placements",
    "fsdp_group_ranks",
    "fsdp_modules",
    "is_fsdp2_model",
    "mesh_dim_roles",
]

#: the roles a mesh dimension plays on the FSDP2 path (and the names that declare them), outermost first
FSDP_MESH_DIMS: tuple[str, ...] = ("dp_replicate", "dp_shard", "tp")
GROUP_TIMEOUT_S = 300.0


def _fsdp_kind(name: str, p: torch.Tensor, role: str, transposed: bool) -> str:
    """The FSDP2 layout's kind for a decided role; what it cannot run yet is refused in one line."""
    if role == "matrix" and (transposed or p.dim() != 2):
        what = "is stored (in, out) (GPT-2's Conv1D)" if transposed else f"is {p.dim()}-D"
        raise RoleError(
            f"{name}: {what}, which the FSDP2 path does not update as a matrix yet; use canzona's ZeRO-1 path "
            f"or roles={{{name!r}: 'elementwise'}}"
        )
    return role


def _check_whole_experts(layouts: Mapping[str, PieceLayout], experts: Sequence[str]) -> None:
    """Every rank's block of a stack planned as whole experts must hold whole experts (the
    placements said so; the gathered blocks must agree)."""
    for n in experts:
        lay = layouts[n]
        for r, b in enumerate(lay.blocks):
            if b.shape[0] and (tuple(b.shape[1:]) != tuple(lay.full_shape[1:]) or any(b.offset[1:])):
                raise RoleError(
                    f"{n}: rank {r} holds block {b.shape} of the expert stack {lay.full_shape}, which cuts experts its "
                    "placements say are whole; shard expert stacks with Shard(0) or Shard(1), or mark them 'elementwise' with roles="
                )


def expert_layouts(name: str, lay: PieceLayout) -> dict[str, PieceLayout]:
    """The ``(M, N)`` layout of every expert ``name[e]`` of a stack cut by its shard: each rank's
    block intersected with expert ``e``, in the expert's own coordinates (empty where the block
    holds none of it)."""
    out = {}
    for e in range(lay.full_shape[0]):
        blocks = []
        for b in lay.blocks:
            held = b.numel and b.offset[0] <= e < b.offset[0] + b.shape[0]
            blocks.append(Block(tuple(b.offset[1:]), tuple(b.shape[1:])) if held else Block((0, 0), (0, 0)))
        t = expert_task_name(name, e)
        out[t] = PieceLayout(t, tuple(lay.full_shape[1:]), tuple(blocks))
    return out


def fsdp_modules(model: Any) -> list[nn.Module]:
    """The modules of ``model`` wrapped by FSDP2's ``fully_shard`` (empty for any other model)."""
    if not isinstance(model, nn.Module):
        return []
    # a model can only hold fully_shard modules once torch.distributed.fsdp is loaded: do not pay
    # its import (seconds) on the ZeRO-1 path
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_cls = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return [m for m in model.modules() if isinstance(m, module_cls)] if module_cls is not None else []


def is_fsdp2_model(model: Any) -> bool:
    """True when ``model`` (an ``nn.Module``) contains a module wrapped by FSDP2's ``fully_shard``."""
    return bool(fsdp_modules(model))


def fsdp_group_ranks(mesh_shape: tuple[int, ...], mesh_dim_names: tuple[str, ...], ranks: list[int]) -> list[list[int]]:
    """The shard groups of a mesh (one per ``dp_replicate`` index): the global ranks of its
    ``dp_shard x tp`` sub-mesh, sorted. ``mesh_dim_names``: each dimension's role
    (:func:`mesh_dim_roles`); ``ranks`` is the mesh's rank list in row-major order."""
    if "dp_replicate" not in mesh_dim_names:
        return [sorted(ranks)]
    axis = mesh_dim_names.index("dp_replicate")
    t = torch.tensor(ranks).view(mesh_shape).movedim(axis, 0)
    return [sorted(row.flatten().tolist()) for row in t]


def check_fsdp2_mesh(mesh: Any, world: int) -> Any:
    """The mesh an FSDP2 model was sharded on: a DeviceMesh over the whole world with distinct
    dimension names (their roles come from the placements: :func:`mesh_dim_roles`)."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh is None:
        raise ValueError(
            "an FSDP2 model needs mesh=: the DeviceMesh it was sharded on (fully_shard's dimension, optionally "
            "HSDP's replicate and TP's dimensions; any names, read from the placements)"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = tuple(mesh.mesh_dim_names or ())
    if "dp" in names:
        raise ValueError(
            "the model is sharded by FSDP2 (fully_shard) but the mesh has a 'dp' dimension, which is canzona's own ZeRO-1 "
            "path: mixing the two is not supported; name the mesh dimensions ('dp_replicate', 'dp_shard', 'tp')"
        )
    if len(names) != mesh.ndim or len(set(names)) != len(names):
        raise ValueError(f"an FSDP2 mesh needs one distinct name per dimension, got {names}")
    if mesh.size() != world:
        raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {world}; the mesh must cover the whole world")
    return mesh


def _is_shard0(pl: Any) -> bool:
    from torch.distributed.tensor import Shard

    return (isinstance(pl, Shard) or type(pl).__name__ == "_StridedShard") and getattr(pl, "dim", None) == 0


def dim_role_from_placements(placements: Sequence[Any]) -> str | None:
    """The role the placements of every parameter on one mesh dimension give it: all ``Shard(0)``
    (or ``_StridedShard(0)``): ``dp_shard``; all ``Replicate``: ``dp_replicate``; ``Shard(d)`` and
    ``Replicate`` otherwise: ``tp``; None for anything else (or no parameter on it)."""
    from torch.distributed.tensor import Replicate, Shard

    if not placements:
        return None
    if all(_is_shard0(pl) for pl in placements):
        return "dp_shard"
    if all(isinstance(pl, Replicate) for pl in placements):
        return "dp_replicate"
    if all(isinstance(pl, Replicate) or type(pl) is Shard for pl in placements):
        return "tp"
    return None


def mesh_dim_roles(names: Sequence[str], placements: Mapping[str, Sequence[Any]]) -> dict[str, str]:
    """Each mesh dimension's role (see the module docstring): a dimension named ``dp_replicate``,
    ``dp_shard`` or ``tp`` keeps that role (:func:`check_placements` checks it); any other gets the
    role its parameters' placements give it (``placements``: dimension name -> the placement of
    every trainable parameter on it). Refuses, in one line, a dimension that gets no role, two
    dimensions with one role, a mesh without ``dp_shard`` and roles out of order."""
    roles: dict[str, str] = {}
    for d in names:
        role = d if d in FSDP_MESH_DIMS else dim_role_from_placements(placements.get(d, ()))
        if role is None:
            seen = sorted({repr(pl) for pl in placements.get(d, ())})
            raise ValueError(
                f"mesh dimension {d!r}: its parameters' placements {seen or 'none'} give it no role on the FSDP2 path "
                "(Shard(0) on every parameter: fully_shard's; Replicate on every parameter: HSDP's; Shard(d)/Replicate: TP's); "
                "name it 'dp_shard', 'dp_replicate' or 'tp' if the placements are meant so"
            )
        roles[d] = role
    by_role: dict[str, list[str]] = {}
    for d, role in roles.items():
        by_role.setdefault(role, []).append(d)
    for role, dims in by_role.items():
        if len(dims) > 1:
            raise ValueError(
                f"mesh dimensions {dims} all read as {role!r} from their placements, which is ambiguous; "
                f"name the one fully_shard shards 'dp_shard' (and TP's 'tp', HSDP's 'dp_replicate')"
            )
    if "dp_shard" not in by_role:
        raise ValueError(f"no dimension of the mesh {tuple(names)} is fully_shard's (Shard(0) on every parameter); got roles {roles}")
    order = [roles[d] for d in names]
    if order != [r for r in FSDP_MESH_DIMS if r in order]:
        raise ValueError(f"FSDP2 mesh dimensions must come in the order {FSDP_MESH_DIMS} (outermost first); the mesh {tuple(names)} reads as {tuple(order)}")
    return roles


def _placement_ok(role: str, pl: Any, ndim: int) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    if role == "dp_shard":
        # Shard(0), or FSDP2's _StridedShard(0) when TP also cuts dim 0 (FSDP chunks the TP-local rows)
        return _is_shard0(pl)
    if role == "tp":
        return isinstance(pl, Replicate) or (type(pl) is Shard and 0 <= pl.dim < ndim)
    return isinstance(pl, Replicate)


def check_placements(name: str, p: torch.Tensor, mesh: Any, roles: Mapping[str, str] | None = None) -> int | None:
    """Refuse any piece layout the FSDP2 layout cannot serve; return the TP split dim (None: replicated).
    ``roles``: each mesh dimension's role (:func:`mesh_dim_roles`; default: its name)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        raise ValueError(
            f"{name}: not a DTensor; every trainable parameter of an FSDP2 model must be sharded by fully_shard "
            "(wrap the root module too)"
        )
    roles = dict(roles or {})
    pm = p.device_mesh
    pnames = tuple(pm.mesh_dim_names or ())
    if "dp_shard" not in [roles.get(d, d) for d in pnames]:
        raise ValueError(f"{name}: its mesh {pnames} has no dimension fully_shard shards it on; shard it with fully_shard(mesh=...)")
    names = tuple(mesh.mesh_dim_names)
    tp_dim: int | None = None
    for dim_name, pl in zip(pnames, p.placements):
        if dim_name not in names or pm.size(pnames.index(dim_name)) != mesh.size(names.index(dim_name)):
            raise ValueError(f"{name}: its mesh dimension {dim_name!r} is not a dimension of the same size in the optimizer's mesh {names}")
        role = roles.get(dim_name, dim_name)
        if not _placement_ok(role, pl, p.ndim):
            raise ValueError(
                f"{name}: placement {pl!r} on mesh dimension {dim_name!r} (role {role}) is not supported on the FSDP2 path "
                "(expected Shard(0) on dp_shard, Shard(d) or Replicate on tp, Replicate on dp_replicate)"
            )
        if role == "tp" and type(pl) is Shard:
            tp_dim = pl.dim
    return tp_dim


def _shard_dim(pl: Any) -> int | None:
    """The tensor dim a ``Shard`` (or FSDP2's ``_StridedShard``) cuts; None for anything else."""
    from torch.distributed.tensor import Shard

    return pl.dim if isinstance(pl, Shard) or type(pl).__name__ == "_StridedShard" else None


def check_expert_placements(name: str, p: torch.Tensor, mesh: Any, roles: Mapping[str, str]) -> int | None:
    """Refuse an expert stack's layout the FSDP2 layout cannot serve; return 1 when its layout cuts
    every expert (``Shard(1)``, or ``_StridedShard(1)``, on its shard dimension of more than one
    rank; ``Shard(1)`` or ``Shard(2)`` on TP's: torchtitan's colwise/rowwise experts without ep),
    None when every rank holds whole experts. Its mesh is either dimensions of the optimizer's mesh
    (fully_shard's, HSDP's ``Replicate``, TP's ``Replicate``, ``Shard(1)`` or ``Shard(2)``) or an expert mesh (expert parallelism: ``ep`` and the
    experts' own FSDP dimension, ``efsdp``, beside HSDP's ``Replicate`` dimension of the optimizer's
    mesh when it has one, never TP's) whose own dimensions span exactly the shard groups (one
    replica's ``dp_shard x tp`` ranks: beside tp, EP borrows TP's ranks as torchtitan builds it)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        raise ValueError(f"{name}: not a DTensor; every trainable parameter of an FSDP2 model must be sharded by fully_shard (wrap the root module too)")
    pm, names = p.device_mesh, tuple(mesh.mesh_dim_names)
    pnames = tuple(pm.mesh_dim_names or ())
    own = [d for d in pnames if d not in names]
    where = f"{name}: an expert stack on mesh {pnames} with {tuple(p.placements)}"
    if own:
        # the expert mesh's own dimensions, with HSDP's dimension of the optimizer's mesh fixed, must
        # span exactly the shard groups (one replica's dp_shard x tp ranks each): torchtitan's
        # ("dp_replicate"?, "efsdp", "ep") with efsdp x ep = dp_shard x cp x tp (EP borrows TP's ranks)
        if any(d in names and roles.get(d, d) == "tp" for d in pnames):
            raise ValueError(f"{where}: an expert mesh that also carries the optimizer's tp dimension (expert tensor parallelism) "
                             "is not supported on the FSDP2 path; it serves expert parallelism beside tp with the experts on a mesh "
                             "of their own, ('efsdp', 'ep') spanning TP's ranks and not cut by TP, as torchtitan 0.3 builds it, "
                             "and experts cut by TP on the optimizer's mesh without ep (Shard(1)/Shard(2) on tp)")
        proles = tuple(roles.get(d, d) if d in names else "experts" for d in pnames)
        theirs = sorted(fsdp_group_ranks(tuple(pm.mesh.shape), proles, pm.mesh.flatten().tolist()))
        groups = sorted(fsdp_group_ranks(tuple(mesh.mesh.shape), tuple(roles[d] for d in names), mesh.mesh.flatten().tolist()))
        if theirs != groups:
            hint = []
            if len(groups) > 1:
                hint.append("beside dp_replicate the expert mesh carries it too, outermost: torchtitan's ('dp_replicate', 'efsdp', 'ep')")
            if "tp" in roles.values():
                hint.append("beside tp it spans the dp_shard x tp ranks: efsdp x ep = dp_shard x tp, as torchtitan builds it")
            more = f" ({'; '.join(hint)})" if hint else ""
            raise ValueError(f"{where}: its dimensions {tuple(d for d in pnames if d in own)} span the ranks {theirs}, not the shard groups "
                             f"{groups}; the expert mesh must cover each shard group's ranks{more}")
    shard_cut = tp_cut = False
    for d, pl in zip(pnames, p.placements):
        k = pnames.index(d)
        if d in names and pm.size(k) != mesh.size(names.index(d)):
            raise ValueError(f"{name}: its mesh dimension {d!r} is not a dimension of the same size in the optimizer's mesh {names}")
        role = roles.get(d, d) if d in names else "experts"
        sd = _shard_dim(pl)
        if role == "tp" and sd is not None:
            # torchtitan's experts with tp and without ep: colwise Shard(1), rowwise Shard(2) per expert
            if type(pl) is not Shard or sd not in (1, 2):
                raise ValueError(f"{where}: {pl!r} on {d!r} splits the stack on its expert dimension by TP, which the FSDP2 path "
                                 "does not serve; TP cuts experts on dim 1 or 2 (torchtitan's colwise/rowwise experts), "
                                 "expert parallelism puts them on a mesh of their own, ('efsdp', 'ep')")
            tp_cut = tp_cut or pm.size(k) > 1
        elif role in ("dp_shard", "experts") and sd in (0, 1):
            shard_cut = shard_cut or (sd == 1 and pm.size(k) > 1)
        elif not (role in ("dp_replicate", "tp") and isinstance(pl, Replicate)):
            raise ValueError(f"{where}: placement {pl!r} on {d!r} is not served; expert stacks take Shard(0) (whole experts) or "
                             "Shard(1) (experts cut on their rows) on their shard and expert dimensions, Shard(1), Shard(2) "
                             "or Replicate on TP's, Replicate on HSDP's")
    if shard_cut and not tp_cut and not own and "tp" in roles.values():
        raise ValueError(f"{where}: experts cut by their shard (Shard(1)) and replicated over tp on the optimizer's mesh are not "
                         "supported on the FSDP2 path; beside tp cut them by TP too (Shard(1)/Shard(2) on tp, torchtitan's layout "
                         "without ep) or put them on an expert mesh of their own, ('efsdp', 'ep') spanning TP's ranks")
    return 1 if shard_cut or tp_cut else None


def _placements_by_dim(model: nn.Module, skip: Collection[str] = ()) -> dict[str, list[Any]]:
    """Mesh dimension name -> the placement on it of every trainable DTensor parameter not in
    ``skip`` (expert stacks, whose placements are their own: :func:`check_expert_placements`)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, list[Any]] = {}
    for n, p in model.named_parameters():
        if p.requires_grad and isinstance(p, DTensor) and n not in skip:
            for d, pl in zip(p.device_mesh.mesh_dim_names or (), p.placements):
                out.setdefault(d, []).append(pl)
    return out


class FSDP2Layout(Layout):
    """An FSDP2 (``fully_shard``) model (see the module docstring).

    Attributes the front end forwards: ``dp`` (``dp_replicate x dp_shard``), ``tp``, ``tp_rank``,
    ``replica`` (this rank's ``dp_replicate`` index), ``group_rank`` and ``group_size`` (this rank
    in its shard group), ``comm`` (the shard group's :class:`~canzona.runtime.comm.Comm`). ``plan``
    is a :class:`~canzona.plan.plan.Plan` for ``layout_kind="fsdp2"``, ``runtime`` an
    :class:`~canzona.runtime.shard.FSDPRuntime`."""

    engine = "fsdp2"
    refused = ("grad_reduce", "param_sync", "bucket_numel", "tp_dims", "param_views", "grad_views", "overlap_updates", "alpha", "tp_schedule")
    refused_reason = "of canzona's ZeRO-1 path, which do not apply to an FSDP2 model (FSDP2 owns the gradients and their reduction)"
    exposed = ("dp", "tp", "tp_rank", "replica", "group_rank", "group_size", "comm")

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        return is_fsdp2_model(model)

    def __init__(self, model: nn.Module, mesh: Any, settings: OptimizerSettings, *, device: torch.device) -> None:
        super().__init__(model, mesh, settings, device=device)
        if settings.strategy not in FSDP_STRATEGIES:
            raise ValueError(
                f"strategy {settings.strategy!r} needs canzona's own ZeRO-1 buffer and cannot run on an FSDP2 model; "
                f"choose one of {', '.join(FSDP_STRATEGIES)}"
            )
        self.mesh = mesh = check_fsdp2_mesh(mesh, dist.get_world_size())
        names = tuple(mesh.mesh_dim_names)
        self._decided = module_roles(model, settings.roles)
        stacks = {n for n, (role, _) in self._decided.items() if role == "experts"}
        #: mesh dimension name -> its role, read from every parameter but the expert stacks (an
        #: expert mesh's dimensions are the experts' own); ``dims``: role -> the dimension playing it
        self.roles = mesh_dim_roles(names, _placements_by_dim(model, stacks))
        self.dims = {role: d for d, role in self.roles.items()}
        self.size = {r: (mesh.size(names.index(self.dims[r])) if r in self.dims else 1) for r in FSDP_MESH_DIMS}
        self.dp, self.tp = self.size["dp_replicate"] * self.size["dp_shard"], self.size["tp"]
        self.tp_rank = mesh.get_local_rank(self.dims["tp"]) if "tp" in self.dims else 0
        self.replica = mesh.get_local_rank(self.dims["dp_replicate"]) if "dp_replicate" in self.dims else 0

    # ------------------------------------------------------------------ plan
    def make_plan(self, matrix_cls: type[torch.optim.Optimizer], plan: Any) -> Plan:
        s = self.settings
        trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("the model has no trainable parameters")
        records = []
        decided = self._decided
        for n, p in trainable:
            if decided[n][0] == "experts" and p.dim() == 3:  # 1: its shard cuts every expert (one task each)
                records.append(ParamSpec(n, tuple(p.shape), "experts", check_expert_placements(n, p, self.mesh, self.roles)))
                continue
            tp_dim = check_placements(n, p, self.mesh, self.roles)
            # TP's split dim with tp 1: DTensor's TP chunks may be uneven (see canzona.plan.shard)
            records.append(ParamSpec(n, tuple(p.shape), _fsdp_kind(n, p, *decided[n]), tp_dim))
        inputs = shard_inputs(
            type(self.model).__name__,
            layout="module",
            dp_shard=self.size["dp_shard"],
            tp=self.size["tp"],
            dp_replicate=self.size["dp_replicate"],
            optimizer=cost_key_for_class(matrix_cls),  # classes the registry does not know are costed as Muon
            strategy=s.strategy,
            cost=s.cost,
            cmax_bytes=cmax_to_bytes(s.cmax, self.size["tp"], torch.empty((), dtype=s.master_dtype).element_size()),
            grad_bytes=torch.empty((), dtype=s.master_dtype).element_size(),
        )
        if plan is None:
            plan = plan_shard(records, inputs)
        else:
            self._check_given_plan(plan, records, inputs)
        self.plan = plan
        self._kinds = {p.name: p.spec.kind for p in plan.params}
        return plan

    @staticmethod
    def _check_given_plan(plan: Any, records: list[ParamSpec], inputs: PlanInputs) -> None:
        if not isinstance(plan, Plan) or plan.inputs.layout_kind != "fsdp2":
            what = "a ZeRO-1 Plan" if isinstance(plan, Plan) else type(plan).__name__
            raise TypeError(f"plan must be a canzona Plan made for FSDP2 (layout_kind 'fsdp2') on an FSDP2 model, got {what}")
        if plan.inputs != inputs:
            raise ValueError(f"the plan was made for {plan.inputs}, this optimizer needs {inputs}")
        if list(plan.specs) != records:
            raise ValueError("the plan was made for other parameters than this model's (names, shapes, kinds or TP splits differ)")

    @property
    def planned(self) -> frozenset[str]:
        return frozenset(self._kinds)

    def role(self, name: str) -> str:
        return "matrix" if self._kinds[name] in ("matrix", "experts") else "elementwise"

    # ------------------------------------------------------------------ runtime
    def build(
        self, *, matrix_factory: OptimizerFactory, elementwise_factory: OptimizerFactory, comm_stats: CommStats, phase_times: PhaseTimer
    ) -> FSDPRuntime:
        plan = self.plan
        self.comm = Comm(self._shard_group(), comm_stats, wait_timeout_s=self.settings.status_timeout_s)
        self.group_rank, self.group_size = self.comm.rank, self.comm.size
        named = dict(self.model.named_parameters())
        layouts = self._exchange_layouts(plan, named)
        experts = [p.name for p in plan.params if p.spec.kind == "experts" and p.spec.tp_dim is None]
        _check_whole_experts(layouts, experts)  # the same layouts on every rank: all raise together
        cut = [p.name for p in plan.params if p.spec.kind == "experts" and p.spec.tp_dim is not None]
        tasks = {t: lay for n in cut for t, lay in expert_layouts(n, layouts[n]).items()}
        self.runtime = FSDPRuntime(
            {p.name: named[p.name] for p in plan.params},
            layouts,
            [list(zip(g.params, g.hosts)) for g in plan.micro_groups[0]],
            comm=self.comm,
            matrix_factory=matrix_factory,
            elementwise_factory=elementwise_factory,
            settings=self.settings,
            expert_names=experts,
            expert_layouts=tasks,
        )
        from canzona.runtime.fsdp_comm import bound_fsdp_collectives  # imports FSDP2's comm API: FSDP2 models only

        #: the ``fully_shard`` modules whose own collectives wait at most ``status_timeout_s`` ("" is the root)
        self.bounded_modules = bound_fsdp_collectives(self.model, self.settings.status_timeout_s, on=self.settings.bound_fsdp_collectives)
        return self.runtime

    def _shard_group(self) -> Any:
        """This rank's shard group (every rank creates every replica's group, in the same order)."""
        names = tuple(self.mesh.mesh_dim_names)
        roles = tuple(self.roles[d] for d in names)
        shard_groups = fsdp_group_ranks(tuple(self.mesh.mesh.shape), roles, self.mesh.mesh.flatten().tolist())
        me = dist.get_rank()
        group = None
        for ranks in shard_groups:
            g = dist.new_group(ranks, timeout=timedelta(seconds=GROUP_TIMEOUT_S)) if len(shard_groups) > 1 else None
            if me in ranks:
                group = g
        return group

    def _exchange_layouts(self, plan: Plan, named: Mapping[str, torch.Tensor]) -> dict[str, PieceLayout]:
        """Every rank's block of every parameter, from the DTensor placements (one all-gather of
        offsets and shapes over the shard group; not counted in ``comm_stats``)."""
        # DTensor's own rule for a rank's block (it understands FSDP2's _StridedShard under TP); a
        # private helper, also what torch.distributed.checkpoint uses. PieceLayout re-checks that
        # the gathered blocks tile every tensor exactly, so a changed rule fails loudly.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        nd = max(len(p.spec.shape) for p in plan.params)
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
            k = len(pp.spec.shape)
            blocks = tuple(Block(tuple(table[r][i][:k]), tuple(table[r][i][nd : nd + k])) for r in range(n))
            layouts[pp.name] = PieceLayout(pp.name, tuple(pp.spec.shape), blocks)
        return layouts

    def clip_grad_norm(self, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor:
        from canzona.runtime.clip import clip_fsdp

        return clip_fsdp(self.runtime, self.replica, max_norm, norm_type, error_if_nonfinite, foreach)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """FSDP2's gradient sync off on every ``fully_shard`` module while inside: each backward
        accumulates into FSDP2's unsharded gradients without reduce-scatter (or HSDP's all-reduce);
        the first backward after the block reduces the accumulated sum. On exit the sync is turned
        back on (FSDP2's default): a model whose sync the caller had switched off gets it back."""
        modules = fsdp_modules(self.model)
        for m in modules:
            m.set_requires_gradient_sync(False, recurse=False)  # type: ignore[operator]
        try:
            yield
        finally:
            for m in modules:
                m.set_requires_gradient_sync(True, recurse=False)  # type: ignore[operator]

    def refresh_masters(self) -> None:
        """Re-read the fp32 masters from the model (collective): call after overwriting parameters."""
        self.runtime.refresh_masters()

    def describe(self) -> str:
        i = self.plan.inputs
        return f"dp_replicate={i.dp_replicate}, dp_shard={i.dp_shard}, tp={i.tp}"

    # ------------------------------------------------------------------ checkpoint pieces
    def checkpoint_params(self) -> list[ParamRecord]:
        return [ParamRecord(p.name, s.shape, s.kind, s.tp_dim, s.kind != "matrix") for p in self.plan.params for s in (p.spec,)]

    def checkpoint_describe(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "strategy": self.settings.strategy,
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
        if eng.split:  # the split step: every matrix piece with its momentum, like an element-wise piece
            out += self._split_held(first)
        for name in () if eng.split else eng.hosted:
            m = eng.masters[name]
            canonical = first and (eng.tasks[name].host != -1 or self.group_rank == 0)
            base, e = split_task_name(name)
            if e is None:
                out.append(Held(name, (whole_box(m.shape),), m, eng.optimizer, m, False, canonical))
            else:  # one expert of a stack cut by its shard, at its place in the stack, state per expert
                out.append(Held(base, (((e, 0, 0), (1, *m.shape)),), m, eng.optimizer, m, True, canonical, e))
        for (name, k), m in rt.expert_masters.items():  # whole local experts: state shaped like the expert
            lay = rt.layouts[name]
            b = lay.blocks[self.group_rank]
            box = ((b.offset[0] + k, 0, 0), (1, *m.shape))
            out.append(Held(name, (box,), m, rt.expert_optimizer, m, True, first and lay.sources[self.group_rank], b.offset[0] + k))
        return out

    def _split_held(self, first: bool) -> list[Held]:
        """Under the split step, this rank's non-empty piece of every task with its momentum, state
        shaped like the piece: a matrix's block, or, for expert ``e`` of a stack cut by its shard,
        the block's rows of that expert at its place in the stack (a box ``(1, rows, cols)`` at
        ``(e, ...)``). Both are sliced regions of the parameter, so the consolidated state is the
        parameter's shape, as the whole-matrix step's (Muon's momentum is shaped like its matrix,
        so a stack's is also its per-expert ``(E, M, N)`` state)."""
        rt, eng = self.runtime, self.runtime.engine
        out = []
        for task, m in eng.pieces.items():
            lay = rt.task_layouts[task]
            b = lay.blocks[self.group_rank]
            if not b.numel:
                continue
            base, e = split_task_name(task)
            box = (b.offset, b.shape) if e is None else ((e, *b.offset), (1, *b.shape))
            out.append(Held(base, (box,), m, eng.optimizer, m, True, first and lay.sources[self.group_rank]))
        return out

    def model_pieces(self) -> list[ModelPiece]:
        rt = self.runtime
        out = []
        for name, p in rt.params.items():
            b = rt.layouts[name].blocks[self.group_rank]
            local = local_block(p.detach())
            out.append(ModelPiece(name, local, (b.offset, b.shape), rt.aliases_model(name, local)))
        return out

    def status_device(self) -> torch.device:
        return local_block(next(iter(self.runtime.params.values())).detach()).device

    def finish_load(self, steps: int) -> None:
        self.runtime.steps = int(steps)  # hosts hold full masters, loaded whole: nothing to re-assemble
        self.runtime.replicas.clear()  # every rank holds the loaded state
