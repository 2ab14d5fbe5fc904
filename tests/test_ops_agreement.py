"""CPU/GPU agreement of the image ops: one checker, run over the same samples.

The CPU pipeline (simplejpeg/Pillow, one op at a time) is the reference. Against it:
``reference`` (the fused kernel's math in NumPy: runs everywhere), ``cuda`` (the fused
kernel) and ``cuda-unfused`` (one GPU op at a time). Resized outputs agree within 1
level (0-255 scale) at most and 0.5 level on average; decoded pixels within the
decoders' documented differences (IDCT and chroma upsampling: a few levels at edges).
"""

import glob
import io

import numpy as np
import pytest

import gpuio
from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.device import Device
from gpuio.errors import FormatError
from gpuio.ops.fused import FusedCropResizeNormalize, fused_reference
from gpuio.ops.geometry import image_sizes
from gpuio.sample import make_image_tree

MEAN, STD = [123.675, 116.28, 103.53], [58.395, 57.12, 57.375]
CHAINS = {
    "train": lambda: [ops.random_resized_crop(224), ops.flip(), ops.normalize(MEAN, STD)],
    "val": lambda: [ops.resize(shorter=256), ops.center_crop(224), ops.normalize(MEAN, STD)],
    "area-hwc-f16": lambda: [ops.random_resized_crop(96, interp="area"), ops.flip(False),
                             ops.normalize(MEAN, STD, layout="HWC", dtype="float16")],
    "crop-resize-u8": lambda: [ops.center_crop(280), ops.resize((160, 120)), ops.flip(p=1.0),
                               ops.normalize(0, 1, dtype="uint8")],
}


def to_host(a):
    if isinstance(a, list):
        return [to_host(x) for x in a]
    if hasattr(a, "__cuda_array_interface__"):
        import cupy

        return cupy.asnumpy(a)
    return np.asarray(a)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    return make_image_tree(tmp_path_factory.mktemp("imgs"), count=40, classes=2, seed=2, progress=False)


@pytest.fixture(scope="module")
def encoded(tree):
    return [np.fromfile(p, np.uint8) for p in sorted(glob.glob(f"{tree}/*/*.jpg"))]


def make_batch(values, device="cpu", seed=5, field="data", on_error="raise"):
    index = np.arange(len(values))
    return Batch({field: list(values)}, index, sample_seeds(seed, 0, index), device=Device(*device.split(":"))
                 if ":" in device else Device(device), on_error=on_error)


@pytest.fixture(scope="module")
def decoded(encoded):
    return ops.decode_image()(make_batch(encoded)).data["image"]


@pytest.fixture(params=["reference", pytest.param("cuda", marks=pytest.mark.gpu),
                        pytest.param("cuda-unfused", marks=pytest.mark.gpu)])
def other(request):
    return request.param


def run_other(kind, chain, images):
    """The pipeline ``chain`` over ``images`` (decoded on the CPU) by ``kind``."""
    if kind == "reference":
        fused = FusedCropResizeNormalize(chain)
        batch = make_batch(images, field="image")
        plan = fused.plan(batch, image_sizes(images))
        mean, inv_std = chain[-1].channel_params(3)
        return fused_reference(images, plan, mean, inv_std, interp=fused.interp, antialias=fused.antialias,
                               layout=chain[-1].layout, dtype=chain[-1].dtype)
    import cupy

    batch = make_batch([cupy.asarray(img) for img in images], device="cuda", field="image")
    out = ops.Compose(chain, fuse=kind == "cuda")(batch).data["image"]
    assert isinstance(out, cupy.ndarray)
    return cupy.asnumpy(out)


def check_levels(a, b, normalize, bound=1.0):
    """|a - b| in 0-255 pixel levels: max within ``bound``, mean under 0.5."""
    scale = 1.0 if normalize.dtype == "uint8" else np.asarray(STD, np.float32)
    scale = np.reshape(scale, (-1, 1, 1)) if normalize.layout == "CHW" and normalize.dtype != "uint8" else scale
    levels = np.abs(a.astype(np.float64) - b.astype(np.float64)) * scale
    tol = 0.15 if normalize.dtype == "float16" else 1e-3
    assert levels.max() <= bound + tol, f"max difference {levels.max():.3f} levels"
    assert levels.mean() < 0.5, f"mean difference {levels.mean():.3f} levels"


@pytest.mark.parametrize("name", list(CHAINS))
def test_pipeline_agreement(decoded, other, name):
    chain = CHAINS[name]()
    cpu = ops.Compose(chain)(make_batch(decoded, field="image")).data["image"]
    out = run_other(other, chain, decoded)
    assert out.shape == cpu.shape and out.dtype == cpu.dtype
    check_levels(out, cpu, chain[-1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_decode_agreement(encoded, decoded, device):
    """Against Pillow on the CPU (the same libjpeg-turbo: equal within 1), against the
    CPU decoder on the GPU (nvJPEG: IDCT and chroma-upsampling differences)."""
    if device == "cpu":
        from PIL import Image, ImageOps

        others = [np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(b.tobytes()))).convert("RGB"))
                  for b in encoded]
        bound, mean_bound = 1, 0.05
    else:
        others = to_host(ops.decode_image()(make_batch(encoded, device="cuda")).data["image"])
        bound, mean_bound = 64, 1.5
    assert [o.shape for o in others] == [d.shape for d in decoded]
    for got, want in zip(others, decoded):
        diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
        assert diff.max() <= bound and diff.mean() < mean_bound


@pytest.mark.gpu
def test_gpu_decode_bad_bytes_and_fallback(encoded):
    import cupy

    from PIL import Image

    png = io.BytesIO()
    Image.fromarray(np.zeros((8, 9, 3), np.uint8)).save(png, "PNG")
    bufs = [encoded[0], encoded[0][: len(encoded[0]) // 3], np.frombuffer(png.getvalue(), np.uint8)]
    with pytest.raises(FormatError, match="sample 1"):
        ops.decode_image()(make_batch(bufs, device="cuda"))
    batch = ops.decode_image()(make_batch(bufs, device="cuda", on_error="skip"))
    assert batch.index.tolist() == [0, 2] and all(isinstance(i, cupy.ndarray) for i in batch.data["image"])
    assert batch.data["image"][1].shape == (8, 9, 3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_loader_with_compose(tree, device):
    index = gpuio.formats.filetree(tree)
    pipe = ops.Compose([ops.decode_image()] + CHAINS["train"]())
    loader = gpuio.Loader(index, 16, ops=[pipe], device=device, output="numpy", shuffle=True, seed=1)
    batches = list(loader)
    assert len(batches) == 3
    images = to_host(batches[0]["image"])
    assert images.shape == (16, 3, 224, 224) and images.dtype == np.float32
    assert -2.2 < images.min() and images.max() < 2.7
    assert sum(len(b["index"]) for b in batches) == 40
