"""Image codecs: JPEG 2000, TIFF, WebP, PNG, BMP (written by Pillow and OpenCV) decoded
by content, never by file name, on the CPU and (same body, marked gpu) on a GPU batch;
and decode_image_slice against a whole decode and the same slice."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

import gpuio
from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.errors import FormatError
from gpuio.ops.decode import image_format
from gpuio.ops.decode_slice import crop_window
from gpuio.sample import sample_image
from tests.conftest import to_host


def make(device, bufs, **fields):
    index = np.arange(len(bufs))
    dev = Device("cuda", 0) if device == "cuda" else Device("cpu")
    data = {"data": [np.frombuffer(b, np.uint8) for b in bufs], **{k: list(v) for k, v in fields.items()}}
    return Batch(data, index, sample_seeds(0, 0, index), device=dev)


@pytest.fixture(scope="module")
def pixels():
    return sample_image(np.random.default_rng(11), 45, 70)


def pillow(pixels, fmt, mode="RGB", **kw):
    buf = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(buf, fmt, **kw)
    return buf.getvalue()


# name -> (encoder, format, lossless?)
CODECS = {
    "png-rgb": (lambda p: pillow(p, "PNG"), "png", True),
    "png-rgba": (lambda p: pillow(p, "PNG", "RGBA"), "png", True),
    "png-palette": (lambda p: pillow(p, "PNG", "P"), "png", False),
    "jp2-lossless": (lambda p: pillow(p, "JPEG2000"), "jpeg2000", True),
    "j2k-codestream": (lambda p: pillow(p, "JPEG2000", no_jp2=True), "jpeg2000", True),
    "jp2-lossy": (lambda p: pillow(p, "JPEG2000", quality_mode="rates", quality_layers=[20]), "jpeg2000", False),
    "tiff-raw": (lambda p: pillow(p, "TIFF"), "tiff", True),
    "tiff-lzw": (lambda p: pillow(p, "TIFF", compression="tiff_lzw"), "tiff", True),
    "tiff-big-endian": (lambda p: cv2.imencode(".tiff", p[:, :, ::-1])[1].tobytes(), "tiff", True),
    "webp-lossless": (lambda p: pillow(p, "WEBP", lossless=True), "webp", True),
    "webp-lossy": (lambda p: pillow(p, "WEBP", quality=80), "webp", False),
    "bmp": (lambda p: pillow(p, "BMP"), "bmp", True),
    "gif": (lambda p: pillow(p, "GIF"), "gif", False),
}


@pytest.mark.parametrize("name", list(CODECS))
def test_each_codec_decodes_by_content(device, pixels, name):
    encode, fmt, lossless = CODECS[name]
    buf = encode(pixels)
    assert image_format(buf) == fmt
    batch = ops.decode_image()(make(device, [buf]))
    img = to_host(batch.data["image"][0])
    assert img.shape == (45, 70, 3) and img.dtype == np.uint8
    with Image.open(io.BytesIO(buf)) as im:
        ref = np.asarray(im.convert("RGB"))
    if lossless:
        np.testing.assert_array_equal(img, pixels)
    else:  # lossy codecs: what Pillow decodes (nvjpeg2k's wavelet differs from OpenJPEG's by a level or two)
        assert np.abs(img.astype(int) - ref).max() <= (0 if device == "cpu" else 4)


def test_colors_of_other_codecs(pixels):
    rgba = pillow(pixels, "PNG", "RGBA")
    gray_tiff = pillow(pixels, "TIFF", "L")
    out = ops.decode_image(color="unchanged")(make("cpu", [rgba, gray_tiff])).data["image"]
    assert out[0].shape == (45, 70, 4) and out[1].shape == (45, 70, 1)
    gray = ops.decode_image(color="gray")(make("cpu", [pillow(pixels, "WEBP", lossless=True)])).data["image"][0]
    np.testing.assert_array_equal(gray[:, :, 0], np.asarray(Image.fromarray(pixels).convert("L")))


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_sixteen_bit_images_keep_their_high_byte(device, fmt):
    deep = (np.arange(30 * 40, dtype=np.uint32).reshape(30, 40) * 53 % 65536).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(deep).save(buf, fmt)
    img = to_host(ops.decode_image(color="gray")(make(device, [buf.getvalue()])).data["image"][0])
    # nvImageCodec rounds x * 255 / 65535 where the CPU takes x >> 8: at most one level apart
    assert np.abs(img[:, :, 0].astype(int) - (deep >> 8)).max() <= (0 if device == "cpu" else 1)


def test_file_names_do_not_choose_the_decoder(tmp_path, pixels):
    (tmp_path / "a").mkdir()
    misnamed = {"png_as.jpg": CODECS["png-rgb"][0], "tiff_as.png": CODECS["tiff-lzw"][0],
                "jp2_as.bmp": CODECS["jp2-lossless"][0], "webp_as.jpeg": CODECS["webp-lossless"][0]}
    for name, encode in misnamed.items():
        (tmp_path / "a" / name).write_bytes(encode(pixels))
    index = gpuio.formats.filetree(tmp_path)
    loader = gpuio.Loader(index, 4, ops=[ops.decode_image()], output="numpy")
    (batch,) = list(loader)
    assert batch["image"].shape == (4, 45, 70, 3)
    for img in batch["image"]:
        np.testing.assert_array_equal(img, pixels)


@pytest.mark.parametrize("name", ["png-rgb", "jp2-lossless", "tiff-lzw", "webp-lossless"])
def test_bad_bytes_of_other_codecs_are_format_errors(device, pixels, name):
    buf = CODECS[name][0](pixels)
    cut = buf[: len(buf) // 2]
    batch = make(device, [buf, cut, b"\x00" * 64])
    batch.on_error = "skip"
    out = ops.decode_image()(batch)
    assert len(out.data["image"]) == 1 and [sample for sample, _ in out.errors] == [1, 2]
    assert all(isinstance(err, FormatError) for _, err in out.errors)
    assert "not an image format" in str(out.errors[1][1])


def _declaring(buf: bytes, height: int, width: int) -> bytes:
    """``buf`` (a baseline or progressive JPEG) with its frame header rewritten to
    declare ``height`` x ``width`` pixels; the scan data stays that of the small image."""
    at = next(buf.index(m) for m in (b"\xff\xc0", b"\xff\xc2") if m in buf)
    return buf[:at + 5] + height.to_bytes(2, "big") + width.to_bytes(2, "big") + buf[at + 9:]


@pytest.mark.parametrize("chain", ["decode", "fused", "slice"])
def test_images_over_the_pixel_limit_are_bad_samples(monkeypatch, pixels, chain):
    """A few KB may declare 65500 x 65500 pixels: never allocated or decoded, the row is
    a FormatError naming the limit; the other rows decode; ops.decode.MAX_PIXELS moves it."""
    good = pillow(pixels, "JPEG", quality=90)
    bombs = [_declaring(good, 65500, 65500), _declaring(pillow(pixels, "JPEG", progressive=True), 60000, 65000)]
    op = {"decode": lambda: ops.decode_image(),
          "fused": lambda: ops.Compose([ops.decode_image(), ops.resize((8, 8)), ops.normalize()]),
          "slice": lambda: ops.decode_image_slice()}[chain]

    def run(bufs):
        window = {"crop_anchor": [np.zeros(2, np.float32)] * len(bufs),
                  "crop_shape": [np.ones(2, np.float32)] * len(bufs)} if chain == "slice" else {}
        batch = make("cpu", bufs, **window)
        batch.on_error = "skip"
        return op()(batch)

    out = run([good, *bombs])
    assert [sample for sample, _ in out.errors] == [1, 2]
    assert all(isinstance(err, FormatError) and "MAX_PIXELS" in str(err) for _, err in out.errors)
    assert len(out.data["image"]) == 1
    monkeypatch.setattr(gpuio.ops.decode, "MAX_PIXELS", 45 * 70 - 1)
    out = run([good])
    assert len(out.errors) == 1 and "declares 70x45 pixels" in str(out.errors[0][1])


# ---------------------------------------------------------------- decode_image_slice


SLICES = [((0.0, 0.0), (1.0, 1.0)), ((0.1, 0.2), (0.5, 0.6)), ((0.63, 0.05), (0.37, 0.9)), ((0.3, 0.7), (0.01, 0.01))]


@pytest.mark.parametrize("name", ["jpeg", "jpeg-progressive", "jpeg-gray", "png-rgb", "jp2-lossless", "tiff-lzw"])
def test_decode_image_slice_equals_whole_decode_then_slice(device, name):
    pixels = sample_image(np.random.default_rng(12), 131, 197)
    encode = {"jpeg": lambda p: pillow(p, "JPEG", quality=90),
              "jpeg-progressive": lambda p: pillow(p, "JPEG", quality=90, progressive=True),
              "jpeg-gray": lambda p: pillow(p, "JPEG", "L", quality=90)}.get(name, CODECS.get(name, (None,))[0])
    buf = encode(pixels)
    bufs = [buf] * len(SLICES)
    whole = ops.decode_image()(make(device, bufs)).data["image"]
    batch = make(device, bufs, crop_anchor=[np.float32(a) for a, _ in SLICES],
                 crop_shape=[np.float32(s) for _, s in SLICES])
    sliced = ops.decode_image_slice()(batch).data["image"]
    for img, full, (anchor, shape) in zip(sliced, whole, SLICES):
        y0, x0, y1, x1 = crop_window(anchor, shape, 131, 197)
        ref = to_host(full)[y0:y1, x0:x1]
        img = to_host(img)
        assert img.shape == ref.shape
        # libjpeg's region decode upsamples chroma as the whole decode does (a margin is decoded)
        assert np.abs(img.astype(int) - ref).max() <= (0 if device == "cpu" else 2)


def test_slice_follows_random_bbox_crop_through_the_loader(tmp_path):
    from gpuio.bench.detection import write_coco

    root, ann = write_coco(tmp_path, count=6, size=(96, 128), seed=3)
    index = gpuio.formats.coco(root, ann, box_format="ltrb", normalized=True)
    crop = dict(aspect_ratio=(0.5, 2.0), thresholds=(0.1, 0.3), scaling=(0.3, 1.0), num_attempts=20)
    kw = dict(fields=["data", "boxes", "labels"], output="numpy", seed=5)
    roi = list(gpuio.Loader(index, 3, ops=[ops.random_bbox_crop(**crop), ops.decode_image_slice()], **kw))
    whole = list(gpuio.Loader(index, 3, ops=[ops.decode_image(), ops.random_bbox_crop(**crop)], **kw))
    for a, b in zip(roi, whole):
        for img, ref, boxes, ref_boxes in zip(a["image"], b["image"], a["boxes"], b["boxes"]):
            assert img.shape == ref.shape
            assert np.abs(img.astype(int) - ref).max() <= 0
            np.testing.assert_array_equal(boxes, ref_boxes)


def test_what_a_gpu_batch_sends_to_nvimagecodec(pixels):
    """The routing a GPU batch uses (the decode itself needs a GPU): complete baseline
    JPEGs, complete JPEG 2000 and TIFF go to nvImageCodec; the rest to the CPU."""
    from gpuio.ops.decode import gpu_decodable

    def arr(b):
        return np.frombuffer(b, np.uint8)

    jpeg = pillow(pixels, "JPEG", quality=90)
    j2k = CODECS["jp2-lossless"][0](pixels)
    routed = {"jpeg": jpeg, "jp2": j2k, "j2k": CODECS["j2k-codestream"][0](pixels),
              "tiff": CODECS["tiff-lzw"][0](pixels), "bigendian-tiff": CODECS["tiff-big-endian"][0](pixels)}
    cpu = {"progressive jpeg": pillow(pixels, "JPEG", progressive=True), "cut jpeg": jpeg[:-100],
           "cut jp2": j2k[:-100], "png": CODECS["png-rgb"][0](pixels), "webp": CODECS["webp-lossy"][0](pixels),
           "bmp": CODECS["bmp"][0](pixels), "cmyk jpeg": pillow(pixels, "JPEG", "CMYK"), "junk": b"\x00" * 32}
    assert {name: gpu_decodable(arr(b)) for name, b in routed.items()} == dict.fromkeys(routed, True)
    assert {name: gpu_decodable(arr(b)) for name, b in cpu.items()} == dict.fromkeys(cpu, False)
