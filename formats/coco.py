"""COCO detection datasets: image files plus per-image annotation arrays.

``coco(image_root, annotations)`` reads the annotation JSON once and indexes one sample
per image, **sorted by image id**. Fields:

- ``data``: the image file's bytes (extent ``image_root/file_name``);
- ``boxes``: float32 ``[n, 4]`` per image (``Ragged``), ``xywh`` (COCO's left, top,
  width, height) or ``ltrb`` (left, top, right, bottom), in pixels or, with
  ``normalized=True``, divided by the image width (x) and height (y);
- ``labels``: int32 ``[n]``, category ids numbered ``1..K`` in the order the file's
  ``categories`` list gives them, whatever the ids (DALI's COCO reader's rule: the
  first listed category is 1); ``category_ids``: the raw int64 ids. The index's
  ``meta["category_ids"]`` lists the ids in that order, so label ``l`` is
  ``meta["category_ids"][l - 1]``. An annotation whose category is not listed, and a
  category id listed twice, are errors, since either means a broken file (DALI gives
  the first label 0, and the second its first listing's number, skipping one);
- ``image_id`` (int64), ``width`` and ``height`` (int64, pixels).

Annotations keep their order in the JSON file within an image (the order of
``pycocotools.coco.COCO.getAnnIds(imgIds=[i])``).

Masks (``masks=``) stay compact in the index:

- ``"polygons"``: ``polygons`` int32 ``[p, 3]`` per image, one row per polygon:
  (annotation number within the image, i.e. the row of ``boxes``; first vertex; end
  vertex, exclusive), vertex numbers counting into that image's ``vertices``: float32
  ``[v, 2]`` (x, y), scaled like boxes. This is DALI's polygon layout. Annotations
  whose segmentation is RLE (crowd regions) have no polygons; use ``"pixelwise"``.
- ``"pixelwise"``: every segmentation (polygons or RLE) is converted to one COCO
  compressed RLE at index time: ``mask_rle`` (bytes per image, the annotations'
  RLE ``counts`` strings back to back) and ``mask_rle_sizes`` (int64 ``[n]``, their
  lengths). ``decode_masks(sample)`` turns a sample into uint8 ``[n, H, W]`` masks
  (0/1) at read time; a whole dataset of pixel masks is never held.

A polygon needs an even number of coordinates, at least 4 (two points). A polygon of
two points (a line, no area) is accepted, as DALI and pycocotools accept it: DALI keeps
it in its polygon outputs and pycocotools rasterizes it to no pixels. ``"polygons"``
keeps it as written and ``"pixelwise"`` rasterizes it like pycocotools; with either,
``meta["degenerate_polygons"]`` counts such polygons (0 in a clean file). One rule
differs on purpose: pycocotools' ``frPyObjects`` takes a list whose *first* polygon has
4 numbers for a box ``[x, y, w, h]`` (and then fails), so a polygon's meaning would
depend on its place in the list; gpuio reads every polygon as a polygon.

In object storage, ``annotations`` is an object URL (``s3://``, ``http(s)://``) read by
one GET, and ``image_root`` an ``s3://`` prefix: an image is the object
``image_root/file_name``, its size and ETag from one listing of the prefix.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from gpuio.errors import ConfigError, DataError, FormatError, StorageError
from gpuio.formats._files import full_path, open_regular_file
from gpuio.index import Extents, PathTable, Ragged, SampleIndex
from gpuio.storage.remote import ObjectInfo, is_url
from gpuio.storage.remote import client as remote_client

__all__ = ["coco", "decode_masks"]


def coco(image_root: str | os.PathLike[str], annotations: str | os.PathLike[str], *,
         box_format: str = "xywh", normalized: bool = False, skip_empty: bool = False,
         include_crowd: bool = True, masks: str | None = None) -> SampleIndex:
    """Index a COCO dataset: images under ``image_root``, annotations in the JSON file
    ``annotations``. See the module docstring for the fields and their layouts.

    ``include_crowd=False`` drops ``iscrowd`` annotations; ``skip_empty=True`` then
    drops images left without annotations.
    """
    if box_format not in ("xywh", "ltrb"):
        raise ConfigError(f"box_format {box_format!r}; choose 'xywh' or 'ltrb'")
    if masks not in (None, "polygons", "pixelwise"):
        raise ConfigError(f"masks {masks!r}; choose None, 'polygons' or 'pixelwise'")
    root = full_path(image_root)
    if is_url(root):
        root = root.rstrip("/")
    ann_path = os.fspath(annotations)
    doc = _load_json(ann_path)

    images = _list(doc, "images", ann_path)
    anns = _list(doc, "annotations", ann_path)
    cats = _list(doc, "categories", ann_path)

    # images, sorted by id
    img_ids = np.empty(len(images), dtype=np.int64)
    widths = np.empty(len(images), dtype=np.int64)
    heights = np.empty(len(images), dtype=np.int64)
    names: list[str] = []
    for k, img in enumerate(images):
        where = f"image {k}" if not isinstance(img, dict) or "id" not in img else f"image id {img['id']}"
        img_ids[k] = _int(img, "id", ann_path, where)
        widths[k] = _int(img, "width", ann_path, where)
        heights[k] = _int(img, "height", ann_path, where)
        name = _get(img, "file_name", ann_path, where)
        if not isinstance(name, str):
            raise FormatError(f"{where}: file_name must be a string, got {name!r}", path=ann_path)
        names.append(name)
    order = np.argsort(img_ids, kind="stable")
    img_ids, widths, heights = img_ids[order], widths[order], heights[order]
    names = [names[k] for k in order.tolist()]
    dup = np.flatnonzero(np.diff(img_ids) == 0)
    if dup.size:
        raise FormatError(f"image id {img_ids[dup[0]]} appears twice in 'images'", path=ann_path)

    cat_ids = np.array([_int(c, "id", ann_path, f"category {k}") for k, c in enumerate(cats)], dtype=np.int64)
    cat_order = np.argsort(cat_ids, kind="stable")  # to look ids up; labels follow the file's order
    sorted_cat_ids = cat_ids[cat_order]
    dup = np.flatnonzero(np.diff(sorted_cat_ids) == 0)
    if dup.size:
        raise FormatError(f"category id {sorted_cat_ids[dup[0]]} appears twice in 'categories'", path=ann_path)

    # annotations, as arrays in file order
    n_ann = len(anns)
    ann_ids = np.empty(n_ann, dtype=np.int64)
    ann_img = np.empty(n_ann, dtype=np.int64)
    ann_cat = np.empty(n_ann, dtype=np.int64)
    crowd = np.zeros(n_ann, dtype=bool)
    bbox = np.empty((n_ann, 4), dtype=np.float64)
    for k, a in enumerate(anns):
        where = f"annotation {k}" if not isinstance(a, dict) or "id" not in a else f"annotation id {a['id']}"
        ann_ids[k] = _int(a, "id", ann_path, where)
        ann_img[k] = _int(a, "image_id", ann_path, where)
        ann_cat[k] = _int(a, "category_id", ann_path, where)
        crowd[k] = bool(a.get("iscrowd", 0))
        b = _get(a, "bbox", ann_path, where)
        try:
            if len(b) != 4:
                raise ValueError
            bbox[k] = b
        except (TypeError, ValueError) as exc:
            raise FormatError(f"{where}: bbox must be 4 numbers [x, y, w, h], got {b!r}",
                              path=ann_path) from exc

    row = np.searchsorted(img_ids, ann_img)
    bad = np.flatnonzero((row >= len(img_ids)) | (img_ids[np.minimum(row, len(img_ids) - 1)] != ann_img)
                         if len(img_ids) else np.ones(n_ann, dtype=bool))
    if bad.size:
        k = bad[0]
        raise FormatError(f"annotation id {ann_ids[k]} names image id {ann_img[k]}, which is not in 'images'",
                          path=ann_path)
    found = np.searchsorted(sorted_cat_ids, ann_cat)
    bad = np.flatnonzero((found >= len(cat_ids))
                         | (sorted_cat_ids[np.minimum(found, len(cat_ids) - 1)] != ann_cat)
                         if len(cat_ids) else np.ones(n_ann, dtype=bool))
    if bad.size:
        k = bad[0]
        raise FormatError(f"annotation id {ann_ids[k]} names category id {ann_cat[k]}, which is not in "
                          f"'categories'", path=ann_path)

    keep = np.flatnonzero(~crowd) if not include_crowd else np.arange(n_ann)
    keep = keep[np.argsort(row[keep], kind="stable")]  # by image, file order within an image
    counts = np.bincount(row[keep], minlength=len(img_ids))
    ann_offsets = np.zeros(len(img_ids) + 1, dtype=np.int64)
    np.cumsum(counts, out=ann_offsets[1:])

    boxes = bbox[keep]
    if box_format == "ltrb":
        boxes[:, 2:] += boxes[:, :2]
    if normalized:
        zero = np.flatnonzero((widths <= 0) | (heights <= 0))
        if zero.size:
            raise FormatError(f"image id {img_ids[zero[0]]} has width {widths[zero[0]]} and height "
                              f"{heights[zero[0]]}; normalized=True needs positive sizes", path=ann_path)
        boxes /= np.stack([widths, heights, widths, heights], axis=1)[row[keep]]

    values: dict[str, np.ndarray | Ragged] = {
        "boxes": Ragged(boxes.astype(np.float32), ann_offsets),
        "labels": Ragged((cat_order[found[keep]] + 1).astype(np.int32), ann_offsets),
        "category_ids": Ragged(ann_cat[keep], ann_offsets),
        "image_id": img_ids,
        "width": widths,
        "height": heights,
    }
    meta: dict[str, Any] = {"format": "coco", "root": root, "annotations": full_path(ann_path),
                            "box_format": box_format, "normalized": normalized, "masks": masks,
                            "category_ids": cat_ids.tolist()}
    if masks == "polygons":
        mask_values, meta["degenerate_polygons"] = _polygons(anns, keep, row, ann_offsets, ann_ids, widths,
                                                             heights, normalized, ann_path)
        values.update(mask_values)
    elif masks == "pixelwise":
        mask_values, meta["degenerate_polygons"] = _rles(anns, keep, row, ann_offsets, ann_ids, widths,
                                                         heights, ann_path)
        values.update(mask_values)

    if is_url(root):
        infos = _listed_images(root, names, img_ids)
        sizes = np.array([i.size for i in infos], dtype=np.int64)
        meta["remote"] = {"etags": [i.etag for i in infos], "sizes": sizes.tolist()}
    else:
        sizes = np.empty(len(names), dtype=np.int64)
        for k, name in enumerate(names):
            full = os.path.join(root, name)
            try:
                sizes[k] = os.stat(full).st_size
            except OSError as exc:
                raise StorageError(f"image id {img_ids[k]}: cannot read image file: {exc.strerror or exc}",
                                   path=full) from exc
    n = len(names)
    index = SampleIndex(PathTable.from_paths(names, root=root),
                        {"data": Extents(np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int64), sizes)},
                        values, meta=meta)
    if skip_empty:
        index = index.take(np.flatnonzero(counts))
    if len(index) == 0:
        raise DataError("no samples: no images" + (" with annotations" if skip_empty else ""), path=ann_path)
    return index


def decode_masks(sample: Mapping[str, Any]) -> np.ndarray:
    """Pixel masks of one sample of a ``masks="pixelwise"`` index (``index[i]``):
    uint8 ``[n, height, width]``, 1 inside annotation ``j`` (row ``j`` of ``boxes``)."""
    from pycocotools import mask as cmask

    h, w = int(sample["height"]), int(sample["width"])
    sizes = np.asarray(sample["mask_rle_sizes"], dtype=np.int64)
    if not sizes.size:
        return np.zeros((0, h, w), dtype=np.uint8)
    blob = bytes(sample["mask_rle"])
    ends = np.cumsum(sizes).tolist()
    rles = [{"size": [h, w], "counts": blob[s:e]} for s, e in zip([0, *ends[:-1]], ends)]
    return np.ascontiguousarray(cmask.decode(rles).transpose(2, 0, 1))


# ---- helpers ---------------------------------------------------------------------------

def _listed_images(root: str, names: list[str], img_ids: np.ndarray) -> list[ObjectInfo]:
    """The objects ``root/name`` of the images, from one listing of the prefix ``root``;
    an image with no object is a ``StorageError`` naming its URL."""
    objects = {info.url: info for info in remote_client().list(root + "/")}
    out = []
    for k, name in enumerate(names):
        info = objects.get(f"{root}/{name}")
        if info is None:
            raise StorageError(f"image id {img_ids[k]}: no such object in the listing of {root}/",
                               path=f"{root}/{name}")
        out.append(info)
    return out


def _load_json(path: str) -> dict[str, Any]:
    if is_url(path):  # one GET of the whole object
        f, _ = open_regular_file(path, "annotation file")
        with f:
            raw = f.read()
    else:
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except OSError as exc:
            raise StorageError(f"cannot read annotation file: {exc.strerror or exc}", path=path) from exc
    try:
        text = raw.decode("utf-8")
        doc = json.loads(text)
    except UnicodeDecodeError as exc:
        raise FormatError(f"annotation file is not UTF-8: {exc.reason}", path=path, offset=exc.start) from exc
    except json.JSONDecodeError as exc:
        raise FormatError(f"invalid JSON: {exc.msg} (line {exc.lineno} column {exc.colno})", path=path,
                          offset=len(text[:exc.pos].encode("utf-8"))) from exc
    except RecursionError as exc:
        raise FormatError("invalid JSON: nested too deeply", path=path) from exc
    if not isinstance(doc, dict):
        raise FormatError(f"expected a JSON object with 'images', 'annotations' and 'categories', "
                          f"got {type(doc).__name__}", path=path, offset=0)
    return doc


def _list(doc: dict[str, Any], key: str, path: str) -> list[Any]:
    if key not in doc:
        raise FormatError(f"missing top-level key {key!r} (a COCO file has 'images', 'annotations' "
                          f"and 'categories')", path=path)
    if not isinstance(doc[key], list):
        raise FormatError(f"{key!r} must be a list, got {type(doc[key]).__name__}", path=path)
    return doc[key]


def _get(obj: Any, key: str, path: str, where: str) -> Any:
    if not isinstance(obj, dict):
        raise FormatError(f"{where}: expected a JSON object, got {type(obj).__name__}", path=path)
    if key not in obj:
        raise FormatError(f"{where}: missing key {key!r}", path=path)
    return obj[key]


def _int(obj: Any, key: str, path: str, where: str) -> int:
    v = _get(obj, key, path, where)
    if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
        raise FormatError(f"{where}: {key!r} must be an integer, got {v!r}", path=path)
    return int(v)


def _segmentation(a: Any, path: str, ann_id: int) -> Any:
    seg = a.get("segmentation")
    if seg is None:
        raise FormatError(f"annotation id {ann_id}: missing key 'segmentation' (needed for masks)", path=path)
    return seg


def _polygon_list(seg: Any, path: str, ann_id: int) -> list[np.ndarray]:
    """The polygons of a list-of-polygons segmentation as float64 [v, 2] arrays, v >= 2."""
    out = []
    for poly in seg:
        try:
            xy = np.asarray(poly, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"annotation id {ann_id}: a polygon must be a list of numbers", path=path) from exc
        if xy.ndim != 1 or xy.size % 2 or xy.size < 4:
            raise FormatError(f"annotation id {ann_id}: a polygon needs an even number (>= 4) of "
                              f"coordinates x0, y0, x1, y1, ...; got {xy.size}", path=path)
        out.append(xy.reshape(-1, 2))
    return out


def _polygons(anns: list[Any], keep: np.ndarray, row: np.ndarray, ann_offsets: np.ndarray,
              ann_ids: np.ndarray, widths: np.ndarray, heights: np.ndarray, normalized: bool,
              path: str) -> tuple[dict[str, Ragged], int]:
    """DALI's polygon layout and the number of two-point polygons."""
    verts: list[np.ndarray] = []
    poly_ann: list[int] = []  # position of the polygon's annotation in `keep`
    for pos, k in enumerate(keep.tolist()):
        seg = _segmentation(anns[k], path, int(ann_ids[k]))
        if isinstance(seg, dict):  # RLE: no polygons
            continue
        if not isinstance(seg, list):
            raise FormatError(f"annotation id {ann_ids[k]}: segmentation must be a list of polygons or an "
                              f"RLE object", path=path)
        for xy in _polygon_list(seg, path, int(ann_ids[k])):
            verts.append(xy)
            poly_ann.append(pos)
    n_img = len(ann_offsets) - 1
    poly_ann_a = np.asarray(poly_ann, dtype=np.int64)
    nv = np.fromiter((len(v) for v in verts), dtype=np.int64, count=len(verts))
    vertices = np.concatenate(verts) if verts else np.zeros((0, 2))
    poly_img = row[keep][poly_ann_a]
    if normalized:
        vertices = vertices / np.stack([widths, heights], axis=1)[np.repeat(poly_img, nv)]
    vstart = np.zeros(len(nv) + 1, dtype=np.int64)
    np.cumsum(nv, out=vstart[1:])
    poly_offsets = np.zeros(n_img + 1, dtype=np.int64)
    np.cumsum(np.bincount(poly_img, minlength=n_img), out=poly_offsets[1:])
    vert_offsets = np.zeros(n_img + 1, dtype=np.int64)
    np.cumsum(np.bincount(poly_img, weights=nv, minlength=n_img).astype(np.int64), out=vert_offsets[1:])
    base = vert_offsets[poly_img]
    table = np.stack([poly_ann_a - ann_offsets[poly_img], vstart[:-1] - base, vstart[1:] - base],
                     axis=1).astype(np.int32)
    return ({"polygons": Ragged(table.reshape(-1, 3), poly_offsets),
             "vertices": Ragged(vertices.astype(np.float32).reshape(-1, 2), vert_offsets)},
            int(np.count_nonzero(nv == 2)))


