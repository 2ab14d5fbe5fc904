"""Storage benchmark: gpuio's batched reads against the simple ways, and the ceilings.

Three datasets: many small files (about 100 KB each), a few large files, and records
packed in one file. For each, warm and cold page cache, it times gpuio, a naive Python
loop (``open().read()`` per file or ``seek``/``read`` per record) and ``np.fromfile``,
and measures the ceiling in the same run: the fastest of one sequential ``readinto`` of
the same bytes laid out in one file, those bytes read by ``io_threads`` threads at once,
4 MiB per read, and those bytes read with O_DIRECT in ``read_parts`` parallel reads (as
gpuio reads a cold batch). With a GPU it adds gpuio into GPU memory, per-file kvikio reads,
``torch.from_numpy(np.fromfile(...)).cuda()`` and the pinned host-to-device bandwidth.

``--npy`` times a NumPy dataset of large arrays instead: ``.npy`` files of 128 MiB (in
``full``), one ``gpuio.read`` call per file, against one sequential ``readinto`` of each.
A read from a warm page cache is a copy from memory to memory, so there the ceiling also
counts a copy of the same number of bytes from one buffer in memory to another, by one
thread and by as many threads as cores: the machine's memory bandwidth caps every warm
read at that figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

import gpuio
from gpuio.bench._chart import Group, write_chart
from gpuio.formats import numpy as npy_index
from gpuio.bench._common import best_time, cache_dir, drop_cache, machine, print_table, write_json
from gpuio.index import Extents, SampleIndex

SIZES = {  # name: (small files, small size, large files, large size, records, record size)
    "full": (4000, 100_000, 4, 256 << 20, 16384, 16 << 10),
    "quick": (1000, 100_000, 2, 32 << 20, 2048, 16 << 10),
    "tiny": (50, 10_000, 2, 1 << 20, 100, 1000),  # for tests of the bench itself
}
NPY_SIZES = {"full": (4, 128 << 20), "quick": (2, 32 << 20), "tiny": (2, 1 << 20)}  # name: (files, array bytes)


def _write(path: str, nbytes: int, block: np.ndarray, shift: int) -> None:
    with open(path, "wb") as f:
        left = nbytes
        while left:
            piece = block[shift % 4096: shift % 4096 + min(left, len(block) - 4096)]
            f.write(piece)
            left -= len(piece)
            shift += 1
        f.flush()
        os.fsync(f.fileno())  # clean pages can be dropped for the cold runs


def make_datasets(root: str, size: str = "full", seed: int = 0) -> dict[str, SampleIndex]:
    """Create (once) and index the three datasets under ``root``."""
    n_small, s_small, n_large, s_large, n_rec, s_rec = SIZES[size]
    root = os.path.join(root, f"storage-{size}")
    marker = os.path.join(root, "done.json")
    rng = np.random.default_rng(seed)
    small_sizes = rng.integers(s_small * 7 // 10, s_small * 13 // 10, n_small)
    rec_sizes = rng.integers(s_rec // 2, s_rec * 3 // 2, n_rec)
    if not os.path.exists(marker):
        from tqdm import tqdm

        block = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
        for sub in ("small", "large", "packed", "ceiling"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
        jobs = [(os.path.join(root, "small", f"{i:06d}.bin"), int(n)) for i, n in enumerate(small_sizes)]
        jobs += [(os.path.join(root, "large", f"{i:02d}.bin"), s_large) for i in range(n_large)]
        jobs += [(os.path.join(root, "packed", "records.bin"), int(rec_sizes.sum())),
                 (os.path.join(root, "ceiling", "small.bin"), int(small_sizes.sum()))]
        for k, (path, nbytes) in enumerate(tqdm(jobs, desc="writing storage dataset", unit="file")):
            _write(path, nbytes, block, k)
        with open(marker, "w") as f:
            json.dump({"size": size, "seed": seed}, f)
    small = [os.path.join(root, "small", f"{i:06d}.bin") for i in range(n_small)]
    large = [os.path.join(root, "large", f"{i:02d}.bin") for i in range(n_large)]
    rec_offsets = np.concatenate([[0], np.cumsum(rec_sizes)[:-1]])
    return {
        "small": SampleIndex(small, {"data": Extents(np.arange(n_small), np.zeros(n_small), small_sizes)}),
        "large": SampleIndex(large, {"data": Extents(np.arange(n_large), np.zeros(n_large),
                                                     np.full(n_large, s_large))}),
        "packed": SampleIndex([os.path.join(root, "packed", "records.bin")],
                              {"data": Extents(np.zeros(n_rec), rec_offsets, rec_sizes)}),
        "_ceiling_small": os.path.join(root, "ceiling", "small.bin"),
    }


def make_npy(root: str, size: str = "full") -> SampleIndex:
    """Create (once) and index ``.npy`` files of one uint8 array each."""
    count, nbytes = NPY_SIZES[size]
    root = os.path.join(root, f"storage-npy-{size}")
    os.makedirs(root, exist_ok=True)
    paths = [os.path.join(root, f"{i:02d}.npy") for i in range(count)]
    block = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    for k, path in enumerate(paths):
        if not os.path.exists(path):
            with open(path + ".tmp", "wb") as f:
                np.save(f, np.resize(np.roll(block, k), nbytes))
                f.flush()
                os.fsync(f.fileno())  # clean pages can be dropped for the cold runs
            os.replace(path + ".tmp", path)
    return npy_index(paths)


def run_npy(root: str | None = None, size: str = "full", repeat: int = 3,
            caches: tuple[str, ...] = ("warm", "cold"), out: str | None = None) -> dict[str, Any]:
    """Large ``.npy`` files, one ``gpuio.read`` call per file (a NumPy dataset of large
    arrays); baseline: one sequential ``readinto`` of each file."""
    index = make_npy(root or cache_dir(), size)
    paths = index.files.many(np.arange(len(index.files)))
    rows = measure("large .npy, one call per file", index, paths, batch=1, repeat=repeat, caches=caches,
                   baseline=SEQUENTIAL, memory_bound=True)
    print("baseline: one sequential readinto per file; gpuio: one gpuio.read call per file")
    return report(f"gpuio storage benchmark, .npy files ({size})", rows, out, {"size": size})


def _batches(n: int, batch: int, order: np.ndarray) -> list[np.ndarray]:
    return [order[i: i + batch] for i in range(0, n, batch)]


def _each(index: SampleIndex, batches: list[np.ndarray], device: str = "cpu") -> None:
    """Read batch after batch, each dropped before the next as a training loop does, with
    a new Reader (none of its read-ahead is left from an earlier run, before a cache drop)."""
    with gpuio.Reader(device) as reader:
        for b in batches:
            reader.read(index, b)


def _naive_files(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            f.read()


def _fromfile_files(paths: list[str]) -> None:
    for p in paths:
        np.fromfile(p, dtype=np.uint8)


def _naive_records(path: str, offsets: list[int], lengths: list[int]) -> None:
    with open(path, "rb") as f:
        for off, n in zip(offsets, lengths):
            f.seek(off)
            f.read(n)


def _fromfile_records(path: str, offsets: list[int], lengths: list[int]) -> None:
    for off, n in zip(offsets, lengths):
        np.fromfile(path, dtype=np.uint8, count=n, offset=off)


def concat_files(paths: list[str], out: str) -> str:
    """Write the files one after the other into ``out`` (once): the bytes of a file
    tree as one file, for the sequential-read ceiling."""
    total = sum(os.path.getsize(p) for p in paths)
    if not os.path.exists(out) or os.path.getsize(out) != total:
        from tqdm import tqdm

        with open(out + ".tmp", "wb") as dst:
            for p in tqdm(paths, desc="one file of the same bytes, for the ceiling", unit="file", leave=False):
                with open(p, "rb") as src:
                    dst.write(src.read())
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(out + ".tmp", out)
    return out


# The ceiling of a dataset is the fastest of these reads of its bytes laid out in one file.
SEQUENTIAL, PARALLEL, PARTS = "sequential readinto", "parallel 4 MiB reads", "read_parts reads"
DIRECT, DIRECT_DEEP = "O_DIRECT, read_parts reads", "O_DIRECT 1 MiB reads"  # deep: io_threads in flight
# With a warm page cache (--npy) the ceiling also counts copies of the same bytes within memory.
MEMORY_ONE, MEMORY_ALL = "memory copy, 1 thread", f"memory copy, {os.cpu_count()} threads"
# A cold row counts as failed when it beats its ceiling by more than this: the best rounds
# of two methods come from different minutes of a disk whose speed drifts, while a read
# from memory would be several times faster.
DRIFT = 1.15


def _padded(nbytes: int, direct: bool) -> int:
    return (nbytes + 4095) // 4096 * 4096 if direct else nbytes


def _parallel(paths: list[str], buf: np.ndarray, pool: ThreadPoolExecutor, chunk: int = 4 << 20,
              direct: bool = False) -> None:
    """The files read into one buffer by the pool's threads at once, ``chunk`` bytes per
    read: large reads at the queue depth gpuio uses (one thread's sequential reads keep
    fewer requests in flight; on small files the kernel's readahead may serve them better).
    ``direct``: with O_DIRECT, around the page cache as gpuio reads cold batches (each file
    at a page-aligned place in ``buf``, which must be page-aligned)."""
    view = memoryview(buf)
    jobs, pos = [], 0
    for p in paths:
        size = os.path.getsize(p)
        jobs += [(p, off, pos + off, _padded(min(chunk, size - off), direct)) for off in range(0, size, chunk)]
        pos += _padded(size, direct)
    fds = {p: os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p in paths}
    try:
        list(pool.map(lambda job: os.preadv(fds[job[0]], [view[job[2]: job[2] + job[3]]], job[1]), jobs))
    finally:
        for fd in fds.values():
            os.close(fd)


def _copy(src: np.ndarray, dst: np.ndarray, pool: ThreadPoolExecutor | None = None, shares: int = 1) -> None:
    """``src`` into the front of ``dst``, in ``shares`` contiguous parts on ``pool``'s
    threads (NumPy's copy releases the GIL)."""
    cuts = np.linspace(0, len(src), shares + 1).astype(int).tolist()

    def copy(part: tuple[int, int]) -> None:
        np.copyto(dst[part[0]: part[1]], src[part[0]: part[1]])

    parts = list(itertools.pairwise(cuts))
    list(pool.map(copy, parts) if pool is not None else map(copy, parts))


def _takes_direct(path: str) -> bool:
    """Whether the file's filesystem opens it with O_DIRECT (tmpfs may not)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


def _sequential(paths: list[str], buf: np.ndarray) -> None:
    """One thread reading the files front to back into one buffer."""
    view = memoryview(buf)
    pos = 0
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view[pos: pos + (64 << 20)])
                if not n:
                    break
                pos += n


RESIDENT_LIMIT = 0.01  # fraction of pages that may stay cached after a drop for a cold run to count


def measure(name: str, index: SampleIndex, ceiling_paths: list[str], *, batch: int = 256,
            repeat: int = 3, caches: tuple[str, ...] = ("warm", "cold"), packed: bool = False,
            baseline: str = "naive loop", memory_bound: bool = False,
            more: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Time every method over one dataset (one sample per file unless ``packed``).

    Methods run in ``repeat`` rounds, each round starting with the next method, and
    each keeps its best time; ``median round vs baseline`` is the median over rounds of
    the baseline's time in that round over the method's (the disk drifts between rounds).
    Before every cold run the files are flushed and dropped from the page cache, and the
    drop is checked; a cold row whose drop did not take, or that beats its own ceiling
    (the fastest of a sequential, a parallel and an O_DIRECT read of the same bytes in one
    file) by more than ``DRIFT``, is a failed measurement: it carries ``failed`` (the
    reason) instead of figures. ``memory_bound``: the warm ceiling also counts copies of
    the same bytes within memory (``MEMORY_ONE``, ``MEMORY_ALL``). ``more``: other ways of
    gpuio's to time alongside, ``{name: function}``, judged as ``gpuio``'s."""
    from tqdm import tqdm

    ext = index.extents["data"]
    paths = index.files.many(np.arange(len(index.files)))
    total, n = int(ext.length.sum()), len(index)
    order = np.random.default_rng(1).permutation(n) if packed else np.arange(n)
    batches = _batches(n, batch, order)
    offsets, lengths = ext.offset[order].tolist(), ext.length[order].tolist()
    # page-aligned for O_DIRECT and huge-page backed as gpuio's buffers are (with 4 KiB
    # pages, the kernel pins many more pages per O_DIRECT read, which would hold the
    # ceiling's direct reads below gpuio's own). Private, as gpuio's: a shared anonymous
    # mapping is shmem, whose huge pages are off by default, so MADV_HUGEPAGE would not take
    seq_mem = mmap.mmap(-1, max(4096, sum(_padded(os.path.getsize(p), True) for p in ceiling_paths)),
                        flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        seq_mem.madvise(mmap.MADV_HUGEPAGE)
    seq_buf = np.frombuffer(seq_mem, dtype=np.uint8)
    bounds = ((SEQUENTIAL, PARALLEL, PARTS) + ((DIRECT, DIRECT_DEEP) if _takes_direct(ceiling_paths[0]) else ())
              if ceiling_paths else ())
    all_files = list(dict.fromkeys(paths + ceiling_paths))
    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(gpuio.config.get("io_threads")) as pool:
        methods = {
            "gpuio": lambda: _each(index, batches),
            **(more or {}),
            "naive loop": (lambda: _naive_records(paths[0], offsets, lengths)) if packed
            else (lambda: _naive_files(paths)),
            "np.fromfile": (lambda: _fromfile_records(paths[0], offsets, lengths)) if packed
            else (lambda: _fromfile_files(paths)),
        }
        if bounds:
            methods[SEQUENTIAL] = lambda: _sequential(ceiling_paths, seq_buf)
            methods[PARALLEL] = lambda: _parallel(ceiling_paths, seq_buf, pool)
            parts_chunk = _padded(-(-len(seq_buf) // gpuio.config.get("read_parts")), True)
            methods[PARTS] = lambda: _parallel(ceiling_paths, seq_buf, pool, parts_chunk)
        if DIRECT in bounds:
            methods[DIRECT] = lambda: _parallel(ceiling_paths, seq_buf, pool, parts_chunk, direct=True)
            methods[DIRECT_DEEP] = lambda: _parallel(ceiling_paths, seq_buf, pool, 1 << 20, direct=True)
        memory = (MEMORY_ONE, MEMORY_ALL) if memory_bound and "warm" in caches else ()
        if memory:
            src = np.ones(total, np.uint8)  # written: its pages are in memory before the first copy
            methods[MEMORY_ONE] = lambda: _copy(src, seq_buf)
            methods[MEMORY_ALL] = lambda: _copy(src, seq_buf, pool, os.cpu_count() or 1)
        if gpuio.cuda_available():
            methods.update(_gpu_methods(index, batches, paths))
        for cache in caches:
            names = [m for m in methods if cache == "warm" or m not in memory]
            bounds_now = (*bounds, *memory) if cache == "warm" else bounds
            if cache == "warm":  # read afresh, front to back: the page cache holds them as readahead left them
                drop_cache(all_files)
                _naive_files(all_files)
            rounds: dict[str, list[float]] = {m: [] for m in names}
            resident = dict.fromkeys(names, 0.0)
            with tqdm(total=repeat * len(names), desc=f"{name}, {cache} page cache", unit="run",
                      leave=False) as bar:
                for r in range(repeat):
                    for m in names[r % len(names):] + names[:r % len(names)]:
                        if cache == "cold":
                            resident[m] = max(resident[m], drop_cache(all_files))
                        t0 = time.perf_counter()
                        methods[m]()
                        rounds[m].append(time.perf_counter() - t0)
                        bar.update()
            times = {m: min(ts) for m, ts in rounds.items()}
            ceiling = min(times[m] for m in bounds_now) if bounds_now else None
            failed = {m: _failure(cache, resident[m], times[m], ceiling, m in bounds_now) for m in names}
            bound_failed = next((failed[m] for m in bounds_now if failed[m]), None)
            for method, t in times.items():
                row: dict[str, Any] = {"dataset": name, "cache": cache, "method": method}
                if failed[method] or bound_failed:
                    rows.append({**row, "seconds_measured": t,
                                 "failed": failed[method] or f"its ceiling failed: {bound_failed}"})
                    continue
                base = times[baseline] if not failed[baseline] else None
                rows.append({**row, "seconds": t, "GB/s": total / t / 1e9, "files/s": n / t if n > 16 else None,
                             "vs baseline": base / t if base else None,
                             "median round vs baseline": float(np.median(np.divide(rounds[baseline], rounds[method])))
                             if base else None,
                             "vs ceiling": ceiling / t if ceiling else None,
                             "ceiling GB/s": total / ceiling / 1e9 if ceiling else None})
    return rows


def _failure(cache: str, resident: float, t: float, t_ceiling: float | None, is_ceiling: bool) -> str | None:
    """Why a row is not a result, or None. Only cold rows are judged: a cold run that
    reads from memory, the mistake that makes a row beat its ceiling, is the one to catch."""
    if cache != "cold":
        return None
    if resident > RESIDENT_LIMIT:
        return (f"{resident:.0%} of the files' pages were still in the page cache after flushing and "
                f"dropping them, so this cold run read from memory")
    if t_ceiling is not None and not is_ceiling and t * DRIFT < t_ceiling:
        return (f"faster than its own ceiling ({t:.3f} s against {t_ceiling:.3f} s for the same bytes in one "
                f"file, read sequentially, in parallel 4 MiB reads, in read_parts parts or with O_DIRECT), "
                f"so some of its reads did not come from the disk")
    return None


COLUMNS = [("dataset", "dataset", ""), ("cache", "cache", ""), ("method", "method", ""),
           ("GB/s", "GB/s", ".2f"), ("files/s", "files/s", ",.0f"),
           ("vs baseline", "vs baseline", ".2f"), ("median round vs baseline", "per round", ".2f"),
           ("vs ceiling", "vs ceiling", ".2f")]


def report(title: str, rows: list[dict[str, Any]], out: str | None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Print the table (with the machine and mode) and write the JSON."""
    cuda = gpuio.cuda_available()
    if cuda:
        rows = rows + [_pinned_h2d()]
    info = machine()
    print(f"{title} on {info.get('gpu', 'no GPU')}, {info['cpu']} ({info['cores']} cores), "
          f"io_threads={gpuio.config.get('io_threads')}")
    print_table([{**r, "note": "FAILED, see below" if r.get("failed") else ""} for r in rows],
                COLUMNS + [("note", "note", "s")])
    for r in rows:
        if r.get("failed"):
            print(f"failed measurement, not a result: {r['dataset']}, {r['cache']}, {r['method']}: {r['failed']}")
    result = {"machine": info, "settings": gpuio.config.settings(), "rows": rows, **(extra or {})}
    if cuda:
        from gpuio.storage._kvikio import compat_mode_active

        result["kvikio_compat_mode"] = compat_mode_active()
        print("kvikio:", "COMPAT MODE (POSIX reads + bounce buffers, no GDS)" if result["kvikio_compat_mode"]
              else "GDS active")
    write_json(out, result)
    if out:
        print(f"wrote {write_chart(os.path.splitext(out)[0] + '.png', title, 'GB/s', _groups(rows))}")
    return result


def _ceiling_words() -> dict[str, str]:
    """The chart's label of each ceiling row: what it reads, in plain words."""
    same, parts, threads = "ceiling: the same bytes in one file,", gpuio.config.get("read_parts"), \
        gpuio.config.get("io_threads")
    return {SEQUENTIAL: f"{same} one sequential read",
            PARALLEL: f"{same} 4 MiB reads, {threads} at once",
            PARTS: f"{same} {parts} parallel sequential reads",
            DIRECT: f"{same} {parts} parallel O_DIRECT reads",
            DIRECT_DEEP: f"{same} O_DIRECT 1 MiB reads, {threads} at once",
            MEMORY_ONE: "ceiling: the same number of bytes copied within memory, one thread",
            MEMORY_ALL: f"ceiling: the same number of bytes copied within memory, {os.cpu_count()} threads"}


def _groups(rows: list[dict[str, Any]]) -> list[Group]:
    """One chart panel per dataset and cache: a bar per method, the ceiling as a line."""
    words = _ceiling_words()
    groups: dict[tuple[str, str], Group] = {}
    for r in rows:
        key = (r["dataset"], r["cache"])
        if key not in groups:
            groups[key] = Group(f"{r['dataset']}, {r['cache']} page cache" if r["dataset"] != "-" else r["method"], [])
        g = groups[key]
        g.ceiling = r.get("ceiling GB/s", g.ceiling)
        if r["method"] == "pinned H2D (ceiling)":
            g.ceiling = r["GB/s"]
            continue
        label = words.get(r["method"], r["method"])
        g.bars.append((label, r.get("GB/s")))
        if label != r["method"]:
            g.ceilings.add(label)
        elif r["method"].startswith("gpuio"):
            g.ours.add(label)
        if r.get("failed"):
            g.notes[label] = "failed measurement (see the JSON)"
    return list(groups.values())


def run(root: str | None = None, size: str = "full", batch: int = 256, repeat: int = 3,
        caches: tuple[str, ...] = ("warm", "cold"), out: str | None = None) -> dict[str, Any]:
    """The storage benchmark over its three datasets; prints a table, returns the results."""
    data = make_datasets(root or cache_dir(), size)
    ceiling_small = data.pop("_ceiling_small")
    rows = measure("small files", data["small"], [ceiling_small], batch=batch, repeat=repeat, caches=caches)
    large = data["large"]
    rows += measure("large files", large, large.files.many(np.arange(len(large.files))), batch=len(large),
                    repeat=repeat, caches=caches, baseline=SEQUENTIAL)
    rows += measure("packed records", data["packed"], [data["packed"].files[0]], batch=batch, repeat=repeat,
                    caches=caches, packed=True)
    print("baseline: the naive loop for small files and packed records; one sequential readinto for large files")
    return report(f"gpuio storage benchmark ({size})", rows, out, {"size": size})


def _gpu_methods(index: SampleIndex, batches: list[np.ndarray], paths: list[str]) -> dict[str, Any]:
    import cupy
    import kvikio
    import torch

    def kvikio_per_file() -> None:
        for p in paths:
            with kvikio.CuFile(p, "r") as f:
                buf = cupy.empty(os.path.getsize(p), dtype=cupy.uint8)
                f.read(buf)
        cupy.cuda.runtime.deviceSynchronize()

    def torch_copy() -> None:
        for p in paths:
            torch.from_numpy(np.fromfile(p, dtype=np.uint8)).cuda()
        torch.cuda.synchronize()

    def gpuio_cuda() -> None:
        _each(index, batches, "cuda")
        cupy.cuda.runtime.deviceSynchronize()

    return {"gpuio -> GPU": gpuio_cuda, "kvikio per file -> GPU": kvikio_per_file,
            "np.fromfile + torch .cuda()": torch_copy}


def _pinned_h2d(nbytes: int = 256 << 20) -> dict[str, Any]:
    import cupy

    host = np.frombuffer(cupy.cuda.alloc_pinned_memory(nbytes), dtype=np.uint8, count=nbytes)
    dev = cupy.empty(nbytes, dtype=cupy.uint8)

    def copy() -> None:
        dev.set(host)
        cupy.cuda.runtime.deviceSynchronize()

    t = best_time(copy, 5)
    return {"dataset": "-", "cache": "-", "method": "pinned H2D (ceiling)", "seconds": t, "GB/s": nbytes / t / 1e9}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="where the datasets are made (default: the gpuio cache folder)")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warm-only", action="store_true")
    parser.add_argument("--npy", action="store_true",
                        help="only large .npy files, one gpuio.read call per file")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    caches = ("warm",) if args.warm_only else ("warm", "cold")
    if args.npy:
        run_npy(args.root, args.size, args.repeat, caches, args.out)
    else:
        run(args.root, args.size, args.batch, args.repeat, caches, args.out)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
