"""The fused GPU chain and ``Compose``.

``FusedCropResizeNormalize`` replaces a chain ``[crop | resize]* -> [flip] ->
normalize`` (at most one resampling step: a ``resize`` or a ``random_resized_crop``)
by one kernel launch per batch on the GPU: it composes the chain's per-sample
parameters (each op draws its random numbers exactly as when it runs alone) into a
source box, the source pixels the filter may read, the output size and a flip flag,
then reads the decoded pixels once and writes the normalized batch once. On a CPU
batch the same plan runs in C (``ops/_resample.c``: one call per batch, the GIL
released) for the linear, area and nearest filters into float32 or uint8; otherwise
(or where the C module was not built) the ops run one by one. A resampling chain that
no normalize follows (``[crop | resize]* -> [flip]``, e.g. decode and resize to uint8
HWC) is fused with ``normalize(0, 1, "HWC", "uint8")`` where the C path takes it.
``fused_reference`` is the kernel's math in NumPy, so that the algorithm is tested
without a GPU.

``DecodeFused`` puts a ``decode_image`` in front of a fused chain: each image is decoded
only where the chain's filter reads (the crop's rows and columns). On the CPU libjpeg
reads the batch's JPEG headers in one C call, the plan's random draws are made, and one
more C call per part (``gpuio.ops._jpeg.decode_resample``, the GIL released; the rows split
into a part per core with about equal decoded pixels, run at once on the process's pool, so
that one batch keeps every core busy: the first batch of an epoch and the last) decodes
each JPEG's window with libjpeg-turbo's partial decode, at 1/2, 1/4 or 1/8 scale (libjpeg's DCT
scaling) when the crop keeps at least the output's size (times 1.5) at that scale, and
resamples it into the batch output while it is still in the cache. Where the batch has
the images' restart offsets (the field ``<field>.restarts`` beside the encoded ``<field>``,
as a packed dataset with restart markers has: ``gpuio.ops.restart``), only the restart
intervals that cover the window and 4 pixels around it are decoded, bit-exact to decoding
the whole stream (offsets that do not fit their image: decoded from the whole stream, with
a warning). Images it does not
take (CMYK, EXIF-rotated, truncated, not JPEG), or stops on (a libjpeg warning), are
decoded whole by ``decode_cpu`` (the one decode policy: see ``ops.decode``) and resampled
by ``gpuio.ops._resample``. On the GPU the batch goes through nvImageCodec's region decode in
one call (``ops.decode_slice.region_source``), the rest falling back per image as in
``decode_image``.

``Compose(ops)`` runs ops in order, dropping rejected rows between them, and swaps
every fusable chain for the fused op (and a decoder in front of one for
``DecodeFused``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio import config
from gpuio.batch import Batch, Op
from gpuio.storage.buffers import pooled_empty
from gpuio.device import require
from gpuio.errors import ConfigError, FormatError
from gpuio.ops.color import Normalize, cast, stack_or_list
from gpuio.ops import decode as decode_ops
from gpuio.ops._cpu_pool import cpu_count, cpu_pool
from gpuio.ops.decode import (DecodeImage, byte_view, decodes_gray, decode_cpu, decode_gpu, decode_rows, facts_info,
                              gpu_decodable, jpeg_facts, region_decodable, upload)
from gpuio.ops.decode_slice import code_stream, region_source, stored_orientation
from gpuio.ops.geometry import INTERPOLATIONS, CenterCrop, Flip, RandomResizedCrop, Resize, Crop, image_sizes, resample
from gpuio.ops.restart import restarts_field

try:
    from gpuio.ops import _resample
except ImportError:  # built at install where a C compiler exists; else the CPU ops run one by one
    _resample = None

__all__ = ["Compose", "DecodeFused", "FusedCropResizeNormalize", "crop_mirror_normalize", "dct_denoms",
           "fused_crop_resize_normalize", "fused_reference"]

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
        self.unfused = ops  # what runs where the fused path does not: without an implicit normalize (_fuse)
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
            if isinstance(op, Crop):
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

    def runs_in_c(self) -> bool:
        """Whether a CPU batch runs through ``gpuio.ops._resample`` (else op by op)."""
        return _resample is not None and self.interp != "cubic" and self.normalize.dtype != "float16"

    def __call__(self, batch: Batch) -> Batch:
        images = batch.data[self.field]
        if len(images) == 0 or any(img.dtype != np.uint8 for img in images) \
                or not (batch.device.is_cuda or self.runs_in_c()):
            for op in self.unfused:
                batch = op(batch)
                batch.drop_rejected()
            return batch
        plan = self.plan(batch, image_sizes(images))
        keep = plan.pop("ok")
        batch.drop_rejected()
        images = [img for img, k in zip(images, keep.tolist()) if k]
        plan = {k: v[keep] for k, v in plan.items()}
        batch.data[self.field] = self.run_plan(batch, images, plan)
        return batch

    def run_plan(self, batch: Batch, images: list[Any], plan: dict[str, np.ndarray]) -> Any:
        """The chain's output for uint8 HWC ``images`` and their ``plan`` (rows all kept)."""
        if not images:
            return []
        channels = images[0].shape[2]
        args = dict(interp=self.interp, antialias=self.antialias, layout=self.normalize.layout,
                    dtype=self.normalize.dtype)
        if batch.device.is_cuda:  # one launch per channel count, each with its normalization
            from gpuio.ops._kernels import crop_resize_normalize

            return crop_resize_normalize(batch, images, plan["box"], plan["clip"], plan["out_hw"], plan["flip"],
                                         params=self.normalize.channel_params, **args)
        if any(img.shape[2] != channels for img in images):  # grey and colour: as Normalize, per image
            return stack_or_list(np, [fused_reference([img], {k: v[row: row + 1] for k, v in plan.items()},
                                                      *self.normalize.channel_params(img.shape[2]), **args)[0]
                                      for row, img in enumerate(images)])
        mean, inv_std = self.normalize.channel_params(channels)
        if not self.runs_in_c():
            return fused_reference(images, plan, mean, inv_std, **args)
        out, offsets = self.c_output(plan["out_hw"], channels)
        _resample.resample(images, *self.c_args(plan, offsets, out, channels))
        return self.c_result(out, offsets, plan["out_hw"], channels)

    def c_output(self, out_hw: np.ndarray, channels: int) -> tuple[np.ndarray, np.ndarray]:
        """The flat output of the C path for outputs of sizes ``out_hw`` ``[N, 2]`` (a
        pooled buffer) and where each sample starts in it (items, int64 ``[N]``)."""
        sizes = out_hw[:, 0] * out_hw[:, 1] * channels
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return pooled_empty((int(sizes.sum()),), self.normalize.dtype), offsets

    def c_args(self, plan: dict[str, np.ndarray], offsets: np.ndarray, out: np.ndarray, channels: int) -> tuple:
        """The batch arguments of ``gpuio.ops._resample.resample`` and
        ``gpuio.ops._jpeg.decode_resample`` after their images."""
        mean, inv_std = self.normalize.channel_params(channels)
        return (np.ascontiguousarray(plan["box"], np.float64), np.ascontiguousarray(plan["clip"], np.int64),
                np.ascontiguousarray(plan["out_hw"], np.int64), np.ascontiguousarray(offsets, np.int64),
                np.ascontiguousarray(plan["flip"], np.int64), mean, inv_std, out, INTERPOLATIONS[self.interp],
                self.antialias, self.normalize.layout == "CHW", self.normalize.dtype == "uint8")

    def c_result(self, out: np.ndarray, offsets: np.ndarray, out_hw: np.ndarray, channels: int) -> Any:
        """The samples in ``out`` (``c_output``) as one array, or a list where their
        shapes differ."""
        chw = self.normalize.layout == "CHW"
        shapes = [(channels, h, w) if chw else (h, w, channels) for h, w in out_hw.tolist()]
        if all(shape == shapes[0] for shape in shapes):
            return out.reshape(len(shapes), *shapes[0])
        return [out[o: o + int(np.prod(shape))].reshape(shape) for o, shape in zip(offsets.tolist(), shapes)]


