"""formats.mds: datasets written by mosaicml-streaming's MDSWriter, read sample for sample
as the library's own shard reader reads them (MDSReader, after its own decompression)."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

import gpuio
from gpuio import formats, ops
from gpuio.bench._common import streaming_module  # mosaicml-streaming without its package __init__
from gpuio.errors import ConfigError, FormatError, StorageError

from checkers import check_index_or_gpuio_error
from remote_env import upload_tree
from writers_env import add_writers

add_writers()  # mosaicml-streaming, installed without its dependencies where the environment lacks it

MDSWriter = streaming_module("streaming.base.format.mds.writer").MDSWriter

COLUMNS = {"image": "jpeg", "label": "int", "caption": "str", "raw": "bytes", "meta": "json",
           "feature": "ndarray:float32:2,3", "mask": "ndarray", "score": "float32", "count": "str_int",
           "thumb": "pil", "views": "list[png]"}


def _picture(rng, h, w, mode="RGB"):
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), (x + y) % 256], -1).astype(np.uint8)
    img = np.clip(base.astype(np.int16) + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(img if mode == "RGB" else img[..., 0], mode)


def _samples(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = int(rng.integers(16, 48)), int(rng.integers(16, 48))
        out.append({"image": _picture(rng, h, w), "label": int(rng.integers(0, 10)), "caption": f"sample {i} é",
                    "raw": rng.bytes(int(rng.integers(0, 300))), "meta": {"i": i, "tags": ["a", "b"][: i % 3]},
                    "feature": rng.standard_normal((2, 3)).astype(np.float32),
                    "mask": rng.integers(0, 1000, (int(rng.integers(1, 5)), 3)).astype(np.int16),
                    "score": float(rng.random()), "count": i * 7, "thumb": _picture(rng, 5, 4, "L"),
                    "views": [_picture(rng, 6, 7) for _ in range(i % 3)]})
        out[-1]["photo"] = out[-1]["image"]
    return out


def write_mds(folder, n=23, compression=None, hashes=("sha1", "xxh64"), columns=COLUMNS, size_limit=9000, seed=0):
    samples = _samples(n, seed)
    with MDSWriter(out=str(folder), columns=columns, compression=compression, hashes=list(hashes),
                   size_limit=size_limit) as w:
        for s in samples:
            w.write({k: s[k] for k in columns})
    return samples


def reference(folder):
    """Every sample of an MDS folder as the library reads it: its shard reader over the
    raw shards, compressed ones first decompressed by its own compression module."""
    fmt = streaming_module("streaming.base.format")
    compression = streaming_module("streaming.base.compression")
    obj = json.load(open(os.path.join(folder, "index.json")))
    out = []
    for info in obj["shards"]:
        if info["compression"]:
            raw = os.path.join(folder, info["raw_data"]["basename"])
            if not os.path.exists(raw):
                with open(os.path.join(folder, info["zip_data"]["basename"]), "rb") as f:
                    data = compression.decompress(info["compression"], f.read())
                with open(raw, "wb") as f:
                    f.write(data)
        reader = fmt.reader_from_json(str(folder), None, info)
        out += [{k: _plain(v) for k, v in reader.get_item(i).items()} for i in range(info["samples"])]
        for name in {info["raw_data"]["basename"]} if info["compression"] else ():
            os.remove(os.path.join(folder, name))
    return out


def header_bytes(folder):
    """What indexing an uncompressed MDS folder needs: index.json, and each shard's sample
    count, offsets table and JSON (up to its first sample)."""
    total = os.path.getsize(os.path.join(folder, "index.json"))
    for info in json.load(open(os.path.join(folder, "index.json")))["shards"]:
        with open(os.path.join(folder, info["raw_data"]["basename"]), "rb") as f:
            total += int(np.frombuffer(f.read(8), "<u4")[1])
    return total


def _plain(value):
    """A reference value with its images as ``(encoded bytes, RGB or L pixels)``."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, Image.Image):
        encoded = value.fp.getvalue() if isinstance(getattr(value, "fp", None), io.BytesIO) else None
        return encoded, np.asarray(value)
    return value


