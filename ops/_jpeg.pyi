"""libjpeg decoding for ``gpuio.ops`` on the CPU, fused with the resampler of
``ops/_resample.h`` (``ops/_jpeg.c``).

Optional: built at install where libjpeg's headers exist; else whole images are decoded
by simplejpeg. Callers: ``gpuio.ops.decode`` (``jpeg_facts``, ``decode_region``, reached
through ``native_jpeg()``), ``gpuio.ops.fused`` (``decode_resample``) and
``gpuio.ops.restart`` (``add_restarts``).
"""
from _typeshed import ReadableBuffer, WriteableBuffer

def headers(images: list[ReadableBuffer], out: WriteableBuffer, /) -> None:
    """libjpeg's reading of the headers of N encoded images into ``out``, int64
    ``[N, 7]``: components, progressive (0/1), EXIF orientation (1-8; 1 when absent or
    malformed), height, width (in pixels, as stored), complete (1 when the data ends with
    the EOI marker), subsampling (the largest factor by which a component is subsampled,
    across or down: 1 for 4:4:4 and gray, 2 for 4:2:0, 4:2:2 and 4:4:0, 4 for 4:1:1). A row is all 0 where libjpeg cannot read the headers (not a JPEG, a
    broken header): such images take the whole-image decoder. The GIL is released while
    the headers are read.

    Raises TypeError when ``images`` is not a list of buffers; ValueError when ``out``
    holds fewer than ``N * 7 * 8`` bytes.
    """

def decode_region(data: ReadableBuffer, gray: bool, denom: int, y0: int, x0: int, y1: int, x1: int,
                  out: WriteableBuffer, restarts: ReadableBuffer | None = None, /) -> None:
    """Rows ``y0:y1`` and columns ``x0:x1`` of the 1/``denom``-scaled image of one JPEG
    (pixels of the scaled image, which has ``ceil(size / denom)`` pixels per side), uint8
    HWC with 1 channel (``gray``) or 3 (RGB) into the first
    ``(y1 - y0) * (x1 - x0) * channels`` bytes of ``out``. Rows below the region are not
    decoded. ``restarts``: the JPEG's restart offsets (little-endian uint32, as
    ``add_restarts`` gives them; None or empty: none): then only the restart intervals
    that cover the region and 4 pixels around it (which the chroma upsampler reads) are
    decoded, where its intervals are a
    whole number of MCU rows or an even part of one (else the whole stream, as without);
    the pixels are the same. The GIL is released while it decodes.

    Raises ValueError when ``denom`` is not 1, 2, 4 or 8, the region is empty or does
    not fit in ``out``, it ends outside the image, ``restarts`` do not fit the JPEG, or
    libjpeg cannot decode the data (the message is libjpeg's).
    """

def decode_resample(images: list[ReadableBuffer], denoms: ReadableBuffer, gray: bool, boxes: ReadableBuffer,
                    clips: ReadableBuffer, out_hw: ReadableBuffer, offsets: ReadableBuffer, flips: ReadableBuffer,
                    mean: ReadableBuffer, inv_std: ReadableBuffer, out: WriteableBuffer, interp: int,
                    antialias: int, chw: int, to_uint8: bool, restarts: list[ReadableBuffer | None] | None = None,
                    /) -> list[tuple[int, str]]:
    """Decode and resample a batch of N JPEGs in one call, the GIL released for the whole
    batch: per image, only the rows and iMCU columns its clip reads are decoded (only the
    restart intervals that cover them where ``restarts[i]`` holds its restart offsets,
    as in ``decode_region``), at
    1/``denoms[i]`` DCT scale (``denoms``: int64 ``[N]``, each 1, 2, 4 or 8), 1 channel
    (``gray``) or 3, then cropped, resized, flipped, normalized and cast into ``out`` as
    ``gpuio.ops._resample.resample`` does. ``boxes`` and ``clips`` are in full-image
    pixels; the other arguments are those of ``resample``.

    Returns ``[(row, message)]`` for the images that failed to decode (their outputs are
    left unwritten; the caller decodes them another way or rejects them); ``[]`` when all
    succeeded.

    Raises TypeError when ``images`` is not a list of buffers or ``restarts`` not a list
    of N buffers or None; ValueError when ``denoms`` or another argument buffer is too
    short, a ``restarts`` buffer's size is not a multiple of 4, ``interp`` is not 0, 1 or 3, or
    an image's denom is not 1, 2, 4 or 8 or its output does not fit in ``out`` (the
    message names the image's row); MemoryError.
    """

def add_restarts(data: ReadableBuffer, interval: int, fit: bool, /) -> tuple[bytes, bytes]:
    """The JPEG ``data`` rewritten losslessly (libjpeg's transcoding: the DCT coefficients
    are copied) with a restart marker every ``interval`` MCUs (0: every MCU row; ``fit``:
    the interval nearest to it that makes the intervals a grid on the image's MCU rows,
    as ``add_restart_markers(fit_rows=True)`` says), and the
    byte offsets of each restart interval's first entropy-coded byte in it, interval 0
    included, as little-endian uint32 bytes. Optimal Huffman tables, one sequential scan,
    the APP1 and APP2 markers kept (see ``gpuio.ops.restart.add_restart_markers``). The
    GIL is released while it runs.

    Raises ValueError when ``interval`` is outside 0-65535 or libjpeg cannot read the
    JPEG (the message is libjpeg's); MemoryError.
    """

def stage_times() -> tuple[float, float]:
    """(decode, resample): CPU seconds that ``decode_resample`` has spent decoding and
    resampling while ``time_stages(True)`` was in force, summed over all threads (the two
    stages run in one call, so a profiler cannot tell them apart otherwise)."""

def time_stages(on: bool) -> None:
    """Count ``stage_times()`` from now on (``True``) or stop (``False``, the default:
    reading a thread's CPU clock twice per image is a system call on some machines)."""
