"""Loader(prefetch="auto"), the default: the read-ahead deepens while the consumer waits
and the stages have time to spare, within the buffer budget, and says why in stats()
and the ``gpuio`` log; a consumer that does not wait, a budget that binds and an
explicit prefetch each keep it where it is; on a long epoch it settles within the
first tenth, and a noisy wait does not move it back and forth. decode_parts="auto", the
default, by the same tuner: a JPEG chain's batches split into more parts while its
workers are saturated and cores idle, never beyond the cores of the CPU budget, and a
split that runs no faster is undone."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.pipeline._stats import cpu_budget
from gpuio.sample import make_image_tree

from test_stats import tree

SLOW_EVERY = 16  # one batch in this many takes the op SLOW_S, the others FAST_S
SLOW_S, FAST_S = 0.05, 0.001


class Jitter:
    """An op whose latency varies: batches of samples 0, 16, 32 ... take 50 ms, the rest 1 ms
    (the mean is well under a 5 ms consumer's step; the slow one is ten steps)."""

    def __init__(self, every=SLOW_EVERY, slow_s=SLOW_S):
        self.every, self.slow_s = every, slow_s

    def __call__(self, batch):
        time.sleep(self.slow_s if int(batch.index[0]) % self.every == 0 else FAST_S)
        return batch


def loader(index, jitter=None, **kw):
    return gpuio.Loader(index, 1, ops=[jitter or Jitter()], threads=2, output="numpy", **kw)


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


def test_the_read_ahead_settles_within_the_first_tenth_of_a_long_epoch(tmp_path):
    """400 batches, one in 8 taking 30 ms: the spans are as short as a tenth of the epoch
    needs, and the read-ahead deepens in its first 40 batches and changes nothing after
    them."""
    ld = loader(tree(tmp_path / "t", n=400), Jitter(every=8, slow_s=0.03))
    waits = consume(ld, 0.004)
    changes = [d for d in ld.stats()["tuning"] if d["to"] != d["from"]]
    assert changes and all(d["setting"] == "prefetch" and d["batch"] <= 40 for d in changes), changes
    assert "over 8 batches" in changes[0]["why"]
    assert sum(waits[-40:]) < sum(waits[1:41]) / 2, (sum(waits[1:41]), sum(waits[-40:]))


def test_a_noisy_wait_does_not_move_the_settings_back_and_forth(tmp_path):
    """One batch in 16 takes 50 ms, so a span of 8 batches waits for it or does not: over
    four epochs the read-ahead only deepens, once per depth at most, and nothing is
    decided more than once."""
    ld = loader(tree(tmp_path / "t", n=64))
    for _ in range(4):
        consume(ld, 0.005)
    tuning = ld.stats()["tuning"]
    changes = [(d["from"], d["to"]) for d in tuning if d["to"] != d["from"]]
    assert all(b > a for a, b in changes) and len(set(changes)) == len(changes), tuning
    assert len(tuning) == len({(d["setting"], d["from"], d["to"], d["why"]) for d in tuning}), tuning


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


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """40 JPEGs of about 500x375 pixels (10 batches of 4)."""
    return gpuio.formats.filetree(make_image_tree(tmp_path_factory.mktemp("jpg"), count=40, classes=2,
                                                  progress=False))


def jpeg_loader(index, **kw):
    chain = ops.Compose([ops.decode_image(), ops.random_resized_crop(64), ops.flip(), ops.normalize()])
    return gpuio.Loader(index, 4, fields=("data",), ops=[chain], threads=1, output="numpy", **kw)


def parts_decided(s):
    return [d for d in s["tuning"] if d["setting"] == "decode_parts"]


def test_a_saturated_decoder_with_idle_cores_splits_its_batches(jpegs, caplog):
    """One worker decodes while the consumer waits and the process leaves cores idle:
    its batches split into parts, up to the cores it may use; the pixels equal those of
    one part."""
    ld = jpeg_loader(jpegs)
    with caplog.at_level(logging.INFO, logger="gpuio"):
        for _ in range(3):
            last = [b["image"] for b in ld]
    s, cores = ld.stats(), cpu_budget()
    decided = parts_decided(s)
    assert decided and all(d["to"] <= cores for d in decided) and s["decode_parts"] <= cores
    if cores > 1:  # a planted case: split, with the reason and a log line, kept if it runs faster
        grown = [d for d in decided if d["to"] > d["from"]]
        assert grown and grown[0]["from"] == 1 and grown[0]["to"] > 1
        assert all("workers are" in d["why"] and "idle cores" in d["why"] for d in grown)
        assert any("decode_parts 1 -> 2" in r.getMessage() for r in caplog.records)
        undone = [d for d in decided if d["to"] < d["from"]]
        assert all("batches/s" in d["why"] and "undone" in d["why"] for d in undone)
        assert len(grown) == 1 and len(undone) <= 1  # kept or undone, and not tried again: the wait stays ~100%
        assert s["decode_parts"] == (1 if undone and undone[-1]["batch"] > grown[-1]["batch"] else grown[-1]["to"])
    with gpuio.config.override(decode_parts=1):
        one = jpeg_loader(jpegs)
    one.set_epoch(2)  # the epoch of `last`: the same random draws
    assert np.array_equal(np.concatenate(last), np.concatenate([b["image"] for b in one]))
    assert parts_decided(one.stats()) == [] and one.stats()["decode_parts"] == 1


def test_a_one_core_budget_keeps_one_part(jpegs, monkeypatch):
    """The same case where the process may use one core (torchrun's local world size
    takes the rest): the parts stay at one, and a decision says why."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpu_budget()))
    assert cpu_budget() == 1
    ld = jpeg_loader(jpegs)
    for _ in range(2):
        list(ld)
    s = ld.stats()
    decided = parts_decided(s)
    assert s["decode_parts"] == 1 and decided and all(d["from"] == d["to"] == 1 for d in decided)
    assert any("one per core" in d["why"] or "cores busy" in d["why"] for d in decided)


def test_a_slow_consumer_keeps_one_part_and_an_explicit_value_is_kept(jpegs):
    ld = jpeg_loader(jpegs)
    for _ in ld:
        time.sleep(0.05)
    assert parts_decided(ld.stats()) == [] and ld.stats()["decode_parts"] == 1
    with gpuio.config.override(decode_parts=3):  # the value in force when the loader is made
        ld = jpeg_loader(jpegs)
    for _ in range(2):
        list(ld)
    s = ld.stats()
    assert s["decode_parts"] == 3 and parts_decided(s) == []
