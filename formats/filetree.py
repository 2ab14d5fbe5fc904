"""File trees: one sample per file, labelled by its class folder.

``root/<class>/<...>/<file>``: classes are the sub-folders of ``root`` in sorted order
and a file's label is its class's position. Samples come exactly as torchvision's
``ImageFolder`` lists them: class by class; within a class, folder by folder in the
sorted order of their paths as strings (so ``sub 2/`` and ``sub-x/`` come between
``sub/`` and ``sub/deeper/``, since ``' ' < '-' < '/'``), and within a folder its files
sorted by name. Names compare as Python strings (code points), upper case first.
Links to folders are followed, as ``ImageFolder`` follows them. Entries at the top
that are not folders are no samples.

Symbolic links that lead nowhere are skipped and counted, never raised as ``OSError``:

- a file-named link that cannot be followed (a dangling link, a link loop) counts in
  ``meta["broken_links"]``; ``ImageFolder`` lists it and fails when it is read;
- a folder that is (a link to) one of its own ancestors (``class/loop -> .``) is not
  entered and counts in ``meta["directory_loops"]``; ``ImageFolder`` recurses into it
  until the system refuses the path (40 links deep), listing each file again at every
  level. A link to a folder that is no ancestor is followed, so its files appear under
  both paths, as in ``ImageFolder``.

Either kind of skip also raises a ``UserWarning`` naming the first entry. A folder that
cannot be listed is a ``StorageError`` (``ImageFolder``'s walk leaves it out unseen), and a
class folder with no files keeps its label number (``ImageFolder`` refuses it).
"""

from __future__ import annotations

import errno
import functools
import heapq
import itertools
import os
import warnings
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpuio.errors import DataError, FormatError, StorageError
from gpuio.formats._files import each_shard, progress
from gpuio.index import UNKNOWN_LENGTH, Extents, PathTable, SampleIndex
from gpuio.storage.remote import RemoteFile, is_url
from gpuio.storage.remote import client as remote_client

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

    def add_unsized(self, prefix: str, names: list[str]) -> None:
        """Files ``prefix + name``, their sizes unknown (``UNKNOWN_LENGTH``)."""
        encoded = [os.fsencode(prefix + name) for name in names]
        ends = itertools.accumulate(map(len, encoded), initial=len(self.blob))
        next(ends)  # the initial value: the end of the files before these
        self.ends.extend(ends)
        self.blob += b"".join(encoded)
        self.sizes.extend(itertools.repeat(UNKNOWN_LENGTH, len(encoded)))

    def __len__(self) -> int:
        return len(self.ends)

    @classmethod
    def joined(cls, parts: list[_Files]) -> _Files:
        """The files of ``parts``, one after another."""
        out = cls()
        for part in parts:
            shift = len(out.blob)
            out.blob += part.blob
            out.ends.frombytes((np.frombuffer(part.ends, dtype=np.int64) + shift).tobytes())
            out.sizes.extend(part.sizes)
        return out

    def table(self, root: str) -> PathTable:
        offsets = np.zeros(len(self.ends) + 1, dtype=np.int64)
        offsets[1:] = np.frombuffer(self.ends, dtype=np.int64)
        return PathTable(np.frombuffer(bytes(self.blob), dtype=np.uint8), offsets, root)


class _Skipped:
    """Relative paths of the entries a walk skipped."""

    def __init__(self) -> None:
        self.broken_links: list[str] = []
        self.directory_loops: list[str] = []


def _class_files(root: str, extensions: tuple[str, ...], root_id: tuple[int, int], cls: str,
                 advance: Callable[[int], None]) -> tuple[_Files, _Skipped]:
    """The files of the class folder ``cls`` and the entries skipped there."""
    files, skipped = _Files(), _Skipped()
    _walk_class(os.path.join(root, cls), cls, extensions, root_id, files, skipped)
    advance(1)
    return files, skipped


