"""``SampleIndex``: per sample, the byte extents of its fields, in a few NumPy arrays.

A format only indexes. What it produces is a ``SampleIndex``:

- ``files``: a compact table of paths (one UTF-8 blob plus offsets, never one Python
  string per file, so that 1.28 M ImageNet files cost tens of MB, not hundreds);
- extent fields: per sample a file id, a byte offset and a length (``Extents``); a
  length of ``UNKNOWN_LENGTH`` (-1) means the rest of the file from the offset, which
  the storage core learns from the file when it reads it (a file tree's whole files,
  listed without a stat() per file; ``gpuio.storage.learn_lengths`` fills them in);
- value fields: per-sample metadata already known at index time: an array with one
  row per sample (labels, ids) or a ``Ragged`` array (boxes, keys);
- optionally a ``parser``, which turns the bytes of one extent field (a TFRecord
  record, a RecordIO record) into further fields after the read, on the batch buffer.

An index saves to one ``.npz`` file (no pickle) and reloads without touching the data.
"""

from __future__ import annotations

import functools
import json
import os
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from gpuio.errors import ConfigError, FormatError, OutOfRangeError, StorageError

__all__ = [
    "Extent",
    "Extents",
    "UNKNOWN_LENGTH",
    "Ragged",
    "PathTable",
    "Parser",
    "SampleIndex",
    "register_parser",
    "parser_from_config",
    "register_sample_reader",
    "concat",
]

_INDEX_VERSION = 1

UNKNOWN_LENGTH = -1  # an extent's length: the rest of its file from the offset, learned at the read


class Extent(NamedTuple):
    """``length`` bytes of ``file`` starting at byte ``offset`` (``UNKNOWN_LENGTH``: to the
    end of the file)."""

    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class Extents:
    """The extents of one field for every sample: file ids, byte offsets, lengths
    (``UNKNOWN_LENGTH`` where the extent runs to the end of its file, size not yet known)."""

    file: np.ndarray  # int32 ids into SampleIndex.files
    offset: np.ndarray  # int64 bytes
    length: np.ndarray  # int64 bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "file", np.ascontiguousarray(self.file, dtype=np.int32))
        object.__setattr__(self, "offset", np.ascontiguousarray(self.offset, dtype=np.int64))
        object.__setattr__(self, "length", np.ascontiguousarray(self.length, dtype=np.int64))
        n = len(self.file)
        if len(self.offset) != n or len(self.length) != n:
            raise ConfigError(
                f"Extents arrays differ in length: file {n}, offset {len(self.offset)}, "
                f"length {len(self.length)}"
            )

    def __len__(self) -> int:
        return len(self.file)

    def take(self, rows: np.ndarray) -> Extents:
        """The extents of ``rows`` (non-negative sample positions), in that order."""
        return Extents(self.file[rows], self.offset[rows], self.length[rows])


