"""The augmentations' CUDA elementwise kernels (colour matrix, blur pass, warp), their
bodies compiled as C++ and run on the CPU (one loop over the output elements, a raw
argument as a plain pointer), against the CPU path of the same op (ops/_augment.c): checks
the kernels' indexing, borders and arithmetic where no GPU is present, and that both give
the same levels. Skips without a C++ compiler."""

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from gpuio import ops
from gpuio.batch import Batch, sample_seeds
from gpuio.ops.augment import BLUR_SOURCE, COLOR_SOURCE, REFLECT101_SOURCE, apply_color, gaussian_weights, yiq_matrix
from gpuio.ops.warp import TAP_SOURCE, WARP_SOURCE, rotated_size, rotation_matrix
from gpuio.sample import sample_image

HEAD = r"""
#include <math.h>
#include <algorithm>
using std::min; using std::max;
#define __device__
#define __forceinline__ inline
template <typename T> struct Raw { T* p; T& operator[](long long i) const { return p[i]; } };
"""


def loop(name, params, raws, out_t, body):
    """An elementwise kernel as a C function: ``raws`` (type, name) become ``Raw`` views."""
    views = " ".join(f"Raw<{t}> {n}{{{n}_}};" for t, n in raws)
    return (f'extern "C" void {name}({params}, {out_t}* out, long long n) {{\n'
            f"  {views}\n  for (long long i = 0; i < n; ++i) {{ {out_t}& dst = out[i];\n{body}\n  }}\n}}\n")


SOURCE = (HEAD + REFLECT101_SOURCE + TAP_SOURCE
          + loop("color", "unsigned char* src_, float* m_, long long hw, long long c",
                 [("unsigned char", "src"), ("float", "m")], "unsigned char", COLOR_SOURCE)
          + loop("blur_u8", "unsigned char* src_, float* w_, int h, int wd, long long c, int radius, int axis",
                 [("unsigned char", "src"), ("float", "w")], "float", BLUR_SOURCE)
          + loop("blur_f32", "float* src_, float* w_, int h, int wd, long long c, int radius, int axis",
                 [("float", "src"), ("float", "w")], "float", BLUR_SOURCE)
          + loop("warp", "unsigned char* src_, float* m_, float* fill_, int ih, int iw, int ow, int c, int interp, "
                 "int use_fill", [("unsigned char", "src"), ("float", "m"), ("float", "fill")], "unsigned char",
                 WARP_SOURCE))
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
    matrices = [yiq_matrix(h, s, v) for h, s, v in [(20, 1.2, 0.9), (-40, 0.5, 1.1), (0, 1, 1)]]
    for stack in (np.stack(images), rgba[None], images[1][None, ..., :1].copy()):
        n, h, w, c = stack.shape
        table = np.zeros((n, 12), np.float32)
        for k in range(n):
            table[k, :9] = (matrices[k] if c >= 3 else 1.3 * np.eye(3)).ravel()
            table[k, 9:] = (5, -3, 2) if c >= 3 else -7
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
