"""Shared contract checkers for loaders: one function per contract.

Each takes a ``make(**overrides) -> Loader`` factory so that any dataset, op chain and
device can be checked the same way:

- ``check_exactly_once``: every rank yields the same number of batches, and across
  ranks each sample is a real row exactly once per epoch (at most once for ``"drop"``);
- ``check_resume``: ``state_dict()`` at every batch position (including the end of an
  epoch and the step into the next) resumes with exactly the remaining batches;
- ``check_elastic_resume``: states saved by every rank of one job shape resume on
  another (world size, batch size, last batch): the rest of the epoch holds every
  sample not yet seen exactly once, with the data each sample has in an uninterrupted
  run, and the next epoch is a fresh loader's;
- ``check_deterministic``: the batches do not depend on the number of threads or the
  prefetch depth.

For formats, ``check_index_or_gpuio_error`` is the contract every parser keeps on
corrupt bytes (the fuzz tests of each format call it).
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import gpuio
from gpuio.storage._fielddecode import decoded_fields
from gpuio.errors import GpuioError

MakeLoader = Callable[..., gpuio.Loader]


def host(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch with every array as NumPy (torch, CuPy and lists of them)."""
    def conv(v: Any) -> Any:
        if isinstance(v, list):
            return [conv(x) for x in v]
        if hasattr(v, "detach"):  # torch
            return v.detach().cpu().numpy()
        if hasattr(v, "__cuda_array_interface__"):
            import cupy

            return cupy.asnumpy(v)
        return np.asarray(v) if isinstance(v, np.ndarray) else v

    return {k: conv(v) for k, v in batch.items()}


def assert_same_batch(a: dict[str, Any], b: dict[str, Any], where: str = "") -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, list):
            assert isinstance(y, list) and len(x) == len(y), f"{where} field {key}"
            for xi, yi in zip(x, y):
                np.testing.assert_array_equal(np.asarray(xi), np.asarray(yi), err_msg=f"{where} field {key}")
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{where} field {key}")


def run_epoch(loader: gpuio.Loader) -> list[dict[str, Any]]:
    return [host(b) for b in loader]


def check_exactly_once(make: MakeLoader, n: int, world_size: int, last_batch: str,
                       epochs: int = 2) -> None:
    """All ranks of a ``world_size`` job over ``n`` samples, for ``epochs`` epochs."""
    loaders = [make(rank=r, world_size=world_size, last_batch=last_batch) for r in range(world_size)]
    lengths = {len(ld) for ld in loaders}
    assert len(lengths) == 1, f"ranks disagree on len(): {lengths}"
    orders = []
    for epoch in range(epochs):
        real = []
        for ld in loaders:
            ld.set_epoch(epoch)
            batches = run_epoch(ld)
            assert len(batches) == len(ld), f"rank {ld.rank} yielded {len(batches)} batches, len() says {len(ld)}"
            for b in batches:
                idx = b["index"]
                assert idx.dtype == np.int64
                rows = len(idx)
                assert rows <= ld.batch_size
                if last_batch == "pad" or last_batch == "drop":
                    assert rows == ld.batch_size, f"{last_batch}: batch of {rows} rows"
                if last_batch == "drop":
                    assert (idx >= 0).all(), "drop yields no padding rows"
                for key, v in b.items():
                    assert len(v) == rows, f"field {key} has {len(v)} rows, index {rows}"
                real.append(idx[idx >= 0])
        seen = np.concatenate(real) if real else np.zeros(0, np.int64)
        assert len(np.unique(seen)) == len(seen), f"epoch {epoch}: a sample appears twice"
        if last_batch == "drop":
            step = world_size * loaders[0].batch_size
            assert len(seen) == n // step * step
        else:
            np.testing.assert_array_equal(np.sort(seen), np.arange(n))
        orders.append(seen)
    if epochs > 1 and loaders[0].shuffle and n > 3:
        assert not np.array_equal(orders[0], orders[1]), "shuffle gave the same order in two epochs"