def _runs(cost: np.ndarray, parts: int) -> list[np.ndarray]:
    """At most ``parts`` runs of consecutive positions of ``cost`` (``[N]``) with about
    equal sums, none empty."""
    if len(cost) == 0:
        return []
    total = np.cumsum(cost, dtype=np.float64)
    cuts = np.searchsorted(total, total[-1] * np.arange(1, parts) / parts, side="right")
    return [run for run in np.split(np.arange(len(cost)), np.unique(cuts)) if len(run)]


def _filter_clip(plan: dict[str, np.ndarray], interp: str, antialias: bool) -> np.ndarray:
    """The clips of a fused ``plan`` narrowed to the source pixels the C resampler's
    filter reads for each box, and a pixel more on each side (``ops/_resample.h``
    ``windows``: an output pixel reads the taps within the filter's support of its centre,
    the support scaled by the box's shrink where it antialiases). The output is the same;
    the decoder decodes less where a crop follows a resize (``resize -> center_crop``),
    whose clip is the whole image."""
    box = plan["box"]
    scale = box[:, 2:4] / np.maximum(plan["out_hw"], 1)
    fscale = np.where(antialias & (scale > 1.0), scale, 1.0)
    support = fscale * {"linear": 1.0, "area": 0.5}.get(interp, 0.0) + 1.5  # nearest: its one pixel
    clip = plan["clip"].copy()
    clip[:, 0:2] = np.maximum(clip[:, 0:2], np.floor(box[:, 0:2] - support))
    clip[:, 2:4] = np.minimum(clip[:, 2:4], np.ceil(box[:, 0:2] + box[:, 2:4] + support))
    return clip


