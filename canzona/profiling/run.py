"""Profile training steps of the tiny model: torch.profiler (TensorBoard traces) and CUDA capture ranges.

A profile is :func:`canzona.train.train` (the ordinary training loop, whose phases are annotated
by :mod:`canzona.runtime.phases`) run on every rank under ``torch.profiler.profile`` with a
wait / warmup / active schedule, so each rank leaves one ``rank<r>.<id>.pt.trace.json`` in the
output directory (the TensorBoard plugin's naming). Each trace is exported to a private file,
its process renamed ``rank <r>`` (torch names every process "python"), and written atomically
(:func:`canzona.fileio.atomic_write`): a failed export (full disk) leaves no partial or temporary
file and raises an ``OSError`` naming the trace. While the profiler runs, kineto's status lines
(``USDT:... profiler_start``, ``STAGE:...``), which it prints on the process's stderr whatever
its log level, are filtered out of that stream; every other line passes. The profiler is entered before ``train``
and advanced by its per-step hook, so ``ProfilerStep#k`` is training step ``k``; with ``wait >= 1``
step 0 (plan, fingerprint exchange, lazy optimizer state) is never recorded.

For Nsight Systems, :class:`CudaCaptureRange` calls ``cudaProfilerStart`` before the first active
step and ``cudaProfilerStop`` after the last one (only when CUDA is available: the training code
itself never touches the CUDA profiler API), so ``nsys profile --capture-range=cudaProfilerApi``
records exactly the active steps (:mod:`canzona.profiling.nsys`).

:func:`expected_phases` lists the phases a strategy runs (the annotation contract the tests check).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from canzona.runtime.phases import (
    BACKWARD,
    DP_ALL_GATHER,
    DP_ALL_REDUCE,
    DP_LOCAL_UPDATE,
    DP_REDUCE_SCATTER,
    FORWARD,
    LAYERWISE_BROADCAST,
    OPTIMIZER_STEP,
    STATUS,
    TP_APPLY,
    TP_COMPUTE,
    TP_GATHER,
    TP_SCATTER,
)

__all__ = [
    "CudaCaptureRange",
    "ProfileRun",
    "ProfileSchedule",
    "ProfileSpec",
    "ProfilerHook",
    "existing_traces",
    "expected_phases",
    "profile_run",
    "profile_worker",
    "drop_kineto_lines",
    "name_processes",
    "quiet_kineto",
    "trace_writer",
]



def _nonneg(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")


@dataclass(frozen=True, slots=True)
class ProfileSchedule:
    """torch.profiler's schedule: ``wait`` steps unrecorded, ``warmup`` steps recorded and
    discarded, ``active`` steps recorded; one cycle. Training runs ``total`` steps."""

    wait: int = 1
    warmup: int = 1
    active: int = 2

    def __post_init__(self) -> None:
        _nonneg("wait", self.wait, 0)
        _nonneg("warmup", self.warmup, 0)
        _nonneg("active", self.active, 1)

    @property
    def total(self) -> int:
        return self.wait + self.warmup + self.active

    @property
    def first_active(self) -> int:
        return self.wait + self.warmup

    @property
    def last_active(self) -> int:
        return self.total - 1


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    """One profiling run: the training config (its ``steps`` is overridden by the schedule), the
    schedule, where TensorBoard traces go (None: no torch.profiler) and whether to toggle the CUDA
    profiler API around the active steps (for nsys)."""

    train: Any  # canzona.train.TrainConfig
    schedule: ProfileSchedule = ProfileSchedule()
    tensorboard_dir: str | None = None
    cuda_capture: bool = False

    def __post_init__(self) -> None:
        from canzona.train import TrainConfig

        if not isinstance(self.train, TrainConfig):
            raise TypeError(f"train must be a canzona.train.TrainConfig, got {type(self.train).__name__}")
        if not isinstance(self.schedule, ProfileSchedule):
            raise TypeError(f"schedule must be a ProfileSchedule, got {type(self.schedule).__name__}")
        if self.tensorboard_dir is None and not self.cuda_capture:
            raise ValueError("nothing to record: give a TensorBoard directory and/or cuda_capture=True")
        if self.cuda_capture and not torch.cuda.is_available():
            raise ValueError("cuda_capture needs a CUDA device (torch.cuda.is_available() is False)")
        if self.train.steps != self.schedule.total:
            object.__setattr__(self, "train", replace(self.train, steps=self.schedule.total))


@dataclass(frozen=True, slots=True)
class ProfileRun:
    """What a profiling run left: one trace per rank (rank order) and the per-rank train results."""

    spec: ProfileSpec
    traces: tuple[Path, ...]
    results: tuple[Any, ...]


def expected_phases(strategy: str, *, dp: int, tp: int, tp_schedule: str | None = None) -> frozenset[str]:
    """The base phase names a run of ``strategy`` at ``dp`` x ``tp`` records (on some rank).

    Every strategy: forward, backward, optimizer step, local update, status exchanges. Reduce-scatter strategies
    (zero1, asc, lb-asc, lb-asc-joint): bucket reduce-scatters and parameter all-gathers; sc and
    layerwise: bucket all-reduces, layerwise adds the owners' broadcast. With tp > 1 the TP engine
    runs gather / compute / apply per micro-group, plus the scatter of updated shards unless the
    schedule is ``sync`` (all TP ranks compute: sc, layerwise, zero1)."""
    from canzona.plan.strategies import get_strategy

    record = get_strategy(strategy)
    out = {FORWARD, BACKWARD, OPTIMIZER_STEP, DP_LOCAL_UPDATE, STATUS}
    if record.reduce_scatter:
        out |= {DP_REDUCE_SCATTER, DP_ALL_GATHER}
    else:
        out.add(DP_ALL_REDUCE)
    if record.param_return == "broadcast":
        out.add(LAYERWISE_BROADCAST)
    if tp > 1 and not record.elementwise_only:
        out |= {TP_GATHER, TP_COMPUTE, TP_APPLY}
        if (tp_schedule or record.default_tp_schedule) != "sync":
            out.add(TP_SCATTER)
    return frozenset(out)


class CudaCaptureRange:
    """``cudaProfilerStart`` before step ``first`` and ``cudaProfilerStop`` after step ``last``.

    :meth:`before_training` handles ``first == 0``; :meth:`after_step` is called after every step.
    Does nothing on a machine without CUDA, so it can be left in a CPU run."""

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.enabled = torch.cuda.is_available()
        self.started = self.stopped = False

    def _start(self, *, sync: bool = True) -> None:
        if self.enabled and not self.started:
            if sync:  # let earlier steps' kernels finish outside the captured range
                torch.cuda.synchronize()
            torch.cuda.profiler.start()
            self.started = True

    def _stop(self) -> None:
        if self.enabled and self.started and not self.stopped:
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            self.stopped = True

    def before_training(self) -> None:
        if self.first == 0:
            self._start(sync=False)  # nothing has run yet (and the rank's device is not chosen yet)

    def after_step(self, step: int) -> None:
        if step + 1 == self.first:
            self._start()
        if step == self.last:
            self._stop()

    def close(self) -> None:
        self._stop()


class ProfilerHook:
    """The per-step hook handed to :func:`canzona.train.train`: advances the torch profiler
    (``prof.step()``) and the CUDA capture range after every optimizer step."""

    def __init__(self, prof: Any | None, capture: CudaCaptureRange | None) -> None:
        self.prof, self.capture = prof, capture
        self.steps = 0

    def __call__(self, step: int, *_: Any) -> None:  # train's hook also passes (loss, phase seconds)
        if self.capture is not None:
            self.capture.after_step(step)
        if self.prof is not None:
            self.prof.step()
        self.steps += 1


def existing_traces(directory: str | Path) -> list[Path]:
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith((".pt.trace.json", ".pt.trace.json.gz")))


def _metrics_files(directory: Path) -> list[Path]:
    """The metrics log of an earlier profile in ``directory`` (metrics.csv, run.json, TensorBoard event files)."""
    from canzona.runs import METRICS_CSV, RUN_JSON

    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and (p.name in (METRICS_CSV, RUN_JSON) or p.name.startswith("events.out.tfevents.")))


#: one kineto status message: ``USDT:2026-01-02 03:04:05 123:456 SyncActivityProfilerHandler.cpp:52] profiler_start``
#: (two can share a line: kineto does not always end them with a newline)
_KINETO_LINE = re.compile(rb"(?:USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] (?:(?!USDT:|STAGE:)[^\n])*")


def drop_kineto_lines(data: bytes) -> bytes:
    """``data`` (whole lines) without kineto's status messages; other lines unchanged."""
    out = []
    for line in data.split(b"\n"):
        kept = _KINETO_LINE.sub(b"", line)
        if kept.strip() or not line.strip():
            out.append(kept)
    return b"\n".join(out)


