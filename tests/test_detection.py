"""Detection ops (random_bbox_crop, bb_flip, paste, bbox_paste, box_encoder) against
NumPy references written from DALI's documented formulas, and against the pixels they
move: boxes drawn into real images must land on the same pixels after each op. The
same bodies run on the CPU and (marked gpu) on a GPU batch."""

from __future__ import annotations

import numpy as np
import pytest

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.errors import ConfigError, DataError
from gpuio.ops.decode_slice import crop_window
from gpuio.ops.detection import encode_boxes
from gpuio.sample import sample_image
from tests.conftest import to_host


def make(device, data, start=0, seed=0, epoch=0, order=None):
    index = np.arange(start, start + len(next(iter(data.values()))))
    if order is not None:
        index = index[order]
        data = {k: [v[i] for i in order] for k, v in data.items()}
    dev = Device("cuda", 0) if device == "cuda" else Device("cpu")
    if device == "cuda" and "image" in data:
        import cupy

        data = dict(data, image=[cupy.asarray(img) for img in data["image"]])
    return Batch({k: list(v) for k, v in data.items()}, index, sample_seeds(seed, epoch, index), device=dev)


def random_boxes(rng, n, lo=0.02, hi=0.5):
    lt = rng.uniform(0, 1 - hi, (n, 2))
    return np.concatenate([lt, lt + rng.uniform(lo, hi, (n, 2))], 1).astype(np.float32)


def detection_rows(count=12, seed=0, size=(60, 80)):
    """Images with one flat colour rectangle per box (box k painted with value 40 + 15 k)."""
    rng = np.random.default_rng(seed)
    boxes, labels, images = [], [], []
    for _ in range(count):
        b = random_boxes(rng, int(rng.integers(1, 6)), 0.1, 0.45)
        img = np.zeros(size + (3,), np.uint8)
        for k, (l, t, r, btm) in enumerate(b.tolist()):
            img[round(t * size[0]):round(btm * size[0]), round(l * size[1]):round(r * size[1])] = 40 + 15 * k
        boxes.append(b)
        labels.append(rng.integers(1, 80, len(b)).astype(np.int32))
        images.append(img)
    return {"boxes": boxes, "labels": labels, "image": images}


# ---------------------------------------------------------------- box_encoder reference


def iou_ref(a, b):
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = np.float32(iw) * np.float32(ih)
    if inter <= 0:
        return np.float32(0)
    area = lambda x: np.float32(x[2] - x[0]) * np.float32(x[3] - x[1])  # noqa: E731
    return np.float32(inter / (area(a) + area(b) - inter))


def encode_ref(boxes, labels, anchors, criteria=0.5, offset=False, scale=1.0, means=(0,) * 4, stds=(1,) * 4):
    """DALI's box_encoder, loop by loop: every box claims its best anchor (IoU := 2,
    last of ties), every anchor takes its best box (last of ties) above ``criteria``."""
    a_count = len(anchors)
    ious = np.array([[iou_ref(b, a) for a in anchors] for b in boxes], np.float32).reshape(len(boxes), a_count)
    for row in ious:
        best = max(range(a_count), key=lambda k: (row[k], k))
        row[best] = 2.0
    cs = lambda x: np.array([(x[0] + x[2]) / 2, (x[1] + x[3]) / 2, x[2] - x[0], x[3] - x[1]], np.float32)  # noqa: E731
    out_boxes = np.zeros((a_count, 4), np.float32)
    out_labels = np.zeros(a_count, np.int32)
    for k in range(a_count):
        anchor = cs(anchors[k])
        if not offset:
            out_boxes[k] = anchor
        if len(boxes) == 0:
            continue
        j = max(range(len(boxes)), key=lambda i: (ious[i, k], i))
        if ious[j, k] <= criteria:
            continue
        box = cs(boxes[j])
        out_labels[k] = labels[j]
        if offset:
            box, anchor = box * scale, anchor * scale
            out_boxes[k, :2] = ((box[:2] - anchor[:2]) / anchor[2:] - means[:2]) / stds[:2]
            out_boxes[k, 2:] = (np.log(box[2:] / anchor[2:]) - means[2:]) / stds[2:]
        else:
            out_boxes[k] = box
    return out_boxes, out_labels


