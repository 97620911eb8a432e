"""Consolidated optimizer checkpoints that resume bitwise and re-shard to any layout.

The contract with the front ends: :class:`Checkpointable`. Checkpoint code (this module and
:mod:`canzona.runtime.dcp`) reads an optimizer only through it: which parameters exist
(:class:`ParamRecord`), which regions of them this rank holds with their masters and optimizer
state (:class:`Held`), where the model keeps its values (:class:`ModelPiece`), the
hyperparameters, and a ``finish_load`` step. ``canzona.DistributedOptimizer`` implements it for
canzona's ZeRO-1 path and for FSDP2 models, so both formats serve both engines and a checkpoint
of one engine loads into the other. Saved hyperparameters come back in one place,
:func:`restore_hyperparams`.

Format (``format = "canzona.optimizer_state"``, ``version = 3``): one ``torch.save`` document
holding only tensors, numbers, strings, bools, None, lists, tuples and dicts, so it loads with
``torch.load(..., weights_only=True)``::

    {
      "format": "canzona.optimizer_state", "version": 2,
      "meta": {                                  # JSON-able
        "engine": "dp" | "fsdp2", "strategy", "dp", "tp", "fingerprint", "plan_inputs": {...},
        "steps", "matrix_optimizer", "elementwise_optimizer", "master_dtype",
        "params": {name: {"shape": [...], "kind": "matrix" | "elementwise", "tp_dim": int | None}},
      },
      "params": {name: full-shape master value (master dtype)},
      "state":  {name: {key: tensor | number}},  # what a single-device optimizer would hold for
                                                 # the full parameter: element-wise pieces and
                                                 # shards reassembled, matrix state full-shape
      "hyper":  {"matrix": {...}, "elementwise": {...}},   # the inner optimizers' hyperparameters
      "checksums": {"params": {name: int}, "state": {name: {key: int}}},   # 62-bit, per tensor
      "digest": str,                             # BLAKE2b-256 of everything above
    }

Integrity: ``digest`` (:func:`document_digest`) covers the whole document but itself, in a
canonical type-tagged encoding: hyperparameters, step counts, key names, container structure and
every tensor's dtype, shape and bytes. Loading checks it (:func:`verify_document`) before anything
else, so a file that unpickles to anything but what was saved is refused (the fuzz test in
tests/test_checkpoint.py flips every byte outside the tensor data of a saved file: each flip is
refused or loads the original document); where the cause is one tensor, the per-tensor
``checksums`` (:func:`canzona.runtime.integrity.tensor_checksum`) name it. Version-2 documents
(written before the digest) still load, with the weaker check they carry: their tensors are
verified, their numbers and names are not. Files are written atomically
(:func:`canzona.runtime.integrity.atomic_write`: the old file survives a failed save). Before
anything is written, loading also refuses: masters whose dtype is not the optimizer's
``master_dtype`` (a float64 master in an fp32 run), non-finite values in masters or state, and
hyperparameters out of range (non-finite numbers, ``lr`` or ``weight_decay`` < 0, ``eps`` <= 0,
``betas``/``momentum`` outside [0, 1)). The saved hyperparameters **override** the constructor's:
every saved value of a role is written into its inner optimizers and the groups' ``lr`` /
``weight_decay`` into ``param_groups``, as ``torch.optim.Optimizer.load_state_dict`` restores its
param groups; to change one after resuming, set it in ``opt.param_groups`` after loading.

Errors reach every rank: saving and loading each join a status exchange
(:func:`canzona.runtime.agree.agree`), so a rank that cannot read the file, a document refused on
one rank, or a failed write on rank 0 raises on every rank within seconds, naming the rank. Before
that, every collective checkpoint entry point (here, in :mod:`canzona.runtime.dcp` and
:mod:`canzona.runtime.stateful`) meets the other ranks in the process group's store
(:func:`join_collective`): one called on some ranks only raises there within ``status_timeout_s``
and on the others when they reach it, with no collective left in flight.

The document is *consolidated per parameter name* and independent of the layout it was written
under: :func:`consolidated_state_dict` gathers every canonical held region to world rank 0 (one
``gather_object``; the whole state passes through rank 0's memory), and
:func:`load_consolidated_state_dict` lets every rank cut out the regions its own layout makes it
hold, writes the masters, the optimizer state and the model's values, and lets the front end
re-assemble what derives from them (the TP hosts' full masters). Saving at DP=2 and loading at
DP=1 or DP=4, or on an FSDP2 mesh, continues exactly as an uninterrupted run would
(tests/test_checkpoint.py and tests/test_fsdp2.py check it bitwise).

Element-wise optimizer state is re-sliced like the parameter (tensors of the piece's shape);
0-dim tensors and numbers (step counters) are copied to every piece. A state tensor of any other
shape on a sliced region cannot be re-sliced and is refused with an error naming it.

An ``(E, M, N)`` expert stack is E independent matrices, so its state is per expert: each
expert's state tensor (whatever its shape: Muon's ``(M, N)`` momentum, Shampoo's ``(M, M)`` and
``(N, N)`` preconditioners) is stored stacked along the expert index, ``(E, *shape)``, in the
memory layout the experts keep it in (SOAP's column-major eigenbases stay column-major), and a
rank loading expert ``e`` takes entry ``e``. Re-slicing is along the expert index only.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from canzona.runtime.agree import RankFailure, agree
from canzona.runtime.comm import Comm, CommStats
from canzona.runtime.integrity import atomic_write, tensor_checksum

__all__ = [
    "FORMAT",
    "agree_on_checkpoint",
    "scalar_tensor",
    "stack_experts",
    "GROUP_NAMES",
    "SCHEDULED_KEYS",
    "READS",
    "VERSION",
    "Box",
    "CheckpointError",
    "Checkpointable",
    "CollectiveMismatch",
    "Held",
    "ModelPiece",
    "ParamRecord",
    "check_hyperparams",
    "checksums",
    "consolidated_state_dict",
    "document_digest",
    "expert_box",
    "flat_range_boxes",
    "join_collective",
    "load_checkpoint",
    "load_consolidated_state_dict",
    "restore_hyperparams",
    "save_checkpoint",
    "verify_document",
    "whole_box",
]

FORMAT = "canzona.optimizer_state"
VERSION = 3
#: document versions :func:`load_consolidated_state_dict` reads (2: per-tensor checksums only)
READS: tuple[int, ...] = (2, 3)

#: the front ends' parameter groups, in ``param_groups`` order (one per inner-optimizer role)
GROUP_NAMES: tuple[str, ...] = ("matrix", "elementwise")
#: group hyperparameters that schedulers may change and ``step()`` pushes into the inner optimizers
SCHEDULED_KEYS: tuple[str, ...] = ("lr", "weight_decay")

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in a full tensor


class CheckpointError(ValueError):
    """A checkpoint that does not fit this optimizer (format, parameters, optimizer classes)."""


# ---------------------------------------------------------------------------------- the contract


@dataclass(frozen=True)
class ParamRecord:
    """One trainable parameter as checkpoints see it: full shape, kind (``matrix`` /
    ``elementwise``, :func:`canzona.specs.is_matrix_param`), TP split dim and whether its optimizer
    state is element-wise (tensors shaped like the parameter, sliced like it)."""

    name: str
    shape: tuple[int, ...]
    kind: str
    tp_dim: int | None
    elementwise: bool


@dataclass(frozen=True)
class Held:
    """A region of one parameter whose optimizer side this rank holds.

    ``expert``: the index of the one expert of an ``(E, M, N)`` stack this region is (``master``
    is its ``(M, N)`` matrix); its state tensors, of any shape, are that expert's entry of the
    stack's per-expert state (see the module docstring).

    ``region`` lists boxes of the full tensor in the flat order of ``master`` (this rank's master
    values of the region; None when the rank holds only state, e.g. a TP host on the ZeRO-1 path,
    whose full master is re-assembled from the TP shards). ``optimizer.state[param]`` is its
    state: with ``sliced`` (element-wise optimizers) its tensors are shaped like ``master`` and
    cover the same region; otherwise they are whole (a matrix host's full-shape state). Several
    ranks may hold the same region (TP replicas, ``sc``); exactly one of them is ``canonical`` and
    contributes it to a consolidated document."""

    name: str
    region: tuple[Box, ...]
    master: torch.Tensor | None
    optimizer: torch.optim.Optimizer | None
    param: torch.Tensor | None
    sliced: bool
    canonical: bool
    expert: int | None = None

    def state(self) -> Mapping[str, Any]:
        if self.optimizer is None or self.param is None:
            return {}
        return self.optimizer.state.get(self.param, {})


@dataclass(frozen=True)
class ModelPiece:
    """The model's own storage of one parameter on this rank: ``local`` holds box ``box`` of it.
    ``aliased``: that storage is also the optimizer's master of it (the FSDP2 split step with
    parameters in the master dtype), so a load writes it through the master (the optimizer's
    value) and never from the model entry, and a load target for the model entry is a copy."""

    name: str
    local: torch.Tensor
    box: Box
    aliased: bool = False


class Checkpointable(Protocol):
    """What checkpoints need of an optimizer front end (``canzona.DistributedOptimizer`` on the
    ZeRO-1 path and on FSDP2 models implement it). The checkpoint code reads nothing else."""

    model: torch.nn.Module
    mesh: Any
    master_dtype: torch.dtype
    matrix_cls: type
    elementwise_cls: type
    status_timeout_s: float
    comm_stats: CommStats
    param_groups: list[dict[str, Any]]
    #: the optimizer's runtime; checkpoints use only its ``set_hyperparams(role, values)``,
    #: ``replicas.check(what)`` (:class:`canzona.runtime.agree.ReplicaGuard`: saves are refused
    #: while a failed update left per-rank replicas different) and ``status_comm`` (the status
    #: exchanges' :class:`~canzona.runtime.comm.Comm`, counted in ``comm_stats``)
    runtime: Any

    @property
    def steps(self) -> int: ...

    def finish_param_sync(self) -> None:
        """Wait for pending parameter updates (a lazy all-gather) before values are read or written."""

    def checkpoint_params(self) -> list[ParamRecord]:
        """Every trainable parameter, in a rank-independent order."""

    def checkpoint_describe(self) -> dict[str, Any]:
        """JSON-able facts about the layout the state was written under (engine, sizes, plan)."""

    def held(self) -> list[Held]:
        """What this rank holds of the optimizer state (see :class:`Held`)."""

    def model_pieces(self) -> list[ModelPiece]:
        """Where this rank keeps each trainable parameter's values (see :class:`ModelPiece`)."""

    def hyperparams(self) -> dict[str, dict[str, Any]]:
        """Per group name, the JSON-able hyperparameters the inner optimizers of that role run
        (constructor values with the groups' current scheduled ones); identical on every rank."""

    def status_device(self) -> torch.device:
        """Where this rank's status exchanges run."""

    def finish_load(self, steps: int) -> None:
        """After masters and state were written: re-assemble what is derived from them
        (collective where hosts hold full masters built from shards), set the step count and
        discard pending gradients."""

    def consolidated_state_dict(self) -> dict[str, Any]:
        """The consolidated document (:func:`consolidated_state_dict`) on world rank 0, ``{}``
        elsewhere (collective)."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state in DCP's shape (:func:`canzona.runtime.stateful.sharded_state_dict`;
        collective)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load either form (:func:`canzona.runtime.stateful.load_state`; collective)."""


