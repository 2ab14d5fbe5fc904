"""Restart markers end to end: a file tree packed with ``restart_interval`` (``gpuio.pack``)
and read by a ``Loader`` gives the train and val chains' batches of the source tree, bit
for bit, with every JPEG's window decoded from its restart intervals (the field
``data.restarts`` reaches the fused decode)."""

from __future__ import annotations

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.ops import fused
from gpuio.ops.decode import native_jpeg
from gpuio.sample import make_image_tree
from conftest import to_host

pytestmark = pytest.mark.skipif(native_jpeg() is None, reason="gpuio.ops._jpeg not built (no libjpeg headers)")

CHAINS = {
    "train": lambda: [ops.random_resized_crop(64), ops.flip(), ops.normalize([120.0] * 3, [60.0] * 3)],
    "val": lambda: [ops.resize(shorter=72), ops.center_crop(64), ops.normalize([120.0] * 3, [60.0] * 3)],
}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    source = make_image_tree(root / "src", count=24, classes=2, seed=8, progress=False)
    return source, gpuio.pack(source, root / "packed", images=gpuio.ImagePolicy(restart_interval=2))


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_loader_on_packed_restarts_equals_the_source(monkeypatch, trees, chain):
    source, packed = trees
    marked = []
    decode_resample = fused.DecodeFused._resample

    def counting(self, batch, images, restarts, *args):
        marked.append(sum(r is not None and len(r) > 0 for r in restarts))
        return decode_resample(self, batch, images, restarts, *args)

    def epoch(index):
        pipe = ops.Compose([ops.decode_image(), *CHAINS[chain]()])
        loader = gpuio.Loader(index, 8, ops=[pipe], shuffle=True, seed=5, last_batch="drop", output="numpy")
        return [(np.asarray(b["image"]), np.asarray(b["label"])) for b in loader]

    want = epoch(gpuio.formats.filetree(source))
    monkeypatch.setattr(fused.DecodeFused, "_resample", counting)
    got = epoch(gpuio.formats.packed(packed))
    assert len(got) == len(want) == 3
    for (image, label), (want_image, want_label) in zip(got, want):
        assert np.array_equal(label, want_label) and np.array_equal(image, want_image)
    # every JPEG the region decoder takes came with its offsets (the sample's CMYK and
    # EXIF-rotated images are decoded whole before, and are not counted)
    assert sum(marked) >= 20


def test_bench_rows_run_on_a_small_tree(trees, tmp_path):
    """``bench/restart.py`` end to end: every row measured, the marked rows' outputs
    checked equal to the source's, the JSON written."""
    import json

    from gpuio.bench.restart import main

    out = tmp_path / "restart.json"
    main(["--root", trees[0], "--batch", "8", "--epochs", "1", "--workers", "1", "--intervals", "0,4",
          "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["pipeline"], r["name"]) for r in rows] == [
        (p, n) for p in ("train", "val")
        for n in ("decode only (source)", "gpuio, source", "gpuio, restarts every row", "gpuio, restarts 4")]
    assert all(r["images_s"] > 0 and r["cpu_ms"] > 0 for r in rows)
    assert all(r["decode_ms"] > 0 and r["resample_ms"] > 0 for r in rows if r["name"].startswith("gpuio"))
    assert all(0.5 < r["size"] < 1.5 for r in rows if "restarts" in r["name"])


def test_the_restart_offsets_are_read_on_the_host_and_not_handed_over(trees, device):
    """``data.restarts`` is an input of the decoder (read into host memory, never placed
    on a GPU), not a column of the batches; it comes when ``fields=`` names it."""
    _, packed = trees
    index = gpuio.formats.packed(packed)
    decode = ops.decode_image()
    assert decode.host_inputs == ("data", "data.restarts")
    chain = [decode, *CHAINS["train"]()]
    batches = list(gpuio.Loader(index, 8, ops=chain, device=device, output="numpy"))
    assert [sorted(b) for b in batches] == [["image", "index", "label"]] * 3
    with pytest.raises(KeyError, match="DecodeImage read it to decode 'data' into 'image'"):
        batches[0]["data.restarts"]
    named = next(iter(gpuio.Loader(index, 8, fields=["data", "data.restarts"], ops=chain, device=device,
                                   output="numpy")))
    got = [bytes(to_host(o)) for o in named["data.restarts"]]
    assert got == [index[i]["data.restarts"] for i in to_host(named["index"]).tolist()] and len(got) == 8
