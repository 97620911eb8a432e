"""Named phases of an iteration: NVTX ranges, profiler ranges and timers under one name.

Every phase is opened with :func:`phase`, which enters, with the identical string,

- an NVTX range through the ``nvtx`` package when it is importable (a no-op without a GPU or
  without an attached nsys; ``torch.cuda.nvtx`` is never used because it raises on CPU builds),
- ``torch.profiler.record_function`` (shows in TensorBoard / Chrome traces; cheap when no
  profiler is active),
- a :class:`PhaseTimer` when one is active (:func:`timing`): wall time and this thread's CPU
  time per phase name, and the current phase name that communication accounting files bytes under.

Names are registered in :mod:`canzona.phase_names` (listed in docs/profiling.md) and spelled
literally where they are opened: ``<base>[/bucket<i>|/group<k>][/launch|/wait]``. An
asynchronously started collective opens a ``.../launch`` range while it is issued and a
``.../wait`` range while the caller blocks on it; the timer keeps the two apart (key
``<base>/launch`` and ``<base>/wait``), so exposed communication (wait time) is never mixed with
issue cost.

Range arguments. ``phase(name, bytes=..., bucket=..., peers=...)`` attaches small integer or string
arguments to the range: they appear under ``args`` of the event in a Chrome / TensorBoard trace
(profile with ``record_shapes=True``; torch records keyword values only then) and as the NVTX
payload (``bytes``) in nsys. ``torch.profiler.record_function`` drops its ``args`` string from the
exported trace, so the arguments ride on a second range of the identical name and extent, entered
with torch's ``_RecordFunctionFast`` (category ``cpu_op``), nested directly inside the
``user_annotation`` range that trace summaries count. Nothing is formatted or entered when no
profiler records: the keyword dict is the whole cost.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

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
    "STATUS",
    "PhaseTimer",
    "phase",
    "timing",
    "current_phase",
    "base_phase",
    "timer_key",
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
    STATUS,
    TP_APPLY,
    TP_COMPUTE,
    TP_GATHER,
    TP_SCATTER,
    base_phase,
    parse,
)

# torch's fast record-function carries keyword values into the trace; guard for older builds
_RecordFunctionFast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)


def timer_key(name: str) -> str:
    """The :class:`PhaseTimer` key of a phase name: its base, plus ``/launch`` or ``/wait`` for the
    stages of an asynchronous collective (the bucket/group index is dropped)."""
    base, _, stage = parse(name)
    return f"{base}/{stage}" if stage else base


@dataclass
class PhaseTimer:
    """Accumulated wall and thread-CPU seconds and call counts per phase, keyed by
    :func:`timer_key` (base name, with ``/launch`` and ``/wait`` stages kept apart)."""

    wall: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cpu: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, name: str, wall: float, cpu: float) -> None:
        key = timer_key(name)
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
def phase(name: str, **args: int | str) -> Iterator[None]:
    """Open the named phase (NVTX range + ``record_function`` + timer); nests freely.

    ``args`` (e.g. ``bytes=4096, bucket=3, peers=2``) are attached to the range for profilers
    (see the module docstring); they cost nothing when no profiler records."""
    timer = _timer
    _stack.append(name)
    if _nvtx is not None:
        payload = args.get("bytes")
        rng: Any = _nvtx.annotate(name, domain="canzona", payload=payload if isinstance(payload, int) else None)
    else:
        rng = contextlib.nullcontext()
    # record_function costs ~6 us even with no profiler attached; enter it only when one records.
    recording = torch.autograd._profiler_enabled()
    rf: Any = torch.profiler.record_function(name) if recording else contextlib.nullcontext()
    fast: Any = (
        _RecordFunctionFast(name, [], args) if recording and args and _RecordFunctionFast is not None else contextlib.nullcontext()
    )
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        with rng, rf, fast:
            yield
    finally:
        if timer is not None:
            timer.add(name, time.perf_counter() - t0, time.thread_time() - c0)
        _stack.pop()
