"""``gpuio.pack``: any index rewritten as gpuio's packed layout (``gpuio.formats.packed``
describes it).

The source's samples are cut, in order, into shards of about ``pack_shard_size`` source
bytes; each shard is one task (read its samples, apply the image policy, lay out its
records, write it whole), run here or on ``workers`` processes. A shard depends only
on its samples and the options, so the same source and options give the same bytes,
whatever the workers. The destination holds a lock (``.gpuio-pack.lock``) while a pack
runs, and a progress file (``.gpuio-pack.json``: the source's fingerprint, the options
and each finished shard's size and CRC-32C); a pack that finds one of the same source and
options keeps the shards still there as written (``_Dest.holds``) and writes the rest. ``index.json`` is
written last.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
import socket
import warnings
from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, NamedTuple

import numpy as np
from crc32c import crc32c

from gpuio import config
from gpuio.errors import ConfigError, DataError, DependencyError, FormatError, StorageError
from gpuio.formats.packed import (BLOCK, FORMAT_NAME, HEADER_BYTES, INDEX_NAME, PAGE, VERSION, Header, align,
                                  join, place, value_schema, values_blob)
from gpuio.index import Ragged, SampleIndex
from gpuio.storage.remote import is_http, is_url

__all__ = ["DEFAULT_RESTART_INTERVAL", "ImagePolicy", "pack", "ray_pack"]

LOCK_NAME = ".gpuio-pack.lock"
PROGRESS_NAME = ".gpuio-pack.json"
_READ_ROWS = 256  # samples read from the source per batch
# MCUs per restart interval when the policy names none: chosen by bench/restart.py (bench/RESULTS.md)
DEFAULT_RESTART_INTERVAL = 4
_UNMARKED = ("not_jpeg", "refused")  # why an image was kept without restart markers


class ImagePolicy(NamedTuple):
    """How ``pack`` stores an image field. The default adds restart markers to JPEGs
    (lossless) and keeps every other image's bytes.

    - ``restart_interval``: add JPEG restart markers every this many MCUs (lossless; the
      interval fitted to the image's MCU rows as ``gpuio.ops.restart.add_restart_markers``
      fits it) and store their offsets in ``<field>.restarts``; 0: none, the source's
      bytes; None (the default): ``DEFAULT_RESTART_INTERVAL`` where ``gpuio.ops._jpeg``
      was built, else 0 (with a warning), and 0 where the source has the field's offsets
      already (a packed dataset). Images that are not JPEGs, and JPEGs that
      libjpeg's transcoder refuses (truncated, lossless, 12-bit ...), keep their bytes and
      an empty ``<field>.restarts``; the packed index counts them in
      ``meta["unmarked"]`` (``{field: {"not_jpeg": n, "refused": n}}``);
    - ``max_side``: images whose longer side exceeds this many pixels are resized
      (area filter) to that longer side and re-encoded as baseline 4:2:0 RGB JPEGs at
      ``quality`` (lossy); 0: none;
    - ``raw_below``: images of fewer encoded bytes than this are stored as raw RGB pixels
      (an uncompressed TIFF: decoding is a copy); 0: none.
    """

    restart_interval: int | None = None
    max_side: int = 0
    quality: int = 90
    raw_below: int = 0

    def check(self, field: str) -> None:
        """A ``ConfigError`` naming ``field`` unless every value is one a pack can use."""
        for name, value in self._asdict().items():
            if value is None and name == "restart_interval":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"image policy of {field!r}: {name} must be a non-negative integer, got {value!r}")
        if not 1 <= self.quality <= 100:
            raise ConfigError(f"image policy of {field!r}: quality {self.quality}, choose 1 to 100")
        if (self.restart_interval or 0) > 0xFFFF:
            raise ConfigError(f"image policy of {field!r}: restart_interval {self.restart_interval}; a JPEG's "
                              f"restart interval is at most 65535 MCUs")
        if self.restart_interval:
            _restart_markers()


def _restart_markers() -> Any:
    """``gpuio.ops.restart`` (imported when used: it loads the decoders); a
    ``ConfigError`` where its transcoder, ``gpuio.ops._jpeg``, was not built."""
    from gpuio.ops import restart
    from gpuio.ops.decode import native_jpeg

    if native_jpeg() is None:
        raise ConfigError("restart markers need gpuio.ops._jpeg, which was not built (rebuild gpuio with a C "
                          "compiler and libjpeg's headers; gpuio info lists the C extensions)")
    return restart


def pack(source: SampleIndex | str | os.PathLike[str], dest: str | os.PathLike[str], *,
         images: ImagePolicy | Mapping[str, ImagePolicy] = ImagePolicy(), workers: int = 1,
         shard_size: int | None = None) -> str:
    """Write ``source`` (an index, or a path gpuio indexes: a saved index, a packed
    dataset, a file tree) as a packed dataset in ``dest`` (a folder, or an ``s3://``
    prefix); returns ``dest``. Read it with ``gpuio.formats.packed(dest)``.

    ``images``: one ``ImagePolicy`` for every image field, or ``{field: policy}`` (other
    fields keep their bytes); the default adds restart markers to the JPEGs (lossless),
    ``ImagePolicy(restart_interval=0)`` keeps every byte of the source. ``workers``:
    processes writing shards at once.
    ``shard_size``: source bytes per shard (default: the ``pack_shard_size`` setting).
    Every field of the source is kept, in its order, with its metadata. A pack
    interrupted before its end goes on where it stopped when run again with the same
    source and options; a second pack into a destination in use is refused."""
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    return _pack(source, dest, images, shard_size, functools.partial(_run_local, workers=workers))


def ray_pack(source: SampleIndex | str | os.PathLike[str], dest: str | os.PathLike[str], *,
             images: ImagePolicy | Mapping[str, ImagePolicy] = ImagePolicy(), shard_size: int | None = None,
             address: str | None = None, max_retries: int = 3) -> str:
    """``gpuio.ray.pack``: ``pack`` with each shard a Ray task on the cluster at
    ``address`` (default: the one this process is connected to, else a new local one).
    ``dest`` must be reachable from every node (an ``s3://`` prefix, or a shared file
    system). A task whose worker dies is run again (up to ``max_retries`` times); it
    writes the same bytes, so the result equals an undisturbed pack."""
    try:
        import ray
    except ImportError as exc:
        raise DependencyError(f"gpuio.ray.pack needs Ray (pip install 'gpuio[ray]'): {exc}") from exc
    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR")
    return _pack(source, dest, images, shard_size, functools.partial(_run_ray, max_retries=max_retries))


def _pack(source: SampleIndex | str | os.PathLike[str], dest: str | os.PathLike[str],
          images: ImagePolicy | Mapping[str, ImagePolicy], shard_size: int | None, run: Any) -> str:
    """``pack`` with ``run(job, todo, bounds, finished)`` writing the shards ``todo``."""
    from gpuio.formats._files import progress
    from gpuio.storage import learn_lengths

    label = os.fspath(source) if not isinstance(source, SampleIndex) else None
    index = learn_lengths(_open_source(label) if label is not None else source)
    shard_size = config.get("pack_shard_size") if shard_size is None else shard_size
    if shard_size < 1:
        raise ConfigError(f"shard_size must be at least 1 byte, got {shard_size}")
    policies = _policies(index, images)
    spec = _spec(index, policies, label, shard_size)
    bounds = _bounds(index, shard_size)
    out = _Dest(os.fspath(dest))
    existing = out.read_json(INDEX_NAME)
    if existing is not None:
        if (existing.get("source"), existing.get("options")) == (spec["source"], spec["options"]):
            return out.base
        raise ConfigError(f"{out.base} holds a packed dataset of another source or options; choose another "
                          f"destination or remove it")
    with out.lock():
        state = out.read_json(PROGRESS_NAME)
        if state is not None and (state.get("source"), state.get("options")) != (spec["source"], spec["options"]):
            raise ConfigError(f"{out.base} holds an unfinished pack of another source or options "
                              f"({PROGRESS_NAME}); choose another destination or remove it")
        done: dict[int, dict[str, Any]] = {}
        for key, info in (state or {}).get("done", {}).items():
            if out.holds(info):  # a shard kept must read back as it was written
                done[int(key)] = info
        todo = [k for k in range(len(bounds)) if k not in done]

        def record(k: int, info: dict[str, Any]) -> None:
            done[k] = info
            out.write(PROGRESS_NAME, _dumps({"source": spec["source"], "options": spec["options"],
                                            "done": {str(j): done[j] for j in sorted(done)}}))

        job = _Job(index, spec, policies, out.base)
        counts = np.diff(np.array([0] + [e for _, e in bounds]))
        with progress(f"packing into {out.base}", len(index), "sample") as advance:
            advance(int(sum(counts[k] for k in done)))
            run(job, todo, bounds, lambda k, info: (record(k, info), advance(int(counts[k]))))
        spec["shards"] = [done[k] for k in range(len(bounds))]
        if job.marked:
            spec["meta"]["unmarked"] = {f: {why: sum(s["unmarked"][f][why] for s in spec["shards"])
                                            for why in _UNMARKED} for f in job.marked}
        out.write(INDEX_NAME, _dumps(spec))
        out.remove(PROGRESS_NAME)
    return out.base


def _run_local(job: _Job, todo: list[int], bounds: list[tuple[int, int]], finished: Any, workers: int) -> None:
    """The shards ``todo`` here (``workers`` 1) or on ``workers`` forked processes,
    ``finished(k, info)`` as each ends. Forked, as torch's DataLoader workers are (gpuio
    renews its threads, pools and clients in a forked child): a spawned process would run
    the caller's script again."""
    if workers == 1 or len(todo) <= 1:
        try:
            for k in todo:
                finished(k, job.shard(k, *bounds[k]))
        finally:
            job.close()
        return
    with ProcessPoolExecutor(min(workers, len(todo)), mp_context=multiprocessing.get_context("fork"),
                             initializer=_init_worker, initargs=(job,)) as pool:
        pending = {pool.submit(_worker_shard, k, *bounds[k]): k for k in todo}
        try:
            while pending:
                ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in ready:
                    finished(pending.pop(future), future.result())
        finally:
            for future in pending:
                future.cancel()


