"""The training augmentations against NVIDIA DALI's CPU operators, with fixed parameters.

    python bench/augment.py [--count 32] [--size 224] [--repeat 5] [--out augment.json]

For each op of ``gpuio.ops`` that DALI has (brightness_contrast, hsv, color_twist,
gaussian_blur, rotate, warp_affine, erase, jpeg_compression_distortion (DALI's CPU codec
needs ``nvidia-nvimgcodec-cu12``); random_grayscale against DALI's RGB -> GRAY
conversion), both run on the same decoded batch (``--count`` JPEGs of the sample
dataset, resized to ``--size`` square) with the same constant arguments: gpuio on the
CPU (one C call per op and batch, in the calling thread), DALI's CPU pipeline
(``device_id=None``, ``external_source`` -> the op, ``num_threads`` = cores). Printed per
op: the mean and largest absolute difference in uint8 levels and the share of values
that differ, then each one's best time per batch (``--repeat`` runs; DALI's pipeline runs
synchronously, and its time includes handing the batch to the pipeline). A second table
compares each augmentation of DALI's auto_aug policies (the TrivialAugment wide suite;
the ImageNet AutoAugment policy's own ones) at magnitude bin ``--bin`` with a positive
sign, DALI's against gpuio's; a third times the whole policies (auto_augment,
rand_augment(n=2, m=9), trivial_augment_wide; their random draws differ, so only the time
is compared): the mean wall-clock and process CPU time (all of DALI's threads, which a
machine shared with other jobs moves less) per batch. DALI comes with the ``bench`` extra (``pip install
nvidia-dali-cuda120``; DALI's auto_aug prints deprecation warnings for aliases it calls
itself).

Where torchvision imports, the same is done against ``torchvision.transforms.v2`` on the
same images as a uint8 NCHW tensor (its layout; the conversion is not timed), with
``--torch-threads`` intra-op threads (default 1, as in a DataLoader worker; gpuio's ops
run on one thread too; torch's default pool of a thread per core waits for its threads
after every small op, which a machine shared with other jobs makes slow): each op
torchvision has (``torchvision_cases``: brightness, saturation, hue, contrast, color
jitter, grayscale, gaussian blur, rotate, affine, erase, random erasing, JPEG, MixUp,
CutMix) with the same arguments; where the op draws at random (color_jitter,
random_erasing, mixup, cutmix) torchvision is given gpuio's draws (the op's
``params``/``boxes``/``weights`` for the same batch) and timed on its own transform with
its own draws. Then each augmentation of the TrivialAugment wide suite (and invert) at
``--bin``, torchvision's functional op as its policies call it, given gpuio's parameter;
then the whole policies (``v2.AutoAugment``, ``v2.RandAugment(2, 9)``,
``v2.TrivialAugmentWide``, bilinear, fill 128) one image at a time, as a Dataset's
``__getitem__`` runs them, against gpuio's batch call. A package that does not import
leaves its rows saying so; with neither the command stops.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import math
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.bench._common import BenchError, best_time, machine, print_table, sample_root, write_json

AFFINE = [0.9, 0.2, 5.0, -0.15, 1.05, -8.0]  # destination -> source, pixels
CASES: list[tuple[str, Any, str, dict[str, Any]]] = [
    ("brightness_contrast", ops.brightness_contrast(brightness=1.2, contrast=0.7), "brightness_contrast",
     dict(brightness=1.2, contrast=0.7)),
    ("hsv", ops.hsv(hue=30.0, saturation=1.3, value=0.9), "hsv", dict(hue=30.0, saturation=1.3, value=0.9)),
    ("color_twist", ops.color_twist(brightness=1.1, contrast=0.8, hue=-20.0, saturation=1.2), "color_twist",
     dict(brightness=1.1, contrast=0.8, hue=-20.0, saturation=1.2)),
    ("random_grayscale(p=1)", ops.random_grayscale(p=1.0), "color_space_conversion", {}),
    ("gaussian_blur(sigma=1.5)", ops.gaussian_blur(sigma=1.5), "gaussian_blur", dict(sigma=1.5)),
    ("gaussian_blur(window_size=7)", ops.gaussian_blur(window_size=7), "gaussian_blur", dict(window_size=7)),
    ("rotate(30, fill_value=0)", ops.rotate(30.0, fill_value=0), "rotate", dict(angle=30.0, fill_value=0)),
    ("rotate(-17.5, keep_size)", ops.rotate(-17.5, keep_size=True), "rotate", dict(angle=-17.5, keep_size=True)),
    ("erase(2 regions, fill)", ops.erase((20.4, 30.6, 150, 190), (50.3, 40.5, 90, 60), fill_value=(118, 185, 0)),
     "erase", dict(anchor=(20.4, 30.6, 150, 190), shape=(50.3, 40.5, 90, 60), fill_value=(118, 185, 0),
                   axis_names="HW")),
    ("erase(normalized, centred)", ops.erase((0.5, 0.5), (0.33, 0.27), normalized=True, centered_anchor=True),
     "erase", dict(anchor=(0.5, 0.5), shape=(0.33, 0.27), normalized=True, centered_anchor=True, axis_names="HW")),
    ("jpeg_compression_distortion(30)", ops.jpeg_compression_distortion(30), "jpeg_compression_distortion",
     dict(quality=30)),
    ("warp_affine(matrix, fill)", ops.warp_affine(AFFINE, fill_value=0), "warp_affine",
     dict(matrix=AFFINE, fill_value=0)),
]


def load_images(count: int, size: int) -> list[np.ndarray]:
    """``count`` sample JPEGs decoded and resized to ``size`` square, uint8 HWC RGB."""
    files = sorted(glob.glob(os.path.join(sample_root(), "*", "*.jpg")))[:count]
    batch = Batch({"data": [np.fromfile(f, np.uint8) for f in files]}, np.arange(len(files)),
                  sample_seeds(0, 0, np.arange(len(files))))
    batch = ops.resize((size, size))(ops.decode_image()(batch))
    return [np.ascontiguousarray(img) for img in batch.data["image"]]


def dali_pipeline(images: list[np.ndarray], op_name: str, kwargs: dict[str, Any]) -> Any:
    from nvidia.dali import fn, pipeline_def, types

    # synchronous: run() computes the batch it returns (no batches prepared ahead)
    @pipeline_def(batch_size=len(images), num_threads=os.cpu_count() or 1, device_id=None, exec_async=False,
                  exec_pipelined=False)
    def pipe() -> Any:
        data = fn.external_source(source=lambda: images, batch=True, layout="HWC")
        if op_name == "color_space_conversion":
            return fn.color_space_conversion(data, image_type=types.RGB, output_type=types.GRAY)
        return getattr(fn, op_name)(data, **kwargs)

    p = pipe()
    p.build()
    return p


def policy_rows(images: list[np.ndarray], magnitude_bin: int) -> list[dict[str, Any]]:
    """Each augmentation of DALI's TrivialAugment wide suite and of its AutoAugment
    ImageNet policy at ``magnitude_bin`` (positive sign) in DALI and in gpuio, compared."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import auto_augment as dali_aa, trivial_augment as dali_ta
    from nvidia.dali.auto_aug.core import signed_bin

    geometric = {"translate_x", "translate_y", "shear_x", "shear_y", "rotate"}
    index = np.arange(len(images))
    rows = []
    ta, aa = ops.trivial_augment_wide(), ops.auto_augment()
    dali_policy = dali_aa.get_image_net_policy()
    suites = [("TA", dali_ta.get_trivial_augment_wide_suite(), ta, 31),
              ("AA", [dali_policy.augmentations[k] for k in sorted(dali_policy.augmentations)], aa, 11)]
    for tag, dali_suite, ours, bins in suites:
        names = [a.name for a in ours.suite]
        for aug in dali_suite:
            if tag == "AA" and aug.name not in ("color", "solarize_add", "invert", "posterize", "solarize"):
                continue  # the others are the TA rows' ops with other ranges
            b = min(magnitude_bin, bins - 1)

            @pipeline_def(batch_size=len(images), num_threads=os.cpu_count() or 1, device_id=None, exec_async=False,
                          exec_pipelined=False)
            def pipe(aug: Any = aug, b: int = b, bins: int = bins) -> Any:
                data = fn.external_source(source=lambda: images, batch=True, layout="HWC")
                signed = signed_bin(b, random_sign=fn.random.uniform(values=[0], dtype=types.INT32))
                extra = {"fill_value": 128} if aug.name in geometric else {}
                return aug(data, magnitude_bin=signed, num_magnitude_bins=bins, **extra)

            p = pipe()
            p.build()
            theirs = [np.asarray(p.run()[0].at(i)) for i in range(len(images))]
            k = names.index(aug.name)
            batch = Batch({"image": list(images)}, index, sample_seeds(0, 0, index))
            param = ours.suite[k].param(b, bins, False)
            mine = ours.step(batch, list(images), np.full(len(images), k), np.full(len(images), param))
            diff = np.concatenate([np.abs(a.astype(np.int64) - t).ravel() for a, t in zip(mine, theirs)])
            rows.append(dict(op=f"{tag} {aug.name} (bin {b})", mean=float(diff.mean()), max=int(diff.max()),
                             share=float((diff > 0).mean())))
    return rows


