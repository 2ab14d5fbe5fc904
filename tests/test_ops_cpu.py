"""The CPU fast paths of gpuio.ops: the C resampler (``gpuio.ops._resample``) against the NumPy
reference, region and DCT-scaled JPEG decoding (``gpuio.ops._jpeg``) against whole-image
decoding, and ``DecodeFused`` against decoding then running the chain op by op. Real
JPEGs written with Pillow."""

import glob
import importlib.util
import io
import math
import pathlib
import subprocess
import sysconfig

import numpy as np
import pytest
from PIL import Image

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.errors import FormatError
from gpuio.ops import decode, fused
from gpuio.ops.decode import decode_cpu, decode_region, facts_info, jpeg_facts, jpeg_info, region_decodable
from gpuio.ops.fused import DecodeFused, FusedCropResizeNormalize, fused_reference
from gpuio.ops.geometry import image_sizes
from gpuio.sample import make_image_tree, sample_image

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]


def make_batch(values, field="data", on_error="raise", seed=4):
    index = np.arange(len(values))
    return Batch({field: list(values)}, index, sample_seeds(seed, 0, index), on_error=on_error)


def encode(pixels, **kw):
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", **kw)
    return np.frombuffer(buf.getvalue(), np.uint8)


@pytest.fixture(scope="module")
def jpegs():
    """JPEGs of every layout the region decoder takes (4:2:0, 4:2:2, 4:4:4, gray,
    progressive, odd sizes) plus the sample generator's (CMYK, EXIF-rotated ...)."""
    rng = np.random.default_rng(3)
    out = []
    for h, w, kw in [(120, 160, {}), (97, 131, {"subsampling": 1}), (150, 90, {"subsampling": 0}),
                     (101, 203, {"progressive": True}), (333, 517, {"quality": 80})]:
        out.append(encode(sample_image(rng, h, w), quality=kw.pop("quality", 90), **kw))
    out.append(encode(sample_image(rng, 130, 170)[:, :, 0]))
    return out


@pytest.fixture(scope="module")
def tree_jpegs(tmp_path_factory):
    root = make_image_tree(tmp_path_factory.mktemp("imgs"), count=40, classes=2, seed=7, progress=False)
    return [np.fromfile(p, np.uint8) for p in sorted(glob.glob(f"{root}/*/*.jpg"))]


def levels(a, b, normalize):
    """|a - b| in 0-255 pixel levels."""
    scale = 1.0 if normalize.dtype == "uint8" else np.asarray(STD, np.float32)
    if normalize.layout == "CHW" and normalize.dtype != "uint8":
        scale = np.reshape(scale, (-1, 1, 1))
    return np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) * scale


CHAINS = {
    "rrc-flip": lambda: [ops.random_resized_crop(64), ops.flip(), ops.normalize(MEAN, STD)],
    "resize-area-hwc": lambda: [ops.resize((40, 56), interp="area"), ops.normalize(MEAN, STD, layout="HWC")],
    "nearest-vflip-u8": lambda: [ops.random_resized_crop(48, interp="nearest"), ops.flip(False, p=1.0),
                                 ops.normalize(0, 1, dtype="uint8")],
    "hwc-u8": lambda: [ops.resize((40, 57)), ops.normalize(0, 1, layout="HWC", dtype="uint8")],
    "shorter-ragged": lambda: [ops.resize(shorter=50), ops.normalize(MEAN, STD)],
    "crop-resize-crop": lambda: [ops.center_crop(60), ops.resize(shorter=50), ops.center_crop((40, 50)),
                                 ops.normalize(MEAN, STD)],
}


def require_built(module, name, what):
    if module is None:  # the install builds it where `what` exists; CI machines have it
        pytest.fail(f"{name} was not built: {what}?")


