"""Video files: one sample per clip, read as the byte span of the clip's packets.

Clips follow DALI's ``readers.video``: a clip starting at frame ``f0`` holds frames
``f0, f0 + stride, ..., f0 + (sequence_length - 1) * stride`` (presentation order,
counted from 0), clips start every ``step`` frames, and clips that would run past the
last frame are left out. Labels are those of ``formats.filetree`` (sorted class
folders, or ``path label`` lines of ``file_list``); a plain list of files is labelled
by position.

Indexing demuxes each file once with PyAV (FFmpeg), without decoding: per video packet
its byte position, size, presentation time and keyframe flag. A clip's ``data`` extent
is the byte span from the keyframe at or before ``f0`` through the last packet, in
decode order, that its frames need. With B-frames the frames up to the clip's last
one in presentation order can need packets later in decode order; the span runs to
the latest of them. The packets of one clip are not always back to back: other streams
(audio, subtitles) are interleaved with them. The span is read whole, as one extent,
and the decoder takes the video packets out of it by the offsets stored per clip; an
audio track adds its own few kB per clip to the read.

Fields:
    ``data``: the clip's packet span (bytes).
    ``label`` (int64), ``file`` (int64: the video's number in sorted order), ``frame``
        (int64: ``f0``).
    ``packets``: per clip an int32 ``[P, 4]`` table, one row per video packet of the
        span in decode order: byte offset in ``data``, size, the frame number it
        carries (-1 for a packet the container marks as not shown), and the clip slot
        ``j`` of that frame (-1 when the clip does not keep it).
    ``codec``: per clip the decoder's parameters from the container header (decoder
        name, size, pixel format, colour description, reorder depth, and the lengths of
        the stream-state units) as JSON, a newline, the codec's extradata bytes and the
        stream-state units (``ops.video.codec_header`` parses it). The stream state
        (H.264, HEVC; ``gpuio._nal``) is what a decoder that read the file from its start
        has learnt by the clip's first packet besides the header: in-band parameter sets
        and the encoder's user-data SEI notes (x264's version note, which FFmpeg needs to
        decode streams of old x264 builds right, is in the file's first packet only).

Both per-clip tables are stored for every clip (a ``SampleIndex`` holds only
per-sample columns): 16 bytes per packet of the span plus the header (tens of bytes
for H.264, up to a few kB for x265's HEVC) and the stream state (none for a clip at
the file's start, about 0.7 kB for x264's note) per clip, well under 1 % of the bytes a
clip reads. ``ops.decode_video`` turns these fields into frames.

Errors at index time (``FormatError`` naming the file): no video stream, a file the
demuxer cannot open (an MP4 cut short loses its ``moov`` box), packets that run past
the end of the file or fewer packets than the header declares (a file cut short), and
containers that give no byte position or timestamp per packet.
"""

from __future__ import annotations

import io
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from gpuio import _nal
from gpuio.device import require
from gpuio.errors import ConfigError, DataError, FormatError, StorageError
from gpuio.formats._files import full_path, object_blocks, regular_file_size
from gpuio.storage import Reader
from gpuio.storage.remote import is_url, object_versions
from gpuio.formats.filetree import filetree
from gpuio.index import Extents, PathTable, Ragged, SampleIndex

__all__ = ["video", "VIDEO_EXTENSIONS"]

