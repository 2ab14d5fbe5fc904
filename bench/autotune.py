"""Autotuning: ``gpuio.Loader``'s defaults (``prefetch="auto"``, ``threads="auto"``,
``decode_parts="auto"``) against a grid of hand-set ``prefetch``, ``threads`` and
``decode_parts``, and against tf.data's AUTOTUNE on the same image chain.

    python bench/autotune.py                  # quick: about fifteen minutes on 2 cores
    python bench/autotune.py --size tiny      # a minute; checks that it works
    python bench/autotune.py --out out/autotune.json

Pipelines: ``read only`` (a file tree of ~100 KB random files, bench/loader.py's),
``image train`` (its ImageNet-like JPEGs through decode_image -> random_resized_crop(224)
-> flip -> normalize, one Compose) and ``video clips`` (clips of 8 frames, 2 apart, of
640x360 H.264 videos with a keyframe every 2 s, bench/video.py's, decoded on the CPU by
ops.decode_video). Consumers: ``fast`` (2 ms of sleep per batch: the loader is the
bottleneck) and ``slow`` (sleeps twice the default loader's seconds per batch under the
fast consumer, measured first: the consumer is the bottleneck). Each configuration is one
fresh loader, kept for every round (so the default keeps what it tuned, as it would from
epoch to epoch); a round runs each configuration's epoch once, in turn (interleaved, so
that the machine's load hits all alike; each round starts one configuration later), and
the figure is the median samples/s over ``--rounds`` rounds (each epoch's first batch,
the start-up, included).

``tf.data AUTOTUNE`` (image train, where tensorflow imports): the same files through
``read_file -> extract_jpeg_shape -> sample_distorted_bounding_box (area 0.08-1, aspect
3/4-4/3) -> decode_and_crop_jpeg -> resize(224, bilinear) -> random_flip_left_right ->
normalize`` in ``map(num_parallel_calls=AUTOTUNE)``, ``batch``, ``prefetch(AUTOTUNE)``;
an iterator per epoch, as Keras's ``fit`` makes one (an iterator kept across epochs, over
``repeat()``, works ahead into the next epoch while the other configurations run, taking
their cores).

Columns: ``vs best`` is the default's figure over the grid's best (the best of many noisy
figures: on a loaded machine it is lucky as often as it is good); ``vs same`` over the
grid's configuration with the settings the default ended at (where the grid has them);
``tf.data`` its figure and its ratio to the default. ``prefetch``/``parts`` are where the default ended;
``changes``: how many times the default changed a setting; ``settled at``: the batch of
its last change, counted over every epoch it ran, and that as a share of one epoch (the
issue's target: within the first 10% of an epoch; the tuner decides at the end of spans
of 4 to 8 batches past the start-up, short enough for four decisions in an epoch's first
tenth where the epoch is long enough); ``peak
MB``: the default's peak bytes read and not yet handed over against its buffer budget;
``input share`` the consumer's wait share over every round. The machine's load average
is printed with the table: on a shared machine, other processes' load moves the figures
between runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import gpuio
from gpuio.bench._common import cache_dir, machine, print_table, write_json
from gpuio.bench.loader import MEAN, STD, image_ops, index_of, make_datasets

SIZES = {"quick": (1000, 64), "tiny": (48, 16)}  # samples per file pipeline, clips of the video pipeline
FAST_S = 0.002
GRID = {"prefetch": (0, 1, 4, 16), "threads": (1, 2)}
PARTS = (1, 2)  # decode_parts in the grid of a pipeline that decodes JPEGs
VIDEO = {"width": 640, "height": 360, "videos": 4, "sequence_length": 8, "stride": 2, "batch": 2}

Epoch = Callable[[float], tuple[int, float]]  # step_s -> samples and seconds of one pass


def loader_epoch(loader: gpuio.Loader) -> Epoch:
    """One pass of ``loader`` whose consumer sleeps ``step_s`` per batch."""

    def run(step_s: float) -> tuple[int, float]:
        rows, t0 = 0, time.perf_counter()
        for batch in loader:
            rows += len(batch["index"])
            time.sleep(step_s)
        return rows, time.perf_counter() - t0

    return run


def tf_data_epoch(paths: list[str], batch: int) -> Epoch | None:
    """One epoch of the image chain in tf.data with AUTOTUNE (see the module docstring);
    None where tensorflow does not import."""
    try:
        import tensorflow as tf
    except ImportError:
        return None
    mean, std = tf.constant(MEAN, tf.float32), tf.constant(STD, tf.float32)
    whole = tf.constant([[[0.0, 0.0, 1.0, 1.0]]], tf.float32)

    @tf.autograph.experimental.do_not_convert  # plain tf ops, no Python control flow to convert
    def chain(path: Any) -> Any:
        data = tf.io.read_file(path)
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            tf.image.extract_jpeg_shape(data), bounding_boxes=whole, min_object_covered=0.0,
            aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        y, x, _ = tf.unstack(begin)
        h, w, _ = tf.unstack(size)
        image = tf.image.decode_and_crop_jpeg(data, tf.stack([y, x, h, w]), channels=3)
        image = tf.image.random_flip_left_right(tf.image.resize(image, (224, 224)))
        return (image - mean) / std

    ds = (tf.data.Dataset.from_tensor_slices(paths).map(chain, num_parallel_calls=tf.data.AUTOTUNE)
          .batch(batch).prefetch(tf.data.AUTOTUNE))

    def run(step_s: float) -> tuple[int, float]:
        rows, t0 = 0, time.perf_counter()
        for images in ds:  # an iterator per epoch, as Keras's fit makes one
            rows += int(images.shape[0])
            time.sleep(step_s)
        return rows, time.perf_counter() - t0

    return run


def compare(index: gpuio.SampleIndex, ops: list[Any], batch: int, step_s: float, rounds: int, parts: bool,
            others: dict[str, Epoch]) -> dict[str, Any]:
    """Median samples/s of the default, of each grid configuration (``decode_parts`` too
    where ``parts``) and of ``others``; the default's tuning."""
    grid = {"default": {}}
    for prefetch, threads, n in itertools.product(GRID["prefetch"], GRID["threads"], PARTS if parts else (None,)):
        name = f"prefetch={prefetch} threads={threads}" + (f" parts={n}" if n else "")
        grid[name] = {"prefetch": prefetch, "threads": threads, "decode_parts": n}
    loaders = {}
    for name, kw in grid.items():
        n = kw.pop("decode_parts", None)
        with gpuio.config.override(**({"decode_parts": n} if n else {})):  # a loader takes the value in force
            loaders[name] = gpuio.Loader(index, batch, ops=ops, output="numpy", **kw)
    runs = {name: loader_epoch(loader) for name, loader in loaders.items()} | others
    rates: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(rounds):  # each round starts one configuration later: none always runs first
        for name in order[r % len(order):] + order[:r % len(order)]:
            rows, seconds = runs[name](step_s)
            rates[name].append(rows / seconds)
    median = {name: statistics.median(r) for name, r in rates.items()}
    best = max((n for n in grid if n != "default"), key=median.__getitem__)
    s = loaders["default"].stats()
    batches = len(loaders["default"])
    for loader in loaders.values():
        loader.close()
    changes = [d["batch"] for d in s["tuning"] if d["to"] != d["from"]]
    last = changes[-1] if changes else None
    tf_rate = median.get("tf.data AUTOTUNE")
    ended = f"prefetch={s['prefetch']} threads={s['threads']['threads']}" + (
        f" parts={s['decode_parts']}" if parts else "")  # the grid's configuration the default ended at, if any
    same = median.get(ended) if ended in grid else None
    return {"default": median["default"], "best": best, "best_rate": median[best],
            "vs_best": median["default"] / median[best], "prefetch": s["prefetch"],
            "vs_same": None if same is None else median["default"] / same,
            "parts": s["decode_parts"] if parts else None, "batches": batches,
            "changes": len(changes), "decided_at": last, "decided_share": None if last is None else last / batches,
            "tf_data": tf_rate, "tf_vs_default": None if tf_rate is None else tf_rate / median["default"],
            "input_share": s["consumer"]["input_share"], "tuning": s["tuning"],
            "peak_mb": s["peak_bytes_in_flight"] / 1e6, "budget_mb": s["buffers"]["budget"] / 1e6,
            "within_budget": s["peak_bytes_in_flight"] <= s["buffers"]["budget"], "all": median, "rounds": rates}


