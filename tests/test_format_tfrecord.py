"""formats.tfrecord on files written by the tfrecord package."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import tfrecord as tfrecord_pkg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tfrecord.reader import tfrecord_loader
from tfrecord.tools.tfrecord2idx import create_index

import gpuio
from checkers import (assert_gpu_read_matches_cpu, check_directory_and_fifo_name_the_path, check_index_or_gpuio_error,
                      index_on_a_process_pool)
from gpuio.errors import ConfigError, DataError, FormatError
from gpuio.formats import tfrecord
from gpuio.formats.tfrecord import ExampleParser

FEATURES = {"image/encoded": "bytes", "image/class/label": "int64", "bbox": "float", "tags": "bytes",
            "score": "float", "ids": "int64"}


def _examples(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        size = int(rng.choice([0, 1, 5, 127, 128, 300, 5000, 70000]))
        out.append({
            "image/encoded": (rng.integers(0, 256, size, dtype=np.uint8).tobytes(), "byte"),
            "image/class/label": (int(rng.integers(-5, 1000)) if k % 7 else -(1 << 62), "int"),
            "bbox": (rng.random(k % 5).astype(np.float32).tolist(), "float"),
            "tags": ([f"t{j}".encode() for j in range(k % 3 + 1)], "byte"),
            "score": (float(np.float32(k / 3)), "float"),
            "ids": (list(range(k, k + k % 4)), "int"),
        })
    return out


def _write(path, examples):
    writer = tfrecord_pkg.TFRecordWriter(os.fspath(path))
    for ex in examples:
        writer.write(ex)
    writer.close()
    return path


@pytest.fixture
def dataset(tmp_path):
    path = _write(tmp_path / "data.tfrecord", _examples(40))
    create_index(os.fspath(path), os.fspath(tmp_path / "data.idx"))
    return path, tmp_path / "data.idx"


def _assert_matches_loader(index, path):
    """Every parsed feature equals what tfrecord's own reader returns."""
    ref = list(tfrecord_loader(os.fspath(path), None))
    assert len(index) == len(ref)
    rows = np.arange(len(index))
    cols = gpuio.storage.read_fields(index, rows, tuple(FEATURES))
    for i, want in enumerate(ref):
        assert cols["image/encoded"][i].tobytes() == want["image/encoded"]
        assert cols["image/class/label"][i] == want["image/class/label"][0]
        assert isinstance(cols["image/class/label"][i], np.int64)
        np.testing.assert_array_equal(np.atleast_1d(cols["bbox"][i]), want["bbox"])
        np.testing.assert_array_equal(np.atleast_1d(cols["ids"][i]), want["ids"])
        assert cols["score"][i] == want["score"][0] and cols["score"][i].dtype == np.float32
        tags = want["tags"]
        got = cols["tags"][i]
        if isinstance(tags, bytes):
            assert got.tobytes() == tags
        else:
            assert [g.tobytes() for g in got] == tags.tolist()


@pytest.mark.parametrize("use_index", [False, True])
@pytest.mark.parametrize("verify", [False, True])
def test_features_match_tfrecord_reader(dataset, use_index, verify):
    path, idx = dataset
    index = tfrecord(path, idx if use_index else None, features=FEATURES, verify=verify)
    assert set(index.fields) == {"record", "record_number", *FEATURES}
    _assert_matches_loader(index, path)


def test_index_file_and_scan_agree_and_payload_is_exact(dataset):
    path, idx = dataset
    scanned, indexed = tfrecord(path), tfrecord(path, idx)
    for a, b in zip((scanned.extents["data"].offset, scanned.extents["data"].length),
                    (indexed.extents["data"].offset, indexed.extents["data"].length)):
        np.testing.assert_array_equal(a, b)
    # tfrecord2idx's length covers the framing: 8 + 4 + payload + 4
    table = np.loadtxt(idx, dtype=np.int64)
    np.testing.assert_array_equal(indexed.extents["data"].offset, table[:, 0] + 12)
    np.testing.assert_array_equal(indexed.extents["data"].length, table[:, 1] - 16)
    payloads = [bytes(r) for r in tfrecord_pkg.reader.tfrecord_iterator(os.fspath(path))]
    got = gpuio.read(indexed, np.arange(len(indexed)))
    assert [g.tobytes() for g in got] == payloads
    assert indexed[3]["data"] == payloads[3] and indexed[3]["record_number"] == 3


