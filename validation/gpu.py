"""GPU checks of the CUDA / NCCL path: exactness cells, uneven collectives, stream ordering,
host syncs in the step, Newton-Schulz throughput and the overlap of a step.

Used by ``tests/test_gpu.py`` (skipped without CUDA) and by ``profiling/gpu_check.py`` (one
command on a GPU machine). Every worker runs under :func:`canzona.runtime.launch.run_workers` with
``backend="nccl"``, one GPU per rank (NCCL refuses two ranks on one device), so the multi-rank
checks need as many GPUs as ranks; :func:`cells_for` says which fit.

Written without access to a GPU: none of this has run on CUDA yet (see README, "GPU check").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "EXACTNESS_CASES",
    "cells_for",
    "exactness_worker",
    "host_sync_worker",
    "ns_tflops",
    "overlap_fraction",
    "overlap_worker",
    "reference_params",
    "stream_order_worker",
    "tp_engine_worker",
    "uneven_collectives_worker",
]

STEPS = 3
MATRIX_KW = {"lr": 0.05}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}
#: (strategy, matrix optimizer): the cells of the DP exactness check on NCCL
EXACTNESS_CASES: tuple[tuple[str, str], ...] = (("lb-asc", "muon"), ("asc", "shampoo"), ("sc", "muon"), ("layerwise", "soap"), ("zero1", "adamw"))


def cells_for(n_gpus: int) -> list[int]:
    """World sizes of the NCCL cells that fit ``n_gpus`` (one GPU per rank)."""
    return [w for w in (1, 2, 4) if w <= n_gpus]


def _device(rank: int) -> torch.device:
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _cls(name: str) -> type[torch.optim.Optimizer]:
    from canzona.optim import SOAP, Muon, Shampoo

    return {"adamw": torch.optim.AdamW, "muon": Muon, "shampoo": Shampoo, "soap": SOAP}[name]


# ------------------------------------------------------------------------------- exactness


def exactness_worker(rank: int, world: int, bucket_numel: int = 40) -> dict[str, Any]:
    """Every :data:`EXACTNESS_CASES` strategy on the toy model, integer gradients injected through
    backward hooks, parameters on this rank's GPU; returns the final parameters (on CPU)."""
    import canzona
    from validation.harness import ToyModel, inject_grads, integer_grads, params_of

    dev = _device(rank)
    out: dict[str, Any] = {}
    for strategy, optname in EXACTNESS_CASES:
        model = ToyModel().to(dev)
        opt = canzona.DistributedOptimizer(
            model, _cls(optname), strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=bucket_numel
        )
        for s in range(STEPS):
            grads = {n: g.to(dev) for n, g in integer_grads(model, step=s, rank=rank).items()}
            inject_grads(model, grads)
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize(dev)
        out[f"{strategy}/{optname}"] = {n: t.cpu() for n, t in params_of(model).items()}
    return out


