"""Consolidated optimizer checkpoints that resume bitwise and re-shard to any DP size.

Format (``format = "canzona.optimizer_state"``, ``version = 2``): one ``torch.save`` document
holding only tensors, numbers, strings, bools, None, lists, tuples and dicts, so it loads with
``torch.load(..., weights_only=True)``::

    {
      "format": "canzona.optimizer_state", "version": 1,
      "meta": {                                  # JSON-able
        "strategy", "dp", "tp", "fingerprint", "plan_inputs": {...}, "steps",
        "matrix_optimizer", "elementwise_optimizer", "master_dtype",
        "params": {name: {"shape": [...], "kind": "matrix" | "elementwise", "tp_dim": int | None}},
      },
      "params": {name: full-shape master value (master dtype)},
      "state":  {name: {key: tensor | number}},  # what a single-device optimizer would hold for
                                                 # the full parameter: element-wise pieces and TP
                                                 # shards reassembled, matrix state full-shape
      "hyper":  {"matrix": {...}, "elementwise": {...}},   # param-group hyperparameters
      "checksums": {"params": {name: int}, "state": {name: {key: int}}},   # 62-bit, per tensor
    }

Integrity (issue 17): every tensor of ``params`` and ``state`` has a checksum
(:func:`canzona.runtime.integrity.tensor_checksum`) that loading verifies, so a flipped byte is
refused with an error naming the tensor; files are written atomically
(:func:`canzona.runtime.integrity.atomic_write`: the old file survives a failed save). Before
anything is written, loading also refuses: masters whose dtype is not the optimizer's
``master_dtype`` (a float64 master in an fp32 run), non-finite values in masters or state, and
hyperparameters out of range (non-finite numbers, ``lr`` or ``weight_decay`` < 0, ``eps`` <= 0,
``betas``/``momentum`` outside [0, 1)). The saved hyperparameters **override** the constructor's:
every saved param-group value (``lr``, ``weight_decay``, ``betas``, ``momentum`` ...) that the
inner optimizers also have is restored, as ``torch.optim.Optimizer.load_state_dict`` restores its
param groups; to change one after resuming, set it in ``opt.param_groups`` (``lr``,
``weight_decay``) after loading.

Errors reach every rank: saving and loading each join a status exchange
(:func:`canzona.runtime.agree.agree`), so a rank that cannot read the file, a document refused on
one rank, or a failed write on rank 0 raises on every rank within seconds, naming the rank.

The document is *consolidated per parameter name* and independent of the plan it was written
under: :func:`consolidated_state_dict` gathers every owner's pieces to world rank 0 (one
``gather_object``; the whole state passes through rank 0's memory), and
:func:`load_consolidated_state_dict` lets every rank pick what its own (possibly different) plan
makes it own, writes the masters, the optimizer state and the model parameters, and re-assembles
the TP hosts' full masters. Saving at DP=2 and loading at DP=1 or DP=4 therefore continues exactly
as an uninterrupted run would (tests/test_checkpoint.py checks it bitwise).

Element-wise optimizer state is re-sliced like the parameter (tensors of the piece's shape);
0-dim tensors and numbers (step counters) are copied to every piece. A state tensor of any other
shape on a cut piece cannot be re-sliced and is refused with an error naming it.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from canzona.runtime.comm import Comm
from canzona.runtime.agree import RankFailure, agree
from canzona.runtime.buffer import local_tensor
from canzona.runtime.dp import elementwise_role
from canzona.runtime.integrity import atomic_write, tensor_checksum

if TYPE_CHECKING:  # pragma: no cover
    from canzona.distributed import DistributedOptimizer

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "check_hyperparams",
    "checksums",
    "consolidated_state_dict",
    "load_checkpoint",
    "load_consolidated_state_dict",
    "save_checkpoint",
]

FORMAT = "canzona.optimizer_state"
VERSION = 2


class CheckpointError(ValueError):
    """A checkpoint that does not fit this optimizer (format, parameters, optimizer classes)."""


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def _hyper(opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    if opt is None:
        return {}
    g = opt.param_groups[0]
    return {k: v for k, v in g.items() if k != "params" and _jsonable(v)}


def _exports(dopt: DistributedOptimizer) -> dict[str, Any]:
    """This rank's share of the consolidated document (canonical copies only)."""
    rt = dopt.runtime
    # every DP rank holds the same values under sc: DP rank 0's copy is canonical
    replica = rt.plan.every_rank_updates and rt.dp_rank != 0
    pieces: list[dict[str, Any]] = []
    for pc in () if replica else rt.pieces:
        spec = rt.specs[pc.name]
        if not spec.tp_split and dopt.tp_rank != 0:
            continue  # replicated across TP: TP rank 0's copy is canonical
        master = rt.masters[pc]
        entry: dict[str, Any] = {
            "name": pc.name,
            "tp_rank": dopt.tp_rank,
            "start": pc.start,
            "end": pc.end,
            "role": pc.role,
            "master": _cpu(master).reshape(-1),
        }
        if pc.role == "elementwise":
            st = rt.elementwise_opt.state.get(master, {}) if rt.elementwise_opt is not None else {}
            sliced, scalar = {}, {}
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    if tuple(v.shape) != tuple(master.shape):
                        raise CheckpointError(
                            f"{pc.name}: element-wise optimizer state {k!r} has shape {tuple(v.shape)}, not the "
                            f"parameter's {tuple(master.shape)}; it cannot be re-sliced"
                        )
                    sliced[k] = _cpu(v).reshape(-1)
                else:
                    scalar[k] = _cpu(v) if torch.is_tensor(v) else v
            entry["sliced"], entry["scalar"] = sliced, scalar
        elif pc.role == "matrix":
            st = rt.matrix_opt.state.get(master, {}) if rt.matrix_opt is not None else {}
            entry["state"] = {k: (_cpu(v) if torch.is_tensor(v) else v) for k, v in st.items()}
        pieces.append(entry)
    tp_state: dict[str, Any] = {}
    eng = rt.tp_engine
    # TP hosts hold each task's state once; under the sync schedule every TP rank holds it: take TP rank 0's
    if eng is not None and not replica and (not eng.sync or dopt.tp_rank == 0):
        tp_state = {n: {k: (_cpu(v) if torch.is_tensor(v) else v) for k, v in st.items()} for n, st in eng.state_dict().items()}
    matrix_opt = rt.matrix_opt if rt.matrix_opt is not None else (eng.optimizer if eng is not None else None)
    return {
        "pieces": pieces,
        "tp_state": tp_state,
        "hyper": {"matrix": _hyper(matrix_opt), "elementwise": _hyper(rt.elementwise_opt)},
    }


