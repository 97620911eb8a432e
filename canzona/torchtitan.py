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
several meshes (beside expert parallelism's own: routed experts on a mesh with an ``ep``
dimension, torchtitan's ``("efsdp", "ep")`` or under HSDP ``("dp_replicate", "efsdp", "ep")``, also
beside a dense ``("fsdp", "tp")``, are served as the FSDP2 layout serves them; without ep the
experts cut by TP share the dense mesh), a mesh that does not cover the world, and torchtitan's
``param_groups`` (canzona assigns roles itself: ``roles=``).

Checkpoints: the container's ``state_dict``/``load_state_dict`` are the DistributedOptimizer's own
per-rank DCP ``Stateful`` form (:mod:`canzona.runtime.stateful`): each rank returns the regions it
holds, DCP de-duplicates replicas and re-shards across layouts, and a fresh optimizer gets its load
targets without being stepped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.distributed import DistributedOptimizer

__all__ = ["CanzonaOptimizers", "model_mesh", "resolve_name"]

try:  # torchtitan is an optional extra: canzona imports without it
    from torchtitan.components.optimizer import OptimizersContainer as _Base
except ImportError as exc:  # pragma: no cover - exercised where torchtitan is absent
    _Base = None  # type: ignore[assignment,misc]
    _MISSING = f"canzona.torchtitan needs torchtitan ({exc}); pip install 'canzona[torchtitan]'"
else:
    _MISSING = ""


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
    """The DeviceMesh the trainable parameters of ``model`` live on (FSDP2 ``fully_shard``
    parameters are DTensors); one line refusing anything else. Under expert parallelism the
    routed experts live on a mesh of their own (torchtitan's ``("efsdp", "ep")``): a mesh with an
    ``ep`` dimension is the experts', which the FSDP2 layout checks against this one
    (:func:`canzona.layouts.fsdp2.check_expert_placements`)."""
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
        if "ep" in (m.mesh_dim_names or ()):
            continue
        meshes.setdefault((tuple(m.mesh_dim_names or ()), tuple(m.mesh.flatten().tolist()), tuple(m.mesh.shape)), (m, n))
    if not meshes:
        if any(p.requires_grad for p in model.parameters()):
            raise ValueError("every trainable parameter is on an expert mesh (one with an 'ep' dimension); the dense ones give the optimizer's mesh")
        raise ValueError("the model has no trainable parameters")
    if len(meshes) > 1:
        (a, na), (b, nb) = list(meshes.values())[:2]
        raise ValueError(
            f"the parameters live on {len(meshes)} meshes ({na} on {a.mesh_dim_names}, {nb} on {b.mesh_dim_names}); "
            "canzona.torchtitan needs one mesh for all of them (besides expert parallelism's own mesh, one with an 'ep' dimension)"
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

            cmax: float = 512.0
            """Micro-group capacity C_max in 2**20 TP-local gradient elements per host (the paper's
            unit, Algorithm 2)."""

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
                cmax=config.cmax,
                status_timeout_s=config.status_timeout_s,
            )
            self.optimizers = [self.optimizer]
            self._post_init([p for p in model.parameters() if p.requires_grad])

        def step(self, closure: Any = None) -> None:
            if closure is not None:
                raise TypeError("CanzonaOptimizers.step takes no closure")
            self.optimizer.step()

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

        def state_dict(self) -> dict[str, Any]:
            """This rank's optimizer state in DCP's form (collective: every rank calls it); the
            DistributedOptimizer's own ``Stateful`` form."""
            return self.optimizer.state_dict()

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            """Install what ``dcp.load`` read into the dict :meth:`state_dict` returned (collective)."""
            self.optimizer.load_state_dict(state_dict)

else:

    def __getattr__(name: str) -> Any:
        if name == "CanzonaOptimizers":
            raise ImportError(_MISSING)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
