"""Detection (SSD) pipeline benchmark and codec table, on generated COCO-style data.

    python bench/detection.py [--count 512] [--batch 32] [--epochs 2] [--out detection.json]

The SSD training pipeline at batch 32, per image: ``random_bbox_crop`` (aspect ratio
0.5-2, IoU thresholds 0/0.1/0.3/0.5/0.7/0.9, scaling 0.3-1, no crop allowed, 50
attempts) -> decode only that window -> zoom out (``paste`` + ``bbox_paste``, ratio
1-4, fill 104/117/123) -> ``bb_flip`` + mirror -> resize 300x300 -> normalize to float32
CHW -> ``box_encoder`` (8732 SSD300 anchors, criteria 0.5, offset, scale 300, stds
0.1/0.1/0.2/0.2). Competitors, in interleaved rounds (images/s of the best epoch, page
cache warm): gpuio on the CPU (``Loader`` + ``ops.Compose``) and NVIDIA DALI's CPU
pipeline (``device_id=None``, ``num_threads`` = cores, ``readers.coco`` ->
``random_bbox_crop`` -> ``decoders.image_slice`` -> ``paste`` / ``bbox_paste`` ->
``bb_flip`` -> ``resize`` -> ``crop_mirror_normalize`` -> ``box_encoder``); on a GPU
machine also gpuio on the GPU. A second gpuio row runs ``paste`` and ``resize`` as two
ops, as DALI does, to show what the one-pass zoom out gains. ``--agreement`` also runs DALI's ``box_encoder``,
``bb_flip``, ``bbox_paste`` and ``paste`` and gpuio's on the same boxes and prints the
largest differences.

The codec table decodes the same images stored as JPEG, PNG, JPEG 2000, TIFF, WebP and
BMP with ``ops.decode_image`` (a batch at a time, one thread) and with a Pillow loop
(``Image.open(...).convert("RGB")``), interleaved; images/s per format.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from typing import Any

import numpy as np
from PIL import Image

import gpuio
from gpuio import ops
from gpuio.bench._common import BenchError, cache_dir, interleaved_rounds, machine, print_table, write_json
from gpuio.batch import Batch, sample_seeds
from gpuio.ops import ssd300_anchors
from gpuio.sample import make_coco as write_coco, sample_image

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]
FILL = (104, 117, 123)
CROP = dict(aspect_ratio=(0.5, 2.0), thresholds=(0.0, 0.1, 0.3, 0.5, 0.7, 0.9), scaling=(0.3, 1.0),
            bbox_layout="xyXY", allow_no_crop=True, num_attempts=50)
ZOOM = dict(ratio=(1.0, 4.0), paste_x=(0.0, 1.0), paste_y=(0.0, 1.0))
ENCODE = dict(criteria=0.5, offset=True, scale=300.0, stds=(0.1, 0.1, 0.2, 0.2))
def gpuio_ssd(anchors: np.ndarray, one_pass_zoom: bool = True) -> ops.Compose:
    """The SSD pipeline as gpuio ops: the zoom out and the resize to 300x300 are one
    ``paste(size=(300, 300))`` (the same output as ``paste`` then ``resize``), or with
    ``one_pass_zoom=False`` two ops as in DALI's pipeline."""
    zoom = [ops.paste(**ZOOM, fill_value=FILL, size=(300, 300))] if one_pass_zoom else \
        [ops.paste(**ZOOM, fill_value=FILL)]
    resize = [] if one_pass_zoom else [ops.resize((300, 300))]
    return ops.Compose([ops.random_bbox_crop(**CROP), ops.decode_image_slice(), *zoom,
                        ops.bbox_paste(**ZOOM, ltrb=True), ops.bb_flip(ltrb=True), *resize, ops.flip(),
                        ops.normalize(MEAN, STD), ops.box_encoder(anchors, **ENCODE)])


