"""Epoch-order benchmark: what one rank pays at an epoch start (or a resume) to know the
samples it reads this epoch.

    python bench/order.py [--n 1280000,10000000,100000000] [--world-size 64] [--repeat 3] [--out results.json]

For each dataset size ``--n`` and each rule, a fresh child process computes rank 0's
samples for the whole epoch (every batch of ``--batch-size``, ``last_batch="partial"``),
and reports the wall time and the peak-RSS increase while doing it (the best of
``--repeat`` children for time, the largest increase for memory):

- ``keyed``: gpuio's order (``gpuio.pipeline.order``, order version 2): a keyed
  permutation evaluated at the rank's own positions only (``EpochPlan.samples``);
- ``full-permutation``: the rule before it (order version 1): every rank draws the whole
  permutation ``np.random.Generator(np.random.PCG64([seed, epoch])).permutation(N)`` and
  takes its share of it.

It prints the machine, a table with the keyed rule's speed-up and the growth exponent
of each rule's time between sizes, and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from gpuio.bench._common import machine, peak_rss, print_table, reset_peak_rss, write_json

RULES = ("keyed", "full-permutation")


def rank_samples(rule: str, n: int, batch_size: int, world_size: int, rank: int, epoch: int) -> np.ndarray:
    """The samples ``rank`` reads as real rows in ``epoch`` under ``rule``."""
    from gpuio.pipeline.order import EpochPlan, epoch_order

    plan = EpochPlan(n, batch_size, world_size, rank, "partial")
    if rule == "keyed":
        return plan.samples(epoch_order(n, True, 0, epoch))
    order = np.random.Generator(np.random.PCG64([0, epoch])).permutation(n).astype(np.int64, copy=False)
    return plan.samples(order)


def child(rule: str, n: int, batch_size: int, world_size: int) -> dict[str, Any]:
    rank_samples(rule, 1000, batch_size, 4, 0, 0)  # imports and first calls out of the figure
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    mine = rank_samples(rule, n, batch_size, world_size, 0, 1)
    seconds = time.perf_counter() - t0
    rss1 = peak_rss()
    return {"rule": rule, "samples": n, "world_size": world_size, "rank_samples": int(len(mine)),
            "seconds": seconds, "rss_mb": (rss1 - rss0) / 1024, "result_mb": mine.nbytes / 2**20}


def run_child(rule: str, n: int, batch_size: int, world_size: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", rule, "--n", str(n),
           "--batch-size", str(batch_size), "--world-size", str(world_size)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{rule} at {n} samples failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="1280000,10000000,100000000", help="dataset sizes, comma-separated")
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3, help="fresh child processes per figure")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, int(args.n), args.batch_size, args.world_size)))
        return
    sizes = [int(x) for x in args.n.split(",")]
    rules = [r for r in args.rules.split(",") if r]
    unknown = [r for r in rules if r not in RULES]
    if unknown:
        p.error(f"unknown rule(s) {unknown}; choose from {', '.join(RULES)}")
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; world_size {args.world_size}, "
          f"batch_size {args.batch_size}, rank 0, fresh process per figure, best of {args.repeat}")
    rows = []
    for n in sizes:
        for rule in rules:
            runs = [run_child(rule, n, args.batch_size, args.world_size) for _ in range(args.repeat)]
            best = min(runs, key=lambda r: r["seconds"])
            rows.append({**best, "rss_mb": max(r["rss_mb"] for r in runs),
                         "all_seconds": [r["seconds"] for r in runs]})
    by = {(r["rule"], r["samples"]): r for r in rows}
    for r in rows:
        other = by.get(("full-permutation", r["samples"]))
        if r["rule"] == "keyed" and other:
            r["speedup"] = f"{other['seconds'] / r['seconds']:.1f}x"
        smaller = [m for m in sizes if m < r["samples"] and (r["rule"], m) in by]
        if smaller:
            prev = by[(r["rule"], max(smaller))]
            r["growth"] = math.log(r["seconds"] / prev["seconds"]) / math.log(r["samples"] / prev["samples"])
    print_table(rows, [("rule", "rule", ""), ("samples", "samples", "d"), ("rank_samples", "rank's samples", "d"),
                       ("seconds", "epoch start s", ".3f"), ("rss_mb", "peak RSS +MB", ".1f"),
                       ("result_mb", "result MB", ".1f"), ("speedup", "vs full", ""),
                       ("growth", "time exponent", ".2f")])
    write_json(args.out, {"machine": info, "world_size": args.world_size, "batch_size": args.batch_size,
                          "rows": rows})


if __name__ == "__main__":
    main()
