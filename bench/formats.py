"""Datasets from other libraries: the same ImageNet-like sample (``gpuio.sample``'s JPEGs
and labels) written by each library's own writer, then, per format, in one run:

- **index**: ``formats.<name>(...)`` time and the bytes it read (``index.meta``), against
  the data's size;
- **epoch**: images/s of an epoch of decode, random resized crop 224, flip and normalize
  (float32 CHW), batches of ``--batch``: ``gpuio.Loader`` with ``--threads`` threads
  against that library's own loader with the same work in as many worker processes
  (Hugging Face: ``datasets`` + ``set_transform`` + ``torch.utils.data.DataLoader``);
  each competitor's best of ``--epochs`` interleaved passes;
- **raw**: MB/s of reading the image column's bytes, every row in file order: ``gpuio.read``
  against pyarrow's ``ParquetFile.read_row_group`` (Parquet only).

Formats: ``hf-parquet`` (``Dataset.to_parquet``: uncompressed PLAIN image pages, exact
extents), ``pyarrow-parquet`` (``pyarrow.parquet.write_table`` defaults: snappy +
dictionary, decompressed once at indexing), ``pyarrow-zstd`` (zstd without a dictionary,
pages of about 1 MB: page extents, decompressed once per batch), ``hf-arrow`` (``save_to_disk``).

Also ``mds`` (mosaicml-streaming's ``MDSWriter``, uncompressed: samples read in place),
``litdata`` (``litdata.optimize``, uncompressed), ``array_record`` (array_record's writer,
``group_size:1`` and its default zstd: each record's chunk, decompressed by the parse
step) and ``array_record-plain`` (uncompressed), each against that library's own loader
(``StreamingDataset`` + ``DataLoader``, ``litdata.StreamingDataLoader``, Grain's
``DataLoader`` over ``ArrayRecordDataSource``) with the same Pillow work per image.

``--remote``: ``hf-parquet`` in SeaweedFS (started on loopback), the two ways to index it
side by side: page extents read through the node-local cache (what ``formats.parquet``
does) against a one-time scan (the object copied whole through the cache, then exact
extents), each with the first (shuffled, raw bytes) epoch after it and the bytes each
downloads.

    python bench/formats.py [--count 1000] [--batch 64] [--threads 2] [--epochs 2] [--remote] [--out formats.json]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import gpuio
from gpuio import ops
from gpuio.bench._common import interleaved_rounds, machine, print_table, sample_root, streaming_module, write_json

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def write_datasets(root: str, folder: str) -> dict[str, Any]:
    """The sample tree as a ``datasets`` Dataset (``Image()`` + ``ClassLabel``) written by
    each writer; ``{format: paths}``."""
    import datasets
    import pyarrow.parquet as pq

    tree = gpuio.formats.filetree(root)
    names = sorted({os.path.basename(os.path.dirname(p)) for p in tree.files})
    images = [{"bytes": open(p, "rb").read(), "path": os.path.basename(p)} for p in tree.files]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    ds = datasets.Dataset.from_dict({"image": images, "label": np.asarray(tree.values["label"]).tolist()},
                                    features=features)
    out = {"hf-parquet": os.path.join(folder, "hf.parquet"), "pyarrow-parquet": os.path.join(folder, "pa.parquet"),
           "pyarrow-zstd": os.path.join(folder, "zstd.parquet"), "hf-arrow": os.path.join(folder, "hf-arrow")}
    if not os.path.exists(out["hf-arrow"]):
        ds.to_parquet(out["hf-parquet"])
        table = pq.read_table(out["hf-parquet"])
        pq.write_table(table, out["pyarrow-parquet"])  # pyarrow's defaults: snappy + dictionary
        pq.write_table(table, out["pyarrow-zstd"], compression="zstd", use_dictionary=False,
                       write_batch_size=16)  # pages of about 1 MB: page units
        ds.save_to_disk(out["hf-arrow"])
    out["hf-arrow"] = os.path.join(out["hf-arrow"], "data-*.arrow")
    return out


def make_index(name: str, path: str) -> Any:
    if name in STREAMING:
        return STREAMING[name](path)
    return gpuio.formats.arrow(path) if name.endswith("arrow") else gpuio.formats.parquet(path)


def index_rows(name: str, path: str) -> list[dict[str, Any]]:
    """Indexing twice: the first time (a dictionary chunk's decompressed copy made) and again."""
    rows = []
    for when in ("first", "again"):
        t0 = time.perf_counter()
        index = make_index(name, path)
        seconds = time.perf_counter() - t0
        read, size = index.meta["index_bytes_read"], index.meta["data_bytes"]
        kind = index.meta.get("extents", {"image.bytes": "exact"})["image.bytes"] if name not in STREAMING else (
            "chunk, parse step" if name == "array_record" else "in place")
        rows.append({"format": name, "when": when, "samples": len(index), "index_s": seconds, "read_kb": read / 1024,
                     "read_pct": 100 * read / size, "data_mb": size / 1e6,
                     "extents": f"{kind}{' (decompressed copy)' if index.meta.get('decompressed') else ''}"})
    return rows


def gpuio_epoch(index: Any, batch: int, threads: int) -> Callable[[], Iterator[Any]]:
    pipe = ops.Compose([ops.decode_image(), ops.random_resized_crop(224), ops.flip(), ops.normalize(MEAN, STD)])
    loader = gpuio.Loader(index, batch, ops=[pipe], shuffle=True, last_batch="drop", threads=threads,
                          output="torch")

    def run() -> Iterator[Any]:
        for b in loader:
            yield b["image"]

    return run


def pillow_train(img: Any) -> Any:
    """torchvision's RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize
    on a PIL image, in Pillow and torch (torchvision is not needed): what a `datasets`
    user's ``set_transform`` runs."""
    import torch
    from PIL import Image

    img = img.convert("RGB")
    w, h = img.size
    top, left, ch, cw = (h - min(h, w)) // 2, (w - min(h, w)) // 2, min(h, w), min(h, w)  # the fallback: a centre
    for _ in range(10):
        target, aspect = h * w * random.uniform(0.08, 1.0), math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw_, ch_ = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw_ <= w and 0 < ch_ <= h:
            top, left, ch, cw = random.randint(0, h - ch_), random.randint(0, w - cw_), ch_, cw_
            break
    img = img.resize((224, 224), Image.BILINEAR, box=(left, top, left + cw, top + ch), reducing_gap=None)
    if random.random() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div_(255)
    mean, std = torch.tensor([0.485, 0.456, 0.406])[:, None, None], torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    return x.sub_(mean).div_(std)


def hf_epoch(name: str, path: str, batch: int, workers: int) -> Callable[[], Iterator[Any]]:
    """``datasets`` + ``set_transform`` + torch DataLoader: what a Hugging Face user writes."""
    import datasets
    import torch

    if name.endswith("arrow"):
        ds = datasets.load_from_disk(os.path.dirname(path))
    else:
        ds = datasets.Dataset.from_parquet(path)

    def apply(rows: dict[str, list[Any]]) -> dict[str, list[Any]]:
        return {"image": [pillow_train(im) for im in rows["image"]], "label": rows["label"]}

    ds.set_transform(apply)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True, num_workers=workers,
                                         persistent_workers=workers > 0)

    def run() -> Iterator[Any]:
        for b in loader:
            yield b["image"]

    return run


