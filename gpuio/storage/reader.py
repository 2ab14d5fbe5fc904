"""Batched reads of byte extents into host or GPU buffers: ``gpuio.read``.

A ``Reader`` owns a storage backend and a buffer pool. For one batch it builds a read
plan, takes one buffer from the pool, runs the plan and hands back views into that
buffer, one per sample: NumPy arrays in host memory, or CuPy arrays on the GPU.

Where the bytes land is the caller's choice, never guessed: ``device="cpu"`` lands
them in host memory (pinned when a GPU is present, so that a later copy to the GPU is
fast); ``device="cuda"`` lands them in GPU memory, through kvikio/cuFile when it is
installed (GPUDirect Storage where the system has it) or through a pinned host buffer
and one copy otherwise.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from gpuio import config
from gpuio._fork import RenewedLock, renew_after_fork
from gpuio.storage.buffers import BufferPool, Lease, default_pool
from gpuio.device import Device, check_cuda, cuda_available, parse_device, require
from gpuio.errors import ConfigError, OutOfRangeError, StorageError, open_error, truncated_error
from gpuio.storage._fielddecode import Rows, decode, decoded_fields
from gpuio.index import Extents, PathTable, Ragged, SampleIndex
from gpuio.storage.plan import ReadPlan, build_plan
from gpuio.storage.remote import SETTINGS as REMOTE_SETTINGS, is_remote

try:
    from gpuio.storage import _readloop
except ImportError:  # built at install where a C compiler exists; os.stat otherwise
    _readloop = None

__all__ = ["Reader", "read", "read_fields", "read_sample", "learn_lengths"]

# Read-ahead of consecutive cold batches of one file (a packed dataset read in its order):
# a batch read with O_DIRECT whose records fill half or more of the stretch of one file
# they span first queues reads of the stretches after it (``read_ahead`` bytes of them),
# each about as long, into buffers of the reader's own, read in the background in pieces
# in the file's order. A next batch whose records lie mostly in the first of them takes
# its buffer (no copy): each buffer has room around its stretch for the records of a
# batch that begins or ends a little outside it, copied from the stretches beside it (or
# read, where none has them); one that fits no buffer (records of other sizes) is copied
# from the stretches into a buffer of its own. So the disk always has the coming stretches
# queued, also while the caller handles a batch. A shuffled batch spans far more than its
# records: it reads as before. The read-ahead's buffers give way to any wait for room in
# the pool, and it leaves the room of a batch's own buffers.
_AHEAD_DENSE = 0.5  # the least share of its stretch a batch's records cover for reading on after it
_AHEAD_TAKEN = 0.25  # the least share of a stretch a batch's records cover for it to take the buffer
# (or of their span, to be copied from the stretches)
_AHEAD_READS = 8  # pieces of the stretches (task_size bytes each) read at once: fewer than the
# read_ahead setting queues, so that they end in the file's order
_AHEAD_MARGIN = 8  # a stretch reaches this fraction of a batch past where the batch should end
_PAGE = 4096  # O_DIRECT's alignment


def _pages(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _stamp(path: str) -> tuple[int, int, int] | None:
    """What tells a file's versions apart (inode, size, change time); None where it
    cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class _Ahead(NamedTuple):
    """A read-ahead: the bytes ``start..end`` of ``path`` (``start`` a page boundary; the
    file as ``stamp`` says) into ``lease`` from byte ``head`` on, read in pieces,
    ``(end, future)`` each; the buffer has room for ``head`` bytes of the file before
    ``start`` and as many after ``end``."""

    path: str
    stamp: tuple[int, int, int]
    start: int
    end: int
    head: int
    lease: Lease
    pieces: list[tuple[int, Future[None]]]

    def wait(self, upto: int) -> bool:
        """Wait for the pieces up to the file's byte ``upto``: False where one was cancelled
        (the read-ahead was dropped); a failed one raises its error."""
        for end, done in self.pieces:
            try:
                done.result()
            except CancelledError:
                return False
            if end >= upto:
                break
        return True

    def bytes_of(self, start: int, end: int) -> np.ndarray:
        """The buffer's bytes of the file's ``start..end``, which must lie in the stretch."""
        return self.lease.array[self.head + start - self.start: self.head + end - self.start]


