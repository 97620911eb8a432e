"""canzona: exact, load-balanced matrix-based optimizers under ZeRO-1 DP, TP and FSDP2 (arXiv 2602.06079).

One optimizer front end, :class:`DistributedOptimizer`, lays itself out the way the model is laid
out (:mod:`canzona.layouts`: canzona's ZeRO-1 buffer, or FSDP2 ``fully_shard``).

Data flows one way: model config or module -> :mod:`canzona.specs` -> :mod:`canzona.plan` (pure,
offline) -> :mod:`canzona.runtime` (torch.distributed) -> phases (NVTX + record_function) ->
traces and reports -> notebooks. Heavy pieces are imported lazily so ``canzona plan`` stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "DistributedOptimizer": "canzona.distributed",
    "OptimizerSettings": "canzona.settings",
    "make_plan": "canzona.plan",
    "Plan": "canzona.plan",
    "PlanInputs": "canzona.plan",
    "ParamSpec": "canzona.specs",
    "specs_from_config": "canzona.specs",
    "specs_from_module": "canzona.specs",
    "load_model_config": "canzona.config",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'canzona' has no attribute {name!r}")
