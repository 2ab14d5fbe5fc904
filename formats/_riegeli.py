"""Riegeli/records, the container of ArrayRecord files: the parts gpuio reads.

A file is 64 KiB blocks, each starting with a 24-byte block header (so a chunk's bytes
in the file skip 24 bytes at every multiple of 64 KiB); a chunk is a 40-byte header
(``header_hash``, ``data_size``, ``data_hash``, ``chunk_type`` byte and 7-byte
``num_records``, ``decoded_data_size``; little-endian), its data, then padding. A
simple chunk (type ``r``) holds a compression byte (0 none, ``z`` zstd, ``b`` brotli,
``s`` snappy), a varint and the record sizes (varints), then the records' bytes, each
of the two parts compressed as one block prefixed by its decompressed size (varint)
when the byte is not 0. Hashes are not checked here (HighwayHash); every size is, so
that bad bytes are a ``FormatError`` naming the file and the byte offset, never an
index past the data.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from gpuio.errors import FormatError
from gpuio.formats.mds import decompress

__all__ = ["BLOCK", "BLOCK_HEADER", "CHUNK_HEADER", "ChunkHeader", "file_position", "without_block_headers",
           "chunk_header", "simple_chunk", "simple_chunk_parts", "varint", "varints"]

BLOCK = 1 << 16
BLOCK_HEADER = 24
CHUNK_HEADER = 40
_USABLE = BLOCK - BLOCK_HEADER
_CODECS = {0x7A: "zstd", 0x62: "br", 0x73: "snappy"}
SIMPLE = 0x72


def file_position(chunk_begin: int, n: int) -> int:
    """The file position ``n`` bytes of chunk content after ``chunk_begin`` (the chunk's
    header and data counted, the block headers in between skipped)."""
    overhead = (n + (chunk_begin + _USABLE - 1) % BLOCK) // _USABLE
    return chunk_begin + n + overhead * BLOCK_HEADER


def without_block_headers(raw: np.ndarray, offset: int) -> np.ndarray:
    """``raw``, the file's bytes from ``offset`` on, with the block headers inside them
    taken out: a view where there are none, else a copy."""
    first = -(-offset // BLOCK) * BLOCK
    if first >= offset + len(raw):
        return raw
    cuts = range(first - offset, len(raw), BLOCK)
    return np.concatenate([raw[:cuts[0]], *(raw[b + BLOCK_HEADER: b + BLOCK] for b in cuts)])


class ChunkHeader:
    """A chunk header's fields: ``data_size``, ``chunk_type``, ``num_records``,
    ``decoded_data_size`` (bytes, records)."""

    def __init__(self, data_size: int, chunk_type: int, num_records: int, decoded_data_size: int) -> None:
        self.data_size, self.chunk_type = data_size, chunk_type
        self.num_records, self.decoded_data_size = num_records, decoded_data_size


def chunk_header(buf: Any, path: str, offset: int) -> ChunkHeader:
    """The header of the chunk whose content (block headers taken out) starts ``buf``;
    ``offset``: the chunk's place in the file, for messages."""
    if len(buf) < CHUNK_HEADER:
        raise FormatError(f"truncated Riegeli chunk: {len(buf)} of its {CHUNK_HEADER} header bytes", path=path,
                          offset=offset)
    _, data_size, _, word, decoded = struct.unpack_from("<QQQQQ", bytes(buf[:CHUNK_HEADER]))
    return ChunkHeader(data_size, word & 0xFF, word >> 8, decoded)


