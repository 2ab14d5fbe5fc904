"""NumPy ``.npy`` files: one sample per file, the extent pointing at the array bytes.

Only the header is read at index time (versions 1.0, 2.0 and 3.0; its ``descr`` read
by NumPy's own ``descr_to_dtype``, so padded structured dtypes come out as ``np.load``
makes them). After a read the bytes are viewed as the stored array (the index's field
decoder ``"array"``, ``gpuio.storage._fielddecode``): on a GPU they land in device memory and
are viewed there, with no copy through the host.
"""

from __future__ import annotations

import ast
import os
import struct
from collections.abc import Sequence

import numpy as np

from gpuio.errors import DataError, FormatError, StorageError
from gpuio.formats._files import has_pattern, open_regular_file, shard_paths
from gpuio.storage.remote import client as remote_client
from gpuio.storage.remote import is_http, is_url, object_versions
from gpuio.index import Extents, PathTable, Ragged, SampleIndex

__all__ = ["numpy", "parse_npy_header"]

_MAGIC = b"\x93NUMPY"


def parse_npy_header(head: bytes, path: str) -> tuple[np.dtype, tuple[int, ...], bool, int]:
    """``(dtype, shape, fortran_order, data_offset)`` from the first bytes of a .npy."""
    if len(head) < 10 or not head.startswith(_MAGIC):
        raise FormatError(f"not a .npy file: bad magic {head[:6]!r}, expected {_MAGIC!r}", path=path, offset=0)
    major = head[6]
    if major == 1:
        (hlen,), start = struct.unpack("<H", head[8:10]), 10
    elif major in (2, 3):
        if len(head) < 12:
            raise FormatError("truncated .npy header", path=path, offset=len(head))
        (hlen,), start = struct.unpack("<I", head[8:12]), 12
    else:
        raise FormatError(f"unsupported .npy version {major}.{head[7]}", path=path, offset=6)
    if len(head) < start + hlen:
        raise FormatError(f"truncated .npy header: {hlen} header bytes announced, "
                          f"{len(head) - start} present", path=path, offset=len(head))
    text = head[start: start + hlen]
    try:
        header = ast.literal_eval(text.decode("utf-8" if major == 3 else "latin1"))
        dtype = np.lib.format.descr_to_dtype(header["descr"])
        shape = tuple(int(d) for d in header["shape"])
        fortran = bool(header["fortran_order"])
    except (ValueError, SyntaxError, KeyError, IndexError, TypeError, UnicodeDecodeError, MemoryError,
            RecursionError) as exc:
        raise FormatError(f"malformed .npy header {text[:80]!r}: {exc}", path=path, offset=start) from exc
    if any(d < 0 for d in shape) or dtype.hasobject or dtype.subdtype is not None or not dtype.itemsize:
        raise FormatError(f"unsupported .npy array: shape {shape}, dtype {dtype}", path=path, offset=start)
    return dtype, shape, fortran, start + hlen


def numpy(root_or_files: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
          rows: slice | None = None) -> SampleIndex:
    """Index ``.npy`` files: a directory (searched recursively, sorted) or a list.

    Field ``data`` is the array as ``np.load`` gives it: its stored dtype, shape and
    order (a Fortran-order file gives a Fortran-order array), a view of the bytes read
    (NumPy on the CPU, CuPy on a GPU). ``shape`` (int64), ``dtype`` (the header's
    ``descr``: ``'<f4'``, or a list of fields as text) and ``fortran_order`` (bool)
    describe it. ``gpuio.read(index, rows)`` gives the raw bytes instead. In a
    ``Loader`` batch, arrays of one shape and dtype stack into one ``[B, ...]``
    array (C order). ``rows=slice(a, b)`` keeps only those rows of the leading axis of
    each C-order array, so only their bytes are read.
    """
    if isinstance(root_or_files, (str, os.PathLike)):
        root = os.fspath(root_or_files)
        if is_url(root) and not is_http(root) and not root.endswith(".npy") and not has_pattern(root):  # a prefix
            paths = sorted(i.url for i in remote_client().list(root.rstrip("/") + "/") if i.url.endswith(".npy"))
            if not paths:
                raise DataError("no samples: found no .npy objects under this prefix", path=root)
        elif os.path.isdir(root):
            paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".npy"))
            if not paths:
                raise DataError("no samples: found no .npy files", path=root)
        else:
            paths = shard_paths(root, ".npy file")
    else:
        paths = shard_paths(root_or_files, ".npy file")
        if not paths:
            raise DataError("no samples: an empty list of .npy files was given")
    offsets, lengths, shapes, dtypes, fortran_order = [], [], [], [], []
    for path in paths:
        f, size = open_regular_file(path, ".npy file")
        try:
            with f:
                head = f.read(4096)
                if len(head) >= 12 and head.startswith(_MAGIC) and head[6] in (1, 2, 3):
                    need = (10 + struct.unpack("<H", head[8:10])[0] if head[6] == 1
                            else 12 + struct.unpack("<I", head[8:12])[0])
                    if need > len(head):
                        head += f.read(need - len(head))
        except OSError as exc:
            raise StorageError(f"cannot read: {exc.strerror or exc}", path=path) from exc
        dtype, shape, fortran, start = parse_npy_header(head, path)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if rows is not None:
            if fortran or not shape:
                raise FormatError("rows= needs a C-order array with at least one axis", path=path, offset=0)
            lo, hi, step = rows.indices(shape[0])
            if step != 1:
                raise FormatError(f"rows= takes a contiguous slice, got step {step}", path=path)
            row_bytes = nbytes // shape[0] if shape[0] else 0
            shape = (max(0, hi - lo), *shape[1:])
            start, nbytes = start + lo * row_bytes, max(0, hi - lo) * row_bytes
        if start + nbytes > size:
            raise FormatError(f"array of {nbytes} bytes at byte {start} runs past the end of the "
                              f"file ({size} bytes)", path=path, offset=size)
        offsets.append(start)
        lengths.append(nbytes)
        shapes.append(shape)
        dtypes.append(dtype.str if dtype.names is None else str(np.lib.format.dtype_to_descr(dtype)))
        fortran_order.append(fortran)
    n = len(paths)
    extents = Extents(np.arange(n, dtype=np.int32), np.asarray(offsets), np.asarray(lengths))
    values = {"shape": Ragged.from_list(shapes, dtype=np.int64), "dtype": Ragged.from_list(dtypes, kind="str"),
              "fortran_order": np.asarray(fortran_order, dtype=bool)}
    return SampleIndex(PathTable.from_paths(paths), {"data": extents}, values,
                       meta={"format": "numpy", "decode": {"data": "array"}, **object_versions(paths)})
