"""gpuio in forked children, after the parent used it: torch DataLoader workers, plain
``os.fork`` and ``multiprocessing``. Each child runs under a timeout, so that a hang
(a child waiting on the parent's reader threads or on a lock held at the fork) fails
the test instead of stalling the suite."""

from __future__ import annotations

import multiprocessing
import os
import threading

import numpy as np
import pytest

import gpuio
from gpuio.storage import reader as storage
from gpuio.storage import _posix
from gpuio.storage.buffers import default_pool
from gpuio.index import Extents, SampleIndex

from test_storage import read_loop  # noqa: F401  (autouse: every test runs with both read loops)

CHILD_TIMEOUT_S = 60
FILES, SIZE = 16, 256 << 10  # big enough for several reader threads on two cores


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(5)
    blobs = [rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes() for _ in range(FILES)]
    paths = []
    for i, blob in enumerate(blobs):
        path = tmp_path / f"f{i:02d}.bin"
        path.write_bytes(blob)
        paths.append(str(path))
    index = SampleIndex(paths, {"data": Extents(np.arange(FILES), np.zeros(FILES), np.full(FILES, SIZE))},
                        {"label": np.arange(FILES, dtype=np.int64)})
    return index, blobs


def use_gpuio_in_parent(index, blobs):
    """Read as a training script would before its workers fork: gpuio.read and a Loader."""
    got = gpuio.read(index, range(FILES))
    assert [a.tobytes() for a in got] == blobs
    assert (_posix._readloop.helpers() > 0) if gpuio.config.get("native") else any(
        t.name.startswith("gpuio-read") for t in threading.enumerate()), \
        "the parent's reader threads should be running when it forks"
    loader = gpuio.Loader(index, 4, output="numpy")
    assert sum(len(b["index"]) for b in loader) == FILES
    loader.close()


def child_reads(index, rows):
    """What a worker does: gpuio.read and a Loader pass, in the child."""
    single = [a.tobytes() for a in gpuio.read(index, rows)]
    loader = gpuio.Loader(index, 4, output="numpy")
    labels = np.concatenate([b["label"] for b in loader]).tolist()
    loader.close()
    return single, labels


def run_in_fork_child(target, *args):
    """Run ``target(*args)`` in a forked child; its result comes back through a pipe."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def main():
        try:
            send.send(("ok", target(*args)))
        except BaseException as exc:  # reported to the parent
            send.send(("error", f"{type(exc).__name__}: {exc}"))

    proc = ctx.Process(target=main, daemon=True)
    proc.start()
    send.close()
    ready = recv.poll(CHILD_TIMEOUT_S)
    if not ready:
        proc.kill()
        proc.join()
        pytest.fail(f"the forked child hung for {CHILD_TIMEOUT_S} s")
    status, value = recv.recv()
    proc.join(CHILD_TIMEOUT_S)
    assert status == "ok", value
    return value


def test_torch_dataloader_workers_read_after_parent_did(files):
    import torch

    index, blobs = files
    use_gpuio_in_parent(index, blobs)

    class Groups(torch.utils.data.Dataset):  # item i: files 4i..4i+3, read in one batch
        def __len__(self):
            return FILES // 4

        def __getitem__(self, i):
            return torch.stack([torch.from_numpy(a.copy()) for a in gpuio.read(index, range(4 * i, 4 * i + 4))])

    loader = torch.utils.data.DataLoader(Groups(), batch_size=None, num_workers=2,
                                         multiprocessing_context="fork", timeout=CHILD_TIMEOUT_S)
    rows = [bytes(t.numpy()) for item in loader for t in item]  # raises on a hung worker
    assert rows == blobs


def test_multiprocessing_fork_child_reads_and_loads(files):
    index, blobs = files
    use_gpuio_in_parent(index, blobs)
    rows = [3, 0, 15, 7]
    single, labels = run_in_fork_child(child_reads, index, rows)
    assert single == [blobs[r] for r in rows]
    assert labels == list(range(FILES))


def test_plain_os_fork_child_reads(files):
    index, blobs = files
    use_gpuio_in_parent(index, blobs)
    recv, send = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, then leave without pytest's cleanup
        status = 1
        try:
            os.close(recv)
            single, labels = child_reads(index, [1, 2])
            status = 0 if single == blobs[1:3] and labels == list(range(FILES)) else 2
        finally:
            os.write(send, bytes([status]))
            os._exit(0)
    os.close(send)
    try:
        ready = _wait_readable(recv, CHILD_TIMEOUT_S)
        if not ready:
            os.kill(pid, 9)
        assert ready, f"the forked child hung for {CHILD_TIMEOUT_S} s"
        assert os.read(recv, 1) == b"\0", "the child read wrong bytes or raised"
    finally:
        os.close(recv)
        os.waitpid(pid, 0)


def _wait_readable(fd: int, timeout: float) -> bool:
    import select

    return bool(select.select([fd], [], [], timeout)[0])


def test_locks_held_by_parent_threads_at_fork_are_free_in_the_child(files):
    """A parent's thread inside the pool or the reader cache when the process forks
    does not exist in the child; the locks it held must not stay locked there."""
    index, blobs = files
    use_gpuio_in_parent(index, blobs)
    holding, release = threading.Event(), threading.Event()

    def hold():
        with default_pool()._lock, storage._readers_lock:
            holding.set()
            release.wait()

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait()
    try:
        single, _ = run_in_fork_child(child_reads, index, [4])
    finally:
        release.set()
        holder.join()
    assert single == [blobs[4]]


def child_iterates(loader):
    return [int(label) for batch in loader for label in batch["label"]]


def test_loader_running_in_the_parent_iterates_in_the_child(files):
    """A pass left running at the fork (its stage threads alive in the parent) is
    restarted by the child's ``for``, which reads with threads of its own."""
    index, _ = files
    loader = gpuio.Loader(index, 4, output="numpy", prefetch=2)
    running = iter(loader)
    next(running)
    try:
        assert run_in_fork_child(child_iterates, loader) == list(range(FILES))
        assert [int(x) for x in next(running)["label"]] == [4, 5, 6, 7]  # the parent's pass goes on
    finally:
        loader.close()


