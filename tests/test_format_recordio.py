"""formats.recordio on files written here by the MXNet RecordIO specification."""

from __future__ import annotations

import ctypes
import os
import pickle
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuio
from checkers import (assert_gpu_read_matches_cpu, check_directory_and_fifo_name_the_path, check_index_or_gpuio_error,
                      index_on_a_process_pool)
from gpuio.errors import ConfigError, FormatError, StorageError
from gpuio.formats import recordio
from gpuio.formats.recordio import MAGIC, RecordIOParser

MAGIC_BYTES = struct.pack("<I", MAGIC)


def _parts(payload):
    """A writer splits the payload where the magic sits at a 4-byte aligned position
    and drops those 4 bytes; the reader puts them back."""
    out, start = [], 0
    for i in range(0, len(payload) & ~3, 4):
        if payload[i: i + 4] == MAGIC_BYTES:
            out.append(payload[start:i])
            start = i + 4
    out.append(payload[start:])
    return out


def _write_rec(f, payload):
    """Writes one record at the current position of ``f``; returns its offset."""
    offset = f.tell()
    parts = _parts(payload)
    for k, part in enumerate(parts):
        cflag = 0 if len(parts) == 1 else 1 if k == 0 else 3 if k == len(parts) - 1 else 2
        f.write(struct.pack("<II", MAGIC, cflag << 29 | len(part)) + part + b"\0" * (-len(part) % 4))
    return offset


def _pack(label, ident, data, id2=0):
    """IRHeader + data, as mxnet.recordio.pack does: a scalar label, or flag labels."""
    labels = np.atleast_1d(np.asarray(label, dtype=np.float32))
    if labels.size == 1 and np.ndim(label) == 0:
        return struct.pack("<IfQQ", 0, float(labels[0]), ident, id2) + data
    return struct.pack("<IfQQ", labels.size, 0.0, ident, id2) + labels.tobytes() + data


