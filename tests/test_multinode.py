"""Two "nodes" on one machine: two ``torchrun --nnodes=2`` launches meeting by c10d
rendezvous on loopback (gloo, 2 ranks each), each node with its own cache folder (its
NVMe) and its own fault-injecting proxy in front of one SeaweedFS store, so that every
node's GETs are counted apart. Two shuffled epochs: every sample exactly once per epoch
across the four ranks, and each node downloads exactly the blocks its ranks read, each
once although both of its ranks ask. In the third epoch node 1 is killed (SIGKILL, its
agent's and its ranks' process groups) mid-epoch; the job restarts from the last
``state_dict()`` on node 0 alone, with two ranks and another batch size: the rest of
the epoch exactly once, and node 0 downloads none of the blocks it already holds.
Node 1's link to the store fails meanwhile (503s, dropped connections, a body cut
short, a stalled answer): its ranks retry and the epochs complete exactly once.

A read that stalls past every try (the remote timeout each) stops its rank with a
PipelineError naming the rank, the URL and the byte range, in about tries x timeout.

This file is also the ranks' script: ``python tests/test_multinode.py WORKDIR PHASE``
under torchrun."""

from __future__ import annotations

import io
import json
import re
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time

import numpy as np
import pytest

from gpuio import formats
from gpuio.storage import remote

from remote_env import ACCESS_KEY, SECRET_KEY, FaultProxy, SeaweedS3

SHARDS, PER_SHARD, BLOCK = 4, 24, 8192
N = SHARDS * PER_SHARD
B, SEED, KILL_AFTER = 4, 3, 2  # node 1 is killed after epoch 2's step KILL_AFTER (0-based)
RESUME_B = 3
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _payload(j: int) -> bytes:
    return bytes([j % 251]) * (100 + j)  # under 512 bytes: one tar block


def _write(path: str, value: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)  # the test never reads half a file


def _rank_main(work: str, phase: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import gpuio
    from gpuio.index import SampleIndex

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ["GPUIO_TEST_NODE"])
    index = SampleIndex.load(os.path.join(work, "index.npz"))  # no listing, no header reads

    def step(batch: dict) -> list[int]:
        rows = batch["index"].tolist()
        for i, data in zip(rows, batch["bin"]):
            assert bytes(data) == _payload(i), f"rank {rank}: sample {i} has other bytes"
        dist.all_reduce(torch.ones(1))  # a collective per step, as DDP's backward does
        return rows

    if phase == "train":
        loader = gpuio.Loader(index, B, shuffle=True, seed=SEED, rank=rank, world_size=world, threads=1,
                              output="numpy")
        for epoch in (0, 1):
            rows = [i for batch in loader for i in step(batch)]
            _write(os.path.join(work, f"epoch{epoch}-rank{rank}.json"), {"node": node, "rows": rows})
        while not os.path.exists(os.path.join(work, "go")):  # the test reads the GET counts of epochs 0-1
            time.sleep(0.02)
        rows = []
        for k, batch in enumerate(loader):
            rows += step(batch)
            _write(os.path.join(work, f"state-rank{rank}-step{k}.json"),
                   {"node": node, "rows": rows, "state": loader.state_dict(), "pid": os.getpid()})
            if node == 1 and k == KILL_AFTER:
                time.sleep(600)  # killed here by the test
    else:
        with open(os.path.join(work, "states.json")) as f:
            states = json.load(f)
        loader = gpuio.Loader(index, RESUME_B, shuffle=True, seed=SEED, rank=rank, world_size=world, threads=1,
                              output="numpy")
        loader.load_state_dict(states)
        batches = [step(batch) for batch in loader]
        _write(os.path.join(work, f"resumed-rank{rank}.json"), {"node": node, "batches": batches})
    dist.barrier()
    dist.destroy_process_group()


