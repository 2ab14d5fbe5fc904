"""Parquet files, as the Hugging Face Hub stores datasets and ``datasets.Dataset.to_parquet``
writes them: one sample per row.

Fields are the leaf columns, named by their path (a struct's fields as ``image.bytes``,
``image.path``). Binary columns (``BYTE_ARRAY`` that is not a string) become extent
fields; every other column is read at index time into a value field: numbers as arrays,
strings as ``str``. A ``datasets`` ``Image()``/``Audio()`` column is a struct ``{bytes,
path}``; the schema's ``huggingface`` metadata names them (their ``.bytes`` fields go into
``index.meta["images"]``, where ``decode_image`` finds them) and the ``ClassLabel`` names
(``index.meta["class_names"]``).

Where a value lies is found from the footer (Thrift's compact protocol,
``formats/_thrift.py``), the offset index's page locations or the page headers:

- **exact**: in a local column chunk written uncompressed, without a dictionary and
  PLAIN-encoded (``datasets`` >= 4.6 writes image, audio and video columns so), a value is
  a u32 length and its bytes after the page header and definition levels. Indexing reads
  each page's header and levels and each value's 4-byte length; the extent is the value.
- **dictionary chunks** (pyarrow's default), and compressed chunks with a page over
  ``PAGE_UNIT_LIMIT`` bytes: the dictionary page holds the values compressed as one block,
  up to a whole row group's, and pyarrow writes a page per 1,024 rows, so no small unit
  decodes alone; the chunk is decompressed once at indexing into ``<cache_dir>/parquet/`` (``gpuio.config``
  ``cache_dir``; reused while the file's size and mtime or ETag are unchanged), whose
  values are exact extents (``index.meta["decompressed"]`` lists the copies). Remote files
  with such chunks have every binary chunk copied so: an index reads either objects or
  local files.
- **pages**: other compressed chunks, and every chunk of a remote file, give the extent
  field ``<name>.page``: the data page holding the value, the smallest unit that decodes
  alone. Its length is the page's plus the value's row in it (the bytes after the page
  that this reads are ignored), which tells the parse step (``PageParser``) which value
  to take; it decompresses each page once per batch and gives the field ``<name>`` as
  views of the values. Remote files take this form because a value's offset needs every
  length before it in its page: see the README.

A row whose ``bytes`` is null and whose sibling ``path`` is set reads that file (relative
paths from the Parquet file's folder); in page units, a null value is empty.
Indexing reports what it read in ``index.meta["index_bytes_read"]`` (footers, page
indexes, page headers, levels, value lengths and the value columns).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gpuio.errors import ConfigError, DataError, DependencyError, FormatError, StorageError
from gpuio.formats._files import derived_path, each_shard, full_path, shard_paths, size_or_zero, writing_whole
from gpuio.formats._thrift import ThriftError, read_struct
from gpuio.index import UNKNOWN_LENGTH, Extents, Parser, PathTable, Ragged, SampleIndex
from gpuio.storage.remote import client as remote_client
from gpuio.storage.remote import is_url, object_versions

__all__ = ["parquet", "PageParser", "PAGE_UNIT_LIMIT", "follow_paths", "hf_features", "hf_meta"]

MAGIC = b"PAR1"
# Parquet's Thrift enums and field ids (parquet.thrift)
_BYTE_ARRAY = 6
_OPTIONAL, _REPEATED = 1, 2
_UTF8 = 0  # ConvertedType
_PLAIN, _PLAIN_DICTIONARY, _RLE, _BIT_PACKED, _RLE_DICTIONARY = 0, 2, 3, 4, 8
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
_CODECS = {0: None, 1: "snappy", 2: "gzip", 4: "brotli", 6: "zstd", 7: "lz4_raw"}
_CODEC_NAMES = {3: "LZO", 5: "LZ4 (Hadoop framing)"}
_ENCODINGS_READ = {_PLAIN, _PLAIN_DICTIONARY, _RLE, _BIT_PACKED, _RLE_DICTIONARY}
_HEADER_READ = 256  # bytes read for a page header at first; more when it is longer
# A compressed chunk with a page larger than this is decompressed once at indexing instead of read as page
# units: a batch holds a unit per sample (pyarrow writes a page per 1,024 rows, 50 MB of ImageNet JPEGs).
PAGE_UNIT_LIMIT = 4 << 20


class _Bad(Exception):
    """Malformed page bytes: ``args == (reason, byte offset within the unit)`` (internal)."""


# The Thrift structs read, as the types of the fields used (parquet.thrift): a struct read
# is checked against its spec once, so that the code after it meets only these types.
_PAGE_HEADER = {1: int, 2: int, 3: int, 5: {1: int, 2: int}, 7: {1: int, 2: int},
                8: {1: int, 4: int, 5: int, 6: int, 7: int}}
_OFFSET_INDEX = {1: [{1: int, 2: int, 3: int}]}
_FILE_META = {2: [{1: int, 3: int, 4: bytes, 5: int, 6: int, 10: dict}], 3: int,
              4: [{1: [{1: bytes, 3: {2: [int], 4: int, 7: int, 9: int, 11: int}, 4: int, 5: int}], 3: int}],
              5: [{1: bytes, 2: bytes}]}


def _typed(value: Any, spec: Any) -> bool:
    """Whether ``value`` (a struct as ``formats._thrift`` reads it) has ``spec``'s types
    where it has those fields."""
    if isinstance(spec, dict):
        return isinstance(value, dict) and all(k not in value or _typed(value[k], t) for k, t in spec.items())
    if isinstance(spec, list):
        return isinstance(value, list) and all(_typed(v, spec[0]) for v in value)
    return isinstance(value, spec)


def parquet(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
            fields: Sequence[str] | Mapping[str, str] | None = None) -> SampleIndex:
    """Index the rows of one or more Parquet files (``s3://``/``http(s)://`` URLs,
    brace ranges and globs too), in file then row order.

    ``fields``: the leaf columns to index, by path (``["image.bytes", "label"]``), or a
    dict ``{name in the index: column path}`` to rename them; default every leaf column
    that is not a list. Binary columns are extent fields (see the module docstring for
    exact and page extents), the others value fields. ``index.meta``: ``images`` (the
    ``Image()`` columns' bytes fields), ``class_names`` (``{field: ClassLabel names}``),
    ``index_bytes_read``, ``data_bytes`` (the files' sizes), ``extents`` (``{field:
    "exact" | "pages"}``) and ``decompressed`` (the copies of dictionary chunks and
    chunks of large pages, in ``<cache_dir>/parquet/``).
    """
    paths = [full_path(p) for p in shard_paths(paths, "Parquet file")]
    if not paths:
        raise DataError("no samples: an empty list of Parquet files was given")
    footers = [_footer(p) for p in paths]
    first = footers[0]
    wanted = _wanted(fields, first)
    for foot in footers[1:]:
        missing = [c for c in wanted.values() if c not in foot.leaves]
        if missing:
            raise FormatError(f"columns {missing} are missing here (the first file, {paths[0]}, has them)",
                              path=foot.path, offset=foot.size - 8 - foot.length)
    binary = {name: col for name, col in wanted.items() if first.leaves[col].binary}
    exact = {name: not any(_needs_pages(f, col) for f in footers) for name, col in binary.items()}
    sizes = [size_or_zero(p) for p in paths]
    # one process: decompressing a copy calls pyarrow, whose own threads make a forked pool unsafe
    found = each_shard(functools.partial(_index_file, {n: (c, exact[n]) for n, c in binary.items()}, False),
                       footers, "indexing Parquet files", sizes, processes=False)
    if is_url(paths[0]) and any(r[n][2].any() for r in found for n in binary):
        # some chunks of these objects are decompressed into local copies: all of them are (an index reads
        # either objects or local files)
        exact = dict.fromkeys(binary, True)
        found = each_shard(functools.partial(_index_file, {n: (c, True) for n, c in binary.items()}, True),
                           footers, "indexing Parquet files", sizes, processes=False)
    paged = [name for name in binary if not all(r[name][2].all() for r in found) and not exact[name]]
    exact = {name: name not in paged for name in binary}
    if len(paged) > 1:
        raise ConfigError(f"columns {[binary[n] for n in paged]} are compressed, and an index parses one such "
                          f"column; index them one at a time (fields=[...])")
    codecs = {f.path: _codec(f, binary[paged[0]]) for f in footers} if paged else {}
    values, read_bytes = _read_columns(footers, {n: c for n, c in wanted.items() if n not in binary})

    files: list[str] = []  # the files the extents name: Parquet files, decompressed copies, files rows name
    file_ids: dict[str, int] = {}

    def file_id(path: str) -> int:
        if path not in file_ids:
            file_ids[path] = len(files)
            files.append(path)
        return file_ids[path]

    extents: dict[str, Extents] = {}
    for name, col in binary.items():
        offsets = np.concatenate([r[name][0] for r in found])
        lengths = np.concatenate([r[name][1] for r in found])
        ids = []
        for k, r in enumerate(found):  # rows of dictionary chunks lie in the file's decompressed copy
            in_copy, copy = r[name][2], r[name][3]
            ids.append(np.where(in_copy, file_id(copy) if in_copy.any() else -1,
                                file_id(paths[k]) if not in_copy.all() else -1).astype(np.int32))
        ids = _external_files(col, first, footers, np.concatenate(ids), offsets, lengths, files)
        extents[name if exact[name] else f"{name}.page"] = Extents(ids, offsets, lengths)
    parser = None
    if paged:
        leaf = first.leaves[binary[paged[0]]]
        parser = PageParser(paged[0], f"{paged[0]}.page", codecs, leaf.max_def)
    meta = {"format": "parquet", "columns": dict(wanted), **hf_meta(first.features, wanted, binary),
            "extents": {n: "exact" if exact[n] else "pages" for n in binary},
            "decompressed": sorted({f for r in found for n in binary if (f := r[n][3])}),
            "index_bytes_read": int(sum(f.length + 8 for f in footers) + sum(r["_read"] for r in found) + read_bytes),
            "data_bytes": int(sum(f.size for f in footers)), **object_versions(files)}
    if len({is_url(f) for f in files}) > 1:
        raise ConfigError(f"these rows name both objects and local files ({[f for f in files if not is_url(f)][:3]} "
                          f"...); an index reads one or the other")
    if not files:  # value columns only: the Parquet files, for the record
        files = list(paths)
    return SampleIndex(PathTable.from_paths(files), extents, values, parser, meta=meta)



# ---- files: local or remote, every byte read counted -------------------------------

class _Source:
    """A Parquet file opened for indexing: ``read(n, offset)`` by ``os.pread`` or a
    ranged GET; ``bytes_read`` counts them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.bytes_read = 0
        self.fd = -1
        if is_url(path):
            info = remote_client().head(path)
            self.size, self.etag = info.size, info.etag
            return
        try:
            self.fd = os.open(path, os.O_RDONLY)
            self.size = os.fstat(self.fd).st_size
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot read Parquet file: {getattr(exc, 'strerror', None) or exc}",
                               path=path) from exc

    def read(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes from byte ``offset`` (fewer at the end of the file)."""
        n = max(0, min(n, self.size - offset))
        if self.fd < 0:
            buf = bytearray(n)
            if n:
                remote_client().get_into(self.path, offset, memoryview(buf), self.etag)
            data = bytes(buf)
        else:
            try:
                data = os.pread(self.fd, n, offset)
            except OSError as exc:
                raise StorageError(f"cannot read Parquet file: {exc.strerror or exc}", path=self.path,
                                   offset=offset) from exc
        self.bytes_read += len(data)
        return data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Leaf:
    """One leaf column of the schema: its index among the leaves, physical type,
    maximum definition and repetition levels, and whether it holds binary (non-string)
    values."""

    def __init__(self, position: int, element: dict[int, Any], max_def: int, max_rep: int) -> None:
        self.position = position
        self.max_def, self.max_rep = max_def, max_rep
        self.physical = element.get(1)
        logical = element.get(10) or {}
        self.is_string = element.get(6) == _UTF8 or 1 in logical or 11 in logical  # UTF8, STRING, JSON
        self.binary = element.get(1) == _BYTE_ARRAY and not self.is_string


class _Footer:
    """A file's ``FileMetaData``: its leaves by dotted path, row groups, row count,
    ``huggingface`` features, and where the footer lies (``length`` bytes before the
    last 8)."""

    def __init__(self, path: str, size: int, length: int, meta: dict[int, Any]) -> None:
        self.path, self.size, self.length = path, size, length
        self.rows = meta.get(3, 0)
        self.row_groups = meta.get(4) or []
        self.leaves: dict[str, _Leaf] = {}
        schema = meta.get(2) or []
        if not schema:
            raise FormatError("the footer has no schema", path=path, offset=size - 8 - length)
        self._walk(schema, 1, schema[0].get(5, 0), [], 0, 0)
        kv = {e.get(1, b"").decode(errors="replace"): e.get(2, b"") for e in meta.get(5) or []}
        self.features = hf_features(kv.get("huggingface"))
        if sum(rg.get(3, 0) for rg in self.row_groups) != self.rows:
            raise FormatError(f"the footer's row groups hold {sum(rg.get(3, 0) for rg in self.row_groups)} rows, "
                              f"its total says {self.rows}", path=path, offset=size - 8 - length)

    def _walk(self, schema: list[dict[int, Any]], at: int, children: int, prefix: list[str], d: int, r: int) -> int:
        for _ in range(children):
            if at >= len(schema):
                raise FormatError("the footer's schema tree names more children than it has elements",
                                  path=self.path, offset=self.size - 8 - self.length)
            el = schema[at]
            name = el.get(4, b"").decode(errors="replace")
            rep = el.get(3, 0)
            dd, rr = d + (rep in (_OPTIONAL, _REPEATED)), r + (rep == _REPEATED)
            if el.get(5):
                at = self._walk(schema, at + 1, el[5], [*prefix, name], dd, rr)
            else:
                self.leaves[".".join([*prefix, name])] = _Leaf(len(self.leaves), el, dd, rr)
                at += 1
        return at

    def chunks(self, column: str) -> list[dict[int, Any]]:
        """The ``ColumnChunk`` of ``column`` in each row group."""
        k = self.leaves[column].position
        out = []
        for g, rg in enumerate(self.row_groups):
            cols = rg.get(1) or []
            if k >= len(cols) or 3 not in cols[k]:
                raise FormatError(f"row group {g} has no metadata for column {column!r}", path=self.path,
                                  offset=self.size - 8 - self.length)
            if cols[k].get(1):
                raise FormatError(f"row group {g}: column {column!r} lies in another file ({cols[k][1]!r}); "
                                  f"such multi-file datasets are not read", path=self.path)
            out.append(cols[k])
        return out


def _footer(path: str) -> _Footer:
    src = _Source(path)
    try:
        if src.size < 12:
            raise FormatError(f"not a Parquet file: {src.size} bytes, shorter than its magic and footer",
                              path=path, offset=0)
        head, tail = src.read(4, 0), src.read(8, src.size - 8)
        if head != MAGIC or tail[4:] != MAGIC:
            bad = 0 if head != MAGIC else src.size - 4
            raise FormatError(f"not a Parquet file: no {MAGIC!r} magic at byte {bad} (found "
                              f"{(head if bad == 0 else tail[4:])!r})", path=path, offset=bad)
        (length,) = struct.unpack("<I", tail[:4])
        if length > src.size - 12:
            raise FormatError(f"the footer's length says {length} bytes, the file has {src.size - 12} between "
                              f"its magics (cut short?)", path=path, offset=src.size - 8)
        at = src.size - 8 - length
        try:
            meta, end = read_struct(src.read(length, at))
        except ThriftError as exc:
            raise FormatError(f"bad footer (FileMetaData): {exc.args[0]}", path=path, offset=at + exc.args[1]) from None
        if not _typed(meta, _FILE_META):
            raise FormatError("bad footer (FileMetaData): a field holds another type than parquet.thrift says",
                              path=path, offset=at)
        return _Footer(path, src.size, length, meta)
    finally:
        src.close()


def _wanted(fields: Sequence[str] | Mapping[str, str] | None, foot: _Footer) -> dict[str, str]:
    """``{field name: column path}``, checked against the first file's leaves."""
    if fields is None:
        return {c: c for c, leaf in foot.leaves.items() if not leaf.max_rep}
    if isinstance(fields, str):
        fields = [fields]
    wanted = {str(k): str(v) for k, v in fields.items()} if isinstance(fields, Mapping) else {f: f for f in fields}
    unknown = [c for c in wanted.values() if c not in foot.leaves]
    if unknown or not wanted:
        raise ConfigError(f"fields {unknown or 'none given'}; the columns of {foot.path}: {list(foot.leaves)}")
    lists = [c for c in wanted.values() if foot.leaves[c].max_rep]
    if lists:
        raise ConfigError(f"columns {lists} are lists (repeated); gpuio indexes one value per row")
    return wanted


def _dictionary_chunk(cc: dict[int, Any]) -> bool:
    """Whether a column chunk starts with a dictionary page."""
    meta = cc[3]
    return meta.get(11) is not None or bool({_PLAIN_DICTIONARY, _RLE_DICTIONARY} & set(meta.get(2) or []))


def _needs_pages(foot: _Footer, column: str) -> bool:
    """Whether some chunk of ``column`` here is read as page units: not a dictionary chunk
    (decompressed once instead), and not stored as it is in a local file (uncompressed,
    PLAIN)."""
    for cc in foot.chunks(column):
        if _dictionary_chunk(cc):
            continue
        meta = cc[3]
        if is_url(foot.path) or meta.get(4, 0) != 0 or set(meta.get(2) or []) - {_PLAIN, _RLE, _BIT_PACKED}:
            return True
    return False


def _codec(foot: _Footer, column: str, dictionary: bool | None = False) -> str | None:
    """pyarrow's name of the codec of ``column``'s chunks here (those with a dictionary
    page or without, or all for ``None``); one codec, checked."""
    codecs = {_chunk_codec(cc, column) for cc in foot.chunks(column)
              if dictionary is None or _dictionary_chunk(cc) == dictionary}
    if len(codecs) > 1:
        raise ConfigError(f"column {column!r} mixes codecs {sorted(map(str, codecs))} across row groups of "
                          f"{foot.path}")
    return codecs.pop() if codecs else None


def _chunk_codec(cc: dict[int, Any], column: str) -> str | None:
    c = cc[3].get(4, 0)
    if c not in _CODECS:
        raise ConfigError(f"column {column!r} is compressed with {_CODEC_NAMES.get(c, f'codec {c}')}, which "
                          f"gpuio does not read (snappy, gzip, brotli, zstd, lz4_raw)")
    return _CODECS[c]


# ---- pages: where each value lies ---------------------------------------------------

class _Page:
    """A page header read at byte ``start``: the header, where its body starts and ends."""

    def __init__(self, header: dict[int, Any], start: int, body: int) -> None:
        self.header, self.start, self.body = header, start, body
        self.end = body + header.get(3, 0)
        self.kind = header.get(1)
        sub = header.get(5 if self.kind == _DATA_PAGE else 8 if self.kind == _DATA_PAGE_V2 else 7) or {}
        self.values = sub.get(1, 0)
        self.encoding = sub.get(2 if self.kind == _DATA_PAGE else 4 if self.kind == _DATA_PAGE_V2 else 2, _PLAIN)
        self.sub = sub


def _page_at(read: Callable[[int, int], bytes], start: int, limit: int) -> _Page:
    """The page header at ``start``, read with ``read(n, offset)``; ``limit``: where the
    page's column chunk ends. Raises ``_Bad`` (offsets from the file's start)."""
    n = _HEADER_READ
    while True:
        buf = read(min(n, limit - start), start)
        try:
            header, end = read_struct(buf)
            break
        except ThriftError as exc:
            if start + len(buf) < limit and "past the end" in exc.args[0]:
                n *= 16
                continue
            raise _Bad(f"bad page header: {exc.args[0]}", start + exc.args[1]) from None
    if not _typed(header, _PAGE_HEADER):
        raise _Bad("bad page header: a field holds another type than parquet.thrift says", start)
    page = _Page(header, start, start + end)
    size = header.get(3, -1)
    if header.get(1) not in (_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2, 1) or size < 0 or page.end > limit:
        raise _Bad(f"the page header says type {header.get(1)} and {size} bytes, more than the "
                   f"{limit - page.body} its column chunk has left", start)
    if page.kind in (_DATA_PAGE, _DATA_PAGE_V2) and page.values < 0:
        raise _Bad(f"the page header says {page.values} values", start)
    return page


def _index_file(columns: dict[str, tuple[str, bool]], copy_all: bool, foot: _Footer,
                advance: Callable[[int], None]) -> dict[str, Any]:
    """``{field: (offsets, lengths, in the copy, copy)}`` of one file's binary columns
    (``columns``: ``{field: (column path, exact)}``): rows of dictionary chunks lie in
    ``copy``, the file's decompressed copy of that column (``""``: none; every chunk
    with ``copy_all``); plus
    ``"_read"``: the bytes read."""
    src = _Source(foot.path)
    try:
        out: dict[str, Any] = {}
        for name, (column, exact) in columns.items():
            leaf = foot.leaves[column]
            chunks = foot.chunks(column)
            in_place, to_copy = {}, []
            for g, cc in enumerate(chunks):
                if copy_all or _dictionary_chunk(cc):
                    to_copy.append(g)
                    continue
                try:
                    pages = _chunk_pages(src, cc, foot.row_groups[g].get(3, 0))
                    if exact:
                        in_place[g] = _exact_values(src, pages, leaf)
                    elif max(p.end - p.start for p in pages) > PAGE_UNIT_LIMIT:
                        to_copy.append(g)
                    else:
                        in_place[g] = _units(src, pages)
                except _Bad as exc:
                    raise FormatError(f"row group {g}, column {column!r}: {exc.args[0]}", path=foot.path,
                                      offset=exc.args[1]) from None
            copy, copied = _decompressed_copy(src, foot, column, to_copy)
            parts = [copied[g] if g in copied else in_place[g] for g in range(len(chunks))]
            for g, part in enumerate(parts):
                rows = foot.row_groups[g].get(3, 0)
                if len(part[0]) != rows:
                    raise FormatError(f"row group {g}, column {column!r}: its pages hold {len(part[0])} values, "
                                      f"the row group {rows} rows", path=foot.path, offset=_chunk_start(chunks[g]))
            out[name] = (np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64),
                         np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64),
                         np.concatenate([np.full(len(p[0]), g in copied) for g, p in enumerate(parts)])
                         if parts else np.zeros(0, bool), copy)
        out["_read"] = src.bytes_read
        advance(foot.size)
        return out
    finally:
        src.close()


