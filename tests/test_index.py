"""SampleIndex persistence, concat, take and range checks, on real files."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

import gpuio
from gpuio.errors import ConfigError, FormatError, OutOfRangeError, StorageError
from gpuio.index import Extents, PathTable, Ragged, SampleIndex, concat, register_parser


class SplitParser:
    """Record = one length byte, then a head of that length, then a tail."""

    name = "test-split"
    fields = ("head", "tail")

    def __init__(self, source: str = "record") -> None:
        self.source = source

    def config(self) -> dict[str, Any]:
        return {"source": self.source}

    def parse(self, records, samples, paths, offsets):
        heads = [r[1: 1 + int(r[0])] for r in records]
        tails = [r[1 + int(r[0]):] for r in records]
        return {"head": heads, "tail": tails}


register_parser("test-split", SplitParser)


def _shard(dir_, name: str, n: int, seed: int, root: bool = True) -> tuple[SampleIndex, list[dict]]:
    """A shard of ``n`` samples in two data files, with every kind of field."""
    rng = np.random.default_rng(seed)
    dir_.mkdir(parents=True, exist_ok=True)
    blobs = [bytearray(), bytearray()]
    file, offset, length, rec_off, rec_len, expect = [], [], [], [], [], []
    for i in range(n):
        f = i % 2
        data = rng.integers(0, 256, int(rng.integers(0, 50)), dtype=np.uint8).tobytes()
        head = bytes(rng.integers(0, 256, i % 4, dtype=np.uint8))
        record = bytes([len(head)]) + head + b"tail%d" % i
        file.append(f)
        offset.append(len(blobs[f]))
        length.append(len(data))
        blobs[f] += data
        rec_off.append(len(blobs[f]))
        rec_len.append(len(record))
        blobs[f] += record
        expect.append({"data": data, "record": record, "head": head, "tail": b"tail%d" % i,
                       "label": seed * 100 + i, "xy": [i * 0.5, -i], "boxes": rng.random((i % 3, 4), dtype=np.float32),
                       "blob": bytes([i]) * (i % 5), "key": f"{name}/ключ{i}" if i % 2 else "",
                       "flag": bool(i % 2)})
    names = [f"{name}-0.bin", f"{name}-1.bin"]
    for nm, b in zip(names, blobs):
        (dir_ / nm).write_bytes(bytes(b))
    files = PathTable.from_paths(names, root=str(dir_)) if root else PathTable.from_paths(
        [str(dir_ / nm) for nm in names])
    index = SampleIndex(
        files,
        {"data": Extents(np.array(file), np.array(offset), np.array(length)),
         "record": Extents(np.array(file), np.array(rec_off), np.array(rec_len))},
        {"label": np.array([e["label"] for e in expect], dtype=np.int64),
         "xy": np.array([e["xy"] for e in expect], dtype=np.float32),
         "flag": np.array([e["flag"] for e in expect]),
         "boxes": Ragged.from_list([e["boxes"] for e in expect], dtype=np.float32, row_shape=(4,)),
         "blob": Ragged.from_list([e["blob"] for e in expect], kind="bytes"),
         "key": Ragged.from_list([e["key"] for e in expect], kind="str")},
        parser=SplitParser(),
        meta={"format": "test", "shard": name},
    )
    return index, expect


def _assert_sample(got: dict, want: dict) -> None:
    assert got["data"] == want["data"] and got["record"] == want["record"]
    assert bytes(got["head"]) == want["head"] and bytes(got["tail"]) == want["tail"]
    assert got["label"] == want["label"]
    np.testing.assert_array_equal(got["xy"], np.float32(want["xy"]))
    np.testing.assert_array_equal(got["boxes"], want["boxes"])
    assert got["boxes"].shape == (len(want["boxes"]), 4) and got["boxes"].dtype == np.float32
    assert got["blob"] == want["blob"] and got["key"] == want["key"] and got["flag"] == want["flag"]


def test_fields_and_reads(tmp_path):
    index, expect = _shard(tmp_path / "a", "a", 9, 1)
    assert len(index) == 9
    assert index.fields == ("data", "record", "label", "xy", "flag", "boxes", "blob", "key", "head", "tail")
    for i, want in enumerate(expect):
        _assert_sample(index[i], want)
    _assert_sample(index[-1], expect[-1])
    assert index.nbytes("data") == sum(len(e["data"]) for e in expect)


def test_save_load_round_trip_every_field_kind(tmp_path):
    index, expect = _shard(tmp_path / "a", "a", 9, 1)
    path = tmp_path / "a.index"  # no .npz suffix is added
    index.save(path)
    assert path.exists() and not (tmp_path / "a.index.npz").exists()
    back = SampleIndex.load(path)
    assert back.fields == index.fields and back.meta == index.meta and back.files == index.files
    assert isinstance(back.parser, SplitParser) and back.parser.config() == {"source": "record"}
    for n in index.extents:
        for a in ("file", "offset", "length"):
            np.testing.assert_array_equal(getattr(back.extents[n], a), getattr(index.extents[n], a))
    for n, col in index.values.items():
        if isinstance(col, Ragged):
            assert back.values[n].kind == col.kind
            np.testing.assert_array_equal(back.values[n].values, col.values)
            np.testing.assert_array_equal(back.values[n].offsets, col.offsets)
        else:
            assert back.values[n].dtype == col.dtype
            np.testing.assert_array_equal(back.values[n], col)
    for i, want in enumerate(expect):
        _assert_sample(back[i], want)


def test_parserless_and_value_only_indexes_round_trip(tmp_path):
    index, expect = _shard(tmp_path / "a", "a", 5, 2)
    plain = SampleIndex(index.files, {"data": index.extents["data"]}, {"key": index.values["key"]})
    plain.save(tmp_path / "plain.idx")
    back = SampleIndex.load(tmp_path / "plain.idx")
    assert back.parser is None and back.fields == ("data", "key")
    assert [back[i]["data"] for i in range(5)] == [e["data"] for e in expect]
    values_only = SampleIndex([], values={"label": np.arange(4), "e": Ragged.from_list([[], [1], [], [2, 3]])})
    values_only.save(tmp_path / "v.idx")
    back = SampleIndex.load(tmp_path / "v.idx")
    assert len(back) == 4 and len(back.files) == 0
    assert back[3]["e"].tolist() == [2, 3] and back[2]["e"].tolist() == [] and back[1]["label"] == 1


def test_concat_shifts_file_ids_and_ragged_offsets(tmp_path):
    a, ea = _shard(tmp_path / "a", "a", 5, 1)
    b, eb = _shard(tmp_path / "b", "b", 4, 2)  # a different root
    c, ec = _shard(tmp_path / "a", "c", 3, 3)  # the same root as a
    both = concat([a, b, c])
    assert len(both) == 12 and len(both.files) == 6
    assert list(both.files) == [*a.files, *b.files, *c.files]
    np.testing.assert_array_equal(both.extents["data"].file,
                                  np.concatenate([a.extents["data"].file, b.extents["data"].file + 2,
                                                  c.extents["data"].file + 4]))
    boxes = both.values["boxes"]
    assert boxes.offsets[5] == a.values["boxes"].offsets[-1]
    assert boxes.offsets[-1] == sum(len(x.values["boxes"].values) for x in (a, b, c))
    for i, want in enumerate(ea + eb + ec):
        _assert_sample(both[i], want)
    same_root = concat([a, c])
    assert same_root.files.root == a.files.root and list(same_root.files) == [*a.files, *c.files]
    a.save(tmp_path / "a.idx")
    b.save(tmp_path / "b.idx")
    from_files = concat([tmp_path / "a.idx", str(tmp_path / "b.idx")])
    for i, want in enumerate(ea + eb):
        _assert_sample(from_files[i], want)
    assert gpuio.concat is concat and gpuio.formats.concat is concat


def test_concat_errors(tmp_path):
    a, _ = _shard(tmp_path / "a", "a", 3, 1)
    with pytest.raises(ConfigError):
        concat([])
    other = SampleIndex(a.files, {"data": a.extents["data"]})
    with pytest.raises(ConfigError, match="different fields"):
        concat([a, other])
    no_parser = SampleIndex(a.files, a.extents, a.values)
    with pytest.raises(ConfigError, match="different parsers"):
        concat([a, no_parser])


def test_take(tmp_path):
    index, expect = _shard(tmp_path / "a", "a", 8, 4)
    rows = [7, 0, 3, 3, -1]
    sub = index.take(rows)
    assert len(sub) == 5 and sub.files is index.files
    for i, r in enumerate(rows):
        _assert_sample(sub[i], expect[r])
    assert len(index.take([])) == 0
    with pytest.raises(OutOfRangeError):
        index.take([0, 8])
    with pytest.raises(OutOfRangeError):
        index.take([-9])


def test_out_of_range(tmp_path):
    index, _ = _shard(tmp_path / "a", "a", 4, 5)
    for bad in (4, -5, 100):
        with pytest.raises(OutOfRangeError, match=f"sample {bad}"):
            index[bad]
        with pytest.raises(OutOfRangeError):
            index.extent(bad)
        with pytest.raises(OutOfRangeError):
            gpuio.read(index, [0, bad])
    with pytest.raises(OutOfRangeError):
        index.files[2]
    with pytest.raises(ConfigError, match="byte fields"):
        index.extent(0, "label")
    with pytest.raises(ConfigError):
        SampleIndex(index.files, {"data": Extents([0, 2], [0, 0], [1, 1])})  # file id 2 of 2 files
    with pytest.raises(ConfigError, match="differ in sample count"):
        SampleIndex(index.files, {"data": index.extents["data"]}, {"label": np.arange(5)})


def test_load_of_a_non_index_file(tmp_path):
    cases = {
        "random.idx": np.random.default_rng(0).integers(0, 256, 1000, dtype=np.uint8).tobytes(),
        "empty.idx": b"",
        "json.idx": json.dumps({"version": 1}).encode(),
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    np.savez(tmp_path / "plain.npz", a=np.arange(3))
    index, _ = _shard(tmp_path / "a", "a", 2, 6)
    index.save(tmp_path / "good.idx")
    with np.load(tmp_path / "good.idx") as z:
        arrays = dict(z)
    spec = json.loads(arrays["spec"].tobytes())
    spec["version"] = 99
    arrays["spec"] = np.frombuffer(json.dumps(spec).encode(), dtype=np.uint8)
    np.savez(tmp_path / "future.npz", **arrays)
    arrays["spec"] = np.frombuffer(json.dumps({"version": 1}).encode(), dtype=np.uint8)
    np.savez(tmp_path / "incomplete.npz", **arrays)
    arrays["spec"] = np.frombuffer(b"[1]", dtype=np.uint8)
    np.savez(tmp_path / "list.npz", **arrays)
    for name in [*cases, "plain.npz", "future.npz", "incomplete.npz", "list.npz", "missing.idx"]:
        with pytest.raises(StorageError if name == "missing.idx" else FormatError) as err:
            SampleIndex.load(tmp_path / name)
        assert err.value.path == str(tmp_path / name)


@pytest.mark.parametrize("kind", ["array", "bytes", "str"])
def test_ragged_rows_equal_one_by_one(kind):
    rng = np.random.default_rng(4)
    if kind == "array":
        items = [rng.standard_normal((int(rng.integers(0, 4)), 4)).astype(np.float32) for _ in range(30)]
        col = Ragged.from_list(items, dtype=np.float32, row_shape=(4,))
    elif kind == "bytes":
        col = Ragged.from_list([rng.bytes(int(rng.integers(0, 9))) for _ in range(30)], kind="bytes")
    else:
        col = Ragged.from_list(["ä" * int(rng.integers(0, 5)) + str(i) for i in range(30)], kind="str")
    rows = np.array([29, 0, 5, 5, 17, 3])
    got, want = col.rows(rows), [col[i] for i in rows.tolist()]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if kind == "array":
            np.testing.assert_array_equal(g, w)
            assert g.shape == w.shape
        else:
            assert g == w and type(g) is type(w)
    assert col.rows(np.array([], dtype=np.int64)) == []


def test_load_of_an_index_whose_tables_do_not_fit_is_a_format_error(tmp_path):
    """The C read loops take each path from the file table's offsets without a bound: a
    saved index whose offsets run past the path blob, or whose extents name files past
    the table, is refused at load, naming the file."""
    index, _ = _shard(tmp_path / "a", "a", 2, 6)
    index.save(tmp_path / "good.idx")
    with np.load(tmp_path / "good.idx") as z:
        good = dict(z)
    bad_offsets = good["files.offsets"].copy()
    bad_offsets[1] = len(good["files.blob"]) + 1_000_000
    bad_ids = good["e.data.file"].copy()
    bad_ids[0] = len(good["files.offsets"]) + 5
    for name, key, value in [("offsets.npz", "files.offsets", bad_offsets), ("ids.npz", "e.data.file", bad_ids)]:
        np.savez(tmp_path / name, **{**good, key: value})
        with pytest.raises(FormatError) as err:
            SampleIndex.load(tmp_path / name)
        assert err.value.path == str(tmp_path / name)