def assert_same(got, want, columns=COLUMNS):
    for name, enc in columns.items():
        g, w = got[name], want[name]
        if enc in ("jpeg", "png"):
            assert bytes(g) == w[0]
            np.testing.assert_array_equal(_decoded(g), w[1])
        elif enc == "pil":
            np.testing.assert_array_equal(np.squeeze(g), w[1])
        elif enc.startswith("list["):
            assert [bytes(v) for v in g] == [v[0] for v in w]
        elif enc.startswith("ndarray"):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
        elif enc == "bytes":
            assert bytes(g) == w
        elif isinstance(w, np.generic):  # index[i] gives Python scalars, a batch NumPy ones
            assert np.asarray(g).astype(w.dtype) == w
        else:
            assert g == w and type(np.asarray(g).item()) is type(w)


def _decoded(data):
    return np.asarray(Image.open(io.BytesIO(bytes(data))).convert("RGB"))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUIO_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("compression", [None, "zstd", "gz:5"])
def test_samples_equal_the_library_reader(tmp_path, compression):
    write_mds(tmp_path / "ds", compression=compression)
    index = formats.mds(tmp_path / "ds")
    want = reference(tmp_path / "ds")
    assert len(index) == len(want) == 23
    assert index.meta["shards"] > 2 and index.meta["columns"] == dict(sorted(COLUMNS.items()))
    assert index.meta["data_bytes"] == sum(os.path.getsize(tmp_path / "ds" / f) for f in os.listdir(tmp_path / "ds")
                                           if f.startswith("shard."))
    for i in range(len(index)):
        assert_same(index[i], want[i])
    batch = gpuio.storage.read_fields(index, np.arange(len(index))[::-1], list(COLUMNS))
    for j, i in enumerate(range(len(index) - 1, -1, -1)):
        assert_same({k: v[j] for k, v in batch.items()}, want[i])
    if compression is None:  # exact: the extents are the samples' bytes in the shards, read in place
        assert index.meta["index_bytes_read"] == header_bytes(tmp_path / "ds")
        assert all(p.startswith(str(tmp_path / "ds")) for p in index.files)
    else:  # each shard decompressed once into the cache folder, hashes checked
        assert all(p.startswith(str(tmp_path / "cache" / "mds")) for p in index.files)
        assert len(index.meta["decompressed_from"]) == index.meta["shards"]
        again = formats.mds(tmp_path / "ds")
        assert list(again.files) == list(index.files) and again.meta["index_bytes_read"] < index.meta[
            "index_bytes_read"]


def test_loader_decodes_the_image_column_and_saved_index_reloads(tmp_path):
    samples = write_mds(tmp_path / "ds", columns={"photo": "jpeg", "label": "int"})  # a name no rule knows
    index = formats.mds(tmp_path / "ds")
    index.save(tmp_path / "i.npz")
    index = gpuio.SampleIndex.load(tmp_path / "i.npz")
    want = reference(tmp_path / "ds")
    seen = {}
    assert index.meta["images"] == ["photo"]  # so decode_image() finds it
    loader = gpuio.Loader(index, 5, ops=[ops.decode_image()], shuffle=True, seed=3, output="numpy")
    for batch in loader:
        for j, i in enumerate(batch["index"].tolist()):
            seen[i] = (batch["image"][j], batch["label"][j])
    assert sorted(seen) == list(range(len(samples)))
    for i, (image, label) in seen.items():
        np.testing.assert_array_equal(image, want[i]["photo"][1])
        assert label == want[i]["label"]


def test_pickled_columns_are_refused_unless_allowed(tmp_path):
    columns = {"x": "pkl", "label": "int"}
    rng = np.random.default_rng(1)
    with MDSWriter(out=str(tmp_path / "ds"), columns=columns) as w:
        for i in range(4):
            w.write({"x": {"i": i, "v": rng.random(2).tolist()}, "label": i})
    with pytest.raises(ConfigError, match="'x' is pickled.*allow_pickle=True"):
        formats.mds(tmp_path / "ds")
    index = formats.mds(tmp_path / "ds", allow_pickle=True)
    want = reference(tmp_path / "ds")
    assert [index[i]["x"] for i in range(4)] == [w["x"] for w in want]