def _decompressed_copy(src: _Source, foot: _Footer, column: str, chunks: list[int]
                       ) -> tuple[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """The values of ``column`` in the dictionary chunks ``chunks`` (row groups) written
    back to back into a file in ``<cache_dir>/parquet/``, made once per version of the
    Parquet file (a dictionary page holds its values compressed as one block, up to a
    whole row group's: no smaller unit decodes alone). Returns the copy's path (``""``
    without such chunks) and per row group the values' offsets in it and lengths (a
    null: offset -1, length 0)."""
    if not chunks:
        return "", {}
    out = f"{derived_path(foot.path, 'parquet', column, chunks)}.{column}"
    if not (os.path.exists(out) and os.path.exists(out + ".npz")):
        _write_copy(src, foot, column, chunks, out)
    with np.load(out + ".npz", allow_pickle=False) as z:
        offsets, lengths, counts = z["offsets"], z["lengths"], z["counts"]
    bounds = np.concatenate(([0], np.cumsum(counts)))
    return out, {g: (offsets[bounds[k]: bounds[k + 1]], lengths[bounds[k]: bounds[k + 1]])
                 for k, g in enumerate(chunks)}


def _write_copy(src: _Source, foot: _Footer, column: str, chunks: list[int], out: str) -> None:
    leaf = foot.leaves[column]
    offsets, lengths, counts = [], [], []
    with writing_whole(out, foot.path) as f:
        for g in chunks:
            cc = foot.chunks(column)[g]
            start = _chunk_start(cc)
            end = start + cc[3].get(7, 0)
            if start < 4 or end > src.size - 8:
                raise FormatError(f"row group {g}, column {column!r}: its bytes {start}..{end} lie outside the "
                                  f"file's data ({src.size} bytes)", path=foot.path, offset=start)
            try:
                values = [v for part in _chunk_values(np.frombuffer(src.read(end - start, start), np.uint8),
                                                      leaf, _chunk_codec(cc, column)) for v in part]
            except _Bad as exc:
                raise FormatError(f"row group {g}, column {column!r}: {exc.args[0]}", path=foot.path,
                                  offset=start + exc.args[1]) from None
            for v in values:
                offsets.append(f.tell() if v is not None else -1)
                lengths.append(len(v) if v is not None else 0)
                if v is not None:
                    f.write(v)
            counts.append(len(values))
    with writing_whole(out + ".npz", foot.path) as f:  # last: a copy is complete when its table is there
        np.savez(f, offsets=np.asarray(offsets, np.int64), lengths=np.asarray(lengths, np.int64),
                 counts=np.asarray(counts, np.int64))


def _chunk_start(cc: dict[int, Any]) -> int:
    meta = cc[3]
    starts = [v for v in (meta.get(9), meta.get(11)) if v is not None and v > 0]
    return min(starts) if starts else 0


class _PageSpan:
    """A page as its location says: start, end (header included), values, and whether
    it is the chunk's dictionary page."""

    def __init__(self, start: int, end: int, values: int, dictionary: bool, page: _Page | None = None) -> None:
        self.start, self.end, self.values, self.dictionary, self.page = start, end, values, dictionary, page


def _chunk_pages(src: _Source, cc: dict[int, Any], rows: int) -> list[_PageSpan]:
    """The pages of one column chunk, from its offset index when the file has one (no
    page is read), else from its page headers."""
    meta = cc[3]
    start = _chunk_start(cc)
    end = start + meta.get(7, 0)
    if end > src.size - 8 or start < 4:
        raise _Bad(f"the column chunk's bytes {start}..{end} lie outside the file's data ({src.size} bytes)", start)
    if cc.get(4) is not None and cc.get(5):
        at = cc[4]
        try:
            index, _ = read_struct(src.read(cc[5], at))
        except ThriftError as exc:
            raise _Bad(f"bad offset index: {exc.args[0]}", at + exc.args[1]) from None
        if not _typed(index, _OFFSET_INDEX):
            raise _Bad("bad offset index: a field holds another type than parquet.thrift says", at)
        locs = index.get(1) or []
        spans = []
        if locs and locs[0].get(1, start) > start:  # the dictionary page comes before the first data page
            spans.append(_PageSpan(start, locs[0][1], 0, True))
        for k, loc in enumerate(locs):
            first, size = loc.get(1, -1), loc.get(2, -1)
            nxt = locs[k + 1].get(3, -1) if k + 1 < len(locs) else rows
            values = nxt - loc.get(3, -1)
            if first < start or size <= 0 or first + size > end or values <= 0 or (spans and first < spans[-1].end):
                raise _Bad(f"the offset index's page {k} (at byte {first}, {size} bytes, {values} rows) does not fit "
                           f"its column chunk (bytes {start}..{end})", at)
            spans.append(_PageSpan(first, first + size, values, False))
        return spans
    spans, pos = [], start
    while pos < end:
        page = _page_at(src.read, pos, end)
        if page.kind == 1:  # an index page: unused by the format's writers, skipped
            pos = page.end
            continue
        spans.append(_PageSpan(pos, page.end, page.values, page.kind == _DICTIONARY_PAGE, page))
        pos = page.end
    return spans


def _units(src: _Source, pages: list[_PageSpan]) -> tuple[np.ndarray, np.ndarray]:
    """Per value: its page (the unit that decodes alone), and as the extent's length the
    page's plus the value's row in it, which the parse step reads back. A value whose
    extent would run past the end of the file is refused."""
    offsets, lengths = [], []
    for p in pages:
        if p.dictionary:
            raise _Bad("a dictionary page in a chunk read page by page", p.start)
        if p.end + p.values - 1 > src.size:
            raise _Bad(f"the page at byte {p.start} ends {src.size - p.end} bytes before the end of the file, "
                       f"fewer than its {p.values} values", p.start)
        offsets.append(np.full(p.values, p.start, dtype=np.int64))
        lengths.append(p.end - p.start + np.arange(p.values, dtype=np.int64))
    return (np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
            np.concatenate(lengths) if lengths else np.zeros(0, np.int64))


def _exact_values(src: _Source, pages: list[_PageSpan], leaf: _Leaf) -> tuple[np.ndarray, np.ndarray]:
    """Per value: the offset and length of its bytes (a null: offset -1, length 0).
    Reads each page's header and levels, then each value's u32 length prefix."""
    offsets, lengths = [], []
    for span in pages:
        page = span.page or _page_at(src.read, span.start, span.end)
        if page.kind not in (_DATA_PAGE, _DATA_PAGE_V2):
            raise _Bad(f"a {'dictionary' if page.kind == _DICTIONARY_PAGE else f'type {page.kind}'} page in a "
                       f"chunk whose metadata says PLAIN without a dictionary", span.start)
        if page.encoding != _PLAIN:
            raise _Bad(f"a data page of encoding {page.encoding} in a chunk whose metadata says PLAIN", span.start)
        pos = page.body
        if page.kind == _DATA_PAGE_V2:
            levels_at, pos = pos + page.sub.get(6, 0), pos + page.sub.get(6, 0) + page.sub.get(5, 0)
            levels = src.read(pos - levels_at, levels_at)
        elif leaf.max_def:
            (n,) = struct.unpack("<I", _need(src.read(4, pos), 4, pos))
            levels, levels_at = src.read(n, pos + 4), pos + 4
            pos += 4 + n
        else:
            levels, levels_at = b"", pos
        present = _present(levels, leaf.max_def, page.values, levels_at)
        off = np.full(page.values, -1, dtype=np.int64)
        length = np.zeros(page.values, dtype=np.int64)
        for r in np.flatnonzero(present).tolist():
            (n,) = struct.unpack("<I", _need(src.read(4, pos), 4, pos))
            if pos + 4 + n > page.end:
                raise _Bad(f"a value of {n} bytes runs past its page (ends at byte {page.end})", pos)
            off[r], length[r] = pos + 4, n
            pos += 4 + n
        if pos != page.end:
            raise _Bad(f"the page's {int(present.sum())} values end at byte {pos}, its header says {page.end}",
                       page.start)
        offsets.append(off)
        lengths.append(length)
    return (np.concatenate(offsets) if offsets else np.zeros(0, np.int64),
            np.concatenate(lengths) if lengths else np.zeros(0, np.int64))


def _need(data: bytes, n: int, at: int) -> bytes:
    if len(data) < n:
        raise _Bad(f"{len(data)} of {n} bytes: the file is cut short", at)
    return data


def _present(levels: bytes, max_def: int, count: int, at: int) -> np.ndarray:
    """Which of ``count`` values are set, from their definition levels (the RLE/bit-packed
    hybrid encoding)."""
    if not max_def:
        return np.ones(count, dtype=bool)
    return _hybrid(levels, 0, len(levels), max_def.bit_length(), count, at) == max_def


def _hybrid(buf: Any, pos: int, end: int, width: int, count: int, at: int) -> np.ndarray:
    """``count`` integers of ``width`` bits in Parquet's RLE/bit-packed hybrid encoding,
    from ``buf[pos:end]`` (``at``: the file offset of ``buf[0]``, for errors)."""
    out = np.zeros(count, dtype=np.int64)
    filled = 0
    step = (width + 7) // 8
    weights = 1 << np.arange(width, dtype=np.int64)
    while filled < count:
        value = shift = 0
        while True:  # the run's header: a ULEB128 varint
            if pos >= end or shift > 35:
                raise _Bad(f"the levels or indices end after {filled} of {count} values", at + pos)
            b = int(buf[pos])  # a NumPy uint8 would overflow when shifted
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        if value & 1:  # bit-packed groups of 8
            n = (value >> 1) * 8
            nbytes = (value >> 1) * width
            if pos + nbytes > end:
                raise _Bad(f"bit-packed run of {n} values runs past its {end - pos} bytes", at + pos)
            bits = np.unpackbits(np.frombuffer(bytes(buf[pos: pos + nbytes]), dtype=np.uint8), bitorder="little")
            vals = bits.reshape(-1, width).astype(np.int64) @ weights if width else np.zeros(n, np.int64)
            take = min(n, count - filled)
            out[filled: filled + take] = vals[:take]
            pos += nbytes
        else:
            n = value >> 1
            if pos + step > end:
                raise _Bad("a run's value runs past its bytes", at + pos)
            take = min(n, count - filled)
            out[filled: filled + take] = int.from_bytes(bytes(buf[pos: pos + step]), "little")
            pos += step
        if n == 0:
            raise _Bad("an empty run in the levels or indices", at + pos)
        filled += take
    return out


def _external_files(column: str, foot: _Footer, footers: list[_Footer], ids: np.ndarray, offsets: np.ndarray,
                    lengths: np.ndarray, files: list[str]) -> np.ndarray:
    """Rows whose value is null: where the column is a struct's ``bytes`` and its
    sibling ``path`` is set, the extent is that whole file (relative to the Parquet
    file's folder), added to ``files``; else an empty extent. Returns the file ids."""
    null = np.flatnonzero(offsets < 0)
    offsets[null] = 0
    sibling = column[: -len("bytes")] + "path" if column.endswith(".bytes") else None
    if not len(null) or sibling is None or sibling not in foot.leaves:
        return ids
    targets = _read_columns(footers, {"_path": sibling})[0]["_path"]
    return follow_paths(null, [targets[r] for r in null.tolist()], ids, lengths, files)


def follow_paths(rows: np.ndarray, targets: Sequence[str], ids: np.ndarray, lengths: np.ndarray,
                 files: list[str]) -> np.ndarray:
    """A ``datasets`` image or audio whose ``bytes`` is null is the file its ``path``
    names: the extents of ``rows`` become those whole files (a relative path from the
    folder of the sample's own file), appended to ``files``; rows without a path keep
    their empty extent. Returns the file ids."""
    for r, target in zip(rows.tolist(), targets):
        if not target:
            continue
        base = os.path.dirname(files[ids[r]])
        ids[r] = len(files)
        files.append(target if os.path.isabs(target) or is_url(target) else os.path.join(base, target))
        lengths[r] = UNKNOWN_LENGTH
    return ids


# ---- value columns ------------------------------------------------------------------

# PLAIN widths of the fixed-size physical types
_NUMBERS = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 4: np.dtype("<f4"), 5: np.dtype("<f8")}
_BOOLEAN = 0


