"""Automatic augmentation policies as DALI's ``nvidia.dali.auto_aug`` defines them:
``auto_augment`` (AutoAugment, the ImageNet policy), ``trivial_augment_wide``
(TrivialAugment, the wide suite) and ``rand_augment`` (RandAugment(n, m)), on uint8 HWC
RGB images.

A suite is a list of augmentations, each with a magnitude range ``(low, high)`` split into
``num_magnitude_bins`` bins (``linspace(low, high, bins)[bin]``), negated with probability
1/2 where the augmentation says so, then mapped to the op's parameter (DALI's suites, in
DALI's order, with the translations bounded in pixels: DALI's default without ``shape``):

- geometry (``fill_value`` 128, bilinear, through ``ops.warp``): ``translate_x``/``_y``
  (pixels), ``shear_x``/``_y`` (shear factor, about the top-left corner), ``rotate``
  (degrees, counter-clockwise, size kept);
- ``brightness``, ``contrast`` (about the image's mean luma, as Pillow), ``color``
  (saturation in YIQ space, DALI's ``saturation``): factor ``1 + magnitude`` in the
  TrivialAugment and RandAugment suites, the magnitude itself in AutoAugment's policy;
- ``sharpness``: a 3x3 filter ``-m * [[1,1,1],[1,5,1],[1,1,1]] / 13 + (1 + m) * identity``,
  borders mirrored (``dcb|abcd``); ``posterize``: keep the top ``round(magnitude)`` bits
  (1-8); ``solarize``: levels at or above the threshold inverted; ``solarize_add``: levels
  below 128 raised by the magnitude; ``invert``; ``equalize``: OpenCV's
  per-channel histogram equalization; ``auto_contrast``: each channel stretched to 0-255;
  ``identity``.

Per sample, from ``batch.rng(row, salt)``: TrivialAugment draws the augmentation, the bin
(uniform over all bins) and the sign; RandAugment draws, for each of its ``n`` steps, the
augmentation and the sign (the bin is ``m``). The draws depend on (seed, epoch, sample)
only. Each step runs each augmentation once over the rows that drew it: the colour ones as
one matrix call (``ops.augment.apply_color``), the level maps (posterize, solarize,
solarize_add, invert, equalize) as one table call (``ops.augment.apply_levels``), the
geometric ones as one warp call; on the CPU each is one C call per batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError, DataError
from gpuio.ops import _augment
from gpuio.ops.augment import LUMA, apply_color, apply_levels, histograms, reflect101_index, yiq_matrix
from gpuio.ops.warp import rotation_matrix, warp

__all__ = ["Augmentation", "AutoAugment", "TrivialAugmentWide", "RandAugment", "auto_augment",
           "trivial_augment_wide", "rand_augment", "trivial_augment_wide_suite", "rand_augment_suite",
           "image_net_policy"]


@dataclass(frozen=True)
class Augmentation:
    """One augmentation of a suite: its name, magnitude range and whether the magnitude is
    negated with probability 1/2."""

    name: str
    low: float = 0.0
    high: float = 0.0
    randomly_negate: bool = False
    shift: float = 0.0  # added to the signed magnitude: 1 for the enhancements' factors 1 +- m

    def param(self, magnitude_bin: int, bins: int, negative: bool) -> float:
        """The op's parameter at ``magnitude_bin`` of ``bins``: the bin's magnitude, negated
        when ``negative`` and the augmentation allows it, plus ``shift``."""
        value = float(np.linspace(self.low, self.high, bins)[magnitude_bin]) if bins > 1 else float(self.low)
        return (-value if self.randomly_negate and negative else value) + self.shift


def _suite(translate: float, shear: float, angle: float, enhance: tuple[float, float],
           posterize: tuple[float, float]) -> list[Augmentation]:
    return [Augmentation("translate_x", 0, translate, True), Augmentation("translate_y", 0, translate, True),
            Augmentation("shear_x", 0, shear, True), Augmentation("shear_y", 0, shear, True),
            Augmentation("rotate", 0, angle, True), Augmentation("brightness", *enhance, True, 1.0),
            Augmentation("contrast", *enhance, True, 1.0), Augmentation("color", *enhance, True, 1.0),
            Augmentation("sharpness", *enhance, True, 1.0), Augmentation("posterize", *posterize),
            Augmentation("solarize", 256, 0), Augmentation("equalize"), Augmentation("auto_contrast"),
            Augmentation("identity")]


def trivial_augment_wide_suite(max_translate_abs: float = 32) -> list[Augmentation]:
    """DALI's TrivialAugment wide suite (14 augmentations)."""
    return _suite(max_translate_abs, 0.99, 135, (0.01, 0.99), (8, 2))