def test_several_roots_by_brace_pattern_concatenate(tmp_path):
    write_mds(tmp_path / "a", n=5, columns={"image": "jpeg", "label": "int"}, seed=1)
    write_mds(tmp_path / "b", n=7, columns={"image": "jpeg", "label": "int"}, seed=2)
    index = formats.mds(str(tmp_path / "{a,b}"))
    want = reference(tmp_path / "a") + reference(tmp_path / "b")
    assert [index[i]["label"] for i in range(12)] == [w["label"] for w in want]


def _shard(folder, k=0):
    shards = json.load(open(os.path.join(folder, "index.json")))["shards"]
    return os.path.join(folder, shards[k]["raw_data"]["basename"])


def test_bad_shards_name_the_file_shard_and_offset(tmp_path):
    cols = {"image": "jpeg", "label": "int"}
    ds = tmp_path / "ds"
    write_mds(ds, columns=cols)
    path = _shard(ds, 1)
    good = open(path, "rb").read()

    with open(path, "wb") as f:  # truncated
        f.write(good[:-10])
    with pytest.raises(FormatError, match="shard 1") as err:
        formats.mds(ds)
    assert err.value.path == path and err.value.offset is not None

    n = int(np.frombuffer(good[:4], "<u4")[0])
    table = np.frombuffer(good[4: 8 + 4 * n], "<u4").copy()
    table[2], table[3] = table[3], table[2]  # an offsets table that lies
    with open(path, "wb") as f:
        f.write(good[:4] + table.tobytes() + good[8 + 4 * n:])
    with pytest.raises(FormatError, match="offsets table") as err:
        formats.mds(ds)
    assert err.value.path == path and err.value.offset == 4 + 4 * 3

    with open(path, "wb") as f:  # another sample count
        f.write(np.uint32(n + 1).tobytes() + good[4:])
    with pytest.raises(FormatError, match="holds 24 samples|samples, index.json") as err:
        formats.mds(ds)
    assert err.value.path == path and err.value.offset == 0

    with open(path, "wb") as f:  # the sizes inside a sample lie: found when it is parsed
        first = int(table[0])
        f.write(good[:first] + np.uint32(10**6).tobytes() + good[first + 4:])
    index = formats.mds(ds)
    row = int(np.flatnonzero(index.extents["__sample__"].file == 1)[0])
    with pytest.raises(FormatError, match="column 'image' needs 1000000 bytes") as err:
        index[row]
    assert err.value.path == path and err.value.offset == first + 4

    with open(path, "wb") as f:
        f.write(good)
    os.rename(path, path + ".moved")  # a listed shard that is missing
    with pytest.raises(StorageError) as err:
        formats.mds(ds)
    assert err.value.path == path
    os.rename(path + ".moved", path)

    obj = json.load(open(ds / "index.json"))
    extra = dict(obj, shards=obj["shards"][:1] + obj["shards"][2:])
    with open(ds / "index.json", "w") as f:  # a shard in the folder that index.json does not list
        json.dump(extra, f)
    with pytest.raises(FormatError, match="not listed in index.json") as err:
        formats.mds(ds)
    assert err.value.path == path and err.value.offset == 0
    with open(ds / "index.json", "w") as f:
        json.dump(obj, f)

    with open(path, "wb") as f:  # same size, other bytes: the listed hashes catch it
        f.write(good[:-1] + bytes([good[-1] ^ 1]))
    formats.mds(ds)  # indexing reads headers only
    with pytest.raises(FormatError, match="shard 1: sha1 mismatch") as err:
        formats.mds(ds, verify=True)
    assert err.value.path == path and err.value.offset == 0