def raw_rows(name: str, path: str, batch: int) -> list[dict[str, Any]]:
    """MB/s of the image column's bytes in file order: gpuio.read against read_row_group."""
    import pyarrow.parquet as pq

    index = make_index(name, path)
    field = "image.bytes"

    def gpuio_read() -> int:
        total = 0
        for start in range(0, len(index), batch):
            total += sum(len(v) for v in gpuio.read(index, np.arange(start, min(start + batch, len(index))), field))
        return total

    def pyarrow_read() -> int:
        f = pq.ParquetFile(path)
        total = 0
        for g in range(f.num_row_groups):
            col = f.read_row_group(g, columns=["image"]).column("image").combine_chunks().field("bytes")
            total += col.buffers()[2].size if col.buffers()[2] is not None else 0
        return total

    rows = []
    for label, fn in (("gpuio.read", gpuio_read), ("pyarrow read_row_group", pyarrow_read)):
        fn()  # page cache warm, imports done
        best, nbytes = float("inf"), 0
        for _ in range(3):
            t0 = time.perf_counter()
            nbytes = fn()
            best = min(best, time.perf_counter() - t0)
        rows.append({"format": name, "reader": label, "mb_s": nbytes / best / 1e6})
    rows[0]["ratio"] = rows[0]["mb_s"] / rows[1]["mb_s"]
    return rows


