"""Geometry ops: resize, center crop, random resized crop, flip.

Images are HWC arrays (uint8 unless said otherwise), one per row, as a list (sizes may
differ) or an array with one leading row per sample.

Resampling follows Pillow and torchvision's ``antialias=True``: for an output pixel
``o`` of a box ``[start, start + length)`` of source pixels resized to ``out``
pixels, ``scale = length / out``, ``center = start + (o + 0.5) * scale``; when
downsampling the filter is widened by ``scale`` (``fscale = max(scale, 1)``); source
pixel ``j`` in ``[floor(center - support + 0.5), floor(center + support + 0.5))``,
clipped to the pixels the filter may read, weighs ``filter((j + 0.5 - center) / fscale)``
and the weights are normalized to sum to 1. Filters: ``linear`` (triangle, support 1),
``cubic`` (Keys a=-0.5, support 2) and ``nearest`` (source pixel ``floor(center)``).
``area`` weighs each source pixel by its overlap with the output pixel's footprint
``[center - fscale/2, center + fscale/2)`` (an average over the area when
downsampling, linear interpolation when upsampling; unlike Pillow's BOX, which counts
whole pixels by their centers, it does not jump at ties). ``filter_weights`` computes these weights; the CPU
path runs Pillow where it computes the same thing (uint8, 1 or 3 channels; Pillow
rounds its horizontal pass to uint8 levels, which moves results by less than 1 level)
and the NumPy matrices elsewhere; the GPU kernel (``gpuio.ops._kernels``) computes them per
output pixel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError, DataError
from gpuio.ops._rng import Streams

__all__ = ["Resize", "CenterCrop", "RandomResizedCrop", "Flip", "resize", "center_crop",
           "random_resized_crop", "flip", "filter_weights", "resample", "INTERPOLATIONS"]

INTERPOLATIONS = {"nearest": 0, "linear": 1, "cubic": 2, "area": 3}
_SUPPORT = {"nearest": 0.0, "linear": 1.0, "cubic": 2.0, "area": 0.5}
_PILLOW = {"linear": Image.BILINEAR, "cubic": Image.BICUBIC}


def _check_interp(interp: str) -> str:
    if interp not in INTERPOLATIONS:
        raise ConfigError(f"interp {interp!r}; choose one of {', '.join(INTERPOLATIONS)}")
    return interp


def size_pair(size: int | Sequence[int], what: str) -> tuple[int, int]:
    """``(height, width)`` in pixels from an int or a pair; a ``ConfigError`` naming ``what`` else."""
    pair = (size, size) if isinstance(size, (int, np.integer)) else tuple(size)
    if len(pair) != 2 or any(int(s) < 1 for s in pair):
        raise ConfigError(f"{what} must be a positive int or (height, width), got {size!r}")
    return int(pair[0]), int(pair[1])


def _filter(interp: str, d: np.ndarray, fscale: float) -> np.ndarray:
    """Weight of a source pixel whose center is ``d`` pixels from the output pixel's."""
    x = np.abs(d / fscale)
    if interp == "linear":
        return np.maximum(1.0 - x, 0.0)
    if interp == "cubic":
        a = -0.5
        near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        far = (((x - 5.0) * x + 8.0) * x - 4.0) * a
        return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))
    half = 0.5 * fscale  # area: the overlap of the pixel with the output pixel's footprint
    return np.maximum(np.minimum(d + 0.5, half) - np.maximum(d - 0.5, -half), 0.0)


def filter_weights(out: int, start: float, length: float, lo: int, hi: int, interp: str = "linear",
                   antialias: bool = True) -> np.ndarray:
    """Resampling weights, float32 ``[out, hi - lo]``: row ``o`` weighs the source
    pixels ``lo .. hi-1`` (the pixels the filter may read) for output pixel ``o`` of
    the box ``[start, start + length)`` (source pixels) resized to ``out`` pixels."""
    scale = length / out
    center = start + (np.arange(out) + 0.5) * scale
    j = np.arange(lo, hi)[None, :]
    if interp == "nearest":
        pick = np.clip(np.floor(center), lo, hi - 1).astype(np.int64)
        return (j == pick[:, None]).astype(np.float32)
    fscale = max(scale, 1.0) if antialias else 1.0
    if interp == "area":
        first, last = np.floor(center - 0.5 * fscale), np.ceil(center + 0.5 * fscale)
    else:
        support = _SUPPORT[interp] * fscale
        first, last = np.floor(center - support + 0.5), np.floor(center + support + 0.5)
    inside = (j >= np.maximum(first, lo)[:, None]) & (j < np.minimum(last, hi)[:, None])
    w = _filter(interp, j + 0.5 - center[:, None], fscale) * inside
    total = w.sum(axis=1, keepdims=True)
    return (w / np.where(total == 0.0, 1.0, total)).astype(np.float32)


