"""Mosaic Streaming MDS datasets (``MDSWriter``'s output): ``index.json`` and its shards.

``index.json`` lists the shards (``{"version": 2, "shards": [...]}``), each with its
``column_names`` (sorted), ``column_encodings``, ``column_sizes`` (bytes, ``null`` for
variable-size columns), ``samples``, ``compression`` and the files ``raw_data`` and
``zip_data`` (``basename``, ``bytes``, ``hashes``). A raw shard is ``uint32 n``,
``uint32 offsets[n + 1]`` (byte positions of the samples in the shard), the writer's
config as JSON, then the samples; a sample is one ``uint32`` size per variable-size
column, then every column's bytes in column order. All integers little-endian.

An uncompressed shard is read in place: the extent field ``__sample__`` is a sample's
bytes as stored, found from the shard's offsets table alone (indexing reads
``index.json`` and each shard's header, nothing else), and the parser (``MDSParser``)
splits it into the columns after the read: ``bytes``, ``jpeg`` and ``png`` as uint8
views into the batch buffer (``decode_image`` decodes them), ``ndarray`` as array views,
scalars as NumPy scalars, ``str``/``json``/``str_int``/... decoded, ``pil`` as an
``HWC`` uint8 array, the ``list[...]``/``jpeg_array`` columns as lists.

A compressed shard (``zstd``, ``gz``, ``bz2``, ``br``, ``snappy``) decodes only whole, and
its samples' positions are inside the compressed bytes: each is decompressed once, at
indexing, into ``<cache_dir>/mds/`` (``gpuio.config`` ``cache_dir``; reused while the
source's size and mtime or ETag are unchanged), its ``zip_data`` hashes checked on the
way, and the copy is indexed as above; ``meta["decompressed_from"]`` lists the sources.

``pkl`` columns are refused unless ``allow_pickle=True``: loading a pickle runs code.
"""

from __future__ import annotations

import functools
import gzip
import bz2
import hashlib
import json
import os
import pickle
import posixpath
import re
import threading
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from gpuio.errors import ConfigError, DataError, DependencyError, FormatError, StorageError
from gpuio.formats._files import derived_path, each_shard, full_path, open_regular_file, shard_paths, writing_whole
from gpuio.index import Extents, Parser, PathTable, SampleIndex
from gpuio.storage.remote import RemoteFile, is_url, object_versions

__all__ = ["mds", "MDSParser", "decompress", "decompressed_copy", "check_hashes", "read_at", "read_json", "open_exact",
           "closing_file", "offsets_table", "pil_pixels", "jpeg_array_items"]

_SCALARS = {"uint8": "<u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "int8": "<i1", "int16": "<i2",
            "int32": "<i4", "int64": "<i8", "float16": "<f2", "float32": "<f4", "float64": "<f8", "int": "<i8"}
_TEXT = ("str", "str_int", "str_float", "str_decimal", "json")
_IMAGES = ("jpeg", "png")
_LISTS = ("list[jpeg]", "list[png]", "list[pil]", "jpeg_array", "jpegarray")
_ENCODINGS = ("bytes", *_TEXT, *_IMAGES, *_LISTS, *_SCALARS, "pil", "ndarray", "pkl")
# MDS ndarray dtype codes (a column without a fixed dtype stores one byte of these first)
_NDARRAY_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                   34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
_PIL_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4, "CMYK": 4, "LA": 2, "I;16": 1}
_CODECS = ("zstd", "gz", "bz2", "br", "snappy")
SAMPLE_FIELD = "__sample__"
_SHARD_NAME = re.compile(r"shard\.\d+\.mds(\.(zstd|gz|bz2|br|snappy))?")  # as MDSWriter names them


