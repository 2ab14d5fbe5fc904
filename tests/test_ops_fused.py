"""The fused chain's math (``fused_reference``, which the CUDA kernel mirrors line by
line) against the unfused CPU ops, on real decoded JPEGs; the window a fused chain
decodes (``DecodeFused``: libjpeg-turbo's partial decode on the CPU, nvImageCodec's
region decode on the GPU) and the plan moved onto it; decode + chain fused against
unfused on each device."""

import numpy as np
import pytest

from gpuio import config, ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.ops import fused
from gpuio.ops.fused import DecodeFused, FusedCropResizeNormalize, fused_reference, to_region
from gpuio.ops.geometry import image_sizes
from gpuio.sample import make_image_tree
from tests.conftest import to_host

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]


def sample_jpegs(tmp_path_factory):
    """JPEGs of the sample generator: some grayscale, progressive, CMYK, EXIF-rotated."""
    import glob

    root = make_image_tree(tmp_path_factory.mktemp("imgs"), count=24, classes=2, seed=1, progress=False)
    return [np.fromfile(p, np.uint8) for p in sorted(glob.glob(f"{root}/*/*.jpg"))]


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    return sample_jpegs(tmp_path_factory)


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):  # imported by other test modules: no fixtures of this one
    bufs = sample_jpegs(tmp_path_factory)
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
    plan = fused.plan(batch, image_sizes(decoded))
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
    hw = image_sizes(decoded[:2])
    hw[1] = (1200, 1300)
    plan = FusedCropResizeNormalize(chain).plan(batch, hw)
    assert plan["ok"].tolist() == [False, True] and [i for i, _ in batch.errors] == [100]
    assert plan["out_hw"][1].tolist() == [5, 5]


@pytest.mark.parametrize("name", ["rrc-flip-norm", "rrc-cubic-vflip", "crop-resize-crop"])
def test_window_a_fused_chain_decodes(decoded, name):
    """The window ``DecodeFused`` has decoded (on the GPU: the nvImageCodec region) is the
    plan's ``clip``; for random_resized_crop it is the crop the op draws alone for the same
    (seed, epoch, sample). The plan moved onto the window (``to_region``) gives the same
    output from the window's pixels as the plan from the whole image, bit for bit."""
    chain = CHAINS[name]()
    op = FusedCropResizeNormalize(chain)
    plan = op.plan(fresh(decoded), image_sizes(decoded))
    if name.startswith("rrc"):
        crops, ok = chain[0].boxes(fresh(decoded), image_sizes(decoded))
        assert ok.all()
        want = np.concatenate([crops[:, :2], crops[:, :2] + crops[:, 2:4]], axis=1)
        assert plan["clip"].tolist() == want.tolist()
    moved = {k: v.copy() for k, v in plan.items()}
    windows = []
    for row, img in enumerate(decoded):
        y0, x0, y1, x1 = plan["clip"][row].tolist()
        assert 0 <= y0 < y1 <= img.shape[0] and 0 <= x0 < x1 <= img.shape[1]
        windows.append(img[y0:y1, x0:x1])
        to_region(moved, row, (y0, x0, y1, x1))
        assert moved["clip"][row].tolist() == [0, 0, y1 - y0, x1 - x0]
    mean, inv_std = chain[-1].channel_params(3)
    args = dict(interp=op.interp, antialias=op.antialias, layout=chain[-1].layout, dtype=chain[-1].dtype)
    whole = fused_reference(decoded, plan, mean, inv_std, **args)
    assert np.array_equal(fused_reference(windows, moved, mean, inv_std, **args), whole)


DECODE_CHAINS = {
    "rrc-flip": lambda: [ops.random_resized_crop(64), ops.flip(), ops.normalize(MEAN, STD)],
    "rrc-area-hwc-u8": lambda: [ops.random_resized_crop((48, 40), interp="area"), ops.flip(False, p=1.0),
                                ops.normalize(0, 1, layout="HWC", dtype="uint8")],
    "resize-centercrop": lambda: [ops.resize(shorter=80), ops.center_crop(64), ops.normalize(MEAN, STD)],
}


