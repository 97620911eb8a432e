"""Sharded DCP checkpoints (canzona.runtime.dcp): written per rank, read at another layout, bitwise.

The world-4 run also trains a transformers Qwen3 at DP2 x TP2 under transformers' own TP plan
(the Hugging Face DP x TP case, with a sharded save and resume in the middle).

One world-4 run saves (ToyModel at DP4 under four strategies; the tiny Qwen3 at DP2 x TP2 with
DTensor TP and hosted micro-group state) and resumes the Qwen3 checkpoint at DP4 and at DP2 x TP2;
one world-2 run resumes the ToyModel checkpoints at DP2 and the Qwen3 one at DP2 and DP1 x TP2, and
checks refusals. Every resumed run must equal, bit for bit, one process that continued the original
run (gradients are integers times 2**-4: any reduction order and DP size give the exact mean).
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from canzona.runtime.launch import run_workers
from canzona.testing import (
    ReferenceRunner,
    ToyModel,
    inject_grads,
    integer_grads,
    mean_grads,
    pack,
    params_of,
    tensors_equal,
    tp_local,
    unpack,
)

pytestmark = pytest.mark.slow

SAVE_STEPS, MORE_STEPS = 3, 2
MATRIX_KW = {"lr": 0.05}
EW_KW = {"lr": 0.01, "weight_decay": 0.1}
#: ToyModel cases: zero1 cuts every parameter into flat pieces (chunked boxes); lb-asc-joint cuts
#: element-wise parameters only and SOAP's matrix state is not parameter-shaped and partly
#: column-major (its layout must survive the round trip); Muon and TP-hosted state: the tiny Qwen3
CASES = (("zero1", "adamw"), ("lb-asc-joint", "soap"))


def _cls(name: str) -> type[torch.optim.Optimizer]:
    from canzona.optim import SOAP, Muon, Shampoo

    return {"adamw": torch.optim.AdamW, "muon": Muon, "shampoo": Shampoo, "soap": SOAP}[name]


def _toy_opt(model, strategy: str, optname: str):
    import canzona

    return canzona.DistributedOptimizer(model, optname, strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)


def _run(model, opt, steps, rank: int, grads=None) -> None:
    for s in steps:
        inject_grads(model, grads(s) if grads is not None else integer_grads(model, step=s, rank=rank))
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------------------ tiny Qwen3 with TP


def _tiny(seed: int):
    from canzona.config import load_model_config
    from canzona.models import Qwen3

    torch.manual_seed(seed)
    return Qwen3(load_model_config("qwen3-tiny"))


def _tiny_grads(step: int, dp_rank: int) -> dict[str, torch.Tensor]:
    shapes = {n: tuple(p.shape) for n, p in _tiny(0).named_parameters()}
    return integer_grads(shapes, step=step, rank=dp_rank, seed=11)


def _qk_norms(names) -> set[str]:
    return {n for n in names if n.endswith(("q_norm.weight", "k_norm.weight"))}


def _tiny_opt(seed: int, dp: int, tp: int):
    """The tiny Qwen3 on a dp x tp mesh (DTensor TP when tp > 1) with lb-asc Muon."""
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.models.tp import parallelize

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp")) if tp > 1 else None
    model = parallelize(_tiny(seed), mesh["tp"]) if tp > 1 else _tiny(seed)
    opt = canzona.DistributedOptimizer(
        model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=4096
    )
    return model, opt


def _tiny_run(model, opt, steps) -> None:
    for s in steps:
        full = _tiny_grads(s, opt.dp_rank)
        inject_grads(model, tp_local(full, opt.plan.specs, opt.tp_rank, partial=_qk_norms(full)) if opt.tp > 1 else full)
        opt.step()
        opt.zero_grad()


def _full(model) -> dict[str, torch.Tensor]:
    return {n: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()) for n, p in model.named_parameters()}


def _tiny_resume(folder: str, dp: int, tp: int) -> dict[str, torch.Tensor]:
    from canzona.runtime.dcp import load_sharded

    model, opt = _tiny_opt(5, dp, tp)
    load_sharded(opt, Path(folder) / "tiny")
    assert opt.steps == SAVE_STEPS
    _tiny_run(model, opt, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
    return _full(model)


# ------------------------------------------------------------------------------ a transformers model at DP2 x TP2

_HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None  # in the dev extra

HF_STEPS = 3


def _hf_model():
    import transformers

    from canzona.config import load_model_config
    from canzona.hf import hf_config

    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(hf_config(load_model_config("qwen3-tiny"), attn_implementation="eager")).float()


def _hf_dp2xtp2(folder: str) -> dict:
    """A transformers Qwen3 under its own TP plan at DP2 x TP2 (README order: optimizer before the
    first forward), injected gradients; two steps, a sharded save, a fresh model loads it, one more
    step: bitwise against one device (the q/k norms get transformers' gradient all-reduce)."""
    from torch.distributed.device_mesh import init_device_mesh

    import canzona
    from canzona.hf import apply_tp_plan
    from canzona.runtime.dcp import load_sharded, save_sharded
    from canzona.specs import specs_from_module
    from canzona.testing import tp_cut

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build():
        model = apply_tp_plan(_hf_model(), mesh["tp"])
        opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", mesh=mesh, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW)
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))  # first forward: transformers registers its hooks
        return model, opt

    model, opt = build()
    specs = specs_from_module(model)
    tp_dims = {s.name: s.tp_dim for s in specs if s.tp_split}
    shapes = {s.name: s.shape for s in specs}
    partial = _qk_norms(shapes)

    def run(model, opt, steps) -> None:
        for s in steps:
            full = integer_grads(shapes, step=s, rank=opt.dp_rank, seed=3)
            inject_grads(model, tp_cut(full, tp_dims, opt.tp_rank, 2, partial=partial))
            opt.step()
            opt.zero_grad()

    run(model, opt, range(HF_STEPS - 1))
    save_sharded(opt, Path(folder) / "hf")
    model, opt = build()
    load_sharded(opt, Path(folder) / "hf")
    run(model, opt, range(HF_STEPS - 1, HF_STEPS))
    return {"params": params_of(model), "tp_dims": tp_dims, "tp_rank": opt.tp_rank}


