"""A Loader checks, when it is made, that every op's input field will be there, and a
batch says where a decoded field went: the first mistakes of a port from DALI."""

import io
import tarfile

import numpy as np
import pytest
import simplejpeg

import gpuio
from gpuio import formats, ops
from gpuio.batch import Batch, Op
from gpuio.errors import ConfigError


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A WebDataset tar (jpg, cls) and a file tree of the same JPEGs."""
    root = tmp_path_factory.mktemp("wds")
    rng = np.random.default_rng(0)
    tar_path = root / "shard-000.tar"
    with tarfile.open(tar_path, "w") as tar:
        for i in range(6):
            jpg = simplejpeg.encode_jpeg(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8))
            (root / "tree" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            (root / "tree" / f"c{i % 2}" / f"{i}.jpg").write_bytes(jpg)
            for ext, payload in (("jpg", jpg), ("cls", str(i % 2).encode())):
                info = tarfile.TarInfo(f"{i:04d}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return formats.webdataset([str(tar_path)], fields=("jpg", "cls")), formats.filetree(root / "tree")


def test_a_decoder_reading_a_field_the_index_lacks_fails_when_the_loader_is_made(shards):
    wds, _ = shards
    two = wds.take(range(len(wds)))  # the same samples with a second image field
    two.extents["seg.png"] = two.extents["jpg"]
    with pytest.raises(ConfigError) as info:
        gpuio.Loader(two, 4, ops=[ops.decode_image(), ops.crop_mirror_normalize(16)])
    msg = str(info.value)
    assert "DecodeImage reads field 'data', but this index has no field 'data'" in msg
    assert "'jpg'" in msg and "field=" in msg
    batch = next(iter(gpuio.Loader(wds, 4, ops=[ops.decode_image("jpg")], output="numpy")))
    assert batch["image"].shape == (4, 24, 32, 3)


def test_the_decoder_finds_the_one_image_field_and_fields_rename(shards):
    wds, tree = shards
    want = list(gpuio.Loader(tree, 3, ops=ops.decode_image(), output="numpy"))  # one op, not in a list
    found = list(gpuio.Loader(wds, 3, ops=[ops.decode_image()], output="numpy"))
    renamed = list(gpuio.Loader(wds, 3, fields={"data": "jpg", "label": "cls"}, ops=[ops.decode_image()],
                                output="numpy"))
    assert sorted(found[0]) == ["__key__", "cls", "image", "index"] and sorted(renamed[0]) == ["data", "image", "index", "label"]
    by_name = {int(i): img for b in want for i, img in zip(b["index"], b["image"])}
    tree_pos = {i: k for k, i in enumerate(sorted(range(6), key=lambda i: (i % 2, i)))}  # c0/0,2,4 then c1/1,3,5
    for batches in (found, renamed):
        for b in batches:
            for i, img in zip(b["index"].tolist(), b["image"]):
                np.testing.assert_array_equal(img, by_name[tree_pos[i]])
    assert [int(v) for b in renamed for v in b["label"]] == [i % 2 for i in range(6)]
    with pytest.raises(ConfigError, match=r"loads \['jpg'\] under two names"):
        gpuio.Loader(wds, 3, fields={"data": "jpg", "jpg": "jpg"})
    with pytest.raises(ConfigError, match=r"unknown field\(s\) \['png'\]"):
        gpuio.Loader(wds, 3, fields={"data": "png"})
    with pytest.raises(ConfigError, match=r"give a list of field names \(fields=\['jpg'\]\)"):
        gpuio.Loader(wds, 3, fields="jpg")


def test_fields_that_leave_out_an_op_s_input_fail_when_the_loader_is_made(shards):
    _, tree = shards
    with pytest.raises(ConfigError, match=r"DecodeImage reads field 'data', but fields=\['label'\] leaves it out"):
        gpuio.Loader(tree, 4, fields=["label"], ops=[ops.decode_image()])
    with pytest.raises(ConfigError, match=r"Normalize reads field 'image', but this index has no field 'image'"):
        gpuio.Loader(tree, 4, ops=[ops.Compose([ops.normalize(0, 1)])])


def test_a_decoded_field_is_not_handed_over_and_asking_for_it_says_where_it_went(shards):
    _, tree = shards
    batch = next(iter(gpuio.Loader(tree, 4, ops=[ops.decode_image()], output="numpy")))
    assert sorted(batch) == ["image", "index", "label"]
    with pytest.raises(KeyError, match=r"DecodeImage decoded it into 'image' \(batch\['image'\]\)"):
        batch["data"]
    with pytest.raises(KeyError, match=r"this batch has no 'images'; it has \['label', 'image', 'index'\]"):
        batch["images"]
    with pytest.raises(KeyError, match=r"batch\[0\]: a gpuio batch is one dict of fields, not a list of them"):
        batch[0]["data"]  # DALI's DALIGenericIterator yields [{"data": ..., "label": ...}]


def test_after_an_op_that_names_no_field_nothing_more_is_checked(shards):
    _, tree = shards

    class Brighten(Op):  # a user's op: makes a field the checker cannot know about
        def __call__(self, batch: Batch) -> Batch:
            batch.data["bright"] = [np.minimum(img.astype(np.int16) + 10, 255).astype(np.uint8)
                                    for img in batch.data["image"]]
            return batch

    loader = gpuio.Loader(tree, 4, ops=[ops.decode_image(), Brighten(), ops.normalize(0, 1, field="bright")],
                          output="numpy")
    assert next(iter(loader))["bright"].shape == (4, 3, 24, 32)
