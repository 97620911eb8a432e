"""The files of a sharded checkpoint (canzona.runtime.dcp_files), one process: the allow-list
reader of DCP's ``.metadata`` and the seal. The multi-process cases (planted payloads, flipped
bytes on both engines, failed saves) are in tests/test_checkpoint_dcp.py."""

from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from canzona.runtime import dcp_files


def _dcp_dir(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"a": torch.arange(6.0).view(3, 2), "b": torch.tensor(3), "c": torch.zeros(2, dtype=torch.bfloat16)}, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    return out


class _Run:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_real_metadata_passes_the_allow_list(tmp_path: Path) -> None:
    d = _dcp_dir(tmp_path)
    md = dcp_files.read_metadata(d)
    assert set(md.state_dict_metadata) == {"a", "b", "c"}
    found = {m for m, _ in dcp_files.scan_pickle((d / ".metadata").read_bytes())}
    assert "torch.distributed.checkpoint.metadata" in found
    dcp_files.check_metadata(md, dcp_files.data_files(d))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_a_planted_callable_is_refused_before_anything_is_built(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    raw = pickle.dumps(_Run(marker), protocol=protocol)
    with pytest.raises(dcp_files.MetadataRefused, match=r"refers to (posix|nt)\.system, which DCP metadata never holds"):
        dcp_files.scan_pickle(raw)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".metadata").write_bytes(raw)
    with pytest.raises(dcp_files.MetadataRefused):
        dcp_files.read_metadata(tmp_path / "d")
    assert not marker.exists()


def test_an_indirect_class_reference_is_refused(tmp_path: Path) -> None:
    # STACK_GLOBAL whose module comes from a DUP, not from a string push: not decidable statically
    raw = b"\x80\x04\x8c\x05torch\x94\x8c\x04Size\x94\x32\x93."  # PROTO 4, 'torch', 'Size', DUP, STACK_GLOBAL
    with pytest.raises(dcp_files.MetadataRefused, match="only indirectly"):
        dcp_files.scan_pickle(raw)


def test_the_seal_covers_every_file_and_itself(tmp_path: Path) -> None:
    d = _dcp_dir(tmp_path)
    dcp_files.seal(d)
    files = dcp_files.read_manifest(d)
    assert set(files) == {".metadata", *(p.name for p in d.glob("*.distcp"))}
    dcp_files.verify(d, files, 0, 1)
    data = next(d.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="fails its checksum"):
        dcp_files.verify(d, files, 0, 1)
    seal = d / dcp_files.MANIFEST
    seal.write_text(seal.read_text().replace('"version": 1', '"version": 1 '))  # same JSON
    dcp_files.read_manifest(d)
    seal.write_text(seal.read_text().replace('"bytes": ', '"bytes": 1', 1))
    with pytest.raises(ValueError, match="fails its own digest"):
        dcp_files.read_manifest(d)
    (d / "extra.bin").write_bytes(b"x")
    seal.unlink()
    with pytest.raises(ValueError, match="no canzona.checksums.json"):
        dcp_files.read_manifest(d)


def _document() -> dict:
    from canzona.runtime.checkpoint import FORMAT, checksums, document_digest

    doc = {
        "format": FORMAT,
        "version": 3,
        "meta": {"steps": 3, "params": {"w": {"shape": [2, 2], "kind": "matrix", "tp_dim": None}}},
        "params": {"w": torch.arange(4.0).view(2, 2)},
        "state": {"w": {"momentum_buffer": torch.ones(2, 2)}},
        "hyper": {"matrix": {"lr": 0.02, "ns_steps": 5, "nesterov": True, "betas": (0.9, 0.95)}, "elementwise": {}},
    }
    doc["checksums"] = checksums(doc)
    doc["digest"] = document_digest(doc)
    return doc


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["meta"].update(steps=2),
        lambda d: d["hyper"]["matrix"].update(lr=3e-7),
        lambda d: d["hyper"]["matrix"].update(ns_steps=4),
        lambda d: d["hyper"]["matrix"].update(nesterov=False),
        lambda d: d["hyper"]["matrix"].update(betas=[0.9, 0.95]),  # a list where a tuple was
        lambda d: d["state"].update(w={"momentum_bufffer": d["state"]["w"]["momentum_buffer"]}),
        lambda d: d["params"].update(w=d["params"]["w"].t()),
    ],
)
def test_the_document_digest_covers_numbers_names_and_structure(change) -> None:
    from canzona.runtime.checkpoint import CheckpointError, verify_document

    doc = _document()
    verify_document(doc)
    change(doc)
    with pytest.raises(CheckpointError):
        verify_document(doc)


def test_version_2_documents_keep_their_weaker_check_and_a_downgraded_version_3_is_refused() -> None:
    from canzona.runtime.checkpoint import CheckpointError, verify_document

    old = _document()
    del old["digest"]
    old["version"] = 2
    verify_document(old)  # loads as before: per-tensor checksums only (checked by the loader)
    downgraded = _document()
    downgraded["version"] = 2
    with pytest.raises(CheckpointError, match="says version 2 but carries a version-3 digest"):
        verify_document(downgraded)
    for bad in (3.0, True, 4):
        doc = _document()
        doc["version"] = bad
        with pytest.raises(CheckpointError, match="unsupported checkpoint version"):
            verify_document(doc)