@pytest.fixture(scope="module")
def portable_resample(tmp_path_factory):
    """``ops/_resample.c`` built with ``GPUIO_PORTABLE``: the plain C resampler (no
    AVX2 path, no run-time clones), which CPUs without AVX2 run. Needs the C compiler
    the install builds the module with."""
    cc = sysconfig.get_config_var("CC").split()[0]
    path = tmp_path_factory.mktemp("portable") / ("_resample" + sysconfig.get_config_var("EXT_SUFFIX"))
    source = pathlib.Path(fused.__file__).resolve().parents[1] / "ops" / "_resample.c"
    subprocess.run([cc, "-O3", "-shared", "-fPIC", "-DGPUIO_PORTABLE", f"-I{sysconfig.get_paths()['include']}",
                    "-o", str(path), str(source)], check=True, capture_output=True)
    spec = importlib.util.spec_from_file_location("_resample", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", list(CHAINS))
def test_c_resampler_matches_reference(monkeypatch, jpegs, portable_resample, name):
    """The C resampler as built (AVX2 where the CPU has it) and its plain C build
    (``portable_resample``) against the NumPy reference."""
    require_built(fused._resample, "gpuio.ops._resample", "is a C compiler installed")
    images = [decode_cpu(b, "rgb", i) for i, b in enumerate(jpegs)]
    images[1] = images[1][::-1, ::2]  # a strided view
    chain = CHAINS[name]()
    op = FusedCropResizeNormalize(chain)
    plan = op.plan(make_batch(images, field="image"), image_sizes(images))
    mean, inv_std = chain[-1].channel_params(3)
    ref = fused_reference(images, plan, mean, inv_std, interp=op.interp, antialias=op.antialias,
                          layout=chain[-1].layout, dtype=chain[-1].dtype)
    for module in (fused._resample, portable_resample):
        monkeypatch.setattr(fused, "_resample", module)
        out = op(make_batch(images, field="image")).data["image"]
        assert type(out) is type(ref) and len(out) == len(ref)
        for got, want in zip(out, ref):
            assert got.shape == want.shape and got.dtype == want.dtype
            bound = 1.0 if chain[-1].dtype == "uint8" else 1e-3  # uint8: a different rounding of x.5
            assert levels(got, want, chain[-1]).max() <= bound


def test_jpeg_facts_equal_jpeg_info(tree_jpegs, jpegs):
    """libjpeg's header reading (one C call per batch) gives what the Python parser
    gives, on gray, progressive, CMYK and EXIF-rotated JPEGs; zeros for other bytes."""
    require_built(decode.native_jpeg(), "gpuio.ops._jpeg", "are libjpeg's headers installed (libjpeg-turbo / libjpeg-dev)")
    bufs = tree_jpegs + jpegs
    facts = jpeg_facts(bufs + [np.frombuffer(b"not an image", np.uint8), tree_jpegs[0][:40]])
    assert [facts_info(f) for f in facts[:-2]] == [jpeg_info(b) for b in bufs]
    assert {jpeg_info(b).orientation for b in bufs} > {1} and {jpeg_info(b).components for b in bufs} == {1, 3, 4}
    assert facts[-2:].tolist() == [[0] * 7] * 2
    complete = [b[-2] == 0xFF and b[-1] == 0xD9 for b in bufs]
    assert facts[:-2, 5].tolist() == complete and all(complete)


def test_region_decode_equals_whole_decode(jpegs):
    require_built(decode.native_jpeg(), "gpuio.ops._jpeg", "are libjpeg's headers installed (libjpeg-turbo / libjpeg-dev)")
    rng = np.random.default_rng(0)
    facts = jpeg_facts(jpegs)
    assert region_decodable(facts).all()
    for k, data in enumerate(jpegs):
        info = jpeg_info(data)
        whole = decode_cpu(data, "rgb", k)
        h, w = whole.shape[:2]
        assert (info.height, info.width) == (h, w)
        for _ in range(12):
            y0, x0 = int(rng.integers(0, h - 1)), int(rng.integers(0, w - 1))
            y1, x1 = int(rng.integers(y0 + 1, h + 1)), int(rng.integers(x0 + 1, w + 1))
            got = decode_region(data, info.components, "rgb", (y0, x0, y1, x1), 1, k)
            np.testing.assert_array_equal(got, whole[y0:y1, x0:x1])
        gray = decode_region(data, info.components, "gray", (0, 0, h, w), 1, k)
        np.testing.assert_array_equal(gray, decode_cpu(data, "gray", k))
        with pytest.raises(FormatError, match=f"sample {k}: .*outside the image"):
            decode_region(data, info.components, "rgb", (0, 0, h + 1, w), 1, k)


def test_dct_scaled_decode_then_resize_is_close_to_full_decode(jpegs):
    """A 1/2, 1/4, 1/8 decode of a large image resized to 1/d of its size or less
    agrees with the full decode resized likewise within 1.5 levels on average."""
    require_built(decode.native_jpeg(), "gpuio.ops._jpeg", "are libjpeg's headers installed (libjpeg-turbo / libjpeg-dev)")
    data = jpegs[4]  # 333 x 517
    info = jpeg_info(data)
    whole = decode_cpu(data, "rgb", 0)
    for d, out_hw in [(2, (160, 250)), (4, (80, 120)), (8, (40, 60))]:
        sh, sw = -(-info.height // d), -(-info.width // d)
        small = decode_region(data, info.components, "rgb", (0, 0, sh, sw), d, 0)
        assert small.shape == (sh, sw, 3)
        chain = lambda: [ops.resize(out_hw), ops.normalize(0, 1, layout="HWC")]  # noqa: E731
        a = ops.Compose(chain())(make_batch([whole], field="image")).data["image"]
        plan_box = np.array([[0, 0, info.height / d, info.width / d]])
        b = fused_reference([small], {"box": plan_box, "clip": np.array([[0, 0, sh, sw]]),
                                      "out_hw": np.array([out_hw]), "flip": np.zeros(1, np.int64)},
                            np.zeros(3, np.float32), np.ones(3, np.float32), layout="HWC")
        diff = np.abs(a - b)
        assert diff.mean() < 1.5, (d, diff.mean())


def run(chain, bufs, fuse, on_error="raise"):
    pipe = ops.Compose([ops.decode_image()] + chain, fuse=fuse)
    return pipe(make_batch(bufs, on_error=on_error))


@pytest.mark.parametrize("name", ["rrc-flip", "resize-area-hwc", "shorter-ragged", "crop-resize-crop"])
def test_decode_fused_matches_decode_then_ops(monkeypatch, tree_jpegs, jpegs, name):
    """Region decoding plus the C resampler against decoding whole images and running
    the ops one by one (Pillow): within the 1 level Pillow's rounding allows when no DCT
    scaling applies; with it (the default) within 1.5 levels on average per image."""
    bufs = tree_jpegs + jpegs
    pipe = ops.Compose([ops.decode_image()] + CHAINS[name]())
    assert isinstance(pipe.fused[0], DecodeFused) and len(pipe.fused) == 1
    want = run(CHAINS[name](), bufs, fuse=False).data["image"]
    scaled = pipe(make_batch(bufs)).data["image"]
    monkeypatch.setattr(fused, "dct_denoms", lambda box, out_hw, subsampling: np.ones(len(box), np.int64))
    got = pipe(make_batch(bufs)).data["image"]
    assert len(got) == len(want) == len(scaled) == len(bufs)
    for g, s, w in zip(got, scaled, want):
        assert g.shape == s.shape == w.shape
        d = levels(g, w, CHAINS[name]()[-1])
        assert d.max() <= 1.0 + 1e-3 and d.mean() < 0.5
        assert levels(s, w, CHAINS[name]()[-1]).mean() < 1.5


def test_decode_fused_every_chroma_layout_stays_close_to_decode_then_ops(monkeypatch):
    """JPEGs of every chroma layout libjpeg writes (libjpeg-turbo through OpenCV: 4:4:4,
    4:2:2, 4:2:0, 4:4:0, 4:1:1), with and without restart markers, large enough for DCT
    scaling: ``jpeg_facts`` gives their subsampling, and the fused decode stays within
    1.5 levels on average of decoding whole and running the ops (1 level without DCT
    scaling): a 4:1:1 JPEG is not DCT-scaled (its chroma would be replicated 4 times
    across at the scaled size, drifting by more than that)."""
    import cv2

    rng = np.random.default_rng(11)
    layouts = {"444": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444, 1), "422": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422, 2),
               "420": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420, 2), "440": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR_440, 2),
               "411": (cv2.IMWRITE_JPEG_SAMPLING_FACTOR_411, 4)}
    pictures = [sample_image(rng, 1201, 1403), sample_image(rng, 301, 467)]
    bufs, names, factors = [], [], []
    for name, (flag, factor) in layouts.items():
        for rst in (0, 1):
            for k, pixels in enumerate(pictures):
                ok, enc = cv2.imencode(".jpg", pixels[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 92,
                                                                    cv2.IMWRITE_JPEG_SAMPLING_FACTOR, flag,
                                                                    cv2.IMWRITE_JPEG_RST_INTERVAL, rst])
                assert ok
                bufs.append(np.frombuffer(enc.tobytes(), np.uint8))
                names.append(f"{name}, restart interval {rst}, picture {k}")
                factors.append(factor)
    assert jpeg_facts(bufs)[:, 6].tolist() == factors
    chains = {"rrc-flip": CHAINS["rrc-flip"], "resize-224": lambda: [ops.resize((224, 224)), ops.normalize(MEAN, STD)],
              "centre": lambda: [ops.resize(shorter=80), ops.center_crop(64), ops.normalize(MEAN, STD)]}
    for chain in chains.values():
        want = run(chain(), bufs, fuse=False).data["image"]
        scaled = run(chain(), bufs, fuse=True).data["image"]
        with monkeypatch.context() as m:
            m.setattr(fused, "dct_denoms", lambda box, out_hw, subsampling: np.ones(len(box), np.int64))
            whole = run(chain(), bufs, fuse=True).data["image"]
        for name, s, g, w in zip(names, scaled, whole, want):
            assert levels(g, w, chain()[-1]).max() <= 1.0 + 1e-3, name
            assert levels(s, w, chain()[-1]).mean() < 1.5, name


