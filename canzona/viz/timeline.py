"""Profiler timelines from a trace summary: per-rank phase timelines, phase breakdowns per
strategy and the optimizer step's critical path.

A *phase table* is the trace summary the profiling scripts write (``phases.csv`` or
``phases.parquet``, one row per phase occurrence) with a ``meta.json`` beside it:

=========  =======  ===============================================================
column     type     meaning
=========  =======  ===============================================================
rank       int      global rank that recorded the phase
step       int      training step
phase      str      base phase name (``canzona/tp/gather``; names of canzona.runtime.phases)
part       str      suffix without the slash (``bucket3``, ``group1``) or ""
start_us   float    start, microseconds on a clock common to all ranks
dur_us     float    duration in microseconds (>= 0)
depth      int      nesting depth, 0 = outermost
=========  =======  ===============================================================

``meta.json``: ``{"strategy", "optimizer", "dp", "tp", "steps", "model"}``.

Which profile: :func:`resolve_profile` picks the user's newest run under ``runs/`` (where
``canzona profile --tensorboard runs/<name>`` writes) and falls back to the shipped sample with a
note saying so. :func:`load_profile` also opens a raw trace directory (one ``*.pt.trace.json`` per
rank) and summarises it on the fly with :func:`canzona.profiling.traces.load_traces`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from canzona.config import PACKAGE_DATA
from canzona.runs import PHASE_TABLES, TRACE_SUFFIXES, choose_run, find_runs, profile_files
from canzona.viz._style import PAPER_MARKER, categorical_colors, finish
from canzona.fileio import loads_json

__all__ = [
    "PHASE_COLUMNS",
    "DEFAULT_PROFILE_DIR",
    "RUNS_DIR",
    "Profile",
    "latest_profile",
    "resolve_profile",
    "validate_phase_table",
    "load_phase_table",
    "load_profile",
    "discover_profiles",
    "phase_label",
    "phase_breakdown",
    "breakdown_by_strategy",
    "rank_phase_durations",
    "optimizer_critical_path",
    "fig_timeline",
    "fig_phase_breakdown",
    "fig_critical_path",
]

#: column -> dtype of a phase table
PHASE_COLUMNS: dict[str, str] = {
    "rank": "int64",
    "step": "int64",
    "phase": "object",
    "part": "object",
    "start_us": "float64",
    "dur_us": "float64",
    "depth": "int64",
}
#: the sample trace summary shipped with the package, which the timeline notebook opens when there
#: is no run of the user's own
DEFAULT_PROFILE_DIR = PACKAGE_DATA / "profiles" / "sample"
_META_KEYS = ("strategy", "optimizer", "dp", "tp", "steps", "model")
#: where user runs live: ``runs/`` of the working directory and of its parent (so that a notebook
#: started in notebooks/ finds the runs of the repository root), or ``$CANZONA_RUNS_DIR``
RUNS_DIR = Path("runs")
_TABLES = PHASE_TABLES
_TRACE_SUFFIXES = TRACE_SUFFIXES


def _runs_roots(roots: Any) -> list[Path] | None:
    if roots is None:
        return None
    if isinstance(roots, str | Path):
        roots = [roots]
    return [Path(r) for r in roots]


def latest_profile(roots: str | Path | list[str | Path] | None = None) -> Path | None:
    """The newest profile (trace summary or raw trace directory) under ``roots`` (default:
    :func:`canzona.runs.runs_roots`), by the modification time of its files; None when there is none."""
    runs = find_runs("profile", _runs_roots(roots))
    return runs[-1] if runs else None


def resolve_profile(path: str | Path | None = None, *, roots: str | Path | list[str | Path] | None = None) -> tuple[Path, str]:
    """The profile to show and the note that says which it is and why (:func:`canzona.runs.choose_run`):
    ``path`` itself, else the newest run (:func:`latest_profile`), else the shipped sample."""
    choice = choose_run("profile", path, sample=DEFAULT_PROFILE_DIR, roots=_runs_roots(roots))
    return choice.path, choice.note


def _optimizer_phase() -> str:
    # imported late: canzona.runtime pulls in torch, which a figure-only session does not need
    from canzona.runtime.phases import OPTIMIZER_STEP

    return OPTIMIZER_STEP


@dataclass(frozen=True, slots=True)
class Profile:
    """A loaded trace summary: the phase table and the run's metadata (may be empty)."""

    phases: pd.DataFrame
    meta: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def label(self) -> str:
        m = self.meta
        if not m:
            return self.source or "profile"
        return f"{m.get('model', '?')}, {m.get('optimizer', '?')}, {m.get('strategy', '?')}, DP{m.get('dp', '?')} x TP{m.get('tp', '?')}"


