"""The ``posix`` backend: parallel reads into one host batch buffer.

Small files are latency-bound, so what matters is how many reads are in flight, not
how many cores there are: ``io_threads`` (16 by default) reader threads each take the
next task from a shared counter. The plan splits a batch's large reads into a few long
tasks (``read_parts``): each is one sequential run that the kernel's readahead
serves, and page-cache copies still run on several cores. A cold batch of reads of 64 KiB
and more (``cold_direct``, decided by ``reads_cold_direct`` before the plan is made) is
read with O_DIRECT, around the page cache.

Where the C accelerator (``_readloop.c``) was built, the task loop runs in C with the GIL
released for the whole batch, on the calling thread and helper threads of a C pool
that need no GIL to start or finish (so a Loader's consumer, running Python meanwhile,
does not hold a batch's copy back). Otherwise the loop runs in
Python around ``os.preadv``, which releases the GIL per call: then a few "fast lane"
threads try each read with ``RWF_NOWAIT`` and only reads that would wait for the disk
go to the other threads (see ``_read_python``).

A file read by one task (the small-file case) is opened, read and closed by that
task; a file read by several tasks of the batch (records packed in one file, a large
file in pieces) is opened once per batch and shared by them.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from gpuio._fork import renew_after_fork
from gpuio.storage.buffers import Lease
from gpuio.errors import ConfigError, StorageError, open_error, truncated_error

try:
    from gpuio.storage import _readloop
except ImportError:  # built at install where a C compiler exists; Python reads otherwise
    _readloop = None
from gpuio.index import PathTable
from gpuio.storage.plan import ReadPlan


_PARALLEL_COPY = 64 << 10  # mean read size from which cached copies run on several cores
# A cold batch of reads of 64 KiB and more goes around the page cache (O_DIRECT): data the
# cache does not hold gains nothing from it, and a direct read skips the copy out of it and
# the cache's own memory work (bench/storage.py's cold rows compare the two). Packed small
# records stay buffered: O_DIRECT would widen each to 4 KiB alignment and lose readahead.
_DIRECT_MEAN_READ = 64 << 10  # the mean read size from which a batch may go around the cache
_DIRECT_SAMPLE = 8  # reads of the batch whose pages are looked up
_DIRECT_CACHED = 0.125  # the largest fraction of those pages the page cache may hold
# cachestat walks the cache's pages of the range it is given: of a longer read only this
# much from its middle is looked up (the page-cache lookup stays small beside the read)
_DIRECT_PROBE = 1 << 20
_CACHESTAT = 451  # cachestat(2), Linux 6.5: how much of a file range the page cache holds


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_syscall = ctypes.CDLL(None, use_errno=True).syscall if sys.platform.startswith("linux") else None


def cached_pages(fd: int, offset: int, length: int) -> int | None:
    """Pages of the file range the page cache holds, without reading anything (cachestat(2));
    None where the kernel has no cachestat."""
    out = _Cachestat()
    if _syscall is None or _syscall(_CACHESTAT, fd, ctypes.byref(_CachestatRange(offset, length)),
                                    ctypes.byref(out), 0):
        return None
    return int(out.nr_cache)


def native_available() -> bool:
    """Whether the C accelerator was built at install."""
    return _readloop is not None


class PosixBackend:
    """Reads a plan into host memory with a pool of reader threads."""

    name = "posix"

    def __init__(self, threads: int = 16, o_direct: bool = False, thread_name: str = "gpuio-read",
                 native: bool | None = None) -> None:
        self.threads = max(1, threads)
        self.native = _readloop is not None if native is None else native
        if self.native and _readloop is None:
            raise ConfigError("the C accelerator gpuio.storage._readloop was not built (no C compiler at install?)")
        self.thread_name = thread_name
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self._flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        self._no_direct: set[str] = set()  # files whose filesystem refused O_DIRECT
        self._nowait = hasattr(os, "RWF_NOWAIT")  # cleared if the kernel refuses it
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        renew_after_fork(self)

    def _after_fork(self) -> None:
        """In a forked child: the parent's reader threads are gone; a new pool starts on demand."""
        self._pool = None
        self._pool_lock = threading.Lock()

    @property
    def align(self) -> int:
        return 4096 if self.o_direct else 1

    def reads_cold_direct(self, plan: ReadPlan, paths: PathTable) -> bool:
        """Whether to read this batch with O_DIRECT although ``o_direct`` is off: its reads
        average 64 KiB or more and the page cache holds almost none of a sample of them
        (up to 8 reads, each looked up in its middle MiB with cachestat, which reads nothing)."""
        n = len(plan)
        if self.o_direct or not n or int(plan.task_length.sum()) < _DIRECT_MEAN_READ * n:
            return False
        cached = total = 0
        for k in np.unique(np.linspace(0, n - 1, min(n, _DIRECT_SAMPLE)).astype(np.int64)).tolist():
            path = paths[int(plan.task_file[k])]
            if path in self._no_direct:
                return False
            length = int(plan.task_length[k])
            probe = min(length, _DIRECT_PROBE)
            pages = self._file_pages(path, int(plan.task_offset[k]) + (length - probe) // 2, probe)
            if pages is None:
                return False  # no cachestat, or the file does not open (the read reports it)
            cached, total = cached + pages, total + -(-probe // 4096)
        return cached <= _DIRECT_CACHED * total

    def _file_pages(self, path: str, offset: int, length: int) -> int | None:
        """``cached_pages`` of a file range by path; None where it does not open."""
        try:
            fd = os.open(path, self._flags)
        except OSError:
            return None
        try:
            return cached_pages(fd, offset, length)
        finally:
            os.close(fd)

    def _open(self, path: str, direct: bool) -> int:
        if direct and path not in self._no_direct:
            try:
                return os.open(path, self._flags | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this filesystem has no O_DIRECT
                    raise open_error(path, exc) from exc
                self._no_direct.add(path)
        try:
            return os.open(path, self._flags)
        except OSError as exc:
            raise open_error(path, exc) from exc

    def _direct(self, plan: ReadPlan, paths: PathTable, unique: np.ndarray) -> bool:
        """Whether a batch of files ``unique`` is read with O_DIRECT: its plan is aligned for
        it (``o_direct``, or a cold batch of long reads) and none of the files refused it."""
        return plan.align >= 4096 and not (self._no_direct and self._no_direct & set(paths.many(unique)))

    def read(self, plan: ReadPlan, paths: PathTable, lease: Lease) -> None:
        """Fill the host buffer ``lease`` as the plan says; raise StorageError on any failure."""
        if len(plan) == 0:
            return
        if self.native:
            self._read_native(plan, paths, lease)
        else:
            self._read_python(plan, paths, lease)

    def _read_native(self, plan: ReadPlan, paths: PathTable, lease: Lease) -> None:
        """The C task loop with the GIL released (``_readloop.c``), on this thread and C
        helper threads: first one thread per core copies what the page cache holds, then ``io_threads``
        threads read the rest from the disk. Under O_DIRECT, ``io_threads`` threads read
        everything: there ``RWF_NOWAIT`` does not stop at the page cache, the read waits
        for the disk (a first pass on one thread per core read a cold batch at that queue depth)."""
        n = len(plan)
        unique, inverse, counts = np.unique(plan.task_file, return_inverse=True, return_counts=True)
        fds = np.full(len(unique), -1, dtype=np.int32)
        stop = np.zeros(1, dtype=np.int32)
        pending, npending, done = np.empty(n, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(n, dtype=np.int64)
        direct = self._direct(plan, paths, unique)
        shared = (counts > 1).astype(np.int8)
        # the C loop builds each path from the table's packed bytes: no Python string per file
        common = (paths.root, paths.blob, paths.offsets[unique], paths.offsets[unique + 1], inverse.astype(np.int32),
                  plan.task_offset, plan.task_length, plan.task_dest, plan.task_need, shared, fds)
        tail = (pending, npending, done, lease.array.ctypes.data, self._flags | (os.O_DIRECT if direct else 0))
        try:
            todo = np.arange(n, dtype=np.int64)
            if not direct:
                results = self._run_phase(common, stop, todo, tail, nowait=True,
                                          workers=min(n, self.threads, os.cpu_count() or 1))
                # in task order, so that a task before a failed one has always run (its error is the one raised)
                todo = todo[:0] if any(r[0] for r in results) else np.sort(pending[: npending[0]])
            if len(todo):
                results = self._run_phase(common, stop, todo, tail, nowait=False, workers=min(len(todo), self.threads))
        finally:
            for fd in fds[fds >= 0].tolist():
                os.close(fd)
        failed = [r for r in results if r[0]]
        if not failed:
            return
        status, task, err, got = min(failed, key=lambda r: r[1])
        path = paths[int(plan.task_file[task])]
        offset, need = int(plan.task_offset[task]), int(plan.task_need[task])
        if status == 1 and direct and err == errno.EINVAL:  # this filesystem has no O_DIRECT
            self._no_direct.update(paths.many(unique))
            return self._read_native(plan, paths, lease)
        if status == 1:
            raise open_error(path, OSError(err, os.strerror(err)))
        if status == 2:
            raise StorageError(f"read failed: {os.strerror(err)}", path=path, offset=offset + got)
        raise truncated_error(path, offset, need, got)

    def _run_phase(self, common: tuple, stop: np.ndarray, todo: np.ndarray, tail: tuple, *, nowait: bool,
                   workers: int) -> list[tuple[int, int, int, int]]:
        return _readloop.run(*common, np.zeros(1, dtype=np.int64), stop, todo, *tail, int(nowait), workers)

    def _read_python(self, plan: ReadPlan, paths: PathTable, lease: Lease) -> None:
        """The same in Python, where the C accelerator was not built.

        A few "fast lane" threads (one per core) try each read with ``RWF_NOWAIT``,
        which copies what the page cache holds and never blocks; a read that would
        wait for the disk goes to the I/O threads, so that cold data gets
        ``io_threads`` reads in flight while cached data is copied without waking
        sixteen threads to fight over the GIL.
        """
        n = len(plan)
        view = memoryview(lease.array)
        unique, inverse, counts = np.unique(plan.task_file, return_inverse=True, return_counts=True)
        names = paths.many(unique)
        direct = self._direct(plan, paths, unique)
        files = [names[i] for i in inverse.tolist()]
        owns = (counts[inverse] == 1).tolist()  # the task's file has no other task: open it alone
        offsets, lengths = plan.task_offset.tolist(), plan.task_length.tolist()
        dests, needs = plan.task_dest.tolist(), plan.task_need.tolist()
        shared: dict[str, int] = {}  # path -> fd, for files with several tasks
        tasks = itertools.count()
        errors: list[tuple[int, BaseException]] = []  # (task, error): the first task's is raised, as in C
        blocked: list[Future[None]] = []
        nowait = self._nowait and not direct  # as in C: under O_DIRECT, RWF_NOWAIT reads wait for the disk
        close, preadv, flag = os.close, os.preadv, getattr(os, "RWF_NOWAIT", 0)

        def open_(path: str) -> int:
            return self._open(path, direct)

        def shared_fd(path: str) -> int:
            fd = shared.get(path)
            if fd is None:
                fd = open_(path)
                kept = shared.setdefault(path, fd)  # atomic: one fd wins per path
                if kept != fd:
                    close(fd)
                fd = kept
            return fd

        def finish(fd: int, k: int, got: int, own: bool) -> None:
            try:
                self._read_into(fd, files[k], offsets[k], needs[k], view[dests[k]: dests[k] + lengths[k]], got)
            except BaseException as exc:  # handed to the caller below
                errors.append((k, exc))
            finally:
                if own:
                    close(fd)

        def fast_lane() -> None:
            k = -1
            try:
                while not errors:
                    k = next(tasks)
                    if k >= n:
                        return
                    own = owns[k]
                    fd = open_(files[k]) if own else shared_fd(files[k])
                    got = 0
                    if nowait:
                        try:
                            got = preadv(fd, [view[dests[k]: dests[k] + lengths[k]]], offsets[k], flag)
                        except BlockingIOError:
                            pass
                        except OSError as exc:
                            self._nowait_refused(exc, files[k], offsets[k])
                    if got == lengths[k]:
                        if own:
                            close(fd)
                    elif nowait:
                        blocked.append(self._executor().submit(finish, fd, k, got, own))
                    else:
                        finish(fd, k, got, own)
            except BaseException as exc:  # handed to the caller below
                errors.append((k, exc))

        if not nowait:
            lanes = min(n, self.threads)
        elif plan.nbytes < _PARALLEL_COPY * n:
            lanes = 1  # copies this short gain less from a second core than the GIL hand-offs cost
        else:
            lanes = min(n, self.threads, os.cpu_count() or 1)
        try:
            helpers = [self._executor().submit(fast_lane) for _ in range(lanes - 1)]
            fast_lane()
            for fut in helpers:
                fut.result()
            for fut in blocked:  # complete: no more are added once the lanes are done
                fut.result()
        finally:
            for fd in shared.values():
                os.close(fd)
        if errors:
            raise min(errors, key=lambda e: e[0])[1]

    def _nowait_refused(self, exc: OSError, path: str, offset: int) -> None:
        """A non-blocking read failed: either RWF_NOWAIT is not supported here (then
        stop trying it; the blocking read follows) or the read really failed."""
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            if not self.o_direct:
                self._nowait = False
            return  # under O_DIRECT the blocking read reports real problems
        raise StorageError(f"read failed: {exc.strerror or exc}", path=path, offset=offset) from exc

    def _read_into(self, fd: int, path: str, offset: int, need: int, out: memoryview, got: int = 0) -> None:
        length = len(out)
        while got < length:
            try:
                n = os.preadv(fd, [out[got:]], offset + got)
            except OSError as exc:
                if exc.errno == errno.EINVAL and got and self.o_direct:
                    break  # O_DIRECT read of a partial last block past EOF
                raise StorageError(f"read failed: {exc.strerror or exc}", path=path,
                                   offset=offset + got) from exc
            if n == 0:
                break
            got += n
        if got < need:
            raise truncated_error(path, offset, need, got)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix=self.thread_name)
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
