"""Model configurations the simulator knows beyond the shipped ``canzona/data/models`` (a hypothetical 1T-parameter MoE)."""

from __future__ import annotations

from canzona.config import ModelConfig, MoEConfig
from canzona.plan.build import resolve_model

__all__ = ["MOE_1T_NAME", "moe_1t_config", "resolve_sim_model"]

MOE_1T_NAME = "qwen3-moe-1t"


def moe_1t_config() -> ModelConfig:
    """A 1.04T-parameter MoE in the Qwen3-MoE architecture (hypothetical: the scale case for the planner and the simulator).

    assumption: Kimi K2's published dimensions (hidden 7168, 61 layers, 64 query heads, 384
    experts, top-8, expert width 2048, vocabulary 163840) mapped onto Qwen3-MoE blocks (GQA with 8
    KV heads of 128 instead of MLA, every layer sparse, no shared expert). canzona's specs have no
    expert parallelism: every expert is TP-split like a dense MLP and replicated over DP.
    """
    return ModelConfig(
        name=MOE_1T_NAME,
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=163840,
        tie_word_embeddings=False,
        moe=MoEConfig(num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048),
        sources=(("all", "assumption: Kimi-K2-sized dimensions on the Qwen3-MoE architecture (canzona.sim.analysis.moe_1t_config)"),),
    )


def resolve_sim_model(model: str | ModelConfig) -> ModelConfig:
    """A shipped model name or config path, or :data:`MOE_1T_NAME`."""
    if isinstance(model, str) and model.lower() == MOE_1T_NAME:
        return moe_1t_config()
    return resolve_model(model)