def validate_phase_table(df: pd.DataFrame, *, source: str = "phase table") -> pd.DataFrame:
    """Check and normalise a phase table: required columns, types, finite non-negative times.
    Returns a copy with the documented dtypes (``part`` NaN -> "") sorted by rank, step, start.
    Raises ValueError naming the first problem."""
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"{source}: expected a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in PHASE_COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"{source}: missing column(s) {', '.join(missing)}; a phase table needs {', '.join(PHASE_COLUMNS)}")
    out = df[list(PHASE_COLUMNS)].copy()
    out["part"] = out["part"].fillna("").astype(str)
    out["phase"] = out["phase"].astype(str)
    if (out["phase"] == "").any() or out["phase"].isin(["nan", "None"]).any():
        raise ValueError(f"{source}: empty phase name in row {int(np.flatnonzero((out['phase'] == '') | out['phase'].isin(['nan', 'None']))[0])}")
    for col in ("rank", "step", "depth"):
        vals = pd.to_numeric(out[col], errors="coerce")
        bad = vals.isna() | (vals != np.floor(vals)) | (vals < 0)
        if bad.any():
            raise ValueError(f"{source}: column {col!r} must hold non-negative integers (row {int(np.flatnonzero(bad)[0])}: {out[col].iloc[int(np.flatnonzero(bad)[0])]!r})")
        out[col] = vals.astype("int64")
    for col in ("start_us", "dur_us"):
        vals = pd.to_numeric(out[col], errors="coerce")
        bad = ~np.isfinite(vals.to_numpy(dtype=np.float64))
        if bad.any():
            raise ValueError(f"{source}: column {col!r} must hold finite numbers (row {int(np.flatnonzero(bad)[0])})")
        out[col] = vals.astype("float64")
    if (out["dur_us"] < 0).any():
        raise ValueError(f"{source}: negative duration in row {int(np.flatnonzero(out['dur_us'] < 0)[0])}")
    return out.sort_values(["rank", "step", "start_us", "depth"], kind="stable").reset_index(drop=True)


def load_phase_table(path: str | Path) -> pd.DataFrame:
    """Read a phase table from ``.csv`` or ``.parquet`` (or a directory holding ``phases.parquet``
    or ``phases.csv``) and validate it. A missing or unreadable file is one clear error."""
    p = Path(path)
    if p.is_dir():
        for name in ("phases.parquet", "phases.csv"):
            if (p / name).is_file():
                p = p / name
                break
        else:
            raise FileNotFoundError(f"{path}: no phases.parquet, phases.csv or *.pt.trace.json in this directory")
    if not p.is_file():
        raise FileNotFoundError(f"phase table not found: {p}")
    try:
        if p.suffix == ".parquet":
            df = pd.read_parquet(p)
        elif p.suffix == ".csv":
            df = pd.read_csv(p, dtype={"phase": str, "part": str}, keep_default_na=False, na_values={"rank": [""], "step": [""]})
        else:
            raise ValueError(f"{p}: a phase table is a .csv or .parquet file")
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError) as exc:
        raise ValueError(f"{p}: cannot read the phase table ({exc})") from None
    from canzona.profiling.traces import infer_old_stages

    return infer_old_stages(validate_phase_table(df, source=str(p)))


def _strict_json(text: str, source: str) -> Any:
    try:
        return loads_json(text, source)
    except json.JSONDecodeError as exc:
        raise ValueError(str(exc)) from None


