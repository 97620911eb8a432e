"""Parameter specs from configs (both layouts) and from modules (meta device)."""

from __future__ import annotations

import pytest

from canzona.plan import resolve_model
from canzona.specs import ParamSpec, is_matrix_param, specs_from_config, specs_from_module


def test_megatron_layout_shapes_and_splits():
    cfg = resolve_model("qwen3-32b")
    specs = {s.name: s for s in specs_from_config(cfg, tp=8)}
    qkv = specs["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((64 + 2 * 8) * 128, 5120) and qkv.tp_dim == 0 and qkv.local_shape == (1280, 5120)
    proj = specs["decoder.layers.0.self_attention.linear_proj.weight"]
    assert proj.shape == (5120, 8192) and proj.tp_dim == 1 and proj.local_shape == (5120, 1024)
    fc1 = specs["decoder.layers.63.mlp.linear_fc1.weight"]
    assert fc1.shape == (51200, 5120) and fc1.kind == "matrix" and fc1.layer == 63
    emb = specs["embedding.word_embeddings.weight"]
    assert emb.kind == "elementwise" and emb.tp_dim == 0 and emb.local_numel == 151936 * 5120 // 8
    assert specs["output_layer.weight"].kind == "elementwise"
    norm = specs["decoder.layers.0.input_layernorm.weight"]
    assert norm.kind == "elementwise" and not norm.tp_split and norm.local_shape == (5120,)
    assert len(specs) == 1 + 64 * 8 + 2


def test_hf_layout_and_tied_embeddings():
    cfg = resolve_model("qwen3-0.6b")
    hf = specs_from_config(cfg, layout="hf", tp=2)
    names = [s.name for s in hf]
    assert "lm_head.weight" not in names  # tied
    assert names[0] == "model.embed_tokens.weight"
    q = next(s for s in hf if s.name.endswith("layers.0.self_attn.q_proj.weight"))
    assert q.shape == (2048, 1024) and q.tp_dim == 0
    meg = specs_from_config(cfg, layout="megatron", tp=2)
    assert sum(s.numel for s in hf) == sum(s.numel for s in meg)


def test_moe_router_is_elementwise_and_separate_experts_are_matrices():
    cfg = resolve_model("qwen3-30b-a3b")
    specs = specs_from_config(cfg, tp=4, experts="separate")
    router = [s for s in specs if s.name.endswith("mlp.router.weight")]
    assert len(router) == 48 and all(s.kind == "elementwise" and s.tp_dim is None for s in router)
    experts = [s for s in specs if ".local_experts." in s.name]
    assert len(experts) == 48 * 128 * 2 and all(s.kind == "matrix" for s in experts)


def test_matrix_rule():
    assert is_matrix_param("decoder.layers.0.mlp.linear_fc1.weight", (8, 4))
    assert not is_matrix_param("embedding.word_embeddings.weight", (8, 4))
    assert not is_matrix_param("model.layers.0.mlp.gate.weight", (8, 4))
    assert not is_matrix_param("decoder.layers.0.input_layernorm.weight", (8,))


def test_bad_specs_raise():
    with pytest.raises(ValueError, match="does not divide"):
        ParamSpec("w", (6, 4), "matrix", 1, 3)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        ParamSpec("w", (6,), "matrix")
    with pytest.raises(ValueError, match="layout"):
        specs_from_config(resolve_model("qwen3-tiny"), layout="deepspeed")


def test_specs_from_meta_module_with_declared_tp_dims():
    torch = pytest.importorskip("torch")
    with torch.device("meta"):
        m = torch.nn.Sequential(torch.nn.Linear(8, 6, bias=True), torch.nn.Linear(6, 8, bias=False))
    specs = specs_from_module(m, tp_dims={"0.weight": 0, "1.weight": 1}, tp=2)
    by = {s.name: s for s in specs}
    assert [s.name for s in specs] == ["0.weight", "0.bias", "1.weight"]
    assert by["0.weight"].shape == (12, 8) and by["0.weight"].local_shape == (6, 8)
    assert by["1.weight"].shape == (8, 12) and by["1.weight"].tp_dim == 1
    assert by["0.bias"].kind == "elementwise" and by["0.weight"].kind == "matrix"


# ---------------------------------------------------------------- cost models (canzona.cost)
from canzona import cost as C  # noqa: E402


def test_cost_formulas_by_hand():
    assert C.muon_flops((6, 2)) == 5 * 2 * 6 * 2 * 2
    assert C.muon_flops((2, 6)) == C.muon_flops((6, 2))
    assert C.shampoo_flops((4, 2), precondition_frequency=8) == 2 * (16 * 2 + 4 * 4) + 13 * 8 + 10 * (64 + 8) // 8
    assert C.soap_flops((4, 2), precondition_frequency=8) == 3 * (16 * 2 + 4 * 4) + 13 * 8 + 10 * (64 + 8) // 8
    assert C.adamw_flops(10) == 130
    assert C.state_bytes("muon", (4, 2)) == 32
    assert C.state_bytes("shampoo", (4, 2)) == (2 * (16 + 4) + 16) * 4 == C.state_bytes("soap", (4, 2))
    assert C.state_bytes("adamw", (7,)) == 56


def test_cost_shape_switch_and_elementwise_model():
    w = ParamSpec("mlp.linear_fc1.weight", (16, 4), "matrix", 0, 4)  # local (4, 4)
    assert C.param_flops(w, "muon", "local") == C.muon_flops((4, 4))
    assert C.param_flops(w, "muon", "full") == C.muon_flops((16, 4)) / 4
    assert C.param_memory(w, "muon", "full") == C.param_memory(w, "muon", "local") == 4 * 4 * 4
    rep = ParamSpec("w", (16, 4), "matrix", None, 4)  # replicated: every TP rank does it all
    assert C.param_flops(rep, "muon", "full") == C.muon_flops((16, 4))
    emb = ParamSpec("embedding.word_embeddings.weight", (16, 4), "elementwise", 0, 4)
    assert C.param_flops(emb, "shampoo") == C.adamw_flops(16) and C.param_memory(emb, "soap") == 2 * 16 * 4
    assert C.param_cost(w, "numel") == 16
    with pytest.raises(ValueError):
        C.param_cost(w, "time")
    with pytest.raises(ValueError):
        C.param_flops(w, "lion")


def test_vectorised_costs_match_scalar():
    import numpy as np

    for name, tp, layout in (("qwen3-tiny", 2, "hf"), ("qwen3-30b-a3b", 4, "megatron")):
        specs = specs_from_config(resolve_model(name), tp=tp, layout=layout)[:400]
        for opt in C.OPTIMIZERS:
            for shape in ("full", "local"):
                f, m = C.cost_arrays(specs, opt, shape)
                assert np.array_equal(f, [C.param_flops(s, opt, shape) for s in specs])
                assert np.array_equal(m, [C.param_memory(s, opt, shape) for s in specs])
