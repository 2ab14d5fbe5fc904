"""TFRecord files: one sample per record, the extent pointing at the record payload.

A record is ``uint64 length``, ``uint32 masked crc32c(length bytes)``, ``length`` bytes
of payload, ``uint32 masked crc32c(payload)``, all little-endian; the masked CRC is
``((crc >> 15 | crc << 17) + 0xa282ead8) mod 2**32``. Records come from a
``tfrecord2idx`` index file (``offset length`` per line, in bytes; ``length`` covers the
whole record, framing included) or from one scan of the file.

CRCs are checked at index time: a scan always checks each length CRC (the length
decides where the next record starts); ``verify=True`` also checks every payload CRC,
and with an index file reads each indexed record's framing. Reads never re-check. An
index file must cover its data file exactly (records back to back from byte 0 to the
end); one that does not (empty, cut short, made for another file) is an error.

Compressed files (``TFRecordOptions`` ``GZIP``/``ZLIB``: the whole file one gzip or
zlib stream) cannot be read in place: records are extents of uncompressed bytes.
``compression="gzip"``/``"zlib"`` decompresses each file once into
``<cache_dir>/tfrecord/`` (``gpuio.config`` ``cache_dir``, default ``~/.cache/gpuio``;
reused while the source's size and mtime are unchanged) and indexes that copy; without
it a compressed file is a ``FormatError`` that says so.

With ``features``, the payload is parsed after the read as a ``tf.train.Example``
by a small protobuf decoder (``ExampleParser``); bytes features come back as views
into the batch buffer.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
import zlib
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from gpuio.errors import ConfigError, DataError, DependencyError, FormatError, StorageError
from gpuio.formats._files import (derived_path, each_shard, full_path, int_table, open_regular_file, shard_paths,
                                 size_or_zero, writing_whole)
from gpuio.storage.remote import RemoteFile, is_url, object_versions
from gpuio.index import Extents, Parser, PathTable, SampleIndex

__all__ = ["tfrecord", "ExampleParser", "bad_records", "masked_crc32c"]

_KINDS = ("bytes", "int64", "float")
_KIND_FIELD = {"bytes": 1, "float": 2, "int64": 3}  # Feature's oneof field numbers
_HEADER = 12  # uint64 length + uint32 length CRC
_FRAMING = 16  # header + uint32 payload CRC
_COMPRESSIONS = ("gzip", "zlib")
_CHUNK = 4 << 20  # bytes per decompression step


def masked_crc32c(data: Any) -> int:
    """TFRecord's masked CRC32C of a bytes-like object, as a uint32."""
    try:
        import crc32c
    except ImportError as exc:
        raise DependencyError("CRC checks need the 'crc32c' package (pip install crc32c)") from exc
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
             index_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str] | None] | None = None,
             features: Mapping[str, str] | None = None, verify: bool = False,
             compression: str | None = None) -> SampleIndex:
    """Index the records of one or more TFRecord files, in file then record order.

    ``index_paths``: one ``tfrecord2idx`` index file per data file (``None`` entries,
    or ``None`` for all, scan instead). Without ``features`` the field ``data`` holds
    each record's payload. With ``features`` (``{"image/encoded": "bytes",
    "image/class/label": "int64", ...}``, kinds ``bytes``, ``int64``, ``float``) the
    payload is the extent field ``record`` and every named feature is a field, parsed
    after the read: ``bytes`` as a uint8 view into the batch buffer (a list of views
    when the list has several values), ``int64``/``float`` as an ``int64``/``float32``
    scalar when the list holds one value, else an array; a feature with no value
    (``tf.train.Feature()``) or an empty list gives an empty list (``bytes``) or an
    empty array, as TensorFlow parses it. Field ``record_number`` is the record's
    position in its file.

    ``compression``: ``None`` for plain files, ``"gzip"`` or ``"zlib"`` for files
    written with that ``TFRecordOptions`` compression, which are decompressed once
    into the cache folder (see the module docstring); the index's files are then the
    decompressed copies, and ``index.meta["decompressed_from"]`` lists the originals.
    """
    paths = shard_paths(paths, "TFRecord file")
    if not paths:
        raise DataError("no samples: an empty list of TFRecord files was given")
    if index_paths is None:
        index_paths = [None] * len(paths)
    elif isinstance(index_paths, (str, os.PathLike)):
        index_paths = shard_paths(index_paths, "TFRecord index file")
    index_paths = [None if p is None else os.fspath(p) for p in index_paths]
    if len(index_paths) != len(paths):
        raise ConfigError(f"{len(index_paths)} index files for {len(paths)} TFRecord files; give one per file")
    if compression not in (None, *_COMPRESSIONS):
        raise ConfigError(f"compression={compression!r}; choose None, 'gzip' or 'zlib'")
    meta: dict[str, Any] = {"format": "tfrecord", "verified": bool(verify)}
    if compression is not None:
        meta["decompressed_from"] = [full_path(p) for p in paths]
        paths = [_decompressed(p, compression) for p in paths]
    parser = ExampleParser(dict(features)) if features is not None else None
    if parser is not None and {"record", "record_number"} & set(parser.fields):
        raise ConfigError("feature names 'record' and 'record_number' are taken by the index's own fields")
    files, offsets, lengths, numbers = [], [], [], []
    found = each_shard(functools.partial(_records, verify), list(zip(paths, index_paths)), "indexing TFRecord files",
                       [size_or_zero(p) for p in paths])
    for k, (off, length) in enumerate(found):
        files.append(np.full(len(off), k, dtype=np.int32))
        offsets.append(off + _HEADER)
        lengths.append(length)
        numbers.append(np.arange(len(off), dtype=np.int64))
    extents = Extents(np.concatenate(files), np.concatenate(offsets), np.concatenate(lengths))
    field = "data" if parser is None else "record"
    paths = [full_path(p) for p in paths]
    meta.update(object_versions(paths))
    return SampleIndex(PathTable.from_paths(paths), {field: extents},
                       {"record_number": np.concatenate(numbers)}, parser, meta=meta)


def _records(verify: bool, paths: tuple[str, str | None], advance: Callable[[int], None]
             ) -> tuple[np.ndarray, np.ndarray]:
    """``(record start, payload length)`` arrays for one file (``paths``: the file and
    its index file or ``None``), in bytes; ``advance(n)``: ``n`` more bytes done."""
    path, index_path = paths
    f, size = open_regular_file(path, "TFRecord file")
    if is_url(path):  # no memory map of an object: its bytes, all of them only where they are all read
        with f:
            mm = f.pread(size if index_path is None or verify else _HEADER, 0)
    else:
        mm = _map(f, size, path)
    try:
        _refuse_compressed(mm, size, path)
        if index_path is None:
            return _scan(mm, size, path, verify, advance)
        start, total = _read_index(index_path, path, size)
        if verify:
            for k in range(len(start)):
                n = _check_header(mm, size, int(start[k]), k, path)
                if n + _FRAMING != total[k]:
                    raise FormatError(f"index file {index_path} gives {int(total[k])} bytes for this record, "
                                      f"its header says {n + _FRAMING}", path=path,
                                      sample=f"record {k}", offset=int(start[k]))
                _check_data(mm, int(start[k]), n, k, path)
        advance(size)
        return start, total - _FRAMING
    finally:
        if isinstance(mm, mmap.mmap):
            mm.close()


def _map(f: Any, size: int, path: str) -> Any:
    """A read-only memory map of the open file ``f`` (``b""`` when it is empty)."""
    try:
        with f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except OSError as exc:
        raise StorageError(f"cannot read TFRecord file: {exc.strerror or exc}", path=path) from exc


def bad_records(path: str | os.PathLike[str]) -> Iterator[FormatError]:
    """Every record of a TFRecord file whose CRCs do not match, as the ``FormatError``
    naming its file, record number and byte offset, in file order: reads the whole
    file (``gpuio check`` runs it on a TFRecord index). A bad length CRC or a
    truncated record ends the walk (the next record's start is unknown)."""
    path = os.fspath(path)
    f, size = open_regular_file(path, "TFRecord file")
    with f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    try:
        pos, k = 0, 0
        while pos < size:
            try:
                n = _check_header(mm, size, pos, k, path)
            except FormatError as exc:
                yield exc
                return
            try:
                _check_data(mm, pos, n, k, path)
            except FormatError as exc:
                yield exc
            pos, k = pos + n + _FRAMING, k + 1
    finally:
        if isinstance(mm, mmap.mmap):
            mm.close()


