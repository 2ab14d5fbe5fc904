"""Errors name the file or sample and say what was expected, in gpuio's words: no reprs
of internals, no advice from the libraries underneath."""

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.errors import FormatError, PipelineError, StorageError


def test_a_file_that_is_not_an_image_is_named_without_internals(tmp_path):
    (tmp_path / "c0").mkdir()
    for i, payload in enumerate([b"GIF89a" + bytes(40), b"\xff\xd8 not a JPEG after all" * 4]):
        (tmp_path / "c0" / f"{i}.jpg").write_bytes(payload)
    index = gpuio.formats.filetree(tmp_path)
    for row in range(2):
        loader = gpuio.Loader(index.take([row]), 1, ops=[ops.decode_image()], output="numpy", threads=1)
        with pytest.raises(PipelineError) as info:
            next(iter(loader))
        msg = str(info.value)
        assert index.extent(row).file in msg and "sample 0" in msg
        assert "not an image format Pillow reads (the bytes start b" in msg
        assert " object at 0x" not in msg


@pytest.mark.parametrize("kind", ["text", "npz", "pickled", "cut"])
def test_loading_a_file_that_is_not_an_index_says_so(tmp_path, kind):
    path = tmp_path / "train.idx"
    if kind == "text":
        path.write_text("hello, world\n")
    else:
        arrays = {"a": np.arange(3)} if kind != "pickled" else {"spec": np.array([{"x": 1}], dtype=object)}
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        if kind == "cut":
            path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(FormatError) as info:
        gpuio.SampleIndex.load(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: not a gpuio index") and "pickle" not in msg


def test_loading_a_missing_index_is_a_storage_error(tmp_path):
    with pytest.raises(StorageError, match="nope.idx: cannot open the index: No such file"):
        gpuio.SampleIndex.load(tmp_path / "nope.idx")


def _unreadable(tmp_path):
    """Each format's call on a file that is not there, and the path its error must name."""
    from gpuio import formats

    gone = str(tmp_path / "gone")
    (tmp_path / "tree" / "c0").mkdir(parents=True)
    (tmp_path / "list.txt").write_text("c0/gone.jpg 0\n")
    (tmp_path / "m.json").write_text('{"audio_filepath": "gone.wav", "duration": 1.0, "text": "a"}\n')
    return {
        "numpy": (lambda: formats.numpy([gone + ".npy"]), gone + ".npy"),
        "tfrecord": (lambda: formats.tfrecord(gone), gone),
        "tfrecord index": (lambda: formats.tfrecord(gone, gone + ".idx"), gone),
        "recordio": (lambda: formats.recordio(gone), gone),
        "lmdb": (lambda: formats.lmdb(gone), gone),
        "webdataset": (lambda: formats.webdataset(gone), gone),
        "video": (lambda: formats.video([gone + ".mp4"], sequence_length=2), gone + ".mp4"),
        "coco": (lambda: formats.coco(tmp_path, gone + ".json"), gone + ".json"),
        "manifest": (lambda: formats.manifest(gone), gone),
        "manifest's audio file": (lambda: formats.manifest(tmp_path / "m.json"), str(tmp_path / "gone.wav")),
        "file list": (lambda: formats.filetree(tmp_path / "tree", file_list=gone), gone),
        "file in a file list": (lambda: formats.filetree(tmp_path / "tree", file_list=tmp_path / "list.txt"),
                                str(tmp_path / "tree" / "c0" / "gone.jpg")),
    }


@pytest.mark.parametrize("case", ["numpy", "tfrecord", "tfrecord index", "recordio", "lmdb", "webdataset", "video",
                                  "coco", "manifest", "manifest's audio file", "file list", "file in a file list"])
def test_a_missing_file_is_a_storage_error_naming_it(tmp_path, case):
    make, path = _unreadable(tmp_path)[case]
    with pytest.raises(StorageError, match="No such file") as err:
        make()
    assert err.value.path == path
