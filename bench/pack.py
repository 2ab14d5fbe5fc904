"""``python -m gpuio.bench.pack``: gpuio pack against the other writers, and what packing
changes for the reader, in one run on the ImageNet-like sample dataset.

Rows:

- packing time, pass-through bytes, ``--workers`` processes each: ``gpuio.pack``; Mosaic
  ``MDSWriter`` and webdataset's ``ShardWriter`` with the samples cut into as many parts,
  one writer per part on as many processes (as each library's docs parallelize them);
  ``litdata.optimize`` where it imports (it needs torchvision);
- size: the packed dataset's bytes (shards and ``index.json``) against the source's, and
  the overhead split: alignment padding (4 KiB starts of records of 32 KiB and more, 4 MiB
  blocks), each shard's header, table and value columns, ``index.json``; with the same split
  computed for this sample's image sizes scaled to ImageNet's mean (``--computed-mean``),
  placed by the writer's own rule (``formats.packed.place``);
- a Loader epoch of the train chain (decode, random resized crop 224, flip, normalize) and
  of the val chain (resize 256, center crop 224, normalize) on the source tree and on the packed
  dataset (``bench/images.py``'s chains), with the decode-only ceiling of each chain on
  the source (``images.decode_only``);
- cold reads: every record of the packed shards through ``gpuio.Reader`` (also with its
  read-ahead off) and through a ``gpuio.Loader`` (the data field only, in order) with the
  page cache dropped, in
  ``--batch`` batches and in one batch, each against ``bench/storage.py``'s
  ceiling measured in the same rounds (listed after it): the fastest of its sequential,
  parallel and O_DIRECT reads of the same bytes (the records, back to back in one file), in
  ``--cold-repeat`` interleaved rounds (one cold read takes a fraction of a second, and the
  machine's other load spreads single reads by 2x and more); and a Reader's cold passes in
  order in batches of 16 with the read-ahead on against ``read_ahead=0`` (the ratio: off's
  time over on's), the best of as many alternating rounds.
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
from gpuio.bench._common import cache_dir, drop_cache, machine, sample_root
from gpuio.formats.packed import INDEX_NAME, PAGE, align, place

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


def _records_file(index: gpuio.SampleIndex, out: str) -> str:
    """The records of ``index``'s data field, back to back in one file (flushed, so that its
    pages can be dropped): the bytes a cold read of every record delivers, laid out for the
    sequential ceiling."""
    ext = index.extents["data"]
    with open(out, "wb") as dst:
        for k in np.lexsort((ext.offset, ext.file)).tolist():
            with open(index.files[int(ext.file[k])], "rb") as src:
                dst.write(os.pread(src.fileno(), int(ext.length[k]), int(ext.offset[k])))
        dst.flush()
        os.fsync(dst.fileno())
    return out


def _padding(offset: np.ndarray, length: np.ndarray) -> tuple[int, int]:
    """The unfilled bytes before the records of one shard's data region, in bytes: those
    the 4 KiB start of a record of 32 KiB or more asks for, and those beyond
    them that keep a record within a 4 MiB block."""
    pages = blocks = 0
    order = np.argsort(offset, kind="stable")
    end = int(offset[order[0]])
    for at, n in zip(offset[order].tolist(), length[order].tolist()):
        if at > end:
            paged = align(end, PAGE)
            pages += min(at, paged) - end
            blocks += max(0, at - paged)
        end = max(end, at + n)
    return pages, blocks


def _overhead(index: gpuio.SampleIndex, folder: str) -> dict[str, int]:
    """A packed dataset's bytes beyond its records' own: alignment padding (4 KiB starts,
    4 MiB blocks), the shards' header, table and value columns (all before the first
    record), and ``index.json``."""
    split = {"records": 0, "padding, 4 KiB starts": 0, "padding, 4 MiB blocks": 0, "header+table+values": 0,
             "index.json": os.path.getsize(os.path.join(folder, INDEX_NAME))}
    exts = list(index.extents.values())
    for f, path in enumerate(index.files.many(np.arange(len(index.files)))):
        offset = np.concatenate([e.offset[e.file == f] for e in exts]).astype(np.int64)
        length = np.concatenate([e.length[e.file == f] for e in exts]).astype(np.int64)
        pages, blocks = _padding(offset, length)
        split["records"] += int(length.sum())
        split["padding, 4 KiB starts"] += pages
        split["padding, 4 MiB blocks"] += blocks
        split["header+table+values"] += int(offset.min())
    return split


def _computed_overhead(lengths: np.ndarray, measured: dict[str, int], n: int, mean: float) -> dict[str, float]:
    """The split of ``_overhead`` computed, not measured, for images of ``lengths`` scaled to
    a ``mean`` bytes: padding from the writer's rule (``place``) over one shard's worth of
    them, repeated; header, table, values and ``index.json`` as measured per sample."""
    scaled = np.maximum(1, np.round(lengths * (mean / lengths.mean()))).astype(np.int64)
    shard = np.resize(scaled, max(1, int(gpuio.config.get("pack_shard_size") // mean)))
    pages, blocks = _padding(place(shard, 0), shard)
    per_image = {"padding, 4 KiB starts": pages / len(shard), "padding, 4 MiB blocks": blocks / len(shard),
                 "header+table+values": measured["header+table+values"] / n, "index.json": measured["index.json"] / n}
    return {k: v / mean for k, v in per_image.items()}


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


def _loader_pass(index: gpuio.SampleIndex, batch: int) -> None:
    """A pass of a new Loader over the records of ``index``'s data field, in order, as
    they are (no ops): its reads, read-ahead and hand-over."""
    for _ in gpuio.Loader(index, batch, fields=("data",), output="numpy"):
        pass


def _no_read_ahead(index: gpuio.SampleIndex, batch: int) -> None:
    """The cold reads of ``storage.measure``'s gpuio row (batches in order, a new Reader)
    with the Reader's read-ahead off."""
    with gpuio.config.override(read_ahead=0), gpuio.Reader("cpu") as reader:
        for start in range(0, len(index), batch):
            reader.read(index, np.arange(start, min(start + batch, len(index))))


