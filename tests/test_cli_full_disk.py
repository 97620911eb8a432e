"""Every command that writes, on a full file system: one line naming the path, exit 2, the old
file intact, nothing half-written and no temporary file left.

The full file system is a 64 KiB tmpfs filled to its last kilobyte where this process may mount
one (root in most containers); elsewhere a file-size limit (``RLIMIT_FSIZE``, as ``ulimit -f``,
with SIGXFSZ ignored so a write fails with EFBIG instead of killing the process) in a subprocess
stands in for it. The commands run in-process on the tmpfs (fast) and as subprocesses under the
limit.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from canzona.cli import main

ROOT = Path(__file__).resolve().parents[1]
OLD = "previous content\n"
LIMIT = 1024  # bytes a file may grow to under the RLIMIT_FSIZE variant


@contextlib.contextmanager
def _tmpfs(where: Path) -> Iterator[str | None]:
    """Mount a 64 KiB tmpfs at ``where``; yield None when mounting is not allowed, else the reason."""
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        yield f"cannot run mount: {exc}"
        return
    if done.returncode != 0:
        yield f"mount -t tmpfs refused: {done.stderr.strip() or done.returncode}"
        return
    try:
        yield None
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def small_fs(tmp_path_factory) -> Iterator[tuple[Path | None, str]]:
    """``(folder, why)``: a folder on a 64 KiB tmpfs (None and the reason when there is none)."""
    base = tmp_path_factory.mktemp("fullfs")
    with _tmpfs(base / "mnt") as why:
        yield (None, why or "") if why else (base / "mnt", "")


def _fill(folder: Path, leave: int = 1024) -> Path:
    """Fill the file system of ``folder`` but ``leave`` bytes."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    filler = folder / ".filler"
    with filler.open("ab") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def _case(folder: Path) -> tuple[Path, list[str]]:
    """A fresh sub-folder holding an old output file, and the command lines that overwrite it."""
    d = folder / uuid.uuid4().hex[:8]
    d.mkdir()
    target = d / "out.json"
    target.write_text(OLD)
    return target, [str(target)]


#: name -> argv with OUT for the output path (DIR for an output folder)
COMMANDS: dict[str, list[str]] = {
    "plan": ["plan", "--model", "qwen3-32b", "--dp", "32", "--tp", "8", "--json", "OUT"],
    "plan-fsdp": ["plan", "--model", "qwen3-tiny", "--fsdp", "2", "--json", "OUT"],
    "simulate": ["simulate", "--model", "qwen3-32b", "--dp", "32", "--tp", "8", "--no-sensitivity", "--json", "OUT"],
    "simulate-fsdp": ["simulate", "--model", "qwen3-32b", "--fsdp", "32", "--tp", "8", "--json", "OUT"],
    "reproduce": ["reproduce", "all", "--json", "OUT"],
    "figures": ["figures", "--out", "DIR", "--only", "partition_map", "--no-profile", "--plotlyjs", "cdn"],
    "figures-js": ["figures", "--out", "DIR", "--only", "partition_map", "--no-profile"],
}


def _argv(name: str, target: Path) -> list[str]:
    return [str(target) if a == "OUT" else str(target.parent) if a == "DIR" else a for a in COMMANDS[name]]


def _check_outcome(name: str, target: Path, code: int, err: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, (name, code, err[-1500:])
    assert "Traceback" not in err, err[-1500:]
    assert lines and str(target.parent) in lines[-1], lines[-1:]  # the failing path is named
    assert len([ln for ln in lines if "error" in ln]) == 1, lines
    assert target.read_text() == OLD, "the old output was destroyed"
    left = sorted(p.name for p in target.parent.iterdir() if p.name != target.name)
    assert not [n for n in left if n.endswith(".tmp") or n.startswith(".")], f"temporary files left: {left}"
    if name.startswith("figures"):
        # pages are renamed into place whole: none is cut short
        assert not [n for n in left if n.endswith(".html")], f"partial pages left: {left}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_full_tmpfs(name: str, small_fs, capsys) -> None:
    folder, why = small_fs
    if folder is None:
        pytest.skip(f"no tmpfs here ({why}); test_file_size_limit covers the same commands")
    target, _ = _case(folder)
    if name.startswith("figures"):
        target = target.parent / "partition_map.html"
        target.write_text(OLD)
    filler = _fill(folder)
    try:
        try:
            code = main(_argv(name, target))
        except SystemExit as exc:
            code = int(exc.code or 0)
        _, err = capsys.readouterr()
    finally:
        filler.unlink()
    assert "No space left on device" in err, err[-1500:]
    _check_outcome(name, target, code, err)


def _limited() -> None:  # runs in the child between fork and exec
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["simulate-fsdp", "reproduce", "figures"])
def test_file_size_limit(name: str, small_fs, tmp_path: Path) -> None:
    """The same failure through ``ulimit -f`` (only where no tmpfs can be mounted, or when
    ``CANZONA_TEST_FSIZE=1`` asks for it)."""
    folder, _ = small_fs
    if folder is not None and not os.environ.get("CANZONA_TEST_FSIZE"):
        pytest.skip("the tmpfs variant ran (CANZONA_TEST_FSIZE=1 runs this one too)")
    target, _ = _case(tmp_path)
    if name.startswith("figures"):
        target = target.parent / "partition_map.html"
        target.write_text(OLD)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "canzona", *_argv(name, target)], capture_output=True, text=True, timeout=300,
        env=env, cwd=tmp_path, preexec_fn=_limited,
    )
    assert "File too large" in done.stderr, done.stderr[-1500:]
    _check_outcome(name, target, done.returncode, done.stderr)


def test_profile_trace_export_on_a_full_disk(small_fs, tmp_path: Path) -> None:
    """A trace that cannot be written (full disk) raises one OSError naming the trace and leaves
    neither the trace nor the profiler's scratch file; a trace that can is renamed ``rank N``."""
    import json

    from canzona.profiling.run import trace_writer

    class FakeProf:
        def export_chrome_trace(self, path: str) -> None:
            doc = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}]}
            doc["traceEvents"] += [{"ph": "X", "name": f"op{i}", "pid": 1, "tid": 1, "ts": i, "dur": 1} for i in range(2000)]
            Path(path).write_text(json.dumps(doc))

    folder, _ = small_fs
    good = tmp_path / "good"
    good.mkdir()
    trace_writer(good, 3)(FakeProf())
    (written,) = list(good.iterdir())
    assert written.name.startswith("rank3.") and written.name.endswith(".pt.trace.json")
    names = [e["args"]["name"] for e in json.loads(written.read_text())["traceEvents"] if e.get("name") == "process_name"]
    assert names == ["rank 3"]
    if folder is None:
        pytest.skip("no tmpfs for the full-disk half")
    out = folder / "traces"
    out.mkdir()
    filler = _fill(folder, leave=4096)
    try:
        with pytest.raises(OSError) as info:
            trace_writer(out, 1)(FakeProf())
    finally:
        filler.unlink()
    assert str(out) in str(info.value.filename), info.value
    assert list(out.iterdir()) == [], "a partial trace or a scratch file was left"