def rand_augment_suite(max_translate_abs: float = 100) -> list[Augmentation]:
    """DALI's RandAugment suite (monotonic magnitudes, 14 augmentations)."""
    return _suite(max_translate_abs, 0.3, 30, (0.0, 0.9), (8, 4))


def image_net_policy(max_translate_abs: float = 250) -> tuple[list[Augmentation], list[list[tuple[int, float, int]]]]:
    """DALI's AutoAugment ImageNet policy (11 magnitude bins): its augmentations (identity
    last) and 25 sub-policies of (augmentation index, probability, magnitude bin) stages."""
    augs = [Augmentation("equalize"), Augmentation("shear_y", 0, 0.3, True), Augmentation("color", 0.1, 1.9),
            Augmentation("rotate", 0, 30, True), Augmentation("solarize", 0, 256),
            Augmentation("solarize_add", 0, 110), Augmentation("shear_x", 0, 0.3, True), Augmentation("invert"),
            Augmentation("posterize", 0, 4), Augmentation("auto_contrast"),
            Augmentation("translate_y", 0, max_translate_abs, True), Augmentation("identity")]
    eq, shy, col, rot, sol, sola, shx, inv, post, ac, ty = range(11)
    subs = [[(eq, 0.8, 0), (shy, 0.8, 4)], [(col, 0.4, 9), (eq, 0.6, 0)], [(col, 0.4, 1), (rot, 0.6, 8)],
            [(sol, 0.8, 3), (eq, 0.4, 0)], [(sol, 0.4, 2), (sol, 0.6, 2)], [(col, 0.2, 0), (eq, 0.8, 0)],
            [(eq, 0.4, 0), (sola, 0.8, 3)], [(shx, 0.2, 9), (rot, 0.6, 8)], [(col, 0.6, 1), (eq, 1.0, 0)],
            [(inv, 0.4, 0), (rot, 0.6, 0)], [(eq, 1.0, 0), (shy, 0.6, 3)], [(col, 0.4, 7), (eq, 0.6, 0)],
            [(post, 0.4, 6), (ac, 0.4, 0)], [(sol, 0.6, 8), (col, 0.6, 9)], [(sol, 0.2, 4), (rot, 0.8, 9)],
            [(rot, 1.0, 7), (ty, 0.8, 9)], [(sol, 0.8, 4)], [(shy, 0.8, 0), (col, 0.6, 4)],
            [(col, 1.0, 0), (rot, 0.6, 2)], [(eq, 0.8, 0)], [(eq, 1.0, 0), (ac, 0.6, 0)],
            [(shy, 0.4, 7), (sola, 0.6, 7)], [(post, 0.8, 2), (sol, 0.6, 10)], [(sol, 0.6, 8), (eq, 0.6, 0)],
            [(col, 0.8, 6), (rot, 0.4, 5)]]
    return augs, subs


def _select(suite: list[Augmentation], excluded: Sequence[str] | None) -> list[Augmentation]:
    names = [a.name for a in suite]
    unknown = sorted(set(excluded or ()) - set(names))
    if unknown:
        raise ConfigError(f"excluded names {unknown} are not in the suite; its augmentations are {', '.join(names)}")
    chosen = [a for a in suite if a.name not in set(excluded or ())]
    if not chosen:
        raise ConfigError("excluded leaves no augmentation in the suite")
    return chosen


