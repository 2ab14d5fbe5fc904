"""WebDataset shards: samples stored as consecutive members of uncompressed tar files.

A member ``a/b/000123.seg.png`` belongs to the sample with key ``a/b/000123`` (the
path up to the first dot of the base name) and holds its field ``seg.png`` (the rest,
lowercased, as WebDataset does). Consecutive members with the same key form one
sample. Members that are not regular files, and base names without a dot or starting
with one, are skipped.

Only headers are read: each field's extent points at the member's bytes inside the
tar, so a batch is read straight from the shards. A local tar's headers are walked in
C (``_tar.c``: 512-byte headers read with pread, member data skipped); a tar it cannot
index exactly as the full parser below does (a bad header, a truncated file, unusual
spellings) and a remote one are parsed in Python, whose errors name the tar and the
header's byte offset. Compressed tars (``.tar.gz``...)
cannot be read in place and are refused.

After the read, fields are decoded by their last extension as the webdataset package's
default decoders do (``webdataset.autodecode.basichandlers``): ``txt``, ``text``,
``transcript`` -> ``str``; ``cls``, ``cls2``, ``index``, ``inx``, ``id`` -> ``int``;
``json``, ``jsn`` -> the JSON object; ``npy`` -> array; ``npz`` -> dict of arrays.
Every other extension stays bytes, pickles and torch files included (on purpose:
loading them runs code; decode them yourself if you trust the data).
"""

from __future__ import annotations

import functools
import os
from array import array
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from gpuio.errors import ConfigError, DataError, FormatError
from gpuio.formats import _tar
from gpuio.formats._files import each_shard, full_path, open_regular_file, shard_paths, size_or_zero
from gpuio.storage.remote import is_url, object_versions
from gpuio.index import Extents, PathTable, Ragged, SampleIndex

__all__ = ["webdataset"]

_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd",
               b"\x04\x22\x4d\x18": "lz4"}
_BLOCK = 512
# last extension -> field decoder (gpuio.storage._fielddecode), as the webdataset package decodes them
_DECODERS = {"txt": "str", "text": "str", "transcript": "str", "cls": "int", "cls2": "int", "index": "int",
             "inx": "int", "id": "int", "json": "json", "jsn": "json", "npy": "npy", "npz": "npz"}


def webdataset(tar_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
               fields: Sequence[str] = ("jpg", "cls"), missing: str = "error",
               decode: bool = True) -> SampleIndex:
    """Index the samples of one or more tar shards, concatenated in the order given.

    Each name in ``fields`` (an extension such as ``"jpg"`` or ``"seg.png"``) becomes
    an extent field holding that member's bytes; ``__key__`` holds each sample's key
    (``str``). A sample without one of ``fields`` raises ``FormatError`` naming the tar
    and key (``missing="error"``) or is left out (``missing="skip"``).

    With ``decode=True``, ``index[i]`` and the ``Loader`` give fields decoded by their
    extension (see the module docstring: ``cls`` an ``int``, ``txt`` a ``str``, ...;
    a value that does not decode is a ``FormatError`` naming the tar, byte offset and
    sample), and a batch's ``int`` fields stack into one int64 label array; other
    fields are the member's bytes. ``decode=False`` keeps bytes everywhere;
    ``gpuio.read`` always gives bytes.
    """
    if isinstance(fields, str):
        fields = (fields,)
    fields = tuple(f.lower() for f in fields)
    if not fields or len(set(fields)) != len(fields) or "__key__" in fields or "" in fields:
        raise ConfigError(f"fields {fields!r}: give distinct member extensions such as ('jpg', 'cls')")
    if missing not in ("error", "skip"):
        raise ConfigError(f"missing {missing!r}; choose 'error' or 'skip'")
    paths = [full_path(p) for p in shard_paths(tar_paths, "tar file")]
    if not paths:
        raise DataError("no samples: an empty list of tar files was given")

    wanted = {f: k for k, f in enumerate(fields)}
    sizes = [size_or_zero(p) for p in paths]
    shards = each_shard(functools.partial(_index_shard, wanted, missing == "skip"), paths, "indexing tar files",
                        sizes)
    counts = [s.samples for s in shards]
    if not sum(counts):
        raise DataError(f"no samples with fields {list(fields)} in {len(paths)} tar file(s)", path=paths[0])

    # joined one array at a time, each shard's parts dropped once used, so that the peak
    # stays near one copy of the index
    files = np.repeat(np.arange(len(paths), dtype=np.int32), counts)
    extents = {}
    for f, k in wanted.items():
        offset = _join([part for s in shards for part in s.take_offsets(k)])
        extents[f] = Extents(files, offset, _join([part for s in shards for part in s.take_lengths(k)]))
    key_lengths = _join([part for s in shards for part in s.take_key_lengths()])
    key_offsets = np.zeros(len(key_lengths) + 1, dtype=np.int64)
    np.cumsum(key_lengths, out=key_offsets[1:])
    del key_lengths
    keys = np.frombuffer(b"".join(part for s in shards for part in s.take_keys()), dtype=np.uint8)
    values = {"__key__": Ragged(keys, key_offsets, "str")}
    decoders = {f: _DECODERS[f.rsplit(".", 1)[-1]] for f in fields if decode and f.rsplit(".", 1)[-1] in _DECODERS}
    return SampleIndex(PathTable.from_paths(paths), extents, values,
                       meta={"format": "webdataset", "fields": list(fields), "decode": decoders,
                             **object_versions(paths)})


