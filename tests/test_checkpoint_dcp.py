"""Sharded DCP checkpoints (canzona.runtime.dcp): written per rank, read at another layout, bitwise.

One world-4 run saves (ToyModel at DP4 under two strategies; the tiny Qwen3 at DP2 x TP2 with
DTensor TP and hosted micro-group state; FSDPToy under fully_shard at dp_shard 4 and at dp_shard 2
x tp 2) and resumes the Qwen3 checkpoint at DP4 and at DP2 x TP2 and each FSDP2 checkpoint at the
other FSDP2 layout; it also trains a transformers Qwen3 at DP2 x TP2 under transformers' own TP
plan with a sharded save and resume in the middle. One world-2 run resumes the ToyModel
checkpoints at DP2, the Qwen3 one at DP2 and DP1 x TP2, the FSDP2 ones at dp_shard 2, saves and
resumes at dp_shard 2 and across the engines (ZeRO-1 dp 2 <-> FSDP2 dp_shard 2), checks refusals on
both paths and the load's memory bound. Every resumed run must equal, bit for bit, one process
that continued the original run (gradients are integers times 2**-4: any reduction order and DP
size give the exact mean). Each case runs under ``harness.attempt`` (tests/harness.py) and fails on its own.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch

from canzona.optimizers import get_optimizer
from canzona.runtime.launch import run_workers
from harness import attempt, case_results, held_snapshot, load_refused
from validation.harness import ReferenceRunner, ToyModel, inject_grads, integer_grads, mean_grads, pack, params_of, tensors_equal, unpack

from tiny_qwen3 import EW_KW, MATRIX_KW, MORE_STEPS, SAVE_STEPS, full_params, qk_norms, tiny_opt, tiny_reference, tiny_run

pytestmark = pytest.mark.slow

#: ToyModel cases: zero1 cuts every parameter into flat pieces (chunked boxes); lb-asc-joint cuts
#: element-wise parameters only and SOAP's matrix state is not parameter-shaped and partly
#: column-major (its layout must survive the round trip); Muon and TP-hosted state: the tiny Qwen3
CASES = (("zero1", "adamw"), ("lb-asc-joint", "soap"))


def _cls(name: str) -> type[torch.optim.Optimizer]:
    return get_optimizer(name).load()


def _toy_opt(model, strategy: str, optname: str):
    import canzona

    return canzona.DistributedOptimizer(model, optname, strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40)


def _run(model, opt, steps, rank: int, grads=None) -> None:
    for s in steps:
        inject_grads(model, grads(s) if grads is not None else integer_grads(model, step=s, rank=rank))
        opt.step()
        opt.zero_grad()


# ------------------------------------------------------------------------------ tiny Qwen3 with TP


def _tiny_resume(folder: str, dp: int, tp: int) -> dict[str, torch.Tensor]:
    from canzona.runtime.dcp import load_sharded

    model, opt = tiny_opt(5, dp, tp)
    load_sharded(opt, Path(folder) / "tiny")
    assert opt.steps == SAVE_STEPS
    tiny_run(model, opt, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
    return full_params(model)


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
    from validation.harness import tp_cut

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
    partial = qk_norms(shapes)

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


# ------------------------------------------------------------------------------ FSDP2 (fully_shard) and across engines

#: bytes: every stored chunk and the load's scratch buffer of the FSDP2 cases are cut this small
#: (the toy's rows are 20-40 bytes), so chunked saves and the two-pass load run on every region
CHUNK = 96
FSDP_KW = {"lr": 0.02}


def _fsdp_mesh(name: str):
    from torch.distributed.device_mesh import init_device_mesh

    from validation.fsdp_harness import FSDP_MESHES

    shape, names = FSDP_MESHES[name]
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _fsdp(mesh_name: str, optname: str = "muon"):
    """FSDPToy under fully_shard on a mesh of validation.fsdp_harness.FSDP_MESHES, lb-asc."""
    import canzona
    from validation.fsdp_harness import build_fsdp_toy, fsdp_local_grads

    mesh = _fsdp_mesh(mesh_name)
    model = build_fsdp_toy(mesh)
    opt = canzona.DistributedOptimizer(model, optname, strategy="lb-asc", mesh=mesh, optimizer_kwargs=FSDP_KW, elementwise_kwargs=EW_KW)

    def run(steps) -> None:
        for s in steps:
            model(fsdp_local_grads(mesh, s)).backward()
            opt.step()
            opt.zero_grad()

    return model, opt, run


def _fsdp_shapes() -> dict[str, tuple[int, ...]]:
    from validation.fsdp_harness import FSDP_TOY_SHAPES

    return {n: s for n, (s, _) in FSDP_TOY_SHAPES.items()}


def _zero1_toy(optname: str = "muon"):
    """The same FSDPToy on canzona's own ZeRO-1 path (1-D dp mesh, plain tensors)."""
    import canzona
    from validation.fsdp_harness import FSDPToy

    model = FSDPToy()
    opt = canzona.DistributedOptimizer(model, optname, strategy="lb-asc", optimizer_kwargs=FSDP_KW, elementwise_kwargs=EW_KW, bucket_numel=40)

    def run(steps) -> None:
        for s in steps:
            model(integer_grads(_fsdp_shapes(), step=s, rank=opt.dp_rank)).backward()
            opt.step()
            opt.zero_grad()

    return model, opt, run


def _outcome(model, opt) -> dict:
    """Full parameters and the consolidated document (masters and every state entry; rank 0)."""
    from validation.fsdp_harness import _full_params

    params = _full_params(model)
    doc = opt.consolidated_state_dict()
    return {"params": params, "doc": doc, "steps": opt.steps}


def _save_then(build, folder: str, name: str) -> None:
    """SAVE_STEPS steps, then a sharded save (a consolidated file when ``name`` ends in .pt)."""
    from canzona.runtime.checkpoint import save_checkpoint
    from canzona.runtime.dcp import save_sharded

    model, opt, run = build()
    run(range(SAVE_STEPS))
    if name.endswith(".pt"):
        save_checkpoint(opt, Path(folder) / name)
    elif name.startswith("dcp-"):  # torch's own DCP, the optimizer as a Stateful
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=str(Path(folder) / name))
    else:
        save_sharded(opt, Path(folder) / name, chunk_bytes=CHUNK)


