"""Data integrity for what canzona writes and reads: atomic file writes and tensor checksums.

- :func:`atomic_write` (from :mod:`canzona.fileio`, re-exported here): temp file in the same
  folder, fsync, rename; a failed write leaves the old file intact and no temporary file.
- :func:`tensor_checksum` is a 62-bit checksum of a tensor's bytes (dtype and shape included),
  used per tensor in consolidated checkpoints (a flipped byte is refused on load, naming the
  tensor) and to compare parameter replicas across ranks. It is a position-weighted sum, not a
  cryptographic hash: it detects accidental corruption, not tampering.
"""

from __future__ import annotations

import hashlib

import torch

from canzona.fileio import atomic_write, atomic_writer, check_writable

__all__ = ["atomic_write", "atomic_writer", "check_writable", "hash_text", "tensor_checksum"]

_MASK = (1 << 62) - 1
_CHUNK = 1 << 24  # elements per chunk: bounds the int64 temporaries on large tensors


def tensor_checksum(t: torch.Tensor) -> int:
    """62-bit checksum of ``t``'s bytes, dtype and shape (any device; read in chunks)."""
    t = t.detach()
    flat = t.contiguous().reshape(-1)
    size = flat.element_size()
    word = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    if word is None or flat.dtype == torch.bool:
        flat, word = flat.to(torch.uint8), torch.uint8
    elif flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
        word = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(word) if flat.dtype != word else flat
    total = 0
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK].to(torch.int64)
        # weights 1..65521 by position: a swap of two elements or a flipped byte changes the sum
        w = torch.arange(start, start + part.numel(), dtype=torch.int64, device=part.device) % 65521 + 1
        # wrap-around int64 arithmetic is deterministic, so equal tensors give equal sums
        total = (total + int((part * w).sum()) + start) & _MASK
    head = hash_text(f"{t.dtype}|{tuple(t.shape)}")
    return (total * 1000003 + head) & _MASK


def hash_text(text: str) -> int:
    """A stable 62-bit integer for ``text`` (unlike ``hash``, the same in every process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK
