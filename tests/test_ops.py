"""CPU contracts of gpuio.ops: decode (JPEG kinds, EXIF, PNG, bad bytes), geometry,
colour, normalize, Compose. Real JPEGs and PNGs written with Pillow."""

import io
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

import gpuio
from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.errors import ConfigError, DataError, FormatError
from gpuio.ops.decode import jpeg_info
from gpuio.ops.fused import FusedCropResizeNormalize, _fuse
from gpuio.sample import sample_image


def make_batch(values, seed=0, epoch=0, on_error="raise", field="data", start=0):
    index = np.arange(start, start + len(values))
    return Batch({field: list(values)}, index, sample_seeds(seed, epoch, index), on_error=on_error)


def encode(pixels, fmt="JPEG", **kw):
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **kw)
    return np.frombuffer(buf.getvalue(), np.uint8)


@pytest.fixture(scope="module")
def pixels():
    return sample_image(np.random.default_rng(5), 120, 160)


def pillow_rgb(buf, exif=True):
    with Image.open(io.BytesIO(buf.tobytes())) as im:
        return np.asarray((ImageOps.exif_transpose(im) if exif else im).convert("RGB"))


# ---------------------------------------------------------------- decode


def test_decode_baseline_progressive_equal_pillow(pixels):
    bufs = [encode(pixels, quality=90), encode(pixels, quality=85, progressive=True),
            encode(pixels, quality=95, subsampling=0)]
    assert jpeg_info(bufs[0]) == (3, False, 1, 120, 160) and jpeg_info(bufs[1]) == (3, True, 1, 120, 160)
    out = ops.decode_image()(make_batch(bufs)).data["image"]
    for buf, img in zip(bufs, out):
        assert img.shape == (120, 160, 3) and img.dtype == np.uint8 and img.flags.c_contiguous
        # simplejpeg and Pillow both run libjpeg-turbo's default (islow DCT, fancy upsampling)
        assert np.abs(img.astype(int) - pillow_rgb(buf)).max() <= 1
    assert np.abs(out[0].astype(int) - pixels).mean() < 6


