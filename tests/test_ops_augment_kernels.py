"""The augmentations' CUDA elementwise kernels (colour matrix, blur pass, warp), their
bodies compiled as C++ and run on the CPU (one loop over the output elements, a raw
argument as a plain pointer), against the CPU path of the same op (ops/_augment.c): checks
the kernels' indexing, borders and arithmetic where no GPU is present, and that both give
the same levels. Skips without a C++ compiler. The same bodies compiled with nvcc, with the
options CuPy gives NVRTC (``offline_gpu``: fails without nvcc), contain no fused
multiply-add, which the C++ build (-ffp-contract=off) has none of either."""

import ast
import ctypes
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sysconfig

import numpy as np
import pytest

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.ops.augment import (BLUR_SOURCE, COLOR_SOURCE, EXACT_OPTIONS, HISTOGRAM_SOURCE, REFLECT101_SOURCE,
                               apply_color, gaussian_weights, histograms, yiq_matrix)
from gpuio.ops.warp import TAP_SOURCE, WARP_SOURCE, rotated_size, rotation_matrix
from gpuio.sample import sample_image

HEAD = r"""
#include <math.h>
#include <algorithm>
using std::min; using std::max;
#define __device__
#define __forceinline__ inline
template <typename T> struct Raw { T* p; T& operator[](long long i) const { return p[i]; } };
template <typename T> T atomicAdd(T* p, T v) { T old = *p; *p += v; return old; }
"""


def loop(name, params, raws, out_t, body, cuda=False):
    """An elementwise kernel as a C function: ``raws`` (type, name) become ``Raw`` views.
    With ``cuda``, a CUDA kernel over the same elements (a grid-stride loop, as CuPy's)."""
    views = " ".join(f"Raw<{t}> {n}{{{n}_}};" for t, n in raws)
    head, start, step = ('extern "C" __global__ void', "blockIdx.x * (long long)blockDim.x + threadIdx.x",
                         "(long long)blockDim.x * gridDim.x") if cuda else ('extern "C" void', "0", "1")
    return (f"{head} {name}({params}, {out_t}* out, long long n) {{\n"
            f"  {views}\n  for (long long i = {start}; i < n; i += {step}) {{ {out_t}& dst = out[i];\n{body}\n  }}\n}}\n")


def kernels(cuda=False):
    """The kernels (colour, blur over uint8 and float32, warp, histogram) as one source."""
    return (REFLECT101_SOURCE + TAP_SOURCE
            + loop("color", "unsigned char* src_, float* m_, long long hw, long long c",
                   [("unsigned char", "src"), ("float", "m")], "unsigned char", COLOR_SOURCE, cuda)
            + loop("blur_u8", "unsigned char* src_, float* w_, int h, int wd, long long c, int radius, int axis",
                   [("unsigned char", "src"), ("float", "w")], "float", BLUR_SOURCE, cuda)
            + loop("blur_f32", "float* src_, float* w_, int h, int wd, long long c, int radius, int axis",
                   [("float", "src"), ("float", "w")], "float", BLUR_SOURCE, cuda)
            + loop("warp", "unsigned char* src_, float* m_, float* fill_, int ih, int iw, int ow, int c, int interp, "
                   "int use_fill", [("unsigned char", "src"), ("float", "m"), ("float", "fill")], "unsigned char",
                   WARP_SOURCE, cuda)
            + loop("histogram", "unsigned char* src_, long long hw, long long c, unsigned int* counts_",
                   [("unsigned char", "src"), ("unsigned int", "counts")], "char", HISTOGRAM_SOURCE, cuda))


SOURCE = HEAD + kernels()
CUDA_SOURCE = r"""
template <typename T> struct Raw { T* p; __device__ T& operator[](long long i) const { return p[i]; } };
""" + kernels(cuda=True)
CXX = shutil.which("g++") or shutil.which("c++")
LL, INT = ctypes.c_longlong, ctypes.c_int


def ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if CXX is None:
        pytest.skip("no C++ compiler")
    src = tmp_path_factory.mktemp("k") / "augment.cpp"
    src.write_text(SOURCE)
    so = src.with_suffix(".so")
    # no fused multiply-add: the CPU path (built with -ffp-contract=off) rounds each product
    subprocess.run([CXX, "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-o", str(so), str(src)], check=True,
                   capture_output=True)
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(1)
    return [sample_image(rng, 40, 52) for _ in range(3)]


def one_batch(images):
    index = np.arange(len(images))
    return Batch({"image": list(images)}, index, sample_seeds(0, 0, index))


def test_colour_kernel_equals_the_cpu_path(lib, images):
    rgba = np.concatenate([images[0], np.full((40, 52, 1), 77, np.uint8)], axis=2)
    # the last matrix has three equal rows and offsets (grey), which the CPU path sums once
    matrices = [yiq_matrix(h, s, v) for h, s, v in [(20, 1.2, 0.9), (-40, 0.5, 1.1), (0, 1, 1)]]
    matrices.append(np.tile([0.299, 0.587, 0.114], (3, 1)))
    for stack in (np.stack(images + images[:1]), np.stack([rgba, rgba]), images[1][None, ..., :1].copy()):
        n, h, w, c = stack.shape
        table = np.zeros((n, 12), np.float32)
        for k in range(n):
            table[k, :9] = (matrices[k - n] if c >= 3 else 1.3 * np.eye(3)).ravel()
            table[k, 9:] = (1.5, 1.5, 1.5) if k == n - 1 else (5, -3, 2) if c >= 3 else -7
        out = np.empty_like(stack)
        lib.color(ptr(np.ascontiguousarray(stack)), ptr(table), LL(h * w), LL(c), ptr(out), LL(out.size))
        batch = one_batch(list(stack))
        apply_color(batch, "image", table[:, :9].reshape(-1, 3, 3), table[:, 9:])
        assert np.array_equal(out, np.stack(batch.data["image"]))


