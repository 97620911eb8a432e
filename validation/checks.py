"""The two checks, run inside one spawned process group per mesh (``run_mesh`` is the worker).

Spawning a gloo group costs seconds, so every cell of one mesh runs in the same group, one after
the other, each with a fresh model and a fresh :class:`canzona.DistributedOptimizer`; each returns
a compact result dict to rank 0. The single-device reference runs on rank 0 (the other ranks wait
in the next collective).

**injected** (the exactness promise, Sections 3-4: a Canzona step computes exactly what the
single-device optimizer computes on the full tensors). Per step, per parameter and per DP rank the
gradient is an integer in [-8, 8] times 2**-6 (:func:`validation.harness.integer_grads`, drawn on
the *full* shape; TP ranks cut their shard from it), so any DP sum is exact in any order and the
mean over a power-of-two DP size is exact. The gradients enter through a real backward pass
(``(p * g).sum()``), so the ZeRO-1 buffer hooks fire as in training. After ``steps`` steps, with
``torch.equal``:

- every parameter on every rank (TP shards reassembled per DP replica) equals the reference's
  (cast to the model dtype for bf16 cells);
- every fp32 master in ``DistributedOptimizer.consolidated_state_dict()`` equals the reference optimizer's
  parameter (fp32 masters of the same initial values);
- every optimizer state entry, key by key, equals the reference optimizer's state for that
  parameter.

**training** (real forward/backward of the tiny Qwen3, DTensor TP via
:func:`canzona.models.parallelize`, Markov-chain data, ``canzona train``'s default learning
rates), judged against an independent single-process oracle (:func:`_teacher_forced`): per step
and tensor, the gradients after the TP backward (DP-averaged) within :data:`GRAD_RTOL` of the
single-process gradient at the same parameters, and the parameters after the step bitwise equal
to the single-device optimizer stepped with the run's own DP-mean gradients, at every DP size
(every strategy's DP reduction sums the ranks in rank order from zero on gloo, as the oracle
does); every replica of every parameter, master and optimizer state bitwise equal on every rank
holding it (:mod:`validation.replicas`); the loss within :data:`LOSS_RTOL` of the single-process
loss and, for each strategy, losses and final parameters bitwise equal to ``sc``'s (the same
operations in the same order).
"""

from __future__ import annotations

import copy
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.plan.strategies import get_strategy
from validation import faults
from canzona.runtime.buffer import local_tensor
from validation.harness import ReferenceRunner, inject_grads, integer_grads, mean_grads, pack, params_of, tp_cut, unpack
from canzona.train import DTYPES
from validation.compare import Comparator, Mismatch
from validation.matrix import Cell, parse_mesh, strategy_args
from validation.models import build_model

__all__ = [
    "OPTIMIZER_KWARGS",
    "ELEMENTWISE_KWARGS",
    "GRAD_EXPONENT",
    "LOSS_RTOL",
    "TRAIN_BATCH",
    "TRAIN_SEQ",
    "run_mesh",
    "optimizer_setup",
]

#: Hyperparameters per optimizer: weight decay on, momentum on, preconditioners refreshed every 2
#: steps (Shampoo, SOAP) so a few steps exercise every branch of the math.
OPTIMIZER_KWARGS: dict[str, dict[str, Any]] = {
    "muon": {"lr": 0.02, "weight_decay": 0.01, "momentum": 0.95, "nesterov": True},
    "shampoo": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.01, "precondition_frequency": 2},
    "soap": {"lr": 3e-3, "weight_decay": 0.01, "precondition_frequency": 2},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.01},
}
ELEMENTWISE_KWARGS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.01}
#: Injected gradients: integers in [-8, 8] times 2**GRAD_EXPONENT (exact in bf16 and fp32, sums exact).
GRAD_EXPONENT = -6
GRAD_SEED = 1234
#: Training check (``canzona.train.train`` with its default learning rates): global batch and
#: sequence length (the tiny Qwen3's vocabulary is 256).
TRAIN_BATCH = 8
TRAIN_SEQ = 16
#: How the training check tensor-parallelizes the model (``canzona.train`` tp_style): ``dtensor``
#: (canzona.models.parallelize) or ``megatron`` (plain shards, canzona.models.shard_megatron).
TRAIN_TP = "dtensor"
#: the training check's reference run on each mesh: every other cell's losses are compared with its
#: losses, and its own cell with a single process
BASELINE = "sc"
#: Relative tolerance where bitwise equality is not expected (see the module docstring for when):
#: |loss - reference| <= LOSS_RTOL[dtype][optimizer] * max |reference loss|.
#: Why these values. The trajectories then differ only because sums are associated differently:
#: a few fp32 ulps (relative ~1e-7) per gradient element. How far that travels depends on the
#: optimizer and the parameter dtype (measured over 5 steps of ``canzona train``'s default learning
#: rates on every mesh of ``--full``; the runs are deterministic, so each bound's margin absorbs
#: changes of the optimizer code, not run-to-run noise):
#: - fp32, Muon / AdamW / Shampoo: Newton-Schulz, element-wise Adam and Shampoo's grafted inverse
#:   roots keep it small: at most 1.0e-4 relative (Muon); bound 5e-4 (5x).
#: - fp32, SOAP: eigenbases of nearly degenerate preconditioners rotate by (perturbation /
#:   eigenvalue gap) and Adam-style normalisation in that basis turns a rounding-sized change of a
#:   tiny entry into an O(lr) change of its update: up to 8.9e-4; bound 5e-3 (5.6x).
#: - bf16 parameters (fp32 masters): a one-ulp master difference can flip the bf16 rounding of a
#:   parameter, a 2**-8 relative change; the loss moved by at most 8.5e-4 relative (AdamW); bound
#:   2**-8 ~ 3.9e-3 (one bf16 ulp of the loss scale, 4.6x).
#: A defect in the step itself is caught bit for bit by the injected check; this check guards the
#: training path (hooks, buckets, TP forward) and reports the measured maximum next to the bound.
LOSS_RTOL: dict[str, dict[str, float]] = {
    "float32": {"muon": 5e-4, "adamw": 5e-4, "shampoo": 5e-4, "soap": 5e-3},
    "bfloat16": {"muon": 2.0**-8, "adamw": 2.0**-8, "shampoo": 2.0**-8, "soap": 2.0**-8},
}


