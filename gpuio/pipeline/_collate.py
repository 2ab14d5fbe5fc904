"""A batch as the consumer gets it: its rows collated into arrays, then handed over.

``Collate`` is the loader's last stage (its own CUDA stream on a GPU, part of the last
op's stage on the CPU): a field whose rows are arrays of one shape and dtype becomes one
``[B, ...]`` array on the batch's device; raw bytes and ragged fields stay lists.
``Collate.hand_off`` then gives the batch to the consumer's framework: on a GPU the
consumer's stream first waits for the batch's last event, and its memory goes back only
after that stream is done with it (``gpuio.storage._deferred.hand_over``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from gpuio.device import Device, require
from gpuio.index import Ragged, SampleIndex
from gpuio.pipeline import _frameworks
from gpuio.pipeline._opfields import LoaderBatch
from gpuio.storage._deferred import hand_over
from gpuio.storage._fielddecode import Rows, decoded_fields
from gpuio.storage.buffers import pooled_empty

__all__ = ["Collate", "stack"]


class Collate:
    """Collates a batch's columns (``__call__``) and hands them over (``hand_off``).

    ``sources`` maps the names the batch uses to the index fields they hold; ``notes``
    names the fields a decoder consumed (left out, and explained when asked for)."""

    def __init__(self, index: SampleIndex, sources: dict[str, str], notes: dict[str, str], device: Device,
                 output: str, framework: Any) -> None:
        self.index, self.sources, self.notes, self.device = index, sources, notes, device
        self.output, self.framework = output, framework
        self.raw_fields = set(index.extents) - set(decoded_fields(index))  # bytes, not decoded values

    def __call__(self, work: Any) -> tuple[dict[str, Any], int]:
        """``work.batch``'s columns and ``index`` as the consumer gets them, and its real rows."""
        b = work.batch
        xp = b.xp
        with self._on_device():  # a worker thread's current device is GPU 0 until it says otherwise
            out = {name: self.column(name, col, xp) for name, col in b.data.items() if name not in self.notes}
            index = np.asarray(b.index, dtype=np.int64)
            out["index"] = xp.asarray(index) if self.device.is_cuda else index
        return out, int((index >= 0).sum())

    def _on_device(self) -> Any:
        """The batch's GPU as CuPy's current device, or a null context on the CPU."""
        return require("cupy").cuda.Device(self.device.index) if self.device.is_cuda else contextlib.nullcontext()

    def column(self, name: str, col: Any, xp: Any) -> Any:
        """One column: an array as it is (on the batch's device), scalars and same-shape
        arrays stacked, anything else (raw bytes, ragged fields, strings) a list."""
        cuda = self.device.is_cuda
        if isinstance(col, np.ndarray):
            return xp.asarray(col) if cuda else col
        if not isinstance(col, list) or not col:
            return col
        first = col[0]
        if isinstance(first, np.generic):  # parsed scalars (labels): one array
            if all(type(a) is type(first) for a in col):
                col = np.asarray(col, dtype=first.dtype)
                return xp.asarray(col) if cuda else col
            return col
        if not (isinstance(first, np.ndarray) or hasattr(first, "__cuda_array_interface__")):
            return col
        src = self.sources.get(name, name)
        if isinstance(self.index.values.get(src), Ragged) or (
                src in self.raw_fields and first.ndim == 1 and first.dtype == np.uint8):
            return col  # ragged by nature (boxes, raw bytes): a list, even when a batch's rows agree
        stacked = stack(col, xp)
        if stacked is None:
            return col
        return xp.asarray(stacked) if cuda else stacked

    def hand_off(self, out: dict[str, Any], event: Any) -> LoaderBatch:
        """The collated batch for the consumer, in its framework's tensors (no copies);
        ``event``: the batch's last CUDA event (``None`` on the CPU)."""
        torch = self.framework if self.output == "torch" else None
        if event is not None:  # the consumer's stream waits for the batch's kernels
            cp = require("cupy")
            device = self.device.index
            with cp.cuda.Device(device):
                if torch is not None:
                    consumer = torch.cuda.current_stream(device).cuda_stream
                else:
                    consumer = cp.cuda.get_current_stream().ptr
                cp.cuda.runtime.streamWaitEvent(consumer, event.ptr)
            if self.output in ("jax", "tensorflow"):  # no handle on their streams: the batch is done first
                event.synchronize()
            # the memory goes back only after the consumer's stream is done with it
            out = {name: _hand_over(v, consumer, device, cp) for name, v in out.items()}
        out = {name: _frameworks.convert(v, self.output, self.framework) for name, v in out.items()}
        return LoaderBatch(out, self.notes)


def stack(rows: list[Any], xp: Any) -> Any:
    """``rows`` (arrays) as one ``[B, ...]`` array on their device, or ``None`` where they
    differ in shape, dtype or array type. No copy where they are the rows of one array:
    a ``Rows`` that the ops left as it was read and decoded (no check per row), or arrays
    back to back in row order within one allocation (one view of it). Else a copy; on the
    host into a pooled, page-aligned buffer (JAX takes only 64-byte aligned memory without
    a copy)."""
    whole = rows.stacked() if isinstance(rows, Rows) else None
    if whole is not None:
        return whole
    first = rows[0]
    kind, shape, dtype = type(first), first.shape, first.dtype
    if any(type(a) is not kind or a.shape != shape or a.dtype != dtype for a in rows):
        return None
    xp = np if isinstance(first, np.ndarray) else xp  # host rows of a GPU batch stack on the host
    if _one_allocation(rows, xp):
        return xp.lib.stride_tricks.as_strided(first, shape=(len(rows), *first.shape),
                                               strides=(first.nbytes, *first.strides))
    if xp is np:
        return np.stack(rows, out=pooled_empty((len(rows), *first.shape), first.dtype))
    return xp.stack(rows)


def _one_allocation(rows: list[Any], xp: Any) -> bool:
    """Whether C-contiguous ``rows`` lie back to back in row order in memory that one
    owner holds (NumPy: one ``base``; CuPy: one ``data.mem``). A view built from row 0
    keeps only row 0's owner alive: rows that merely sit next to it in separate
    allocations (CuPy's pool hands consecutive blocks of one size out back to back) are
    freed with their arrays, and the next batch's allocations would overwrite them while
    the consumer reads the view."""
    first = rows[0]
    if not (first.flags.c_contiguous and first.nbytes):
        return False
    if xp is np:
        ptr, owner = (lambda a: a.__array_interface__["data"][0]), (lambda a: a.base)
    else:
        ptr, owner = (lambda a: a.data.ptr), (lambda a: a.data.mem)
    home, start, step = owner(first), ptr(first), first.nbytes
    return home is not None and all(owner(a) is home and a.flags.c_contiguous and ptr(a) == start + i * step
                                    for i, a in enumerate(rows))


def _hand_over(v: Any, stream: int, device: int, cp: Any) -> Any:
    """``v`` (a CuPy array, or a list of values) for the consumer on ``stream``; see
    ``gpuio.storage._deferred.hand_over``."""
    if isinstance(v, cp.ndarray):
        return hand_over(v, stream, device)
    if isinstance(v, list):
        return [hand_over(a, stream, device) if isinstance(a, cp.ndarray) else a for a in v]
    return v
