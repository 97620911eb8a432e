"""``metrics.csv`` on a full file system: the failing step raises one ``OSError`` naming the file,
and the file ends at its last whole row (never a torn one). The full file system is a 64 KiB
tmpfs filled to its last bytes where this process may mount one, else a file-size limit
(``RLIMIT_FSIZE``, SIGXFSZ ignored) in a subprocess (tests/test_cli_full_disk.py's pattern)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from canzona.runs import METRICS_COLUMNS, METRICS_CSV, MetricsLog
from test_cli_full_disk import _fill, _tmpfs

ROOT = Path(__file__).resolve().parents[1]
PHASES = {"canzona/optimizer/step": 0.00125, "canzona/dp/all_gather/wait": 0.0005}


def _log_until_full(directory: Path) -> tuple[int, str]:
    """Log steps until a write fails; (steps logged, the error's message)."""
    log = MetricsLog(directory, tensorboard=False)
    try:
        for step in range(100000):
            try:
                log.log(step, 2.5 + step * 1e-7, 0.0123456789, PHASES)
            except OSError as exc:
                return step, str(exc)
    finally:
        log.close()
    raise AssertionError("the file system never filled up")


def _check(path: Path, steps: int, message: str) -> None:
    assert f"cannot append to {path}" in message, message
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n"), "torn last row"
    rows = text.splitlines()
    assert rows[0].split(",") == list(METRICS_COLUMNS)
    assert [int(r.split(",", 1)[0]) for r in rows[1:]] == list(range(steps))  # every whole row, nothing after
    assert all(len(r.split(",")) == len(METRICS_COLUMNS) for r in rows)


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory):
    base = tmp_path_factory.mktemp("metrics_fullfs")
    with _tmpfs(base / "mnt") as why:
        yield (None, why or "") if why else (base / "mnt", "")


def test_metrics_csv_on_a_full_tmpfs_keeps_whole_rows(small_fs) -> None:
    folder, why = small_fs
    if folder is None:
        pytest.skip(f"no tmpfs here ({why}); the file-size limit variant below covers it")
    run = folder / uuid.uuid4().hex[:8]
    run.mkdir()
    filler = _fill(folder, leave=6 * 1024)
    try:
        steps, message = _log_until_full(run)
        _check(run / METRICS_CSV, steps, message)
        assert steps > 0
    finally:
        filler.unlink()


_CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
from test_bound_metrics import _check, _log_until_full
from pathlib import Path
steps, message = _log_until_full(Path(sys.argv[1]))
_check(Path(sys.argv[1]) / "metrics.csv", steps, message)
print("ok", steps)
"""


def _limit() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_metrics_csv_under_a_file_size_limit_keeps_whole_rows(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "run"), str(ROOT / "tests")],
                          capture_output=True, text=True, env=env, preexec_fn=_limit, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ok "), done.stderr[-2000:]
