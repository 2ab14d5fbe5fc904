"""Every format's extents, read on the CPU and into GPU memory (kvikio where installed),
equal the bytes that plain file reads find there. LMDB, TFRecord and RecordIO have the
same check in their own test files."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from PIL import Image

from gpuio import formats

from checkers import assert_read_matches_files


def _jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (24, 32, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG")
    return buf.getvalue()


def _filetree(root):
    for i in range(9):
        (root / f"c{i % 3}").mkdir(exist_ok=True)
        (root / f"c{i % 3}" / f"{i}.jpg").write_bytes(_jpeg(i))
    return formats.filetree(root), "data"


def _numpy(root):
    for i in range(7):
        np.save(root / f"{i}.npy", np.arange(i * 100, dtype=np.float32).reshape(-1, 4)[: i * 5])
    return formats.numpy(root), "data"


def _coco(root):
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 32, "height": 24} for i in range(5)]
    for im in images:
        (root / im["file_name"]).write_bytes(_jpeg(im["id"]))
    anns = [{"id": k, "image_id": k % 5, "category_id": 7, "bbox": [1, 2, 3, 4], "area": 12, "iscrowd": 0}
            for k in range(8)]
    (root / "ann.json").write_text(json.dumps({"images": images, "annotations": anns,
                                               "categories": [{"id": 7, "name": "x"}]}))
    return formats.coco(root, root / "ann.json"), "data"


def _webdataset(root):
    with tarfile.open(root / "shard.tar", "w") as tf:
        for i in range(6):
            for ext, data in (("jpg", _jpeg(i)), ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return formats.webdataset(root / "shard.tar"), "jpg"


@pytest.mark.parametrize("make", [_filetree, _numpy, _coco, _webdataset])
def test_read_matches_files(tmp_path, make, device):
    index, field = make(tmp_path)
    assert_read_matches_files(index, field, device)
