"""Checks on a dataset's data files before a format indexes them, and the reader of
the integer tables that are their sidecar index files."""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import io
import multiprocessing
import os
import re
import stat
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, suppress
from typing import BinaryIO, TypeVar

import numpy as np

from gpuio import config
from gpuio.errors import ConfigError, DataError, FormatError, StorageError
from gpuio.index import Extents, PathTable, SampleIndex
from gpuio.storage import Reader
from gpuio.storage.cache import cache_folder, new_copy
from gpuio.storage.remote import RemoteFile, is_http, is_url, object_versions, url_path
from gpuio.storage.remote import client as remote_client

_T = TypeVar("_T")
_R = TypeVar("_R")

__all__: list[str] = []


def open_regular_file(path: str, what: str) -> tuple[BinaryIO, int]:
    """``(binary file open for reading, size in bytes)`` of ``path`` (a ``what``, e.g.
    ``".rec file"``), checked to be a regular file: a ``StorageError`` when it cannot
    be opened (missing, permission), a ``DataError`` when it is a directory, FIFO,
    device or socket. Both name the path. A URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``) opens a
    ``gpuio.storage.remote.RemoteFile``: ``read``/``seek``/``pread`` by ranged GETs, no
    ``fileno``."""
    if is_url(path):
        remote = RemoteFile(path)
        return remote, remote.size  # type: ignore[return-value]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: opening a FIFO must not wait
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise StorageError(f"cannot read {what}: {getattr(exc, 'strerror', None) or exc}", path=path) from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a device, FIFO or socket"
        raise DataError(f"a {what} must be a regular file, this is {kind}", path=path)
    return os.fdopen(fd, "rb"), st.st_size


def size_or_zero(path: str) -> int:
    """A file's size in bytes for a progress bar; 0 when it cannot be stat'ed (the
    format reports that when it opens the file)."""
    if is_url(path):
        return 0  # no request for a progress bar
    try:
        return os.stat(path).st_size
    except (OSError, ValueError):
        return 0


def regular_file_size(path: str, what: str) -> int:
    """Size in bytes of ``path``, checked as ``open_regular_file`` does."""
    f, size = open_regular_file(path, what)
    f.close()
    return size


def int_table(path: str, columns: int) -> np.ndarray:
    """A text file of ``columns`` whitespace-separated integers per line (an index
    file), as an ``(n, columns)`` int64 array (NumPy's C parser; no Python loop per
    line). Checked as ``open_regular_file`` does first."""
    f, size = open_regular_file(path, "text index file")
    if is_url(path):  # a small file: read whole, then parsed as a local one
        with f:
            f = io.BytesIO(f.read())
    with f:
        if size == 0:
            return np.zeros((0, columns), dtype=np.int64)
        try:
            with warnings.catch_warnings():  # a file of blank lines is an empty index
                warnings.simplefilter("ignore", UserWarning)
                table = np.loadtxt(f, dtype=np.int64, ndmin=2, comments=None)
        except OSError as exc:
            raise StorageError(f"cannot read text index file: {exc.strerror or exc}", path=path) from exc
        except ValueError as exc:
            raise FormatError(f"not an index file of {columns} integers per line: {exc}", path=path) from exc
    if table.size == 0:
        return np.zeros((0, columns), dtype=np.int64)
    if table.shape[1] != columns:
        raise FormatError(f"expected {columns} integers per line, found {table.shape[1]}", path=path, offset=0)
    return table


_BRACE = re.compile(r"\{([^{}]*)\}")
_GLOB = re.compile(r"[*?[]")


def _braces(pattern: str) -> list[str]:
    """``pattern`` with its first ``{a,b}`` or ``{0000..0099}`` expanded (then the rest,
    recursively), in order: as webdataset and the shell write shard lists. A numeric
    range keeps the width of its first bound (``{000..12}`` gives ``000`` ... ``012``)."""
    m = _BRACE.search(pattern)
    if m is None:
        return [pattern]
    body = m.group(1)
    r = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if r is not None:
        lo, hi = int(r.group(1)), int(r.group(2))
        if hi < lo:
            raise ConfigError(f"{pattern!r}: the range {{{body}}} runs backwards")
        width = len(r.group(1))
        choices = [f"{n:0{width}d}" for n in range(lo, hi + 1)]
    elif "," in body:
        choices = body.split(",")
    else:
        return [pattern[:m.end()] + p for p in _braces(pattern[m.end():])]  # a literal {word}
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [p for c in choices for p in _braces(head + c + tail)]


