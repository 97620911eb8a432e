"""Run a selection of cells: one spawned process group per mesh, results gathered into a report.

An FSDP2 mesh shares the process group of a selected mesh with the same number of processes
(:func:`validation.matrix.process_groups`), running after that mesh's cells.

:func:`run_suite` is the programmatic entry point (``canzona validate`` and ``python -m
validation`` call it). It checks everything it can *before* starting a process (names, meshes
against the processes available, the report path), so bad input costs nothing and writes nothing.

Test-only fault hook (documented in ``docs/validation.md``): ``fault=PlantedFault(cell, Fault,
mode)`` plants one defect in one cell. ``mode="runtime"`` registers it as an update hook
(:class:`validation.faults.FaultHook`) on that cell's optimizer only, so the runtime itself perturbs
the update (``ulp``) or loses a state update (``stale_state``); ``mode="post-step"`` has the
validation worker add one ulp to the model's copy of the parameter element right after the
optimizer step (a corrupted value return; ``ulp`` only). From the command line:
``CANZONA_FAULT="kind=ulp,param=NAME,step=S,index=I"`` with ``CANZONA_FAULT_CELL=<cell name>``
(and optionally ``CANZONA_FAULT_MODE=post-step``). ``mode="defect"`` arms one of the training
gate's planted defects (:mod:`validation.defects`: ``qk-norm-unreduced``, ``state-on-dp1``,
``lr-on-dp1``), from the command line ``CANZONA_FAULT="defect=<name>"``. FSDP2 cells take
``runtime`` faults only (:mod:`validation.fsdp_harness` arms them for the one case).

:func:`run` is the Python API behind ``canzona validate``, the pytest plugin and the exactness
notebook: the user's optimizer and model by name, class or import path, returning the
:class:`SuiteResult` (the report document, ``ok``, the failing cells, the table).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from validation.faults import Fault
from validation.matrix import Cell, Selection, build_matrix, group_by_mesh, parse_mesh, process_groups
from validation.report import build_report, check_writable, write_report

__all__ = ["PlantedFault", "SuiteResult", "run", "run_suite", "run_group", "fault_from_env", "settings", "preflight", "MESH_TIMEOUT_S"]

#: Upper bound on one mesh's cells (a process group running several meshes gets this per mesh); a
#: hung collective ends there.
MESH_TIMEOUT_S = 900.0
FAULT_MODES = ("runtime", "post-step", "defect")


@dataclass(frozen=True, slots=True)
class PlantedFault:
    """A test-only defect planted in one cell (see the module docstring); ``fault`` is a
    :class:`~validation.faults.Fault`, or a defect name for ``mode="defect"``."""

    cell: str
    fault: Fault | str
    mode: str = "runtime"

    def __post_init__(self) -> None:
        from validation.defects import DEFECTS

        if self.mode not in FAULT_MODES:
            raise ValueError(f"fault mode must be one of {', '.join(FAULT_MODES)}, got {self.mode!r}")
        if self.mode == "defect":
            if self.fault not in DEFECTS:
                raise ValueError(f"unknown planted defect {self.fault!r}; choose one of {', '.join(DEFECTS)}")
            return
        if not isinstance(self.fault, Fault):
            raise ValueError(f"mode {self.mode!r} needs a validation.faults.Fault, got {self.fault!r}")
        if self.mode == "post-step" and self.fault.kind != "ulp":
            raise ValueError("post-step faults model a corrupted value return: kind 'ulp' only")


@dataclass(frozen=True, slots=True)
class SuiteResult:
    report: dict[str, Any]
    paths: tuple[Path, Path] | None
    #: why the report files could not be written (a full disk, say): the results are still here
    write_error: str | None = None

    @property
    def ok(self) -> bool:
        return self.report["summary"]["failed"] == 0

    @property
    def exit_code(self) -> int:
        return 0 if self.ok and self.write_error is None else 1

    @property
    def failures(self) -> list[dict[str, Any]]:
        """The cells that did not pass (mismatches and errors)."""
        return [c for c in self.report["cells"] if not c["passed"]]

    def table(self, *, full: bool = False) -> str:
        """The readable summary: failing cells in full and passes counted (``full``: every row)."""
        from validation.report import format_summary, format_table

        return format_table(self.report) if full else format_summary(self.report)


def fault_from_env() -> PlantedFault | None:
    """The planted fault described by ``CANZONA_FAULT`` + ``CANZONA_FAULT_CELL`` (+ ``CANZONA_FAULT_MODE``)."""
    from validation.faults import parse

    text = os.environ.get("CANZONA_FAULT", "").strip()
    if not text:
        return None
    cell = os.environ.get("CANZONA_FAULT_CELL", "").strip()
    if not cell:
        raise ValueError("CANZONA_FAULT is set but CANZONA_FAULT_CELL (the cell to plant it in) is not")
    if text.startswith("defect="):
        return PlantedFault(cell, text.partition("=")[2].strip(), "defect")
    # the parent only parses it; the workers plant it in the one cell
    return PlantedFault(cell, parse(text, "CANZONA_FAULT"), os.environ.get("CANZONA_FAULT_MODE", "runtime").strip() or "runtime")


def settings() -> dict[str, Any]:
    """What the cells were run with (recorded in the report)."""
    from canzona.train import DEFAULT_ELEMENTWISE_LR, DEFAULT_LR
    from validation import checks
    from validation.fsdp2_cells import FSDP_DEFAULT_KWARGS, FSDP_ELEMENTWISE_KWARGS
    from validation.matrix import FSDP_MESH_NAMES

    return {
        "injected_gradients": f"integers in [-8, 8] x 2**{checks.GRAD_EXPONENT} per DP rank, seed {checks.GRAD_SEED}",
        "master_dtype": "float32",
        "optimizer_kwargs": {k: {kk: (list(vv) if isinstance(vv, tuple) else vv) for kk, vv in v.items()} for k, v in checks.OPTIMIZER_KWARGS.items()},
        "elementwise_optimizer": "AdamW",
        "elementwise_kwargs": {k: (list(v) if isinstance(v, tuple) else v) for k, v in checks.ELEMENTWISE_KWARGS.items()},
        "fsdp": {
            "runner": "validation.fsdp_harness.fsdp_mesh_worker (FSDPToy or FSDPMoEToy under fully_shard) vs validation.fsdp_harness.fsdp_reference",
            "meshes": {m: parse_mesh(m).fsdp for m in FSDP_MESH_NAMES},
            "injected_gradients": "validation.harness.integer_grads (its default seed and scale) per DP rank",
            "elementwise_kwargs": dict(FSDP_ELEMENTWISE_KWARGS),
            "optimizer_kwargs_when_none": dict(FSDP_DEFAULT_KWARGS),
        },
        "training": {
            "runner": "validation.checks._train_run (canzona.models.parallelize, DistributedOptimizer) vs validation.checks._teacher_forced",
            "grad_rtol": dict(checks.GRAD_RTOL),
            "param_rtol": 0.0,
            "lr": {**DEFAULT_LR, "adamw": DEFAULT_ELEMENTWISE_LR},
            "elementwise_lr": DEFAULT_ELEMENTWISE_LR,
            "batch": checks.TRAIN_BATCH,
            "seq_len": checks.TRAIN_SEQ,
            "tp_style": checks.TRAIN_TP,
            "loss_rtol": {k: dict(v) for k, v in checks.LOSS_RTOL.items()},
        },
    }


def _mesh_failure(cells: Sequence[Cell], message: str, seconds: float, group: str | None = None) -> list[dict[str, Any]]:
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
            "error": f"mesh {group or c.mesh} process group failed: {line}",
        }
        for c in cells
    ]


def run_suite(
    sel: Selection,
    *,
    report_path: str | os.PathLike[str] | None,
    fault: PlantedFault | Sequence[PlantedFault] | None = None,
    command: str = "",
    progress: Callable[[str], None] | None = None,
    mesh_timeout_s: float = MESH_TIMEOUT_S,
    on_cell: Callable[[dict[str, Any]], None] | None = None,
    probe: bool = True,
) -> SuiteResult:
    """Run the selected cells and write the report (``report_path=None``: do not write).

    ``progress`` receives a line per mesh, ``on_cell`` a short dict per finished cell (``cell``,
    ``passed``, ``error``, ``seconds``, ``bitwise_expected``, ``bitwise``), called from a reader
    thread while the workers run. ``probe``: import and construct the user's optimizer and model
    and probe the optimizer's separability (:mod:`validation.probe`) before any process starts.
    """
    cells = build_matrix(sel)
    planted = _planted_faults(fault, cells)
    if probe:
        preflight(cells, sel)
    if report_path is not None:
        check_writable(report_path)
    say = progress or (lambda _m: None)
    events, reader, stop = _start_cell_reader(on_cell)
    options = {"optimizer_kwargs": sel.optimizer_kwargs, "model_kwargs": sel.model_kwargs, "progress": events}
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    by_mesh = group_by_mesh(cells)
    for group in process_groups(by_mesh):
        results.extend(_run_mesh_group(group, by_mesh, planted, options, mesh_timeout_s, say))
    if reader is not None:
        stop.set()
        reader.join(timeout=5.0)
    explicit = any(v is not None for v in (sel.optimizers, sel.strategies, sel.meshes, sel.dtypes, sel.checks, sel.models, sel.steps))
    level = "custom" if explicit else sel.level
    report = build_report(results, level=level, command=command, seconds=time.perf_counter() - t0, settings=settings())
    paths, write_error = None, None
    if report_path is not None:
        try:
            paths = write_report(report, report_path)
        except (OSError, ValueError) as exc:
            # keep what was computed: the caller prints the table, then this line
            write_error = f"cannot write the report {report_path}: {getattr(exc, 'strerror', None) or exc}"
    return SuiteResult(report, paths, write_error)


def _planted_faults(fault: PlantedFault | Sequence[PlantedFault] | None, cells: Sequence[Cell]) -> list[PlantedFault]:
    """``fault`` as a list, refused unless each names a distinct selected cell whose mesh takes its mode."""
    planted = [] if fault is None else [fault] if isinstance(fault, PlantedFault) else list(fault)
    if len({f.cell for f in planted}) != len(planted):
        raise ValueError("at most one planted fault per cell")
    for f in planted:
        if f.cell not in {c.name for c in cells}:
            raise ValueError(f"fault cell {f.cell!r} is not among the selected cells")
        if f.mode != "runtime" and parse_mesh(next(c.mesh for c in cells if c.name == f.cell)).fsdp is not None:
            raise ValueError(f"fault cell {f.cell!r} is on an FSDP2 mesh, which takes runtime faults only (not {f.mode!r})")
    return planted


def _start_cell_reader(on_cell: Callable[[dict[str, Any]], None] | None) -> tuple[Any, threading.Thread | None, threading.Event]:
    """The queue the workers post finished cells to and a started thread handing each to
    ``on_cell`` until the stop event is set (no queue and no thread without ``on_cell``)."""
    import multiprocessing as mp
    import queue as queue_mod

    events = mp.get_context("spawn").Queue() if on_cell is not None else None
    stop = threading.Event()

    def drain() -> None:
        assert events is not None and on_cell is not None
        while True:
            try:
                on_cell(events.get(timeout=0.2))
            except queue_mod.Empty:
                if stop.is_set():
                    return
            except (EOFError, OSError):
                return

    reader = threading.Thread(target=drain, daemon=True) if events is not None else None
    if reader is not None:
        reader.start()
    return events, reader, stop


def _run_mesh_group(
    group: Sequence[str],
    by_mesh: dict[str, list[Cell]],
    planted: Sequence[PlantedFault],
    options: dict[str, Any],
    mesh_timeout_s: float,
    say: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Run the meshes of one process group in one spawn; a result per cell, in cell order (a
    worker failure or a missing result fails the cells it concerns)."""
    from canzona.runtime.launch import WorkerError, run_workers

    results: list[dict[str, Any]] = []
    parts = [(m, list(by_mesh[m])) for m in group]
    mesh_cells = [c for _, mc in parts for c in mc]
    mesh_name = " + ".join(group)
    world = parse_mesh(group[0]).world
    say(f"mesh {mesh_name}: {len(mesh_cells)} cells on {world} processes ...")
    t1 = time.perf_counter()
    arg = [(f.cell, f.mode, f.fault) for f in planted if f.cell in {c.name for c in mesh_cells}] or None
    try:
        out = run_workers(run_group, world, parts, arg, options, timeout_s=mesh_timeout_s * len(parts), pg_timeout_s=120.0)
        got = out[0] or []
        by_name = {r["cell"]: r for r in got}
        missing = [c for c in mesh_cells if c.name not in by_name]
        results.extend(by_name[c.name] for c in mesh_cells if c.name in by_name)
        if missing:
            results.extend(_mesh_failure(missing, "the worker returned no result for these cells", 0.0, mesh_name))
    except WorkerError as exc:
        results.extend(_mesh_failure(mesh_cells, str(exc), time.perf_counter() - t1, mesh_name))
    n_pass = sum(1 for r in results[-len(mesh_cells) :] if r["passed"])
    say(f"mesh {mesh_name}: {n_pass}/{len(mesh_cells)} passed in {time.perf_counter() - t1:.1f} s")
    return results


