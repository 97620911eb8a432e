"""The two checks, run inside one spawned process group per mesh (``run_mesh`` is the worker).

Spawning a gloo group costs seconds, so every cell of one mesh runs in the same group, one after
the other, each with a fresh model and a fresh :class:`canzona.DistributedOptimizer`; each returns
a compact result dict to rank 0. The single-device reference runs on rank 0 (the other ranks wait
in the next collective).

**injected** (the exactness promise, Sections 3-4: a Canzona step computes exactly what the
single-device optimizer computes on the full tensors). Per step, per parameter and per DP rank the
gradient is an integer in [-8, 8] times 2**-6 (:func:`canzona.testing.integer_grads`, drawn on
the *full* shape; TP ranks cut their shard from it), so any DP sum is exact in any order and the
mean over a power-of-two DP size is exact. The gradients enter through a real backward pass
(``(p * g).sum()``), so the ZeRO-1 buffer hooks fire as in training. After ``steps`` steps, with
``torch.equal``:

- every parameter on every rank (TP shards reassembled per DP replica) equals the reference's
  (cast to the model dtype for bf16 cells);
- every fp32 master in ``DistributedOptimizer.state_dict()`` equals the reference optimizer's
  parameter (fp32 masters of the same initial values);
- every optimizer state entry, key by key, equals the reference optimizer's state for that
  parameter.

**training** (real forward/backward: :func:`canzona.train.train` on the tiny Qwen3 with its
default learning rates, DTensor TP via :func:`canzona.models.parallelize`, Markov-chain data): the
loss trajectory of each strategy against ``sc`` on the same mesh (and, where bitwise equality is
required, the fingerprint of the final full parameters), and ``sc`` against a single-process run
on the global batch with the same hyperparameters.
Bitwise equality is *required* where the floating-point operations are the same: against ``sc``
on meshes with at most 2 DP ranks (a two-term sum is commutative, so all-reduce and reduce-scatter
give the same bits; the model, data, TP forward and the optimizer math on whole tensors are the
same). Elsewhere (DP 4: gloo's all-reduce and reduce-scatter may associate a four-term sum
differently; ``sc`` vs one process: a mean of per-rank means and TP's row-parallel partial sums
reassociate the arithmetic) the trajectories must agree within :data:`LOSS_RTOL` (per dtype and
optimizer) relative to the loss, and the report carries the measured maximum and the reason.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.runtime import faults
from canzona.runtime.buffer import local_tensor
from canzona.testing import ReferenceRunner, inject_grads, integer_grads, mean_grads, pack, params_of, tp_cut, unpack
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
_BITWISE_REASON = "same floating-point operations: model, data, optimizer math on whole tensors, and 2-term DP sums are order independent"


def optimizer_setup(optimizer: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any], dict[str, Any]]:
    """(matrix optimizer class, its kwargs, element-wise AdamW kwargs) for a cell's optimizer name."""
    from canzona.distributed import resolve_optimizer

    cls = resolve_optimizer(optimizer)
    kw = dict(OPTIMIZER_KWARGS[optimizer])
    ew = dict(kw) if optimizer == "adamw" else dict(ELEMENTWISE_KWARGS)
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


def _injected_cell(cell: Cell, mesh: Any, rank: int, dp_rank: int, tp_rank: int, dp: int, tp: int, fault: Any) -> dict[str, Any] | None:
    from canzona.distributed import DistributedOptimizer

    t0 = time.perf_counter()
    dtype = DTYPES[cell.dtype]
    model, full, tp_dims, bucket_numel = build_model(cell.model, dtype, tp_rank=tp_rank, tp=tp)
    shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    cls, kw, ew = optimizer_setup(cell.optimizer)
    strategy, schedule = strategy_args(cell.strategy)
    mode, f = fault if fault is not None else (None, None)
    if mode == "runtime":
        faults.arm(f)
    try:
        dopt = DistributedOptimizer(
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
        )
        for step in range(1, cell.steps + 1):
            g_full = _full_grads(shapes, step, dp_rank, dtype)
            inject_grads(model, tp_cut(g_full, tp_dims, tp_rank, tp))
            dopt.step()
            dopt.zero_grad()
            if mode == "post-step" and step == f.step:
                _post_step_fault(model, f, tp_dims, shapes[f.param], tp_rank, tp)
        fired = 0
        if mode == "runtime":
            fired = int(faults.fired(f.param))
    finally:
        if mode == "runtime":
            faults.disarm()
    sd = dopt.state_dict()
    local = params_of(model)
    shares: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(pack({"local": local, "fired": fired, "dp_rank": dp_rank, "tp_rank": tp_rank}), shares, dst=0)
    dopt.runtime.detach()
    if rank != 0:
        return None
    assert shares is not None
    got = [unpack(s) for s in shares]

    # ---- reference: the single-device optimizer on full tensors with the DP-mean gradients
    runner = ReferenceRunner(
        full, cls, kw, torch.optim.AdamW, ew, all_elementwise=dopt.plan.strategy.elementwise_only, master_dtype=torch.float32
    )
    for step in range(1, cell.steps + 1):
        runner.step(mean_grads([_full_grads(shapes, step, d, dtype) for d in range(dp)]))
    ref_params = runner.params()
    ref_masters = runner.master_values()
    ref_state = runner.states()

    cmp = Comparator()
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
    extra: dict[str, Any] = {}
    if mode is not None:
        extra["fault"] = {"mode": mode, "kind": f.kind, "param": f.param, "step": f.step, "index": f.index}
        if mode == "runtime":
            extra["fault"]["fired"] = bool(sum(g["fired"] for g in got))
    r = _result(cell, cmp, time.perf_counter() - t0, bitwise_expected=True, reason="", **extra)
    if mode == "runtime" and not extra["fault"]["fired"]:
        # A defect that could not be planted proves nothing: fail loudly instead of passing.
        r["passed"] = False
        r["error"] = (
            f"planted {f.kind} fault on {f.param} (step {f.step}) never fired: the runtime did not call "
            f"canzona.runtime.faults.{'on_update' if f.kind == 'ulp' else 'snapshot_state/on_state'} for it"
        )
    return r


