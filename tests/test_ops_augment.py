"""The training augmentations (gpuio.ops.augment, gpuio.ops.mix) against references
computed apart from them: Pillow's ImageEnhance and convert("L"), OpenCV's GaussianBlur,
per-pixel formulas in plain NumPy written from DALI's and torchvision's definitions;
draws that follow the sample, not the batch; argument errors; CPU/GPU agreement (the
``device`` fixture's cuda twin)."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageStat

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.errors import ConfigError, DataError
from gpuio.sample import sample_image


def make_batch(images, index=None, device="cpu", seed=3, **fields):
    index = np.arange(len(images)) if index is None else np.asarray(index)
    if device != "cpu":
        import cupy

        images = [cupy.asarray(img) for img in images]
    return Batch({"image": list(images), **fields}, index, sample_seeds(seed, 0, index), device=Device(device))


def host(v):
    if isinstance(v, list):
        return [host(x) for x in v]
    if hasattr(v, "__cuda_array_interface__"):
        import cupy

        return cupy.asnumpy(v)
    return np.asarray(v)


def run(op, images, device="cpu", index=None, **fields):
    batch = op(make_batch(images, index, device, **fields))
    return host(batch.data["image"]), {k: host(batch.data[k]) for k in fields}


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(7)
    return [sample_image(rng, 48, 64), sample_image(rng, 40, 40), sample_image(rng, 48, 64), sample_image(rng, 33, 57)]


def close(a, b, max_diff=1, mean_diff=0.25):
    d = np.abs(np.asarray(a, np.int64) - np.asarray(b, np.int64))
    assert d.max() <= max_diff and d.mean() <= mean_diff, (d.max(), d.mean())


def round_u8(v):
    return np.clip(np.floor(np.asarray(v, np.float64) + 0.5), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------- colour


def test_brightness_matches_pillow_enhance(images):
    out, _ = run(ops.brightness_contrast(brightness=1.3), images)
    for img, got in zip(images, out):
        pil = np.asarray(ImageEnhance.Brightness(Image.fromarray(img)).enhance(1.3)).astype(np.int64)
        # the same product; Pillow's blend truncates it where gpuio (and DALI) round
        assert np.array_equal(pil, np.clip(np.floor(img * np.float32(1.3)), 0, 255))
        assert set(np.unique(got - pil).tolist()) <= {0, 1}


def test_contrast_about_the_mean_grey_matches_pillow_enhance(images):
    img = images[0]
    # Pillow blends with the image's mean grey; DALI's contrast_center is that level here
    mean = int(ImageStat.Stat(Image.fromarray(img).convert("L")).mean[0] + 0.5)
    (got,), _ = run(ops.brightness_contrast(contrast=0.6, contrast_center=mean), [img])
    pil = np.asarray(ImageEnhance.Contrast(Image.fromarray(img)).enhance(0.6)).astype(np.int64)
    assert set(np.unique(got - pil).tolist()) <= {0, 1}  # Pillow truncates, gpuio rounds


def test_brightness_contrast_formula_with_shift_default_center_and_grey(images):
    grey = images[1][..., :1].copy()
    rgba = np.concatenate([images[2], np.full(images[2].shape[:2] + (1,), 77, np.uint8)], axis=2)
    out, _ = run(ops.brightness_contrast(brightness=0.9, contrast=1.5, brightness_shift=0.1), [images[0], grey, rgba])
    assert np.array_equal(out[2][..., 3], rgba[..., 3])  # alpha passes through
    for img, got in zip([images[0], grey, rgba[..., :3]], [out[0], out[1], out[2][..., :3]]):
        ref = 0.1 * 255 + 0.9 * (128 + 1.5 * (img.astype(np.float64) - 128))
        assert got.shape == img.shape and got.dtype == np.uint8
        close(got, round_u8(ref), max_diff=1, mean_diff=0.01)


def yiq_reference(img, hue, sat, value):
    """DALI's hsv per pixel, written out: Y, I, Q from RGB; (I, Q) rotated by the hue
    angle and scaled by the saturation; all scaled by the value; back to RGB."""
    r, g, b = (img[..., k].astype(np.float64) for k in range(3))
    y = 0.299 * r + 0.587 * g + 0.114 * b
    i = 0.596 * r - 0.274 * g - 0.321 * b
    q = 0.211 * r - 0.523 * g + 0.311 * b
    h = math.radians(hue)
    i, q = sat * (math.cos(h) * i + math.sin(h) * q), sat * (-math.sin(h) * i + math.cos(h) * q)
    y, i, q = value * y, value * i, value * q
    return np.stack([y + 0.956 * i + 0.621 * q, y - 0.272 * i - 0.647 * q, y - 1.107 * i + 1.705 * q], axis=-1)


@pytest.mark.parametrize("hue,sat,value", [(0, 1, 1), (40, 1, 1), (-90, 0.5, 1.2), (180, 1.5, 0.8)])
def test_hsv_matches_the_yiq_formula(images, hue, sat, value):
    out, _ = run(ops.hsv(hue=hue, saturation=sat, value=value), images)
    for img, got in zip(images, out):
        close(got, round_u8(yiq_reference(img, hue, sat, value)), max_diff=1, mean_diff=0.01)
        if (hue, sat, value) == (0, 1, 1):  # DALI's 3-digit YIQ matrices: within a level of the input
            close(got, img, max_diff=1, mean_diff=0.5)


def test_hsv_saturation_zero_is_pillow_grey_and_alpha_passes(images):
    rgba = np.concatenate([images[0], np.full(images[0].shape[:2] + (1,), 77, np.uint8)], axis=2)
    (got,), _ = run(ops.hsv(saturation=0), [rgba])
    grey = np.asarray(Image.fromarray(images[0]).convert("L"))
    for k in range(3):
        close(got[..., k], grey, max_diff=1, mean_diff=0.3)
    assert np.array_equal(got[..., 3], rgba[..., 3])


def test_color_twist_is_hsv_then_brightness_contrast(images):
    out, _ = run(ops.color_twist(brightness=1.1, contrast=0.7, hue=25, saturation=1.3), images)
    for img, got in zip(images, out):
        ref = 1.1 * (128 + 0.7 * (yiq_reference(img, 25, 1.3, 1.0) - 128))
        close(got, round_u8(ref), max_diff=1, mean_diff=0.01)


def test_random_grayscale_is_pillow_luma_for_the_chosen_rows(images):
    op = ops.random_grayscale(p=0.5)
    index = np.arange(40)
    imgs = [images[k % 4] for k in index]
    out, _ = run(op, imgs, index=index)
    batch = make_batch(imgs, index)
    chosen = [batch.rng(row, op.salt).random() < 0.5 for row in range(len(index))]
    assert 5 < sum(chosen) < 35
    for img, got, grey in zip(imgs, out, chosen):
        if grey:
            ref = np.asarray(Image.fromarray(img).convert("L"))
            for k in range(3):
                close(got[..., k], ref, max_diff=1, mean_diff=0.3)
        else:
            assert np.array_equal(got, img)
    one = images[0][..., :1].copy()
    assert np.array_equal(run(ops.random_grayscale(p=1.0), [one])[0][0], one)


def test_colour_ops_need_rgb(images):
    grey = images[0][..., :1].copy()
    with pytest.raises(DataError, match="3 or more channels"):
        ops.hsv(hue=10)(make_batch([grey]))
    with pytest.raises(DataError, match="color_twist"):
        ops.color_twist(hue=10)(make_batch([grey]))


# ---------------------------------------------------------------- blur and erasing


@pytest.mark.parametrize("kw,cv", [({"sigma": 1.0}, ((7, 7), 1.0, 1.0)), ({"sigma": 2.3}, ((15, 15), 2.3, 2.3)),
                                   ({"window_size": 5}, ((5, 5), 1.1, 1.1)),
                                   ({"window_size": 11}, ((11, 11), 0, 0)),
                                   ({"sigma": 1.5, "window_size": 3}, ((3, 3), 1.5, 1.5)),
                                   ({"sigma": (0.8, 2.0), "window_size": (5, 9), "per_axis": True},
                                    ((9, 5), 2.0, 0.8))])
def test_gaussian_blur_matches_opencv(images, kw, cv):
    (ksize, sx, sy) = cv
    out, _ = run(ops.gaussian_blur(**kw), images)
    for img, got in zip(images, out):
        # OpenCV computes the sigma of a window alone with DALI's formula (above 7 taps;
        # below it takes fixed binomial kernels, so 1.1 is given for 5 taps); both mirror
        # borders without repeating the edge (BORDER_REFLECT_101); OpenCV's uint8 path
        # is fixed point, hence a level at most
        ref = cv2.GaussianBlur(img, ksize, sigmaX=sx, sigmaY=sy, borderType=cv2.BORDER_REFLECT_101)
        close(got, ref, max_diff=1, mean_diff=0.1)


def test_gaussian_blur_tiny_image_and_sigma_range(images):
    tiny = images[0][:2, :3].copy()
    (got,), _ = run(ops.gaussian_blur(sigma=2.0), [tiny])
    close(got, cv2.GaussianBlur(tiny, (13, 13), 2.0, borderType=cv2.BORDER_REFLECT_101), max_diff=1, mean_diff=0.5)
    op = ops.gaussian_blur(sigma=(0.5, 3.0))
    sigmas, windows = op.params(make_batch(images))
    assert len(set(sigmas[:, 0].tolist())) == 4 and np.array_equal(sigmas[:, 0], sigmas[:, 1])
    assert np.array_equal(windows, 2 * np.ceil(3 * sigmas).astype(int) + 1)


def test_gaussian_blur_float32_images_stay_float32(images):
    img = images[3].astype(np.float32) / 255
    (got,), _ = run(ops.gaussian_blur(sigma=1.2), [img])
    ref = cv2.GaussianBlur(img, (9, 9), 1.2, borderType=cv2.BORDER_REFLECT_101)
    assert got.dtype == np.float32 and np.abs(got - ref).max() < 1e-5


def test_colour_ops_name_the_sample_that_is_not_uint8(images):
    with pytest.raises(DataError, match="uint8 HWC.*row 1") as err:
        run(ops.brightness_contrast(brightness=1.2), [images[0], images[1].astype(np.float32)], index=[5, 9])
    assert err.value.sample == 9


def test_the_c_calls_check_their_buffers(images):
    from gpuio.ops import _augment

    src = [images[0], images[1]]
    table = np.zeros((2, 12), np.float32)
    with pytest.raises(ValueError, match=r"outs\[1\]"):
        _augment.color(src, table, [np.empty_like(images[0]), np.empty_like(images[0])])
    with pytest.raises(ValueError, match="table"):
        _augment.color(src, table[:1], [np.empty_like(img) for img in src])
    with pytest.raises(ValueError, match=r"images\[0\]"):
        _augment.lut([np.zeros((2, 2, 5), np.uint8)], np.zeros((1, 4, 256), np.uint8), [np.zeros((2, 2, 5), np.uint8)])
    with pytest.raises(ValueError, match=r"images\[0\]"):
        _augment.histogram([images[0][:, ::2]], np.zeros((1, 4, 256), np.int64))  # not C-contiguous
    with pytest.raises(ValueError, match="odd"):
        _augment.blur(src[:1], [np.ones(2, np.float32)], [np.ones(3, np.float32)], [np.empty_like(images[0])])
    with pytest.raises(ValueError, match="interp"):
        _augment.warp(src[:1], np.zeros((1, 6), np.float32), np.zeros((1, 4), np.float32), 2, 0,
                      [np.empty_like(images[0])])
    outs = [np.empty_like(img) for img in src]
    with pytest.raises(ValueError, match=r"images\[1\]: want the shape of images\[0\]"):
        _augment.mix(src, np.zeros((2, 2), np.float32), outs)
    same, same_outs = [images[0]] * 2, [np.empty_like(images[0])] * 2
    with pytest.raises(ValueError, match=r"boxes\[1\]: want 0 <= y0 <= y1 <= height"):
        _augment.paste(same, np.array([[0, 0, 1, 1], [0, 0, 1, 99]], np.int64), same_outs)
    with pytest.raises(ValueError, match=r"params\[0, 0\]: a step is -1 or 0-3"):
        _augment.jitter([images[0][..., :1].copy()], np.array([[2, -1, -1, -1, 1, 1, 1, 0]], np.float64),
                        [np.empty_like(images[0][..., :1])])
    with pytest.raises(ValueError, match="0 < alpha <= 1"):
        _augment.rng_beta(np.zeros((2, 6), np.uint64), None, 1.5, np.zeros(2))


def erasing_reference(rng, h, w, p, scale, ratio):
    """torchvision's RandomErasing.get_params with NumPy's generator (a box of no pixels,
    which would erase nothing, is tried again as one that does not fit)."""
    if not rng.random() < p:
        return None
    for _ in range(10):
        area = h * w * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        eh, ew = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if not (0 < eh < h and 0 < ew < w):
            continue
        return int(rng.integers(0, h - eh + 1)), int(rng.integers(0, w - ew + 1)), eh, ew
    return None


def test_random_erasing_follows_torchvision(images):
    op = ops.random_erasing(p=0.7, scale=(0.02, 0.6), value=(10, 20, 30))
    index = np.arange(30)
    imgs = [images[k % 4] for k in index]
    out, _ = run(op, imgs, index=index)
    batch = make_batch(imgs, index)
    erased = 0
    for row, (img, got) in enumerate(zip(imgs, out)):
        box = erasing_reference(batch.rng(row, op.salt), *img.shape[:2], 0.7, (0.02, 0.6), (0.3, 3.3))
        ref = img.copy()
        if box:
            top, left, h, w = box
            ref[top:top + h, left:left + w] = (10, 20, 30)
            erased += 1
        assert np.array_equal(got, ref), row
    assert 10 < erased < 30


@pytest.mark.parametrize("scale, ratio", [((0.02, 0.33), (0.3, 3.3)), ((0.0, 1.0), (1e-3, 1e3))])
def test_random_erasing_boxes_are_the_per_row_generators(scale, ratio):
    """The boxes drawn for the whole batch in one C call equal ``erasing_reference`` on
    ``batch.rng(row, salt)`` for seeds of one and two 32-bit words and images where a
    box fits at once, after retries, or never (1-pixel sides: nothing erased)."""
    rng = np.random.default_rng(9)
    hw = np.concatenate([rng.integers(1, 700, (300, 2)), [[1, 1], [1, 400], [400, 1], [2, 2], [3, 900]]])
    index = np.arange(len(hw))
    op = ops.random_erasing(p=0.8, scale=scale, ratio=ratio)
    for seeds in (sample_seeds(5, 1, index), index.astype(np.uint64)):
        batch = Batch({"image": [None] * len(hw)}, index, seeds)
        want = [erasing_reference(batch.rng(r, op.salt), h, w, 0.8, scale, ratio) or (0, 0, 0, 0)
                for r, (h, w) in enumerate(hw.tolist())]
        assert [tuple(box) for box in op.boxes(batch, hw).tolist()] == want


def test_erase_places_regions_as_dali(images):
    img = images[0]  # 48 x 64
    (got,), _ = run(ops.erase(anchor=(2.4, 3.6, -2, 60), shape=(3.3, 2.5, 5, 10), fill_value=(7, 8, 9)), [img])
    ref = img.copy()
    # DALI 2.4 erases rows floor(2.4)..floor(5.7) and columns floor(3.6)..floor(6.1), clipped
    ref[2:5, 3:6] = (7, 8, 9)
    ref[0:3, 60:64] = (7, 8, 9)
    assert np.array_equal(got, ref)
    (band,), _ = run(ops.erase(anchor=(0.25,), shape=(0.5,), axis_names="W", normalized=True), [img])
    ref = img.copy()
    ref[:, 16:48] = 0
    assert np.array_equal(band, ref)
    (centred,), _ = run(ops.erase(anchor=(10, 10), shape=(3, 4), centered_anchor=True, fill_value=1), [img])
    ref = img.copy()
    ref[8:11, 8:12] = 1
    assert np.array_equal(centred, ref)


def test_jpeg_compression_distortion_is_pillow_jpeg_at_the_drawn_quality(images):
    import io

    grey = images[1][..., :1].copy()
    for quality in (5, 50, 95):
        out, _ = run(ops.jpeg_compression_distortion(quality), [images[0], grey])
        for img, got in zip([images[0], grey], out):
            buf = io.BytesIO()
            Image.fromarray(img[..., 0] if img.shape[2] == 1 else img).save(buf, "JPEG", quality=quality)
            ref = np.asarray(Image.open(buf)).reshape(img.shape)
            assert got.shape == img.shape and np.array_equal(got, ref)
            assert not np.array_equal(got, img)
    op = ops.jpeg_compression_distortion((10, 12))
    batch = make_batch([images[0]] * 30, index=np.arange(30))
    q = op.qualities(batch)
    assert set(q.tolist()) == {10, 11, 12}
    assert q.tolist() == [10 + batch.rng(row, op.salt).integers(0, 3) for row in range(30)]


# ---------------------------------------------------------------- mixing


def test_mixup_images_and_one_hot_labels(images):
    imgs = [images[0], images[2], np.flipud(images[0]).copy()]
    labels = np.array([2, 0, 4])
    op = ops.mixup(alpha=0.4, num_classes=5)
    out, got = run(op, imgs, label=labels)
    batch = make_batch(imgs)
    lam = [batch.rng(row, op.salt).beta(0.4, 0.4) for row in range(3)]
    eye = np.eye(5)
    for row in range(3):
        prev = (row - 1) % 3
        ref = lam[row] * imgs[row].astype(np.float64) + (1 - lam[row]) * imgs[prev]
        close(out[row], round_u8(ref), max_diff=1, mean_diff=0.01)
        np.testing.assert_allclose(got["label"][row], lam[row] * eye[labels[row]] + (1 - lam[row]) * eye[labels[prev]],
                                   atol=1e-6)
    assert out.dtype == np.uint8 and got["label"].dtype == np.float32


def test_cutmix_pastes_torchvision_boxes_and_soft_labels(images):
    imgs = [images[0], images[2], 255 - images[0]]
    soft = np.array([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]], np.float32)
    op = ops.cutmix(alpha=1.0)
    out, got = run(op, imgs, label=soft)
    batch = make_batch(imgs)
    h, w = imgs[0].shape[:2]
    for row in range(3):
        rng = batch.rng(row, op.salt)
        lam = rng.beta(1.0, 1.0)
        cx, cy = rng.integers(0, w), rng.integers(0, h)
        r = 0.5 * math.sqrt(1 - lam)
        y0, x0 = max(cy - int(r * h), 0), max(cx - int(r * w), 0)
        y1, x1 = min(cy + int(r * h), h), min(cx + int(r * w), w)
        ref = imgs[row].copy()
        ref[y0:y1, x0:x1] = imgs[(row - 1) % 3][y0:y1, x0:x1]
        assert np.array_equal(out[row], ref)
        kept = 1 - (y1 - y0) * (x1 - x0) / (h * w)
        np.testing.assert_allclose(got["label"][row], kept * soft[row] + (1 - kept) * soft[(row - 1) % 3], atol=1e-6)


def test_mixup_c_path_is_the_float32_formula(images):
    imgs = [images[0], images[2], 255 - images[0], images[2][::-1].copy()]
    op = ops.mixup(alpha=0.4, num_classes=3)
    out, _ = run(op, imgs, label=np.array([0, 1, 2, 1]))
    w = op.weights(make_batch(imgs)).astype(np.float32)[:, None, None, None]
    stack = np.stack(imgs).astype(np.float32)
    assert np.array_equal(out, round_u8(w * stack + (1 - w) * np.roll(stack, 1, axis=0)))


@pytest.mark.parametrize("alpha", [0.05, 0.4, 1.0, 2.5])
def test_mixing_draws_are_the_batch_generators(images, alpha):
    """Weights and boxes (one C call for alpha <= 1) are exactly the numbers of
    ``batch.rng(row, salt)``: beta, then the box centre's x and y."""
    batch = make_batch([images[0]] * 40, index=np.arange(40) * 7919, seed=2**40 + 3)
    mix, cut = ops.mixup(alpha), ops.cutmix(alpha)
    assert mix.weights(batch).tolist() == [batch.rng(r, mix.salt).beta(alpha, alpha) for r in range(40)]
    lam = cut.weights(batch)
    boxes = cut.boxes(batch, lam, 33, 57)
    for row in range(40):
        rng = batch.rng(row, cut.salt)
        assert lam[row] == rng.beta(alpha, alpha)
        cx, cy = rng.integers(0, 57), rng.integers(0, 33)
        r = 0.5 * math.sqrt(1 - lam[row])
        assert boxes[row].tolist() == [max(cy - int(r * 33), 0), max(cx - int(r * 57), 0), min(cy + int(r * 33), 33),
                                       min(cx + int(r * 57), 57)]


