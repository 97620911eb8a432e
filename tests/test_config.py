"""Shipped model configs: strict parsing, sources, and parameter counts against the model cards."""

from __future__ import annotations

import json

import pytest

from canzona.config import MODELS_DIR, ConfigError, ModelConfig, available_models, load_model_config
from canzona.plan import resolve_model
from canzona.specs import specs_from_config, total_numel

QWEN3 = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-30b-a3b"]

# Totals stated on the Hugging Face model cards (Qwen/Qwen3-<size>), in billions.
CARD_TOTALS = {
    "qwen3-0.6b": (0.596, 0.01),
    "qwen3-32b": (32.76, 0.01),
    "qwen3-30b-a3b": (30.53, 0.01),
    "qwen3-1.7b": (1.7, 0.05),
    "qwen3-4b": (4.0, 0.05),
    "qwen3-8b": (8.2, 0.05),
    "qwen3-14b": (14.8, 0.05),
}


def test_all_family_members_ship():
    assert set(QWEN3) <= set(available_models())


@pytest.mark.parametrize("name", QWEN3)
def test_config_loads_strictly_with_sources(name):
    raw = json.loads((MODELS_DIR / f"{name}.json").read_text())
    cfg = ModelConfig.from_dict(raw, origin=name)
    assert cfg.name == name
    src = dict(cfg.sources)
    numeric = [k for k in raw if k not in ("name", "sources")]
    missing = [k for k in numeric if k not in src]
    assert not missing, f"{name}: no source for {missing}"
    assert all("Qwen/Qwen3-" in v for k, v in src.items() if k in numeric)
    assert cfg.head_dim == 128 and cfg.vocab_size == 151936 and cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6


@pytest.mark.parametrize("name", sorted(CARD_TOTALS))
@pytest.mark.parametrize("layout", ["megatron", "hf"])
def test_parameter_count_matches_model_card(name, layout):
    want, tol = CARD_TOTALS[name]
    got = total_numel(specs_from_config(resolve_model(name), layout=layout)) / 1e9
    assert abs(got - want) <= tol, f"{name} ({layout}): {got:.4f}B vs card {want}B"


def test_shapes_of_named_members():
    c = resolve_model("qwen3-32b")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (
        5120, 25600, 64, 64, 8)
    assert not c.tie_word_embeddings
    m = resolve_model("qwen3-30b-a3b")
    assert m.moe is not None and (m.moe.num_experts, m.moe.num_experts_per_tok, m.moe.moe_intermediate_size) == (128, 8, 768)
    assert resolve_model("qwen3-4b").tie_word_embeddings and not resolve_model("qwen3-8b").tie_word_embeddings


def test_resolve_model_handles_dotted_names_and_paths(tmp_path):
    assert resolve_model("qwen3-0.6b").hidden_size == 1024
    assert resolve_model("QWEN3-1.7B").hidden_size == 2048
    raw = json.loads((MODELS_DIR / "qwen3-tiny.json").read_text())
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(raw))
    assert resolve_model(str(p)).hidden_size == raw["hidden_size"]
    with pytest.raises(ConfigError, match="unknown model"):
        resolve_model("qwen3-999b")


def test_malformed_configs_are_rejected(tmp_path):
    raw = json.loads((MODELS_DIR / "qwen3-tiny.json").read_text())
    bad_key = dict(raw, hidden_sise=3)
    bad_type = dict(raw, hidden_size="64")
    p1, p2, p3 = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    p1.write_text(json.dumps(bad_key))
    p2.write_text(json.dumps(bad_type))
    p3.write_text("{not json")
    with pytest.raises(ConfigError, match="unknown key"):
        load_model_config(p1)
    with pytest.raises(ConfigError, match="hidden_size"):
        load_model_config(p2)
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(p3)