def _resume(build, folder: str, name: str) -> dict:
    from canzona.runtime.checkpoint import load_checkpoint
    from canzona.runtime.dcp import load_sharded

    model, opt, run = build()
    if name.endswith(".pt"):
        load_checkpoint(opt, Path(folder) / name)
    elif name.startswith("dcp-"):
        import torch.distributed.checkpoint as dcp

        dcp.load({"model": model.state_dict(), "optim": opt}, checkpoint_id=str(Path(folder) / name))
    else:
        load_sharded(opt, Path(folder) / name, chunk_bytes=CHUNK)
    run(range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
    return _outcome(model, opt)


def _roundtrip(build) -> dict:
    """What ``accelerate.prepare`` does on every rank (``load_state_dict(state_dict())`` with the
    tensors moved to the device), on a fresh optimizer and again after SAVE_STEPS steps; the run
    must go on as if nothing happened."""
    model, opt, run = build()
    opt.load_state_dict({k: v.to("cpu") for k, v in opt.state_dict().items()})
    run(range(SAVE_STEPS))
    opt.load_state_dict({k: v.to("cpu") for k, v in opt.state_dict().items()})
    run(range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
    return _outcome(model, opt)


def _one_rank_calls(build) -> dict:
    """Rank 0 calls state_dict() alone: it raises within status_timeout_s (3 s here) naming rank 1;
    rank 1, arriving at that call later, raises at once; the process group still works and the
    next state_dict() on both ranks succeeds."""
    import time

    from canzona.runtime.checkpoint import CollectiveMismatch

    model, opt, run = build()
    run(range(1))
    opt.status_timeout_s = 3.0
    rank = torch.distributed.get_rank()
    if rank == 1:
        time.sleep(5.0)
    start = time.monotonic()
    try:
        opt.state_dict()
        msg = "returned"
    except CollectiveMismatch as exc:
        msg = str(exc)
    elapsed = time.monotonic() - start
    torch.distributed.barrier()
    after = sorted(opt.state_dict())[:1]
    return {"error": msg, "elapsed": elapsed, "after": after}


def _torch_state_api(build) -> dict:
    """torch.distributed.checkpoint.state_dict's get/set_optimizer_state_dict on canzona's optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt, run = build()
    run(range(1))
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    before = held_snapshot(opt)
    out = {}
    for key, call in (("get", lambda: get_optimizer_state_dict(model, opt)), ("set", lambda: set_optimizer_state_dict(model, opt, {"state": {}, "param_groups": []}))):
        try:
            call()
            out[key] = "returned"
        except Exception as exc:  # noqa: BLE001 - the test reads what it says
            out[key] = str(exc)
    return {**out, "steps": opt.steps, "untouched": tensors_equal(before, held_snapshot(opt)) == []}


def _partly_loaded(build, folder: str, name: str) -> dict:
    """``dcp.load`` of the Stateful form writes into the live tensors before ``load_state_dict``
    checks anything: a checkpoint whose saved ``lr`` is negative is refused only after its masters
    are in. Every later step and save must refuse (PartlyLoaded) until a good load, after which
    the run goes on as if the bad load never happened."""
    import torch.distributed.checkpoint as dcp

    from canzona.runtime.agree import PartlyLoaded
    from canzona.runtime.checkpoint import CheckpointError

    model, opt, run = build()
    run(range(2))
    good, bad = Path(folder) / f"{name}-good", Path(folder) / f"{name}-bad"
    dcp.save({"optim": opt}, checkpoint_id=str(good))
    sd = dict(opt.state_dict())
    lr_keys = [k for k in sd if k.startswith("canzona.hyper.") and k.endswith(".lr")]
    dcp.save({"optim": {**sd, **{k: torch.tensor(-1.0, dtype=sd[k].dtype) for k in lr_keys}}}, checkpoint_id=str(bad))
    run(range(2, 3))
    after_three = params_of(model) if not hasattr(next(model.parameters()), "device_mesh") else _outcome(model, opt)["params"]
    out: dict = {"lr_keys": len(lr_keys)}
    try:
        dcp.load({"optim": opt}, checkpoint_id=str(bad))
        out["load"] = "loaded"
    except CheckpointError as exc:
        out["load"] = str(exc)
    for what, call in (("step", lambda: run(range(3, 4))), ("save", opt.consolidated_state_dict)):
        try:
            call()
            out[what] = "ran"
        except PartlyLoaded as exc:
            out[what] = str(exc)
    out["steps_refused_at"] = opt.steps
    opt.zero_grad()  # the refused step's gradients (a refusal before the step keeps them, as torch.optim does)
    # torch's dcp.save still takes the Stateful form (dcp.load needs its targets to get out of
    # this), but what it writes is refused by every load
    unloadable = Path(folder) / f"{name}-unloadable"
    dcp.save({"optim": opt}, checkpoint_id=str(unloadable))
    dcp.load({"optim": opt}, checkpoint_id=str(good))
    try:
        dcp.load({"optim": opt}, checkpoint_id=str(unloadable))
        out["unloadable"] = "loaded"
    except CheckpointError as exc:
        out["unloadable"] = str(exc)
    dcp.load({"optim": opt}, checkpoint_id=str(good))
    run(range(2, 3))
    again = params_of(model) if not hasattr(next(model.parameters()), "device_mesh") else _outcome(model, opt)["params"]
    out["resumed_equal"] = tensors_equal(after_three, again) == []
    return out


def _fsdp_reference(dps: tuple[int, int]) -> object:
    """One process: SAVE_STEPS steps with the means of dps[0] data-parallel ranks, then MORE_STEPS
    with those of dps[1]."""
    from canzona.optim import Muon
    from validation.fsdp_harness import FSDPToy

    ref = ReferenceRunner(FSDPToy(), Muon, FSDP_KW, torch.optim.AdamW, EW_KW)
    for s in range(SAVE_STEPS + MORE_STEPS):
        dp = dps[0] if s < SAVE_STEPS else dps[1]
        ref.step(mean_grads([integer_grads(_fsdp_shapes(), step=s, rank=r) for r in range(dp)]))
    return ref




def _trained_fsdp(optname: str = "muon"):
    """A dp_shard 2 FSDP2 optimizer two steps in, so a refused load would visibly change it."""
    model, opt, run = _fsdp("dp_shard2", optname)
    run(range(2))
    return opt


def _damaged(folder: str, src: str, name: str, how: str) -> Path:
    """A copy of checkpoint directory ``src`` with every data file truncated or overwritten by
    bytes of the same length (rank 0 writes it; every rank waits)."""
    broken = Path(folder) / name
    if torch.distributed.get_rank() == 0:
        shutil.copytree(Path(folder) / src, broken)
        for f in sorted(broken.glob("*.distcp")):
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2] if how == "truncate" else bytes((b + 97) % 256 for b in data))
    torch.distributed.barrier()
    return broken


def _fsdp_single(folder: str, name: str, optname: str = "muon", truncate: bool = False) -> Path:
    from canzona.runtime.checkpoint import save_checkpoint

    model, opt, run = _fsdp("dp_shard2", optname)
    run(range(1))
    path = Path(folder) / name
    save_checkpoint(opt, path)
    if truncate and torch.distributed.get_rank() == 0:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    torch.distributed.barrier()
    return path


def _fsdp_refusals(folder: str) -> dict:
    from canzona.runtime.checkpoint import load_checkpoint
    from canzona.runtime.dcp import load_sharded

    def sharded(d):
        return lambda o: load_sharded(o, d, chunk_bytes=CHUNK)

    out = {
        "fsdp_wrong_optimizer": load_refused(_trained_fsdp("shampoo"), sharded(Path(folder) / "fsdp2")),
        "fsdp_other_model": load_refused(_trained_fsdp(), sharded(Path(folder) / "tiny")),
        "fsdp_truncated": load_refused(_trained_fsdp(), sharded(_damaged(folder, "fsdp2", "fsdp2-truncated", "truncate"))),
        "fsdp_corrupt": load_refused(_trained_fsdp(), sharded(_damaged(folder, "fsdp2", "fsdp2-corrupt", "overwrite"))),
    }
    single = _fsdp_single(folder, "fsdp-single.pt")
    out["fsdp_single_wrong_optimizer"] = load_refused(_trained_fsdp("shampoo"), lambda o: load_checkpoint(o, single))
    out["fsdp_single_other_model"] = load_refused(_trained_fsdp(), lambda o: load_checkpoint(o, Path(folder) / "single.pt"))
    truncated = _fsdp_single(folder, "fsdp-single-truncated.pt", truncate=True)
    out["fsdp_single_truncated"] = load_refused(_trained_fsdp(), lambda o: load_checkpoint(o, truncated))
    return out


def _bounded_load(folder: str) -> dict:
    """The tiny Qwen3 at DP2: saved and loaded with 4 KiB chunks, into a trained optimizer (state
    exists: written in place) and into a fresh one. Records the largest tensor DCP materialised
    while reading (torch.load wrapped for the duration: DCP decodes every stored item with it) and
    what the loader allocated; and, as a control, the same figures for a checkpoint saved with
    one chunk per tensor."""
    import canzona.runtime.dcp as dcp_mod
    from canzona.runtime.dcp import load_sharded, save_sharded

    cap = 4096
    model, opt = tiny_opt(0, 2, 1)
    tiny_run(model, opt, range(2))
    save_sharded(opt, Path(folder) / "bounded", chunk_bytes=cap)
    save_sharded(opt, Path(folder) / "unbounded", chunk_bytes=2**40)
    owned = opt.runtime.master_bytes() + opt.state_bytes()
    seen: list[int] = []
    real_load = torch.load

    def spy(*args, **kwargs):
        t = real_load(*args, **kwargs)
        if torch.is_tensor(t) and t.dtype != torch.uint8:  # canzona.meta is a uint8 JSON document
            seen.append(t.numel() * t.element_size())
        return t

    out: dict = {"cap": cap, "owned": owned}
    torch.load = spy
    try:
        for key, target, name in (("trained", opt, "bounded"), ("fresh", tiny_opt(3, 2, 1)[1], "bounded"), ("control", opt, "unbounded")):
            seen.clear()
            load_sharded(target, Path(folder) / name, chunk_bytes=cap)
            out[key] = {"largest_item": max(seen), "items": len(seen), **dcp_mod.last_load_stats}
    finally:
        torch.load = real_load
    return out


# ------------------------------------------------------------------------------ hostile and damaged directories


class _Shell:
    """Unpickles into running ``touch <marker>`` (``os.system``): the planted payload."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


class _ShellThenMetadata:
    """Runs the payload, then unpickles into the real metadata: a load that does not refuse it
    goes on as if nothing happened."""

    def __init__(self, marker: str, md) -> None:
        self.marker, self.md = marker, md

    def __reduce__(self):
        import operator

        return (operator.getitem, ((_Shell(self.marker), self.md), 1))


def _copy(folder: str, src: str, name: str, change) -> Path:
    """A copy of checkpoint directory ``src`` changed by ``change(dir)`` on rank 0; every rank waits."""
    out = Path(folder) / name
    if torch.distributed.get_rank() == 0:
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(Path(folder) / src, out)
        change(out)
    torch.distributed.barrier()
    return out


def _plant(folder: str, how: str) -> tuple[Path, Path]:
    """``zero1-toy`` with a ``.metadata`` that runs ``touch``: ``shell`` (the bare payload, the seal
    left as it was), ``resealed`` (the same with the seal rewritten to match), ``then_metadata``
    (payload, then the real metadata, resealed)."""
    import pickle

    from canzona.runtime import dcp_files

    marker = Path(folder) / f"pwned-{how}"

    def change(d: Path) -> None:
        md = dcp_files.read_metadata(d)
        payload = _Shell(str(marker)) if how != "then_metadata" else _ShellThenMetadata(str(marker), md)
        (d / ".metadata").write_bytes(pickle.dumps(payload))
        if how != "shell":  # a forger who also rewrites the seal
            dcp_files.write_manifest(d, dcp_files.hash_files(d, dcp_files.data_files(d), 0, 1))

    return _copy(folder, "zero1-toy", f"planted-{how}", change), marker


#: one stored item of each kind: a matrix master, a model entry, an AdamW ``exp_avg``
FLIPS = {"master": "optim.layers.1.up.master", "model": "model.layers.1.up", "exp_avg": "optim.embed.weight.state.exp_avg"}


def _trained_zero1():
    """The FSDPToy on the ZeRO-1 path two steps in, so a refused load would visibly change it."""
    model, opt, run = _zero1_toy()
    run(range(2))
    return opt


def _flip_entry(folder: str, src: str, prefix: str) -> Path:
    """Checkpoint ``src`` with one byte flipped inside the tensor bytes of the first stored item whose
    key starts with ``prefix`` (a master, a model entry, an AdamW ``exp_avg``)."""
    import io

    from canzona.runtime import dcp_files

    def change(d: Path) -> None:
        md = dcp_files.read_metadata(d)
        idx, info = next((i, s) for i, s in sorted(md.storage_data.items(), key=lambda kv: kv[0].fqn) if i.fqn.startswith(prefix))
        f = d / info.relative_path
        data = bytearray(f.read_bytes())
        item = bytes(data[info.offset : info.offset + info.length])
        t = torch.load(io.BytesIO(item), weights_only=True)
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        at = info.offset + item.index(raw) + len(raw) // 2
        data[at] ^= 0x10
        f.write_bytes(bytes(data))

    return _copy(folder, src, f"flip-{src}-" + prefix.replace(".", "-"), change)


def _dcp_attacks(folder: str) -> dict:
    """Planted code and damaged directories: refused on both ranks, nothing changed, nothing run."""
    from canzona.runtime.dcp import load_sharded, save_sharded

    out: dict = {}
    for how in ("shell", "resealed", "then_metadata"):
        d, marker = _plant(folder, how)
        r = load_refused(_trained_zero1(), lambda o, d=d: load_sharded(o, d))
        torch.distributed.barrier()
        out[f"planted_{how}"] = {**r, "ran": marker.exists()}
    for key, prefix in FLIPS.items():
        d = _flip_entry(folder, "zero1-toy", prefix)
        out[f"flip_{key}"] = load_refused(_trained_zero1(), lambda o, d=d: load_sharded(o, d))
    d = _flip_entry(folder, "fsdp2", FLIPS["master"])
    out["fsdp_flip_master"] = load_refused(_trained_fsdp(), lambda o: load_sharded(o, d, chunk_bytes=CHUNK))

    def extra(d: Path) -> None:
        shutil.copy(d / "__0_0.distcp", d / "__2_0.distcp")

    def missing(d: Path) -> None:
        (d / "__1_0.distcp").unlink()

    out["extra_file"] = load_refused(_trained_zero1(), lambda o: load_sharded(o, _copy(folder, "zero1-toy", "extra", extra)))
    out["missing_file"] = load_refused(_trained_zero1(), lambda o: load_sharded(o, _copy(folder, "zero1-toy", "missing", missing)))
    # a data file of another save of the same model (one step further): same names, same sizes
    model, opt, run = _zero1_toy()
    run(range(SAVE_STEPS + 1))
    save_sharded(opt, Path(folder) / "zero1-toy-later", chunk_bytes=CHUNK)

    def other_save(d: Path) -> None:
        shutil.copy(Path(folder) / "zero1-toy-later" / "__1_0.distcp", d / "__1_0.distcp")

    out["other_save_file"] = load_refused(_trained_zero1(), lambda o: load_sharded(o, _copy(folder, "zero1-toy", "mixed", other_save)))
    return out


def _save_error(opt, path: Path) -> dict:
    from canzona.runtime.checkpoint import CheckpointError
    from canzona.runtime.dcp import save_sharded

    try:
        save_sharded(opt, path)
        msg = "saved"
    except CheckpointError as exc:
        msg = str(exc)
    torch.distributed.barrier()
    return {"error": msg, "tmp_left": path.with_name(path.name + ".tmp").exists()}


def _small_filesystem(where: Path, size_kib: int) -> bool:
    """Mount a tmpfs of ``size_kib`` at ``where`` on rank 0 (root can; CI may not): whether it did,
    the same answer on every rank."""
    import subprocess

    ok = torch.zeros(1)
    if torch.distributed.get_rank() == 0:
        where.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(where)], capture_output=True, check=False)
        ok[0] = float(done.returncode == 0)
    torch.distributed.broadcast(ok, 0)
    return bool(ok[0])


