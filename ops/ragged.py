"""Batches of ragged rows (clips, spectrograms of different lengths) as one array,
and the two ops that work on any such field: ``normalize_axes`` and ``pad``.

Audio ops run on a whole batch at once: ``pack`` lays the rows of a field end to end
along their ragged axis (time) as one array ``[N, ...]`` (``N`` = the rows' lengths
summed), an op computes on it with NumPy or CuPy, and ``unpack`` hands back one view
per row. Rows that already lie end to end in one buffer, as the audio ops leave them,
pack without a copy. Per-row statistics are segment reductions over the packed
array (``segment_reduce``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.device import require
from gpuio.errors import ConfigError

__all__ = ["NormalizeAxes", "Pad", "normalize_axes", "pad", "pack", "unpack", "segment_reduce", "rows_of"]


def rows_of(col: Any) -> list[Any]:
    """A field's rows as a list (a stacked array gives one view per row)."""
    return list(col) if not isinstance(col, list) else col


def _ptr(a: Any) -> int:
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def pack(xp: Any, rows: Sequence[Any], axis: int) -> tuple[Any, np.ndarray]:
    """Rows laid end to end along ``axis``: ``(packed, lengths)``, ``packed`` time-major
    ``[N, *other axes]``, ``lengths`` int64 ``[B]`` (host). No copy when the rows are
    already consecutive views of one buffer."""
    moved = [xp.moveaxis(r, axis, 0) for r in rows]
    lengths = np.array([m.shape[0] for m in moved], dtype=np.int64)
    first = moved[0]
    rest = first.shape[1:]
    if all(m.shape[1:] == rest and m.dtype == first.dtype for m in moved):
        row_bytes = int(np.prod(rest, dtype=np.int64)) * first.dtype.itemsize
        base = _ptr(first)
        ends = np.concatenate([[0], np.cumsum(lengths)]) * row_bytes
        if all(m.flags.c_contiguous and (m.size == 0 or _ptr(m) == base + int(e))
               for m, e in zip(moved, ends[:-1])):
            strides = (row_bytes, *first.strides[1:]) if rest else (row_bytes,)
            return xp.lib.stride_tricks.as_strided(first, shape=(int(lengths.sum()), *rest),
                                                   strides=strides), lengths
    return xp.concatenate(moved, axis=0), lengths


def unpack(packed: Any, lengths: np.ndarray, axis: int) -> list[Any]:
    """One view of ``packed`` per row, the ragged axis moved back to ``axis``."""
    ends = np.cumsum(lengths).tolist()
    starts = [0, *ends[:-1]]
    if not axis:
        return [packed[a:b] for a, b in zip(starts, ends)]
    order = [*range(1, axis + 1), 0, *range(axis + 1, packed.ndim)]
    return [packed[a:b].transpose(order) for a, b in zip(starts, ends)]


_IDENTITY = {"sum": 0.0, "max": -np.inf, "min": np.inf}


def segment_reduce(xp: Any, values: Any, lengths: np.ndarray, kind: str) -> Any:
    """Per row ``kind`` ("sum", "max", "min") over axis 0 of a packed array:
    ``[N, ...]`` -> ``[B, ...]``; an empty row gives the reduction's identity."""
    b = len(lengths)
    out_dtype = values.dtype if kind != "sum" else np.result_type(values.dtype, np.float64)
    identity = _IDENTITY[kind]
    if np.dtype(out_dtype).kind in "iu" and kind != "sum":
        info = np.iinfo(out_dtype)
        identity = info.min if kind == "max" else info.max
    out = xp.full((b, *values.shape[1:]), identity, dtype=out_dtype)
    nonempty = np.nonzero(lengths)[0]
    if not len(nonempty):
        return out
    if xp is np:
        ufunc = {"sum": np.add, "max": np.maximum, "min": np.minimum}[kind]
        starts = (np.cumsum(lengths) - lengths)[nonempty]
        out[nonempty] = ufunc.reduceat(values.astype(out_dtype, copy=False), starts, axis=0)
        return out
    cupyx = require("cupyx")
    seg = xp.repeat(xp.arange(b), lengths.tolist())
    scatter = {"sum": cupyx.scatter_add, "max": cupyx.scatter_max, "min": cupyx.scatter_min}[kind]
    scatter(out, seg, values.astype(out_dtype, copy=False))
    return out


