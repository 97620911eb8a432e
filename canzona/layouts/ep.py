"""The expert-parallel layout: expert stacks sharded over an ``ep`` mesh dimension, the rest ZeRO-1.

How torchtitan lays out a mixture of experts: each ``(E, M, N)`` expert stack is a DTensor with
``Shard(0)`` on the ``ep`` dimension of the mesh (EP rank ``e`` holds experts
``[e E/ep, (e+1) E/ep)`` whole, tokens reach them through the dispatch all-to-all), and every other
parameter is a plain tensor replicated over all ranks. Meshes: ``("ep",)`` and ``("dp", "ep")``
(row-major, the mesh covering the world). The layout serves any model holding a DTensor parameter
on a mesh dimension named ``ep`` and no FSDP2 module: FSDP2 models with expert parallelism
(torchtitan's ``fully_shard`` of every block with the experts on their own ``efsdp`` mesh) are
:class:`~canzona.layouts.fsdp2.FSDP2Layout`'s.

What each rank does (two :class:`~canzona.runtime.dp.DPRuntime`, one step:
:class:`~canzona.runtime.ep.EPRuntime`):

- dense parameters: canzona's ZeRO-1 buffer over all ``dp x ep`` ranks (Section 3), gradients
  averaged over all of them;
- expert stacks: this rank's local stacks ``(E/ep, M, N)``, E/ep matrix tasks each, over the
  expert-DP group (the ``dp`` dimension at this rank's ``ep`` coordinate): gradients summed over
  that group only, never over ``ep``, and divided by ``dp x ep`` (they arrive summed over the EP
  ranks' tokens). With ``dp = 1`` every rank updates its own whole experts with no optimizer
  communication; with ``dp > 1`` the local experts are partitioned over the group as ZeRO-1 does.
- planning (:func:`canzona.plan.ep.plan_ep`): the expert plan first; each rank's expert load is
  the dense plan's preload, so the dense tasks are balanced around it.

Refused, one line each: a given ``plan=``, ``overlap_updates``, ``param_sync="lazy"``,
``tp_dims`` (see :attr:`EPLayout.refused`), a ``tp`` mesh dimension, an expert
DTensor that is not ``Shard(0)`` on the ``ep`` dimension or whose experts do not divide by ``ep``,
and a DTensor that is not an expert stack. ``clip_grad_norm_`` is one exchange over both parts.
Checkpoints place every local expert at its global coordinates, so they load across layouts.
An expert stack held as a plain tensor is a dense parameter (replicated, its experts planned over
all ranks): the layout reads what is sharded from the DTensors, never from a second description.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.layouts.base import Layout, OptimizerFactory
from canzona.layouts.zero1 import Zero1Layout, differing_replicas, dp_held, refuse_different_replicas
from canzona.optimizers import ELEMENTWISE_DEFAULT, cost_key_for_class
from canzona.plan.build import cmax_to_bytes
from canzona.plan.ep import EPPlan, plan_ep
from canzona.plan.plan import PlanInputs
from canzona.plan.strategies import get_strategy
from canzona.runtime.buffer import local_tensor
from canzona.runtime.checkpoint import Held, ModelPiece, ParamRecord, whole_box
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.dp import DPRuntime, elementwise_role
from canzona.runtime.ep import EPRuntime
from canzona.runtime.phases import PhaseTimer
from canzona.settings import OptimizerSettings
from canzona.specs import ParamSpec, check_transposed_support, module_roles

__all__ = ["EPLayout", "ep_params"]

#: the one line for what is supported (completes every mesh refusal)
SUPPORTED = "expert parallelism runs on canzona's ZeRO-1 path with a ('ep',) or ('dp', 'ep') mesh"


def ep_params(model: nn.Module) -> list[tuple[str, Any]]:
    """The model's parameters that are DTensors on a mesh with an ``ep`` dimension."""
    from torch.distributed.tensor import DTensor

    return [(n, p) for n, p in model.named_parameters()
            if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())]


