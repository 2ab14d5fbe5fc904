"""gpuio.sample.make_image_tree: layout, determinism, the awkward JPEG kinds."""

import hashlib
import os

import numpy as np
from PIL import Image

import gpuio
from gpuio.sample import make_image_tree


def _digest(root):
    h = hashlib.sha256()
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            h.update(name.encode())
            with open(os.path.join(dirpath, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def test_layout_kinds_and_filetree(tmp_path):
    root = make_image_tree(tmp_path / "imgs", count=100, classes=4, seed=3, progress=False)
    assert root == str(tmp_path / "imgs")
    assert sorted(os.listdir(root)) == [f"class_{c:03d}" for c in range(4)]
    assert len(os.listdir(os.path.join(root, "class_001"))) == 25
    modes, progressive, rotated, sizes = [], 0, 0, []
    for dirpath, _, files in os.walk(root):
        for name in files:
            with Image.open(os.path.join(dirpath, name)) as im:
                assert im.format == "JPEG"
                modes.append(im.mode)
                progressive += bool(im.info.get("progressive"))
                rotated += im.getexif().get(0x0112, 1) != 1
                sizes.append(im.size)
                pixels = np.asarray(im.convert("L"), dtype=np.float32)
                # natural-looking: neighbouring pixels are close (not pure noise), yet not flat
                assert np.abs(np.diff(pixels, axis=1)).mean() < 12
                assert pixels.std() > 5
    assert modes.count("L") == 5 and modes.count("CMYK") == 1 and modes.count("RGB") == 94
    assert progressive == 5 and rotated == 2
    w, h = np.array(sizes).T
    assert 300 <= np.median(np.minimum(w, h)) <= 450 and 400 <= np.median(np.maximum(w, h)) <= 600
    index = gpuio.formats.filetree(root)
    assert len(index) == 100 and np.bincount(index.values["label"]).tolist() == [25] * 4


def test_deterministic_per_seed(tmp_path):
    a = make_image_tree(tmp_path / "a", count=30, classes=3, seed=7, progress=False)
    b = make_image_tree(tmp_path / "b", count=30, classes=3, seed=7, progress=False)
    c = make_image_tree(tmp_path / "c", count=30, classes=3, seed=8, progress=False)
    assert _digest(a) == _digest(b) != _digest(c)
