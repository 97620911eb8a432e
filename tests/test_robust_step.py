"""torch semantics for missing gradients, bitwise against the single-device optimizer.

One spawned world of two ranks runs the same gradient schedule under several strategies (and
DP1 x TP2 on the tiny Qwen3 model, where a TP-split matrix goes unused); the parent replays it on
:class:`validation.harness.ReferenceRunner`, which is plain ``torch.optim`` on one process:

- step 0: two parameters get no gradient on any rank (skipped: no update, no weight decay, no
  state, no step count), two get a gradient on one rank only (the others count as zero);
- step 1: ``step()`` without ``backward()`` after ``zero_grad()``: nothing moves;
- step 2: one backward, then ``step()`` twice without ``zero_grad()``: the same gradient is
  applied twice, as ``torch.optim`` re-applies an unchanged ``p.grad``;
- step 3: an ordinary step.

Gradients are small integers times 2**-4 (exact sums and means), so everything is ``torch.equal``.
Also: a backward after ``step()`` without ``zero_grad()`` warns (canzona starts a new gradient
where torch would add), and ``overlap_updates=True`` keeps the old per-bucket pipeline.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from canzona.optim import Muon
from canzona.runtime.launch import run_workers
from validation.harness import (
    ReferenceRunner,
    ToyModel,
    inject_grads,
    integer_grads,
    mean_grads,
    pack,
    params_of,
    tensors_equal,
    unpack,
)

pytestmark = pytest.mark.slow

MATRIX_KW = {"lr": 0.05}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}
#: (strategy, matrix optimizer)
CASES = (("lb-asc", "muon"), ("sc", "muon"), ("zero1", "adamw"), ("layerwise", "shampoo"))
UNUSED = ("glu.weight", "mix.bias")  # no gradient on any rank
ONE_RANK = {"up.bias": 0, "down.weight": 1}  # a gradient on this rank only
TP_UNUSED = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_norm.weight")


class FlakyMuon(Muon):
    """Muon that raises while ``FlakyMuon.fail`` is set (set on one rank only)."""

    fail = False

    def step(self, closure=None):
        if FlakyMuon.fail:
            raise FloatingPointError("host refused")
        return super().step(closure)


def _cls(name: str) -> type[torch.optim.Optimizer]:
    from canzona.optim import Muon, Shampoo

    return {"adamw": torch.optim.AdamW, "muon": Muon, "shampoo": Shampoo}[name]


def _grads(model_or_shapes, step: int, rank: int, unused=UNUSED, one_rank=ONE_RANK, seed: int = 0) -> dict[str, torch.Tensor]:
    g = integer_grads(model_or_shapes, step=step, rank=rank, seed=seed)
    if step == 0:
        for n in unused:
            g.pop(n)
        for n, r in one_rank.items():
            if r != rank:
                g.pop(n)
    return g


def _schedule(opt, feed) -> None:
    """The four steps of the module docstring; ``feed(step)`` runs one backward."""
    feed(0)
    opt.step()
    opt.zero_grad()
    opt.step()  # no backward
    opt.zero_grad()
    feed(2)
    opt.step()
    opt.step()  # the same gradient again
    opt.zero_grad()
    feed(3)
    opt.step()
    opt.zero_grad()


def _dp_case(rank: int, strategy: str, optname: str) -> dict:
    import canzona

    model = ToyModel()
    opt = canzona.DistributedOptimizer(
        model, _cls(optname), strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40
    )
    _schedule(opt, lambda s: inject_grads(model, _grads(model, s, rank)))
    # a backward after step() without zero_grad(): warned, the old gradient dropped
    opt.step()  # re-applies nothing: zero_grad() above dropped the gradients
    inject_grads(model, _grads(model, 4, rank))
    opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inject_grads(model, _grads(model, 5, rank))
    opt.step()
    opt.zero_grad()
    sd = opt.consolidated_state_dict()
    return {
        "params": params_of(model),
        "unused_state": {n: sd["state"][n] for n in UNUSED} if rank == 0 else None,
        "warned": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }


def _tiny(seed: int = 0):
    from canzona.config import load_model_config
    from canzona.models import Qwen3

    torch.manual_seed(seed)
    return Qwen3(load_model_config("qwen3-tiny"))


def _tiny_grads(step: int, rank: int) -> dict[str, torch.Tensor]:
    shapes = {n: tuple(p.shape) for n, p in _tiny().named_parameters()}
    return _grads(shapes, step, rank, unused=TP_UNUSED, one_rank={}, seed=11)


def _tp_case(rank: int) -> dict:
    """DP1 x TP2 (DTensor TP, LPT micro-groups): a TP-split matrix and a q-norm go unused."""
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.models.tp import parallelize
    from validation.harness import tp_local

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize(_tiny(), mesh["tp"])
    opt = canzona.DistributedOptimizer(
        model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=4096
    )
    tp_rank = mesh.get_local_rank("tp")

    def feed(s: int) -> None:
        full = _tiny_grads(s, 0)
        specs = [sp for sp in opt.plan.specs if sp.name in full]
        norms = {n for n in full if n.endswith(("q_norm.weight", "k_norm.weight"))}
        inject_grads(model, tp_local(full, specs, tp_rank, partial=norms))

    _schedule(opt, feed)
    out = {"params": {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in model.named_parameters()}}
    # a TP host whose optimizer raises (on rank 1 only): the engine still finishes its exchanges,
    # and both ranks raise the same error, naming rank 1 (rather than rank 0 hanging in an all-to-all)
    model = parallelize(_tiny(), mesh["tp"])
    opt = canzona.DistributedOptimizer(model, FlakyMuon, strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW, bucket_numel=4096)
    FlakyMuon.fail = tp_rank == 1
    feed(2)
    try:
        opt.step()
        out["host_error"] = None
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        out["host_error"] = (type(exc).__name__, str(exc))
    FlakyMuon.fail = False
    return out


def worker(rank: int, world: int) -> bytes:
    out = {case: _dp_case(rank, *case) for case in CASES}
    out["tp"] = _tp_case(rank)
    return pack(out)


_RUN: list[dict] = []


def _results() -> list[dict]:
    if not _RUN:
        _RUN.extend(unpack(r) for r in run_workers(worker, 2, timeout_s=240))
    return _RUN


def _replay(ref: ReferenceRunner, grads_of) -> None:
    ref.step(grads_of(0))
    ref.step({})
    g2 = grads_of(2)
    ref.step(g2)
    ref.step(g2)
    ref.step(grads_of(3))


def _dp_mean(model, step: int) -> dict[str, torch.Tensor]:
    """Mean over two ranks where a rank without a gradient contributes zeros; names no rank has are left out."""
    per_rank = [_grads(model, step, r) for r in range(2)]
    names = sorted(set(per_rank[0]) | set(per_rank[1]))
    full = [{n: g.get(n, torch.zeros_like(integer_grads(model, step=step, rank=0)[n])) for n in names} for g in per_rank]
    return mean_grads(full)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_missing_gradients_follow_torch_bitwise(case: tuple[str, str]) -> None:
    strategy, optname = case
    model = ToyModel()
    ref = ReferenceRunner(model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1")
    _replay(ref, lambda s: _dp_mean(model, s))
    ref.step({})
    ref.step(_dp_mean(model, 4))
    ref.step(_dp_mean(model, 5))  # step 5's backward dropped step 4's applied gradient, not added to it
    want = ref.params()
    for rank, res in enumerate(_results()):
        got = res[case]
        assert tensors_equal(want, got["params"]) == [], f"{strategy} rank {rank}: differs from torch.optim"
        assert len(got["warned"]) == 1 and "after step() without zero_grad()" in got["warned"][0], got["warned"]
    # the parameters unused at step 0 were not stepped there (nor at the step without backward):
    # their state (AdamW's step count, Muon's momentum) equals torch's
    state = _results()[0][case]["unused_state"]
    ref_state = ref.states()
    for n in UNUSED:
        for k, v in ref_state[n].items():
            got = state[n][k]
            assert (torch.equal(got, v) if torch.is_tensor(v) else got == v), f"{strategy} {n}.{k}"


def test_tp_engine_skips_unused_bitwise() -> None:
    from canzona.optim import Muon

    ref = ReferenceRunner(_tiny(), Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    _replay(ref, lambda s: _tiny_grads(s, 0))
    want = ref.params()
    for rank, res in enumerate(_results()):
        assert tensors_equal(want, res["tp"]["params"]) == [], f"DP1 x TP2 rank {rank}: differs from torch.optim"


def test_tp_host_error_reaches_every_rank() -> None:
    for rank, res in enumerate(_results()):
        got = res["tp"]["host_error"]
        assert got is not None and got[0] == "RankFailure", (rank, got)
        assert "optimizer step (update) failed on 1 rank(s); rank 1: FloatingPointError: host refused" in got[1], got


def test_skipped_means_not_touched_single_process() -> None:
    """The reference itself: a parameter without a gradient keeps its value through a step with
    weight decay (so the bitwise tests above do test skipping, not a no-op)."""
    model = ToyModel()
    ref = ReferenceRunner(model, _cls("muon"), MATRIX_KW, torch.optim.AdamW, EW_KW)
    before = ref.params()
    ref.step(_grads(model, 0, 0))
    after = ref.params()
    for n in UNUSED:
        assert torch.equal(before[n], after[n])
    assert not torch.equal(before["embed.weight"], after["embed.weight"])
