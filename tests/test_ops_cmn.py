"""``ops.crop_mirror_normalize`` against crop, mirror and normalize written out in NumPy,
on real decoded JPEGs; the same body on the GPU (fused kernel) where one is present."""

import numpy as np
import pytest
from conftest import to_host
from test_ops_fused import decoded  # noqa: F401  (real decoded JPEGs, a fixture)

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import parse_device
from gpuio.errors import ConfigError

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]


def run(op, images, device):
    index = np.arange(len(images))
    batch = Batch({"image": list(images)}, index, sample_seeds(5, 1, index), parse_device(device))
    if batch.device.is_cuda:
        batch.data["image"] = [batch.xp.asarray(img) for img in images]
    return to_host(op(batch).data["image"])


def expected(img, crop, mirrored, layout):
    h, w = crop
    top, left = int(round((img.shape[0] - h) / 2.0)), int(round((img.shape[1] - w) / 2.0))
    v = img[top:top + h, left:left + w].astype(np.float32)
    v = v[:, ::-1] if mirrored else v
    v = (v - np.float32(MEAN)) / np.float32(STD)
    return v.transpose(2, 0, 1) if layout == "CHW" else v


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_crop_mirror_normalize_is_crop_then_mirror_then_normalize(decoded, device, layout):
    crop = (200, 240)
    for mirror in (0.0, 1.0):
        out = run(ops.crop_mirror_normalize(crop, MEAN, STD, mirror=mirror, layout=layout), decoded, device)
        assert out.shape == (len(decoded), *((3, *crop) if layout == "CHW" else (*crop, 3)))
        for img, got in zip(decoded, out):
            np.testing.assert_allclose(got, expected(img, crop, mirror == 1.0, layout), atol=1e-4)


def test_random_mirror_flips_some_rows_the_same_way_on_every_run(decoded, device):
    op = ops.crop_mirror_normalize(224, MEAN, STD, mirror=0.5)
    out = run(op, decoded, device)
    mirrored = [np.allclose(got, expected(img, (224, 224), True, "CHW"), atol=1e-4) for img, got in zip(decoded, out)]
    plain = [np.allclose(got, expected(img, (224, 224), False, "CHW"), atol=1e-4) for img, got in zip(decoded, out)]
    assert all(m or p for m, p in zip(mirrored, plain)) and 0 < sum(mirrored) < len(decoded)
    np.testing.assert_array_equal(run(op, decoded, device), out)  # draws depend on (seed, epoch, sample) only


def test_crop_mirror_normalize_checks_its_arguments():
    with pytest.raises(ConfigError, match="probability"):
        ops.crop_mirror_normalize(224, mirror=2)
    with pytest.raises(ConfigError, match="layout"):
        ops.crop_mirror_normalize(224, layout="NCHW")


def test_crop_mirror_normalize_fuses_with_the_ops_around_it():
    from gpuio.ops.fused import FusedCropResizeNormalize

    chain = ops.Compose([ops.random_resized_crop(224), ops.crop_mirror_normalize(224, MEAN, STD, mirror=0.5)])
    assert len(chain.fused) == 1 and isinstance(chain.fused[0], FusedCropResizeNormalize)
    assert [type(o).__name__ for o in chain.fused[0].ops] == ["RandomResizedCrop", "CenterCrop", "Flip", "Normalize"]