def _walk_class(top: str, rel: str, extensions: tuple[str, ...], root_id: tuple[int, int], out: _Files,
                skipped: _Skipped) -> None:
    """Add the files under the class folder ``top`` (``rel`` from the root) in
    ImageFolder's order. A heap keyed by relative path yields the folders in sorted
    path order, since a folder's path sorts before its sub-folders'. Each heap entry
    carries the (device, inode) of the folder and those above it, to refuse loops."""
    heap: list[tuple[str, str, tuple[tuple[int, int], ...]]] = []

    def enter(rel: str, path: str, st: os.stat_result, ancestors: tuple[tuple[int, int], ...]) -> None:
        ident = (st.st_dev, st.st_ino)
        if ident in ancestors:
            skipped.directory_loops.append(rel)
        else:
            heapq.heappush(heap, (rel, path, ancestors + (ident,)))

    enter(rel, top, os.stat(top), (root_id,))
    while heap:
        rel, path, ancestors = heapq.heappop(heap)
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError as exc:
            raise StorageError(f"cannot list directory: {exc.strerror or exc}", path=path) from exc
        # sizes are left to the read (UNKNOWN_LENGTH): a regular file costs no syscall
        # here (the entry's type comes with the listing); only a link is followed, to
        # skip one that leads nowhere
        names, links = [], {}
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows links; a link loop raises ELOOP
            except OSError:
                is_dir = False
            if is_dir:
                enter(f"{rel}/{entry.name}", entry.path, entry.stat(), ancestors)
            elif entry.name.lower().endswith(extensions):
                names.append(entry.name)
                if entry.is_symlink():
                    links[entry.name] = entry
        names.sort()
        if links:
            names = [n for n in names if n not in links or _leads_somewhere(links[n], f"{rel}/{n}", skipped)]
        out.add_unsized(f"{rel}/", names)


def _leads_somewhere(link: os.DirEntry, rel: str, skipped: _Skipped) -> bool:
    try:
        link.stat()
    except OSError:  # a dangling link or a link loop
        skipped.broken_links.append(rel)
        return False
    return True


def filetree(root: str | os.PathLike[str], extensions: Sequence[str] = IMAGE_EXTENSIONS,
             file_list: str | os.PathLike[str] | None = None) -> SampleIndex:
    """Index the files under ``root`` whose names end in one of ``extensions``
    (case-insensitive). Fields: ``data`` (the file's bytes) and ``label`` (int64).

    The walk lists files without a stat() each: their extents have ``UNKNOWN_LENGTH``
    (the whole file, sized when read; ``gpuio.storage.learn_lengths`` fills them in).
    ``file_list``: a text file of ``relative/path label`` lines; it replaces the walk
    and its order and labels are kept as written, and each file is stat'ed for its size
    (a missing one is an error naming the line). An ``s3://`` listing gives sizes too.
    """
    if is_url(os.fspath(root)):
        return _remote_tree(os.fspath(root).rstrip("/"), _extensions(extensions), file_list)
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        raise DataError("not a directory", path=root)
    exts = _extensions(extensions)
    if file_list is not None:
        files = _Files()
        with progress(f"indexing files under {root}", None, "file") as advance:
            labels = _read_file_list(os.fspath(file_list), root, files, advance)
    else:
        classes = _class_folders(root)
        root_st = os.stat(root)
        # class folders are walked on the shard runner, so that large trees use every core
        parts = each_shard(functools.partial(_class_files, root, exts, (root_st.st_dev, root_st.st_ino)), classes,
                           f"indexing files under {root}", [1] * len(classes), unit="folder")
        files = _Files.joined([f for f, _ in parts])
        skipped = _Skipped()
        for _, s in parts:
            skipped.broken_links += s.broken_links
            skipped.directory_loops += s.directory_loops
        labels = np.repeat(np.arange(len(classes), dtype=np.int64), [len(f) for f, _ in parts])
        del parts
    if not len(files):
        where = f"listed in {os.fspath(file_list)}" if file_list is not None else \
            f"with extensions {', '.join(exts)} in class folders"
        raise DataError(f"no samples: found no files {where}", path=root)
    n = len(files)
    extents = Extents(np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int64),
                      np.frombuffer(files.sizes, dtype=np.int64))
    meta: dict[str, object] = {"format": "filetree", "root": root}
    if file_list is None:
        meta.update(classes=classes, broken_links=len(skipped.broken_links),
                    directory_loops=len(skipped.directory_loops))
        for kind, where in (("broken links", skipped.broken_links), ("directory loops", skipped.directory_loops)):
            if where:
                warnings.warn(f"{root}: skipped {len(where)} {kind}, the first {where[0]!r}", stacklevel=2)
    return SampleIndex(files.table(root), {"data": extents}, {"label": labels}, meta=meta)


def _extensions(extensions: Sequence[str]) -> tuple[str, ...]:
    return tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in extensions)