def _elementwise_optimizer(name: str) -> bool:
    """Whether ``name`` is a registered element-wise optimizer (AdamW): it then runs on every
    parameter with one set of hyperparameters (a user's optimizer counts as a matrix one)."""
    from canzona.optimizers import get_optimizer, optimizer_names

    return name in optimizer_names() and not get_optimizer(name).matrix


def optimizer_setup(optimizer: str, user_kwargs: Mapping[str, Any] | None = None) -> tuple[type[torch.optim.Optimizer], dict[str, Any], dict[str, Any]]:
    """(matrix optimizer class, its kwargs, element-wise AdamW kwargs) for a cell's optimizer: a
    built-in name (its :data:`OPTIMIZER_KWARGS`, updated by ``user_kwargs``) or an import path
    (``user_kwargs`` only)."""
    from validation.targets import BUILTIN_OPTIMIZERS, resolve_optimizer_class

    cls = resolve_optimizer_class(optimizer)
    kw = {**OPTIMIZER_KWARGS.get(optimizer, {}), **dict(user_kwargs or {})} if optimizer in BUILTIN_OPTIMIZERS else dict(user_kwargs or {})
    ew = dict(kw) if _elementwise_optimizer(optimizer) else dict(ELEMENTWISE_KWARGS)
    return cls, kw, ew


