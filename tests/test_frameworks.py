"""Loader output for torch, JAX and TensorFlow: DLPack hand-off without copies, the same
values as ``output="numpy"``, and a missing framework reported when the Loader is made."""

from __future__ import annotations

import importlib
import multiprocessing
import sys
import traceback

import numpy as np
import pytest

import gpuio
from gpuio.batch import Op
from gpuio.storage.buffers import pooled_empty
from gpuio.errors import ConfigError, DependencyError
from gpuio.formats import numpy as npy_format
from gpuio.pipeline._frameworks import convert, load

FRAMEWORKS = ["torch", "jax", "tensorflow"]
N = 10


@pytest.fixture(scope="module")
def npy_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("npy")
    rng = np.random.default_rng(4)
    for i in range(N):
        np.save(root / f"{i:02d}.npy", rng.standard_normal((3, 5)).astype(np.float32))
    return str(root)


@pytest.fixture(scope="module")
def npy(npy_root):
    return npy_format(npy_root)


def to_numpy(x):
    """A framework's tensor as a NumPy array (a copy is fine: for comparing values)."""
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def address(x) -> int:
    """Where a framework's tensor keeps its data."""
    if hasattr(x, "data_ptr"):  # torch
        return x.data_ptr()
    if hasattr(x, "unsafe_buffer_pointer"):  # JAX
        return x.unsafe_buffer_pointer()
    return np.from_dlpack(x).ctypes.data  # TensorFlow: DLPack gives its buffer back as it is


class Plant(Op):
    """Puts an array it made (page-aligned, from the pool) into each batch and keeps it,
    so that a test can compare addresses and write into the memory afterwards."""

    def __init__(self):
        self.made = {}  # first row's dataset index -> the array (the op's workers finish in any order)

    def __call__(self, batch):
        out = pooled_empty((len(batch.index), 8), np.float32)
        out[:] = np.arange(8, dtype=np.float32)
        batch.data["planted"] = out
        self.made[int(batch.index[0])] = out
        return batch


def check_values(index, output, shuffle):
    want = list(gpuio.Loader(index, 4, output="numpy", shuffle=shuffle))
    got = list(gpuio.Loader(index, 4, output=output, shuffle=shuffle))
    assert len(got) == len(want) == 3
    for g, w in zip(got, want):
        assert set(g) == set(w)
        np.testing.assert_array_equal(to_numpy(g["data"]), w["data"])
        np.testing.assert_array_equal(to_numpy(g["index"]), w["index"])  # JAX's default 32-bit ints hold it
        assert isinstance(g["shape"], list)  # lists stay lists, as the stages made them
        assert all(np.array_equal(a, b) for a, b in zip(g["shape"], w["shape"]))
        for row, i in enumerate(w["index"].tolist()):
            np.testing.assert_array_equal(to_numpy(g["data"])[row], np.load(index.extent(i).file))


def check_shares_memory(index, output):
    plant = Plant()
    batches = list(gpuio.Loader(index, 4, ops=[plant], output=output))
    assert len(batches) == len(plant.made) == 3
    for batch in batches:
        made = plant.made[int(to_numpy(batch["index"])[0])]
        assert address(batch["planted"]) == made.ctypes.data
        made[:, 0] = -1.0  # written after the hand-off: the framework sees it, no copy was made
        assert to_numpy(batch["planted"])[:, 0].tolist() == [-1.0] * len(made)


def check_read_only_copied(output):
    module = importlib.import_module(output)
    ro = np.frombuffer(np.arange(6, dtype=np.float32).tobytes(), dtype=np.float32)
    assert not ro.flags.writeable
    np.testing.assert_array_equal(to_numpy(convert(ro, output, module)), ro)
    assert convert([ro], output, module)[0] is ro  # lists are left as they are


def total(x, output):
    """The sum of a framework's tensor, computed by that framework (a kernel reads the memory)."""
    module = importlib.import_module(output)
    if output == "torch":
        return float(x.to(module.float64).sum())
    if output == "jax":
        return float(module.numpy.sum(x.astype(module.numpy.float32)))
    return float(module.reduce_sum(module.cast(x, module.float64)))


def check_compute(index, output):
    """The framework computes on every column of every batch, whatever the column's
    alignment (TensorFlow aborts the process on a CPU tensor not aligned to 64 bytes)."""
    columns = 0
    for shuffle in (False, True):
        want = list(gpuio.Loader(index, 3, output="numpy", shuffle=shuffle, seed=1))
        got = list(gpuio.Loader(index, 3, output=output, shuffle=shuffle, seed=1))
        for g, w in zip(got, want):
            for name, value in w.items():
                if isinstance(value, np.ndarray):
                    assert abs(total(g[name], output) - float(value.astype(np.float64).sum())) < 1e-3
                    columns += 1
    assert columns >= 8


CHECKS = {
    "compute": check_compute,
    "values": lambda index, output: check_values(index, output, shuffle=False),
    "values-shuffled": lambda index, output: check_values(index, output, shuffle=True),
    "shares-memory": check_shares_memory,
    "read-only": lambda index, output: check_read_only_copied(output),
}


def run_checks(root, output, conn):
    """Every check for ``output`` in this process; failures go back as tracebacks."""
    index = npy_format(root)
    results = {}
    for name, check in CHECKS.items():
        try:
            check(index, output)
            results[name] = None
        except Exception:  # reported by the test that asked for it
            results[name] = traceback.format_exc()
    conn.send(results)


@pytest.fixture(scope="module")
def tensorflow_results(npy_root):
    """TensorFlow runs in a process of its own: it and the ``tfrecord`` package, which
    other tests use to write TFRecord files, register the same protobuf names
    (``tensorflow.BytesList``) and cannot be imported into one process."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_checks, args=(npy_root, "tensorflow", send))
    proc.start()
    send.close()
    ready = recv.poll(300)
    results = recv.recv() if ready else None
    proc.join(30)
    assert results is not None, "the TensorFlow process gave no results within 300 s"
    return results


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("output", FRAMEWORKS)
def test_framework_output(npy, output, check, request):
    if output == "tensorflow":
        failure = request.getfixturevalue("tensorflow_results")[check]
        assert failure is None, failure
    else:
        importlib.import_module(output)  # in the test extra: a missing one fails, never skips
        CHECKS[check](npy, output)


@pytest.mark.parametrize("shuffle", [False, True])
def test_stacked_rows_are_aligned_for_jax(npy, shuffle):
    """JAX on the CPU copies memory not aligned to 64 bytes; stacked rows never are
    (a view of the read buffer in order, else a pooled page-aligned stack)."""
    for batch in gpuio.Loader(npy, 4, output="numpy", shuffle=shuffle):
        assert batch["data"].ctypes.data % 64 == 0


@pytest.mark.parametrize("output", FRAMEWORKS)
def test_missing_framework_is_reported_when_the_loader_is_made(npy, output, monkeypatch):
    monkeypatch.setitem(sys.modules, output, None)  # what an environment without it shows
    with pytest.raises(DependencyError, match=rf"pip install 'gpuio\[{output}\]'"):
        gpuio.Loader(npy, 4, output=output)


def test_unknown_output_names_the_choices(npy):
    with pytest.raises(ConfigError, match="'torch', 'numpy', 'jax', 'tensorflow'"):
        gpuio.Loader(npy, 4, output="paddle")
    assert load("numpy") is None
