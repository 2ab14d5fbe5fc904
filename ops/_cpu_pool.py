"""The process's thread pool for ops that split a CPU batch into parts run at once (C
code that releases the GIL: libjpeg, FFmpeg, NVDEC): one thread per core, made anew after a
fork. A part never waits on another part, so the pool cannot deadlock on itself."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from gpuio import _fork

_lock = _fork.RenewedLock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def cpu_pool() -> ThreadPoolExecutor:
    """The pool (made on first use, and anew in a forked child)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(cpu_count(), thread_name_prefix="gpuio-ops"))
        return _pool[1]


def cpu_count() -> int:
    """The pool's threads: the cores."""
    return os.cpu_count() or 1
