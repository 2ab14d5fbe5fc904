"""The filetree and numpy formats: labelling rules, header versions, exact bytes, errors."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuio
from gpuio.errors import DataError, FormatError, StorageError
from gpuio.formats import filetree
from gpuio.formats import numpy as npy_format
from gpuio.formats.numpy import parse_npy_header


def _touch(path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


# ---- filetree ------------------------------------------------------------------------

@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "train"
    files = {
        "b/1.jpg": b"b1", "b/0.JPG": b"b0",
        "a/x.jpeg": b"ax", "a/sub/deeper/y.Png": b"ay", "a/notes.txt": b"skip",
        "C/z.webp": b"Cz",  # upper case sorts before lower case, as sorted() does
        "a10/q.jpg": b"q10", "a2/q.jpg": b"q2",  # string order, not natural order
        "empty/readme.md": b"skip",
        "stray.jpg": b"not in a class folder",
    }
    for name, data in files.items():
        _touch(root / name, data)
    return root, files


def test_labels_follow_sorted_class_folders(tree):
    root, files = tree
    index = filetree(root)
    # ImageFolder's rule: classes = sorted(names of the sub-folders of root), label = position
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    assert index.meta["classes"] == classes == ["C", "a", "a10", "a2", "b", "empty"]
    rel = [p.removeprefix(str(root) + "/") for p in index.files]
    # ImageFolder's order: a folder's own files before its sub-folders' (tests/test_format_filetree.py)
    assert rel == ["C/z.webp", "a/x.jpeg", "a/sub/deeper/y.Png", "a10/q.jpg", "a2/q.jpg", "b/0.JPG", "b/1.jpg"]
    labels = index.values["label"].tolist()
    assert labels == [classes.index(r.split("/")[0]) for r in rel]
    for i, r in enumerate(rel):
        s = index[i]
        assert s["data"] == files[r] and s["label"] == labels[i]
    batch = gpuio.read(index, [6, 0, 2])
    assert [b.tobytes() for b in batch] == [files["b/1.jpg"], files["C/z.webp"], files["a/sub/deeper/y.Png"]]


def test_extension_filter_is_case_insensitive(tree):
    root, _ = tree
    only_png = filetree(root, extensions=("PNG",))
    assert [p.rsplit("/", 1)[1] for p in only_png.files] == ["y.Png"]
    assert only_png.values["label"].tolist() == [1]  # class numbering ignores the filter
    txt = filetree(root, extensions=(".TXT", "md"))
    assert sorted(p.rsplit("/", 1)[1] for p in txt.files) == ["notes.txt", "readme.md"]


def test_file_list_keeps_order_and_labels(tree, tmp_path):
    root, files = tree
    lst = tmp_path / "list.txt"
    lst.write_text("b/1.jpg 7\n\na/sub/deeper/y.Png 3\nstray.jpg -1\n")
    index = filetree(root, file_list=lst)
    assert index.values["label"].tolist() == [7, 3, -1]
    assert [index[i]["data"] for i in range(3)] == [files["b/1.jpg"], files["a/sub/deeper/y.Png"],
                                                     files["stray.jpg"]]
    assert "classes" not in index.meta


def test_file_list_errors(tree, tmp_path):
    root, _ = tree
    lst = tmp_path / "list.txt"
    lst.write_text("b/1.jpg 0\nb/0.JPG zero\n")
    with pytest.raises(FormatError, match="line 2") as err:
        filetree(root, file_list=lst)
    assert err.value.path == str(lst) and err.value.offset == len("b/1.jpg 0\n")
    lst.write_text("b/1.jpg 0\nb/missing.jpg 1\n")
    with pytest.raises(DataError, match="line 2") as err:
        filetree(root, file_list=lst)
    assert err.value.path == str(root / "b/missing.jpg")
    with pytest.raises(DataError):
        filetree(root, file_list=tmp_path / "no_list.txt")


def test_empty_or_missing_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no samples") as err:
        filetree(tmp_path / "empty")
    assert err.value.path == str(tmp_path / "empty")
    (tmp_path / "classes_only" / "a").mkdir(parents=True)
    with pytest.raises(DataError, match="no samples"):
        filetree(tmp_path / "classes_only")
    with pytest.raises(DataError, match="not a directory") as err:
        filetree(tmp_path / "nope")
    assert err.value.path == str(tmp_path / "nope")


# ---- numpy ---------------------------------------------------------------------------

def _write(path, arr, version=None) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array(f, arr, version=version, allow_pickle=False)


def _assert_same_array(got, want) -> None:
    """``got`` is what ``np.load`` gives: dtype (field names, itemsize), shape, order, bytes."""
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype and got.dtype.names == want.dtype.names
    assert got.dtype.itemsize == want.dtype.itemsize and got.shape == want.shape
    assert got.flags.f_contiguous == want.flags.f_contiguous and got.flags.c_contiguous == want.flags.c_contiguous
    assert got.tobytes(order="A") == want.tobytes(order="A")
    np.testing.assert_array_equal(got, want)


def test_header_versions_and_layouts(tmp_path):
    rng = np.random.default_rng(0)
    big_dtype = np.dtype([(f"field_{k:04d}", "<f4") for k in range(3000)])  # header > 64 KiB: v2
    v1_dtype = np.dtype([(f"f{k:03d}", "<f4") for k in range(400)])  # v1 header > the first 4 KiB read
    uni_dtype = np.dtype([("größe", "<i2"), ("wert", "<f8")])  # non-latin1 names: v3
    arrays = {
        "v1.npy": (rng.standard_normal((5, 3)).astype(np.float32), (1, 0)),
        "v1big.npy": (np.ones(3, dtype=v1_dtype), (1, 0)),
        "v2.npy": (np.zeros(2, dtype=big_dtype), (2, 0)),
        "v3.npy": (np.array([(1, 2.5), (-3, 4.0)], dtype=uni_dtype), (3, 0)),
        "v2small.npy": (np.arange(6, dtype=">i8").reshape(2, 3), (2, 0)),
        "fortran.npy": (np.asfortranarray(rng.integers(0, 100, (4, 6)).astype(np.uint16)), None),
        "scalar.npy": (np.array(3.25), None),
        "struct.npy": (np.array([(1, b"ab"), (2, b"cd")], dtype=[("id", "<u4"), ("tag", "S2")]), None),
        "bytes.npy": (np.arange(7, dtype=np.uint8), None),
        "empty.npy": (np.zeros((0, 3), dtype=np.float64), None),
    }
    for name, (arr, version) in arrays.items():
        _write(tmp_path / name, arr, version)
    raw = (tmp_path / "v2.npy").read_bytes()
    assert raw[6] == 2 and struct.unpack("<I", raw[8:12])[0] > 65535
    assert (tmp_path / "v3.npy").read_bytes()[6] == 3
    assert struct.unpack("<H", (tmp_path / "v1big.npy").read_bytes()[8:10])[0] > 4096
    index = npy_format(tmp_path)
    names = [os.path.basename(p) for p in index.files]
    assert names == sorted(arrays)
    raw_bytes = gpuio.read(index, np.arange(len(index)))  # gpuio.read keeps the raw bytes
    for i, name in enumerate(names):
        s = index[i]
        _assert_same_array(s["data"], np.load(tmp_path / name, max_header_size=1 << 20))
        assert tuple(s["shape"].tolist()) == arrays[name][0].shape
        assert s["fortran_order"] is (name == "fortran.npy")
        assert raw_bytes[i].tobytes() == arrays[name][0].tobytes(order="A")
        e = index.extent(i)
        assert e.offset + e.length == os.path.getsize(tmp_path / name)
    # one batch: the arrays lie back to back in one buffer, at offsets that do not suit
    # every dtype's alignment (a 7-byte array before an 8-byte-aligned one)
    batch = gpuio.storage.read_fields(index, np.arange(len(index)), ("data",))["data"]
    for name, got in zip(names, batch):
        _assert_same_array(got, np.load(tmp_path / name, max_header_size=1 << 20))
        assert got.flags.aligned, name


def test_fortran_order_comes_back_as_np_load_gives_it(tmp_path):
    """The sample is the Fortran-order array, not its bytes read in C order."""
    want = np.asfortranarray(np.random.default_rng(3).standard_normal((5, 7)))
    np.save(tmp_path / "fortran_f64.npy", want)
    got = npy_format(tmp_path / "fortran_f64.npy")[0]["data"]
    _assert_same_array(got, np.load(tmp_path / "fortran_f64.npy"))
    assert got.flags.f_contiguous and not got.flags.c_contiguous
    np.testing.assert_array_equal(got[:, 1], want[:, 1])


def test_structured_dtype_with_padding(tmp_path):
    """The header's ('', '|V3') padding entry is padding, not a field f1."""
    dtype = np.dtype({"names": ["a", "b", "c"], "formats": ["<i4", "u1", "<f8"],
                      "offsets": [0, 4, 8], "itemsize": 16})
    want = np.zeros(4, dtype=dtype)
    want["a"], want["b"], want["c"] = [1, -2, 3, 4], [5, 6, 7, 8], [0.5, 1.5, -2.5, 9.0]
    np.save(tmp_path / "padded.npy", want)
    assert b"('', '|V3')" in (tmp_path / "padded.npy").read_bytes()[:128]
    index = npy_format(tmp_path / "padded.npy")
    got = index[0]["data"]
    _assert_same_array(got, np.load(tmp_path / "padded.npy"))
    assert got.dtype.names == ("a", "b", "c") and got.dtype.itemsize == 16
    np.testing.assert_array_equal(got["c"], want["c"])
    index.save(tmp_path / "padded.gpuio")  # the dtype survives a saved index
    _assert_same_array(gpuio.SampleIndex.load(tmp_path / "padded.gpuio")[0]["data"], want)