def remote_rows(paths: dict[str, str], batch: int, folder: str) -> list[dict[str, Any]]:
    """Parquet in SeaweedFS: page extents through the cache against a one-time scan."""
    from gpuio.bench.remote import SeaweedServer
    from gpuio.index import PathTable, SampleIndex
    from gpuio.storage import remote

    key, secret = "benchKey", "benchSecret0123456789"
    server = SeaweedServer(os.path.join(folder, "weed"), key, secret)
    rows = []
    try:
        os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret,
                          AWS_REGION="us-east-1")
        import boto3

        s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                          region_name="us-east-1")
        for _ in range(60):
            try:
                s3.create_bucket(Bucket="bench")
                break
            except Exception:  # the gateway is still starting
                time.sleep(1)
        fetched = _Fetched()
        remote.watch_fetches(fetched)
        for name in ("hf-parquet",):  # pyarrow's dictionary chunks are decompressed at indexing either way
            s3.upload_file(paths[name], "bench", f"{name}.parquet")
            url = f"s3://bench/{name}.parquet"
            for way in ("page extents via cache", "one-time scan"):
                os.environ["GPUIO_REMOTE_CACHE_DIR"] = tempfile.mkdtemp(dir=folder)
                remote.reset_client()
                fetched.nbytes = 0
                t0 = time.perf_counter()
                if way == "one-time scan":
                    whole = SampleIndex(PathTable.from_paths([url]), {"data": gpuio.index.Extents(
                        np.zeros(1, np.int32), np.zeros(1, np.int64), np.array([remote.client().head(url).size]))},
                        meta=remote.object_versions([url]))
                    copy = os.path.join(folder, "copy.parquet")
                    with open(copy, "wb") as f:
                        f.write(gpuio.read(whole, [0], "data")[0].tobytes())
                    exact = gpuio.formats.parquet(copy)
                    index = SampleIndex(PathTable.from_paths([url]), exact.extents, exact.values,
                                        meta={**exact.meta, **remote.object_versions([url])})
                else:
                    index = gpuio.formats.parquet(url)
                index_s, index_bytes = time.perf_counter() - t0, fetched.nbytes
                fetched.nbytes = 0
                t0 = time.perf_counter()
                field = "image.bytes"
                order = np.random.default_rng(0).permutation(len(index))
                for start in range(0, len(index), batch):
                    gpuio.storage.read_fields(index, order[start: start + batch], (field,))
                epoch_s = time.perf_counter() - t0
                rows.append({"format": name, "way": way, "index_s": index_s, "index_mb": index_bytes / 1e6,
                             "epoch1_s": epoch_s, "epoch1_mb": fetched.nbytes / 1e6,
                             "total_s": index_s + epoch_s})
    finally:
        server.stop()
        remote.reset_client()
    return rows


class _Fetched:
    """Counts the bytes of every ranged GET (``remote.watch_fetches``)."""

    def __init__(self) -> None:
        self.nbytes = 0

    def fetched(self, seconds: float, nbytes: int) -> None:
        self.nbytes += nbytes


def _sample(path_label: tuple[str, int]) -> dict[str, Any]:
    """One LitData sample (module level: optimize's workers call it): the JPEG as the file
    holds it, and its label."""
    from PIL import Image

    path, label = path_label
    return {"image": Image.open(path), "label": label}