def test_color_jitter_draws_each_row_s_generator_numbers():
    """The batch's order and factors, drawn at once by its streams, are those of
    ``batch.rng(row, salt)``: ``permutation(4)``, then the brightness, contrast,
    saturation and hue ``uniform`` draws."""
    batch = make_batch([np.zeros((8, 8, 3), np.uint8)] * 37, seed=11)
    op = ops.color_jitter(0.4, 0.3, 1.2, 0.1)
    order, factors = op.params(batch)
    for row in range(len(batch)):
        rng = batch.rng(row, op.salt)
        assert order[row].tolist() == rng.permutation(4).tolist()
        assert factors[row].tolist() == [rng.uniform(0.6, 1.4), rng.uniform(0.7, 1.3), rng.uniform(0.0, 2.2),
                                         rng.uniform(-0.1, 0.1)]


def test_color_jitter_c_path_agrees_with_the_array_path(images):
    """uint8 images take one C call; float32 ones (the same levels) the array code that
    the GPU runs: the same draws and steps, the mean grey summed in another precision."""
    rgba = np.concatenate([images[0], images[2][..., :1]], axis=2)
    imgs = [images[0], images[1], rgba, images[3][..., :1].copy(), 255 - images[2]]
    for op in (ops.color_jitter(0.4, 0.4, 0.4, 0.1), ops.color_jitter(hue=0.5), ops.color_jitter(0.2, 0.9)):
        got, _ = run(op, imgs)
        ref, _ = run(op, [img.astype(np.float32) for img in imgs])
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype == np.uint8 and a.shape == b.shape
            close(a, b, max_diff=1, mean_diff=0.001)


