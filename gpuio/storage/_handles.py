"""An LRU cache of open file handles shared by reader threads.

Opening a file per read is what makes small-file loading slow on some filesystems,
and a kvikio ``CuFile`` costs two descriptors and a cuFile registration, so handles
stay open across batches. A handle in use is never closed under a reader: eviction
skips it and closes it when its last user lets go.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gpuio._fork import keep_forever, renew_after_fork


class HandleCache:
    def __init__(self, open_fn: Callable[[str], Any], close_fn: Callable[[Any], None],
                 capacity: int) -> None:
        self._open = open_fn
        self._close = close_fn
        self._capacity = max(1, capacity)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, list[Any]] = OrderedDict()  # key -> [handle, users]
        self._doomed: dict[int, list[Any]] = {}  # evicted while in use
        renew_after_fork(self)

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's handles (cuFile ones must not be closed
        here) and a lock a parent's thread may have held; handles reopen on demand."""
        keep_forever([entry[0] for entry in (*self._entries.values(), *self._doomed.values())])
        self._lock = threading.Lock()
        self._entries.clear()
        self._doomed.clear()

    def acquire(self, key: str) -> Any:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry[1] += 1
                return entry[0]
        handle = self._open(key)  # outside the lock: opening may block on I/O
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:  # another thread opened it meanwhile
                entry[1] += 1
                spare = handle
            else:
                self._entries[key] = [handle, 1]
                spare = None
                self._evict()
        if spare is not None:
            self._close(spare)
            return entry[0]
        return handle

    def release(self, key: str, handle: Any) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is handle:
                entry[1] -= 1
                return
            doomed = self._doomed.get(id(handle))
            doomed[1] -= 1
            if doomed[1]:
                return
            del self._doomed[id(handle)]
        self._close(handle)

    def _evict(self) -> None:
        while len(self._entries) > self._capacity:
            key, entry = self._entries.popitem(last=False)
            if entry[1]:
                self._doomed[id(entry[0])] = entry
            else:
                self._close(entry[0])

    def close(self) -> None:
        with self._lock:
            entries = [e for e in self._entries.values() if not e[1]]
            self._entries.clear()
        for handle, _ in entries:
            self._close(handle)