def write_streaming(root: str, folder: str) -> dict[str, str]:
    """The sample tree written by mosaicml-streaming's MDSWriter, litdata.optimize and
    array_record's writer (zstd, its default, and uncompressed), each once."""
    from array_record.python.array_record_module import ArrayRecordWriter
    from PIL import Image

    tree = gpuio.formats.filetree(root)
    files, labels = list(tree.files), np.asarray(tree.values["label"]).tolist()
    out = {"mds": os.path.join(folder, "mds"), "litdata": os.path.join(folder, "litdata"),
           "array_record": os.path.join(folder, "zstd.array_record"),
           "array_record-plain": os.path.join(folder, "plain.array_record")}
    if not os.path.exists(out["mds"]):
        writer = streaming_module("streaming.base.format.mds.writer").MDSWriter
        with writer(out=out["mds"], columns={"image": "jpeg", "label": "int"}) as w:
            for p, label in zip(files, labels):
                w.write({"image": Image.open(p), "label": label})
    if not os.path.exists(os.path.join(out["litdata"], "index.json")):
        import multiprocessing

        import litdata

        method = multiprocessing.get_start_method(allow_none=True)
        litdata.optimize(fn=_sample, inputs=list(zip(files, labels)), output_dir=out["litdata"],
                         chunk_bytes="64MB", num_workers=1, mode="overwrite")
        multiprocessing.set_start_method(method, force=True)  # optimize sets spawn for the whole process
    for name, options in (("array_record", "group_size:1"), ("array_record-plain", "group_size:1,uncompressed")):
        if not os.path.exists(out[name]):
            w = ArrayRecordWriter(out[name], options)
            for p in files:
                w.write(open(p, "rb").read())
            w.close()
    return out


def _train_classes() -> dict[str, Callable[[], type]]:
    """Makers of the library-based classes the competitors' worker processes unpickle by
    name (each base class comes from a library imported only when its row runs)."""

    def mds() -> type:
        base = streaming_module("streaming.base.dataset").StreamingDataset
        return type("MDSTrain", (base,), {"__getitem__": lambda self, i: self.train(base.__getitem__(self, i)["image"]),
                                          "__module__": __name__})

    def lit() -> type:
        import litdata

        def item(self: Any, i: Any) -> Any:  # its JPEG decoder needs torchvision: the bytes, decoded by Pillow
            from PIL import Image

            return self.train(Image.open(io.BytesIO(bytes(litdata.StreamingDataset.__getitem__(self, i)["image"]))))

        return type("LitTrain", (litdata.StreamingDataset,), {"__getitem__": item, "__module__": __name__})

    def grain_decode() -> type:
        import grain.python as grain

        def map_(self: Any, record: bytes) -> Any:
            from PIL import Image

            return self.train(Image.open(io.BytesIO(record))).numpy()

        return type("GrainDecode", (grain.MapTransform,), {"__init__": lambda self, train: setattr(self, "train", train),
                                                            "map": map_, "__module__": __name__})

    return {"MDSTrain": mds, "LitTrain": lit, "GrainDecode": grain_decode}


def __getattr__(name: str) -> Any:
    """``MDSTrain``, ``LitTrain`` and ``GrainDecode``, made on first use, here and in the
    loaders' worker processes."""
    makers = _train_classes()
    if name not in makers:
        raise AttributeError(name)
    cls = globals()[name] = makers[name]()
    return cls