def _scan(mm: Any, size: int, path: str, verify: bool, advance: Callable[[int], None]
          ) -> tuple[np.ndarray, np.ndarray]:
    starts, lengths = array("q"), array("q")
    pos = done = 0
    while pos < size:
        k = len(starts)
        n = _check_header(mm, size, pos, k, path)
        if verify:
            _check_data(mm, pos, n, k, path)
        starts.append(pos)
        lengths.append(n)
        pos += n + _FRAMING
        if not k & 0xFFFF:
            advance(pos - done)
            done = pos
    advance(size - done)
    return np.frombuffer(starts, dtype=np.int64), np.frombuffer(lengths, dtype=np.int64)


def _check_header(mm: Any, size: int, pos: int, k: int, path: str) -> int:
    """Payload length of the record at ``pos``, its length CRC checked."""
    if pos + _HEADER > size:
        raise FormatError(f"truncated record header: {size - pos} of {_HEADER} bytes",
                          path=path, sample=f"record {k}", offset=pos)
    n, stored = struct.unpack_from("<QI", mm, pos)
    computed = _crc_at(mm, pos, pos + 8)
    if stored != computed:
        raise FormatError(f"length CRC mismatch (stored {stored:#010x}, computed {computed:#010x})",
                          path=path, sample=f"record {k}", offset=pos)
    if pos + _FRAMING + n > size:
        raise FormatError(f"truncated record: the header announces {n} payload bytes and a 4-byte CRC, "
                          f"the file has {size - pos - _HEADER} bytes after the header", path=path,
                          sample=f"record {k}", offset=pos)
    return n


def _check_data(mm: Any, pos: int, n: int, k: int, path: str) -> None:
    computed = _crc_at(mm, pos + _HEADER, pos + _HEADER + n)
    (stored,) = struct.unpack_from("<I", mm, pos + _HEADER + n)
    if stored != computed:
        raise FormatError(f"data CRC mismatch (stored {stored:#010x}, computed {computed:#010x})",
                          path=path, sample=f"record {k}", offset=pos)


def _crc_at(mm: Any, start: int, end: int) -> int:
    with memoryview(mm)[start:end] as part:  # released at once, so the map can close
        return masked_crc32c(part)


