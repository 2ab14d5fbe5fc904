"""Image decoding: ``decode_image``.

The format is read from the bytes (``image_format``: JPEG, PNG, JPEG 2000, TIFF, WebP,
BMP, GIF by their magic numbers), never from a file name. CPU: simplejpeg
(libjpeg-turbo, releases the GIL) for JPEGs with 1 or 3 components, Pillow for
everything else (CMYK JPEGs, PNG, JPEG 2000 through OpenJPEG, TIFF through libtiff,
WebP, BMP, and what else Pillow reads); 16-bit samples keep their high byte. GPU:
nvImageCodec decodes a whole batch per call: complete baseline 1/3-component JPEGs (on
the hardware JPEG decoder where the GPU has one), JPEG 2000 (nvjpeg2k) and TIFF (nvtiff)
where those libraries are installed; images it does not take (progressive, CMYK or
truncated JPEGs, PNG, WebP, BMP ...) or fails on go through the CPU path and are
uploaded, without failing the batch.

Output: HWC uint8 per sample; ``color="rgb"`` gives 3 channels (grayscale and CMYK
JPEGs too), ``"gray"`` 1 channel, ``"unchanged"`` the file's own channels (1, 2, 3
or 4). Grayscale JPEGs are decoded as gray and their one channel repeated for ``"rgb"``
(libjpeg-turbo converts lossless JPEGs to no other colour space). The orientation is
applied once, on both devices: a JPEG's EXIF orientation, and for the other formats the
one Pillow reports after loading the pixels (Pillow applies a TIFF's own Orientation tag
while loading and then drops it; it leaves an EXIF orientation in PNG and WebP to the
caller). The two decoders differ within the JPEG standard's IDCT and chroma-upsampling
tolerances (a few levels at edges).

What is decoded, on every route (this op, ``Compose``'s fused chain, a GPU batch's CPU
fallback, ``decode_image_slice``): what Pillow decodes. A JPEG that libjpeg-turbo decodes
only with a warning (extraneous bytes before a marker, a malformed ICC block, data that
ends a segment early), or any other JPEG simplejpeg refuses, is decoded by Pillow and
what stopped simplejpeg is reported (``Batch.warn``; a Loader counts it in
``stats()["warned"]``). A JPEG whose data stops
before its end-of-image marker (a truncated file) is refused, whatever Pillow's
``LOAD_TRUNCATED_IMAGES`` says, and so is whatever Pillow cannot decode.
"""

from __future__ import annotations

import functools
import io
import re
import struct
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from gpuio.batch import Batch, Op
from gpuio.device import require
from gpuio.errors import ConfigError, FormatError

__all__ = ["DecodeImage", "decode_image", "decode_cpu", "decode_region", "region_decodable", "jpeg_facts",
           "facts_info", "jpeg_info", "JpegInfo",
           "orient", "decode_rows", "COLORS", "image_format", "gpu_decodable", "decode_gpu", "upload", "restarts_field"]

COLORS = ("rgb", "gray", "unchanged")
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}
_PILLOW_ERRORS = (OSError, ValueError, SyntaxError, EOFError, struct.error, Image.DecompressionBombError)
# A JPEG's header may declare up to 65535 x 65535 pixels in a few bytes; a decoder that
# believes it allocates (and libjpeg's arithmetic decoder fills) gigabytes. Images declaring
# more are bad samples; the default is Pillow's decompression-bomb limit. Set it higher
# (ops.decode.MAX_PIXELS = ...) for datasets of larger images.
MAX_PIXELS = 2 * 89_478_485
_MAGIC = (("jpeg", b"\xff\xd8\xff"), ("png", b"\x89PNG\r\n\x1a\n"), ("jpeg2000", b"\x00\x00\x00\x0cjP  \r\n\x87\n"),
          ("jpeg2000", b"\xff\x4f\xff\x51"), ("tiff", b"II*\x00"), ("tiff", b"MM\x00*"), ("tiff", b"II+\x00"),
          ("tiff", b"MM\x00+"), ("bmp", b"BM"), ("gif", b"GIF8"))


