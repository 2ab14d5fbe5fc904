"""Training augmentations with DALI's names, arguments and defaults: colour
(``brightness_contrast``, ``hsv``, ``color_twist``, ``random_grayscale``), ``gaussian_blur``,
``erase`` (DALI's fixed regions), ``random_erasing`` (torchvision's RandomErasing) and
``jpeg_compression_distortion``.

Images are HWC uint8 per row (a list, sizes may differ, or one array ``[N, H, W, C]``);
an op returns the same kind of container with new uint8 images (rounded half up,
saturated to 0-255). Every numeric argument is a constant or a ``(low, high)`` range:
a range draws one uniform number per sample from the numbers of ``batch.rng(row, salt)``
(keyed by seed, epoch and sample, so the draws of a sample do not depend on the batch it
is in), the ranged arguments in the order of the signature.

The colour ops are one 3x3 matrix and offset per sample applied to the RGB channels
(channels past the third pass through): on the CPU one C call per batch
(``gpuio.ops._augment.color``, a 256-level table per channel where the matrix is
diagonal, as brightness_contrast's), on the GPU one elementwise kernel launch per shape;
both compute the same float32 sums, so they give the same levels. ``gaussian_blur`` is
one C call per batch on the CPU (``_augment.blur``) and two kernel launches per image on
the GPU, again with the same sums.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError, DataError
from gpuio.ops import _augment
from gpuio.ops._rng import Streams

__all__ = ["BrightnessContrast", "Hsv", "ColorTwist", "RandomGrayscale", "GaussianBlur", "RandomErasing", "Erase",
           "JpegCompressionDistortion", "erase", "jpeg_compression_distortion", "brightness_contrast", "hsv",
           "color_twist", "random_grayscale", "gaussian_blur", "random_erasing",
           "Range", "param_range", "draw", "yiq_matrix", "apply_color", "apply_levels", "histograms",
           "reflect101_index", "host_outputs", "LUMA",
           "host_copies", "COLOR_SOURCE", "BLUR_SOURCE", "HISTOGRAM_SOURCE", "REFLECT101_SOURCE", "EXACT_OPTIONS"]

Range = float | tuple[float, float]

# DALI's RGB <-> YIQ matrices (color_twist.h): hue rotates I and Q, saturation scales them
_RGB2YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.321], [0.211, -0.523, 0.311]])
_YIQ2RGB = np.array([[1.0, 0.956, 0.621], [1.0, -0.272, -0.647], [1.0, -1.107, 1.705]])
LUMA = np.array([0.299, 0.587, 0.114])


def param_range(value: Range, name: str, low: float = -math.inf, high: float = math.inf) -> tuple[float, float]:
    """``(low, high)`` of a constant or a range argument, each end in ``[low, high]``;
    a ``ConfigError`` naming ``name`` and the valid range else."""
    pair = (value, value) if isinstance(value, (int, float, np.number)) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, (int, float, np.number)) and math.isfinite(v) for v in pair):
        raise ConfigError(f"{name} is a number or a (low, high) range, got {value!r}")
    lo, hi = float(pair[0]), float(pair[1])
    if not (low <= lo <= hi <= high):
        raise ConfigError(f"{name}={value!r}: each value must be in [{low}, {high}] and low <= high")
    return lo, hi


def draw(batch: Batch, salt: int, ranges: Sequence[tuple[float, float]]) -> np.ndarray:
    """Per row one value of each range, float64 ``[N, len(ranges)]``: a constant as is, a
    range uniform from ``batch.rng(row, salt)`` (in the order given, constants drawing
    nothing)."""
    streams = Streams(batch.seeds, salt)
    out = np.empty((len(batch), len(ranges)))
    for k, (lo, hi) in enumerate(ranges):
        out[:, k] = lo if lo == hi else streams.uniform(lo, hi)
    return out


def yiq_matrix(hue: float, saturation: float, value: float) -> np.ndarray:
    """DALI's hsv transform of RGB values, float64 ``[3, 3]``: to YIQ, rotate I/Q by
    ``hue`` degrees, scale I/Q by ``saturation``, scale all by ``value``, back to RGB."""
    h = math.radians(hue)
    rot = np.array([[1.0, 0.0, 0.0], [0.0, math.cos(h), math.sin(h)], [0.0, -math.sin(h), math.cos(h)]])
    sat = np.diag([1.0, saturation, saturation])
    return _YIQ2RGB @ rot @ sat @ (value * _RGB2YIQ)


def _rows(images: Any) -> list[Any]:
    return list(images)


def _groups(images: list[Any], rows: list[int]) -> dict[tuple[int, ...], list[int]]:
    """``rows`` grouped by the shape of their image, in row order."""
    out: dict[tuple[int, ...], list[int]] = {}
    for row in rows:
        out.setdefault(tuple(images[row].shape), []).append(row)
    return out


def _container(images: Any, rows: list[Any], xp: Any) -> Any:
    """``rows`` as the kind of container ``images`` was (one array or a list)."""
    return xp.stack(rows) if not isinstance(images, list) and rows else rows


def _to_uint8(xp: Any, v: Any) -> Any:
    return xp.clip(xp.floor(v + 0.5), 0, 255).astype(xp.uint8)


# the elementwise kernels' bodies (CuPy ElementwiseKernel: ``i`` the output index, ``dst``
# its element; tests/test_ops_augment_kernels.py runs them as C++ on the CPU and compiles
# them with nvcc as CuPy compiles them)
# The NVRTC options of every kernel whose float arithmetic must give the CPU path's
# levels (ops/_augment.c is built with -ffp-contract=off): NVRTC contracts a multiply
# and an add into one FMA by default, rounding once where the CPU rounds twice.
EXACT_OPTIONS = ("--fmad=false",)
COLOR_SOURCE = r"""
const long long p = i / c;            /* pixel index over the stacked batch */
const int ch = (int)(i % c);
const int s = (int)(p / hw);          /* sample */
float v;
if (c >= 3 && ch < 3) {
    const long long b = p * c;
    v = m[s * 12 + ch * 3] * src[b] + m[s * 12 + ch * 3 + 1] * src[b + 1] + m[s * 12 + ch * 3 + 2] * src[b + 2]
        + m[s * 12 + 9 + ch];
} else if (c < 3) {
    v = m[s * 12] * src[i] + m[s * 12 + 9];
} else {
    v = src[i];
}
dst = (unsigned char)fminf(fmaxf(floorf(v + 0.5f), 0.0f), 255.0f);
"""
BLUR_SOURCE = r"""
const int ch = (int)(i % c);
const long long p = i / c;
const int x = (int)(p % wd), y = (int)(p / wd);
float acc = 0.0f;
for (int k = -radius; k <= radius; ++k) {
    int yy = axis == 0 ? reflect101(y + k, h) : y;
    int xx = axis == 0 ? x : reflect101(x + k, wd);
    acc += w[k + radius] * (float)src[((long long)yy * wd + xx) * c + ch];
}
dst = acc;
"""
HISTOGRAM_SOURCE = r"""
const long long k = i / (hw * c);     /* image */
const int ch = (int)(i % c);
atomicAdd(&counts[(k * 4 + ch) * 256 + src[i]], 1u);
"""
REFLECT101_SOURCE = r"""
__device__ __forceinline__ int reflect101(int j, int n) {
    if (n == 1) return 0;
    while (j < 0 || j >= n) { j = j < 0 ? -j : 2 * n - 2 - j; }
    return j;
}
"""
_kernels: dict[str, Any] = {}


def _kernel(cp: Any, name: str) -> Any:
    """The op's elementwise kernel, made once per process (CuPy caches the build)."""
    if name not in _kernels:
        if name == "histogram":  # integer counts: no float arithmetic to keep exact
            _kernels[name] = cp.ElementwiseKernel("raw uint8 src, int64 hw, int64 c", "raw uint32 counts",
                                                  HISTOGRAM_SOURCE, "gpuio_histograms")
        elif name == "color":
            _kernels[name] = cp.ElementwiseKernel("raw uint8 src, raw float32 m, int64 hw, int64 c", "uint8 dst",
                                                  COLOR_SOURCE, "gpuio_color_matrix", options=EXACT_OPTIONS)
        else:
            _kernels[name] = cp.ElementwiseKernel(
                "raw T src, raw float32 w, int32 h, int32 wd, int64 c, int32 radius, int32 axis", "float32 dst",
                BLUR_SOURCE, "gpuio_blur_pass", preamble=REFLECT101_SOURCE, options=EXACT_OPTIONS)
    return _kernels[name]


