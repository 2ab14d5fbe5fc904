"""Video decoding: ``decode_video``, clips of ``formats.video`` to RGB frames.

Each sample's ``data`` is its clip's packet span, ``packets`` the table of the video
packets in it (offset, size, frame number, clip slot) and ``codec`` the decoder
parameters from the container header (see ``formats.video``). The decoder is fed the
packets from the keyframe on, in decode order, and the clip keeps the pictures whose
frame numbers it asks for: ``frames``, uint8 ``[F, H, W, 3]`` RGB per sample, in clip
order. Where the batch's clips agree in shape their frames are views into one
``[B, F, H, W, 3]`` array, which the Loader hands over without a copy; on the CPU it
comes from the buffer pool, so ``buffer_budget`` (``gpuio.config``) must hold it: 8 clips
of 60 1080p frames are 3 GB.

CPU: PyAV (FFmpeg's decoders, libdav1d for AV1). Clips decode in parallel on a thread
pool (FFmpeg runs with the GIL released); a clip that spans several H.264/HEVC IDR
pictures decodes as parts, one decoder each, that the pool runs in parallel too, each
part ending at its last kept frame (``_parts``). A part's decoder is first given what a
decoder that read the file from its start knows there (``gpuio._nal``: in-band parameter
sets, the encoder's notes such as the version of old x264 builds whose bugs FFmpeg
corrects), in front of the part's first packet; NVDEC gets the same. Packets whose
pictures the clip does not keep are sent with ``skip_frame="NONREF"``, so a
non-reference picture nobody looks at is not decoded at all; every picture the clip
keeps, and every reference picture it needs, is decoded as FFmpeg decodes it from the
start of the file. The kept 4:2:0 pictures are converted to RGB by ``ops/_video.c``
straight into the clip's array, with the fixed-point arithmetic of swscale's unscaled
converter; it is used for a colour setting (pixel format, colour space, range) only
after it gave the bytes of swscale for every (Y, U, V) triple, once per process. Other
pictures (4:4:4, 10-bit, odd sizes, a setting where the two differ) go through swscale
as ``VideoFrame.to_ndarray(format="rgb24")`` does (the frame's own colour space; with
``size`` the same call with ``width``/``height``, swscale's bilinear filter), one
single-threaded swscale context per part. The frames equal, bit for bit, those of
decoding the whole file with PyAV.

GPU: PyNvVideoCodec (NVDEC), one decoder per clip, clips in parallel. H.264/HEVC
packets are rewritten to Annex B on the host (start codes for the length fields, the
avcC/hvcC parameter sets and the clip's stream state in front of the first packet;
``annexb_packets``), AV1 gets its configuration OBUs in front, VP9 goes as stored.
The decoder works on the batch's CUDA stream and converts to RGB itself
(``OutputColorType.RGB``, the colour matrix the stream signals); its pictures are taken
by DLPack (``device_frame``) and the kept ones copied into one ``[B, F, H, W, 3]``
device array, and ``size`` resizes them all in one bilinear launch (``ops.resize``).
Clips in another codec or pixel format (4:4:4, 10-bit) decode on the CPU and are
uploaded. NVDEC's pictures equal FFmpeg's (decoding is exact for these codecs); its RGB
conversion rounds differently from swscale's.

A packet the decoder rejects, or a frame it does not return, is a ``FormatError``
naming the sample, the frame number and the packet's byte offset in the clip.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import numpy as np

from gpuio import _fork, _nal
from gpuio.batch import Batch, Op
from gpuio.ops._cpu_pool import cpu_count, cpu_pool
from gpuio.storage.buffers import pooled_empty
from gpuio.device import require
from gpuio.errors import ConfigError, FormatError

try:
    from gpuio.ops import _video
except ImportError:  # built at install where a C compiler exists; else swscale converts every frame
    _video = None

__all__ = ["DecodeVideo", "decode_video", "CodecHeader", "codec_header", "decode_clip", "annexb_packets",
           "device_frame"]


class CodecHeader(NamedTuple):
    """What a decoder needs from the container header (``formats.video``)."""

    decoder: str  # FFmpeg decoder name: h264, hevc, vp9, libdav1d ...
    width: int  # pixels
    height: int  # pixels
    pix_fmt: str
    reorder_depth: int
    colorspace: int  # FFmpeg AVColorSpace
    color_range: int  # FFmpeg AVColorRange
    color_primaries: int
    color_trc: int
    extradata: bytes
    state: tuple[bytes, ...] = ()  # NAL units for a decoder started at the clip's first packet (``gpuio._nal``)


_headers: dict[bytes, CodecHeader] = {}
# FFmpeg decoders that read skip_frame for each packet as it is decoded (libdav1d reads
# it as it drains its queue, which drops pictures that were asked for)
_SKIP_PER_PACKET = {"h264", "hevc", "vp9"}


def codec_header(blob: Any) -> CodecHeader:
    """Parse a ``codec`` field value (JSON, a newline, the extradata, the stream state)."""
    blob = bytes(blob)
    header = _headers.get(blob)
    if header is None:
        text, _, rest = blob.partition(b"\n")
        try:
            params = json.loads(text)
            lengths = params.pop("state")
        except KeyError:
            raise FormatError("the index's codec field has no stream state: it was made by an older gpuio; "
                              "index the videos again with formats.video") from None
        except (ValueError, AttributeError) as exc:
            raise FormatError(f"bad codec header in the index: {exc}") from exc
        if not isinstance(lengths, list) or not all(isinstance(n, int) and n >= 0 for n in lengths) \
                or sum(lengths) > len(rest):
            raise FormatError(f"bad codec header in the index: stream-state lengths {lengths!r} for "
                              f"{len(rest)} bytes after the parameters")
        at = len(rest) - sum(lengths)
        state = []
        for n in lengths:
            state.append(rest[at:at + n])
            at += n
        try:
            header = CodecHeader(**params, extradata=rest[:len(rest) - sum(lengths)], state=tuple(state))
        except TypeError as exc:
            raise FormatError(f"bad codec header in the index: {exc}") from exc
        if len(_headers) > 1024:
            _headers.clear()
        _headers[blob] = header
    return header


def _context(av: Any, header: CodecHeader, threads: int) -> Any:
    ctx = av.CodecContext.create(header.decoder, "r")
    ctx.width, ctx.height, ctx.pix_fmt = header.width, header.height, header.pix_fmt
    ctx.reorder_depth = header.reorder_depth
    ctx.colorspace, ctx.color_range = header.colorspace, header.color_range
    ctx.color_primaries, ctx.color_trc = header.color_primaries, header.color_trc
    if header.extradata:
        ctx.extradata = header.extradata
    ctx.thread_count = threads
    ctx.thread_type = "AUTO" if threads != 1 else "SLICE"
    return ctx


def _table(packets: Any) -> np.ndarray:
    table = np.asarray(packets)
    if table.ndim != 2 or table.shape[1] != 4:
        raise ConfigError(f"packets table of shape {table.shape}; decode_video needs the 'packets' field "
                          f"of formats.video ([P, 4] int32 per clip)")
    return table


def _clip_length(packets: Any) -> int:
    """Frames the clip keeps (one more than its highest slot)."""
    slots = _table(packets)[:, 3]
    return int(slots.max()) + 1 if len(slots) else 0


class _Slots:
    """Where each kept frame goes in the clip, and which places are filled."""

    def __init__(self, table: np.ndarray, sample: object) -> None:
        self.slot_of = {int(f): int(j) for f, j in table[:, 2:4].tolist() if j >= 0}
        self.filled = np.zeros(len(self.slot_of), dtype=bool)
        self.sample = sample

    def take(self, frame: int) -> int:
        """The slot of frame number ``frame`` (marked filled), -1 if the clip does not keep it."""
        j = self.slot_of.get(frame, -1)
        if j >= 0:
            self.filled[j] = True
        return j

    def check(self, decoder: str) -> None:
        if not self.filled.all():
            missing = int(np.flatnonzero(~self.filled)[0])
            frame = next(f for f, j in self.slot_of.items() if j == missing)
            raise FormatError(f"{decoder} gave no picture for frame {frame} (clip slot {missing}); "
                              f"a packet of the clip is corrupt", sample=self.sample)


_START = b"\0\0\0\1"


def _header_units(header: CodecHeader) -> list[bytes]:
    """The NAL units of an H.264/HEVC header (avcC/hvcC or Annex B)."""
    try:
        return _nal.header_units(header.decoder, header.extradata)
    except ValueError as exc:
        raise FormatError(f"bad avcC/hvcC extradata in the index: {exc}") from exc


def _framed(units: tuple[bytes, ...], size: int) -> bytes:
    """NAL units as a packet carries them: each after a ``size``-byte length, or after a
    start code (``size`` 0)."""
    if size and any(len(u) >> (8 * size) for u in units):
        raise FormatError(f"a stream-state NAL unit does not fit this stream's {size}-byte lengths")
    return b"".join((len(u).to_bytes(size, "big") if size else _START) + u for u in units)


def _parts(buf: memoryview, rows: list[list[int]], header: CodecHeader) -> list[tuple[int, int, bytes]]:
    """Row ranges ``[start, end)`` of the clip's table that decode on their own, each with
    the bytes to put in front of its first packet: a new part starts at each H.264/HEVC
    IDR picture after the first row (no picture after an IDR refers to one before it),
    and its decoder gets, in front, what a decoder reading from the file's start knows
    there (the clip's stream state from the index, updated by the rows before); each part
    ends at its last kept frame (pictures refer only to pictures before them in decode
    order), and a part with none is left out."""
    codec = header.decoder
    size = _nal.length_size(codec, header.extradata)
    starts = [(0, header.state)]
    if codec in _nal.CODECS:
        state = _nal.StreamState(codec, _header_units(header))
        for unit in header.state:
            state.add(unit)
        data = buf if size else buf.tobytes()  # Annex B is searched for start codes
        for k, (offset, length, _, _) in enumerate(rows):
            end = offset + length
            found = [(at, min(n, end - at)) for at, n in _nal.units(data, offset, end, size) if at < end]
            if k and any(n > 0 and _nal.nal_type(codec, data, at) in _nal.IDR[codec] for at, n in found):
                starts.append((k, state.units()))
            for at, n in found:
                state.add(data[at:at + n])
    parts = []
    for (start, units), (stop, _) in zip(starts, starts[1:] + [(len(rows), ())]):
        kept = [k for k in range(start, stop) if rows[k][3] >= 0]
        if kept:
            parts.append((start, kept[-1] + 1, _framed(units, size)))
    return parts


class _Clip:
    """One clip's CPU decode, as parts (``_parts``) that may run on different threads."""

    def __init__(self, data: Any, packets: Any, codec: Any, size: tuple[int, int] | None,
                 out: np.ndarray | None, sample: object) -> None:
        self.av = require("av")
        table = _table(packets)
        self.header = codec_header(codec)
        self.buf = memoryview(np.ascontiguousarray(np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray)
                                                   else data)).cast("B")
        self.slots = _Slots(table, sample)
        self.size, self.sample, self.rows = size, sample, table.tolist()
        h, w = size if size is not None else (self.header.height, self.header.width)
        self.frames = out if out is not None else np.empty((len(self.slots.filled), h, w, 3), np.uint8)
        self.parts = _parts(self.buf, self.rows, self.header)
        self.error: FormatError | None = None  # a part's, when parts decode on other threads

    def decode(self, start: int, end: int, front: bytes = b"", threads: int = 1) -> None:
        """Decode rows ``[start, end)`` with a new decoder, ``front`` (NAL units, see
        ``_parts``) before the first packet; their kept frames land in ``frames``."""
        av, frames, size = self.av, self.frames, self.size
        resize = {"width": frames.shape[2], "height": frames.shape[1]} if size is not None else {}
        # one swscale context for the part, on this thread: PyAV's per-frame default makes a
        # context and a thread pool for every frame, which the other clips' threads then wait on
        reformatter = av.video.reformatter.VideoReformatter()
        ctx = _context(av, self.header, threads)
        skips = self.header.decoder in _SKIP_PER_PACKET

        def store(pictures: list[Any]) -> None:
            for picture in pictures:
                j = self.slots.take(picture.pts)
                if j < 0:
                    continue
                direct = _direct_rgb(picture) if size is None and frames.flags.c_contiguous else None
                if direct is not None and (picture.height, picture.width) == frames.shape[1:3]:
                    _yuv420_rgb24(picture, frames[j], direct)
                    continue
                rgb = reformatter.reformat(picture, format="rgb24", threads=1, **resize).to_ndarray()
                if rgb.shape != frames.shape[1:]:
                    raise FormatError(f"frame {picture.pts} is {rgb.shape[1]}x{rgb.shape[0]} pixels, the clip's "
                                      f"other frames {frames.shape[2]}x{frames.shape[1]}", sample=self.sample)
                frames[j] = rgb

        row = start
        try:
            for row in range(start, end):
                offset, length, frame, slot = self.rows[row]
                body = self.buf[offset: offset + length]
                packet = av.Packet(front + body.tobytes() if row == start and front else body)
                # pictures come back with the packet's pts: the frame number (negative: not shown)
                packet.pts = packet.dts = frame if frame >= 0 else -1 - row
                if skips:
                    ctx.skip_frame = "DEFAULT" if slot >= 0 else "NONREF"
                store(ctx.decode(packet))
            row = end - 1
            store(ctx.decode(None))
        except av.FFmpegError as exc:
            offset, _, frame, _ = self.rows[row]
            raise FormatError(f"cannot decode frame {frame} (packet at byte {offset} of the clip): {exc}",
                              sample=self.sample) from exc

    def result(self) -> np.ndarray:
        if self.error is not None:
            raise self.error
        self.slots.check("the decoder")
        return self.frames


