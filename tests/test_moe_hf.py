"""transformers' MoE models (Qwen3-MoE, Mixtral, Qwen2-MoE, built from small configs, nothing
downloaded) keep their experts as 3-D stacks: canzona's default rule makes each stack E matrix
tasks (and Qwen2-MoE's 1 x N shared-expert gate element-wise), and both paths update every expert
bitwise as the single-device optimizer does on that expert alone: ZeRO-1 DP (dp 2, lb-asc and sc)
and FSDP2 (dp_shard 2, fully_shard per decoder layer). Gradients are injected (integers, so the
DP mean is exact); one spawned world-2 run serves every case."""

from __future__ import annotations

import pytest
import torch

from canzona.runtime.launch import run_workers
from canzona.specs import module_roles
from validation.harness import inject_grads, integer_grads, mean_grads, pack, unpack
from moe_models import TaskReference

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
DP_STRATEGIES = ("lb-asc", "sc")
STEPS = 2
MKW = {"lr": 0.05}
EKW = {"lr": 0.01, "weight_decay": 0.1}


def _model(arch: str) -> torch.nn.Module:
    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    if arch == "qwen3_moe":
        cls, cfg = transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            **common, head_dim=8, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    elif arch == "mixtral":
        cls, cfg = transformers.MixtralForCausalLM, transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    else:
        cls, cfg = transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=12, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    return cls(cfg).float()


def _grads(model: torch.nn.Module, step: int, rank: int) -> dict[str, torch.Tensor]:
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    g = integer_grads(shapes, step=step, rank=rank)
    if step == 1:  # expert 3 of layer 0 got no tokens on any rank
        for n in g:
            if n.startswith("model.layers.0.mlp.experts."):
                g[n][3].zero_()
    return g


def _dp(rank: int, arch: str, strategy: str) -> dict:
    import canzona

    model = _model(arch)
    opt = canzona.DistributedOptimizer(model, "muon", strategy=strategy, optimizer_kwargs=MKW, elementwise_kwargs=EKW, bucket_numel=20_000)
    for s in range(STEPS):
        inject_grads(model, _grads(model, s, rank))
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fsdp(rank: int, arch: str) -> dict:
    """Each rank's ``p.grad`` is its block of the DP mean, as FSDP2's reduce-scatter leaves it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import canzona

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = _model(arch)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = canzona.DistributedOptimizer(model, "muon", mesh=mesh, optimizer_kwargs=MKW, elementwise_kwargs=EKW)
    for s in range(STEPS):
        mean = mean_grads([_grads(model, s, r) for r in range(2)])
        for n, p in model.named_parameters():
            chunks = torch.chunk(mean[n], 2, dim=0)
            local = chunks[rank] if rank < len(chunks) else mean[n][:0]
            assert tuple(local.shape) == tuple(p.to_local().shape), n
            p.grad = DTensor.from_local(local.contiguous(), mesh, p.placements, shape=p.shape, stride=p.stride())
        opt.step()
        opt.zero_grad()
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def worker(rank: int, world: int) -> bytes:
    out = {}
    for arch in ARCHS:
        for strategy in DP_STRATEGIES:
            out[(arch, strategy)] = _dp(rank, arch, strategy)
        out[(arch, "fsdp2")] = _fsdp(rank, arch)
    return pack(out)


_RUN: list[dict] = []


def _results() -> list[dict]:
    if not _RUN:
        _RUN.extend(unpack(r) for r in run_workers(worker, 2, timeout_s=400))
    return _RUN


def _reference(arch: str) -> dict[str, torch.Tensor]:
    from canzona.optim import Muon

    model = _model(arch)
    ref = TaskReference(model, module_roles(model), Muon, MKW, torch.optim.AdamW, EKW)
    for s in range(STEPS):
        ref.step(mean_grads([_grads(model, s, r) for r in range(2)]))
    return ref.params()


def test_default_roles_of_transformers_moe_models() -> None:
    for arch in ARCHS:
        roles = module_roles(_model(arch))
        stacks = [n for n, (r, _) in roles.items() if r == "experts"]
        assert len(stacks) == 4 and all(".mlp.experts." in n for n in stacks), arch
        assert roles["model.embed_tokens.weight"][0] == "elementwise"
        assert roles["model.layers.0.mlp.gate.weight"][0] == "elementwise"
    assert module_roles(_model("qwen2_moe"))["model.layers.0.mlp.shared_expert_gate.weight"][0] == "elementwise"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", (*DP_STRATEGIES, "fsdp2"))
def test_every_expert_bitwise(arch: str, path: str) -> None:
    want = _reference(arch)
    for r in _results():
        got = r[(arch, path)]
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert bad == [], bad
