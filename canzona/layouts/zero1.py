"""The ZeRO-1 buffer layout: canzona's own gradient buffer over plain or DTensor-TP models.

The paper's setting (Sections 3 and 4). The model's parameters are whole on every DP rank (or
TP-local shards under DTensor tensor parallelism, or Megatron-style plain shards described by
``tp_dims``); gradients arrive through backward hooks into a flat, bucketed buffer
(:mod:`canzona.runtime.buffer`), each bucket's collective (reduce-scatter to the plan's cut points,
or all-reduce) launched as soon as it is complete; each DP rank updates the parameters the plan
(Algorithm 1, :mod:`canzona.plan`) gives it, TP-split matrices go through the micro-group engine
(Algorithm 2, :mod:`canzona.runtime.tp`), and values return by all-gather or broadcast
(:class:`canzona.runtime.dp.DPRuntime`).

The mesh is ``None`` (1-D DP over the world), ``("dp",)`` or ``("dp", "tp")``. Invariants: the
plan's specs are the model's trainable parameters with their TP splits; every rank checks at
construction that its DP replicas start bitwise equal; the rank that owns a piece is the one
rank whose optimizer state holds it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.layouts.base import Layout, OptimizerFactory
from canzona.optimizers import ELEMENTWISE_DEFAULT, cost_key_for_class
from canzona.plan.build import cmax_to_bytes
from canzona.plan.plan import Plan, PlanInputs
from canzona.plan.strategies import get_strategy, strategy_names
from canzona.runtime.agree import agree
from canzona.runtime.buffer import local_tensor
from canzona.runtime.checkpoint import Box, Held, ModelPiece, ParamRecord, box_index, flat_range_boxes, whole_box
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.dp import DPRuntime, elementwise_role
from canzona.runtime.integrity import tensor_checksum
from canzona.runtime.phases import PhaseTimer
from canzona.settings import OptimizerSettings
from canzona.specs import ParamSpec, check_transposed_support, specs_from_module, split_task_name

__all__ = ["Zero1Layout", "check_zero1_mesh", "differing_replicas", "dp_held", "model_pieces_of", "refuse_different_replicas", "tp_boxes"]


def check_zero1_mesh(mesh: Any, world: int, device: torch.device) -> Any:
    """The mesh of the ZeRO-1 layout (a 1-D ``("dp",)`` mesh over the world when ``mesh`` is None)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if mesh is None:
        return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed DeviceMesh (or None for 1-D DP), got {type(mesh).__name__}")
    if mesh.size() != world:
        raise ValueError(f"the mesh has {mesh.size()} ranks but the world has {world}; the mesh must cover the whole world")
    names = mesh.mesh_dim_names
    if names is not None and "dp_shard" in names:
        raise ValueError(
            f"the mesh {names} names FSDP2 dimensions but the model holds no fully_shard module; shard the model "
            "with fully_shard first, or use a ('dp',) / ('dp', 'tp') mesh for canzona's own ZeRO-1 path"
        )
    if mesh.ndim == 1 and names not in (None, ("dp",)):
        raise ValueError(f"a 1-D mesh must be named ('dp',), got {names}")
    if mesh.ndim > 1 and (names is None or "dp" not in names or set(names) - {"dp", "tp"} or mesh.ndim != 2):
        raise ValueError(f"a 2-D mesh needs dimensions named ('dp', 'tp'), got {names}")
    return mesh


