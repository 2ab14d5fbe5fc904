"""Video clip benchmark: random clips of H.264 videos decoded to uint8 RGB frames.

    python bench/video.py [--size full|quick] [--videos 16] [--rounds 2] [--out video.json]

Shape (after the DALI write-up, scaled down): ``full`` is 1080p videos of 10 s at 30 fps
(H.264, x264 ``veryfast``, B-frames, a keyframe every 2 s), ``sequence_length=60``,
``stride=5``, batches of 8; ``quick`` the same at 640x360. Every competitor decodes the
same clips in the same shuffled order each round; rounds interleave the competitors,
the best round counts. Figures: clips/s and decoded (kept) frames/s, page cache warm.

Competitors: gpuio on the CPU (``formats.video`` + ``ops.decode_video`` in a
``gpuio.Loader``); a plain PyAV loop that opens the file, seeks to the keyframe before
the clip and decodes to its last frame, once with PyAV's default threads and once with
frame threads (``thread_type="AUTO"``); decord and torchcodec where they import. On a
GPU machine: gpuio with NVDEC, torchcodec's CUDA decoder and PyNvVideoCodec's
``SimpleDecoder``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import gpuio
from gpuio import ops
from gpuio.bench._common import cache_dir, machine, print_table, write_json

SIZES = {"full": (1920, 1080), "quick": (640, 360)}
FRAMES, RATE, LENGTH, STRIDE, BATCH = 300, 30, 60, 5, 8


def make_videos(width: int, height: int, count: int) -> list[str]:
    """``count`` H.264 MP4s of moving patterns in the cache folder, made on first use."""
    import av

    root = os.path.join(cache_dir(), f"sample-videos-{width}x{height}")
    os.makedirs(root, exist_ok=True)
    paths = []
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([np.sin(xx / 37) * np.cos(yy / 53), np.sin((xx * 0.7 + yy * 0.3) / 29),
                     np.cos((xx - yy) / 61)], -1)
    base = ((base + 1) * 110).astype(np.uint8)
    for v in range(count):
        path = os.path.join(root, f"{v:03d}.mp4")
        paths.append(path)
        if os.path.exists(path):
            continue
        print(f"encoding {path}", file=sys.stderr)
        rng = np.random.default_rng(v)
        speed = rng.integers(2, 9, 2)
        grain = rng.integers(0, 10, (4, height, width, 1), dtype=np.uint8)
        with av.open(path + ".part", "w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=RATE)
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            stream.options = {"preset": "veryfast", "g": str(2 * RATE), "bf": "3", "crf": "23"}
            for i in range(FRAMES):  # a pattern panning at its own speed, a moving block, film grain
                img = np.roll(base, (int(i * speed[0]), int(i * speed[1])), axis=(0, 1)) + grain[i % 4]
                y0 = (i * 7) % (height - height // 4)
                img[y0: y0 + height // 4, width // 3: width // 3 + width // 6] ^= 0x80
                out.mux(stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
            out.mux(stream.encode())
        os.replace(path + ".part", path)
    return paths


# ---- competitors: each returns run(order) -> iterator of batches (sequences of [F, H, W, 3] clips) ----

def gpuio_run(index: gpuio.SampleIndex, device: str) -> Callable[[np.ndarray], Iterator[Any]]:
    def run(order: np.ndarray) -> Iterator[Any]:
        loader = gpuio.Loader(index.take(order), BATCH, ops=[ops.decode_video()], device=device,
                              output="numpy", threads=1, prefetch=1)
        for batch in loader:
            yield batch["frames"]
        if device == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()

    return run


def pyav_run(index: gpuio.SampleIndex, threads: str | None) -> Callable[[np.ndarray], Iterator[Any]]:
    """Open, seek to the keyframe at or before the clip's first frame, decode up to its
    last frame, keep its frames (by the stream's timestamps, known from one scan)."""
    import av

    times = {}
    for f, path in enumerate(index.files):
        with av.open(path) as c:
            times[f] = np.sort([p.pts for p in c.demux(video=0) if p.size])

    def run(order: np.ndarray) -> Iterator[Any]:
        for i in order.tolist():
            f, f0 = int(index.values["file"][i]), int(index.values["frame"][i])
            wanted = times[f][f0: f0 + (LENGTH - 1) * STRIDE + 1: STRIDE].tolist()
            slot = {t: j for j, t in enumerate(wanted)}
            frames: list[Any] = [None] * LENGTH
            with av.open(index.files[f]) as c:
                stream = c.streams.video[0]
                if threads:
                    stream.thread_type = threads
                c.seek(wanted[0], stream=stream, backward=True)
                for picture in c.decode(stream):
                    if picture.pts in slot:
                        frames[slot[picture.pts]] = picture.to_ndarray(format="rgb24")
                    if picture.pts >= wanted[-1]:
                        break
            yield [np.stack(frames)]

    return run


def decord_run(index: gpuio.SampleIndex) -> Callable[[np.ndarray], Iterator[Any]]:
    import decord

    def run(order: np.ndarray) -> Iterator[Any]:
        for i in order.tolist():
            f0 = int(index.values["frame"][i])
            reader = decord.VideoReader(index.files[int(index.values["file"][i])], ctx=decord.cpu(0))
            yield [reader.get_batch(list(range(f0, f0 + (LENGTH - 1) * STRIDE + 1, STRIDE))).asnumpy()]

    return run


def torchcodec_run(index: gpuio.SampleIndex, device: str) -> Callable[[np.ndarray], Iterator[Any]]:
    from torchcodec.decoders import VideoDecoder

    def run(order: np.ndarray) -> Iterator[Any]:
        for i in order.tolist():
            f0 = int(index.values["frame"][i])
            decoder = VideoDecoder(index.files[int(index.values["file"][i])], device=device,
                                   dimension_order="NHWC", seek_mode="exact")
            frames = decoder.get_frames_at(list(range(f0, f0 + (LENGTH - 1) * STRIDE + 1, STRIDE))).data
            yield [frames]
        if device == "cuda":
            import torch

            torch.cuda.synchronize()

    return run


def pynvvideocodec_run(index: gpuio.SampleIndex) -> Callable[[np.ndarray], Iterator[Any]]:
    import PyNvVideoCodec as nvc

    def run(order: np.ndarray) -> Iterator[Any]:
        for i in order.tolist():
            f0 = int(index.values["frame"][i])
            decoder = nvc.SimpleDecoder(index.files[int(index.values["file"][i])],
                                        output_color_type=nvc.OutputColorType.RGB)
            yield [decoder.get_batch_frames_by_index(list(range(f0, f0 + (LENGTH - 1) * STRIDE + 1, STRIDE)))]

    return run


def competitors(index: gpuio.SampleIndex) -> tuple[dict[str, Callable], dict[str, str]]:
    """The runs that could be set up, and why the others could not."""
    makers: dict[str, Callable[[], Callable]] = {
        "gpuio cpu": lambda: gpuio_run(index, "cpu"),
        "pyav loop (default threads)": lambda: pyav_run(index, None),
        "pyav loop (thread_type=AUTO)": lambda: pyav_run(index, "AUTO"),
        "decord cpu": lambda: decord_run(index),
        "torchcodec cpu": lambda: torchcodec_run(index, "cpu"),
    }
    skipped = {}
    if gpuio.cuda_available():
        makers.update({"gpuio cuda (nvdec)": lambda: gpuio_run(index, "cuda"),
                       "torchcodec cuda": lambda: torchcodec_run(index, "cuda"),
                       "pynvvideocodec SimpleDecoder": lambda: pynvvideocodec_run(index)})
    else:
        skipped["gpu rows"] = "no usable NVIDIA GPU on this machine"
    runs = {}
    for name, make in makers.items():
        try:
            runs[name] = make()
        except (ImportError, OSError, RuntimeError) as exc:  # a competitor that cannot load is a result
            cause = f" ({str(exc.__cause__).splitlines()[0][:200]})" if exc.__cause__ else ""
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}{cause}"
    return runs, skipped


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (Linux /proc/stat), None elsewhere."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (sum(ticks[:8]) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait


