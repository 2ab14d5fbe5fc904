"""What a gpuio job costs the object store at 8, 64 and 1,000 nodes of 8 GPUs: a model
fed with per-sample costs measured on this machine and the object store's documented
limits, checked against a small run of real gpuio ranks.

    python bench/scale_model.py [--gpu-rate 2000] [--epochs 90] [--check] [--out r.json]

Measured here (each the best of 3): the saved index's bytes and ``SampleIndex.load``
time per sample (a webdataset-like index: shard, offset, length, label, key), and the
time per position to evaluate a rank's share of the shuffled epoch order.

Documented limits (Amazon S3 User Guide, "Best practices design patterns: optimizing
Amazon S3 performance" and the ListObjectsV2 API reference): 5,500 GET/HEAD requests per
second per partitioned prefix; one concurrent request per 85-90 MB/s of throughput
(85 MB/s is used); a listing page holds at most 1,000 keys. Assumptions (flags): each
GPU consumes ``--gpu-rate`` samples/s, a node's NIC carries ``--nic-gbps``, the cache
keeps every block it is given (``remote_cache_budget`` set to the NVMe's size).

The rules the model applies (the Loader's epoch order is one global permutation; each
node's cache downloads a block once, when one of its ranks first reads in it):

- one object per sample (``files``): a cold read is one GET per sample;
- shards read in cache blocks of ``remote_block`` (``shards``): a node reads 1/n of the
  samples, at random, so it touches a block of k samples with p = 1 - (1 - 1/n)^k and
  downloads that share of the dataset's blocks; across n nodes the store sends
  n * p times the dataset per cold epoch (the read amplification);
- after e epochs a node holds 1 - (1 - q)^e of the dataset (q = 1/n for files, p for
  shards): later epochs fetch the rest, then read local NVMe only;
- listing: ceil(objects / 1,000) LIST requests per lister; every rank listing at start
  sends ranks x pages requests to one prefix; an index file instead is one GET per rank.

``--check`` runs the small case of tests/test_multinode.py for real (SeaweedFS on
loopback; 4 webdataset shards of 24 samples, 8 KiB blocks, 2 nodes of 2 ranks, 2
shuffled epochs) and prints the model's GETs per node beside the GETs the nodes made.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import best_time, machine, print_table, write_json  # noqa: E402
from gpuio.index import Extents, PathTable, Ragged, SampleIndex  # noqa: E402
from gpuio.pipeline.order import epoch_order  # noqa: E402

S3_GET_PER_PREFIX = 5500  # GET/HEAD requests per second per partitioned prefix (S3 User Guide)
S3_BYTES_PER_CONNECTION = 85e6  # one concurrent request per 85-90 MB/s (S3 User Guide)
S3_KEYS_PER_LIST = 1000  # ListObjectsV2 returns at most 1,000 keys per request
BLOCK = 8 << 20  # gpuio's remote_block default: the unit the node cache downloads
SHARD = 128 << 20  # gpuio pack's default shard size
GPUS_PER_NODE = 8
REQUESTS_PER_RANK = 32  # gpuio's remote_requests default: GETs in flight per reader
DATASETS = {  # samples, mean bytes per sample
    "imagenet-1k": (1_281_167, 110_000),  # ILSVRC2012 train: 1,281,167 JPEGs, about 140 GB
    "100M-sample": (100_000_000, 100_000),
}
NODES = (8, 64, 1000)


def measure(n: int = 200_000) -> dict[str, float]:
    """Per-sample costs on this machine: the saved index's bytes and load time, and the
    epoch order's evaluation time per position."""
    shards = n // 1000
    rng = np.random.default_rng(0)
    files = PathTable.from_paths([f"s3://bucket/train/shard-{k:06d}.tar" for k in range(shards)])
    length = rng.integers(50_000, 170_000, n)
    file = np.repeat(np.arange(shards), 1000)[:n]
    offset = np.zeros(n, dtype=np.int64)
    for k in range(shards):
        rows = slice(k * 1000, (k + 1) * 1000)
        offset[rows] = np.cumsum(np.r_[0, length[rows][:-1] + 1024]) + 512
    index = SampleIndex(files, {"jpg": Extents(file, offset, length)},
                        {"cls": rng.integers(0, 1000, n), "__key__": Ragged.from_list([f"n{i:08d}" for i in range(n)],
                                                                                     kind="str")})
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "index.npz")
        index.save(path)
        size = os.path.getsize(path)
        load = best_time(lambda: SampleIndex.load(path), 3)
    big = DATASETS["imagenet-1k"][0]
    share = np.arange(0, big, GPUS_PER_NODE * 8)  # one rank's positions of 64 ranks
    order = epoch_order(big, True, 0, 1)
    evaluate = best_time(lambda: order[share], 3)
    return {"index_bytes_per_sample": size / n, "index_load_s_per_sample": load / n,
            "order_s_per_position": evaluate / len(share)}


