"""What the suite validates: built-in optimizers and models, or the user's own by import path.

An optimizer is a built-in name (``muon``, ``shampoo``, ``soap``, ``adamw``) or an import path
``package.module:Name`` naming a per-parameter ``torch.optim.Optimizer`` subclass; a model is a
built-in name (``awkward``, ``qwen3``) or an import path naming a callable that returns an
``nn.Module`` (a class or a factory function). Keyword arguments for either come as JSON objects
(``--optimizer-kwargs`` / ``--model-kwargs``).

The user's module is imported by its path in the parent process (so a typo costs nothing) *and*
in every spawned worker: it must be importable there too, i.e. an installed package or a module
on ``PYTHONPATH`` (the workers inherit the parent's ``sys.path``). Any failure to import or to
construct is a :class:`TargetError` (a ``ValueError``) with one line naming the path.

A custom model declares its tensor-parallel layout, if it has one, as an attribute
``canzona_tp_dims`` (``{parameter name: split dim}``, Megatron-style plain shards): the suite
then splits those parameters over the ``tp`` mesh dimension; without it every parameter is
replicated over TP. Custom models run the injected check only (the training check needs a
language-model forward and data: it runs on the built-in ``qwen3``).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from canzona.optimizers import optimizer_names
from canzona.fileio import loads_json

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_OPTIMIZERS",
    "TargetError",
    "is_import_path",
    "load_object",
    "parse_kwargs",
    "resolve_optimizer_class",
    "build_custom_model",
    "check_optimizer_target",
    "check_model_target",
]

#: the registered optimizer names (:mod:`canzona.optimizers`) at import time
BUILTIN_OPTIMIZERS: tuple[str, ...] = optimizer_names()
BUILTIN_MODELS: tuple[str, ...] = ("awkward", "qwen3")


class TargetError(ValueError):
    """An optimizer or model path that cannot be imported or constructed (one readable line)."""


def is_import_path(text: str) -> bool:
    """``package.module:Name`` (a colon separates the module from the attribute)."""
    mod, sep, attr = str(text).partition(":")
    return bool(sep and mod.strip() and attr.strip())


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def load_object(path: str, what: str) -> Any:
    """Import ``package.module:Name`` (dots after the colon walk attributes); TargetError otherwise."""
    if not is_import_path(path):
        raise TargetError(f"{what} {path!r} is neither a built-in name nor an import path package.module:Name")
    mod_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name.strip())
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module, reported in one line
        raise TargetError(
            f"{what} {path}: cannot import module {mod_name.strip()!r} ({_one_line(exc)}); "
            "install the package or put its directory on PYTHONPATH"
        ) from None
    for part in attr.strip().split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{what} {path}: module {mod_name.strip()!r} has no attribute {attr.strip()!r}")
        obj = getattr(obj, part)
    return obj


def parse_kwargs(text: str | Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """A JSON object (string) or a mapping -> dict; TargetError for anything else."""
    if text is None:
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    try:
        value = loads_json(text, what, max_bytes=1 << 20)
    except json.JSONDecodeError as exc:
        raise TargetError(str(exc)) from None
    if not isinstance(value, dict):
        raise TargetError(f"{what}: expected a JSON object like '{{\"lr\": 0.01}}', got {type(value).__name__}")
    return value


def resolve_optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class for a built-in name or an import path (TargetError naming the path)."""
    if name in BUILTIN_OPTIMIZERS:
        from canzona.distributed import resolve_optimizer

        return resolve_optimizer(name)
    obj = load_object(name, "optimizer")
    if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
        raise TargetError(f"optimizer {name}: expected a torch.optim.Optimizer subclass, got {obj!r}")
    return obj


def build_custom_model(path: str, kwargs: Mapping[str, Any], *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``callable(**kwargs)`` for the model path, cast to ``dtype``; TargetError on any failure."""
    fn = load_object(path, "model")
    if not callable(fn):
        raise TargetError(f"model {path}: {fn!r} is not callable (expected a function or class returning an nn.Module)")
    # Every rank and the reference must build the very same initial weights: seed the global RNG,
    # the source most nn.Module constructors draw from.
    torch.manual_seed(0)
    try:
        model = fn(**dict(kwargs))
    except Exception as exc:  # noqa: BLE001 - the user's constructor failed
        raise TargetError(f"model {path}: construction failed ({_one_line(exc)})") from None
    if not isinstance(model, nn.Module):
        raise TargetError(f"model {path}: returned {type(model).__name__}, not a torch.nn.Module")
    if next(iter(model.parameters()), None) is None:
        raise TargetError(f"model {path}: the module has no parameters")
    return model.to(dtype)


def check_optimizer_target(name: str, kwargs: Mapping[str, Any]) -> type[torch.optim.Optimizer]:
    """Import the class and construct it once over a small matrix (before any process starts)."""
    cls = resolve_optimizer_class(name)
    try:
        cls([nn.Parameter(torch.zeros(4, 3))], **dict(kwargs))
    except Exception as exc:  # noqa: BLE001 - the user's constructor failed
        raise TargetError(f"optimizer {name}: construction with kwargs {dict(kwargs)} failed ({_one_line(exc)})") from None
    return cls


def check_model_target(path: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """Build the model once in the parent and check its declared TP layout."""
    model = build_custom_model(path, kwargs)
    dims = getattr(model, "canzona_tp_dims", None) or {}
    if not isinstance(dims, Mapping):
        raise TargetError(f"model {path}: canzona_tp_dims must be a dict {{parameter name: dim}}")
    named = dict(model.named_parameters())
    for n, d in dims.items():
        if n not in named:
            raise TargetError(f"model {path}: canzona_tp_dims names {n!r}, which is not a parameter of the model")
        if not isinstance(d, int) or not 0 <= d < named[n].dim():
            raise TargetError(f"model {path}: canzona_tp_dims[{n!r}] = {d!r} is not a dim of its shape {tuple(named[n].shape)}")
    return model