def load_profile(path: str | Path | None = None) -> Profile:
    """Load a trace summary directory (phase table + ``meta.json``), a raw trace directory (one
    ``*.pt.trace.json`` per rank, summarised here; its ``meta.json`` when ``canzona profile``
    wrote one) or a single phase-table file (then the metadata is empty). None: the profile
    :func:`resolve_profile` picks (the newest run, else the shipped sample)."""
    p = resolve_profile(path)[0]
    if p.is_dir() and not any((p / t).is_file() for t in _TABLES) and any(f.name.endswith(_TRACE_SUFFIXES) for f in profile_files(p)):
        from canzona.profiling.traces import load_traces

        phases = validate_phase_table(load_traces(p), source=str(p))
    else:
        phases = load_phase_table(p)
    meta: dict[str, Any] = {}
    meta_path = p / "meta.json" if p.is_dir() else None
    if meta_path is not None and meta_path.is_file():
        doc = _strict_json(meta_path.read_text(encoding="utf-8"), str(meta_path))
        if not isinstance(doc, dict):
            raise ValueError(f"{meta_path}: metadata must be a JSON object")
        unknown_type = [k for k in ("dp", "tp", "steps") if k in doc and not (isinstance(doc[k], int) and not isinstance(doc[k], bool))]
        if unknown_type:
            raise ValueError(f"{meta_path}: {', '.join(unknown_type)} must be integers")
        meta = doc
    return Profile(phases, meta, str(p))


def _recorded_config(d: Path, base: Path) -> dict[str, Any] | None:
    """The configuration a run recorded (``meta.json`` of ``canzona profile``, else ``run.json``
    of the metrics log) in ``d`` or the nearest folder above it up to ``base``; None without one."""
    from canzona.runs import RUN_JSON

    for folder in (d, *d.parents):
        for name in ("meta.json", RUN_JSON):
            f = folder / name
            if f.is_file():
                doc = _strict_json(f.read_text(encoding="utf-8"), str(f))
                if isinstance(doc, dict) and isinstance(doc.get("strategy"), str):
                    return doc
        if folder == base:
            break
    return None


def discover_profiles(root: str | Path = DEFAULT_PROFILE_DIR.parent) -> dict[str, Path]:
    """Profiles under ``root`` (any depth) keyed by the strategy their run recorded (``meta.json``
    or ``run.json``; ``"<strategy> (<folder>)"`` when two runs share one), sorted by path. A folder
    whose run recorded no strategy is not a strategy and is left out; the raw traces of a run
    whose phase table is also there (the same recorded configuration) count once, as the table."""
    base = Path(root)
    if not base.is_dir():
        raise FileNotFoundError(f"profile root not found: {root}")
    dirs = sorted({p.parent for pat in (*_TABLES, *(f"*{s}" for s in _TRACE_SUFFIXES)) for p in base.rglob(pat)})
    runs: list[tuple[Path, dict[str, Any], bool]] = []
    for d in dirs:
        cfg = _recorded_config(d, base)
        if cfg is not None:
            runs.append((d, cfg, any((d / t).is_file() for t in _TABLES)))
    tables = [json.dumps(c, sort_keys=True) for _, c, is_table in runs if is_table]
    runs = [r for r in runs if r[2] or json.dumps(r[1], sort_keys=True) not in tables]
    count: dict[str, int] = {}
    for _, c, _ in runs:
        count[c["strategy"]] = count.get(c["strategy"], 0) + 1
    return {(c["strategy"] if count[c["strategy"]] == 1 else f"{c['strategy']} ({d.name})"): d for d, c, _ in runs}


def phase_label(phase: str, part: str = "") -> str:
    """``canzona/tp/gather`` + ``group1`` -> ``canzona/tp/gather/group1``."""
    return f"{phase}/{part}" if part else phase


def _short(phase: str) -> str:
    return phase.removeprefix("canzona/")


# ------------------------------------------------------------------------------------------ tables
def _stage(part: str) -> str:
    tail = part.rsplit("/", 1)[-1] if part else ""
    return tail if tail in ("launch", "wait") else ""