def test_bytes_features_are_views_into_the_batch_buffer(dataset):
    path, _ = dataset
    index = tfrecord(path, features={"image/encoded": "bytes"})
    rows = np.arange(len(index))
    records = gpuio.read(index, rows, "record")
    parsed = index.parser.parse(records, rows, [path] * len(rows), index.extents["record"].offset)
    for rec, img in zip(records, parsed["image/encoded"]):
        if len(img):
            assert np.shares_memory(rec, img)


def test_several_files_and_save_load(tmp_path):
    a = _write(tmp_path / "a.tfrecord", _examples(5, seed=1))
    b = _write(tmp_path / "b.tfrecord", _examples(7, seed=2))
    create_index(os.fspath(b), os.fspath(tmp_path / "b.idx"))
    index = tfrecord([a, b], [None, tmp_path / "b.idx"], features=FEATURES)
    assert len(index) == 12 and len(index.files) == 2
    assert index.values["record_number"].tolist() == list(range(5)) + list(range(7))
    index.save(tmp_path / "tf.idx")
    back = gpuio.SampleIndex.load(tmp_path / "tf.idx")
    assert isinstance(back.parser, ExampleParser) and back.parser.features == FEATURES
    ref = list(tfrecord_loader(os.fspath(b), None))
    assert back[5 + 6]["image/encoded"] == ref[6]["image/encoded"]
    assert back[5 + 6]["image/class/label"] == ref[6]["image/class/label"][0]


def test_empty_file(tmp_path):
    path = tmp_path / "empty.tfrecord"
    path.write_bytes(b"")
    assert len(tfrecord(path)) == 0


def test_hand_written_protobuf_variants(tmp_path):
    """Unpacked int64/float lists, negative varints and unknown fields, which the
    tfrecord writer never produces."""
    def varint(v):
        v &= (1 << 64) - 1
        out = bytearray()
        while True:
            out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
            v >>= 7
            if not out[-1] & 0x80:
                return bytes(out)

    def ld(field, body):
        return varint(field << 3 | 2) + varint(len(body)) + body

    ints = ld(3, varint(1 << 3 | 0) + varint(-7) + varint(1 << 3 | 0) + varint(9))  # unpacked
    floats = ld(2, b"\x0d" + struct.pack("<f", 1.5) + b"\x0d" + struct.pack("<f", -2.0))
    unknown = varint(9 << 3 | 0) + varint(5) + varint(10 << 3 | 5) + b"abcd"
    entries = ld(1, ld(1, b"i") + ld(2, ints)) + ld(1, ld(1, b"f") + ld(2, floats)) + ld(1, ld(1, b"e") + ld(2, b""))
    payload = unknown + ld(1, entries)
    path = _write_payloads(tmp_path / "hand.tfrecord", [payload])
    index = tfrecord(path, features={"i": "int64", "f": "float"}, verify=True)
    sample = index[0]
    np.testing.assert_array_equal(sample["i"], [-7, 9])
    np.testing.assert_array_equal(sample["f"], np.array([1.5, -2.0], dtype=np.float32))
    assert tfrecord(path, features={"e": "bytes"})[0]["e"] == []  # an entry without a value: empty
    with pytest.raises(FormatError, match="feature 'missing' missing"):
        tfrecord(path, features={"missing": "int64"})[0]
    with pytest.raises(FormatError, match="feature 'i' holds int64, expected float"):
        tfrecord(path, features={"i": "float"})[0]


def _write_payloads(path, payloads):
    """Frame serialized protobufs as TFRecords, with the tfrecord package's CRC."""
    with open(path, "wb") as f:
        for payload in payloads:
            header = struct.pack("<Q", len(payload))
            f.write(header + tfrecord_pkg.TFRecordWriter.masked_crc(header) + payload
                    + tfrecord_pkg.TFRecordWriter.masked_crc(payload))
    return path