def _make_mesh(dp: int, tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if tp == 1:
        return init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _result(cell: Cell, cmp: Comparator | None, seconds: float, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "cell": cell.name,
        "check": cell.check,
        "model": cell.model,
        "optimizer": cell.optimizer,
        "strategy": cell.strategy,
        "mesh": cell.mesh,
        "dtype": cell.dtype,
        "steps": cell.steps,
        "seconds": round(seconds, 3),
    }
    if cmp is not None:
        out.update(
            passed=cmp.equal,
            max_abs_diff=cmp.reported_max(),
            first_mismatch=cmp.first.as_dict() if cmp.first is not None else None,
            mismatched_params=list(cmp.names()),
            compared=cmp.compared,
        )
    out.update(extra)
    return out


# ============================================================================ injected gradients


def _full_grads(shapes: Mapping[str, tuple[int, ...]], step: int, dp_rank: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return integer_grads(shapes, step=step, rank=dp_rank, seed=GRAD_SEED, exponent=GRAD_EXPONENT, dtype=dtype)


def _post_step_fault(model: nn.Module, fault: faults.Fault, tp_dims: Mapping[str, int], full_shape: tuple[int, ...], tp_rank: int, tp: int) -> None:
    """``post-step`` fault mode: one ulp added to the model's copy of element ``index`` (full flat
    index) of ``param`` on every rank holding it, after the optimizer step (a corrupted value return)."""
    p = local_tensor(dict(model.named_parameters())[fault.param].detach())
    idx = list(torch.unravel_index(torch.tensor(fault.index), full_shape))
    d = tp_dims.get(fault.param)
    if d is not None and tp > 1:
        width = full_shape[d] // tp
        owner, idx[d] = divmod(int(idx[d]), width)
        if owner != tp_rank:
            return
    with torch.no_grad():
        x = p[tuple(int(i) for i in idx)]
        p[tuple(int(i) for i in idx)] = torch.nextafter(x, torch.full_like(x, float("inf")))


def _injected_cell(cell: Cell, ctx: _Ctx, fault: Any, opts: Mapping[str, Any]) -> dict[str, Any] | None:
    """One injected cell on every rank of the mesh: run it distributed, gather every rank's copies
    on rank 0 and judge them there against the single-device reference (None on other ranks)."""
    from validation.replicas import compare_replicas, local_params, local_replicas

    rank, dp_rank, tp_rank, dp, tp, mesh = ctx.rank, ctx.dp_rank, ctx.tp_rank, ctx.dp, ctx.tp, ctx.mesh
    t0 = time.perf_counter()
    dtype = DTYPES[cell.dtype]
    model, full, tp_dims, bucket_numel = build_model(cell.model, dtype, tp_rank=tp_rank, tp=tp, model_kwargs=opts.get("model_kwargs"))
    shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    cls, kw, ew = optimizer_setup(cell.optimizer, opts.get("optimizer_kwargs"))
    mode, f = fault if fault is not None else (None, None)
    defect = None
    if mode == "defect":
        from validation.defects import DEFECTS

        defect = DEFECTS[f]()
    planted = faults.FaultHook(f) if mode == "runtime" else None
    handle = None
    try:
        dopt = _distributed_optimizer(model, cell, mesh, cls, kw, ew, tp_dims, bucket_numel)
        if planted is not None:
            handle = dopt.register_update_hook(planted)
        _injected_steps(dopt, model, cell, ctx, shapes, tp_dims, dtype, fault, defect)
        fired = int(planted is not None and planted.fired) or int(bool(getattr(defect, "fired", False)))
    finally:
        if handle is not None:
            handle.remove()
    sd = dopt.consolidated_state_dict()
    local = params_of(model)
    copies = {**local_params(model, tp_dims, tp_rank), **local_replicas(dopt, tp_rank)}
    shares: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(pack({"local": local, "copies": copies, "fired": fired, "dp_rank": dp_rank, "tp_rank": tp_rank}), shares, dst=0)
    dopt.runtime.detach()
    if rank != 0:
        return None
    assert shares is not None
    got = [unpack(s) for s in shares]

    # ---- reference: the single-device optimizer on full tensors with the DP-mean gradients
    stacks = expert_stacks(full)
    runner = ReferenceRunner(
        full, cls, kw, torch.optim.AdamW, ew, all_elementwise=dopt.plan.strategy.elementwise_only, master_dtype=torch.float32,
        kinds={n: "experts" for n in stacks},
    )
    for step in range(1, cell.steps + 1):
        runner.step(mean_grads([_full_grads(shapes, step, d, dtype) for d in range(dp)]))
    cmp = Comparator(experts=stacks)
    _compare_injected(cmp, runner, sd, got, shapes, tp_dims, dp, tp)
    # every copy of a parameter, master and optimizer state on every rank (not just the one the
    # consolidated state_dict reads) must hold the same bits
    shared = compare_replicas([g["copies"] for g in got], cmp)
    extra: dict[str, Any] = {"replicas_checked": shared}
    if mode is not None:
        extra["fault"] = _fault_record(mode, f, got)
    r = _result(cell, cmp, time.perf_counter() - t0, bitwise_expected=True, bitwise=cmp.equal, reason="", **extra)
    if mode == "defect" and hasattr(defect, "fired") and not extra["fault"]["fired"]:
        r["passed"] = False
        r["error"] = f"planted defect {f} never fired: no rank held what it needs (see validation.defects)"
    if mode == "runtime" and not extra["fault"]["fired"]:
        # A defect that could not be planted proves nothing: fail loudly instead of passing.
        r["passed"] = False
        r["error"] = (
            f"planted {f.kind} fault on {f.param} (step {f.step}) never fired: the runtime's update hooks "
            "did not see that parameter updated whole that often on any rank"
        )
    return r


def expert_stacks(model: nn.Module) -> dict[str, int]:
    """Name -> expert count of every ``(E, M, N)`` expert stack of ``model`` under its roles (the
    default rule plus the model's ``canzona_roles``): the reference steps each expert alone, and a
    mismatch in one names its expert."""
    from canzona.specs import module_roles

    if not any(p.dim() == 3 for p in model.parameters()):
        return {}
    shapes = dict(model.named_parameters())
    roles = module_roles(model, getattr(model, "canzona_roles", None))
    return {n: int(shapes[n].shape[0]) for n, (role, _) in roles.items() if role == "experts"}


def _distributed_optimizer(model: nn.Module, cell: Cell, mesh: Any, cls: type, kw: Mapping[str, Any], ew: Mapping[str, Any],
                           tp_dims: Mapping[str, int], bucket_numel: int | None) -> Any:
    """The cell's ``DistributedOptimizer``: its strategy and TP schedule, AdamW on element-wise
    parameters, fp32 masters."""
    from canzona.distributed import DistributedOptimizer

    strategy, schedule = strategy_args(cell.strategy)
    return DistributedOptimizer(
        model,
        cls,
        strategy=strategy,
        mesh=mesh,
        optimizer_kwargs=kw,
        elementwise_optimizer=torch.optim.AdamW,
        elementwise_kwargs=ew,
        tp_schedule=schedule,
        tp_dims=tp_dims or None,
        bucket_numel=bucket_numel,
        master_dtype=torch.float32,
        roles=getattr(model, "canzona_roles", None),
    )


def _injected_steps(dopt: Any, model: nn.Module, cell: Cell, ctx: _Ctx, shapes: Mapping[str, tuple[int, ...]],
                    tp_dims: Mapping[str, int], dtype: torch.dtype, fault: Any, defect: Any) -> None:
    """The cell's steps on this rank: integer gradients through a real backward, the optimizer
    step, and the planted defect or ``post-step`` fault at its step."""
    mode, f = fault if fault is not None else (None, None)
    for step in range(1, cell.steps + 1):
        g_full = _full_grads(shapes, step, ctx.dp_rank, dtype)
        inject_grads(model, tp_cut(g_full, tp_dims, ctx.tp_rank, ctx.tp))
        if defect is not None:
            defect.before_step(step, dopt, ctx.dp_rank)
        dopt.step()
        if defect is not None:
            defect.after_step(step, cell.steps, dopt, ctx.dp_rank)
        dopt.zero_grad()
        if mode == "post-step" and step == f.step:
            _post_step_fault(model, f, tp_dims, shapes[f.param], ctx.tp_rank, ctx.tp)


def _compare_injected(cmp: Comparator, runner: ReferenceRunner, sd: Mapping[str, Any], got: Sequence[Mapping[str, Any]],
                      shapes: Mapping[str, tuple[int, ...]], tp_dims: Mapping[str, int], dp: int, tp: int) -> None:
    """Compare, per parameter, the model's value on every DP replica (TP shards concatenated; a
    replicated parameter on every TP rank too), the consolidated fp32 master and the optimizer
    state with the reference ``runner``'s, bit for bit, into ``cmp``."""
    ref_params = runner.params()
    ref_masters = runner.master_values()
    ref_state = runner.states()
    for name in shapes:
        # the model's value on every DP replica (its TP shards concatenated)
        td = tp_dims.get(name)
        for d in range(dp):
            shards = [g["local"][name] for g in sorted((g for g in got if g["dp_rank"] == d), key=lambda g: g["tp_rank"])]
            value = torch.cat(shards, dim=td) if td is not None and tp > 1 else shards[0]
            cmp.tensors(name, "value" if d == 0 else f"value@dp{d}", ref_params[name], value)
            if td is None:
                # a replicated parameter must hold the same bits on every TP rank too
                for t in range(1, len(shards)):
                    cmp.tensors(name, f"value@dp{d}tp{t}", ref_params[name], shards[t])
        if name not in sd.get("params", {}):
            cmp.missing(name, "master", "present", "missing from state_dict")
        else:
            cmp.tensors(name, "master", ref_masters[name], sd["params"][name])
        cmp.states(name, ref_state.get(name, {}), sd.get("state", {}).get(name, {}))


def _fault_record(mode: str, f: Any, got: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report's ``fault`` entry of a cell with a planted fault: what was planted and, for a
    ``runtime`` fault, whether its hook fired on any rank (a named defect always runs)."""
    if mode == "defect":
        from validation.defects import DEFECTS

        tracked = hasattr(DEFECTS[f](), "fired")  # a defect that can fail to plant says whether it fired
        return {"mode": mode, "kind": f, "fired": bool(sum(g["fired"] for g in got)) if tracked else True}
    out = {"mode": mode, "kind": f.kind, "param": f.param, "step": f.step, "index": f.index}
    if mode == "runtime":
        out["fired"] = bool(sum(g["fired"] for g in got))
    return out


# ============================================================================ real training

#: The training gate's independent oracle (:func:`_teacher_forced`), per tensor and step.
#:
#: Gradients: the DP mean of the gradients the TP backward produced must satisfy
#: ``max |g - g1| <= GRAD_RTOL[dtype] * max |g1|``, g1 the single-process gradient on the global
#: batch at the same parameters. Not bitwise, because the distributed run computes the same real
#: numbers in another order (per-rank sums over 1/dp of the tokens, then the DP mean; row-parallel
#: matmuls summing per-TP-rank partial products). Derivation: a sum of n terms in any order errs by
#: at most (n - 1) * u * sum |terms| (u = 2**-24 in fp32); the tiny Qwen3's reductions are at most
#: a few hundred terms (128 tokens, ffn 176) chained through 2 layers, so the difference stays
#: within ~1e-5 of the tensor's scale unless terms cancel badly. Measured over 5 steps on dp2xtp2
#: and dp4, Muon/SOAP/Shampoo/AdamW: at most 8.2e-7 in fp32; in bf16 (u = 2**-8, every
#: activation rounded) 1.95e-2. A missing reduction is an error of the order of the tensor itself
#: (a TP rank keeping its partial q/k-norm gradient, its heads only, is off by the other ranks'
#: share: about half). Bounds: fp32 1e-3 (>1000x the measured rounding, 500x under a 50 % error),
#: bf16 0.1 (5x both ways).
#:
#: Parameters after each step: the single-device optimizer stepped with the run's own DP-mean
#: gradients, summed over the DP ranks in rank order from zero. The runtime sums in that order
#: too at every DP size on gloo (reduce-scatter strategies through
#: ``Comm.reduce_scatter_v``, all-reduce ones through ``Comm.all_reduce_in_rank_order``; with 2
#: ranks any order is exact), so the parameters must be *bitwise* equal. (Before the all-reduce
#: strategies summed in rank order, gloo's ring order made dp4 differ by an ulp per element,
#: which the optimizers amplified along their trajectory: Muon 1.2e-2 and SOAP 0.96 of the
#: step's update after 5 steps; dp4 was bounded then.)
GRAD_RTOL: dict[str, float] = {"float32": 1e-3, "bfloat16": 1e-1}


def _train_lr(optimizer: str) -> float | None:
    """The matrix learning rate for the training check: ``canzona train``'s default, except AdamW,
    which gets the element-wise rate. ``zero1`` runs the element-wise optimizer (with the
    element-wise hyperparameters) on every parameter, so with train's default AdamW rates (3e-3
    matrices, 1e-2 element-wise) a zero1 run would be a different run from sc (measured: loss off
    by 0.098 after one step), a hyperparameter policy question rather than an exactness one; one
    rate for all parameters makes every strategy's AdamW the same optimizer."""
    from canzona.train import DEFAULT_ELEMENTWISE_LR

    return DEFAULT_ELEMENTWISE_LR if _elementwise_optimizer(optimizer) else None


def _train_setup(optimizer: str, user_kwargs: Mapping[str, Any] | None) -> tuple[type[torch.optim.Optimizer], dict[str, Any], dict[str, Any]]:
    """(matrix class, its kwargs, element-wise kwargs) of the training check: ``canzona train``'s
    default learning rates for built-in optimizers, the user's kwargs for their own."""
    from canzona.train import DEFAULT_ELEMENTWISE_LR, DEFAULT_LR
    from validation.targets import BUILTIN_OPTIMIZERS, resolve_optimizer_class

    cls = resolve_optimizer_class(optimizer)
    if optimizer in BUILTIN_OPTIMIZERS:
        kw = {"lr": _train_lr(optimizer) or DEFAULT_LR[optimizer], **dict(user_kwargs or {})}
    else:
        kw = dict(user_kwargs or {})
    return cls, kw, {"lr": DEFAULT_ELEMENTWISE_LR}


def _dtensor_dims(model: nn.Module) -> dict[str, int]:
    """Split dim of every DTensor parameter sharded over TP (from its placements)."""
    out: dict[str, int] = {}
    for n, p in model.named_parameters():
        for pl in getattr(p, "placements", None) or ():
            d = getattr(pl, "dim", None)
            if d is not None:
                out[n] = int(d)
    return out


def _train_run(
    ctx: _Ctx, optimizer: str, okw: Mapping[str, Any] | None, strategy_name: str, dtype_name: str, steps: int, defect: Any
) -> dict[str, Any] | None:
    """One distributed training run; rank 0 gets every rank's per-step gradients (TP-local, after
    the TP backward, before DP reduction), parameters after each step, losses and state replicas."""
    from canzona.config import load_model_config
    from canzona.distributed import DistributedOptimizer
    from canzona.models import Qwen3, batch, parallelize
    from validation.replicas import local_params, local_replicas

    cls, kw, ew = _train_setup(optimizer, okw)
    strategy, schedule = strategy_args(strategy_name)
    cfg = load_model_config("qwen3-tiny")
    undo = defect.setup() if defect is not None else None
    handles = []
    dopt = None
    try:
        model = Qwen3(cfg, seed=0, dtype=DTYPES[dtype_name])
        if ctx.tp > 1:
            parallelize(model, ctx.mesh["tp"])
        dims = _dtensor_dims(model)
        grads_now: dict[str, torch.Tensor] = {}

        def capture(name: str, p: torch.Tensor) -> Any:
            placements = getattr(p, "placements", None)

            def hook(g: torch.Tensor) -> None:
                g = g.detach()
                if placements is not None and tuple(getattr(g, "placements", placements)) != tuple(placements):
                    # DTensor autograd may leave a gradient Partial or Replicate (the vocab-parallel
                    # embedding): bring it to the parameter's layout, as the optimizer's hook does
                    g = g.redistribute(p.device_mesh, placements)
                grads_now[name] = local_tensor(g).to("cpu", copy=True)

            return hook

        # registered after parallelize (so after its q/k-norm all-reduce hooks) and before the
        # optimizer's post-accumulate hooks: this sees the gradient the TP backward produced
        handles = [p.register_hook(capture(n, p)) for n, p in model.named_parameters()]
        dopt = DistributedOptimizer(
            model,
            cls,
            strategy=strategy,
            mesh=ctx.mesh,
            optimizer_kwargs=kw,
            elementwise_optimizer=torch.optim.AdamW,
            elementwise_kwargs={"lr": kw["lr"]} if _elementwise_optimizer(optimizer) else ew,
            tp_schedule=schedule,
            master_dtype=torch.float32,
        )
        grads, params, losses = [], [], []
        for step in range(steps):
            ids, labels = batch(step, ctx.dp_rank, ctx.dp, TRAIN_BATCH, TRAIN_SEQ, 0, vocab=cfg.vocab_size)
            loss = model.loss(ids, labels)
            loss.backward()
            grads.append(dict(grads_now))
            grads_now.clear()
            if defect is not None:
                defect.before_step(step + 1, dopt, ctx.dp_rank)
            dopt.step()
            if defect is not None:
                defect.after_step(step + 1, steps, dopt, ctx.dp_rank)
            dopt.zero_grad()
            params.append(local_params(model, dims, ctx.tp_rank))
            report = loss.detach().float().reshape(1).clone()
            if ctx.dp > 1:
                dist.all_reduce(report, group=ctx.dp_group)
                report /= ctx.dp
            losses.append(float(report.item()))
        mine = {"dp_rank": ctx.dp_rank, "tp_rank": ctx.tp_rank, "grads": grads, "params": params, "losses": losses, "replicas": local_replicas(dopt, ctx.tp_rank), "dims": dims}
    finally:
        for h in handles:
            h.remove()
        if undo is not None:
            undo()
        if dopt is not None:
            dopt.runtime.detach()
    shares: list[Any] | None = [None] * ctx.world if ctx.rank == 0 else None
    dist.gather_object(pack(mine), shares, dst=0)
    if ctx.rank != 0:
        return None
    assert shares is not None
    return {"ranks": [unpack(s) for s in shares]}


def _teacher_forced(optimizer: str, okw: Mapping[str, Any] | None, dtype_name: str, run: Mapping[str, Any], all_elementwise: bool) -> dict[str, Any]:
    """The independent oracle for one distributed run, on rank 0, with one process:

    - per step, the single-process model's loss and gradients on the *global* batch at the
      parameters the distributed model had before that step (DP replica 0, TP shards joined):
      what the TP forward/backward and the DP mean must reproduce up to reassociation;
    - the single-device optimizer stepped with the distributed run's own DP-mean gradients
      (summed over DP replicas in rank order, in fp32, then divided by the DP size, as the runtime
      does): what every parameter must equal after each step, bit for bit wherever that sum is
      exact in any order (at most 2 DP ranks).

    Forcing each comparison onto the distributed run's own inputs keeps rounding from compounding
    over steps (a free-running reference drifts: Newton-Schulz amplifies tiny singular directions,
    Adam's first steps turn a rounding-sized gradient into a sign), so the bounds stay tight.
    """
    from canzona.config import load_model_config
    from canzona.models import Qwen3, batch

    cls, kw, ew = _train_setup(optimizer, okw)
    cfg = load_model_config("qwen3-tiny")
    model = Qwen3(cfg, seed=0, dtype=DTYPES[dtype_name])
    ranks = run["ranks"]
    dims = ranks[0]["dims"]
    dp = 1 + max(r["dp_rank"] for r in ranks)
    names = [n for n, _ in model.named_parameters()]
    runner = ReferenceRunner(
        model, cls, kw, torch.optim.AdamW, {"lr": kw["lr"]} if _elementwise_optimizer(optimizer) else ew, all_elementwise=all_elementwise, master_dtype=torch.float32
    )
    probe = copy.deepcopy(model)
    initial = params_of(model)
    steps = len(ranks[0]["losses"])
    losses, grads, mean_g, params = [], [], [], []
    for step in range(steps):
        if step:
            with torch.no_grad():
                for n, p in probe.named_parameters():
                    p.copy_(_replica_value(ranks, 0, step - 1, n, dims.get(n)))
        ids, labels = batch(step, 0, 1, TRAIN_BATCH, TRAIN_SEQ, 0, vocab=cfg.vocab_size)
        loss = probe.loss(ids, labels)
        loss.backward()
        grads.append({n: p.grad.detach().clone() for n, p in probe.named_parameters()})
        probe.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().float()))
        per_dp = [{n: _assemble(ranks, d, "grads", step, n, dims.get(n)) for n in names} for d in range(dp)]
        g = mean_grads(per_dp, dtype=torch.float32)
        mean_g.append(g)
        runner.step(g)
        params.append(runner.params())
    return {"losses": torch.tensor(losses, dtype=torch.float64), "grads": grads, "mean_grads": mean_g, "params": params, "initial": initial}


