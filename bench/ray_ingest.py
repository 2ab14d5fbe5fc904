"""The image pipeline on a Ray cluster: gpuio.ray against Ray Data's own readers.

    python bench/ray_ingest.py [--count 1000] [--cpus N] [--batch 64] [--epochs 3] [--out ray.json]

One run, one local Ray cluster (``ray.init(num_cpus=--cpus)``, default all cores), the
sample dataset's ``--count`` JPEGs (``gpuio.sample.make_image_tree``, in the cache
folder), the same work for each row: decode to RGB, resize to 224x224, normalize per
channel (0-255 mean and std) into float32 CHW; every pass iterates the whole dataset in
batches of ``--batch`` rows on the driver, as a trainer would. Rows:

- ``gpuio.ray``: ``gpuio.ray.read(filetree, ops=[decode_image(), resize((224, 224)),
  normalize(...)])``: read tasks of whole batches, the storage core's reads, the ops on
  the workers (on the CPU, decode, resize and normalize as one fused C call per batch);
- ``Ray Data``: ``ray.data.read_images(root, mode="RGB", size=(224, 224))`` (Pillow
  decodes and resizes) and ``map_batches`` of the normalization in NumPy, as Ray plans
  it (read tasks of a few files each), and again with ``override_num_blocks`` set to
  gpuio.ray's default task count (4 per CPU);
- ``gpuio.ray, normalize in the trainer's Collate``: decode and resize on the workers
  (uint8 rows through the object store, a quarter of float32's bytes), normalize in
  ``gpuio.ray.Collate`` inside ``iter_torch_batches`` on the driver, here on its CPU
  (on a GPU trainer this is the GPU end);
- ``gpuio.Loader``: the same ops in a Loader on the driver alone (no Ray), for scale.

Each row has one untimed pass, then ``--epochs`` interleaved rounds; the best pass
counts (images/s, and the ratio to Ray Data's row). Needs ``pip install 'gpuio[ray]'``.
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

import gpuio
from gpuio import formats, ops
from gpuio.bench._common import BenchError, interleaved_rounds, machine, print_table, sample_root, write_json

MEAN, STD = [123.7, 116.3, 103.5], [58.4, 57.1, 57.4]
SIZE = 224


def gpuio_ops() -> list[Any]:
    return [ops.decode_image(), ops.resize((SIZE, SIZE)), ops.normalize(mean=MEAN, std=STD)]


def normalize_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ray Data's row: uint8 NHWC images to normalized float32 NCHW."""
    x = batch["image"].astype(np.float32)
    x -= np.asarray(MEAN, np.float32)
    x /= np.asarray(STD, np.float32)
    return {"image": np.ascontiguousarray(x.transpose(0, 3, 1, 2))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1000, help="JPEGs of the sample dataset")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="the Ray cluster's CPUs")
    parser.add_argument("--batch", type=int, default=64, help="rows per batch (gpuio's read tasks and the trainer)")
    parser.add_argument("--epochs", type=int, default=3, help="timed rounds")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    try:
        import ray
        import ray.data

        import gpuio.ray as gray
    except ImportError as exc:
        raise BenchError(f"this bench needs Ray Data: pip install 'gpuio[ray]' ({exc})") from exc

    root = sample_root(args.count)
    index = formats.filetree(root)
    ray.init(num_cpus=args.cpus, address="local", include_dashboard=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        def gpuio_ray() -> Iterator[np.ndarray]:
            ds = gray.read(index, ops=gpuio_ops(), batch_size=args.batch)
            for batch in ds.iter_batches(batch_size=args.batch, batch_format="numpy"):
                yield batch["image"]

        def ray_data(**read_options: Any) -> Iterator[np.ndarray]:
            ds = ray.data.read_images(root, mode="RGB", size=(SIZE, SIZE), **read_options)
            ds = ds.map_batches(normalize_batch, batch_format="numpy", batch_size=args.batch)
            for batch in ds.iter_batches(batch_size=args.batch, batch_format="numpy"):
                yield batch["image"]

        trainer = gray.Collate([ops.normalize(mean=MEAN, std=STD)], device="cpu")

        def gpuio_ray_trainer() -> Iterator[Any]:
            ds = gray.read(index, ops=gpuio_ops()[:2], batch_size=args.batch)
            for batch in ds.iter_torch_batches(batch_size=args.batch, collate_fn=trainer, device="cpu"):
                yield batch["image"]

        loader = gpuio.Loader(index, args.batch, ops=gpuio_ops(), output="numpy", threads=args.cpus)

        def gpuio_loader() -> Iterator[np.ndarray]:
            for batch in loader:
                yield batch["image"]

        tasks = 4 * args.cpus  # gpuio.ray's default number of read tasks
        runs = {"gpuio.ray": gpuio_ray, "Ray Data (read_images + map_batches)": ray_data,
                f"Ray Data, {tasks} read tasks": functools.partial(ray_data, override_num_blocks=tasks),
                "gpuio.ray, normalize in the trainer's Collate": gpuio_ray_trainer,
                "gpuio.Loader (driver only, no Ray)": gpuio_loader}
        rates, failed = interleaved_rounds(runs, args.epochs, count=len(index))
    finally:
        ray.shutdown()
    base = rates.get("Ray Data (read_images + map_batches)")
    rows = [{"row": name, "images_s": rates.get(name), "vs_ray_data": rates[name] / base if name in rates and base
             else None, "error": failed.get(name, "")} for name in runs]
    info = machine()
    print(f"\n{info.get('cpu', '?')}, {args.cpus} Ray CPUs; {len(index)} JPEGs ({root}); decode + resize "
          f"{SIZE}x{SIZE} + normalize, batches of {args.batch}; best of {args.epochs} passes")
    print_table(rows, [("row", "pipeline", ""), ("images_s", "images/s", ".0f"),
                       ("vs_ray_data", "x Ray Data", ".2f"), ("error", "error", "")])
    write_json(args.out, dict(machine=info, ray=ray.__version__, gpuio=gpuio.__version__, count=len(index),
                              cpus=args.cpus, batch=args.batch, epochs=args.epochs, rows=rows))


if __name__ == "__main__":
    main()