def decode_clip(data: Any, packets: Any, codec: Any, size: tuple[int, int] | None = None,
                out: np.ndarray | None = None, sample: object = None, threads: int = 1) -> np.ndarray:
    """Decode one clip on the CPU: ``[F, H, W, 3]`` uint8 RGB (``size=(h, w)`` resizes).

    ``data``, ``packets`` and ``codec`` are one sample's fields of ``formats.video``;
    ``out`` (optional) receives the frames; ``threads`` are FFmpeg's own threads for
    this clip.
    """
    clip = _Clip(data, packets, codec, size, out, sample)
    for start, end, front in clip.parts:
        clip.decode(start, end, front, threads)
    return clip.result()


# ---- YUV 4:2:0 -> RGB24 straight into the clip's array ---------------------------------------

# FFmpeg's YCbCr -> RGB factors (crv, cbu, cgu, cgv, 16.16 fixed point) by AVColorSpace;
# any other colour space gets BT.601's, as swscale gives it
_BT601 = (104597, 132201, 25675, 53279)
_FACTORS = {1: (117489, 138438, 13975, 34925), 4: (104448, 132798, 24759, 53109),
            7: (117579, 136230, 16907, 35559), 9: (110013, 140363, 12277, 42626), 10: (110013, 140363, 12277, 42626)}
