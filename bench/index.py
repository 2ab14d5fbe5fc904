"""Index benchmark: how long and how much memory indexing a large dataset takes.

    python bench/index.py [--n 1000000] [--dir-files 100000] [--out results.json]

Builds, in a temporary folder, datasets of ``--n`` samples and indexes each one in a
fresh child process, so that the peak-RSS increase belongs to the indexing alone:

- ``filetree-list``: a ``file_list`` of ``--n`` lines (``path label``) over the files of
  the directory below, cycled (each line is still stat'ed);
- ``filetree-walk``: a real directory of ``--dir-files`` empty files in 1000 class
  folders (creating a million files takes minutes, hence the lower default);
- ``filetree-torchvision-loop``: the reference for ``filetree-walk``: torchvision's
  ``find_classes``/``make_dataset`` algorithm written out here as a plain loop (scandir
  for the sorted class folders, ``sorted(os.walk(followlinks=True))``, sorted file
  names, the extension test), since torchvision cannot be installed beside this torch;
- ``webdataset``: ``--shards`` tars of ``--n`` samples in all, two members each
  (``.jpg``, ``.cls``), plain ustar headers;
- ``tfrecord``: one TFRecord file of ``--n`` records plus its index file (the
  ``tfrecord`` package's ``offset length`` text format);
- ``tfrecord-scan``: the same records in ``--shards`` files without index files (scanned);
- ``recordio-scan``: ``--shards`` ``.rec`` files of ``--n`` records in all, no ``.idx``;
- ``lmdb`` and its reference ``lmdb-cursor-loop`` (a plain ``for key, value in
  txn.cursor()`` over the same database, keeping nothing).

Per dataset it reports the wall time to index (the median of ``--repeat`` runs), the peak RSS increase while indexing,
the index's array bytes (``nbytes``), the saved file's size, and the save and load
times. It prints a table and writes JSON with ``--out``.

    python bench/index.py --getitem [--getitem-files 2000] [--getitem-bytes 16384]

measures reading one sample instead: ``index[i]`` against a plain ``open``, ``seek`` and
``read`` of each of the sample's extents (the same files, the same random order), and
the batched read of that one row (``gpuio.storage.read_fields``), on a file tree and on a
WebDataset tar of the same samples (``.jpg`` of ``--getitem-bytes`` bytes, ``.cls``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import inspect
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator

import numpy as np

import gpuio
from gpuio.bench._common import machine, peak_rss, print_table, reset_peak_rss, write_json
from gpuio.index import Ragged, SampleIndex

CASES = ("filetree-list", "filetree-walk", "filetree-torchvision-loop", "webdataset", "tfrecord", "tfrecord-scan",
         "recordio-scan", "lmdb", "lmdb-cursor-loop")
# the reference each gpuio case is compared with, measured in the same run
REFERENCE = {"filetree-walk": "filetree-torchvision-loop", "lmdb": "lmdb-cursor-loop"}
TORCHVISION_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def index_nbytes(index: SampleIndex) -> int:
    """Bytes held by the index's arrays (paths, extents, values)."""
    total = index.files.nbytes
    for e in index.extents.values():
        total += e.file.nbytes + e.offset.nbytes + e.length.nbytes
    for v in index.values.values():
        total += v.values.nbytes + v.offsets.nbytes if isinstance(v, Ragged) else v.nbytes
    return total


# ---- datasets ---------------------------------------------------------------------------

def make_tree(root: str, n: int) -> None:
    for c in range(1000):
        os.makedirs(os.path.join(root, f"class{c:04d}"), exist_ok=True)
    for k in range(n):
        open(os.path.join(root, f"class{k % 1000:04d}", f"img{k:08d}.jpg"), "wb").close()


def make_file_list(path: str, dir_files: int, n: int) -> None:
    k = np.arange(n) % dir_files
    lines = (f"class{c:04d}/img{i:08d}.jpg {c}\n" for i, c in zip(k.tolist(), (k % 1000).tolist()))
    with open(path, "w") as f:
        f.writelines(lines)