def _small_batches(index: gpuio.SampleIndex, batch: int, repeat: int) -> dict[str, Any]:
    """Cold passes of a Reader over the records of ``index`` in order, in batches of
    ``batch``, with the read-ahead on and with ``read_ahead=0``, alternating which goes
    first, the best of ``repeat`` each: the read-ahead must not cost small batches more
    than it saves."""
    paths, n = index.files.many(np.arange(len(index.files))), len(index)
    best = {"on": float("inf"), "off": float("inf")}

    def cold_pass(way: str) -> float:
        drop_cache(paths)
        with gpuio.config.override(**({"read_ahead": 0} if way == "off" else {})), gpuio.Reader("cpu") as reader:
            t0 = time.perf_counter()
            for start in range(0, n, batch):
                reader.read(index, np.arange(start, min(start + batch, n)))
            return time.perf_counter() - t0

    for r in range(repeat):
        for way in ("on", "off") if r % 2 == 0 else ("off", "on"):
            best[way] = min(best[way], cold_pass(way))
    return {"row": f"cold: gpuio.Reader, batches of {batch} in order, vs read_ahead=0", "s": best["on"],
            "MB_s": index.nbytes("data") / best["on"] / 1e6, "ratio": best["off"] / best["on"]}


def _ceiling(root: str, pipeline: str, batch: int, count: int) -> float:
    run = images.decode_only(root, batch, os.cpu_count() or 1, count, pipeline)
    return _timed(lambda: list(run()))


