"""The process's thread pool for ops that split a CPU batch into parts run at once (C
code that releases the GIL: libjpeg, FFmpeg, NVDEC): one thread per core, made anew after a
fork. A part never waits on another part, so the pool cannot deadlock on itself. While a
watcher is registered (``watch_parts``: a loader capturing a trace), each part's run is
told to it."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpuio import _fork

_lock = _fork.RenewedLock()
_pool: tuple[int, ThreadPoolExecutor] | None = None
_watchers: tuple[Callable[[str, float, float], None], ...] = ()


class _Pool(ThreadPoolExecutor):
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:  # map() calls it too
        return super().submit(_timed(fn) if _watchers else fn, *args, **kwargs)


def _timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    name = getattr(fn, "__qualname__", type(fn).__name__)

    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            for watcher in _watchers:
                watcher(name, t0, t1)

    return run


def watch_parts(watcher: Callable[[str, float, float], None], on: bool = True) -> None:
    """Call ``watcher(name, t0, t1)`` (``time.perf_counter`` seconds) on the pool's
    thread after each part it runs from now on; ``on=False`` stops it."""
    global _watchers
    _watchers = tuple(w for w in _watchers if w != watcher) + ((watcher,) if on else ())


def part_watchers() -> int:
    """How many watchers ``watch_parts`` holds now."""
    return len(_watchers)


def cpu_pool() -> ThreadPoolExecutor:
    """The pool (made on first use, and anew in a forked child)."""
    global _pool
    with _lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), _Pool(cpu_count(), thread_name_prefix="gpuio-ops"))
        return _pool[1]


def cpu_count() -> int:
    """The pool's threads: the cores."""
    return os.cpu_count() or 1