def run_group(
    rank: int,
    world: int,
    parts: Sequence[tuple[str, Sequence[Cell]]],
    fault: Sequence[tuple[str, str, Any]] | None = None,
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]] | None:
    """Worker body (module level for spawn): the cells of each ``(mesh, cells)`` part in turn in
    this one process group, ZeRO-1 meshes through :func:`validation.checks.run_mesh`, FSDP2 meshes
    through :func:`validation.fsdp2_cells.run_fsdp_mesh`; rank 0 returns every result."""
    import torch.distributed as dist

    from validation.checks import run_mesh
    from validation.fsdp2_cells import run_fsdp_mesh

    results: list[dict[str, Any]] = []
    for mesh_name, cells in parts:
        worker = run_fsdp_mesh if parse_mesh(mesh_name).fsdp is not None else run_mesh
        got = worker(rank, world, mesh_name, cells, fault, options)
        results.extend(got or ())
        dist.barrier()
    return results if rank == 0 else None


def preflight(cells: Sequence[Cell], sel: Selection) -> None:
    """Before any process starts: import and construct every user optimizer and model
    (:class:`~validation.targets.TargetError`, one line naming the path) and refuse optimizers
    that cannot be exact under distribution (:class:`~validation.probe.NotSeparableError`)."""
    from validation.checks import optimizer_setup
    from validation.probe import probe_separable
    from validation.targets import BUILTIN_OPTIMIZERS, check_model_target, check_optimizer_target, is_import_path

    for name in dict.fromkeys(c.optimizer for c in cells):
        if name in BUILTIN_OPTIMIZERS and not sel.optimizer_kwargs:
            continue
        cls, kw, _ = optimizer_setup(name, sel.optimizer_kwargs)
        check_optimizer_target(name, kw)
        probe_separable(cls, kw, f"optimizer {name}")
    for name in dict.fromkeys(c.model for c in cells):
        if is_import_path(name):
            check_model_target(name, sel.model_kwargs or {})


