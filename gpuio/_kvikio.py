"""The ``kvikio`` backend: cuFile reads straight into device memory.

With GPUDirect Storage the bytes go from NVMe to GPU memory by DMA; without it (kvikio
"compat mode") kvikio reads through its own pinned bounce buffers. Either way the
batch buffer is a CuPy array and no host copy is made by gpuio.

kvikio's default of one I/O thread is far too low for many small extents, so its thread
pool and task size come from gpuio's ``io_threads`` and ``task_size``. ``CuFile``
handles are cached across batches (opening one costs two descriptors and a cuFile
handle registration) and each batch buffer is registered with cuFile once.
"""

from __future__ import annotations

import os
from typing import Any

from gpuio._handles import HandleCache
from gpuio._posix import open_error, truncated_error
from gpuio.buffers import Lease
from gpuio.device import require
from gpuio.errors import StorageError
from gpuio.index import PathTable
from gpuio.plan import ReadPlan


def _configure(kvikio: Any, threads: int, task_size: int, compat: str) -> None:
    mode = {"auto": "AUTO", "on": "ON", "off": "OFF"}[compat]
    d = kvikio.defaults
    values = {"num_threads": threads, "task_size": task_size,
              "compat_mode": getattr(kvikio.CompatMode, mode)}
    if hasattr(d, "set"):  # kvikio >= 25.04
        for key, value in values.items():
            d.set(key, value)
    else:
        d.num_threads_reset(threads)
        d.task_size_reset(task_size)
        d.compat_mode_reset(values["compat_mode"])


def compat_mode_active() -> bool:
    """True when kvikio reads through POSIX and a bounce buffer instead of GDS."""
    kvikio = require("kvikio")
    d = kvikio.defaults
    if hasattr(d, "is_compat_mode_preferred"):
        return bool(d.is_compat_mode_preferred())
    mode = d.get("compat_mode") if hasattr(d, "get") else d.compat_mode()
    if isinstance(mode, bool):  # kvikio < 24.10
        return mode
    if mode == kvikio.CompatMode.AUTO:  # falls back without libcufile or /run/udev
        return not (_cufile_loads() and os.access("/run/udev", os.R_OK))
    return mode == kvikio.CompatMode.ON


def _cufile_loads() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcufile.so.0")
    except OSError:
        return False
    return True


class KvikioBackend:
    """Reads a plan into a CuPy batch buffer with kvikio ``CuFile.pread``."""

    name = "kvikio"
    align = 1

    def __init__(self, threads: int = 16, task_size: int = 4 << 20, compat: str = "auto",
                 max_open: int = 256) -> None:
        self._kvikio = require("kvikio")
        _configure(self._kvikio, threads, task_size, compat)
        self.compat = compat_mode_active()
        self._handles = HandleCache(self._open, lambda f: f.close(), max_open)
        # Pool storages registered with cuFile, kept until close() so that none is freed
        # while registered. The pool reuses storages, so this stays small.
        self._registered: dict[int, Any] = {}

    def _open(self, path: str) -> Any:
        try:
            os.stat(path)
            if not os.access(path, os.R_OK):
                raise PermissionError(13, "Permission denied", path)
        except OSError as exc:
            raise open_error(path, exc) from exc
        return self._kvikio.CuFile(path, "r")

    def _register(self, lease: Lease) -> None:
        storage = lease._storage
        if id(storage) not in self._registered and not self.compat:
            self._kvikio.memory_register(storage.array)
            self._registered[id(storage)] = storage

    def read(self, plan: ReadPlan, paths: PathTable, lease: Lease) -> None:
        """Fill the device buffer ``lease`` as the plan says."""
        self._register(lease)
        buf = lease.array
        files = [paths[i] for i in plan.task_file.tolist()]
        sizes: dict[str, int] = {}
        pending = []
        try:
            for path, off, length, dest, need in zip(
                    files, plan.task_offset.tolist(), plan.task_length.tolist(),
                    plan.task_dest.tolist(), plan.task_need.tolist()):
                if path not in sizes:
                    try:
                        sizes[path] = os.stat(path).st_size
                    except OSError as exc:
                        raise open_error(path, exc) from exc
                # cuFile does not report short reads past EOF reliably: check the size
                if off + need > sizes[path]:
                    raise truncated_error(path, off, need, max(0, sizes[path] - off))
                length = min(length, sizes[path] - off)
                handle = self._handles.acquire(path)
                pending.append((path, handle, off, length,
                                handle.pread(buf[dest: dest + length], length, off)))
        finally:
            first_error: BaseException | None = None
            for path, handle, off, length, fut in pending:
                try:
                    got = fut.get()
                    if got < length:
                        raise truncated_error(path, off, length, got)
                except StorageError as exc:
                    first_error = first_error or exc
                except RuntimeError as exc:  # kvikio reports I/O failures as RuntimeError
                    first_error = first_error or StorageError(f"cuFile read failed: {exc}", path=path, offset=off)
                finally:
                    self._handles.release(path, handle)
        if first_error is not None:
            raise first_error

    def close(self) -> None:
        for storage in self._registered.values():
            self._kvikio.memory_deregister(storage.array)
        self._registered.clear()
        self._handles.close()
