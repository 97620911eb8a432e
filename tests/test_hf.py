"""Hugging Face transformers models (Qwen3ForCausalLM, LlamaForCausalLM built from small configs,
nothing downloaded) under canzona: DP every strategy bitwise, transformers' own TP plan bitwise
with injected gradients, real forward/backward to a proven bound, in the README's order (optimizer
built before the first forward, which registers transformers' q/k-norm gradient all-reduce hook
after canzona's). One spawned world-2 run serves every case; each test asserts on its own part."""

from __future__ import annotations

import pytest
import torch

from canzona.config import load_model_config
from canzona.runtime.launch import run_workers
from harness import attempt, case_results
from validation.harness import (
    ReferenceRunner,
    inject_grads,
    integer_grads,
    mean_grads,
    pack,
    params_of,
    tensors_equal,
    tp_cut,
    unpack,
)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

STEPS = 2
MATRIX_KW = {"lr": 0.05}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}
#: (architecture, tied embeddings): Qwen3 as configured by qwen3-tiny (untied), Llama tied
MODELS: tuple[tuple[str, bool], ...] = (("qwen3", False), ("llama", True))
#: strategy -> matrix optimizer ("zero1" cuts matrices, so AdamW everywhere)
DP_CASES: dict[str, str] = {"zero1": "adamw", "sc": "muon", "layerwise": "muon", "asc": "muon", "lb-asc": "muon", "lb-asc-joint": "muon"}
TP_STRATEGIES: tuple[str, ...] = ("lb-asc", "sc")
BUCKET_NUMEL = 30_000
#: gradients transformers' TP plan all-reduces over TP in backward (per-head q/k norms): each TP rank
#: holds a partial sum, so injected gradients give them ``full / tp`` (see validation.harness.tp_cut)
PARTIAL = ("q_norm.weight", "k_norm.weight")


def _model(arch: str, tied: bool, seed: int = 0) -> torch.nn.Module:
    from canzona.hf import hf_config

    cfg = hf_config(load_model_config("qwen3-tiny"), arch, tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(seed)
    cls = transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.LlamaForCausalLM
    return cls(cfg).float()


def _ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))


def _cls(name: str) -> type[torch.optim.Optimizer]:
    from canzona.optim import Muon

    return {"adamw": torch.optim.AdamW, "muon": Muon}[name]


# ------------------------------------------------------------------------------ workers


def _dp_case(rank: int, arch: str, tied: bool, strategy: str) -> dict:
    import canzona

    model = _model(arch, tied)
    opt = canzona.DistributedOptimizer(
        model, _cls(DP_CASES[strategy]), strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=BUCKET_NUMEL
    )
    for s in range(STEPS):
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        opt.zero_grad()
    return {"params": params_of(model), "planned": [pp.name for pp in opt.plan.params], "buckets": len(opt.plan.buckets)}


def _tp_model(arch: str, tied: bool = False):
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.hf import apply_tp_plan

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = apply_tp_plan(_model(arch, tied), mesh["tp"])
    return mesh, model


def _tp_injected(rank: int, arch: str, strategy: str, tied: bool = False) -> dict:
    """README order: shard, build the optimizer, then the first forward (transformers registers its
    q/k-norm hook there, after canzona's); gradients injected through backward."""
    import canzona
    from canzona.specs import specs_from_module

    mesh, model = _tp_model(arch, tied)
    opt = canzona.DistributedOptimizer(model, "muon", strategy=strategy, mesh=mesh, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW)
    model(input_ids=_ids(0, 0))  # first forward: registers transformers' gradient hooks (no backward)
    tp_dims = {s.name: s.tp_dim for s in specs_from_module(model) if s.tp_split}
    full_shapes = {s.name: s.shape for s in specs_from_module(model)}
    partial = [n for n in full_shapes if n.endswith(PARTIAL)]
    for s in range(STEPS):
        full = integer_grads(full_shapes, step=s, rank=0)
        inject_grads(model, tp_cut(full, tp_dims, mesh["tp"].get_local_rank(), 2, partial=partial))
        opt.step()
        opt.zero_grad()
    tie = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return {"params": params_of(model), "tp_dims": tp_dims, "partial": partial, "hosted": opt.runtime.tp_engine is not None, "tie": tie}


#: Bound for transformers' TP plan with real forward/backward against one device. Bitwise equality
#: is impossible: a row-parallel projection (o_proj, down_proj) computes each output element as two
#: half-length dot products, one per TP rank, summed by the all-reduce, while the single-device
#: matmul accumulates the full-length dot product in its own order; fp32 addition is not
#: associative, so the logits and every gradient differ in their last bits before any optimizer
#: runs (the vocab-parallel embedding's all-reduce and the q/k-norm gradient all-reduce reassociate
#: sums the same way). Rounding-level gradient differences stay rounding-level in the update when
#: the update is Lipschitz in the gradient: Newton-Schulz in fp32 (in bf16 a 1e-8 change can flip a
#: rounding and move the update by a bf16 ulp) and AdamW with eps = 1e-3 (|d update| <= lr |d g| /
#: eps; with eps = 1e-8 a gradient of +1e-12 against -1e-12 moves by +lr against -lr). An ownership,
#: routing or hook mistake moves a parameter by about lr = 0.05 instead, far above the bound.
TP_BACKWARD_ATOL = 1e-4
TP_BACKWARD_MATRIX_KW = {**MATRIX_KW, "ns_dtype": torch.float32}
TP_BACKWARD_EW_KW = {**EW_KW, "eps": 1e-3}