def shard_paths(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], what: str) -> list[str]:
    """The files named by ``paths`` (one path or several), in order, with brace patterns
    (``shard-{0000..0099}.tar``, ``{train,val}.rec``) expanded and glob patterns
    (``shards/*.tar``) matched, sorted by name. A path without a pattern is kept as it
    is (a missing one is reported when it is opened); a glob that matches no file is a
    ``DataError`` naming the pattern (``what``: e.g. ``"tar file"``)."""
    given = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for p in given:
        for one in _braces(os.fspath(p)):
            if has_pattern(one) and is_url(one):
                found = _matching_objects(one)
                if not found:
                    raise DataError(f"no {what} matches this pattern", path=one)
                out.extend(found)
            elif has_pattern(one) and not os.path.exists(one):
                found = sorted(glob.glob(one))
                if not found:
                    raise DataError(f"no {what} matches this pattern", path=one)
                out.extend(found)
            else:
                out.append(one)
    return out


def _matching_objects(pattern: str) -> list[str]:
    """The objects whose URLs match a glob ``pattern`` (``s3://b/shards/*.tar``), sorted:
    one listing of the prefix before the first wildcard."""
    head = pattern[:_GLOB.search(pattern).start()]
    return sorted(info.url for info in remote_client().list(head) if fnmatch.fnmatchcase(info.url, pattern))


def has_pattern(path: str) -> bool:
    """Whether ``path`` holds a glob wildcard (``*``, ``?``, ``[``): a local path or a
    bucket's URL (``s3://``, ``gs://``, Azure: a listing matches it); never an http(s) URL,
    which has no listing and whose ``?`` starts its query."""
    return not is_http(path) and _GLOB.search(path) is not None


def full_path(path: str | os.PathLike[str]) -> str:
    """``path`` made absolute; a URL as it is."""
    path = os.fspath(path)
    return path if is_url(path) else os.path.abspath(path)


_COPY_BATCH = 8  # blocks read per batch while copying a remote object


def object_blocks(url: str) -> tuple[int, SampleIndex]:
    """(size in bytes, an index of one sample per ``remote_block`` piece) of the remote
    object ``url``: read through the storage core, its pieces are the node-local cache's
    blocks, so bytes read this way at index time are the epoch's reads already cached."""
    info = remote_client().head(url)
    block = max(4096, config.get("remote_block"))
    starts = np.arange(0, info.size, block, dtype=np.int64)
    extents = Extents(np.zeros(len(starts), np.int32), starts, np.minimum(block, info.size - starts))
    return info.size, SampleIndex(PathTable.from_paths([url]), {"data": extents}, meta=object_versions([url]))


@contextmanager
def local_copy(url: str, what: str) -> Iterator[str]:
    """The remote object ``url`` (a ``what``, e.g. ``"LMDB data file"``) as a local file,
    for a library that needs one at index time (LMDB's memory map, FFmpeg's seeks). The
    object is read whole through the storage core in ``remote_block`` pieces, so with the
    node-local cache on its blocks stay cached and the epoch's reads of the same bytes
    download nothing more. The copy is a temporary file in the cache folder
    (``gpuio.storage.cache.new_copy``, as large as the object), removed when the block ends
    (or by the cache's eviction, once unwritten for its stall limit, if this process dies); a
    ``DataError`` inside the block that names the copy is raised again naming ``url``."""
    size, pieces = object_blocks(url)
    folder = cache_folder()

    def cannot_write(exc: OSError) -> StorageError:
        return StorageError(f"cannot write a local copy of the object ({size} bytes) into {folder} "
                            f"(remote_cache_dir): {exc.strerror or exc}", path=url)

    try:
        fd, copy = new_copy(os.path.splitext(url_path(url))[1])
    except OSError as exc:
        raise cannot_write(exc) from exc
    try:
        rows = np.arange(len(pieces))
        batches = [rows[k: k + _COPY_BATCH] for k in range(0, len(rows), _COPY_BATCH)]
        try:
            with (os.fdopen(fd, "wb") as f, Reader("cpu") as reader,
                  progress(f"copying {what}", size, "B") as advance):
                for k, rows in enumerate(batches):
                    if k + 1 < len(batches):
                        reader.prefetch(pieces, batches[k + 1])
                    for piece in reader.read(pieces, rows):
                        f.write(piece)
                        advance(len(piece))
        except StorageError:  # a read of the object: it names the URL already
            raise
        except OSError as exc:  # the copy's own writes (a full disk)
            raise cannot_write(exc) from exc
        try:
            yield copy
        except DataError as exc:
            if exc.path != copy:
                raise
            raise type(exc)(exc.reason, path=url, offset=exc.offset, sample=exc.sample) from exc
    finally:
        with suppress(FileNotFoundError):  # removed by an eviction while indexing ran long
            os.unlink(copy)


