"""Profiling: torch.profiler / nsys runs of the annotated training loop and trace summaries.

- :mod:`canzona.profiling.run`: profile the tiny model on a DP x TP mesh (TensorBoard traces per
  rank, CUDA capture ranges for nsys), and the phases each strategy is expected to record;
- :mod:`canzona.profiling.traces`: Chrome-trace JSON -> phase table (rank, step, phase, part,
  start_us, dur_us, depth), per-phase statistics, step makespans, the optimizer step's critical
  path, CSV/Parquet summaries under ``data/profiles/``;
- :mod:`canzona.profiling.nsys`: the ``nsys profile`` command line, refused cleanly without nsys or CUDA;
- :mod:`canzona.profiling.bench`: the strategy benchmark (sc, layerwise, asc, lb-asc on one mesh);
- :mod:`canzona.profiling.overhead`: what the annotations cost with no profiler attached.

Only :mod:`~canzona.profiling.traces` is imported here (pandas, no process groups); the others are
imported on use.
"""

from __future__ import annotations

from canzona.profiling.traces import (
    META_KEYS,
    PHASE_COLUMNS,
    comm_exposure,
    critical_path,
    load_traces,
    phase_stats,
    read_meta,
    step_makespans,
    write_meta,
    write_summary,
)

__all__ = [
    "META_KEYS",
    "PHASE_COLUMNS",
    "comm_exposure",
    "critical_path",
    "load_traces",
    "phase_stats",
    "read_meta",
    "step_makespans",
    "write_meta",
    "write_summary",
]
