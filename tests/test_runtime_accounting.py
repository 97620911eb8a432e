"""Communication accounting: the paper's structural claim, measured per rank per phase.

For a ZeRO-1 buffer of N elements (fp32) over R DP ranks (Sections 2.2 and 3.1):

- ``lb-asc`` (and ``asc``, ``lb-asc-joint``, ``zero1``) move exactly one reduce-scatter in
  forward-backward: (R - 1) N elements sent in total, rank r sending N - S_r of its cut;
- ``sc`` all-reduces: 2 (R - 1) N, twice that;
- the optimizer step of the reduce-scatter strategies moves zero bytes; the updated values return
  in the all-gather phase after it, which mirrors the reduce-scatter;
- ``layerwise`` all-reduces like ``sc`` and broadcasts every parameter from its owner inside the
  step: (R - 1) numel elements per parameter;
- the step's two status exchanges (control traffic, their own phase ``canzona/status``) are
  all-reduces of 1 + 2 + 2P and of 1 int64 values (P parameters), in every strategy.

Run with ``-s`` to see the per-phase table (``pytest -q -s tests/test_runtime_accounting.py``).
"""

from __future__ import annotations

import pytest

from canzona.runtime.phases import (
    DP_ALL_GATHER,
    DP_ALL_REDUCE,
    DP_LOCAL_UPDATE,
    DP_REDUCE_SCATTER,
    LAYERWISE_BROADCAST,
    OPTIMIZER_STEP,
    STATUS,
)
from canzona.runtime.comm import even_sizes
from validation.harness import ToyModel, inject_grads, integer_grads

pytestmark = pytest.mark.slow

STRATEGIES = ("zero1", "sc", "layerwise", "asc", "lb-asc", "lb-asc-joint")
BUCKET_NUMEL = 40


def accounting_worker(rank: int, world: int) -> dict:
    import canzona

    out = {}
    for strategy in STRATEGIES:
        model = ToyModel()
        opt = canzona.DistributedOptimizer(
            model, "adamw" if strategy == "zero1" else "muon", strategy=strategy, bucket_numel=BUCKET_NUMEL
        )
        assert opt.comm_stats.as_dict() == {}, "construction traffic must not be counted"
        inject_grads(model, integer_grads(model, step=0, rank=rank))
        fwd_bwd = opt.comm_stats.as_dict()
        opt.comm_stats.reset()
        opt.step()
        step = opt.comm_stats.as_dict()
        plan = opt.plan
        out[strategy] = {
            "fwd_bwd": fwd_bwd,
            "step": step,
            "N": plan.buffer_numel,
            "buckets": len(plan.buckets),
            "shards": [b.shard_sizes() for b in plan.buckets],
            "numels": [p.numel for p in plan.params],
            "es": opt.runtime.buffer.data.element_size(),
            "state_bytes": opt.state_bytes(),
            "times": sorted(opt.phase_times.as_dict()),
        }
    return out


def _sent(res: list[dict], strategy: str, when: str, phase: str) -> int:
    return sum(r[strategy][when].get(phase, {}).get("sent", 0) for r in res)


def _recv(res: list[dict], strategy: str, when: str, phase: str) -> int:
    return sum(r[strategy][when].get(phase, {}).get("recv", 0) for r in res)


def _table(res: list[dict], world: int) -> str:
    lines = [f"world {world}: bytes sent, summed over ranks (fp32, N = {res[0]['lb-asc']['N']} elements)"]
    for st in STRATEGIES:
        fb = sum(v["sent"] for r in res for v in r[st]["fwd_bwd"].values())
        inside = sum(v["sent"] for r in res for k, v in r[st]["step"].items() if k not in (DP_ALL_GATHER, STATUS))
        ag = _sent(res, st, "step", DP_ALL_GATHER)
        status = _sent(res, st, "step", STATUS)
        lines.append(f"  {st:13s} fwd-bwd {fb:7d}  optimizer step {inside:6d}  post-step all-gather {ag:6d}  status {status:4d}")
    return "\n".join(lines)


