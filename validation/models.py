"""The models the validation cells run on, built identically on every rank from a seed.

- :class:`AwkwardModel`: a parameter set chosen to break naive partitioners:
  odd sizes everywhere, a ``1 x n`` matrix, a tall and a wide matrix, one matrix larger than a
  whole DP rank's share of the buffer (and of its bucket), a 3-D element-wise tensor, odd biases
  and norms, and a token embedding *tied* to the output head (one parameter, two uses). Its TP
  layout (``TP_DIMS``) splits the tied embedding over the vocabulary, the tall and big matrices
  over rows and the wide one over columns; every split dim is even, every other dim odd.
  It has no forward: the injected check drives gradients through ``(p * g).sum()``.
- :func:`build_model`: the awkward model, the tiny Qwen3 or the tiny Qwen3-MoE (``qwen3-moe``:
  two layers of 8 stacked experts, ``(8, 64, 64)`` and the non-square ``(8, 64, 32)``, each
  expert a matrix task of its own) in a dtype, sharded Megatron-style (plain local shards plus
  ``tp_dims``) for TP, with the full unsharded copy the reference runs on. ``qwen3-moe`` runs
  on DP meshes only (canzona's TP helpers refuse a MoE model).

``validation.harness.ToyModel`` has awkward sizes too but no ``1 x n`` matrix, no tied embedding and
no parameter larger than a rank's share, hence this model here.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["AwkwardModel", "AWKWARD_TP_DIMS", "AWKWARD_BUCKET_NUMEL", "build_model", "shard_plain"]

#: Split dims of the awkward model's TP-split parameters (the tied head shares the embedding's).
AWKWARD_TP_DIMS: dict[str, int] = {"embed.weight": 0, "tall.weight": 0, "wide.weight": 1, "big.weight": 0}
#: Small buckets, so that the model spans several buckets and ``big`` exceeds a bucket by itself.
AWKWARD_BUCKET_NUMEL = 256


class AwkwardModel(nn.Module):
    """Parameters (registration order), shape, kind under the default rules:

    ``embed.weight`` 22 x 9 element-wise, tied to ``lm_head.weight``; ``row.weight`` 1 x 37
    element-wise (a 1 x n gate); ``tall.weight`` 50 x 3 matrix; ``tall.bias`` 13; ``wide.weight`` 3 x 66 matrix;
    ``big.weight`` 48 x 41 matrix (1968 elements: 72% of all 2738, so at dp >= 2 it is larger
    than any balanced rank share); ``odd.weight`` 7 x 9 matrix; ``norm.weight`` 5;
    ``kernel.weight`` 3 x 5 x 7 (3-D: the default rule refuses it, so the model says it is
    element-wise through :attr:`canzona_roles`, as a user would with ``roles=``); ``mix.bias`` 1.
    """

    #: the roles this model asks for (``DistributedOptimizer(roles=...)``), read by the suite
    canzona_roles: dict[str, str] = {"kernel.weight": "elementwise"}

    def __init__(self, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def param(*shape: int, scale: float = 0.25) -> nn.Parameter:
            return nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype))

        def holder(**params: nn.Parameter) -> nn.Module:
            m = nn.Module()
            for k, v in params.items():
                setattr(m, k, v)
            return m

        self.embed = holder(weight=param(22, 9))
        self.row = holder(weight=param(1, 37))
        self.tall = holder(weight=param(50, 3), bias=param(13))
        self.wide = holder(weight=param(3, 66))
        self.big = holder(weight=param(48, 41))
        self.odd = holder(weight=param(7, 9))
        self.norm = holder(weight=nn.Parameter((1.0 + 0.1 * torch.randn(5, generator=g)).to(dtype)))
        self.kernel = holder(weight=param(3, 5, 7))
        self.mix = holder(bias=param(1))
        self.lm_head = nn.Module()
        self.lm_head.weight = self.embed.weight  # tied: named_parameters yields it once, as embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - the suite injects gradients
        raise NotImplementedError("AwkwardModel has no forward; the injected check uses (p * g).sum()")


def shard_plain(model: nn.Module, tp_dims: dict[str, int], tp_rank: int, tp: int) -> dict[str, int]:
    """Replace each TP-split parameter by this rank's contiguous slice (Megatron-style plain
    tensors), keep ties (a parameter object reached under several names is sharded once and
    re-assigned everywhere), and return ``tp_dims`` for ``DistributedOptimizer(tp_dims=...)``."""
    if tp == 1:
        return {}
    named = dict(model.named_parameters())
    new: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for name, dim in tp_dims.items():
            p = named[name]
            if p.shape[dim] % tp:
                raise ValueError(f"{name}: dim {dim} of {tuple(p.shape)} does not divide by tp={tp}")
            new[id(p)] = nn.Parameter(p.detach().chunk(tp, dim=dim)[tp_rank].clone())
    # walk every (module, attribute) so tied uses get the same new Parameter object
    for mod in model.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and id(p) in new:
                setattr(mod, attr, new[id(p)])
    return dict(tp_dims)


def build_model(
    kind: str, dtype: torch.dtype, *, tp_rank: int = 0, tp: int = 1, seed: int = 0, model_kwargs: dict | None = None
) -> tuple[nn.Module, nn.Module, dict[str, int], int | None]:
    """(sharded model for this rank, full unsharded copy, tp_dims, bucket_numel or None for the default).

    ``kind`` is ``awkward``, ``qwen3``, ``qwen3-moe`` or the import path of the user's model factory
    (:mod:`validation.targets`; its ``canzona_tp_dims`` attribute, if any, names the parameters
    split over TP, sharded here Megatron-style)."""
    from validation.targets import is_import_path

    if is_import_path(kind):
        from validation.targets import build_custom_model

        full = build_custom_model(kind, model_kwargs or {}, dtype=dtype)
        model = copy.deepcopy(full)
        dims = shard_plain(model, dict(getattr(full, "canzona_tp_dims", None) or {}), tp_rank, tp)
        return model, full, dims, None
    if kind == "awkward":
        full = AwkwardModel(seed=seed, dtype=dtype)
        model = copy.deepcopy(full)
        dims = shard_plain(model, AWKWARD_TP_DIMS, tp_rank, tp)
        return model, full, dims, AWKWARD_BUCKET_NUMEL
    if kind == "qwen3":
        from canzona.config import load_model_config
        from canzona.models import Qwen3, shard_megatron

        cfg = load_model_config("qwen3-tiny")
        full = Qwen3(cfg, seed=seed, dtype=dtype)
        model = copy.deepcopy(full)
        dims = shard_megatron(model, tp_rank, tp, forward=False) if tp > 1 else {}
        # ~1/4 of the model per bucket: several buckets, cut points inside each
        return model, full, dims, 32768
    if kind == "qwen3-moe":
        if tp > 1:
            raise ValueError("the qwen3-moe model runs on DP meshes only (canzona's TP helpers refuse a mixture of experts)")
        from canzona.config import load_model_config
        from canzona.models import Qwen3MoE

        full = Qwen3MoE(load_model_config("qwen3-moe-tiny"), seed=seed, dtype=dtype)
        # ~1/4 of the model per bucket: several buckets, cut points between experts
        return copy.deepcopy(full), full, {}, 40960
    raise ValueError(f"unknown model {kind!r}")
