"""gpuio's packed layout (``gpuio pack`` writes it): shards of aligned records and an
``index.json`` that needs no listing.

A packed dataset is a folder (or an ``s3://`` / ``http(s)://`` prefix) holding
``index.json`` and shards named in it (``shard-00000.gpk`` ...). A shard is:

- a 64-byte header, little-endian: ``magic`` (8 bytes, ``GPUIOPK1``), ``version``
  (uint32), ``fields`` (uint32: extent fields per sample), ``samples`` (uint64),
  ``table_offset``, ``values_offset``, ``values_bytes`` and ``data_offset`` (uint64,
  bytes from the shard's start), zero padding;
- the record table at ``table_offset``: uint64 ``[samples, fields, 2]``, each record's
  byte offset (from the shard's start) and length, fields in ``index.json``'s order;
- the value columns at ``values_offset``: per value field, in ``index.json``'s order,
  the shard's rows as NumPy ``.npy`` arrays (a dense field one array; a ragged field its
  values, then its offsets from 0), back to back;
- the records from ``data_offset`` (a 4 KiB boundary), in sample order, each sample's
  fields in order. A record of ``ALIGN_FROM`` (32 KiB) or more starts on a 4 KiB
  boundary; no record crosses a ``BLOCK`` (4 MiB) boundary unless it is longer than a
  block, and then it starts on one. So O_DIRECT and cuFile read a large record with no
  bounce buffer, and one of kvikio's tasks holds it whole. Padding that these rules ask
  for is filled with records from a little further on (``place``: at most ``WINDOW``
  records ahead, so a batch's records stay near each other), and a smaller record may sit
  in the padding before the aligned record that precedes it. The record table says
  where each record is; readers need no order. Gaps are zeros.

``index.json`` holds the schema (extent fields; value fields with their kind, dtype and
row shape; the parser a TFRecord's fields come from; the fields that hold images), the
shards (name, samples, bytes, CRC-32C of the whole file), the source's metadata (class
names, field decoders), the options it was packed with and the source it came from.
An image field packed with restart markers has a field ``<field>.restarts``
(``gpuio.ops.restart.restarts_field``): per sample the byte offsets (uint32
little-endian, from the image's first byte) of each restart interval's first
entropy-coded byte, interval 0 included (empty for an image without markers), which the
fused CPU decode reads to decode a crop from the intervals it covers.
"""

from __future__ import annotations

import io
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from gpuio.errors import ConfigError, FormatError
from gpuio.formats._files import each_shard, full_path, open_regular_file
from gpuio.index import Extents, PathTable, Ragged, SampleIndex, parser_from_config
from gpuio.storage.remote import is_url, object_versions

__all__ = ["packed"]

MAGIC = b"GPUIOPK1"
VERSION = 1
HEADER = struct.Struct("<8sIIQQQQQ")
HEADER_BYTES = 64
PAGE = 4 << 10  # records of ALIGN_FROM bytes and more start on a page boundary
ALIGN_FROM = 32 << 10
BLOCK = 4 << 20  # no record crosses a block boundary (a longer record starts on one)
WINDOW = 16  # records after the one being placed that may move forward into its padding
INDEX_NAME = "index.json"
FORMAT_NAME = "gpuio.packed"


class Header(NamedTuple):
    """A shard's header (see the module docstring); offsets in bytes."""

    fields: int
    samples: int
    table_offset: int
    values_offset: int
    values_bytes: int
    data_offset: int

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, *self).ljust(HEADER_BYTES, b"\0")