def rank_phase_durations(phases: pd.DataFrame, *, depth: int | None = 0) -> pd.DataFrame:
    """Milliseconds each rank spends in each base phase per step (buckets and groups summed), at
    nesting ``depth`` (None: every depth); the launch and wait stages of asynchronous collectives
    stay apart (``canzona/dp/reduce_scatter/wait``). Columns: ``step``, ``rank``, ``phase``, ``ms``."""
    df = phases if depth is None else phases[phases["depth"] == depth]
    stage = df["part"].map(_stage)
    df = df.assign(phase=[f"{p}/{st}" if st else p for p, st in zip(df["phase"], stage)])
    out = df.groupby(["step", "rank", "phase"], as_index=False)["dur_us"].sum()
    out["ms"] = out.pop("dur_us") / 1e3
    return out


def phase_breakdown(phases: pd.DataFrame, *, depth: int = 0, reduce: str = "max") -> pd.DataFrame:
    """Time per base phase per step at nesting ``depth``: per step, across ranks ``reduce``
    ("max": the slowest rank, which the step waits for; "mean"), then mean and standard
    deviation over steps. Columns: ``phase``, ``ms``, ``ms_std``, ``share`` (of the summed ms)."""
    if reduce not in ("max", "mean"):
        raise ValueError(f"reduce must be 'max' or 'mean', got {reduce!r}")
    d = rank_phase_durations(phases, depth=depth)
    if d.empty:
        return pd.DataFrame(columns=["phase", "ms", "ms_std", "share"])
    per_step = d.groupby(["step", "phase"])["ms"].agg(reduce).reset_index()
    out = per_step.groupby("phase")["ms"].agg(["mean", "std"]).reset_index()
    out.columns = ["phase", "ms", "ms_std"]
    out["ms_std"] = out["ms_std"].fillna(0.0)
    total = float(out["ms"].sum())
    out["share"] = out["ms"] / total if total > 0 else 0.0
    return out.sort_values("ms", ascending=False, kind="stable").reset_index(drop=True)


def breakdown_by_strategy(profiles: Mapping[str, pd.DataFrame | Profile], *, depth: int = 0, reduce: str = "max") -> pd.DataFrame:
    """:func:`phase_breakdown` of several runs, keyed by strategy (or any label), in one long
    table with a ``strategy`` column."""
    parts = []
    for name, prof in profiles.items():
        df = prof.phases if isinstance(prof, Profile) else prof
        b = phase_breakdown(df, depth=depth, reduce=reduce)
        b.insert(0, "strategy", name)
        parts.append(b)
    if not parts:
        raise ValueError("need at least one profile")
    return pd.concat(parts, ignore_index=True)


def _pick_step(phases: pd.DataFrame, step: int | None) -> int:
    steps = sorted(int(s) for s in phases["step"].unique())
    if not steps:
        raise ValueError("the phase table is empty")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ValueError(f"step {step} not in the phase table (steps {steps[0]}..{steps[-1]})")
    return int(step)


