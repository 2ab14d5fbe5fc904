"""``decode_image_slice``: decode only a window of each image (DALI's
``decoders.image_slice``), the window a ``random_bbox_crop`` chose.

The window comes per row as a relative ``anchor`` (x, y) and ``shape`` (w, h), both
0-1, rounded to pixels by ``crop_window``. CPU: JPEGs that ``region_decodable`` takes
(their headers read in one call per batch) are decoded by libjpeg-turbo only where the
window is (rows below it are not decoded, columns beside it not IDCT'd;
``gpuio.ops._jpeg``); other images, and those the region decoder stops on (a libjpeg
warning), are decoded whole by ``decode_cpu`` (the one decode policy: see
``ops.decode``) and sliced. GPU: nvImageCodec decodes
the batch in one call, JPEGs without EXIF rotation and JPEG 2000 through its region
decode (``CodeStream.get_sub_code_stream(region=)``), TIFFs and rotated JPEGs whole and
then sliced; the rest take the CPU path and are uploaded. The output equals ``decode_image`` followed by the same slice.
``code_stream``, ``stored_orientation`` and ``region_source`` are the GPU region
machinery, shared with ``ops.fused.DecodeFused`` (the window a fused chain reads).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.device import require
from gpuio.errors import ConfigError, FormatError
from gpuio.ops import decode
from gpuio.ops.decode import (COLORS, byte_view, decode_cpu, decode_gpu, decode_region, facts_info, gpu_decodable,
                              image_format, jpeg_facts, jpeg_info, region_decodable, upload)

__all__ = ["DecodeImageSlice", "decode_image_slice", "crop_window", "code_stream", "region_source",
           "stored_orientation"]


def crop_window(anchor: Sequence[float], shape: Sequence[float], h: int, w: int) -> tuple[int, int, int, int]:
    """Pixel window ``(y0, x0, y1, x1)`` of a relative crop (``anchor`` x, y and
    ``shape`` w, h) in an ``h`` x ``w`` image: edges rounded to the nearest pixel, at
    least one pixel kept."""
    x0 = min(max(int(np.floor(anchor[0] * w + 0.5)), 0), w - 1)
    y0 = min(max(int(np.floor(anchor[1] * h + 0.5)), 0), h - 1)
    x1 = min(max(int(np.floor((anchor[0] + shape[0]) * w + 0.5)), x0 + 1), w)
    y1 = min(max(int(np.floor((anchor[1] + shape[1]) * h + 0.5)), y0 + 1), h)
    return y0, x0, y1, x1


def _slice(img: Any, anchor: Sequence[float], shape: Sequence[float]) -> Any:
    y0, x0, y1, x1 = crop_window(anchor, shape, img.shape[0], img.shape[1])
    return img[y0:y1, x0:x1]


class DecodeImageSlice(Op):
    """Decode the window ``anchor``/``shape`` (field names; relative x, y and w, h per
    row) of ``field`` (encoded bytes) into ``out`` (HWC uint8); see the module
    docstring. Colours and errors as ``decode_image``."""

    def __init__(self, field: str = "data", anchor: str = "crop_anchor", shape: str = "crop_shape",
                 out: str = "image", color: str = "rgb") -> None:
        if color not in COLORS:
            raise ConfigError(f"color {color!r}; choose one of {', '.join(COLORS)}")
        self.field, self.anchor, self.shape, self.out, self.color = field, anchor, shape, out, color
        self.host_inputs = (field,)

    def __call__(self, batch: Batch) -> Batch:
        bufs = batch.data[self.field]
        anchors, shapes = batch.data[self.anchor], batch.data[self.shape]
        images: list[Any] = [None] * len(bufs)
        if batch.device.is_cuda:
            self._decode_gpu(batch, bufs, anchors, shapes, images)
        rows = [row for row in range(len(bufs)) if images[row] is None]
        data = [byte_view(bufs[row]) for row in rows]
        facts = jpeg_facts(data) if decode.native_jpeg() is not None else None
        windowed = region_decodable(facts).tolist() if facts is not None else [False] * len(rows)
        for k, row in enumerate(rows):
            try:
                images[row] = self._decode_cpu(data[k], None if facts is None else facts[k], windowed[k],
                                               anchors[row], shapes[row], int(batch.index[row]),
                                               functools.partial(batch.warn, row))
            except FormatError as exc:
                batch.reject(row, exc)
        batch.data[self.out] = upload(batch, images)
        batch.drop_rejected()
        return batch

    def _decode_cpu(self, data: np.ndarray, facts: np.ndarray | None, windowed: bool, anchor: Sequence[float],
                    shape: Sequence[float], sample: int, on_warning: Callable[[str], None]) -> np.ndarray:
        """The window of one image: by the region decoder where it takes the image
        (``windowed``; ``facts``: its row of ``jpeg_facts``, None where the decoder is
        not built). What the region decoder refuses (it stops at libjpeg's first
        warning) is decoded whole by ``decode_cpu``, which decodes or refuses it as
        ``decode_image`` does."""
        if windowed:
            window = crop_window(anchor, shape, int(facts[3]), int(facts[4]))
            try:
                return decode_region(data, int(facts[0]), self.color, window, 1, sample)
            except FormatError:
                pass
        info = facts_info(facts) if facts is not None else None
        return np.ascontiguousarray(_slice(decode_cpu(data, self.color, sample, info, on_warning), anchor, shape))

    def _decode_gpu(self, batch: Batch, bufs: list[Any], anchors: list[Any], shapes: list[Any],
                    images: list[Any]) -> None:
        """Region-decode on the GPU what nvImageCodec takes; the rest stays None."""
        nvimgcodec = require("nvidia.nvimgcodec")
        rows, sources, whole = [], [], []
        for row, buf in enumerate(bufs):
            data = byte_view(buf)
            if not gpu_decodable(data):
                continue
            if not stored_orientation(data):
                rows.append(row)
                sources.append(data)
                whole.append(row)
                continue
            stream = code_stream(nvimgcodec, data)
            if stream is None:
                continue
            window = crop_window(anchors[row], shapes[row], stream.height, stream.width)
            rows.append(row)
            sources.append(region_source(nvimgcodec, stream, window))
        decode_gpu(batch, rows, sources, self.color, images)
        for row in whole:
            if images[row] is not None:
                images[row] = _slice(images[row], anchors[row], shapes[row])


def stored_orientation(data: np.ndarray) -> bool:
    """Whether an image's decoded pixels are in its stored orientation, so that a
    window in stored coordinates is the window of the decoded image: not a JPEG with an
    EXIF rotation, not a TIFF (which may carry its own orientation tag)."""
    info = jpeg_info(data)
    return (info is None or info.orientation == 1) and image_format(data) != "tiff"


def code_stream(nvimgcodec: Any, data: np.ndarray) -> Any | None:
    """nvImageCodec's parsed code stream of ``data`` (its ``height`` and ``width`` are
    the stored size; parsing needs no GPU), or None where it cannot parse the bytes
    (the CPU path then decodes or rejects them)."""
    try:
        stream = nvimgcodec.CodeStream(data)
        parsed = stream.height > 0 and stream.width > 0  # nvImageCodec parses on this first look
    except RuntimeError:
        return None
    return stream if parsed else None


def region_source(nvimgcodec: Any, stream: Any, window: Sequence[int]) -> Any:
    """What ``decode_gpu`` decodes for the pixels ``window`` (y0, x0, y1, x1; stored
    coordinates, inside the image) of ``stream``: a sub code stream with that region
    (nvImageCodec decodes only it), or ``stream`` itself for the whole image."""
    y0, x0, y1, x1 = (int(v) for v in window)
    if (y0, x0, y1, x1) == (0, 0, stream.height, stream.width):
        return stream
    return stream.get_sub_code_stream(region=nvimgcodec.Region(y0, x0, y1, x1))


def decode_image_slice(field: str = "data", anchor: str = "crop_anchor", shape: str = "crop_shape",
                       out: str = "image", color: str = "rgb") -> DecodeImageSlice:
    """See ``DecodeImageSlice``."""
    return DecodeImageSlice(field, anchor, shape, out, color)