@pytest.mark.parametrize("name", list(DECODE_CHAINS))
def test_decode_fused_equals_decode_then_ops(device, monkeypatch, encoded, name):
    """``decode_image`` + chain fused (CPU: partial decode + C resampler; GPU: nvImageCodec
    region decode + the kernel) against the unfused ops on the same device: the same
    draws, rows and errors, outputs within 1 level (Pillow's rounding) plus, on the GPU,
    the region decode's chroma upsampling at the window's edges (2 levels). Progressive,
    CMYK, EXIF-rotated, truncated and non-image rows take the per-image fallbacks."""
    # the CPU's DCT scaling is tested elsewhere
    monkeypatch.setattr(fused, "dct_denoms", lambda box, out_hw, subsampling: np.ones(len(box), np.int64))
    bufs = list(encoded) + [encoded[0][: len(encoded[0]) // 2], np.frombuffer(b"not an image", np.uint8)]

    def run(fuse):
        index = np.arange(len(bufs))
        dev = Device("cuda", 0) if device == "cuda" else Device("cpu")
        batch = Batch({"data": list(bufs)}, index, sample_seeds(5, 2, index), device=dev, on_error="skip")
        pipe = ops.Compose([ops.decode_image()] + DECODE_CHAINS[name](), fuse=fuse)
        assert isinstance(pipe.fused[0], DecodeFused) == fuse
        return pipe(batch)

    got, want = run(True), run(False)
    assert got.index.tolist() == want.index.tolist() == list(range(len(encoded)))
    assert [i for i, _ in got.errors] == [i for i, _ in want.errors] == [len(encoded), len(encoded) + 1]
    normalize = DECODE_CHAINS[name]()[-1]
    scale = np.ones(3) if normalize.dtype == "uint8" else np.asarray(STD)
    bound = 1.0 if device == "cpu" else 3.0
    assert len(got.data["image"]) == len(want.data["image"])
    for g, w in zip(got.data["image"], want.data["image"]):
        g, w = to_host(g).astype(np.float64), to_host(w).astype(np.float64)
        assert g.shape == w.shape
        axis = (-1, 1, 1) if normalize.layout == "CHW" else (1, 1, -1)
        levels = np.abs(g - w) * scale.reshape(axis)
        assert levels.max() <= bound + 1e-3 and levels.mean() < 0.5


def test_decode_fused_splits_a_cpu_batch_into_parts_on_the_pool(monkeypatch, encoded):
    """A CPU batch's window decodes run as parts on the process's pool (runs of rows with
    about equal decoded pixels): the output, the rows and the warnings equal those of one
    part, and an image that libjpeg stops on in a later part (a stray restart marker in its
    entropy-coded data) is redone whole in its own row."""
    bad = encoded[20].copy()
    bad[len(bad) // 2: len(bad) // 2 + 2] = [0xFF, 0xD3]
    bufs = list(encoded[:20]) + [bad] + list(encoded[21:])
    runs_made = []

    def runs(cost, parts):
        got = real_runs(cost, parts)
        runs_made.append([run.tolist() for run in got])
        sums = [int(cost[run].sum()) for run in got]
        assert sorted(np.concatenate(got).tolist()) == list(range(len(cost)))
        assert max(sums) - min(sums) <= 2 * int(cost.max())  # about equal: within a row or two
        return got

    real_runs = fused._runs
    monkeypatch.setattr(fused, "_runs", runs)

    def run(parts):
        index = np.arange(len(bufs))
        batch = Batch({"data": list(bufs)}, index, sample_seeds(5, 2, index), on_error="skip")
        with config.override(decode_parts=parts):
            return ops.Compose([ops.decode_image(), *DECODE_CHAINS["rrc-flip"]()])(batch)

    one, three = run(1), run(3)
    assert len(runs_made[0]) == 1 and len(runs_made[1]) == 3
    assert one.index.tolist() == three.index.tolist() == list(range(len(bufs)))
    assert [i for i, _ in one.warnings] == [i for i, _ in three.warnings] == [20]
    assert np.array_equal(one.data["image"], three.data["image"])
    assert not np.array_equal(three.data["image"][20], three.data["image"][19])
    assert real_runs(np.array([], np.int64), 4) == [] and len(real_runs(np.zeros(3, np.int64), 4)) == 1
