"""Canzona against the ordinary way: torch DDP + ``torch.optim.Muon`` on every rank.

One :class:`Case` is a model, a world size and a mesh; every variant of a case trains the same
model on the same data in its own set of ``world`` processes (so peak memory is per variant):

- ``ddp``: ``DistributedDataParallel`` (all-reduce of gradients, bucketed and overlapped with
  backward) and ``torch.optim.Muon`` over every matrix parameter (AdamW over the others) on every
  rank: each rank computes every update;
- ``sc``, ``layerwise``, ``asc``, ``lb-asc``: :class:`canzona.DistributedOptimizer` with canzona's
  Muon (AdamW for element-wise parameters). A ``/copy`` suffix (``lb-asc/copy``) builds it with
  ``param_views=False, grad_views=False``: the parameter and gradient copies the views remove
  (docs/runtime.md), for measuring them side by side.

Per variant and rank, per measured step: the step's wall time (forward + backward + optimizer,
slowest rank, median over steps), the optimizer time (``step()``, which for canzona includes
returning the updated values), the exposed communication and the bytes sent, and the peak memory
of the rank. *Exposed communication* is time the host spent blocked on a collective:

- canzona: the wall time of every ``.../wait`` phase range (``PhaseTimer`` keeps them apart);
- DDP: backward with gradient synchronization minus backward under ``no_sync()`` (extra steps
  measured for that purpose only), i.e. the all-reduce time backward could not hide.

CPU time: the same step and optimizer spans in process CPU seconds (``time.process_time``: every
thread of the rank, gloo's included). On a machine with fewer cores than busy threads, wall time
mostly measures the scheduler; CPU time still measures the work each rank does.

Bytes are logical point-to-point volumes (:mod:`canzona.runtime.comm`): counted for canzona, and
for DDP computed with the same formula for its all-reduce (2 (R-1)/R of the gradient bytes per rank).
Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA; on CPU the growth of the process's peak
resident set (``ru_maxrss``) from just before the model is built, which also holds allocator slack.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "COPY_SUFFIX",
    "VARIANTS",
    "Case",
    "LinearStack",
    "VariantResult",
    "format_phases",
    "format_table",
    "known_variant",
    "median_of_runs",
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


# ----------------------------------------------------------------------------------- worker side


def _rss_peak_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


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


def vs_torch_worker(rank: int, world: int, case: Case, variant: str) -> dict[str, Any]:
    """Train ``case`` with ``variant`` on this rank; returns its per-step figures."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    rss0 = _rss_peak_mib()
    mesh = None
    dp_rank = rank
    if variant != "ddp" and case.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (case.dp, case.tp), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_local_rank("dp")
    model, data = _build(case, device, mesh)
    n_params = sum(1 for _ in model.parameters())

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    step_s: list[float] = []
    opt_s: list[float] = []
    step_cpu: list[float] = []
    opt_cpu: list[float] = []
    bwd_s: list[float] = []
    exposed_s: list[float] = []
    sent: list[int] = []
    phases: list[dict[str, float]] = []
    if variant == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=case.bucket_numel * 4 / 2**20, device_ids=[device.index] if cuda else None)
        named = list(model.named_parameters())
        mats = [p for n, p in named if _is_matrix(n, p)]
        rest = [p for n, p in named if not _is_matrix(n, p)]
        opts: list[torch.optim.Optimizer] = [torch.optim.Muon(mats, lr=0.02, weight_decay=0.01)]
        if rest:
            opts.append(torch.optim.AdamW(rest, lr=1e-3))
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        ar_bytes = int(2 * (world - 1) * grad_bytes / world) if world > 1 else 0

        def fwd_bwd(step: int) -> float:
            loss = _ddp_loss(ddp, case, data(step, rank))
            t = time.perf_counter()
            loss.backward()
            sync()
            return time.perf_counter() - t

        nosync_bwd: list[float] = []
        for step in range(case.warmup + case.steps):
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            b = fwd_bwd(step)
            t1, c1 = time.perf_counter(), time.process_time()
            for o in opts:
                o.step()
            sync()
            t2, c2 = time.perf_counter(), time.process_time()
            for o in opts:
                o.zero_grad(set_to_none=True)
            if step >= case.warmup:
                step_s.append(t2 - t0)
                opt_s.append(t2 - t1)
                step_cpu.append(c2 - c0)
                opt_cpu.append(c2 - c1)
                bwd_s.append(b)
                sent.append(ar_bytes)
        # backward without the all-reduce, for the exposed-communication estimate
        for step in range(case.steps):
            with ddp.no_sync():
                nosync_bwd.append(fwd_bwd(step))
            for o in opts:
                o.zero_grad(set_to_none=True)
        exposed = max(0.0, statistics.median(bwd_s) - statistics.median(nosync_bwd))
        exposed_s = [exposed] * len(step_s)
        state = sum(t.numel() * t.element_size() for o in opts for st in o.state.values() for t in st.values() if torch.is_tensor(t))
    else:
        import canzona

        views = not variant.endswith(COPY_SUFFIX)
        opt = canzona.DistributedOptimizer(
            model,
            "muon",
            strategy=variant.removesuffix(COPY_SUFFIX),
            mesh=mesh,
            optimizer_kwargs={"lr": 0.02, "weight_decay": 0.01},
            elementwise_kwargs={"lr": 1e-3},
            bucket_numel=case.bucket_numel,
            param_views=views,
            grad_views=views,
        )
        for step in range(case.warmup + case.steps):
            opt.comm_stats.reset()
            opt.phase_times.reset()
            sync()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = _loss(model, case, data(step, dp_rank))
            loss.backward()
            t1, c1 = time.perf_counter(), time.process_time()
            opt.step()
            opt.zero_grad()
            sync()
            t2, c2 = time.perf_counter(), time.process_time()
            if step >= case.warmup:
                times = opt.phase_times.as_dict()
                step_s.append(t2 - t0)
                opt_s.append(t2 - t1)
                step_cpu.append(c2 - c0)
                opt_cpu.append(c2 - c1)
                exposed_s.append(sum(v["wall_s"] for k, v in times.items() if k.endswith("/wait")))
                phases.append({k: v["wall_s"] for k, v in times.items()})
                sent.append(opt.comm_stats.total_sent())
        state = opt.state_bytes()
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else _rss_peak_mib() - rss0
    return {
        "rank": rank,
        "step_s": step_s,
        "opt_s": opt_s,
        "step_cpu_s": step_cpu,
        "opt_cpu_s": opt_cpu,
        "exposed_s": exposed_s,
        "sent": sent,
        "peak_mib": peak,
        "state_bytes": state,
        "params": n_params,
        "phases": phases,
    }


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


