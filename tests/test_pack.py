"""gpuio pack and formats.packed: every field back as it went in, the alignment rules,
determinism across workers, resume after a failure, the lock, the image policies, CLI."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
import simplejpeg
from crc32c import crc32c
from PIL import Image

import gpuio
from checkers import assert_read_matches_files, check_resume, write_tar
from conftest import to_host
from gpuio.cli import main
from gpuio.errors import ConfigError, FormatError, StorageError
from gpuio.formats.packed import ALIGN_FROM, BLOCK, PAGE, WINDOW, place
from gpuio.index import Extents, PathTable, Ragged, SampleIndex
from gpuio.ops.decode import decode_cpu, jpeg_info
from gpuio.sample import make_image_tree


def _same_samples(a: SampleIndex, b: SampleIndex) -> None:
    assert len(a) == len(b) and a.fields == b.fields
    for i in range(len(a)):
        x, y = a[i], b[i]
        for name in a.fields:
            if isinstance(x[name], np.ndarray):
                np.testing.assert_array_equal(x[name], y[name], err_msg=f"sample {i} field {name}")
            else:
                assert x[name] == y[name], f"sample {i} field {name}"


def _files(folder) -> dict[str, bytes]:
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_image_tree(tmp_path_factory.mktemp("tree") / "src", count=24, seed=3, progress=False)


@pytest.fixture(scope="module")
def tars(tmp_path_factory):
    """Two webdataset shards of members from 0 bytes to 1.5 MiB (random bytes), labels and texts."""
    rng = np.random.default_rng(7)
    folder = tmp_path_factory.mktemp("wds")
    paths = []
    for s in range(2):
        members = []
        for k in range(20):
            n = int(rng.choice([0, 1, 4095, 4096, 32767, 32768, 40000, 300_000, 1_500_000]))
            members += [(f"s{s}/{k:04d}.bin", rng.integers(0, 256, n, dtype=np.uint8).tobytes()),
                        (f"s{s}/{k:04d}.cls", str(k % 5).encode()), (f"s{s}/{k:04d}.txt", f"sample {k} é".encode())]
        paths.append(str(write_tar(folder / f"shard-{s}.tar", members)))
    return paths


def test_every_field_round_trips_with_the_alignment_rules(tars, tmp_path):
    src = gpuio.formats.webdataset(tars, fields=("bin", "cls", "txt"))
    dest = gpuio.pack(src, tmp_path / "p", shard_size=6 << 20)
    got = gpuio.formats.packed(dest)
    _same_samples(src, got)
    assert isinstance(got[3]["cls"], int) and got.meta["decode"] == src.meta["decode"]
    spec = json.loads(open(os.path.join(dest, "index.json")).read())
    assert [s["samples"] for s in spec["shards"]] and sum(s["samples"] for s in spec["shards"]) == len(src)
    for s in spec["shards"]:
        data = open(os.path.join(dest, s["name"]), "rb").read()
        assert s["crc32c"] == crc32c(data) and s["bytes"] == len(data)
    assert spec["source"]["format"] == "webdataset" and spec["source"]["samples"] == len(src)
    assert spec["extents"] == ["bin", "cls", "txt"] and spec["values"]["__key__"]["kind"] == "str"
    for fid in range(len(got.files)):  # the rules, no overlap, and no padding the rules do not ask for
        mine = np.concatenate([np.stack([e.offset, e.length], 1)[e.file == fid] for e in got.extents.values()])
        mine = mine[np.lexsort((mine[:, 1], mine[:, 0]))]
        end = int(mine[0, 0])
        for at, n in mine.tolist():
            assert n < ALIGN_FROM or at % PAGE == 0
            assert not n or at // BLOCK == (at + n - 1) // BLOCK
            assert at >= end and (at - end < PAGE or at % BLOCK == 0), (fid, at, n, end)
            end = at + n
    assert max(os.path.getsize(p) for p in got.files) > BLOCK  # the block rule was exercised
    assert (got.extents["cls"].offset < got.extents["bin"].offset).any()  # small records in the padding
    # the CLI indexes any format first: the same bytes
    assert main(["pack", "--format", "webdataset", *tars, "--fields", "bin,cls,txt", "-o", str(tmp_path / "cli"),
                 "--shard-size", "6MiB", "--images", "bin", "--restart-interval", "0"]) == 0
    assert _files(dest) == _files(tmp_path / "cli")


def test_packed_records_read_on_each_device_with_o_direct(tars, tmp_path, device):
    got = gpuio.formats.packed(gpuio.pack(gpuio.formats.webdataset(tars, fields=("bin", "cls")), tmp_path / "p"))
    with gpuio.config.override(o_direct=True):  # the aligned records: no bounce buffer needed
        assert_read_matches_files(got, "bin", device)


def _unfilled(offsets: np.ndarray, lengths: np.ndarray) -> int:
    """The bytes between records laid out at ``offsets``, checked against the rules (no
    overlap, 4 KiB starts from ALIGN_FROM bytes, no block crossed)."""
    end = free = 0
    for k in np.argsort(offsets, kind="stable").tolist():
        at, n = int(offsets[k]), int(lengths[k])
        assert at >= end and (n < ALIGN_FROM or at % PAGE == 0) and at // BLOCK == (at + max(n, 1) - 1) // BLOCK
        free, end = free + at - end, at + n
    return free


def test_padding_is_filled_from_the_next_records():
    rng = np.random.default_rng(5)  # a fifth of the records small, the rest up to 400 KB
    lengths = rng.permutation(np.concatenate([rng.integers(1, ALIGN_FROM, 200), rng.integers(ALIGN_FROM, 400_000, 800)]))
    offsets = place(lengths, 0)
    assert np.array_equal(offsets, place(lengths, 0))
    in_order = place(lengths, 0, window=0)  # every record in order: the padding the rules ask for
    assert _unfilled(offsets, lengths) < 0.7 * _unfilled(in_order, lengths)
    # a record moves forward by at most WINDOW records; blocks end less than a record early
    rank = np.empty(len(lengths), dtype=np.int64)
    rank[np.argsort(offsets, kind="stable")] = np.arange(len(lengths))
    assert (np.arange(len(lengths)) - rank).max() <= WINDOW
    ends = (offsets + lengths)[np.argsort(offsets)]
    for boundary in range(BLOCK, int(ends[-1]), BLOCK):
        assert boundary - ends[ends <= boundary].max() < 400_000


def test_batches_read_in_order_are_read_ahead(tmp_path, device):
    rng = np.random.default_rng(2)  # records from 1 byte to 120 KB in three shards, some moved into padding
    n = 600
    blobs = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in rng.choice([1, 5000, 40_000, 120_000], n)]
    (tmp_path / "blob.bin").write_bytes(b"".join(blobs))
    src = SampleIndex(PathTable.from_paths([str(tmp_path / "blob.bin")]), {"data": Extents(
        np.zeros(n), np.cumsum([0] + [len(b) for b in blobs[:-1]]), [len(b) for b in blobs])})
    got = gpuio.formats.packed(gpuio.pack(src, tmp_path / "p", shard_size=10 << 20))
    assert len(got.files) == 3

    def check(reader, rows):
        for row, arr in zip(rows, reader.read(got, rows)):
            ext = got.extent(row, "data")
            with open(ext.file, "rb") as f:
                f.seek(ext.offset)
                assert to_host(arr).tobytes() == f.read(ext.length), f"sample {row}"

    # O_DIRECT: read ahead; on a GPU through host memory (posix), uploaded per batch
    with gpuio.config.override(o_direct=True), gpuio.Reader(device, backend="posix") as reader:
        shard = got.extents["data"].file
        batches = [np.arange(start, min(start + 64, n)) for start in range(0, n, 64)]
        for rows in batches:  # in order, across the shards' boundaries
            check(reader, rows.tolist())
        in_order = reader.read_ahead_batches  # every batch within one shard
        assert in_order == sum(len(set(shard[rows])) == 1 for rows in batches) >= 7
        check(reader, rng.permutation(n)[:64].tolist())  # shuffled: read as it is
        assert reader.read_ahead_batches == in_order
        check(reader, list(range(64)))  # in order again
        check(reader, list(range(64, 128)))
        assert reader.read_ahead_batches == in_order + 2
        first = got.extent(128, "data")  # the next batch's bytes change after they were read ahead
        with open(first.file, "r+b") as f:
            f.seek(first.offset)
            f.write(bytes(255 - b for b in f.read(first.length)))
        check(reader, list(range(128, 192)))
    with gpuio.config.override(o_direct=True, read_ahead=0), gpuio.Reader(device, backend="posix") as reader:
        for rows in batches:
            check(reader, rows.tolist())
        assert reader.read_ahead_batches == 0


def test_small_batches_of_a_packed_shard_read_in_order_are_all_read_ahead(tmp_path):
    """Batches of 16 rows read in order from a packed shard (its records a little out of
    row order: the padding filled from the next ones) are all taken from the read-ahead,
    those that fit no stretch's buffer copied from the stretches, with the bytes of the file."""
    rng = np.random.default_rng(4)
    blobs = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in rng.integers(1_000, 90_000, 800)]
    (tmp_path / "blob.bin").write_bytes(b"".join(blobs))
    src = SampleIndex(PathTable.from_paths([str(tmp_path / "blob.bin")]), {"data": Extents(
        np.zeros(len(blobs)), np.cumsum([0] + [len(b) for b in blobs[:-1]]), [len(b) for b in blobs])})
    got = gpuio.formats.packed(gpuio.pack(src, tmp_path / "p"))
    assert len(got.files) == 1
    with gpuio.config.override(o_direct=True), gpuio.Reader("cpu") as reader:
        for start in range(0, len(blobs), 16):
            rows = list(range(start, start + 16))
            assert [a.tobytes() for a in reader.read(got, rows)] == [blobs[r] for r in rows]
        assert reader.read_ahead_batches == len(blobs) // 16


