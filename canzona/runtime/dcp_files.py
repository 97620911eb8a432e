"""The files of a sharded checkpoint directory: metadata read without running code, every byte sealed.

``torch.distributed.checkpoint`` (DCP) keeps a directory's index in ``.metadata``, a pickle that
its ``FileSystemReader`` unpickles as it is: a planted ``__reduce__`` runs on every rank that
loads the directory. The data files (``__<rank>_<n>.distcp``) carry no checksum, so a flipped
byte inside a tensor loads silently. A sharded checkpoint is something a user hands in; this
module makes it data:

- :func:`read_metadata` reads ``.metadata`` with an allow-list: a static pass over the pickle's
  opcodes (:func:`scan_pickle`) names every class it would import and refuses anything that DCP
  metadata does not consist of (its dataclasses from ``torch.distributed.checkpoint.metadata``,
  ``filesystem._StorageInfo``, ``torch.Size``, dtypes, layouts and ``pathlib`` paths) *before any
  object is built*; then an unpickler restricted to the same classes builds it, and
  :func:`check_metadata` checks its shape (tensor entries only, data files that the seal lists, no
  stream transforms). :class:`SafeFileSystemReader` is DCP's reader with that ``read_metadata``,
  and it refuses to hand DCP's planner a pickled (``BYTE_IO``) item, which DCP would unpickle.
- :func:`seal` writes ``canzona.checksums.json`` beside the files at save, after every data file
  and ``.metadata`` were written: per file its size and BLAKE2b digest, and a digest of the seal
  itself. The directory is renamed into place only after it (see :func:`canzona.runtime.dcp
  .save_sharded`), so the seal is the last thing a save writes. :func:`verify` checks it before
  anything is loaded: a flipped byte anywhere, a missing or extra file, or a file of another save
  is refused. Hashing is shared out: rank ``r`` of ``R`` hashes every ``R``-th file; every rank
  checks the seal and ``.metadata`` itself, because it unpickles ``.metadata`` next.

The digests detect corruption and mix-ups, not a forger who rewrites the seal too: against that,
the allow-list is what keeps code from running, and the loaders' shape and finiteness checks
what keeps the optimizer sane.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import pickletools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from canzona.runtime.integrity import atomic_write

__all__ = [
    "MANIFEST",
    "MANIFEST_FORMAT",
    "SafeFileSystemReader",
    "check_metadata",
    "file_digest",
    "hash_files",
    "read_manifest",
    "read_metadata",
    "scan_pickle",
    "seal",
    "verify",
    "write_manifest",
]

MANIFEST = "canzona.checksums.json"
MANIFEST_FORMAT = "canzona.dcp.checksums"
MANIFEST_VERSION = 1
METADATA = ".metadata"

_DCP_MD = "torch.distributed.checkpoint.metadata"
#: (module, name) of every class or function DCP's metadata pickle may refer to
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {(_DCP_MD, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                             "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout")}
    | {("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")}
    | {("collections", "OrderedDict")}
)
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"})
_MEMO_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
_NO_STACK_CHANGE = frozenset({"FRAME", "PROTO", "MEMOIZE", *_MEMO_PUT})
_REFUSED_OPS = frozenset({"EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"})


class MetadataRefused(ValueError):
    """``.metadata`` refers to something DCP metadata never holds (it was not unpickled)."""


def _allowed(module: str, name: str) -> bool:
    if (module, name) in _ALLOWED:
        return True
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


def scan_pickle(raw: bytes) -> list[tuple[str, str]]:
    """Every (module, name) the pickle ``raw`` would import, found without unpickling it;
    :class:`MetadataRefused` for one outside the allow-list, for one that cannot be told from the
    opcodes alone, for extension-registry and persistent references, and for a malformed pickle.

    ``STACK_GLOBAL`` takes its module and name from the stack: they are known only when the two
    pushes right before it (memo stores aside) are strings, which is how pickle writes them; any
    other opcode in between makes the reference unknown, and unknown is refused."""
    recent: list[str | None] = []  # what the last pushes were (None: not a known string)
    memo: dict[int, str | None] = {}
    found: list[tuple[str, str]] = []

    def check(module: Any, name: Any) -> None:
        if not (isinstance(module, str) and isinstance(name, str)):
            raise MetadataRefused("refers to a class it names only indirectly; DCP metadata never does")
        if not _allowed(module, name):
            raise MetadataRefused(f"refers to {module}.{name}, which DCP metadata never holds")
        found.append((module, name))

    try:
        for op, arg, _ in pickletools.genops(raw):
            name = op.name
            if name in _REFUSED_OPS:
                raise MetadataRefused(f"uses the pickle opcode {name}, which DCP metadata never does")
            if name in _STRING_OPS:
                recent.append(arg if isinstance(arg, str) else None)
            elif name in _MEMO_GET:
                recent.append(memo.get(arg))
            elif name in _MEMO_PUT or name == "MEMOIZE":
                memo[arg if name != "MEMOIZE" else len(memo)] = recent[-1] if recent else None
            elif name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                check(module, attr)
                recent.append(None)
            elif name == "STACK_GLOBAL":
                check(recent[-2] if len(recent) > 1 else None, recent[-1] if recent else None)
                recent.append(None)
            elif name not in _NO_STACK_CHANGE:
                recent.append(None)
    except MetadataRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed pickle is refused the same way
        raise MetadataRefused(f"is not a well-formed pickle ({type(exc).__name__}: {exc})") from None
    return found


class _AllowListUnpickler(pickle.Unpickler):
    """The second line: even after :func:`scan_pickle` passed, only allowed classes are built."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(module, name):
            raise MetadataRefused(f"refers to {module}.{name}, which DCP metadata never holds")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataRefused("uses a persistent reference, which DCP metadata never does")


