"""Canzona on FSDP2 beside microsoft/dion's distributed Muon and muon-fsdp2, in one run (gloo, CPU).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python profiling/bench_fsdp2.py --peers dion,muon-fsdp2
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python profiling/bench_fsdp2.py --peers dion --worlds 2 --repeat 3
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python profiling/bench_fsdp2.py --peers none --phases   # canzona only
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python profiling/bench_fsdp2.py --peers dion --exchange ns-input,gradients
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python profiling/bench_fsdp2.py --peers dion --tiny 500 --ns shared --strategies lb-asc

The peers are benchmark-only installs, never canzona dependencies (docs/profiling.md, "Peers"):
dion is not on the package index (``git clone https://github.com/microsoft/dion`` and
``pip install --no-deps -e dion``); muon-fsdp2 is (``pip install --no-deps muon-fsdp2``). A
peer that cannot be imported is reported in one line and the rest still runs; muon-fsdp2 then
falls back to a labelled re-implementation of its scheme.

The model is a transformers ``LlamaForCausalLM`` (default hidden 256, 4 layers, 8 heads of 32
with 4 KV heads, MLP 768, vocabulary 2048, untied head), sharded with ``fully_shard`` per layer
and at the root on a 1-D ``dp_shard`` mesh. Every contender is its own copy of the model with the
same initial weights and gets the same gradients (drawn once per parameter, the same full tensor
on every rank, each rank given its FSDP2 piece as ``p.grad``). Only ``optimizer.step()`` is timed,
between two barriers (the wall time is the slowest rank's); contenders alternate step by step in
a rotating order, so a change of the machine's load hits all of them alike.

Contenders: ``canzona lb-asc`` (hosts balanced by Muon FLOPs), ``canzona asc`` (round-robin hosts),
``canzona sc`` (every rank computes every update); ``dion`` (``dion.Muon`` on the shard mesh:
momentum on the shards, same-shape matrices stacked into one all-to-all each way in bfloat16,
a batched orthogonalization on the host; AdamW for the rest) and ``muon-fsdp2`` (per matrix a
gather to one rank and a scatter back). Each peer runs twice: with its own Newton-Schulz (dion:
Polar Express, ``torch.compile``d, compiled during the warm-up; muon-fsdp2: its compiled quintic
loop) and with the *shared* one, canzona's :func:`canzona.optim.muon.newton_schulz` (bfloat16,
one matrix at a time), which canzona always uses. The two tables (own NS, shared NS) separate
the schedule from the arithmetic. The peers are configured with canzona's Muon hyperparameters
where they have them (momentum 0.95 with Nesterov, weight decay 0.1); their momentum convention
(``m = mu m + g``) and lr scaling differ from canzona's (torch's), which changes no cost.

Printed per contender: step wall time (median and fastest of the timed steps, each the slowest
rank's), the slowest rank's main-thread CPU during ``step()`` (median over steps), the whole
process's CPU (gloo's threads included; max over ranks), bytes sent per step summed over ranks
(canzona's counted by its ``Comm``; the peers' from their collectives' sizes), peak
optimizer-state bytes per rank, and the step time relative to dion's (or to canzona lb-asc's
when dion is absent). ``--repeat N`` runs the whole comparison N times in fresh processes and
prints the median over runs of each figure, with each run's ratio. With ``--phases`` canzona's
contenders also print their phases per step (wall and main-thread CPU, max over ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

STRATEGIES = ("lb-asc", "asc", "sc")
PEERS = ("dion", "muon-fsdp2")
NS_MODES = ("own", "shared")


# ============================================================================ model and gradients


def _config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
        tie_word_embeddings=False, max_position_embeddings=64,
    )


class TinyMatrices(nn.Module):
    """``count`` square ``side x side`` weight matrices and nothing else: a step is almost all
    per-parameter overhead (the ``--tiny`` case)."""

    def __init__(self, count: int, side: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(side, side, bias=False) for _ in range(count))


def _build(args: argparse.Namespace, mesh: Any, shard: bool = True) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)  # the same initial weights for every contender
    if args.tiny:
        model = TinyMatrices(args.tiny, args.tiny_side)
        if shard:
            fully_shard(model, mesh=mesh)
        return model
    model = LlamaForCausalLM(_config(args))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _is_matrix(name: str, p: torch.Tensor) -> bool:
    from canzona.specs import is_matrix_param

    return is_matrix_param(name, tuple(p.shape))


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """One full gradient per parameter, the same on every rank (seeded by position)."""
    g = torch.Generator().manual_seed(1234)
    return {n: torch.randn(tuple(p.shape), generator=g) * 1e-2 for n, p in model.named_parameters()}


def _pieces(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's FSDP2 piece of every gradient, as a DTensor with the parameter's placements
    (``distribute_tensor`` cuts it as FSDP2 cuts the parameter)."""
    from torch.distributed.tensor import distribute_tensor

    return {n: distribute_tensor(full[n], p.device_mesh, p.placements) if hasattr(p, "device_mesh") else full[n].clone()
            for n, p in model.named_parameters()}