def test_loader_stacks_arrays_and_keeps_ragged_lists(tmp_path, device):
    """One [B, ...] array per batch when shapes and dtypes agree, on the
    loader's device (on a GPU the bytes land there and are viewed there); lists of
    arrays otherwise."""
    from conftest import to_host

    rng = np.random.default_rng(5)
    (tmp_path / "same").mkdir()
    (tmp_path / "ragged").mkdir()
    same = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(6)]
    same[2] = np.asfortranarray(same[2])  # order does not change the values in a batch
    for k, a in enumerate(same):
        np.save(tmp_path / "same" / f"{k}.npy", a)
    ragged = [np.arange(k + 1, dtype=np.int16) * k for k in range(5)]
    for k, a in enumerate(ragged):
        np.save(tmp_path / "ragged" / f"{k}.npy", a)
    for output in ("numpy", "torch"):
        loader = gpuio.Loader(npy_format(tmp_path / "same"), 4, device=device, output=output, threads=1)
        assert loader._dev_fields == (("data",) if device == "cuda" else ())  # storage -> GPU, no host copy
        batches = list(loader)
        assert [len(b["index"]) for b in batches] == [4, 2]
        data = batches[0]["data"]
        if output == "torch":
            assert data.device.type == device and data.dtype.is_floating_point
            data = data.cpu().numpy()
        else:
            assert (device == "cuda") == hasattr(data, "__cuda_array_interface__")
            data = to_host(data)
        assert data.shape == (4, 3, 4) and data.dtype == np.float32
        np.testing.assert_array_equal(data, np.stack(same[:4]))
        np.testing.assert_array_equal(to_host(batches[1]["data"]) if output == "numpy"
                                      else batches[1]["data"].cpu().numpy(), np.stack(same[4:]))
    batch = next(iter(gpuio.Loader(npy_format(tmp_path / "ragged"), 5, device=device, output="numpy")))
    assert isinstance(batch["data"], list) and len(batch["data"]) == 5
    for got, want in zip(batch["data"], ragged):
        _assert_same_array(to_host(got), want)