def _failed_saves(folder: str) -> dict:
    """save_sharded where rank 0 cannot make the folder (its parent is a regular file), and onto a
    full disk over an existing checkpoint: a 192 KiB tmpfs holding one ~156 KB checkpoint, so the
    next save's temporary copy runs out of space (ENOSPC); where no tmpfs can be mounted, rank 1's
    DCP writes raise that ENOSPC instead. One CheckpointError on both ranks naming the path and
    the first failing rank's cause, no ``.tmp`` left, the existing checkpoint intact and loadable."""
    import errno
    import os
    import subprocess
    from unittest import mock

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from canzona.runtime import dcp_files
    from canzona.runtime.dcp import load_sharded, save_sharded

    rank = torch.distributed.get_rank()
    model, opt, run = _zero1_toy()
    run(range(1))
    blocker = Path(folder) / "a-plain-file"
    if rank == 0:
        blocker.write_text("not a folder")
    torch.distributed.barrier()
    out = {"not_a_folder": _save_error(opt, blocker / "ckpt")}
    disk = Path(folder) / "small-disk"
    mounted = _small_filesystem(disk, 192)  # one checkpoint (~156 KB) fits, a second beside it does not
    path = disk / "full"
    try:
        save_sharded(opt, path, chunk_bytes=CHUNK)
        seal = (path / dcp_files.MANIFEST).read_bytes()
        run(range(1, 2))

        def no_space(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        inject = rank == 1 and not mounted
        with mock.patch.object(dcp_fs, "_write_item", no_space) if inject else mock.patch.object(dcp_fs, "_write_item", dcp_fs._write_item):
            out["full"] = _save_error(opt, path)
        out["full"]["old_intact"] = (path / dcp_files.MANIFEST).read_bytes() == seal
        load_sharded(opt, path, chunk_bytes=CHUNK)  # the previous checkpoint still loads
        out["full"]["old_loads"] = opt.steps == 1
        out["full"]["tmpfs"] = mounted
        out["read_only"] = {"tmpfs": mounted}
        if mounted:  # read-only for root too
            if rank == 0:
                subprocess.run(["mount", "-o", "remount,ro", str(disk)], capture_output=True, check=True)
            torch.distributed.barrier()
            out["read_only"].update(_save_error(opt, disk / "ro"), made=(disk / "ro").exists())
    finally:
        torch.distributed.barrier()
        if mounted and rank == 0:
            subprocess.run(["umount", str(disk)], capture_output=True, check=False)
    return out


# ------------------------------------------------------------------------------ workers


def world4_worker(rank: int, world: int, folder: str) -> bytes:
    from canzona.runtime.dcp import save_sharded

    def save_toys() -> None:
        for strategy, optname in CASES:
            model = ToyModel()
            opt = _toy_opt(model, strategy, optname)
            _run(model, opt, range(SAVE_STEPS), rank)
            save_sharded(opt, Path(folder) / strategy)

    def save_tiny() -> list[str]:
        model, opt = tiny_opt(0, 2, 2)
        tiny_run(model, opt, range(SAVE_STEPS))
        save_sharded(opt, Path(folder) / "tiny")
        return sorted(p.name for p in (Path(folder) / "tiny").iterdir())

    cases = {"toys": attempt(save_toys), "files": attempt(save_tiny)}
    cases["dp4"] = attempt(_tiny_resume, folder, 4, 1)
    cases["dp2xtp2"] = attempt(_tiny_resume, folder, 2, 2)
    if _HAVE_TRANSFORMERS:
        cases["hf"] = attempt(_hf_dp2xtp2, folder)
    # FSDP2: save at dp_shard 4 and at dp_shard 2 x tp 2, each resumed at the other layout
    cases["fsdp4_save"] = attempt(_save_then, lambda: _fsdp("dp_shard4"), folder, "fsdp4")
    cases["fsdp22_save"] = attempt(_save_then, lambda: _fsdp("dp_shard2_tp2"), folder, "fsdp22")
    cases["fsdp4_to_fsdp22"] = attempt(_resume, lambda: _fsdp("dp_shard2_tp2"), folder, "fsdp4")
    cases["fsdp22_to_fsdp4"] = attempt(_resume, lambda: _fsdp("dp_shard4"), folder, "fsdp22")
    return pack({"cases": cases})


def world2_worker(rank: int, world: int, folder: str) -> bytes:
    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint
    from canzona.runtime.dcp import load_sharded

    def toy_resume(strategy: str, optname: str) -> dict:
        model = ToyModel(seed=5)
        opt = _toy_opt(model, strategy, optname)
        load_sharded(opt, Path(folder) / strategy)
        _run(model, opt, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS), rank)
        return params_of(model)

    cases = {strategy: attempt(toy_resume, strategy, optname) for strategy, optname in CASES}
    cases["tiny_dp2"] = attempt(_tiny_resume, folder, 2, 1)
    cases["tiny_dp1xtp2"] = attempt(_tiny_resume, folder, 1, 2)

    # ---- refusals on the ZeRO-1 path: one CheckpointError, in-memory state untouched
    def sharded(d):
        return lambda o: load_sharded(o, d)

    def trained_toy(strategy: str, optname: str, **kw):
        model = ToyModel(seed=7, **kw)
        opt = _toy_opt(model, strategy, optname)
        _run(model, opt, range(1), rank)
        return opt

    cases["wrong_optimizer"] = attempt(lambda: load_refused(trained_toy("lb-asc-joint", "shampoo"), sharded(Path(folder) / "lb-asc-joint")))
    cases["other_model"] = attempt(lambda: load_refused(trained_toy("lb-asc-joint", "soap", ffn=12), sharded(Path(folder) / "lb-asc-joint")))
    cases["not_a_checkpoint"] = attempt(lambda: load_refused(trained_toy("lb-asc", "muon"), sharded(Path(folder))))
    cases["truncated"] = attempt(lambda: load_refused(trained_toy("zero1", "adamw"), sharded(_damaged(folder, "zero1", "truncated", "truncate"))))
    cases["corrupt"] = attempt(lambda: load_refused(trained_toy("zero1", "adamw"), sharded(_damaged(folder, "zero1", "corrupt", "overwrite"))))

    def single_truncated() -> dict:
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
        return load_refused(trained_toy("lb-asc", "muon"), lambda o: load_checkpoint(o, Path(folder) / "single-truncated.pt"))

    cases["single_truncated"] = attempt(single_truncated)

    # ---- FSDP2 at dp_shard 2, and across the two engines (the same FSDPToy, the same names)
    cases["fsdp2_save"] = attempt(_save_then, lambda: _fsdp("dp_shard2"), folder, "fsdp2")
    cases["fsdp2_to_fsdp2"] = attempt(_resume, lambda: _fsdp("dp_shard2"), folder, "fsdp2")
    cases["zero1_save"] = attempt(_save_then, _zero1_toy, folder, "zero1-toy")
    cases["zero1_to_fsdp2"] = attempt(_resume, lambda: _fsdp("dp_shard2"), folder, "zero1-toy")
    cases["fsdp2_to_zero1"] = attempt(_resume, _zero1_toy, folder, "fsdp2")
    # the consolidated format across the engines too
    cases["zero1_single_save"] = attempt(_save_then, _zero1_toy, folder, "zero1-toy.pt")
    cases["zero1_to_fsdp2_single"] = attempt(_resume, lambda: _fsdp("dp_shard2"), folder, "zero1-toy.pt")
    cases["fsdp4_to_fsdp2"] = attempt(_resume, lambda: _fsdp("dp_shard2"), folder, "fsdp4")
    cases["fsdp22_to_fsdp2"] = attempt(_resume, lambda: _fsdp("dp_shard2"), folder, "fsdp22")
    refusals = attempt(_fsdp_refusals, folder)
    for key in FSDP_REFUSALS:
        cases[key] = {"result": refusals["result"][key]} if "result" in refusals else refusals
    cases["bounded"] = attempt(_bounded_load, folder)
    attacks = attempt(_dcp_attacks, folder)
    for key in DCP_ATTACKS:
        cases[key] = {"result": attacks["result"][key]} if "result" in attacks else attacks
    # torch's DCP with the optimizer as a Stateful, across the engines; accelerate's round trip
    cases["dcp_zero1_save"] = attempt(_save_then, _zero1_toy, folder, "dcp-zero1")
    cases["dcp_fsdp2_save"] = attempt(_save_then, lambda: _fsdp("dp_shard2"), folder, "dcp-fsdp2")
    cases["stateful_zero1_to_fsdp2"] = attempt(_resume, lambda: _fsdp("dp_shard2"), folder, "dcp-zero1")
    cases["stateful_fsdp2_to_zero1"] = attempt(_resume, _zero1_toy, folder, "dcp-fsdp2")
    cases["stateful_fsdp2_to_fsdp2"] = attempt(_resume, lambda: _fsdp("dp_shard2"), folder, "dcp-fsdp2")
    cases["roundtrip_zero1"] = attempt(_roundtrip, _zero1_toy)
    cases["roundtrip_fsdp2"] = attempt(_roundtrip, lambda: _fsdp("dp_shard2"))
    cases["one_rank_zero1"] = attempt(_one_rank_calls, _zero1_toy)
    cases["one_rank_fsdp2"] = attempt(_one_rank_calls, lambda: _fsdp("dp_shard2"))
    cases["partly_zero1"] = attempt(_partly_loaded, _zero1_toy, folder, "partly-zero1")
    cases["partly_fsdp2"] = attempt(_partly_loaded, lambda: _fsdp("dp_shard2"), folder, "partly-fsdp2")
    cases["torch_api_zero1"] = attempt(_torch_state_api, _zero1_toy)
    cases["torch_api_fsdp2"] = attempt(_torch_state_api, lambda: _fsdp("dp_shard2"))
    saves = attempt(_failed_saves, folder)
    for key in ("not_a_folder", "full", "read_only"):
        cases[f"save_{key}"] = {"result": saves["result"][key]} if "result" in saves else saves
    return pack({"cases": cases})


