"""Colour ops: ``color_jitter`` and ``normalize``.

Both take HWC images (uint8 pixels, 0-255) and run the same array code on NumPy and
CuPy; on a GPU batch ``normalize`` of uint8 images is the fused kernel with an
identity crop (one launch per batch), and ``color_jitter`` of host uint8 images is one
C call per batch (``gpuio.ops._augment.jitter``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio.storage.buffers import pooled_empty
from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError
from gpuio.ops import _augment
from gpuio.ops._rng import Streams
from gpuio.ops.augment import host_outputs

__all__ = ["ColorJitter", "Normalize", "color_jitter", "normalize", "cast", "stack_or_list", "DTYPES", "LAYOUTS"]

DTYPES = ("float32", "float16", "uint8")
LAYOUTS = ("CHW", "HWC")
_LUMA = (0.299, 0.587, 0.114)


def cast(xp: Any, v: Any, dtype: str) -> Any:
    """Float values to ``dtype``: uint8 rounds half up and saturates to 0-255."""
    if dtype == "uint8":
        return xp.clip(xp.floor(v + 0.5), 0, 255).astype(xp.uint8)
    return v.astype(dtype, copy=False)


def stack_or_list(xp: Any, rows: list[Any]) -> Any:
    """One array ``[N, ...]`` when every row has the same shape, else the list."""
    if rows and all(r.shape == rows[0].shape for r in rows):
        return xp.stack(rows)
    return rows


class Normalize(Op):
    """``(pixel - mean) / std`` per channel (``mean``/``std`` in the input's units,
    0-255 for uint8 pixels, as DALI's crop_mirror_normalize takes them), laid out
    ``CHW`` or ``HWC`` and cast to ``dtype``. Images of one size come out stacked as one
    array ``[N, C, H, W]`` (or ``[N, H, W, C]``); mixed sizes stay a list."""

    def __init__(self, mean: float | Sequence[float] = 0.0, std: float | Sequence[float] = 1.0,
                 layout: str = "CHW", dtype: str = "float32", *, field: str = "image") -> None:
        if layout not in LAYOUTS:
            raise ConfigError(f"layout {layout!r}; choose {' or '.join(LAYOUTS)}")
        if dtype not in DTYPES:
            raise ConfigError(f"dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self.mean = np.atleast_1d(np.asarray(mean, dtype=np.float32))
        self.std = np.atleast_1d(np.asarray(std, dtype=np.float32))
        if self.mean.ndim != 1 or self.std.ndim != 1 or not np.all(self.std != 0):
            raise ConfigError(f"mean and std are one number per channel and std has no zero; "
                              f"got mean={mean!r} std={std!r}")
        if len(self.mean) > 1 and len(self.std) > 1 and len(self.mean) != len(self.std):
            raise ConfigError(f"mean has {len(self.mean)} values and std {len(self.std)}: give one per channel "
                              f"to both (or one number for every channel)")
        self.layout, self.dtype, self.field = layout, dtype, field

    def channel_params(self, channels: int) -> tuple[np.ndarray, np.ndarray]:
        """(mean, 1/std), float32 ``[channels]``."""
        if len(self.mean) not in (1, channels) or len(self.std) not in (1, channels):
            raise ConfigError(f"mean/std have {len(self.mean)}/{len(self.std)} values for images of "
                              f"{channels} channel(s)")
        return (np.broadcast_to(self.mean, (channels,)).copy(),
                np.broadcast_to(1.0 / self.std, (channels,)).astype(np.float32))

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        if len(images) == 0:
            return batch
        if batch.device.is_cuda and all(img.dtype == np.uint8 and 1 <= img.shape[2] <= 4 for img in images):
            from gpuio.ops._kernels import crop_resize_normalize

            # the fused kernel with the whole image as its box: one launch per channel count
            hw = np.array([img.shape[:2] for img in images], dtype=np.int64).reshape(-1, 2)
            box = np.concatenate([np.zeros_like(hw), hw], axis=1)
            batch.data[self.field] = crop_resize_normalize(
                batch, list(images), box.astype(np.float64), box, hw, np.zeros(len(hw), np.int64),
                interp="linear", antialias=True, params=self.channel_params, layout=self.layout, dtype=self.dtype)
            return batch
        with batch.on_device() as xp:
            batch.data[self.field] = self._normalize_array(xp, images)
        return batch

    def _normalize_array(self, xp: Any, images: list[Any]) -> Any:
        """The array-module path: one array ``[N, ...]`` where the shapes agree, else a list."""
        params: dict[int, tuple[Any, Any]] = {}  # channels -> (mean, 1/std), once per batch
        for img in images:
            c = img.shape[2]
            if c not in params:
                params[c] = tuple(xp.asarray(a) for a in self.channel_params(c))
        same = all(img.shape == images[0].shape for img in images)
        rows = [self._one(xp, img, params[img.shape[2]]) for img in images] if not same else None
        if same:
            h, w, c = images[0].shape
            shape = (c, h, w) if self.layout == "CHW" else (h, w, c)
            out = (xp.empty((len(images), *shape), dtype=self.dtype) if xp is not np
                   else pooled_empty((len(images), *shape), self.dtype))
            for row, img in enumerate(images):
                self._one(xp, img, params[c], out[row])
        return out if same else rows

    def _one(self, xp: Any, img: Any, params: tuple[Any, Any], out: Any = None) -> Any:
        """One HWC image normalized into ``out`` (allocated when None) with
        ``params`` = (mean, 1/std): two passes over float32, in the output layout."""
        mean, inv_std = params
        src = img
        if self.layout == "CHW":
            src, mean, inv_std = img.transpose(2, 0, 1), mean[:, None, None], inv_std[:, None, None]
        direct = self.dtype == "float32"
        if out is None:
            out = xp.empty(src.shape, dtype=self.dtype)
        tmp = out if direct else xp.empty(src.shape, dtype=xp.float32)
        xp.subtract(src, mean, out=tmp, dtype=xp.float32)
        xp.multiply(tmp, inv_std, out=tmp)
        if not direct:
            out[...] = cast(xp, tmp, self.dtype)
        return out


def _gray(xp: Any, v: Any) -> Any:
    return v[..., 0:1] * _LUMA[0] + v[..., 1:2] * _LUMA[1] + v[..., 2:3] * _LUMA[2]


def _shift_hue(xp: Any, v: Any, shift: float) -> Any:
    """Rotate the hue of RGB values ``v`` (0-255 floats) by ``shift`` turns."""
    maxc, minc = v.max(axis=-1), v.min(axis=-1)
    delta = maxc - minc
    safe = xp.where(delta > 0, delta, 1.0)
    r, g, b = v[..., 0], v[..., 1], v[..., 2]
    h = xp.where(maxc == r, (g - b) / safe, xp.where(maxc == g, 2.0 + (b - r) / safe, 4.0 + (r - g) / safe))
    h = xp.where(delta > 0, (h / 6.0 + shift) % 1.0, 0.0)
    s = xp.where(maxc > 0, delta / xp.where(maxc > 0, maxc, 1.0), 0.0)
    h6 = h * 6.0
    i = xp.floor(h6)
    f = h6 - i
    p, q, t = maxc * (1.0 - s), maxc * (1.0 - s * f), maxc * (1.0 - s * (1.0 - f))
    cases = [i == k for k in range(6)]
    pick = [(maxc, t, p), (q, maxc, p), (p, maxc, t), (p, q, maxc), (t, p, maxc), (maxc, p, q)]
    return xp.stack([xp.select(cases, [c[k] for c in pick]) for k in range(3)], axis=-1)


class ColorJitter(Op):
    """torchvision's ColorJitter on uint8 HWC images: brightness, contrast and
    saturation factors uniform in ``[max(0, 1 - x), 1 + x]``, a hue shift uniform in
    ``[-hue, hue]`` turns (``hue <= 0.5``), applied in a random order per image.
    Values stay float between steps (clipped to 0-255) and are rounded once at the end.
    Saturation and hue leave 1-channel images unchanged. Host uint8 images take one C
    call per batch (``_augment.jitter``, the same float32 steps); others, and GPU
    batches, the array code."""

    salt = 0x434A4954

    def __init__(self, brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0,
                 hue: float = 0.0, *, field: str = "image") -> None:
        for name, v in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation)):
            if v < 0:
                raise ConfigError(f"{name} must be >= 0, got {v!r}")
        if not 0 <= hue <= 0.5:
            raise ConfigError(f"hue must be in [0, 0.5] turns, got {hue!r}")
        self.amounts = (float(brightness), float(contrast), float(saturation), float(hue))
        self.field = field

    def params(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """Per row the order of the 4 steps and their factors, int64 and float64 ``[N,
        4]``: ``permutation(4)`` then the four ``uniform`` draws of ``batch.rng(row,
        salt)``, drawn for the batch at once by its streams (``ops._rng``)."""
        streams = Streams(batch.seeds, self.salt)
        order = streams.permutation(4)
        b, c, s, h = self.amounts
        factors = np.stack([streams.uniform(max(0.0, 1 - b), 1 + b), streams.uniform(max(0.0, 1 - c), 1 + c),
                            streams.uniform(max(0.0, 1 - s), 1 + s), streams.uniform(-h, h)], axis=1)
        return order, factors

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        order, factors = (a[: len(images)] for a in self.params(batch))  # row r: image r
        channels = np.array([img.shape[2] if img.ndim == 3 else 1 for img in images], np.int64)
        steps = self._steps(order, channels)
        if not batch.device.is_cuda and all(img.dtype == np.uint8 and img.ndim == 3 for img in images):
            src = [np.ascontiguousarray(img) for img in images]  # one C call: the steps below in float32
            out = host_outputs(src)
            _augment.jitter(src, np.ascontiguousarray(np.concatenate([steps, factors], axis=1), np.float64), out)
            batch.data[self.field] = out
            return batch
        with batch.on_device() as xp:
            batch.data[self.field] = [self._jitter_array(xp, img, row_steps, row_factors)
                                      for img, row_steps, row_factors in zip(images, steps, factors)]
        return batch

    def _steps(self, order: np.ndarray, channels: np.ndarray) -> np.ndarray:
        """The steps in ``order`` (``[N, 4]``) that change images of ``channels`` channels
        (``[N]``), -1 for the others."""
        amounts = np.array(self.amounts) != 0
        changes = amounts[order] & ((order < 2) | (channels[:, None] >= 3))
        return np.where(changes, order, -1)

    def _jitter_array(self, xp: Any, img: Any, steps: np.ndarray, factors: np.ndarray) -> Any:
        """One HWC image through ``steps`` (``_steps``' row) with the array module ``xp``
        (the mean grey summed in double by the C path)."""
        v = img.astype(xp.float32)
        for step in steps.tolist():
            f = float(factors[step])
            if step == 0:
                v = xp.clip(v * f, 0, 255)
            elif step == 1:  # the mean stays on the device: the blend rounds it to float32, as the C path
                m = (_gray(xp, v[..., :3]) if img.shape[2] >= 3 else v).mean(dtype=xp.float64)
                v = xp.clip(v * f + (m * (1 - f)).astype(xp.float32), 0, 255)
            elif step == 2:
                v = xp.clip(v * f + _gray(xp, v[..., :3]) * (1 - f), 0, 255)
            elif step == 3:
                v = xp.concatenate([_shift_hue(xp, v[..., :3], f), v[..., 3:]], axis=-1)
        return cast(xp, v, "uint8")


def normalize(mean: float | Sequence[float] = 0.0, std: float | Sequence[float] = 1.0, layout: str = "CHW",
              dtype: str = "float32", *, field: str = "image") -> Normalize:
    """See ``Normalize``."""
    return Normalize(mean, std, layout, dtype, field=field)


def color_jitter(brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0, hue: float = 0.0,
                 *, field: str = "image") -> ColorJitter:
    """See ``ColorJitter``."""
    return ColorJitter(brightness, contrast, saturation, hue, field=field)