@pytest.mark.parametrize("descr", ["()", "('<f4',)", "[()]", "[('a',)]", "[1]", "[(1, '<f4')]",
                                   "[('a', '<f4', (-1,))]", "[('a', '<f4'), ('a', '<f4')]", "{}", "'V0'",
                                   "'O'", "[('a', 'O')]", "(('<f4', (2,)), (3,))", "'nope'"])
def test_odd_header_descrs_raise_format_errors(descr):
    text = ("{'descr': %s, 'fortran_order': False, 'shape': (2,), }" % descr).encode()
    with pytest.raises(FormatError) as err:
        parse_npy_header(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text, "odd.npy")
    assert err.value.path == "odd.npy" and err.value.offset == 10


def test_rows_reads_only_those_bytes(tmp_path):
    arr = np.arange(10 * 7, dtype="<i4").reshape(10, 7)
    _write(tmp_path / "a.npy", arr)
    full = npy_format(tmp_path / "a.npy")
    part = npy_format(tmp_path / "a.npy", rows=slice(3, 6))
    assert part.extent(0).offset == full.extent(0).offset + 3 * 7 * 4
    assert part.extent(0).length == 3 * 7 * 4
    _assert_same_array(part[0]["data"], arr[3:6])
    assert part[0]["shape"].tolist() == [3, 7]
    _assert_same_array(npy_format(tmp_path / "a.npy", rows=slice(8, 100))[0]["data"], arr[8:])
    _assert_same_array(npy_format(tmp_path / "a.npy", rows=slice(-2, None))[0]["data"], arr[-2:])
    with pytest.raises(FormatError, match="step"):
        npy_format(tmp_path / "a.npy", rows=slice(0, 6, 2))
    _write(tmp_path / "f.npy", np.asfortranarray(arr))
    with pytest.raises(FormatError, match="C-order"):
        npy_format(tmp_path / "f.npy", rows=slice(0, 2))


