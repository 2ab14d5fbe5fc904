"""Restart markers (``gpuio.ops.restart``): the lossless rewrite, against the source's
pixels and ``jpegtran``'s bytes, and windows decoded from the restart intervals that cover
them, bit-exact to decoding the whole source image and cropping it (also DCT-scaled), in
``decode_region`` and through ``DecodeFused``."""

from __future__ import annotations

import io
import shutil
import subprocess

import cv2
import numpy as np
import pytest
from PIL import Image

from conftest import to_host
from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.errors import ConfigError, FormatError
from gpuio.ops import fused
from gpuio.ops.decode import decode_cpu, jpeg_info, native_jpeg
from gpuio.ops.fused import DecodeFused
from gpuio.ops.restart import add_restart_markers, restarts_field
from gpuio.sample import sample_image

pytestmark = pytest.mark.skipif(native_jpeg() is None, reason="gpuio.ops._jpeg not built (no libjpeg headers)")

# (name, cv2 sampling factor or None for grayscale, MCU height, MCU width)
LAYOUTS = [("444", cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444, 8, 8), ("420", cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420, 16, 16),
           ("422", cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422, 8, 16), ("440", cv2.IMWRITE_JPEG_SAMPLING_FACTOR_440, 16, 8),
           ("411", cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411, 8, 32), ("gray", None, 8, 8)]


def encode(pixels: np.ndarray, sampling: int | None, **params: int) -> bytes:
    flags = [cv2.IMWRITE_JPEG_QUALITY, 90]
    if sampling is not None:
        flags += [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, sampling]
        pixels = pixels[:, :, ::-1]
    else:
        pixels = pixels[:, :, 0]
    for key, value in params.items():
        flags += [getattr(cv2, key), value]
    ok, data = cv2.imencode(".jpg", np.ascontiguousarray(pixels), flags)
    assert ok
    return data.tobytes()


def region(data: bytes, denom: int, window: tuple[int, int, int, int], restarts=None, gray=False) -> np.ndarray:
    y0, x0, y1, x1 = window
    out = np.empty((y1 - y0, x1 - x0, 1 if gray else 3), np.uint8)
    native_jpeg().decode_region(data, gray, denom, y0, x0, y1, x1, out, restarts)
    return out


