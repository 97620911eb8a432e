"""The test harness in tests/harness.py: per-case outcomes of a multi-case run, and the launcher's
``file://`` rendezvous."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from canzona.runtime.launch import file_init_method, process_group
from harness import attempt, case_results


def _div(a: int, b: int) -> float:
    return a / b


def test_attempt_records_each_case_and_case_results_names_the_failing_one() -> None:
    per_rank = [{"cases": {k: attempt(_div, 1, k) for k in (1, 0, 2)}} for _ in range(2)]
    assert case_results(per_rank, "cases", 1) == [1.0, 1.0]
    assert case_results(per_rank, "cases", 2) == [0.5, 0.5]  # the broken case leaves the others alone
    with pytest.raises(AssertionError, match=r"case cases\[0\] failed on rank 0: ZeroDivisionError") as exc:
        case_results(per_rank, "cases", 0)
    assert "Traceback" in str(exc.value)


def test_file_rendezvous_forms_a_group_and_refuses_reuse(tmp_path: Path) -> None:
    url = file_init_method(tmp_path)
    assert url.startswith("file://")
    with process_group(url):
        assert dist.is_initialized() and dist.get_world_size() == 1
    assert not dist.is_initialized()
    (tmp_path / "rendezvous").write_bytes(b"stale")  # what a crashed run leaves behind
    with pytest.raises(ValueError, match="fresh file"):
        file_init_method(tmp_path)
