"""The launcher, the counted collectives, phases and the fault hooks (the runtime's foundations)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from validation import faults
from canzona.runtime.agree import MESSAGE_BYTES, agree
from canzona.runtime.hooks import UpdateHooks, UpdateNormLog
from canzona.runtime.comm import Comm, CommStats, even_sizes
from canzona.runtime.launch import WorkerError, run_workers
from harness import attempt, raised
from canzona.runtime.phases import STATUS, PhaseTimer, base_phase, current_phase, phase, timing


# ----------------------------------------------------------------------------- workers (module level: spawn)
def _echo(rank: int, world: int) -> dict[str, object]:
    init = dist.distributed_c10d._default_pg_init_method  # how this group met
    return {"rank": rank, "world": world, "t": torch.arange(4.0) * rank, "init": init}


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
        mx = torch.tensor([rank, -rank], dtype=torch.int64)
        c.all_reduce(mx, op="max")
    try:
        c.all_reduce(mx, op="min")
    except ValueError as exc:
        out["op_error"] = str(exc)
    # the status exchange goes through the same counted layer, in its own phase: a flag vector,
    # then (the last rank failed) the messages
    c_status = Comm()
    reduced = agree(None, "probe", flags=torch.tensor([rank, 3], dtype=torch.int64), comm=c_status)
    failed = raised(lambda: agree(ValueError("bad input") if rank == world - 1 else None, "probe", comm=c_status))
    out.update(status=(reduced, failed, c_status.stats.as_dict()))
    out.update(shard=shard, full=full, ar=ar, recv=recv, b=b, eq=eq, mx=mx, stats=c.stats.as_dict(), phases=sorted(timer.wall))
    try:
        c.reduce_scatter_v(flat, [1, 2][:world] + [0] * (world - 2))
    except ValueError as exc:
        out["size_error"] = str(exc)
    # rounding-sensitive values: the sum must be the reference's, rank order from zero, bit for bit
    def values(r: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7 + r)
        v = torch.randn(1000, generator=g) * torch.logspace(-6, 6, 1000)
        v[:5] = -0.0  # every rank's -0.0: the reference's sum from +0.0 gives +0.0
        return v

    cut = [300, 150, 400, 150][:world] if world == 4 else [600, 400]
    mine = values(rank)
    scratch = torch.empty(c.reduce_scatter_scratch(mine, cut) + 3)
    got, work = c.reduce_scatter_v(mine, cut, out=torch.empty(cut[rank]), scratch=scratch, async_op=True)
    work.wait()
    sync, _ = c.reduce_scatter_v(mine, cut)
    ref = torch.zeros(1000)
    for r in range(world):
        ref += values(r)
    lo = sum(cut[:rank])
    out["rounded"] = (got, sync, ref[lo : lo + cut[rank]], c.reduce_scatter_scratch(mine, cut))
    try:
        c.reduce_scatter_v(mine, cut, scratch=torch.empty(world * cut[rank] - 1))
    except ValueError as exc:
        out["scratch_error"] = str(exc)
    # the all-reduce in rank order (sc, layerwise): the same rank-order sum on every rank, counted
    # once as an all-reduce; 1001 elements, so its even slices are uneven at world 4
    c_ar = Comm()
    odd = torch.cat([values(rank), torch.tensor([float(rank)])])
    async_ar = odd.clone()
    scratch_ar = torch.empty(c_ar.rank_order_scratch(odd))
    with phase("canzona/dp/all_reduce/bucket0"):
        work = c_ar.all_reduce_in_rank_order(async_ar, scratch=scratch_ar, async_op=True)
    with phase("canzona/dp/all_reduce/bucket0/wait"):
        if work is not None:
            work.wait()
    sync_ar = odd.clone()
    with phase("canzona/dp/all_reduce/bucket0"):
        c_ar.all_reduce_in_rank_order(sync_ar)
    gloo_ar = odd.clone()
    dist.all_reduce(gloo_ar)
    out["ordered"] = (async_ar, sync_ar, torch.cat([ref, torch.tensor([float(sum(range(world)))])]), gloo_ar,
                      c_ar.sums_in_rank_order(odd), c_ar.stats.as_dict(), scratch_ar.numel())
    return out


def comm_worker(rank: int, world: int) -> dict[str, dict]:
    """One spawned run per world size for the counted-collective checks here and the per-strategy
    byte counts of tests/test_runtime_accounting.py (the ``comm_runs`` fixture in conftest.py);
    each records its own outcome, so either fails its own tests only."""
    from test_runtime_accounting import accounting_worker

    return {"collectives": {None: attempt(_collectives, rank, world)}, "accounting": {None: attempt(accounting_worker, rank, world)}}


# ----------------------------------------------------------------------------- launcher
@pytest.fixture
def tmp_tempdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The launcher's temporary directories go under ``tmp_path`` (to check they are removed)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.slow
def test_run_workers_returns_results_in_rank_order_with_tensors(tmp_tempdir: Path) -> None:
    res = run_workers(_echo, 2, timeout_s=120)
    assert [r["rank"] for r in res] == [0, 1]
    assert torch.equal(res[1]["t"], torch.arange(4.0))
    # the group met at a file rendezvous in a fresh temporary directory, removed afterwards
    init = res[0]["init"]
    assert init == res[1]["init"] and init.startswith("file://") and str(tmp_tempdir.resolve()) in init
    assert list(tmp_tempdir.iterdir()) == []


@pytest.mark.slow
def test_a_failing_rank_is_named_and_nothing_hangs(tmp_tempdir: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1: ValueError: planted failure"):
        run_workers(_fail_on_one, 2, timeout_s=120, pg_timeout_s=30)
    assert time.monotonic() - t0 < 60
    assert list(tmp_tempdir.iterdir()) == []  # the rendezvous directory is gone after a failure too


@pytest.mark.slow
def test_a_worker_that_cannot_start_raises_its_error_and_stops_the_others(tmp_tempdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's process fails to start (e.g. out of process slots): the launcher raises that error,
    not one of its own clean-up, stops rank 0, and removes the rendezvous directory."""
    import multiprocessing
    import multiprocessing.context

    real = multiprocessing.context.SpawnProcess.start

    def start(self) -> None:
        if self._args[0] == 1:  # the worker's rank
            raise OSError("cannot fork another process")
        real(self)

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    with pytest.raises(OSError, match="cannot fork another process"):
        run_workers(_sleep, 2, timeout_s=60)
    assert multiprocessing.active_children() == []
    assert list(tmp_tempdir.iterdir()) == []