class NormalizeAxes(Op):
    """DALI's ``normalize``: ``scale * (x - mean) / stddev + shift`` per row, the
    mean and standard deviation taken over ``axes`` of each row (all axes by default),
    or over the whole batch with ``batch=True``; ``mean``/``stddev`` fix them instead.
    ``ddof`` and ``epsilon`` (added to the variance) as DALI's; a zero standard
    deviation gives 0. Output float32. Named ``normalize_axes`` because
    ``ops.normalize`` is the image op. Jasper's per-feature normalization of "ft"
    features is ``normalize_axes(axes=(1,))``."""

    def __init__(self, axes: Sequence[int] | None = None, *, batch: bool = False, mean: float | None = None,
                 stddev: float | None = None, ddof: int = 0, epsilon: float = 0.0, scale: float = 1.0,
                 shift: float = 0.0, field: str = "audio") -> None:
        self.axes = None if axes is None else tuple(int(a) for a in axes)
        self.batch, self.mean, self.stddev = bool(batch), mean, stddev
        self.ddof, self.epsilon, self.scale, self.shift = int(ddof), float(epsilon), float(scale), float(shift)
        self.field = field

    def __call__(self, batch: Batch) -> Batch:
        rows = rows_of(batch.data[self.field])
        if not rows:
            return batch
        xp = batch.xp
        ndim = rows[0].ndim
        axes = tuple(range(ndim)) if self.axes is None else tuple(a % ndim for a in self.axes)
        # pack along the axis the rows differ in (0 when they agree)
        ragged = next((a for a in range(ndim) if len({r.shape[a] for r in rows}) > 1), 0)
        packed, lengths = pack(xp, rows, ragged)
        # axes of the packed array ([N, others]) reduced within a row, besides N
        others = [a for a in range(ndim) if a != ragged]
        inner = tuple(1 + others.index(a) for a in axes if a != ragged)
        over_rows = ragged in axes
        x = packed.astype(xp.float32, copy=False)
        mean = self._stat(xp, x, lengths, inner, over_rows, self.mean, None)
        if self.stddev is not None:
            inv = xp.asarray(np.float32(1.0 / self.stddev))
        else:
            var = self._stat(xp, x, lengths, inner, over_rows, None, mean)
            std = xp.sqrt(var + self.epsilon)
            inv = xp.where(std > 0, 1.0 / xp.where(std > 0, std, 1.0), 0.0).astype(xp.float32)
        out = xp.subtract(x, mean, dtype=xp.float32)
        out *= inv * np.float32(self.scale)
        if self.shift:
            out += np.float32(self.shift)
        batch.data[self.field] = unpack(out, lengths, ragged)
        return batch

    def _stat(self, xp: Any, x: Any, lengths: np.ndarray, inner: tuple[int, ...], over_rows: bool,
              fixed: float | None, mean: Any) -> Any:
        """The mean (``mean`` None) or the variance around ``mean``, broadcastable to
        ``x``: per element of the packed array (its row's value)."""
        if fixed is not None:
            return xp.asarray(np.float32(fixed))
        v = x if mean is None else (x - mean) ** 2
        sums = v.sum(axis=inner, keepdims=True, dtype=xp.float64) if inner else v.astype(xp.float64)
        count = np.prod([x.shape[a] for a in inner], dtype=np.int64) if inner else 1
        if over_rows:  # per row: segment sums over N
            sums = segment_reduce(xp, sums, lengths, "sum")
            counts = lengths * count
            if self.batch:
                sums, counts = sums.sum(axis=0, keepdims=True), counts.sum(keepdims=True)
        else:
            counts = np.full(len(lengths), count)
            if self.batch:
                raise ConfigError("normalize_axes(batch=True) needs the ragged (time) axis among the axes")
        denom = counts - (self.ddof if mean is not None else 0)
        denom_x = xp.asarray(np.maximum(denom, 1).astype(np.float64))
        if not over_rows:
            return (sums / denom_x[0]).astype(xp.float32)
        stat = sums / denom_x.reshape((-1,) + (1,) * (sums.ndim - 1))
        if self.batch:
            return stat.astype(xp.float32)
        rows = xp.asarray(np.repeat(np.arange(len(lengths)), lengths))
        return stat.astype(xp.float32)[rows]


