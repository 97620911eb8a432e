"""The asynchronous runtime: the TP engine's explicit schedule, reserved exchange buffers,
launch/wait phase ranges with profiler arguments, and backend-chosen collectives.

The multi-process part runs once (module-scoped fixture, world 2, gloo) and each test asserts on
its own part of the result.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from canzona.config import load_model_config
from canzona.phase_names import LAUNCH, WAIT, parse
from canzona.plan import PlanInputs, make_plan
from canzona.runtime import phases
from canzona.runtime.launch import run_workers
from canzona.runtime.phases import PhaseTimer, phase, timing
from canzona.runtime.exchange import (
    APPLY,
    COMPUTE,
    GATHER_LAUNCH,
    GATHER_WAIT,
    SCATTER_LAUNCH,
    SCATTER_WAIT,
    pipeline,
)
from canzona.specs import specs_from_config

CFG = load_model_config("qwen3-tiny")
STEPS = 3


# =========================================================================== the schedule (pure)


def _in_flight(events: list[tuple[str, int]]) -> list[tuple[set[int], set[int]]]:
    """Gathers and scatters in flight after each event."""
    g: set[int] = set()
    s: set[int] = set()
    out = []
    for ev, k in events:
        {GATHER_LAUNCH: g.add, GATHER_WAIT: g.discard, SCATTER_LAUNCH: s.add, SCATTER_WAIT: s.discard}.get(ev, lambda _k: None)(k)
        out.append((set(g), set(s)))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_pipeline_is_complete_ordered_and_bounded(n: int) -> None:
    ev = pipeline(n)
    pos = {e: i for i, e in enumerate(ev)}
    assert len(ev) == len(pos) == 6 * n  # every event once per group
    for k in range(n):
        chain = [GATHER_LAUNCH, GATHER_WAIT, COMPUTE, SCATTER_LAUNCH, SCATTER_WAIT, APPLY]
        assert [pos[c, k] for c in chain] == sorted(pos[c, k] for c in chain), k
        if k + 1 < n:
            # gather k+1 is in flight while group k computes ...
            assert pos[GATHER_LAUNCH, k + 1] < pos[COMPUTE, k] < pos[GATHER_WAIT, k + 1]
        if k >= 1:
            # ... and so is scatter k-1, applied right after compute k
            assert pos[SCATTER_LAUNCH, k - 1] < pos[COMPUTE, k] < pos[SCATTER_WAIT, k - 1]
            assert pos[APPLY, k - 1] < pos[SCATTER_LAUNCH, k]
    # one collective per slot at a time: the two reserved slots suffice
    for gathers, scatters in _in_flight(ev):
        assert len(gathers) <= 1 and len(scatters) <= 1


def test_pipeline_sync_has_no_scatter() -> None:
    ev = pipeline(3, sync=True)
    assert {e for e, _ in ev} == {GATHER_LAUNCH, GATHER_WAIT, COMPUTE, APPLY}
    assert ev.index((GATHER_LAUNCH, 1)) < ev.index((COMPUTE, 0))
    assert ev.index((APPLY, 0)) == ev.index((COMPUTE, 0)) + 1
    assert pipeline(0) == [] and pipeline(0, sync=True) == []


# =========================================================================== phases (no processes)


def test_timer_keeps_launch_and_wait_apart() -> None:
    timer = PhaseTimer()
    with timing(timer):
        for k in range(2):
            with phase(f"canzona/tp/scatter/group{k}/launch", bytes=8, group=k, peers=2):
                pass
            with phase(f"canzona/tp/scatter/group{k}/wait"):
                pass
        with phase("canzona/tp/compute/group0"):
            pass
    assert timer.calls == {"canzona/tp/scatter/launch": 2, "canzona/tp/scatter/wait": 2, "canzona/tp/compute": 1}


def test_phase_args_cost_nothing_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("a profiler range was entered with no profiler recording")

    monkeypatch.setattr(phases, "_RecordFunctionFast", boom)
    monkeypatch.setattr(torch.profiler, "record_function", boom)
    with phase("canzona/dp/all_gather/bucket0/launch", bytes=1 << 20, bucket=0, peers=4):
        pass


def test_phase_args_reach_the_chrome_trace(tmp_path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    name = "canzona/dp/reduce_scatter/bucket2/launch"
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        with phase(name, bytes=4096, bucket=2, peers=4):
            torch.ones(3).sum()
    path = tmp_path / "t.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("name") == name]
    cats = {e.get("cat") for e in events}
    assert "user_annotation" in cats, cats  # the range trace summaries count
    with_args = [e for e in events if "bytes" in e.get("args", {})]
    assert len(with_args) == 1
    assert {k: with_args[0]["args"][k] for k in ("bytes", "bucket", "peers")} == {"bytes": 4096, "bucket": 2, "peers": 4}


# =========================================================================== distributed (world 2)


def _plan(cmax: int):
    specs = specs_from_config(CFG, tp=2, layout="hf")
    inputs = PlanInputs(
        model=CFG.name, layout="hf", dp=1, tp=2, optimizer="muon", strategy="lb-asc",
        tp_schedule="lpt", bucket_numel=20_000, cmax_bytes=cmax,
    )
    return make_plan(specs, inputs)


def _grad(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    return torch.randint(-8, 8, shape, generator=gen).to(torch.float32) * 2.0**-4


def _async_worker(rank: int, world: int, trace_dir: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    import canzona
    from canzona.models import Qwen3
    from canzona.optim import Muon
    from canzona.runtime.comm import Comm
    from canzona.runtime.tp import TPEngine
    from validation.harness import ToyModel, inject_grads, integer_grads

    out: dict = {}
    plan = _plan(cmax=50_000)  # several micro-groups
    comm = Comm(None)
    full = {n: p.detach().clone() for n, p in Qwen3(CFG, seed=5).named_parameters()}
    mine = [p for p in plan.params if p.spec.kind == "matrix" and p.spec.tp_split]
    local = {p.name: full[p.name].chunk(2, dim=p.spec.tp_dim)[rank].clone() for p in mine}

    def factory(ps):
        return Muon(ps, lr=0.02, weight_decay=0.01)

    engine = TPEngine(plan, dp_rank=0, comm=comm, optimizer_factory=factory, local_masters=local)
    # record the buffers every exchange sends from and receives into
    calls: list[tuple[str, int, int]] = []
    a2a = comm.all_to_all_v

    def recording(send, send_sizes, recv_sizes, *, out=None, async_op=False):
        res, work = a2a(send, send_sizes, recv_sizes, out=out, async_op=async_op)
        calls.append(("a2a" if async_op else "a2a-sync", send.data_ptr(), res.data_ptr()))
        return res, work

    comm.all_to_all_v = recording  # type: ignore[method-assign]
    ref = {p.name: torch.nn.Parameter(full[p.name].clone()) for p in mine}
    ref_opt = factory(list(ref.values()))
    per_step_ptrs, events = [], []
    for step in range(STEPS):
        calls.clear()
        grads = {p.name: _grad(p.name, p.spec.shape, step).chunk(2, dim=p.spec.tp_dim)[rank].clone() for p in mine}
        if step == STEPS - 1:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                engine.step(grads)
            prof.export_chrome_trace(str(Path(trace_dir) / f"tp{rank}.json"))
        else:
            engine.step(grads)
        per_step_ptrs.append(sorted({(p, q) for _, p, q in calls}))
        events.append(list(engine.last_events))
        for p in mine:
            ref[p.name].grad = _grad(p.name, p.spec.shape, step)
        ref_opt.step()
    slot_ptrs = sorted(t.data_ptr() for t in engine.slots.tensors() if t.numel())
    out["tp"] = {
        "n_groups": len(engine.groups),
        "events": events,
        "schedule": list(engine.schedule_events),
        "ptrs": per_step_ptrs,
        "slot_ptrs": slot_ptrs,
        "all_async": all(kind == "a2a" for kind, _, _ in calls),
        "reserved": engine.reserved_exchange_bytes,
        "peak": engine.peak_exchange_bytes,
        "cmax": plan.inputs.cmax_bytes,
        "exact": all(torch.equal(local[p.name], ref[p.name].detach().chunk(2, dim=p.spec.tp_dim)[rank]) for p in mine),
    }

    # DP side: launch/wait ranges with arguments in a real step's trace
    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", bucket_numel=40)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        inject_grads(model, integer_grads(model, step=0, rank=rank))
        opt.step()
    prof.export_chrome_trace(str(Path(trace_dir) / f"dp{rank}.json"))
    out["dp_times"] = sorted(opt.phase_times.as_dict())
    out["dp_buckets"] = len(opt.plan.buckets)

    # uneven all-gather into a caller's buffer
    sizes = [3, 2]
    mine_t = torch.arange(sizes[rank], dtype=torch.float32) + 10 * rank
    buf = torch.full((sum(sizes),), -1.0)
    got, work = Comm(None).all_gather_v(mine_t, sizes, out=buf, async_op=True)
    work.wait()
    out["ag"] = (got.data_ptr() == buf.data_ptr(), got.tolist())

    # equal all-gathers sent from this rank's own region of the output (the DP runtime's parameter
    # buffers): in place, no copy of the region, several in flight at once
    clones: list[int] = []
    real_clone = torch.Tensor.clone
    torch.Tensor.clone = lambda t, *a, **k: clones.append(t.numel()) or real_clone(t, *a, **k)  # type: ignore[method-assign]
    try:
        pending = []
        for b, n in enumerate((1, 5, 1000, 70_000)):
            full = torch.full((2 * n,), -1.0)
            full[rank * n : (rank + 1) * n] = torch.arange(n, dtype=torch.float32) + 1000 * rank + b
            pending.append((b, n, *Comm(None).all_gather_v(full[rank * n : (rank + 1) * n], [n, n], out=full, async_op=True)))
        good = []
        for b, n, got_b, w in pending:
            w.wait()
            good.append(torch.equal(got_b, torch.cat([torch.arange(n, dtype=torch.float32) + 1000 * r + b for r in range(2)])))
    finally:
        torch.Tensor.clone = real_clone  # type: ignore[method-assign]
    out["ag_in_place"] = (good, clones)
    return out


@pytest.fixture(scope="module")
def async_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    d = tmp_path_factory.mktemp("async")
    return run_workers(_async_worker, 2, str(d), timeout_s=150), d


@pytest.mark.slow
def test_engine_runs_the_pipeline_and_stays_exact(async_run) -> None:
    res, _ = async_run
    for r in res:
        tp = r["tp"]
        assert tp["n_groups"] >= 3, "the case needs several micro-groups"
        assert [tuple(e) for e in tp["schedule"]] == pipeline(tp["n_groups"])
        for ev in tp["events"]:
            assert [tuple(e) for e in ev] == pipeline(tp["n_groups"])
        assert tp["all_async"], "every exchange of a step must be started asynchronously"
        assert tp["exact"], "the pipelined engine differs from single-device Muon"


@pytest.mark.slow
def test_exchange_buffers_are_reserved_once_and_reused(async_run) -> None:
    res, _ = async_run
    for r in res:
        tp = r["tp"]
        # every step exchanges through the same buffers, and they are the engine's reserved slots
        assert tp["ptrs"][0] == tp["ptrs"][1] == tp["ptrs"][2]
        used = {p for pair in tp["ptrs"][0] for p in pair}
        assert used <= set(tp["slot_ptrs"])
        # two slots (gather, scatter) of two buffers each, every buffer within C_max
        assert tp["peak"] <= tp["cmax"]
        assert 0 < tp["reserved"] <= 4 * tp["peak"]


def _trace_events(path: Path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if str(e.get("name", "")).startswith("canzona/")]


@pytest.mark.slow
def test_traces_show_launch_and_wait_with_arguments(async_run) -> None:
    res, d = async_run
    for rank in range(2):
        tp = _trace_events(d / f"tp{rank}.json")
        staged = {(parse(e["name"]).base, parse(e["name"]).stage) for e in tp if e.get("cat") == "user_annotation"}
        for base in ("canzona/tp/gather", "canzona/tp/scatter"):
            assert {(base, LAUNCH), (base, WAIT)} <= staged, staged
        launches = [e for e in tp if parse(e["name"]).stage == LAUNCH and "bytes" in e.get("args", {})]
        assert launches and all(e["args"]["peers"] == 2 and isinstance(e["args"]["group"], int) for e in launches)
        dp = _trace_events(d / f"dp{rank}.json")
        rs = [e for e in dp if parse(e["name"]).base == "canzona/dp/reduce_scatter"]
        assert {parse(e["name"]).stage for e in rs} == {LAUNCH, WAIT}
        with_args = [e for e in rs if "bucket" in e.get("args", {})]
        assert {e["args"]["bucket"] for e in with_args} == set(range(res[rank]["dp_buckets"]))
        ag = {parse(e["name"]).stage for e in dp if parse(e["name"]).base == "canzona/dp/all_gather"}
        assert ag == {LAUNCH, WAIT}
    # the timer keeps issue cost and blocked time apart
    assert {"canzona/dp/reduce_scatter/launch", "canzona/dp/reduce_scatter/wait",
            "canzona/dp/all_gather/launch", "canzona/dp/all_gather/wait"} <= set(res[0]["dp_times"])


@pytest.mark.slow
def test_bucket_all_gathers_leave_while_later_buckets_update(async_run) -> None:
    """Inside the step, bucket 0's parameter all-gather is launched right after its own update,
    before the later buckets' updates run (so it travels while they compute), and every gather is
    waited before ``step()`` returns (eager)."""
    res, d = async_run
    for rank in range(2):
        n = res[rank]["dp_buckets"]
        assert n >= 3, "the case needs several buckets"
        dp = _trace_events(d / f"dp{rank}.json")

        def start(name: str) -> float:
            hits = [e["ts"] for e in dp if e["name"] == name and e.get("cat") == "user_annotation"]
            assert len(hits) == 1, (name, len(hits))
            return hits[0]

        step = next(e for e in dp if e["name"] == "canzona/optimizer/step" and e.get("cat") == "user_annotation")
        launch0 = start("canzona/dp/all_gather/bucket0/launch")
        assert start("canzona/dp/local_update/bucket0") < launch0 < start(f"canzona/dp/local_update/bucket{n - 1}")
        assert step["ts"] < launch0 < step["ts"] + step["dur"]
        for i in range(n):
            assert start(f"canzona/dp/all_gather/bucket{i}/wait") > launch0


@pytest.mark.slow
def test_uneven_all_gather_into_a_given_buffer(async_run) -> None:
    res, _ = async_run
    for r in res:
        same, values = r["ag"]
        assert same
        assert values == [0.0, 1.0, 2.0, 10.0, 11.0]
        good, clones = r["ag_in_place"]
        assert good == [True] * 4 and clones == [], (good, clones)


# =========================================================================== the shared engine (one rank)


def test_engine_runs_overlap_work_after_the_first_launch_and_reads_skip_at_compute(single_rank_group) -> None:
    """``MicroGroupEngine.run(overlap=...)`` runs the caller's work once, right after the first
    gather is launched (and also when there is no micro-group at all); tasks the caller adds to
    the ``skip`` set it passed are not stepped."""
    from canzona.runtime.comm import Comm
    from canzona.phase_names import exchange_phases
    from canzona.runtime.exchange import Block, ExchangeTask, MicroGroupEngine, PieceLayout

    names = exchange_phases("canzona/shard/gather", "canzona/shard/compute", "canzona/shard/scatter", "canzona/shard/apply")

    def task(name: str, shape: tuple[int, int]) -> ExchangeTask:
        return ExchangeTask(PieceLayout(name, shape, (Block((0, 0), shape),)), 0)

    groups = [[task("a", (3, 4)), task("b", (2, 5))], [task("c", (4, 4))]]
    values = {t.name: torch.randn(t.layout.full_shape, generator=torch.Generator().manual_seed(i)) for i, g in enumerate(groups) for t in g}
    initial = {k: v.clone() for k, v in values.items()}
    engine = MicroGroupEngine(groups, comm=Comm(None), optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.5), initial=values, phases=names)
    skip: set[str] = set()
    seen: list[list[tuple[str, int]]] = []

    def work() -> None:
        seen.append(list(engine.last_events))
        skip.add("c")  # decided after the first launch: group 1 must not step it

    grads = {k: torch.ones_like(v) for k, v in values.items()}
    engine.run(grads, values, skip=skip, overlap=work)
    assert seen == [[(GATHER_LAUNCH, 0)]]
    assert engine.last_events == pipeline(2)
    assert torch.equal(values["a"], initial["a"] - 0.5) and torch.equal(values["b"], initial["b"] - 0.5)
    assert torch.equal(values["c"], initial["c"])
    empty = MicroGroupEngine([], comm=Comm(None), optimizer_factory=lambda ps: torch.optim.SGD(ps, lr=0.5), initial={}, phases=names)
    calls: list[int] = []
    empty.run({}, {}, overlap=lambda: calls.append(1))
    assert calls == [1]
