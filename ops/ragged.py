"""Batches of ragged rows (clips, spectrograms of different lengths) as one array,
and the two ops that work on any such field: ``normalize_axes`` and ``pad``.

Audio ops run on a whole batch at once: ``pack`` lays the rows of a field end to end
along their ragged axis (time) as one array ``[N, ...]`` (``N`` = the rows' lengths
summed), an op computes on it with NumPy or CuPy, and ``unpack`` hands back one view
per row. Rows that already lie end to end in one buffer, as the audio ops leave them,
pack without a copy. Per-row statistics are segment reductions over the packed
array (``segment_max``, ``segment_span``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch, Op
from gpuio.storage.buffers import pooled_empty
from gpuio.device import require
from gpuio.errors import ConfigError

try:
    from gpuio.ops import _audio
except ImportError:  # built at install where a C compiler exists; else NumPy computes the same
    _audio = None

__all__ = ["NormalizeAxes", "Pad", "normalize_axes", "pad", "pack", "unpack", "segment_max", "segment_span",
           "rows_of", "to_host", "empty", "groups", "ragged_axis"]


def rows_of(col: Any) -> list[Any]:
    """A field's rows as a list (a stacked array gives one view per row)."""
    return list(col) if not isinstance(col, list) else col


def to_host(a: Any) -> np.ndarray:
    """``a`` as a host NumPy array: a CuPy array or a torch tensor (on any device) copied
    to the host, a NumPy array as it is, anything else (a list, a number) through
    ``np.asarray``."""
    torch = sys.modules.get("torch")  # never imported here: a tensor means torch is loaded
    if torch is not None and isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return a.get() if hasattr(a, "__cuda_array_interface__") else np.asarray(a)


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


_HOST_GROUP = 1 << 19  # elements per group of rows on the host: temporaries stay in cache