class EPLayout(Layout):
    """Expert stacks sharded over ``ep``, dense parameters ZeRO-1 (see the module docstring).

    Attributes the front end forwards: ``dp`` (expert-DP size), ``ep``, ``dp_rank``, ``ep_rank``,
    ``dense_comm``, ``expert_comm``. ``plan`` is an :class:`~canzona.plan.ep.EPPlan`, ``runtime``
    an :class:`~canzona.runtime.ep.EPRuntime`."""

    engine = "ep"
    refused = ("overlap_updates", "param_sync", "tp_dims")
    refused_reason = (
        "not supported with expert parallelism (one status agreement covers the dense and the expert step, "
        "and parameters are whole or expert-sharded, never TP-split)"
    )
    exposed = ("dp", "ep", "dp_rank", "ep_rank", "dense_comm", "expert_comm")

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        from canzona.layouts.fsdp2 import is_fsdp2_model

        return bool(ep_params(model)) and not is_fsdp2_model(model)

    def __init__(self, model: nn.Module, mesh: Any, settings: OptimizerSettings, *, device: torch.device) -> None:
        super().__init__(model, mesh, settings, device=device)
        try:
            self.strategy_record = get_strategy(settings.strategy)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        self.mesh = mesh = self._check_mesh(mesh, dist.get_world_size())
        names = mesh.mesh_dim_names
        self.ep = mesh.size(names.index("ep"))
        self.dp = mesh.size(names.index("dp")) if "dp" in names else 1
        self.ep_rank = mesh.get_local_rank("ep")
        self.dp_rank = mesh.get_local_rank("dp") if "dp" in names else 0
        self._check_experts()

    def _check_mesh(self, mesh: Any, world: int) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if mesh is None:  # the experts' own mesh, when it is the whole ("ep",) mesh
            meshes = {id(p.device_mesh): p.device_mesh for _, p in ep_params(self.model)}
            mesh = next(iter(meshes.values())) if len(meshes) == 1 else None
            if mesh is None or mesh.mesh_dim_names != ("ep",):
                raise ValueError(f"the experts are sharded over a sub-mesh: pass mesh= (the whole DeviceMesh); {SUPPORTED}")
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
        names = mesh.mesh_dim_names
        if names not in (("ep",), ("dp", "ep")):
            raise ValueError(f"mesh dimensions {names} are not supported with expert parallelism; {SUPPORTED}")
        if mesh.size() != world:
            raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {world}; the mesh must cover the whole world")
        return mesh

    def _check_experts(self) -> None:
        """Every DTensor is an expert stack, ``Shard(0)`` over this mesh's ``ep`` dimension, whole experts per rank."""
        from torch.distributed.tensor import DTensor, Shard

        ep_mesh = self.mesh if self.mesh.ndim == 1 else self.mesh["ep"]
        for name, p in self.model.named_parameters():
            if not isinstance(p, DTensor):
                continue
            where = f"{name}: a DTensor on mesh {p.device_mesh.mesh_dim_names} with {tuple(p.placements)}"
            if p.device_mesh.mesh_dim_names != ("ep",) or p.device_mesh.mesh.tolist() != ep_mesh.mesh.tolist():
                raise ValueError(f"{where}; under expert parallelism only expert stacks are DTensors, on the mesh's 'ep' dimension ({SUPPORTED})")
            if tuple(p.placements) != (Shard(0),) or p.dim() != 3:
                raise ValueError(f"{where}; an expert stack must be (E, M, N) with Shard(0) on 'ep' (each rank holds whole experts)")
            if p.shape[0] % self.ep:
                raise ValueError(f"{name}: {p.shape[0]} experts do not divide by ep={self.ep}; every EP rank must hold the same number")

    def check_optimizers(self, matrix_cls: type[torch.optim.Optimizer], ew_cls: type[torch.optim.Optimizer]) -> None:
        Zero1Layout.check_optimizers(self, matrix_cls, ew_cls)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ plan
    def _specs(self) -> tuple[list[ParamSpec], list[ParamSpec]]:
        """The dense specs (global shapes) and the local expert stacks ``(E/ep, M, N)``."""
        from torch.distributed.tensor import DTensor

        roles = module_roles(self.model, self.settings.roles)
        dense: list[ParamSpec] = []
        local: list[ParamSpec] = []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            kind, transposed = roles[name]
            if isinstance(p, DTensor):
                if kind != "experts":
                    raise ValueError(f"{name}: sharded over 'ep' but its role is {kind!r}; only an expert stack may be (roles=)")
                local.append(ParamSpec(name, tuple(p.to_local().shape), "experts"))
            else:
                dense.append(ParamSpec(name, tuple(p.shape), kind, transposed=transposed))
        return dense, local

    def make_plan(self, matrix_cls: type[torch.optim.Optimizer], plan: Any) -> EPPlan:
        from canzona.plan import default_bucket_numel, default_tp_schedule

        if plan is not None:
            raise ValueError("plan=: under expert parallelism canzona makes the plan itself (a dense and an expert part); pass plan=None")
        dense, local = self._specs()
        check_transposed_support(dense, matrix_cls, self.strategy_record.elementwise_only)
        s = self.settings
        world = self.dp * self.ep
        inputs = PlanInputs(
            model=type(self.model).__name__, layout="module", dp=world, tp=1,
            optimizer=ELEMENTWISE_DEFAULT if self.strategy_record.elementwise_only else cost_key_for_class(matrix_cls),
            strategy=s.strategy, tp_schedule=s.tp_schedule or default_tp_schedule(s.strategy),
            bucket_numel=s.bucket_numel if s.bucket_numel is not None else default_bucket_numel(world),
            alpha=s.alpha, cost=s.cost,
            cmax_bytes=cmax_to_bytes(s.cmax, 1, torch.empty((), dtype=s.master_dtype).element_size()),
            grad_bytes=torch.empty((), dtype=s.master_dtype).element_size(),
        )
        expert_numel = s.bucket_numel if s.bucket_numel is not None else default_bucket_numel(self.dp)
        self.plan = plan_ep(dense, local, inputs, ep=self.ep, expert_bucket_numel=expert_numel)
        self._expert_names = frozenset(sp.name for sp in local)
        self._planned = frozenset(pp.name for pp in self.plan.params)
        return self.plan

    @property
    def planned(self) -> frozenset[str]:
        return self._planned

    def role(self, name: str) -> str:
        part = self.plan.experts if name in self._expert_names else self.plan.dense
        return "elementwise" if elementwise_role(part, name) else "matrix"

    def check_replicas(self) -> None:
        """Dense parameters must start equal on every rank, each local expert stack on the ranks
        holding the same experts (one checksum all-reduce over the world, as the ZeRO-1 layout)."""
        named = dict(self.model.named_parameters())
        dense = [pp.name for pp in self.plan.dense.params]
        experts = [pp.name for pp in self.plan.experts.params]
        # dense parameters: one slot each (every rank); experts: one slot per EP coordinate
        mine = [(k, named[n]) for k, n in enumerate(dense)]
        mine += [(len(dense) + self.ep_rank * len(experts) + j, named[n]) for j, n in enumerate(experts)]
        labels = dense + [f"{n} (EP rank {e})" for e in range(self.ep) for n in experts]
        differ = differing_replicas(mine, labels, self.settings.status_timeout_s)
        refuse_different_replicas(differ, "the ranks that hold them", "every rank")

    # ------------------------------------------------------------------ runtime
    def build(
        self, *, matrix_factory: OptimizerFactory, elementwise_factory: OptimizerFactory, comm_stats: CommStats, phase_times: PhaseTimer
    ) -> EPRuntime:
        if "dp" in self.mesh.mesh_dim_names:
            expert_group = self.mesh.get_group("dp")
        else:  # ("ep",): every rank is its own expert-DP group
            expert_group, _ = dist.new_subgroups(group_size=1)
        # every collective the step launches waits at most status_timeout_s, as on the other layouts
        bound = self.settings.status_timeout_s
        self.dense_comm = Comm(None, comm_stats, wait_timeout_s=bound)
        self.expert_comm = Comm(expert_group, comm_stats, wait_timeout_s=bound)
        named = dict(self.model.named_parameters())
        common = dict(matrix_factory=matrix_factory, elementwise_factory=elementwise_factory, settings=self.settings)
        dense = DPRuntime(self.plan.dense, {p.name: named[p.name] for p in self.plan.dense.params}, dp_comm=self.dense_comm, **common)
        experts = DPRuntime(self.plan.experts, {p.name: named[p.name] for p in self.plan.experts.params}, dp_comm=self.expert_comm,
                            grad_divisor=self.dp * self.ep, **common)
        self.runtime = EPRuntime(dense, experts, ep=self.ep, ep_rank=self.ep_rank, status_comm=dense.status_comm,
                                 timeout_s=self.settings.status_timeout_s)
        self.runtime.timer = phase_times
        self.runtime.attach()
        return self.runtime

    def clip_grad_norm(self, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor:
        names = [n for n, _ in self.model.named_parameters() if n in self._planned]
        return self.runtime.clip_grad_norm(names, max_norm, norm_type, error_if_nonfinite, foreach)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.runtime.dense.buffer.no_sync(), self.runtime.experts.buffer.no_sync():
            yield

    def describe(self) -> str:
        return f"dp={self.dp}, ep={self.ep}"

    # ------------------------------------------------------------------ checkpoint pieces
    # Checkpoints are layout-independent: every region is in the full tensor's coordinates, so an
    # expert this rank holds as local expert k of its stack is written (and read) at global
    # expert ep_rank * E/ep + k, and a checkpoint of this layout loads under ZeRO-1 or FSDP2 and back.
    def _global_box(self, spec: ParamSpec, box: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if spec.name not in self._expert_names:
            return box
        off = list(box[0])
        off[0] += self.ep_rank * spec.shape[0]
        return tuple(off), box[1]

    def checkpoint_params(self) -> list[ParamRecord]:
        rt = self.runtime
        out = []
        for part in (self.plan.dense, self.plan.experts):
            for sp in part.specs:
                shape = (sp.shape[0] * self.ep, *sp.shape[1:]) if sp.name in self._expert_names else tuple(sp.shape)
                out.append(ParamRecord(sp.name, shape, sp.kind, None, elementwise_role(part, sp.name) or sp.kind == "experts"))
        order = {n: k for k, (n, _) in enumerate(self.model.named_parameters())}
        assert rt is not None
        return sorted(out, key=lambda r: order[r.name])

    def checkpoint_describe(self) -> dict[str, Any]:
        inp = self.plan.dense.inputs
        return {"engine": self.engine, "strategy": inp.strategy, "dp": self.dp, "ep": self.ep, "tp": 1, "fingerprint": self.plan.fingerprint}

    def held(self) -> list[Held]:
        return dp_held(self.runtime.dense, lambda spec, b: b) + dp_held(self.runtime.experts, self._global_box)

    def model_pieces(self) -> list[ModelPiece]:
        out = []
        for rt in self.runtime.parts:
            for name, p in rt.params.items():
                spec = rt.specs[name]
                out.append(ModelPiece(name, local_tensor(p.detach()), self._global_box(spec, whole_box(spec.shape))))
        return out

    def status_device(self) -> torch.device:
        return self.runtime.dense.buffer.data.device

    def finish_load(self, steps: int) -> None:
        for rt in self.runtime.parts:
            rt.steps = int(steps)
            rt.discard_grads()
            rt.replicas.clear()  # every rank holds the loaded state
        self.runtime.steps = int(steps)