def make_tar(path: str, start: int, n: int) -> None:
    """A tar of samples ``start`` to ``start + n - 1``: ``s/<k>.jpg`` (4 bytes) and
    ``s/<k>.cls`` (3 digits), ustar headers as ``tarfile`` writes them. One sample is
    written by ``tarfile``; the rest are copies with the digits and checksums changed,
    in NumPy (``tarfile`` would take minutes for millions of members)."""
    template = bytearray()
    for ext, data in (("jpg", b"\xff\xd8\xff\xd9"), ("cls", b"000")):
        info = tarfile.TarInfo(f"s/{0:010d}.{ext}")
        info.size, info.mtime = len(data), 0
        template += info.tobuf(tarfile.USTAR_FORMAT) + data + b"\0" * (-len(data) % 512)
    one = np.frombuffer(bytes(template), dtype=np.uint8)
    step = 100_000
    with open(path, "wb") as f:
        for first in range(start, start + n, step):
            k = np.arange(first, min(first + step, start + n))
            rows = np.tile(one, (len(k), 1))
            digits = (k[:, None] // 10 ** np.arange(9, -1, -1) % 10 + ord("0")).astype(np.uint8)
            cls = (k[:, None] % 1000 // 10 ** np.arange(2, -1, -1) % 10 + ord("0")).astype(np.uint8)
            rows[:, 1536:1539] = cls
            for header in (0, 1024):
                rows[:, header + 2:header + 12] = digits
                head = rows[:, header:header + 512]
                head[:, 148:156] = ord(" ")
                chk = head.sum(axis=1, dtype=np.int64)
                head[:, 148:156] = np.frombuffer(b"".join(b"%06o\0 " % c for c in chk.tolist()),
                                                 dtype=np.uint8).reshape(-1, 8)
            f.write(rows.tobytes())
        f.write(b"\0" * 1024)


def make_rec(path: str, n: int) -> None:
    """A RecordIO file of ``n`` whole records (magic, length, 24-byte header, 4-byte payload)."""
    import struct

    payload = struct.pack("<IfQQ", 0, 1.0, 7, 0) + b"\xff\xd8\xff\xd9"
    record = struct.pack("<II", 0xCED7230A, len(payload)) + payload
    with open(path, "wb") as f:
        for first in range(0, n, 100_000):
            f.write(record * min(100_000, n - first))


def make_lmdb(path: str, n: int) -> None:
    import lmdb

    env = lmdb.open(path, map_size=max(1 << 30, n * 200), subdir=True, writemap=True, sync=False)
    value = b"\xff\xd8" + b"x" * 60 + b"\xff\xd9"
    for first in range(0, n, 1_000_000):
        with env.begin(write=True) as txn:
            cur = txn.cursor()
            cur.putmulti(((b"%010d" % k, value) for k in range(first, min(first + 1_000_000, n))), append=True)
    env.sync()
    env.close()


def shards(n: int, count: int) -> list[tuple[int, int]]:
    """``(first sample, samples)`` of ``count`` shards holding ``n`` samples in all."""
    bounds = np.linspace(0, n, count + 1).astype(np.int64).tolist()
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def make_tfrecord(path: str, index_path: str | None, n: int) -> None:
    from tfrecord.writer import TFRecordWriter

    one = path + ".one"
    writer = TFRecordWriter(one)
    writer.write({"label": (7, "int"), "image": (b"\xff\xd8\xff\xd9", "byte")})
    writer.close()
    with open(one, "rb") as f:
        record = f.read()
    os.remove(one)
    with open(path, "wb") as f:
        for _ in range(0, n, 10_000):  # the same valid record, n times
            f.write(record * min(10_000, n - _))
    if index_path is None:
        return
    offsets = np.arange(n, dtype=np.int64) * len(record)
    with open(index_path, "w") as f:
        f.writelines(f"{o} {len(record)}\n" for o in offsets.tolist())


# ---- one measurement, in a child process ------------------------------------------------

def _tfrecord_index(path: str, index_path: str) -> SampleIndex:
    fn = importlib.import_module("gpuio.formats.tfrecord").tfrecord
    params = [p for p in inspect.signature(fn).parameters if "index" in p]
    return fn(path, **{params[0]: index_path}) if params else fn(path)


def torchvision_loop(root: str) -> int:
    """torchvision's ``find_classes`` + ``make_dataset`` walk, as a plain loop; the count."""
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir())
    samples = []
    for label, name in enumerate(classes):
        for folder, _, names in sorted(os.walk(os.path.join(root, name), followlinks=True)):
            for fname in sorted(names):
                path = os.path.join(folder, fname)
                if path.lower().endswith(TORCHVISION_EXTENSIONS):
                    samples.append((path, label))
    return len(samples)


def lmdb_cursor_loop(path: str) -> int:
    """A plain cursor loop over an LMDB database, keeping nothing; the count."""
    import lmdb

    env = lmdb.open(path, readonly=True, lock=False, readahead=False)
    n = 0
    with env.begin(buffers=True) as txn:
        for _key, _value in txn.cursor():
            n += 1
    env.close()
    return n


def child(case: str, args: list[str], out_dir: str) -> dict:
    from gpuio.formats import filetree, lmdb, recordio, tfrecord, webdataset

    build = {
        "filetree-list": lambda: filetree(args[0], file_list=args[1]),
        "filetree-walk": lambda: filetree(args[0]),
        "filetree-torchvision-loop": lambda: torchvision_loop(args[0]),
        "webdataset": lambda: webdataset(args, fields=("jpg", "cls")),
        "tfrecord": lambda: _tfrecord_index(args[0], args[1]),
        "tfrecord-scan": lambda: tfrecord(args),
        "recordio-scan": lambda: recordio(args),
        "lmdb": lambda: lmdb(args[0]),
        "lmdb-cursor-loop": lambda: lmdb_cursor_loop(args[0]),
    }[case]
    rss0 = reset_peak_rss()
    t0 = time.perf_counter()
    index = build()
    t_index = time.perf_counter() - t0
    rss1 = peak_rss()
    if isinstance(index, int):  # a reference loop: no index
        return {"case": case, "samples": index, "index_s": t_index, "rss_mb": (rss1 - rss0) / 1024,
                "per_sample_us": t_index / index * 1e6}
    path = os.path.join(out_dir, case + ".gpuio-index")
    t0 = time.perf_counter()
    index.save(path)
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = SampleIndex.load(path)
    t_load = time.perf_counter() - t0
    first = back[0]  # the index reads real bytes
    return {"case": case, "samples": len(index), "index_s": t_index, "rss_mb": (rss1 - rss0) / 1024,
            "nbytes_mb": index_nbytes(index) / 2**20, "file_mb": os.path.getsize(path) / 2**20,
            "save_s": t_save, "load_s": t_load, "per_sample_us": t_index / len(index) * 1e6,
            "fields": list(first)}


def run_child(case: str, args: list[str], out_dir: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case, "--out-dir", out_dir, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def workdir(parent: str | None, keep: bool) -> Iterator[str]:
    """A new folder for the datasets, removed afterwards unless ``keep``."""
    path = tempfile.mkdtemp(dir=parent, prefix="gpuio-index-bench-")
    try:
        yield path
    finally:
        if keep:
            print(f"datasets kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)


def make_getitem_data(root: str, n: int, size: int) -> tuple[str, str]:
    """A file tree of ``n`` files of ``size`` random bytes in 10 class folders, and one
    tar holding the same samples (``<k>.jpg`` with those bytes, ``<k>.cls``)."""
    tree, tar_path = os.path.join(root, "getitem-tree"), os.path.join(root, "getitem.tar")
    rng = np.random.default_rng(0)
    with tarfile.open(tar_path, "w") as tar:
        for k in range(n):
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            folder = os.path.join(tree, f"class{k % 10}")
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"{k:06d}.jpg"), "wb") as f:
                f.write(data)
            for ext, member in (("jpg", data), ("cls", b"%d" % (k % 10))):
                info = tarfile.TarInfo(f"{k:06d}.{ext}")
                info.size = len(member)
                tar.addfile(info, io.BytesIO(member))
    return tree, tar_path


def getitem_rows(tmp: str, n: int, size: int, rounds: int) -> list[dict]:
    """Per dataset, the median over ``rounds`` of the time per sample of ``index[i]``,
    of plain reads of the same extents and of a batched read of one row, interleaved."""
    from gpuio.formats import filetree, webdataset

    tree, tar_path = make_getitem_data(tmp, n, size)
    rows = []
    for name, index in (("filetree", filetree(tree)), ("webdataset", webdataset(tar_path, fields=("jpg", "cls")))):
        order = np.random.default_rng(1).permutation(len(index)).tolist()
        extents = [[index.extent(i, f) for f in index.extents] for i in order]
        if index[order[0]]["jpg" if name == "webdataset" else "data"] != _plain_bytes(extents[0][0]):
            raise RuntimeError(f"{name}: index[{order[0]}] differs from the file's bytes")
        times: dict[str, list[float]] = {"getitem": [], "plain": [], "batched": []}
        for _ in range(rounds):
            for key, fn, arg in (("getitem", _getitem_loop, (index, order)), ("plain", _plain_loop, (extents,)),
                                 ("batched", _batched_loop, (index, order))):
                t0 = time.perf_counter()
                fn(*arg)
                times[key].append((time.perf_counter() - t0) / len(order) * 1e6)
        us = {k: float(np.median(v)) for k, v in times.items()}
        rows.append({"dataset": name, "samples": len(index), "extents": len(index.extents), "bytes": size,
                     "getitem_us": us["getitem"], "plain_us": us["plain"], "batched_us": us["batched"],
                     "vs_plain": us["getitem"] / us["plain"], "batched_vs_plain": us["batched"] / us["plain"]})
    return rows


def _getitem_loop(index: SampleIndex, order: list[int]) -> None:
    for i in order:
        index[i]


def _plain_loop(extents: list[list[tuple[str, int, int]]]) -> None:
    for sample in extents:
        for path, offset, length in sample:
            with open(path, "rb") as f:
                f.seek(offset)
                f.read(length)


def _batched_loop(index: SampleIndex, order: list[int]) -> None:
    from gpuio.storage import read_fields

    for i in order:
        read_fields(index, [i], index.fields)


def _plain_bytes(extent: tuple[str, int, int]) -> bytes:
    path, offset, length = extent
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="samples in the list, tar and TFRecord datasets")
    p.add_argument("--dir-files", type=int, default=100_000, help="files in the real directory tree")
    p.add_argument("--shards", type=int, default=1, help="files the webdataset, tfrecord-scan and recordio-scan "
                                                         "samples are spread over")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--tmp", default=None, help="where to build the datasets (default: the system temp dir)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--keep", action="store_true", help="keep the datasets (their folder is printed)")
    p.add_argument("--repeat", type=int, default=1, help="index each dataset this many times, the cases in turn, "
                                                         "and report the median run")
    p.add_argument("--getitem", action="store_true", help="measure index[i] against open+read of the same "
                                                          "extents instead of indexing")
    p.add_argument("--getitem-files", type=int, default=2000, help="samples of the --getitem datasets")
    p.add_argument("--getitem-bytes", type=int, default=16384, help="bytes of each --getitem sample's .jpg")
    p.add_argument("--rounds", type=int, default=7, help="--getitem: passes over the samples per reader "
                                                         "(the median is reported)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.paths, a.out_dir)))
        return

    if a.getitem:
        info = machine()
        print(f"machine: {info['cpu']}, {info['cores']} cores, python {info['python']}, gpuio {info['gpuio']}")
        with workdir(a.tmp, a.keep) as tmp:
            rows = getitem_rows(tmp, a.getitem_files, a.getitem_bytes, a.rounds)
        print_table(rows, [("dataset", "dataset", "s"), ("samples", "samples", "d"),
                           ("extents", "extents/sample", "d"), ("bytes", ".jpg bytes", "d"),
                           ("getitem_us", "index[i] us", ".1f"), ("plain_us", "open+read us", ".1f"),
                           ("batched_us", "read_fields 1 row us", ".1f"), ("vs_plain", "index[i] vs open+read", ".2f"),
                           ("batched_vs_plain", "1 row vs open+read", ".2f")])
        write_json(a.out, {"bench": "index-getitem", "machine": info, "results": rows, "gpuio": gpuio.__version__})
        return

    cases = [c for c in a.cases.split(",") if c]
    cases += [REFERENCE[c] for c in cases if c in REFERENCE and REFERENCE[c] not in cases]
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(CASES)}")
    if importlib.util.find_spec("tfrecord") is None:
        for case in {"tfrecord", "tfrecord-scan"} & set(cases):
            print(f"{case}: skipped, the tfrecord package writes its file: pip install 'gpuio[bench]'")
            cases.remove(case)
    dir_files = min(a.dir_files, a.n)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, python {info['python']}, gpuio {info['gpuio']}")
    if "filetree-torchvision-loop" in cases:
        print("filetree-torchvision-loop: torchvision's find_classes/make_dataset algorithm re-implemented in this "
              "file (torchvision is not installed beside this torch)")
    rows = []
    with workdir(a.tmp, a.keep) as tmp:
        tree = os.path.join(tmp, "tree")
        made: dict[str, list[str]] = {}
        t0 = time.perf_counter()
        if {"filetree-list", "filetree-walk", "filetree-torchvision-loop"} & set(cases):
            make_tree(tree, dir_files)
        if "filetree-list" in cases:
            make_file_list(os.path.join(tmp, "list.txt"), dir_files, a.n)
            made["filetree-list"] = [tree, os.path.join(tmp, "list.txt")]
        for case in ("filetree-walk", "filetree-torchvision-loop"):
            made[case] = [tree]
        parts = shards(a.n, a.shards)
        if "webdataset" in cases:
            made["webdataset"] = [os.path.join(tmp, f"shard-{k:05d}.tar") for k in range(a.shards)]
            for path, (first, count) in zip(made["webdataset"], parts):
                make_tar(path, first, count)
        if "tfrecord" in cases:
            make_tfrecord(os.path.join(tmp, "data.tfrecord"), os.path.join(tmp, "data.index"), a.n)
            made["tfrecord"] = [os.path.join(tmp, "data.tfrecord"), os.path.join(tmp, "data.index")]
        if "tfrecord-scan" in cases:
            made["tfrecord-scan"] = [os.path.join(tmp, f"scan-{k:05d}.tfrecord") for k in range(a.shards)]
            for path, (_, count) in zip(made["tfrecord-scan"], parts):
                make_tfrecord(path, None, count)
        if "recordio-scan" in cases:
            made["recordio-scan"] = [os.path.join(tmp, f"scan-{k:05d}.rec") for k in range(a.shards)]
            for path, (_, count) in zip(made["recordio-scan"], parts):
                make_rec(path, count)
        if {"lmdb", "lmdb-cursor-loop"} & set(cases):
            make_lmdb(os.path.join(tmp, "lmdb"), a.n)
            made["lmdb"] = made["lmdb-cursor-loop"] = [os.path.join(tmp, "lmdb")]
        print(f"datasets built in {time.perf_counter() - t0:.1f} s in {tmp} "
              f"(n={a.n} in {a.shards} shard(s), directory tree: {dir_files} files)")
        out_dir = os.path.join(tmp, "indexes")
        os.makedirs(out_dir)
        from tqdm import tqdm

        runs: dict[str, list[dict]] = {case: [] for case in cases}
        for _ in range(a.repeat):  # the cases in turn, so that a busy minute falls on all of them
            for case in tqdm(cases, desc="indexing", unit="dataset"):
                runs[case].append(run_child(case, made[case], out_dir))
        for case, got in runs.items():  # the run with the median time, and every run's time
            got.sort(key=lambda r: r["index_s"])
            rows.append({**got[(len(got) - 1) // 2], "index_s_runs": [r["index_s"] for r in got]})
    times = {r["case"]: r["index_s"] for r in rows}
    for r in rows:
        ref = REFERENCE.get(r["case"])
        r["vs_reference"] = f"{r['index_s'] / times[ref]:.2f}x {ref}" if ref in times else "-"
        for key in ("nbytes_mb", "file_mb", "save_s", "load_s"):
            r.setdefault(key, None)
    print()
    print_table(rows, [("case", "dataset", "s"), ("samples", "samples", "d"), ("index_s", "index s", ".2f"),
                       ("per_sample_us", "us/sample", ".1f"), ("rss_mb", "peak RSS +MB", ".1f"),
                       ("nbytes_mb", "arrays MB", ".1f"), ("file_mb", "file MB", ".1f"),
                       ("save_s", "save s", ".3f"), ("load_s", "load s", ".3f"),
                       ("vs_reference", "time vs reference", "s")])
    write_json(a.out, {"bench": "index", "machine": info, "n": a.n, "dir_files": dir_files, "results": rows,
                       "gpuio": gpuio.__version__})


if __name__ == "__main__":
    main()
