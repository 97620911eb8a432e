"""Checkpoints: save at DP=2, load at DP=1 and DP=4, continue bitwise equal to an uninterrupted run.

Also: the tiny Qwen3 model saved under DP2 x TP2 (DTensor TP, LPT micro-groups: TP shards and
host-held full-shape state) resumes bitwise under DP2 x TP2 and under pure DP4 (no TP).

The uninterrupted run is one process running the same optimizers on the same reduced gradients
(integers times 2**-4: any reduction order and any DP size give the exact mean): three steps with
the two-rank means, then two with the means of the resuming world. The resumed models start from
a different random initialization, so equality also shows the checkpoint restored the parameters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from canzona.optimizers import get_optimizer
from canzona.runtime.launch import file_init_method, process_group, run_workers
from harness import attempt, case_results, load_refused
from validation.harness import ReferenceRunner, ToyModel, inject_grads, integer_grads, mean_grads, pack, params_of, tensors_equal, unpack

from tiny_qwen3 import EW_KW, MATRIX_KW, MORE_STEPS, SAVE_STEPS, full_params, tiny_opt, tiny_reference, tiny_run

pytestmark = pytest.mark.slow

CASES = (("lb-asc", "muon"), ("zero1", "adamw"), ("layerwise", "shampoo"), ("lb-asc-joint", "soap"))


def _cls(name: str) -> type[torch.optim.Optimizer]:
    return get_optimizer(name).load()


def _opt(model, strategy: str, optname: str):
    import canzona

    return canzona.DistributedOptimizer(
        model, optname, strategy=strategy, optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW, bucket_numel=40
    )


def _save_case(rank: int, folder: str, strategy: str, optname: str) -> None:
    from canzona.runtime.checkpoint import save_checkpoint

    model = ToyModel()
    opt = _opt(model, strategy, optname)
    for s in range(SAVE_STEPS):
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        opt.zero_grad()
    save_checkpoint(opt, Path(folder) / f"{strategy}.pt")


def save_worker(rank: int, world: int, folder: str) -> bytes:
    cases = {strategy: attempt(_save_case, rank, folder, strategy, optname) for strategy, optname in CASES}
    return pack({"cases": cases})


def _resume_case(rank: int, folder: str, strategy: str, optname: str) -> dict:
    from canzona.runtime.checkpoint import load_checkpoint

    model = ToyModel(seed=5)
    opt = _opt(model, strategy, optname)
    load_checkpoint(opt, Path(folder) / f"{strategy}.pt")
    assert opt.steps == SAVE_STEPS
    out: dict = {}
    # a round trip through the new layout's owners reproduces the saved document
    again = opt.consolidated_state_dict()
    if rank == 0:
        saved = torch.load(Path(folder) / f"{strategy}.pt", weights_only=True)
        out["roundtrip"] = tensors_equal(saved["params"], again["params"]) + [
            f"{n}.{k}"
            for n, st in saved["state"].items()
            for k, v in st.items()
            if not (torch.equal(v, again["state"][n][k]) if torch.is_tensor(v) else v == again["state"][n][k])
        ]
    for s in range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS):
        inject_grads(model, integer_grads(model, step=s, rank=rank))
        opt.step()
        opt.zero_grad()
    out["params"] = params_of(model)
    return out




def _wrong_optimizer(rank: int, folder: str) -> dict:
    from canzona.runtime.checkpoint import load_checkpoint

    return load_refused(_opt(ToyModel(), "lb-asc", "shampoo"), lambda o: load_checkpoint(o, Path(folder) / "lb-asc.pt"))


def _junk(rank: int, folder: str) -> dict:
    from canzona.runtime.checkpoint import load_checkpoint

    junk = Path(folder) / "junk.pt"
    torch.save({"hello": torch.zeros(1)}, junk)
    return load_refused(_opt(ToyModel(), "lb-asc", "muon"), lambda o: load_checkpoint(o, junk))


def _bad_state(rank: int, folder: str) -> dict:
    """A mis-shaped state of the last parameter is refused before any master is written."""
    fresh = _opt(ToyModel(seed=7), "zero1", "adamw")
    bad = torch.load(Path(folder) / "zero1.pt", weights_only=True)
    last = list(fresh.plan.buffer_order())[-1].name
    bad["state"][last]["exp_avg"] = bad["state"][last]["exp_avg"].reshape(-1)[1:]
    return load_refused(fresh, lambda o: o.load_state_dict(bad))


REFUSALS = {
    "wrong_optimizer": (_wrong_optimizer, "written by matrix_optimizer 'Muon'"),
    "junk": (_junk, "not a canzona optimizer checkpoint"),
    "bad_state": (_bad_state, "state 'exp_avg' has shape"),
}


def resume_worker(rank: int, world: int, folder: str) -> bytes:
    cases = {strategy: attempt(_resume_case, rank, folder, strategy, optname) for strategy, optname in CASES}
    if world == 4:
        cases["tp"] = attempt(_tp_resume, rank, folder)
    if world == 1:
        cases.update({key: attempt(fn, rank, folder) for key, (fn, _) in REFUSALS.items()})
    return pack({"cases": cases})


# ------------------------------------------------------------------------------ TP shards re-sharded


def _tp_resume(rank: int, folder: str) -> dict:
    """Save the tiny Qwen3 under DP2 x TP2 (DTensor TP, micro-groups) after SAVE_STEPS; resume it
    under DP2 x TP2 and under pure DP4."""
    from canzona.runtime.checkpoint import load_checkpoint, save_checkpoint

    path = Path(folder) / "tp.pt"
    model, opt = tiny_opt(0, 2, 2)
    tiny_run(model, opt, range(SAVE_STEPS))
    save_checkpoint(opt, path)
    out = {}
    for key, dp, tp in (("dp2xtp2", 2, 2), ("dp4", 4, 1)):
        model, opt = tiny_opt(5, dp, tp)
        load_checkpoint(opt, path)
        tiny_run(model, opt, range(SAVE_STEPS, SAVE_STEPS + MORE_STEPS))
        out[key] = full_params(model)
    return out


def _reference(strategy: str, optname: str, resume_world: int) -> dict[str, torch.Tensor]:
    model = ToyModel()
    ref = ReferenceRunner(model, _cls(optname), MATRIX_KW, torch.optim.AdamW, EW_KW, all_elementwise=strategy == "zero1")
    for s in range(SAVE_STEPS + MORE_STEPS):
        world = 2 if s < SAVE_STEPS else resume_world
        ref.step(mean_grads([integer_grads(model, step=s, rank=r) for r in range(world)]))
    return ref.params()


# ------------------------------------------------------------------------------ one spawn per world


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """Save once at world 2 (the ToyModel cases), then resume at world 1 and world 4 (which also
    saves and resumes the TP case): one spawned group each, shared by every test of this module."""
    folder = tmp_path_factory.mktemp("ckpt")
    cache: dict[str, list[dict]] = {}

    def get(run: str, case: str) -> list:
        if run not in cache:
            if run == "save2":
                cache[run] = [unpack(r) for r in run_workers(save_worker, 2, str(folder), timeout_s=150)]
            else:
                get("save2", CASES[0][0])
                world = int(run.removeprefix("resume"))
                if world == 1:
                    # one rank needs no process of its own: this process joins a one-rank group
                    # (the refusal cases and the DP=1 resume run here, as in a single-GPU job)
                    rendezvous = tmp_path_factory.mktemp("rendezvous")
                    with process_group(file_init_method(rendezvous)):
                        cache[run] = [unpack(resume_worker(0, 1, str(folder)))]
                else:
                    cache[run] = [unpack(r) for r in run_workers(resume_worker, world, str(folder), timeout_s=240)]
        return case_results(cache[run], "cases", case)

    get.folder = folder  # type: ignore[attr-defined]
    return get


@pytest.mark.parametrize("strategy,optname", CASES)
def test_saved_document_is_plain_data(runs, strategy: str, optname: str) -> None:
    import json

    runs("save2", strategy)
    doc = torch.load(runs.folder / f"{strategy}.pt", weights_only=True)
    assert doc["format"] == "canzona.optimizer_state" and doc["meta"]["dp"] == 2 and doc["meta"]["steps"] == SAVE_STEPS
    assert doc["meta"]["engine"] == "dp" and doc["meta"]["matrix_optimizer"] == _cls(optname).__name__
    json.dumps(doc["meta"])  # metadata is JSON-able
    json.dumps(doc["hyper"])
    assert doc["hyper"]["elementwise"]["lr"] == EW_KW["lr"]


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("strategy,optname", CASES)
def test_resume_at_another_dp_size_bitwise(runs, world: int, strategy: str, optname: str) -> None:
    want = _reference(strategy, optname, world)
    for rank, r in enumerate(runs(f"resume{world}", strategy)):
        assert tensors_equal(want, r["params"]) == [], f"{strategy} resumed at DP={world}, rank {rank}"


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("strategy,optname", CASES)
def test_load_then_save_reproduces_the_document(runs, world: int, strategy: str, optname: str) -> None:
    assert runs(f"resume{world}", strategy)[0]["roundtrip"] == [], f"{strategy}: state changed in a load/save round trip at DP={world}"


@pytest.mark.parametrize("layout,dp", [("dp2xtp2", 2), ("dp4", 4)])
def test_tp_checkpoint_resumes_bitwise(runs, layout: str, dp: int) -> None:
    want = tiny_reference(dp).params()
    for rank, r in enumerate(runs("resume4", "tp")):
        assert tensors_equal(want, r[layout]) == [], f"TP checkpoint resumed as {layout}, rank {rank}"


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_with_one_error_and_nothing_changed(runs, case: str) -> None:
    (got,) = runs("resume1", case)
    assert REFUSALS[case][1] in got["error"], got["error"]
    assert "\n" not in got["error"], "one line"
    assert got["untouched"], f"{case}: a refused checkpoint changed masters, state or the model"


# ------------------------------------------------------------------------------ every byte covered


class _TinyLinear(torch.nn.Module):
    """One matrix (Muon) and one bias (AdamW): the smallest document with both roles' state."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)


