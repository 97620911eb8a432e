"""The launcher, the counted collectives, phases and the fault hooks (the runtime's foundations)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from canzona.runtime import faults
from canzona.runtime.comm import Comm, CommStats, even_sizes
from canzona.runtime.launch import WorkerError, run_workers
from canzona.runtime.phases import PhaseTimer, base_phase, current_phase, phase, timing


# ----------------------------------------------------------------------------- workers (module level: spawn)
def _echo(rank: int, world: int) -> dict[str, object]:
    return {"rank": rank, "world": world, "t": torch.arange(4.0) * rank}


def _fail_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure")
    t = torch.zeros(1)
    dist.all_reduce(t)  # rank 0 blocks here until the process-group timeout or the kill
    return 0


def _sleep(rank: int, world: int) -> int:
    time.sleep(60)
    return rank


def _collectives(rank: int, world: int) -> dict[str, object]:
    c = Comm()
    out: dict[str, object] = {}
    flat = (torch.arange(11, dtype=torch.float32) + 1) * (rank + 1)
    sizes = [0, 4, 7, 0][:world] if world == 4 else [4, 7]
    with timing() as timer:
        with phase("canzona/dp/reduce_scatter/bucket0"):
            shard, work = c.reduce_scatter_v(flat, sizes, async_op=True)
            work.wait()
        with phase("canzona/dp/all_gather/bucket0"):
            full, work = c.all_gather_v(shard, sizes, async_op=True)
            work.wait()
        with phase("canzona/dp/all_reduce/bucket0"):
            ar = flat.clone()
            c.all_reduce(ar)
        with phase("canzona/tp/gather/group0"):
            send = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
            recv, _ = c.all_to_all_v(send, [2] * world, [2] * world)
        with phase("canzona/layerwise/broadcast"):
            b = torch.full((3,), float(rank))
            c.broadcast(b, src=world - 1)
        eq, _ = c.all_gather_equal(torch.tensor([float(rank)]))
    out.update(shard=shard, full=full, ar=ar, recv=recv, b=b, eq=eq, stats=c.stats.as_dict(), phases=sorted(timer.wall))
    try:
        c.reduce_scatter_v(flat, [1, 2][:world] + [0] * (world - 2))
    except ValueError as exc:
        out["size_error"] = str(exc)
    return out


# ----------------------------------------------------------------------------- launcher
def test_run_workers_returns_results_in_rank_order_with_tensors() -> None:
    res = run_workers(_echo, 2, timeout_s=120)
    assert [r["rank"] for r in res] == [0, 1]
    assert torch.equal(res[1]["t"], torch.arange(4.0))


def test_a_failing_rank_is_named_and_nothing_hangs() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1: ValueError: planted failure"):
        run_workers(_fail_on_one, 2, timeout_s=120, pg_timeout_s=30)
    assert time.monotonic() - t0 < 60


def test_the_run_deadline_kills_workers() -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="timed out"):
        run_workers(_sleep, 2, timeout_s=8)
    assert time.monotonic() - t0 < 40


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        run_workers(_echo, 0)


# ----------------------------------------------------------------------------- collectives
@pytest.mark.parametrize("world", [2, 4])
def test_uneven_collectives_and_their_byte_counts(world: int) -> None:
    res = run_workers(_collectives, world, timeout_s=150)
    total = sum(range(1, world + 1))
    expect_full = (torch.arange(11, dtype=torch.float32) + 1) * total
    sizes = [0, 4, 7, 0] if world == 4 else [4, 7]
    starts = [sum(sizes[:r]) for r in range(world)]
    for r, out in enumerate(res):
        assert torch.equal(out["full"], expect_full)
        assert torch.equal(out["shard"], expect_full[starts[r] : starts[r] + sizes[r]])
        assert torch.equal(out["ar"], expect_full)
        assert torch.equal(out["recv"], torch.tensor([100.0 * j + 2 * r + k for j in range(world) for k in range(2)]))
        assert torch.equal(out["b"], torch.full((3,), float(world - 1)))
        assert torch.equal(out["eq"], torch.arange(world, dtype=torch.float32))
        st = out["stats"]
        es, n, own = 4, 11, sizes[r]
        # reduce-scatter: send everything but my shard, receive my shard from every other rank
        assert st["canzona/dp/reduce_scatter"] == {"sent": (n - own) * es, "recv": (world - 1) * own * es, "calls": 1}
        assert st["canzona/dp/all_gather"] == {"sent": (world - 1) * own * es, "recv": (n - own) * es, "calls": 1}
        even = even_sizes(n, world)[r]
        ar_bytes = ((n - even) + (world - 1) * even) * es
        assert st["canzona/dp/all_reduce"] == {"sent": ar_bytes, "recv": ar_bytes, "calls": 1}
        assert st["canzona/tp/gather"]["sent"] == (world - 1) * 2 * es
        bsent = (world - 1) * 3 * es if r == world - 1 else 0
        assert st["canzona/layerwise/broadcast"]["sent"] == bsent
        assert "canzona/tp/gather" in out["phases"] and "canzona/dp/all_reduce" in out["phases"]
        assert "split sizes" in out["size_error"]
    # summed over ranks, an all-reduce moves twice a reduce-scatter of the same buffer
    rs = sum(o["stats"]["canzona/dp/reduce_scatter"]["sent"] for o in res)
    assert rs == (world - 1) * 11 * 4


def test_even_sizes() -> None:
    assert even_sizes(11, 4) == [3, 3, 3, 2]
    assert even_sizes(2, 4) == [1, 1, 0, 0]
    assert sum(even_sizes(1000003, 7)) == 1000003


def test_comm_stats_totals_and_reset() -> None:
    s = CommStats()
    with phase("canzona/tp/scatter/group3"):
        s.record(10, 4)
    s.record(1, 2)
    assert s.as_dict()["canzona/tp/scatter"] == {"sent": 10, "recv": 4, "calls": 1}
    assert s.total_sent() == 11 and s.total_recv("canzona/tp/scatter") == 4
    s.reset()
    assert s.as_dict() == {}


# ----------------------------------------------------------------------------- phases
def test_phase_names_suffixes_and_timers() -> None:
    assert base_phase("canzona/dp/reduce_scatter/bucket12") == "canzona/dp/reduce_scatter"
    assert base_phase("canzona/tp/gather/group0") == "canzona/tp/gather"
    assert base_phase("canzona/optimizer/step") == "canzona/optimizer/step"
    assert base_phase("canzona/tp/groupies") == "canzona/tp/groupies"
    timer = PhaseTimer()
    assert current_phase() is None
    with timing(timer):
        with phase("canzona/optimizer/step"):
            assert current_phase() == "canzona/optimizer/step"
            for k in range(3):
                with phase(f"canzona/tp/compute/group{k}"):
                    assert current_phase() == f"canzona/tp/compute/group{k}"
    assert current_phase() is None
    assert timer.calls == {"canzona/optimizer/step": 1, "canzona/tp/compute": 3}
    assert timer.wall["canzona/optimizer/step"] >= timer.wall["canzona/tp/compute"] >= 0


def test_phases_reach_the_profiler_with_identical_names() -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with phase("canzona/dp/local_update"):
            torch.ones(4).sum()
    names = {e.name for e in prof.events()}
    assert "canzona/dp/local_update" in names


# ----------------------------------------------------------------------------- faults
def test_fault_from_env_and_ulp_at_the_armed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CANZONA_FAULT", "kind=ulp,param=w,step=2,index=3")
    try:
        f = faults.from_env()
        assert f == faults.Fault("ulp", "w", 2, 3) and faults.armed() == f
        v = torch.ones(6)
        faults.on_update("w", v)  # step 1: untouched
        assert torch.equal(v, torch.ones(6))
        faults.on_update("other", v)
        assert not faults.fired("w")
        faults.on_update("w", v)  # step 2: element 3 moves by exactly one ulp
        assert faults.fired("w") and faults.fired() and not faults.fired("other")
        diff = (v != 1).nonzero().flatten().tolist()
        assert diff == [3] and v[3].item() == torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    finally:
        faults.disarm()
    assert faults.armed() is None


def test_stale_state_fault_undoes_one_state_update() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    faults.arm(faults.Fault("stale_state", "p", step=2))
    try:
        buffers = []
        for _ in range(3):
            p.grad = torch.ones(3)
            faults.snapshot_state("p", opt, p)
            opt.step()
            faults.on_state("p", opt, p)
            buffers.append(opt.state[p]["momentum_buffer"].clone())
        assert torch.equal(buffers[1], buffers[0])  # the step-2 state change was lost
        assert not torch.equal(buffers[2], buffers[1])
    finally:
        faults.disarm()


@pytest.mark.parametrize("text", ["kind=ulp", "param=x", "kind=bogus,param=x", "kind=ulp,param=x,step=0", "nonsense"])
def test_bad_fault_specs_are_rejected(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("CANZONA_FAULT", text)
    with pytest.raises(ValueError):
        faults.from_env()
    faults.disarm()