def test_bad_files(tmp_path):
    _write(tmp_path / "good.npy", np.arange(100, dtype=np.float64))
    raw = (tmp_path / "good.npy").read_bytes()
    hlen = struct.unpack("<H", raw[8:10])[0]
    cases = {
        "magic.npy": (b"\x93NUMPX" + raw[6:], "bad magic", 0),
        "version.npy": (raw[:6] + b"\x07\x00" + raw[8:], "unsupported .npy version", 6),
        "header.npy": (raw[:10] + b"{'descr': '<f8', " + b" " * (hlen - 17) + raw[10 + hlen:], "malformed", 10),
        "short_header.npy": (raw[:40], "truncated .npy header", 40),
        "short_data.npy": (raw[:10 + hlen + 100], "runs past the end", 10 + hlen + 100),
        "tiny.npy": (raw[:5], "bad magic", 0),
    }
    for name, (data, match, offset) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(FormatError, match=match) as err:
            npy_format(path)
        assert err.value.path == str(path) and err.value.offset == offset, name
    (tmp_path / "nothing_here").mkdir()
    with pytest.raises(DataError, match="no .npy files"):
        npy_format(tmp_path / "nothing_here")
    with pytest.raises(DataError):
        npy_format([tmp_path / "missing.npy"])


@settings(max_examples=200, deadline=None)
@given(head=st.one_of(st.binary(max_size=200),
                      st.binary(max_size=200).map(lambda b: b"\x93NUMPY" + b),
                      st.tuples(st.sampled_from([1, 2, 3]), st.text(max_size=120)).map(
                          lambda t: b"\x93NUMPY" + bytes([t[0], 0]) + (
                              struct.pack("<H", len(t[1].encode())) if t[0] == 1
                              else struct.pack("<I", len(t[1].encode()))) + t[1].encode())))
def test_parse_npy_header_raises_only_format_errors(head):
    try:
        dtype, shape, fortran, start = parse_npy_header(head, "x.npy")
    except FormatError as err:
        assert err.path == "x.npy"
        return
    assert isinstance(dtype, np.dtype) and all(d >= 0 for d in shape) and start <= len(head)


def test_npy_fifo_directory_and_missing_name_the_path(tmp_path):
    os.mkfifo(tmp_path / "fifo.npy")
    with pytest.raises(DataError, match="a .npy file must be a regular file, this is a device, FIFO") as err:
        npy_format(tmp_path)  # found by the directory walk; must not wait for a writer
    assert err.value.path == str(tmp_path / "fifo.npy")
    (tmp_path / "dir.npy").mkdir()
    with pytest.raises(DataError, match="this is a directory") as err:
        npy_format([tmp_path / "dir.npy"])
    assert err.value.path == str(tmp_path / "dir.npy")
    with pytest.raises(StorageError, match="No such file") as err:
        npy_format([tmp_path / "missing.npy"])
    assert err.value.path == str(tmp_path / "missing.npy")
