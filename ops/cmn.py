"""``crop_mirror_normalize``: DALI's one-op crop, random mirror, normalize and layout.

It is ``Compose([center_crop, flip, normalize])``, run as one fused op: on a GPU batch
one kernel launch, on a CPU batch one C call (``gpuio.ops._resample``; the ops one after the
other where it is not built or ``dtype`` is float16), each op drawing its random
numbers per sample as it does alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuio.ops.color import Normalize
from gpuio.ops.fused import Compose
from gpuio.ops.geometry import CenterCrop, Flip

__all__ = ["crop_mirror_normalize"]


def crop_mirror_normalize(crop: int | Sequence[int] | None = None, mean: float | Sequence[float] = 0.0,
                          std: float | Sequence[float] = 1.0, *, mirror: float = 0.0, layout: str = "CHW",
                          dtype: str = "float32", field: str = "image") -> Compose:
    """Center-crop ``crop`` (h, w pixels, or one int for a square; None: no crop), mirror
    left-right with probability ``mirror`` (DALI's ``mirror=fn.random.coin_flip()`` is
    ``mirror=0.5``), then ``(pixel - mean) / std`` per channel (0-255 units for uint8
    images), laid out ``"CHW"`` or ``"HWC"`` and cast to ``dtype``. Takes HWC images;
    a batch of one size comes out as one ``[N, C, H, W]`` (or ``[N, H, W, C]``) array.
    An image smaller than ``crop`` is a bad sample (resize first)."""
    ops = [CenterCrop(crop, field=field)] if crop is not None else []
    if mirror:
        ops.append(Flip(True, mirror, field=field))
    ops.append(Normalize(mean, std, layout, dtype, field=field))
    return Compose(ops)
