"""Muon's split step (momentum on the pieces, Newton-Schulz on the whole matrix, the update on the
pieces) against the single-device Muon, bitwise; and the element-wise kernels it relies on, at
every shard offset."""

from __future__ import annotations

import sys
import traceback

import pytest
import torch

from canzona.optim import Muon
from canzona.optim.muon import MATRIX_INPUT_DTYPES


def _ops(g: torch.Tensor, b: torch.Tensor, p: torch.Tensor, o: torch.Tensor) -> list[torch.Tensor]:
    """The split step's element-wise kernels, in its order."""
    new = b.lerp(g, 0.05)
    nest = g.lerp(new, 0.95)
    q = p.clone()
    q.mul_(1 - 0.02 * 0.1)
    q.add_(o, alpha=-0.02 * 1.7320508)
    return [new, nest, nest.to(torch.bfloat16), q]


@pytest.mark.parametrize("dtype", MATRIX_INPUT_DTYPES)
def test_element_wise_kernels_do_not_depend_on_the_piece_offset(dtype: torch.dtype) -> None:
    """Every element gets the same bits on a piece starting at any offset (vectorized body and
    scalar tail alike): the premise of computing the momentum on the shards."""
    torch.manual_seed(0)
    n = 700
    g, b, p = (torch.randn(n, dtype=dtype) * s for s in (1e-3, 1.0, 3.0))
    o = torch.randn(n, dtype=torch.bfloat16)
    whole = _ops(g, b, p, o)
    for start in range(65):
        for length in (1, 7, 15, 17, 31, 33, 63, 129, 300):
            sl = slice(start, start + length)
            part = _ops(g[sl].clone(), b[sl].clone(), p[sl].clone(), o[sl].clone())
            for w, x in zip(whole, part):
                assert torch.equal(w[sl], x), (start, length)


def test_the_split_step_is_offered_only_where_it_is_bitwise() -> None:
    assert Muon([torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16))]).matrix_input_dtype() is None
    assert Muon([torch.nn.Parameter(torch.zeros(4, 4))]).matrix_input_dtype() == torch.bfloat16
    assert Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype=None).matrix_input_dtype() == torch.float32
    # off the CPU (not measured there): not offered
    assert Muon([torch.nn.Parameter(torch.zeros(4, 4, device="meta"))]).matrix_input_dtype() is None
    # param groups computing in different dtypes: one exchange dtype is impossible
    two = Muon([{"params": [torch.nn.Parameter(torch.zeros(4, 4))]}, {"params": [torch.nn.Parameter(torch.zeros(4, 4))], "ns_dtype": None}])
    assert two.matrix_input_dtype() is None


def _row_pieces(rows: int, cuts: list[int]) -> list[slice]:
    edges = [0, *sorted(c for c in cuts if 0 < c < rows), rows]
    return [slice(a, b) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, None])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", MATRIX_INPUT_DTYPES)
def test_split_step_equals_step(ns_dtype: torch.dtype | None, nesterov: bool, dtype: torch.dtype) -> None:
    """Pieces cut at odd rows (offsets not multiples of the vector width), several steps, tall,
    wide and same-shape (batched) matrices: parameters and momentum equal ``step()``'s bitwise."""
    torch.manual_seed(1)
    shapes = [(37, 23), (19, 53), (24, 24), (24, 24), (5, 3)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, ns_dtype=ns_dtype, adjust_lr_fn="match_rms_adamw")
    ref = [torch.nn.Parameter(torch.randn(s, dtype=dtype)) for s in shapes]
    ref_opt = Muon(ref, **kw)
    cuts = [[3, 11, 12, 30], [1, 7], [5, 13], [24], [2]]
    slices = [_row_pieces(s[0], c) for s, c in zip(shapes, cuts)]
    pieces = [[torch.nn.Parameter(r.detach()[sl].clone()) for sl in sls] for r, sls in zip(ref, slices)]
    opt = Muon([q for ps in pieces for q in ps], **kw)
    work = ns_dtype or dtype
    assert opt.matrix_input_dtype() == work
    for _ in range(3):
        grads = [torch.randn(s, dtype=dtype) for s in shapes]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
        flat = [(k, q, sl) for k, (ps, sls) in enumerate(zip(pieces, slices)) for q, sl in zip(ps, sls)]
        moms, xs = opt.matrix_input([q for _, q, _ in flat], [grads[k][sl].clone() for k, _, sl in flat])
        inputs = [torch.empty(g.shape, dtype=work) for g in grads]
        for (k, _, sl), x in zip(flat, xs):
            inputs[k][sl] = x  # the exchange's cast to the compute dtype
        outs = opt.matrix_output([ps[0] for ps in pieces], inputs)
        opt.matrix_apply([q for _, q, _ in flat], moms, [outs[k][sl] for k, _, sl in flat], [outs[k].shape for k, _, _ in flat])
    for r, ps, sls in zip(ref, pieces, slices):
        for q, sl in zip(ps, sls):
            assert torch.equal(r.detach()[sl], q.detach())
            assert torch.equal(ref_opt.state[r]["momentum_buffer"][sl], opt.state[q]["momentum_buffer"])


