"""Images as they come from the wild: orientation applied once on every
container, 8-bit lossless JPEGs, JPEGs libjpeg only warns about, truncated JPEGs, and
what ``Loader.stats()`` says of skipped and warned-of samples. Every file is written by a
real encoder (Pillow, libjpeg-turbo through imagecodecs) and, for the damaged JPEGs,
edited byte by byte. The reference decoder is Pillow."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image, ImageCms, ImageFile, ImageOps

import gpuio
from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.errors import FormatError
from gpuio.formats import filetree

# Pillow's transpose for each orientation (what ``ImageOps.exif_transpose`` applies) and
# its inverse, which turns the picture into the pixels a camera would store
_SHOW = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
         5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
         8: Image.Transpose.ROTATE_90}
_STORE = {**_SHOW, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def make_batch(bufs, on_error="raise", **fields):
    index = np.arange(len(bufs))
    return Batch({"data": [np.frombuffer(b, np.uint8) for b in bufs], **fields}, index, sample_seeds(0, 0, index),
                 on_error=on_error)


@pytest.fixture(scope="module")
def picture():
    """A smooth 40 x 56 RGB picture with a corner mark (every orientation differs)."""
    y, x = np.mgrid[0:40, 0:56]
    img = np.stack([4 * y + 2 * x, 255 - 3 * x, 100 + 2 * y], axis=2).clip(0, 255).astype(np.uint8)
    img[:6, :9] = (250, 10, 10)
    return img


def encode_oriented(picture, container, orientation):
    """``picture`` stored as a camera would store it with ``orientation``, the tag in
    the container's place: a TIFF's own Orientation tag, an EXIF block in JPEG, PNG, WebP."""
    im = Image.fromarray(picture)
    if orientation != 1:
        im = im.transpose(_STORE[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    f = io.BytesIO()
    if container == "tiff":
        im.save(f, "TIFF", exif=exif)
    elif container == "jpeg":
        im.save(f, "JPEG", exif=exif, quality=95, subsampling=0)
    elif container == "png":
        im.save(f, "PNG", exif=exif)
    else:
        im.save(f, "WEBP", exif=exif, lossless=True)
    return f.getvalue()


def pillow_shown(buf):
    """The reference: Pillow's pixels with the orientation applied by Pillow."""
    with Image.open(io.BytesIO(buf)) as im:
        return np.asarray(ImageOps.exif_transpose(im).convert("RGB"))


def routes(bufs, on_error="raise"):
    """The decoded images of ``bufs`` on the CPU routes that decode whole images or
    windows: ``decode_image``; ``decode_image_slice`` with the whole window; the fused
    decode -> center_crop -> normalize chain (uint8 HWC, so that pixels compare exactly)
    and the same ops one by one."""
    out = {"decode_image": ops.decode_image()(make_batch(bufs, on_error))}
    whole = [np.zeros(2, np.float32)] * len(bufs), [np.ones(2, np.float32)] * len(bufs)
    out["decode_image_slice"] = ops.decode_image_slice()(make_batch(bufs, on_error, crop_anchor=whole[0],
                                                                    crop_shape=whole[1]))
    for fuse in (True, False):
        chain = ops.Compose([ops.decode_image(), ops.center_crop(16),
                             ops.normalize(mean=[0, 0, 0], std=[1, 1, 1], layout="HWC", dtype="uint8")], fuse=fuse)
        out["fused" if fuse else "unfused"] = chain(make_batch(bufs, on_error))
    return out