def _check_compressed_rle(counts: str, total: int, path: str, ann_id: int) -> None:
    """Check a compressed RLE string (COCO's 6-bit variable-length encoding of run
    lengths, the third and later stored as differences) before pycocotools decodes
    it: its C decoder writes runs without bounds checks."""
    runs: list[int] = []
    x = k = 0
    for ch in counts:
        c = ord(ch) - 48
        if not 0 <= c < 64:
            raise FormatError(f"annotation id {ann_id}: compressed RLE has a character {ch!r} outside '0'..'o'",
                              path=path)
        x |= (c & 0x1F) << (5 * k)
        k += 1
        if c & 0x20:
            continue
        if c & 0x10:
            x -= 1 << (5 * k)
        if len(runs) > 2:
            x += runs[-2]
        if x < 0:
            raise FormatError(f"annotation id {ann_id}: compressed RLE decodes to a negative run", path=path)
        runs.append(x)
        x = k = 0
    if k or sum(runs) != total:
        raise FormatError(f"annotation id {ann_id}: compressed RLE covers {sum(runs)} pixels, the image has "
                          f"{total}", path=path)


def _rles(anns: list[Any], keep: np.ndarray, row: np.ndarray, ann_offsets: np.ndarray, ann_ids: np.ndarray,
          widths: np.ndarray, heights: np.ndarray, path: str) -> tuple[dict[str, Ragged], int]:
    """Compressed RLE strings and the number of two-point polygons."""
    from pycocotools import mask as cmask

    strings: list[bytes] = []
    degenerate = 0
    for k in keep.tolist():
        ann_id = int(ann_ids[k])
        seg = _segmentation(anns[k], path, ann_id)
        h, w = int(heights[row[k]]), int(widths[row[k]])
        if isinstance(seg, list):
            polys = _polygon_list(seg, path, ann_id)
            degenerate += sum(len(xy) == 2 for xy in polys)
            # a repeated last vertex rasterizes alike and keeps frPyObjects from taking
            # a 4-number first polygon for a box
            polys = [(np.vstack([xy, xy[-1:]]) if len(xy) == 2 else xy).ravel().tolist() for xy in polys]
            rle = cmask.merge(cmask.frPyObjects(polys, h, w)) if polys else cmask.encode(
                np.zeros((h, w, 1), dtype=np.uint8, order="F"))[0]
        elif isinstance(seg, dict) and isinstance(seg.get("counts"), (list, str)) and seg.get("size") == [h, w]:
            counts = seg["counts"]
            if isinstance(counts, list):
                if not all(isinstance(c, int) and c >= 0 for c in counts) or sum(counts) != h * w:
                    raise FormatError(f"annotation id {ann_id}: uncompressed RLE counts must be "
                                      f"non-negative integers summing to height*width = {h * w}", path=path)
                rle = cmask.frPyObjects(seg, h, w)
            else:
                _check_compressed_rle(counts, h * w, path, ann_id)
                rle = {"size": [h, w], "counts": counts.encode("ascii")}
        else:
            raise FormatError(f"annotation id {ann_id}: segmentation must be a list of polygons or an RLE "
                              f"object {{'size': [{h}, {w}], 'counts': ...}}", path=path)
        strings.append(rle["counts"])
    sizes = np.fromiter((len(s) for s in strings), dtype=np.int64, count=len(strings))
    blob = np.frombuffer(b"".join(strings), dtype=np.uint8).copy()
    cum = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=cum[1:])
    return ({"mask_rle": Ragged(blob, cum[ann_offsets], "bytes"),
             "mask_rle_sizes": Ragged(sizes, ann_offsets)}, degenerate)