def apply_color(batch: Batch, field: str, matrices: np.ndarray, offsets: np.ndarray) -> None:
    """``out = M @ rgb + offset`` per pixel of each row (``matrices`` ``[N, 3, 3]``,
    ``offsets`` ``[N, 3]``; 1-2 channel images take ``M[0, 0] * v + offset[0]``, channels
    past the third pass through), rounded half up to uint8, into ``batch.data[field]``."""
    images = batch.data[field]
    rows = _rows(images)
    for row, img in enumerate(rows):
        if img.dtype != np.uint8 or img.ndim != 3:
            raise DataError(f"the colour ops take uint8 HWC images; row {row} is {img.dtype} of shape "
                            f"{tuple(img.shape)}", sample=int(batch.index[row]))
    table = np.zeros((len(rows), 12), np.float32)
    table[:, :9] = np.asarray(matrices).reshape(-1, 9)
    table[:, 9:] = offsets
    out: list[Any] = list(rows)  # rows whose transform is the identity stay as they are
    same = np.all(table == np.array([1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0], np.float32), axis=1)
    rows_to_do = [r for r in range(len(rows)) if not same[r]]
    if batch.device.is_cuda:
        with batch.on_device() as cp:
            for shape, idx in _groups(rows, rows_to_do).items():
                src = cp.ascontiguousarray(cp.stack([rows[r] for r in idx]))
                dst = cp.empty(src.shape, cp.uint8)
                _kernel(cp, "color")(src, cp.asarray(table[idx]), shape[0] * shape[1], shape[2], dst)
                out = _place(out, idx, dst)
            batch.data[field] = _container(images, out, cp)
        return
    src = [np.ascontiguousarray(rows[r]) for r in rows_to_do]
    dst = host_outputs(src)
    _augment.color(src, np.ascontiguousarray(table[rows_to_do]), dst)
    batch.data[field] = _container(images, _place(out, rows_to_do, dst), np)