def _sub_batch(batch: Batch, rows: list[int], images: list[Any]) -> Batch:
    return Batch({"image": images}, batch.index[rows], batch.seeds[rows], device=batch.device, stream=batch.stream)


def _geometry(batch: Batch, rows: list[int], images: list[Any], name: str, mags: list[float], fill: np.ndarray,
              interp: int) -> list[Any]:
    """The warp of each image (forward transforms, inverted to destination -> source)."""
    hw = np.array([img.shape[:2] for img in images], np.int64).reshape(-1, 2)
    m = np.zeros((len(images), 2, 3))
    for k, (mag, (h, w)) in enumerate(zip(mags, hw.tolist())):
        if name == "rotate":
            m[k] = rotation_matrix(mag, (h, w), (h, w))
            continue
        fwd = np.eye(3)
        if name == "translate_x":
            fwd[0, 2] = mag
        elif name == "translate_y":
            fwd[1, 2] = mag
        elif name == "shear_x":
            fwd[0, 1] = mag
        else:
            fwd[1, 0] = mag
        m[k] = np.linalg.inv(fwd)[:2]
    sub = _sub_batch(batch, rows, images)
    warp(sub, "image", m, hw, fill, interp)
    return list(sub.data["image"])


def _colour(batch: Batch, rows: list[int], images: list[Any], name: str, mags: list[float]) -> list[Any]:
    """brightness, contrast, color and auto_contrast as one matrix per image."""
    n = len(images)
    factors = np.asarray(mags, np.float64)
    offsets = np.zeros((n, 3))
    if name == "brightness":
        matrices = factors[:, None, None] * np.eye(3)
    elif name == "color":
        matrices = np.stack([yiq_matrix(0.0, f, 1.0) for f in factors])
    elif name == "contrast":  # Pillow's centre: the mean luma of the image
        counts = histograms(batch, images)[:, :3]
        means = (counts * np.arange(256)).sum(axis=2) / counts.sum(axis=2)  # exact sums, as a mean over pixels
        centre = (means * LUMA).sum(axis=1)
        matrices = factors[:, None, None] * np.eye(3)
        offsets[:] = (centre * (1.0 - factors))[:, None]
    else:  # auto_contrast: each channel's range stretched to 0-255
        used = histograms(batch, images)[:, :3] > 0
        lo = np.argmax(used, axis=2).astype(np.float64)
        hi = 255.0 - np.argmax(used[:, :, ::-1], axis=2)
        scale = np.where(hi > lo, 255.0 / np.maximum(hi - lo, 1), 1.0)
        matrices = scale[:, :, None] * np.eye(3)
        offsets = np.where(hi > lo, -lo * scale, 0.0)
    sub = _sub_batch(batch, rows, images)
    apply_color(sub, "image", matrices, offsets)
    return list(sub.data["image"])


def _level_tables(batch: Batch, images: list[Any], name: str, mags: list[float]) -> np.ndarray:
    """posterize, solarize, solarize_add, invert and equalize as a map of the levels per
    channel of each image, uint8 ``[N, 4, 256]``."""
    levels = np.arange(256)
    if name == "equalize":  # OpenCV's equalizeHist per channel
        counts = histograms(batch, images).astype(np.float64)
        total = np.array([img.shape[0] * img.shape[1] for img in images], np.float64)[:, None]
        lead = np.take_along_axis(counts, np.argmax(counts > 0, axis=2)[..., None], axis=2)[..., 0]
        # levels below the first used one map to 0, then the cumulative count times
        # 255 / (pixels - count of the first level), float32 products as OpenCV, rounded
        cdf = (np.cumsum(counts, axis=2) - lead[..., None]).astype(np.float32)
        scale = (255.0 / np.where(lead < total, total - lead, 1.0)).astype(np.float32)
        tables = np.clip(np.rint(cdf * scale[..., None]), 0, 255)
        return np.where((lead < total)[..., None], tables, levels).astype(np.uint8)  # one level: as it is
    tables = np.empty((len(images), 4, 256), np.uint8)
    for k, mag in enumerate(mags):
        if name == "posterize":
            bits = min(max(int(np.round(mag)), 1), 8)
            table = levels & ((0xFF << (8 - bits)) & 0xFF)
        elif name == "solarize":
            table = np.where(levels < mag, levels, 255 - levels)
        elif name == "solarize_add":  # levels below 128 raised by the magnitude, wrapping as uint8
            table = np.where(levels < 128, (levels + int(mag)) & 0xFF, levels)
        else:  # invert
            table = 255 - levels
        tables[k] = table
    return tables