def optimizer_critical_path(phases: pd.DataFrame, *, step: int | None = None, phase: str | None = None) -> pd.DataFrame:
    """The optimizer step's critical path in ``step`` (the last step by default).

    The step is over when the slowest rank leaves its optimizer phase (``canzona/optimizer/step``
    unless ``phase`` says otherwise), so that rank is the critical one. Its path is the sequence of
    the phase's direct children in time order, with the gaps between them (time the rank spent
    outside any recorded child: Python between phases, or work no phase records) as ``gap``
    segments, each named by the child phase it precedes (``gap before tp/compute/group0``).
    Columns: ``rank``, ``segment`` (label), ``phase``, ``part``, ``start_us``, ``dur_us``, ``kind``
    ("phase" or "gap"); ``attrs``: ``critical_rank``, ``step``, ``total_us``, ``per_rank_us``
    (optimizer-phase duration of every rank) and ``per_rank_span_us`` (its start and end).
    """
    phase = phase or _optimizer_phase()
    s = _pick_step(phases, step)
    d = phases[phases["step"] == s]
    top = d[d["phase"] == phase]
    if top.empty:
        raise ValueError(f"no {phase!r} phase in step {s}")
    # a rank may record the phase once per step; take its outermost occurrence span
    spans = top.assign(end=top["start_us"] + top["dur_us"]).groupby("rank").agg(
        start=("start_us", "min"), end=("end", "max"), depth=("depth", "min")
    )
    crit = int(spans["end"].idxmax())
    lo, hi, pdepth = float(spans.at[crit, "start"]), float(spans.at[crit, "end"]), int(spans.at[crit, "depth"])
    kids = d[(d["rank"] == crit) & (d["depth"] == pdepth + 1) & (d["start_us"] >= lo) & (d["start_us"] < hi)].sort_values("start_us")
    rows = []
    t = lo
    last = ""
    for _, k in kids.iterrows():
        label = phase_label(k["phase"], k["part"])
        if k["start_us"] > t:
            rows.append((crit, f"gap before {_short(label)}", "", "", t, float(k["start_us"]) - t, "gap"))
        rows.append((crit, label, k["phase"], k["part"], float(k["start_us"]), float(k["dur_us"]), "phase"))
        t = max(t, float(k["start_us"] + k["dur_us"]))
        last = label
    if hi > t:
        where = f"gap after {_short(last)}, to the end of the phase" if last else f"{_short(phase)} without child phases"
        rows.append((crit, where, "", "", t, hi - t, "gap"))
    out = pd.DataFrame(rows, columns=["rank", "segment", "phase", "part", "start_us", "dur_us", "kind"])
    out.attrs.update(
        critical_rank=crit, step=s, total_us=hi - lo, phase=phase,
        per_rank_us={int(r): float(e - b) for r, b, e in zip(spans.index, spans["start"], spans["end"])},
        per_rank_span_us={int(r): (float(b), float(e)) for r, b, e in zip(spans.index, spans["start"], spans["end"])},
    )
    return out


# ------------------------------------------------------------------------------------------ figures
_DEPTH_WIDTH = (0.8, 0.55, 0.34, 0.2)

#: the runtime's phases (canzona.runtime.phases names, copied so that plotting never imports
#: torch) in pipeline order, each with a fixed colour shared by every timeline figure: outer
#: phases light, the phases nested inside them saturated so they stand out on their parent
PHASE_COLORS: dict[str, str] = {
    "canzona/forward": "#1f77b4",
    "canzona/backward": "#9ecae1",
    "canzona/dp/reduce_scatter": "#6a3d9a",
    "canzona/dp/all_reduce": "#b15928",
    "canzona/optimizer/step": "#fdd0a2",
    "canzona/dp/local_update": "#2ca02c",
    "canzona/tp/gather": "#e377c2",
    "canzona/tp/compute": "#e6550d",
    "canzona/tp/scatter": "#17becf",
    "canzona/tp/apply": "#8c6d31",
    "canzona/shard/gather": "#f7b6d2",
    "canzona/shard/compute": "#fd8d3c",
    "canzona/shard/scatter": "#9edae5",
    "canzona/shard/apply": "#c49c94",
    "canzona/dp/all_gather": "#7f7f7f",
    "canzona/layerwise/broadcast": "#bcbd22",
}


def _unstaged(name: str) -> str:
    for st in ("/launch", "/wait"):
        if name.endswith(st):
            return name[: -len(st)]
    return name


def _phase_order(names) -> list[str]:
    """Known phases in pipeline order (a collective's launch before its wait), then any others
    alphabetically."""
    names = set(names)
    rank = {n: i for i, n in enumerate(PHASE_COLORS)}
    known = sorted((n for n in names if _unstaged(n) in rank), key=lambda n: (rank[_unstaged(n)], n.endswith("/wait"), n))
    return known + sorted(names - set(known))


def _phase_colors(names: list[str]) -> dict[str, str]:
    """A colour per phase name: its base phase's fixed colour (stages share it), else a spare one."""
    others = [n for n in names if _unstaged(n) not in PHASE_COLORS]
    spare = dict(zip(others, categorical_colors(len(others))))
    return {n: PHASE_COLORS.get(_unstaged(n)) or spare[n] for n in names}


