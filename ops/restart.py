"""JPEG restart markers: a lossless rewrite that lets a crop decode only what it covers.

A JPEG's entropy-coded data is one bit stream: to decode a row, a decoder must
Huffman-decode every row above it. Restart markers (RST0-RST7, every N MCUs) cut the
stream into intervals that start afresh (byte-aligned, DC predictions reset), so a
decoder that knows where each interval starts can decode a window from the intervals
that cover it and skip the rest. ``add_restart_markers`` rewrites a JPEG with markers
(libjpeg's transcoding: the DCT coefficients are copied, never decoded to pixels, so the
pixels stay exactly those of the original) and returns each interval's byte offset. The
fused CPU decode (``gpuio.ops.fused.DecodeFused``) takes those offsets from the field
``<field>.restarts`` beside the encoded images (``<field>``) and decodes a crop from the
intervals it covers, reaching a few pixels beyond it on each side (what the chroma
upsampler reads), bit-exact to decoding the whole image and cropping it. An interval must be a
whole number of MCU rows (``interval_mcus=0``: one row) or an even part of one (then
columns are skipped too; ``add_restart_markers`` picks such an interval near the one
asked for); other intervals, and images without offsets, decode the whole stream.
"""

from __future__ import annotations

import numpy as np

from gpuio.errors import ConfigError, DependencyError, FormatError
from gpuio.ops.decode import byte_view, native_jpeg, restarts_field

__all__ = ["add_restart_markers", "restarts_field"]


def add_restart_markers(jpeg: bytes | np.ndarray, interval_mcus: int, *,
                        fit_rows: bool = True) -> tuple[bytes, np.ndarray]:
    """``jpeg`` (encoded bytes) rewritten losslessly with a restart marker every
    ``interval_mcus`` MCUs (0: every MCU row; an MCU is 8x8 pixels for grayscale and
    4:4:4, 16x16 for 4:2:0, 8 high and 16 wide for 4:2:2), and the byte offset of each
    restart interval's first entropy-coded byte in the new JPEG, interval 0 included
    (uint32 ``[intervals]``). ``fit_rows`` (the default) moves the interval to the
    nearest one that a crop can use, as the image's MCUs per row allow: a whole number
    of rows where ``interval_mcus`` is a row or more, else the divisor of a row nearest
    to it between half and twice it (the crop then skips columns too), else one row;
    ``fit_rows=False`` keeps it exactly (``jpegtran -restart NB``). The DCT
    coefficients, quantization tables and sampling are copied, so the pixels decode
    exactly as the original's; the Huffman tables are made optimal for the image and the
    data is one sequential scan (a progressive JPEG comes out baseline); the Exif and XMP
    (APP1) and ICC profile (APP2) markers are kept, other metadata dropped.
    Deterministic: the same input gives the same bytes. The GIL is released while it
    runs.

    Raises ``FormatError`` when libjpeg cannot read the JPEG (the message is libjpeg's),
    ``ConfigError`` for an interval outside 0-65535, and ``DependencyError`` where
    ``gpuio.ops._jpeg`` was not built.
    """
    if not 0 <= interval_mcus <= 65535:
        raise ConfigError(f"restart interval {interval_mcus}: 0 (every MCU row) to 65535 MCUs")
    module = native_jpeg()
    if module is None:
        raise DependencyError("add_restart_markers needs gpuio.ops._jpeg, built at install where libjpeg's "
                              "headers exist (libjpeg-turbo / libjpeg-dev): reinstall gpuio with them")
    data = byte_view(jpeg)
    try:
        out, offsets = module.add_restarts(data, int(interval_mcus), fit_rows)
    except ValueError as exc:
        raise FormatError(f"cannot add restart markers to a JPEG of {len(data)} bytes: {exc}") from exc
    return out, np.frombuffer(offsets, "<u4").astype(np.uint32)
