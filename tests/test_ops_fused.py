"""The fused chain's math (``fused_reference``, which the CUDA kernel mirrors line by
line) against the unfused CPU ops, on real decoded JPEGs. Runs without a GPU."""

import numpy as np
import pytest

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.ops.fused import FusedCropResizeNormalize, fused_reference
from gpuio.ops.geometry import _sizes
from gpuio.sample import make_image_tree

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    import glob

    root = make_image_tree(tmp_path_factory.mktemp("imgs"), count=24, classes=2, seed=1, progress=False)
    bufs = [np.fromfile(p, np.uint8) for p in sorted(glob.glob(f"{root}/*/*.jpg"))]
    index = np.arange(len(bufs))
    batch = ops.decode_image()(Batch({"data": bufs}, index, sample_seeds(0, 0, index)))
    return batch.data["image"]


def fresh(images, seed=3):
    index = np.arange(100, 100 + len(images))
    return Batch({"image": list(images)}, index, sample_seeds(seed, 1, index))


CHAINS = {
    "rrc-flip-norm": lambda: [ops.random_resized_crop(224), ops.flip(), ops.normalize(MEAN, STD)],
    "rrc-cubic-vflip": lambda: [ops.random_resized_crop((96, 128), interp="cubic"), ops.flip(False),
                                ops.normalize(MEAN, STD, layout="HWC")],
    "rrc-area-f16": lambda: [ops.random_resized_crop(64, interp="area"), ops.normalize(MEAN, STD,
                                                                                       dtype="float16")],
    "resize-centercrop": lambda: [ops.resize(shorter=256), ops.center_crop(224), ops.normalize(MEAN, STD)],
    "centercrop-resize-flip-u8": lambda: [ops.center_crop(280), ops.resize((160, 120)), ops.flip(p=1.0),
                                          ops.normalize(0, 1, layout="HWC", dtype="uint8")],
    "crop-resize-crop": lambda: [ops.center_crop(300), ops.resize(shorter=200), ops.center_crop((150, 180)),
                                 ops.normalize(MEAN, STD)],
    "upsample": lambda: [ops.center_crop(100), ops.resize(333), ops.flip(), ops.normalize(MEAN, STD)],
    "normalize-only": lambda: [ops.center_crop(200), ops.normalize(MEAN, STD)],
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_fused_reference_matches_unfused_cpu_ops(decoded, name):
    chain = CHAINS[name]()
    fused = FusedCropResizeNormalize(chain)
    unfused = ops.Compose(chain, fuse=False)(fresh(decoded)).data["image"]
    batch = fresh(decoded)
    plan = fused.plan(batch, _sizes(decoded))
    assert plan["ok"].all()
    mean, inv_std = chain[-1].channel_params(3)
    ref = fused_reference(decoded, plan, mean, inv_std, interp=fused.interp, antialias=fused.antialias,
                          layout=chain[-1].layout, dtype=chain[-1].dtype)
    assert isinstance(ref, np.ndarray) and ref.shape == unfused.shape and ref.dtype == unfused.dtype
    scale = 1.0 if chain[-1].dtype == "uint8" else np.asarray(STD, np.float32)
    if chain[-1].layout == "CHW":
        scale = np.reshape(scale, (-1, 1, 1))
    levels = np.abs(ref.astype(np.float64) - unfused.astype(np.float64)) * scale  # in 0-255 pixel levels
    tol = 0.15 if chain[-1].dtype == "float16" else 1e-3  # float16: 1 ulp of ~2 is 0.1 level
    # Pillow rounds its horizontal pass: with non-negative filters (linear, area) the
    # two differ by at most 1 level; cubic's negative lobes amplify that rounding
    bound = 2.0 if "cubic" in name else 1.0
    assert levels.max() <= bound + tol and levels.mean() < 0.5
    if name == "normalize-only":  # no resampling: identical arithmetic
        assert levels.max() < 1e-3


def test_plan_composes_boxes(decoded):
    img = decoded[0]
    h, w = img.shape[:2]
    chain = [ops.resize(shorter=256), ops.center_crop(224), ops.normalize()]
    plan = FusedCropResizeNormalize(chain).plan(fresh([img]), np.array([[h, w]]))
    rh, rw = chain[0].out_size(h, w)
    top, left = round((rh - 224) / 2), round((rw - 224) / 2)
    np.testing.assert_allclose(plan["box"][0], [top * h / rh, left * w / rw, 224 * h / rh, 224 * w / rw])
    assert plan["clip"][0].tolist() == [0, 0, h, w] and plan["out_hw"][0].tolist() == [224, 224]
    chain = [ops.center_crop(100), ops.random_resized_crop(50), ops.flip(p=1), ops.normalize()]
    batch = fresh([img])
    plan = FusedCropResizeNormalize(chain).plan(batch, np.array([[h, w]]))
    t, l, ch, cw = chain[1].boxes(batch, np.array([[100, 100]]))[0][0].tolist()
    top, left = round((h - 100) / 2), round((w - 100) / 2)
    assert plan["box"][0].tolist() == [top + t, left + l, ch, cw]
    assert plan["clip"][0].tolist() == [top + t, left + l, top + t + ch, left + l + cw]
    assert plan["flip"].tolist() == [1] and plan["out_hw"][0].tolist() == [50, 50]


def test_fused_op_on_cpu_runs_the_chain(decoded):
    chain = CHAINS["rrc-flip-norm"]()
    a = FusedCropResizeNormalize(chain)(fresh(decoded)).data["image"]
    b = ops.Compose(chain)(fresh(decoded)).data["image"]
    assert np.array_equal(a, b)


def test_fused_plan_rejects_small_images(decoded):
    chain = [ops.center_crop(1000), ops.resize(shorter=10), ops.center_crop(5), ops.normalize()]
    batch = fresh(decoded[:2])
    batch.on_error = "skip"
    hw = _sizes(decoded[:2])
    hw[1] = (1200, 1300)
    plan = FusedCropResizeNormalize(chain).plan(batch, hw)
    assert plan["ok"].tolist() == [False, True] and [i for i, _ in batch.errors] == [100]
    assert plan["out_hw"][1].tolist() == [5, 5]
