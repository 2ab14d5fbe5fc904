"""Object detection ops (the SSD pipeline), with DALI's names and semantics.

Boxes are float32 ``[n, 4]`` per row in coordinates relative to the image (0-1; index
COCO with ``normalized=True``), ``ltrb`` (DALI's ``"xyXY"``: left, top, right, bottom)
or ``xywh`` (``"xyWH"``: left, top, width, height); labels int32 ``[n]``.

- ``random_bbox_crop``: DALI's prospective crop. It picks a window whose overlap with
  the boxes passes a randomly chosen threshold, keeps the boxes whose centre lies in it
  (with their labels), clips and remaps them to the window, writes the window as
  ``crop_anchor`` (x, y) and ``crop_shape`` (w, h), relative, and crops the decoded
  image if there is one; else ``decode_image_slice()`` decodes only the window (DALI's
  ``decoders.image_slice``).
- ``bb_flip``: mirrors boxes on the rows where ``flip`` with the same ``horizontal``
  and ``p`` mirrors the image (the same draw from ``(seed, epoch, sample)``).
- ``paste`` / ``bbox_paste``: zoom out, the image on a canvas ``ratio`` times larger
  and the boxes moved with it; both draw ``ratio``, ``paste_x``, ``paste_y`` alike.
- ``box_encoder``: matches boxes to anchors and encodes them (SSD), a batch in one
  vectorized NumPy or CuPy pass over ``[boxes of all rows, anchors]``.

Masks and polygons follow these ops: the fields ``polygons`` (int32 ``[p, 3]``:
annotation, first vertex, end vertex) and ``vertices`` (float32 ``[v, 2]``, relative
x, y) as ``formats.coco(masks="polygons", normalized=True)`` gives them, and pixel
masks ``masks`` (uint8 ``[n, H, W]``, from ``formats.coco.decode_masks``) when a row
has them. Crops drop the polygons and masks of the boxes they drop and renumber the
rest; vertices are moved like box corners but not clipped (as DALI's coordinate
transforms leave them). ``resize`` does not touch them (relative coordinates do not
change; pixel masks keep their size).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.device import require
from gpuio.errors import ConfigError, DataError
from gpuio.ops.decode_slice import crop_window
from gpuio.ops.color import Normalize
from gpuio.ops.fused import FusedCropResizeNormalize
from gpuio.ops.geometry import Flip, Resize, size_pair
from gpuio.ops.ragged import segment_max, to_host

__all__ = ["RandomBBoxCrop", "BBFlip", "Paste", "BBoxPaste", "BoxEncoder", "random_bbox_crop", "bb_flip",
           "paste", "bbox_paste", "box_encoder", "encode_boxes"]

_LAYOUTS = {"xyXY": True, "xyWH": False}  # layout -> ltrb
_MAX_WINDOWS = 10_000  # random_bbox_crop's total_num_attempts=-1


def _module(a: Any) -> Any:
    """NumPy or CuPy, whichever ``a`` lives in."""
    return np if isinstance(a, np.ndarray) else require("cupy")


def _boxes(row: Any) -> np.ndarray:
    return np.asarray(to_host(row), np.float32).reshape(-1, 4)


def _to_ltrb(b: np.ndarray, ltrb: bool) -> np.ndarray:
    return b if ltrb else np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], axis=1)


def _from_ltrb(b: np.ndarray, ltrb: bool) -> np.ndarray:
    return b if ltrb else np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], axis=1)


def _pair(value: Sequence[float], name: str, low: float = 0.0) -> tuple[float, float]:
    pair = tuple(float(v) for v in value)
    if len(pair) != 2 or not low <= pair[0] <= pair[1]:
        raise ConfigError(f"{name} is a range [min, max] with {low} <= min <= max, got {value!r}")
    return pair


def _overlap(crops: np.ndarray, boxes: np.ndarray, iou: bool) -> np.ndarray:
    """IoU (or the fraction of each box inside the crop) of crops ``[k, 4]`` and boxes
    ``[m, 4]`` (ltrb): float32 ``[k, m]``."""
    c, b = crops[:, None, :], boxes[None, :, :]
    iw = np.maximum(np.minimum(c[..., 2], b[..., 2]) - np.maximum(c[..., 0], b[..., 0]), 0)
    ih = np.maximum(np.minimum(c[..., 3], b[..., 3]) - np.maximum(c[..., 1], b[..., 1]), 0)
    inter = iw * ih
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    if not iou:
        return inter / np.maximum(area_b, np.float32(1e-12))
    union = (c[..., 2] - c[..., 0]) * (c[..., 3] - c[..., 1]) + area_b - inter
    return inter / np.maximum(union, np.float32(1e-12))


def _select_masks(batch: Batch, row: int, keep: np.ndarray, boxes: int, polygons: str, vertices: str, masks: str,
                  move: Any) -> None:
    """Keep the polygons and pixel masks of the boxes ``keep`` (old box numbers, in
    order, of ``boxes``), renumbered, and move the vertices with ``move(xy) -> xy``."""
    data = batch.data
    if masks in data and data[masks][row] is not None and len(data[masks][row]) != boxes:
        raise DataError(f"{len(data[masks][row])} pixel masks for {boxes} boxes", sample=int(batch.index[row]))
    if polygons in data and vertices in data:
        poly = np.asarray(to_host(data[polygons][row]), np.int64).reshape(-1, 3)
        xy = np.asarray(to_host(data[vertices][row]), np.float32).reshape(-1, 2)
        renumber = np.full(max(int(poly[:, 0].max(initial=-1)), int(keep.max(initial=-1))) + 1, -1, np.int64)
        renumber[keep] = np.arange(len(keep))
        kept = poly[renumber[poly[:, 0]] >= 0]
        counts = kept[:, 2] - kept[:, 1]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        take = np.concatenate([np.arange(s, e) for s, e in kept[:, 1:].tolist()] + [np.zeros(0, np.int64)])
        data[polygons][row] = np.stack([renumber[kept[:, 0]], starts[:-1], starts[1:]], axis=1).astype(np.int32)
        data[vertices][row] = move(xy[take]).astype(np.float32)
    if masks in data and data[masks][row] is not None:
        data[masks][row] = data[masks][row][keep]


class RandomBBoxCrop(Op):
    """DALI's ``random_bbox_crop`` (2-D, relative coordinates). Per row: choose one of
    ``thresholds`` (plus "no crop" when ``allow_no_crop``), then draw up to
    ``num_attempts`` windows, each side ``scaling`` times the image's (``aspect_ratio``
    w/h in range; a fixed ratio when min == max), placed uniformly; a window passes when
    the minimum (``all_boxes_above_threshold``, else maximum) overlap with the boxes
    (``threshold_type`` ``"iou"`` or ``"overlap"``: the fraction of a box inside) is at
    least the threshold and at least one box keeps its centre (``lo <= c < hi``)
    inside; the first window that passes is taken. Otherwise another threshold is drawn,
    until ``total_num_attempts`` windows were tried (-1: 10,000, where DALI searches
    forever), and then the best window so far is taken. With ``bbox_prune_threshold``, boxes are kept by the
    fraction of their area inside the window instead of by their centre. Kept boxes are
    clipped to the window and remapped to it; the rest go with their labels, polygons
    and masks. A row without boxes is not cropped.

    Writes ``anchor_out`` (x, y) and ``shape_out`` (w, h), float32 ``[2]`` relative,
    DALI's ``anchor`` and ``shape`` outputs; crops ``image`` when it is already decoded
    (HWC, the window rounded to pixels by ``crop_window``), else ``decode_image_slice``
    decodes only the window."""

    salt = 0x52424358

    def __init__(self, aspect_ratio: Sequence[float] = (1.0, 1.0), thresholds: Sequence[float] = (0.0,),
                 scaling: Sequence[float] = (1.0, 1.0), bbox_layout: str = "xyXY", allow_no_crop: bool = True,
                 num_attempts: int = 1, total_num_attempts: int = -1, threshold_type: str = "iou",
                 all_boxes_above_threshold: bool = True, bbox_prune_threshold: float | None = None, *,
                 field: str = "boxes", labels: str = "labels", image: str = "image", polygons: str = "polygons",
                 vertices: str = "vertices", masks: str = "masks", anchor_out: str = "crop_anchor",
                 shape_out: str = "crop_shape") -> None:
        self.aspect_ratio = _pair(aspect_ratio, "aspect_ratio")
        self.scaling = _pair(scaling, "scaling")
        if self.aspect_ratio[0] <= 0:
            raise ConfigError(f"aspect_ratio must be positive, got {aspect_ratio!r}")
        self.thresholds = [float(t) for t in thresholds]
        if not self.thresholds or any(not 0.0 <= t <= 1.0 for t in self.thresholds):
            raise ConfigError(f"thresholds are one or more numbers in [0, 1], got {thresholds!r}")
        if bbox_layout not in _LAYOUTS:
            raise ConfigError(f"bbox_layout {bbox_layout!r}; choose one of {', '.join(_LAYOUTS)}")
        if threshold_type not in ("iou", "overlap"):
            raise ConfigError(f"threshold_type {threshold_type!r}; choose 'iou' or 'overlap'")
        if int(num_attempts) < 1 or int(total_num_attempts) == 0 or int(total_num_attempts) < -1:
            raise ConfigError(f"num_attempts must be >= 1 and total_num_attempts >= 1 or -1, got "
                              f"{num_attempts!r} and {total_num_attempts!r}")
        if bbox_prune_threshold is not None and not 0.0 <= bbox_prune_threshold <= 1.0:
            raise ConfigError(f"bbox_prune_threshold is in [0, 1], got {bbox_prune_threshold!r}")
        self.ltrb, self.allow_no_crop = _LAYOUTS[bbox_layout], bool(allow_no_crop)
        # DALI searches forever when no window can pass; a loader must not hang
        self.num_attempts = int(num_attempts)
        self.total_num_attempts = int(total_num_attempts) if total_num_attempts > 0 else _MAX_WINDOWS
        self.iou, self.all_boxes = threshold_type == "iou", bool(all_boxes_above_threshold)
        self.prune = bbox_prune_threshold
        self.field, self.anchor_out, self.shape_out = field, anchor_out, shape_out
        self.fields = dict(labels=labels, image=image, polygons=polygons, vertices=vertices, masks=masks)

    def _kept_all(self, crops: np.ndarray, boxes: np.ndarray) -> np.ndarray:
        """Which boxes ``[m, 4]`` each window of ``crops`` ``[k, 4]`` (ltrb) keeps: bool ``[k, m]``."""
        if self.prune is not None:
            return _overlap(crops, boxes, iou=False) >= self.prune
        cx, cy = (boxes[:, 0] + boxes[:, 2]) * 0.5, (boxes[:, 1] + boxes[:, 3]) * 0.5
        c = crops[:, :, None]
        return (cx >= c[:, 0]) & (cx < c[:, 2]) & (cy >= c[:, 1]) & (cy < c[:, 3])

    def _shapes(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` window sizes (w, h), float32, as DALI draws them."""
        shape = rng.uniform(self.scaling[0], self.scaling[1], size=(n, 2)).astype(np.float32)
        lo, hi = self.aspect_ratio
        if lo == hi:  # fixed ratio: one side follows the other (picked at random), then the larger keeps its size
            largest = shape.max(axis=1)
            w_first = rng.random(n) < 0.5
            shape = np.where(w_first[:, None], np.stack([shape[:, 0], shape[:, 0] / np.float32(lo)], 1),
                             np.stack([shape[:, 1] * np.float32(lo), shape[:, 1]], 1)).astype(np.float32)
            shape *= (largest / shape.max(axis=1))[:, None]
        return shape

    def window(self, batch: Batch, row: int, boxes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The window (ltrb, float32 ``[4]``) for ``row`` with boxes ``[m, 4]`` (ltrb)
        and the numbers of the boxes it keeps."""
        whole = np.array([0, 0, 1, 1], np.float32)
        if len(boxes) == 0:
            return whole, np.zeros(0, np.int64)
        rng = batch.rng(row, self.salt)
        options = len(self.thresholds) + self.allow_no_crop
        best, best_metric, tried = None, -1.0, 0
        while tried < self.total_num_attempts:
            choice = int(rng.integers(options))
            if choice == len(self.thresholds):
                return whole, np.arange(len(boxes))
            n = min(self.num_attempts, self.total_num_attempts - tried)
            tried += n
            shape = self._shapes(rng, n)
            anchor = (rng.random((n, 2)) * (1.0 - shape)).astype(np.float32)
            ratio = shape[:, 0] / shape[:, 1]
            fits = (ratio >= self.aspect_ratio[0]) & (ratio <= self.aspect_ratio[1])
            crops = np.concatenate([anchor, anchor + shape], axis=1)
            overlap = _overlap(crops, boxes, self.iou)
            metric = np.where(fits, overlap.min(axis=1) if self.all_boxes else overlap.max(axis=1), -1.0)
            kept = self._kept_all(crops, boxes)  # [n, m]
            passed = fits & (metric >= self.thresholds[choice]) & kept.any(axis=1)
            if passed.any():
                k = int(np.argmax(passed))
                return crops[k], np.flatnonzero(kept[k])
            k = int(np.argmax(metric))  # the first of the best windows so far
            if fits[k] and metric[k] > best_metric:
                best, best_metric = (crops[k], np.flatnonzero(kept[k])), float(metric[k])
        return best if best is not None else (whole, np.arange(len(boxes)))

    def __call__(self, batch: Batch) -> Batch:
        anchors, shapes = [], []
        for row in range(len(batch)):
            try:
                anchor, shape = self._crop_row(batch, row)
            except DataError as exc:
                batch.reject(row, exc)
                anchor, shape = np.zeros(2, np.float32), np.ones(2, np.float32)
            anchors.append(anchor)
            shapes.append(shape)
        batch.data[self.anchor_out], batch.data[self.shape_out] = anchors, shapes
        return batch

    def _crop_row(self, batch: Batch, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Crop one row's boxes and what follows them; returns its anchor and shape."""
        f, data = self.fields, batch.data
        boxes = _to_ltrb(_boxes(data[self.field][row]), self.ltrb)
        crop, keep = self.window(batch, row, boxes)
        size = crop[2:] - crop[:2]
        _select_masks(batch, row, keep, len(boxes), f["polygons"], f["vertices"], f["masks"],
                      lambda xy: (xy - crop[:2]) / size)
        moved = (np.clip(boxes[keep], np.tile(crop[:2], 2), np.tile(crop[2:], 2)) - np.tile(crop[:2], 2)) \
            / np.tile(size, 2)
        data[self.field][row] = _from_ltrb(np.clip(moved, 0, 1).astype(np.float32), self.ltrb)
        if f["labels"] in data:
            data[f["labels"]][row] = data[f["labels"]][row][keep]
        for name in (f["masks"], f["image"]):
            pixels = data[name][row] if name in data else None
            if pixels is None:
                continue
            hw = pixels.shape[1:3] if name == f["masks"] else pixels.shape[:2]
            y0, x0, y1, x1 = crop_window(crop[:2], size, *hw)
            data[name][row] = pixels[:, y0:y1, x0:x1] if name == f["masks"] else pixels[y0:y1, x0:x1]
        return crop[:2].copy(), size.astype(np.float32)


class BBFlip(Op):
    """DALI's ``bb_flip``: ``x -> 1 - x`` for boxes (ltrb: ``l' = 1 - r``, ``r' = 1 -
    l``; xywh: ``x' = 1 - x - w``), vertices and pixel masks, on the rows where
    ``flip(horizontal=True, p=p)`` mirrors the image (and likewise upside down for
    ``vertical``), so that boxes and pixels follow one draw."""

    def __init__(self, ltrb: bool = False, horizontal: bool = True, vertical: bool = False, p: float = 0.5, *,
                 field: str = "boxes", vertices: str = "vertices", masks: str = "masks") -> None:
        self.ltrb, self.field, self.vertices, self.masks = bool(ltrb), field, vertices, masks
        self.flips = [(axis, Flip(axis == 0, p)) for axis, on in ((0, horizontal), (1, vertical)) if on]

    def __call__(self, batch: Batch) -> Batch:
        data = batch.data
        for axis, flip in self.flips:
            for row in np.flatnonzero(flip.flips(batch)).tolist():
                b = data[self.field][row]
                xp = _module(b)
                b = xp.asarray(b, dtype=xp.float32).reshape(-1, 4).copy()
                if self.ltrb:
                    b[:, [axis, axis + 2]] = 1.0 - b[:, [axis + 2, axis]]
                else:
                    b[:, axis] = 1.0 - b[:, axis] - b[:, axis + 2]
                data[self.field][row] = b
                if self.vertices in data:
                    v = data[self.vertices][row].copy()
                    v[:, axis] = 1.0 - v[:, axis]
                    data[self.vertices][row] = v
                if self.masks in data and data[self.masks][row] is not None:
                    m = data[self.masks][row]
                    data[self.masks][row] = m[:, :, ::-1] if axis == 0 else m[:, ::-1]
        return batch


def _draw(value: float | Sequence[float], rng: np.random.Generator) -> float:
    """A number, or one drawn uniformly from a range (lo, hi); always one draw, so that
    the draws after it stay in place."""
    u = rng.random()
    if isinstance(value, (int, float, np.number)):
        return float(value)
    return float(value[0] + (value[1] - value[0]) * u)


def _range(value: float | Sequence[float], name: str, low: float, high: float) -> float | tuple[float, float]:
    if isinstance(value, (int, float, np.number)):
        if not low <= float(value) <= high:
            raise ConfigError(f"{name} must be in [{low}, {high}], got {value!r}")
        return float(value)
    lo, hi = _pair(value, name, low)
    if hi > high:
        raise ConfigError(f"{name} must be in [{low}, {high}], got {value!r}")
    return lo, hi


class _PasteDraws:
    """``ratio``, ``paste_x`` and ``paste_y`` per row: numbers, or ranges drawn from
    per row; ``paste`` and ``bbox_paste`` with equal arguments draw equal values."""

    salt = 0x50415354

    def __init__(self, ratio: float | Sequence[float], paste_x: float | Sequence[float],
                 paste_y: float | Sequence[float]) -> None:
        self.ratio = _range(ratio, "ratio", 1.0, float("inf"))
        self.paste_x = _range(paste_x, "paste_x", 0.0, 1.0)
        self.paste_y = _range(paste_y, "paste_y", 0.0, 1.0)

    def params(self, batch: Batch, row: int) -> tuple[float, float, float]:
        rng = batch.rng(row, self.salt)
        return _draw(self.ratio, rng), _draw(self.paste_x, rng), _draw(self.paste_y, rng)


def _canvas(xp: Any, img: Any, ch: int, cw: int, top: int, left: int, fill: np.ndarray) -> Any:
    """``img`` (HWC) at (``top``, ``left``) on a ``ch`` x ``cw`` canvas of ``fill``."""
    h, w, c = img.shape
    canvas = xp.empty((ch, cw, c), img.dtype)
    # filled by whole rows of the canvas (contiguous copies): above, below, then beside the image
    row = xp.asarray(np.tile(np.broadcast_to(fill, (c,)).astype(img.dtype), cw))
    rows = canvas.reshape(ch, cw * c)
    rows[:top], rows[top + h:] = row, row
    rows[top:top + h, :left * c], rows[top:top + h, (left + w) * c:] = row[:left * c], row[(left + w) * c:]
    canvas[top:top + h, left:left + w] = img
    return canvas


def _near(top: int, length: int, canvas: int, out: int) -> tuple[int, int, int, int]:
    """Along one axis of a ``canvas``-pixel canvas resized to ``out`` pixels (linear,
    antialiased) with the image on ``[top, top + length)``: the output pixels
    ``[o0, o1)`` whose filters reach the image and the canvas pixels ``[s0, s1)`` their
    filters read (the others see only the fill)."""
    scale = canvas / out
    support = max(scale, 1.0)
    o0 = max(0, math.floor((top - support) / scale - 0.5))
    o1 = min(out, math.ceil((top + length + support) / scale - 0.5) + 1)
    s0 = min(top, max(0, math.floor((o0 + 0.5) * scale - support) - 1))
    s1 = max(top + length, min(canvas, math.ceil((o1 - 0.5) * scale + support) + 1))
    return o0, o1, s0, s1


class Paste(_PasteDraws, Op):
    """DALI's ``paste``: each HWC image on a canvas of ``int(size * ratio)`` pixels per
    side (at least ``min_canvas_size``) filled with ``fill_value`` (one number or one
    per channel), its top-left corner at ``int(paste_x * (canvas_w - w))``,
    ``int(paste_y * (canvas_h - h))``. ``ratio`` (>= 1), ``paste_x`` and ``paste_y``
    (0-1) are numbers or ranges ``(lo, hi)`` drawn uniformly per row. Pixel masks
    (``masks``) go on a zero canvas the same way.

    ``size`` (h, w; uint8 images) also resizes the canvas to ``size`` as ``resize(size)``
    does (linear, antialiased), in one pass that resamples only the output pixels whose
    filter reaches the image (the rest are the fill): the zoom out of SSD pipelines
    without building and reading a canvas up to ``ratio**2`` times the image. Equal to
    ``paste`` then the fused ``resize`` up to float rounding (one level at most). Pixel
    masks stay at the canvas size, as ``resize`` leaves them."""

    def __init__(self, ratio: float | Sequence[float], paste_x: float | Sequence[float] = 0.5,
                 paste_y: float | Sequence[float] = 0.5, fill_value: float | Sequence[float] = 0,
                 min_canvas_size: float = 0.0, *, size: int | Sequence[int] | None = None, field: str = "image",
                 masks: str = "masks") -> None:
        super().__init__(ratio, paste_x, paste_y)
        if min_canvas_size < 0:
            raise ConfigError(f"min_canvas_size must be >= 0, got {min_canvas_size!r}")
        self.fill = np.atleast_1d(np.asarray(fill_value, np.float64))
        self.min_canvas, self.field, self.masks = float(min_canvas_size), field, masks
        self.size = None if size is None else size_pair(size, "size")
        self._resizer = None if size is None else FusedCropResizeNormalize(
            [Resize(self.size, field=field), Normalize(0.0, 1.0, "HWC", "uint8", field=field)])

    def placement(self, batch: Batch, row: int, h: int, w: int) -> tuple[int, int, int, int]:
        """(canvas height, canvas width, top, left) in pixels for an ``h`` x ``w`` image."""
        ratio, px, py = self.params(batch, row)
        ch, cw = max(int(h * ratio), int(self.min_canvas)), max(int(w * ratio), int(self.min_canvas))
        ch, cw = max(ch, h), max(cw, w)
        return ch, cw, int(py * (ch - h)), int(px * (cw - w))

    def __call__(self, batch: Batch) -> Batch:
        data = batch.data
        for img in data[self.field]:
            if len(self.fill) not in (1, img.shape[2]):
                raise ConfigError(f"fill_value has {len(self.fill)} numbers for images of {img.shape[2]} channels")
            if self.size is not None and img.dtype != np.uint8:
                raise ConfigError(f"paste(size=...) takes uint8 images, got {img.dtype}")
        if self.size is not None:
            data[self.field] = self._paste_resized(batch, list(data[self.field]))
        for row, img in enumerate(data[self.field]):
            h, w = img.shape[:2]
            if self.size is None:
                data[self.field][row] = _canvas(_module(img), img, *self.placement(batch, row, h, w), self.fill)
            if self.masks in data and data[self.masks][row] is not None:
                m = data[self.masks][row]
                mch, mcw, mtop, mleft = self.placement(batch, row, *m.shape[1:])
                data[self.masks][row] = _canvas(_module(m), m.transpose(1, 2, 0), mch, mcw, mtop, mleft,
                                                np.zeros(1)).transpose(2, 0, 1)
        return batch

    def _paste_resized(self, batch: Batch, images: list[Any]) -> list[Any]:
        """Paste and resize to ``size``: one resampling call over the parts of the
        canvases near the images, put into canvases of the fill."""
        (oh, ow), subs, spans = self.size, [], []
        plan: dict[str, list[Any]] = {"box": [], "clip": [], "out_hw": []}
        for row, img in enumerate(images):
            h, w = img.shape[:2]
            ch, cw, top, left = self.placement(batch, row, h, w)
            oy0, oy1, sy0, sy1 = _near(top, h, ch, oh)
            ox0, ox1, sx0, sx1 = _near(left, w, cw, ow)
            subs.append(_canvas(_module(img), img, sy1 - sy0, sx1 - sx0, top - sy0, left - sx0, self.fill))
            sy, sx = ch / oh, cw / ow
            plan["box"].append((oy0 * sy - sy0, ox0 * sx - sx0, (oy1 - oy0) * sy, (ox1 - ox0) * sx))
            plan["clip"].append((0, 0, sy1 - sy0, sx1 - sx0))
            plan["out_hw"].append((oy1 - oy0, ox1 - ox0))
            spans.append((oy0, oy1, ox0, ox1))
        if not images:
            return []
        arrays = {k: np.array(v, np.float64 if k == "box" else np.int64) for k, v in plan.items()}
        arrays["flip"] = np.zeros(len(images), np.int64)
        near = self._resizer.run_plan(batch, subs, arrays)
        out = []
        for img, part, (oy0, oy1, ox0, ox1) in zip(images, near, spans):
            full = _canvas(_module(img), img[:0, :0], oh, ow, 0, 0, self.fill)
            full[oy0:oy1, ox0:ox1] = part
            out.append(full)
        return out


class BBoxPaste(_PasteDraws, Op):
    """DALI's ``bbox_paste``: boxes (and vertices) where ``paste`` with the same
    ``ratio``, ``paste_x`` and ``paste_y`` puts their pixels: ``x' = x / ratio +
    paste_x * (ratio - 1) / ratio`` (likewise y; widths and heights are divided by
    ``ratio``), the offset lowered where needed so that boxes in 0-1 stay in 0-1."""

    def __init__(self, ratio: float | Sequence[float], paste_x: float | Sequence[float] = 0.5,
                 paste_y: float | Sequence[float] = 0.5, ltrb: bool = False, *, field: str = "boxes",
                 vertices: str = "vertices") -> None:
        super().__init__(ratio, paste_x, paste_y)
        self.ltrb, self.field, self.vertices = bool(ltrb), field, vertices

    def transform(self, batch: Batch, row: int) -> tuple[np.float32, np.ndarray]:
        """(scale, offset (x, y)) for ``row``, float32 as DALI computes them."""
        ratio, px, py = (np.float32(v) for v in self.params(batch, row))
        scale = np.float32(1) / ratio
        mul = (ratio - np.float32(1)) / ratio
        offset = np.array([px * mul, py * mul], np.float32)
        for d in range(2):
            if scale + offset[d] > 1:
                offset[d] = np.float32(1) - scale
                while scale + offset[d] > 1:
                    offset[d] = np.nextafter(offset[d], np.float32(-1))
        return scale, offset

    def __call__(self, batch: Batch) -> Batch:
        data = batch.data
        for row in range(len(batch)):
            scale, offset = self.transform(batch, row)
            b = data[self.field][row]
            xp = _module(b)
            b = xp.asarray(b, dtype=xp.float32).reshape(-1, 4)
            add = xp.asarray(np.concatenate([offset, offset if self.ltrb else np.zeros(2, np.float32)]))
            data[self.field][row] = b * scale + add
            if self.vertices in data:
                v = data[self.vertices][row]
                data[self.vertices][row] = v * scale + _module(v).asarray(offset)
        return batch


def encode_boxes(xp: Any, boxes: Any, counts: np.ndarray, labels: Any, anchors: Any, criteria: float = 0.5,
                 offset: bool = False, scale: float = 1.0, means: Sequence[float] = (0, 0, 0, 0),
                 stds: Sequence[float] = (1, 1, 1, 1)) -> tuple[Any, Any]:
    """DALI's box encoding for a batch, vectorized in ``xp`` (NumPy or CuPy): ``boxes``
    float32 ``[T, 4]`` (ltrb) and ``labels`` int32 ``[T]``, the rows' boxes end to end,
    ``counts[b]`` (host int64 ``[B]``) of them in row ``b``; ``anchors`` float32 ``[A, 4]``
    (ltrb). Returns float32 ``[B, A, 4]`` and int32 ``[B, A]``.

    Each box claims the anchor it overlaps most (IoU set to 2; the last of ties); each
    anchor then takes the box of its row with the highest IoU (the last of ties) if that
    IoU is above ``criteria``. Matched anchors get the box's centre and size ``(cx, cy,
    w, h)`` and label, the others their own centre and size and label 0; with ``offset``
    matched anchors get ``((c_box - c_anchor) / w_anchor - mean) / std`` and ``(log(w_box
    / w_anchor) - mean) / std`` (coordinates times ``scale`` first), the others 0."""
    total = len(boxes)
    if total == 0:  # no box in any row: one that no row owns, so that the gathers below have a source
        boxes, labels = xp.zeros((1, 4), xp.float32), xp.zeros(1, xp.int32)
    # coordinates one array each: [T, 1] for boxes, [A] for anchors, so that every step
    # runs over a contiguous [T, A] array
    bl, bt, br, bb = (boxes[:, k, None] for k in range(4))
    al, at, ar, ab = (xp.ascontiguousarray(anchors[:, k]) for k in range(4))
    inter = xp.minimum(br, ar)
    inter -= xp.maximum(bl, al)
    xp.maximum(inter, 0, out=inter)
    ih = xp.minimum(bb, ab)
    ih -= xp.maximum(bt, at)
    xp.maximum(ih, 0, out=ih)
    inter *= ih
    union = xp.add((br - bl) * (bb - bt), (ar - al) * (ab - at), out=ih)
    union -= inter
    iou = xp.where(inter > 0, inter / xp.where(union > 0, union, 1), 0).astype(xp.float32, copy=False)
    count_a = anchors.shape[0]
    iou[xp.arange(len(boxes)), count_a - 1 - xp.argmax(iou[:, ::-1], axis=1)] = 2
    # each anchor's best box in each row, the last of ties: the row's largest key, the
    # IoU's bits (they order as the values, IoU >= 0) above the box's number
    key = iou.view(xp.uint32).astype(xp.uint64)
    key <<= xp.uint64(32)
    key |= xp.arange(len(boxes), dtype=xp.uint64)[:, None]
    best = segment_max(xp, key[:total], counts)  # [B, A]; 0 (box 0, IoU 0) for a row without boxes
    best_box = (best & xp.uint64(0xFFFFFFFF)).astype(xp.int64)
    matched = (best >> xp.uint64(32)).astype(xp.uint32).view(xp.float32) > criteria
    out_labels = xp.where(matched, labels[best_box], 0).astype(xp.int32)
    # centre and size: of each box, gathered per anchor ([B, A] each), and of each anchor ([A] each)
    box_cs = [v[best_box] for v in ((boxes[:, 0] + boxes[:, 2]) * 0.5, (boxes[:, 1] + boxes[:, 3]) * 0.5,
                                    boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1])]
    anchor_cs = [(al + ar) * 0.5, (at + ab) * 0.5, ar - al, ab - at]
    if not offset:
        out = [xp.where(matched, b, a) for b, a in zip(box_cs, anchor_cs)]
        return xp.stack(out, axis=-1).astype(xp.float32, copy=False), out_labels
    s = xp.float32(scale)
    box_cs, anchor_cs = [v * s for v in box_cs], [v * s for v in anchor_cs]
    with np.errstate(divide="ignore", invalid="ignore"):
        out = [((box_cs[k] - anchor_cs[k]) / anchor_cs[k + 2] - xp.float32(means[k])) / xp.float32(stds[k])
               for k in range(2)]
        out += [(xp.log(xp.where(matched, box_cs[k], 1) / anchor_cs[k]) - xp.float32(means[k])) / xp.float32(stds[k])
                for k in range(2, 4)]
    return xp.stack([xp.where(matched, v, 0) for v in out], axis=-1).astype(xp.float32, copy=False), out_labels