def video_pipeline(clips: int) -> tuple[gpuio.SampleIndex, list[Any], int] | None:
    """The video clips pipeline (see the module docstring): ``clips`` clips spread over
    the videos; None where PyAV (the encoder) does not import."""
    try:
        from gpuio.bench.video import make_videos
        paths = make_videos(VIDEO["width"], VIDEO["height"], VIDEO["videos"])
    except ImportError:
        return None
    index = gpuio.formats.video(paths, sequence_length=VIDEO["sequence_length"], stride=VIDEO["stride"])
    every = max(1, len(index) // clips)
    return index.take(list(range(0, len(index), every))[:clips]), [gpuio.ops.decode_video()], VIDEO["batch"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="quick")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="", help="run the pipelines whose name contains this")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    n, clips = SIZES[a.size]
    paths = make_datasets(cache_dir(), n, images=image_ops() is not None)
    pipelines: dict[str, Callable[[], Any]] = {
        "read only": lambda: (index_of("filetree", paths["filetree"]), [], a.batch_size)}
    if "jpeg" in paths:
        pipelines["image train"] = lambda: (gpuio.formats.filetree(paths["jpeg"]), image_ops(), a.batch_size)
    pipelines["video clips"] = lambda: video_pipeline(clips)
    load = [os.getloadavg()]
    rows = []
    for name, make in pipelines.items():
        if a.only not in name or (made := make()) is None:
            continue
        index, ops, batch = made
        jpeg = name == "image train"
        probe = gpuio.Loader(index, batch, ops=ops, output="numpy")
        loader_epoch(probe)(FAST_S)  # warms the page cache and the decoders
        batches, seconds = len(probe), loader_epoch(probe)(FAST_S)[1]
        probe.close()
        tf_run = tf_data_epoch(index.files.many(index.extents["data"].file), batch) if jpeg else None
        for consumer, step_s in (("fast", FAST_S), ("slow", 2 * seconds / batches)):
            others = {"tf.data AUTOTUNE": tf_run} if tf_run is not None else {}
            r = compare(index, ops, batch, step_s, a.rounds, parts=jpeg, others=others)
            rows.append({"pipeline": name, "consumer": f"{consumer} ({1e3 * step_s:.0f} ms)", **r})
            load.append(os.getloadavg())
    print(f"{n} samples per file pipeline, {clips} clips, batches of {a.batch_size} (clips: {VIDEO['batch']}), "
          f"median of {a.rounds} rounds; load average (1 min) "
          f"{' '.join(f'{x[0]:.1f}' for x in load)} (before, after each row; {os.cpu_count()} cores)")
    print_table(rows, [("pipeline", "pipeline", ""), ("consumer", "consumer", ""), ("default", "default/s", ".0f"),
                       ("best", "grid's best", ""), ("best_rate", "best/s", ".0f"), ("vs_best", "vs best", ".2f"),
                       ("vs_same", "vs same", ".2f"),
                       ("tf_data", "tf.data/s", ".0f"), ("tf_vs_default", "tf/default", ".2f"),
                       ("prefetch", "prefetch", "d"), ("parts", "parts", ""), ("changes", "changes", "d"),
                       ("decided_at", "settled at", ""),
                       ("decided_share", "of epoch", ".2f"), ("batches", "batches/epoch", "d"),
                       ("peak_mb", "peak MB", ".1f"), ("budget_mb", "budget MB", ".0f"),
                       ("input_share", "input share", ".3f")])
    write_json(a.out, {"machine": machine(), "load_average": load, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
