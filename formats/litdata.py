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

Compressed chunks (``compression="zstd"``), by ``compression_level``:

- ``batch`` (optimize's default for zstd): frames of items (256 by default), each a zstd
  frame, after a table of them. An item's extent is its frame, the smallest unit that
  decodes alone, widened back by the item's place in the frame (which tells the parse
  step which item it is); the parse step decompresses each frame once per batch, however
  many of its items the batch holds. A shuffled epoch reads about one frame per sample,
  so a chunk whose frames average over ``COPY_FRAMES_OVER`` bytes (1 MiB; 256 JPEGs make
  tens of MB) is decompressed once at indexing instead, as ``chunk`` below.
- ``sample``: each item its own zstd frame, at the place of the item: the extent is the
  frame, decompressed by the parse step.
- ``chunk``: the whole file one zstd frame, where the items' places are known only after
  decompressing it all: each chunk is decompressed once, at indexing, into
  ``<cache_dir>/litdata/`` (reused while the source's size and mtime or ETag are
  unchanged) and the copy is indexed in place; ``meta["decompressed_from"]`` lists the
  sources.

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
from gpuio.formats.mds import (closing_file, decompress, decompressed_copy, jpeg_array_items, offsets_table,
                               open_exact, pil_pixels, read_at, read_json)
from gpuio.index import Extents, Parser, PathTable, SampleIndex
from gpuio.storage.remote import object_versions

__all__ = ["litdata", "LitDataParser", "COPY_FRAMES_OVER"]

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
# zstd frames averaging more bytes than this are decompressed once, at indexing: a shuffled
# batch reads about one frame per sample, and frames of large items (256 JPEGs: tens of MB)
# would make every batch read hundreds of times its samples' bytes
COPY_FRAMES_OVER = 1 << 20


def litdata(roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], allow_pickle: bool = False
            ) -> SampleIndex:
    """Index one or more LitData datasets (folders holding ``index.json``; local paths,
    ``s3://`` or ``http(s)://`` URLs, brace ranges and globs), concatenated in order.

    Fields: ``__item__`` (each item's bytes as stored) and, parsed after the read, every
    leaf of the sample under its pytree path. ``index.meta``: ``leaves`` (field ->
    LitData format), ``images`` (the ``jpeg`` and ``image`` leaves, which ``decode_image()``
    finds), ``index_bytes_read`` (bytes indexing read), ``data_bytes`` (the chunks' bytes, as
    ``index.json`` lists them), ``chunks``.
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
    paths = [c.path for c in found]
    files = np.repeat(np.arange(len(paths), dtype=np.int32), [len(c.starts) for c in found])
    meta: dict[str, Any] = {"format": "litdata", "leaves": dict(leaves), "chunks": len(paths),
                            "images": [n for n, f in leaves.items() if f.split(":", 1)[0] in ("jpeg", "image")],
                            "index_bytes_read": int(bytes_read + sum(c.read for c in found)),
                            "data_bytes": int(sum(c.get("chunk_bytes") or 0 for _, _, c, _ in chunks))}
    sources = [c.source for c in found]
    if any(src is not None for src in sources):
        meta["decompressed_from"] = sources
    else:
        meta.update(object_versions(paths))
    parser = LitDataParser([list(c) for c in leaves.items()], allow_pickle,
                           {c.path: c.frames for c in found if c.frames}, [c.path for c in found if c.zstd_items])
    extents = Extents(files, np.concatenate([c.starts for c in found]), np.concatenate([c.lengths for c in found]))
    return SampleIndex(PathTable.from_paths(paths), {ITEM_FIELD: extents}, parser=parser, meta=meta)


def _index_json(root: str) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """``(config, chunk entries, bytes read)`` of ``root``'s ``index.json``, checked."""
    path = root + "/index.json"
    obj, size = read_json(path, "LitData index.json")
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


class _Chunk:
    """One chunk as indexed: the file its extents lie in, their starts and lengths, the
    bytes indexing read, the compressed source of a decompressed copy, and for the parse
    step the zstd frames (``[[offset, end], ...]``) or whether each item is a zstd frame."""

    def __init__(self, path: str, starts: np.ndarray, lengths: np.ndarray, read: int, source: str | None = None,
                 frames: list[list[int]] | None = None, zstd_items: bool = False) -> None:
        self.path, self.starts, self.lengths, self.read, self.source = path, starts, lengths, read, source
        self.frames, self.zstd_items = frames, zstd_items


def _index_chunk(item: tuple[str, int, dict[str, Any], str | None], advance: Callable[[int], None]) -> _Chunk:
    """The extents of one chunk entry's items."""
    root, k, c, codec = item
    path = root + "/" + c["filename"]
    if codec == "zstd:batch":
        out = _framed(path, c, k)
    else:
        source, read = None, 0
        if codec == "zstd":
            source = path
            path, read = decompressed_copy(source, "litdata", functools.partial(decompress, "zstd", path=source))
        offsets, n = _chunk_offsets(path, c, k)
        out = _Chunk(path, offsets[:-1], np.diff(offsets), read + n, source, zstd_items=codec == "zstd:sample")
    advance(int(c.get("chunk_bytes") or 0))
    return out


