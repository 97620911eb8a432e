"""canzona.runtime.comm.wait_bounded in one process (a one-rank gloo world, a stand-in work): it
returns once the work lands, passes a real error through, gives up after its bound with the line
naming this rank's position, and then refuses every later wait of that world at once. The
multi-rank behaviour (a rank that skips or adds a step) is tests/test_robust_errors.py's."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from canzona.runtime.comm import CollectiveTimeout, Comm, wait_bounded
from canzona.runtime.launch import file_init_method, process_group


class SlowWork:
    """Lands after ``slices`` timed-out waits; records each timeout it was given."""

    def __init__(self, slices: int, error: str | None = None) -> None:
        self.left, self.error, self.timeouts = slices, error, []

    def wait(self, timeout: timedelta) -> bool:
        self.timeouts.append(timeout.total_seconds())
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.left > 0:
            self.left -= 1
            raise RuntimeError("Operation timed out!")
        return True


def test_wait_bounded_lands_gives_up_and_then_refuses_at_once(tmp_path) -> None:
    with process_group(file_init_method(tmp_path), timeout_s=20):
        work = SlowWork(slices=2)
        wait_bounded(work.wait, 10.0, "here")  # lands on the third slice
        assert len(work.timeouts) == 3 and max(work.timeouts) <= 0.25
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            wait_bounded(SlowWork(0, error="Connection closed by peer").wait, 10.0, "here")
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout) as info:
            wait_bounded(SlowWork(slices=10**6).wait, 0.6, "canzona/dp/all_gather/bucket0 (all_gather)")
        took = time.monotonic() - t0
        assert 0.6 <= took < 0.6 + 1.0, took
        msg = str(info.value)
        assert msg.startswith("canzona's collectives stopped matching across ranks: rank 0 waited 0.6 s in "
                              "canzona/dp/all_gather/bucket0 (all_gather) and gave up."), msg
        assert msg.endswith("this process group cannot be used further"), msg
        # the world is beyond use: any later bounded wait raises the same line before waiting
        late = SlowWork(slices=0)
        with pytest.raises(CollectiveTimeout) as again:
            wait_bounded(late.wait, 10.0, "elsewhere")
        assert str(again.value) == msg and late.timeouts == []
    (tmp_path / "fresh").mkdir()
    with process_group(file_init_method(tmp_path / "fresh"), timeout_s=20):  # a new world starts clean
        wait_bounded(SlowWork(slices=0).wait, 1.0, "here")


def test_comm_bounds_only_what_it_is_told_to(tmp_path) -> None:
    with process_group(file_init_method(tmp_path), timeout_s=20):
        with pytest.raises(ValueError, match="wait_timeout_s must be a positive number"):
            Comm(None, wait_timeout_s=0)
        assert Comm(None).wait_timeout_s is None and Comm(None, wait_timeout_s=5).wait_timeout_s == 5.0
        # one rank: nothing is launched, so nothing to bound (and nothing wrapped)
        assert Comm(None, wait_timeout_s=5).all_reduce(torch.ones(3), async_op=True) is None