@pytest.mark.parametrize("name", list(CHAINS))
def test_decode_fused_gray_jpeg_equals_rgb_decode(monkeypatch, name):
    """A grayscale JPEG in an RGB chain is decoded and resampled as one channel and
    written as three: equal to decoding it as RGB and resampling three channels, in
    every layout and type."""
    require_built(decode.native_jpeg(), "gpuio.ops._jpeg", "are libjpeg's headers installed (libjpeg-turbo / libjpeg-dev)")
    rng = np.random.default_rng(5)
    bufs = [encode(sample_image(rng, h, w)[:, :, 0], quality=q) for h, w, q in [(120, 160, 90), (97, 131, 75),
                                                                               (333, 517, 95)]]
    monkeypatch.setattr(fused, "dct_denoms", lambda box, out_hw, subsampling: np.ones(len(box), np.int64))
    got = run(CHAINS[name](), bufs, fuse=True).data["image"]
    rgb = [decode_cpu(b, "rgb", i) for i, b in enumerate(bufs)]
    want = ops.Compose(CHAINS[name]())(make_batch(rgb, field="image")).data["image"]
    assert len(got) == len(want) == len(bufs)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("missing", [("_resample", "_jpeg"), ("_jpeg",)])
def test_decode_fused_without_c_modules_matches(monkeypatch, tree_jpegs, missing):
    """Where neither C module was built the same pipeline decodes whole images and runs
    the ops one by one (equal results); without the region decoder alone it decodes
    whole images with simplejpeg and resamples in C (within Pillow's 1 level)."""
    want = run(CHAINS["rrc-flip"](), tree_jpegs, fuse=False).data["image"]
    for name in missing:
        monkeypatch.setattr(fused if name == "_resample" else decode, name, None)
    got = run(CHAINS["rrc-flip"](), tree_jpegs, fuse=True).data["image"]
    assert levels(got, want, CHAINS["rrc-flip"]()[-1]).max() <= (0.0 if "_resample" in missing else 1.0 + 1e-3)


