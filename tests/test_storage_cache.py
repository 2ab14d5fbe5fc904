"""The node-local cache tier in front of object storage: what a warm epoch costs, and
how a process meets blocks another process cached. The store is a plain HTTP server
with range requests on loopback (the cache sees every store alike); the bytes are
compared with the same files read from local disk."""

from __future__ import annotations

import multiprocessing
import os
import tarfile
import threading

import numpy as np
import pytest

import gpuio
from gpuio import formats
from gpuio.index import SampleIndex
from gpuio.storage import cache as cache_mod
from gpuio.storage import remote
from gpuio.storage.cache import cache_folder, flush

from remote_env import http_server


@pytest.fixture(autouse=True)
def _settings(tmp_path, monkeypatch):
    """A fresh cache folder per test, few short tries; a new client (the server is new)."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "remote-cache"))
    monkeypatch.setenv("GPUIO_REMOTE_RETRIES", "2")
    monkeypatch.setenv("GPUIO_REMOTE_TIMEOUT", "5")
    remote.reset_client()
    yield
    remote.reset_client()


def _npys(folder, rng, n):
    """``n`` .npy files of 2,000-9,000 random bytes each: their names."""
    folder.mkdir()
    names = [f"a{k:03d}.npy" for k in range(n)]
    for name in names:
        np.save(folder / name, rng.integers(0, 256, int(rng.integers(2000, 9000)), dtype=np.uint8))
    return names


def _shards(folder, rng, shards, per):
    """WebDataset tar shards of ``per`` samples (a ``bin`` member of 1-3,000 bytes each): their names."""
    folder.mkdir()
    names = []
    for s in range(shards):
        names.append(f"shard-{s}.tar")
        with tarfile.open(folder / names[-1], "w") as tar:
            for k in range(per):
                member = folder / "member"
                member.write_bytes(rng.integers(0, 256, int(rng.integers(1, 3000)), dtype=np.uint8).tobytes())
                tar.add(member, arcname=f"s{s}_{k:03d}.bin")
    (folder / "member").unlink()
    return names


def _epoch(index, field="data", seed=0):
    """One shuffled Loader epoch in batches of 4: ``{sample: bytes}``."""
    loader = gpuio.Loader(index, 4, shuffle=True, seed=seed, output="numpy", fields=[field])
    try:
        return {int(i): bytes(v) for batch in loader for i, v in zip(batch["index"], batch[field])}
    finally:
        loader.close()


def _epoch_in_a_process(args):
    """Another process of the node: one epoch of the saved index, its blocks written to the cache."""
    path, field = args
    _epoch(SampleIndex.load(path), field)
    flush()


def _in_another_process(path, field="data"):
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_epoch_in_a_process, args=((str(path), field),))
    child.start()
    child.join(120)
    assert child.exitcode == 0


def _thread_starts(monkeypatch):
    """The names of the threads started from now on, in order."""
    names = []
    start = threading.Thread.start

    def counted(self):
        names.append(self.name)
        return start(self)

    monkeypatch.setattr(threading.Thread, "start", counted)
    return names


def test_warm_epochs_start_no_thread_per_block(tmp_path, monkeypatch):
    """Every block cached by another process. This process's first epoch meets each block
    once (read whole, its size and CRC-32C checked, in one pass per batch); later epochs,
    with the index made again, read the block files as local files. No epoch starts a
    thread per block (here: 48 objects in 12 batches, most of them several blocks of
    4 KiB): each starts at most the threads an epoch of the same files on local disk
    starts, plus the cache's writer threads (which touch met blocks for the LRU order).
    The server is gone: no GET either."""
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")
    names = _npys(tmp_path / "data", np.random.default_rng(1), 48)
    local = formats.numpy([str(tmp_path / "data" / name) for name in names])
    with http_server(str(tmp_path / "data")) as base:
        formats.numpy([f"{base}/{name}" for name in names]).save(tmp_path / "index.npz")
        _in_another_process(tmp_path / "index.npz")
    started = _thread_starts(monkeypatch)
    want = _epoch(local)
    on_local_disk = len(started)
    for epoch in range(3):
        before = len(started)
        assert _epoch(SampleIndex.load(tmp_path / "index.npz"), seed=epoch) == want
        new = started[before:]
        assert len(new) <= on_local_disk + cache_mod._WRITERS, new
        assert not [name for name in new if name.startswith(("gpuio-cache-ahead", "gpuio-remote"))], new


def test_blocks_met_first_are_checked_and_bad_ones_downloaded_again(tmp_path, monkeypatch):
    """Shards cached by another process, in blocks of 4 KiB that hold pieces of several
    samples: this process meets them first in its epoch's one pass, which reads each block
    whole; a block cut short, one with a byte flipped, one grown by a byte and one removed are
    downloaded again, and the epoch equals the local one."""
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")
    names = _shards(tmp_path / "data", np.random.default_rng(2), shards=3, per=12)
    local = formats.webdataset([str(tmp_path / "data" / name) for name in names], fields=("bin",))
    want = _epoch(local, "bin")
    with http_server(str(tmp_path / "data")) as base:
        formats.webdataset([f"{base}/{name}" for name in names], fields=("bin",)).save(tmp_path / "index.npz")
        _in_another_process(tmp_path / "index.npz", "bin")
        blocks = sorted(os.path.join(d, f) for d, _, fs in os.walk(cache_folder()) for f in fs)
        whole = {path: open(path, "rb").read() for path in blocks}
        assert len(blocks) > 8 and not [b for b in blocks if b.endswith(".part")]
        for k, path in enumerate(blocks[:8]):
            if k % 4 == 0:
                os.truncate(path, os.path.getsize(path) - 1)
            elif k % 4 == 1:
                with open(path, "r+b") as f:
                    f.write(bytes([whole[path][0] ^ 0xFF]))
            elif k % 4 == 2:
                with open(path, "ab") as f:
                    f.write(b"\0")
            else:
                os.unlink(path)
        assert _epoch(SampleIndex.load(tmp_path / "index.npz"), "bin") == want
        flush()
    assert {path: open(path, "rb").read() for path in blocks} == whole  # each one as its first download wrote it