def test_value_fields_of_every_kind_and_a_reader_loop(tmp_path):
    rng = np.random.default_rng(1)
    blobs = [rng.integers(0, 256, int(n), dtype=np.uint8).tobytes() for n in rng.integers(1, 50_000, 30)]
    data = tmp_path / "blob.bin"
    data.write_bytes(b"".join(blobs))
    starts = np.cumsum([0] + [len(b) for b in blobs[:-1]])
    boxes = Ragged.from_list([rng.random((k % 4, 4)).astype(np.float32) for k in range(30)], np.float32,
                             row_shape=(4,))
    names = Ragged.from_list([f"name {k}" for k in range(30)], kind="str")
    src = SampleIndex(PathTable.from_paths([str(data)]),
                      {"payload": Extents(np.zeros(30), starts, [len(b) for b in blobs])},
                      {"label": np.arange(30, dtype=np.int16), "boxes": boxes, "name": names,
                       "embedding": rng.random((30, 3)).astype(np.float64)}, meta={"classes": ["a", "b"]})
    got = gpuio.formats.packed(gpuio.pack(src, tmp_path / "p", shard_size=200_000))
    _same_samples(src, got)
    assert got.values["embedding"].dtype == np.float64 and got.values["label"].dtype == np.int16
    assert got.meta["classes"] == ["a", "b"] and len(got.files) > 1
    check_resume(lambda: gpuio.Loader(got, 7, shuffle=True, seed=3, output="numpy"))


