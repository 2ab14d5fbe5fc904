import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuio.errors import ConfigError
from gpuio.storage.plan import build_plan


def run_plan(plan, files, file_ids, offsets, lengths):
    """Execute a plan against in-memory files; return each sample's bytes."""
    buf = np.zeros(plan.nbytes, dtype=np.uint8)
    for f, off, n, dest, need in zip(plan.task_file, plan.task_offset, plan.task_length, plan.task_dest, plan.task_need):
        chunk = files[f][off: off + n]
        assert len(chunk) >= need
        buf[dest: dest + len(chunk)] = chunk
    return [buf[d: d + n].tobytes() for d, n in zip(plan.sample_dest, plan.sample_length)]


extent_lists = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 5000), st.integers(0, 3000)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(extent_lists, st.sampled_from([0, 1, 64, 4096]), st.sampled_from([1, 512, 4096]),
       st.sampled_from([4096, 1000, 1 << 20]), st.sampled_from([1, 2, 4]))
def test_plan_puts_every_sample_where_it_says(extents, gap, align, task_size, parts):
    rng = np.random.default_rng(0)
    files = [rng.integers(0, 256, 9000, dtype=np.uint8) for _ in range(4)]
    f, o, n = (np.array(c, dtype=np.int64) for c in zip(*extents))
    plan = build_plan(f, o, n, gap=gap, align=align, task_size=task_size, parts=parts)
    got = run_plan(plan, files, f, o, n)
    for i in range(len(f)):
        assert got[i] == files[f[i]][o[i]: o[i] + n[i]].tobytes()
    # the reads unsplit; those longer than task_size make about `parts` tasks of one size
    reads = build_plan(f, o, n, gap=gap, align=align, task_size=1 << 40).task_length
    unit = max(task_size, align) // align * align
    piece = unit * max(1, -(-int(reads[reads > unit].sum()) // (parts * unit)))
    assert len(plan) == np.maximum(1, -(-reads // piece)).sum()
    assert (plan.task_length <= piece).all()
    if align > 1:
        assert (plan.task_offset % align == 0).all()
        assert (plan.task_dest % align == 0).all()
        assert (plan.task_length % align == 0).all()
    # reads never overlap in the buffer (a read of nothing, for an empty sample, is nowhere)
    dest, length = plan.task_dest[plan.task_length > 0], plan.task_length[plan.task_length > 0]
    order = np.argsort(dest)
    assert (dest[order][1:] >= (dest + length)[order][:-1]).all()


def test_adjacent_and_near_extents_merge_into_one_read():
    plan = build_plan([0, 0, 0], [0, 100, 300], [100, 100, 50], gap=100)
    assert len(plan) == 1 and plan.nbytes == 350
    assert plan.sample_dest.tolist() == [0, 100, 300]


def test_gap_larger_than_limit_splits_reads_and_files_never_merge():
    plan = build_plan([0, 0, 1], [0, 10_000, 0], [10, 10, 10], gap=4096)
    assert len(plan) == 3 and plan.nbytes == 30


def test_duplicate_extents_share_bytes():
    plan = build_plan([0, 0], [64, 64], [16, 16], gap=0)
    assert len(plan) == 1 and plan.sample_dest.tolist() == [0, 0]


def test_o_direct_alignment_widens_reads():
    plan = build_plan([0], [5000], [10], align=4096)
    assert plan.task_offset.tolist() == [4096] and plan.task_length.tolist() == [4096]
    assert plan.sample_dest.tolist() == [5000 - 4096]
    assert plan.task_need.tolist() == [5010 - 4096]


def test_large_extent_splits_into_tasks():
    plan = build_plan([0], [0], [10 << 20], task_size=4 << 20)
    assert plan.task_length.tolist() == [4 << 20, 4 << 20, 2 << 20]
    assert plan.task_dest.tolist() == [0, 4 << 20, 8 << 20]
    assert build_plan([0], [0], [10 << 20], task_size=4 << 20, parts=1).task_length.tolist() == [10 << 20]


def test_long_reads_make_about_parts_tasks_in_all():
    """One 128 MiB .npy array: 4 sequential parts of 32 MiB, not 32 tasks of 4 MiB; four
    such files in one batch: one part each."""
    one = build_plan([0], [128], [128 << 20], task_size=4 << 20, parts=4)
    assert one.task_offset.tolist() == [128 + (k << 25) for k in range(4)]
    assert one.task_length.tolist() == [32 << 20] * 4
    four = build_plan([0, 1, 2, 3], [128] * 4, [256 << 20] * 4, task_size=4 << 20, parts=4)
    assert four.task_length.tolist() == [256 << 20] * 4
    # short reads beside them are not counted and not split
    mixed = build_plan([0, 1], [0, 0], [100 << 20, 100_000], task_size=4 << 20, parts=4)
    assert mixed.task_length.tolist() == [28 << 20] * 3 + [16 << 20, 100_000]
    # O_DIRECT: an unaligned extent of an odd size, tasks still aligned
    direct = build_plan([0], [1000], [(9 << 20) + 3], align=4096, task_size=1 << 20, parts=3)
    assert direct.task_length.tolist() == [4 << 20, 4 << 20, (1 << 20) + 4096]
    assert (direct.task_offset % 4096 == 0).all() and (direct.task_dest % 4096 == 0).all()
    assert direct.sample_dest.tolist() == [1000] and direct.task_need.tolist()[-1] == (1 << 20) + 1003
    with pytest.raises(ConfigError, match="parts must be at least 1, got 0"):
        build_plan([0], [0], [1], parts=0)


def test_empty_plan():
    plan = build_plan([], [], [])
    assert len(plan) == 0 and plan.nbytes == 0


def test_align_must_be_power_of_two():
    with pytest.raises(ConfigError, match="align must be a power of two, got 3000"):
        build_plan([0], [0], [1], align=3000)


def test_one_file_per_sample_lands_in_the_order_given():
    """Shuffled samples of one file each: back to back in the buffer in the order given
    (a [B, ...] batch is then a view of it), the reads still issued in file order."""
    files = np.array([5, 2, 9, 0, 7])
    plan = build_plan(files, np.full(5, 128), np.full(5, 400))
    assert plan.sample_dest.tolist() == [0, 400, 800, 1200, 1600] and plan.nbytes == 2000
    assert plan.task_file.tolist() == [0, 2, 5, 7, 9]
    assert plan.task_dest.tolist() == [1200, 400, 0, 1600, 800]
    assert plan.task_need.tolist() == plan.task_length.tolist() == [400] * 5


def test_samples_that_follow_in_the_file_and_in_the_batch_share_a_read():
    # file 1's two samples, then file 0's two: two reads, rows in the order given
    plan = build_plan([1, 1, 0, 0], [0, 100, 0, 100], [100] * 4, gap=0)
    assert plan.sample_dest.tolist() == [0, 100, 200, 300]
    assert plan.task_file.tolist() == [0, 1] and plan.task_dest.tolist() == [200, 0]
    assert plan.task_length.tolist() == [200, 200]


def test_file_order_is_kept_where_it_saves_reads():
    # one file, shuffled: one merged read in file order beats four in batch order
    plan = build_plan([0, 0, 0, 0], [300, 0, 200, 100], [100] * 4, gap=0)
    assert len(plan) == 1 and plan.sample_dest.tolist() == [300, 0, 200, 100]
    # O_DIRECT reads start on aligned destinations: file order, as before
    aligned = build_plan([3, 1], [128, 128], [400, 400], align=4096)
    assert aligned.task_dest.tolist() == [0, 4096] and aligned.sample_dest.tolist() == [4096 + 128, 128]


def test_given_order_reads_split_into_tasks():
    plan = build_plan([1, 0], [0, 0], [10 << 20, 10 << 20], task_size=4 << 20)
    assert plan.sample_dest.tolist() == [0, 10 << 20]
    assert plan.task_file.tolist() == [0, 0, 1, 1]  # 20 MiB in 4 parts: tasks of 8 MiB
    assert plan.task_dest.tolist() == [10 << 20, 18 << 20, 0, 8 << 20]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3000)), min_size=1, max_size=40),
       st.sampled_from([3000, 1 << 20]), st.sampled_from([1, 4]), st.randoms(use_true_random=False))
def test_a_file_per_sample_plans_as_the_general_given_order_path(extents, task_size, parts, rnd):
    """The shortcut for a file tree (every sample in a file of its own, no read to split)
    gives the plan the general path gives."""
    from gpuio.storage.plan import _given_order_plan

    offset, length = (np.array(c, dtype=np.int64) for c in zip(*extents))
    file = np.array(rnd.sample(range(1000), len(extents)), dtype=np.int64)
    got = build_plan(file, offset, length, task_size=task_size, parts=parts)
    want = _given_order_plan(file, offset, length, np.zeros(len(file), dtype=bool), task_size, parts)
    for name in ("task_file", "task_offset", "task_length", "task_dest", "task_need", "sample_dest",
                 "sample_length"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert (got.nbytes, got.align) == (want.nbytes, want.align)