def child_reopens(cache, parent_handle, path):
    handle = cache.acquire(path)
    cache.release(path, handle)
    return handle is not parent_handle, parent_handle.closed, handle.read(4)


def test_cached_file_handles_are_reopened_in_the_child(files):
    """The parent's handles are neither used nor closed in the child (a cuFile handle
    must not be deregistered there); the child opens its own on demand."""
    from gpuio.storage._handles import HandleCache

    index, blobs = files
    path = index.extent(2).file
    cache = HandleCache(lambda p: open(p, "rb"), lambda f: f.close(), capacity=4)
    parent_handle = cache.acquire(path)
    cache.release(path, parent_handle)
    try:
        assert run_in_fork_child(child_reopens, cache, parent_handle, path) == (True, False, blobs[2][:4])
    finally:
        cache.close()


def child_overwrites(arrays):
    """Write into inherited batch arrays, then read anew: the parent must see none of it."""
    pool = default_pool()
    held_at_start = pool.held_bytes
    for a in arrays:
        a[:] = 0
    del arrays[:]  # inherited leases end here: the parent's buffers, not the child's
    return held_at_start, pool.held_bytes


def test_child_writes_stay_out_of_parent_buffers(files):
    index, blobs = files
    kept = gpuio.read(index, [0, 1])
    gpuio.read(index, [2, 3])  # its buffer goes back to the pool's cache
    held_at_start, held_after = run_in_fork_child(child_overwrites, kept)
    assert (held_at_start, held_after) == (0, 0)  # the child's pool starts empty
    assert [a.tobytes() for a in kept] == blobs[:2]
    again = gpuio.read(index, [2, 3])
    assert [a.tobytes() for a in again] == blobs[2:4]


@pytest.mark.gpu
def test_child_of_a_cuda_parent_reads_on_cpu_and_refuses_cuda(files):
    index, blobs = files
    assert gpuio.read(index, [0], device="cuda")[0].nbytes == SIZE  # CUDA in use in the parent

    def child():
        host = gpuio.read(index, [5])[0].tobytes()  # pinned buffers would need CUDA: plain ones
        messages = []
        for attempt in (lambda: gpuio.read(index, [5], device="cuda"),  # the parent's cached reader
                        lambda: gpuio.Loader(index, 4, device="cuda")):  # refused when made
            try:
                attempt()
            except gpuio.errors.DeviceError as exc:
                messages.append(str(exc))
        return host, messages

    host, messages = run_in_fork_child(child)
    assert host == blobs[5]
    assert len(messages) == 2 and all("'spawn' method" in m for m in messages)