@contextlib.contextmanager
def quiet_kineto() -> Iterator[None]:
    """Filter kineto's status lines out of this process's stderr (file descriptor 2, where its C++
    code prints them) for the duration of the block."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)

    def pump() -> None:
        pending = b""
        with os.fdopen(r, "rb", buffering=0) as f:
            while chunk := f.read(65536):
                pending += chunk
                head, sep, pending = pending.rpartition(b"\n")
                kept = drop_kineto_lines(head)
                if sep and (kept or not head):
                    os.write(saved, kept + b"\n")
        if pending:
            os.write(saved, drop_kineto_lines(pending))

    thread = threading.Thread(target=pump, name="canzona-kineto-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        import sys

        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the pump sees end of file
        thread.join(timeout=5)
        os.close(saved)


def trace_writer(directory: str | Path, rank: int) -> Callable[[Any], None]:
    """The profiler's ``on_trace_ready``: export this rank's trace to a private file, name its
    process ``rank <rank>``, and write ``rank<rank>.<ms>.pt.trace.json`` atomically."""
    folder = Path(directory)

    def write(prof: Any) -> None:
        from canzona.fileio import atomic_write

        target = folder / f"rank{rank}.{int(time.time() * 1000)}.pt.trace.json"
        fd, scratch = tempfile.mkstemp(prefix=f".rank{rank}.", suffix=".export", dir=folder)
        os.close(fd)
        try:
            try:
                prof.export_chrome_trace(scratch)
                with open(scratch, encoding="utf-8") as f:
                    doc = json.load(f)  # our own profiler's output, not a user's file
            except (OSError, RuntimeError) as exc:
                raise OSError(getattr(exc, "errno", None), f"cannot export the trace: {exc}", str(target)) from None
            name_processes(doc, rank)
            atomic_write(target, json.dumps(doc))
        finally:
            for leftover in folder.glob(Path(scratch).name + "*"):
                with contextlib.suppress(OSError):
                    leftover.unlink()

    return write


def name_processes(doc: dict[str, Any], rank: int) -> None:
    """Rename every process of a Chrome trace ``rank <rank>`` and sort it by rank (in place)."""
    for ev in doc.get("traceEvents", ()):
        if isinstance(ev, dict) and ev.get("ph") == "M" and isinstance(ev.get("args"), dict):
            if ev.get("name") == "process_name":
                ev["args"]["name"] = f"rank {rank}"
            elif ev.get("name") == "process_sort_index":
                ev["args"]["sort_index"] = rank


def profile_worker(rank: int, world_size: int, spec: ProfileSpec) -> Any:
    """Worker body (:func:`canzona.runtime.launch.run_workers`): train under the profiler on this
    rank; returns this rank's :class:`canzona.train.TrainResult`."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from canzona.train import MetricsHook, train

    del world_size
    sch = spec.schedule
    capture = CudaCaptureRange(sch.first_active, sch.last_active) if spec.cuda_capture else None

    def run(prof: Any) -> Any:
        # one training run stepping the profiler (if any) and the CUDA capture range (if any);
        # rank 0 logs loss and phase times beside the traces (metrics.csv + TensorBoard scalars)
        hook = ProfilerHook(prof, capture)
        log = MetricsHook(spec.train, str(spec.tensorboard_dir)) if rank == 0 and spec.tensorboard_dir is not None else None
        if capture is not None:
            capture.before_training()
        try:
            if log is None:
                return train(spec.train, on_step=hook)

            def both(step: int, loss: float, phases: dict[str, float]) -> None:
                log(step, loss, phases)
                hook(step, loss, phases)

            return train(spec.train, on_step=both)
        finally:
            if log is not None:
                log.close()
            if capture is not None:
                capture.close()

    if spec.tensorboard_dir is None:
        return run(None)
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and spec.train.resolved_backend == "nccl":
        activities.append(ProfilerActivity.CUDA)
    handler = trace_writer(spec.tensorboard_dir, rank)
    with quiet_kineto(), profile(
        activities=activities,
        schedule=schedule(wait=sch.wait, warmup=sch.warmup, active=sch.active, repeat=1),
        on_trace_ready=handler,
        # torch writes the keyword arguments of canzona's phase ranges (bytes, bucket/group, peers)
        # into the trace only when shapes are recorded
        record_shapes=True,
        profile_memory=False,
        with_stack=False,
    ) as prof:
        return run(prof)


