"""canzona's tiny Qwen3-MoE: Hugging Face's parameter layout and forward, routing with its tie-break,
a zero gradient for an expert that routes no token, the roles it gets, and that it trains on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from canzona.config import load_model_config
from canzona.models import Qwen3, Qwen3MoE, batch
from canzona.models.qwen3_moe import route
from canzona.specs import module_roles

CFG = load_model_config("qwen3-moe-tiny")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _hf(cfg):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, num_experts=cfg.moe.num_experts,
        num_experts_per_tok=cfg.moe.num_experts_per_tok, moe_intermediate_size=cfg.moe.moe_intermediate_size,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], attn_implementation="eager",
    )
    return transformers.Qwen3MoeForCausalLM(hf_cfg).eval()


@pytest.mark.slow  # transformers' import and model build: ~20 s on 2 shared cores
def test_layout_and_forward_match_hugging_face() -> None:
    ours = Qwen3MoE(CFG, seed=0)
    hf = _hf(CFG)
    assert [(n, tuple(p.shape)) for n, p in ours.named_parameters()] == [(n, tuple(p.shape)) for n, p in hf.named_parameters()]
    hf.load_state_dict(ours.state_dict())
    ids, _ = batch(0, 0, 1, 2, 12, seed=0)
    with torch.no_grad():
        want = hf(ids).logits
        got = ours(ids)
    # not an exactness claim: HF's eager attention and RMSNorm round in another order than ours
    assert torch.allclose(got, want, rtol=0, atol=1e-4), (got - want).abs().max()


def test_route_top_k_renormalized_with_lower_index_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 2.0], [3.0, 1.0, 3.0, -1.0]])
    w, idx = route(logits, 2)
    assert idx.tolist() == [[1, 2], [0, 2]]
    assert torch.equal(w, torch.full((2, 2), 0.5))


def test_an_expert_without_tokens_gets_a_zero_gradient() -> None:
    model = Qwen3MoE(CFG, seed=0)
    idle = 5
    for layer in model.model.layers:  # the router never picks the idle expert (probability 0)
        def masked(x: torch.Tensor, gate: torch.nn.Module = layer.mlp.gate) -> tuple[torch.Tensor, torch.Tensor]:
            logits = F.linear(x, gate.weight).masked_fill(torch.arange(CFG.moe.num_experts) == idle, float("-inf"))
            return route(logits, gate.top_k)

        layer.mlp.gate.forward = masked
    ids, labels = batch(0, 0, 1, 2, 12, seed=0)
    x = model.model.embed_tokens(ids)
    assert model.model.layers[0].mlp.routed_tokens(model.model.layers[0].post_attention_layernorm(x))[idle] == 0
    model.loss(ids, labels).backward()
    for layer in model.model.layers:
        for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            assert p.grad is not None and torch.count_nonzero(p.grad[idle]) == 0
            assert torch.count_nonzero(p.grad) > 0  # the routed experts did learn


def test_roles_experts_router_and_embeddings() -> None:
    roles = module_roles(Qwen3MoE(CFG, device="meta"))
    assert roles["model.layers.1.mlp.experts.gate_up_proj"] == ("experts", False)
    assert roles["model.layers.1.mlp.experts.down_proj"] == ("experts", False)
    assert roles["model.layers.1.mlp.gate.weight"] == ("elementwise", False)
    assert roles["model.embed_tokens.weight"] == ("elementwise", False)
    assert roles["model.layers.1.self_attn.q_proj.weight"] == ("matrix", False)


def test_dense_and_moe_configs_go_to_their_own_class() -> None:
    with pytest.raises(ValueError, match="needs a config with 'moe'"):
        Qwen3MoE(load_model_config("qwen3-tiny"))
    with pytest.raises(ValueError, match="dense"):
        Qwen3(CFG)


def test_trains_on_cpu_with_muon_per_expert() -> None:
    """Single device, every expert its own Muon task (the reference the distributed tests use)."""
    from canzona.optim import Muon
    from moe_models import TaskReference

    model = Qwen3MoE(CFG, seed=0)
    ref = TaskReference(model, module_roles(model), Muon, {"lr": 0.02}, torch.optim.AdamW, {"lr": 3e-3})
    names, params = zip(*ref.model.named_parameters())
    losses = []
    for s in range(30):
        ids, labels = batch(s, 0, 1, 8, 32, seed=0)
        loss = ref.model.loss(ids, labels)
        ref.step(dict(zip(names, torch.autograd.grad(loss, params))))
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses
