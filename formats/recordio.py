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
(``key<TAB>offset`` lines) nothing of the ``.rec`` is read at index time: a record's
extent runs to the next indexed offset (or the end of the file) and may hold padding.
"""

from __future__ import annotations

import mmap
import os
import struct
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio.errors import ConfigError, DataError, FormatError
from gpuio.formats.tfrecord import _int_table
from gpuio.index import Extents, PathTable, SampleIndex, register_parser

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
    paths = ([os.fspath(rec_paths)] if isinstance(rec_paths, (str, os.PathLike))
             else [os.fspath(p) for p in rec_paths])
    if not paths:
        raise DataError("no samples: an empty list of .rec files was given")
    if idx_path is None:
        idx_paths: list[str | None] = [None] * len(paths)
    elif isinstance(idx_path, (str, os.PathLike)):
        idx_paths = [os.fspath(idx_path)]
    else:
        idx_paths = [None if p is None else os.fspath(p) for p in idx_path]
    if len(idx_paths) != len(paths):
        raise ConfigError(f"{len(idx_paths)} .idx files for {len(paths)} .rec files; give one per file")
    files, offsets, lengths, keys = [], [], [], []
    for k, (path, idx) in enumerate(zip(paths, idx_paths)):
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise DataError(f"cannot read .rec file: {exc.strerror or exc}", path=path) from exc
        key, off, length = _scan(path, size) if idx is None else _from_idx(idx, path, size)
        files.append(np.full(len(off), k, dtype=np.int32))
        offsets.append(off)
        lengths.append(length)
        keys.append(key)
    return SampleIndex(PathTable.from_paths([os.path.abspath(p) for p in paths]),
                       {"record": Extents(np.concatenate(files), np.concatenate(offsets), np.concatenate(lengths))},
                       {"key": np.concatenate(keys)}, RecordIOParser(), meta={"format": "recordio"})


def _from_idx(idx: str, path: str, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(key, offset, length)`` from an ``.idx`` file; a record runs to the next
    distinct indexed offset or to the end of the file."""
    table = _int_table(idx, 2)
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
    ends = np.append(starts[1:], size)
    return key, offset, ends[np.searchsorted(starts, offset)] - offset


def _scan(path: str, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(record number, offset, length)`` of every record, one pass over the headers."""
    starts, lengths = array("q"), array("q")
    if size:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            pos, first = 0, -1  # ``first``: start of the open multi-part record
            while pos < size:
                k = len(starts)
                cflag, n = _part(mm, size, pos, path, f"record {k}")
                if cflag in (0, 1) and first >= 0:
                    raise FormatError(f"a new record (cflag {cflag}) inside the multi-part record that "
                                      f"starts at byte {first}", path=path, sample=f"record {k}", offset=pos)
                if cflag in (2, 3) and first < 0:
                    raise FormatError(f"a continuation part (cflag {cflag}) where a record should start",
                                      path=path, sample=f"record {k}", offset=pos)
                if cflag == 1:
                    first = pos
                elif cflag in (0, 3):
                    start = pos if cflag == 0 else first
                    starts.append(start)
                    lengths.append(pos + 8 + n - start)
                    first = -1
                pos += 8 + ((n + 3) & ~3)
            if first >= 0:
                raise FormatError("the file ends inside a multi-part record", path=path,
                                  sample=f"record {len(starts)}", offset=first)
    off = np.frombuffer(starts, dtype=np.int64)
    return np.arange(len(off), dtype=np.int64), off, np.frombuffer(lengths, dtype=np.int64)


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
    n = lrecord & _LENGTH_MASK
    if pos + 8 + n > size:
        raise FormatError(f"truncated part: {n} payload bytes announced, {size - pos - 8} present",
                          path=path, sample=sample, offset=base + pos)
    return lrecord >> 29, n


@register_parser("recordio")
class RecordIOParser:
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
        if cflag == 0:
            return record[8: 8 + n]
        if cflag != 1:
            raise FormatError(f"record starts with a continuation part (cflag {cflag})", path=path,
                              sample=sample, offset=base)
        parts, pos = [record[8: 8 + n]], 8 + ((n + 3) & ~3)
        while cflag != 3:
            cflag, n = _part(record, size, pos, path, sample, base)
            if cflag not in (2, 3):
                raise FormatError(f"part with cflag {cflag} inside a multi-part record", path=path,
                                  sample=sample, offset=base + pos)
            parts += [np.frombuffer(_MAGIC_BYTES, dtype=np.uint8), record[pos + 8: pos + 8 + n]]
            pos += 8 + ((n + 3) & ~3)
        return np.concatenate(parts)
