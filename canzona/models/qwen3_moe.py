"""A tiny Qwen3-MoE decoder (Hugging Face's ``Qwen3MoeForCausalLM`` structure) that trains on CPU.

For tests, the demo and notebooks of expert stacks as matrix tasks (Canzona, arXiv 2602.06079, with
experts as independent tasks): the same attention as :class:`canzona.models.Qwen3`, and in every
layer a sparse MoE block in place of the dense MLP, laid out as transformers 5.x keeps it:

* ``mlp.experts.gate_up_proj`` ``(E, 2F, H)`` and ``mlp.experts.down_proj`` ``(E, H, F)``: stacked
  3-D expert weights under a module path containing ``experts`` (the default role rule makes each
  stack E matrix tasks);
* ``mlp.gate.weight`` ``(E, H)``: the router (element-wise by the role rule, like HF's).

Routing per token: softmax of the router logits in float32, the ``k`` largest probabilities
(ties broken toward the lower expert index, by a stable sort, so routing never depends on a
kernel's choice), renormalized to sum to one (Qwen3's ``norm_topk_prob``). Expert ``e`` runs
``down_e(silu(gate_e x) * up_e x)`` on the tokens routed to it, scaled by their weights and summed
into the output with ``index_add_`` in token order; an expert that got no token contributes nothing
and gets a zero gradient slice, not a missing one. No load-balancing loss (the model is for
exactness and demos, not quality).

Parameter names and registration order are HF's (``experts`` before ``gate``), hence those of
``specs_from_config(cfg, layout="hf")`` for the MoE config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from canzona.config import ModelConfig

from .qwen3 import Qwen3

__all__ = ["MoEBlock", "Qwen3MoE", "StackedExperts", "TopKRouter", "route"]


def route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, experts)`` of shape ``[T, k]``: the top-``k`` softmax probabilities of each row
    of ``logits`` (float32), renormalized, and their expert indices (ties: lower index first)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, idx = top[:, :k], idx[:, :k]
    return top / top.sum(dim=-1, keepdim=True), idx


class TopKRouter(nn.Module):
    """The router: ``weight`` ``(E, H)``; returns :func:`route` of ``x @ weight.T``."""

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.top_k = cfg.moe.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(cfg.moe.num_experts, cfg.hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(x, self.weight), self.top_k)


class StackedExperts(nn.Module):
    """E SwiGLU experts kept as two stacks: ``gate_up_proj`` (E, 2F, H) and ``down_proj`` (E, H, F)."""

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        assert cfg.moe is not None
        e, h, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, h, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, h, f, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``; ``weights``/``experts`` ``[T, k]`` from the router."""
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            tokens, slot = torch.where(experts == e)
            if tokens.numel() == 0:
                continue
            gate, up = F.linear(x[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, tokens, y * weights[tokens, slot, None].to(y.dtype))
        return out


class MoEBlock(nn.Module):
    """Router and stacked experts (HF's ``Qwen3MoeSparseMoeBlock``; ``experts`` registered first)."""

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.experts = StackedExperts(cfg, device=device, dtype=dtype)
        self.gate = TopKRouter(cfg, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.gate(flat)
        return self.experts(flat, weights, experts).view_as(x)

    def routed_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """How many (token, slot) pairs each expert receives for ``x`` (``[E]`` int64)."""
        _, experts = self.gate(x.reshape(-1, x.shape[-1]))
        return torch.bincount(experts.reshape(-1), minlength=self.experts.gate_up_proj.shape[0])


class Qwen3MoE(Qwen3):
    """Tiny Qwen3-MoE causal LM: :class:`canzona.models.Qwen3` with :class:`MoEBlock` as every
    layer's feed-forward block (construction, initialization, ``forward`` and :meth:`loss` are the
    dense model's). ``forward(input_ids) -> logits``.

    Needs a config with ``moe`` (``canzona/data/models/qwen3-moe-tiny.json``). Initialization is a
    pure function of ``seed``, as the dense model's: every parameter of rank >= 2 (expert stacks
    and the router included) from N(0, init_std^2) in registration order, norms at one.
    ``device="meta"`` builds shapes only. canzona's TP helpers (:func:`canzona.models.parallelize`,
    :func:`canzona.models.shard_megatron`) refuse it: they lay out the dense model only.
    """

    mlp_block = MoEBlock

    @staticmethod
    def check_config(cfg: ModelConfig) -> None:
        if cfg.moe is None:
            raise ValueError(f"{cfg.name}: Qwen3MoE needs a config with 'moe' (use canzona.models.Qwen3 for a dense one)")
