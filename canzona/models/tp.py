"""Tensor parallelism for the tiny Qwen3 model, two ways (Section 4's setting).

1. :func:`parallelize`: PyTorch DTensor tensor parallelism (``parallelize_module``). q/k/v/gate/up
   are column-parallel (weights ``Shard(0)``), o/down row-parallel (``Shard(1)``), the embedding
   vocab-parallel (``Shard(0)``, masked lookup + all-reduce) and the output head column-parallel
   over the vocabulary with replicated logits. All of it runs on CPU gloo. The optimizer learns
   each parameter's split dimension from its DTensor placement (``canzona.specs.specs_from_module``).

2. :func:`shard_megatron`: "Megatron style" plain tensors. Every TP-split weight is replaced by this
   rank's slice as an ordinary ``nn.Parameter`` and the split dims are returned as ``tp_dims``
   ({name: dim}), which the runtime accepts in place of placements. With a process group the
   forward is made tensor-parallel with autograd functions (copy-to/reduce-from/gather-from the TP
   region, as Megatron-LM does); without one only the weights are sharded (enough for optimizer tests).

In both, attention runs over local heads only: q/k/v are column-split on head boundaries, so a
rank's projections produce ``num_heads / tp`` query and ``num_kv_heads / tp`` key/value heads,
and :class:`canzona.models.qwen3.Attention` infers those counts from the activation width. That
needs ``tp`` to divide ``num_key_value_heads`` (checked here, on every rank, before any collective).

The per-head q/k RMSNorm weights are replicated but each rank applies them to its own heads only,
so their gradients are partial sums over heads: both variants all-reduce those two gradients over
the TP group in backward (a gradient hook), which makes every replicated parameter's gradient
identical on all TP ranks, as the DP runtime assumes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from canzona.config import ModelConfig
from canzona.models.qwen3 import Qwen3
from canzona.specs import specs_from_config

__all__ = [
    "COLWISE",
    "ROWWISE",
    "hf_tp_dims",
    "check_tp",
    "parallelize",
    "shard_megatron",
    "local_shard",
]

#: Sub-module suffixes of a decoder layer that are column-parallel (output features split, dim 0).
COLWISE: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
#: Sub-module suffixes of a decoder layer that are row-parallel (input features split, dim 1).
ROWWISE: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
_QK_NORMS: tuple[str, ...] = ("self_attn.q_norm", "self_attn.k_norm")


def hf_tp_dims(cfg: ModelConfig) -> dict[str, int]:
    """{parameter name: split dim} of every TP-split parameter in the HF layout (embedding and head
    on dim 0, column-parallel on dim 0, row-parallel on dim 1), as ``specs_from_config`` declares."""
    return {s.name: s.tp_dim for s in specs_from_config(cfg, layout="hf") if s.tp_dim is not None}


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError when ``tp`` cannot split this model on head and row boundaries (the same
    check ``canzona plan`` makes: :func:`canzona.config.check_tp_degree`)."""
    from canzona.config import check_tp_degree

    check_tp_degree(cfg, tp)


def _layer_plan(cfg: ModelConfig) -> dict[str, str]:
    out: dict[str, str] = {}
    for i in range(cfg.num_hidden_layers):
        for suffix in COLWISE:
            out[f"model.layers.{i}.{suffix}"] = "colwise"
        for suffix in ROWWISE:
            out[f"model.layers.{i}.{suffix}"] = "rowwise"
    return out


def _allreduce_grad_hook(group: dist.ProcessGroup | None):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone()
        dist.all_reduce(out, group=group)
        return out

    return hook


def _hook_qk_norms(model: Qwen3, group: dist.ProcessGroup | None) -> None:
    for i, layer in enumerate(model.model.layers):
        for suffix in _QK_NORMS:
            mod = layer.get_submodule(suffix)
            mod.weight.register_hook(_allreduce_grad_hook(group))


