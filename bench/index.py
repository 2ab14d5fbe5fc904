"""Index benchmark: how long and how much memory indexing a large dataset takes.

    python bench/index.py [--n 1000000] [--dir-files 100000] [--out results.json]

Builds, in a temporary folder, datasets of ``--n`` samples and indexes each one in a
fresh child process, so that the peak-RSS increase belongs to the indexing alone:

- ``filetree-list``: a ``file_list`` of ``--n`` lines (``path label``) over the files of
  the directory below, cycled (each line is still stat'ed);
- ``filetree-walk``: a real directory of ``--dir-files`` empty files in 1000 class
  folders (creating a million files takes minutes, hence the lower default);
- ``webdataset``: one tar of ``--n`` samples, two members each (``.jpg``, ``.cls``);
- ``tfrecord``: one TFRecord file of ``--n`` records plus its index file (the
  ``tfrecord`` package's ``offset length`` text format), when ``gpuio.formats.tfrecord``
  exists.

Per dataset it reports the wall time to index, the peak RSS increase while indexing,
the index's array bytes (``nbytes``), the saved file's size, and the save and load
times. It prints a table and writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

import gpuio
from gpuio._bench.common import machine, print_table, write_json
from gpuio.index import Ragged, SampleIndex

CASES = ("filetree-list", "filetree-walk", "webdataset", "tfrecord")


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


def make_tar(path: str, n: int) -> None:
    with open(path, "wb") as f:
        for k in range(n):
            for ext, data in (("jpg", b"\xff\xd8\xff\xd9"), ("cls", str(k % 1000).encode())):
                info = tarfile.TarInfo(f"s/{k:08d}.{ext}")
                info.size = len(data)
                f.write(info.tobuf(tarfile.USTAR_FORMAT))
                f.write(data + b"\0" * (-len(data) % 512))
        f.write(b"\0" * 1024)


def make_tfrecord(path: str, index_path: str, n: int) -> None:
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
    offsets = np.arange(n, dtype=np.int64) * len(record)
    with open(index_path, "w") as f:
        f.writelines(f"{o} {len(record)}\n" for o in offsets.tolist())


# ---- one measurement, in a child process ------------------------------------------------

def _tfrecord_index(path: str, index_path: str) -> SampleIndex:
    fn = importlib.import_module("gpuio.formats.tfrecord").tfrecord
    params = [p for p in inspect.signature(fn).parameters if "index" in p]
    return fn(path, **{params[0]: index_path}) if params else fn(path)


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> int:
    """Reset the peak-RSS counter (Linux ``clear_refs``) and return the RSS now, KiB.

    ``ru_maxrss`` alone would not do: it survives ``exec`` and so starts at the
    parent's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return _status_kib("VmRSS") or 0


def _peak_rss() -> int:
    """Peak RSS since the last reset, KiB."""
    return _status_kib("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(case: str, args: list[str], out_dir: str) -> dict:
    from gpuio.formats import filetree, webdataset

    build = {
        "filetree-list": lambda: filetree(args[0], file_list=args[1]),
        "filetree-walk": lambda: filetree(args[0]),
        "webdataset": lambda: webdataset(args[0], fields=("jpg", "cls")),
        "tfrecord": lambda: _tfrecord_index(args[0], args[1]),
    }[case]
    rss0 = _reset_peak_rss()
    t0 = time.perf_counter()
    index = build()
    t_index = time.perf_counter() - t0
    rss1 = _peak_rss()
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1_000_000, help="samples in the list, tar and TFRecord datasets")
    p.add_argument("--dir-files", type=int, default=100_000, help="files in the real directory tree")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--tmp", default=None, help="where to build the datasets (default: the system temp dir)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.paths, a.out_dir)))
        return

    cases = [c for c in a.cases.split(",") if c]
    unknown = set(cases) - set(CASES)
    if unknown:
        p.error(f"unknown case(s) {sorted(unknown)}; choose from {', '.join(CASES)}")
    if "tfrecord" in cases and importlib.util.find_spec("tfrecord") is None:
        print("tfrecord: skipped, the tfrecord package writes its file: pip install 'gpuio[bench]'")
        cases.remove("tfrecord")
    dir_files = min(a.dir_files, a.n)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, python {info['python']}, gpuio {info['gpuio']}")
    rows = []
    with tempfile.TemporaryDirectory(dir=a.tmp, prefix="gpuio-index-bench-") as tmp:
        tree = os.path.join(tmp, "tree")
        made: dict[str, list[str]] = {}
        t0 = time.perf_counter()
        if {"filetree-list", "filetree-walk"} & set(cases):
            make_tree(tree, dir_files)
        if "filetree-list" in cases:
            make_file_list(os.path.join(tmp, "list.txt"), dir_files, a.n)
            made["filetree-list"] = [tree, os.path.join(tmp, "list.txt")]
        if "filetree-walk" in cases:
            made["filetree-walk"] = [tree]
        if "webdataset" in cases:
            make_tar(os.path.join(tmp, "shard.tar"), a.n)
            made["webdataset"] = [os.path.join(tmp, "shard.tar")]
        if "tfrecord" in cases:
            make_tfrecord(os.path.join(tmp, "data.tfrecord"), os.path.join(tmp, "data.index"), a.n)
            made["tfrecord"] = [os.path.join(tmp, "data.tfrecord"), os.path.join(tmp, "data.index")]
        print(f"datasets built in {time.perf_counter() - t0:.1f} s in {tmp} "
              f"(n={a.n}, directory tree: {dir_files} files)")
        out_dir = os.path.join(tmp, "indexes")
        os.makedirs(out_dir)
        from tqdm import tqdm

        for case in tqdm(cases, desc="indexing", unit="dataset"):
            rows.append(run_child(case, made[case], out_dir))
    print()
    print_table(rows, [("case", "dataset", "s"), ("samples", "samples", "d"), ("index_s", "index s", ".2f"),
                       ("per_sample_us", "us/sample", ".1f"), ("rss_mb", "peak RSS +MB", ".1f"),
                       ("nbytes_mb", "arrays MB", ".1f"), ("file_mb", "file MB", ".1f"),
                       ("save_s", "save s", ".3f"), ("load_s", "load s", ".3f")])
    write_json(a.out, {"bench": "index", "machine": info, "n": a.n, "dir_files": dir_files, "results": rows,
                       "gpuio": gpuio.__version__})


if __name__ == "__main__":
    main()
