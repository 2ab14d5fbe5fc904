"""Loader.report(): pipelines made to be bound each way, and the verdict names the cause
that was planted: a slow consumer, a slow op on too few workers, throttled object
storage (503s from the fault proxy), a buffer budget that holds one batch in flight."""

from __future__ import annotations

import hashlib
import time

import numpy as np

import gpuio
from gpuio import formats
from gpuio.pipeline._stats import cpu_budget
from gpuio.storage import remote

from remote_env import FaultProxy, http_server
from test_stats import Sleep, tree


def test_a_slow_consumer_is_not_input_bound(tmp_path):
    ld = gpuio.Loader(tree(tmp_path / "t"), 4, threads=2, output="numpy")
    for _ in ld:
        time.sleep(0.02)
    v = ld.report()
    assert v.band == "not input-bound" and v.input_share < 0.05
    assert v.bottleneck == "consumer" and v.resource == "consumer"
    assert "nothing in the loader" in v.advice and str(v).startswith("not input-bound")


def test_a_slow_op_on_one_worker_binds_its_workers(tmp_path):
    ld = gpuio.Loader(tree(tmp_path / "t"), 4, ops=[Sleep(0.02)], threads=1, output="numpy")
    for _ in ld:
        pass
    v = ld.report()
    assert v.band == "highly input-bound" and v.input_share > 0.2
    assert v.bottleneck == "Sleep" and v.resource == "workers"
    assert "raise threads (now 1" in v.advice
    assert v.numbers["stage_busy"]["Sleep"] >= 0.8 and v.numbers["cpu_busy"] < 0.85
    for k, _ in enumerate(ld):  # a pass left early closes the stages: the verdict still knows their window
        if k == 3:
            break
    assert ld.report().resource == "workers"


class Burn:
    """An op that keeps a core busy for ``seconds`` per batch (hashing, which releases the GIL)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.block = seconds, bytes(1 << 20)

    def __call__(self, batch):
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            hashlib.sha256(self.block).digest()
        return batch


def test_an_op_on_every_core_binds_the_cpu(tmp_path):
    cores = cpu_budget()
    ld = gpuio.Loader(tree(tmp_path / "t", n=8 * cores), 2, ops=[Burn(0.04)], threads=cores, output="numpy")
    for _ in ld:
        pass
    v = ld.report()
    assert v.band == "highly input-bound" and v.bottleneck == "Burn" and v.resource == "cpu"
    assert "more threads cannot help" in v.advice
    n = v.numbers  # its cores saturated, or taken by other processes while it wanted them
    assert n["cpu_busy"] >= 0.85 or (n["core_demand"] >= 0.5 and n["waited_for_core_share"] >= 0.3)


def test_throttled_storage_binds_the_network(tmp_path, monkeypatch):
    """Every batch's GETs meet a 503 (a store throttling its clients) before they pass."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE", "0")
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache"))
    rows = np.arange(12 * 500, dtype=np.float32).reshape(12, 500)
    for i, row in enumerate(rows):
        np.save(tmp_path / f"{i:02d}.npy", row)
    remote.reset_client()
    with http_server(str(tmp_path)) as base:
        proxy = FaultProxy(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        try:
            ld = gpuio.Loader(formats.numpy([f"{proxy.url}/{i:02d}.npy" for i in range(12)]), 2,
                              output="numpy")
            got = []
            proxy.fail(2)
            for b in ld:
                got.append(b["data"])
                proxy.fail(2)  # the next GETs are refused once, and retried after a backoff
                time.sleep(0.005)
        finally:
            proxy.close()
    np.testing.assert_array_equal(np.concatenate(got), rows)
    v = ld.report()
    assert v.band == "highly input-bound"
    assert v.bottleneck == "read" and v.resource == "network"
    assert v.numbers["get_p50_ms"] >= 40  # the backoff of one retry
    assert "remote_requests" in v.advice
    remote.reset_client()


def test_a_tiny_buffer_budget_binds(tmp_path):
    """A budget of two batches' buffers leaves one batch in flight: the op's two workers
    take turns, idle half the time, and the consumer waits; the same loader with the
    default budget is bound by its op's workers instead."""
    index = tree(tmp_path / "t", n=48)

    def run():
        ld = gpuio.Loader(index, 4, ops=[Sleep(0.03)], threads=2, output="numpy")
        for _ in ld:
            pass
        return ld

    with gpuio.config.override(buffer_budget=2 * 65536):  # a batch's buffer takes 64 KiB
        tight = run()
    assert tight.stats()["window"] == 1
    v = tight.report()
    assert v.input_share > 0.2 and v.bottleneck == "Sleep" and v.resource == "buffer budget"
    assert "raise buffer_budget to about" in v.advice and "holds only 1 batch(es)" in v.why
    roomy = run().report()
    assert roomy.bottleneck == "Sleep" and roomy.resource == "workers" and roomy.numbers["window"] > 1


def test_no_verdict_before_batches(tmp_path):
    v = gpuio.Loader(tree(tmp_path / "t"), 4, output="numpy").report()
    assert v.band == "no verdict yet" and "iterate it first" in v.advice