def check_resume(make: MakeLoader, epochs: int = 2) -> None:
    """Stop after every batch (and after each completed epoch), save, restore into a
    new loader, and compare the rest of the run with an uninterrupted one."""
    ref = make()
    batches: list[dict[str, Any]] = []
    states: list[tuple[int, dict[str, Any]]] = [(0, ref.state_dict())]
    for _ in range(epochs):
        for b in ref:
            batches.append(host(b))
            states.append((len(batches), ref.state_dict()))
        states.append((len(batches), ref.state_dict()))  # after the pass: next epoch, batch 0
    assert ref.epoch == epochs
    for done, state in states:
        resumed = make()
        resumed.load_state_dict(state)
        rest: list[dict[str, Any]] = []
        while resumed.epoch < epochs:
            rest.extend(host(b) for b in resumed)
        assert len(rest) == len(batches) - done, f"resume after {done} batches ({state}): {len(rest)} batches"
        for j, (x, y) in enumerate(zip(rest, batches[done:])):
            assert_same_batch(x, y, f"resume after {done} batches, batch {done + j}")
    # a state from a partly consumed pass, taken mid-iteration
    ref = make()
    it = iter(ref)
    first = [host(next(it)) for _ in range(min(2, len(ref)))]
    state = ref.state_dict()
    del it
    resumed = make()
    resumed.load_state_dict(state)
    rest = run_epoch(resumed)
    whole = run_epoch(make())
    assert len(first) + len(rest) == len(whole)
    for j, (x, y) in enumerate(zip(first + rest, whole)):
        assert_same_batch(x, y, f"mid-iteration state, batch {j}")


def check_elastic_resume(make: MakeLoader, n: int, saved: dict[str, Any], resumed: dict[str, Any],
                         steps: int, epochs: int = 2) -> None:
    """Every rank of a job made with ``saved`` (``world_size``, ``batch_size``,
    ``last_batch``) hands out ``steps`` batches and saves its state; the states agree
    (but for ``rank`` and ``skipped``), and a job made with ``resumed`` that loads them
    (even ranks the list of all states, odd ranks one state) yields, with equal batch
    counts per rank, every sample the first job had not yet consumed exactly once (at
    most once for ``"drop"``), each row equal to that sample's row in an uninterrupted
    one-rank run; its next epochs equal a fresh job's."""
    w, w2 = saved["world_size"], resumed["world_size"]
    epoch = 1  # not epoch 0: the epoch must come from the state
    old = [make(rank=r, **saved) for r in range(w)]
    seen, states = [], []
    for ld in old:
        ld.set_epoch(epoch)
        it = iter(ld)
        seen += [host(next(it))["index"] for _ in range(steps)]
        states.append(ld.state_dict())
        del it
        ld.close()
    for s in states[1:]:
        assert {k: v for k, v in s.items() if k not in ("rank", "skipped")} == \
            {k: v for k, v in states[0].items() if k not in ("rank", "skipped")}, (states[0], s)
    consumed = states[0]["consumed"]
    seen_real = np.concatenate(seen + [np.zeros(0, np.int64)])
    seen_real = seen_real[seen_real >= 0]
    if steps < len(old[0]):
        assert consumed == len(seen_real) == steps * w * saved["batch_size"], (consumed, len(seen_real))
    else:
        assert consumed == n
    reference = make(rank=0, world_size=1, batch_size=max(n, 1), last_batch="partial")
    reference.set_epoch(epoch)
    by_sample = {}
    for b in run_epoch(reference):
        for row, i in enumerate(b["index"].tolist()):
            if i >= 0:
                by_sample[i] = {k: (v[row] if k != "index" else i) for k, v in b.items()}
    new = [make(rank=r, **resumed) for r in range(w2)]
    rest = []
    for r, ld in enumerate(new):
        ld.load_state_dict(states if r % 2 == 0 else states[r % w])
        assert ld.epoch == epoch
        length = len(ld)
        batches = run_epoch(ld)
        assert len(batches) == length, f"rank {r} yielded {len(batches)} batches, len() said {length}"
        assert ld.epoch == epoch + 1
        for b in batches:
            idx = b["index"]
            for row, i in enumerate(idx.tolist()):
                if i >= 0:
                    want = by_sample[i]
                    for key, v in b.items():
                        np.testing.assert_array_equal(np.asarray(v[row] if key != "index" else i),
                                                      np.asarray(want[key]), err_msg=f"sample {i} field {key}")
            rest.append(idx[idx >= 0])
    assert len({len(ld) for ld in new}) == 1
    rest_real = np.concatenate(rest + [np.zeros(0, np.int64)])
    both = np.concatenate([seen_real, rest_real])
    assert len(np.unique(both)) == len(both), "a sample was seen twice across the resume"
    left = n - consumed
    step2 = w2 * resumed["batch_size"]
    want = left // step2 * step2 if resumed["last_batch"] == "drop" else left
    assert len(rest_real) == want, f"{len(rest_real)} samples after the resume, want {want}"
    if want == left:
        assert len(both) == n or steps == len(old[0])
    for e in range(epoch + 1, epoch + epochs):
        fresh = [make(rank=r, **resumed) for r in range(w2)]
        for ld, f in zip(new, fresh):
            f.set_epoch(e)
            got, ref = run_epoch(ld), run_epoch(f)
            assert len(got) == len(ref)
            for j, (x, y) in enumerate(zip(got, ref)):
                assert_same_batch(x, y, f"epoch {e} after the resume, rank {ld.rank} batch {j}")