# ============================================================================ real training


def _train_lr(optimizer: str) -> float | None:
    """The matrix learning rate for ``canzona.train``: its default, except AdamW, which gets the
    element-wise rate. ``zero1`` runs the element-wise optimizer (with the element-wise
    hyperparameters) on every parameter, so with train's default AdamW rates (3e-3 matrices, 1e-2
    element-wise) a zero1 run would be a different run from sc (measured: loss off by 0.098 after
    one step), a hyperparameter policy question rather than an exactness one; one rate for all
    parameters makes every strategy's AdamW the same optimizer."""
    from canzona.train import DEFAULT_ELEMENTWISE_LR

    return DEFAULT_ELEMENTWISE_LR if optimizer == "adamw" else None


def _train(optimizer: str, strategy_name: str, dtype_name: str, steps: int, dp: int, tp: int) -> tuple[torch.Tensor, str]:
    """(global loss per step, fingerprint of the final full parameters) of ``canzona.train.train``
    under one strategy, inside the running process group; every rank returns them."""
    from canzona.train import TrainConfig, train

    strategy, schedule = strategy_args(strategy_name)
    cfg = TrainConfig(
        optimizer=optimizer,
        lr=_train_lr(optimizer),
        strategy=strategy,
        dp=dp,
        tp=tp,
        steps=steps,
        batch_size=TRAIN_BATCH,
        seq_len=TRAIN_SEQ,
        dtype=dtype_name,
        tp_schedule=schedule,
        tp_style=TRAIN_TP,
        backend="gloo",
        progress=False,
    )
    res = train(cfg)
    return torch.tensor(res.losses, dtype=torch.float64), res.params_fingerprint


def _single_process_losses(optimizer: str, dtype_name: str, steps: int) -> torch.Tensor:
    """The single-device run on the global batch with ``canzona train``'s hyperparameters (its
    default learning rates, optimizer defaults otherwise): the ground truth ``sc`` is compared with."""
    from canzona.config import load_model_config
    from canzona.distributed import resolve_optimizer
    from canzona.models import Qwen3, batch
    from canzona.train import DEFAULT_ELEMENTWISE_LR, DEFAULT_LR

    cfg = load_model_config("qwen3-tiny")
    model = Qwen3(cfg, seed=0, dtype=DTYPES[dtype_name])
    lr = _train_lr(optimizer) or DEFAULT_LR[optimizer]
    runner = ReferenceRunner(
        model, resolve_optimizer(optimizer), {"lr": lr}, torch.optim.AdamW, {"lr": DEFAULT_ELEMENTWISE_LR}, master_dtype=torch.float32
    )
    losses = []
    for step in range(steps):
        ids, labels = batch(step, 0, 1, TRAIN_BATCH, TRAIN_SEQ, 0, vocab=cfg.vocab_size)
        loss = runner.model.loss(ids, labels)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in runner.model.named_parameters()}
        runner.model.zero_grad(set_to_none=True)
        runner.step(grads)
        losses.append(float(loss.detach().float()))
    return torch.tensor(losses, dtype=torch.float64)


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


