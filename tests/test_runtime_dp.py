"""Every DP strategy equals a single-process run of the same optimizer on the same reduced gradients.

Bitwise (torch.equal) throughout:

- injected gradients are small integers times 2**-4 (:func:`validation.harness.integer_grads`), so
  any reduction order gives the same sum and the mean over a power-of-two DP size is exact;
- real backward passes at DP=2 are bitwise too: a two-rank sum is one addition, and floating-point
  addition is commutative, so gloo's reduce gives exactly ``g0 + g1``, which the reference forms;
- DP2 x TP2 with injected gradients on the tiny Qwen3 model (TP micro-groups) is bitwise against
  the full-shape single-process run; with real backward the TP forward reassociates sums (row-
  parallel matmuls), so that case checks DP-replica agreement bitwise and the reference only to a
  bound (see the test).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from canzona.runtime.launch import run_workers
from harness import attempt, case_results, raised
from validation.harness import ReferenceRunner, ToyModel, inject_grads, integer_grads, mean_grads, pack, params_of, tensors_equal, tp_local, unpack

pytestmark = pytest.mark.slow

STEPS = 3
MATRIX_KW = {"lr": 0.05}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}
#: (strategy, optimizer, grad_reduce, feed): feed "hook" injects through backward, "direct" sets p.grad
CASES: list[tuple[str, str, str, str]] = [
    ("zero1", "adamw", "mean", "hook"),
    ("sc", "muon", "mean", "hook"),
    ("layerwise", "torch-muon", "mean", "hook"),
    ("asc", "shampoo", "mean", "hook"),
    ("lb-asc", "muon", "mean", "hook"),
    ("lb-asc", "soap", "sum", "direct"),
    ("lb-asc-joint", "muon", "mean", "hook"),
]


def _cls(name: str) -> type[torch.optim.Optimizer]:
    from canzona.optim import SOAP, Muon, Shampoo

    return {"adamw": torch.optim.AdamW, "muon": Muon, "torch-muon": torch.optim.Muon, "shampoo": Shampoo, "soap": SOAP}[name]


def _run_case(rank: int, case: tuple[str, str, str, str], bucket_numel: int) -> dict:
    import canzona

    strategy, optname, reduce, feed = case
    model = ToyModel()
    opt = canzona.DistributedOptimizer(
        model,
        _cls(optname),
        strategy=strategy,
        optimizer_kwargs=MATRIX_KW,
        elementwise_kwargs=EW_KW,
        bucket_numel=bucket_numel,
        grad_reduce=reduce,
    )
    launched_in_backward = []
    for s in range(STEPS):
        grads = integer_grads(model, step=s, rank=rank)
        if feed == "hook":
            inject_grads(model, grads)
            launched_in_backward.append(opt.runtime.buffer.all_launched)
        else:
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
        opt.step()
        opt.zero_grad()
    return {"params": params_of(model), "launched": launched_in_backward, "cut": _has_cut_piece(opt),
            "viewed": sorted(opt.runtime.param_views), "names": sorted(n for n, _ in model.named_parameters()),
            "masters": _master_layout(opt.runtime)}


def _has_cut_piece(opt) -> bool:
    return any(not pc.whole for pc in opt.runtime.pieces)


def world_worker(rank: int, world: int, bucket_numel: int) -> bytes:
    """One spawned run per world size: every strategy, then the real-backward (world 2) or the
    DP2 x TP2 (world 4) checks, so the process start-up cost is paid once. Each case's outcome is
    recorded on its own (:func:`harness.attempt`), so a failing case fails its own test."""
    out: dict = {"strategies": {case: attempt(_run_case, rank, case, bucket_numel) for case in CASES}}
    if world == 2:
        out["backward"] = {st: attempt(_backward_case, rank, st) for st in BACKWARD_STRATEGIES}
        out["lazy"] = {None: attempt(_lazy_case, rank)}
        out["frozen"] = {None: attempt(_frozen_case, rank)}
        out["bf16"] = {case: attempt(_bf16_case, rank, *case) for case in BF16_CASES}
        out["per_bucket"] = _per_bucket_cases(rank)
        out["views"] = {key: attempt(_views_case, rank, key) for key in VIEW_CASES}
    if world == 4:
        out["tp"] = {key: attempt(_tp_case, rank, *key) for key in TP_CASES}
        out["tp_error"] = {None: attempt(_tp_error_case, rank)}
    return pack(out)


@pytest.fixture(scope="module")
def runs() -> Callable[..., list]:
    """``runs(world, section, key)``: every rank's result of one case, from one spawned run per
    world size (started on first use); a case that raised on a rank fails the asking test only,
    naming the case, the rank and the worker's traceback."""
    cache: dict[int, list[dict]] = {}

    def get(world: int, section: str, key: object = None) -> list:
        if world not in cache:
            cache[world] = [unpack(r) for r in run_workers(world_worker, world, 40, timeout_s=240)]
        return case_results(cache[world], section, key)

    return get