def library_epoch(name: str, path: str, batch: int, workers: int, train: Callable[[Any], Any]
                  ) -> tuple[str, Callable[[], Iterator[Any]]]:
    """``(label, one pass)`` of the library's own loader with ``train`` (decode + augment
    of a PIL image) in ``workers`` processes."""
    import torch

    if name == "mds":
        ds = __getattr__("MDSTrain")(local=path, shuffle=True, batch_size=batch)
        ds.train = train
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers, drop_last=True,
                                             persistent_workers=workers > 0)
        return "StreamingDataset + DataLoader", lambda: iter(loader)
    if name == "litdata":
        import litdata
        from litdata.streaming.serializers import BytesSerializer

        ds = __getattr__("LitTrain")(path, shuffle=True, serializers={"jpeg": BytesSerializer()})
        ds.train = train
        loader = litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers, drop_last=True,
                                             persistent_workers=workers > 0)
        return "litdata StreamingDataLoader", lambda: iter(loader)
    import grain.python as grain
    from absl import flags
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    decode = __getattr__("GrainDecode")
    source = ArrayRecordDataSource([path])
    # one loader over endless epochs, each pass taking an epoch's batches: its workers
    # start once, as the other loaders' persistent workers do
    sampler = grain.IndexSampler(num_records=len(source), shard_options=grain.NoSharding(), shuffle=True,
                                 num_epochs=None, seed=0)
    batches = iter(grain.DataLoader(data_source=source, sampler=sampler, worker_count=workers,
                                    operations=[decode(train), grain.Batch(batch, drop_remainder=True)]))

    def run() -> Iterator[Any]:
        for _ in range(len(source) // batch):
            yield next(batches)

    return "Grain DataLoader", run


# the other libraries' formats: name -> the gpuio format that indexes it
STREAMING = {"mds": gpuio.formats.mds, "litdata": gpuio.formats.litdata, "array_record": gpuio.formats.array_record,
             "array_record-plain": gpuio.formats.array_record}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=1000, help="images in the sample (default 1000)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="gpuio's threads and the DataLoader's workers (default: the cores)")
    p.add_argument("--epochs", type=int, default=2, help="timed passes per competitor")
    p.add_argument("--remote", action="store_true", help="also Parquet in SeaweedFS: page extents against a scan")
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    random.seed(0)
    root = sample_root(args.count)
    folder = os.path.join(os.path.dirname(root), f"formats-{args.count}")
    os.makedirs(folder, exist_ok=True)
    paths = write_datasets(root, folder)
    paths.update(write_streaming(root, folder))
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; {args.count} JPEGs, batch {args.batch}, "
          f"{args.threads} threads / workers")

    index_table = [row for n, p in paths.items() for row in index_rows(n, p)]
    print("\nindexing")
    print_table(index_table, [("format", "format", ""), ("when", "when", ""), ("samples", "samples", "d"),
                              ("index_s", "seconds", ".3f"),
                              ("read_kb", "read KiB", ".1f"), ("read_pct", "% of data", ".3f"),
                              ("data_mb", "data MB", ".1f"), ("extents", "extents", "")])

    epoch_table = []
    for name, path in paths.items():
        own, run = (library_epoch(name, path, args.batch, args.threads, pillow_train) if name in STREAMING
                    else ("datasets + DataLoader", hf_epoch(name, path, args.batch, args.threads)))
        runs = {"gpuio Loader": gpuio_epoch(make_index(name, path), args.batch, args.threads), own: run}
        speed, failed = interleaved_rounds(runs, args.epochs, desc=name)
        for who in runs:
            epoch_table.append({"format": name, "loader": who, "images_s": speed.get(who),
                                "ratio": speed[who] / speed[own] if who in speed and own in speed else None,
                                "error": failed.get(who, "")})
        del runs, run  # the DataLoader's workers end before the next rows run
    print("\nepoch: decode, random resized crop 224, flip, normalize (images/s, best pass)")
    print_table(epoch_table, [("format", "format", ""), ("loader", "loader", ""), ("images_s", "images/s", ".1f"),
                              ("ratio", "x own loader", ".2f"), ("error", "error", "")])

    parquets = ("hf-parquet", "pyarrow-parquet", "pyarrow-zstd")
    raw_table = [r for n in parquets for r in raw_rows(n, paths[n], args.batch)]
    print("\nraw image column, file order (MB/s, best of 3, page cache warm)")
    print_table(raw_table, [("format", "format", ""), ("reader", "reader", ""), ("mb_s", "MB/s", ".1f"),
                            ("ratio", "x pyarrow", ".2f")])
    result = {"machine": info, "args": vars(args), "index": index_table, "epoch": epoch_table, "raw": raw_table}
    if args.remote:
        result["remote"] = remote_rows(paths, args.batch, folder)
        print("\nremote Parquet (SeaweedFS on loopback): index, then one shuffled epoch of raw bytes")
        print_table(result["remote"], [("format", "format", ""), ("way", "way", ""), ("index_s", "index s", ".2f"),
                                       ("index_mb", "index MB", ".2f"), ("epoch1_s", "epoch 1 s", ".2f"),
                                       ("epoch1_mb", "epoch 1 MB", ".1f"), ("total_s", "total s", ".2f")])
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
