"""LitData datasets (``litdata.optimize`` output): ``index.json`` and its chunk files.

``index.json`` holds ``chunks`` (each ``filename``, ``chunk_size``: items, ``chunk_bytes``:
bytes on disk) and ``config``: ``data_format`` (one LitData serializer name per leaf of
the sample's pytree), ``data_spec`` (the pytree's structure, as torch's
``treespec_dumps`` writes it), ``compression`` and ``compression_level``. A chunk is
``uint32 n``, ``uint32 offsets[n + 1]`` (byte positions of the items), then the items;
an item is one ``uint32`` size per leaf, then the leaves. Integers are little-endian.

An uncompressed chunk is read in place: the extent field ``__item__`` is an item's bytes
as stored, found from the chunk's offsets table alone (indexing reads ``index.json`` and
each chunk's header), and the parser (``LitDataParser``) splits it into the leaves after
the read, each a field named by its path in the pytree (``image``, ``boxes.0``; a
sample that is one leaf: ``data``): ``jpeg``, ``image:<ext>``, ``bytes`` and ``file``
leaves as uint8 views into the batch buffer (``decode_image`` decodes the images),
``numpy``/``no_header_numpy``/``tensor``/``no_header_tensor`` as array views, ``pil`` as
an ``HWC`` uint8 array, ``int``/``float``/``bool``/``str`` as values.

A compressed chunk (``zstd`` whole-file, per batch of items or per item) decodes only
through its frames, and its items' positions are inside them: each chunk is
decompressed once, at indexing, into ``<cache_dir>/litdata/`` (reused while the
source's size and mtime or ETag are unchanged) and the copy is indexed as above;
``meta["decompressed_from"]`` lists the sources.

Pickled leaves (``pickle``, ``graph:pickle``) are refused unless ``allow_pickle=True``:
loading a pickle runs code. Leaves gpuio does not decode (``json``, ``video``, ``audio``
...), Arrow-row chunks and encrypted chunks are refused, naming the leaf or the setting.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpuio.errors import ConfigError, DataError, FormatError
from gpuio.formats._files import each_shard, full_path, shard_paths
from gpuio.formats.mds import (closing_file, decompress, decompressed_copy, jpeg_array_items, open_exact, pil_pixels,
                               read_at)
from gpuio.index import Extents, Parser, PathTable, SampleIndex
from gpuio.storage.remote import object_versions

__all__ = ["litdata", "LitDataParser"]

ITEM_FIELD = "__item__"
# LitData's dtype codes: no_header_numpy:N (NumPy's scalar types in its order) and no_header_tensor:N / tensor
_NUMPY_CODES = ("<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16", "|b1")
_TORCH_CODES = {0: "<f4", 1: "<f4", 2: "<f8", 3: "<f8", 4: "<c8", 5: "<c8", 6: "<c16", 7: "<c16", 8: "<f2",
                9: "<f2", 11: "<u1", 12: "<i1", 13: "<i2", 14: "<i2", 15: "<i4", 16: "<i4", 17: "<i8", 18: "<i8",
                19: "|b1", 20: "<u2"}
_BYTES = ("bytes", "jpeg", "image", "file")
_VALUES = {"int": "<i8", "float": "<f8"}
_PICKLED = ("pickle", "graph:pickle")
_FRAMED_MAGIC = b"LDFZ01\0\0"
_FRAMED_PREFIX = struct.Struct("<8sHHIII")  # magic, version, flags, items, items per frame, frames
_FRAME = struct.Struct("<IIQII")  # first item, items, file offset, compressed bytes, decompressed bytes


def litdata(roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], allow_pickle: bool = False
            ) -> SampleIndex:
    """Index one or more LitData datasets (folders holding ``index.json``; local paths,
    ``s3://`` or ``http(s)://`` URLs, brace ranges and globs), concatenated in order.

    Fields: ``__item__`` (each item's bytes as stored) and, parsed after the read, every
    leaf of the sample under its pytree path. ``index.meta``: ``leaves`` (field ->
    LitData format), ``images`` (the ``jpeg`` and ``image`` leaves, which ``decode_image()``
    finds), ``index_bytes_read`` (bytes indexing read), ``chunks``.
    """
    roots = [full_path(r).rstrip("/") for r in shard_paths(roots, "LitData dataset folder")]
    if not roots:
        raise DataError("no samples: an empty list of LitData dataset folders was given")
    chunks, leaves, bytes_read = [], None, 0
    for root in roots:
        cfg, listed, n = _index_json(root)
        bytes_read += n
        mine = _leaves(cfg, root, allow_pickle)
        if leaves is not None and mine != leaves:
            raise FormatError(f"its leaves {mine} differ from {leaves} of the datasets before it: one index needs "
                              f"one sample structure", path=root + "/index.json")
        leaves = mine
        codec = _codec(cfg, root)
        chunks += [(root, k, c, codec) for k, c in enumerate(listed)]
    found = each_shard(_index_chunk, chunks, "indexing LitData chunks", [c.get("chunk_bytes") or 0
                                                                          for _, _, c, _ in chunks])
    paths = [p for p, _, _, _ in found]
    counts = [len(o) - 1 for _, o, _, _ in found]
    files = np.repeat(np.arange(len(paths), dtype=np.int32), counts)
    starts = np.concatenate([o[:-1] for _, o, _, _ in found])
    lengths = np.concatenate([np.diff(o) for _, o, _, _ in found])
    meta: dict[str, Any] = {"format": "litdata", "leaves": dict(leaves), "chunks": len(paths),
                            "images": [n for n, f in leaves.items() if f.split(":", 1)[0] in ("jpeg", "image")],
                            "index_bytes_read": int(bytes_read + sum(n for _, _, n, _ in found))}
    sources = [src for _, _, _, src in found]
    if any(src is not None for src in sources):
        meta["decompressed_from"] = sources
    else:
        meta.update(object_versions(paths))
    return SampleIndex(PathTable.from_paths(paths), {ITEM_FIELD: Extents(files, starts, lengths)},
                       parser=LitDataParser([list(c) for c in leaves.items()], allow_pickle), meta=meta)


def _index_json(root: str) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """``(config, chunk entries, bytes read)`` of ``root``'s ``index.json``, checked."""
    path = root + "/index.json"
    f, size = open_exact(path, "LitData index.json")
    with closing_file(f):
        text = read_at(path, size, 0, f)
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise FormatError(f"index.json is not JSON ({exc})", path=path, offset=0) from None
    cfg = obj.get("config") if isinstance(obj, dict) else None
    chunks = obj.get("chunks") if isinstance(obj, dict) else None
    if not isinstance(cfg, dict) or not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
        raise FormatError("index.json has no 'config' and list of 'chunks' (litdata.optimize writes both)",
                          path=path, offset=0)
    for k, c in enumerate(chunks):
        if not isinstance(c.get("filename"), str) or not isinstance(c.get("chunk_size"), int):
            raise FormatError(f"chunk {k} has no filename and chunk_size", path=path, sample=f"chunk {k}")
    for key, why in (("encryption", "encrypted chunks"), ("ipc_compression", "Arrow IPC rows")):
        if cfg.get(key):
            raise FormatError(f"the dataset has {why} ({key}={cfg[key]!r}), which gpuio does not read", path=path)
    if cfg.get("item_loader", "PyTreeLoader") != "PyTreeLoader":
        raise FormatError(f"item_loader {cfg['item_loader']!r}: gpuio reads the items of LitData's default "
                          f"PyTreeLoader", path=path)
    return cfg, chunks, size


def _codec(cfg: dict[str, Any], root: str) -> str | None:
    """``None``, or how the chunks are compressed: ``zstd`` (whole file), ``zstd:batch``
    (frames of items), ``zstd:sample`` (each item)."""
    compression = cfg.get("compression")
    if not compression:
        return None
    name = str(compression).split(":", 1)[0]
    if name != "zstd":
        raise FormatError(f"compression {compression!r}; gpuio reads LitData's zstd", path=root + "/index.json")
    level = cfg.get("compression_level") or "chunk"
    return "zstd" if level == "chunk" else f"zstd:{level}"


def _leaves(cfg: dict[str, Any], root: str, allow_pickle: bool) -> dict[str, str]:
    """``{field: LitData format}`` of the sample's leaves, in the order items store them."""
    path = root + "/index.json"
    formats = cfg.get("data_format")
    if not isinstance(formats, list) or not formats:
        raise FormatError("config has no data_format", path=path)
    try:
        names = _leaf_names(json.loads(cfg["data_spec"])[1]) if cfg.get("data_spec") else ["data"]
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise FormatError(f"config's data_spec is not a pytree spec ({exc})", path=path) from None
    if len(names) != len(formats):
        raise FormatError(f"data_spec has {len(names)} leaves, data_format {len(formats)}", path=path)
    if ITEM_FIELD in names:
        raise FormatError(f"a leaf is named {ITEM_FIELD!r}, the name of gpuio's own field", path=path)
    for name, fmt in zip(names, formats):
        if fmt in _PICKLED and not allow_pickle:
            raise ConfigError(f"leaf {name!r} is pickled (LitData format {fmt!r}), and loading a pickle runs code: "
                              f"pass allow_pickle=True if you trust {root}")
        if _kind(fmt) is None:
            raise FormatError(f"leaf {name!r} has LitData format {fmt!r}, which gpuio does not decode", path=path)
    return dict(zip(names, formats))


def _leaf_names(spec: dict[str, Any], prefix: str = "") -> list[str]:
    """The paths of a pytree spec's leaves (``a.b``, ``boxes.0``), in flattening order."""
    children = spec["children_spec"]
    if spec["type"] is None:
        return [prefix or "data"]
    if spec["type"] in ("builtins.dict", "collections.OrderedDict"):
        keys = [str(k) for k in json.loads(spec["context"])]
    else:
        keys = [str(i) for i in range(len(children))]
    out = []
    for key, child in zip(keys, children):
        out += _leaf_names(child, f"{prefix}.{key}" if prefix else key)
    return out


def _kind(fmt: str) -> str | None:
    """How a LitData format decodes: its family, or ``None`` where gpuio does not."""
    base, _, arg = fmt.partition(":")
    if fmt in _PICKLED:
        return "pickle"
    if base in _BYTES or base in _VALUES or base in ("str", "text", "bool", "pil", "jpeg_array", "numpy", "tensor"):
        return base
    if base == "no_header_numpy" and arg.isdigit() and int(arg) < len(_NUMPY_CODES):
        return base
    if base == "no_header_tensor" and arg.isdigit() and int(arg) in _TORCH_CODES:
        return base
    return None


def _index_chunk(item: tuple[str, int, dict[str, Any], str | None], advance: Callable[[int], None]
                 ) -> tuple[str, np.ndarray, int, str | None]:
    """``(path of the uncompressed chunk, item offsets (n + 1), bytes read, compressed
    source or None)`` of one chunk entry."""
    root, k, c, codec = item
    path = root + "/" + c["filename"]
    source, read = None, 0
    if codec is not None:
        source = path
        path, read = decompressed_copy(source, "litdata", functools.partial(_unzip_chunk, source, codec))
    offsets, n = _chunk_offsets(path, c, k)
    advance(int(c.get("chunk_bytes") or 0))
    return path, offsets, read + n, source


def _chunk_offsets(path: str, c: dict[str, Any], k: int) -> tuple[np.ndarray, int]:
    """The ``n + 1`` item offsets of an uncompressed chunk, checked against its size and
    its ``index.json`` entry; and the bytes read for them."""
    where = {"path": path, "sample": f"chunk {k}"}
    f, size = open_exact(path, "LitData chunk")
    with closing_file(f):
        head = read_at(path, 8, 0, f)
        if head.startswith(_FRAMED_MAGIC[:4]):
            raise FormatError("a zstd-framed chunk in a dataset whose index.json says it is not compressed",
                              offset=0, **where)
        if len(head) < 8:
            raise FormatError(f"truncated chunk: {size} bytes, not even its item count and first offset",
                              offset=0, **where)
        n = int(np.frombuffer(head[:4], "<u4")[0])
        if n != c["chunk_size"]:
            raise FormatError(f"the chunk holds {n} items, index.json says {c['chunk_size']}", offset=0, **where)
        table = read_at(path, 4 * (n + 1), 4, f)
    if len(table) < 4 * (n + 1):
        raise FormatError(f"truncated chunk: {size} bytes end inside the table of {n + 1} item offsets",
                          offset=size, **where)
    offsets = np.frombuffer(table, "<u4").astype(np.int64)
    rises = np.diff(offsets) >= 0
    if offsets[0] != 8 + 4 * n or not rises.all() or offsets[-1] > size:
        bad = 0 if offsets[0] != 8 + 4 * n else int(np.flatnonzero(~rises)[0]) + 1 if not rises.all() else n
        raise FormatError(f"the offsets table does not cut the chunk ({size} bytes) into items: offset {bad} is "
                          f"{int(offsets[bad])} (the items start right after the table, rise, and end within the "
                          f"file{'; the file is cut short' if offsets[-1] > size else ''})", offset=4 + 4 * bad,
                          **where)
    return offsets, 4 + len(table)


def _unzip_chunk(source: str, codec: str, data: bytes) -> bytes:
    """A compressed chunk as the uncompressed chunk it was written from."""
    if codec == "zstd":
        return decompress("zstd", data, source)
    if codec == "zstd:batch":
        return _unframe(source, data)
    if codec == "zstd:sample":  # the classic layout, each item its own zstd frame
        n = int(np.frombuffer(data[:4], "<u4")[0]) if len(data) >= 4 else -1
        offsets = np.frombuffer(data[4: 8 + 4 * n], "<u4").astype(np.int64) if n >= 0 else np.zeros(0)
        if n < 0 or len(offsets) != n + 1 or offsets[0] != 8 + 4 * n or (np.diff(offsets) < 0).any() \
                or offsets[-1] > len(data):
            raise FormatError("the per-item zstd chunk's offsets table does not cut it into items", path=source,
                              offset=0)
        items = [decompress("zstd", data[a:b], source, a) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
        return _classic(items)
    raise FormatError(f"compression {codec!r}, which gpuio does not read", path=source, offset=0)


def _unframe(source: str, data: bytes) -> bytes:
    """A ``compression_level="batch"`` chunk (magic, the items' offsets in the
    decompressed concatenation, a table of zstd frames) as the classic chunk."""
    if len(data) < _FRAMED_PREFIX.size or not data.startswith(_FRAMED_MAGIC):
        raise FormatError(f"not a zstd-framed LitData chunk: it starts with {data[:8]!r}, not {_FRAMED_MAGIC!r}",
                          path=source, offset=0)
    _, version, _, n, _, frames = _FRAMED_PREFIX.unpack_from(data, 0)
    table_at = _FRAMED_PREFIX.size + 4 * (n + 1)
    if version != 1 or table_at + _FRAME.size * frames > len(data):
        raise FormatError(f"framed chunk version {version} with {n} items in {frames} frames does not fit its "
                          f"{len(data)} bytes", path=source, offset=0)
    logical = np.frombuffer(data, "<u4", n + 1, _FRAMED_PREFIX.size).astype(np.int64)
    parts = []
    for i in range(frames):
        at = table_at + i * _FRAME.size
        _, _, offset, size, decoded = _FRAME.unpack_from(data, at)
        if offset + size > len(data):
            raise FormatError(f"frame {i} at byte {offset} of {size} bytes runs past the file", path=source,
                              offset=at)
        part = decompress("zstd", data[offset: offset + size], source, offset)
        if len(part) != decoded:
            raise FormatError(f"frame {i} decompresses to {len(part)} bytes, its table says {decoded}", path=source,
                              offset=offset)
        parts.append(part)
    body = b"".join(parts)
    if (np.diff(logical) < 0).any() or logical[0] != 0 or logical[-1] != len(body):
        raise FormatError(f"the items' offsets do not cut the {len(body)} decompressed bytes", path=source,
                          offset=_FRAMED_PREFIX.size)
    return _classic([body[a:b] for a, b in zip(logical[:-1].tolist(), logical[1:].tolist())])


def _classic(items: list[bytes]) -> bytes:
    """Items laid out as an uncompressed chunk: count, offsets, items."""
    n = len(items)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(i) for i in items], out=offsets[1:])
    offsets += 8 + 4 * n
    return np.uint32(n).tobytes() + offsets.astype("<u4").tobytes() + b"".join(items)


class _Bad(Exception):
    """A leaf that does not decode, at byte ``args[1]`` of the item (internal)."""


class LitDataParser(Parser):
    """Splits a LitData item (``__item__``) into its leaves and decodes each by its
    LitData format (see the module docstring); pickled leaves only with ``allow_pickle``."""

    name = "litdata"
    source = ITEM_FIELD

    def __init__(self, leaves: list[list[str]], allow_pickle: bool = False) -> None:
        self.leaves = [(str(n), str(f)) for n, f in leaves]
        self.allow_pickle = bool(allow_pickle)
        pickled = [n for n, f in self.leaves if f in _PICKLED]
        if pickled and not self.allow_pickle:
            raise ConfigError(f"leaves {pickled} are pickled, and loading a pickle runs code: allow_pickle=True")
        self.fields = tuple(n for n, _ in self.leaves)

    def config(self) -> dict[str, Any]:
        return {"leaves": [list(c) for c in self.leaves], "allow_pickle": self.allow_pickle}

    def parse(self, records: Sequence[np.ndarray], samples: np.ndarray, paths: Sequence[str],
              offsets: np.ndarray) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in self.fields}
        head = 4 * len(self.leaves)
        for j, record in enumerate(records):
            try:
                if len(record) < head:
                    raise _Bad(f"{len(record)} bytes, fewer than the {head}-byte table of leaf sizes", 0)
                sizes = np.frombuffer(record[:head], "<u4").tolist()
                if head + sum(sizes) != len(record):
                    raise _Bad(f"leaf sizes {sizes[:8]} add up to {sum(sizes)} bytes, the item has "
                               f"{len(record) - head} after them", 0)
                pos = head
                for (name, fmt), n in zip(self.leaves, sizes):
                    out[name].append(_leaf(record[pos: pos + n], name, fmt, pos))
                    pos += n
            except _Bad as exc:
                raise FormatError(f"bad LitData item: {exc.args[0]}", path=paths[j], sample=int(samples[j]),
                                  offset=int(offsets[j]) + exc.args[1]) from None
        return out