def test_decode_gray_and_cmyk(pixels):
    gray = encode(np.asarray(Image.fromarray(pixels).convert("L")))
    cmyk_buf = io.BytesIO()
    Image.fromarray(pixels).convert("CMYK").save(cmyk_buf, "JPEG", quality=95)
    cmyk = np.frombuffer(cmyk_buf.getvalue(), np.uint8)
    assert jpeg_info(gray).components == 1 and jpeg_info(cmyk).components == 4
    rgb = ops.decode_image(color="rgb")(make_batch([gray, cmyk])).data["image"]
    assert [im.shape for im in rgb] == [(120, 160, 3)] * 2
    assert np.array_equal(rgb[0][..., 0], rgb[0][..., 2])  # gray expanded to 3 equal channels
    assert np.abs(rgb[0].astype(int) - pillow_rgb(gray)).max() <= 1
    assert np.abs(rgb[1].astype(int) - pillow_rgb(cmyk)).max() <= 1
    assert np.abs(rgb[1].astype(int) - pixels).mean() < 8
    one = ops.decode_image(color="gray")(make_batch([gray, cmyk])).data["image"]
    assert [im.shape for im in one] == [(120, 160, 1)] * 2
    same = ops.decode_image(color="unchanged")(make_batch([gray, cmyk])).data["image"]
    assert [im.shape for im in same] == [(120, 160, 1), (120, 160, 3)]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_decode_exif_orientation_matches_pillow(pixels, orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = encode(pixels, exif=exif.tobytes())
    assert jpeg_info(buf).orientation == orientation
    img = ops.decode_image()(make_batch([buf])).data["image"][0]
    assert np.array_equal(img, pillow_rgb(buf))
    assert img.shape[:2] == ((160, 120) if orientation >= 5 else (120, 160))
    png = encode(pixels, "PNG", exif=exif.tobytes())  # PNG goes through Pillow; EXIF applied too
    out = ops.decode_image()(make_batch([png])).data["image"][0]
    assert np.array_equal(out, pillow_rgb(png)) and out.shape == img.shape


def test_decode_png_modes(pixels):
    rgba = np.dstack([pixels, np.full(pixels.shape[:2], 200, np.uint8)])
    pal = Image.fromarray(pixels).quantize(16)
    buf = io.BytesIO()
    pal.save(buf, "PNG")
    bufs = [encode(pixels, "PNG"), encode(rgba, "PNG"), np.frombuffer(buf.getvalue(), np.uint8),
            encode(pixels[..., 0], "PNG")]
    rgb = ops.decode_image()(make_batch(bufs)).data["image"]
    assert np.array_equal(rgb[0], pixels) and np.array_equal(rgb[1], pixels)
    assert np.array_equal(rgb[2], np.asarray(pal.convert("RGB")))
    assert np.array_equal(rgb[3], np.repeat(pixels[..., :1], 3, axis=2))
    same = ops.decode_image(color="unchanged")(make_batch(bufs)).data["image"]
    assert [im.shape[2] for im in same] == [3, 4, 3, 1]
    assert np.array_equal(same[1], rgba)


def test_decode_bad_bytes_raise_or_skip(pixels):
    good = encode(pixels)
    truncated = good[: len(good) // 2]
    garbage = np.frombuffer(b"not an image at all", np.uint8)
    with pytest.raises(FormatError, match="sample 11"):
        ops.decode_image()(make_batch([good, truncated], start=10))
    with pytest.raises(FormatError, match="sample 10"):
        ops.decode_image()(make_batch([garbage], start=10))
    batch = make_batch([good, truncated, good, garbage], on_error="skip")
    batch.data["label"] = np.array([5, 6, 7, 8])
    batch = ops.decode_image()(batch)
    assert batch.index.tolist() == [0, 2] and batch.data["label"].tolist() == [5, 7]
    assert len(batch.data["image"]) == 2 and [i for i, _ in batch.errors] == [1, 3]
    assert all(isinstance(e, FormatError) for _, e in batch.errors)


def test_decode_bad_color_and_bytes_input(pixels):
    with pytest.raises(ConfigError, match="color"):
        ops.decode_image(color="bgr")
    assert ops.decode_image().host_inputs == ("data", "data.restarts")
    img = ops.decode_image()(make_batch([encode(pixels).tobytes()])).data["image"][0]
    assert img.shape == (120, 160, 3)


# ---------------------------------------------------------------- geometry


def images_batch(sizes, seed=0):
    rng = np.random.default_rng(0)
    batch = make_batch([None] * len(sizes), seed=seed)
    batch.data["image"] = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    return batch


def test_resize_sizes():
    sizes = [(375, 500), (500, 375), (100, 100)]
    out = ops.resize(shorter=256)(images_batch(sizes)).data["image"]
    assert [im.shape for im in out] == [(256, 341, 3), (341, 256, 3), (256, 256, 3)]
    out = ops.resize(longer=100)(images_batch(sizes)).data["image"]
    assert [im.shape for im in out] == [(75, 100, 3), (100, 75, 3), (100, 100, 3)]
    out = ops.resize((64, 32), interp="cubic")(images_batch(sizes)).data["image"]
    assert all(im.shape == (64, 32, 3) and im.dtype == np.uint8 for im in out)
    with pytest.raises(ConfigError):
        ops.resize((64, 32), shorter=3)
    with pytest.raises(ConfigError, match="interp"):
        ops.resize(10, interp="lanczos")


def test_center_crop_placement_and_small_image():
    batch = images_batch([(11, 20), (4, 4)])
    src = list(batch.data["image"])
    batch.on_error = "skip"
    out = ops.center_crop((5, 6))(batch).data["image"]
    # torchvision: top = round((11 - 5) / 2) = 3, left = round((20 - 6) / 2) = 7
    assert len(out) == 1 and np.array_equal(out[0], src[0][3:8, 7:13])
    assert isinstance(batch.errors[0][1], DataError) and "smaller than the center crop" in str(batch.errors[0][1])
    with pytest.raises(DataError, match="sample 1"):
        ops.center_crop(5)(images_batch([(11, 20), (4, 4)]))


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 700), w=st.integers(1, 700), seed=st.integers(0, 2**32),
       lo=st.floats(0.01, 1.0), ratio_lo=st.floats(0.2, 1.0))
def test_random_resized_crop_boxes_in_bounds(h, w, seed, lo, ratio_lo):
    op = ops.random_resized_crop(8, scale=(lo, 1.0), ratio=(ratio_lo, 1 / ratio_lo))
    batch = make_batch([None] * 4, seed=seed)
    boxes, ok = op.boxes(batch, np.array([[h, w]] * 4))
    assert ok.all()
    t, l, ch, cw = boxes.T
    assert (t >= 0).all() and (l >= 0).all() and (ch >= 1).all() and (cw >= 1).all()
    assert (t + ch <= h).all() and (l + cw <= w).all()