class Pad(Op):
    """DALI's ``pad``: rows padded with ``fill_value`` along ``axes`` (all by default)
    to the batch's largest extent, at least ``shape`` (-1: no minimum) and rounded up
    to a multiple of ``align``, stacked into one array ``[B, ...]``. The rows'
    extents before padding go to the field ``lengths`` (int64 ``[B]`` for one padded
    axis, ``[B, len(axes)]`` otherwise; None: not written)."""

    def __init__(self, axes: Sequence[int] | None = None, *, fill_value: float = 0.0,
                 shape: Sequence[int] | None = None, align: int | Sequence[int] | None = None,
                 lengths: str | None = "lengths", field: str = "audio") -> None:
        self.axes = None if axes is None else tuple(int(a) for a in axes)
        self.fill_value, self.lengths, self.field = fill_value, lengths, field
        self.shape = None if shape is None else tuple(int(s) for s in shape)
        self.align = align
        if self.shape is not None and self.axes is not None and len(self.shape) != len(self.axes):
            raise ConfigError(f"pad: shape {self.shape} needs one extent per axis of {self.axes}")

    def __call__(self, batch: Batch) -> Batch:
        rows = rows_of(batch.data[self.field])
        if not rows:
            return batch
        xp = batch.xp
        ndim = rows[0].ndim
        axes = tuple(range(ndim)) if self.axes is None else tuple(a % ndim for a in self.axes)
        extents = np.array([r.shape for r in rows], dtype=np.int64).reshape(len(rows), ndim)
        target = extents.max(axis=0)
        minimum = self.shape or (-1,) * len(axes)
        align = np.broadcast_to(np.asarray(self.align if self.align is not None else 1), (len(axes),))
        for k, a in enumerate(axes):
            target[a] = max(int(target[a]), int(minimum[k]))
            target[a] = -(-int(target[a]) // int(align[k])) * int(align[k])
        if any(len({e[a] for e in extents.tolist()}) > 1 for a in range(ndim) if a not in axes):
            raise ConfigError(f"pad: rows differ along axes that are not padded (axes={axes}); "
                              f"shapes {sorted({tuple(e) for e in extents.tolist()})}")
        out = xp.full((len(rows), *target.tolist()), self.fill_value, dtype=rows[0].dtype)
        for i, r in enumerate(rows):
            out[(i, *(np.s_[:n] for n in r.shape))] = r
        batch.data[self.field] = out
        if self.lengths is not None:
            kept = extents[:, list(axes)]
            batch.data[self.lengths] = kept[:, 0].copy() if len(axes) == 1 else kept
        return batch


def normalize_axes(axes: Sequence[int] | None = None, *, batch: bool = False, mean: float | None = None,
                   stddev: float | None = None, ddof: int = 0, epsilon: float = 0.0, scale: float = 1.0,
                   shift: float = 0.0, field: str = "audio") -> NormalizeAxes:
    """See ``NormalizeAxes``."""
    return NormalizeAxes(axes, batch=batch, mean=mean, stddev=stddev, ddof=ddof, epsilon=epsilon,
                         scale=scale, shift=shift, field=field)


def pad(axes: Sequence[int] | None = None, *, fill_value: float = 0.0, shape: Sequence[int] | None = None,
        align: int | Sequence[int] | None = None, lengths: str | None = "lengths", field: str = "audio") -> Pad:
    """See ``Pad``."""
    return Pad(axes, fill_value=fill_value, shape=shape, align=align, lengths=lengths, field=field)
