"""Loader(prefetch="auto"), the default: the read-ahead deepens while the consumer waits
and the stages have time to spare, within the buffer budget, and says why in stats()
and the ``gpuio`` log; a consumer that does not wait, a budget that binds and an
explicit prefetch each keep it where it is."""

from __future__ import annotations

import logging
import time

import gpuio

from test_stats import tree

SLOW_EVERY = 16  # one batch in this many takes the op SLOW_S, the others FAST_S
SLOW_S, FAST_S = 0.05, 0.001


class Jitter:
    """An op whose latency varies: batches of samples 0, 16, 32 ... take 50 ms, the rest 1 ms
    (the mean is well under a 5 ms consumer's step; the slow one is ten steps)."""

    def __call__(self, batch):
        time.sleep(SLOW_S if int(batch.index[0]) % SLOW_EVERY == 0 else FAST_S)
        return batch


def loader(index, **kw):
    return gpuio.Loader(index, 1, ops=[Jitter()], threads=2, output="numpy", **kw)


def consume(ld, step_s):
    """The consumer's wait in next() per batch, working ``step_s`` on each."""
    waits, it = [], iter(ld)
    while True:
        t0 = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            return waits
        waits.append(time.perf_counter() - t0)
        time.sleep(step_s)


def test_a_fast_consumer_deepens_the_read_ahead_and_waits_less(tmp_path, caplog):
    ld = loader(tree(tmp_path / "t", n=320))
    with caplog.at_level(logging.INFO, logger="gpuio"):
        waits = consume(ld, 0.005)
    s = ld.stats()
    grown = [d for d in s["tuning"] if d["to"] > d["from"]]
    assert grown and s["prefetch"] > 1 and s["window"] == s["prefetch"] + 3  # one reader, two op workers
    assert all(d["setting"] == "prefetch" and "consumer waited" in d["why"] for d in grown)
    assert [d["batch"] for d in s["tuning"]] == sorted(d["batch"] for d in s["tuning"])
    assert sum(1 for r in caplog.records if "prefetch" in r.getMessage()) == len(s["tuning"])
    # the consumer's wait share over a stretch of 32 batches (two slow ones) before and after the tuning
    first = sum(waits[1:33]) / (sum(waits[1:33]) + 32 * 0.005)
    last = sum(waits[-32:]) / (sum(waits[-32:]) + 32 * 0.005)
    assert first > 0.1 and last < first / 2, (first, last, s["tuning"])


def test_a_slow_consumer_keeps_the_read_ahead(tmp_path):
    ld = loader(tree(tmp_path / "t", n=64))
    consume(ld, 0.03)
    s = ld.stats()
    assert s["tuning"] == [] and s["prefetch"] == 1 and s["window"] == 4


def test_the_read_ahead_stops_at_the_buffer_budget_and_says_so(tmp_path):
    index = tree(tmp_path / "t", n=160)
    budget = 6 * 65536  # a batch's read buffer takes 64 KiB: six batches, the consumer holds one
    with gpuio.config.override(buffer_budget=budget):
        ld = loader(index)
        consume(ld, 0.005)
    s = ld.stats()
    assert s["window"] == 5 and s["prefetch"] == 2
    assert s["tuning"][-1]["to"] == 2 and "buffer budget" in s["tuning"][-1]["why"]
    assert s["peak_bytes_in_flight"] <= budget and s["buffers"]["held"] <= budget == s["buffers"]["budget"]


def test_an_explicit_prefetch_is_kept(tmp_path):
    ld = loader(tree(tmp_path / "t", n=96), prefetch=1)
    consume(ld, 0.005)
    s = ld.stats()
    assert s["tuning"] == [] and s["prefetch"] == 1 and s["window"] == 4
    assert s["consumer"]["input_share"] > 0.1  # it waited, and nothing changed