def mds(roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], allow_pickle: bool = False,
        verify: bool = False) -> SampleIndex:
    """Index one or more MDS datasets (folders holding ``index.json``; local paths,
    ``s3://`` or ``http(s)://`` URLs, brace ranges and globs), concatenated in order.

    Fields: ``__sample__`` (each sample's bytes as stored) and, parsed after the read,
    every column under its own name. ``verify=True`` also reads every uncompressed shard
    whole and checks the hashes ``index.json`` lists (compressed shards are always
    checked, since indexing reads them). ``index.meta``: ``columns`` (name -> MDS
    encoding), ``images`` (the ``jpeg`` and ``png`` columns, which ``decode_image()``
    finds), ``index_bytes_read`` (bytes indexing read), ``data_bytes`` (the shards' bytes, as
    ``index.json`` lists them), ``shards``.
    """
    roots = [full_path(r).rstrip("/") for r in shard_paths(roots, "MDS dataset folder")]
    if not roots:
        raise DataError("no samples: an empty list of MDS dataset folders was given")
    shards, bytes_read = [], 0
    for root in roots:
        listed, n = _index_json(root)
        bytes_read += n
        shards += [(root, k, s) for k, s in enumerate(listed)]
    columns = _columns(shards, allow_pickle)
    found = each_shard(functools.partial(_index_shard, verify), shards, "indexing MDS shards",
                       [s["raw_data"].get("bytes", 0) if isinstance(s.get("raw_data"), dict) else 0
                        for _, _, s in shards])
    paths = [p for p, _, _, _ in found]
    bytes_read += sum(n for _, _, n, _ in found)
    counts = [len(o) - 1 for _, o, _, _ in found]
    files = np.repeat(np.arange(len(paths), dtype=np.int32), counts)
    starts = np.concatenate([o[:-1] for _, o, _, _ in found])
    lengths = np.concatenate([np.diff(o) for _, o, _, _ in found])
    meta: dict[str, Any] = {"format": "mds", "columns": dict(columns), "shards": len(paths),
                            "images": [n for n, e in columns.items() if e in _IMAGES],
                            "index_bytes_read": int(bytes_read), "verified": bool(verify),
                            "data_bytes": int(sum((s.get("zip_data") if s.get("compression") else s["raw_data"])
                                                  .get("bytes", 0) for _, _, s in shards))}
    sources = [src for _, _, _, src in found]
    if any(src is not None for src in sources):
        meta["decompressed_from"] = sources
    else:
        meta.update(object_versions(paths))
    return SampleIndex(PathTable.from_paths(paths), {SAMPLE_FIELD: Extents(files, starts, lengths)},
                       parser=MDSParser([list(c) for c in columns.items()], allow_pickle), meta=meta)


def read_at(path: str, n: int, offset: int, f: Any = None) -> bytes:
    """``n`` bytes of ``path`` from byte ``offset`` (fewer at its end): one ranged GET
    of exactly those bytes for a URL, one ``pread`` for a local file (``f``: the file,
    already open)."""
    if f is not None and not isinstance(f, RemoteFile):
        return os.pread(f.fileno(), n, offset)
    remote = f if f is not None else RemoteFile(path, window=1)
    return remote.pread(n, offset)


def read_json(path: str, what: str) -> tuple[Any, int]:
    """``(the JSON document in path, its size in bytes)``; a file that is not JSON is a
    ``FormatError``."""
    f, size = open_exact(path, what)
    with closing_file(f):
        text = read_at(path, size, 0, f)
    try:
        return json.loads(text), size
    except ValueError as exc:
        raise FormatError(f"{what} is not JSON ({exc})", path=path, offset=0) from None


def open_exact(path: str, what: str) -> tuple[Any, int]:
    """``(file, size)``; a URL opens with no read-ahead, so that header reads fetch only
    their bytes."""
    if is_url(path):
        remote = RemoteFile(path, window=1)
        return remote, remote.size
    return open_regular_file(path, what)


