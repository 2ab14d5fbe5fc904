"""formats.webdataset on tars written with the tarfile module."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuio
from gpuio.errors import ConfigError, DataError, FormatError, StorageError
from gpuio.formats import webdataset

from checkers import check_index_or_gpuio_error, index_on_a_process_pool, write_tar


def _samples(n, start=0, prefix="shard/"):
    rng = np.random.default_rng(start)
    out = []
    for k in range(start, start + n):
        key = f"{prefix}{k:06d}"
        out.append((f"{key}.jpg", rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()))
        out.append((f"{key}.cls", str(k % 10).encode()))
        out.append((f"{key}.seg.png", f"seg{k}".encode() * (k % 3)))
    return out


def test_fields_keys_and_exact_bytes(tmp_path):
    members = [("shard", None), *_samples(20)]
    tar = write_tar(tmp_path / "a.tar", members)
    index = webdataset(tar, fields=("jpg", "cls", "seg.png"))
    assert len(index) == 20
    assert set(index.fields) == {"jpg", "cls", "seg.png", "__key__"}
    payload = dict(m for m in members if m[1] is not None)
    for i in range(20):
        s = index[i]
        key = f"shard/{i:06d}"
        assert s["__key__"] == key
        assert s["jpg"] == payload[key + ".jpg"]
        assert s["cls"] == int(payload[key + ".cls"])  # decoded, as the webdataset package does
        assert s["seg.png"] == payload[key + ".seg.png"]
    # extents point into the tar itself
    raw = (tmp_path / "a.tar").read_bytes()
    e = index.extent(7, "jpg")
    assert e.file == str(tar) and raw[e.offset: e.offset + e.length] == payload["shard/000007.jpg"]
    batch = gpuio.read(index, [19, 0, 5], "jpg")
    assert [b.tobytes() for b in batch] == [payload[f"shard/{k:06d}.jpg"] for k in (19, 0, 5)]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_long_names_and_formats(tmp_path, fmt):
    deep = "d" * 60 + "/" + "e" * 60 + "/"  # > 100 bytes: GNU longname / pax path / ustar prefix
    members = [(f"{deep}x{k}.txt", f"text {k}".encode()) for k in range(3)]
    if fmt != tarfile.USTAR_FORMAT:
        members.append(("ü/" + "k" * 120 + ".txt", "unicode ✓".encode()))
    tar = write_tar(tmp_path / "a.tar", members, fmt)
    index = webdataset(tar, fields=("txt",))
    assert [index[i]["__key__"] for i in range(len(index))] == [m[0].rsplit(".", 1)[0] for m in members]
    assert [index[i]["txt"] for i in range(len(index))] == [m[1].decode() for m in members]


def _decodable_samples(n):
    rng = np.random.default_rng(9)
    members = []
    for k in range(n):
        buf = io.BytesIO()
        np.save(buf, rng.standard_normal((2, 3)).astype(np.float32) * k)
        ragged = io.BytesIO()
        np.save(ragged, np.arange(k + 1, dtype=np.int16))
        members += [(f"s/{k:04d}.jpg", rng.integers(0, 256, 50 + k, dtype=np.uint8).tobytes()),
                    (f"s/{k:04d}.cls", f"{k % 4}".encode()),
                    (f"s/{k:04d}.cls2", f" {-k}\n".encode()),  # int() takes blanks, as in the package
                    (f"s/{k:04d}.index", str(10 ** 12 + k).encode()),
                    (f"s/{k:04d}.txt", f"caption {k} ✓".encode()),
                    (f"s/{k:04d}.json", json.dumps({"k": k, "tags": ["a"] * k}).encode()),
                    (f"s/{k:04d}.npy", buf.getvalue()),
                    (f"s/{k:04d}.seq.npy", ragged.getvalue()),
                    (f"s/{k:04d}.seg.png", b"png" * k)]
    return members


DECODED = ("jpg", "cls", "cls2", "index", "txt", "json", "npy", "seq.npy", "seg.png")


def test_decoded_fields_match_the_webdataset_package(tmp_path):
    """The common extensions decode as webdataset's default decoders
    decode them; undeclared extensions stay bytes."""
    import webdataset as wds  # the reference reader (test extra)
    tar = write_tar(tmp_path / "d.tar", _decodable_samples(7))
    index = webdataset(tar, fields=DECODED)
    ref = list(wds.WebDataset(os.fspath(tar), shardshuffle=False).decode())
    assert len(ref) == len(index) == 7
    for i, want in enumerate(ref):
        got = index[i]
        assert got["__key__"] == want["__key__"]
        for field in DECODED:
            if field in ("npy", "seq.npy"):
                assert got[field].dtype == want[field].dtype
                np.testing.assert_array_equal(got[field], want[field])
            else:
                assert type(got[field]) is type(want[field]) and got[field] == want[field], field
    raw = webdataset(tar, fields=DECODED, decode=False)
    assert raw[3]["cls"] == b"3" and raw[3]["txt"] == "caption 3 ✓".encode()
    assert [b.tobytes() for b in gpuio.read(index, [3], "cls")] == [b"3"]  # gpuio.read: bytes


def test_loader_stacks_decoded_labels_and_arrays(tmp_path, device):
    """Ints become one int64 label array on the loader's device, same-shape npy arrays
    one [B, ...] array; str, JSON objects, ragged arrays and bytes stay lists."""
    from conftest import to_host

    tar = write_tar(tmp_path / "d.tar", _decodable_samples(7))
    index = webdataset(tar, fields=DECODED)
    fields = [f for f in DECODED if f != "index"]  # the Loader's own "index" field takes that name
    batches = list(gpuio.Loader(index, 4, fields=fields, device=device, output="numpy", threads=1))
    b = batches[0]
    assert to_host(b["cls"]).dtype == np.int64 and to_host(b["cls"]).tolist() == [0, 1, 2, 3]
    assert to_host(b["index"]).tolist() == [0, 1, 2, 3]
    assert to_host(b["cls2"]).tolist() == [0, -1, -2, -3]
    assert to_host(b["npy"]).shape == (4, 2, 3)
    np.testing.assert_array_equal(to_host(b["npy"])[2], index[2]["npy"])
    assert b["txt"] == [f"caption {k} ✓" for k in range(4)]
    assert b["json"][3] == {"k": 3, "tags": ["a"] * 3}
    assert [to_host(a).tolist() for a in b["seq.npy"]] == [list(range(k + 1)) for k in range(4)]
    assert isinstance(b["jpg"], list) and to_host(b["jpg"][1]).tobytes() == index[1]["jpg"]
    torch_batch = next(iter(gpuio.Loader(index, 4, fields=fields, device=device, output="torch", threads=1)))
    assert torch_batch["cls"].device.type == device and torch_batch["cls"].tolist() == [0, 1, 2, 3]
    assert str(torch_batch["index"].dtype) == "torch.int64"


def test_undecodable_value_names_tar_sample_and_offset(tmp_path):
    tar = write_tar(tmp_path / "a.tar", [("0.cls", b"1"), ("1.cls", b"one"), ("2.json", b"{"), ("3.pyd", b"x")])
    index = webdataset(tar, fields=("cls",), missing="skip")
    assert index[0]["cls"] == 1
    with pytest.raises(FormatError, match="cannot decode 'cls' as int") as err:
        index[1]
    assert err.value.path == str(tar) and err.value.sample == 1
    assert err.value.offset == index.extent(1, "cls").offset
    with pytest.raises(gpuio.errors.PipelineError, match="cannot decode 'cls'"):
        list(gpuio.Loader(index, 2, output="numpy"))
    with pytest.raises(FormatError, match="cannot decode 'json' as json"):
        webdataset(tar, fields=("json",), missing="skip")[0]
    assert webdataset(tar, fields=("pyd",), missing="skip")[0]["pyd"] == b"x"  # pickles stay bytes, on purpose


def test_key_field_split_rules(tmp_path):
    tar = write_tar(tmp_path / "a.tar", [
        ("a.b/c/000123.seg.png", b"seg"),  # dots in folders do not count
        ("a.b/c/000123.JPG", b"jpg"),  # extensions are lowercased
        ("a.b/c/.hidden", b"skip"),  # dot files and names without a dot are skipped
        ("a.b/c/README", b"skip"),
        ("000124.jpg", b"j2"),
        ("000124.seg.png", b"s2"),
    ])
    index = webdataset(tar, fields=("jpg", "seg.png"))
    assert [index[i]["__key__"] for i in range(2)] == ["a.b/c/000123", "000124"]
    assert [index[i]["seg.png"] for i in range(2)] == [b"seg", b"s2"]
    assert index[0]["jpg"] == b"jpg"


def test_missing_field_error_or_skip(tmp_path):
    members = _samples(5)
    del members[7]  # sample 2 loses its .cls
    tar = write_tar(tmp_path / "a.tar", members)
    with pytest.raises(FormatError, match=r"key 'shard/000002'.*'cls'") as err:
        webdataset(tar)
    assert err.value.path == str(tar)
    raw = tar.read_bytes()
    assert raw[err.value.offset: err.value.offset + 16].startswith(b"shard/000002.jpg")
    index = webdataset(tar, missing="skip")
    assert [index[i]["__key__"] for i in range(len(index))] == [f"shard/{k:06d}" for k in (0, 1, 3, 4)]


def test_several_tars_concatenate_in_order(tmp_path):
    t1 = write_tar(tmp_path / "b.tar", _samples(3, 0))
    t2 = write_tar(tmp_path / "a.tar", _samples(4, 3))
    index = webdataset([t1, t2])
    assert len(index) == 7 and list(index.files) == [str(t1), str(t2)]
    assert index.extents["jpg"].file.tolist() == [0] * 3 + [1] * 4
    assert [index[i]["__key__"] for i in range(7)] == [f"shard/{k:06d}" for k in range(7)]
    payload = dict(_samples(4, 3))
    assert index[5]["jpg"] == payload["shard/000005.jpg"]
    # same as concatenating the per-tar indexes
    both = gpuio.concat([webdataset(t1), webdataset(t2)])
    for f in ("jpg", "cls"):
        np.testing.assert_array_equal(both.extents[f].offset, index.extents[f].offset)
    np.testing.assert_array_equal(both.values["__key__"].values, index.values["__key__"].values)


def test_save_load(tmp_path):
    tar = write_tar(tmp_path / "a.tar", _samples(6))
    index = webdataset(tar, fields=("cls", "jpg"))
    index.save(tmp_path / "a.idx")
    back = gpuio.SampleIndex.load(tmp_path / "a.idx")
    assert [back[i] for i in range(6)] == [index[i] for i in range(6)]


def test_non_utf8_member_name(tmp_path):
    tar = tmp_path / "a.tar"
    with tarfile.open(tar, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tf:
        info = tarfile.TarInfo("caf\xe9.txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(FormatError, match="not UTF-8") as err:
        webdataset(tar, fields=("txt",))
    assert err.value.offset == 0


def test_duplicate_field_in_a_sample(tmp_path):
    tar = write_tar(tmp_path / "a.tar", [("k1.jpg", b"a"), ("k1.cls", b"1"), ("k1.jpg", b"b")])
    with pytest.raises(FormatError, match="'jpg' appears twice") as err:
        webdataset(tar)
    assert err.value.offset == 2 * 1024  # third member's header


def test_compressed_tar_refused(tmp_path):
    tar = write_tar(tmp_path / "a.tar", _samples(2))
    gz = tmp_path / "a.tar.gz"
    gz.write_bytes(gzip.compress(tar.read_bytes()))
    with pytest.raises(FormatError, match="gzip-compressed") as err:
        webdataset(gz)
    assert err.value.path == str(gz) and err.value.offset == 0


def test_truncated_and_bad_headers(tmp_path):
    tar = write_tar(tmp_path / "a.tar", _samples(4))
    raw = tar.read_bytes()
    index = webdataset(tar)
    last = index.extent(3, "jpg")
    # cut inside the last data member, inside a header, and flip a header byte
    cut = tmp_path / "cut.tar"
    cut.write_bytes(raw[: last.offset + last.length // 2])
    with pytest.raises(FormatError, match="truncated") as err:
        webdataset(cut, fields=("jpg",))
    assert err.value.path == str(cut)
    header_at = index.extent(2, "jpg").offset - 512
    cut.write_bytes(raw[: header_at + 100])
    with pytest.raises(FormatError, match="truncated") as err:
        webdataset(cut)
    assert err.value.offset == header_at
    bad = tmp_path / "bad.tar"
    bad.write_bytes(raw[:header_at + 148] + b"9" + raw[header_at + 149:])  # checksum field
    with pytest.raises(FormatError, match="bad tar header") as err:
        webdataset(bad)
    assert err.value.offset == header_at and err.value.path == str(bad)
    bad.write_bytes(b"x" * 1024)
    with pytest.raises(FormatError, match="bad tar header") as err:
        webdataset(bad)
    assert err.value.offset == 0


def test_cut_at_a_header_boundary_is_reported(tmp_path):
    """A tar cut exactly where a member's header starts lacks its
    end-of-archive blocks; that is an error, not a shorter dataset (tarfile itself
    reads such a file silently as 9 of 16 samples)."""
    tar = write_tar(tmp_path / "a.tar", _samples(16))
    assert len(webdataset(tar, fields=("jpg", "cls"))) == 16
    header_at = webdataset(tar).extent(9, "jpg").offset - 512  # sample 9's first member
    cut = tmp_path / "cut.tar"
    cut.write_bytes(tar.read_bytes()[:header_at])
    with tarfile.open(cut) as tf:
        assert len(tf.getmembers()) == 9 * 3
    with pytest.raises(FormatError, match="truncated tar: 0 bytes where a 512-byte header or the "
                                          "end-of-archive blocks should be") as err:
        webdataset(cut, fields=("jpg", "cls"))
    assert err.value.path == str(cut) and err.value.offset == header_at


def test_argument_and_file_errors(tmp_path):
    tar = write_tar(tmp_path / "a.tar", _samples(1))
    with pytest.raises(ConfigError):
        webdataset(tar, missing="drop")
    with pytest.raises(ConfigError):
        webdataset(tar, fields=("jpg", "jpg"))
    with pytest.raises(ConfigError):
        webdataset(tar, fields=("__key__",))
    with pytest.raises(StorageError) as err:
        webdataset(tmp_path / "none.tar")
    assert err.value.path == str(tmp_path / "none.tar")
    with pytest.raises(DataError, match="no samples"):
        webdataset(tar, fields=("npy",), missing="skip")
    empty = write_tar(tmp_path / "empty.tar", [])
    with pytest.raises(DataError, match="no samples"):
        webdataset(empty)


_TEMPLATE = None


def _template() -> bytes:
    global _TEMPLATE
    if _TEMPLATE is None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for name, data in [("k1.txt", b"one"), ("k2.txt", b"two" * 300), ("d/" + "n" * 110 + ".txt", b"3")]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                info.pax_headers = {"comment": "x"}
                tf.addfile(info, io.BytesIO(data))
        _TEMPLATE = buf.getvalue()
    return _TEMPLATE


def _check_or_gpuio_error(path) -> None:
    check_index_or_gpuio_error(lambda: webdataset(path, fields=("txt",), missing="skip"), ("txt",))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=3000))
def test_random_bytes_raise_only_gpuio_errors(tmp_path, data):
    path = tmp_path / "r.tar"
    path.write_bytes(data)
    _check_or_gpuio_error(path)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.integers(0, 10_000)))
def test_corrupted_tars_raise_only_gpuio_errors(tmp_path, edits, cut):
    raw = bytearray(_template())
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    path = tmp_path / "c.tar"
    path.write_bytes(bytes(raw[:cut]) if cut is not None else bytes(raw))
    _check_or_gpuio_error(path)


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_long_and_unicode_names_in_every_tar_format(tmp_path, fmt):
    deep = "d" * 60 + "/" + "e" * 60  # over 100 bytes: GNU long-name or pax path record
    names = [f"{deep}/{'x' * 90}{i:03d}" for i in range(3)]
    if fmt != tarfile.USTAR_FORMAT:
        names.append("dir/caf\u00e9-\u00fcber")  # non-ASCII: a pax record in pax format
    path = tmp_path / "long.tar"
    with tarfile.open(path, "w", format=fmt) as tf:
        for k, name in enumerate(names):
            for ext, data in (("jpg", bytes([k]) * (700 + k)), ("cls", str(k).encode())):
                info = tarfile.TarInfo(f"{name}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    index = webdataset(path)
    assert [index[i]["__key__"] for i in range(len(index))] == names
    assert [index[i]["jpg"] for i in range(len(index))] == [bytes([k]) * (700 + k) for k in range(len(names))]
    with tarfile.open(path) as tf:
        truth = {m.name: (m.offset_data, m.size) for m in tf}
    for i, name in enumerate(names):
        ext = index.extent(i, "jpg")
        assert (ext.offset, ext.length) == truth[f"{name}.jpg"]


def test_header_checksum_mismatch_names_the_header(tmp_path):
    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tf:
        for i in range(3):
            info = tarfile.TarInfo(f"{i:03d}.jpg")
            info.size = 10
            tf.addfile(info, io.BytesIO(b"x" * 10))
    raw = bytearray(path.read_bytes())
    raw[1024 + 5] ^= 0x01  # a name byte of the second member's header
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=r"at byte 1024: bad tar header: checksum mismatch"):
        webdataset(path, fields=("jpg",))


def test_directory_and_fifo_name_the_path(tmp_path):
    (tmp_path / "dir.tar").mkdir()
    os.mkfifo(tmp_path / "fifo.tar")
    with pytest.raises(DataError, match="a tar file must be a regular file, this is a directory") as err:
        webdataset(tmp_path / "dir.tar")
    assert err.value.path == str(tmp_path / "dir.tar")
    with pytest.raises(DataError, match="this is a device, FIFO or socket") as err:
        webdataset(tmp_path / "fifo.tar")  # must not wait for a writer
    assert err.value.path == str(tmp_path / "fifo.tar")


# ---- the header walk against tarfile ------------------------------------------------------

def _expected(paths, fields, skip):
    """What the module docstring says, computed from tarfile's own member list:
    (tar number, key, {field: (data offset, size)}) per kept sample."""
    out = []
    for t, path in enumerate(paths):
        groups = []
        with tarfile.open(path) as tf:
            for m in tf:
                if not m.isreg():
                    continue
                slash = m.name.rfind("/")
                dot = m.name.find(".", slash + 1)
                if dot <= slash + 1:
                    continue
                key, field = m.name[:dot], m.name[dot + 1:].lower()
                if not groups or groups[-1][0] != key:
                    groups.append((key, {}))
                if field in fields:
                    groups[-1][1][field] = (m.offset_data, m.size)
        for key, found in groups:
            if len(found) == len(fields):
                out.append((t, key, found))
            else:
                assert skip, key
    return out


def _odd_members(k, long_names):
    """A sample's members with what a real shard holds besides: folders, files that are
    no sample, upper-case extensions, empty members, and (where asked) long names."""
    deep = ("p" * 70 + "/" + "q" * 50 + "/") if long_names and k % 3 == 0 else "s/"
    data = bytes([k % 256]) * (k * 37 % 1500)
    members = [(f"{deep}{k:05d}.JPG" if k % 4 == 1 else f"{deep}{k:05d}.jpg", data),
               (f"{deep}{k:05d}.cls", str(k % 7).encode())]
    if k % 5 == 0:
        members.insert(0, (f"dir{k}", None))
    if k % 6 == 0:
        members.append((f"{deep}README", b"not a sample"))
        members.append((f"{deep}.hidden", b"nor this"))
    if k % 9 == 0:
        members.pop(1)  # no .cls: left out with missing="skip"
    if k % 11 == 0:
        members.append((f"{deep}{k:05d}.txt", b""))
    return members


@pytest.mark.parametrize("writer", ["webdataset.TarWriter", "ustar", "gnu", "pax"])
def test_index_matches_tarfile_for_every_writer(tmp_path, writer):
    paths = []
    for shard in range(3):
        path = str(tmp_path / f"{writer}-{shard}.tar")
        ks = range(shard * 40, shard * 40 + 40)
        if writer == "webdataset.TarWriter":
            import webdataset as wds

            with wds.TarWriter(path) as sink:
                for k in ks:
                    sample = {"__key__": f"s/{k:05d}", "jpg": bytes([k]) * (k * 37 % 1500), "cls": k % 7}
                    if k % 9 != 0:
                        sink.write(sample)
                    else:
                        sink.write({"__key__": sample["__key__"], "jpg": sample["jpg"], "txt": "no cls"})
        else:
            fmt = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}[writer]
            members = [m for k in ks for m in _odd_members(k, long_names=writer != "ustar" and shard != 1)]
            write_tar(path, members, fmt)
        paths.append(path)
    index = webdataset(paths, fields=("jpg", "cls"), missing="skip")
    expected = _expected(paths, ("jpg", "cls"), skip=True)
    assert len(index) == len(expected) > 80
    for field in ("jpg", "cls"):
        ext = index.extents[field]
        assert ext.file.tolist() == [t for t, _, _ in expected]
        assert ext.offset.tolist() == [found[field][0] for _, _, found in expected]
        assert ext.length.tolist() == [found[field][1] for _, _, found in expected]
    assert [index[i]["__key__"] for i in range(len(index))] == [key for _, key, _ in expected]
    with pytest.raises(FormatError, match="sample has no member for field"):
        webdataset(paths, fields=("jpg", "cls"))


def test_shards_on_a_process_pool_match_one_process(tmp_path, monkeypatch):
    paths = [write_tar(tmp_path / f"{s}.tar", _samples(30, start=30 * s), tarfile.USTAR_FORMAT) for s in range(4)]
    here = webdataset(paths, fields=("jpg", "seg.png"))
    pooled, report = index_on_a_process_pool(tmp_path, f"formats.webdataset({[str(p) for p in paths]!r}, "
                                                       f"fields=('jpg', 'seg.png'))")
    assert report["pool"]
    for field in ("jpg", "seg.png"):
        for part in ("file", "offset", "length"):
            assert np.array_equal(getattr(here.extents[field], part), getattr(pooled.extents[field], part))
    assert [pooled[i]["__key__"] for i in range(len(pooled))] == [here[i]["__key__"] for i in range(len(here))]
    bad = tmp_path / "bad.tar"
    bad.write_bytes(open(paths[1], "rb").read()[:5000])
    _, report = index_on_a_process_pool(tmp_path, f"formats.webdataset({[str(paths[0]), str(bad), str(paths[2])]!r}, "
                                                  f"fields=('jpg',))")
    assert report["pool"] and "truncated" in report["error"]  # raised in a pool process, names its tar
    assert report["path"] == str(bad)


def test_progress_bar_only_for_long_indexing(tmp_path, capfd, monkeypatch):
    paths = [write_tar(tmp_path / f"{s}.tar", _samples(5, start=5 * s)) for s in range(2)]
    webdataset(paths, fields=("jpg",))
    assert capfd.readouterr().err == ""  # quick: silent
    monkeypatch.setattr("gpuio.formats._files.PROGRESS_DELAY_S", 0.0)  # as if it had run for a second
    webdataset(paths, fields=("jpg",))
    assert "indexing tar files" in capfd.readouterr().err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 6000), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.one_of(st.none(), st.integers(0, 6000)))
def test_corrupted_plain_tars_raise_only_gpuio_errors(tmp_path, edits, cut):
    members = [("a/k1.txt", b"one"), ("a/k1.cls", b"1"), ("a/k2.txt", b"two" * 300), ("dir", None)]
    # plain ustar headers only: the bulk header walk reads them
    raw = bytearray(write_tar(tmp_path / "plain.tar", members, tarfile.USTAR_FORMAT).read_bytes())
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    path = tmp_path / "c.tar"
    path.write_bytes(bytes(raw[:cut]) if cut is not None else bytes(raw))
    _check_or_gpuio_error(path)
