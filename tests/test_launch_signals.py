"""The launcher stops cleanly: SIGINT/SIGTERM stop every worker within seconds with one line and a
non-zero exit, a dying worker stops the others, a killed launcher leaves no orphan (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canzona.runtime.launch import WorkerError, run_workers

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")]

ROOT = Path(__file__).resolve().parents[1]
#: rank 0's first per-step line (the step number is right-aligned to the width of the total)
_FIRST_STEP = re.compile(r"step +1/")


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out |= {int(x) for x in (task / "children").read_text().split()}
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        left = {p for p in pids if _alive(p)}
        if not left:
            return set()
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


def _env(tmp: Path | None = None) -> dict[str, str]:
    """The launcher's environment; with ``tmp``, its temporary directories (the rendezvous) go there."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return env


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_stops_every_worker(sig: signal.Signals, tmp_path: Path) -> None:
    """``canzona train --dp 2`` (its own launcher, ``--nproc`` defaulting to dp*tp) is signalled once
    rank 0 has trained a step: every worker is gone within seconds, one line says why, exit 128+sig,
    and the launcher's rendezvous directory is removed."""
    cmd = [sys.executable, "-m", "canzona", "train", "--dp", "2", "--steps", "100000", "--batch-size", "2", "--seq-len", "8"]
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp), cwd=ROOT)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 150
        line = ""
        while time.monotonic() < deadline and not _FIRST_STEP.match(line):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"launcher exited early: {proc.stderr.read() if proc.stderr else ''}"
        assert _FIRST_STEP.match(line), "training never reached its first step"
        assert [p.name for p in tmp.iterdir() if p.name.startswith("canzona-rendezvous-")], "no file rendezvous under TMPDIR"
        workers = _children(proc.pid)
        assert len(workers) >= 2, workers
        t0 = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, (proc.returncode, err[-2000:])
    assert took < 15, f"stopping took {took:.1f} s"
    last = err.strip().splitlines()[-1]
    assert last == f"canzona train: stopped by {sig.name}: 2 worker process(es) terminated", last
    assert "Traceback" not in err, err[-2000:]
    assert _wait_gone(workers, 10) == set(), "orphaned worker processes"
    assert [p.name for p in tmp.iterdir() if p.name.startswith("canzona-rendezvous-")] == [], "rendezvous directory left behind"


def _die_or_wait(rank: int, world: int) -> None:
    if rank == 1:
        time.sleep(0.5)
        os._exit(7)  # no message, no cleanup: as a crash or the OOM killer would
    time.sleep(300)  # busy for minutes (a long compute): only the launcher can stop it


def test_a_dying_worker_stops_the_others_promptly() -> None:
    import multiprocessing as mp

    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 died: exited with code 7"):
        run_workers(_die_or_wait, 2, timeout_s=120, pg_timeout_s=60)
    took = time.monotonic() - t0
    assert took < 60, f"took {took:.1f} s (rank 0 would have run for 300 s)"
    assert [p for p in mp.active_children() if p.name.startswith("Process")] == []


_SLEEPER = """
import sys, time
from canzona.runtime.launch import run_workers

def sleep(rank, world):
    time.sleep(600)

if __name__ == "__main__":
    print("started", flush=True)
    run_workers(sleep, 2, timeout_s=600)
"""