def host_outputs(images: list[np.ndarray]) -> list[np.ndarray]:
    """Uninitialized outputs of the images' shapes and types for a C call: the rows of one
    new array when the shapes agree (one allocation per batch), else one array each."""
    if images and all(img.shape == images[0].shape and img.dtype == images[0].dtype for img in images):
        return list(np.empty((len(images), *images[0].shape), images[0].dtype))
    return [np.empty_like(img) for img in images]


def apply_levels(batch: Batch, images: list[Any], tables: np.ndarray) -> list[Any]:
    """Each uint8 HWC image (1-4 channels) with its levels mapped: channel ``c`` of image
    ``k`` through ``tables[k, c]`` (uint8 ``[N, 4, 256]``); new images, on the batch's
    device."""
    if not batch.device.is_cuda:
        src = [np.ascontiguousarray(img) for img in images]
        out = [np.empty_like(img) for img in src]
        _augment.lut(src, np.ascontiguousarray(tables, np.uint8), out)
        return out
    with batch.on_device() as cp:
        return [cp.asarray(t[:img.shape[2]])[cp.arange(img.shape[2]), img.astype(cp.int32)]
                for img, t in zip(images, tables)]


def histograms(batch: Batch, images: list[Any]) -> np.ndarray:
    """The count of each level per channel of each uint8 HWC image (1-4 channels), int64
    ``[N, 4, 256]`` in host memory (zeros for channels an image does not have). On the GPU
    one kernel launch per image shape and one copy to the host for the batch."""
    counts = np.zeros((len(images), 4, 256), np.int64)
    if not batch.device.is_cuda:
        _augment.histogram([np.ascontiguousarray(img) for img in images], counts)
        return counts
    with batch.on_device() as cp:
        groups, parts = _groups(images, list(range(len(images)))), []
        for (h, w, c), idx in groups.items():
            parts.append(cp.zeros((len(idx), 4, 256), cp.uint32))
            src = cp.ascontiguousarray(cp.stack([images[r] for r in idx]))
            _kernel(cp, "histogram")(src, h * w, c, parts[-1], size=src.size)
        for idx, part in zip(groups.values(), host_copies(cp, parts)):
            counts[idx] = part
    return counts


def host_copies(cp: Any, arrays: list[Any]) -> list[np.ndarray]:
    """``arrays`` (on the current device) copied into one pinned host buffer on the
    current stream, with the one wait for that stream that reading them on the host
    needs; views of the buffer, in order, shaped as the arrays."""
    stream = cp.cuda.get_current_stream()
    arrays = [cp.ascontiguousarray(a) for a in arrays]
    ends = np.cumsum([0, *(a.nbytes for a in arrays)]).tolist()
    pinned = cp.cuda.alloc_pinned_memory(max(ends[-1], 1))  # CuPy's pinned pool: small, short-lived
    host = np.frombuffer(pinned, np.uint8, ends[-1])
    for a, offset in zip(arrays, ends):
        if a.nbytes:
            a.data.copy_to_host_async(pinned.ptr + offset, a.nbytes, stream)
    stream.synchronize()  # the batch's one wait: its work so far and these copies
    return [host[lo:hi].view(a.dtype).reshape(a.shape) for a, lo, hi in zip(arrays, ends, ends[1:])]


def _place(out: list[Any], idx: list[int], stacked: Any) -> list[Any]:
    for k, r in enumerate(idx):
        out[r] = stacked[k]
    return out


def _need_rgb(batch: Batch, field: str, op: str) -> None:
    for row, img in enumerate(batch.data[field]):
        if img.ndim != 3 or img.shape[2] < 3 or img.dtype != np.uint8:
            batch.reject(row, DataError(f"{op} takes uint8 HWC images of 3 or more channels (RGB first); "
                                        f"row {row} is {img.dtype} of shape {tuple(img.shape)}",
                                        sample=int(batch.index[row])))
    batch.drop_rejected()