def center16(img):
    h, w = img.shape[:2]
    return img[(h - 16) // 2: (h - 16) // 2 + 16, (w - 16) // 2: (w - 16) // 2 + 16]


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("container", ["tiff", "jpeg", "png", "webp"])
def test_every_orientation_equals_the_upright_picture(picture, container, orientation):
    """Each orientation, applied once, gives the upright picture on every CPU route:
    exactly for the lossless containers, and for JPEG equal to Pillow's decode and
    within JPEG's error of the picture. (Pillow applies a TIFF's Orientation tag while
    loading; gpuio transposed it a second time.)"""
    buf = encode_oriented(picture, container, orientation)
    want = pillow_shown(buf)
    if container == "jpeg":
        assert np.abs(want.astype(int) - picture).mean() < 2
    else:
        np.testing.assert_array_equal(want, picture)
    got = routes([buf])
    for name in ("decode_image", "decode_image_slice"):
        np.testing.assert_array_equal(got[name].data["image"][0], want, err_msg=name)
    for name in ("fused", "unfused"):
        np.testing.assert_array_equal(np.asarray(got[name].data["image"])[0], center16(want), err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("container", ["tiff", "jpeg", "png", "webp"])
def test_every_orientation_equals_the_upright_picture_on_the_gpu(picture, container):
    """The same rule on a GPU batch: nvImageCodec applies the JPEG EXIF and TIFF
    orientation (``apply_exif_orientation``; its TIFF parser reads the tag) once, and
    what it does not take comes from the CPU path: the upright picture (exact for the
    lossless containers; JPEG within the GPU IDCT's few levels)."""
    import cupy

    from gpuio.device import Device

    bufs = [encode_oriented(picture, container, o) for o in range(1, 9)]
    batch = make_batch(bufs)
    batch.device = Device("cuda", 0)
    whole = [np.zeros(2, np.float32)] * 8, [np.ones(2, np.float32)] * 8
    sliced = make_batch(bufs, crop_anchor=whole[0], crop_shape=whole[1])
    sliced.device = Device("cuda", 0)
    for out in (ops.decode_image()(batch), ops.decode_image_slice()(sliced)):
        for o, img in zip(range(1, 9), out.data["image"]):
            got = cupy.asnumpy(img)
            assert got.shape == picture.shape, (container, o)
            if container == "jpeg":
                assert np.abs(got.astype(int) - picture).mean() < 3, o
            else:
                np.testing.assert_array_equal(got, picture, err_msg=f"orientation {o}")


@pytest.fixture(scope="module")
def lossless():
    """8-bit lossless JPEGs (SOF3) from libjpeg-turbo's own encoder: gray and RGB."""
    imagecodecs = pytest.importorskip("imagecodecs")
    rng = np.random.default_rng(3)
    gray = rng.integers(0, 256, (24, 40), np.uint8)
    rgb = rng.integers(0, 256, (24, 40, 3), np.uint8)
    bufs = [bytes(imagecodecs.jpeg8_encode(a, lossless=True)) for a in (gray, rgb)]
    assert all(b"\xff\xc3" in b[:200] for b in bufs)  # lossless frames, as written
    return bufs, gray, rgb


@pytest.mark.parametrize("color", ["rgb", "gray", "unchanged"])
def test_lossless_jpeg_decodes_as_pillow(lossless, color):
    """libjpeg-turbo converts a lossless JPEG to no other colour space ("Unsupported
    color conversion request" for gray -> RGB): the gray one is decoded as gray and its
    channel repeated, as Pillow does, on every CPU route."""
    bufs, gray, rgb = lossless
    mode = {"rgb": "RGB", "gray": "L"}
    want = [np.asarray(Image.open(io.BytesIO(b)).convert(mode.get(color, Image.open(io.BytesIO(b)).mode)))
            for b in bufs]
    np.testing.assert_array_equal(Image.open(io.BytesIO(bufs[0])), gray)  # lossless, to the pixel
    np.testing.assert_array_equal(Image.open(io.BytesIO(bufs[1])), rgb)
    got = ops.decode_image(color=color)(make_batch(bufs)).data["image"]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w if w.ndim == 3 else w[:, :, None])
    if color == "rgb":
        out = routes(bufs)
        np.testing.assert_array_equal(out["decode_image_slice"].data["image"][0], want[0])
        np.testing.assert_array_equal(np.asarray(out["fused"].data["image"]), np.asarray(out["unfused"].data["image"]))
        np.testing.assert_array_equal(np.asarray(out["fused"].data["image"])[0], center16(want[0]))


def _segment(marker, payload):
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


@pytest.fixture(scope="module")
def damaged(picture):
    """JPEGs that Pillow decodes though libjpeg warns about them or their metadata is
    malformed, each made from a real Pillow JPEG (one with an sRGB ICC profile)."""
    f = io.BytesIO()
    Image.fromarray(picture).save(f, "JPEG", quality=90, icc_profile=ImageCms.ImageCmsProfile(
        ImageCms.createProfile("sRGB")).tobytes())
    base = f.getvalue()
    app2 = base.index(b"\xff\xe2")
    assert base[app2 + 4: app2 + 16] == b"ICC_PROFILE\0"
    sos = base.index(b"\xff\xda")
    scan_end = base.rindex(b"\xff\xd9")
    return {
        "clean": base,
        # libjpeg warns: the ICC block's sequence number is 0 ("bad ICC marker")
        "icc_sequence_0": base[:app2 + 16] + b"\x00" + base[app2 + 17:],
        # libjpeg warns: two bytes that are no marker before the scan ("extraneous bytes")
        "ff00_in_header": base[:sos] + b"\xff\x00" + base[sos:],
        "junk_before_marker": base[:sos] + b"\x12\x34" + base[sos:],
        # libjpeg warns: the scan stops early but the file ends with EOI
        "scan_ends_early": base[:sos + (scan_end - sos) // 2] + b"\xff\xd9",
        # libjpeg warns: a second ICC block numbered as the first, after the frame header
        "icc_after_sof": base[:sos] + _segment(0xE2, b"ICC_PROFILE\0\x01\x01" + b"abcd" * 8) + base[sos:],
        # no warning, odd data: bytes after EOI, an EXIF block whose first IFD is out of range
        "bytes_after_eoi": base + b"\x00trailing\x01",
        "exif_broken": base[:2] + _segment(0xE1, b"Exif\0\0MM\x00\x2a\xff\xff\xff\xff") + base[2:],
    }


WARNED = ["icc_sequence_0", "ff00_in_header", "junk_before_marker", "scan_ends_early", "icc_after_sof"]


def test_jpegs_pillow_decodes_are_decoded_on_every_route_and_warnings_reported(damaged):
    """One policy for every route: what Pillow decodes is decoded (equal to Pillow),
    the libjpeg warnings reported per sample in ``batch.warnings``; before, the
    warned-about ones were refused by ``decode_image`` (libjpeg's warnings were fatal)."""
    names = list(damaged)
    bufs = [damaged[n] for n in names]
    want = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in bufs]
    out = routes(bufs)
    for route in ("decode_image", "decode_image_slice"):
        batch = out[route]
        assert batch.index.tolist() == list(range(len(names))), route
        for name, g, w in zip(names, batch.data["image"], want):
            np.testing.assert_array_equal(g, w, err_msg=f"{route} {name}")
        warned = {names[i] for i, _ in batch.warnings}
        if route == "decode_image":
            assert warned == set(WARNED)
        else:  # the region decoder's libjpeg may be one (2.x) that does not check ICC blocks
            assert set(WARNED) - {"icc_sequence_0", "icc_after_sof"} <= warned <= set(WARNED)
        assert all(message.endswith("; decoded by Pillow") for _, message in batch.warnings)
    fused, unfused = np.asarray(out["fused"].data["image"]), np.asarray(out["unfused"].data["image"])
    np.testing.assert_array_equal(fused, unfused)
    np.testing.assert_array_equal(fused, np.stack([center16(w) for w in want]))


def test_truncated_jpeg_is_refused_on_every_route(damaged, monkeypatch):
    """A JPEG whose data stops before its end-of-image marker is refused on every route,
    with an error naming the sample and saying it is truncated, even where Pillow is told
    to load truncated images (which it would fill with gray)."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    f = io.BytesIO()
    Image.open(io.BytesIO(damaged["clean"])).convert("CMYK").save(f, "JPEG")  # decoded by Pillow, not simplejpeg
    for base in (damaged["ff00_in_header"], f.getvalue()):  # a warning, then the cut: Pillow would decode it now
        cut = base[: len(base) * 2 // 3]
        for route, batch in routes([damaged["clean"], cut], on_error="skip").items():
            assert batch.index.tolist() == [0], route
            (sample, err), = batch.errors
            assert sample == 1 and isinstance(err, FormatError) and "sample 1" in str(err)
            assert "truncated" in str(err) and f"at byte {len(cut)}" in str(err), route


def test_skip_stats_name_the_file_and_byte_offset(tmp_path, damaged):
    """Under ``on_error="skip"`` ``stats()["errors"]`` names each skipped sample's file
    and byte offset, not only its number; JPEGs decoded despite a libjpeg warning are
    counted in ``stats()["warned"]`` and named in ``stats()["warnings"]``."""
    files = {"a_clean.jpg": damaged["clean"], "b_cut.jpg": damaged["clean"][:300],
             "c_warned.jpg": damaged["ff00_in_header"], "d_clean.jpg": damaged["clean"]}
    (tmp_path / "x").mkdir()
    for name, data in files.items():
        (tmp_path / "x" / name).write_bytes(data)
    index = filetree(str(tmp_path))
    loader = gpuio.Loader(index, 4, ops=[ops.decode_image()], on_error="skip", output="numpy")
    rows = [b["index"].tolist() for b in loader]
    stats = loader.stats()
    paths = [index.extent(i).file for i in range(4)]
    cut, warned = (next(i for i, p in enumerate(paths) if p.endswith(n)) for n in ("b_cut.jpg", "c_warned.jpg"))
    assert sorted(i for row in rows for i in row) == sorted(set(range(4)) - {cut})
    assert stats["skipped"] == 1 and stats["warned"] == 1
    assert f"sample {cut} " in stats["errors"][0] and f"file {paths[cut]} at byte 0" in stats["errors"][0]
    assert "truncated" in stats["errors"][0].lower()
    assert f"sample {warned} " in stats["warnings"][0] and f"file {paths[warned]} at byte 0" in stats["warnings"][0]
