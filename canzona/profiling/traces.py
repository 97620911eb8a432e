"""Trace summaries: the Chrome-trace JSON that ``torch.profiler`` writes, turned into a phase table.

Every phase of an iteration is a ``torch.profiler.record_function`` range named after
:mod:`canzona.runtime.phases` (the paper's iteration anatomy, Sections 3-4: forward, backward with
the bucket reduce-scatters / all-reduces, the optimizer step with its local updates and TP
micro-group gather -> compute -> scatter -> apply, the parameter all-gather). The profiler's
TensorBoard handler writes one ``*.pt.trace.json`` per rank; :func:`load_traces` reads them all and
returns the *phase table*, one row per phase occurrence:

=========  =====  ===================================================================
column     type   meaning
=========  =====  ===================================================================
rank       int    global rank that recorded the phase
step       int    training step (the profiler's ``ProfilerStep#N`` window that holds it)
phase      str    base phase name without suffix (``canzona/tp/gather``)
part       str    ``""`` or the suffix without its first slash: the index (``bucket3``,
                  ``group1``) and/or the stage (``bucket3/wait``, ``launch``)
start_us   float  start in microseconds on a clock common to all ranks, 0 = earliest phase
dur_us     float  duration in microseconds (>= 0)
depth      int    nesting depth among canzona phases on that rank, 0 = outermost
=========  =====  ===================================================================

Launch and wait: a collective started asynchronously is two ranges, ``<name>/launch`` (issuing
it) and ``<name>/wait`` (blocking until it lands; :mod:`canzona.phase_names`). Traces written
before that grammar give both ranges the same name; when such a name occurs exactly twice in one
step on one rank, the first is read as the launch and the second as the wait. The summaries keep
the stages apart: a 14 us launch and a 10 ms wait are different rows.

Why the clock is common: Kineto writes ``ts`` as wall-clock (epoch) time minus the trace's
``baseTimeNanoseconds``; adding the base back puts every process of one machine on the same clock.

On top of the table: :func:`phase_stats` (per-phase statistics), :func:`step_makespans`
(iteration, fwd-bwd and optimizer-step makespans per step), :func:`critical_path` (which rank and
which phases bound each optimizer step) and :func:`write_summary` (CSV, plus Parquet when pyarrow
is installed). The timeline notebook reads what :func:`write_summary` writes
(:mod:`canzona.viz.timeline`).
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from canzona.fileio import atomic_write, loads_json, read_json
from canzona.phase_names import (
    BACKWARD,
    COMM_PHASES,
    COMPUTE_PHASES,
    DP_ALL_GATHER,
    FORWARD,
    LAUNCH,
    OPTIMIZER_COMM_PHASES,
    OPTIMIZER_STEP,
    STATUS,
    WAIT,
    is_communication,
    parse,
)

__all__ = [
    "COMM_PHASES",
    "comm_exposure",
    "phase_kind",
    "stage_of",
    "COMPUTE_PHASES",
    "META_KEYS",
    "PHASE_COLUMNS",
    "PREFIX",
    "STEP_OWN_TIME",
    "critical_path",
    "infer_old_stages",
    "load_traces",
    "parse_trace",
    "phase_stats",
    "read_meta",
    "read_trace",
    "step_makespans",
    "trace_files",
    "write_meta",
    "write_summary",
]

#: column -> dtype of the phase table (the contract the timeline notebook codes against)
PHASE_COLUMNS: dict[str, str] = {
    "rank": "int64",
    "step": "int64",
    "phase": "object",
    "part": "object",
    "start_us": "float64",
    "dur_us": "float64",
    "depth": "int64",
}
#: every canzona phase name starts with this
PREFIX = "canzona/"
# COMPUTE_PHASES (optimizer math, the work Canzona balances) and COMM_PHASES (every phase that
# moves bytes; each of its stages is classed ``comm`` by phase_kind) are canzona.phase_names's:
# one definition. The step summary's ``optimizer_comm_us`` counts OPTIMIZER_COMM_PHASES, the
# exchanges of optimizer data inside the step.
META_KEYS: tuple[str, ...] = ("strategy", "optimizer", "dp", "tp", "steps", "model")

_TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_RANK_RE = re.compile(r"rank(\d+)")
# Kineto writes start and duration with nanosecond resolution in microseconds; a child that ends
# "after" its parent by less than this is rounding, not a broken nesting.
_EPS_US = 1e-3


# ------------------------------------------------------------------------------------------ reading
def trace_files(directory: str | Path) -> list[Path]:
    """The ``*.pt.trace.json`` (or ``.json.gz``) files directly under ``directory``, sorted."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"trace directory not found: {d}")
    files = sorted(p for p in d.iterdir() if p.is_file() and p.name.endswith(_TRACE_SUFFIXES))
    if not files:
        raise FileNotFoundError(f"{d}: no *.pt.trace.json files (run `canzona profile --tensorboard {d}` first)")
    return files



