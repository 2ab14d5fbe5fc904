"""GPU memory shared across CUDA streams is not reused while a stream may still read it
(``gpuio.storage._deferred``, the buffer pool's release events, the loader's hand-over).

Each test queues slow work on the consumer's stream (``torch.cuda._sleep``) that reads
memory gpuio produced, lets gpuio produce more (which would overwrite freed memory),
and checks the contents once the slow work is done. Without deferred frees these
fail by data corruption, not by an error.
"""

from __future__ import annotations

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.formats import filetree
from gpuio.formats import numpy as npy_format
from gpuio.sample import make_image_tree

pytestmark = pytest.mark.gpu

SLOW = 200_000_000  # GPU clock cycles, about 0.1 s


def _image_loader(root, **kw):
    pipeline = [ops.decode_image(), ops.random_resized_crop(64), ops.flip(), ops.normalize(128.0, 64.0)]
    return gpuio.Loader(filetree(root), 16, ops=pipeline, device="cuda", shuffle=True, seed=5, **kw)


def _npy_loader(root, **kw):
    return gpuio.Loader(npy_format(root), 8, fields=["data"], device="cuda", shuffle=True, seed=5, **kw)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    base = tmp_path_factory.mktemp("streams")
    images = make_image_tree(base / "jpg", count=96, classes=3, seed=2, progress=False)
    rng = np.random.default_rng(4)
    (base / "npy").mkdir()
    for i in range(64):
        np.save(base / "npy" / f"{i:03d}.npy", rng.standard_normal((32, 48)).astype(np.float32))
    return {"images": (_image_loader, images), "npy": (_npy_loader, str(base / "npy"))}


def _expected(make, root):
    """Each batch's contents, copied and synchronized at once (no reuse is possible)."""
    import torch

    out = []
    for b in make(root, prefetch=1):
        out.append({k: v.clone() for k, v in b.items() if isinstance(v, torch.Tensor)})
        torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("name", ["images", "npy"])
def test_batch_kept_or_dropped_while_consumer_stream_reads_it(datasets, name):
    """(a) fused-kernel outputs, (b) decoded images between stages and (c) device read
    buffers: batch k is read by slow work on torch's stream while batches k+1... are made."""
    import torch

    make, root = datasets[name]
    expected = _expected(make, root)
    stream = torch.cuda.Stream()  # the consumer works on a stream of its own
    with torch.cuda.stream(stream):
        kept, copies = {}, {}
        for k, batch in enumerate(make(root, prefetch=3)):
            tensors = {f: v for f, v in batch.items() if isinstance(v, torch.Tensor)}
            torch.cuda._sleep(SLOW)  # the reads below wait behind this
            copies[k] = {f: v.clone() for f, v in tensors.items()}
            if k % 2 == 0:
                kept[k] = tensors  # kept alive while later batches are made
            del batch, tensors  # odd k: dropped while the copy is still queued
        torch.cuda.synchronize()
    assert len(copies) == len(expected)
    for k, want in enumerate(expected):
        for f, v in want.items():
            assert torch.equal(copies[k][f], v), f"batch {k} field {f}: overwritten while queued reads were pending"
            if k in kept:
                assert torch.equal(kept[k][f], v), f"batch {k} field {f}: a kept batch changed"


def test_hand_over_releases_after_the_consumer_stream():
    import cupy as cp
    import torch

    from gpuio.storage import _deferred

    source = cp.arange(1 << 20, dtype=cp.float32)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        given = torch.from_dlpack(_deferred.hand_over(source, stream.cuda_stream, 0))
        torch.cuda._sleep(SLOW)
        total = given.sum()
    del given, source  # the consumer drops it with its read still queued
    assert _deferred.reap() >= 1  # kept: the stream has not passed the read
    torch.cuda.synchronize()
    assert _deferred.reap() == 0
    assert total.item() == float(np.arange(1 << 20, dtype=np.float64).sum())


def test_pool_does_not_lend_a_buffer_a_stream_still_reads():
    import cupy as cp

    from gpuio.storage.buffers import BufferPool

    pool = BufferPool(1 << 26)
    lease = pool.acquire(1 << 20, "cuda")
    storage = lease._storage
    stream = cp.cuda.Stream(non_blocking=True)
    with cp.cuda.Device(0), stream:
        arr = lease.array
        _spin()
        arr.fill(7)  # queued behind the spin
        total = arr.sum(dtype=cp.int64)
        del arr, lease  # the buffer goes back with this stream's work still queued
    busy = pool.acquire(1 << 20, "cuda")
    assert busy._storage is not storage, "a buffer a stream still writes was lent again"
    stream.synchronize()
    assert int(total) == 7 << 20
    held = pool.held_bytes
    del busy
    pool.acquire(1 << 20, "cuda")  # both buffers are idle now: one is reused
    assert pool.held_bytes == held


def _spin():
    """Slow work on the current CuPy stream."""
    import cupy as cp

    kernel = cp.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }''', "spin")
    kernel((1,), (1,), (np.int64(SLOW),))


def test_two_kvikio_readers_share_one_registration(tmp_path):
    """GDS registration belongs to the pool's buffer: readers sharing a pool register it
    once, and closing one reader leaves it registered for the other."""
    from gpuio.storage.buffers import BufferPool
    from gpuio.index import Extents, SampleIndex
    from gpuio.storage import Reader

    pytest.importorskip("kvikio")
    path = tmp_path / "data.bin"
    blob = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    path.write_bytes(blob.tobytes())
    index = SampleIndex([str(path)], {"data": Extents(np.zeros(4, np.int64), np.arange(4) * 4096,
                                                      np.full(4, 4096))})
    pool = BufferPool(1 << 26)
    first = Reader("cuda", backend="kvikio", pool=pool)
    second = Reader("cuda", backend="kvikio", pool=pool)
    for reader in (first, second, first):
        got = reader.read(index, [0, 1, 2, 3])
        np.testing.assert_array_equal(np.concatenate([g.get() for g in got]), blob[: 4 * 4096])
        del got
    first.close()
    got = second.read(index, [3])
    np.testing.assert_array_equal(got[0].get(), blob[3 * 4096: 4 * 4096])
    del got
    second.close()
    pool.clear()  # deregisters what was registered, once
