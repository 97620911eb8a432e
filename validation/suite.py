"""Run a selection of cells: one spawned process group per mesh, results gathered into a report.

:func:`run_suite` is the programmatic entry point (``canzona validate`` and ``python -m
validation`` call it). It checks everything it can *before* starting a process (names, meshes
against the processes available, the report path), so bad input costs nothing and writes nothing.

Test-only fault hook (documented in ``docs/validation.md``): ``fault=PlantedFault(cell, Fault,
mode)`` plants one defect in one cell. ``mode="runtime"`` arms it in
:mod:`canzona.runtime.faults` inside the workers for that cell only, so the runtime itself perturbs
the update (``ulp``) or loses a state update (``stale_state``); ``mode="post-step"`` has the
validation worker add one ulp to the model's copy of the parameter element right after the
optimizer step (a corrupted value return; ``ulp`` only). From the command line:
``CANZONA_FAULT="kind=ulp,param=NAME,step=S,index=I"`` with ``CANZONA_FAULT_CELL=<cell name>``
(and optionally ``CANZONA_FAULT_MODE=post-step``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canzona.runtime.faults import Fault
from validation.matrix import Cell, Selection, build_matrix, group_by_mesh, parse_mesh
from validation.report import build_report, check_writable, write_report

__all__ = ["PlantedFault", "SuiteResult", "run_suite", "fault_from_env", "settings", "MESH_TIMEOUT_S"]

#: Upper bound on one mesh's process group (all its cells); a hung collective ends there.
MESH_TIMEOUT_S = 900.0
FAULT_MODES = ("runtime", "post-step")


@dataclass(frozen=True, slots=True)
class PlantedFault:
    """A test-only defect planted in one cell (see the module docstring)."""

    cell: str
    fault: Fault
    mode: str = "runtime"

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"fault mode must be one of {', '.join(FAULT_MODES)}, got {self.mode!r}")
        if self.mode == "post-step" and self.fault.kind != "ulp":
            raise ValueError("post-step faults model a corrupted value return: kind 'ulp' only")


@dataclass(frozen=True, slots=True)
class SuiteResult:
    report: dict[str, Any]
    paths: tuple[Path, Path] | None
    #: why the report could not be written (full disk ...); the results are still in ``report``
    write_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.report["summary"]["failed"] == 0

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1


def fault_from_env() -> PlantedFault | None:
    """The planted fault described by ``CANZONA_FAULT`` + ``CANZONA_FAULT_CELL`` (+ ``CANZONA_FAULT_MODE``)."""
    from canzona.runtime import faults

    text = os.environ.get("CANZONA_FAULT", "").strip()
    if not text:
        return None
    cell = os.environ.get("CANZONA_FAULT_CELL", "").strip()
    if not cell:
        raise ValueError("CANZONA_FAULT is set but CANZONA_FAULT_CELL (the cell to plant it in) is not")
    f = faults.from_env("CANZONA_FAULT")
    faults.disarm()  # the parent only parses it; workers arm it for the one cell
    assert f is not None
    return PlantedFault(cell, f, os.environ.get("CANZONA_FAULT_MODE", "runtime").strip() or "runtime")


def settings() -> dict[str, Any]:
    """What the cells were run with (recorded in the report)."""
    from canzona.train import DEFAULT_ELEMENTWISE_LR, DEFAULT_LR
    from validation import checks

    return {
        "injected_gradients": f"integers in [-8, 8] x 2**{checks.GRAD_EXPONENT} per DP rank, seed {checks.GRAD_SEED}",
        "master_dtype": "float32",
        "optimizer_kwargs": {k: {kk: (list(vv) if isinstance(vv, tuple) else vv) for kk, vv in v.items()} for k, v in checks.OPTIMIZER_KWARGS.items()},
        "elementwise_optimizer": "AdamW",
        "elementwise_kwargs": {k: (list(v) if isinstance(v, tuple) else v) for k, v in checks.ELEMENTWISE_KWARGS.items()},
        "training": {
            "runner": "canzona.train.train",
            "lr": {**DEFAULT_LR, "adamw": DEFAULT_ELEMENTWISE_LR},
            "elementwise_lr": DEFAULT_ELEMENTWISE_LR,
            "batch": checks.TRAIN_BATCH,
            "seq_len": checks.TRAIN_SEQ,
            "tp_style": checks.TRAIN_TP,
            "loss_rtol": {k: dict(v) for k, v in checks.LOSS_RTOL.items()},
        },
    }


def _mesh_failure(cells: Sequence[Cell], message: str, seconds: float) -> list[dict[str, Any]]:
    line = message.strip().splitlines()[0][:500] if message.strip() else "process group failed"
    return [
        {
            "cell": c.name,
            "check": c.check,
            "model": c.model,
            "optimizer": c.optimizer,
            "strategy": c.strategy,
            "mesh": c.mesh,
            "dtype": c.dtype,
            "steps": c.steps,
            "passed": False,
            "max_abs_diff": None,
            "first_mismatch": None,
            "seconds": round(seconds / max(1, len(cells)), 3),
            "error": f"mesh {c.mesh} process group failed: {line}",
        }
        for c in cells
    ]


def run_suite(
    sel: Selection,
    *,
    report_path: str | os.PathLike[str] | None,
    fault: PlantedFault | None = None,
    command: str = "",
    progress: Callable[[str], None] | None = None,
    mesh_timeout_s: float = MESH_TIMEOUT_S,
) -> SuiteResult:
    """Run the selected cells and write the report (``report_path=None``: do not write)."""
    from canzona.runtime.launch import WorkerError, run_workers
    from validation.checks import run_mesh

    cells = build_matrix(sel)
    if fault is not None and fault.cell not in {c.name for c in cells}:
        raise ValueError(f"fault cell {fault.cell!r} is not among the selected cells")
    if report_path is not None:
        check_writable(report_path)
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    for mesh_name, mesh_cells in group_by_mesh(cells).items():
        world = parse_mesh(mesh_name).world
        say(f"mesh {mesh_name}: {len(mesh_cells)} cells on {world} processes ...")
        t1 = time.perf_counter()
        arg = (fault.cell, fault.mode, fault.fault) if fault is not None and fault.cell in {c.name for c in mesh_cells} else None
        try:
            out = run_workers(run_mesh, world, mesh_name, list(mesh_cells), arg, timeout_s=mesh_timeout_s, pg_timeout_s=120.0)
            got = out[0] or []
            by_name = {r["cell"]: r for r in got}
            missing = [c for c in mesh_cells if c.name not in by_name]
            results.extend(by_name[c.name] for c in mesh_cells if c.name in by_name)
            if missing:
                results.extend(_mesh_failure(missing, "the worker returned no result for these cells", 0.0))
        except WorkerError as exc:
            results.extend(_mesh_failure(mesh_cells, str(exc), time.perf_counter() - t1))
        n_pass = sum(1 for r in results[-len(mesh_cells) :] if r["passed"])
        say(f"mesh {mesh_name}: {n_pass}/{len(mesh_cells)} passed in {time.perf_counter() - t1:.1f} s")
    explicit = any(v is not None for v in (sel.optimizers, sel.strategies, sel.meshes, sel.dtypes, sel.checks, sel.models, sel.steps))
    level = "custom" if explicit else sel.level
    report = build_report(results, level=level, command=command, seconds=time.perf_counter() - t0, settings=settings())
    try:
        paths = write_report(report, report_path) if report_path is not None else None
    except OSError as exc:  # keep the results: the caller prints them, then reports the failure
        where = exc.filename or report_path
        return SuiteResult(report, None, f"cannot write the report {where}: {exc.strerror or exc}")
    return SuiteResult(report, paths)