def read_trace(path: str | Path) -> dict[str, Any]:
    """Parse one Chrome-trace file strictly (no NaN/Infinity); ValueError when it is not a trace."""
    p = Path(path)
    raw = p.read_bytes()
    if p.name.endswith(".gz"):
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise ValueError(f"{p}: not a gzip file ({exc})") from None
    try:
        doc = loads_json(raw, str(p), max_bytes=1 << 34)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{p}: not a valid Chrome-trace JSON file ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{p}: a Chrome trace is a JSON object with a 'traceEvents' list")  # noqa: TRY004 - bad file content
    return doc


def _trace_rank(doc: dict[str, Any], path: Path) -> int:
    info = doc.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int) and not isinstance(info["rank"], bool):
        return int(info["rank"])
    m = _RANK_RE.search(path.name)
    if m:
        return int(m.group(1))
    raise ValueError(f"{path}: cannot tell which rank wrote this trace (no distributedInfo.rank, no 'rank<N>' in the file name)")


def _base_ns(doc: dict[str, Any], path: Path) -> int:
    base = doc.get("baseTimeNanoseconds", 0)
    if not isinstance(base, int) or isinstance(base, bool) or base < 0:
        raise ValueError(f"{path}: baseTimeNanoseconds must be a non-negative integer, got {base!r}")
    return base


def _complete_events(doc: dict[str, Any], path: Path) -> Iterable[tuple[str, float, float]]:
    """(name, ts, dur) of the CPU-side record_function ranges (``user_annotation``) of a trace."""
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, dict) or e.get("ph") != "X" or e.get("cat") != "user_annotation":
            continue
        name, ts, dur = e.get("name"), e.get("ts"), e.get("dur", 0.0)
        if not isinstance(name, str):
            continue
        if not (isinstance(ts, int | float) and isinstance(dur, int | float)) or isinstance(ts, bool) or isinstance(dur, bool):
            raise ValueError(f"{path}: event {i} ({name!r}) has a non-numeric ts/dur")  # noqa: TRY004 - bad file content
        if not (np.isfinite(ts) and np.isfinite(dur)) or dur < 0:
            raise ValueError(f"{path}: event {i} ({name!r}) has ts={ts!r}, dur={dur!r}")
        yield name, float(ts), float(dur)


def _split(name: str) -> tuple[str, str]:
    """``canzona/dp/reduce_scatter/bucket3/wait`` -> (``canzona/dp/reduce_scatter``, ``bucket3/wait``)."""
    base = parse(name).base
    return base, name[len(base) + 1 :] if base != name else ""


def stage_of(part: str) -> str:
    """The stage in a phase table's ``part`` (``launch``, ``wait``), or ``""``."""
    tail = part.rsplit("/", 1)[-1] if part else ""
    return tail if tail in (LAUNCH, WAIT) else ""


def phase_kind(phase: str, part: str = "") -> str:
    """``compute`` (optimizer math), ``comm`` (any stage of a collective, waits included) or
    ``other``."""
    if phase in COMPUTE_PHASES:
        return "compute"
    return "comm" if is_communication(phase) else "other"


