"""The training augmentations against NVIDIA DALI's CPU operators, with fixed parameters.

    python bench/augment.py [--count 32] [--size 224] [--repeat 5] [--out augment.json]

For each op of ``gpuio.ops`` that DALI has (brightness_contrast, hsv, color_twist,
gaussian_blur, rotate, warp_affine; random_grayscale against DALI's RGB -> GRAY
conversion), both run on the same decoded batch (``--count`` JPEGs of the sample
dataset, resized to ``--size`` square) with the same constant arguments: gpuio on the
CPU, DALI's CPU pipeline (``device_id=None``, ``external_source`` -> the op,
``num_threads`` = cores). Printed per op: the mean and largest absolute difference in
uint8 levels and the share of values that differ, then each one's best time per batch
(``--repeat`` runs; DALI's pipeline runs synchronously, and its time includes handing the
batch to the pipeline). DALI comes
with the ``bench`` extra (``pip install nvidia-dali-cuda120``); without it the command
says so and stops.
"""

from __future__ import annotations

import argparse
import glob
import os
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=5)
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

        pipe = dali_pipeline(images, dali_name, kwargs)
        ours = gpuio_run()
        theirs = [np.asarray(pipe.run()[0].at(i)) for i in range(len(images))]
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
    write_json(args.out, dict(machine=info, dali=dali.__version__, count=len(images), size=args.size, rows=rows))


if __name__ == "__main__":
    main()