class CollectiveMismatch(RuntimeError):
    """A collective method (``state_dict()``, a checkpoint save or load) was not called on every rank."""


# ---------------------------------------------------------------------------------- collective guard

_collective_calls = itertools.count()  # every rank numbers its collective calls alike while they agree


def join_collective(src: Checkpointable, what: str) -> None:
    """Wait (at most ``src.status_timeout_s``) in the default store until every rank has entered
    the collective method ``what`` at the same call number; raise :class:`CollectiveMismatch` on
    a timeout (naming the missing ranks, and leaving a mark that makes them raise when they come),
    when another rank gave up on this call already, or when another rank entered another method."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    try:
        store = dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the rendezvous needs no collective
    except Exception:  # noqa: BLE001 - without a store there is nothing to wait in
        return
    rank, world, n = dist.get_rank(), dist.get_world_size(), next(_collective_calls)
    base = f"canzona.collective/{n}"  # a store key, not a phase name
    store.set(f"{base}/{rank}", what)
    rule = f"{what} is collective: every rank must call it at the same point"
    if store.check([f"{base}/abandoned"]):
        raise CollectiveMismatch(f"{rule}; {store.get(f'{base}/abandoned').decode()} stopped waiting for this call")
    timeout = float(src.status_timeout_s)
    try:
        store.wait([f"{base}/{r}" for r in range(world)], timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - torch raises DistStoreError or RuntimeError on a timeout
        missing = [r for r in range(world) if not store.check([f"{base}/{r}"])]
        store.set(f"{base}/abandoned", f"rank {rank} (in {what})")
        raise CollectiveMismatch(f"{rule}; rank(s) {missing} did not call it within {timeout:g} s") from None
    if store.check([f"{base}/abandoned"]):  # it gave up just as this rank arrived
        raise CollectiveMismatch(f"{rule}; {store.get(f'{base}/abandoned').decode()} stopped waiting for this call")
    others = {r: store.get(f"{base}/{r}").decode() for r in range(world)}
    odd = {r: w for r, w in others.items() if w != what}
    if odd:
        r, w = sorted(odd.items())[0]
        raise CollectiveMismatch(f"{rule}; rank {r} called {w} instead")



def restore_hyperparams(src: Checkpointable, hyper: Mapping[str, Any]) -> None:
    """The one place saved hyperparameters come back: each group's :data:`SCHEDULED_KEYS`
    (``lr``, ``weight_decay``) into ``src.param_groups``, and every saved value of the role into
    the inner optimizers (``betas``, ``momentum`` ... override the constructor's, as
    ``torch.optim.Optimizer.load_state_dict`` restores its param groups). A group the checkpoint
    has no values for keeps its own. JSON turns tuples into lists; they become tuples again."""
    for group in src.param_groups:
        saved = hyper.get(group["name"], {})
        if not isinstance(saved, Mapping) or not saved:
            continue
        for k in SCHEDULED_KEYS:
            if k in group and k in saved:
                group[k] = saved[k]
        src.runtime.set_hyperparams(group["name"], {k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()})


def inner_hyperparams(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-able values ``cls(params, **kwargs)`` puts in its param group (its own defaults
    filled in), read from a throw-away instance over one small tensor."""
    group = cls([torch.zeros(4, 3)], **dict(kwargs)).param_groups[0]
    return {k: v for k, v in group.items() if k != "params" and _jsonable(v)}