class JpegInfo(NamedTuple):
    components: int  # 1 gray, 3 YCbCr/RGB, 4 CMYK/YCCK; 0 if no frame header was found
    progressive: bool
    orientation: int  # EXIF orientation 1-8 (1 when absent)
    height: int = 0  # pixels, as stored (before the EXIF orientation); 0 if unknown
    width: int = 0


def _exif_orientation(seg: memoryview) -> int:
    """Orientation tag (0x0112) of IFD0 in an APP1 Exif payload (after ``Exif\\0\\0``);
    1 when absent or malformed, as decoders ignore bad EXIF."""
    tiff = bytes(seg)
    end = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if end is None:
        return 1
    try:
        ifd = struct.unpack_from(end + "I", tiff, 4)[0]
        (count,) = struct.unpack_from(end + "H", tiff, ifd)
        for k in range(count):
            tag, _, _, value = struct.unpack_from(end + "HHIH", tiff, ifd + 2 + 12 * k)
            if tag == 0x0112:
                return value if 1 <= value <= 8 else 1
    except struct.error:
        return 1
    return 1


def restarts_field(field: str) -> str:
    """The name of the field that holds the restart offsets of the encoded images in
    ``field``: ``"<field>.restarts"``, one uint32 array per sample (``gpuio.ops.restart``)."""
    return f"{field}.restarts"


def byte_view(buf: Any) -> np.ndarray:
    """Encoded bytes (uint8 array, bytes, memoryview) as a contiguous uint8 array."""
    return np.ascontiguousarray(buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8))


def jpeg_info(buf: Any) -> JpegInfo | None:
    """Frame and EXIF facts of a JPEG from its headers (stops at the first scan), or
    None when ``buf`` does not start like a JPEG."""
    return _headers(buf)[0]


def _headers(buf: Any) -> tuple[JpegInfo | None, int]:
    """``jpeg_info`` and the byte offset of the first start-of-scan marker (0 if none)."""
    data = memoryview(byte_view(buf)).cast("B")
    if len(data) < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None, 0
    pos, components, progressive, orientation, height, width, scan = 2, 0, False, 1, 0, 0, 0
    raw = None  # the bytes, copied once where a search needs them
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:  # bytes that are no marker: skipped to the next one, as libjpeg does (warning)
            raw = bytes(data) if raw is None else raw
            pos = raw.find(b"\xff", pos)
            if pos < 0:
                break
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x00:  # a stuffed zero outside a scan: no marker either
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan
            scan = pos if marker == 0xDA else 0
            break
        if 0xD0 <= marker <= 0xD7 or marker == 0x01:  # markers without a length
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        seg = data[pos + 4: pos + 2 + length]
        if marker in _SOF and len(seg) >= 6:
            components, progressive = seg[5], marker in _PROGRESSIVE
            height, width = (seg[1] << 8) | seg[2], (seg[3] << 8) | seg[4]
        elif marker == 0xE1 and bytes(seg[:6]) == b"Exif\0\0":
            orientation = _exif_orientation(seg[6:])
        pos += 2 + length
    return JpegInfo(components, progressive, orientation, height, width), scan


def orient(img: Any, orientation: int) -> Any:
    """Apply an EXIF orientation (1-8) to an HWC array; returns a view."""
    if orientation == 2:
        return img[:, ::-1]
    if orientation == 3:
        return img[::-1, ::-1]
    if orientation == 4:
        return img[::-1]
    if orientation == 5:
        return img.transpose(1, 0, 2)
    if orientation == 6:
        return img[::-1].transpose(1, 0, 2)
    if orientation == 7:
        return img[::-1, ::-1].transpose(1, 0, 2)
    if orientation == 8:
        return img[:, ::-1].transpose(1, 0, 2)
    return img


