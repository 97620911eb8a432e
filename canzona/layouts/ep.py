"""The expert-parallel layout: expert stacks sharded over an ``ep`` mesh dimension, the rest ZeRO-1.

How torchtitan lays out a mixture of experts: each ``(E, M, N)`` expert stack is a DTensor with
``Shard(0)`` on the ``ep`` dimension of the mesh (EP rank ``e`` holds experts
``[e E/ep, (e+1) E/ep)`` whole, tokens reach them through the dispatch all-to-all), and every other
parameter is a plain tensor replicated over all ranks. Meshes: ``("ep",)`` and ``("dp", "ep")``
(row-major, the mesh covering the world); beside tensor parallelism ``("ep", "tp")`` and
``("dp", "ep", "tp")``, where the dense parameters may be DTensors on ``mesh["tp"]`` (as
``parallelize_module`` makes them) and the experts either stay whole on every TP rank (on
``mesh["ep"]``, or ``(Shard(0), Replicate())`` on ``mesh["ep", "tp"]``) or, with expert tensor
parallelism (ETP, torchtitan's ``ExpertTensorParallel``), are ``(Shard(0), Shard(d))`` on
``mesh["ep", "tp"]``: each expert's rows (``d = 1``) or columns (``d = 2``) cut over ``tp``. The layout serves any model holding a DTensor parameter
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

With a ``tp`` dimension: the dense parameters are the ZeRO-1 layout's ``("dp", "tp")`` case with
``dp x ep`` DP ranks (the buffer over the ``dp x ep`` ranks of each TP coordinate, TP-split
matrices through :class:`~canzona.runtime.tp.TPEngine` over ``tp``, averaged over ``dp x ep``); the
expert stacks are partitioned over the ``dp x tp`` ranks of each EP coordinate. TP ranks see the
same tokens, so their expert gradients are equal copies, not partial sums: TP ranks other than 0
send theirs times zero (``DPRuntime(grad_contributes=False)``), so the group's sum is the sum over
``dp`` of one copy, divided by ``dp x ep`` as without TP.

With expert tensor parallelism every TP rank holds a different shard of each local expert, and
its gradient is that shard's whole gradient (the TP ranks computed the experts' outputs together
from the same tokens). The expert part is then a ZeRO-1 x TP runtime like the dense one: its
buffer over the ``dp`` ranks of each ``(ep, tp)`` coordinate (summed over ``dp``, divided by
``dp x ep``), each expert one TP task that a :class:`~canzona.runtime.tp.TPEngine` over ``tp``
assembles on its host, updates whole (bitwise the single-device optimizer on that ``(M, N)``
matrix) and returns in shards. Either every expert stack is TP-cut or none is.

Refused, one line each: a given ``plan=``, ``overlap_updates``, ``param_sync="lazy"``,
``tp_dims`` (see :attr:`EPLayout.refused`), a mesh other than the four above (other orders
included), an expert DTensor that is not ``Shard(0)`` on the ``ep`` dimension or whose experts do
not divide by ``ep``, experts cut by TP other than ETP's ``Shard(1)`` or ``Shard(2)`` on ``tp`` (an
uneven cut, a packed placement, a stack sharded on ``mesh["tp"]`` alone), some stacks TP-cut and
others not, and a DTensor that is neither an expert stack nor (with ``tp``) a dense parameter on
``mesh["tp"]``. ``clip_grad_norm_`` is one exchange over both parts.
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
from canzona.layouts.zero1 import Zero1Layout, differing_replicas, dp_held, model_pieces_of, refuse_different_replicas, tp_boxes
from canzona.optimizers import ELEMENTWISE_DEFAULT, cost_key_for_class
from canzona.plan.build import cmax_to_bytes
from canzona.plan.ep import EPPlan, plan_ep
from canzona.plan.plan import PlanInputs
from canzona.plan.strategies import get_strategy
from canzona.runtime.buffer import local_tensor
from canzona.runtime.checkpoint import Box, Held, ModelPiece, ParamRecord
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.dp import DPRuntime, elementwise_role
from canzona.runtime.ep import EPRuntime
from canzona.runtime.phases import PhaseTimer
from canzona.settings import OptimizerSettings
from canzona.specs import ParamSpec, check_transposed_support, module_roles, specs_from_module

__all__ = ["EPLayout", "ep_params"]

#: the one line for what is supported (completes every mesh refusal)
SUPPORTED = ("expert parallelism runs on canzona's ZeRO-1 path with a ('ep',), ('dp', 'ep'), ('ep', 'tp') or "
             "('dp', 'ep', 'tp') mesh")
#: what an expert stack's placements on ('ep', 'tp') may be (completes the ETP refusals)
ETP_PLACEMENTS = ("an expert stack on ('ep', 'tp') is (Shard(0), Replicate()) or, with expert tensor parallelism, "
                  "(Shard(0), Shard(1)) / (Shard(0), Shard(2)) with its rows or columns dividing by tp")
#: the mesh dimension names served, in this order (row-major, covering the world)
MESHES = (("ep",), ("dp", "ep"), ("ep", "tp"), ("dp", "ep", "tp"))


def ep_params(model: nn.Module) -> list[tuple[str, Any]]:
    """The model's parameters that are DTensors on a mesh with an ``ep`` dimension."""
    from torch.distributed.tensor import DTensor

    return [(n, p) for n, p in model.named_parameters()
            if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())]