def dct_denoms(box: np.ndarray, out_hw: np.ndarray, subsampling: np.ndarray) -> np.ndarray:
    """Per row the largest DCT scale 1/d (d = 8, 4, 2, else 1), int64 ``[N]``, that keeps
    the box (``[N, 4]``) at least 1.5x ``out_hw`` (``[N, 2]``): the resize after it then
    smooths the scaled IDCT's sharper edges (with less margin they survive the resize and
    the output drifts from that of a full decode). Only for JPEGs whose components are
    subsampled by at most 2 (``subsampling``, ``[N]``, from ``jpeg_facts``): libjpeg
    scales their chroma by the IDCT or fancy upsampling, while a 4:1:1 JPEG's scaled
    chroma is replicated 4 times across and drifts by over 1.5 levels on average."""
    denoms = np.ones(len(box), np.int64)
    for d in (2, 4, 8):
        denoms[(box[:, 2] >= 1.5 * d * out_hw[:, 0]) & (box[:, 3] >= 1.5 * d * out_hw[:, 1]) & (subsampling <= 2)] = d
    return denoms


class DecodeFused(Op):
    """``decode`` (a ``decode_image``) then ``fused`` on its output; see the module
    docstring. Outputs equal those of the two ops in turn, up to the DCT scaling (when
    it applies: within 1.5 levels on average). Corrupt data in rows below a crop is
    never read (a truncated file is still refused: the region decoder takes only files
    that end with the end-of-image marker). On a GPU batch
    nvImageCodec decodes only the window the chain reads, then the fused kernel runs
    (no DCT scaling there: outputs equal the two ops in turn up to the region decode's
    chroma upsampling at the window's edges). A CPU batch's window decodes run as
    ``decode_parts`` parts at once on the ops' pool (``uses_decode_parts``: a Loader
    passes its value, ``"auto"`` tuned online)."""

    uses_decode_parts = True

    def __init__(self, decode: DecodeImage, fused: FusedCropResizeNormalize) -> None:
        if decode.out != fused.field:
            raise ConfigError(f"the decoder writes {decode.out!r}, the fused chain reads {fused.field!r}")
        self.decode, self.fused, self.host_inputs = decode, fused, decode.host_inputs
        self.ops = [decode, *fused.ops]

    def __call__(self, batch: Batch) -> Batch:
        if batch.device.is_cuda:
            return self._call_gpu(batch)
        if not self.fused.runs_in_c() or decode_ops.native_jpeg() is None:
            batch = self.decode(batch)
            batch.drop_rejected()
            return self.fused(batch)
        return self._call_cpu(batch)

    def _call_cpu(self, batch: Batch) -> Batch:
        """libjpeg reads the batch's headers in one call; the JPEGs the region decoder
        takes are decoded where the plan reads and resampled in one more call
        (``gpuio.ops._jpeg.decode_resample``), the others decoded whole (``decode_cpu``) and
        resampled by ``gpuio.ops._resample``, into the same output."""
        color = self.decode.color
        bufs = [byte_view(buf) for buf in batch.data[self.decode.field]]
        restarts = batch.data.get(restarts_field(self.decode.field))
        facts = jpeg_facts(bufs)
        windowed = region_decodable(facts)
        images: list[Any] = list(bufs)  # encoded where windowed, else decoded here
        hw = facts[:, 3:5].copy()
        bad: list[int] = []

        def decode_whole(rows: np.ndarray) -> None:
            for row in rows.tolist():
                try:
                    images[row] = decode_cpu(bufs[row], color, int(batch.index[row]), facts_info(facts[row]),
                                             functools.partial(batch.warn, row))
                    hw[row] = images[row].shape[:2]
                except FormatError as exc:
                    batch.reject(row, exc)
                    bad.append(row)
            windowed[rows] = False

        decode_whole(np.flatnonzero(~windowed))
        channels = {1 if decodes_gray(color, c) else 3 for c in facts[windowed, 0].tolist()}
        channels |= {img.shape[2] for row, img in enumerate(images) if not windowed[row] and row not in bad}
        if len(channels) > 1:  # gray and colour images ("unchanged"): decoded whole, NumPy math in run_plan
            decode_whole(np.flatnonzero(windowed))
        keep = _keep(len(images), bad)
        batch.drop_rejected()
        subsampling = facts[:, 6]
        restarts = list(restarts) if restarts is not None else [None] * len(images)
        images, windowed, subsampling, restarts = (_take(images, keep), windowed[keep], subsampling[keep],
                                                   _take(restarts, keep))
        plan = self.fused.plan(batch, hw[keep])
        keep = plan.pop("ok")
        batch.drop_rejected()
        images, windowed, subsampling, restarts = (_take(images, keep), windowed[keep], subsampling[keep],
                                                   _take(restarts, keep))
        plan = {k: v[keep] for k, v in plan.items()}
        if len(channels) != 1 or not images:
            batch.data[self.fused.field] = self.fused.run_plan(batch, images, plan)
            return batch
        return self._resample(batch, images, restarts, windowed, subsampling, plan, channels.pop())

    def _resample(self, batch: Batch, images: list[Any], restarts: list[Any], windowed: np.ndarray,
                  subsampling: np.ndarray, plan: dict[str, np.ndarray], channels: int) -> Batch:
        """The chain's output into one buffer: the ``windowed`` rows of ``images``
        (encoded; ``subsampling`` from their ``jpeg_facts``; ``restarts`` their restart
        offsets or None) decoded from the restart intervals their windows cover (the whole
        stream where they have none) and resampled by
        ``gpuio.ops._jpeg.decode_resample``, the others (decoded, ``channels`` each) by
        ``gpuio.ops._resample.resample``. The rows the first refuses (it stops at libjpeg's
        first warning) are decoded whole by ``decode_cpu``, which decodes or refuses them as
        ``decode_image`` does, and resampled after."""
        out, offsets = self.fused.c_output(plan["out_hw"], channels)
        plan = dict(plan, clip=_filter_clip(plan, self.fused.interp, self.fused.antialias))
        rows = np.flatnonzero(windowed)
        denoms = dct_denoms(plan["box"][rows], plan["out_hw"][rows], subsampling[rows])
        clip = plan["clip"][rows]
        decoded_pixels = (clip[:, 2] - clip[:, 0]) * (clip[:, 3] - clip[:, 1]) // (denoms * denoms)

        def decode_resample(run: np.ndarray, marked: bool = True) -> list[tuple[int, str]]:
            """The rows ``rows[run]`` (from their restart intervals where ``marked``); the
            failed ones as (row, message)."""
            these = rows[run]
            part = {k: v[these] for k, v in plan.items()}
            failed = decode_ops.native_jpeg().decode_resample(
                [images[r] for r in these.tolist()], denoms[run], channels == 1,
                *self.fused.c_args(part, offsets[these], out, channels),
                [restarts[r] for r in these.tolist()] if marked else None)
            return [(int(these[k]), message) for k, message in failed]

        parts = config.get("decode_parts")  # "auto" outside a Loader, or 0: a part per core
        runs = _runs(decoded_pixels, parts if isinstance(parts, int) and parts > 0 else cpu_count())
        failed = [f for got in (cpu_pool().map(decode_resample, runs) if len(runs) > 1
                                else map(decode_resample, runs)) for f in got]
        marked = {row for row, _ in failed if restarts[row] is not None and len(restarts[row])}
        if marked:  # offsets that do not fit their image (or bad data they point at): once more from the whole stream
            again = dict(decode_resample(np.searchsorted(rows, sorted(marked)), marked=False))
            for row, message in failed:
                if row in marked and row not in again:
                    batch.warn(row, f"decoded without its restart offsets: {message}")
            failed = [(row, again.get(row, message)) for row, message in failed if row not in marked or row in again]
        rest = np.flatnonzero(~windowed)
        if len(rest):
            part = {k: v[rest] for k, v in plan.items()}
            _resample.resample([images[r] for r in rest], *self.fused.c_args(part, offsets[rest], out, channels))
        redo, decoded = [], []
        for row, _ in failed:
            try:
                img = decode_cpu(images[row], self.decode.color, int(batch.index[row]),
                                 on_warning=functools.partial(batch.warn, row))
            except FormatError as exc:
                batch.reject(row, exc)
                continue
            y1, x1 = plan["clip"][row, 2:].tolist()
            if img.shape[2] != channels or y1 > img.shape[0] or x1 > img.shape[1]:
                batch.reject(row, FormatError(f"image of {len(images[row])} bytes decodes to {img.shape}, not the "
                                              f"size its header declares", sample=int(batch.index[row])))
                continue
            redo.append(row)
            decoded.append(img)
        if redo:
            part = {k: v[redo] for k, v in plan.items()}
            _resample.resample(decoded, *self.fused.c_args(part, offsets[redo], out, channels))
        batch.data[self.fused.field] = self.fused.c_result(out, offsets, plan["out_hw"], channels)
        batch.drop_rejected()
        return batch

    def _call_gpu(self, batch: Batch) -> Batch:
        """nvImageCodec decodes only the window the plan reads (``clip``) of the images
        it takes in stored orientation, all in one call; the images it does not take,
        or the rotated ones, are decoded whole first (``decode_rows``: nvImageCodec, else
        the CPU), and so are those it fails on in the window call. The random draws are
        made on the stored sizes, as the unfused ops make them on the decoded images."""
        color = self.decode.color
        bufs = [byte_view(buf) for buf in batch.data[self.decode.field]]
        windowed = [gpu_decodable(data) and stored_orientation(data) for data in bufs]
        nvimgcodec = require("nvidia.nvimgcodec") if any(windowed) else None
        streams = [code_stream(nvimgcodec, data) if w else None for data, w in zip(bufs, windowed)]
        images: list[Any] = [None] * len(bufs)
        bad = decode_rows(batch, bufs, [row for row, stream in enumerate(streams) if stream is None], color, images)
        hw = [(s.height, s.width) if s is not None else img.shape[:2] if img is not None else (0, 0)
              for s, img in zip(streams, images)]
        keep = _keep(len(bufs), bad)
        batch.drop_rejected()
        bufs, streams, images = _take(bufs, keep), _take(streams, keep), _take(images, keep)
        plan = self.fused.plan(batch, np.array(_take(hw, keep), np.int64).reshape(-1, 2))
        keep = plan.pop("ok")
        batch.drop_rejected()
        bufs, streams, images = _take(bufs, keep), _take(streams, keep), _take(images, keep)
        plan = {k: v[keep] for k, v in plan.items()}  # indexing by a mask copies: to_region may write it
        rows = [row for row, stream in enumerate(streams) if stream is not None]
        windows = {row: tuple(plan["clip"][row].tolist()) for row in rows}
        decode_gpu(batch, rows, [region_source(nvimgcodec, streams[r], windows[r]) for r in rows], color, images)
        for row in rows:
            y0, x0, y1, x1 = windows[row]
            if images[row] is not None and images[row].shape[:2] != (y1 - y0, x1 - x0):
                images[row] = None  # a decoder that ignored the region: decoded again whole
            if images[row] is not None:
                to_region(plan, row, windows[row])
        bad = decode_rows(batch, bufs, [row for row in rows if images[row] is None], color, images)
        keep = _keep(len(bufs), bad)
        batch.drop_rejected()
        images = upload(batch, _take(images, keep))
        batch.data[self.fused.field] = self.fused.run_plan(batch, images, {k: v[keep] for k, v in plan.items()})
        return batch


