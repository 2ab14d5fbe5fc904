"""WebDataset shards: samples stored as consecutive members of uncompressed tar files.

A member ``a/b/000123.seg.png`` belongs to the sample with key ``a/b/000123`` (the
path up to the first dot of the base name) and holds its field ``seg.png`` (the rest,
lowercased, as WebDataset does). Consecutive members with the same key form one
sample. Members that are not regular files, and base names without a dot or starting
with one, are skipped.

Only headers are read: each field's extent points at the member's bytes inside the
tar, so a batch is read straight from the shards. Compressed tars (``.tar.gz``...)
cannot be read in place and are refused.
"""

from __future__ import annotations

import os
import tarfile
from array import array
from collections.abc import Sequence

import numpy as np

from gpuio.errors import ConfigError, DataError, FormatError, StorageError
from gpuio.index import Extents, PathTable, Ragged, SampleIndex

__all__ = ["webdataset"]

_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd",
               b"\x04\x22\x4d\x18": "lz4"}
_BLOCK = 512


def webdataset(tar_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
               fields: Sequence[str] = ("jpg", "cls"), missing: str = "error") -> SampleIndex:
    """Index the samples of one or more tar shards, concatenated in the order given.

    Each name in ``fields`` (an extension such as ``"jpg"`` or ``"seg.png"``) becomes
    an extent field holding that member's bytes; ``__key__`` holds each sample's key
    (``str``). A sample without one of ``fields`` raises ``FormatError`` naming the tar
    and key (``missing="error"``) or is left out (``missing="skip"``).
    """
    if isinstance(fields, str):
        fields = (fields,)
    fields = tuple(f.lower() for f in fields)
    if not fields or len(set(fields)) != len(fields) or "__key__" in fields or "" in fields:
        raise ConfigError(f"fields {fields!r}: give distinct member extensions such as ('jpg', 'cls')")
    if missing not in ("error", "skip"):
        raise ConfigError(f"missing {missing!r}; choose 'error' or 'skip'")
    paths = [os.path.abspath(os.fspath(tar_paths))] if isinstance(tar_paths, (str, os.PathLike)) else \
        [os.path.abspath(os.fspath(p)) for p in tar_paths]
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
    values = {"__key__": Ragged(np.frombuffer(bytes(keys), dtype=np.uint8).copy(), key_offsets, "str")}
    return SampleIndex(PathTable.from_paths(paths), extents, values,
                       meta={"format": "webdataset", "fields": list(fields)})


def _scan(path: str, t: int, wanted: dict[str, int], skip: bool, tar_id: array, offsets: list[array],
          lengths: list[array], keys: bytearray, key_lengths: array) -> None:
    """Append the samples of one tar to the output arrays."""
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise StorageError(f"cannot open tar file: {exc.strerror or exc}", path=path) from exc
    with f:
        size = os.fstat(f.fileno()).st_size
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
            except UnicodeEncodeError as exc:  # tarfile keeps undecodable bytes as surrogates
                raise FormatError("member name is not UTF-8", path=path,
                                  sample=f"key {cur_key!r}", offset=cur_at) from exc
            keys.extend(key)
            key_lengths.append(len(key))

        tf = None
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
            while True:
                info = tf.next()
                if info is None:
                    break
                tf.members.clear()  # stream: keep no TarInfo per member
                at = info.offset
                if not info.isreg():
                    continue
                end = info.offset_data + info.size
                if end > size:
                    raise FormatError(f"truncated tar: member {info.name!r} needs bytes up to {end}, the file "
                                      f"has {size}", path=path, offset=info.offset_data)
                if info.issparse():
                    raise FormatError(f"member {info.name!r} is a sparse file; its bytes are not contiguous",
                                      path=path, offset=at)
                name = info.name
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
                    cur[field] = (info.offset_data, info.size)
            flush()
            end_at = tf.offset
        except FormatError:
            raise
        except (tarfile.TarError, ValueError, UnicodeError, OverflowError) as exc:
            at = tf.offset if tf is not None else 0
            raise FormatError(f"bad tar header: {exc}", path=path, offset=at) from exc
        # tarfile ends quietly at an unreadable header after the first: check what stopped it
        if end_at < size:
            block = os.pread(f.fileno(), _BLOCK, end_at)
            if len(block) < _BLOCK:
                raise FormatError(f"truncated tar: {len(block)} bytes where a {_BLOCK}-byte header or the "
                                  f"end-of-archive block should be", path=path, offset=end_at)
            if block.count(0) != _BLOCK:
                try:
                    tarfile.TarInfo.frombuf(block, tarfile.ENCODING, "surrogateescape")
                    reason = "unreadable header"
                except (tarfile.TarError, ValueError, UnicodeError, OverflowError) as exc:
                    reason = str(exc)
                raise FormatError(f"bad tar header: {reason}", path=path, offset=end_at)