def varint(buf: Any, pos: int, end: int, path: str, offset: int) -> tuple[int, int]:
    """``(value, position after it)`` of the varint64 at ``pos`` of ``buf`` (before ``end``)."""
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise FormatError("truncated or overlong varint in a Riegeli chunk", path=path, offset=offset + pos)
        b = int(buf[pos])
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def varints(buf: np.ndarray, path: str, offset: int) -> np.ndarray:
    """Every varint64 of ``buf`` (uint8, varints back to back), as uint64, with NumPy
    (no Python loop per value)."""
    buf = np.asarray(buf, dtype=np.uint8)
    last = buf < 0x80
    if len(buf) and not last[-1]:
        raise FormatError("truncated varint at the end of a Riegeli chunk's record sizes", path=path,
                          offset=offset + len(buf))
    group = np.concatenate(([0], np.cumsum(last)[:-1])) if len(buf) else np.zeros(0, np.int64)
    ends = np.flatnonzero(last)
    starts = np.concatenate(([0], ends[:-1] + 1)) if len(ends) else ends
    place = np.arange(len(buf)) - starts[group]
    if len(place) and place.max() > 9:
        raise FormatError("an overlong varint in a Riegeli chunk's record sizes", path=path,
                          offset=offset + int(starts[group[np.argmax(place)]]))
    parts = (buf & 0x7F).astype(np.uint64) << (7 * place).astype(np.uint64)
    return np.add.reduceat(parts, starts) if len(ends) else np.zeros(0, np.uint64)


def _block(buf: Any, codec: str, path: str, offset: int) -> np.ndarray:
    """A compressed block (varint decompressed size, then the codec's bytes) decompressed."""
    size, pos = varint(buf, 0, len(buf), path, offset)
    out = decompress(codec, bytes(buf[pos:]), path, offset + pos)
    if len(out) != size:
        raise FormatError(f"a {codec} block decompresses to {len(out)} bytes, its prefix says {size}", path=path,
                          offset=offset)
    return np.frombuffer(out, dtype=np.uint8)


def simple_chunk(content: np.ndarray, path: str, offset: int) -> list[np.ndarray]:
    """The records of a simple chunk (``content``: its header and data, block headers
    taken out), views into ``content`` where it is uncompressed."""
    sizes, values = simple_chunk_parts(content, path, offset)
    bounds = np.concatenate(([0], np.cumsum(sizes.astype(np.int64)))).tolist()
    return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def simple_chunk_parts(content: np.ndarray, path: str, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """``(record sizes, the records back to back)`` of a simple chunk, as ``simple_chunk``
    reads it, checked: the sizes add up to the records' bytes and the header's count."""
    head = chunk_header(content, path, offset)
    if head.chunk_type != SIMPLE:
        kind = chr(head.chunk_type) if 32 < head.chunk_type < 127 else f"{head.chunk_type:#x}"
        raise FormatError(f"chunk type {kind!r}; gpuio reads simple chunks of records ('r'; ArrayRecord writes them "
                          f"unless its 'transpose' option is set)", path=path, offset=offset)
    end = CHUNK_HEADER + head.data_size
    if end > len(content):
        raise FormatError(f"truncated Riegeli chunk: its data needs {head.data_size} bytes, "
                          f"{len(content) - CHUNK_HEADER} follow its header", path=path, offset=offset)
    data = content[CHUNK_HEADER: end]
    at = offset + CHUNK_HEADER  # for messages; the data's place counts no block headers
    if not len(data):
        raise FormatError("an empty simple chunk (no compression byte)", path=path, offset=at)
    kind = int(data[0])
    if kind and kind not in _CODECS:
        raise FormatError(f"compression type {kind:#x}; Riegeli's are 0, 'z', 'b' and 's'", path=path, offset=at)
    sizes_size, pos = varint(data, 1, len(data), path, at)
    if pos + sizes_size > len(data):
        raise FormatError(f"record sizes of {sizes_size} bytes run past the chunk's {len(data)} data bytes",
                          path=path, offset=at + pos)
    sizes_raw, values = data[pos: pos + sizes_size], data[pos + sizes_size:]
    if kind:
        sizes_raw = _block(sizes_raw, _CODECS[kind], path, at + pos)
        values = _block(values, _CODECS[kind], path, at + pos + sizes_size)
    sizes = varints(sizes_raw, path, at + pos)
    total = int(sizes.sum(dtype=np.uint64)) if len(sizes) else 0
    if (len(sizes) != head.num_records or total != len(values) or len(values) != head.decoded_data_size
            or (len(sizes) and int(sizes.max()) > len(values))):
        raise FormatError(f"the chunk's {len(sizes)} record sizes ({total} bytes) do not match its header "
                          f"({head.num_records} records, {head.decoded_data_size} bytes) and its {len(values)} bytes "
                          f"of records", path=path, offset=offset)
    return sizes, values