def to_region(plan: dict[str, np.ndarray], row: int, region: Sequence[int]) -> None:
    """Move ``row`` of a fused ``plan`` (source pixel coordinates) to the pixels of its
    decoded ``region`` (y0, x0, y1, x1): the box is shifted, the filter reads the whole
    region. (The CPU path's DCT scaling moves its boxes in C.)"""
    y0, x0, y1, x1 = region
    plan["box"][row] = plan["box"][row] - [y0, x0, 0, 0]
    plan["clip"][row] = [0, 0, y1 - y0, x1 - x0]


def _keep(n: int, bad: list[int]) -> np.ndarray:
    keep = np.ones(n, dtype=bool)
    keep[bad] = False
    return keep


def _take(values: list[Any], keep: np.ndarray) -> list[Any]:
    return [v for v, k in zip(values, keep.tolist()) if k]


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
    """``ops`` with each fusable chain ending in a normalize replaced by the fused op. A
    chain with one resampling step and no normalize after it (``[crop | resize]* ->
    [flip]``, followed by an op of another kind or by nothing) fuses too, with a
    ``normalize(0, 1, "HWC", "uint8")``: the uint8 HWC images the ops give (rounded as the
    resampler rounds, within a level of Pillow's), in one array where their sizes agree."""
    out: list[Op] = []
    for k, op in enumerate(ops):
        out.append(op)
        if isinstance(op, Normalize):
            start = _chain_start(out[:-1], op.field)
            if start < len(out) - 1:
                chain = out[start:]
                del out[start:]
                out.append(FusedCropResizeNormalize(chain))
        elif isinstance(op, (*_GEOMETRY, Flip)) and not _extends(ops[k + 1: k + 2], op.field):
            start = _chain_start(out, op.field)
            chain = [*out[start:], Normalize(0.0, 1.0, "HWC", "uint8", field=op.field)]
            if any(_resamples(o) for o in chain):
                fused = FusedCropResizeNormalize(chain)
                fused.unfused = chain[:-1]  # images that are not uint8 keep their dtype, as the ops leave it
                if fused.runs_in_c():  # else the ops one by one (Pillow) are the faster CPU path
                    del out[start:]
                    out.append(fused)
    return out


