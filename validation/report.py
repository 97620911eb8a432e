"""The validation report: JSON and CSV documents, the readable table, atomic writing and loading.

JSON (``schema`` = ``canzona.validation``, ``version`` = 1; documented in ``docs/validation.md``)::

    {
      "schema": "canzona.validation", "version": 1,
      "created": "2026-01-01T00:00:00Z", "level": "quick" | "full" | "custom",
      "command": "canzona validate --quick", "environment": {"python", "torch", "platform"},
      "settings": {...},                              # gradients, tolerances, hyperparameters
      "summary": {"cells", "passed", "failed", "errors", "seconds"},
      "cells": [{"cell", "check", "model", "optimizer", "strategy", "mesh", "dtype", "steps",
                 "passed", "max_abs_diff", "first_mismatch", "seconds", ...}]
    }

``first_mismatch`` is null or ``{"param", "what", "index", "expected", "got"}`` (plus ``"expert"``,
the expert's index, when the parameter is an expert stack). The CSV holds
one row per cell with the same scalar fields (``first_mismatch`` flattened into
``mismatch_param``, ``mismatch_what``, ``mismatch_index``). Both files are written to a temporary
file in the target directory and renamed into place, so a reader never sees half a report.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import sys
import tempfile
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from canzona.fileio import read_json

__all__ = [
    "SCHEMA",
    "VERSION",
    "CSV_COLUMNS",
    "build_report",
    "format_table",
    "report_paths",
    "check_writable",
    "write_report",
    "load_report",
    "report_frame",
    "default_report_path",
    "report_dir_paths",
    "latest_report",
    "format_summary",
    "result_label",
    "cell_detail",
    "RUNS_DIR",
]

SCHEMA = "canzona.validation"
VERSION = 1
CSV_COLUMNS: tuple[str, ...] = (
    "cell",
    "check",
    "model",
    "optimizer",
    "strategy",
    "mesh",
    "dtype",
    "steps",
    "passed",
    "max_abs_diff",
    "mismatch_param",
    "mismatch_what",
    "mismatch_index",
    "bitwise_expected",
    "bound",
    "seconds",
    "reason",
    "error",
)
_REQUIRED_CELL = ("optimizer", "strategy", "mesh", "dtype", "check", "passed", "max_abs_diff", "first_mismatch", "seconds")


#: Where ``canzona validate`` writes its reports unless ``--report`` says otherwise (relative to
#: the current directory, one timestamped folder per run; never the source tree).
RUNS_DIR = Path("runs") / "validation"


def default_report_path(now: datetime | None = None) -> Path:
    """``validation/<UTC timestamp>/report.json`` under the user's runs folder
    (:func:`canzona.runs.runs_dir`: ``$CANZONA_RUNS_DIR``, else ``runs/`` of the current directory),
    where every results view looks for it."""
    from canzona.runs import runs_dir

    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%SZ")
    base = runs_dir().resolve() / RUNS_DIR.name / stamp
    p, n = base, 1
    while p.exists():  # two runs in the same second
        n += 1
        p = base.with_name(f"{stamp}-{n}")
    return p / "report.json"


def report_dir_paths(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``--report PATH``: ``x.json`` or ``x.csv`` name the pair; anything else is a directory that
    receives ``report.json`` and ``report.csv`` (created if missing)."""
    p = Path(path)
    if p.suffix.lower() in (".json", ".csv"):
        return report_paths(p)
    return p / "report.json", p / "report.csv"


def latest_report(root: str | os.PathLike[str] | None = None) -> Path | None:
    """The newest ``runs/validation/*/report.json`` under ``root`` (default: the current directory)."""
    base = Path(root) if root is not None else Path.cwd()
    found = sorted((base / RUNS_DIR).glob("*/report.json"), key=lambda p: (p.stat().st_mtime, p.name))
    return found[-1] if found else None