def _read_index(index_path: str, path: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(record start, record length)`` from a ``tfrecord2idx`` file, checked
    against the data file's ``size``."""
    table = int_table(index_path, 2)
    start, total = table[:, 0], table[:, 1]
    bad = (start < 0) | (total < _FRAMING) | (start + total > size)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise FormatError(f"index file {index_path} line {k + 1}: record of {int(total[k])} bytes at byte "
                          f"{int(start[k])} does not fit the file ({size} bytes; a record has at least "
                          f"{_FRAMING})", path=path, sample=f"record {k}", offset=int(start[k]))
    ends = start + total
    gap = np.flatnonzero(start != np.concatenate(([0], ends[:-1])))
    covered = int(ends[-1]) if len(ends) else 0
    if gap.size or covered != size:
        where = (f"line {int(gap[0]) + 1} starts at byte {int(start[gap[0]])}, where the records before end "
                 f"at byte {int(ends[gap[0] - 1]) if gap[0] else 0}" if gap.size
                 else f"its {len(start)} records end at byte {covered}")
        raise FormatError(f"index file {index_path} does not cover the data file ({size} bytes): {where}; "
                          f"rebuild it (tfrecord2idx) or pass no index file to scan the data",
                          path=path, offset=int(start[gap[0]]) if gap.size else covered)
    return start.copy(), total.copy()


def _compression_of(head: bytes) -> str | None:
    """``"gzip"`` or ``"zlib"`` when ``head`` starts such a stream (RFC 1952 magic;
    RFC 1950's deflate method byte 0x78 and header check), else ``None``."""
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if len(head) >= 2 and head[0] == 0x78 and (head[0] << 8 | head[1]) % 31 == 0:
        return "zlib"
    return None


def _refuse_compressed(mm: Any, size: int, path: str) -> None:
    """A file whose first bytes are no valid record header but a gzip/zlib stream is
    a compressed TFRecord: say so, and how to read it."""
    if size < _HEADER or struct.unpack_from("<I", mm, 8)[0] == _crc_at(mm, 0, 8):
        return
    kind = _compression_of(bytes(mm[:2]))
    if kind is not None:
        raise FormatError(f"the file is a {kind}-compressed TFRecord (TFRecordOptions compression "
                          f"{kind.upper()}), whose records cannot be read in place; pass "
                          f"compression={kind!r} to decompress it once into the cache folder",
                          path=path, offset=0)


def _decompressed(path: str, compression: str) -> str:
    """The uncompressed copy of ``path`` (a local file or a remote object, read by
    ranged GETs) in the cache folder, made once per version of it."""
    out = derived_path(path, "tfrecord", compression)
    if not os.path.exists(out):
        with writing_whole(out, path) as dst, (RemoteFile(path, _CHUNK) if is_url(path) else open(path, "rb")) as src:
            _inflate(src, dst, compression, path)
    return out


def _inflate(src: Any, dst: Any, compression: str, path: str) -> None:
    """Copy ``src``'s decompressed bytes to ``dst``: one or more gzip members, or one
    zlib stream."""
    found = _compression_of(src.read(2))
    if found != compression:
        raise FormatError(f"compression={compression!r}, but the file does not start a {compression} stream "
                          f"(it looks {found + '-compressed' if found else 'uncompressed'})", path=path, offset=0)
    src.seek(0)
    wbits = 16 + zlib.MAX_WBITS if compression == "gzip" else zlib.MAX_WBITS
    d, at = zlib.decompressobj(wbits), 0  # at: where the current stream starts
    try:
        while chunk := src.read(_CHUNK):
            while chunk:
                if d.eof:  # gzip allows several members; nothing may follow a zlib stream
                    if compression == "zlib":
                        raise FormatError(f"{os.fstat(src.fileno()).st_size - at} bytes after the end of the "
                                          f"zlib stream", path=path, offset=at)
                    d = zlib.decompressobj(wbits)
                dst.write(d.decompress(chunk))
                chunk = d.unused_data if d.eof else b""
                if d.eof:
                    at = src.tell() - len(chunk)
        dst.write(d.flush())
    except zlib.error as exc:
        raise FormatError(f"bad {compression} data ({exc})", path=path, offset=at) from None
    if not d.eof:
        raise FormatError(f"the {compression} stream ends early: the file is cut short", path=path,
                          offset=src.tell())


# ---- tf.train.Example, wire format ------------------------------------------------

class _Bad(Exception):
    """Malformed protobuf at byte ``args[1]`` of the payload (internal)."""


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Bad("truncated or overlong varint", pos)
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int):
    """Yield ``(field number, wire type, value or start, end)`` over one message:
    varints carry their value, length-delimited/fixed fields their byte range."""
    while pos < end:
        tag, pos = _varint(buf, pos, end)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield number, wire, value, pos
            continue
        if wire == 2:
            n, pos = _varint(buf, pos, end)
        elif wire in (1, 5):
            n = 8 if wire == 1 else 4
        else:
            raise _Bad(f"unsupported wire type {wire} (field {number})", pos)
        if number == 0 or pos + n > end:
            raise _Bad(f"field {number} of {n} bytes runs past its message", pos)
        yield number, wire, pos, pos + n
        pos += n


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _feature(buf: memoryview, record: np.ndarray, start: int, end: int, kind: str, name: str) -> Any:
    """Decode a ``Feature`` message of the expected ``kind``."""
    want = _KIND_FIELD[kind]
    found = (want, start, start)  # no kind set (tf.train.Feature()): an empty list, as TensorFlow reads it
    for number, wire, a, b in _fields(buf, start, end):
        if number in (1, 2, 3) and wire == 2:
            found = (number, a, b)
    if found[0] != want:
        got = next(k for k, f in _KIND_FIELD.items() if f == found[0])
        raise _Bad(f"feature {name!r} holds {got}, expected {kind}", start)
    _, a, b = found
    items: list[Any] = []
    for number, wire, x, y in _fields(buf, a, b):
        if number != 1:
            continue
        if kind == "bytes" and wire == 2:
            items.append(record[x:y])
        elif kind == "float" and wire == 2:  # packed
            if (y - x) % 4:
                raise _Bad(f"packed floats of {y - x} bytes", x)
            items.append(record[x:y].view("<f4"))
        elif kind == "float" and wire == 5:
            items.append(record[x:y].view("<f4"))
        elif kind == "int64" and wire == 2:  # packed
            pos = x
            while pos < y:
                v, pos = _varint(buf, pos, y)
                items.append(_signed(v))
        elif kind == "int64" and wire == 0:
            items.append(_signed(x))
        else:
            raise _Bad(f"feature {name!r}: wire type {wire} in a {kind} list", x)
    if kind == "bytes":
        return items[0] if len(items) == 1 else items
    if kind == "float":
        values = np.concatenate(items) if items else np.zeros(0, dtype=np.float32)
        return values[0] if len(values) == 1 else values
    return np.int64(items[0]) if len(items) == 1 else np.asarray(items, dtype=np.int64)