def read_metadata(path: str | os.PathLike[str], raw: bytes | None = None) -> Any:
    """The DCP ``Metadata`` of directory ``path`` read through the allow-list (see the module
    docstring); :class:`MetadataRefused` names what was refused, nothing was built by then."""
    from torch.distributed.checkpoint.metadata import Metadata

    if raw is None:
        raw = (Path(path) / METADATA).read_bytes()
    scan_pickle(raw)
    md = _AllowListUnpickler(io.BytesIO(raw)).load()
    if not isinstance(md, Metadata):
        raise MetadataRefused(f"holds a {type(md).__name__}, not DCP metadata")
    return md


def check_metadata(md: Any, files: Iterable[str]) -> None:
    """The metadata's shape: tensor entries with integer sizes and chunks, storage entries that
    point into ``files`` (the seal's data files) with no stream transforms. canzona writes tensors
    only; a pickled (bytes) entry would be unpickled by DCP's planner, so it is refused."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    names = set(files)
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise MetadataRefused("lacks its entry tables")
    for key, item in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(item, TensorStorageMetadata):
            raise MetadataRefused(f"entry {key!r} is not a tensor (canzona writes tensors only)")
        if not isinstance(item.size, torch.Size) or not isinstance(getattr(item.properties, "dtype", None), torch.dtype):
            raise MetadataRefused(f"entry {key!r} has no tensor size or dtype")
        if not isinstance(item.chunks, list):
            raise MetadataRefused(f"entry {key!r} has no chunk list")
    for idx, info in md.storage_data.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise MetadataRefused("a storage entry is not DCP's (index, file range) pair")
        if info.relative_path not in names:
            raise MetadataRefused(f"{idx.fqn}: points into {info.relative_path!r}, which the seal does not list")
        if getattr(info, "transform_descriptors", None):
            raise MetadataRefused(f"{idx.fqn}: stored through stream transforms {info.transform_descriptors!r}; canzona writes none")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0 and info.length >= 0):
            raise MetadataRefused(f"{idx.fqn}: a file range that is not two non-negative integers")


def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import LoadItemType

    class _Reader(FileSystemReader):
        def __init__(self, path: str | os.PathLike[str], files: Iterable[str]) -> None:
            super().__init__(str(path))
            self._canzona_files = tuple(files)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            md = read_metadata(self.path)
            check_metadata(md, self._canzona_files)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

        def read_data(self, plan: Any, planner: Any) -> Any:
            if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
                raise MetadataRefused("asks to unpickle a stored object; canzona reads tensors only")
            return super().read_data(plan, planner)

    _Reader.__name__ = _Reader.__qualname__ = "SafeFileSystemReader"
    return _Reader


_READER: type | None = None


def SafeFileSystemReader(path: str | os.PathLike[str], files: Iterable[str]) -> Any:  # noqa: N802 - a class to its callers
    """DCP's ``FileSystemReader`` over ``path`` reading its metadata through :func:`read_metadata`
    (checked against the sealed data files ``files``) and never unpickling a stored object. Made
    on first use, so importing this module does not import DCP."""
    global _READER
    if _READER is None:
        _READER = _reader_class()
    return _READER(path, files)


# ------------------------------------------------------------------------------------- the seal


def file_digest(path: str | os.PathLike[str]) -> str:
    """BLAKE2b-256 of a file's bytes (hex), read in 1 MiB blocks."""
    h = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _json_digest(body: Mapping[str, Any]) -> str:
    return hashlib.blake2b(json.dumps(body, sort_keys=True, separators=(",", ":")).encode(), digest_size=32).hexdigest()


