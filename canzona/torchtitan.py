"""canzona in torchtitan: an ``OptimizersContainer`` that torchtitan's trainer builds from its config.

torchtitan (0.3.0) builds its optimizer with ``config.optimizer.build(model_parts=...)``, schedules
it with ``LRSchedulersContainer`` (one ``LambdaLR`` per optimizer the container yields), clips with
``clip_grad_norm_`` over the model's FSDP2 (DTensor) gradients and checkpoints
``{"optimizer": container}`` with ``torch.distributed.checkpoint`` (the container is a
``Stateful``). Put :class:`CanzonaOptimizers.Config` where the config names the optimizer::

    from canzona.torchtitan import CanzonaOptimizers

    config.optimizer = CanzonaOptimizers.Config(
        name="muon", strategy="lb-asc", optimizer_kwargs={"lr": 0.02},
        elementwise_kwargs={"lr": 3e-4, "weight_decay": 0.1})

The container holds one :class:`canzona.DistributedOptimizer` over the (single) model part, on
the FSDP2 layout (:mod:`canzona.layouts.fsdp2`). The mesh is read from the parameters (their
DTensor ``device_mesh``), and each mesh dimension's role from the placements, so torchtitan's
names (``fsdp``, ``dp_shard_cp``, ``dp_replicate``, ``tp``) work as they are. ``step``,
``zero_grad``, ``state_dict``/``load_state_dict`` and the parameter groups the scheduler edits
(``"matrix"`` and ``"elementwise"``) are the DistributedOptimizer's. Refused in one line:
pipeline parallelism (several model parts), a model that is not FSDP2-sharded, parameters on
several meshes (expert parallelism's own mesh), a mesh that does not cover the world, and
torchtitan's ``param_groups`` (canzona assigns roles itself: ``roles=``).

Checkpoint form (:func:`dcp_state_dict`, :func:`load_dcp_state_dict`): every rank returns the
regions it holds (fp32 masters and optimizer state) as DTensors over the mesh whose local tensor
lists those regions at their global offsets, the regions of
:func:`canzona.runtime.dcp.save_sharded`, so DCP de-duplicates replicas and re-shards across
layouts; plus a hash of each parameter's state entry names, the step count and the numeric
hyperparameters as 0-dim tensors. A fresh optimizer has no state tensors for DCP to read into,
so the targets of a parameter without state are zero-filled tensors shaped by one lr-0 step of a
throw-away instance of its optimizer class on a copy of the master (the real optimizer and model
are untouched); the saved name hash still says "no state", so an unstepped optimizer saves none
and loads none.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.distributed import DistributedOptimizer

__all__ = ["CanzonaOptimizers", "dcp_state_dict", "load_dcp_state_dict", "model_mesh", "resolve_name"]

try:  # torchtitan is an optional extra: canzona imports without it
    from torchtitan.components.optimizer import OptimizersContainer as _Base
except ImportError as exc:  # pragma: no cover - exercised where torchtitan is absent
    _Base = None  # type: ignore[assignment,misc]
    _MISSING = f"canzona.torchtitan needs torchtitan ({exc}); pip install 'canzona[torchtitan]'"
else:
    _MISSING = ""

STEPS_KEY = "canzona.steps"
HYPER_PREFIX = "canzona.hyper."


def resolve_name(name: Any) -> Any:
    """A config's optimizer: a canzona name (``muon``, ``shampoo``, ``soap``, ``adamw`` ...), a
    ``torch.optim.<Class>`` path (read from ``torch.optim``, nothing imported), or a class."""
    if isinstance(name, str) and name.startswith("torch.optim."):
        cls = getattr(torch.optim, name.removeprefix("torch.optim."), None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ValueError(f"{name!r} is not a torch.optim optimizer class")
        return cls
    return name


def model_mesh(model: nn.Module) -> Any:
    """The DeviceMesh every trainable parameter of ``model`` lives on (FSDP2 ``fully_shard``
    parameters are DTensors); one line refusing anything else."""
    from torch.distributed.tensor import DTensor

    from canzona.layouts.fsdp2 import is_fsdp2_model

    if not is_fsdp2_model(model):
        raise ValueError(
            "canzona.torchtitan serves FSDP2 (fully_shard) models; torchtitan shards with FSDP2 when its "
            "parallelize function runs (parallelism.data_parallel_shard_degree)"
        )
    meshes: dict[tuple[Any, ...], tuple[Any, str]] = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not isinstance(p, DTensor):
            raise ValueError(f"{n}: not a DTensor; every trainable parameter must be sharded by fully_shard (wrap the root module too)")
        m = p.device_mesh
        meshes.setdefault((tuple(m.mesh_dim_names or ()), tuple(m.mesh.flatten().tolist()), tuple(m.mesh.shape)), (m, n))
    if not meshes:
        raise ValueError("the model has no trainable parameters")
    if len(meshes) > 1:
        (a, na), (b, nb) = list(meshes.values())[:2]
        raise ValueError(
            f"the parameters live on {len(meshes)} meshes ({na} on {a.mesh_dim_names}, {nb} on {b.mesh_dim_names}); "
            "canzona.torchtitan needs one mesh for all of them (expert parallelism's own mesh is not supported)"
        )
    mesh = next(iter(meshes.values()))[0]
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"the parameters' mesh {mesh.mesh_dim_names} covers {mesh.size()} of {dist.get_world_size()} ranks "
            "(pipeline parallelism?); canzona.torchtitan needs a mesh over the whole world"
        )
    return mesh


# ------------------------------------------------------------------------------ checkpoint form
# Until DistributedOptimizer.state_dict() is itself per-rank and DCP-Stateful, the container
# writes this form (see the module docstring); the two functions below are the only code to
# replace then.


def _keys_code(keys: Any) -> int:
    raw = "|".join(sorted(str(k) for k in keys)).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") & ((1 << 62) - 1)


def _probe_state(h: Any) -> dict[str, Any]:
    """Zero-filled state shaped as ``h``'s optimizer would create it: one lr-0 step with a zero
    gradient of a throw-away instance over a copy of the master."""
    opt, param = h.optimizer, h.param
    group = next((g for g in opt.param_groups if any(p is param for p in g["params"])), opt.param_groups[0])
    copy = param.detach().clone().requires_grad_(True)
    probe = type(opt)([copy])
    probe.param_groups[0].update({k: v for k, v in group.items() if k != "params"}, lr=0.0)
    copy.grad = torch.zeros_like(copy)
    probe.step()
    return {k: (torch.zeros_like(v) if torch.is_tensor(v) else v) for k, v in probe.state.get(copy, {}).items()}


def _number(v: Any) -> torch.Tensor | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return torch.tensor([float(x) for x in v], dtype=torch.float64)
    return None


def dcp_state_dict(opt: DistributedOptimizer) -> tuple[dict[str, Any], list[tuple[Any, dict[str, Any]]]]:
    """This rank's DCP entries for ``opt`` (collective: every rank calls it) and the load targets:
    (held region, its state entries), the tensors DCP reads into."""
    from canzona.runtime.agree import agree
    from canzona.runtime.checkpoint import whole_box
    from canzona.runtime.dcp import CHUNK_BYTES, _Chunks

    opt.finish_param_sync()
    chunks, plain, targets = _Chunks(CHUNK_BYTES), {}, []
    error: BaseException | None = None
    try:
        shapes = {r.name: tuple(r.shape) for r in opt.checkpoint_params()}
        for h in opt.held():
            shape = shapes[h.name]
            if h.master is not None:
                chunks.add_region(f"{h.name}.master", shape, h.region, h.master.detach().reshape(-1))
            if h.optimizer is None or h.param is None:
                continue
            state = dict(h.state())
            plain[f"{h.name}.keys"] = torch.tensor(_keys_code(state), dtype=torch.int64)
            state = state or _probe_state(h)
            for k, v in state.items():
                key = f"{h.name}.state.{k}"
                if not torch.is_tensor(v):
                    plain[f"{h.name}.pystate.{k}"] = _number(v) if _number(v) is not None else torch.tensor(int(v))
                elif v.dim() == 0:
                    plain[key] = v
                elif h.sliced:
                    chunks.add_region(key, shape, h.region, v.detach().view(-1))
                else:
                    chunks.add_box(key, tuple(v.shape), whole_box(v.shape), v.detach())
            targets.append((h, state))
    except Exception as exc:  # noqa: BLE001 - every rank must learn that this rank cannot
        error = exc
    agree(error, "state_dict()", comm=opt.runtime.status_comm, timeout_s=opt.status_timeout_s, mark=True)
    out = {**chunks.state_dict(opt.mesh), **plain, STEPS_KEY: torch.tensor(int(opt.steps), dtype=torch.int64)}
    for group, values in opt.hyperparams().items():
        for k, v in values.items():
            t = _number(v)
            if t is not None:
                out[f"{HYPER_PREFIX}{group}.{k}"] = t
    return out, targets


def load_dcp_state_dict(opt: DistributedOptimizer, sd: Any, targets: list[tuple[Any, dict[str, Any]]]) -> None:
    """Install what DCP read into :func:`dcp_state_dict`'s targets (collective): every rank checks
    the step count, the hyperparameters and each parameter's state names before any rank changes
    its optimizer."""
    from canzona.runtime.agree import RankFailure, agree
    from canzona.runtime.checkpoint import CheckpointError, check_hyper_section, restore_hyperparams

    error: BaseException | None = None
    new: list[tuple[Any, dict[str, Any]]] = []
    hyper: dict[str, dict[str, Any]] = {}
    steps = 0
    try:
        steps = int(sd[STEPS_KEY])
        if steps < 0:
            raise CheckpointError(f"the saved step count {steps} is negative")
        for key, t in sd.items():
            if isinstance(key, str) and key.startswith(HYPER_PREFIX):
                group, _, k = key.removeprefix(HYPER_PREFIX).partition(".")
                value = t.tolist()
                hyper.setdefault(group, {})[k] = tuple(value) if isinstance(value, list) else value
        check_hyper_section(hyper)
        for h, state in targets:
            saved = int(sd[f"{h.name}.keys"])
            if saved == _keys_code(()):
                new.append((h, {}))
            elif saved != _keys_code(state):
                raise CheckpointError(f"{h.name}: the saved optimizer state has other entries than {sorted(state)}")
            else:
                new.append((h, {k: (v if torch.is_tensor(v) else type(v)(sd[f"{h.name}.pystate.{k}"].item())) for k, v in state.items()}))
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    try:
        agree(error, "load_state_dict()", comm=opt.runtime.status_comm, timeout_s=opt.status_timeout_s, mark=True)
    except RankFailure:
        if error is not None:
            raise error from None
        raise
    for h, st in new:
        if st:
            h.optimizer.state[h.param] = st
        else:
            h.optimizer.state.pop(h.param, None)
    restore_hyperparams(opt, hyper)
    opt.finish_load(steps)


# ------------------------------------------------------------------------------ the container

if _Base is not None:

    class CanzonaOptimizers(_Base):  # type: ignore[misc,valid-type]
        """torchtitan's optimizer container over one :class:`canzona.DistributedOptimizer` (see
        the module docstring). ``self.optimizer`` is the DistributedOptimizer; iterating the
        container yields it (what ``LRSchedulersContainer`` schedules)."""

        @dataclass(kw_only=True, slots=True)
        class Config(_Base.Config):
            name: str = "muon"
            """Matrix optimizer: a canzona name (muon, shampoo, soap, adamw ...) or torch.optim.<Class>."""

            strategy: str = "lb-asc"
            """canzona strategy on the FSDP2 layout (lb-asc, asc, sc, no-fuse)."""

            optimizer_kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 0.02})
            """Keyword arguments of the matrix optimizer (lr, weight_decay, momentum ...)."""

            elementwise_optimizer: str = "adamw"
            """Optimizer of embeddings, head, norms and biases: a canzona name or torch.optim.<Class>."""

            elementwise_kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 3e-4})
            """Keyword arguments of the element-wise optimizer."""

            roles: dict[str, str] = field(default_factory=dict)
            """Role overrides, parameter-name glob -> matrix / elementwise (canzona's roles=)."""

            cmax_mb: float = 512.0
            """Micro-group capacity C_max in MiB of gathered gradient (the paper's Algorithm 2)."""

            status_timeout_s: float = 60.0
            """Bound on every wait for the other ranks in canzona's status exchanges, seconds."""

        def __init__(self, config: CanzonaOptimizers.Config, *, model_parts: list[nn.Module]) -> None:
            if len(model_parts) != 1:
                raise ValueError(
                    f"canzona.torchtitan serves one model part, got {len(model_parts)} (pipeline parallelism is not supported)"
                )
            if config.param_groups or config.optimizer_factory_kwargs_by_name:
                raise ValueError(
                    "CanzonaOptimizers.Config takes no param_groups / optimizer_factory_kwargs_by_name: canzona gives "
                    "every parameter its role itself (set roles= to override it)"
                )
            model = model_parts[0]
            self.model_parts = model_parts
            self.optimizer = DistributedOptimizer(
                model,
                resolve_name(config.name),
                strategy=config.strategy,
                mesh=model_mesh(model),
                optimizer_kwargs=config.optimizer_kwargs,
                elementwise_optimizer=resolve_name(config.elementwise_optimizer),
                elementwise_kwargs=config.elementwise_kwargs,
                roles=dict(config.roles) or None,
                cmax_mb=config.cmax_mb,
                status_timeout_s=config.status_timeout_s,
            )
            self.optimizers = [self.optimizer]
            self._targets: tuple[int, list[tuple[Any, dict[str, Any]]]] | None = None
            self._post_init([p for p in model.parameters() if p.requires_grad])

        def step(self, closure: Any = None) -> None:
            if closure is not None:
                raise TypeError("CanzonaOptimizers.step takes no closure")
            self.optimizer.step()

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

        def state_dict(self) -> dict[str, Any]:
            """This rank's optimizer state in DCP's form (collective: every rank calls it; see
            :func:`dcp_state_dict`)."""
            sd, targets = dcp_state_dict(self.optimizer)
            self._targets = (id(sd), targets)
            return sd

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            """Install what ``dcp.load`` read into the dict :meth:`state_dict` returned (collective)."""
            if self._targets is None or self._targets[0] != id(state_dict):
                raise ValueError(
                    "CanzonaOptimizers.load_state_dict takes the dict its own state_dict() returned on this rank, "
                    "after torch.distributed.checkpoint.load read into it (dcp.load({'optimizer': container}) does both)"
                )
            targets, self._targets = self._targets[1], None
            load_dcp_state_dict(self.optimizer, state_dict, targets)

else:

    def __getattr__(name: str) -> Any:
        if name == "CanzonaOptimizers":
            raise ImportError(_MISSING)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
