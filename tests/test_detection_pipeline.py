"""The SSD pipeline (bench/detection.py's ops) through the Loader on a generated
COCO-style dataset: shapes and dtypes, resume and thread-count determinism by the
shared checkers, and the encoded boxes decoding back to the boxes the ops moved."""

from __future__ import annotations

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.bench.detection import ENCODE, gpuio_ssd, write_coco
from gpuio.ops import ssd300_anchors
from tests.checkers import check_deterministic, check_resume, host


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root, ann = write_coco(tmp_path_factory.mktemp("coco"), count=10, size=(96, 128), seed=4)
    return gpuio.formats.coco(root, ann, box_format="ltrb", normalized=True, skip_empty=True)


def make_loader(index, **kw):
    kw = dict(dict(batch_size=4, fields=["data", "boxes", "labels"], ops=[gpuio_ssd(ssd300_anchors())],
                   output="numpy", shuffle=True, seed=9), **kw)
    return gpuio.Loader(index, kw.pop("batch_size"), **kw)


def test_ssd_batches(device, coco):
    batches = [host(b) for b in make_loader(coco, device=device)]
    assert [len(b["index"]) for b in batches] == [4, 4, 2]
    for b in batches:
        n = len(b["index"])
        assert b["image"].shape == (n, 3, 300, 300) and b["image"].dtype == np.float32
        assert b["boxes"].shape == (n, 8732, 4) and b["boxes"].dtype == np.float32
        assert b["labels"].shape == (n, 8732) and b["labels"].dtype == np.int32
        assert ((b["labels"] > 0).sum(axis=1) >= 1).all()  # every image keeps a box, matched to an anchor


def test_ssd_resume_and_threads(coco):
    check_resume(lambda **kw: make_loader(coco, **kw), epochs=2)
    check_deterministic(lambda **kw: make_loader(coco, **kw), [dict(threads=1), dict(threads=3, prefetch=1)])


def test_encoded_offsets_decode_to_the_moved_boxes(coco):
    """Undo box_encoder's offsets on matched anchors: the boxes the crop, zoom out and
    flip produced come back."""
    anchors = ssd300_anchors()
    chain = gpuio_ssd(anchors).ops
    before = make_loader(coco, ops=[ops.Compose(chain[:-1])], shuffle=False)
    after = make_loader(coco, ops=[ops.Compose(chain)], shuffle=False)
    stds = np.array(ENCODE["stds"], np.float32)
    a_c = (anchors[:, :2] + anchors[:, 2:]) / 2
    a_s = anchors[:, 2:] - anchors[:, :2]
    for raw, enc in zip(before, after):
        for boxes, labels, enc_boxes, enc_labels in zip(raw["boxes"], raw["labels"], enc["boxes"], enc["labels"]):
            hit = enc_labels > 0
            c = enc_boxes[hit, :2] * stds[:2] * a_s[hit] + a_c[hit]
            s = np.exp(enc_boxes[hit, 2:] * stds[2:]) * a_s[hit]
            decoded = np.concatenate([c - s / 2, c + s / 2], axis=1)
            # every decoded box is one of the row's boxes, with its label
            dist = np.abs(decoded[:, None, :] - boxes[None, :, :]).max(axis=2)
            nearest = dist.argmin(axis=1)
            assert dist.min(axis=1).max() < 1e-5
            assert (labels[nearest] == enc_labels[hit]).all()
