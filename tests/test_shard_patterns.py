"""Shard lists as webdataset users write them: brace ranges and globs in every format
that takes several files."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from gpuio import formats
from gpuio.errors import ConfigError, DataError
from gpuio.formats._files import shard_paths


def write_tar(path, keys):
    with tarfile.open(path, "w") as tar:
        for key in keys:
            for ext, body in (("jpg", f"jpeg of {key}".encode()), ("cls", str(len(key)).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))


@pytest.fixture()
def shards(tmp_path):
    for k in range(12):
        write_tar(tmp_path / f"shard-{k:04d}.tar", [f"s{k}a", f"s{k}b"])
    return tmp_path


def test_brace_range_keeps_width_and_order(shards):
    index = formats.webdataset(str(shards / "shard-{0000..0011}.tar"))
    assert len(index) == 24
    assert [index.files[i] for i in range(len(index.files))] == [str(shards / f"shard-{k:04d}.tar") for k in range(12)]
    assert index[23]["__key__"] == "s11b"


def test_glob_is_sorted_and_lists_are_expanded(shards):
    by_glob = formats.webdataset(str(shards / "shard-*.tar"))
    by_list = formats.webdataset([str(shards / "shard-{0000..0005}.tar"), str(shards / "shard-{0006,0007}.tar"),
                                  str(shards / "shard-00[01]?.tar")])
    assert len(by_glob) == 24
    assert len(by_list) == 12 + 4 + 24  # the last pattern matches all twelve shards again
    assert list(by_glob.files)[:3] == [str(shards / f"shard-{k:04d}.tar") for k in range(3)]


def test_patterns_that_match_nothing_or_run_backwards(shards):
    with pytest.raises(DataError, match=r"no tar file matches this pattern") as err:
        formats.webdataset(str(shards / "nope-*.tar"))
    assert "nope-*.tar" in str(err.value)
    with pytest.raises(ConfigError, match="runs backwards"):
        shard_paths(str(shards / "shard-{0011..0000}.tar"), "tar file")
    # a brace range naming a file that does not exist is reported when it is opened, with its name
    with pytest.raises(DataError, match="shard-0012.tar"):
        formats.webdataset(str(shards / "shard-{0000..0012}.tar"))


def test_numpy_and_recordio_take_patterns(tmp_path):
    for k in range(3):
        np.save(tmp_path / f"part-{k}.npy", np.full((2, 2), k, np.int16))
    index = formats.numpy(str(tmp_path / "part-{0..2}.npy"))
    assert len(index) == 3 and index[2]["data"].tolist() == [[2, 2], [2, 2]]
    assert len(formats.numpy(str(tmp_path / "part-*.npy"))) == 3


def test_literal_braces_and_existing_names_stay(tmp_path):
    odd = tmp_path / "weird[1].npy"
    np.save(odd, np.zeros(3))
    assert shard_paths(str(odd), ".npy file") == [str(odd)]  # exists: not a glob
    assert shard_paths("a{b}c", "x") == ["a{b}c"]