def _sharpness(batch: Batch, images: list[Any], mags: list[float]) -> list[Any]:
    """The 3x3 filter ``m * identity + (1 - m) * smooth`` (``smooth``: 1 1 1 / 1 5 1 / 1 1 1
    over 13), borders mirrored, float32 sums in row-major tap order, rounded half up."""
    smooth = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float32) / 13
    kernels = np.empty((len(images), 3, 3), np.float32)
    for k, mag in enumerate(mags):
        kernels[k] = np.float32(1 - mag) * smooth
        kernels[k, 1, 1] += np.float32(mag)
    if not batch.device.is_cuda:
        src = [np.ascontiguousarray(img) for img in images]
        out = [np.empty_like(img) for img in src]
        _augment.filter3x3(src, kernels, out)
        return out
    out = []
    with batch.on_device() as cp:
        for img, kernel in zip(images, kernels):
            h, w = img.shape[:2]
            rows, cols = cp.asarray(reflect101_index(h, 1)), cp.asarray(reflect101_index(w, 1))
            padded = img.astype(cp.float32)[rows][:, cols]
            acc = cp.zeros(img.shape, cp.float32)
            for dy in range(3):
                for dx in range(3):
                    acc += np.float32(kernel[dy, dx]) * padded[dy:dy + h, dx:dx + w]
            out.append(cp.clip(cp.floor(acc + 0.5), 0, 255).astype(cp.uint8))
    return out


_GEOMETRY = {"translate_x", "translate_y", "shear_x", "shear_y", "rotate"}
_COLOUR = {"brightness", "contrast", "color", "auto_contrast"}
_LEVELS = {"posterize", "solarize", "solarize_add", "invert", "equalize"}


class _Policy(Op):
    """Shared by the policies: arguments, one step over the batch."""

    def __init__(self, suite: list[Augmentation], num_magnitude_bins: int, fill_value: float | None,
                 interp_type: str, field: str) -> None:
        from gpuio.ops.warp import INTERP_TYPES

        if not (isinstance(num_magnitude_bins, int) and num_magnitude_bins >= 1):
            raise ConfigError(f"num_magnitude_bins must be an int >= 1, got {num_magnitude_bins!r}")
        if interp_type not in INTERP_TYPES:
            raise ConfigError(f"interp_type {interp_type!r}; choose one of {', '.join(INTERP_TYPES)}")
        if fill_value is not None and not 0 <= fill_value <= 255:
            raise ConfigError(f"fill_value is a level in [0, 255] (or None: clamp), got {fill_value!r}")
        self.suite, self.bins = suite, num_magnitude_bins
        self.fill = None if fill_value is None else np.array([float(fill_value)])
        self.interp, self.field = INTERP_TYPES.index(interp_type), field

    def step(self, batch: Batch, images: list[Any], ops: np.ndarray, mags: np.ndarray) -> list[Any]:
        """Apply augmentation ``ops[row]`` with magnitude ``mags[row]`` to each image."""
        out = list(images)
        for k in np.unique(ops).tolist():
            rows = np.flatnonzero(ops == k).tolist()
            name = self.suite[k].name
            group, m = [images[r] for r in rows], mags[rows].tolist()
            if name in _GEOMETRY:
                done = _geometry(batch, rows, group, name, m, self.fill, self.interp)
            elif name in _COLOUR:
                done = _colour(batch, rows, group, name, m)
            elif name in _LEVELS:
                done = apply_levels(batch, group, _level_tables(batch, group, name, m))
            elif name == "sharpness":
                done = _sharpness(batch, group, m)
            else:  # identity
                done = group
            for r, img in zip(rows, done):
                out[r] = img
        return out

    def run(self, batch: Batch, plan: list[tuple[np.ndarray, np.ndarray]]) -> Batch:
        images = list(batch.data[self.field])
        for row, img in enumerate(images):
            if img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
                raise DataError(f"{type(self).__name__} takes uint8 HWC RGB images; row {row} is {img.dtype} "
                                f"of shape {tuple(img.shape)}", sample=int(batch.index[row]))
        for ops, mags in plan:
            images = self.step(batch, images, ops, mags)
        batch.data[self.field] = images
        return batch