@pytest.fixture(scope="module")
def encoder_case():
    rng = np.random.default_rng(3)
    grid = [(x, y, x + s, y + s) for s in (0.25, 0.5) for x in np.arange(0, 1 - s + 1e-6, s / 2)
            for y in np.arange(0, 1 - s + 1e-6, s / 2)]
    anchors = np.concatenate([np.array(grid, np.float32), random_boxes(rng, 40, 0.05, 0.4)])
    boxes = [random_boxes(rng, n, 0.05, 0.5) for n in (3, 1, 0, 6)]
    boxes[3][4] = boxes[3][1]  # two equal boxes: the later one wins their anchors
    boxes[1][0] = [0.9, 0.9, 0.905, 0.905]  # tiny box: below criteria everywhere, still claims its best anchor
    labels = [np.arange(1, len(b) + 1, dtype=np.int32) * 3 for b in boxes]
    return anchors, boxes, labels


@pytest.mark.parametrize("kw", [dict(), dict(criteria=0.3),
                                dict(offset=True, scale=300.0, stds=(0.1, 0.1, 0.2, 0.2)),
                                dict(offset=True, means=(0.1, -0.2, 0.3, 0.0), stds=(0.5, 0.5, 2.0, 2.0))])
def test_box_encoder_matches_dali_formula(device, encoder_case, kw):
    anchors, boxes, labels = encoder_case
    batch = ops.box_encoder(anchors.ravel().tolist(), **kw)(make(device, {"boxes": boxes, "labels": labels}))
    out_boxes, out_labels = to_host(batch.data["boxes"]), to_host(batch.data["labels"])
    assert out_boxes.shape == (4, len(anchors), 4) and out_boxes.dtype == np.float32
    assert out_labels.shape == (4, len(anchors)) and out_labels.dtype == np.int32
    for row in range(4):
        ref_boxes, ref_labels = encode_ref(boxes[row], labels[row], anchors, **kw)
        np.testing.assert_array_equal(out_labels[row], ref_labels)
        np.testing.assert_allclose(out_boxes[row], ref_boxes, rtol=1e-5, atol=2e-5)
    assert (out_labels[2] == 0).all()  # no boxes: background everywhere
    assert 6 not in out_labels[3] and 15 in out_labels[3]  # box 1 (label 6) lost its anchors to its twin, box 4
    assert (out_labels[1] == 3).sum() == 1  # the tiny box matched only its best anchor


def test_batched_encoding_equals_row_by_row(encoder_case):
    """The one pass over the rows' boxes end to end (as both devices run it) gives
    exactly what each row alone gives: no box matches an anchor of another row, and a
    row without boxes (row 2) is background everywhere."""
    anchors, boxes, labels = encoder_case
    counts = np.array([len(b) for b in boxes])
    for kw in (dict(), dict(offset=True, scale=300.0)):
        all_boxes, all_labels = encode_boxes(np, np.concatenate(boxes), counts, np.concatenate(labels), anchors,
                                             **kw)
        for k, (b, lab) in enumerate(zip(boxes, labels)):
            one_boxes, one_labels = encode_boxes(np, b, np.array([len(b)]), lab, anchors, **kw)
            np.testing.assert_array_equal(all_boxes[k], one_boxes[0])
            np.testing.assert_array_equal(all_labels[k], one_labels[0])
        none_boxes, none_labels = encode_boxes(np, np.zeros((0, 4), np.float32), np.zeros(3, np.int64),
                                               np.zeros(0, np.int32), anchors, **kw)  # no boxes in the batch
        assert none_boxes.shape == (3, len(anchors), 4) and not none_labels.any()
        np.testing.assert_array_equal(none_boxes[1], all_boxes[2])