def check_deterministic(make: MakeLoader, settings: list[dict[str, Any]], epochs: int = 2) -> None:
    """The same batches, in the same order, under each of ``settings`` (threads, prefetch)."""
    runs = []
    for kw in settings:
        ld = make(**kw)
        runs.append([b for _ in range(epochs) for b in run_epoch(ld)])
    for kw, run in zip(settings[1:], runs[1:]):
        assert len(run) == len(runs[0]), kw
        for j, (x, y) in enumerate(zip(run, runs[0])):
            assert_same_batch(x, y, f"{kw} batch {j}")


def assert_gpu_read_matches_cpu(index, field="data"):
    """The storage core's GPU path (kvikio, or pinned host + copy) returns the same
    bytes as the CPU path for every sample of ``index``, read in reverse order."""
    import cupy

    import gpuio

    rows = np.arange(len(index))[::-1]
    cpu = gpuio.read(index, rows, field, device="cpu")
    gpu = gpuio.read(index, rows, field, device="cuda")
    assert len(cpu) == len(gpu) == len(index)
    for c, g in zip(cpu, gpu):
        assert isinstance(g, cupy.ndarray)
        np.testing.assert_array_equal(cupy.asnumpy(g), c)


def assert_read_matches_files(index, field, device):
    """``gpuio.read`` on ``device`` returns, for every sample, exactly the bytes its
    extent names, as plain ``open/seek/read`` finds them."""
    import gpuio

    rows = np.arange(len(index))[::-1]
    got = gpuio.read(index, rows, field, device=device)
    for row, arr in zip(rows.tolist(), got):
        ext = index.extent(row, field)
        with open(ext.file, "rb") as f:
            f.seek(ext.offset)
            want = f.read(ext.length)
        host = arr.get() if hasattr(arr, "__cuda_array_interface__") else arr
        assert host.tobytes() == want, f"sample {row} of {ext.file}"


