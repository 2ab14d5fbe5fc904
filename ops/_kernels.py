"""The fused crop + resize + flip + normalize + layout + cast CUDA kernel (CuPy).

One launch per batch (per channel count, where grey and colour images share a batch):
grid ``(ceil(max_out_pixels / 256), N)``, one thread per output pixel (all channels).
Per-sample parameters travel as two small device arrays. The kernel mirrors
``gpuio.ops.geometry.resample`` and ``gpuio.ops.fused.fused_reference`` line by line:
the same filter window, the horizontal pass clipped to 0-255 (as Pillow), then the
vertical pass, clip to 0-255, ``(v - mean) * inv_std``, cast. It reads uint8 only;
the ops take other images to the array-module path (``geometry.resample`` on CuPy).
CuPy is imported only when a GPU batch runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gpuio.batch import Batch
from gpuio.errors import ConfigError

__all__ = ["OPTIONS", "SOURCE", "channel_groups", "check_images", "crop_resize_normalize", "launch_params",
           "split_output"]

# params, int64 per sample: src address, row / column / channel strides (bytes),
# clip y0, x0, y1, x1 (source pixels the filter may read), out h, out w,
# out offset (elements), flip bits (1: left-right, 2: upside down)
_NPARAM = 12

SOURCE = r"""
#if OUT_KIND == 1
typedef unsigned short out_t;  /* float16 bits */
__device__ __forceinline__ void store(out_t* p, float v) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); *p = h;
}
#elif OUT_KIND == 2
typedef unsigned char out_t;
__device__ __forceinline__ void store(out_t* p, float v) {
    *p = (unsigned char)fminf(fmaxf(floorf(v + 0.5f), 0.0f), 255.0f);
}
#else
typedef float out_t;
__device__ __forceinline__ void store(out_t* p, float v) { *p = v; }
#endif

/* geometry.py _filter(): weight of the source pixel whose center is d pixels from the
   output pixel's; 0 nearest, 1 linear (triangle), 2 cubic (a = -0.5), 3 area (overlap) */
__device__ __forceinline__ float filter_weight(int interp, float d, float fscale) {
    if (interp == 0) return 1.0f;
    if (interp == 3) {
        const float half = 0.5f * fscale;
        return fmaxf(fminf(d + 0.5f, half) - fmaxf(d - 0.5f, -half), 0.0f);
    }
    const float x = fabsf(d / fscale);
    if (interp == 1) return x < 1.0f ? 1.0f - x : 0.0f;
    const float a = -0.5f;
    if (x < 1.0f) return ((a + 2.0f) * x - (a + 3.0f)) * x * x + 1.0f;
    if (x < 2.0f) return (((x - 5.0f) * x + 8.0f) * x - 4.0f) * a;
    return 0.0f;
}

/* geometry.py filter_weights(): the source window [first, last) of output pixel o */
__device__ __forceinline__ void window(int interp, int antialias, float start, float length, int out, int o,
                                       int lo, int hi, float* center, float* fscale, int* first, int* last) {
    const float scale = length / out;
    const float c = start + (o + 0.5f) * scale;
    *center = c;
    if (interp == 0) {
        const int pick = min(max((int)floorf(c), lo), hi - 1);
        *first = pick; *last = pick + 1; *fscale = 1.0f;
        return;
    }
    const float fs = antialias ? fmaxf(scale, 1.0f) : 1.0f;
    if (interp == 3) {
        *first = max((int)floorf(c - 0.5f * fs), lo);
        *last = min((int)ceilf(c + 0.5f * fs), hi);
    } else {
        const float support = (interp == 1 ? 1.0f : 2.0f) * fs;
        *first = max((int)floorf(c - support + 0.5f), lo);
        *last = min((int)floorf(c + support + 0.5f), hi);
    }
    *fscale = fs;
}