def test_box_encoder_rejects_a_row_whose_labels_do_not_match_its_boxes(encoder_case):
    anchors, boxes, labels = encoder_case
    labels = [labels[0], labels[1][:0], labels[2], labels[3]]
    with pytest.raises(DataError, match="0 labels for 1 boxes") as err:
        ops.box_encoder(anchors)(make("cpu", {"boxes": boxes, "labels": labels}))
    assert err.value.sample == 1
    rows = np.arange(4)
    out = ops.box_encoder(anchors)(Batch({"boxes": list(boxes), "labels": labels}, rows, sample_seeds(0, 0, rows),
                                         on_error="skip"))
    assert [row for row, _ in out.errors] == [1]
    expected = ops.box_encoder(anchors)(make("cpu", {"boxes": boxes, "labels": encoder_case[2]}))
    for row in (0, 2, 3):  # the other rows as without the bad one
        np.testing.assert_array_equal(out.data["labels"][row], expected.data["labels"][row])


# ---------------------------------------------------------------- bb_flip


@pytest.mark.parametrize("ltrb", [True, False])
def test_bb_flip_formula(device, ltrb):
    rng = np.random.default_rng(1)
    ltrb_boxes = [random_boxes(rng, n) for n in (2, 0, 5)]
    given = [b if ltrb else np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], 1) for b in ltrb_boxes]
    for horizontal, vertical in ((True, False), (False, True), (True, True)):
        out = ops.bb_flip(ltrb=ltrb, horizontal=horizontal, vertical=vertical, p=1.0)(
            make(device, {"boxes": [g.copy() for g in given]})).data["boxes"]
        for g, o in zip(given, out):
            ref = g.copy()
            for axis, on in ((0, horizontal), (1, vertical)):
                if on and ltrb:
                    ref[:, [axis, axis + 2]] = 1 - g[:, [axis + 2, axis]]
                elif on:
                    ref[:, axis] = 1 - g[:, axis] - g[:, axis + 2]
            np.testing.assert_allclose(to_host(o), ref, atol=1e-7)


def box_pixels_match(images, boxes, tol=1):
    """Each box k of each row covers pixels painted 40 + 15 k (its inside, ``tol``
    pixels in from the edges, is uniformly that value)."""
    for img, b in zip(images, boxes):
        img = to_host(img)
        h, w = img.shape[:2]
        for k, (l, t, r, btm) in enumerate(np.asarray(b).tolist()):
            y0, y1, x0, x1 = round(t * h) + tol, round(btm * h) - tol, round(l * w) + tol, round(r * w) - tol
            if y1 - y0 < 2 or x1 - x0 < 2:
                continue
            inside = img[y0:y1, x0:x1, 0]
            # boxes may overlap: the later box paints over the earlier
            later = [40 + 15 * j for j in range(k, len(b))]
            assert np.isin(inside, later).all(), (k, np.unique(inside))


def test_bb_flip_follows_the_flip_of_the_image(device):
    data = detection_rows(24, seed=2)
    batch = ops.Compose([ops.flip(p=0.5), ops.bb_flip(ltrb=True, p=0.5)])(make(device, data))
    flipped = [not np.array_equal(b, o) for b, o in zip(batch.data["boxes"], data["boxes"])]
    assert 0 < sum(flipped) < len(flipped)
    box_pixels_match(batch.data["image"], batch.data["boxes"])


# ---------------------------------------------------------------- paste, bbox_paste


def test_bbox_paste_formula(device):
    rng = np.random.default_rng(4)
    boxes = [random_boxes(rng, 4), np.array([[0.0, 0.0, 1.0, 1.0]], np.float32)]
    for ratio, px, py in ((2.5, 0.3, 0.9), (3.0, 1.0, 1.0), (1.0, 0.2, 0.7)):
        for ltrb in (True, False):
            out = ops.bbox_paste(ratio, px, py, ltrb=ltrb)(make(device, {"boxes": [b.copy() for b in boxes]}))
            for b, o in zip(boxes, out.data["boxes"]):
                ofs = np.array([px, py]) * (ratio - 1) / ratio
                ref = b / ratio + np.concatenate([ofs, ofs if ltrb else [0, 0]])
                np.testing.assert_allclose(to_host(o), ref, atol=1e-6)
                if ltrb:  # boxes in 0-1 stay in 0-1
                    assert to_host(o).min() >= 0 and to_host(o).max() <= 1


