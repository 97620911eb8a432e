"""Hugging Face ``transformers`` models with canzona: configs, transformers' own TP plan.

A transformers model is an ordinary ``nn.Module`` to :class:`canzona.DistributedOptimizer`: its
parameter roles come from the same rule as canzona's own model (:func:`canzona.specs.is_matrix_param`:
2-D weights are matrix parameters; token embeddings, ``lm_head``, norms, biases and MoE routers are
element-wise), TP splits are read from the DTensor placements transformers' TP plan creates, and a
tied ``lm_head``/``embed_tokens`` pair is one parameter (``named_parameters`` yields it once), so it
gets one buffer slot, one owner and one update.

The documented order is the one people use: build (and shard) the model, build the optimizer,
then train. transformers' ``replicated_with_grad_allreduce`` style (Qwen3's per-head q/k norms)
registers its gradient all-reduce hook at the *first forward*, i.e. after canzona's hooks; canzona
takes each gradient only after every other hook on the parameter has run
(:mod:`canzona.runtime.buffer`, "Other code's hooks"), so that order is exact.

:class:`Trainer` (``canzona.hf.Trainer``, defined in :mod:`canzona.hf_trainer`) is
``transformers.Trainer`` running canzona's optimizer under torchrun: no DDP wrapper, clipping
through ``opt.clip_grad_norm_``, gradient accumulation through ``no_sync``, collective checkpoints.

This module imports ``transformers`` lazily; it is a test (``dev``) dependency of canzona, not a
runtime one.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from canzona.config import ModelConfig

__all__ = ["Trainer", "apply_tp_plan", "expand_tp_plan", "hf_config"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":  # imports transformers (and accelerate) only when asked for
        from canzona.hf_trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'canzona.hf' has no attribute {name!r}")

_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def hf_config(cfg: ModelConfig, architecture: str = "qwen3", **overrides: Any) -> Any:
    """A transformers config (``Qwen3Config`` or ``LlamaConfig``) with the sizes of a canzona model
    config (e.g. ``load_model_config("qwen3-tiny")``); nothing is downloaded. ``overrides`` are
    passed to the config class (``tie_word_embeddings=True``, ``attn_implementation`` ...).
    Llama has no per-head q/k norms, so its parameters are Qwen3's minus those two per layer."""
    if cfg.moe is not None:
        raise ValueError(f"{cfg.name} is a MoE model; hf_config builds dense Qwen3/Llama configs")
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attention_dropout=0.0,
    )
    common.update(overrides)
    if architecture == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    if architecture == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**common)
    raise ValueError(f"unknown architecture {architecture!r}; choose qwen3 or llama")


def expand_tp_plan(model: nn.Module, plan: dict[str, str] | None = None) -> dict[str, str]:
    """transformers' TP plan of ``model`` (its ``tp_plan`` property, wildcard keys such as
    ``model.layers.*.self_attn.q_proj``) expanded to concrete names: for every module, first each of
    its own parameters the plan covers (to shard), then the module itself (to install its forward
    hooks), which is the order ``apply_tensor_parallelism`` expects."""
    plan = dict(model.tp_plan if plan is None else plan)
    out: dict[str, str] = {}
    for mname, module in model.named_modules():
        generic = _LAYER_INDEX.sub(".*", mname)
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            style = plan.get(_LAYER_INDEX.sub(".*", full), plan.get(generic) if mname else None)
            if style is not None:
                out[full] = style
        if mname and generic in plan:
            out[mname] = plan[generic]
    return out


def apply_tp_plan(model: nn.Module, tp_mesh: Any, plan: dict[str, str] | None = None) -> nn.Module:
    """Shard ``model`` (built in this process, e.g. from a config) over the 1-D ``tp_mesh`` with
    transformers' own tensor-parallel plan, as ``from_pretrained(..., tp_plan="auto")`` does for
    checkpoints: colwise/rowwise linears become ``Shard(0)``/``Shard(1)`` DTensors, the vocabulary-
    parallel embedding and head ``Shard(0)``, replicated norms stay plain tensors (q/k norms get
    transformers' gradient all-reduce hook at the first forward). Every rank must hold the same
    weights before the call (same seed): sharding keeps each rank's own slice, nothing is sent.
    Tied parameters (``tie_word_embeddings=True``: ``lm_head.weight`` is ``embed_tokens.weight``)
    stay tied: the shared tensor is sharded once, under its first name, and the other module gets
    the same DTensor back when its own style lays it out the same way (the vocabulary-parallel
    embedding and the column-parallel head are both ``Shard(0)``); otherwise one line refuses.
    Call it before building the optimizer."""
    from transformers.integrations.tensor_parallel import apply_tensor_parallelism

    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D (e.g. mesh['tp']), got {tp_mesh.ndim} dimensions")
    full = expand_tp_plan(model, plan)
    aliases = _tied_aliases(model)
    styles = {alias: full.pop(alias) for alias in aliases if alias in full}  # sharded once, as its owner
    apply_tensor_parallelism(model, tp_mesh, full)
    _retie(model, tp_mesh, aliases, styles)
    return model


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    """Tied parameters: each later name of a shared tensor -> its first name (``named_parameters``'s)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[n] = first[id(p)]
        else:
            first[id(p)] = n
    return out


def _retie(model: nn.Module, tp_mesh: Any, aliases: dict[str, str], styles: dict[str, str]) -> None:
    """Tie every alias to its (now sharded) owner again, refusing a tie whose two TP styles lay the
    tensor out differently (the alias style's layout is read by sharding a meta copy)."""
    import torch
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    params = dict(model.named_parameters())
    for alias, owner in aliases.items():
        mod_name, _, pname = alias.rpartition(".")
        module, shared = model.get_submodule(mod_name), params[owner]
        mine = getattr(shared, "placements", None)
        if alias in styles:
            probe = nn.Module()
            probe.register_parameter(pname, nn.Parameter(torch.empty(tuple(shared.shape), device="meta")))
            ALL_PARALLEL_STYLES[styles[alias]].shard_param(probe, pname, tp_mesh)
            want = getattr(probe._parameters[pname], "placements", None)
        else:
            want = None
        if tuple(want or ()) != tuple(mine or ()):
            raise ValueError(
                f"{alias} is tied to {owner}, which the TP plan lays out as {mine} while {alias}'s style "
                f"{styles.get(alias)!r} needs {want}; untie them (tie_word_embeddings=False) or give both the same layout in plan="
            )
        module._parameters[pname] = shared
