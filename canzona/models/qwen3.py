"""A tiny Qwen3-architecture decoder for tests, the demo, profiling and ``canzona train``.

Structure follows Hugging Face's Qwen3 (the ``hf`` layout of :func:`canzona.specs.specs_from_config`):
token embedding; per layer RMSNorm -> grouped-query attention with per-head q/k RMSNorm and rotary
position embeddings -> residual, RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; output head
(tied to the embedding when ``cfg.tie_word_embeddings``). No biases.

Parameter names and registration order equal ``specs_from_config(cfg, layout="hf")`` exactly,
so a plan built offline from the config applies to a live module unchanged.

Tensor parallelism: attention derives its head counts from the width of the projected
activations, not from the config, so the same forward runs on full weights, on DTensor-sharded
weights (``canzona.models.tp.parallelize``: column-parallel q/k/v give local heads) and on
Megatron-style plain local shards (``canzona.models.tp.shard_megatron``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from canzona.config import ModelConfig

__all__ = ["Qwen3", "RMSNorm", "Attention", "MLP", "DecoderLayer", "Qwen3Body", "lm_loss", "rotary"]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32 (as HF Qwen3 does) so a bf16 run does not lose the mean-square.
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm over the last dimension with a learned scale."""

    def __init__(self, size: int, eps: float, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def rotary(seq_len: int, head_dim: int, theta: float, *, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [seq_len, head_dim] for rotate-half rotary embeddings (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(pos, inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with per-head q/k RMSNorm and rotary embeddings (causal, SDPA)."""

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.head_dim = hd
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * hd, **kw)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * hd, **kw)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * hd, **kw)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, **kw)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Head counts come from the activation width: under TP the projections are column-split and
        # produce only this rank's heads (num_heads / tp), which is all this rank attends over.
        n_q, n_kv = q.shape[-1] // hd, k.shape[-1] // hd
        if n_q * hd != q.shape[-1] or n_kv * hd != k.shape[-1] or n_kv == 0 or n_q % n_kv:
            raise ValueError(
                f"attention sees {q.shape[-1]} query and {k.shape[-1]} key features, which is not a whole number "
                f"of heads of size {hd} with query heads a multiple of key/value heads (is tp a divisor of num_key_value_heads?)"
            )
        q = self.q_norm(q.view(b, t, n_q, hd)).transpose(1, 2)
        k = self.k_norm(k.view(b, t, n_kv, hd)).transpose(1, 2)
        v = v.view(b, t, n_kv, hd).transpose(1, 2)
        cos, sin = rotary(t, hd, self.rope_theta, device=x.device)
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        if n_q != n_kv:
            # Query head i reads key/value head i // (n_q / n_kv), as in HF's repeat_kv.
            rep = n_q // n_kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, n_q * hd))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(h, f, **kw)
        self.up_proj = nn.Linear(h, f, **kw)
        self.down_proj = nn.Linear(f, h, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block. Sub-modules are registered attention, MLP, then the two norms,
    which is Hugging Face's parameter order (and ``specs_from_config(layout="hf")``'s). ``mlp``
    is the feed-forward block's class (the dense :class:`MLP`, or a mixture-of-experts block)."""

    def __init__(self, cfg: ModelConfig, *, mlp: type[nn.Module] | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, device=device, dtype=dtype)
        self.mlp = (mlp or MLP)(cfg, device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Body(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``Qwen3Model``, registered as ``model``);
    ``mlp`` as in :class:`DecoderLayer`."""

    def __init__(self, cfg: ModelConfig, *, mlp: type[nn.Module] | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, mlp=mlp, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; ``labels`` are already shifted (``labels[:, t]`` follows
    ``input_ids[:, t]``). Computed in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


class Qwen3(nn.Module):
    """Tiny Qwen3 causal LM. ``forward(input_ids) -> logits``; :meth:`loss` gives next-token CE.

    Initialization is a pure function of ``seed``: every weight matrix is drawn, in registration
    order, from N(0, 0.02^2) with one ``torch.Generator``; norms start at one. Every rank that
    builds the model with the same seed holds the same weights, which TP sharding relies on.
    ``device="meta"`` builds shapes only (no initialization).

    Subclasses change the feed-forward block through :attr:`mlp_block` and which configs they
    accept through :meth:`check_config` (:class:`canzona.models.Qwen3MoE`).
    """

    #: the feed-forward block of every decoder layer (None: the dense :class:`MLP`)
    mlp_block: type[nn.Module] | None = None

    @staticmethod
    def check_config(cfg: ModelConfig) -> None:
        """Refuse a config this model cannot build (ValueError, one line)."""
        if cfg.moe is not None:
            raise ValueError(f"{cfg.name}: the tiny Qwen3 model is dense; use canzona.models.Qwen3MoE for a config with 'moe'")

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.check_config(cfg)
        self.config = cfg
        self.model = Qwen3Body(cfg, mlp=self.mlp_block, device=device, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device="meta")
            self.lm_head.weight = self.model.embed_tokens.weight
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        if torch.device(device or "cpu").type != "meta":
            self.reset_parameters(seed, init_std)

    @torch.no_grad()
    def reset_parameters(self, seed: int, init_std: float = 0.02) -> None:
        """Re-draw every parameter from ``seed`` (see the class docstring)."""
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
        for _, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                # Draw on CPU in fp32 so the values do not depend on the device or the param dtype.
                w = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, init_std, generator=gen)
                p.copy_(w.to(device=p.device, dtype=p.dtype))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.model(input_ids))
        # The logits of a 3-D linear (and of DTensor TP's Replicate output) are a view; FSDP2 hooks
        # the root module's output for its pre-backward all-gather and warns that an in-place op
        # on a view would drop that hook. A copy (bitwise equal) gives it a tensor of its own.
        return logits.clone() if logits._is_view() else logits

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of ``forward(input_ids)`` against ``labels``."""
        return lm_loss(self(input_ids), labels)