def test_bad_compressed_shards(tmp_path):
    ds = tmp_path / "ds"
    write_mds(ds, compression="zstd", columns={"image": "jpeg", "label": "int"})
    info = json.load(open(ds / "index.json"))["shards"][0]
    path = os.path.join(ds, info["zip_data"]["basename"])
    good = open(path, "rb").read()
    with open(path, "wb") as f:  # bad magic
        f.write(b"\0\0\0\0" + good[4:])
    with pytest.raises(FormatError, match="shard 0: sha1 mismatch") as err:
        formats.mds(ds)
    assert err.value.path == path
    obj = json.load(open(ds / "index.json"))
    for s in obj["shards"]:
        s["zip_data"]["hashes"] = {}
        s["raw_data"]["hashes"] = {}
    with open(ds / "index.json", "w") as f:
        json.dump(obj, f)
    with pytest.raises(FormatError, match="bad zstd data") as err:
        formats.mds(ds)
    assert err.value.path == path and err.value.offset == 0


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_from_seaweedfs_equals_local(tmp_path, seaweed, compression):
    cols = {"image": "jpeg", "label": "int", "caption": "str"}
    write_mds(tmp_path / "ds", columns=cols, compression=compression)
    bucket = f"mds-{compression or 'plain'}"
    seaweed.create_bucket(Bucket=bucket)
    upload_tree(seaweed, bucket, str(tmp_path / "ds"), "train")
    index = formats.mds(f"s3://{bucket}/train")
    want = reference(tmp_path / "ds")
    assert all(p.startswith("s3://") for p in index.files) == (compression is None)
    for i in range(len(index)):
        assert_same(index[i], want[i], cols)
    loader = gpuio.Loader(index, 4, ops=[ops.decode_image(field="image")], fields=["image", "label"],
                          output="numpy")
    for batch in loader:
        for j, i in enumerate(batch["index"].tolist()):
            np.testing.assert_array_equal(batch["image"][j], want[i]["image"][1])
            assert batch["label"][j] == want[i]["label"]
    if compression is None:
        assert index.meta["index_bytes_read"] == header_bytes(tmp_path / "ds")


def test_cli_index_inspect_and_check(tmp_path, capsys):
    from gpuio.cli import main

    write_mds(tmp_path / "ds", columns={"photo": "jpeg", "label": "int"})
    main(["index", "mds", str(tmp_path / "ds"), "--out", str(tmp_path / "i.npz")])
    assert "23 samples in" in capsys.readouterr().out
    main(["inspect", str(tmp_path / "i.npz")])
    text = capsys.readouterr().out
    assert "format mds" in text and "photo                parsed from '__sample__'" in text
    index = gpuio.SampleIndex.load(tmp_path / "i.npz")
    ext = index.extents["__sample__"]
    path, at = index.files[ext.file[5]], int(ext.offset[5])
    data = bytearray(open(path, "rb").read())
    data[at + 4 + 2: at + 4 + 40] = bytes(38)  # the JPEG's header zeroed: it no longer decodes
    open(path, "wb").write(data)
    assert main(["check", str(tmp_path / "i.npz")]) == 1
    text = capsys.readouterr().out
    assert "22 of 23 samples good, 1 bad (reading every field, decoding photo" in text
    assert "sample 5" in text and path in text


# where bytes are changed: the headers at the start, the tables at the end, anywhere
_PLACES = st.one_of(st.integers(0, 300), st.integers(-70_000, -1), st.integers(0, 1 << 20))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_PLACES, st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, 2))
def test_damaged_shards_give_gpuio_errors_or_samples(tmp_path, flips, shard):
    """Bytes changed anywhere in a shard (its header, offsets, JSON, sizes, values): a
    gpuio error naming the place, or samples read from inside the shard."""
    ds = tmp_path / f"ds-{len(os.listdir(tmp_path))}"
    write_mds(ds, n=12)
    path = _shard(ds, shard)
    data = bytearray(open(path, "rb").read())
    for at, value in flips:
        data[at % len(data)] = value
    open(path, "wb").write(data)
    check_index_or_gpuio_error(lambda: formats.mds(ds), list(COLUMNS))