def _meta(dopt: DistributedOptimizer) -> dict[str, Any]:
    inp = dopt.plan.inputs
    return {
        "strategy": inp.strategy,
        "dp": inp.dp,
        "tp": inp.tp,
        "fingerprint": dopt.plan.fingerprint,
        "plan_inputs": {f.name: getattr(inp, f.name) for f in fields(inp)},
        "steps": dopt.steps,
        "matrix_optimizer": dopt.matrix_cls.__name__,
        "elementwise_optimizer": dopt.elementwise_cls.__name__,
        "master_dtype": str(dopt.master_dtype).removeprefix("torch."),
        "params": {s.name: {"shape": list(s.shape), "kind": s.kind, "tp_dim": s.tp_dim} for s in dopt.plan.specs},
    }


def _assemble(spec: Any, parts: list[tuple[int, int, int, torch.Tensor]], what: str) -> torch.Tensor:
    """Full-shape tensor from (tp_rank, start, end, flat values) pieces of the TP-local shards."""
    tp = spec.tp if spec.tp_split else 1
    n = spec.local_numel
    dtype = parts[0][3].dtype
    shards = []
    for t in range(tp):
        flat = torch.empty(n, dtype=dtype)
        covered = 0
        for r, s, e, v in parts:
            if r == t:
                flat[s:e] = v
                covered += e - s
        if covered != n:
            raise CheckpointError(f"{spec.name}: {what} pieces of TP rank {t} cover {covered} of {n} elements")
        shards.append(flat.view(spec.local_shape))
    return torch.cat(shards, dim=spec.tp_dim) if tp > 1 else shards[0]