def test_paste_and_bbox_paste_move_boxes_with_their_pixels(device):
    data = detection_rows(16, seed=5, size=(48, 64))
    chain = [ops.paste((1.0, 3.0), (0.0, 1.0), (0.0, 1.0), fill_value=(7, 8, 9)),
             ops.bbox_paste((1.0, 3.0), (0.0, 1.0), (0.0, 1.0), ltrb=True)]
    batch = ops.Compose(chain)(make(device, data))
    sizes = {to_host(img).shape for img in batch.data["image"]}
    assert len(sizes) > 4  # ratios were drawn per row
    for img, src in zip(batch.data["image"], data["image"]):
        img = to_host(img)
        assert img.shape[0] >= 48 and img.shape[1] >= 64 and (img == [7, 8, 9]).all(axis=2).sum() \
            == img.shape[0] * img.shape[1] - 48 * 64
    box_pixels_match(batch.data["image"], batch.data["boxes"], tol=2)


def test_paste_canvas_as_dali(device):
    img = np.full((7, 11, 3), 9, np.uint8)
    out = to_host(ops.paste(2.5, 0.3, 0.9, fill_value=(1, 2, 3))(make(device, {"image": [img]})).data["image"][0])
    assert out.shape == (17, 27, 3)  # int(7 * 2.5), int(11 * 2.5)
    inside = np.argwhere(out[:, :, 0] == 9)
    assert inside.min(0).tolist() == [9, 4] and inside.max(0).tolist() == [15, 14]  # int(0.9 * 10), int(0.3 * 16)
    assert ops.paste(1.0, min_canvas_size=20)(make(device, {"image": [img]})).data["image"][0].shape == (20, 20, 3)


@pytest.mark.parametrize("size", [(300, 300), (64, 96)])
def test_paste_with_size_equals_paste_then_resize(device, size):
    rng = np.random.default_rng(10)
    images = [sample_image(rng, int(rng.integers(20, 160)), int(rng.integers(20, 160))) for _ in range(12)]
    zoom = dict(ratio=(1.0, 4.0), paste_x=(0.0, 1.0), paste_y=(0.0, 1.0), fill_value=(104, 117, 123))
    fast = ops.paste(**zoom, size=size)(make(device, {"image": images})).data["image"]
    slow = ops.Compose([ops.paste(**zoom), ops.resize(size), ops.normalize(0, 1, layout="HWC", dtype="uint8")])(
        make(device, {"image": images})).data["image"]
    for a, b in zip(fast, slow):
        a, b = to_host(a).astype(int), to_host(b).astype(int)
        assert a.shape == b.shape == size + (3,)
        assert np.abs(a - b).max() <= 1 and (a != b).mean() < 0.01


# ---------------------------------------------------------------- random_bbox_crop

SSD_CROP = dict(aspect_ratio=(0.5, 2.0), thresholds=(0.0, 0.1, 0.3, 0.5, 0.7, 0.9), scaling=(0.3, 1.0),
                bbox_layout="xyXY", allow_no_crop=True, num_attempts=50)


def iou_matrix(crop, boxes):
    return np.array([iou_ref(crop, b) for b in boxes])


def test_random_bbox_crop_contract(device):
    data = detection_rows(40, seed=6)
    original = {k: list(v) for k, v in data.items()}
    batch = ops.random_bbox_crop(**SSD_CROP)(make(device, data))
    no_crop = 0
    for row in range(40):
        (ax, ay), (sw, sh) = batch.data["crop_anchor"][row], batch.data["crop_shape"][row]
        crop = np.array([ax, ay, ax + sw, ay + sh], np.float32)
        boxes = original["boxes"][row]
        if sw == 1.0 and sh == 1.0:
            no_crop += 1
        else:
            assert 0.5 - 1e-6 <= sw / sh <= 2.0 + 1e-6 and 0.3 - 1e-6 <= min(sw, sh) and max(sw, sh) <= 1.0
            assert crop.min() >= 0 and crop.max() <= 1 + 1e-6
            assert iou_matrix(crop, boxes).min() >= 0.0  # a threshold of the list held (0 at least)
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        keep = np.flatnonzero((cx >= crop[0]) & (cx < crop[2]) & (cy >= crop[1]) & (cy < crop[3]))
        assert len(keep) >= 1
        np.testing.assert_array_equal(batch.data["labels"][row], original["labels"][row][keep])
        ref = (np.clip(boxes[keep], np.tile(crop[:2], 2), np.tile(crop[2:], 2)) - np.tile(crop[:2], 2)) \
            / np.tile(crop[2:] - crop[:2], 2)
        np.testing.assert_allclose(batch.data["boxes"][row], ref, atol=1e-5)
        img = original["image"][row]
        y0, x0, y1, x1 = crop_window((ax, ay), (sw, sh), *img.shape[:2])
        np.testing.assert_array_equal(to_host(batch.data["image"][row]), img[y0:y1, x0:x1])
    assert 0 < no_crop < 40


