"""The C header walk of tar shards (``formats/_tar.c``) against the module's full Python
parser, which indexes what the walk declines and reports every bad header: on tars of
every writer and on corrupted ones, both give the same index or the same error."""

from __future__ import annotations

import importlib
import os
import tarfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuio
from gpuio.errors import GpuioError
from gpuio.formats import webdataset

from checkers import write_tar

FIELDS = ("jpg", "cls", "seg.png")
_tar = importlib.import_module("gpuio.formats._tar")
_module = importlib.import_module("gpuio.formats.webdataset")  # the name webdataset is the function


class _Declines:
    """Stands in for the C module: declines every tar, so the full parser indexes it."""

    @staticmethod
    def shard(*args):
        return None


def _members(n, long_names):
    rng = np.random.default_rng(n)
    out = []
    for k in range(n):
        folder = ("deep/" * 25 if long_names and k % 3 == 0 else "") + ("ünï/" if long_names and k % 4 == 1 else "s/")
        key = f"{folder}{k:05d}"
        out.append((f"{key}.jpg", rng.integers(0, 256, int(rng.integers(0, 2000)), dtype=np.uint8).tobytes()))
        out.append((f"{key}.CLS" if k % 5 == 2 else f"{key}.cls", str(k % 10).encode()))
        if k % 2:
            out.append((f"{key}.seg.png", b"seg" * k))
        if k % 7 == 3:
            out.append((f"{folder}.hidden", b"x"))  # a base name starting with a dot: not a member
            out.append((f"{folder}nodot", b"y"))
            out.append((f"{folder}dir{k}", None))
    return out


def _outcome(paths, skip):
    """The index as comparable lists, or the error's type and message."""
    try:
        index = webdataset(paths, fields=FIELDS, missing="skip" if skip else "error", decode=False)
    except GpuioError as exc:
        return type(exc).__name__, str(exc)
    return ({f: (e.file.tolist(), e.offset.tolist(), e.length.tolist()) for f, e in index.extents.items()},
            index.values["__key__"].rows(np.arange(len(index))))


def _assert_walk_equals_parser(paths, monkeypatch, skip=True):
    walked = _outcome(paths, skip)
    with monkeypatch.context() as m:
        m.setattr(_module, "_tar", _Declines)
        parsed = _outcome(paths, skip)
    assert walked == parsed
    return walked


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_walk_indexes_every_writer_s_tars_as_the_parser(tmp_path, monkeypatch, fmt):
    long_names = fmt != tarfile.USTAR_FORMAT
    path = write_tar(tmp_path / "a.tar", _members(60, long_names), fmt)
    walked = _assert_walk_equals_parser([path], monkeypatch)
    assert len(walked[1]) == 60 - 30  # every odd sample has all three fields
    with open(path, "rb") as f:  # the C walk itself took these: long names, pax records, non-ASCII keys
        got = _tar.shard(f.fileno(), os.path.getsize(path), tuple(x.encode() for x in FIELDS), True)
    assert got is not None and got[3] == 30
    for skip in (True, False):
        _assert_walk_equals_parser([path], monkeypatch, skip)  # without skip: the parser's error


def test_walk_declines_what_only_the_parser_reads(tmp_path):
    path = write_tar(tmp_path / "a.tar", _members(6, False), tarfile.USTAR_FORMAT)
    raw = bytearray(path.read_bytes())
    fields = tuple(x.encode() for x in FIELDS)

    def walk(data):
        path.write_bytes(bytes(data))
        with open(path, "rb") as f:
            return _tar.shard(f.fileno(), len(data), fields, True)

    assert walk(raw) is not None
    assert walk(raw[:700]) is None  # cut inside the first member's data
    bad = raw.copy()
    bad[124:136] = b"0000000001x\0"  # a size field that is no octal number
    assert walk(bad) is None
    bad = raw.copy()
    bad[148:156] = b"0000000\0"  # a checksum that does not match
    assert walk(bad) is None
    with pytest.raises(ValueError, match="fields"):
        _tar.shard(0, 0, (), True)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
       edits=st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 20_000)), skip=st.booleans())
def test_corrupted_tars_give_the_parser_s_index_or_error(tmp_path, monkeypatch, fmt, edits, cut, skip):
    raw = bytearray(write_tar(tmp_path / "t.tar", _members(8, fmt != tarfile.USTAR_FORMAT), fmt).read_bytes())
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    path = tmp_path / "c.tar"
    path.write_bytes(bytes(raw[:cut]) if cut is not None else bytes(raw))
    _assert_walk_equals_parser([str(path)], monkeypatch, skip)


def test_walk_reads_the_bytes_of_each_member(tmp_path):
    members = _members(20, True)
    path = write_tar(tmp_path / "a.tar", members, tarfile.GNU_FORMAT)
    index = webdataset(path, fields=("jpg",), missing="skip")
    payload = {name: data for name, data in members if name.endswith(".jpg")}
    assert [index[i]["jpg"] for i in range(len(index))] == [payload[k + ".jpg"] for k in
                                                            (index[i]["__key__"] for i in range(len(index)))]
    assert gpuio.read(index, [3], "jpg")[0].tobytes() == index[3]["jpg"]


def test_more_fields_than_the_walk_takes_are_indexed_by_the_parser(tmp_path):
    fields = tuple(f"f{k}" for k in range(70))  # the C walk takes at most 64
    members = [(f"s{j}.{f}", f"{j}{f}".encode()) for j in range(3) for f in fields]
    write_tar(tmp_path / "wide.tar", members, tarfile.USTAR_FORMAT)
    index = webdataset(tmp_path / "wide.tar", fields=fields, decode=False)
    assert len(index) == 3 and index[2]["f69"] == b"2f69" and index[0]["f0"] == b"0f0"
