"""Start a small process group on this machine: tests, the validation suite, ``canzona train --nproc``.

:func:`run_workers` spawns ``world_size`` processes, joins them into a gloo (or NCCL) group on a
free loopback port picked at run time, runs ``fn(rank, world_size, *args)`` in each and returns
the per-rank results in rank order. It never hangs: the process group has a timeout, the whole run
has a deadline after which every worker is killed, and a failure on any rank is re-raised in the
parent as :class:`WorkerError` naming the rank and carrying the worker's traceback text.

No orphans, no stragglers:

- a worker that fails or dies (any exit, even ``SIGKILL``) is noticed by the parent within about a
  second; the parent then kills every other worker (they would otherwise sit in a collective until
  the process group's timeout) and raises;
- SIGINT or SIGTERM to the parent stops every worker (terminate, then kill after a grace period)
  and raises :class:`LaunchInterrupted` naming the signal; workers ignore SIGINT themselves (a
  Ctrl-C on the terminal reaches the whole process group), so the parent alone decides;
- a worker whose parent disappears (killed with ``SIGKILL``) exits on its own: on Linux the kernel
  sends it SIGKILL (``PR_SET_PDEATHSIG``), elsewhere a watchdog thread notices within a second.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["LaunchInterrupted", "WorkerError", "free_port", "run_workers", "init_process_group"]

#: seconds a terminated worker gets to exit before it is killed
GRACE_S = 3.0


class WorkerError(RuntimeError):
    """A worker failed or the run timed out; the message names the rank(s) and the cause."""


class LaunchInterrupted(RuntimeError):
    """SIGINT or SIGTERM reached the launcher; every worker has been stopped."""

    def __init__(self, signum: int, stopped: int) -> None:
        self.signum = signum
        self.stopped = stopped
        super().__init__(f"stopped by {signal.Signals(signum).name}: {stopped} worker process(es) terminated")


def _die_with_parent(parent: int) -> None:
    """Make this worker exit when the launcher dies, even by SIGKILL (no orphan holding ports)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="canzona-parent-watch", daemon=True).start()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_process_group(rank: int, world_size: int, port: int, *, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Join the default process group over TCP on loopback with a bounded timeout."""
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    threads: int,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    parent: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides what an interrupt means
    _die_with_parent(parent)
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        init_process_group(rank, world_size, port, backend=backend, timeout_s=pg_timeout_s)
        out = fn(rank, world_size, *args)
        # Plain pickle (not the multiprocessing reducer, which shares tensor storage through file
        # descriptors that vanish when this worker exits before the parent reads them).
        results.put((rank, True, pickle.dumps(out)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 180.0,
    pg_timeout_s: float = 60.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Results travel back through a
    queue, so keep them small (tensors are fine). Raises :class:`WorkerError` when any rank raises,
    or when the run exceeds ``timeout_s`` (all workers are then killed).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, backend, threads, pg_timeout_s, fn, args, results, os.getpid()),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    interrupted: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signum)
        raise LaunchInterrupted(signum, 0)

    # Only the main thread may install handlers; elsewhere (a test runner's thread) keep the defaults.
    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, on_signal)
    deadline = time.monotonic() + timeout_s
    got: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for p in procs:
            p.start()
        while len(got) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(got))
                raise WorkerError(f"distributed run timed out after {timeout_s:.0f} s; ranks {missing} did not finish")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got]
                if dead and results.empty():
                    time.sleep(0.2)
                    if results.empty():
                        raise WorkerError(f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})") from None
                continue
            if ok:
                got[rank] = pickle.loads(payload)  # bytes from our own child process, never from a file
            else:
                failures.append(f"rank {rank}: {payload}")
                # One failed rank usually leaves the others blocked in a collective: stop now.
                break
        if failures:
            first = failures[0]
            raise WorkerError(first.rstrip())
        return [got[r] for r in range(world_size)]
    except LaunchInterrupted:
        raise LaunchInterrupted(interrupted[0], _stop(procs)) from None
    finally:
        clean = not failures and len(got) == world_size and not interrupted
        for p in procs:
            p.join(timeout=5 if clean else 0.5)
        _stop(procs)
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _stop(procs: list[Any]) -> int:
    """Terminate the live workers, kill those still alive after :data:`GRACE_S`; how many were live."""
    live = [p for p in procs if p.is_alive()]
    for p in live:
        with contextlib.suppress(Exception):
            p.terminate()
    end = time.monotonic() + GRACE_S
    for p in live:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in live:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return len(live)
