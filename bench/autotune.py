"""Read-ahead autotuning: ``gpuio.Loader``'s defaults (``prefetch="auto"``,
``threads="auto"``) against a grid of hand-set ``prefetch`` and ``threads``.

    python bench/autotune.py                  # quick: about five minutes on 2 cores
    python bench/autotune.py --size tiny      # seconds; checks that it works
    python bench/autotune.py --out out/autotune.json

Pipelines: ``read only`` (a file tree of ~100 KB random files, bench/loader.py's) and
``image train`` (its ImageNet-like JPEGs through decode_image -> random_resized_crop(224)
-> flip -> normalize, one Compose). Consumers: ``fast`` (2 ms of sleep per batch: the
loader is the bottleneck) and ``slow`` (sleeps twice the default loader's seconds per
batch under the fast consumer, measured first: the consumer is the bottleneck). Each
configuration is one fresh loader, kept for every round (so the default keeps what it
tuned, as it would from epoch to epoch); a round runs each configuration's epoch once,
in turn, and the figure is the median samples/s over ``--rounds`` rounds (each epoch's
first batch, the start-up, included). ``vs best`` is the default's figure over the
grid's best. ``prefetch``, ``decided at`` and ``input share`` are the default loader's:
the depth it ended at, the batch of its last decision, and the consumer's wait share
over every round. The machine's load average is printed with the table: on a shared
machine, other processes' load moves the figures between runs.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from typing import Any

import gpuio
from gpuio.bench._common import cache_dir, machine, print_table, write_json
from gpuio.bench.loader import image_ops, index_of, make_datasets

SIZES = {"quick": 1000, "tiny": 48}  # samples per pipeline
FAST_S = 0.002
GRID = {"prefetch": (0, 1, 4, 16), "threads": (1, 2)}


def epoch(loader: gpuio.Loader, step_s: float) -> tuple[int, float]:
    """Samples and seconds of one pass whose consumer sleeps ``step_s`` per batch."""
    rows, t0 = 0, time.perf_counter()
    for batch in loader:
        rows += len(batch["index"])
        time.sleep(step_s)
    return rows, time.perf_counter() - t0


def compare(index: gpuio.SampleIndex, ops: list[Any], batch: int, step_s: float, rounds: int) -> dict[str, Any]:
    """Median samples/s of the default and of each grid configuration; the default's tuning."""
    configs: dict[str, dict[str, Any]] = {"default": {}}
    for prefetch, threads in itertools.product(GRID["prefetch"], GRID["threads"]):
        configs[f"prefetch={prefetch} threads={threads}"] = {"prefetch": prefetch, "threads": threads}
    loaders = {name: gpuio.Loader(index, batch, ops=ops, output="numpy", **kw) for name, kw in configs.items()}
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, loader in loaders.items():
            rows, seconds = epoch(loader, step_s)
            rates[name].append(rows / seconds)
    median = {name: statistics.median(r) for name, r in rates.items()}
    best = max((n for n in median if n != "default"), key=median.__getitem__)
    s = loaders["default"].stats()
    for loader in loaders.values():
        loader.close()
    return {"default": median["default"], "best": best, "best_rate": median[best],
            "vs_best": median["default"] / median[best], "prefetch": s["prefetch"],
            "decided_at": s["tuning"][-1]["batch"] if s["tuning"] else None,
            "input_share": s["consumer"]["input_share"], "tuning": s["tuning"],
            "peak_bytes": s["peak_bytes_in_flight"], "budget": s["buffers"]["budget"], "all": median}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="quick")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    n = SIZES[a.size]
    paths = make_datasets(cache_dir(), n, images=image_ops() is not None)
    pipelines = {"read only": (index_of("filetree", paths["filetree"]), [])}
    if "jpeg" in paths:
        pipelines["image train"] = (gpuio.formats.filetree(paths["jpeg"]), image_ops())
    load = os.getloadavg()
    rows = []
    for name, (index, ops) in pipelines.items():
        probe = gpuio.Loader(index, a.batch_size, ops=ops, output="numpy")
        epoch(probe, FAST_S)  # warms the page cache and the decoders
        batches, seconds = len(probe), epoch(probe, FAST_S)[1]
        probe.close()
        for consumer, step_s in (("fast", FAST_S), ("slow", 2 * seconds / batches)):
            r = compare(index, ops, a.batch_size, step_s, a.rounds)
            rows.append({"pipeline": name, "consumer": f"{consumer} ({1e3 * step_s:.0f} ms)", "batches": batches,
                         **r, "decided_at": "-" if r["decided_at"] is None else r["decided_at"]})
    load = (load, os.getloadavg())
    print(f"{n} samples per pipeline, batches of {a.batch_size}, median of {a.rounds} rounds; "
          f"load average {load[0][0]:.1f} before, {load[1][0]:.1f} after ({os.cpu_count()} cores)")
    print_table(rows, [("pipeline", "pipeline", ""), ("consumer", "consumer", ""), ("default", "default/s", ".0f"),
                       ("best", "grid's best", ""), ("best_rate", "best/s", ".0f"), ("vs_best", "vs best", ".2f"),
                       ("prefetch", "prefetch", "d"), ("decided_at", "decided at", ""),
                       ("batches", "batches/epoch", "d"), ("input_share", "input share", ".3f")])
    write_json(a.out, {"machine": machine(), "load_average": load, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
