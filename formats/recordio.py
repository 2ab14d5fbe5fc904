"""MXNet RecordIO (``.rec`` with an optional ``.idx``): one sample per record.

A record is one or more parts, each ``uint32 magic 0xced7230a``, ``uint32 lrecord``
(upper 3 bits: cflag, lower 29: payload length in bytes), the payload, and zero
padding to a multiple of 4 bytes, all little-endian. cflag 0 is a whole record; 1, 2
and 3 are the first, a middle and the last part of a record that its writer split
where the payload held the magic, which is put back between the parts on rejoining.

The payload starts with an ``IRHeader`` (``flag`` uint32, ``label`` float32, ``id``
and ``id2`` uint64); when ``flag > 0``, ``flag`` float32 labels follow and replace
``label``. The rest is the data (an encoded image, for im2rec files).

The extent field ``record`` spans a record's parts from its first magic; the parser
(``RecordIOParser``) checks the framing after the read and produces ``data`` (a view
into the batch buffer for single-part records, rejoined bytes otherwise), ``label``
(float32, shape ``[max(1, flag)]``) and ``id`` (int). With an ``.idx`` file
(``key<TAB>offset`` lines) only the last record's headers are read at index time: a
record's extent runs to the next indexed offset (or the end of the file) and may hold
padding. An ``.idx`` must cover its ``.rec``: the last indexed record must end where
the file ends (an empty ``.idx`` fits only an empty file), and the parser refuses an
extent that holds more than its record, so an ``.idx`` that leaves records out is an
error, never fewer samples. MXNet's ``MXIndexedRecordIO`` and DALI's reader serve just
the indexed records; gpuio differs on purpose, since a cut index (an interrupted
``im2rec``, a partial copy) is far likelier than a deliberate subset. For a subset,
index the whole file and keep rows with ``SampleIndex.take``.

A ``.rec`` and its ``.idx`` may be URLs (``s3://``, ``http(s)://``): the ``.idx`` is
read by one GET and only the last record's bytes of the ``.rec`` are fetched; without
an ``.idx`` the whole object is fetched for the scan.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from contextlib import nullcontext
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpuio.errors import ConfigError, DataError, FormatError
from gpuio.formats._files import (each_shard, full_path, int_table, open_regular_file, regular_file_size,
                                  shard_paths, size_or_zero)
from gpuio.storage.remote import is_url, object_versions
from gpuio.index import Extents, Parser, PathTable, SampleIndex

__all__ = ["recordio", "RecordIOParser", "MAGIC"]

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_LENGTH_MASK = (1 << 29) - 1
_IRHEADER = struct.Struct("<IfQQ")  # flag, label, id, id2: 24 bytes


def recordio(rec_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
             idx_path: str | os.PathLike[str] | Sequence[str | os.PathLike[str] | None] | None = None,
             ) -> SampleIndex:
    """Index the records of one or more ``.rec`` files.

    ``idx_path``: one ``.idx`` file per ``.rec`` (``None`` entries, or ``None`` for all,
    scan the file instead). Samples come in ``.idx`` line order, else in file order.
    Fields: ``record`` (bytes, framing included), ``key`` (int64: the ``.idx`` key, or
    the record's position in its file), and, parsed after the read, ``data``,
    ``label`` and ``id``.
    """
    paths = shard_paths(rec_paths, ".rec file")
    if not paths:
        raise DataError("no samples: an empty list of .rec files was given")
    if idx_path is None:
        idx_paths: list[str | None] = [None] * len(paths)
    elif isinstance(idx_path, (str, os.PathLike)):
        idx_paths = list(shard_paths(idx_path, ".idx file"))
    else:
        idx_paths = [None if p is None else os.fspath(p) for p in idx_path]
    if len(idx_paths) != len(paths):
        raise ConfigError(f"{len(idx_paths)} .idx files for {len(paths)} .rec files; give one per file")
    files, offsets, lengths, keys = [], [], [], []
    found = each_shard(_records, list(zip(paths, idx_paths)), "indexing .rec files", [size_or_zero(p) for p in paths])
    for k, (key, off, length) in enumerate(found):
        files.append(np.full(len(off), k, dtype=np.int32))
        offsets.append(off)
        lengths.append(length)
        keys.append(key)
    paths = [full_path(p) for p in paths]
    meta: dict[str, Any] = {"format": "recordio", **object_versions(paths)}
    return SampleIndex(PathTable.from_paths(paths),
                       {"record": Extents(np.concatenate(files), np.concatenate(offsets), np.concatenate(lengths))},
                       {"key": np.concatenate(keys)}, RecordIOParser(), meta=meta)


def _records(paths: tuple[str, str | None], advance: Callable[[int], None]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(key, offset, length)`` of one ``.rec`` file's records, from its ``.idx`` file
    (``paths``: the two, or the ``.rec`` and ``None``) or a scan; ``advance(n)``: ``n``
    more bytes done."""
    path, idx = paths
    size = regular_file_size(path, ".rec file")
    if idx is None:
        return _scan(path, size, advance)
    out = _from_idx(idx, path, size)
    advance(size)
    return out


def _from_idx(idx: str, path: str, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(key, offset, length)`` from an ``.idx`` file; a record runs to the next
    distinct indexed offset or to the end of the file."""
    table = int_table(idx, 2)
    key, offset = table[:, 0].copy(), table[:, 1].copy()
    bad = (offset < 0) | (offset + 8 > size)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise FormatError(f"index file {idx} line {k + 1} (key {int(key[k])}) points past the end of the "
                          f"file ({size} bytes)", path=path, sample=f"record {k}", offset=int(offset[k]))
    starts = np.sort(offset)
    distinct = np.ones(len(starts), dtype=bool)
    distinct[1:] = starts[1:] != starts[:-1]  # np.unique would be slower
    starts = starts[distinct]
    _check_covers(idx, path, size, key, offset, starts)
    ends = np.append(starts[1:], size)
    return key, offset, ends[np.searchsorted(starts, offset)] - offset


def _check_covers(idx: str, path: str, size: int, key: np.ndarray, offset: np.ndarray, starts: np.ndarray) -> None:
    """Raise unless the last indexed record (at ``starts[-1]``) ends where the file
    does: an ``.idx`` cut short would otherwise lose the records after it."""
    hint = "rebuild it (im2rec) or pass no .idx to scan the .rec"
    if not len(starts):
        if size:
            raise FormatError(f"index file {idx} lists no records, the file has {size} bytes; {hint}", path=path)
        return
    k = int(np.flatnonzero(offset == starts[-1])[0])
    last = int(starts[-1])
    if is_url(path):  # the last record's bytes only: it runs to the end of the object
        f, size = open_regular_file(path, ".rec file")
        with f:
            tail = f.pread(size - last, last)
        end = last + _record_end(tail, size - last, 0, path, f"record {k}", last)
    else:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            end = _record_end(mm, size, last, path, f"record {k}")
    if (end + 3) & ~3 < size:
        raise FormatError(f"index file {idx} does not cover the data file ({size} bytes): its last record "
                          f"(line {k + 1}, key {int(key[k])}) ends at byte {end}; {hint}", path=path,
                          sample=f"record {k}", offset=end)


def _scan(path: str, size: int, advance: Callable[[int], None]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(record number, offset, length)`` of every record, one pass over the headers."""
    starts, lengths = array("q"), array("q")
    done = 0
    if size:
        f, size = open_regular_file(path, ".rec file")
        with f, (nullcontext(f.pread(size, 0)) if is_url(path)  # an object: fetched whole for the scan
                 else mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) as mm:
            pos = 0
            while pos < size:
                end = _record_end(mm, size, pos, path, f"record {len(starts)}")
                starts.append(pos)
                lengths.append(end - pos)
                pos = (end + 3) & ~3
                if not len(starts) & 0xFFFF:
                    advance(pos - done)
                    done = pos
    advance(size - done)
    off = np.frombuffer(starts, dtype=np.int64)
    return np.arange(len(off), dtype=np.int64), off, np.frombuffer(lengths, dtype=np.int64)


def _record_end(buf: Any, size: int, pos: int, path: str, sample: object, base: int = 0) -> int:
    """End (before padding) of the record whose first part is at ``pos`` of ``buf``
    (``size`` bytes), the file's bytes from byte ``base`` on, after checking its parts'
    flags."""
    start = pos
    cflag, n = _part(buf, size, pos, path, sample, base)
    if cflag in (2, 3):
        raise FormatError(f"a continuation part (cflag {cflag}) where a record should start", path=path,
                          sample=sample, offset=base + pos)
    while cflag in (1, 2):
        pos += 8 + ((n + 3) & ~3)
        if pos >= size:
            raise FormatError("the file ends inside a multi-part record", path=path, sample=sample,
                              offset=base + start)
        cflag, n = _part(buf, size, pos, path, sample, base)
        if cflag in (0, 1):
            raise FormatError(f"a new record (cflag {cflag}) inside the multi-part record that starts at byte "
                              f"{base + start}", path=path, sample=sample, offset=base + pos)
    return pos + 8 + n


def _part(buf: Any, size: int, pos: int, path: str, sample: object, base: int = 0) -> tuple[int, int]:
    """``(cflag, payload length)`` of the part at ``pos`` of ``buf`` (``size`` bytes),
    which starts at byte ``base`` of the file ``path``."""
    if pos + 8 > size:
        raise FormatError(f"truncated part header: {size - pos} of 8 bytes", path=path, sample=sample,
                          offset=base + pos)
    magic, lrecord = struct.unpack_from("<II", buf, pos)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic:#010x}, expected {MAGIC:#010x}", path=path, sample=sample,
                          offset=base + pos)
    if lrecord >> 29 > 3:
        raise FormatError(f"bad cflag {lrecord >> 29} (0 to 3: whole, first, middle, last part)", path=path,
                          sample=sample, offset=base + pos)
    n = lrecord & _LENGTH_MASK
    if pos + 8 + n > size:
        raise FormatError(f"truncated part: {n} payload bytes announced, {size - pos - 8} present",
                          path=path, sample=sample, offset=base + pos)
    return lrecord >> 29, n


class RecordIOParser(Parser):
    """Checks a record's framing, rejoins its parts and splits off the ``IRHeader``."""

    name = "recordio"
    source = "record"
    fields = ("data", "label", "id")

    def config(self) -> dict[str, Any]:
        return {}

    def parse(self, records: Sequence[np.ndarray], samples: np.ndarray, paths: Sequence[str],
              offsets: np.ndarray) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"data": [], "label": [], "id": []}
        for j, record in enumerate(records):
            sample, path, base = int(samples[j]), paths[j], int(offsets[j])
            payload = self._payload(record, path, base, sample)
            if len(payload) < _IRHEADER.size:
                raise FormatError(f"payload of {len(payload)} bytes is shorter than the "
                                  f"{_IRHEADER.size}-byte IRHeader", path=path, sample=sample, offset=base)
            flag, label, ident, _ = _IRHEADER.unpack_from(payload, 0)
            start = _IRHEADER.size + 4 * flag
            if start > len(payload):
                raise FormatError(f"IRHeader announces {flag} labels, the payload has room for "
                                  f"{(len(payload) - _IRHEADER.size) // 4}", path=path, sample=sample, offset=base)
            out["label"].append(payload[_IRHEADER.size: start].view("<f4").astype(np.float32) if flag
                                else np.array([label], dtype=np.float32))
            out["id"].append(ident)
            out["data"].append(payload[start:])
        return out

    @staticmethod
    def _payload(record: np.ndarray, path: str, base: int, sample: int) -> np.ndarray:
        """The record's payload: a view when it has one part, else the parts
        rejoined with the magic between them."""
        size = len(record)
        cflag, n = _part(record, size, 0, path, sample, base)
        if cflag not in (0, 1):
            raise FormatError(f"record starts with a continuation part (cflag {cflag})", path=path,
                              sample=sample, offset=base)
        parts, pos = [record[8: 8 + n]], 8 + ((n + 3) & ~3)
        while cflag in (1, 2):
            cflag, n = _part(record, size, pos, path, sample, base)
            if cflag not in (2, 3):
                raise FormatError(f"part with cflag {cflag} inside a multi-part record", path=path,
                                  sample=sample, offset=base + pos)
            parts += [np.frombuffer(_MAGIC_BYTES, dtype=np.uint8), record[pos + 8: pos + 8 + n]]
            pos += 8 + ((n + 3) & ~3)
        if pos < size:  # an .idx that skips a record gives its bytes to the record before
            raise FormatError(f"{size - pos} bytes follow the record in its extent: the .idx leaves out the "
                              f"record at byte {base + pos}", path=path, sample=sample, offset=base + pos)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)
