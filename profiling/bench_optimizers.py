"""Step times of canzona's single-device optimizers on Qwen3-like layer shapes (CPU-sized).

Prints, for one transformer block's matrices:

* Muon (ours) vs ``torch.optim.Muon`` measured side by side, interleaved step by step so both see
  the same machine state, plus their bitwise agreement; AdamW for scale.
* Shampoo and SOAP: a cached step (no eigendecomposition / no basis refresh) and a step that
  recomputes roots (Shampoo, ``eigh``) or refreshes bases (SOAP, one QR power iteration). These
  run at a smaller hidden size by default: ``eigh`` of fc1's 2816 x 2816 statistic alone takes
  several seconds on 2 CPU cores.
* Batched Newton-Schulz (one ``baddbmm`` chain over k same-shape matrices, as Canzona's TP
  micro-groups would use, arXiv 2602.06079 Sec. 3.3) vs a loop, with the bitwise verdict.
* The finiteness test of a step's gradients (the optimizers' own, and the runtimes' test of the
  reduced buckets): canzona's ``nonfinite_flags`` (on CPU a sum per tensor, ``aminmax`` only where
  the sum is not finite) against ``aminmax`` alone and ``torch.isfinite(g).all()`` per tensor,
  interleaved, with a check that all three name the same tensors when one holds NaN.

Run from the repository root: ``.venv/bin/python profiling/bench_optimizers.py`` (< 1 minute on
2 cores; ``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from canzona.optim import SOAP, Muon, Shampoo, batched_newton_schulz, newton_schulz  # noqa: E402
from canzona.optim._common import nonfinite_flags  # noqa: E402

__all__ = ["block_shapes", "main"]


def block_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    """One Qwen3-like block scaled down: fused qkv (GQA, 1.5x hidden), o, fc1 (fused gate/up,
    2 x 2.75 x hidden), fc2."""
    ffn = (hidden * 11) // 4
    return {
        "qkv": (hidden * 3 // 2, hidden),
        "o": (hidden, hidden),
        "fc1": (2 * ffn, hidden),
        "fc2": (hidden, ffn),
    }


def _params(shapes: dict[str, tuple[int, int]], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(0.02 * torch.randn(s, generator=gen)).requires_grad_() for s in shapes.values()]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:9.2f} ms"


def bench_muon(hidden: int, repeats: int) -> None:
    shapes = block_shapes(hidden)
    print(f"\n== Muon vs torch.optim.Muon, hidden {hidden}: " + ", ".join(f"{k} {list(v)}" for k, v in shapes.items()))
    ours_p, ref_p, adam_p = _params(shapes, 0), _params(shapes, 0), _params(shapes, 0)
    ours = Muon(ours_p, lr=0.02, weight_decay=0.1)
    ref = torch.optim.Muon(ref_p, lr=0.02, weight_decay=0.1)
    adamw = torch.optim.AdamW(adam_p, lr=1e-3)
    times: dict[str, list[float]] = {"ours": [], "torch": [], "adamw": []}
    warmup = 2
    for step in range(warmup + repeats):
        for params in (ours_p, ref_p, adam_p):
            _set_grads(params, step)
        # Alternate who goes first so cache/turbo effects do not favour one side.
        order = [("ours", ours), ("torch", ref)] if step % 2 == 0 else [("torch", ref), ("ours", ours)]
        for name, opt in order + [("adamw", adamw)]:
            elapsed = _timed(opt.step)
            if step >= warmup:
                times[name].append(elapsed)
    med = {k: statistics.median(v) for k, v in times.items()}
    equal = all(torch.equal(a, b) for a, b in zip(ours_p, ref_p))
    print(f"  canzona Muon       {_ms(med['ours'])}  (median of {repeats})")
    print(f"  torch.optim.Muon   {_ms(med['torch'])}")
    print(f"  torch.optim.AdamW  {_ms(med['adamw'])}")
    print(f"  ratio ours/torch   {med['ours'] / med['torch']:9.3f}x  (target <= 1.0x)")
    print(f"  bitwise equal to torch.optim.Muon after {warmup + repeats} steps: {equal}")


def bench_eig_optimizers(hidden: int, repeats: int) -> None:
    shapes = block_shapes(hidden)
    print(f"\n== Shampoo and SOAP, hidden {hidden}: " + ", ".join(f"{k} {list(v)}" for k, v in shapes.items()))
    torch.linalg.eigh(torch.eye(8))  # first LAPACK call pays a one-off initialisation
    never = 10**9
    cases: list[tuple[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer], Callable[[list[torch.Tensor]], torch.optim.Optimizer]]] = [
        (
            "Shampoo",
            lambda ps: Shampoo(ps, lr=1e-3, precondition_frequency=never),
            lambda ps: Shampoo(ps, lr=1e-3, precondition_frequency=1),
        ),
        (
            "SOAP",
            lambda ps: SOAP(ps, lr=1e-3, precondition_frequency=never),
            lambda ps: SOAP(ps, lr=1e-3, precondition_frequency=1),
        ),
    ]
    refresh_repeats = max(1, repeats // 3)
    for name, cached_factory, refresh_factory in cases:
        params = _params(shapes, 0)
        opt = cached_factory(params)
        _set_grads(params, 0)
        first = _timed(opt.step)  # roots / eigh bases computed here
        cached = []
        for step in range(1, repeats + 1):
            _set_grads(params, step)
            cached.append(_timed(opt.step))
        params = _params(shapes, 0)
        opt = refresh_factory(params)
        _set_grads(params, 0)
        opt.step()
        refresh = []
        for step in range(1, refresh_repeats + 1):
            _set_grads(params, step)
            refresh.append(_timed(opt.step))
        what = "eigh inverse roots" if name == "Shampoo" else "QR basis refresh"
        print(f"  {name:8s} first step {_ms(first)} | cached step {_ms(statistics.median(cached))} "
              f"(median of {repeats}) | step with {what} {_ms(statistics.median(refresh))} (median of {refresh_repeats})")


def bench_batched_ns(hidden: int, group_size: int, repeats: int) -> None:
    shapes = dict(block_shapes(hidden))
    shapes["small 128x128"] = (128, 128)
    shapes["head 64x256"] = (64, 256)
    print(f"\n== Batched Newton-Schulz vs loop (bf16, 5 steps), stacks of {group_size} same-shape matrices")
    for name, shape in shapes.items():
        gen = torch.Generator().manual_seed(7)
        mats = [torch.randn(shape, generator=gen) for _ in range(group_size)]
        loop_out = torch.stack([newton_schulz(m) for m in mats])
        batched_out = batched_newton_schulz(mats)
        equal = torch.equal(loop_out, batched_out)
        loop_t, batch_t = [], []
        for i in range(repeats):
            pair = [("loop", lambda: [newton_schulz(m) for m in mats]), ("batched", lambda: batched_newton_schulz(mats))]
            for label, fn in pair if i % 2 == 0 else pair[::-1]:
                (loop_t if label == "loop" else batch_t).append(_timed(fn))
        lm, bm = statistics.median(loop_t), statistics.median(batch_t)
        diff = (loop_out.float() - batched_out.float()).abs().max().item()
        print(f"  {name:14s} {str(list(shape)):12s} loop {_ms(lm)}  batched {_ms(bm)}  speed-up {lm / bm:5.2f}x  "
              f"bitwise equal: {equal}" + ("" if equal else f" (max |diff| {diff:.3g})"))


def bench_finiteness(hidden: int, copies: int, repeats: int) -> None:
    shapes = block_shapes(hidden)
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(shape, generator=gen) for _ in range(copies) for shape in shapes.values()]
    numel = sum(g.numel() for g in grads)
    print(f"\n== Finiteness test of {len(grads)} gradients ({copies} blocks' matrices, {numel} fp32 elements)")

    def exact_only(ts: list[torch.Tensor]) -> torch.Tensor:
        # the min and max of every tensor, stacked: nonfinite_flags' exact test without the sum first
        lo_hi = torch.stack([x for t in ts for x in torch.aminmax(t)]).view(-1, 2)
        return ~torch.isfinite(lo_hi).all(dim=1)

    tests: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
        "canzona nonfinite_flags": nonfinite_flags,
        "aminmax per tensor": exact_only,
        "isfinite(g).all() per tensor": lambda ts: torch.stack([~torch.isfinite(t).all() for t in ts]),
    }
    times: dict[str, list[float]] = {k: [] for k in tests}
    for i in range(repeats + 1):
        order = list(tests.items())
        for name, fn in order[i % len(order):] + order[: i % len(order)]:
            elapsed = _timed(lambda fn=fn: bool(fn(grads).any()))
            if i:
                times[name].append(elapsed)
    bad = [g.clone() for g in grads]
    bad[len(bad) // 2].view(-1)[7] = float("nan")
    verdicts = {name: fn(bad).tolist() for name, fn in tests.items()}
    same = len({tuple(v) for v in verdicts.values()}) == 1 and sum(verdicts["canzona nonfinite_flags"]) == 1
    ref = statistics.median(times["canzona nonfinite_flags"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:30s} {_ms(med)}  {med / ref:6.2f}x canzona's")
    print(f"  the three name the same tensor holding one NaN: {same}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size for Muon and batched NS")
    parser.add_argument("--eig-hidden", type=int, default=256, help="hidden size for Shampoo and SOAP")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps per measurement")
    parser.add_argument("--group-size", type=int, default=4, help="matrices per batched NS stack")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default); "
                        "1 gives steadier medians on a shared, oversubscribed machine")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.eig_hidden, args.repeats = 64, 32, 3
    for name in ("hidden", "eig_hidden", "repeats", "group_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    # Other processes on a small machine distort medians; the load average says how much.
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 params, "
          f"{os.cpu_count()} CPUs, load average {load}")
    start = time.perf_counter()
    bench_muon(args.hidden, args.repeats)
    bench_eig_optimizers(args.eig_hidden, args.repeats)
    bench_batched_ns(args.hidden, args.group_size, max(3, args.repeats // 2))
    bench_finiteness(args.hidden, 4, args.repeats)
    print(f"\ntotal wall time {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