def derived_path(source: str, kind: str, *salt: object) -> str:
    """Where a file derived from ``source`` at indexing (a decompressed copy) lies:
    ``<cache_dir>/<kind>/<tag>-<name>``, the tag naming the version of ``source`` (a local
    file's size and mtime, an object's size and ETag) and ``salt`` (the options it was
    derived with), so that a changed source or other options get a file of their own."""
    if is_url(source):
        info = remote_client().head(source)
        version = f"{source}\0{info.size}\0{info.etag}"
    else:
        try:
            st = os.stat(source)
        except OSError as exc:
            raise StorageError(f"cannot read the file: {exc.strerror or exc}", path=source) from exc
        version = f"{os.path.abspath(source)}\0{st.st_size}\0{st.st_mtime_ns}"
    tag = hashlib.sha256("\0".join([version, *map(str, salt)]).encode()).hexdigest()[:24]
    folder = os.path.join(config.get("cache_dir") or os.path.join(os.path.expanduser("~"), ".cache", "gpuio"), kind)
    return os.path.join(folder, f"{tag}-{os.path.basename(url_path(source))}")


@contextmanager
def writing_whole(out: str, source: str) -> Iterator[BinaryIO]:
    """``out`` (a ``derived_path`` of ``source``) written whole or not at all: the block
    writes a ``.part`` of this process beside it, renamed onto ``out`` when the block ends
    without an error and removed when it raises."""
    tmp = f"{out}.{os.getpid()}.part"
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(tmp, "wb") as dst:
            yield dst
        os.replace(tmp, out)
    except StorageError:  # a read of the source: it names the source already
        raise
    except OSError as exc:
        raise StorageError(f"cannot write {os.path.basename(out)} into {os.path.dirname(out)} (cache_dir): "
                           f"{exc.strerror or exc}", path=source) from exc
    finally:
        with suppress(FileNotFoundError):
            os.remove(tmp)


# An indexing shows its bar only once it has run this long, so small datasets stay silent.
PROGRESS_DELAY_S = 1.0


@contextmanager
def progress(what: str, total: int | None, unit: str) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr (tqdm) for an indexing step; yields ``advance(n)``,
    safe to call from several threads. The bar appears at the first ``advance`` after
    ``PROGRESS_DELAY_S`` seconds and is removed when the step ends; tqdm is imported
    only then, so that a step that ends sooner does not pay for its import."""
    start, lock = time.monotonic(), threading.Lock()
    done, bars = 0, [_bar(what, total, unit, 0)] if PROGRESS_DELAY_S <= 0 else []

    def advance(n: int) -> None:
        nonlocal done
        with lock:
            if bars:
                bars[0].update(n)
                return
            done += n
            if time.monotonic() - start >= PROGRESS_DELAY_S:
                bars.append(_bar(what, total, unit, done))

    try:
        yield advance
    finally:
        for bar in bars:
            bar.close()


def _bar(what: str, total: int | None, unit: str, done: int) -> object:
    from tqdm import tqdm

    class Bar(tqdm):
        monitor_interval = 0  # no monitor thread: a process with one thread may fork its shard pool

    scale = unit == "B"
    return Bar(total=total, initial=done, desc=what, unit=unit, unit_scale=scale,
               unit_divisor=1024 if scale else 1000, file=sys.stderr, leave=False, dynamic_ncols=True)


def each_shard(work: Callable[[_T, Callable[[int], None]], _R], items: Sequence[_T], what: str,
               sizes: Sequence[int], processes: bool = True, unit: str = "B") -> list[_R]:
    """``[work(item, advance) for item in items]``, in order, with a progress bar on
    stderr counting ``unit`` (bytes by default) out of ``sum(sizes)`` (``advance(n)``:
    ``n`` more done; ``sizes[k]`` is item k's share).

    Indexing a shard is a Python loop over its headers: threads would only take turns
    holding the GIL. So the first item runs here, and when the rest would take more
    than ``POOL_AFTER_S`` seconds at its pace (and ``processes``), they run on a pool
    of forked processes, one per core. Only a process with no other Python thread
    forks (a fork copies locks other threads may hold; a fork server or spawned
    interpreter would run the caller's script again unless it guards its main
    code); the pool starts before the progress bar's own thread. The first failing
    item, in order, raises its error; items not yet started are cancelled."""
    if not items:
        return []
    t0 = time.perf_counter()
    first = work(items[0], _no_progress)
    rest = len(items) - 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    pool = None
    if (processes and rest and cores > 1 and (time.perf_counter() - t0) * rest > POOL_AFTER_S
            and threading.active_count() == 1 and not multiprocessing.current_process().daemon):
        pool = ProcessPoolExecutor(max_workers=min(rest, cores), mp_context=multiprocessing.get_context("fork"))
    try:
        futures = [pool.submit(work, item, _no_progress) for item in items[1:]] if pool is not None else None
        with progress(what, int(sum(sizes)), unit) as advance:
            advance(sizes[0])
            out = [first]
            if futures is None:
                out += [work(item, advance) for item in items[1:]]
            else:
                for future, size in zip(futures, sizes[1:]):
                    out.append(future.result())
                    advance(size)
        return out
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


# Shards go to a process pool when the rest would take longer than this here; below it,
# starting the processes costs more than it saves.
POOL_AFTER_S = 0.5


def _no_progress(n: int) -> None:
    """``advance`` in a pool process: its shard counts once it is back."""
