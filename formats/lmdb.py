"""LMDB environments: one sample per key, the extent pointing at the value's bytes.

LMDB keeps every value contiguous in ``data.mdb`` (in a leaf page, or in a run of
overflow pages for values above about 2 KiB), and maps that file into memory from
byte 0. The byte offset of a value in the file is therefore its address in the map
minus the map's base address, and the storage core reads values like any other
extent (through GDS too) without LMDB at read time.

The base address comes from ``/proc/self/maps`` (the mapping of ``data.mdb`` that holds
the values); ``env.info()["map_addr"]`` is the address stored in the meta page, which
is 0 unless the environment was created with ``MDB_FIXEDMAP``, so it cannot be used.
"""

from __future__ import annotations

import itertools
import mmap
import os
from array import array
from collections.abc import Callable

import numpy as np

from gpuio.errors import DataError, FormatError
from gpuio.formats._files import local_copy, progress, regular_file_size
from gpuio.storage.remote import is_url, object_versions, url_path
from gpuio.index import Extents, PathTable, Ragged, SampleIndex

__all__ = ["lmdb"]


def lmdb(path: str | os.PathLike[str]) -> SampleIndex:
    """Index the main database of the LMDB environment at ``path`` (the environment
    directory, or the data file of an environment made with ``subdir=False``).

    Fields: ``key`` (``bytes``, a ``Ragged`` of kind ``"bytes"``) and ``data`` (the
    value's bytes in the data file), in key order. The environment is opened read-only
    without the lock file and closed before returning. Paths that are not UTF-8 work
    (LMDB gets the path's bytes).

    A URL names the environment (``s3://bucket/train.lmdb``, read as its ``data.mdb``) or
    its data file (``.../data.mdb``). LMDB maps the data file into memory, so indexing
    reads the object whole into a temporary local copy (through the node-local cache, so
    reading the values later downloads nothing more), removed after; the index names the
    URL, and the values are read by ranged GETs as in every format.
    """
    path = os.fspath(path)
    if is_url(path):
        url = path if url_path(path).endswith(".mdb") else path.rstrip("/") + "/data.mdb"
        with local_copy(url, "LMDB data file") as copy:
            index = _local(copy)
        return SampleIndex(PathTable.from_paths([url]), index.extents, index.values,
                           meta={**index.meta, **object_versions([url])})
    return _local(path)


def _local(path: str) -> SampleIndex:
    import lmdb as _lmdb

    path = os.path.abspath(os.fspath(path))
    subdir = os.path.isdir(path)
    data_file = os.path.join(path, "data.mdb") if subdir else path
    size = regular_file_size(data_file, "LMDB data file")
    if size == 0:  # LMDB itself answers "Bad file descriptor"
        raise FormatError("empty LMDB data file (0 bytes); an environment holds at least its two meta pages",
                          path=data_file, offset=0)
    try:
        env = _lmdb.open(os.fsencode(path), subdir=subdir, readonly=True, lock=False, readahead=False,
                         create=False, max_dbs=0)
    except _lmdb.Error as exc:
        raise FormatError(f"not a readable LMDB environment: {exc}", path=data_file, offset=0) from exc
    try:
        return _index(env, data_file, size, _lmdb.Error)
    finally:
        env.close()


def _index(env, data_file: str, size: int, lmdb_error: type[Exception]) -> SampleIndex:
    psize = env.stat()["psize"]
    need = (env.info()["last_pgno"] + 1) * psize
    if need > size:  # pages past the end of the file would fault (SIGBUS) when touched
        raise FormatError(f"truncated LMDB data file: the meta page names {need // psize} pages "
                          f"({need} bytes), the file has {size} bytes", path=data_file, offset=size)
    with progress("indexing LMDB", env.stat()["entries"], "record") as advance:
        try:
            walked = _page_walk(env, data_file, size, psize)
        except lmdb_error:  # LMDB's own cursor fails on the pages: the cursor loop below reports where
            walked = None
        if walked is not None:
            advance(len(walked[1]))
            offset, length, keys, key_offsets = walked
            return _sample_index(data_file, offset, length, keys, key_offsets, psize)
        return _cursor_index(env, data_file, size, psize, lmdb_error, advance)