# ------------------------------------------------------------------------------ workers


def world4_worker(rank: int, world: int, folder: str) -> bytes:
    from canzona.runtime.dcp import save_sharded

    for strategy, optname in CASES:
        model = ToyModel()
        opt = _toy_opt(model, strategy, optname)
        _run(model, opt, range(SAVE_STEPS), rank)
        save_sharded(opt, Path(folder) / strategy)
    model, opt = _tiny_opt(0, 2, 2)
    _tiny_run(model, opt, range(SAVE_STEPS))
    save_sharded(opt, Path(folder) / "tiny")
    files = sorted(p.name for p in (Path(folder) / "tiny").iterdir())
    out = {"files": files, "dp4": _tiny_resume(folder, 4, 1), "dp2xtp2": _tiny_resume(folder, 2, 2)}
    if _HAVE_TRANSFORMERS:
        out["hf"] = _hf_dp2xtp2(folder)
    return pack(out)


def world2_worker(rank: int, world: int, folder: str) -> bytes:
    from canzona.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from canzona.runtime.dcp import load_sharded

    out: dict = {}
    for strategy, optname in CASES:
        model = ToyModel(seed=5)
        opt = _toy_opt(model, strategy, optname)
        load_sharded(opt, Path(folder) / strategy)
        _run(model, opt, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS), rank)
        out[strategy] = params_of(model)
    out["tiny_dp2"] = _tiny_resume(folder, 2, 1)
    out["tiny_dp1xtp2"] = _tiny_resume(folder, 1, 2)

    # ---- refusals: one CheckpointError, in-memory state untouched
    def refused(opt, load, path) -> tuple[str, bool]:
        model = opt.model
        before = [m.clone() for m in opt.runtime.masters.values()] + [p.detach().clone() for p in model.parameters()]
        try:
            load(opt, path)
        except CheckpointError as exc:
            msg = str(exc)
        else:
            msg = "loaded"
        after = list(opt.runtime.masters.values()) + [p.detach() for p in model.parameters()]
        return msg, all(torch.equal(a, b) for a, b in zip(before, after))

    out["wrong_optimizer"] = refused(_toy_opt(ToyModel(seed=7), "lb-asc-joint", "shampoo"), load_sharded, Path(folder) / "lb-asc-joint")
    out["other_model"] = refused(_toy_opt(ToyModel(seed=7, ffn=12), "lb-asc-joint", "soap"), load_sharded, Path(folder) / "lb-asc-joint")
    out["not_a_checkpoint"] = refused(_toy_opt(ToyModel(seed=7), "lb-asc", "muon"), load_sharded, Path(folder))
    broken = Path(folder) / "truncated"
    if rank == 0:
        shutil.copytree(Path(folder) / "zero1", broken)
        for f in sorted(broken.glob("*.distcp")):
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2])
    torch.distributed.barrier()
    out["truncated"] = refused(_toy_opt(ToyModel(seed=7), "zero1", "adamw"), load_sharded, broken)
    # the consolidated single-file format: a truncated file is refused the same way
    model = ToyModel()
    opt = _toy_opt(model, "lb-asc", "muon")
    _run(model, opt, range(1), rank)
    single = Path(folder) / "single.pt"
    save_checkpoint(opt, single)
    if rank == 0:
        data = single.read_bytes()
        (Path(folder) / "single-truncated.pt").write_bytes(data[: len(data) // 2])
    torch.distributed.barrier()
    out["single_truncated"] = refused(_toy_opt(ToyModel(seed=7), "lb-asc", "muon"), load_checkpoint, Path(folder) / "single-truncated.pt")
    return pack(out)


# ------------------------------------------------------------------------------ references


def _toy_reference(strategy: str, optname: str) -> dict[str, torch.Tensor]:
    model = ToyModel()
    ref = ReferenceRunner(model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1")
    for s in range(SAVE_STEPS + MORE_STEPS):
        world = 4 if s < SAVE_STEPS else 2
        ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(world)]))
    return ref.params()


