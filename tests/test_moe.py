"""Roles the user controls and experts as matrix tasks.

Unit part: the default role rule (embeddings by module type and tied weights, 1 x N gates, GPT-2's
Conv1D on its (out, in) shape, 3-D expert stacks, conv weights refused with the opt-in named),
``roles=`` overrides, costs of expert stacks, plan validation of cuts between experts, Muon's
transposed groups. Distributed part (one world-2 spawn): the ZeRO-1 path under every strategy,
bitwise against the single-device optimizer applied to each matrix task alone (every expert on its
own, Conv1D on its transpose, the opted-in conv weight reshaped), including a step where one expert
got no tokens (a zero gradient), every expert's momentum, and a consolidated checkpoint round trip;
and canzona's tiny Qwen3-MoE trained on real batches, each rank checked in its own process against
the single-device per-task reference stepped on the mean gradient of both ranks' batches (Muon's
default steps each expert alone: no batched chain runs).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from canzona.runtime.launch import run_workers
from canzona.specs import ParamSpec, RoleError, module_roles, specs_from_module
from validation.harness import integer_grads, mean_grads, pack, unpack
from moe_models import TaskReference, ToyMoE

MKW = {"lr": 0.05, "adjust_lr_fn": "spectral"}
EKW = {"lr": 0.01, "weight_decay": 0.1}
ROLES = {"conv.weight": "matrix"}
STRATEGIES = ("lb-asc", "sc", "layerwise", "asc", "lb-asc-joint", "zero1")
STEPS = 3
#: the expert of ``experts.gate_up_proj`` / ``experts.down_proj`` that routes no token at step 1
IDLE_EXPERT = 2


# ------------------------------------------------------------------------------ the role rule
def test_default_rule_by_module_type_and_shape() -> None:
    got = module_roles(ToyMoE())
    assert got["wte.weight"] == ("elementwise", False)  # nn.Embedding, tied to the head
    assert "head.weight" not in got  # tied: one parameter
    assert got["wpe.weight"] == ("elementwise", False)
    assert got["c_attn.weight"] == ("matrix", True)  # Conv1D: stored (in, out)
    assert got["shared_expert_gate.weight"] == ("elementwise", False)  # 1 x N
    assert got["gate.weight"] == ("elementwise", False)  # router
    assert got["experts.gate_up_proj"] == ("experts", False)
    assert got["experts.down_proj"] == ("experts", False)
    assert got["proj.weight"] == ("matrix", False)


def test_embedding_found_by_type_not_name() -> None:
    m = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 8))  # names say nothing
    assert module_roles(m) == {"0.weight": ("elementwise", False), "1.weight": ("matrix", False), "1.bias": ("elementwise", False)}


def test_tied_to_an_embedding_registered_first_as_a_head() -> None:
    class HeadFirst(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = torch.nn.Linear(8, 16, bias=False)
            self.emb = torch.nn.Embedding(16, 8)
            self.out.weight = self.emb.weight

    assert module_roles(HeadFirst()) == {"out.weight": ("elementwise", False)}


def test_conv_weight_refused_by_default_with_the_opt_in() -> None:
    with pytest.raises(RoleError, match=r"conv\.weight.*roles=\{'conv\.weight': 'matrix'\}.*\(4, 27\)"):
        module_roles(ToyMoE(conv=True))
    assert module_roles(ToyMoE(conv=True), ROLES)["conv.weight"] == ("matrix", False)
    spec = {s.name: s for s in specs_from_module(ToyMoE(conv=True), roles=ROLES)}["conv.weight"]
    assert spec.task_shape == (4, 27) and spec.n_tasks == 1


def test_three_d_outside_experts_refused() -> None:
    m = torch.nn.Module()
    m.stack = torch.nn.Parameter(torch.zeros(2, 3, 4))
    with pytest.raises(RoleError, match="stack: a 3-D parameter"):
        module_roles(m)
    assert module_roles(m, {"stack": "experts"}) == {"stack": ("experts", False)}
    assert module_roles(m, lambda n, p: "elementwise") == {"stack": ("elementwise", False)}


def test_roles_mapping_first_match_wins_and_callable_falls_back() -> None:
    m = ToyMoE()
    got = module_roles(m, {"proj.*": "elementwise", "w*.weight": "matrix", "c_attn.weight": "matrix"})
    assert got["proj.weight"] == ("elementwise", False)
    assert got["wte.weight"] == ("matrix", False)  # the user said so
    assert got["c_attn.weight"] == ("matrix", True)  # still stored transposed
    got = module_roles(m, lambda n, p: "elementwise" if n.startswith("experts.down") else None)
    assert got["experts.down_proj"] == ("elementwise", False) and got["experts.gate_up_proj"] == ("experts", False)


@pytest.mark.parametrize(
    "roles,match",
    [({"proj.weight": "muon"}, "a role is one of"), ({"proj.weight": "experts"}, "needs a 3-D"), ({"proj.bias": "matrix"}, "at least 2")],
)
def test_bad_roles_one_line(roles: dict, match: str) -> None:
    with pytest.raises(RoleError, match=match):
        module_roles(ToyMoE(), roles)


def test_expert_costs_are_e_tasks() -> None:
    from canzona.cost import cost_arrays, matrix_flops, param_flops, param_memory, state_bytes

    s = ParamSpec("experts.w", (4, 12, 8), "experts")
    assert param_flops(s, "muon") == 4 * matrix_flops("muon", (12, 8))
    assert param_memory(s, "shampoo") == 4 * state_bytes("shampoo", (12, 8))
    t = ParamSpec("c.weight", (8, 24), "matrix", transposed=True)
    assert param_flops(t, "muon") == matrix_flops("muon", (24, 8))
    f, mem = cost_arrays([s, t], "shampoo")
    assert f.tolist() == [param_flops(s, "shampoo"), param_flops(t, "shampoo")]
    assert mem.tolist() == [param_memory(s, "shampoo"), param_memory(t, "shampoo")]


def _plan(strategy: str = "lb-asc"):
    from canzona.plan import make_plan
    from canzona.plan.plan import PlanInputs

    specs = specs_from_module(ToyMoE(conv=True), roles=ROLES)
    return make_plan(specs, PlanInputs(model="toy", layout="module", dp=2, tp=1, optimizer="muon", strategy=strategy,
                                       tp_schedule="sync", bucket_numel=10_000))


def test_plan_accepts_cuts_between_experts_only() -> None:
    from canzona.plan.errors import PlanError
    from canzona.plan.plan import Plan

    plan = _plan()
    pp = plan.param("experts.gate_up_proj")
    assert pp.role == "experts"
    unit = 12 * 8
    b = plan.buckets[pp.bucket]
    mid = pp.offset + 2 * unit

    def cut_at(point: int) -> Plan:
        cuts = (0, point, b.numel)
        params = []
        for q in plan.params:
            if q.bucket != pp.bucket:
                params.append(q)
                continue
            start, end = q.offset, q.offset + q.numel
            if end <= point:
                params.append(dataclasses.replace(q, dp_owner=0, dp_ranges=()))
            elif start >= point:
                params.append(dataclasses.replace(q, dp_owner=1, dp_ranges=()))
            else:
                params.append(dataclasses.replace(q, dp_owner=None, dp_ranges=((0, 0, point - start), (1, point - start, q.numel))))
        buckets = tuple(dataclasses.replace(x, cuts=cuts) if x.index == pp.bucket else x for x in plan.buckets)
        return Plan(inputs=plan.inputs, params=tuple(params), buckets=buckets, micro_groups=plan.micro_groups, metrics=plan.metrics)

    ok = cut_at(mid)
    assert ok.param("experts.gate_up_proj").dp_ranges == ((0, 0, 2 * unit), (1, 2 * unit, 4 * unit))
    assert Plan.from_dict(ok.to_dict()) == ok
    with pytest.raises(PlanError, match="cuts an expert"):
        cut_at(mid + 5)


def test_plan_json_keeps_transposed() -> None:
    from canzona.plan.plan import Plan

    plan = _plan()
    doc = plan.to_dict()
    assert [q.get("transposed", False) for q in doc["params"] if q["name"] == "c_attn.weight"] == [True]
    back = Plan.from_dict(doc)
    assert back.param("c_attn.weight").spec.transposed and back.fingerprint == plan.fingerprint


def test_describe_table_lists_every_role() -> None:
    from canzona.plan.describe import describe_plan, role_rows

    plan = _plan()
    rows = {r.name: r for r in role_rows(plan)}
    assert rows["experts.gate_up_proj"].tasks == "4 x (12, 8)"
    assert rows["c_attn.weight"].tasks == "1 x (24, 8) (stored transposed)"
    assert rows["conv.weight"].tasks == "1 x (4, 27) (reshaped)"
    assert rows["wte.weight"].role == "elementwise"
    text = describe_plan(plan)
    assert len(text.splitlines()) == len(plan.params) + 3 and "2 experts" in text


@pytest.mark.parametrize("fn", ["original", "spectral", "match_rms_adamw"])
def test_muon_transposed_group_is_the_transpose_bitwise(fn: str) -> None:
    from canzona.optim import Muon

    g = torch.Generator().manual_seed(1)
    stored = torch.randn(8, 24, generator=g)
    logical = stored.T.contiguous()
    a = Muon([{"params": [stored], "transposed": True}], lr=0.05, adjust_lr_fn=fn)
    b = Muon([logical], lr=0.05, adjust_lr_fn=fn)
    for _ in range(3):
        grad = torch.randn(8, 24, generator=g)
        stored.grad, logical.grad = grad.clone(), grad.T.contiguous()
        a.step()
        b.step()
        assert torch.equal(stored.T, logical)
    assert torch.equal(a.state[stored]["momentum_buffer"].T, b.state[logical]["momentum_buffer"])
    if fn != "match_rms_adamw":  # the scaling differs between the two orientations: the flag matters
        c = torch.randn(8, 24, generator=g)
        d = c.clone()
        c.grad = d.grad = torch.randn(8, 24, generator=g)
        Muon([c], lr=0.05, adjust_lr_fn=fn).step()
        Muon([{"params": [d], "transposed": True}], lr=0.05, adjust_lr_fn=fn).step()
        assert not torch.equal(c, d)


def test_transposed_refused_for_an_optimizer_that_cannot_flip() -> None:
    from canzona.specs import check_transposed_support

    specs = specs_from_module(ToyMoE())
    with pytest.raises(RoleError, match="c_attn.weight: stored \\(in, out\\).*Muon cannot"):
        check_transposed_support(specs, torch.optim.Muon)
    check_transposed_support(specs, torch.optim.Muon, elementwise_only=True)


# ------------------------------------------------------------------------------ distributed
def _grads(model: torch.nn.Module, step: int, rank: int) -> dict[str, torch.Tensor]:
    g = integer_grads(model, step=step, rank=rank)
    if step == 1:  # one expert routed no token on any rank this step: a zero gradient, not a missing one
        for n in ("experts.gate_up_proj", "experts.down_proj"):
            g[n][IDLE_EXPERT].zero_()
    return g


def _cls(strategy: str):
    from canzona.optim import Muon

    return torch.optim.AdamW if strategy == "zero1" else Muon


def _dp_case(rank: int, strategy: str, folder: str) -> dict:
    import canzona
    from validation.harness import inject_grads

    model = ToyMoE(conv=True)
    opt = canzona.DistributedOptimizer(model, _cls(strategy), strategy=strategy, optimizer_kwargs=MKW if strategy != "zero1" else EKW,
                                       elementwise_kwargs=EKW, bucket_numel=700, roles=ROLES)
    for s in range(STEPS):
        inject_grads(model, _grads(model, s, rank))
        opt.step()
        opt.zero_grad()
    doc = opt.consolidated_state_dict()
    out = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "describe": opt.describe(), "ok": True}
    if rank == 0:
        out["state"] = {n: {k: v for k, v in st.items() if torch.is_tensor(v)} for n, st in doc["state"].items()}
    # round trip: a fresh optimizer loads the document and takes the same next step as this one
    fresh_model = ToyMoE(conv=True)
    fresh = canzona.DistributedOptimizer(fresh_model, _cls(strategy), strategy=strategy, optimizer_kwargs=MKW if strategy != "zero1" else EKW,
                                         elementwise_kwargs=EKW, bucket_numel=700, roles=ROLES)
    import torch.distributed as dist

    objs = [doc if rank == 0 else None]
    dist.broadcast_object_list(objs, src=0)
    fresh.load_state_dict(objs[0])
    for m, o in ((model, opt), (fresh_model, fresh)):
        inject_grads(m, _grads(m, STEPS, rank))
        o.step()
        o.zero_grad()
    out["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh_model.parameters()))
    if strategy == "lb-asc":  # several experts of a stack on each rank: the sharded format round trip
        from canzona.runtime.dcp import load_sharded, save_sharded
        from harness import doc_differences

        save_sharded(opt, f"{folder}/muon-experts.dcp")
        again = canzona.DistributedOptimizer(ToyMoE(conv=True, seed=4), _cls(strategy), strategy=strategy, optimizer_kwargs=MKW,
                                             elementwise_kwargs=EKW, bucket_numel=700, roles=ROLES)
        load_sharded(again, f"{folder}/muon-experts.dcp")
        out["sharded"] = doc_differences(_everywhere(again.consolidated_state_dict()), _everywhere(opt.consolidated_state_dict()))
    return out


def _everywhere(doc: dict) -> dict:
    """Rank 0's document on every rank."""
    import torch.distributed as dist

    box = [doc or None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


TINY_MOE_STRATEGIES = ("lb-asc", "sc")


def _tiny_moe_grads(model: torch.nn.Module, step: int, rank: int) -> dict[str, torch.Tensor]:
    from canzona.models import batch

    ids, labels = batch(step, rank, 2, 4, 16, seed=3)
    names, params = zip(*model.named_parameters())
    return dict(zip(names, torch.autograd.grad(model.loss(ids, labels), params)))


def _tiny_moe_case(rank: int, strategy: str) -> dict:
    """Train canzona's Qwen3-MoE at dp 2; beside it, in this process, the per-task reference
    stepped on the mean of both ranks' gradients computed on the reference's own weights."""
    import canzona
    import canzona.optim.muon as muon_mod
    from canzona.config import load_model_config
    from canzona.models import Qwen3MoE, batch
    from canzona.optim import Muon

    cfg = load_model_config("qwen3-moe-tiny")
    model = Qwen3MoE(cfg, seed=1)
    ref = TaskReference(model, module_roles(model), Muon, MKW, torch.optim.AdamW, EKW)
    opt = canzona.DistributedOptimizer(model, "muon", strategy=strategy, optimizer_kwargs=MKW, elementwise_kwargs=EKW, bucket_numel=20_000)
    chains: list[int] = []
    real = muon_mod.batched_newton_schulz
    muon_mod.batched_newton_schulz = lambda grads, *a: (chains.append(len(grads)), real(grads, *a))[1]
    losses = []
    try:
        for s in range(STEPS):
            ids, labels = batch(s, rank, 2, 4, 16, seed=3)
            loss = model.loss(ids, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            ref.step(mean_grads([_tiny_moe_grads(ref.model, s, r) for r in range(2)]))
    finally:
        muon_mod.batched_newton_schulz = real
    want = ref.params()
    bad = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), want[n])]
    return {"bad": bad, "chains": chains, "losses": losses, "n_params": len(want)}