def mean_times(fn: Any, repeat: int) -> tuple[float, float]:
    """Mean wall-clock and mean process CPU time (all threads) of ``repeat`` runs of ``fn``
    after one untimed run, in seconds: the mean, as each run draws other augmentations
    (the least would time the lightest draws); CPU time, as a machine shared with other
    jobs moves it less."""
    fn()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - w0) / repeat, (time.process_time() - c0) / repeat


def dali_policy(images: list[np.ndarray], name: str) -> Callable[[], Any]:
    """DALI's whole policy ``name`` over ``images``: its built pipeline's ``run``."""
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali.auto_aug import auto_augment as dali_aa, rand_augment as dali_ra, trivial_augment as dali_ta

    policies = {"auto_augment": lambda d: dali_aa.auto_augment(d, seed=1),
                "rand_augment": lambda d: dali_ra.rand_augment(d, n=2, m=9, seed=1),
                "trivial_augment_wide": lambda d: dali_ta.trivial_augment_wide(d, seed=1)}

    @pipeline_def(batch_size=len(images), num_threads=os.cpu_count() or 1, device_id=None, exec_async=False,
                  exec_pipelined=False, enable_conditionals=True)
    def pipe() -> Any:
        return policies[name](fn.external_source(source=lambda: images, batch=True, layout="HWC"))

    p = pipe()
    p.build()
    return p.run