def test_feature_with_no_kind_is_empty(tmp_path):
    """tf.train.Feature() (no kind set) parses as an empty list, as
    TensorFlow's parser and DALI's variable-length reader read it."""
    from tfrecord import example_pb2

    examples = []
    for k in range(3):
        ex = example_pb2.Example()
        feats = ex.features.feature
        feats["label"].int64_list.value.append(k)
        if k == 1:
            for name in ("maybe_i", "maybe_f", "maybe_b"):
                feats[name].CopyFrom(example_pb2.Feature())
        else:
            feats["maybe_i"].int64_list.value.extend([k, -k])
            feats["maybe_f"].float_list.value.extend([k / 2, 1.0])
            feats["maybe_b"].bytes_list.value.extend([b"x" * k, b"yz"])
        examples.append(ex)
    path = _write_payloads(tmp_path / "maybe.tfrecord", [ex.SerializeToString() for ex in examples])
    empty = examples[1].features.feature["maybe_i"]
    assert empty.WhichOneof("kind") is None and empty.SerializeToString() == b""
    index = tfrecord(path, features={"label": "int64", "maybe_i": "int64", "maybe_f": "float",
                                     "maybe_b": "bytes"}, verify=True)
    s = index[1]
    assert s["label"] == 1
    assert s["maybe_i"].dtype == np.int64 and s["maybe_i"].shape == (0,)
    assert s["maybe_f"].dtype == np.float32 and s["maybe_f"].shape == (0,)
    assert s["maybe_b"] == []
    for k in (0, 2):
        assert index[k]["maybe_i"].tolist() == [k, -k]
        assert index[k]["maybe_f"].tolist() == [k / 2, 1.0]
        assert [b.tobytes() for b in index[k]["maybe_b"]] == [b"x" * k, b"yz"]


@pytest.mark.parametrize("compression", ["gzip", "zlib"])
def test_compressed_files(tmp_path, compression, monkeypatch):
    """TFRecordOptions GZIP/ZLIB files are one gzip/zlib stream of the
    plain file; without compression= they are refused with a message that says so."""
    import gzip
    import zlib

    monkeypatch.setenv("GPUIO_CACHE_DIR", os.fspath(tmp_path / "cache"))
    plain = _write(tmp_path / "plain.tfrecord", _examples(25, seed=4))
    raw = plain.read_bytes()
    packed = tmp_path / f"data.tfrecord.{compression}"
    packed.write_bytes(gzip.compress(raw) if compression == "gzip" else zlib.compress(raw))
    if compression == "gzip":  # the tfrecord package reads the same file
        want = [bytes(r) for r in tfrecord_pkg.reader.tfrecord_iterator(os.fspath(packed), compression_type="gzip")]
    else:
        want = [bytes(r) for r in tfrecord_pkg.reader.tfrecord_iterator(os.fspath(plain))]
    assert len(want) == 25
    with pytest.raises(FormatError, match=f"{compression}-compressed TFRecord .*compression='{compression}'") as err:
        tfrecord(packed)
    assert err.value.path == os.fspath(packed) and err.value.offset == 0
    index = tfrecord(packed, compression=compression, features=FEATURES, verify=True)
    assert index.meta["decompressed_from"] == [os.fspath(packed)]
    assert index.files[0].startswith(os.fspath(tmp_path / "cache" / "tfrecord"))
    assert [r.tobytes() for r in gpuio.read(index, np.arange(25), "record")] == want
    _assert_matches_loader(index, plain)
    copy = index.files[0]
    assert tfrecord(packed, compression=compression).files[0] == copy  # decompressed once
    other = "zlib" if compression == "gzip" else "gzip"
    with pytest.raises(FormatError, match=f"does not start a {other} stream .*looks {compression}-compressed"):
        tfrecord(packed, compression=other)
    with pytest.raises(FormatError, match="does not start a .* stream .*looks uncompressed"):
        tfrecord(plain, compression=compression)
    cut = tmp_path / f"cut.{compression}"
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
    with pytest.raises(FormatError, match="ends early") as err:
        tfrecord(cut, compression=compression)
    assert err.value.path == os.fspath(cut)
    with pytest.raises(ConfigError, match="compression="):
        tfrecord(plain, compression="bz2")