class BrightnessContrast(Op):
    """DALI's brightness_contrast on uint8 HWC images: ``out = brightness_shift * 255 +
    brightness * (contrast_center + contrast * (in - contrast_center))`` per channel,
    rounded half up and saturated to 0-255. ``contrast_center`` defaults to 128 (half of
    uint8's range, as DALI). Each of ``brightness``, ``brightness_shift``, ``contrast``
    and ``contrast_center`` is a constant or a ``(low, high)`` range drawn per sample.
    ``brightness=(0.6, 1.4), contrast=(0.6, 1.4)`` is torchvision's brightness/contrast
    jitter of 0.4 with a fixed centre instead of the image's mean grey."""

    salt = 0x42434E54

    def __init__(self, brightness: Range = 1.0, contrast: Range = 1.0, contrast_center: Range | None = None,
                 brightness_shift: Range = 0.0, *, field: str = "image") -> None:
        self.ranges = (param_range(brightness, "brightness"), param_range(brightness_shift, "brightness_shift", -1, 1),
                       param_range(contrast, "contrast", 0.0),
                       param_range(128.0 if contrast_center is None else contrast_center, "contrast_center", 0, 255))
        self.field = field

    def params(self, batch: Batch) -> np.ndarray:
        """Per row (brightness, brightness_shift, contrast, contrast_center), float64 ``[N, 4]``."""
        return draw(batch, self.salt, self.ranges)

    def __call__(self, batch: Batch) -> Batch:
        if len(batch) == 0:
            return batch
        b, shift, c, center = self.params(batch).T
        scale = b * c
        offset = shift * 255.0 + b * center * (1.0 - c)
        apply_color(batch, self.field, scale[:, None, None] * np.eye(3), np.repeat(offset[:, None], 3, axis=1))
        return batch


class Hsv(Op):
    """DALI's hsv on uint8 RGB(A) HWC images, a linear transform in YIQ space: ``hue``
    rotates the chroma (degrees, default 0), ``saturation`` scales it (default 1; 0 gives
    grey), ``value`` scales all three (default 1). DALI's YIQ matrices are rounded to 3
    digits, so ``hue=0, saturation=1, value=1`` moves some pixels by 1 level, as in DALI.
    Each argument is a constant or a ``(low, high)`` range drawn per sample."""

    salt = 0x48535631

    def __init__(self, hue: Range = 0.0, saturation: Range = 1.0, value: Range = 1.0, *,
                 field: str = "image") -> None:
        self.ranges = (param_range(hue, "hue", -360, 360), param_range(saturation, "saturation", 0.0),
                       param_range(value, "value", 0.0))
        self.field = field

    def params(self, batch: Batch) -> np.ndarray:
        """Per row (hue, saturation, value), float64 ``[N, 3]``."""
        return draw(batch, self.salt, self.ranges)

    def __call__(self, batch: Batch) -> Batch:
        _need_rgb(batch, self.field, "hsv")
        if len(batch) == 0:
            return batch
        m = np.stack([yiq_matrix(h, s, v) for h, s, v in self.params(batch).tolist()])
        apply_color(batch, self.field, m, np.zeros((len(m), 3)))
        return batch


class ColorTwist(Op):
    """DALI's color_twist on uint8 RGB(A) HWC images: hsv's ``hue`` (degrees) and
    ``saturation`` in YIQ space, then ``brightness * (128 + contrast * (v - 128))``
    (DALI's composition, contrast about half of uint8's range). Defaults leave the image
    as hsv's identity does. Each argument is a constant or a ``(low, high)`` range drawn
    per sample, in the order brightness, contrast, hue, saturation."""

    salt = 0x43545749

    def __init__(self, brightness: Range = 1.0, contrast: Range = 1.0, hue: Range = 0.0,
                 saturation: Range = 1.0, *, field: str = "image") -> None:
        self.ranges = (param_range(brightness, "brightness", 0.0), param_range(contrast, "contrast", 0.0),
                       param_range(hue, "hue", -360, 360), param_range(saturation, "saturation", 0.0))
        self.field = field

    def params(self, batch: Batch) -> np.ndarray:
        """Per row (brightness, contrast, hue, saturation), float64 ``[N, 4]``."""
        return draw(batch, self.salt, self.ranges)

    def __call__(self, batch: Batch) -> Batch:
        _need_rgb(batch, self.field, "color_twist")
        if len(batch) == 0:
            return batch
        p = self.params(batch)
        m = np.stack([b * c * yiq_matrix(h, s, 1.0) for b, c, h, s in p.tolist()])
        offset = (128.0 - 128.0 * p[:, 1]) * p[:, 0]
        apply_color(batch, self.field, m, np.repeat(offset[:, None], 3, axis=1))
        return batch


