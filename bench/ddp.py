"""Multi-GPU training with gpuio.Loader and DistributedDataParallel, launched by torchrun.

    torchrun --standalone --nproc_per_node=8 bench/ddp.py --data /data/features --epochs 2
    torchrun --standalone --nproc_per_node=2 bench/ddp.py            # CPU, gloo, synthetic data

Each process reads its shard (``rank``/``world_size`` from torchrun's environment) on
its own GPU (``cuda:LOCAL_RANK``, NCCL) or on the CPU (gloo). ``--data`` is a directory
of ``.npy`` feature arrays of one shape; without it rank 0 writes a small synthetic
dataset to a temporary directory. The model is a linear probe: the point is the input
pipeline. At the end the ranks all-gather the ``index`` rows they saw and rank 0 checks
that every sample was a real row exactly once per epoch, and prints samples/s per rank
and overall.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import gpuio
from gpuio.bench._common import write_json
from gpuio.batch import Batch, Op


class AsFloat32(Op):
    """Each sample's array (``formats.numpy`` gives the stored dtype and shape) as
    float32 (NumPy or CuPy alike; no copy when it is float32 already)."""

    def __call__(self, batch: Batch) -> Batch:
        batch.data["data"] = [d.astype(np.float32, copy=False) for d in batch.data["data"]]
        return batch


def synthetic(root: str, samples: int, dim: int) -> None:
    rng = np.random.default_rng(0)
    for i in range(samples):
        np.save(os.path.join(root, f"{i:06d}.npy"), rng.standard_normal(dim, dtype=np.float32))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="directory of .npy arrays (default: synthetic)")
    p.add_argument("--samples", type=int, default=1000, help="synthetic samples")
    p.add_argument("--dim", type=int, default=64, help="synthetic feature size")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--last-batch", default="partial", choices=["partial", "drop", "pad"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", help="rank 0 writes the results as JSON here")
    args = p.parse_args(argv)

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = gpuio.cuda_available() and torch.cuda.is_available()
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))

    tmp = None
    root = args.data
    if root is None:  # rank 0 writes, the others wait and use the same path
        tmp = tempfile.TemporaryDirectory(prefix="gpuio-ddp-") if rank == 0 else None
        path = [tmp.name if tmp else None]
        dist.broadcast_object_list(path, src=0)
        root = path[0]
        if rank == 0:
            synthetic(root, args.samples, args.dim)
        dist.barrier()

    index = gpuio.formats.numpy(root)
    loader = gpuio.Loader(index, args.batch_size, ops=[AsFloat32()], device=device, shuffle=True, seed=0,
                          rank=rank, world_size=world, last_batch=args.last_batch, threads=args.threads)
    dim = int(np.prod(index.values["shape"][0]))
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Linear(dim, 1).to(device), device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    ok = True
    t0 = time.perf_counter()
    real_rows = 0
    for epoch in range(args.epochs):
        loader.set_epoch(epoch)
        seen = []
        for batch in loader:
            x = batch["data"].reshape(len(batch["index"]), -1)
            keep = (batch["index"] >= 0).to(x.dtype)  # padding rows carry data, weigh 0
            loss = ((model(x).squeeze(1) - x.mean(1)) ** 2 * keep).sum() / keep.sum().clamp(min=1)
            opt.zero_grad()
            loss.backward()  # DDP all-reduce: hangs unless every rank takes the same steps
            opt.step()
            seen.append(batch["index"].cpu())
            real_rows += int((batch["index"] >= 0).sum())
        mine = torch.cat(seen) if seen else torch.zeros(0, dtype=torch.int64)
        gathered: list[torch.Tensor] = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            rows = torch.cat(gathered)
            rows = rows[rows >= 0].numpy()
            n = len(index)
            expect = n if args.last_batch != "drop" else n // (world * args.batch_size) * world * args.batch_size
            once = len(np.unique(rows)) == len(rows) == expect
            ok &= once
            print(f"epoch {epoch}: {len(rows)} real rows over {world} ranks, {len(loader)} batches per rank; "
                  f"exactly-once: {'OK' if once else 'FAILED'}", flush=True)
    seconds = time.perf_counter() - t0
    rates: list[float] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(rates, real_rows / seconds)
    if rank == 0:
        result = {"world_size": world, "device": device, "samples": len(index), "batch_size": args.batch_size,
                  "epochs": args.epochs, "samples_per_s_per_rank": rates, "samples_per_s": sum(rates),
                  "exactly_once": bool(ok), "stats_rank0": loader.stats()}
        print(f"samples/s per rank: {', '.join(f'{r:,.0f}' for r in rates)}; total {sum(rates):,.0f}")
        print(f"exactly-once across ranks: {'OK' if ok else 'FAILED'}")
        write_json(args.out, json.loads(json.dumps(result, default=str)))
    loader.close()  # its threads end before the process group and the interpreter do
    dist.barrier()
    dist.destroy_process_group()
    if tmp is not None:
        tmp.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Ends without interpreter finalization: gloo's C++ worker threads may still hold work
    # objects after destroy_process_group, and destroying those while the interpreter is torn
    # down aborts the rank ('terminate called without an active exception') after it is done.
    os._exit(code)