def intervals(data: bytes, mcu_h: int, mcu_w: int) -> tuple[int, int]:
    """MCUs per row and MCU rows of a JPEG."""
    info = jpeg_info(data)
    return -(-info.width // mcu_w), -(-info.height // mcu_h)


@pytest.fixture(scope="module")
def images():
    """Per layout a JPEG whose sides are not multiples of its MCU (partial MCUs at the
    right and bottom edges)."""
    rng = np.random.default_rng(5)
    pixels = sample_image(rng, 203, 261)
    return {name: (encode(pixels, sampling), mcu_h, mcu_w) for name, sampling, mcu_h, mcu_w in LAYOUTS}


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS])
def test_markers_are_lossless_and_offsets_point_after_each_marker(images, name):
    data, mcu_h, mcu_w = images[name]
    per_row, rows = intervals(data, mcu_h, mcu_w)
    whole = decode_cpu(data, "rgb", 0)
    for interval in (0, 1, 3, per_row, 2 * per_row + 1):
        marked, offsets = add_restart_markers(data, interval, fit_rows=False)
        assert (decode_cpu(marked, "rgb", 0) == whole).all()
        assert add_restart_markers(data, interval, fit_rows=False)[0] == marked  # deterministic
        mcus = interval or per_row
        assert offsets.dtype == np.uint32 and len(offsets) == -(-per_row * rows // mcus)
        sos = 10 if name == "gray" else 14  # the SOS marker's bytes with 1 or 3 components: the scan follows
        assert marked[offsets[0] - sos: offsets[0] - sos + 2] == b"\xff\xda"
        for k in range(1, len(offsets)):
            assert marked[offsets[k] - 2: offsets[k]] == bytes([0xFF, 0xD0 + (k - 1) % 8])
            assert b"\xff\xd0" not in marked[offsets[k - 1]: offsets[k] - 2].replace(b"\xff\x00", b"")
        assert marked[-2:] == b"\xff\xd9"


@pytest.mark.parametrize("name, asked, fitted", [("444", 4, 3), ("444", 40, 33), ("444", 60, 66), ("444", 0, 33),
                                                ("420", 4, 17), ("420", 8, 17), ("411", 4, 3), ("gray", 8, 11),
                                                ("gray", 2, 3)])
def test_fit_rows_picks_an_interval_that_tiles_the_rows(images, name, asked, fitted):
    """261 pixels across: 33 MCUs of 8 (4:4:4, gray), 17 of 16 (4:2:0), 9 of 32 (4:1:1)."""
    data, mcu_h, mcu_w = images[name]
    per_row, rows = intervals(data, mcu_h, mcu_w)
    marked, offsets = add_restart_markers(data, asked)
    dri = marked.index(b"\xff\xdd\x00\x04")
    assert int.from_bytes(marked[dri + 4: dri + 6], "big") == fitted
    assert len(offsets) == -(-per_row * rows // fitted)


def test_progressive_source_comes_out_sequential_with_the_same_pixels():
    data = encode(sample_image(np.random.default_rng(2), 120, 97), cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420,
                  IMWRITE_JPEG_PROGRESSIVE=1)
    assert jpeg_info(data).progressive
    marked, offsets = add_restart_markers(data, 0)
    assert not jpeg_info(marked).progressive and len(offsets) == -(-120 // 16)
    assert (decode_cpu(marked, "rgb", 0) == decode_cpu(data, "rgb", 0)).all()


def test_exif_orientation_and_icc_profile_are_kept():
    """Metadata the rewrite keeps; a window from the intervals decodes the same pixels."""
    pixels = sample_image(np.random.default_rng(4), 64, 80)
    exif = Image.Exif()
    exif[0x0112] = 6
    icc = b"\0\0\2\0ICC-profile-bytes" * 40
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90, exif=exif.tobytes(), icc_profile=icc)
    marked, offsets = add_restart_markers(buf.getvalue(), 4)
    assert jpeg_info(marked).orientation == 6
    assert Image.open(io.BytesIO(marked)).info["icc_profile"] == icc
    assert (decode_cpu(marked, "rgb", 0) == decode_cpu(buf.getvalue(), "rgb", 0)).all()
    # a window decoded from the intervals (their JPEG leaves the metadata out): the same pixels
    whole = region(buf.getvalue(), 1, (0, 0, 64, 80))
    assert (region(marked, 1, (20, 40, 40, 80), offsets) == whole[20:40, 40:80]).all()


@pytest.mark.skipif(shutil.which("jpegtran") is None, reason="jpegtran not installed (Debian: libjpeg-turbo-progs)")
@pytest.mark.parametrize("interval", [0, 5])
def test_bytes_equal_jpegtran(tmp_path, images, interval):
    """The same transcoding as ``jpegtran -optimize -restart N[B]`` (no metadata to copy)."""
    data = images["420"][0]
    (tmp_path / "in.jpg").write_bytes(data)
    restart = f"{interval}B" if interval else "1"
    subprocess.run(["jpegtran", "-copy", "none", "-optimize", "-restart", restart, "-outfile",
                    str(tmp_path / "out.jpg"), str(tmp_path / "in.jpg")], check=True)
    assert add_restart_markers(data, interval, fit_rows=False)[0] == (tmp_path / "out.jpg").read_bytes()


def test_bad_input_is_named():
    with pytest.raises(FormatError, match="cannot add restart markers to a JPEG of 9 bytes"):
        add_restart_markers(b"not a jpg", 4)
    with pytest.raises(ConfigError, match="0 \\(every MCU row\\) to 65535"):
        add_restart_markers(b"\xff\xd8", 70000)


def windows(rng: np.random.Generator, h: int, w: int, count: int, mcu_h: int, mcu_w: int
            ) -> list[tuple[int, int, int, int]]:
    """Random windows of an h x w image, ones on each edge and corner, and ones that
    start and end on (or a pixel off) the grid of ``mcu_h`` x ``mcu_w`` pixels."""
    out = [(0, 0, h, w), (0, 0, 1, 1), (h - 1, w - 1, h, w), (0, w // 2, h // 3, w), (h // 2, 0, h, 1 + w // 5),
           (h // 3, w // 3, h // 3 + 1, w // 3 + 1)]
    for off in (-1, 0, 1):
        y0, x0 = min(h - 1, max(0, 2 * mcu_h + off)), min(w - 1, max(0, 3 * mcu_w + off))
        out.append((y0, x0, max(y0 + 1, min(h, y0 + 2 * mcu_h + off)), max(x0 + 1, min(w, x0 + mcu_w + 1 - off))))
    for _ in range(count):
        y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
        out.append((y0, x0, int(rng.integers(y0 + 1, h + 1)), int(rng.integers(x0 + 1, w + 1))))
    return out


@pytest.mark.parametrize("name", [layout[0] for layout in LAYOUTS])
def test_window_from_restart_intervals_equals_whole_decode_cropped(images, name):
    """Intervals of one MCU row, two rows, a part of a row (columns skipped too) and one
    that fits neither (decoded from the whole stream): every window at every DCT scale
    equals the same window of the whole source image decoded at that scale (the decoded
    intervals reach EDGE pixels beyond the window, which the chroma upsampler reads)."""
    data, mcu_h, mcu_w = images[name]
    per_row, _ = intervals(data, mcu_h, mcu_w)
    gray = name == "gray"
    rng = np.random.default_rng(len(name))
    parts = [n for n in range(2, per_row) if per_row % n == 0] or [1]
    for interval in (0, 2 * per_row, parts[0], per_row + 1):
        marked, offsets = add_restart_markers(data, interval, fit_rows=False)
        for denom in (1, 2, 4, 8):
            h, w = -(-203 // denom), -(-261 // denom)
            whole = region(data, denom, (0, 0, h, w), gray=gray)
            for y0, x0, y1, x1 in windows(rng, h, w, 8, max(1, mcu_h // denom), max(1, mcu_w // denom)):
                got = region(marked, denom, (y0, x0, y1, x1), offsets, gray)
                assert (got == whole[y0:y1, x0:x1]).all(), (interval, denom, (y0, x0, y1, x1))


def test_only_the_intervals_a_window_covers_are_read(images):
    """An interval above the window, made corrupt: the whole-stream decode stops on it,
    the decode from the window's intervals never reads it."""
    data = images["420"][0]
    marked, offsets = add_restart_markers(data, 0)
    corrupt = bytearray(marked)
    corrupt[offsets[2]: offsets[3] - 2] = b"\xff\x11" * ((offsets[3] - 2 - offsets[2]) // 2) + \
        b"\x11" * ((offsets[3] - 2 - offsets[2]) % 2)
    window = (120, 30, 190, 200)
    with pytest.raises(ValueError, match="Corrupt JPEG data"):
        region(bytes(corrupt), 1, window)
    assert (region(bytes(corrupt), 1, window, offsets) == region(data, 1, (0, 0, 203, 261))[120:190, 30:200]).all()


def test_offsets_that_do_not_fit_the_jpeg_are_refused(images):
    data = images["444"][0]
    marked, offsets = add_restart_markers(data, 0)
    with pytest.raises(ValueError, match="restart offsets starting at byte"):
        region(marked, 1, (100, 0, 120, 20), offsets[:-1])
    moved = offsets.copy()
    moved[10] += 1
    with pytest.raises(ValueError, match="restart interval 9 .* does not end with marker 0xFFD1"):
        region(marked, 1, (70, 0, 90, 20), moved)
    with pytest.raises(ValueError, match="multiple of 4|uint32"):
        region(marked, 1, (150, 0, 170, 20), offsets.tobytes()[:-1])
    # no markers in the JPEG (DRI absent): offsets are not used, the window decodes as without
    assert (region(data, 1, (100, 0, 120, 20), offsets) == region(data, 1, (100, 0, 120, 20))).all()


CHAINS = {
    "rrc-flip": lambda: [ops.random_resized_crop(48), ops.flip(), ops.normalize([120.0] * 3, [60.0] * 3)],
    "val": lambda: [ops.resize(shorter=64), ops.center_crop(56), ops.normalize([120.0] * 3, [60.0] * 3)],
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_decode_fused_with_restarts_equals_it_on_the_source(monkeypatch, images, chain):
    """``DecodeFused`` over restart-marked JPEGs with their offsets in ``data.restarts``
    (some rows without: None, empty, a PNG; one with offsets that do not fit: decoded
    whole) gives exactly the output of the source JPEGs without offsets, with and
    without DCT scaling."""
    rng = np.random.default_rng(9)
    sources = [images[name][0] for name, *_ in LAYOUTS if name != "gray"]
    sources += [encode(sample_image(rng, h, w), cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420) for h, w in
                [(375, 500), (500, 333), (240, 320)]]
    marked = [add_restart_markers(s, k % 3 * 2) for k, s in enumerate(sources)]
    png = io.BytesIO()
    Image.fromarray(sample_image(rng, 70, 90)).save(png, "PNG")
    data = [m for m, _ in marked] + [sources[0], sources[1], png.getvalue(), marked[2][0]]
    restarts = [o.tobytes() for _, o in marked] + [None, np.zeros(0, np.uint32), np.zeros(0, np.uint8),
                                                   marked[3][1]]
    source_data = sources + [sources[0], sources[1], png.getvalue(), sources[2]]
    pipe = ops.Compose([ops.decode_image()] + CHAINS[chain]())
    assert isinstance(pipe.fused[0], DecodeFused)
    index = np.arange(len(data))

    def run(values, offsets):
        fields = {"data": list(values)} | ({restarts_field("data"): offsets} if offsets is not None else {})
        return pipe(Batch(fields, index, sample_seeds(3, 0, index)))

    for scaled in (True, False):
        if not scaled:
            monkeypatch.setattr(fused, "dct_denoms", lambda box, out_hw, subsampling: np.ones(len(box), np.int64))
        want = run(source_data, None).data["image"]
        batch = run(data, restarts)
        got = batch.data["image"]
        assert len(got) == len(want) == len(data)
        for g, w in zip(got, want):
            assert g.shape == w.shape and (g == w).all()
        assert [(row, message.split(":")[0]) for row, message in batch.warnings] == \
            [(len(data) - 1, "decoded without its restart offsets")]


@pytest.mark.parametrize("geometry", [
    lambda: [ops.resize(64), ops.center_crop(56)],
    lambda: [ops.resize(100, interp="area"), ops.center_crop((40, 90)), ops.flip(True, 1.0)],
    lambda: [ops.resize(60, interp="nearest"), ops.center_crop(30)],
    lambda: [ops.resize(150, antialias=False), ops.center_crop(100)],
    lambda: [ops.center_crop(120), ops.resize(64), ops.center_crop(33)],
])
def test_crop_after_resize_decodes_only_what_the_filter_reads(monkeypatch, images, geometry):
    """A crop after a resize narrows the window decoded to the pixels the resampler's
    filter reads for it (before, the whole image): the same output, bit for bit, with and
    without DCT scaling and restart offsets."""
    rng = np.random.default_rng(12)
    sources = [encode(sample_image(rng, h, w), cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420) for h, w in
               [(375, 500), (500, 333), (203, 261), (640, 480)]]
    marked = [add_restart_markers(s, 4) for s in sources]
    pipe = ops.Compose([ops.decode_image(), *geometry(), ops.normalize([120.0] * 3, [60.0] * 3, layout="HWC")])
    assert isinstance(pipe.fused[0], DecodeFused)
    index = np.arange(len(sources))
    batches = {"source": {"data": sources},
               "restarts": {"data": [m for m, _ in marked], restarts_field("data"): [o for _, o in marked]}}
    narrowed = {k: pipe(Batch(dict(v), index, sample_seeds(1, 0, index))).data["image"] for k, v in batches.items()}
    monkeypatch.setattr(fused, "_filter_clip", lambda plan, interp, antialias: plan["clip"])
    whole = pipe(Batch(dict(batches["source"]), index, sample_seeds(1, 0, index))).data["image"]
    for got in narrowed.values():
        assert all(np.array_equal(g, w) for g, w in zip(got, whole))


def test_restart_marked_jpegs_decode_alike_on_every_device(images, device):
    """On the GPU (nvImageCodec's region decode; the offsets are not needed there) as on
    the CPU, the fused chain over restart-marked baseline JPEGs with their offsets gives
    exactly its output over the source JPEGs."""
    sources = [images[name][0] for name in ("444", "420", "422")]
    marked = [add_restart_markers(s, 2) for s in sources]
    index = np.arange(len(sources))
    pipe = ops.Compose([ops.decode_image(), *CHAINS["rrc-flip"]()])

    def run(fields):
        return [to_host(x) for x in pipe(Batch(fields, index, sample_seeds(2, 0, index),
                                               device=Device(device))).data["image"]]

    want = run({"data": sources})
    got = run({"data": [m for m, _ in marked], restarts_field("data"): [o for _, o in marked]})
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
