"""Canzona on FSDP2 versus muon-fsdp2, side by side, in one invocation (gloo, CPU, world 2 and 4).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python profiling/bench_fsdp2.py            # defaults below
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python profiling/bench_fsdp2.py --layers 4 --steps 2 --worlds 2

The peer needs its own install (benchmark only, not a canzona dependency)::

    pip install muon-fsdp2

One Qwen3-like model (q/k/v/o with grouped KV heads, gate/up/down MLP, norms, untied embedding and
head; shapes divisible by the world so muon-fsdp2's even-shard gather works), sharded with
``fully_shard`` per layer and at the root on a 1-D ``dp_shard`` mesh. Every contender gets the same
injected gradients through a real FSDP2 backward; only ``optimizer.step()`` is timed, between two
barriers (so the wall time is the slowest rank's); the contenders' steps are interleaved in a
rotating order, so changes of machine load hit all of them alike. Contenders:

- ``canzona lb-asc``  hosts balanced by Muon FLOPs (Algorithm 2 micro-groups, loads carried);
- ``canzona asc``     round-robin hosts (the peers' placement) with canzona's fused exchanges;
- ``canzona sc``      every rank gathers every gradient and recomputes every update;
- ``muon-fsdp2``      the PyPI package (``Muon`` with ``use_muon`` groups): per parameter a
                      blocking-free ``gather`` to rank ``index % world``, the host orthogonalizes,
                      one ``scatter`` per parameter; its Newton-Schulz loop is ``torch.compile``d
                      (compiled during the warm-up step, not timed). Falls back to a labelled
                      re-implementation of the same scheme when the package is missing or cannot
                      compile here, doing the same Muon math as canzona's defaults (momentum 0.95
                      with Nesterov, decoupled weight decay 0.1, lr scaled by
                      ``sqrt(max(1, rows/cols))``, bf16 Newton-Schulz; AdamW with torch's
                      defaults on the rest), so that the two do the same arithmetic.

Printed per contender: step wall time (median and fastest of the timed steps; each step's time is
the slowest rank's), optimizer compute per rank (the
main thread's CPU time during ``step()``: math plus packing, not the gloo worker threads) as max
(median over steps), min (the least loaded step; per step the slowest rank) and mean, and
``max / (total / world)``, the whole process's CPU time during ``step()`` (all threads, gloo's
included; max over ranks), bytes sent per step (all ranks; muon-fsdp2's counted from
its gather/scatter sizes), peak optimizer-state bytes per rank (max and max/mean), and the step
time relative to ``canzona lb-asc``. Both Muons run their Newton-Schulz in bfloat16.

With ``--phases``, canzona's contenders also print their phases per step (wall and main-thread CPU,
max over ranks, and calls): status exchange and element-wise update, gather launch/wait, compute,
scatter launch/wait, apply.

What canzona does that the peer does not (the rest is the same arithmetic, split differently):
before anything changes it checks every gradient piece for NaN/inf (one sum per piece, then a
status all-reduce) so that a bad step is refused on every rank, and canzona's Muon checks its full
gradients again (one ``aminmax`` per matrix); it packs the blocks of each micro-group into one
fused all-to-all in the main thread, where the peer's per-parameter ``gather``/``scatter`` copy
inside gloo's worker threads (outside the ``cpu`` columns, inside ``proc``); and it sends values,
not deltas, from fp32 masters on the host. At world 2 a host's own half of each matrix it hosts
never enters the exchange (copied in place; see docs/runtime.md). docs/runtime.md ("CPU against
the muon-fsdp2 scheme") gives the measured split of the per-rank CPU.

On a machine shared with other jobs the wall times are dominated by scheduling (a rank waits for a
core, not for data); with more ranks than cores (world 4 on 2 cores) a step costs the total CPU of
all ranks whatever the balance. The CPU columns are then the comparable quantities: ``cpu max``
approximates the step on a quiet machine with a core per rank (exposed exchanges and waits come on
top).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

STRATEGIES = ("lb-asc", "asc", "sc")


class Block(nn.Module):
    def __init__(self, h: int, q: int, kv: int, ffn: int, g: torch.Generator) -> None:
        super().__init__()

        def w(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * shape[-1] ** -0.5)

        self.q_proj, self.k_proj, self.v_proj, self.o_proj = w(q, h), w(kv, h), w(kv, h), w(h, q)
        self.gate_proj, self.up_proj, self.down_proj = w(ffn, h), w(ffn, h), w(h, ffn)
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_norm = nn.Parameter(torch.ones(h))

    def forward(self, grads: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        return _inject(self, grads, prefix)


def _inject(module: nn.Module, grads: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    # sum(p * g): the gradient of p is exactly g; FSDP2 unshards p for this forward as for any other
    total = torch.zeros(())
    for n, p in module.named_parameters(recurse=False):
        loc = p.to_local() if hasattr(p, "to_local") else p
        total = total + (loc * grads[prefix + n]).sum()
    return total


class Model(nn.Module):
    def __init__(self, layers: int, h: int, q: int, kv: int, ffn: int, vocab: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed_tokens = nn.Parameter(torch.randn(vocab, h, generator=g) * 0.02)
        self.layers = nn.ModuleList([Block(h, q, kv, ffn, g) for _ in range(layers)])
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Parameter(torch.randn(vocab, h, generator=g) * 0.02)

    def forward(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        total = _inject(self, grads, "")
        for i, layer in enumerate(self.layers):
            total = total + layer(grads, f"layers.{i}.")
        return total


def _is_matrix(name: str, p: torch.Tensor) -> bool:
    from canzona.specs import is_matrix_param

    return is_matrix_param(name, tuple(p.shape))


def _build(args: argparse.Namespace, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = Model(args.layers, args.hidden, args.q, args.kv, args.ffn, args.vocab)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return {n: torch.randn(tuple(p.shape), generator=g) * 1e-2 for n, p in model.named_parameters()}


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                loc = v.to_local() if hasattr(v, "to_local") else v
                total += loc.numel() * loc.element_size()
    return total


def _peer(model: nn.Module, lr: float) -> tuple[torch.optim.Optimizer, str]:
    """muon-fsdp2 from PyPI, or a labelled re-implementation of its scheme."""
    mats = [p for n, p in model.named_parameters() if _is_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if not _is_matrix(n, p)]
    try:
        import muon_fsdp2  # type: ignore[import-not-found]

        opt = muon_fsdp2.Muon(
            [dict(params=mats, lr=lr, use_muon=True, rms_scale=False, weight_decay=0.1), dict(params=rest, lr=1e-3, use_muon=False)]
        )
        return opt, "muon-fsdp2 (PyPI)"
    except ImportError:
        return _PeerScheme(mats, rest, lr), "muon-fsdp2 scheme (re-implemented)"


class _PeerScheme(torch.optim.Optimizer):
    """Re-implementation of muon-fsdp2's scheme, for when the package is unavailable: momentum on
    the local shard, per parameter a ``gather`` of the shards to rank ``index % world``, the host
    runs canzona's Newton-Schulz on the full matrix, one blocking ``scatter`` per parameter; AdamW
    (torch's defaults, as canzona's element-wise optimizer) on the local shards of the rest. The
    Muon math is canzona's defaults (torch's): momentum 0.95 with Nesterov, decoupled weight decay
    0.1, lr scaled by ``sqrt(max(1, rows / cols))``, Newton-Schulz in bfloat16; what it leaves out
    is canzona's non-finite checks (no refusal of a NaN step). Not bitwise anything: a timing
    stand-in."""

    def __init__(self, mats: list[torch.Tensor], rest: list[torch.Tensor], lr: float) -> None:
        super().__init__([dict(params=mats, muon=True), dict(params=rest, muon=False)], dict(lr=lr, weight_decay=0.1, momentum=0.95))
        self._adam = torch.optim.AdamW(rest) if rest else None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        import torch.distributed as dist

        from canzona.optim.muon import adjust_lr, newton_schulz

        for group in self.param_groups:
            if not group["muon"]:
                continue
            lr, mu = group["lr"], group["momentum"]
            for i, p in enumerate(group["params"]):
                g = p.grad.to_local()
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(g)
                buf = st["momentum_buffer"]
                buf.lerp_(g, 1 - mu)
                upd = g.lerp(buf, mu)
                world, rank = dist.get_world_size(), dist.get_rank()
                dst = i % world
                parts = [torch.empty_like(upd) for _ in range(world)] if rank == dst else None
                dist.gather(upd, parts, dst=dst)
                out = torch.empty_like(upd)
                if rank == dst:
                    full = newton_schulz(torch.cat(parts), 5, dtype=torch.bfloat16).to(upd.dtype)
                    dist.scatter(out, list(full.chunk(world)), src=dst)
                else:
                    dist.scatter(out, None, src=dst)
                local = p.to_local()
                local.mul_(1 - lr * group["weight_decay"])
                local.add_(out, alpha=-adjust_lr(lr, None, p.shape))
        if self._adam is not None:
            self._adam.step()  # DTensor parameters and gradients: AdamW runs on the local shards


def _peer_bytes(model: nn.Module, world: int) -> int:
    """Bytes muon-fsdp2 sends per step: per matrix, every non-host sends its shard to the host
    (gather) and the host sends every other rank its shard back (scatter)."""
    total = 0
    for n, p in model.named_parameters():
        if _is_matrix(n, p):
            shard = p.to_local().numel() * p.to_local().element_size()
            total += 2 * (world - 1) * shard
    return total


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import canzona

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    contenders: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
    for name in [f"canzona {s}" for s in STRATEGIES] + ["peer"]:
        model = _build(args, mesh)
        if name == "peer":
            opt, name = _peer(model, args.lr)
        else:
            opt = canzona.DistributedOptimizer(
                model, "muon", strategy=name.split()[1], mesh=mesh, optimizer_kwargs={"lr": args.lr}, cost="flops", cmax=args.cmax
            )
        contenders[name] = (model, opt)
    grads = _grads(next(iter(contenders.values()))[0], rank)
    walls: dict[str, list[float]] = {n: [] for n in contenders}
    cpus: dict[str, list[float]] = {n: [] for n in contenders}
    procs: dict[str, list[float]] = {n: [] for n in contenders}

    def one_step(name: str) -> tuple[float, float, float]:
        model, opt = contenders[name]
        model(grads).backward()
        dist.barrier()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        opt.step()
        c1, p1 = time.thread_time(), time.process_time()
        dist.barrier()
        t1 = time.perf_counter()
        opt.zero_grad()
        return t1 - t0, c1 - c0, p1 - p0

    names = list(contenders)
    for _ in range(args.warmup):  # compiles muon-fsdp2's Newton-Schulz, allocates every state
        for name in names:
            one_step(name)
    for name in names:
        opt = contenders[name][1]
        if hasattr(opt, "comm_stats"):
            opt.comm_stats.reset()
            opt.phase_times.reset()
    # interleaved, in a rotating order, so a change of machine load hits every contender alike
    for step in range(args.steps):
        for j in range(len(names)):
            name = names[(j + step) % len(names)]
            w, c, pc = one_step(name)
            walls[name].append(w)
            cpus[name].append(c)
            procs[name].append(pc)
    out: dict[str, Any] = {}
    for name, (model, opt) in contenders.items():
        if hasattr(opt, "comm_stats"):
            sent = opt.comm_stats.total_sent() / args.steps
            state = opt.state_bytes()
        else:
            sent = _peer_bytes(model, world) / world  # per rank on average; summed over ranks below
            state = _state_bytes(opt)
        out[name] = {"wall": statistics.median(walls[name]), "walls": walls[name], "cpu": statistics.median(cpus[name]), "cpus": cpus[name],
                     "proc": statistics.median(procs[name]), "sent": sent, "state": state}
        if hasattr(opt, "phase_times"):
            pt = opt.phase_times
            out[name]["phases"] = {k: (pt.wall[k] / args.steps, pt.cpu[k] / args.steps, pt.calls[k] / args.steps) for k in pt.wall}
            out[name]["groups"] = len(opt.plan.groups)
    return out


def _report(world: int, per_rank: list[dict[str, Any]], phases: bool = False) -> None:
    labels = list(per_rank[0])
    base = next(lab for lab in labels if lab.endswith("lb-asc"))
    print(f"\nworld {world} (gloo, one thread per rank)")
    head = (
        f"{'contender':<34}{'step ms':>9}{'min ms':>8}{'cpu max ms':>11}{'cpu min':>8}{'cpu mean':>9}{'max/(tot/R)':>12}"
        f"{'proc max ms':>12}{'MB sent':>9}{'state max MB':>13}{'st max/mean':>12}{'vs lb-asc':>10}"
    )
    print(head)
    print("-" * len(head))
    for lab in labels:
        rows = [r[lab] for r in per_rank]
        wall = max(r["wall"] for r in rows)
        # the step's wall time is the slowest rank's (barriers on both sides): per step, max over ranks
        fastest = min(max(r["walls"][i] for r in rows) for i in range(len(rows[0]["walls"])))
        # the least loaded step's CPU (max over ranks): the figure least disturbed by other jobs
        cpu_min = min(max(r["cpus"][i] for r in rows) for i in range(len(rows[0]["cpus"])))
        cpus = [r["cpu"] for r in rows]
        states = [r["state"] for r in rows]
        mean_cpu, mean_state = sum(cpus) / world, sum(states) / world
        bwall = max(r[base]["wall"] for r in per_rank)
        print(
            f"{lab:<34}{wall * 1e3:>9.1f}{fastest * 1e3:>8.1f}{max(cpus) * 1e3:>11.1f}{cpu_min * 1e3:>8.1f}{mean_cpu * 1e3:>9.1f}{max(cpus) / mean_cpu:>12.2f}"
            f"{max(r['proc'] for r in rows) * 1e3:>12.1f}{sum(r['sent'] for r in rows) / 2**20:>9.2f}{max(states) / 2**20:>13.2f}{max(states) / mean_state:>12.2f}"
            f"{wall / bwall:>10.2f}"
        )
    if not phases:
        return
    print(f"\nworld {world}: canzona phases per step (wall ms max over ranks / thread-CPU ms max over ranks / calls)")
    for lab in labels:
        if "phases" not in per_rank[0][lab]:
            continue
        print(f"  {lab} ({per_rank[0][lab]['groups']} micro-groups)")
        keys = sorted({k for r in per_rank for k in r[lab]["phases"]})
        for k in keys:
            vals = [r[lab]["phases"].get(k, (0.0, 0.0, 0.0)) for r in per_rank]
            print(f"    {k:<40}{max(v[0] for v in vals) * 1e3:>9.1f}{max(v[1] for v in vals) * 1e3:>9.1f}{max(v[2] for v in vals):>7.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="comma list of world sizes (default 2,4)")
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (default 6)")
    p.add_argument("--hidden", type=int, default=512, help="hidden width (default 512)")
    p.add_argument("--q", type=int, default=512, help="query width (heads x head_dim)")
    p.add_argument("--kv", type=int, default=128, help="key/value width (grouped KV heads)")
    p.add_argument("--ffn", type=int, default=1536, help="MLP width (default 1536)")
    p.add_argument("--vocab", type=int, default=2048, help="vocabulary size of the embedding and head (default 2048)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender (interleaved)")
    p.add_argument("--cmax", type=float, default=2.0,
                   help="canzona's micro-group capacity C_max in 2^20 TP-local gradient elements per host (default 2, "
                        "8 MiB of fp32 gradient: several groups, so exchanges overlap compute)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per contender first (default 1)")
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate (default 0.02)")
    p.add_argument("--phases", action="store_true", help="also print canzona's per-phase wall and CPU times per step (max over ranks)")
    args = p.parse_args(argv)
    from canzona.runtime.launch import run_workers

    try:
        worlds = [int(w) for w in args.worlds.split(",")]
    except ValueError:
        p.error(f"--worlds must be a comma list of integers, got {args.worlds!r}")
    if any(w < 1 for w in worlds):
        p.error(f"--worlds must be >= 1 each, got {args.worlds!r}")
    for name in ("layers", "hidden", "q", "kv", "ffn", "vocab", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or not args.cmax > 0 or not args.lr > 0:
        p.error("--warmup must be >= 0, --cmax and --lr > 0")
    for w in worlds:
        for dim in (args.hidden, args.q, args.kv, args.ffn, args.vocab):
            if dim % w:
                print(f"bench_fsdp2: error: every width must divide by the world ({dim} % {w}); muon-fsdp2 needs even shards", file=sys.stderr)
                return 2
    print(
        f"Qwen3-like model: {args.layers} layers, hidden {args.hidden}, q {args.q}, kv {args.kv}, ffn {args.ffn}, vocab {args.vocab}; "
        f"Muon lr {args.lr}; canzona C_max {args.cmax:g} x 2^20 elements; {args.steps} interleaved timed steps after {args.warmup} warm-up"
    )
    for w in worlds:
        per_rank = run_workers(_worker, w, args, timeout_s=1800, pg_timeout_s=600)
        _report(w, per_rank, args.phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
