"""Loader.stats(): the always-on measurements of every stage, the consumer, the remote
fetches and the bytes in flight, read while a pass runs; the CPU budget they are judged by."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import gpuio
from gpuio import formats
from gpuio.pipeline._stats import Histogram, cpu_budget
from gpuio.storage import remote

from remote_env import http_server

N = 24
BATCH = 4


class Sleep:
    """An op that takes ``seconds`` per batch, doing nothing else."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, batch):
        time.sleep(self.seconds)
        return batch


class AddOne:
    """``data + 1`` row by row, on the batch's device (a GPU stage on a GPU)."""

    def __call__(self, batch):
        batch.data["data"] = [row + 1 for row in batch.data["data"]]
        return batch


def tree(root, n=N, size=3000):
    rng = np.random.default_rng(0)
    (root / "c").mkdir(parents=True)
    for i in range(n):
        (root / "c" / f"{i:03d}.jpg").write_bytes(rng.bytes(size))
    return formats.filetree(str(root))


def npy(root, n=N):
    root.mkdir()
    for i in range(n):
        np.save(root / f"{i:03d}.npy", np.full((64, 64), i, dtype=np.float32))
    return formats.numpy(str(root))


def test_histogram_quantiles_within_a_bucket():
    h = Histogram()
    for ms in range(1, 101):  # 1..100 ms
        h.add(ms / 1e3)
    assert h.n == 100
    for q, want in ((0.5, 0.050), (0.99, 0.099)):
        got = h.quantile(q)
        assert want <= got <= want * 2 ** 0.25, (q, got)  # the bucket's upper edge
    assert Histogram().quantile(0.5) == 0.0
    h.add(1e9)  # beyond the last bucket: kept in it, no growth
    assert len(h.counts) == len(Histogram().counts)


def test_stage_and_consumer_figures(tmp_path):
    """A 20 ms op on one worker and a consumer that works 10 ms per batch: the op's
    latency, busy share and batches, the consumer's wait and work, no bytes left in
    flight after the pass."""
    index = tree(tmp_path / "t")
    ld = gpuio.Loader(index, BATCH, ops=[Sleep(0.02)], threads=1, output="numpy")
    for _ in ld:
        time.sleep(0.01)
    s = ld.stats()
    op = s["stages"]["Sleep"]
    assert op["batches"] == len(ld) == N // BATCH and op["workers"] == 1
    assert 20 <= op["p50_ms"] <= 30 and op["p99_ms"] >= op["p50_ms"]
    assert 0.5 < op["busy"] <= 1.0  # the op binds: its one worker is busy most of the pass
    read = s["stages"]["read"]
    assert read["batches"] == len(ld) and read["busy"] < op["busy"]
    c = s["consumer"]
    assert c["batches"] == len(ld)
    assert 10 <= c["work_p50_ms"] <= 20
    assert c["wait_s"] > 0 and 0 < c["input_share"] < 1
    assert c["input_share"] == pytest.approx(c["wait_s"] / (c["wait_s"] + c["work_s"]), abs=1e-3)
    assert 0 < c["hand_off_s"] < c["wait_s"] + c["start_up_s"] and c["hand_off_p99_ms"] >= c["hand_off_p50_ms"]
    assert s["consumer_wait_s"] == pytest.approx(c["wait_s"] + c["start_up_s"], abs=2e-6)
    assert sum(s["bytes_in_flight"].values()) == 0
    assert 0 < s["peak_bytes_in_flight"] <= (s["window"] + 1) * BATCH * 3000
    assert 0 < s["buffers"]["held"] <= s["buffers"]["budget"]
    assert s["cpu"]["cores"] >= 1 and s["cpu"]["seconds"] > 0
    assert s["remote"]["requests"] == 0


