"""The ``gpuio`` command: ``gpuio bench``, ``gpuio sample``, ``gpuio info``, ``gpuio serve``."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import numpy as np

import gpuio
from gpuio._bench.common import SAMPLE_COUNT, cache_dir, sample_root
from gpuio.errors import GpuioError
from gpuio.sample import make_image_tree

__all__ = ["main"]


def _index_for(path: str) -> gpuio.SampleIndex:
    if os.path.isfile(path):
        return gpuio.SampleIndex.load(path)
    return gpuio.formats.filetree(path)


def _cmd_bench(args: argparse.Namespace) -> None:
    from gpuio._bench import images, storage

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
    if not args.no_images:
        print()
        images.main(["--root", path, "--batch", str(args.batch), "--epochs", "2",
                     "--out", os.path.splitext(out)[0] + "-images.json"])


def _check_bench_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags that the chosen benchmark would ignore."""
    if args.storage:
        ignored = [flag for flag, value in (("PATH", args.path), ("--count", args.count),
                                           ("--no-images", args.no_images)) if value]
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


def _cmd_sample(args: argparse.Namespace) -> None:
    print(sample_root(args.count, args.seed) if args.out is None else _make(args))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
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
    print("settings:")
    for name, value in gpuio.config.settings().items():
        print(f"  {name:16s} {value!r:12}  {gpuio.config.DEFAULTS[name][1]}")


def _kvikio_report() -> str:
    """Whether kvikio loads (an installed kvikio may not: libcufile missing ...), and
    whether its reads would use GPUDirect Storage."""
    from gpuio._kvikio import compat_mode_active, kvikio_problem, load

    problem = kvikio_problem()
    if problem is not None:
        return f"installed, cannot be loaded: the GPU backend 'auto' uses posix. {problem}"
    kvikio = load()
    mode = kvikio.defaults.get("compat_mode").name  # an IntEnum: AUTO, ON or OFF
    how = "compat mode: POSIX reads + bounce buffers, no GDS" if compat_mode_active() else "GDS"
    return f"{kvikio.__version__} loads; compat_mode {mode} -> {how}"


def _cmd_serve(args: argparse.Namespace) -> None:
    import signal

    from gpuio import serve

    server = serve.Server(serve.parse_ops(args.ops), model=args.model, device=args.device, name=args.name,
                          http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          address=args.address, instances=args.instances, max_batch=args.max_batch)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop Triton cleanly on SIGTERM as on Ctrl-C
    with server:
        print(f"serving model {args.name!r} ({server.output} out): http {args.address}:{args.http_port}, "
              f"grpc {args.address}:{args.grpc_port}", flush=True)
        server.serve_forever()


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuio", description="Training data from storage into GPU tensors.")
    parser.add_argument("--version", action="version", version=f"gpuio {gpuio.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure read throughput against the simple ways and the ceilings")
    bench.add_argument("path", nargs="?", help="a file tree or a saved index (default: the sample dataset)")
    bench.add_argument("--storage", action="store_true",
                       help="the full storage benchmark: small files, large files, packed records")
    bench.add_argument("--size", choices=("tiny", "quick", "full"), help="dataset size for --storage (default: full)")
    bench.add_argument("--root", help="where --storage makes its datasets (default: the cache folder)")
    bench.add_argument("--count", type=_positive, help=f"images in the sample dataset (default: {SAMPLE_COUNT})")
    bench.add_argument("--batch", type=_positive, default=256)
    bench.add_argument("--repeat", type=_positive, default=3)
    bench.add_argument("--warm-only", action="store_true", help="skip the cold page cache runs")
    bench.add_argument("--no-images", action="store_true",
                       help="skip the image pipeline (decode, random resized crop, flip, normalize)")
    bench.add_argument("--out", help="the results as JSON here, the chart beside it as PNG "
                       "(default: results/bench.json in the cache folder)")
    bench.set_defaults(func=_cmd_bench)

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
    serve.add_argument("--address", default="0.0.0.0", help="interface to listen on (default: all)")
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
        args.func(args)
    except GpuioError as exc:
        print(f"gpuio: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.command == "bench":
        print(f"done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
