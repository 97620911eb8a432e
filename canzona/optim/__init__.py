"""Single-device matrix optimizers: the ground truth of Canzona's exactness suite.

Canzona (arXiv 2602.06079) runs an ordinary per-parameter ``torch.optim.Optimizer`` on the
full-shape parameters a rank owns (DP owner or TP host); these are those optimizers. Each
parameter's update depends only on its own gradient and state, and nothing here communicates.
Element-wise parameters (embeddings, output head, routers, norms, biases) go to
``torch.optim.AdamW``; :func:`split_param_groups` does the split.

Names are resolved lazily so that the planner can import :func:`is_matrix_param` (pure, from
:mod:`canzona.optim.groups`) without importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "MATRIX_EXCLUDE_PATTERNS": "canzona.optim.groups",
    "is_matrix_param": "canzona.optim.groups",
    "split_param_groups": "canzona.optim.groups",
    "ADJUST_LR_FNS": "canzona.optim.muon",
    "DEFAULT_NS_COEFFICIENTS": "canzona.optim.muon",
    "DEFAULT_NS_EPS": "canzona.optim.muon",
    "DEFAULT_NS_STEPS": "canzona.optim.muon",
    "Muon": "canzona.optim.muon",
    "adjust_lr": "canzona.optim.muon",
    "batched_newton_schulz": "canzona.optim.muon",
    "newton_schulz": "canzona.optim.muon",
    "GRAFTING_TYPES": "canzona.optim.shampoo",
    "Shampoo": "canzona.optim.shampoo",
    "matrix_inverse_root": "canzona.optim.shampoo",
    "SECOND_MOMENT_REFRESH": "canzona.optim.soap",
    "SOAP": "canzona.optim.soap",
    "eigenbasis": "canzona.optim.soap",
    "refresh_eigenbasis": "canzona.optim.soap",
    "finite_grads_verified": "canzona.optim._common",
    "nonfinite_flags": "canzona.optim._common",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'canzona.optim' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
