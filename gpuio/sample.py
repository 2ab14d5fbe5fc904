"""A small ImageNet-like dataset of JPEGs for tests and benchmarks.

``make_image_tree(root)`` writes ``root/<class>/<n>.jpg``: natural-looking pictures
(smooth colour fields, a few shapes, sensor-like noise) of about 500x375 pixels, quality
85-95, with the awkward cases a real crawl has: grayscale (~5%), progressive (~5%),
CMYK and EXIF-rotated JPEGs (a few each). The same ``seed`` writes the same bytes.
"""

from __future__ import annotations

import io
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["make_coco", "make_image_tree", "sample_image"]

_KINDS = ("plain", "gray", "progressive", "cmyk", "exif")


def sample_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """One natural-looking RGB picture, HWC uint8: a smooth colour field from a coarse
    random grid, a few filled shapes, and Gaussian noise."""
    grid = rng.integers(0, 256, size=(int(rng.integers(2, 6)), int(rng.integers(2, 6)), 3), dtype=np.uint8)
    img = Image.fromarray(grid).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(2, 7))):
        x0, x1 = np.sort(rng.integers(0, width, 2))
        y0, y1 = np.sort(rng.integers(0, height, 2))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.ellipse((int(x0), int(y0), int(x1), int(y1)), fill=color)
        else:
            draw.rectangle((int(x0), int(y0), int(x1), int(y1)), fill=color)
    pixels = np.asarray(img, dtype=np.int16)
    noise = rng.normal(0.0, float(rng.uniform(2.0, 8.0)), size=(height, width, 1)).astype(np.int16)
    return np.clip(pixels + noise, 0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, kind: str, quality: int, orientation: int) -> bytes:
    img = Image.fromarray(pixels)
    opts: dict = {"quality": quality}
    if kind == "gray":
        img = img.convert("L")
    elif kind == "cmyk":
        img = img.convert("CMYK")
    elif kind == "progressive":
        opts["progressive"] = True
    elif kind == "exif":
        exif = Image.Exif()
        exif[0x0112] = orientation
        opts["exif"] = exif.tobytes()
    buf = io.BytesIO()
    img.save(buf, "JPEG", **opts)
    return buf.getvalue()


def make_image_tree(root: str | os.PathLike[str], count: int = 1000, classes: int = 10, seed: int = 0,
                    progress: bool = True) -> str:
    """Write ``count`` JPEGs into ``root/class_XXX/NNNNNN.jpg`` (image ``i`` in class
    ``i % classes``) and return ``root``. Sizes vary around 500x375 pixels; ~5% are
    grayscale, ~5% progressive, ~1% CMYK (at least one when ``count >= 20``) and ~2%
    carry an EXIF orientation other than 1 (at least one when ``count >= 20``)."""
    root = os.fspath(root)
    count, classes = int(count), int(classes)
    if count < 0 or classes < 1:
        from gpuio.errors import ConfigError

        raise ConfigError(f"count must be >= 0 and classes >= 1, got count={count} classes={classes}")
    rng = np.random.default_rng(seed)
    kinds = np.zeros(count, dtype=np.int8)
    order = rng.permutation(count)
    few = 1 if count >= 20 else 0
    n_gray, n_prog = count // 20, count // 20
    n_cmyk, n_exif = max(few, count // 100), max(few, count // 50)
    start = 0
    for k, n in enumerate((n_gray, n_prog, n_cmyk, n_exif), start=1):
        kinds[order[start:start + n]] = k
        start += n
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class_{c:03d}"), exist_ok=True)

    def write(i: int) -> None:
        r = np.random.default_rng([seed, i])
        h, w = int(r.integers(300, 451)), int(r.integers(400, 601))
        if r.random() < 0.3:
            h, w = w, h
        data = _encode(sample_image(r, h, w), _KINDS[kinds[i]], int(r.integers(85, 96)),
                       int(r.choice([3, 6, 8, 2, 5, 7, 4])))
        with open(os.path.join(root, f"class_{i % classes:03d}", f"{i // classes:06d}.jpg"), "wb") as f:
            f.write(data)

    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        results = pool.map(write, range(count))
        if progress:
            from tqdm import tqdm

            results = tqdm(results, total=count, desc="images", unit="img")
        for _ in results:
            pass
    return root


COCO_SIZES = ((480, 640), (640, 480), (427, 640), (512, 512))  # (h, w) as COCO's images are


def make_coco(root: str | os.PathLike[str], count: int, size: tuple[int, int] | None = None, seed: int = 0,
              categories: int = 20) -> tuple[str, str]:
    """A COCO-style dataset: ``count`` JPEGs (``size`` (h, w), or COCO-like sizes) with
    1-8 boxes each, every box a flat rectangle painted on the image, in
    ``root/images``, and ``root/instances.json``. Returns (image root, annotation file)."""
    root = os.fspath(root)
    images_dir = os.path.join(root, "images")
    os.makedirs(images_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    images, anns = [], []
    for k in range(count):
        h, w = size or COCO_SIZES[k % len(COCO_SIZES)]
        img = sample_image(rng, h, w)
        for _ in range(int(rng.integers(1, 9))):
            bw, bh = (rng.uniform(0.05, 0.6, 2) * (w, h)).astype(int) + 2
            x, y = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
            img[y:y + bh, x:x + bw] = rng.integers(0, 256, 3)
            anns.append({"id": len(anns) + 1, "image_id": k + 1, "category_id": int(rng.integers(1, categories + 1)),
                         "bbox": [x, y, int(bw), int(bh)], "area": float(bw * bh), "iscrowd": 0})
        name = f"{k:06d}.jpg"
        Image.fromarray(img).save(os.path.join(images_dir, name), quality=90)
        images.append({"id": k + 1, "file_name": name, "width": w, "height": h})
    doc = {"images": images, "annotations": anns,
           "categories": [{"id": c, "name": f"class{c}"} for c in range(1, categories + 1)]}
    ann_path = os.path.join(root, "instances.json")
    with open(ann_path, "w") as f:
        json.dump(doc, f)
    return images_dir, ann_path
