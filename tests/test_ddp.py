"""Two real processes with torch.distributed (gloo, CPU): every rank takes the same
number of steps, and the all-gathered ``index`` rows hold every sample exactly once."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gpuio

N, B, WORLD, EPOCHS = 37, 4, 2, 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(rank: int, root: str, store: str, out: str, last_batch: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    index = gpuio.formats.numpy(root)
    loader = gpuio.Loader(index, B, shuffle=True, seed=7, rank=rank, world_size=WORLD,
                          last_batch=last_batch, threads=2)
    result = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        rows, steps = [], 0
        for batch in loader:
            step = torch.ones(1)
            dist.all_reduce(step)  # a collective per step, as DDP's backward does
            rows.append(batch["index"])
            steps += 1
            for i, data in zip(batch["index"].tolist(), batch["data"]):
                if i >= 0:  # each real row carries its own sample's array
                    assert np.array_equal(np.asarray(data), np.load(index.extent(i).file))
        local = torch.cat(rows)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
        dist.all_gather(sizes, torch.tensor([len(local)]))
        longest = int(max(s.item() for s in sizes))
        padded = torch.full((longest,), -2, dtype=torch.int64)
        padded[: len(local)] = local
        gathered = [torch.empty(longest, dtype=torch.int64) for _ in range(WORLD)]
        dist.all_gather(gathered, padded)
        steps_all = [torch.zeros(1, dtype=torch.int64) for _ in range(WORLD)]
        dist.all_gather(steps_all, torch.tensor([steps]))
        result.append({"rows": [g[: int(s.item())].numpy() for g, s in zip(gathered, sizes)],
                       "steps": [int(s.item()) for s in steps_all]})
    if rank == 0:
        np.save(out, np.array(result, dtype=object), allow_pickle=True)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def npy_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_npy")
    rng = np.random.default_rng(0)
    for i in range(N):
        np.save(root / f"{i:03d}.npy", rng.standard_normal(3, dtype=np.float32))
    return str(root)


@pytest.mark.parametrize("last_batch", ["partial", "pad"])
def test_ddp_exactly_once(npy_root, tmp_path, last_batch):
    out = str(tmp_path / "result.npy")
    ctx = mp.start_processes(_worker, args=(npy_root, str(tmp_path / "store"), out, last_batch),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("DDP workers did not finish in 90 s (unequal step counts hang collectives)")
    result = np.load(out, allow_pickle=True)
    orders = []
    for epoch in result:
        assert len(set(epoch["steps"])) == 1, f"ranks took different step counts: {epoch['steps']}"
        rows = np.concatenate(epoch["rows"])
        real = rows[rows >= 0]
        np.testing.assert_array_equal(np.sort(real), np.arange(N))  # exactly once
        if last_batch == "pad":
            assert len(rows) == WORLD * B * epoch["steps"][0]
        orders.append(real)
    assert not np.array_equal(orders[0], orders[1]), "epochs should be shuffled differently"


def test_torchrun_example(tmp_path):
    """bench/ddp.py under torchrun: two CPU ranks, DDP training, exactly-once check."""
    out = tmp_path / "ddp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(REPO, "bench", "ddp.py"), "--samples", "37", "--batch-size", "4",
           "--threads", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exactly-once across ranks: OK" in proc.stdout
    import json

    result = json.loads(out.read_text())
    assert result["exactly_once"] and result["world_size"] == 2