def _run_ray(job: _Job, todo: list[int], bounds: list[tuple[int, int]], finished: Any, max_retries: int) -> None:
    """The shards ``todo`` as Ray tasks (the job sent once, through the object store),
    ``finished(k, info)`` as each ends."""
    import ray

    task = ray.remote(num_cpus=1, max_retries=max_retries)(_ray_shard)
    shared = ray.put(job)
    pending = {task.remote(shared, k, *bounds[k]): k for k in todo}
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                finished(pending.pop(ref), ray.get(ref))
    finally:
        for ref in pending:
            ray.cancel(ref)


def _ray_shard(job: _Job, k: int, start: int, end: int) -> dict[str, Any]:
    try:
        return job.shard(k, start, end)
    finally:
        job.close()


_worker_job: _Job | None = None


def _init_worker(job: _Job) -> None:
    global _worker_job
    _worker_job = job


def _worker_shard(k: int, start: int, end: int) -> dict[str, Any]:  # after _init_worker
    return _worker_job.shard(k, start, end)


def _open_source(path: str) -> SampleIndex:
    """The index of a path gpuio reads: a saved index, a packed dataset, a file tree."""
    from gpuio import formats

    if is_url(path):
        return formats.packed(path) if path.endswith(INDEX_NAME) or _has_object(join(path, INDEX_NAME)) \
            else formats.filetree(path)
    if os.path.isfile(path):
        return formats.packed(path) if path.endswith(INDEX_NAME) else SampleIndex.load(path)
    if os.path.isfile(os.path.join(path, INDEX_NAME)):
        return formats.packed(path)
    return formats.filetree(path)


