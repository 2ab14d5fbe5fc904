"""Serving benchmark: requests/s and p50/p99 latency of ImageNet-style preprocessing in
Triton Inference Server (PyTriton), gpuio's model next to a PyTriton model doing the same
with Pillow and NumPy, at 1, 8 and 32 concurrent clients (and gpuio on the GPU, on a GPU
machine), all in one run:

    python bench/serve.py [--count 256] [--seconds 5] [--rounds 2] [--out serve.json]

Each request is one JPEG of the sample dataset (around 500x375); the models decode it,
resize the shorter side to 256, center crop 224 and normalize to float32 CHW. Both models
run in one Triton, with the same number of instances; Pillow's gets Triton's dynamic
batcher, gpuio's batches in process (see ``gpuio.serve``). The clients (one tritonclient
HTTP client per thread) run in another process, so that they do not share this one's
GIL. Rounds are interleaved, each starting with the next model; the best round counts.

PyTriton's Triton needs Python 3.12: under another Python this runs itself again in the
environment of ``tests/serve_env.py`` (made once; it has no GPU packages). For the GPU
row, run it with a Python 3.12 that has ``gpuio[serve,cu12]`` (or ``cu13``) installed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from serve_env import ensure, free_ports  # noqa: E402  the 3.12 server environment, shared with the tests
MEAN, STD = [123.7, 116.3, 103.5], [58.4, 57.1, 57.4]
OPS = f"decode_image(), resize(shorter=256), center_crop(224), normalize({MEAN}, {STD})"


def pillow_preprocess(data: np.ndarray) -> np.ndarray:
    """The same preprocessing in Pillow and NumPy: float32 CHW [3, 224, 224]."""
    from PIL import Image

    with Image.open(io.BytesIO(data.tobytes())) as im:
        im = im.convert("RGB")
        w, h = im.size
        size = (256, max(1, int(256 * h / w))) if w <= h else (max(1, int(256 * w / h)), 256)
        im = im.resize(size, Image.BILINEAR)
        left, top = (size[0] - 224) // 2, (size[1] - 224) // 2
        x = np.asarray(im.crop((left, top, left + 224, top + 224)), dtype=np.float32)
    return ((x - np.float32(MEAN)) / np.float32(STD)).transpose(2, 0, 1)


def pillow_infer(requests: list) -> list:
    return [{"image": np.stack([pillow_preprocess(row) for row in r["images"]])} for r in requests]


def load(port: int, model: str, clients: int, seconds: float, files: list[str]) -> dict:
    """``clients`` threads, each with its own HTTP client, send one image per request
    for ``seconds``; requests/s and latency percentiles (ms)."""
    import tritonclient.http as http

    blobs = [np.frombuffer(open(f, "rb").read(), np.uint8)[None] for f in files]
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)

    def client(k: int) -> None:
        c = http.InferenceServerClient(f"127.0.0.1:{port}", connection_timeout=120, network_timeout=120)
        mine, i = [], k
        start.wait()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            blob = blobs[i % len(blobs)]
            i += clients
            inp = http.InferInput("images", list(blob.shape), "UINT8")
            inp.set_data_from_numpy(blob)
            t0 = time.perf_counter()
            try:
                c.infer(model, [inp]).as_numpy("image")
            except Exception as exc:  # noqa: BLE001 - reported in the row
                with lock:
                    errors.append(str(exc)[-300:])
                break
            mine.append(time.perf_counter() - t0)
        c.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    ms = np.asarray(latencies) * 1e3
    return {"requests": len(ms), "requests_per_s": len(ms) / elapsed,
            "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
            "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None, "errors": errors[:3]}


def agreement(port: int, models: list[str], files: list[str]) -> float:
    """Mean absolute difference between the first model's outputs and the others' (the
    same preprocessing, resampled by different code)."""
    import tritonclient.http as http

    client = http.InferenceServerClient(f"127.0.0.1:{port}")
    diffs = []
    for f in files:
        blob = np.frombuffer(open(f, "rb").read(), np.uint8)[None]
        inp = http.InferInput("images", list(blob.shape), "UINT8")
        inp.set_data_from_numpy(blob)
        outs = [client.infer(m, [inp]).as_numpy("image") for m in models]
        diffs += [float(np.abs(o - outs[0]).mean()) for o in outs[1:]]
    client.close()
    return float(np.mean(diffs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=256, help="distinct images sent (default: 256)")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement (default: 5)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", default="1,8,32", help="concurrency levels (default: 1,8,32)")
    parser.add_argument("--instances", type=int, default=4, help="Triton instances per model (default: 4)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--load", help=argparse.SUPPRESS)  # internal: run one load in this process
    args = parser.parse_args(argv)
    if args.load:
        print(json.dumps(load(**json.loads(args.load))))
        return
    if sys.version_info[:2] != (3, 12):  # PyTriton's Triton loads models only under 3.12
        python = ensure(log=lambda m: print(m, file=sys.stderr))
        sys.exit(subprocess.call([python, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)]))
    run(args)


def run(args: argparse.Namespace) -> None:
    import gpuio
    from gpuio import serve
    from gpuio.bench._common import machine, sample_root
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    root = sample_root(2000)
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".jpg"))[:args.count]
    http_port, grpc_port, metrics_port = free_ports(3)
    models = {"gpuio cpu": "gpuio_cpu", "Pillow + NumPy": "pillow"}
    servers = [serve.Server(serve.parse_ops(OPS), name="gpuio_cpu", instances=args.instances)]
    if gpuio.cuda_available():
        models["gpuio cuda"] = "gpuio_cuda"
        servers.append(serve.Server(serve.parse_ops(OPS), name="gpuio_cuda", device="cuda",
                                    instances=args.instances))
    serve.libpython_on_path()
    config = TritonConfig(http_address="127.0.0.1", grpc_address="127.0.0.1", metrics_address="127.0.0.1",
                          http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port, exit_timeout_secs=5)
    levels = [int(c) for c in args.clients.split(",")]
    results: dict[str, dict[int, dict]] = {name: {} for name in models}
    with Triton(config=config) as triton:
        for s in servers:
            s.bind(triton)
        triton.bind(model_name="pillow", infer_func=[pillow_infer] * args.instances,
                    inputs=[Tensor(name="images", dtype=np.uint8, shape=(-1,))],
                    outputs=[Tensor(name="image", dtype=np.float32, shape=(3, 224, 224))],
                    config=ModelConfig(max_batch_size=64, batcher=DynamicBatcher(max_queue_delay_microseconds=1000)))
        triton.run()
        diff = agreement(http_port, list(models.values()), files[:16])
        print(f"Pillow + NumPy vs gpuio, 16 images: mean |difference| {diff:.4f} (normalized units)", file=sys.stderr)
        names = list(models)
        for clients in levels:
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[:r % len(names)]:
                    spec = {"port": http_port, "model": models[name], "clients": clients,
                            "seconds": args.seconds, "files": files}
                    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--load", json.dumps(spec)],
                                          capture_output=True, text=True, check=True)
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    best = results[name].get(clients)
                    if best is None or row["requests_per_s"] > best["requests_per_s"]:
                        results[name][clients] = row
                    print(f"  {name:16s} {clients:3d} clients, round {r + 1}: {row['requests_per_s']:.1f} req/s",
                          file=sys.stderr)
    for s in servers:
        s.stop()  # Triton is stopped: this ends the batch threads
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, GPUs: {info['gpus']}; {len(files)} sample JPEGs, "
          f"{args.instances} instances per model, best of {args.rounds} rounds of {args.seconds:g} s; "
          f"outputs differ by {diff:.4f} on average (normalized units)")
    print(f"{'model':16s} {'clients':>7s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'vs Pillow':>9s}  errors")
    for clients in levels:
        base = results["Pillow + NumPy"][clients]["requests_per_s"]
        for name in models:
            row = results[name][clients]
            print(f"{name:16s} {clients:7d} {row['requests_per_s']:8.1f} {row['p50_ms'] or 0:8.1f} "
                  f"{row['p99_ms'] or 0:8.1f} {row['requests_per_s'] / base if base else 0:9.2f}  "
                  f"{len(row['errors']) or '-'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": info, "ops": OPS, "instances": args.instances, "seconds": args.seconds,
                       "mean_abs_difference": diff,
                       "rounds": args.rounds, "results": results}, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