def _write_and_run(args: argparse.Namespace, root: str, src: gpuio.SampleIndex, dest: str, work: str,
                   keep: gpuio.ImagePolicy) -> list[dict[str, Any]]:
    """The rows of the writers, the sizes and the chains (all but the cold reads)."""
    rows: list[dict[str, Any]] = []
    n, source_bytes = len(src), src.nbytes("data")
    packed = gpuio.formats.packed(dest)
    t_pack = _best(lambda out: gpuio.pack(src, out, workers=args.workers, images=keep), work, args.repeat)
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
    split = _overhead(packed, dest)
    packed_bytes = sum(split.values())
    rows.append({"row": "size: packed / source", "bytes": packed_bytes, "ratio": packed_bytes / source_bytes})
    computed = _computed_overhead(src.extents["data"].length.astype(np.int64), split, n, args.computed_mean)
    for part, nbytes in split.items():
        if part != "records":
            rows.append({"row": f"size: {part}", "bytes": nbytes, "share": nbytes / source_bytes})
    for part, share in {**computed, "all overhead": sum(computed.values())}.items():
        rows.append({"row": f"size: {part}, {args.computed_mean / 1e3:.0f} KB mean (computed)", "share": share})
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
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2000, help="images in the sample dataset")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each row; the fastest counts")
    parser.add_argument("--restart-interval", default="",
                        help="also pack with restart markers every N MCUs (a comma list: one pack each) and run "
                             "the chains on each")
    parser.add_argument("--cold-repeat", type=int, default=10,
                        help="rounds of the cold reads (gpuio's and each way of the ceiling); the fastest counts")
    parser.add_argument("--computed-mean", type=float, default=110e3,
                        help="also compute the size overhead for images of this mean size in bytes (ImageNet's: "
                             "about 110 KB)")
    parser.add_argument("--only", choices=("cold",), help="only the cold reads (of a pass-through pack)")
    parser.add_argument("--out", default=os.path.join(cache_dir(), "results", "bench-pack.json"))
    args = parser.parse_args(argv)
    root = sample_root(args.count)
    src = gpuio.storage.learn_lengths(gpuio.formats.filetree(root))
    n, source_bytes = len(src), src.nbytes("data")
    work = tempfile.mkdtemp(prefix="gpuio-bench-pack-", dir=cache_dir())
    rows: list[dict[str, Any]] = []
    loadavg = [os.getloadavg()]  # the machine's other load, at the start and the end
    print(f"{n} images, {source_bytes / 1e6:.1f} MB, from {root}; {args.workers} workers; {machine()['cpu']}; "
          f"load average {loadavg[0][0]:.1f}")
    try:
        _samples(src, range(n))  # the source read once: every writer starts from a warm page cache
        dest = os.path.join(work, "packed")
        keep = gpuio.ImagePolicy(restart_interval=0)  # pass-through, as the other writers store the images
        gpuio.pack(src, dest, workers=args.workers, images=keep)
        packed = gpuio.formats.packed(dest)
        if args.only != "cold":
            rows += _write_and_run(args, root, src, dest, work, keep)
        records = [_records_file(packed, os.path.join(work, "records.bin"))]
        bounds = (storage.SEQUENTIAL, storage.PARALLEL, storage.PARTS, storage.DIRECT, storage.DIRECT_DEEP)
        for batch in dict.fromkeys((args.batch, n)):  # the Loader's batches, and one batch of every record
            ways = {"gpuio": "gpuio.Reader", "gpuio.Loader": "gpuio.Loader, data only",
                    "no read-ahead": "gpuio.Reader, read_ahead=0"}
            cold = storage.measure("packed", packed, records, batch=batch, repeat=args.cold_repeat, caches=("cold",),
                                   more={"gpuio.Loader": functools.partial(_loader_pass, packed, batch),
                                         "no read-ahead": functools.partial(_no_read_ahead, packed, batch)})
            for r in cold:
                if r["method"] in ways:
                    way = ways[r["method"]]
                    rows.append({"row": f"cold: {way}, batches of {batch}, vs ceiling", "s": r.get("seconds"),
                                 "MB_s": r["GB/s"] * 1e3 if "GB/s" in r else None, "ratio": r.get("vs ceiling"),
                                 **({"why": r["failed"]} if "failed" in r else {})})
            ways = sorted((r for r in cold if r["method"] in bounds and "seconds" in r), key=lambda r: r["seconds"])
            rows += [{"row": f"cold: {r['method']}, the records in one file", "s": r["seconds"],
                      "MB_s": r["GB/s"] * 1e3, "ratio": r["vs ceiling"]} for r in ways]
        rows.append(_small_batches(packed, 16, args.cold_repeat))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loadavg.append(os.getloadavg())
    print(f"{'row':60s} {'seconds':>8s} {'figure':>14s} {'ratio':>7s}")
    for r in rows:
        figure = (f"{r['img_s']:.0f} img/s" if "img_s" in r else f"{r['MB_s']:.0f} MB/s" if r.get("MB_s")
                  else f"{r['share']:.2%}" if "share" in r else f"{r['bytes'] / 1e6:.1f} MB" if "bytes" in r else "")
        secs = f"{r['s']:.3f}" if r.get("s") is not None else "-"
        ratio = f"{r['ratio']:.2f}" if r.get("ratio") else ""
        print(f"{r['row']:60s} {secs:>8s} {figure:>14s} {ratio:>7s}" + (f"  {r['why']}" if "why" in r else ""))
    print(f"load average (1, 5, 15 min): start {', '.join(f'{v:.1f}' for v in loadavg[0])}; "
          f"end {', '.join(f'{v:.1f}' for v in loadavg[1])}")
    result = {"machine": machine(), "load_average": {"start": loadavg[0], "end": loadavg[1]}, "count": n,
              "source_bytes": source_bytes, "workers": args.workers, "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"results: {args.out}")
    return result


if __name__ == "__main__":
    main()