# ---------------------------------------------------------------------------------- regions


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The flat range ``[start, end)`` of a row-major tensor of ``shape`` as row-aligned boxes
    (offsets, sizes), in flat order: each box is a contiguous run of the range, so consecutive
    slices of the flat values are the boxes' contents. At most ``2 * ndim - 1`` boxes."""
    if end <= start:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    out: list[Box] = []
    row, off = divmod(start, inner)
    if off:  # partial first row
        stop = min(end, (row + 1) * inner)
        out += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], off, stop - row * inner)]
        start = stop
        if start >= end:
            return out
        row = start // inner
    last, rest = divmod(end, inner)
    if last > row:
        out.append(((row, *(0,) * (len(shape) - 1)), (last - row, *shape[1:])))
    if rest:
        out += [((last, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, rest)]
    return out


def whole_box(shape: Sequence[int]) -> Box:
    return (tuple(0 for _ in shape), tuple(int(n) for n in shape))


def expert_box(expert: int, shape: Sequence[int]) -> Box:
    """Where expert ``expert``'s state tensor of ``shape`` sits in its stack's per-expert state
    ``(E, *shape)`` (the sharded formats store it so, as the consolidated one does)."""
    return ((int(expert), *(0 for _ in shape)), (1, *(int(n) for n in shape)))


def box_index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(*box))


