"""Behaviour shared by Muon, Shampoo and SOAP: torch Optimizer contract, exactness properties the
distributed runtime relies on (determinism, resumption, per-parameter independence), bad input,
and the matrix / element-wise split."""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable

import pytest
import torch

from canzona.optim import SOAP, Muon, Shampoo, is_matrix_param, split_param_groups

@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny matrices: one thread avoids OpenMP oversubscription on a shared 2-core runner
    (10-50x slower otherwise); the bitwise comparisons are made within one setting anyway."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- helpers the per-optimizer files import from here (one copy of each)
F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _orthogonal(n: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=_gen(seed), dtype=F64))
    return q


def _least_squares_loss(make, lr: float, steps: int = 60) -> float:
    gen = _gen(70)
    n, d, k = 128, 16, 8
    x = torch.randn(n, d, generator=gen, dtype=F64) * torch.logspace(0, 1.5, d, dtype=F64)  # ill-conditioned
    y = x @ torch.randn(k, d, generator=gen, dtype=F64).T + 0.01 * torch.randn(n, k, generator=gen, dtype=F64)
    w = torch.zeros(k, d, dtype=F64, requires_grad=True)
    opt = make([w], lr)
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * (x @ w.T - y).square().mean()).backward()
        opt.step()
    with torch.no_grad():
        loss = (0.5 * (x @ w.T - y).square().mean()).item()
    return loss if math.isfinite(loss) else math.inf


LR_GRID = [10.0**e for e in (-3, -2.5, -2, -1.5, -1, -0.5, 0, 0.5, 1)]


Factory = Callable[..., torch.optim.Optimizer]

# Small precondition_frequency so that resumption crosses root recomputations / basis refreshes.
FACTORIES: dict[str, Factory] = {
    "muon": lambda params, **kw: Muon(params, lr=0.02, **kw),
    "muon_f64": lambda params, **kw: Muon(params, lr=0.02, ns_dtype=None, **kw),
    "shampoo": lambda params, **kw: Shampoo(params, lr=0.01, momentum=0.9, weight_decay=0.01, precondition_frequency=2, **kw),
    "shampoo_sgd_graft": lambda params, **kw: Shampoo(params, lr=0.01, grafting="sgd", precondition_frequency=3, **kw),
    "soap": lambda params, **kw: SOAP(params, lr=0.01, precondition_frequency=2, **kw),
    "soap_rotate": lambda params, **kw: SOAP(
        params, lr=0.01, precondition_frequency=2, skip_first_step=False, second_moment_refresh="rotate", **kw
    ),
}
SHAPES = [(6, 4), (4, 6), (5, 5), (1, 7)]


def _make_params(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in SHAPES]


def _grad_stream(dtype: torch.dtype, steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES] for _ in range(steps)]


def _dtype_for(name: str) -> torch.dtype:
    return torch.float32 if name == "muon" else torch.float64


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()


@pytest.mark.parametrize("name", list(FACTORIES))
def test_two_runs_bitwise_equal(name: str) -> None:
    dtype = _dtype_for(name)
    grads = _grad_stream(dtype, 7)
    results = []
    for _ in range(2):
        params = _make_params(dtype)
        _run(FACTORIES[name](params), params, grads)
        results.append([p.detach().clone() for p in params])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][0], _make_params(dtype)[0])


@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_dict_round_trip_resumes_bitwise(name: str) -> None:
    dtype = _dtype_for(name)
    grads = _grad_stream(dtype, 9)
    ref_params = _make_params(dtype)
    _run(FACTORIES[name](ref_params), ref_params, grads)

    params = _make_params(dtype)
    opt = FACTORIES[name](params)
    _run(opt, params, grads[:4])
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "optim": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = [t.clone().requires_grad_() for t in saved["params"]]
    fresh = FACTORIES[name](resumed)
    fresh.load_state_dict(saved["optim"])
    _run(fresh, resumed, grads[4:])
    for a, b in zip(resumed, ref_params):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_update_independent_of_group_membership(name: str) -> None:
    """The distributed runtime hands each rank an arbitrary subset: results must not change."""
    dtype = _dtype_for(name)
    grads = _grad_stream(dtype, 5)
    together = _make_params(dtype)
    _run(FACTORIES[name](together), together, grads)
    for i in range(len(SHAPES)):
        alone = _make_params(dtype)
        opt = FACTORIES[name]([alone[i]])
        for step_grads in grads:
            alone[i].grad = step_grads[i].clone()
            opt.step()
        assert torch.equal(alone[i], together[i])


