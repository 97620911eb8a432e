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
