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
nvidia-dali-cuda120``); without it the command says so and stops (DALI's auto_aug prints
deprecation warnings for aliases it calls itself).
"""

from __future__ import annotations

import argparse
import glob
import os
import time
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


def policy_times(images: list[np.ndarray], repeat: int) -> list[dict[str, Any]]:
    """Mean time and process CPU time per batch of each whole policy (random draws differ:
    time only)."""
    from nvidia.dali import fn, pipeline_def
    from nvidia.dali.auto_aug import auto_augment as dali_aa, rand_augment as dali_ra, trivial_augment as dali_ta

    index = np.arange(len(images))
    cases = [("auto_augment (ImageNet)", ops.auto_augment(), lambda d: dali_aa.auto_augment(d, seed=1)),
             ("rand_augment(n=2, m=9)", ops.rand_augment(2, 9), lambda d: dali_ra.rand_augment(d, n=2, m=9, seed=1)),
             ("trivial_augment_wide", ops.trivial_augment_wide(), lambda d: dali_ta.trivial_augment_wide(d, seed=1))]
    rows = []
    for name, op, dali_fn in cases:
        @pipeline_def(batch_size=len(images), num_threads=os.cpu_count() or 1, device_id=None, exec_async=False,
                      exec_pipelined=False, enable_conditionals=True)
        def pipe(dali_fn: Any = dali_fn) -> Any:
            return dali_fn(fn.external_source(source=lambda: images, batch=True, layout="HWC"))

        p = pipe()
        p.build()
        epochs = iter(range(1 << 30))

        def ours(op: Any = op, epochs: Any = epochs) -> None:  # new draws each run, as in training
            op(Batch({"image": list(images)}, index, sample_seeds(0, next(epochs), index)))

        (gpuio_s, gpuio_cpu_s), (dali_s, dali_cpu_s) = mean_times(ours, repeat), mean_times(p.run, repeat)
        rows.append(dict(op=name, gpuio_ms=1e3 * gpuio_s, dali_ms=1e3 * dali_s, gpuio_cpu_ms=1e3 * gpuio_cpu_s,
                         dali_cpu_ms=1e3 * dali_cpu_s))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--bin", type=int, default=20, help="magnitude bin of the policy rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        import nvidia.dali  # noqa: F401
    except ImportError as exc:
        raise BenchError("DALI is not installed: pip install nvidia-dali-cuda120 (the bench extra)") from exc
    import nvidia.dali as dali

    images = load_images(args.count, args.size)
    index = np.arange(len(images))
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; DALI {dali.__version__} (CPU); "
          f"{len(images)} images of {args.size}x{args.size}")
    rows = []
    for name, op, dali_name, kwargs in CASES:
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
        shapes = [a.shape == b.shape for a, b in zip(ours, theirs)]
        if not all(shapes):
            rows.append(dict(op=name, note=f"shapes differ: {ours[0].shape} vs {theirs[0].shape}"))
            continue
        diff = np.concatenate([np.abs(a.astype(np.int64) - b).ravel() for a, b in zip(ours, theirs)])
        rows.append(dict(op=name, mean=float(diff.mean()), max=int(diff.max()), share=float((diff > 0).mean()),
                         gpuio_ms=1e3 * best_time(gpuio_run, args.repeat),
                         dali_ms=1e3 * best_time(pipe.run, args.repeat), note=""))
    print_table(rows, [("op", "op", ""), ("mean", "mean |diff|", ".3f"), ("max", "max", "d"),
                       ("share", "differing", ".2%"), ("gpuio_ms", "gpuio CPU ms/batch", ".1f"),
                       ("dali_ms", "DALI CPU ms/batch", ".1f"), ("note", "", "")])
    policy = policy_rows(images, args.bin)
    print(f"\nthe augmentations of DALI's auto_aug policies at magnitude bin {args.bin}, positive sign "
          f"(TA: trivial_augment_wide's suite, AA: auto_augment's ImageNet policy):")
    print_table(policy, [("op", "augmentation", ""), ("mean", "mean |diff|", ".3f"), ("max", "max", "d"),
                         ("share", "differing", ".2%")])
    times = policy_times(images, args.repeat)
    print(f"\nwhole policies, mean of {args.repeat} batches: time and process CPU time (all threads) per batch:")
    print_table(times, [("op", "policy", ""), ("gpuio_ms", "gpuio CPU ms/batch", ".1f"),
                        ("dali_ms", "DALI CPU ms/batch", ".1f"), ("gpuio_cpu_ms", "gpuio CPU time ms", ".1f"),
                        ("dali_cpu_ms", "DALI CPU time ms", ".1f")])
    write_json(args.out, dict(machine=info, dali=dali.__version__, count=len(images), size=args.size, rows=rows,
                              policy_rows=policy, policy_times=times))


if __name__ == "__main__":
    main()