#: Shampoo and SOAP on the non-square stacks (4, 12, 8) and (4, 8, 6): preconditioners per expert
#: ((12, 12) and (8, 8); (8, 8) and (6, 6)), refreshed every step; Conv1D left to AdamW (only
#: canzona's Muon updates it transposed)
PRECOND_KW = {"shampoo": {"lr": 0.01, "precondition_frequency": 1}, "soap": {"lr": 3e-3, "precondition_frequency": 1}}
PRECOND_ROLES = {"c_attn.weight": "elementwise"}
RESUME_STEPS = 2


def _precond_opt(model: torch.nn.Module, name: str):
    import canzona

    return canzona.DistributedOptimizer(model, name, strategy="lb-asc", optimizer_kwargs=PRECOND_KW[name], elementwise_kwargs=EKW,
                                        bucket_numel=700, roles=PRECOND_ROLES)


def _precond_save(rank: int, name: str, folder: str) -> dict:
    """Shampoo / SOAP at dp 2 (lb-asc splits each stack's experts over the ranks), then the
    consolidated, the sharded (DCP) and the Stateful (``dcp.save``) checkpoints; each of the last
    two loaded at dp 2 into an optimizer of other values, compared with the saved document."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.checkpoint import save_checkpoint
    from canzona.runtime.dcp import load_sharded, save_sharded
    from harness import doc_differences
    from validation.harness import inject_grads

    model = ToyMoE()
    opt = _precond_opt(model, name)
    for s in range(STEPS):
        inject_grads(model, _grads(model, s, rank))
        opt.step()
        opt.zero_grad()
    owners = {n: sorted(pc.expert for pc in opt.runtime.pieces if pc.name == n and pc.expert is not None)
              for n in ("experts.gate_up_proj", "experts.down_proj")}
    save_checkpoint(opt, f"{folder}/{name}.pt")
    save_sharded(opt, f"{folder}/{name}.dcp")
    dcp.save({"optim": opt}, checkpoint_id=f"{folder}/{name}.stateful")
    want = _everywhere(opt.consolidated_state_dict())
    differ = {}
    for fmt, load in (("sharded", lambda o: load_sharded(o, f"{folder}/{name}.dcp")),
                      ("stateful", lambda o: dcp.load({"optim": o}, checkpoint_id=f"{folder}/{name}.stateful"))):
        again = _precond_opt(ToyMoE(seed=6), name)
        load(again)
        differ[fmt] = doc_differences(_everywhere(again.consolidated_state_dict()), want)
    return {"experts_here": owners, "differ": differ}


def moe_worker(rank: int, world: int, folder: str) -> bytes:
    out: dict = {s: _dp_case(rank, s, folder) for s in STRATEGIES}
    out["tiny_moe"] = {s: _tiny_moe_case(rank, s) for s in TINY_MOE_STRATEGIES}
    out["precond"] = {n: _precond_save(rank, n, folder) for n in PRECOND_KW}
    return pack(out)


_RUN: list[dict] = []
_FOLDER: list[str] = []


def _results() -> list[dict]:
    if not _RUN:
        import tempfile

        _FOLDER.append(tempfile.mkdtemp(prefix="canzona-moe-"))
        _RUN.extend(unpack(r) for r in run_workers(moe_worker, 2, _FOLDER[0], timeout_s=300))
    return _RUN


def _reference(strategy: str) -> TaskReference:
    from canzona.optim import Muon

    model = ToyMoE(conv=True)
    roles = module_roles(model, ROLES)
    if strategy == "zero1":
        roles = {n: ("elementwise", False) for n in roles}
    ref = TaskReference(model, roles, Muon, MKW, torch.optim.AdamW, EKW)
    for s in range(STEPS):
        ref.step(mean_grads([_grads(model, s, r) for r in range(2)]))
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp2_experts_bitwise_per_task(strategy: str) -> None:
    res = [r[strategy] for r in _results()]
    ref = _reference(strategy)
    want = ref.params()
    for r in res:
        bad = [n for n in want if not torch.equal(r["params"][n], want[n])]
        assert bad == [], bad
    assert "experts" in res[0]["describe"]
    if strategy == "zero1":
        return
    state = res[0]["state"]
    for n in ("experts.gate_up_proj", "experts.down_proj"):
        mom = state[n]["momentum_buffer"]
        assert mom.shape == (4, *ref.tasks[n][0].shape)
        for e, m in enumerate(ref.momentum(n)):
            assert torch.equal(mom[e], m), (n, e)
    assert torch.equal(state["c_attn.weight"]["momentum_buffer"].T, ref.momentum("c_attn.weight")[0])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp2_experts_checkpoint_round_trip(strategy: str) -> None:
    assert all(r[strategy]["resumed_equal"] for r in _results())
    if strategy == "lb-asc":  # the sharded format carries several experts of a stack per rank, bitwise
        for r in _results():
            assert r[strategy]["sharded"] == [], r[strategy]["sharded"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", TINY_MOE_STRATEGIES)
def test_dp2_tiny_qwen3_moe_trains_bitwise_per_task(strategy: str) -> None:
    """Real routing and backward: every parameter on both ranks equals the per-task reference, and
    the owners ran no batched Newton-Schulz chain (the default steps each expert alone: batching
    is not bitwise on every CPU, docs/roles.md)."""
    res = [r["tiny_moe"][strategy] for r in _results()]
    for r in res:
        assert r["bad"] == [], r["bad"]
        assert r["n_params"] > 20
    assert all(r["chains"] == [] for r in res)
    assert res[0]["losses"] != res[1]["losses"]  # the ranks saw different batches


def _precond_reference(name: str) -> TaskReference:
    """Each expert alone under the single-device optimizer: STEPS steps on the mean of both ranks'
    gradients, then RESUME_STEPS on rank 0's alone (the run resumed at dp 1)."""
    from canzona.optimizers import get_optimizer

    model = ToyMoE()
    ref = TaskReference(model, module_roles(model, PRECOND_ROLES), get_optimizer(name).load(), PRECOND_KW[name], torch.optim.AdamW, EKW)
    for s in range(STEPS):
        ref.step(mean_grads([_grads(model, s, r) for r in range(2)]))
    for s in range(STEPS, STEPS + RESUME_STEPS):
        ref.step(_grads(model, s, 0))
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRECOND_KW))
def test_preconditioned_expert_state_resumes_at_another_dp_size(name: str, tmp_path) -> None:
    """Shampoo / SOAP state of non-square experts (per-expert (M, M) and (N, N) preconditioners)
    saved at dp 2, with the experts of each stack split over both ranks, in the consolidated and
    the sharded (DCP) formats, loads at dp 1 from either and continues bitwise as each expert
    alone on one device would; both keep the state stacked along the expert index. Both DCP forms
    also load back at dp 2 equal to the saved state (every tensor, its layout)."""
    from canzona.runtime.checkpoint import load_checkpoint
    from canzona.runtime.dcp import load_sharded
    from canzona.runtime.launch import file_init_method, process_group
    from validation.harness import inject_grads

    res = [r["precond"][name] for r in _results()]
    here = [r["experts_here"] for r in res]
    assert all(sorted(here[0][n] + here[1][n]) == [0, 1, 2, 3] for n in here[0])
    assert any(here[0][n] and here[1][n] for n in here[0]), here  # a stack's experts on both ranks
    folder = _FOLDER[0]
    doc = torch.load(f"{folder}/{name}.pt", weights_only=True)
    key = "L" if name == "shampoo" else "Q_L"
    assert doc["state"]["experts.gate_up_proj"][key].shape == (4, 12, 12)
    assert doc["state"]["experts.down_proj"][key].shape == (4, 8, 8)
    for r in res:
        assert r["differ"] == {"sharded": [], "stateful": []}, r["differ"]
    want = _precond_reference(name).params()
    for fmt in ("pt", "dcp"):
        (tmp_path / fmt).mkdir()
        with process_group(file_init_method(tmp_path / fmt)):
            model = ToyMoE(seed=5)
            opt = _precond_opt(model, name)
            (load_checkpoint if fmt == "pt" else load_sharded)(opt, f"{folder}/{name}.{fmt}")
            for s in range(STEPS, STEPS + RESUME_STEPS):
                inject_grads(model, _grads(model, s, 0))
                opt.step()
                opt.zero_grad()
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert bad == [], (fmt, bad)