def report_paths(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(JSON path, CSV path) for ``--report PATH``: ``x.json`` -> (x.json, x.csv), ``x.csv`` ->
    (x.json, x.csv), anything else -> (PATH.json, PATH.csv)."""
    p = Path(path)
    if p.suffix.lower() == ".json":
        return p, p.with_suffix(".csv")
    if p.suffix.lower() == ".csv":
        return p.with_suffix(".json"), p
    return p.with_name(p.name + ".json"), p.with_name(p.name + ".csv")


def check_writable(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Raise ValueError (one line) unless both report files can be created; creates missing parent
    directories (that is all it leaves behind). Run before any work, so a bad path costs nothing."""
    if Path(path).is_dir():
        # never PATH.json beside a folder (``--report /tmp`` would write /tmp.json)
        raise ValueError(f"report path {path} is a directory; name a file in it (e.g. {Path(path) / 'report'})")
    js, cs = report_paths(path)
    for p in (js, cs):
        if p.exists() and p.is_dir():
            raise ValueError(f"report path {p} is a directory")
        parent = p.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create the report directory {parent}: {exc.strerror or exc}") from None
        if not parent.is_dir():
            raise ValueError(f"report directory {parent} is not a directory")
        try:
            fd, tmp = tempfile.mkstemp(prefix=".canzona-validate-", dir=parent)
        except OSError as exc:
            raise ValueError(f"cannot write the report in {parent}: {exc.strerror or exc}") from None
        os.close(fd)
        os.unlink(tmp)
        if p.exists() and not os.access(p, os.W_OK):
            raise ValueError(f"report file {p} exists and is not writable")
    return js, cs


def _environment() -> dict[str, str]:
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}


def _finite(obj: Any) -> Any:
    """Strict JSON has no NaN or Infinity: non-finite floats become the strings "nan", "inf", "-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def build_report(
    results: Sequence[Mapping[str, Any]],
    *,
    level: str,
    command: str,
    seconds: float,
    settings: Mapping[str, Any],
) -> dict[str, Any]:
    """The JSON document for a list of per-cell results (as the workers return them)."""
    cells = [_finite(dict(r)) for r in results]
    for c in cells:
        c.pop("traceback", None)
        if c.get("max_abs_diff") is not None and not isinstance(c["max_abs_diff"], (int, float)):
            c["max_abs_diff"] = None  # non-finite difference (NaN/inf on one side): not a number in strict JSON
        for key in ("losses", "reference_losses"):
            if key in c and not all(isinstance(x, (int, float)) for x in c[key]):
                c[f"{key}_text"] = c.pop(key)  # keep non-finite trajectories readable, out of the numeric field
        for k in _REQUIRED_CELL:
            c.setdefault(k, None)
    passed = sum(1 for c in cells if c["passed"] is True)
    errors = sum(1 for c in cells if c.get("error"))
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "level": level,
        "command": command,
        "environment": _environment(),
        "settings": dict(settings),
        "summary": {"cells": len(cells), "passed": passed, "failed": len(cells) - passed, "errors": errors, "seconds": round(seconds, 1)},
        "cells": cells,
    }


def _mismatch_text(m: Mapping[str, Any] | None) -> str:
    if not m:
        return ""
    at = f"[{m['index']}]" if m.get("index") is not None else ""
    what = m.get("what") or ""
    who = f"{m.get('param')} expert {m['expert']}" if m.get("expert") is not None else m.get("param")
    return f"{who} {what}{at}".strip()


def _num_text(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if v == 0:
        return "0"
    return f"{v:.3g}"


def result_label(c: Mapping[str, Any]) -> str:
    """``PASS`` (bit-identical where bitwise equality is required), ``PASS~`` (within a documented
    bound where it is not), ``FAIL`` (a mismatch), ``ERROR`` (the cell raised)."""
    if not c["passed"]:
        return "ERROR" if c.get("error") else "FAIL"
    if c.get("bitwise_expected") is False and not c.get("bitwise", False):
        return "PASS~"
    return "PASS"


def cell_detail(c: Mapping[str, Any]) -> str:
    """One phrase per cell that never calls a bounded cell identical: ``bit-identical`` for PASS,
    the worst difference next to its bound for PASS~, the first mismatch for FAIL."""
    label = result_label(c)
    if label == "ERROR":
        return str(c.get("error") or "")
    if label == "FAIL":
        m = c.get("first_mismatch") or {}
        text = _mismatch_text(m)
        if m.get("expected") is not None or m.get("got") is not None:
            text += f": expected {_num_text(m.get('expected'))}, got {_num_text(m.get('got'))}"
        return text
    if label == "PASS":
        return f"bit-identical ({c.get('compared', '?')} compared)"
    worst = c.get("worst")
    prefix = "params bit-identical; " if c.get("params_identical") and c.get("check") == "training" else ""
    prefix += "bit-identical to sc; " if c.get("vs_sc_identical") else ""
    if isinstance(worst, Mapping):
        return f"{prefix}within bound: worst {worst.get('param')} {worst.get('what')} |diff| {_num_text(worst.get('diff'))} <= {_num_text(worst.get('bound'))}"
    return f"{prefix}within bound: |diff| {_num_text(c.get('max_abs_diff'))} <= {_num_text(c.get('bound'))}"


def _rows_table(cells: Sequence[Mapping[str, Any]]) -> str:
    rows = [(c["cell"], result_label(c), cell_detail(c)[:110], f"{c['seconds']:.2f}s" if isinstance(c.get("seconds"), (int, float)) else "") for c in cells]
    head = ("cell", "result", "detail", "time")
    widths = [max(len(head[i]), *(len(r[i]) for r in rows)) if rows else len(head[i]) for i in range(len(head))]
    out = io.StringIO()
    out.write("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip() + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for r in rows:
        out.write("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() + "\n")
    return out.getvalue()


def _summary_lines(report: Mapping[str, Any]) -> str:
    s = report["summary"]
    labels = [result_label(c) for c in report["cells"]]
    exact, bounded = labels.count("PASS"), labels.count("PASS~")
    out = (
        f"\n{s['cells']} cells: {s['passed']} passed ({exact} bit-identical, {bounded} within a documented bound), "
        f"{s['failed']} failed ({s.get('errors', 0)} errors) in {s['seconds']:.1f} s\n"
    )
    if bounded:
        out += "PASS~ = within the documented bound where bitwise equality is not expected (see 'reason' in the JSON report)\n"
    return out


def format_table(report: Mapping[str, Any]) -> str:
    """Fixed-width table of every cell (cell, result, detail, time), then the summary line."""
    return _rows_table(report["cells"]) + _summary_lines(report)


def format_summary(report: Mapping[str, Any]) -> str:
    """The compact form: failing cells in full (their table rows), passes counted by kind."""
    bad = [c for c in report["cells"] if not c["passed"]]
    return (_rows_table(bad) if bad else "") + _summary_lines(report)


def _csv_text(report: Mapping[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
    w.writeheader()
    for c in report["cells"]:
        m = c.get("first_mismatch") or {}
        row = {k: c.get(k) for k in CSV_COLUMNS}
        row.update(mismatch_param=m.get("param"), mismatch_what=m.get("what"), mismatch_index=m.get("index"))
        w.writerow({k: ("" if v is None else v) for k, v in row.items()})
    return buf.getvalue()


def _atomic_write(path: Path, text: str) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the rename makes them the report
        # mkstemp makes the file private (0600); a report is an ordinary file (0666 minus umask)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        return Path(tmp)
    except BaseException:
        os.unlink(tmp)
        raise


def write_report(report: Mapping[str, Any], path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``PATH.json`` and ``PATH.csv`` (see :func:`report_paths`): both contents go to
    temporary files first and are renamed into place only when both are complete."""
    js, cs = check_writable(path)
    text_json = json.dumps(report, indent=1, allow_nan=False) + "\n"
    text_csv = _csv_text(report)
    tmp_json = _atomic_write(js, text_json)
    try:
        tmp_csv = _atomic_write(cs, text_csv)
    except BaseException:
        os.unlink(tmp_json)
        raise
    os.replace(tmp_json, js)
    os.replace(tmp_csv, cs)
    return js, cs