def _reference(case: tuple[str, str, str, str], world: int) -> dict[str, torch.Tensor]:
    strategy, optname, reduce, _ = case
    model = ToyModel()
    ref = ReferenceRunner(model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1")
    for s in range(STEPS):
        ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(world)], reduce=reduce))
    return ref.params()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_every_strategy_matches_single_process_bitwise(runs, world: int, case: tuple[str, str, str, str]) -> None:
    results = runs(world, "strategies", case)
    want = _reference(case, world)
    for rank, got in enumerate(results):
        assert tensors_equal(want, got["params"]) == [], f"{case} rank {rank}: differs from the single-process run"
        if case[3] == "hook":
            # every bucket's collective was launched by the backward hooks, before step()
            assert all(got["launched"]), f"{case}: some bucket waited for step() to launch"
    if case[0] == "zero1":
        # zero1 with 40-element buckets must cut parameters, so the flat-piece path is exercised
        assert results[0]["cut"], "zero1 cut no parameter"
    if case[0] != "layerwise":
        # fp32 model: parameters are views of the parameter buffers and every owned master is its
        # slot, sc's (every rank owns everything) included; layerwise broadcasts into the parameters
        for got in results:
            m = got["masters"]
            assert got["viewed"] == got["names"], case
            assert m["separate"] == [] and m["inside"] and m["master_bytes"] == 0 and m["packed"] == 0, (case, m)


# ------------------------------------------------------------------------------ real backward


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 13, (3, 7), generator=g)


BACKWARD_STRATEGIES = ("lb-asc", "sc")


def _backward_case(rank: int, strategy: str) -> dict[str, torch.Tensor]:
    import canzona

    model = ToyModel(seed=3)
    opt = canzona.DistributedOptimizer(
        model, "muon", strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=64
    )
    losses = []
    for s in range(STEPS):
        # gradient accumulation over two micro-batches: the first without launching collectives
        with opt.no_sync():
            model.loss(_batch(s, 2 * rank)).backward()
        assert not opt.runtime.buffer.all_launched
        loss = model.loss(_batch(s, 2 * rank + 1))
        loss.backward()
        losses.append(float(loss))
        opt.step()
        opt.zero_grad()
    return params_of(model)


@pytest.mark.parametrize("strategy", BACKWARD_STRATEGIES)
def test_real_backward_dp2_bitwise(runs, strategy: str) -> None:
    from canzona.optim import Muon

    got = runs(2, "backward", strategy)
    model = ToyModel(seed=3)
    ref = ReferenceRunner(model, Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    for s in range(STEPS):
        per_rank = []
        for r in range(2):
            ref.model.zero_grad(set_to_none=True)
            ref.model.loss(_batch(s, 2 * r)).backward()
            ref.model.loss(_batch(s, 2 * r + 1)).backward()  # accumulates in p.grad: g_a + g_b, as the buffer does
            per_rank.append({n: p.grad.clone() for n, p in ref.model.named_parameters()})
        ref.model.zero_grad(set_to_none=True)
        ref.step(mean_grads(per_rank))
    want = ref.params()
    for rank in range(2):
        assert tensors_equal(want, got[rank]) == [], f"rank {rank} differs from the single-process run"


# ------------------------------------------------------------------------------ DP2 x TP2 (tiny Qwen3)


def _tiny():
    from canzona.config import load_model_config
    from canzona.models import Qwen3

    cfg = load_model_config("qwen3-tiny")
    torch.manual_seed(0)
    return cfg, Qwen3(cfg)


#: (strategy, feed): "inject" DTensor TP with injected integer gradients, "megatron" the same on
#: plain-tensor shards with declared ``tp_dims``, "backward" DTensor TP with real backward passes
#: "split": as "inject", planned with separate matrix / element-wise buffers (the paper authors' layout)
TP_CASES = (("lb-asc", "inject"), ("sc", "inject"), ("lb-asc-joint", "megatron"), ("lb-asc", "backward"), ("lb-asc", "split"))


def _tp_case(rank: int, strategy: str, feed: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.models.qwen3 import lm_loss
    from canzona.models.tp import parallelize, shard_megatron

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    cfg, model = _tiny()
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    tp_dims = None
    if feed == "megatron":
        tp_dims = shard_megatron(model, tp_rank, 2, group=mesh.get_group("tp"))
    else:
        parallelize(model, mesh["tp"])
    mat_kw, ew_kw = (TP_BACKWARD_MATRIX_KW, TP_BACKWARD_EW_KW) if feed == "backward" else (MATRIX_KW, EW_KW)
    plan = None
    if feed == "split":
        from canzona.plan import PlanInputs, make_plan
        from canzona.specs import specs_from_module

        inputs = PlanInputs(model="qwen3-tiny", layout="module", dp=2, tp=2, optimizer="muon", strategy=strategy,
                            tp_schedule="lpt", bucket_numel=4096, buffers="split")
        plan = make_plan(specs_from_module(model, tp=2), inputs)
    opt = canzona.DistributedOptimizer(
        model, "muon", strategy=strategy, mesh=mesh, optimizer_kwargs=mat_kw, elementwise_kwargs=ew_kw, bucket_numel=4096, tp_dims=tp_dims,
        plan=plan,
    )
    if feed == "split":  # the runtime ran the split geometry: no bucket mixes the two kinds
        assert all(len({opt.plan.param(n).spec.kind for n in b.params}) == 1 for b in opt.plan.buckets)
    for s in range(STEPS):
        if feed != "backward":
            full = integer_grads(full_shapes, step=s, rank=dp_rank, seed=7)
            # the model all-reduces its per-head q/k norm gradients over TP: inject full / tp there
            qk = {n for n in full if n.endswith(("q_norm.weight", "k_norm.weight"))}
            inject_grads(model, tp_local(full, opt.plan.specs, tp_rank, partial=qk))
        else:
            ids = _tp_ids(cfg, s, dp_rank)
            lm_loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    dtensor = sorted(n for n, p in model.named_parameters() if hasattr(p, "to_local"))
    full_params = {}
    for n, p in model.named_parameters():
        if tp_dims is not None and n in tp_dims:  # plain local shard: gather the TP group's shards
            parts = [torch.empty_like(p.detach()) for _ in range(2)]
            torch.distributed.all_gather(parts, p.detach().contiguous(), group=mesh.get_group("tp"))
            full_params[n] = torch.cat(parts, dim=tp_dims[n])
        else:
            full_params[n] = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
    return {"params": full_params, "dp_rank": dp_rank, "tp_rank": tp_rank, "hosted": opt.runtime.tp_engine is not None,
            "viewed": sorted(opt.runtime.param_views), "copied": dict(opt.runtime.copied_params), "dtensor": dtensor,
            "in_buffer": _in_param_buffers(model, opt.runtime), "masters": _master_layout(opt.runtime)}


def _tp_error_case(rank: int) -> dict:
    """dp2 x tp2, lb-asc: the element-wise optimizer raises on DP rank 1 at the second step, after
    that rank's earlier buckets were updated in place (their masters are parameter-buffer slots).
    Every rank lands every bucket's all-gather before raising, the buckets holding TP-split pieces
    included, so the DP replicas hold the same parameters; the next step works."""
    from torch.distributed.device_mesh import init_device_mesh

    from test_robust_errors import FlakyAdamW

    import canzona
    from canzona.models.tp import parallelize
    from canzona.runtime.buffer import local_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    _, model = _tiny()
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    parallelize(model, mesh["tp"])
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW,
                                       elementwise_optimizer=FlakyAdamW, elementwise_kwargs=EW_KW, bucket_numel=4096)
    rt = opt.runtime

    def feed(s: int) -> None:
        full = integer_grads(full_shapes, step=s, rank=dp_rank, seed=7)
        qk = {n for n in full if n.endswith(("q_norm.weight", "k_norm.weight"))}
        inject_grads(model, tp_local(full, opt.plan.specs, tp_rank, partial=qk))

    def local_params() -> dict[str, torch.Tensor]:
        return {n: local_tensor(p.detach()).clone() for n, p in model.named_parameters()}

    feed(0)
    opt.step()
    opt.zero_grad()
    feed(1)
    FlakyAdamW.fail = dp_rank == 1
    try:
        out = {"error": raised(opt.step)}
    finally:
        FlakyAdamW.fail = False
    out["after_error"] = local_params()
    opt.zero_grad()
    feed(2)
    opt.step()
    out["after_next"] = local_params()
    late = set(range(len(opt.plan.buckets))) - set(rt._early_buckets)
    out["late_aliased"] = any(pc.bucket in late for pc in rt.aliased_masters)
    out["late_elementwise"] = any(pc.bucket in late and pc.role == "elementwise" for pc in rt.pieces)
    return out


def _master_layout(rt) -> dict:
    """Which owned pieces' masters are parameter-buffer slots (roles), which are copies of their own
    (roles), whether every aliased master lies inside a parameter buffer, the bytes of separate
    masters and how many masters each all-gather still packs."""
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in rt.param_buffers.values()]
    aliased = [pc for pc in rt.pieces if pc in rt.aliased_masters]
    return {
        "aliased": sorted({pc.role for pc in aliased}),
        "separate": sorted({pc.role for pc in rt.pieces if pc not in rt.aliased_masters}),
        "inside": all(any(lo <= rt.masters[pc].data_ptr() < hi for lo, hi in spans) for pc in aliased),
        "master_bytes": rt.master_bytes(),
        "packed": sum(len(dst) for dst, _ in rt._pack.values()),
    }