def ssd300_anchors() -> np.ndarray:
    """The 8732 SSD300 default boxes for ``box_encoder``: float32 ``[8732, 4]``, ltrb,
    relative to the image (0-1, clipped): feature maps 38/19/10/5/3/1, steps
    8/16/32/64/100/300, scales 21-315 pixels, aspect ratios 2 (and 3 on the middle maps)."""
    fig, feats, steps = 300, (38, 19, 10, 5, 3, 1), (8, 16, 32, 64, 100, 300)
    scales, ratios = (21, 45, 99, 153, 207, 261, 315), ((2,), (2, 3), (2, 3), (2, 3), (2,), (2,))
    boxes = []
    for k, f in enumerate(feats):
        s1, s2 = scales[k] / fig, scales[k + 1] / fig
        sizes = [(s1, s1), (math.sqrt(s1 * s2),) * 2]
        for r in ratios[k]:
            sizes += [(s1 * math.sqrt(r), s1 / math.sqrt(r)), (s1 / math.sqrt(r), s1 * math.sqrt(r))]
        step = fig / steps[k]
        for i, j in itertools.product(range(f), repeat=2):
            cx, cy = (j + 0.5) / step, (i + 0.5) / step
            boxes += [(cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2) for w, h in sizes]
    return np.clip(np.array(boxes, np.float32), 0, 1)