def _as_path(obj: Any, what: str) -> str:
    """A class or function -> its import path ``module:qualname`` (workers import it by that)."""
    if isinstance(obj, str):
        return obj
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or "<locals>" in qual or module == "__main__":
        from validation.targets import TargetError

        raise TargetError(
            f"{what} {obj!r} must be defined at module level in an importable module (not in __main__ or inside a "
            "function): the validation workers are fresh processes that import it by name"
        )
    return f"{module}:{qual}"


def _names(value: Any, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, (str, type)) or callable(value) else list(value)
    out: list[str] = []
    for v in items:
        if isinstance(v, str):
            out.extend(p.strip() for p in v.split(",") if p.strip())
        else:
            out.append(_as_path(v, what))
    return tuple(out)


def run(
    optimizer: Any = None,
    model: Any = None,
    *,
    optimizer_kwargs: dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    meshes: Sequence[str] | str | None = None,
    strategies: Sequence[str] | str | None = None,
    dtypes: Sequence[str] | str | None = None,
    checks: Sequence[str] | str | None = None,
    level: str = "quick",
    steps: int | None = None,
    max_procs: int | None = None,
    report: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    on_cell: Callable[[dict[str, Any]], None] | None = None,
    fault: PlantedFault | None = None,
    command: str = "",
    mesh_timeout_s: float = MESH_TIMEOUT_S,
) -> SuiteResult:
    """Validate an optimizer (and model) under every selected cell; the Python API of the gate.

    ``optimizer``/``model``: built-in names, import paths ``package.module:Name``, or the class /
    factory itself (defined at module level in an importable module: every worker imports it).
    None: every built-in. The other filters take names as ``canzona validate`` does. ``report``: a
    directory to write ``report.json`` and ``report.csv`` into (or a ``.json`` path); None writes
    nothing. Raises :class:`~validation.targets.TargetError` (import or construction failed) and
    :class:`~validation.probe.NotSeparableError` (the optimizer cannot be exact under
    distribution; the message says why), both ``ValueError``, before any process starts.

    >>> res = validation.run("examples.sign_momentum:SignMomentum", meshes=["dp2"])  # doctest: +SKIP
    >>> res.ok, res.table()                                                          # doctest: +SKIP
    """
    from validation.matrix import CHECKS, DTYPES, MODELS, OPTIMIZERS, STRATEGIES, default_max_procs, parse_names
    from validation.report import report_dir_paths
    from validation.targets import parse_kwargs

    opt_names = parse_names(_names(optimizer, "optimizer"), OPTIMIZERS, "optimizer", paths=True)
    model_names = parse_names(_names(model, "model"), MODELS, "model", paths=True)
    mesh_names = None
    if meshes is not None:
        mesh_names = tuple(dict.fromkeys(parse_mesh(m).name for m in ([meshes] if isinstance(meshes, str) else meshes) for m in str(m).split(",") if m.strip()))
    sel = Selection(
        level=level,
        optimizers=opt_names,
        strategies=parse_names(strategies, STRATEGIES, "strategy"),
        meshes=mesh_names,
        dtypes=parse_names(dtypes, DTYPES, "dtype"),
        checks=parse_names(checks, CHECKS, "check"),
        models=model_names,
        steps=steps,
        max_procs=max_procs or default_max_procs(),
        optimizer_kwargs=parse_kwargs(optimizer_kwargs, "optimizer kwargs") or None,
        model_kwargs=parse_kwargs(model_kwargs, "model kwargs") or None,
    )
    report_path = report_dir_paths(report)[0] if report is not None else None
    return run_suite(sel, report_path=report_path, fault=fault, command=command, progress=progress, on_cell=on_cell, mesh_timeout_s=mesh_timeout_s)
