"""Crops decoded from JPEG restart intervals: the image chains on restart-marked JPEGs
(``gpuio.ops.restart.add_restart_markers``, offsets beside each image as a packed dataset
holds them) against libjpeg-turbo's decode-only ceiling on the source JPEGs.

    python bench/restart.py [--root TREE | --count 2000] [--batch 64] [--epochs 3] [--intervals 0,4,8] [--out restart.json]

Rows per pipeline, all from JPEG bytes held in memory (no storage, so that the rows
compare decoding alone), in interleaved rounds (images/s of the best pass):

- ``decode only (source)``: ``bench/images.py``'s ceiling on the source JPEGs (``train``:
  a random resized crop's window at gpuio's DCT scale; ``val``: every image whole);
- ``gpuio, source``: the chain (``ops.Compose``, its fused CPU decode) on the source JPEGs;
- ``gpuio, restarts N``: the chain on the JPEGs rewritten with a restart marker every N
  MCUs (``fit_rows``: the nearest interval that tiles the image's MCU rows; 0: every MCU
  row), their offsets in ``data.restarts``: only the intervals a crop covers are decoded.

``train``: decode, random resized crop 224, flip, normalize to float32 CHW; ``val``:
decode, resize 256, center crop 224, normalize. Each restart row also says the marked
bytes against the source's (the rewrite also makes the Huffman tables optimal, which
shrinks JPEGs written without that) and the seconds it took to mark them on one core;
``per round`` is the median over rounds of a row's pass against the ceiling's pass of the
same round; ``CPU ms/image`` the process CPU time of a row's cheapest pass, and the
ceiling's against it (a loaded machine moves it less than images/s), and of that pass the
CPU time per image the fused decode spent decoding JPEG windows and resampling them (the
rest: the images it decodes whole, CMYK and EXIF-rotated, and Python). Before timing, every restart row's outputs are checked equal to the source
row's (the same crops): the decode from intervals is bit-exact.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import gpuio
from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.bench._common import BenchError, interleaved_rounds, machine, print_table, sample_root, write_json
from gpuio.bench.images import MEAN, STD, cpu_timed, decode_only, image_paths
from gpuio.errors import FormatError
from gpuio.ops.decode import native_jpeg
from gpuio.ops.restart import add_restart_markers, restarts_field

PIPELINES = {"train": "decode, random resized crop 224, flip, normalize to float32 CHW",
             "val": "decode, resize 256, center crop 224, normalize to float32 CHW"}


def chain(pipeline: str) -> ops.Compose:
    """The ``train`` or ``val`` chain (see the module docstring)."""
    geometry = ([ops.random_resized_crop(224), ops.flip()] if pipeline == "train"
                else [ops.resize(shorter=256), ops.center_crop(224)])
    return ops.Compose([ops.decode_image(), *geometry, ops.normalize(MEAN, STD)])


def mark(bufs: list[np.ndarray], interval: int) -> tuple[list[np.ndarray], list[np.ndarray], float]:
    """``bufs`` with restart markers every ``interval`` MCUs (fitted to the rows), their
    offsets, and the seconds it took. An image libjpeg cannot rewrite stays as it is,
    with no offsets."""
    marked, offsets = [], []
    start = time.perf_counter()
    for buf in bufs:
        try:
            data, where = add_restart_markers(buf, interval)
        except FormatError:
            data, where = buf.tobytes(), np.zeros(0, np.uint32)
        marked.append(np.frombuffer(data, np.uint8))
        offsets.append(where)
    return marked, offsets, time.perf_counter() - start


def chain_run(pipeline: str, bufs: list[np.ndarray], restarts: list[np.ndarray] | None,
              batch: int) -> Callable[[], Iterator[Any]]:
    """One pass of ``pipeline``'s chain over encoded ``bufs`` in batches of ``batch``
    (``restarts``: their restart offsets, or None), the same random draws every pass."""
    pipe = chain(pipeline)

    def run() -> Iterator[Any]:
        for start in range(0, len(bufs) - batch + 1, batch):
            index = np.arange(start, start + batch)
            fields: dict[str, Any] = {"data": bufs[start: start + batch]}
            if restarts is not None:
                fields[restarts_field("data")] = restarts[start: start + batch]
            yield pipe(Batch(fields, index, sample_seeds(0, 0, index))).data["image"]

    return run


def stage_timed(run: Callable[[], Iterator[Any]], passes: list[tuple[float, float]]) -> Callable[[], Iterator[Any]]:
    """``run``, appending each pass's CPU seconds per item in the fused decode's two stages
    (``gpuio.ops._jpeg.stage_times``: decoding, resampling; all threads) to ``passes``."""
    jpeg = native_jpeg()

    def timed() -> Iterator[Any]:
        jpeg.time_stages(True)
        start, items = jpeg.stage_times(), 0
        try:
            for batch in run():
                items += int(batch.shape[0])
                yield batch
        finally:
            end = jpeg.stage_times()
            jpeg.time_stages(False)
        passes.append(tuple((b - a) / max(items, 1) for a, b in zip(start, end)))

    return timed


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="a JPEG file tree (default: the gpuio sample dataset)")
    parser.add_argument("--count", type=int, default=2000, help="images in the sample dataset")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3, help="timed passes per row; the best counts")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decode-only threads")
    parser.add_argument("--intervals", default="0,4,8",
                        help="restart intervals in MCUs, comma-separated (0: every MCU row)")
    parser.add_argument("--pipeline", choices=[*PIPELINES, "both"], default="both")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    root = args.root or sample_root(args.count)
    paths = image_paths(root)
    count = len(paths) - len(paths) % args.batch
    bufs = [np.fromfile(p, np.uint8) for p in paths[:count]]
    intervals = [int(n) for n in args.intervals.split(",")]
    pipelines = list(PIPELINES) if args.pipeline == "both" else [args.pipeline]
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores")
    print(f"dataset: {root}: {count} JPEGs ({sum(map(len, bufs)) / 2**20:.1f} MiB) in batches of {args.batch}, "
          f"held in memory; best of {args.epochs} passes")
    source_bytes = sum(map(len, bufs))
    marked = {n: mark(bufs, n) for n in intervals}
    rows, runs = [], {}
    for pipeline in pipelines:
        print(f"  {pipeline}: {PIPELINES[pipeline]}")
        source = chain_run(pipeline, bufs, None, args.batch)
        runs[f"{pipeline}: decode only (source)"] = decode_only(root, args.batch, args.workers, count, pipeline)
        runs[f"{pipeline}: gpuio, source"] = source
        rows += [{"pipeline": pipeline, "name": "decode only (source)"}, {"pipeline": pipeline, "name": "gpuio, source"}]
        for n, (data, offsets, seconds) in marked.items():
            run = chain_run(pipeline, data, offsets, args.batch)
            if any(not np.array_equal(g, w) for g, w in zip(run(), source())):
                raise BenchError(f"{pipeline}: the chain on JPEGs with restarts every {n} MCUs differs from the "
                                 f"chain on the source")
            name = f"gpuio, restarts {n or 'every row'}"
            runs[f"{pipeline}: {name}"] = run
            rows.append({"pipeline": pipeline, "name": name, "size": sum(map(len, data)) / source_bytes,
                         "mark_s": seconds})
    cpu: dict[str, list[float]] = {}
    stages: dict[str, list[tuple[float, float]]] = {}
    runs = {key: cpu_timed(run if "decode only" in key else stage_timed(run, stages.setdefault(key, [])),
                           cpu.setdefault(key, [])) for key, run in runs.items()}
    per_round: dict[str, list[float]] = {}
    speeds, failed = interleaved_rounds(runs, args.epochs, count, desc="restart rows", rounds=per_round)
    for pipeline in pipelines:
        ceiling = f"{pipeline}: decode only (source)"
        for row in (r for r in rows if r["pipeline"] == pipeline):
            key = f"{pipeline}: {row['name']}"
            if key in speeds:
                row["images_s"] = speeds[key]
                row["cpu_ms"] = 1e3 * min(cpu[key][1:])  # the first pass is the untimed warm-up
                if stages.get(key):  # the split of the cheapest pass
                    cheapest = stages[key][1:][int(np.argmin(cpu[key][1:]))]
                    row["decode_ms"], row["resample_ms"] = (1e3 * t for t in cheapest)
                if ceiling in speeds:
                    row["of_ceiling"] = speeds[key] / speeds[ceiling]
                    row["of_ceiling_per_round"] = float(np.median(np.divide(per_round[key], per_round[ceiling])))
                    row["of_ceiling_cpu"] = min(cpu[ceiling][1:]) / min(cpu[key][1:])
            if key in failed:
                row["note"] = failed[key]
    print_table(rows, [("pipeline", "pipeline", "s"), ("name", "row", "s"), ("images_s", "images/s", ".1f"),
                       ("of_ceiling", "of decode only", ".2f"), ("of_ceiling_per_round", "per round", ".2f"),
                       ("cpu_ms", "CPU ms/image", ".3f"), ("of_ceiling_cpu", "of decode only (CPU)", ".2f"),
                       ("decode_ms", "decode ms", ".3f"), ("resample_ms", "resample ms", ".3f"),
                       ("size", "bytes vs source", ".4f"), ("mark_s", "marking s", ".1f"), ("note", "note", "s")])
    payload = {"benchmark": "restart", "machine": info, "dataset": {"root": root, "images": count},
               "batch": args.batch, "epochs": args.epochs, "results": rows}
    write_json(args.out, payload)
    if failed:
        raise BenchError("; ".join(f"{name}: {error}" for name, error in failed.items()))
    return payload


if __name__ == "__main__":
    main()