def region_numel(region: Sequence[Box]) -> int:
    return sum(math.prod(b[1]) for b in region)


def _region_values(full: torch.Tensor, region: Sequence[Box]) -> torch.Tensor:
    """The region's values of a full tensor, flat, in the region's order."""
    parts = [full[box_index(b)].reshape(-1) for b in region]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# ---------------------------------------------------------------------------------- consolidation


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def _exports(src: Checkpointable) -> list[dict[str, Any]]:
    """This rank's canonical regions: flat master values and state (sliced state flat as well)."""
    out: list[dict[str, Any]] = []
    for h in src.held():
        if not h.canonical:
            continue
        entry: dict[str, Any] = {"name": h.name, "region": [list(map(list, b)) for b in h.region], "sliced": h.sliced}
        if h.master is not None:
            entry["master"] = _cpu(h.master).reshape(-1)
        state: dict[str, Any] = {}
        if h.expert is not None:
            entry["expert"] = h.expert
        for k, v in h.state().items():
            if torch.is_tensor(v) and h.expert is not None and v.dim() > 0:
                state[k] = ("expert", _cpu(v))
            elif torch.is_tensor(v) and h.sliced and v.dim() > 0:
                if h.master is None or tuple(v.shape) != tuple(h.master.shape):
                    raise CheckpointError(
                        f"{h.name}: element-wise optimizer state {k!r} has shape {tuple(v.shape)}, not the "
                        f"parameter's {tuple(ref.shape) if ref is not None else '?'}; it cannot be re-sliced"
                    )
                state[k] = ("sliced", _cpu(v).reshape(-1))
            else:
                state[k] = ("whole", _cpu(v) if torch.is_tensor(v) else v)
        entry["state"] = state
        out.append(entry)
    return out


def _assemble(name: str, shape: tuple[int, ...], parts: list[tuple[list[Box], torch.Tensor]], what: str) -> torch.Tensor:
    """Full tensor of ``shape`` from (region, flat values) parts; every element covered once."""
    full = torch.empty(shape, dtype=parts[0][1].dtype)
    covered = 0
    for region, flat in parts:
        pos = 0
        for off, size in region:
            n = math.prod(size)
            full[box_index((tuple(off), tuple(size)))] = flat[pos : pos + n].view(tuple(size))
            pos += n
            covered += n
    if covered != math.prod(shape):
        raise CheckpointError(f"{name}: {what} regions cover {covered} of {math.prod(shape)} elements")
    return full