def test_index_file_must_cover_the_data_file(dataset, tmp_path):
    """An index file that does not cover its data file (empty, cut in
    half, or with a gap) is an error, not a shorter dataset."""
    path, idx = dataset
    size = path.stat().st_size
    lines = idx.read_text().splitlines()
    table = np.loadtxt(idx, dtype=np.int64)
    bad = tmp_path / "bad.idx"
    bad.write_text("")
    with pytest.raises(FormatError, match=rf"does not cover the data file \({size} bytes\): its 0 records "
                                          r"end at byte 0; rebuild it") as err:
        tfrecord(path, bad)
    assert err.value.path == os.fspath(path) and err.value.offset == 0
    bad.write_text("\n".join(lines[:20]) + "\n")
    end = int(table[19].sum())
    with pytest.raises(FormatError, match=f"its 20 records end at byte {end}") as err:
        tfrecord(path, bad)
    assert err.value.offset == end
    bad.write_text("\n".join(lines[:5] + lines[6:]) + "\n")
    with pytest.raises(FormatError, match=f"line 6 starts at byte {table[6, 0]}, where the records before "
                                          f"end at byte {table[5, 0]}"):
        tfrecord(path, bad)
    assert len(tfrecord(path, idx)) == 40


def _flip(path, pos):
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x10
    path.write_bytes(bytes(data))


def test_data_crc_mismatch_names_file_record_offset(dataset):
    path, idx = dataset
    starts = np.loadtxt(idx, dtype=np.int64)[:, 0]
    _flip(path, int(starts[17]) + 20)
    for index_path in (None, idx):
        with pytest.raises(FormatError, match=r"data\.tfrecord: record 17 at byte \d+: data CRC mismatch "
                                              r"\(stored 0x[0-9a-f]{8}, computed 0x[0-9a-f]{8}\)") as err:
            tfrecord(path, index_path, verify=True)
        assert err.value.offset == starts[17]
    tfrecord(path)  # without verify, payloads are not checked


def test_length_crc_and_truncation(dataset):
    path, idx = dataset
    starts = np.loadtxt(idx, dtype=np.int64)[:, 0]
    size = path.stat().st_size
    os.truncate(path, size - 3)
    n = size - int(starts[39]) - 16  # the last record's payload bytes
    with pytest.raises(FormatError, match=f"record 39 at byte .*truncated record: the header announces {n} "
                                          f"payload bytes and a 4-byte CRC, the file has {n + 1} bytes "
                                          f"after the header") as err:
        tfrecord(path)
    assert err.value.offset == starts[39]
    with pytest.raises(FormatError, match="does not fit the file") as err:
        tfrecord(path, idx)
    assert err.value.sample == "record 39"
    _flip(path, int(starts[2]) + 1)  # the length field
    with pytest.raises(FormatError, match="record 2 at byte .*length CRC mismatch"):
        tfrecord(path)


def test_bad_index_files(dataset, tmp_path):
    path, idx = dataset
    bad = tmp_path / "bad.idx"
    bad.write_text("0 95\nzero 12\n")
    with pytest.raises(FormatError, match="not an index file"):
        tfrecord(path, bad)
    bad.write_text("0 95 3\n")
    with pytest.raises(FormatError, match="expected 2 integers per line"):
        tfrecord(path, bad)
    bad.write_text(f"{path.stat().st_size + 10} 100\n")
    with pytest.raises(FormatError, match="line 1: .*does not fit"):
        tfrecord(path, bad)
    table = np.loadtxt(idx, dtype=np.int64)
    table[0, 1] += 4  # still covers the file, but record 0 is not 4 bytes longer
    table[1] += [4, -4]
    np.savetxt(bad, table, fmt="%d")
    with pytest.raises(FormatError, match="gives .* bytes for this record, its header says"):
        tfrecord(path, bad, verify=True)
    with pytest.raises(ConfigError, match="index files for"):
        tfrecord([path, path], [idx])
    with pytest.raises(ConfigError, match="feature kinds"):
        tfrecord(path, features={"x": "string"})
    with pytest.raises(ConfigError, match="are taken"):
        tfrecord(path, features={"record": "bytes"})
    with pytest.raises(DataError, match="cannot read"):
        tfrecord(tmp_path / "missing.tfrecord")


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory):
    path = _write(tmp_path_factory.mktemp("tf") / "v.tfrecord", _examples(6, seed=3))
    return path.read_bytes()