def consolidated_state_dict(dopt: DistributedOptimizer) -> dict[str, Any]:
    """Gather the optimizer's state into one plan-independent document on world rank 0.

    Collective over the world group. Rank 0 returns the document, other ranks an empty dict.
    """
    mine: dict[str, Any] = {}
    error: BaseException | None = None
    try:
        mine = _exports(dopt)
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    agree(error, "consolidating the optimizer state", device=_device(dopt), timeout_s=dopt.status_timeout_s, mark=True)
    rank = dist.get_rank()
    # through the byte-counting layer, so checkpoint traffic shows in comm_stats ("unphased")
    got = Comm(None, dopt.comm_stats).gather_object(mine, dst=0)
    if rank != 0:
        return {}
    assert got is not None
    by_name: dict[str, list[dict[str, Any]]] = {}
    tp_state: dict[str, Any] = {}
    hyper: dict[str, dict[str, Any]] = {"matrix": {}, "elementwise": {}}
    for share in got:
        for e in share["pieces"]:
            by_name.setdefault(e["name"], []).append(e)
        tp_state.update(share["tp_state"])
        for k, have in hyper.items():
            if not have and share["hyper"][k]:
                hyper[k] = share["hyper"][k]
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for spec in dopt.plan.specs:
        entries = by_name.get(spec.name, [])
        if not entries:
            raise CheckpointError(f"{spec.name}: no rank exported it (plan and runtime disagree)")
        params[spec.name] = _assemble(spec, [(e["tp_rank"], e["start"], e["end"], e["master"]) for e in entries], "master")
        role = entries[0]["role"]
        if role == "elementwise":
            st: dict[str, Any] = dict(entries[0]["scalar"])
            for k in entries[0]["sliced"]:
                st[k] = _assemble(spec, [(e["tp_rank"], e["start"], e["end"], e["sliced"][k]) for e in entries], f"state {k!r}")
            state[spec.name] = st
        elif role == "matrix":
            state[spec.name] = dict(entries[0]["state"])
        else:
            state[spec.name] = dict(tp_state.get(spec.name, {}))
    doc = {"format": FORMAT, "version": VERSION, "meta": _meta(dopt), "params": params, "state": state, "hyper": hyper}
    doc["checksums"] = checksums(doc)
    return doc


def _device(dopt: DistributedOptimizer) -> torch.device:
    """Where this rank's status exchange runs: the ZeRO-1 buffer's device, or (FSDP2 path, no
    canzona buffer) the model's."""
    buffer = getattr(dopt.runtime, "buffer", None)
    if buffer is not None:
        return buffer.data.device
    return next(dopt.model.parameters()).device


def checksums(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Per-tensor checksums of a document's ``params`` and ``state`` (see the module docstring)."""
    return {
        "params": {n: tensor_checksum(t) for n, t in doc["params"].items()},
        "state": {n: {k: tensor_checksum(v) for k, v in st.items() if torch.is_tensor(v)} for n, st in doc["state"].items()},
    }


def _check_integrity(dopt: DistributedOptimizer, doc: Mapping[str, Any]) -> None:
    """Checksums, master dtype, finiteness (the structure was checked before)."""
    sums = doc.get("checksums")
    if not isinstance(sums, Mapping) or not isinstance(sums.get("params"), Mapping) or not isinstance(sums.get("state"), Mapping):
        raise CheckpointError("checkpoint carries no checksums; it cannot be verified")
    for name, t in doc["params"].items():
        if t.dtype != dopt.master_dtype:
            raise CheckpointError(f"{name}: checkpoint master is {t.dtype}, this optimizer keeps {dopt.master_dtype} masters")
        if sums["params"].get(name) != tensor_checksum(t):
            raise CheckpointError(f"{name}: parameter value fails its checksum (the file is corrupt)")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{name}: parameter value holds NaN or inf")
    for name, st in doc["state"].items():
        saved = sums["state"].get(name, {})
        for k, v in st.items():
            if not torch.is_tensor(v):
                if isinstance(v, float) and not math.isfinite(v):
                    raise CheckpointError(f"{name}: optimizer state {k!r} is {v}")
                continue
            if not isinstance(saved, Mapping) or saved.get(k) != tensor_checksum(v):
                raise CheckpointError(f"{name}: optimizer state {k!r} fails its checksum (the file is corrupt)")
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise CheckpointError(f"{name}: optimizer state {k!r} holds NaN or inf")


#: hyperparameter ranges a saved param group must respect: key -> (low, high, high included)
_RANGES: dict[str, tuple[float, float, bool]] = {
    "lr": (0.0, math.inf, False),
    "weight_decay": (0.0, math.inf, False),
    "momentum": (0.0, 1.0, False),
    "dampening": (0.0, 1.0, True),
}


def check_hyperparams(where: str, values: Mapping[str, Any]) -> None:
    """Refuse saved hyperparameters that no optimizer would accept (CheckpointError naming them):
    non-finite numbers anywhere, ``lr``/``weight_decay`` < 0, ``eps`` <= 0, ``momentum`` outside
    [0, 1), ``betas`` entries outside [0, 1)."""
    for k, v in values.items():
        nums = list(v) if isinstance(v, (list, tuple)) else [v]
        for x in nums:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            if not math.isfinite(x):
                raise CheckpointError(f"checkpoint's {where} hyperparameter {k!r} is {v!r}, not finite")
        if k == "betas":
            if not isinstance(v, (list, tuple)) or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in v):
                raise CheckpointError(f"checkpoint's {where} betas {v!r} must be numbers in [0, 1)")
        elif k == "eps":
            if isinstance(v, (int, float)) and not v > 0:
                raise CheckpointError(f"checkpoint's {where} eps {v!r} must be > 0")
        elif k in _RANGES and isinstance(v, (int, float)) and not isinstance(v, bool):
            lo, hi, closed = _RANGES[k]
            if not (lo <= v and (v <= hi if closed else v < hi)):
                raise CheckpointError(f"checkpoint's {where} {k} {v!r} must be in [{lo:g}, {hi:g}{']' if closed else ')'}")


