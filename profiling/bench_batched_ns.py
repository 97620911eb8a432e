"""Batched Newton-Schulz against one chain per matrix: matrices per second, side by side.

A host that owns many same-shape expert tasks (Canzona, arXiv 2602.06079, Sec. 3.3 micro-groups;
a MoE layer's E experts) can orthogonalize them with one ``bmm``/``baddbmm`` chain over a stacked
buffer (:func:`canzona.optim.muon.batched_newton_schulz`) instead of E calls of
:func:`canzona.optim.muon.newton_schulz`. This script times both on the same inputs, interleaved
repeat by repeat (so both see the same machine load), and reports the median of each as matrices
per second, plus on how many of ``--inputs`` random stacks the two results are bitwise equal
(whether they are depends on the CPU, the thread count, the shape and the values, so one input
proves little). The default stacks are 64 experts of
96 x 64 and of 384 x 256: Qwen3-30B-A3B's expert matrices (128 per layer of 768 x 2048 and
2048 x 768) scaled down to sizes a CPU times in seconds.

Run from the repository root::

    .venv/bin/python profiling/bench_batched_ns.py                   # 64 x (96x64, 384x256), bf16 NS, 7 repeats
    .venv/bin/python profiling/bench_batched_ns.py --ns-dtype fp32 --threads 2
    .venv/bin/python profiling/bench_batched_ns.py --quick           # 8 experts, 3 repeats, 4 inputs (smoke test)
    .venv/bin/python profiling/bench_batched_ns.py --shapes 24x16,96x64 --experts 8 --inputs 12 --threads 2

On CUDA the bitwise question is a different one (cuBLAS picks kernels per problem size and batch
count, and the batched and single calls need not agree), as it is on CPU: Muon batches only
under ``batched=True``. ``profiling/gpu_check.py`` asks it on the machine: its
"batched Newton-Schulz" check runs both chains on the GPU at the expert shapes above (bf16 and
float32 compute, 2 and 64 matrices per stack), reports per shape whether they are bitwise equal and
the largest difference in units of the compute dtype's roundoff, and fails only if a difference
exceeds the documented bound of 64 u (equality is a finding there, not a requirement). Passing
``--device cuda`` to this script times the two on a GPU as well.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

__all__ = ["compare_shape", "main"]

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        m, sep, n = part.strip().partition("x")
        if not sep or not m.isdigit() or not n.isdigit() or int(m) < 1 or int(n) < 1:
            raise ValueError(f"--shapes must be a comma list of MxN with positive sides, got {part.strip()!r}")
        out.append((int(m), int(n)))
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="96x64,384x256", help="comma list of expert shapes MxN (default 96x64,384x256)")
    p.add_argument("--experts", type=int, default=64, help="matrices per stack (default 64)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats of each variant, interleaved (default 7)")
    p.add_argument("--ns-dtype", choices=sorted(NS_DTYPES), default="bf16", help="Newton-Schulz compute dtype (default bf16)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--inputs", type=int, default=8, help="random stacks compared bit for bit (default 8)")
    p.add_argument("--quick", action="store_true", help="8 experts, 3 repeats and 4 inputs")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compare_shape(shape: tuple[int, int], experts: int, repeats: int, ns_dtype: torch.dtype, device: torch.device,
                  inputs: int = 1) -> dict:
    """Median seconds of the loop and of the batched chain over ``experts`` matrices of ``shape``,
    timed alternately (one warm-up each first) on the first of ``inputs`` random stacks, and on how
    many of those stacks their results are bitwise equal (with the largest difference seen)."""
    from canzona.optim.muon import batched_newton_schulz, newton_schulz

    gen = torch.Generator().manual_seed(0)
    stacks = [torch.randn((experts, *shape), generator=gen).to(device) for _ in range(inputs)]
    stack = stacks[0]
    mats = list(stack.unbind(0))

    def loop() -> torch.Tensor:
        return torch.stack([newton_schulz(m, dtype=ns_dtype) for m in mats])

    def batched() -> torch.Tensor:
        return batched_newton_schulz(stack, dtype=ns_dtype)

    first = (loop(), batched())  # warm-up, and the comparison of the first stack
    times: dict[str, list[float]] = {"loop": [], "batched": []}
    for r in range(repeats):
        order = ("loop", "batched") if r % 2 == 0 else ("batched", "loop")
        for name in order:
            fn = loop if name == "loop" else batched
            _sync(device)
            t = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    equal, diff = 0, 0.0
    for k, st in enumerate(stacks):
        lo, ba = first if k == 0 else (torch.stack([newton_schulz(m, dtype=ns_dtype) for m in st.unbind(0)]),
                                       batched_newton_schulz(st, dtype=ns_dtype))
        equal += int(torch.equal(lo, ba))
        diff = max(diff, (lo.double() - ba.double()).abs().max().item())
    return {"shape": shape, "experts": experts, "loop_s": med["loop"], "batched_s": med["batched"], "inputs": inputs,
            "bitwise_inputs": equal, "bitwise": equal == inputs, "max_diff_u": diff / torch.finfo(ns_dtype).eps}


def _check(args: argparse.Namespace) -> str | None:
    if args.quick:
        args.experts, args.repeats, args.inputs = 8, 3, 4
    if args.inputs < 1:
        return "--inputs must be >= 1"
    if args.experts < 1:
        return "--experts must be >= 1"
    if args.repeats < 1:
        return "--repeats must be >= 1"
    if args.threads < 1:
        return "--threads must be >= 1"
    if args.device not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda, got {args.device!r}"
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device visible"
    try:
        args.shapes = _shapes(args.shapes)
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    err = _check(args)
    if err is not None:
        print(f"bench_batched_ns: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ns_dtype = NS_DTYPES[args.ns_dtype]
    print(f"batched vs one-by-one Newton-Schulz ({args.ns_dtype} compute, {args.device}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, median of {args.repeats} interleaved repeats)")
    print(f"{'shape':>9s} {'experts':>7s} {'loop mat/s':>11s} {'batched mat/s':>14s} {'speed-up':>8s}  bitwise on")
    for shape in args.shapes:
        r = compare_shape(shape, args.experts, args.repeats, ns_dtype, device, args.inputs)
        loop_rate, batch_rate = r["experts"] / r["loop_s"], r["experts"] / r["batched_s"]
        same = f"{r['bitwise_inputs']}/{r['inputs']} inputs" + ("" if r["bitwise"] else f" (max {r['max_diff_u']:.2f} u)")
        print(f"{shape[0]:>4d}x{shape[1]:<4d} {r['experts']:>7d} {loop_rate:>11.1f} {batch_rate:>14.1f} "
              f"{batch_rate / loop_rate:>7.2f}x  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
