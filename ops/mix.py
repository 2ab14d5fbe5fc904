"""Batch mixing: ``mixup`` and ``cutmix`` of images and labels, as torchvision v2's
MixUp and CutMix define them, with one mixing weight per sample.

Each row ``r`` is mixed with the row before it in the batch (row 0 with the last row,
torchvision's ``roll(1)``), taken from the batch as it came in. Its weight ``lam`` is
drawn from ``Beta(alpha, alpha)`` with ``batch.rng(row, salt)``, so a sample's draws
depend on (seed, epoch, sample) only and a resumed epoch mixes the same way. Images are
HWC of one shape (a list or one array ``[N, H, W, C]``); the result is one array of the
input dtype (uint8 rounded half up). Labels (``label_field``) are class indices ``[N]``
(made one-hot with ``num_classes``) or soft labels ``[N, K]``; they come out float32
``[N, K]``. Host uint8 images are mixed by one C call per batch (``_augment.mix`` and
``paste``: the array code's float32 sums, one output array, no float copy of the batch);
other images and GPU batches run the same array code on NumPy and CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError, DataError
from gpuio.ops import _augment
from gpuio.ops._rng import Streams

__all__ = ["MixUp", "CutMix", "mixup", "cutmix"]


class _Mix(Op):
    """Shared by MixUp and CutMix: arguments, the weights and the labels."""

    def __init__(self, alpha: float, num_classes: int | None, field: str, label_field: str) -> None:
        if not (isinstance(alpha, (int, float)) and alpha > 0):
            raise ConfigError(f"alpha is the Beta distribution's parameter, a number > 0, got {alpha!r}")
        if num_classes is not None and not (isinstance(num_classes, (int, np.integer)) and num_classes >= 1):
            raise ConfigError(f"num_classes must be an int >= 1 (or None for soft labels [N, K]), "
                              f"got {num_classes!r}")
        self.alpha, self.num_classes = float(alpha), num_classes
        self.field, self.label_field = field, label_field

    def weights(self, batch: Batch) -> np.ndarray:
        """Per row ``lam ~ Beta(alpha, alpha)``, float64 ``[N]``."""
        return self._draws(batch, 0, 0)[:, 0]

    def _draws(self, batch: Batch, h: int, w: int) -> np.ndarray:
        """Per row ``lam``, then with an ``h`` x ``w`` image a pixel's x and y (0 else),
        float64 ``[N, 3]``, drawn in that order by ``batch.rng(row, salt)``: for ``alpha
        <= 1`` by the batch's streams (``ops._rng``, the same numbers), else by the
        generators (NumPy's beta for ``alpha > 1`` is not written out)."""
        out = np.zeros((len(batch), 3))
        if self.alpha <= 1.0:
            streams = Streams(batch.seeds, self.salt)
            out[:, 0] = streams.beta(self.alpha)
            if h and w:
                out[:, 1] = streams.integers(np.full(len(batch), w))
                out[:, 2] = streams.integers(np.full(len(batch), h))
            return out
        for row in range(len(batch)):
            rng = batch.rng(row, self.salt)
            out[row, 0] = rng.beta(self.alpha, self.alpha)
            if h and w:
                out[row, 1:] = rng.integers(0, w), rng.integers(0, h)
        return out

    def _stacked(self, xp: Any, batch: Batch) -> Any:
        images = batch.data[self.field]
        if isinstance(images, list):
            shapes = {tuple(img.shape) for img in images}
            if len(shapes) > 1:
                raise DataError(f"{type(self).__name__.lower()} mixes images of one shape; this batch has "
                                f"{sorted(shapes)} (resize or crop first)", sample=int(batch.index[0]))
            images = xp.stack(images)
        return images

    def _labels(self, xp: Any, batch: Batch, lam: np.ndarray) -> Any:
        given = batch.data[self.label_field]
        on_device = hasattr(given, "__cuda_array_interface__")
        host = None if on_device else np.asarray(given)
        labels = given if on_device else xp.asarray(host)
        if labels.ndim == 1:
            if self.num_classes is None:
                raise ConfigError(f"{self.label_field!r} holds class indices: give num_classes= to make them one-hot")
            if on_device:  # class indices someone put on the GPU: read back once to check them
                host = labels.get()
            bad = np.flatnonzero((host < 0) | (host >= self.num_classes))  # the host's copy: no read back
            if len(bad):
                raise DataError(f"label {host[bad[0]]} is not in [0, {self.num_classes})",
                                sample=int(batch.index[bad[0]]))
            labels = xp.eye(self.num_classes, dtype=xp.float32)[labels.astype(xp.int64)]
        elif labels.ndim != 2:
            raise ConfigError(f"{self.label_field!r} must be class indices [N] or soft labels [N, K], "
                              f"got shape {tuple(labels.shape)}")
        labels = labels.astype(xp.float32)
        w = xp.asarray(lam.astype(np.float32))[:, None]
        return w * labels + (1 - w) * xp.roll(labels, 1, axis=0)

    def __call__(self, batch: Batch) -> Batch:
        if len(batch) == 0:
            return batch
        with batch.on_device() as xp:
            self._mix(xp, batch)
        return batch

    def _mix(self, xp: Any, batch: Batch) -> None:  # pragma: no cover - interface
        raise NotImplementedError


def _host_uint8(xp: Any, images: Any) -> list[np.ndarray] | None:
    """Host uint8 HWC images of one shape as C-contiguous arrays for ``_augment``, else
    None (the array code takes them, and names a batch of mixed shapes)."""
    if xp is not np or len(images) == 0:
        return None
    rows = [np.ascontiguousarray(img) for img in images]
    if rows[0].dtype != np.uint8 or rows[0].ndim != 3 or any(r.shape != rows[0].shape or r.dtype != np.uint8
                                                             for r in rows):
        return None
    return rows


def _like(xp: Any, v: Any, dtype: Any) -> Any:
    """Float values ``v`` as ``dtype``: uint8 rounded half up and saturated."""
    if np.dtype(dtype) == np.uint8:
        return xp.clip(xp.floor(v + 0.5), 0, 255).astype(xp.uint8)
    return v.astype(dtype)


class MixUp(_Mix):
    """torchvision's MixUp with a weight per sample: ``image = lam * image + (1 - lam) *
    previous image`` and the same for the labels, ``lam ~ Beta(alpha, alpha)`` (``alpha``
    default 1.0, as torchvision). See the module ``gpuio.ops.mix`` for the rows, labels
    and draws."""

    salt = 0x4D495855

    def __init__(self, alpha: float = 1.0, num_classes: int | None = None, *, field: str = "image",
                 label_field: str = "label") -> None:
        super().__init__(alpha, num_classes, field, label_field)

    def _mix(self, xp: Any, batch: Batch) -> None:
        lam = self.weights(batch)
        src = _host_uint8(xp, batch.data[self.field])
        if src is not None:  # one C call: the same float32 sums
            w = lam.astype(np.float32)
            out = np.empty((len(src), *src[0].shape), np.uint8)
            _augment.mix(src, np.ascontiguousarray(np.stack([w, 1 - w], axis=1)), list(out))
            batch.data[self.label_field] = self._labels(xp, batch, lam)
            batch.data[self.field] = out
            return
        images = self._stacked(xp, batch)
        w = xp.asarray(lam.astype(np.float32)).reshape((-1,) + (1,) * (images.ndim - 1))
        mixed = w * images.astype(xp.float32) + (1 - w) * xp.roll(images, 1, axis=0).astype(xp.float32)
        batch.data[self.label_field] = self._labels(xp, batch, lam)
        batch.data[self.field] = _like(xp, mixed, images.dtype)


class CutMix(_Mix):
    """torchvision's CutMix with a weight per sample: a box of the previous image is
    pasted into each image, centred at a uniform random pixel ``(cy, cx)`` with half
    sizes ``int(H * sqrt(1 - lam) / 2)`` and ``int(W * sqrt(1 - lam) / 2)``, clipped to
    the image, ``lam ~ Beta(alpha, alpha)`` (``alpha`` default 1.0); the labels mix with
    ``1 - box area / image area`` (the area actually pasted). See the module
    ``gpuio.ops.mix`` for the rows, labels and draws."""

    salt = 0x4355544D

    def __init__(self, alpha: float = 1.0, num_classes: int | None = None, *, field: str = "image",
                 label_field: str = "label") -> None:
        super().__init__(alpha, num_classes, field, label_field)

    def boxes(self, batch: Batch, lam: np.ndarray, h: int, w: int) -> np.ndarray:
        """Per row the pasted box (y0, x0, y1, x1), int64 ``[N, 4]``: after ``lam``, the
        row's generator draws the centre's x then y."""
        return self._box(self._draws(batch, h, w), np.asarray(lam, np.float64), h, w)

    @staticmethod
    def _box(draws: np.ndarray, lam: np.ndarray, h: int, w: int) -> np.ndarray:
        cx, cy = draws[:, 1].astype(np.int64), draws[:, 2].astype(np.int64)
        r = 0.5 * np.sqrt(1.0 - lam)
        rh, rw = (r * h).astype(np.int64), (r * w).astype(np.int64)
        return np.stack([np.maximum(cy - rh, 0), np.maximum(cx - rw, 0), np.minimum(cy + rh, h),
                         np.minimum(cx + rw, w)], axis=1)

    def _mix(self, xp: Any, batch: Batch) -> None:
        src = _host_uint8(xp, batch.data[self.field])
        images = src if src is not None else self._stacked(xp, batch)
        h, w = images[0].shape[:2]
        draws = self._draws(batch, h, w)
        box = self._box(draws, draws[:, 0], h, w)
        area = (box[:, 2] - box[:, 0]) * (box[:, 3] - box[:, 1])
        kept = 1.0 - area / float(h * w)
        if src is not None:  # one C call: rows copied, the boxes pasted from the row before
            out = np.empty((len(src), h, w, src[0].shape[2]), np.uint8)
            _augment.paste(src, box, list(out))
            batch.data[self.label_field] = self._labels(xp, batch, kept)
            batch.data[self.field] = out
            return
        b = xp.asarray(box)
        ys, xs = xp.arange(h)[None, :, None], xp.arange(w)[None, None, :]
        inside = ((ys >= b[:, 0, None, None]) & (ys < b[:, 2, None, None])
                  & (xs >= b[:, 1, None, None]) & (xs < b[:, 3, None, None]))
        batch.data[self.label_field] = self._labels(xp, batch, kept)
        batch.data[self.field] = xp.where(inside[..., None], xp.roll(images, 1, axis=0), images)


def mixup(alpha: float = 1.0, num_classes: int | None = None, *, field: str = "image",
          label_field: str = "label") -> MixUp:
    """See ``MixUp``."""
    return MixUp(alpha, num_classes, field=field, label_field=label_field)


def cutmix(alpha: float = 1.0, num_classes: int | None = None, *, field: str = "image",
           label_field: str = "label") -> CutMix:
    """See ``CutMix``."""
    return CutMix(alpha, num_classes, field=field, label_field=label_field)