def torchvision_policy(images: list[np.ndarray], name: str) -> Callable[[], Any]:
    """torchvision v2's whole policy ``name`` (bilinear, fill 128: gpuio's arguments) applied
    to each image of ``images`` on its own (a draw per image, as in a Dataset)."""
    import torch
    from torchvision.transforms import v2

    bilinear = v2.InterpolationMode.BILINEAR
    policy = {"auto_augment": v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=bilinear, fill=128),
              "rand_augment": v2.RandAugment(2, 9, interpolation=bilinear, fill=128),
              "trivial_augment_wide": v2.TrivialAugmentWide(interpolation=bilinear, fill=128)}[name]
    x = list(torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous())
    return lambda: [policy(img) for img in x]


def policy_times(images: list[np.ndarray], repeat: int, dali: bool, tv: bool) -> list[dict[str, Any]]:
    """Mean time and process CPU time per batch of each whole policy (random draws differ:
    time only), gpuio's and those of DALI and torchvision where they import."""
    index = np.arange(len(images))
    cases = [("auto_augment (ImageNet)", ops.auto_augment(), "auto_augment"),
             ("rand_augment(n=2, m=9)", ops.rand_augment(2, 9), "rand_augment"),
             ("trivial_augment_wide", ops.trivial_augment_wide(), "trivial_augment_wide")]
    rows = []
    for name, op, key in cases:
        epochs = iter(range(1 << 30))

        def ours(op: Any = op, epochs: Any = epochs) -> None:  # new draws each run, as in training
            op(Batch({"image": list(images)}, index, sample_seeds(0, next(epochs), index)))

        row: dict[str, Any] = dict(op=name)
        theirs = [("gpuio", ours)] + ([("dali", dali_policy(images, key))] if dali else []) + (
            [("tv", torchvision_policy(images, key))] if tv else [])
        for who, run in theirs:
            wall, cpu = mean_times(run, repeat)
            row[f"{who}_ms"], row[f"{who}_cpu_ms"] = 1e3 * wall, 1e3 * cpu
        rows.append(row)
    return rows