def test_random_bbox_crop_threshold_holds_for_every_box():
    data = detection_rows(30, seed=7)
    crop = ops.random_bbox_crop(aspect_ratio=(0.5, 2.0), thresholds=(0.3,), scaling=(0.3, 1.0),
                                allow_no_crop=False, num_attempts=100, total_num_attempts=400,
                                threshold_type="overlap")
    batch = crop(make("cpu", {k: list(v) for k, v in data.items()}))
    for row in range(30):
        (ax, ay), (sw, sh) = batch.data["crop_anchor"][row], batch.data["crop_shape"][row]
        c = np.array([ax, ay, ax + sw, ay + sh])
        b = data["boxes"][row]
        iw = np.clip(np.minimum(c[2], b[:, 2]) - np.maximum(c[0], b[:, 0]), 0, None)
        ih = np.clip(np.minimum(c[3], b[:, 3]) - np.maximum(c[1], b[:, 1]), 0, None)
        assert (iw * ih / ((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]))).min() >= 0.3 - 1e-5


def test_random_bbox_crop_draws_depend_on_seed_epoch_sample_only():
    data = detection_rows(10, seed=8)
    crop = ops.random_bbox_crop(**SSD_CROP)
    first = crop(make("cpu", dict(data), start=100))
    order = np.array([7, 2, 9, 0, 5])  # another batch with some of the same samples, in another order
    again = crop(make("cpu", dict(data), start=100, order=order))
    for pos, row in enumerate(order.tolist()):
        np.testing.assert_array_equal(again.data["crop_anchor"][pos], first.data["crop_anchor"][row])
        np.testing.assert_array_equal(again.data["boxes"][pos], first.data["boxes"][row])
    later = crop(make("cpu", dict(data), start=100, epoch=1))
    assert any(not np.array_equal(a, b) for a, b in zip(later.data["crop_anchor"], first.data["crop_anchor"]))


def test_random_bbox_crop_xywh_equals_ltrb():
    data = detection_rows(10, seed=9)
    ltrb = ops.random_bbox_crop(**SSD_CROP)(make("cpu", dict(data))).data["boxes"]
    xywh_in = [np.concatenate([b[:, :2], b[:, 2:] - b[:, :2]], 1) for b in data["boxes"]]
    xywh = ops.random_bbox_crop(**dict(SSD_CROP, bbox_layout="xyWH"))(
        make("cpu", dict(data, boxes=xywh_in))).data["boxes"]
    for a, b in zip(ltrb, xywh):
        np.testing.assert_allclose(np.concatenate([a[:, :2], a[:, 2:] - a[:, :2]], 1), b, atol=1e-5)