def stack_experts(name: str, key: str, n_experts: int, parts: Mapping[int, torch.Tensor]) -> torch.Tensor:
    """One per-expert state tensor of a stack, ``(E, *shape)``, from every expert's own (each
    expert exactly once, all of one shape, dtype and memory layout, which the stack keeps: entry
    ``e`` is a view with the expert's strides)."""
    if sorted(parts) != list(range(n_experts)):
        raise CheckpointError(f"{name}: state {key!r} was exported for experts {sorted(parts)}, the stack has {n_experts}")
    first = parts[0]
    for e, t in parts.items():
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride():
            raise CheckpointError(
                f"{name}: state {key!r} of expert {e} is {tuple(t.shape)} {t.dtype} with strides {t.stride()}, expert 0's "
                f"{tuple(first.shape)} {first.dtype} {first.stride()}; experts of one stack must keep alike state"
            )
    like = torch.empty_like(first)  # the layout of a dense tensor (preserve_format), else row-major
    out = torch.empty_strided((n_experts, *first.shape), (max(1, first.numel()), *like.stride()), dtype=first.dtype)
    for e, t in parts.items():
        out[e].copy_(t)
    return out


def _meta(src: Checkpointable) -> dict[str, Any]:
    return {
        **src.checkpoint_describe(),
        "steps": src.steps,
        "matrix_optimizer": src.matrix_cls.__name__,
        "elementwise_optimizer": src.elementwise_cls.__name__,
        "master_dtype": str(src.master_dtype).removeprefix("torch."),
        "params": {r.name: {"shape": list(r.shape), "kind": r.kind, "tp_dim": r.tp_dim} for r in src.checkpoint_params()},
    }


def consolidated_state_dict(src: Checkpointable) -> dict[str, Any]:
    """Gather the optimizer's state into one layout-independent document on world rank 0.

    Collective over the world group (:func:`join_collective` first). Rank 0 returns the
    document, other ranks an empty dict.
    """
    join_collective(src, "consolidated_state_dict()")
    src.runtime.replicas.check("saving the optimizer state")  # the same flag on every rank: all raise
    mine: list[dict[str, Any]] = []
    error: BaseException | None = None
    try:
        src.finish_param_sync()
        mine = _exports(src)
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    agree(error, "consolidating the optimizer state", comm=src.runtime.status_comm, timeout_s=src.status_timeout_s, mark=True)
    # through the byte-counting layer, so checkpoint traffic shows in comm_stats ("unphased")
    got = Comm(None, src.comm_stats).gather_object(mine, dst=0)
    if dist.get_rank() != 0:
        return {}
    assert got is not None
    by_name: dict[str, list[dict[str, Any]]] = {}
    for share in got:
        for e in share:
            by_name.setdefault(e["name"], []).append(e)
    params: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    for rec in src.checkpoint_params():
        entries = by_name.get(rec.name, [])
        with_master = [e for e in entries if "master" in e]
        if not with_master:
            raise CheckpointError(f"{rec.name}: no rank exported it (layout and runtime disagree)")
        params[rec.name] = _assemble(rec.name, rec.shape, [(e["region"], e["master"]) for e in with_master], "master")
        st: dict[str, Any] = {}
        for e in entries:
            for k, (how, v) in e["state"].items():
                if how == "whole":
                    st.setdefault(k, v)
        for k in {k for e in entries for k, (how, _) in e["state"].items() if how == "sliced"}:
            parts = [(e["region"], e["state"][k][1]) for e in entries if k in e["state"] and e["state"][k][0] == "sliced"]
            st[k] = _assemble(rec.name, rec.shape, parts, f"state {k!r}")
        for k in sorted({k for e in entries for k, (how, _) in e["state"].items() if how == "expert"}):
            per = {e["expert"]: e["state"][k][1] for e in entries if e["state"].get(k, ("",))[0] == "expert"}
            st[k] = stack_experts(rec.name, k, rec.shape[0], per)
        state[rec.name] = st
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "meta": _meta(src),
        "params": params,
        "state": state,
        "hyper": src.hyperparams(),
    }
    doc["checksums"] = checksums(doc)
    doc["digest"] = document_digest(doc)
    return doc


