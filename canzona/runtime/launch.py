"""Start a small process group on this machine: tests, the validation suite, ``canzona train --nproc``.

:func:`run_workers` spawns ``world_size`` processes, joins them into a gloo (or NCCL) group at a
``file://`` rendezvous in a fresh temporary directory (no TCP port that another process could take
between picking and binding it; the directory is removed when the run ends, however it ends,
unless the launcher itself is killed with SIGKILL), runs ``fn(rank, world_size, *args)`` in each
and returns the per-rank results in rank order. It never hangs: the process group has a timeout, the whole run
has a deadline after which every worker is killed, and a failure on any rank is re-raised in the
parent as :class:`WorkerError` naming the rank and carrying the worker's traceback text.

Dead and frozen ranks are named too, without waiting for the process-group timeout: a worker
that dies is reported with its signal (``rank 1 died: killed by signal SIGKILL``) within about a
second; each worker runs a heartbeat thread that stamps a shared array every
:data:`HEARTBEAT_INTERVAL_S`, and a rank whose heartbeat is older than ``heartbeat_timeout_s``
(a SIGSTOPped or otherwise frozen process: its threads stop with it) is reported as frozen,
with its process state, and every worker is killed. The heartbeat starts once the worker is up,
so a slow start-up is bounded by the run's deadline only.

No orphans, no stragglers:

- a worker that fails or dies (any exit, even ``SIGKILL``) is noticed by the parent within about a
  second; the parent then kills every other worker (they would otherwise sit in a collective until
  the process group's timeout) and raises;
- SIGINT or SIGTERM to the parent stops every worker (terminate, then kill after a grace period)
  and raises :class:`LaunchInterrupted` naming the signal; workers ignore SIGINT themselves (a
  Ctrl-C on the terminal reaches the whole process group), so the parent alone decides;
- a worker whose parent disappears (killed with ``SIGKILL``) exits on its own: on Linux the kernel
  sends it SIGKILL (``PR_SET_PDEATHSIG``), elsewhere a watchdog thread notices within a second.

:func:`file_init_method` and :func:`process_group` are the same rendezvous for a group formed by
hand (the tests' one-rank groups). torchrun jobs keep
``env://``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["HEARTBEAT_INTERVAL_S", "HEARTBEAT_TIMEOUT_S", "LaunchInterrupted", "WorkerError", "describe_exit", "file_init_method", "init_process_group", "process_group", "run_workers"]

#: seconds between two heartbeats of a worker
HEARTBEAT_INTERVAL_S = 0.5
#: default age (seconds) of a worker's last heartbeat at which it is reported frozen (well below
#: the process group's 60 s timeout)
HEARTBEAT_TIMEOUT_S = 15.0
#: seconds a terminated worker gets to exit before it is killed
GRACE_S = 3.0


class WorkerError(RuntimeError):
    """A worker failed or the run timed out; the message names the rank(s) and the cause, and
    carries the failing worker's traceback. :attr:`summary` is the first line alone (rank and
    cause), what a command prints; the whole message is for ``--debug`` and the run's log."""

    @property
    def summary(self) -> str:
        text = str(self).strip()
        return text.splitlines()[0] if text else "a worker failed"


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


def file_init_method(directory: str | os.PathLike[str]) -> str:
    """A ``file://`` rendezvous for ``torch.distributed.init_process_group`` in ``directory`` (a
    fresh temporary directory per group, e.g. pytest's ``tmp_path``): unlike a port that was free a
    moment ago, no other process can take it before the group forms. A file left by an earlier
    group that did not end cleanly would be joined as if it were fresh, so an existing file is
    refused."""
    path = Path(directory).resolve() / "rendezvous"
    if path.exists():
        raise ValueError(f"{path} exists: a file rendezvous needs a fresh file per process group")
    return path.as_uri()


def init_process_group(rank: int, world_size: int, init_method: str, *, backend: str = "gloo", timeout_s: float = 60.0) -> None:
    """Join the default process group at ``init_method`` (see :func:`file_init_method`) with a bounded timeout."""
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