def test_random_bbox_crop_carries_polygons_and_masks(device):
    boxes = [np.array([[0.05, 0.05, 0.25, 0.25], [0.6, 0.6, 0.9, 0.9], [0.1, 0.55, 0.3, 0.95]], np.float32)]
    vertices = [np.array([[0.05, 0.05], [0.25, 0.05], [0.25, 0.25],  # box 0
                          [0.6, 0.6], [0.9, 0.6], [0.9, 0.9], [0.6, 0.9],  # box 1
                          [0.1, 0.55], [0.3, 0.95], [0.2, 0.6]], np.float32)]  # box 2
    polygons = [np.array([[0, 0, 3], [1, 3, 7], [2, 7, 10]], np.int32)]
    masks = [np.stack([np.pad(np.ones((8, 8), np.uint8), [(k * 10, 32 - k * 10 - 8)] * 2) for k in range(3)])]
    data = {"boxes": boxes, "labels": [np.array([1, 2, 3], np.int32)], "polygons": polygons, "vertices": vertices,
            "masks": masks}
    # a fixed window over the lower half: x 0..1, y 0.5..1 (scaling with w 1 and h 0.5)
    crop = ops.random_bbox_crop(aspect_ratio=(2.0, 2.0), scaling=(1.0, 1.0), allow_no_crop=False,
                                thresholds=(0.0,), num_attempts=1)
    for seed in range(20):  # the fixed ratio 2 on 1.0 draws gives a 1 x 0.5 window at a random height
        batch = crop(make(device, {k: [v[0].copy()] for k, v in data.items()}, seed=seed))
        (ax, ay), (sw, sh) = batch.data["crop_anchor"][0], batch.data["crop_shape"][0]
        if ay > 0.45:
            break
    assert sw == pytest.approx(1.0) and sh == pytest.approx(0.5)
    labels = batch.data["labels"][0].tolist()
    assert labels == [2, 3]  # box 0's centre left the window
    np.testing.assert_array_equal(batch.data["polygons"][0], [[0, 0, 4], [1, 4, 7]])
    np.testing.assert_allclose(batch.data["vertices"][0], (vertices[0][3:] - [ax, ay]) / [sw, sh], atol=1e-6)
    assert batch.data["masks"][0].shape[0] == 2 and batch.data["masks"][0].shape[1] < 40


def test_detection_ops_reject_bad_arguments():
    with pytest.raises(ConfigError, match="thresholds"):
        ops.random_bbox_crop(thresholds=(1.5,))
    with pytest.raises(ConfigError, match="bbox_layout"):
        ops.random_bbox_crop(bbox_layout="yxYX")
    with pytest.raises(ConfigError, match="ratio"):
        ops.paste(0.5)
    with pytest.raises(ConfigError, match="paste_x"):
        ops.bbox_paste(2.0, paste_x=(0.2, 1.5))
    with pytest.raises(ConfigError, match="stds"):
        ops.box_encoder([0, 0, 1, 1], stds=(0.1, 0.1, 0.0, 0.2))


def test_random_bbox_crop_that_cannot_pass_ends_with_the_best_window():
    """DALI searches forever here (no window of 0.3-1 can have IoU 0.95 with a tiny box);
    gpuio stops after 10,000 windows and takes the best one."""
    data = {"boxes": [np.array([[0.5, 0.5, 0.52, 0.52]], np.float32)], "labels": [np.array([4], np.int32)]}
    crop = ops.random_bbox_crop(thresholds=(0.95,), scaling=(0.3, 1.0), allow_no_crop=False, num_attempts=50)
    batch = crop(make("cpu", data))
    (ax, ay), (sw, sh) = batch.data["crop_anchor"][0], batch.data["crop_shape"][0]
    assert sw < 0.35 and sh < 0.35  # the smallest windows overlap the box most
    assert ax <= 0.5 and ay <= 0.5 and ax + sw >= 0.52 and ay + sh >= 0.52  # ... when they hold all of it
    assert batch.data["labels"][0].tolist() == [4]


def test_random_bbox_crop_masks_that_do_not_match_the_boxes_are_bad_samples():
    data = detection_rows(3, seed=11)
    data["masks"] = [np.zeros((len(b) + (k == 1), 60, 80), np.uint8) for k, b in enumerate(data["boxes"])]
    crop = ops.random_bbox_crop(**SSD_CROP)
    with pytest.raises(DataError, match="sample 1.*pixel masks for"):
        crop(make("cpu", {k: list(v) for k, v in data.items()}))
    batch = make("cpu", {k: list(v) for k, v in data.items()})
    batch.on_error = "skip"
    crop(batch)
    batch.drop_rejected()
    assert batch.index.tolist() == [0, 2] and len(batch.data["crop_anchor"]) == 2
    assert [len(m) for m in batch.data["masks"]] == [len(b) for b in batch.data["boxes"]]
