"""Image pipeline benchmark over ImageNet-like JPEGs from ``gpuio.sample``, batches of
64: ``train`` (decode, random resized crop 224, flip, normalize to float32 CHW) and
``val`` (decode, resize to 224x224, normalize to float32 CHW).

    python bench/images.py [--count 2000] [--batch 64] [--epochs 2] [--pipeline both] [--out images.json]

Competitors, measured in one run, all in interleaved rounds (images/s of the best epoch,
page cache warm): gpuio on the CPU (``gpuio.Loader`` + ``ops.Compose``),
``torch.utils.data.DataLoader`` with Pillow doing the same ops (workers = cores; the
baseline of the ratios), NVIDIA DALI's CPU pipeline (``pip install gpuio[bench]``;
``device_id=None``, ``num_threads`` = cores: ``readers.file`` ->
``decoders.image_random_crop`` or ``decoders.image`` -> ``resize`` ->
``crop_mirror_normalize``); on a GPU machine also gpuio on the GPU (fused kernel) and
torchvision's batched ``decode_jpeg(device="cuda")`` + torch ops. For ``val`` it also
prints the mean difference between gpuio's and DALI's outputs on the same images. For the
competitors that run in this process (gpuio, DALI) it also prints the process CPU time
per image of their cheapest pass, which a loaded machine moves less than images/s (the
DataLoader's workers are other processes; DALI's work ahead of its pass falls partly in
the next competitor's pass).
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
from gpuio.bench._chart import Group, write_chart
from gpuio.bench._common import BenchError, interleaved_rounds, machine, print_table, sample_root, write_json

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


PIPELINES = {"train": "decode, random resized crop 224, flip, normalize to float32 CHW",
             "val": "decode, resize 224x224, normalize to float32 CHW"}


def gpuio_ops(pipeline: str) -> Any:
    geometry = [ops.random_resized_crop(224), ops.flip()] if pipeline == "train" else [ops.resize((224, 224))]
    return ops.Compose([ops.decode_image(), *geometry, ops.normalize(MEAN, STD)])


def gpuio_loader(root: str, batch: int, device: str, pipeline: str = "train") -> Any:
    pipe = gpuio_ops(pipeline)
    loader = gpuio.Loader(gpuio.formats.filetree(root), batch, fields=("data", "label"), ops=[pipe],
                          device=device, output=_output(), shuffle=True, last_batch="drop")
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

    def __init__(self, root: str, train: bool = True) -> None:
        self.train = train
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
        top, left, ch, cw = _rrc_box(h, w) if self.train else (0, 0, h, w)
        img = img.resize((224, 224), Image.BILINEAR, box=(left, top, left + cw, top + ch), reducing_gap=None)
        if self.train and random.random() < 0.5:
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


def torch_dataloader(root: str, batch: int, workers: int, pipeline: str = "train") -> Any:
    import torch

    loader = torch.utils.data.DataLoader(PillowImageFolder(root, pipeline == "train"), batch_size=batch, shuffle=True,
                                         num_workers=workers, persistent_workers=workers > 0, drop_last=True)

    def run():
        for images, _ in loader:
            yield images

    return run


def dali_pipeline(root: str, batch: int, threads: int, pipeline: str, shuffle: bool = True) -> Any:
    """DALI's CPU pipeline (built): ``train`` decodes only a random crop window
    (``image_random_crop``, as DALI's ImageNet examples), ``val`` the whole image."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None)
    def pipe():
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=shuffle, name="reader")
        if pipeline == "train":
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
            mirror = fn.random.coin_flip()
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            mirror = 0
        images = fn.resize(images, resize_x=224, resize_y=224)
        return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=MEAN, std=STD,
                                        mirror=mirror), labels

    p = pipe()
    p.build()
    return p


def dali_cpu(root: str, batch: int, threads: int, count: int, pipeline: str = "train") -> Any:
    p = dali_pipeline(root, batch, threads, pipeline)
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


def cpu_timed(run: Any, passes: list[float]) -> Any:
    """``run``, appending each pass's process CPU seconds per item to ``passes``."""

    def timed():
        start, items = time.process_time(), 0
        for batch in run():
            items += int(batch.shape[0])
            yield batch
        passes.append((time.process_time() - start) / max(items, 1))

    return timed