# ============================================================================ the shared Newton-Schulz


#: the Newton-Schulz compute dtype of canzona and of the shared function (``--ns-dtype``); set in
#: every worker from its arguments
NS_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}
_ns_dtype: torch.dtype = torch.bfloat16


def shared_newton_schulz(x: torch.Tensor, epsilon: Any = None) -> torch.Tensor:
    """canzona's Newton-Schulz (``--ns-dtype``, one matrix at a time) behind the peers' signatures:
    a ``[..., m, n]`` stack is orthogonalized matrix by matrix, as canzona's hosts do."""
    from canzona.optim.muon import newton_schulz

    if x.ndim == 2:
        return newton_schulz(x, dtype=_ns_dtype)
    flat = x.reshape(-1, *x.shape[-2:])
    return torch.stack([newton_schulz(m, dtype=_ns_dtype) for m in flat.unbind(0)]).reshape(x.shape)


def _shared_ns_for_muon_fsdp2(g: torch.Tensor, steps: int) -> torch.Tensor:
    from canzona.optim.muon import newton_schulz

    return newton_schulz(g, steps, dtype=_ns_dtype)


# ============================================================================ peers


def _dion(model: nn.Module, mesh: Any, lr: float, shared: bool) -> torch.optim.Optimizer:
    import dion  # type: ignore[import-not-found]

    mats = [p for n, p in model.named_parameters() if _is_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if not _is_matrix(n, p)]
    groups = [dict(params=mats), dict(params=rest, algorithm="adamw", lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)]
    kw: dict[str, Any] = {"newton_schulz_func": shared_newton_schulz} if shared else {}
    return dion.Muon(groups, distributed_mesh=mesh, lr=lr, mu=0.95, nesterov=True, weight_decay=0.1, **kw)


