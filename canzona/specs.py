"""Parameter specs: the plain-data view of a model that every planner works on.

A :class:`ParamSpec` says what the planner needs to know about one parameter and nothing more:
its name, global shape, tensor-parallel split dimension and size, and whether the matrix
optimizer updates it (``matrix``: atomic) or an element-wise optimizer does (``elementwise``:
divisible anywhere, as ZeRO-1 assumes). Specs come from a model config (:func:`specs_from_config`,
for the Megatron or the Hugging Face layout) or from a live ``nn.Module``
(:func:`specs_from_module`, also on the meta device and with DTensor parameters).

Specs are listed in *registration order* (the order ``named_parameters`` yields them); the
ZeRO-1 buffer reverses it (see ``canzona.plan.buckets``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from canzona.config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "Kind",
    "Layout",
    "ParamSpec",
    "LAYOUTS",
    "MATRIX_EXCLUDE_PATTERNS",
    "is_matrix_param",
    "specs_from_config",
    "specs_from_module",
    "total_numel",
]

Kind = Literal["matrix", "elementwise"]
Layout = Literal["megatron", "hf"]
LAYOUTS: tuple[str, ...] = ("megatron", "hf")

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: Name fragments (case-insensitive) of 2-D weights that stay with the element-wise optimizer, as in
#: the reference implementation: token embeddings, output heads and MoE routers are lookup tables or
#: classifiers, not linear maps between hidden states. A weight whose module is named ``gate``
#: (``*.gate.weight``: the router of Qwen3-MoE and Mixtral) is a router too.
MATRIX_EXCLUDE_PATTERNS: tuple[str, ...] = ("embed", "lm_head", "output_layer", "router")


def is_matrix_param(name: str, shape: Iterable[int]) -> bool:
    """True when the matrix optimizer owns this parameter: 2-D weights except token embeddings,
    output heads and MoE routers. Everything else (norms, biases, those three) is element-wise.
    Pure function of name and shape, shared by the planner and :mod:`canzona.optim`."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if len(tuple(shape)) != 2:
        return False
    lowered = name.lower()
    if any(pattern in lowered for pattern in MATRIX_EXCLUDE_PATTERNS):
        return False
    parts = lowered.split(".")
    return not (len(parts) >= 2 and parts[-2] == "gate" and parts[-1] == "weight")


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter as the planner sees it.

    ``shape`` is the global (unsplit) shape; ``tp_dim`` the dimension split across ``tp`` tensor-
    parallel ranks (None: replicated on every TP rank). ``kind`` is ``matrix`` (atomic for the
    matrix optimizer) or ``elementwise``.
    """

    name: str
    shape: tuple[int, ...]
    kind: Kind
    tp_dim: int | None = None
    tp: int = 1

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a parameter needs a name")
        if not self.shape or any((not isinstance(d, int)) or d < 1 for d in self.shape):
            raise ValueError(f"{self.name}: shape must be a tuple of positive ints, got {self.shape!r}")
        if self.kind not in ("matrix", "elementwise"):
            raise ValueError(f"{self.name}: kind must be 'matrix' or 'elementwise', got {self.kind!r}")
        if self.kind == "matrix" and len(self.shape) != 2:
            raise ValueError(f"{self.name}: a matrix parameter must be 2-D, got shape {self.shape}")
        if self.tp < 1:
            raise ValueError(f"{self.name}: tp must be >= 1, got {self.tp}")
        if self.tp_dim is not None:
            if not 0 <= self.tp_dim < len(self.shape):
                raise ValueError(f"{self.name}: tp_dim {self.tp_dim} out of range for shape {self.shape}")
            if self.shape[self.tp_dim] % self.tp:
                raise ValueError(
                    f"{self.name}: dimension {self.tp_dim} of shape {self.shape} does not divide by tp={self.tp}"
                )

    @property
    def tp_split(self) -> bool:
        """True when the parameter is actually split (a split dim and more than one TP rank)."""
        return self.tp_dim is not None and self.tp > 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of one TP rank's shard (the piece that lives in that rank's ZeRO-1 buffer)."""
        if not self.tp_split:
            return self.shape
        s = list(self.shape)
        s[self.tp_dim] //= self.tp  # type: ignore[index]
        return tuple(s)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def local_numel(self) -> int:
        # same value as prod(local_shape) (the split dim divides by tp, checked above) without
        # building the shape tuple: Plan.validate asks for it several times per parameter
        n = math.prod(self.shape)
        return n // self.tp if self.tp_dim is not None and self.tp > 1 else n

    @property
    def layer(self) -> int | None:
        """Transformer layer index parsed from the name (``...layers.<i>....``), None outside layers."""
        m = _LAYER_RE.search(self.name)
        return int(m.group(1)) if m else None


def _spec(name: str, shape: tuple[int, ...], tp_dim: int | None, tp: int) -> ParamSpec:
    kind: Kind = "matrix" if is_matrix_param(name, shape) else "elementwise"
    return ParamSpec(name=name, shape=shape, kind=kind, tp_dim=tp_dim, tp=tp)


