"""The buffer budget: a setting applies exactly where it is in force, and a Loader runs
with the batches its budget holds or refuses, with the numbers, when it is made."""

from __future__ import annotations

import numpy as np
import pytest

import gpuio
from gpuio.storage.buffers import BufferPool
from gpuio.errors import BufferBudgetError
from gpuio.index import Extents, SampleIndex

SIZE = 100_000  # bytes per file
BATCH = 4
# what a batch of 4 costs the loader's pool: 4 files plus the merge gap per read
# (4 KiB each), rounded up as the pool rounds (to 1/8 of the next power of two)
BATCH_CHARGE = 458_752


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(11)
    blobs, paths = [], []
    for i in range(12):
        blob = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
        (tmp_path / f"{i:02d}.bin").write_bytes(blob)
        paths.append(str(tmp_path / f"{i:02d}.bin"))
        blobs.append(blob)
    n = len(paths)
    index = SampleIndex(paths, {"data": Extents(np.arange(n), np.zeros(n), np.full(n, SIZE))})
    return index, blobs


def test_read_budget_holds_inside_the_override_only(files):
    index, blobs = files
    with gpuio.config.override(buffer_budget=1000):  # before the process-wide pool exists
        with pytest.raises(BufferBudgetError, match=r"100,000 bytes was requested.*budget is 1,000 bytes"):
            gpuio.read(index, [0])
    assert gpuio.read(index, [0])[0].tobytes() == blobs[0]  # the override ended with its block
    with gpuio.config.override(buffer_budget=1000):  # and applies once the pool exists
        with pytest.raises(BufferBudgetError, match="budget is 1,000 bytes"):
            gpuio.read(index, [1])
    assert gpuio.read(index, [1])[0].tobytes() == blobs[1]


def test_a_pool_made_with_a_budget_keeps_it():
    pool = BufferPool(budget=1 << 20)
    with gpuio.config.override(buffer_budget=1000):
        assert pool.acquire(500_000).nbytes == 500_000
    with pytest.raises(BufferBudgetError, match="1,048,576"):
        pool.acquire(2 << 20)


def test_loader_whose_budget_holds_one_batch_is_refused_when_made(files):
    index, _ = files
    with gpuio.config.override(buffer_budget=BATCH_CHARGE + 1000):
        with pytest.raises(BufferBudgetError) as err:
            gpuio.Loader(index, BATCH, output="numpy")
    message = str(err.value)
    assert f"needs up to {BATCH_CHARGE:,} bytes" in message
    assert f"buffer_budget is {BATCH_CHARGE + 1000:,}" in message
    assert f"at least {2 * BATCH_CHARGE:,}" in message


@pytest.mark.parametrize("batches", [2, 3])
def test_loader_runs_with_the_batches_that_fit(files, batches):
    index, blobs = files
    with gpuio.config.override(buffer_budget=batches * BATCH_CHARGE):
        loader = gpuio.Loader(index, BATCH, output="numpy", prefetch=4, threads=2)
    windows, rows = set(), []
    for batch in loader:  # made under the override, run outside it: the budget stays the loader's
        windows.add(loader.stats()["window"])
        rows += [(int(i), d.tobytes()) for i, d in zip(batch["index"], batch["data"])]
    assert windows == {batches - 1}  # the batch the consumer holds plus those in flight fit
    assert rows == list(enumerate(blobs))


def test_loader_with_room_keeps_its_prefetch(files):
    index, _ = files
    loader = gpuio.Loader(index, BATCH, output="numpy", prefetch=4, threads=2)
    it = iter(loader)
    next(it)
    assert loader.stats()["window"] == 4 + 1  # prefetch plus the one read worker
    loader.close()


def test_loader_ignores_overrides_made_after_it(files):
    index, blobs = files
    loader = gpuio.Loader(index, BATCH, output="numpy")
    with gpuio.config.override(buffer_budget=1000):
        got = [d.tobytes() for batch in loader for d in batch["data"]]
    assert got == blobs
