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
    ("bench_annotation", ["--steps", "3", "--block", "1", "--calls", "10"], ["annotation overhead per training step, no profiler attached: estimate"]),
    ("bench_checkpoint", ["--hidden", "64", "--layers", "1", "--ffn", "64", "--vocab", "64", "--chunk-mib", "0.01"],
     ["sharded chunk cap: 0.01 MiB", "consolidated load"]),
    ("bench_fsdp2", ["--worlds", "2", "--layers", "1", "--hidden", "64", "--q", "64", "--kv", "32", "--ffn", "128", "--vocab", "64",
                     "--steps", "1", "--warmup", "0"], ["world 2 (gloo, one thread per rank)", "canzona lb-asc", "muon-fsdp2 scheme"]),
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
