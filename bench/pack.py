"""``python -m gpuio.bench.pack``: gpuio pack against the other writers, and what packing
changes for the reader, in one run on the ImageNet-like sample dataset.

Rows:

- packing time, pass-through bytes, ``--workers`` processes each: ``gpuio.pack``; Mosaic
  ``MDSWriter`` and webdataset's ``ShardWriter`` with the samples cut into as many parts,
  one writer per part on as many processes (as each library's docs parallelize them);
  ``litdata.optimize`` where it imports (it needs torchvision);
- size: the packed dataset's bytes against the source's;
- a Loader epoch of the train chain (decode, random resized crop 224, flip, normalize) and
  of the val chain (resize 256, center crop 224, normalize) on the source tree and on the packed
  dataset (``bench/images.py``'s chains), with the decode-only ceiling of each chain on
  the source (``images.decode_only``);
- cold reads: every record of the packed shards through ``gpuio.Reader`` with the page
  cache dropped, against ``bench/storage.py``'s ceiling (the fastest of a sequential, a
  parallel and an O_DIRECT read) of the shard files themselves.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

import gpuio
from gpuio.bench import images, storage
from gpuio.bench._common import cache_dir, machine, sample_root

__all__ = ["main"]


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _best(write: Callable[[str], Any], work: str, repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``write(folder)``, each into a new folder."""
    times = []
    for _ in range(repeat):
        out = tempfile.mkdtemp(dir=work)
        times.append(_timed(lambda: write(out)))
        shutil.rmtree(out)
    return min(times)


def _samples(index: gpuio.SampleIndex, rows: range) -> list[tuple[str, bytes, int]]:
    out = []
    for i in rows:
        path = index.files[index.extents["data"].file[i]]
        with open(path, "rb") as f:
            out.append((f"{i:08d}", f.read(), int(index.values["label"][i])))
    return out


def _wds_part(args: tuple[str, str, range]) -> None:
    import webdataset as wds

    root, out, rows = args
    index = gpuio.formats.filetree(root)
    os.makedirs(out, exist_ok=True)
    with wds.ShardWriter(os.path.join(out, "part-%06d.tar"), maxsize=128 << 20, verbose=0) as sink:
        for key, data, label in _samples(index, rows):
            sink.write({"__key__": key, "jpg": data, "cls": label})


def _mds_writer() -> Any:
    """mosaicml-streaming's ``MDSWriter``, its package's ``__init__`` skipped (that one
    imports torchvision, which the writer does not use)."""
    import importlib
    import importlib.util
    import sys
    import types

    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None:
            raise ImportError("No module named 'streaming' (pip install --no-deps mosaicml-streaming)")
        for name, folder in (("streaming", ""), ("streaming.base", "base")):
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(spec.submodule_search_locations[0], folder)]
            sys.modules[name] = module
    return importlib.import_module("streaming.base.format.mds.writer").MDSWriter


def _mds_part(args: tuple[str, str, range]) -> None:
    MDSWriter = _mds_writer()
    root, out, rows = args
    index = gpuio.formats.filetree(root)
    with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit=128 << 20) as sink:
        for _, data, label in _samples(index, rows):
            sink.write({"jpg": data, "cls": label})


def _litdata_item(item: tuple[str, int]) -> dict[str, Any]:
    with open(item[0], "rb") as f:
        return {"jpg": f.read(), "cls": item[1]}


def _parts(root: str, out: str, n: int, workers: int) -> list[tuple[str, str, range]]:
    cuts = np.linspace(0, n, workers + 1).astype(int).tolist()
    return [(root, os.path.join(out, f"w{k}"), range(a, b)) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]


def _on_processes(fn: Callable[[Any], None], parts: list[Any]) -> None:
    with ProcessPoolExecutor(len(parts)) as pool:
        list(pool.map(fn, parts))


def _chain(pipeline: str) -> Any:
    """The issue's chains: train as ``bench/images.py``'s; val resize 256, center crop 224."""
    if pipeline == "train":
        return images.gpuio_ops("train")
    ops = gpuio.ops
    return ops.Compose([ops.decode_image(), ops.resize(shorter=256), ops.center_crop(224),
                        ops.normalize(images.MEAN, images.STD)])


def _loader_epoch(index: gpuio.SampleIndex, pipeline: str, batch: int) -> float:
    loader = gpuio.Loader(index, batch, fields=index.fields, ops=[_chain(pipeline)],  # with data.restarts
                          output="numpy", shuffle=True)  # every image, as the ceiling decodes them
    return _timed(lambda: [b["image"] for b in loader])


