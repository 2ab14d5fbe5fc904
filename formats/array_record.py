"""ArrayRecord files (``array_record``'s writer; Grain's ``ArrayRecordDataSource``): one
sample per record.

An ArrayRecord file is a Riegeli/records file (``gpuio.formats._riegeli``): a signature
chunk, the data chunks (simple chunks of ``group_size`` records each), a footer chunk
(one ``RiegeliFooterMetadata`` then one ``ArrayRecordFooter`` per data chunk:
``chunk_offset``, ``decoded_data_size``, ``num_records``) and a postscript chunk at the
start of the last 64 KiB block (``RiegeliPostscript``: ``footer_offset``, ``magic``).
Indexing reads the signature, the postscript, the footer and the first and last data
chunks' first bytes (and, for chunks of several uncompressed records, their sizes): not
the records.

- ``group_size:1`` (one record per chunk): the extent field ``__record__`` is the
  record's chunk, the smallest unit that decodes alone. Uncompressed, that is the record
  in place plus its chunk's 40-byte header and 3-byte size prefix, which the parse step
  checks (so a footer that lies is an error, not other bytes) and gives the record as a
  view; compressed (zstd by default, brotli, snappy), the parse step decompresses it.
- ``group_size`` > 1, uncompressed: the extent is the record's bytes in place, found from
  each chunk's record sizes (read at indexing, checked against the chunk's header and
  the footer).
- ``group_size`` > 1, compressed: refused, since a record decodes only with its whole
  chunk: write such files with ``group_size:1`` (as Grain's random access needs) or
  uncompressed.

A record or chunk that crosses a 64 KiB block boundary has the 24-byte block header
inside its extent, which the parse step takes out (a copy of that record only).

The parse step (``ArrayRecordParser``) gives the field ``data``: the record's bytes (a
uint8 view into the batch buffer where they lie in one piece).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpuio.errors import DataError, FormatError
from gpuio.formats._files import each_shard, full_path, shard_paths, size_or_zero
from gpuio.formats._riegeli import (BLOCK, BLOCK_HEADER, CHUNK_HEADER, chunk_header, file_position, simple_chunk,
                                    simple_chunk_parts, varint, varints, without_block_headers)
from gpuio.formats.mds import closing_file, open_exact, read_at
from gpuio.index import Extents, Parser, PathTable, SampleIndex
from gpuio.storage.remote import object_versions

__all__ = ["array_record", "ArrayRecordParser"]

RECORD_FIELD = "__record__"
# the first 64 bytes of every Riegeli/records file: a block header and the signature chunk
_SIGNATURE = bytes.fromhex("83af70d10d884a3f0000000000000000" "4000000000000000" "91bac23c9287e1a9"
                           "0000000000000000" "e19f13c0e9b1c372" "7300000000000000" "0000000000000000")
_POSTSCRIPT_MAGIC = 0x71930E704FDAE05E


def array_record(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> SampleIndex:
    """Index the records of one or more ArrayRecord files (local paths, ``s3://`` or
    ``http(s)://`` URLs, brace ranges and globs), in file then record order.

    Fields: ``__record__`` (the bytes read: the record, or its compressed chunk) and,
    parsed after the read, ``data`` (the record's bytes). ``index.meta``:
    ``index_bytes_read``, ``data_bytes`` (the files' sizes), ``chunked`` (per file, whether
    its extents are whole chunks).
    """
    paths = [full_path(p) for p in shard_paths(paths, "ArrayRecord file")]
    if not paths:
        raise DataError("no samples: an empty list of ArrayRecord files was given")
    found = each_shard(_index_file, paths, "indexing ArrayRecord files", [size_or_zero(p) for p in paths])
    files = np.repeat(np.arange(len(paths), dtype=np.int32), [len(f.starts) for f in found])
    starts = np.concatenate([f.starts for f in found])
    lengths = np.concatenate([f.lengths for f in found])
    chunked = [f.chunked for f in found]
    meta: dict[str, Any] = {"format": "array_record", "chunked": chunked,
                            "index_bytes_read": int(sum(f.read for f in found)),
                            "data_bytes": int(sum(f.size for f in found)), **object_versions(paths)}
    parser = ArrayRecordParser([p for p, c in zip(paths, chunked) if c])
    return SampleIndex(PathTable.from_paths(paths), {RECORD_FIELD: Extents(files, starts, lengths)},
                       parser=parser, meta=meta)


class _Reads:
    """Reads of one file that count their bytes."""

    def __init__(self, path: str, f: Any, size: int) -> None:
        self.path, self.f, self.size, self.total = path, f, size, 0

    def content(self, begin: int, n: int) -> np.ndarray:
        """``n`` bytes of chunk content from the chunk at ``begin`` (block headers taken
        out); fewer where the file ends."""
        end = min(file_position(begin, n), self.size)
        raw = read_at(self.path, end - begin, begin, self.f)
        self.total += len(raw)
        return without_block_headers(np.frombuffer(raw, dtype=np.uint8), begin)

    def chunk(self, begin: int) -> np.ndarray:
        """The whole chunk at ``begin`` (header and data), block headers taken out."""
        head = self.content(begin, CHUNK_HEADER)
        size = chunk_header(head, self.path, begin).data_size
        if file_position(begin, CHUNK_HEADER + size) > self.size:
            raise FormatError(f"truncated file: the chunk's {size} data bytes run past its end ({self.size} bytes)",
                              path=self.path, offset=begin)
        return np.concatenate([head, self.content(file_position(begin, CHUNK_HEADER), size)[:size]]) \
            if size else head


class _File:
    """One file as indexed: its records' extent starts and lengths, the bytes indexing
    read, the file's size, and whether the extents are whole chunks."""

    def __init__(self, starts: np.ndarray, lengths: np.ndarray, read: int, size: int, chunked: bool) -> None:
        self.starts, self.lengths, self.read, self.size, self.chunked = starts, lengths, read, size, chunked


def _index_file(path: str, advance: Callable[[int], None]) -> _File:
    """The extents of one file's records."""
    f, size = open_exact(path, "ArrayRecord file")
    with closing_file(f):
        reads = _Reads(path, f, size)
        head = read_at(path, len(_SIGNATURE), 0, f)
        reads.total += len(head)
        if head != _SIGNATURE:
            raise FormatError(f"not a Riegeli/ArrayRecord file: it starts with {head[:16].hex()}, not the Riegeli "
                              f"file signature", path=path, offset=0)
        footer_at = _footer_offset(reads)
        chunks = _footer(reads, footer_at)
        ends = np.append(chunks[1:, 0], footer_at)
        first = _first_data(reads, int(chunks[0, 0])) if len(chunks) else 0
        if len(chunks) > 1 and _first_data(reads, int(chunks[-1, 0])) != first:
            raise FormatError("the file's chunks mix compressions; gpuio reads files written with one set of "
                              "options", path=path, offset=int(chunks[-1, 0]))
        if (chunks[:, 2] == 1).all():  # group_size 1: each record's extent is its chunk
            out = chunks[:, 0], ends - chunks[:, 0]
        elif first:
            k = int(np.flatnonzero(chunks[:, 2] > 1)[0])
            raise FormatError(f"compressed chunks of {int(chunks[k, 2])} records (group_size > 1): a record decodes "
                              f"only with its whole chunk; write the file with the options 'group_size:1' (as "
                              f"Grain's random access needs) or 'uncompressed'", path=path, offset=int(chunks[k, 0]))
        else:
            out = _records_in_place(reads, chunks)
    advance(size)
    return _File(out[0], out[1], reads.total, size, bool((chunks[:, 2] == 1).all()))


def _footer_offset(reads: _Reads) -> int:
    """``footer_offset`` from the postscript, the chunk at the start of the last block."""
    path, size = reads.path, reads.size
    at = (size - 1) // BLOCK * BLOCK if size > BLOCK else -1
    if at < BLOCK:
        raise FormatError(f"truncated file: {size} bytes, too short for an ArrayRecord file's data and its postscript "
                          f"block", path=path, offset=size)
    records = simple_chunk(reads.chunk(at), path, at)
    fields = _proto(records[0], path, at) if records else {}
    if fields.get(2) != _POSTSCRIPT_MAGIC or not isinstance(fields.get(1), int):
        raise FormatError("the last block holds no ArrayRecord postscript (footer offset and magic): the file is cut "
                          "short, or not an ArrayRecord file", path=path, offset=at)
    footer = fields[1]
    if not CHUNK_HEADER <= footer < at:
        raise FormatError(f"the postscript's footer offset {footer} lies outside the file's data (before byte {at})",
                          path=path, offset=at)
    return footer


def _footer(reads: _Reads, at: int) -> np.ndarray:
    """``[chunk_offset, decoded_data_size, num_records]`` per data chunk, from the footer
    chunk at ``at``, checked."""
    path = reads.path
    sizes, values = simple_chunk_parts(reads.chunk(at), path, at)
    first = int(sizes[0]) if len(sizes) else 0
    meta = _proto(values[:first], path, at) if len(sizes) else {}
    info = _proto(meta[1], path, at) if isinstance(meta.get(1), bytes) else {}
    table = _entries(sizes[1:], values[first:], path, at)
    if not info or info.get(2, 0) != len(table) or info.get(3, 0) != int(table[:, 2].sum()):
        raise FormatError(f"the footer's metadata ({info.get(2)} chunks, {info.get(3)} records) does not match its "
                          f"{len(table)} chunk entries", path=path, offset=at)
    offsets = table[:, 0]
    bad = (offsets < len(_SIGNATURE)) | (offsets >= at) | (table[:, 2] < 1)
    bad[1:] |= offsets[1:] <= offsets[:-1]
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise FormatError(f"footer entry {k}: a chunk of {int(table[k, 2])} records at byte {int(offsets[k])}, which "
                          f"is not after the chunk before it and before the footer (byte {at})", path=path, offset=at)
    return table


def _entries(sizes: np.ndarray, values: np.ndarray, path: str, at: int) -> np.ndarray:
    """``[chunk_offset, decoded_data_size, num_records]`` of the footer's
    ``ArrayRecordFooter`` messages (``values``, of ``sizes``): with NumPy where each is
    the writer's three varint fields in order, else message by message."""
    stream = varints(values, path, at) if len(values) and values[-1] < 0x80 else np.zeros(0, np.uint64)
    if len(stream) == 6 * len(sizes) and (stream.reshape(-1, 6)[:, ::2] == [8, 16, 24]).all():
        return stream.reshape(-1, 6)[:, 1::2].astype(np.int64)
    bounds = np.concatenate(([0], np.cumsum(sizes.astype(np.int64)))).tolist()
    rows = [_proto(values[a:b], path, at) for a, b in zip(bounds[:-1], bounds[1:])]
    return np.array([[r.get(1, -1), r.get(2, -1), r.get(3, -1)] for r in rows], dtype=np.int64).reshape(-1, 3)


def _first_data(reads: _Reads, begin: int) -> int:
    """The compression byte of the data chunk at ``begin``."""
    content = reads.content(begin, CHUNK_HEADER + 1)
    head = chunk_header(content, reads.path, begin)
    if len(content) <= CHUNK_HEADER or head.data_size < 1:
        raise FormatError("truncated data chunk", path=reads.path, offset=begin)
    return int(content[CHUNK_HEADER])


def _records_in_place(reads: _Reads, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The file spans of the records of uncompressed chunks, from each chunk's record sizes."""
    starts, ends = [], []
    for c, decoded, n in chunks.tolist():
        sizes, logical = _sizes(reads, c, n, decoded)
        for at, length in zip(logical, sizes):
            start = file_position(c, at)
            starts.append(start + BLOCK_HEADER if start % BLOCK == 0 else start)
            ends.append(file_position(c, at + length))
    starts_a, ends_a = np.array(starts, dtype=np.int64), np.array(ends, dtype=np.int64)
    if len(ends_a) and ends_a.max() > reads.size:
        raise FormatError(f"truncated file: its chunks place records up to byte {int(ends_a.max())}, the file has "
                          f"{reads.size}", path=reads.path, offset=reads.size)
    return starts_a, ends_a - starts_a


def _sizes(reads: _Reads, c: int, n: int, decoded: int) -> tuple[list[int], list[int]]:
    """The record sizes of the uncompressed chunk at ``c`` (``n`` records of ``decoded``
    bytes, as the footer says) and each record's place in the chunk's content."""
    path = reads.path
    head = reads.content(c, CHUNK_HEADER + 11)
    header = chunk_header(head, path, c)
    data = head[CHUNK_HEADER:]
    if not len(data) or data[0] != 0:
        raise FormatError("a compressed chunk in a file whose first chunk is not", path=path, offset=c)
    sizes_size, pos = varint(data, 1, len(data), path, c + CHUNK_HEADER)
    body = reads.content(c, CHUNK_HEADER + pos + sizes_size)[CHUNK_HEADER + pos:]
    sizes, p = [], 0
    while p < len(body):
        size, p = varint(body, p, len(body), path, c + CHUNK_HEADER + pos)
        sizes.append(size)
    if (len(sizes) != n or sum(sizes) != decoded or header.num_records != n
            or header.data_size != pos + sizes_size + decoded):
        raise FormatError(f"the chunk ({header.num_records} records, {header.data_size} data bytes) and its "
                          f"{len(sizes)} record sizes ({sum(sizes)} bytes) disagree with the footer ({n} records of "
                          f"{decoded} bytes)", path=path, offset=c)
    first = CHUNK_HEADER + pos + sizes_size
    return sizes, (first + np.concatenate(([0], np.cumsum(sizes[:-1])))).astype(np.int64).tolist()


def _proto(buf: Any, path: str, at: int) -> dict[int, Any]:
    """The varint (wire type 0) and length-delimited (2) fields of a protobuf message,
    last value wins."""
    buf = bytes(buf)
    out: dict[int, Any] = {}
    pos = 0
    while pos < len(buf):
        tag, pos = varint(buf, pos, len(buf), path, at)
        if tag & 7 == 0:
            out[tag >> 3], pos = varint(buf, pos, len(buf), path, at)
        elif tag & 7 == 2:
            n, pos = varint(buf, pos, len(buf), path, at)
            if pos + n > len(buf):
                raise FormatError(f"a protobuf field of {n} bytes runs past its {len(buf)}-byte message", path=path,
                                  offset=at)
            out[tag >> 3], pos = buf[pos: pos + n], pos + n
        else:
            raise FormatError(f"protobuf wire type {tag & 7} in an ArrayRecord footer", path=path, offset=at)
    return out


class ArrayRecordParser(Parser):
    """Gives ``data``, a record's bytes, from its ``__record__`` extent: the record in place
    (block headers inside it taken out), or, in the files of ``chunked``, its chunk
    decoded."""

    name = "array_record"
    source = RECORD_FIELD
    fields = ("data",)

    def __init__(self, chunked: Sequence[str] = ()) -> None:
        self.chunked = list(chunked)
        self._chunked = frozenset(self.chunked)

    def config(self) -> dict[str, Any]:
        return {"chunked": self.chunked}

    def parse(self, records: Sequence[np.ndarray], samples: np.ndarray, paths: Sequence[str],
              offsets: np.ndarray) -> dict[str, list[Any]]:
        out = []
        for j, raw in enumerate(records):
            at, path = int(offsets[j]), paths[j]
            content = without_block_headers(raw, at)
            if path in self._chunked:
                try:
                    found = simple_chunk(content, path, at)
                except FormatError as exc:
                    raise FormatError(exc.reason, path=path, sample=int(samples[j]), offset=exc.offset) from None
                if len(found) != 1:
                    raise FormatError(f"the chunk holds {len(found)} records, the index one", path=path,
                                      sample=int(samples[j]), offset=at)
                content = found[0]
            out.append(content)
        return {"data": out}
