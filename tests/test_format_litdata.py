"""formats.litdata: datasets written by litdata.optimize, read sample for sample as
litdata's StreamingDataset reads them (its JPEG leaves kept as bytes: its own decoder
needs torchvision)."""

from __future__ import annotations

import importlib
import io
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

import gpuio
from gpuio import formats, ops
from gpuio.errors import ConfigError, FormatError
litdata_format = importlib.import_module("gpuio.formats.litdata")  # the module, not the function

from checkers import check_exactly_once, check_index_or_gpuio_error, check_resume
from remote_env import upload_tree
from writers_env import add_writers

add_writers()  # litdata, installed without torchvision where the environment lacks it
import litdata  # noqa: E402
from litdata.streaming.serializers import BytesSerializer  # noqa: E402
from litdata.streaming.writer import BinaryWriter  # noqa: E402


def make_sample(i):
    """Sample ``i``: every leaf kind gpuio decodes (module level: optimize's worker calls it)."""
    rng = np.random.default_rng(i)
    h, w = int(rng.integers(12, 40)), int(rng.integers(12, 40))
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([x * 6 % 256, y * 6 % 256, (x + y) * 3 % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    buf.seek(0)
    return {"image": Image.open(buf), "label": i % 7, "caption": f"item {i} ü", "score": float(rng.random()),
            "flag": bool(i % 2), "ids": torch.arange(i % 4 + 1, dtype=torch.int64),
            "grid": rng.integers(-500, 500, (2, 3)).astype(np.int16), "vec": rng.random(i % 3 + 1).astype(np.float32),
            "thumb": Image.fromarray(pixels[:5, :4]), "raw": rng.bytes(int(rng.integers(0, 200))),
            "weights": torch.ones((2, 2), dtype=torch.float32) * i}


def make_pickled(i):
    return {"x": {i, i + 1}, "label": i}


def write(folder, n=13, fn=make_sample, optimize=False, **kw):
    """Samples ``fn(0..n-1)`` in chunks of 5 items: by ``litdata.optimize`` (a worker
    process, some seconds), or by the chunk writer its workers run (``BinaryWriter``),
    here in this process."""
    if optimize:
        litdata.optimize(fn=fn, inputs=list(range(n)), output_dir=str(folder), chunk_size=5, num_workers=1,
                         mode="overwrite", **kw)
        return
    os.makedirs(folder)
    writer = BinaryWriter(str(folder), chunk_size=5, **kw)
    for i in range(n):
        writer[i] = fn(i)
    writer.done()
    writer.merge(1)


def reference(folder):
    ds = litdata.StreamingDataset(str(folder), serializers={"jpeg": BytesSerializer()})
    return [ds[i] for i in range(len(ds))]


def assert_same(got, want):
    for name, w in want.items():
        g = got[name]
        if isinstance(w, (bytes, memoryview)):
            assert bytes(g) == bytes(w)
        elif isinstance(w, Image.Image):
            np.testing.assert_array_equal(g, np.asarray(w))
        elif isinstance(w, (np.ndarray, torch.Tensor)):
            w = w.numpy() if isinstance(w, torch.Tensor) else w
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
        else:
            assert g == w and type(np.asarray(g).item()) is type(w)


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUIO_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("compression", [None, "zstd", "zstd:chunk", "zstd:sample"])
def test_items_equal_litdata_streaming_dataset(tmp_path, compression, monkeypatch):
    codec, _, level = (compression or "").partition(":")
    write(tmp_path / "ds", optimize=compression is None, compression=codec or None,
          **({"compression_level": level} if level else {}))
    index = formats.litdata(tmp_path / "ds")
    want = reference(tmp_path / "ds")
    assert len(index) == len(want) == 13 and index.meta["chunks"] == 3
    assert set(index.meta["leaves"]) == set(want[0])
    assert index.meta["data_bytes"] == sum(os.path.getsize(p) for p in (tmp_path / "ds").glob("chunk-*"))
    for i in range(len(index)):
        assert_same(index[i], want[i])
    rows = np.arange(len(index))[::-1]
    batch = gpuio.storage.read_fields(index, rows, list(index.meta["leaves"]))
    for j, i in enumerate(rows.tolist()):
        assert_same({k: v[j] for k, v in batch.items()}, want[i])
    folder = tmp_path / "ds"
    chunks = json.load(open(folder / "index.json"))["chunks"]
    if compression == "zstd:chunk":  # a whole-file zstd chunk decodes only whole: decompressed once, at indexing
        assert all(p.startswith(str(tmp_path / "cache" / "litdata")) for p in index.files)
        assert len(index.meta["decompressed_from"]) == 3
        return
    # read in place: index.json and each chunk's offsets table (and frame table)
    head = 24 + 24 if compression == "zstd" else 4  # framed: its prefix and one frame's entry; else the count
    assert index.meta["index_bytes_read"] == os.path.getsize(folder / "index.json") + sum(
        head + 4 * (c["chunk_size"] + 1) for c in chunks)
    assert all(p.startswith(str(folder)) for p in index.files)
    if compression == "zstd":  # each frame decompressed once per batch, however many of its items the batch holds
        monkeypatch.setattr(litdata_format, "COPY_FRAMES_OVER", 0)  # large frames: decompressed once, at indexing
        copied = formats.litdata(folder)
        assert all(p.startswith(str(tmp_path / "cache" / "litdata")) for p in copied.files)
        assert [copied[i]["caption"] for i in range(13)] == [w["caption"] for w in want]
        calls = []
        real = litdata_format.decompress
        monkeypatch.setattr(litdata_format, "decompress", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
        gpuio.storage.read_fields(index, rows, ["label"])
        assert len(calls) == 3


def test_loader_decodes_the_image_leaf_and_saved_index_reloads(tmp_path):
    write(tmp_path / "ds")
    formats.litdata(tmp_path / "ds").save(tmp_path / "i.npz")
    index = gpuio.SampleIndex.load(tmp_path / "i.npz")
    want = reference(tmp_path / "ds")
    seen = {}
    assert index.meta["images"] == ["image"]
    for batch in gpuio.Loader(index, 4, ops=[ops.decode_image()], shuffle=True, seed=1, output="numpy"):
        for j, i in enumerate(batch["index"].tolist()):
            seen[i] = (batch["image"][j], batch["label"][j])
    assert sorted(seen) == list(range(13))
    for i, (image, label) in seen.items():
        np.testing.assert_array_equal(image, np.asarray(Image.open(io.BytesIO(bytes(want[i]["image"])))))
        assert label == want[i]["label"]


def test_pickled_leaves_are_refused_unless_allowed(tmp_path):
    write(tmp_path / "ds", n=4, fn=make_pickled)
    with pytest.raises(ConfigError, match="leaf 'x' is pickled.*allow_pickle=True"):
        formats.litdata(tmp_path / "ds")
    index = formats.litdata(tmp_path / "ds", allow_pickle=True)
    assert [index[i]["x"] for i in range(4)] == [w["x"] for w in reference(tmp_path / "ds")]


def test_bad_chunks_name_the_file_chunk_and_offset(tmp_path):
    ds = tmp_path / "ds"
    write(ds, n=10)
    obj = json.load(open(ds / "index.json"))
    path = str(ds / obj["chunks"][1]["filename"])
    good = open(path, "rb").read()
    n = int(np.frombuffer(good[:4], "<u4")[0])

    with open(path, "wb") as f:  # truncated inside the offsets table
        f.write(good[:12])
    with pytest.raises(FormatError, match="truncated chunk") as err:
        formats.litdata(ds)
    assert err.value.path == path and err.value.sample == "chunk 1"

    table = np.frombuffer(good[4: 8 + 4 * n], "<u4").copy()
    table[2] = table[4]  # an offsets table that lies
    with open(path, "wb") as f:
        f.write(good[:4] + table.tobytes() + good[8 + 4 * n:])
    with pytest.raises(FormatError, match="offsets table") as err:
        formats.litdata(ds)
    assert err.value.path == path and err.value.offset == 4 + 4 * 3

    with open(path, "wb") as f:  # the leaf sizes inside an item lie: found when it is parsed
        first = int(np.frombuffer(good[4:8], "<u4")[0])
        f.write(good[:first] + np.uint32(10**6).tobytes() + good[first + 4:])
    index = formats.litdata(ds)
    row = int(np.flatnonzero(index.extents["__item__"].file == 1)[0])
    with pytest.raises(FormatError, match="leaf sizes") as err:
        index[row]
    assert err.value.path == path and err.value.offset == first

    with open(path, "wb") as f:
        f.write(good)
    os.remove(ds / obj["chunks"][-1]["filename"])  # a chunk index.json lists that is missing
    with pytest.raises(gpuio.errors.StorageError) as err:
        formats.litdata(ds)
    assert err.value.path == str(ds / obj["chunks"][-1]["filename"])


def test_bad_framed_chunk(tmp_path):
    ds = tmp_path / "ds"
    write(ds, n=6, compression="zstd")
    path = str(ds / json.load(open(ds / "index.json"))["chunks"][0]["filename"])
    good = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(b"XXXX" + good[4:])
    with pytest.raises(FormatError, match="not a zstd-framed LitData chunk") as err:
        formats.litdata(ds)
    assert err.value.path == path and err.value.offset == 0
    with open(path, "wb") as f:  # a frame's bytes damaged: found when a batch decompresses it
        f.write(good[:-20] + bytes(20))
    index = formats.litdata(ds)
    with pytest.raises(FormatError, match="zstd") as err:
        index[0]
    assert err.value.path == path and err.value.sample == 0


def test_from_seaweedfs_equals_local(tmp_path, seaweed):
    write(tmp_path / "ds", n=9)
    seaweed.create_bucket(Bucket="litdata")
    upload_tree(seaweed, "litdata", str(tmp_path / "ds"), "train")
    index = formats.litdata("s3://litdata/train")
    local = formats.litdata(tmp_path / "ds")
    assert index.meta["index_bytes_read"] == local.meta["index_bytes_read"]
    want = reference(tmp_path / "ds")
    for i in range(len(index)):
        assert_same(index[i], want[i])
    for batch in gpuio.Loader(index, 4, ops=[ops.decode_image(field="image")], fields=["image"], output="numpy"):
        for j, i in enumerate(batch["index"].tolist()):
            pixels = np.asarray(Image.open(io.BytesIO(bytes(want[i]["image"]))))
            np.testing.assert_array_equal(batch["image"][j], pixels)


def test_frames_across_ranks_exactly_once_and_resume(tmp_path):
    """zstd frames decompressed by the parse step: every item once per epoch across ranks,
    and a saved state resumes with the same batches."""
    write(tmp_path / "ds", n=23, compression="zstd", compression_batch_size=4)
    index = formats.litdata(tmp_path / "ds")
    assert sum(len(f) for f in index.parser.frames.values()) == 4 * 2 + 1  # chunks of 5, 5, 5, 5, 3 items in frames of 4

    def make(**kw):
        return gpuio.Loader(index, 3, fields=["label", "caption"], shuffle=True, seed=4, output="numpy", **kw)

    check_exactly_once(make, len(index), 3, "partial")
    check_resume(make, epochs=1)
    want = reference(tmp_path / "ds")
    for batch in make():
        assert batch["caption"] == [want[i]["caption"] for i in batch["index"].tolist()]


# where bytes are changed: the headers at the start, the tables at the end, anywhere
_PLACES = st.one_of(st.integers(0, 300), st.integers(-70_000, -1), st.integers(0, 1 << 20))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_PLACES, st.integers(0, 255)), min_size=1, max_size=4),
       st.sampled_from([None, "zstd"]))
def test_damaged_chunks_give_gpuio_errors_or_items(tmp_path, flips, compression):
    ds = tmp_path / f"ds-{len(os.listdir(tmp_path))}"
    write(ds, n=8, compression=compression)
    path = ds / json.load(open(ds / "index.json"))["chunks"][0]["filename"]
    data = bytearray(path.read_bytes())
    for at, value in flips:
        data[at % len(data)] = value
    path.write_bytes(bytes(data))
    check_index_or_gpuio_error(lambda: formats.litdata(ds), list(make_sample(0)))