@pytest.mark.parametrize("shape", [(40, 52), (3, 4), (1, 7)])
def test_blur_kernel_equals_the_cpu_path(lib, images, shape):
    img = np.ascontiguousarray(images[0][:shape[0], :shape[1]])
    ky, kx = gaussian_weights(1.3, 9), gaussian_weights(0.8, 5)
    h, w, c = img.shape
    rows, cols = np.empty(img.shape, np.float32), np.empty(img.shape, np.float32)
    lib.blur_u8(ptr(img), ptr(kx), INT(h), INT(w), LL(c), INT(len(kx) // 2), INT(1), ptr(rows), LL(rows.size))
    lib.blur_f32(ptr(rows), ptr(ky), INT(h), INT(w), LL(c), INT(len(ky) // 2), INT(0), ptr(cols), LL(cols.size))
    got = np.clip(np.floor(cols + 0.5), 0, 255).astype(np.uint8)
    blurred = ops.gaussian_blur(sigma=(1.3, 0.8), window_size=(9, 5), per_axis=True)(one_batch([img]))
    assert np.array_equal(got, blurred.data["image"][0])


@pytest.mark.parametrize("angle,fill,keep,interp", [(30, 0.0, False, "linear"), (-17.5, None, True, "linear"),
                                                    (33, None, False, "nearest"), (200, 99.5, True, "linear")])
def test_warp_kernel_equals_the_cpu_path(lib, images, angle, fill, keep, interp):
    img = images[2]
    h, w, c = img.shape
    oh, ow = (h, w) if keep else rotated_size(h, w, angle)
    m = rotation_matrix(angle, (h, w), (oh, ow)).astype(np.float32).ravel()
    levels = np.full(c, 0 if fill is None else fill, np.float32)
    out = np.empty((oh, ow, c), np.uint8)
    lib.warp(ptr(img), ptr(m), ptr(levels), INT(h), INT(w), INT(ow), INT(c), INT(["linear", "nearest"].index(interp)),
             INT(fill is not None), ptr(out), LL(out.size))
    ref = ops.rotate(angle, fill_value=fill, keep_size=keep, interp_type=interp)(one_batch([img])).data["image"][0]
    assert np.array_equal(out, ref)


def test_histogram_kernel_equals_the_cpu_path(lib, images):
    """Three images of one shape and two of another (one launch per shape on the GPU),
    1-4 channels: the counts the kernel adds up per image and channel."""
    rng = np.random.default_rng(3)
    imgs = [images[0], images[0][::-1].copy(), rng.integers(0, 256, (40, 52, 4), np.uint8),
            rng.integers(0, 4, (5, 7, 1), np.uint8), rng.integers(0, 256, (5, 7, 2), np.uint8)]
    want = histograms(one_batch(imgs), imgs)
    got = np.zeros(want.shape, np.uint32)
    for k, img in enumerate(imgs):
        h, w, c = img.shape
        lib.histogram(ptr(np.ascontiguousarray(img)), LL(h * w), LL(c), ptr(got[k]), ptr(np.empty(img.size, np.int8)),
                      LL(img.size))
    assert np.array_equal(got, want) and want.sum() == sum(img.size for img in imgs)


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """``ops/_augment.c`` built with ``GPUIO_PORTABLE``: the plain C (no x86-64-v3 clone),
    which CPUs without AVX2 run; the flags of pyproject.toml otherwise."""
    cc = sysconfig.get_config_var("CC").split()[0]
    path = tmp_path_factory.mktemp("portable") / ("_augment" + sysconfig.get_config_var("EXT_SUFFIX"))
    source = pathlib.Path(__file__).resolve().parents[1] / "ops" / "_augment.c"
    subprocess.run([cc, "-O3", "-ffp-contract=off", "-shared", "-fPIC", "-DGPUIO_PORTABLE",
                    f"-I{sysconfig.get_paths()['include']}", "-o", str(path), str(source)], check=True,
                   capture_output=True)
    spec = importlib.util.spec_from_file_location("_augment", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_built_c_path_equals_its_plain_c_build(portable, images):
    """The module as installed (its AVX2 clone where the CPU has it) and the plain C give
    the same values for every function."""
    from gpuio.ops import _augment

    rng = np.random.default_rng(5)
    src = [np.ascontiguousarray(img) for img in images] + [rng.integers(0, 256, (7, 1, 4), np.uint8)]
    n = len(src)

    def both(name, *args, outs=None):
        got = []
        for module in (_augment, portable):
            out = [np.empty_like(o) for o in outs] if outs is not None else None
            extra = [] if out is None else [out]
            getattr(module, name)(*args, *extra)
            got.append(out)
        return got

    table = rng.uniform(-1, 2, (n, 12)).astype(np.float32)
    table[1, [1, 2, 3, 5, 6, 7]] = 0  # a diagonal matrix: the per-channel tables
    table[2, 3:9], table[2, 10:] = np.tile(table[2, :3], 2), table[2, 9]  # equal rows: one sum for all
    mine, plain = both("color", src, table, outs=src)
    assert all(np.array_equal(a, b) for a, b in zip(mine, plain))
    mine, plain = both("filter3x3", src, rng.uniform(-1, 1, (n, 9)).astype(np.float32), outs=src)
    assert all(np.array_equal(a, b) for a, b in zip(mine, plain))
    ky = [gaussian_weights(1.3, 9)] * n
    kx = [gaussian_weights(0.7, 5)] * n
    floats = [img.astype(np.float32) / 7 for img in src]
    for data in (src, floats):
        mine, plain = both("blur", data, ky, kx, outs=data)
        assert all(np.array_equal(a, b) for a, b in zip(mine, plain))
    params = np.array([[3, 0, 1, 2], [1, -1, 0, 3], [2, 3, 1, 0], [1, 0, 2, -1]], np.float64)
    params = np.concatenate([params, rng.uniform(0.3, 1.7, (n, 4)) - [0, 0, 0, 1.1]], axis=1)
    mine, plain = both("jitter", src, params, outs=src)
    assert all(np.array_equal(a, b) for a, b in zip(mine, plain))
    same = [src[0], src[2], 255 - src[0]]
    mine, plain = both("mix", same, rng.uniform(0, 1, (3, 2)).astype(np.float32), outs=same)
    assert all(np.array_equal(a, b) for a, b in zip(mine, plain))
    boxes = np.array([[3, 5, 20, 30], [0, 0, 40, 52], [7, 9, 7, 40]], np.int64)
    mine, plain = both("paste", same, boxes, outs=same)
    assert all(np.array_equal(a, b) for a, b in zip(mine, plain))
    ref = [img.copy() for img in same]
    for k, (y0, x0, y1, x1) in enumerate(boxes.tolist()):
        ref[k][y0:y1, x0:x1] = same[k - 1][y0:y1, x0:x1]
    assert all(np.array_equal(a, b) for a, b in zip(mine, ref))
    m = np.stack([rotation_matrix(a, img.shape[:2], (31, 45)) for a, img in zip((25, -70, 180, 3), src)])
    fills = np.tile(np.array([99.5, 0, 255, 3], np.float32), (n, 1))
    outs = [np.empty((31, 45, img.shape[2]), np.uint8) for img in src]
    for interp in (0, 1):
        for use_fill in (0, 1):
            mine, plain = both("warp", src, m.astype(np.float32), fills, interp, use_fill, outs=outs)
            assert all(np.array_equal(a, b) for a, b in zip(mine, plain))


# What CuPy 14 adds to a kernel's own options before NVRTC compiles it
# (cupy/cuda/compiler.py: -ftz=true; the architecture is the GPU's), as nvcc takes them
CUPY_ADDS = ("-ftz=true",)
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def fmas_per_kernel(tmp_path, options):
    """The number of float FMA instructions in each kernel of ``CUDA_SOURCE`` compiled
    to PTX for sm_90 with ``options``."""
    if not pathlib.Path(NVCC).exists():
        pytest.fail("nvcc is not on PATH (CUDA 13.0's nvcc is expected here and on CI)")
    src, ptx = tmp_path / "augment.cu", tmp_path / "augment.ptx"
    src.write_text(CUDA_SOURCE)
    done = subprocess.run([NVCC, "-ptx", "-arch=sm_90", *options, "-o", str(ptx), str(src)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    entries = ptx.read_text().split(".entry ")[1:]
    return {entry.split("(")[0].strip(): len(re.findall(r"\bfma\.rn[.\w]*f32\b", entry)) for entry in entries}


@pytest.mark.offline_gpu
def test_kernels_compile_without_fma_as_cupy_builds_them(tmp_path):
    """With CuPy's options alone NVRTC (as nvcc) contracts the kernels' multiply-adds into
    FMAs, which round once where the CPU path rounds twice; with ``EXACT_OPTIONS`` none
    is left."""
    contracted = fmas_per_kernel(tmp_path, CUPY_ADDS)
    assert contracted.pop("histogram") == 0  # integer counts
    assert sorted(contracted) == ["blur_f32", "blur_u8", "color", "warp"] and all(contracted.values()), contracted
    exact = fmas_per_kernel(tmp_path, (*EXACT_OPTIONS, *CUPY_ADDS))
    assert exact == dict.fromkeys([*contracted, "histogram"], 0), exact


def test_every_elementwise_kernel_that_must_equal_the_cpu_is_built_exact():
    """Each CuPy kernel of the colour, blur and warp ops is made with ``EXACT_OPTIONS``."""
    root = pathlib.Path(__file__).resolve().parents[1] / "ops"
    made = {}
    for name in ("augment.py", "warp.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("ElementwiseKernel", "RawKernel")):
                options = {k.arg: ast.unparse(k.value) for k in node.keywords}.get("options")
                made[ast.unparse(node.args[3])] = options
    assert made == {"'gpuio_histograms'": None, "'gpuio_color_matrix'": "EXACT_OPTIONS", "'gpuio_blur_pass'": "EXACT_OPTIONS",
                    "'gpuio_warp_affine'": "EXACT_OPTIONS"}, made
