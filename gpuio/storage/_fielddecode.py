"""Field decoders: the bytes of an extent field turned into values right after the read.

A format names them in ``index.meta["decode"]`` (``{field: decoder}``, saved with the
index). ``gpuio.storage.read_fields`` applies them, so ``index[i]`` and the Loader see
values; ``gpuio.read`` keeps returning the raw bytes. Decoders:

- ``"array"``: the bytes are one array whose shape (int64 ``Ragged``), dtype (a NumPy
  header ``descr`` string) and ``fortran_order`` (bool) are the index's value fields of
  those names (``formats.numpy``). The bytes are viewed in place, on the device they
  were read to (CuPy on a GPU: no copy through the host); a view whose address does not
  suit the dtype's alignment is first copied on that device (entered explicitly: CuPy
  copies to the current device).
- ``"int"`` (``int(bytes)``, as ``np.int64``), ``"str"`` (UTF-8), ``"json"``, ``"npy"``
  (``np.load`` without pickles) and ``"npz"`` (a dict of arrays): on the host, as the
  webdataset package's default decoders.
"""

from __future__ import annotations

import ast
import functools
import io
import json
import math
import operator
import zipfile
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuio.device import require
from gpuio.errors import ConfigError, FormatError

__all__ = ["DECODERS", "Rows", "decoded_fields", "host_decoded_fields", "decode", "descr_dtype"]


class Rows(list):
    """A list of the rows of one array ``whole`` of 2 or more dimensions (``list(whole)``: views), so that a
    batch stacks them with no copy and no check per row; see ``stacked``."""

    def __init__(self, whole: Any) -> None:
        super().__init__(whole)
        self.whole = whole
        self._made = tuple(self)

    def stacked(self) -> Any:
        """``whole``, if the list still holds the rows it was made with, in that order
        (an op may have replaced or reordered some); else ``None``."""
        same = len(self) == len(self._made) and all(map(operator.is_, self, self._made))
        return self.whole if same else None


def _int(data: bytes) -> np.int64:
    value = int(data)
    if not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"{value} does not fit in int64")
    return np.int64(value)


def _npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


_HOST: dict[str, Callable[[bytes], Any]] = {
    "int": _int,
    "str": lambda data: data.decode("utf-8"),
    "json": json.loads,
    "npy": lambda data: np.lib.format.read_array(io.BytesIO(data), allow_pickle=False),
    "npz": _npz,
}
DECODERS = ("array", *_HOST)
# what a malformed value raises in the decoders above
_BAD_VALUE = (ValueError, TypeError, UnicodeDecodeError, EOFError, OverflowError, zipfile.BadZipFile,
              RecursionError, MemoryError)


def decoded_fields(index: Any) -> dict[str, str]:
    """``{field: decoder}`` of an index (empty when its bytes are all raw)."""
    table = index.meta.get("decode") or {}
    bad = {f: d for f, d in table.items() if d not in DECODERS or f not in index.extents}
    if bad:
        raise ConfigError(f"index meta 'decode' names {bad}; decoders apply to extent fields "
                          f"{list(index.extents)} and are one of {DECODERS}")
    return dict(table)


def host_decoded_fields(index: Any) -> tuple[str, ...]:
    """Decoded fields whose bytes must be read into host memory."""
    return tuple(f for f, d in decoded_fields(index).items() if d != "array")


@functools.lru_cache(maxsize=256)
def descr_dtype(descr: str) -> np.dtype:
    """The dtype of a NumPy header ``descr`` as text (``'<f4'`` or a list of fields),
    built as ``np.load`` builds it (padding entries named ``''`` are not fields)."""
    return np.lib.format.descr_to_dtype(ast.literal_eval(descr) if descr.startswith("[") else descr)