@pytest.mark.slow
def test_the_run_deadline_kills_workers(tmp_tempdir: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="timed out"):
        run_workers(_sleep, 2, timeout_s=3)
    assert time.monotonic() - t0 < 40
    assert list(tmp_tempdir.iterdir()) == []


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        run_workers(_echo, 0)


# ----------------------------------------------------------------------------- collectives
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_uneven_collectives_and_their_byte_counts(comm_runs, world: int) -> None:
    res = comm_runs(world, "collectives")
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
        assert torch.equal(out["mx"], torch.tensor([world - 1, 0]))
        assert "op must be one of ['max', 'sum']" in out["op_error"]
        reduced, failed, status = out["status"]
        assert torch.equal(reduced, torch.tensor([world - 1, 3]))
        assert failed is not None and failed[0] == "RankFailure"
        assert failed[1] == f"probe failed on 1 rank(s); rank {world - 1}: ValueError: bad input"
        # [error, flag, flag] and [error] max-reduced, then one message of 1 + 1024 bytes per rank
        status_bytes = sum(((m - even_sizes(m, world)[r]) + (world - 1) * even_sizes(m, world)[r]) * 8 for m in (3, 1))
        status_bytes += (world - 1) * (MESSAGE_BYTES + 1)
        assert status == {STATUS: {"sent": status_bytes, "recv": status_bytes, "calls": 3}}, status
        assert "split sizes" in out["size_error"]
        got, sync, ref, scratch = out["rounded"]
        assert torch.equal(got, ref) and torch.equal(sync, ref), "the reduce-scatter is not the rank-order sum"
        if r == 0:  # the five -0.0 entries sum to +0.0, as the reference's sum from zero
            assert not torch.signbit(got[:5]).any() and not torch.signbit(ref[:5]).any()
        assert scratch == world * ref.numel()  # gloo receives every rank's slice
        assert "scratch must be" in out["scratch_error"]
    # the all-reduce in rank order: the reference's sum on every rank, bit for bit (with 2 ranks
    # gloo's own all-reduce already is: a two-term sum commutes; at world 4 its ring order is
    # not, which these rounding-sensitive values show), counted as one all-reduce per call
    for r, out in enumerate(res):
        async_ar, sync_ar, want, gloo_ar, own_form, st, scratch_n = out["ordered"]
        assert own_form == (world > 2)
        # the receive buffer of its reduce-scatter: every rank's even slice for this rank; none at world 2
        assert scratch_n == (world * even_sizes(1001, world)[r] if world > 2 else 0)
        assert torch.equal(async_ar, want) and torch.equal(sync_ar, want), "the all-reduce is not the rank-order sum"
        assert torch.equal(async_ar, res[0]["ordered"][0])
        if world == 2:
            assert torch.equal(gloo_ar, want)
        even = even_sizes(1001, world)[r]
        ar_bytes = ((1001 - even) + (world - 1) * even) * 4
        assert st == {"canzona/dp/all_reduce": {"sent": 2 * ar_bytes, "recv": 2 * ar_bytes, "calls": 2}}, st
    if world == 4:
        assert any(not torch.equal(o["ordered"][3], o["ordered"][2]) for o in res), "gloo's ring order happened to match"
    # summed over ranks, an all-reduce moves twice a reduce-scatter of the same buffer
    rs = sum(o["stats"]["canzona/dp/reduce_scatter"]["sent"] for o in res)
    assert rs == (world - 1) * 11 * 4


