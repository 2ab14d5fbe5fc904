"""The node-local cache tier of remote data.

Remote bytes are kept on local disk, in ``remote_cache_dir`` (default
``<cache_dir>/remote``), as whole objects up to ``remote_block`` bytes and as aligned
blocks of that size of larger ones. A block's file name is derived from the object's
URL, ETag and size, so a replaced object never maps to the old bytes.

Rules:

- a block is written to a temporary file (``.part``) and renamed into place: a reader
  sees a whole block or none;
- one download per block on the node: the process that creates ``<block>.part``
  (``O_EXCL``) downloads into it, the others wait for the block (a ``.part`` older than
  the stall limit, ``remote_timeout`` x (``remote_retries`` + 1) seconds, is left by a
  dead or hung process and is taken over);
- a block is used only when its size is the one expected; a block of another size
  (cut short, overwritten) is downloaded again;
- the cache holds at most ``remote_cache_budget`` bytes: past it, the least recently
  used blocks (by modification time, touched at each use) go first, never a block of
  the batch being read;
- a full cache disk (ENOSPC, EDQUOT, EFBIG) is a warning: the batch gets the bytes it
  downloaded, and they are not kept;
- the reads themselves are the posix backend's, from the block files: a later epoch
  reads local disk only.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from gpuio import config
from gpuio.errors import StorageError
from gpuio.index import PathTable
from gpuio.storage.buffers import Lease
from gpuio.storage.plan import ReadPlan

__all__ = ["BlockCache", "cache_folder"]

_POLL_S = 0.005  # first wait for a block another process downloads; doubles up to _POLL_MAX_S
_POLL_MAX_S = 0.1
# a cache disk that is full (or a file size limit): the reads go on without caching
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_RECHECK_S = 30.0  # a block found whole is looked at again (stat, touch for LRU) after this long
_PATHS_KEPT = 1 << 20  # block paths and checks remembered, at most
_EVICT_SHARE = 8  # the folder is scanned for eviction after downloads of budget / this many bytes


def cache_folder() -> str:
    """The folder of the remote cache (``remote_cache_dir``, else ``<cache_dir>/remote``)."""
    folder = config.get("remote_cache_dir")
    if not folder:
        base = config.get("cache_dir") or os.path.join(os.path.expanduser("~"), ".cache", "gpuio")
        folder = os.path.join(base, "remote")
    return folder


class BlockCache:
    """Blocks of remote objects on local disk, read through the posix backend."""

    def __init__(self, fetch: Callable[[str, int, memoryview, str | None], Any] | None = None) -> None:
        """``fetch(url, offset, out, etag)`` fills ``out`` with the object's bytes from
        ``offset`` (``gpuio.storage.remote``'s ranged GET); None for a cache that only
        reads and evicts."""
        from gpuio.storage._posix import PosixBackend, native_available

        self.fetch = fetch

        self.root = cache_folder()
        self.block = max(4096, config.get("remote_block"))
        self.budget = config.get("remote_cache_budget")
        # a download running longer than every try of it may take is left by a dead or hung process
        self.stale_s = max(1, config.get("remote_timeout")) * (max(1, config.get("remote_retries")) + 1)
        self._posix = PosixBackend(config.get("io_threads"), False, "gpuio-cache-read",
                                   native=config.get("native") and native_available())
        self._added = 0
        self._lock = threading.Lock()
        # blocks this process found whole, and when: not looked at again (stat, touch)
        # for _RECHECK_S; a block another process evicts meanwhile fails the posix read,
        # and the batch is made present again with every block looked at
        self._seen: dict[str, float] = {}
        self._warned_full = False
        self._paths: dict[tuple[str, str, int, int], str] = {}

    def path(self, info: Any, block: int) -> str:
        """The file of block ``block`` of the object ``info`` (an ``ObjectInfo``)."""
        key = (info.url, info.etag, info.size, block)
        path = self._paths.get(key)
        if path is None:
            tag = hashlib.sha256(f"{info.url}\0{info.etag}\0{info.size}".encode()).hexdigest()[:40]
            path = self._paths[key] = os.path.join(self.root, tag[:2], f"{tag}.{block}")
            if len(self._paths) > _PATHS_KEPT:
                self._paths.clear()
        return path

    def read(self, plan: ReadPlan, infos: list[Any], inverse: np.ndarray, lease: Lease,
             pool: ThreadPoolExecutor) -> None:
        """Fill ``lease`` as ``plan`` says (task ``k`` reads object ``infos[inverse[k]]``):
        the blocks the tasks touch are made present, then read from their files."""
        B = self.block
        sizes = np.array([i.size for i in infos], dtype=np.int64)[inverse]
        start = plan.task_offset
        end = np.minimum(start + plan.task_length, sizes)  # a merge gap never runs past the end
        short = np.flatnonzero(end < start + plan.task_need)
        if short.size:
            k = int(short[0])
            raise StorageError(f"the object has {int(sizes[k])} bytes, the index needs bytes up to "
                               f"{int(start[k] + plan.task_need[k])} (replaced after indexing?)",
                               path=infos[int(inverse[k])].url, offset=int(start[k]))
        first, last = start // B, (end - 1) // B
        counts = np.where(end > start, last - first + 1, 0)
        task = np.repeat(np.arange(len(start)), counts)
        block = first[task] + np.arange(len(task)) - np.repeat(np.cumsum(counts) - counts, counts)
        p_start = np.maximum(start[task], block * B)
        p_end = np.minimum(end[task], (block + 1) * B)
        obj = inverse[task].astype(np.int64)
        keys, which = np.unique(np.stack([obj, block]), axis=1, return_inverse=True)
        which = which.reshape(-1).astype(np.int64)
        wanted = [(infos[int(o)], int(b)) for o, b in keys.T.tolist()]
        paths = [self.path(info, b) for info, b in wanted]
        p_off, p_len = p_start - block * B, p_end - p_start
        p_dest = plan.task_dest[task] + (p_start - start[task])
        view = lease.array
        for attempt in range(2):
            now_s = time.monotonic()
            if attempt:
                self._seen.clear()
            todo = [k for k, path in enumerate(paths) if now_s - self._seen.get(path, -_RECHECK_S) >= _RECHECK_S]
            futures = [pool.submit(self.ensure, *wanted[k], paths[k]) for k in todo]
            fresh: list[Any] = [None] * len(paths)
            first_error = None
            for k, fut in zip(todo, futures):
                exc = fut.exception()
                if exc is not None and first_error is None:
                    first_error = exc
                fresh[k] = None if exc is not None else fut.result()
            if first_error is not None:
                raise first_error
            if len(self._seen) > _PATHS_KEPT:
                self._seen.clear()
            self._seen.update((paths[k], now_s) for k in todo)
            # blocks downloaded just now are copied from memory; the others read from their files
            now = np.array([f is not None for f in fresh], dtype=bool)[which]
            for k in np.flatnonzero(now).tolist():
                src, off, n, dest = fresh[which[k]], int(p_off[k]), int(p_len[k]), int(p_dest[k])
                view[dest: dest + n] = np.frombuffer(src, dtype=np.uint8, count=n, offset=off)
            old = ~now
            local = ReadPlan(task_file=which[old], task_offset=p_off[old], task_length=p_len[old],
                             task_dest=p_dest[old], task_need=p_len[old], sample_dest=plan.sample_dest,
                             sample_length=plan.sample_length, nbytes=plan.nbytes, align=1)
            try:
                self._posix.read(local, PathTable.from_paths(paths), lease)
                break
            except StorageError:
                if attempt:  # evicted by another process in between, twice: not a race any more
                    raise
        self._maybe_evict(set(paths))

    def ensure(self, info: Any, block: int, path: str) -> bytearray | None:
        """Make block ``block`` of ``info`` present at ``path``: use it (None), or
        download it once per node (its bytes), written whole or not at all. The
        download goes to ``<path>.part``, created with ``O_EXCL``: the one process that
        creates it downloads, the others wait for ``path``."""
        want = min(self.block, info.size - block * self.block)
        if self._present(path, want):
            return None
        part = path + ".part"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        wait, since = _POLL_S, time.monotonic()
        while True:
            try:
                fd = os.open(part, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._present(path, want):
                    return None
                self._break_stale(part)
                if time.monotonic() - since > 2 * self.stale_s:
                    raise StorageError(f"waited {time.monotonic() - since:.0f} s for another process to "
                                       f"download block {block} of {info.url} into the cache", path=path) from None
                time.sleep(wait)
                wait = min(2 * wait, _POLL_MAX_S)
                continue
            except OSError as exc:
                if exc.errno in _FULL:
                    return self._uncached(info, block, want, path, exc)
                raise _cache_error(path, exc) from exc
            break
        done = False
        try:
            if self._present(path, want):  # written by another process while we took the lock
                return None
            buf = self._download(info, block, want)
            try:
                with os.fdopen(fd, "wb", closefd=False) as f:
                    f.write(buf)
                os.replace(part, path)
            except OSError as exc:
                if exc.errno in _FULL:
                    self._warn_full(path, exc)
                    return buf  # the batch gets its bytes; the block stays uncached
                raise _cache_error(path, exc) from exc
            done = True
            with self._lock:
                self._added += want
            return buf
        finally:
            os.close(fd)
            if not done:
                try:
                    os.unlink(part)
                except FileNotFoundError:
                    pass

    def _uncached(self, info: Any, block: int, want: int, path: str, exc: OSError) -> bytearray:
        """The block's bytes, downloaded without keeping them: the cache disk is full."""
        self._warn_full(path, exc)
        return self._download(info, block, want)

    def _warn_full(self, path: str, exc: OSError) -> None:
        if not self._warned_full:
            self._warned_full = True
            warnings.warn(f"{path}: cannot write the remote cache ({exc.strerror or exc}); reading on without "
                          f"caching. Lower remote_cache_budget (GPUIO_REMOTE_CACHE_BUDGET) or free space",
                          stacklevel=2)

    def _download(self, info: Any, block: int, want: int) -> bytearray:
        if self.fetch is None:
            raise StorageError(f"block {block} of {info.url} is not in the cache, and this cache has no "
                               f"fetch to download it", path=self.path(info, block))
        buf = bytearray(want)
        self.fetch(info.url, block * self.block, memoryview(buf), info.etag)
        return buf

    @staticmethod
    def _present(path: str, want: int) -> bool:
        """Whether the block file is there and whole (touched: it is in use); a file of
        another size is removed (cut short or overwritten)."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            return False
        if size != want:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return False
        try:
            os.utime(path)
        except FileNotFoundError:  # evicted by another process just now
            return False
        return True

    def _break_stale(self, part: str) -> None:
        """Remove a download in progress that has not finished within the stall limit
        (its process died or hangs); its block is then downloaded again."""
        try:
            age = time.time() - os.stat(part).st_mtime
        except FileNotFoundError:
            return
        if age > self.stale_s:
            try:
                os.unlink(part)
            except FileNotFoundError:
                pass

    def _maybe_evict(self, keep: set[str]) -> None:
        with self._lock:
            if self._added * _EVICT_SHARE < self.budget:
                return
            self._added = 0
        self.evict(keep)

    def evict(self, keep: set[str] = frozenset()) -> int:
        """Remove the least recently used blocks until the cache holds at most its
        budget; returns the bytes it holds after."""
        blocks = []
        total = 0
        try:
            folders = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        for folder in folders:
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder.path):
                name = entry.name
                if name.endswith(".part"):
                    continue
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                blocks.append((st.st_mtime, entry.path, st.st_size))
                total += st.st_size
        blocks.sort()
        for _, path, size in blocks:
            if total <= self.budget:
                break
            if path in keep:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            total -= size
        return total


def _cache_error(path: str, exc: OSError) -> StorageError:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = ("the cache disk is full: lower remote_cache_budget (GPUIO_REMOTE_CACHE_BUDGET), free space, "
                  "or turn the cache off (GPUIO_REMOTE_CACHE=0)")
    return StorageError(f"cannot write the remote cache: {reason}", path=path)