class TrivialAugmentWide(_Policy):
    """DALI's ``trivial_augment_wide``: each image gets one augmentation of the wide suite
    (``trivial_augment_wide_suite``: translations up to ``max_translate_abs`` = 32 pixels,
    shears up to 0.99, rotations up to 135 degrees, enhancements 1 +- 0.01..0.99,
    posterize 8..2 bits, solarize 256..0, equalize, auto_contrast, identity), chosen
    uniformly, at a magnitude bin uniform over ``num_magnitude_bins`` (31), negated with
    probability 1/2 where the augmentation allows. ``fill_value`` (128; None clamps) and
    ``interp_type`` serve the geometric ones; ``excluded`` names augmentations to leave
    out. See ``gpuio.ops.auto_aug`` for each augmentation's definition."""

    salt = 0x54415744

    def __init__(self, num_magnitude_bins: int = 31, fill_value: float | None = 128, interp_type: str = "linear",
                 max_translate_abs: float = 32, excluded: Sequence[str] | None = None, *,
                 field: str = "image") -> None:
        super().__init__(_select(trivial_augment_wide_suite(max_translate_abs), excluded), num_magnitude_bins,
                         fill_value, interp_type, field)

    def plan(self, batch: Batch) -> list[tuple[np.ndarray, np.ndarray]]:
        """One step: per row the augmentation's index in the suite and its signed magnitude."""
        ops, mags = np.zeros(len(batch), np.int64), np.zeros(len(batch))
        for row in range(len(batch)):
            rng = batch.rng(row, self.salt)
            k, b, sign = int(rng.integers(len(self.suite))), int(rng.integers(self.bins)), bool(rng.integers(2))
            ops[row], mags[row] = k, self.suite[k].param(b, self.bins, sign)
        return [(ops, mags)]

    def __call__(self, batch: Batch) -> Batch:
        return self.run(batch, self.plan(batch))


class RandAugment(_Policy):
    """DALI's ``rand_augment(n, m)``: each image gets ``n`` augmentations in a row, each
    chosen uniformly (with replacement) from the RandAugment suite (``rand_augment_suite``:
    translations up to ``max_translate_abs`` = 100 pixels, shears up to 0.3, rotations up
    to 30 degrees, enhancements 1 +- 0..0.9, posterize 8..4 bits, solarize 256..0,
    equalize, auto_contrast, identity), all at magnitude bin ``m`` of
    ``num_magnitude_bins`` (31), each negated with probability 1/2 where the augmentation
    allows. ``fill_value``, ``interp_type`` and ``excluded`` as ``trivial_augment_wide``."""

    salt = 0x52414E44

    def __init__(self, n: int, m: int, num_magnitude_bins: int = 31, fill_value: float | None = 128,
                 interp_type: str = "linear", max_translate_abs: float = 100, excluded: Sequence[str] | None = None,
                 *, field: str = "image") -> None:
        super().__init__(_select(rand_augment_suite(max_translate_abs), excluded), num_magnitude_bins, fill_value,
                         interp_type, field)
        if not (isinstance(n, int) and n >= 0):
            raise ConfigError(f"n (augmentations per image) must be an int >= 0, got {n!r}")
        if not (isinstance(m, int) and 0 <= m < num_magnitude_bins):
            raise ConfigError(f"m (the magnitude bin) must be an int in [0, {num_magnitude_bins - 1}], got {m!r}")
        self.n, self.m = n, m

    def plan(self, batch: Batch) -> list[tuple[np.ndarray, np.ndarray]]:
        """``n`` steps: per row the augmentation's index and its signed magnitude."""
        ops, mags = np.zeros((self.n, len(batch)), np.int64), np.zeros((self.n, len(batch)))
        for row in range(len(batch)):
            rng = batch.rng(row, self.salt)
            for level in range(self.n):
                k, sign = int(rng.integers(len(self.suite))), bool(rng.integers(2))
                ops[level, row], mags[level, row] = k, self.suite[k].param(self.m, self.bins, sign)
        return list(zip(ops, mags))

    def __call__(self, batch: Batch) -> Batch:
        return self.run(batch, self.plan(batch))


