"""Arrow IPC files, as ``datasets`` caches datasets (``save_to_disk``, the ``map`` cache:
``data-00000-of-00001.arrow``): one sample per row.

Both IPC layouts are read: the stream format that ``datasets`` writes (messages back to
back, no footer) and the file format (``ARROW1`` magic around the same stream). Fields
are the leaf columns, named by their path (``image.bytes``, ``image.path``, ``label``),
as ``formats.parquet`` names them. Binary columns are extent fields; a value's extent is
exact: its record batch body's offset in the file, plus its data buffer's offset in the
body, plus ``offsets[i]..offsets[i+1]``. Indexing reads the messages' metadata, the
binary columns' offset and validity buffers and the value columns (a local file is
memory-mapped, so the data buffers are never read); ``index.meta["index_bytes_read"]``
says how much. A remote file is read whole once through the node-local cache
(``formats._files.local_copy``: later reads of its blocks download nothing), since
Arrow's buffer layout is in flatbuffer metadata that pyarrow reads only with its body.

Compressed IPC bodies (LZ4/ZSTD buffers) cannot be read in place and are refused;
``datasets`` never writes them. A row whose image ``bytes`` is null and whose ``path``
is set reads that file, as in ``formats.parquet``. Needs pyarrow.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from gpuio.errors import ConfigError, DataError, DependencyError, FormatError
from gpuio.formats._files import each_shard, full_path, local_copy, open_regular_file, shard_paths, size_or_zero
from gpuio.formats.parquet import follow_paths, hf_features, hf_meta
from gpuio.index import Extents, PathTable, Ragged, SampleIndex
from gpuio.storage.remote import is_url, object_versions

__all__ = ["arrow"]

_FILE_MAGIC = b"ARROW1"


def arrow(paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
          fields: Sequence[str] | Mapping[str, str] | None = None) -> SampleIndex:
    """Index the rows of one or more Arrow IPC files (stream or file format; URLs,
    brace ranges and globs too), in file then row order.

    ``fields``: the leaf columns to index by path (``["image.bytes", "label"]``) or
    ``{name in the index: column path}``; default every leaf column that is not a list.
    ``index.meta``: ``images``, ``class_names`` (from the schema's ``huggingface``
    metadata), ``index_bytes_read`` and ``data_bytes``.
    """
    try:
        import pyarrow as pa
    except ImportError as exc:
        raise DependencyError("formats.arrow reads Arrow IPC metadata with pyarrow: pip install pyarrow") from exc
    paths = [full_path(p) for p in shard_paths(paths, "Arrow file")]
    if not paths:
        raise DataError("no samples: an empty list of Arrow files was given")
    first = _index_path(fields, None, paths[0], lambda n: None)
    wanted, features = first["_wanted"], first["_features"]
    # pyarrow's own threads make a forked pool unsafe: the files are indexed here, one by one
    parts = [first, *each_shard(functools.partial(_index_path, fields, wanted), paths[1:], "indexing Arrow files",
                                [size_or_zero(p) for p in paths[1:]], processes=False)]
    read, size = sum(p["_read"] for p in parts), sum(p["_size"] for p in parts)

    files = list(paths)
    counts = [p["_rows"] for p in parts]
    file_ids = np.repeat(np.arange(len(paths), dtype=np.int32), counts)
    extents, values = {}, {}
    binary = [n for n in wanted if parts[0][n][0] == "extent"]
    for name, column in wanted.items():
        if name in binary:
            offsets = np.concatenate([p[name][1] for p in parts])
            lengths = np.concatenate([p[name][2] for p in parts])
            ids = file_ids.copy()
            null = np.flatnonzero(offsets < 0)
            offsets[null] = 0
            targets = np.concatenate([p[name][3] for p in parts]) if len(null) else []
            ids = follow_paths(null, [targets[r] for r in null.tolist()], ids, lengths, files)
            extents[name] = Extents(ids, offsets, lengths)
        else:
            chunks = [c for p in parts for c in p[name][1]]
            values[name] = _value(pa, pa.chunked_array(chunks, type=chunks[0].type) if chunks else None, column,
                                  paths[0])
    meta = {"format": "arrow", "columns": dict(wanted), **hf_meta(features, wanted, binary),
            "index_bytes_read": int(read), "data_bytes": int(size), **object_versions(paths)}
    return SampleIndex(PathTable.from_paths(files), extents, values, meta=meta)


def _index_path(fields: Any, wanted: dict[str, str] | None, path: str, advance: Callable[[int], None]
                ) -> dict[str, Any]:
    import pyarrow as pa

    with _mapped(path) as buf:
        out = _index_file(pa, path, buf, fields, wanted)
    advance(out["_size"])
    return out


@contextlib.contextmanager
def _mapped(path: str) -> Iterator[Any]:
    """The file's bytes as a pyarrow buffer: memory-mapped (a remote object: its local
    copy, read whole through the cache)."""
    import pyarrow as pa

    if is_url(path):
        with local_copy(path, "Arrow file") as copy, pa.memory_map(copy) as mm:
            yield mm.read_buffer()
        return
    f, _ = open_regular_file(path, "Arrow file")  # the path's own checks and errors
    f.close()
    with pa.memory_map(path) as mm:
        yield mm.read_buffer()


def _leaves(pa: Any, schema: Any) -> dict[str, Any]:
    """``{dotted path: field}`` of the schema's leaf fields (structs opened)."""
    out: dict[str, Any] = {}

    def walk(field: Any, prefix: str) -> None:
        name = f"{prefix}{field.name}"
        if pa.types.is_struct(field.type):
            for child in field.type:
                walk(child, f"{name}.")
        else:
            out[name] = field

    for field in schema:
        walk(field, "")
    return out


