"""Deferred frees and buffer give-backs re-entered by finalizers.

A collection can run anywhere, inside ``reap()`` too, and run finalizers that hand more
memory to ``gpuio.storage._deferred`` (a handed-over array's owner calls ``release_after``).
Such a re-entry on the same thread must neither hang nor lose an entry. The events here
are small stand-ins for ``cupy.cuda.Event`` (the module reads only ``done``), so that
the bookkeeping runs without a GPU; the GPU contract covers the real events. A lease's
finalizer gives its buffer back to its pool from wherever a collection runs, another
pool's locked code included, so it must not wait for its pool's lock."""

from __future__ import annotations

import gc
import threading
import weakref

from gpuio.storage import _deferred
from gpuio.storage.buffers import BufferPool


class Event:
    """Passed or not, as set; querying it may run a garbage collection first, as any
    allocation in the real query can."""

    def __init__(self, passed=True, collect=False):
        self.passed, self.collect = passed, collect

    @property
    def done(self):
        if self.collect:
            gc.collect()
        return self.passed


class Held:
    """What an entry keeps alive; tells when it is freed."""

    def __init__(self, freed, name):
        weakref.finalize(self, freed.append, name)


def in_thread(body, timeout=10.0):
    """Runs ``body`` on a daemon thread; a hang fails the test instead of the run."""
    errors = []

    def run():
        try:
            body()
        except BaseException as e:  # handed to the test's thread below
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "deadlock: reap() re-entered by a finalizer never returned"
    if errors:
        raise errors[0]


def test_finalizer_reentering_during_reap_neither_hangs_nor_loses_entries():
    freed = []
    waiting = Event(passed=False)

    def body():
        enabled = gc.isenabled()
        gc.disable()  # the cycle below is collected only inside reap, by the event query
        try:
            cycle = Held(freed, "cycle")
            cycle.me = cycle
            # the cycle's finalizer hands two more objects over, as hand_over's owner does
            weakref.finalize(cycle, lambda: (_deferred.keep_until([Event()], Held(freed, "re-entered")),
                                             _deferred.keep_until([waiting], Held(freed, "still in use"))))
            del cycle
            _deferred.keep_until([Event(collect=True)], Held(freed, "first"))
        finally:
            if enabled:
                gc.enable()

    # earlier tests' garbage goes first, untimed: finalizers of loaders and torch DataLoaders
    # join their threads and worker processes, which can take seconds
    gc.collect()
    in_thread(body)
    assert "cycle" in freed and "first" in freed and "re-entered" in freed
    assert "still in use" not in freed  # its stream has not passed the event
    waiting.passed = True
    assert _deferred.reap() == 0
    assert "still in use" in freed


def test_concurrent_keepers_and_reapers_keep_exactly_what_is_still_in_use():
    freed, kept = [], []
    waiting = [Event(passed=False) for _ in range(40)]

    def keeper(k):
        for i in range(200):
            name = f"{k}-{i}"
            if i % 5 == 0:
                kept.append(name)
                _deferred.keep_until([waiting[(k * 200 + i) % 40]], Held(freed, name))
            else:
                _deferred.keep_until([Event(collect=i % 50 == 1)], Held(freed, name))
            _deferred.reap()

    def body():
        threads = [threading.Thread(target=keeper, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    in_thread(body, timeout=60)
    assert not set(kept) & set(freed)  # nothing freed while its event is pending
    assert len(freed) == 4 * 200 - len(kept)
    for e in waiting:
        e.passed = True
    assert _deferred.reap() == 0
    assert len(freed) == 4 * 200


def test_a_lease_given_back_while_its_pool_is_locked_does_not_wait():
    gc.collect()  # earlier tests' garbage first, untimed (see above)
    pool = BufferPool(1 << 20)
    leases = [pool.acquire(1000)]
    held, release = threading.Event(), threading.Event()

    def hold():  # another thread inside the pool's locked code, as in its acquire
        with pool._lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait()
    try:
        in_thread(lambda: (leases.clear(), gc.collect()), timeout=5)  # the lease's finalizer runs here
    finally:
        release.set()
        holder.join()
    again = pool.acquire(1000)  # the buffer given back is lent again: nothing new is allocated
    assert again.nbytes == 1000 and pool.held_bytes == 64 << 10
