"""Suite-wide settings: runs that commands log by default (``canzona train`` writes a metrics log
under ``runs/``) go to a temporary folder, never into the working tree, and the figures' "newest
run" lookup sees only what a test wrote there."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from canzona.runtime.launch import file_init_method, process_group
from harness import case_results

#: the plugin test drives a nested pytest run (tests/test_validation_api.py)
pytest_plugins = ["pytester"]


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