def _read_columns(footers: list[_Footer], wanted: dict[str, str]) -> tuple[dict[str, Any], int]:
    """The non-binary columns ``wanted`` (``{field: column path}``) of every file as value
    fields (numbers as arrays, strings as ``str``), and the bytes read: each column chunk
    read whole and decoded (decompressed with pyarrow where it is compressed)."""
    parts: dict[str, list[Any]] = {n: [] for n in wanted}
    read = 0
    for foot in footers:
        src = _Source(foot.path)
        try:
            for name, column in wanted.items():
                leaf = foot.leaves[column]
                codec = _codec(foot, column, None)
                for g, cc in enumerate(foot.chunks(column)):
                    start = _chunk_start(cc)
                    end = start + cc[3].get(7, 0)
                    buf = np.frombuffer(src.read(end - start, start), dtype=np.uint8)
                    try:
                        values = _chunk_values(buf, leaf, codec)
                        if leaf.is_string:
                            _check_utf8(values)
                        parts[name].extend(values)
                    except _Bad as exc:
                        raise FormatError(f"row group {g}, column {column!r}: {exc.args[0]}", path=foot.path,
                                          offset=start + exc.args[1]) from None
        finally:
            read += src.bytes_read
            src.close()
    out: dict[str, Any] = {}
    for name, column in wanted.items():
        got = parts[name]
        leaf = footers[0].leaves[column]
        if leaf.physical == _BYTE_ARRAY:
            raw = Ragged.from_list([bytes(v) if v is not None else b"" for part in got for v in part], kind="bytes")
            out[name] = Ragged(raw.values, raw.offsets, "str" if leaf.is_string else "bytes")
            continue
        nulls = sum(int(p.mask.sum()) for p in got if isinstance(p, np.ma.MaskedArray))
        if nulls:
            raise FormatError(f"column {column!r} has {nulls} null values; gpuio keeps numbers as arrays "
                              f"without nulls", path=footers[0].path)
        out[name] = np.concatenate([np.asarray(p) for p in got]) if got else np.zeros(0)
    return out, read