def _leaf(data: np.ndarray, name: str, fmt: str, pos: int) -> Any:
    kind = _kind(fmt)
    arg = fmt.partition(":")[2]
    try:
        if kind in _BYTES:
            return data
        if kind in _VALUES:
            return data.view(_VALUES[kind])[0]
        if kind == "bool":
            return bool(data[0])
        if kind in ("str", "text"):
            return data.tobytes().decode("utf-8")
        if kind == "pil":
            return pil_pixels(data)
        if kind == "jpeg_array":
            return jpeg_array_items(data)
        if kind == "no_header_numpy":
            return _view(data, _NUMPY_CODES[int(arg)], None)
        if kind == "no_header_tensor":
            return _view(data, _TORCH_CODES[int(arg)], None)
        if kind == "numpy":  # uint32 dtype code, uint32 ndim, uint32 dims, values
            code, ndim = data[:8].view("<u4").tolist()
            shape = tuple(data[8: 8 + 4 * ndim].view("<u4").tolist())
            return _view(data[8 + 4 * ndim:], _NUMPY_CODES[code], shape)
        if kind == "tensor":  # big-endian uint32 dtype code and rank, the dims, values
            code, rank = struct.unpack(">II", data[:8].tobytes())
            shape = struct.unpack(f">{rank}I", data[8: 8 + 4 * rank].tobytes())
            return _view(data[8 + 4 * rank:], _TORCH_CODES[code], shape)
        return pickle.loads(data.tobytes())
    except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError, struct.error, pickle.UnpicklingError,
            EOFError) as exc:
        raise _Bad(f"leaf {name!r} ({fmt}) does not decode: {exc}", pos) from None


def _view(data: np.ndarray, dtype: str, shape: tuple[int, ...] | None) -> np.ndarray:
    dt = np.dtype(dtype)
    if data.__array_interface__["data"][0] % dt.alignment:
        data = data.copy()
    values = data.view(dt)
    return values if shape is None else values.reshape(shape)
