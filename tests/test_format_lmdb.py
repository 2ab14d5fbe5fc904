"""formats.lmdb on environments written with the lmdb package."""

from __future__ import annotations

import os

import lmdb as lmdb_pkg
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import gpuio
from checkers import assert_gpu_read_matches_cpu, check_index_or_gpuio_error
from gpuio.errors import DataError, FormatError, StorageError
from gpuio.formats import lmdb

# empty, tiny (leaf page), around the overflow threshold (~2 KiB with 4 KiB pages),
# exactly one and several pages, and large overflow runs
SIZES = [0, 1, 3, 17, 255, 1000, 2000, 2030, 2100, 4080, 4096, 4097, 8192, 12345, 100_000, 1 << 20]


def _write_env(path, items, subdir=True):
    env = lmdb_pkg.open(os.fspath(path), map_size=1 << 28, subdir=subdir)
    with env.begin(write=True) as txn:
        for key, value in items:
            txn.put(key, value)
    env.close()
    return path


def _items(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(f"key-{k:05d}-{n}".encode(), rng.integers(0, 256, n, dtype=np.uint8).tobytes())
            for k, n in enumerate(sizes)]


def _check_against_lmdb(index, env_path, subdir=True):
    env = lmdb_pkg.open(os.fspath(env_path), readonly=True, lock=False, subdir=subdir)
    with env.begin() as txn:
        expected = list(txn.cursor())
    env.close()
    assert len(index) == len(expected)
    batch = gpuio.read(index, np.arange(len(index)), "data")
    data_file = index.files[0]
    raw = open(data_file, "rb").read()
    for i, (key, value) in enumerate(expected):
        assert index.values["key"][i] == key
        assert batch[i].tobytes() == value, f"sample {i} ({len(value)} bytes)"
        ext = index.extent(i, "data")
        assert ext.length == len(value)
        assert raw[ext.offset: ext.offset + ext.length] == value
    return expected


def test_values_of_every_size_read_exactly(tmp_path):
    env = _write_env(tmp_path / "env", _items(SIZES))
    index = lmdb(env)
    assert set(index.fields) == {"key", "data"}
    assert index.files[0] == os.path.join(os.fspath(env), "data.mdb")
    expected = _check_against_lmdb(index, env)
    # index[i] is the same through the convenience path, in key order
    for i in (0, 5, len(SIZES) - 1):
        sample = index[i]
        assert sample == {"data": expected[i][1], "key": expected[i][0]}
    # overflow values start right after a page header, leaf values inside a page
    psize = index.meta["page_size"]
    big = [i for i, (_, v) in enumerate(expected) if len(v) > psize]
    assert big and all(index.extent(i, "data").offset % psize == 16 for i in big)


def test_many_random_records_and_random_batches(tmp_path):
    rng = np.random.default_rng(1)
    sizes = rng.choice([0, 1, 10, 100, 1500, 3000, 5000, 20000], size=1500).tolist()
    env = _write_env(tmp_path / "env", _items(sizes, seed=2))
    index = lmdb(env)
    expected = _check_against_lmdb(index, env)
    rows = rng.permutation(len(index))[:300]
    got = gpuio.read(index, rows, "data")
    assert [g.tobytes() for g in got] == [expected[r][1] for r in rows]


def test_subdir_false_file(tmp_path):
    path = _write_env(tmp_path / "single.lmdb", _items([5, 5000, 0, 70]), subdir=False)
    index = lmdb(path)
    assert index.files[0] == os.fspath(path)
    _check_against_lmdb(index, path, subdir=False)


def test_empty_environment(tmp_path):
    env = _write_env(tmp_path / "env", [])
    index = lmdb(env)
    assert len(index) == 0


def test_save_load_round_trip(tmp_path):
    env = _write_env(tmp_path / "env", _items(SIZES[:8]))
    index = lmdb(env)
    index.save(tmp_path / "lmdb.idx")
    back = gpuio.SampleIndex.load(tmp_path / "lmdb.idx")
    assert back.fields == index.fields and len(back) == len(index)
    for i in range(len(index)):
        assert back[i] == index[i]


def test_index_is_arrays_not_objects(tmp_path):
    env = _write_env(tmp_path / "env", _items([10] * 50))
    index = lmdb(env)
    keys = index.values["key"]
    assert isinstance(keys, gpuio.Ragged) and keys.kind == "bytes" and keys.values.dtype == np.uint8
    assert index.extents["data"].offset.dtype == np.int64


def test_missing_and_not_lmdb(tmp_path):
    with pytest.raises(StorageError, match="cannot read LMDB data file: No such file") as err:
        lmdb(tmp_path / "nope")
    assert err.value.path == str(tmp_path / "nope")
    bogus = tmp_path / "bogus"
    bogus.mkdir()
    (bogus / "data.mdb").write_bytes(b"\x00" * 20000)
    with pytest.raises(FormatError, match="not a readable LMDB environment") as err:
        lmdb(bogus)
    assert err.value.path.endswith("data.mdb") and err.value.offset == 0


def test_path_that_is_not_utf8(tmp_path):
    env_dir = os.path.join(os.fsencode(tmp_path), b"caf\xe9 \xff")  # Latin-1 bytes, not UTF-8
    _write_env(env_dir, _items([10, 5000]))
    path = os.fsdecode(env_dir)  # str with surrogate escapes, as os.listdir gives it
    with pytest.raises(UnicodeEncodeError):
        path.encode("utf-8")
    index = lmdb(path)
    assert index.files[0] == os.path.join(path, "data.mdb")
    _check_against_lmdb(index, env_dir)


