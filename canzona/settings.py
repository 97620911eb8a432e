"""The optimizer's settings: one frozen, validated record built once from the user's keywords.

:class:`canzona.DistributedOptimizer` takes its options as keyword arguments (the user's
interface); it builds one :class:`OptimizerSettings` from them before anything else and hands that
record to the layout (:mod:`canzona.layouts`) and through it to the runtime. Validation happens
here, in ``__post_init__``, and nowhere downstream: a runtime reads the fields, it does not check
them again.

Invariants: every field holds a value of its documented type and range once the record exists;
the record is immutable; :meth:`OptimizerSettings.changed` names the fields that differ from their
defaults, which is what a layout refuses when it cannot serve an option (for example the ZeRO-1
buffer's options on an FSDP2 model).

:func:`check_hyperparams` is the range check of the scheduled hyperparameters (``lr``,
``weight_decay``, ``betas``, ``eps``), made at construction on the optimizers'
arguments and at every ``step()`` on the parameter groups, since a scheduler or the user may change
them after construction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from canzona.runtime.agree import STATUS_TIMEOUT_S

__all__ = ["OptimizerSettings", "check_hyperparams"]

_GRAD_REDUCE = ("mean", "sum")
_PARAM_SYNC = ("eager", "lazy")
_MASTER_DTYPES = (torch.float32, torch.float64)
_EXCHANGES = ("gradients", "ns-input", "auto")


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerSettings:
    """What :class:`canzona.DistributedOptimizer` was asked to do, validated once."""

    strategy: str = "lb-asc"
    """The partitioning strategy by name (``zero1``, ``sc``, ``layerwise``, ``asc``, ``lb-asc`` ...);
    which names a layout serves is the layout's to say."""
    tp_schedule: str | None = None
    """TP micro-group schedule (ZeRO-1 buffer layout); None: the strategy's default."""
    tp_dims: Mapping[str, int | None] | None = None
    """Split dims of Megatron-style plain TP shards, by parameter name (ZeRO-1 buffer layout)."""
    bucket_numel: int | None = None
    """Elements per gradient bucket (ZeRO-1 buffer layout); None: the planner's default for the DP size."""
    alpha: float = 1.0
    """Algorithm 1's balance weight between equal shares and deficits (ZeRO-1 buffer layout)."""
    cost: str = "numel"
    """The cost model that balances hosts and owners (``numel``, ``flops`` ...)."""
    cmax: float = 512.0
    """Algorithm 2's micro-group capacity C_max in 2^20 TP-local gradient elements per host (the
    paper's unit, :data:`canzona.plan.CMAX_UNIT`)."""
    master_dtype: torch.dtype = torch.float32
    """Dtype of the optimizer's master copies and reduced gradients: float32 or float64."""
    grad_reduce: str = "mean"
    """How DP gradients combine on the ZeRO-1 buffer: ``mean`` (sum, then divide) or ``sum``."""
    param_sync: str = "eager"
    """When updated values return on the ZeRO-1 buffer: ``eager`` (inside ``step()``) or ``lazy``
    (all-gathers finished by forward pre-hooks)."""
    status_timeout_s: float = STATUS_TIMEOUT_S
    """Bound, in seconds, on every wait for the other ranks in the status exchanges (plan
    fingerprints, replica check, the step's exchanges, checkpoint save and load)."""
    bound_fsdp_collectives: bool = True
    """FSDP2 on gloo: bound the waits of FSDP2's own all-gathers and reduce-scatters by
    ``status_timeout_s`` too (:mod:`canzona.runtime.fsdp_comm`; the same collectives, the same
    bits), so a rank that skipped a ``step()`` fails within the bound, naming the ranks, instead
    of waiting for the process group's timeout. No effect on NCCL, on modules with several
    parameter groups, nor where no ``fully_shard`` module exists."""
    overlap_updates: bool = False
    """ZeRO-1 buffer: update each bucket as soon as its collective lands, without the pre-update
    agreement (no torch-style skipping of missing gradients, no pre-update non-finite check)."""
    param_views: bool = True
    """ZeRO-1 buffer: make parameters views of the flat parameter buffer the all-gather writes."""
    grad_views: bool = True
    """ZeRO-1 buffer: let autograd accumulate gradients straight into the gradient buffer."""
    exchange: str = "gradients"
    """What the matrix micro-groups exchange (FSDP2 and TP): ``gradients`` (gradient pieces to the
    host, updated values back, fp32) or ``ns-input`` (Muon: momentum on the shards, only the
    Newton-Schulz input and output travel, in its compute dtype; bitwise the same step);
    ``auto``: ``ns-input`` where the matrix optimizer offers it, else ``gradients``. The default
    stays ``gradients``: ``ns-input`` refuses per-update hooks (no rank updates a matrix whole)
    and is offered on CPU parameters only so far (docs/runtime.md, "The split step")."""
    roles: Any = None
    """Parameter roles the user decides (``matrix``, ``experts``, ``elementwise``): a callable
    ``(name, param) -> role | None`` or a mapping of glob patterns to roles (first match wins);
    None, or a None answer: the default rule (:func:`canzona.specs.default_role`)."""
    no_weight_decay: frozenset[str] = frozenset()
    """Element-wise parameters (by name) the element-wise optimizer steps with ``weight_decay=0``:
    a second param group of its inner instances, as ``transformers.Trainer`` exempts biases and
    norm weights; a scheduled ``weight_decay`` leaves them at 0."""

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, str):
            raise TypeError(f"strategy must be a strategy name, got {self.strategy!r}")
        if self.grad_reduce not in _GRAD_REDUCE:
            raise ValueError(f"grad_reduce must be 'mean' or 'sum', got {self.grad_reduce!r}")
        if self.param_sync not in _PARAM_SYNC:
            raise ValueError(f"param_sync must be 'eager' or 'lazy', got {self.param_sync!r}")
        if self.master_dtype not in _MASTER_DTYPES:
            raise ValueError(f"master_dtype must be torch.float32 or torch.float64, got {self.master_dtype}")
        if self.exchange not in _EXCHANGES:
            raise ValueError(f"exchange must be one of {', '.join(map(repr, _EXCHANGES))}, got {self.exchange!r}")
        for flag in ("overlap_updates", "param_views", "grad_views", "bound_fsdp_collectives"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        c = self.cmax
        if isinstance(c, bool) or not (isinstance(c, (int, float)) and 0 < c < math.inf):
            raise ValueError(f"cmax must be a positive number of 2^20 TP-local gradient elements per host, got {c!r}")
        t = self.status_timeout_s
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and 0 < t < math.inf):
            raise ValueError(f"status_timeout_s must be a positive number of seconds, got {t!r}")
        object.__setattr__(self, "status_timeout_s", float(t))
        if self.roles is not None and not (callable(self.roles) or isinstance(self.roles, Mapping)):
            raise TypeError(f"roles must be a callable (name, param) -> role or a mapping of patterns to roles, got {type(self.roles).__name__}")
        if isinstance(self.roles, Mapping):
            object.__setattr__(self, "roles", dict(self.roles))
        nd = self.no_weight_decay
        if isinstance(nd, str) or not all(isinstance(n, str) for n in nd):
            raise TypeError(f"no_weight_decay must be a collection of parameter names, got {nd!r}")
        object.__setattr__(self, "no_weight_decay", frozenset(nd))
        if self.tp_dims is not None:
            if not isinstance(self.tp_dims, Mapping):
                raise TypeError(f"tp_dims must map parameter names to split dims, got {type(self.tp_dims).__name__}")
            object.__setattr__(self, "tp_dims", dict(self.tp_dims))

    def changed(self) -> tuple[str, ...]:
        """The fields whose value differs from the default, in declaration order."""
        default = OptimizerSettings()
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != getattr(default, f.name))


def _number(value: Any) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().cpu())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def check_hyperparams(values: Mapping[str, Any], where: str) -> None:
    """ValueError naming ``where`` and the key when a scheduled hyperparameter is out of range:
    ``lr`` and ``weight_decay`` non-finite or negative, each of ``betas``
    outside [0, 1), ``eps`` non-finite or not positive. Keys ``values`` lacks are not checked."""
    for key in ("lr", "weight_decay"):
        if key in values:
            x = _number(values[key])
            if x is None or not math.isfinite(x) or x < 0:
                raise ValueError(f"{where}: {key} must be a finite number >= 0, got {values[key]!r}")
    if "betas" in values:
        betas = values["betas"]
        nums = [_number(b) for b in betas] if isinstance(betas, (tuple, list)) else [None]
        if any(b is None or not 0 <= b < 1 for b in nums):
            raise ValueError(f"{where}: betas must each be in [0, 1), got {betas!r}")
    if "eps" in values and values["eps"] is not None:
        x = _number(values["eps"])
        if x is None or not math.isfinite(x) or x <= 0:
            raise ValueError(f"{where}: eps must be a finite number > 0, got {values['eps']!r}")
