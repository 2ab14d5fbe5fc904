"""Geometry by inverse mapping: ``rotate`` and ``warp_affine``, DALI's names, arguments
and defaults.

Coordinates are continuous with pixel ``(x, y)`` covering ``[x, x + 1) x [y, y + 1)``
(centres at ``+ 0.5``), as in DALI's warps. Output pixel ``(x, y)`` samples the source
at ``M @ (x + 0.5, y + 0.5, 1)`` (``M``: 2x3, destination to source, x first):
``linear`` weighs the 4 pixels around it, ``nearest`` takes the pixel it falls in. A tap
outside the image reads ``fill_value`` (one level, or one per channel), or, with no
``fill_value``, the nearest border pixel (coordinates clamped). Results round half up to
uint8. The CPU runs one C call per batch (``gpuio.ops._augment.warp``, the GIL released);
the GPU one elementwise kernel launch per image (``warp`` below); both compute the same
float32 arithmetic, so they give the same levels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError
from gpuio.ops import _augment
from gpuio.ops.augment import EXACT_OPTIONS, Range, draw, param_range

__all__ = ["Rotate", "WarpAffine", "rotate", "warp_affine", "rotated_size", "rotation_matrix", "warp", "INTERP_TYPES",
           "WARP_SOURCE", "TAP_SOURCE"]

INTERP_TYPES = ("linear", "nearest")

WARP_SOURCE = r"""
const int ch = (int)(i % c);
const long long p = i / c;
const int x = (int)(p % ow), y = (int)(p / ow);
const float dx = x + 0.5f, dy = y + 0.5f;
/* source, pixel centres at integers; held within 2 pixels of the image (every tap beyond
   reads what the nearest one there reads) so that the int conversions cannot overflow */