def specs_from_config(cfg: ModelConfig, *, tp: int = 1, layout: str = "megatron") -> list[ParamSpec]:
    """Parameter specs of a Qwen3 model in registration order.

    ``megatron`` follows Megatron-Core GPT naming: fused ``linear_qkv`` [(q+2kv)*head_dim, hidden]
    and ``linear_fc1`` [2*ffn, hidden] column-parallel (split dim 0), ``linear_proj`` and
    ``linear_fc2`` row-parallel (split dim 1), embedding and output layer vocab-parallel (dim 0).
    ``hf`` follows Hugging Face Qwen3 naming with separate q/k/v/o and gate/up/down projections.
    MoE layers replace the MLP with a router (replicated, element-wise) and ``num_experts``
    experts, each TP-split like a dense MLP (no expert parallelism).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: list[ParamSpec] = []

    def add(name: str, shape: tuple[int, ...], tp_dim: int | None) -> None:
        out.append(_spec(name, shape, tp_dim, tp))

    def mlp(prefix: str, ffn: int) -> None:
        if layout == "megatron":
            add(f"{prefix}.linear_fc1.weight", (2 * ffn, h), 0)
            add(f"{prefix}.linear_fc2.weight", (h, ffn), 1)
        else:
            add(f"{prefix}.gate_proj.weight", (ffn, h), 0)
            add(f"{prefix}.up_proj.weight", (ffn, h), 0)
            add(f"{prefix}.down_proj.weight", (h, ffn), 1)

    if layout == "megatron":
        add("embedding.word_embeddings.weight", (cfg.vocab_size, h), 0)
        for i in range(cfg.num_hidden_layers):
            p = f"decoder.layers.{i}"
            add(f"{p}.input_layernorm.weight", (h,), None)
            add(f"{p}.self_attention.linear_qkv.weight", (q + 2 * kv, h), 0)
            add(f"{p}.self_attention.q_layernorm.weight", (hd,), None)
            add(f"{p}.self_attention.k_layernorm.weight", (hd,), None)
            add(f"{p}.self_attention.linear_proj.weight", (h, q), 1)
            add(f"{p}.pre_mlp_layernorm.weight", (h,), None)
            if cfg.moe is None:
                mlp(f"{p}.mlp", cfg.intermediate_size)
            else:
                add(f"{p}.mlp.router.weight", (cfg.moe.num_experts, h), None)
                for e in range(cfg.moe.num_experts):
                    mlp(f"{p}.mlp.experts.local_experts.{e}", cfg.moe.moe_intermediate_size)
        add("decoder.final_layernorm.weight", (h,), None)
        if not cfg.tie_word_embeddings:
            add("output_layer.weight", (cfg.vocab_size, h), 0)
    else:
        add("model.embed_tokens.weight", (cfg.vocab_size, h), 0)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            add(f"{p}.self_attn.q_proj.weight", (q, h), 0)
            add(f"{p}.self_attn.k_proj.weight", (kv, h), 0)
            add(f"{p}.self_attn.v_proj.weight", (kv, h), 0)
            add(f"{p}.self_attn.o_proj.weight", (h, q), 1)
            add(f"{p}.self_attn.q_norm.weight", (hd,), None)
            add(f"{p}.self_attn.k_norm.weight", (hd,), None)
            if cfg.moe is None:
                mlp(f"{p}.mlp", cfg.intermediate_size)
            else:
                add(f"{p}.mlp.gate.weight", (cfg.moe.num_experts, h), None)
                for e in range(cfg.moe.num_experts):
                    mlp(f"{p}.mlp.experts.{e}", cfg.moe.moe_intermediate_size)
            add(f"{p}.input_layernorm.weight", (h,), None)
            add(f"{p}.post_attention_layernorm.weight", (h,), None)
        add("model.norm.weight", (h,), None)
        if not cfg.tie_word_embeddings:
            add("lm_head.weight", (cfg.vocab_size, h), 0)
    return out


def specs_from_module(
    module: torch.nn.Module,
    *,
    tp_dims: Mapping[str, int | None] | None = None,
    tp: int = 1,
    kinds: Mapping[str, Kind] | None = None,
) -> list[ParamSpec]:
    """Parameter specs of a live module (any device, including ``meta``), in registration order.

    DTensor parameters report their global shape; a ``Shard(d)`` placement gives the split dim and
    the mesh size gives ``tp``. Plain-tensor parameters hold a local shard when ``tp_dims`` declares
    a split dim for their name (Megatron style): the global shape is the local shape with that dim
    multiplied by ``tp``. ``kinds`` overrides the matrix/element-wise rule for named parameters.
    Tied parameters appear once (under their first name), as ``named_parameters`` yields them.
    """
    from torch.distributed.tensor import DTensor, Shard

    tp_dims = dict(tp_dims or {})
    kinds = dict(kinds or {})
    names = {n for n, _ in module.named_parameters()}
    for n in list(tp_dims) + list(kinds):
        if n not in names:
            raise ValueError(f"{n!r} is not a parameter of the module")
    out: list[ParamSpec] = []
    for name, p in module.named_parameters():
        ptp = tp
        if isinstance(p, DTensor):
            if name in tp_dims:
                raise ValueError(f"{name}: a DTensor carries its own placement; do not declare tp_dims for it")
            shard_axes = [(axis, pl.dim) for axis, pl in enumerate(p.placements) if isinstance(pl, Shard)]
            if len(shard_axes) > 1:
                raise ValueError(f"{name}: sharded on more than one mesh dimension; only 1-D TP sharding is supported")
            shape = tuple(p.shape)
            tp_dim = shard_axes[0][1] if shard_axes else None
            if shard_axes:
                ptp = p.device_mesh.size(shard_axes[0][0])
        else:
            tp_dim = tp_dims.get(name)
            shape = tuple(p.shape)
            if tp_dim is not None:
                if not 0 <= tp_dim < len(shape):
                    raise ValueError(f"{name}: tp_dim {tp_dim} out of range for shape {shape}")
                s = list(shape)
                s[tp_dim] *= tp
                shape = tuple(s)
        kind = kinds.get(name) or ("matrix" if is_matrix_param(name, shape) else "elementwise")
        out.append(ParamSpec(name=name, shape=shape, kind=kind, tp_dim=tp_dim, tp=ptp))
    return out


def total_numel(specs: Iterable[ParamSpec]) -> int:
    """Global parameter count (tied parameters counted once)."""
    return sum(s.numel for s in specs)