def _has_object(url: str) -> bool:
    from gpuio.storage.remote import client

    try:
        client().head(url)
    except (DataError, StorageError):  # missing (404), or not to be had
        return False
    return True


def _policies(index: SampleIndex, images: ImagePolicy | Mapping[str, ImagePolicy]) -> dict[str, ImagePolicy]:
    """``{field: policy}`` of the image fields a policy changes (checked)."""
    from gpuio.pipeline._opfields import image_fields

    if isinstance(images, ImagePolicy):
        chosen = {f: images for f in image_fields(index) if f in index.extents}
    else:
        chosen = dict(images)
        wrong = [f for f in chosen if f not in index.extents]
        if wrong:
            raise ConfigError(f"image policies for {wrong}, which are not byte fields of the source; its byte "
                              f"fields: {list(index.extents)}")
    for field, policy in chosen.items():
        if not isinstance(policy, ImagePolicy):
            raise ConfigError(f"the policy of {field!r} is a {type(policy).__name__}; give a gpuio.ImagePolicy")
    if any(p.restart_interval is None for p in chosen.values()):
        from gpuio.ops.restart import restarts_field

        default = _default_interval()  # a field whose offsets the source has (a packed dataset) keeps them
        chosen = {f: p if p.restart_interval is not None else
                  p._replace(restart_interval=0 if restarts_field(f) in index.fields else default)
                  for f, p in chosen.items()}
    for field, policy in chosen.items():
        policy.check(field)
        if policy.restart_interval and _restart_markers().restarts_field(field) in index.fields:
            raise ConfigError(f"the source has a field {_restart_markers().restarts_field(field)!r} already")
    return {f: p for f, p in chosen.items() if p != ImagePolicy(restart_interval=0)}