def _replica_value(ranks: Sequence[Mapping[str, Any]], dp_rank: int, step: int, name: str, dim: int | None) -> torch.Tensor:
    """DP replica ``dp_rank``'s full value of ``name`` after step ``step`` (TP shards joined)."""
    mine = sorted((r for r in ranks if r["dp_rank"] == dp_rank), key=lambda r: r["tp_rank"])
    key = f"param:{name}"
    got = [r["params"][step][key if key in r["params"][step] else f"{key}@tp{r['tp_rank']}"] for r in mine]
    return torch.cat(got, dim=dim) if dim is not None and len(got) > 1 else got[0]


def _assemble(ranks: Sequence[Mapping[str, Any]], dp_rank: int, field: str, step: int, name: str, dim: int | None) -> torch.Tensor:
    """The full tensor of DP replica ``dp_rank``: its TP ranks' local tensors concatenated."""
    shards = [r[field][step][name] for r in sorted((r for r in ranks if r["dp_rank"] == dp_rank), key=lambda r: r["tp_rank"])]
    return torch.cat(shards, dim=dim) if dim is not None and len(shards) > 1 else shards[0]


class _Bounded:
    """Per-tensor bounded comparisons: keeps the worst ratio |diff| / bound and the violations."""

    def __init__(self) -> None:
        self.worst: dict[str, Any] | None = None
        self.failures: list[Mismatch] = []
        self.compared = 0
        self.max_abs = 0.0
        #: largest |diff| / scale per kind (gradient, value): the measured figure next to its rtol
        self.measured: dict[str, float] = {}

    def check(self, name: str, what: str, expected: torch.Tensor, got: torch.Tensor, rtol: float, scale: float, kind: str) -> None:
        """max |expected - got| <= rtol * scale."""
        bound = rtol * scale
        self.compared += 1
        e, g = expected.detach().to(torch.float64).reshape(-1), got.detach().to(torch.float64).reshape(-1)
        if e.shape != g.shape:
            self.failures.append(Mismatch(name, what, None, f"numel {e.numel()}", f"numel {g.numel()}"))
            return
        diff = (e - g).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
        if diff.numel() == 0:
            return
        i = int(torch.argmax(diff))
        d = float(diff[i])
        self.max_abs = max(self.max_abs, d)
        rel = d / scale if scale > 0 else (0.0 if d == 0 else float("inf"))
        self.measured[kind] = max(self.measured.get(kind, 0.0), rel)
        ratio = d / bound if bound > 0 else (0.0 if d == 0 else float("inf"))
        if self.worst is None or ratio > self.worst["ratio"]:
            self.worst = {"param": name, "what": what, "index": i, "diff": d, "bound": bound, "ratio": ratio}
        if not d <= bound:
            self.failures.append(Mismatch(name, what, i, float(e[i]), float(g[i])))