def _check_utf8(parts: list[list[Any]]) -> None:
    for part in parts:
        for k, v in enumerate(part):
            try:
                if v is not None:
                    bytes(v).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _Bad(f"a string value ({k} of its page) is not UTF-8: {exc.reason}", 0) from None


def _chunk_values(buf: np.ndarray, leaf: _Leaf, codec: str | None) -> list[Any]:
    """The values of one column chunk (``buf``: its bytes), one part per data page: a
    list of byte views (``None`` for a null) or an array (masked where null)."""
    if leaf.physical not in (*_NUMBERS, _BOOLEAN, _BYTE_ARRAY):
        raise _Bad(f"physical type {leaf.physical} is not read (numbers, booleans and byte arrays are)", 0)

    def read(k: int, at: int) -> bytes:
        return bytes(buf[at: at + k])

    decoder = _ChunkDecoder(codec, leaf.max_def, leaf.physical)
    pos, out = 0, []
    while pos < len(buf):
        page = _page_at(read, pos, len(buf))
        pos = page.end
        if page.kind == _DICTIONARY_PAGE:
            decoder.dictionary = decoder.plain(decoder.body(buf, page), page.values, page.body)
        elif page.kind in (_DATA_PAGE, _DATA_PAGE_V2):
            present, values = decoder.page_values(buf, page)
            if leaf.physical == _BYTE_ARRAY:
                it = iter(values)
                out.append([next(it) if p else None for p in present.tolist()])
            else:
                full = np.zeros(len(present), dtype=np.asarray(values).dtype)
                full[present] = values
                out.append(full if present.all() else np.ma.MaskedArray(full, ~present))
    return out