def test_backends_that_reduce_cpu_tensors() -> None:
    from canzona.runtime.agree import reduces_cpu_tensors

    for backend in ("gloo", "mpi", "cpu:gloo,cuda:nccl", "cuda:nccl, cpu:gloo", "CPU:GLOO"):
        assert reduces_cpu_tensors(backend), backend
    for backend in ("nccl", "cuda:nccl", "xccl", "ucc:nccl"):
        assert not reduces_cpu_tensors(backend), backend


def _own_status_group_worker(rank: int, world: int, folder: str) -> dict:
    """A world whose default group cannot reduce CPU tensors (NCCL alone), emulated on gloo: the
    status exchanges get a gloo group of their own, made at construction, and every exchange of a
    step, a refusal, an optimizer error and a checkpoint round trip runs over it."""
    import canzona
    from canzona.runtime import agree as agree_mod
    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint
    from validation.harness import ToyModel, inject_grads, integer_grads, params_of

    agree_mod.reduces_cpu_tensors = lambda backend: False  # what an nccl-only world reports
    out: dict = {}
    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", optimizer_kwargs={"lr": 0.05}, bucket_numel=40)
    group = agree_mod.status_group()
    out["own_group"] = group is not None and group is not dist.group.WORLD
    out["runtime_uses_it"] = opt.runtime.status_comm.group is group
    out["ranks"] = dist.get_process_group_ranks(group)
    inject_grads(model, integer_grads(model, step=0, rank=rank))
    opt.comm_stats.reset()
    opt.step()
    out["status_bytes"] = opt.comm_stats.as_dict().get(STATUS, {})
    opt.zero_grad()
    path = Path(folder) / "own_status.pt"
    save_checkpoint(opt, path)
    grads = integer_grads(model, step=1, rank=rank)
    if rank == 1:
        grads["norm.weight"][0] = float("nan")
    inject_grads(model, grads)
    out["nonfinite"] = raised(opt.step)
    opt.zero_grad()
    load_checkpoint(opt, path)
    inject_grads(model, integer_grads(model, step=1, rank=rank))
    opt.step()
    out["params"] = params_of(model)
    return out