def _ceiling(root: str, pipeline: str, batch: int, count: int) -> float:
    run = images.decode_only(root, batch, os.cpu_count() or 1, count, pipeline)
    return _timed(lambda: list(run()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="images in the sample dataset")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row; the fastest counts")
    parser.add_argument("--restart-interval", default="",
                        help="also pack with restart markers every N MCUs (a comma list: one pack each) and run "
                             "the chains on each")
    parser.add_argument("--out", default=os.path.join(cache_dir(), "results", "bench-pack.json"))
    args = parser.parse_args(argv)
    root = sample_root(args.count)
    src = gpuio.storage.learn_lengths(gpuio.formats.filetree(root))
    n, source_bytes = len(src), src.nbytes("data")
    work = tempfile.mkdtemp(prefix="gpuio-bench-pack-", dir=cache_dir())
    rows: list[dict[str, Any]] = []
    print(f"{n} images, {source_bytes / 1e6:.1f} MB, from {root}; {args.workers} workers; {machine()['cpu']}")
    try:
        _samples(src, range(n))  # the source read once: every writer starts from a warm page cache
        dest = os.path.join(work, "packed")
        gpuio.pack(src, dest, workers=args.workers)
        t_pack = _best(lambda out: gpuio.pack(src, out, workers=args.workers), work, args.repeat)
        rows.append({"row": "pack: gpuio.pack", "s": t_pack})
        items = [(src.files[src.extents["data"].file[i]], int(src.values["label"][i])) for i in range(n)]
        writers = {  # name: (import, write into a folder)
            "pack: webdataset ShardWriter": (lambda: __import__("webdataset"), lambda out: _on_processes(
                _wds_part, _parts(root, out, n, args.workers))),
            "pack: mosaic MDSWriter": (_mds_writer, lambda out: _on_processes(
                _mds_part, _parts(root, out, n, args.workers))),
            "pack: litdata.optimize": (lambda: __import__("litdata"), lambda out: __import__("litdata").optimize(
                fn=_litdata_item, inputs=items, output_dir=out, chunk_bytes="128MB", num_workers=args.workers,
                verbose=False)),
        }
        for name, (load, write) in writers.items():
            try:
                load()  # imported here first, so that forked writers start with it, as gpuio's do
            except ImportError as exc:
                rows.append({"row": name, "s": None, "why": f"does not import here: {exc}"})
                continue
            t = _best(write, work, args.repeat)
            rows.append({"row": name, "s": t, "ratio": t / t_pack})
        packed = gpuio.formats.packed(dest)
        packed_bytes = sum(os.path.getsize(p) for p in packed.files)
        rows.append({"row": "size: packed / source", "bytes": packed_bytes, "ratio": packed_bytes / source_bytes})
        chains = {"source tree": src, "packed pass-through": packed}
        for interval in [int(v) for v in args.restart_interval.split(",") if v]:
            marked = os.path.join(work, f"marked-{interval}")
            gpuio.pack(src, marked, workers=args.workers, images=gpuio.ImagePolicy(restart_interval=interval))
            chains[f"packed restart {interval}"] = index = gpuio.formats.packed(marked)
            marked_bytes = sum(os.path.getsize(p) for p in index.files)
            rows.append({"row": f"size: packed restart {interval} / source", "bytes": marked_bytes,
                         "ratio": marked_bytes / source_bytes})
        for pipeline in ("train", "val"):
            # in rounds, each starting with the next run, the fastest of each counting: the
            # machine's other load drifts between rounds
            runs: dict[str, Callable[[], float]] = {"decode-only ceiling (source)": functools.partial(
                _ceiling, root, pipeline, args.batch, n)}
            for name, index in chains.items():
                _loader_epoch(index, pipeline, args.batch)  # warm: the page cache and the pools
                runs[f"Loader on {name}"] = functools.partial(_loader_epoch, index, pipeline, args.batch)
            names = list(runs)
            times: dict[str, list[float]] = {m: [] for m in names}
            for r in range(args.repeat):
                for m in names[r % len(names):] + names[:r % len(names)]:
                    times[m].append(runs[m]())
            ceiling = min(times[names[0]])
            for m in names:
                t = min(times[m])
                rows.append({"row": f"{pipeline}: {m}", "s": t, "img_s": n / t,
                             **({"ratio": ceiling / t} if m != names[0] else {})})
        shards = packed.files.many(np.arange(len(packed.files)))
        for r in storage.measure("packed", packed, shards, batch=args.batch, repeat=3, caches=("cold",)):
            if r["method"] == "gpuio":
                rows.append({"row": "cold: gpuio.Reader, every record, vs ceiling", "s": r.get("seconds"),
                             "MB_s": r["GB/s"] * 1e3 if "GB/s" in r else None, "ratio": r.get("vs ceiling"),
                             **({"why": r["failed"]} if "failed" in r else {})})
                if r.get("ceiling GB/s"):
                    rows.append({"row": "cold: ceiling (bench/storage.py, the shard files)",
                                 "MB_s": r["ceiling GB/s"] * 1e3})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'row':48s} {'seconds':>8s} {'figure':>14s} {'ratio':>7s}")
    for r in rows:
        figure = (f"{r['img_s']:.0f} img/s" if "img_s" in r else f"{r['MB_s']:.0f} MB/s" if r.get("MB_s")
                  else f"{r['bytes'] / 1e6:.1f} MB" if "bytes" in r else "")
        secs = f"{r['s']:.2f}" if r.get("s") is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") else ""
        print(f"{r['row']:48s} {secs:>8s} {figure:>14s} {ratio:>7s}" + (f"  {r['why']}" if "why" in r else ""))
    result = {"machine": machine(), "count": n, "source_bytes": source_bytes, "workers": args.workers, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results: {args.out}")
    return result


if __name__ == "__main__":
    main()