def parallelize(model: Qwen3, tp_mesh) -> Qwen3:  # tp_mesh: torch.distributed.device_mesh.DeviceMesh
    """Tensor-parallelize ``model`` in place over the 1-D ``tp_mesh`` with DTensor; returns it.

    Pass ``mesh["tp"]`` of a 2-D ("dp", "tp") mesh. Every rank must have built the model with the
    same seed (the full weights are the source of the shards). The forward afterwards equals the
    unsharded forward up to floating-point reassociation (row-parallel matmuls and the vocab-parallel
    lookup sum per-rank partial products, in a different order than one matmul does).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if not isinstance(model, Qwen3):
        raise TypeError(f"parallelize expects a canzona Qwen3 model, got {type(model).__name__}")
    if model.config.moe is not None: raise TypeError(f"parallelize supports the dense canzona Qwen3 only; {type(model).__name__} is a mixture of experts (no TP layout for expert stacks here)")  # noqa: E701
    if tp_mesh.ndim != 1:
        raise ValueError(f"parallelize needs a 1-D TP mesh (mesh['tp']), got {tp_mesh.ndim} dims")
    cfg = model.config
    check_tp(cfg, tp_mesh.size())
    plan: dict[str, object] = {
        # Vocab-parallel embedding: RowwiseParallel on an nn.Embedding shards the table on dim 0 and
        # all-reduces the masked partial lookups.
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # Column-parallel head over the vocabulary, logits all-gathered so the plain loss applies.
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for name, how in _layer_plan(cfg).items():
        plan[name] = ColwiseParallel() if how == "colwise" else RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    if cfg.tie_word_embeddings:
        # parallelize_module distributed the shared table twice; tie the head back to the embedding's
        # DTensor (both are Shard(0) over the vocabulary, so the head's hooks work unchanged).
        model.lm_head.weight = model.model.embed_tokens.weight
    _hook_qk_norms(model, tp_mesh.get_group())
    return model


# --------------------------------------------------------------------------- Megatron-style plain TP


def local_shard(full: torch.Tensor, dim: int, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's contiguous slice of ``full`` along ``dim`` (a copy), as TP layouts define it."""
    if full.shape[dim] % tp:
        raise ValueError(f"dimension {dim} of shape {tuple(full.shape)} does not divide by tp={tp}")
    return full.chunk(tp, dim=dim)[tp_rank].clone()


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient in backward (entering a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (summing row-parallel partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        ctx.rank, ctx.size, ctx.width = dist.get_rank(group), dist.get_world_size(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def _install_megatron_forward(model: Qwen3, group: dist.ProcessGroup | None, tp_rank: int) -> None:
    def copy_in(_mod: nn.Module, args: tuple) -> tuple:
        return (_CopyToTP.apply(args[0], group), *args[1:])

    def reduce_out(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(out, group)

    def gather_out(_mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        return _GatherFromTP.apply(out, group)

    emb = model.model.embed_tokens
    rows = emb.weight.shape[0]
    lo = tp_rank * rows

    def embed_in(mod: nn.Module, args: tuple) -> tuple:
        ids = args[0]
        outside = (ids < lo) | (ids >= lo + rows)
        mod._canzona_outside = outside  # read by embed_out, same forward call
        return ((ids - lo).masked_fill(outside, 0), *args[1:])

    def embed_out(mod: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
        out = out.masked_fill(mod._canzona_outside.unsqueeze(-1), 0.0)
        del mod._canzona_outside
        return _ReduceFromTP.apply(out, group)

    emb.register_forward_pre_hook(embed_in)
    emb.register_forward_hook(embed_out)
    for name, how in _layer_plan(model.config).items():
        mod = model.get_submodule(name)
        if how == "colwise":
            mod.register_forward_pre_hook(copy_in)
        else:
            mod.register_forward_hook(reduce_out)
    model.lm_head.register_forward_pre_hook(copy_in)
    model.lm_head.register_forward_hook(gather_out)
    _hook_qk_norms(model, group)


@torch.no_grad()
def shard_megatron(
    model: Qwen3,
    tp_rank: int,
    tp: int,
    *,
    group: dist.ProcessGroup | None = None,
    forward: bool = True,
) -> dict[str, int]:
    """Replace every TP-split weight of ``model`` by its plain local shard; return ``tp_dims``.

    ``tp_dims`` maps parameter name -> split dim (the ``hf`` layout's, see :func:`hf_tp_dims`), for
    ``specs_from_module(model, tp_dims=..., tp=tp)`` and the TP runtime. With ``forward=True`` (and
    ``tp > 1``) the forward is made tensor-parallel over ``group`` (default: the world), so it
    matches the unsharded model up to reassociation; ``forward=False`` only shards the weights.
    """
    if not isinstance(model, Qwen3):
        raise TypeError(f"shard_megatron expects a canzona Qwen3 model, got {type(model).__name__}")
    if model.config.moe is not None: raise TypeError(f"shard_megatron supports the dense canzona Qwen3 only; {type(model).__name__} is a mixture of experts (no TP layout for expert stacks here)")  # noqa: E701
    cfg = model.config
    check_tp(cfg, tp)
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank must be in [0, {tp}), got {tp_rank!r}")
    dims = hf_tp_dims(cfg)
    params = dict(model.named_parameters())
    for name, dim in dims.items():
        if name not in params:  # tied head: shared with the embedding, sharded once
            continue
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        setattr(mod, attr, nn.Parameter(local_shard(params[name].detach(), dim, tp_rank, tp)))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    if forward and tp > 1:
        _install_megatron_forward(model, group, tp_rank)
    return {n: d for n, d in dims.items() if n in dict(model.named_parameters())}