def resample(img: Any, box: Sequence[float], clip: Sequence[int], out_hw: tuple[int, int],
             interp: str = "linear", antialias: bool = True, xp: Any = np) -> Any:
    """Resample ``img`` (HWC, any real dtype) to ``out_hw``: the source box
    ``(y0, x0, h, w)`` in pixels, the filter reading only the source pixels in
    ``clip = (y0, x0, y1, x1)``. Horizontal pass first; for uint8 input its result is
    clipped to 0-255, as Pillow clips (Pillow also rounds it: within 0.5 level). Returns float32 HWC, not
    rounded or clipped. ``xp`` is the array module of ``img`` (CuPy for a GPU image; the
    caller has entered its device)."""
    y0, x0, bh, bw = (float(v) for v in box)
    cy0, cx0, cy1, cx1 = (int(v) for v in clip)
    wy = filter_weights(out_hw[0], y0, bh, cy0, cy1, interp, antialias)
    wx = filter_weights(out_hw[1], x0, bw, cx0, cx1, interp, antialias)
    region = img[cy0:cy1, cx0:cx1]
    if interp == "nearest":  # one-hot weights: pick the pixels
        return region[xp.asarray(np.argmax(wy, axis=1))][:, xp.asarray(np.argmax(wx, axis=1))].astype(np.float32)
    rows = xp.einsum("xj,yjc->yxc", xp.asarray(wx), region.astype(np.float32), optimize=True)
    if img.dtype == np.uint8:
        rows = xp.clip(rows, 0, 255)
    h, w, c = rows.shape
    return (xp.asarray(wy) @ rows.reshape(h, w * c)).reshape(out_hw[0], w, c)


def _to_uint8(x: Any, xp: Any = np) -> Any:
    return xp.clip(xp.floor(x + 0.5), 0, 255).astype(np.uint8)


def _resize_cpu(img: np.ndarray, out_hw: tuple[int, int], interp: str, antialias: bool) -> np.ndarray:
    """One HWC image to ``out_hw``; same dtype out (uint8 rounded half up)."""
    h, w, c = img.shape
    if (h, w) == tuple(out_hw):
        return img
    if img.dtype == np.uint8 and c in (1, 3) and antialias and interp in _PILLOW:
        pil = Image.fromarray(np.ascontiguousarray(img[:, :, 0] if c == 1 else img))
        res = np.asarray(pil.resize((out_hw[1], out_hw[0]), _PILLOW[interp], reducing_gap=None))
        return res.reshape(out_hw[0], out_hw[1], c)
    res = resample(img, (0, 0, h, w), (0, 0, h, w), out_hw, interp, antialias)
    return _to_uint8(res) if img.dtype == np.uint8 else res.astype(img.dtype, copy=False)


def _resize_gpu(batch: Batch, images: list[Any], boxes: np.ndarray, out_hw: np.ndarray, interp: str,
                antialias: bool) -> Any:
    """Crop boxes ``[N, 4]`` (y0, x0, h, w) of HWC images resized to ``out_hw`` ``[N, 2]``
    on the GPU, the filter reading only inside each box: the uint8 images of 1-4
    channels in one kernel launch per channel count, the others (another dtype, more
    channels) one by one with ``resample`` on CuPy, rounded or cast as on the CPU. One
    array when every output has one shape and dtype, else a list."""
    from gpuio.ops._kernels import crop_resize_normalize

    clips = np.stack([boxes[:, 0], boxes[:, 1], boxes[:, 0] + boxes[:, 2], boxes[:, 1] + boxes[:, 3]], axis=1)
    on_kernel = [img.dtype == np.uint8 and img.ndim == 3 and 1 <= img.shape[2] <= 4 for img in images]
    rows = np.flatnonzero(on_kernel)
    got = crop_resize_normalize(batch, [images[r] for r in rows], boxes[rows].astype(np.float32), clips[rows],
                                out_hw[rows], np.zeros(len(rows), np.int64), interp=interp,
                                antialias=antialias, layout="HWC", dtype="uint8")
    if len(rows) == len(images):
        return got
    out: list[Any] = [None] * len(images)
    for r, image in zip(rows.tolist(), got):
        out[r] = image
    for r in np.flatnonzero(~np.array(on_kernel, bool)).tolist():
        out[r] = _resample_gpu(batch, images[r], boxes[r], clips[r], tuple(out_hw[r].tolist()), interp, antialias)
    return out