def model(samples: int, size: float, nodes: int, layout: str, costs: dict[str, float], gpu_rate: float,
          nic_gbps: float, epochs: int) -> dict[str, Any]:
    """One row: what a job of ``nodes`` x 8 GPUs on this dataset and layout costs."""
    ranks = nodes * GPUS_PER_NODE
    rate = ranks * gpu_rate  # samples/s of the whole job
    epoch_s = samples / rate
    dataset = samples * size
    if layout == "files":
        objects, q = samples, 1 / nodes
        cold_gets = rate  # one GET per sample
        cold_bytes = rate * size
    else:
        objects = math.ceil(dataset / SHARD)
        per_block = BLOCK / size
        q = 1 - (1 - 1 / nodes) ** per_block
        blocks = dataset / BLOCK
        cold_gets = nodes * q * blocks / epoch_s
        cold_bytes = nodes * q * dataset / epoch_s
    node_bytes = cold_bytes / nodes
    cache = dataset * (1 - (1 - q) ** epochs)
    pages = math.ceil(objects / S3_KEYS_PER_LIST)
    index_bytes = samples * costs["index_bytes_per_sample"]
    index_s = samples * costs["index_load_s_per_sample"] + index_bytes / S3_BYTES_PER_CONNECTION
    order_s = samples / ranks * costs["order_s_per_position"]
    limits = {  # share of each limit the cold epoch takes (1 = at the limit)
        "S3 GET/s of a prefix": cold_gets / S3_GET_PER_PREFIX,
        "node NIC": node_bytes * 8 / (nic_gbps * 1e9),
        "GETs in flight/node": node_bytes / S3_BYTES_PER_CONNECTION / (GPUS_PER_NODE * REQUESTS_PER_RANK),
    }
    binding = max(limits, key=limits.get)
    return {"layout": layout, "nodes": nodes, "ranks": ranks, "samples_per_s": rate, "epoch_s": epoch_s,
            "cold_gets_per_s": cold_gets, "prefixes": cold_gets / S3_GET_PER_PREFIX,
            "amplification": cold_bytes / (rate * size), "node_mb_per_s": node_bytes / 1e6,
            "cache_gb_per_node": cache / 1e9, "warm_share_epoch2": q,
            "list_requests_all_ranks": ranks * pages, "list_s_all_ranks": ranks * pages / S3_GET_PER_PREFIX,
            "index_mb": index_bytes / 1e6, "index_s_per_rank": index_s, "order_s_per_rank": order_s,
            "binding": f"{binding} ({limits[binding]:.1f}x)"}


# ---- the check against a real run ----------------------------------------------------------

SMALL = {"shards": 4, "per_shard": 24, "block": 8192, "nodes": 2, "ranks_per_node": 2, "batch": 4, "epochs": 2}


def _small_shards(s3: Any) -> list[str]:
    """tests/test_multinode.py's shards: 4 tars of 24 samples, members KEY.bin and KEY.cls."""
    s3.create_bucket(Bucket="data")
    for k in range(SMALL["shards"]):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for j in range(k * SMALL["per_shard"], (k + 1) * SMALL["per_shard"]):
                for ext, value in (("bin", bytes([j % 251]) * (100 + j)), ("cls", str(j % 7).encode())):
                    member = tarfile.TarInfo(f"{j:04d}.{ext}")
                    member.size = len(value)
                    tar.addfile(member, io.BytesIO(value))
        s3.put_object(Bucket="data", Key=f"wds/shard-{k}.tar", Body=buf.getvalue())
    return [f"s3://data/wds/shard-{k}.tar" for k in range(SMALL["shards"])]


_NODE = """
import json, sys
import gpuio
from gpuio.index import SampleIndex
index = SampleIndex.load(sys.argv[1])
node, nodes, per_node, batch, epochs = (int(v) for v in sys.argv[2:7])
world = nodes * per_node
loaders = [gpuio.Loader(index, batch, shuffle=True, seed=3, rank=node * per_node + r, world_size=world,
                        threads=1, output="numpy") for r in range(per_node)]
gets = []
for epoch in range(epochs):
    for ld in loaders:
        for _ in ld:
            pass
    gets.append(loaders[0].stats()["remote"]["requests"])  # every GET of this process (the node)
print(json.dumps(gets))
"""


