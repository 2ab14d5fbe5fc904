"""gpuio in a forked child (torch DataLoader workers, ``multiprocessing`` with fork).

A child made by ``fork()`` has only the thread that forked: the parent's reader
threads do not exist there, a lock one of them held stays locked for good, and CUDA
cannot be used when the parent had initialized it. Objects that own threads, locks or
handles call ``renew_after_fork(self)``; in each forked child their ``_after_fork()``
drops those, and they are made anew when first needed.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from typing import Any

from gpuio.errors import DeviceError

_renewed: weakref.WeakSet[Any] = weakref.WeakSet()
# The parent's GPU-side objects (pinned or device buffers, cuFile handles): kept for
# good in a child, since releasing them there would call into CUDA.
_inherited: list[Any] = []
_cuda_at_fork = False  # whether CUDA was in use in this process when it last forked
parent_used_cuda = False  # in a forked child: whether the parent had CUDA in use


def renew_after_fork(obj: Any) -> None:
    """Call ``obj._after_fork()`` in every forked child, for as long as ``obj`` lives."""
    _renewed.add(obj)


def keep_forever(objects: Any) -> None:
    """Never release ``objects`` in this process (the parent's GPU resources)."""
    _inherited.extend(objects)


class RenewedLock:
    """A lock for module-level state that is new and free in every forked child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        renew_after_fork(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork

    def __enter__(self) -> RenewedLock:
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def refuse_cuda_after_fork() -> None:
    """Raise ``DeviceError`` where CUDA cannot be used: in a child forked from a process
    that had it in use (CUDA's rule; kvikio's threads and pinned memory are the parent's)."""
    if parent_used_cuda:
        raise DeviceError(
            "this process was forked from one that had CUDA in use, and CUDA cannot be used "
            "in such a child; start worker processes with the 'spawn' method (torch DataLoader: "
            "multiprocessing_context='spawn') or read with device='cpu' there")


def _cuda_in_use() -> bool:
    # gpuio imports CuPy only on a GPU path; torch keeps its own flag
    torch = sys.modules.get("torch")
    return "cupy" in sys.modules or bool(torch is not None and torch.cuda.is_initialized())


def _before_fork() -> None:
    global _cuda_at_fork
    _cuda_at_fork = _cuda_in_use()


def _after_fork_in_child() -> None:
    global parent_used_cuda
    parent_used_cuda = parent_used_cuda or _cuda_at_fork
    for obj in list(_renewed):
        obj._after_fork()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
