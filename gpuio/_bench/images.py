"""Image pipeline benchmark: decode, random resized crop 224, flip, normalize to float
CHW, batches of 256, over ImageNet-like JPEGs from ``gpuio.sample``.

    python bench/images.py [--count 2000] [--batch 256] [--epochs 2] [--out images.json]

Competitors, measured in one run (images/s of the best epoch, page cache warm):
gpuio on the CPU (``gpuio.Loader`` + ``ops.Compose``), ``torch.utils.data.DataLoader``
with Pillow doing the same ops (workers = cores; the baseline of the ratios), NVIDIA
DALI's CPU pipeline when installed; on a GPU machine also gpuio on the GPU (fused
kernel) and torchvision's batched ``decode_jpeg(device="cuda")`` + torch ops.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import Any

import numpy as np

import gpuio
from gpuio import ops
from gpuio._bench.chart import Group, write_chart
from gpuio._bench.common import BenchError, machine, print_table, sample_root, write_json

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def _rounds(runs: dict[str, Any], epochs: int, count: int) -> tuple[dict[str, float], dict[str, str]]:
    """Images/s of each competitor's fastest pass, and the error of each that failed.
    One untimed pass each first (workers, decoders and caches warm up), then ``epochs``
    rounds that run every competitor once, so that drift of the machine hits them
    alike. A competitor that fails drops out with its whole error; the others go on."""
    from tqdm import tqdm

    best = dict.fromkeys(runs, float("inf"))
    failed: dict[str, str] = {}
    with tqdm(total=(epochs + 1) * len(runs), desc="image pipelines", unit="pass", leave=False) as bar:
        for timed in [False] + [True] * epochs:
            for name, run in runs.items():
                bar.update()
                if name in failed:
                    continue
                try:
                    seen = 0
                    t0 = time.perf_counter()
                    for images in run():
                        seen += int(images.shape[0])
                    if seen != count:
                        raise RuntimeError(f"a pass yielded {seen} images, expected {count}")
                except Exception as exc:  # a competitor's failure is a result to report, not a crash
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                if timed:
                    best[name] = min(best[name], time.perf_counter() - t0)
    return {name: count / t for name, t in best.items() if name not in failed}, failed


def gpuio_loader(root: str, batch: int, device: str) -> Any:
    pipe = ops.Compose([ops.decode_image(), ops.random_resized_crop(224), ops.flip(), ops.normalize(MEAN, STD)])
    loader = gpuio.Loader(gpuio.formats.filetree(root), batch, fields=("data", "label"), ops=[pipe],
                          device=device, output=_output(), shuffle=True)
    sync = _cuda_sync() if device == "cuda" else (lambda: None)

    def run():
        for b in loader:
            yield b["image"]
        sync()

    return run


def _output() -> str:
    """torch tensors where torch is installed (the DataLoader's output), else NumPy."""
    import importlib.util

    return "torch" if importlib.util.find_spec("torch") is not None else "numpy"


def _cuda_sync():
    import torch

    return torch.cuda.synchronize


class PillowImageFolder:
    """What torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip +
    ToTensor + Normalize do, written with Pillow and torch (torchvision is not needed)."""

    def __init__(self, root: str) -> None:
        index = gpuio.formats.filetree(root)
        self.paths = list(index.files)  # absolute paths
        self.labels = np.asarray(index.values["label"])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import torch
        from PIL import Image

        with Image.open(self.paths[i]) as im:
            img = im.convert("RGB")
        w, h = img.size
        top, left, ch, cw = _rrc_box(h, w)
        img = img.resize((224, 224), Image.BILINEAR, box=(left, top, left + cw, top + ch), reducing_gap=None)
        if random.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float().div_(255)
        x = x.sub_(torch.tensor([0.485, 0.456, 0.406])[:, None, None]).div_(torch.tensor([0.229, 0.224, 0.225])[:, None, None])
        return x, int(self.labels[i])


def _rrc_box(h: int, w: int) -> tuple[int, int, int, int]:
    area = h * w
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        aspect = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return random.randint(0, h - ch), random.randint(0, w - cw), ch, cw
    side = min(h, w)
    return (h - side) // 2, (w - side) // 2, side, side


def torch_dataloader(root: str, batch: int, workers: int) -> Any:
    import torch

    loader = torch.utils.data.DataLoader(PillowImageFolder(root), batch_size=batch, shuffle=True,
                                         num_workers=workers, persistent_workers=workers > 0)

    def run():
        for images, _ in loader:
            yield images

    return run


def dali_cpu(root: str, batch: int, threads: int, count: int) -> Any:
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=True, name="reader")
        images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
        images = fn.random_resized_crop(images, size=(224, 224))
        return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=MEAN, std=STD,
                                        mirror=fn.random.coin_flip()), labels

    p = pipe()
    p.build()
    steps = math.ceil(count / batch)

    def run():
        for k in range(steps):
            images, _ = p.run()
            yield np.empty((min(batch, count - k * batch), 0))  # DALI pads the last batch

    return run