@contextlib.contextmanager
def process_group(init_method: str, rank: int = 0, world_size: int = 1, *, backend: str = "gloo", timeout_s: float = 60.0) -> Iterator[None]:
    """Join the default process group at ``init_method`` (see :func:`file_init_method`) with a
    bounded timeout for the duration of the block, then destroy it."""
    init_process_group(rank, world_size, init_method, backend=backend, timeout_s=timeout_s)
    try:
        yield
    finally:
        dist.destroy_process_group()


def describe_exit(code: int | None) -> str:
    """Human words for a process exit code (negative: the signal that killed it)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by signal {name} (exit code {code})"
    return f"exited with code {code}"


def _process_state(pid: int | None) -> str:
    """The kernel's state letter for ``pid`` in words (Linux /proc; "unknown" elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "unknown"
    return {"T": "stopped (SIGSTOP or a debugger)", "t": "stopped by a tracer", "D": "in uninterruptible I/O",
            "Z": "zombie", "R": "running", "S": "sleeping"}.get(state, state)


def _beat(beats: Any, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()
        time.sleep(HEARTBEAT_INTERVAL_S)


def _worker(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str,
    threads: int,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    parent: int,
    beats: Any = None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides what an interrupt means
    _die_with_parent(parent)
    if beats is not None:
        threading.Thread(target=_beat, args=(beats, rank), name="canzona-heartbeat", daemon=True).start()
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        init_process_group(rank, world_size, init_method, backend=backend, timeout_s=pg_timeout_s)
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
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; return results by rank.

    ``fn`` and ``args`` must be picklable (a module-level function). Results travel back through a
    queue, so keep them small (tensors are fine). Raises :class:`WorkerError` when any rank raises,
    or when the run exceeds ``timeout_s`` (all workers are then killed), when a worker dies
    (naming its signal), or when a worker's heartbeat is older than ``heartbeat_timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    run = _Run.make(world_size, backend, threads, pg_timeout_s, fn, args)
    interrupted: list[int] = []
    handlers = _install_handlers(interrupted)
    try:
        for p in run.procs:
            p.start()
        run.collect(time.monotonic() + timeout_s, timeout_s, heartbeat_timeout_s)
        if run.failures:
            raise run.failure_error()
        return [run.got[r] for r in range(world_size)]
    except LaunchInterrupted:
        raise LaunchInterrupted(interrupted[0], _stop(run.procs)) from None
    finally:
        run.close(clean=not run.failures and len(run.got) == world_size and not interrupted)
        for sig, old in handlers.items():
            signal.signal(sig, old)


def _install_handlers(interrupted: list[int]) -> dict[int, Any]:
    """SIGINT and SIGTERM raise :class:`LaunchInterrupted` (recording the signal in
    ``interrupted``); returns the handlers to restore. Only the main thread may install handlers;
    elsewhere (a test runner's thread) the defaults stay."""

    def on_signal(signum: int, _frame: Any) -> None:
        interrupted.append(signum)
        raise LaunchInterrupted(signum, 0)

    handlers: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handlers[sig] = signal.signal(sig, on_signal)
    return handlers


class _Run:
    """The workers of one :func:`run_workers` call, what came back from them, and its clean-up."""

    def __init__(self, procs: list[Any], results: Any, beats: Any, rendezvous: str) -> None:
        self.procs, self.results, self.beats, self.rendezvous = procs, results, beats, rendezvous
        self.world_size = len(procs)
        self.got: dict[int, Any] = {}
        self.failures: list[str] = []

    @classmethod
    def make(cls, world_size: int, backend: str, threads: int, pg_timeout_s: float, fn: Callable[..., Any], args: tuple[Any, ...]) -> "_Run":
        """The processes (not started), the result queue, the heartbeat array and the rendezvous."""
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        # the rendezvous file's directory: fresh per run, removed by close()
        rendezvous = tempfile.mkdtemp(prefix="canzona-rendezvous-")
        init_method = file_init_method(rendezvous)
        # monotonic clock stamps (system-wide on Linux, so comparable across processes); 0: not up yet
        beats = ctx.Array("d", world_size, lock=False)
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, init_method, backend, threads, pg_timeout_s, fn, args, results, os.getpid(), beats),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        return cls(procs, results, beats, rendezvous)

    def collect(self, deadline: float, timeout_s: float, heartbeat_timeout_s: float) -> None:
        """Take results until every rank answered or one failed; :class:`WorkerError` for a run
        past its deadline, a dead worker or a frozen one."""
        while len(self.got) + len(self.failures) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(self.got))
                raise WorkerError(f"distributed run timed out after {timeout_s:.0f} s; ranks {missing} did not finish")
            try:
                rank, ok, payload = self.results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                self._check_alive(heartbeat_timeout_s)
                continue
            if ok:
                self.got[rank] = pickle.loads(payload)  # bytes from our own child process, never from a file
            else:
                self.failures.append(f"rank {rank}: {payload}")
                # One failed rank usually leaves the others blocked in a collective: stop now.
                return

    def _check_alive(self, heartbeat_timeout_s: float) -> None:
        """Raise :class:`WorkerError` naming workers that died, or whose heartbeat is too old."""
        procs, beats, got = self.procs, self.beats, self.got
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got]
        if dead and self.results.empty():
            time.sleep(0.2)
            if self.results.empty():
                what = "; ".join(f"rank {i} died: {describe_exit(procs[i].exitcode)}" for i in dead)
                raise WorkerError(f"{what} (the other ranks were stopped)") from None
        now = time.monotonic()
        frozen = [i for i in range(self.world_size) if i not in got and beats[i] > 0 and now - beats[i] > heartbeat_timeout_s]
        if frozen:
            what = "; ".join(
                f"rank {i} is frozen: no heartbeat for {now - beats[i]:.1f} s (process {_process_state(procs[i].pid)})" for i in frozen
            )
            raise WorkerError(f"{what}; every worker was killed") from None

    def failure_error(self) -> WorkerError:
        """The error for a rank that reported a failure, naming first a rank that died or froze
        meanwhile: a survivor's error is often only the echo of that rank ("Connection closed by
        peer", a status exchange that timed out before the heartbeat limit)."""
        procs, beats, got = self.procs, self.beats, self.got
        first = self.failures[0].rstrip()
        reported = {int(f.split(":", 1)[0].split()[1]) for f in self.failures}
        until = time.monotonic() + 1.0
        dead: list[int] = []
        while not dead and time.monotonic() < until:
            dead = [i for i, p in enumerate(procs) if i not in reported and i not in got and p.exitcode not in (None, 0)]
            if not dead:
                time.sleep(0.05)
        if dead:
            what = "; ".join(f"rank {i} died: {describe_exit(procs[i].exitcode)}" for i in dead)
            return WorkerError(f"{what}; then {first}")
        # a beat several intervals old (or a stopped process) names the frozen rank
        now = time.monotonic()
        stale = [i for i in range(self.world_size) if i not in reported and i not in got and (
            (beats[i] > 0 and now - beats[i] > 5 * HEARTBEAT_INTERVAL_S) or _process_state(procs[i].pid).startswith("stopped"))]
        if stale:
            what = "; ".join(
                f"rank {i} is frozen: "
                + (f"no heartbeat for {now - beats[i]:.1f} s " if beats[i] > 0 else "")
                + f"(process {_process_state(procs[i].pid)})"
                for i in stale
            )
            return WorkerError(f"{what}; then {first}")
        return WorkerError(first)

    def close(self, *, clean: bool) -> None:
        """Join the workers (briefly unless the run ended cleanly), stop what is left, remove the rendezvous."""
        for p in self.procs:
            if p.pid is not None:  # a start() that failed leaves the rest unstarted
                p.join(timeout=5 if clean else 0.5)
        _stop(self.procs)
        shutil.rmtree(self.rendezvous, ignore_errors=True)


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