def fig_timeline(phases: pd.DataFrame, *, step: int | None = None, max_depth: int | None = None, title: str = "") -> go.Figure:
    """Per-rank timeline of phases: one row per rank, one bar per phase occurrence coloured by
    its base phase; nested phases are drawn as thinner bars inside their parents. ``step`` limits
    the view to one step (all steps by default); times are ms from the first phase shown."""
    df = phases
    if step is not None:
        df = df[df["step"] == _pick_step(phases, step)]
    if max_depth is not None:
        df = df[df["depth"] <= max_depth]
    if df.empty:
        raise ValueError("no phases to draw (empty table after the step / depth filter)")
    t0 = float(df["start_us"].min())
    names = _phase_order(df["phase"].unique())
    colors = _phase_colors(names)
    fig = go.Figure()
    for name in names:
        g = df[df["phase"] == name]
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[f"rank {r}" for r in g["rank"]],
                x=(g["dur_us"] / 1e3).to_numpy(),
                base=((g["start_us"] - t0) / 1e3).to_numpy(),
                width=[_DEPTH_WIDTH[min(int(x), len(_DEPTH_WIDTH) - 1)] for x in g["depth"]],
                name=_short(name),
                marker=dict(color=colors[name], line=dict(width=0)),
                customdata=np.stack([g["part"].replace("", "-"), g["step"], g["depth"], g["dur_us"] / 1e3, (g["start_us"] - t0) / 1e3], axis=-1),
                hovertemplate=(name + " %{customdata[0]}<br>step %{customdata[1]}, depth %{customdata[2]}<br>"
                               "start %{customdata[4]:.3f} ms, lasts %{customdata[3]:.3f} ms<extra>%{y}</extra>"),
            )
        )
    ranks = sorted(df["rank"].unique())
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(categoryorder="array", categoryarray=[f"rank {r}" for r in ranks][::-1])
    which = f"step {int(df['step'].iloc[0])}" if step is not None else f"steps {int(df['step'].min())}..{int(df['step'].max())}"
    return finish(
        fig,
        title=f"Phase timeline per rank, {which}{(': ' + title) if title else ''}<br><sup>thinner bars are phases nested inside wider ones</sup>",
        x_title="time since the first phase shown (ms, common clock)",
        y_title="rank",
        legend_title="phase (canzona/...)",
        # tall enough for one row per rank and for the legend without a scroll bar
        height=max(320, 46 * len(ranks) + 170, 22 * len(names) + 190),
    )


def fig_phase_breakdown(breakdown: pd.DataFrame, *, paper: Mapping[str, Mapping[str, float]] | None = None) -> go.Figure:
    """Stacked bars: per strategy (from :func:`breakdown_by_strategy`), the time of each phase.
    ``paper`` optionally maps strategy -> {phase label: seconds} drawn as open diamonds (only when
    the profiled run is the paper's configuration; the caller decides)."""
    if "strategy" not in breakdown:
        raise ValueError("expected a table from breakdown_by_strategy (a 'strategy' column)")
    strategies = list(dict.fromkeys(breakdown["strategy"]))
    names = _phase_order(breakdown["phase"].unique())
    colors = _phase_colors(names)
    fig = go.Figure()
    for name in names:
        d = breakdown[breakdown["phase"] == name].set_index("strategy").reindex(strategies)
        # the stages of one collective share its colour; the wait is hatched, the launch dotted
        pattern = "/" if name.endswith("/wait") else "." if name.endswith("/launch") else ""
        fig.add_trace(go.Bar(x=strategies, y=d["ms"].fillna(0.0), name=_short(name), marker_color=colors[name],
                             marker_pattern_shape=pattern, error_y=None, hovertemplate=name + ": %{y:.3f} ms<extra>%{x}</extra>"))
    if paper:
        xs, ys, txt = [], [], []
        for st, vals in paper.items():
            for lab, sec in vals.items():
                xs.append(st)
                ys.append(sec * 1e3)
                txt.append(lab)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", marker=PAPER_MARKER, name="paper (reported)", text=txt,
                                 hovertemplate="paper %{text}: %{y:.1f} ms<extra>%{x}</extra>"))
    fig.update_layout(barmode="stack")
    return finish(
        fig,
        title="Phase breakdown per strategy (slowest rank per step, mean over steps; overlapping phases add up)",
        x_title="strategy",
        y_title="time per step (ms)",
        legend_title="phase (canzona/...)",
        height=460,
    )


