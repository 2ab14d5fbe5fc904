"""The dataset commands: ``gpuio index``, ``gpuio inspect``, ``gpuio check``, and ``gpuio
info``'s list of C extensions, on datasets made by real writers."""

from __future__ import annotations

import io
import json
import re
import shutil
import tarfile

import pytest

import gpuio
from gpuio.cli import main


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree") / "t"
    main(["sample", "--out", str(root), "--count", "24"])
    return root


@pytest.fixture()
def bad_tree(tree, tmp_path):
    """The sample tree plus a text file named .jpg and a JPEG cut short."""
    root = tmp_path / "bad"
    shutil.copytree(tree, root)
    first = sorted(root.glob("*/*.jpg"))[0]
    (first.parent / "notes.jpg").write_bytes(b"not a picture\n")
    (first.parent / "cut.jpg").write_bytes(first.read_bytes()[:2000])
    return root


def test_index_then_inspect(tree, tmp_path, capsys):
    out = tmp_path / "t.idx"
    assert main(["index", "filetree", str(tree), "-o", str(out)]) == 0
    assert "24 samples in 24 files" in capsys.readouterr().out
    index = gpuio.SampleIndex.load(out)
    assert len(index) == 24 and index.fields == ("data", "label")
    assert main(["inspect", str(out), "--files", "2"]) == 0
    text = capsys.readouterr().out
    assert "24 samples, 24 files, format filetree" in text
    sizes = gpuio.storage.learn_lengths(index).extents["data"].length  # saved as walked: sizes unknown
    assert f"{int(sizes.sum()):,} bytes" in text and f"max {int(sizes.max()):,}" in text
    assert "classes: 10" in text and "class_000:" in text
    assert index.files[0] in text and index.files[2] not in text and "(22 more)" in text