#: planted code and damaged directories -> what the one-line refusal says
DCP_ATTACKS = {
    "planted_shell": ".metadata holds",
    "planted_resealed": "refers to posix.system, which DCP metadata never holds",
    "planted_then_metadata": "operator.getitem, which DCP metadata never holds",
    "flip_master": "fails its checksum",
    "flip_model": "fails its checksum",
    "flip_exp_avg": "fails its checksum",
    "fsdp_flip_master": "fails its checksum",
    "extra_file": "__2_0.distcp is not one of the sealed files",
    "missing_file": "sealed file __1_0.distcp is missing",
    "other_save_file": "__1_0.distcp fails its checksum",
}


FSDP_REFUSALS = {
    "fsdp_wrong_optimizer": "written by matrix_optimizer 'Muon'",
    "fsdp_other_model": "checkpoint parameters differ from the model's",
    "fsdp_truncated": "(truncated, or from another save)",
    "fsdp_corrupt": "fails its checksum",
    "fsdp_single_wrong_optimizer": "written by matrix_optimizer 'Muon'",
    "fsdp_single_other_model": "checkpoint parameters differ from the model's",
    "fsdp_single_truncated": "not a readable checkpoint",
}


# ------------------------------------------------------------------------------ references


def _toy_reference(strategy: str, optname: str) -> dict[str, torch.Tensor]:
    model = ToyModel()
    ref = ReferenceRunner(model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1")
    for s in range(SAVE_STEPS + MORE_STEPS):
        world = 4 if s < SAVE_STEPS else 2
        ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(world)]))
    return ref.params()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dcp")