def test_stats_read_from_another_thread_while_the_pass_runs(tmp_path):
    index = tree(tmp_path / "t", n=64)
    ld = gpuio.Loader(index, 2, ops=[Sleep(0.002)], threads=2, output="numpy")
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(ld.stats())

    t = threading.Thread(target=watch)
    t.start()
    try:
        rows = sum(len(b["index"]) for b in ld)
    finally:
        stop.set()
        t.join()
    assert rows == 64 and len(seen) > 3
    done = [x["stages"].get("Sleep", {}).get("batches", 0) for x in seen]
    assert done == sorted(done)  # counts only grow
    assert max(x["peak_bytes_in_flight"] for x in seen) > 0
    assert any(sum(x["bytes_in_flight"].values()) > 0 for x in seen)  # seen mid-pass


def test_remote_fetches_are_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUIO_REMOTE_CACHE", "0")
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache"))
    rows = np.arange(8 * 750, dtype=np.float32).reshape(8, 750)  # 3000 bytes a row
    for i, row in enumerate(rows):
        np.save(tmp_path / f"{i}.npy", row)
    remote.reset_client()
    with http_server(str(tmp_path)) as base:
        ld = gpuio.Loader(formats.numpy([f"{base}/{i}.npy" for i in range(8)]), 4, output="numpy")
        got = np.concatenate([b["data"] for b in ld])
    np.testing.assert_array_equal(got, rows)
    r = ld.stats()["remote"]
    assert r["requests"] >= 2 and r["bytes"] == rows.nbytes
    assert r["p99_ms"] >= r["p50_ms"] > 0 and r["bytes_per_s"] > 0
    remote.reset_client()


def test_device_stage_timed_by_events(tmp_path, device):
    """The same body on the CPU and on a GPU: on a GPU each op stage also has its device
    time (CUDA events around its work on its stream, read once passed), and the batches
    equal the CPU's."""
    index = npy(tmp_path / "n")
    ld = gpuio.Loader(index, BATCH, ops=[AddOne()], device=device, output="numpy")
    for k, b in enumerate(ld):
        data = b["data"]
        data = data.get() if hasattr(data, "get") else data
        np.testing.assert_array_equal(data[:, 0, 0], np.arange(k * BATCH, (k + 1) * BATCH) + 1)
    stage = ld.stats()["stages"]["AddOne"]
    assert stage["batches"] == len(ld)
    if device == "cpu":
        assert "gpu_seconds" not in stage
    else:
        deadline = time.monotonic() + 5  # the last events are read once they have passed
        while ld.stats()["stages"]["AddOne"]["gpu_batches"] < len(ld) and time.monotonic() < deadline:
            time.sleep(0.01)
        stage = ld.stats()["stages"]["AddOne"]
        assert stage["gpu_batches"] == len(ld) and stage["gpu_seconds"] > 0
        assert 0 < stage["gpu_p50_ms"] <= stage["gpu_p99_ms"]


def test_cpu_budget_follows_affinity_and_local_world_size(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert 1 <= cpu_budget() <= cores
    alone = cpu_budget()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu_budget() == max(1, alone // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(4 * cores))
    assert cpu_budget() == 1


def test_threads_auto_takes_the_cpu_budget_and_says_why(tmp_path, monkeypatch):
    index = tree(tmp_path / "t")
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ld = gpuio.Loader(index, 4, ops=[Sleep(0.0)], output="numpy")  # the default is "auto"
    why = ld.stats()["threads"]
    assert why["auto"] and why["affinity"] == affinity and why["local_world_size"] == 2
    assert ld.threads == why["threads"] == why["cores"] == cpu_budget() <= max(1, affinity // 2)
    list(ld)
    assert ld.stats()["stages"]["Sleep"]["workers"] == ld.threads
    assert gpuio.Loader(index, 4, threads=3).stats()["threads"] == {"threads": 3, "auto": False}
    with pytest.raises(gpuio.errors.ConfigError, match="threads must be a positive integer or 'auto'"):
        gpuio.Loader(index, 4, threads="many")