def _is_binary(pa: Any, t: Any) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _index_file(pa: Any, path: str, buf: Any, fields: Any, wanted: dict[str, str] | None) -> dict[str, Any]:
    """One file's columns: per binary field ``("extent", offsets, lengths, path targets)``
    (offset -1: null), per value field ``("value", arrays)``; plus ``_rows``, ``_read``
    (bytes read), ``_size``, ``_wanted`` and ``_features``."""
    start = 8 if bytes(buf[:6]) == _FILE_MAGIC else 0
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(buf[start:]))
        messages = iter(reader)
        first = next(messages, None)
        if first is None or first.type != "schema":
            raise FormatError(f"not an Arrow IPC stream: its first message is {first.type if first else 'missing'}, "
                              f"not a schema", path=path, offset=start)
        schema = pa.ipc.read_schema(first)
        leaves = _leaves(pa, schema)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # a name that is not UTF-8
        raise FormatError(f"not an Arrow IPC stream or file: {exc}", path=path, offset=start) from None
    if wanted is None:
        wanted = _wanted(pa, fields, leaves, path)
    missing = [c for c in wanted.values() if c not in leaves]
    if missing:
        raise FormatError(f"columns {missing} are missing here (the first file has them)", path=path)
    features = hf_features((schema.metadata or {}).get(b"huggingface"))
    read = 8 + first.metadata.size
    out: dict[str, Any] = {n: ("extent", [], [], []) if _is_binary(pa, leaves[c].type) else ("value", [])
                           for n, c in wanted.items()}
    rows = k = 0
    base = buf.address
    last_end = start + read  # where the last message read ends
    while True:
        try:
            message = next(messages, None)
        except (pa.ArrowException, OSError) as exc:
            raise FormatError(f"record batch {k}: a message cut short or malformed ({exc})", path=path,
                              offset=last_end) from None
        if message is None:
            break
        read += 8 + message.metadata.size
        if message.type == "dictionary batch":
            raise ConfigError(f"{path}: dictionary-encoded columns are not indexed (record batch {k})")
        if message.type != "record batch":
            continue
        body_at = message.body.address - base
        try:
            batch = pa.ipc.read_record_batch(message, schema)
            batch.validate(full=True)  # offsets within their buffers, before any value is read
        except (pa.ArrowException, OSError) as exc:
            raise FormatError(f"record batch {k}: {exc}", path=path, offset=body_at) from None
        for name, column in wanted.items():
            array, null = _column(batch, column)
            if out[name][0] == "value":
                if null.any():  # nulls of a struct above it
                    import pyarrow.compute as pc

                    array = pc.if_else(pa.array(null), pa.scalar(None, array.type), array)
                out[name][1].append(array)
                read += sum(b.size for b in array.buffers() if b is not None)
                continue
            where = f"record batch {k}, column {column!r}"
            off, length, nbytes = _extents(pa, array, null, message.body, body_at, where, path)
            read += nbytes
            out[name][1].append(off)
            out[name][2].append(length)
            sibling = column[: -len("bytes")] + "path" if column.endswith(".bytes") else None
            if (off < 0).any() and sibling in leaves:
                out[name][3].append(np.array(_column(batch, sibling)[0].to_pylist(), dtype=object))
            else:
                out[name][3].append(np.full(len(off), None, dtype=object))
        rows += batch.num_rows
        k += 1
        last_end = body_at + message.body.size
    result: dict[str, Any] = {"_rows": rows, "_read": read, "_size": buf.size, "_wanted": wanted,
                              "_features": features}
    for name, part in out.items():
        if part[0] == "value":
            result[name] = part
        else:
            result[name] = ("extent", *(np.concatenate(p) if p else np.zeros(0, np.int64) for p in part[1:3]),
                            np.concatenate(part[3]) if part[3] else np.zeros(0, dtype=object))
    return result