def _in_param_buffers(model, rt) -> list[str]:
    """Parameters whose (local) storage lies inside one of the runtime's parameter buffers."""
    from canzona.runtime.buffer import local_tensor

    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in rt.param_buffers.values()]
    out = []
    for n, p in model.named_parameters():
        ptr = local_tensor(p.detach()).data_ptr()
        if any(lo <= ptr < hi for lo, hi in spans):
            out.append(n)
    return sorted(out)


@pytest.mark.parametrize("key", [k for k in TP_CASES if k[1] != "backward"])
def test_dp2_tp2_tiny_qwen3_injected_bitwise(runs, key: tuple[str, str]) -> None:
    from canzona.optim import Muon

    got = runs(4, "tp", key)
    _, model = _tiny()
    ref = ReferenceRunner(model, Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for s in range(STEPS):
        ref.step(mean_grads([integer_grads(shapes, step=s, rank=r, seed=7) for r in range(2)]))
    want = ref.params()
    for res in got:
        assert tensors_equal(want, res["params"]) == [], f"rank dp{res['dp_rank']} tp{res['tp_rank']} differs"
    assert any(res["hosted"] for res in got), "no rank ran the TP engine"


def _tp_ids(cfg, step: int, dp_rank: int) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(100 * step + dp_rank))


#: Bound for the real-backward DP2 x TP2 run against the single-process run. Bitwise equality is
#: impossible here: the TP forward/backward sums partial products in another order than one
#: full-width matmul (row-parallel o/down projections, the vocab-parallel embedding's all-reduce),
#: so gradients differ in their last bits before any optimizer runs. Each step moves a parameter
#: by about lr = 0.05 (Muon's orthogonalized update, AdamW's normalized one), so an ownership,
#: geometry or routing mistake shows up as an error of that order; rounding stays orders below.
#: Adam divides by sqrt(v) + eps: with the default eps a gradient element that is 1e-12 in one run
#: and -1e-12 in the other (a token absent from the batch, after the vocab-parallel all-reduce)
#: moves by +lr versus -lr. A larger eps makes the update Lipschitz in the gradient
#: (|d update| <= lr |d g| / eps), so the rounding-level gradient differences stay rounding-level.
#: Likewise Muon's Newton-Schulz runs in bf16 by default: a 1e-8 change of a gradient element can
#: flip a bf16 rounding and move the update by a bf16 ulp (~0.4% of it); in fp32 it cannot.
TP_BACKWARD_ATOL = 1e-4
TP_BACKWARD_EW_KW = {**EW_KW, "eps": 1e-3}
TP_BACKWARD_MATRIX_KW = {**MATRIX_KW, "ns_dtype": torch.float32}