def _nhwc(t: Any) -> list[np.ndarray]:
    """A torchvision NCHW uint8 batch (one tensor or a list of CHW ones) as HWC arrays."""
    return [np.ascontiguousarray(img.permute(1, 2, 0).numpy()) for img in t]


def torchvision_cases(images: list[np.ndarray]) -> list[tuple[str, Any, str, Callable[[Batch], Any], Any]]:
    """Each op of torchvision v2 that gpuio has: (gpuio's op, its name, torchvision's call,
    ``compare(batch)``: torchvision's output for the batch gpuio runs (given gpuio's draws
    for the random ops), ``timed()``: what is timed (None: compare's call itself))."""
    import torch
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F

    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    xf = x.float()  # MixUp takes float images (uint8 ones raise)
    labels = torch.arange(len(images)) % 10
    bilinear = v2.InterpolationMode.BILINEAR
    jitter, hue = ops.color_jitter(0.4, 0.4, 0.4, 0.1), ops.color_jitter(hue=0.1)
    erasing = ops.random_erasing(p=1.0, value=(124, 116, 104))
    mixup, cutmix = ops.mixup(1.0, num_classes=10), ops.cutmix(1.0, num_classes=10)
    steps = [F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue]  # ColorJitter's fn_idx

    def jitter_tv(op: Any) -> Callable[[Batch], list[Any]]:
        def run(batch: Batch) -> list[Any]:
            out = []
            orders, factors = op.params(batch)
            for img, order, row_factors in zip(x, orders.tolist(), factors.tolist()):
                for k in order:
                    img = steps[k](img, row_factors[k])
                out.append(img)
            return out

        return run

    def erasing_tv(batch: Batch) -> list[Any]:
        value = torch.tensor([124, 116, 104], dtype=torch.uint8)[:, None, None]
        boxes = erasing.boxes(batch, np.array([img.shape[:2] for img in images]))
        return [F.erase(img, top, left, h, w, value) for img, (top, left, h, w) in zip(x, boxes.tolist())]

    def mixup_tv(batch: Batch) -> list[Any]:  # its output in float, rounded to levels here
        tv = v2.MixUp(alpha=1.0, num_classes=10)
        params = dict(labels=labels, batch_size=len(images))
        return [tv.transform(xf, dict(params, lam=lam))[row].round().to(torch.uint8)
                for row, lam in enumerate(mixup.weights(batch).tolist())]

    def cutmix_tv(batch: Batch) -> list[Any]:
        tv = v2.CutMix(alpha=1.0, num_classes=10)
        params = dict(labels=labels, batch_size=len(images), lam_adjusted=0.0)
        h, w = images[0].shape[:2]
        boxes = cutmix.boxes(batch, cutmix.weights(batch), h, w)
        return [tv.transform(x, dict(params, box=(x0, y0, x1, y1)))[row]
                for row, (y0, x0, y1, x1) in enumerate(boxes.tolist())]

    tv_jitter, tv_hue = v2.ColorJitter(0.4, 0.4, 0.4, 0.1), v2.ColorJitter(hue=0.1)
    tv_erasing = v2.RandomErasing(p=1.0, value=[124, 116, 104])
    tv_mixup, tv_cutmix = v2.MixUp(alpha=1.0, num_classes=10), v2.CutMix(alpha=1.0, num_classes=10)
    return [
        ("brightness_contrast(brightness=1.2)", ops.brightness_contrast(brightness=1.2), "adjust_brightness(1.2)",
         lambda b: F.adjust_brightness(x, 1.2), None),
        ("brightness_contrast(contrast=0.7)", ops.brightness_contrast(contrast=0.7), "adjust_contrast(0.7)",
         lambda b: F.adjust_contrast(x, 0.7), None),
        ("hsv(saturation=1.3)", ops.hsv(saturation=1.3), "adjust_saturation(1.3)",
         lambda b: F.adjust_saturation(x, 1.3), None),
        ("hsv(value=0.9)", ops.hsv(value=0.9), "adjust_brightness(0.9)", lambda b: F.adjust_brightness(x, 0.9), None),
        ("hsv(hue=30)", ops.hsv(hue=30.0), "adjust_hue(30 / 360)", lambda b: F.adjust_hue(x, 30 / 360), None),
        ("color_jitter(hue=0.1)", hue, "adjust_hue at gpuio's factors", jitter_tv(hue),
         lambda: [tv_hue(img) for img in x]),
        ("color_jitter(0.4, 0.4, 0.4, 0.1)", jitter, "ColorJitter steps, gpuio's order+factors", jitter_tv(jitter),
         lambda: [tv_jitter(img) for img in x]),
        ("random_grayscale(p=1)", ops.random_grayscale(p=1.0), "rgb_to_grayscale(3 channels)",
         lambda b: F.rgb_to_grayscale(x, 3), None),
        ("gaussian_blur(sigma=1.5)", ops.gaussian_blur(sigma=1.5), "gaussian_blur([11, 11], 1.5)",
         lambda b: F.gaussian_blur(x, [11, 11], [1.5, 1.5]), None),
        ("gaussian_blur(window_size=7)", ops.gaussian_blur(window_size=7), "gaussian_blur([7, 7])",
         lambda b: F.gaussian_blur(x, [7, 7]), None),
        ("rotate(30, fill_value=0)", ops.rotate(30.0, fill_value=0), "rotate(30, expand, fill=0)",
         lambda b: F.rotate(x, 30.0, bilinear, expand=True, fill=0), None),
        ("rotate(-17.5, keep_size, fill_value=0)", ops.rotate(-17.5, fill_value=0, keep_size=True),
         "rotate(-17.5, fill=0)", lambda b: F.rotate(x, -17.5, bilinear, fill=0), None),
        # gpuio's angle and shear turn counter-clockwise, torchvision's affine's clockwise
        ("warp_affine(angle=20, scale=1.1, shear=10, translate 8, -5)",
         ops.warp_affine(angle=20.0, scale=1.1, shear=10.0, translate_x=8.0, translate_y=-5.0, fill_value=0),
         "affine(-20, [8, -5], 1.1, [-10, 0], fill=0)",
         lambda b: F.affine(x, -20.0, [8.0, -5.0], 1.1, [-10.0, 0.0], bilinear, fill=0), None),
        ("erase((20, 30), (50, 90), fill)", ops.erase((20, 30), (50, 90), fill_value=(118, 185, 0)),
         "erase(20, 30, 50, 90, fill)",
         lambda b: F.erase(x, 20, 30, 50, 90, torch.tensor([118, 185, 0], dtype=torch.uint8)[:, None, None]), None),
        ("random_erasing(p=1, value=mean)", erasing, "erase at gpuio's boxes", erasing_tv,
         lambda: [tv_erasing(img) for img in x]),
        ("jpeg_compression_distortion(30)", ops.jpeg_compression_distortion(30), "jpeg(30)",
         lambda b: F.jpeg(x, 30), None),
        ("mixup(alpha=1)", mixup, "MixUp (float) at gpuio's weights", mixup_tv, lambda: tv_mixup(xf, labels)),
        ("cutmix(alpha=1)", cutmix, "CutMix at gpuio's boxes", cutmix_tv, lambda: tv_cutmix(x, labels)),
    ]


