"""formats.arrow on the `datasets` Arrow cache (save_to_disk: IPC stream files) and on
pyarrow's IPC file format: every read equals datasets' own, local and from SeaweedFS."""

from __future__ import annotations

import os

import datasets
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuio
from checkers import check_exactly_once, check_index_or_gpuio_error, run_epoch
from gpuio.errors import ConfigError, FormatError
from gpuio.formats import arrow
from test_format_parquet import NAMES, _hf_dataset, _png, s3, s3server  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arrow")
    ds = _hf_dataset(30, seed=2)
    ds.save_to_disk(os.fspath(folder / "ds"), num_shards=2)
    return folder, ds


def _check_equal(index, ds):
    rows = np.arange(len(ds))[::-1]
    got = gpuio.storage.read_fields(index, rows, ("image.bytes", "label", "caption"))
    want = ds.cast_column("image", datasets.Image(decode=False))
    for j, r in enumerate(rows.tolist()):
        assert got["image.bytes"][j].tobytes() == want[r]["image"]["bytes"], r
        assert got["label"][j] == ds[r]["label"] and got["caption"][j] == ds[r]["caption"]


def test_save_to_disk_reads_equal_datasets(saved):
    folder, ds = saved
    index = arrow(os.fspath(folder / "ds" / "data-*.arrow"))
    assert len(index.files) == 2 and len(index) == len(ds)
    assert index.meta["images"] == ["image.bytes"] and index.meta["class_names"] == {"label": NAMES}
    # indexing reads metadata, offsets and the value columns, never the images' bytes
    assert index.meta["index_bytes_read"] + index.nbytes("image.bytes") <= index.meta["data_bytes"]
    _check_equal(index, ds)
    index.save(folder / "i.npz")
    _check_equal(gpuio.SampleIndex.load(folder / "i.npz"), ds)
    loader = gpuio.Loader(index, 7, ops=[gpuio.ops.decode_image()], output="numpy", threads=2)
    seen = 0
    for batch in loader:
        for j, r in enumerate(batch["index"].tolist()):
            np.testing.assert_array_equal(np.asarray(batch["image"][j]), np.asarray(ds[r]["image"]))
            seen += 1
    assert seen == len(ds)
    check_exactly_once(lambda **kw: gpuio.Loader(index, 4, shuffle=True, seed=1, output="numpy", threads=1,
                                                 fields=["image.bytes", "label"], **kw), len(ds), 2, "partial")


def test_ipc_file_format_nulls_and_paths(tmp_path):
    rng = np.random.default_rng(3)
    pngs = [_png(rng, k) for k in range(5)]
    (tmp_path / "side.png").write_bytes(pngs[4])
    image = pa.array([{"bytes": pngs[0], "path": None}, {"bytes": pngs[1], "path": "x"}, None,
                      {"bytes": pngs[3], "path": None}, {"bytes": None, "path": "side.png"}],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    table = pa.table({"image": image, "label": pa.array([0, 1, 2, 3, 4])})
    with pa.OSFile(os.fspath(tmp_path / "f.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=2):
            w.write_batch(batch)
    index = arrow(tmp_path / "f.arrow", fields={"img": "image.bytes", "y": "label"})
    got = [index[k] for k in range(5)]
    assert [g["img"] for g in got] == [pngs[0], pngs[1], b"", pngs[3], pngs[4]]
    assert [g["y"] for g in got] == [0, 1, 2, 3, 4]
    # compressed IPC buffers cannot be read in place: refused, naming the file
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.OSFile(os.fspath(tmp_path / "z.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema,
                                                                                   options=options) as w:
        w.write_table(table)
    with pytest.raises(ConfigError, match=r"z\.arrow.*compressed IPC body"):
        arrow(tmp_path / "z.arrow")


def test_errors_name_the_file_and_byte(saved, tmp_path):
    folder, _ = saved
    data = (folder / "ds" / "data-00000-of-00002.arrow").read_bytes()
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"\x00" * 16 + data[16:])
    with pytest.raises(FormatError, match=r"bad\.arrow.*at byte 0"):
        arrow(bad)
    bad.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(FormatError, match=r"bad\.arrow.*record batch 0"):
        arrow(bad)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_corrupt_bytes_give_gpuio_errors(saved, tmp_path_factory, data):
    folder, _ = saved
    raw = bytearray((folder / "ds" / "data-00000-of-00002.arrow").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "f.arrow"
    path.write_bytes(bytes(raw))
    check_index_or_gpuio_error(lambda: arrow(path, fields=["image.bytes", "label"]), ["image.bytes", "label"])


def test_s3_reads_equal_local(saved, s3):
    folder, ds = saved
    s3.create_bucket(Bucket="hfarrow")
    for k in range(2):
        name = f"data-{k:05d}-of-00002.arrow"
        s3.upload_file(os.fspath(folder / "ds" / name), "hfarrow", f"ds/{name}")
    index = arrow("s3://hfarrow/ds/data-{00000..00001}-of-00002.arrow")
    _check_equal(index, ds)
    assert sum(len(b["index"]) for b in run_epoch(gpuio.Loader(index, 8, output="numpy"))) == len(ds)