def _join(parts: list[np.ndarray]) -> np.ndarray:
    out = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    parts.clear()
    return out


class _Shard:
    """The samples of one tar: per field its data offsets and lengths, the keys' UTF-8
    bytes and lengths, each as a list of parts (one per run of headers), handed over
    once each (``take_*``) so that joining them frees them."""

    def __init__(self, nfields: int) -> None:
        self.samples = 0
        self.offsets: list[list[np.ndarray]] = [[] for _ in range(nfields)]
        self.lengths: list[list[np.ndarray]] = [[] for _ in range(nfields)]
        self.keys: list[bytes] = []
        self.key_lengths: list[np.ndarray] = []

    def add(self, offsets: list[np.ndarray], lengths: list[np.ndarray], keys: bytes, key_lengths: np.ndarray) -> None:
        self.samples += len(key_lengths)
        for k in range(len(offsets)):
            self.offsets[k].append(offsets[k])
            self.lengths[k].append(lengths[k])
        self.keys.append(keys)
        self.key_lengths.append(key_lengths)

    def take_offsets(self, k: int) -> list[np.ndarray]:
        out, self.offsets[k] = self.offsets[k], []
        return out

    def take_lengths(self, k: int) -> list[np.ndarray]:
        out, self.lengths[k] = self.lengths[k], []
        return out

    def take_keys(self) -> list[bytes]:
        out, self.keys = self.keys, []
        return out

    def take_key_lengths(self) -> list[np.ndarray]:
        out, self.key_lengths = self.key_lengths, []
        return out


_WALK_FIELDS = 64  # the most fields the C walk takes (more: the full parser indexes the tar)


def _index_shard(wanted: dict[str, int], skip: bool, path: str, advance: Callable[[int], None]) -> _Shard:
    """The samples of one tar: the C header walk (``_tar.shard``) where it indexes the
    tar exactly, else (and for every error, so that messages name the exact header) the
    full parser."""
    f, size = open_regular_file(path, "tar file")
    with f:
        # an object in S3 or on HTTP has no descriptor: its headers are walked by ranged GETs (_scan)
        if (not is_url(path) and len(wanted) <= _WALK_FIELDS and size >= 2 * _BLOCK
                and not f.read(6).startswith(tuple(_COMPRESSED))):
            got = _tar.shard(f.fileno(), size, tuple(w.encode("utf-8") for w in wanted), skip)
            if got is not None:
                rows, keys, key_lengths, samples = got
                table = np.frombuffer(rows, dtype=np.int64).reshape(samples, 2, len(wanted))
                shard = _Shard(len(wanted))
                shard.add([table[:, 0, k] for k in range(len(wanted))], [table[:, 1, k] for k in range(len(wanted))],
                          keys, np.frombuffer(key_lengths, dtype=np.int64))
                advance(size)
                return shard
    shard = _Shard(len(wanted))
    _scan(path, wanted, skip, shard)
    advance(size)
    return shard


