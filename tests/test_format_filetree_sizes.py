"""A walked file tree lists its files without their sizes: each extent has
``UNKNOWN_LENGTH`` (the whole file), which the storage core learns when it reads it."""

from __future__ import annotations

import os

import numpy as np
import pytest

import gpuio
from gpuio.errors import BufferBudgetError, ConfigError, StorageError
from gpuio.formats import filetree
from gpuio.index import UNKNOWN_LENGTH, SampleIndex

SIZES = [0, 1, 4095, 4097, 300_000, 17, 65_536]


@pytest.fixture
def tree(tmp_path):
    rng = np.random.default_rng(5)
    root = tmp_path / "tree"
    for k, size in enumerate(SIZES):
        folder = root / f"class{k % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{k:02d}.jpg").write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    os.symlink(root / "class0" / "04.jpg", root / "class1" / "99.jpg")  # a link to a file: its target's bytes
    return root


@pytest.fixture(params=["C", "os.stat"])
def stat_with(request, monkeypatch):
    """Sizes learned by the C accelerator's stat loop, or by os.stat where it was not built."""
    if request.param == "os.stat":
        monkeypatch.setattr("gpuio.storage.reader._readloop", None)
    return request.param


def _contents(index):
    return [open(path, "rb").read() for path in index.files]


def test_reads_learn_the_sizes_of_a_walked_tree(tree, stat_with):
    index = filetree(tree)
    assert len(index) == len(SIZES) + 1 and (index.extents["data"].length == UNKNOWN_LENGTH).all()
    want = _contents(index)
    rows = np.random.default_rng(0).permutation(len(index))
    assert [a.tobytes() for a in gpuio.read(index, rows)] == [want[i] for i in rows]
    with gpuio.config.override(o_direct=True):  # a plan aligned to 4 KiB from the learned sizes
        assert [a.tobytes() for a in gpuio.read(index, rows)] == [want[i] for i in rows]
    assert [index[i]["data"] for i in range(len(index))] == want
    got = {}
    for batch in gpuio.Loader(index, 3, output="numpy"):
        got.update((int(i), np.asarray(d).tobytes()) for i, d in zip(batch["index"], batch["data"]))
    assert [got[i] for i in range(len(index))] == want


def test_unknown_sizes_save_load_and_learn(tree, tmp_path, stat_with):
    index = filetree(tree)
    with pytest.raises(ConfigError, match="unknown length.*learn_lengths"):
        index.nbytes()
    index.save(tmp_path / "walked.idx")
    back = SampleIndex.load(tmp_path / "walked.idx")
    assert (back.extents["data"].length == UNKNOWN_LENGTH).all() and back[4]["data"] == _contents(index)[4]
    assert gpuio.storage.learn_lengths(back) is back
    sizes = [os.path.getsize(p) for p in back.files]
    assert back.extents["data"].length.tolist() == sizes and back.nbytes() == sum(sizes)
    back.save(tmp_path / "sized.idx")
    assert SampleIndex.load(tmp_path / "sized.idx").extents["data"].length.tolist() == sizes


def test_a_missing_file_stays_unknown_and_its_read_names_it(tree, stat_with):
    index = filetree(tree)
    gone = index.files[1]
    os.remove(gone)
    gpuio.storage.learn_lengths(index)
    length = index.extents["data"].length
    assert length[1] == UNKNOWN_LENGTH and (np.delete(length, 1) >= 0).all()
    for read in (lambda: gpuio.read(index, [0, 1]), lambda: index[1]):
        with pytest.raises(StorageError, match="file not found") as err:
            read()
        assert err.value.path == gone


def test_loader_budget_takes_the_learned_sizes(tree):
    # two batches of the two largest files (300,000 and 65,536 bytes) do not fit in 500,000
    with gpuio.config.override(buffer_budget=500_000), pytest.raises(BufferBudgetError, match="needs up to"):
        gpuio.Loader(filetree(tree), 2, output="numpy")


def test_a_file_list_records_the_sizes(tree, tmp_path):
    (tmp_path / "list.txt").write_text("class0/00.jpg 0\nclass0/04.jpg 3\nclass1/05.jpg 1\n")
    index = filetree(tree, file_list=tmp_path / "list.txt")
    assert index.extents["data"].length.tolist() == [SIZES[0], SIZES[4], SIZES[5]]


def test_a_file_that_cannot_be_stated_is_named_by_nbytes_and_inspect(tree, tmp_path, capsys):
    from gpuio.cli import main

    index = filetree(tree)
    gone = index.files[1]
    os.remove(gone)
    gpuio.storage.learn_lengths(index)
    with pytest.raises(ConfigError, match=f"1 extents of unknown length, the first of file {gone}"):
        index.nbytes()
    index.save(tmp_path / "gone.idx")
    assert main(["inspect", str(tmp_path / "gone.idx")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("data"))
    sizes = [os.path.getsize(p) for p in index.files if p != gone]
    assert f"{sum(sizes):,} bytes: per sample min {min(sizes):,}," in line  # the known sizes only
    assert f"1 of unknown size (cannot be stat'ed: {gone}" in line