def dali_agreement(root: str, threads: int, n: int = 64) -> float:
    """Mean |gpuio - DALI| in 0-255 levels over the ``val`` pipeline's output for the
    same ``n`` encoded images (the ones DALI's reader yields first)."""
    from nvidia.dali import fn, pipeline_def

    from gpuio.batch import Batch, sample_seeds

    p = dali_pipeline(root, n, threads, "val", shuffle=False)
    out, _ = p.run()
    dali = np.stack([np.array(t) for t in out])

    @pipeline_def(batch_size=n, num_threads=threads, device_id=None)
    def files():
        return fn.readers.file(file_root=root, random_shuffle=False)[0]

    q = files()
    q.build()
    (encoded,) = q.run()
    bufs = [np.array(t) for t in encoded]
    index = np.arange(n)
    ours = gpuio_ops("val")(Batch({"data": bufs}, index, sample_seeds(0, 0, index))).data["image"]
    std = np.asarray(STD, np.float32)[:, None, None]
    return float((np.abs(np.asarray(ours) - dali) * std).mean())


def profile_stages(root: str, pipeline: str, count: int = 512, batch: int = 64) -> list[dict[str, Any]]:
    """CPU time per image (one thread, ``time.thread_time``) of each stage of the
    pipeline, op by op (``Compose(fuse=False)``: simplejpeg, Pillow, NumPy) and fused
    (``DecodeFused``: JPEG headers, window decode and resample in C, the whole decodes of
    the images the window decoder does not take, the crop plan's random draws). The
    window decode and the resample run in one C call, which times them itself."""
    import cProfile
    import pstats

    from gpuio.batch import Batch, sample_seeds
    from gpuio.ops import decode

    index = gpuio.formats.filetree(root)
    bufs = [np.fromfile(p, np.uint8) for p in list(index.files)[:count]]
    # what a stage is made of: builtin (C) functions by name, Python functions by file
    stages = {"op by op": [("decode (simplejpeg, Pillow)", ("decode_jpeg", "'decode'", "decode.py")),
                           ("crop + resize (Pillow)", ("'resize'", "geometry.py", "_rng.py")),
                           ("normalize (NumPy)", ("color.py",))],
              "fused": [("window decode (libjpeg, C)", ()),
                        ("resample + normalize (C)", ("_resample.resample",)),
                        ("JPEG headers (libjpeg, C)", ("_jpeg.headers",)),
                        ("whole decode, other images (simplejpeg, Pillow)", ("decode_jpeg", "'decode'")),
                        ("random draws, crop plan (Python)", ("geometry.py", "_rng.py"))]}
    rows = []
    n = len(bufs) // batch * batch
    for mode, parts in stages.items():
        pipe = gpuio_ops(pipeline)
        if mode == "op by op":
            pipe = ops.Compose(pipe.ops, fuse=False)
        in_c = decode.native_jpeg().stage_times() if decode.native_jpeg() is not None else (0.0, 0.0)
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        for s in range(0, n, batch):
            rows_ = np.arange(s, s + batch)
            pipe(Batch({"data": bufs[s:s + batch]}, rows_, sample_seeds(0, 0, rows_)))
        prof.disable()
        shares = dict.fromkeys([name for name, _ in parts] + ["other Python"], 0.0)
        for (file, _, func), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
            stage = next((name for name, keys in parts
                          if any(k in func if file == "~" else file.endswith(k) for k in keys)), "other Python")
            shares[stage] += tottime
        if mode == "fused" and decode.native_jpeg() is not None:  # decode_resample's time: its own split, the rest other
            window, resample = (b - a for a, b in zip(in_c, decode.native_jpeg().stage_times()))
            shares["window decode (libjpeg, C)"] += window
            shares["resample + normalize (C)"] += resample
            shares["other Python"] -= window + resample
        shares["total"] = sum(shares.values())
        rows += [{"pipeline": pipeline, "mode": mode, "stage": k, "ms_per_image": 1e3 * v / n}
                 for k, v in shares.items()]
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="a JPEG file tree (default: the gpuio sample dataset)")
    parser.add_argument("--count", type=int, default=2000, help="images in the sample dataset")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="passes per competitor; the best counts")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="DataLoader workers and DALI threads")
    parser.add_argument("--pipeline", choices=[*PIPELINES, "both"], default="both")
    parser.add_argument("--profile", action="store_true",
                        help="only print the CPU time per stage, op by op and fused (one thread)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    root = args.root or sample_root(args.count)
    count = len(gpuio.formats.filetree(root))
    count -= count % args.batch  # whole batches only (the loader drops the last partial one)
    pipelines = list(PIPELINES) if args.pipeline == "both" else [args.pipeline]
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, GPUs: {info['gpus']}"
          + (f" ({info['gpu']})" if "gpu" in info else ""))
    print(f"dataset: {root}: {count} JPEGs in whole batches of {args.batch}; best of {args.epochs} epochs")
    for pipeline in pipelines:
        print(f"  {pipeline}: {PIPELINES[pipeline]}")
    if args.profile:
        rows = [r for p in pipelines for r in profile_stages(root, p, min(count, 512), args.batch)]
        print_table(rows, [("pipeline", "pipeline", "s"), ("mode", "mode", "s"), ("stage", "stage", "s"),
                           ("ms_per_image", "CPU ms/image", ".3f")])
        write_json(args.out, {"benchmark": "images-profile", "machine": info, "results": rows})
        return {"results": rows}
    cuda = gpuio.cuda_available()
    if not cuda:
        print("no GPU: the gpuio cuda and torchvision GPU rows are not run")
    rows, runs, cpu = [], {}, {}
    for pipeline in pipelines:
        makers = [("gpuio cpu (Loader + ops.Compose)", lambda p=pipeline: gpuio_loader(root, args.batch, "cpu", p)),
                  (f"torch DataLoader + Pillow ({args.workers} workers)",
                   lambda p=pipeline: torch_dataloader(root, args.batch, args.workers, p)),
                  (f"DALI cpu pipeline ({args.workers} threads)",
                   lambda p=pipeline: dali_cpu(root, args.batch, args.workers, count, p))]
        if cuda:
            makers.append(("gpuio cuda (fused kernel)", lambda p=pipeline: gpuio_loader(root, args.batch, "cuda", p)))
            if pipeline == "train":
                makers.append(("torchvision decode_jpeg cuda + torch ops", lambda: torchvision_gpu(root, args.batch)))
        for name, make in makers:
            row: dict[str, Any] = {"pipeline": pipeline, "name": name}
            try:
                runs[f"{pipeline}: {name}"] = make()
                if not name.startswith("torch DataLoader"):  # in this process: its CPU time is ours to see
                    runs[f"{pipeline}: {name}"] = cpu_timed(runs[f"{pipeline}: {name}"],
                                                            cpu.setdefault(f"{pipeline}: {name}", []))
            except ImportError as exc:
                row["note"] = f"not installed ({exc.name})"
            rows.append(row)
    speeds, failed = interleaved_rounds(runs, args.epochs, count, desc="image pipelines")
    for row in rows:
        key = f"{row['pipeline']}: {row['name']}"
        if key in speeds:
            row["images_s"] = speeds[key]
        if len(cpu.get(key, [])) > 1:  # the first pass is the untimed warm-up
            row["cpu_ms"] = 1e3 * min(cpu[key][1:])
        if key in failed:
            row["note"], row["error"] = "failed (below)", failed[key]
    for pipeline in pipelines:
        group = [r for r in rows if r["pipeline"] == pipeline]
        for col, prefix in (("ratio", "torch DataLoader"), ("vs_dali", "DALI")):
            base = next((r.get("images_s") for r in group if r["name"].startswith(prefix)), None)
            for r in group:
                if r.get("images_s") and base:
                    r[col] = r["images_s"] / base
    print_table(rows, [("pipeline", "pipeline", "s"), ("name", "competitor", "s"), ("images_s", "images/s", ".1f"),
                       ("ratio", "vs torch DataLoader", ".2f"), ("vs_dali", "vs DALI", ".2f"),
                       ("cpu_ms", "CPU ms/image", ".3f"), ("note", "note", "s")])
    payload = {"benchmark": "images", "machine": info, "dataset": {"root": root, "images": count},
               "batch": args.batch, "epochs": args.epochs, "results": rows}
    if "val" in pipelines and any(r["name"].startswith("DALI") and "images_s" in r for r in rows):
        payload["val_mean_levels_vs_dali"] = dali_agreement(root, args.workers, min(64, count))
        print(f"val: mean difference gpuio vs DALI {payload['val_mean_levels_vs_dali']:.2f} levels (0-255)")
    for name, error in failed.items():
        print(f"{name} failed: {error}")
    write_json(args.out, payload)
    if args.out:
        charts = [Group(PIPELINES[p], [(r["name"], r.get("images_s")) for r in rows if r["pipeline"] == p],
                        notes={r["name"]: r["note"] for r in rows if r.get("note") and r["pipeline"] == p},
                        ours={r["name"] for r in rows if r["name"].startswith("gpuio")})
                  for p in pipelines]
        png = write_chart(os.path.splitext(args.out)[0] + ".png", "gpuio image pipeline benchmark", "images/s", charts)
        print(f"wrote {png}")
    ours = {name: error for name, error in failed.items() if ": gpuio" in name}
    if ours:
        raise BenchError("gpuio's own pipeline failed: " + "; ".join(f"{n}: {e}" for n, e in ours.items()))
    return payload


if __name__ == "__main__":
    main()