def _training_cells(cells: Sequence[Cell], rank: int, dp: int, tp: int) -> list[dict[str, Any]]:
    """Run the training cells of one mesh, ``sc`` first per (optimizer, dtype) as the baseline."""
    out: list[dict[str, Any]] = []
    keys: list[tuple[str, str, int]] = []
    for c in cells:
        k = (c.optimizer, c.dtype, c.steps)
        if k not in keys:
            keys.append(k)
    for optimizer, dtype_name, steps in keys:
        group = [c for c in cells if (c.optimizer, c.dtype, c.steps) == (optimizer, dtype_name, steps)]
        t0 = time.perf_counter()
        try:
            baseline, base_fp = _train(optimizer, BASELINE, dtype_name, steps, dp, tp)
        except Exception as exc:  # noqa: BLE001 - without the baseline no cell of the group can be judged
            out.extend(_error(c, exc, time.perf_counter() - t0) for c in group)
            continue
        sc_seconds = time.perf_counter() - t0
        for cell in group:
            t1 = time.perf_counter()
            fp_same: bool | None = None
            try:
                if cell.strategy == BASELINE:
                    expected = _single_process_losses(optimizer, dtype_name, steps) if rank == 0 else baseline
                    got = baseline
                    bitwise = False
                    reason = (
                        "sc vs one process: a mean of per-rank mean losses"
                        + (" and TP row-parallel partial sums" if tp > 1 else "")
                        + " reassociate the arithmetic; bound LOSS_RTOL[dtype][optimizer] x max |loss|"
                    )
                    seconds = sc_seconds + time.perf_counter() - t1
                else:
                    got, fp = _train(optimizer, cell.strategy, dtype_name, steps, dp, tp)
                    expected = baseline
                    fp_same = fp == base_fp
                    bitwise = dp <= 2
                    reason = (
                        _BITWISE_REASON
                        if bitwise
                        else "dp=4: gloo all-reduce (sc) and reduce-scatter may associate the 4-term gradient sums differently; bound LOSS_RTOL[dtype][optimizer] x max |loss|"
                    )
                    seconds = time.perf_counter() - t1
            except Exception as exc:  # noqa: BLE001 - a failing cell is a result, not a crash
                out.append(_error(cell, exc, time.perf_counter() - t1))
                continue
            if rank != 0:
                continue
            passed, mx, first, bound = _loss_comparison(expected, got, bitwise, LOSS_RTOL[dtype_name][optimizer])
            if bitwise and fp_same is False:
                # equal losses but different final parameters (the last update is not seen by any loss)
                passed = False
                if first is None:
                    first = Mismatch("params", "fingerprint", None, base_fp, "differs")
            r = _result(cell, None, seconds)
            r.update(
                passed=passed,
                max_abs_diff=mx,
                first_mismatch=first.as_dict() if first is not None else None,
                mismatched_params=[first.param] if first is not None else [],
                compared=len(expected),
                bitwise_expected=bitwise,
                bitwise=bool(torch.equal(expected, got)) and fp_same is not False,
                params_identical=fp_same,
                bound=bound,
                reason=reason,
                losses=[float(x) for x in got],
                reference_losses=[float(x) for x in expected],
            )
            out.append(r)
    return out


# ============================================================================ the worker


def _error(cell: Cell, exc: BaseException, seconds: float) -> dict[str, Any]:
    r = _result(cell, None, seconds)
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    r.update(passed=False, max_abs_diff=None, first_mismatch=None, mismatched_params=[], error=text[:500], traceback=traceback.format_exc()[-2000:])
    return r


def run_mesh(rank: int, world: int, mesh_name: str, cells: Sequence[Cell], fault: tuple[str, str, faults.Fault] | None = None) -> list[dict[str, Any]] | None:
    """Worker body (module level for spawn): every cell of one mesh; rank 0 returns the results.

    ``fault`` = (cell name, mode, Fault) plants a defect in that one cell: mode ``runtime`` arms it
    in :mod:`canzona.runtime.faults` (the runtime perturbs an update or a state), mode
    ``post-step`` perturbs the model's parameter right after the optimizer step (ulp only).
    """
    spec = parse_mesh(mesh_name)
    if spec.world != world:
        raise ValueError(f"mesh {mesh_name} needs {spec.world} processes, the group has {world}")
    dp, tp = spec.dp, spec.tp
    dp_rank, tp_rank = divmod(rank, tp)
    mesh = _make_mesh(dp, tp)
    results: list[dict[str, Any]] = []
    for cell in cells:
        if cell.check != "injected":
            continue
        t0 = time.perf_counter()
        cell_fault = (fault[1], fault[2]) if fault is not None and fault[0] == cell.name else None
        try:
            r = _injected_cell(cell, mesh, rank, dp_rank, tp_rank, dp, tp, cell_fault)
        except Exception as exc:  # noqa: BLE001 - recorded as a failed cell; construction errors raise on every rank
            r = _error(cell, exc, time.perf_counter() - t0)
        if rank == 0 and r is not None:
            results.append(r)
    training = [c for c in cells if c.check == "training"]
    if training:
        results.extend(r for r in _training_cells(training, rank, dp, tp) if rank == 0)
    return results if rank == 0 else None