PASS_THROUGH = gpuio.ImagePolicy(restart_interval=0)


def test_same_bytes_whatever_the_workers_and_the_cli(tree, tmp_path):
    one = gpuio.pack(tree, tmp_path / "one", shard_size=300_000, images=PASS_THROUGH)
    assert main(["pack", tree, "-o", str(tmp_path / "two"), "--workers", "2", "--shard-size", "300000",
                 "--restart-interval", "0"]) == 0
    assert _files(one) == _files(tmp_path / "two")
    assert len(_files(one)) > 3
    _same_samples(gpuio.formats.filetree(tree), gpuio.formats.packed(one))
    # the packed index is a format like the others: gpuio index and check take it
    assert main(["index", "packed", one, "-o", str(tmp_path / "p.idx")]) == 0
    assert main(["check", one]) == 0
    assert gpuio.SampleIndex.load(tmp_path / "p.idx").meta["images"] == ["data"]
    # packed again into the same place: nothing to do; other options there: refused
    before = _files(one)
    assert gpuio.pack(tree, one, shard_size=300_000, images=PASS_THROUGH) == one and _files(one) == before
    with pytest.raises(ConfigError, match="another source or options"):
        gpuio.pack(tree, one, shard_size=300_000)  # the default: restart markers


def test_an_interrupted_pack_keeps_its_verified_shards(tree, tmp_path):
    src = gpuio.storage.learn_lengths(gpuio.formats.filetree(tree))
    src.save(tmp_path / "src.idx")
    src = str(tmp_path / "src.idx")  # a saved index: its sizes known, whatever happens to the files
    whole = gpuio.pack(src, tmp_path / "whole", shard_size=300_000)
    victim = gpuio.SampleIndex.load(src).extent(16, "data").file
    kept = open(victim, "rb").read()
    os.remove(victim)
    dest = tmp_path / "p"
    with pytest.raises(StorageError, match=os.path.basename(victim)):
        gpuio.pack(src, dest, shard_size=300_000)
    written = sorted(n for n in os.listdir(dest) if n.endswith(".gpk"))
    assert written and not (dest / "index.json").exists() and not (dest / ".gpuio-pack.lock").exists()
    stamps = {n: os.stat(dest / n).st_mtime_ns for n in written}
    broken = dest / written[0]  # a kept shard that no longer reads back as written is written again
    raw = bytearray(broken.read_bytes())
    raw[-1] ^= 0xFF
    broken.write_bytes(raw)
    stamps.pop(written[0])
    with open(victim, "wb") as f:
        f.write(kept)
    gpuio.pack(src, dest, shard_size=300_000)
    assert _files(dest) == _files(whole)
    assert all(os.stat(dest / n).st_mtime_ns == t for n, t in stamps.items())