def _default_interval() -> int:
    """``DEFAULT_RESTART_INTERVAL``, or 0 with a warning where ``gpuio.ops._jpeg`` (the
    transcoder) was not built: a pack by default never fails for want of it."""
    from gpuio.ops.decode import native_jpeg

    if native_jpeg() is not None:
        return DEFAULT_RESTART_INTERVAL
    warnings.warn("packing the images as their source bytes, without the default restart markers: "
                  "gpuio.ops._jpeg was not built (rebuild gpuio with a C compiler and libjpeg's headers for "
                  "crops that decode faster)", UserWarning, stacklevel=5)
    return 0


def _spec(index: SampleIndex, policies: dict[str, ImagePolicy], label: str | None, shard_size: int
          ) -> dict[str, Any]:
    """``index.json`` but its shards."""
    from gpuio.pipeline._opfields import image_fields

    extents = []
    for f in index.extents:
        extents.append(f)
        if f in policies and policies[f].restart_interval:
            extents.append(_restart_markers().restarts_field(f))
    intervals = {f: p.restart_interval for f, p in policies.items() if p.restart_interval}
    meta = {k: v for k, v in index.meta.items()
            if k not in ("format", "remote", "images", "options", "source", "unmarked")}
    options = {"shard_size": shard_size, "images": {f: p._asdict() for f, p in sorted(policies.items())},
               "restart_interval": (next(iter(intervals.values())) if len(set(intervals.values())) == 1
                                    else intervals) if intervals else 0}
    return {"format": FORMAT_NAME, "version": VERSION, "samples": len(index),
            "extents": extents, "values": {n: value_schema(c) for n, c in index.values.items()},
            "parser": ({"name": index.parser.name, "config": index.parser.config()} if index.parser else None),
            "images": [f for f in image_fields(index) if f in index.extents], "meta": meta,
            "options": options, "source": _source(index, label)}


def _source(index: SampleIndex, label: str | None) -> dict[str, Any]:
    """What the pack came from: the path given (else the index's first file), its format,
    sample count and a SHA-256 of the whole index (file names, extents, values, parser)."""
    h = hashlib.sha256()
    h.update(index.files.blob.tobytes())
    h.update(index.files.offsets.tobytes())
    for name, ext in index.extents.items():
        h.update(name.encode() + b"\0")
        for a in (ext.file, ext.offset, ext.length):
            h.update(a.tobytes())
    for name, col in index.values.items():
        h.update(name.encode() + b"\0")
        parts = [col.values, col.offsets] if isinstance(col, Ragged) else [col]
        for a in parts:
            h.update(str(a.dtype).encode() + np.ascontiguousarray(a).tobytes())
    if index.parser is not None:
        h.update(json.dumps([index.parser.name, index.parser.config()], sort_keys=True).encode())
    first = index.files[0] if len(index.files) else ""
    return {"path": label if label is not None else first, "format": index.meta.get("format", "unknown"),
            "samples": len(index), "sha256": h.hexdigest()}


