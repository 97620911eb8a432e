"""Peak memory of checkpoint save/load: sharded (DCP, canzona.runtime.dcp) beside consolidated.

A Qwen3-architecture model of about 100M parameters (hidden 768, 8 layers, ffn 2048, vocab 32000)
trains one step with lb-asc Muon on ``--dp`` local processes (gloo on CPU), then every rank saves
and loads both formats into its trained optimizer. For each phase the benchmark prints, per rank,
the peak resident memory *above* the resident memory before the phase, next to the bytes of
optimizer state the rank owns (fp32 masters plus optimizer state) and the sharded format's chunk
cap (``--chunk-mib``).

How peak memory is measured: on Linux CPU, ``/proc/self/status`` VmHWM (the kernel's high-water
mark of resident memory) after resetting it to the current RSS through ``/proc/self/clear_refs``
(after ``gc.collect`` and ``malloc_trim``, so freed heap is not counted at the start); the figure
is VmHWM minus the RSS at entry. On CUDA, ``torch.cuda.max_memory_allocated`` minus the
allocation at entry. No tracing allocator (tracemalloc) is involved.

The sharded load reads every region twice through a scratch buffer of at most the cap and writes
the state in place (``canzona.runtime.dcp``), so its peak stays near the cap plus DCP's own
per-file bookkeeping; the consolidated format passes the whole state through rank 0 and every
rank holds the whole document while loading.

Run from the repository root::

    .venv/bin/python profiling/bench_checkpoint.py              # dp2, ~100M parameters
    .venv/bin/python profiling/bench_checkpoint.py --dp 4 --layers 4 --chunk-mib 4
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from canzona.runtime.launch import run_workers

PHASES = ("sharded save", "sharded load", "consolidated save", "consolidated load")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


class Peak:
    """Peak memory above the level at entry (bytes): VmHWM on Linux CPU, the allocator on CUDA."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __enter__(self) -> Peak:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            import ctypes
            import gc

            gc.collect()
            ctypes.CDLL(None).malloc_trim(0)  # hand freed heap back, so RSS is what is live now
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            self.base = _rss_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.base
        else:
            self.peak = _rss_kib("VmHWM") * 1024 - self.base


def worker(rank: int, world: int, args: argparse.Namespace, folder: str) -> dict:
    import canzona
    from canzona.config import ModelConfig
    from canzona.models import Qwen3, lm_loss
    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint
    from canzona.runtime import dcp
    from canzona.runtime.dcp import load_sharded, save_sharded

    cfg = ModelConfig(
        name="bench-100m", hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256), head_dim=64,
        vocab_size=args.vocab, tie_word_embeddings=False, max_position_embeddings=64,  # 16-token batches: no big rotary tables
    )
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = Qwen3(cfg).to("cuda" if cuda else "cpu")
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", optimizer_kwargs={"lr": 0.02})
    # random tokens (the Markov sample data keeps a vocab x vocab table: 4 GB at this vocabulary)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(rank))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    lm_loss(model(ids.to(model.lm_head.weight.device)), labels.to(model.lm_head.weight.device)).backward()
    opt.step()
    opt.zero_grad()
    owned = opt.runtime.master_bytes() + opt.state_bytes()
    out = {"params": sum(p.numel() for p in model.parameters()), "owned": owned, "peaks": {}}
    cap = int(args.chunk_mib * 2**20)
    steps = (
        ("sharded save", lambda: save_sharded(opt, Path(folder) / "dcp", chunk_bytes=cap)),
        ("sharded load", lambda: load_sharded(opt, Path(folder) / "dcp", chunk_bytes=cap)),
        ("consolidated save", lambda: save_checkpoint(opt, Path(folder) / "single.pt")),
        ("consolidated load", lambda: load_checkpoint(opt, Path(folder) / "single.pt")),
    )
    for name, fn in steps:
        torch.distributed.barrier()
        with Peak(cuda) as peak:
            fn()
        out["peaks"][name] = peak.peak
        if name == "sharded load":
            out["load_stats"] = dict(dcp.last_load_stats)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2, help="local processes (DP ranks, gloo on CPU)")
    ap.add_argument("--hidden", type=int, default=768, help="model hidden size")
    ap.add_argument("--layers", type=int, default=8, help="transformer layers")
    ap.add_argument("--ffn", type=int, default=2048, help="MLP intermediate size")
    ap.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    ap.add_argument("--chunk-mib", type=float, default=32, help="sharded format: largest stored chunk and load scratch buffer (MiB)")
    args = ap.parse_args(argv)
    for name in ("dp", "layers", "ffn", "vocab"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.hidden < 64 or args.hidden % 64:
        ap.error(f"--hidden must be a positive multiple of 64 (the heads are 64 wide), got {args.hidden}")
    if not args.chunk_mib > 0:
        ap.error(f"--chunk-mib must be > 0, got {args.chunk_mib:g}")
    if not Path("/proc/self/clear_refs").exists() and not torch.cuda.is_available():
        print("bench_checkpoint: needs Linux /proc (or CUDA) to measure peak memory", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        res = run_workers(worker, args.dp, args, folder, timeout_s=1800, pg_timeout_s=600)
    mib = 2**20
    print(f"model: {res[0]['params'] / 1e6:.1f}M parameters, dp={args.dp}, lb-asc Muon + AdamW, fp32 masters")
    print(f"sharded chunk cap: {args.chunk_mib:g} MiB")
    print(f"{'rank':>4}  {'owned state':>12}  " + "  ".join(f"{p:>18}" for p in PHASES) + f"  {'load scratch':>12}")
    for r, out in enumerate(res):
        cells = "  ".join(f"{out['peaks'][p] / mib:>14.1f} MiB" for p in PHASES)
        scratch = out["load_stats"]["scratch_bytes"] / mib
        print(f"{r:>4}  {out['owned'] / mib:>8.1f} MiB  {cells}  {scratch:>8.1f} MiB")
    print("peak = resident memory above the level before the phase (VmHWM on CPU, allocator peak on CUDA)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