def test_two_packs_into_one_destination_are_refused(tree, tmp_path):
    dest = tmp_path / "p"
    dest.mkdir()
    lock = dest / ".gpuio-pack.lock"
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid()}))
    with pytest.raises(ConfigError, match="in use by another pack"):
        gpuio.pack(tree, dest)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(json.dumps({"host": socket.gethostname(), "pid": int(gone.stdout)}))  # a process that ended
    gpuio.pack(tree, dest)
    assert not lock.exists() and (dest / "index.json").exists()


def test_max_side_and_raw_below(tree, tmp_path):
    src = gpuio.formats.filetree(tree)
    gpuio.storage.learn_lengths(src)
    small = int(np.median(src.extents["data"].length))
    policy = gpuio.ImagePolicy(restart_interval=0, max_side=200, quality=80, raw_below=small)
    got = gpuio.formats.packed(gpuio.pack(src, tmp_path / "p", images=policy))
    assert got.meta["options"]["images"]["data"]["max_side"] == 200
    raws = shrunk = 0
    for i in range(len(src)):
        before, after = src[i]["data"], got[i]["data"]
        pixels = decode_cpu(before, "rgb", i)
        if len(before) < small:  # raw pixels, exactly the source's decode
            raws += 1
            assert after[:4] in (b"II*\x00", b"MM\x00*")
            np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(after))), pixels)
            np.testing.assert_array_equal(decode_cpu(after, "rgb", i), pixels)
        elif max(pixels.shape[:2]) > 200:  # resized by the area filter, baseline 4:2:0
            shrunk += 1
            batch = gpuio.batch.Batch({"image": [pixels]}, np.array([i]), np.zeros(1, np.uint64))
            want = gpuio.ops.resize(longer=200, interp="area")(batch).data["image"][0]
            assert after == simplejpeg.encode_jpeg(want, quality=80, colorspace="RGB", colorsubsampling="420")
            assert b"\xff\xc0" in after and jpeg_info(after).progressive is False
            assert simplejpeg.decode_jpeg_header(after)[2:] == ("YCbCr", "420")
            assert max(decode_cpu(after, "rgb", i).shape[:2]) == 200
        else:
            assert after == before
    assert raws and shrunk


def test_options_are_checked(tree, tmp_path):
    with pytest.raises(ConfigError, match="quality 0"):
        gpuio.pack(tree, tmp_path / "a", images=gpuio.ImagePolicy(max_side=10, quality=0))
    with pytest.raises(ConfigError, match="not byte fields"):
        gpuio.pack(tree, tmp_path / "a", images={"label": gpuio.ImagePolicy(max_side=10)})
    with pytest.raises(ConfigError, match="http"):
        gpuio.pack(tree, "http://127.0.0.1:1/x")
    assert main(["pack", tree, "-o", str(tmp_path / "b"), "--quality", "80"]) == 1