_RUNS: dict[int, list[dict]] = {}


def _case(world: int, folder: Path, case: str) -> list:
    """Every rank's result of one case; the world-2 run reads what the world-4 run saved."""
    if 4 not in _RUNS:
        _RUNS[4] = [unpack(r) for r in run_workers(world4_worker, 4, str(folder), timeout_s=300)]
    if world == 2 and 2 not in _RUNS:
        _RUNS[2] = [unpack(r) for r in run_workers(world2_worker, 2, str(folder), timeout_s=300)]
    return case_results(_RUNS[world], "cases", case)


# ------------------------------------------------------------------------------ tests


def test_each_rank_writes_its_own_file(folder: Path) -> None:
    res = _case(4, folder, "files")
    assert res[0] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "canzona.checksums.json"]
    sizes = [(folder / "tiny" / f"__{r}_0.distcp").stat().st_size for r in range(4)]
    # nothing is gathered: no rank's file holds (nearly) everything
    assert max(sizes) < 0.6 * sum(sizes), sizes


@pytest.mark.parametrize("layout", ["dp4", "dp2xtp2"])
def test_dp2xtp2_checkpoint_resumes_at_world4_bitwise(folder: Path, layout: str) -> None:
    want = tiny_reference(4 if layout == "dp4" else 2).params()
    for rank, r in enumerate(_case(4, folder, layout)):
        assert tensors_equal(want, r) == [], f"resumed as {layout}, rank {rank}"