def _tiny_reference(resume_dp: int, steps: int = SAVE_STEPS + MORE_STEPS) -> ReferenceRunner:
    from canzona.optim import Muon

    ref = ReferenceRunner(_tiny(0), Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    for s in range(steps):
        dp = 2 if s < SAVE_STEPS else resume_dp
        ref.step(mean_grads([_tiny_grads(s, r) for r in range(dp)]))
    return ref


_RUNS: dict[int, list[dict]] = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp")


def _results(world: int, folder: Path) -> list[dict]:
    if 4 not in _RUNS:
        _RUNS[4] = [unpack(r) for r in run_workers(world4_worker, 4, str(folder), timeout_s=240)]
    if world == 2 and 2 not in _RUNS:
        _RUNS[2] = [unpack(r) for r in run_workers(world2_worker, 2, str(folder), timeout_s=240)]
    return _RUNS[world]


# ------------------------------------------------------------------------------ tests


def test_each_rank_writes_its_own_file(folder: Path) -> None:
    res = _results(4, folder)
    assert res[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    sizes = [(folder / "tiny" / f"__{r}_0.distcp").stat().st_size for r in range(4)]
    # nothing is gathered: no rank's file holds (nearly) everything
    assert max(sizes) < 0.6 * sum(sizes), sizes


@pytest.mark.parametrize("layout", ["dp4", "dp2xtp2"])
def test_dp2xtp2_checkpoint_resumes_at_world4_bitwise(folder: Path, layout: str) -> None:
    want = _tiny_reference(4 if layout == "dp4" else 2).params()
    for rank, r in enumerate(_results(4, folder)):
        assert tensors_equal(want, r[layout]) == [], f"resumed as {layout}, rank {rank}"


@pytest.mark.parametrize("layout,dp", [("tiny_dp2", 2), ("tiny_dp1xtp2", 1)])
def test_dp2xtp2_checkpoint_resumes_at_world2_bitwise(folder: Path, layout: str, dp: int) -> None:
    want = _tiny_reference(dp).params()
    for rank, r in enumerate(_results(2, folder)):
        assert tensors_equal(want, r[layout]) == [], f"resumed as {layout}, rank {rank}"


@pytest.mark.parametrize("strategy,optname", CASES)
def test_dp4_checkpoint_resumes_at_dp2_bitwise(folder: Path, strategy: str, optname: str) -> None:
    want = _toy_reference(strategy, optname)
    for rank, r in enumerate(_results(2, folder)):
        assert tensors_equal(want, r[strategy]) == [], f"{strategy} resumed at DP2, rank {rank}"


def test_dcp_tools_read_the_checkpoint(folder: Path, tmp_path: Path) -> None:
    """DCP's own converter turns the directory into full tensors: the masters and optimizer state
    of the one-process run after the saved steps, the model's parameters under their own names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _results(4, folder)
    out = tmp_path / "full.pt"
    dcp_to_torch_save(folder / "tiny", out)
    doc = torch.load(out, weights_only=True)
    ref = _tiny_reference(2, SAVE_STEPS)
    masters, states = ref.master_values(), ref.states()
    for n, m in masters.items():
        assert torch.equal(doc[f"optim.{n}.master"], m), n
        assert torch.equal(doc[f"model.{n}"], m), n
        for k, v in states[n].items():
            assert torch.equal(doc[f"optim.{n}.state.{k}"], v), f"{n}.{k}"


@pytest.mark.skipif(not _HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_hf_model_dp2xtp2_with_a_sharded_resume_bitwise(folder: Path) -> None:
    from canzona.optim import Muon
    from canzona.testing import tp_cut

    model = _hf_model()
    ref = ReferenceRunner(model, Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for s in range(HF_STEPS):
        ref.step(mean_grads([integer_grads(shapes, step=s, rank=r, seed=3) for r in range(2)]))
    want = ref.params()
    for rank, r in enumerate(_results(4, folder)):
        got = r["hf"]
        assert got["tp_dims"], "transformers' TP plan must shard some parameters"
        assert tensors_equal(tp_cut(want, got["tp_dims"], got["tp_rank"], 2), got["params"]) == [], f"rank {rank}"


@pytest.mark.parametrize(
    "case,expect",
    [
        ("wrong_optimizer", "written by matrix_optimizer 'SOAP'"),
        ("other_model", "checkpoint holds shape"),
        ("not_a_checkpoint", "not a sharded checkpoint directory"),
        ("truncated", "is truncated"),
        ("single_truncated", "not a readable checkpoint"),
    ],
)
def test_bad_checkpoints_are_refused_and_change_nothing(folder: Path, case: str, expect: str) -> None:
    for rank, r in enumerate(_results(2, folder)):
        msg, untouched = r[case]
        assert expect in msg, f"rank {rank}: {msg}"
        assert "\n" not in msg, "one line"
        assert untouched, f"{case}: rank {rank} changed its state"