class ExampleParser(Parser):
    """Parses TFRecord payloads as ``tf.train.Example`` and returns ``features``
    (``{name: "bytes" | "int64" | "float"}``); a missing feature or another kind is
    a ``FormatError``, a feature with no kind set an empty value."""

    name = "tfrecord.example"
    source = "record"

    def __init__(self, features: dict[str, str]) -> None:
        bad = {k: v for k, v in features.items() if v not in _KINDS}
        if bad or not features:
            raise ConfigError(f"feature kinds {bad or 'none given'}; choose from {', '.join(_KINDS)}")
        self.features = dict(features)
        self.fields = tuple(self.features)

    def config(self) -> dict[str, Any]:
        return {"features": self.features}

    def parse(self, records: Sequence[np.ndarray], samples: np.ndarray, paths: Sequence[str],
              offsets: np.ndarray) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in self.fields}
        wanted = {name.encode(): name for name in self.fields}
        for j, record in enumerate(records):
            buf = memoryview(record)
            try:
                found = self._find(buf, len(record), wanted)
                for name, kind in self.features.items():
                    if name not in found:
                        raise _Bad(f"feature {name!r} missing; the record's features: "
                                   f"{self._names(buf, len(record))}", 0)
                    out[name].append(_feature(buf, record, *found[name], kind, name))
            except _Bad as exc:
                raise FormatError(f"bad tf.train.Example: {exc.args[0]} (at payload byte {exc.args[1]})",
                                  path=paths[j], sample=int(samples[j]), offset=int(offsets[j])) from None
        return out

    @staticmethod
    def _find(buf: memoryview, size: int, wanted: dict[bytes, str] | None) -> dict[str, tuple[int, int]]:
        """Byte ranges of the wanted ``Feature`` messages (every one for ``None``):
        Example.features (1) -> Features.feature (1, map entries of key 1 and value 2)."""
        found: dict[str, tuple[int, int]] = {}
        for number, wire, a, b in _fields(buf, 0, size):
            if number != 1 or wire != 2:
                continue
            for n2, w2, c, d in _fields(buf, a, b):
                if n2 != 1 or w2 != 2:
                    continue
                key, value = None, (d, d)  # an absent value is an empty Feature
                for n3, w3, x, y in _fields(buf, c, d):
                    if n3 == 1 and w3 == 2:
                        key = buf[x:y].tobytes()
                    elif n3 == 2 and w3 == 2:
                        value = (x, y)
                if wanted is None and key is not None:
                    found[key.decode(errors="replace")] = value
                elif wanted is not None and key in wanted:
                    found[wanted[key]] = value
        return found

    @classmethod
    def _names(cls, buf: memoryview, size: int) -> str:
        """The names of every feature a record has, sorted, for an error message."""
        names = sorted(cls._find(buf, size, None))
        return ", ".join(repr(n) for n in names[:50]) + (f", ... ({len(names) - 50} more)" if len(names) > 50 else "") \
            if names else "none"
