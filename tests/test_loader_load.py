"""``Loader.load``: one batch of chosen samples on the calling thread, as a pass gives
them (the way gpuio.ray's read tasks run a loader's pipeline); errors travel pickled."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import gpuio
from gpuio import formats, ops
from gpuio.errors import ConfigError, DataError, PipelineError, StorageError
from gpuio.sample import make_image_tree


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_image_tree(tmp_path_factory.mktemp("load-tree"), count=12, classes=2, progress=False)


def _chain():
    return [ops.decode_image(), ops.random_resized_crop(24), ops.flip(),
            ops.normalize(mean=[123.7, 116.3, 103.5], std=[58.4, 57.1, 57.4])]


def test_load_gives_the_rows_of_a_pass(tree):
    index = formats.filetree(tree)
    loader = gpuio.Loader(index, 5, ops=_chain(), output="numpy", shuffle=True, seed=4)
    loader.set_epoch(1)
    ref = {int(i): (img, lab) for b in loader for i, img, lab in zip(b["index"], b["image"], b["label"])}
    other = gpuio.Loader(index, 5, ops=_chain(), output="numpy", shuffle=True, seed=4)
    got = other.load([11, 0, 7], epoch=1)
    assert got["index"].tolist() == [11, 0, 7] and got["image"].shape == (3, 3, 24, 24)
    for j, i in enumerate([11, 0, 7]):
        np.testing.assert_array_equal(got["image"][j], ref[i][0])
        assert got["label"][j] == ref[i][1]
    assert other.state_dict()["consumed"] == 0  # the position did not move
    with pytest.raises(ConfigError, match="sample 12 out of range"):
        other.load([3, 12])
    with pytest.raises(ConfigError, match="1-D"):
        other.load([[1, 2]])
    other.close()


def test_load_names_a_bad_sample_or_skips_it(tree, tmp_path):
    root = make_image_tree(tmp_path / "t", count=4, classes=1, progress=False)
    bad = tmp_path / "t" / "class_000" / "000002.jpg"
    bad.write_bytes(b"\xff\xd8 not a jpeg")
    index = formats.filetree(root)
    with pytest.raises(PipelineError, match=r"sample 2.*000002\.jpg"):
        gpuio.Loader(index, 4, ops=[ops.decode_image()], output="numpy").load([0, 1, 2, 3])
    skip = gpuio.Loader(index, 4, ops=[ops.decode_image()], output="numpy", on_error="skip")
    got = skip.load([0, 1, 2, 3])
    assert got["index"].tolist() == [0, 1, 3] and skip.stats()["skipped"] == 1


def test_errors_pickle_with_their_fields():
    """A worker process (Ray, multiprocessing) hands errors back pickled: same type,
    message and fields."""
    for err in (PipelineError("boom", stage="read", sample=3, key=b"k", path="/d/a.jpg"),
                StorageError("short read", path="/d/b.bin", offset=4096, sample=7),
                DataError("bad", path=None, offset=None, sample="record 2")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__