@pytest.mark.slow
def test_an_nccl_only_world_runs_status_exchanges_on_a_gloo_group_of_their_own(tmp_path: Path) -> None:
    res = run_workers(_own_status_group_worker, 2, str(tmp_path), timeout_s=120)
    for r in res:
        assert r["own_group"] and r["runtime_uses_it"] and r["ranks"] == [0, 1]
        assert r["status_bytes"]["calls"] == 2 and r["status_bytes"]["sent"] > 0
        assert r["nonfinite"] is not None and r["nonfinite"][0] == "NonFiniteGradient", r["nonfinite"]
    a, b = res[0]["params"], res[1]["params"]
    assert all(torch.equal(a[n], b[n]) for n in a)


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


# ----------------------------------------------------------------------------- faults, update hooks
def test_fault_from_env_and_ulp_at_the_armed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CANZONA_FAULT", "kind=ulp,param=w,step=2,index=3")
    f = faults.from_env()
    assert f == faults.Fault("ulp", "w", 2, 3)
    monkeypatch.delenv("CANZONA_FAULT")
    assert faults.from_env() is None
    hook = faults.FaultHook(f)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    v = torch.ones(6)
    hook("w", v, opt)  # step 1: untouched
    assert torch.equal(v, torch.ones(6)) and not hook.fired
    hook("other", v, opt)
    assert not hook.fired and hook.count == 1
    hook("w", v, opt)  # step 2: element 3 moves by exactly one ulp
    assert hook.fired
    diff = (v != 1).nonzero().flatten().tolist()
    assert diff == [3] and v[3].item() == torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()
    hook("w", v, opt)  # later steps: untouched
    assert (v != 1).nonzero().flatten().tolist() == [3]


def test_stale_state_fault_undoes_one_state_update() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    hooks = UpdateHooks()
    hook = faults.FaultHook(faults.Fault("stale_state", "p", step=2))
    handle = hooks.register(hook)
    buffers = []
    for _ in range(3):
        p.grad = torch.ones(3)
        hooks.step(opt, [("p", p)])
        buffers.append(opt.state[p]["momentum_buffer"].clone())
    assert hook.fired
    assert torch.equal(buffers[1], buffers[0])  # the step-2 state change was lost
    assert not torch.equal(buffers[2], buffers[1])
    handle.remove()
    assert not hooks