def run_case(case: Case, *, backend: str = "gloo", timeout_s: float = 900.0) -> list[VariantResult]:
    """Run every variant of ``case`` (each in fresh processes) and summarize."""
    from canzona.runtime.launch import run_workers

    out = []
    for v in case.variants:
        per_rank = run_workers(vs_torch_worker, case.world, case, v, backend=backend, timeout_s=timeout_s)
        out.append(summarize(case, v, per_rank))
    add_ratios(out)
    return out


def summarize(case: Case, variant: str, per_rank: Sequence[dict[str, Any]]) -> VariantResult:
    """Slowest rank per step, then the median over steps; bytes summed over ranks."""
    n = len(per_rank[0]["step_s"])

    def med_of_max(key: str) -> float:
        return statistics.median(max(r[key][i] for r in per_rank) for i in range(n)) * 1e3

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
        peak_mib=max(float(r["peak_mib"]) for r in per_rank),
        params=int(per_rank[0]["params"]),
        phases=_phase_medians(per_rank),
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
    """Several runs of the same variants (in the same order) folded into one: every figure is the
    median over the runs (per rank for phases), so alternating runs of two variants compare them
    under the same drifting load. Ratios are recomputed."""
    out = []
    for same in zip(*runs):
        first = same[0]
        if any(r.variant != first.variant for r in same):
            raise ValueError("runs hold different variants")

        def med(attr: str, same: Sequence[VariantResult] = same) -> float:
            return statistics.median(getattr(r, attr) for r in same)

        keys = sorted({k for r in same for k in r.phases})
        ranks = max((len(v) for r in same for v in r.phases.values()), default=0)
        phases = {k: [statistics.median(r.phases[k][i] if k in r.phases else 0.0 for r in same) for i in range(ranks)] for k in keys}
        out.append(VariantResult(
            case=first.case, variant=first.variant, world=first.world, step_ms=med("step_ms"), optimizer_ms=med("optimizer_ms"),
            step_cpu_ms=med("step_cpu_ms"), optimizer_cpu_ms=med("optimizer_cpu_ms"), exposed_comm_ms=med("exposed_comm_ms"),
            bytes_per_step=int(med("bytes_per_step")), peak_mib=med("peak_mib"), params=first.params, phases=phases,
        ))
    add_ratios(out)
    return out


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
    nan = float("nan")
    lines = [title, f"  {'variant':14s} {'step ms':>9s} {'x DDP':>6s} {'optim ms':>9s} {'x DDP':>6s} {'step CPU ms':>11s} "
             f"{'x DDP':>6s} {'optim CPU':>9s} {'exposed ms':>10s} {'KiB/step':>9s} {'peak MiB':>9s} {'us/param':>9s} {'CPU us/p':>9s}"]
    for r in results:
        lines.append(
            f"  {r.variant:14s} {r.step_ms:9.2f} {r.ratios.get('step', nan):6.2f} {r.optimizer_ms:9.2f} "
            f"{r.ratios.get('optimizer', nan):6.2f} {r.step_cpu_ms:11.2f} {r.ratios.get('step_cpu', nan):6.2f} "
            f"{r.optimizer_cpu_ms:9.2f} {r.exposed_comm_ms:10.2f} {r.bytes_per_step / 1024:9.1f} "
            f"{r.peak_mib:9.1f} {1e3 * r.step_ms / max(1, r.params):9.1f} {1e3 * r.step_cpu_ms / max(1, r.params):9.1f}"
        )
    return "\n".join(lines)


def as_dicts(results: Sequence[VariantResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