def _index_json(root: str) -> tuple[list[dict[str, Any]], int]:
    """The shard entries of ``root``'s ``index.json`` and its size in bytes, checked."""
    path = root + "/index.json"
    obj, size = read_json(path, "MDS index.json")
    shards = obj.get("shards") if isinstance(obj, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise FormatError("index.json has no list of shards (MDSWriter writes {\"version\": 2, \"shards\": "
                          "[...]})", path=path, offset=0)
    for k, s in enumerate(shards):
        if s.get("format") != "mds":
            raise FormatError(f"shard {k} is in format {s.get('format')!r}; gpuio reads 'mds' shards (of the "
                              f"MDSWriter)", path=path, sample=f"shard {k}")
        for key in ("column_names", "column_encodings", "column_sizes", "samples", "raw_data"):
            if key not in s:
                raise FormatError(f"shard {k} has no {key!r}", path=path, sample=f"shard {k}")
    _refuse_unlisted(root, shards)
    return shards, size


def _refuse_unlisted(root: str, shards: list[dict[str, Any]]) -> None:
    """A shard file in a local dataset folder that ``index.json`` does not list (an
    interrupted writer, a partial merge) would be silently left out: an error."""
    if is_url(root):
        return
    listed = {posixpath.basename(s[key]["basename"]) for s in shards for key in ("raw_data", "zip_data")
              if isinstance(s.get(key), dict) and "basename" in s[key]}
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise StorageError(f"cannot list the MDS dataset folder: {exc.strerror or exc}", path=root) from exc
    extra = sorted(n for n in names if _SHARD_NAME.fullmatch(n) and n not in listed)
    if extra:
        raise FormatError(f"{len(extra)} shard file(s) not listed in index.json ({', '.join(extra[:5])}): an "
                          f"index.json from an unfinished or other write; rewrite or merge the index",
                          path=os.path.join(root, extra[0]), offset=0)


def _columns(shards: list[tuple[str, int, dict[str, Any]]], allow_pickle: bool) -> dict[str, str]:
    """``{column: encoding}``, the same in every shard, each encoding one gpuio reads."""
    first = None
    for root, k, s in shards:
        names, encodings, sizes = s["column_names"], s["column_encodings"], s["column_sizes"]
        where = {"path": root + "/index.json", "sample": f"shard {k}"}
        if not (isinstance(names, list) and isinstance(encodings, list) and isinstance(sizes, list)
                and len(names) == len(encodings) == len(sizes)):
            raise FormatError("column_names, column_encodings and column_sizes are not lists of one length",
                              **where)
        cols = dict(zip(names, encodings))
        if first is None:
            first = cols
            for name, enc in cols.items():
                base = enc.split(":", 1)[0]
                if base not in _ENCODINGS:
                    raise FormatError(f"column {name!r} has encoding {enc!r}, which gpuio does not read; it reads "
                                      f"{', '.join(_ENCODINGS)}", **where)
                if base == "pkl" and not allow_pickle:
                    raise ConfigError(f"column {name!r} is pickled (MDS encoding 'pkl'), and loading a pickle runs "
                                      f"code: pass allow_pickle=True if you trust {root}")
        elif cols != first:
            raise FormatError(f"shard {k} has columns {cols}, shard 0 has {first}: one index needs one set of "
                              f"columns", **where)
        if SAMPLE_FIELD in cols:
            raise FormatError(f"a column is named {SAMPLE_FIELD!r}, the name of gpuio's own field", **where)
    return first or {}


class closing_file:
    """``with`` for a local file or a ``RemoteFile`` (which has nothing to close)."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def __enter__(self) -> Any:
        return self.f

    def __exit__(self, *exc: object) -> None:
        if not isinstance(self.f, RemoteFile):
            self.f.close()


def _index_shard(verify: bool, item: tuple[str, int, dict[str, Any]], advance: Callable[[int], None]
                 ) -> tuple[str, np.ndarray, int, str | None]:
    """``(path of the raw shard, sample offsets (n + 1), bytes read, compressed source or
    None)`` of one shard entry."""
    root, k, s = item
    raw = s["raw_data"]
    zipped = s.get("zip_data")
    source = None
    read = 0
    if s.get("compression"):
        if not isinstance(zipped, dict) or "basename" not in zipped:
            raise FormatError(f"shard {k} is compressed ({s['compression']}) but has no zip_data",
                              path=root + "/index.json", sample=f"shard {k}")
        source = root + "/" + zipped["basename"]
        codec = str(s["compression"]).split(":", 1)[0]
        path, read = decompressed_copy(source, "mds",
                                       functools.partial(_unzip_shard, source, codec, zipped, raw, f"shard {k}"))
    else:
        path = root + "/" + raw["basename"]
        if verify and raw.get("hashes"):
            f, size = open_exact(path, "MDS shard")
            with closing_file(f):
                data = read_at(path, size, 0, f)
            read += len(data)
            check_hashes(data, raw["hashes"], path, f"shard {k}")
    offsets, n = _shard_offsets(path, s, k)
    advance(int(raw.get("bytes", 0)))
    return path, offsets, read + n, source


def offsets_table(path: str, f: Any, size: int, expected: int, unit: str, items: str, where: dict[str, Any]
                  ) -> np.ndarray:
    """The table that starts an MDS shard and a LitData chunk: ``uint32 n`` (which must be
    ``expected``), then ``uint32 offsets[n + 1]``; as int64 (``4 * (n + 2)`` bytes read).
    ``unit``/``items``: what the file and its entries are called, for messages."""
    head = read_at(path, 4, 0, f)
    if len(head) < 4:
        raise FormatError(f"truncated {unit}: {size} bytes, not even the 4-byte count of {items}", offset=0, **where)
    n = int(np.frombuffer(head, "<u4")[0])
    if n != expected:
        raise FormatError(f"the {unit} holds {n} {items}, index.json says {expected}", offset=0, **where)
    table = read_at(path, 4 * (n + 1), 4, f) if 4 * (n + 2) <= size else b""
    if len(table) < 4 * (n + 1):
        raise FormatError(f"truncated {unit}: {size} bytes end inside the table of {n + 1} offsets of its {items}",
                          offset=size, **where)
    return np.frombuffer(table, "<u4").astype(np.int64)


def _shard_offsets(path: str, s: dict[str, Any], k: int) -> tuple[np.ndarray, int]:
    """The ``n + 1`` sample offsets of a raw shard, checked against its size and its
    ``index.json`` entry; and the bytes read for them."""
    where = {"path": path, "sample": f"shard {k}"}
    f, size = open_exact(path, "MDS shard")
    with closing_file(f):
        offsets = offsets_table(path, f, size, s["samples"], "shard", "samples", where)
        n = len(offsets) - 1
        header_end = 8 + 4 * n
        config_bytes = b""
        if header_end < offsets[0] <= size:
            config_bytes = read_at(path, int(offsets[0]) - header_end, header_end, f)
    read = header_end + len(config_bytes)
    if offsets[0] < header_end or (np.diff(offsets) < 0).any() or offsets[-1] != size:
        bad = (0 if offsets[0] < header_end else
               int(np.flatnonzero(np.diff(offsets) < 0)[0]) + 1 if (np.diff(offsets) < 0).any() else n)
        raise FormatError(f"the offsets table does not cut the shard ({size} bytes) into samples: offset {bad} is "
                          f"{int(offsets[bad])} (the samples start after the {header_end}-byte table and its JSON, "
                          f"rise, and end at the end of the file"
                          f"{'; the file is cut short' if offsets[-1] > size else ''})",
                          offset=4 + 4 * bad, **where)
    raw_bytes = s["raw_data"].get("bytes")
    if raw_bytes is not None and raw_bytes != size:
        raise FormatError(f"the shard has {size} bytes, index.json says {raw_bytes}", offset=min(size, raw_bytes),
                          **where)
    try:
        cfg = json.loads(config_bytes)
    except ValueError:
        cfg = None
    if not isinstance(cfg, dict) or cfg.get("column_names") != s["column_names"] or \
            cfg.get("column_encodings") != s["column_encodings"]:
        raise FormatError(f"the shard's header JSON does not match its index.json entry (columns "
                          f"{s['column_names']}): not the shard index.json describes", offset=header_end, **where)
    fixed = sum(c or 0 for c in s["column_sizes"]) + 4 * sum(c is None for c in s["column_sizes"])
    short = np.flatnonzero(np.diff(offsets) < fixed)
    if short.size:
        j = int(short[0])
        raise FormatError(f"sample {j} has {int(offsets[j + 1] - offsets[j])} bytes, fewer than the {fixed} its "
                          f"columns' sizes need", offset=int(offsets[j]), **where)
    return offsets, read


# ---- compressed shards -----------------------------------------------------------------

def decompress(codec: str, data: Any, path: str, offset: int = 0) -> bytes:
    """``data`` decompressed by ``codec`` (``zstd``, ``gz``, ``bz2``, ``br``, ``snappy``);
    bad data is a ``FormatError`` naming ``path`` and ``offset``."""
    try:
        if codec == "zstd":
            return _zstd().decompressobj().decompress(data)
        if codec == "gz":
            return gzip.decompress(data)
        if codec == "bz2":
            return bz2.decompress(data)
        if codec == "br":
            return _module("brotli", "brotli").decompress(bytes(data))
        if codec == "snappy":
            return bytes(_module("cramjam", "cramjam").snappy.decompress_raw(bytes(data)))
    except (OSError, EOFError, ValueError) as exc:
        raise FormatError(f"bad {codec} data ({exc})", path=path, offset=offset) from None
    except Exception as exc:  # the codecs' own error classes (zstandard.ZstdError, brotli.error, cramjam's)
        if type(exc).__module__.split(".")[0] in ("zstandard", "brotli", "_brotli", "cramjam"):
            raise FormatError(f"bad {codec} data ({exc})", path=path, offset=offset) from None
        raise
    raise FormatError(f"compression {codec!r}, which gpuio does not read; it reads {', '.join(_CODECS)}",
                      path=path, offset=offset)


_THREAD = threading.local()


def _zstd() -> Any:
    """This thread's zstd decompressor (one is not thread-safe, and making one per call
    costs more than decompressing a small frame)."""
    if not hasattr(_THREAD, "zstd"):
        _THREAD.zstd = _module("zstandard", "zstandard").ZstdDecompressor()
    return _THREAD.zstd


def _module(name: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise DependencyError(f"this data is compressed with a codec that needs the '{package}' package "
                              f"(pip install {package})") from exc


def check_hashes(data: Any, hashes: dict[str, str], path: str, where: str) -> None:
    """Check ``data`` against ``{algorithm: hex digest}`` (hashlib's algorithms and
    xxhash's, as Mosaic Streaming writes them); a mismatch is a ``FormatError``."""
    for algo, stored in sorted(hashes.items()):
        if algo in hashlib.algorithms_available and hasattr(hashlib, algo):
            computed = getattr(hashlib, algo)(data).hexdigest()
        elif algo.startswith("xxh"):
            computed = getattr(_module("xxhash", "xxhash"), algo)(data).hexdigest()
        else:
            raise FormatError(f"{where}: hash {algo!r}, which gpuio cannot compute", path=path, offset=0)
        if computed != stored:
            raise FormatError(f"{where}: {algo} mismatch (stored {stored}, computed {computed}): the file is not the "
                              f"one its index lists", path=path, offset=0)


def decompressed_copy(source: str, kind: str, decode: Callable[[bytes], bytes]) -> tuple[str, int]:
    """``(path of the decompressed copy of source, bytes read from source)``: the copy
    in ``<cache_dir>/<kind>/``, ``decode(the source's bytes)`` (which checks them and raises
    ``FormatError``), made once per version of ``source`` (``formats._files.derived_path``)."""
    out = derived_path(source, kind)
    if os.path.exists(out):
        return out, 0
    f, size = open_exact(source, "compressed file")
    with closing_file(f):
        data = read_at(source, size, 0, f)
    raw = decode(data)
    with writing_whole(out, source) as dst:
        dst.write(raw)
    return out, len(data)


def _unzip_shard(source: str, codec: str, zipped: dict[str, Any], raw: dict[str, Any], where: str,
                 data: bytes) -> bytes:
    """A compressed MDS shard's bytes decompressed, its hashes checked before and after."""
    check_hashes(data, zipped.get("hashes") or {}, source, where)
    out = decompress(codec, data, source)
    check_hashes(out, raw.get("hashes") or {}, source, f"{where} (decompressed)")
    return out


# ---- the parser --------------------------------------------------------------------------

class _Bad(Exception):
    """A column that does not decode, at byte ``args[1]`` of the sample (internal)."""


class MDSParser(Parser):
    """Splits an MDS sample (``__sample__``) into its columns and decodes each by its
    encoding (see the module docstring); ``pkl`` columns only with ``allow_pickle``."""

    name = "mds"
    source = SAMPLE_FIELD

    def __init__(self, columns: list[list[str]], allow_pickle: bool = False) -> None:
        self.columns = [(str(n), str(e)) for n, e in columns]
        self.allow_pickle = bool(allow_pickle)
        pickled = [n for n, e in self.columns if e == "pkl"]
        if pickled and not self.allow_pickle:
            raise ConfigError(f"columns {pickled} are pickled, and loading a pickle runs code: allow_pickle=True")
        self.fields = tuple(n for n, _ in self.columns)
        self._sizes = [_fixed_size(e) for _, e in self.columns]
        self._nvar = sum(s is None for s in self._sizes)
        self._encodings = [e.partition(":")[::2] for _, e in self.columns]  # (base, arg) of each column

    def config(self) -> dict[str, Any]:
        return {"columns": [list(c) for c in self.columns], "allow_pickle": self.allow_pickle}

    def parse(self, records: Sequence[np.ndarray], samples: np.ndarray, paths: Sequence[str],
              offsets: np.ndarray) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {name: [] for name in self.fields}
        for j, record in enumerate(records):
            try:
                for name, value in zip(self.fields, self.split(record)):
                    out[name].append(value)
            except _Bad as exc:
                raise FormatError(f"bad MDS sample: {exc.args[0]}", path=paths[j], sample=int(samples[j]),
                                  offset=int(offsets[j]) + exc.args[1]) from None
        return out

    def split(self, record: np.ndarray) -> list[Any]:
        """The decoded columns of one sample's bytes, in column order."""
        head = 4 * self._nvar
        if len(record) < head:
            raise _Bad(f"{len(record)} bytes, fewer than the {head}-byte table of column sizes", 0)
        var = iter(np.frombuffer(record[:head], "<u4").tolist())
        pos, values = head, []
        for (name, enc), (base, arg), size in zip(self.columns, self._encodings, self._sizes):
            n = next(var) if size is None else size
            if pos + n > len(record):
                raise _Bad(f"column {name!r} needs {n} bytes at byte {pos}, the sample has {len(record)}", pos)
            values.append(self._value(record[pos: pos + n], name, enc, base, arg, pos))
            pos += n
        if pos != len(record):
            raise _Bad(f"{len(record) - pos} bytes follow the last column (the offsets table and the column "
                       f"sizes disagree)", pos)
        return values

    def _value(self, data: np.ndarray, name: str, enc: str, base: str, arg: str, pos: int) -> Any:
        try:
            if base in ("bytes", *_IMAGES):
                return data
            if base in _SCALARS:
                return data.view(_SCALARS[base])[0]
            if base == "ndarray":
                return _ndarray(data, arg)
            if base == "pil":
                return pil_pixels(data)
            if base in _LISTS:
                items = jpeg_array_items(data) if base in ("jpeg_array", "jpegarray") else _list(data)
                return [pil_pixels(item) for item in items] if base == "list[pil]" else items
            if base == "pkl":
                return pickle.loads(data.tobytes())
            return _FROM_TEXT[base](data.tobytes().decode("utf-8"))
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError, InvalidOperation,
                pickle.UnpicklingError, EOFError) as exc:
            raise _Bad(f"column {name!r} ({enc}) does not decode: {exc}", pos) from None