def _pillow_mode(mode: str, color: str, transparency: bool) -> str:
    if color == "rgb":
        return "RGB"
    if color == "gray":
        return "L"
    if mode in ("L", "LA", "RGB", "RGBA"):
        return mode
    return "RGBA" if "A" in mode or transparency else "RGB"


def _reason(exc: BaseException, buf: np.ndarray) -> str:
    """What a decoder said, without reprs of its internals (``<_io.BytesIO object at 0x...>``)."""
    if isinstance(exc, UnidentifiedImageError):
        return f"not an image format Pillow reads (the bytes start {bytes(buf[:8])!r})"
    return re.sub(r" ?<[\w.]+ object at 0x[0-9a-fA-F]+>", "", str(exc)) or type(exc).__name__


def image_format(buf: Any) -> str | None:
    """The format of encoded image bytes from their first bytes: ``"jpeg"``, ``"png"``,
    ``"jpeg2000"`` (JP2 file or bare codestream), ``"tiff"`` (and BigTIFF), ``"webp"``,
    ``"bmp"``, ``"gif"``, or None."""
    head = bytes(byte_view(buf)[:16])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return next((name for name, magic in _MAGIC if head.startswith(magic)), None)


def _eight_bit(im: Image.Image) -> Image.Image:
    """A 16-bit (or 32-bit integer) grayscale image as 8-bit "L": the high byte, as
    Pillow reduces 16-bit RGB."""
    if not (im.mode.startswith("I;16") or im.mode == "I"):
        return im
    return Image.fromarray((np.clip(np.asarray(im), 0, 65535).astype(np.uint32) >> 8).astype(np.uint8), "L")


def decodes_gray(color: str, components: int) -> bool:
    """Whether a JPEG of ``components`` decodes to one channel for ``color``."""
    return color == "gray" or (color == "unchanged" and components == 1)


def _check_pixels(height: int, width: int, nbytes: int, sample: int) -> None:
    if height * width > MAX_PIXELS:
        raise FormatError(f"image of {nbytes} bytes declares {width}x{height} pixels, more than "
                          f"gpuio.ops.decode.MAX_PIXELS ({MAX_PIXELS:,}); raise it for such images", sample=sample)


def decode_cpu(buf: Any, color: str, sample: int, info: JpegInfo | None = None,
               on_warning: Callable[[str], None] | None = None) -> np.ndarray:
    """One encoded image to HWC uint8 on the host (see the module docstring); bad bytes
    raise ``FormatError`` naming ``sample``. ``info``: its ``jpeg_info`` where the
    caller has read it already. ``on_warning(message)`` hears of a JPEG decoded despite
    a libjpeg warning (None: not reported)."""
    buf = byte_view(buf)
    info = jpeg_info(buf) if info is None else info
    if info is not None:
        _check_pixels(info.height, info.width, len(buf), sample)
    try:
        if info is not None and info.components in (1, 3):
            img = _decode_jpeg(buf, color, info, sample, on_warning)
            orientation = info.orientation
        else:
            if info is not None and info.components:  # a JPEG frame (CMYK, YCCK): Pillow's, when complete
                _check_complete(buf, sample)
            img, orientation = _decode_pillow(buf, color)
            orientation = info.orientation if info is not None else orientation
    except FormatError:
        raise
    except _PILLOW_ERRORS as exc:
        raise FormatError(f"cannot decode image ({len(buf)} bytes): {_reason(exc, buf)}", sample=sample) from exc
    except MemoryError as exc:
        raise FormatError(f"cannot decode image ({len(buf)} bytes): no memory for its pixels", sample=sample) from exc
    if img.ndim == 2:
        img = img[:, :, None]
    return np.ascontiguousarray(orient(img, orientation if 1 <= orientation <= 8 else 1))