def test_decode_fused_bad_samples(monkeypatch, tree_jpegs):
    """Corrupt and truncated JPEGs are errors naming the sample; with on_error="skip"
    the other rows come out as decode-then-ops gives them."""
    monkeypatch.setattr(fused, "dct_denoms", lambda box, out_hw, subsampling: np.ones(len(box), np.int64))
    good = [b for b, ok in zip(tree_jpegs, region_decodable(jpeg_facts(tree_jpegs))) if ok][:6]
    corrupt = good[1].copy()
    scan = corrupt.tobytes().index(b"\xff\xda") + 40
    corrupt[scan: scan + 64] = 0xFF  # bad entropy-coded data in the first rows, EOI intact
    bufs = [good[0], corrupt, good[2], good[3][: len(good[3]) // 2], np.frombuffer(b"not an image", np.uint8)]
    for bad in (1, 3, 4):
        with pytest.raises(FormatError, match="sample 1"):
            run(CHAINS["rrc-flip"](), [good[0], bufs[bad]], fuse=True)
    batch = run(CHAINS["rrc-flip"](), bufs, fuse=True, on_error="skip")
    assert batch.index.tolist() == [0, 2] and sorted(i for i, _ in batch.errors) == [1, 3, 4]
    want = run(CHAINS["rrc-flip"](), [bufs[0], good[5], bufs[2]], fuse=False).data["image"]
    assert levels(batch.data["image"], want[[0, 2]], CHAINS["rrc-flip"]()[-1]).max() <= 1.0 + 1e-3


def scalar_rrc_box(op, batch, row, h, w):
    """torchvision's RandomResizedCrop draw for one row from ``batch.rng`` (the numbers
    ``RandomResizedCrop.boxes`` draws for the whole batch at once)."""
    rng = batch.rng(row, op.salt)
    log_lo, log_hi = math.log(op.ratio[0]), math.log(op.ratio[1])
    for _ in range(10):
        target = h * w * rng.uniform(op.scale[0], op.scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            return [int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1)), ch, cw]
    if w / h < op.ratio[0]:
        cw, ch = w, int(round(w / op.ratio[0]))
    elif w / h > op.ratio[1]:
        ch, cw = h, int(round(h * op.ratio[1]))
    else:
        ch, cw = h, w
    return [(h - ch) // 2, (w - cw) // 2, ch, cw]


@pytest.mark.parametrize("scale, ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (0.2, 5.0)),
                                          ((0.5, 0.5), (1.0, 1.0))])
def test_batch_draws_equal_per_row_generators(scale, ratio):
    """The random crops and flips drawn for a whole batch at once (``ops._rng``)
    equal those of one NumPy generator per row (``batch.rng``), for seeds of one and
    two 32-bit words, crops that fit at once, after retries, never (the centered
    fallback), whole-image crops (no offset drawn) and rows without a size."""
    rng = np.random.default_rng(5)
    hw = np.concatenate([rng.integers(1, 900, (400, 2)), [[1, 1], [1, 500], [500, 1], [3, 2], [0, 0], [224, 224]]])
    index = np.arange(len(hw))
    op = ops.random_resized_crop(224, scale=scale, ratio=ratio)
    for seeds in (sample_seeds(11, 3, index), index.astype(np.uint64)):
        batch = Batch({"image": [None] * len(hw)}, index, seeds)
        boxes, ok = op.boxes(batch, hw)
        assert ok.tolist() == [h > 0 and w > 0 for h, w in hw.tolist()]
        want = [scalar_rrc_box(op, batch, r, h, w) if h > 0 else [0] * 4 for r, (h, w) in enumerate(hw.tolist())]
        assert boxes.tolist() == want
        for flip in (ops.flip(p=0.3), ops.flip(False)):
            bit = 1 if flip.horizontal else 2
            assert flip.flips(batch).tolist() == [bit if batch.rng(r, flip.salt).random() < flip.p else 0
                                                  for r in range(len(hw))]


@pytest.mark.parametrize("salt", [0, 1, 0x52524331, 0xFFFFFFFF])
def test_streams_give_each_row_its_generator_s_numbers(salt):
    """``ops._rng.Streams`` (the C generator of ``gpuio.ops._augment``) gives row ``r``
    the numbers of ``Generator(PCG64(SeedSequence([seed, salt])))``: raw outputs,
    ``random``, ``uniform``, ``integers`` of bounds 1 to 2**32 and ``permutation`` in any order (a 32-bit
    half kept across other draws), on the rows a mask picks (the others stay), for seeds
    of one and two 32-bit words; bad bounds and salts are a ValueError."""
    from gpuio.ops._rng import Streams

    rng = np.random.default_rng(7)
    seeds = np.concatenate([rng.integers(0, 2**32, 16, dtype=np.uint64),
                            rng.integers(2**32, 2**64 - 1, 16, dtype=np.uint64, endpoint=True),
                            np.array([0, 1, 2**32 - 1, 2**32, 2**64 - 1], np.uint64)])
    gens = [np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(s), salt]))) for s in seeds]
    streams = Streams(seeds, salt)
    bounds = np.array([1, 2, 3, 7, 224, 1000, 12345, 2**31 - 1, 2**31, 2**32])
    for step in range(40):
        rows = rng.random(len(seeds)) < 0.7
        kind, high = step % 5, rng.choice(bounds, len(seeds))
        if kind == 0:
            got = streams.integers(high, rows).tolist()
            want = [int(g.integers(0, h)) if r else 0 for g, h, r in zip(gens, high.tolist(), rows)]
        elif kind == 1:
            got = streams.random(rows).tolist()
            want = [g.random() if r else 0.0 for g, r in zip(gens, rows)]
        elif kind == 2:
            got = streams.uniform(-3.5, 2.25, rows).tolist()
            want = [g.uniform(-3.5, 2.25) if r else -3.5 for g, r in zip(gens, rows)]
        elif kind == 4:
            k = int(rng.choice([1, 2, 4, 5, 33, 300]))
            got = streams.permutation(k, rows).tolist()
            want = [g.permutation(k).tolist() if r else list(range(k)) for g, r in zip(gens, rows)]
        else:
            every = (step // 5) % 2 == 1  # every other time all rows (rows None)
            got = streams.next64(None if every else rows).tolist()
            want = [int(g.bit_generator.random_raw()) if r or every else 0 for g, r in zip(gens, rows)]
        assert got == want, (step, kind)
    before = streams.state.copy()
    with pytest.raises(ValueError, match=r"high\[1\] = 0"):
        streams.integers(np.array([5, 0] + [1] * (len(seeds) - 2)), None)
    assert (streams.state == before).all()  # nothing drawn
    with pytest.raises(ValueError, match="32 bits"):
        Streams(seeds, 2**32)


def test_decode_resample_checks_its_arguments(jpegs):
    """Arguments that do not fit are a ValueError before any decoding; a window outside
    the image is that image's failure (the others are decoded)."""
    require_built(decode.native_jpeg(), "gpuio.ops._jpeg", "are libjpeg's headers installed (libjpeg-turbo / libjpeg-dev)")
    data = jpegs[0]  # 120 x 160

    def call(denoms, clips, out, interp=1):
        n = len(denoms)
        boxes = np.concatenate([clips[:, :2], clips[:, 2:] - clips[:, :2]], axis=1).astype(np.float64)
        return decode.native_jpeg().decode_resample([data] * n, np.array(denoms, np.int64), False, boxes, clips,
                                            np.full((n, 2), 8, np.int64), np.arange(n, dtype=np.int64) * 192,
                                            np.zeros(n, np.int64), np.zeros(3, np.float32), np.ones(3, np.float32),
                                            out, interp, True, True, False)

    inside, outside = [0, 0, 120, 160], [200, 0, 240, 160]
    with pytest.raises(ValueError, match="denom"):
        call([3], np.array([inside]), np.empty(192, np.float32))
    with pytest.raises(ValueError, match="inside `out`"):
        call([1, 1], np.array([inside, inside]), np.empty(200, np.float32))
    with pytest.raises(ValueError, match="interp 2"):
        call([1], np.array([inside]), np.empty(192, np.float32), interp=2)
    out = np.full(384, np.nan, np.float32)
    failed = call([1, 2], np.array([outside, inside]), out)
    assert [row for row, _ in failed] == [0] and "outside" in failed[0][1]
    assert np.isfinite(out[192:]).all()


def test_decode_resample_counts_stage_times_only_when_asked(jpegs):
    """``stage_times()`` (bench/images.py --profile) grows only while ``time_stages(True)``
    is in force: a pipeline's decodes read no clocks."""
    require_built(decode.native_jpeg(), "gpuio.ops._jpeg", "are libjpeg's headers installed (libjpeg-turbo / libjpeg-dev)")
    jpeg = decode.native_jpeg()
    pipe = ops.Compose([ops.decode_image(), ops.resize((32, 32)), ops.normalize(MEAN, STD)])
    bufs = [jpegs[0]] * 8
    before = jpeg.stage_times()
    pipe(make_batch(bufs))
    assert jpeg.stage_times() == before
    jpeg.time_stages(True)
    try:
        pipe(make_batch(bufs))
    finally:
        jpeg.time_stages(False)
    after = jpeg.stage_times()
    assert after[0] > before[0] and after[1] > before[1]


@pytest.mark.parametrize("chain", [lambda: [ops.resize((40, 56))], lambda: [ops.random_resized_crop(48), ops.flip()],
                                   lambda: [ops.resize(shorter=50)]], ids=["resize", "rrc-flip", "shorter-ragged"])
def test_resampling_chain_without_normalize_fuses_to_uint8(monkeypatch, tree_jpegs, jpegs, chain):
    """A decode and resampling chain that no normalize follows runs fused (uint8 HWC out)
    and gives what the ops one by one give: within a level (the rounding of x.5) without
    DCT scaling, within 1.5 levels on average per image with it (the default)."""
    bufs = tree_jpegs + jpegs
    pipe = ops.Compose([ops.decode_image()] + chain())
    assert len(pipe.fused) == 1 and isinstance(pipe.fused[0], DecodeFused)
    want = run(chain(), bufs, fuse=False).data["image"]
    scaled = pipe(make_batch(bufs)).data["image"]
    monkeypatch.setattr(fused, "dct_denoms", lambda box, out_hw, subsampling: np.ones(len(box), np.int64))
    got = pipe(make_batch(bufs)).data["image"]
    u8 = ops.normalize(0, 1, layout="HWC", dtype="uint8")
    assert len(got) == len(want) == len(scaled) == len(bufs)
    for g, s, w in zip(got, scaled, want):
        assert g.shape == s.shape == w.shape and g.dtype == s.dtype == w.dtype == np.uint8
        assert levels(g, w, u8).max() <= 1 and levels(s, w, u8).mean() < 1.5


def test_resampling_chain_without_normalize_keeps_other_dtypes(jpegs):
    """Images that are not uint8 (normalized first) skip the fused path and keep their
    dtype through the chain, as the ops one by one leave it."""
    chain = lambda: [ops.decode_image(), ops.normalize(MEAN, STD, layout="HWC"), ops.resize((16, 16))]  # noqa: E731
    got = ops.Compose(chain())(make_batch(jpegs)).data["image"]
    want = ops.Compose(chain(), fuse=False)(make_batch(jpegs)).data["image"]
    assert all(g.dtype == np.float32 for g in got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