def test_mixing_errors(images):
    with pytest.raises(DataError, match="one shape"):
        ops.mixup(num_classes=3)(make_batch([images[0], images[1]], label=np.array([0, 1])))
    with pytest.raises(ConfigError, match="num_classes"):
        ops.cutmix()(make_batch([images[0], images[2]], label=np.array([0, 1])))
    with pytest.raises(DataError, match=r"label 7 is not in \[0, 3\)"):
        ops.mixup(num_classes=3)(make_batch([images[0], images[2]], label=np.array([0, 7])))


# ---------------------------------------------------------------- draws, arguments, devices

RANDOM_OPS = {
    "brightness_contrast": lambda: ops.brightness_contrast(brightness=(0.5, 1.5), contrast=(0.5, 1.5)),
    "hsv": lambda: ops.hsv(hue=(-30, 30), saturation=(0.5, 1.5), value=(0.8, 1.2)),
    "color_twist": lambda: ops.color_twist(brightness=(0.8, 1.2), contrast=(0.8, 1.2), hue=(-20, 20),
                                           saturation=(0.5, 1.5)),
    "random_grayscale": lambda: ops.random_grayscale(p=0.5),
    "gaussian_blur": lambda: ops.gaussian_blur(sigma=(0.3, 2.0)),
    "random_erasing": lambda: ops.random_erasing(p=0.9),
    "jpeg_compression_distortion": lambda: ops.jpeg_compression_distortion((5, 60)),
    "rotate": lambda: ops.rotate((-40, 40), keep_size=True),
    "warp_affine": lambda: ops.warp_affine(angle=(-20, 20), scale=(0.8, 1.2), fill_value=0),
}


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_a_sample_gets_the_same_draws_in_any_batch(images, name):
    imgs = [images[k % 4] for k in range(8)]
    whole, _ = run(RANDOM_OPS[name](), imgs, index=np.arange(8))
    part, _ = run(RANDOM_OPS[name](), [imgs[6], imgs[1], imgs[3]], index=[6, 1, 3])
    for got, row in zip(part, [6, 1, 3]):
        assert np.array_equal(got, whole[row])
    assert any(not np.array_equal(a, b) for a, b in zip(whole, imgs))


