"""Fixtures shared by the test files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from canzona.testing import file_init_method, process_group


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group in this process, met at a ``file://`` rendezvous in the
    test's own temporary directory (no port to race for), destroyed after the test."""
    with process_group(file_init_method(tmp_path)):
        yield