class Zero1Layout(Layout):
    """Canzona's ZeRO-1 buffer over a plain or DTensor-TP model (see the module docstring).

    Attributes the front end forwards: ``dp``, ``tp``, ``dp_rank``, ``tp_rank``, ``dp_comm``,
    ``tp_comm``. ``plan`` is a :class:`~canzona.plan.plan.Plan`, ``runtime`` a
    :class:`~canzona.runtime.dp.DPRuntime`."""

    engine = "dp"
    exposed = ("dp", "tp", "dp_rank", "tp_rank", "dp_comm", "tp_comm")

    @classmethod
    def serves(cls, model: nn.Module) -> bool:
        return True  # the fallback: any model no other layout claims

    def __init__(self, model: nn.Module, mesh: Any, settings: OptimizerSettings, *, device: torch.device) -> None:
        super().__init__(model, mesh, settings, device=device)
        try:
            self.strategy_record = get_strategy(settings.strategy)
        except ValueError as exc:  # a PlanError: a user's bad argument is a plain ValueError here
            raise ValueError(str(exc)) from None
        self.mesh = mesh = check_zero1_mesh(mesh, dist.get_world_size(), device)
        names = mesh.mesh_dim_names or ("dp",)
        self.dp = mesh.size(names.index("dp"))
        self.tp = mesh.size(names.index("tp")) if "tp" in names else 1
        self.dp_rank = mesh.get_local_rank("dp") if mesh.ndim > 1 else dist.get_rank(mesh.get_group())
        self.tp_rank = mesh.get_local_rank("tp") if "tp" in names else 0

    def check_optimizers(self, matrix_cls: type[torch.optim.Optimizer], ew_cls: type[torch.optim.Optimizer]) -> None:
        """``zero1`` cuts matrices at equal chunks: it runs only an element-wise optimizer."""
        strategy = self.settings.strategy
        if self.strategy_record.elementwise_only and matrix_cls is not ew_cls and matrix_cls is not torch.optim.AdamW:
            others = ", ".join(n for n in strategy_names() if not get_strategy(n).elementwise_only)
            raise ValueError(
                f"{strategy} cuts matrices at equal chunks, so it can only run an element-wise optimizer; got {matrix_cls.__name__}. "
                f"Use optimizer='adamw' or a strategy that keeps matrices whole ({others}) for matrix optimizers"
            )

    # ------------------------------------------------------------------ plan
    def make_plan(self, matrix_cls: type[torch.optim.Optimizer], plan: Any) -> Plan:
        s = self.settings
        # frozen parameters (requires_grad=False) are not the optimizer's: no buffer slot, no owner
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        specs = [sp for sp in specs_from_module(self.model, tp_dims=s.tp_dims, tp=self.tp, roles=s.roles) if sp.name in trainable]
        if not specs:
            raise ValueError("the model has no trainable parameters")
        check_transposed_support(specs, matrix_cls, self.strategy_record.elementwise_only)
        if plan is None:
            plan = self._plan(specs, matrix_cls)
        else:
            self._check_given_plan(plan, specs)
        self.plan = plan
        self._planned = frozenset(pp.name for pp in plan.params)
        return plan

    def _plan(self, specs: list[ParamSpec], matrix_cls: type[torch.optim.Optimizer]) -> Plan:
        from canzona.plan import default_bucket_numel, default_tp_schedule, make_plan

        s = self.settings
        inputs = PlanInputs(
            model=type(self.model).__name__,
            layout="module",
            dp=self.dp,
            tp=self.tp,
            # the registry's cost key of the class (classes it does not know are costed as Muon); an
            # element-wise-only strategy runs every parameter through the element-wise optimizer
            optimizer=ELEMENTWISE_DEFAULT if self.strategy_record.elementwise_only else cost_key_for_class(matrix_cls),
            strategy=s.strategy,
            tp_schedule=s.tp_schedule or default_tp_schedule(s.strategy),
            bucket_numel=s.bucket_numel if s.bucket_numel is not None else default_bucket_numel(self.dp),
            alpha=s.alpha,
            cost=s.cost,
            cmax_bytes=cmax_to_bytes(s.cmax, self.tp, torch.empty((), dtype=s.master_dtype).element_size()),
            grad_bytes=torch.empty((), dtype=s.master_dtype).element_size(),
        )
        return make_plan(specs, inputs)

    def _check_given_plan(self, plan: Any, specs: list[ParamSpec]) -> None:
        if not isinstance(plan, Plan) or plan.inputs.layout_kind != "zero1":
            what = "an FSDP2 plan (layout_kind 'fsdp2')" if isinstance(plan, Plan) else type(plan).__name__
            raise TypeError(f"plan must be a canzona Plan for the ZeRO-1 layout, got {what}")
        if plan.inputs.dp != self.dp or plan.inputs.tp != self.tp:
            raise ValueError(f"the plan is for dp={plan.inputs.dp} x tp={plan.inputs.tp}, the mesh is dp={self.dp} x tp={self.tp}")
        if plan.inputs.strategy != self.settings.strategy:
            raise ValueError(f"the plan is for strategy {plan.inputs.strategy!r}, not {self.settings.strategy!r}")
        if {sp.name: sp for sp in plan.specs} != {sp.name: sp for sp in specs}:
            raise ValueError("the plan was made for other parameters than this model's (names, shapes, kinds or TP splits differ)")

    @property
    def planned(self) -> frozenset[str]:
        return self._planned

    def role(self, name: str) -> str:
        # under zero1 every parameter is element-wise, the matrix group empty
        return "elementwise" if elementwise_role(self.plan, name) else "matrix"

    def check_replicas(self) -> None:
        """Replicas must start equal: every DP rank's copy of each parameter (its TP-local shard)
        is compared through a 62-bit checksum of its bytes (one all-reduce over the world group,
        once). Different seeds or a skipped broadcast are refused on every rank, naming the
        parameters; under ``sc`` they would otherwise stay different forever."""
        planned = [pp.name for pp in self.plan.params]
        named = dict(self.model.named_parameters())
        n = len(planned)
        # one slot per TP rank and parameter: each TP rank's shard is compared across DP ranks only
        differ = differing_replicas([(self.tp_rank * n + k, named[name]) for k, name in enumerate(planned)],
                                    [name for _ in range(self.tp) for name in planned], self.settings.status_timeout_s)
        refuse_different_replicas(sorted(set(differ)), "DP ranks", "every DP rank")

    # ------------------------------------------------------------------ runtime
    def build(
        self, *, matrix_factory: OptimizerFactory, elementwise_factory: OptimizerFactory, comm_stats: CommStats, phase_times: PhaseTimer
    ) -> DPRuntime:
        mesh = self.mesh
        dp_group = mesh.get_group("dp") if mesh.ndim > 1 else mesh.get_group()
        bound = self.settings.status_timeout_s  # every wait of the step's collectives (canzona.runtime.comm)
        self.dp_comm = Comm(dp_group, comm_stats, wait_timeout_s=bound)
        self.tp_comm = Comm(mesh.get_group("tp"), comm_stats, wait_timeout_s=bound) if self.tp > 1 else None
        named = dict(self.model.named_parameters())
        self.runtime = DPRuntime(
            self.plan,
            {p.name: named[p.name] for p in self.plan.params},
            dp_comm=self.dp_comm,
            matrix_factory=matrix_factory,
            elementwise_factory=elementwise_factory,
            tp_engine_factory=self._tp_engine_factory(matrix_factory),
            settings=self.settings,
        )
        self.runtime.timer = phase_times
        self.runtime.attach()
        if self.runtime.lazy:
            self.runtime.install_forward_hooks(self.model)
        return self.runtime

    def _tp_engine_factory(self, factory: OptimizerFactory) -> Any:
        if self.tp == 1:
            return None
        from canzona.runtime.tp import TPEngine

        plan, dp_rank, comm, exchange = self.plan, self.dp_rank, self.tp_comm, self.settings.exchange
        return lambda masters: TPEngine(plan, dp_rank=dp_rank, comm=comm, optimizer_factory=factory, local_masters=masters, exchange=exchange)

    def clip_grad_norm(self, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor:
        from canzona.runtime.clip import clip_zero1

        return clip_zero1(self.runtime, self.tp_rank, max_norm, norm_type, error_if_nonfinite, foreach)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with self.runtime.buffer.no_sync():
            yield

    def describe(self) -> str:
        return f"dp={self.dp}, tp={self.tp}"

    # ------------------------------------------------------------------ checkpoint pieces
    def checkpoint_params(self) -> list[ParamRecord]:
        return [
            ParamRecord(sp.name, tuple(sp.shape), sp.kind, sp.tp_dim, elementwise_role(self.plan, sp.name) or sp.kind == "experts")
            for sp in self.plan.specs
        ]

    def checkpoint_describe(self) -> dict[str, Any]:
        inp = self.plan.inputs
        return {
            "engine": self.engine,
            "strategy": inp.strategy,
            "dp": inp.dp,
            "tp": inp.tp,
            "fingerprint": self.plan.fingerprint,
            "plan_inputs": {f.name: getattr(inp, f.name) for f in fields(inp)},
        }

    def _boxes(self, spec: ParamSpec, box: Box) -> list[tuple[Box, Box]]:
        return tp_boxes(spec, self.tp_rank, box)

    def held(self) -> list[Held]:
        return dp_held(self.runtime, self._boxes, self.tp_rank)

    def model_pieces(self) -> list[ModelPiece]:
        rt = self.runtime
        return [piece for name, p in rt.params.items() for piece in model_pieces_of(name, local_tensor(p.detach()), rt.specs[name], self._boxes)]

    def status_device(self) -> torch.device:
        return self.runtime.buffer.data.device

    def finish_load(self, steps: int) -> None:
        rt = self.runtime
        if rt.tp_engine is not None:
            rt.tp_engine.refresh_masters()  # hosts re-assemble their full masters from the loaded shards
        rt.steps = int(steps)
        rt.discard_grads()
        rt.replicas.clear()  # every rank holds the loaded state


def differing_replicas(mine: list[tuple[int, torch.Tensor]], labels: list[str], timeout_s: float) -> list[str]:
    """The labels of the slots whose copies differ between the ranks that fill them: this rank puts
    a 62-bit checksum ``c`` of each of its tensors' local bytes, and ``-c``, into its slots of
    ``mine``; one MAX all-reduce over the world (a status exchange) gives every slot the largest
    ``c`` and the negated smallest one, equal exactly when every rank filling it holds the same bytes."""
    lowest = torch.iinfo(torch.int64).min
    flags = torch.full((len(labels), 2), lowest, dtype=torch.int64)
    for k, t in mine:
        c = tensor_checksum(local_tensor(t.detach()))
        flags[k, 0], flags[k, 1] = c, -c
    reduced = agree(None, "checking parameter replicas", flags=flags.reshape(-1), timeout_s=timeout_s)
    assert reduced is not None
    r = reduced.cpu().view(-1, 2)
    return [labels[k] for k in range(len(labels)) if int(r[k, 0]) != -int(r[k, 1])]


def refuse_different_replicas(differ: list[str], across: str, every: str) -> None:
    """One line on every rank when replicas start different (different seeds, a skipped broadcast)."""
    if differ:
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise RuntimeError(
            f"parameter values differ across {across} at construction: {', '.join(differ[:3])}{more}; "
            f"{every} must start from the same model (same seed, or broadcast the parameters first)"
        )


def tp_boxes(spec: ParamSpec, tp_rank: int, box: Box) -> list[tuple[Box, Box]]:
    """Box ``box`` of TP rank ``tp_rank``'s local shard of ``spec`` as (local box, box of the full
    tensor) pairs whose local boxes cover ``box`` in its flat (row-major) order.

    One pair for a parameter that is not TP-split (the same box) or split in one block (offset by
    the rank's slice). A packed stack (``tp_blocks`` = b > 1, transformers' ``packed_colwise``)
    holds rows ``[r m, (r + 1) m)`` of each of its b blocks of the split dim (m = its local rows
    per block): its local block j sits at full rows ``j b_full + r m``, so a box crossing local
    blocks is cut at their bounds, and to keep the flat order, first into one box per index of the
    dims before the split dim."""
    if not spec.tp_split:
        return [(box, box)]
    d = spec.tp_dim
    assert d is not None
    local_rows = spec.local_shape[d]
    off, size = box
    if spec.tp_blocks == 1:
        moved = list(off)
        moved[d] += tp_rank * local_rows
        return [(box, (tuple(moved), size))]
    m = local_rows // spec.tp_blocks
    full_block = spec.shape[d] // spec.tp_blocks
    out: list[tuple[Box, Box]] = []
    for lead in itertools.product(*(range(o, o + n) for o, n in zip(off[:d], size[:d]))):
        start, stop = off[d], off[d] + size[d]
        while start < stop:
            j = start // m
            end = min(stop, (j + 1) * m)
            sizes = (*(1,) * d, end - start, *size[d + 1 :])
            local = ((*lead, start, *off[d + 1 :]), sizes)
            full = ((*lead, j * full_block + tp_rank * m + (start - j * m), *off[d + 1 :]), sizes)
            out.append((local, full))
            start = end
    return out


def model_pieces_of(name: str, local: torch.Tensor, spec: ParamSpec, boxes: Any) -> list[ModelPiece]:
    """The model's local tensor of parameter ``name`` as :class:`ModelPiece` s: one for the whole
    tensor, or (a packed stack) one view per box of ``boxes(spec, whole local box)``."""
    pairs = boxes(spec, whole_box(spec.local_shape))
    if len(pairs) == 1:
        return [ModelPiece(name, local, pairs[0][1])]
    return [ModelPiece(name, local[box_index(loc)], full) for loc, full in pairs]


def dp_held(rt: DPRuntime, boxes: Any, tp_rank: int = 0, expert_base: Mapping[str, int] | None = None) -> list[Held]:
    """What one :class:`DPRuntime` holds, as checkpoints see it: every owned piece's region (boxes
    of the local tensor mapped to the full tensor by ``boxes(spec, box)``, (local, full) pairs as
    :func:`tp_boxes` makes them: a TP shard's offset, a packed stack's blocks, an EP rank's first
    expert), its master and state, and the TP hosts' full-shape state (``expert_base``: the global
    index of a stack's local expert 0, for a TP host's expert tasks under expert parallelism)."""
    # every DP rank holds the same values under sc: DP rank 0's copy is canonical
    replica = rt.plan.every_rank_updates and rt.dp_rank != 0
    out: list[Held] = []
    # the TP engine's split step keeps each TP shard's state with the shard, shaped like it
    split_tp = rt.tp_engine is not None and rt.tp_engine.split
    for pc in rt.pieces:
        spec = rt.specs[pc.name]
        region = tuple(full for b in flat_range_boxes(tuple(spec.local_shape), pc.start, pc.end) for _, full in boxes(spec, b))
        m = rt.masters[pc]
        opt = {"elementwise": rt.elementwise_opt, "matrix": rt.matrix_opt, "tp": rt.tp_engine.optimizer if split_tp else None}.get(pc.role)
        # replicated across TP: TP rank 0's copy is canonical
        canonical = not replica and (spec.tp_split or tp_rank == 0)
        # an expert's state is shaped like its (M, N) master and re-sliced like the stack
        # (a TP piece holds state only under the split step, sliced like its shard)
        sliced = split_tp if pc.role == "tp" else (pc.role == "elementwise" or pc.expert is not None)
        # the expert's index in the full stack is where its box starts along dim 0 (box_of maps an
        # EP rank's local expert k to ep_rank * E_local + k); a TP piece of an expert is a TP shard,
        # whose state (if any) is sliced like the shard, not one expert's whole entry
        expert = region[0][0][0] if pc.expert is not None and pc.role != "tp" else None
        out.append(Held(pc.name, region, m, opt, m if opt is not None else None, sliced, canonical, expert))
    eng = rt.tp_engine
    if eng is not None and not eng.split:
        # TP hosts hold each task's full state (its full master is re-assembled from the shards);
        # under the sync schedule every TP rank holds it: TP rank 0's is canonical
        for name in eng.hosted:
            canonical = not replica and (not eng.sync or tp_rank == 0)
            base, k = split_task_name(name)  # one expert (name[k]) of a TP-split stack: its (M, N) box and state entry
            shape = rt.specs[base].shape
            if k is not None:
                k += (expert_base or {}).get(base, 0)
            box = whole_box(shape) if k is None else ((k,) + (0,) * (len(shape) - 1), (1, *shape[1:]))
            out.append(Held(base, (box,), None, eng.optimizer, eng.masters[name], k is not None, canonical, k))
    return out