def test_restart_interval(tree, tmp_path):
    policy = gpuio.ImagePolicy(restart_interval=4)
    src = gpuio.formats.filetree(tree)
    got = gpuio.formats.packed(gpuio.pack(src, tmp_path / "p", images=policy))
    assert got.fields == ("data", "data.restarts", "label") and got.meta["options"]["restart_interval"] == 4
    for i in range(len(src)):
        jpeg, offsets = got[i]["data"], np.frombuffer(got[i]["data.restarts"], dtype="<u4")
        np.testing.assert_array_equal(decode_cpu(jpeg, "rgb", i), decode_cpu(src[i]["data"], "rgb", i))
        if jpeg_info(jpeg).progressive or jpeg_info(jpeg).components not in (1, 3):
            continue
        assert len(offsets) > 1
        for k, at in enumerate(offsets.tolist()[1:], start=1):  # each interval after its RSTn marker
            assert jpeg[at - 2] == 0xFF and jpeg[at - 1] == 0xD0 + (k - 1) % 8
    # the fused crops decode from the intervals they cover: the same pixels as from the source
    chain = gpuio.ops.Compose([gpuio.ops.decode_image(), gpuio.ops.resize(shorter=96), gpuio.ops.center_crop(64)])
    for a, b in zip(gpuio.Loader(src, 8, ops=[chain], output="numpy"), gpuio.Loader(got, 8, ops=[chain], output="numpy")):
        np.testing.assert_array_equal(a["image"], b["image"])


