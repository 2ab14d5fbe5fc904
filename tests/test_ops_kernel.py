"""The fused CUDA kernel's source, compiled as C++ and run on the CPU (one loop over
the grid), against ``fused_reference``: checks the kernel's indexing, strides, flips,
windows and layouts where no GPU is present. Skips without a C++ compiler. (The
float16 store is inline PTX and is not compiled here.)"""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.ops._kernels import _NPARAM, SOURCE
from gpuio.ops.fused import FusedCropResizeNormalize, fused_reference
from gpuio.ops.geometry import image_sizes
from gpuio.sample import sample_image

HARNESS = r"""
#include <math.h>
#include <algorithm>
using std::min; using std::max;
struct uint3_ { unsigned x, y, z; };
static uint3_ blockIdx, threadIdx, blockDim;
#define __device__
#define __forceinline__ inline
#define __global__
%s
extern "C" void launch(int gx, int gy, int bx, const long long* params, const float* boxes, const float* mean,
                       const float* inv_std, out_t* out, int channels, int interp, int antialias, int chw) {
    blockDim.x = bx;
    for (unsigned y = 0; y < (unsigned)gy; ++y)
        for (unsigned x = 0; x < (unsigned)gx; ++x)
            for (unsigned t = 0; t < (unsigned)bx; ++t) {
                blockIdx.x = x; blockIdx.y = y; threadIdx.x = t;
                crop_resize_normalize(params, boxes, mean, inv_std, out, channels, interp, antialias, chw);
            }
}
"""

CXX = shutil.which("g++") or shutil.which("c++")


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    out = {}
    for kind, dtype in ((0, np.float32), (2, np.uint8)):
        src = tmp_path_factory.mktemp("k") / "k.cpp"
        src.write_text(HARNESS % SOURCE)
        lib = src.with_suffix(".so")
        subprocess.run([CXX, "-O1", "-shared", "-fPIC", f"-DOUT_KIND={kind}", "-o", str(lib), str(src)],
                       check=True, capture_output=True)
        out[dtype] = ctypes.CDLL(str(lib)).launch
    return out


def run_kernel(launch, images, plan, mean, inv_std, interp, antialias, layout, dtype):
    """What ``gpuio.ops._kernels.crop_resize_normalize`` does, with host pointers."""
    n, channels = len(images), images[0].shape[2]
    out_hw = plan["out_hw"]
    sizes = out_hw[:, 0] * out_hw[:, 1] * channels
    params = np.empty((n, _NPARAM), dtype=np.int64)
    params[:, 0] = [img.ctypes.data for img in images]
    params[:, 1:4] = [img.strides for img in images]
    params[:, 4:8] = plan["clip"]
    params[:, 8:10] = out_hw
    params[:, 10] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    params[:, 11] = plan["flip"]
    boxes = np.ascontiguousarray(plan["box"], dtype=np.float32)
    out = np.zeros(int(sizes.sum()), dtype=dtype)
    mean, inv_std = np.ascontiguousarray(mean, np.float32), np.ascontiguousarray(inv_std, np.float32)
    threads = 64
    pixels = int((out_hw[:, 0] * out_hw[:, 1]).max())
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)  # noqa: E731
    launch(ctypes.c_int((pixels + threads - 1) // threads), ctypes.c_int(n), ctypes.c_int(threads), ptr(params),
           ptr(boxes), ptr(mean), ptr(inv_std), ptr(out), ctypes.c_int(channels),
           ctypes.c_int({"nearest": 0, "linear": 1, "cubic": 2, "area": 3}[interp]), ctypes.c_int(antialias),
           ctypes.c_int(layout == "CHW"))
    h, w = out_hw[0]
    return out.reshape((n, channels, h, w) if layout == "CHW" else (n, h, w, channels))


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(3)
    base = [sample_image(rng, h, w) for h, w in [(150, 200), (200, 120), (90, 90)]]
    # views with odd strides, as the GPU path gets them: a flip, a crop, an EXIF transpose
    return [base[0][:, ::-1], base[1][10:190, 5:], base[2].transpose(1, 0, 2), np.ascontiguousarray(base[0])]


CHAINS = [
    lambda: [ops.random_resized_crop(64), ops.flip(), ops.normalize([120, 110, 100], [60, 55, 50])],
    lambda: [ops.resize(shorter=80), ops.center_crop((64, 48)), ops.flip(False, p=1),
             ops.normalize(0, 1, layout="HWC", dtype="uint8")],
    lambda: [ops.center_crop(80), ops.resize((100, 130), interp="cubic"), ops.normalize(10, 2)],
    lambda: [ops.random_resized_crop(40, interp="area"), ops.normalize(0, 1, layout="HWC")],
    lambda: [ops.random_resized_crop(40, interp="nearest"), ops.flip(p=1), ops.normalize(0, 1, dtype="uint8")],
    lambda: [ops.resize((50, 70), antialias=False), ops.normalize(0, 1)],
]


@pytest.mark.parametrize("k", range(len(CHAINS)))
def test_kernel_source_matches_reference(kernels, images, k):
    chain = CHAINS[k]()
    fused = FusedCropResizeNormalize(chain)
    index = np.arange(len(images))
    batch = Batch({"image": list(images)}, index, sample_seeds(1, 0, index))
    plan = fused.plan(batch, image_sizes(images))
    norm = chain[-1]
    mean, inv_std = norm.channel_params(3)
    args = dict(interp=fused.interp, antialias=fused.antialias, layout=norm.layout, dtype=norm.dtype)
    ref = fused_reference(images, plan, mean, inv_std, **args)
    dtype = np.uint8 if norm.dtype == "uint8" else np.float32
    got = run_kernel(kernels[dtype], images, plan, mean, inv_std, args["interp"], args["antialias"],
                     norm.layout, dtype)
    assert got.shape == ref.shape
    std = 1.0 / inv_std.astype(np.float64)  # differences in 0-255 pixel levels
    std = std.reshape(-1, 1, 1) if norm.layout == "CHW" else std
    diff = np.abs(got.astype(np.float64) - ref.astype(np.float64)) * std
    assert diff.max() <= (1.0 if dtype == np.uint8 else 0.01)  # float32 sums in another order
    if dtype == np.uint8:
        assert diff.mean() < 0.01
    # and the kernel agrees with the unfused CPU ops
    cpu = ops.Compose(CHAINS[k]())(Batch({"image": list(images)}, index, sample_seeds(1, 0, index)))
    levels = np.abs(got.astype(np.float64) - cpu.data["image"].astype(np.float64)) * std
    assert levels.max() <= (2.0 if fused.interp == "cubic" else 1.0) + 1e-3 and levels.mean() < 0.5