def _extends(following: list[Op], field: str) -> bool:
    """Whether the op after a geometry op (``following``: it, or nothing) continues its
    chain on ``field``."""
    return bool(following) and isinstance(following[0], (*_GEOMETRY, Flip, Normalize)) \
        and following[0].field == field


def _chain_start(ops: list[Op], field: str) -> int:
    """Where the longest fusable chain ``[crop | resize]* -> [flip]`` on ``field`` (at
    most one resampling step) that ends ``ops`` begins; ``len(ops)`` when none does."""
    start = len(ops)
    if start > 0 and isinstance(ops[start - 1], Flip) and ops[start - 1].field == field:
        start -= 1
    resamples = 0
    while start > 0 and isinstance(ops[start - 1], _GEOMETRY) and ops[start - 1].field == field \
            and resamples + _resamples(ops[start - 1]) <= 1:
        resamples += _resamples(ops[start - 1])
        start -= 1
    return start


def _fuse_decode(ops: list[Op]) -> list[Op]:
    """``ops`` with each ``decode_image`` followed by a fused chain on its output
    replaced by ``DecodeFused``."""
    out: list[Op] = []
    for op in ops:
        if isinstance(op, FusedCropResizeNormalize) and out and isinstance(out[-1], DecodeImage) \
                and out[-1].out == op.field:
            out[-1] = DecodeFused(out[-1], op)
        else:
            out.append(op)
    return out