def test_a_bad_image_is_kept_as_it_is_or_named(tree, tmp_path):
    bad = tmp_path / "src" / "class_0" / "bad.jpg"
    bad.parent.mkdir(parents=True)
    good = open(gpuio.formats.filetree(tree).files[0], "rb").read()
    bad.write_bytes(good[: len(good) // 3])
    # libjpeg cannot add markers to it: kept as its bytes (the reader refuses it as it would the source's)
    got = gpuio.formats.packed(gpuio.pack(str(tmp_path / "src"), tmp_path / "p",
                                          images=gpuio.ImagePolicy(restart_interval=2)))
    assert got[0]["data"] == bad.read_bytes() and got[0]["data.restarts"] == b""
    assert got.meta["unmarked"] == {"data": {"not_jpeg": 0, "refused": 1}}
    # a policy that decodes it names its file
    with pytest.raises(FormatError, match=r"bad\.jpg.*packing field 'data'"):
        gpuio.pack(str(tmp_path / "src"), tmp_path / "q", images=gpuio.ImagePolicy(max_side=8))


def _train_epoch(index) -> list[tuple[np.ndarray, np.ndarray]]:
    chain = [gpuio.ops.decode_image(), gpuio.ops.random_resized_crop(64), gpuio.ops.flip(),
             gpuio.ops.normalize([120.0] * 3, [60.0] * 3)]
    loader = gpuio.Loader(index, 5, ops=chain, shuffle=True, seed=4, output="numpy")
    return [(b["image"], b["label"], sorted(b)) for b in loader]


def test_the_default_marks_jpegs_and_keeps_other_images(tree, tmp_path, capsys):
    src = tmp_path / "src"
    jpegs = gpuio.formats.filetree(tree).files
    for k in range(12):
        (src / f"class_{k % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"class_{k % 2}" / f"{k:02d}.jpg").write_bytes(open(jpegs[k], "rb").read())
    Image.fromarray(decode_cpu(open(jpegs[0], "rb").read(), "rgb", 0)).save(src / "class_1" / "png.png")
    source = gpuio.formats.filetree(str(src))
    dest = gpuio.pack(str(src), tmp_path / "p", shard_size=200_000)
    got = gpuio.formats.packed(dest)
    assert got.meta["options"]["restart_interval"] == 4 and got.fields == ("data", "data.restarts", "label")
    assert got.meta["unmarked"] == {"data": {"not_jpeg": 1, "refused": 0}}
    for i in range(len(source)):
        before, after = source[i]["data"], got[i]["data"]
        offsets = np.frombuffer(got[i]["data.restarts"], "<u4")
        if before.startswith(b"\x89PNG"):
            assert after == before and len(offsets) == 0
        else:  # the intervals are an MCU row or an even part of one: at least one per row
            assert after != before and len(offsets) >= -(-jpeg_info(after).height // 16)
            np.testing.assert_array_equal(decode_cpu(after, "rgb", i), decode_cpu(before, "rgb", i))
    want, packed = _train_epoch(source), _train_epoch(got)
    assert len(packed) == len(want) == 3
    for (image, label, names), (want_image, want_label, _) in zip(packed, want):
        assert names == ["image", "index", "label"]  # no data.restarts handed over
        assert np.array_equal(label, want_label) and np.array_equal(image, want_image)
    # the CLI's default is the same, and so are the bytes on 2 workers; it says what it kept
    capsys.readouterr()
    assert main(["pack", str(src), "-o", str(tmp_path / "cli"), "--workers", "2", "--shard-size", "200000"]) == 0
    assert _files(dest) == _files(tmp_path / "cli") and len(_files(dest)) > 3
    assert "data: restart markers every 4 MCUs; kept as their bytes: 1 images that are not JPEGs, 0 JPEGs" \
        in capsys.readouterr().out


def test_without_the_transcoder_the_default_keeps_the_bytes(tree, tmp_path, monkeypatch):
    as_is = gpuio.pack(tree, tmp_path / "as-is", images=PASS_THROUGH)
    monkeypatch.setattr(gpuio.ops.decode, "native_jpeg", lambda: None)  # gpuio.ops._jpeg not built
    with pytest.warns(UserWarning, match="gpuio.ops._jpeg was not built"):
        dest = gpuio.pack(tree, tmp_path / "p")
    assert _files(dest) == _files(as_is)
    with pytest.raises(ConfigError, match="gpuio.ops._jpeg, which was not built"):
        gpuio.pack(tree, tmp_path / "q", images=gpuio.ImagePolicy(restart_interval=2))


def test_a_bad_shard_names_itself(tree, tmp_path):
    dest = gpuio.pack(tree, tmp_path / "p", shard_size=300_000)
    shard = os.path.join(dest, "shard-00001.gpk")
    raw = bytearray(open(shard, "rb").read())
    raw[:8] = b"NOTPACKD"
    open(shard, "wb").write(raw)
    with pytest.raises(FormatError, match="shard-00001.gpk.*not a gpuio packed shard"):
        gpuio.formats.packed(dest)
    open(os.path.join(dest, "index.json"), "w").write("{}")
    with pytest.raises(FormatError, match="index.json.*not a gpuio packed index"):
        gpuio.formats.packed(dest)


def test_two_threads_reading_two_files_in_order_on_one_reader_get_their_own_bytes(tmp_path):
    """Threads that share a Reader and each read another file in its order (gpuio.read's
    kept readers) get their own files' bytes while the read-ahead follows one or the other."""
    rng = np.random.default_rng(5)
    n = 400
    index, blobs = [], []
    for name in ("a.bin", "b.bin"):
        parts = [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in rng.integers(4000, 12_000, n)]
        (tmp_path / name).write_bytes(b"".join(parts))
        index.append(SampleIndex(PathTable.from_paths([str(tmp_path / name)]), {"data": Extents(
            np.zeros(n), np.cumsum([0] + [len(b) for b in parts[:-1]]), [len(b) for b in parts])}))
        blobs.append(parts)
    failures = []

    def read_in_order(k, reader):
        try:
            for start in range(0, n, 16):
                rows = list(range(start, start + 16))
                got = [to_host(a).tobytes() for a in reader.read(index[k], rows)]
                if got != [blobs[k][r] for r in rows]:
                    failures.append((k, start))
        except Exception as exc:  # reported below, with the thread's file
            failures.append((k, exc))

    with gpuio.config.override(o_direct=True, read_ahead=512 << 10), gpuio.Reader("cpu", backend="posix") as reader:
        for _ in range(12):
            threads = [threading.Thread(target=read_in_order, args=(k, reader)) for k in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        taken = reader.read_ahead_batches
    assert failures == [] and taken > 0