def gpuio_loader(root: str, ann: str, batch: int, device: str, anchors: np.ndarray,
                 one_pass_zoom: bool = True) -> Any:
    index = gpuio.formats.coco(root, ann, box_format="ltrb", normalized=True, skip_empty=True)
    loader = gpuio.Loader(index, batch, fields=("data", "boxes", "labels"), ops=[gpuio_ssd(anchors, one_pass_zoom)],
                          device=device, output="numpy", shuffle=True, last_batch="drop")

    def run():
        for b in loader:
            yield b["image"]
        if device == "cuda":
            import cupy

            cupy.cuda.Device().synchronize()  # every stream the pipeline used

    return run


def dali_ssd(root: str, ann: str, batch: int, threads: int, anchors: np.ndarray) -> Any:
    """DALI's CPU SSD pipeline (built)."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=None)
    def pipe():
        jpegs, boxes, labels = fn.readers.coco(file_root=root, annotations_file=ann, ltrb=True, ratio=True,
                                               skip_empty=True, random_shuffle=True, name="reader")
        anchor, shape, boxes, labels = fn.random_bbox_crop(boxes, labels, **dict(CROP, bbox_layout="xyXY"))
        images = fn.decoders.image_slice(jpegs, anchor, shape, device="cpu", output_type=types.RGB)
        ratio = fn.random.uniform(range=list(ZOOM["ratio"]))
        px, py = fn.random.uniform(range=[0.0, 1.0]), fn.random.uniform(range=[0.0, 1.0])
        images = fn.paste(images, ratio=ratio, paste_x=px, paste_y=py, fill_value=FILL)
        boxes = fn.bbox_paste(boxes, ratio=ratio, paste_x=px, paste_y=py, ltrb=True)
        coin = fn.random.coin_flip()
        boxes = fn.bb_flip(boxes, ltrb=True, horizontal=coin)
        images = fn.resize(images, resize_x=300, resize_y=300)
        images = fn.crop_mirror_normalize(images, mean=MEAN, std=STD, mirror=coin, dtype=types.FLOAT,
                                          output_layout="CHW")
        boxes, labels = fn.box_encoder(boxes, labels, anchors=anchors.ravel().tolist(), **ENCODE)
        return images, boxes, labels

    p = pipe()
    p.build()
    return p


def dali_loader(root: str, ann: str, batch: int, threads: int, anchors: np.ndarray, count: int) -> Any:
    p = dali_ssd(root, ann, batch, threads, anchors)

    def run():
        for _ in range(count // batch):
            images, _, _ = p.run()
            yield np.empty((len(images), 0))

    return run


CODECS = {"JPEG": dict(quality=90), "PNG": {}, "JPEG 2000": {}, "TIFF": dict(compression="tiff_lzw"),
          "WebP": dict(quality=90), "BMP": {}}


def codec_table(count: int, rounds: int, size: tuple[int, int] = (480, 640)) -> list[dict[str, Any]]:
    """Images/s per format: ``ops.decode_image`` on one CPU batch vs a Pillow loop."""
    rng = np.random.default_rng(1)
    pixels = [sample_image(rng, *size) for _ in range(count)]
    rows = []
    for fmt, kw in CODECS.items():
        bufs = []
        for px in pixels:
            out = io.BytesIO()
            Image.fromarray(px).save(out, fmt.replace(" ", "").upper(), **kw)
            bufs.append(np.frombuffer(out.getvalue(), np.uint8))
        index = np.arange(count)
        decode = ops.decode_image()

        def ours():
            decode(Batch({"data": list(bufs)}, index, sample_seeds(0, 0, index)))

        def pillow():
            for b in bufs:
                with Image.open(io.BytesIO(b)) as im:
                    np.asarray(im.convert("RGB"))

        best = {"gpuio": float("inf"), "Pillow": float("inf")}
        for _ in range(rounds):
            for name, fn in (("gpuio", ours), ("Pillow", pillow)):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
        rows.append({"format": fmt, "kB_per_image": sum(len(b) for b in bufs) / count / 1e3,
                     "gpuio_images_s": count / best["gpuio"], "pillow_images_s": count / best["Pillow"],
                     "ratio": best["Pillow"] / best["gpuio"]})
    return rows


def _feed(values: list[Any]) -> Any:
    """A DALI external source callback that gives ``values`` as one batch."""
    return lambda: values


def dali_agreement(root: str, ann: str, anchors: np.ndarray, n: int = 64) -> dict[str, float]:
    """Largest differences between DALI's and gpuio's box_encoder, bb_flip, bbox_paste
    and paste on the boxes of the first ``n`` images (labels: count of mismatches)."""
    from nvidia.dali import fn, pipeline_def

    index = gpuio.formats.coco(root, ann, box_format="ltrb", normalized=True, skip_empty=True)
    boxes = [np.asarray(index[i]["boxes"], np.float32) for i in range(n)]
    labels = [np.asarray(index[i]["labels"], np.int32) for i in range(n)]
    images = [np.full((37 + i % 5, 53 + i % 7, 3), i, np.uint8) for i in range(n)]
    rng = np.random.default_rng(0)
    ratio, px, py = rng.uniform(1, 4, n).astype(np.float32), rng.random(n, np.float32), rng.random(n, np.float32)

    @pipeline_def(batch_size=n, num_threads=1, device_id=None)
    def pipe():
        b = fn.external_source(source=_feed(boxes), batch=True)
        lab = fn.external_source(source=_feed(labels), batch=True)
        img = fn.external_source(source=_feed(images), batch=True, layout="HWC")
        r, x, y = (fn.external_source(source=_feed([np.float32(e) for e in v]), batch=True) for v in (ratio, px, py))
        eb, el = fn.box_encoder(b, lab, anchors=anchors.ravel().tolist(), **ENCODE)
        return (eb, el, fn.bb_flip(b, ltrb=True, horizontal=1, vertical=1),
                fn.bbox_paste(b, ratio=r, paste_x=x, paste_y=y, ltrb=True),
                fn.paste(img, ratio=r, paste_x=x, paste_y=y, fill_value=FILL))

    p = pipe()
    p.build()
    dali = [[np.array(t) for t in out] for out in p.run()]
    rows = np.arange(n)
    batch = Batch({"boxes": list(boxes), "labels": list(labels)}, rows, sample_seeds(0, 0, rows))
    enc = ops.box_encoder(anchors, **ENCODE)(batch)
    flipped = ops.bb_flip(ltrb=True, horizontal=True, vertical=True, p=1.0)(
        Batch({"boxes": list(boxes)}, rows, sample_seeds(0, 0, rows))).data["boxes"]
    pasted, canvases = [], []
    for i in range(n):  # per-image parameters as numbers: one op per image
        one = np.array([i])
        pasted += ops.bbox_paste(float(ratio[i]), float(px[i]), float(py[i]), ltrb=True)(
            Batch({"boxes": [boxes[i]]}, one, sample_seeds(0, 0, one))).data["boxes"]
        canvases += ops.paste(float(ratio[i]), float(px[i]), float(py[i]), fill_value=FILL)(
            Batch({"image": [images[i]]}, one, sample_seeds(0, 0, one))).data["image"]
    return {"box_encoder_max_abs": float(max(np.abs(enc.data["boxes"][i] - dali[0][i]).max() for i in range(n))),
            "box_encoder_label_mismatches": int(sum((enc.data["labels"][i] != dali[1][i]).sum() for i in range(n))),
            "bb_flip_max_abs": float(max(np.abs(flipped[i] - dali[2][i]).max() for i in range(n))),
            "bbox_paste_max_abs": float(max(np.abs(pasted[i] - dali[3][i]).max() for i in range(n))),
            "paste_pixel_mismatches": int(sum(c.shape != d.shape or int((c != d).sum())
                                              for c, d in zip(canvases, dali[4]))),
            "images": n, "anchors": len(anchors)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=512, help="images in the generated COCO-style dataset")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2, help="timed passes per competitor; the best counts")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="DALI threads")
    parser.add_argument("--codec-count", type=int, default=64, help="images per format in the codec table")
    parser.add_argument("--agreement", action="store_true", help="compare DALI's and gpuio's box ops too")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    root = os.path.join(cache_dir(), f"sample-coco-{args.count}")
    if not os.path.exists(os.path.join(root, ".complete")):
        write_coco(root, args.count)
        open(os.path.join(root, ".complete"), "w").close()
    images, ann = os.path.join(root, "images"), os.path.join(root, "instances.json")
    count = args.count - args.count % args.batch
    anchors = ssd300_anchors()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, GPUs: {info['gpus']}"
          + (f" ({info['gpu']})" if "gpu" in info else ""))
    print(f"dataset: {root}: {args.count} COCO-style JPEGs (480x640 and alike, 1-8 boxes), batches of "
          f"{args.batch}, {count} images a pass; best of {args.epochs} epochs")
    makers = [("gpuio cpu (Loader + ops.Compose)", lambda: gpuio_loader(images, ann, args.batch, "cpu", anchors)),
              ("gpuio cpu, paste then resize (DALI's op order)",
               lambda: gpuio_loader(images, ann, args.batch, "cpu", anchors, one_pass_zoom=False)),
              (f"DALI cpu pipeline ({args.threads} threads)",
               lambda: dali_loader(images, ann, args.batch, args.threads, anchors, count))]
    if gpuio.cuda_available():
        makers.append(("gpuio cuda", lambda: gpuio_loader(images, ann, args.batch, "cuda", anchors)))
    else:
        print("no GPU: the gpuio cuda row is not run")
    rows, runs = [], {}
    for name, make in makers:
        row: dict[str, Any] = {"name": name}
        try:
            runs[name] = make()
        except ImportError as exc:
            row["note"] = f"not installed ({exc.name})"
        rows.append(row)
    speeds, failed = interleaved_rounds(runs, args.epochs, desc="SSD pipelines")
    dali = next((speeds.get(r["name"]) for r in rows if r["name"].startswith("DALI")), None)
    for row in rows:
        if row["name"] in speeds:
            row["images_s"] = speeds[row["name"]]
            row["vs_dali"] = row["images_s"] / dali if dali else None
        if row["name"] in failed:
            row["note"], row["error"] = "failed (below)", failed[row["name"]]
    print_table(rows, [("name", "SSD pipeline", "s"), ("images_s", "images/s", ".1f"), ("vs_dali", "vs DALI", ".2f"),
                       ("note", "note", "s")])
    codecs = codec_table(args.codec_count, max(args.epochs, 2))
    print_table(codecs, [("format", "format", "s"), ("kB_per_image", "kB/image", ".1f"),
                         ("gpuio_images_s", "gpuio images/s", ".1f"), ("pillow_images_s", "Pillow images/s", ".1f"),
                         ("ratio", "gpuio / Pillow", ".2f")])
    payload = {"benchmark": "detection", "machine": info, "dataset": {"root": root, "images": args.count},
               "batch": args.batch, "epochs": args.epochs, "results": rows, "codecs": codecs}
    if args.agreement:
        payload["agreement"] = dali_agreement(images, ann, anchors)
        print("agreement with DALI:", json.dumps(payload["agreement"]))
    for name, error in failed.items():
        print(f"{name} failed: {error}")
    write_json(args.out, payload)
    ours = {name: error for name, error in failed.items() if name.startswith("gpuio")}
    if ours:
        raise BenchError("gpuio's own pipeline failed: " + "; ".join(f"{n}: {e}" for n, e in ours.items()))
    return payload