def _decode_pillow(buf: np.ndarray, color: str) -> tuple[np.ndarray, int]:
    """Pixels (HW or HWC uint8) and the orientation still to apply, by Pillow. The
    orientation is read after the pixels are loaded: Pillow has applied and dropped a
    TIFF's Orientation tag by then."""
    with Image.open(io.BytesIO(memoryview(buf))) as im:
        im.load()
        orientation = int(im.getexif().get(0x0112, 1))
        mode = _pillow_mode(im.mode, color, "transparency" in im.info)
        im8 = _eight_bit(im)
        return np.asarray(im8 if im8.mode == mode else im8.convert(mode)), orientation


def _check_complete(buf: np.ndarray, sample: int, why: str = "") -> None:
    """Refuse a JPEG whose data stops before the end-of-image marker that follows its
    first scan: Pillow would decode it when told to load truncated images (the rest
    gray), and libjpeg only warns of it."""
    if len(buf) >= 2 and buf[-2] == 0xFF and buf[-1] == 0xD9:
        return
    scan = _headers(buf)[1]
    if not scan or bytes(buf[scan:]).find(b"\xff\xd9") < 0:
        raise FormatError(f"cannot decode image ({len(buf)} bytes): truncated: the data ends at byte {len(buf)}, "
                          f"before the end-of-image marker{why}", sample=sample)


def _decode_jpeg(buf: np.ndarray, color: str, info: JpegInfo, sample: int,
                 on_warning: Callable[[str], None] | None) -> np.ndarray:
    """A 1- or 3-component JPEG by simplejpeg; one it refuses (it stops at libjpeg's
    first warning, or at what its TurboJPEG API does not take) is Pillow's to decode,
    what stopped simplejpeg reported, unless its data stops before the end-of-image
    marker (truncated: refused)."""
    gray = info.components == 1 or color == "gray"
    try:
        img = simplejpeg.decode_jpeg(buf, colorspace="GRAY" if gray else "RGB")
    except ValueError as exc:
        reason = f"cannot decode image ({len(buf)} bytes): {exc}"
        _check_complete(buf, sample, f" ({exc})")
        try:
            img = _decode_pillow(buf, color)[0]
        except _PILLOW_ERRORS as pillow_exc:  # an error, not a warning: libjpeg's words say why
            raise FormatError(reason, sample=sample) from pillow_exc
        if on_warning is not None:
            on_warning(f"simplejpeg (libjpeg-turbo) stopped at: {exc}; decoded by Pillow")
        return img
    # libjpeg's gray -> RGB conversion repeats the value; done here, it also serves lossless JPEGs
    return np.repeat(img, 3, axis=2) if gray and color == "rgb" else img


try:
    from gpuio.ops import _jpeg
except ImportError:  # built at install where libjpeg's headers exist; else whole-image decodes only
    _jpeg = None


def native_jpeg() -> Any:
    """The C JPEG module (``gpuio.ops._jpeg``: headers, region decodes, decode + resample
    in one call), or ``None`` where it was not built."""
    return _jpeg


def jpeg_facts(bufs: list[np.ndarray]) -> np.ndarray:
    """libjpeg's reading of the headers of encoded images (contiguous uint8 arrays;
    ``gpuio.ops._jpeg`` must be built), int64 ``[N, 7]``: components, progressive, EXIF
    orientation, height, width (as stored), complete (ends with EOI), subsampling (the
    largest factor by which a component is subsampled, across or down: 1 for 4:4:4 and
    gray, 2 for 4:2:0, 4:2:2 and 4:4:0, 4 for 4:1:1); all 0 where libjpeg cannot read
    them (not a JPEG, a broken header)."""
    facts = np.empty((len(bufs), 7), np.int64)
    _jpeg.headers(bufs, facts)
    return facts


def facts_info(facts: np.ndarray) -> JpegInfo | None:
    """One row of ``jpeg_facts`` as ``jpeg_info`` gives it (None where libjpeg could
    not read the headers)."""
    components, progressive, orientation, height, width = facts[:5].tolist()
    return JpegInfo(components, bool(progressive), orientation, height, width) if components else None


