"""Real torchrun: ``canzona train`` as one rank per process, and examples/train_hf.py (the README's
Hugging Face example) on transformers' TP plan; rank 0 alone prints, once per step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)


def test_canzona_train_under_torchrun() -> None:
    res = _torchrun("-m", "canzona", "train", "--dp", "2", "--steps", "2", "--batch-size", "2", "--seq-len", "8", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("loss: first") == 1, res.stdout  # one summary: rank 0's
    assert "dp=2 tp=1" in res.stdout


def test_hf_example_under_torchrun_with_transformers_tp_plan() -> None:
    pytest.importorskip("transformers")
    res = _torchrun("examples/train_hf.py", "--dp", "1", "--tp", "2", "--steps", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split(" loss ")[0] for ln in lines] == ["step 1/2", "step 2/2"], res.stdout