def _framed(path: str, c: dict[str, Any], k: int) -> _Chunk:
    """A chunk written with ``compression_level="batch"``: magic, the items' offsets in the
    decompressed concatenation, a table of zstd frames (first item, items, file offset,
    compressed and decompressed bytes), the frames. An item's extent is its frame widened
    back by its place in the frame (``offset - j``, ``length + j``: the bytes before a
    frame are the header or earlier frames, at least one per item), which tells the parse
    step which item of the frame; the frame ends where the extent ends."""
    where = {"path": path, "sample": f"chunk {k}"}
    f, size = open_exact(path, "LitData chunk")
    with closing_file(f):
        head = read_at(path, _FRAMED_PREFIX.size, 0, f)
        if len(head) < _FRAMED_PREFIX.size or not head.startswith(_FRAMED_MAGIC):
            raise FormatError(f"not a zstd-framed LitData chunk: it starts with {head[:8]!r}, not {_FRAMED_MAGIC!r}",
                              offset=0, **where)
        _, version, _, n, _, frames = _FRAMED_PREFIX.unpack_from(head, 0)
        if version != 1 or n != c["chunk_size"]:
            raise FormatError(f"framed chunk version {version} of {n} items; gpuio reads version 1, index.json says "
                              f"{c['chunk_size']} items", offset=0, **where)
        want = 4 * (n + 1) + _FRAME.size * frames
        tables = read_at(path, want, _FRAMED_PREFIX.size, f) if _FRAMED_PREFIX.size + want <= size else b""
    if len(tables) < 4 * (n + 1) + _FRAME.size * frames:
        raise FormatError(f"truncated chunk: {size} bytes end inside its tables of {n} items and {frames} frames",
                          offset=size, **where)
    table = np.array([_FRAME.unpack_from(tables, 4 * (n + 1) + i * _FRAME.size) for i in range(frames)],
                     dtype=np.int64).reshape(-1, 5)
    first, count, offset, length = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    body = _FRAMED_PREFIX.size + len(tables)
    ends = offset + length
    if (count < 1).any() or first[0] != 0 or (first[1:] != (first + count)[:-1]).any() or (first + count)[-1] != n \
            or offset[0] != body or (offset[1:] != ends[:-1]).any() or ends[-1] > size:
        raise FormatError(f"the frame table does not cut the chunk ({size} bytes, {n} items) into frames of items "
                          f"one after the other", offset=_FRAMED_PREFIX.size + 4 * (n + 1), **where)
    read = len(head) + len(tables)
    if length.mean() > COPY_FRAMES_OVER:  # a shuffled batch would read a frame per sample: decompress once
        copy, n_read = decompressed_copy(path, "litdata", functools.partial(_unframe, path))
        offsets, n_head = _chunk_offsets(copy, c, k)
        return _Chunk(copy, offsets[:-1], np.diff(offsets), read + n_read + n_head, source=path)
    j = np.arange(n) - np.repeat(first, count)  # each item's place in its frame
    return _Chunk(path, np.repeat(offset, count) - j, np.repeat(length, count) + j, read,
                  frames=np.stack([offset, ends], 1).tolist())


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




def _chunk_offsets(path: str, c: dict[str, Any], k: int) -> tuple[np.ndarray, int]:
    """The ``n + 1`` item offsets of an uncompressed chunk, checked against its size and
    its ``index.json`` entry; and the bytes read for them."""
    where = {"path": path, "sample": f"chunk {k}"}
    f, size = open_exact(path, "LitData chunk")
    with closing_file(f):
        if read_at(path, 4, 0, f) == _FRAMED_MAGIC[:4]:
            raise FormatError("a zstd-framed chunk in a dataset whose index.json says it is not compressed",
                              offset=0, **where)
        offsets = offsets_table(path, f, size, c["chunk_size"], "chunk", "items", where)
    n = len(offsets) - 1
    rises = np.diff(offsets) >= 0
    if offsets[0] != 8 + 4 * n or not rises.all() or offsets[-1] > size:
        bad = 0 if offsets[0] != 8 + 4 * n else int(np.flatnonzero(~rises)[0]) + 1 if not rises.all() else n
        raise FormatError(f"the offsets table does not cut the chunk ({size} bytes) into items: offset {bad} is "
                          f"{int(offsets[bad])} (the items start right after the table, rise, and end within the "
                          f"file{'; the file is cut short' if offsets[-1] > size else ''})", offset=4 + 4 * bad,
                          **where)
    return offsets, 8 + 4 * n


class _Bad(Exception):
    """A leaf that does not decode, at byte ``args[1]`` of the item (internal)."""