def _scan(path: str, wanted: dict[str, int], skip: bool, shard: _Shard) -> None:
    """Add the samples of one tar to ``shard``, parsing every header in turn."""
    offsets = [array("q") for _ in wanted]
    lengths = [array("q") for _ in wanted]
    keys = bytearray()
    key_lengths = array("q")
    f, size = open_regular_file(path, "tar file")
    with f:
        head = f.read(6)
        for magic, name in _COMPRESSED.items():
            if head.startswith(magic):
                raise FormatError(f"{name}-compressed tar: samples cannot be read in place from a compressed "
                                  f"tar; decompress it first", path=path, offset=0)
        f.seek(0)
        cur_key: str | None = None
        cur: dict[str, tuple[int, int]] = {}
        cur_at = 0

        def flush() -> None:
            if cur_key is None:
                return
            if len(cur) < len(wanted):
                if skip:
                    return
                absent = [w for w in wanted if w not in cur]
                raise FormatError(f"sample has no member for field(s) {absent}; fields present: "
                                  f"{sorted(cur) or 'none of those asked for'} (missing='skip' leaves such "
                                  f"samples out)", path=path, sample=f"key {cur_key!r}", offset=cur_at)
            for w, k in wanted.items():
                offsets[k].append(cur[w][0])
                lengths[k].append(cur[w][1])
            try:
                key = cur_key.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise FormatError("member name is not UTF-8", path=path,
                                  sample=f"key {cur_key!r}", offset=cur_at) from exc
            keys.extend(key)
            key_lengths.append(len(key))

        members = _members(f.pread if is_url(path) else functools.partial(os.pread, f.fileno()), path, size)
        try:
            for at, data_at, length, name in members:
                slash = name.rfind("/")
                dot = name.find(".", slash + 1)
                if dot <= slash + 1:
                    continue
                key, field = name[:dot], name[dot + 1:].lower()
                if key != cur_key:
                    flush()
                    cur_key, cur, cur_at = key, {}, at
                if field in wanted:
                    if field in cur:
                        raise FormatError(f"field {field!r} appears twice in one sample", path=path,
                                          sample=f"key {key!r}", offset=at)
                    cur[field] = (data_at, length)
        except FormatError as exc:
            members.throw(exc)
        flush()
    shard.add([np.frombuffer(o, dtype=np.int64) for o in offsets], [np.frombuffer(n, dtype=np.int64) for n in lengths],
              bytes(keys), np.frombuffer(key_lengths, dtype=np.int64))


_ZERO = bytes(_BLOCK)
_REGULAR = (b"0", b"\0", b"7")


def _number(field: bytes, path: str, at: int, what: str) -> int:
    """A tar numeric field: octal ASCII (NUL/space padded) or GNU base-256."""
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        return value if field[0] == 0x80 else value - (1 << (8 * len(field) - 8))
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise FormatError(f"bad tar header: {what} field {field!r} is not an octal number",
                          path=path, offset=at) from None


