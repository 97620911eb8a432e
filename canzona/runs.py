"""Where runs live and what each one logs: a loss/metrics table per run.

``canzona train`` and ``canzona profile`` write, from rank 0, one ``metrics.csv`` per run (always)
and the same numbers as TensorBoard scalars (``events.out.tfevents.*``, when the ``tensorboard``
package is installed) into the run's directory, with a ``run.json`` naming the configuration.
A profile's directory is its TensorBoard logdir, so the scalars sit beside the traces.

``metrics.csv`` columns: ``step`` (0-based), ``loss`` (global mean over DP ranks), ``wall_ms``
(rank 0's wall time from the end of the previous step to the end of this one; empty for the
first step, whose time includes building the model and the plan), then ``<phase>_ms`` for every phase of
:data:`canzona.phase_names.PHASES` (rank 0's wall time in that phase during the step, every stage
and index summed; 0 when the strategy does not run it), then for every communication phase
(:data:`canzona.phase_names.COMM_PHASES`) ``<phase>/launch_ms`` and ``<phase>/wait_ms`` (issuing an
asynchronous collective, blocking until it lands), and last ``comm_exposed_ms``: the step's
communication no compute hid, i.e. every wait plus every collective run synchronously (no stage),
the same quantity the trace summary calls exposed (:func:`canzona.profiling.traces.comm_exposure`).
The times are rank 0's :class:`canzona.runtime.phases.PhaseTimer` readings (host wall clock around
each range), so they agree with the profiler trace of the same steps up to the cost of entering
and leaving a range (tested in tests/test_profiling.py).

User runs go under ``runs/`` of the working directory (the environment variable
``CANZONA_RUNS_DIR`` moves it). Every notebook and figure finds the user's newest run the same
way, :func:`choose_run`: the newest file of the asked kind (:data:`RUN_KINDS`: a profile, a
validation report, a metrics log) under :func:`runs_roots` (``$CANZONA_RUNS_DIR`` when set, else
``runs/`` of the working directory and of its parent, so a notebook started in ``notebooks/``
finds the repository's runs), else the sample shipped inside the package, and always a one-line
note saying which file is shown and why, for the first output of a notebook or figure.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canzona.phase_names import COMM_PHASES, LAUNCH, PHASES, WAIT, parse

__all__ = [
    "PHASE_TABLES",
    "TRACE_SUFFIXES",
    "REPORT_JSON",
    "profile_files",
    "RUN_KINDS",
    "RunChoice",
    "choose_run",
    "find_runs",
    "METRICS_CSV",
    "METRICS_COLUMNS",
    "COMM_EXPOSED",
    "step_metrics",
    "RUN_JSON",
    "RUNS_ENV",
    "MetricsLog",
    "new_run_dir",
    "runs_dir",
    "runs_roots",
]

RUNS_ENV = "CANZONA_RUNS_DIR"
#: the shorter name, accepted the same (``$CANZONA_RUNS_DIR`` wins when both are set)
RUNS_ENV_SHORT = "CANZONA_RUNS"


def _runs_env() -> str | None:
    """The runs folder the environment names, if any."""
    return os.environ.get(RUNS_ENV) or os.environ.get(RUNS_ENV_SHORT) or None
METRICS_CSV = "metrics.csv"
RUN_JSON = "run.json"
#: the communication phases in registry order (their launch and wait stages get columns)
_COMM = tuple(p for p in PHASES if p in COMM_PHASES)
#: the key (and, with ``_ms``, the column) of a step's exposed communication
COMM_EXPOSED = "comm_exposed"
#: the header of metrics.csv, fixed so that every run's table has the same columns
METRICS_COLUMNS: tuple[str, ...] = (
    "step", "loss", "wall_ms", *(f"{p}_ms" for p in PHASES),
    *(f"{p}/{st}_ms" for p in _COMM for st in (LAUNCH, WAIT)), f"{COMM_EXPOSED}_ms",
)


def step_metrics(phases: Mapping[str, float]) -> dict[str, float]:
    """Seconds per metrics key from one step's :class:`~canzona.runtime.phases.PhaseTimer` readings
    (keys ``<base>`` or ``<base>/launch|wait``; index suffixes are accepted and summed): every
    registered base (all its stages), ``<comm base>/launch`` and ``/wait``, and
    :data:`COMM_EXPOSED` (waits plus synchronous collectives). Unregistered names are ignored."""
    out = dict.fromkeys((*PHASES, *(f"{p}/{st}" for p in _COMM for st in (LAUNCH, WAIT)), COMM_EXPOSED), 0.0)
    for key, seconds in phases.items():
        base, _, stage = parse(key)
        if base not in out:
            continue
        out[base] += seconds
        if base in COMM_PHASES:
            if stage:
                out[f"{base}/{stage}"] += seconds
            if stage != LAUNCH:
                out[COMM_EXPOSED] += seconds
    return out


def runs_dir() -> Path:
    """The folder user runs go into: ``$CANZONA_RUNS_DIR`` or ``runs`` (relative to the working
    directory)."""
    return Path(_runs_env() or "runs")


def runs_roots() -> list[Path]:
    """Where to look for runs: ``$CANZONA_RUNS_DIR`` when set, else ``runs/`` of the working
    directory and of its parent (a notebook started in ``notebooks/`` finds the repository's
    runs); only folders that exist, each once."""
    cwd = Path.cwd()
    candidates = [runs_dir()] if _runs_env() else [cwd / "runs", cwd.parent / "runs"]
    out: list[Path] = []
    for c in candidates:
        c = c.resolve()
        if c.is_dir() and c not in out:
            out.append(c)
    return out


#: the file names of a profile's trace summary (a phase table), preferred to its raw traces
PHASE_TABLES = ("phases.parquet", "phases.csv")
#: the file-name endings of a profile's raw torch.profiler traces (one per rank)
TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
REPORT_JSON = "report.json"

#: what each kind of run is called in a note and the command that writes one
RUN_KINDS: dict[str, tuple[str, str]] = {
    "profile": ("profile", "canzona profile --tensorboard runs/<name>"),
    "validation": ("validation report", "canzona validate"),
    "metrics": ("metrics log", "canzona train"),
}


def profile_files(d: Path) -> list[Path]:
    """The files that make directory ``d`` a profile: its phase table(s), else its raw traces."""
    try:
        entries = [p for p in d.iterdir() if p.is_file()]
    except OSError:
        return []
    tables = [p for p in entries if p.name in PHASE_TABLES]
    return tables or [p for p in entries if p.name.endswith(TRACE_SUFFIXES)]


def _candidates(kind: str, root: Path) -> Iterator[tuple[Path, list[Path]]]:
    """(what a run of ``kind`` is opened by, the files whose time dates it) under ``root``."""
    if kind == "profile":
        for d in (root, *(p for p in root.rglob("*") if p.is_dir())):
            files = profile_files(d)
            if files:
                yield d, files
    else:
        name = REPORT_JSON if kind == "validation" else METRICS_CSV
        for f in root.rglob(name):
            if f.is_file():
                yield (f if kind == "validation" else f.parent), [f]


def find_runs(kind: str, roots: list[Path] | None = None) -> list[Path]:
    """Every run of ``kind`` (a key of :data:`RUN_KINDS`) under ``roots`` (default
    :func:`runs_roots`), oldest first by the modification time of its files (path as tie-break):
    a profile's directory, a validation report's ``report.json``, a metrics log's directory."""
    if kind not in RUN_KINDS:
        raise ValueError(f"kind must be one of {', '.join(RUN_KINDS)}, got {kind!r}")
    found: dict[Path, float] = {}
    for root in runs_roots() if roots is None else [Path(r) for r in roots]:
        if root.is_dir():
            for target, files in _candidates(kind, root):
                found[target.resolve()] = max(f.stat().st_mtime for f in files)
    return sorted(found, key=lambda p: (found[p], str(p)))