def profile_run(spec: ProfileSpec, *, overwrite: bool = False, timeout_s: float = 600.0) -> ProfileRun:
    """Run ``spec`` on ``dp * tp`` local processes (gloo on CPU, NCCL with CUDA when the config says
    so) and return the traces. A TensorBoard directory that already holds traces is refused unless
    ``overwrite`` (then only those trace files are removed): one profile per directory keeps
    ``load_traces`` unambiguous."""
    from canzona.runtime.launch import run_workers

    cfg = spec.train
    if spec.tensorboard_dir is not None:
        out = Path(spec.tensorboard_dir)
        if out.exists() and not out.is_dir():
            raise ValueError(f"{out} exists and is not a directory")
        old = existing_traces(out)
        if old and not overwrite:
            raise ValueError(f"{out} already holds {len(old)} trace file(s); choose an empty directory or pass --force to replace them")
        logs = _metrics_files(out)
        if logs and not overwrite:
            raise ValueError(f"{out} already holds a metrics log ({logs[0].name}); choose an empty directory or pass --force to replace it")
        for p in [*old, *logs]:
            p.unlink()
        out.mkdir(parents=True, exist_ok=True)
    backend = cfg.resolved_backend
    results = run_workers(profile_worker, cfg.world_size, spec, backend=backend, timeout_s=timeout_s)
    traces: list[Path] = []
    if spec.tensorboard_dir is not None:
        found = existing_traces(spec.tensorboard_dir)
        for r in range(cfg.world_size):
            mine = [p for p in found if p.name.startswith(f"rank{r}.")]
            if len(mine) != 1:
                raise RuntimeError(f"rank {r} left {len(mine)} trace files in {spec.tensorboard_dir} (expected one)")
            traces.append(mine[0])
    return ProfileRun(spec, tuple(traces), tuple(results))