extern "C" __global__ void crop_resize_normalize(
        const long long* params, const float* boxes, const float* mean, const float* inv_std,
        out_t* out, int channels, int interp, int antialias, int chw) {
    const long long* p = params + 12 * (long long)blockIdx.y;
    const float* box = boxes + 4 * (long long)blockIdx.y;   /* y0, x0, h, w in source pixels */
    const int oh = (int)p[8], ow = (int)p[9];
    const int pix = blockIdx.x * blockDim.x + threadIdx.x;
    if (pix >= oh * ow) return;
    const int oy = pix / ow, ox = pix - oy * ow;
    const int sy = (p[11] & 2) ? oh - 1 - oy : oy;   /* flip: read the mirrored pixel */
    const int sx = (p[11] & 1) ? ow - 1 - ox : ox;
    const unsigned char* src = (const unsigned char*)p[0];
    const long long rs = p[1], cs = p[2], chs = p[3];
    float cy, fy, cx, fx;
    int y0, y1, x0, x1;
    window(interp, antialias, box[0], box[2], oh, sy, (int)p[4], (int)p[6], &cy, &fy, &y0, &y1);
    window(interp, antialias, box[1], box[3], ow, sx, (int)p[5], (int)p[7], &cx, &fx, &x0, &x1);
    float wxsum = 0.0f, wysum = 0.0f;
    for (int i = x0; i < x1; ++i) wxsum += filter_weight(interp, i + 0.5f - cx, fx);
    if (wxsum == 0.0f) wxsum = 1.0f;
    /* loops over c run to the constant 4 (unrolled, c < channels inside), so that acc
       and h stay in registers: a runtime bound would put them in a stack frame */
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = y0; j < y1; ++j) {
        const float wy = filter_weight(interp, j + 0.5f - cy, fy);
        wysum += wy;
        if (wy == 0.0f) continue;
        const unsigned char* row = src + j * rs;
        float h[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int i = x0; i < x1; ++i) {
            const float wx = filter_weight(interp, i + 0.5f - cx, fx);
            const unsigned char* px = row + i * cs;
#pragma unroll
            for (int c = 0; c < 4; ++c) if (c < channels) h[c] += wx * px[c * chs];
        }
#pragma unroll
        for (int c = 0; c < 4; ++c)   /* horizontal pass clipped to 0-255, as Pillow */
            if (c < channels) acc[c] += wy * fminf(fmaxf(h[c] / wxsum, 0.0f), 255.0f);
    }
    if (wysum == 0.0f) wysum = 1.0f;
    out_t* o = out + p[10];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        if (c >= channels) break;
        const float v = fminf(fmaxf(acc[c] / wysum, 0.0f), 255.0f);
        const long long idx = chw ? (long long)c * oh * ow + pix : (long long)pix * channels + c;
        store(o + idx, (v - mean[c]) * inv_std[c]);
    }
}
"""

# output dtype -> the compile options of its kernel (CI compiles each with nvcc)
OPTIONS = {"float32": ("-DOUT_KIND=0",), "float16": ("-DOUT_KIND=1",), "uint8": ("-DOUT_KIND=2",)}
_INTERP = {"nearest": 0, "linear": 1, "cubic": 2, "area": 3}
_lock = threading.Lock()
_compiled: dict[str, Any] = {}


def _kernel(cp: Any, dtype: str) -> Any:
    with _lock:
        if dtype not in _compiled:
            _compiled[dtype] = cp.RawKernel(SOURCE, "crop_resize_normalize", options=OPTIONS[dtype])
        return _compiled[dtype]


def channel_groups(channels: np.ndarray) -> dict[int, np.ndarray]:
    """The rows of each channel count (``channels``, int ``[N]``), ascending: the kernel
    takes one count per launch, so a batch of grey and colour images is launched once
    per count, each launch writing its rows into the one output buffer."""
    return {int(c): np.flatnonzero(channels == c) for c in np.unique(channels)}


def launch_params(addresses: Sequence[int], strides: Sequence[Sequence[int]], channels: np.ndarray,
                  clips: np.ndarray, out_hw: np.ndarray, flips: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's per-sample parameters, int64 ``[N, 12]`` (see ``_NPARAM``), and each
    sample's output size in elements (``[N]``): outputs lie back to back in row order
    in one buffer, each of its own channel count."""
    n = len(addresses)
    out_hw = np.asarray(out_hw, dtype=np.int64).reshape(n, 2)
    sizes = out_hw[:, 0] * out_hw[:, 1] * np.asarray(channels, np.int64)
    params = np.empty((n, _NPARAM), dtype=np.int64)
    params[:, 0] = addresses
    params[:, 1:4] = np.asarray(strides, np.int64).reshape(n, 3)
    params[:, 4:8] = clips
    params[:, 8:10] = out_hw
    params[:, 10] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    params[:, 11] = flips
    return params, sizes