#: the row (and legend entry) of the critical-path figure that holds every gap between child phases
GAP_ROW = "gaps between child phases"


def fig_critical_path(phases: pd.DataFrame, *, step: int | None = None, phase: str | None = None) -> go.Figure:
    """Left: each rank's optimizer phase as a bar from its start to its end (ms since the first
    rank entered it), the critical rank -- the one that ends last, not necessarily the longest --
    in red. Right: the critical rank's optimizer step as a waterfall of its child phases and the
    gaps between them, coloured by base phase as in :func:`fig_timeline`."""
    cp = optimizer_critical_path(phases, step=step, phase=phase)
    a = cp.attrs
    per = a["per_rank_us"]
    spans = a["per_rank_span_us"]
    ranks = sorted(per)
    first = min(b for b, _ in spans.values())
    # the right panel's row labels (tp/gather/group0/launch) sit between the panels: leave them room
    rows = [GAP_ROW if k == "gap" else _short(x) for x, k in zip(cp["segment"], cp["kind"])]
    longest = max((len(x) for x in rows), default=10)
    fig = make_subplots(rows=1, cols=2, column_widths=[0.32, 0.68], horizontal_spacing=min(0.3, 0.06 + 0.0075 * longest),
                        subplot_titles=("optimizer phase per rank (red: ends last)", f"critical path: rank {a['critical_rank']}"))
    colors = ["#d62728" if r == a["critical_rank"] else "#7f7f7f" for r in ranks]
    fig.add_trace(go.Bar(x=[f"rank {r}" for r in ranks], y=[per[r] / 1e3 for r in ranks], base=[(spans[r][0] - first) / 1e3 for r in ranks],
                         marker_color=colors, name="optimizer phase of each rank (red: critical rank)",
                         customdata=[[per[r] / 1e3, (spans[r][1] - first) / 1e3] for r in ranks],
                         hovertemplate="%{x}: %{base:.3f} .. %{customdata[1]:.3f} ms (lasts %{customdata[0]:.3f} ms)<extra></extra>"),
                  row=1, col=1)
    segs = rows
    # one colour and legend entry per base phase; the rows name each part (group0, bucket1, ...);
    # every gap shares one row (the table names each by the phase it precedes)
    base_of = {seg: (ph or GAP_ROW) for seg, ph in zip(cp["segment"], cp["phase"])}
    bases = _phase_order([b for b in dict.fromkeys(base_of.values()) if b != GAP_ROW])
    col = _phase_colors(bases)
    col[GAP_ROW] = "#cccccc"
    if GAP_ROW in base_of.values():
        bases.append(GAP_ROW)
    t0 = float(cp["start_us"].min()) if len(cp) else 0.0
    for b in bases:
        sel = (cp["segment"].map(base_of) == b).to_numpy()
        g = cp[sel]
        start = ((g["start_us"] - t0) / 1e3).to_numpy()
        fig.add_trace(go.Bar(orientation="h", y=[r for r, keep in zip(rows, sel) if keep], x=(g["dur_us"] / 1e3).to_numpy(), base=start,
                             customdata=start, name=_short(b), marker_color=col[b],
                             hovertemplate="%{y}: %{x:.3f} ms from %{customdata:.3f} ms<extra></extra>"), row=1, col=2)
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(categoryorder="array", categoryarray=list(dict.fromkeys(segs))[::-1], row=1, col=2)
    fig.update_xaxes(title_text="rank", row=1, col=1)
    fig.update_yaxes(title_text="ms since the first rank entered the phase", row=1, col=1)
    fig.update_xaxes(title_text="time since the rank entered the optimizer phase (ms)", row=1, col=2)
    fig.update_yaxes(title_text="child phase", title_standoff=2, row=1, col=2)
    return finish(
        fig,
        title=(f"Optimizer critical path, step {a['step']}: {a['total_us'] / 1e3:.3f} ms on rank {a['critical_rank']} ({_short(a['phase'])})"
               "<br><sup>the step ends when the last rank leaves its optimizer phase; grey: gaps between child phases (Python, unrecorded work)</sup>"),
        legend_title="phase (canzona/...)",
        height=max(400, 24 * len(set(segs)) + 240),
    )
