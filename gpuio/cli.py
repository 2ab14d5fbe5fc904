"""The ``gpuio`` command: ``gpuio bench``, ``gpuio sample``, ``gpuio info``."""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import numpy as np

import gpuio
from gpuio.errors import GpuioError

SAMPLE_COUNT = 2000


def sample_root(count: int = SAMPLE_COUNT, seed: int = 0) -> str:
    """The built-in sample dataset (ImageNet-like JPEGs), generated on first use."""
    from gpuio._bench.common import cache_dir
    from gpuio.sample import make_image_tree

    root = os.path.join(cache_dir(), f"sample-images-{count}-{seed}")
    if not os.path.exists(os.path.join(root, ".complete")):
        print(f"generating the sample dataset ({count} JPEGs) in {root}", file=sys.stderr)
        make_image_tree(root, count=count, seed=seed, progress=True)
        open(os.path.join(root, ".complete"), "w").close()
    return root


def _index_for(path: str) -> gpuio.SampleIndex:
    if os.path.isfile(path):
        return gpuio.SampleIndex.load(path)
    return gpuio.formats.filetree(path)


def cmd_bench(args: argparse.Namespace) -> None:
    from gpuio._bench import storage
    from gpuio._bench.common import cache_dir

    if args.storage:
        storage.run(args.root, args.size, args.batch, args.repeat, _caches(args), args.out)
        return
    path = args.path or sample_root(args.count)
    index = _index_for(path)
    paths = index.files.many(np.arange(len(index.files)))
    ceiling = []
    if index.nbytes() <= 2 << 30:  # same bytes as one file, for the sequential ceiling
        key = hashlib.sha1(("\0".join(paths)).encode()).hexdigest()[:12]
        ceiling = [storage.concat_files(paths, os.path.join(cache_dir(), f"ceiling-{key}.bin"))]
    print(f"{len(index)} samples, {index.nbytes() / 1e6:.1f} MB, from {path}")
    rows = storage.measure(os.path.basename(os.path.normpath(path)), index, ceiling, batch=args.batch,
                           repeat=args.repeat, caches=_caches(args))
    storage.report("gpuio read benchmark", rows, args.out, {"dataset": path})
    if not args.no_images:
        from gpuio._bench import images

        print()
        images.main(["--root", path, "--batch", str(args.batch), "--epochs", "2"]
                    + (["--out", args.out.replace(".json", "-images.json")] if args.out else []))


def _caches(args: argparse.Namespace) -> tuple[str, ...]:
    return ("warm",) if args.warm_only else ("warm", "cold")


def cmd_sample(args: argparse.Namespace) -> None:
    print(sample_root(args.count, args.seed) if args.out is None else _make(args))


def _make(args: argparse.Namespace) -> str:
    from gpuio.sample import make_image_tree

    return make_image_tree(args.out, count=args.count, seed=args.seed, progress=True)


def cmd_info(args: argparse.Namespace) -> None:
    import importlib.util

    print(f"gpuio {gpuio.__version__}")
    print(f"GPUs visible: {gpuio.gpu_count()}")
    for pkg in ("cupy", "kvikio", "nvidia.nvimgcodec", "PyNvVideoCodec", "torch"):
        try:
            found = importlib.util.find_spec(pkg) is not None
        except ModuleNotFoundError:
            found = False
        print(f"  {pkg:18s} {'installed' if found else 'not installed'}")
    print("settings:")
    for name, value in gpuio.config.settings().items():
        print(f"  {name:16s} {value!r:12}  {gpuio.config.DEFAULTS[name][1]}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuio", description="Training data from storage into GPU tensors.")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure read throughput against the simple ways and the ceilings")
    bench.add_argument("path", nargs="?", help="a file tree or a saved index (default: the sample dataset)")
    bench.add_argument("--storage", action="store_true",
                       help="the full storage benchmark: small files, large files, packed records")
    bench.add_argument("--size", choices=("tiny", "quick", "full"), default="full", help="dataset size for --storage")
    bench.add_argument("--root", help="where --storage makes its datasets (default: the cache folder)")
    bench.add_argument("--count", type=int, default=SAMPLE_COUNT, help="images in the sample dataset")
    bench.add_argument("--batch", type=int, default=256)
    bench.add_argument("--repeat", type=int, default=3)
    bench.add_argument("--warm-only", action="store_true", help="skip the cold page cache runs")
    bench.add_argument("--no-images", action="store_true",
                       help="skip the image pipeline (decode, random resized crop, flip, normalize)")
    bench.add_argument("--out", help="write the results as JSON here")
    bench.set_defaults(func=cmd_bench)

    sample = sub.add_parser("sample", help="generate the sample dataset and print its path")
    sample.add_argument("--out", help="folder to write to (default: the cache folder)")
    sample.add_argument("--count", type=int, default=SAMPLE_COUNT)
    sample.add_argument("--seed", type=int, default=0)
    sample.set_defaults(func=cmd_sample)

    info = sub.add_parser("info", help="GPUs, installed GPU packages and settings")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
