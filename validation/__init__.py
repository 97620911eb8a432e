"""Canzona's exactness-validation suite: the package's promise made checkable.

Every Canzona strategy (``sc``, ``layerwise``, ``asc``, ``lb-asc``, ``no-fuse``, ``zero1``) on every
ZeRO-1 mesh (``dp2``, ``tp2``, ``dp2xtp2``, ``dp4``), and the FSDP2 strategies on the FSDP2 meshes
(``fsdp2``, ``fsdp4``, ``fsdp2xtp2``, ``hsdp2x2``), must compute *exactly* what the single-device optimizer
(Muon, Shampoo, SOAP; AdamW on element-wise parameters) computes on the full tensors: parameters,
fp32 masters and optimizer states equal with ``torch.equal`` (the paper's Sections 3-4 claim that
alpha-balanced partitioning and micro-group hosting never split a matrix). Real training adds the
loss trajectory of each strategy against ``sc``.

Run it as ``canzona validate --quick`` (CI) or ``--full``, or ``python -m validation``; see
``docs/validation.md`` for the matrix, the report format and the fault hook. Modules:
:mod:`validation.matrix` (cells, filters), :mod:`validation.models` (the awkward parameter set),
:mod:`validation.checks` (the worker and both checks), :mod:`validation.fsdp2_cells` (the injected
check on FSDP2 meshes), :mod:`validation.compare` (bitwise
comparison), :mod:`validation.report` (JSON/CSV/table), :mod:`validation.suite` (orchestration),
:mod:`validation.cli` (arguments, exit codes), :mod:`validation.targets` (the user's optimizer and
model by import path), :mod:`validation.probe` (separability probes), :mod:`validation.replicas`
(every copy on every rank), :mod:`validation.defects` (planted defects the gate must catch).

Python API: ``validation.run(optimizer, model, meshes=[...])`` returns a :class:`SuiteResult`
(``ok``, ``failures``, ``table()``, ``report``); the pytest fixture ``canzona_exact``
(:mod:`canzona.pytest_plugin`) wraps it. ``canzona`` reaches this package only through
:func:`canzona.lab.suite` (the product imports the lab on demand, never at import time); the
suite's helpers (:mod:`validation.harness`: the toy model, integer gradients, the single-device
reference; :mod:`validation.faults`: planted runtime defects; :mod:`validation.fsdp_harness`: the
FSDP2 case; :mod:`validation.gpu`: the CUDA/NCCL checks) live here, not in the product.
"""

from __future__ import annotations

from validation.cli import add_arguments as add_cli_arguments
from validation.cli import run as run_cli
from validation.matrix import CHECKS, DTYPES, FSDP_MESH_NAMES, MODELS, OPTIMIZERS, STANDARD_MESHES, STRATEGIES, Cell, MeshSpec, Selection, build_matrix, parse_mesh
from validation.report import format_table, load_report, report_frame, write_report
from validation.probe import NotSeparableError, probe_separable
from validation.suite import PlantedFault, SuiteResult, run, run_suite
from validation.targets import TargetError

__all__ = [
    "add_cli_arguments",
    "run_cli",
    "CHECKS",
    "DTYPES",
    "MODELS",
    "OPTIMIZERS",
    "STANDARD_MESHES",
    "FSDP_MESH_NAMES",
    "STRATEGIES",
    "Cell",
    "MeshSpec",
    "Selection",
    "build_matrix",
    "parse_mesh",
    "PlantedFault",
    "SuiteResult",
    "run",
    "run_suite",
    "NotSeparableError",
    "probe_separable",
    "TargetError",
    "format_table",
    "load_report",
    "report_frame",
    "write_report",
]
