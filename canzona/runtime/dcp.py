"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes what it owns.

:func:`save_sharded` writes one DCP checkpoint directory: the model's own ``state_dict()`` (keys
``model.<name>``; DTensor parameters write their shards, replicated tensors are written once) and
canzona's optimizer side, where every rank contributes exactly the pieces its plan makes it hold:

- ``optim.<name>.master``: the fp32 master values, one *global* tensor of the parameter's full
  shape per parameter; a rank writes the chunks it owns (a whole TP-local shard of an owned or
  hosted matrix, the flat range of an element-wise piece, which becomes at most a few row-aligned
  rectangles of the full tensor);
- ``optim.<name>.state.<key>``: optimizer state. Element-wise state tensors are chunked like the
  master; a matrix parameter's state (owned whole by its DP owner, or by its TP host) is written
  whole by that rank; 0-dim tensors (step counters) once;
- ``optim.<name>.pystate.<key>``: non-tensor state values (Python ints, floats, bools) as 0-dim tensors;
- ``canzona.meta``: a JSON document (uint8 tensor, never a pickle) with the format, version,
  optimizer classes, the parameters' shapes and roles, the step count and the groups' ``lr`` /
  ``weight_decay``.

Pieces held by several ranks (TP-replicated parameters, ``sc``'s replicas, the ``sync`` schedule's
TP hosts) have identical chunks, which DCP's save planner de-duplicates, so every element is
written by exactly one rank; nothing is gathered anywhere. The chunks are handed to DCP as
``LocalShardsWrapper`` local tensors of DTensors (the mechanism torchrec uses for row-wise shards),
so the directory is a plain DCP checkpoint: ``torch.distributed.checkpoint.format_utils
.dcp_to_torch_save`` converts it to one ``torch.save`` file of full tensors.

:func:`load_sharded` reads it at *any* layout (another DP size, another TP size, another strategy):
every rank asks DCP for exactly the regions its own plan makes it hold, and DCP reads the
overlapping parts of the saved chunks. The load first reads ``canzona.meta`` and the directory's
metadata and refuses a checkpoint of another model or optimizer, a missing key or a wrongly shaped
tensor with one :class:`~canzona.runtime.checkpoint.CheckpointError` on every rank; tensors are read
into fresh buffers and copied into the optimizer and the model only after DCP reported success on
every rank, so a refused or truncated checkpoint leaves the in-memory state untouched. Peak memory
on a rank: its own state plus one fresh copy of what it loads (nothing of other ranks').
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from canzona.runtime.buffer import local_tensor
from canzona.runtime.checkpoint import CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from canzona.distributed import DistributedOptimizer

__all__ = ["DCP_FORMAT", "DCP_VERSION", "META_KEY", "flat_range_boxes", "load_sharded", "save_sharded"]

DCP_FORMAT = "canzona.dcp"
DCP_VERSION = 1
META_KEY = "canzona.meta"

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


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


class _Chunks:
    """Chunks of global tensors this rank holds: key -> [(global offsets, tensor view)]."""

    def __init__(self) -> None:
        self.by_key: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def add_piece(self, key: str, spec: Any, tp_rank: int, start: int, end: int, flat: torch.Tensor) -> None:
        """A flat piece ``[start, end)`` of this TP rank's shard of parameter ``spec``'s tensor."""
        shift = [0] * len(spec.shape)
        if spec.tp_split:
            shift[spec.tp_dim] = tp_rank * spec.local_shape[spec.tp_dim]
        pos = 0
        for offs, sizes in flat_range_boxes(tuple(spec.local_shape), start, end):
            n = math.prod(sizes)
            view = flat[pos : pos + n].view(sizes)
            pos += n
            self._add(key, tuple(spec.shape), tuple(o + s for o, s in zip(offs, shift)), view)

    def add_whole(self, key: str, t: torch.Tensor) -> None:
        self._add(key, tuple(t.shape), (0,) * t.dim(), t)

    def _add(self, key: str, shape: tuple[int, ...], offsets: tuple[int, ...], t: torch.Tensor) -> None:
        if self.shapes.setdefault(key, shape) != shape:
            raise CheckpointError(f"{key}: chunks of two shapes {self.shapes[key]} and {shape}")
        self.by_key.setdefault(key, []).append((offsets, t))

    def state_dict(self, mesh: Any) -> dict[str, Any]:
        """DCP values: 0-dim tensors as they are, everything else a DTensor over ``mesh`` whose local
        tensor lists this rank's chunks with their global offsets."""
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

        out: dict[str, Any] = {}
        for key, chunks in self.by_key.items():
            shape = self.shapes[key]
            if not shape:
                out[key] = chunks[0][1]
                continue
            local = LocalShardsWrapper([t for _, t in chunks], [o for o, _ in chunks])
            stride = torch.empty(shape, device="meta").stride()
            out[key] = DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False, shape=torch.Size(shape), stride=stride)
        return out


