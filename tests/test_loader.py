"""gpuio.Loader: outputs, error propagation, skip mode, shutdown, stats."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.batch import Op
from gpuio.errors import ConfigError, DataError, PipelineError, StorageError
from gpuio.formats import filetree, numpy as npy_format
from gpuio.index import Ragged, SampleIndex

from checkers import assert_same_batch, host, RejectSamples

N = 30


def make_tree(root, n=N, seed=0, size=(1, 4000)):
    rng = np.random.default_rng(seed)
    for i in range(n):
        d = root / f"class{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{i:03d}.jpg").write_bytes(rng.bytes(int(rng.integers(*size))))
    return filetree(str(root))


def with_keys(index: SampleIndex) -> SampleIndex:
    keys = Ragged.from_list([f"img-{i:03d}" for i in range(len(index))], kind="str")
    return SampleIndex(index.files, index.extents, {**index.values, "key": keys}, meta=index.meta)


def loader_threads():
    gc.collect()  # loaders left in reference cycles (a traceback holding a frame) end their threads here
    return {t for t in threading.enumerate() if t.name.startswith("gpuio-loader")}


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "tree")


@pytest.fixture
def npy(tmp_path):
    rng = np.random.default_rng(3)
    return npy_files(tmp_path / "npy", [rng.integers(0, 255, (4, 5), dtype=np.uint8) for _ in range(N)])


def npy_files(root, arrays) -> SampleIndex:
    """A ``formats.numpy`` index of one ``.npy`` file per array."""
    root.mkdir()
    for i, a in enumerate(arrays):
        np.save(root / f"{i:03d}.npy", a)
    return npy_format(str(root))


class AsArray(Op):
    def __call__(self, batch):
        batch.data["data"] = [d.view(np.dtype(t)).reshape(tuple(s))
                              for d, s, t in zip(batch.data["data"], batch.data["shape"], batch.data["dtype"])]
        return batch


class Boom(Op):
    def __call__(self, batch):
        if 5 in batch.index.tolist():
            raise ValueError("op failed")
        return batch


class Slow(Op):
    def __call__(self, batch):
        time.sleep(0.05)
        return batch


# ---- outputs -------------------------------------------------------------------------
def test_torch_output_types(tree):
    import torch

    ld = gpuio.Loader(tree, 8, threads=2)
    b = next(iter(ld))
    assert set(b) == {"data", "label", "index"}
    assert isinstance(b["label"], torch.Tensor) and b["label"].shape == (8,)
    assert b["index"].dtype == torch.int64
    assert isinstance(b["data"], list) and all(isinstance(x, np.ndarray) for x in b["data"])
    for i, x in zip(b["index"].tolist(), b["data"]):
        with open(tree.extent(i).file, "rb") as f:
            assert x.tobytes() == f.read()
    np.testing.assert_array_equal(b["label"].numpy(), tree.values["label"][:8])


def test_numpy_output_stacks_fixed_shapes(npy):
    ld = gpuio.Loader(npy, 7, ops=[AsArray()], output="numpy", threads=2)
    batches = list(ld)
    assert len(batches) == len(ld) == 5
    assert [len(b["index"]) for b in batches] == [7, 7, 7, 7, 2]
    b = batches[0]
    assert isinstance(b["data"], np.ndarray) and b["data"].shape == (7, 4, 5) and b["data"].dtype == np.uint8
    assert isinstance(b["shape"], list) and isinstance(b["dtype"], list)  # Ragged fields stay lists
    for row, i in enumerate(b["index"].tolist()):
        np.testing.assert_array_equal(b["data"][row], np.load(npy.extent(i).file))


def test_stack_is_a_view_when_rows_lie_in_order(npy):
    """Shuffled or not, one file per sample lands back to back in one batch buffer, in
    row order, and is stacked without a copy, page aligned (JAX takes 64-byte aligned
    memory without a copy of its own)."""
    b = next(iter(gpuio.Loader(npy, 6, ops=[AsArray()], output="numpy", threads=1)))
    assert not b["data"].flags.owndata
    s = next(iter(gpuio.Loader(npy, 6, ops=[AsArray()], output="numpy", threads=1, shuffle=True)))
    assert not s["data"].flags.owndata and s["data"].ctypes.data % 4096 == 0
    for batch in (b, s):
        for row, i in enumerate(batch["index"].tolist()):
            np.testing.assert_array_equal(batch["data"][row], np.load(npy.extent(i).file))


def test_torch_tensors_by_dlpack_and_raw_views(npy):
    import torch

    b = next(iter(gpuio.Loader(npy, 4, ops=[AsArray()], threads=1)))
    assert isinstance(b["data"], torch.Tensor) and b["data"].shape == (4, 4, 5)
    rb = next(iter(gpuio.Loader(npy, 4, output="numpy", threads=1)))
    # raw bytes stay a list of views into one read buffer
    assert len({id(x.base) for x in rb["data"]}) == 1 and rb["data"][0].base is not None


def test_fields_selection_and_reserved_name(tree):
    ld = gpuio.Loader(tree, 4, fields=["label"], threads=1, output="numpy")
    b = next(iter(ld))
    assert set(b) == {"label", "index"}
    assert ld.stats()["bytes"] == 0  # no extent field read
    with pytest.raises(ConfigError, match="unknown field"):
        gpuio.Loader(tree, 4, fields=["nope"])
    with pytest.raises(ConfigError, match="last_batch"):
        gpuio.Loader(tree, 4, last_batch="keep")
    with pytest.raises(ConfigError, match="batch_size"):
        gpuio.Loader(tree, 0)
    with pytest.raises(ConfigError, match="rank"):
        gpuio.Loader(tree, 4, rank=2, world_size=2)


def test_epochs_advance_and_set_epoch(tree):
    ld = gpuio.Loader(tree, 8, shuffle=True, output="numpy", threads=2)
    e0 = np.concatenate([b["index"] for b in ld])
    assert ld.epoch == 1
    e1 = np.concatenate([b["index"] for b in ld])
    assert not np.array_equal(e0, e1)
    ld.set_epoch(0)
    np.testing.assert_array_equal(np.concatenate([b["index"] for b in ld]), e0)
    for b in ld:  # leaving a pass early restarts that epoch
        break
    assert ld.epoch == 1
    np.testing.assert_array_equal(np.concatenate([b["index"] for b in ld]), e1)


def test_stats(tree):
    ld = gpuio.Loader(tree, 8, ops=[Slow()], threads=2, output="numpy")
    rows = sum(len(b["index"]) for b in ld)
    s = ld.stats()
    assert s["samples"] == rows == N
    assert s["bytes"] == tree.nbytes()
    assert s["samples_per_s"] > 0 and s["bytes_per_s"] > 0
    assert set(s["stages"]) == {"read", "Slow"}  # on the CPU, collate runs in the last stage
    assert s["stages"]["Slow"]["batches"] == len(ld)
    assert s["stages"]["Slow"]["ms_per_batch"] >= 45
    assert s["skipped"] == 0 and s["errors"] == []


def test_window_and_read_ahead(tree):
    """Besides the batch the consumer holds, a batch per stage worker plus ``prefetch``
    (default 1) are in flight: a loader that only reads has read batches k+1 and k+2
    when it hands over batch k, without being asked; with prefetch=0, batch k+1 only."""
    sizes = gpuio.storage.learn_lengths(tree).extents["data"].length  # a walked tree's are learned
    batch_bytes = [int(sizes[k * 5: (k + 1) * 5].sum()) for k in range(4)]
    for prefetch, window in ((1, 2), (0, 1)):
        ld = gpuio.Loader(tree, 5, output="numpy", **({} if prefetch == 1 else {"prefetch": 0}))
        it = iter(ld)
        next(it)
        want = sum(batch_bytes[: window + 1])
        deadline = time.monotonic() + 10
        while ld.stats()["bytes"] < want and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)  # room for a wrong further read to show
        assert ld.stats()["bytes"] == want
        assert ld.stats()["window"] == window
        ld.close()
    assert gpuio.Loader(tree, 5, ops=[Slow()], threads=3, prefetch=2).stats()["window"] == 0  # not started
    ld = gpuio.Loader(tree, 5, ops=[Slow()], threads=3, prefetch=2, output="numpy")
    it = iter(ld)
    next(it)
    assert ld.stats()["window"] == 2 + 1 + 3  # prefetch, the reader, the op stage's workers
    ld.close()
    with pytest.raises(ConfigError, match="prefetch must be an integer >= 0"):
        gpuio.Loader(tree, 5, prefetch=-1)


def test_idle_consumer_reads_inline_busy_one_reads_ahead(tmp_path):
    """A read-only loader whose consumer does nothing between batches reads its next
    pass on the consumer's thread; one whose consumer works reads ahead on the stage
    thread. Both yield the same batches, pass after pass, and an idle loader whose
    consumer starts working reads ahead again from the next pass."""
    tree = make_tree(tmp_path, size=(200_000, 300_000))  # reads long next to the idle consumer's time

    def passes(ld, n, work_s=0.0):
        out, modes = [], []
        for _ in range(n):
            got = []
            for b in ld:
                got.append(b)  # compared after the pass: an idle consumer
                if work_s:
                    time.sleep(work_s)
            out.append([(b["index"], [d.tobytes() for d in b["data"]]) for b in got])
            modes.append(ld.stats()["inline"])
        return out, modes

    idle = gpuio.Loader(tree, 4, shuffle=True, seed=3, output="numpy")
    busy = gpuio.Loader(tree, 4, shuffle=True, seed=3, output="numpy")
    got_idle, idle_modes = passes(idle, 3)
    got_busy, busy_modes = passes(busy, 3, work_s=0.02)
    assert idle_modes == [False, True, True]  # the first pass reads ahead: nothing is known yet
    assert busy_modes == [False, False, False]
    for a, b in zip(got_idle, got_busy):
        assert len(a) == len(b) == len(idle)
        for (ia, da), (ib, db) in zip(a, b):
            np.testing.assert_array_equal(ia, ib)
            assert da == db
    _, modes = passes(idle, 2, work_s=0.02)
    assert modes == [True, False]  # the pass after a busy one reads ahead
    assert idle.stats()["stages"]["read"]["batches"] == 5 * len(idle)  # inline passes count too
    idle.close(), busy.close()


def test_loaders_with_stages_or_on_a_gpu_never_read_inline(tree):
    ld = gpuio.Loader(tree, 8, ops=[Slow()], threads=2, output="numpy")
    for _ in range(2):
        assert sum(len(b["index"]) for b in ld) == N
        assert not ld.stats()["inline"]
    ld.close()
    from gpuio.pipeline._executor import Executor, Stage
    from gpuio.device import Device

    ex = Executor([Stage("s", lambda x: x, gpu=True)], window=1, device=Device("cpu"))
    with pytest.raises(RuntimeError, match="cannot run inline"):
        ex.feed(iter([1]), inline=True)


def test_inline_pass_reports_and_skips_bad_samples_as_a_threaded_one(tmp_path):
    for on_error in ("raise", "skip"):
        index = with_keys(make_tree(tmp_path / on_error, size=(100, 200)))
        ld = gpuio.Loader(index, 4, output="numpy", on_error=on_error)
        assert sum(len(b["index"]) for b in ld) == N
        assert sum(len(b["index"]) for b in ld) == N and ld.stats()["inline"]
        bad = 17 if on_error == "raise" else 9
        os.remove(index.extent(bad).file)
        got = []
        if on_error == "raise":
            with pytest.raises(PipelineError) as info:
                for b in ld:
                    got.extend(b["index"].tolist())
            err = info.value
            assert err.stage == "read" and err.sample == bad and err.path == index.extent(bad).file
            assert got == list(range(16)), "batches before the bad one arrive, in order"
        else:
            got = np.concatenate([b["index"] for b in ld])
            np.testing.assert_array_equal(got, np.setdiff1d(np.arange(N), [bad]))
            assert ld.stats()["skipped"] == 1 and "sample 9" in ld.stats()["errors"][-1]
        ld.close()
    assert not loader_threads()


def test_order_is_kept_when_batches_finish_out_of_order(tree):
    class Jitter(Op):
        def __call__(self, batch):
            time.sleep(0.03 * (int(batch.index[0]) % 3 == 0))
            return batch

    ld = gpuio.Loader(tree, 3, ops=[Jitter()], threads=4, prefetch=4, output="numpy")
    got = np.concatenate([b["index"] for b in ld])
    np.testing.assert_array_equal(got, np.arange(N))


# ---- errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_read_error_names_stage_sample_key_file(tmp_path, damage):
    # with the sizes recorded: a walked tree, whose sizes are learned at the read, reads a truncated file whole
    index = with_keys(gpuio.storage.learn_lengths(make_tree(tmp_path / "t", size=(100, 200))))
    bad = 17
    path = index.extent(bad).file
    if damage == "truncate":
        with open(path, "r+b") as f:
            f.truncate(10)
    else:
        os.remove(path)
    ld = gpuio.Loader(index, 4, threads=2, output="numpy")
    got = []
    with pytest.raises(PipelineError) as info:
        for b in ld:
            got.extend(b["index"].tolist())
    err = info.value
    assert err.stage == "read" and err.sample == bad and err.key == f"img-{bad:03d}" and err.path == path
    assert isinstance(err.__cause__, StorageError)
    assert path in str(err) and "sample 17" in str(err) and "'read'" in str(err)
    assert got == list(range(16)), "batches before the bad one arrive, in order"
    assert not loader_threads()


def test_read_error_skip_counts(tmp_path):
    index = make_tree(tmp_path / "t", size=(100, 200))
    for bad in (3, 17):
        os.remove(index.extent(bad).file)
    ld = gpuio.Loader(index, 4, threads=2, output="numpy", on_error="skip")
    got = np.concatenate([b["index"] for b in ld])
    assert len([b for b in ld]) == len(ld)  # same batch count with skipped rows
    np.testing.assert_array_equal(np.sort(got), np.setdiff1d(np.arange(N), [3, 17]))
    s = ld.stats()
    assert s["skipped"] == 4  # two passes
    assert "sample 3" in s["errors"][0] and index.extent(3).file in s["errors"][0]


def test_op_reject_raise_and_skip(tree):
    ld = gpuio.Loader(with_keys(tree), 4, ops=[RejectSamples([6])], threads=2, output="numpy")
    with pytest.raises(PipelineError) as info:
        list(ld)
    err = info.value
    assert err.stage == "reject" and err.sample == 6 and err.key == "img-006"
    assert err.path == tree.extent(6).file and isinstance(err.__cause__, DataError)
    ld = gpuio.Loader(tree, 4, ops=[RejectSamples([6, 7, 20])], threads=2, output="numpy", on_error="skip",
                      shuffle=True)
    batches = list(ld)
    assert len(batches) == len(ld)
    got = np.concatenate([b["index"] for b in batches])
    np.testing.assert_array_equal(np.sort(got), np.setdiff1d(np.arange(N), [6, 7, 20]))
    for b in batches:
        assert len(b["data"]) == len(b["label"]) == len(b["index"])
    assert ld.stats()["skipped"] == 3


def test_op_exception_is_pipeline_error(tree):
    ld = gpuio.Loader(tree, 4, ops=[Boom()], threads=2, output="numpy")
    with pytest.raises(PipelineError, match="op failed") as info:
        list(ld)
    assert info.value.stage == "Boom" and isinstance(info.value.__cause__, ValueError)
    assert not loader_threads()


def write_tfrecord(path, n, missing_label=()):
    from tfrecord import TFRecordWriter

    writer = TFRecordWriter(str(path))
    for i in range(n):
        example = {"image": (bytes([i]) * (10 + i), "byte")}
        if i not in missing_label:
            example["label"] = (i * 10, "int")
        writer.write(example)
    writer.close()


def test_parse_stage_tfrecord(tmp_path):
    write_tfrecord(tmp_path / "a.tfrecord", 13)
    index = gpuio.formats.tfrecord(str(tmp_path / "a.tfrecord"), features={"image": "bytes", "label": "int64"})
    ld = gpuio.Loader(index, 4, fields=["image", "label"], shuffle=True, threads=2, output="numpy")
    seen = []
    for b in ld:
        assert set(b) == {"image", "label", "index"}
        assert isinstance(b["label"], np.ndarray) and b["label"].dtype == np.int64
        np.testing.assert_array_equal(b["label"], b["index"] * 10)
        for i, img in zip(b["index"].tolist(), b["image"]):
            assert bytes(img) == bytes([i]) * (10 + i)
        seen.extend(b["index"].tolist())
    assert sorted(seen) == list(range(13))
    assert "parse" in ld.stats()["stages"]


def test_parse_error_raise_and_skip(tmp_path):
    path = tmp_path / "a.tfrecord"
    write_tfrecord(path, 9, missing_label=[4])
    index = gpuio.formats.tfrecord(str(path), features={"image": "bytes", "label": "int64"})
    ld = gpuio.Loader(index, 3, fields=["image", "label"], threads=2, output="numpy")
    with pytest.raises(PipelineError) as info:
        list(ld)
    assert info.value.stage == "parse" and info.value.sample == 4 and info.value.path == str(path)
    ld = gpuio.Loader(index, 3, fields=["image", "label"], threads=2, output="numpy", on_error="skip")
    got = np.concatenate([b["index"] for b in ld])
    np.testing.assert_array_equal(got, [0, 1, 2, 3, 5, 6, 7, 8])
    assert ld.stats()["skipped"] == 1 and "sample 4" in ld.stats()["errors"][0]


# ---- shutdown ---------------------------------------------------------------------------
def test_no_threads_after_break(tree):
    ld = gpuio.Loader(tree, 2, ops=[Slow()], threads=3, prefetch=4)
    for _ in ld:
        assert loader_threads()
        break
    assert not loader_threads()


def test_no_threads_after_close(tree):
    ld = gpuio.Loader(tree, 2, ops=[Slow()], threads=3)
    it = iter(ld)
    next(it)
    ld.close()
    assert not loader_threads()
    assert list(it) == []  # a closed pass ends


def test_no_threads_after_consumer_exception_or_interrupt(tree):
    ld = gpuio.Loader(tree, 2, ops=[Slow()], threads=3)
    for exc in (RuntimeError, KeyboardInterrupt):
        with pytest.raises(exc):
            for _ in ld:
                raise exc()
        assert not loader_threads()


def test_no_threads_after_gc(tree):
    ld = gpuio.Loader(tree, 2, ops=[Slow()], threads=3)
    it = iter(ld)
    next(it)
    del it
    gc.collect()
    assert not loader_threads()
    del ld
    gc.collect()
    assert not loader_threads()


def test_threads_are_kept_across_completed_passes_and_end_with_the_loader(tree):
    ld = gpuio.Loader(tree, 4, ops=[Slow()], threads=2, output="numpy")
    first = [b["index"].tolist() for b in ld]
    started = loader_threads()
    assert started and all(t.is_alive() for t in started)
    second = [b["index"].tolist() for b in ld]  # the next epoch runs on the same threads
    assert loader_threads() == started and first == second
    ld.close()
    assert not loader_threads() and not any(t.is_alive() for t in started)
    assert [b["index"].tolist() for b in ld] == first  # a closed loader starts them again
    assert loader_threads()
    del ld  # dropped without close(): its threads hold no reference to it
    gc.collect()
    assert not loader_threads() and not any(t.is_alive() for t in started)


def test_threads_kept_at_a_fork_are_the_parents_and_the_child_starts_its_own(tree):
    from test_fork import run_in_fork_child

    ld = gpuio.Loader(tree, 4, ops=[Slow()], threads=2, output="numpy")
    want = [b["index"].tolist() for b in ld]  # a completed pass: its threads idle at the fork
    kept = loader_threads()
    assert run_in_fork_child(lambda: [b["index"].tolist() for b in ld]) == want
    assert [b["index"].tolist() for b in ld] == want and loader_threads() == kept
    ld.close()


def test_no_threads_after_iterators_of_several_passes_are_dropped(tree):
    ld = gpuio.Loader(tree, 2, ops=[Slow()], threads=3)
    list(ld)  # a completed pass: its threads stay
    passes = [iter(ld) for _ in range(3)]
    for it in passes:
        next(it)  # each new pass stops the one before
    assert [len(list(it)) for it in passes[:2]] == [0, 0]  # stopped passes end
    del passes, it
    assert not loader_threads()
    del ld
    assert not loader_threads()


def test_close_does_not_drain_the_pipeline(tree):
    class Held(Op):
        """Holds every batch after the first until close() stops the pass, so that close
        meets each worker inside a call with more batches queued behind it."""

        calls = 0

        def __call__(self, batch):
            Held.calls += 1
            if int(batch.index[0]) != 0:
                ld._executor._stop.wait(30)
            return batch

    ld = gpuio.Loader(tree, 2, ops=[Held()], threads=2, prefetch=8)
    it = iter(ld)
    next(it)
    deadline = time.monotonic() + 30  # batch 0, then one batch held by each of the 2 workers
    while Held.calls < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert Held.calls == 3
    ld.close()
    # each worker finishes the batch it holds; the queued ones are dropped
    assert Held.calls == 3 and not loader_threads()


# ---- end to end with the real image ops ---------------------------------------------
def test_decode_image_end_to_end(tmp_path):
    import simplejpeg

    rng = np.random.default_rng(0)
    root = tmp_path / "jpg" / "c0"
    root.mkdir(parents=True)
    for i in range(10):
        img = rng.integers(0, 255, (32, 48, 3), dtype=np.uint8)
        (root / f"{i}.jpg").write_bytes(simplejpeg.encode_jpeg(img, quality=95))
    index = filetree(str(tmp_path / "jpg"))
    dec = ops.decode_image()
    ld = gpuio.Loader(index, 4, ops=[dec], output="numpy", threads=2)
    assert "data" in getattr(dec, "host_inputs", ())
    b = next(iter(ld))
    imgs = b["image"]  # same-size images: stacked, NHWC
    assert isinstance(imgs, np.ndarray) and imgs.shape == (4, 32, 48, 3)
    assert "data" not in b  # decoded into "image": the encoded bytes come only when fields= names them
    named = next(iter(gpuio.Loader(index, 4, fields=["data"], ops=[dec], output="numpy", threads=2)))
    assert isinstance(named["data"], list) and named["image"].shape == (4, 32, 48, 3)
    for row, i in enumerate(b["index"].tolist()):
        with open(index.extent(i).file, "rb") as f:
            want = simplejpeg.decode_jpeg(f.read())
        np.testing.assert_array_equal(imgs[row], want)


def test_image_pipeline_resumes_with_same_draws(tmp_path):
    import simplejpeg

    from checkers import check_resume

    rng = np.random.default_rng(1)
    root = tmp_path / "jpg" / "c0"
    root.mkdir(parents=True)
    for i in range(11):
        img = rng.integers(0, 255, (int(rng.integers(20, 40)), int(rng.integers(20, 40)), 3), dtype=np.uint8)
        (root / f"{i}.jpg").write_bytes(simplejpeg.encode_jpeg(img, quality=90))
    index = filetree(str(tmp_path / "jpg"))

    def make(**kw):
        chain = ops.Compose([ops.decode_image(), ops.random_resized_crop(16), ops.flip(),
                             ops.normalize([127.5] * 3, [51.0] * 3)])
        return gpuio.Loader(index, 4, fields=["data", "label"], ops=[chain], shuffle=True, threads=2,
                            output="numpy", **kw)

    b = next(iter(make()))
    assert b["image"].shape == (4, 3, 16, 16) and b["image"].dtype == np.float32
    check_resume(make)


def test_bad_jpeg_in_compose_raises_and_skips(tmp_path):
    import simplejpeg

    root = tmp_path / "jpg" / "c0"
    root.mkdir(parents=True)
    for i in range(8):
        img = np.full((8, 8, 3), i * 20, dtype=np.uint8)
        (root / f"{i}.jpg").write_bytes(simplejpeg.encode_jpeg(img) if i != 5 else b"not a jpeg at all")
    index = filetree(str(tmp_path / "jpg"))
    ld = gpuio.Loader(index, 3, ops=[ops.Compose([ops.decode_image()])], output="numpy", threads=2)
    with pytest.raises(PipelineError) as info:
        list(ld)
    assert info.value.sample == 5 and info.value.path == index.extent(5).file
    ld = gpuio.Loader(index, 3, ops=[ops.Compose([ops.decode_image()])], output="numpy", threads=2,
                      on_error="skip")
    got = np.concatenate([b["index"] for b in ld])
    np.testing.assert_array_equal(got, [0, 1, 2, 3, 4, 6, 7])
    assert ld.stats()["skipped"] == 1


# ---- GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_matches_cpu(npy):
    import torch

    cpu = [host(b) for b in gpuio.Loader(npy, 4, ops=[AsArray()], shuffle=True, threads=2)]
    gpu_loader = gpuio.Loader(npy, 4, ops=[AsArray()], shuffle=True, device="cuda")
    gpu = []
    for b in gpu_loader:
        assert b["index"].is_cuda
        gpu.append(host(b))
    torch.cuda.synchronize()
    assert len(cpu) == len(gpu)
    for x, y in zip(cpu, gpu):
        assert_same_batch(x, y)
    assert not loader_threads()


@pytest.fixture
def float_npy(tmp_path):
    rng = np.random.default_rng(5)
    return npy_files(tmp_path / "f32", [rng.standard_normal((3, 7)).astype(np.float32) for _ in range(N)])


def test_shuffled_arrays_stack_as_a_view_of_the_read_buffer(float_npy, monkeypatch):
    """One file per sample, shuffled: the read plan lays the samples out in batch order,
    so the [B, ...] batch is the read buffer itself (64-byte aligned for JAX), no copy."""
    reads = []
    read = gpuio.Reader._read_rows

    def recorded(self, *args, **kwargs):
        reads.append(read(self, *args, **kwargs))
        return reads[-1]

    monkeypatch.setattr(gpuio.Reader, "_read_rows", recorded)
    batches = list(gpuio.Loader(float_npy, 8, output="numpy", shuffle=True, seed=1, threads=1))
    assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(N))
    assert len(reads) == len(batches)
    for b, rows in zip(batches, reads):
        data = b["data"]
        assert data.shape == (len(b["index"]), 3, 7) and data.dtype == np.float32
        assert all(np.shares_memory(data, row) for row in rows)
        assert data.flags.c_contiguous and data.ctypes.data % 64 == 0
        for row, i in enumerate(b["index"].tolist()):
            np.testing.assert_array_equal(data[row], np.load(float_npy.extent(i).file))


def test_read_fields_stacked_gives_the_read_buffer_or_the_rows(float_npy, tmp_path):
    """``stacked=True``: arrays of one shape and dtype come back as one [B, ...] view of
    the read buffer (what a loader with no ops hands out); mixed shapes stay a list."""
    rows = np.array([5, 0, 9, 3])
    got = gpuio.storage.read_fields(float_npy, rows, ("data",), stacked=True)["data"]
    listed = gpuio.storage.read_fields(float_npy, rows, ("data",))["data"]
    assert isinstance(got, np.ndarray) and got.shape == (4, 3, 7) and got.dtype == np.float32
    assert isinstance(listed, list) and len(listed) == 4
    for j, i in enumerate(rows.tolist()):
        want = np.load(float_npy.extent(i).file)
        np.testing.assert_array_equal(got[j], want)
        np.testing.assert_array_equal(listed[j], want)
    mixed = npy_files(tmp_path / "mixed", [np.ones((2, 3), np.float32), np.zeros((4,), np.float32)])
    both = gpuio.storage.read_fields(mixed, np.array([0, 1]), ("data",), stacked=True)["data"]
    assert isinstance(both, list) and [a.shape for a in both] == [(2, 3), (4,)]


class ReplaceFirstRow(Op):
    """Changes the batch's list of rows in place: row 0 becomes a new array, the rest reversed."""

    def __call__(self, batch):
        rows = batch.data["data"]
        rows[0] = rows[0] + 1
        rows[1:] = rows[:0:-1]
        return batch


def test_rows_changed_by_an_op_are_stacked_as_they_are(float_npy):
    b = next(iter(gpuio.Loader(float_npy, 8, ops=[ReplaceFirstRow()], output="numpy", shuffle=True, threads=1)))
    index = b["index"].tolist()
    want = [np.load(float_npy.extent(index[0]).file) + 1] + [np.load(float_npy.extent(i).file) for i in index[:0:-1]]
    np.testing.assert_array_equal(b["data"], np.stack(want))
