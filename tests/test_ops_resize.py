"""Resampling against its definitions: torch's antialiased interpolate (what
torchvision's antialias=True runs) and Pillow's resize with reducing_gap=None."""

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from gpuio.ops.geometry import _resize_cpu, filter_weights, resample
from gpuio.sample import sample_image

SIZES = [(224, 224), (100, 333), (31, 17), (600, 700), (375, 250), (375, 500)]


@pytest.fixture(scope="module")
def image():
    return sample_image(np.random.default_rng(11), 375, 500)


def torch_resize(img, hw, mode, antialias=True):
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None].float()
    y = torch.nn.functional.interpolate(x, size=hw, mode=mode, antialias=antialias, align_corners=False)
    return y[0].permute(1, 2, 0).numpy()


@pytest.mark.parametrize("hw", SIZES)
@pytest.mark.parametrize("interp,mode", [("linear", "bilinear"), ("cubic", "bicubic")])
def test_weights_match_torch_antialias(image, hw, interp, mode):
    # float input: no intermediate rounding, so this is torch's definition exactly
    f = image.astype(np.float32)
    ours = resample(f, (0, 0, 375, 500), (0, 0, 375, 500), hw, interp)
    np.testing.assert_allclose(ours, torch_resize(f, hw, mode), atol=0.01)


@pytest.mark.parametrize("hw", SIZES)
@pytest.mark.parametrize("interp", ["linear", "cubic"])
def test_cpu_resize_matches_reference_within_one_level(image, hw, interp):
    pil = _resize_cpu(image, hw, interp, True).astype(np.float64)  # Pillow
    ref = np.clip(resample(image, (0, 0, 375, 500), (0, 0, 375, 500), hw, interp), 0, 255)
    assert np.abs(pil - np.floor(ref + 0.5)).max() <= 1 and np.abs(pil - ref).mean() < 0.5
    if interp == "linear":  # and torchvision (uint8 rounded): within 1 level
        tv = np.floor(np.clip(torch_resize(image, hw, "bilinear"), 0, 255) + 0.5)
        assert np.abs(pil - tv).max() <= 1.0 and np.abs(pil - tv).mean() < 0.5


@pytest.mark.parametrize("hw", [(224, 224), (100, 333), (31, 17), (125, 250)])
def test_area_is_overlap_average(image, hw):
    ours = _resize_cpu(image, hw, "area", True).astype(np.float64)
    # OpenCV's INTER_AREA averages over exact pixel overlaps when downsampling, too
    want = cv2.resize(image, (hw[1], hw[0]), interpolation=cv2.INTER_AREA).astype(np.float64)
    assert np.abs(ours - want).max() <= 1 and np.abs(ours - want).mean() < 0.1
    if hw == (125, 250):  # integer factors: the same as Pillow's BOX
        box = np.asarray(Image.fromarray(image).resize((250, 125), Image.BOX, reducing_gap=None))
        assert np.abs(ours - box).max() <= 1


def test_filter_weights_shape_and_windows():
    w = filter_weights(4, 0.0, 16.0, 0, 16, "linear")  # scale 4: triangle 8 pixels wide
    assert w.shape == (4, 16) and np.allclose(w.sum(axis=1), 1)
    assert np.array_equal(w[1] * 32, [0, 0, 1, 3, 5, 7, 7, 5, 3, 1, 0, 0, 0, 0, 0, 0])
    area = filter_weights(4, 0.0, 16.0, 0, 16, "area")
    assert np.array_equal(area, np.kron(np.eye(4), np.full(4, 0.25)).astype(np.float32))
    clipped = filter_weights(3, 2.0, 6.0, 2, 8, "linear")  # a crop of pixels 2..7: nothing outside
    assert clipped.shape == (3, 6) and np.allclose(clipped.sum(axis=1), 1)
    up = filter_weights(8, 0.0, 4.0, 0, 4, "linear")  # upsampling: plain 2-tap interpolation
    assert (np.count_nonzero(up, axis=1) <= 2).all()
    nearest = filter_weights(3, 0.0, 9.0, 0, 9, "nearest")
    assert np.argmax(nearest, axis=1).tolist() == [1, 4, 7]
    noaa = filter_weights(4, 0.0, 16.0, 0, 16, "linear", antialias=False)
    assert (np.count_nonzero(noaa, axis=1) <= 2).all()


def test_non_uint8_and_no_antialias_paths(image):
    f = image.astype(np.float32)
    out = _resize_cpu(f, (50, 60), "linear", True)
    assert out.dtype == np.float32 and out.shape == (50, 60, 3)
    # no antialias: matches torch's plain bilinear away from the borders (edges clamp differently)
    ours = _resize_cpu(image, (150, 200), "linear", False).astype(np.float64)
    tv = torch_resize(image, (150, 200), "bilinear", antialias=False)
    assert np.abs(ours - tv)[2:-2, 2:-2].max() <= 1.0  # two roundings of 0.5
    rgba = np.dstack([image, image[..., :1]])
    out = _resize_cpu(rgba, (40, 30), "linear", True)  # 4 channels: NumPy path, Pillow-equal on RGB
    assert np.abs(out[..., :3].astype(int) - _resize_cpu(image, (40, 30), "linear", True)).max() <= 1
    gray = image[..., :1]
    out = _resize_cpu(gray, (40, 30), "linear", True)
    assert out.shape == (40, 30, 1)
    assert np.array_equal(out[..., 0], np.asarray(Image.fromarray(image[..., 0]).resize((30, 40), Image.BILINEAR,
                                                                                      reducing_gap=None)))
