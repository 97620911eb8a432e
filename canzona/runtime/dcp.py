"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP): each rank writes what it holds.

:func:`save_sharded` writes one DCP checkpoint directory from any
:class:`~canzona.runtime.checkpoint.Checkpointable` optimizer (canzona's ZeRO-1 path and the
FSDP2 path alike). Every tensor is a *global* tensor of its full shape, written in chunks by the
ranks that hold them:

- ``model.<key>``: the model's own ``state_dict()`` entries; a rank writes its local block
  (a DTensor's shard, the whole tensor when it is replicated);
- ``optim.<name>.master``: the fp32 masters; a rank writes the regions it holds (a whole TP-local
  shard of an owned matrix, the flat range of a ZeRO-1 element-wise piece, which becomes at most a
  few row-aligned rectangles, an FSDP2 block, a hosted full matrix);
- ``optim.<name>.state.<key>``: optimizer state. Element-wise state tensors are chunked like the
  master; a matrix parameter's state (held whole by its DP owner or its host) is written whole
  by that rank; an expert's state tensor of any shape (Muon's ``(M, N)`` momentum, Shampoo's
  ``(M, M)`` preconditioner) as entry ``e`` of the stack's per-expert state ``(E, *shape)``, as
  the consolidated format keeps it; 0-dim tensors (step counters) once;
- ``optim.<name>.stride.<key>``: the memory layout of a non-contiguous state tensor (values travel
  without it; SOAP's column-major eigenvectors round differently in another layout);
- ``optim.<name>.pystate.<key>``: non-tensor state values (Python ints, floats, bools) as 0-dim tensors;
- ``canzona.meta``: a JSON document (uint8 tensor, never a pickle) with the format, version,
  optimizer classes, the parameters' shapes and kinds, the step count, the hyperparameters and the
  layout it was saved under.

Chunks are cut into row slabs of at most ``chunk_bytes`` (default :data:`CHUNK_BYTES`; a slab is
at least one row of dim 0), so no single stored item is larger. Chunks held by several ranks (TP
replicas, ``sc``, HSDP replicas, the ``sync`` schedule's TP hosts) are identical, and DCP's save
planner de-duplicates them: every element is written by exactly one rank and nothing is gathered.
The chunks are handed to DCP as ``LocalShardsWrapper`` local tensors of DTensors (for several
chunks of a tensor of more than 2 dims, e.g. several experts of a stack on one rank, a subclass
that defines the one view DTensor applies to it), so the directory is a plain DCP checkpoint: ``torch.distributed.checkpoint.format_utils
.dcp_to_torch_save`` converts it to one ``torch.save`` file of full tensors.

The directory is sealed (:mod:`canzona.runtime.dcp_files`): after DCP wrote every data file and
``.metadata``, the ranks hash their share of the files and rank 0 writes
``canzona.checksums.json`` before the directory is renamed into place. A save that fails on any
rank raises one :class:`~canzona.runtime.checkpoint.CheckpointError` on every rank naming the
path and the first failing rank's cause, and removes what it wrote.

:func:`load_sharded` reads it at *any* layout (another DP size, another TP size, another strategy,
the other engine): every rank asks DCP for exactly the regions it holds, and DCP reads the
overlapping parts of the saved chunks. It first checks the seal (every file present, none extra,
sizes and digests: a flipped byte or a file of another save is refused), reads ``.metadata``
through an allow-list unpickler (a pickle that names anything but DCP's metadata classes is
refused before any object is built) and ``canzona.meta``, and refuses a checkpoint of another
model or optimizer, a missing key or a wrongly shaped tensor with one
:class:`~canzona.runtime.checkpoint.CheckpointError` on every rank. Then two passes:

1. *verify*: every requested region is read into one scratch buffer of at most ``chunk_bytes``
   (all destinations are views of it; the values are discarded), so a file that DCP cannot
   decode fails here, on every rank, before anything was written;
2. *commit*: DCP reads every region straight into its destination (masters, existing optimizer
   state tensors and the model's local tensors, in place; state tensors the optimizer does not
   have yet are allocated once, at their final size).

Compatibility: the keys and their shapes are those of the first version (``DCP_VERSION`` 1),
which wrote a 3-D key only where each rank held one piece of it; such a checkpoint loads here at
any layout. A checkpoint with non-square experts' preconditioners (keys ``(E, M, M)`` beside an
``(E, M, N)`` stack) is refused by that version in one line (``state 'L' has shape ...``).

Peak memory on a rank while loading: its own state plus the scratch buffer plus DCP's one stored
item in flight, each bounded by ``chunk_bytes`` (``last_load_stats`` records what the last load
allocated). The data is read twice; that is the price of refusing a corrupt file without holding
a second copy of the state.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from canzona.runtime import dcp_files
from canzona.runtime.agree import RankFailure, agree
from canzona.runtime.checkpoint import (
    Box,
    CheckpointError,
    Checkpointable,
    Held,
    check_hyper_section,
    check_optimizers,
    expert_box,
    flat_range_boxes,
    join_collective,
    agree_on_checkpoint,
    restore_hyperparams,
    scalar_tensor,
    whole_box,
)
from canzona.runtime.comm import Comm

__all__ = [
    "CHUNK_BYTES",
    "DCP_FORMAT",
    "DCP_VERSION",
    "META_KEY",
    "flat_range_boxes",
    "last_load_stats",
    "load_sharded",
    "save_sharded",
]

DCP_FORMAT = "canzona.dcp"
DCP_VERSION = 1
META_KEY = "canzona.meta"
#: default cap on one stored chunk and on the load's scratch buffer (bytes)
CHUNK_BYTES = 32 * 2**20

#: what the last :func:`load_sharded` on this process allocated besides the state it loaded into:
#: ``scratch_bytes`` (the verify pass's buffer), ``new_state_bytes`` (state tensors the optimizer
#: did not have before), ``fresh_bytes`` (0-dim and Python-valued entries), ``regions`` (count)
last_load_stats: dict[str, int] = {}


def _region_views(region: tuple[Box, ...], flat: torch.Tensor) -> Iterator[tuple[Box, torch.Tensor]]:
    """Each box of ``region`` with its values: ``flat`` holds the region's values box after box."""
    pos = 0
    for box in region:
        n = math.prod(box[1])
        yield box, flat[pos : pos + n].view(box[1])
        pos += n


def _slabs(box: Box, view: torch.Tensor, cap: int) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """``view`` (box-shaped) cut along dim 0 into slabs of at most ``cap`` bytes (at least a row)."""
    offs, sizes = box
    if not sizes or sizes[0] <= 1:
        return [(tuple(offs), view)]
    row = math.prod(sizes[1:]) * view.element_size()
    step = max(1, cap // max(row, 1))
    if step >= sizes[0]:
        return [(tuple(offs), view)]
    # The last row is a slab of its own. DCP's writer clones every slab (a view of a larger
    # tensor), writes a rank's items largest first, and keeps the last item written under each
    # key alive until the rank's file is closed: with a one-row slab last, what it keeps is one
    # row per key instead of up to ``cap`` bytes per key (profiling/bench_checkpoint.py measures it).
    n = sizes[0] - 1
    out = [((offs[0] + r, *offs[1:]), view[r : min(r + step, n)]) for r in range(0, n, step)]
    return out + [((offs[0] + n, *offs[1:]), view[n:])]


@functools.cache
def _nd_shards() -> type:
    """torch's ``LocalShardsWrapper`` for several local shards of a tensor of more than 2 dims.

    DCP reads and writes a wrapper's shards through ``__create_write_items__``,
    ``__create_chunk_list__`` and ``__get_tensor_shard__``, which take N-D offsets as they are;
    the one op torch's wrapper refuses beyond 2-D is ``view``, which ``DTensor.from_local`` and
    ``to_local`` apply to it with its own shape. That view (the identity) is defined here, per
    shard; any other is refused."""
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

    class NdLocalShards(LocalShardsWrapper):
        @staticmethod
        def handle_view(args: Any, kwargs: Any) -> Any:
            self, shape = args[0], tuple(args[1])
            if shape != tuple(self.shape):
                raise NotImplementedError(f"a view {shape} of several {self.local_shards()[0].ndim}-D local shards")
            return NdLocalShards([torch.ops.aten.view.default(s, s.shape) for s in self.local_shards()], self.local_offsets())

    return NdLocalShards


class _Chunks:
    """Chunks of global tensors: key -> [(global offsets, tensor view)], cut into slabs of at most
    ``cap`` bytes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.by_key: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def add_box(self, key: str, shape: tuple[int, ...], box: Box, view: torch.Tensor) -> None:
        """``view`` (shaped like ``box``) holds box ``box`` of the global tensor ``key`` of ``shape``."""
        if math.prod(box[1]) == 0 and shape:
            return
        if self.shapes.setdefault(key, shape) != shape:
            raise CheckpointError(f"{key}: chunks of two shapes {self.shapes[key]} and {shape}")
        self.by_key.setdefault(key, []).extend(_slabs(box, view, self.cap))

    def add_region(self, key: str, shape: tuple[int, ...], region: tuple[Box, ...], flat: torch.Tensor) -> None:
        """``flat`` holds the region's values in the region's order."""
        for box, view in _region_views(region, flat):
            self.add_box(key, shape, box, view)

    def add_whole(self, key: str, t: torch.Tensor) -> None:
        self.add_box(key, tuple(t.shape), whole_box(t.shape), t)

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
            wrapper = _nd_shards() if len(shape) > 2 and len(chunks) > 1 else LocalShardsWrapper
            local = wrapper([t for _, t in chunks], [list(o) for o, _ in chunks])
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


def _model_boxes(src: Checkpointable, load: bool = False) -> dict[str, tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]]:
    """Each model ``state_dict()`` entry's full shape and the (box, local tensor) pieces this rank
    holds of it: the front end's own record for trainable parameters (several boxes for a packed
    TP stack), a DTensor's placements otherwise. ``load``: without the pieces whose storage is
    also their master's (:class:`~canzona.runtime.checkpoint.ModelPiece` ``aliased``), which the
    load writes through the master entry only."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    pieces: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    for mp in src.model_pieces():
        held = pieces.setdefault(mp.name, [])
        if not (load and mp.aliased):
            held.append(((tuple(mp.box[0]), tuple(mp.box[1])), mp.local))
    out: dict[str, tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]] = {}
    for k, v in src.model.state_dict().items():
        if not torch.is_tensor(v):
            raise CheckpointError(f"model entry {k!r} is a {type(v).__name__}, not a tensor; sharded checkpoints hold tensors only")
        v = v.detach()
        if k in pieces:
            out[k] = (tuple(v.shape), pieces[k])
        elif isinstance(v, DTensor):
            shape, offset = compute_local_shape_and_global_offset(v.shape, v.device_mesh, v.placements)
            out[k] = (tuple(v.shape), [((tuple(offset), tuple(shape)), v.to_local())])
        else:
            out[k] = (tuple(v.shape), [(whole_box(v.shape), v)])
    return out


