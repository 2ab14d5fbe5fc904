"""The automatic augmentation policies (gpuio.ops.auto_aug): each augmentation of the
suites against Pillow's ImageOps/ImageEnhance, OpenCV's equalizeHist and warpAffine, or
an exact expectation; the per-sample draws; argument errors; CPU/GPU agreement."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

import gpuio
from checkers import check_resume
from gpuio import formats, ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.errors import ConfigError, DataError
from gpuio.ops.auto_aug import rand_augment_suite, trivial_augment_wide_suite
from gpuio.sample import make_image_tree, sample_image


def make_batch(images, index=None, device="cpu", seed=11):
    index = np.arange(len(images)) if index is None else np.asarray(index)
    if device != "cpu":
        import cupy

        images = [cupy.asarray(img) for img in images]
    return Batch({"image": list(images)}, index, sample_seeds(seed, 0, index), device=Device(device))


def host(images):
    out = []
    for img in images:
        if hasattr(img, "__cuda_array_interface__"):
            import cupy

            img = cupy.asnumpy(img)
        out.append(np.asarray(img))
    return out


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(3)
    return [sample_image(rng, 48, 64), sample_image(rng, 37, 50)]


def apply(name, magnitude, images, device="cpu"):
    """The augmentation ``name`` with parameter ``magnitude`` on every image."""
    op = ops.auto_augment() if name in ("invert", "solarize_add") else ops.trivial_augment_wide()
    k = [a.name for a in op.suite].index(name)
    batch = make_batch(images, device=device)
    n = len(images)
    return host(op.step(batch, list(batch.data["image"]), np.full(n, k), np.full(n, float(magnitude))))


def diff(a, b):
    d = np.abs(np.asarray(a, np.int64) - np.asarray(b, np.int64))
    return d.max(), d.mean()


def test_pixel_augmentations_match_pillow_and_opencv(images):
    for img, got in zip(images, apply("posterize", 3, images)):
        assert np.array_equal(got, np.asarray(ImageOps.posterize(Image.fromarray(img), 3)))
    for img, got in zip(images, apply("solarize", 128.0, images)):
        assert np.array_equal(got, np.asarray(ImageOps.solarize(Image.fromarray(img), 128)))
    for img, got in zip(images, apply("equalize", 0, images)):
        ref = np.stack([cv2.equalizeHist(np.ascontiguousarray(img[..., c])) for c in range(3)], axis=-1)
        assert np.array_equal(got, ref)  # DALI's equalize is OpenCV's
    for img, got in zip(images, apply("auto_contrast", 0, images)):
        pil = np.asarray(ImageOps.autocontrast(Image.fromarray(img)))
        assert diff(got, pil)[0] <= 1  # Pillow truncates its table, gpuio rounds
    for img, got in zip(images, apply("invert", 0, images)):
        assert np.array_equal(got, np.asarray(ImageOps.invert(Image.fromarray(img))))
    for img, got in zip(images, apply("solarize_add", 33.7, images)):
        assert np.array_equal(got, np.where(img < 128, img + 33, img))
    for img, got in zip(images, apply("identity", 0, images)):
        assert np.array_equal(got, img)


def test_enhancements_match_pillow(images):
    for img, got in zip(images, apply("brightness", 1.5, images)):
        pil = np.asarray(ImageEnhance.Brightness(Image.fromarray(img)).enhance(1.5)).astype(np.int64)
        assert set(np.unique(got - pil).tolist()) <= {0, 1}  # Pillow truncates, gpuio rounds
    for img, got in zip(images, apply("contrast", 0.7, images)):
        # Pillow's centre is its mean luma rounded to a level, gpuio's (as DALI's) is not rounded
        worst, mean = diff(got, np.asarray(ImageEnhance.Contrast(Image.fromarray(img)).enhance(0.7)))
        assert worst <= 2 and mean < 0.7
    for img, got in zip(images, apply("sharpness", 1.5, images)):
        pil = np.asarray(ImageEnhance.Sharpness(Image.fromarray(img)).enhance(1.5))
        # Pillow leaves the 1-pixel border unfiltered and rounds its smoothed image first
        worst, mean = diff(got[1:-1, 1:-1], pil[1:-1, 1:-1])
        assert worst <= 2 and mean < 0.6
    color = apply("color", 1.4, images)
    same = ops.hsv(saturation=1.4)(make_batch(images)).data["image"]
    for a, b in zip(color, same):
        assert np.array_equal(a, b)  # DALI's color is its saturation: hsv's YIQ scaling


def test_geometric_augmentations(images):
    for img, got in zip(images, apply("translate_x", 10, images)):
        assert np.array_equal(got[:, 10:], img[:, :-10]) and np.all(got[:, :10] == 128)
    for img, got in zip(images, apply("translate_y", -7, images)):
        assert np.array_equal(got[:-7], img[7:]) and np.all(got[-7:] == 128)
    for img, got in zip(images, apply("rotate", 20, images)):
        assert np.array_equal(got, ops.rotate(20, fill_value=128, keep_size=True)(make_batch([img])).data["image"][0])
    for img, got in zip(images, apply("shear_x", 0.2, images)):
        # forward x' = x + 0.2 y about the top-left corner; OpenCV's centres are 0.5 off gpuio's
        inv = np.linalg.inv(np.array([[1, 0.2, 0], [0, 1, 0], [0, 0, 1]]))[:2]
        cv_m = np.concatenate([inv[:, :2], (inv[:, :2] @ [0.5, 0.5] + inv[:, 2] - 0.5)[:, None]], axis=1)
        ref = cv2.warpAffine(img, cv_m, (img.shape[1], img.shape[0]), flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
                             borderMode=cv2.BORDER_CONSTANT, borderValue=(128, 128, 128))
        worst, mean = diff(got, ref)
        assert worst <= 2 and mean < 0.1  # OpenCV: 1/32-pixel coordinates, fixed-point weights


def test_suites_are_dalis():
    ta, ra = trivial_augment_wide_suite(), rand_augment_suite()
    names = ["translate_x", "translate_y", "shear_x", "shear_y", "rotate", "brightness", "contrast", "color",
             "sharpness", "posterize", "solarize", "equalize", "auto_contrast", "identity"]
    assert [a.name for a in ta] == names and [a.name for a in ra] == names
    assert ta[5].param(30, 31, True) == pytest.approx(0.01) and ra[7].param(0, 31, False) == 1.0  # 1 +- m
    assert ta[4].param(30, 31, True) == -135 and ra[4].param(30, 31, False) == 30
    assert ta[0].param(30, 31, False) == 32 and ra[1].param(30, 31, True) == -100
    assert ta[9].param(0, 31, True) == 8 and ta[9].param(30, 31, True) == 2  # never negated
    assert ra[10].param(15, 31, False) == 128


def test_trivial_augment_draws_follow_the_sample(images):
    op = ops.trivial_augment_wide()
    imgs = [images[k % 2] for k in range(12)]
    batch = make_batch(imgs, index=np.arange(12))
    (ops_, mags), = op.plan(batch)
    for row in range(12):
        rng = batch.rng(row, op.salt)
        k, b, sign = rng.integers(14), rng.integers(31), rng.integers(2)
        assert ops_[row] == k and mags[row] == op.suite[k].param(b, 31, bool(sign))
    assert len(set(ops_.tolist())) > 4
    whole = host(op(make_batch(imgs, index=np.arange(12))).data["image"])
    part = host(op(make_batch([imgs[9], imgs[2]], index=[9, 2])).data["image"])
    assert np.array_equal(part[0], whole[9]) and np.array_equal(part[1], whole[2])


def test_rand_augment_applies_n_steps_at_bin_m(images):
    op = ops.rand_augment(2, 9)
    imgs = [images[k % 2] for k in range(6)]
    plan = op.plan(make_batch(imgs))
    assert len(plan) == 2
    for ops_, mags in plan:
        for k, mag in zip(ops_.tolist(), mags.tolist()):
            expected = op.suite[k].param(9, 31, False)
            assert mag in (expected, 2 * op.suite[k].shift - expected)
    got = host(op(make_batch(imgs)).data["image"])
    batch = make_batch(imgs)
    steps = list(batch.data["image"])
    for ops_, mags in plan:
        steps = op.step(batch, steps, ops_, mags)
    assert all(np.array_equal(a, b) for a, b in zip(got, host(steps)))
    same = host(ops.rand_augment(0, 9)(make_batch(imgs)).data["image"])
    assert all(np.array_equal(a, b) for a, b in zip(same, imgs))


def test_auto_augment_image_net_draws(images):
    op = ops.auto_augment()
    assert len(op.sub_policies) == 25 and op.bins == 11
    imgs = [images[k % 2] for k in range(40)]
    batch = make_batch(imgs, index=np.arange(40))
    plan = op.plan(batch)
    ran = 0
    for row in range(40):
        rng = batch.rng(row, op.salt)
        stages = op.sub_policies[rng.integers(25)]
        for level in range(2):
            k, mag = plan[level][0][row], plan[level][1][row]
            if level >= len(stages):
                assert op.suite[k].name == "identity"
                continue
            aug, prob, magnitude_bin = stages[level]
            run, sign = rng.random() < prob, bool(rng.integers(2))
            assert op.suite[k].name == (op.suite[aug].name if run else "identity")
            if run:
                ran += 1
                assert mag == op.suite[aug].param(magnitude_bin, 11, sign)
    assert ran > 20
    whole = host(op(make_batch(imgs, index=np.arange(40))).data["image"])
    part = host(op(make_batch([imgs[30], imgs[5]], index=[30, 5])).data["image"])
    assert np.array_equal(part[0], whole[30]) and np.array_equal(part[1], whole[5])


@pytest.mark.parametrize("make,message", [
    (lambda: ops.auto_augment("cifar10"), "policy_name 'cifar10'; the policy here is 'image_net'"),
    (lambda: ops.rand_augment(2, 31), r"m \(the magnitude bin\) must be an int in \[0, 30\]"),
    (lambda: ops.rand_augment(-1, 9), "n .* must be an int >= 0"),
    (lambda: ops.trivial_augment_wide(num_magnitude_bins=0), "num_magnitude_bins must be an int >= 1"),
    (lambda: ops.trivial_augment_wide(excluded=["blur"]), r"excluded names \['blur'\] are not in the suite"),
    (lambda: ops.trivial_augment_wide(fill_value=300), r"fill_value is a level in \[0, 255\]"),
    (lambda: ops.rand_augment(1, 1, interp_type="cubic"), "interp_type 'cubic'"),
])
def test_policy_arguments_are_checked(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_policies_take_rgb_only(images):
    with pytest.raises(DataError, match="uint8 HWC RGB"):
        ops.trivial_augment_wide()(make_batch([images[0][..., :1].copy()]))


@pytest.mark.parametrize("make", [lambda: ops.trivial_augment_wide(), lambda: ops.rand_augment(2, 12),
                                  lambda: ops.auto_augment()])
def test_policies_cpu_and_device_agree(images, device, make):
    imgs = [images[k % 2] for k in range(16)]
    cpu = host(make()(make_batch(imgs)).data["image"])
    got = host(make()(make_batch(imgs, device=device)).data["image"])
    for a, b in zip(cpu, got):
        worst, mean = diff(a, b)
        assert worst <= 1 and mean < 0.01  # float32 sums in another order: a level at .5 ties


def test_a_training_chain_of_these_ops_resumes_exactly(tmp_path):
    index = formats.filetree(make_image_tree(tmp_path / "t", count=20, progress=False))
    chain = [ops.decode_image(), ops.random_resized_crop(48), ops.rand_augment(2, 9), ops.hsv(hue=(-10, 10)),
             ops.gaussian_blur(sigma=(0.1, 1.0)), ops.random_erasing(), ops.rotate((-15, 15), keep_size=True),
             ops.mixup(0.4, num_classes=100), ops.normalize(0, 255)]

    def make(**kw):
        return gpuio.Loader(index, 6, ops=chain, output="numpy", shuffle=True, seed=3, threads=2, **kw)

    check_resume(make, epochs=2)