def test_dp2_tp2_tiny_qwen3_real_backward(runs) -> None:
    from canzona.models.qwen3 import lm_loss
    from canzona.optim import Muon

    got = runs(4, "tp", ("lb-asc", "backward"))
    # DP replicas hold bitwise-identical parameters after every step (values, not deltas, return)
    for a, b in ((0, 2), (1, 3)):
        assert tensors_equal(got[a]["params"], got[b]["params"]) == []
    # TP ranks of one DP rank agree on the full tensors they assemble
    assert tensors_equal(got[0]["params"], got[1]["params"]) == []
    cfg, model = _tiny()
    ref = ReferenceRunner(model, Muon, TP_BACKWARD_MATRIX_KW, torch.optim.AdamW, TP_BACKWARD_EW_KW)
    for s in range(STEPS):
        per_rank = []
        for r in range(2):
            ref.model.zero_grad(set_to_none=True)
            ids = _tp_ids(cfg, s, r)
            lm_loss(ref.model(ids[:, :-1]), ids[:, 1:]).backward()
            per_rank.append({n: p.grad.clone() for n, p in ref.model.named_parameters()})
        ref.step(mean_grads(per_rank))
    want = ref.params()
    init = {n: p.detach() for n, p in model.named_parameters()}
    err = {n: float((want[n] - got[0]["params"][n]).abs().max()) for n in want}
    worst = max(err, key=err.__getitem__)
    assert err[worst] < TP_BACKWARD_ATOL, f"max |TP run - single process| = {err[worst]:.3g} ({worst})"
    moved = min(float((want[n] - init[n]).abs().max()) for n in want)
    assert moved > 100 * TP_BACKWARD_ATOL, "the bound must be far below the size of an update"


# ------------------------------------------------------------------------------ bf16 mixed precision

BF16_CASES = (("lb-asc", "muon"), ("zero1", "adamw"), ("sc", "muon"))


def _bf16_case(rank: int, strategy: str, optname: str) -> dict:
    import canzona

    model = ToyModel(dtype=torch.bfloat16)
    opt = canzona.DistributedOptimizer(
        model, optname, strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40
    )
    opt.comm_stats.reset()
    for s in range(STEPS):
        inject_grads(model, integer_grads(model, step=s, rank=rank, dtype=torch.bfloat16))
        opt.step()
        opt.zero_grad()
    masters = {pc.name: m.detach().clone() for pc, m in opt.runtime.masters.items() if pc.whole}
    return {"params": params_of(model), "masters": masters, "comm": opt.comm_stats.as_dict(), "N": opt.plan.buffer_numel}


@pytest.mark.parametrize("case", BF16_CASES)
def test_bf16_params_fp32_masters_bitwise(runs, case: tuple[str, str]) -> None:
    """bf16 model parameters, fp32 masters and optimizer state on the owners: the model holds the
    fp32 masters rounded to bf16, bitwise as a single-process fp32-master run does; gradients are
    reduced in fp32 and updated values return in bf16 (half the all-gather bytes of fp32)."""
    strategy, optname = case
    got = runs(2, "bf16", case)
    model = ToyModel(dtype=torch.bfloat16)
    ref = ReferenceRunner(
        model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1", master_dtype=torch.float32
    )
    for s in range(STEPS):
        ref.step(mean_grads([integer_grads(model, step=s, rank=r, dtype=torch.bfloat16) for r in range(2)]))
    want, masters = ref.params(), ref.master_values()
    for r in got:
        assert tensors_equal(want, r["params"]) == []
        assert all(t.dtype == torch.bfloat16 for t in r["params"].values())
        for n, m in r["masters"].items():
            assert m.dtype == torch.float32 and torch.equal(m, masters[n]), n
    if strategy != "sc":
        from canzona.runtime.phases import DP_ALL_GATHER, DP_REDUCE_SCATTER

        for r in got:
            assert r["comm"][DP_ALL_GATHER]["recv"] * 2 == r["comm"][DP_REDUCE_SCATTER]["sent"]


# ------------------------------------------------------------------------------ lazy parameter sync


