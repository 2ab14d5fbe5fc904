"""The storage core over real files: sizes, alignments, thread counts, O_DIRECT, errors."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

import gpuio
from gpuio.storage.buffers import BufferPool
from gpuio.errors import BufferBudgetError, ConfigError, OutOfRangeError, StorageError
from gpuio.index import Extents, SampleIndex
from gpuio.storage._posix import native_available
from gpuio.storage import Reader

from conftest import to_host

SIZES = [0, 1, 511, 4095, 4096, 4097, 100_000, 3 << 20]


@pytest.fixture(params=["native", "python"], autouse=True)
def read_loop(request):
    """Every test here runs with the C read loop and with the pure-Python one."""
    if request.param == "native" and not native_available():
        pytest.fail("the C accelerator gpuio.storage._readloop was not built: is a C compiler installed?")
    with gpuio.config.override(native=request.param == "native"):
        yield request.param


def write_files(root, sizes, seed=0):
    rng = np.random.default_rng(seed)
    paths, blobs = [], []
    for i, n in enumerate(sizes):
        p = root / f"f{i:03d}.bin"
        blob = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        p.write_bytes(blob)
        paths.append(str(p))
        blobs.append(blob)
    return paths, blobs


def file_index(paths, sizes):
    n = len(paths)
    return SampleIndex(paths, {"data": Extents(np.arange(n), np.zeros(n), np.array(sizes))})


@pytest.mark.parametrize("threads", [1, 4, 32])
@pytest.mark.parametrize("o_direct", [False, True])
def test_whole_files_every_size(tmp_path, device, threads, o_direct):
    paths, blobs = write_files(tmp_path, SIZES)
    index = file_index(paths, SIZES)
    with gpuio.config.override(io_threads=threads, o_direct=o_direct, task_size=1 << 20):
        with Reader(device) as reader:
            rows = [7, 0, 3, 3, 5, 1, 6, 2, 4]
            out = reader.read(index, rows)
    for row, arr in zip(rows, out):
        assert to_host(arr).tobytes() == blobs[row]
        assert arr.dtype == np.uint8 and arr.ndim == 1


@pytest.mark.parametrize("o_direct", [False, True])
def test_records_packed_in_one_file_unaligned(tmp_path, device, o_direct):
    rng = np.random.default_rng(1)
    blob = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "packed.bin").write_bytes(blob)
    offsets = rng.integers(0, len(blob) - 70_000, 200)
    lengths = rng.integers(0, 70_000, 200)
    index = SampleIndex([str(tmp_path / "packed.bin")],
                        {"data": Extents(np.zeros(200), offsets, lengths)})
    rows = rng.permutation(200)[:150]
    with gpuio.config.override(o_direct=o_direct, merge_gap=1000):
        with Reader(device) as reader:
            out = reader.read(index, rows)
    for row, arr in zip(rows, out):
        assert to_host(arr).tobytes() == blob[offsets[row]: offsets[row] + lengths[row]]


def test_views_share_one_batch_buffer(tmp_path):
    paths, _ = write_files(tmp_path, [100, 200, 300])
    out = gpuio.read(file_index(paths, [100, 200, 300]), [0, 1, 2])
    bases = {id(a.base) for a in out}
    assert len(bases) == 1


def test_negative_indices_and_empty_batch(tmp_path):
    paths, blobs = write_files(tmp_path, [10, 20])
    index = file_index(paths, [10, 20])
    assert gpuio.read(index, [-1])[0].tobytes() == blobs[1]
    assert gpuio.read(index, []) == []


def test_missing_file_names_path(tmp_path):
    paths, _ = write_files(tmp_path, [10, 20])
    index = file_index(paths, [10, 20])
    os.remove(paths[1])
    with pytest.raises(StorageError, match="f001.bin: cannot open: file not found") as info:
        gpuio.read(index, [0, 1])
    assert info.value.path == paths[1]


def test_paths_come_from_the_packed_table_as_the_os_takes_them(tmp_path):
    """The read loops open each file by its packed bytes: nested folders, a name that is not
    UTF-8, and a name longer than the OS takes (an error that names it, and nothing else lost)."""
    deep = tmp_path / "deep" / "er"
    deep.mkdir(parents=True)
    names = [os.fsencode(deep) + b"/caf\xe9.bin", os.fsencode(tmp_path) + b"/plain.bin"]
    blobs = [b"a" * 100, b"b" * 50]
    for name, blob in zip(names, blobs):
        with open(name, "wb") as f:
            f.write(blob)
    paths = [os.fsdecode(n) for n in names]
    index = file_index(paths, [100, 50])
    assert [bytes(d) for d in gpuio.read(index, [1, 0])] == [blobs[1], blobs[0]]
    too_long = str(tmp_path / ("x" * 200) / ("y" * 5000))
    bad = file_index(paths + [too_long], [100, 50, 10])
    with pytest.raises(StorageError, match="cannot open") as info:
        gpuio.read(bad, [0, 2, 1])
    assert info.value.path == too_long
    assert [bytes(d) for d in gpuio.read(bad, [0, 1])] == blobs


def test_truncated_file_names_path_and_offset(tmp_path, device):
    paths, _ = write_files(tmp_path, [5000, 20])
    index = file_index(paths, [5000, 20])
    os.truncate(paths[0], 1234)
    with Reader(device) as reader, pytest.raises(StorageError, match="at byte 1234: file ends before") as info:
        reader.read(index, [1, 0])
    assert info.value.path == paths[0] and info.value.offset == 1234


def test_permission_denied(tmp_path):
    paths, _ = write_files(tmp_path, [10])
    os.chmod(paths[0], 0)
    index = file_index(paths, [10])
    if os.geteuid() != 0:
        with pytest.raises(StorageError, match="permission denied"):
            gpuio.read(index, [0])
        return
    # Root reads any file: read in a forked child that drops to user nobody.
    os.chmod(tmp_path, 0o755)
    os.chmod(tmp_path.parent, 0o755)
    os.chmod(tmp_path.parent.parent, 0o755)
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        message = b"no error"
        try:
            with Reader("cpu", threads=1) as reader:  # imports done before losing /root
                os.setgid(65534)
                os.setuid(65534)
                reader.read(index, [0])
        except Exception as exc:  # reported to the parent through the pipe
            message = f"{type(exc).__name__}: {exc}".encode()
        finally:
            os.write(wr, message)
            os._exit(0)
    os.close(wr)
    os.waitpid(pid, 0)
    with os.fdopen(rd, "rb") as f:
        message = f.read().decode()
    assert message == f"StorageError: {paths[0]}: cannot open: permission denied"


def test_directory_in_place_of_file(tmp_path):
    (tmp_path / "d").mkdir()
    index = SampleIndex([str(tmp_path / "d")], {"data": Extents([0], [0], [10])})
    with pytest.raises(StorageError, match="d: ") as info:
        gpuio.read(index, [0])
    assert info.value.path == str(tmp_path / "d")


def test_out_of_range_and_bad_field(tmp_path):
    paths, _ = write_files(tmp_path, [10])
    index = file_index(paths, [10])
    with pytest.raises(OutOfRangeError, match="sample 5 out of range"):
        gpuio.read(index, [5])
    with pytest.raises(ConfigError, match="unknown field"):
        gpuio.read(index, [0], field="label")
    with pytest.raises(ConfigError, match="1-D"):
        gpuio.read(index, [[0]])


def test_no_threads_left_after_close(tmp_path):
    paths, _ = write_files(tmp_path, [1000] * 20)
    before = set(threading.enumerate())
    with Reader("cpu", threads=8) as reader:
        reader.read(file_index(paths, [1000] * 20), range(20))
    assert set(threading.enumerate()) <= before


def test_handle_cache_bounds_open_files_and_never_closes_one_in_use(tmp_path):
    from gpuio.storage._handles import HandleCache

    paths, _ = write_files(tmp_path, [10] * 6)
    closed = []
    cache = HandleCache(lambda p: os.open(p, os.O_RDONLY),
                        lambda fd: (closed.append(fd), os.close(fd)), capacity=2)
    busy = cache.acquire(paths[0])
    for p in paths[1:]:
        cache.release(p, cache.acquire(p))
    assert len(cache._entries) <= 2
    assert busy not in closed  # evicted while in use: still open
    assert os.pread(busy, 10, 0) == open(paths[0], "rb").read()
    cache.release(paths[0], busy)
    assert busy in closed
    again = cache.acquire(paths[5])
    assert cache.acquire(paths[5]) == again  # cached handle shared
    cache.release(paths[5], again)
    cache.release(paths[5], again)
    cache.close()
    assert len(closed) == 6


def test_files_with_many_records_share_one_descriptor(tmp_path):
    blob = np.random.default_rng(3).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
    (tmp_path / "r.bin").write_bytes(blob)
    offs = np.arange(0, 1 << 16, 1 << 10)
    index = SampleIndex([str(tmp_path / "r.bin")], {"data": Extents(np.zeros(64), offs, np.full(64, 100))})
    with gpuio.config.override(merge_gap=0), Reader("cpu", threads=8) as reader:
        out = reader.read(index, range(64))
    assert [a.tobytes() for a in out] == [blob[o: o + 100] for o in offs]
    # counted by target, not in all: other libraries in the process (a Ray driver) hold descriptors too
    opened = [fd for fd in os.listdir("/proc/self/fd")
              if _fd_target(fd) == str(tmp_path / "r.bin")]
    assert len(opened) <= 1


def _fd_target(fd: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed since it was listed
        return None


def test_pool_reuses_buffers_and_enforces_budget():
    pool = BufferPool(budget=1 << 20, wait_s=0.2)
    lease = pool.acquire(300_000)
    first = lease.array.ctypes.data
    del lease
    gc.collect()
    again = pool.acquire(290_000)
    assert again.array.ctypes.data == first  # reused
    assert pool.held_bytes <= 1 << 20
    with pytest.raises(BufferBudgetError, match=r"2,000,000 bytes was requested.*1,048,576"):
        pool.acquire(2_000_000)
    hold = [again, pool.acquire(400_000)]
    with pytest.raises(BufferBudgetError, match="stay in use"):
        pool.acquire(500_000)
    del hold, again
    gc.collect()
    assert pool.acquire(500_000).nbytes == 500_000


def test_buffer_stays_valid_while_views_live(tmp_path):
    paths, blobs = write_files(tmp_path, [1000, 2000])
    index = file_index(paths, [1000, 2000])
    pool = BufferPool(budget=1 << 30)
    with Reader("cpu", pool=pool) as reader:
        keep = reader.read(index, [0])[0]
        for _ in range(5):
            reader.read(index, [1])
        assert keep.tobytes() == blobs[0]


def test_index_getitem_reads_synchronously(tmp_path):
    paths, blobs = write_files(tmp_path, [10, 20])
    index = SampleIndex(paths, {"data": Extents([0, 1], [0, 0], [10, 20])}, {"label": np.array([3, 4])})
    assert index[1] == {"data": blobs[1], "label": 4}
    assert index.extent(1) == gpuio.Extent(paths[1], 0, 20)


def test_cuda_device_without_gpu_is_a_clear_error():
    if gpuio.gpu_count():
        pytest.skip("this machine has a GPU")
    with pytest.raises(gpuio.errors.DeviceError, match="no NVIDIA GPU"):
        Reader("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["posix", "kvikio"])
@pytest.mark.parametrize("compat", ["auto", "on"])
def test_gpu_backends_agree_with_cpu(tmp_path, backend, compat):
    """posix lands in pinned host memory and copies once; kvikio reads with cuFile."""
    import cupy

    paths, blobs = write_files(tmp_path, SIZES)
    index = file_index(paths, SIZES)
    rows = [7, 0, 3, 6, 5, 1, 2, 4]
    cpu = gpuio.read(index, rows)
    with gpuio.config.override(kvikio_compat=compat, task_size=1 << 20):
        with Reader("cuda", backend=backend) as reader:
            for _ in range(2):  # the second batch reuses cached handles and buffers
                out = reader.read(index, rows)
                assert all(isinstance(a, cupy.ndarray) for a in out)
                assert [cupy.asnumpy(a).tobytes() for a in out] == [c.tobytes() for c in cpu]


def test_gpuio_read_keeps_few_readers_alive(tmp_path):
    """Each distinct setting makes a reader for gpuio.read; only the last four are kept,
    and the threads of the others end."""
    import gc
    import threading

    def reader_threads():
        return [t for t in threading.enumerate() if t.name.startswith("gpuio-read")]

    paths, blobs = write_files(tmp_path, [200_000] * 16)
    index = file_index(paths, [200_000] * 16)
    peak = 0
    for threads in range(2, 24):
        with gpuio.config.override(io_threads=threads):
            assert gpuio.read(index, range(16))[3].tobytes() == blobs[3]
        peak = max(peak, len(reader_threads()))
    gc.collect()
    helpers = max(1, (os.cpu_count() or 1) - 1)  # cached copies: one lane per core
    deadline = time.monotonic() + 30  # a dropped reader's threads end after its last task
    while len(reader_threads()) > 4 * helpers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(reader_threads()) <= 4 * helpers
    if (os.cpu_count() or 1) > 1:
        assert peak > 0, "the reads ran on reader threads"


@pytest.mark.parametrize("o_direct", [False, True])
def test_large_extents_read_as_a_few_parts(tmp_path, o_direct):
    """Long unaligned extents of odd sizes, split into about read_parts tasks of a
    multiple of task_size, read exactly, with and without O_DIRECT."""
    sizes = [(5 << 20) + 4097, (3 << 20) + 1, 777]
    paths, blobs = write_files(tmp_path, sizes)
    offsets = np.array([1000, 4095, 3])
    index = SampleIndex(paths, {"data": Extents(np.arange(3), offsets, np.array(sizes) - offsets)})
    with gpuio.config.override(o_direct=o_direct, task_size=1 << 20, read_parts=3, io_threads=4):
        with Reader("cpu") as reader:
            out = reader.read(index, [1, 0, 2])
    assert [a.tobytes() for a in out] == [blobs[i][offsets[i]:] for i in (1, 0, 2)]


def drop_from_page_cache(paths):
    """Flush and evict the files' pages; the number of their pages still cached after (by
    cachestat), or None where the kernel cannot say."""
    from gpuio.storage._posix import cached_pages

    left = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            pages = cached_pages(fd, 0, os.path.getsize(path))
        finally:
            os.close(fd)
        if pages is None:
            return None
        left += pages
    return left


def test_file_pages_by_path_agrees_with_cachestat_on_a_descriptor(tmp_path):
    """The cold check's page count of a file range by path is what ``cached_pages``
    counts on an open descriptor, and None for a file that does not open."""
    from gpuio.storage._posix import PosixBackend, cached_pages

    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(10 * 4096 + 5))
    path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        expected = cached_pages(fd, 100, 9 * 4096)
    finally:
        os.close(fd)
    backend = PosixBackend()
    assert backend._file_pages(str(path), 100, 9 * 4096) == expected
    assert expected is None or expected >= 9  # the range spans 10 pages, all just read
    assert backend._file_pages(str(tmp_path / "missing"), 0, 10) is None


def test_readers_on_many_threads_at_once(tmp_path):
    """Readers on several threads read at the same time (in C, their batches share one
    pool of helper threads); each gets its own files' bytes."""
    sizes = [300_000 + 4099 * i for i in range(24)]
    paths, blobs = write_files(tmp_path, sizes)
    index = file_index(paths, sizes)
    failures = []

    def read_many(first):
        try:
            with Reader("cpu", threads=4) as reader:
                for r in range(6):
                    rows = [(first + r + 5 * j) % len(sizes) for j in range(8)]
                    got = reader.read(index, rows)
                    if [a.tobytes() for a in got] != [blobs[i] for i in rows]:
                        failures.append((first, r))
        except Exception as exc:  # reported below, with the thread's rows
            failures.append((first, exc))

    threads = [threading.Thread(target=read_many, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_cold_check_of_long_reads_looks_at_their_middle(tmp_path):
    """Of a long read the cold check looks up the middle MiB only: a file whose head the
    page cache holds (as after an index read its header) is still read around the cache,
    and one whose middle it holds is copied from the cache."""
    from gpuio.storage._posix import _DIRECT_PROBE

    size = 32 * _DIRECT_PROBE
    paths, _ = write_files(tmp_path, [size])
    files = SampleIndex(paths, {"data": Extents(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([size]))}).files
    plan = gpuio.storage.plan.build_plan(np.arange(1), np.zeros(1, np.int64), np.array([size]), task_size=size)
    assert drop_from_page_cache(paths) == 0, "this filesystem keeps no page cache to look up (tmpfs?)"
    with Reader("cpu") as reader, open(paths[0], "rb") as f:
        f.read(_DIRECT_PROBE)  # the head, with the kernel's readahead after it
        assert reader.backend.reads_cold_direct(plan, files)
        f.seek(size // 2 - _DIRECT_PROBE)
        f.read(2 * _DIRECT_PROBE)
        assert not reader.backend.reads_cold_direct(plan, files)


def test_cold_large_reads_go_around_the_page_cache(tmp_path):
    """A batch of long reads that the page cache does not hold is read with O_DIRECT (it
    stays out of the page cache), unaligned extents of odd sizes exactly; once the files
    are cached, the same batch is copied from the page cache."""
    from gpuio.storage._posix import cached_pages

    sizes = [(5 << 20) + 4097, (3 << 20) + 1]
    paths, blobs = write_files(tmp_path, sizes)
    offsets = np.array([1000, 4095])
    index = SampleIndex(paths, {"data": Extents(np.arange(2), offsets, np.array(sizes) - offsets)})
    expected = [blobs[1][offsets[1]:], blobs[0][offsets[0]:]]
    cold = drop_from_page_cache(paths) == 0  # False where cachestat or the drop is missing (tmpfs)
    with gpuio.config.override(task_size=1 << 20, io_threads=4), Reader("cpu") as reader:
        plan = gpuio.storage.plan.build_plan(np.arange(2), offsets, np.array(sizes) - offsets, task_size=1 << 20)
        assert reader.backend.reads_cold_direct(plan, index.files) == cold
        assert [a.tobytes() for a in reader.read(index, [1, 0])] == expected
        if cold:
            fd = os.open(paths[0], os.O_RDONLY)
            assert cached_pages(fd, 0, sizes[0]) < 8  # read around the page cache
            os.close(fd)
        for p in paths:
            with open(p, "rb") as f:
                f.read()
        assert not reader.backend.reads_cold_direct(plan, index.files)
        assert [a.tobytes() for a in reader.read(index, [1, 0])] == expected
    with gpuio.config.override(cold_direct=False), Reader("cpu") as reader:
        drop_from_page_cache(paths)
        assert [a.tobytes() for a in reader.read(index, [1, 0])] == expected
        fd = os.open(paths[0], os.O_RDONLY)
        assert cached_pages(fd, 0, sizes[0]) > 1000 or not cold  # through the page cache
        os.close(fd)


def test_cold_small_files_go_around_the_page_cache_short_records_do_not(tmp_path):
    """Files of 100 KB, odd sizes, cold: read with O_DIRECT (they stay uncached); reads of
    a few KiB (records) stay buffered."""
    from gpuio.storage._posix import cached_pages

    sizes = [100_000 + 37 * i for i in range(12)]
    paths, blobs = write_files(tmp_path, sizes)
    index = file_index(paths, sizes)
    cold = drop_from_page_cache(paths) == 0
    with Reader("cpu") as reader:
        rows = [5, 0, 11, 3, 3, 7]
        assert [a.tobytes() for a in reader.read(index, rows)] == [blobs[r] for r in rows]
        left = []
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            left.append(cached_pages(fd, 0, os.path.getsize(p)))
            os.close(fd)
        assert left[5] == left[0] == 0 or not cold
        short = gpuio.storage.plan.build_plan(np.arange(12), np.zeros(12), np.full(12, 8000))
        assert not reader.backend.reads_cold_direct(short, index.files)


@pytest.mark.parametrize("mode", ["buffered", "o_direct", "cold"])
def test_large_extent_of_a_truncated_file_names_path_and_offset(tmp_path, mode):
    """A file shorter than the index says, read in several parts: the error names the
    file and the byte where it ends."""
    paths, _ = write_files(tmp_path, [6 << 20])
    index = file_index(paths, [6 << 20])
    os.truncate(paths[0], (3 << 20) + 123)
    if mode == "cold":
        drop_from_page_cache(paths)
    with gpuio.config.override(o_direct=mode == "o_direct", task_size=1 << 20, read_parts=3):
        with Reader("cpu") as reader, pytest.raises(StorageError, match="file ends before") as info:
            reader.read(index, [0])
    assert info.value.path == paths[0] and info.value.offset == (3 << 20) + 123


def test_o_direct_reads_skip_the_page_cache_pass(tmp_path, read_loop, monkeypatch):
    """Under O_DIRECT a read with RWF_NOWAIT waits for the disk, so the first pass (one
    thread per core, meant for page-cache copies) is skipped: io_threads read it all."""
    from gpuio.storage._posix import PosixBackend

    paths, blobs = write_files(tmp_path, [100_000] * 8)
    phases = []
    run_phase = PosixBackend._run_phase
    monkeypatch.setattr(PosixBackend, "_run_phase",
                        lambda self, *args, nowait, workers: phases.append(nowait) or run_phase(
                            self, *args, nowait=nowait, workers=workers))
    for o_direct in (True, False):
        with gpuio.config.override(o_direct=o_direct), Reader("cpu") as reader:
            assert [a.tobytes() for a in reader.read(file_index(paths, [100_000] * 8), range(8))] == blobs
    if read_loop == "native":
        assert phases == [False, True]  # O_DIRECT: one blocking pass; buffered (cached files): the copy pass


def test_read_ahead_buffers_give_way_to_a_batch_that_does_not_take_them(tmp_path):
    """Where a batch's own buffer would wait for room in the pool, the read-ahead's buffers
    that it does not take go back first (a cold file read in order, then a cached one,
    in a pool the read-ahead filled)."""
    sizes = [16 << 20, 8 << 20]
    paths, blobs = write_files(tmp_path, sizes)
    record, n = 128 << 10, 128
    cold = SampleIndex(paths[:1], {"data": Extents(np.zeros(n), np.arange(n) * record, np.full(n, record))})
    if drop_from_page_cache(paths[:1]) != 0:
        pytest.fail("the page cache of the test's folder cannot be dropped or looked at (cachestat)")
    with open(paths[1], "rb") as f:
        f.read()  # cached: read through the page cache, not ahead
    with gpuio.config.override(read_ahead=32 << 20), Reader("cpu", pool=BufferPool(40 << 20, wait_s=1)) as reader:
        assert [a.tobytes() for a in reader.read(cold, range(16))] == [
            blobs[0][k * record:(k + 1) * record] for k in range(16)]
        assert reader.read_ahead_batches == 1
        assert [a.tobytes() for a in reader.read(file_index(paths[1:], sizes[1:]), [0])] == [blobs[1]]


def test_a_batch_taken_from_the_read_ahead_stats_its_file_once(tmp_path, monkeypatch):
    """Batches read in order with O_DIRECT are taken from the read-ahead with one stat of
    their file each (the stamp checked as a batch is taken serves the read-ahead after it)."""
    record, n, batch = 8 << 10, 256, 16
    paths, blobs = write_files(tmp_path, [record * n])
    index = SampleIndex(paths, {"data": Extents(np.zeros(n), np.arange(n) * record, np.full(n, record))})
    stats = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: (stats.append(str(path)), real_stat(path, *a, **k))[1])
    with gpuio.config.override(o_direct=True, read_ahead=1 << 20), Reader("cpu") as reader:
        for start in range(0, n, batch):
            rows = np.arange(start, start + batch)
            assert b"".join(a.tobytes() for a in reader.read(index, rows)) == blobs[0][start * record:
                                                                                       (start + batch) * record]
            if start == 0:
                stats.clear()
        assert reader.read_ahead_batches == n // batch
    assert stats.count(paths[0]) == n // batch - 1


def test_the_read_ahead_keeps_room_for_a_batchs_own_buffers_and_gives_way(tmp_path, device):
    """In a pool the read-ahead could fill, batches read in order with O_DIRECT (on a GPU
    through host memory and copied into a device buffer of the same pool), each with a
    buffer of its size taken beside it (as a device copy takes), never wait: the read-ahead
    leaves their room. A buffer of most of the budget, asked for outside any reader, makes
    the read-ahead give its buffers back."""
    record, n, batch = 64 << 10, 256, 16
    paths, blobs = write_files(tmp_path, [record * n])
    index = SampleIndex(paths, {"data": Extents(np.zeros(n), np.arange(n) * record, np.full(n, record))})
    pool = BufferPool(8 << 20, wait_s=1)
    with gpuio.config.override(o_direct=True, read_ahead=32 << 20), \
            Reader(device, backend="posix", pool=pool) as reader:
        for start in range(0, n, batch):
            got = reader.read(index, np.arange(start, start + batch))
            beside = pool.acquire(batch * record, device)
            assert b"".join(to_host(a).tobytes() for a in got) == blobs[0][start * record:(start + batch) * record]
            del got, beside
            if start == n // 2:
                assert reader.read_ahead_batches == start // batch + 1
                assert pool.acquire(7 << 20).nbytes == 7 << 20
        assert reader.read_ahead_batches >= n // batch - 1



def _disk_bytes_read():
    """Bytes this process has read from the disk (not from the page cache)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])

def test_close_does_not_read_the_read_ahead_it_drops(tmp_path):
    """A Reader closed after one batch read in order with O_DIRECT cancels the read-ahead's
    pieces not started: the process reads far fewer bytes of the disk than were queued."""
    record, n, batch = 64 << 10, 512, 16
    paths, blobs = write_files(tmp_path, [record * n])
    index = SampleIndex(paths, {"data": Extents(np.zeros(n), np.arange(n) * record, np.full(n, record))})

    before = _disk_bytes_read()
    with gpuio.config.override(o_direct=True, read_ahead=32 << 20, task_size=64 << 10), Reader("cpu") as reader:
        assert b"".join(a.tobytes() for a in reader.read(index, np.arange(batch))) == blobs[0][:batch * record]
        assert reader.read_ahead_batches == 1
    assert _disk_bytes_read() - before < (16 << 20)  # of 32 MiB queued


def test_batches_in_order_that_fit_no_read_ahead_buffer_are_copied_from_its_stretches(tmp_path):
    """Batches of 16 records of 1 to 100 KiB read in order with O_DIRECT: a batch that the
    queued stretches hold but whose span fits no stretch's buffer is copied from them into
    a buffer of its own, and the read-ahead goes on, where each such batch started it again
    from its own records (reading what was queued and in flight again): the pass takes
    every batch from the read-ahead and reads the file's bytes from the disk once."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1 << 10, 100 << 10, 1024)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    paths, blobs = write_files(tmp_path, [int(lengths.sum())])
    index = SampleIndex(paths, {"data": Extents(np.zeros(len(lengths)), offsets, lengths)})

    before = _disk_bytes_read()
    with gpuio.config.override(o_direct=True, read_ahead=8 << 20, task_size=1 << 20), Reader("cpu") as reader:
        for start in range(0, len(lengths), 16):
            rows = np.arange(start, min(start + 16, len(lengths)))
            got = reader.read(index, rows)
            assert [a.tobytes() for a in got] == [blobs[0][offsets[r]:offsets[r] + lengths[r]] for r in rows]
        taken = reader.read_ahead_batches
    assert taken == len(lengths) // 16
    assert _disk_bytes_read() - before < 1.1 * lengths.sum()


def test_batches_copied_from_the_read_ahead_in_a_tight_pool_get_their_bytes(tmp_path):
    """A first batch of small records sets the read-ahead's stretches; the next batches, of
    larger records, fit no stretch's buffer, and their own buffers would be copied from the
    stretches: where the pool has no room for one without waiting (the stretches it copies
    from hold the room), the batch is read as it is, and every batch gets its bytes."""
    lengths = np.array([4 << 10] * 16 + [64 << 10] * 240)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    paths, blobs = write_files(tmp_path, [int(lengths.sum())])
    index = SampleIndex(paths, {"data": Extents(np.zeros(len(lengths)), offsets, lengths)})
    for budget in (4 << 20, 64 << 20):
        with gpuio.config.override(o_direct=True, read_ahead=16 << 20, task_size=256 << 10), \
                Reader("cpu", pool=BufferPool(budget, wait_s=2)) as reader:
            for start in range(0, len(lengths), 16):
                rows = np.arange(start, start + 16)
                got = reader.read(index, rows)
                assert [a.tobytes() for a in got] == [blobs[0][offsets[r]:offsets[r] + lengths[r]] for r in rows]
            assert reader.read_ahead_batches >= (1 if budget == 4 << 20 else len(lengths) // 16)