class RandomGrayscale(Op):
    """torchvision's RandomGrayscale: with probability ``p`` (default 0.1) an RGB(A) image
    becomes grey in all three colour channels, ``0.299 R + 0.587 G + 0.114 B`` (ITU-R
    601-2 luma, as Pillow's ``convert("L")``), rounded half up; alpha passes through.
    1-2 channel images are already grey and stay as they are."""

    salt = 0x47524159

    def __init__(self, p: float = 0.1, *, field: str = "image") -> None:
        self.p = param_range(p, "p", 0.0, 1.0)[0]
        self.field = field

    def chosen(self, batch: Batch) -> np.ndarray:
        """Per row whether it turns grey, bool ``[N]`` (a draw in [0, 1) below ``p``:
        every row for ``p = 1``, none for ``p = 0``, with no draws)."""
        if self.p in (0.0, 1.0):
            return np.full(len(batch), self.p == 1.0)
        return Streams(batch.seeds, self.salt).random() < self.p

    def __call__(self, batch: Batch) -> Batch:
        if len(batch) == 0:
            return batch
        grey = self.chosen(batch) & np.array([img.shape[2] >= 3 for img in batch.data[self.field]], bool)
        m = np.where(grey[:, None, None], np.tile(LUMA, (3, 1))[None], np.eye(3)[None])
        apply_color(batch, self.field, m, np.zeros((len(batch), 3)))
        return batch


def gaussian_weights(sigma: float, window: int) -> np.ndarray:
    """The normalized 1-D Gaussian of ``window`` taps (odd), float32."""
    x = np.arange(window) - window // 2
    w = np.exp(-(x * x) / (2.0 * sigma * sigma))
    return (w / w.sum()).astype(np.float32)


def reflect101_index(n: int, radius: int) -> np.ndarray:
    """Source index of each padded position ``-radius .. n + radius - 1`` (mirror
    without repeating the edge pixel: ``dcb|abcd|cba``)."""
    j = np.arange(-radius, n + radius)
    if n == 1:
        return np.zeros_like(j)
    period = 2 * n - 2
    j = np.abs(j) % period
    return np.where(j >= n, period - j, j)


