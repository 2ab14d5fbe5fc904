"""formats.coco against real JPEGs and pycocotools' own reading of the same JSON."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image
from pycocotools import mask as cmask
from pycocotools.coco import COCO

import gpuio
from gpuio.errors import DataError, FormatError, GpuioError, StorageError
from gpuio.formats import coco
from gpuio.formats.coco import decode_masks

SIZES = {5: (40, 30), 2: (64, 48), 9: (32, 32), 11: (50, 20)}  # image id -> (width, height)
CATEGORY_IDS = [90, 3, 7, 1]  # non-contiguous, unsorted in the file


def _crowd_rle(w: int, h: int) -> dict:
    m = np.zeros((h, w), dtype=np.uint8)
    m[5:15, 10:30] = 1
    rle = cmask.encode(np.asfortranarray(m))
    # uncompressed RLE, as COCO stores crowd regions
    flat = m.ravel(order="F")
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    counts = np.diff(bounds).tolist()
    if flat[0] == 1:
        counts = [0] + counts
    assert cmask.decode(cmask.frPyObjects({"size": [h, w], "counts": counts}, h, w)).sum() == m.sum()
    return {"size": [h, w], "counts": counts}, rle


def _write_dataset(tmp_path, *, extra_anns=(), mutate=None):
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = []
    for image_id, (w, h) in SIZES.items():
        name = f"sub/img_{image_id:03d}.jpg"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / name, quality=90)
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
    uncompressed, _ = _crowd_rle(*SIZES[2])
    anns = [
        {"id": 100, "image_id": 5, "category_id": 7, "bbox": [1.5, 2.0, 10.0, 8.0], "iscrowd": 0, "area": 80.0,
         "segmentation": [[1.5, 2.0, 11.5, 2.0, 11.5, 10.0, 1.5, 10.0]]},
        {"id": 101, "image_id": 2, "category_id": 90, "bbox": [0.0, 0.0, 64.0, 48.0], "iscrowd": 0, "area": 1.0,
         "segmentation": [[0, 0, 20, 0, 20, 20], [30, 30, 40, 30, 40, 40, 30, 40]]},
        {"id": 102, "image_id": 2, "category_id": 1, "bbox": [10, 5, 20, 10], "iscrowd": 1, "area": 200.0,
         "segmentation": uncompressed},
        {"id": 103, "image_id": 5, "category_id": 3, "bbox": [20, 10, 5, 5], "iscrowd": 0, "area": 25.0,
         "segmentation": [[20, 10, 25, 10, 25, 15]]},
        {"id": 104, "image_id": 11, "category_id": 1, "bbox": [3, 4, 5, 6], "iscrowd": 1, "area": 30.0,
         "segmentation": [[3, 4, 8, 4, 8, 10, 3, 10]]},
        *extra_anns,
    ]
    doc = {"images": images, "annotations": anns,
           "categories": [{"id": c, "name": f"c{c}", "supercategory": "x"} for c in CATEGORY_IDS]}
    if mutate is not None:
        mutate(doc)
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(doc))
    return root, path


@pytest.fixture
def dataset(tmp_path):
    return _write_dataset(tmp_path)


def _coco_api(path) -> COCO:
    api = COCO()
    with open(path) as f:
        api.dataset = json.load(f)
    api.createIndex()
    return api


def test_fields_bytes_boxes_labels_match_pycocotools(dataset):
    root, ann = dataset
    index = coco(root, ann)
    api = _coco_api(ann)
    assert len(index) == 4
    assert {"data", "boxes", "labels", "category_ids", "image_id", "width", "height"} <= set(index.fields)
    assert index.values["image_id"].tolist() == [2, 5, 9, 11]  # sorted by image id
    label_of = {c: k + 1 for k, c in enumerate(CATEGORY_IDS)}  # file order: {90: 1, 3: 2, 7: 3, 1: 4}
    for i, image_id in enumerate([2, 5, 9, 11]):
        sample = index[i]
        info = api.imgs[image_id]
        assert sample["data"] == (root / info["file_name"]).read_bytes()
        assert sample["image_id"] == image_id
        assert (sample["width"], sample["height"]) == SIZES[image_id]
        anns = api.loadAnns(api.getAnnIds(imgIds=[image_id], iscrowd=None))
        assert sample["boxes"].dtype == np.float32 and sample["boxes"].shape == (len(anns), 4)
        np.testing.assert_array_equal(sample["boxes"], np.array([a["bbox"] for a in anns], dtype=np.float32).reshape(-1, 4))
        assert sample["category_ids"].tolist() == [a["category_id"] for a in anns]
        assert sample["labels"].dtype == np.int32
        assert sample["labels"].tolist() == [label_of[a["category_id"]] for a in anns]
    assert index[1]["labels"].tolist() == [3, 2]  # image 5: categories 7, 3 in file order
    assert index[2]["boxes"].shape == (0, 4)  # image 9 has no annotations
    assert index.meta["category_ids"] == CATEGORY_IDS


def test_labels_number_categories_in_file_order_as_dali(tmp_path):
    # DALI's readers.coco (checked with nvidia-dali 2.4 on the CPU) numbers categories
    # 1, 2, ... in the order 'categories' lists them; ids [90, 1, 7, 1] give [3, 2, 5, 2]
    listed = [3, 1, 90, 11, 7]
    anns = [{"id": 300 + k, "image_id": 9, "category_id": c, "bbox": [0, 0, 1, 1], "iscrowd": 0}
            for k, c in enumerate([90, 1, 7, 1])]
    root, ann = _write_dataset(tmp_path, extra_anns=anns, mutate=lambda d: d.update(
        categories=[{"id": c, "name": f"c{c}"} for c in listed]))
    index = coco(root, ann)
    assert index[2]["category_ids"].tolist() == [90, 1, 7, 1]
    assert index[2]["labels"].tolist() == [3, 2, 5, 2]
    assert index.meta["category_ids"] == listed
    labels = index.values["labels"].values
    np.testing.assert_array_equal(np.asarray(listed)[labels - 1], index.values["category_ids"].values)


def test_batch_read_gives_exact_file_bytes(dataset):
    root, ann = dataset
    index = coco(root, ann)
    batch = gpuio.read(index, [3, 0, 1])
    for got, i in zip(batch, [3, 0, 1]):
        assert got.tobytes() == (root / index.files[i].removeprefix(str(root) + "/")).read_bytes()


def test_ltrb_and_normalized(dataset):
    root, ann = dataset
    xywh = coco(root, ann)
    ltrb = coco(root, ann, box_format="ltrb")
    norm = coco(root, ann, box_format="ltrb", normalized=True)
    b = xywh.values["boxes"].values.astype(np.float64)
    expect = np.concatenate([b[:, :2], b[:, :2] + b[:, 2:]], axis=1)
    np.testing.assert_array_equal(ltrb.values["boxes"].values, expect.astype(np.float32))
    # image 5 is 40 x 30: its first box [1.5, 2, 10, 8] -> ltrb [1.5, 2, 11.5, 10] / [40, 30, 40, 30]
    np.testing.assert_allclose(norm[1]["boxes"][0], [1.5 / 40, 2 / 30, 11.5 / 40, 10 / 30], rtol=1e-6)
    assert np.all(norm.values["boxes"].values <= 1.0)


def test_crowd_and_empty_filters(dataset):
    root, ann = dataset
    no_crowd = coco(root, ann, include_crowd=False)
    assert [len(no_crowd[i]["boxes"]) for i in range(4)] == [1, 2, 0, 0]
    assert no_crowd[0]["category_ids"].tolist() == [90]
    skipped = coco(root, ann, include_crowd=False, skip_empty=True)
    assert skipped.values["image_id"].tolist() == [2, 5]
    assert skipped[1]["data"] == (root / "sub/img_005.jpg").read_bytes()
    np.testing.assert_array_equal(skipped[1]["boxes"], no_crowd[1]["boxes"])
    with_crowd = coco(root, ann, skip_empty=True)
    assert with_crowd.values["image_id"].tolist() == [2, 5, 11]


def test_polygons_layout(dataset):
    root, ann = dataset
    index = coco(root, ann, masks="polygons")
    api = _coco_api(ann)
    for i, image_id in enumerate(index.values["image_id"].tolist()):
        s = index[i]
        assert s["polygons"].dtype == np.int32 and s["vertices"].dtype == np.float32
        anns = api.loadAnns(api.getAnnIds(imgIds=[image_id], iscrowd=None))
        expect = [(j, np.array(p, dtype=np.float32).reshape(-1, 2))
                  for j, a in enumerate(anns) if isinstance(a["segmentation"], list) for p in a["segmentation"]]
        assert len(s["polygons"]) == len(expect)
        for (ann_no, start, end), (j, xy) in zip(s["polygons"].tolist(), expect):
            assert ann_no == j
            np.testing.assert_array_equal(s["vertices"][start:end], xy)
    # image 2: two polygons of annotation 0, none for the RLE crowd annotation 1
    assert index[0]["polygons"].tolist() == [[0, 0, 3], [0, 3, 7]]
    norm = coco(root, ann, masks="polygons", normalized=True)
    np.testing.assert_allclose(norm[0]["vertices"], index[0]["vertices"] / np.float32([64, 48]), rtol=1e-6)


def test_pixelwise_masks_match_ann_to_mask(dataset):
    root, ann = dataset
    index = coco(root, ann, masks="pixelwise")
    api = _coco_api(ann)
    for i, image_id in enumerate(index.values["image_id"].tolist()):
        masks = decode_masks(index[i])
        anns = api.loadAnns(api.getAnnIds(imgIds=[image_id], iscrowd=None))
        w, h = SIZES[image_id]
        assert masks.shape == (len(anns), h, w) and masks.dtype == np.uint8
        for j, a in enumerate(anns):
            np.testing.assert_array_equal(masks[j], api.annToMask(a))
    assert decode_masks(index[0])[1].sum() == 200  # the crowd RLE region


def test_compressed_rle_segmentation(tmp_path):
    w, h = SIZES[11]
    m = np.zeros((h, w), dtype=np.uint8)
    m[2:9, 4:40] = 1
    rle = cmask.encode(np.asfortranarray(m))
    good = {"id": 200, "image_id": 11, "category_id": 3, "bbox": [4, 2, 36, 7], "iscrowd": 1,
            "segmentation": {"size": [h, w], "counts": rle["counts"].decode()}}
    root, ann = _write_dataset(tmp_path, extra_anns=[good])
    index = coco(root, ann, masks="pixelwise")
    np.testing.assert_array_equal(decode_masks(index[3])[-1], m)
    for counts in (rle["counts"].decode()[:-1], rle["counts"].decode() + "3", "\x7f\x7f"):
        bad = dict(good, id=201, segmentation={"size": [h, w], "counts": counts})
        sub = tmp_path / f"bad{len(counts)}{ord(counts[-1])}"
        sub.mkdir()
        root, ann = _write_dataset(sub, extra_anns=[bad])
        with pytest.raises(FormatError, match="annotation id 201"):
            coco(root, ann, masks="pixelwise")


def test_save_load_round_trip(dataset, tmp_path):
    root, ann = dataset
    index = coco(root, ann, masks="polygons")
    index.save(tmp_path / "coco.idx")
    back = gpuio.SampleIndex.load(tmp_path / "coco.idx")
    assert back.fields == index.fields
    for i in range(len(index)):
        a, b = index[i], back[i]
        for k in a:
            np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("annotations"), "missing top-level key 'annotations'"),
    (lambda d: d["images"][1].pop("file_name"), "image id 2: missing key 'file_name'"),
    (lambda d: d["annotations"][2].pop("bbox"), "annotation id 102: missing key 'bbox'"),
    (lambda d: d["annotations"][0].update(bbox=[1, 2, 3]), "annotation id 100: bbox must be 4 numbers"),
    (lambda d: d["annotations"][3].update(image_id=77), "annotation id 103 names image id 77"),
    (lambda d: d["annotations"][3].update(category_id=4), "annotation id 103 names category id 4"),
    (lambda d: d["images"].append(dict(d["images"][0])), "image id 5 appears twice"),
    (lambda d: d["images"][0].update(id="five"), "'id' must be an integer"),
    (lambda d: d["images"][0].update(width=float("inf")), "'width' must be an integer"),
    (lambda d: d["annotations"][0].update(category_id=7.5), "'category_id' must be an integer"),
])
def test_bad_annotations_name_file_and_id(tmp_path, mutate, match):
    root, ann = _write_dataset(tmp_path, mutate=mutate)
    with pytest.raises(FormatError, match=match) as err:
        coco(root, ann)
    assert err.value.path == str(ann)


def test_invalid_json_names_byte_offset(tmp_path):
    root, ann = _write_dataset(tmp_path)
    text = ann.read_text()
    at = text.index("[") + 1  # inside the images list
    ann.write_text(text[:at] + "@" + text[at:])
    with pytest.raises(FormatError, match="invalid JSON") as err:
        coco(root, ann)
    assert err.value.path == str(ann) and err.value.offset == at
    ann.write_text("[1, 2]")
    with pytest.raises(FormatError, match="expected a JSON object"):
        coco(root, ann)
    with pytest.raises(StorageError):
        coco(root, tmp_path / "nope.json")


def test_missing_image_file_names_path_and_image_id(dataset):
    root, ann = dataset
    os.remove(root / "sub/img_009.jpg")
    with pytest.raises(StorageError, match="image id 9") as err:
        coco(root, ann)
    assert err.value.path == str(root / "sub/img_009.jpg")


def test_missing_segmentation_when_masks_asked(tmp_path):
    root, ann = _write_dataset(tmp_path, mutate=lambda d: d["annotations"][4].pop("segmentation"))
    assert len(coco(root, ann)) == 4  # boxes only: segmentation not needed
    for masks in ("polygons", "pixelwise"):
        with pytest.raises(FormatError, match="annotation id 104: missing key 'segmentation'"):
            coco(root, ann, masks=masks)


def test_two_point_polygons_are_accepted_and_counted(tmp_path):
    line, triangle = [2, 3, 12, 3], [0, 0, 20, 0, 20, 10]

    def degenerate(doc):
        doc["annotations"][0]["segmentation"] = [line, triangle]  # image 5's first annotation
        doc["annotations"][3]["segmentation"] = [triangle, line]  # image 5's second annotation

    root, ann = _write_dataset(tmp_path, mutate=degenerate)
    assert "degenerate_polygons" not in coco(root, ann).meta  # segmentations not read without masks
    polys = coco(root, ann, masks="polygons")
    assert polys.meta["degenerate_polygons"] == 2
    # what DALI's readers.coco (nvidia-dali 2.4, CPU) gives for these two annotations
    assert polys[1]["polygons"].tolist() == [[0, 0, 2], [0, 2, 5], [1, 5, 8], [1, 8, 10]]
    np.testing.assert_array_equal(polys[1]["vertices"], np.float32(
        [[2, 3], [12, 3], [0, 0], [20, 0], [20, 10], [0, 0], [20, 0], [20, 10], [2, 3], [12, 3]]))

    pixels = coco(root, ann, masks="pixelwise")
    assert pixels.meta["degenerate_polygons"] == 2
    masks = decode_masks(pixels[1])
    api = _coco_api(ann)
    # pycocotools rasterizes a two-point polygon after another polygon (to no pixels)...
    np.testing.assert_array_equal(masks[1], api.annToMask(api.anns[103]))
    assert masks[1].sum() == cmask.decode(cmask.frPyObjects([triangle], 30, 40)).sum() > 0
    # ...but takes a first polygon of 4 numbers for a box (pycocotools 2.0.x then raises
    # a TypeError); gpuio reads it as a polygon, so the order of the parts does not matter
    np.testing.assert_array_equal(masks[0], masks[1])


def test_bad_polygon_and_arguments(tmp_path):
    for seg in ([[1, 2, 3]], [[1, 2]], [[0, 0, 5, 0, 5, 5], [7, 7]]):
        sub = tmp_path / str(len(seg) * 10 + len(seg[-1]))
        sub.mkdir()
        root, ann = _write_dataset(sub, mutate=lambda d: d["annotations"][0].update(segmentation=seg))
        for masks in ("polygons", "pixelwise"):
            with pytest.raises(FormatError, match=r"annotation id 100: a polygon needs an even number \(>= 4\)"):
                coco(root, ann, masks=masks)
    with pytest.raises(GpuioError, match="box_format"):
        coco(root, ann, box_format="xyxy")
    with pytest.raises(GpuioError, match="masks"):
        coco(root, ann, masks="rle")


def test_no_images_is_an_error(tmp_path):
    root, ann = _write_dataset(tmp_path, mutate=lambda d: d.update(images=[], annotations=[]))
    with pytest.raises(DataError, match="no samples"):
        coco(root, ann)