def _oracle_checks(run: Mapping[str, Any], ref: Mapping[str, Any], dtype_name: str, bounded: _Bounded, cmp: Comparator) -> None:
    """Against :func:`_teacher_forced`'s oracle, per tensor and step: the gradients (DP mean of the
    TP-joined per-rank gradients) within GRAD_RTOL x max |single-process gradient|; the parameters
    of DP replica 0 after the step bitwise equal to the single-device optimizer's."""
    ranks = run["ranks"]
    dims = ranks[0]["dims"]
    g_rtol = GRAD_RTOL[dtype_name]
    for step in range(len(ref["grads"])):
        for name, g_ref in ref["grads"][step].items():
            g_mean = ref["mean_grads"][step][name]
            scale = float(g_ref.abs().max()) if g_ref.numel() else 0.0
            bounded.check(name, f"grad@step{step + 1}", g_ref, g_mean, g_rtol, scale, "grad")
        for name, p_ref in ref["params"][step].items():
            value = _replica_value(ranks, 0, step, name, dims.get(name))
            cmp.tensors(name, f"value@step{step + 1}", p_ref, value)


def _replica_checks(run: Mapping[str, Any], cmp: Comparator) -> int:
    from validation.replicas import compare_replicas

    ranks = run["ranks"]
    shared = 0
    for step in range(len(ranks[0]["params"])):
        shared += compare_replicas([r["params"][step] for r in ranks], cmp, label=f"@step{step + 1}")
    shared += compare_replicas([r["replicas"] for r in ranks], cmp)
    return shared


