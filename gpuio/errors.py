"""One error hierarchy for everything gpuio raises on purpose.

Errors about data name the file, the byte offset and the sample or record, so that a
user can find the bad bytes with ``dd`` or a hex editor.
"""

from __future__ import annotations

import errno
import functools

__all__ = [
    "GpuioError",
    "ConfigError",
    "DependencyError",
    "DeviceError",
    "BufferBudgetError",
    "OutOfRangeError",
    "DataError",
    "StorageError",
    "FormatError",
    "PipelineError",
    "open_error",
    "truncated_error",
]


class GpuioError(Exception):
    """Root of every error gpuio raises on purpose."""


class ConfigError(GpuioError, ValueError):
    """A setting or argument has a value gpuio cannot use."""


class DependencyError(GpuioError, ImportError):
    """An optional package is needed for this path; the message names the extra."""


class DeviceError(GpuioError, RuntimeError):
    """A device was asked for that this machine does not have or cannot use."""


class BufferBudgetError(GpuioError, MemoryError):
    """A buffer request does not fit the pool's byte budget."""


class OutOfRangeError(GpuioError, IndexError):
    """A sample or file index outside the dataset."""


class DataError(GpuioError):
    """Bad or unreadable data; names the file, the byte offset and the sample.

    ``str(err)`` reads ``path: sample 17 at byte 90210: what went wrong``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        offset: int | None = None,
        sample: object = None,
    ) -> None:
        self.path = None if path is None else str(path)
        self.offset = offset
        self.sample = sample
        self.reason = message
        where = []
        if sample is not None:
            where.append(f"{sample}" if isinstance(sample, str) else f"sample {sample}")
        if offset is not None:
            where.append(f"at byte {offset}")
        prefix = f"{self.path}: " if self.path else ""
        if where:
            prefix += " ".join(where) + ": "
        super().__init__(prefix + message)

    def __reduce__(self) -> tuple[object, tuple[()]]:  # rebuilt with its keywords (Ray, multiprocessing)
        return functools.partial(type(self), self.reason, path=self.path, offset=self.offset, sample=self.sample), ()


class StorageError(DataError, OSError):
    """A read failed: missing file, permission, or fewer bytes than indexed."""


class FormatError(DataError, ValueError):
    """Bytes that do not follow their format (bad magic, CRC mismatch, bad header)."""


class PipelineError(GpuioError, RuntimeError):
    """An error inside a loader stage; names the stage, the sample and its file.

    The original error is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, stage: str, sample: int | None = None,
                 key: object = None, path: str | None = None) -> None:
        self.stage = stage
        self.sample = sample
        self.key = key
        self.path = path
        self.reason = message
        parts = [f"stage {stage!r}"]
        if sample is not None:
            parts.append(f"sample {sample}")
        if key is not None:
            parts.append(f"key {key!r}")
        if path is not None:
            parts.append(f"file {path}")
        super().__init__(", ".join(parts) + ": " + message)

    def __reduce__(self) -> tuple[object, tuple[()]]:  # rebuilt with its keywords (Ray, multiprocessing)
        return functools.partial(type(self), self.reason, stage=self.stage, sample=self.sample, key=self.key,
                                 path=self.path), ()


def open_error(path: str, exc: OSError) -> StorageError:
    """A gpuio error for a failed open, naming the file and the reason."""
    reason = {
        errno.ENOENT: "file not found (moved or deleted after indexing?)",
        errno.EACCES: "permission denied",
        errno.EISDIR: "is a directory, not a file",
    }.get(exc.errno or 0, exc.strerror or str(exc))
    return StorageError(f"cannot open: {reason}", path=path)


def truncated_error(path: str, offset: int, need: int, got: int) -> StorageError:
    """A gpuio error for a read that ended before the indexed extent did."""
    return StorageError(
        f"file ends before the indexed extent: needed {need} bytes from byte {offset}, "
        f"read {got} (file truncated after indexing?)", path=path, offset=offset + got)