def test_a_killed_launcher_leaves_no_orphans(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    # a SIGKILLed launcher cannot remove its rendezvous directory: keep it under tmp_path
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=_env(tmp_path), cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        workers: set[int] = set()
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(0.5)
            workers = {p for p in _children(proc.pid) if "sleep" in _cmdline(p) or "spawn_main" in _cmdline(p)}
        assert len(workers) >= 2, "workers never started"
        time.sleep(2.0)  # let them reach the sleep (past the parent-death setup)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _wait_gone(workers, 10) == set(), "workers outlived their killed launcher"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _wait_for_workers(proc: subprocess.Popen, n: int, timeout_s: float) -> set[int]:
    """The launcher's spawned workers once ``n`` of them are up (and past their start-up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"command exited early ({proc.returncode}): {proc.stderr.read() if proc.stderr else ''}"
        workers = {p for p in _children(proc.pid) if "spawn_main" in _cmdline(p)}
        if len(workers) >= n:
            time.sleep(3.0)  # let them reach their work (past the process-group rendezvous)
            return workers
        time.sleep(0.3)
    raise AssertionError("the workers never started")


def _one_line_exit(proc: subprocess.Popen, timeout_s: float = 60) -> tuple[int, list[str], str]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in err, err[-3000:]
    return proc.returncode, err.strip().splitlines(), err


@pytest.mark.parametrize(
    ("argv", "sig", "workers"),
    [
        (["validate", "--quick", "-q", "--no-report"], signal.SIGTERM, 2),
        (["validate", "--quick", "-q", "--no-report"], signal.SIGINT, 2),
        (["profile", "--dp", "2", "--steps", "100000", "--tensorboard", "TB"], signal.SIGTERM, 2),
        (["demo", "--skip-verify", "--steps", "100000", "--out", "DEMO"], signal.SIGTERM, 4),
    ],
    ids=["validate-TERM", "validate-INT", "profile-TERM", "demo-TERM"],
)
def test_every_long_command_stops_on_a_signal_with_one_line(argv: list[str], sig: signal.Signals, workers: int, tmp_path: Path) -> None:
    argv = [str(tmp_path / a) if a in ("TB", "DEMO") else a for a in argv]
    proc = subprocess.Popen([sys.executable, "-m", "canzona", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=_env(tmp_path), cwd=tmp_path)
    try:
        running = _wait_for_workers(proc, workers, 240)
        t0 = time.monotonic()
        proc.send_signal(sig)
        code, lines, err = _one_line_exit(proc)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + sig, (code, err[-2000:])
    assert lines[-1].startswith(f"canzona {argv[0]}: stopped by {sig.name}: ") and lines[-1].endswith("worker process(es) terminated"), lines[-3:]
    assert took < 20, f"stopping took {took:.1f} s"
    assert _wait_gone(running, 10) == set(), "orphaned worker processes"


def test_sigterm_to_a_one_process_run(tmp_path: Path) -> None:
    """``canzona train`` at dp1 (no launcher) also stops with one line and 128 + SIGTERM."""
    cmd = [sys.executable, "-m", "canzona", "train", "--steps", "100000", "--batch-size", "2", "--seq-len", "8", "--no-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path), cwd=tmp_path)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 150
        line = ""
        while time.monotonic() < deadline and not _FIRST_STEP.match(line):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "train exited early"
        proc.send_signal(signal.SIGTERM)
        code, lines, err = _one_line_exit(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGTERM, (code, err[-2000:])
    assert lines == ["canzona train: stopped by SIGTERM"], lines


@pytest.mark.parametrize("how", ["kill", "stop", "timeout"])
def test_a_worker_failure_is_one_line_naming_the_rank(how: str, tmp_path: Path) -> None:
    """At dp2, a rank SIGKILLed or SIGSTOPped mid-run, or a run past ``--timeout-s``: exit 1 and
    one line naming the rank and the cause, no traceback."""
    cmd = [sys.executable, "-m", "canzona", "train", "--dp", "2", "--steps", "100000", "--batch-size", "2", "--seq-len", "8", "--no-log"]
    if how == "timeout":
        cmd += ["--timeout-s", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path), cwd=tmp_path)
    victim = None
    try:
        if how != "timeout":
            victim = max(_wait_for_workers(proc, 2, 240))
            assert proc.stdout is not None
            line, deadline = "", time.monotonic() + 150
            while not _FIRST_STEP.match(line):  # the heartbeats run once the ranks train
                line = proc.stdout.readline()
                assert (line or proc.poll() is None) and time.monotonic() < deadline, "training never reached its first step"
            os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        code, lines, err = _one_line_exit(proc, timeout_s=120)
    finally:
        if victim is not None and how == "stop":
            with contextlib.suppress(OSError):
                os.kill(victim, signal.SIGKILL)
    assert code == 1, (code, err[-2000:])
    assert len(lines) == 1, lines
    want = {"kill": r"canzona train: error: rank [01] died: killed by signal SIGKILL",
            "stop": r"canzona train: error: rank [01] is frozen: (no heartbeat for [\d.]+ s )?\(process stopped",
            "timeout": r"canzona train: error: distributed run timed out after 1 s"}[how]
    assert re.match(want, lines[0]), lines[0]


#: status_timeout_s of the torchrun case (a loaded machine may build the optimizer seconds apart)
TORCHRUN_BOUND_S = 6

_TORCHRUN_WORKER = '''
import os, signal, sys, time
import torch.distributed as dist
from datetime import timedelta
import canzona
from validation.harness import ToyModel, inject_grads, integer_grads

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
rank = dist.get_rank()
model = ToyModel()
dist.barrier()  # construction's own exchanges have the same bound: start it together
opt = canzona.DistributedOptimizer(model, "muon", optimizer_kwargs={"lr": 0.05}, elementwise_kwargs={"lr": 0.01},
                                   bucket_numel=40, status_timeout_s=int(sys.argv[2]))
open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
dist.barrier()
if rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(0.5)
t0 = time.monotonic()
try:
    inject_grads(model, integer_grads(model, step=0, rank=rank))
    opt.step()
except Exception as exc:
    print(f"rank {rank} raised after {time.monotonic() - t0:.2f} s: {exc}", flush=True)
    sys.exit(1)
'''


def test_a_stopped_worker_under_torchrun_is_named_and_not_left_behind(tmp_path: Path) -> None:
    """torchrun (no canzona launcher), rank 1 SIGSTOPped after construction: rank 0's step gives
    up within ``status_timeout_s`` naming rank 1 as stopped and kills it (a stopped process acts
    on no signal but SIGKILL; torchrun alone would send SIGTERM and wait 30 s, and a torchrun that
    is itself killed would leave it behind); torchrun then exits and no worker is left."""
    script = tmp_path / "worker.py"
    script.write_text(_TORCHRUN_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", "--monitor-interval", "0.2", str(script), str(tmp_path), str(TORCHRUN_BOUND_S)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(tmp_path), cwd=ROOT, timeout=240)
    took = time.monotonic() - t0
    pids = {int((tmp_path / f"pid{r}").read_text()) for r in range(2) if (tmp_path / f"pid{r}").exists()}
    left = {p for p in pids if _alive(p)}
    for p in left:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    assert len(pids) == 2, proc.stderr[-3000:]
    assert left == set(), f"worker(s) {left} left behind"
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank 0 raised after")]
    assert said, (proc.stdout[-2000:], proc.stderr[-3000:])
    print(f"\ntime-to-error torchrun, rank 1 SIGSTOPped: {said[0].split(':')[0]}; torchrun exited after {took:.1f} s in all")
    assert "rank 1 is stopped (process" in said[0] and "was killed (SIGKILL)" in said[0], said[0]
    assert float(said[0].split("after ")[1].split(" s")[0]) < TORCHRUN_BOUND_S + 1.5 + 4.0
    assert proc.returncode != 0
    # torchrun's own grace for a worker that ignores SIGTERM is 30 s: exiting sooner shows it did not wait
    assert "Unable to shutdown process" not in proc.stderr, proc.stderr[-3000:]