def _loss_comparison(expected: torch.Tensor, got: torch.Tensor, bitwise: bool, rtol: float) -> tuple[bool, float, Mismatch | None, float]:
    """(passed, max |diff|, first differing step, bound used)."""
    diff = (expected - got).abs()
    finite = bool(torch.isfinite(got).all() and torch.isfinite(expected).all())
    mx = float(diff.max()) if finite else float("inf")
    bound = 0.0 if bitwise else rtol * float(expected.abs().max())
    first = None
    neq = torch.nonzero(expected != got)
    if neq.numel():
        i = int(neq[0, 0])
        first = Mismatch("loss", "loss", i, float(expected[i]), float(got[i]))
    passed = finite and (torch.equal(expected, got) if bitwise else mx <= bound)
    return passed, mx, first, bound


def _final_params(run: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Every rank's final parameters, keyed ``rank<r>/<param key>`` (for the bitwise comparison with sc)."""
    return {f"rank{i}/{k}": v for i, r in enumerate(run["ranks"]) for k, v in r["params"][-1].items()}


def _training_cells(cells: Sequence[Cell], ctx: _Ctx, opts: Mapping[str, Any], defects: Mapping[str, Any], emit: Any) -> list[dict[str, Any]]:
    """Run the training cells of one mesh, ``sc`` first per (optimizer, dtype) as the baseline.

    Each cell is judged three ways (a gate that one shared mistake cannot fool): against the
    single-process model per tensor (gradients after the TP backward, parameters after every
    step, gradients within GRAD_RTOL, parameters bitwise: an independent oracle, since ``sc``
    shares the model's TP code with every other strategy); every replica on every rank bitwise
    equal (parameters after every step, masters and optimizer state after the last); and the loss
    trajectory and final parameters of each strategy bitwise equal to ``sc``'s.
    """
    out: list[dict[str, Any]] = []
    keys: list[tuple[str, str, int]] = []
    for c in cells:
        k = (c.optimizer, c.dtype, c.steps)
        if k not in keys:
            keys.append(k)
    okw = opts.get("optimizer_kwargs")
    for optimizer, dtype_name, steps in keys:
        group = [c for c in cells if (c.optimizer, c.dtype, c.steps) == (optimizer, dtype_name, steps)]
        base: dict[str, Any] | None = None
        order = sorted(group, key=lambda c: c.strategy != BASELINE)
        if not any(c.strategy == BASELINE for c in group):
            order = [Cell("training", "qwen3", optimizer, BASELINE, group[0].mesh, dtype_name, steps), *order]
        for cell in order:
            t1 = time.perf_counter()
            armed = defects.get(cell.name)
            try:
                run = _train_run(ctx, optimizer, okw, cell.strategy, dtype_name, steps, armed)
                r = None
                if ctx.rank == 0:
                    assert run is not None
                    ref = _teacher_forced(optimizer, okw, dtype_name, run, get_strategy(strategy_args(cell.strategy)[0]).elementwise_only)
                    r = _judge_training(cell, run, ref, base, time.perf_counter() - t1)
                    if armed is not None:
                        r["fault"] = {"mode": "defect", "kind": armed.name, "fired": True}
                    if cell.strategy == BASELINE and base is None:
                        base = {"losses": torch.tensor(run["ranks"][0]["losses"], dtype=torch.float64), "final": _final_params(run)}
            except Exception as exc:  # noqa: BLE001 - a failing cell is a result, not a crash
                r = _error(cell, exc, time.perf_counter() - t1)
                if cell.strategy == BASELINE:
                    base = None
            if cell in group and ctx.rank == 0 and r is not None:
                out.append(r)
                emit(r)
    return out


def _judge_training(cell: Cell, run: Mapping[str, Any], ref: Mapping[str, Any], base: Mapping[str, Any] | None, seconds: float) -> dict[str, Any]:
    losses = torch.tensor(run["ranks"][0]["losses"], dtype=torch.float64)
    bounded = _Bounded()
    cmp = Comparator()
    _oracle_checks(run, ref, cell.dtype, bounded, cmp)
    shared = _replica_checks(run, cmp)
    # loss trajectory vs one process (bounded) and, for non-sc strategies, vs sc
    rtol = LOSS_RTOL[cell.dtype].get(cell.optimizer, max(LOSS_RTOL[cell.dtype].values()))
    l_ok, l_mx, l_first, l_bound = _loss_comparison(ref["losses"], losses, False, rtol)
    bounded.compared += 1
    if l_bound > 0 and (bounded.worst is None or l_mx / l_bound > bounded.worst["ratio"]):
        bounded.worst = {"param": "loss", "what": "loss", "index": None, "diff": l_mx, "bound": l_bound, "ratio": l_mx / l_bound}
    if not l_ok and l_first is not None:
        bounded.failures.append(l_first)
    vs_sc: dict[str, Any] = {}
    sc_failure: Mismatch | None = None
    if cell.strategy != BASELINE:
        if base is None:
            raise RuntimeError("the sc baseline of this group failed, so this strategy cannot be compared with it")
        # the same operations in the same order (rank-order DP sums included): bitwise
        ok, mx, first, bound = _loss_comparison(base["losses"], losses, True, rtol)
        mine = _final_params(run)
        c2 = Comparator()
        for k in sorted(set(mine) | set(base["final"])):
            if k in mine and k in base["final"]:
                c2.tensors(k.split("/", 1)[1].split(":", 1)[1].split("@")[0], "value-vs-sc", base["final"][k], mine[k])
            else:
                c2.missing(k, "value-vs-sc", "present" if k in base["final"] else "absent", "present" if k in mine else "missing")
        if not c2.equal:
            ok = False
            first = first or c2.first
        if not ok:
            sc_failure = first or Mismatch("loss", "loss-vs-sc", None, None, None)
        vs_sc = {"vs_sc_bitwise_expected": True, "vs_sc_identical": bool(torch.equal(base["losses"], losses)) and c2.equal, "params_identical_to_sc": c2.equal}
    failures: list[Mismatch] = []
    if sc_failure is not None:
        failures.append(sc_failure)
    failures += cmp.mismatches + bounded.failures
    first = failures[0] if failures else None
    # the first replica mismatch is the clearest message when replicas disagree
    if cmp.first is not None:
        first = cmp.first
    r = _result(cell, None, seconds)
    worst = bounded.worst
    r.update(
        passed=not failures,
        max_abs_diff=bounded.max_abs if not failures else max(bounded.max_abs, cmp.max_abs_diff),
        first_mismatch=first.as_dict() if first is not None else None,
        mismatched_params=sorted({m.param for m in failures}),
        compared=bounded.compared + cmp.compared,
        bitwise_expected=False,
        bitwise=False,
        # bit-identical to the single-device optimizer on the run's own DP-mean gradients
        params_identical=not any(m.what.startswith("value@step") for m in cmp.mismatches),
        bound=worst["bound"] if worst else None,
        worst=worst,
        measured={k: float(f"{v:.3g}") for k, v in bounded.measured.items()},
        rtol={"grad": GRAD_RTOL[cell.dtype], "value": 0.0, "loss": rtol},
        replicas_checked=shared,
        reason=(
            "gradients vs one process at the same parameters within GRAD_RTOL x max|grad| (per-rank partial sums, the DP "
            "mean and TP row-parallel partial products reassociate the arithmetic); "
            + "parameters after every step bitwise equal to the single-device optimizer on the run's DP-mean gradients"
            + "; every replica on every rank bitwise"
            + ("; losses and final parameters bit-identical to sc" if vs_sc.get("vs_sc_bitwise_expected") else "")
        ),
        losses=[float(x) for x in losses],
        reference_losses=[float(x) for x in ref["losses"]],
        **vs_sc,
    )
    return r


# ============================================================================ the worker


class _Ctx:
    """This rank's place in the mesh (built once per worker)."""

    def __init__(self, rank: int, world: int, dp: int, tp: int) -> None:
        self.rank, self.world, self.dp, self.tp = rank, world, dp, tp
        self.dp_rank, self.tp_rank = divmod(rank, tp)
        self.mesh = _make_mesh(dp, tp)
        self.dp_group = self.mesh.get_group("dp") if tp > 1 else self.mesh.get_group()


def _error(cell: Cell, exc: BaseException, seconds: float) -> dict[str, Any]:
    r = _result(cell, None, seconds)
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    r.update(passed=False, max_abs_diff=None, first_mismatch=None, mismatched_params=[], error=text[:500], traceback=traceback.format_exc()[-2000:])
    return r


def run_mesh(
    rank: int,
    world: int,
    mesh_name: str,
    cells: Sequence[Cell],
    fault: Sequence[tuple[str, str, Any]] | None = None,
    options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]] | None:
    """Worker body (module level for spawn): every cell of one mesh; rank 0 returns the results.

    ``fault`` = [(cell name, mode, Fault or defect name), ...] plants a defect in each named cell: mode
    ``runtime`` registers a :class:`validation.faults.FaultHook` as an update hook on that
    cell's optimizer (the runtime perturbs an update or a state), ``post-step`` perturbs the model's parameter right after the optimizer step (ulp
    only), ``defect`` arms one of :data:`validation.defects.DEFECTS` (training cells).
    ``options``: ``optimizer_kwargs`` / ``model_kwargs`` for the user's optimizer and model,
    ``progress`` (a queue that receives each finished cell's result on rank 0).
    """
    opts = dict(options or {})
    queue = opts.get("progress")

    def emit(r: Mapping[str, Any]) -> None:
        if queue is not None:
            try:
                queue.put({k: r.get(k) for k in ("cell", "passed", "error", "seconds", "bitwise_expected", "bitwise")})
            except Exception:  # noqa: BLE001 - progress is best effort; the result still returns
                pass

    spec = parse_mesh(mesh_name)
    if spec.world != world:
        raise ValueError(f"mesh {mesh_name} needs {spec.world} processes, the group has {world}")
    ctx = _Ctx(rank, world, spec.dp, spec.tp)
    results: list[dict[str, Any]] = []
    for cell in cells:
        if cell.check != "injected":
            continue
        t0 = time.perf_counter()
        cell_fault = next(((f[1], f[2]) for f in fault or () if f[0] == cell.name), None)
        try:
            r = _injected_cell(cell, ctx, cell_fault, opts)
        except Exception as exc:  # noqa: BLE001 - recorded as a failed cell; construction errors raise on every rank
            r = _error(cell, exc, time.perf_counter() - t0)
        if rank == 0 and r is not None:
            results.append(r)
            emit(r)
    training = [c for c in cells if c.check == "training"]
    if training:
        from validation.defects import DEFECTS

        defects = {f[0]: DEFECTS[f[2]]() for f in fault or () if f[1] == "defect"}
        results.extend(r for r in _training_cells(training, ctx, opts, defects, emit) if rank == 0)
    return results if rank == 0 else None
