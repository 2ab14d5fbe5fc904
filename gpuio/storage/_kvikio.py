"""The ``kvikio`` backend: cuFile reads straight into device memory.

With GPUDirect Storage the bytes go from NVMe to GPU memory by DMA. Without it they go
through host memory, in one of two ways: kvikio's own "compat mode" never calls cuFile
and reads with POSIX into its pinned bounce buffers; or kvikio calls cuFile, and cuFile
runs in *its* compat mode (no nvidia-fs kernel driver: POSIX reads into cuFile's bounce
buffers). Only the driver tells the two cuFile cases apart: ``gds_status()`` asks it
(``kvikio.cufile_driver.get("is_gds_available")``) and looks for nvidia-fs
(``/proc/driver/nvidia-fs``), and ``gpuio info`` reports what it says. Either way the
batch buffer is a CuPy array and no host copy is made by gpuio.

kvikio's default of one I/O thread is far too low for many small extents, so its thread
pool and task size come from gpuio's ``io_threads`` and ``task_size``. ``CuFile``
handles are cached across batches (opening one costs two descriptors and a cuFile
handle registration). Where GDS is in use, each device batch buffer is registered with
cuFile once, by the buffer pool that owns it (``_Storage.register_gds``), and
deregistered when the pool frees it. A registration cuFile refuses (its BAR1 or pinned
limits) is not an error: cuFile also reads into unregistered device memory, through
its own staging buffers, so the backend warns once, stops registering and reads on.

``import kvikio`` loads libkvikio, libcufile and rapids-logger; ``load()`` does it on
first use and turns a failure into a ``DependencyError`` that names the library and
the pip package that brings it (``kvikio_problem()`` gives the same reason as text, for
``backend="auto"`` and ``gpuio info``).
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import warnings
from types import ModuleType
from typing import Any

from gpuio.storage._handles import HandleCache
from gpuio.storage.buffers import Lease
from gpuio.errors import DependencyError, StorageError, open_error, truncated_error
from gpuio.index import PathTable
from gpuio.storage.plan import ReadPlan

__all__ = ["NVIDIA_FS", "KvikioBackend", "compat_mode_active", "gds_status", "kvikio_problem", "load"]

# a shared library or module kvikio loads -> the pip package that brings it
_PACKAGES = {
    "libcufile": "nvidia-cufile (CUDA 13) or nvidia-cufile-cu12 (CUDA 12)",
    "libkvikio": "libkvikio-cu13 or libkvikio-cu12",
    "librapids_logger": "rapids-logger",
    "libcuda": "the NVIDIA driver (not a pip package)",
    "libcudart": "nvidia-cuda-runtime (CUDA 13) or nvidia-cuda-runtime-cu12",
    "cuda": "cuda-pathfinder",
    "kvikio": "kvikio-cu13 or kvikio-cu12",
}


@functools.lru_cache(maxsize=1)
def load() -> ModuleType:
    """``kvikio`` with ``kvikio.defaults`` imported (``import kvikio`` alone does not
    import that submodule), or a ``DependencyError`` naming what is missing."""
    try:
        kvikio = importlib.import_module("kvikio")
        importlib.import_module("kvikio.defaults")
    except (ImportError, OSError, RuntimeError) as exc:  # cuda.pathfinder: RuntimeError
        text = f"{type(exc).__name__}: {exc}".splitlines()[0]
        found = re.search(r"\b(lib[A-Za-z0-9_]+)\.so", text)
        missing = found.group(1) if found else (getattr(exc, "name", None) or "").split(".")[0]
        package = _PACKAGES.get(missing)
        hint = f"; {missing} comes from the pip package {package}" if package else ""
        raise DependencyError(f"kvikio cannot be loaded ({text}){hint}; pip install 'gpuio[cu13]' "
                              f"(or [cu12]) installs kvikio and what it loads") from exc
    return kvikio


def kvikio_problem() -> str | None:
    """Why kvikio cannot be used here (the ``load()`` error), or None when it loads."""
    try:
        load()
    except DependencyError as exc:
        return str(exc)
    return None


def _configure(kvikio: Any, threads: int, task_size: int, compat: str) -> None:
    mode = {"auto": kvikio.CompatMode.AUTO, "on": kvikio.CompatMode.ON, "off": kvikio.CompatMode.OFF}[compat]
    kvikio.defaults.set({"num_threads": threads, "task_size": task_size, "compat_mode": mode})


def compat_mode_active() -> bool:
    """True when kvikio reads through POSIX and a bounce buffer instead of GDS (with
    ``compat_mode`` AUTO, kvikio decides this from libcufile and the driver)."""
    kvikio = load()
    return bool(kvikio.defaults.is_compat_mode_preferred())


# present while the nvidia-fs kernel module, GDS's driver, is loaded
NVIDIA_FS = "/proc/driver/nvidia-fs"


def gds_status() -> tuple[bool, str]:
    """Whether kvikio's reads use GPUDirect Storage here, and how they go, in words.

    GDS only when kvikio calls cuFile (not its own compat mode), the nvidia-fs driver
    is loaded and cuFile's driver properties report it (``is_gds_available``; where
    this kvikio cannot tell, nvidia-fs alone decides). Otherwise cuFile reads with
    POSIX in its compat mode. (cuFile may still fall back per file, on a file system
    GDS does not support.)"""
    kvikio = load()
    if compat_mode_active():
        return False, "kvikio compat mode: POSIX reads + bounce buffers, no cuFile, no GDS"
    nvfs = os.path.exists(NVIDIA_FS)
    unknown = None
    try:
        available = bool(importlib.import_module("kvikio.cufile_driver").get("is_gds_available"))
    except (ImportError, AttributeError, KeyError, RuntimeError) as exc:  # older kvikio; a driver that will not open
        available, unknown = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
    version = getattr(kvikio, "__version__", "?")
    if not nvfs or available is False:
        why = f"no nvidia-fs driver ({NVIDIA_FS} absent)" if not nvfs else "cuFile reports no GDS driver"
        return False, f"kvikio {version} (cuFile compat mode: POSIX reads; {why})"
    if available is None:
        return True, f"GDS (kvikio {version}; nvidia-fs loaded, cuFile's driver properties unreadable: {unknown})"
    return True, f"GDS (kvikio {version}; cuFile with the nvidia-fs driver)"


class KvikioBackend:
    """Reads a plan into a CuPy batch buffer with kvikio ``CuFile.pread``."""

    name = "kvikio"
    align = 1

    def __init__(self, threads: int = 16, task_size: int = 4 << 20, compat: str = "auto",
                 max_open: int = 256) -> None:
        self._kvikio = load()
        _configure(self._kvikio, threads, task_size, compat)
        self.compat = compat_mode_active()
        self.gds, self.how = gds_status()  # how = gds_status's words, for reports
        self.unregistered: str | None = None  # why buffers are no longer registered with cuFile
        self._handles = HandleCache(self._open, lambda f: f.close(), max_open)

    def _open(self, path: str) -> Any:
        kvikio = self._kvikio
        try:
            os.stat(path)
            if not os.access(path, os.R_OK):
                raise PermissionError(13, "Permission denied", path)
        except OSError as exc:
            raise open_error(path, exc) from exc
        try:
            return kvikio.CuFile(path, "r")
        except (RuntimeError, ValueError, OSError) as exc:  # kvikio reports open failures as RuntimeError
            raise StorageError(f"cuFile cannot open the file: {exc}", path=path, offset=0) from exc

    def read(self, plan: ReadPlan, paths: PathTable, lease: Lease) -> None:
        """Fill the device buffer ``lease`` as the plan says."""
        if self.gds and self.unregistered is None:
            try:
                lease.register_gds(self._kvikio)
            except RuntimeError as exc:  # cuFile reads unregistered memory too: through its staging buffers
                self.unregistered = f"cuFile cannot register a {lease.nbytes:,}-byte batch buffer: {exc}"
                warnings.warn(f"{self.unregistered}; reading into unregistered GPU memory from now on (slower)",
                              RuntimeWarning, stacklevel=2)
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
                try:
                    future = handle.pread(buf[dest: dest + length], length, off)
                except (RuntimeError, ValueError, OSError) as exc:
                    self._handles.release(path, handle)
                    raise StorageError(f"cuFile read of {length} bytes failed: {exc}", path=path,
                                       offset=off) from exc
                pending.append((path, handle, off, length, future))
        finally:
            first_error: BaseException | None = None
            for path, handle, off, length, future in pending:
                try:
                    got = future.get()
                    if got < length:
                        raise truncated_error(path, off, length, got)
                except StorageError as exc:
                    first_error = first_error or exc
                except (RuntimeError, ValueError, OSError) as exc:  # kvikio reports I/O failures as RuntimeError
                    first_error = first_error or StorageError(f"cuFile read failed: {exc}", path=path, offset=off)
                finally:
                    self._handles.release(path, handle)
        if first_error is not None:
            raise first_error

    def close(self) -> None:
        """Close the cached file handles (the buffer pool owns the GDS registrations)."""
        self._handles.close()
