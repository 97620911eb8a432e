"""Named phases of an iteration: NVTX ranges, profiler ranges and timers under one name.

Every phase is opened with :func:`phase`, which enters, with the identical string,

- an NVTX range through the ``nvtx`` package when it is importable (a no-op without a GPU or
  without an attached nsys; ``torch.cuda.nvtx`` is never used because it raises on CPU builds),
- ``torch.profiler.record_function`` (shows in TensorBoard / Chrome traces; cheap when no
  profiler is active),
- a :class:`PhaseTimer` when one is active (:func:`timing`): wall time and this thread's CPU
  time per phase name, and the current phase name that communication accounting files bytes under.

Names are defined once in :mod:`canzona.phase_names` (listed in docs/profiling.md); suffixes ``/bucket<i>`` and ``/group<k>`` are appended where useful.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

try:  # the nvtx package is a declared dependency; keep the package usable without it
    import nvtx as _nvtx
except ImportError:  # pragma: no cover
    _nvtx = None

__all__ = [
    "PHASES",
    "FORWARD",
    "BACKWARD",
    "DP_REDUCE_SCATTER",
    "DP_ALL_REDUCE",
    "OPTIMIZER_STEP",
    "DP_LOCAL_UPDATE",
    "TP_GATHER",
    "TP_COMPUTE",
    "TP_SCATTER",
    "TP_APPLY",
    "DP_ALL_GATHER",
    "LAYERWISE_BROADCAST",
    "PhaseTimer",
    "phase",
    "timing",
    "current_phase",
    "base_phase",
]

from canzona.phase_names import (  # noqa: E402  (names live in one torch-free module)
    BACKWARD,
    DP_ALL_GATHER,
    DP_ALL_REDUCE,
    DP_LOCAL_UPDATE,
    DP_REDUCE_SCATTER,
    FORWARD,
    LAYERWISE_BROADCAST,
    OPTIMIZER_STEP,
    PHASES,
    TP_APPLY,
    TP_COMPUTE,
    TP_GATHER,
    TP_SCATTER,
    base_phase,
)


@dataclass
class PhaseTimer:
    """Accumulated wall and thread-CPU seconds and call counts per (base) phase name."""

    wall: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cpu: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, name: str, wall: float, cpu: float) -> None:
        key = base_phase(name)
        self.wall[key] += wall
        self.cpu[key] += cpu
        self.calls[key] += 1

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {k: {"wall_s": self.wall[k], "cpu_s": self.cpu[k], "calls": self.calls[k]} for k in self.wall}


_timer: PhaseTimer | None = None
_stack: list[str] = []


def current_phase() -> str | None:
    """Innermost open phase name (with suffix), or None outside any phase."""
    return _stack[-1] if _stack else None


@contextlib.contextmanager
def timing(timer: PhaseTimer | None = None) -> Iterator[PhaseTimer]:
    """Collect phase times into ``timer`` (a new one by default) while the block runs."""
    global _timer
    prev, _timer = _timer, timer if timer is not None else PhaseTimer()
    try:
        yield _timer
    finally:
        _timer = prev


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Open the named phase (NVTX range + ``record_function`` + timer); nests freely."""
    timer = _timer
    _stack.append(name)
    rng = _nvtx.annotate(name, domain="canzona") if _nvtx is not None else contextlib.nullcontext()
    # record_function costs ~6 us even with no profiler attached; enter it only when one records.
    rf = torch.profiler.record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        with rng, rf:
            yield
    finally:
        if timer is not None:
            timer.add(name, time.perf_counter() - t0, time.thread_time() - c0)
        _stack.pop()