def test_random_resized_crop_distribution_and_determinism():
    op = ops.random_resized_crop(224)
    hw = np.array([[375, 500]] * 400)
    boxes, _ = op.boxes(make_batch([None] * 400, seed=1), hw)
    again, _ = op.boxes(make_batch([None] * 400, seed=1), hw)
    other, _ = op.boxes(make_batch([None] * 400, seed=2), hw)
    assert np.array_equal(boxes, again) and not np.array_equal(boxes, other)
    area = boxes[:, 2] * boxes[:, 3] / (375 * 500)
    ratio = boxes[:, 3] / boxes[:, 2]
    assert 0.07 <= area.min() and area.max() <= 1.0 and 0.35 < area.mean() < 0.54  # draws too large for the image are retried
    assert ratio.min() > 0.7 and ratio.max() < 1.4
    # a strip whose ratio no draw fits falls back to the center crop of the closest ratio
    fallback, _ = ops.random_resized_crop(8, scale=(0.99, 1.0)).boxes(make_batch([None]), np.array([[10, 400]]))
    assert fallback.tolist() == [[0, (400 - 13) // 2, 10, 13]]
    out = op(images_batch([(375, 500), (30, 40)])).data["image"]
    assert [im.shape for im in out] == [(224, 224, 3)] * 2


def test_random_resized_crop_is_crop_then_resize():
    batch = images_batch([(120, 90)], seed=4)
    src = batch.data["image"][0]
    op = ops.random_resized_crop((20, 30))
    boxes, _ = op.boxes(batch, np.array([[120, 90]]))
    t, l, h, w = boxes[0].tolist()
    expected = np.asarray(Image.fromarray(np.ascontiguousarray(src[t:t + h, l:l + w]))
                          .resize((30, 20), Image.BILINEAR, reducing_gap=None))
    assert np.array_equal(op(batch).data["image"][0], expected)


def test_flip_p0_p1_and_per_sample():
    batch = images_batch([(5, 7)] * 3)
    src = list(batch.data["image"])
    assert all(np.array_equal(a, b) for a, b in zip(ops.flip(p=0.0)(batch).data["image"], src))
    batch.data["image"] = list(src)
    out = ops.flip(p=1.0)(batch).data["image"]
    assert all(np.array_equal(a, b[:, ::-1]) for a, b in zip(out, src))
    batch.data["image"] = list(src)
    out = ops.flip(horizontal=False, p=1.0)(batch).data["image"]
    assert all(np.array_equal(a, b[::-1]) for a, b in zip(out, src))
    flips = ops.flip().flips(make_batch([None] * 1000, seed=9))
    assert set(flips.tolist()) == {0, 1} and 400 < flips.sum() < 600
    assert np.array_equal(flips, ops.flip().flips(make_batch([None] * 1000, seed=9)))
    with pytest.raises(ConfigError):
        ops.flip(p=2)


# ---------------------------------------------------------------- colour, normalize


def test_normalize_layouts_and_dtypes():
    batch = images_batch([(4, 6)] * 2)
    src = np.stack(batch.data["image"]).astype(np.float32)
    mean, std = [120.0, 110.0, 100.0], [60.0, 50.0, 40.0]
    out = ops.normalize(mean, std)(batch).data["image"]
    assert out.shape == (2, 3, 4, 6) and out.dtype == np.float32
    want = ((src - np.float32(mean)) * (1 / np.float32(std))).transpose(0, 3, 1, 2)
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
    batch = images_batch([(4, 6)] * 2)
    out = ops.normalize(mean, std, layout="HWC", dtype="float16")(batch).data["image"]
    assert out.shape == (2, 4, 6, 3) and out.dtype == np.float16
    np.testing.assert_allclose(out, want.transpose(0, 2, 3, 1), atol=1e-2)
    batch = images_batch([(4, 6)] * 2)
    out = ops.normalize(0, 1, dtype="uint8")(batch).data["image"]
    assert out.dtype == np.uint8 and np.array_equal(out, src.astype(np.uint8).transpose(0, 3, 1, 2))
    ragged = ops.normalize(mean, std)(images_batch([(4, 6), (5, 6)])).data["image"]
    assert isinstance(ragged, list) and [r.shape for r in ragged] == [(3, 4, 6), (3, 5, 6)]
    with pytest.raises(ConfigError, match="std"):
        ops.normalize(0, [1, 0, 1])
    with pytest.raises(ConfigError, match="channel"):
        ops.normalize([1, 2], 1)(images_batch([(2, 2)]))


def test_color_jitter():
    batch = images_batch([(16, 16)] * 4, seed=3)
    src = list(batch.data["image"])
    same = ops.color_jitter()(batch).data["image"]
    assert all(np.array_equal(a, b) for a, b in zip(same, src))
    jitter = ops.color_jitter(0.4, 0.4, 0.4, 0.1)
    batch.data["image"] = list(src)
    a = jitter(batch).data["image"]
    batch.data["image"] = list(src)
    b = jitter(batch).data["image"]
    assert all(np.array_equal(x, y) and x.dtype == np.uint8 and x.shape == (16, 16, 3) for x, y in zip(a, b))
    assert not np.array_equal(a[0], src[0])
    # brightness alone scales every pixel by one factor in [0.6, 1.4]
    batch.data["image"] = [np.full((4, 4, 3), 100, np.uint8)]
    out = ops.color_jitter(brightness=0.4)(batch).data["image"][0]
    assert len(np.unique(out)) == 1 and 60 <= out[0, 0, 0] <= 140
    # a hue shift of a gray image changes nothing; saturation 0 of 1-channel images is skipped
    batch.data["image"] = [np.full((4, 4, 3), 77, np.uint8), np.full((4, 4, 1), 9, np.uint8)]
    out = ops.color_jitter(saturation=0.9, hue=0.5)(batch).data["image"]
    assert (out[0] == 77).all() and (out[1] == 9).all()
    # a full hue turn of a coloured image comes back to itself
    from gpuio.ops.color import _shift_hue

    rgb = src[0].astype(np.float32)
    np.testing.assert_allclose(_shift_hue(np, rgb, 1.0), rgb, atol=1e-3)
    np.testing.assert_allclose(_shift_hue(np, rgb, 1 / 3)[..., [1, 2, 0]], rgb, atol=1e-3)
    with pytest.raises(ConfigError):
        ops.color_jitter(hue=0.7)


# ---------------------------------------------------------------- Compose, fusion


def test_compose_pipeline_contract(pixels):
    bufs = [encode(pixels), encode(pixels[:90]), encode(pixels, progressive=True)]
    pipe = ops.Compose([ops.decode_image(), ops.random_resized_crop(32), ops.flip(),
                        ops.normalize([127.0] * 3, [64.0] * 3)])
    assert pipe.host_inputs == ("data", "data.restarts")
    out = pipe(make_batch(bufs, seed=1)).data["image"]
    again = pipe(make_batch(bufs, seed=1)).data["image"]
    other = pipe(make_batch(bufs, seed=2)).data["image"]
    assert out.shape == (3, 3, 32, 32) and out.dtype == np.float32
    assert np.array_equal(out, again) and not np.array_equal(out, other)
    assert -2.5 < out.min() and out.max() < 2.5


def test_fuse_detects_chains():
    dec, rrc, fl, norm = ops.decode_image(), ops.random_resized_crop(8), ops.flip(), ops.normalize()
    fused = _fuse([dec, rrc, fl, norm])
    assert fused[0] is dec and isinstance(fused[1], FusedCropResizeNormalize) and len(fused) == 2
    assert fused[1].ops == [rrc, fl, norm]
    res, cc = ops.resize(shorter=16), ops.center_crop(8)
    assert _fuse([dec, res, cc, norm])[1].ops == [res, cc, norm]
    jit = ops.color_jitter(0.1)
    broken = _fuse([dec, rrc, jit, norm])  # jitter breaks the chain: the crop fuses to uint8 HWC, normalize alone
    assert broken[0] is dec and broken[2:] == [jit, norm] and broken[1].ops[0] is rrc
    assert (broken[1].normalize.dtype, broken[1].normalize.layout) == ("uint8", "HWC")
    assert [type(o).__name__ for o in _fuse([dec, res, fl])[1].ops] == ["Resize", "Flip", "Normalize"]
    assert _fuse([dec, cc]) == [dec, cc]  # no resampling step: nothing to gain
    assert _fuse([dec, ops.resize((8, 8), interp="cubic")])[1:][0].interp == "cubic"  # not in C: op by op
    two = _fuse([res, rrc, fl, norm])  # two resamples: only the last one fuses
    assert two[0] is res and two[1].ops == [rrc, fl, norm]
    with pytest.raises(ConfigError, match="resamples once"):
        FusedCropResizeNormalize([res, rrc, norm])
    with pytest.raises(ConfigError, match="ends with normalize"):
        FusedCropResizeNormalize([rrc, fl])


def test_imports():
    assert gpuio.ops is ops and set(ops.__all__) <= set(dir(ops))
    assert math.isclose(ops.random_resized_crop(3).ratio[1], 4 / 3)