def infer_old_stages(df: pd.DataFrame) -> pd.DataFrame:
    """Traces from before the launch/wait grammar: a communication name seen exactly twice in one
    step on one rank is its launch then its wait (see the module docstring). Rows that already
    carry a stage, the status exchanges (``canzona/status``, synchronous, twice per step) and every
    other row are left as they are."""
    if df.empty:
        return df
    # the status exchange came with the stage grammar and always runs synchronously: never paired
    unstaged = df["phase"].map(is_communication) & (df["part"].map(stage_of) == "") & (df["phase"] != STATUS)
    if not unstaged.any():
        return df
    sub = df[unstaged].sort_values("start_us", kind="stable")
    counts = sub.groupby(["rank", "step", "phase", "part"])["start_us"].transform("size")
    order = sub.groupby(["rank", "step", "phase", "part"]).cumcount()
    pairs = sub[counts == 2]
    stage = np.where(order[counts == 2] == 0, LAUNCH, WAIT)
    out = df.copy()
    out.loc[pairs.index, "part"] = [f"{p}/{st}" if p else st for p, st in zip(pairs["part"], stage)]
    return out


def _depths(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Nesting depth of each interval among the others (input sorted by start, longer first)."""
    depth = np.zeros(len(starts), dtype=np.int64)
    stack: list[float] = []
    for i, (s, e) in enumerate(zip(starts, ends)):
        while stack and stack[-1] <= s + _EPS_US:
            stack.pop()
        depth[i] = len(stack)
        stack.append(e)
    return depth


def parse_trace(doc: dict[str, Any], *, rank: int, source: str = "trace") -> pd.DataFrame:
    """The phase rows of one rank's trace, with ``start_us`` still on the trace's own clock
    (``ts`` + base time in us). Step = the ``ProfilerStep#N`` window that holds the phase's start;
    a trace without those windows (recorded without a schedule) numbers steps by forward passes."""
    path = Path(source)
    base_us = _base_ns(doc, path) / 1e3
    phases: list[tuple[str, float, float]] = []
    windows: list[tuple[int, float, float]] = []
    for name, ts, dur in _complete_events(doc, path):
        if name.startswith(PREFIX):
            phases.append((name, ts, dur))
        else:
            m = _STEP_RE.match(name)
            if m:
                windows.append((int(m.group(1)), ts, ts + dur))
    if not phases:
        return _empty()
    phases.sort(key=lambda x: (x[1], -x[2]))
    names = [p[0] for p in phases]
    ts = np.array([p[1] for p in phases])
    dur = np.array([p[2] for p in phases])
    if windows:
        windows.sort(key=lambda w: w[1])
        w_start = np.array([w[1] for w in windows])
        idx = np.searchsorted(w_start, ts + _EPS_US, side="right") - 1
        w_end = np.array([w[2] for w in windows])
        inside = (idx >= 0) & (ts <= w_end[np.clip(idx, 0, None)] + _EPS_US)
        steps = np.where(inside, np.array([w[0] for w in windows])[np.clip(idx, 0, None)], -1)
    else:
        fwd = np.array([n == FORWARD for n in names])
        if not fwd.any():
            raise ValueError(f"{source}: no ProfilerStep windows and no {FORWARD} phases: cannot tell steps apart")
        steps = np.cumsum(fwd) - 1
    keep = steps >= 0  # phases outside every profiled step window are partial; they are not steps
    depth = _depths(ts, ts + dur)
    split = [_split(n) for n in names]
    df = pd.DataFrame(
        {
            "rank": np.full(len(names), rank, dtype=np.int64),
            "step": steps.astype(np.int64),
            "phase": [s[0] for s in split],
            "part": [s[1] for s in split],
            "start_us": ts + base_us,
            "dur_us": dur,
            "depth": depth,
        }
    )
    return infer_old_stages(df[keep].reset_index(drop=True))


def _empty() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in PHASE_COLUMNS.items()})


def load_traces(directory: str | Path) -> pd.DataFrame:
    """The phase table of every rank's trace under ``directory`` (see the module docstring).

    Raises FileNotFoundError when there is no trace, ValueError for a malformed trace, two traces
    of the same rank (profile into an empty directory) or traces without any canzona phase."""
    files = trace_files(directory)
    docs: list[tuple[int, dict[str, Any], Path]] = []
    seen: dict[int, Path] = {}
    for f in files:
        doc = read_trace(f)
        rank = _trace_rank(doc, f)
        if rank in seen:
            raise ValueError(f"{directory}: two traces of rank {rank} ({seen[rank].name}, {f.name}); keep one profile per directory")
        seen[rank] = f
        docs.append((rank, doc, f))
    # Keep precision: express every base time relative to the smallest one before going to float.
    base0 = min(_base_ns(doc, f) for _, doc, f in docs)
    tables = []
    for rank, doc, f in docs:
        shifted = dict(doc, baseTimeNanoseconds=_base_ns(doc, f) - base0)
        tables.append(parse_trace(shifted, rank=rank, source=str(f)))
    df = pd.concat(tables, ignore_index=True) if tables else _empty()
    if df.empty:
        raise ValueError(f"{directory}: the traces hold no '{PREFIX}*' phases (were the steps run inside the profiler's active window?)")
    df["start_us"] = df["start_us"] - float(df["start_us"].min())
    df = df.astype(PHASE_COLUMNS)
    return df.sort_values(["rank", "step", "start_us", "depth"], kind="stable").reset_index(drop=True)


# ------------------------------------------------------------------------------------------ statistics
def _check_table(df: pd.DataFrame) -> None:
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"expected a phase table (pandas DataFrame), got {type(df).__name__}")
    missing = [c for c in PHASE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"not a phase table: missing column(s) {', '.join(missing)}")
    if df.empty:
        raise ValueError("the phase table is empty")


def phase_stats(df: pd.DataFrame) -> pd.DataFrame:
    """Per base phase and stage (``launch``, ``wait`` or ``""``): ``kind`` (:func:`phase_kind`),
    occurrences, ranks, total / mean / median / min / max / std duration (us), and
    ``per_rank_step_us``, the mean over (rank, step) of the phase's summed duration. Nested
    occurrences of the same phase (a deferred TP gather inside another) count once each."""
    _check_table(df)
    d = df.assign(stage=df["part"].map(stage_of))
    keys = ["phase", "stage"]
    g = d.groupby(keys)["dur_us"]
    out = pd.DataFrame(
        {
            "calls": g.size(),
            "ranks": d.groupby(keys)["rank"].nunique(),
            "total_us": g.sum(),
            "mean_us": g.mean(),
            "median_us": g.median(),
            "min_us": g.min(),
            "max_us": g.max(),
            "std_us": g.std(ddof=0),
        }
    )
    per = d.groupby([*keys, "rank", "step"])["dur_us"].sum().groupby(keys).mean()
    out["per_rank_step_us"] = per
    out = out.sort_values("total_us", ascending=False).reset_index()
    out.insert(2, "kind", [phase_kind(p) for p in out["phase"]])
    return out


def comm_exposure(df: pd.DataFrame) -> pd.DataFrame:
    """Exposed communication per communication phase: how long ranks were blocked on it.

    Per base phase, as means over (rank, step) of summed microseconds: ``launch_us`` (issuing
    asynchronous collectives), ``wait_us`` (blocking until they land), ``sync_us`` (collectives
    run synchronously, no stage), ``exposed_us`` = ``wait_us + sync_us`` (communication time no
    compute hides: the rank could do nothing else), ``in_flight_us`` (launch start to wait end of
    each launch/wait pair), ``hidden_us`` (``in_flight`` minus launch and wait: the time the
    collective ran while the rank worked) and ``hidden_share`` = hidden / in flight. These are
    host-side ranges: on a GPU they measure how long the CPU waited, not the streams.
    """
    _check_table(df)
    d = df[df["phase"].map(is_communication)].copy()
    cols = ["phase", "launch_us", "wait_us", "sync_us", "exposed_us", "in_flight_us", "hidden_us", "hidden_share"]
    if d.empty:
        return pd.DataFrame(columns=cols)
    d["stage"] = d["part"].map(stage_of)
    d["index"] = [p.rsplit("/", 1)[0] if st and "/" in p else ("" if st else p) for p, st in zip(d["part"], d["stage"])]
    n_rank_steps = df.groupby(["rank", "step"]).ngroups
    rows = []
    for name, g in d.groupby("phase", sort=True):
        launch = float(g.loc[g["stage"] == LAUNCH, "dur_us"].sum())
        wait = float(g.loc[g["stage"] == WAIT, "dur_us"].sum())
        sync = float(_outermost(g[g["stage"] == ""], (name,))["dur_us"].sum())
        in_flight = hidden = 0.0
        for _, q in g[g["stage"] != ""].sort_values("start_us", kind="stable").groupby(["rank", "index"]):
            pending: tuple[float, float] | None = None
            for st, s0, du in zip(q["stage"], q["start_us"], q["dur_us"]):
                if st == LAUNCH:
                    pending = (float(s0), float(du))
                elif pending is not None:
                    span = float(s0 + du) - pending[0]
                    in_flight += span
                    hidden += max(0.0, span - pending[1] - float(du))
                    pending = None
        rows.append({
            "phase": name,
            "launch_us": launch / n_rank_steps,
            "wait_us": wait / n_rank_steps,
            "sync_us": sync / n_rank_steps,
            "exposed_us": (wait + sync) / n_rank_steps,
            "in_flight_us": in_flight / n_rank_steps,
            "hidden_us": hidden / n_rank_steps,
            "hidden_share": hidden / in_flight if in_flight > 0 else np.nan,
        })
    return pd.DataFrame(rows, columns=cols).sort_values("exposed_us", ascending=False, kind="stable").reset_index(drop=True)


def _outermost(df: pd.DataFrame, names: Iterable[str]) -> pd.DataFrame:
    """Rows of the given phases that are not nested inside another row of those phases (so a
    nested re-entry, e.g. the next micro-group's gather launched inside a gather, is not counted twice)."""
    names = tuple(names)
    sub = df[df["phase"].isin(names)].sort_values(["rank", "start_us", "dur_us"], ascending=[True, True, False])
    keep = np.ones(len(sub), dtype=bool)
    end_by_rank: dict[int, float] = {}
    for i, (r, s, d) in enumerate(zip(sub["rank"].to_numpy(), sub["start_us"].to_numpy(), sub["dur_us"].to_numpy())):
        end = end_by_rank.get(int(r), -np.inf)
        if s + d <= end + _EPS_US:
            keep[i] = False
        else:
            end_by_rank[int(r)] = max(end, s + d)
    return sub[keep]


def _per_rank(df: pd.DataFrame, names: Iterable[str], ranks: Iterable[int]) -> pd.Series:
    s = _outermost(df, names).groupby("rank")["dur_us"].sum()
    return s.reindex(list(ranks), fill_value=0.0)


def _exposed(d: pd.DataFrame) -> pd.Series:
    """Per rank: summed durations of wait stages and synchronous communication ranges (outermost)."""
    comm = d[d["phase"].map(is_communication)]
    blocked = comm[comm["part"].map(stage_of) != LAUNCH]
    if blocked.empty:
        return pd.Series(dtype=float)
    keep = _outermost(blocked, blocked["phase"].unique())
    return keep.groupby("rank")["dur_us"].sum()


def step_makespans(df: pd.DataFrame) -> pd.DataFrame:
    """Per step, across ranks (us):

    - ``iteration_us``: earliest phase start to latest phase end over all ranks;
    - ``fwd_bwd_us``: the slowest rank's forward start -> backward end;
    - ``optimizer_us``: the slowest rank's ``canzona/optimizer/step`` duration (summed when a rank
      enters it more than once), ``optimizer_span_us``: first entry to last exit over ranks;
    - ``optimizer_compute_us``: the largest per-rank optimizer math time (local updates + TP
      compute), ``optimizer_comm_us``: the largest per-rank TP exchange / broadcast time;
    - ``param_return_us``: the slowest rank's parameter all-gather (after the step; 0 for sc);
    - ``exposed_comm_us``: the largest per-rank time blocked on communication in the step (wait
      stages and synchronous collectives, every phase; see :func:`comm_exposure`);
    - ``slowest_rank``: the rank that leaves the optimizer step last.
    """
    _check_table(df)
    rows = []
    ranks = sorted(int(r) for r in df["rank"].unique())
    for step, d in df.groupby("step", sort=True):
        end = d["start_us"] + d["dur_us"]
        fb = []
        for _, rd in d.groupby("rank"):
            f, b = rd[rd["phase"] == FORWARD], rd[rd["phase"] == BACKWARD]
            if not f.empty and not b.empty:
                fb.append(float((b["start_us"] + b["dur_us"]).max() - f["start_us"].min()))
        opt = _outermost(d, (OPTIMIZER_STEP,))
        opt_end = opt.assign(end=opt["start_us"] + opt["dur_us"]).groupby("rank")["end"].max()
        rows.append(
            {
                "step": int(step),
                "iteration_us": float(end.max() - d["start_us"].min()),
                "fwd_bwd_us": max(fb) if fb else np.nan,
                "optimizer_us": float(opt.groupby("rank")["dur_us"].sum().max()) if not opt.empty else np.nan,
                "optimizer_span_us": float((opt["start_us"] + opt["dur_us"]).max() - opt["start_us"].min()) if not opt.empty else np.nan,
                "optimizer_compute_us": float(_per_rank(d, COMPUTE_PHASES, ranks).max()),
                "optimizer_comm_us": float(_per_rank(d, OPTIMIZER_COMM_PHASES, ranks).max()),
                "param_return_us": float(_per_rank(d, (DP_ALL_GATHER,), ranks).max()),
                "exposed_comm_us": float(_exposed(d).reindex(ranks, fill_value=0.0).max()),
                "slowest_rank": int(opt_end.idxmax()) if not opt_end.empty else -1,
            }
        )
    return pd.DataFrame(rows)


#: the critical-path row of a step's time spent in ``canzona/optimizer/step`` itself, outside every
#: named phase below it
STEP_OWN_TIME = "canzona/optimizer/step (own time)"


def critical_path(df: pd.DataFrame) -> pd.DataFrame:
    """Which rank and which phases bound each optimizer step.

    The step is over when the last rank leaves ``canzona/optimizer/step`` (everyone else waits for
    it in the next collective), so that rank is the critical one. Its step time is split into the
    base phases directly below the step (summed over buckets / micro-groups) plus
    :data:`STEP_OWN_TIME`, the time inside the step outside any child phase (the step's own
    Python work: agreement bookkeeping, hyperparameter push, packing plans). One row per (step, phase,
    stage): ``step``, ``rank``, ``optimizer_us`` (that rank's step duration), ``phase``,
    ``stage`` (``launch``, ``wait`` or ``""``), ``kind`` (``compute``, ``comm`` for every stage of
    a collective, waits included, or ``other``), ``dur_us``, ``share`` (of ``optimizer_us``), and
    ``busiest_rank``: the rank with the most optimizer math (local updates + TP compute) in that
    step, which is where a load imbalance shows first.
    """
    _check_table(df)
    rows = []
    ranks = sorted(int(r) for r in df["rank"].unique())
    for step, d in df.groupby("step", sort=True):
        opt = _outermost(d, (OPTIMIZER_STEP,))
        if opt.empty:
            continue
        opt = opt.assign(end=opt["start_us"] + opt["dur_us"])
        crit = int(opt.groupby("rank")["end"].max().idxmax())
        work = _per_rank(d, COMPUTE_PHASES, ranks)
        busiest = int(work.idxmax())
        spans = opt[opt["rank"] == crit]
        total = float(spans["dur_us"].sum())
        rd = d[d["rank"] == crit]
        kids = []
        for _, sp in spans.iterrows():
            lo, hi, dep = sp["start_us"], sp["end"], int(sp["depth"])
            inside = rd[(rd["depth"] == dep + 1) & (rd["start_us"] >= lo - _EPS_US) & (rd["start_us"] + rd["dur_us"] <= hi + _EPS_US)]
            kids.append(inside)
        kid = pd.concat(kids) if kids else rd.iloc[:0]
        by_phase = kid.assign(stage=kid["part"].map(stage_of)).groupby(["phase", "stage"])["dur_us"].sum()
        untracked = max(0.0, total - float(by_phase.sum()))
        for (name, stage), dur in list(by_phase.items()) + [((STEP_OWN_TIME, ""), untracked)]:
            rows.append(
                {
                    "step": int(step),
                    "rank": crit,
                    "optimizer_us": total,
                    "phase": name,
                    "stage": stage,
                    "kind": phase_kind(name),
                    "dur_us": float(dur),
                    "share": float(dur) / total if total > 0 else 0.0,
                    "busiest_rank": busiest,
                }
            )
    out = pd.DataFrame(rows, columns=["step", "rank", "optimizer_us", "phase", "stage", "kind", "dur_us", "share", "busiest_rank"])
    return out.sort_values(["step", "dur_us"], ascending=[True, False], kind="stable").reset_index(drop=True)


# ------------------------------------------------------------------------------------------ writing
def write_summary(df: pd.DataFrame, out_dir: str | Path, *, parquet: bool | None = None) -> dict[str, Path]:
    """Write the phase table and its summaries under ``out_dir``: ``phases.csv`` (the contract),
    ``phases.parquet`` (``parquet=None``: when pyarrow is installed; False: never, as for the
    committed sample, which must open where pyarrow is missing), ``phase_stats.csv``,
    ``step_makespans.csv``, ``critical_path.csv``, ``comm_exposure.csv``. Times are written to
    1 ns (3 decimals of us), shares to 6 significant digits. Returns {name: path}."""
    _check_table(df)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = df[list(PHASE_COLUMNS)].astype(PHASE_COLUMNS)
    written: dict[str, Path] = {}
    written["phases.csv"] = out / "phases.csv"
    atomic_write(written["phases.csv"], table.to_csv(index=False, float_format="%.3f"))
    stale = out / "phases.parquet"
    if parquet is None:
        try:
            import pyarrow  # noqa: F401 - optional: Parquet only when it is installed
        except ImportError:
            parquet = False
        else:
            parquet = True
    if parquet:
        written["phases.parquet"] = stale
        atomic_write(stale, lambda f: table.to_parquet(f, index=False))
    elif stale.is_file():
        stale.unlink()  # readers prefer Parquet: an old one would shadow the new CSV
    for name, frame in (
        ("phase_stats.csv", phase_stats(table)),
        ("step_makespans.csv", step_makespans(table)),
        ("critical_path.csv", critical_path(table)),
        ("comm_exposure.csv", comm_exposure(table)),
    ):
        written[name] = out / name
        atomic_write(written[name], _rounded(frame).to_csv(index=False))
    return written


def _rounded(frame: pd.DataFrame) -> pd.DataFrame:
    """Microsecond columns to 3 decimals, share columns to 6 significant digits (a 0.03 % share
    must not print as 0.000)."""
    out = frame.copy()
    for c in out.columns:
        if c.endswith("_us"):
            out[c] = out[c].round(3)
        elif "share" in c:
            out[c] = out[c].map(lambda v: float(f"{v:.6g}") if pd.notna(v) else v)
    return out


def write_meta(out_dir: str | Path, *, strategy: str, optimizer: str, dp: int, tp: int, steps: int, model: str) -> Path:
    """Write ``meta.json`` ({strategy, optimizer, dp, tp, steps, model}) beside a phase table."""
    for key, val in (("dp", dp), ("tp", tp), ("steps", steps)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"meta: {key} must be a positive integer, got {val!r}")
    path = Path(out_dir) / "meta.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"strategy": str(strategy), "optimizer": str(optimizer), "dp": dp, "tp": tp, "steps": steps, "model": str(model)}
    atomic_write(path, json.dumps(doc, indent=2) + "\n")
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    """Read a ``meta.json`` (a file or the directory holding it) strictly."""
    p = Path(path)
    if p.is_dir():
        p = p / "meta.json"
    try:
        doc = read_json(p)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or set(doc) != set(META_KEYS):
        raise ValueError(f"{p}: meta.json must be an object with exactly the keys {', '.join(META_KEYS)}")
    return doc
