"""Suite-wide settings: runs that commands log by default (``canzona train`` writes a metrics log
under ``runs/``) go to a temporary folder, never into the working tree, and the figures' "newest
run" lookup sees only what a test wrote there."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path_factory, monkeypatch) -> None:
    from canzona.runs import RUNS_ENV

    monkeypatch.setenv(RUNS_ENV, str(tmp_path_factory.mktemp("runs")))