def check() -> list[dict[str, Any]]:
    """The model's GETs per node for SMALL beside those of a real run: one process per
    node, its ranks' Loaders in it, its own cache folder, data on SeaweedFS."""
    from gpuio import formats
    from gpuio.bench.remote import SeaweedServer
    from gpuio.storage import remote

    key, secret = "gpuioScaleKey", "gpuioScaleSecret0123456789"
    with tempfile.TemporaryDirectory() as folder:
        server = SeaweedServer(os.path.join(folder, "weed"), key, secret)
        env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret, "AWS_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": server.endpoint, "AWS_CONFIG_FILE": "/nonexistent/scale-model",
               "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/scale-model", "GPUIO_REMOTE_BLOCK": str(SMALL["block"])}
        os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION",
                                                "AWS_ENDPOINT_URL", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")})
        try:
            import boto3

            deadline = time.monotonic() + 60
            while True:
                try:
                    s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=key,
                                      aws_secret_access_key=secret, region_name="us-east-1")
                    urls = _small_shards(s3)
                    break
                except Exception:  # the server is still starting
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            remote.reset_client()
            index = formats.webdataset(urls, fields=("bin", "cls"))
            saved = os.path.join(folder, "index.npz")
            index.save(saved)
            procs = [subprocess.Popen([sys.executable, "-c", _NODE, saved, str(k), str(SMALL["nodes"]),
                                       str(SMALL["ranks_per_node"]), str(SMALL["batch"]), str(SMALL["epochs"])],
                                      env={**env, "GPUIO_REMOTE_CACHE_DIR": os.path.join(folder, f"cache{k}")},
                                      stdout=subprocess.PIPE, text=True) for k in range(SMALL["nodes"])]
            measured = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
        finally:
            server.kill()
    ext = index.extents["bin"]
    blocks = len({(f, o // SMALL["block"]) for f, o in zip(ext.file.tolist(), ext.offset.tolist())})
    per_block = len(index) / blocks
    q = 1 - (1 - 1 / SMALL["nodes"]) ** per_block
    rows = []
    for epoch in range(SMALL["epochs"]):
        predicted = blocks * (1 - (1 - q) ** (epoch + 1))
        for k in range(SMALL["nodes"]):
            got = measured[k][epoch]
            rows.append({"case": f"node {k}, after epoch {epoch + 1}", "model": predicted, "measured": got,
                         "ratio": got / predicted})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-rate", type=float, default=2000.0, help="samples/s each GPU consumes")
    ap.add_argument("--nic-gbps", type=float, default=100.0, help="a node's network, Gbit/s")
    ap.add_argument("--epochs", type=int, default=90, help="epochs of the job (for the cache it ends with)")
    ap.add_argument("--check", action="store_true", help="also run the small real case and compare")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    costs = measure()
    print(f"machine: {machine()['cpu']}, {os.cpu_count()} cores")
    print("measured here: index {index_bytes_per_sample:.1f} B/sample, load {us_load:.3f} us/sample; "
          "epoch order {us_order:.3f} us/position".format(
              us_load=1e6 * costs["index_load_s_per_sample"], us_order=1e6 * costs["order_s_per_position"], **costs))
    print(f"documented (S3): {S3_GET_PER_PREFIX} GET/s per prefix, {S3_BYTES_PER_CONNECTION / 1e6:.0f} MB/s per "
          f"connection, {S3_KEYS_PER_LIST} keys per LIST; assumed: {args.gpu_rate:.0f} samples/s per GPU, "
          f"{args.nic_gbps:.0f} Gbit/s per node, {args.epochs} epochs")
    rows = []
    for name, (samples, size) in DATASETS.items():
        for layout in ("files", "shards"):
            for nodes in NODES:
                rows.append({"dataset": name, **model(samples, size, nodes, layout, costs, args.gpu_rate,
                                                      args.nic_gbps, args.epochs)})
    print_table(rows, [("dataset", "dataset", ""), ("layout", "layout", ""), ("nodes", "nodes", "d"),
                       ("cold_gets_per_s", "cold GET/s", ",.0f"), ("prefixes", "prefixes", ",.1f"),
                       ("amplification", "bytes x", ".1f"), ("node_mb_per_s", "MB/s/node", ",.0f"),
                       ("cache_gb_per_node", "cache GB/node", ",.0f"),
                       ("list_s_all_ranks", "list s (all ranks)", ",.1f"),
                       ("index_mb", "index MB", ",.0f"), ("index_s_per_rank", "index s/rank", ".2f"),
                       ("order_s_per_rank", "order s/rank", ".3f"), ("binding", "binds first", "")])
    checked = check() if args.check else []
    if checked:
        print("\nthe model against a real run (tests/test_multinode.py's case: GETs per node, cumulative)")
        print_table(checked, [("case", "case", ""), ("model", "model", ".1f"), ("measured", "measured", "d"),
                              ("ratio", "measured/model", ".2f")])
    write_json(args.out, {"machine": machine(), "costs": costs, "rows": rows, "check": checked,
                          "assumed": {"gpu_rate": args.gpu_rate, "nic_gbps": args.nic_gbps, "epochs": args.epochs}})


if __name__ == "__main__":
    main()
