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