@pytest.mark.parametrize("name", list(FACTORIES))
def test_skips_params_without_grad_and_supports_closure_and_zero_grad(name: str) -> None:
    dtype = _dtype_for(name)
    params = _make_params(dtype)
    before = [p.detach().clone() for p in params]
    opt = FACTORIES[name](params)
    target = torch.ones_like(params[0])

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = ((params[0] - target) ** 2).sum()
        loss.backward()
        return loss

    for _ in range(3):
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor)
    assert not torch.equal(params[0], before[0])
    for p, b in zip(params[1:], before[1:]):
        assert p.grad is None and torch.equal(p, b) and p not in opt.state
    opt.zero_grad()
    assert params[0].grad is None


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_grad_raises_before_any_mutation(name: str, bad: float) -> None:
    dtype = _dtype_for(name)
    params = _make_params(dtype)
    opt = FACTORIES[name](params)
    _run(opt, params, _grad_stream(dtype, 3))
    state_before = copy.deepcopy(opt.state_dict())
    params_before = [p.detach().clone() for p in params]
    grads = _grad_stream(dtype, 1, seed=5)[0]
    grads[2][1, 3] = bad
    for p, g in zip(params, grads):
        p.grad = g
    found = "NaN" if bad != bad else "inf"
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[2\].*\(5, 5\).*1 {'NaN' if found == 'NaN' else '.inf'}"):
        opt.step()
    for p, b in zip(params, params_before):
        assert torch.equal(p, b)
    state_after = opt.state_dict()
    assert state_after["state"].keys() == state_before["state"].keys()
    for key, entry in state_before["state"].items():
        assert entry.keys() == state_after["state"][key].keys()
        for field, value in entry.items():
            other = state_after["state"][key][field]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other


def test_non_finite_error_names_parameter() -> None:
    w = torch.zeros(3, 3, requires_grad=True)
    opt = Muon([("layers.0.attn.q_proj.weight", w)])
    w.grad = torch.full((3, 3), float("nan"))
    with pytest.raises(ValueError, match=r"'layers\.0\.attn\.q_proj\.weight'.*9 NaN"):
        opt.step()


@pytest.mark.parametrize("cls", [Muon, Shampoo, SOAP])
def test_rejects_non_matrix_params_at_construction(cls: type) -> None:
    for shape in [(4,), (2, 3, 4), ()]:
        with pytest.raises(ValueError, match="2-D"):
            cls([torch.zeros(shape, requires_grad=True)])
    with pytest.raises(ValueError, match="empty"):
        cls([torch.zeros(0, 3, requires_grad=True)])