class EPLayout(Layout):
    """Expert stacks sharded over ``ep``, dense parameters ZeRO-1 (see the module docstring).

    Attributes the front end forwards: ``dp`` (the mesh's ``dp`` size), ``ep``, ``tp``, ``dp_rank``,
    ``ep_rank``, ``tp_rank``, ``dense_comm``, ``expert_comm``, ``tp_comm``. ``plan`` is an :class:`~canzona.plan.ep.EPPlan`, ``runtime``
    an :class:`~canzona.runtime.ep.EPRuntime`."""

    engine = "ep"
    refused = ("overlap_updates", "param_sync", "tp_dims")
    refused_reason = (
        "not supported with expert parallelism (one status agreement covers the dense and the expert step, "
        "and TP splits are read from DTensor placements only)"
    )
    exposed = ("dp", "ep", "tp", "etp", "dp_rank", "ep_rank", "tp_rank", "dense_comm", "expert_comm", "tp_comm")

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
        self.tp = mesh.size(names.index("tp")) if "tp" in names else 1
        self.ep_rank = mesh.get_local_rank("ep")
        self.dp_rank = mesh.get_local_rank("dp") if "dp" in names else 0
        self.tp_rank = mesh.get_local_rank("tp") if "tp" in names else 0
        self.tp_comm: Comm | None = None
        #: expert tensor parallelism: every expert stack's rows or columns cut over ``tp``
        self.etp = False
        self._check_dtensors()

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
        if names not in MESHES:
            raise ValueError(f"mesh dimensions {names} are not supported with expert parallelism; {SUPPORTED}")
        if mesh.size() != world:
            raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {world}; the mesh must cover the whole world")
        return mesh

    def _check_dtensors(self) -> None:
        """Every DTensor is an expert stack ``Shard(0)`` over this mesh's ``ep`` dimension with whole
        experts per rank (on the ``ep`` sub-mesh, or on ``("ep", "tp")`` replicated over ``tp`` or,
        ETP, every stack cut over ``tp`` on its rows or columns), or, with a ``tp`` dimension, a dense
        parameter on the ``tp`` sub-mesh (``parallelize_module``'s). Sets :attr:`etp`."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        ep_ranks = self.mesh["ep"].mesh.tolist() if self.mesh.ndim > 1 else self.mesh.mesh.tolist()
        tp_ranks = self.mesh["tp"].mesh.tolist() if self.tp_named else None
        ep_tp_ranks = self.mesh["ep", "tp"].mesh.tolist() if self.tp_named else None
        cut: dict[str, bool] = {}  # expert stack -> TP-cut (ETP)
        for name, p in self.model.named_parameters():
            if not isinstance(p, DTensor):
                continue
            names, ranks, placements = p.device_mesh.mesh_dim_names, p.device_mesh.mesh.tolist(), tuple(p.placements)
            where = f"{name}: a DTensor on mesh {names} with {placements}"
            if names == ("tp",) and ranks == tp_ranks:
                if p.dim() == 3 and any(isinstance(pl, Shard) for pl in placements):
                    raise ValueError(f"{where}; an expert stack TP-cut on 'tp' is not supported with expert parallelism "
                                     "(experts are Shard(0) on 'ep' and whole on every TP rank)")
                continue  # a dense TP parameter
            if names == ("ep", "tp") and ranks == ep_tp_ranks:
                tp_pl = placements[1]
                etp = type(tp_pl) is Shard and tp_pl.dim in (1, 2) and p.dim() == 3 and p.shape[tp_pl.dim] % self.tp == 0
                if tp_pl != Replicate() and not etp:
                    raise ValueError(f"{where}; {ETP_PLACEMENTS}")
                cut[name] = etp
            elif names != ("ep",) or ranks != ep_ranks:
                dense = " or dense TP parameters on its 'tp' dimension" if self.tp_named else ""
                raise ValueError(f"{where}; under expert parallelism only expert stacks on the mesh's 'ep' dimension{dense} "
                                 f"are DTensors ({SUPPORTED})")
            if placements[0] != Shard(0) or p.dim() != 3:
                raise ValueError(f"{where}; an expert stack must be (E, M, N) with Shard(0) on 'ep' (each rank holds whole experts)")
            if p.shape[0] % self.ep:
                raise ValueError(f"{name}: {p.shape[0]} experts do not divide by ep={self.ep}; every EP rank must hold the same number")
            cut.setdefault(name, False)
        if len(set(cut.values())) > 1:
            whole, split = (next(n for n, c in cut.items() if c is v) for v in (False, True))
            raise ValueError(f"{whole}: whole on every TP rank while {split} is TP-cut; with expert tensor parallelism every "
                             "expert stack must be cut over 'tp' (or none)")
        self.etp = any(cut.values())

    @property
    def tp_named(self) -> bool:
        """Whether the mesh has a ``tp`` dimension (even of size 1)."""
        return "tp" in self.mesh.mesh_dim_names

    def _is_expert(self, p: Any) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())

    def check_optimizers(self, matrix_cls: type[torch.optim.Optimizer], ew_cls: type[torch.optim.Optimizer]) -> None:
        Zero1Layout.check_optimizers(self, matrix_cls, ew_cls)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ plan
    def _specs(self) -> tuple[list[ParamSpec], list[ParamSpec]]:
        """The dense specs (global shapes, TP splits read from the placements) and the local expert
        stacks ``(E/ep, M, N)``."""
        roles = module_roles(self.model, self.settings.roles)
        named = dict(self.model.named_parameters())
        dense: list[ParamSpec] = []
        local: list[ParamSpec] = []
        for name, p in named.items():
            if not p.requires_grad or not self._is_expert(p):
                continue
            if roles[name][0] != "experts":
                raise ValueError(f"{name}: sharded over 'ep' but its role is {roles[name][0]!r}; only an expert stack may be (roles=)")
            if self.etp:  # the local experts' full rows and columns, the TP cut read from the placement
                d = p.placements[1].dim
                local.append(ParamSpec(name, (p.shape[0] // self.ep, *p.shape[1:]), "experts", tp_dim=d, tp=self.tp))
            else:
                local.append(ParamSpec(name, tuple(p.to_local().shape), "experts"))
        if self.tp_named:  # the ZeRO-1 layout's reading of DTensor TP (specs_from_module), experts left out
            experts = {n for n, p in named.items() if self._is_expert(p)}
            dense = [sp for sp in specs_from_module(self.model, tp=self.tp, roles=self.settings.roles, exclude=experts)
                     if named[sp.name].requires_grad]
        else:
            for name, p in named.items():
                if p.requires_grad and not self._is_expert(p):
                    kind, transposed = roles[name]
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
            model=type(self.model).__name__, layout="module", dp=world, tp=self.tp,
            optimizer=ELEMENTWISE_DEFAULT if self.strategy_record.elementwise_only else cost_key_for_class(matrix_cls),
            strategy=s.strategy, tp_schedule=s.tp_schedule or default_tp_schedule(s.strategy),
            bucket_numel=s.bucket_numel if s.bucket_numel is not None else default_bucket_numel(world),
            alpha=s.alpha, cost=s.cost,
            cmax_bytes=cmax_to_bytes(s.cmax, self.tp, torch.empty((), dtype=s.master_dtype).element_size()),
            grad_bytes=torch.empty((), dtype=s.master_dtype).element_size(),
        )
        expert_numel = s.bucket_numel if s.bucket_numel is not None else default_bucket_numel(self.dp if self.etp else self.dp * self.tp)
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
        """Dense parameters must start equal on every rank (each TP rank's shard on the ranks of its
        TP coordinate), each local expert stack on the ranks holding the same experts (under ETP:
        the same TP shard of them; one checksum all-reduce over the world, as the ZeRO-1 layout)."""
        named = dict(self.model.named_parameters())
        dense = [pp.name for pp in self.plan.dense.params]
        experts = [pp.name for pp in self.plan.experts.params]
        # dense parameters: one slot each per TP coordinate; experts: one slot per EP coordinate
        # (per (EP, TP) coordinate under ETP)
        nd = len(dense) * self.tp
        cuts = self.tp if self.etp else 1
        coord = self.ep_rank * cuts + (self.tp_rank if self.etp else 0)
        mine = [(self.tp_rank * len(dense) + k, named[n]) for k, n in enumerate(dense)]
        mine += [(nd + coord * len(experts) + j, named[n]) for j, n in enumerate(experts)]
        where = [f"EP rank {e}" + (f", TP rank {t}" if self.etp else "") for e in range(self.ep) for t in range(cuts)]
        labels = dense * self.tp + [f"{n} ({w})" for w in where for n in experts]
        differ = sorted(set(differing_replicas(mine, labels, self.settings.status_timeout_s)), key=labels.index)
        refuse_different_replicas(differ, "the ranks that hold them", "every rank")

    # ------------------------------------------------------------------ runtime
    def build(
        self, *, matrix_factory: OptimizerFactory, elementwise_factory: OptimizerFactory, comm_stats: CommStats, phase_times: PhaseTimer
    ) -> EPRuntime:
        dense_group, expert_group = self._groups()
        # every collective the step launches waits at most status_timeout_s, as on the other layouts
        bound = self.settings.status_timeout_s
        self.dense_comm = Comm(dense_group, comm_stats, wait_timeout_s=bound)
        self.expert_comm = Comm(expert_group, comm_stats, wait_timeout_s=bound)
        self.tp_comm = Comm(self.mesh.get_group("tp"), comm_stats, wait_timeout_s=bound) if self.tp > 1 else None
        named = dict(self.model.named_parameters())
        common = dict(matrix_factory=matrix_factory, elementwise_factory=elementwise_factory, settings=self.settings)
        dense = DPRuntime(self.plan.dense, {p.name: named[p.name] for p in self.plan.dense.params}, dp_comm=self.dense_comm,
                          tp_engine_factory=self._tp_engine_factory(matrix_factory, self.plan.dense, self.dense_comm), **common)
        # expert gradients arrive summed over the EP ranks' tokens and are equal copies on the TP
        # ranks (they saw the same tokens): summed over dp (TP rank 0's copy), divided by dp x ep;
        # under ETP each TP rank's is its own shard's: summed over dp, the TP engine over tp
        experts = DPRuntime(self.plan.experts, {p.name: named[p.name] for p in self.plan.experts.params}, dp_comm=self.expert_comm,
                            grad_divisor=self.dp * self.ep, grad_contributes=self.etp or self.tp_rank == 0,
                            tp_engine_factory=self._tp_engine_factory(matrix_factory, self.plan.experts, self.expert_comm) if self.etp else None,
                            **common)
        self.runtime = EPRuntime(dense, experts, ep=self.ep, ep_rank=self.ep_rank, tp_rank=self.tp_rank, status_comm=dense.status_comm,
                                 timeout_s=self.settings.status_timeout_s, etp=self.etp)
        self.runtime.timer = phase_times
        self.runtime.attach()
        return self.runtime

    def _groups(self) -> tuple[Any, Any]:
        """The dense group (the ``dp x ep`` ranks of this rank's TP coordinate; the world without
        ``tp``) and the expert group (the ``dp x tp`` ranks of this rank's EP coordinate; under ETP
        the ``dp`` ranks of its ``(ep, tp)`` coordinate), each in rank order. Every rank creates
        every group, in the same order."""
        if not self.tp_named:
            if "dp" in self.mesh.mesh_dim_names:
                return None, self.mesh.get_group("dp")
            return None, dist.new_subgroups(group_size=1)[0]  # ("ep",): every rank is its own expert-DP group
        grid = self.mesh.mesh.reshape(self.dp, self.ep, self.tp)
        me = dist.get_rank()
        mine: list[Any] = []
        holders = ([grid[:, e, t].tolist() for e in range(self.ep) for t in range(self.tp)] if self.etp
                   else [grid[:, e, :].flatten().tolist() for e in range(self.ep)])
        for lists in ([grid[:, :, t].flatten().tolist() for t in range(self.tp)], holders):
            for ranks in lists:
                g = dist.new_group(sorted(ranks))
                if me in ranks:
                    mine.append(g)
        return mine[0], mine[1]

    def _tp_engine_factory(self, factory: OptimizerFactory, plan: Any, dp_comm: Comm) -> Any:
        """The TP micro-group engine of one part (the dense part, or the experts under ETP) over ``tp``."""
        if self.tp == 1:
            return None
        from canzona.runtime.tp import TPEngine

        dp_rank, comm, exchange = dp_comm.rank, self.tp_comm, self.settings.exchange
        return lambda masters: TPEngine(plan, dp_rank=dp_rank, comm=comm, optimizer_factory=factory, local_masters=masters, exchange=exchange)

    def clip_grad_norm(self, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor:
        names = [n for n, _ in self.model.named_parameters() if n in self._planned]
        return self.runtime.clip_grad_norm(names, max_norm, norm_type, error_if_nonfinite, foreach)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.runtime.dense.buffer.no_sync(), self.runtime.experts.buffer.no_sync():
            yield

    def describe(self) -> str:
        return f"dp={self.dp}, ep={self.ep}" + (f", tp={self.tp}" if self.tp_named else "") + (" (experts TP-cut: etp)" if self.etp else "")

    # ------------------------------------------------------------------ checkpoint pieces
    # Checkpoints are layout-independent: every region is in the full tensor's coordinates, so an
    # expert this rank holds as local expert k of its stack is written (and read) at global
    # expert ep_rank * E/ep + k, and a checkpoint of this layout loads under ZeRO-1 or FSDP2 and back.
    def _boxes(self, spec: ParamSpec, box: Box) -> list[tuple[Box, Box]]:
        """A box of this rank's local tensor as (local, full tensor) box pairs: an expert stack's
        offset by this EP rank's first expert (and under ETP by this TP rank's slice), a dense TP
        shard's by this TP rank's slice."""
        pairs = tp_boxes(spec, self.tp_rank, box)
        if spec.name not in self._expert_names:
            return pairs
        first = self.ep_rank * spec.shape[0]
        return [(local, ((full[0][0] + first, *full[0][1:]), full[1])) for local, full in pairs]

    def checkpoint_params(self) -> list[ParamRecord]:
        rt = self.runtime
        out = []
        for part in (self.plan.dense, self.plan.experts):
            for sp in part.specs:
                shape = (sp.shape[0] * self.ep, *sp.shape[1:]) if sp.name in self._expert_names else tuple(sp.shape)
                out.append(ParamRecord(sp.name, shape, sp.kind, sp.tp_dim, elementwise_role(part, sp.name) or sp.kind == "experts"))
        order = {n: k for k, (n, _) in enumerate(self.model.named_parameters())}
        assert rt is not None
        return sorted(out, key=lambda r: order[r.name])

    def checkpoint_describe(self) -> dict[str, Any]:
        inp = self.plan.dense.inputs
        return {"engine": self.engine, "strategy": inp.strategy, "dp": self.dp, "ep": self.ep, "tp": self.tp, "fingerprint": self.plan.fingerprint}

    def held(self) -> list[Held]:
        # dense replicas over TP: TP rank 0's copy is canonical; every expert piece has one owner
        first = {sp.name: self.ep_rank * sp.shape[0] for sp in self.plan.experts.specs}  # a TP host's expert k is global first + k
        return dp_held(self.runtime.dense, self._boxes, self.tp_rank) + dp_held(self.runtime.experts, self._boxes, expert_base=first)

    def model_pieces(self) -> list[ModelPiece]:
        return [piece for rt in self.runtime.parts for name, p in rt.params.items()
                for piece in model_pieces_of(name, local_tensor(p.detach()), rt.specs[name], self._boxes)]

    def status_device(self) -> torch.device:
        return self.runtime.dense.buffer.data.device

    def finish_load(self, steps: int) -> None:
        for rt in self.runtime.parts:
            if rt.tp_engine is not None:
                rt.tp_engine.refresh_masters()  # TP hosts re-assemble their full masters from the loaded shards
        for rt in self.runtime.parts:
            rt.steps = int(steps)
            rt.discard_grads()
            rt.replicas.clear()  # every rank holds the loaded state
        self.runtime.steps = int(steps)