def region_decodable(facts: np.ndarray) -> np.ndarray:
    """Which rows of ``jpeg_facts`` the region decoder (``gpuio.ops._jpeg.decode_resample``)
    takes: complete 1- or 3-component JPEGs without EXIF rotation, of at most
    ``MAX_PIXELS`` (``decode_cpu`` rejects the larger ones)."""
    components = facts[:, 0]
    return (((components == 1) | (components == 3)) & (facts[:, 2] == 1) & (facts[:, 3] > 0) & (facts[:, 4] > 0)
            & (facts[:, 5] == 1) & (facts[:, 3] * facts[:, 4] <= MAX_PIXELS))


def decode_region(data: np.ndarray, components: int, color: str, region: tuple[int, int, int, int], denom: int,
                  sample: int) -> np.ndarray:
    """Pixels ``y0:y1, x0:x1`` (``region``) of a JPEG that ``region_decodable`` takes
    (``components`` from its facts), DCT-scaled by 1/``denom`` (1, 2, 4, 8; the scaled
    image has ``ceil(size / denom)`` pixels per side), HWC uint8 as ``decode_cpu``
    gives. Rows below the region are not decoded at all, rows above and columns beside
    it are not IDCT'd."""
    y0, x0, y1, x1 = region
    out = np.empty((y1 - y0, x1 - x0, 1 if decodes_gray(color, components) else 3), np.uint8)
    try:
        _jpeg.decode_region(data, out.shape[2] == 1, denom, y0, x0, y1, x1, out)
    except ValueError as exc:
        raise FormatError(f"cannot decode image ({len(data)} bytes): {exc}", sample=sample) from exc
    return out


_local = threading.local()


def _gpu_decoder(nvimgcodec: Any, device: int) -> Any:
    """One nvImageCodec decoder per thread and device."""
    decoders = _local.__dict__.setdefault("decoders", {})
    if device not in decoders:
        decoders[device] = nvimgcodec.Decoder(device_id=device)
    return decoders[device]


class DecodeImage(Op):
    """Decode ``field`` (encoded bytes per row) into ``out`` (HWC uint8 per row). The
    encoded bytes must be in host memory (``host_inputs``): both decoders parse there,
    and so are the images' restart offsets where the batch has them (``<field>.restarts``,
    read by the fused CPU decode: ``gpuio.ops.restart``)."""

    def __init__(self, field: str = "data", out: str = "image", color: str = "rgb") -> None:
        if color not in COLORS:
            raise ConfigError(f"color {color!r}; choose one of {', '.join(COLORS)}")
        self.field, self.out, self.color = field, out, color
        self.host_inputs = (field, restarts_field(field))

    def __call__(self, batch: Batch) -> Batch:
        bufs = batch.data[self.field]
        images: list[Any] = [None] * len(bufs)
        decode_rows(batch, bufs, list(range(len(bufs))), self.color, images)
        batch.data[self.out] = upload(batch, images)
        batch.drop_rejected()
        return batch


def decode_rows(batch: Batch, bufs: list[Any], rows: list[int], color: str, images: list[Any]) -> list[int]:
    """Decode ``rows`` of ``bufs`` (encoded bytes) whole into ``images`` (HWC uint8): on
    a GPU batch nvImageCodec takes what it can in one call (CuPy arrays), the rest and
    what it fails on decode on the CPU (NumPy arrays). Returns the rows rejected (bad
    samples; their images stay None)."""
    if batch.device.is_cuda:
        gpu_rows = [row for row in rows if gpu_decodable(byte_view(bufs[row]))]
        decode_gpu(batch, gpu_rows, [byte_view(bufs[r]) for r in gpu_rows], color, images)
    bad = []
    for row in rows:
        if images[row] is None:
            try:
                images[row] = decode_cpu(bufs[row], color, int(batch.index[row]),
                                         on_warning=functools.partial(batch.warn, row))
            except FormatError as exc:
                batch.reject(row, exc)
                bad.append(row)
    return bad


