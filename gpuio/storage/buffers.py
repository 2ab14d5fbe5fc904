"""A pool of batch buffers with a byte budget.

Batch buffers are large, and pinned host memory and device memory are slow to
allocate, so released buffers are kept and reused. The pool never holds more than its
budget: cached buffers are freed to make room, a request that cannot fit even in an
empty pool raises ``BufferBudgetError`` naming the budget and the request, and a request
that fits but finds the budget taken by buffers still in use first has the buffers kept
only to be ahead (a read-ahead's, see ``BufferPool.give_way``) given back, then waits for
one to return.
The process-wide pool (``default_pool()``) takes its budget from ``gpuio.config`` at
each request, so an override of ``buffer_budget`` applies exactly where it is in force.

In a forked child each pool starts empty: buffers lent or cached before the fork stay
the parent's (host buffers are private, copy-on-write mappings), and when the parent
had CUDA in use, host buffers are not pinned (no CUDA call is allowed there).

A ``Lease`` goes back to the pool when the last array viewing it is garbage collected,
so arrays handed to users (and tensors made from them by DLPack) stay valid as long as
they are referenced.
"""

from __future__ import annotations

import mmap
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuio import _fork, config
from gpuio.storage._deferred import reap
from gpuio.device import Device, parse_device, require
from gpuio.errors import BufferBudgetError

__all__ = ["BufferPool", "Lease", "default_pool", "pooled_empty"]


_POLL_S = 0.005  # how often a waiting acquire checks given-back device buffers


def _round_capacity(nbytes: int) -> int:
    """Round up to 1/8 of the next power of two (at least 64 KiB) so sizes repeat."""
    if nbytes <= 64 << 10:
        return 64 << 10
    step = 1 << max(16, nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


class _Storage:
    """One allocation: host (plain or pinned) or device memory, 4 KiB aligned.

    Device and pinned memory are allocations of their own (``cudaMalloc``,
    ``cudaHostAlloc`` of exactly ``capacity`` bytes), not pieces of CuPy's pools: the
    budget counts what is really held, freeing one gives the memory back, cuFile
    registers exactly this allocation, and CuPy's pool never hands it to a stream.
    A device buffer given back is reused only once ``events`` (recorded on the
    releasing threads' streams) have passed; see ``gpuio.storage._deferred``.
    """

    def __init__(self, capacity: int, device: Device, pinned: bool) -> None:
        self.capacity = capacity
        self.device = device
        self.pinned = pinned
        self.events: list[Any] = []
        self._gds: Any = None  # once registered with cuFile: the finalizer that deregisters
        if device.is_cuda:
            cp = require("cupy")
            with cp.cuda.Device(device.index):
                self._mem = cp.cuda.Memory(capacity)  # 256-byte aligned or better
                self.array = cp.ndarray((capacity,), cp.uint8, cp.cuda.MemoryPointer(self._mem, 0))
        elif pinned:
            cp = require("cupy")
            self._mem = cp.cuda.PinnedMemory(capacity)  # page aligned
            self.array = np.frombuffer(cp.cuda.PinnedMemoryPointer(self._mem, 0), dtype=np.uint8, count=capacity)
        else:
            # Anonymous mmap: page aligned (O_DIRECT's rule) and, where the kernel has
            # transparent huge pages, backed by 2 MiB pages, so that filling a fresh
            # batch buffer costs few page faults and TLB misses.
            self._mem = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE)  # a forked child gets a copy
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._mem.madvise(mmap.MADV_HUGEPAGE)
            self.array = np.frombuffer(self._mem, dtype=np.uint8, count=capacity)

    def idle(self) -> bool:
        """No stream still uses this buffer (always true for host memory)."""
        # removed one by one, never by rebinding the list: a finalizer (_record_release)
        # may append an event at any moment
        for e in [e for e in self.events if e.done]:
            self.events.remove(e)
        return not self.events

    def register_gds(self, kvikio: Any) -> None:
        """Register this device buffer with cuFile, once. ``memory_register`` covers the
        whole allocation, which is exactly this buffer. It is deregistered before the
        memory is freed: by ``close`` or, when the pool itself goes, by the finalizer
        (which holds the memory until then)."""
        if self._gds is None:
            kvikio.memory_register(self.array)
            self._gds = weakref.finalize(self, kvikio.memory_deregister, self.array)
            self._gds.atexit = False

    def close(self) -> int:
        """Free the memory now (the pool evicts it); returns its capacity in bytes."""
        for e in self.events:
            e.synchronize()
        if self._gds is not None:
            self._gds()  # deregisters, once
        self.array = self._mem = None
        return self.capacity

    def device_array(self, nbytes: int, owner: Any) -> Any:
        """A CuPy uint8 array over the first ``nbytes``, built on the pointer (CuPy
        synchronizes the current stream when it takes ``__cuda_array_interface__``).
        It keeps ``owner`` alive; when it and its views are gone, an event on the
        releasing thread's current stream guards the buffer's reuse."""
        cp = require("cupy")
        user = _User()
        gone = weakref.finalize(user, self._record_release)
        gone.atexit = False
        user.owner = owner
        mem = cp.cuda.UnownedMemory(self.array.data.ptr, nbytes, user, self.device.index)
        return cp.ndarray((nbytes,), cp.uint8, cp.cuda.MemoryPointer(mem, 0))

    def _record_release(self) -> None:
        if _fork.parent_used_cuda:  # a forked child's copy of the parent's buffer: no CUDA here
            return
        cp = require("cupy")
        with cp.cuda.Device(self.device.index):
            event = cp.cuda.Event(block=False, disable_timing=True)
            event.record(cp.cuda.get_current_stream())
        self.events.append(event)