class _Layered(torch.nn.Module):
    """A model whose forward calls child modules that own their parameters (the usual nn.Module
    style), so the lazy parameter sync finishes buckets module by module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(13, 6)
        self.first = torch.nn.Linear(6, 10)
        self.second = torch.nn.Linear(10, 6)
        self.last = torch.nn.Linear(6, 13, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.second(torch.tanh(self.first(x)))
        return self.last(x)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 13), ids[:, 1:].reshape(-1))


def _lazy_case(rank: int) -> dict:
    """``param_sync="lazy"``: step() leaves the all-gathers in flight; the forward's pre-hooks finish
    them bucket by bucket. Real backward, so the forward must see the updated parameters."""
    out = {"toy": _lazy_run(rank, ToyModel(seed=3))}
    torch.manual_seed(1)
    out["layered"] = _lazy_run(rank, _Layered(), eager_too=True)
    return out


def _lazy_run(rank: int, model: torch.nn.Module, eager_too: bool = False) -> dict:
    import copy

    import canzona

    twin = copy.deepcopy(model) if eager_too else None
    opt = canzona.DistributedOptimizer(
        model, "muon", strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=64, param_sync="lazy"
    )
    pending_after_step = []
    in_forward: list[int] = []
    if isinstance(model, _Layered):
        # runs after the runtime's own pre-hook on `first`: how many buckets are still in flight there
        model.first.register_forward_pre_hook(lambda *_: in_forward.append(len(opt.runtime._pending)))
    for s in range(STEPS):
        with opt.no_sync():
            model.loss(_batch(s, 2 * rank)).backward()
        model.loss(_batch(s, 2 * rank + 1)).backward()
        opt.step()
        pending_after_step.append(len(opt.runtime._pending))
        opt.zero_grad()
    opt.finish_param_sync()
    out = {"params": params_of(model), "pending": pending_after_step, "buckets": len(opt.plan.buckets), "in_forward": in_forward}
    if twin is not None:
        eager = canzona.DistributedOptimizer(
            twin, "muon", strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=64
        )
        for s in range(STEPS):
            with eager.no_sync():
                twin.loss(_batch(s, 2 * rank)).backward()
            twin.loss(_batch(s, 2 * rank + 1)).backward()
            eager.step()
            eager.zero_grad()
        out["eager"] = params_of(twin)
    return out


def test_lazy_param_sync_overlaps_forward_and_stays_bitwise(runs) -> None:
    got = runs(2, "lazy")
    eager = runs(2, "backward", "lb-asc")
    for r, e in zip(got, eager):
        # ToyModel reads its children's parameters without calling them: the root hook covers that
        assert r["toy"]["pending"] == [r["toy"]["buckets"]] * STEPS, "step() must leave every bucket's all-gather to the forward"
        assert tensors_equal(e, r["toy"]["params"]) == [], "lazy and eager parameter sync must give the same values"
        assert tensors_equal(r["layered"]["eager"], r["layered"]["params"]) == []
        assert r["layered"]["pending"] == [r["layered"]["buckets"]] * STEPS
        # when `first` runs, the buckets of the modules after it (second, last) are still in flight
        assert all(n > 0 for n in r["layered"]["in_forward"][2::2]), r["layered"]["in_forward"]


# ------------------------------------------------------------------------------ frozen parameters


def _frozen_case(rank: int) -> dict:
    import canzona

    model = ToyModel()
    model.embed.weight.requires_grad_(False)
    opt = canzona.DistributedOptimizer(model, "muon", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)
    for s in range(STEPS):
        grads = integer_grads(model, step=s, rank=rank)
        del grads["embed.weight"]
        inject_grads(model, grads)
        opt.step()
        opt.zero_grad()
    return {"params": params_of(model), "planned": [p.name for p in opt.plan.params]}


def test_frozen_parameters_are_left_alone(runs) -> None:
    from canzona.optim import Muon

    model = ToyModel()
    ref = ReferenceRunner(model, Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    for s in range(STEPS):
        per_rank = []
        for r in range(2):
            g = integer_grads(model, step=s, rank=r)
            del g["embed.weight"]
            per_rank.append(g)
        ref.step(mean_grads(per_rank))  # no gradient: the reference optimizers skip the embedding
    want = ref.params()
    assert torch.equal(want["embed.weight"], model.embed.weight.detach())
    for got in runs(2, "frozen"):
        assert "embed.weight" not in got["planned"]
        assert tensors_equal(want, got["params"]) == []


# ------------------------------------------------------------------------------ per-bucket step


#: the all-reduce path (every rank updates everything) and the reduce-scatter path (owners only)
PER_BUCKET_CASES: tuple[tuple[str, str, str, str], ...] = (("sc", "muon", "mean", "hook"), ("lb-asc", "muon", "mean", "hook"))
#: how long rank 1 holds its last bucket back waiting for rank 0's first update (a fixed bound, so a
#: runtime that waits for every bucket before updating fails this test after HOLD_S instead of hanging)
HOLD_S = 20.0


def _per_bucket_cases(rank: int) -> dict:
    import shutil
    import tempfile

    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="canzona-per-bucket-") if rank == 0 else None]
    dist.broadcast_object_list(box)
    try:
        return {case: attempt(_per_bucket_case, rank, case, box[0]) for case in PER_BUCKET_CASES}
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def _per_bucket_case(rank: int, case: tuple[str, str, str, str], signal_dir: str) -> dict:
    """Rank 1 holds its *last* bucket's gradient collective back until rank 0 has run its first
    local optimizer update of the step (signalled through a file). A step that waits for every
    bucket before updating cannot get there (rank 0 would wait for the held bucket): rank 1 then
    gives up after HOLD_S and reports it. Both ranks log, in order, every wait on a bucket's
    collective and every local optimizer step with the buckets whose masters hold a gradient."""
    import os
    import time

    import canzona
    from canzona.runtime.phases import DP_LOCAL_UPDATE, current_phase
    from canzona.phase_names import parse

    strategy, optname, reduce, _ = case
    model = ToyModel()
    # overlap_updates: the per-bucket pipeline without the pre-update agreement (which, by design,
    # waits for every bucket before any update; tests/test_robust_step.py covers that default)
    opt = canzona.DistributedOptimizer(
        model, _cls(optname), strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40, grad_reduce=reduce,
        overlap_updates=True,
    )
    rt = opt.runtime
    n = len(rt.plan.buckets)
    events: list[tuple] = []
    works: dict[int, object] = {}
    st = {"step": 0, "signalled": False}
    held: list[bool] = []
    last_in_flight: list[bool] = []

    def signal(s: int) -> str:
        return os.path.join(signal_dir, f"{strategy}-step{s}")

    class Logged:
        """The collective's work handle, logging when the step waits on it."""

        def __init__(self, i: int, work: object) -> None:
            self.i, self.work = i, work

        def wait(self, *a: object, **k: object) -> object:
            events.append(("wait", self.i))
            return self.work.wait(*a, **k)

    name = "reduce_scatter_v" if rt.reduce_scatter else "all_reduce"
    launch = getattr(rt.comm, name)

    def launching(*args: object, **kwargs: object) -> object:
        # launched inside its own bucket's launch phase
        index = parse(current_phase()).index
        assert index is not None and parse(current_phase()).stage == "launch"
        i = int(index.removeprefix("bucket"))
        if rank == 1 and i == n - 1:
            t0 = time.monotonic()
            while not os.path.exists(signal(st["step"])) and time.monotonic() - t0 < HOLD_S:
                time.sleep(0.002)
            held.append(os.path.exists(signal(st["step"])))
        res = launch(*args, **kwargs)
        work = res[1] if rt.reduce_scatter else res
        works[i] = work
        logged = Logged(i, work) if work is not None else None
        return (res[0], logged) if rt.reduce_scatter else logged

    setattr(rt.comm, name, launching)
    bucket_of = {id(m): pc.bucket for pc, m in rt.masters.items()}

    def pre_step(o: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        with_grad = sorted({bucket_of[id(p)] for g in o.param_groups for p in g["params"] if p.grad is not None})
        events.append(("step", tuple(with_grad)))
        if rank == 0 and not st["signalled"]:
            st["signalled"] = True
            last_in_flight.append(not works[n - 1].is_completed())
            open(signal(st["step"]), "w").close()

    for o in rt.optimizers():
        o.register_step_pre_hook(pre_step)
    opt.phase_times.reset()
    waits = []
    for s in range(STEPS):
        st["step"], st["signalled"] = s, False
        events.append(("begin", s))
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        waits.append(sorted(rt.bucket_wait_s))
        opt.zero_grad()
    owned = sorted({pc.bucket for pc in rt.pieces if pc.role != "tp"})
    return {
        "params": params_of(model),
        "events": events,
        "buckets": n,
        "owned": owned,
        "held": held,
        "last_in_flight": last_in_flight,
        "waits": waits,
        "local_update_calls": opt.phase_times.as_dict()[DP_LOCAL_UPDATE]["calls"],
    }


@pytest.mark.parametrize("case", PER_BUCKET_CASES, ids=lambda c: c[0])
def test_step_updates_each_bucket_as_its_collective_arrives(runs, case: tuple[str, str, str, str]) -> None:
    """The step waits bucket by bucket (in launch order) and updates a bucket's parameters right
    after its own collective: rank 0 runs a local update while rank 1 has not even launched the
    last bucket's collective, and the result stays bitwise equal to the single-process run."""
    got = runs(2, "per_bucket", case)
    want = _reference(case, 2)
    n = got[0]["buckets"]
    assert n >= 3, "the case needs several buckets"
    # rank 0 owns something before the last bucket, so its first update can precede that bucket
    assert got[0]["owned"] and got[0]["owned"][0] < n - 1, got[0]["owned"]
    for rank, res in enumerate(got):
        assert tensors_equal(want, res["params"]) == [], f"{case} rank {rank}: differs from the single-process run"
        assert res["waits"] == [list(range(n))] * STEPS  # a wait time recorded for every bucket
        assert res["local_update_calls"] == n * STEPS  # one canzona/dp/local_update/bucket<i> per bucket
        steps = _split_steps(res["events"])
        assert len(steps) == STEPS
        for evs in steps:
            assert [e[1] for e in evs if e[0] == "wait"] == list(range(n)), evs  # launch order, each once
            last_wait = None
            updated: list[int] = []
            for kind, what in evs:
                if kind == "wait":
                    last_wait = what
                else:
                    # exactly the bucket just waited for holds gradients: nothing stepped twice or early
                    assert what == (last_wait,), (kind, what, evs)
                    updated.append(last_wait)
            assert sorted(set(updated)) == res["owned"], (updated, res["owned"])
            # the first local update runs before the step waits on the last bucket
            first_step = next(k for k, e in enumerate(evs) if e[0] == "step")
            assert first_step < evs.index(("wait", n - 1)), evs
    # rank 1 got rank 0's signal every step: rank 0 updated while the last bucket was not launched
    assert got[1]["held"] == [True] * STEPS, "rank 0 did not update any bucket before the last bucket's collective"
    assert got[0]["last_in_flight"] == [True] * STEPS


def _split_steps(events: list[tuple]) -> list[list[tuple]]:
    out: list[list[tuple]] = []
    for e in events:
        if e[0] == "begin":
            out.append([])
        else:
            out[-1].append(e)
    return out


class _PerCallLR(torch.optim.SGD):
    """Decays its learning rate per step() call, in param_groups: per-parameter state, yet stepping
    it once per bucket would decay the rate once per bucket."""

    def step(self, closure=None):  # type: ignore[override]
        for group in self.param_groups:
            group["lr"] = group["lr"] * 0.5
        return super().step(closure)


def test_optimizers_with_per_call_state_are_refused() -> None:
    from canzona.distributed import check_per_parameter
    from canzona.optim import Muon

    check_per_parameter(Muon, MATRIX_KW)  # per bucket == all at once, bitwise
    check_per_parameter(torch.optim.AdamW, EW_KW)
    with pytest.raises(TypeError, match="stepped once per subset of its parameters"):
        check_per_parameter(_PerCallLR, {"lr": 0.1})


# ------------------------------------------------------------------------------ parameters and gradients as buffer views

#: "real": real backward with gradient accumulation, views on and off, plus the ways users break
#: views; "bf16": bf16 parameters (fp32 masters); "mixed": one bf16 parameter in an fp32 bucket
VIEW_CASES = ("real", "bf16", "mixed")


def _views_case(rank: int, key: str) -> dict:
    import warnings

    import canzona

    out: dict = {}
    for views in (True, False):
        if key == "real":
            model: torch.nn.Module = ToyModel(seed=3)
        elif key == "bf16":
            model = ToyModel(seed=3, dtype=torch.bfloat16)
        else:
            model = ToyModel(seed=3)
            model.mix.bias.data = model.mix.bias.data.to(torch.bfloat16)
        opt = canzona.DistributedOptimizer(
            model, "muon", strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=64,
            param_views=views, grad_views=views,
        )
        rt = opt.runtime
        named = dict(model.named_parameters())
        in_place, on_buffer, caught = [], [], []
        for s in range(STEPS):
            if views and key == "real" and s == 1:
                model.mix.weight.data = model.mix.weight.data.clone()  # breaks the view: rebound in step()
            if views and key == "real" and s == 2:
                model.to("cpu")  # no-ops keep the views
                model.float()
            with opt.no_sync():
                model.loss(_batch(s, 2 * rank)).backward()
            model.loss(_batch(s, 2 * rank + 1)).backward()
            in_place.append(sorted(rt.buffer.in_place))
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                opt.step()
            caught.append([str(x.message) for x in w if "parameter buffer" in str(x.message)])
            # every viewed parameter's storage is its bucket's parameter buffer, at its slot
            on_buffer.append(all(
                named[n].data_ptr() == v.data_ptr()
                and named[n].untyped_storage().data_ptr() == rt.param_buffers[rt.buffer.bucket_of[n]].untyped_storage().data_ptr()
                for n, v in rt.param_views.items()
            ))
            opt.zero_grad()
        res = {
            "params": params_of(model), "in_place": in_place, "on_buffer": on_buffer, "warnings": caught,
            "viewed": sorted(rt.param_views), "copied": dict(rt.copied_params), "rebinds": rt.rebinds,
            "names": sorted(named), "buffers": len(rt.param_buffers), "masters": _master_layout(rt),
        }
        if views and key == "real":
            # a cast behind the optimizer's back is refused by the runtime itself (not a silent copy)
            p = model.up.weight
            kept = p.data
            p.data = p.data.double()
            i = rt.buffer.bucket_of["up.weight"]
            try:
                rt.apply_params({i: rt.param_buffers[i]})
                res["cast"] = "accepted"
            except RuntimeError as exc:
                res["cast"] = str(exc)
            p.data = kept
            # load_state_dict(assign=True) replaces the Parameter objects: the next step refuses
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
            try:
                opt.step()
                res["assign"] = "accepted"
            except RuntimeError as exc:
                res["assign"] = str(exc)
        out[views] = res
    return out


def test_parameters_and_gradients_are_views_and_stay_bitwise(runs) -> None:
    """Default (views on): every parameter is a view of its bucket's parameter buffer, the all-gather
    writes into it, the first micro-batch's gradients land in the gradient buffer in place; the
    parameters equal the copy path (views off) and the single-process run, bit for bit."""
    got = runs(2, "views", "real")
    eager = runs(2, "backward", "lb-asc")  # checked against the single-process run by test_real_backward_dp2_bitwise
    for rank, r in enumerate(got):
        on, off = r[True], r[False]
        assert tensors_equal(eager[rank], on["params"]) == [] and tensors_equal(eager[rank], off["params"]) == []
        assert on["viewed"] == on["names"] and on["copied"] == {} and on["buffers"] > 1
        assert on["on_buffer"] == [True] * STEPS
        assert on["in_place"] == [on["names"]] * STEPS  # the no_sync micro-batch, every step
        assert off["viewed"] == [] and off["buffers"] == 0 and off["in_place"] == [[]] * STEPS
        # fp32 parameters and fp32 masters: every owned master is its parameter-buffer slot (no
        # separate copy, nothing packed for the all-gather); without views every master is a copy
        assert on["masters"]["aliased"] and on["masters"]["separate"] == [] and on["masters"]["inside"]
        assert on["masters"]["master_bytes"] == 0 and on["masters"]["packed"] == 0
        assert off["masters"]["aliased"] == [] and off["masters"]["master_bytes"] > 0 and off["masters"]["packed"] > 0


def test_a_replaced_parameter_storage_is_rebound_with_one_warning(runs) -> None:
    for r in runs(2, "views", "real"):
        on = r[True]
        assert on["rebinds"] == 1, "p.data = clone must be rebound once, model.to()/float() no-ops not at all"
        assert [len(w) for w in on["warnings"]] == [0, 1, 0] and "mix.weight" in on["warnings"][1][0]


def test_moved_cast_or_replaced_parameters_are_refused(runs) -> None:
    for r in runs(2, "views", "real"):
        on = r[True]
        assert "up.weight became torch.float64" in on["cast"] and "before building the DistributedOptimizer" in on["cast"]
        assert "parameters changed after the plan was made" in on["assign"]


@pytest.mark.parametrize("key", ["bf16", "mixed"])
def test_other_dtypes_keep_the_copies_they_need(runs, key: str) -> None:
    """bf16 parameters with fp32 masters: parameters are views of bf16 parameter buffers, gradients
    are copied (cast) into the fp32 buffer. A bf16 parameter in a bucket gathered in fp32 keeps the
    copy out, naming why. Bitwise equal to views off either way."""
    for r in runs(2, "views", key):
        on, off = r[True], r[False]
        assert tensors_equal(on["params"], off["params"]) == []
        assert on["in_place"] == ([[]] if key == "bf16" else [sorted(set(on["names"]) - {"mix.bias"})]) * STEPS
        if key == "bf16":
            assert on["viewed"] == on["names"] and on["copied"] == {}
            # bf16 parameter buffers: the fp32 masters stay copies of their own, packed for the gather
            assert on["masters"]["aliased"] == [] and on["masters"]["master_bytes"] > 0 and on["masters"]["packed"] > 0
        else:
            # buckets gathered in fp32 (the bf16 bias's included): masters are their slots
            assert on["masters"]["separate"] == [] and on["masters"]["master_bytes"] == 0
            assert list(on["copied"]) == ["mix.bias"] and "differs from its bucket's gather dtype" in on["copied"]["mix.bias"]
            assert on["viewed"] == sorted(set(on["names"]) - {"mix.bias"})


@pytest.mark.parametrize("key", [("lb-asc", "inject"), ("lb-asc-joint", "megatron"), ("sc", "inject")], ids="-".join)
def test_tp_parameters_are_views_dtensor_and_plain(runs, key: tuple[str, str]) -> None:
    """Every parameter becomes a view of its bucket's parameter buffer: DTensor parameters through
    their local tensor (the all-gather writes straight into ``to_local()``), plain shards
    (Megatron-style ``tp_dims``) and plain replicated parameters directly. ``sc`` returns no values
    by all-gather, but its parameters are views too: the masters that are slots are updated in
    the model itself, the TP engine's are copied in."""
    for res in runs(4, "tp", key):
        assert res["copied"] == {}
        assert res["viewed"] == sorted(res["params"])
        assert res["in_buffer"] == res["viewed"], "a viewed parameter's storage is not in the parameter buffer"
        # the TP engine keeps the masters of TP-split pieces; every other owned master is its slot
        assert "tp" not in res["masters"]["aliased"] and set(res["masters"]["separate"]) <= {"tp"}
        assert res["masters"]["inside"]
        if key[1] == "megatron":
            assert res["dtensor"] == []
        else:
            assert res["dtensor"], "the case needs DTensor parameters"


def test_tp_optimizer_error_lands_every_bucket_so_dp_replicas_agree(runs) -> None:
    res = runs(4, "tp_error", None)
    for r in res:
        assert r["error"] is not None and r["error"][0] == "RankFailure", r["error"]
        assert "rank(s); rank 2: ArithmeticError: flaky optimizer refused this step" in r["error"][1], r["error"]
    assert any(r["late_aliased"] for r in res), "no aliased master sits in a bucket gathered after the TP engine"
    for tp in range(2):  # global rank = 2 * dp + tp
        a, b = res[tp], res[2 + tp]
        for key in ("after_error", "after_next"):
            assert tensors_equal(a[key], b[key]) == [], f"tp rank {tp}: DP replicas differ ({key})"


@pytest.mark.parametrize("dtensor", [False, True], ids=["plain", "dtensor"])
def test_a_graph_saved_before_step_refuses_to_backward_through_viewed_weights(single_rank_group, dtensor: bool) -> None:
    """The all-gather writes into viewed parameters behind autograd's back; canzona bumps their
    version counters (for a DTensor, the wrapper's: autograd saves the wrapper), so a backward
    through a graph recorded before ``step()`` raises instead of using the new weights silently."""
    import canzona
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 4, bias=False))
    mesh = None
    if dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh)
    assert sorted(opt.runtime.param_views) == ["0.weight", "2.weight"] and not opt.runtime.copied_params
    x = torch.randn(3, 4, requires_grad=True)
    model(x).square().sum().backward()
    stale = model(x).square().sum()  # saves the weights for its backward
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


