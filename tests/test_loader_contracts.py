"""The loader's contracts, through the shared checkers in tests/checkers.py:
exactly-once sharding, resume at every position (also on another number of ranks,
batch size or last-batch rule), determinism across thread counts; and the epoch
order: its documented rule and its shuffle quality against a full permutation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuio
from gpuio.errors import ConfigError
from gpuio.pipeline.order import ROUNDS, EpochPlan, epoch_order
from gpuio.batch import Op
from gpuio.formats import filetree, numpy as npy_format

from checkers import check_deterministic, check_elastic_resume, check_exactly_once, check_resume, RejectSamples

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


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 9, 16, 17, 37, 1000])  # 1000: batches() crosses blocks
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
        batches = list(p.batches(order))
        assert len(batches) == len(p)
        for k, (src, index) in enumerate(batches):
            want_src, want_index = p.rows(order, k)
            np.testing.assert_array_equal(src, want_src)
            np.testing.assert_array_equal(index, want_index)
        mine = [index[index >= 0] for index in (p.rows(order, k)[1] for k in range(len(p)))]
        np.testing.assert_array_equal(p.samples(order), np.concatenate(mine) if mine else np.zeros(0, np.int64))
    seen = np.concatenate(real) if real else np.zeros(0, np.int64)
    assert len(np.unique(seen)) == len(seen)
    if last_batch == "drop":
        assert len(seen) == n // (b * world_size) * b * world_size
    else:
        np.testing.assert_array_equal(np.sort(seen), np.arange(n))


def _documented_order(n, seed, epoch):
    """The order rule as the order module's docstring states it, one position at a time
    in plain Python integers."""
    m64 = (1 << 64) - 1
    keys = [int(k) for k in np.random.SeedSequence([seed, epoch]).generate_state(ROUNDS, np.uint64)]

    def mix(x):
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & m64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & m64
        return x ^ (x >> 31)

    bits = max(1, (n - 1).bit_length())

    def network(x):
        a, b = bits // 2, bits - bits // 2
        left, right = x >> b, x & ((1 << b) - 1)
        for key in keys:
            left, right = right, left ^ (mix(right ^ key) & ((1 << a) - 1))
            a, b = b, a
        return (left << b) | right

    out = []
    for p in range(n):
        x = network(p)
        while x >= n:
            x = network(x)
        out.append(x)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 10, 37, 64, 1000])
def test_permutation_is_documented_rule(n):
    np.testing.assert_array_equal(np.asarray(epoch_order(n, True, 3, 4)), _documented_order(n, 3, 4))
    np.testing.assert_array_equal(np.asarray(epoch_order(n, False, 3, 4)), np.arange(n))
    order = epoch_order(n, True, 3, 4)
    positions = np.random.default_rng(0).integers(0, n, 50)
    np.testing.assert_array_equal(order[positions], np.asarray(order)[positions])  # per position = whole


def test_order_is_a_permutation_at_every_size():
    for n in list(range(0, 70)) + [1023, 1024, 1025, 4097]:
        for seed, epoch in [(0, 0), (5, 1), (-1, 2**63)]:
            got = np.asarray(epoch_order(n, True, seed, epoch))
            np.testing.assert_array_equal(np.sort(got), np.arange(n))


def _quality(perms):
    """Statistics of permutations of [0, n) (rows) that a uniform one keeps close to
    known values: mean |corr(position, sample)|, mean displacement / n (1/3), the share
    of samples that stay within n/100 of their position (about 0.02), the correlation
    of neighbouring positions' samples, the share of fixed points times n (about 1),
    and the chi-square of where sample 0 lands over all rows (10 bins)."""
    n = perms.shape[1]
    pos = np.arange(n)
    corr = np.mean([abs(np.corrcoef(pos, p)[0, 1]) for p in perms])
    disp = np.mean(np.abs(perms - pos)) / n
    near = np.mean(np.abs(perms - pos) <= n // 100)
    neighbours = np.mean([abs(np.corrcoef(p[:-1], p[1:])[0, 1]) for p in perms])
    fixed = np.mean(perms == pos) * n
    lands = np.argmax(perms == 0, axis=1) * 10 // n
    counts = np.bincount(lands, minlength=10)
    expected = len(perms) / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    return corr, disp, near, neighbours, fixed, chi2


@pytest.mark.parametrize("n", [1000, 5000, 4097])
def test_shuffle_quality_matches_a_full_permutation(n):
    """The keyed order against numpy's full permutation: the same statistics within the
    noise of 300 draws (position correlation, displacement, locality, neighbours, fixed
    points, where a sample lands)."""
    draws = 300
    ours = np.stack([np.asarray(epoch_order(n, True, 7, e)) for e in range(draws)])
    full = np.stack([np.random.default_rng(e).permutation(n) for e in range(draws)])
    q, f = _quality(ours), _quality(full)
    corr, disp, near, neighbours, fixed, chi2 = q
    assert corr < 3 * f[0] + 0.01 and neighbours < 3 * f[3] + 0.01, (q, f)
    assert abs(disp - 1 / 3) < 0.01 and abs(f[1] - 1 / 3) < 0.01, (q, f)
    assert abs(near - f[2]) < 0.005, (q, f)
    assert 0.6 < fixed < 1.4, (q, f)
    assert chi2 < 27.9, (q, f)  # chi-square, 9 degrees of freedom, p = 0.001
    # the orders of two epochs are unrelated
    assert abs(np.corrcoef(ours[0], ours[1])[0, 1]) < 0.1


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
    a = gpuio.Loader(npy_index, 4, shuffle=True, seed=1)
    state = a.state_dict()
    with pytest.raises(ConfigError, match="seed=1, this loader has seed=2"):
        gpuio.Loader(npy_index, 4, shuffle=True, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="shuffle=True, this loader has shuffle=False"):
        gpuio.Loader(npy_index, 4, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="out of range"):
        a.load_state_dict({**state, "batch": len(a) + 1})
    with pytest.raises(ConfigError, match="inconsistent state: 2 batches of 4 on 1 ranks .* consume 8 samples"):
        a.load_state_dict({**state, "batch": 2, "consumed": 4})
    with pytest.raises(ConfigError, match="state lacks 'consumed'"):
        a.load_state_dict({k: v for k, v in state.items() if k != "consumed"})
    gpuio.Loader(npy_index, 5, shuffle=True, seed=1, world_size=3, rank=2).load_state_dict(state)  # elastic


def test_state_of_the_old_order_is_refused(npy_index):
    """A state from before the keyed order (no order_version) names positions of another
    order: refused, saying so."""
    old = {"epoch": 1, "batch": 2, "samples": N, "batch_size": 4, "world_size": 1,
           "last_batch": "partial", "shuffle": True, "seed": 0}
    with pytest.raises(ConfigError, match=r"older epoch order \(no 'order_version' key"):
        gpuio.Loader(npy_index, 4, shuffle=True).load_state_dict(old)


def test_states_that_disagree_are_refused(npy_index):
    loaders = [gpuio.Loader(npy_index, 4, shuffle=True, rank=r, world_size=2, threads=1) for r in range(2)]
    states = []
    for ld, steps in zip(loaders, (1, 2)):
        it = iter(ld)
        for _ in range(steps):
            next(it)
        states.append(ld.state_dict())
        del it
    new = gpuio.Loader(npy_index, 4, shuffle=True, rank=0, world_size=3)
    with pytest.raises(ConfigError, match="do not describe one position: rank 0 saved consumed=8, rank 1 saved "
                                          "consumed=16"):
        new.load_state_dict(states)


@pytest.fixture(scope="module")
def npy_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("npy_elastic")
    rng = np.random.default_rng(3)
    files = []
    for i in range(40):
        files.append(str(root / f"{i:03d}.npy"))
        np.save(files[-1], rng.random((2,), dtype=np.float32) + i)
    return files


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(0, 40), w=st.integers(1, 5), b=st.integers(1, 6), w2=st.integers(1, 5),
       b2=st.integers(1, 6), last=st.sampled_from(["partial", "drop", "pad"]),
       last2=st.sampled_from(["partial", "drop", "pad"]))
def test_elastic_resume(npy_files, data, n, w, b, w2, b2, last, last2):
    """Saved by W ranks of B at any step, resumed by W' ranks of B': exactly once, the
    same data and draws per sample, then ordinary epochs."""
    index = npy_format(npy_files[:n]) if n else None
    if index is None:  # an empty dataset: nothing to resume, nothing to check but the plan
        plans = [EpochPlan(0, b2, w2, r, last2, 0) for r in range(w2)]
        assert all(len(p) == 0 for p in plans)
        return
    steps = data.draw(st.integers(0, len(EpochPlan(n, b, w, 0, last))), label="steps")

    def make(**kw):
        return gpuio.Loader(index, ops=[AsFloat(), Noise()], shuffle=True, seed=11, threads=1,
                            output="numpy", **kw)

    check_elastic_resume(make, n, {"world_size": w, "batch_size": b, "last_batch": last},
                         {"world_size": w2, "batch_size": b2, "last_batch": last2}, steps)


def test_elastic_resume_carries_skip_counts(npy_index):
    """Skip counts go on: new rank r takes the counts of saved ranks q with q % W' == r,
    so the new ranks' counts add up to the job's."""
    bad = [int(i) for i in np.asarray(epoch_order(N, True, 2, 0))[:12:2]]  # 6 samples of the first 12
    old = [gpuio.Loader(npy_index, 3, ops=[RejectSamples(bad)], shuffle=True, seed=2, rank=r, world_size=4,
                        threads=1, output="numpy", on_error="skip") for r in range(4)]
    states = []
    for ld in old:
        it = iter(ld)
        next(it)
        states.append(ld.state_dict())
        del it
    counts = [s["skipped"] for s in states]
    assert sum(counts) == 6
    new = [gpuio.Loader(npy_index, 5, ops=[RejectSamples(bad)], shuffle=True, seed=2, rank=r, world_size=3,
                        threads=1, output="numpy", on_error="skip") for r in range(3)]
    for r, ld in enumerate(new):
        ld.load_state_dict(states)
        assert ld.stats()["skipped"] == sum(c for q, c in enumerate(counts) if q % 3 == r)
        rows = np.concatenate([b["index"] for b in ld])
        assert not set(rows.tolist()) & set(bad)
    assert sum(ld.stats()["skipped"] for ld in new) == 6


def test_resume_of_a_resumed_epoch(npy_index):
    """A job resumed on another shape saves again mid-epoch and is resumed on a third:
    the position stays a prefix of the one order, every sample exactly once."""
    def job(world, batch, last):
        return [gpuio.Loader(npy_index, batch, shuffle=True, seed=6, rank=r, world_size=world, last_batch=last,
                             threads=1, output="numpy") for r in range(world)]

    seen, states = [], None
    for (world, batch, last), steps in [((4, 2, "pad"), 1), ((3, 3, "drop"), 2), ((2, 5, "partial"), None)]:
        saved = []
        for ld in job(world, batch, last):
            if states is not None:
                ld.load_state_dict(states)
            it = iter(ld)
            for _ in range(len(ld) if steps is None else steps):
                idx = next(it)["index"]
                seen.append(idx[idx >= 0])
            saved.append(ld.state_dict())
            del it
        states = saved
    assert [s["consumed"] for s in states] == [N] * 2
    seen = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(seen), np.arange(N))
    order = np.asarray(epoch_order(N, True, 6, 0))
    np.testing.assert_array_equal(np.sort(seen[:8 + 18]), np.sort(order[:8 + 18]))  # the consumed prefix