@pytest.mark.parametrize("nesterov", [True, False])
def test_flat_momenta_equal_the_per_piece_path(monkeypatch: pytest.MonkeyPatch, nesterov: bool) -> None:
    """Many small pieces keep their momenta as views of one flat buffer (two, used in turn): every
    step bitwise what one kernel call per piece gives, through a fresh start, a step that applies
    only some pieces, state entries replaced by other tensors (a load) and a list whose pieces
    have a momentum only in part; the per-piece path is the same class with the flat path off."""
    from canzona.optim import muon as M

    torch.manual_seed(4)
    shapes = [(8, 16), (3, 5), (4, 4), (1, 7), (8, 16), (2, 9)] * 4
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    init = [torch.randn(s) for s in shapes]
    flat_ps = [torch.nn.Parameter(t.clone()) for t in init]
    ref_ps = [torch.nn.Parameter(t.clone()) for t in init]
    flat, ref = Muon(flat_ps, **kw), Muon(ref_ps, **kw)
    n = len(shapes)

    def step(opt, ps, k, grads, apply_only, off: bool) -> None:
        monkeypatch.setattr(M, "FLAT_MOMENTA_NUMEL", 0 if off else 1 << 20)
        live = [ps[i] for i in range(n)]
        moms, xs = opt.matrix_input(live, [g.clone() for g in grads])
        outs = [torch.randn(s, generator=torch.Generator().manual_seed(100 * k + i)) for i, s in enumerate(shapes)]
        keep = [i for i in range(n) if apply_only is None or i in apply_only]
        opt.matrix_apply([live[i] for i in keep], [moms[i] for i in keep], [outs[i] for i in keep], [shapes[i] for i in keep])

    for k in range(7):
        grads = [torch.randn(s) for s in shapes]
        if k == 4:  # a load: every state entry another tensor of the same values
            for opt, ps in ((flat, flat_ps), (ref, ref_ps)):
                for q in ps:
                    opt.state[q]["momentum_buffer"] = opt.state[q]["momentum_buffer"].clone()
        if k == 5:  # some pieces without a momentum at all: the per-piece path decides this step
            for opt, ps in ((flat, flat_ps), (ref, ref_ps)):
                for q in ps[:3]:
                    del opt.state[q]["momentum_buffer"]
        apply_only = set(range(0, n, 2)) if k == 2 else None  # a step that updates half the pieces
        step(flat, flat_ps, k, grads, apply_only, off=False)
        step(ref, ref_ps, k, grads, apply_only, off=True)
        for i, (a, b) in enumerate(zip(flat_ps, ref_ps)):
            assert torch.equal(a.detach(), b.detach()), (k, i)
            assert torch.equal(flat.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"]), (k, i)
        if k in (1, 3, 6):  # steady steps: the momenta are views of one buffer
            bufs = [flat.state[q]["momentum_buffer"] for q in flat_ps]
            assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1, k
            assert len({ref.state[q]["momentum_buffer"].untyped_storage().data_ptr() for q in ref_ps}) == n


def test_split_step_follows_changed_groups_and_lists() -> None:
    """The split step keeps its grouping per list of pieces; it must still follow what changes:
    an ``lr`` set in place (a scheduler), param groups replaced (torch's ``load_state_dict``), and
    lists that differ from step to step (a subset in another order, two groups interleaved, so
    that a cached index would point at the wrong piece). Every step bitwise ``step()``'s."""
    torch.manual_seed(3)
    shapes = [(12, 8), (8, 12), (12, 8), (6, 6)]
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    pieces = [torch.nn.Parameter(r.detach().clone()) for r in ref]  # one piece per matrix: the whole of it

    def groups(ps: list[torch.Tensor]) -> list[dict]:
        return [{"params": [ps[0], ps[2]], "lr": 0.02}, {"params": [ps[1], ps[3]], "lr": 0.05, "adjust_lr_fn": "match_rms_adamw"}]

    ref_opt, opt = Muon(groups(ref), momentum=0.9), Muon(groups(pieces), momentum=0.9)
    orders = [[0, 1, 2, 3], [3, 0, 1], [2, 1, 0, 3], [1, 3], [0, 1, 2, 3]]
    for step, order in enumerate(orders):
        if step == 2:  # a schedule writes lr in place
            for o in (ref_opt, opt):
                o.param_groups[0]["lr"] = 0.01
        if step == 3:  # new group dicts with other values, as torch's load_state_dict makes
            for o in (ref_opt, opt):
                sd = o.state_dict()
                sd["param_groups"][1]["lr"] = 0.07
                o.load_state_dict(sd)
        grads = {k: torch.randn(shapes[k]) for k in order}
        for k, r in enumerate(ref):
            r.grad = grads[k].clone() if k in grads else None
        ref_opt.step()
        live = [pieces[k] for k in order]
        moms, xs = opt.matrix_input(live, [grads[k].clone() for k in order])
        outs = opt.matrix_output(live, [x.to(torch.bfloat16) for x in xs])
        opt.matrix_apply(live, moms, outs, [shapes[k] for k in order])
        for r, q in zip(ref, pieces):
            assert torch.equal(r.detach(), q.detach()), f"step {step}"


def test_split_step_of_a_transposed_group_equals_step() -> None:
    torch.manual_seed(2)
    ref = torch.nn.Parameter(torch.randn(29, 17))
    ref_opt = Muon([{"params": [ref], "transposed": True}], lr=0.03)
    sls = _row_pieces(29, [9, 10])
    pieces = [torch.nn.Parameter(ref.detach()[sl].clone()) for sl in sls]
    opt = Muon([{"params": pieces, "transposed": True}], lr=0.03)
    for _ in range(2):
        g = torch.randn(29, 17)
        ref.grad = g.clone()
        ref_opt.step()
        full = torch.empty(29, 17, dtype=torch.bfloat16)
        moms, xs = opt.matrix_input(pieces, [g[sl].clone() for sl in sls])
        for sl, x in zip(sls, xs):
            full[sl] = x
        (o,) = opt.matrix_output([pieces[0]], [full])
        opt.matrix_apply(pieces, moms, [o[sl] for sl in sls], [o.shape] * len(sls))
    for q, sl in zip(pieces, sls):
        assert torch.equal(ref.detach()[sl], q.detach())


# ============================================================================ FSDP2, spawned
# One spawn per world size serves every case (module-scoped results); each case is its own test.

# (label, matrix optimizer, its kwargs, strategy, parameter dtype, exchange)
FSDP_CASES: list[tuple[str, str, dict, str, str, str]] = [
    ("muon/lb-asc", "muon", {"lr": 0.02}, "lb-asc", "float32", "ns-input"),
    ("muon/asc/fp32-ns", "muon", {"lr": 0.02, "ns_dtype": None}, "asc", "float32", "ns-input"),
    ("muon/sc/no-nesterov", "muon", {"lr": 0.02, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"}, "sc", "float32", "ns-input"),
    ("muon/lb-asc/bf16-params", "muon", {"lr": 0.02}, "lb-asc", "bfloat16", "ns-input"),
    ("shampoo/lb-asc/auto", "shampoo", {"lr": 0.01}, "lb-asc", "float32", "auto"),
]
FSDP_MESH_KEYS = {2: ("dp_shard2",), 4: ("dp_shard4", "dp_shard2_tp2", "dp_replicate2_dp_shard2")}
#: meshes that run only the first case (HSDP: the shard-group engine is the same, replicas agree)
FIRST_CASE_ONLY = ("dp_replicate2_dp_shard2",)
EW = {"lr": 0.01, "weight_decay": 0.1}
NS_STEPS = 3


def _fsdp_case(mesh, opt_name: str, kw: dict, strategy: str, dtype: torch.dtype, exchange: str) -> dict:
    import torch.distributed as dist

    import canzona
    from canzona.distributed import resolve_optimizer
    from validation.fsdp_harness import _dp, _full_params, build_fsdp_toy, compare_with_reference, fsdp_local_grads, fsdp_reference

    model = build_fsdp_toy(mesh, dtype)
    opt = canzona.DistributedOptimizer(model, opt_name, strategy=strategy, mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=EW,
                                       exchange=exchange)
    for s in range(NS_STEPS):
        model(fsdp_local_grads(mesh, s)).backward()
        opt.step()
        opt.zero_grad()
    # the steps' bytes (the consolidated document below is counted too)
    out = {"split": opt.runtime.engine.split, "sent": opt.comm_stats.total_sent(), "state_bytes": opt.state_bytes(), "mismatches": None}
    params, doc = _full_params(model), opt.consolidated_state_dict()
    if dist.get_rank() == 0:
        ref = fsdp_reference(resolve_optimizer(opt_name), kw, EW, dtype=dtype, dp=_dp(mesh)[1], steps=NS_STEPS)
        out["mismatches"] = compare_with_reference(params, doc, ref)
    return out


def _resume_case(rank: int, mesh) -> dict:
    """Save after 2 split steps, load into a fresh model and optimizer (``gradients`` and
    ``ns-input``), step once more: both equal 3 uninterrupted steps."""
    import os
    import tempfile

    import torch.distributed as dist

    import canzona
    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint
    from validation.fsdp_harness import _full_params, build_fsdp_toy, fsdp_local_grads

    def make(exchange: str):
        m = build_fsdp_toy(mesh, torch.float32)
        return m, canzona.DistributedOptimizer(m, "muon", mesh=mesh, optimizer_kwargs={"lr": 0.02}, elementwise_kwargs=EW, exchange=exchange)

    def run(m, o, steps) -> None:
        for s in steps:
            m(fsdp_local_grads(mesh, s)).backward()
            o.step()
            o.zero_grad()

    model, opt = make("ns-input")
    run(model, opt, range(2))
    path = [os.path.join(tempfile.mkdtemp(prefix="canzona-ns-"), "opt.pt") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    save_checkpoint(opt, path[0])
    run(model, opt, range(2, 3))
    out = {"straight": _full_params(model)}
    for exchange in ("ns-input", "gradients"):
        fresh, opt2 = make(exchange)
        load_checkpoint(opt2, path[0])
        run(fresh, opt2, range(2, 3))
        out[exchange] = _full_params(fresh)
    dist.barrier()
    if rank == 0:
        os.unlink(path[0])
        os.rmdir(os.path.dirname(path[0]))
    return out


def _alias_case(mesh) -> dict:
    """fp32 parameters: the split step's piece masters are the model's own shards (no copy back,
    no second fp32 copy); a shard FSDP2 re-allocates (here re-allocated after the
    first step, as ``model.to`` does) is written by copy from then on, and the three steps still equal the
    single-device optimizer bitwise; bf16 parameters keep separate fp32 masters. A DCP-form load
    whose ``.model`` entry disagrees with ``.master`` leaves the master's value in an aliased
    piece, whatever order DCP fills the two targets in."""
    import torch.distributed as dist

    import canzona
    from canzona.distributed import resolve_optimizer
    from canzona.runtime.shard import local_block
    from canzona.runtime.stateful import _pieces
    from validation.fsdp_harness import _dp, _full_params, build_fsdp_toy, compare_with_reference, fsdp_local_grads, fsdp_reference

    def aliased(model, opt) -> tuple[int, int]:
        rt = opt.runtime
        named = dict(model.named_parameters())
        pairs = [(m, local_block(named[rt._task_of[t]].detach())) for t, m in rt.engine.pieces.items() if m.numel()]
        return sum(m.untyped_storage().data_ptr() == loc.untyped_storage().data_ptr() for m, loc in pairs), len(pairs)

    kw = {"lr": 0.02}
    out: dict[str, object] = {}
    model = build_fsdp_toy(mesh, torch.float32)
    opt = canzona.DistributedOptimizer(model, "muon", mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=EW, exchange="ns-input")
    out["fp32"] = aliased(model, opt)
    for s in range(NS_STEPS):
        model(fsdp_local_grads(mesh, s)).backward()
        opt.step()
        opt.zero_grad()
        if s == 0:
            # what model.to(...) does under FSDP2: every shard in new storage (FSDPModule._apply
            # re-points the sharded parameters); the aliases are stale from here on
            model._apply(lambda t: t.clone())
            out["after_swap"] = aliased(model, opt)
    params, doc = _full_params(model), opt.consolidated_state_dict()
    out["mismatches"] = None
    if dist.get_rank() == 0:
        ref = fsdp_reference(resolve_optimizer("muon"), kw, EW, dtype=torch.float32, dp=_dp(mesh)[1], steps=NS_STEPS)
        out["mismatches"] = compare_with_reference(params, doc, ref)
    bf16 = build_fsdp_toy(mesh, torch.bfloat16)
    out["bf16"] = aliased(bf16, canzona.DistributedOptimizer(bf16, "muon", mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=EW,
                                                              exchange="ns-input"))
    # a DCP-form load: fill the targets as dcp.load would (masters, then the model entries)
    model = build_fsdp_toy(mesh, torch.float32)
    opt = canzona.DistributedOptimizer(model, "muon", mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=EW, exchange="ns-input")
    model(fsdp_local_grads(mesh, 0)).backward()
    opt.step()
    opt.zero_grad()
    sd = opt.state_dict()
    matrices = [n for n in opt.runtime.engine.pieces]
    with torch.no_grad():
        for suffix, value in ((".master", 1.0), (".model", 2.0)):
            for n in matrices:
                for _, t in _pieces(sd[n + suffix]):
                    t.fill_(value)
    opt.load_state_dict(sd)
    named = dict(model.named_parameters())
    out["loaded"] = sorted({float(v) for n in matrices if (loc := local_block(named[n].detach())).numel() for v in loc.unique()})
    return out


def _refusals(mesh) -> dict:
    import canzona
    from validation.fsdp_harness import build_fsdp_toy

    out = {}
    for key, kw in {"shampoo": {"optimizer": "shampoo", "exchange": "ns-input"}, "bad": {"optimizer": "muon", "exchange": "values"}}.items():
        try:
            canzona.DistributedOptimizer(build_fsdp_toy(mesh), mesh=mesh, **kw)
            out[key] = None
        except (ValueError, TypeError) as exc:
            out[key] = str(exc)
    opt = canzona.DistributedOptimizer(build_fsdp_toy(mesh), "muon", mesh=mesh, exchange="ns-input")
    try:
        opt.register_update_hook(lambda *a: None)
        out["hook"] = None
    except ValueError as exc:
        out["hook"] = str(exc)
    return out


# ============================================================================ TP engine (ZeRO-1's TP micro-groups)

TP_CASES = [("sc", "sync"), ("asc", "round-robin"), ("lb-asc", "lpt")]
TP_STEPS = 3


def _tp_case(strategy: str, schedule: str, exchange: str) -> dict:
    """The TP engine over the whole world (dp 1) on qwen3-tiny's TP-split matrices, against one
    single-device Muon over the full matrices: shards and momentum bitwise."""
    import zlib

    from canzona.config import load_model_config
    from canzona.models import Qwen3
    from canzona.plan import PlanInputs, make_plan
    from canzona.runtime.comm import Comm, CommStats
    from canzona.runtime.tp import TPEngine
    from canzona.specs import specs_from_config

    cfg = load_model_config("qwen3-tiny")
    tp = 2
    plan = make_plan(specs_from_config(cfg, tp=tp, layout="hf"), PlanInputs(
        model=cfg.name, layout="hf", dp=1, tp=tp, optimizer="muon", strategy=strategy, tp_schedule=schedule,
        bucket_numel=20_000, cmax_bytes=2**16))
    comm = Comm(None, CommStats())
    full = {n: p.detach().clone() for n, p in Qwen3(cfg, seed=5).named_parameters()}
    mine = [p for p in plan.params if p.spec.kind == "matrix" and p.spec.tp_split]
    local = {p.name: full[p.name].chunk(tp, dim=p.spec.tp_dim)[comm.rank].clone() for p in mine}
    kw = {"lr": 0.02, "weight_decay": 0.01}
    engine = TPEngine(plan, dp_rank=0, comm=comm, optimizer_factory=lambda ps: Muon(ps, **kw), local_masters=local, exchange=exchange)
    comm.stats.reset()
    ref = {p.name: torch.nn.Parameter(full[p.name].clone()) for p in mine}
    ref_opt = Muon(list(ref.values()), **kw)
    for step in range(TP_STEPS):
        grads = {}
        for p in mine:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{p.name}/{step}".encode()))
            g = torch.randn(p.spec.shape, generator=gen)
            ref[p.name].grad = g
            grads[p.name] = g.chunk(tp, dim=p.spec.tp_dim)[comm.rank].clone()
        engine.step(grads)
        ref_opt.step()
    bad = []
    for p in mine:
        cut = lambda t: t.chunk(tp, dim=p.spec.tp_dim)[comm.rank]  # noqa: E731
        if not torch.equal(local[p.name], cut(ref[p.name].detach())):
            bad.append(f"param:{p.name}")
        st = engine.state_dict().get(p.name) if engine.split else None
        if st is not None and not torch.equal(st["momentum_buffer"], cut(ref_opt.state[ref[p.name]]["momentum_buffer"])):
            bad.append(f"state:{p.name}")
    return {"split": engine.split, "mismatches": bad, "sent": comm.stats.total_sent(), "state_bytes": engine.state_bytes(),
            "tasks": len(mine)}


def _zero1_tp_case(rank: int) -> dict:
    """The front end on the ZeRO-1 path at dp 1 x tp 2 (the TP engine's split step inside
    ``DistributedOptimizer``): model values bitwise the single-device run's; a checkpoint written
    after 2 steps loads under ``gradients`` and the third step agrees; update hooks refused."""
    import os
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from canzona.distributed import DistributedOptimizer
    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint
    from validation.checks import ELEMENTWISE_KWARGS, OPTIMIZER_KWARGS
    from validation.harness import ReferenceRunner, inject_grads, integer_grads, params_of, tensors_equal, tp_cut
    from validation.models import build_model

    tp, tp_rank = 2, rank
    mesh = init_device_mesh("cpu", (1, tp), mesh_dim_names=("dp", "tp"))
    kw = OPTIMIZER_KWARGS["muon"]

    def make(exchange: str):
        model, full, tp_dims, bucket_numel = build_model("awkward", torch.float32, tp_rank=tp_rank, tp=tp)
        opt = DistributedOptimizer(model, Muon, strategy="lb-asc", mesh=mesh, optimizer_kwargs=kw, elementwise_kwargs=ELEMENTWISE_KWARGS,
                                   tp_dims=tp_dims or None, bucket_numel=bucket_numel, roles=getattr(model, "canzona_roles", None),
                                   exchange=exchange)
        return model, full, tp_dims, opt

    model, full, tp_dims, opt = make("ns-input")
    shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}

    def run(m, o, steps) -> None:
        for step in steps:
            inject_grads(m, tp_cut(integer_grads(shapes, step=step, rank=0, exponent=-6), tp_dims, tp_rank, tp))
            o.step()
            o.zero_grad()

    run(model, opt, range(1, 3))
    path = [os.path.join(tempfile.mkdtemp(prefix="canzona-ns-tp-"), "opt.pt") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    save_checkpoint(opt, path[0])
    run(model, opt, range(3, 4))
    runner = ReferenceRunner(full, Muon, kw, torch.optim.AdamW, ELEMENTWISE_KWARGS)
    for step in range(1, 4):
        runner.step(integer_grads(shapes, step=step, rank=0, exponent=-6))
    out = {"split": opt.runtime.tp_engine is not None and opt.runtime.tp_engine.split,
           "mismatches": tensors_equal(params_of(model), tp_cut(runner.params(), tp_dims, tp_rank, tp))}
    model2, _, _, opt2 = make("gradients")
    load_checkpoint(opt2, path[0])
    run(model2, opt2, range(3, 4))
    out["resumed"] = tensors_equal(params_of(model2), params_of(model))
    try:
        opt.register_update_hook(lambda *a: None)
        out["hook"] = None
    except ValueError as exc:
        out["hook"] = str(exc)
    for o in (opt, opt2):
        o.runtime.detach()
    dist.barrier()
    if rank == 0:
        os.unlink(path[0])
        os.rmdir(os.path.dirname(path[0]))
    return out


def _ns_worker(rank: int, world: int, keys: tuple[str, ...]) -> bytes:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from validation.fsdp_harness import FSDP_MESHES
    from validation.harness import pack

    out: dict[str, object] = {}
    if world == 2:
        for strategy, schedule in TP_CASES:
            for exchange in ("ns-input", "gradients"):
                try:
                    out[f"tp/{strategy}/{exchange}"] = _tp_case(strategy, schedule, exchange)
                except Exception as exc:  # noqa: BLE001 - one case fails on its own
                    out[f"tp/{strategy}/{exchange}"] = {"error": f"{type(exc).__name__}: {exc}"}
                dist.barrier()
        try:
            out["zero1-tp"] = _zero1_tp_case(rank)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc(file=sys.stderr)
            out["zero1-tp"] = {"error": f"{type(exc).__name__}: {exc}"}
        dist.barrier()
    for key in keys:
        shape, names = FSDP_MESHES[key]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for label, opt_name, kw, strategy, dtype, exchange in FSDP_CASES[:1] if key in FIRST_CASE_ONLY else FSDP_CASES:
            for mode in (exchange, "gradients") if label == "muon/lb-asc" else (exchange,):
                try:
                    out[f"{key}/{label}/{mode}"] = _fsdp_case(mesh, opt_name, kw, strategy, getattr(torch, dtype), mode)
                except Exception as exc:  # noqa: BLE001 - one case fails on its own
                    traceback.print_exc(file=sys.stderr)
                    out[f"{key}/{label}/{mode}"] = {"error": f"{type(exc).__name__}: {exc}"}
                dist.barrier()
        if key in ("dp_shard2", "dp_shard2_tp2"):
            try:
                out[f"{key}/resume"] = _resume_case(rank, mesh)
            except Exception as exc:  # noqa: BLE001
                out[f"{key}/resume"] = {"error": f"{type(exc).__name__}: {exc}"}
            out[f"{key}/refusals"] = _refusals(mesh)
        if key == "dp_shard2":
            try:
                out["alias"] = _alias_case(mesh)
            except Exception as exc:  # noqa: BLE001 - one case fails on its own
                traceback.print_exc(file=sys.stderr)
                out["alias"] = {"error": f"{type(exc).__name__}: {exc}"}
            dist.barrier()
    return pack(out)


_results: dict[int, list[dict] | Exception] = {}


def _fsdp_results(world: int) -> list[dict]:
    """The spawn of ``world`` ranks, run once for every test that reads it (a failed spawn too)."""
    from canzona.runtime.launch import run_workers
    from validation.harness import unpack

    if world not in _results:
        try:
            _results[world] = [unpack(b) for b in run_workers(_ns_worker, world, FSDP_MESH_KEYS[world], timeout_s=400)]
        except Exception as exc:  # noqa: BLE001 - reported by every test that needs it
            _results[world] = exc
    got = _results[world]
    if isinstance(got, Exception):
        raise got
    return got


_IDS = [(w, k, c[0]) for w, keys in FSDP_MESH_KEYS.items() for k in keys for c in (FSDP_CASES[:1] if k in FIRST_CASE_ONLY else FSDP_CASES)]


@pytest.mark.slow
@pytest.mark.parametrize(("world", "key", "label"), _IDS, ids=[f"{k}-{c}" for _, k, c in _IDS])
def test_fsdp2_split_step_matches_single_device_bitwise(world: int, key: str, label: str) -> None:
    """Parameters, masters and momentum equal the single-device optimizer's bitwise under
    ``ns-input``; Muon takes the split step (fewer bytes than ``gradients``, the same state
    sharded), Shampoo keeps the generic path under ``auto``."""
    res = _fsdp_results(world)
    case = next(c for c in FSDP_CASES if c[0] == label)
    split = res[0][f"{key}/{label}/{case[5]}"]
    assert "error" not in split, split.get("error")
    assert split["mismatches"] == []
    muon = case[1] == "muon"
    assert all(r[f"{key}/{label}/{case[5]}"]["split"] is muon for r in res)
    if label == "muon/lb-asc":  # the same momentum in all, sharded instead of hosted; fewer bytes
        assert res[0][f"{key}/{label}/gradients"]["mismatches"] == []
        assert sum(r[f"{key}/{label}/{case[5]}"]["sent"] for r in res) < sum(r[f"{key}/{label}/gradients"]["sent"] for r in res)
        if key in ("dp_shard2", "dp_shard4"):  # (pieces replicated over tp or dp_replicate hold their momentum twice)
            assert sum(r[f"{key}/{label}/{case[5]}"]["state_bytes"] for r in res) == sum(r[f"{key}/{label}/gradients"]["state_bytes"] for r in res)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "key"), [(2, "dp_shard2"), (4, "dp_shard2_tp2")])
def test_fsdp2_split_step_checkpoint_resumes_bitwise_under_either_exchange(world: int, key: str) -> None:
    got = _fsdp_results(world)[0][f"{key}/resume"]
    assert "error" not in got, got.get("error")
    for exchange in ("ns-input", "gradients"):
        bad = [n for n in got["straight"] if not torch.equal(got["straight"][n], got[exchange][n])]
        assert bad == [], (exchange, bad)


@pytest.mark.slow
def test_fsdp2_split_step_masters_alias_fp32_shards_and_survive_a_storage_swap() -> None:
    res = _fsdp_results(2)
    for r in res:
        got = r["alias"]
        assert "error" not in got, got.get("error")
        aliased, pieces = got["fp32"]
        assert pieces > 0 and aliased == pieces  # every non-empty piece master is the model's shard
        assert got["after_swap"] == (0, pieces)  # the swap left them stale: the step copies
        assert got["bf16"][0] == 0  # another dtype: separate fp32 masters
        assert got["loaded"] == [1.0]  # the master entry's value, never the model entry's
    assert res[0]["alias"]["mismatches"] == []


@pytest.mark.slow
def test_fsdp2_split_step_refusals_are_one_clear_line() -> None:
    got = _fsdp_results(2)[0]["dp_shard2/refusals"]
    assert "exchange='ns-input' needs a matrix optimizer" in got["shampoo"]
    assert "exchange must be one of" in got["bad"]
    assert "exchange='gradients'" in got["hook"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [c[0] for c in TP_CASES])
def test_tp_split_step_matches_single_device_bitwise(strategy: str) -> None:
    """The TP engine's split step: shards and sharded momentum equal the single-device Muon's;
    fewer bytes than the gradients exchange, the same momentum in total."""
    res = _fsdp_results(2)
    split, plain = ([r[f"tp/{strategy}/{m}"] for r in res] for m in ("ns-input", "gradients"))
    for r in split + plain:
        assert "error" not in r, r.get("error")
        assert r["tasks"] > 0 and r["mismatches"] == []
    assert all(r["split"] for r in split) and not any(r["split"] for r in plain)
    assert sum(r["sent"] for r in split) < sum(r["sent"] for r in plain)
    if strategy != "sc":  # (under sc every TP rank holds the whole state of everything)
        assert sum(r["state_bytes"] for r in split) == sum(r["state_bytes"] for r in plain)


@pytest.mark.slow
def test_zero1_tp_front_end_split_step_is_bitwise_and_checkpoints_across_exchanges() -> None:
    for r in _fsdp_results(2):
        got = r["zero1-tp"]
        assert "error" not in got, got.get("error")
        assert got["split"] and got["mismatches"] == [] and got["resumed"] == []
        assert "exchange='gradients'" in got["hook"]