def _tp_backward(rank: int, arch: str) -> dict:
    import canzona

    mesh, model = _tp_model(arch)
    opt = canzona.DistributedOptimizer(
        model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs=TP_BACKWARD_MATRIX_KW, elementwise_kwargs=TP_BACKWARD_EW_KW
    )
    losses = []
    for s in range(STEPS):
        ids = _ids(s, 0)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"params": params_of(model), "losses": losses}


def _moe_under_tp_plan(rank: int, arch: str) -> dict:
    """A MoE model under transformers' TP plan: its packed_colwise expert stack (a _StridedShard
    placement) is an expert stack split over TP (un-packed on each expert's host, see
    tests/test_tp_experts.py); marked element-wise it is served too (AdamW on the shards); marked
    as one matrix it is refused in one line naming it."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.hf import apply_tp_plan

    common = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    if arch == "mixtral":
        cls, cfg = transformers.MixtralForCausalLM, transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    else:
        cls, cfg = transformers.Qwen2MoeForCausalLM, transformers.Qwen2MoeConfig(
            **common, moe_intermediate_size=12, shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = apply_tp_plan(cls(cfg).float(), mesh["tp"])
    out = {}
    for key, roles in (("default", None), ("elementwise", {"*experts*": "elementwise"}), ("matrix", {"*experts*": "matrix"})):
        try:
            canzona.DistributedOptimizer(model, "muon", mesh=mesh, roles=roles)
            out[key] = None
        except ValueError as exc:
            out[key] = str(exc)
    return out


def hf_worker(rank: int, world: int) -> bytes:
    out: dict = {"dp": {}, "tp": {}, "backward": {}}
    for arch, tied in MODELS:
        for strategy in DP_CASES:
            out["dp"][(arch, strategy)] = _dp_case(rank, arch, tied, strategy)
    for arch, _ in MODELS:
        for strategy in TP_STRATEGIES:
            out["tp"][(arch, strategy)] = _tp_injected(rank, arch, strategy)
        out["backward"][arch] = _tp_backward(rank, arch)
    out["tp_tied"] = {"llama": attempt(_tp_injected, rank, "llama", "lb-asc", True)}  # tied embeddings under the TP plan
    out["moe_tp"] = {arch: attempt(_moe_under_tp_plan, rank, arch) for arch in ("mixtral", "qwen2_moe")}
    return pack(out)


_RUN: list[dict] = []


def _results() -> list[dict]:
    if not _RUN:
        _RUN.extend(unpack(r) for r in run_workers(hf_worker, 2, timeout_s=300))
    return _RUN


# ------------------------------------------------------------------------------ tests


def test_hf_parameter_roles_follow_canzonas_rule() -> None:
    """Roles of a transformers Qwen3 come from the rule canzona's own HF-layout specs use: the same
    names, shapes, kinds and TP split dims as ``specs_from_config(..., layout="hf")``."""
    from canzona.models import hf_tp_dims
    from canzona.specs import specs_from_config, specs_from_module

    cfg = load_model_config("qwen3-tiny")
    model = _model("qwen3", False)
    dims = hf_tp_dims(cfg)
    got = {s.name: s for s in specs_from_module(model, tp_dims={n: d for n, d in dims.items()}, tp=1)}
    want = {s.name: s for s in specs_from_config(cfg, layout="hf", tp=1)}
    assert got.keys() == want.keys()
    for n in want:
        assert (got[n].shape, got[n].kind) == (want[n].shape, want[n].kind), n
    assert got["model.embed_tokens.weight"].kind == "elementwise" and got["lm_head.weight"].kind == "elementwise"
    assert got["model.layers.0.self_attn.q_norm.weight"].kind == "elementwise"
    assert got["model.layers.0.mlp.gate_proj.weight"].kind == "matrix"


def test_tied_embeddings_are_one_parameter() -> None:
    from canzona.specs import specs_from_module

    model = _model("llama", True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = [s.name for s in specs_from_module(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names


@pytest.mark.parametrize("arch,tied", MODELS)
def test_dp2_every_strategy_bitwise(arch: str, tied: bool) -> None:
    results = [r["dp"] for r in _results()]
    for strategy, optname in DP_CASES.items():
        model = _model(arch, tied)
        ref = ReferenceRunner(model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1")
        for s in range(STEPS):
            ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(2)]))
        want = ref.params()
        for rank, res in enumerate(results):
            got = res[(arch, strategy)]
            assert got["buckets"] > 1, "the case must exercise several buckets"
            assert tensors_equal(want, got["params"]) == [], f"{arch} {strategy} rank {rank}: differs from one device"
            if tied:
                assert got["planned"].count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in got["planned"]


@pytest.mark.parametrize("arch", [m for m, _ in MODELS])
def test_tp2_with_transformers_tp_plan_injected_bitwise(arch: str) -> None:
    """dp1 x tp2 under transformers' own TP plan, README order: bitwise against one device. The
    Qwen3 q/k norms only reach the full gradient through transformers' all-reduce hook, registered
    after canzona's: a hook that saw None (or that canzona read before it) would fail this."""
    results = [r["tp"] for r in _results()]
    for strategy in TP_STRATEGIES:
        model = _model(arch, False)
        ref = ReferenceRunner(model, _cls("muon"), MATRIX_KW, torch.optim.AdamW, EW_KW)
        for s in range(STEPS):
            ref.step(integer_grads(model, step=s, rank=0))
        want = ref.params()
        for tp_rank, res in enumerate(results):
            got = res[(arch, strategy)]
            if arch == "qwen3":
                assert got["partial"], "the q/k norms must be among the hooked parameters"
            assert any(r[(arch, strategy)]["hosted"] for r in results), "no rank ran the TP engine"
            shard = tp_cut(want, got["tp_dims"], tp_rank, 2)
            assert got["tp_dims"], "transformers' TP plan must shard some parameters"
            assert tensors_equal(shard, got["params"]) == [], f"{arch} {strategy} tp rank {tp_rank}: differs from one device"