def gpu_decodable(data: np.ndarray) -> bool:
    """Whether a GPU batch hands these bytes to nvImageCodec: a complete (ends with the
    end-of-image or end-of-codestream marker) baseline 1/3-component JPEG or JPEG 2000,
    or a TIFF."""
    info = jpeg_info(data)
    # a JPEG or JPEG 2000 cut short goes to the CPU path, which rejects it, rather than
    # to a decoder that may fill in the missing part
    ends = len(data) >= 2 and data[-2] == 0xFF and data[-1] == 0xD9
    if info is not None:  # too large: decode_cpu rejects it
        return info.components in (1, 3) and not info.progressive and ends and info.height * info.width <= MAX_PIXELS
    fmt = image_format(data)
    return (fmt == "jpeg2000" and ends) or fmt == "tiff"


def decode_gpu(batch: Batch, rows: list[int], sources: list[Any], color: str, images: list[Any]) -> None:
    """Decode ``sources`` (encoded bytes or nvImageCodec code streams, one per row in
    ``rows``) on the GPU in one call into ``images`` (HWC CuPy arrays); the rows it
    fails on stay None for the CPU path."""
    if not rows:
        return
    nvimgcodec = require("nvidia.nvimgcodec")
    params = _decode_params(nvimgcodec, color)
    with batch.on_device() as cp:
        stream = cp.cuda.get_current_stream()
        decoded = _gpu_decoder(nvimgcodec, batch.device.index).decode(sources, params=params, cuda_stream=stream.ptr)
        for row, img in zip(rows, decoded):
            if img is None:
                continue
            arr = _cuda_view(img, cp, batch.device.index)
            if arr.ndim == 2:
                arr = arr[:, :, None]
            if color == "rgb" and arr.shape[2] == 1:
                arr = cp.broadcast_to(arr, arr.shape[:2] + (3,))
            images[row] = arr


def _cuda_view(obj: Any, cp: Any, device: int) -> Any:
    """A CuPy array over the memory that ``obj``'s ``__cuda_array_interface__`` describes
    (on GPU ``device``), keeping ``obj`` alive, with no wait: ``cupy.asarray`` would
    synchronize the interface's ``stream`` (an nvImageCodec image names the stream it
    was decoded on, the batch's own), where the work that reads the array is queued on
    that same stream after the decode anyway."""
    face = obj.__cuda_array_interface__
    shape, dtype, strides = tuple(face["shape"]), np.dtype(face["typestr"]), face.get("strides")
    if strides is None:  # C order
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    else:  # from the first element to the end of the last
        nbytes = 0 if 0 in shape else sum((n - 1) * abs(st) for n, st in zip(shape, strides)) + dtype.itemsize
    memory = cp.cuda.UnownedMemory(face["data"][0], nbytes, obj, device)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0), strides=strides)


def upload(batch: Batch, images: list[Any]) -> list[Any]:
    """``images`` with the NumPy ones (decoded on the CPU) copied to a GPU batch's
    device on its stream; unchanged on a CPU batch."""
    if not batch.device.is_cuda:
        return images
    with batch.on_device() as cp:
        return [cp.asarray(img) if isinstance(img, np.ndarray) else img for img in images]


def _decode_params(nvimgcodec: Any, color: str) -> Any:
    """nvImageCodec's decode parameters for ``color``. Its ColorSpec has no RGB: SRGB
    gives interleaved RGB. Only the member needed is looked up."""
    spec = (nvimgcodec.ColorSpec.SRGB if color == "rgb" else nvimgcodec.ColorSpec.GRAY if color == "gray"
            else nvimgcodec.ColorSpec.UNCHANGED)
    return nvimgcodec.DecodeParams(color_spec=spec, apply_exif_orientation=True)


def decode_image(field: str = "data", out: str = "image", color: str = "rgb") -> DecodeImage:
    """See ``DecodeImage``."""
    return DecodeImage(field, out, color)