def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a JSON report strictly (no NaN/Infinity) and check its schema, version and cell fields."""
    p = Path(path)
    if p.suffix.lower() != ".json":
        p = report_paths(p)[0]
    doc = read_json(p)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{p}: not a canzona validation report (schema {doc.get('schema') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != VERSION:
        raise ValueError(f"{p}: report version {doc.get('version')!r}, this canzona reads version {VERSION}")
    summary = doc.get("summary")
    cells = doc.get("cells")
    if not isinstance(summary, dict) or not isinstance(cells, list):
        raise ValueError(f"{p}: report lacks summary or cells")
    for k in ("cells", "passed", "failed"):
        if not isinstance(summary.get(k), int):
            raise ValueError(f"{p}: summary.{k} must be an integer")
    for i, c in enumerate(cells):
        missing = [k for k in _REQUIRED_CELL if not isinstance(c, dict) or k not in c]
        if missing:
            raise ValueError(f"{p}: cell {i} lacks {', '.join(missing)}")
    if summary["cells"] != len(cells) or summary["passed"] != sum(1 for c in cells if c["passed"] is True):
        raise ValueError(f"{p}: summary does not match the cells")
    return doc


def report_frame(report: Mapping[str, Any]) -> Any:
    """The cells as a pandas DataFrame (one row per cell; ``first_mismatch`` flattened), for notebooks."""
    import pandas as pd

    return pd.read_csv(io.StringIO(_csv_text(report)))