def torchvision_gpu(root: str, batch: int) -> Any:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg, read_file
    from torchvision.transforms import v2

    paths = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".jpg")]
    mean = torch.tensor(MEAN, device="cuda")[:, None, None]
    std = torch.tensor(STD, device="cuda")[:, None, None]
    crop = v2.RandomResizedCrop(224, antialias=True)
    flip = v2.RandomHorizontalFlip()

    def run():
        order = np.random.permutation(len(paths))
        for s in range(0, len(paths), batch):
            data = [read_file(paths[i]) for i in order[s:s + batch]]
            images = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
            out = torch.stack([flip(crop(im)) for im in images]).float()
            yield (out - mean) / std
        torch.cuda.synchronize()

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="a JPEG file tree (default: the gpuio sample dataset)")
    parser.add_argument("--count", type=int, default=2000, help="images in the sample dataset")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2, help="passes per competitor; the best counts")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    root = args.root or sample_root(args.count)
    count = len(gpuio.formats.filetree(root))
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, GPUs: {info['gpus']}"
          + (f" ({info['gpu']})" if "gpu" in info else ""))
    print(f"dataset: {root}: {count} JPEGs; batch {args.batch}; decode, random resized crop 224, flip, "
          f"normalize to float32 CHW; best of {args.epochs} epochs")
    makers = [("gpuio cpu (Loader + ops.Compose)", lambda: gpuio_loader(root, args.batch, "cpu")),
              (f"torch DataLoader + Pillow ({args.workers} workers)",
               lambda: torch_dataloader(root, args.batch, args.workers)),
              ("DALI cpu pipeline", lambda: dali_cpu(root, args.batch, args.workers, count))]
    if gpuio.cuda_available():
        makers += [("gpuio cuda (fused kernel)", lambda: gpuio_loader(root, args.batch, "cuda")),
                   ("torchvision decode_jpeg cuda + torch ops", lambda: torchvision_gpu(root, args.batch))]
    else:
        print("no GPU: the gpuio cuda and torchvision GPU rows are not run")
    rows, runs = [], {}
    for name, make in makers:
        row: dict[str, Any] = {"name": name}
        try:
            runs[name] = make()
        except ImportError as exc:
            row["note"] = f"not installed ({exc.name})"
        rows.append(row)
    speeds, failed = _rounds(runs, args.epochs, count)
    for row in rows:
        if row["name"] in speeds:
            row["images_s"] = speeds[row["name"]]
        if row["name"] in failed:
            row["note"], row["error"] = "failed (below)", failed[row["name"]]
    base = next((r.get("images_s") for r in rows if r["name"].startswith("torch DataLoader")), None)
    for r in rows:
        if r.get("images_s") and base:
            r["ratio"] = r["images_s"] / base
    print_table(rows, [("name", "pipeline", "s"), ("images_s", "images/s", ".1f"),
                       ("ratio", "vs torch DataLoader", ".2f"), ("note", "note", "s")])
    payload = {"benchmark": "images", "machine": info, "dataset": {"root": root, "images": count},
               "batch": args.batch, "epochs": args.epochs, "results": rows}
    for name, error in failed.items():
        print(f"{name} failed: {error}")
    write_json(args.out, payload)
    if args.out:
        chart = Group("decode, random resized crop 224, flip, normalize", [(r["name"], r.get("images_s")) for r in rows],
                      notes={r["name"]: r["note"] for r in rows if r.get("note")})
        print(f"wrote {write_chart(os.path.splitext(args.out)[0] + '.png', 'gpuio image pipeline benchmark', 'images/s', [chart])}")
    ours = {name: error for name, error in failed.items() if name.startswith("gpuio")}
    if ours:
        raise BenchError("gpuio's own pipeline failed: " + "; ".join(f"{n}: {e}" for n, e in ours.items()))
    return payload


if __name__ == "__main__":
    main()