def _diff(ours: list[np.ndarray], theirs: list[np.ndarray]) -> dict[str, Any]:
    """Mean and largest |difference| in levels and the share of values that differ, or a
    note where the shapes differ."""
    if not all(a.shape == b.shape for a, b in zip(ours, theirs)):
        return dict(note=f"shapes differ: {ours[0].shape} vs {theirs[0].shape}")
    diff = np.concatenate([np.abs(a.astype(np.int64) - b).ravel() for a, b in zip(ours, theirs)])
    return dict(mean=float(diff.mean()), max=int(diff.max()), share=float((diff > 0).mean()))


def torchvision_rows(images: list[np.ndarray], repeat: int) -> list[dict[str, Any]]:
    """``torchvision_cases``: gpuio's output against torchvision's, and each one's time."""
    index = np.arange(len(images))

    def batch() -> Batch:
        return Batch({"image": list(images), "label": index % 10}, index, sample_seeds(0, 0, index))

    rows = []
    for name, op, tv_name, compare, timed in torchvision_cases(images):
        def gpuio_run(op: Any = op) -> list[np.ndarray]:
            return list(op(batch()).data["image"])

        row = dict(op=name, tv=tv_name, **_diff(gpuio_run(), _nhwc(compare(batch()))))
        row.update(gpuio_ms=1e3 * best_time(gpuio_run, repeat),
                   tv_ms=1e3 * best_time(timed or (lambda compare=compare: compare(batch())), repeat))
        rows.append(row)
    return rows


