"""What the phase annotations cost when no profiler is attached.

Every phase (:func:`canzona.runtime.phases.phase`) enters an NVTX range (``nvtx`` package), a
``torch.profiler.record_function`` range and, inside ``DistributedOptimizer.step``, a
:class:`~canzona.runtime.phases.PhaseTimer`. Two measurements:

- :func:`annotation_cost`: microseconds per ``with phase(...)`` call, beside its parts (bare
  loop, ``nullcontext``, NVTX alone, ``record_function`` alone, with and without an active timer).
- :class:`AnnotationToggle`: an A/B on real training steps. Used as the per-step hook of the
  training loop, it swaps every module's ``phase`` for a do-nothing context manager on alternate
  blocks of steps, timing each step, so annotated and bare steps interleave under the same
  background load; :func:`ab_summary` turns the step times into medians and a difference.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from canzona.runtime import phases as _phases

__all__ = ["AnnotationToggle", "ab_summary", "annotation_cost", "null_phase", "patch_phase"]


@contextlib.contextmanager
def null_phase(name: str, **args: int | str) -> Iterator[None]:
    """A phase that does nothing: the baseline of the A/B comparison."""
    yield


def _per_call_us(fn: Callable[[], None], n: int, repeats: int) -> tuple[float, float]:
    """Median over ``repeats`` of the mean wall and thread-CPU time of ``n`` calls, in microseconds.
    CPU time is the cost itself; wall time also holds preemption when cores are oversubscribed."""
    fn()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(n):
            fn()
        wall.append((time.perf_counter() - t0) / n * 1e6)
        cpu.append((time.thread_time() - c0) / n * 1e6)
    return statistics.median(wall), statistics.median(cpu)


def annotation_cost(n: int = 20_000, repeats: int = 7, name: str = "canzona/tp/compute/group0") -> dict[str, dict[str, float]]:
    """Cost per call of ``with phase(name): pass`` and of its parts, no profiler attached:
    ``{variant: {"wall_us", "cpu_us"}}``.

    Variants: ``loop`` (empty call), ``nullcontext``, ``nvtx`` (``nvtx.annotate`` alone, when the
    package is present), ``record_function`` (alone), ``phase`` (no timer active), ``phase+timer``
    (inside ``timing()``, as everywhere in ``canzona.train``: forward/backward and the optimizer
    step run under the optimizer's PhaseTimer)."""
    if n < 1 or repeats < 1:
        raise ValueError(f"n and repeats must be positive, got n={n}, repeats={repeats}")
    if torch.autograd._profiler_enabled():
        raise RuntimeError("a profiler is attached: annotation_cost measures the unprofiled cost")

    def loop() -> None:
        pass

    def null() -> None:
        with contextlib.nullcontext():
            pass

    def rf() -> None:
        with torch.profiler.record_function(name):
            pass

    def ph() -> None:
        with _phases.phase(name):
            pass

    variants: dict[str, Callable[[], None]] = {"loop": loop, "nullcontext": null, "record_function": rf}
    nv = getattr(_phases, "_nvtx", None)
    if nv is not None:

        def nvtx_only() -> None:
            with nv.annotate(name, domain="canzona"):
                pass

        variants["nvtx"] = nvtx_only
    variants["phase"] = ph
    out: dict[str, dict[str, float]] = {}
    for key, fn in variants.items():
        w, c = _per_call_us(fn, n, repeats)
        out[key] = {"wall_us": w, "cpu_us": c}
    with _phases.timing():
        w, c = _per_call_us(ph, n, repeats)
    out["phase+timer"] = {"wall_us": w, "cpu_us": c}
    return out


@contextlib.contextmanager
def patch_phase(replacement: Callable[..., Any]) -> Iterator[list[str]]:
    """Replace ``phase`` in every loaded ``canzona`` module that imported it; restore on exit.
    Yields the names of the patched modules."""
    original = _phases.phase
    patched: list[str] = []
    for modname, mod in list(sys.modules.items()):
        if modname.startswith("canzona") and mod is not None and getattr(mod, "phase", None) is original:
            mod.phase = replacement
            patched.append(modname)
    try:
        yield patched
    finally:
        for modname in patched:
            sys.modules[modname].phase = original


@dataclass
class AnnotationToggle:
    """Per-step hook for an interleaved A/B of annotated vs. bare steps (one per rank).

    Called after every optimizer step with the step index (further arguments of the training
    loop's hook are ignored). It records the wall and thread-CPU time since the
    previous call under the mode that step ran in, then picks the mode of the next step: blocks of
    ``block`` steps alternate between ``annotated`` (the real ``phase``) and ``bare`` (every
    canzona module's ``phase`` replaced by :func:`null_phase`). The first ``skip`` steps (lazy
    optimizer state, allocator warm-up; step 0 always, it has no start mark) are not recorded. All ranks switch at the same step
    because the schedule depends on the step index only.
    """

    block: int = 2
    skip: int = 1
    times: dict[str, list[float]] = field(default_factory=lambda: {"annotated": [], "bare": []})
    cpu_times: dict[str, list[float]] = field(default_factory=lambda: {"annotated": [], "bare": []})
    _mode: str = "annotated"
    _last: float | None = None
    _last_cpu: float = 0.0
    _patch: Any = None

    def mode_for(self, step: int) -> str:
        return "annotated" if (step // self.block) % 2 == 0 else "bare"

    def __call__(self, step: int, *_: Any) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        if self._last is not None and step >= self.skip:
            self.times[self._mode].append(now - self._last)
            self.cpu_times[self._mode].append(cpu - self._last_cpu)
        nxt = self.mode_for(step + 1)
        if nxt != self._mode:
            if nxt == "bare":
                self._patch = patch_phase(null_phase)
                self._patch.__enter__()
            else:
                self.close()
            self._mode = nxt
        self._last, self._last_cpu = time.perf_counter(), time.thread_time()

    def close(self) -> None:
        """Restore the real ``phase`` (call when training ends in bare mode)."""
        if self._patch is not None:
            self._patch.__exit__(None, None, None)
            self._patch = None


def ab_summary(times: dict[str, list[float]]) -> dict[str, float]:
    """Median step time per mode (ms), their difference and the relative overhead."""
    a, b = times.get("annotated", []), times.get("bare", [])
    if not a or not b:
        raise ValueError("need step times for both modes (run more steps than skip + 2 * block)")
    ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    return {
        "annotated_ms": ma,
        "bare_ms": mb,
        "diff_ms": ma - mb,
        "overhead": (ma - mb) / mb,
        "n_annotated": float(len(a)),
        "n_bare": float(len(b)),
    }


def ab_worker(rank: int, world_size: int, config: Any, block: int = 2, skip: int = 1) -> dict[str, Any]:
    """Worker body: measure :func:`annotation_cost` on this rank, then train ``config`` with an
    :class:`AnnotationToggle`; returns step times per mode, phase calls per annotated step and the
    per-call costs (us)."""
    # Import every module that uses ``phase`` before patching (see :func:`patch_phase`).
    import canzona.distributed
    import canzona.runtime.dp
    import canzona.runtime.tp  # noqa: F401
    from canzona.train import train

    del world_size
    cost = annotation_cost(n=5000, repeats=5)
    toggle = AnnotationToggle(block=block, skip=skip)
    try:
        result = train(config, on_step=toggle)
    finally:
        toggle.close()
    annotated_steps = sum(toggle.mode_for(s) == "annotated" for s in range(config.steps))
    calls = sum(int(v["calls"]) for v in result.phase_times.values())
    return {
        "rank": rank,
        "times": toggle.times,
        "cpu_times": toggle.cpu_times,
        "calls_per_step": calls / annotated_steps,
        "cost_us": cost,
    }