def empty(xp: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """A batch-sized output array: pooled host memory (no page faults per batch) or
    a CuPy array."""
    return pooled_empty(shape, dtype) if xp is np else xp.empty(shape, dtype=dtype)


def groups(xp: Any, lengths: np.ndarray, width: int = 1) -> list[tuple[int, int, int, int]]:
    """Consecutive rows in groups ``(first row, stop row, first element, stop
    element)`` of the packed array: on the host, groups of about ``_HOST_GROUP``
    elements (``length * width`` per row; a longer row is a group of its own), so
    that an op's temporaries stay in cache; on a GPU the whole batch at once."""
    ends = np.cumsum(lengths)
    if xp is not np or not len(lengths):
        return [(0, len(lengths), 0, int(ends[-1]) if len(ends) else 0)]
    out, first = [], 0
    while first < len(lengths):
        start = int(ends[first] - lengths[first])
        stop = int(np.searchsorted(ends, start + max(_HOST_GROUP // max(width, 1), 1), side="right"))
        stop = max(stop, first + 1)
        out.append((first, stop, start, int(ends[stop - 1])))
        first = stop
    return out


def unpack(packed: Any, lengths: np.ndarray, axis: int) -> list[Any]:
    """One view of ``packed`` per row, the ragged axis moved back to ``axis``."""
    ends = np.cumsum(lengths).tolist()
    starts = [0, *ends[:-1]]
    if not axis:
        return [packed[a:b] for a, b in zip(starts, ends)]
    order = [*range(1, axis + 1), 0, *range(axis + 1, packed.ndim)]
    return [packed[a:b].transpose(order) for a, b in zip(starts, ends)]


def segment_max(xp: Any, values: Any, lengths: np.ndarray) -> Any:
    """Per row maximum over axis 0 of a packed array: ``[N, ...]`` -> ``[B, ...]``,
    the dtype's lowest value (-inf for floats) for an empty row. On the host one
    contiguous reduction per row (several times faster than ``np.maximum.reduceat``
    along axis 0); on a GPU one ``cupyx.scatter_max`` for the batch (float32, int32,
    uint32 or uint64, which CUDA's atomics take)."""
    lowest = -np.inf if np.dtype(values.dtype).kind == "f" else np.iinfo(values.dtype).min
    out = xp.full((len(lengths), *values.shape[1:]), lowest, dtype=values.dtype)
    ends = np.cumsum(lengths)
    if xp is np:
        for i, (start, end) in enumerate(zip((ends - lengths).tolist(), ends.tolist())):
            if end > start:
                np.maximum.reduce(values[start:end], axis=0, out=out[i:i + 1], keepdims=True)
        return out
    rows = xp.repeat(xp.arange(len(lengths)), lengths.tolist())
    require("cupyx").scatter_max(out, rows, values)
    return out


def segment_span(xp: Any, values: Any, thresholds: Any, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a packed 1-D array, the positions (within the row) of the first and
    the last value ``>= thresholds[row]``, or -1 for both when none is: host int64
    ``[B]`` arrays."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first = np.full(len(lengths), -1, dtype=np.int64)
    last = np.full(len(lengths), -1, dtype=np.int64)
    if xp is np:
        for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
            above = values[start:end] >= thresholds[i]
            k = int(above.argmax()) if end > start else 0
            if end > start and above[k]:
                first[i], last[i] = k, end - start - 1 - int(above[::-1].argmax())
        return first, last
    hits = xp.flatnonzero(values >= xp.repeat(thresholds, lengths.tolist()))
    hits_end = xp.concatenate([hits, xp.asarray([len(values)])])
    lo = to_host(hits_end[xp.searchsorted(hits, xp.asarray(starts))])  # first hit at or after each start
    hi = to_host(hits_end[xp.maximum(xp.searchsorted(hits, xp.asarray(ends)) - 1, 0)])  # last before each end
    found = (lo < ends) & (hi >= starts) & (len(hits) > 0)
    first[found], last[found] = lo[found] - starts[found], hi[found] - starts[found]
    return first, last


def ragged_axis(rows: Sequence[Any]) -> int:
    """The first axis along which the rows' extents differ (0 when none does): the axis
    to pack them along."""
    return next((a for a in range(rows[0].ndim) if len({r.shape[a] for r in rows}) > 1), 0)


def _axes(axes: tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    """``axes`` of a row with ``ndim`` dimensions, negatives resolved; None: all."""
    return tuple(range(ndim)) if axes is None else tuple(a % ndim for a in axes)


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
        xp, ndim, axes = batch.xp, rows[0].ndim, _axes(self.axes, rows[0].ndim)
        if (xp is np and _audio is not None and ndim == 2 and len(axes) == 1 and not self.batch
                and self.mean is None and self.stddev is None and len({r.shape[1 - axes[0]] for r in rows}) == 1):
            # one C pass per row (the features of "ft" rows over time): the same sums, no temporaries
            x, lengths = pack(np, [r.astype(np.float32, copy=False) for r in rows], axes[0])
            out = empty(np, x.shape, np.float32)
            _audio.normalize(np.ascontiguousarray(x), lengths, x.shape[1], self.ddof, self.epsilon, self.scale,
                             self.shift, out)
            batch.data[self.field] = unpack(out, lengths, axes[0])
            return batch
        # rows are cache-sized blocks: one reduction per row and axis set, no batch-wide temporaries
        x = [r.astype(xp.float32, copy=False) for r in rows]
        counts = [int(np.prod([r.shape[a] for a in axes], dtype=np.int64)) for r in x]
        mean = self._stats(xp, [r.sum(axis=axes, keepdims=True, dtype=xp.float64) for r in x], counts, 0,
                           self.mean)
        if self.stddev is not None:
            inv = [np.float32(self.scale / self.stddev)] * len(x)
        else:
            sq = [xp.square(r - m).sum(axis=axes, keepdims=True, dtype=xp.float64) for r, m in zip(x, mean)]
            var = self._stats(xp, sq, counts, self.ddof, None)
            inv = [xp.where(v + self.epsilon > 0, self.scale / xp.sqrt(xp.maximum(v + self.epsilon, np.float32(1e-30))), 0.0)
                   .astype(xp.float32) for v in var]
        # outputs end to end in one buffer, along the axis the rows differ in
        ragged = ragged_axis(rows)
        lengths = np.array([r.shape[ragged] for r in rows], dtype=np.int64)
        rest = [rows[0].shape[a] for a in range(ndim) if a != ragged]
        out = unpack(empty(xp, (int(lengths.sum()), *rest), np.float32), lengths, ragged)
        for r, m, k, dst in zip(x, mean, inv, out):
            xp.subtract(r, m, out=dst)
            dst *= k
            if self.shift:
                dst += np.float32(self.shift)
        batch.data[self.field] = out
        return batch

    def _stats(self, xp: Any, sums: list[Any], counts: list[int], ddof: int, fixed: float | None) -> list[Any]:
        """Per row ``sum / (count - ddof)`` as float32 (pooled over the batch with
        ``batch=True``), or ``fixed``."""
        if fixed is not None:
            return [np.float32(fixed)] * len(sums)
        if self.batch:
            if len({s.shape for s in sums}) > 1:
                raise ConfigError("normalize_axes(batch=True): rows differ along axes that are not reduced")
            pooled = (sum(sums) / max(sum(counts) - ddof, 1)).astype(xp.float32)
            return [pooled] * len(sums)
        return [(s / max(c - ddof, 1)).astype(xp.float32) for s, c in zip(sums, counts)]


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
        xp, ndim, axes = batch.xp, rows[0].ndim, _axes(self.axes, rows[0].ndim)
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
        out = empty(xp, (len(rows), *target.tolist()), rows[0].dtype)
        for i, r in enumerate(rows):
            out[(i, *(np.s_[:n] for n in r.shape))] = r
            for a, n in enumerate(r.shape):  # the rest of the row's slab: the boxes beyond r along each axis
                out[(i, *(np.s_[:m] for m in r.shape[:a]), np.s_[n:])] = self.fill_value
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
