"""What a ``Loader``'s ops read and make, checked when the loader is made, and the
batch dict whose missing keys say where the data went.

Ops name their input field ``field`` and what they make ``out`` (or ``*_out``), as
``decode_image(field="data", out="image")`` does; the check follows the ops in
order and stops at the first op that names no input (a user's op may make anything).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from gpuio.errors import ConfigError
from gpuio.index import SampleIndex


# Field names that hold encoded images: a webdataset member's extension, a TFRecord
# feature's last part ("image/encoded"), or a plain name.
_IMAGE_NAMES = frozenset({"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "gif", "jp2", "image",
                          "img", "encoded"})
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")


def image_fields(index: SampleIndex, fields: Sequence[str] | None = None) -> list[str]:
    """The fields of ``index`` (among ``fields``, default all) that hold encoded images:
    those named as images are (``jpg``, ``seg.png``, ``image/encoded``), and ``data``
    where the format stores images there (a file tree of image files, COCO, RecordIO), and
    those the format lists in ``index.meta["images"]`` (a packed dataset's images, a Parquet
    ``Image()`` column's ``image.bytes``)."""
    out = []
    named = index.meta.get("images") or ()
    for f in index.fields if fields is None else fields:
        if re.split(r"[/.]", f.lower())[-1] in _IMAGE_NAMES or f in named:
            out.append(f)
        elif f == "data" and f in index.fields:
            kind = index.meta.get("format")
            if kind in ("coco", "recordio") or (
                    kind == "filetree" and len(index.files) and
                    os.path.splitext(index.files[0])[1].lower() in _IMAGE_SUFFIXES):
                out.append(f)
    return out


def flat_ops(ops: Iterable[Any]) -> list[Any]:
    """The ops in the order they run, with ``Compose``-like containers opened."""
    out: list[Any] = []
    for op in ops:
        inner = getattr(op, "ops", None)
        if inner is not None and not isinstance(getattr(op, "field", None), str):
            out.extend(flat_ops(inner))
        else:
            out.append(op)
    return out


def _made(op: Any) -> list[str]:
    names = []
    for attr, value in getattr(op, "__dict__", {}).items():
        if attr == "out" or attr.endswith("_out"):
            names.extend([value] if isinstance(value, str) else [v for v in value or () if isinstance(v, str)])
    return names


def check_op_fields(ops: Sequence[Any], fields: Sequence[str], index: SampleIndex) -> None:
    """Raise ``ConfigError`` naming the op, the field it reads and the fields there
    are, when an op would read a field that neither ``fields`` nor an earlier op gives."""
    have = list(fields)
    decoded: dict[str, int | None] = {}  # field -> channels, of uint8 images a decoder made
    for op in flat_ops(ops):
        field = getattr(op, "field", None)
        if not isinstance(field, str):
            return
        if field in decoded and hasattr(op, "channel_params"):
            _check_normalize(op, field, decoded[field])
        if field not in have:
            name = type(op).__name__
            why = (f"fields={list(fields)} leaves it out" if field in index.fields
                   else f"this index has no field {field!r}")
            raise ConfigError(f"{name} reads field {field!r}, but {why}; the ops get {have} "
                              f"(the index offers {list(index.fields)}). Name one of them with "
                              f"{name}'s field= argument, or list {field!r} in the Loader's fields=")
        have.extend(f for f in _made(op) if f not in have)
        if getattr(op, "host_inputs", ()) and isinstance(getattr(op, "color", None), str):  # an image decoder
            decoded.update(dict.fromkeys(_made(op), _CHANNELS.get(op.color)))


_CHANNELS = {"rgb": 3, "gray": 1}  # an image decoder's color= -> channels ("unchanged": any)


def _check_normalize(op: Any, field: str, channels: int | None) -> None:
    """A normalizing op on decoded uint8 images: its mean/std fit the decoder's channels
    (a ``ConfigError`` now, not at the first batch), and 0-1 values, torchvision's
    units for float images, draw a warning (on 0-255 pixels they give outputs up to
    about 1,100)."""
    if channels is not None:
        try:
            op.channel_params(channels)
        except ConfigError as exc:
            raise ConfigError(f"{type(op).__name__} on {field!r}, decoded with {channels} channel(s): {exc}") from exc
    mean, std = (np.round(np.asarray(getattr(op, name), dtype=np.float64), 4) for name in ("mean", "std"))
    if np.all(np.abs(mean) <= 1) and np.all(std <= 1) and not (np.all(mean == 0) and np.all(std == 1)):
        warnings.warn(f"{type(op).__name__} on {field!r}: mean={mean.tolist()} and std={std.tolist()} look like "
                      f"values for 0-1 images (torchvision's), but {field!r} holds uint8 pixels (0-255): scale "
                      f"them by 255 (e.g. mean=[123.7, 116.3, 103.5], std=[58.4, 57.1, 57.4])",
                      UserWarning, stacklevel=4)


def consumed_fields(ops: Sequence[Any], fields: Sequence[str]) -> dict[str, str]:
    """Encoded fields that a decoder turns into another field, and the other fields it
    reads to do so (a JPEG's restart offsets): ``{field: note}``, the note saying where
    their content went. The loader hands these over only when asked for by name
    (``fields=``)."""
    notes = {}
    for op in flat_ops(ops):
        field, made = getattr(op, "field", None), _made(op)
        if field in fields and getattr(op, "host_inputs", ()) and made and field not in made:
            notes[field] = (f"this batch has no {field!r}: {type(op).__name__} decoded it into {made[0]!r} "
                            f"(batch[{made[0]!r}]); the encoded bytes come too when the Loader's fields= "
                            f"names {field!r}")
            for used in op.host_inputs:
                if used != field and used in fields and used not in made:
                    notes[used] = (f"this batch has no {used!r}: {type(op).__name__} read it to decode {field!r} "
                                   f"into {made[0]!r}; it comes too when the Loader's fields= names {used!r}")
    return notes


class LoaderBatch(dict):
    """One batch as the ``Loader`` yields it: a dict of fields (plus ``index``) whose
    missing keys raise a ``KeyError`` that says where the data went."""

    def __init__(self, data: dict[str, Any], notes: dict[str, str]) -> None:
        super().__init__(data)
        self.notes = notes

    def __missing__(self, key: Any) -> Any:
        if isinstance(key, int):  # DALI's iterators yield a list with one dict per pipeline
            raise KeyError(f"batch[{key}]: a gpuio batch is one dict of fields, not a list of them "
                           f"(as DALI's iterators yield); take its fields directly: {list(self)}")
        raise KeyError(self.notes.get(key, f"this batch has no {key!r}; it has {list(self)}"))

    def __reduce__(self) -> tuple[Any, ...]:  # pickles as a plain dict
        return (dict, (dict(self),))