def _remote_tree(root: str, exts: tuple[str, ...], file_list: str | os.PathLike[str] | None) -> SampleIndex:
    """``filetree`` of an ``s3://`` prefix: one listing, then ImageFolder's order (class
    by class; folder by folder in the sorted order of their paths; files by name).
    A class folder is the first part of the keys below the root that have one."""
    objects = {info.url[len(root) + 1:]: info for info in remote_client().list(root + "/")}
    files = _Files()
    if file_list is not None:
        with progress(f"indexing files under {root}", None, "file") as advance:
            labels = _read_file_list(os.fspath(file_list), root, files, advance, sizes=objects)
        classes = None
    else:
        classes = sorted({rel.split("/", 1)[0] for rel in objects if "/" in rel})
        keyed = []
        for rel, info in objects.items():
            if "/" not in rel or rel.endswith("/") or not rel.lower().endswith(exts):
                continue  # a top-level object, a folder marker, another kind of file
            folder, _, name = rel.rpartition("/")
            keyed.append((rel.split("/", 1)[0], folder, name, info.size))
        keyed.sort()
        label_of = {c: k for k, c in enumerate(classes)}
        labels = np.array([label_of[c] for c, *_ in keyed], dtype=np.int64)
        for _, folder, name, size in keyed:
            files.add(f"{folder}/{name}", size)
    if not len(files):
        raise DataError(f"no samples: found no objects with extensions {', '.join(exts)} in class folders",
                        path=root)
    n = len(files)
    table = files.table(root)
    urls = table.many(np.arange(n))
    meta: dict[str, object] = {"format": "filetree", "root": root,
                               "remote": {"etags": [objects[u[len(root) + 1:]].etag for u in urls],
                                          "sizes": np.frombuffer(files.sizes, dtype=np.int64).tolist()}}
    if classes is not None:
        meta.update(classes=classes, broken_links=0, directory_loops=0)
    extents = Extents(np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int64),
                      np.frombuffer(files.sizes, dtype=np.int64))
    return SampleIndex(table, {"data": extents}, {"label": labels}, meta=meta)


def _class_folders(root: str) -> list[str]:
    """Sorted names of the folders (or links to folders) in ``root``."""
    classes = []
    try:
        with os.scandir(root) as it:
            for entry in it:
                try:
                    if entry.is_dir():
                        classes.append(entry.name)
                except OSError:  # a link loop: not a folder
                    pass
    except OSError as exc:
        raise StorageError(f"cannot list directory: {exc.strerror or exc}", path=root) from exc
    return sorted(classes)


def _read_file_list(path: str, root: str, out: _Files, advance: Callable[[int], None],
                    sizes: dict[str, Any] | None = None) -> np.ndarray:
    """Paths and labels of a file list; ``sizes``: the objects of a remote root by
    relative key (their sizes are looked up there instead of stat'ed)."""
    labels = array("q")
    offset = 0  # byte offset of the line, for error messages
    try:
        with (RemoteFile(path) if is_url(path) else open(path, "rb")) as f:
            for lineno, raw in enumerate(f, 1):
                line = raw.decode("utf-8").rstrip("\r\n")
                parts = line.rsplit(None, 1)
                if line.strip():
                    if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                        raise FormatError(f"expected 'path label', got {line!r}", path=path,
                                          sample=f"line {lineno}", offset=offset)
                    full = os.path.join(root, parts[0])
                    try:
                        if sizes is not None:
                            if parts[0] not in sizes:
                                raise FileNotFoundError(errno.ENOENT, "no such object")
                            size = sizes[parts[0]].size
                        else:
                            size = os.stat(full).st_size
                    except OSError as exc:
                        raise StorageError(f"file named on line {lineno} of {path} cannot be read: "
                                           f"{exc.strerror or exc}", path=full) from exc
                    out.add(parts[0], size)
                    labels.append(int(parts[1]))
                    if not len(labels) & 0xFFFF:
                        advance(0x10000)
                offset += len(raw)
    except UnicodeDecodeError as exc:
        raise FormatError(f"file list is not UTF-8: {exc.reason}", path=path, offset=offset + exc.start) from exc
    except StorageError:  # a named file's, naming it
        raise
    except OSError as exc:
        raise StorageError(f"cannot read file list: {exc.strerror or exc}", path=path) from exc
    return np.frombuffer(labels, dtype=np.int64).copy()