@pytest.mark.parametrize("text", ["kind=ulp", "param=x", "kind=bogus,param=x", "kind=ulp,param=x,step=0", "nonsense", "kind=ulp,param=x,step=two"])
def test_bad_fault_specs_are_rejected(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("CANZONA_FAULT", text)
    with pytest.raises(ValueError, match="CANZONA_FAULT|fault"):
        faults.from_env()


def test_update_hooks_run_around_the_step_and_remove() -> None:
    """Hooks see (name, master, optimizer) after the step, ``before_update`` before it, in
    registration order, under no_grad; a removed hook is never called again."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.5)
    hooks = UpdateHooks()
    calls: list[tuple[str, str, float, bool]] = []

    class Both:
        def before_update(self, name: str, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
            calls.append(("before", name, float(param[0]), torch.is_grad_enabled()))

        def __call__(self, name: str, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
            assert optimizer is opt and param is p
            calls.append(("after", name, float(param[0]), torch.is_grad_enabled()))

    h1 = hooks.register(Both())
    h2 = hooks.register(lambda name, param, optimizer: calls.append(("plain", name, float(param[0]), torch.is_grad_enabled())))
    assert len(hooks) == 2
    p.grad = torch.ones(2)
    hooks.step(opt, [("p", p)])
    assert calls == [("before", "p", 1.0, False), ("after", "p", 0.5, False), ("plain", "p", 0.5, False)]
    h1.remove()
    h1.remove()  # idempotent
    calls.clear()
    hooks.step(opt, [("p", p)])
    assert calls == [("plain", "p", 0.0, False)]
    h2.remove()
    assert not hooks
    with pytest.raises(TypeError, match="callable"):
        hooks.register(42)  # type: ignore[arg-type]


def test_update_norm_log_matches_direct_norms() -> None:
    """The logger's norms are those of the update and the new value, bit for bit."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = torch.optim.AdamW([p], lr=0.1)
    hooks = UpdateHooks()
    log = UpdateNormLog()
    hooks.register(log)
    want = []
    for _ in range(3):
        old = p.detach().clone()
        p.grad = torch.randn(4, 3)
        hooks.step(opt, [("w", p)])
        want.append((float(torch.linalg.vector_norm(p.detach() - old)), float(torch.linalg.vector_norm(p.detach()))))
    rows = log.rows()
    assert rows == {"w": [(k + 1, u, n) for k, (u, n) in enumerate(want)]}
    assert log.gather() == rows  # no process group: this rank's rows
    assert log.ratios()["w"] == [u / n for u, n in want]
    log.clear()
    assert log.rows() == {}


def test_front_end_hook_sees_every_parameter_once_per_step_and_plants_a_fault(single_rank_group) -> None:
    """One rank owns everything: the hook registered on ``DistributedOptimizer`` sees each
    parameter once per step with its own optimizer; a planted ulp moves exactly that element of the
    model's parameter; after ``remove()`` nothing is called and nothing is perturbed."""
    import canzona
    from validation.harness import ToyModel, inject_grads, integer_grads

    def run(plant: bool) -> tuple[list[tuple[str, int]], dict[str, torch.Tensor]]:
        model = ToyModel()
        opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", bucket_numel=40)
        seen: list[tuple[str, int]] = []
        inner = {id(o) for o in (opt.runtime.matrix_opt, opt.runtime.elementwise_opt)}
        h = opt.register_update_hook(lambda n, p, o: seen.append((n, opt.steps)) if id(o) in inner and p in o.state else None)
        fault = faults.FaultHook(faults.Fault("ulp", "mix.weight", step=2, index=4)) if plant else None
        hf = opt.register_update_hook(fault) if fault is not None else None
        for step in range(3):
            if step == 2:
                h.remove()
                if hf is not None:
                    hf.remove()
            inject_grads(model, integer_grads(model, step=step, rank=0))
            opt.step()
            opt.zero_grad()
        assert fault is None or fault.fired
        return seen, {n: p.detach().clone() for n, p in model.named_parameters()}

    seen, clean = run(False)
    names = [n for n, _ in ToyModel().named_parameters()]
    assert sorted(seen) == sorted((n, s) for n in names for s in (0, 1))
    _, faulty = run(True)
    for n in names:
        if n == "mix.weight":
            assert (faulty[n] != clean[n]).flatten().nonzero().flatten().tolist() != []
        else:
            assert torch.equal(faulty[n], clean[n]), n


def test_two_stage_work_launches_its_second_stage_on_advance_and_waits_it_once() -> None:
    """The rank-order all-reduce's work: ``advance()`` waits the first collective and launches the
    second (so a caller can launch every bucket's second stage before waiting any), ``wait()``
    advances if needed and waits the second, each exactly once."""
    from canzona.runtime.comm import _TwoStageWork

    log: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait(self, timeout: object = None) -> bool:
            log.append(f"wait {self.name}" + ("" if timeout is None else f" {timeout}"))
            return True

    def then(name: str) -> Fake:
        log.append(f"launch {name}")
        return Fake(name)

    a, b = _TwoStageWork(Fake("rs0"), lambda: then("ag0")), _TwoStageWork(Fake("rs1"), lambda: then("ag1"))
    a.advance()
    b.advance()
    a.advance()  # a second advance does nothing
    a.wait()
    b.wait()
    b.wait()
    assert log == ["wait rs0", "launch ag0", "wait rs1", "launch ag1", "wait ag0", "wait ag1"]
    log.clear()
    _TwoStageWork(Fake("rs"), lambda: then("ag")).wait(5)  # a timeout reaches both stages
    assert log == ["wait rs 5", "launch ag", "wait ag 5"]
