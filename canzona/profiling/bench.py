"""Strategy benchmark: sc, layerwise, asc and lb-asc on the same model and mesh (Section 5's comparison).

Each strategy trains the tiny model with :func:`canzona.train.train` on ``dp * tp`` local
processes. A :class:`PhaseRecorder` wraps every phase (the real annotation still runs inside it)
and records, per rank and step, wall time, this thread's CPU time and, on CUDA, the phase's GPU
time from a pair of CUDA events. From those :func:`summarize` derives, per strategy:

- the optimizer-step makespan (slowest rank's ``canzona/optimizer/step``, median over steps), and
  with the parameter return (``canzona/dp/all_gather``) added;
- per-rank optimizer compute: CPU seconds (CUDA ms on GPU) of ``canzona/dp/local_update`` +
  ``canzona/tp/compute``, the optimizer math that Canzona distributes; its total over ranks and
  its maximum (the load-balance bound);
- fwd-bwd time (slowest rank) and the iteration time;
- bytes moved per phase per step (sum over ranks of what each sends: :mod:`canzona.runtime.comm`).

On a few CPU cores with more processes than cores the wall times are noisy; CPU-time and byte
ratios are the figures to trust: sc recomputes every update on every rank, so lb-asc's total
optimizer compute should approach 1/world of sc's.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from canzona.runtime import phases as _phases
from canzona.runtime.phases import (
    BACKWARD,
    DP_ALL_GATHER,
    FORWARD,
    OPTIMIZER_STEP,
    base_phase,
)
from canzona.phase_names import COMPUTE_PHASES as COMPUTE

__all__ = [
    "BENCH_STRATEGIES",
    "PhaseRecorder",
    "StrategySummary",
    "bench_worker",
    "format_report",
    "ratios",
    "run_strategy",
    "summarize",
]

BENCH_STRATEGIES: tuple[str, ...] = ("sc", "layerwise", "asc", "lb-asc")


class PhaseRecorder:
    """Wraps :func:`canzona.runtime.phases.phase`: the annotation runs unchanged, and each
    outermost occurrence of a base phase is logged as ``(step, base, wall_s, cpu_s, gpu_ms)``.
    ``on_step`` (the training loop's per-step hook) advances the step and resolves CUDA events
    (the loop synchronizes the device at the end of every step on CUDA)."""

    def __init__(self, *, cuda: bool = False) -> None:
        self.real = _phases.phase
        self.cuda = cuda
        self.step = 0
        self.records: list[tuple[int, str, float, float, float]] = []
        self._open: list[str] = []
        self._pending: list[tuple[int, str, float, float, Any, Any]] = []

    @contextlib.contextmanager
    def phase(self, name: str, **args: int | str) -> Iterator[None]:
        base = base_phase(name)
        if base in self._open:  # a nested re-entry of the same phase: counted by the outer one
            with self.real(name, **args):
                yield
            return
        self._open.append(base)
        ev = None
        if self.cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            with self.real(name, **args):
                yield
        finally:
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            self._open.pop()
            if ev is not None:
                ev[1].record()
                self._pending.append((self.step, base, wall, cpu, ev[0], ev[1]))
            else:
                self.records.append((self.step, base, wall, cpu, float("nan")))

    def on_step(self, step: int, *_: Any) -> None:  # train's hook also passes (loss, phase seconds)
        if self._pending:
            torch.cuda.synchronize()
            for s, base, wall, cpu, a, b in self._pending:
                self.records.append((s, base, wall, cpu, float(a.elapsed_time(b))))
            self._pending.clear()
        self.step = step + 1


def bench_worker(rank: int, world_size: int, config: Any) -> dict[str, Any]:
    """Worker body: train ``config`` with every phase recorded; returns this rank's records."""
    # Import every module that uses ``phase`` before patching, so all of them see the recorder.
    import canzona.distributed
    import canzona.runtime.dp
    import canzona.runtime.tp  # noqa: F401
    from canzona.profiling.overhead import patch_phase
    from canzona.train import train

    del world_size
    rec = PhaseRecorder(cuda=config.resolved_backend == "nccl")
    with patch_phase(rec.phase):
        result = train(config, on_step=rec.on_step)
    return {
        "rank": rank,
        "records": rec.records,
        "comm_bytes": result.comm_bytes,
        "step_seconds": list(result.step_seconds),
        "losses": list(result.losses),
        "params_fingerprint": result.params_fingerprint,
    }


def run_strategy(config: Any, *, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Run :func:`bench_worker` on ``config.dp * config.tp`` local processes."""
    from canzona.runtime.launch import run_workers

    return run_workers(bench_worker, config.world_size, config, backend=config.resolved_backend, timeout_s=timeout_s)


@dataclass(frozen=True, slots=True)
class StrategySummary:
    """Figures of one strategy (times in ms, medians over the measured steps unless noted)."""

    strategy: str
    steps: int
    optimizer_ms: float
    optimizer_return_ms: float
    fwd_bwd_ms: float
    iteration_ms: float
    compute_kind: str  # "cpu" (thread CPU time) or "cuda" (CUDA events)
    compute_ms_per_rank: tuple[float, ...]  # mean per measured step
    bytes_per_phase: dict[str, int] = field(default_factory=dict)  # per step, summed over ranks
    params_fingerprint: str = ""

    @property
    def compute_total_ms(self) -> float:
        return float(sum(self.compute_ms_per_rank))

    @property
    def compute_max_ms(self) -> float:
        return float(max(self.compute_ms_per_rank))

    @property
    def compute_balance(self) -> float:
        """max / mean over ranks of the optimizer compute (1 = perfectly balanced)."""
        mean = self.compute_total_ms / len(self.compute_ms_per_rank)
        return self.compute_max_ms / mean if mean > 0 else float("nan")

    @property
    def bytes_total(self) -> int:
        return int(sum(self.bytes_per_phase.values()))


def summarize(strategy: str, per_rank: Sequence[dict[str, Any]], *, warmup: int) -> StrategySummary:
    """Reduce the per-rank records of one run to a :class:`StrategySummary`, skipping the first
    ``warmup`` steps (plan construction, lazy optimizer state)."""
    steps = len(per_rank[0]["step_seconds"])
    measured = list(range(warmup, steps))
    if not measured:
        raise ValueError(f"no measured steps: {steps} steps run, warmup {warmup}")
    ranks = len(per_rank)
    # wall[r][s][phase], comp[r][s]
    wall: list[list[dict[str, float]]] = [[{} for _ in range(steps)] for _ in range(ranks)]
    comp = [[0.0] * steps for _ in range(ranks)]
    kind = "cpu"
    for r, out in enumerate(per_rank):
        for s, base, w, c, g in out["records"]:
            if s >= steps:
                continue
            wall[r][s][base] = wall[r][s].get(base, 0.0) + w
            if base in COMPUTE:
                if not math.isnan(g):  # CUDA events were recorded
                    kind = "cuda"
                    comp[r][s] += g
                else:
                    comp[r][s] += c * 1e3

    def med_max(f) -> float:
        return statistics.median(max(f(r, s) for r in range(ranks)) for s in measured) * 1e3

    opt = med_max(lambda r, s: wall[r][s].get(OPTIMIZER_STEP, 0.0))
    opt_ret = med_max(lambda r, s: wall[r][s].get(OPTIMIZER_STEP, 0.0) + wall[r][s].get(DP_ALL_GATHER, 0.0))
    fb = med_max(lambda r, s: wall[r][s].get(FORWARD, 0.0) + wall[r][s].get(BACKWARD, 0.0))
    it = med_max(lambda r, s: per_rank[r]["step_seconds"][s])
    comp_rank = tuple(statistics.fmean(comp[r][s] for s in measured) for r in range(ranks))
    nbytes: dict[str, int] = {}
    for out in per_rank:
        for name, v in out["comm_bytes"].items():
            nbytes[name] = nbytes.get(name, 0) + int(v.get("sent", 0))
    # Traffic is identical every step (same plan, same shapes), so the per-step figure is exact.
    per_step = {k: v // steps for k, v in sorted(nbytes.items())}
    return StrategySummary(strategy, len(measured), opt, opt_ret, fb, it, kind, comp_rank, per_step, per_rank[0]["params_fingerprint"])


def ratios(results: Sequence[StrategySummary], baseline: str) -> dict[str, dict[str, float]]:
    """Each strategy's figures divided by ``baseline``'s: compute total and max, optimizer makespan
    (with and without the parameter return), fwd-bwd and bytes moved."""
    base = {r.strategy: r for r in results}.get(baseline)
    if base is None:
        raise ValueError(f"baseline {baseline!r} not among the results ({', '.join(r.strategy for r in results)})")

    def div(a: float, b: float) -> float:
        return a / b if b > 0 else float("nan")

    return {
        r.strategy: {
            "compute_total": div(r.compute_total_ms, base.compute_total_ms),
            "compute_max": div(r.compute_max_ms, base.compute_max_ms),
            "optimizer": div(r.optimizer_ms, base.optimizer_ms),
            "optimizer+return": div(r.optimizer_return_ms, base.optimizer_return_ms),
            "fwd_bwd": div(r.fwd_bwd_ms, base.fwd_bwd_ms),
            "bytes": div(r.bytes_total, base.bytes_total),
        }
        for r in results
    }


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f}"


def format_report(results: Sequence[StrategySummary], *, header: str = "") -> str:
    """The benchmark's printed report: figures per strategy, bytes per phase, ratios vs sc and layerwise."""
    lines = [header] if header else []
    kind = results[0].compute_kind
    unit = "thread CPU ms" if kind == "cpu" else "CUDA ms"
    lines.append(f"{'strategy':<11}{'opt ms':>9}{'opt+ret ms':>12}{'fwd-bwd ms':>12}{'iter ms':>10}"
                 f"{'compute total':>15}{'compute max':>13}{'max/mean':>10}  per-rank compute ({unit}/step)")
    for r in results:
        per = " ".join(f"{v:.2f}" for v in r.compute_ms_per_rank)
        lines.append(f"{r.strategy:<11}{r.optimizer_ms:>9.2f}{r.optimizer_return_ms:>12.2f}{r.fwd_bwd_ms:>12.2f}{r.iteration_ms:>10.2f}"
                     f"{r.compute_total_ms:>15.2f}{r.compute_max_ms:>13.2f}{r.compute_balance:>10.2f}  [{per}]")
    phases = sorted({p for r in results for p in r.bytes_per_phase})
    lines.append("")
    lines.append("KiB sent per step, summed over ranks")
    lines.append(f"{'strategy':<11}" + "".join(f"{p.removeprefix('canzona/'):>20}" for p in phases) + f"{'total':>12}")
    for r in results:
        lines.append(f"{r.strategy:<11}" + "".join(f"{_kib(r.bytes_per_phase.get(p, 0)):>20}" for p in phases) + f"{_kib(r.bytes_total):>12}")
    names = {r.strategy for r in results}
    for base in ("sc", "layerwise"):
        if base not in names:
            continue
        lines.append("")
        lines.append(f"ratios vs {base}")
        rt = ratios(results, base)
        cols = ("compute_total", "compute_max", "optimizer", "optimizer+return", "fwd_bwd", "bytes")
        lines.append(f"{'strategy':<11}" + "".join(f"{c:>18}" for c in cols))
        for r in results:
            lines.append(f"{r.strategy:<11}" + "".join(f"{rt[r.strategy][c]:>18.3f}" for c in cols))
    return "\n".join(lines)
