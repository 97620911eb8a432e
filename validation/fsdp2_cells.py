"""The injected check on FSDP2 meshes: :mod:`validation.fsdp_harness` cells in the suite's report format.

Each cell is one case of :func:`validation.fsdp_harness.fsdp_mesh_worker`: the ``FSDPToy`` model
(odd shapes FSDP2 pads, uneven TP chunks, a 1 x n matrix, a tied embedding) or ``FSDPMoEToy``
(non-square expert stacks whose experts FSDP2's ``Shard(0)`` keeps whole, uneven counts) sharded with
``fully_shard``, ``canzona.DistributedOptimizer`` stepped with integer gradients injected through
a real FSDP2 backward, rank 0's full parameters and consolidated state returned. Rank 0 then
replays the steps with the single-device optimizers (:func:`validation.fsdp_harness.fsdp_reference`)
and compares every parameter, fp32 master and optimizer-state entry with ``torch.equal``
(:class:`validation.compare.Comparator`, which locates the first differing element);
``fsdp_harness``'s own comparison must agree. A planted runtime fault travels in the case
(``fsdp_harness`` arms it for that case only); a planted fault that leaves no trace fails the cell.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from validation.compare import Comparator
from validation.matrix import Cell, parse_mesh

__all__ = ["FSDP_ELEMENTWISE_KWARGS", "FSDP_DEFAULT_KWARGS", "fsdp_case", "compare_fsdp", "judge_fsdp", "run_fsdp_mesh"]

#: The element-wise AdamW settings of :func:`validation.fsdp_harness.run_fsdp_case` (its cases carry
#: none). If they ever drift apart, the reference differs on the element-wise parameters and the
#: cell fails: a drift can never make a cell pass.
FSDP_ELEMENTWISE_KWARGS: dict[str, Any] = {"lr": 0.01, "weight_decay": 0.1}
#: What :func:`~validation.fsdp_harness.run_fsdp_case` gives an optimizer when a case has no keyword
#: arguments (a user's optimizer without ``--optimizer-kwargs``); the reference gets the same.
FSDP_DEFAULT_KWARGS: dict[str, Any] = {"lr": 0.02}


def _dtype(name: str) -> tuple[torch.dtype, bool]:
    """(parameter dtype, FSDP2 mixed precision) of a cell dtype."""
    if name == "bf16-mixed":
        return torch.float32, True
    return getattr(torch, name), False


def fsdp_case(cell: Cell, fault: Any, optimizer_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """The :func:`~validation.fsdp_harness.fsdp_mesh_worker` case of ``cell``; ``fault`` is a
    :class:`~validation.faults.Fault` or None."""
    from validation.checks import optimizer_setup
    from validation.targets import BUILTIN_OPTIMIZERS

    cls, kw, _ = optimizer_setup(cell.optimizer, optimizer_kwargs)
    dtype, mixed = _dtype(cell.dtype)
    case: dict[str, Any] = {
        "label": cell.name,
        # built-ins by name (as canzona.DistributedOptimizer documents them), the user's class itself
        "optimizer": cell.optimizer if cell.optimizer in BUILTIN_OPTIMIZERS else cls,
        "strategy": cell.strategy,
        "optimizer_kwargs": kw or dict(FSDP_DEFAULT_KWARGS),
        "dtype": str(dtype).removeprefix("torch."),
        "mixed_precision": mixed,
        "steps": cell.steps,
        "model": cell.model,
    }
    if fault is not None:
        case["fault"] = {"kind": fault.kind, "param": fault.param, "step": fault.step, "index": fault.index}
    return case


def compare_fsdp(params: Mapping[str, torch.Tensor], document: Mapping[str, Any], ref: Any) -> Comparator:
    """Every parameter (``value``), fp32 master (``master``) and optimizer-state entry
    (``state.<key>``) of the run against the single-device replay ``ref``, bit for bit (a
    mismatch in an expert stack names the expert)."""
    cmp = Comparator(experts={n: len(tasks) for n, tasks in getattr(ref, "experts", {}).items()})
    ref_params, ref_masters, ref_states = ref.params(), ref.master_values(), ref.states()
    masters, states = document.get("params", {}), document.get("state", {})
    for name in sorted(set(ref_params) | set(params)):
        if name not in params or name not in ref_params:
            cmp.missing(name, "value", "present" if name in ref_params else "absent", "present" if name in params else "missing")
            continue
        cmp.tensors(name, "value", ref_params[name], params[name])
        if name not in masters:
            cmp.missing(name, "master", "present", "missing from state_dict")
        else:
            cmp.tensors(name, "master", ref_masters[name], masters[name])
        cmp.states(name, ref_states.get(name, {}), states.get(name, {}))
    for name in sorted(set(states) - set(ref_params)):
        cmp.missing(name, "state", "absent", "present")
    return cmp


def judge_fsdp(cell: Cell, cmp: Comparator, mismatches: Sequence[str], fault: Any, seconds: float) -> dict[str, Any]:
    """The report row of one FSDP2 cell: passed only when both comparisons found nothing and no
    planted fault was asked for (one that left no trace proves nothing)."""
    from validation.checks import _result

    r = _result(cell, cmp, seconds, bitwise_expected=True, bitwise=cmp.equal, reason="")
    if mismatches and cmp.equal:
        r["passed"] = False
        r["error"] = f"validation.fsdp_harness's comparison found differences the per-tensor comparison did not: {', '.join(mismatches[:5])}"
    if fault is not None:
        detected = not r["passed"]
        r["fault"] = {"mode": "runtime", "kind": fault.kind, "param": fault.param, "step": fault.step, "index": fault.index, "detected": detected}
        if not detected:
            r["passed"] = False
            r["error"] = (
                f"planted {fault.kind} fault on {fault.param} (step {fault.step}) left no trace: the FSDP2 runtime "
                "never applied it (no such parameter or step?) or its effect vanished"
            )
    return r


def run_fsdp_mesh(
    rank: int,
    world: int,
    mesh_name: str,
    cells: Sequence[Cell],
    fault: Sequence[tuple[str, str, Any]] | None = None,
    options: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]] | None:
    """Every cell of one FSDP2 mesh on this rank of an initialized process group (the FSDP2
    counterpart of :func:`validation.checks.run_mesh`, same arguments); rank 0 returns the results.
    Only ``runtime`` faults can be planted here (see :func:`validation.suite.run_suite`)."""
    import torch.distributed as dist

    from validation.fsdp_harness import fsdp_mesh_worker, fsdp_reference
    from validation.checks import _error, optimizer_setup

    opts = dict(options or {})
    queue = opts.get("progress")
    spec = parse_mesh(mesh_name)
    if spec.fsdp is None or spec.world != world:
        raise ValueError(f"mesh {mesh_name} is not an FSDP2 mesh of {world} processes")
    results: list[dict[str, Any]] = []
    for cell in cells:
        t0 = time.perf_counter()
        planted = next((f[2] for f in fault or () if f[0] == cell.name), None)
        try:
            case = fsdp_case(cell, planted, opts.get("optimizer_kwargs"))
            # one case per call: an error in one cell does not take the mesh's other cells with it
            out = fsdp_mesh_worker(rank, world, spec.fsdp, [case])[0]
            r = None
            if rank == 0:
                cls = optimizer_setup(cell.optimizer, opts.get("optimizer_kwargs"))[0]
                dtype, _ = _dtype(cell.dtype)
                ref = fsdp_reference(cls, case["optimizer_kwargs"], FSDP_ELEMENTWISE_KWARGS, dtype=dtype, dp=spec.dp, steps=cell.steps, model=cell.model)
                cmp = compare_fsdp(out["params"], out["document"], ref)
                r = judge_fsdp(cell, cmp, out["mismatches"], planted, time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 - recorded as a failed cell
            r = _error(cell, exc, time.perf_counter() - t0) if rank == 0 else None
        dist.barrier()
        if r is not None:
            results.append(r)
            if queue is not None:
                try:
                    queue.put({k: r.get(k) for k in ("cell", "passed", "error", "seconds", "bitwise_expected", "bitwise")})
                except Exception:  # noqa: BLE001 - progress is best effort
                    pass
    return results if rank == 0 else None