def check_images(images: Sequence[Any]) -> np.ndarray:
    """The channel count of each image (int64 ``[N]``), or a ``ConfigError`` for an
    image the kernel cannot read (not uint8 HWC of 1-4 channels: callers take those
    to the array-module path, as the CPU does)."""
    channels = np.array([img.shape[2] if img.ndim == 3 else 0 for img in images], np.int64)
    bad = [row for row, img in enumerate(images) if img.dtype != np.uint8 or not 1 <= channels[row] <= 4]
    if bad:
        img = images[bad[0]]
        raise ConfigError(f"the GPU crop/resize/normalize kernel takes uint8 HWC images of 1-4 channels; "
                          f"row {bad[0]} is {img.dtype} of shape {tuple(img.shape)}")
    return channels


def crop_resize_normalize(batch: Batch, images: list[Any], boxes: np.ndarray, clips: np.ndarray,
                          out_hw: np.ndarray, flips: np.ndarray, *, interp: str = "linear",
                          antialias: bool = True,
                          params: Callable[[int], tuple[np.ndarray, np.ndarray]] | None = None,
                          layout: str = "CHW", dtype: str = "float32") -> Any:
    """Run the fused kernel over uint8 HWC CuPy ``images`` (any strides: crops and
    flips may be views; 1 to 4 channels, counts may differ between rows). Per sample:
    ``boxes`` ``[N, 4]`` (y0, x0, h, w; source pixels, float), ``clips`` ``[N, 4]``
    (y0, x0, y1, x1; the pixels the filter may read), ``out_hw`` ``[N, 2]``, ``flips``
    ``[N]`` (bit 1 left-right, bit 2 upside down). ``params(channels)`` gives the
    normalization (mean, 1/std), float32 ``[channels]``, of images of that many
    channels (None: none). Returns one array ``[N, C, H, W]`` / ``[N, H, W, C]`` when
    every output has the same shape, else a list of per-sample views into one buffer."""
    n = len(images)
    if n == 0:
        return []
    channels = check_images(images)
    table, sizes = launch_params([img.data.ptr for img in images], [img.strides for img in images], channels,
                                 clips, out_hw, flips)
    boxes = np.asarray(boxes, np.float32).reshape(n, 4)
    out_hw = table[:, 8:10]
    threads = 256
    with batch.on_device() as cp:
        out = cp.empty(int(sizes.sum()), dtype=dtype)
        for c, rows in channel_groups(channels).items():
            mean, inv_std = (np.zeros(c, np.float32), np.ones(c, np.float32)) if params is None else params(c)
            args = (cp.asarray(table[rows]), cp.asarray(boxes[rows]),
                    cp.asarray(np.asarray(mean, np.float32)), cp.asarray(np.asarray(inv_std, np.float32)),
                    out, np.int32(c), np.int32(_INTERP[interp]), np.int32(antialias), np.int32(layout == "CHW"))
            pixels = int((out_hw[rows, 0] * out_hw[rows, 1]).max())
            _kernel(cp, dtype)(((pixels + threads - 1) // threads, len(rows)), (threads,), args)
    return split_output(out, table, sizes, channels, layout)


def split_output(out: Any, table: np.ndarray, sizes: np.ndarray, channels: np.ndarray, layout: str) -> Any:
    """The samples in the kernel's flat output ``out`` (``launch_params``' ``table`` and
    ``sizes``): one array ``[N, ...]`` when all have one shape, else a list of views."""
    shapes = [(c, h, w) if layout == "CHW" else (h, w, c) for c, (h, w) in zip(channels.tolist(),
                                                                               table[:, 8:10].tolist())]
    if all(shape == shapes[0] for shape in shapes):
        return out.reshape((len(shapes), *shapes[0]))
    return [out[o: o + s].reshape(shape) for o, s, shape in zip(table[:, 10].tolist(), sizes.tolist(), shapes)]