# ---- the test (the driver) ---------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _shards(server) -> list[str]:
    """Webdataset shards (``KEY.bin``, ``KEY.cls`` members) in the store; their URLs."""
    s3 = server.boto()
    s3.create_bucket(Bucket="data")
    for k in range(SHARDS):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for j in range(k * PER_SHARD, (k + 1) * PER_SHARD):
                for ext, value in (("bin", _payload(j)), ("cls", str(j % 7).encode())):
                    member = tarfile.TarInfo(f"{j:04d}.{ext}")
                    member.size = len(value)
                    tar.addfile(member, io.BytesIO(value))
        s3.put_object(Bucket="data", Key=f"wds/shard-{k}.tar", Body=buf.getvalue())
    s3.close()
    return [f"s3://data/wds/shard-{k}.tar" for k in range(SHARDS)]


def _blocks(index, samples) -> set[tuple[int, int]]:
    """(file, block) of every cache block the samples' fields lie in."""
    out = set()
    for field in ("bin", "cls"):
        ext = index.extents[field]
        s = np.asarray(sorted(samples), dtype=np.int64)
        for f, a, n in zip(ext.file[s].tolist(), ext.offset[s].tolist(), ext.length[s].tolist()):
            out.update((f, b) for b in range(a // BLOCK, (a + max(n, 1) - 1) // BLOCK + 1))
    return out


def _gets(asked: list[tuple[str, str, str]], since: int = 0) -> list[tuple[int, int]]:
    """The (file, block) of each request of ``asked`` (a proxy's) from ``since`` on."""
    out = []
    for method, path, rng in asked[since:]:
        assert method == "GET" and rng.startswith("bytes="), f"a request other than a block's GET: {method} {path}"
        start, end = (int(x) for x in rng[6:].split("-"))
        assert start % BLOCK == 0 and end - start < BLOCK, f"not a block's range: {rng}"
        out.append((int(path.rsplit("-", 1)[1].split(".")[0]), start // BLOCK))
    return out


class _Node:
    """One node: a torchrun agent (its own session) with the node's proxy and cache folder."""

    def __init__(self, work: str, node: int, nnodes: int, port: int, phase: str, env: dict[str, str]) -> None:
        self.log = open(os.path.join(work, f"node{node}-{phase}.log"), "w")
        # c10d rendezvous numbers the nodes in the order they join (torchrun ignores --node_rank with it)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0",
               os.path.abspath(__file__), work, phase]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env, "GPUIO_TEST_NODE": str(node)},
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.flush()

    def text(self) -> str:
        with open(self.log.name) as f:
            return f.read()[-4000:]


def _wait_for(paths: list[str], nodes: list[_Node], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        for n in nodes:
            if n.proc.poll() is not None:
                raise AssertionError(f"a node exited with {n.proc.returncode}:\n{n.text()}")
        assert time.monotonic() < deadline, "the ranks did not get there in time"
        time.sleep(0.05)


AWS = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
       "AWS_CONFIG_FILE": "/nonexistent/gpuio-test-aws-config",
       "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/gpuio-test-aws-credentials"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The SeaweedFS server with the shards, their index saved (the ranks load it: no
    request of theirs but the blocks' GETs) and the store's port."""
    folder = tmp_path_factory.mktemp("multinode")
    server = SeaweedS3(str(folder / "weed"))
    try:
        with pytest.MonkeyPatch.context() as env:
            for name, value in {**AWS, "AWS_ENDPOINT_URL": server.endpoint}.items():
                env.setenv(name, value)
            env.delenv("AWS_PROFILE", raising=False)
            remote.reset_client()
            index = formats.webdataset(_shards(server), fields=("bin", "cls"))
            index.save(str(folder / "index.npz"))
            yield index, str(folder / "index.npz"), int(server.endpoint.rsplit(":", 1)[1])
    finally:
        remote.reset_client()
        server.kill()
        server.kill()


def test_two_nodes_exactly_once_one_download_per_block_and_a_node_lost(store, tmp_path):
    index, saved_index, port = store
    work = str(tmp_path)
    shutil.copy(saved_index, os.path.join(work, "index.npz"))
    nodes: list[_Node] = []
    proxies = [FaultProxy(("127.0.0.1", port)) for _ in range(2)]
    try:
        # node 1's link: 503s, dropped connections, a body cut short, an answer that never comes
        proxies[1].fail(2, 503)
        proxies[1].drop(2)
        proxies[1].truncate(1)
        proxies[1].stall(1)
        envs = [{**AWS, "AWS_ENDPOINT_URL": p.url, "GPUIO_REMOTE_CACHE_DIR": os.path.join(work, f"cache{k}"),
                 "GPUIO_REMOTE_BLOCK": str(BLOCK), "GPUIO_REMOTE_TIMEOUT": "2", "OMP_NUM_THREADS": "1"}
                for k, p in enumerate(proxies)]
        rdzv = _free_port()
        nodes = [_Node(work, k, 2, rdzv, "train", envs[k]) for k in range(2)]
        ranks = range(4)
        _wait_for([os.path.join(work, f"epoch1-rank{r}.json") for r in ranks], nodes)
        seen_12 = [list(p.asked) for p in proxies]  # epochs 0 and 1
        open(os.path.join(work, "go"), "w").close()
        last = [os.path.join(work, f"state-rank{r}-step{KILL_AFTER}.json") for r in ranks]
        _wait_for(last, nodes)
        states = []
        for p in last:
            with open(p) as f:
                states.append(json.load(f))
        for s in states:  # node 1: kill every process of it, the agent and each rank's session
            if s["node"] == 1:
                os.killpg(s["pid"], signal.SIGKILL)
        os.killpg(nodes[1].proc.pid, signal.SIGKILL)
        nodes[1].wait(30)
        assert nodes[0].wait(90) != 0, "node 0 went on without node 1"
        before_resume = len(proxies[0].asked)
        _write(os.path.join(work, "states.json"), [s["state"] for s in states])
        resumed = _Node(work, 0, 1, _free_port(), "resume", envs[0])
        nodes.append(resumed)
        assert resumed.wait(120) == 0, resumed.text()
    finally:
        for n in nodes:
            if n.proc.poll() is None:
                os.killpg(n.proc.pid, signal.SIGKILL)
                n.proc.wait()
        for p in proxies:
            p.close()

    def reports(name: str, count: int) -> list[dict]:
        out = []
        for r in range(count):
            with open(os.path.join(work, name.format(r=r))) as f:
                out.append(json.load(f))
        return out

    held = [set(), set()]  # the blocks each node's ranks read
    for epoch in (0, 1):
        reps = reports(f"epoch{epoch}-rank{{r}}.json", 4)
        assert sorted(i for v in reps for i in v["rows"]) == list(range(N)), f"epoch {epoch}: not exactly once"
        for k in (0, 1):
            mine = [_blocks(index, v["rows"]) for v in reps if v["node"] == k]
            assert len(mine) == 2, "two ranks per node"
            held[k] |= mine[0] | mine[1]
            if epoch == 0:
                assert mine[0] & mine[1], f"node {k}'s ranks share no block: the test shows no shared download"
    gets = [_gets(seen_12[k]) for k in (0, 1)]
    assert len(gets[0]) == len(set(gets[0])), "node 0 downloaded a block twice"
    # node 1: each of its 6 faults is one more GET of the same block, retried
    assert len(gets[1]) - len(set(gets[1])) == 6, sorted(gets[1])
    for k in (0, 1):
        assert set(gets[k]) == held[k], f"node {k} downloaded other blocks than its ranks read"

    # epoch 2: the position every rank saved at the last step they all took, then the resumed job
    assert {s["state"]["consumed"] for s in states} == {(KILL_AFTER + 1) * 4 * B}
    before = [i for s in states for i in s["rows"]]
    resumed = reports("resumed-rank{r}.json", 2)
    assert {v["node"] for v in resumed} == {0} and len({len(v["batches"]) for v in resumed}) == 1
    after = [i for v in resumed for b in v["batches"] for i in b]
    assert sorted(before + after) == list(range(N)), "the lost epoch is not exactly once"
    epoch2 = _gets(proxies[0].asked[:before_resume], len(seen_12[0]))
    again = _gets(proxies[0].asked, before_resume)
    assert len(epoch2) == len(set(epoch2)) and not set(epoch2) & set(gets[0]), "node 0 downloaded a block again"
    assert not set(again) & (set(gets[0]) | set(epoch2)), "the resumed job downloaded blocks node 0 held"
    assert set(again) == _blocks(index, after) - set(gets[0]) - set(epoch2)
    assert _blocks(index, after) - set(again), "the resumed job read no block from node 0's cache"


if __name__ == "__main__":
    _rank_main(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization: gloo's threads can abort a finished rank there


def test_a_stalled_read_stops_its_rank_naming_it_the_url_and_the_range(store, tmp_path, monkeypatch):
    """Every answer withheld: the read fails after its tries (the remote timeout each)
    with a PipelineError naming the rank, the object and the byte range, instead of
    leaving the rank (and the others, in their next collective) waiting."""
    import gpuio
    from gpuio.errors import PipelineError
    from gpuio.index import SampleIndex

    _, saved_index, port = store
    proxy = FaultProxy(("127.0.0.1", port))
    try:
        proxy.stall(1000)
        # settings by the environment: the process's client is made on a reading thread
        for name, value in (("AWS_ENDPOINT_URL", proxy.url), ("GPUIO_REMOTE_TIMEOUT", "1"),
                            ("GPUIO_REMOTE_RETRIES", "2"), ("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache")),
                            ("GPUIO_REMOTE_BLOCK", str(BLOCK))):
            monkeypatch.setenv(name, value)
        remote.reset_client()
        loader = gpuio.Loader(SampleIndex.load(saved_index), B, rank=1, world_size=2, threads=1, output="numpy")
        t0 = time.monotonic()
        with pytest.raises(PipelineError) as caught:
            next(iter(loader))
        waited = time.monotonic() - t0
    finally:
        proxy.close()
        remote.reset_client()
    message = str(caught.value)
    named = re.search(r"StorageError: (s3://\S+): at byte \d+: GET bytes (\d+)-(\d+):", message)
    assert "rank 1 of 2" in message and named, message
    url, first, last = named.groups()
    assert ("GET", url[4:], f"bytes={first}-{last}") in proxy.asked, "the range named is not one asked for"
    assert "after 2 tries" in message, message
    assert 2 <= waited < 2 + 4, f"a stalled read took {waited:.1f} s to fail (2 tries of 1 s each)"


_CLAIMER = """
import sys
import gpuio
from gpuio.index import SampleIndex
loader = gpuio.Loader(SampleIndex.load(sys.argv[1]), 4, threads=1, output="numpy")
next(iter(loader))  # its first GET stalls: the process dies holding the block's claim
"""


def test_a_claim_left_by_a_killed_process_is_taken_over_at_once(store, tmp_path, monkeypatch):
    """A process killed while it downloads a block (as a node's ranks are when the job
    stops) leaves the block's ``.part`` claim in the node's cache; the restarted job on
    that node downloads the block at once, not after the stall limit (270 s by default)."""
    import gpuio
    from gpuio.index import SampleIndex

    _, saved_index, port = store
    proxy = FaultProxy(("127.0.0.1", port))
    cache = tmp_path / "cache"
    try:
        proxy.stall(1)  # the first GET: the other blocks are fetched and written
        for name, value in (("AWS_ENDPOINT_URL", proxy.url), ("GPUIO_REMOTE_CACHE_DIR", str(cache)),
                            ("GPUIO_REMOTE_BLOCK", str(BLOCK))):
            monkeypatch.setenv(name, value)
        claimer = subprocess.Popen([sys.executable, "-c", _CLAIMER, saved_index], env={**os.environ, **AWS})
        deadline = time.monotonic() + 60
        while not (proxy.asked and list(cache.rglob("*.part"))) and claimer.poll() is None:
            assert time.monotonic() < deadline, "the reader made no claim"
            time.sleep(0.02)
        claimer.kill()
        claimer.wait()
        claims = list(cache.rglob("*.part"))
        assert claims, "the killed process left no claim"
        remote.reset_client()
        loader = gpuio.Loader(SampleIndex.load(saved_index), B, threads=1, output="numpy")
        t0 = time.monotonic()
        batch = next(iter(loader))
        waited = time.monotonic() - t0
        loader.close()
    finally:
        proxy.close()
        remote.reset_client()
    assert [bytes(d) for d in batch["bin"]] == [_payload(i) for i in batch["index"].tolist()]
    assert waited < 10, f"the restarted reader waited {waited:.0f} s for a dead process's claim"
