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

import os
from array import array

import numpy as np

from gpuio.errors import DataError, FormatError
from gpuio.formats._files import regular_file_size
from gpuio.index import Extents, PathTable, Ragged, SampleIndex

__all__ = ["lmdb"]


def lmdb(path: str | os.PathLike[str]) -> SampleIndex:
    """Index the main database of the LMDB environment at ``path`` (the environment
    directory, or the data file of an environment made with ``subdir=False``).

    Fields: ``key`` (``bytes``, a ``Ragged`` of kind ``"bytes"``) and ``data`` (the
    value's bytes in the data file), in key order. The environment is opened read-only
    without the lock file and closed before returning. Paths that are not UTF-8 work
    (LMDB gets the path's bytes).
    """
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
    n = len(length)
    return SampleIndex(
        PathTable.from_paths([data_file]),
        {"data": Extents(np.zeros(n, dtype=np.int32), offset, length)},
        {"key": Ragged(np.frombuffer(bytes(keys), dtype=np.uint8), key_offsets, "bytes")},
        meta={"format": "lmdb", "page_size": psize},
    )


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
