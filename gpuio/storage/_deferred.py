"""Deferred frees: GPU memory outlives the stream work that reads it.

CuPy's memory pool gives a freed block back to the arena of the stream that allocated
it, and the next allocation on that stream may overwrite it at once, while another
stream (the next pipeline stage's, or torch's) may still have reads of it queued. So
gpuio never drops the last reference to GPU memory that crossed to another stream
directly: it keeps it here until that stream has passed an event recorded after its
last use, and only then drops it (the memory goes back to CuPy's pool, to
nvImageCodec, or, for a batch buffer, to gpuio's pool).

Two places cross streams:

- a pipeline stage on its stream reads arrays made on an earlier stage's stream and
  drops them: ``release_after([stage stream], arrays)`` right after the stage's work
  is queued;
- the loader hands arrays to the consumer (torch's current stream, or CuPy's for
  ``output="numpy"``): ``hand_over`` gives the consumer a CuPy array on the same
  memory whose owner, when the consumer drops it and every view and DLPack tensor
  made from it, records an event on the consumer's stream and passes the original to
  ``release_after``. Work the consumer queues on other streams is the consumer's to
  order (as with ``torch.Tensor.record_stream``).

Entries are checked (``cudaEventQuery``, no wait) on every new entry; ``reap()``
checks them too. CuPy is imported only when a GPU path calls in.

No lock guards the entries: they sit in a deque, whose appends and pops are atomic.
Finalizers call ``release_after`` (a handed-over array's owner going, an array freed in
a stage) whenever the garbage collector runs, which can be on any thread and inside any
code, a ``reap()`` or a ``BufferPool`` call included; a lock taken here would deadlock
such a re-entry on the same thread, or against the pool's lock on another.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

from gpuio import _fork
from gpuio.device import require

__all__ = ["hand_over", "keep_until", "reap", "release_after"]

_pending: deque[tuple[list[Any], Any]] = deque()  # (events, what they keep alive)


def release_after(streams: Iterable[int], obj: Any, device: int) -> None:
    """Keep ``obj`` (arrays, or anything that holds them) alive until each stream in
    ``streams`` (``cudaStream_t`` handles as ints; 0 is the legacy default stream) on
    GPU ``device`` has finished the work queued on it so far."""
    if _fork.parent_used_cuda:  # the parent's memory, in a forked child: no CUDA call is allowed
        _fork.keep_forever([obj])
        return
    cp = require("cupy")
    events = []
    with cp.cuda.Device(device):
        for ptr in streams:
            event = cp.cuda.Event(block=False, disable_timing=True)
            cp.cuda.runtime.eventRecord(event.ptr, ptr)
            events.append(event)
    keep_until(events, obj)


def keep_until(events: list[Any], obj: Any) -> None:
    """Keep ``obj`` alive until every event in ``events`` (objects with a ``done``
    property, as ``cupy.cuda.Event``) has passed; then a ``reap()`` drops it."""
    _pending.append((events, obj))
    reap()


def reap() -> int:
    """Drop what no stream still needs; returns how many entries are still waiting.

    Each entry is popped, checked and, when still needed, appended again: another
    thread, or a finalizer run by a collection in between, may reap or add entries at
    the same time, and no entry is lost or dropped early."""
    done = []
    for _ in range(len(_pending)):
        try:
            entry = _pending.popleft()
        except IndexError:  # a concurrent reap took the rest
            break
        try:
            passed = all(e.done for e in entry[0])
        except BaseException:  # a CUDA error: the entry stays, the error goes to the caller
            _pending.append(entry)
            raise
        (done if passed else _pending).append(entry)
    del done  # dropping may run finalizers, which may call release_after again
    return len(_pending)


class _Owner:
    """What a handed-over array's memory belongs to; see ``hand_over``."""

    __slots__ = ("__weakref__",)


def hand_over(array: Any, stream: int, device: int) -> Any:
    """A CuPy array on the memory of ``array`` for a consumer working on ``stream``
    (a ``cudaStream_t`` as int). When it, its views and the DLPack tensors made from it
    are all gone, an event is recorded on ``stream`` and ``array`` is released once the
    event has passed. Arrays of zero bytes come back as they are."""
    if array.nbytes == 0:
        return array
    cp = require("cupy")
    owner = _Owner()
    done = weakref.finalize(owner, lambda: release_after((stream,), array, device))
    done.atexit = False  # at exit CUDA may be gone; the process frees everything anyway
    base = array.data.mem
    mem = cp.cuda.UnownedMemory(base.ptr, base.size, owner, device)
    return cp.ndarray(array.shape, array.dtype, cp.cuda.MemoryPointer(mem, array.data.ptr - base.ptr),
                      strides=array.strides)
