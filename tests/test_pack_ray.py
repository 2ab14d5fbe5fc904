"""gpuio.ray.pack on a real local Ray cluster: a worker killed in the middle of a shard
(SIGKILL) has its task run again, and the result equals an undisturbed pack."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import pytest
import ray

import gpuio
import gpuio.ray
from gpuio.cli import main
from gpuio.sample import make_image_tree


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, address="local", include_dashboard=False, logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()


def _files(folder) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def _shard_tasks() -> list[int]:
    """The processes running a shard task now (Ray titles them after the task's function)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::_ray_shard"):
                    pids.append(int(pid))
        except OSError:  # it ended meanwhile
            pass
    return pids


def test_a_worker_killed_mid_shard_gives_the_same_pack(cluster, tmp_path):
    tree = make_image_tree(tmp_path / "src", count=30, seed=2, progress=False)
    src = gpuio.storage.learn_lengths(gpuio.formats.filetree(tree))
    src.save(tmp_path / "src.idx")
    saved = str(tmp_path / "src.idx")
    whole = gpuio.pack(saved, tmp_path / "whole", shard_size=300_000)
    nshards = len(json.loads(open(os.path.join(whole, "index.json")).read())["shards"])
    # one source file becomes a FIFO: the task reading it waits in open() until killed
    victim = src.extent(15, "data").file
    shutil.copy(victim, tmp_path / "kept.jpg")
    os.remove(victim)
    os.mkfifo(victim)
    dest = tmp_path / "ray"
    errors: list[BaseException] = []

    def run() -> None:
        try:
            gpuio.ray.pack(saved, dest, shard_size=300_000)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    progress = dest / ".gpuio-pack.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # every other shard done: the one left waits on the FIFO
        if progress.exists() and len(json.loads(progress.read_text())["done"]) == nshards - 1:
            break
        time.sleep(0.2)
    stuck = _shard_tasks()
    assert len(stuck) == 1 and thread.is_alive() and not errors
    os.replace(tmp_path / "kept.jpg", victim)  # the FIFO's waiter keeps the old inode
    os.kill(stuck[0], signal.SIGKILL)
    thread.join(120)
    assert not thread.is_alive() and not errors, errors
    assert _files(dest) == _files(whole)
    # the CLI's --ray joins the cluster this process is connected to
    assert main(["pack", saved, "-o", str(tmp_path / "cli"), "--shard-size", "300000", "--ray", "auto"]) == 0
    assert _files(tmp_path / "cli") == _files(whole)
    # and a packed dataset is read on the cluster as any index is
    packed = gpuio.formats.packed(dest)
    rows = gpuio.ray.read(packed, batch_size=8).take_all()
    assert [int(r["index"]) for r in rows] == list(range(len(packed)))
    for r in rows:
        assert bytes(r["data"]) == packed[int(r["index"])]["data"] and int(r["label"]) == packed.values["label"][
            int(r["index"])]