def _cursor_index(env, data_file: str, size: int, psize: int, lmdb_error: type[Exception],
                  advance: Callable[[int], None]) -> SampleIndex:
    """The index from LMDB's cursor, one record at a time."""
    addresses, lengths, key_lengths = array("q"), array("q"), array("q")
    keys = bytearray()
    try:
        with env.begin(buffers=True) as txn:
            for key, value in txn.cursor():
                keys += key
                key_lengths.append(len(key))
                n = len(value)
                lengths.append(n)
                # the buffer is a view into the map; its address is the value's place
                addresses.append(np.frombuffer(value, dtype=np.uint8).ctypes.data if n else 0)
                if not len(lengths) & 0xFFFF:
                    advance(0x10000)
    except lmdb_error as exc:
        raise FormatError(f"corrupt LMDB database after {len(lengths)} records: {exc}",
                          path=data_file, sample=f"record {len(lengths)}") from exc
    addr = np.frombuffer(addresses, dtype=np.int64)
    length = np.frombuffer(lengths, dtype=np.int64)
    nonempty = length > 0
    offset = np.zeros(len(addr), dtype=np.int64)
    if nonempty.any():
        base = _map_base(int(addr[nonempty][0]), data_file)
        offset[nonempty] = addr[nonempty] - base
        bad = nonempty & ((offset < 0) | (offset + length > size))
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise FormatError(f"value of {int(length[k])} bytes lies outside the data file "
                              f"({size} bytes)", path=data_file, sample=f"record {k}", offset=int(offset[k]))
    key_offsets = np.zeros(len(key_lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(key_lengths, dtype=np.int64), out=key_offsets[1:])
    return _sample_index(data_file, offset, length, np.frombuffer(bytes(keys), dtype=np.uint8), key_offsets, psize)


def _sample_index(data_file: str, offset: np.ndarray, length: np.ndarray, keys: np.ndarray,
                  key_offsets: np.ndarray, psize: int) -> SampleIndex:
    n = len(length)
    return SampleIndex(
        PathTable.from_paths([data_file]),
        {"data": Extents(np.zeros(n, dtype=np.int32), offset, length)},
        {"key": Ragged(keys, key_offsets, "bytes")},
        meta={"format": "lmdb", "page_size": psize},
    )


# The on-disk layout of LMDB 0.9 (data version 1) on 64-bit systems, as mdb.c defines it:
# a page starts with a 16-byte header (page number u64, pad u16, flags u16, lower u16,
# upper u16) followed by u16 offsets of its nodes; a node is (lo u16, hi u16, flags u16,
# key size u16, key, data). A leaf node's data size is lo | hi << 16, and a value too
# big for the page (flag F_BIGDATA) is a u64 page number of overflow pages holding it
# after their own header. A branch node's child page number is lo | hi << 16 | flags << 32.
# The meta pages (0 and 1) hold after the page header: magic u32, version u32, address,
# map size, then the free and main databases (pad u32, flags u16, depth u16, branch,
# leaf and overflow page counts, entries, root page: u64 each), last page, txnid.
_MAGIC, _VERSION = 0xBEEFC0DE, 1
_P_BRANCH, _P_LEAF, _P_LEAF2 = 0x01, 0x02, 0x20
_F_BIGDATA, _F_SUBDATA_DUPDATA = 0x01, 0x06
_DUPSORT = 0x04
_HEADER = 16
_LEAVES = 4096  # leaf pages parsed at once: bounds the per-node arrays (int64 each) in memory


def _page_walk(env, data_file: str, size: int, psize: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(value offsets, value lengths, key bytes, key offsets)`` of the main database in
    key order, from the B-tree pages of ``data.mdb`` read with NumPy; ``None`` where the
    layout is not the one above (another LMDB version, a dupsort database) or does not
    agree with LMDB's own cursor on every key, so that the cursor loop indexes (and
    reports) such files. The cursor check runs in C (``iternext``)."""
    with open(data_file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        data = np.frombuffer(mm, dtype=np.uint8)
        try:
            walked = _walk_pages(data, size, psize, env.info()["last_txnid"], env.stat()["entries"])
        finally:
            del data  # the map closes only once no array views it
    if walked is None:
        return None
    keys = walked[2]
    # keys are unique in the database: the same keys in the same order are the same nodes
    with env.begin() as txn:  # keys as bytes: joining them is faster than joining buffers
        cursor_keys, at = txn.cursor().iternext(keys=True, values=False), 0
        while True:
            part = b"".join(itertools.islice(cursor_keys, 1 << 16))  # a run at a time: bounded memory
            if not part:
                return walked if at == len(keys) else None
            if memoryview(keys)[at:at + len(part)] != part:
                return None
            at += len(part)


def _u(data: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """Little-endian unsigned integers of ``width`` bytes at byte offsets ``at``."""
    if width == 2 and len(data) % 2 == 0 and not np.any(at & 1):  # node fields: 2-byte aligned
        return data.view("<u2")[at >> 1].astype(np.int64)
    out = np.zeros(len(at), dtype=np.int64)
    for b in range(width - 1, -1, -1):
        out = (out << 8) | data[at + b]
    return out


def _walk_pages(data: np.ndarray, size: int, psize: int, txnid: int, entries: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    metas = np.array([0, psize])
    if size < 2 * psize or np.any(_u(data, metas + 16, 4) != _MAGIC) or np.any(_u(data, metas + 20, 4) != _VERSION):
        return None
    current = np.flatnonzero(_u(data, metas + 144, 8) == txnid)
    if len(current) != 1:
        return None
    main = int(metas[current[0]]) + 88
    flags, root = int(_u(data, np.array([main + 4]), 2)[0]), int(_u(data, np.array([main + 40]), 8)[0])
    if flags & _DUPSORT:
        return None
    if entries == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=np.uint8), np.zeros(1, dtype=np.int64)
    pages = size // psize
    level = np.array([root], dtype=np.int64)
    while True:  # one tree level at a time, pages in key order
        if np.any((level < 2) | (level >= pages)):
            return None
        kind = _u(data, level * psize + 10, 2)
        if np.all(kind & _P_LEAF) and not np.any(kind & (_P_LEAF2 | _P_BRANCH)):
            break
        if not np.all(kind == _P_BRANCH):
            return None
        nodes, node_at = _nodes(data, level, psize)
        if nodes is None:
            return None
        level = _u(data, node_at, 2) | (_u(data, node_at + 2, 2) << 16) | (_u(data, node_at + 4, 2) << 32)
    runs = [_leaves(data, level[k:k + _LEAVES], psize, size) for k in range(0, len(level), _LEAVES)]
    if any(run is None for run in runs) or sum(len(run[1]) for run in runs) != entries:
        return None
    offset = np.concatenate([run[0] for run in runs])
    length = np.concatenate([run[1] for run in runs])
    ksize = np.concatenate([run[2] for run in runs])
    keys = np.concatenate([run[3] for run in runs])
    del runs
    key_offsets = np.zeros(len(ksize) + 1, dtype=np.int64)
    np.cumsum(ksize, out=key_offsets[1:])
    return offset, length, keys, key_offsets


def _leaves(data: np.ndarray, leaves: np.ndarray, psize: int, size: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """``(value offsets, value lengths, key sizes, key bytes)`` of the nodes of a run of
    leaf pages, in order; ``None`` where a node is not a plain record or lies outside
    its page or the file."""
    pages = size // psize
    nodes, node_at = _nodes(data, leaves, psize)
    if nodes is None:
        return None
    node_flags = _u(data, node_at + 4, 2)
    ksize = _u(data, node_at + 6, 2)
    length = _u(data, node_at, 2) | (_u(data, node_at + 2, 2) << 16)
    if np.any(node_flags & _F_SUBDATA_DUPDATA) or np.any(node_at + 8 + ksize > nodes * psize + psize):
        return None
    offset = node_at + 8 + ksize
    big = np.flatnonzero(node_flags & _F_BIGDATA)
    if len(big):
        over = _u(data, offset[big], 8)
        if np.any((over < 2) | (over >= pages)):
            return None
        offset[big] = over * psize + _HEADER
    if np.any(offset + length > size):
        return None
    if len(ksize) and np.all(ksize == ksize[0]):  # keys of one size: a 2-D gather
        at = (node_at + 8)[:, None] + np.arange(int(ksize[0]))
    else:
        starts = np.cumsum(ksize) - ksize
        at = np.repeat(node_at + 8 - starts, ksize) + np.arange(int(ksize.sum()))
    return offset, length, ksize, data[at].ravel()


def _nodes(data: np.ndarray, pages: np.ndarray, psize: int) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """``(page of each node, byte offset of each node)`` of ``pages``, in order."""
    base = pages * psize
    lower = _u(data, base + 12, 2)
    count = (lower - _HEADER) // 2
    if np.any(lower < _HEADER) or np.any(lower > psize):
        return None, None
    page = np.repeat(pages, count)
    slot = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    ptr = _u(data, np.repeat(base, count) + _HEADER + 2 * slot, 2)
    if np.any(ptr < _HEADER) or np.any(ptr + 8 > psize):
        return None, None
    return page, page * psize + ptr


def _map_base(address: int, data_file: str) -> int:
    """Address of byte 0 of ``data_file`` in the mapping of this process that holds
    ``address``, from ``/proc/self/maps`` (``start-end perms offset dev inode path``)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise DataError("indexing LMDB needs /proc/self/maps (Linux) to find value offsets",
                        path=data_file) from exc
    st = os.stat(data_file)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}".encode()
    for line in lines:
        parts = line.split(None, 5)
        start, end = (int(x, 16) for x in parts[0].split(b"-"))
        if start <= address < end:
            if len(parts) < 5 or int(parts[4]) != st.st_ino or parts[3] != dev:
                break
            return start - int(parts[2], 16)
    raise DataError(f"LMDB value at address {address:#x} is not in a mapping of the data file",
                    path=data_file)