@pytest.mark.parametrize("layout,dp", [("tiny_dp2", 2), ("tiny_dp1xtp2", 1)])
def test_dp2xtp2_checkpoint_resumes_at_world2_bitwise(folder: Path, layout: str, dp: int) -> None:
    want = tiny_reference(dp).params()
    for rank, r in enumerate(_case(2, folder, layout)):
        assert tensors_equal(want, r) == [], f"resumed as {layout}, rank {rank}"


@pytest.mark.parametrize("strategy,optname", CASES)
def test_dp4_checkpoint_resumes_at_dp2_bitwise(folder: Path, strategy: str, optname: str) -> None:
    _case(4, folder, "toys")
    want = _toy_reference(strategy, optname)
    for rank, r in enumerate(_case(2, folder, strategy)):
        assert tensors_equal(want, r) == [], f"{strategy} resumed at DP2, rank {rank}"


def test_dcp_tools_read_the_checkpoint(folder: Path, tmp_path: Path) -> None:
    """DCP's own converter turns the directory into full tensors: the masters and optimizer state
    of the one-process run after the saved steps, the model's parameters under their own names."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _case(4, folder, "files")
    out = tmp_path / "full.pt"
    dcp_to_torch_save(folder / "tiny", out)
    doc = torch.load(out, weights_only=True)
    ref = tiny_reference(2, SAVE_STEPS)
    masters, states = ref.master_values(), ref.states()
    for n, m in masters.items():
        assert torch.equal(doc[f"optim.{n}.master"], m), n
        assert torch.equal(doc[f"model.{n}"], m), n
        for k, v in states[n].items():
            assert torch.equal(doc[f"optim.{n}.state.{k}"], v), f"{n}.{k}"


@pytest.mark.skipif(not _HAVE_TRANSFORMERS, reason="transformers is not installed")
def test_hf_model_dp2xtp2_with_a_sharded_resume_bitwise(folder: Path) -> None:
    from canzona.optim import Muon
    from validation.harness import tp_cut

    model = _hf_model()
    ref = ReferenceRunner(model, Muon, MATRIX_KW, torch.optim.AdamW, EW_KW)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for s in range(HF_STEPS):
        ref.step(mean_grads([integer_grads(shapes, step=s, rank=r, seed=3) for r in range(2)]))
    want = ref.params()
    for rank, got in enumerate(_case(4, folder, "hf")):
        assert got["tp_dims"], "transformers' TP plan must shard some parameters"
        assert tensors_equal(tp_cut(want, got["tp_dims"], got["tp_rank"], 2), got["params"]) == [], f"rank {rank}"


@pytest.mark.parametrize(
    "case,expect",
    [
        ("wrong_optimizer", "written by matrix_optimizer 'SOAP'"),
        ("other_model", "checkpoint holds shape"),
        ("not_a_checkpoint", "not a sharded checkpoint directory"),
        ("truncated", "(truncated, or from another save)"),
        ("corrupt", "fails its checksum"),
        ("single_truncated", "not a readable checkpoint"),
        *FSDP_REFUSALS.items(),
    ],
)
def test_bad_checkpoints_are_refused_and_change_nothing(folder: Path, case: str, expect: str) -> None:
    for rank, r in enumerate(_case(2, folder, case)):
        assert expect in r["error"], f"rank {rank}: {r['error']}"
        assert "\n" not in r["error"], "one line"
        assert r["untouched"], f"{case}: rank {rank} changed its masters, state or model"


#: FSDP2 and cross-engine resumes: case -> (world, data-parallel size before and after the save)
FSDP_RESUMES = {
    "fsdp2_to_fsdp2": (2, (2, 2)),
    "zero1_to_fsdp2": (2, (2, 2)),
    "fsdp2_to_zero1": (2, (2, 2)),
    "zero1_to_fsdp2_single": (2, (2, 2)),
    "fsdp4_to_fsdp2": (2, (4, 2)),
    "fsdp22_to_fsdp2": (2, (2, 2)),
    "fsdp4_to_fsdp22": (4, (4, 2)),
    "fsdp22_to_fsdp4": (4, (2, 4)),
    # dcp.save / dcp.load with the optimizer as a Stateful; load_state_dict(state_dict()) round trips
    "stateful_zero1_to_fsdp2": (2, (2, 2)),
    "stateful_fsdp2_to_zero1": (2, (2, 2)),
    "stateful_fsdp2_to_fsdp2": (2, (2, 2)),
    "roundtrip_zero1": (2, (2, 2)),
    "roundtrip_fsdp2": (2, (2, 2)),
}


@pytest.mark.parametrize("case", list(FSDP_RESUMES))
def test_fsdp2_sharded_resume_is_bitwise_in_parameters_and_every_state_entry(folder: Path, case: str) -> None:
    """Saved on one layout (FSDP2 dp_shard 2 / 4 / 2 x tp 2, or canzona's ZeRO-1 dp 2; sharded, and
    one consolidated file), loaded on another, MORE_STEPS more steps: parameters, masters and every optimizer-state entry equal one
    uninterrupted process's (validation.fsdp_harness.compare_with_reference: torch.equal)."""
    from validation.fsdp_harness import compare_with_reference

    world, dps = FSDP_RESUMES[case]
    if world == 2:
        _case(4, folder, "fsdp4_save")
        _case(4, folder, "fsdp22_save")
    res = _case(world, folder, case)
    assert all(r["steps"] == SAVE_STEPS + MORE_STEPS for r in res)
    assert compare_with_reference(res[0]["params"], res[0]["doc"], _fsdp_reference(dps)) == []
    for rank, r in enumerate(res[1:], 1):
        assert tensors_equal(res[0]["params"], r["params"]) == [], f"rank {rank} ended with other parameters"


