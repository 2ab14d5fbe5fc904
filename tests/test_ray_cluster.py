"""gpuio.ray on a Ray cluster of three nodes on one machine (``ray.cluster_utils.Cluster``:
a head that runs the driver and no tasks, two worker nodes of one CPU each, each with
its own cache folder), reading NumPy files from SeaweedFS: a worker node removed while
one of its read tasks is half done, and a worker process killed, during one pass: the
rows are every sample exactly once, in the epoch's order (the lost tasks run again on
the node left, and rows they had handed out are not handed out twice); a consumer that
stops part way resumes from gpuio.ray's state with exactly the rows it had not taken."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

import gpuio.ray as gray
from gpuio import formats
from gpuio.batch import Op
from gpuio.pipeline.order import epoch_order
from gpuio.storage import remote

from remote_env import ACCESS_KEY, SECRET_KEY, SeaweedS3
from test_ray import _DieOnce

N, B, SEED, EPOCH = 32, 4, 11, 2
AWS = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
       "AWS_CONFIG_FILE": "/nonexistent/gpuio-test-aws-config",
       "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/gpuio-test-aws-credentials"}


def _array(i: int) -> np.ndarray:
    return np.arange(i, i + 3 + i % 4, dtype=np.int32)


class _HoldOnce(Op):
    """Writes the id of the node it runs on to ``marker`` and waits there (for the test to
    remove the node) the first time it sees sample ``at``."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at = marker, at

    def __call__(self, batch):
        if self.at in batch.index.tolist() and not os.path.exists(self.marker):
            with open(self.marker + ".tmp", "w") as f:
                f.write(ray.get_runtime_context().get_node_id())
            os.replace(self.marker + ".tmp", self.marker)
            time.sleep(120)
        return batch


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """SeaweedFS with N .npy files, and the cluster, its workers pointed at the store;
    yields (cluster, the worker nodes, the index, a folder for markers)."""
    folder = tmp_path_factory.mktemp("ray-cluster")
    server = SeaweedS3(str(folder / "weed"))
    cluster = None
    env = pytest.MonkeyPatch()
    try:
        s3 = server.boto()
        s3.create_bucket(Bucket="data")
        for i in range(N):
            path = folder / "a.npy"
            np.save(path, _array(i))
            s3.put_object(Bucket="data", Key=f"npy/{i:03d}.npy", Body=path.read_bytes())
        s3.close()
        for name, value in {**AWS, "AWS_ENDPOINT_URL": server.endpoint}.items():  # the raylets' and workers'
            env.setenv(name, value)
        env.delenv("AWS_PROFILE", raising=False)
        remote.reset_client()
        index = formats.numpy("s3://data/npy")
        # a node whose raylet stops answering is declared dead after about a second, not 15
        health = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200,
                  "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                                "_system_config": health})
        workers = [cluster.add_node(num_cpus=1, env_vars={"GPUIO_REMOTE_CACHE_DIR": str(folder / f"cache{k}")})
                   for k in range(2)]
        ray.init(address=cluster.address, logging_level="ERROR")
        for module in (__name__, _DieOnce.__module__):  # the ops travel by value
            ray.cloudpickle.register_pickle_by_value(sys.modules[module])
        yield cluster, workers, index, folder
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        env.undo()
        remote.reset_client()
        server.kill()


def _remove_when_held(cluster, workers, marker: str, removed: list) -> None:
    """Remove (not gracefully) the worker node whose id the op wrote to ``marker``."""
    deadline = time.monotonic() + 120
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(marker) as f:
        node_id = f.read()
    node = next(w for w in workers if w.node_id == node_id)
    cluster.remove_node(node, allow_graceful=False)
    removed.append(node_id)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")  # Ray's own settings, copied
def test_a_node_removed_and_a_worker_killed_mid_pass(cluster):
    cluster, workers, index, folder = cluster
    order = np.asarray(epoch_order(N, True, SEED, EPOCH)).tolist()
    held, died = str(folder / "held"), str(folder / "died")
    # 4 read tasks of 2 batches: the node is removed while its task holds its second batch (position 14),
    # its first handed out; a worker dies in the second batch of the last task (position 29)
    ops = [_HoldOnce(held, order[14]), _DieOnce(died, order[29])]
    ds = gray.read(index, ops=ops, batch_size=B, shuffle=True, seed=SEED, epoch=EPOCH, override_num_blocks=4)
    removed: list[str] = []
    remover = threading.Thread(target=_remove_when_held, args=(cluster, workers, held, removed))
    remover.start()
    rows = []
    taken = 17  # the consumer's position when it "stops": its state is taken there
    state = None
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for i, data in zip(batch["index"].tolist(), batch["data"]):
            np.testing.assert_array_equal(data, _array(i))
            rows.append(i)
            if len(rows) == taken:
                state = gray.state_dict(index, taken, shuffle=True, seed=SEED, epoch=EPOCH)
    remover.join()
    assert removed and os.path.exists(died), "the node was removed and the worker killed"
    assert rows == order, "not every sample exactly once in the epoch's order"
    rest = gray.read(index, batch_size=B, shuffle=True, seed=SEED, state=state)
    got = [int(i) for b in rest.iter_batches(batch_size=None, batch_format="numpy") for i in b["index"]]
    assert got == order[taken:]