_direct_lock = _fork.RenewedLock()  # a fork while another thread checks must not leave it held
_direct: dict[tuple[str, int, int], tuple[int, ...] | None] = {}


def _round16(x: int) -> int:
    r = (x + (1 << 15)) >> 16
    return -32768 if r < -32767 else min(r, 32767)


def _rgb_coefficients(colorspace: int, full_range: bool) -> tuple[int, ...]:
    """The 16-bit offsets and factors of swscale's unscaled YUV -> RGB (in the order
    ``ops/_video.c`` takes them), derived as FFmpeg derives them."""
    crv, cbu, cgu, cgv = _FACTORS.get(colorspace, _BT601)
    cgu, cgv = -cgu, -cgv
    cy, oy = 1 << 16, 0
    if full_range:  # C division: toward zero
        crv, cbu, cgu, cgv = (k * 224 // 255 if k >= 0 else -(-k * 224 // 255) for k in (crv, cbu, cgu, cgv))
    else:
        cy, oy = cy * 255 // 219, 16 << 16
    return (_round16(oy * 8), _round16(cy * 8192), 1024, 1024, _round16(cbu * 8192), _round16(cgu * 8192),
            _round16(cgv * 8192), _round16(crv * 8192))


def _yuv420_rgb24(picture: Any, out: np.ndarray, coefficients: tuple[int, ...]) -> None:
    y, u, v = picture.planes
    _video.yuv420_rgb24(y, y.line_size, u, v, u.line_size, out, picture.width, picture.height, coefficients)


def _direct_rgb(picture: Any) -> tuple[int, ...] | None:
    """The coefficients with which ``ops/_video.c`` converts this picture to the bytes
    swscale gives it, or None (no C extension, another pixel format, an odd size, or a
    colour setting where the two differ). Checked once per process and colour setting on
    every (Y, U, V) triple."""
    fmt = picture.format.name
    if _video is None or fmt not in ("yuv420p", "yuvj420p") or picture.width % 2 or picture.height % 2:
        return None
    key = (fmt, int(picture.colorspace), int(picture.color_range))
    with _direct_lock:
        if key not in _direct:
            _direct[key] = _checked_coefficients(*key)
        return _direct[key]


def _checked_coefficients(fmt: str, colorspace: int, color_range: int) -> tuple[int, ...] | None:
    """Convert frames holding every (Y, U, V) triple both ways; the coefficients if the bytes agree."""
    import av

    coefficients = _rgb_coefficients(colorspace, fmt == "yuvj420p" or color_range == 2)
    reformatter = av.video.reformatter.VideoReformatter()
    width, rows = 4096, 512  # chroma rows of 2048 samples: U runs through 0-255, V steps every 256
    cols = np.arange(width // 2)
    for part in range(4):  # four frames of 4096 x 1024: every (U, V) 64 times, each with 4 new Y values
        row = np.arange(rows) + part * rows
        frame = av.VideoFrame(width, 2 * rows, fmt)
        frame.colorspace, frame.color_range = colorspace, color_range
        y = 4 * (row // 32)[:, None, None] + np.array([[0, 1], [2, 3]])  # chroma row, luma row, pixel
        planes = (np.broadcast_to(y[:, :, None, :], (rows, 2, width // 2, 2)).reshape(2 * rows, width),
                  cols & 255, (8 * row[:, None] + cols // 256) & 255)
        for plane, values in zip(frame.planes, planes):
            np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[:, :values.shape[-1]] = values
        try:
            want = reformatter.reformat(frame, format="rgb24", threads=1).to_ndarray()
        except av.FFmpegError:  # a colour setting swscale refuses: decode_clip's own call says so
            return None
        got = np.empty_like(want)
        _yuv420_rgb24(frame, got, coefficients)
        if not np.array_equal(got, want):
            return None
    return coefficients


class DecodeVideo(Op):
    """Decode clips (``formats.video``) into ``out``: uint8 ``[F, H, W, 3]`` RGB per
    row, ``size=(h, w)`` pixels when given. Reads ``field`` (host memory), ``packets``
    and ``codec``; drops ``packets`` and ``codec`` from the batch."""

    def __init__(self, size: tuple[int, int] | None = None, field: str = "data", out: str = "frames") -> None:
        if size is not None:
            if len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
                                     for v in size):
                raise ConfigError(f"size {size!r}; give (height, width) in pixels or None")
            size = (int(size[0]), int(size[1]))
        self.size, self.field, self.out = size, field, out
        self.host_inputs = (field,)

    def __call__(self, batch: Batch) -> Batch:
        for name in ("packets", "codec"):
            if name not in batch.data:
                raise ConfigError(f"decode_video needs the field {name!r} of formats.video in the batch; "
                                  f"load it (Loader fields=...)")
        shapes = [self._shape(p, c) for p, c in zip(batch.data["packets"], batch.data["codec"])]
        frames = self._decode_gpu(batch, shapes) if batch.device.is_cuda else self._decode_cpu(batch, shapes)
        batch.data[self.out] = frames
        del batch.data["packets"], batch.data["codec"]
        batch.drop_rejected()
        return batch

    def _shape(self, packets: Any, codec: Any) -> tuple[int, int, int, int]:
        header = codec_header(codec)
        h, w = self.size if self.size is not None else (header.height, header.width)
        return _clip_length(packets), h, w, 3

    def _decode_cpu(self, batch: Batch, shapes: list[tuple[int, ...]]) -> list[Any]:
        """The parts of all clips (``_parts``) on the pool: a clip that spans several IDR
        pictures keeps both cores busy, and the batch ends with a short part, not a clip."""
        data, packets, codecs = batch.data[self.field], batch.data["packets"], batch.data["codec"]
        # pooled (mapped, huge-page) memory: a batch of 1080p clips is GBs that would page-fault in afresh
        block = pooled_empty((len(shapes), *shapes[0]), np.uint8) if shapes and len(set(shapes)) == 1 else None
        clips = [_caught(_Clip, data[row], packets[row], codecs[row], self.size,
                         None if block is None else block[row], int(batch.index[row])) for row in range(len(shapes))]
        parts = [(clip, *part) for clip in clips if isinstance(clip, _Clip) for part in clip.parts]
        # few parts: FFmpeg's own threads; many: one thread per part
        threads = max(1, cpu_count() // max(1, len(parts)))

        def one(part: tuple[_Clip, int, int, bytes]) -> None:
            clip, start, end, front = part
            try:
                clip.decode(start, end, front, threads)
            except FormatError as exc:
                clip.error = clip.error or exc

        list(cpu_pool().map(one, parts))
        return _rejected(batch, [_caught(clip.result) if isinstance(clip, _Clip) else clip for clip in clips])

    def _decode_gpu(self, batch: Batch, shapes: list[tuple[int, ...]]) -> list[Any]:
        """NVDEC for the clips it takes (one decoder per clip, clips in parallel), the
        CPU path for the rest, uploaded; then one resize launch for the batch."""
        cp = require("cupy")
        nvc = require("PyNvVideoCodec")
        data, packets, codecs = batch.data[self.field], batch.data["packets"], batch.data["codec"]
        device = batch.device.index
        native = [(n, codec_header(c).height, codec_header(c).width, 3) for (n, *_), c in zip(shapes, codecs)]
        with cp.cuda.Device(device):
            stream = batch.stream if batch.stream is not None else cp.cuda.get_current_stream()
            block = cp.empty((len(shapes), *native[0]), cp.uint8) if shapes and len(set(native)) == 1 else None

            def one(row: int) -> Any:
                header = codec_header(codecs[row])
                # a pool thread's current device is GPU 0: every allocation and copy is made inside
                # the batch's device, or it lands there (a cuda:N tensor over GPU 0's memory)
                with cp.cuda.Device(device), stream:
                    out = block[row] if block is not None else cp.empty(native[row], cp.uint8)
                    if header.decoder in _NVDEC_CODECS and header.pix_fmt in _NVDEC_FORMATS:
                        return _decode_clip_nvdec(nvc, cp, data[row], packets[row], header, out, device,
                                                  stream, int(batch.index[row]))
                    out.set(decode_clip(data[row], packets[row], codecs[row], sample=int(batch.index[row])))
                    return out

            clips = _run_rows(batch, one, len(shapes))
            if self.size is None:
                return clips
            from gpuio.ops.geometry import Resize

            frames = [f for clip in clips if not isinstance(clip, FormatError) for f in clip]
            if not frames:
                return clips
            flat = Batch({"image": frames}, np.zeros(len(frames), np.int64), np.zeros(len(frames), np.uint64),
                         batch.device, stream=stream)
            resized = iter(Resize(self.size, antialias=False)(flat).data["image"])
            h, w = self.size
            return [clip if isinstance(clip, FormatError)
                    else cp.stack([next(resized) for _ in range(len(clip))]).reshape(len(clip), h, w, 3)
                    for clip in clips]


def _run_rows(batch: Batch, decode_row: Any, rows: int) -> list[Any]:
    """``decode_row(row)`` for every row on the pool; a row whose clip is bad is
    rejected (its place in the list holds the error)."""
    return _rejected(batch, list(cpu_pool().map(lambda row: _caught(decode_row, row), range(rows))))


def _caught(call: Any, *args: Any) -> Any:
    """``call(*args)``, or the ``FormatError`` it raised (a bad clip is rejected, not raised)."""
    try:
        return call(*args)
    except FormatError as exc:
        return exc


def _rejected(batch: Batch, clips: list[Any]) -> list[Any]:
    """``clips``, each ``FormatError`` in it rejecting its row of ``batch``."""
    for row, clip in enumerate(clips):
        if isinstance(clip, FormatError):
            batch.reject(row, clip)
    return clips


# ---- NVDEC -----------------------------------------------------------------------------------

_NVDEC_CODECS = {"h264": "H264", "hevc": "HEVC", "vp9": "VP9", "libdav1d": "AV1", "av1": "AV1"}
_NVDEC_FORMATS = ("yuv420p", "yuvj420p")


def annexb_packets(data: Any, packets: Any, codec: Any) -> list[bytes]:
    """The clip's video packets as the NVDEC parser takes them: H.264/HEVC NAL units
    with start codes instead of length fields and, in front of the first packet, the
    header's parameter sets and the clip's stream state (``CodecHeader.state``); AV1
    with the configuration OBUs in front; VP9 as stored."""
    return _annexb(_bytes(data), _table(packets), codec_header(codec))


def _bytes(data: Any) -> bytes:
    return np.ascontiguousarray(data, dtype=np.uint8).tobytes() if isinstance(data, np.ndarray) else bytes(data)


def _annexb(buf: bytes, table: np.ndarray, header: CodecHeader, sample: object = None) -> list[bytes]:
    raw = [buf[o:o + n] for o, n in table[:, :2].tolist()]
    if header.decoder in ("libdav1d", "av1"):
        if raw and len(header.extradata) > 4:
            raw[0] = header.extradata[4:] + raw[0]
        return raw
    if header.decoder not in _nal.CODECS:
        return raw
    front = _framed((*_header_units(header), *header.state), 0)
    size = _nal.length_size(header.decoder, header.extradata)
    if not size:  # Annex B already
        return [front + packet if k == 0 else packet for k, packet in enumerate(raw)]
    out = []
    for k, packet in enumerate(raw):
        parts = [front] if k == 0 else []
        for at, n in _nal.units(packet, 0, len(packet), size):
            if at + n > len(packet):
                raise FormatError(f"frame {table[k, 2]}: a NAL unit of {n} bytes runs past its packet "
                                  f"({len(packet)} bytes, at packet byte {at - size})", sample=sample)
            parts += [_START, packet[at:at + n]]
        out.append(b"".join(parts))
    return out


def _decode_clip_nvdec(nvc: Any, cp: Any, data: Any, packets: Any, header: CodecHeader, out: Any,
                       device: int, stream: Any, sample: int) -> Any:
    """One clip on NVDEC into ``out`` (``[F, H, W, 3]`` uint8 on the GPU)."""
    table = _table(packets)
    slots = _Slots(table, sample)
    units = _annexb(_bytes(data), table, header, sample)
    errors = (getattr(nvc, "PyNvVCException", RuntimeError), RuntimeError, ValueError)
    with cp.cuda.Device(device):  # it runs on pool threads, whose current device is GPU 0
        cp.cuda.runtime.free(0)  # makes the device's primary context current in this thread
        try:  # the decoder works on the batch's stream: copies out of its surfaces are ordered after it
            decoder = nvc.CreateDecoder(gpuid=device,
                                        codec=getattr(nvc.cudaVideoCodec, _NVDEC_CODECS[header.decoder]),
                                        cudacontext=cp.cuda.driver.ctxGetCurrent(), cudastream=stream.ptr,
                                        usedevicememory=True, outputColorType=nvc.OutputColorType.RGB)
        except errors as exc:
            raise FormatError(f"NVDEC cannot take this {header.decoder} stream: {exc}", sample=sample) from exc

        def keep(pictures: list[Any]) -> None:
            for picture in pictures:
                j = slots.take(int(picture.getPTS()))
                if j >= 0:
                    out[j] = device_frame(cp, picture).reshape(out.shape[1:])

        row = 0
        try:
            for row, unit in enumerate(units):
                host = np.frombuffer(unit, np.uint8)  # NVDEC reads it during Decode
                packet = nvc.PacketData()
                packet.bsl_data, packet.bsl = host.ctypes.data, host.size
                packet.pts = int(table[row, 2]) if table[row, 2] >= 0 else -1 - row
                keep(decoder.Decode(packet))
            row = len(units)
            keep(decoder.Decode(nvc.PacketData()))  # an empty packet: end of stream, flush
        except errors as exc:
            frame = table[min(row, len(table) - 1), 2]
            raise FormatError(f"NVDEC cannot decode frame {frame}: {exc}", sample=sample) from exc
    slots.check("NVDEC")
    return out


def device_frame(xp: Any, picture: Any) -> Any:
    """A decoded picture as an ``xp`` (CuPy, or NumPy for a host picture) array, without
    a copy, through DLPack: PyNvVideoCodec's ``DecodedFrame`` has ``__dlpack__`` and
    ``__dlpack_device__`` but no ``__cuda_array_interface__``, which ``cupy.asarray``
    needs (it turns anything else into an object array, and fails)."""
    return xp.from_dlpack(picture)


def decode_video(size: tuple[int, int] | None = None, field: str = "data", out: str = "frames") -> DecodeVideo:
    """See ``DecodeVideo``."""
    return DecodeVideo(size, field, out)
