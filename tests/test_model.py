"""Tiny Qwen3 model, its tensor parallelization (DTensor and Megatron-style) and synthetic data."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from canzona.config import load_model_config
from canzona.models import MarkovData, Qwen3, batch, check_tp, hf_tp_dims, lm_loss, parallelize, shard_megatron
from canzona.runtime.launch import run_workers
from canzona.specs import specs_from_config, specs_from_module

CFG = load_model_config("qwen3-tiny")
TIED = replace(CFG, tie_word_embeddings=True)

# Why TP results are compared with a tolerance and not torch.equal: a row-parallel layer (o_proj,
# down_proj) and the vocab-parallel embedding compute per-rank partial products and all-reduce them,
# i.e. sum_k x_k w_k is evaluated as (sum over rank 0's k) + (sum over rank 1's k) instead of one
# blocked sum; fp32 addition is not associative, so results differ in the last bits (observed
# ~1e-7 relative). rtol 1e-5 leaves two orders of magnitude of headroom over that while still
# catching any real mistake (a wrong head mapping or a missing reduction changes the loss by >1e-2).
RTOL = 1e-5


def _inputs(b: int = 2, t: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(0, 0, 1, b, t, seed, vocab=CFG.vocab_size)


# --------------------------------------------------------------------------- single process


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_param_names_and_order_match_hf_specs(device: str) -> None:
    model = Qwen3(CFG, device=device)
    assert specs_from_module(model, tp_dims=hf_tp_dims(CFG)) == specs_from_config(CFG, layout="hf")
    assert all(p.device.type == device for p in model.parameters())


def test_tied_embeddings_share_one_parameter() -> None:
    cfg = replace(CFG, tie_word_embeddings=True)
    model = Qwen3(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert specs_from_module(model, tp_dims=hf_tp_dims(cfg)) == specs_from_config(cfg, layout="hf")
    ids, labels = _inputs()
    assert torch.isfinite(model.loss(ids, labels))


def test_init_is_a_function_of_the_seed() -> None:
    a, b, c = Qwen3(CFG, seed=3), Qwen3(CFG, seed=3), Qwen3(CFG, seed=4)
    for (n, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), n
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), n
    assert all(p.bias is None for p in a.modules() if isinstance(p, torch.nn.Linear))


def test_forward_shapes_loss_and_causality() -> None:
    model = Qwen3(CFG, seed=0)
    ids, labels = _inputs(2, 12)
    logits = model(ids)
    assert logits.shape == (2, 12, CFG.vocab_size)
    loss = model.loss(ids, labels)
    assert torch.equal(loss, lm_loss(logits, labels))
    # Small init: the untrained model is close to uniform over the vocabulary.
    assert abs(loss.item() - math.log(CFG.vocab_size)) < 0.2
    # Causal: changing a later token leaves earlier logits untouched.
    ids2 = ids.clone()
    ids2[:, 8] = (ids2[:, 8] + 1) % CFG.vocab_size
    logits2 = model(ids2)
    assert torch.equal(logits[:, :8], logits2[:, :8])
    assert not torch.equal(logits[:, 8:], logits2[:, 8:])


def test_bfloat16_forward_is_finite() -> None:
    model = Qwen3(CFG, seed=0, dtype=torch.bfloat16)
    ids, labels = _inputs()
    assert model(ids).dtype == torch.bfloat16
    assert torch.isfinite(model.loss(ids, labels))


def test_check_tp_rejects_split_heads() -> None:
    check_tp(CFG, 2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_tp(CFG, 4)  # 2 KV heads cannot be spread over 4 ranks with whole heads
    with pytest.raises(ValueError):
        check_tp(CFG, 0)


def test_megatron_shard_without_group_declares_split_dims() -> None:
    model = Qwen3(CFG, seed=1)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    tp_dims = shard_megatron(model, 1, 2, forward=False)
    assert tp_dims == hf_tp_dims(CFG)
    assert specs_from_module(model, tp_dims=tp_dims, tp=2) == specs_from_config(CFG, tp=2, layout="hf")
    for n, p in model.named_parameters():
        if n in tp_dims:
            assert torch.equal(p, full[n].chunk(2, dim=tp_dims[n])[1]), n
        else:
            assert torch.equal(p, full[n]), n


def test_megatron_shard_rejects_bad_rank() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        shard_megatron(Qwen3(CFG), 2, 2, forward=False)


# --------------------------------------------------------------------------- data


def test_data_is_deterministic_and_sliced_by_dp_rank() -> None:
    ids, labels = batch(5, 0, 1, 4, 10, seed=7)
    assert ids.shape == labels.shape == (4, 10) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])  # labels are the next tokens
    again, _ = batch(5, 0, 1, 4, 10, seed=7)
    assert torch.equal(ids, again)
    # dp=2 ranks get the two halves of the same global batch.
    r0, l0 = batch(5, 0, 2, 4, 10, seed=7)
    r1, l1 = batch(5, 1, 2, 4, 10, seed=7)
    assert torch.equal(torch.cat([r0, r1]), ids) and torch.equal(torch.cat([l0, l1]), labels)
    assert not torch.equal(batch(6, 0, 1, 4, 10, seed=7)[0], ids)
    assert not torch.equal(batch(5, 0, 1, 4, 10, seed=8)[0], ids)
    assert int(ids.max()) < 256 and int(ids.min()) >= 0


def test_data_is_learnable() -> None:
    chain = MarkovData(256, seed=0)
    # The entropy rate is well below a uniform guess, so the loss has room to fall.
    assert 0.5 < chain.entropy() < math.log(256) - 2.0


@pytest.mark.parametrize(
    "args, match",
    [((0, 0, 2, 3, 8, 0), "multiple of dp"), ((0, 2, 2, 4, 8, 0), "dp_rank"), ((-1, 0, 1, 4, 8, 0), "step"), ((0, 0, 1, 4, 0, 0), "seq_len")],
)
def test_data_rejects_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        batch(*args)


# --------------------------------------------------------------------------- tensor parallel


def _reference(seed: int, cfg=CFG) -> tuple[float, dict[str, torch.Tensor]]:
    model = Qwen3(cfg, seed=seed)
    ids, labels = _inputs()
    loss = model.loss(ids, labels)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _full_grad(g: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(g, DTensor):
        return g.full_tensor()
    if dim is None:
        return g
    import torch.distributed as dist

    parts = [torch.empty_like(g) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, g.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _tp_run(mesh, mode: str) -> dict:
    tp_mesh = mesh["tp"]
    cfg = TIED if mode.endswith("tied") else CFG
    model = Qwen3(cfg, seed=11)
    if mode.startswith("dtensor"):
        parallelize(model, tp_mesh)
        tp_dims: dict[str, int] = {}
        specs = specs_from_module(model, tp=tp_mesh.size())
    else:
        tp_dims = shard_megatron(model, tp_mesh.get_local_rank(), tp_mesh.size(), group=tp_mesh.get_group())
        specs = specs_from_module(model, tp_dims=tp_dims, tp=tp_mesh.size())
    ids, labels = _inputs()
    loss = model.loss(ids, labels)
    loss.backward()
    grads = {n: _full_grad(p.grad, tp_dims.get(n), tp_mesh.get_group()) for n, p in model.named_parameters()}
    # numpy, not tensors: torch's queue shares tensor storage by file descriptor, which breaks
    # when the worker exits before the parent reads the result.
    return {"loss": loss.item(), "grads": {n: g.numpy() for n, g in grads.items()}, "specs": specs}


def _tp_worker(rank: int, world: int, modes: tuple[str, ...]) -> dict[str, dict]:
    from torch.distributed.device_mesh import init_device_mesh

    if world == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return {mode: _tp_run(mesh, mode) for mode in modes}


@pytest.mark.slow
@pytest.mark.parametrize("world, modes", [(2, ("dtensor", "megatron", "dtensor-tied", "megatron-tied")), (4, ("dtensor",))])
def test_tp_forward_and_grads_match_unsharded(world: int, modes: tuple[str, ...]) -> None:
    results = run_workers(_tp_worker, world, modes, timeout_s=120)
    for mode in modes:
        cfg = TIED if mode.endswith("tied") else CFG
        ref_loss, ref_grads = _reference(11, cfg)
        out = [r[mode] for r in results]
        for r in out:
            r["grads"] = {n: torch.from_numpy(g) for n, g in r["grads"].items()}
        for r in out:
            assert r["specs"] == specs_from_config(cfg, tp=2, layout="hf"), mode
            assert r["loss"] == pytest.approx(ref_loss, rel=RTOL, abs=0), mode
            for n, g in r["grads"].items():
                torch.testing.assert_close(g, ref_grads[n], rtol=RTOL, atol=1e-7, msg=f"{mode}: {n}")
        # Replicated parameters' gradients (norms, including the per-head q/k norms whose partial
        # sums are all-reduced by a hook) are bitwise identical on the TP ranks of one DP rank.
        for a, b in ((0, 1),) + (((2, 3),) if world == 4 else ()):
            for n, g in out[a]["grads"].items():
                if g.ndim == 1:
                    assert torch.equal(g, out[b]["grads"][n]), (mode, n)
