"""Expert stacks in the config-based planner: specs_from_config's stacked layout (and the separate
one kept), plans that place the experts of one stack on several DP ranks (cut between experts
only), the atomic bound counting one expert as the task, Qwen3-235B-A22B's config, and the
``canzona plan`` report (max / mean FLOPs and state over every GPU next to the bound)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from canzona.config import load_model_config
from canzona.cost import matrix_flops
from canzona.plan import build, plan_model
from canzona.plan.convention import lower_bound
from canzona.specs import ParamSpec, specs_from_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("layout,up,down,router", [
    ("hf", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"),
    ("megatron", "mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight", "mlp.router.weight"),
])
def test_stacked_experts_are_e_tasks_and_keep_the_parameter_count(layout: str, up: str, down: str, router: str) -> None:
    cfg = load_model_config("qwen3-30b-a3b")
    stacked = specs_from_config(cfg, tp=4, layout=layout)
    separate = specs_from_config(cfg, tp=4, layout=layout, experts="separate")
    assert sum(s.numel for s in stacked) == sum(s.numel for s in separate)
    layer = {s.name.split("layers.3.", 1)[1]: s for s in stacked if ".layers.3." in s.name}
    assert layer[up].shape == (128, 2 * 768, 2048) and layer[down].shape == (128, 2048, 768)
    assert all(layer[n].kind == "experts" and layer[n].tp_dim is None and layer[n].n_tasks == 128 for n in (up, down))
    assert layer[router].kind == "elementwise"
    assert sum(s.n_tasks for s in stacked if s.kind == "experts") == 48 * 2 * 128
    assert not any(".experts." in s.name and s.kind == "matrix" for s in stacked)
    assert sum(".experts." in s.name for s in separate) == 48 * 128 * (2 if layout == "megatron" else 3)


def test_stacked_hf_specs_are_the_tiny_moe_models_parameters() -> None:
    import torch

    from canzona.models import Qwen3MoE

    cfg = load_model_config("qwen3-moe-tiny")
    model = Qwen3MoE(cfg, device="meta")
    assert [(s.name, s.shape) for s in specs_from_config(cfg, layout="hf")] == [
        (n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, torch.nn.Parameter)


def test_unknown_experts_layout_is_one_error() -> None:
    with pytest.raises(ValueError, match="unknown experts layout 'fused'"):
        specs_from_config(load_model_config("qwen3-moe-tiny"), experts="fused")


def test_qwen3_235b_a22b_config_matches_its_published_total() -> None:
    cfg = load_model_config("qwen3-235b-a22b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4096, 94, 64, 4, 128)
    assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.num_experts_per_tok, cfg.moe.moe_intermediate_size) == (128, 8, 1536)
    total = sum(s.numel for s in specs_from_config(cfg))
    assert abs(total / 1e9 - 235.09) < 0.01  # the model card's 235B total (235.09B)


def test_lower_bound_takes_one_expert_as_the_task() -> None:
    stack = ParamSpec("l.experts.w", (4, 64, 32), "experts")
    dense = ParamSpec("l.proj.weight", (64, 64), "matrix")
    one, sq = 2.0 * matrix_flops("muon", (64, 32)), 2.0 * matrix_flops("muon", (64, 64))
    assert lower_bound([stack, dense], 4, 1) == pytest.approx(max(1.0, sq / ((4 * one + sq) / 4)))
    assert lower_bound([stack], 2, 1) == 1.0  # 4 equal experts over 2 GPUs: no atom above the mean


def _whole_stacks(monkeypatch: pytest.MonkeyPatch, **kw):
    with monkeypatch.context() as m:
        m.setattr(build, "_partition_experts", lambda *a: None)
        return plan_model(**kw)


def test_lb_asc_spreads_a_stacks_experts_over_ranks_and_balances_better(monkeypatch: pytest.MonkeyPatch) -> None:
    kw = {"model": "qwen3-30b-a3b", "dp": 32, "tp": 4}
    plan = plan_model(**kw)
    plan.validate()  # every cut of a stack falls between experts (Plan.validate refuses others)
    cut = [p for p in plan.params if p.role == "experts" and p.dp_ranges]
    assert cut, "no expert stack was spread over ranks"
    for p in cut:
        unit = p.spec.numel // p.spec.shape[0]
        assert all(s % unit == 0 and e % unit == 0 for _, s, e in p.dp_ranges)
        assert len({r for r, _, _ in p.dp_ranges}) >= 2
    whole = _whole_stacks(monkeypatch, **kw)
    assert not any(p.dp_ranges for p in whole.params if p.role == "experts")
    assert plan.metrics.details["tp_flops_ratio_global"] < whole.metrics.details["tp_flops_ratio_global"]
    assert plan.metrics.dp_flops_ratio < whole.metrics.dp_flops_ratio


def test_separate_form_still_plans() -> None:
    plan = plan_model("qwen3-30b-a3b", dp=8, tp=2, experts="separate")
    assert not any(p.role == "experts" for p in plan.params)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_cli_plan_reports_all_gpu_flops_and_state_with_the_bound(model: str) -> None:
    run = subprocess.run([sys.executable, "-m", "canzona", "plan", "--model", model, "--dp", "32", "--tp", "4"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-1000:]
    lines = {line.split("  ")[1].strip(): line for line in run.stdout.splitlines() if line.startswith("  ") and "  " in line[2:]}
    assert "atomic lower bound" in lines["TP FLOPs, all GPUs"] and "over all 128 GPUs" in lines["TP FLOPs, all GPUs"]
    assert "over all 128 GPUs" in lines["TP state, all GPUs"]
