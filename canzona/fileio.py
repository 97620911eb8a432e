"""Atomic file writes and strict JSON reads for every file canzona handles (torch-free).

:func:`atomic_write` writes a file so that a reader sees either the old file or the complete new
one, never a truncated mix: the bytes go to a temporary file in the same folder (same file system,
so the final rename is atomic), are flushed and fsync'ed, then ``os.replace`` puts it in place and
the folder is fsync'ed. If anything fails (full disk, read-only folder, an exception in the
writer) the temporary file is removed, the old file is left as it was, and the ``OSError`` names
the path. Every file a canzona command, plan document or checkpoint writes goes through it.
:func:`check_writable` lets a command refuse an unwritable output before doing the work.

:func:`loads_json` / :func:`read_json` parse every JSON document a user hands in (model configs,
hardware profiles, reports, trace summaries, plans, keyword arguments) with bounded work: a size
limit checked before parsing, a nesting limit (a 200k-deep array would otherwise end in a
``RecursionError``), no ``NaN``/``Infinity`` constants, no number that overflows a float
(``1e999``), no integer longer than 40 digits. Every refusal is a :class:`JSONLimitError`, a
``json.JSONDecodeError`` (so a ``ValueError``), whose message is one line naming the source.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "JSONLimitError",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "atomic_write",
    "atomic_writer",
    "check_writable",
    "loads_json",
    "read_json",
]

#: nesting a canzona document never needs (plans and reports are 4-5 levels deep)
MAX_JSON_DEPTH = 64
#: default size limit of a JSON file read from disk (configs, profiles, plans, reports); trace
#: readers pass a larger one
MAX_JSON_BYTES = 64 << 20
#: digits of the longest integer accepted (2^64 has 20; anything longer is a typo or an attack)
MAX_INT_DIGITS = 40


class JSONLimitError(json.JSONDecodeError):
    """A JSON document refused by :func:`loads_json`; ``str()`` is one line naming the source."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "", 0)
        self.args = (message,)

    def __str__(self) -> str:
        return self.msg


def _target_mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a folder; the rename itself is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "wb", encoding: str | None = None) -> Iterator[IO[Any]]:
    """Context manager yielding a file object whose content replaces ``path`` atomically on exit."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory", str(path))
    if path.exists() and not path.is_file():
        # never rename over a device or a pipe (as root, /dev/full would be replaced)
        raise OSError(22, "not a regular file", str(path))
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        # mkstemp makes the file private (0600); give it the mode a plain open() would have
        os.chmod(tmp, _target_mode(path))
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def atomic_write(path: str | os.PathLike[str], data: str | bytes | Callable[[IO[bytes]], None], *, encoding: str = "utf-8") -> Path:
    """Write ``data`` (text, bytes, or a function writing to a binary file object, e.g.
    ``lambda f: torch.save(doc, f)``) to ``path`` atomically (see the module docstring).
    Returns the path. An ``OSError`` carries the target path as its ``filename``."""
    path = Path(path)
    try:
        with atomic_writer(path, "wb") as f:
            if callable(data):
                data(f)
            elif isinstance(data, str):
                f.write(data.encode(encoding))
            else:
                f.write(data)
    except OSError as exc:
        if exc.filename is None or str(exc.filename) != str(path):
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
        raise
    return path


def check_writable(path: str | os.PathLike[str], what: str = "output") -> Path:
    """Fail early (before the work) when ``path`` cannot be written: a folder, a missing or
    read-only parent folder. Raises ``OSError`` naming the path; writes nothing."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(21, f"{what} is a directory", str(path))
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(2, f"{what} folder {folder} does not exist", str(path))
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise PermissionError(13, f"{what} is not writable", str(path))
    return path


class _Refused(ValueError):
    """Raised from inside a json hook; turned into a JSONLimitError naming the source."""


def _parse_constant(token: str) -> Any:
    raise _Refused(f"{token} is not a finite number")


def _parse_float(token: str) -> float:
    v = float(token)
    if not math.isfinite(v):
        raise _Refused(f"number {token[:40]} overflows a float")
    return v


def _parse_int(token: str) -> int:
    if len(token.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"integer of {len(token.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(token)


def _depth(doc: Any, limit: int) -> int:
    """Nesting depth of a parsed document, walked without recursion; stops above ``limit``."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def loads_json(text: str | bytes, source: str = "JSON", *, max_depth: int = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse ``text`` strictly (see the module docstring); :class:`JSONLimitError` naming
    ``source`` for a document over the limits, with a non-finite or huge number, or malformed."""
    if len(text) > max_bytes:
        raise JSONLimitError(f"{source}: {len(text)} bytes of JSON, above the limit of {max_bytes}")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONLimitError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        doc = json.loads(text, parse_constant=_parse_constant, parse_float=_parse_float, parse_int=_parse_int)
    except _Refused as exc:
        raise JSONLimitError(f"{source}: {exc}") from None
    except RecursionError:
        raise JSONLimitError(f"{source}: JSON nested deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise JSONLimitError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if _depth(doc, max_depth) > max_depth:
        raise JSONLimitError(f"{source}: JSON nested deeper than {max_depth} levels")
    return doc


def read_json(path: str | os.PathLike[str], *, max_depth: int = MAX_JSON_DEPTH, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read and parse a JSON file strictly, its size checked before it is read. ``OSError`` for
    a file that cannot be read (naming it), :class:`JSONLimitError` for its content."""
    path = Path(path)
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise JSONLimitError(f"{path}: {size} bytes of JSON, above the limit of {max_bytes}")
        raw = f.read(max_bytes + 1)
    return loads_json(raw, str(path), max_depth=max_depth, max_bytes=max_bytes)