def _add_state(chunks: _Chunks, h: Held, shape: tuple[int, ...]) -> None:
    """One held region's optimizer state: element-wise tensors chunked like the master, an
    expert's tensors (any shape) as its entry of the stack's per-expert state ``(E, *shape)``,
    anything else whole."""
    name = h.name
    for k, v in h.state().items():
        if torch.is_tensor(v):
            v = v.detach()
            if v.dim() == 0:
                chunks.add_whole(_state_key(name, k), v)
            elif h.expert is not None:
                key = _state_key(name, k)
                chunks.add_box(key, (shape[0], *v.shape), expert_box(h.expert, tuple(v.shape)), v.unsqueeze(0))
                _add_stride(chunks, _stride_key(name, k), v)
            elif h.sliced:
                if h.master is None or v.numel() != h.master.numel():
                    raise CheckpointError(f"{name}: element-wise optimizer state {k!r} has {v.numel()} elements, its piece is not that size")
                chunks.add_region(_state_key(name, k), shape, h.region, v.reshape(-1))
            else:
                chunks.add_whole(_state_key(name, k), v)
                _add_stride(chunks, _stride_key(name, k), v)
        else:
            chunks.add_whole(_py_key(name, k), scalar_tensor(v, f"{name}.{k}"))


def _add_stride(chunks: _Chunks, key: str, v: torch.Tensor) -> None:
    """The memory layout of a non-contiguous state tensor, once per rank (the experts of a stack
    keep theirs alike: a second, other layout is refused)."""
    if v.is_contiguous():
        return
    stride = torch.tensor(v.stride(), dtype=torch.int64)
    have = chunks.by_key.get(key)
    if have is None:
        chunks.add_whole(key, stride)
    elif not torch.equal(have[0][1], stride):
        raise CheckpointError(f"{key}: experts of one stack keep this state in two memory layouts, {tuple(have[0][1].tolist())} and {v.stride()}")