_FROM_TEXT = {"str": str, "str_int": int, "str_float": float, "str_decimal": Decimal, "json": json.loads}


def _fixed_size(enc: str) -> int | None:
    base, _, arg = enc.partition(":")
    if base in _SCALARS:
        return np.dtype(_SCALARS[base]).itemsize
    if base == "ndarray" and arg.count(":") == 1:
        dtype, shape = arg.split(":")
        return int(np.prod([int(d) for d in shape.split(",")])) * np.dtype(dtype).itemsize
    return None


def _ndarray(data: np.ndarray, arg: str) -> np.ndarray:
    """An MDS ``ndarray[:dtype[:shape]]`` value: ``[dtype code]``, ``[ndim << 2 | shape
    width code]`` and the shape where the encoding does not fix them, then the values."""
    dtype, _, shape_text = arg.partition(":")
    pos = 0
    if not dtype:
        dtype = _NDARRAY_DTYPES[int(data[0])]
        pos = 1
    if shape_text:
        shape = tuple(int(d) for d in shape_text.split(","))
    else:
        byte = int(data[pos])
        ndim, width = byte >> 2, 1 << (byte & 3)
        shape = tuple(data[pos + 1: pos + 1 + ndim * width].view(f"<u{width}").tolist())
        if len(shape) != ndim:
            raise ValueError(f"the shape of {ndim} dimensions is cut short")
        pos += 1 + ndim * width
    values = data[pos:]
    dt = np.dtype(dtype).newbyteorder("<")
    if values.__array_interface__["data"][0] % dt.alignment:
        values = values.copy()
    return values.view(dt).reshape(shape)


