"""The fused GPU chain and ``Compose``.

``FusedCropResizeNormalize`` replaces a chain ``[crop | resize]* -> [flip] ->
normalize`` (at most one resampling step: a ``resize`` or a ``random_resized_crop``)
by one kernel launch per batch on the GPU: it composes the chain's per-sample
parameters (each op draws its random numbers exactly as when it runs alone) into a
source box, the source pixels the filter may read, the output size and a flip flag,
then reads the decoded pixels once and writes the normalized batch once. On a CPU
batch it runs the ops one by one (the reference path). ``fused_reference`` is the
kernel's math in NumPy, so that the algorithm is tested without a GPU.

``Compose(ops)`` runs ops in order, dropping rejected rows between them, and on a GPU
batch swaps every fusable chain for the fused op.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError
from gpuio.ops.color import Normalize, cast, stack_or_list
from gpuio.ops.geometry import CenterCrop, Flip, RandomResizedCrop, Resize, _Crop, _sizes, resample

__all__ = ["Compose", "FusedCropResizeNormalize", "fused_crop_resize_normalize", "fused_reference"]

_GEOMETRY = (CenterCrop, RandomResizedCrop, Resize)


def _resamples(op: Op) -> bool:
    return isinstance(op, (RandomResizedCrop, Resize))


class FusedCropResizeNormalize(Op):
    """``ops``: geometry ops (``center_crop``, ``random_resized_crop``, ``resize``,
    at most one of the last two), then optionally a ``flip``, then a ``normalize``, all
    on the same field. See the module docstring."""

    def __init__(self, ops: Sequence[Op]) -> None:
        ops = list(ops)
        if not ops or not isinstance(ops[-1], Normalize):
            raise ConfigError("a fused chain ends with normalize")
        self.normalize: Normalize = ops[-1]
        self.flip: Flip | None = ops[-2] if len(ops) > 1 and isinstance(ops[-2], Flip) else None
        self.geometry = ops[:len(ops) - 1 - (self.flip is not None)]
        bad = [type(op).__name__ for op in self.geometry if not isinstance(op, _GEOMETRY)]
        if bad:
            raise ConfigError(f"cannot fuse {bad}: the chain is [center_crop | random_resized_crop | resize]* "
                              f"-> [flip] -> normalize")
        if sum(_resamples(op) for op in self.geometry) > 1:
            raise ConfigError("a fused chain resamples once: at most one resize or random_resized_crop")
        if len({op.field for op in ops}) != 1:
            raise ConfigError(f"the ops of a fused chain work on one field, got {sorted({op.field for op in ops})}")
        self.ops, self.field = ops, self.normalize.field
        sampler = next((op for op in self.geometry if _resamples(op)), None)
        self.interp = sampler.interp if sampler is not None else "linear"
        self.antialias = sampler.antialias if sampler is not None else True

    def plan(self, batch: Batch, hw: np.ndarray) -> dict[str, np.ndarray]:
        """Per-sample parameters for images of sizes ``hw`` ``[N, 2]``: ``box``
        float64 ``[N, 4]`` (y0, x0, h, w; source pixels), ``clip`` int64 ``[N, 4]``
        (y0, x0, y1, x1; the source pixels the filter may read), ``out_hw`` int64
        ``[N, 2]``, ``flip`` int64 ``[N]`` and ``ok`` (rows not rejected)."""
        n = len(hw)
        hw = np.asarray(hw, dtype=np.int64).reshape(n, 2)
        box = np.concatenate([np.zeros((n, 2)), hw], axis=1).astype(np.float64)
        clip = np.concatenate([np.zeros((n, 2), np.int64), hw], axis=1)
        size = hw.copy()
        ok = np.ones(n, dtype=bool)
        resampled = False
        for op in self.geometry:
            if isinstance(op, _Crop):
                crop, good = op.boxes(batch, size)
                ok &= good
                sy, sx = box[:, 2] / np.maximum(size[:, 0], 1), box[:, 3] / np.maximum(size[:, 1], 1)
                box = np.stack([box[:, 0] + crop[:, 0] * sy, box[:, 1] + crop[:, 1] * sx,
                                crop[:, 2] * sy, crop[:, 3] * sx], axis=1)
                if not resampled:  # a crop of source pixels: the filter stays inside it
                    clip = np.stack([crop[:, 0], crop[:, 1], crop[:, 0] + crop[:, 2], crop[:, 1] + crop[:, 3]],
                                    axis=1) + np.concatenate([clip[:, :2], clip[:, :2]], axis=1)
                size = crop[:, 2:4].copy()
            if isinstance(op, RandomResizedCrop):
                size[:] = op.size
            elif isinstance(op, Resize):
                size = np.array([op.out_size(h, w) if h > 0 and w > 0 else (0, 0) for h, w in size.tolist()],
                                dtype=np.int64).reshape(n, 2)
            size[~ok] = 0  # rejected rows: later ops skip them
            resampled = resampled or _resamples(op)
        flip = self.flip.flips(batch) if self.flip is not None else np.zeros(n, dtype=np.int64)
        return {"box": box, "clip": clip, "out_hw": size, "flip": flip, "ok": ok}

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        if not batch.device.is_cuda or len(images) == 0 or any(img.dtype != np.uint8 for img in images):
            for op in self.ops:
                batch = op(batch)
                batch.drop_rejected()
            return batch
        from gpuio.ops._kernels import crop_resize_normalize

        plan = self.plan(batch, _sizes(images))
        keep = plan.pop("ok")
        batch.drop_rejected()
        images = [img for img, k in zip(images, keep.tolist()) if k]
        plan = {k: v[keep] for k, v in plan.items()}
        mean, inv_std = self.normalize.channel_params(images[0].shape[2] if images else 1)
        batch.data[self.field] = crop_resize_normalize(
            batch, images, plan["box"], plan["clip"], plan["out_hw"], plan["flip"], interp=self.interp,
            antialias=self.antialias, mean=mean, inv_std=inv_std, layout=self.normalize.layout,
            dtype=self.normalize.dtype)
        return batch


def fused_reference(images: Sequence[np.ndarray], plan: dict[str, np.ndarray], mean: np.ndarray,
                    inv_std: np.ndarray, *, interp: str = "linear", antialias: bool = True, layout: str = "CHW",
                    dtype: str = "float32") -> Any:
    """The fused kernel's math in NumPy, per sample: resample the box (horizontal pass
    clipped to 0-255), clip to 0-255, flip, ``(v - mean) * inv_std``, layout,
    cast. ``plan`` as ``FusedCropResizeNormalize.plan`` returns it."""
    rows = []
    for img, box, clip, hw, f in zip(images, plan["box"], plan["clip"], plan["out_hw"].tolist(),
                                     plan["flip"].tolist()):
        v = np.clip(resample(img, box, clip, tuple(hw), interp, antialias), 0.0, 255.0)
        if f & 1:
            v = v[:, ::-1]
        if f & 2:
            v = v[::-1]
        v = (v - mean) * inv_std
        rows.append(cast(np, v.transpose(2, 0, 1) if layout == "CHW" else v, dtype))
    return stack_or_list(np, rows)


def _fuse(ops: list[Op]) -> list[Op]:
    """``ops`` with each fusable chain ending in a normalize replaced by the fused op."""
    out: list[Op] = []
    for op in ops:
        out.append(op)
        if not isinstance(op, Normalize):
            continue
        start = len(out) - 1
        if start > 0 and isinstance(out[start - 1], Flip) and out[start - 1].field == op.field:
            start -= 1
        resamples = 0
        while start > 0 and isinstance(out[start - 1], _GEOMETRY) and out[start - 1].field == op.field \
                and resamples + _resamples(out[start - 1]) <= 1:
            resamples += _resamples(out[start - 1])
            start -= 1
        if start < len(out) - 1:
            chain = out[start:]
            del out[start:]
            out.append(FusedCropResizeNormalize(chain))
    return out


class Compose(Op):
    """Run ``ops`` in order, dropping the rows they reject after each. On a GPU batch
    (``fuse=True``) each chain ``[crop | resize]* -> [flip] -> normalize`` runs as one
    fused kernel. ``host_inputs`` lists the fields its ops need in host memory."""

    def __init__(self, ops: Sequence[Op], *, fuse: bool = True) -> None:
        self.ops = list(ops)
        self.fused = _fuse(self.ops) if fuse else self.ops
        self.host_inputs = tuple(dict.fromkeys(f for op in self.ops for f in getattr(op, "host_inputs", ())))

    def __call__(self, batch: Batch) -> Batch:
        for op in self.fused if batch.device.is_cuda else self.ops:
            batch = op(batch)
            batch.drop_rejected()
        return batch


def fused_crop_resize_normalize(ops: Sequence[Op]) -> FusedCropResizeNormalize:
    """See ``FusedCropResizeNormalize``."""
    return FusedCropResizeNormalize(ops)
