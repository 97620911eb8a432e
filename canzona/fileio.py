"""Atomic file writes for everything canzona writes (torch-free).

:func:`atomic_write` writes a file so that a reader sees either the old file or the complete new
one, never a truncated mix: the bytes go to a temporary file in the same folder (same file system,
so the final rename is atomic), are flushed and fsync'ed, then ``os.replace`` puts it in place and
the folder is fsync'ed. If anything fails (full disk, read-only folder, an exception in the
writer) the temporary file is removed, the old file is left as it was, and the ``OSError`` names
the path. Every file a canzona command, plan document or checkpoint writes goes through it.
:func:`check_writable` lets a command refuse an unwritable output before doing the work.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "atomic_writer", "check_writable"]


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