def _status_bytes(n_params: int, world: int, rank: int) -> int:
    """Bytes rank ``rank`` sends (and receives) in a step's two status exchanges: all-reduces of
    ``[error, digest, -digest, received (P), non-finite (P)]`` and of ``[error]``, int64."""
    total = 0
    for n in (3 + 2 * n_params, 1):
        own = even_sizes(n, world)[rank]
        total += ((n - own) + (world - 1) * own) * 8
    return total


@pytest.mark.parametrize("world", [2, 4])
def test_comm_volumes(comm_runs, world: int) -> None:
    res = comm_runs(world, "accounting")
    print("\n" + _table(res, world))
    N, es = res[0]["lb-asc"]["N"], res[0]["lb-asc"]["es"]
    rs_volume = (world - 1) * N * es
    for st in ("zero1", "asc", "lb-asc", "lb-asc-joint"):
        # fwd-bwd: exactly one reduce-scatter of the buffer, nothing else
        for r, rr in enumerate(res):
            d = rr[st]
            assert set(d["fwd_bwd"]) == {DP_REDUCE_SCATTER}, (st, d["fwd_bwd"])
            mine = sum(s[r] for s in d["shards"])
            assert d["fwd_bwd"][DP_REDUCE_SCATTER] == {"sent": (N - mine) * es, "recv": (world - 1) * mine * es, "calls": d["buckets"]}
            # the step itself moves nothing but its status exchanges; only the post-step
            # all-gather phase carries values
            assert set(d["step"]) == {DP_ALL_GATHER, STATUS}, (st, d["step"])
            assert d["step"][DP_ALL_GATHER] == {"sent": (world - 1) * mine * es, "recv": (N - mine) * es, "calls": d["buckets"]}
            assert DP_LOCAL_UPDATE in d["times"] and OPTIMIZER_STEP in d["times"]
        assert _sent(res, st, "fwd_bwd", DP_REDUCE_SCATTER) == rs_volume
        assert _recv(res, st, "fwd_bwd", DP_REDUCE_SCATTER) == rs_volume
        assert _sent(res, st, "step", OPTIMIZER_STEP) == 0 and _sent(res, st, "step", DP_LOCAL_UPDATE) == 0
    # sc: the all-reduce moves exactly twice the reduce-scatter volume; its step moves nothing
    for st in ("sc", "layerwise"):
        assert all(set(r[st]["fwd_bwd"]) == {DP_ALL_REDUCE} for r in res)
        assert _sent(res, st, "fwd_bwd", DP_ALL_REDUCE) == 2 * rs_volume
    assert all(set(r["sc"]["step"]) == {STATUS} for r in res)
    # the status exchanges: exactly their all-reduces, two calls per step, in every strategy
    for st in STRATEGIES:
        for r, rr in enumerate(res):
            expected = _status_bytes(len(rr[st]["numels"]), world, r)
            assert rr[st]["step"][STATUS] == {"sent": expected, "recv": expected, "calls": 2}, (st, r, rr[st]["step"])
    # layerwise: owners broadcast every parameter inside the step
    numels = res[0]["layerwise"]["numels"]
    assert all(set(r["layerwise"]["step"]) == {LAYERWISE_BROADCAST, STATUS} for r in res)
    assert _sent(res, "layerwise", "step", LAYERWISE_BROADCAST) == (world - 1) * sum(numels) * es
    assert _recv(res, "layerwise", "step", LAYERWISE_BROADCAST) == (world - 1) * sum(numels) * es
    # optimizer state is partitioned: under lb-asc each parameter's state lives on exactly one rank,
    # so the ranks together hold what every sc rank holds alone
    assert sum(r["lb-asc"]["state_bytes"] for r in res) == res[0]["sc"]["state_bytes"]
    assert all(r["lb-asc"]["state_bytes"] < r["sc"]["state_bytes"] for r in res)