def _samples(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        data = bytearray(rng.integers(0, 256, int(rng.choice([0, 1, 3, 4, 5, 100, 4096, 30001])), dtype=np.uint8))
        if k % 4 == 1 and len(data) >= 8:  # one aligned magic: two parts (header is 24 bytes, 4-aligned)
            data[4:8] = MAGIC_BYTES
        if k % 4 == 2:  # magics at the start, twice in the middle, and at the end: many parts
            data = bytearray(MAGIC_BYTES) + data + MAGIC_BYTES + MAGIC_BYTES + bytes(len(data) % 4) + MAGIC_BYTES
            data[1:1] = MAGIC_BYTES  # an unaligned magic is not split
        label = float(k) / 2 if k % 3 else rng.random(k % 5 + 2).astype(np.float32)
        out.append((label, k * 1000 + 7, bytes(data)))
    return out


def _write_file(path, samples, keys=None, idx_path=None, order=None):
    offsets = []
    with open(path, "wb") as f:
        for label, ident, data in samples:
            offsets.append(_write_rec(f, _pack(label, ident, data)))
    if idx_path is not None:
        keys = list(range(len(samples))) if keys is None else keys
        order = range(len(samples)) if order is None else order
        with open(idx_path, "w") as f:
            f.writelines(f"{keys[i]}\t{offsets[i]}\n" for i in order)
    return offsets


def _assert_sample(got, want):
    label, ident, data = want
    assert got["data"] == data
    assert got["id"] == ident
    assert got["label"].dtype == np.float32
    np.testing.assert_array_equal(got["label"], np.atleast_1d(np.float32(label)))


def test_scan_reads_every_record_exactly(tmp_path):
    samples = _samples(40)
    offsets = _write_file(tmp_path / "a.rec", samples)
    assert any(len(_parts(_pack(*s))) > 2 for s in samples)  # the writer did split records
    index = recordio(tmp_path / "a.rec")
    assert len(index) == 40
    assert set(index.fields) == {"record", "key", "data", "label", "id"}
    np.testing.assert_array_equal(index.extents["record"].offset, offsets)
    np.testing.assert_array_equal(index.values["key"], np.arange(40))
    cols = gpuio.storage.read_fields(index, np.arange(40), ("data", "label", "id"))
    for i, want in enumerate(samples):
        _assert_sample({k: cols[k][i] for k in cols} | {"data": cols["data"][i].tobytes()}, want)
    _assert_sample(index[2], samples[2])


def test_idx_file_order_keys_and_agreement_with_scan(tmp_path):
    samples = _samples(25, seed=1)
    rng = np.random.default_rng(5)
    order = rng.permutation(25)
    keys = (np.arange(25) * 3 + 100).tolist()
    _write_file(tmp_path / "a.rec", samples, keys, tmp_path / "a.idx", order)
    index = recordio(tmp_path / "a.rec", tmp_path / "a.idx")
    assert index.values["key"].tolist() == [keys[i] for i in order]
    for j, i in enumerate(order):
        _assert_sample(index[j], samples[i])
    # the scan's extents are exact; the .idx ones run to the next record (padding)
    scanned = recordio(tmp_path / "a.rec")
    ext = index.extents["record"]
    np.testing.assert_array_equal(ext.offset, scanned.extents["record"].offset[order])
    assert (ext.length >= scanned.extents["record"].length[order]).all()
    assert (ext.length - scanned.extents["record"].length[order] < 4).all()


def test_single_part_data_is_a_view(tmp_path):
    samples = [(1.0, 1, b"abcdefgh"), (2.0, 2, b"ab" + MAGIC_BYTES + b"cd"), (3.0, 3, b"xyz")]
    _write_file(tmp_path / "a.rec", samples)
    index = recordio(tmp_path / "a.rec")
    rows = np.arange(3)
    records = gpuio.read(index, rows, "record")
    parsed = index.parser.parse(records, rows, [index.files[0]] * 3, index.extents["record"].offset)
    assert np.shares_memory(parsed["data"][0], records[0])
    assert np.shares_memory(parsed["data"][2], records[2])
    # the magic at payload byte 26 is not 4-aligned: one part, kept as is
    assert parsed["data"][1].tobytes() == b"ab" + MAGIC_BYTES + b"cd"


def test_several_files_and_save_load(tmp_path):
    a, b = _samples(4, seed=2), _samples(6, seed=3)
    _write_file(tmp_path / "a.rec", a)
    _write_file(tmp_path / "b.rec", b, idx_path=tmp_path / "b.idx")
    index = recordio([tmp_path / "a.rec", tmp_path / "b.rec"], [None, tmp_path / "b.idx"])
    assert len(index) == 10 and len(index.files) == 2
    index.save(tmp_path / "rec.gidx")
    back = gpuio.SampleIndex.load(tmp_path / "rec.gidx")
    assert isinstance(back.parser, RecordIOParser)
    for i, want in enumerate(a + b):
        _assert_sample(back[i], want)


def test_empty_file(tmp_path):
    (tmp_path / "e.rec").write_bytes(b"")
    assert len(recordio(tmp_path / "e.rec")) == 0


def test_bad_magic_names_file_record_offset(tmp_path):
    offsets = _write_file(tmp_path / "a.rec", _samples(10), idx_path=tmp_path / "a.idx")
    data = bytearray((tmp_path / "a.rec").read_bytes())
    data[offsets[6]] ^= 0xFF
    (tmp_path / "a.rec").write_bytes(bytes(data))
    with pytest.raises(FormatError, match=r"a\.rec: record 6 at byte \d+: bad magic") as err:
        recordio(tmp_path / "a.rec")
    assert err.value.offset == offsets[6]
    index = recordio(tmp_path / "a.rec", tmp_path / "a.idx")  # .idx: found at read time
    with pytest.raises(FormatError, match=r"a\.rec: sample 6 at byte \d+: bad magic") as err:
        index[6]
    assert err.value.offset == offsets[6]


def test_truncation_and_bad_parts(tmp_path):
    samples = _samples(8, seed=4)
    offsets = _write_file(tmp_path / "a.rec", samples)
    path = tmp_path / "a.rec"
    raw = path.read_bytes()
    path.write_bytes(raw[: offsets[7] + 12])
    with pytest.raises(FormatError, match="record 7 at byte .*truncated part") as err:
        recordio(path)
    assert err.value.offset == offsets[7]
    # a continuation part where a record starts, and a whole record inside a split one
    last = struct.pack("<II", MAGIC, 3 << 29 | 0)
    path.write_bytes(raw[: offsets[3]] + last)
    with pytest.raises(FormatError, match="record 3 at byte .*continuation part"):
        recordio(path)
    first = struct.pack("<II", MAGIC, 1 << 29 | 0)
    path.write_bytes(raw[: offsets[3]] + first + raw[offsets[3]:])
    with pytest.raises(FormatError, match="a new record .* inside the multi-part record"):
        recordio(path)
    path.write_bytes(raw[: offsets[3]] + first)
    with pytest.raises(FormatError, match="ends inside a multi-part record"):
        recordio(path)


def test_bad_headers_and_idx(tmp_path):
    path = tmp_path / "a.rec"
    with open(path, "wb") as f:
        _write_rec(f, b"short")  # no room for the IRHeader
        _write_rec(f, struct.pack("<IfQQ", 1000, 0, 1, 0) + b"1234")  # 1000 labels announced
    index = recordio(path)
    with pytest.raises(FormatError, match="sample 0 at byte 0: payload of 5 bytes is shorter"):
        index[0]
    with pytest.raises(FormatError, match="sample 1 at byte 16: IRHeader announces 1000 labels"):
        index[1]
    idx = tmp_path / "a.idx"
    idx.write_text(f"0\t0\n1\t{path.stat().st_size}\n")
    with pytest.raises(FormatError, match="line 2 \\(key 1\\) points past the end"):
        recordio(path, idx)
    idx.write_text("0\tzero\n")
    with pytest.raises(FormatError, match="not an index file"):
        recordio(path, idx)
    with pytest.raises(ConfigError):
        recordio([path, path], idx)


def test_directory_fifo_and_bad_path_name_the_path(tmp_path):
    samples = _samples(3)
    _write_file(tmp_path / "a.rec", samples, idx_path=tmp_path / "a.idx")
    check_directory_and_fifo_name_the_path(recordio, tmp_path / "a.rec", tmp_path / "a.idx", tmp_path, ".rec",
                                           "a .rec file")
    with pytest.raises(StorageError, match="No such file"):
        recordio(tmp_path / "missing.rec")
    with pytest.raises(StorageError, match="cannot read .rec file"):
        recordio(str(tmp_path / "nul\0.rec"))


def _in_child_without_capabilities(fn):
    """``fn()``'s result or raised exception (as ``(type name, str, path)``), computed in
    a forked child that dropped every capability (capset(2)), so that file permissions
    hold even when the tests run as root (CAP_DAC_OVERRIDE would bypass them)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
            if ctypes.CDLL(None, use_errno=True).capset(header, (ctypes.c_uint32 * 6)()) != 0:
                raise OSError(ctypes.get_errno(), "capset failed")
            try:
                out = ("ok", repr(fn()), None)
            except Exception as exc:
                out = (type(exc).__name__, str(exc), getattr(exc, "path", None))
            os.write(write_end, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        out = pickle.loads(f.read())
    os.waitpid(pid, 0)
    return out


def test_unreadable_rec_names_the_path(tmp_path):
    _write_file(tmp_path / "a.rec", _samples(3), idx_path=tmp_path / "a.idx")
    os.chmod(tmp_path / "a.rec", 0)
    for idx in (None, tmp_path / "a.idx"):
        kind, message, path = _in_child_without_capabilities(lambda: len(recordio(tmp_path / "a.rec", idx)))
        assert kind == "StorageError" and path == str(tmp_path / "a.rec")
        assert "cannot read .rec file: Permission denied" in message


def test_idx_that_does_not_cover_the_file(tmp_path):
    samples = _samples(20, seed=8)
    offsets = _write_file(tmp_path / "a.rec", samples, idx_path=tmp_path / "a.idx")
    size = (tmp_path / "a.rec").stat().st_size
    lines = (tmp_path / "a.idx").read_text().splitlines(keepends=True)
    assert len(recordio(tmp_path / "a.rec", tmp_path / "a.idx")) == 20
    (tmp_path / "cut.idx").write_text("".join(lines[:11]))  # cut in half: 11 of 20 records
    with pytest.raises(FormatError, match=rf"cut\.idx does not cover the data file \({size} bytes\): its last "
                                          r"record \(line 11, key 10\) ends at byte") as err:
        recordio(tmp_path / "a.rec", tmp_path / "cut.idx")
    assert err.value.path == str(tmp_path / "a.rec") and offsets[10] < err.value.offset <= offsets[11]
    (tmp_path / "empty.idx").write_text("")
    with pytest.raises(FormatError, match=f"empty.idx lists no records, the file has {size} bytes"):
        recordio(tmp_path / "a.rec", tmp_path / "empty.idx")
    # an .idx that leaves out a record in the middle: the record before it refuses the extra bytes
    (tmp_path / "gap.idx").write_text("".join(lines[:5] + lines[6:]))
    index = recordio(tmp_path / "a.rec", tmp_path / "gap.idx")
    _assert_sample(index[3], samples[3])
    _assert_sample(index[5], samples[6])
    with pytest.raises(FormatError, match="the .idx leaves out the record at byte") as err:
        index[4]
    assert err.value.offset == offsets[5]
    (tmp_path / "e.rec").write_bytes(b"")
    assert len(recordio(tmp_path / "e.rec", tmp_path / "empty.idx")) == 0


def test_bad_cflag_is_refused(tmp_path):
    path = tmp_path / "a.rec"
    with open(path, "wb") as f:
        _write_rec(f, _pack(1.0, 1, b"abcd"))
        f.write(struct.pack("<II", MAGIC, 5 << 29 | 4) + b"wxyz")
    with pytest.raises(FormatError, match="record 1 at byte 36: bad cflag 5"):
        recordio(path)


@pytest.fixture(scope="module")
def valid_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "v.rec"
    _write_file(path, _samples(8, seed=6))
    return path.read_bytes()


def _index_and_parse_all(*args):
    check_index_or_gpuio_error(lambda: recordio(*args), ("data", "label", "id", "key"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 1 << 17), flips=st.lists(st.tuples(st.integers(0, 1 << 17), st.integers(0, 7)),
                                                   max_size=4))
def test_corrupted_files_raise_only_gpuio_errors(tmp_path, valid_bytes, cut, flips):
    data = bytearray(valid_bytes[:cut])
    for pos, bit in flips:
        if data:
            data[pos % len(data)] ^= 1 << bit
    (tmp_path / "f.rec").write_bytes(bytes(data))
    _index_and_parse_all(tmp_path / "f.rec")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=2000), offsets=st.lists(st.integers(-5, 2100), max_size=8))
def test_random_files_with_random_idx_raise_only_gpuio_errors(tmp_path, data, offsets):
    (tmp_path / "r.rec").write_bytes(data)
    (tmp_path / "r.idx").write_text("".join(f"{k}\t{o}\n" for k, o in enumerate(offsets)))
    _index_and_parse_all(tmp_path / "r.rec")
    _index_and_parse_all(tmp_path / "r.rec", tmp_path / "r.idx")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.binary(max_size=200), cflag=st.integers(0, 7))
def test_random_payloads_raise_only_gpuio_errors(tmp_path, payload, cflag):
    """Valid framing around random payloads and flags: the parser is exercised."""
    with open(tmp_path / "p.rec", "wb") as f:
        f.write(struct.pack("<II", MAGIC, cflag << 29 | len(payload)) + payload + b"\0" * (-len(payload) % 4))
    _index_and_parse_all(tmp_path / "p.rec")


@pytest.mark.gpu
def test_gpu_read_matches_cpu(tmp_path):
    _write_file(tmp_path / "a.rec", _samples(12), idx_path=tmp_path / "a.idx")
    index = recordio(tmp_path / "a.rec", tmp_path / "a.idx")
    assert_gpu_read_matches_cpu(index, "record")


def test_files_scanned_on_a_process_pool_match_one_process(tmp_path, monkeypatch, capfd):
    paths = []
    for k in range(4):
        _write_file(tmp_path / f"{k}.rec", _samples(5, seed=k))
        paths.append(tmp_path / f"{k}.rec")
    here = recordio(paths)
    assert capfd.readouterr().err == ""  # quick: no progress bar
    monkeypatch.setattr("gpuio.formats._files.PROGRESS_DELAY_S", 0.0)
    recordio(paths)
    assert "indexing .rec files" in capfd.readouterr().err  # past the delay: a progress bar
    pooled, report = index_on_a_process_pool(tmp_path, f"formats.recordio({[os.fspath(p) for p in paths]!r})")
    assert report["pool"]  # the files after the first went to processes
    for part in ("file", "offset", "length"):
        assert np.array_equal(getattr(here.extents["record"], part), getattr(pooled.extents["record"], part))
    assert pooled.values["key"].tolist() == here.values["key"].tolist()
    with open(paths[3], "r+b") as f:
        f.write(b"\0\0\0\0")  # the first record's magic
    _, report = index_on_a_process_pool(tmp_path, f"formats.recordio({[os.fspath(p) for p in paths]!r})")
    assert report["pool"] and "bad magic" in report["error"]  # raised in a pool process, naming the file
    assert report["path"] == os.fspath(paths[3])
