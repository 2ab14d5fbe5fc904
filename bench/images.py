"""Image pipeline benchmark over ImageNet-like JPEGs from ``gpuio.sample``, batches of
64: ``train`` (decode, random resized crop 224, flip, normalize to float32 CHW) and
``val`` (decode, resize to 224x224, normalize to float32 CHW); ``--pipeline resize``:
decode and resize to 224x224 uint8 HWC, no normalize (what SPDL's image example makes);
``--pipeline randaugment``: ``train`` with RandAugment on the uint8 crops before normalize
(gpuio's ``ops.rand_augment(2, 9)``, DALI's ``nvidia.dali.auto_aug.rand_augment(n=2, m=9)``
after its resize, torchvision v2's ``RandAugment(2, 9)`` in a DataLoader; the ceiling,
gpuio's, DALI's and torchvision's rows only).

    python bench/images.py [--root TREE | --count 2000] [--batch 64] [--epochs 2] [--pipeline both] [--out images.json]

Competitors (``COMPETITORS``), measured in one run, all in interleaved rounds (images/s
of the best epoch, page cache warm):

- the ceiling, ``decode only``: libjpeg-turbo decoding the pixels each pipeline needs,
  as gpuio's C decoder does it (accurate integer IDCT, fancy upsampling): every image
  whole for ``val`` and ``resize``, a random resized crop's window at the DCT scale
  gpuio's rule picks for ``train``; from bytes held in memory into a reused buffer, a
  batch split over ``--workers`` threads, no resize; every row shows its fraction of it;
- gpuio on the CPU (``gpuio.Loader`` + ``ops.Compose``);
- ``torch.utils.data.DataLoader`` with Pillow doing the same ops (workers = cores);
  for ``randaugment`` instead torchvision v2's ImageNet train transform as its
  classification reference writes it (``TorchvisionRandAugment``: ``decode_jpeg``,
  RandomResizedCrop, RandomHorizontalFlip, RandAugment, ToDtype, Normalize);
- SPDL (``pip install spdl``, with FFmpeg's shared libraries): a ``PipelineBuilder``
  source -> ``aggregate(batch)`` -> ``pipe(decode, concurrency=workers)`` ->
  ``add_sink``, built with ``num_threads=workers``, as SPDL's image examples write it;
  ``val`` decodes a batch with ``spdl.io.load_image_batch`` (FFmpeg's bilinear
  ``scale`` to 224x224), ``train`` each image with its own crop, scale and flip filter
  (``spdl.io.decode_packets``), batched by ``spdl.io.convert_frames``; then the uint8
  HWC batch is normalized to float32 CHW with torch, as SPDL's ImageNet example does;
- NVIDIA DALI's CPU pipeline (``pip install nvidia-dali-cuda120``; ``device_id=None``,
  ``num_threads`` = cores: ``readers.file`` -> ``decoders.image_random_crop`` or
  ``decoders.image`` -> ``resize`` -> ``crop_mirror_normalize``);
- on a GPU machine also gpuio on the GPU (fused kernel) and torchvision's batched
  ``decode_jpeg(device="cuda")`` + torch ops.

A competitor whose package is missing is a row saying so. Each DALI pass is followed by
0.5 s idle, so that its work ahead (two batches) is over before the next competitor's
pass is timed. ``per round`` is the median over rounds of a row's pass
against the ceiling's pass of the same round (drift between rounds cancels). For ``val``
it also prints the mean difference between gpuio's and DALI's outputs on the same
images. For the competitors that run in this process it also prints the process CPU time
per image of their cheapest pass, which a loaded machine moves less than images/s (the
DataLoader's workers are other processes; DALI's work ahead of its pass is counted in no
pass).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

import gpuio
from gpuio import ops
from gpuio.bench._chart import Group, write_chart
from gpuio.bench._common import BenchError, interleaved_rounds, machine, print_table, sample_root, write_json

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


PIPELINES = {"train": "decode, random resized crop 224, flip, normalize to float32 CHW",
             "val": "decode, resize 224x224, normalize to float32 CHW",
             "resize": "decode, resize 224x224, uint8 HWC (no normalize)",
             "randaugment": "train with rand_augment(n=2, m=9) before normalize"}
TRAIN = ("train", "randaugment")  # the pipelines that crop at random
BOTH = ("train", "val")  # --pipeline both (the default)


def gpuio_ops(pipeline: str) -> Any:
    geometry = [ops.random_resized_crop(224), ops.flip()] if pipeline in TRAIN else [ops.resize((224, 224))]
    augment = [ops.rand_augment(2, 9)] if pipeline == "randaugment" else []
    normalize = [ops.normalize(MEAN, STD)] if pipeline != "resize" else []
    return ops.Compose([ops.decode_image(), *geometry, *augment, *normalize])


def gpuio_loader(root: str, batch: int, device: str, pipeline: str = "train") -> Any:
    pipe = gpuio_ops(pipeline)
    loader = gpuio.Loader(gpuio.formats.filetree(root), batch, fields=("data", "label"), ops=[pipe],
                          device=device, output=_output(), shuffle=True, last_batch="drop")
    sync = _cuda_sync() if device == "cuda" else (lambda: None)

    def run():
        for b in loader:
            yield b["image"]
        sync()

    run.report = loader.report  # the verdict on its passes (Loader.report), printed after the table
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

    def __init__(self, root: str, train: bool = True, normalize: bool = True) -> None:
        self.train, self.normalize = train, normalize
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
        if not self.normalize:
            return torch.from_numpy(np.array(img)), int(self.labels[i])
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


class TorchvisionRandAugment:
    """torchvision's ImageNet train transform with RandAugment, as its classification
    reference writes it (``ClassificationPresetTrain``, tensor backend):
    ``decode_jpeg`` (RGB), ``RandomResizedCrop(224)`` (bilinear, antialias),
    ``RandomHorizontalFlip``, ``RandAugment(num_ops=2, magnitude=9)`` (bilinear) on the
    uint8 crop, ``ToDtype(float32, scale=True)``, ``Normalize``."""

    def __init__(self, root: str) -> None:
        import torch
        from torchvision.transforms import v2

        index = gpuio.formats.filetree(root)
        self.paths = list(index.files)  # absolute paths
        self.labels = np.asarray(index.values["label"])
        bilinear = v2.InterpolationMode.BILINEAR
        self.transform = v2.Compose([v2.RandomResizedCrop(224, interpolation=bilinear, antialias=True),
                                     v2.RandomHorizontalFlip(), v2.RandAugment(2, 9, interpolation=bilinear),
                                     v2.ToDtype(torch.float32, scale=True),
                                     v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from torchvision.io import ImageReadMode, decode_jpeg, read_file

        return self.transform(decode_jpeg(read_file(self.paths[i]), mode=ImageReadMode.RGB)), int(self.labels[i])


def torch_dataloader(root: str, batch: int, workers: int, pipeline: str = "train") -> Any:
    import torch

    dataset = (TorchvisionRandAugment(root) if pipeline == "randaugment"
               else PillowImageFolder(root, pipeline == "train", pipeline != "resize"))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True,
                                         num_workers=workers, persistent_workers=workers > 0, drop_last=True)

    def run():
        for images, _ in loader:
            yield images

    return run


def dali_pipeline(root: str, batch: int, threads: int, pipeline: str, shuffle: bool = True) -> Any:
    """DALI's CPU pipeline (built): ``train`` decodes only a random crop window
    (``image_random_crop``, as DALI's ImageNet examples), ``val`` the whole image;
    ``randaugment`` is ``train`` with ``nvidia.dali.auto_aug.rand_augment`` after the resize."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import rand_augment

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None,
                  enable_conditionals=pipeline == "randaugment")  # auto_aug picks an op per sample
    def pipe():
        jpegs, labels = fn.readers.file(file_root=root, random_shuffle=shuffle, name="reader")
        if pipeline in TRAIN:
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
            mirror = fn.random.coin_flip()
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            mirror = 0
        images = fn.resize(images, resize_x=224, resize_y=224)
        if pipeline == "randaugment":
            images = rand_augment.rand_augment(images, n=2, m=9)
        if pipeline == "resize":
            return images, labels
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