VIDEO_EXTENSIONS = (".mp4", ".m4v", ".mov", ".mkv", ".webm")
_EBML, _SEGMENT = b"\x1a\x45\xdf\xa3", b"\x18\x53\x80\x67"
_MP4_BOXES = (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip")
_BLOCK_HEADER = 32  # most bytes between a packet's stated position and its data
_HELD_BLOCKS = 4  # blocks of a remote file kept in memory for the demuxer's seeks back
_AHEAD_BLOCKS = 4  # blocks of a remote file fetched ahead of the demuxer


def video(root_or_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
          sequence_length: int, stride: int = 1, step: int | None = None,
          file_list: str | os.PathLike[str] | None = None,
          extensions: Sequence[str] = VIDEO_EXTENSIONS) -> SampleIndex:
    """Index the clips of the videos under ``root_or_files`` (a directory of class
    folders, or with ``file_list`` its ``path label`` lines) or of a list of files.

    ``sequence_length`` frames per clip, ``stride`` frames apart; a clip starts every
    ``step`` frames (default ``sequence_length``). See the module docstring for the
    fields and the clip rule.
    """
    for name, value in (("sequence_length", sequence_length), ("stride", stride),
                        ("step", sequence_length if step is None else step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    step = sequence_length if step is None else int(step)
    if isinstance(root_or_files, (str, os.PathLike)):
        tree = filetree(root_or_files, extensions, file_list)
        files, labels, meta = tree.files, tree.values["label"], dict(tree.meta)
    else:
        paths = [full_path(p) for p in root_or_files]
        if not paths:
            raise DataError("no samples: an empty list of video files was given")
        files, labels, meta = PathTable.from_paths(paths), np.arange(len(paths), dtype=np.int64), object_versions(paths)
    meta.update(format="video", sequence_length=int(sequence_length), stride=int(stride), step=step)

    av = require("av")
    parts = [_clips(_demux(av, path), f, sequence_length, stride, step)
             for f, path in enumerate(files)]
    clip_file = np.concatenate([p.file for p in parts])
    if not len(clip_file):
        raise DataError(f"no samples: no video has {(sequence_length - 1) * stride + 1} frames "
                        f"(sequence_length={sequence_length}, stride={stride})", path=files[0])
    extents = Extents(clip_file, np.concatenate([p.offset for p in parts]),
                      np.concatenate([p.length for p in parts]))
    values = {
        "label": labels[clip_file],
        "file": clip_file.astype(np.int64),
        "frame": np.concatenate([p.frame for p in parts]),
        "packets": Ragged.from_list([t for p in parts for t in p.tables], dtype=np.int32, row_shape=(4,)),
        "codec": Ragged.from_list([h for p in parts for h in p.headers], kind="bytes"),
    }
    return SampleIndex(files, {"data": extents}, values, meta=meta)


class _Stream(NamedTuple):
    """One file's video packets in decode order, and its decoder parameters."""

    pos: np.ndarray  # int64 byte offset of each packet's data
    size: np.ndarray  # int64 bytes
    frame: np.ndarray  # int64 frame number (presentation order), -1 if not shown
    key: np.ndarray  # bool keyframe
    params: dict  # the decoder's parameters
    extradata: bytes
    state: dict[int, tuple[bytes, ...]]  # per keyframe packet: the stream state before it (``gpuio._nal``)


_Pread = Callable[[int, int], bytes]  # (n, offset) -> up to n bytes of the file from offset


def _ebml_size(pread: _Pread, at: int) -> tuple[int, int]:
    """An EBML element size at byte ``at``: (value, bytes it takes); value -1 when
    unknown (all ones)."""
    head = pread(8, at)
    first = head[0] if head else 0
    width = 9 - first.bit_length()
    if not first or len(head) < width:
        return -1, 1
    value = int.from_bytes(head[:width], "big") & ((1 << (7 * width)) - 1)
    return (-1 if value == (1 << (7 * width)) - 1 else value), width


def _container_end(pread: _Pread, file_size: int) -> int:
    """Where the file's top-level structure says it ends (bytes): the end of the last
    ISO-BMFF box (MP4, MOV) or of the Matroska/WebM segment; 0 when the file does not
    say (another container, a segment of unknown size)."""
    head = pread(8, 0)
    if head[:4] == _EBML:
        size, width = _ebml_size(pread, 4)
        segment = 4 + width + size
        if size < 0 or pread(4, segment) != _SEGMENT:
            return 0
        size, width = _ebml_size(pread, segment + 4)
        return segment + 4 + width + size if size >= 0 else 0
    if head[4:8] not in _MP4_BOXES:
        return 0
    at = 0
    while at + 8 <= file_size:
        box = pread(16, at)
        size = int.from_bytes(box[:4], "big")
        if size == 1:
            size = int.from_bytes(box[8:16], "big")
        elif size == 0:  # the last box runs to the end of the file
            return file_size
        if size < 8:
            return 0
        at += size
    return at


class _ObjectFile(io.RawIOBase):
    """A remote video file as a seekable binary file for the demuxer, with no local copy:
    read in the node-local cache's blocks through the storage core (``object_blocks``),
    so the bytes demuxed are the clips' reads cached already; the next blocks are
    fetched ahead, and a few are held in memory for the demuxer's seeks back (an MP4
    whose index follows its media is read from its end, then from its start)."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.size, self._pieces = object_blocks(url)
        self._block = int(self._pieces.extents["data"].length[0]) if len(self._pieces) else 1
        self._reader = Reader("cpu")
        self._held: OrderedDict[int, bytes] = OrderedDict()
        self._pos = 0

    def _get(self, k: int) -> bytes:
        got = self._held.get(k)
        if got is not None:
            self._held.move_to_end(k)
            return got
        ahead = np.arange(k + 1, min(k + 1 + _AHEAD_BLOCKS, len(self._pieces)))
        if len(ahead):
            self._reader.prefetch(self._pieces, ahead)
        got = self._held[k] = self._reader.read(self._pieces, [k])[0].tobytes()
        while len(self._held) > _HELD_BLOCKS:
            self._held.popitem(last=False)
        return got

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes from byte ``offset`` (fewer at the end of the object)."""
        n = max(0, min(n, self.size - offset))
        out = bytearray()
        while len(out) < n:
            at = offset + len(out)
            k, skip = divmod(at, self._block)
            out += self._get(k)[skip: skip + n - len(out)]
        return bytes(out)

    def readinto(self, buffer: bytearray | memoryview) -> int:
        data = self.pread(len(buffer), self._pos)
        buffer[:len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self._pos = pos if whence == io.SEEK_SET else self._pos + pos if whence == io.SEEK_CUR else self.size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
        super().close()


def _demux(av, path: str) -> _Stream:
    """Demux ``path`` once (no decoding) and check each packet's bytes lie where the
    container says: a local file, or a remote one read through the cache (``_ObjectFile``)."""
    if is_url(path):
        with _ObjectFile(path) as f:
            return _demux_from(av, path, f, f.size, f.pread)
    size = regular_file_size(path, "video file")  # FFmpeg would wait on a FIFO
    with open(path, "rb") as f:
        return _demux_from(av, path, path, size, lambda n, at: os.pread(f.fileno(), n, at))


def _demux_from(av, path: str, source: str | _ObjectFile, file_size: int, pread: _Pread) -> _Stream:
    """``_demux`` of ``source`` (``path`` or a file object of it, ``file_size`` bytes,
    whose bytes ``pread`` gives)."""
    try:
        container = av.open(source)
    except OSError as exc:  # FFmpeg's errors that are the system's: a missing file, no permission, a directory
        raise StorageError(f"cannot open: {exc.strerror or exc}", path=path) from exc
    except av.FFmpegError as exc:
        raise FormatError(f"cannot open as a video file (cut short, or not a video): {exc}", path=path) from exc
    with container:
        if not container.streams.video:
            raise FormatError("no video stream in this file", path=path)
        stream = container.streams.video[0]
        cc = stream.codec_context
        params = {"decoder": cc.codec.name, "width": cc.width, "height": cc.height, "pix_fmt": cc.pix_fmt,
                  "reorder_depth": cc.reorder_depth, "colorspace": int(cc.colorspace),
                  "color_range": int(cc.color_range), "color_primaries": int(cc.color_primaries),
                  "color_trc": int(cc.color_trc)}
        extradata = cc.extradata or b""
        codec = cc.codec.name if cc.codec.name in _nal.CODECS else None
        if codec is not None:
            try:
                state = _nal.StreamState(codec, _nal.header_units(codec, extradata))
            except ValueError as exc:
                raise FormatError(f"bad {codec} header (extradata): {exc}", path=path) from exc
            nal_size = _nal.length_size(codec, extradata)
        states: dict[int, tuple[bytes, ...]] = {}
        declared = stream.frames
        pos, size, pts, key, shown = [], [], [], [], []
        try:
            end = _container_end(pread, file_size)
            if end > file_size:
                raise FormatError(f"file cut short: the container's headers say it runs to byte {end}, "
                                  f"the file has {file_size} bytes", path=path, offset=file_size)
            for packet in container.demux(stream):
                if packet.size == 0:  # the demuxer's end-of-stream marker
                    continue
                d = len(pos)
                if packet.pos is None or packet.pos < 0 or packet.pts is None:
                    raise FormatError(f"the container gives no byte position or timestamp for video packet "
                                      f"{d}; remux it to MP4 or Matroska", path=path)
                # Matroska's position is the block's, a few header bytes before the frame
                data = bytes(packet)
                at = pread(_BLOCK_HEADER + packet.size, packet.pos).find(data)
                at = packet.pos + at if at >= 0 else -1
                if at < 0:
                    end = packet.pos + packet.size
                    if end > file_size:
                        raise FormatError(f"file cut short: video packet {d} ends at byte {end}, the file "
                                          f"has {file_size} bytes", path=path, offset=packet.pos)
                    raise FormatError(f"video packet {d} ({packet.size} bytes) is not stored verbatim at "
                                      f"its position (compressed or laced frames)", path=path, offset=packet.pos)
                if codec is not None:  # the stream state before each keyframe, where clips start
                    if packet.is_keyframe or not d:
                        states[d] = state.units()
                    view = memoryview(data)
                    for a, n in _nal.units(data, 0, len(data), nal_size):
                        state.add(view[a:a + n])
                pos.append(at)
                size.append(packet.size)
                pts.append(packet.pts)
                key.append(packet.is_keyframe)
                shown.append(not packet.is_discard)
        except av.FFmpegError as exc:
            raise FormatError(f"cannot demux (cut short or corrupt): {exc}", path=path) from exc
        except OSError as exc:
            raise StorageError(f"cannot read: {exc.strerror or exc}", path=path) from exc
    if declared and len(pos) != declared:
        raise FormatError(f"file cut short: the header declares {declared} video frames, "
                          f"{len(pos)} packets were found", path=path)
    shown_ = np.array(shown, dtype=bool)
    pts_ = np.array(pts, dtype=np.int64)
    # frame numbers: the rank of each shown packet's timestamp (presentation order)
    frame = np.full(len(pos), -1, dtype=np.int64)
    by_time = np.flatnonzero(shown_)[np.argsort(pts_[shown_], kind="stable")]
    frame[by_time] = np.arange(len(by_time))
    return _Stream(np.array(pos, dtype=np.int64), np.array(size, dtype=np.int64), frame,
                   np.array(key, dtype=bool), params, extradata, states)


class _Clips(NamedTuple):
    """The clips of one file."""

    file: np.ndarray  # int32 file id per clip
    offset: np.ndarray  # int64 byte where the clip's span starts
    length: np.ndarray  # int64 bytes of the span
    frame: np.ndarray  # int64 first frame
    tables: list[np.ndarray]  # per clip [P, 4]: offset in the span, size, frame number, slot
    headers: list[bytes]  # per clip the ``codec`` field value


def _clips(s: _Stream, file_id: int, length: int, stride: int, step: int) -> _Clips:
    n = int((s.frame >= 0).sum())
    starts = np.arange(0, max(n - (length - 1) * stride, 0), step, dtype=np.int64)
    decode_at = np.empty(n, dtype=np.int64)  # decode position of each frame
    decode_at[s.frame[s.frame >= 0]] = np.flatnonzero(s.frame >= 0)
    # the last packet (in decode order) needed to show every frame up to frame p
    last_needed = np.maximum.accumulate(decode_at) if n else decode_at
    key_frames = np.sort(s.frame[s.key & (s.frame >= 0)])
    ends = s.pos + s.size
    offsets, lengths, tables, headers = [], [], [], []
    made: dict[tuple[bytes, ...], bytes] = {}
    for f0 in starts.tolist():
        f_last = f0 + (length - 1) * stride
        k = np.searchsorted(key_frames, f0, side="right") - 1
        first = int(decode_at[key_frames[k]]) if k >= 0 else 0
        rows = slice(first, int(last_needed[f_last]) + 1)
        lo, hi = int(s.pos[rows].min()), int(ends[rows].max())
        frames = s.frame[rows]
        kept = (frames >= f0) & (frames <= f_last) & ((frames - f0) % stride == 0)
        slot = np.where(kept, (frames - f0) // stride, -1)
        tables.append(np.stack([s.pos[rows] - lo, s.size[rows], frames, slot], axis=1))
        offsets.append(lo)
        lengths.append(hi - lo)
        state = s.state.get(first, ())
        if state not in made:
            params = json.dumps({**s.params, "state": [len(u) for u in state]}, separators=(",", ":"))
            made[state] = params.encode() + b"\n" + s.extradata + b"".join(state)
        headers.append(made[state])
    return _Clips(np.full(len(starts), file_id, dtype=np.int32), np.array(offsets, dtype=np.int64),
                  np.array(lengths, dtype=np.int64), starts, tables, headers)
