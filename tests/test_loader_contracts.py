"""The loader's contracts, through the shared checkers in tests/checkers.py:
exactly-once sharding, resume at every position, determinism across thread counts."""

from __future__ import annotations

import numpy as np
import pytest

import gpuio
from gpuio.pipeline.order import EpochPlan, epoch_order
from gpuio.batch import Op
from gpuio.formats import filetree, numpy as npy_format

from checkers import check_deterministic, check_exactly_once, check_resume

N = 37  # prime: no batch size or world size divides it


class AsFloat(Op):
    """Raw ``.npy`` bytes -> float32 arrays of their recorded shape."""

    def __call__(self, batch):
        batch.data["data"] = [d.view(np.float32).reshape(tuple(s))
                              for d, s in zip(batch.data["data"], batch.data["shape"])]
        return batch


class Noise(Op):
    """Adds noise drawn from ``batch.rng``: the draws must follow the sample, not the thread."""

    salt = 11

    def __call__(self, batch):
        batch.data["data"] = [x + batch.rng(r, self.salt).normal(size=x.shape).astype(np.float32)
                              for r, x in enumerate(batch.data["data"])]
        return batch


@pytest.fixture(scope="module")
def npy_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("npy")
    rng = np.random.default_rng(1)
    for i in range(N):
        np.save(root / f"{i:03d}.npy", rng.random((2, 3), dtype=np.float32) + i)
    return npy_format(str(root))


@pytest.fixture(scope="module")
def tree_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    rng = np.random.default_rng(2)
    for i in range(N):
        d = root / f"class{i % 3}"
        d.mkdir(exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(rng.bytes(int(rng.integers(1, 3000))))
    return filetree(str(root))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 16, 17, 37])
@pytest.mark.parametrize("world_size", range(1, 9))
@pytest.mark.parametrize("last_batch", ["partial", "drop", "pad"])
def test_plan_rule(n, world_size, last_batch):
    """The order rule on its own, many sizes (n < world_size included)."""
    b = 3
    order = epoch_order(n, True, 5, 1)
    plans = [EpochPlan(n, b, world_size, r, last_batch) for r in range(world_size)]
    assert len({len(p) for p in plans}) == 1
    real = []
    for p in plans:
        for k in range(len(p)):
            src, index = p.rows(order, k)
            assert len(src) == len(index) >= 1
            pad = index < 0
            np.testing.assert_array_equal(src[~pad], index[~pad])
            assert (src >= 0).all() and (src < max(n, 1)).all()
            if last_batch != "partial":
                assert len(index) == b
            real.append(index[~pad])
    seen = np.concatenate(real) if real else np.zeros(0, np.int64)
    assert len(np.unique(seen)) == len(seen)
    if last_batch == "drop":
        assert len(seen) == n // (b * world_size) * b * world_size
    else:
        np.testing.assert_array_equal(np.sort(seen), np.arange(n))


def test_permutation_is_documented_rule():
    want = np.random.Generator(np.random.PCG64([3, 4])).permutation(10)
    np.testing.assert_array_equal(epoch_order(10, True, 3, 4), want)
    np.testing.assert_array_equal(epoch_order(10, False, 3, 4), np.arange(10))


@pytest.mark.parametrize("last_batch", ["partial", "drop", "pad"])
@pytest.mark.parametrize("world_size", range(1, 9))
def test_exactly_once(npy_index, world_size, last_batch):
    def make(**kw):
        return gpuio.Loader(npy_index, 4, ops=[AsFloat()], shuffle=True, seed=3, threads=2, output="numpy", **kw)

    check_exactly_once(make, N, world_size, last_batch)


def test_exactly_once_rows_carry_their_sample(npy_index):
    """Each row's data is the sample its index names; padding rows copy a real sample."""
    ld = gpuio.Loader(npy_index, 5, ops=[AsFloat()], shuffle=True, rank=2, world_size=3,
                      last_batch="pad", output="numpy", threads=2)
    order = epoch_order(N, True, 0, 0)
    for k, b in enumerate(ld):
        src, index = ld.plan.rows(order, k)
        np.testing.assert_array_equal(b["index"], index)
        for row, s in enumerate(src.tolist()):
            want = np.load(npy_index.extent(s).file)
            np.testing.assert_array_equal(b["data"][row], want)


@pytest.mark.parametrize("last_batch,world_size,rank", [("partial", 1, 0), ("pad", 3, 2), ("drop", 2, 1)])
def test_resume(npy_index, last_batch, world_size, rank):
    def make(**kw):
        return gpuio.Loader(npy_index, 4, ops=[AsFloat(), Noise()], shuffle=True, seed=9, threads=2,
                            rank=rank, world_size=world_size, last_batch=last_batch, output="numpy", **kw)

    check_resume(make)


def test_resume_filetree_torch(tree_index):
    def make(**kw):
        return gpuio.Loader(tree_index, 6, shuffle=True, seed=1, threads=2, **kw)

    check_resume(make, epochs=2)


def test_deterministic_across_threads(npy_index):
    def make(**kw):
        return gpuio.Loader(npy_index, 4, ops=[AsFloat(), Noise()], shuffle=True, seed=4,
                            last_batch="pad", rank=1, world_size=2, output="numpy", **kw)

    check_deterministic(make, [{"threads": 1, "prefetch": 1}, {"threads": 2, "prefetch": 2},
                               {"threads": 5, "prefetch": 4}])


def test_state_dict_checks_settings(npy_index):
    a = gpuio.Loader(npy_index, 4, shuffle=True)
    b = gpuio.Loader(npy_index, 5, shuffle=True)
    with pytest.raises(gpuio.errors.ConfigError, match="batch_size"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(gpuio.errors.ConfigError, match="out of range"):
        a.load_state_dict({**a.state_dict(), "batch": len(a) + 1})