def pil_pixels(data: np.ndarray) -> np.ndarray:
    """An MDS ``pil`` value (``uint32 width, height, len(mode)``, the mode, the raw
    pixels) as an ``HWC`` uint8 array (``HW`` uint16 for ``I;16``)."""
    width, height, n = data[:12].view("<u4").tolist()
    mode = data[12: 12 + n].tobytes().decode("ascii")
    if mode not in _PIL_CHANNELS:
        raise ValueError(f"PIL mode {mode!r}; gpuio reads {', '.join(_PIL_CHANNELS)}")
    pixels = data[12 + n:]
    if mode == "I;16":
        return pixels.copy().view("<u2").reshape(height, width)
    return pixels.reshape(height, width, _PIL_CHANNELS[mode])


def _list(data: np.ndarray) -> list[np.ndarray]:
    """An MDS ``list[...]`` value: ``uint32`` 0, ``uint32 n``, ``n`` ``uint32`` sizes, the items."""
    n = int(data[4:8].view("<u4")[0])
    sizes = data[8: 8 + 4 * n].view("<u4").tolist()
    return _cut(data, 8 + 4 * n, sizes)


def jpeg_array_items(data: np.ndarray) -> list[np.ndarray]:
    """An MDS ``jpeg_array`` value: ``uint32 n``, ``n`` ``uint32`` sizes, the JPEGs."""
    n = int(data[:4].view("<u4")[0])
    return _cut(data, 4 + 4 * n, data[4: 4 + 4 * n].view("<u4").tolist())


def _cut(data: np.ndarray, pos: int, sizes: list[int]) -> list[np.ndarray]:
    if len(data) < pos or pos + sum(sizes) != len(data):
        raise ValueError(f"item sizes {sizes[:8]} do not fill the {len(data)}-byte value")
    out = []
    for n in sizes:
        out.append(data[pos: pos + n])
        pos += n
    return out