def _index_and_parse_all(path, verify):
    check_index_or_gpuio_error(lambda: tfrecord(path, features=FEATURES, verify=verify), FEATURES)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 1 << 17), flips=st.lists(st.tuples(st.integers(0, 1 << 17), st.integers(0, 7)),
                                                   max_size=4), verify=st.booleans())
def test_corrupted_files_raise_only_gpuio_errors(tmp_path, valid_bytes, cut, flips, verify):
    data = bytearray(valid_bytes[:cut])
    for pos, bit in flips:
        if data:
            data[pos % len(data)] ^= 1 << bit
    path = tmp_path / "f.tfrecord"
    path.write_bytes(bytes(data))
    _index_and_parse_all(path, verify)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=300))
def test_random_payloads_raise_only_gpuio_errors(tmp_path, payload):
    """Valid framing around random bytes: only the protobuf decoder is exercised."""
    _index_and_parse_all(_write_payloads(tmp_path / "p.tfrecord", [payload]), True)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.binary(max_size=200))
def test_random_index_files_raise_only_gpuio_errors(tmp_path, text, valid_bytes):
    path = tmp_path / "v.tfrecord"
    path.write_bytes(valid_bytes)
    (tmp_path / "r.idx").write_bytes(text)
    check_index_or_gpuio_error(lambda: tfrecord(path, tmp_path / "r.idx", features=FEATURES), FEATURES)


@pytest.mark.gpu
def test_gpu_read_matches_cpu(dataset):
    path, idx = dataset
    index = tfrecord(path, idx)
    assert_gpu_read_matches_cpu(index, "data")


def test_directory_and_fifo_name_the_path(dataset, tmp_path):
    path, index_path = dataset
    check_directory_and_fifo_name_the_path(tfrecord, path, index_path, tmp_path, ".tfrecord", "a TFRecord file")


def test_a_missing_feature_names_the_features_the_record_has(dataset):
    path, _ = dataset
    index = tfrecord(path, features={"image/encoded": "bytes", "image/label": "int64"})
    with pytest.raises(FormatError) as err:
        index[3]
    msg = str(err.value)
    assert "feature 'image/label' missing; the record's features: 'bbox', 'ids', 'image/class/label', " \
           "'image/encoded', 'score', 'tags'" in msg
    assert str(path) in msg and "sample 3" in msg


def test_files_scanned_on_a_process_pool_match_one_process(tmp_path, monkeypatch):
    paths = [_write(tmp_path / f"{k}.tfrecord", _examples(6, seed=k)) for k in range(4)]
    here = tfrecord(paths, features=FEATURES)
    pooled, report = index_on_a_process_pool(tmp_path, f"formats.tfrecord({[str(p) for p in paths]!r}, "
                                                       f"features={FEATURES!r})")
    assert report["pool"]  # the files after the first went to processes
    for part in ("file", "offset", "length"):
        assert np.array_equal(getattr(here.extents["record"], part), getattr(pooled.extents["record"], part))
    assert pooled.values["record_number"].tolist() == here.values["record_number"].tolist()
    _flip(paths[2], 3)  # the length CRC of the first record
    _, report = index_on_a_process_pool(tmp_path, f"formats.tfrecord({[str(p) for p in paths]!r})")
    assert report["pool"] and "length CRC mismatch" in report["error"]  # raised in a process, naming the file
    assert report["path"] == os.fspath(paths[2])


def test_progress_bar_only_for_long_scans(tmp_path, capfd, monkeypatch):
    paths = [_write(tmp_path / f"{k}.tfrecord", _examples(3, seed=k)) for k in range(2)]
    tfrecord(paths)
    assert capfd.readouterr().err == ""
    monkeypatch.setattr("gpuio.formats._files.PROGRESS_DELAY_S", 0.0)  # as if it had run for a second
    tfrecord(paths)
    assert "indexing TFRecord files" in capfd.readouterr().err