class LitDataParser(Parser):
    """Splits a LitData item (``__item__``) into its leaves and decodes each by its
    LitData format (see the module docstring); pickled leaves only with ``allow_pickle``.
    In the files of ``frames`` (``{path: [[offset, end], ...]}``) an extent is an item's
    zstd frame widened back by the item's place in it, and each frame is decompressed
    once per batch; in the files of ``zstd_items`` each item is a zstd frame."""

    name = "litdata"
    source = ITEM_FIELD

    def __init__(self, leaves: list[list[str]], allow_pickle: bool = False,
                 frames: dict[str, list[list[int]]] | None = None, zstd_items: Sequence[str] = ()) -> None:
        self.leaves = [(str(n), str(f)) for n, f in leaves]
        self.allow_pickle = bool(allow_pickle)
        pickled = [n for n, f in self.leaves if f in _PICKLED]
        if pickled and not self.allow_pickle:
            raise ConfigError(f"leaves {pickled} are pickled, and loading a pickle runs code: allow_pickle=True")
        self.fields = tuple(n for n, _ in self.leaves)
        self.frames = dict(frames or {})
        self.zstd_items = list(zstd_items)
        self._frame_at = {p: {end: start for start, end in f} for p, f in self.frames.items()}
        self._zstd_items = frozenset(self.zstd_items)
        self._kinds = [(_kind(f), f.partition(":")[2]) for _, f in self.leaves]  # (family, argument) of each leaf

    def config(self) -> dict[str, Any]:
        return {"leaves": [list(c) for c in self.leaves], "allow_pickle": self.allow_pickle, "frames": self.frames,
                "zstd_items": self.zstd_items}

    def parse(self, records: Sequence[np.ndarray], samples: np.ndarray, paths: Sequence[str],
              offsets: np.ndarray) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in self.fields}
        frames: dict[tuple[str, int], tuple[np.ndarray, list[int]]] = {}  # decompressed once per batch
        for j, record in enumerate(records):
            path, at = paths[j], int(offsets[j])
            try:
                item, pos = self._item(record, path, at, frames)
                for name, value in zip(self.fields, self._split(item, pos)):
                    out[name].append(value)
            except _Bad as exc:
                raise FormatError(f"bad LitData item: {exc.args[0]}", path=path, sample=int(samples[j]),
                                  offset=at + exc.args[1]) from None
            except FormatError as exc:  # a frame that does not decompress
                raise FormatError(exc.reason, path=path, sample=int(samples[j]), offset=exc.offset) from None
        return out

    def _item(self, record: np.ndarray, path: str, at: int, frames: dict[tuple[str, int], tuple[np.ndarray, list[int]]]
              ) -> tuple[np.ndarray, int]:
        """``(the item's bytes, their place in the file for messages)``."""
        if path in self._zstd_items:
            return np.frombuffer(decompress("zstd", record, path, at), dtype=np.uint8), 0
        starts = self._frame_at.get(path)
        if starts is None:
            return record, 0
        begin = starts.get(at + len(record))
        if begin is None or begin < at:
            raise _Bad(f"the extent ({len(record)} bytes) ends where no zstd frame of the chunk ends: an index made "
                       f"for another file", 0)
        key = (path, begin)
        if key not in frames:
            data = np.frombuffer(decompress("zstd", record[begin - at:], path, begin), dtype=np.uint8)
            frames[key] = data, self._item_starts(data)
        data, bounds = frames[key]
        k = begin - at
        if k + 1 >= len(bounds):
            raise _Bad(f"item {k} of a zstd frame of {len(bounds) - 1} items", begin - at)
        return data[bounds[k]: bounds[k + 1]], begin - at

    def _item_starts(self, data: np.ndarray) -> list[int]:
        """Where each item of a decompressed frame starts, and its end: an item is one
        ``uint32`` size per leaf, then the leaves."""
        head, bounds, pos = 4 * len(self.leaves), [0], 0
        while pos < len(data):
            if pos + head > len(data):
                raise _Bad(f"a decompressed frame's last {len(data) - pos} bytes are no item", 0)
            pos += head + int(np.frombuffer(data[pos: pos + head], "<u4").sum(dtype=np.int64))
            bounds.append(pos)
        if pos != len(data):
            raise _Bad(f"the items' leaf sizes run {pos - len(data)} bytes past their decompressed frame", 0)
        return bounds

    def _split(self, item: np.ndarray, at: int) -> list[Any]:
        head = 4 * len(self.leaves)
        if len(item) < head:
            raise _Bad(f"{len(item)} bytes, fewer than the {head}-byte table of leaf sizes", at)
        sizes = np.frombuffer(item[:head], "<u4").tolist()
        if head + sum(sizes) != len(item):
            raise _Bad(f"leaf sizes {sizes[:8]} add up to {sum(sizes)} bytes, the item has {len(item) - head} "
                       f"after them", at)
        values, pos = [], head
        for (name, fmt), (kind, arg), n in zip(self.leaves, self._kinds, sizes):
            values.append(_leaf(item[pos: pos + n], name, fmt, kind, arg, at + pos))
            pos += n
        return values


def _leaf(data: np.ndarray, name: str, fmt: str, kind: str | None, arg: str, pos: int) -> Any:
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