def test_fsdp2_checkpoint_is_chunked_and_read_by_dcp_tools(folder: Path, tmp_path: Path) -> None:
    """Every stored chunk of the dp_shard 2 checkpoint is at most CHUNK bytes (or one row), and
    DCP's converter turns it into the one-process run's masters, state and parameters."""
    import math

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _case(2, folder, "fsdp2_save")
    md = FileSystemReader(str(folder / "fsdp2")).read_metadata()
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and key != "canzona.meta" and len(item.size) > 0:
            es = torch.empty((), dtype=item.properties.dtype).element_size()
            row = math.prod(item.size[1:]) * es
            for c in item.chunks:
                assert math.prod(c.sizes) * es <= max(CHUNK, row), (key, c)
    out = tmp_path / "full.pt"
    dcp_to_torch_save(folder / "fsdp2", out)
    doc = torch.load(out, weights_only=True)
    from canzona.optim import Muon
    from validation.fsdp_harness import FSDPToy

    ref = ReferenceRunner(FSDPToy(), Muon, FSDP_KW, torch.optim.AdamW, EW_KW)
    for s in range(SAVE_STEPS):
        ref.step(mean_grads([integer_grads(_fsdp_shapes(), step=s, rank=r) for r in range(2)]))
    states = ref.states()
    for n, m in ref.master_values().items():
        assert torch.equal(doc[f"optim.{n}.master"], m), n
        assert torch.equal(doc[f"model.{n}"], m), n
        for k, v in states[n].items():
            assert torch.equal(doc[f"optim.{n}.state.{k}"], v), f"{n}.{k}"