def _tensor_data_ranges(raw: bytes) -> list[tuple[int, int]]:
    """Byte ranges of the tensor storages (``archive/data/<n>`` records) in a torch.save file."""
    import io
    import struct
    import zipfile

    out = []
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        for info in z.infolist():
            if "/data/" in info.filename:
                off = info.header_offset
                name_len, extra_len = struct.unpack("<HH", raw[off + 26 : off + 30])
                start = off + 30 + name_len + extra_len
                out.append((start, start + info.compress_size))
    return out


def _same(a, b) -> bool:
    """Equal content: the same types, keys, numbers (bit for bit), strings and tensors."""
    if type(a) is not type(b):
        return False
    if torch.is_tensor(a):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        flat = [torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8) for t in (a, b)]
        return torch.equal(*flat)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a.hex() == b.hex()
    return a == b


def test_every_flipped_byte_outside_the_tensor_data_is_refused_or_changes_nothing(tmp_path: Path) -> None:
    """A consolidated checkpoint of a 3-step run, every byte outside the tensor storages flipped
    (low bit) in turn: the pickle (hyperparameters, step counts, key names, structure) and the zip
    records. Each flipped file must fail torch.load or verify_document, or load a document equal
    to the original; before the document digest, flips that turned ``ns_steps`` 5 into 4, an lr,
    a beta or ``maximize`` loaded silently."""
    import io
    import warnings

    import canzona
    from canzona.runtime.checkpoint import verify_document

    with process_group(file_init_method(tmp_path)):
        model = _TinyLinear()
        opt = canzona.DistributedOptimizer(model, "muon", strategy="lb-asc", optimizer_kwargs=MATRIX_KW, elementwise_kwargs=EW_KW)
        for s in range(3):
            inject_grads(model, integer_grads(model, step=s, rank=0))
            opt.step()
            opt.zero_grad()
        doc = opt.consolidated_state_dict()
    buf = io.BytesIO()
    torch.save(doc, buf)
    raw = buf.getvalue()
    original = torch.load(io.BytesIO(raw), weights_only=True)
    verify_document(original)
    skip = _tensor_data_ranges(raw)
    assert skip and sum(b - a for a, b in skip) < len(raw) // 4, "the tensor data is a small part of the file"
    loaded_different, refused, same = [], 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for pos in range(len(raw)):
            if any(a <= pos < b for a, b in skip):
                continue
            flipped = bytearray(raw)
            flipped[pos] ^= 0x01
            try:
                got = torch.load(io.BytesIO(bytes(flipped)), weights_only=True)
                verify_document(got)
            except Exception:  # noqa: BLE001 - any refusal is a refusal
                refused += 1
                continue
            if _same(got, original):
                same += 1
            else:
                loaded_different.append(pos)
    assert loaded_different == [], f"{len(loaded_different)} flips loaded a different document, first at bytes {loaded_different[:5]}"
    assert refused > 1000, (refused, same)