def _feed(h: Any, v: Any, depth: int = 0) -> None:
    """Feed a canonical, type-tagged encoding of ``v`` into the hash ``h``: every key, number,
    string, container kind and tensor (dtype, shape, bytes) counts; dict entries in sorted order."""
    if depth > 64:
        raise CheckpointError("checkpoint document is nested deeper than any canzona writes")
    if torch.is_tensor(v):
        # a fresh row-major copy: values count, not the strides the file gave them (a size-1 dim
        # may carry any stride, which .contiguous() keeps and a byte view refuses)
        t = torch.empty(v.shape, dtype=v.dtype).copy_(v.detach())
        h.update(f"x{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(v, Mapping):
        items = sorted(v.items(), key=lambda kv: (type(kv[0]).__name__, str(kv[0])))
        h.update(f"d{len(items)}|".encode())
        for k, x in items:
            _feed(h, k, depth + 1)
            _feed(h, x, depth + 1)
    elif isinstance(v, (list, tuple)):
        h.update(f"{'l' if isinstance(v, list) else 't'}{len(v)}|".encode())
        for x in v:
            _feed(h, x, depth + 1)
    elif isinstance(v, bool) or v is None:
        h.update({True: b"T", False: b"F", None: b"N"}[v])
    elif isinstance(v, int):
        h.update(f"i{v}|".encode())
    elif isinstance(v, float):
        h.update(f"f{v.hex()}|".encode())
    elif isinstance(v, str):
        raw = v.encode("utf-8", "surrogatepass")
        h.update(f"s{len(raw)}|".encode() + raw)
    else:
        raise CheckpointError(f"checkpoint document holds a {type(v).__name__}, which canzona never writes")


def document_digest(doc: Mapping[str, Any]) -> str:
    """BLAKE2b-256 (hex) of everything in ``doc`` but its ``"digest"`` entry: hyperparameters,
    step counts, key names, structure and every tensor's bytes, in a canonical encoding
    (:func:`_feed`), so a document that loads with any difference from what was saved fails it."""
    h = hashlib.blake2b(digest_size=32)
    _feed(h, {k: v for k, v in doc.items() if k != "digest"})
    return h.hexdigest()


def _name_bad_tensor(doc: Mapping[str, Any]) -> None:
    """Raise naming the first tensor that fails its own checksum, if one does (a better message
    than the document digest's)."""
    sums = doc.get("checksums")
    if not isinstance(sums, Mapping):
        return
    for section, label in (("params", "parameter value"), ("state", "optimizer state")):
        table, saved = doc.get(section), sums.get(section)
        if not isinstance(table, Mapping) or not isinstance(saved, Mapping):
            continue
        for name, v in table.items():
            if section == "params":
                if torch.is_tensor(v) and saved.get(name) != tensor_checksum(v):
                    raise CheckpointError(f"{name}: {label} fails its checksum (the file is corrupt)")
                continue
            want = saved.get(name)
            for k, t in (v.items() if isinstance(v, Mapping) else ()):
                if torch.is_tensor(t) and (not isinstance(want, Mapping) or want.get(k) != tensor_checksum(t)):
                    raise CheckpointError(f"{name}: {label} {k!r} fails its checksum (the file is corrupt)")


def _check_format(doc: Any) -> int:
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        raise CheckpointError(f"not a canzona optimizer checkpoint (format {doc.get('format') if isinstance(doc, Mapping) else type(doc).__name__!r})")
    version = doc.get("version")
    if type(version) is not int or version not in READS:
        raise CheckpointError(f"unsupported checkpoint version {version!r} (this canzona reads {', '.join(map(str, READS))})")
    return version


def verify_document(doc: Any) -> None:
    """The integrity checks that need no optimizer: the format, the version and, for a version-3
    document, its digest over the whole document (CheckpointError otherwise). A version-2 document
    (canzona before the whole-document digest) has only per-tensor checksums: its tensors are
    checked, its numbers, names and structure cannot be, and it must carry no ``"digest"`` entry
    (a version-3 document whose version a corruption turned into 2 is refused)."""
    version = _check_format(doc)
    if version == 2:
        if "digest" in doc:
            raise CheckpointError("checkpoint says version 2 but carries a version-3 digest (the file is corrupt)")
        return
    if not isinstance(doc.get("digest"), str):
        raise CheckpointError("checkpoint carries no document digest; it cannot be verified")
    if document_digest(doc) != doc["digest"]:
        _name_bad_tensor(doc)
        raise CheckpointError(
            "checkpoint fails its document digest: a hyperparameter, step count, key or value differs from what was saved (the file is corrupt)"
        )


def checksums(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Per-tensor checksums of a document's ``params`` and ``state`` (see the module docstring)."""
    return {
        "params": {n: tensor_checksum(t) for n, t in doc["params"].items()},
        "state": {n: {k: tensor_checksum(v) for k, v in st.items() if torch.is_tensor(v)} for n, st in doc["state"].items()},
    }


def _check_integrity(src: Checkpointable, doc: Mapping[str, Any]) -> None:
    """Checksums, master dtype, finiteness (the structure was checked before)."""
    sums = doc.get("checksums")
    if not isinstance(sums, Mapping) or not isinstance(sums.get("params"), Mapping) or not isinstance(sums.get("state"), Mapping):
        raise CheckpointError("checkpoint carries no checksums; it cannot be verified")
    for name, t in doc["params"].items():
        if t.dtype != src.master_dtype:
            raise CheckpointError(f"{name}: checkpoint master is {t.dtype}, this optimizer keeps {src.master_dtype} masters")
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


def _check_document(src: Checkpointable, doc: Any) -> None:
    """Everything a document must pass before a rank writes any of it; the checks that name a
    parameter first (they only read), the whole-document digest before the values are trusted."""
    _check_format(doc)
    for key in ("meta", "params", "state", "hyper"):
        if not isinstance(doc.get(key), Mapping):
            raise CheckpointError(f"checkpoint lacks its {key!r} section")
    meta = doc["meta"]
    check_optimizers(src, meta)
    want = {r.name: r for r in src.checkpoint_params()}
    cut = {h.name for h in src.held() if h.sliced and h.expert is None}
    have = doc["params"]
    if set(have) != set(want):
        raise CheckpointError(
            f"checkpoint parameters differ from the model's: missing {sorted(set(want) - set(have))[:3]}, "
            f"unexpected {sorted(set(have) - set(want))[:3]}"
        )
    kinds = {n: m.get("kind") if isinstance(m, Mapping) else None for n, m in meta.get("params", {}).items()} if isinstance(meta.get("params"), Mapping) else {}
    for name, rec in want.items():
        if kinds.get(name) != rec.kind:
            raise CheckpointError(
                f"{name}: checkpoint treats it as {kinds.get(name)!r}, this optimizer as {rec.kind!r}; "
                "its optimizer state belongs to another optimizer"
            )
        t = have[name]
        if not torch.is_tensor(t) or tuple(t.shape) != rec.shape:
            raise CheckpointError(f"{name}: checkpoint holds shape {tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}, the model {rec.shape}")
        # Checked here for every parameter, not only for the regions this rank loads: a rank that
        # failed half-way through the load would leave its masters half-written and the other ranks
        # waiting in the hosts' collective.
        st = doc["state"].get(name, {})
        if not isinstance(st, Mapping):
            raise CheckpointError(f"{name}: optimizer state is a {type(st).__name__}, not a mapping")
        if rec.elementwise:
            # an expert stack's per-expert state is (E, *shape); where this layout cuts the stack
            # into element ranges (an element-wise optimizer over it) it must be the stack's shape
            per_expert = rec.kind == "experts" and name not in cut
            for k, v in st.items():
                if not torch.is_tensor(v) or v.dim() == 0:
                    continue
                if per_expert and v.shape[0] != rec.shape[0]:
                    raise CheckpointError(f"{name}: state {k!r} has shape {tuple(v.shape)}, expected one entry per expert ({rec.shape[0]}, ...)")
                if not per_expert and tuple(v.shape) != rec.shape:
                    raise CheckpointError(f"{name}: state {k!r} has shape {tuple(v.shape)}, expected {rec.shape}")
    check_hyper_section(doc["hyper"])
    if not isinstance(meta.get("steps", 0), int) or isinstance(meta.get("steps", 0), bool) or meta.get("steps", 0) < 0:
        raise CheckpointError(f"checkpoint's step count {meta.get('steps')!r} is not a non-negative integer")
    _check_integrity(src, doc)  # names the tensor, the dtype or the NaN where one is the cause
    verify_document(doc)


def check_optimizers(src: Checkpointable, meta: Mapping[str, Any]) -> None:
    """The checkpoint's optimizer classes must be this optimizer's (names compared)."""
    for key, mine in (("matrix_optimizer", src.matrix_cls.__name__), ("elementwise_optimizer", src.elementwise_cls.__name__)):
        if meta.get(key) != mine:
            raise CheckpointError(f"checkpoint was written by {key} {meta.get(key)!r}, this optimizer runs {mine!r}")


def check_hyper_section(hyper: Any) -> None:
    """A mapping of group name -> mapping of acceptable values (:func:`check_hyperparams`)."""
    if not isinstance(hyper, Mapping):
        raise CheckpointError("checkpoint's hyperparameters are not a mapping")
    for key in GROUP_NAMES:
        if not isinstance(hyper.get(key, {}), Mapping):
            raise CheckpointError(f"checkpoint's {key!r} hyperparameters are not a mapping")
        check_hyperparams(key, hyper.get(key, {}))


def load_consolidated_state_dict(src: Checkpointable, doc: Mapping[str, Any]) -> None:
    """Load a :func:`consolidated_state_dict` document on every rank, re-sliced to this layout.

    Every rank must pass the whole document. Restores masters, optimizer state, hyperparameters,
    the step count and the model's parameter values. Collective: the status exchange, and the
    re-assembly of full masters where hosts build them from shards.
    """
    join_collective(src, "load_state_dict()")
    error: BaseException | None = None
    try:
        _check_document(src, doc)
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    try:
        agree(error, "loading the checkpoint", comm=src.runtime.status_comm, timeout_s=src.status_timeout_s, mark=True)
    except RankFailure:
        if error is not None:
            raise error from None  # this rank's own error says it best
        raise
    src.finish_param_sync()  # a pending lazy all-gather must not overwrite the loaded values later
    params, states = doc["params"], doc["state"]
    with torch.no_grad():
        for h in src.held():
            if h.master is not None:
                h.master.copy_(_region_values(params[h.name], h.region).view(h.master.shape))
            if h.optimizer is None or h.param is None:
                continue
            dev = h.param.device
            new: dict[str, Any] = {}
            for k, v in states.get(h.name, {}).items():
                if torch.is_tensor(v) and h.expert is not None and v.dim() > 0:  # (E, *shape): this expert's entry
                    new[k] = v[h.expert].clone().to(dev)
                elif torch.is_tensor(v) and h.sliced and v.dim() > 0:  # full-shape: _check_document checked it
                    shape = h.master.shape if h.master is not None else (region_numel(h.region),)
                    new[k] = _region_values(v, h.region).reshape(shape).to(dev, copy=True)
                elif torch.is_tensor(v):
                    new[k] = v.clone().to(dev)
                else:
                    new[k] = v
            h.optimizer.state[h.param] = new
        for mp in src.model_pieces():
            if not mp.aliased:  # an aliased piece got the master's value above
                mp.local.copy_(params[mp.name][box_index(mp.box)].reshape(mp.local.shape))
    restore_hyperparams(src, doc["hyper"])
    src.finish_load(int(doc["meta"].get("steps", 0)))


def save_checkpoint(src: Checkpointable, path: str | os.PathLike[str]) -> None:
    """Write the consolidated document to ``path`` from world rank 0 (collective; atomic rename).
    Goes through ``src.consolidated_state_dict()``, so a scheduler's latest lr is what is saved."""
    doc = src.consolidated_state_dict()
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            atomic_write(path, lambda f: torch.save(doc, f))
        except Exception as exc:  # noqa: BLE001 - every rank must learn that the save failed
            error = exc
    agree(error, f"saving the checkpoint {path}", comm=src.runtime.status_comm, timeout_s=src.status_timeout_s, mark=True)


def load_checkpoint(src: Checkpointable, path: str | os.PathLike[str]) -> None:
    """Read ``path`` on every rank (``weights_only=True``: data, not code) and load it. A rank that
    cannot read it raises its :class:`CheckpointError`, the others a ``RankFailure`` naming it."""
    join_collective(src, "load_checkpoint()")
    error: CheckpointError | None = None
    doc: Any = None
    try:
        doc = torch.load(Path(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        error = CheckpointError(f"checkpoint not found: {path}")
    except Exception as exc:  # noqa: BLE001 - a corrupt or foreign file must say so, not crash obscurely
        error = CheckpointError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {_first_line(exc)})")
    if error is None:
        try:
            _check_format(doc)
        except CheckpointError as exc:
            error = exc
    try:
        agree(error, f"reading the checkpoint {path}", comm=src.runtime.status_comm, timeout_s=src.status_timeout_s, mark=True)
    except RankFailure:
        if error is not None:
            raise error from None
        raise
    src.load_state_dict(doc)


def agree_on_checkpoint(src: Checkpointable, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed in checkpoint step ``what``: this rank's own
    error says it best, the others raise a CheckpointError carrying the failing ranks' (in a
    sharded load each rank checks a share of the files, so one rank may be the only one to see
    the damage)."""
    try:
        agree(error, what, comm=src.runtime.status_comm, timeout_s=src.status_timeout_s, mark=True)
    except RankFailure as failure:
        if error is not None:
            raise error from None
        raise CheckpointError(str(failure)) from failure


def scalar_tensor(v: Any, what: str | None = None) -> torch.Tensor | None:
    """The 0-dim tensor form of a Python number kept in optimizer state or hyperparameters (bool,
    int64, float64: exact for every Python value of the type). None for anything else, or, with
    ``what``, a :class:`CheckpointError` naming it (a sharded form holds tensors only)."""
    if isinstance(v, bool):
        return torch.tensor(v)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    if what is not None:
        raise CheckpointError(f"{what}: optimizer state of type {type(v).__name__} cannot be written to a sharded checkpoint")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else ""