class _User:
    """Owner of one ``Lease.array`` on the device: it holds the lease."""

    __slots__ = ("owner", "__weakref__")


class Lease:
    """A batch buffer on loan from a pool; returned when no array views it any more.

    ``lease.array`` is a 1-D uint8 NumPy (host) or CuPy (device) array of ``nbytes``.
    Keep using only the arrays it hands out: they keep the lease alive.
    """

    def __init__(self, pool: BufferPool, storage: _Storage, nbytes: int) -> None:
        self._storage = storage
        self.nbytes = nbytes
        self.device = storage.device
        weakref.finalize(self, pool._give_back, storage, pool._generation)

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return self._storage.array[: self.nbytes].__array_interface__

    def register_gds(self, kvikio: Any) -> None:
        """Register the whole pooled buffer behind this lease with cuFile (once per buffer)."""
        self._storage.register_gds(kvikio)

    @property
    def array(self) -> Any:
        """A fresh array over the buffer; it (and its views) keep the lease alive."""
        if self.device.is_cuda:
            return self._storage.device_array(self.nbytes, self)
        return np.asarray(self)


class BufferPool:
    """Reusable batch buffers, at most ``budget`` bytes per pool. With ``budget=None``
    the pool follows the ``buffer_budget`` setting in force at each ``acquire``."""

    def __init__(self, budget: int | None = None, *, wait_s: float = 60.0) -> None:
        self._budget = None if budget is None else int(budget)
        self.wait_s = wait_s
        self._lock = threading.Condition()
        self._free: list[_Storage] = []
        # buffers given back by leases' finalizers, which run wherever a collection
        # does, other pools' locked code included: they append here and never take the
        # lock (two pools would deadlock, each finalizer waiting for the other's lock);
        # the pool moves them to _free under its lock, and a waiting acquire polls
        self._returned: deque[_Storage] = deque()
        self._held = 0  # bytes allocated, in use or free
        self._givers: list[weakref.WeakMethod[Callable[[], object]]] = []  # see give_way
        self._generation = 0  # forks seen: a buffer lent in an earlier one is not ours
        _fork.renew_after_fork(self)

    def _after_fork(self) -> None:
        _fork.keep_forever([s for s in [*self._free, *self._returned] if s.device.is_cuda or s.pinned])
        self._lock = threading.Condition()  # a parent's thread may have held it
        self._free = []
        self._returned = deque()
        self._held = 0
        self._generation += 1

    @property
    def budget(self) -> int:
        """Bytes this pool may hold now."""
        return int(config.get("buffer_budget")) if self._budget is None else self._budget

    @property
    def held_bytes(self) -> int:
        """Bytes of buffers the pool holds now, leased and free."""
        return self._held

    def charge(self, nbytes: int) -> int:
        """Bytes of the budget that a buffer of ``nbytes`` takes (sizes are rounded up
        so that they repeat, unless the rounded size would not fit the budget)."""
        capacity = _round_capacity(max(int(nbytes), 1))
        return capacity if capacity <= self.budget else int(nbytes)

    def acquire(self, nbytes: int, device: str | Device = "cpu", *, pinned: bool = False) -> Lease:
        """Lend a buffer of at least ``nbytes`` bytes on ``device``. Where the budget has no
        room, the holders of buffers kept only to be ahead (see ``give_way``) give them
        back, and it waits up to ``wait_s`` for buffers in use to return."""
        device, pinned, budget, capacity = self._request(nbytes, device, pinned)
        if capacity > budget:
            raise BufferBudgetError(
                f"a batch buffer of {nbytes:,} bytes was requested, but the buffer budget is "
                f"{budget:,} bytes; raise it with gpuio.config.override(buffer_budget=...) "
                f"or GPUIO_BUFFER_BUDGET, or use a smaller batch")
        deadline = time.monotonic() + self.wait_s
        while True:
            if device.is_cuda:
                # batches whose streams are done return their buffers first; outside the
                # lock, because what reap drops runs finalizers that take other locks
                reap()
            with self._lock:
                got = self._take(nbytes, capacity, device, pinned, budget, budget)
                held = self._held
            if got is not False:
                return self._lend(got, nbytes, capacity, device, pinned)
            left = deadline - time.monotonic()
            if left <= 0:
                raise BufferBudgetError(
                    f"waited {self.wait_s:.0f} s for {capacity:,} bytes of batch buffer, but "
                    f"{held:,} of the {budget:,}-byte budget stay in use; release "
                    f"references to old batches or raise buffer_budget")
            self._make_way()
            with self._lock:
                self._lock.wait(min(left, _POLL_S))  # given-back buffers arrive unnotified

    def try_acquire(self, nbytes: int, device: str | Device = "cpu", *, pinned: bool = False,
                    keep: int = 0) -> Lease | None:
        """``acquire`` without waiting and without asking anyone to give way: None where the
        buffers in use leave less than the buffer and ``keep`` bytes more (the room that
        others' buffers need) of the budget."""
        device, pinned, budget, capacity = self._request(nbytes, device, pinned)
        with self._lock:
            got = self._take(nbytes, capacity, device, pinned, budget, budget - int(keep))
        return None if got is False else self._lend(got, nbytes, capacity, device, pinned)

    def give_way(self, release: Callable[[], object]) -> None:
        """Have ``release``, a bound method, called whenever an ``acquire`` would wait for room
        (outside the pool's lock, in the waiting thread): its object holds buffers only to be
        ahead (a read-ahead) and gives them back. Held weakly: it ends with its object."""
        with self._lock:
            self._givers.append(weakref.WeakMethod(release))

    def _make_way(self) -> None:
        with self._lock:
            self._givers = [g for g in self._givers if g() is not None]
            calls = [g() for g in self._givers]
        for call in calls:
            if call is not None:
                call()

    def _request(self, nbytes: int, device: str | Device, pinned: bool) -> tuple[Device, bool, int, int]:
        """A request's device, whether pinned, the budget in force and the capacity to take."""
        device = parse_device(device)
        if device.is_cuda:
            _fork.refuse_cuda_after_fork()  # also for readers made before the fork
        pinned = pinned and not device.is_cuda and not _fork.parent_used_cuda
        budget = self.budget
        capacity = _round_capacity(max(int(nbytes), 1))
        return device, pinned, budget, capacity if capacity <= budget else int(nbytes)

    def _take(self, nbytes: int, capacity: int, device: Device, pinned: bool, budget: int,
              room: int) -> _Storage | bool:
        """Under the lock: a free buffer that fits, else True where ``capacity`` bytes were
        counted in (free buffers freed to make room), else False: the buffers in use and
        this one would pass ``room`` bytes."""
        self._take_returned()
        in_use = self._held - sum(s.capacity for s in self._free)
        fit = [s for s in self._free if s.device == device and s.pinned == pinned
               and nbytes <= s.capacity <= 2 * capacity and in_use + s.capacity <= room and s.idle()]
        if fit:
            # the smallest; of equal ones the last given back, whose memory the CPU cache
            # most likely still holds (eviction takes the oldest)
            best = min(reversed(fit), key=lambda s: s.capacity)
            self._free.remove(best)
            return best
        if in_use + capacity > room:
            return False
        while self._free and self._held + capacity > budget:
            self._held -= self._free.pop(0).close()
        self._held += capacity
        return True

    def _lend(self, got: _Storage | bool, nbytes: int, capacity: int, device: Device, pinned: bool) -> Lease:
        """A lease of the free buffer ``got``, or of a new one of ``capacity`` bytes (counted in)."""
        if isinstance(got, _Storage):
            return Lease(self, got, int(nbytes))
        try:
            storage = _Storage(capacity, device, pinned)
        except BaseException:
            with self._lock:
                self._held -= capacity
                self._lock.notify_all()
            raise
        return Lease(self, storage, int(nbytes))

    def _give_back(self, storage: _Storage, generation: int) -> None:
        if generation != self._generation:  # lent before this process forked: the parent's
            if storage.device.is_cuda or storage.pinned:
                _fork.keep_forever([storage])
            return
        self._returned.append(storage)  # no lock: see __init__

    def _take_returned(self) -> None:
        """Move the given-back buffers to the free list (under the lock)."""
        while self._returned:
            self._free.append(self._returned.popleft())

    def clear(self) -> None:
        """Free every cached buffer (buffers in use return later and are kept)."""
        with self._lock:
            self._take_returned()
            for s in self._free:
                self._held -= s.close()
            self._free.clear()


_default: BufferPool | None = None
_default_lock = _fork.RenewedLock()


def default_pool() -> BufferPool:
    """The process-wide pool that ``gpuio.read`` uses; its budget is the setting in force
    at each request."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BufferPool()
        return _default


def pooled_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized host array from the default pool: big batch outputs reuse
    memory that is already mapped (huge pages), instead of page-faulting in fresh
    memory every batch. It returns to the pool when no view of it remains."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return default_pool().acquire(nbytes).array.view(dtype).reshape(shape)