def _dion_bytes(model: nn.Module, world: int) -> int:
    """Bytes dion's Muon sends per step, all ranks: per group of same-shape matrices (padded to a
    multiple of the world), two all-to-alls of bf16 shards, each rank keeping 1/world of its own."""
    shapes: dict[tuple[int, ...], int] = {}
    for n, p in model.named_parameters():
        if _is_matrix(n, p):
            shapes[tuple(p.shape)] = shapes.get(tuple(p.shape), 0) + 1
    total = 0
    for shape, count in shapes.items():
        padded = -(-count // world) * world
        rows = -(-shape[0] // world)  # dion pads every shard to ceil(rows / world)
        total += 2 * (world - 1) * padded * rows * shape[1] * 2
    return total


def _muon_fsdp2(model: nn.Module, lr: float) -> tuple[torch.optim.Optimizer, bool]:
    mats = [p for n, p in model.named_parameters() if _is_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if not _is_matrix(n, p)]
    try:
        import muon_fsdp2  # type: ignore[import-not-found]
    except ImportError:
        return _PeerScheme(mats, rest, lr), False
    opt = muon_fsdp2.Muon(
        [dict(params=mats, lr=lr, use_muon=True, rms_scale=False, weight_decay=0.1), dict(params=rest, lr=1e-3, use_muon=False)]
    )
    return opt, True


@contextlib.contextmanager
def _muon_fsdp2_shared_ns() -> Iterator[None]:
    """muon-fsdp2 reads its Newton-Schulz from a module global at every call: swap in the shared
    one for the duration of a step."""
    import muon_fsdp2  # type: ignore[import-not-found]

    own = muon_fsdp2.zeropower_via_newtonschulz5
    muon_fsdp2.zeropower_via_newtonschulz5 = _shared_ns_for_muon_fsdp2
    try:
        yield
    finally:
        muon_fsdp2.zeropower_via_newtonschulz5 = own


class _PeerScheme(torch.optim.Optimizer):
    """Re-implementation of muon-fsdp2's scheme, for when the package is unavailable: momentum on
    the local shard, per parameter a ``gather`` of the shards to rank ``index % world``, the host
    runs canzona's Newton-Schulz on the full matrix, one blocking ``scatter`` per parameter; AdamW
    (torch's defaults) on the local shards of the rest. Canzona's Muon math (momentum 0.95 with
    Nesterov, decoupled weight decay 0.1, lr scaled by ``sqrt(max(1, rows / cols))``, bf16
    Newton-Schulz), without canzona's non-finite checks. Not bitwise anything: a timing stand-in."""

    def __init__(self, mats: list[torch.Tensor], rest: list[torch.Tensor], lr: float) -> None:
        super().__init__([dict(params=mats, muon=True), dict(params=rest, muon=False)], dict(lr=lr, weight_decay=0.1, momentum=0.95))
        self._adam = torch.optim.AdamW(rest) if rest else None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        import torch.distributed as dist

        from canzona.optim.muon import adjust_lr, newton_schulz

        world, rank = dist.get_world_size(), dist.get_rank()
        for group in self.param_groups:
            if not group["muon"]:
                continue
            lr, mu = group["lr"], group["momentum"]
            for i, p in enumerate(group["params"]):
                g = p.grad.to_local()
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(g))
                buf.lerp_(g, 1 - mu)
                upd = g.lerp(buf, mu)
                dst = i % world
                parts = [torch.empty_like(upd) for _ in range(world)] if rank == dst else None
                dist.gather(upd, parts, dst=dst)
                out = torch.empty_like(upd)
                if rank == dst:
                    assert parts is not None
                    full = newton_schulz(torch.cat(parts), 5, dtype=_ns_dtype).to(upd.dtype)
                    dist.scatter(out, list(full.chunk(world)), src=dst)
                else:
                    dist.scatter(out, None, src=dst)
                local = p.to_local()
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(out, alpha=-adjust_lr(lr, None, p.shape))
        if self._adam is not None:
            self._adam.step()  # DTensor parameters and gradients: AdamW runs on the local shards


def _muon_fsdp2_bytes(model: nn.Module, world: int) -> int:
    """Bytes muon-fsdp2 sends per step, all ranks: per matrix, every non-host sends its fp32 shard
    to the host (gather) and the host sends every other rank its shard back (scatter)."""
    total = 0
    for n, p in model.named_parameters():
        if _is_matrix(n, p):
            loc = p.to_local()
            total += 2 * (world - 1) * loc.numel() * loc.element_size()
    return total


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                loc = v.to_local() if hasattr(v, "to_local") else v
                total += loc.numel() * loc.element_size()
    return total


# ============================================================================ one run


def peer_status(peers: list[str]) -> tuple[dict[str, bool], list[str]]:
    """Which peers import here, and one line for each that does not (dion is skipped;
    muon-fsdp2 falls back to its re-implementation)."""
    available: dict[str, bool] = {}
    lines: list[str] = []
    for peer in peers:
        module = "dion" if peer == "dion" else "muon_fsdp2"
        try:
            __import__(module)
            available[peer] = True
        except Exception as exc:  # noqa: BLE001 - any failure to import is "not installed here"
            available[peer] = False
            what = "skipped" if peer == "dion" else "using the labelled re-implementation of its scheme"
            lines.append(f"{peer}: cannot import {module} ({type(exc).__name__}: {exc}); {what} (see docs/profiling.md, 'Peers')")
    return available, lines


def _contenders(args: argparse.Namespace, mesh: Any, world: int, available: dict[str, bool]) -> dict[str, dict[str, Any]]:
    """name -> {model, opt, ns ("own"/"shared"/"both"), ctx (a context for each step), sent}."""
    import canzona

    out: dict[str, dict[str, Any]] = {}
    for s in args.strategies:
        for cmax in args.cmax:
            for exchange, batched in itertools.product(args.exchange, args.batched):
                model = _build(args, mesh)
                opt = canzona.DistributedOptimizer(model, "muon", strategy=s, mesh=mesh, cost="flops", cmax=cmax, exchange=exchange,
                                                   optimizer_kwargs={"lr": args.lr, "batched": batched == "on",
                                                                     "ns_dtype": NS_DTYPE[args.ns_dtype]})
                extra = [f"C_max {cmax:g}"] if len(args.cmax) > 1 else []
                extra += [exchange] if len(args.exchange) > 1 else []
                extra += ["batched NS, not bitwise"] if batched == "on" else []
                label = f"canzona {s}" + (f" ({', '.join(extra)})" if extra else "")
                out[label] = {"model": model, "opt": opt, "ns": "both", "ctx": contextlib.nullcontext, "sent": None}
    if args.tiny:
        # what DDP's optimizer step is: torch's Muon over the full (replicated) matrices, no exchange
        model = _build(args, mesh, shard=False)
        out["DDP + torch.optim.Muon"] = {"model": model, "opt": torch.optim.Muon(model.parameters(), lr=args.lr), "ns": "both",
                                         "ctx": contextlib.nullcontext, "sent": 0}
    for mode in args.ns:
        shared = mode == "shared"
        if "dion" in available and available["dion"]:
            model = _build(args, mesh)
            out[f"dion ({mode} NS)"] = {"model": model, "opt": _dion(model, mesh, args.lr, shared), "ns": mode,
                                        "ctx": contextlib.nullcontext, "sent": _dion_bytes(model, world)}
        if "muon-fsdp2" in available:
            model = _build(args, mesh)
            opt, real = _muon_fsdp2(model, args.lr)
            if not real and not shared:
                continue  # the re-implementation has only canzona's Newton-Schulz: one row, under "shared"
            label = f"muon-fsdp2 ({mode} NS)" if real else "muon-fsdp2 scheme, re-implemented (shared NS)"
            ctx = _muon_fsdp2_shared_ns if real and shared else contextlib.nullcontext
            out[label] = {"model": model, "opt": opt, "ns": mode, "ctx": ctx, "sent": _muon_fsdp2_bytes(model, world)}
    return out


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    global _ns_dtype
    _ns_dtype = NS_DTYPE[args.ns_dtype]
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    available = dict(args.available)
    contenders = _contenders(args, mesh, world, available)
    pieces = {name: _pieces(c["model"], _full_grads(c["model"])) for name, c in contenders.items()}
    walls: dict[str, list[float]] = {n: [] for n in contenders}
    cpus: dict[str, list[float]] = {n: [] for n in contenders}
    procs: dict[str, list[float]] = {n: [] for n in contenders}

    def one_step(name: str) -> tuple[float, float, float]:
        c = contenders[name]
        for (n, p) in c["model"].named_parameters():
            p.grad = pieces[name][n].clone()  # the optimizers may write into p.grad
        dist.barrier()
        with c["ctx"]():
            t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
            c["opt"].step()
            c1, p1 = time.thread_time(), time.process_time()
        dist.barrier()
        t1 = time.perf_counter()
        c["opt"].zero_grad()
        return t1 - t0, c1 - c0, p1 - p0

    names = list(contenders)
    for _ in range(args.warmup):  # compiles the peers' Newton-Schulz, allocates every state
        for name in names:
            one_step(name)
    for name in names:
        opt = contenders[name]["opt"]
        if hasattr(opt, "comm_stats"):
            opt.comm_stats.reset()
            opt.phase_times.reset()
    for step in range(args.steps):  # interleaved, in a rotating order
        for j in range(len(names)):
            name = names[(j + step) % len(names)]
            w, c, pc = one_step(name)
            walls[name].append(w)
            cpus[name].append(c)
            procs[name].append(pc)
    return {name: _record(c, walls[name], cpus[name], procs[name], args.steps, world) for name, c in contenders.items()}


def _record(c: dict[str, Any], walls: list[float], cpus: list[float], procs: list[float], steps: int, world: int) -> dict[str, Any]:
    opt = c["opt"]
    if hasattr(opt, "comm_stats"):
        sent, state = opt.comm_stats.total_sent() / steps, opt.state_bytes()
    else:
        sent, state = c["sent"] / world, _state_bytes(opt)  # per rank on average; summed over ranks in the report
    rec: dict[str, Any] = {"walls": walls, "cpus": cpus, "procs": procs, "sent": sent, "state": state, "ns": c["ns"],
                           "params": sum(1 for _ in c["model"].parameters())}
    if hasattr(opt, "phase_times"):
        pt = opt.phase_times
        rec["phases"] = {k: (pt.wall[k] / steps, pt.cpu[k] / steps, pt.calls[k] / steps) for k in pt.wall}
        rec["groups"] = len(opt.plan.micro_groups[0])
    return rec


# ============================================================================ report


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per contender: median and fastest step (each step's time is the slowest rank's), the
    slowest rank's median main-thread CPU, process CPU, MB sent (all ranks), state MB (max rank)."""
    out: dict[str, dict[str, float]] = {}
    for lab in per_rank[0]:
        rows = [r[lab] for r in per_rank]
        steps = range(len(rows[0]["walls"]))
        per_step = [max(r["walls"][i] for r in rows) for i in steps]
        out[lab] = {
            "step_ms": statistics.median(per_step) * 1e3,
            "min_ms": min(per_step) * 1e3,
            "cpu_ms": max(statistics.median(r["cpus"]) for r in rows) * 1e3,
            "proc_ms": max(statistics.median(r["procs"]) for r in rows) * 1e3,
            "mb_sent": sum(r["sent"] for r in rows) / 1e6,
            "state_mb": max(r["state"] for r in rows) / 1e6,
            "us_param": statistics.median(per_step) * 1e6 / rows[0]["params"],
        }
    return out


def _base(labels: list[str], mode: str) -> str:
    dion = f"dion ({mode} NS)"
    return dion if dion in labels else labels[0]


def format_table(world: int, mode: str, runs: list[dict[str, dict[str, float]]], ns: dict[str, str]) -> str:
    """One table per NS mode: canzona's rows and the peers' rows of that mode, medians over runs,
    each run's ratio to the base (dion, else canzona lb-asc) listed at the end of the row."""
    labels = [lab for lab in runs[0] if ns[lab] in ("both", mode)]
    base = _base(labels, mode)
    head = (f"{'contender':<44}{'step ms':>9}{'min ms':>8}{'cpu ms':>8}{'proc ms':>9}{'MB sent':>9}{'state MB':>9}{'us/param':>9}"
            f"{'vs ' + base.split(' (')[0]:>12}  per run")
    lines = [f"\nworld {world}, {mode} Newton-Schulz (gloo, one thread per rank; median of {len(runs)} run(s))", head, "-" * len(head)]
    for lab in labels:
        med = {k: statistics.median(r[lab][k] for r in runs) for k in runs[0][lab]}
        ratios = [r[lab]["step_ms"] / r[base]["step_ms"] for r in runs]
        lines.append(
            f"{lab:<44}{med['step_ms']:>9.1f}{med['min_ms']:>8.1f}{med['cpu_ms']:>8.1f}{med['proc_ms']:>9.1f}{med['mb_sent']:>9.2f}"
            f"{med['state_mb']:>9.2f}{med['us_param']:>9.1f}{statistics.median(ratios):>12.3f}  {' '.join(f'{x:.3f}' for x in ratios)}"
        )
    return "\n".join(lines)


def format_phases(world: int, per_rank: list[dict[str, Any]]) -> str:
    lines = [f"\nworld {world}: canzona phases per step (wall ms max over ranks / thread-CPU ms max over ranks / calls)"]
    for lab in per_rank[0]:
        if "phases" not in per_rank[0][lab]:
            continue
        lines.append(f"  {lab} ({per_rank[0][lab]['groups']} micro-groups)")
        for k in sorted({k for r in per_rank for k in r[lab]["phases"]}):
            vals = [r[lab]["phases"].get(k, (0.0, 0.0, 0.0)) for r in per_rank]
            lines.append(f"    {k:<44}{max(v[0] for v in vals) * 1e3:>9.2f}{max(v[1] for v in vals) * 1e3:>9.2f}{max(v[2] for v in vals):>7.0f}")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="comma list of world sizes (default 2,4)")
    p.add_argument("--peers", default="dion,muon-fsdp2", help="comma list among dion, muon-fsdp2, or 'none' (default both)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="canzona's strategies, comma list (default lb-asc,asc,sc)")
    p.add_argument("--ns", default="own,shared", help="Newton-Schulz modes for the peers: own, shared or both (default own,shared)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="hidden width (default 256)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    p.add_argument("--ffn", type=int, default=768, help="MLP width (default 768)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size (default 2048)")
    p.add_argument("--steps", type=int, default=7, help="timed steps per contender, interleaved (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per contender first (default 2)")
    p.add_argument("--repeat", type=int, default=1, help="whole runs in fresh processes; medians over runs (default 1)")
    p.add_argument("--cmax", default="2", help="canzona's micro-group capacity C_max in 2**20 TP-local gradient elements per host (2 = 8 MiB of fp32 at TP 1), or a comma list (one contender each; default 2)")
    p.add_argument("--exchange", default="ns-input", help="canzona's exchange= (ns-input, gradients), or a comma list (one contender each; default ns-input)")
    p.add_argument("--batched", default="off", help="canzona's Muon batched= (off: one matrix at a time, bitwise; on: same-shape "
                   "matrices in one batched chain, within a bound, not bitwise), or off,on (one contender each; default off)")
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (default 0.02)")
    p.add_argument("--ns-dtype", choices=sorted(NS_DTYPE), default="bf16",
                   help="Newton-Schulz compute dtype of canzona and of the shared function (default bf16; fp32 on a CPU "
                        "without fast bf16 products, where bf16 Newton-Schulz hides everything else); the peers' own "
                        "functions keep theirs")
    p.add_argument("--phases", action="store_true", help="also print canzona's per-phase wall and CPU times per step")
    p.add_argument("--tiny", type=int, default=0, help="instead of the Llama: this many square matrices (e.g. 500), "
                   "with DDP + torch.optim.Muon as a contender; the us/param column is the per-parameter cost")
    p.add_argument("--tiny-side", type=int, default=16, help="side of the --tiny matrices (default 16)")
    args = p.parse_args(argv)
    try:
        args.worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds must be a comma list of integers, got {args.worlds!r}")
    if any(w < 1 for w in args.worlds):
        p.error(f"--worlds must be >= 1 each, got {args.worlds}")
    args.peers = [] if args.peers.strip() in ("", "none") else [s.strip() for s in args.peers.split(",")]
    if bad := [s for s in args.peers if s not in PEERS]:
        p.error(f"--peers: unknown peer {bad[0]!r} (known: {', '.join(PEERS)}, or 'none')")
    args.strategies = [s.strip() for s in args.strategies.split(",")]
    if not args.strategies or any(s not in STRATEGIES for s in args.strategies):
        p.error(f"--strategies must be a comma list among {', '.join(STRATEGIES)}, got {','.join(args.strategies)!r}")
    args.exchange = [s.strip() for s in args.exchange.split(",")]
    if not args.exchange or any(s not in ("ns-input", "gradients") for s in args.exchange):
        p.error(f"--exchange must be a comma list among ns-input, gradients, got {','.join(args.exchange)!r}")
    args.batched = [s.strip() for s in args.batched.split(",")]
    if not args.batched or any(s not in ("off", "on") for s in args.batched):
        p.error(f"--batched must be off, on or off,on, got {','.join(args.batched)!r}")
    args.ns = [s.strip() for s in args.ns.split(",")]
    if not args.ns or any(s not in NS_MODES for s in args.ns):
        p.error(f"--ns must be a comma list among {', '.join(NS_MODES)}, got {','.join(args.ns)!r}")
    if args.tiny < 0 or args.tiny_side < 1:
        p.error("--tiny must be >= 0 and --tiny-side >= 1")
    for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "steps", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        args.cmax = [float(c) for c in str(args.cmax).split(",")]
    except ValueError:
        p.error(f"--cmax must be a number or a comma list of numbers, got {args.cmax!r}")
    if args.warmup < 0 or not all(c > 0 for c in args.cmax) or not args.lr > 0:
        p.error("--warmup must be >= 0, --cmax and --lr > 0")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden must divide by --heads and --heads by --kv-heads, got {args.hidden}, {args.heads}, {args.kv_heads}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from canzona.runtime.launch import run_workers

    head_dim = args.hidden // args.heads
    widths = (args.tiny_side,) if args.tiny else (args.hidden, args.heads * head_dim, args.kv_heads * head_dim, args.ffn, args.vocab)
    for w in args.worlds:
        if bad := [d for d in widths if d % w]:
            print(f"bench_fsdp2: error: every width must divide by the world ({bad[0]} % {w}); muon-fsdp2 needs even shards", file=sys.stderr)
            return 2
    available, lines = peer_status(args.peers)
    for line in lines:
        print(line)
    args.available = available
    if args.tiny:
        print(f"{args.tiny} matrices of {args.tiny_side} x {args.tiny_side} under one fully_shard")
    print(
        f"transformers Llama: {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} KV), ffn {args.ffn}, "
        f"vocab {args.vocab}; Muon lr {args.lr}, Newton-Schulz in {args.ns_dtype}; canzona C_max {','.join(f'{c:g}' for c in args.cmax)} (x 2**20 elements); {args.steps} interleaved timed steps after "
        f"{args.warmup} warm-up, {args.repeat} run(s); peers: {', '.join(args.peers) or 'none'}"
    )
    for w in args.worlds:
        runs, last = [], None
        for _ in range(args.repeat):
            # torch.compile of the peers' functions can hold the interpreter for tens of seconds on a
            # loaded machine, which starves the launcher's heartbeat thread: allow it
            last = run_workers(_worker, w, args, timeout_s=1800, pg_timeout_s=600, heartbeat_timeout_s=600)
            runs.append(summarize(last))
        assert last is not None
        ns = {lab: last[0][lab]["ns"] for lab in last[0]}
        for mode in args.ns if any(v != "both" for v in ns.values()) else args.ns[:1]:
            print(format_table(w, mode, runs, ns))
        if args.phases:
            print(format_phases(w, last))
    return 0


if __name__ == "__main__":
    sys.exit(main())
