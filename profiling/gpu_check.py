"""One command that checks canzona's CUDA / NCCL path on a machine with 1 or more GPUs (< 5 min).

In order, each check bounded in time, every result in one summary table at the end:

1. NCCL exactness cells that fit the GPU count (world 1, 2, 4; one GPU per rank): every DP
   strategy bitwise equal to a single-device run (``validation.gpu.exactness_worker``);
2. the uneven collectives in their NCCL forms, the stream ordering of asynchronous waits, the
   pipelined TP engine on NCCL, and the host synchronizations of one optimizer step;
3. an ``nsys`` capture of ``canzona profile`` (when ``nsys`` is on PATH) and a check that every
   canzona NVTX range the run should open appears in it;
4. Newton-Schulz (Muon, bf16) step time and TFLOP/s per Qwen3-32B shape, written as the
   simulator's calibration file (``canzona simulate --calibration OUT/ns_calibration.csv``);
5. the overlap of a training step: share of NCCL kernel time with a compute kernel running;
6. batched Newton-Schulz against one chain per matrix on CUDA at the expert shapes: whether they
   are bitwise equal (a finding: Muon batches only under ``batched=True``), failing only
   past the documented bound of 64 roundoffs;
7. the piecewise probe of element-wise optimizers on CUDA (``canzona.distributed.check_piecewise``,
   which refuses torch's fused CPU kernels): failing when plain or ``foreach`` AdamW is refused
   there (canzona would refuse its own default), reporting whether ``fused=True`` Adam, AdamW and
   SGD pass on CUDA (a finding: they are accepted where they pass).

Without a CUDA device it prints one line and exits 0 having done nothing. Exit 1 when a check
fails. Written without a GPU at hand: it has never run on one.

    .venv/bin/python profiling/gpu_check.py --out runs/gpu_check
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/gpu_check", help="directory for the nsys report, traces and calibration file")
    p.add_argument("--budget-s", type=float, default=280.0, help="skip the remaining checks past this many seconds (default 280)")
    p.add_argument("--nsys", default="nsys", help="nsys executable (default: nsys on PATH)")
    return p.parse_args(argv)


class Summary:
    def __init__(self, budget_s: float) -> None:
        self.rows: list[tuple[str, str, str]] = []
        self.t0 = time.monotonic()
        self.budget_s = budget_s

    def run(self, name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        if time.monotonic() - self.t0 > self.budget_s:
            self.rows.append((name, "skipped", f"time budget of {self.budget_s:.0f} s spent"))
            return
        t = time.monotonic()
        try:
            ok, detail = fn()
            status = "ok" if ok else "FAIL"
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others
            status, detail = "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.rows.append((name, status, f"{detail} ({time.monotonic() - t:.1f} s)"))
        print(f"gpu_check: {name}: {status}", flush=True)

    def table(self) -> str:
        w = max(len(r[0]) for r in self.rows)
        lines = [f"{'check':{w}s}  status   detail"]
        lines += [f"{n:{w}s}  {s:7s}  {d}" for n, s, d in self.rows]
        return "\n".join(lines)

    @property
    def failed(self) -> bool:
        return any(s == "FAIL" for _, s, _ in self.rows)


def _exactness(world: int) -> tuple[bool, str]:
    from validation import gpu
    from canzona.runtime.launch import run_workers
    from validation.harness import tensors_equal

    got = run_workers(gpu.exactness_worker, world, backend="nccl", timeout_s=150)
    want = gpu.reference_params(world)
    bad = [f"{case}@rank{r}" for case, params in want.items() for r, res in enumerate(got) if tensors_equal(params, res[case])]
    return not bad, f"{len(want)} strategies x {world} ranks bitwise" if not bad else f"differ: {', '.join(bad[:4])}"


def _uneven(world: int) -> tuple[bool, str]:
    import torch

    from validation import gpu
    from canzona.runtime.launch import run_workers

    res = run_workers(gpu.uneven_collectives_worker, world, backend="nccl", timeout_s=90)
    sizes = res[0]["sizes"]
    want = torch.cat([torch.arange(s, dtype=torch.float32) + 100 * r for r, s in enumerate(sizes)])
    ok = all(torch.equal(r["gathered"], want) and r["a2a_in_place"] for r in res)
    return ok, f"all_gather_v sizes {sizes}, all_to_all_v into a given buffer"


def _stream(world: int) -> tuple[bool, str]:
    from validation import gpu
    from canzona.runtime.launch import run_workers

    res = run_workers(gpu.stream_order_worker, world, backend="nccl", timeout_s=90)
    ok = all(not r["nan"] and r["sum"] == r["want"] for r in res)
    return ok, "kernel queued after work.wait() reads the landed data" if ok else f"{res}"


def _tp(world: int) -> tuple[bool, str]:
    from validation import gpu
    from canzona.runtime.launch import run_workers

    res = run_workers(gpu.tp_engine_worker, world, backend="nccl", timeout_s=120)
    bad = sorted({n for r in res for n in r["mismatched"]})
    return not bad, f"{res[0]['groups']} micro-groups, tp={world}, bitwise" if not bad else f"differ: {bad[:3]}"


def _syncs() -> tuple[bool, str]:
    from validation import gpu
    from canzona.runtime.launch import run_workers

    (res,) = run_workers(gpu.host_sync_worker, 1, backend="nccl", timeout_s=90)
    worst = max(res["steps"], key=lambda s: s["syncs"] - s["optimizer_steps"])
    ok = all(s["syncs"] <= s["optimizer_steps"] for s in res["steps"])
    return ok, f"{worst['syncs']} host syncs for {worst['optimizer_steps']} inner optimizer steps" + ("" if ok else f": {worst['first']}")


def _nsys(out: Path, nsys: str, n_gpus: int) -> tuple[bool, str]:
    from canzona.profiling.nsys import nsys_command
    from canzona.profiling.run import expected_phases

    if shutil.which(nsys) is None:
        return True, f"'{nsys}' not on PATH: no capture (install Nsight Systems to run this check)"
    dp, tp = (2, 2) if n_gpus >= 4 else (min(n_gpus, 2), 1)
    rep = out / "gpu_check"
    args = ["--dp", str(dp), "--tp", str(tp), "--steps", "2", "--wait", "1", "--warmup", "0", "--bucket-numel", "200000"]
    cmd = nsys_command(rep, args, nsys=nsys)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    if run.returncode != 0:
        return False, f"nsys profile exited {run.returncode}: {(run.stderr or run.stdout).strip().splitlines()[-1:]}"
    stats = subprocess.run([nsys, "stats", "--report", "nvtx_sum", "--format", "csv", str(rep) + ".nsys-rep"],
                           capture_output=True, text=True, timeout=120)
    text = stats.stdout
    want = sorted(expected_phases("lb-asc", dp=dp, tp=tp))
    missing = [name for name in want if name not in text]
    return not missing, f"dp{dp} x tp{tp}: {len(want) - len(missing)}/{len(want)} canzona ranges in the report" + (
        f"; missing {missing}" if missing else "")


def _ns(out: Path) -> tuple[bool, str]:
    from validation.gpu import ns_tflops
    from canzona.sim.measure import QWEN3_32B_SHAPES, measure_matrix_timings, write_timings_csv

    rows = measure_matrix_timings(QWEN3_32B_SHAPES, optimizer="muon", dtype="bf16", device="cuda", repeats=5)
    path = write_timings_csv(rows, out / "ns_calibration.csv")
    parts = [f"{r['m']}x{r['n']} {r['seconds'] * 1e3:.1f} ms {r['tflops']:.0f} TFLOP/s" for r in ns_tflops(rows)]
    return True, "; ".join(parts) + f"; wrote {path}"


def _overlap(out: Path, world: int) -> tuple[bool, str]:
    from validation import gpu
    from canzona.runtime.launch import run_workers

    res = run_workers(gpu.overlap_worker, world, 4, str(out), backend="nccl", timeout_s=150)
    r = max(res, key=lambda x: x["step_ms"])
    return True, (f"lb-asc dp{world}: step {r['step_ms']:.1f} ms, NCCL kernels {r['comm_ms']:.2f} ms/step, "
                  f"{100 * min(x['overlap'] for x in res):.0f}% of it under compute (worst rank), host waits {r['exposed_wait_ms']:.2f} ms/step")


def _batched_ns() -> tuple[bool, str]:
    import torch

    from canzona.optim.muon import batched_newton_schulz, newton_schulz

    parts, worst = [], 0.0
    for shape in ((96, 64), (384, 256), (64, 64), (192, 64)):
        for name, ns_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            for count in (2, 64):
                g = torch.randn((count, *shape), generator=torch.Generator().manual_seed(count)).cuda()
                loop = torch.stack([newton_schulz(m, dtype=ns_dtype) for m in g])
                diff_u = (loop.double() - batched_newton_schulz(g, dtype=ns_dtype).double()).abs().max().item() / torch.finfo(ns_dtype).eps
                worst = max(worst, diff_u)
                if diff_u:
                    parts.append(f"{count}x{shape[0]}x{shape[1]} {name} {diff_u:.2f} u")
    found = "bitwise at every shape" if not parts else "differs: " + ", ".join(parts[:6])
    return worst <= 64, f"{found} (bound 64 u)"


def _piecewise() -> tuple[bool, str]:
    import torch

    from canzona.distributed import check_piecewise

    dev = torch.device("cuda", 0)

    def passes(cls: type, kwargs: dict, dtype: torch.dtype) -> bool:
        try:
            check_piecewise(cls, kwargs, "probe", device=dev, dtype=dtype)
        except TypeError:
            return False
        return True

    base = {f"AdamW{kw} {str(dt)[6:]}": passes(torch.optim.AdamW, kw, dt) for kw in ({}, {"foreach": True})
            for dt in (torch.float32, torch.bfloat16)}
    fused = {f"{cls.__name__} fused": passes(cls, {"fused": True, **({"momentum": 0.9} if cls is torch.optim.SGD else {})}, torch.float32)
             for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)}
    detail = ", ".join(f"{k}: {'passes' if v else 'refused'}" for k, v in {**base, **fused}.items())
    return all(base.values()), detail


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); nothing done")
        return 0
    from validation.gpu import cells_for

    n = torch.cuda.device_count()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: {n} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, output in {out}", flush=True)
    s = Summary(args.budget_s)
    for w in cells_for(n):
        s.run(f"exactness nccl world {w}", lambda w=w: _exactness(w))
    if n >= 2:
        w = 4 if n >= 4 else 2
        s.run(f"uneven collectives world {w}", lambda: _uneven(w))
        s.run("stream order of async waits", lambda: _stream(2))
        s.run(f"pipelined TP engine tp {w}", lambda: _tp(w))
    else:
        s.rows.append(("multi-rank NCCL checks", "skipped", "one GPU: NCCL needs one GPU per rank"))
    s.run("host syncs in a step", _syncs)
    s.run("nsys NVTX ranges", lambda: _nsys(out, args.nsys, n))
    s.run("Newton-Schulz throughput", lambda: _ns(out))
    s.run("overlap of a step", lambda: _overlap(out, min(n, 2)))
    s.run("batched Newton-Schulz", _batched_ns)
    s.run("piecewise element-wise optimizers", _piecewise)
    print()
    print(s.table())
    return 1 if s.failed else 0


if __name__ == "__main__":
    sys.exit(main())