def image_paths(root: str) -> list[str]:
    """The JPEG files of the sample tree under ``root``, absolute paths in the tree's order."""
    return list(gpuio.formats.filetree(root).files)  # absolute paths


def decode_only(root: str, batch: int, threads: int, count: int, pipeline: str = "val") -> Any:
    """The decoder's own speed, the ceiling of the pipelines: libjpeg-turbo decoding, as
    gpuio's C path decodes them (``decode_region`` of ``decode.native_jpeg()``: accurate
    IDCT, fancy upsampling; the images it does not take by ``decode.decode_cpu``), the
    pixels a pipeline needs: ``val`` and ``resize`` every image whole, ``train`` a random
    resized crop's window per image and pass (``_rrc_box``'s draws), at the DCT scale
    gpuio's fused decode picks (``ops.fused.dct_denoms``), with no resample. From bytes in memory into one output buffer per thread
    (no page faults of fresh arrays), each batch split into ``threads`` runs of images on
    as many threads."""
    import threading

    from gpuio.ops import decode
    from gpuio.ops.fused import dct_denoms

    jpeg = decode.native_jpeg()
    if jpeg is None:
        raise ImportError("gpuio.ops._jpeg was not built", name="gpuio.ops._jpeg")
    bufs = [np.fromfile(path, np.uint8) for path in image_paths(root)[:count]]
    facts = decode.jpeg_facts(bufs)
    whole = decode.region_decodable(facts).tolist()
    largest = int((facts[:, 3] * facts[:, 4]).max(initial=1)) * 3
    pool, local = ThreadPoolExecutor(threads), threading.local()

    def windows(start: int, stop: int) -> list[list[int]]:
        """Per image ``start:stop`` the ``[denom, y0, x0, y1, x1]`` of the region to
        decode, in scaled pixels: the whole image, or for ``train`` a random resized crop's
        window at the DCT scale of gpuio's rule (``ops.fused.dct_denoms``)."""
        hw = facts[start:stop, 3:5]
        if pipeline not in TRAIN:
            return np.column_stack([np.ones(len(hw), np.int64), np.zeros_like(hw), hw]).tolist()
        box = np.array([_rrc_box(h, w) for h, w in hw.tolist()], np.int64).reshape(-1, 4)
        d = dct_denoms(box.astype(np.float64), np.full((len(box), 2), 224), facts[start:stop, 6])
        return np.column_stack([d, box[:, 0] // d, box[:, 1] // d, -(-(box[:, 0] + box[:, 2]) // d),
                                -(-(box[:, 1] + box[:, 3]) // d)]).tolist()

    def decode_run(part: tuple[range, list[list[int]]]) -> int:
        rows, regions = part
        out = getattr(local, "out", None)
        if out is None:
            out = local.out = np.zeros(largest, np.uint8)
        for i, (d, y0, x0, y1, x1) in zip(rows, regions):
            if whole[i]:
                jpeg.decode_region(bufs[i], facts[i, 0] == 1, d, y0, x0, y1, x1, out)
            else:
                decode.decode_cpu(bufs[i], "rgb", i, decode.facts_info(facts[i]))
        return len(rows)

    def run():
        for start in range(0, count, batch):
            n = min(batch, count - start)
            regions = windows(start, start + n)
            cuts = np.linspace(start, start + n, threads + 1).astype(int).tolist()
            parts = [(range(a, b), regions[a - start: b - start]) for a, b in itertools.pairwise(cuts)]
            yield np.empty((sum(pool.map(decode_run, parts)), 0))

    return run


def spdl_loader(root: str, batch: int, threads: int, pipeline: str = "train") -> Any:
    """SPDL's pipeline as its image examples build it (see the module docstring)."""
    import spdl.io
    import torch
    from spdl.pipeline import PipelineBuilder

    paths = image_paths(root)
    try:  # the Python package imports without FFmpeg's libraries; its first decode loads them
        spdl.io.demux_image(paths[0])
    except (OSError, RuntimeError) as exc:
        raise ImportError(f"spdl cannot load FFmpeg: {exc}", name="spdl's FFmpeg libraries") from exc
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    resize = spdl.io.get_video_filter_desc(scale_width=224, scale_height=224, scale_mode=None, scale_algo="bilinear",
                                           pix_fmt="rgb24")

    def train_batch(srcs: list[str]) -> Any:
        frames = []
        for src in srcs:
            packets = spdl.io.demux_image(src)
            top, left, ch, cw = _rrc_box(packets.codec.height, packets.codec.width)
            flip = ",hflip" if random.random() < 0.5 else ""
            crop = f"crop=w={cw}:h={ch}:x={left}:y={top},scale=w=224:h=224:flags=bilinear{flip}"
            frames.append(spdl.io.decode_packets(packets, filter_desc=spdl.io.get_video_filter_desc(filter_desc=crop)))
        return spdl.io.convert_frames(frames)

    def val_batch(srcs: list[str]) -> Any:
        return spdl.io.load_image_batch(srcs, width=None, height=None, pix_fmt=None, filter_desc=resize)

    load = train_batch if pipeline == "train" else val_batch

    def decode_normalize(srcs: list[str]) -> Any:
        if pipeline == "resize":
            return spdl.io.to_torch(load(srcs))
        x = spdl.io.to_torch(load(srcs)).permute(0, 3, 1, 2).float() / 255.0
        return (x - mean) / std

    def run():
        order = [paths[i] for i in np.random.permutation(len(paths))]
        loader = (PipelineBuilder().add_source(order).aggregate(batch, drop_last=True)
                  .pipe(decode_normalize, concurrency=threads).add_sink(3).build(num_threads=threads))
        with loader.auto_stop():
            yield from loader.get_iterator()

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


class Setup(NamedTuple):
    """What every competitor is given."""

    root: str
    batch: int
    workers: int  # DataLoader workers; DALI, SPDL and decode-only threads
    count: int  # images per pass, in whole batches


@dataclass(frozen=True)
class Competitor:
    """A row per pipeline. ``name``: its label ("{workers}" stands for ``--workers``);
    ``make(setup, pipeline)``: a function making one pass that yields batches (it raises
    ImportError, naming the package, where one is missing); ``in_process``: its CPU time
    is this process's; ``gpu``: run only where a GPU is; ``pipelines``: those it runs."""

    name: str
    make: Callable[[Setup, str], Callable[[], Iterator[Any]]]
    in_process: bool = True
    gpu: bool = False
    pipelines: tuple[str, ...] = tuple(PIPELINES)


COMPETITORS = [
    Competitor("decode only: libjpeg-turbo, gpuio C decoder ({workers} threads)",
               lambda s, p: decode_only(s.root, s.batch, s.workers, s.count, p)),
    Competitor("gpuio cpu (Loader + ops.Compose)", lambda s, p: gpuio_loader(s.root, s.batch, "cpu", p)),
    Competitor("torch DataLoader + Pillow ({workers} workers)",
               lambda s, p: torch_dataloader(s.root, s.batch, s.workers, p), in_process=False,
               pipelines=("train", "val", "resize")),
    Competitor("torch DataLoader + torchvision v2 (RandAugment, {workers} workers)",
               lambda s, p: torch_dataloader(s.root, s.batch, s.workers, p), in_process=False,
               pipelines=("randaugment",)),
    Competitor("SPDL pipeline ({workers} threads)", lambda s, p: spdl_loader(s.root, s.batch, s.workers, p),
               pipelines=("train", "val", "resize")),
    Competitor("DALI cpu pipeline ({workers} threads)", lambda s, p: dali_cpu(s.root, s.batch, s.workers, s.count, p)),
    Competitor("gpuio cuda (fused kernel)", lambda s, p: gpuio_loader(s.root, s.batch, "cuda", p), gpu=True),
    Competitor("torchvision decode_jpeg cuda + torch ops", lambda s, p: torchvision_gpu(s.root, s.batch), gpu=True,
               pipelines=("train",)),
]

# the ratio columns: key, heading, and the row (by the start of its name) each row is divided by
RATIOS = [("of_ceiling", "of decode only", "decode only"), ("ratio", "vs torch DataLoader", "torch DataLoader"),
          ("vs_spdl", "vs SPDL", "SPDL"), ("vs_dali", "vs DALI", "DALI")]


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
                        ("random draws, crop plan (Python)", ("geometry.py", "_rng.py", "_augment.rng_"))]}
    rows = []
    n = len(bufs) // batch * batch
    if decode.native_jpeg() is not None:
        decode.native_jpeg().time_stages(True)
    for mode, parts in stages.items():
        pipe = gpuio_ops(pipeline)
        if mode == "op by op":
            pipe = ops.Compose(pipe.ops, fuse=False)
        in_c = decode.native_jpeg().stage_times() if decode.native_jpeg() is not None else (0.0, 0.0)
        prof = cProfile.Profile(time.thread_time)
        with gpuio.config.override(decode_parts=1):  # the fused decodes on this thread, where it is profiled
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
    if decode.native_jpeg() is not None:
        decode.native_jpeg().time_stages(False)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", help="a JPEG file tree (default: the gpuio sample dataset)")
    parser.add_argument("--count", type=int, default=2000, help="images in the sample dataset")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="passes per competitor; the best counts")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="DataLoader workers; DALI, SPDL and decode-only threads")
    parser.add_argument("--pipeline", choices=[*PIPELINES, "both"], default="both",
                        help="both: train and val")
    parser.add_argument("--profile", action="store_true",
                        help="only print the CPU time per stage, op by op and fused (one thread)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    root = args.root or sample_root(args.count)
    count = len(gpuio.formats.filetree(root))
    count -= count % args.batch  # whole batches only (the loader drops the last partial one)
    pipelines = list(BOTH) if args.pipeline == "both" else [args.pipeline]
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
    setup = Setup(root, args.batch, args.workers, count)
    rows, runs, cpu, reports = [], {}, {}, {}
    for pipeline in pipelines:
        for competitor in COMPETITORS:
            if pipeline not in competitor.pipelines or (competitor.gpu and not cuda):
                continue
            name = competitor.name.format(workers=args.workers)
            key = f"{pipeline}: {name}"
            row: dict[str, Any] = {"pipeline": pipeline, "name": name}
            try:
                runs[key] = competitor.make(setup, pipeline)
                if hasattr(runs[key], "report"):
                    reports[key] = runs[key].report
                if competitor.in_process:  # its CPU time is ours to see
                    runs[key] = cpu_timed(runs[key], cpu.setdefault(key, []))
            except ImportError as exc:
                row["note"] = f"not installed ({exc.name})"
            rows.append(row)
    per_round: dict[str, list[float]] = {}
    # a pause after DALI's passes lets its work ahead (two batches) end before the next pass
    speeds, failed = interleaved_rounds(runs, args.epochs, count, desc="image pipelines", rounds=per_round,
                                        settle={k: 0.5 for k in runs if ": DALI" in k})
    for row in rows:
        key = f"{row['pipeline']}: {row['name']}"
        if key in speeds:
            row["images_s"] = speeds[key]
            row["rounds"] = per_round[key]
        if len(cpu.get(key, [])) > 1:  # the first pass is the untimed warm-up
            row["cpu_ms"] = 1e3 * min(cpu[key][1:])
        if key in failed:
            row["note"], row["error"] = "failed (below)", failed[key]
    for pipeline in pipelines:
        group = [r for r in rows if r["pipeline"] == pipeline]
        for col, _, prefix in RATIOS:
            base = next((r.get("images_s") for r in group if r["name"].startswith(prefix)), None)
            for r in group:
                if r.get("images_s") and base:
                    r[col] = r["images_s"] / base
        ceiling = next((r for r in group if r["name"].startswith(RATIOS[0][2]) and r.get("rounds")), None)
        for r in group:  # the round's drift cancels: each pass against the ceiling's pass of the same round
            if ceiling is not None and r.get("rounds"):
                r["of_ceiling_per_round"] = float(np.median(np.divide(r["rounds"], ceiling["rounds"])))
    print_table(rows, [("pipeline", "pipeline", "s"), ("name", "competitor", "s"), ("images_s", "images/s", ".1f"),
                       *((col, heading, ".2f") for col, heading, _ in RATIOS[:1]),
                       ("of_ceiling_per_round", "per round", ".2f"),
                       *((col, heading, ".2f") for col, heading, _ in RATIOS[1:]),
                       ("cpu_ms", "CPU ms/image", ".3f"), ("note", "note", "s")])
    for key, report in reports.items():  # what binds gpuio's pipeline here (the bench's consumer does nothing)
        print(f"{key}, {str(report()).replace(chr(10), chr(10) + '  ')}")
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
