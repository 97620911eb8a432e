"""Suite-wide settings: runs that commands log by default (``canzona train`` writes a metrics log
under ``runs/``) go to a temporary folder, never into the working tree, and the figures' "newest
run" lookup sees only what a test wrote there. The quick gate (``pytest -m "not slow"``) starts no
worker process: a test (or a fixture it sets up) that starts one without the ``slow`` mark fails
with the line naming the mark."""

from __future__ import annotations

import multiprocessing.process
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from canzona.runtime.launch import file_init_method, process_group
from harness import case_results

#: the plugin test drives a nested pytest run (tests/test_validation_api.py)
pytest_plugins = ["pytester"]


#: the test being set up, run or torn down, while it is not marked slow
_QUICK_TEST: list[str | None] = [None]
_start_process = multiprocessing.process.BaseProcess.start


def _guarded_start(self: multiprocessing.process.BaseProcess) -> None:
    if _QUICK_TEST[0] is not None:
        raise RuntimeError(f"{_QUICK_TEST[0]} starts a worker process but is not marked @pytest.mark.slow "
                           "(the quick gate `pytest -m \"not slow\"` starts none)")
    _start_process(self)


multiprocessing.process.BaseProcess.start = _guarded_start  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    _QUICK_TEST[0] = None if item.get_closest_marker("slow") else item.nodeid
    try:
        return (yield)
    finally:
        _QUICK_TEST[0] = None


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path_factory, monkeypatch) -> None:
    from canzona.runs import RUNS_ENV

    monkeypatch.setenv(RUNS_ENV, str(tmp_path_factory.mktemp("runs")))


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group in this process, met at a ``file://`` rendezvous in the
    test's own temporary directory (no port to race for), destroyed after the test."""
    with process_group(file_init_method(tmp_path)):
        yield


@pytest.fixture(scope="session")
def comm_runs() -> Callable[[int, str], list]:
    """``comm_runs(world, section)``: every rank's result of one section ("collectives" or
    "accounting") of one spawned run per world size, shared by tests/test_runtime_core.py and
    tests/test_runtime_accounting.py (started on first use); a section that raised on a rank fails
    the asking test only, naming the section and the rank."""
    from canzona.runtime.launch import run_workers

    cache: dict[int, list] = {}

    def get(world: int, section: str) -> list:
        if world not in cache:
            from test_runtime_core import comm_worker

            cache[world] = run_workers(comm_worker, world, timeout_s=240)
        return case_results(cache[world], section)

    return get
