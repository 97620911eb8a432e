"""canzona.torchtitan with torchtitan 0.3.0 on CPU (gloo, world 2, one spawn).

What runs: torchtitan's debug llama3 model (``model_registry("debugmodel")``, 6 layers, dim 256,
vocabulary 2048) built on the meta device, parallelized by torchtitan's own ``parallelize_llama``
(its FSDP2 application over the ``fsdp`` mesh of ``ParallelDims(dp_shard=2)``), materialized and
initialized by its ``init_weights``. torchtitan's attention (FlexAttention) has no backward on CPU
and 0.3.0 refuses SDPA for language models, so no forward/backward runs: each step *injects* the
reduced gradients, integer-valued and the same on both sides, as FSDP2 DTensor gradients with the
parameters' placements. Then:

- the optimizer is built through ``CanzonaOptimizers.Config(...).build(model_parts=[model])`` and
  scheduled by torchtitan's ``LRSchedulersContainer`` (warm-up), with torchtitan's
  ``clip_grad_norm_`` over the DTensor gradients before each step, and compared bitwise (every
  parameter piece and the consolidated optimizer state) with ``canzona.DistributedOptimizer``
  used directly on a copy of the model with the same gradients, clipping and schedule;
- ``dcp.save({"optimizer": container, "model": ...})`` after two steps, ``dcp.load`` into a fresh
  model and container, one more step: bitwise equal to the uninterrupted run.

torchtitan's ``Trainer`` is not run: it needs a forward/backward through FlexAttention.
torchtitan 0.3.0 imports triton (for expert-parallel GPU kernels) when its models are imported;
where triton is absent (CPU-only torch) the worker stands in for that one kernel module with names
that raise if called (the dense model never calls them). torchtitan defaults its device to CUDA
when none is found; the worker sets it to CPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from canzona.runtime.launch import run_workers
from validation.harness import pack, unpack

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed (pip install 'canzona[torchtitan]')")

STEPS = 3
#: fp32 Newton-Schulz: what is checked here (the container against direct use, the resume) does not
#: depend on its dtype, and on a CPU without fast bf16 products (AVX2) bf16 made this spawn take a minute
MATRIX_KW = {"lr": 0.02, "weight_decay": 0.01, "ns_dtype": torch.float32}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}


def _cpu_torchtitan() -> None:
    """torchtitan on a CPU-only machine: its device type and, without triton, its EP kernels."""
    import sys
    import types

    if importlib.util.find_spec("triton") is None:
        name = "torchtitan.distributed.minimal_async_ep.kernels"

        def _kernel(k: str):
            def missing(*_a, **_k):
                raise RuntimeError(f"{k}: a triton kernel, unavailable in this test")
            return missing

        stand_in = types.ModuleType(name)
        stand_in.__getattr__ = lambda k: (_ for _ in ()).throw(AttributeError(k)) if k.startswith("__") else _kernel(k)  # type: ignore[method-assign]
        sys.modules.setdefault(name, stand_in)
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    parallel_dims.device_type = "cpu"


def _debug_model(parallel_dims, like=None):
    """torchtitan's debug llama3, parallelized by torchtitan (FSDP2 on its ``fsdp`` mesh); its
    values copied from ``like`` when given, else from torchtitan's init_weights (seed 0)."""
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(
        model, parallel_dims=parallel_dims, training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"), compile_config=CompileConfig(), ac_config=None,
        dump_folder="/tmp",
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        if like is None:
            torch.manual_seed(0)
            model.init_weights(buffer_device=None)
        else:
            for p, q in zip(model.parameters(), like.parameters()):
                p.to_local().copy_(q.to_local())
            for b, c in zip(model.buffers(), like.buffers()):
                b.copy_(c)
    return model


def _inject(model, step: int) -> None:
    """Integer-valued gradients (the same full tensor on every rank), as this rank's DTensor piece."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    g = torch.Generator().manual_seed(1000 + step)
    for p in model.parameters():
        full = torch.randint(-3, 4, tuple(p.shape), generator=g).to(p.dtype)
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].contiguous()
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def _run(model, opt, sched, steps) -> list[float]:
    from torchtitan.distributed import utils as dist_utils

    norms = []
    for s in steps:
        _inject(model, s)
        norms.append(float(dist_utils.clip_grad_norm_(list(model.parameters()), max_norm=20.0, foreach=True)))
        opt.step()
        sched.step()
        opt.zero_grad()
    return norms


def _pieces(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().detach().clone() for n, p in model.named_parameters()}


def _doc(opt) -> dict:
    from canzona.runtime.checkpoint import consolidated_state_dict

    return consolidated_state_dict(opt)


def _worker(rank: int, world: int, ckpt_dir: str) -> bytes:
    _cpu_torchtitan()
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.distributed import ParallelDims

    import canzona
    from canzona.torchtitan import CanzonaOptimizers, model_mesh

    pd = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, world_size=world, spmd_backend="partial_dtensor")
    pd.build_mesh()
    sched_cfg = LRSchedulersContainer.Config(warmup_steps=2)
    cfg = CanzonaOptimizers.Config(name="muon", strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW)
    out: dict[str, object] = {}

    # the container, built as torchtitan's trainer builds its optimizer
    model = _debug_model(pd)
    start = _debug_model(pd, like=model)  # the initial values, for the direct run and the resume
    opts = cfg.build(model_parts=[model])
    scheds = sched_cfg.build(optimizers=opts, training_steps=6)
    out["mesh"] = list(opts.optimizer.mesh.mesh_dim_names)
    out["roles"] = dict(opts.optimizer.layout.roles)
    out["groups"] = [len(g["params"]) for g in opts.optimizer.param_groups]
    out["norms"] = _run(model, opts, scheds, range(2))
    dcp.save({"optimizer": opts, "model": model.state_dict()}, checkpoint_id=ckpt_dir)
    out["lr_at_save"] = [g["lr"] for g in opts.optimizer.param_groups]
    out["norms"] += _run(model, opts, scheds, range(2, STEPS))
    out["container"], out["container_doc"] = _pieces(model), _doc(opts.optimizer)
    out["lr"] = [g["lr"] for g in opts.optimizer.param_groups]

    # canzona's DistributedOptimizer directly, on a copy of the initial model
    direct = _debug_model(pd, like=start)
    opt = canzona.DistributedOptimizer(direct, "muon", strategy="lb-asc", mesh=model_mesh(direct), optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW)
    sched = sched_cfg.build(optimizers=[opt], training_steps=6)
    out["direct_norms"] = _run(direct, opt, sched, range(STEPS))
    out["direct"], out["direct_doc"] = _pieces(direct), _doc(opt)

    # resume: a fresh model and container, loaded from the step-2 checkpoint, one more step
    fresh = _debug_model(pd, like=start)
    opts2 = cfg.build(model_parts=[fresh])
    scheds2 = sched_cfg.build(optimizers=opts2, training_steps=6)
    dcp.load({"optimizer": opts2, "model": fresh.state_dict()}, checkpoint_id=ckpt_dir)
    scheds2.load_state_dict({"last_epoch": 2})
    out["resumed_steps"] = opts2.optimizer.steps
    out["resumed_lr"] = [g["lr"] for g in opts2.optimizer.param_groups]
    out["resume_norms"] = _run(fresh, opts2, scheds2, range(2, STEPS))
    out["resumed"], out["resumed_doc"] = _pieces(fresh), _doc(opts2.optimizer)

    # refusals, before any collective
    errors = {}
    for key, kwargs in {"pp": {"model_parts": [model, fresh]}}.items():
        try:
            cfg.build(**kwargs)
            errors[key] = None
        except ValueError as exc:
            errors[key] = str(exc)
    out["errors"] = errors
    return pack(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("titan") / "step2")
    return [unpack(b) for b in run_workers(_worker, 2, path, timeout_s=600)]


def _same(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _same_doc(a: dict, b: dict) -> list[str]:
    bad = _same(a["params"], b["params"])
    for name in sorted(set(a["state"]) | set(b["state"])):
        sa, sb = a["state"].get(name, {}), b["state"].get(name, {})
        for k in sorted(set(sa) | set(sb)):
            va, vb = sa.get(k), sb.get(k)
            if not (torch.equal(va, vb) if torch.is_tensor(va) and torch.is_tensor(vb) else va == vb):
                bad.append(f"{name}[{k}]")
    return bad


@pytest.mark.slow
def test_container_reads_torchtitans_mesh_and_builds_two_groups(runs) -> None:
    for r in runs:
        assert r["mesh"] == ["fsdp"] and r["roles"] == {"fsdp": "dp_shard"}
        assert r["groups"][0] > 0 and r["groups"][1] > 0  # matrices and element-wise parameters
        assert r["resumed_lr"] == r["lr_at_save"] and r["lr"] != r["lr_at_save"]  # the warm-up moved it
    assert "pipeline parallelism" in runs[0]["errors"]["pp"]


@pytest.mark.slow
def test_container_equals_distributed_optimizer_used_directly(runs) -> None:
    for r in runs:
        assert r["norms"] == r["direct_norms"] and all(n > 20.0 for n in r["norms"])  # clipping was active
        assert not _same(r["container"], r["direct"]), _same(r["container"], r["direct"])[:5]
        assert r["container"] != {}
    assert runs[0]["container_doc"]["state"], "nothing compared"
    assert not _same_doc(runs[0]["container_doc"], runs[0]["direct_doc"])


@pytest.mark.slow
def test_dcp_round_trip_resumes_bitwise(runs) -> None:
    for r in runs:
        assert r["resumed_steps"] == 2
        assert r["resume_norms"] == r["norms"][2:]
        bad = _same(r["resumed"], r["container"])
        assert not bad, f"resumed run differs from the uninterrupted one on {bad[:5]}"
    assert not _same_doc(runs[0]["resumed_doc"], runs[0]["container_doc"])


@pytest.mark.slow  # importing torchtitan takes seconds
def test_config_refusals_without_a_process_group() -> None:
    from canzona.torchtitan import CanzonaOptimizers, resolve_name

    cfg = CanzonaOptimizers.Config(param_groups=[object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="param_groups"):
        CanzonaOptimizers(cfg, model_parts=[torch.nn.Linear(2, 2)])
    assert resolve_name("torch.optim.AdamW") is torch.optim.AdamW and resolve_name("muon") == "muon"
    with pytest.raises(ValueError, match="not a torch.optim optimizer"):
        resolve_name("torch.optim.lr_scheduler")