const float sx = fminf(fmaxf(m[0] * dx + m[1] * dy + m[2] - 0.5f, -2.0f), iw + 1.0f);
const float sy = fminf(fmaxf(m[3] * dx + m[4] * dy + m[5] - 0.5f, -2.0f), ih + 1.0f);
float v;
if (interp == 1) {
    v = tap(src, (int)floorf(sx + 0.5f), (int)floorf(sy + 0.5f), ch, ih, iw, c, use_fill, fill);
} else {
    const int x0 = (int)floorf(sx), y0 = (int)floorf(sy);
    const float fx = sx - x0, fy = sy - y0;
    const float top = tap(src, x0, y0, ch, ih, iw, c, use_fill, fill) * (1.0f - fx)
                    + tap(src, x0 + 1, y0, ch, ih, iw, c, use_fill, fill) * fx;
    const float bottom = tap(src, x0, y0 + 1, ch, ih, iw, c, use_fill, fill) * (1.0f - fx)
                       + tap(src, x0 + 1, y0 + 1, ch, ih, iw, c, use_fill, fill) * fx;
    v = top * (1.0f - fy) + bottom * fy;
}
dst = (unsigned char)fminf(fmaxf(floorf(v + 0.5f), 0.0f), 255.0f);
"""
TAP_SOURCE = r"""
template <typename S, typename F>  /* S, F: CuPy's CArray of the raw arguments */
__device__ __forceinline__ float tap(const S& src, int x, int y, int ch, int ih, int iw, int c, int use_fill,
                                     const F& fill) {
    if (x < 0 || y < 0 || x >= iw || y >= ih) {
        if (use_fill) return fill[ch];
        x = min(max(x, 0), iw - 1);
        y = min(max(y, 0), ih - 1);
    }
    return (float)src[((long long)y * iw + x) * c + ch];
}
"""
_kernels: dict[str, Any] = {}


def _kernel(cp: Any) -> Any:
    """The warp kernel, made once per process (CuPy caches the build)."""
    if "warp" not in _kernels:
        _kernels["warp"] = cp.ElementwiseKernel(
            "raw uint8 src, raw float32 m, raw float32 fill, int32 ih, int32 iw, int32 ow, int32 c, int32 interp, "
            "int32 use_fill", "uint8 dst", WARP_SOURCE, "gpuio_warp_affine", preamble=TAP_SOURCE,
            options=EXACT_OPTIONS)
    return _kernels["warp"]


def _fill_levels(fill_value: float | Sequence[float] | None) -> np.ndarray | None:
    if fill_value is None:
        return None
    levels = np.atleast_1d(np.asarray(fill_value, np.float64))
    if levels.ndim != 1 or not np.all((levels >= 0) & (levels <= 255)):
        raise ConfigError(f"fill_value is one level in [0, 255] or one per channel (or None: clamp to the "
                          f"border), got {fill_value!r}")
    return levels


def _check_interp(interp_type: str) -> int:
    if interp_type not in INTERP_TYPES:
        raise ConfigError(f"interp_type {interp_type!r}; choose one of {', '.join(INTERP_TYPES)}")
    return INTERP_TYPES.index(interp_type)


def warp(batch: Batch, field: str, matrices: np.ndarray, out_hw: np.ndarray, fill: np.ndarray | None,
         interp: int) -> None:
    """Warp each uint8 HWC image of ``batch.data[field]`` by its destination-to-source
    matrix (``matrices`` ``[N, 2, 3]``) to ``out_hw`` ``[N, 2]`` pixels (see the module
    docstring); a list of new images replaces the field."""
    images = list(batch.data[field])
    for img in images:
        if img.dtype != np.uint8 or img.ndim != 3 or not 1 <= img.shape[2] <= 4:
            raise ConfigError(f"warps take uint8 HWC images of 1-4 channels; got {img.dtype} of shape "
                              f"{tuple(img.shape)}")
        if fill is not None and len(fill) not in (1, img.shape[2]):
            raise ConfigError(f"fill_value has {len(fill)} levels for an image of {img.shape[2]} channels")
    if not batch.device.is_cuda:
        fills = np.zeros((len(images), 4), np.float32)
        if fill is not None:
            for k, img in enumerate(images):
                fills[k, :img.shape[2]] = np.broadcast_to(fill, (img.shape[2],))
        src = [np.ascontiguousarray(img) for img in images]
        out = [np.empty((oh, ow, img.shape[2]), np.uint8) for img, (oh, ow) in zip(images, out_hw.tolist())]
        _augment.warp(src, np.asarray(matrices, np.float32).reshape(-1, 6), fills, interp, fill is not None, out)
        batch.data[field] = out
        return
    out = []
    with batch.on_device() as cp:
        for img, m, (oh, ow) in zip(images, matrices, out_hw.tolist()):
            ih, iw, c = img.shape
            levels = np.zeros(c, np.float32) if fill is None else np.broadcast_to(fill, (c,)).astype(np.float32)
            dst = cp.empty((oh, ow, c), cp.uint8)
            _kernel(cp)(cp.ascontiguousarray(img), cp.asarray(np.asarray(m, np.float32).ravel()),
                        cp.asarray(levels), np.int32(ih), np.int32(iw), np.int32(ow), np.int32(c),
                        np.int32(interp), np.int32(fill is not None), dst)
            out.append(dst)
    batch.data[field] = out


def rotated_size(h: int, w: int, angle: float) -> tuple[int, int]:
    """DALI's output (height, width) of a rotation by ``angle`` degrees with
    ``keep_size=False``: the rotated image's bounding box (less 0.01 before rounding up),
    made one larger where needed so that each side keeps the parity of the input side
    it mostly comes from (less blur at small angles)."""
    a = math.radians(angle)
    c, s = abs(math.cos(a)), abs(math.sin(a))
    ow, oh = math.ceil(c * w + s * h - 1e-2), math.ceil(c * h + s * w - 1e-2)
    pw, ph = (w % 2, h % 2) if s <= c else (h % 2, w % 2)
    return oh + (oh % 2 != ph), ow + (ow % 2 != pw)


def rotation_matrix(angle: float, in_hw: tuple[int, int], out_hw: tuple[int, int]) -> np.ndarray:
    """Destination-to-source 2x3 matrix of a counter-clockwise rotation by ``angle``
    degrees (the top-left corner at (0, 0), y down) about the centres of both images."""
    a = math.radians(angle)
    r = np.array([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]])
    c_in = np.array([in_hw[1], in_hw[0]]) * 0.5
    c_out = np.array([out_hw[1], out_hw[0]]) * 0.5
    return np.concatenate([r, (c_in - r @ c_out)[:, None]], axis=1)


class Rotate(Op):
    """DALI's rotate on uint8 HWC images: counter-clockwise by ``angle`` degrees (the
    top-left corner at (0, 0)), about the image centre. ``keep_size=False`` (DALI's
    default) makes the output the rotated bounding box (``rotated_size``);
    ``keep_size=True`` keeps the input's size. ``fill_value`` fills what lies outside
    the source (None: the border pixels extend). ``interp_type`` is ``"linear"``
    (default) or ``"nearest"``. ``angle`` is a constant or a ``(low, high)`` range drawn
    per sample (torchvision's RandomRotation(degrees=d) is ``angle=(-d, d)``)."""

    salt = 0x524F5441

    def __init__(self, angle: Range, fill_value: float | Sequence[float] | None = None, keep_size: bool = False,
                 interp_type: str = "linear", *, field: str = "image") -> None:
        self.angle = param_range(angle, "angle", -3600, 3600)
        self.fill, self.keep_size = _fill_levels(fill_value), bool(keep_size)
        self.interp, self.field = _check_interp(interp_type), field

    def angles(self, batch: Batch) -> np.ndarray:
        """Per row the angle in degrees, float64 ``[N]``."""
        return draw(batch, self.salt, [self.angle])[:, 0]

    def __call__(self, batch: Batch) -> Batch:
        hw = np.array([img.shape[:2] for img in batch.data[self.field]], np.int64).reshape(-1, 2)
        angles = self.angles(batch)
        out_hw = hw if self.keep_size else np.array([rotated_size(h, w, a) for (h, w), a in
                                                     zip(hw.tolist(), angles.tolist())], np.int64).reshape(-1, 2)
        m = np.stack([rotation_matrix(a, tuple(i), tuple(o)) for a, i, o in
                      zip(angles.tolist(), hw.tolist(), out_hw.tolist())]) if len(hw) else np.zeros((0, 2, 3))
        warp(batch, self.field, m, out_hw, self.fill, self.interp)
        return batch


class WarpAffine(Op):
    """DALI's warp_affine on uint8 HWC images: ``matrix`` (2x3, or its 6 values row by
    row: ``x_src = m00 x + m01 y + m02``, ``y_src = m10 x + m11 y + m12``) maps output to
    source pixels (``inverse_map=True``, DALI's default; False: source to output, inverted
    here). ``size`` is the output (height, width) (default: the input's); ``fill_value``
    and ``interp_type`` as ``rotate``. Without ``matrix`` the transform is drawn per sample
    about the image centre from ``angle`` (degrees, counter-clockwise), ``scale``,
    ``shear`` (degrees, along x) and ``translate_x``/``translate_y`` (pixels), each a
    constant or a ``(low, high)`` range (torchvision's RandomAffine in DALI's terms)."""

    salt = 0x57415246

    def __init__(self, matrix: Sequence[float] | np.ndarray | None = None, size: Sequence[int] | None = None,
                 fill_value: float | Sequence[float] | None = None, interp_type: str = "linear",
                 inverse_map: bool = True, *, angle: Range = 0.0, scale: Range = 1.0, shear: Range = 0.0,
                 translate_x: Range = 0.0, translate_y: Range = 0.0, field: str = "image") -> None:
        self.matrix = None
        if matrix is not None:
            m = np.asarray(matrix, np.float64).reshape(-1)
            if m.size != 6 or not np.all(np.isfinite(m)):
                raise ConfigError(f"matrix is 2x3 (6 finite values, row by row), got {matrix!r}")
            m = m.reshape(2, 3)
            if not inverse_map:
                full = np.vstack([m, [0, 0, 1]])
                if abs(np.linalg.det(full)) < 1e-12:
                    raise ConfigError(f"matrix {matrix!r} cannot be inverted (inverse_map=False needs it)")
                m = np.linalg.inv(full)[:2]
            self.matrix = m
        self.size = None
        if size is not None:
            if len(size) != 2 or any(int(s) < 1 for s in size):
                raise ConfigError(f"size is the output (height, width) in pixels, got {size!r}")
            self.size = (int(size[0]), int(size[1]))
        self.ranges = (param_range(angle, "angle", -3600, 3600), param_range(scale, "scale", 1e-3, 1e3),
                       param_range(shear, "shear", -89, 89), param_range(translate_x, "translate_x"),
                       param_range(translate_y, "translate_y"))
        self.fill, self.interp, self.field = _fill_levels(fill_value), _check_interp(interp_type), field

    def matrices(self, batch: Batch, hw: np.ndarray, out_hw: np.ndarray) -> np.ndarray:
        """Per row the destination-to-source matrix, float64 ``[N, 3x2]``."""
        if self.matrix is not None:
            return np.repeat(self.matrix[None], len(hw), axis=0)
        out = np.zeros((len(hw), 2, 3))
        for row, (angle, scale, shear, tx, ty) in enumerate(draw(batch, self.salt, self.ranges).tolist()):
            a, sh = math.radians(angle), math.radians(shear)
            # forward, about the centre: rotate (counter-clockwise on screen) . shear . scale
            rot = np.array([[math.cos(a), math.sin(a)], [-math.sin(a), math.cos(a)]])
            fwd = rot @ np.array([[1.0, math.tan(sh)], [0.0, 1.0]]) * scale
            inv = np.linalg.inv(fwd)
            c_in = np.array([hw[row, 1], hw[row, 0]]) * 0.5
            c_out = np.array([out_hw[row, 1], out_hw[row, 0]]) * 0.5
            out[row] = np.concatenate([inv, (c_in - inv @ (c_out + [tx, ty]))[:, None]], axis=1)
        return out

    def __call__(self, batch: Batch) -> Batch:
        hw = np.array([img.shape[:2] for img in batch.data[self.field]], np.int64).reshape(-1, 2)
        out_hw = hw if self.size is None else np.tile(np.array(self.size, np.int64), (len(hw), 1))
        warp(batch, self.field, self.matrices(batch, hw, out_hw), out_hw, self.fill, self.interp)
        return batch


def rotate(angle: Range, fill_value: float | Sequence[float] | None = None, keep_size: bool = False,
           interp_type: str = "linear", *, field: str = "image") -> Rotate:
    """See ``Rotate``."""
    return Rotate(angle, fill_value, keep_size, interp_type, field=field)


def warp_affine(matrix: Sequence[float] | np.ndarray | None = None, size: Sequence[int] | None = None,
                fill_value: float | Sequence[float] | None = None, interp_type: str = "linear",
                inverse_map: bool = True, *, angle: Range = 0.0, scale: Range = 1.0, shear: Range = 0.0,
                translate_x: Range = 0.0, translate_y: Range = 0.0, field: str = "image") -> WarpAffine:
    """See ``WarpAffine``."""
    return WarpAffine(matrix, size, fill_value, interp_type, inverse_map, angle=angle, scale=scale, shear=shear,
                      translate_x=translate_x, translate_y=translate_y, field=field)
