"""What an adopter trips over first: help on every op, the SSD anchors and the COCO
sample in public modules, normalize's arguments checked when the Loader is made."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest

import gpuio
from gpuio import formats, ops
from gpuio.errors import ConfigError
from gpuio.sample import make_coco, make_image_tree


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return formats.filetree(make_image_tree(tmp_path_factory.mktemp("t") / "t", count=8))


@pytest.mark.parametrize("name", [n for n in ops.__all__ if inspect.isfunction(getattr(ops, n))])
def test_help_on_every_op_factory_explains_it(name):
    doc = inspect.getdoc(getattr(ops, name)) or ""
    assert len(doc) > 80 and not doc.startswith("See "), f"help(ops.{name}) says only {doc!r}"


def test_help_on_random_resized_crop_names_its_arguments():
    doc = inspect.getdoc(ops.random_resized_crop)
    assert "RandomResizedCrop" in doc and "scale" in doc and "ratio" in doc


def test_ssd_anchors_and_coco_sample_are_public(tmp_path):
    anchors = ops.ssd300_anchors()
    assert anchors.shape == (8732, 4) and anchors.dtype == np.float32
    assert anchors.min() >= 0 and anchors.max() <= 1 and np.all(anchors[:, 2:] > anchors[:, :2])
    root, ann = make_coco(tmp_path, count=3, size=(64, 80))
    index = formats.coco(root, ann, box_format="ltrb", normalized=True)
    assert len(index) == 3 and "boxes" in index.fields


def test_normalize_with_0_1_values_on_uint8_images_warns(tree):
    with pytest.warns(UserWarning, match=r"look like values for 0-1 images .* scale them by 255"):
        gpuio.Loader(tree, 4, ops=[ops.decode_image(), ops.resize(32),
                                   ops.normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    with pytest.warns(UserWarning, match="0-1 images"):  # inside a Compose too
        gpuio.Loader(tree, 4, ops=[ops.Compose([ops.decode_image(), ops.normalize(0.5, 0.25)])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpuio.Loader(tree, 4, ops=[ops.decode_image(), ops.normalize([123.7, 116.3, 103.5], [58.4, 57.1, 57.4])])
        gpuio.Loader(tree, 4, ops=[ops.decode_image(), ops.normalize()])  # the identity is not a mistake


def test_normalize_arguments_are_checked_when_made(tree):
    with pytest.raises(ConfigError, match="mean has 3 values and std 2"):
        ops.normalize([1.0, 2.0, 3.0], [4.0, 5.0])
    with pytest.raises(ConfigError, match=r"Normalize on 'image', decoded with 1 channel\(s\): mean/std have 3/3"):
        gpuio.Loader(tree, 4, ops=[ops.decode_image(color="gray"), ops.normalize([120.0] * 3, [60.0] * 3)])
    gpuio.Loader(tree, 4, ops=[ops.decode_image(color="gray"), ops.normalize(120.0, 60.0)])  # one for all


def test_len_after_a_resume_counts_the_batches_the_pass_yields(tree):
    loader = gpuio.Loader(tree, 3, output="numpy")  # 8 samples: 3 batches
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    resumed = gpuio.Loader(tree, 3, output="numpy")
    resumed.load_state_dict(state)
    assert len(resumed) == 2
    seen = []
    for batch in resumed:
        seen.append(batch["index"].tolist())
        assert len(resumed) == 2  # the running pass
    assert seen == [[3, 4, 5], [6, 7]]
    assert len(resumed) == 3  # the next epoch is whole