def torchvision_augmentation(name: str, p: float, x: Any) -> Any:
    """torchvision's functional op as its v2 policies call it for augmentation ``name``,
    given gpuio's parameter ``p`` (bilinear, fill 128). torchvision's shears move x by
    ``-tan(angle) * y`` where gpuio's move it by ``+p * y``: the angle is atan(-p)."""
    from torchvision.transforms.v2 import InterpolationMode, functional as F

    bilinear, fill = InterpolationMode.BILINEAR, [128.0]
    shear = math.degrees(math.atan(-p))
    calls = {"translate_x": lambda: F.affine(x, 0.0, [p, 0.0], 1.0, [0.0, 0.0], bilinear, fill),
             "translate_y": lambda: F.affine(x, 0.0, [0.0, p], 1.0, [0.0, 0.0], bilinear, fill),
             "shear_x": lambda: F.affine(x, 0.0, [0, 0], 1.0, [shear, 0.0], bilinear, fill, center=[0, 0]),
             "shear_y": lambda: F.affine(x, 0.0, [0, 0], 1.0, [0.0, shear], bilinear, fill, center=[0, 0]),
             "rotate": lambda: F.rotate(x, p, bilinear, fill=fill),
             "brightness": lambda: F.adjust_brightness(x, p), "contrast": lambda: F.adjust_contrast(x, p),
             "color": lambda: F.adjust_saturation(x, p), "sharpness": lambda: F.adjust_sharpness(x, p),
             "posterize": lambda: F.posterize(x, round(p)), "solarize": lambda: F.solarize(x, min(p, 255.0)),
             "equalize": lambda: F.equalize(x), "auto_contrast": lambda: F.autocontrast(x),
             "invert": lambda: F.invert(x), "identity": lambda: x}
    return calls[name]()


def torchvision_policy_rows(images: list[np.ndarray], magnitude_bin: int) -> list[dict[str, Any]]:
    """Each augmentation of gpuio's TrivialAugment wide suite (and AutoAugment's invert) at
    ``magnitude_bin`` (positive sign), gpuio's against torchvision's functional op given the
    same parameter."""
    import torch

    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()
    index = np.arange(len(images))
    ta, aa = ops.trivial_augment_wide(), ops.auto_augment()
    chosen = [("TA", ta, k, min(magnitude_bin, 30), 31) for k in range(len(ta.suite))]
    chosen += [("AA", aa, k, min(magnitude_bin, 10), 11) for k, a in enumerate(aa.suite) if a.name == "invert"]
    rows = []
    for tag, ours, k, b, bins in chosen:
        aug = ours.suite[k]
        param = aug.param(b, bins, False)
        batch = Batch({"image": list(images)}, index, sample_seeds(0, 0, index))
        mine = ours.step(batch, list(images), np.full(len(images), k), np.full(len(images), param))
        rows.append(dict(op=f"{tag} {aug.name} (bin {b})", param=param,
                         **_diff(mine, _nhwc(torchvision_augmentation(aug.name, param, x)))))
    return rows


