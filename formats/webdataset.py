"""WebDataset shards: samples stored as consecutive members of uncompressed tar files.

A member ``a/b/000123.seg.png`` belongs to the sample with key ``a/b/000123`` (the
path up to the first dot of the base name) and holds its field ``seg.png`` (the rest,
lowercased, as WebDataset does). Consecutive members with the same key form one
sample. Members that are not regular files, and base names without a dot or starting
with one, are skipped.

Only headers are read: each field's extent points at the member's bytes inside the
tar, so a batch is read straight from the shards. Compressed tars (``.tar.gz``...)
cannot be read in place and are refused.

After the read, fields are decoded by their last extension as the webdataset package's
default decoders do (``webdataset.autodecode.basichandlers``): ``txt``, ``text``,
``transcript`` -> ``str``; ``cls``, ``cls2``, ``index``, ``inx``, ``id`` -> ``int``;
``json``, ``jsn`` -> the JSON object; ``npy`` -> array; ``npz`` -> dict of arrays.
Every other extension stays bytes, pickles and torch files included (on purpose:
loading them runs code; decode them yourself if you trust the data).
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Iterator, Sequence

import numpy as np

from gpuio.errors import ConfigError, DataError, FormatError
from gpuio.formats._files import open_regular_file, shard_paths
from gpuio.index import Extents, PathTable, Ragged, SampleIndex

__all__ = ["webdataset"]

_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd",
               b"\x04\x22\x4d\x18": "lz4"}
_BLOCK = 512
# last extension -> field decoder (gpuio._fielddecode), as the webdataset package decodes them
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
    paths = [os.path.abspath(p) for p in shard_paths(tar_paths, "tar file")]
    if not paths:
        raise DataError("no samples: an empty list of tar files was given")

    wanted = {f: k for k, f in enumerate(fields)}
    tar_id = array("i")
    offsets = [array("q") for _ in fields]
    lengths = [array("q") for _ in fields]
    keys = bytearray()
    key_lengths = array("q")
    for t, path in enumerate(paths):
        _scan(path, t, wanted, missing == "skip", tar_id, offsets, lengths, keys, key_lengths)
    if not tar_id:
        raise DataError(f"no samples with fields {list(fields)} in {len(paths)} tar file(s)", path=paths[0])

    files = np.frombuffer(tar_id, dtype=np.int32).copy()
    extents = {f: Extents(files, np.frombuffer(offsets[k], dtype=np.int64).copy(),
                          np.frombuffer(lengths[k], dtype=np.int64).copy()) for f, k in wanted.items()}
    key_offsets = np.zeros(len(key_lengths) + 1, dtype=np.int64)
    np.cumsum(np.frombuffer(key_lengths, dtype=np.int64), out=key_offsets[1:])
    values = {"__key__": Ragged(np.frombuffer(keys, dtype=np.uint8).copy(), key_offsets, "str")}
    decoders = {f: _DECODERS[f.rsplit(".", 1)[-1]] for f in fields if decode and f.rsplit(".", 1)[-1] in _DECODERS}
    return SampleIndex(PathTable.from_paths(paths), extents, values,
                       meta={"format": "webdataset", "fields": list(fields), "decode": decoders})


def _scan(path: str, t: int, wanted: dict[str, int], skip: bool, tar_id: array, offsets: list[array],
          lengths: list[array], keys: bytearray, key_lengths: array) -> None:
    """Append the samples of one tar to the output arrays."""
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
            tar_id.append(t)
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

        members = _members(f.fileno(), path, size)
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


def _members(fd: int, path: str, size: int) -> Iterator[tuple[int, int, int, str]]:
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
            win_at, win = pos, os.pread(fd, _WINDOW, pos)
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
            data = os.pread(fd, length, data_at)
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
