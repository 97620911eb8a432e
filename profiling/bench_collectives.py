"""The collectives behind canzona's choices per backend, side by side in one run (gloo on CPU).

Per world size, on an N-element fp32 buffer cut into uneven shards (the cut points of a plan are
uneven), median over repeats of wall time and process CPU time (all threads, gloo's included):

- uneven all-gather: ``Comm.all_gather_v`` (on gloo what it picks), ``all_to_all_single`` over an
  R-fold repeated send buffer, and an equal all-gather of shards padded to the largest one, then
  compacted;
- uneven reduce-scatter: ``Comm.reduce_scatter_v`` (on gloo what it picks: an ``all_to_all_single``
  of the slices, then their sum in rank order), against gloo's list-form ``reduce_scatter`` and an
  all-reduce of the whole buffer (twice the bytes).

    .venv/bin/python profiling/bench_collectives.py --numel 2000000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["main"]

VARIANTS = ("all_gather_v", "repeat_all_to_all", "padded_all_gather", "reduce_scatter_v", "list_reduce_scatter", "all_reduce")


def _sizes(numel: int, world: int) -> list[int]:
    base = numel // world
    sizes = [base + (base // 3 if r % 2 == 0 else -(base // 3)) for r in range(world)]
    sizes[-1] += numel - sum(sizes)
    return sizes


def _worker(rank: int, world: int, numel: int, repeats: int) -> dict[str, tuple[float, float]]:
    import torch
    import torch.distributed as dist

    from canzona.runtime.comm import Comm, _all_gather_single

    comm = Comm(None)
    sizes = _sizes(numel, world)
    local = torch.randn(sizes[rank])
    flat = torch.randn(numel)
    shard = torch.empty(sizes[rank])
    scratch = torch.empty(comm.reduce_scatter_scratch(flat, sizes))

    def run(name: str) -> None:
        if name == "all_gather_v":
            _, w = comm.all_gather_v(local, sizes, async_op=True)
            w.wait()
        elif name == "repeat_all_to_all":
            out = torch.empty(numel)
            dist.all_to_all_single(out, local.repeat(world), output_split_sizes=sizes, input_split_sizes=[local.numel()] * world)
        elif name == "padded_all_gather":
            m = max(sizes)
            send = torch.zeros(m)
            send[: local.numel()].copy_(local)
            buf = torch.empty(m * world)
            _all_gather_single(buf, send)
            out = torch.empty(numel)
            torch.cat([buf[r * m : r * m + s] for r, s in enumerate(sizes)], out=out)
        elif name == "reduce_scatter_v":
            _, w = comm.reduce_scatter_v(flat, sizes, out=shard, scratch=scratch, async_op=True)
            w.wait()
        elif name == "list_reduce_scatter":
            dist.reduce_scatter(shard, list(flat.split(sizes)))
        else:
            comm.all_reduce(flat.clone())

    out: dict[str, tuple[float, float]] = {}
    for name in VARIANTS:
        run(name)  # warm-up
        walls, cpus = [], []
        for _ in range(repeats):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            run(name)
            walls.append(time.perf_counter() - t)
            cpus.append(time.process_time() - c)
        out[name] = (statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=2_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--worlds", default="2,4")
    args = p.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w]
    if args.numel < 8 or args.repeats < 1 or not worlds or min(worlds) < 2:
        print("bench_collectives: --numel >= 8, --repeats >= 1, world sizes >= 2", file=sys.stderr)
        return 2
    from canzona.runtime.launch import run_workers

    for world in worlds:
        res = run_workers(_worker, world, args.numel, args.repeats, timeout_s=600)
        print(f"world {world}, {args.numel} fp32 elements, shards {_sizes(args.numel, world)} "
              f"(slowest rank, median of {args.repeats}): wall ms / process CPU ms")
        for name in VARIANTS:
            wall = max(r[name][0] for r in res)
            cpu = max(r[name][1] for r in res)
            print(f"  {name:18s} {wall:9.2f} {cpu:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