class Compose(Op):
    """Run ``ops`` in order, dropping the rows they reject after each. With
    ``fuse=True`` each chain ``[crop | resize]* -> [flip] -> normalize`` runs as one
    fused op (a kernel on a GPU batch, C on a CPU batch), and so does a resampling chain
    with no normalize after it (uint8 HWC out; see ``_fuse``), together with a
    ``decode_image`` right before it (``DecodeFused``). ``host_inputs`` lists the
    fields its ops need in host memory; ``uses_decode_parts``, whether one of its ops
    reads the ``decode_parts`` setting."""

    def __init__(self, ops: Sequence[Op], *, fuse: bool = True) -> None:
        # a Compose inside (crop_mirror_normalize) is opened, so that its chain fuses with the ops around it
        self.ops = [o for op in ops for o in (op.ops if isinstance(op, Compose) else [op])]
        self.fused = _fuse_decode(_fuse(self.ops)) if fuse else self.ops
        self.host_inputs = tuple(dict.fromkeys(f for op in self.ops for f in getattr(op, "host_inputs", ())))
        self.uses_decode_parts = any(getattr(op, "uses_decode_parts", False) for op in self.fused)

    def __call__(self, batch: Batch) -> Batch:
        for op in self.fused:
            batch = op(batch)
            batch.drop_rejected()
        return batch


