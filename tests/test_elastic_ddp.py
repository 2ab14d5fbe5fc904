"""Elastic resume across real processes: ``torchrun`` (gloo, CPU) runs 4 ranks that
save their states mid-epoch, then 2 and then 3 ranks that resume from them. Across the
two jobs every sample is a real row exactly once in the interrupted epoch, every rank
takes the same number of steps, and the next epoch is whole.

This file is also the ranks' script: ``python tests/test_elastic_ddp.py save|resume ...``
under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

N, EPOCH, SAVE_STEPS = 37, 1, 2
SAVED = {"world_size": 4, "batch_size": 3, "last_batch": "pad"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rank_main(phase: str, root: str, state_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import gpuio

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    index = gpuio.formats.numpy(root)
    if phase == "save":
        loader = gpuio.Loader(index, SAVED["batch_size"], last_batch=SAVED["last_batch"], shuffle=True, seed=5,
                              rank=rank, world_size=world, threads=1, output="numpy")
        loader.set_epoch(EPOCH)
        it = iter(loader)
        rows = []
        for _ in range(SAVE_STEPS):
            rows.append(next(it)["index"].tolist())
            dist.all_reduce(torch.ones(1))  # a collective per step, as DDP's backward does
        state = loader.state_dict()
        del it
        result = {"state": state, "rows": rows}
    else:
        with open(state_file) as f:
            states = json.load(f)["states"]
        loader = gpuio.Loader(index, 4, last_batch="partial", shuffle=True, seed=5, rank=rank, world_size=world,
                              threads=1, output="numpy")
        loader.load_state_dict(states)
        epochs = []
        for _ in range(2):  # the rest of the saved epoch, then the next one
            rows = []
            for batch in loader:
                rows.append(batch["index"].tolist())
                dist.all_reduce(torch.ones(1))
            epochs.append(rows)
        result = {"epochs": epochs, "epoch_after": loader.epoch}
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"states": [g["state"] for g in gathered], "rows": [g["rows"] for g in gathered]}
                      if phase == "save" else {"ranks": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()


def _torchrun(nproc: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.abspath(__file__), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_torchrun_save_at_4_resume_at_2_and_3(tmp_path):
    root = tmp_path / "npy"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(N):
        np.save(root / f"{i:03d}.npy", rng.standard_normal(3, dtype=np.float32))
    saved = tmp_path / "saved.json"
    _torchrun(SAVED["world_size"], "save", str(root), "", str(saved))
    saved_run = json.loads(saved.read_text())
    states = saved_run["states"]
    position = [{k: v for k, v in s.items() if k not in ("rank", "skipped")} for s in states]
    assert all(p == position[0] for p in position), "ranks saved different positions at the same step"
    assert position[0]["consumed"] == SAVE_STEPS * SAVED["world_size"] * SAVED["batch_size"]
    before = np.array([i for r in saved_run["rows"] for b in r for i in b if i >= 0], dtype=np.int64)
    assert len(before) == position[0]["consumed"]
    for world in (2, 3):
        out = tmp_path / f"resumed{world}.json"
        _torchrun(world, "resume", str(root), str(saved), str(out))
        ranks = json.loads(out.read_text())["ranks"]
        assert len(ranks) == world
        for e in range(2):
            steps = {len(r["epochs"][e]) for r in ranks}
            assert len(steps) == 1, f"W={world}: ranks took different step counts {steps}"
            rows = np.array([i for r in ranks for b in r["epochs"][e] for i in b if i >= 0], dtype=np.int64)
            seen = np.concatenate([before, rows]) if e == 0 else rows
            np.testing.assert_array_equal(np.sort(seen), np.arange(N))  # exactly once
        assert all(r["epoch_after"] == EPOCH + 2 for r in ranks)


if __name__ == "__main__":
    _rank_main(*sys.argv[1:5])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization: gloo's threads can abort a finished rank there
