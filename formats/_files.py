"""Checks on a dataset's data files before a format indexes them."""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from gpuio.errors import DataError, StorageError

__all__: list[str] = []


def open_regular_file(path: str, what: str) -> tuple[BinaryIO, int]:
    """``(binary file open for reading, size in bytes)`` of ``path`` (a ``what``, e.g.
    ``".rec file"``), checked to be a regular file: a ``StorageError`` when it cannot
    be opened (missing, permission), a ``DataError`` when it is a directory, FIFO,
    device or socket. Both name the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO must not wait
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise StorageError(f"cannot read {what}: {getattr(exc, 'strerror', None) or exc}", path=path) from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
        raise DataError(f"a {what} must be a regular file, this is {kind}", path=path)
    return os.fdopen(fd, "rb"), st.st_size


def regular_file_size(path: str, what: str) -> int:
    """Size in bytes of ``path``, checked as ``open_regular_file`` does."""
    f, size = open_regular_file(path, what)
    f.close()
    return size
