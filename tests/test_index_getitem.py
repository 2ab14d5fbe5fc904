"""``index[i]`` reads one local sample by itself (``gpuio.storage.read_sample``): the
values, their types and the errors are those of the batched read of that one row."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
import tfrecord as tfrecord_pkg

import gpuio
from gpuio.errors import StorageError
from gpuio.formats import filetree, lmdb, numpy as npy_format, tfrecord, webdataset
from gpuio.storage._fielddecode import decoded_fields


def _batched_sample(index, i):
    """Sample ``i`` as the batched reader gives it, turned into host values as ``index[i]``
    documents them (bytes for raw extent fields, Python scalars for NumPy scalars)."""
    row = gpuio.storage.read_fields(index, np.array([i]), index.fields, device="cpu")
    decoded = decoded_fields(index)
    out = {}
    for name, col in row.items():
        value = col[0]
        if name not in decoded and isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 1:
            value = value.tobytes()
        elif isinstance(value, np.generic):
            value = value.item()
        out[name] = value
    return out


def _assert_same(a, b, where):
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.flags.f_contiguous == b.flags.f_contiguous, where
        assert a.flags.writeable == b.flags.writeable, where
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for j, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{j}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where


def check_getitem_matches_batch(index):
    for i in [*range(len(index)), -1]:
        got, want = index[i], _batched_sample(index, i % len(index))
        assert list(got) == list(want) == list(index.fields)
        _assert_same(got, want, f"sample {i}")


def test_filetree(tmp_path):
    rng = np.random.default_rng(0)
    for k, size in enumerate([0, 1, 4095, 4096, 70_000, 13]):
        folder = tmp_path / f"class{k % 2}"
        folder.mkdir(exist_ok=True)
        (folder / f"{k}.jpg").write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    index = filetree(tmp_path)
    check_getitem_matches_batch(index)
    assert index[1]["data"] == (tmp_path / "class0" / "2.jpg").read_bytes()  # class0: 0, 2, 4


def test_webdataset_with_decoded_fields(tmp_path):
    path = tmp_path / "shard.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for k in range(7):
            for ext, data in (("jpg", os.urandom(k * 700)), ("cls", str(k * 3).encode()),
                              ("json", json.dumps({"k": k, "box": [k, 1.5]}).encode()), ("txt", f"t{k}".encode())):
                info = tarfile.TarInfo(f"{'long/' * 30 if k == 3 else ''}s{k:03d}.{ext}")  # a GNU long name
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    check_getitem_matches_batch(webdataset(path, fields=("jpg", "cls", "json", "txt")))
    check_getitem_matches_batch(webdataset(path, fields=("jpg", "cls"), decode=False))


def test_numpy_arrays_are_writable_views_with_their_order(tmp_path):
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.asfortranarray(np.arange(6.0).reshape(2, 3)),
              np.array([1, 2, 3], dtype=">i2"), np.zeros((0, 5), dtype=np.uint8),
              np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", "<f8")])]
    for k, a in enumerate(arrays):
        np.save(tmp_path / f"{k}.npy", a)
    index = npy_format(tmp_path)
    check_getitem_matches_batch(index)
    for k, a in enumerate(arrays):
        got = index[k]["data"]
        np.testing.assert_array_equal(got, a)
        assert got.dtype == a.dtype and got.flags.writeable


def test_tfrecord_parsed_features(tmp_path):
    path = os.fspath(tmp_path / "data.tfrecord")
    writer = tfrecord_pkg.TFRecordWriter(path)
    for k in range(6):
        writer.write({"image": (os.urandom(k * 100), "byte"), "label": (k - 2, "int"),
                      "box": ([0.5] * (k % 3), "float")})
    writer.close()
    check_getitem_matches_batch(tfrecord(path, features={"image": "bytes", "label": "int64", "box": "float"}))
    check_getitem_matches_batch(tfrecord(path))


def test_lmdb(tmp_path):
    lmdb_pkg = pytest.importorskip("lmdb")
    env = lmdb_pkg.open(os.fspath(tmp_path / "db"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for k in range(20):
            txn.put(b"%04d" % k, os.urandom(k * 300))
    env.close()
    check_getitem_matches_batch(lmdb(tmp_path / "db"))


def test_errors_name_the_file_as_the_batched_read_does(tmp_path):
    (tmp_path / "a").mkdir()
    for k in range(3):
        (tmp_path / "a" / f"{k}.jpg").write_bytes(b"x" * 1000)
    (tmp_path / "list.txt").write_text("a/0.jpg 0\na/1.jpg 0\na/2.jpg 0\n")
    walked, listed = filetree(tmp_path), filetree(tmp_path, file_list=tmp_path / "list.txt")  # sizes: unknown, known

    def messages(index, i):
        with pytest.raises(StorageError) as one:
            index[i]
        with pytest.raises(StorageError) as batch:
            gpuio.read(index, [i])
        return str(one.value), str(batch.value)

    (tmp_path / "a" / "1.jpg").write_bytes(b"y" * 10)  # truncated after indexing
    one, batch = messages(listed, 1)
    assert one == batch and "1.jpg" in one and "needed 1000 bytes from byte 0, read 10" in one
    assert walked[1]["data"] == b"y" * 10 == gpuio.read(walked, [1])[0].tobytes()  # a whole file, as it is now
    os.remove(tmp_path / "a" / "2.jpg")
    for index in (walked, listed):
        one, batch = messages(index, 2)
        assert one == batch and "2.jpg" in one and "file not found" in one