def _resample_gpu(batch: Batch, img: Any, box: np.ndarray, clip: np.ndarray, out_hw: tuple[int, int],
                  interp: str, antialias: bool) -> Any:
    """One image the kernel does not read, resized as ``_resize_cpu`` resizes it (a box
    of the output's size is the crop itself, as on the CPU)."""
    t, l, h, w = (int(v) for v in box)
    if (h, w) == out_hw and tuple(float(v) for v in box) == (t, l, h, w):
        return img[t:t + h, l:l + w]
    with batch.on_device() as cp:
        res = resample(img, box, clip, out_hw, interp, antialias, xp=cp)
        return _to_uint8(res, cp) if img.dtype == np.uint8 else res.astype(img.dtype, copy=False)


class Resize(Op):
    """Resize each HWC image to ``size=(h, w)``, or so that its shorter side is
    ``shorter`` pixels, or its longer side ``longer`` pixels (the other side keeps the
    aspect ratio, truncated as torchvision does). Antialiased unless ``antialias=False``
    (then the filter is not widened when downsampling)."""

    def __init__(self, size: int | Sequence[int] | None = None, *, shorter: int | None = None,
                 longer: int | None = None, interp: str = "linear", antialias: bool = True,
                 field: str = "image") -> None:
        if sum(v is not None for v in (size, shorter, longer)) != 1:
            raise ConfigError("give exactly one of size=(h, w), shorter= or longer=")
        self.size = None if size is None else size_pair(size, "size")
        for name, v in (("shorter", shorter), ("longer", longer)):
            if v is not None and int(v) < 1:
                raise ConfigError(f"{name} must be a positive number of pixels, got {v!r}")
        self.shorter, self.longer = shorter, longer
        self.interp, self.antialias, self.field = _check_interp(interp), bool(antialias), field

    def out_size(self, h: int, w: int) -> tuple[int, int]:
        """Output (height, width) for an ``h`` x ``w`` input."""
        if self.size is not None:
            return self.size
        if self.shorter is not None:
            s = int(self.shorter)
            return (s, max(1, int(s * w / h))) if h <= w else (max(1, int(s * h / w)), s)
        s = int(self.longer)
        return (max(1, int(s * h / w)), s) if w >= h else (s, max(1, int(s * w / h)))

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        hw = image_sizes(images)
        out_hw = np.array([self.out_size(h, w) for h, w in hw.tolist()], dtype=np.int64).reshape(-1, 2)
        if batch.device.is_cuda:
            boxes = np.concatenate([np.zeros_like(hw), hw], axis=1).astype(np.float64)
            batch.data[self.field] = _resize_gpu(batch, list(images), boxes, out_hw, self.interp, self.antialias)
        else:
            batch.data[self.field] = [_resize_cpu(img, tuple(hw), self.interp, self.antialias)
                                      for img, hw in zip(images, out_hw.tolist())]
        return batch