class BoxEncoder(Op):
    """DALI's ``box_encoder``: boxes (ltrb, relative) and labels per row against
    ``anchors`` (ltrb, ``[A, 4]`` or flat ``4 * A`` floats) to float32 ``[N, A, 4]``
    and int32 ``[N, A]`` (see ``encode_boxes``): the whole batch in one vectorized
    NumPy (CPU) or CuPy (GPU) pass. A row with a number of labels other than its
    number of boxes is a bad sample."""

    def __init__(self, anchors: Sequence[float] | np.ndarray, criteria: float = 0.5, offset: bool = False,
                 scale: float = 1.0, means: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
                 stds: Sequence[float] = (1.0, 1.0, 1.0, 1.0), *, field: str = "boxes",
                 labels: str = "labels") -> None:
        self.anchors = np.asarray(anchors, np.float32).reshape(-1, 4)
        if not len(self.anchors) or not 0.0 <= criteria <= 1.0:
            raise ConfigError(f"give at least one anchor and criteria in [0, 1], got {len(self.anchors)} anchors "
                              f"and criteria={criteria!r}")
        if len(means) != 4 or len(stds) != 4 or any(float(s) == 0.0 for s in stds):
            raise ConfigError(f"means and stds are 4 numbers each, stds without a zero; got {means!r}, {stds!r}")
        self.criteria, self.offset, self.scale = float(criteria), bool(offset), float(scale)
        self.means, self.stds = [float(v) for v in means], [float(v) for v in stds]
        self.field, self.labels = field, labels
        self._device_anchors: dict[int, Any] = {}

    def __call__(self, batch: Batch) -> Batch:
        rows = [_boxes(b) for b in batch.data[self.field]]
        labels = [np.asarray(to_host(v), np.int32).reshape(-1) for v in batch.data[self.labels]]
        for row, (r, lab) in enumerate(zip(rows, labels)):
            if len(lab) != len(r):
                batch.reject(row, DataError(f"{len(lab)} labels for {len(r)} boxes", sample=int(batch.index[row])))
                rows[row], labels[row] = r[:0], lab[:0]
        counts = np.array([len(r) for r in rows], np.int64)
        boxes = np.concatenate(rows) if rows else np.zeros((0, 4), np.float32)
        labels = np.concatenate(labels) if labels else np.zeros(0, np.int32)
        args = (self.criteria, self.offset, self.scale, self.means, self.stds)
        if batch.device.is_cuda:
            with batch.on_device() as cp:
                anchors = self._device_anchors.get(batch.device.index)
                if anchors is None:
                    anchors = self._device_anchors[batch.device.index] = cp.asarray(self.anchors)
                boxes, labels = encode_boxes(cp, cp.asarray(boxes), counts, cp.asarray(labels), anchors, *args)
        else:
            boxes, labels = encode_boxes(np, boxes, counts, labels, self.anchors, *args)
        batch.data[self.field], batch.data[self.labels] = boxes, labels
        return batch