@pytest.mark.parametrize("op", [ops.MixUp(0.5, 4), ops.CutMix(0.5, 4)])
def test_mixing_weights_follow_the_sample(images, op):
    assert np.array_equal(op.weights(make_batch([images[0]] * 3, index=[4, 9, 2]))[[0, 1]],
                          op.weights(make_batch([images[0]] * 2, index=[4, 9])))


@pytest.mark.parametrize("make,message", [
    (lambda: ops.brightness_contrast(contrast=-1), r"contrast=-1: each value must be in \[0.0, inf\]"),
    (lambda: ops.brightness_contrast(contrast_center=300), r"contrast_center=300.*\[0, 255\]"),
    (lambda: ops.brightness_contrast(brightness=(1.5, 0.5)), r"brightness=.*low <= high"),
    (lambda: ops.hsv(saturation="x"), "saturation is a number or a"),
    (lambda: ops.hsv(hue=500), r"hue=500.*\[-360, 360\]"),
    (lambda: ops.color_twist(brightness=-0.1), r"brightness=-0.1.*\[0.0, inf\]"),
    (lambda: ops.random_grayscale(p=1.5), r"p=1.5.*\[0.0, 1.0\]"),
    (lambda: ops.gaussian_blur(), "sigma= .* or window_size="),
    (lambda: ops.gaussian_blur(window_size=4), "window_size must be an odd"),
    (lambda: ops.gaussian_blur(sigma=0), r"sigma=0.*\[0.001, 1000.0\]"),
    (lambda: ops.random_erasing(scale=(0.5, 0.1)), "scale=.*low <= high"),
    (lambda: ops.random_erasing(value=300), r"value is one level in \[0, 255\]"),
    (lambda: ops.mixup(alpha=0), "alpha .* > 0"),
    (lambda: ops.jpeg_compression_distortion(0), r"quality=0.*\[1, 100\]"),
    (lambda: ops.jpeg_compression_distortion((10.5, 20)), "range of ints"),
    (lambda: ops.erase(anchor=(1, 2, 3), shape=(1, 2, 3)), r"2 coordinate\(s\) per region \(HW\)"),
    (lambda: ops.erase(anchor=(1, 2), shape=(-1, 2)), "shape must be >= 0"),
    (lambda: ops.erase(anchor=(1,), shape=(1,), axis_names="C"), "axis_names 'C'"),
    (lambda: ops.cutmix(num_classes=0), "num_classes must be an int >= 1"),
    (lambda: ops.rotate(10, fill_value=-1), r"fill_value is one level in \[0, 255\]"),
    (lambda: ops.rotate(10, interp_type="cubic"), "interp_type 'cubic'; choose one of linear, nearest"),
    (lambda: ops.rotate((10, 5)), "angle=.*low <= high"),
    (lambda: ops.warp_affine([1, 0, 0, 1]), r"matrix is 2x3 \(6 finite values"),
    (lambda: ops.warp_affine([0, 0, 0, 0, 0, 0], inverse_map=False), "cannot be inverted"),
    (lambda: ops.warp_affine(size=(0, 4)), r"size is the output \(height, width\)"),
    (lambda: ops.warp_affine(scale=0), r"scale=0.*\[0.001, 1000.0\]"),
])
def test_arguments_are_checked_when_made(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


AGREEMENT_OPS = {
    "brightness_contrast": lambda: ops.brightness_contrast(brightness=(0.5, 1.5), contrast=(0.5, 1.5)),
    "hsv": lambda: ops.hsv(hue=(-30, 30), saturation=(0.5, 1.5), value=(0.8, 1.2)),
    "color_twist": lambda: ops.color_twist(brightness=1.1, contrast=0.8, hue=15, saturation=1.2),
    "random_grayscale": lambda: ops.random_grayscale(p=0.5),
    "gaussian_blur": lambda: ops.gaussian_blur(sigma=(0.3, 2.0)),
    "random_erasing": lambda: ops.random_erasing(p=0.9, value=(1, 2, 3)),
    "jpeg_compression_distortion": lambda: ops.jpeg_compression_distortion((5, 60)),
    "erase": lambda: ops.erase(anchor=(0.1, 0.2), shape=(0.3, 0.4), normalized=True, fill_value=(1, 2, 3)),
    "mixup": lambda: ops.mixup(0.4, num_classes=3),
    "cutmix": lambda: ops.cutmix(1.0, num_classes=3),
    "rotate": lambda: ops.rotate((-40, 40), fill_value=(9, 8, 7)),
    "rotate_nearest": lambda: ops.rotate(33.0, interp_type="nearest"),
    "warp_affine": lambda: ops.warp_affine(angle=(-20, 20), shear=(-5, 5), scale=(0.8, 1.2)),
    "color_jitter": lambda: ops.color_jitter(0.4, 0.4, 0.4, 0.1),
}
# the GPU runs the C path's float32 arithmetic in its kernels (no FMA): the same levels
EXACT_ON_GPU = {"brightness_contrast", "hsv", "color_twist", "random_grayscale", "gaussian_blur", "random_erasing",
                "jpeg_compression_distortion", "erase", "rotate", "rotate_nearest", "warp_affine"}


@pytest.mark.parametrize("name", sorted(AGREEMENT_OPS))
def test_cpu_and_device_agree(images, device, name):
    imgs = [images[0], images[2], 255 - images[0], images[2][::-1].copy()]
    labels = np.array([0, 1, 2, 1])
    cpu, cpu_labels = run(AGREEMENT_OPS[name](), imgs, label=labels)
    got, got_labels = run(AGREEMENT_OPS[name](), imgs, device, label=labels)
    for a, b in zip(cpu, got):
        if name in EXACT_ON_GPU:
            assert np.array_equal(a, b)
        else:  # float32 sums in another order on the GPU: a level where a value lies at .5
            close(a, b, max_diff=1, mean_diff=0.01)
    np.testing.assert_allclose(np.asarray(cpu_labels["label"], np.float64), np.asarray(got_labels["label"], np.float64),
                               rtol=1e-6)


# ---------------------------------------------------------------- geometry


@pytest.mark.parametrize("interp", ["linear", "nearest"])
def test_rotate_by_quarter_turns_is_exact(images, interp):
    for img in images:
        out = [run(ops.rotate(a, interp_type=interp), [img])[0][0] for a in (90, 180, 270, -90)]
        # counter-clockwise on screen (y down), as np.rot90
        for got, ref in zip(out, [np.rot90(img), img[::-1, ::-1], np.rot90(img, -1), np.rot90(img, -1)]):
            assert np.array_equal(got, ref)


def test_rotated_size_is_the_bounding_box_with_the_input_parity():
    from gpuio.ops.warp import rotated_size

    assert rotated_size(48, 64, 0) == (48, 64) and rotated_size(48, 64, 90) == (64, 48)
    assert rotated_size(48, 64, 45) == (80, 80)  # ceil(0.7071 * 112 - 0.01) = 80, even as 48 and 64
    assert rotated_size(33, 57, 10) == (43, 63)  # 62.2 -> 63 (57 is odd), 42.4 -> 43 (33 is odd)
    assert rotated_size(33, 57, 80) == (63, 43)  # the sides swap their parity sources past 45 degrees


def opencv_warp(img, m, out_hw, fill):
    """OpenCV's warpAffine with gpuio's destination-to-source matrix ``m`` (pixel centres
    at +0.5) moved to OpenCV's integer centres: src = A (dst + 0.5) + t - 0.5."""
    a, t = m[:, :2], m[:, 2]
    cv_m = np.concatenate([a, (a @ [0.5, 0.5] + t - 0.5)[:, None]], axis=1)
    border = (dict(borderMode=cv2.BORDER_REPLICATE) if fill is None
              else dict(borderMode=cv2.BORDER_CONSTANT, borderValue=(fill,) * 4))
    return cv2.warpAffine(img, cv_m, (out_hw[1], out_hw[0]), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP, **border)


@pytest.mark.parametrize("angle,fill,keep", [(30, 0, False), (-17.5, None, True), (135, 200, False)])
def test_rotate_matches_opencv(images, angle, fill, keep):
    from gpuio.ops.warp import rotated_size, rotation_matrix

    for img in images:
        (got,), _ = run(ops.rotate(angle, fill_value=fill, keep_size=keep), [img])
        out_hw = img.shape[:2] if keep else rotated_size(*img.shape[:2], angle)
        assert got.shape == (*out_hw, 3)
        ref = opencv_warp(img, rotation_matrix(angle, img.shape[:2], out_hw), out_hw, fill)
        # OpenCV rounds source coordinates to 1/32 pixel and weights to fixed point
        close(got, ref, max_diff=2, mean_diff=0.05)


def test_warp_affine_matrix_translation_fill_and_inverse(images):
    img = images[0]
    (got,), _ = run(ops.warp_affine([1, 0, 5, 0, 1, -3], fill_value=(1, 2, 3)), [img])
    ref = np.empty_like(img)
    ref[...] = (1, 2, 3)
    ref[3:, :-5] = img[:-3, 5:]
    assert np.array_equal(got, ref)
    (back,), _ = run(ops.warp_affine([1, 0, -5, 0, 1, 3], fill_value=(1, 2, 3), inverse_map=False), [img])
    assert np.array_equal(back, ref)
    (small,), _ = run(ops.warp_affine([2, 0, 0, 0, 2, 0], size=(24, 32)), [img])
    # every output pixel lies between 4 source pixels: OpenCV rounds the .25/.5/.75 ties its own way
    close(small, opencv_warp(img, np.array([[2.0, 0, 0], [0, 2, 0]]), (24, 32), None), max_diff=1, mean_diff=0.3)


def test_warp_affine_far_outside_reads_the_border_or_the_fill(images):
    img = images[0]
    (clamped,), _ = run(ops.warp_affine([1, 0, 1e12, 0, 1, -1e12]), [img])
    assert np.all(clamped == img[0, -1])  # x beyond the right edge, y above the top: the top-right pixel
    (filled,), _ = run(ops.warp_affine([1, 0, -1e12, 0, 1, 0], fill_value=(4, 5, 6)), [img])
    assert np.all(filled == (4, 5, 6))


def test_warp_affine_random_rotation_is_rotate_with_keep_size(images):
    a, _ = run(ops.warp_affine(angle=25.0, fill_value=0), images)
    b, _ = run(ops.rotate(25.0, fill_value=0, keep_size=True), images)
    for x, y in zip(a, b):
        close(x, y, max_diff=1, mean_diff=0.01)
    c, _ = run(ops.warp_affine(angle=(-30, 30), scale=(0.8, 1.2), shear=(-10, 10), translate_x=(-4, 4)), images)
    assert [x.shape for x in c] == [x.shape for x in images]
    assert all(not np.array_equal(x, y) for x, y in zip(c, images))