def _version(module: str) -> str | None:
    """The version of ``module`` where it imports, else None."""
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--bin", type=int, default=20, help="magnitude bin of the policy rows")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch's intra-op threads (torchvision rows)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dali, tv = _version("nvidia.dali"), _version("torchvision")
    if dali is None and tv is None:
        raise BenchError("neither DALI nor torchvision is installed: pip install nvidia-dali-cuda120 (the bench "
                         "extra) or torchvision")
    if tv is not None:
        import torch

        torch.set_num_threads(args.torch_threads)

    images = load_images(args.count, args.size)
    index = np.arange(len(images))
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; DALI {f'{dali} (CPU)' if dali else 'not installed'}; "
          f"torchvision {f'{tv} (CPU, torch threads: {args.torch_threads})' if tv else 'not installed'}; "
          f"{len(images)} images of {args.size}x{args.size}")
    rows = []
    for name, op, dali_name, kwargs in CASES:
        if dali is None:
            rows.append(dict(op=name, note="not installed (nvidia.dali)"))
            continue

        def gpuio_run(op: Any = op) -> list[np.ndarray]:
            return list(op(Batch({"image": list(images)}, index, sample_seeds(0, 0, index))).data["image"])

        ours = gpuio_run()
        try:
            pipe = dali_pipeline(images, dali_name, kwargs)
            theirs = [np.asarray(pipe.run()[0].at(i)) for i in range(len(images))]
        except Exception as exc:  # DALI's failure (a missing codec library) is a row to report, not a crash
            rows.append(dict(op=name, note=f"DALI failed: {str(exc).strip().splitlines()[-1][:80]}"))
            continue
        if dali_name == "color_space_conversion":
            ours = [img[..., :1] for img in ours]
        row = dict(op=name, **_diff(ours, theirs))
        if "note" not in row:
            row.update(gpuio_ms=1e3 * best_time(gpuio_run, args.repeat), dali_ms=1e3 * best_time(pipe.run, args.repeat))
        rows.append(row)
    print("\nagainst DALI's CPU operators:")
    print_table(rows, [("op", "op", ""), ("mean", "mean |diff|", ".3f"), ("max", "max", "d"),
                       ("share", "differing", ".2%"), ("gpuio_ms", "gpuio CPU ms/batch", ".1f"),
                       ("dali_ms", "DALI CPU ms/batch", ".1f"), ("note", "", "")])
    policy = policy_rows(images, args.bin) if dali else []
    print(f"\nthe augmentations of DALI's auto_aug policies at magnitude bin {args.bin}, positive sign "
          f"(TA: trivial_augment_wide's suite, AA: auto_augment's ImageNet policy):"
          + ("" if dali else " DALI not installed"))
    print_table(policy, [("op", "augmentation", ""), ("mean", "mean |diff|", ".3f"), ("max", "max", "d"),
                         ("share", "differing", ".2%")])
    tv_note = [dict(op="torchvision.transforms.v2", note="not installed (torchvision)")]
    tv_rows = torchvision_rows(images, args.repeat) if tv else tv_note
    print("\nagainst torchvision.transforms.v2 (uint8 NCHW tensors):")
    print_table(tv_rows, [("op", "gpuio op", ""), ("tv", "torchvision v2", ""), ("mean", "mean |diff|", ".3f"),
                          ("max", "max", "d"), ("share", "differing", ".2%"),
                          ("gpuio_ms", "gpuio CPU ms/batch", ".1f"), ("tv_ms", "torchvision ms/batch", ".1f"),
                          ("note", "", "")])
    tv_policy = torchvision_policy_rows(images, args.bin) if tv else tv_note
    print(f"\ngpuio's TrivialAugment wide suite (and AutoAugment's invert) at magnitude bin {args.bin}, positive "
          f"sign, against torchvision's functional ops given the same parameter:")
    print_table(tv_policy, [("op", "augmentation", ""), ("param", "parameter", ".3f"), ("mean", "mean |diff|", ".3f"),
                            ("max", "max", "d"), ("share", "differing", ".2%"), ("note", "", "")])
    times = policy_times(images, args.repeat, dali is not None, tv is not None)
    print(f"\nwhole policies, mean of {args.repeat} batches: time and process CPU time (all threads) per batch "
          f"(torchvision: one image at a time):")
    print_table(times, [("op", "policy", ""), ("gpuio_ms", "gpuio ms/batch", ".1f"),
                        ("dali_ms", "DALI ms/batch", ".1f"), ("tv_ms", "torchvision ms/batch", ".1f"),
                        ("gpuio_cpu_ms", "gpuio CPU time ms", ".1f"), ("dali_cpu_ms", "DALI CPU time ms", ".1f"),
                        ("tv_cpu_ms", "torchvision CPU time ms", ".1f")])
    write_json(args.out, dict(machine=info, dali=dali, torchvision=tv, torch_threads=args.torch_threads,
                              count=len(images), size=args.size, rows=rows,
                              policy_rows=policy, torchvision_rows=tv_rows, torchvision_policy_rows=tv_policy,
                              policy_times=times))


if __name__ == "__main__":
    main()