def decode(index: Any, field: str, rows: np.ndarray, raw: Any, *, stacked: bool = False) -> Any:
    """Decode ``raw``, the bytes of ``field`` for samples ``rows``: one uint8 array
    each, or one ``[B, n]`` uint8 array of the rows back to back. With ``stacked``,
    arrays of one shape and dtype come back as that ``[B, ...]`` view, not as its rows."""
    decoder = decoded_fields(index)[field]
    if decoder == "array":
        return _arrays(index, field, rows, raw, stacked)
    fn = _HOST[decoder]
    out = []
    for j, data in enumerate(raw):
        host = data if isinstance(data, np.ndarray) else data.get()  # a CuPy row: gpuio.read on a GPU
        try:
            out.append(fn(host.tobytes()))
        except _BAD_VALUE as exc:
            raise _error(index, field, rows, j, f"cannot decode {field!r} as {decoder}: {exc}") from exc
    return out


def _arrays(index: Any, field: str, rows: np.ndarray, raw: Any, stacked: bool) -> Any:
    whole = raw if not isinstance(raw, list) else raw.stacked() if isinstance(raw, Rows) else None
    if whole is not None and len(rows) and _same_value(index.values["shape"], rows) and (
            _same_value(index.values["dtype"], rows) and not np.asarray(index.values["fortran_order"])[rows].any()):
        shape = tuple(index.values["shape"][int(rows[0])].tolist())
        view = _stacked_array(whole, shape, descr_dtype(index.values["dtype"][int(rows[0])]))
        if view is not None and shape:  # rows of a 1-D array would be scalars, not 0-d arrays
            return view if stacked else Rows(view)
    shapes = index.values["shape"].rows(rows)
    descrs = index.values["dtype"].rows(rows)
    fortran = np.asarray(index.values["fortran_order"])[rows].tolist()
    out = []
    for j, (data, shape, descr, f_order) in enumerate(zip(raw, shapes, descrs, fortran)):
        dtype = descr_dtype(descr)
        on_host = isinstance(data, np.ndarray)
        if not on_host and (dtype.kind not in "biufc" or not dtype.isnative):
            raise _error(index, field, rows, j, f"dtype {descr} has no GPU array type (CuPy takes native-order "
                                                f"bool, int, float and complex); read it with device='cpu'")
        address = data.__array_interface__["data"][0] if on_host else data.data.ptr
        if address % dtype.alignment:
            data = np.copy(data) if on_host else _device_copy(data)
        out.append(data.view(dtype).reshape(tuple(shape.tolist()), order="F" if f_order else "C"))
    return out


def _device_copy(data: Any) -> Any:
    """A copy of the CuPy array ``data`` on its own GPU. CuPy copies to the current
    device, and on a reader's thread that is GPU 0, whichever GPU the read was for."""
    cp = require("cupy")
    with cp.cuda.Device(data.device.id):
        return data.copy()


def _same_value(col: Any, rows: np.ndarray) -> bool:
    """Whether the ``Ragged`` column ``col`` holds one value for all of ``rows``."""
    return col.uniform or col.take(rows).uniform


def _stacked_array(whole: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """``whole``, ``[B, nbytes]`` uint8 rows of C-order arrays, as one ``[B, *shape]``
    view of ``dtype``; ``None`` where the rows' addresses do not suit the dtype (the
    per-row path copies those or reports them) or it has no GPU array type."""
    on_host = isinstance(whole, np.ndarray)
    address = whole.__array_interface__["data"][0] if on_host else whole.data.ptr
    row_bytes = whole.shape[1]
    if (row_bytes != dtype.itemsize * math.prod(shape) or address % dtype.alignment or row_bytes % dtype.alignment
            or (not on_host and (dtype.kind not in "biufc" or not dtype.isnative))):
        return None
    return whole.view(dtype).reshape((len(whole), *shape))


def _error(index: Any, field: str, rows: np.ndarray, j: int, message: str) -> FormatError:
    ext = index.extents[field]
    s = int(rows[j])
    return FormatError(message, path=index.files[ext.file[s]], offset=int(ext.offset[s]), sample=s)
