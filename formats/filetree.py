"""File trees: one sample per file, labelled by its class folder.

``root/<class>/<...>/<file>``: classes are the sub-folders of ``root`` in sorted order
and a file's label is its class's position, as torchvision's ``ImageFolder`` and
DALI's file reader number them. Files come in sorted path order.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Sequence

import numpy as np

from gpuio.errors import DataError, FormatError
from gpuio.index import Extents, PathTable, SampleIndex

__all__ = ["filetree", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


class _Files:
    """Relative paths and sizes, packed as they are found (no object per file)."""

    def __init__(self) -> None:
        self.blob = bytearray()
        self.ends = array("q")
        self.sizes = array("q")

    def add(self, name: str, size: int) -> None:
        self.blob += os.fsencode(name)
        self.ends.append(len(self.blob))
        self.sizes.append(size)

    def __len__(self) -> int:
        return len(self.ends)

    def table(self, root: str) -> PathTable:
        offsets = np.zeros(len(self.ends) + 1, dtype=np.int64)
        offsets[1:] = np.frombuffer(self.ends, dtype=np.int64)
        return PathTable(np.frombuffer(bytes(self.blob), dtype=np.uint8), offsets, root)


def _walk(top: str, rel: str, extensions: tuple[str, ...], out: _Files) -> None:
    try:
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as exc:
        raise DataError(f"cannot list directory: {exc.strerror or exc}", path=top) from exc
    for entry in entries:
        name = f"{rel}{entry.name}"
        if entry.is_dir():
            _walk(entry.path, name + "/", extensions, out)
        elif entry.name.lower().endswith(extensions):
            out.add(name, entry.stat().st_size)


def filetree(root: str | os.PathLike[str], extensions: Sequence[str] = IMAGE_EXTENSIONS,
             file_list: str | os.PathLike[str] | None = None) -> SampleIndex:
    """Index the files under ``root`` whose names end in one of ``extensions``
    (case-insensitive). Fields: ``data`` (the file's bytes) and ``label`` (int64).

    ``file_list``: a text file of ``relative/path label`` lines; it replaces the walk
    and its order and labels are kept as written.
    """
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        raise DataError("not a directory", path=root)
    exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)
    files = _Files()
    if file_list is not None:
        labels = _read_file_list(os.fspath(file_list), root, files)
    else:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        class_counts = []
        for cls in classes:
            before = len(files)
            _walk(os.path.join(root, cls), cls + "/", exts, files)
            class_counts.append(len(files) - before)
        labels = np.repeat(np.arange(len(classes), dtype=np.int64), class_counts)
    if not len(files):
        where = f"listed in {os.fspath(file_list)}" if file_list is not None else \
            f"with extensions {', '.join(exts)} in class folders"
        raise DataError(f"no samples: found no files {where}", path=root)
    n = len(files)
    extents = Extents(np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int64),
                      np.frombuffer(files.sizes, dtype=np.int64))
    meta = {"format": "filetree", "root": root}
    if file_list is None:
        meta["classes"] = classes
    return SampleIndex(files.table(root), {"data": extents}, {"label": labels}, meta=meta)


def _read_file_list(path: str, root: str, out: _Files) -> np.ndarray:
    labels = array("q")
    offset = 0  # byte offset of the line, for error messages
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = raw.decode("utf-8").rstrip("\r\n")
                parts = line.rsplit(None, 1)
                if line.strip():
                    if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                        raise FormatError(f"expected 'path label', got {line!r}", path=path,
                                          sample=f"line {lineno}", offset=offset)
                    full = os.path.join(root, parts[0])
                    try:
                        size = os.stat(full).st_size
                    except OSError as exc:
                        raise DataError(f"file named on line {lineno} of {path} cannot be read: "
                                        f"{exc.strerror}", path=full) from exc
                    out.add(parts[0], size)
                    labels.append(int(parts[1]))
                offset += len(raw)
    except UnicodeDecodeError as exc:
        raise FormatError(f"file list is not UTF-8: {exc.reason}", path=path, offset=offset + exc.start) from exc
    except OSError as exc:
        raise DataError(f"cannot read file list: {exc.strerror or exc}", path=path) from exc
    return np.frombuffer(labels, dtype=np.int64).copy()