@pytest.mark.parametrize("overlap", [False, True], ids=["agreed", "overlap_updates"])
def test_optimizers_do_not_test_gradients_the_step_already_found_finite(single_rank_group, monkeypatch, overlap: bool) -> None:
    """The step's first status exchange tests every gradient an optimizer will read; inside the
    updates canzona's optimizers then skip their own finiteness test (a second read of every
    gradient). ``overlap_updates=True`` has no such exchange, so there they still test."""
    import canzona
    from canzona.optim import _common

    calls: list[int] = []
    real = _common._all_finite
    monkeypatch.setattr(_common, "_all_finite", lambda grads: calls.append(len(grads)) or real(grads))
    model = ToyModel()
    opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", bucket_numel=40, overlap_updates=overlap)
    calls.clear()  # construction probes the optimizer class with a step of its own
    inject_grads(model, integer_grads(model, step=0, rank=0))
    opt.step()
    assert bool(calls) == overlap, calls
    # a non-finite gradient is still refused, by the exchange or by the optimizer
    opt.zero_grad()
    grads = integer_grads(model, step=1, rank=0)
    grads["up.weight"][0, 0] = float("nan")
    inject_grads(model, grads)
    from canzona.runtime.agree import NonFiniteGradient, RankFailure

    with pytest.raises(RankFailure if overlap else NonFiniteGradient, match="up.weight" if not overlap else "is not finite"):
        opt.step()