def _meta(src: Checkpointable, cap: int) -> dict[str, Any]:
    return {
        "format": DCP_FORMAT,
        "version": DCP_VERSION,
        "steps": src.steps,
        "matrix_optimizer": src.matrix_cls.__name__,
        "elementwise_optimizer": src.elementwise_cls.__name__,
        "master_dtype": str(src.master_dtype).removeprefix("torch."),
        "saved_with": src.checkpoint_describe(),
        "chunk_bytes": cap,
        "params": {r.name: {"shape": list(r.shape), "kind": r.kind} for r in src.checkpoint_params()},
        "hyper": src.hyperparams(),
    }


def _meta_tensor(meta: Mapping[str, Any]) -> torch.Tensor:
    raw = json.dumps(meta, sort_keys=True).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def save_sharded(src: Checkpointable, path: str | os.PathLike[str], *, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Write the model's and the optimizer's state to the DCP directory ``path`` (collective over
    the world group). Each rank writes only what it holds, in chunks of at most ``chunk_bytes``;
    the directory is written under ``<path>.tmp``, sealed (:func:`canzona.runtime.dcp_files.seal`:
    every file's digest, written last) and renamed into place by rank 0 once every rank has
    finished. A failed save (a full or read-only folder, a rank that cannot write) raises one
    :class:`CheckpointError` on every rank naming ``path`` and the first failing rank's cause,
    and leaves neither ``<path>.tmp`` nor a changed ``path`` behind."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    join_collective(src, "save_sharded()")
    src.runtime.replicas.check("saving the sharded checkpoint")  # the same flag on every rank: all raise
    src.finish_param_sync()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    sd: dict[str, Any] = {}
    error: BaseException | None = None
    try:
        sd = _save_items(src, chunk_bytes)
    except Exception as exc:  # noqa: BLE001 - every rank must learn that this rank cannot save
        error = exc
    agree_on_checkpoint(src, error, f"preparing the sharded checkpoint {path}")
    steps = (("clearing", _clear_tmp), ("writing", _write), ("hashing", _hash), ("sealing", _seal), ("renaming", _rename))
    for what, fn in steps:
        error = None
        try:
            fn(src, sd, path, tmp)
        except (Exception, _checkpoint_exception()) as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            rank, cause = _cause(exc)
            error = CheckpointError(f"rank {rank} failed {what}: {cause}")
        try:
            agree(error, f"saving the sharded checkpoint {path}", comm=src.runtime.status_comm, timeout_s=src.status_timeout_s, mark=True)
        except RankFailure as failure:
            _discard(tmp)
            first = min(failure.failures.values(), key=lambda m: (_rank_of(m), m)).removeprefix("CheckpointError: ")
            raise CheckpointError(f"saving the sharded checkpoint {path} failed: {first}; nothing was written") from None


def _save_items(src: Checkpointable, cap: int) -> dict[str, Any]:
    shapes = {r.name: tuple(r.shape) for r in src.checkpoint_params()}
    chunks = _Chunks(cap)
    for k, (shape, held) in _model_boxes(src).items():
        for box, local in held:
            chunks.add_box(f"model.{k}", shape, box, local)
    for h in src.held():
        if h.master is not None:
            chunks.add_region(_master_key(h.name), shapes[h.name], h.region, h.master.detach().reshape(-1))
        _add_state(chunks, h, shapes[h.name])
    sd = chunks.state_dict(src.mesh)
    sd[META_KEY] = _meta_tensor(_meta(src, cap))
    return sd


def _checkpoint_exception() -> type[BaseException]:
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def _discard(tmp: Path) -> None:
    """Rank 0 removes what a failed save wrote (best effort: the error that caused it is what the
    user needs to see)."""
    if dist.get_rank() == 0 and (tmp.exists() or tmp.is_symlink()):
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _clear_tmp(src: Checkpointable, sd: Mapping[str, Any], path: Path, tmp: Path) -> None:
    if dist.get_rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        if path.exists() and not path.is_dir():
            raise CheckpointError(f"{path} exists and is not a directory")


def _write(src: Checkpointable, sd: Mapping[str, Any], path: Path, tmp: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({k: v for k, v in sd.items() if k != _DIGESTS}, storage_writer=dcp.FileSystemWriter(str(tmp)))


_DIGESTS = "\0digests"  # where _hash leaves this rank's file digests for _seal (never saved)


def _hash(src: Checkpointable, sd: dict[str, Any], path: Path, tmp: Path) -> None:
    """Every rank hashes its share of the files (kept in ``sd`` for :func:`_seal`)."""
    sd[_DIGESTS] = dcp_files.hash_files(tmp, dcp_files.data_files(tmp), dist.get_rank(), dist.get_world_size())


def _seal(src: Checkpointable, sd: dict[str, Any], path: Path, tmp: Path) -> None:
    """Rank 0 gathers the digests and writes the seal, the directory's last file."""
    got = Comm(None, src.comm_stats).gather_object(sd[_DIGESTS], dst=0)
    if dist.get_rank() == 0:
        assert got is not None
        dcp_files.write_manifest(tmp, {k: v for share in got for k, v in share.items()})


def _rename(src: Checkpointable, sd: Mapping[str, Any], path: Path, tmp: Path) -> None:
    if dist.get_rank() != 0:
        return
    old = path.with_name(path.name + ".old")
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()
    if path.exists():
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except OSError:
        if old.exists() and not path.exists():
            os.replace(old, path)  # put the previous checkpoint back
        raise
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)


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


def _check_meta(src: Checkpointable, meta: Mapping[str, Any]) -> None:
    check_optimizers(src, meta)
    params = meta.get("params")
    if not isinstance(params, Mapping):
        raise CheckpointError("canzona.meta lacks its parameter table")
    want = {r.name: r for r in src.checkpoint_params()}
    if set(params) != set(want):
        raise CheckpointError(
            f"checkpoint parameters differ from the model's: missing {sorted(set(want) - set(params))[:3]}, "
            f"unexpected {sorted(set(params) - set(want))[:3]}"
        )
    for name, rec in want.items():
        entry = params[name]
        if not isinstance(entry, Mapping) or tuple(entry.get("shape", ())) != rec.shape:
            raise CheckpointError(f"{name}: checkpoint holds shape {entry.get('shape') if isinstance(entry, Mapping) else entry}, the model {list(rec.shape)}")
        if entry.get("kind") != rec.kind:
            raise CheckpointError(
                f"{name}: checkpoint treats it as {entry.get('kind')!r}, this optimizer as {rec.kind!r}; its optimizer state belongs to another optimizer"
            )
    mine = str(src.master_dtype).removeprefix("torch.")
    if meta.get("master_dtype") != mine:
        raise CheckpointError(f"checkpoint holds {meta.get('master_dtype')!r} masters, this optimizer keeps {mine!r}")
    steps = meta.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise CheckpointError(f"checkpoint's step count {steps!r} is not a non-negative integer")
    check_hyper_section(meta.get("hyper"))


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


def _item(md: Any, key: str) -> tuple[tuple[int, ...], torch.dtype]:
    item = md.state_dict_metadata.get(key)
    if item is None:
        raise CheckpointError(f"checkpoint lacks {key!r}")
    size, props = getattr(item, "size", None), getattr(item, "properties", None)
    if size is None or props is None:
        raise CheckpointError(f"{key}: saved as an object, not a tensor")
    return tuple(size), props.dtype


def _dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` lays ``size`` out densely (a permutation of a contiguous layout)."""
    expect = 1
    for st, n in sorted(zip(stride, size)):
        if n > 1 and st != expect:
            return False
        expect *= max(n, 1)
    return True


def _saved_stride(key: str, size: tuple[int, ...], strides: Mapping[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The memory layout a state tensor of ``size`` was saved in (row-major when none was saved)."""
    stride = strides.get(key) or torch.empty(size, device="meta").stride()
    if len(stride) != len(size) or not _dense(size, tuple(stride)):
        raise CheckpointError(f"{key}: saved stride {stride} does not describe a dense tensor of shape {size}")
    return tuple(stride)


class _LoadPlan:
    """Where every region this rank holds goes, and what the optimizer state becomes.

    ``boxes``: key -> (global shape, [(box, destination view)]); the commit pass reads into the
    destinations, the verify pass into views of one scratch buffer of the same shapes.
    ``fresh``: 0-dim and Python-valued entries, read into new tensors (tiny).
    ``states``: (held, {state key: tensor or DCP key of a fresh entry}) assigned after the commit."""

    def __init__(self, src: Checkpointable, md: Any, strides: Mapping[str, tuple[int, ...]], cap: int) -> None:
        self.src, self.cap = src, cap
        self.boxes: dict[str, tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]] = {}
        self.fresh: dict[str, torch.Tensor] = {}
        self.states: list[tuple[Held, dict[str, Any]]] = []
        self.new_state_bytes = 0
        shapes = {r.name: tuple(r.shape) for r in src.checkpoint_params()}
        for k, (want, held) in _model_boxes(src, load=True).items():
            size, _ = _item(md, f"model.{k}")
            if size != want:
                raise CheckpointError(f"model entry {k!r}: checkpoint holds shape {size}, the model {want}")
            for box, local in held:
                self._add(f"model.{k}", size, box, local)
        for h in src.held():
            shape = shapes[h.name]
            if h.master is not None:
                key = _master_key(h.name)
                size, _ = _item(md, key)
                if size != shape:
                    raise CheckpointError(f"{key}: checkpoint holds shape {size}, expected {shape}")
                self._add_region(key, shape, h.region, h.master.detach().view(-1))
            if h.optimizer is not None and h.param is not None:
                self.states.append((h, self._state(md, h, shape, strides)))

    def _add(self, key: str, shape: tuple[int, ...], box: Box, view: torch.Tensor) -> None:
        if math.prod(box[1]) == 0 and shape:
            return
        self.boxes.setdefault(key, (shape, []))[1].extend(((o, tuple(t.shape)), t) for o, t in _slabs(box, view, self.cap))

    def _add_region(self, key: str, shape: tuple[int, ...], region: tuple[Box, ...], flat: torch.Tensor) -> None:
        for box, view in _region_views(region, flat):
            self._add(key, shape, box, view)

    def _fresh(self, key: str, size: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> str:
        if key not in self.fresh:
            self.fresh[key] = torch.empty(size, dtype=dtype, device=device)
        return key

    def _state(self, md: Any, h: Held, shape: tuple[int, ...], strides: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        """The new state of ``h``: existing tensors of the right shape, dtype and layout are reused
        (written in place by the commit pass), others allocated once at their final size."""
        old = h.state()
        dev = h.param.device  # type: ignore[union-attr]
        tensors, pys = _state_keys(md, h.name)
        new: dict[str, Any] = {}
        for k, item in tensors.items():
            key = _state_key(h.name, k)
            size, dtype = _item(md, key)
            if size == ():
                new[k] = self._fresh(key, size, dtype, dev)
                continue
            if h.expert is not None:
                if size[0] != shape[0]:
                    raise CheckpointError(f"{h.name}: state {k!r} has shape {size}, expected one entry per expert ({shape[0]}, ...)")
                local_shape = size[1:]
                stride = _saved_stride(key, local_shape, strides)
            elif h.sliced:
                if size != shape:
                    raise CheckpointError(f"{h.name}: state {k!r} has shape {size}, expected {shape}")
                local_shape = tuple(h.master.shape) if h.master is not None else (sum(math.prod(b[1]) for b in h.region),)
                stride = torch.empty(local_shape, device="meta").stride()
            else:
                local_shape = size
                stride = _saved_stride(key, size, strides)
            t = old.get(k)
            if not (torch.is_tensor(t) and tuple(t.shape) == local_shape and t.dtype == dtype and t.device == dev and t.stride() == tuple(stride)):
                t = torch.empty_strided(local_shape, tuple(stride), dtype=dtype, device=dev)
                self.new_state_bytes += t.numel() * t.element_size()
            new[k] = t
            if h.expert is not None:
                self._add(key, size, expert_box(h.expert, local_shape), t.unsqueeze(0))
            elif h.sliced:
                self._add_region(key, shape, h.region, t.view(-1))
            else:
                self._add(key, size, whole_box(size), t)
        for k in pys:
            key = _py_key(h.name, k)
            size, dtype = _item(md, key)
            if size != ():
                raise CheckpointError(f"{key}: not a 0-dim value")
            new[k] = self._fresh(key, size, dtype, dev)
        return new

    def state_dict(self, *, scratch: torch.Tensor | None) -> dict[str, Any]:
        """DCP destinations: the real ones, or (``scratch``) views of one scratch buffer."""
        chunks = _Chunks(self.cap)
        for key, (shape, boxes) in self.boxes.items():
            for box, view in boxes:
                if scratch is not None:
                    n = view.numel() * view.element_size()
                    view = scratch[:n].view(view.dtype).view(view.shape)
                chunks.add_box(key, shape, box, view)
        out = chunks.state_dict(self.src.mesh)
        out.update(self.fresh)
        return out

    def scratch_bytes(self) -> int:
        return max((v.numel() * v.element_size() for _, boxes in self.boxes.values() for _, v in boxes), default=0)

    def commit(self, meta: Mapping[str, Any]) -> None:
        """After the commit pass wrote masters, state tensors and the model in place: assign the
        new state dicts, restore hyperparameters, let the front end finish."""
        for h, new in self.states:
            st = {}
            for k, v in new.items():
                if isinstance(v, str):  # a fresh entry's DCP key
                    t = self.fresh[v]
                    st[k] = t.item() if ".pystate." in v else t
                else:
                    st[k] = v
            h.optimizer.state[h.param] = st  # type: ignore[union-attr,index]
        restore_hyperparams(self.src, meta["hyper"])
        self.src.finish_load(int(meta["steps"]))


def load_sharded(src: Checkpointable, path: str | os.PathLike[str], *, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Load :func:`save_sharded`'s directory into ``src`` (and its model) at this optimizer's own
    layout (collective over the world group). Refuses a checkpoint that does not fit with one
    :class:`CheckpointError` on every rank, leaving the in-memory state untouched; reads through
    a scratch buffer of at most ``chunk_bytes`` (see the module docstring)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    path = Path(path)
    join_collective(src, "load_sharded()")
    src.finish_param_sync()
    error: BaseException | None = None
    meta: dict[str, Any] = {}
    strides: dict[str, tuple[int, ...]] = {}
    md: Any = None
    files: Mapping[str, Any] = {}
    try:
        files = _verified_files(path)
        try:
            md = dcp_files.read_metadata(path)
            dcp_files.check_metadata(md, files)
        except dcp_files.MetadataRefused as exc:
            raise CheckpointError(f"{path}/.metadata {exc}; refused without loading anything") from None
        except Exception as exc:  # noqa: BLE001 - a corrupt directory must say so, not crash obscurely
            raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: {_first_line(exc)})") from None
        _check_files(path, md)
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    agree_on_checkpoint(src, error, f"reading the sharded checkpoint {path}")
    try:
        meta, strides = _read_meta(dcp_files.SafeFileSystemReader(path, files), md)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        raise CheckpointError(f"{path}: reading the checkpoint failed (canzona.meta: {type(exc).__name__}: {_first_line(exc)})") from None
    plan: _LoadPlan | None = None
    try:
        _check_meta(src, meta)
        plan = _LoadPlan(src, md, strides, chunk_bytes)
    except Exception as exc:  # noqa: BLE001 - every rank must still join the exchange
        error = exc
    agree_on_checkpoint(src, error, f"loading the sharded checkpoint {path}")
    assert plan is not None
    scratch = torch.empty(plan.scratch_bytes(), dtype=torch.uint8, device=src.status_device())
    last_load_stats.clear()
    last_load_stats.update(
        scratch_bytes=scratch.numel(),
        new_state_bytes=plan.new_state_bytes,
        fresh_bytes=sum(t.numel() * t.element_size() for t in plan.fresh.values()),
        regions=sum(len(b) for _, b in plan.boxes.values()),
    )
    for stage, target in (("verify", scratch), ("commit", None)):
        try:
            dcp.load(plan.state_dict(scratch=target), storage_reader=dcp_files.SafeFileSystemReader(path, files))
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP reports any rank's read failure on every rank
            where = "" if stage == "verify" else " after verifying it; the in-memory state is partly overwritten"
            raise CheckpointError(f"{path}: reading the checkpoint failed{where} ({type(exc).__name__}: {_first_line(exc)})") from None
        if stage == "verify":
            del scratch
    with torch.no_grad():
        plan.commit(meta)


def _verified_files(path: Path) -> Mapping[str, Any]:
    """The sealed files of ``path`` after this rank checked the seal, ``.metadata`` and its share
    of the data files (:mod:`canzona.runtime.dcp_files`); CheckpointError naming what is wrong."""
    if not path.is_dir() or not (path / ".metadata").is_file():
        raise CheckpointError(f"not a sharded checkpoint directory (no .metadata): {path}")
    try:
        files = dcp_files.read_manifest(path)
        dcp_files.verify(path, files, dist.get_rank(), dist.get_world_size())
    except (ValueError, OSError) as exc:
        raise CheckpointError(f"{path}: {_first_line(exc)}; refused without loading anything") from None
    return files


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


def _cause(exc: BaseException) -> tuple[int, str]:
    """The first failing rank and its cause, one line: for DCP's CheckpointException (one entry per
    failed rank) its lowest rank's exception, otherwise this rank and ``exc``."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException) and getattr(exc, "failures", None):
        rank, cause = sorted(exc.failures.items(), key=lambda kv: kv[0])[0]
        if isinstance(cause, tuple):  # (exception, traceback frames)
            cause = cause[0]
        return int(rank), f"{type(cause).__name__}: {_first_line(cause)}".rstrip(": ")
    return dist.get_rank(), f"{type(exc).__name__}: {_first_line(exc)}".rstrip(": ")


def _rank_of(message: str) -> int:
    """The rank a save step's message names first (``rank R failed ...``)."""
    head = message.removeprefix("CheckpointError: ").split(" ", 2)
    return int(head[1]) if len(head) > 1 and head[0] == "rank" and head[1].isdigit() else 1 << 30


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