def hf_features(raw: bytes | None) -> dict[str, Any]:
    """The ``features`` of a ``huggingface`` schema metadata value (JSON), ``{}`` if none."""
    try:
        features = json.loads(raw).get("info", {}).get("features", {}) if raw else {}
    except (ValueError, AttributeError):
        return {}
    return features if isinstance(features, dict) else {}


def hf_meta(features: dict[str, Any], columns: Mapping[str, str], binary: Sequence[str]) -> dict[str, Any]:
    """``index.meta`` entries from ``datasets`` features: ``images`` (the fields of
    ``binary`` in an ``Image()`` column) and ``class_names`` (``{field: ClassLabel
    names}``); ``columns``: ``{field: column path}``."""
    def kind(column: str) -> Any:
        top = features.get(column.split(".")[0])
        return top if isinstance(top, dict) else {}

    images = [n for n, c in columns.items() if n in binary and kind(c).get("_type") == "Image"]
    names = {n: [str(x) for x in kind(c)["names"]] for n, c in columns.items()
             if "." not in c and kind(c).get("_type") == "ClassLabel" and isinstance(kind(c).get("names"), list)}
    return {"images": images, "class_names": names}


# ---- the parse step: values out of compressed or dictionary-encoded pages -------------

class PageParser(Parser):
    """Turns the page units of ``source`` (see the module docstring) into the values of
    ``field``: uint8 arrays (a null value: empty). Each page is decompressed once per
    batch, however many of its values the batch holds. ``codecs``: each Parquet file's
    codec of the column (pyarrow's name, ``None``: uncompressed); a record of any other
    file (a decompressed copy of dictionary chunks, an image a row's ``path`` names) is
    the value itself."""

    name = "parquet.page"

    def __init__(self, field: str, source: str, codecs: dict[str, str | None], max_def: int) -> None:
        self.field, self.source, self.codecs, self.max_def = field, source, dict(codecs), max_def
        self.fields = (field,)

    def config(self) -> dict[str, Any]:
        return {"field": self.field, "source": self.source, "codecs": self.codecs, "max_def": self.max_def}

    def parse(self, records: Sequence[np.ndarray], samples: np.ndarray, paths: Sequence[str],
              offsets: np.ndarray) -> dict[str, list[Any]]:
        pages: dict[tuple[str, int], tuple[_Page, np.ndarray, np.ndarray, Any]] = {}  # each decoded once a batch
        out = []
        for j, record in enumerate(records):
            key = (paths[j], int(offsets[j]))
            if key[0] not in self.codecs:
                out.append(record)
                continue
            try:
                if key not in pages:
                    page = _page_at(lambda k, at: bytes(record[at: at + k]), 0, len(record))
                    if page.kind not in (_DATA_PAGE, _DATA_PAGE_V2):
                        raise _Bad(f"the page header says a page of type {page.kind}, not a data page", 0)
                    present, values = _ChunkDecoder(self.codecs[key[0]], self.max_def).page_values(record, page)
                    pages[key] = page, present, np.cumsum(present) - 1, values  # a set row's place in values
                page, present, place, values = pages[key]
                row = len(record) - page.end
                if not 0 <= row < page.values:
                    raise _Bad(f"the page header says a page ending at byte {page.end} with {page.values} values, "
                               f"its extent {len(record)} bytes: a page header that lies, or an index made for "
                               f"another file", 0)
                out.append(values[place[row]] if present[row] else record[:0])
            except _Bad as exc:
                raise FormatError(f"column {self.field!r}, page at byte {key[1]}: {exc.args[0]}",
                                  path=paths[j], sample=int(samples[j]), offset=key[1] + exc.args[1]) from None
        return {self.field: out}