class _Into(NamedTuple):
    """The part of a buffer a read lands in (what a backend's ``read`` takes of a lease)."""

    array: np.ndarray


class Reader:
    """Reads batches of extents from an index into buffers on ``device``.

    ``backend`` says how reads into GPU memory are done: ``"posix"`` (host memory, then
    one copy from a pinned buffer), ``"kvikio"`` (cuFile straight into GPU memory) or
    ``"auto"`` (kvikio when it loads, else posix, with the reason in ``fallback``). A
    reader into host memory always reads with posix, whatever ``backend`` says: kvikio
    lands bytes on the device, and a pipeline that reads on the GPU still parses and
    decodes some fields on the host. Settings not given come from ``gpuio.config`` when
    the reader is made. Batches read in the order of a file's records with O_DIRECT (cold
    data) are read ahead: see ``_AHEAD_DENSE`` and what precedes it.
    """

    def __init__(self, device: str | Device = "cpu", *, backend: str | None = None,
                 threads: int | None = None, pool: BufferPool | None = None,
                 thread_name: str = "gpuio-read") -> None:
        self.device = parse_device(device)
        check_cuda(self.device)
        backend = config.get("backend") if backend is None else backend
        self.fallback: str | None = None  # why "auto" did not pick kvikio for a GPU reader
        if backend == "auto" and self.device.is_cuda:
            from gpuio.storage._kvikio import kvikio_problem  # imports kvikio: only for GPU readers

            self.fallback = kvikio_problem()
            backend = "posix" if self.fallback else "kvikio"
        elif backend in ("auto", "kvikio") and not self.device.is_cuda:
            backend = "posix"  # the backend governs device reads only (see the docstring)
        threads = config.get("io_threads") if threads is None else threads
        if backend == "kvikio":
            from gpuio.storage._kvikio import KvikioBackend

            self.backend: Any = KvikioBackend(threads, config.get("task_size"),
                                              config.get("kvikio_compat"), config.get("max_open_files"))
        elif backend == "posix":
            from gpuio.storage._posix import PosixBackend

            from gpuio.storage._posix import native_available

            self.backend = PosixBackend(threads, config.get("o_direct"), thread_name,
                                        native=config.get("native") and native_available())
        else:
            raise ConfigError(f"backend {backend!r}; choose auto, posix or kvikio")
        pinned = config.get("pinned")
        self.pinned = cuda_available() if pinned == "auto" else pinned == "true"
        self.pool = pool if pool is not None else default_pool()
        self.gap = config.get("merge_gap")
        self.task_size = config.get("task_size")
        self.parts = config.get("read_parts")
        self.cold_direct = config.get("cold_direct")
        self.read_ahead = config.get("read_ahead")
        self._remote: Any = None  # the backend of s3:// and http(s):// files, made on first use
        self._upload_streams = threading.local()  # each read thread's upload stream (GPU readers)
        self._remote_settings = {name: config.get(name) for name in REMOTE_SETTINGS}  # ... with these
        self.read_ahead_batches = 0  # batches taken from a read-ahead's buffer (see _AHEAD_DENSE)
        self._after_fork()
        renew_after_fork(self)
        self.pool.give_way(self._drop_ahead)  # whatever waits for room in the pool comes first

    def _after_fork(self) -> None:
        """A new read-ahead state (in a forked child: the parent's thread is gone)."""
        self._ahead: list[_Ahead] = []  # read-aheads of consecutive stretches of one file, in order
        self._taken: _Ahead | None = None  # the one the last batch took (records before the next are there)
        self._ahead_lock = threading.Lock()
        self._ahead_thread: ThreadPoolExecutor | None = None

    @property
    def lands_on_device(self) -> bool:
        """Whether reads land in GPU memory directly (kvikio), not through host memory."""
        return self.backend.name == "kvikio"

    def read_batch(self, index: SampleIndex, rows: Sequence[int] | np.ndarray,
                   field: str = "data") -> tuple[Lease, np.ndarray, np.ndarray]:
        """Read one extent field of ``rows``; returns the buffer and each sample's
        (start, length) in it. The buffer goes back to the pool when no view remains."""
        rows = _check_rows(index, rows)
        ext = index.field_extents(field)
        extents = (ext.file[rows], ext.offset[rows], ext.length[rows])
        if is_remote(index.files):
            return self._read_remote(index, extents)
        extents = (*extents[:2], _known_lengths(index.files, *extents))
        if self.lands_on_device:
            plan = build_plan(*extents, gap=self.gap, align=self.backend.align, task_size=self.task_size,
                              parts=self.parts)
            lease = self.pool.acquire(plan.nbytes, self.device)
            self.backend.read(plan, index.files, lease)
            return lease, plan.sample_dest, plan.sample_length
        taken = self._take_ahead(index.files, *extents)
        if taken is not None:
            ahead, dest = taken
            lease = ahead.lease
            self._read_ahead(index.files, *extents, going_on=ahead)
        else:
            plan = build_plan(*extents, gap=self.gap, align=self.backend.align, task_size=self.task_size,
                              parts=self.parts)
            if self.cold_direct and self.backend.reads_cold_direct(plan, index.files):
                aligned = build_plan(*extents, gap=self.gap, align=_PAGE, task_size=self.task_size,
                                     parts=self.parts)
                # within the buffer a Loader reserved per batch: the extents plus a merge gap each
                if self.pool.charge(aligned.nbytes) <= self.pool.charge(int(extents[2].sum()) + len(rows) * self.gap):
                    plan = aligned
            # a batch that starts reading ahead is read as the first of the stretches, in their pieces
            taken = self._read_ahead(index.files, *extents, going_on=None) if plan.align >= _PAGE else None
            if taken is not None:
                lease, dest = taken[0].lease, taken[1]
            else:
                lease = self.pool.acquire(plan.nbytes, "cpu", pinned=self.pinned)
                self.backend.read(plan, index.files, lease)
                dest = plan.sample_dest
        if self.device.is_cuda:
            lease = self._upload(lease, int((dest + extents[2]).max(initial=0)))
        return lease, dest, extents[2].copy()

    def _drop_ahead(self) -> None:
        """Forget the read-aheads (their buffers go back once their reads in flight end):
        before a new one, at close, and whenever anything waits for room in the pool."""
        with self._ahead_lock:
            dropped, self._ahead, self._taken = self._ahead, [], None
        for ahead in dropped:  # nobody waits for them: their pieces not started are not read
            for _, piece in ahead.pieces:
                piece.cancel()

    def _take_ahead(self, files: PathTable, file: np.ndarray, offset: np.ndarray,
                    length: np.ndarray) -> tuple[_Ahead, np.ndarray] | None:
        """The read-ahead whose stretch holds the most of this batch's bytes, its buffer
        with the bytes of the batch's records beyond the stretch put around it, and each
        sample's place in it, where the batch's records lie in one file, cover a quarter or
        more of that stretch and fit in its buffer; else, where the stretches from the last
        one taken on hold them (records of other sizes than the stretches'), a buffer of
        the batch's own copied from them (``_gather``); else None."""
        with self._ahead_lock:
            queue = self._ahead
            if not queue or not len(file) or not (file == file[0]).all() or files[int(file[0])] != queue[0].path:
                return None
            if _stamp(queue[0].path) != queue[0].stamp:  # replaced or changed since: read it afresh
                self._ahead, self._taken = [], None
                return None
            end = offset + length
            low, high = int(offset.min()), int(end.max())
            k, most, parts = 0, -1, []
            for j, a in enumerate(queue):  # in the file's order: only the stretches the batch reaches
                if a.start >= high:
                    break
                if a.end > low:
                    held = int(length[(offset >= a.start) & (end <= a.end)].sum())
                    if held > most:
                        k, most = j, held
            ahead = queue[k]
            if most < _AHEAD_TAKEN * (ahead.end - ahead.start) or low < ahead.start - ahead.head or \
                    ahead.head + high - ahead.start > ahead.lease.nbytes:  # no buffer fits: copied from them
                parts = [a for a in (self._taken, *queue) if a is not None and a.stamp == ahead.stamp
                         and a.start < high and a.end > low]
                if not parts or parts[0].start > low or high > queue[-1].end or \
                        int(length.sum()) < _AHEAD_TAKEN * (high - low):  # a shuffled batch: read as it is
                    return None
                self._ahead = [a for a in queue if a.end > high]
                self._taken = next((a for a in reversed(parts) if a.end <= high), self._taken)
            else:
                before, after = (queue[k - 1] if k else self._taken), (queue[k + 1] if k + 1 < len(queue) else None)
                self._ahead, self._taken = queue[k + 1:], ahead
        if parts:
            return self._gather(files, int(file[0]), parts, low, high, offset)
        # a failed read-ahead raises its error (the file and offset) here; one dropped is read now
        if not ahead.wait(ahead.end):
            self._read_stretch(files, file[0], ahead.start, ahead.end, ahead)
        if low < ahead.start:  # from the stretch before, else read
            if before is not None and before.stamp == ahead.stamp and before.end == ahead.start and \
                    before.start <= low and before.wait(before.end):
                ahead.bytes_of(low, ahead.start)[...] = before.bytes_of(low, ahead.start)
            else:
                self._read_stretch(files, file[0], low // _PAGE * _PAGE, ahead.start, ahead)
        if high > ahead.end:  # from the stretch after, else read
            if after is not None and after.end >= high and after.wait(high):
                ahead.lease.array[ahead.head + ahead.end - ahead.start: ahead.head + high - ahead.start] = \
                    after.bytes_of(after.start, high)
            else:
                self._read_stretch(files, file[0], ahead.end, high, ahead)
        self.read_ahead_batches += 1
        return ahead, offset - ahead.start + ahead.head

    def _gather(self, files: PathTable, file: int, parts: list[_Ahead], low: int, high: int,
                offset: np.ndarray) -> tuple[_Ahead, np.ndarray] | None:
        """The file's ``low..high`` in a buffer of its own, copied from the stretches
        ``parts`` (read, where one was dropped), as a read-ahead of its own; and each
        sample's place in it. None where the pool has no room without waiting: the parts'
        buffers, which a wait could not free, may be what holds it."""
        start = low // _PAGE * _PAGE
        lease = self.pool.try_acquire(_pages(high - start), "cpu", pinned=self.pinned)  # O_DIRECT: whole pages
        if lease is None:
            return None
        into = _Ahead(parts[0].path, parts[0].stamp, start, high, 0, lease, [])
        for a in parts:
            a_low, a_high = max(a.start, low), min(a.end, high)
            if a.wait(a_high):
                into.bytes_of(a_low, a_high)[...] = a.bytes_of(a_low, a_high)
            else:
                self._read_stretch(files, file, a_low // _PAGE * _PAGE, a_high, into)
        self.read_ahead_batches += 1
        return into, offset - start

    def _read_stretch(self, files: PathTable, file: int, start: int, end: int, into: _Ahead) -> None:
        """Read the file's ``start..end`` (``start`` a page boundary; one read, a task of
        its own) into its place in ``into``'s buffer."""
        n, one = end - start, np.zeros(1, dtype=np.int64)
        plan = ReadPlan(one + file, one + start, one + _pages(n), one, one + n, one, one + n, _pages(n), _PAGE)
        self.backend.read(plan, files, _Into(into.lease.array[into.head + start - into.start:]))

    def _read_ahead(self, files: PathTable, file: np.ndarray, offset: np.ndarray, length: np.ndarray,
                    going_on: _Ahead | None) -> tuple[_Ahead, np.ndarray] | None:
        """Keep stretches after this batch's records, each about as long as the stretch
        they span, read or being read in the background, ``read_ahead`` bytes in all (at
        least one stretch; none where it is 0), where two or more records lie in one file,
        fill half or more of their stretch, which is no longer than ``read_ahead``, and the
        buffer pool has room without waiting beside the room of a batch's own buffers.
        ``going_on``: the read-ahead the batch was taken from (its followers stay; its stamp,
        checked as it was taken, is the file's: one stat per batch). Else the
        read-aheads start afresh, from this batch's stretch: then this batch taken from the
        first (as ``_take_ahead``), or None where none started."""
        if going_on is None:
            self._drop_ahead()
        if not self.read_ahead or len(file) < 2 or not (file == file[0]).all():
            return  # a single record (a file read whole) is read as it is
        first, last = int(offset.min()), int((offset + length).max())
        span = last - first
        if not _PAGE <= span <= self.read_ahead or int(length.sum()) < _AHEAD_DENSE * span:
            return  # a batch longer than the read-ahead keeps enough reads in flight by itself
        path = files[int(file[0])]
        stamp = _stamp(path) if going_on is None else going_on.stamp
        if stamp is None:
            return  # the next batch's own read reports it
        size = stamp[1]
        with self._ahead_lock:
            if going_on is None:  # from this batch's stretch (what another thread queued meanwhile goes)
                self._ahead, self._taken = [], None
            queue, taken = self._ahead, self._taken
            if queue and queue[-1].path != path:
                return None  # another thread's batches of another file took the read-ahead meanwhile
            if taken is not None and taken.path != path:
                taken = None
            if going_on is None:
                at = first // _PAGE * _PAGE
            else:
                at = queue[-1].end if queue else max(last // _PAGE * _PAGE, taken.end if taken is not None else 0)
            # where this batch ends (starting afresh), where the next batches should end, and a little
            # further: a batch that ends early finds the next one's first bytes at the end of its
            # stretch (a copy), where one that ends late would wait for the next stretch
            ends = itertools.chain([_pages(last)] if going_on is None else [],
                                   (_pages(last + k * span + span // _AHEAD_MARGIN) for k in itertools.count(1)))
            queued = queue[-1].end - queue[0].start if queue else 0  # consecutive stretches
            while at < size and (not queue or queued < self.read_ahead):
                stop = min(next(e for e in ends if e >= at + span // 2), size)
                head = _pages(span // 2)  # room for the next batch's bytes before and after the stretch
                room = head + _pages(stop - at) + head
                # never the last room of a batch's own buffers: one as long, and its copy on the device
                lease = self.pool.try_acquire(room, "cpu", pinned=self.pinned,
                                              keep=room * (2 if self.device.is_cuda else 1))
                if lease is None:
                    break
                if self._ahead_thread is None:
                    self._ahead_thread = ThreadPoolExecutor(_AHEAD_READS, thread_name_prefix="gpuio-read-ahead")
                ahead = _Ahead(path, stamp, at, stop, head, lease, [])
                for a in range(at, stop, self.task_size):
                    b = min(a + self.task_size, stop)
                    ahead.pieces.append((b, self._ahead_thread.submit(self._read_stretch, files, int(file[0]), a, b,
                                                                      ahead)))
                queue.append(ahead)
                queued, at = queued + stop - at, stop
        return None if going_on is not None else self._take_ahead(files, file, offset, length)

    def prefetch(self, index: SampleIndex, rows: Sequence[int] | np.ndarray, field: str = "data") -> int:
        """Start fetching the remote blocks of ``field`` of ``rows`` into the node-local
        cache, in the background, so that reading them later reads local disk: for an
        index of remote objects with the cache on, as many bytes as fit in
        ``remote_readahead`` in flight (the rest is fetched when read). Returns the bytes
        started; 0 for local files, with the cache off or when all are present."""
        if not is_remote(index.files) or field not in index.extents:
            return 0
        ext = index.extents[field]
        rows = _check_rows(index, rows)
        return self._remote_backend().prefetch(ext.file[rows], ext.offset[rows], ext.length[rows], index.files,
                                               index.meta.get("remote"))

    def _remote_backend(self) -> Any:
        """The backend of s3:// and http(s):// files, made on first use."""
        if self._remote is None:
            from gpuio.storage.remote import RemoteBackend

            with config.override(**self._remote_settings):
                self._remote = RemoteBackend()
        return self._remote

    def _read_remote(self, index: SampleIndex, extents: tuple[np.ndarray, ...]) -> tuple[Lease, np.ndarray, np.ndarray]:
        """``read_batch`` for objects in S3 or on HTTP(S): ranged GETs, through the
        node-local cache tier (``gpuio.storage.remote``, ``gpuio.storage.cache``)."""
        self._remote_backend()
        if len(extents[2]) and extents[2].min() < 0:
            raise ConfigError("extents of unknown length in object storage: index the objects by their URL "
                              "(a listing gives their sizes)")
        plan = self._remote.plan(*extents)
        lease = self.pool.acquire(plan.nbytes, "cpu", pinned=self.pinned)
        self._remote.read(plan, index.files, lease, index.meta.get("remote"))
        if self.device.is_cuda:
            lease = self._upload(lease, plan.nbytes)
        return lease, plan.sample_dest, plan.sample_length

    def _upload(self, host: Lease, nbytes: int) -> Lease:
        """``host``'s first ``nbytes`` in a device buffer, copied on a non-blocking stream
        of this reader's (one per read thread) and waited for on that stream alone. The
        read thread's current stream is the legacy default stream: a copy there would
        wait for all the work queued on the executor's stage streams (blocking streams),
        and the read thread with it, so that uploads never overlapped with compute."""
        cp = require("cupy")
        dev = self.pool.acquire(nbytes, self.device)
        with cp.cuda.Device(self.device.index):
            stream = getattr(self._upload_streams, "stream", None)
            if stream is None:  # made inside the device: a stream belongs to one
                stream = self._upload_streams.stream = cp.cuda.Stream(non_blocking=True)
            with stream:  # the device array's release event, too, is recorded after the copy
                dev.array.set(host.array[:nbytes], stream=stream)
            stream.synchronize()  # the host buffer returns to the pool right after
        return dev

    def read(self, index: SampleIndex, rows: Sequence[int] | np.ndarray, field: str = "data") -> list[Any]:
        """The bytes of ``field`` for ``rows``: one uint8 array per sample, all views
        into one batch buffer."""
        if field not in index.extents:
            return read_fields(index, rows, (field,), self.device, reader=self)[field]
        got = self._read_rows(index, rows, field)
        return got if isinstance(got, list) else Rows(got)

    def _read_rows(self, index: SampleIndex, rows: Sequence[int] | np.ndarray, field: str) -> Any:
        """``read``'s bytes, as one ``[B, n]`` array where they lie back to back in row
        order (the plan's layout for one file per sample), else as a list of views."""
        lease, starts, lengths = self.read_batch(index, rows, field)
        buf = lease.array
        n = int(lengths[0]) if len(lengths) else 0
        if len(starts) and (lengths == n).all() and (starts == starts[0] + n * np.arange(len(starts))).all():
            return buf[starts[0]: starts[0] + n * len(starts)].reshape(len(starts), n)
        return [buf[s: s + n] for s, n in zip(starts.tolist(), lengths.tolist())]

    def close(self) -> None:
        """End the backend's reader threads and close its files; read-ahead pieces not started
        are cancelled, not read."""
        self._drop_ahead()
        if self._ahead_thread is not None:
            self._ahead_thread.shutdown(wait=True)
            self._ahead_thread = None
        self.backend.close()
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_rows(index: SampleIndex, rows: Sequence[int] | np.ndarray) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
        raise ConfigError(f"indices must be a 1-D sequence of integers, got shape {rows.shape} "
                          f"dtype {rows.dtype}")
    rows = rows.astype(np.int64, copy=False)
    if not rows.size:
        return rows
    n, low = len(index), rows.min()
    if low < -n or rows.max() >= n:
        bad = rows[(rows < -n) | (rows >= n)][0]
        raise OutOfRangeError(f"sample {bad} out of range for an index of {n} samples")
    return rows if low >= 0 else np.where(rows < 0, rows + n, rows)


def read_fields(index: SampleIndex, rows: Sequence[int] | np.ndarray, fields: Sequence[str],
                device: str | Device = "cpu", *, reader: Reader | None = None,
                stacked: bool = False) -> dict[str, Any]:
    """Several fields of ``rows``: extent fields as lists of uint8 arrays (decoded, as
    ``index.meta["decode"]`` says, by ``gpuio.storage._fielddecode``), dense value fields as
    arrays with one row per sample, ragged and parsed fields as lists. With ``stacked``,
    a decoded field whose arrays share one shape and dtype is one ``[B, ...]`` array (a
    view of the read buffer) instead of a list of its rows."""
    rows = _check_rows(index, rows)
    unknown = [f for f in fields if f not in index.fields]
    if unknown:
        raise ConfigError(f"unknown field(s) {unknown}; this index has {list(index.fields)}")
    reader = reader or _default_reader(device)
    out: dict[str, Any] = {}
    decoded = decoded_fields(index)
    parser = index.parser
    parsed = [f for f in fields if parser is not None and f in parser.fields and f not in index.extents]
    if parsed:
        # records are parsed on the host, whatever the destination of other fields
        host = reader if not reader.device.is_cuda else _default_reader("cpu")
        records = host.read(index, rows, parser.source)
        ext = index.extents[parser.source]
        paths = index.files.many(ext.file[rows])
        values = parser.parse(records, rows, paths, ext.offset[rows])
        out.update({f: values[f] for f in parsed})
    for f in fields:
        if f in out:
            continue
        if f in index.extents:
            if f in decoded:  # from the [B, n] buffer where the rows lie back to back
                out[f] = decode(index, f, rows, reader._read_rows(index, rows, f), stacked=stacked)
            else:
                out[f] = reader.read(index, rows, f)
        else:
            col = index.values[f]
            out[f] = col.rows(rows) if isinstance(col, Ragged) else col[rows]
    return {f: out[f] for f in fields}


def read_sample(index: SampleIndex, i: int) -> dict[str, Any]:
    """Sample ``i``'s fields as host values: ``bytes`` for extent fields, Python
    scalars for scalar values, decoded values as they are (``index[i]``).

    A sample in local files is read by itself: per extent field one open, one ``pread``
    and one close, with no read plan, buffer lease or reader threads (a batch's setup,
    which one small file does not repay). Values and errors are those of ``read_fields``.
    """
    decoded = decoded_fields(index)  # decoded fields hold values, not bytes
    if is_remote(index.files):
        row = read_fields(index, np.array([i]), index.fields, device="cpu")
        return {name: _host_value(col[0], raw=name not in decoded) for name, col in row.items()}
    parser = index.parser
    source = parser.source if parser is not None else None
    out: dict[str, Any] = {}
    record = None  # the parser's source bytes, as an array the parser may view
    for name, ext in index.extents.items():
        path, offset, length = index.files[ext.file[i]], int(ext.offset[i]), int(ext.length[i])
        if name in decoded or name == source:  # arrays viewed by decoders and parsers are writable, as in a batch
            data = np.frombuffer(_read_extent(path, offset, length, bytearray), dtype=np.uint8)
            if name == source:
                record = data
            out[name] = (_host_value(decode(index, name, np.array([i]), [data])[0], raw=False) if name in decoded
                         else data.tobytes())
        else:
            out[name] = _read_extent(path, offset, length, bytes)
    for name, col in index.values.items():
        out[name] = _host_value(col[i])
    if parser is not None:  # its fields replace value fields of the same name, as in read_fields
        ext = index.extents[source]
        parsed = parser.parse([record], np.array([i]), [index.files[ext.file[i]]], ext.offset[i: i + 1])
        out.update((name, _host_value(parsed[name][0])) for name in parser.fields if name not in index.extents)
    return {name: out[name] for name in index.fields}


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def _read_extent(path: str, offset: int, length: int, kind: type[bytes | bytearray]) -> bytes | bytearray:
    """``length`` bytes of ``path`` from byte ``offset`` (``UNKNOWN_LENGTH``: the rest of
    the file, its size from fstat on the open descriptor) as ``kind``, with the errors a
    batched read raises. The descriptor is not kept: a cache of them would read the old
    bytes of a file replaced since, unless it checked each path with a stat(), which
    costs about what the open and close it saves."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        raise open_error(path, exc) from exc
    got = 0
    try:
        if length < 0:  # UNKNOWN_LENGTH: to the end of the file
            length = max(os.fstat(fd).st_size - offset, 0)
        if kind is bytes:
            data: bytes | bytearray = os.pread(fd, length, offset)
            got = len(data)
            while got < length:  # a short read: an interrupted call, a network filesystem
                more = os.pread(fd, length - got, offset + got)
                if not more:
                    break
                data, got = data + more, got + len(more)
        else:
            data = bytearray(length)
            view = memoryview(data)
            while got < length:
                n = os.preadv(fd, [view[got:]], offset + got)
                if not n:
                    break
                got += n
    except OSError as exc:
        raise StorageError(f"read failed: {exc.strerror or exc}", path=path, offset=offset + got) from exc
    finally:
        os.close(fd)
    if got < length:
        raise truncated_error(path, offset, length, got)
    return data


def _host_value(value: Any, raw: bool = True) -> Any:
    if raw and isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
        return value.tobytes()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, memoryview):
        return value.tobytes()
    return value




def _file_sizes(files: PathTable, ids: np.ndarray) -> np.ndarray:
    """The sizes of files ``ids`` in bytes, ``-errno`` where one cannot be stat'ed: in C
    with the GIL released where ``_readloop`` was built (threads then stat in parallel)."""
    out = np.empty(len(ids), dtype=np.int64)
    if _readloop is not None:
        _readloop.sizes(files.root, files.blob, files.offsets[ids], files.offsets[ids + 1], out)
        return out
    for k, path in enumerate(files.many(ids)):
        try:
            out[k] = os.stat(path).st_size
        except OSError as exc:
            out[k] = -(exc.errno or errno.EIO)
    return out


def _known_lengths(files: PathTable, file: np.ndarray, offset: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``length`` with each ``UNKNOWN_LENGTH`` replaced by the rest of its file from
    ``offset`` (a stat() of the file; one that cannot be stat'ed is the error its open
    would be)."""
    unknown = np.flatnonzero(length < 0)
    if not len(unknown):
        return length
    sizes = _file_sizes(files, file[unknown])
    bad = np.flatnonzero(sizes < 0)
    if len(bad):
        err = -int(sizes[bad[0]])
        raise open_error(files[file[unknown[bad[0]]]], OSError(err, os.strerror(err)))
    out = length.copy()
    out[unknown] = np.maximum(sizes - offset[unknown], 0)
    return out


_LEARN_CHUNK = 4096  # files stat'ed per task of learn_lengths


def learn_lengths(index: SampleIndex, fields: Sequence[str] | None = None, *, threads: int = 16) -> SampleIndex:
    """Fill in the extents of unknown length (``UNKNOWN_LENGTH``: a file tree's whole
    files) of ``fields`` (default: all extent fields) with the files' sizes, one stat()
    per file on ``threads`` threads, and return ``index``, changed in place: a later
    ``save`` records the sizes. A file that cannot be stat'ed keeps its unknown length,
    and its read reports it. Reads never need this (they learn the lengths of the
    extents they read); what needs every length does (a byte total, a buffer bound)."""
    for name in index.extents if fields is None else fields:
        ext = index.field_extents(name)
        unknown = np.flatnonzero(ext.length < 0)
        if not len(unknown):
            continue
        ids = np.unique(ext.file[unknown])
        chunks = [ids[k: k + _LEARN_CHUNK] for k in range(0, len(ids), _LEARN_CHUNK)]
        with ThreadPoolExecutor(max(1, min(threads, len(chunks))), thread_name_prefix="gpuio-stat") as pool:
            sizes = np.concatenate(list(pool.map(functools.partial(_file_sizes, index.files), chunks)))
        size_of = np.full(len(index.files), -1, dtype=np.int64)  # negative: not known
        size_of[ids] = sizes
        length = ext.length.copy()
        known = size_of[ext.file[unknown]] >= 0
        rows = unknown[known]
        length[rows] = np.maximum(size_of[ext.file[rows]] - ext.offset[rows], 0)
        index.extents[name] = Extents(ext.file, ext.offset, length)
    return index


# The readers behind gpuio.read, one per device and settings, the most recent few kept.
# A reader dropped here ends its threads once no caller uses it any more (the thread
# pool's workers exit when the pool is garbage collected).
_readers: OrderedDict[tuple[Any, ...], Reader] = OrderedDict()
_readers_lock = RenewedLock()  # free in a forked child, whoever held it at the fork
_READERS_KEPT = 4


# the settings a Reader takes when it is made: one kept Reader per combination in use
_READER_SETTINGS = ("backend", "io_threads", "o_direct", "merge_gap", "task_size", "read_parts", "cold_direct",
                    "read_ahead", "native", *REMOTE_SETTINGS)


def _default_reader(device: str | Device) -> Reader:
    device = parse_device(device)
    key = (device, *(config.get(name) for name in _READER_SETTINGS))
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = _readers[key] = Reader(device)
            while len(_readers) > _READERS_KEPT:
                _readers.popitem(last=False)
        _readers.move_to_end(key)
        return reader


def read(index: SampleIndex, indices: Sequence[int] | np.ndarray, field: str = "data",
         device: str | Device = "cpu") -> list[Any]:
    """Read ``field`` of the samples ``indices`` in one batch.

    Returns one value per sample in the order given. For a field stored as bytes,
    each value is a 1-D ``uint8`` array (NumPy on ``"cpu"``, CuPy on ``"cuda[:N]"``),
    a view into one batch buffer that returns to the pool once no view remains.
    Nothing is returned half-read: a missing, unreadable or truncated file raises
    ``gpuio.errors.StorageError`` naming the file and byte offset.
    """
    return _default_reader(device).read(index, indices, field)
