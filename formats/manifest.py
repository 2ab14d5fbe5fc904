"""Speech manifests: NeMo's JSON lines, one utterance per line::

    {"audio_filepath": "wavs/a.flac", "duration": 3.2, "text": "hello", "offset": 0.5}

Fields: ``data`` (the bytes of the whole audio file), ``text`` (str), ``duration``
and ``offset`` (float64 seconds; offset 0 when absent, duration NaN when absent).
Relative paths resolve against the manifest's folder; several lines may name one
file (segments of a long recording), which is then listed once.

The ``data`` extent is the whole file, not the segment's bytes: compressed formats
(FLAC, OGG, MP3) cannot be decoded from a slice of their bytes, and even WAV needs its
header. ``ops.decode_audio`` applies ``offset`` and ``duration`` after the read: it
seeks the decoder to ``offset`` and decodes ``duration`` seconds (as NeMo does). A
long recording split into many segments is therefore read once per segment.

The manifest may be a URL (``s3://``, ``http(s)://``), read by one GET; its audio paths
then resolve as URL references do: a relative path against the manifest's folder, a
path from ``/`` against the bucket (or host), a URL as it is. Each audio object's size
and ETag come from a HEAD request, many in flight.
"""

from __future__ import annotations

import io
import json
import math
import os
import posixpath
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from gpuio.errors import DataError, FormatError, StorageError
from gpuio.formats._files import open_regular_file, regular_file_size
from gpuio.storage.remote import is_url, object_versions
from gpuio.index import Extents, PathTable, Ragged, SampleIndex

__all__ = ["manifest"]


def manifest(path: str | os.PathLike[str]) -> SampleIndex:
    """Index a NeMo JSON-lines manifest (see the module docstring). A line that is not
    a JSON object with a string ``audio_filepath`` and numeric ``duration``/``offset``
    (when present) is a ``FormatError`` naming the line and its byte offset; the
    manifest or an audio file that cannot be read is a ``StorageError``, one that is
    not a regular file (a directory, a FIFO) a ``DataError``, naming the file."""
    path = os.fspath(path)
    remote = is_url(path)
    if not remote:
        path = os.path.abspath(path)
    file_ids: dict[str, int] = {}
    ids, texts, durations, offsets = [], [], [], []
    pos = 0
    f, _ = open_regular_file(path, "manifest")
    if remote:  # one GET, then read as a local file
        with f:
            f = io.BytesIO(f.read())
    try:
        with f:
            for lineno, raw in enumerate(f, 1):
                if raw.strip():
                    rel, text, duration, offset = _entry(raw, path, lineno, pos)
                    full = _resolve(path, rel, remote)
                    ids.append(file_ids.setdefault(full, len(file_ids)))
                    texts.append(text)
                    durations.append(duration)
                    offsets.append(offset)
                pos += len(raw)
    except OSError as exc:
        raise StorageError(f"cannot read manifest: {exc.strerror or exc}", path=path) from exc
    if not ids:
        raise DataError("no samples: the manifest has no entries", path=path)
    files = list(file_ids)
    what = f"sound file named in manifest {path}"
    with ThreadPoolExecutor(max_workers=16) as pool:  # a HEAD request per object: many in flight
        sizes = np.array(list(pool.map(lambda full: regular_file_size(full, what), files)), dtype=np.int64)
    file_id = np.asarray(ids, dtype=np.int32)
    extents = Extents(file_id, np.zeros(len(ids), dtype=np.int64), sizes[file_id])
    values = {
        "text": Ragged.from_list(texts, kind="str"),
        "duration": np.asarray(durations, dtype=np.float64),
        "offset": np.asarray(offsets, dtype=np.float64),
    }
    return SampleIndex(PathTable.from_paths(files), {"data": extents}, values,
                       meta={"format": "manifest", "manifest": path, **object_versions(files)})


def _resolve(manifest: str, rel: str, remote: bool) -> str:
    """The audio file ``rel`` named in ``manifest``: a local path against the
    manifest's folder, or, in a URL manifest, a URL reference (see the module docstring)."""
    if not remote:
        return os.path.normpath(os.path.join(os.path.dirname(manifest), rel))
    if is_url(rel):
        return rel
    scheme, _, rest = manifest.partition("://")
    host, _, key = rest.partition("/")
    key = posixpath.join(posixpath.dirname("/" + key), rel)
    return f"{scheme}://{host}{posixpath.normpath(key)}"


def _entry(raw: bytes, path: str, lineno: int, pos: int) -> tuple[str, str, float, float]:
    where = {"path": path, "sample": f"line {lineno}", "offset": pos}
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"not a JSON object: {exc}", **where) from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("audio_filepath"), str):
        raise FormatError("expected a JSON object with a string 'audio_filepath'", **where)
    text = obj.get("text", "")
    if not isinstance(text, str):
        raise FormatError(f"'text' must be a string, got {type(text).__name__}", **where)
    numbers = []
    for key, default in (("duration", math.nan), ("offset", 0.0)):
        value = obj.get(key, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (key == "offset" and value < 0):
            raise FormatError(f"'{key}' must be a number of seconds (offset >= 0), got {value!r}", **where)
        numbers.append(float(value))
    return obj["audio_filepath"], text, numbers[0], numbers[1]
