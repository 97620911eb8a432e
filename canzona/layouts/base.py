"""The layout interface: how one way of laying out a model's parameters meets the front end.

:class:`canzona.DistributedOptimizer` is one class. What differs between canzona's ZeRO-1 buffer
(plain or DTensor-TP models, the paper's Sections 3 and 4) and an FSDP2 ``fully_shard`` model is
how the parameters are laid out across ranks; a :class:`Layout` object holds exactly that, and the
front end holds everything else (argument checks, optimizer probes, the plan-fingerprint agreement,
parameter groups, the hyperparameter push, ``step``/``zero_grad``, ``state_dict``).

A layout, in the order the front end uses it:

- ``serves(model)``: whether the model is laid out this way (read from the model itself);
- ``__init__(model, mesh, settings, device=...)``: checks the mesh, reads sizes and ranks, refuses the options
  it cannot serve (:attr:`Layout.refused`, one line naming them); no collective;
- ``make_plan(matrix_cls, plan)``: the parameter records it reads from the model and the plan
  (its own plan type for now); may raise, and runs inside the front end's fingerprint agreement;
- ``role(name)`` / ``planned``: which group (``matrix``/``elementwise``) each planned parameter is in;
- ``check_replicas()``: a collective check that the ranks start from the same values, if any;
- ``build(...)``: the runtime (``runtime``), which receives gradients in the layout's way (buffer
  hooks, FSDP2's ``p.grad``), updates what this rank holds and returns values;
- ``no_sync()``: gradient accumulation without collectives;
- the checkpoint pieces of :class:`canzona.runtime.checkpoint.Checkpointable`:
  ``checkpoint_params``, ``checkpoint_describe``, ``held``, ``model_pieces``, ``finish_load``,
  ``status_device``.

Invariants: a layout never decides anything that is not about layout; everything it does before
``build`` is identical on every rank given identical inputs; after ``build`` its ``runtime`` is the
one engine ``step()`` calls.

A new layout (expert parallelism, say) is one module in this package implementing the class below,
plus a line in :func:`canzona.layouts.choose_layout`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from canzona.runtime.checkpoint import Held, ModelPiece, ParamRecord
from canzona.runtime.comm import CommStats
from canzona.runtime.dp import OptimizerFactory
from canzona.runtime.phases import PhaseTimer
from canzona.settings import OptimizerSettings

__all__ = ["Layout", "OptimizerFactory"]


class Layout(ABC):
    """One way parameters are laid out across ranks (see the module docstring)."""

    #: the checkpoints' ``meta["engine"]`` name of this layout
    engine: ClassVar[str]
    #: :class:`OptimizerSettings` fields this layout cannot serve (refused when changed from the default)
    refused: ClassVar[tuple[str, ...]] = ()
    #: why those options are refused (completes the one-line error)
    refused_reason: ClassVar[str] = ""
    #: attributes the front end forwards to the layout (``opt.tp_rank``, ``opt.group_rank`` ...)
    exposed: ClassVar[tuple[str, ...]] = ()

    model: nn.Module
    mesh: Any
    settings: OptimizerSettings
    plan: Any
    runtime: Any

    def __init__(self, model: nn.Module, mesh: Any, settings: OptimizerSettings, *, device: torch.device) -> None:
        bad = [name for name in settings.changed() if name in self.refused]
        if bad:
            raise ValueError(f"{', '.join(bad)}: option(s) {self.refused_reason}")
        self.model = model
        self.settings = settings
        self.mesh = mesh
        #: where the model's (local) parameters live: the device of the status exchanges
        self.device = device

    @classmethod
    @abstractmethod
    def serves(cls, model: nn.Module) -> bool:
        """Whether ``model`` is laid out this way."""

    def check_optimizers(self, matrix_cls: type[torch.optim.Optimizer], ew_cls: type[torch.optim.Optimizer]) -> None:
        """Refuse optimizer classes this layout's strategy cannot run (nothing by default)."""

    @abstractmethod
    def make_plan(self, matrix_cls: type[torch.optim.Optimizer], plan: Any) -> Any:
        """Read the parameter records from the model and make the plan (or check a given one)."""

    @property
    @abstractmethod
    def planned(self) -> frozenset[str]:
        """Names of the parameters the plan covers (the trainable ones)."""

    @abstractmethod
    def role(self, name: str) -> str:
        """``"matrix"`` or ``"elementwise"``: the parameter group of planned parameter ``name``."""

    def check_replicas(self) -> None:
        """A collective check that every rank starts from the same values (none by default)."""

    @abstractmethod
    def build(
        self, *, matrix_factory: OptimizerFactory, elementwise_factory: OptimizerFactory, comm_stats: CommStats, phase_times: PhaseTimer
    ) -> Any:
        """Make :attr:`runtime`, the step engine (collective); returns it."""

    @abstractmethod
    def clip_grad_norm(self, max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the reduced gradients this layout holds
        (collective; :mod:`canzona.runtime.clip`); returns the total norm."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over micro-batches without launching gradient collectives."""
        yield

    def describe(self) -> str:
        """Sizes for ``repr`` (``dp=2, tp=2``)."""
        return ""

    # ------------------------------------------------------------------ checkpoint pieces
    @abstractmethod
    def checkpoint_params(self) -> list[ParamRecord]: ...

    @abstractmethod
    def checkpoint_describe(self) -> dict[str, Any]: ...

    @abstractmethod
    def held(self) -> list[Held]: ...

    @abstractmethod
    def model_pieces(self) -> list[ModelPiece]: ...

    @abstractmethod
    def status_device(self) -> torch.device: ...

    @abstractmethod
    def finish_load(self, steps: int) -> None: ...