def test_tp2_tied_embeddings_keep_their_tie_under_the_tp_plan_bitwise() -> None:
    """Llama with tie_word_embeddings=True under transformers' TP plan: the vocabulary-parallel
    embedding and the column-parallel head share one Shard(0) DTensor, one parameter to canzona,
    bitwise against one device."""
    results = case_results(_results(), "tp_tied", "llama")
    model = _model("llama", True)
    ref = ReferenceRunner(model, _cls("muon"), MATRIX_KW, torch.optim.AdamW, EW_KW)
    for s in range(STEPS):
        ref.step(integer_grads(model, step=s, rank=0))
    want = ref.params()
    for tp_rank, got in enumerate(results):
        assert got["tie"], "the TP plan broke the tie between lm_head and embed_tokens"
        assert got["tp_dims"].get("model.embed_tokens.weight") == 0 and "lm_head.weight" not in got["params"]
        assert tensors_equal(tp_cut(want, got["tp_dims"], tp_rank, 2), got["params"]) == [], f"tp rank {tp_rank}: differs from one device"


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_packed_colwise_under_tp_plan_served_and_as_one_matrix_refused_naming_the_placement(arch: str) -> None:
    for got in case_results(_results(), "moe_tp", arch):
        # under the default role rule the packed stack is accepted (each expert a TP task), and
        # marked element-wise too (AdamW on the shards); marked as one matrix, the packed stack's
        # placement itself is named (its shards joined end to end would reorder the rows)
        assert got["default"] is None and got["elementwise"] is None, got
        msg = got["matrix"]
        assert msg is not None and "gate_up_proj" in msg and "_StridedShard" in msg and "packed_colwise" in msg and "\n" not in msg


@pytest.mark.parametrize("arch", [m for m, _ in MODELS])
def test_tp2_real_forward_backward_within_bound(arch: str) -> None:
    from canzona.optim import Muon

    results = [r["backward"][arch] for r in _results()]
    assert results[0]["losses"] == results[1]["losses"], "TP ranks compute the same loss"
    model = _model(arch, False)
    ref = ReferenceRunner(model, Muon, TP_BACKWARD_MATRIX_KW, torch.optim.AdamW, TP_BACKWARD_EW_KW)
    ref_losses = []
    for s in range(STEPS):
        ref.model.zero_grad(set_to_none=True)
        ids = _ids(s, 0)
        loss = ref.model(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_losses.append(float(loss.detach()))
        ref.step({n: p.grad.clone() for n, p in ref.model.named_parameters()})
    want = ref.params()
    init = {n: p.detach() for n, p in model.named_parameters()}
    tp_dims = _results()[0]["tp"][(arch, "lb-asc")]["tp_dims"]
    assert max(abs(a - b) for a, b in zip(ref_losses, results[0]["losses"])) < 1e-5
    worst = 0.0
    for tp_rank, res in enumerate(results):
        shard = tp_cut(want, tp_dims, tp_rank, 2)
        for n, w in shard.items():
            worst = max(worst, float((w - res["params"][n]).abs().max()))
    assert worst < TP_BACKWARD_ATOL, f"max |TP run - one device| = {worst:.3g}"
    moved = min(float((want[n] - init[n]).abs().max()) for n in want)
    assert moved > 100 * TP_BACKWARD_ATOL, "the bound must be far below the size of an update"