@dataclass(frozen=True)
class Ragged:
    """Variable-length per-sample values: sample ``i`` is ``values[offsets[i]:offsets[i+1]]``.

    ``kind`` says how one sample comes back from ``index[i]``: ``"array"`` (an
    ndarray), ``"bytes"`` or ``"str"`` (for uint8 ``values``).
    """

    values: np.ndarray
    offsets: np.ndarray  # int64, len(samples) + 1
    kind: str = "array"

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", np.ascontiguousarray(self.offsets, dtype=np.int64))
        if self.kind not in ("array", "bytes", "str"):
            raise ConfigError(f"Ragged kind {self.kind!r}; choose array, bytes or str")

    @classmethod
    def from_list(cls, items: Sequence[Any], dtype: Any = None, kind: str = "array",
                  row_shape: tuple[int, ...] = ()) -> Ragged:
        """Build from per-sample sequences (``bytes``/``str`` items for those kinds)."""
        if kind == "str":
            items = [s.encode("utf-8") for s in items]
        if kind in ("bytes", "str"):
            lengths = np.fromiter((len(b) for b in items), dtype=np.int64, count=len(items))
            values = np.frombuffer(b"".join(items), dtype=np.uint8).copy()
        else:
            arrays = [np.asarray(a, dtype=dtype).reshape((-1, *row_shape)) for a in items]
            lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
            values = (np.concatenate(arrays) if arrays
                      else np.zeros((0, *row_shape), dtype=dtype or np.float64))
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls(values, offsets, kind)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @functools.cached_property
    def uniform(self) -> bool:
        """Whether every sample holds the same value (found once: an index's arrays are
        not changed in place)."""
        lengths = np.diff(self.offsets)
        if len(lengths) and (lengths != lengths[0]).any():
            return False
        values = self.values.reshape(len(self), -1) if len(lengths) and lengths[0] else self.values
        return bool((values == values[:1]).all())

    def __getitem__(self, i: int) -> Any:
        part = self.values[self.offsets[i]: self.offsets[i + 1]]
        if self.kind == "bytes":
            return part.tobytes()
        if self.kind == "str":
            return part.tobytes().decode("utf-8")
        return part

    def rows(self, rows: np.ndarray) -> list[Any]:
        """Samples ``rows`` as a list, as ``[self[i] for i in rows]`` gives them, with
        one gather for the batch instead of one slice per sample."""
        part = self.take(rows)
        bounds = part.offsets.tolist()
        if self.kind == "array":
            values = part.values
            return [values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        data = part.values.tobytes()
        if self.kind == "bytes":
            return [data[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        return [data[a:b].decode("utf-8") for a, b in zip(bounds[:-1], bounds[1:])]

    def take(self, rows: np.ndarray) -> Ragged:
        """The values of ``rows`` (non-negative sample positions), in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, ends = self.offsets[rows], self.offsets[rows + 1]
        lengths = ends - starts
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # positions of every selected value, without a Python loop per sample
        pos = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Ragged(self.values[pos], offsets, self.kind)


class PathTable:
    """File paths packed in one UTF-8 blob: ``table[i]`` is path ``i`` as ``str``.

    Paths may be stored relative to ``root`` (a directory), which keeps a table of a
    million files in a file tree to a few tens of MB.
    """

    def __init__(self, blob: np.ndarray, offsets: np.ndarray, root: str = "") -> None:
        self.blob = np.ascontiguousarray(blob, dtype=np.uint8)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self.root = os.fsencode(root)
        if self.root and not self.root.endswith(b"/"):
            self.root += b"/"

    @classmethod
    def from_paths(cls, paths: Iterable[str | os.PathLike[str]], root: str = "") -> PathTable:
        """A table of ``paths`` (stored relative to ``root`` when given)."""
        encoded = [os.fsencode(p) for p in paths]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(e) for e in encoded], out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets, root)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        i = int(i)
        if not -len(self) <= i < len(self):
            raise OutOfRangeError(f"file id {i} out of range for {len(self)} files")
        i %= len(self)
        return os.fsdecode(self.root + self.blob[self.offsets[i]: self.offsets[i + 1]].tobytes())

    def __iter__(self):
        return iter(self.many(np.arange(len(self))))

    def many(self, ids: np.ndarray) -> list[str]:
        """Paths of several file ids at once (faster than one ``table[i]`` each)."""
        ids = np.asarray(ids, dtype=np.int64)
        blob, root = self.blob.data, self.root
        return [os.fsdecode(root + blob[a:b].tobytes())
                for a, b in zip(self.offsets[ids].tolist(), self.offsets[ids + 1].tolist())]

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PathTable) and self.root == other.root
                and np.array_equal(self.offsets, other.offsets)
                and np.array_equal(self.blob, other.blob))

    @property
    def nbytes(self) -> int:
        """Bytes the table holds in memory."""
        return self.blob.nbytes + self.offsets.nbytes


class Parser(Protocol):
    """Turns the bytes of one extent field into further fields, after the read.

    ``name`` is the registry key (``register_parser``) and ``config()`` a JSON-able
    dict, so that a saved index rebuilds the parser with ``cls(**config)``.
    """

    name: str
    source: str  # the extent field whose bytes it parses
    fields: tuple[str, ...]  # the fields it produces

    def config(self) -> dict[str, Any]:
        """The keyword arguments that rebuild this parser (JSON-able)."""
        ...

    def parse(self, records: Sequence[np.ndarray], samples: np.ndarray,
              paths: Sequence[str], offsets: np.ndarray) -> dict[str, list[Any]]:
        """Parse one batch: ``records[j]`` holds the bytes of sample ``samples[j]``,
        read from ``paths[j]`` at byte ``offsets[j]`` (for error messages). Returns,
        per produced field, a list with one value per record; byte fields should be
        views into ``records`` (no copies)."""
        ...


_PARSERS: dict[str, Callable[..., Parser]] = {}


def register_parser(name: str, parser: Callable[..., Parser]) -> None:
    """Make ``parser`` (a class, called with its saved ``config()``) loadable from a saved
    index that names it ``name``."""
    _PARSERS[name] = parser


def parser_from_config(name: str, config: dict[str, Any]) -> Parser:
    """The parser registered as ``name``, made with its saved ``config`` (a ``ConfigError``
    where none is registered by that name)."""
    # ``import gpuio`` registers the built-in parsers (``gpuio.formats.PARSERS``)
    if name not in _PARSERS:
        raise ConfigError(f"index needs parser {name!r}, which is not registered (known: {sorted(_PARSERS)}); "
                          f"import the module that defines it before loading the index")
    return _PARSERS[name](**config)


def _no_sample_reader(index: SampleIndex, i: int) -> dict[str, Any]:
    raise ConfigError("index[i] reads through gpuio.storage, which import gpuio registers: import gpuio")


# How ``index[i]`` reads a sample: ``import gpuio`` registers the storage core's reader
# here, so that this module, below the storage core on the data path, never imports it.
_sample_reader: Callable[[SampleIndex, int], dict[str, Any]] = _no_sample_reader


def register_sample_reader(reader: Callable[[SampleIndex, int], dict[str, Any]]) -> None:
    """Set how ``SampleIndex.__getitem__`` reads sample ``i`` of an index."""
    global _sample_reader
    _sample_reader = reader


class SampleIndex:
    """Per sample, the byte extents of its fields plus cheap metadata.

    ``len(index)`` samples; ``index[i]`` reads sample ``i`` synchronously and returns
    its fields as host values (``bytes`` for extent fields, unless the format decodes
    them: ``gpuio.storage._fielddecode``); ``index.fields`` names
    them. Batches are read with ``gpuio.read(index, indices, field, device)``.
    """

    def __init__(
        self,
        files: PathTable | Sequence[str],
        extents: dict[str, Extents] | None = None,
        values: dict[str, np.ndarray | Ragged] | None = None,
        parser: Parser | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        self.files = files if isinstance(files, PathTable) else PathTable.from_paths(files)
        self.extents = dict(extents or {})
        self.values = dict(values or {})
        self.parser = parser
        self.meta = dict(meta or {})
        lengths = {name: len(col) for name, col in {**self.extents, **self.values}.items()}
        if not lengths:
            raise ConfigError("a SampleIndex needs at least one extent or value field")
        if len(set(lengths.values())) != 1:
            raise ConfigError(f"fields differ in sample count: {lengths}")
        self._len = next(iter(lengths.values()))
        if parser is not None and parser.source not in self.extents:
            raise ConfigError(f"parser {parser.name!r} reads field {parser.source!r}, "
                              f"which is not an extent field of this index")
        for name, ext in self.extents.items():
            if len(ext) and (ext.file.min() < 0 or ext.file.max() >= len(self.files)):
                raise ConfigError(f"field {name!r} names a file id outside 0..{len(self.files) - 1}")

    # ---- shape --------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    @property
    def fields(self) -> tuple[str, ...]:
        """Every field a sample has: extent fields, value fields, then parsed fields."""
        parsed = self.parser.fields if self.parser is not None else ()
        return tuple(dict.fromkeys([*self.extents, *self.values, *parsed]))

    def __repr__(self) -> str:
        return f"SampleIndex({self._len} samples, {len(self.files)} files, fields={list(self.fields)})"

    def extent(self, i: int, field: str = "data") -> Extent:
        """Where sample ``i``'s field lies: ``Extent(path, offset, length)``."""
        ext = self.field_extents(field)
        i = self._check_sample(i)
        return Extent(self.files[ext.file[i]], int(ext.offset[i]), int(ext.length[i]))

    def nbytes(self, field: str = "data") -> int:
        """Total bytes of an extent field over all samples; a ``ConfigError`` where some
        lengths are not known yet (``gpuio.storage.learn_lengths`` learns them)."""
        ext = self.field_extents(field)
        unknown = np.flatnonzero(ext.length < 0)
        if len(unknown):
            raise ConfigError(f"field {field!r} has {len(unknown):,} extents of unknown length, the first of file "
                              f"{self.files[ext.file[unknown[0]]]} (a file tree lists its files without their "
                              f"sizes); gpuio.storage.learn_lengths(index) reads them (a file that cannot be "
                              f"stat'ed stays unknown)")
        return int(ext.length.sum())

    def field_extents(self, field: str) -> Extents:
        """The extents of byte field ``field`` (a ``ConfigError`` naming the byte fields if it is none)."""
        if field not in self.extents:
            raise ConfigError(f"field {field!r} is not stored as bytes in this index; "
                              f"byte fields: {list(self.extents)}")
        return self.extents[field]

    def _check_sample(self, i: int) -> int:
        i = int(i)
        if not -self._len <= i < self._len:
            raise OutOfRangeError(f"sample {i} out of range for an index of {self._len} samples")
        return i % self._len

    # ---- convenience reads ---------------------------------------------------------
    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample ``i``'s fields as host values (``bytes`` for extent fields), read
        synchronously by the storage core."""
        return _sample_reader(self, self._check_sample(i))

    # ---- persistence --------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the index to one ``.npz`` file (no pickle); reload with ``load``."""
        arrays: dict[str, np.ndarray] = {"files.blob": self.files.blob, "files.offsets": self.files.offsets}
        spec: dict[str, Any] = {"version": _INDEX_VERSION, "extents": [], "values": {}, "meta": self.meta,
                                "root": os.fsdecode(self.files.root)}
        for name, ext in self.extents.items():
            spec["extents"].append(name)
            arrays[f"e.{name}.file"], arrays[f"e.{name}.offset"], arrays[f"e.{name}.length"] = (
                ext.file, ext.offset, ext.length)
        for name, col in self.values.items():
            if isinstance(col, Ragged):
                spec["values"][name] = col.kind
                arrays[f"r.{name}.values"], arrays[f"r.{name}.offsets"] = col.values, col.offsets
            else:
                spec["values"][name] = "dense"
                arrays[f"v.{name}"] = col
        if self.parser is not None:
            spec["parser"] = {"name": self.parser.name, "config": self.parser.config()}
        arrays["spec"] = np.frombuffer(json.dumps(spec).encode(), dtype=np.uint8)
        with open(path, "wb") as f:  # a file object keeps np.savez from adding ".npz"
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> SampleIndex:
        """Read an index written by ``save``."""
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                head = f.read(8)
        except OSError as exc:
            raise StorageError(f"cannot open the index: {exc.strerror or exc}", path=path) from exc
        if not head.startswith(b"PK\x03\x04"):
            raise FormatError(f"not a gpuio index: SampleIndex.save writes a .npz (zip) file, and this file "
                              f"starts with {head!r}", path=path)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise FormatError("not a gpuio index, or one cut short: its zip archive does not read back as "
                              "the arrays SampleIndex.save writes", path=path) from exc
        if "spec" not in arrays:
            raise FormatError(f"not a gpuio index: a .npz without the 'spec' entry SampleIndex.save writes "
                              f"(it holds {sorted(arrays)[:8]})", path=path)
        try:
            spec = json.loads(arrays["spec"].tobytes())
        except ValueError as exc:
            raise FormatError("not a gpuio index: its 'spec' entry is not the JSON SampleIndex.save writes",
                              path=path) from exc
        version = spec.get("version") if isinstance(spec, dict) else None
        if version != _INDEX_VERSION:
            raise FormatError(f"index version {version}, expected {_INDEX_VERSION}", path=os.fspath(path))
        try:
            extents = {n: Extents(arrays[f"e.{n}.file"], arrays[f"e.{n}.offset"], arrays[f"e.{n}.length"])
                       for n in spec["extents"]}
            values: dict[str, np.ndarray | Ragged] = {}
            for n, kind in spec["values"].items():
                values[n] = arrays[f"v.{n}"] if kind == "dense" else Ragged(
                    arrays[f"r.{n}.values"], arrays[f"r.{n}.offsets"], kind)
            parser = None
            if "parser" in spec:
                parser = parser_from_config(spec["parser"]["name"], spec["parser"]["config"])
            files = PathTable(arrays["files.blob"], arrays["files.offsets"], spec.get("root", ""))
            meta = spec["meta"]
        except (KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"incomplete gpuio index file (no {exc})", path=os.fspath(path)) from exc
        # the C read and stat loops take paths from these offsets unchecked: they must lie in the blob
        ends = files.offsets
        if not len(ends) or ends[0] < 0 or ends[-1] > len(files.blob) or (np.diff(ends) < 0).any():
            raise FormatError(f"the file table's offsets do not cut its {len(files.blob)}-byte path blob into "
                              f"paths (they must rise from 0 to at most its length)", path=os.fspath(path))
        try:
            return cls(files, extents, values, parser, meta)
        except ConfigError as exc:  # arrays of other lengths, file ids past the file table
            raise FormatError(f"inconsistent gpuio index file: {exc}", path=os.fspath(path)) from exc

    def take(self, rows: Sequence[int] | np.ndarray) -> SampleIndex:
        """A new index of the given samples, in that order (files shared)."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < -self._len or rows.max() >= self._len):
            bad = rows[(rows < -self._len) | (rows >= self._len)][0]
            raise OutOfRangeError(f"sample {bad} out of range for an index of {self._len} samples")
        rows = np.where(rows < 0, rows + self._len, rows)  # Ragged.take needs rows >= 0
        return SampleIndex(
            self.files,
            {n: e.take(rows) for n, e in self.extents.items()},
            {n: (v.take(rows) if isinstance(v, Ragged) else v[rows]) for n, v in self.values.items()},
            self.parser,
            self.meta,
        )


def concat(indexes: Sequence[SampleIndex | str | os.PathLike[str]]) -> SampleIndex:
    """One index over several shards' indexes (or saved index paths), in order."""
    parts = [SampleIndex.load(i) if not isinstance(i, SampleIndex) else i for i in indexes]
    if not parts:
        raise ConfigError("concat needs at least one index")
    first = parts[0]
    for p in parts[1:]:
        if set(p.extents) != set(first.extents) or set(p.values) != set(first.values):
            raise ConfigError(f"cannot concatenate indexes with different fields: "
                              f"{list(first.fields)} and {list(p.fields)}")
        if (p.parser is None) != (first.parser is None) or (
                p.parser is not None and (p.parser.name, p.parser.config()) != (first.parser.name, first.parser.config())):
            raise ConfigError("cannot concatenate indexes with different parsers")
    roots = {p.files.root for p in parts}
    if len(roots) == 1:
        files = PathTable(
            np.concatenate([p.files.blob for p in parts]),
            np.concatenate([[0]] + [p.files.offsets[1:] + sum(q.files.blob.size for q in parts[:k])
                                    for k, p in enumerate(parts)]),
            os.fsdecode(roots.pop()),
        )
    else:
        files = PathTable.from_paths([path for p in parts for path in p.files])
    file_base = np.cumsum([0] + [len(p.files) for p in parts])
    extents = {
        n: Extents(np.concatenate([p.extents[n].file + file_base[k] for k, p in enumerate(parts)]),
                   np.concatenate([p.extents[n].offset for p in parts]),
                   np.concatenate([p.extents[n].length for p in parts]))
        for n in first.extents
    }
    values: dict[str, np.ndarray | Ragged] = {}
    for n, col in first.values.items():
        if isinstance(col, Ragged):
            base = np.cumsum([0] + [len(p.values[n].values) for p in parts])
            values[n] = Ragged(
                np.concatenate([p.values[n].values for p in parts]),
                np.concatenate([[0]] + [p.values[n].offsets[1:] + base[k] for k, p in enumerate(parts)]),
                col.kind)
        else:
            values[n] = np.concatenate([p.values[n] for p in parts])
    return SampleIndex(files, extents, values, first.parser, first.meta)