def reference_params(world: int, device: str | torch.device = "cuda") -> dict[str, dict[str, torch.Tensor]]:
    """The single-device runs the cells must equal bitwise (same device type, one process)."""
    from validation.harness import ReferenceRunner, ToyModel, integer_grads, mean_grads

    out = {}
    for strategy, optname in EXACTNESS_CASES:
        model = ToyModel().to(device)
        ref = ReferenceRunner(model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1")
        for s in range(STEPS):
            grads = mean_grads([integer_grads(model, step=s, rank=r) for r in range(world)])
            ref.step({n: g.to(device) for n, g in grads.items()})
        out[f"{strategy}/{optname}"] = {n: t.cpu() for n, t in ref.params().items()}
    return out


# ------------------------------------------------------------------------------- collectives


def uneven_collectives_worker(rank: int, world: int) -> dict[str, Any]:
    """Uneven all-gather (list form on NCCL), uneven reduce-scatter and all-to-all with split sizes
    into a caller's buffer, async, on CUDA tensors; returns what arrived (on CPU) and the byte counts."""
    from canzona.runtime.comm import Comm

    dev = _device(rank)
    comm = Comm(None)
    sizes = [r + 2 if r % 2 == 0 else 0 for r in range(world)]  # zeros included
    sizes[-1] += 3
    local = torch.arange(sizes[rank], dtype=torch.float32, device=dev) + 100 * rank
    gathered, w = comm.all_gather_v(local, sizes, async_op=True)
    if w is not None:
        w.wait()
    flat = torch.arange(sum(sizes), dtype=torch.float32, device=dev) * (rank + 1)
    shard, w = comm.reduce_scatter_v(flat, sizes, async_op=True)
    if w is not None:
        w.wait()
    send_sizes = [(rank + j) % 3 for j in range(world)]
    recv_sizes = [(j + rank) % 3 for j in range(world)]
    send = torch.arange(sum(send_sizes), dtype=torch.float32, device=dev) + 1000 * rank
    buf = torch.full((sum(recv_sizes),), float("nan"), device=dev)
    got, w = comm.all_to_all_v(send, send_sizes, recv_sizes, out=buf, async_op=True)
    if w is not None:
        w.wait()
    return {
        "gathered": gathered.cpu(),
        "shard": shard.cpu(),
        "a2a": got.cpu(),
        "a2a_in_place": got.data_ptr() == buf.data_ptr(),
        "sizes": sizes,
        "send_sizes": send_sizes,
        "stats": comm.stats.as_dict(),
    }


def stream_order_worker(rank: int, world: int, numel: int = 1 << 24) -> dict[str, Any]:
    """``work.wait()`` on NCCL must order the *current stream* after the collective without a host
    sync: a kernel queued right after the wait reads the landed data. The receive buffer starts as
    NaN and the check kernel is queued before any host synchronization, so a missing stream
    dependency shows as NaN or a wrong sum. Then the TP engine's two reserved slots are reused by
    many micro-groups in a row (the pipelined schedule) and compared with a single-device run."""
    from canzona.runtime.comm import Comm

    dev = _device(rank)
    comm = Comm(None)
    per = numel // world
    send = torch.full((per * world,), float(rank + 1), device=dev)
    out = torch.full((per * world,), float("nan"), device=dev)
    # make the collective slow enough to be caught in flight: queue it behind a busy kernel
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(8):
        a = a @ a
        a = a / a.norm()
    _, w = comm.all_to_all_v(send, [per] * world, [per] * world, out=out, async_op=True)
    w.wait()  # stream dependency only
    total = out.sum()  # queued on the current stream, after the wait
    torch.cuda.synchronize(dev)
    want = float(per * sum(range(1, world + 1)))
    return {"sum": float(total), "want": want, "nan": bool(torch.isnan(out).any())}


def tp_engine_worker(rank: int, world: int, cmax: int = 50_000) -> dict[str, Any]:
    """The pipelined TP engine on NCCL (tp = world, dp 1, many micro-groups) against a single-device
    Muon on the full tensors; returns whether every shard matches bitwise."""
    import zlib

    from canzona.config import load_model_config
    from canzona.models import Qwen3
    from canzona.optim import Muon
    from canzona.plan import PlanInputs, make_plan
    from canzona.runtime.comm import Comm
    from canzona.runtime.tp import TPEngine
    from canzona.specs import specs_from_config

    dev = _device(rank)
    cfg = load_model_config("qwen3-tiny")
    plan = make_plan(
        specs_from_config(cfg, tp=world, layout="hf"),
        PlanInputs(model=cfg.name, layout="hf", dp=1, tp=world, optimizer="muon", strategy="lb-asc",
                   tp_schedule="lpt", bucket_numel=20_000, cmax_bytes=cmax),
    )
    full = {n: p.detach().to(dev) for n, p in Qwen3(cfg, seed=5).named_parameters()}
    mine = [p for p in plan.params if p.spec.kind == "matrix" and p.spec.tp_split]
    local = {p.name: full[p.name].chunk(world, dim=p.spec.tp_dim)[rank].clone() for p in mine}

    def factory(ps: list[torch.Tensor]) -> torch.optim.Optimizer:
        return Muon(ps, lr=0.02, weight_decay=0.01)

    engine = TPEngine(plan, dp_rank=0, comm=Comm(None), optimizer_factory=factory, local_masters=local)
    ref = {p.name: torch.nn.Parameter(full[p.name].clone()) for p in mine}
    ref_opt = factory(list(ref.values()))

    def grad(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
        return (torch.randint(-8, 8, shape, generator=gen).to(torch.float32) * 2.0**-4).to(dev)

    for step in range(STEPS):
        engine.step({p.name: grad(p.name, p.spec.shape, step).chunk(world, dim=p.spec.tp_dim)[rank].contiguous() for p in mine})
        for p in mine:
            ref[p.name].grad = grad(p.name, p.spec.shape, step)
        ref_opt.step()
    torch.cuda.synchronize(dev)
    bad = [p.name for p in mine if not torch.equal(local[p.name], ref[p.name].detach().chunk(world, dim=p.spec.tp_dim)[rank])]
    return {"groups": len(engine.groups), "mismatched": bad}


# ------------------------------------------------------------------------------- host syncs


def host_sync_worker(rank: int, world: int, strategy: str = "lb-asc") -> dict[str, Any]:
    """Count the host synchronizations of one optimizer step (``torch.cuda.set_sync_debug_mode``
    warns on each). The finiteness check of a matrix optimizer reads one flag per ``step()`` call
    (one call per bucket with owned parameters, one per TP micro-group hosted); anything else in
    the hot path (``.item()``, ``bool(tensor)``, a CPU copy) adds to the count."""
    import warnings

    import canzona
    from validation.harness import ToyModel, inject_grads, integer_grads

    dev = _device(rank)
    model = ToyModel().to(dev)
    opt = canzona.DistributedOptimizer(model, "muon", strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)
    calls = 0

    def count(*_a: Any, **_k: Any) -> None:
        nonlocal calls
        calls += 1

    hooks = [o.register_step_pre_hook(count) for o in opt.runtime.optimizers()]
    counts = []
    for s in range(STEPS):
        inject_grads(model, {n: g.to(dev) for n, g in integer_grads(model, step=s, rank=rank).items()})
        torch.cuda.synchronize(dev)
        calls = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
        syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
        counts.append({"syncs": len(syncs), "optimizer_steps": calls, "first": syncs[:3]})
    for h in hooks:
        h.remove()
    return {"steps": counts[1:]}  # step 0 creates optimizer state


# ------------------------------------------------------------------------------- throughput, overlap


def ns_tflops(rows: Sequence[tuple[str, int, int, str, float]]) -> list[dict[str, float]]:
    """TFLOP/s of Muon steps from :func:`canzona.sim.measure.measure_matrix_timings` rows
    (``optimizer, m, n, dtype, seconds``): Newton-Schulz dominates, 5 iterations of
    ``X X^T`` (2 s^2 b), ``A A`` (2 s^3) and ``(.) X`` (2 s^2 b) flops, s the small side, b the big."""
    out = []
    for _opt, m, n, _dt, sec in rows:
        small, big = min(m, n), max(m, n)
        flops = 5 * (4 * small * small * big + 2 * small**3)
        out.append({"m": m, "n": n, "seconds": sec, "tflops": flops / sec / 1e12 if sec > 0 else float("nan")})
    return out


def overlap_fraction(intervals_comm: Sequence[tuple[float, float]], intervals_compute: Sequence[tuple[float, float]]) -> float:
    """Share of the communication kernels' time during which a compute kernel also runs."""

    def merge(iv: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
        out: list[tuple[float, float]] = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    comm, comp = merge(intervals_comm), merge(intervals_compute)
    total = sum(e - s for s, e in comm)
    if total <= 0:
        return 0.0
    both, j = 0.0, 0
    for s, e in comm:
        while j < len(comp) and comp[j][1] <= s:
            j += 1
        k = j
        while k < len(comp) and comp[k][0] < e:
            both += max(0.0, min(e, comp[k][1]) - max(s, comp[k][0]))
            k += 1
    return both / total


def overlap_worker(rank: int, world: int, steps: int = 4, trace_dir: str = "") -> dict[str, Any]:
    """Train the tiny Qwen3 with lb-asc (dp = world) under the profiler with CUDA activity; returns
    the step time and the share of NCCL kernel time overlapped by compute kernels on this rank."""
    import json
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    import canzona
    from canzona.config import load_model_config
    from canzona.models import Qwen3, batch

    dev = _device(rank)
    cfg = load_model_config("qwen3-tiny")
    model = Qwen3(cfg, seed=0, device=dev)
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", bucket_numel=200_000)
    times = []

    def one(step: int) -> None:
        ids, labels = batch(step, rank, world, 8, 64, 0, vocab=cfg.vocab_size)
        model.loss(ids.to(dev), labels.to(dev)).backward()
        opt.step()
        opt.zero_grad()

    one(0)
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for s in range(1, steps + 1):
            t0 = time.perf_counter()
            one(s)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
    path = Path(trace_dir or tempfile.mkdtemp()) / f"overlap{rank}.json"
    prof.export_chrome_trace(str(path))
    kernels = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"]
    comm = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels if "nccl" in e["name"].lower()]
    comp = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels if "nccl" not in e["name"].lower()]
    return {
        "step_ms": statistics.median(times) * 1e3,
        "comm_ms": sum(e - s for s, e in comm) / 1e3 / steps,
        "overlap": overlap_fraction(comm, comp),
        "exposed_wait_ms": sum(v["wall_s"] for k, v in opt.phase_times.as_dict().items() if k.endswith("/wait")) * 1e3 / (steps + 1),
    }
