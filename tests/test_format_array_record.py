"""formats.array_record: files written by array_record's writer, read record for record
as Grain's reader (ArrayRecordDataSource) reads them."""

from __future__ import annotations

import io
import os
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

import gpuio
from gpuio import formats, ops
from gpuio.errors import FormatError
from gpuio.formats import _riegeli

from array_record.python.array_record_data_source import ArrayRecordDataSource
from array_record.python.array_record_module import ArrayRecordWriter

from checkers import check_index_or_gpuio_error
from remote_env import upload_tree


def _jpeg(i, rng):
    h, w = int(rng.integers(16, 64)), int(rng.integers(16, 64))
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([x * 4 % 256, y * 4 % 256, (x * y + i) % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def records(n=40, seed=0):
    """JPEGs, and byte strings from empty to past two 64 KiB blocks, so that records
    cross block headers at every offset class."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = [0, 1, 700, 40_000, 70_000, 140_000][i % 6]
        out.append(_jpeg(i, rng) if i % 3 == 0 else rng.bytes(int(size + rng.integers(0, 50))))
    return out


def write(path, data, options):
    w = ArrayRecordWriter(str(path), options)
    for r in data:
        w.write(r)
    w.close()


def reference(paths):
    source = ArrayRecordDataSource([str(p) for p in paths])
    return [source[i] for i in range(len(source))]


@pytest.mark.parametrize("options", ["group_size:1,uncompressed", "group_size:4,uncompressed", "group_size:1",
                                     "group_size:1,brotli", "group_size:1,snappy"])
def test_records_equal_grains_data_source(tmp_path, options):
    paths = [tmp_path / f"part-{k}.array_record" for k in range(2)]
    for k, p in enumerate(paths):
        write(p, records(seed=k), options)
    index = formats.array_record(str(tmp_path / "part-{0..1}.array_record"))
    want = reference(paths)
    assert len(index) == len(want) == 80
    assert index.meta["chunked"] == ["group_size:1" in options] * 2
    assert index.meta["data_bytes"] == sum(os.path.getsize(p) for p in paths)
    for i in range(len(index)):
        assert index[i]["data"] == want[i]
    rows = np.random.default_rng(0).permutation(len(index))
    got = gpuio.storage.read_fields(index, rows, ["data"])["data"]
    assert [bytes(g) for g in got] == [want[i] for i in rows.tolist()]
    if "uncompressed" in options:  # in place: the record (with its chunk's header where group_size is 1)
        ext = index.extents["__record__"]
        assert (ext.length - np.array([len(w) for w in want]) <= 45 * ("group_size:1" in options) + 3 * 24).all()
        data = sum(os.path.getsize(p) for p in paths)
        assert index.meta["index_bytes_read"] < data / 100
    index.save(tmp_path / "i.npz")
    again = gpuio.SampleIndex.load(tmp_path / "i.npz")
    assert [bytes(again[i]["data"]) for i in (0, 4, 79)] == [want[i] for i in (0, 4, 79)]


def test_loader_decodes_the_jpeg_records(tmp_path):
    data = [_jpeg(i, np.random.default_rng(i)) for i in range(11)]
    write(tmp_path / "a.array_record", data, "group_size:1")
    index = formats.array_record(tmp_path / "a.array_record")
    want = reference([tmp_path / "a.array_record"])
    seen = {}
    for batch in gpuio.Loader(index, 4, ops=[ops.decode_image(field="data")], shuffle=True, seed=2, output="numpy"):
        for j, i in enumerate(batch["index"].tolist()):
            seen[i] = batch["image"][j]
    assert sorted(seen) == list(range(11))
    for i, image in seen.items():
        np.testing.assert_array_equal(image, np.asarray(Image.open(io.BytesIO(want[i]))))


def test_compressed_chunks_of_several_records_are_refused(tmp_path):
    write(tmp_path / "a.array_record", records(10), "group_size:4")
    with pytest.raises(FormatError, match="group_size:1") as err:
        formats.array_record(tmp_path / "a.array_record")
    assert err.value.path == str(tmp_path / "a.array_record") and err.value.offset == 64


def test_bad_files_name_the_file_and_offset(tmp_path):
    path = tmp_path / "a.array_record"
    write(path, records(12), "group_size:1,uncompressed")
    good = path.read_bytes()

    path.write_bytes(b"RIEGELI?" + good[8:])  # bad magic
    with pytest.raises(FormatError, match="not a Riegeli/ArrayRecord file") as err:
        formats.array_record(path)
    assert err.value.path == str(path) and err.value.offset == 0

    path.write_bytes(good[: len(good) - 70_000])  # truncated: the postscript block is gone
    with pytest.raises(FormatError, match="postscript|truncated") as err:
        formats.array_record(path)
    assert err.value.path == str(path)

    # a footer that lies: a chunk's offset one byte off
    path.write_bytes(good)
    reads = formats.array_record(path)
    offsets = np.unique(reads.extents["__record__"].offset)
    entry = next(bytes([0x08]) + _varint(int(o)) for o in offsets[1:]
                 if len(_varint(int(o))) == len(_varint(int(o) + 1)))
    at = good.rindex(entry)
    lied = good[:at] + bytes([0x08]) + _varint(_varint_at(entry, 1) + 1) + good[at + len(entry):]
    path.write_bytes(lied)
    index = formats.array_record(path)
    row = int(np.flatnonzero(index.extents["__record__"].offset == _varint_at(entry, 1) + 1)[0])
    with pytest.raises(FormatError) as err:
        index[row]
    assert err.value.path == str(path) and err.value.offset is not None and err.value.sample == row


def _varint(v):
    out = bytearray()
    while True:
        out.append(v & 0x7F | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _varint_at(buf, field):
    """Field ``field`` of a protobuf message of varint fields."""
    fields, pos = {}, 0
    while pos < len(buf):
        tag, pos = _riegeli.varint(buf, pos, len(buf), "", 0)
        fields[tag >> 3], pos = _riegeli.varint(buf, pos, len(buf), "", 0)
    return fields[field]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 3 << 16))
def test_riegeli_chunk_reader_raises_only_format_errors(data, offset):
    raw = np.frombuffer(data, np.uint8)
    try:
        _riegeli.simple_chunk(_riegeli.without_block_headers(raw, offset), "x", offset)
    except FormatError as exc:
        assert exc.path == "x" and exc.offset is not None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([0, 0x7A, 0x62, 0x73, 0x41]), st.integers(0, 80), st.integers(0, 3), st.integers(0, 80),
       st.binary(max_size=80))
def test_riegeli_simple_chunk_headers_that_lie(kind, data_size, records, decoded, body):
    """Chunk headers whose sizes and counts disagree with their data: a FormatError, or
    records that add up to what the header says."""
    header = struct.pack("<QQQQQ", 0, data_size, 0, 0x72 | (records << 8), decoded)
    try:
        found = _riegeli.simple_chunk(np.frombuffer(header + bytes([kind]) + body, np.uint8), "x", 0)
    except FormatError as exc:
        assert exc.path == "x" and exc.offset is not None
    else:
        assert len(found) == records and sum(len(r) for r in found) == decoded


def test_from_seaweedfs_equals_local(tmp_path, seaweed):
    folder = tmp_path / "ds"
    folder.mkdir()
    write(folder / "a.array_record", records(18), "group_size:1,uncompressed")
    write(folder / "b.array_record", records(9, seed=3), "group_size:1")
    seaweed.create_bucket(Bucket="arrayrecord")
    upload_tree(seaweed, "arrayrecord", str(folder), "train")
    index = formats.array_record("s3://arrayrecord/train/*.array_record")
    local = formats.array_record(str(folder / "*.array_record"))
    assert index.meta["index_bytes_read"] == local.meta["index_bytes_read"]
    want = reference([folder / "a.array_record", folder / "b.array_record"])
    got = [bytes(b) for batch in gpuio.Loader(index, 5, fields=["data"], output="numpy") for b in batch["data"]]
    assert got == want


# where bytes are changed: the headers at the start, the tables at the end, anywhere
_PLACES = st.one_of(st.integers(0, 300), st.integers(-70_000, -1), st.integers(0, 1 << 20))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(_PLACES, st.integers(0, 255)), min_size=1, max_size=4),
       st.sampled_from(["group_size:1,uncompressed", "group_size:3,uncompressed", "group_size:1"]))
def test_damaged_files_give_gpuio_errors_or_records(tmp_path, flips, options):
    path = tmp_path / f"{len(os.listdir(tmp_path))}.array_record"
    write(path, records(7), options)
    data = bytearray(path.read_bytes())
    for at, value in flips:
        data[at % len(data)] = value
    path.write_bytes(bytes(data))
    check_index_or_gpuio_error(lambda: formats.array_record(path), ["data"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, (1 << 63) - 1), max_size=40))
def test_vectorized_varints_equal_the_scalar_reader(values):
    buf = np.frombuffer(b"".join(_varint(v) for v in values), np.uint8)
    got, pos, scalar = _riegeli.varints(buf, "x", 0), 0, []
    while pos < len(buf):
        v, pos = _riegeli.varint(buf, pos, len(buf), "x", 0)
        scalar.append(v)
    assert got.tolist() == scalar == values


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 4 << 16).filter(lambda at: at % (1 << 16) == 0 or at % (1 << 16) >= 24),
       st.integers(0, 3 << 16))
def test_block_headers_taken_out_of_any_span(offset, length):
    """The bytes of file positions ``offset..offset+length`` (a span starts outside a block
    header, as chunks and records do) keep exactly those not in the 24 bytes after a
    multiple of 64 KiB."""
    positions = np.arange(offset, offset + length, dtype=np.int64)
    got = _riegeli.without_block_headers(positions, offset)
    np.testing.assert_array_equal(got, positions[positions % (1 << 16) >= 24])