def align(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def _start(at: int, n: int) -> int:
    """Where a record of ``n`` bytes goes at the earliest from byte ``at``, by the alignment
    rules of the module docstring."""
    first = align(at, PAGE) if n >= ALIGN_FROM else at
    if n and first // BLOCK != (first + n - 1) // BLOCK:  # it would cross a block boundary
        first = align(first, BLOCK)
    return first


def place(lengths: np.ndarray, start: int, window: int = WINDOW) -> np.ndarray:
    """Where records of ``lengths`` bytes go from byte ``start`` (a block boundary or
    later), by the alignment rules of the module docstring: in order, except that padding
    is filled from the ``window`` records after the one being placed. A record shorter
    than ``ALIGN_FROM`` goes into the padding left before the last aligned record where it
    fits there; the end of a block that the next record does not fit is filled with the
    records of the window that fit, the one that leaves the least space first; the
    padding before an aligned record goes to the small record of the window after which
    it pads the least, where that is less than it would pad now."""
    sizes = lengths.tolist()
    n = len(sizes)
    offsets = np.full(n, -1, dtype=np.int64)
    at = start
    gap = (start, start)  # the free bytes before the last aligned record (within one block)

    def put(k: int, first: int) -> None:
        nonlocal at, gap
        if first > at:
            gap = (at, first)
        offsets[k] = first
        at = first + sizes[k]

    for k, size in enumerate(sizes):
        if offsets[k] >= 0:  # moved forward into padding
            continue
        if size < ALIGN_FROM and gap[1] - gap[0] >= size:
            offsets[k] = gap[0]
            gap = (gap[0] + size, gap[1])
            continue
        first = _start(at, size)
        ahead = [j for j in range(k + 1, min(n, k + 1 + window)) if offsets[j] < 0]
        if first > at and first % BLOCK == 0:  # the rest of the block: records of the window that fit
            while True:
                fits = [(-(_start(at, sizes[j]) + sizes[j]), j) for j in ahead
                        if offsets[j] < 0 and _start(at, sizes[j]) + sizes[j] <= first]
                if not fits:
                    break
                j = min(fits)[1]
                put(j, _start(at, sizes[j]))
        elif first > at:  # page padding: a small record before it that leaves less
            pads = [(_start(at + sizes[j], size) - at - sizes[j], j) for j in ahead
                    if sizes[j] < ALIGN_FROM and _start(at, sizes[j]) == at]
            if pads and min(pads)[0] < first - at:
                put(min(pads)[1], at)
        put(k, _start(at, size))
    return offsets


def value_schema(col: np.ndarray | Ragged) -> dict[str, Any]:
    """How a value column is described in ``index.json``."""
    if isinstance(col, Ragged):
        return {"kind": col.kind, "dtype": col.values.dtype.str, "row_shape": list(col.values.shape[1:])}
    return {"kind": "dense", "dtype": col.dtype.str, "row_shape": list(col.shape[1:])}


def values_blob(values: dict[str, np.ndarray | Ragged]) -> bytes:
    """A shard's value columns as ``.npy`` arrays back to back (see the module docstring)."""
    out = io.BytesIO()
    for col in values.values():
        parts = [col.values, col.offsets - col.offsets[0]] if isinstance(col, Ragged) else [col]
        for part in parts:
            np.lib.format.write_array(out, np.ascontiguousarray(part), allow_pickle=False)
    return out.getvalue()


def read_header(head: bytes, path: str) -> Header:
    """The header of the shard ``path`` from its first bytes, checked."""
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise FormatError(f"not a gpuio packed shard: it starts with {head[:8]!r}, expected {MAGIC!r}",
                          path=path, offset=0)
    magic, version, *rest = HEADER.unpack_from(head)
    if version != VERSION:
        raise FormatError(f"packed shard version {version}, this gpuio reads version {VERSION}", path=path, offset=8)
    return Header(*rest)


def read_json(path: str) -> dict[str, Any]:
    """``index.json`` of a packed dataset (a local path or a URL), checked to be one."""
    f, size = open_regular_file(path, "packed index")
    with f:
        raw = f.read(size)
    try:
        spec = json.loads(raw)
    except ValueError as exc:
        raise FormatError(f"not the JSON gpuio pack writes: {exc}", path=path) from None
    if not isinstance(spec, dict) or spec.get("format") != FORMAT_NAME:
        raise FormatError(f"not a gpuio packed index (no \"format\": \"{FORMAT_NAME}\")", path=path, offset=0)
    if spec.get("version") != VERSION:
        raise FormatError(f"packed index version {spec.get('version')}, this gpuio reads version {VERSION}",
                          path=path)
    return spec


def join(base: str, name: str) -> str:
    """``name`` inside the packed dataset at ``base`` (a folder or a URL prefix)."""
    return f"{base.rstrip('/')}/{name}" if is_url(base) else os.path.join(base, name)


class Shard(NamedTuple):
    """What a shard's table and value columns hold: per record offset and length
    (``[samples, fields]`` each) and the value columns of its rows."""

    offset: np.ndarray
    length: np.ndarray
    values: dict[str, np.ndarray | Ragged]


def read_shard_meta(path: str, spec: dict[str, Any], samples: int) -> Shard:
    """The table and value columns of the shard ``path``, checked against ``spec``
    (``index.json``) and its ``samples``."""
    f, size = open_regular_file(path, "packed shard")
    with f:
        head = f.read(HEADER_BYTES)
        h = read_header(head, path)
        nfields = len(spec["extents"])
        if h.fields != nfields or h.samples != samples:
            raise FormatError(f"the shard holds {h.samples} samples of {h.fields} fields, index.json says "
                              f"{samples} of {nfields}", path=path, offset=0)
        table_bytes = h.samples * h.fields * 16
        end = h.values_offset + h.values_bytes
        if (h.table_offset < HEADER_BYTES or h.table_offset + table_bytes > h.values_offset
                or end > h.data_offset or h.data_offset > size):
            raise FormatError(f"the header's regions (table at {h.table_offset}, values at {h.values_offset}, "
                              f"{h.values_bytes} bytes, data at {h.data_offset}) do not fit the shard's "
                              f"{size} bytes in order", path=path, offset=0)
        f.seek(h.table_offset)
        meta = f.read(end - h.table_offset)
    table = np.frombuffer(meta, dtype="<u8", count=table_bytes // 8).reshape(h.samples, h.fields, 2)
    offset, length = table[..., 0].astype(np.int64), table[..., 1].astype(np.int64)
    bad = (offset < h.data_offset) | (offset + length > size)
    if bad.any():
        k = int(np.flatnonzero(bad.any(axis=1))[0])
        raise FormatError(f"sample {k}'s records lie outside the data region ({h.data_offset}..{size})",
                          path=path, offset=h.table_offset + k * h.fields * 16)
    blob = io.BytesIO(meta[h.values_offset - h.table_offset:])
    values: dict[str, np.ndarray | Ragged] = {}
    try:
        for name, schema in spec["values"].items():
            first = np.lib.format.read_array(blob, allow_pickle=False)
            if schema["kind"] == "dense":
                values[name] = first
            else:
                offsets = np.lib.format.read_array(blob, allow_pickle=False)
                values[name] = Ragged(first, offsets, schema["kind"])
    except (ValueError, EOFError) as exc:
        raise FormatError(f"the value columns do not read back as .npy arrays: {exc}", path=path,
                          offset=h.values_offset) from None
    for name, col in values.items():
        n = len(col.offsets) - 1 if isinstance(col, Ragged) else len(col)
        if n != samples:
            raise FormatError(f"value field {name!r} has {n} rows, the shard {samples} samples", path=path,
                              offset=h.values_offset)
    return Shard(offset, length, values)


def packed(path: str | os.PathLike[str]) -> SampleIndex:
    """Index a dataset written by ``gpuio pack``: ``path`` is its folder, an ``s3://`` or
    ``http(s)://`` prefix, or its ``index.json``. Reads ``index.json`` and each shard's
    header, record table and value columns (no listing); every field of the source
    comes back, with its metadata (``index.meta``: the source's, plus ``format``
    ``"packed"``, ``images``, ``options`` and ``source``)."""
    path = full_path(path)
    base = path[: -len(INDEX_NAME) - 1] if path.endswith("/" + INDEX_NAME) else path
    spec = read_json(join(base, INDEX_NAME))
    try:
        shards = spec["shards"]
        names, counts = [s["name"] for s in shards], [int(s["samples"]) for s in shards]
        extent_names, value_specs = list(spec["extents"]), dict(spec["values"])
    except (KeyError, TypeError) as exc:
        raise FormatError(f"incomplete packed index (no {exc})", path=join(base, INDEX_NAME)) from None
    if not names:
        raise FormatError("the packed index names no shards", path=join(base, INDEX_NAME))
    paths = [join(base, name) for name in names]
    jobs = list(zip(paths, counts))

    def one(job: tuple[str, int], advance: Any = None) -> Shard:
        return read_shard_meta(job[0], spec, job[1])

    if is_url(base):  # one GET or two per shard, many in flight
        with ThreadPoolExecutor(16) as pool:
            parts = list(pool.map(one, jobs))
    else:
        parts = each_shard(one, jobs, "indexing packed shards", counts, unit="sample")
    files = np.repeat(np.arange(len(paths), dtype=np.int32), counts)
    extents = {name: Extents(files, np.concatenate([p.offset[:, k] for p in parts]),
                             np.concatenate([p.length[:, k] for p in parts]))
               for k, name in enumerate(extent_names)}
    values: dict[str, np.ndarray | Ragged] = {}
    for name, schema in value_specs.items():
        cols = [p.values[name] for p in parts]
        if schema["kind"] == "dense":
            values[name] = np.concatenate(cols)
        else:
            base_at = np.cumsum([0] + [len(c.values) for c in cols])
            values[name] = Ragged(np.concatenate([c.values for c in cols]),
                                  np.concatenate([[0]] + [c.offsets[1:] + base_at[k] for k, c in enumerate(cols)]),
                                  schema["kind"])
    parser = _parser(spec.get("parser"), join(base, INDEX_NAME))
    meta = {**spec.get("meta", {}), "format": "packed", "images": spec.get("images", []),
            "options": spec.get("options", {}), "source": spec.get("source", {}), **object_versions(paths)}
    try:
        return SampleIndex(PathTable.from_paths(paths), extents, values, parser, meta)
    except ConfigError as exc:
        raise FormatError(f"inconsistent packed index: {exc}", path=join(base, INDEX_NAME)) from exc


def _parser(saved: dict[str, Any] | None, path: str) -> Any:
    """The record parser ``index.json`` names, or None."""
    if not saved:
        return None
    try:
        return parser_from_config(saved["name"], saved.get("config", {}))
    except (KeyError, TypeError) as exc:
        raise FormatError(f"the packed index's parser entry lacks {exc}", path=path) from None