class GaussianBlur(Op):
    """DALI's gaussian_blur on HWC uint8 images: a separable Gaussian of ``sigma``
    pixels and ``window_size`` taps, borders mirrored without repeating the edge pixel
    (``dcb|abcd|cba``, OpenCV's BORDER_REFLECT_101). Give either or both: only ``sigma``
    gives ``window_size = 2 * ceil(3 * sigma) + 1``; only ``window_size`` gives ``sigma
    = ((window_size - 1) / 2 - 1) * 0.3 + 0.8``. Both may be a ``(height, width)`` pair
    (``sigma`` with ``per_axis=True``); ``sigma`` may also be a ``(low, high)`` range drawn
    per sample (then the window follows each drawn sigma unless given). Rows are filtered
    horizontally then vertically in float32 and rounded half up once."""

    salt = 0x47424C52

    def __init__(self, sigma: Range | None = None, window_size: int | Sequence[int] | None = None, *,
                 per_axis: bool = False, field: str = "image") -> None:
        if sigma is None and window_size is None:
            raise ConfigError("gaussian_blur needs sigma= (pixels, > 0) or window_size= (odd taps >= 1), or both")
        self.windows: tuple[int, int] | None = None
        if window_size is not None:
            pair = (window_size, window_size) if isinstance(window_size, (int, np.integer)) else tuple(window_size)
            if len(pair) != 2 or any(int(w) != w or int(w) < 1 or int(w) % 2 == 0 for w in pair):
                raise ConfigError(f"window_size must be an odd number of taps >= 1 (or a (height, width) "
                                  f"pair of them), got {window_size!r}")
            self.windows = (int(pair[0]), int(pair[1]))
        if sigma is None:  # DALI: radius = (window - 1) / 2, sigma = (radius - 1) * 0.3 + 0.8
            s_y, s_x = (((w - 1) / 2 - 1) * 0.3 + 0.8 for w in self.windows)
            self.sigmas, self.shared = ((s_y, s_y), (s_x, s_x)), False
        elif per_axis:
            if isinstance(sigma, (int, float)) or len(sigma) != 2:
                raise ConfigError(f"sigma with per_axis=True is (height, width), got {sigma!r}")
            self.sigmas, self.shared = tuple(param_range(s, "sigma", 1e-3, 1e3) for s in sigma), False
        else:
            self.sigmas, self.shared = (param_range(sigma, "sigma", 1e-3, 1e3),) * 2, True
        self.field = field

    def params(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """Per row (sigma_y, sigma_x) float64 ``[N, 2]`` and (window_y, window_x) int64
        ``[N, 2]``; one draw per row serves both axes unless ``per_axis``."""
        drawn = draw(batch, self.salt, self.sigmas[:1] if self.shared else self.sigmas)
        sigmas = np.repeat(drawn, 2, axis=1) if self.shared else drawn
        if self.windows is not None:
            windows = np.tile(np.array(self.windows, np.int64), (len(batch), 1))
        else:
            windows = 2 * np.ceil(3 * sigmas).astype(np.int64) + 1
        return sigmas, windows

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        rows = _rows(images)
        sigmas, windows = self.params(batch)
        weights = [(gaussian_weights(sy, wy), gaussian_weights(sx, wx))
                   for (sy, sx), (wy, wx) in zip(sigmas.tolist(), windows.tolist())]
        if not batch.device.is_cuda:
            batch.data[self.field] = _container(images, self._blur_cpu(rows, weights), np)
            return batch
        with batch.on_device() as cp:
            out = [self._blur_gpu(cp, img, ky, kx) for img, (ky, kx) in zip(rows, weights)]
            batch.data[self.field] = _container(images, out, cp)
        return batch

    @staticmethod
    def _blur_cpu(rows: list[np.ndarray], weights: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """One C call for the batch: uint8 and float32 images as they are, other types
        through float32 and back."""
        src = [np.ascontiguousarray(img if img.dtype in (np.uint8, np.float32) else img.astype(np.float32))
               for img in rows]
        out = [np.empty_like(img) for img in src]
        _augment.blur(src, [ky for ky, _ in weights], [kx for _, kx in weights], out)
        return [o if o.dtype == img.dtype else o.astype(img.dtype) for o, img in zip(out, rows)]

    @staticmethod
    def _blur_gpu(cp: Any, img: Any, ky: np.ndarray, kx: np.ndarray) -> Any:
        """The two passes of the blur kernel; the caller has entered the image's device."""
        src = cp.ascontiguousarray(img)
        h, w, c = src.shape
        rows = cp.empty(src.shape, cp.float32)
        _kernel(cp, "blur")(src, cp.asarray(kx), np.int32(h), np.int32(w), c, np.int32(len(kx) // 2), np.int32(1),
                            rows)
        cols = cp.empty(src.shape, cp.float32)
        _kernel(cp, "blur")(rows, cp.asarray(ky), np.int32(h), np.int32(w), c, np.int32(len(ky) // 2), np.int32(0),
                            cols)
        return _to_uint8(cp, cols) if img.dtype == np.uint8 else cols.astype(img.dtype)


class RandomErasing(Op):
    """torchvision's RandomErasing: with probability ``p`` erase one box of each image
    (HWC), of ``scale`` x the image's area and aspect ratio (h/w) log-uniform in
    ``ratio``, up to 10 tries for a box smaller than the image (none fits: the image
    stays), filled with ``value`` (one level, or one per channel). The box's top and
    left are uniform over the positions where it fits. gpuio erases uint8 levels, before
    ``normalize``; torchvision usually erases after Normalize, where 0 is the mean colour:
    give the mean levels (e.g. ``value=(124, 116, 104)``) for that look."""

    salt = 0x45524153

    def __init__(self, p: float = 0.5, scale: Sequence[float] = (0.02, 0.33), ratio: Sequence[float] = (0.3, 3.3),
                 value: float | Sequence[float] = 0, *, field: str = "image") -> None:
        self.p = param_range(p, "p", 0.0, 1.0)[0]
        self.scale = param_range(tuple(scale), "scale", 0.0, 1.0)
        self.ratio = param_range(tuple(ratio), "ratio", 1e-6)
        self.value = np.atleast_1d(np.asarray(value, np.float64))
        if self.value.ndim != 1 or not np.all((self.value >= 0) & (self.value <= 255)):
            raise ConfigError(f"value is one level in [0, 255] or one per channel, got {value!r}")
        self.field = field

    def boxes(self, batch: Batch, hw: np.ndarray) -> np.ndarray:
        """Per row (top, left, height, width), int64 ``[N, 4]``; height 0 where nothing
        is erased. A draw below ``p``, then the tries (``ops._rng.Streams.boxes``)."""
        streams = Streams(batch.seeds, self.salt)
        erasing = streams.random() < self.p
        return streams.boxes(hw, self.scale, self.ratio, erase=True, rows=erasing)

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        rows = _rows(images)
        boxes = self.boxes(batch, np.array([img.shape[:2] for img in rows], np.int64).reshape(-1, 2))
        with batch.on_device() as xp:
            batch.data[self.field] = _container(images, self._erase(xp, rows, boxes), xp)
        return batch

    def _erase(self, xp: Any, rows: list[Any], boxes: np.ndarray) -> list[Any]:
        out = []
        for img, (top, left, h, w) in zip(rows, boxes.tolist()):
            if h:
                if len(self.value) not in (1, img.shape[2]):
                    raise ConfigError(f"value has {len(self.value)} levels for an image of {img.shape[2]} channels")
                img = img.copy()
                img[top:top + h, left:left + w] = xp.asarray(np.floor(self.value + 0.5).astype(img.dtype))
            out.append(img)
        return out


class Erase(Op):
    """DALI's erase on HWC images: fill regions with ``fill_value`` (one level, or one per
    channel; default 0). ``anchor`` and ``shape`` list the regions' coordinates one region
    after another along ``axis_names`` (``"HW"``: ``(y0, x0, y1, x1, ...)`` and ``(h0, w0,
    h1, w1, ...)``; ``"H"`` or ``"W"``: bands across the whole other axis), in pixels, or
    as fractions of the image's size with ``normalized`` (both), ``normalized_anchor`` or
    ``normalized_shape``; ``centered_anchor`` puts the anchor at the region's centre. A
    region covers pixels ``floor(anchor)`` to ``floor(anchor + shape)`` (exclusive), clipped
    to the image, as DALI places them. The regions are the same for every image (a random
    box per image: ``random_erasing``)."""

    def __init__(self, anchor: Sequence[float], shape: Sequence[float], fill_value: float | Sequence[float] = 0,
                 axis_names: str = "HW", normalized_anchor: bool = False, normalized_shape: bool = False,
                 centered_anchor: bool = False, normalized: bool | None = None, *, field: str = "image") -> None:
        if axis_names not in ("HW", "WH", "H", "W"):
            raise ConfigError(f"axis_names {axis_names!r}; choose HW, WH, H or W (images are HWC)")
        anchor_a, shape_a = np.atleast_1d(np.asarray(anchor, np.float64)), np.atleast_1d(np.asarray(shape, np.float64))
        k = len(axis_names)
        if anchor_a.ndim != 1 or anchor_a.size == 0 or anchor_a.size % k or anchor_a.size != shape_a.size:
            raise ConfigError(f"anchor and shape give {k} coordinate(s) per region ({axis_names}), the same "
                              f"number of regions; got anchor={anchor!r} shape={shape!r}")
        if np.any(shape_a < 0) or not np.all(np.isfinite(anchor_a)):
            raise ConfigError(f"shape must be >= 0 and anchor finite; got anchor={anchor!r} shape={shape!r}")
        self.fill = np.atleast_1d(np.asarray(fill_value, np.float64))
        if self.fill.ndim != 1 or not np.all((self.fill >= 0) & (self.fill <= 255)):
            raise ConfigError(f"fill_value is one level in [0, 255] or one per channel, got {fill_value!r}")
        if normalized is not None:
            normalized_anchor = normalized_shape = bool(normalized)
        self.axes = ["HW".index(a) for a in axis_names]
        self.anchor, self.shape = anchor_a.reshape(-1, k), shape_a.reshape(-1, k)
        self.norm_anchor, self.norm_shape, self.centered = bool(normalized_anchor), bool(normalized_shape), \
            bool(centered_anchor)
        self.field = field

    def regions(self, h: int, w: int) -> np.ndarray:
        """The regions of an ``h`` x ``w`` image in pixels, (y0, x0, y1, x1) int64 ``[R, 4]``."""
        out = np.tile(np.array([0, 0, h, w], np.int64), (len(self.anchor), 1))
        size = np.array([h, w], np.float64)[self.axes]
        anchor = self.anchor * size if self.norm_anchor else self.anchor
        extent = self.shape * size if self.norm_shape else self.shape
        if self.centered:
            anchor = anchor - extent / 2
        for j, axis in enumerate(self.axes):
            out[:, axis] = np.clip(np.floor(anchor[:, j]), 0, size[j])
            out[:, axis + 2] = np.clip(np.floor(anchor[:, j] + extent[:, j]), 0, size[j])
        return out

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        rows = _rows(images)
        with batch.on_device() as xp:
            batch.data[self.field] = _container(images, self._erase(xp, rows), xp)
        return batch

    def _erase(self, xp: Any, rows: list[Any]) -> list[Any]:
        out = []
        for img in rows:
            if len(self.fill) not in (1, img.shape[2]):
                raise ConfigError(f"fill_value has {len(self.fill)} levels for an image of {img.shape[2]} channels")
            img = img.copy()
            level = xp.asarray(np.floor(self.fill + 0.5).astype(img.dtype))
            for y0, x0, y1, x1 in self.regions(*img.shape[:2]).tolist():
                img[y0:y1, x0:x1] = level
            out.append(img)
        return out


def erase(anchor: Sequence[float], shape: Sequence[float], fill_value: float | Sequence[float] = 0,
          axis_names: str = "HW", normalized_anchor: bool = False, normalized_shape: bool = False,
          centered_anchor: bool = False, normalized: bool | None = None, *, field: str = "image") -> Erase:
    """See ``Erase``."""
    return Erase(anchor, shape, fill_value, axis_names, normalized_anchor, normalized_shape, centered_anchor,
                 normalized, field=field)


class JpegCompressionDistortion(Op):
    """DALI's jpeg_compression_distortion on uint8 HWC images of 1 or 3 channels: each image
    is JPEG-encoded at ``quality`` (1-100, default 50; 4:2:0 chroma for colour) and decoded
    again, with libjpeg through Pillow (the same bytes as DALI's CPU operator). ``quality``
    is a constant or an inclusive ``(low, high)`` range of ints drawn per sample. A GPU
    batch's images go through host memory for the codec (nvJPEG's encoder is not used)."""

    salt = 0x4A504547

    def __init__(self, quality: int | tuple[int, int] = 50, *, field: str = "image") -> None:
        lo, hi = param_range(quality, "quality", 1, 100)
        if lo != int(lo) or hi != int(hi):
            raise ConfigError(f"quality is an int or an (low, high) range of ints in [1, 100], got {quality!r}")
        self.quality, self.field = (int(lo), int(hi)), field

    def qualities(self, batch: Batch) -> np.ndarray:
        """Per row the quality, int64 ``[N]``."""
        lo, hi = self.quality
        if lo == hi:
            return np.full(len(batch), lo, np.int64)
        rows = np.ones(len(batch), bool)
        return lo + Streams(batch.seeds, self.salt).integers(np.full(len(batch), hi - lo + 1), rows)

    @staticmethod
    def _codec(img: np.ndarray, quality: int) -> np.ndarray:
        from PIL import Image

        if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] not in (1, 3):
            raise ConfigError(f"jpeg_compression_distortion takes uint8 HWC images of 1 or 3 channels; "
                              f"got {img.dtype} of shape {tuple(img.shape)}")
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(img[..., 0] if img.shape[2] == 1 else img)).save(buf, "JPEG",
                                                                                               quality=quality)
        with Image.open(buf) as decoded:
            return np.asarray(decoded).reshape(img.shape)

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        rows = _rows(images)
        qualities = self.qualities(batch).tolist()
        if not batch.device.is_cuda:
            batch.data[self.field] = _container(images, [self._codec(img, q) for img, q in zip(rows, qualities)], np)
            return batch
        with batch.on_device() as cp:
            host = host_copies(cp, rows)  # one wait for the batch
            out = [cp.asarray(self._codec(img, q)) for img, q in zip(host, qualities)]  # uploads do not wait
            batch.data[self.field] = _container(images, out, cp)
        return batch


def jpeg_compression_distortion(quality: int | tuple[int, int] = 50, *,
                                field: str = "image") -> JpegCompressionDistortion:
    """See ``JpegCompressionDistortion``."""
    return JpegCompressionDistortion(quality, field=field)


def brightness_contrast(brightness: Range = 1.0, contrast: Range = 1.0, contrast_center: Range | None = None,
                        brightness_shift: Range = 0.0, *, field: str = "image") -> BrightnessContrast:
    """See ``BrightnessContrast``."""
    return BrightnessContrast(brightness, contrast, contrast_center, brightness_shift, field=field)


def hsv(hue: Range = 0.0, saturation: Range = 1.0, value: Range = 1.0, *, field: str = "image") -> Hsv:
    """See ``Hsv``."""
    return Hsv(hue, saturation, value, field=field)


def color_twist(brightness: Range = 1.0, contrast: Range = 1.0, hue: Range = 0.0, saturation: Range = 1.0, *,
                field: str = "image") -> ColorTwist:
    """See ``ColorTwist``."""
    return ColorTwist(brightness, contrast, hue, saturation, field=field)


def random_grayscale(p: float = 0.1, *, field: str = "image") -> RandomGrayscale:
    """See ``RandomGrayscale``."""
    return RandomGrayscale(p, field=field)


def gaussian_blur(sigma: Range | None = None, window_size: int | Sequence[int] | None = None, *,
                  per_axis: bool = False, field: str = "image") -> GaussianBlur:
    """See ``GaussianBlur``."""
    return GaussianBlur(sigma, window_size, per_axis=per_axis, field=field)


def random_erasing(p: float = 0.5, scale: Sequence[float] = (0.02, 0.33), ratio: Sequence[float] = (0.3, 3.3),
                   value: float | Sequence[float] = 0, *, field: str = "image") -> RandomErasing:
    """See ``RandomErasing``."""
    return RandomErasing(p, scale, ratio, value, field=field)