def random_bbox_crop(aspect_ratio: Sequence[float] = (1.0, 1.0), thresholds: Sequence[float] = (0.0,),
                     scaling: Sequence[float] = (1.0, 1.0), bbox_layout: str = "xyXY", allow_no_crop: bool = True,
                     num_attempts: int = 1, total_num_attempts: int = -1, threshold_type: str = "iou",
                     all_boxes_above_threshold: bool = True, bbox_prune_threshold: float | None = None,
                     **fields: str) -> RandomBBoxCrop:
    """See ``RandomBBoxCrop``."""
    return RandomBBoxCrop(aspect_ratio, thresholds, scaling, bbox_layout, allow_no_crop, num_attempts,
                          total_num_attempts, threshold_type, all_boxes_above_threshold, bbox_prune_threshold,
                          **fields)


def bb_flip(ltrb: bool = False, horizontal: bool = True, vertical: bool = False, p: float = 0.5,
            **fields: str) -> BBFlip:
    """See ``BBFlip``."""
    return BBFlip(ltrb, horizontal, vertical, p, **fields)


def paste(ratio: float | Sequence[float], paste_x: float | Sequence[float] = 0.5,
          paste_y: float | Sequence[float] = 0.5, fill_value: float | Sequence[float] = 0,
          min_canvas_size: float = 0.0, *, size: int | Sequence[int] | None = None, **fields: str) -> Paste:
    """See ``Paste``."""
    return Paste(ratio, paste_x, paste_y, fill_value, min_canvas_size, size=size, **fields)


def bbox_paste(ratio: float | Sequence[float], paste_x: float | Sequence[float] = 0.5,
               paste_y: float | Sequence[float] = 0.5, ltrb: bool = False, **fields: str) -> BBoxPaste:
    """See ``BBoxPaste``."""
    return BBoxPaste(ratio, paste_x, paste_y, ltrb, **fields)


def box_encoder(anchors: Sequence[float] | np.ndarray, criteria: float = 0.5, offset: bool = False,
                scale: float = 1.0, means: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
                stds: Sequence[float] = (1.0, 1.0, 1.0, 1.0), **fields: str) -> BoxEncoder:
    """See ``BoxEncoder``."""
    return BoxEncoder(anchors, criteria, offset, scale, means, stds, **fields)
