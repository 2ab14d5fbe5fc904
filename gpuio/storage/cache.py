"""The node-local cache tier of remote data.

Remote bytes are kept on local disk, in ``remote_cache_dir`` (default
``<cache_dir>/remote``), as whole objects up to ``remote_block`` bytes and as aligned
blocks of that size of larger ones. A block's file name is derived from the object's
URL, ETag and size, so a replaced object never maps to the old bytes; a presigned URL's
signing parameters are left out of it where the ETag is a strong one (the same object
signed again is the same entry).

Rules:

- a block is written to a temporary file (``.part``) and renamed into place: a reader
  sees a whole block or none;
- one download per block on the node: the process that creates ``<block>.part``
  (``O_EXCL``) downloads into it, holding a lock on it, the others wait for the block (a
  ``.part`` whose lock is free is left by a dead process, one older than the stall limit,
  ``remote_timeout`` x (``remote_retries`` + 1) seconds, by a hung one: either is taken
  over); within a process, one fetch per block;
- writes are behind the reads: a downloaded block's bytes go to the batch at once, and
  its file is written and renamed on a writer thread. Until then this process serves
  the block from memory, other processes wait for the rename. At most
  ``remote_readahead`` bytes wait to be written: a download waits for room;
- read-ahead (``prefetch``): the blocks of coming batches (a Loader knows its order)
  are fetched in the background (``remote_requests`` threads), at most
  ``remote_readahead`` bytes in flight; what does not fit is fetched when read, and
  what has not started when the interpreter exits is dropped. A block whose file is
  there at its size is passed over in one pass over the names (no thread, no lock);
- a block file ends with an 8-byte trailer, the magic ``gpc2`` and the CRC-32C of the
  block's bytes (the ``crc32c`` package: the CPU's CRC instruction where it has one),
  computed when it is written. When a process first meets a block
  file it checks the size and the CRC: a block cut short, overwritten or corrupted in
  place (same size) is removed and downloaded again. A batch meets its new blocks in one
  pass on the reading thread, each read whole once (into the batch where the batch
  wants all of it, else into a buffer its pieces are copied from); only the blocks
  found missing or bad are fetched on threads. A process remembers the blocks it met
  (``Objects``: an index, Reader or Loader made again over the same objects shares
  them), so its later epochs read the block files as local files. A block that fails a
  later read (evicted or cut short by another process) makes the batch look at its
  blocks again, once;
- the cache holds at most ``remote_cache_budget`` bytes: past it, the least recently
  used blocks (by modification time, touched when first met and again at most every
  ``_RECHECK_S`` while in use, on the writer thread) go first, never a block of the
  batch being read;
- a full cache disk (ENOSPC, EDQUOT, EFBIG) is a warning: the batch gets the bytes it
  downloaded, and they are not kept;
- objects smaller than ``remote_pack_below`` are not a file each: they are appended to
  shared pack files (``_Packs``: each process appends to packs of its own, a record
  per object that every process reads; one download per object on the node by a lock
  on a byte of a claims file; eviction removes whole packs), with the same rules of
  verification, write-behind and read-ahead;
- the reads themselves are the posix backend's (its C read loop), from the block files,
  whose names a batch gets from NumPy arrays per index (``Objects``): a later epoch
  reads local disk with no Python per block.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import struct
import tempfile
import threading
import time
import urllib.parse
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np
from crc32c import crc32c

from gpuio import config
from gpuio._fork import renew_after_fork
from gpuio.errors import StorageError
from gpuio.index import PathTable
from gpuio.storage.buffers import Lease
from gpuio.storage.plan import ReadPlan

__all__ = ["BlockCache", "Objects", "cache_folder", "flush", "new_copy"]

_POLL_S = 0.005  # first wait for a block another process downloads; doubles up to _POLL_MAX_S
_POLL_MAX_S = 0.1
# a cache disk that is full (or a file size limit): the reads go on without caching
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_RECHECK_S = 30.0  # a block in use is touched (mtime, for the LRU order) again after this long
_EVICT_SHARE = 8  # the folder is scanned for eviction after downloads of budget / this many bytes
_TAG = 20  # bytes of an object's sha256 that name its blocks (40 hex digits)
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_WRITERS = 2  # threads writing blocks behind the reads
_MAGIC = b"gpc2"  # a block file's trailer: this, then the CRC-32C of the block's bytes (little-endian)
_TRAILER = struct.Struct("<4sI")
_CLAIM_LOCKS = hasattr(fcntl, "F_OFD_SETLK")  # a block claim is locked by its process (Linux)
_CLAIM_GRACE_S = 1.0  # a claim younger than this may not be locked yet
# a process's pack takes appends up to this size (at most 1/_PACK_SHARE of the budget: eviction
# removes whole packs), then it starts another
_PACK_BYTES = 64 << 20
_PACK_SHARE = 16
_RECORD_MAGIC = b"gpr1"
# a pack record: magic, the object's tag, its bytes' offset and length in the pack and their CRC-32C; then the
# CRC-32C of those fields
_RECORD_HEAD = struct.Struct(f"<4s{_TAG}sqqI")
_RECORD = struct.Struct(f"<4s{_TAG}sqqII")


def cache_folder() -> str:
    """The folder of the remote cache (``remote_cache_dir``, else ``<cache_dir>/remote``)."""
    folder = config.get("remote_cache_dir")
    if not folder:
        base = config.get("cache_dir") or os.path.join(os.path.expanduser("~"), ".cache", "gpuio")
        folder = os.path.join(base, "remote")
    return folder


def new_copy(suffix: str) -> tuple[int, str]:
    """A new empty file for a whole copy of an object (a format's indexing aid), open for
    writing: ``(descriptor, path)``, in the cache folder's ``copies`` folder and named as
    a claim (``.part``), so that eviction counts it in no budget and removes it once no
    process has written to it for the stall limit, as it removes a dead process's claims.
    The caller removes it when done."""
    folder = os.path.join(cache_folder(), "copies")
    os.makedirs(folder, exist_ok=True)
    return tempfile.mkstemp(suffix=f"{suffix}.part", dir=folder)


class _Object(NamedTuple):
    """What the cache needs of an object (``gpuio.storage.remote.ObjectInfo`` has the same fields)."""

    url: str
    size: int
    etag: str


# query parameters that sign a URL (S3 SigV4 and V2, GCS, CloudFront), not name the object
_SIGNING = ("x-amz-", "x-goog-")
_SIGNING_NAMES = {"awsaccesskeyid", "signature", "expires", "key-pair-id", "policy", "googleaccessid", "x-id"}
# an Azure SAS token's parameters (a token has sv and sig); short names, so left out only there
_SAS_NAMES = {"sv", "ss", "srt", "sr", "sp", "st", "se", "sip", "spr", "si", "sig", "sdd", "skoid", "sktid", "skt",
              "ske", "sks", "skv", "saoid", "suoid", "scid"}


def _identity(url: str, etag: str) -> str:
    """What names an object's bytes in the cache: its URL, less the query parameters
    that only sign it (S3, GCS, CloudFront, an Azure SAS token) where a strong ETag pins
    the version, so that the same object presigned again (a new signature, a new expiry)
    is the same cache entry."""
    if "?" not in url or not etag or etag.startswith("W/") or not url.startswith(("http://", "https://")):
        return url
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    sas = {"sv", "sig"} <= {k.lower() for k, _ in query}
    kept = [(k, v) for k, v in query
            if not (k.lower().startswith(_SIGNING) or k.lower() in _SIGNING_NAMES or (sas and k.lower() in _SAS_NAMES))]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(kept), fragment=""))


def _tag(url: str, etag: str, size: int) -> bytes:
    return hashlib.sha256(f"{_identity(url, etag)}\0{etag}\0{size}".encode()).digest()[:_TAG]


_INDEXES_MET = 4  # indexes of distinct objects whose met blocks a process remembers
_indexed: deque[Objects] = deque(maxlen=_INDEXES_MET)


class Objects:
    """One index's objects as the cache sees them.

    Per object (the index's file id): URL (``paths``), size in bytes and ETag. Per block,
    numbered ``base[object] + block``: ``seen(root)``, when this process last found it
    whole in the cache folder ``root`` (``time.monotonic()``, 0 when not known). Block
    file names are made with NumPy from per-object digests, each computed once on first
    use. The same objects indexed again (a new index, Reader or Loader of the process)
    share these with the last ``_INDEXES_MET`` made: a block this process met stays met."""

    def __init__(self, paths: PathTable, sizes: Sequence[int] | np.ndarray, etags: Sequence[str],
                 block: int) -> None:
        self.paths = paths
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.etags = list(etags)
        self.block = block
        self.base = np.zeros(len(self.sizes) + 1, dtype=np.int64)
        np.cumsum(np.maximum(1, -(-self.sizes // block)), out=self.base[1:])
        self._digest = np.zeros((len(self.sizes), _TAG), dtype=np.uint8)
        self._named = np.zeros(len(self.sizes), dtype=bool)
        self._seen: dict[str, np.ndarray] = {}  # cache folder -> per block, when last found whole there
        self._where: dict[str, np.ndarray] = {}  # cache folder -> per block, its pack record's (pack, offset)
        same = next((o for o in list(_indexed) if o._same(self)), None)
        if same is None:
            _indexed.append(self)
        else:
            self._digest, self._named, self._seen, self._where = same._digest, same._named, same._seen, same._where

    def _same(self, other: Objects) -> bool:
        return (self.block == other.block and np.array_equal(self.sizes, other.sizes) and self.etags == other.etags
                and self.paths == other.paths)

    def seen(self, root: str) -> np.ndarray:
        """Per block, when this process last found it whole in the cache folder ``root``
        (``time.monotonic()``; 0 when not known)."""
        got = self._seen.get(root)
        return got if got is not None else self._seen.setdefault(root, np.zeros(int(self.base[-1])))

    def where(self, root: str) -> np.ndarray:
        """Per block cached in a pack of the cache folder ``root``: the pack number and the
        offset of its bytes in the record this process last found of it (``-1``: none);
        they stand for a block while it is met (``seen``)."""
        got = self._where.get(root)
        return got if got is not None else self._where.setdefault(root, np.full((int(self.base[-1]), 2), -1))

    def info(self, obj: int) -> _Object:
        """Object ``obj``'s URL, size in bytes and ETag."""
        return _Object(self.paths[obj], int(self.sizes[obj]), self.etags[obj])

    def locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The object and the block number within it of each block key."""
        obj = np.searchsorted(self.base, keys, side="right") - 1
        return obj, keys - self.base[obj]

    def names(self, keys: np.ndarray, root: str) -> PathTable:
        """The block files of ``keys``: ``<root>/<tag[:2]>/<tag>.<block>``."""
        keys = np.asarray(keys, dtype=np.int64)
        obj, block = self.locate(keys)
        d = self.tags(obj)
        top = int(block.max()) if len(block) else 0
        head = 4 + 2 * _TAG  # "ab/" + 40 hex digits + "."
        width = head + len(str(top))
        mat = np.empty((len(keys), width), dtype=np.uint8)
        mat[:, 3:head - 1:2], mat[:, 4:head - 1:2] = _HEX[d >> 4], _HEX[d & 15]
        mat[:, 0:2] = mat[:, 3:5]
        mat[:, 2] = ord("/")
        mat[:, head - 1] = ord(".")
        if top < 10:  # one digit each (an object cached whole is block 0): rows of one width
            mat[:, head] = ord("0") + block
            return PathTable(mat.reshape(-1), np.arange(len(keys) + 1, dtype=np.int64) * width, root)
        digits = np.ones(len(keys), dtype=np.int64)
        power = 10
        while power <= top:
            digits += block >= power
            power *= 10
        for j in range(width - head):
            mat[:, head + j] = ord("0") + (block // 10 ** np.maximum(digits - 1 - j, 0)) % 10
        lengths = head + digits
        offsets = np.zeros(len(keys) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return PathTable(mat[np.arange(width) < lengths[:, None]], offsets, root)

    def tags(self, obj: np.ndarray) -> np.ndarray:
        """The tags (URL, ETag and size digests) of objects ``obj``: ``(n, 20)`` bytes."""
        new = obj[~self._named[obj]]
        if len(new):
            new = np.unique(new)
        for o in new.tolist():
            self._digest[o] = np.frombuffer(_tag(self.paths[o], self.etags[o], int(self.sizes[o])), dtype=np.uint8)
        self._named[new] = True
        return self._digest[obj]

    def blocks(self, file: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The blocks the byte ranges ``[start, end)`` of objects ``file`` touch: per
        (range, block) pair the range's position and the block's key."""
        B = self.block
        first, last = start // B, (end - 1) // B
        counts = np.where(end > start, last - first + 1, 0)
        which = np.repeat(np.arange(len(start)), counts)
        block = first[which] + np.arange(len(which)) - np.repeat(np.cumsum(counts) - counts, counts)
        return which, self.base[file[which]] + block


class _Packs:
    """The pack files of one cache folder (``<root>/packs``), as this process sees them.

    Objects smaller than ``remote_pack_below`` are appended to packs, not kept in a file
    each. A pack is two files written by one process only: ``<name>.pack``, the objects'
    bytes back to back, and ``<name>.rec``, a record per object (``_RECORD``: magic, the
    object's tag (its URL, ETag and size), where its bytes are, their CRC-32C, and the
    record's own CRC-32C). The bytes are written before their record, and a record counts
    only when whole and its CRC matches, so a process killed while appending loses no
    object recorded before and shows none half written. The writer holds a lock on its
    record file (an OFD lock: released when the process ends), so that eviction, which
    removes whole packs, leaves the packs being written alone. Every process reads every
    record file (the part appended since it last looked) into one table, sorted by tag.
    The download of an object is claimed with an OFD lock on a byte of ``claims`` named
    by its tag, held until its record is written: the others wait for the record, or
    take the claim over when its process ends."""

    def __init__(self, root: str) -> None:
        self.folder = os.path.join(root, "packs")
        self.names: list[str] = []  # pack number -> name
        self._number: dict[str, int] = {}
        self._read_to: list[int] = []  # per pack, the bytes of its record file read
        # the records, in runs sorted by tag (newer runs later; merged as a binary counter merges, so
        # that adding n records costs O(n log n) in all): per record its tags and its pack, offset,
        # length (-1: found bad) and CRC-32C
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []
        self._inserted = False  # records were added since the last lookup
        self.paths = PathTable.from_paths([], root)  # the pack files by number, relative to the root
        self._lock = threading.Lock()  # the table and the names
        self._fresh()
        renew_after_fork(self)

    def _fresh(self) -> None:
        self._write_lock = threading.Lock()  # this process's pack
        self._own: list[Any] | None = None  # [number, .pack fd, .rec fd, bytes written]
        self._claims: int | None = None  # descriptor of the claims file

    def _after_fork(self) -> None:
        """In a forked child: the parent's pack and claims are not this process's."""
        self._lock = threading.Lock()
        self._fresh()

    def find(self, tags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per tag (``S20``): whether a good record of it is known, and the record (pack,
        offset, length, CRC-32C; the latest of its tag)."""
        row = np.zeros((len(tags), 4), dtype=np.int64)
        known = np.zeros(len(tags), dtype=bool)
        with self._lock:  # no record added since the last lookup (a warm epoch): one run to search from now on
            if len(self._runs) > 1 and not self._inserted:
                self._runs = [self._merged(self._runs)]
            self._inserted = False
        for keys, rows in reversed(self._runs):  # the newest record of a tag counts, good or bad
            at = np.maximum(np.searchsorted(keys, tags, side="right") - 1, 0)
            hit = ~known & (keys[at] == tags)
            row[hit], known[hit] = rows[at[hit]], True
        return known & (row[:, 2] >= 0), row

    def spoil(self, tags: np.ndarray, row: np.ndarray) -> None:
        """Forget the records ``row`` of ``tags``: their bytes failed their CRC-32C."""
        for keys, rows in self._runs:
            for tag, (pack, offset) in zip(tags.tolist(), row[:, :2].tolist()):
                lo, hi = np.searchsorted(keys, tag), np.searchsorted(keys, tag, side="right")
                for k in range(lo, hi):
                    if rows[k, 0] == pack and rows[k, 1] == offset:
                        rows[k, 2] = -1

    def _insert(self, tags: list[bytes], rows: list[tuple[int, int, int, int]]) -> None:
        if not tags:
            return
        runs = list(self._runs)
        runs.append(self._merged([(np.array(tags, dtype=f"S{_TAG}"), np.array(rows, dtype=np.int64))]))
        while len(runs) > 1 and len(runs[-2][0]) <= 2 * len(runs[-1][0]):
            newer = runs.pop()
            runs[-1] = self._merged([runs[-1], newer])
        self._runs = runs
        self._inserted = True

    @staticmethod
    def _merged(runs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """One run of the records of ``runs`` (oldest first), sorted by tag, a tag's newer
        records after its older ones."""
        keys = np.concatenate([k for k, _ in runs])
        rows = np.concatenate([r for _, r in runs])
        order = np.argsort(keys, kind="stable")
        return keys[order], rows[order]

    def refresh(self) -> None:
        """Read the records appended since this process last looked; forget the packs removed."""
        try:
            names = sorted(e.name[:-4] for e in os.scandir(self.folder) if e.name.endswith(".rec"))
        except FileNotFoundError:
            names = []
        with self._lock:
            gone = set(self._number) - set(names)
            for name in names:
                if name not in self._number:
                    self._number[name] = len(self.names)
                    self.names.append(name)
                    self._read_to.append(0)
            if gone:
                for _, rows in self._runs:
                    rows[np.isin(rows[:, 0], [self._number[n] for n in gone]), 2] = -1
                for name in gone:  # never seen again: names hold a process id and a random part
                    self._read_to[self._number[name]] = -1
            self.paths = PathTable.from_paths([f"packs/{n}.pack" for n in self.names], os.path.dirname(self.folder))
            tags, rows = [], []
            own = self._own[0] if self._own is not None else -1
            for number, name in enumerate(self.names):
                if self._read_to[number] < 0 or number == own:
                    continue
                data = _read_from(os.path.join(self.folder, f"{name}.rec"), self._read_to[number])
                used = _parse_records(data, number, tags, rows)
                self._read_to[number] += used
            self._insert(tags, rows)

    def claim(self, tag: bytes) -> bool:
        """Take the claim on downloading the object ``tag`` (False: another process holds it)."""
        if self._claims is not None and _removed(self._claims):  # the cache folder was emptied meanwhile
            os.close(self._claims)
            self._claims = None
        if self._claims is None:
            os.makedirs(self.folder, exist_ok=True)
            self._claims = os.open(os.path.join(self.folder, "claims"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        return _lock(self._claims, fcntl.F_WRLCK, _claim_offset(tag))

    def release(self, tags: Sequence[bytes]) -> None:
        for tag in tags:
            _lock(self._claims, fcntl.F_UNLCK, _claim_offset(tag))

    def append(self, entries: list[tuple[bytes, Any]], limit: int) -> list[tuple[int, int, int, int]]:
        """Append the objects ``entries`` (tag, bytes) to this process's pack and record
        them (a new pack where the pack would pass ``limit`` bytes); returns their records
        (pack, offset, length, CRC-32C)."""
        crcs = [crc32c(buf) for _, buf in entries]
        with self._write_lock:
            total = sum(len(buf) for _, buf in entries)
            if self._own is None or (self._own[3] and self._own[3] + total > limit) or _removed(self._own[2]):
                self._start_pack()
            number, data_fd, rec_fd, at = self._own
            records, rows, offset = [], [], at
            for (tag, buf), crc in zip(entries, crcs):
                head = _RECORD_HEAD.pack(_RECORD_MAGIC, tag, offset, len(buf), crc)
                records.append(head + struct.pack("<I", crc32c(head)))
                rows.append((number, offset, len(buf), crc))
                offset += len(buf)
            try:  # the bytes, then their records
                _write_all(data_fd, [memoryview(buf).cast("B") for _, buf in entries if len(buf)])
                _write_all(rec_fd, [memoryview(b"".join(records))])
            except OSError:  # a part may be written: the pack takes no more (its whole records stand)
                self._close_own()
                raise
            self._own[3] = offset
        with self._lock:
            self._insert([tag for tag, _ in entries], rows)
        return rows

    def _close_own(self) -> None:
        if self._own is not None:
            os.close(self._own[1])
            os.close(self._own[2])  # its lock goes with it: eviction may take the pack now
            self._own = None

    def _start_pack(self) -> None:
        """A new pack of this process (the last one is left as it is: whole records only)."""
        self._close_own()
        os.makedirs(self.folder, exist_ok=True)
        name = f"{os.getpid()}-{os.urandom(6).hex()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC
        data_fd = os.open(os.path.join(self.folder, f"{name}.pack"), flags, 0o644)
        rec_fd = os.open(os.path.join(self.folder, f"{name}.rec"), flags, 0o644)
        _lock(rec_fd, fcntl.F_WRLCK, 0)
        with self._lock:
            self._number[name] = len(self.names)
            self.names.append(name)
            self._read_to.append(0)
            self.paths = PathTable.from_paths([f"packs/{n}.pack" for n in self.names], os.path.dirname(self.folder))
        self._own = [self._number[name], data_fd, rec_fd, 0]


def _read_from(path: str, offset: int) -> bytes:
    """The bytes of ``path`` from ``offset`` (none where it is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return b""
    try:
        out = []
        while True:
            got = os.pread(fd, 1 << 20, offset)
            if not got:
                return b"".join(out)
            out.append(got)
            offset += len(got)
    finally:
        os.close(fd)


def _parse_records(data: bytes, number: int, tags: list[bytes], rows: list[tuple[int, int, int, int]]) -> int:
    """Add the whole, good records of ``data`` (a record file's bytes from where it was
    last read) to ``tags`` and ``rows``; returns the bytes taken. A record that fails
    its check before the last one is skipped (damaged); the last one is left to read
    again (it may be being written)."""
    size = _RECORD.size
    whole = len(data) // size
    taken = 0
    for k in range(whole):
        rec = data[k * size: (k + 1) * size]
        magic, tag, offset, length, crc, own = _RECORD.unpack(rec)
        if magic != _RECORD_MAGIC or own != crc32c(rec[: size - 4]):
            if k == whole - 1:
                break
            taken = (k + 1) * size
            continue
        tags.append(tag)
        rows.append((number, offset, length, crc))
        taken = (k + 1) * size
    return taken


def _lock(fd: int, kind: int, offset: int) -> bool:
    """Take (or with ``F_UNLCK`` give back) an OFD lock on byte ``offset`` of ``fd``, not
    waiting: whether it was taken. The lock is the open file's: another open file of the
    same file, also in this process, conflicts with it, and it goes when the file closes."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, os.SEEK_SET, offset, 1, 0))
    except (BlockingIOError, PermissionError):
        return False
    return True


def _removed(fd: int) -> bool:
    """Whether the file open as ``fd`` was removed (the cache folder emptied under this process)."""
    return os.fstat(fd).st_nlink == 0


def _claim_held(part: str) -> bool:
    """Whether a live process holds the block claim ``part`` (its lock, taken by ``_obtain``)."""
    try:
        fd = os.open(part, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return True  # renamed into place or removed: nothing to break
    try:
        return not _lock(fd, fcntl.F_RDLCK, 0)
    finally:
        os.close(fd)


def _claim_offset(tag: bytes) -> int:
    return int.from_bytes(tag[:7], "little")


_packs: dict[str, _Packs] = {}  # cache folder -> its packs, one per process
_packs_lock = threading.Lock()


def _packs_of(root: str) -> _Packs:
    with _packs_lock:
        got = _packs.get(root)
        if got is None:
            got = _packs[root] = _Packs(root)
        return got


_caches: weakref.WeakSet[BlockCache] = weakref.WeakSet()


def flush() -> None:
    """Wait until every block this process's caches fetch ahead or write behind is done."""
    for cache in list(_caches):
        cache.wait()


class BlockCache:
    """Blocks of remote objects on local disk, read through the posix backend."""

    def __init__(self, fetch: Callable[[str, int, int, str | None], Any] | None = None) -> None:
        """``fetch(url, offset, n, etag)`` gives the object's ``n`` bytes from ``offset``
        as a bytes-like buffer (``gpuio.storage.remote``'s ranged GET): the batch is
        served and the block file written from that buffer, with no copy of its own.
        None for a cache that only reads and evicts."""
        from gpuio.storage._posix import PosixBackend, native_available

        self.fetch = fetch
        self.root = cache_folder()
        self.block = max(4096, config.get("remote_block"))
        self.budget = config.get("remote_cache_budget")
        self.window = max(self.block, config.get("remote_readahead"))
        self.requests = max(1, config.get("remote_requests"))
        # objects smaller than this (and cached whole) go to packs; OFD locks (Linux) keep their claims
        self.pack_below = min(config.get("remote_pack_below"), self.block + 1) if hasattr(fcntl, "F_OFD_SETLK") else 0
        self._packs = _packs_of(self.root) if self.pack_below > 0 else None
        self.pack_bytes = max(1, min(_PACK_BYTES, self.budget // _PACK_SHARE))
        # a download running longer than every try of it may take is left by a dead or hung process
        self.stale_s = max(1, config.get("remote_timeout")) * (max(1, config.get("remote_retries")) + 1)
        self._posix = PosixBackend(config.get("io_threads"), False, "gpuio-cache-read",
                                   native=config.get("native") and native_available())
        self._added = 0
        self._folders: set[str] = set()  # block folders known to exist
        self._warned_full = False
        self._warned_write = False
        self._fresh()
        renew_after_fork(self)
        _caches.add(self)

    def _fresh(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._inflight: dict[str, Future[Any]] = {}  # block path -> its fetch in this process
        self._held = 0  # bytes downloaded, not yet written
        self._ahead = 0  # bytes of read-ahead fetches not finished
        # fetches ahead not started yet: (objects, where, path, future, bytes), taken by _fetch_ahead threads
        self._queued: deque[tuple[Objects, tuple[int, int, int], str, Future[Any], int]] = deque()
        self._fetchers = 0  # _fetch_ahead threads running
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def _after_fork(self) -> None:
        """In a forked child: the parent's threads and fetches are not this process's."""
        self._fresh()

    def _pool(self, name: str) -> ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(_WRITERS, thread_name_prefix=f"gpuio-cache-{name}")
            return pool

    def path(self, info: Any, block: int) -> str:
        """The file of block ``block`` of the object ``info`` (an ``ObjectInfo``)."""
        tag = _tag(info.url, info.etag, info.size).hex()
        return os.path.join(self.root, tag[:2], f"{tag}.{block}")

    # ---- reads -------------------------------------------------------------------------
    def read(self, plan: ReadPlan, objects: Objects, lease: Lease, pool: ThreadPoolExecutor) -> None:
        """Fill ``lease`` as ``plan`` says (its file ids are ``objects``'): the blocks the
        tasks touch are made present (those this process has not met yet: fetched on
        ``pool``), then read from their files, or from memory where just downloaded."""
        B = self.block
        file = plan.task_file
        sizes = objects.sizes[file]
        start = plan.task_offset
        end = np.minimum(start + plan.task_length, sizes)  # a merge gap never runs past the end
        short = np.flatnonzero(end < start + plan.task_need)
        if short.size:
            k = int(short[0])
            raise StorageError(f"the object has {int(sizes[k])} bytes, the index needs bytes up to "
                               f"{int(start[k] + plan.task_need[k])} (replaced after indexing?)",
                               path=objects.paths[int(file[k])], offset=int(start[k]))
        task, keys = objects.blocks(file, start, end)
        block = keys - objects.base[file[task]]
        p_start = np.maximum(start[task], block * B)
        p_end = np.minimum(end[task], (block + 1) * B)
        p_off, p_len = p_start - block * B, p_end - p_start
        p_dest = plan.task_dest[task] + (p_start - start[task])
        ukeys, which = np.unique(keys, return_inverse=True)
        which = which.reshape(-1)
        view = lease.array
        seen = objects.seen(self.root)
        uobj = objects.locate(ukeys)[0]
        packed = self._packed(objects, uobj)
        for attempt in range(2):
            if attempt:
                seen[ukeys] = 0
                if packed.any():
                    self._packs.refresh()
            known, rows = self._records(objects, ukeys, uobj, packed, seen[ukeys] > 0)
            bufs: list[Any] = [None] * len(ukeys)
            got = np.zeros(len(ukeys), dtype=bool)  # the block's bytes are in memory (bufs)
            placed = np.zeros(len(which), dtype=bool)  # the piece is in the batch already
            unmet = np.flatnonzero((seen[ukeys] == 0) | ~known)
            if len(unmet):
                met_now = unmet[known[unmet]]
                absent = np.concatenate([self._meet(objects, ukeys, met_now, (which, p_off, p_len, p_dest), view, bufs,
                                                    placed, packed, rows), unmet[~known[unmet]]]).astype(np.int64)
                blocks, small = absent[~packed[absent]], absent[packed[absent]]
                for k, buf in zip(blocks.tolist(), self._fetched(objects, ukeys[blocks], pool)):
                    bufs[k] = buf
                for k, buf in zip(small.tolist(), self._fetched_packed(objects, ukeys[small], pool)):
                    bufs[k] = buf
                got[unmet] = [bufs[k] is not None for k in unmet.tolist()]
            from_memory = got[which]
            for k in np.flatnonzero(from_memory).tolist():
                src, off, n, dest = bufs[which[k]], int(p_off[k]), int(p_len[k]), int(p_dest[k])
                view[dest: dest + n] = np.frombuffer(src, dtype=np.uint8, count=n, offset=off)
            old = ~(from_memory | placed)
            if not old.any():
                break
            files, at, base = self._files(objects, ukeys, packed, rows)
            local = ReadPlan(task_file=at[which[old]], task_offset=base[which[old]] + p_off[old],
                             task_length=p_len[old], task_dest=p_dest[old], task_need=p_len[old],
                             sample_dest=plan.sample_dest, sample_length=plan.sample_length, nbytes=plan.nbytes,
                             align=1)
            try:
                self._posix.read(local, files, lease)
                break
            except StorageError:
                if attempt:  # evicted by another process in between, twice: not a race any more
                    raise
        self._touch_stale(objects, ukeys, packed, rows)
        self._maybe_evict(objects, ukeys, packed, rows)

    def _packed(self, objects: Objects, obj: np.ndarray) -> np.ndarray:
        """Whether each of the objects ``obj`` is cached in a pack (smaller than ``remote_pack_below``)."""
        return objects.sizes[obj] < self.pack_below

    def _records(self, objects: Objects, keys: np.ndarray, obj: np.ndarray, packed: np.ndarray,
                 met: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per block of ``keys`` (of objects ``obj``): whether where its bytes are is known
        (a block's file is named by its key; a packed object's needs a record), and its
        record (pack, offset, length, CRC-32C; zeros for a block). A packed object met
        (``met``) is where its record was when it was met, with no lookup (its CRC-32C
        left 0: it was checked then)."""
        known, rows = ~packed, np.zeros((len(obj), 4), dtype=np.int64)
        if packed.any():
            where = objects.where(self.root)
            kept = packed & met & (where[keys, 0] >= 0)
            rows[kept, :2], rows[kept, 2], known[kept] = where[keys[kept]], objects.sizes[obj[kept]], True
            ask = packed & ~kept
            if ask.any():
                known[ask], rows[ask] = self._packs.find(_tag_keys(objects.tags(obj[ask])))
                found = np.flatnonzero(ask)[known[ask]]
                where[keys[found]] = rows[found, :2]
        return known, rows

    def _files(self, objects: Objects, ukeys: np.ndarray, packed: np.ndarray,
               rows: np.ndarray) -> tuple[PathTable, np.ndarray, np.ndarray]:
        """The files the blocks ``ukeys`` are read from: a table of them, and per block its
        file's number in the table and the offset of its bytes there."""
        if packed.all():  # a packed object's file is its pack: no block file to name
            return self._packs.paths, rows[:, 0], rows[:, 1]
        at, base = np.arange(len(ukeys)), np.zeros(len(ukeys), dtype=np.int64)
        names = objects.names(ukeys[~packed], self.root)
        at[~packed] = np.arange(len(names))
        blocks = len(names)
        if packed.any():
            packs = self._packs.paths
            names = PathTable(np.concatenate([names.blob, packs.blob]),
                              np.concatenate([names.offsets[:-1], packs.offsets + names.offsets[-1]]), self.root)
            at[packed], base[packed] = blocks + rows[packed, 0], rows[packed, 1]
        return names, at, base

    def _meet(self, objects: Objects, ukeys: np.ndarray, unmet: np.ndarray, pieces: tuple[np.ndarray, ...],
              view: np.ndarray, bufs: list[Any], placed: np.ndarray, packed: np.ndarray,
              rows: np.ndarray) -> np.ndarray:
        """Read the blocks ``ukeys[unmet]`` this process has not met from their files, whole,
        checking each one's size and CRC-32C, in one pass on this thread: a block whose only
        piece (``pieces``: per piece its block's position in ``ukeys``, offset in the block,
        length, destination) is all of it lands in the batch (``view``; ``placed``), another
        one in a buffer of its own (``bufs``). A packed object (``packed``) is read from its
        record (``rows``) and checked against the record's CRC-32C. Returns the positions of
        the blocks not found whole (a bad block file is removed, a bad record forgotten):
        they are fetched."""
        which, p_off, p_len, p_dest = pieces
        keys = ukeys[unmet]
        obj, block = objects.locate(keys)
        want = np.minimum(self.block, objects.sizes[obj] - block * self.block)
        only = np.empty(len(ukeys), dtype=np.int64)
        only[which] = np.arange(len(which))  # a block's piece (its last, which is its only one where it has one)
        piece = only[unmet]
        direct = (np.bincount(which, minlength=len(ukeys))[unmet] == 1) & (p_off[piece] == 0) & (p_len[piece] == want)
        names = list(objects.names(keys, self.root))
        small = packed[unmet].tolist()
        for i in np.flatnonzero(packed[unmet]).tolist():
            names[i] = self._packs.paths[int(rows[unmet[i], 0])]
        spare = bytearray(_TRAILER.size + 1)
        met, absent, spoiled = [], [], []
        for i, (k, n, into, j, dest) in enumerate(zip(unmet.tolist(), want.tolist(), direct.tolist(), piece.tolist(),
                                                     p_dest[piece].tolist())):
            out = view[dest: dest + n] if into else np.empty(n, dtype=np.uint8)
            if not (_read_packed(names[i], int(rows[k, 1]), out, int(rows[k, 3])) if small[i]
                    else _read_checked(names[i], out, spare)):
                absent.append(k)
                if small[i]:
                    spoiled.append(k)
                continue
            if into:
                placed[j] = True
            else:
                bufs[k] = out
            met.append(i)
        if spoiled:
            self._packs.spoil(_tag_keys(objects.tags(objects.locate(ukeys[spoiled])[0])), rows[spoiled])
        if met:
            found = keys[met]
            seen = objects.seen(self.root)
            seen[found] = time.monotonic()
            self._pool("write").submit(self._touch, seen, *self._paths(objects, found, packed[unmet[met]],
                                                                       rows[unmet[met]]))
        return np.asarray(absent, dtype=np.int64)

    def _fetched_packed(self, objects: Objects, keys: np.ndarray, pool: ThreadPoolExecutor) -> list[Any]:
        """Per object of ``keys`` (each cached whole in a pack, none found in the records
        yet): its bytes, downloaded now under the node's claim (appended behind), or read
        from the record another process appended meanwhile, waited for while that
        process holds the claim (taken over once it ends). Raises the first error."""
        obj = objects.locate(keys)[0]
        tags = objects.tags(obj)
        out: list[Any] = [None] * len(keys)
        todo = np.arange(len(keys))
        wait, since = _POLL_S, time.monotonic()
        while True:
            futures = self._claim_packed(objects, keys[todo], lambda run, fut, n, name: pool.submit(_settle, fut, run))
            first = next((f.exception() for f in futures if f is not None and f.exception() is not None), None)
            if first is not None:
                raise first
            for i, fut in zip(todo.tolist(), futures):
                out[i] = fut.result() if fut is not None else None
            left = [i for i in todo.tolist() if out[i] is None]  # recorded by another process (by now)
            if left:
                self._packs.refresh()
                found, rows = self._packs.find(_tag_keys(tags[left]))
                for i, ok, row in zip(left, found.tolist(), rows):
                    out[i] = self._read_record(tags[i], row) if ok else None
            todo = np.asarray([i for i in left if out[i] is None], dtype=np.int64)
            if not len(todo):
                return out
            if time.monotonic() - since > 2 * self.stale_s:
                raise StorageError(f"waited {time.monotonic() - since:.0f} s for another process to download "
                                   f"{objects.paths[int(obj[todo[0]])]} into the cache", path=self._packs.folder)
            time.sleep(wait)
            wait = min(2 * wait, _POLL_MAX_S)

    def _claim_packed(self, objects: Objects, keys: np.ndarray,
                      start: Callable[[Callable[[], Any], Future[Any], int, str], Any]) -> list[Future[Any] | None]:
        """Per object of ``keys``: the fetch of it in this process (one running, else one
        started by ``start(run, future, bytes, name in flight)`` under the node's claim, which it holds until its
        record is written; a future of None: recorded meanwhile by another process), or
        None where another process holds the claim."""
        packs = self._packs
        obj = objects.locate(keys)[0]
        tags = objects.tags(obj)
        raw = [t.tobytes() for t in tags]
        names = ["pack:" + r.hex() for r in raw]
        futures: list[Future[Any] | None] = [None] * len(keys)
        claimed = []
        with self._lock:
            for i, name in enumerate(names):
                fut = self._inflight.get(name)
                if fut is None and packs.claim(raw[i]):
                    fut = self._inflight[name] = Future()
                    claimed.append(i)
                futures[i] = fut
        if claimed:
            packs.refresh()  # what finished between this process's look at the records and its claims
            found, _ = packs.find(_tag_keys(tags[claimed]))
            for i, ok in zip(claimed, found.tolist()):
                fut = futures[i]
                if ok:
                    packs.release([raw[i]])
                    self._done(names[i], 0)
                    fut.set_result(None)
                else:
                    start(lambda i=i: self._download_packed(objects, int(keys[i]), int(obj[i]), raw[i], names[i]), fut,
                          int(objects.sizes[obj[i]]), names[i])
        return futures

    def _download_packed(self, objects: Objects, key: int, obj: int, tag: bytes, name: str) -> Any:
        """Download a packed object (its claim held): its bytes, appended to this process's pack behind."""
        try:
            info = objects.info(obj)
            buf = self._download_reserved(info, 0, info.size)
        except BaseException:
            self._packs.release([tag])
            self._done(name, 0)
            raise
        try:
            self._pool("write").submit(self._append, objects, key, tag, name, buf)
        except RuntimeError:  # the interpreter is exiting (its thread pools take no more work): write here
            self._append(objects, key, tag, name, buf)
        return buf

    def _append(self, objects: Objects, key: int, tag: bytes, name: str, buf: Any) -> None:
        """Append a downloaded object to this process's pack and give its claim back (the
        writer thread); a failure leaves it uncached, with a warning."""
        kept = False
        try:
            (record,) = self._packs.append([(tag, buf)], self.pack_bytes)
            kept = True
        except OSError as exc:
            if exc.errno in _FULL:
                self._warn_full(self._packs.folder, exc)
            elif not self._warned_write:
                self._warned_write = True
                warnings.warn(f"{_cache_error(self._packs.folder, exc)}; reading on without caching", stacklevel=2)
        finally:
            self._packs.release([tag])
            if kept:  # met, where its record is
                objects.where(self.root)[key] = record[:2]
                objects.seen(self.root)[key] = time.monotonic()
                with self._lock:
                    self._added += len(buf)
            self._done(name, len(buf))

    def _read_record(self, tag: np.ndarray, row: np.ndarray) -> Any:
        """The bytes of the record ``row`` of ``tag``, None where they fail its CRC-32C (then forgotten)."""
        out = bytearray(int(row[2]))
        if _read_packed(self._packs.paths[int(row[0])], int(row[1]), out, int(row[3])):
            return out
        self._packs.spoil(_tag_keys(tag[None]), row[None])
        return None

    def _fetched(self, objects: Objects, keys: np.ndarray, pool: ThreadPoolExecutor) -> list[Any]:
        """Per block of ``keys``: its bytes when downloaded just now (or still waiting to
        be written), None when its file is whole. Raises the first block's error."""
        if not len(keys):
            return []
        names = objects.names(keys, self.root)
        obj, block = objects.locate(keys)
        futures = [self._start(objects, where, path, pool)
                   for where, path in zip(zip(keys.tolist(), obj.tolist(), block.tolist()), names)]
        first = next((f.exception() for f in futures if f.exception() is not None), None)
        if first is not None:
            raise first
        return [f.result() for f in futures]

    def _start(self, objects: Objects, where: tuple[int, int, int], path: str,
               pool: ThreadPoolExecutor) -> Future[Any]:
        """The fetch of a block (``where``: its key, object and block number) in this
        process: the one running, else one started on ``pool``."""
        with self._lock:
            fut = self._inflight.get(path)
            if fut is None:
                fut = self._inflight[path] = pool.submit(self._get, objects, where, path)
            return fut

    def prefetch(self, objects: Objects, file: np.ndarray, offset: np.ndarray, length: np.ndarray) -> int:
        """Fetch into the cache, in the background, the blocks of the extents
        ``(file, offset, length)`` that this process has not met yet, as many as fit in
        ``remote_readahead`` bytes in flight (the rest is fetched when read); returns the
        bytes started."""
        file = np.asarray(file, dtype=np.int64)
        start = np.asarray(offset, dtype=np.int64)
        end = np.minimum(start + np.asarray(length, dtype=np.int64), objects.sizes[file])
        seen = objects.seen(self.root)
        first, last = objects.base[file] + start // self.block, objects.base[file] + (end - 1) // self.block
        if (end > start).all() and (last - first <= 1).all() and (seen[first] > 0).all() and (seen[last] > 0).all():
            return 0  # a warm batch: each extent within two blocks, both met (no block list made)
        _, keys = objects.blocks(file, start, end)
        keys = np.unique(keys)
        keys = keys[seen[keys] == 0]
        if not len(keys):
            return 0
        obj, block = objects.locate(keys)
        started = 0
        packed = self._packed(objects, obj)
        if packed.any():  # one look at the records: the objects recorded are not fetched
            known, _ = self._records(objects, keys, obj, packed, np.zeros(len(keys), dtype=bool))
            started += self._prefetch_packed(objects, keys[packed & ~known])
            keys, obj, block = keys[~packed], obj[~packed], block[~packed]
        want = np.minimum(self.block, objects.sizes[obj] - block * self.block).tolist()
        names = list(objects.names(keys, self.root))
        # one pass over the names: a block whose file has its size is not fetched (its read checks its CRC)
        fetch = [k for k, (path, n) in enumerate(zip(names, want)) if not _sized(path, n + _TRAILER.size)]
        for k in fetch:
            where, path, n = (int(keys[k]), int(obj[k]), int(block[k])), names[k], want[k]
            with self._lock:
                if path in self._inflight:
                    continue
                if self._ahead + n > self.window:
                    break
                self._ahead += n
                fut: Future[Any] = Future()
                self._inflight[path] = fut
                self._queued.append((lambda where=where, path=path: self._get(objects, where, path), path, fut, n))
            started += n
        self._start_fetchers()
        return started

    def _prefetch_packed(self, objects: Objects, keys: np.ndarray) -> int:
        """``prefetch`` of packed objects not recorded yet: those this node has not claimed,
        as many as fit in the window; returns the bytes started."""
        if not len(keys):
            return 0
        with self._lock:
            room = self.window - self._ahead
        keys = keys[np.cumsum(objects.sizes[objects.locate(keys)[0]]) <= room]
        queued: list[tuple[Callable[[], Any], str, Future[Any], int]] = []
        self._claim_packed(objects, keys, lambda run, fut, n, name: queued.append((run, name, fut, n)))
        with self._lock:
            self._ahead += sum(n for *_, n in queued)
            self._queued.extend(queued)
        self._start_fetchers()
        return sum(n for *_, n in queued)

    def _start_fetchers(self) -> None:
        """Threads for the queued fetches ahead, up to ``remote_requests`` running."""
        with self._lock:
            threads = min(self.requests - self._fetchers, len(self._queued))
            self._fetchers += threads
        for _ in range(threads):
            threading.Thread(target=self._fetch_ahead, name="gpuio-cache-ahead").start()

    def _fetch_ahead(self) -> None:
        """A thread of ``prefetch``: runs the queued fetches until none is left. Once the
        main thread has ended (the interpreter is exiting) the queued ones are dropped:
        they are hints, and each could take every try of a GET against a server that no
        longer answers before the process may exit."""
        while True:
            with self._changed:
                if not self._queued:
                    self._fetchers -= 1
                    self._changed.notify_all()
                    return
                run, path, fut, n = self._queued.popleft()
            try:
                if not threading.main_thread().is_alive():
                    self._done(path, 0)
                    fut.set_exception(StorageError("not fetched ahead: the interpreter is exiting", path=path))
                else:
                    _settle(fut, run)
            finally:
                with self._lock:
                    self._ahead -= n

    def wait(self) -> None:
        """Wait until every fetch ahead and every write behind started so far is done."""
        with self._changed:
            while self._inflight:
                self._changed.wait()

    # ---- fetching a block --------------------------------------------------------------
    def _get(self, objects: Objects, where: tuple[int, int, int], path: str) -> Any:
        """Make a block (``where``: its key, object and block number) present: None when
        its file is whole, else its bytes (downloaded now; the file is written behind, or
        not kept when the disk is full)."""
        key, obj, block = where
        try:
            buf, fd = self._obtain(objects.info(obj), block, path)
        except BaseException:
            self._done(path, 0)
            raise
        if buf is None:
            objects.seen(self.root)[key] = time.monotonic()
            self._done(path, 0)
        elif fd is None:
            self._done(path, len(buf))
        else:
            try:
                self._pool("write").submit(self._write, objects, key, path, fd, buf)
            except RuntimeError:  # the interpreter is exiting (its thread pools take no more work): write here
                self._write(objects, key, path, fd, buf)
        return buf

    def _obtain(self, info: Any, block: int, path: str) -> tuple[Any, int | None]:
        """(None, None) when the block file is whole; else the block's bytes and the
        descriptor of its ``.part`` file (claimed with ``O_EXCL``: this process writes
        it), or None when the cache disk is full (the bytes are not kept)."""
        want = min(self.block, info.size - block * self.block)
        if self._present(path, want):
            return None, None
        part = path + ".part"
        folder = os.path.dirname(path)
        if folder not in self._folders:
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        wait, since = _POLL_S, time.monotonic()
        while True:
            try:
                fd = os.open(part, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._present(path, want):
                    return None, None
                self._break_stale(part)
                if time.monotonic() - since > 2 * self.stale_s:
                    raise StorageError(f"waited {time.monotonic() - since:.0f} s for another process to "
                                       f"download block {block} of {info.url} into the cache", path=path) from None
                time.sleep(wait)
                wait = min(2 * wait, _POLL_MAX_S)
                continue
            except OSError as exc:
                if exc.errno in _FULL:
                    self._warn_full(path, exc)
                    return self._download_reserved(info, block, want), None
                raise _cache_error(path, exc) from exc
            break
        if _CLAIM_LOCKS:
            _lock(fd, fcntl.F_WRLCK, 0)  # held while this process lives: a dead one's claim is free at once
        try:
            if self._present(path, want):  # written by another process while we took the claim
                _unlink(part)
                os.close(fd)
                return None, None
            return self._download_reserved(info, block, want), fd
        except BaseException:
            if _owns(fd, part):
                _unlink(part)
            os.close(fd)
            raise

    def _reserve(self, n: int) -> None:
        """Count ``n`` more bytes held in memory; wait while ``remote_readahead`` bytes are."""
        with self._changed:
            while self._held and self._held + n > self.window:
                self._changed.wait()
            self._held += n

    def _release(self, n: int) -> None:
        with self._changed:
            self._held -= n
            self._changed.notify_all()

    def _done(self, path: str, held: int) -> None:
        """The fetch of ``path`` is over (its ``held`` bytes are no longer this cache's)."""
        with self._changed:
            self._inflight.pop(path, None)
            self._held -= held
            self._changed.notify_all()

    def _write(self, objects: Objects, key: int, path: str, fd: int, buf: Any) -> None:
        """Write a downloaded block to its ``.part`` file and rename it into place (the
        writer thread); a failure leaves the block uncached, with a warning."""
        part = path + ".part"
        kept = False
        try:
            _write_all(fd, [memoryview(buf).cast("B"), memoryview(_TRAILER.pack(_MAGIC, crc32c(buf)))])
            if _owns(fd, part):  # else another process took the claim over as stale: the name is its file now
                os.replace(part, path)
                kept = True
        except OSError as exc:
            if exc.errno in _FULL:
                self._warn_full(path, exc)
            elif not self._warned_write:
                self._warned_write = True
                warnings.warn(f"{_cache_error(path, exc)}; reading on without caching", stacklevel=2)
        finally:
            if not kept and _owns(fd, part):
                _unlink(part)
            os.close(fd)
            if kept:
                objects.seen(self.root)[key] = time.monotonic()
                with self._lock:
                    self._added += len(buf)
            self._done(path, len(buf))

    def _warn_full(self, path: str, exc: OSError) -> None:
        if not self._warned_full:
            self._warned_full = True
            warnings.warn(f"{path}: cannot write the remote cache ({exc.strerror or exc}); reading on without "
                          f"caching. Lower remote_cache_budget (GPUIO_REMOTE_CACHE_BUDGET) or free space",
                          stacklevel=2)

    def _download_reserved(self, info: Any, block: int, want: int) -> Any:
        """``_download`` with ``want`` bytes of memory reserved for it, given back if it fails."""
        self._reserve(want)
        try:
            return self._download(info, block, want)
        except BaseException:
            self._release(want)
            raise

    def _download(self, info: Any, block: int, want: int) -> Any:
        if self.fetch is None:
            raise StorageError(f"block {block} of {info.url} is not in the cache, and this cache has no "
                               f"fetch to download it", path=self.path(info, block))
        return self.fetch(info.url, block * self.block, want, info.etag)

    @staticmethod
    def _present(path: str, want: int) -> bool:
        """Whether the block file is there and whole (``_read_checked``), touched: it is in use.
        A file not there at its size is not read (a download asks first: no buffer of the
        block's size for it)."""
        if not _sized(path, want + _TRAILER.size) or not _read_checked(path, bytearray(want),
                                                                       bytearray(_TRAILER.size + 1)):
            return False
        try:
            os.utime(path)
        except FileNotFoundError:  # evicted by another process just now
            return False
        return True

    def _break_stale(self, part: str) -> None:
        """Remove a download in progress whose process died (its claim's lock is free:
        a restarted job need not wait) or that has not finished within the stall limit
        (its process hangs); its block is then downloaded again."""
        try:
            age = time.time() - os.stat(part).st_mtime
        except FileNotFoundError:
            return
        if age > self.stale_s or (_CLAIM_LOCKS and age > _CLAIM_GRACE_S and not _claim_held(part)):
            _unlink(part)

    # ---- the LRU order and the budget -------------------------------------------------
    def _touch_stale(self, objects: Objects, keys: np.ndarray, packed: np.ndarray, rows: np.ndarray) -> None:
        """Touch, on the writer thread, the files of the blocks of ``keys`` (their packs
        where ``packed``, by ``rows``) last touched over ``_RECHECK_S`` ago (so other
        processes evict them last); one found gone is met again by the next read."""
        now = time.monotonic()
        seen = objects.seen(self.root)
        last = seen[keys]
        stale = (last > 0) & (now - last >= _RECHECK_S)
        if not stale.any():
            return
        seen[keys[stale]] = now
        self._pool("write").submit(self._touch, seen, *self._paths(objects, keys[stale], packed[stale], rows[stale]))

    def _paths(self, objects: Objects, keys: np.ndarray, packed: np.ndarray,
               rows: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """The files of the blocks ``keys``: the keys of those in block files, and the
        names of their files followed by the packs of the others (each pack once)."""
        blocks = keys[~packed]
        packs = np.unique(rows[packed, 0]).tolist()
        return blocks, list(objects.names(blocks, self.root)) + [self._packs.paths[p] for p in packs]

    @staticmethod
    def _touch(seen: np.ndarray, keys: np.ndarray, names: list[str]) -> None:
        """Touch the files ``names`` (mtime: the LRU order); a block file of ``keys`` (the
        first names) found gone is not met."""
        for k, path in enumerate(names):
            try:
                os.utime(path)
            except FileNotFoundError:
                if k < len(keys):
                    seen[keys[k]] = 0

    def _maybe_evict(self, objects: Objects, keys: np.ndarray, packed: np.ndarray, rows: np.ndarray) -> None:
        with self._lock:
            if self._added * _EVICT_SHARE < self.budget:
                return
            self._added = 0
        self.evict(set(self._paths(objects, keys, packed, rows)[1]))

    def evict(self, keep: set[str] = frozenset()) -> int:
        """Remove the least recently used blocks until the cache holds at most its
        budget, and the ``.part`` claims older than the stall limit (left by processes
        that died); returns the bytes the blocks hold after."""
        blocks = []
        total, now = 0, time.time()
        try:
            folders = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        for folder in folders:
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder.path):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if folder.name == "packs":  # a pack goes whole, never while its process appends to it
                    if entry.name.endswith(".pack"):
                        total += st.st_size
                        if not _writing(entry.path[: -len(".pack")] + ".rec"):
                            blocks.append((st.st_mtime, entry.path, st.st_size))
                    continue
                if entry.name.endswith(".part"):
                    if now - st.st_mtime > self.stale_s:  # a claim of a process that died: no one takes it over
                        _unlink(entry.path)
                    continue
                blocks.append((st.st_mtime, entry.path, st.st_size))
                total += st.st_size
        blocks.sort()
        for _, path, size in blocks:
            if total <= self.budget:
                break
            if path in keep:
                continue
            _unlink(path)
            if path.endswith(".pack"):
                _unlink(path[: -len(".pack")] + ".rec")
            total -= size
        return total

    def close(self) -> None:
        """Finish the fetches ahead and the writes behind, and end the cache's threads."""
        self.wait()
        with self._changed:
            while self._fetchers:
                self._changed.wait()
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)
        self._posix.close()


def _read_checked(path: str, out: Any, spare: bytearray) -> bool:
    """Read the block file ``path`` into ``out`` (a writable buffer of the block's size),
    its trailer into ``spare`` (``_TRAILER.size + 1`` bytes: one more shows a longer
    file): whether it is whole, its size and its CRC-32C those of the trailer. Another
    file (cut short, overwritten, corrupted) is removed."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    try:
        got = os.preadv(fd, [out, spare], 0)
    finally:
        os.close(fd)
    if got == len(out) + _TRAILER.size and _TRAILER.unpack_from(spare) == (_MAGIC, crc32c(out)):
        return True
    _unlink(path)
    return False


def _read_packed(path: str, offset: int, out: Any, crc: int) -> bool:
    """Read a packed object's bytes (``len(out)`` from ``offset`` of the pack ``path``)
    into ``out``: whether they are all there and match the record's CRC-32C ``crc``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    try:
        got = os.preadv(fd, [out], offset)
    finally:
        os.close(fd)
    return got == len(out) and crc32c(out) == crc


def _writing(rec: str) -> bool:
    """Whether a process appends to the pack of the record file ``rec`` (holds its lock)."""
    try:
        fd = os.open(rec, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return not _lock(fd, fcntl.F_RDLCK, 0)
    finally:
        os.close(fd)


def _tag_keys(tags: np.ndarray) -> np.ndarray:
    """Tags (``(n, 20)`` bytes) as the pack table's keys (``S20``)."""
    return np.ascontiguousarray(tags).view(f"S{_TAG}").reshape(-1)


def _settle(fut: Future[Any], run: Callable[[], Any]) -> None:
    """Run ``run`` for the future ``fut``: its result or its error."""
    if fut.set_running_or_notify_cancel():
        try:
            fut.set_result(run())
        except BaseException as exc:  # the reader that joins this fetch raises it
            fut.set_exception(exc)


def _sized(path: str, n: int) -> bool:
    """Whether the file ``path`` is there with ``n`` bytes."""
    try:
        return os.stat(path).st_size == n
    except FileNotFoundError:
        return False


def _write_all(fd: int, pieces: list[memoryview]) -> None:
    """Write ``pieces`` (byte views) one after another: one ``writev`` call unless the
    file takes fewer bytes at a time."""
    while pieces:
        n = os.writev(fd, pieces)
        while pieces and n >= len(pieces[0]):
            n -= len(pieces[0])
            pieces.pop(0)
        if pieces:
            pieces[0] = pieces[0][n:]


def _owns(fd: int, part: str) -> bool:
    """Whether the claim ``part`` is still the file open as ``fd``: a claim older than
    the stall limit may have been removed by another process, which then made its own."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(part))
    except OSError:  # gone, or not ours to look at
        return False


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _cache_error(path: str, exc: OSError) -> StorageError:
    reason = exc.strerror or str(exc)
    if exc.errno == errno.ENOSPC:
        reason = ("the cache disk is full: lower remote_cache_budget (GPUIO_REMOTE_CACHE_BUDGET), free space, "
                  "or turn the cache off (GPUIO_REMOTE_CACHE=0)")
    return StorageError(f"cannot write the remote cache: {reason}", path=path)