def fused_crop_resize_normalize(ops: Sequence[Op]) -> FusedCropResizeNormalize:
    """See ``FusedCropResizeNormalize``."""
    return FusedCropResizeNormalize(ops)


def crop_mirror_normalize(crop: int | Sequence[int] | None = None, mean: float | Sequence[float] = 0.0,
                          std: float | Sequence[float] = 1.0, *, mirror: float = 0.0, layout: str = "CHW",
                          dtype: str = "float32", field: str = "image") -> Compose:
    """Center-crop ``crop`` (h, w pixels, or one int for a square; None: no crop), mirror
    left-right with probability ``mirror`` (DALI's ``mirror=fn.random.coin_flip()`` is
    ``mirror=0.5``), then ``(pixel - mean) / std`` per channel (0-255 units for uint8
    images), laid out ``"CHW"`` or ``"HWC"`` and cast to ``dtype``. Takes HWC images;
    a batch of one size comes out as one ``[N, C, H, W]`` (or ``[N, H, W, C]``) array.
    An image smaller than ``crop`` is a bad sample (resize first).

    DALI's one-op crop, random mirror, normalize and layout: ``Compose([center_crop, flip,
    normalize])``, run as one fused op (on a GPU batch one kernel launch, on a CPU batch
    one C call), each op drawing its random numbers per sample as it does alone."""
    ops = [CenterCrop(crop, field=field)] if crop is not None else []
    if mirror:
        ops.append(Flip(True, mirror, field=field))
    ops.append(Normalize(mean, std, layout, dtype, field=field))
    return Compose(ops)