def test_empty_or_odd_data_file_names_it(tmp_path):
    env = _write_env(tmp_path / "env", _items([10]))
    os.truncate(env / "data.mdb", 0)
    with pytest.raises(FormatError, match="empty LMDB data file") as err:
        lmdb(env)
    assert err.value.path == str(env / "data.mdb") and err.value.offset == 0
    (tmp_path / "dirs" / "data.mdb").mkdir(parents=True)
    with pytest.raises(DataError, match="must be a regular file, this is a directory") as err:
        lmdb(tmp_path / "dirs")
    assert err.value.path == str(tmp_path / "dirs" / "data.mdb")
    os.mkfifo(tmp_path / "fifo.mdb")
    with pytest.raises(DataError, match="this is a device, FIFO or socket"):
        lmdb(tmp_path / "fifo.mdb")  # must not wait for a writer


def test_truncated_data_file(tmp_path):
    env = _write_env(tmp_path / "env", _items([50_000, 10, 30_000]))
    data = env / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size - 4096)
    with pytest.raises(FormatError, match="truncated LMDB data file") as err:
        lmdb(env)
    assert err.value.offset == size - 4096


@pytest.fixture(scope="module")
def valid_env_bytes(tmp_path_factory):
    path = _write_env(tmp_path_factory.mktemp("lmdb") / "env", _items([0, 4, 100, 3000, 9000, 20, 5000]))
    return (path / "data.mdb").read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=20000))
def test_random_files_raise_only_gpuio_errors(tmp_path, data):
    path = tmp_path / "random.mdb"
    path.write_bytes(data)
    check_index_or_gpuio_error(lambda: lmdb(path), ["data"])


# LMDB does not checksum its pages: a flipped bit in a branch or leaf page can make
# LMDB itself read outside the map (SIGBUS). gpuio checks what it can before LMDB
# touches the pages: the meta pages (flips there are fuzzed) and the file length.
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=1 << 20),
       flips=st.lists(st.tuples(st.integers(0, 8191), st.integers(0, 7)), max_size=6))
@example(cut=0, flips=[(4232, 3)])  # the second meta page's main root: LMDB's own cursor finds no such page
def test_truncations_and_meta_flips_raise_only_gpuio_errors(tmp_path, valid_env_bytes, cut, flips):
    data = bytearray(valid_env_bytes)
    for pos, bit in flips:
        data[pos] ^= 1 << bit
    if cut < len(data) and not flips:
        del data[cut:]
    path = tmp_path / "fuzzed.mdb"
    path.write_bytes(bytes(data))
    check_index_or_gpuio_error(lambda: lmdb(path), ["data"])


@pytest.mark.gpu
def test_gpu_read_matches_cpu(tmp_path):
    env = _write_env(tmp_path / "env", _items(SIZES))
    index = lmdb(env)
    assert_gpu_read_matches_cpu(index, "data")


def test_b_tree_walk_after_updates_deletes_and_growth(tmp_path):
    """Many transactions leave old copies of pages in the file; only the current tree counts.
    Thousands of records make a tree of several levels; keys of one size and of many sizes."""
    rng = np.random.default_rng(3)
    path = tmp_path / "env"
    env = lmdb_pkg.open(os.fspath(path), map_size=1 << 28)
    for round_ in range(6):
        with env.begin(write=True) as txn:
            for k in rng.integers(0, 6000, 3000).tolist():
                key = b"%08d" % k if round_ % 2 else b"v" * (k % 40 + 1) + b"%d" % k
                txn.put(key, rng.integers(0, 256, int(rng.choice([0, 5, 300, 3000, 9000])), dtype=np.uint8).tobytes())
            for k in rng.integers(0, 6000, 500).tolist():
                txn.delete(b"%08d" % k)
    stat = env.stat()
    env.close()
    assert stat["depth"] >= 3 and stat["overflow_pages"] > 0
    index = lmdb(path)
    assert len(_check_against_lmdb(index, path)) == stat["entries"]


def test_main_database_holding_named_databases_is_indexed_as_before(tmp_path):
    """The main database's records that name sub-databases (the B-tree walk leaves
    them to the cursor) are samples whose value is the sub-database's record."""
    path = tmp_path / "env"
    env = lmdb_pkg.open(os.fspath(path), map_size=1 << 26, max_dbs=2)
    db = env.open_db(b"named", dupsort=True)
    with env.begin(write=True, db=db) as txn:
        for k in range(300):
            txn.put(b"k%03d" % (k % 50), b"value %d" % k, dupdata=True)
    with env.begin(write=True) as txn:
        txn.put(b"plain", b"record")
    env.close()
    index = lmdb(path)
    assert [k for k, _ in _check_against_lmdb(index, path)] == [b"named", b"plain"]


def test_progress_bar_only_for_long_indexing(tmp_path, capfd, monkeypatch):
    env = _write_env(tmp_path / "env", _items([10] * 50))
    lmdb(env)
    assert capfd.readouterr().err == ""
    monkeypatch.setattr("gpuio.formats._files.PROGRESS_DELAY_S", 0.0)  # as if it had run for a second
    lmdb(env)
    assert "indexing LMDB" in capfd.readouterr().err
