"""Checks on a dataset's data files before a format indexes them."""

from __future__ import annotations

import os
import stat

from gpuio.errors import DataError, StorageError

__all__: list[str] = []


def regular_file_size(path: str, what: str) -> int:
    """Size in bytes of ``path`` (a ``what``, e.g. ``".rec file"``), checked to be a
    regular file that this process can open for reading: a ``StorageError`` when it
    cannot be opened (missing, permission), a ``DataError`` when it is a directory,
    FIFO, device or socket. Both name the path."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO must not wait
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise StorageError(f"cannot read {what}: {getattr(exc, 'strerror', None) or exc}", path=path) from exc
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
        raise DataError(f"a {what} must be a regular file, this is {kind}", path=path)
    return st.st_size