class Crop(Op):
    """Base for crops: ``box(batch, row, h, w) -> (top, left, height, width)``."""

    field = "image"

    def box(self, batch: Batch, row: int, h: int, w: int) -> tuple[int, int, int, int]:  # pragma: no cover
        """The crop of ``row`` (an image of ``h`` x ``w`` pixels): (top, left, height, width)."""
        raise NotImplementedError

    def boxes(self, batch: Batch, hw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Crop boxes for images of sizes ``hw`` ``[N, 2]``: int64 ``[N, 4]`` (top,
        left, height, width) and a bool mask of the rows that have one (the others
        were rejected through ``batch.reject`` and get a zero box)."""
        out = np.zeros((len(hw), 4), dtype=np.int64)
        ok = np.ones(len(hw), dtype=bool)
        for row, (h, w) in enumerate(np.asarray(hw).tolist()):
            if h <= 0 or w <= 0:  # rejected by an earlier crop of the same chain
                ok[row] = False
                continue
            try:
                out[row] = self.box(batch, row, h, w)
            except DataError as exc:
                batch.reject(row, exc)
                ok[row] = False
        return out, ok


def image_sizes(images: Sequence[Any]) -> np.ndarray:
    """(height, width) of each HWC image, int64 ``[N, 2]``."""
    return np.array([img.shape[:2] for img in images], dtype=np.int64).reshape(-1, 2)


class CenterCrop(Crop):
    """The centered ``size`` (h, w) window of each image, as torchvision places it
    (offsets rounded). An image smaller than ``size`` is a bad sample (resize first)."""

    def __init__(self, size: int | Sequence[int], *, field: str = "image") -> None:
        self.size, self.field = size_pair(size, "size"), field

    def box(self, batch: Batch, row: int, h: int, w: int) -> tuple[int, int, int, int]:
        ch, cw = self.size
        if ch > h or cw > w:
            raise DataError(f"image of {h}x{w} pixels is smaller than the center crop {ch}x{cw}; "
                            f"resize it first", sample=int(batch.index[row]))
        return int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0)), ch, cw

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        boxes, _ = self.boxes(batch, image_sizes(images))
        batch.data[self.field] = [img[t:t + h, l:l + w] for img, (t, l, h, w) in zip(images, boxes.tolist())]
        batch.drop_rejected()
        return batch


class RandomResizedCrop(Crop):
    """torchvision's RandomResizedCrop: a box of ``scale`` x the image's area and
    aspect ratio (w/h) in ``ratio`` (log-uniform), 10 tries, then the center crop of
    the ratio closest to the image's; the box is resized to ``size`` (h, w)."""

    salt = 0x52524331

    def __init__(self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                 ratio: Sequence[float] = (3 / 4, 4 / 3), *, interp: str = "linear", antialias: bool = True,
                 field: str = "image") -> None:
        self.size = size_pair(size, "size")
        if not (0 < scale[0] <= scale[1]) or not (0 < ratio[0] <= ratio[1]):
            raise ConfigError(f"scale and ratio must be increasing positive pairs, got {scale!r} and {ratio!r}")
        self.scale, self.ratio = (float(scale[0]), float(scale[1])), (float(ratio[0]), float(ratio[1]))
        self.interp, self.antialias, self.field = _check_interp(interp), bool(antialias), field

    def boxes(self, batch: Batch, hw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As ``Crop.boxes``, drawn for the whole batch at once in one C call
        (``ops._rng.Streams.boxes``: the numbers of ``batch.rng(row, salt)``). Per row:
        up to 10 tries of a target area and a log-uniform aspect, then the top and left
        offsets of the first box that fits; no fit: the centered box of the ratio
        closest to the image's."""
        hw = np.ascontiguousarray(hw, np.int64).reshape(-1, 2)
        ok = (hw[:, 0] > 0) & (hw[:, 1] > 0)  # rows rejected by an earlier crop of the same chain have no size
        return Streams(batch.seeds, self.salt).boxes(hw, self.scale, self.ratio), ok

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        boxes, _ = self.boxes(batch, image_sizes(images))
        if batch.device.is_cuda:
            out_hw = np.tile(np.array(self.size, dtype=np.int64), (len(images), 1))
            batch.data[self.field] = _resize_gpu(batch, list(images), boxes.astype(np.float64), out_hw,
                                                 self.interp, self.antialias)
        else:
            batch.data[self.field] = [_resize_cpu(img[t:t + h, l:l + w], self.size, self.interp, self.antialias)
                                      for img, (t, l, h, w) in zip(images, boxes.tolist())]
        return batch


class Flip(Op):
    """Mirror each image with probability ``p``: left-right (``horizontal=True``) or
    upside down. On both devices the result is a view (no copy)."""

    salt = 0x464C4950

    def __init__(self, horizontal: bool = True, p: float = 0.5, *, field: str = "image") -> None:
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"p is a probability in [0, 1], got {p!r}")
        self.horizontal, self.p, self.field = bool(horizontal), float(p), field

    def flips(self, batch: Batch) -> np.ndarray:
        """Per row: 1 (mirror left-right), 2 (upside down) or 0."""
        bit = 1 if self.horizontal else 2
        return np.where(Streams(batch.seeds, self.salt).random() < self.p, bit, 0).astype(np.int64)

    def __call__(self, batch: Batch) -> Batch:
        flips = self.flips(batch)
        images = batch.data[self.field]
        batch.data[self.field] = [img if not f else (img[:, ::-1] if f == 1 else img[::-1])
                                  for img, f in zip(images, flips.tolist())]
        return batch


def resize(size: int | Sequence[int] | None = None, *, shorter: int | None = None, longer: int | None = None,
           interp: str = "linear", antialias: bool = True, field: str = "image") -> Resize:
    """See ``Resize``."""
    return Resize(size, shorter=shorter, longer=longer, interp=interp, antialias=antialias, field=field)


def center_crop(size: int | Sequence[int], *, field: str = "image") -> CenterCrop:
    """See ``CenterCrop``."""
    return CenterCrop(size, field=field)


def random_resized_crop(size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0),
                        ratio: Sequence[float] = (3 / 4, 4 / 3), *, interp: str = "linear",
                        antialias: bool = True, field: str = "image") -> RandomResizedCrop:
    """See ``RandomResizedCrop``."""
    return RandomResizedCrop(size, scale, ratio, interp=interp, antialias=antialias, field=field)


def flip(horizontal: bool = True, p: float = 0.5, *, field: str = "image") -> Flip:
    """See ``Flip``."""
    return Flip(horizontal, p, field=field)