@dataclass(frozen=True, slots=True)
class RunChoice:
    """The run a view shows: its ``path``, whether it is the shipped ``sample``, and ``note``,
    one line for the view's first output naming the file and why it was chosen."""

    path: Path
    sample: bool
    note: str


def _where(roots: list[Path] | None) -> str:
    if roots is not None:
        return " or ".join(str(r) for r in roots) or "(no folder)"
    if _runs_env():
        name = RUNS_ENV if os.environ.get(RUNS_ENV) else RUNS_ENV_SHORT
        return f"${name} ({runs_dir()})"
    cwd = Path.cwd()
    return f"{cwd / 'runs'} or {cwd.parent / 'runs'}"


def choose_run(kind: str, path: str | Path | None = None, *, sample: Path, roots: list[Path] | None = None) -> RunChoice:
    """``path`` when given (it must exist), else the newest run of ``kind`` (:func:`find_runs`),
    else ``sample`` with a note that says it is the shipped sample and how to make a run."""
    if kind not in RUN_KINDS:
        raise ValueError(f"kind must be one of {', '.join(RUN_KINDS)}, got {kind!r}")
    what, command = RUN_KINDS[kind]
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"{what} not found: {p}")
        return RunChoice(p, False, f"{what}: {p} (the one asked for)")
    runs = find_runs(kind, roots)
    if runs:
        return RunChoice(runs[-1], False, f"{what}: {runs[-1]} (your newest, of {len(runs)} under {_where(roots)})")
    return RunChoice(sample, True, f"{what}: NOTE no {what} of yours under {_where(roots)} (`{command}` writes one); "
                                   f"showing the shipped sample {sample}")