def _members(pread: Callable[[int, int], bytes], path: str, size: int) -> Iterator[tuple[int, int, int, str]]:
    """``(header offset, data offset, size, name)`` of each regular-file member.

    Parses ustar, GNU (long names) and pax (``path``/``size`` records) headers directly,
    several times faster than ``tarfile``, which builds an object per member. Headers
    are read through a small window that skips over member data, and their checksums
    are verified in bulk with NumPy.
    """
    pos, long_name, pax = 0, None, {}
    win_at, win = 0, b""
    headers, header_at = bytearray(), array("q")
    while True:
        if pos + _BLOCK > size:
            # a file that ends right after a member (a cut at a header boundary) would
            # otherwise pass for a shorter archive
            raise FormatError(f"truncated tar: {size - pos} bytes where a {_BLOCK}-byte header or the "
                              f"end-of-archive blocks should be (the file is cut short, or was written "
                              f"without its end-of-archive blocks)", path=path, offset=pos)
        if not win_at <= pos <= win_at + len(win) - _BLOCK:
            win_at, win = pos, pread(_WINDOW, pos)
        block = win[pos - win_at: pos - win_at + _BLOCK]
        if block == _ZERO:
            break
        headers += block
        header_at.append(pos)
        if len(header_at) >= _CHECK:
            _check_sums(headers, header_at, path)
            headers, header_at = bytearray(), array("q")
        typeflag = block[156:157]
        length = _number(block[124:136], path, pos, "size")
        if length < 0:
            raise FormatError(f"bad tar header: negative size {length}", path=path, offset=pos)
        data_at = pos + _BLOCK
        if typeflag in (b"x", b"L"):
            if length > 1 << 20 or data_at + length > size:
                raise FormatError(f"bad tar header: extended header of {length} bytes", path=path, offset=pos)
            data = pread(length, data_at)
            if typeflag == b"x":
                pax = _pax_records(data, path, data_at)
            else:
                long_name = data.split(b"\0", 1)[0]
        elif typeflag == b"S":
            raise FormatError("member is a sparse file; its bytes are not contiguous", path=path, offset=pos)
        elif typeflag not in (b"g", b"K"):
            name = block[:100].split(b"\0", 1)[0]
            if block[257:262] == b"ustar":
                prefix = block[345:500].split(b"\0", 1)[0]
                if prefix:
                    name = prefix + b"/" + name
            name = pax.get(b"path", long_name or name)
            if b"size" in pax:
                length = _pax_int(pax[b"size"], path, pos)
            if typeflag in _REGULAR:
                if data_at + length > size:
                    raise FormatError(f"truncated tar: member {name!r} needs bytes up to {data_at + length}, "
                                      f"the file has {size}", path=path, offset=data_at)
                try:
                    text = name.decode("utf-8")
                except UnicodeDecodeError:
                    raise FormatError(f"member name {name!r} is not UTF-8", path=path, offset=pos) from None
                try:
                    yield pos, data_at, length, text
                except FormatError:  # the caller found bad data: a bad header explains it best
                    _check_sums(headers, header_at, path)
                    raise
            long_name, pax = None, {}
        pos = data_at + -(-length // _BLOCK) * _BLOCK
    _check_sums(headers, header_at, path)


_CHECK = 8192  # headers per bulk checksum check (4 MiB of headers)
_WINDOW = 64 << 10


def _check_sums(headers: bytearray, header_at: array, path: str) -> None:
    """Verify the checksums of a run of headers (concatenated in ``headers``)."""
    if not header_at:
        return
    blocks = np.frombuffer(headers, dtype=np.uint8).reshape(-1, _BLOCK)
    computed = blocks.sum(axis=1, dtype=np.int64) - blocks[:, 148:156].sum(axis=1, dtype=np.int64) + 8 * 32
    stored = _octal_fields(blocks[:, 148:156])
    bad = np.flatnonzero(computed != stored)
    if bad.size:
        k = int(bad[0])
        raise FormatError(f"bad tar header: checksum mismatch (stored {int(stored[k])}, computed "
                          f"{int(computed[k])})", path=path, offset=int(header_at[k]))


def _octal_fields(fields: np.ndarray) -> np.ndarray:
    """Octal numbers in fixed-width ASCII fields, one per row: leading spaces, digits,
    then a NUL or space. A row that is not of that form gives -1."""
    digit = (fields >= ord("0")) & (fields <= ord("7"))
    value = np.zeros(len(fields), dtype=np.int64)
    state = np.zeros(len(fields), dtype=np.int8)  # 0 leading blanks, 1 digits, 2 ended
    bad = np.zeros(len(fields), dtype=bool)
    for j in range(fields.shape[1]):
        col, dig = fields[:, j], digit[:, j]
        blank = (col == ord(" ")) | (col == 0)
        take = dig & (state < 2)
        value = np.where(take, value * 8 + (col.astype(np.int64) - ord("0")), value)
        bad |= dig & (state == 2)
        bad |= ~dig & ~blank
        state = np.where(take, 1, np.where(blank & (state == 1), 2, state))
    return np.where(bad, -1, value)


def _pax_records(data: bytes, path: str, at: int) -> dict[bytes, bytes]:
    """``key=value`` records of a pax extended header (``"%d %s=%s\\n"`` each)."""
    out, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        space = data.find(b" ", pos)
        try:
            n = int(data[pos:space]) if space > pos else -1
        except ValueError:
            n = -1
        record = data[space + 1: pos + n - 1] if n > 0 else b""
        if n <= 0 or pos + n > len(data) or b"=" not in record or data[pos + n - 1: pos + n] != b"\n":
            raise FormatError("bad tar header: malformed pax record", path=path, offset=at + pos)
        key, value = record.split(b"=", 1)
        out[key] = value
        pos += n
    return out


def _pax_int(value: bytes, path: str, at: int) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise FormatError(f"bad tar header: pax size {value!r}", path=path, offset=at)
    return n