def _master_key(name: str) -> str:
    return f"optim.{name}.master"


def _state_key(name: str, k: str) -> str:
    return f"optim.{name}.state.{k}"


def _py_key(name: str, k: str) -> str:
    return f"optim.{name}.pystate.{k}"


def _stride_key(name: str, k: str) -> str:
    return f"optim.{name}.stride.{k}"


def _py_tensor(v: Any, what: str) -> torch.Tensor:
    if isinstance(v, bool):
        return torch.tensor(v)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    raise CheckpointError(f"{what}: optimizer state of type {type(v).__name__} cannot be written to a sharded checkpoint")


def _add_state(chunks: _Chunks, name: str, st: Mapping[str, Any], *, piece: tuple[Any, int, int, int] | None) -> None:
    """One parameter's optimizer state: element-wise tensors chunked like the master (``piece`` =
    (spec, tp_rank, start, end)), anything else whole."""
    for k, v in st.items():
        if torch.is_tensor(v):
            if v.dim() == 0:
                chunks.add_whole(_state_key(name, k), v.detach())
            elif piece is not None:
                spec, tp_rank, s, e = piece
                if v.numel() != e - s:
                    raise CheckpointError(f"{name}: element-wise optimizer state {k!r} has {v.numel()} elements, its piece {e - s}")
                chunks.add_piece(_state_key(name, k), spec, tp_rank, s, e, v.detach().reshape(-1))
            else:
                chunks.add_whole(_state_key(name, k), v.detach())
                if not v.is_contiguous():
                    # DCP stores values, not memory layout; some optimizers' math depends on it
                    # (SOAP's eigenvector matrices are column-major, and a matmul over a transposed
                    # layout rounds differently), so the layout travels beside the values
                    chunks.add_whole(_stride_key(name, k), torch.tensor(v.stride(), dtype=torch.int64))
        else:
            chunks.add_whole(_py_key(name, k), _py_tensor(v, f"{name}.{k}"))


def _owned_chunks(dopt: DistributedOptimizer) -> _Chunks:
    """Everything of the optimizer this rank holds, as chunks of global tensors (views, no copies)."""
    rt = dopt.runtime
    chunks = _Chunks()
    for pc in rt.pieces:
        spec = rt.specs[pc.name]
        m = rt.masters[pc]
        chunks.add_piece(_master_key(pc.name), spec, dopt.tp_rank, pc.start, pc.end, m.detach().reshape(-1))
        if pc.role == "elementwise" and rt.elementwise_opt is not None:
            _add_state(chunks, pc.name, rt.elementwise_opt.state.get(m, {}), piece=(spec, dopt.tp_rank, pc.start, pc.end))
        elif pc.role == "matrix" and rt.matrix_opt is not None:
            _add_state(chunks, pc.name, rt.matrix_opt.state.get(m, {}), piece=None)
    eng = rt.tp_engine
    if eng is not None and eng.optimizer is not None:
        for name in eng.hosted:
            _add_state(chunks, name, eng.optimizer.state.get(eng.masters[name], {}), piece=None)
    return chunks


def _meta(dopt: DistributedOptimizer) -> dict[str, Any]:
    from canzona.distributed import SCHEDULED_KEYS

    inp = dopt.plan.inputs
    return {
        "format": DCP_FORMAT,
        "version": DCP_VERSION,
        "steps": dopt.steps,
        "matrix_optimizer": dopt.matrix_cls.__name__,
        "elementwise_optimizer": dopt.elementwise_cls.__name__,
        "master_dtype": str(dopt.master_dtype).removeprefix("torch."),
        "saved_with": {f.name: getattr(inp, f.name) for f in fields(inp)},
        "params": {s.name: {"shape": list(s.shape), "kind": s.kind} for s in dopt.plan.specs},
        "hyper": {g["name"]: {k: g[k] for k in SCHEDULED_KEYS if k in g} for g in dopt.param_groups},
    }