def _check_document(dopt: DistributedOptimizer, doc: Any) -> None:
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        raise CheckpointError(f"not a canzona optimizer checkpoint (format {doc.get('format') if isinstance(doc, Mapping) else type(doc).__name__!r})")
    if doc.get("version") != VERSION:
        raise CheckpointError(f"unsupported checkpoint version {doc.get('version')!r} (this canzona reads {VERSION})")
    for key in ("meta", "params", "state", "hyper"):
        if not isinstance(doc.get(key), Mapping):
            raise CheckpointError(f"checkpoint lacks its {key!r} section")
    meta = doc["meta"]
    for key, mine in (("matrix_optimizer", dopt.matrix_cls.__name__), ("elementwise_optimizer", dopt.elementwise_cls.__name__)):
        if meta.get(key) != mine:
            raise CheckpointError(f"checkpoint was written by {key} {meta.get(key)!r}, this optimizer runs {mine!r}")
    want = {s.name: s for s in dopt.plan.specs}
    have = doc["params"]
    if set(have) != set(want):
        raise CheckpointError(
            f"checkpoint parameters differ from the model's: missing {sorted(set(want) - set(have))[:3]}, "
            f"unexpected {sorted(set(have) - set(want))[:3]}"
        )
    kinds = {n: m.get("kind") for n, m in meta.get("params", {}).items()} if isinstance(meta.get("params"), Mapping) else {}
    for name, spec in want.items():
        if kinds.get(name) != spec.kind:
            raise CheckpointError(
                f"{name}: checkpoint treats it as {kinds.get(name)!r}, this optimizer as {spec.kind!r}; "
                "its optimizer state belongs to another optimizer"
            )
        t = have[name]
        if not torch.is_tensor(t) or tuple(t.shape) != spec.shape:
            raise CheckpointError(f"{name}: checkpoint holds shape {tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}, the model {spec.shape}")
        # Checked here for every parameter, not only for the pieces this rank loads: a rank that
        # failed half-way through the load would leave its masters half-written and the other ranks
        # waiting in the TP hosts' collective.
        st = doc["state"].get(name, {})
        if not isinstance(st, Mapping):
            raise CheckpointError(f"{name}: optimizer state is a {type(st).__name__}, not a mapping")
        if elementwise_role(dopt.plan, name):
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != spec.shape:
                    raise CheckpointError(f"{name}: state {k!r} has shape {tuple(v.shape)}, expected {spec.shape}")
    for key in ("matrix", "elementwise"):
        if not isinstance(doc["hyper"].get(key, {}), Mapping):
            raise CheckpointError(f"checkpoint's {key!r} hyperparameters are not a mapping")
        check_hyperparams(key, doc["hyper"].get(key, {}))
    if not isinstance(meta.get("steps", 0), int) or isinstance(meta.get("steps", 0), bool):
        raise CheckpointError(f"checkpoint's step count {meta.get('steps')!r} is not an integer")
    _check_integrity(dopt, doc)