def _bounds(index: SampleIndex, shard_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` sample ranges of the shards: in order, each closed once its source
    bytes reach ``shard_size`` (at least one sample per shard)."""
    sizes = np.zeros(len(index), dtype=np.int64)
    for ext in index.extents.values():
        sizes += np.maximum(ext.length, 0)
    bounds, start, total = [], 0, 0
    for k, n in enumerate(sizes.tolist()):
        total += n
        if total >= shard_size:
            bounds.append((start, k + 1))
            start, total = k + 1, 0
    if start < len(index) or not bounds:
        bounds.append((start, len(index)))
    return bounds


def _dumps(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()


class _Job:
    """What a shard task needs: the source, ``index.json``'s schema, the policies and the
    destination."""

    def __init__(self, index: SampleIndex, spec: dict[str, Any], policies: dict[str, ImagePolicy], dest: str):
        self.index, self.spec, self.policies, self.dest = index, spec, policies, dest
        self.marked = [f for f, p in policies.items() if p.restart_interval]  # fields given restart markers
        self._reader: Any = None

    def close(self) -> None:
        """End the reader's threads and close its files (a later shard makes a new one)."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def shard(self, k: int, start: int, end: int) -> dict[str, Any]:
        """Write shard ``k`` (samples ``start..end``); its entry in ``index.json``."""
        from gpuio.storage import Reader

        if self._reader is None:
            self._reader = Reader("cpu")
        rows = np.arange(start, end)
        records: list[list[Any]] = [[] for _ in rows]
        unmarked = {f: dict.fromkeys(_UNMARKED, 0) for f in self.marked}
        for a in range(0, len(rows), _READ_ROWS):
            part = rows[a: a + _READ_ROWS]
            for field in self.index.extents:
                got = self._reader.read(self.index, part, field)
                for j, data in enumerate(got):
                    try:
                        records[a + j].extend(self._store(field, int(part[j]), data, unmarked))
                    except DataError as exc:  # a decode or a transcode: name the source's file and record
                        where = self.index.extent(int(part[j]), field)
                        raise type(exc)(f"packing field {field!r}: {exc.reason}", path=where.file,
                                        offset=where.offset, sample=int(part[j])) from exc
        name = f"shard-{k:05d}.gpk"
        values = {n: (c.take(rows) if isinstance(c, Ragged) else c[rows]) for n, c in self.index.values.items()}
        pieces = _layout(records, len(self.spec["extents"]), values)
        crc = 0
        for piece in pieces:
            crc = crc32c(piece, crc)
        _Dest(self.dest).write(name, pieces)
        info = {"name": name, "samples": len(rows), "bytes": sum(len(p) for p in pieces), "crc32c": crc}
        return {**info, "unmarked": unmarked} if unmarked else info

    def _store(self, field: str, sample: int, data: Any, unmarked: dict[str, dict[str, int]]) -> list[Any]:
        """The records ``field``'s bytes ``data`` of ``sample`` become (the image, then
        its restart offsets where the policy adds markers); an image kept without
        markers is counted in ``unmarked[field]``."""
        policy = self.policies.get(field)
        if policy is None:
            return [data]  # a view of the read buffer, written as it is
        raw = bytes(memoryview(data))
        from gpuio.ops.decode import image_format

        out = raw
        if policy.raw_below and len(raw) < policy.raw_below:
            out = _raw_pixels(raw, sample)
        elif policy.max_side and image_format(raw) is not None:
            out = _shrunk(raw, sample, policy.max_side, policy.quality)
        if not policy.restart_interval:
            return [out]
        if image_format(out) != "jpeg":
            unmarked[field]["not_jpeg"] += 1
            return [out, b""]
        try:
            marked, offsets = _restart_markers().add_restart_markers(out, policy.restart_interval)
        except FormatError:  # libjpeg cannot transcode it; the reader decodes (or refuses) it as it would the source
            unmarked[field]["refused"] += 1
            return [out, b""]
        return [bytes(marked), np.ascontiguousarray(offsets, dtype="<u4").tobytes()]


def _raw_pixels(data: bytes, sample: int) -> bytes:
    """An image's RGB pixels as an uncompressed TIFF (orientation applied)."""
    import io

    from PIL import Image

    from gpuio.ops.decode import decode_cpu

    out = io.BytesIO()
    Image.fromarray(decode_cpu(data, "rgb", sample)).save(out, format="TIFF")
    return out.getvalue()


def _shrunk(data: bytes, sample: int, max_side: int, quality: int) -> bytes:
    """``data`` itself when its longer side is at most ``max_side``; else resized (area
    filter, orientation applied) to that longer side and encoded as a baseline 4:2:0
    RGB JPEG at ``quality``."""
    import simplejpeg

    from gpuio.batch import Batch
    from gpuio.ops import resize
    from gpuio.ops.decode import decode_cpu, jpeg_info

    info = jpeg_info(data)
    if info is not None and info.height and max(info.height, info.width) <= max_side:
        return data
    img = decode_cpu(data, "rgb", sample)
    if max(img.shape[:2]) <= max_side:
        return data
    batch = Batch({"image": [img]}, np.array([sample]), np.zeros(1, dtype=np.uint64))
    small = resize(longer=max_side, interp="area")(batch).data["image"][0]
    return simplejpeg.encode_jpeg(np.ascontiguousarray(small), quality=quality, colorspace="RGB",
                                  colorsubsampling="420")


_ZEROS = memoryview(bytes(BLOCK))  # the padding before a record is shorter than a block


def _layout(records: list[list[Any]], nf: int, values: dict[str, np.ndarray | Ragged]) -> list[Any]:
    """One shard's bytes as pieces in order (no copy of the records): header, record
    table, value columns, then each record after the zeros its alignment needs."""
    n = len(records)
    flat = [r for sample in records for r in sample]
    lengths = np.array([len(r) for r in flat], dtype=np.int64)
    blob_values = values_blob(values)
    table_offset = HEADER_BYTES
    values_offset = table_offset + n * nf * 16
    values_end = values_offset + len(blob_values)
    data_offset = align(values_end, PAGE)
    offsets = place(lengths, data_offset)
    header = Header(nf, n, table_offset, values_offset, len(blob_values), data_offset)
    pieces: list[Any] = [header.pack(), np.stack([offsets, lengths], axis=1).astype("<u8").tobytes(), blob_values,
                         _ZEROS[:data_offset - values_end]]
    at = data_offset
    for k in np.argsort(offsets, kind="stable").tolist():  # small records may sit in earlier padding
        if offsets[k] > at:
            pieces.append(_ZEROS[:offsets[k] - at])
        pieces.append(flat[k])
        at = int(offsets[k]) + len(flat[k])
    return pieces


class _Dest:
    """The destination of a pack: a local folder or an ``s3://`` prefix; whole objects
    written at once (a local file under a temporary name, then renamed)."""

    def __init__(self, base: str) -> None:
        if is_http(base):
            raise ConfigError(f"{base}: a pack writes to a local folder or an s3:// prefix, not to http(s)")
        self.base = base.rstrip("/") if is_url(base) else os.path.abspath(base)
        self.remote = is_url(base)

    def _key(self, name: str) -> tuple[str, str]:
        bucket, _, prefix = self.base[len("s3://"):].partition("/")
        return bucket, f"{prefix}/{name}" if prefix else name

    def _s3(self) -> Any:
        from gpuio.storage.remote import client

        return client().s3()

    def write(self, name: str, data: bytes | list[Any], exclusive: bool = False) -> bool:
        """Write object ``name`` (bytes, or bytes-like pieces in order); with ``exclusive``,
        only where none exists (False if one does)."""
        pieces = [data] if isinstance(data, bytes) else data
        if self.remote:
            bucket, key = self._key(name)
            extra = {"IfNoneMatch": "*"} if exclusive else {}
            try:
                self._s3().put_object(Bucket=bucket, Key=key, Body=b"".join(pieces), **extra)
            except Exception as exc:  # botocore's ClientError, connection errors ...
                if exclusive and "PreconditionFailed" in str(exc):
                    return False
                raise StorageError(f"cannot write the object: {exc}", path=f"{self.base}/{name}") from exc
            return True
        path = os.path.join(self.base, name)
        try:
            os.makedirs(self.base, exist_ok=True)
            if exclusive:
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.writelines(pieces)
                return True
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.writelines(pieces)
            os.replace(tmp, path)
        except OSError as exc:
            raise StorageError(f"cannot write: {exc.strerror or exc}", path=path) from exc
        return True

    def read(self, name: str) -> bytes | None:
        """Object ``name``'s bytes, or None where there is none."""
        if self.remote:
            bucket, key = self._key(name)
            s3 = self._s3()
            try:
                return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            except s3.exceptions.NoSuchKey:
                return None
            except Exception as exc:  # botocore's ClientError, connection errors ...
                raise StorageError(f"cannot read the object: {exc}", path=f"{self.base}/{name}") from exc
        try:
            with open(os.path.join(self.base, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot read: {exc.strerror or exc}", path=os.path.join(self.base, name)) from exc

    def read_json(self, name: str) -> dict[str, Any] | None:
        raw = self.read(name)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise StorageError(f"not the JSON gpuio pack writes ({exc}); remove it to pack again",
                               path=f"{self.base}/{name}") from None

    def holds(self, info: dict[str, Any]) -> bool:
        """Whether the shard ``info`` (its entry in the progress file) is there as it was
        written: locally, its CRC-32C read back; in S3, its size (a PUT stores an object
        whole, checksummed by botocore on the way), not downloaded again."""
        if not self.remote:
            data = self.read(info["name"])
            return data is not None and crc32c(data) == info["crc32c"]
        bucket, key = self._key(info["name"])
        try:
            return self._s3().head_object(Bucket=bucket, Key=key)["ContentLength"] == info["bytes"]
        except Exception as exc:  # botocore's ClientError (404), connection errors ...
            if "404" in str(exc) or "Not Found" in str(exc):
                return False
            raise StorageError(f"cannot ask for the object: {exc}", path=f"{self.base}/{info['name']}") from exc

    def remove(self, name: str) -> None:
        if self.remote:
            bucket, key = self._key(name)
            self._s3().delete_object(Bucket=bucket, Key=key)
            return
        try:
            os.unlink(os.path.join(self.base, name))
        except FileNotFoundError:
            pass

    def lock(self) -> _Lock:
        return _Lock(self)


class _Lock:
    """``.gpuio-pack.lock`` in the destination while a pack runs: one naming this host and
    process. A lock left by a process of this host that no longer runs is taken over."""

    def __init__(self, dest: _Dest) -> None:
        self.dest = dest
        self.mine = _dumps({"host": socket.gethostname(), "pid": os.getpid()})

    def __enter__(self) -> _Lock:
        if self.dest.write(LOCK_NAME, self.mine, exclusive=True):
            return self
        held = self.dest.read_json(LOCK_NAME) or {}
        if held.get("host") == socket.gethostname() and not _alive(held.get("pid")):
            self.dest.remove(LOCK_NAME)
            if self.dest.write(LOCK_NAME, self.mine, exclusive=True):
                return self
        raise ConfigError(f"{self.dest.base} is in use by another pack (process {held.get('pid')} on "
                          f"{held.get('host')}, per {LOCK_NAME}); if no pack runs there, remove {LOCK_NAME}")

    def __exit__(self, *exc: object) -> None:
        if self.dest.read(LOCK_NAME) == self.mine:
            self.dest.remove(LOCK_NAME)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True
