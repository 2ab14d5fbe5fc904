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
