"""Canzona against the ordinary way: torch DDP + ``torch.optim.Muon`` on every rank.

One :class:`Case` is a model, a world size and a mesh; every variant of a case trains its own copy
of the same model (same seed) on the same data. Two modes (:func:`run_case`):

- ``interleaved`` (default): one set of ``world`` processes builds every variant and runs them in
  turn, each variant once per step, the order rotated every step (:func:`rotation`), so a load
  that drifts during the run weighs on every variant alike and the ratios compare like with like.
  Peak memory cannot be told apart per variant there (NaN; the shared peak is kept);
- ``separate``: each variant in its own fresh processes, one after another, with its own peak
  memory; a drifting load then lands on whichever variant runs at the time.

The variants (each a runner object with a ``step()`` that trains one step and returns its figures,
used by both modes):

- ``ddp``: ``DistributedDataParallel`` (all-reduce of gradients, bucketed and overlapped with
  backward) and ``torch.optim.Muon`` over every matrix parameter (AdamW over the others) on every
  rank: each rank computes every update;
- ``sc``, ``layerwise``, ``asc``, ``lb-asc``: :class:`canzona.DistributedOptimizer` with canzona's
  Muon (AdamW for element-wise parameters). A ``/copy`` suffix (``lb-asc/copy``) builds it with
  ``param_views=False, grad_views=False``: the parameter and gradient copies the views remove
  (docs/runtime.md), for measuring them side by side.

Per variant and rank, per measured step (each step starts after an untimed barrier): the step's
wall time (forward + backward + optimizer, slowest rank, median over steps), the optimizer time (``step()``, which for canzona includes
returning the updated values), the exposed communication and the bytes sent, and the peak memory
of the rank. *Exposed communication* is time the host spent blocked on a collective:

- canzona: the wall time of every ``.../wait`` phase range (``PhaseTimer`` keeps them apart) and
  of the step's status exchanges (``canzona/status``, synchronous: the rank waits there for the
  slowest one, as DDP's ranks wait in their all-reduce);
- DDP: backward with gradient synchronization minus backward under ``no_sync()`` (extra steps
  measured for that purpose only, after the measured steps of every variant), i.e. the
  all-reduce time backward could not hide.

CPU time: the same step and optimizer spans in process CPU seconds (``time.process_time``: every
thread of the rank, gloo's included). On a machine with fewer cores than busy threads, wall time
mostly measures the scheduler; CPU time still measures the work each rank does.

Bytes are logical point-to-point volumes (:mod:`canzona.runtime.comm`): counted for canzona (its
two status exchanges per step included, 16 bytes per parameter and a few more), and for DDP
computed with the same formula for its all-reduce (2 (R-1)/R of the gradient bytes per rank).
Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the growth of the process's peak
resident set (``ru_maxrss``) from just before the model is built, which also holds allocator slack.
Optimizer state bytes are per variant in both modes (each runner's own optimizer).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from canzona.phase_names import STATUS

__all__ = [
    "COPY_SUFFIX",
    "MODES",
    "VARIANTS",
    "CanzonaRunner",
    "Case",
    "DDPRunner",
    "LinearStack",
    "VariantResult",
    "format_phases",
    "format_table",
    "ideal_ratio",
    "interleaved_worker",
    "known_variant",
    "make_runner",
    "median_of_runs",
    "rotation",
    "run_case",
    "summarize",
    "vs_torch_worker",
]

VARIANTS: tuple[str, ...] = ("ddp", "sc", "layerwise", "asc", "lb-asc")
#: suffix of a canzona variant run without parameter and gradient views
COPY_SUFFIX = "/copy"


def known_variant(variant: str) -> bool:
    """``ddp``, a canzona strategy of :data:`VARIANTS`, or one with :data:`COPY_SUFFIX`."""
    base = variant.removesuffix(COPY_SUFFIX)
    return variant in VARIANTS or (base != variant and base in VARIANTS and base != "ddp")


class LinearStack(nn.Module):
    """``depth`` bias-free ``width x width`` linears with tanh between them: an optimizer-bound
    model (Muon's Newton-Schulz on a width^2 matrix costs ~width/batch times its fwd-bwd)."""

    def __init__(self, depth: int, width: int, *, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.layers = nn.ModuleList()
        for _ in range(depth):
            lin = nn.Linear(width, width, bias=False)
            with torch.no_grad():
                lin.weight.copy_(torch.randn(width, width, generator=g) / width**0.5)
            self.layers.append(lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).square().mean()


@dataclass(frozen=True, slots=True)
class Case:
    """One benchmark setting. ``model`` is ``stack`` (``depth`` x ``width`` linears) or ``qwen3``
    (the tiny Qwen3 config, canzona at ``dp x tp``, DDP at dp = world)."""

    name: str
    model: str
    world: int
    tp: int = 1
    depth: int = 8
    width: int = 384
    batch: int = 16
    seq_len: int = 32
    steps: int = 8
    warmup: int = 3
    bucket_numel: int = 300_000
    variants: tuple[str, ...] = VARIANTS

    @property
    def dp(self) -> int:
        return self.world // self.tp


@dataclass
class VariantResult:
    """Figures of one variant of a case (ms, bytes, MiB; medians over measured steps)."""

    case: str
    variant: str
    world: int
    step_ms: float
    optimizer_ms: float
    step_cpu_ms: float
    optimizer_cpu_ms: float
    exposed_comm_ms: float
    bytes_per_step: int
    peak_mib: float
    params: int
    ratios: dict[str, float] = field(default_factory=dict)
    #: canzona's phases (:class:`~canzona.runtime.phases.PhaseTimer` keys): wall ms per step, median
    #: over measured steps, one value per rank
    phases: dict[str, list[float]] = field(default_factory=dict)
    #: optimizer state bytes of the rank holding the most
    state_bytes: int = 0
    #: ``interleaved`` (every variant in the same processes, step by step in turn) or ``separate``
    mode: str = "separate"
    #: peak memory per rank of the processes that ran the variant: in interleaved mode every
    #: variant's together (``peak_mib`` is then NaN), in separate mode the same as ``peak_mib``
    all_peak_mib: float = float("nan")
    #: :func:`median_of_runs`: each run's own step ratios to DDP (``step``, ``step_cpu``), in run
    #: order, so a reader sees how far the ratio moved between runs; empty for a single run
    run_ratios: dict[str, list[float]] = field(default_factory=dict)


# ----------------------------------------------------------------------------------- worker side

#: per-step figures every runner returns (seconds, bytes); ``phases`` is canzona's, else empty
STEP_KEYS = ("step_s", "opt_s", "step_cpu_s", "opt_cpu_s", "exposed_s", "sent", "phases")


def rotation(n: int, step: int) -> list[int]:
    """The order in which the ``n`` variants run in ``step`` of an interleaved run: step ``k`` starts
    with variant ``k mod n`` and goes round, so every variant takes every position in turn."""
    if n < 1:
        raise ValueError(f"need at least one variant, got {n}")
    return [(step + i) % n for i in range(n)]


def _rss_peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


class _Rank:
    """What the runners of one process share: device, synchronization, and the dp x tp mesh
    (initialized once, on first use, for every canzona variant of a TP case)."""

    def __init__(self, rank: int, world: int, case: Case) -> None:
        import torch.distributed as dist

        self.rank, self.world, self.case = rank, world, case
        self.cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
        self.device = torch.device("cuda", rank % torch.cuda.device_count()) if self.cuda else torch.device("cpu")
        if self.cuda:
            torch.cuda.set_device(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._mesh: Any = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def align(self) -> None:
        """Before a timed step: the device idle and every rank here. Without the barrier a rank
        that finished the previous step's local work first (DDP's optimizer step has no collective
        after it) would wait in the next step's first collective, and in interleaved mode that
        wait would be charged to whichever variant runs next."""
        import torch.distributed as dist

        self.sync()
        if self.cuda:
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def mesh(self) -> Any:
        if self._mesh is None and self.case.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.case.dp, self.case.tp), mesh_dim_names=("dp", "tp"))
        return self._mesh

    def peak_mib(self, rss0: float) -> float:
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.cuda else _rss_peak_mib() - rss0


def _build(case: Case, device: torch.device, mesh: Any) -> tuple[nn.Module, Any]:
    """The model and a function batch(step, dp_rank) -> loss input."""
    if case.model == "stack":
        model = LinearStack(case.depth, case.width).to(device)

        def data(step: int, dp_rank: int) -> tuple[torch.Tensor, ...]:
            g = torch.Generator().manual_seed(1000 * step + dp_rank)
            return (torch.randn(case.batch, case.width, generator=g).to(device),)

        return model, data
    if case.model == "qwen3":
        from canzona.config import load_model_config
        from canzona.models import Qwen3, batch, parallelize

        cfg = load_model_config("qwen3-tiny")
        model = Qwen3(cfg, seed=0, device=device)
        if mesh is not None and case.tp > 1:
            parallelize(model, mesh["tp"])
        dp = case.dp if mesh is not None else case.world

        def data(step: int, dp_rank: int) -> tuple[torch.Tensor, ...]:
            ids, labels = batch(step, dp_rank, dp, case.batch, case.seq_len, 0, vocab=cfg.vocab_size)
            return ids.to(device), labels.to(device)

        return model, data
    raise ValueError(f"unknown model {case.model!r}")


def _is_matrix(name: str, p: torch.Tensor) -> bool:
    # torch's Muon takes 2-D parameters only; embeddings and heads stay with AdamW as in canzona
    return p.dim() == 2 and "embed" not in name and "lm_head" not in name


class DDPRunner:
    """``ddp``: its own model (the case's seed) in ``DistributedDataParallel`` over the whole world,
    ``torch.optim.Muon`` on the matrices and AdamW on the rest, on every rank."""

    def __init__(self, env: _Rank) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.env, case = env, env.case
        self.model, self.data = _build(case, env.device, None)
        self.params = sum(1 for _ in self.model.parameters())
        self.ddp = DDP(self.model, bucket_cap_mb=case.bucket_numel * 4 / 2**20,
                       device_ids=[env.device.index] if env.cuda else None)
        named = list(self.model.named_parameters())
        mats = [p for n, p in named if _is_matrix(n, p)]
        rest = [p for n, p in named if not _is_matrix(n, p)]
        self.opts: list[torch.optim.Optimizer] = [torch.optim.Muon(mats, lr=0.02, weight_decay=0.01)]
        if rest:
            self.opts.append(torch.optim.AdamW(rest, lr=1e-3))
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.ar_bytes = int(2 * (env.world - 1) * grad_bytes / env.world) if env.world > 1 else 0

    def _fwd_bwd(self, step: int) -> float:
        loss = _ddp_loss(self.ddp, self.env.case, self.data(step, self.env.rank))
        t = time.perf_counter()
        loss.backward()
        self.env.sync()
        return time.perf_counter() - t

    def step(self, step: int) -> dict[str, Any]:
        """One training step; its figures. The exposed communication is estimated in :meth:`finish`
        (NaN here)."""
        self.env.align()
        t0, c0 = time.perf_counter(), time.process_time()
        b = self._fwd_bwd(step)
        t1, c1 = time.perf_counter(), time.process_time()
        for o in self.opts:
            o.step()
        for o in self.opts:  # timed, as canzona's zero_grad() is
            o.zero_grad(set_to_none=True)
        self.env.sync()
        t2, c2 = time.perf_counter(), time.process_time()
        return {"step_s": t2 - t0, "opt_s": t2 - t1, "step_cpu_s": c2 - c0, "opt_cpu_s": c2 - c1,
                "exposed_s": float("nan"), "sent": self.ar_bytes, "phases": {}, "bwd_s": b}

    def finish(self, measured: dict[str, list[Any]]) -> dict[str, Any]:
        """The measured steps' figures completed: backward under ``no_sync()`` for as many steps,
        and exposed communication = median backward minus median backward without the all-reduce."""
        nosync: list[float] = []
        for step in range(len(measured["step_s"])):
            with self.ddp.no_sync():
                nosync.append(self._fwd_bwd(step))
            for o in self.opts:
                o.zero_grad(set_to_none=True)
        exposed = max(0.0, statistics.median(measured["bwd_s"]) - statistics.median(nosync)) if nosync else 0.0
        state = sum(t.numel() * t.element_size() for o in self.opts for st in o.state.values() for t in st.values()
                    if torch.is_tensor(t))
        return {**{k: measured[k] for k in STEP_KEYS}, "exposed_s": [exposed] * len(measured["step_s"]),
                "state_bytes": state, "params": self.params}


class CanzonaRunner:
    """A canzona variant: its own model (the case's seed) under :class:`canzona.DistributedOptimizer`
    (canzona's Muon, AdamW element-wise), at dp x tp on the shared mesh for a TP case."""

    def __init__(self, env: _Rank, variant: str) -> None:
        import canzona

        self.env, case = env, env.case
        mesh = env.mesh()
        self.dp_rank = mesh.get_local_rank("dp") if mesh is not None else env.rank
        self.model, self.data = _build(case, env.device, mesh)
        self.params = sum(1 for _ in self.model.parameters())
        views = not variant.endswith(COPY_SUFFIX)
        self.opt = canzona.DistributedOptimizer(
            self.model,
            "muon",
            strategy=variant.removesuffix(COPY_SUFFIX),
            mesh=mesh,
            optimizer_kwargs={"lr": 0.02, "weight_decay": 0.01},
            elementwise_kwargs={"lr": 1e-3},
            bucket_numel=case.bucket_numel,
            param_views=views,
            grad_views=views,
        )

    def step(self, step: int) -> dict[str, Any]:
        """One training step; its figures (exposed communication: the ``.../wait`` phases and the
        status exchanges)."""
        opt = self.opt
        opt.comm_stats.reset()
        opt.phase_times.reset()
        self.env.align()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = _loss(self.model, self.env.case, self.data(step, self.dp_rank))
        loss.backward()
        t1, c1 = time.perf_counter(), time.process_time()
        opt.step()
        opt.zero_grad()
        self.env.sync()
        t2, c2 = time.perf_counter(), time.process_time()
        times = opt.phase_times.as_dict()
        return {"step_s": t2 - t0, "opt_s": t2 - t1, "step_cpu_s": c2 - c0, "opt_cpu_s": c2 - c1,
                "exposed_s": sum(v["wall_s"] for k, v in times.items() if k.endswith("/wait") or k == STATUS),
                "sent": opt.comm_stats.total_sent(), "phases": {k: v["wall_s"] for k, v in times.items()}}

    def finish(self, measured: dict[str, list[Any]]) -> dict[str, Any]:
        return {**{k: measured[k] for k in STEP_KEYS}, "state_bytes": self.opt.state_bytes(), "params": self.params}


def make_runner(env: _Rank, variant: str) -> DDPRunner | CanzonaRunner:
    if not known_variant(variant):
        raise ValueError(f"unknown variant {variant!r}")
    return DDPRunner(env) if variant == "ddp" else CanzonaRunner(env, variant)


def _train(runners: dict[str, DDPRunner | CanzonaRunner], case: Case, interleave: bool) -> dict[str, dict[str, Any]]:
    """``case.warmup`` + ``case.steps`` steps of every runner: one after another (each runner all
    its steps), or interleaved (every step, each runner once, in :func:`rotation` order). Every
    rank runs the same order, so the variants' collectives are issued in the same order."""
    names = list(runners)
    measured: dict[str, dict[str, list[Any]]] = {v: {} for v in names}

    def one(v: str, step: int) -> None:
        fig = runners[v].step(step)
        if step >= case.warmup:
            for k, x in fig.items():
                measured[v].setdefault(k, []).append(x)

    if interleave:
        for step in range(case.warmup + case.steps):
            for i in rotation(len(names), step):
                one(names[i], step)
    else:
        for v in names:
            for step in range(case.warmup + case.steps):
                one(v, step)
    return {v: runners[v].finish(measured[v]) for v in names}


def vs_torch_worker(rank: int, world: int, case: Case, variant: str) -> dict[str, Any]:
    """Train ``case`` with ``variant`` alone on this rank; returns its per-step figures and the
    rank's peak memory (the variant's own)."""
    env = _Rank(rank, world, case)
    rss0 = _rss_peak_mib()
    out = _train({variant: make_runner(env, variant)}, case, interleave=False)[variant]
    return {"rank": rank, **out, "peak_mib": env.peak_mib(rss0)}


def interleaved_worker(rank: int, world: int, case: Case) -> dict[str, Any]:
    """Every variant of ``case`` in this one process, steps interleaved; per variant the same
    figures as :func:`vs_torch_worker` but ``peak_mib`` NaN (the rank's peak, ``all_peak_mib``,
    holds every variant's model and state together)."""
    env = _Rank(rank, world, case)
    rss0 = _rss_peak_mib()
    runners = {v: make_runner(env, v) for v in case.variants}
    out = _train(runners, case, interleave=True)
    peak = env.peak_mib(rss0)
    return {"rank": rank, "variants": {v: {"rank": rank, **figs, "peak_mib": float("nan")} for v, figs in out.items()},
            "all_peak_mib": peak}


def _loss(model: nn.Module, case: Case, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return model.loss(*inputs)  # type: ignore[operator]


def _ddp_loss(ddp: nn.Module, case: Case, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    # DDP's reducer hooks fire only for a forward run through the wrapper
    if case.model == "qwen3":
        ids, labels = inputs
        logits = ddp(ids)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
    return ddp(*inputs).square().mean()


# ----------------------------------------------------------------------------------- driver side


MODES = ("interleaved", "separate")


def run_case(case: Case, *, backend: str = "gloo", timeout_s: float = 900.0, mode: str = "interleaved") -> list[VariantResult]:
    """Run every variant of ``case`` and summarize: ``interleaved`` (one set of ``world`` processes
    holds every variant and runs them step by step in turn, so all see the same load; peak memory
    per variant is NaN) or ``separate`` (each variant in fresh processes, one after another, with
    its own peak memory)."""
    from canzona.runtime.launch import run_workers

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "interleaved":
        per_rank = run_workers(interleaved_worker, case.world, case, backend=backend, timeout_s=timeout_s)
        all_peak = max(float(r["all_peak_mib"]) for r in per_rank)
        out = [summarize(case, v, [r["variants"][v] for r in per_rank], mode=mode, all_peak_mib=all_peak) for v in case.variants]
    else:
        out = []
        for v in case.variants:
            per_rank = run_workers(vs_torch_worker, case.world, case, v, backend=backend, timeout_s=timeout_s)
            out.append(summarize(case, v, per_rank))
    add_ratios(out)
    return out


def summarize(case: Case, variant: str, per_rank: Sequence[dict[str, Any]], *, mode: str = "separate",
              all_peak_mib: float | None = None) -> VariantResult:
    """Slowest rank per step, then the median over steps; bytes summed over ranks. ``all_peak_mib``:
    the peak of the processes (every variant's together in interleaved mode; the variant's own by
    default)."""
    n = len(per_rank[0]["step_s"])

    def med_of_max(key: str) -> float:
        return statistics.median(max(r[key][i] for r in per_rank) for i in range(n)) * 1e3

    peak = max(float(r["peak_mib"]) for r in per_rank)
    return VariantResult(
        case=case.name,
        variant=variant,
        world=case.world,
        step_ms=med_of_max("step_s"),
        optimizer_ms=med_of_max("opt_s"),
        step_cpu_ms=med_of_max("step_cpu_s"),
        optimizer_cpu_ms=med_of_max("opt_cpu_s"),
        exposed_comm_ms=med_of_max("exposed_s"),
        bytes_per_step=int(statistics.median(sum(r["sent"][i] for r in per_rank) for i in range(n))),
        peak_mib=peak,
        params=int(per_rank[0]["params"]),
        phases=_phase_medians(per_rank),
        state_bytes=max(int(r["state_bytes"]) for r in per_rank),
        mode=mode,
        all_peak_mib=peak if all_peak_mib is None else all_peak_mib,
    )


def _phase_medians(per_rank: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Per phase, each rank's median wall ms over the measured steps (0 for steps without it)."""
    keys = sorted({k for r in per_rank for step in r.get("phases", ()) for k in step})
    return {
        k: [statistics.median(step.get(k, 0.0) for step in r["phases"]) * 1e3 if r.get("phases") else 0.0 for r in per_rank]
        for k in keys
    }


def format_phases(results: Sequence[VariantResult], *, title: str) -> str:
    """canzona's phase wall times (ms per step, median over steps) per variant and rank."""
    lines = [title]
    for r in results:
        if not r.phases:
            continue
        lines.append(f"  {r.variant}")
        for k, per_rank in r.phases.items():
            lines.append(f"    {k:44s} " + " ".join(f"{v:8.2f}" for v in per_rank))
    return "\n".join(lines)


def median_of_runs(runs: Sequence[Sequence[VariantResult]]) -> list[VariantResult]:
    """Several runs of the same variants (in the same order, the same mode) folded into one: every
    figure is the median over the runs (per rank for phases), so alternating runs of two variants
    compare them under the same drifting load. Ratios are recomputed; a NaN figure (peak memory in
    interleaved mode) stays NaN."""
    out = []
    for run in runs:
        add_ratios(list(run))  # each run's own ratios (run_ratios below)
    for same in zip(*runs):
        first = same[0]
        if any(r.variant != first.variant for r in same):
            raise ValueError("runs hold different variants")
        if any(r.mode != first.mode for r in same):
            raise ValueError("runs were made in different modes")

        def med(attr: str, same: Sequence[VariantResult] = same) -> float:
            xs = [getattr(r, attr) for r in same]
            return float("nan") if any(math.isnan(x) for x in xs) else statistics.median(xs)

        keys = sorted({k for r in same for k in r.phases})
        ranks = max((len(v) for r in same for v in r.phases.values()), default=0)
        phases = {k: [statistics.median(r.phases[k][i] if k in r.phases else 0.0 for r in same) for i in range(ranks)] for k in keys}
        out.append(VariantResult(
            case=first.case, variant=first.variant, world=first.world, step_ms=med("step_ms"), optimizer_ms=med("optimizer_ms"),
            step_cpu_ms=med("step_cpu_ms"), optimizer_cpu_ms=med("optimizer_cpu_ms"), exposed_comm_ms=med("exposed_comm_ms"),
            bytes_per_step=int(med("bytes_per_step")), peak_mib=med("peak_mib"), params=first.params, phases=phases,
            state_bytes=int(med("state_bytes")), mode=first.mode, all_peak_mib=med("all_peak_mib"),
            run_ratios={k: [r.ratios[k] for r in same] for k in ("step", "step_cpu") if all(k in r.ratios for r in same)},
        ))
    add_ratios(out)
    return out


def ideal_ratio(ddp: VariantResult, world: int) -> tuple[float, float]:
    """(wall, CPU) fraction of DDP's step that perfect partitioning would take on this model and
    machine: DDP's own forward-backward (step minus optimizer) plus 1/``world`` of its optimizer.
    A strategy that keeps DDP's forward-backward cannot go below it."""

    def bound(step: float, opt: float) -> float:
        return (step - opt + opt / world) / step if step > 0 else float("nan")

    return bound(ddp.step_ms, ddp.optimizer_ms), bound(ddp.step_cpu_ms, ddp.optimizer_cpu_ms)


def add_ratios(results: list[VariantResult], baseline: str = "ddp") -> None:
    """Fill each result's ``ratios`` (step, optimizer, peak memory) against ``baseline``."""
    base = next((r for r in results if r.variant == baseline), None)
    if base is None:
        return
    for r in results:
        r.ratios = {
            "step": r.step_ms / base.step_ms if base.step_ms else float("nan"),
            "optimizer": r.optimizer_ms / base.optimizer_ms if base.optimizer_ms else float("nan"),
            "step_cpu": r.step_cpu_ms / base.step_cpu_ms if base.step_cpu_ms else float("nan"),
            "peak": r.peak_mib / base.peak_mib if base.peak_mib else float("nan"),
        }


def format_table(results: Sequence[VariantResult], *, title: str) -> str:
    """One line per variant; where peak memory is not per variant (interleaved mode) the column
    reads ``n/a`` and a footer gives the shared peak."""
    nan = float("nan")
    lines = [title, f"  {'variant':14s} {'step ms':>9s} {'x DDP':>6s} {'optim ms':>9s} {'x DDP':>6s} {'step CPU ms':>11s} "
             f"{'x DDP':>6s} {'optim CPU':>9s} {'exposed ms':>10s} {'KiB/step':>9s} {'peak MiB':>9s} {'us/param':>9s} {'CPU us/p':>9s}"]
    for r in results:
        peak = "n/a" if math.isnan(r.peak_mib) else f"{r.peak_mib:.1f}"
        lines.append(
            f"  {r.variant:14s} {r.step_ms:9.2f} {r.ratios.get('step', nan):6.2f} {r.optimizer_ms:9.2f} "
            f"{r.ratios.get('optimizer', nan):6.2f} {r.step_cpu_ms:11.2f} {r.ratios.get('step_cpu', nan):6.2f} "
            f"{r.optimizer_cpu_ms:9.2f} {r.exposed_comm_ms:10.2f} {r.bytes_per_step / 1024:9.1f} "
            f"{peak:>9s} {1e3 * r.step_ms / max(1, r.params):9.1f} {1e3 * r.step_cpu_ms / max(1, r.params):9.1f}"
        )
    spread = [r for r in results if r.variant != "ddp" and len(r.run_ratios.get("step", ())) > 1]
    if spread:
        lines.append("  x DDP step time in each run, wall / CPU: " + "; ".join(
            f"{r.variant} " + ", ".join(f"{w:.2f} / {c:.2f}" for w, c in zip(r.run_ratios["step"], r.run_ratios["step_cpu"]))
            for r in spread))
    shared = [r for r in results if math.isnan(r.peak_mib)]
    if shared:
        together = max(r.all_peak_mib for r in shared)
        lines.append(f"  peak MiB n/a: the variants ran interleaved in the same processes, which peaked at {together:.1f} MiB "
                     "per rank with every variant together; --mode separate measures each variant's own")
    return "\n".join(lines)


def as_dicts(results: Sequence[VariantResult]) -> list[dict[str, Any]]:
    """The results as plain dicts for JSON; NaN figures (peak memory in interleaved mode) become None."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and math.isnan(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return [clean(asdict(r)) for r in results]