def hash_files(folder: Path, names: Iterable[str], rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Size and digest of this rank's share of ``names`` (every ``world``-th, from ``rank``)."""
    out: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(sorted(names)):
        if i % world == rank:
            f = folder / name
            out[name] = {"bytes": f.stat().st_size, "blake2b": file_digest(f)}
    return out


def data_files(folder: Path) -> list[str]:
    """Every file in ``folder`` but the seal, sorted (``.metadata`` included)."""
    return sorted(p.name for p in folder.iterdir() if p.name != MANIFEST)


def write_manifest(folder: Path, files: Mapping[str, Mapping[str, Any]]) -> None:
    """Write the seal over ``files`` (name -> size and digest) atomically into ``folder``."""
    body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "files": {k: dict(files[k]) for k in sorted(files)}}
    doc = {**body, "digest": _json_digest(body)}
    atomic_write(folder / MANIFEST, lambda f: f.write(json.dumps(doc, indent=1, sort_keys=True).encode()))


def seal(folder: str | os.PathLike[str]) -> None:
    """Seal a directory in one process (all files hashed here): for a sharded checkpoint written
    by an older canzona, or one you have checked yourself. Its ``.metadata`` must pass the
    allow-list first, so sealing never vouches for a pickle that would run code."""
    folder = Path(folder)
    read_metadata(folder)
    write_manifest(folder, hash_files(folder, data_files(folder), 0, 1))


def read_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """The seal's file table after checking the seal's own digest and that the directory holds
    exactly the sealed files (ValueError naming what is wrong)."""
    f = folder / MANIFEST
    if not f.is_file():
        raise ValueError(
            f"no {MANIFEST}: not written by this canzona's save_sharded (or the save did not finish), so it cannot be "
            "verified; if you trust it, canzona.runtime.dcp_files.seal(path) seals it"
        )
    if f.stat().st_size > 64 * 2**20:
        raise ValueError(f"{MANIFEST} is larger than any seal canzona writes")
    try:
        doc = json.loads(f.read_bytes().decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{MANIFEST} is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or doc.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{MANIFEST} is not a canzona seal of version {MANIFEST_VERSION}")
    body = {k: v for k, v in doc.items() if k != "digest"}
    if doc.get("digest") != _json_digest(body):
        raise ValueError(f"{MANIFEST} fails its own digest (the seal is corrupt)")
    files = doc.get("files")
    if not isinstance(files, dict) or METADATA not in files:
        raise ValueError(f"{MANIFEST} does not list {METADATA}")
    for name, entry in files.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("blake2b"), str)):
            raise ValueError(f"{MANIFEST}: entry {name!r} is not a size and a digest")
    have = set(data_files(folder))
    missing, extra = sorted(set(files) - have), sorted(have - set(files))
    if missing:
        raise ValueError(f"sealed file {missing[0]} is missing")
    if extra:
        raise ValueError(f"{extra[0]} is not one of the sealed files (left by another save?)")
    return files


def verify(folder: Path, files: Mapping[str, Mapping[str, Any]], rank: int, world: int) -> None:
    """Check every sealed file's size, and the digests of this rank's share of them and of
    ``.metadata`` (ValueError naming the file)."""
    for name in sorted(files):  # sizes on every rank: cheap, and every rank then says the same
        size = (folder / name).stat().st_size
        if size != files[name]["bytes"]:
            raise ValueError(f"{name} holds {size} bytes, the seal {files[name]['bytes']} (truncated, or from another save)")
    share = {n for i, n in enumerate(sorted(files)) if i % world == rank} | {METADATA}
    for name in sorted(share):
        f, want = folder / name, files[name]
        if file_digest(f) != want["blake2b"]:
            raise ValueError(f"{name} fails its checksum (a changed byte, or a file from another save)")