class AutoAugment(_Policy):
    """DALI's ``auto_augment`` with ``policy_name="image_net"`` (the only policy here): each
    image gets one of the 25 sub-policies of AutoAugment's ImageNet policy
    (``image_net_policy``), chosen uniformly; each of its (at most 2) stages runs with its
    probability at its magnitude bin of 11, negated with probability 1/2 where the
    augmentation allows (shears up to 0.3, rotation up to 30 degrees, translate_y up to
    ``max_translate_abs`` = 250 pixels, color factor 0.1..1.9, posterize 0..4 bits kept
    (at least 1), solarize threshold 0..256, solarize_add 0..110, invert, equalize,
    auto_contrast). ``fill_value`` (128; None clamps) and ``interp_type`` serve the
    geometric ones. Per sample, ``batch.rng(row, salt)`` draws the sub-policy, then per
    stage a uniform number (run when below the probability) and the sign."""

    salt = 0x41554155

    def __init__(self, policy_name: str = "image_net", fill_value: float | None = 128, interp_type: str = "linear",
                 max_translate_abs: float = 250, *, field: str = "image") -> None:
        if policy_name != "image_net":
            raise ConfigError(f"policy_name {policy_name!r}; the policy here is 'image_net'")
        augs, self.sub_policies = image_net_policy(max_translate_abs)
        super().__init__(augs, 11, fill_value, interp_type, field)

    def plan(self, batch: Batch) -> list[tuple[np.ndarray, np.ndarray]]:
        """Two steps: per row the augmentation's index (identity where the stage does not
        run) and its parameter."""
        identity = len(self.suite) - 1
        ops, mags = np.full((2, len(batch)), identity, np.int64), np.zeros((2, len(batch)))
        for row in range(len(batch)):
            rng = batch.rng(row, self.salt)
            stages = self.sub_policies[int(rng.integers(len(self.sub_policies)))]
            for level, (k, prob, magnitude_bin) in enumerate(stages):
                run, sign = rng.random() < prob, bool(rng.integers(2))
                if run:
                    ops[level, row], mags[level, row] = k, self.suite[k].param(magnitude_bin, self.bins, sign)
        return list(zip(ops, mags))

    def __call__(self, batch: Batch) -> Batch:
        return self.run(batch, self.plan(batch))


def auto_augment(policy_name: str = "image_net", fill_value: float | None = 128, interp_type: str = "linear",
                 max_translate_abs: float = 250, *, field: str = "image") -> AutoAugment:
    """See ``AutoAugment``."""
    return AutoAugment(policy_name, fill_value, interp_type, max_translate_abs, field=field)


def trivial_augment_wide(num_magnitude_bins: int = 31, fill_value: float | None = 128, interp_type: str = "linear",
                         max_translate_abs: float = 32, excluded: Sequence[str] | None = None, *,
                         field: str = "image") -> TrivialAugmentWide:
    """See ``TrivialAugmentWide``."""
    return TrivialAugmentWide(num_magnitude_bins, fill_value, interp_type, max_translate_abs, excluded, field=field)


def rand_augment(n: int, m: int, num_magnitude_bins: int = 31, fill_value: float | None = 128,
                 interp_type: str = "linear", max_translate_abs: float = 100, excluded: Sequence[str] | None = None,
                 *, field: str = "image") -> RandAugment:
    """See ``RandAugment``."""
    return RandAugment(n, m, num_magnitude_bins, fill_value, interp_type, max_translate_abs, excluded, field=field)
