"""The benchmark scripts under ``profiling/`` that have no test of their own: a mistaken argument
is one line and exit status 2 before any work starts (quick gate, in process), and a run at tiny
sizes prints its figures (slow: one spawned run each, a few seconds to a quarter of a minute)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "profiling" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


#: (script, arguments, words the one-line error must hold)
BAD_ARGS = [
    ("bench_annotation", ["--steps", "0"], "--steps must be at least"),
    ("bench_annotation", ["--steps", "4", "--block", "2"], "1 + 2 x --block = 5"),
    ("bench_annotation", ["--dp", "0"], "dp must be a positive integer"),
    ("bench_annotation", ["--strategy", "nope"], "unknown strategy 'nope'"),
    ("bench_annotation", ["--tp", "3"], "tp=3 does not divide"),
    ("bench_checkpoint", ["--hidden", "32"], "--hidden must be a positive multiple of 64"),
    ("bench_checkpoint", ["--layers", "0"], "--layers must be >= 1"),
    ("bench_checkpoint", ["--chunk-mib", "0"], "--chunk-mib must be > 0"),
    ("bench_fsdp2", ["--worlds", "x"], "comma list of integers"),
    ("bench_fsdp2", ["--worlds", "0"], "--worlds must be >= 1"),
    ("bench_fsdp2", ["--steps", "0"], "--steps must be >= 1"),
    ("bench_fsdp2", ["--worlds", "3"], "every width must divide by the world"),
    ("bench_fsdp2", ["--peers", "nope"], "unknown peer 'nope'"),
    ("bench_fsdp2", ["--ns", "mine"], "--ns must be a comma list among own, shared"),
    ("bench_fsdp2", ["--strategies", "zero1"], "--strategies must be a comma list among lb-asc, asc, sc"),
    ("bench_fsdp2", ["--cmax", "2,x"], "--cmax must be a number or a comma list"),
    ("bench_planner", ["--repeat", "0"], "--repeat must be >= 1"),
    ("bench_strategies", ["--dp", "0"], "dp must be a positive integer"),
    ("bench_strategies", ["--tp", "3"], "tp=3 does not divide"),
    ("bench_strategies", ["--model", "nope"], "unknown model 'nope'"),
    ("bench_views", ["--timeout-s", "0"], "timeout-s > 0"),
    ("bench_views", ["--models", "nope"], "models must be among"),
]


@pytest.mark.parametrize("name,args,words", BAD_ARGS, ids=[f"{n}{'_'.join(['', *a])}" for n, a, _ in BAD_ARGS])
def test_a_mistaken_argument_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str], name: str, args: list[str], words: str) -> None:
    mod = _script(name)
    try:
        code = mod.main(args)
    except SystemExit as exc:  # argparse's error
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and words in err[-1], err
    assert not any("Traceback" in line for line in err)


#: (script, tiny-size arguments, lines the output must hold)
RUNS = [
    # dp2 x tp1: the same A/B loop as the default dp2 x tp2 on half the processes
    ("bench_annotation", ["--steps", "3", "--block", "1", "--calls", "10", "--tp", "1"], ["annotation overhead per training step, no profiler attached: estimate"]),
    ("bench_checkpoint", ["--hidden", "64", "--layers", "1", "--ffn", "64", "--vocab", "64", "--chunk-mib", "0.01"],
     ["sharded chunk cap: 0.01 MiB", "consolidated load"]),
    ("bench_fsdp2", ["--worlds", "2", "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ffn", "128", "--vocab", "64",
                     "--steps", "1", "--warmup", "0", "--peers", "none", "--strategies", "lb-asc,sc"], ["world 2, own Newton-Schulz (gloo, one thread per rank", "canzona lb-asc",
                                                                           "canzona sc"]),
    ("bench_planner", ["--repeat", "1", "--skip-1t"], ["qwen3-32b DP32 x TP8", "targets (canzona's planner beyond the paper)"]),
    ("bench_views", ["--models", "tiny", "--steps", "1", "--warmup", "0"], ["parameters bitwise equal between the two: True"]),
    ("bench_strategies", ["--steps", "1", "--warmup", "1", "--strategies", "sc,lb-asc", "--dp", "2", "--tp", "1", "--batch-size", "2",
                          "--seq-len", "8"], ["ratios vs sc", "final parameters: identical across strategies"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,args,lines", RUNS, ids=[n for n, _, _ in RUNS])
def test_a_tiny_run_prints_its_figures(name: str, args: list[str], lines: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "profiling" / f"{name}.py"), *args], capture_output=True, text=True,
                         timeout=240, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    for line in lines:
        assert line in run.stdout, (line, run.stdout[-2000:])


def test_bench_fsdp2_names_a_peer_that_cannot_be_imported_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing peer is one line each (dion skipped; muon-fsdp2 replaced by its labelled
    re-implementation), and the run goes on with the others."""
    mod = _script("bench_fsdp2")
    monkeypatch.setitem(sys.modules, "dion", None)  # import dion now raises ImportError
    monkeypatch.setitem(sys.modules, "muon_fsdp2", None)
    available, lines = mod.peer_status(["dion", "muon-fsdp2"])
    assert available == {"dion": False, "muon-fsdp2": False}
    assert len(lines) == 2 and lines[0].startswith("dion: cannot import dion (") and "skipped" in lines[0]
    assert lines[1].startswith("muon-fsdp2: cannot import muon_fsdp2") and "re-implementation" in lines[1]


def test_bench_fsdp2_counts_dion_bytes_from_its_padded_all_to_alls() -> None:
    """Per group of same-shape matrices, padded to a multiple of the world: two all-to-alls of
    bf16 shards (ceil(rows / world) rows each), every rank keeping 1/world of its own."""
    import torch

    mod = _script("bench_fsdp2")
    model = torch.nn.Module()
    model.a = torch.nn.Linear(6, 5, bias=False)   # 5 x 6: one matrix of its shape
    model.b = torch.nn.Linear(6, 5, bias=False)
    model.c = torch.nn.Linear(5, 8, bias=False)   # 8 x 5: alone
    model.norm = torch.nn.Parameter(torch.ones(5))  # element-wise: not counted
    # world 2: 5x6 pair -> 2 matrices, rows ceil(5/2)=3: 2*(2-1)*2*3*6*2; 8x5 -> padded to 2, rows 4: 2*1*2*4*5*2
    assert mod._dion_bytes(model, 2) == 2 * 1 * 2 * 3 * 6 * 2 + 2 * 1 * 2 * 4 * 5 * 2
    # world 4: each group padded to 4 matrices; rows ceil(5/4)=2 and ceil(8/4)=2
    assert mod._dion_bytes(model, 4) == 2 * 3 * 4 * 2 * 6 * 2 + 2 * 3 * 4 * 2 * 5 * 2