@pytest.mark.parametrize("cls", [Shampoo, SOAP])
def test_eigh_optimizers_reject_low_precision(cls: type) -> None:
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(TypeError, match="dtype"):
            cls([torch.zeros(3, 3, dtype=dtype, requires_grad=True)])


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (Muon, {"lr": -0.1}, "lr"),
        (Muon, {"weight_decay": -1.0}, "weight_decay"),
        (Muon, {"eps": -1e-7}, "eps"),
        (Muon, {"momentum": -0.1}, "momentum"),
        (Shampoo, {"lr": -1e-3}, "lr"),
        (Shampoo, {"eps": -1.0}, "eps"),
        (Shampoo, {"momentum": 1.0}, "momentum"),
        (Shampoo, {"graft_beta2": 1.5}, "graft_beta2"),
        (Shampoo, {"weight_decay": -0.1}, "weight_decay"),
        (Shampoo, {"precondition_frequency": 0}, "precondition_frequency"),
        (Shampoo, {"grafting": "adagrad"}, "grafting"),
        (SOAP, {"lr": -3e-3}, "lr"),
        (SOAP, {"betas": (1.0, 0.9)}, r"betas\[0\]"),
        (SOAP, {"betas": (0.9, -0.1)}, r"betas\[1\]"),
        (SOAP, {"betas": (0.9,)}, "betas"),
        (SOAP, {"shampoo_beta": 1.0}, "shampoo_beta"),
        (SOAP, {"eps": -1e-8}, "eps"),
        (SOAP, {"weight_decay": -0.01}, "weight_decay"),
        (SOAP, {"max_precond_dim": 0}, "max_precond_dim"),
        (SOAP, {"second_moment_refresh": "ignore"}, "second_moment_refresh"),
    ],
)
def test_bad_hyperparameters_raise_value_error(cls: type, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cls([torch.zeros(3, 3, requires_grad=True)], **kwargs)


def test_bad_hyperparameter_types_and_group_overrides() -> None:
    p, q = torch.zeros(3, 3, requires_grad=True), torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(TypeError, match="lr"):
        Muon([p], lr=torch.tensor(0.1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="precondition_frequency"):
        SOAP([p], precondition_frequency=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lr"):
        Shampoo([{"params": [p]}, {"params": [q], "lr": -1.0}])
    opt = Muon([p])
    with pytest.raises(ValueError, match="momentum"):
        opt.add_param_group({"params": [q], "momentum": 2.0})
    assert len(opt.param_groups) == 1


def test_grad_shape_mismatch_and_sparse_grad() -> None:
    p = torch.zeros(3, 3, requires_grad=True)
    opt = Shampoo([p])
    p.grad = torch.zeros(3, 3).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()


# --- matrix / element-wise classification -------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "shape", "expected"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 32), True),
        ("model.layers.0.mlp.gate_proj.weight", (88, 32), True),
        ("model.layers.0.mlp.down_proj.weight", (32, 88), True),
        ("model.layers.0.mlp.experts.3.up_proj.weight", (88, 32), True),
        ("model.layers.0.mlp.gate.weight", (8, 32), False),  # MoE router (Qwen3-MoE)
        ("block_sparse_moe.gate.weight", (8, 32), False),  # MoE router (Mixtral)
        ("model.layers.0.mlp.router.weight", (8, 32), False),
        ("model.embed_tokens.weight", (1000, 32), False),
        ("lm_head.weight", (1000, 32), False),
        ("output_layer.weight", (1000, 32), False),
        ("model.layers.0.input_layernorm.weight", (32,), False),
        ("model.layers.0.self_attn.q_proj.bias", (64,), False),
        ("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 64), False),  # gpt-oss: (E, N) stacks of bias vectors
        ("model.layers.0.mlp.experts.down_proj_bias", (4, 32), False),
        ("h.0.attn.bias", (8, 16), False),
        ("model.layers.0.mlp.bias_proj.weight", (8, 16), True),  # 'bias' elsewhere in the name is no bias
        ("conv.weight", (8, 3, 3, 3), False),
        ("Model.Embedding.Weight", (10, 4), False),  # case-insensitive
    ],
)
def test_is_matrix_param(name: str, shape: tuple[int, ...], expected: bool) -> None:
    assert is_matrix_param(name, shape) is expected


def test_split_param_groups_on_module_and_pairs() -> None:
    model = torch.nn.ModuleDict(
        {
            "embed_tokens": torch.nn.Embedding(10, 4),
            "proj": torch.nn.Linear(4, 6),
            "gate": torch.nn.Linear(4, 3, bias=False),
            "norm": torch.nn.LayerNorm(6),
            "lm_head": torch.nn.Linear(6, 10, bias=False),
        }
    )
    model["norm"].bias.requires_grad_(False)
    matrix, elementwise = split_param_groups(model)
    assert [n for n, _ in matrix] == ["proj.weight"]
    assert [n for n, _ in elementwise] == [
        "embed_tokens.weight",
        "proj.bias",
        "gate.weight",
        "norm.weight",
        "lm_head.weight",
    ]
    # Named lists go straight into optimizers, which record the names.
    opt = Muon(matrix, lr=0.02)
    assert opt.param_groups[0]["param_names"] == ["proj.weight"]
    torch.optim.AdamW(elementwise)
    assert split_param_groups(list(model.named_parameters())) == (matrix, elementwise)


def test_split_param_groups_rejects_bad_input() -> None:
    w = torch.zeros(2, 2, requires_grad=True)
    with pytest.raises(ValueError, match="twice"):
        split_param_groups([("a", w), ("a", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="same tensor"):
        split_param_groups([("a", w), ("b", w)])
    with pytest.raises(TypeError, match="pair"):
        split_param_groups([w])  # type: ignore[list-item]


def test_is_matrix_param_importable_without_torch() -> None:
    """The planner is pure: classifying parameter specs must not pull torch in."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "from canzona.optim import is_matrix_param\n"
        "assert is_matrix_param('layers.0.mlp.up_proj.weight', (8, 4))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("layout", ["megatron", "hf"])
def test_is_matrix_param_agrees_with_planner_specs(layout: str) -> None:
    """The planner's ParamSpec.kind and the optimizer split must classify every parameter of the
    shipped Qwen3 configs (dense and MoE) the same way: one rule on both sides of the atomicity
    contract."""
    specs_mod = pytest.importorskip("canzona.specs")
    config_mod = pytest.importorskip("canzona.config")
    models = config_mod.available_models()
    assert models
    for model in models:
        # By path: a name like "qwen3-0.6b" has a Path suffix (".6b") and fails name lookup.
        cfg = config_mod.load_model_config(config_mod.MODELS_DIR / f"{model}.json")
        specs = specs_mod.specs_from_config(cfg, layout=layout)
        assert specs
        wrong = [s.name for s in specs if is_matrix_param(s.name, s.shape) != (s.kind == "matrix")]
        assert wrong == [], f"{model}: {wrong[:5]}"


@pytest.mark.parametrize("numel", [16, 1 << 17])  # the fused small-tensor path and the per-tensor path
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_finiteness_check_catches_every_kind_in_both_paths(numel: int, bad: float) -> None:
    from canzona.optim._common import _all_finite

    grads = [torch.ones(numel), torch.ones(7, dtype=torch.bfloat16), torch.full((numel,), 1e300, dtype=torch.float64)]
    assert _all_finite(grads)
    for i in range(len(grads)):
        g = [t.clone() for t in grads]
        g[i][-1] = bad
        assert not _all_finite(g), (i, bad)


def test_nonfinite_flags_name_exactly_the_tensors_that_hold_nan_or_inf() -> None:
    """One flag per tensor, whichever path tests it (sizes on both sides of the CPU and the
    default thresholds, mixed dtypes grouped apart, None and empty tensors False), equal to
    ``not isfinite(t).all()``; finite values whose sum would overflow are not flagged."""
    from canzona.optim._common import nonfinite_flags

    g = torch.Generator().manual_seed(0)
    sizes = [1, 16, 511, 512, 4096, (1 << 16) - 1, 1 << 16]
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
    tensors: list[torch.Tensor | None] = [None, torch.empty(0)]
    for k, n in enumerate(sizes * 2):
        dtype = dtypes[k % len(dtypes)]
        tensors.append((torch.rand(n, generator=g) * torch.finfo(dtype).max).to(dtype))
    specials = [float("nan"), float("inf"), -float("inf")]
    for trial in range(8):
        ts = [None if t is None else t.clone() for t in tensors]
        for k in torch.randperm(len(ts), generator=g)[: 2 + trial].tolist():
            t = ts[k]
            if t is not None and t.numel():
                t[int(torch.randint(t.numel(), (1,), generator=g))] = specials[(k + trial) % 3]
        want = [t is not None and t.numel() > 0 and not bool(torch.isfinite(t).all()) for t in ts]
        assert nonfinite_flags(ts).tolist() == want, trial
        assert any(want) and not all(want)


def test_nonfinite_flags_on_cpu_sum_first_and_test_exactly_only_a_non_finite_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU a large tensor is summed first: all-finite tensors of ordinary size never reach
    ``aminmax``; a tensor whose sum overflows (finite entries) or cancels to NaN (+inf and -inf)
    does, alone, and gets the exact answer."""
    from canzona.optim import _common

    calls: list[int] = []
    real = torch.aminmax

    def counting(t: torch.Tensor, *a: object, **k: object) -> object:
        calls.append(t.numel())
        return real(t, *a, **k)

    monkeypatch.setattr(_common.torch, "aminmax", counting)
    g = torch.Generator().manual_seed(1)
    ordinary = [torch.randn(n, generator=g) for n in (512, 4096, 70000)]
    assert _common.nonfinite_flags(ordinary).tolist() == [False] * 3
    assert calls == []
    huge = torch.full((1000,), torch.finfo(torch.float32).max)  # finite, but its sum is inf
    both = torch.randn(2000, generator=g)
    both[3], both[1500] = float("inf"), -float("inf")  # the sum is NaN
    assert _common.nonfinite_flags([*ordinary, huge, both]).tolist() == [False, False, False, False, True]
    assert sorted(calls) == [1000, 2000]


def test_nonfinite_flags_small_cpu_tensors_summed_together_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the small tensors of a dtype are summed together first: when that sum is finite the
    fused max-abs test is never called; when it is not (a NaN, or finite values whose sum
    overflows) the exact test flags exactly the tensors that hold NaN or inf."""
    from canzona.optim import _common

    calls: list[int] = []
    real = torch._foreach_norm

    def counting(ts: list[torch.Tensor], *a: object, **k: object) -> object:
        calls.append(len(ts))
        return real(ts, *a, **k)

    monkeypatch.setattr(_common.torch, "_foreach_norm", counting)
    g = torch.Generator().manual_seed(2)
    small = [torch.randn(8, 16, generator=g) for _ in range(50)]
    assert _common.nonfinite_flags(small).tolist() == [False] * 50
    assert calls == []
    nan = [t.clone() for t in small]
    nan[17][3, 5] = float("nan")
    assert _common.nonfinite_flags(nan).tolist() == [k == 17 for k in range(50)]
    big = [torch.full((4, 4), torch.finfo(torch.float32).max) for _ in range(3)]  # finite; the sum is inf
    assert _common.nonfinite_flags(big).tolist() == [False] * 3
    assert calls == [50, 3]
    # several trailing shapes (each concatenated along its first dim) and 0-dim tensors: one sum
    # settles them all; a NaN or inf in any of them sends the lot to the exact test
    mixed = [torch.randn(shape, generator=g) for shape in ((3,), (2, 5), (4, 5), (), (1, 2, 3), (), (7,), (2, 2, 3))]
    calls.clear()
    assert _common.nonfinite_flags(mixed).tolist() == [False] * len(mixed)
    assert calls == []
    for k in range(len(mixed)):
        for bad in (float("nan"), float("inf"), -float("inf")):
            hit = [t.clone() for t in mixed]
            hit[k].view(-1)[-1] = bad
            assert _common.nonfinite_flags(hit).tolist() == [j == k for j in range(len(mixed))], (k, bad)


def test_finite_grads_verified_skips_only_the_finiteness_test() -> None:
    """Inside ``finite_grads_verified()`` a caller vouches for finiteness: a NaN gradient is not
    read again (the runtimes test the same tensors before any update); outside it, and after it,
    the test is back, and a sparse gradient is refused either way."""
    from canzona.optim import Muon, finite_grads_verified

    p = torch.nn.Parameter(torch.ones(3, 3))
    opt = Muon([p], lr=0.1)
    p.grad = torch.full((3, 3), float("nan"))
    with pytest.raises(ValueError, match="not finite"):
        opt.step()
    with finite_grads_verified():
        with finite_grads_verified():
            pass
        opt.step()  # the nested block ended, the outer one still vouches
    assert torch.isnan(p).all()
    p.grad = torch.full((3, 3), float("inf"))
    with pytest.raises(ValueError, match="not finite"):
        opt.step()
    p.grad = torch.eye(3).to_sparse()
    with finite_grads_verified(), pytest.raises(TypeError, match="sparse gradient"):
        opt.step()
