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


# ---- small objects in packs -----------------------------------------------------------


def _records(folder):
    """Every whole record of the packs in ``folder``: (tag, offset, length, CRC-32C, pack file)."""
    from crc32c import crc32c

    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".rec"):
            data = open(os.path.join(folder, name), "rb").read()
            for k in range(len(data) // 48):
                rec = data[k * 48: (k + 1) * 48]
                if rec[:4] == b"gpr1" and crc32c(rec[:44]) == int.from_bytes(rec[44:], "little"):
                    out.append((rec[4:24], int.from_bytes(rec[24:32], "little"), int.from_bytes(rec[32:40], "little"),
                                int.from_bytes(rec[40:44], "little"), os.path.join(folder, name[:-4] + ".pack")))
    return out


def _races(args):
    """A process of the node reading every object of the saved index once."""
    path, field = args
    index = SampleIndex.load(path)
    got = [bytes(a) for a in gpuio.read(index, np.arange(len(index)), field)]
    flush()
    return got


def test_small_objects_go_to_shared_packs_downloaded_once_per_node(tmp_path, monkeypatch):
    """Objects under remote_pack_below are appended to packs (a record each), not kept in
    a file each. Four processes reading the same objects at once download each one once
    (a counting proxy in front of the server); their records are whole, each tag once,
    each pointing at bytes whose CRC-32C it holds; then, the server gone, a process of its
    own reads every object from the packs the others wrote."""
    from crc32c import crc32c
    from remote_env import FaultProxy

    names = _npys(tmp_path / "data", np.random.default_rng(3), 30)
    local = formats.numpy([str(tmp_path / "data" / name) for name in names])
    want = [bytes(a) for a in gpuio.read(local, np.arange(len(local)))]
    with http_server(str(tmp_path / "data")) as base:
        formats.numpy([f"{base}/{name}" for name in names]).save(tmp_path / "index.npz")
        proxy = FaultProxy(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        try:
            moved = SampleIndex.load(tmp_path / "index.npz")
            moved.files = type(moved.files).from_paths([u.replace(base, proxy.url) for u in moved.files])
            moved.save(tmp_path / "proxied.npz")
            with multiprocessing.get_context("spawn").Pool(4) as pool:
                got = pool.map(_races, [(str(tmp_path / "proxied.npz"), "data")] * 4, chunksize=1)
            assert got == [want] * 4
            assert proxy.requests == len(names)
        finally:
            proxy.close()
    packs = os.path.join(cache_folder(), "packs")
    assert sorted(os.listdir(cache_folder())) == ["packs"]  # no file per object
    records = _records(packs)
    assert len({tag for tag, *_ in records}) == len(records) == len(names)
    for tag, offset, length, crc, pack in records:
        with open(pack, "rb") as f:
            f.seek(offset)
            assert crc32c(f.read(length)) == crc
    _in_another_process(tmp_path / "proxied.npz")  # the server is gone: every object from the packs


def _append_then_die(args):
    """Read the objects one by one through the cache (each appended to this process's
    pack), marking ``started`` once some are recorded; killed by the test meanwhile."""
    path, started = args
    index = SampleIndex.load(path)
    for k in range(len(index)):
        gpuio.read(index, [k])
        if k == 5:
            flush()
            open(started, "w").close()


def test_a_process_killed_while_appending_loses_nothing_recorded(tmp_path, monkeypatch):
    """A process killed in the middle of an epoch of appends (and, as if killed inside an
    append, its pack ending in a part of a record and bytes no record names): every whole
    record stays good and is read by the next process without a download (a counting
    proxy), the rest is downloaded again, and the epoch equals the local one."""
    import signal
    import time

    from remote_env import FaultProxy

    names = _npys(tmp_path / "data", np.random.default_rng(4), 60)
    local = formats.numpy([str(tmp_path / "data" / name) for name in names])
    want = _epoch(local)
    with http_server(str(tmp_path / "data")) as base:
        proxy = FaultProxy(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        try:
            formats.numpy([f"{proxy.url}/{name}" for name in names]).save(tmp_path / "index.npz")
            started = tmp_path / "started"
            child = multiprocessing.get_context("spawn").Process(target=_append_then_die,
                                                                 args=((str(tmp_path / "index.npz"), str(started)),))
            child.start()
            while not started.exists() and child.is_alive():
                time.sleep(0.01)
            os.kill(child.pid, signal.SIGKILL)
            child.join(30)
            packs = os.path.join(cache_folder(), "packs")
            recorded = _records(packs)
            assert recorded
            rec = [os.path.join(packs, n) for n in os.listdir(packs) if n.endswith(".rec")]
            with open(rec[0], "ab") as f:  # a record cut short, as a kill inside its write leaves it
                f.write(b"gpr1" + os.urandom(20))
            with open(rec[0][:-4] + ".pack", "ab") as f:  # bytes whose record was never written
                f.write(os.urandom(5000))
            before = -1
            while before != proxy.requests:  # the dead child's last requests counted by the proxy's threads
                before = proxy.requests
                time.sleep(0.3)
            assert _epoch(SampleIndex.load(tmp_path / "index.npz")) == want
            assert proxy.requests - before == len(names) - len(recorded)
        finally:
            proxy.close()


def test_packs_are_evicted_whole_and_never_while_appended_to(tmp_path, monkeypatch):
    """Past remote_cache_budget the least recently used packs go (a pack holds at most a
    sixteenth of the budget), never the one a live process appends to; what was evicted
    is downloaded again, equal."""
    from gpuio.storage.cache import BlockCache

    monkeypatch.setenv("GPUIO_REMOTE_CACHE_BUDGET", "40000")
    names = _npys(tmp_path / "data", np.random.default_rng(5), 12)
    local = formats.numpy([str(tmp_path / "data" / name) for name in names])
    want = [bytes(a) for a in gpuio.read(local, np.arange(len(local)))]
    with http_server(str(tmp_path / "data")) as base:
        index = formats.numpy([f"{base}/{name}" for name in names])
        with gpuio.Reader("cpu") as reader:
            for k in range(len(index)):
                assert bytes(reader.read(index, [k])[0]) == want[k]
        packs = os.path.join(cache_folder(), "packs")
        writing = max((os.path.join(packs, n) for n in os.listdir(packs) if n.endswith(".pack")), key=os.path.getmtime)
        assert BlockCache().evict() <= 40000
        left = [n for n in os.listdir(packs) if n.endswith(".pack")]
        assert 0 < len(left) < len(names) and os.path.exists(writing)
        assert sorted(n[:-5] for n in left) == sorted(n[:-4] for n in os.listdir(packs) if n.endswith(".rec"))
        with gpuio.Reader("cpu") as reader:
            assert [bytes(a) for a in reader.read(index, np.arange(len(index)))] == want


def test_packs_start_again_when_the_cache_folder_is_emptied_under_the_process(tmp_path):
    """The cache folder removed while a process holds its pack open (a user's rm -rf, a
    benchmark emptying it between passes): the next epoch downloads each object once into
    a new pack, and the epoch after reads the packs with no GET (a counting proxy)."""
    import shutil

    from remote_env import FaultProxy

    names = _npys(tmp_path / "data", np.random.default_rng(6), 20)
    local = formats.numpy([str(tmp_path / "data" / name) for name in names])
    want = [bytes(a) for a in gpuio.read(local, np.arange(len(local)))]
    with http_server(str(tmp_path / "data")) as base:
        proxy = FaultProxy(("127.0.0.1", int(base.rsplit(":", 1)[1])))
        try:
            index = formats.numpy([f"{proxy.url}/{name}" for name in names])
            for _ in range(2):
                shutil.rmtree(cache_folder(), ignore_errors=True)
                for epoch in range(2):
                    before = proxy.requests
                    with gpuio.Reader("cpu") as reader:
                        assert [bytes(a) for a in reader.read(index, np.arange(len(index)))] == want
                    assert proxy.requests - before == (len(names) if epoch == 0 else 0)
            assert len([n for n in os.listdir(os.path.join(cache_folder(), "packs")) if n.endswith(".pack")]) == 1
        finally:
            proxy.close()


def test_a_warm_epoch_of_packed_objects_names_no_block_file_and_looks_up_no_record(tmp_path, monkeypatch):
    """Small objects downloaded by this process (its pack's records kept in several runs,
    one per append merged as a binary counter merges). A warm epoch after it, with the
    index made again, makes no block file name for a packed object (its file is its pack)
    and looks up no record: an object this process met is read where its record was when
    it was met; the read-ahead of a batch whose objects are all met lists no blocks. Per
    batch of the warm epoch before: a name per object, a lookup of the batch's records in
    each run (then in one, once the runs were merged), and two block lists."""
    names = _npys(tmp_path / "data", np.random.default_rng(7), 40)
    local = formats.numpy([str(tmp_path / "data" / name) for name in names])
    want = _epoch(local)
    named, searched, listed = [], [], []
    make_names, find, blocks = cache_mod.Objects.names, cache_mod._Packs.find, cache_mod.Objects.blocks

    def counted_names(self, keys, root):
        named.append(len(keys))
        return make_names(self, keys, root)

    def counted_find(self, tags):
        searched.append(len(self._runs))
        return find(self, tags)

    def counted_blocks(self, file, start, end):
        listed.append(len(file))
        return blocks(self, file, start, end)

    monkeypatch.setattr(cache_mod.Objects, "names", counted_names)
    monkeypatch.setattr(cache_mod.Objects, "blocks", counted_blocks)
    monkeypatch.setattr(cache_mod._Packs, "find", counted_find)
    with http_server(str(tmp_path / "data")) as base:
        formats.numpy([f"{base}/{name}" for name in names]).save(tmp_path / "index.npz")
        assert _epoch(SampleIndex.load(tmp_path / "index.npz")) == want
    assert max(searched) > 1  # the downloads left several runs
    for epoch in range(2):  # the server is gone: read from the packs
        named.clear()
        searched.clear()
        listed.clear()
        assert _epoch(SampleIndex.load(tmp_path / "index.npz"), seed=epoch) == want
        assert sum(named) == 0, named
        assert searched == [], searched
        assert len(listed) == -(-len(names) // 4), listed  # the reads' lists, one per batch of 4


def test_a_download_into_an_empty_cache_reads_each_block_file_once(tmp_path, monkeypatch):
    """A first epoch into an empty cache: each block's file is looked for once (the batch's
    one pass, which finds none) and its download, which asks for the file's size first, reads
    none (before, each download read the file twice, each time into a zeroed buffer of the
    block's size: 3 reads per block). The bytes equal the local files'."""
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")
    monkeypatch.setenv("GPUIO_REMOTE_PACK_BELOW", "0")
    names = _npys(tmp_path / "data", np.random.default_rng(8), 6)
    local = formats.numpy([str(tmp_path / "data" / name) for name in names])
    reads = []
    read_checked = cache_mod._read_checked

    def counted(path, out, spare):
        reads.append(path)
        return read_checked(path, out, spare)

    monkeypatch.setattr(cache_mod, "_read_checked", counted)
    with http_server(str(tmp_path / "data")) as base:
        index = formats.numpy([f"{base}/{name}" for name in names])
        got = gpuio.read(index, np.arange(len(names)))
        flush()
    assert [a.tobytes() for a in got] == [a.tobytes() for a in gpuio.read(local, np.arange(len(names)))]
    blocks = [f for _, _, fs in os.walk(cache_folder()) for f in fs]
    assert len(reads) == len(set(reads)) == len(blocks) > len(names)