def test_tiny_moe_is_the_dense_model_with_a_moe_block_and_tp_refuses_it() -> None:
    """Qwen3MoE is canzona's Qwen3 with MoEBlock as its feed-forward block (one constructor,
    init and loss); canzona's TP helpers, which lay out the dense model, refuse it in one line,
    and each model refuses the other's config."""
    from canzona.config import load_model_config
    from canzona.models import Qwen3, Qwen3MoE, parallelize, shard_megatron
    from canzona.models.qwen3_moe import MoEBlock

    moe = Qwen3MoE(load_model_config("qwen3-moe-tiny"), seed=1)
    assert isinstance(moe, Qwen3) and all(isinstance(layer.mlp, MoEBlock) for layer in moe.model.layers)
    again = Qwen3MoE(load_model_config("qwen3-moe-tiny"), seed=1)
    assert all(torch.equal(a, b) for a, b in zip(moe.parameters(), again.parameters()))
    for fn, args in ((shard_megatron, (0, 2)), (parallelize, (None,))):
        with pytest.raises(TypeError, match=f"{fn.__name__} supports the dense canzona Qwen3 only; Qwen3MoE is a mixture of experts") as info:
            fn(moe, *args)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="use canzona.models.Qwen3MoE"):
        Qwen3(load_model_config("qwen3-moe-tiny"))
    with pytest.raises(ValueError, match="needs a config with 'moe'"):
        Qwen3MoE(load_model_config("qwen3-tiny"))