def _wanted(pa: Any, fields: Any, leaves: dict[str, Any], path: str) -> dict[str, str]:
    nested = {c for c, f in leaves.items() if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
              or pa.types.is_fixed_size_list(f.type) or pa.types.is_map(f.type)}
    if fields is None:
        return {c: c for c in leaves if c not in nested}
    if isinstance(fields, str):
        fields = [fields]
    wanted = {str(k): str(v) for k, v in fields.items()} if isinstance(fields, Mapping) else {f: f for f in fields}
    unknown = [c for c in wanted.values() if c not in leaves]
    if unknown or not wanted:
        raise ConfigError(f"fields {unknown or 'none given'}; the columns of {path}: {list(leaves)}")
    lists = [c for c in wanted.values() if c in nested]
    if lists:
        raise ConfigError(f"columns {lists} are lists or maps; gpuio indexes one value per row")
    return wanted


def _column(batch: Any, column: str) -> tuple[Any, np.ndarray]:
    """The leaf ``column`` (a dotted path) of ``batch`` as stored (a struct's child array,
    its buffers untouched), and which rows are null in it or in a struct above it."""
    parts = column.split(".")
    array = batch.column(batch.schema.get_field_index(parts[0]))
    null = np.zeros(len(array), dtype=bool)
    for part in [*parts[1:], None]:
        if array.null_count:
            null |= ~np.asarray(array.is_valid())
        if part is not None:
            array = array.field(part)
    return array, null


def _extents(pa: Any, array: Any, null: np.ndarray, body: Any, body_at: int, where: str, path: str
             ) -> tuple[np.ndarray, np.ndarray, int]:
    """Offsets (in the file; -1: rows ``null``) and lengths of a binary array's values,
    and the bytes of its offset and validity buffers (what indexing reads of it)."""
    validity, offsets_buf, data = array.buffers()[:3]
    width = 8 if pa.types.is_large_binary(array.type) else 4
    n = len(array)
    if offsets_buf is None or data is None:
        return np.full(n, -1, np.int64), np.zeros(n, np.int64), 0
    for b in (offsets_buf, data):
        if b.size and not body.address <= b.address <= b.address + b.size <= body.address + body.size:
            raise ConfigError(f"{path}: {where}: its buffers are not stored as they are (a compressed IPC body, "
                              f"LZ4 or ZSTD); write the file uncompressed")
    offsets = np.frombuffer(offsets_buf, dtype=f"<i{width}", count=n + 1 + array.offset)[array.offset:].astype(np.int64)
    if len(offsets) and ((np.diff(offsets) < 0).any() or offsets[0] < 0 or offsets[-1] > data.size):
        raise FormatError(f"{where}: its offsets do not rise within its {data.size}-byte data buffer",
                          path=path, offset=body_at + offsets_buf.address - body.address)
    start = body_at + (data.address - body.address if data.size else 0) + offsets[:-1]
    length = np.diff(offsets)
    start[null], length[null] = -1, 0
    return start, length, offsets_buf.size + (validity.size if validity is not None else 0)


def _value(pa: Any, column: Any, name: str, path: str) -> Any:
    if column is None:
        return np.zeros(0)
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return Ragged.from_list([s or "" for s in column.to_pylist()], kind="str")
    if column.null_count:
        raise FormatError(f"column {name!r} has {column.null_count} null values; gpuio keeps numbers as arrays "
                          f"without nulls", path=path)
    return column.to_numpy()