def _meta_tensor(meta: Mapping[str, Any]) -> torch.Tensor:
    raw = json.dumps(meta, sort_keys=True).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def save_sharded(dopt: DistributedOptimizer, path: str | os.PathLike[str]) -> None:
    """Write the model's and the optimizer's state to the DCP directory ``path``
    (collective over the world group). Each rank writes only what it owns; the directory is
    written under ``<path>.tmp`` and renamed into place by rank 0 once every rank has finished."""
    import torch.distributed.checkpoint as dcp

    dopt.finish_param_sync()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    sd: dict[str, Any] = {f"model.{k}": v for k, v in dopt.model.state_dict().items()}
    sd.update(_owned_chunks(dopt).state_dict(dopt.mesh))
    sd[META_KEY] = _meta_tensor(_meta(dopt))
    if dist.get_rank() == 0 and tmp.exists():
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp)))
    dist.barrier()
    if dist.get_rank() == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            os.replace(path, old)
        os.replace(tmp, path)
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    dist.barrier()


# ------------------------------------------------------------------------------------- load


def _read_meta(reader: Any, md: Any) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """``canzona.meta`` and the saved memory layouts (strides) of non-contiguous state tensors."""
    import torch.distributed.checkpoint as dcp

    item = md.state_dict_metadata.get(META_KEY)
    if item is None or not hasattr(item, "size") or len(item.size) != 1:
        raise CheckpointError("not a canzona sharded checkpoint (no canzona.meta entry)")
    buf = {META_KEY: torch.empty(tuple(item.size), dtype=torch.uint8)}
    for key, it in md.state_dict_metadata.items():
        if key.startswith("optim.") and ".stride." in key:
            if len(getattr(it, "size", ())) != 1:
                raise CheckpointError(f"{key}: not a stride vector")
            buf[key] = torch.empty(tuple(it.size), dtype=torch.int64)
    dcp.load(buf, storage_reader=reader)
    strides = {k.replace(".stride.", ".state.", 1): tuple(int(x) for x in v.tolist()) for k, v in buf.items() if k != META_KEY}
    try:
        meta = json.loads(bytes(buf[META_KEY].tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"canzona.meta is not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != DCP_FORMAT:
        raise CheckpointError("not a canzona sharded checkpoint (canzona.meta has another format)")
    if meta.get("version") != DCP_VERSION:
        raise CheckpointError(f"unsupported sharded checkpoint version {meta.get('version')!r} (this canzona reads {DCP_VERSION})")
    return meta, strides


def _check_meta(dopt: DistributedOptimizer, meta: Mapping[str, Any]) -> None:
    for key, mine in (("matrix_optimizer", dopt.matrix_cls.__name__), ("elementwise_optimizer", dopt.elementwise_cls.__name__)):
        if meta.get(key) != mine:
            raise CheckpointError(f"checkpoint was written by {key} {meta.get(key)!r}, this optimizer runs {mine!r}")
    params = meta.get("params")
    if not isinstance(params, Mapping):
        raise CheckpointError("canzona.meta lacks its parameter table")
    want = {s.name: s for s in dopt.plan.specs}
    if set(params) != set(want):
        raise CheckpointError(
            f"checkpoint parameters differ from the model's: missing {sorted(set(want) - set(params))[:3]}, "
            f"unexpected {sorted(set(params) - set(want))[:3]}"
        )
    for name, spec in want.items():
        entry = params[name]
        if not isinstance(entry, Mapping) or tuple(entry.get("shape", ())) != spec.shape:
            raise CheckpointError(f"{name}: checkpoint holds shape {entry.get('shape') if isinstance(entry, Mapping) else entry}, the model {list(spec.shape)}")
        if entry.get("kind") != spec.kind:
            raise CheckpointError(
                f"{name}: checkpoint treats it as {entry.get('kind')!r}, this optimizer as {spec.kind!r}; its optimizer state belongs to another optimizer"
            )
    mine = str(dopt.master_dtype).removeprefix("torch.")
    if meta.get("master_dtype") != mine:
        raise CheckpointError(f"checkpoint holds {meta.get('master_dtype')!r} masters, this optimizer keeps {mine!r}")
    steps = meta.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise CheckpointError(f"checkpoint's step count {steps!r} is not a non-negative integer")
    hyper = meta.get("hyper")
    if not isinstance(hyper, Mapping) or not all(isinstance(v, Mapping) for v in hyper.values()):
        raise CheckpointError("checkpoint's hyperparameters are not a mapping of mappings")


def _state_keys(md: Any, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The saved state entries of parameter ``name``: ({key: tensor metadata}, {key: py metadata})."""
    prefix, py = _state_key(name, ""), _py_key(name, "")
    tensors, pys = {}, {}
    for key, item in md.state_dict_metadata.items():
        if key.startswith(prefix):
            tensors[key[len(prefix) :]] = item
        elif key.startswith(py):
            pys[key[len(py) :]] = item
    return tensors, pys


def _fresh(item: Any, what: str, device: torch.device, stride: tuple[int, ...] | None = None) -> torch.Tensor:
    size = getattr(item, "size", None)
    props = getattr(item, "properties", None)
    if size is None or props is None:
        raise CheckpointError(f"{what}: saved as an object, not a tensor")
    if stride is not None:
        if len(stride) != len(size) or not _dense(tuple(size), stride):
            raise CheckpointError(f"{what}: saved stride {stride} does not describe a dense tensor of shape {tuple(size)}")
        return torch.empty_strided(tuple(size), stride, dtype=props.dtype, device=device)
    return torch.empty(tuple(size), dtype=props.dtype, device=device)


def _dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``size`` out densely (a permutation of a contiguous layout)."""
    expect = 1
    for st, n in sorted(zip(stride, size)):
        if n > 1 and st != expect:
            return False
        expect *= max(n, 1)
    return True


def _fresh_like(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return DTensor.from_local(torch.empty_like(t.to_local()), t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return torch.empty_like(t)


class _LoadPlan:
    """Fresh destination buffers for what this rank holds under its own plan, and how to commit them."""

    def __init__(self, dopt: DistributedOptimizer, md: Any, strides: Mapping[str, tuple[int, ...]]) -> None:
        rt = dopt.runtime
        self.dopt = dopt
        self.strides = dict(strides)
        self.chunks = _Chunks()
        self.whole: dict[str, torch.Tensor] = {}  # 0-dim and whole-tensor keys (matrix state, pystate)
        self.masters: list[tuple[Any, torch.Tensor]] = []
        #: element-wise pieces: (piece, {key: flat or 0-dim tensor}, {key: 0-dim tensor of a Python value})
        self.ew_state: list[tuple[Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
        self.matrix_state: list[tuple[Any, dict[str, str]]] = []
        self.hosted_state: dict[str, dict[str, str]] = {}
        self.model: dict[str, torch.Tensor] = {}
        meta = md.state_dict_metadata
        for k, v in dopt.model.state_dict().items():
            key = f"model.{k}"
            if key not in meta:
                raise CheckpointError(f"checkpoint lacks the model entry {k!r}")
            if tuple(getattr(meta[key], "size", ())) != tuple(v.shape):
                raise CheckpointError(f"model entry {k!r}: checkpoint holds shape {tuple(getattr(meta[key], 'size', ()))}, the model {tuple(v.shape)}")
            self.model[key] = _fresh_like(v.detach())
        for pc in rt.pieces:
            spec = rt.specs[pc.name]
            m = rt.masters[pc]
            key = _master_key(pc.name)
            self._expect(meta, key, spec.shape)
            flat = torch.empty(pc.numel, dtype=m.dtype, device=m.device)
            self.chunks.add_piece(key, spec, dopt.tp_rank, pc.start, pc.end, flat)
            self.masters.append((pc, flat))
            tensors, pys = _state_keys(md, pc.name)
            if pc.role == "elementwise":
                st: dict[str, torch.Tensor] = {}
                for k, item in tensors.items():
                    size = tuple(getattr(item, "size", ()))
                    if size == ():
                        st[k] = self._whole(_state_key(pc.name, k), item, m.device)
                    elif size != spec.shape:
                        raise CheckpointError(f"{pc.name}: state {k!r} has shape {size}, expected {spec.shape}")
                    else:
                        buf = torch.empty(pc.numel, dtype=item.properties.dtype, device=m.device)
                        self.chunks.add_piece(_state_key(pc.name, k), spec, dopt.tp_rank, pc.start, pc.end, buf)
                        st[k] = buf
                py = {k: self._whole(_py_key(pc.name, k), item, m.device) for k, item in pys.items()}
                self.ew_state.append((pc, st, py))
            elif pc.role == "matrix":
                self.matrix_state.append((pc, self._whole_state(md, pc.name, m.device)))
        eng = rt.tp_engine
        if eng is not None:
            for name in eng.hosted:
                self.hosted_state[name] = self._whole_state(md, name, eng.masters[name].device)

    @staticmethod
    def _expect(meta: Mapping[str, Any], key: str, shape: tuple[int, ...]) -> None:
        item = meta.get(key)
        if item is None:
            raise CheckpointError(f"checkpoint lacks {key!r}")
        if tuple(getattr(item, "size", ())) != tuple(shape):
            raise CheckpointError(f"{key}: checkpoint holds shape {tuple(getattr(item, 'size', ()))}, expected {tuple(shape)}")

    def _whole(self, key: str, item: Any, device: torch.device) -> torch.Tensor:
        t = self.whole.get(key)
        if t is None:
            t = self.whole[key] = _fresh(item, key, device, self.strides.get(key))
        return t

    def _whole_state(self, md: Any, name: str, device: torch.device) -> dict[str, str]:
        tensors, pys = _state_keys(md, name)
        keys = {k: _state_key(name, k) for k in tensors} | {k: _py_key(name, k) for k in pys}
        for k, key in keys.items():
            self._whole(key, md.state_dict_metadata[key], device)
        return keys

    def state_dict(self) -> dict[str, Any]:
        return {**self.model, **self.chunks.state_dict(self.dopt.mesh), **self.whole}

    def _value(self, key: str) -> Any:
        t = self.whole[key]
        return t.item() if ".pystate." in key else t

    def commit(self, meta: Mapping[str, Any]) -> None:
        """Copy the loaded buffers into the optimizer and the model. Runs only after DCP reported
        success on every rank; the one collective left is the TP hosts' master re-assembly."""
        dopt, rt = self.dopt, self.dopt.runtime
        with torch.no_grad():
            for pc, flat in self.masters:
                rt.masters[pc].copy_(flat.view(rt.masters[pc].shape))
            if rt.elementwise_opt is not None:
                for pc, st, py in self.ew_state:
                    m = rt.masters[pc]
                    new: dict[str, Any] = {k: (v.view(m.shape) if v.dim() else v.clone()) for k, v in st.items()}
                    new.update({k: v.item() for k, v in py.items()})
                    rt.elementwise_opt.state[m] = new
            if rt.matrix_opt is not None:
                for pc, keys in self.matrix_state:
                    rt.matrix_opt.state[rt.masters[pc]] = {k: self._value(key) for k, key in keys.items()}
            eng = rt.tp_engine
            if eng is not None:
                eng.refresh_masters()
                eng.load_state_dict({n: {k: self._value(key) for k, key in keys.items()} for n, keys in self.hosted_state.items()})
            for k, v in dopt.model.state_dict().items():
                local_tensor(v).copy_(local_tensor(self.model[f"model.{k}"]))
        for g in dopt.param_groups:
            for k, v in meta["hyper"].get(g["name"], {}).items():
                if k in g:
                    g[k] = v
        rt.steps = int(meta["steps"])
        rt.discard_grads()


def load_sharded(dopt: DistributedOptimizer, path: str | os.PathLike[str]) -> None:
    """Load :func:`save_sharded`'s directory into ``dopt`` (and its model) at this optimizer's own
    layout (collective over the world group). Refuses a checkpoint that does not fit with one
    :class:`CheckpointError` on every rank, leaving the in-memory state untouched."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"not a sharded checkpoint directory (no .metadata): {path}")
    dopt.finish_param_sync()
    reader = dcp.FileSystemReader(str(path))
    try:
        md = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - a corrupt directory must say so, not crash obscurely
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})") from None
    _check_files(path, md)
    try:
        meta, strides = _read_meta(reader, md)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        raise CheckpointError(f"{path}: reading the checkpoint failed (canzona.meta: {type(exc).__name__}: {_first_line(exc)})") from None
    _check_meta(dopt, meta)
    plan = _LoadPlan(dopt, md, strides)
    try:
        dcp.load(plan.state_dict(), storage_reader=dcp.FileSystemReader(str(path)))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP reports any rank's read failure on every rank
        raise CheckpointError(f"{path}: reading the checkpoint failed ({type(exc).__name__}: {_first_line(exc)})") from None
    plan.commit(meta)


def _check_files(path: Path, md: Any) -> None:
    """Every data file the metadata points into exists and is long enough (a truncated or missing
    file is refused before anything is read)."""
    need: dict[str, int] = {}
    for info in getattr(md, "storage_data", {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: data file {rel} is missing")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(f"{path}: data file {rel} is truncated ({have} bytes, the metadata needs {size})")


def _first_line(exc: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):  # one entry per failed rank: name the first cause
        failures = getattr(exc, "failures", {}) or {}
        if failures:
            rank, cause = sorted(failures.items(), key=lambda kv: kv[0])[0]
            if isinstance(cause, tuple):  # (exception, traceback frames)
                cause = cause[0]
            return f"rank {rank}: {type(cause).__name__} {_first_line(cause)}".rstrip()
    text = str(exc).strip().splitlines()
    return text[0] if text else ""