def new_run_dir(label: str) -> Path:
    """A fresh directory name ``<runs>/<label>-<UTC time>`` (``-2``, ``-3``... if taken); not created."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = runs_dir() / f"{label}-{stamp}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


class MetricsLog:
    """Per-step loss and phase times of one run: ``metrics.csv`` (appended every step, so a killed
    run keeps what it did) and TensorBoard scalars when ``tensorboard`` is importable
    (``tensorboard=None``) or asked for: ``loss``, ``time/step_ms``, ``time/<phase>_ms``,
    ``comm/<phase>/launch_ms``, ``comm/<phase>/wait_ms`` and ``comm/exposed_ms`` (phase names
    without their ``canzona/`` prefix; zero-valued phases are not written).

    The CSV never holds a torn row: each row (the header too) is one ``write`` to a descriptor
    opened for appending; a write that fails or stops short (a full disk, a file-size limit) is
    cut back to the end of the last whole row and raises ``OSError`` naming the file. A process
    killed inside that one call of a few hundred bytes (or a machine that loses power before the
    page cache reaches the disk) is the only way left to a partial last line, which then has no
    line end."""

    def __init__(self, directory: str | Path, *, run: Mapping[str, Any] | None = None, tensorboard: bool | None = None) -> None:
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"{self.dir} exists and is not a directory")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / METRICS_CSV
        if self.path.exists():
            raise ValueError(f"{self.path} already exists; log each run into its own directory")
        if run is not None:
            (self.dir / RUN_JSON).write_text(json.dumps(dict(run), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._size = 0
        self._row(METRICS_COLUMNS)
        self.writer: Any = None
        if tensorboard is not False:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                if tensorboard:
                    raise
            else:
                self.writer = SummaryWriter(log_dir=str(self.dir))

    def log(self, step: int, loss: float, wall_s: float, phases: Mapping[str, float]) -> None:
        """One step: the global loss, the step's wall seconds (NaN: unknown) and seconds per phase
        timer key (``<base>`` or ``<base>/launch|wait``, :func:`step_metrics`; names outside
        :data:`~canzona.phase_names.PHASES` have no column)."""
        m = step_metrics(phases)
        row = [int(step), _num(loss), _num(wall_s * 1e3), *(_num(v * 1e3) for v in m.values())]
        self._row(row)
        if self.writer is not None:
            self.writer.add_scalar("loss", float(loss), int(step))
            if math.isfinite(wall_s):
                self.writer.add_scalar("time/step_ms", wall_s * 1e3, int(step))
            for key, v in m.items():
                if v > 0:
                    self.writer.add_scalar(_tag(key), v * 1e3, int(step))

    def _row(self, row: Any) -> None:
        """Append one CSV row whole, or leave the file at its last whole row and raise."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        buf = io.StringIO()
        csv.writer(buf).writerow(row)
        data = buf.getvalue().encode("utf-8")
        try:
            n = os.write(self._fd, data)
            if n != len(data):
                raise OSError(f"only {n} of {len(data)} bytes written (the file system is full or the file size limit reached)")
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise OSError(exc.errno, f"cannot append to {self.path}: {exc.strerror or exc}") from None
        self._size += n

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.writer is not None:
            writer, self.writer = self.writer, None
            try:
                writer.close()
            except OSError as exc:  # TensorBoard's writer names no file
                raise OSError(exc.errno, f"cannot write the TensorBoard scalars in {self.dir}: {exc.strerror or exc}") from None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tag(key: str) -> str:
    """The TensorBoard tag of a :func:`step_metrics` key."""
    if key == COMM_EXPOSED:
        return "comm/exposed_ms"
    name = key.removeprefix("canzona/")
    return f"comm/{name}_ms" if parse(key).stage else f"time/{name}_ms"


def _num(v: float) -> str:
    v = float(v)
    return repr(v) if math.isfinite(v) else ""
