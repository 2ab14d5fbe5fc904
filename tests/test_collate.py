"""``gpuio.pipeline._collate.stack``: rows become one ``[B, ...]`` view only when one
allocation holds them all; rows that merely lie back to back in separate allocations (a
pool handing out blocks of one size in order, as CuPy's does on one stream) are copied,
since a view keeps only row 0's allocation alive and the freed rows are handed out again."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from gpuio.pipeline._collate import stack

SHAPE = (48, 64, 3)


class _Slot:
    """One block of an ``Arena``: it exports the block's memory; when no array views it
    any more, the block is free for the next request."""

    def __init__(self, arena: Arena, k: int) -> None:
        start = arena.memory.__array_interface__["data"][0] + k * arena.size
        self.__array_interface__ = {"data": (start, False), "shape": (arena.size,), "typestr": "|u1", "version": 3}
        weakref.finalize(self, arena.free.append, k)


class Arena:
    """Host memory in blocks of one size, handed out lowest free block first: blocks
    asked for one after another lie back to back, and a freed block is reused."""

    def __init__(self, size: int, count: int) -> None:
        self.size, self.memory, self.free = size, np.zeros(size * count, np.uint8), list(range(count))

    def full(self, shape: tuple[int, ...], value: int) -> np.ndarray:
        self.free.sort()
        out = np.asarray(_Slot(self, self.free.pop(0)))[: int(np.prod(shape))].reshape(shape)
        out[...] = value
        return out


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_rows_next_to_each_other_in_separate_allocations_are_copied():
    arena = Arena(int(np.prod(SHAPE)), 8)
    rows = [arena.full(SHAPE, k) for k in range(4)]
    assert [_address(r) - _address(rows[0]) for r in rows] == [k * rows[0].nbytes for k in range(4)]
    assert len({id(r.base) for r in rows}) == 4  # each its own owner
    freed = {_address(r) for r in rows[1:]}
    batch = stack(rows, np)
    del rows
    gc.collect()
    later = [arena.full(SHAPE, 200 + k) for k in range(4)]  # the next batch takes the freed blocks
    assert freed <= {_address(r) for r in later}
    assert np.array_equal(batch, np.stack([np.full(SHAPE, k, np.uint8) for k in range(4)]))


def test_rows_of_one_allocation_are_one_view():
    whole = np.arange(4 * int(np.prod(SHAPE)), dtype=np.uint32).reshape(4, *SHAPE)
    rows = list(whole)
    batch = stack(rows, np)
    assert batch.shape == whole.shape and np.shares_memory(batch, whole) and np.array_equal(batch, whole)
    for order in ([1, 0, 2, 3], [0, 1, 3]):  # out of row order, or a gap: a copy
        picked = stack([rows[k] for k in order], np)
        assert not np.shares_memory(picked, whole) and np.array_equal(picked, whole[order])


@pytest.mark.gpu
def test_device_rows_from_the_pool_are_copied_and_one_array_is_viewed():
    """CuPy's pool rounds to 512 bytes and splits free chunks head first: rows of one
    size allocated one at a time on one stream come out back to back. 224x224x3 uint8
    (150,528 bytes) is a multiple of 512."""
    import cupy as cp

    shape = (224, 224, 3)
    nbytes = 224 * 224 * 3
    with cp.cuda.Device(0), cp.cuda.Stream(non_blocking=True) as stream:
        freed = cp.empty(16 * nbytes, cp.uint8)  # a chunk a batch leaves behind: the rows split it
        del freed
        rows = [cp.full(shape, k, cp.uint8) for k in range(4)]
        assert [r.data.ptr - rows[0].data.ptr for r in rows] == [k * nbytes for k in range(4)]
        batch = stack(rows, cp)
        assert batch.data.mem is not rows[0].data.mem  # a copy: row 0's block alone would not hold the rest
        del rows
        later = [cp.full(shape, 200 + k, cp.uint8) for k in range(8)]  # the freed blocks are handed out again
        got = cp.asnumpy(batch, stream=stream)
        assert np.array_equal(got, np.stack([np.full(shape, k, np.uint8) for k in range(4)])), later[0].data.ptr
        whole = cp.arange(4 * 224 * 224 * 3, dtype=cp.uint8).reshape(4, *shape)
        viewed = stack(list(whole), cp)
        assert viewed.data.mem is whole.data.mem and viewed.data.ptr == whole.data.ptr
