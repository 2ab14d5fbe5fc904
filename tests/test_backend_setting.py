"""The storage backend setting governs reads into GPU memory only.

``GPUIO_BACKEND=kvikio`` asks for cuFile reads into the device; a pipeline on the GPU
still reads encoded images and records into host memory to decode or parse them there,
and those host reads must go through posix instead of failing."""

from __future__ import annotations

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.formats import filetree
from gpuio.storage import Reader, read_fields


def write_tfrecord(path, n):
    from tfrecord import TFRecordWriter

    writer = TFRecordWriter(str(path))
    for i in range(n):
        writer.write({"image": (bytes([i]) * (5 + i), "byte"), "label": (i * 10, "int")})
    writer.close()


def jpeg_tree(root, n=6):
    import simplejpeg

    rng = np.random.default_rng(0)
    (root / "c0").mkdir(parents=True)
    images = []
    for i in range(n):
        img = rng.integers(0, 255, (16, 24, 3), dtype=np.uint8)
        blob = simplejpeg.encode_jpeg(img, quality=95)
        (root / "c0" / f"{i}.jpg").write_bytes(blob)
        images.append(simplejpeg.decode_jpeg(blob))
    return filetree(str(root)), images


@pytest.mark.parametrize("how", ["argument", "setting"])
def test_host_reader_under_kvikio_reads_with_posix(tmp_path, how):
    index, _ = jpeg_tree(tmp_path / "t")
    if how == "argument":
        reader = Reader("cpu", backend="kvikio")
    else:
        with gpuio.config.override(backend="kvikio"):
            reader = Reader("cpu")
    with reader:
        assert reader.backend.name == "posix" and not reader.lands_on_device
        got = reader.read(index, [3, 0])
    for row, arr in zip([3, 0], got):
        with open(index.extent(row).file, "rb") as f:
            assert arr.tobytes() == f.read()


def test_unknown_backend_is_still_refused_on_the_host():
    with pytest.raises(gpuio.errors.ConfigError, match="choose auto, posix or kvikio"):
        Reader("cpu", backend="nvme")


def test_loader_decoding_on_the_host_under_kvikio(tmp_path):
    index, images = jpeg_tree(tmp_path / "t")
    with gpuio.config.override(backend="kvikio"):
        ld = gpuio.Loader(index, 3, ops=[ops.decode_image()], output="numpy", threads=2)
        batches = list(ld)
    assert len(batches) == 2
    for b in batches:
        for row, i in enumerate(b["index"].tolist()):
            np.testing.assert_array_equal(b["image"][row], images[i])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_parsed_fields_under_kvikio(tmp_path, device):
    """Records are parsed on the host whatever the destination; under kvikio too."""
    write_tfrecord(tmp_path / "a.tfrecord", 7)
    index = gpuio.formats.tfrecord(str(tmp_path / "a.tfrecord"), features={"image": "bytes", "label": "int64"})
    with gpuio.config.override(backend="kvikio"):
        got = read_fields(index, [6, 2], ["image", "label"], device=device)
    np.testing.assert_array_equal(np.asarray(got["label"]).ravel(), [60, 20])
    assert [bytes(x) for x in got["image"]] == [bytes([6]) * 11, bytes([2]) * 7]