def _local_flat(spec: Any, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of a full-shape tensor, flattened."""
    if spec.tp_split:
        full = full.chunk(spec.tp, dim=spec.tp_dim)[tp_rank]
    return full.reshape(-1)


def load_consolidated_state_dict(dopt: DistributedOptimizer, doc: Mapping[str, Any]) -> None:
    """Load a :func:`consolidated_state_dict` document on every rank, re-sharded to this plan.

    Every rank must pass the whole document. Restores masters, optimizer state (local optimizers
    and TP hosts), hyperparameters, the step count and the model's parameter values. Collective
    when TP-split matrix parameters exist (the TP hosts re-assemble their full masters).
    """
    error: BaseException | None = None
    try:
        _check_document(dopt, doc)
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    try:
        agree(error, "loading the checkpoint", device=_device(dopt), timeout_s=dopt.status_timeout_s, mark=True)
    except RankFailure:
        if error is not None:
            raise error from None  # this rank's own error says it best
        raise
    rt = dopt.runtime
    rt.finish_param_sync()  # a pending lazy all-gather must not overwrite the loaded values later
    tp_rank = dopt.tp_rank
    params, states = doc["params"], doc["state"]
    with torch.no_grad():
        for pc in rt.pieces:
            spec = rt.specs[pc.name]
            m = rt.masters[pc]
            flat = _local_flat(spec, params[pc.name], tp_rank)[pc.start : pc.end]
            m.copy_(flat.view(m.shape))
            st = states.get(pc.name, {})
            if pc.role == "elementwise" and rt.elementwise_opt is not None:
                new: dict[str, Any] = {}
                for k, v in st.items():
                    if torch.is_tensor(v) and v.dim() > 0:  # full-shape: _check_document checked it
                        new[k] = _local_flat(spec, v, tp_rank)[pc.start : pc.end].reshape(m.shape).to(m.device, copy=True)
                    else:
                        new[k] = v.clone().to(m.device) if torch.is_tensor(v) else v
                rt.elementwise_opt.state[m] = new
            elif pc.role == "matrix" and rt.matrix_opt is not None:
                rt.matrix_opt.state[m] = {k: (v.clone().to(m.device) if torch.is_tensor(v) else v) for k, v in st.items()}
        eng = rt.tp_engine
        if eng is not None:
            eng.refresh_masters()
            eng.load_state_dict({n: states.get(n, {}) for n in eng.hosted})
        for name, p in rt.params.items():
            local = local_tensor(p.detach())
            spec = rt.specs[name]
            local.copy_(_local_flat(spec, params[name], tp_rank).view(local.shape))
    hyper = doc["hyper"]
    matrix_opts = [o for o in (rt.matrix_opt, eng.optimizer if eng is not None else None) if o is not None]
    for opts, saved in ((matrix_opts, hyper.get("matrix", {})), ([rt.elementwise_opt] if rt.elementwise_opt else [], hyper.get("elementwise", {}))):
        for o in opts:
            for g in o.param_groups:
                for k, v in saved.items():
                    if k in g:
                        g[k] = v
    rt.steps = int(doc["meta"].get("steps", 0))
    rt.discard_grads()


def save_checkpoint(dopt: DistributedOptimizer, path: str | os.PathLike[str]) -> None:
    """Write the consolidated document to ``path`` from world rank 0 (collective; atomic rename).
    Goes through ``dopt.state_dict()``, so a scheduler's latest lr is what is saved."""
    doc = dopt.state_dict()
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            atomic_write(path, lambda f: torch.save(doc, f))
        except Exception as exc:  # noqa: BLE001 - every rank must learn that the save failed
            error = exc
    agree(error, f"saving the checkpoint {path}", device=_device(dopt), timeout_s=dopt.status_timeout_s, mark=True)


def load_checkpoint(dopt: DistributedOptimizer, path: str | os.PathLike[str]) -> None:
    """Read ``path`` on every rank (``weights_only=True``: data, not code) and load it. A rank that
    cannot read it raises its :class:`CheckpointError`, the others a ``RankFailure`` naming it."""
    error: CheckpointError | None = None
    doc: Any = None
    try:
        doc = torch.load(Path(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        error = CheckpointError(f"checkpoint not found: {path}")
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file must say so, not crash obscurely
        error = CheckpointError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {exc})")
    try:
        agree(error, f"reading the checkpoint {path}", device=_device(dopt), timeout_s=dopt.status_timeout_s, mark=True)
    except RankFailure:
        if error is not None:
            raise error from None
        raise
    dopt.load_state_dict(doc)  # restores the groups' lr / weight_decay too
