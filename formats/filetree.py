"""File trees: one sample per file, labelled by its class folder.

``root/<class>/<...>/<file>``: classes are the sub-folders of ``root`` in sorted order
and a file's label is its class's position, as torchvision's ``ImageFolder`` and
DALI's file reader number them. Files come in sorted path order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from gpuio.errors import DataError, FormatError
from gpuio.index import Extents, PathTable, SampleIndex

__all__ = ["filetree", "IMAGE_EXTENSIONS"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def _walk(top: str, rel: str, extensions: tuple[str, ...], out_names: list[str], out_sizes: list[int]) -> None:
    try:
        entries = sorted(os.scandir(top), key=lambda e: e.name)
    except OSError as exc:
        raise DataError(f"cannot list directory: {exc.strerror or exc}", path=top) from exc
    for entry in entries:
        name = f"{rel}{entry.name}"
        if entry.is_dir():
            _walk(entry.path, name + "/", extensions, out_names, out_sizes)
        elif entry.name.lower().endswith(extensions):
            out_names.append(name)
            out_sizes.append(entry.stat().st_size)


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
    names: list[str] = []
    sizes: list[int] = []
    if file_list is not None:
        labels = _read_file_list(os.fspath(file_list), root, names, sizes)
    else:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        class_counts = []
        for cls in classes:
            before = len(names)
            _walk(os.path.join(root, cls), cls + "/", exts, names, sizes)
            class_counts.append(len(names) - before)
        labels = np.repeat(np.arange(len(classes), dtype=np.int64), class_counts)
    if not names:
        where = f"listed in {os.fspath(file_list)}" if file_list is not None else \
            f"with extensions {', '.join(exts)} in class folders"
        raise DataError(f"no samples: found no files {where}", path=root)
    n = len(names)
    extents = Extents(np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
    meta = {"format": "filetree", "root": root}
    if file_list is None:
        meta["classes"] = classes
    return SampleIndex(PathTable.from_paths(names, root=root), {"data": extents}, {"label": labels}, meta=meta)


def _read_file_list(path: str, root: str, names: list[str], sizes: list[int]) -> np.ndarray:
    labels = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read file list: {exc}", path=path) from exc
    offset = 0
    for lineno, line in enumerate(lines, 1):
        parts = line.rsplit(None, 1)
        if not line.strip():
            offset += len(line) + 1
            continue
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise FormatError(f"expected 'path label', got {line!r}", path=path,
                              sample=f"line {lineno}", offset=offset)
        full = os.path.join(root, parts[0])
        try:
            sizes.append(os.stat(full).st_size)
        except OSError as exc:
            raise DataError(f"file named on line {lineno} of {path} cannot be read: {exc.strerror}",
                            path=full) from exc
        names.append(parts[0])
        labels.append(int(parts[1]))
        offset += len(line) + 1
    return np.asarray(labels, dtype=np.int64)