def check_index_or_gpuio_error(make_index: Callable[[], Any], fields: Sequence[str]) -> None:
    """Corrupt input gives a gpuio error, never another exception: ``make_index()``
    raises one, or every extent of the index lies inside its file and reading ``fields``
    of every sample raises one or returns (raw extent fields at their full length)."""
    try:
        index = make_index()
    except GpuioError:
        return
    for name, ext in index.extents.items():
        size = {f: os.path.getsize(index.files[f]) for f in np.unique(ext.file).tolist()}
        end = np.array([size[f] for f in ext.file.tolist()], dtype=np.int64)
        assert np.all(ext.offset >= 0) and np.all(ext.offset + ext.length <= end), f"{name} extents leave the file"
    try:
        got = gpuio.storage.read_fields(index, np.arange(len(index)), tuple(fields))
    except GpuioError:
        return
    for name in fields:
        if name in index.extents and name not in decoded_fields(index):
            assert [len(g) for g in got[name]] == index.extents[name].length.tolist(), name


def check_directory_and_fifo_name_the_path(open_index: Callable[[Any, Any], Any], data: Any, index_file: Any,
                                           folder: Any, suffix: str, what: str) -> None:
    """A directory or a FIFO given as a data file (``open_index(path, index_file_or_None)``,
    ``what`` its name in the message) or as its index file is a ``DataError`` naming it,
    and opening the FIFO does not wait for a writer. ``data`` and ``index_file``: a good pair."""
    import pytest

    from gpuio.errors import DataError

    directory, fifo = os.path.join(folder, "dir" + suffix), os.path.join(folder, "fifo" + suffix)
    os.mkdir(directory)
    os.mkfifo(fifo)
    for idx in (None, index_file):
        with pytest.raises(DataError, match=f"{what} must be a regular file, this is a directory") as err:
            open_index(directory, idx)
        assert err.value.path == directory
        with pytest.raises(DataError, match="this is a device, FIFO or socket") as err:
            open_index(fifo, idx)
        assert err.value.path == fifo
    for bad in (directory, fifo):  # as index files
        with pytest.raises(DataError, match="a text index file must be a regular file") as err:
            open_index(data, bad)
        assert err.value.path == bad


_POOLED_CHILD = """
import json, sys, warnings
import gpuio
from gpuio import formats
from gpuio.formats import _files
_files.POOL_AFTER_S = 0.0  # every shard after the first goes to the process pool
pools = []
class Counted(_files.ProcessPoolExecutor):
    def __init__(self, *args, **kwargs):
        pools.append(1)
        super().__init__(*args, **kwargs)
_files.ProcessPoolExecutor = Counted
warnings.simplefilter("ignore")
try:
    eval(sys.argv[1]).save(sys.argv[2])
    print(json.dumps({"pool": bool(pools)}))
except gpuio.errors.DataError as exc:
    print(json.dumps({"pool": bool(pools), "error": str(exc), "path": exc.path}))
"""


def index_on_a_process_pool(tmp_path: Any, call: str) -> tuple[Any, dict[str, Any]]:
    """``(index, report)``: the index that ``call`` (an expression over ``formats``) makes
    in a new interpreter, where no other thread keeps the shard pool from forking and every
    shard after the first is indexed in a pool process; ``report["pool"]`` says a pool
    ran, ``report["error"]``/``["path"]`` give the gpuio error it raised instead (index
    ``None``)."""
    import json
    import subprocess
    import sys

    out = os.path.join(tmp_path, "pooled.idx")
    done = subprocess.run([sys.executable, "-c", _POOLED_CHILD, call, out], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return (None if "error" in report else gpuio.SampleIndex.load(out)), report


class RejectSamples(gpuio.batch.Op):
    """Rejects the rows whose dataset index is in ``bad``, as a decoder rejects bad bytes."""

    name = "reject"

    def __init__(self, bad):
        self.bad = set(bad)

    def __call__(self, batch):
        for row, i in enumerate(batch.index.tolist()):
            if i in self.bad:
                batch.reject(row, gpuio.errors.DataError("cannot decode", sample=i))
        return batch


def write_tar(path: Any, members: Sequence[tuple[str, bytes | None]], fmt: int = tarfile.GNU_FORMAT) -> Any:
    """A tar at ``path`` of ``members``: (name, bytes) in order; a None payload makes a
    directory. Returns ``path``."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tf.addfile(info)
            else:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path