def measure(runs: dict[str, Callable], clips: int, rounds: int, seed: int) -> tuple[dict[str, list[dict]], dict[str, str]]:
    """Per competitor, its timed rounds (all clips, one shuffled order per round, shared
    by all; a warm-up round first): seconds, this process's CPU seconds, and the cores
    other processes kept busy meanwhile (the machine is shared; their load slows a
    two-thread decoder more than a one-thread loop)."""
    timed: dict[str, list[dict]] = {name: [] for name in runs}
    failed: dict[str, str] = {}
    for r in range(rounds + 1):
        order = np.random.default_rng([seed, r]).permutation(clips)
        for name, run in runs.items():
            if name in failed:
                continue
            t0, cpu0, busy0 = time.perf_counter(), os.times(), _busy_seconds()
            seen, out = 0, None
            try:
                for out in run(order):
                    seen += len(out)
            except Exception as exc:  # noqa: BLE001 - a competitor's failure is reported, not raised
                failed[name] = f"{type(exc).__name__}: {exc}"
                continue
            out = None  # the last batch goes back to the pool before the next competitor runs
            seconds, cpu1, busy1 = time.perf_counter() - t0, os.times(), _busy_seconds()
            cpu = cpu1.user - cpu0.user + cpu1.system - cpu0.system
            others = None if busy0 is None else max(0.0, (busy1 - busy0 - cpu) / seconds)
            if seen != clips:
                failed[name] = f"yielded {seen} clips, expected {clips}"
            elif r:
                timed[name].append({"seconds": seconds, "cpu_seconds": cpu, "other_cores": others})
            load = "" if others is None else f", other processes {others:.2f} cores"
            print(f"round {r} {name}: {seconds:.2f} s (cpu {cpu:.1f} s{load})", file=sys.stderr)
    return {n: t for n, t in timed.items() if n not in failed}, failed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--videos", type=int, default=16, help="videos (one clip of 60 frames, stride 5, each)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    width, height = SIZES[args.size]
    paths = make_videos(width, height, args.videos)
    index = gpuio.formats.video(paths, sequence_length=LENGTH, stride=STRIDE)
    runs, skipped = competitors(index)
    timed, failed = measure(runs, len(index), args.rounds, args.seed)
    base = timed.get("pyav loop (default threads)")
    rows = []
    for name, rounds in timed.items():
        t = min(r["seconds"] for r in rounds)
        per_round = [b["seconds"] / r["seconds"] for b, r in zip(base, rounds)] if base else []
        others = [r["other_cores"] for r in rounds if r["other_cores"] is not None]
        rows.append({"competitor": name, "clips/s": len(index) / t, "frames/s": len(index) * LENGTH / t,
                     "vs pyav loop": min(r["seconds"] for r in base) / t if base else float("nan"),
                     "per round": " ".join(f"{x:.2f}" for x in per_round),
                     "cpu s/clip": float(np.median([r["cpu_seconds"] for r in rounds])) / len(index),
                     "other cores": max(others) if others else None, "rounds": rounds})
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['gpus']} GPU(s)")
    print(f"dataset: {len(paths)} H.264 videos {width}x{height}, {FRAMES} frames at {RATE} fps; "
          f"{len(index)} clips of {LENGTH} frames, stride {STRIDE}; batch {BATCH}; best of {args.rounds} rounds")
    print_table(rows, [("competitor", "competitor", "s"), ("clips/s", "clips/s", ".2f"),
                       ("frames/s", "frames/s", ".0f"), ("vs pyav loop", "vs pyav loop", ".2f"),
                       ("per round", "per round", "s"), ("cpu s/clip", "cpu s/clip", ".2f"),
                       ("other cores", "others (max)", ".2f")])
    print("vs pyav loop: best round against best round; per round: the same round's two times; cpu s/clip: "
          "this process's CPU time (median round); others: cores other processes kept busy during a round")
    for name, why in {**skipped, **failed}.items():
        print(f"not measured: {name}: {why}")
    write_json(args.out, {"machine": info, "size": args.size, "width": width, "height": height,
                          "videos": len(paths), "clips": len(index), "sequence_length": LENGTH, "stride": STRIDE,
                          "batch": BATCH, "rounds": args.rounds, "results": rows,
                          "not_measured": {**skipped, **failed}})


if __name__ == "__main__":
    main()