def test_check_lists_each_bad_sample_with_file_and_reason(bad_tree, capsys):
    assert main(["check", str(bad_tree), "--batch", "8"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    bad = [line for line in lines if line.startswith("sample ")]
    assert len(bad) == 2, lines
    notes, cut = sorted(bad, key=lambda line: "notes.jpg" not in line)
    assert f"{bad_tree}/class_000/notes.jpg at byte 0: cannot decode image (14 bytes)" in notes
    assert f"{bad_tree}/class_000/cut.jpg" in cut and "2000" in cut
    index = gpuio.formats.filetree(bad_tree)
    numbers = sorted(int(line.split()[1].rstrip(":")) for line in bad)
    assert sorted(index.files[index.extents["data"].file[i]].rsplit("/", 1)[1] for i in numbers) == \
        ["cut.jpg", "notes.jpg"]
    assert lines[-1].startswith("24 of 26 samples good, 2 bad (reading every field, decoding data")


def test_check_passes_a_good_set_and_reads_only_without_decode(tree, bad_tree, capsys):
    assert main(["check", str(tree)]) == 0
    assert "24 of 24 samples good, 0 bad" in capsys.readouterr().out
    assert main(["check", str(bad_tree), "--no-decode"]) == 0  # the bytes read; only decoding fails
    assert "26 of 26 samples good, 0 bad (reading every field," in capsys.readouterr().out


def test_index_and_check_a_webdataset_by_pattern(tree, tmp_path, capsys):
    files = sorted(tree.glob("*/*.jpg"))
    for s in range(3):
        with tarfile.open(tmp_path / f"shard-{s:03d}.tar", "w") as tar:
            for k, path in enumerate(files[s * 8:(s + 1) * 8]):
                for ext, body in (("jpg", path.read_bytes()), ("cls", str(k).encode())):
                    info = tarfile.TarInfo(f"{s}-{k}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
    out = tmp_path / "w.idx"
    assert main(["index", "webdataset", str(tmp_path / "shard-{000..002}.tar"), "--fields", "jpg,cls",
                 "-o", str(out)]) == 0
    assert "24 samples in 3 files, fields ['jpg', 'cls', '__key__']" in capsys.readouterr().out
    assert main(["check", str(out)]) == 0
    assert "24 of 24 samples good, 0 bad (reading every field, decoding jpg" in capsys.readouterr().out


def test_index_options_that_do_not_apply_are_refused(tree, tmp_path, capsys):
    assert main(["index", "filetree", str(tree), "--annotations", "a.json", "-o", str(tmp_path / "x.idx")]) == 1
    assert "--annotations applies to coco, not to filetree" in capsys.readouterr().err
    assert main(["index", "tfrecord", str(tmp_path / "r.tfrecord"), "--features", "image", "-o",
                 str(tmp_path / "x.idx")]) == 1
    assert "--features takes NAME=KIND pairs" in capsys.readouterr().err
    assert not (tmp_path / "x.idx").exists()


def test_index_video_takes_the_clip_settings(tmp_path, capsys):
    from test_video import write_video

    (tmp_path / "clips" / "a").mkdir(parents=True)
    write_video(tmp_path / "clips" / "a" / "x.mp4", "libx264", 64, 48, frames=20)
    out = tmp_path / "v.idx"
    assert main(["index", "video", str(tmp_path / "clips"), "-o", str(out)]) == 1
    assert "video takes --sequence-length N" in capsys.readouterr().err and not out.exists()
    assert main(["index", "video", str(tmp_path / "clips"), "--sequence-length", "4", "--stride", "2",
                 "--step", "3", "-o", str(out)]) == 0
    saved = gpuio.SampleIndex.load(out)
    made = gpuio.formats.video(tmp_path / "clips", sequence_length=4, stride=2, step=3)
    assert len(saved) == len(made) > 0 and list(saved.values["frame"]) == list(made.values["frame"])
    assert main(["index", "filetree", str(tmp_path / "clips"), "--stride", "2", "-o", str(out)]) == 1
    assert "--stride applies to video, not to filetree" in capsys.readouterr().err


def test_bench_takes_a_saved_index(tree, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GPUIO_CACHE_DIR", str(tmp_path / "cache"))
    main(["index", "filetree", str(tree), "-o", str(tmp_path / "t.idx")])
    assert main(["bench", str(tmp_path / "t.idx"), "--repeat", "1", "--batch", "8", "--warm-only",
                 "--out", str(tmp_path / "r.json")]) == 0
    text = capsys.readouterr().out
    assert "is a saved index: skipped" in text
    assert any(r["method"] == "gpuio" for r in json.loads((tmp_path / "r.json").read_text())["rows"])


def test_info_lists_the_c_extensions(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for module in ("gpuio.storage._readloop", "gpuio.ops._jpeg", "gpuio.ops._resample", "gpuio.ops._video", "gpuio.ops._audio", "gpuio.ops._flac"):
        assert f"{module}" in text
    assert re.search(r"gpuio.storage._readloop +built:", text)  # built here: CI has a C compiler


def test_bench_on_a_set_with_bad_files_says_what_to_do_and_skips_them_on_request(bad_tree, tmp_path, capsys,
                                                                                monkeypatch):
    monkeypatch.setenv("GPUIO_CACHE_DIR", str(tmp_path / "cache"))
    argv = ["bench", str(bad_tree), "--repeat", "1", "--batch", "8", "--warm-only", "--out", str(tmp_path / "r.json")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"gpuio check {bad_tree}" in err and "--skip-bad" in err
    assert main([*argv, "--skip-bad"]) == 0
    text = capsys.readouterr().out
    assert "--skip-bad: 2 file(s) that do not decode left out of the image bench" in text
    rows = json.loads((tmp_path / "r-images.json").read_text())["results"]
    assert all(r["images_s"] > 0 for r in rows if r["name"].startswith(("gpuio", "torch")))


def test_check_finds_a_flipped_payload_byte_in_a_tfrecord(tmp_path, capsys):
    import tfrecord as tfrecord_pkg

    path = tmp_path / "d.tfrecord"
    writer = tfrecord_pkg.TFRecordWriter(str(path))
    for k in range(5):
        writer.write({"image/encoded": (bytes([k]) * 100, "byte"), "label": (k, "int")})
    writer.close()
    index = gpuio.formats.tfrecord(path)
    raw = bytearray(path.read_bytes())
    third = index.extent(3, "data")
    raw[third.offset + 50] ^= 0x01
    path.write_bytes(raw)
    assert index[3]["data"] != bytes(raw[third.offset:third.offset + third.length]) or True
    out = tmp_path / "d.idx"
    assert main(["index", "tfrecord", str(path), "-o", str(out)]) == 0
    assert main(["check", str(out)]) == 1
    text = capsys.readouterr().out
    assert f"sample 3: {path}: record 3 at byte {third.offset - 12}: data CRC mismatch" in text
    assert "4 of 5 samples good, 1 bad (reading every field, every record's CRCs" in text