class _ChunkDecoder:
    """Decodes the pages of one column chunk (of physical type ``physical``); a
    dictionary-encoded page needs ``dictionary`` set first."""

    def __init__(self, codec: str | None, max_def: int, physical: int = _BYTE_ARRAY) -> None:
        self.codec, self.max_def, self.physical = codec, max_def, physical
        self.dictionary: Any = None

    def body(self, record: np.ndarray, page: _Page, skip: int = 0) -> np.ndarray:
        """The page's body after its first ``skip`` bytes (the v2 levels), decompressed."""
        body = record[page.body + skip: page.end]
        compressed = self.codec is not None and (page.kind != _DATA_PAGE_V2 or page.sub.get(7, True))
        if not compressed:
            return body
        try:
            import pyarrow as pa
        except ImportError as exc:
            raise DependencyError(f"{self.codec}-compressed Parquet pages are decompressed with pyarrow: "
                                  f"pip install pyarrow") from exc
        size = page.header.get(2, 0) - skip
        try:
            out = pa.decompress(body, decompressed_size=size, codec=self.codec, asbytes=False)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _Bad(f"cannot decompress the page ({self.codec}, {len(body)} bytes to {size}): {exc}",
                       page.body) from None
        return np.frombuffer(out, dtype=np.uint8)

    def plain(self, body: np.ndarray, count: int, at: int) -> Any:
        """``count`` PLAIN values from the start of ``body``: byte arrays as a list of
        views, numbers as an array."""
        if self.physical == _BYTE_ARRAY:
            return _plain_byte_arrays(body, count, at)
        if self.physical == _BOOLEAN:
            if (count + 7) // 8 > len(body):
                raise _Bad(f"{count} booleans in {len(body)} bytes", at)
            return np.unpackbits(body[: (count + 7) // 8], bitorder="little")[:count].astype(bool)
        dtype = _NUMBERS[self.physical]
        if count * dtype.itemsize > len(body):
            raise _Bad(f"{count} values of {dtype.itemsize} bytes in {len(body)} bytes", at)
        return body[: count * dtype.itemsize].view(dtype)

    def page_values(self, record: np.ndarray, page: _Page) -> tuple[np.ndarray, Any]:
        """A data page's ``(which rows are set, their values)``."""
        if page.kind == _DATA_PAGE_V2:
            levels_len = page.sub.get(6, 0) + page.sub.get(5, 0)
            levels = record[page.body + page.sub.get(6, 0): page.body + levels_len]
            body, pos = self.body(record, page, levels_len), 0
        else:
            body = self.body(record, page)
            if self.max_def:
                if len(body) < 4:
                    raise _Bad("the page's levels are cut short", page.body)
                (m,) = struct.unpack_from("<I", body, 0)
                levels, pos = body[4: 4 + m], 4 + m
            else:
                levels, pos = body[:0], 0
        present = _present(levels, self.max_def, page.values, page.body)
        count = int(present.sum())
        if page.encoding == _PLAIN:
            return present, self.plain(body[pos:], count, page.body)
        if page.encoding not in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
            raise _Bad(f"data page encoding {page.encoding} is not read (PLAIN and dictionary are)", page.start)
        if self.dictionary is None:
            raise _Bad("a dictionary-encoded page without a dictionary page before it", page.start)
        if count and pos >= len(body):
            raise _Bad("the page's dictionary indices are missing", page.body)
        idx = _hybrid(body, pos + 1, len(body), int(body[pos]), count, page.body) if count else np.zeros(0, np.int64)
        if count and (idx.min() < 0 or idx.max() >= len(self.dictionary)):
            raise _Bad(f"a dictionary index past the dictionary's {len(self.dictionary)} values", page.body)
        if self.physical == _BYTE_ARRAY:
            return present, [self.dictionary[i] for i in idx.tolist()]
        return present, self.dictionary[idx]


def _plain_byte_arrays(body: np.ndarray, count: int, at: int) -> list[np.ndarray]:
    """``count`` PLAIN byte arrays (u32 length, bytes) from the start of ``body``, as views."""
    out, pos, n = [], 0, len(body)
    for _ in range(count):
        if pos + 4 > n:
            raise _Bad(f"the page's values end after {len(out)} of {count}", at)
        (m,) = struct.unpack_from("<I", body, pos)
        if pos + 4 + m > n:
            raise _Bad(f"a value of {m} bytes runs past its page", at)
        out.append(body[pos + 4: pos + 4 + m])
        pos += 4 + m
    return out