def test_sharded_load_is_bounded_by_the_chunk_size(folder: Path) -> None:
    """Loading the tiny Qwen3 with 4 KiB chunks: DCP never materialises a stored item larger than
    the cap, the loader's scratch buffer is at most the cap, a trained optimizer's state is
    written in place (nothing new allocated) and a fresh one allocates exactly its state once;
    the cap is far below the owned state, so a full copy would break the bound. The control (a
    checkpoint saved one chunk per tensor) shows the spy sees DCP's items."""
    for rank, r in enumerate(_case(2, folder, "bounded")):
        cap, owned = r["cap"], r["owned"]
        assert owned > 20 * cap, (owned, cap)
        for key in ("trained", "fresh"):
            got = r[key]
            assert got["items"] > 0 and got["largest_item"] <= cap, (rank, key, got)
            assert got["scratch_bytes"] <= cap, (rank, key, got)
            assert got["fresh_bytes"] <= 1024, (rank, key, got)
        assert r["trained"]["new_state_bytes"] == 0, r["trained"]
        assert 0 < r["fresh"]["new_state_bytes"] <= owned, r["fresh"]
        assert r["control"]["largest_item"] > 4 * cap, r["control"]


@pytest.mark.parametrize("case,expect", list(DCP_ATTACKS.items()))
def test_planted_code_and_damaged_files_are_refused_on_every_rank(folder: Path, case: str, expect: str) -> None:
    """A ``.metadata`` whose unpickling runs ``os.system`` (with the seal left alone, with the seal
    rewritten to match, and a variant that then yields the real metadata), a flipped byte in a
    master, a model entry and an AdamW ``exp_avg`` (ZeRO-1 and FSDP2), an extra file, a missing
    file and a data file of another save: one line on both ranks, nothing changed, nothing run."""
    for rank, r in enumerate(_case(2, folder, case)):
        assert expect in r["error"], f"rank {rank}: {r['error']}"
        assert "\n" not in r["error"], "one line"
        assert r["untouched"], f"{case}: rank {rank} changed its masters, state or model"
        if case.startswith("planted"):
            assert not r["ran"], f"{case}: the planted command ran on rank {rank}"


def test_a_sharded_save_to_a_read_only_folder_names_the_path_and_cause(folder: Path) -> None:
    res = _case(2, folder, "save_read_only")
    if not res[0]["tmpfs"]:
        pytest.skip("no tmpfs could be mounted here (needs root); the folder and full-disk cases still ran")
    for rank, r in enumerate(res):
        assert "small-disk/ro failed: rank 0 failed writing: " in r["error"] and "Read-only file system" in r["error"], f"rank {rank}: {r['error']}"
        assert not r["tmp_left"] and not r["made"], r


@pytest.mark.parametrize("case", ["save_not_a_folder", "save_full"])
def test_a_failed_sharded_save_names_the_path_and_cause_and_leaves_nothing(folder: Path, case: str) -> None:
    cause = {"save_not_a_folder": "rank 0 failed writing: NotADirectoryError", "save_full": "failed writing: OSError: [Errno 28] No space left on device"}[case]
    for rank, r in enumerate(_case(2, folder, case)):
        assert r["error"].startswith("saving the sharded checkpoint ") and cause in r["error"], f"rank {rank}: {r['error']}"
        assert ("a-plain-file/ckpt" if case == "save_not_a_folder" else "/full ") in r["error"], r["error"]
        assert "\n" not in r["error"] and not r["tmp_left"], r
        if case == "save_full":
            assert r["old_intact"] and r["old_loads"], r


@pytest.mark.parametrize("engine", ["zero1", "fsdp2"])
def test_a_collective_called_on_one_rank_raises_there_in_bounded_time_and_tells_the_other(folder: Path, engine: str) -> None:
    first, second = _case(2, folder, f"one_rank_{engine}")
    assert "rank(s) [1] did not call it within 3 s" in first["error"] and first["elapsed"] < 3.0 + 2.0, first
    assert "rank 0 (in state_dict()) stopped waiting for this call" in second["error"] and second["elapsed"] < 1.0, second
    assert first["after"] == second["after"] == ["canzona.format"], "the process group works afterwards"


@pytest.mark.parametrize("engine", ["zero1", "fsdp2"])
def test_a_refused_stateful_load_refuses_every_later_step_until_a_good_load(folder: Path, engine: str) -> None:
    for rank, r in enumerate(_case(2, folder, f"partly_{engine}")):
        assert r["lr_keys"] >= 1, r
        assert "lr" in r["load"] and "dcp.load had already written into this optimizer's tensors" in r["load"], f"rank {rank}: {r['load']}"
        for what in ("step", "save"):
            assert "left this optimizer partly loaded" in r[what] and "\n" not in r[what], f"rank {rank} {what}: {r[what]}"
        assert r["steps_refused_at"] == 3, "the refused step must not count"
        assert "saved (dcp.save) from an optimizer whose state a failed step or a refused load" in r["unloadable"], r["unloadable"]
        assert r["resumed_equal"], f"rank {rank}: after a good load the run must go on bitwise"


@pytest.mark.parametrize("engine", ["zero1", "fsdp2"])
def test_torch_optimizer_state_dict_api_is_refused_with_the_working_path_and_changes_nothing(folder: Path, engine: str) -> None:
    for rank, r in enumerate(_case(2, folder, f"torch_api_{engine}")):
        for key in ("get", "set"):
            assert "cannot serve it" in r[key] and "dcp.save({'model': model_sd, 'optim': opt})" in r[key], f"rank {rank} {key}: {r[key]}"
            assert "\n" not in r[key]
        assert r["steps"] == 1 and r["untouched"], "torch's zero-gradient initialization step must not run"
