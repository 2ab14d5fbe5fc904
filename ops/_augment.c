/* CPU augmentations of gpuio.ops: colour matrices, level tables, histograms, 3x3 filters,
 * the separable Gaussian blur, the affine warp sampler, colour jitter, MixUp / CutMix
 * (their mixing and their draws), and the per-sample random streams of ops/_rng.py. Each
 * call takes a whole batch (per-sample parameters as arrays, outputs allocated by the
 * caller) and runs with the GIL released, but for the streams' draws (microseconds).
 *
 * The float32 arithmetic is the CUDA kernels' (ops/augment.py COLOR_SOURCE and
 * BLUR_SOURCE, ops/warp.py WARP_SOURCE): the same products summed in the same order,
 * built without fused multiply-add (pyproject.toml: -ffp-contract=off), so the CPU and
 * the GPU give the same levels. Loops that can run over a whole row run over it, so that
 * the compiler vectorizes them without changing any element's order of operations
 * (interleaved pixels are split into planes of one channel and joined again). On x86-64
 * the per-image functions are built twice (target_clones: x86-64-v3, i.e. AVX2, and the
 * baseline) and picked at run time; with no fused multiply-add and no reordering both
 * give the same levels (tests/test_ops_augment.py builds the plain C, GPUIO_PORTABLE,
 * and compares).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && !defined(GPUIO_PORTABLE)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

/* The buffers of a list of HWC images (or their outputs). */
typedef struct {
    Py_buffer *v;
    Py_ssize_t n, got;
} Views;

static void release_views(Views *s) {
    for (Py_ssize_t i = 0; i < s->got; ++i) PyBuffer_Release(&s->v[i]);
    free(s->v);
    s->v = NULL;
    s->got = 0;
}

/* The format's type code without its byte-order prefix. */
static char code(const Py_buffer *b) {
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<') ++f;
    return *f;
}

/* `list` as n C-contiguous 3-D buffers of type `type` ('B' uint8, 'f' float32; 0: either),
 * writable when `writable`; `name` names the argument in errors. 0, or -1 with an
 * exception set (the views taken so far stay in `s` for release_views). */
static int get_views(PyObject *list, const char *name, int writable, char type, Views *s) {
    s->v = NULL;
    s->got = 0;
    if (!PyList_Check(list)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list", name);
        return -1;
    }
    s->n = PyList_GET_SIZE(list);
    s->v = calloc(s->n ? s->n : 1, sizeof(Py_buffer));
    if (!s->v) {
        PyErr_NoMemory();
        return -1;
    }
    const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    for (; s->got < s->n; ++s->got) {
        Py_buffer *b = &s->v[s->got];
        const int taken = PyObject_GetBuffer(PyList_GET_ITEM(list, s->got), b, flags) == 0;
        const char c = taken ? code(b) : 0;
        if (!taken || b->ndim != 3 || b->shape[2] < 1 || (type ? c != type : (c != 'B' && c != 'f'))
                || (c == 'B' ? b->itemsize != 1 : b->itemsize != 4)) {
            if (!taken) PyErr_Clear();  /* not a buffer, not contiguous or not writable: said below */
            PyErr_Format(PyExc_ValueError, "%s[%zd]: want a C-contiguous%s HWC array of %s", name, s->got,
                         writable ? ", writable" : "",
                         type == 'B' ? "uint8" : type == 'f' ? "float32" : "uint8 or float32");
            s->got += taken;
            return -1;
        }
    }
    return 0;
}

/* outs[i] must have the shape of images[i] (same_hw) or the channels of images[i] and the
 * type of images[i]. */
static int check_outs(const Views *images, const Views *outs, int same_hw) {
    if (outs->n != images->n) {
        PyErr_Format(PyExc_ValueError, "outs has %zd arrays for %zd images", outs->n, images->n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < images->n; ++i) {
        const Py_buffer *a = &images->v[i], *b = &outs->v[i];
        if (b->shape[2] != a->shape[2] || code(a) != code(b)
                || (same_hw && (b->shape[0] != a->shape[0] || b->shape[1] != a->shape[1]))) {
            PyErr_Format(PyExc_ValueError, "outs[%zd]: want the type%s of image %zd", i,
                         same_hw ? " and shape" : " and channels", i);
            return -1;
        }
    }
    return 0;
}

/* A C-contiguous parameter buffer of type `type` ('f' float32, 'd' float64, 'q' int64, 'Q' 64-bit
 * words: int64 or uint64, '?' bool or uint8, 'B' uint8) and at least `count` items. */
static int get_param(PyObject *obj, const char *name, char type, Py_ssize_t count, int writable, Py_buffer *b) {
    const int taken = PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT
                                                 | (writable ? PyBUF_WRITABLE : 0)) == 0;
    const char c = taken ? code(b) : 0;
    const int ok = taken && (type == 'q' ? ((c == 'q' || c == 'l') && b->itemsize == 8)
                             : type == 'Q' ? ((c == 'q' || c == 'l' || c == 'Q' || c == 'L') && b->itemsize == 8)
                             : type == '?' ? ((c == '?' || c == 'B') && b->itemsize == 1)
                                           : (c == type && b->itemsize == (type == 'f' ? 4 : type == 'd' ? 8 : 1)));
    if (!ok || b->len / b->itemsize < count) {
        if (taken) PyBuffer_Release(b);
        else PyErr_Clear();  /* not a buffer, not contiguous or not writable: said below */
        PyErr_Format(PyExc_ValueError, "%s: want a C-contiguous%s %s buffer of at least %zd items", name,
                     writable ? ", writable" : "",
                     type == 'f' ? "float32" : type == 'd' ? "float64" : type == 'q' ? "int64"
                     : type == 'Q' ? "uint64" : type == '?' ? "bool" : "uint8", count);
        return -1;
    }
    return 0;
}

/* The images of a batch, all of one shape (CutMix and MixUp mix each with the one before). */
static int same_shapes(const Views *images) {
    for (Py_ssize_t i = 1; i < images->n; ++i)
        if (memcmp(images->v[i].shape, images->v[0].shape, 3 * sizeof(Py_ssize_t)) != 0) {
            PyErr_Format(PyExc_ValueError, "images[%zd]: want the shape of images[0]", i);
            return -1;
        }
    return 0;
}

/* One batch call's buffers: its images, their outputs and one per-image parameter buffer. */
typedef struct {
    Views images, outs;
    Py_buffer param;
} Batch;

enum {
    SAME_SHAPES = 1,  /* the images all of one shape (checked after the outs) */
    ANY_HW = 2,       /* outs[i] of any height and width (else of images[i]'s shape) */
    PARAM_OUT = 4,    /* open_batch: the call is (images, param), param written and no outs */
};

/* The views of `images` (of type `type`, as get_views) and of `outs` (NULL: none), checked
 * (check_outs, same_shapes per `flags`). 0, or -1 with an exception set; close_batch
 * releases what was taken either way. */
static int open_views(Batch *b, PyObject *images, PyObject *outs, char type, int flags) {
    *b = (Batch){0};
    if (get_views(images, "images", 0, type, &b->images) < 0) return -1;
    if (outs && (get_views(outs, "outs", 1, type, &b->outs) < 0
                 || check_outs(&b->images, &b->outs, !(flags & ANY_HW)) < 0))
        return -1;
    return flags & SAME_SHAPES ? same_shapes(&b->images) : 0;
}

/* args (images, param, outs), or (images, param) with PARAM_OUT: uint8 images and outs
 * (open_views) and `param` of type `type` (get_param, named `name`), `per_image` items an
 * image. 0, or -1 with an exception set; close_batch releases either way. */
static int open_batch(Batch *b, PyObject *args, const char *name, char type, Py_ssize_t per_image, int flags) {
    PyObject *images, *param, *outs = NULL;
    *b = (Batch){0};
    if (!PyArg_ParseTuple(args, flags & PARAM_OUT ? "OO" : "OOO", &images, &param, &outs)
            || open_views(b, images, outs, 'B', flags) < 0)
        return -1;
    return get_param(param, name, type, per_image * b->images.n, flags & PARAM_OUT, &b->param);
}

/* Releases the batch's buffers; None when `status` is 0, NULL (the exception set) when -1. */
static PyObject *close_batch(Batch *b, int status) {
    if (b->param.obj) PyBuffer_Release(&b->param);
    release_views(&b->images);
    release_views(&b->outs);
    return status < 0 ? NULL : Py_NewRef(Py_None);
}

/* images[i] of 1-4 channels, `op` naming the call in the error. */
static int up_to_4_channels(const Views *images, const char *op) {
    for (Py_ssize_t i = 0; i < images->n; ++i)
        if (images->v[i].shape[2] > 4) {
            PyErr_Format(PyExc_ValueError, "images[%zd]: %s takes 1-4 channels", i, op);
            return -1;
        }
    return 0;
}

/* floor(v + 0.5) saturated to 0-255 (NaN: 0), as the kernels' fminf(fmaxf(floorf(..))),
 * without calls into libm: truncation is the floor of a positive number. */
static inline uint8_t to_level(float v) {
    const float x = v + 0.5f;
    return x > 0.0f ? (x < 255.0f ? (uint8_t)(int)x : 255) : 0;
}

/* floor of a float known to lie in int's range. */
static inline int floor_int(float v) {
    const int t = (int)v;
    return t - (t > v);
}

/* v held to [lo, hi], NaN to lo, as fminf(fmaxf(v, lo), hi). */
static inline float hold(float v, float lo, float hi) { return v >= lo ? (v < hi ? v : hi) : lo; }

/* ---- colour: out = M @ rgb + offset -------------------------------------------------- */

static inline __attribute__((always_inline)) void color_pixels(const uint8_t *src, uint8_t *dst, int64_t pixels,
                                                              int c, const float *m) {
    if (c < 3 || (m[1] == 0 && m[2] == 0 && m[3] == 0 && m[5] == 0 && m[6] == 0 && m[7] == 0)) {
        /* a * v + b per channel (M diagonal: the other two products add zeros, which
         * leaves the sum as it is): one table of 256 levels per channel */
        uint8_t table[3][256];
        const int k = c < 3 ? 1 : 3;
        for (int ch = 0; ch < k; ++ch)
            for (int v = 0; v < 256; ++v) table[ch][v] = to_level(m[ch * 4] * (float)v + m[9 + ch]);
        if (c < 3) {
            for (int64_t i = 0; i < pixels * c; ++i) dst[i] = table[0][src[i]];
            return;
        }
        for (int64_t p = 0; p < pixels; ++p) {
            const uint8_t *s = src + p * c;
            uint8_t *d = dst + p * c;
            d[0] = table[0][s[0]];
            d[1] = table[1][s[1]];
            d[2] = table[2][s[2]];
            for (int ch = 3; ch < c; ++ch) d[ch] = s[ch];
        }
        return;
    }
    /* blocks of pixels: channels into planes, the sums over the planes (vectorized), the
       levels interleaved again */
    enum { BLOCK = 256 };
    float in[3][BLOCK], out[3][BLOCK];
    uint8_t level[3][BLOCK];
    /* the same row and offset for the three channels (grey): one sum serves them all */
    const int planes = m[0] == m[3] && m[3] == m[6] && m[1] == m[4] && m[4] == m[7] && m[2] == m[5]
                       && m[5] == m[8] && m[9] == m[10] && m[10] == m[11] ? 1 : 3;
    const uint8_t *l1 = level[planes == 1 ? 0 : 1], *l2 = level[planes == 1 ? 0 : 2];
    for (int64_t start = 0; start < pixels; start += BLOCK) {
        const int n = pixels - start < BLOCK ? (int)(pixels - start) : BLOCK;
        const uint8_t *s = src + start * c;
        uint8_t *d = dst + start * c;
        for (int k = 0; k < n; ++k) {
            in[0][k] = s[k * c];
            in[1][k] = s[k * c + 1];
            in[2][k] = s[k * c + 2];
        }
        for (int ch = 0; ch < planes; ++ch) {
            const float a = m[ch * 3], b = m[ch * 3 + 1], e = m[ch * 3 + 2], off = m[9 + ch];
            for (int k = 0; k < n; ++k) out[ch][k] = a * in[0][k] + b * in[1][k] + e * in[2][k] + off;
        }
        for (int ch = 0; ch < planes; ++ch)
            for (int k = 0; k < n; ++k) level[ch][k] = to_level(out[ch][k]);
        for (int k = 0; k < n; ++k) {
            d[k * c] = level[0][k];
            d[k * c + 1] = l1[k];
            d[k * c + 2] = l2[k];
            for (int ch = 3; ch < c; ++ch) d[k * c + ch] = s[k * c + ch];
        }
    }
}

CLONES static void color_one(const uint8_t *src, uint8_t *dst, int64_t pixels, int c, const float *m) {
    if (c == 3)  /* RGB: the (de)interleaving loops vectorized */
        color_pixels(src, dst, pixels, 3, m);
    else
        color_pixels(src, dst, pixels, c, m);
}

static PyObject *color(PyObject *self, PyObject *args) {
    Batch b;
    if (open_batch(&b, args, "table", 'f', 12, 0) < 0) return close_batch(&b, -1);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < b.images.n; ++i)
        color_one(b.images.v[i].buf, b.outs.v[i].buf, b.images.v[i].shape[0] * b.images.v[i].shape[1],
                  (int)b.images.v[i].shape[2], (const float *)b.param.buf + 12 * i);
    Py_END_ALLOW_THREADS
    return close_batch(&b, 0);
}

/* ---- level tables and histograms ------------------------------------------------------ */

static PyObject *lut(PyObject *self, PyObject *args) {
    Batch b;
    if (open_batch(&b, args, "tables", 'B', 4 * 256, 0) < 0 || up_to_4_channels(&b.images, "lut") < 0)
        return close_batch(&b, -1);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < b.images.n; ++i) {
        const uint8_t *src = b.images.v[i].buf, *t = (const uint8_t *)b.param.buf + 1024 * i;
        uint8_t *dst = b.outs.v[i].buf;
        const int c = (int)b.images.v[i].shape[2];
        const int64_t pixels = b.images.v[i].shape[0] * b.images.v[i].shape[1];
        if (c == 3) {
            for (int64_t p = 0; p < pixels; ++p) {
                dst[3 * p] = t[src[3 * p]];
                dst[3 * p + 1] = t[256 + src[3 * p + 1]];
                dst[3 * p + 2] = t[512 + src[3 * p + 2]];
            }
        } else {
            for (int64_t p = 0; p < pixels; ++p)
                for (int ch = 0; ch < c; ++ch) dst[p * c + ch] = t[256 * ch + src[p * c + ch]];
        }
    }
    Py_END_ALLOW_THREADS
    return close_batch(&b, 0);
}

static PyObject *histogram(PyObject *self, PyObject *args) {
    Batch b;
    if (open_batch(&b, args, "counts", 'q', 4 * 256, PARAM_OUT) < 0 || up_to_4_channels(&b.images, "histogram") < 0)
        return close_batch(&b, -1);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < b.images.n; ++i) {
        const uint8_t *src = b.images.v[i].buf;
        int64_t *h = (int64_t *)b.param.buf + 1024 * i;
        const int c = (int)b.images.v[i].shape[2];
        const int64_t items = b.images.v[i].shape[0] * b.images.v[i].shape[1] * c;
        memset(h, 0, 1024 * sizeof(int64_t));
        if (c == 3) {
            for (int64_t j = 0; j + 2 < items; j += 3) {
                ++h[src[j]];
                ++h[256 + src[j + 1]];
                ++h[512 + src[j + 2]];
            }
        } else {
            for (int64_t j = 0; j < items; ++j) ++h[256 * (j % c) + src[j]];
        }
    }
    Py_END_ALLOW_THREADS
    return close_batch(&b, 0);
}

/* ---- colour jitter: torchvision's steps in float32, as ops/color.py's array code ------- */

/* The float32 luma of ops/color.py (_gray): 0.299 r + 0.587 g + 0.114 b, summed left to right. */
static inline float grey_of(float r, float g, float b) { return r * 0.299f + g * 0.587f + b * 0.114f; }

/* The interleaved uint8 pixels as c float planes of `pixels` values, and back as levels
 * (RGB written out, so that the loops vectorize). */
static void to_planes(const uint8_t *src, float *v, int64_t pixels, int c) {
    if (c == 3) {
        float *r = v, *g = v + pixels, *b = v + 2 * pixels;
        for (int64_t p = 0; p < pixels; ++p) {
            r[p] = src[3 * p];
            g[p] = src[3 * p + 1];
            b[p] = src[3 * p + 2];
        }
        return;
    }
    for (int64_t p = 0; p < pixels; ++p)
        for (int ch = 0; ch < c; ++ch) v[ch * pixels + p] = src[p * c + ch];
}

static void from_planes(const float *v, uint8_t *dst, int64_t pixels, int c) {
    if (c == 3) {
        const float *r = v, *g = v + pixels, *b = v + 2 * pixels;
        for (int64_t p = 0; p < pixels; ++p) {
            dst[3 * p] = to_level(r[p]);
            dst[3 * p + 1] = to_level(g[p]);
            dst[3 * p + 2] = to_level(b[p]);
        }
        return;
    }
    for (int64_t p = 0; p < pixels; ++p)
        for (int ch = 0; ch < c; ++ch) dst[p * c + ch] = to_level(v[ch * pixels + p]);
}

/* prm: the 4 steps in the order to apply them (0 brightness, 1 contrast, 2 saturation, 3
 * hue; -1 skipped) then the 4 factors (float64). v: (c + 1) planes of scratch. */
CLONES static void jitter_one(const uint8_t *src, uint8_t *dst, int64_t pixels, int c, const double *prm, float *v) {
    const int64_t n = pixels * c;
    float *r = v, *g = v + pixels, *b = v + 2 * pixels, *grey = v + n;
    to_planes(src, v, pixels, c);
    for (int k = 0; k < 4; ++k) {
        const int step = (int)prm[k];
        if (step < 0) continue;
        const double f = prm[4 + step];
        const float ff = (float)f;
        if (step == 0) {  /* v * f, held to 0-255 */
            for (int64_t j = 0; j < n; ++j) v[j] = hold(v[j] * ff, 0.0f, 255.0f);
        } else if (step == 1) {  /* v * f + mean grey * (1 - f): the mean summed in double */
            double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, sum = 0.0;
            const int64_t count = c >= 3 ? pixels : n;
            if (c >= 3)
                for (int64_t p = 0; p < pixels; ++p) grey[p] = grey_of(r[p], g[p], b[p]);
            const float *vals = c >= 3 ? grey : v;
            int64_t j = 0;
            for (; j + 8 <= count; j += 8)
                for (int q = 0; q < 8; ++q) acc[q] += vals[j + q];
            for (; j < count; ++j) sum += vals[j];
            for (int q = 0; q < 8; ++q) sum += acc[q];
            const float add = (float)(sum / (double)(count ? count : 1) * (1.0 - f));
            for (j = 0; j < n; ++j) v[j] = hold(v[j] * ff + add, 0.0f, 255.0f);
        } else if (step == 2) {  /* v * f + grey * (1 - f) on every channel */
            const float rest = (float)(1.0 - f);
            for (int64_t p = 0; p < pixels; ++p) grey[p] = grey_of(r[p], g[p], b[p]) * rest;
            for (int ch = 0; ch < c; ++ch) {
                float *plane = v + ch * pixels;
                for (int64_t p = 0; p < pixels; ++p) plane[p] = hold(plane[p] * ff + grey[p], 0.0f, 255.0f);
            }
        } else {  /* RGB -> HSV, H + f turns (mod 1), -> RGB (ops/color.py _shift_hue) */
            /* two loops that vectorize: (max, s, h) into the r, g and grey planes; then
               the RGB of each. Every branch is computed, then picked (selects). */
            for (int64_t p = 0; p < pixels; ++p) {
                const float R = r[p], G = g[p], B = b[p];
                const float mx0 = R > G ? R : G, mn0 = R < G ? R : G;
                const float mx = mx0 > B ? mx0 : B, mn = mn0 < B ? mn0 : B, delta = mx - mn;
                const float safe = delta > 0.0f ? delta : 1.0f, mx1 = mx > 0.0f ? mx : 1.0f;
                const float h0 = (G - B) / safe, h1 = 2.0f + (B - R) / safe, h2 = 4.0f + (R - G) / safe;
                float hh = h2;
                hh = mx == G ? h1 : hh;
                hh = mx == R ? h0 : hh;
                /* |x| < 2, where x - trunc(x) is fmodf(x, 1) exactly; NumPy's % then adds 1
                   to a negative remainder */
                const float x = hh / 6.0f + ff;
                const float rem = x - (float)(int)x, up = rem + 1.0f;
                const float wrapped = rem < 0.0f ? up : rem;
                const float sq = delta / mx1;
                r[p] = mx;
                g[p] = mx > 0.0f ? sq : 0.0f;
                grey[p] = delta > 0.0f ? wrapped : 0.0f;
            }
            for (int64_t p = 0; p < pixels; ++p) {
                const float mx = r[p], s = g[p], h = grey[p];
                const float i = (float)(int)(h * 6.0f);  /* h >= 0: the cast floors */
                const float fr = h * 6.0f - i;
                const float P = mx * (1.0f - s), Q = mx * (1.0f - s * fr), T = mx * (1.0f - s * (1.0f - fr));
                /* sector i's (r, g, b); i = 6 (h rounded up to 1) gives 0, np.select's default */
                float ro = 0.0f, go = 0.0f, bo = 0.0f;
                ro = i == 0.0f ? mx : ro;
                ro = i == 1.0f ? Q : ro;
                ro = i == 2.0f ? P : ro;
                ro = i == 3.0f ? P : ro;
                ro = i == 4.0f ? T : ro;
                ro = i == 5.0f ? mx : ro;
                go = i == 0.0f ? T : go;
                go = i == 1.0f ? mx : go;
                go = i == 2.0f ? mx : go;
                go = i == 3.0f ? Q : go;
                go = i == 4.0f ? P : go;
                go = i == 5.0f ? P : go;
                bo = i == 0.0f ? P : bo;
                bo = i == 1.0f ? P : bo;
                bo = i == 2.0f ? T : bo;
                bo = i == 3.0f ? mx : bo;
                bo = i == 4.0f ? mx : bo;
                bo = i == 5.0f ? Q : bo;
                r[p] = ro;
                g[p] = go;
                b[p] = bo;
            }
        }
    }
    from_planes(v, dst, pixels, c);
}

static PyObject *jitter(PyObject *self, PyObject *args) {
    Batch b;
    if (open_batch(&b, args, "params", 'd', 8, 0) < 0) return close_batch(&b, -1);
    const Views *images = &b.images;
    const double *prm = b.param.buf;
    for (Py_ssize_t i = 0; i < images->n; ++i)
        for (int k = 0; k < 4; ++k) {
            const double step = prm[8 * i + k];
            if (!(step == -1 || step == 0 || step == 1 || step == 2 || step == 3)
                    || (images->v[i].shape[2] < 3 && (step == 2 || step == 3))) {
                PyErr_Format(PyExc_ValueError, "params[%zd, %d]: a step is -1 or 0-3 (2 and 3 need 3 channels)", i, k);
                return close_batch(&b, -1);
            }
        }
    size_t need = 1; /* one scratch for the batch: the largest image's planes and a grey plane */
    for (Py_ssize_t i = 0; i < images->n; ++i) {
        const size_t pixels = (size_t)images->v[i].shape[0] * (size_t)images->v[i].shape[1];
        if (pixels * ((size_t)images->v[i].shape[2] + 1) > need) need = pixels * ((size_t)images->v[i].shape[2] + 1);
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    float *scratch = malloc(sizeof(float) * need);
    failed = !scratch;
    for (Py_ssize_t i = 0; i < images->n && !failed; ++i)
        jitter_one(images->v[i].buf, b.outs.v[i].buf, images->v[i].shape[0] * images->v[i].shape[1],
                   (int)images->v[i].shape[2], prm + 8 * i, scratch);
    free(scratch);
    Py_END_ALLOW_THREADS
    if (failed) PyErr_NoMemory();
    return close_batch(&b, failed ? -1 : 0);
}

/* ---- batch mixing: MixUp's weighted sum and CutMix's box, with the row before ---------- */

/* out = w * a + (1 - w) * b per value, float32 (ops/mix.py), rounded half up. */
CLONES static void mix_one(const uint8_t *a, const uint8_t *b, uint8_t *dst, int64_t n, float w, float rest) {
    for (int64_t j = 0; j < n; ++j) dst[j] = to_level(w * (float)a[j] + rest * (float)b[j]);
}

static PyObject *mix(PyObject *self, PyObject *args) {
    Batch b;
    if (open_batch(&b, args, "weights", 'f', 2, SAME_SHAPES) < 0) return close_batch(&b, -1);
    Py_BEGIN_ALLOW_THREADS
    const float *w = b.param.buf;
    const Views *images = &b.images;
    for (Py_ssize_t i = 0; i < images->n; ++i) {
        const Py_buffer *v = &images->v[i];
        mix_one(v->buf, images->v[(i + images->n - 1) % images->n].buf, b.outs.v[i].buf, v->len, w[2 * i],
                w[2 * i + 1]);
    }
    Py_END_ALLOW_THREADS
    return close_batch(&b, 0);
}

static PyObject *paste(PyObject *self, PyObject *args) {
    Batch b;
    if (open_batch(&b, args, "boxes", 'q', 4, SAME_SHAPES) < 0) return close_batch(&b, -1);
    const Views *images = &b.images;
    const int64_t *box = b.param.buf;
    for (Py_ssize_t i = 0; i < images->n; ++i) {
        const int64_t *q = box + 4 * i, h = images->v[i].shape[0], w = images->v[i].shape[1];
        if (!(0 <= q[0] && q[0] <= q[2] && q[2] <= h && 0 <= q[1] && q[1] <= q[3] && q[3] <= w)) {
            PyErr_Format(PyExc_ValueError, "boxes[%zd]: want 0 <= y0 <= y1 <= height and 0 <= x0 <= x1 <= width", i);
            return close_batch(&b, -1);
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < images->n; ++i) {
        const Py_buffer *v = &images->v[i];
        const uint8_t *a = v->buf, *prev = images->v[(i + images->n - 1) % images->n].buf;
        uint8_t *d = b.outs.v[i].buf;
        const int64_t *q = box + 4 * i, row = v->shape[1] * v->shape[2], c = v->shape[2];
        for (int64_t y = 0; y < v->shape[0]; ++y) {
            const int64_t at = y * row;
            if (y < q[0] || y >= q[2] || q[1] == q[3]) {
                memcpy(d + at, a + at, (size_t)row);
                continue;
            }
            memcpy(d + at, a + at, (size_t)(q[1] * c));
            memcpy(d + at + q[1] * c, prev + at + q[1] * c, (size_t)((q[3] - q[1]) * c));
            memcpy(d + at + q[3] * c, a + at + q[3] * c, (size_t)(row - q[3] * c));
        }
    }
    Py_END_ALLOW_THREADS
    return close_batch(&b, 0);
}

/* ---- NumPy's Generator on PCG64, written out: batch streams, MixUp and CutMix's draws -- */

/* batch.rng(row, salt) is Generator(PCG64(SeedSequence([seed, salt]))); these are the
 * algorithms NumPy documents and keeps stable, the one copy of them in gpuio (ops/_rng.py
 * wraps them for batches): SeedSequence's hash of the entropy words into a pool of 4 and its generate_state(4, uint64), PCG64's 128-bit LCG
 * with the XSL-RR output, Generator.random (53 bits), integers(0, n) (Lemire's method on
 * 32-bit draws, the high half of an output kept for the next one) and beta(a, a) for a
 * <= 1 (Johnk's method, with libm's pow as NumPy calls it). */
typedef struct {
    __uint128_t state, inc;
    uint32_t half;
    int has_half;
} Pcg64;

static const __uint128_t PCG_MULT = ((__uint128_t)0x2360ED051FC65DA4ULL << 64) | 0x4385DF649FCCF645ULL;

static uint32_t hashmix(uint32_t value, uint32_t *hash_const) {
    value ^= *hash_const;
    *hash_const *= 0x931E8875U;
    value *= *hash_const;
    return value ^ (value >> 16);
}

static uint32_t mix32(uint32_t x, uint32_t y) {
    const uint32_t result = 0xCA01F9DDU * x - 0x4973F715U * y;
    return result ^ (result >> 16);
}

static void pcg_seed(Pcg64 *g, uint64_t seed, uint32_t salt) {
    const int wide = (seed >> 32) != 0;  /* the seed takes two 32-bit entropy words, else one */
    const uint32_t entropy[4] = {(uint32_t)seed, wide ? (uint32_t)(seed >> 32) : salt, wide ? salt : 0, 0};
    uint32_t pool[4], hash_const = 0x43B0D7E5U;
    for (int i = 0; i < 4; ++i) pool[i] = hashmix(entropy[i], &hash_const);
    for (int src = 0; src < 4; ++src)
        for (int dst = 0; dst < 4; ++dst)
            if (src != dst) pool[dst] = mix32(pool[dst], hashmix(pool[src], &hash_const));
    uint32_t words[8], const_b = 0x8B51F9DDU;
    for (int k = 0; k < 8; ++k) {
        uint32_t value = pool[k % 4] ^ const_b;
        const_b *= 0x58F38DEDU;
        value *= const_b;
        words[k] = value ^ (value >> 16);
    }
    uint64_t w64[4];
    for (int k = 0; k < 4; ++k) w64[k] = words[2 * k] | ((uint64_t)words[2 * k + 1] << 32);
    const __uint128_t init = ((__uint128_t)w64[0] << 64) | w64[1], seq = ((__uint128_t)w64[2] << 64) | w64[3];
    g->state = 0;
    g->inc = (seq << 1) | 1;
    g->state = g->state * PCG_MULT + g->inc;
    g->state += init;
    g->state = g->state * PCG_MULT + g->inc;
    g->half = 0;
    g->has_half = 0;
}

static uint64_t pcg_next64(Pcg64 *g) {
    g->state = g->state * PCG_MULT + g->inc;
    const uint64_t hi = (uint64_t)(g->state >> 64), value = hi ^ (uint64_t)g->state;
    const unsigned rot = (unsigned)(hi >> 58);
    return (value >> rot) | (value << ((64 - rot) & 63));
}

static uint32_t pcg_next32(Pcg64 *g) {
    if (g->has_half) {
        g->has_half = 0;
        return g->half;
    }
    const uint64_t next = pcg_next64(g);
    g->has_half = 1;
    g->half = (uint32_t)(next >> 32);
    return (uint32_t)next;
}

static double pcg_random(Pcg64 *g) { return (double)(pcg_next64(g) >> 11) * (1.0 / 9007199254740992.0); }

/* integers(0, n), 1 <= n <= 2**32 */
static int64_t pcg_below(Pcg64 *g, uint64_t n) {
    if (n <= 1) return 0;
    uint64_t m = (uint64_t)pcg_next32(g) * n;
    uint32_t leftover = (uint32_t)m;
    if (leftover < n) {
        const uint32_t threshold = (uint32_t)((UINT32_MAX - (n - 1)) % n);
        while (leftover < threshold) {
            m = (uint64_t)pcg_next32(g) * n;
            leftover = (uint32_t)m;
        }
    }
    return (int64_t)(m >> 32);
}

/* NumPy's random_interval for max < 2**32: a 32-bit draw under the smallest all-ones
 * mask covering max, redrawn while above max */
static uint32_t pcg_interval(Pcg64 *g, uint32_t max) {
    if (max == 0) return 0;
    uint32_t mask = max, v;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    while ((v = pcg_next32(g) & mask) > max) {
    }
    return v;
}

static double pcg_beta_johnk(Pcg64 *g, double a) {
    for (;;) {
        const double u = pcg_random(g), v = pcg_random(g);
        const double x = pow(u, 1.0 / a), y = pow(v, 1.0 / a), sum = x + y;
        if (sum <= 1.0 && u + v > 0.0) {
            if (sum > 0) return x / sum;
            double lx = log(u) / a, ly = log(v) / a;
            const double lm = lx > ly ? lx : ly;
            lx -= lm;
            ly -= lm;
            return exp(lx - log(exp(lx) + exp(ly)));
        }
    }
}

/* Streams for ops/_rng.py: one generator per row of a uint64 [N, 6] state array (the
 * 128-bit state and increment, high words first, then the kept 32-bit half and its flag),
 * drawn one kind of number over the rows at a time. The calls are microseconds: they keep
 * the GIL. */
enum { PCG_WORDS = 6 };

static void pcg_load(Pcg64 *g, const uint64_t *w) {
    g->state = ((__uint128_t)w[0] << 64) | w[1];
    g->inc = ((__uint128_t)w[2] << 64) | w[3];
    g->half = (uint32_t)w[4];
    g->has_half = w[5] != 0;
}

static void pcg_store(const Pcg64 *g, uint64_t *w) {
    w[0] = (uint64_t)(g->state >> 64);
    w[1] = (uint64_t)g->state;
    w[2] = (uint64_t)(g->inc >> 64);
    w[3] = (uint64_t)g->inc;
    w[4] = g->half;
    w[5] = (uint64_t)g->has_half;
}

/* The state array (writable) and its rows; `rows` (None: all, else bool [N]) and `out`
 * (`out_type` per get_param, N items) beside it. */
typedef struct {
    Py_buffer state, rows, out;
    Py_ssize_t n;
} Draw;

static void draw_release(Draw *d) {
    if (d->state.obj) PyBuffer_Release(&d->state);
    if (d->rows.obj) PyBuffer_Release(&d->rows);
    if (d->out.obj) PyBuffer_Release(&d->out);
}

static int draw_get(PyObject *state, PyObject *rows, PyObject *out, char out_type, Draw *d) {
    memset(d, 0, sizeof *d);
    if (get_param(state, "state", 'Q', 0, 1, &d->state) < 0) return -1;
    d->n = d->state.len / (8 * PCG_WORDS);
    if (d->state.len != d->n * 8 * PCG_WORDS) {
        PyErr_Format(PyExc_ValueError, "state: want %d words per stream, got %zd words", PCG_WORDS, d->state.len / 8);
        return -1;
    }
    if (rows != Py_None && get_param(rows, "rows", '?', d->n, 0, &d->rows) < 0) return -1;
    return get_param(out, "out", out_type, d->n, 1, &d->out);
}

static int draw_row(const Draw *d, Py_ssize_t i) { return !d->rows.obj || ((const uint8_t *)d->rows.buf)[i]; }

/* out[i] = EXPR of the row's stream g (loaded, drawn from, stored back) where the row is
 * drawn, FILL elsewhere (that stream stays). */
#define DRAW_ROWS(d, o, FILL, EXPR)                                                  \
    for (Py_ssize_t i = 0; i < (d).n; ++i) {                                         \
        uint64_t *words_ = (uint64_t *)(d).state.buf + PCG_WORDS * i;                \
        Pcg64 g;                                                                     \
        if (!draw_row(&(d), i)) {                                                    \
            (o)[i] = (FILL);                                                         \
            continue;                                                                \
        }                                                                            \
        pcg_load(&g, words_);                                                        \
        (o)[i] = (EXPR);                                                             \
        pcg_store(&g, words_);                                                       \
    }

static PyObject *rng_seed(PyObject *self, PyObject *args) {
    PyObject *seeds_obj, *state_obj;
    unsigned long long salt;
    if (!PyArg_ParseTuple(args, "OKO", &seeds_obj, &salt, &state_obj)) return NULL;
    if (salt > 0xFFFFFFFFULL) {
        PyErr_Format(PyExc_ValueError, "salt %#llx: 32 bits at most", salt);
        return NULL;
    }
    Py_buffer seeds = {0}, state = {0};
    PyObject *result = NULL;
    if (get_param(seeds_obj, "seeds", 'Q', 0, 0, &seeds) < 0) return NULL;
    const Py_ssize_t n = seeds.len / 8;
    if (get_param(state_obj, "state", 'Q', PCG_WORDS * n, 1, &state) < 0) goto done;
    const uint64_t *s = seeds.buf;
    for (Py_ssize_t i = 0; i < n; ++i) {
        Pcg64 g;
        pcg_seed(&g, s[i], (uint32_t)salt);
        pcg_store(&g, (uint64_t *)state.buf + PCG_WORDS * i);
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&seeds);
    if (state.obj) PyBuffer_Release(&state);
    return result;
}

static PyObject *rng_next64(PyObject *self, PyObject *args) {
    PyObject *state, *rows, *out;
    if (!PyArg_ParseTuple(args, "OOO", &state, &rows, &out)) return NULL;
    Draw d;
    if (draw_get(state, rows, out, 'Q', &d) < 0) {
        draw_release(&d);
        return NULL;
    }
    uint64_t *o = d.out.buf;
    DRAW_ROWS(d, o, 0, pcg_next64(&g))
    draw_release(&d);
    Py_RETURN_NONE;
}

static PyObject *rng_uniform(PyObject *self, PyObject *args) {
    PyObject *state, *rows, *out;
    double low, high;
    if (!PyArg_ParseTuple(args, "OOddO", &state, &rows, &low, &high, &out)) return NULL;
    Draw d;
    if (draw_get(state, rows, out, 'd', &d) < 0) {
        draw_release(&d);
        return NULL;
    }
    const double span = high - low;
    double *o = d.out.buf;
    DRAW_ROWS(d, o, low, low + span * pcg_random(&g))
    draw_release(&d);
    Py_RETURN_NONE;
}

static PyObject *rng_integers(PyObject *self, PyObject *args) {
    PyObject *state, *rows, *high_obj, *out;
    if (!PyArg_ParseTuple(args, "OOOO", &state, &rows, &high_obj, &out)) return NULL;
    Draw d;
    Py_buffer high = {0};
    PyObject *result = NULL;
    if (draw_get(state, rows, out, 'q', &d) < 0 || get_param(high_obj, "high", 'q', d.n, 0, &high) < 0) goto done;
    const int64_t *hi = high.buf;
    for (Py_ssize_t i = 0; i < d.n; ++i)
        if (draw_row(&d, i) && (hi[i] < 1 || hi[i] > 0x100000000LL)) {  /* before any stream moves */
            PyErr_Format(PyExc_ValueError, "high[%zd] = %lld: want 1 <= high <= 2**32", i, (long long)hi[i]);
            goto done;
        }
    int64_t *o = d.out.buf;
    DRAW_ROWS(d, o, 0, (int64_t)pcg_below(&g, (uint64_t)hi[i]))
    result = Py_NewRef(Py_None);
done:
    draw_release(&d);
    if (high.obj) PyBuffer_Release(&high);
    return result;
}

/* torchvision's box tries (RandomResizedCrop, RandomErasing) from a stream: up to 10 of
 * an area of uniform(scale) x the image's and an aspect exp(uniform(log ratio)) (libm's
 * exp and log, which Python's math calls), sides rounded half to even; the first box that
 * fits draws its top, then its left. A crop's width is sqrt(area * aspect) and may reach
 * the image's sides; an erased box's height is, and it stays inside them. No fit: a crop
 * takes the centered box of the ratio closest to the image's, an erase none (`out`, which
 * holds zeros, stays). */
static void pcg_box(Pcg64 *g, int64_t h, int64_t w, const double *scale, const double *log_ratio,
                    const double *ratio, int erase, int64_t *out) {
    const double area = (double)(h * w);
    for (int t = 0; t < 10; ++t) {
        const double target = area * (scale[0] + (scale[1] - scale[0]) * pcg_random(g));
        const double aspect = exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * pcg_random(g));
        const int64_t a = (int64_t)rint(sqrt(target * aspect)), b = (int64_t)rint(sqrt(target / aspect));
        const int64_t bh = erase ? a : b, bw = erase ? b : a;
        if (erase ? (bh > 0 && bh < h && bw > 0 && bw < w) : (bh > 0 && bh <= h && bw > 0 && bw <= w)) {
            out[0] = pcg_below(g, (uint64_t)(h - bh + 1));
            out[1] = pcg_below(g, (uint64_t)(w - bw + 1));
            out[2] = bh;
            out[3] = bw;
            return;
        }
    }
    if (erase) return;  /* out stays zeros */
    int64_t ch = h, cw = w;
    if ((double)w / (double)h < ratio[0]) {
        ch = (int64_t)rint((double)w / ratio[0]);
    } else if ((double)w / (double)h > ratio[1]) {
        cw = (int64_t)rint((double)h * ratio[1]);
    }
    out[0] = (h - ch) >> 1;  /* floor division, as Python's // */
    out[1] = (w - cw) >> 1;
    out[2] = ch;
    out[3] = cw;
}

static PyObject *rng_boxes(PyObject *self, PyObject *args) {
    PyObject *state, *rows, *hw_obj, *out;
    double scale[2], ratio[2];
    int erase;
    if (!PyArg_ParseTuple(args, "OOO(dd)(dd)pO", &state, &rows, &hw_obj, &scale[0], &scale[1], &ratio[0], &ratio[1],
                          &erase, &out))
        return NULL;
    Draw d;
    Py_buffer hw = {0};
    PyObject *result = NULL;
    if (draw_get(state, rows, out, 'q', &d) < 0 || get_param(hw_obj, "hw", 'q', 2 * d.n, 0, &hw) < 0) goto done;
    if (d.out.len < 4 * 8 * d.n) {
        PyErr_Format(PyExc_ValueError, "out: want a C-contiguous, writable int64 buffer of at least %zd items", 4 * d.n);
        goto done;
    }
    const double log_ratio[2] = {log(ratio[0]), log(ratio[1])};
    const int64_t *size = hw.buf;
    uint64_t *w = d.state.buf;
    int64_t *o = d.out.buf;
    for (Py_ssize_t i = 0; i < d.n; ++i) {
        Pcg64 g;
        o[4 * i] = o[4 * i + 1] = o[4 * i + 2] = o[4 * i + 3] = 0;
        if (!draw_row(&d, i) || size[2 * i] <= 0 || size[2 * i + 1] <= 0) continue;
        pcg_load(&g, w + PCG_WORDS * i);
        pcg_box(&g, size[2 * i], size[2 * i + 1], scale, log_ratio, ratio, erase, o + 4 * i);
        pcg_store(&g, w + PCG_WORDS * i);
    }
    result = Py_NewRef(Py_None);
done:
    draw_release(&d);
    if (hw.obj) PyBuffer_Release(&hw);
    return result;
}

/* Generator.permutation(k): arange(k) shuffled from its last item down (item i swapped
 * with item random_interval(i)), k items per row of out (int64 [N, k]) */
static PyObject *rng_permutation(PyObject *self, PyObject *args) {
    PyObject *state, *rows, *out;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OOnO", &state, &rows, &k, &out)) return NULL;
    if (k < 1 || k > 0xFFFFFFFFLL) {
        PyErr_Format(PyExc_ValueError, "rng_permutation takes 1 <= k < 2**32 items, got %zd", k);
        return NULL;
    }
    Draw d;
    PyObject *result = NULL;
    if (draw_get(state, rows, out, 'q', &d) < 0) goto done;
    if (d.out.len < k * 8 * d.n) {
        PyErr_Format(PyExc_ValueError, "out: want a C-contiguous, writable int64 buffer of at least %zd items", k * d.n);
        goto done;
    }
    uint64_t *w = d.state.buf;
    for (Py_ssize_t i = 0; i < d.n; ++i) {
        int64_t *o = (int64_t *)d.out.buf + k * i;
        for (Py_ssize_t j = 0; j < k; ++j) o[j] = j;
        if (!draw_row(&d, i)) continue;
        Pcg64 g;
        pcg_load(&g, w + PCG_WORDS * i);
        for (Py_ssize_t j = k - 1; j > 0; --j) {
            const uint32_t r = pcg_interval(&g, (uint32_t)j);
            const int64_t t = o[j];
            o[j] = o[r];
            o[r] = t;
        }
        pcg_store(&g, w + PCG_WORDS * i);
    }
    result = Py_NewRef(Py_None);
done:
    draw_release(&d);
    return result;
}

static PyObject *rng_beta(PyObject *self, PyObject *args) {
    PyObject *state, *rows, *out;
    double alpha;
    if (!PyArg_ParseTuple(args, "OOdO", &state, &rows, &alpha, &out)) return NULL;
    if (!(alpha > 0.0 && alpha <= 1.0)) {
        PyErr_Format(PyExc_ValueError, "rng_beta takes 0 < alpha <= 1 (Johnk's method), got %g", alpha);
        return NULL;
    }
    Draw d;
    if (draw_get(state, rows, out, 'd', &d) < 0) {
        draw_release(&d);
        return NULL;
    }
    double *o = d.out.buf;
    DRAW_ROWS(d, o, 0.0, pcg_beta_johnk(&g, alpha))
    draw_release(&d);
    Py_RETURN_NONE;
}

/* ---- filters: borders mirrored without repeating the edge pixel (dcb|abcd|cba) -------- */

static inline int reflect101(int j, int n) {
    if (n == 1) return 0;
    while (j < 0 || j >= n) j = j < 0 ? -j : 2 * n - 2 - j;
    return j;
}

/* acc = sum over (dy, dx) in row-major order of k[dy][dx] * pixel(y + dy - 1, x + dx - 1),
 * from 0, float32; `pad` holds 3 float rows of w + 2 pixels (scratch). */
CLONES static void filter3x3_one(const uint8_t *src, uint8_t *dst, int h, int w, int c, const float *k, float *pad) {
    const int64_t row = (int64_t)(w + 2) * c;
    float *acc = pad + 3 * row;
    if (h == 0 || w == 0) return;
    for (int y = 0; y < h; ++y) {
        for (int dy = 0; dy < 3; ++dy) {
            const uint8_t *s = src + (int64_t)reflect101(y + dy - 1, h) * w * c;
            float *p = pad + dy * row;
            for (int64_t j = 0; j < (int64_t)w * c; ++j) p[c + j] = s[j];
            for (int ch = 0; ch < c; ++ch) {
                p[ch] = s[(int64_t)reflect101(-1, w) * c + ch];
                p[(int64_t)(w + 1) * c + ch] = s[(int64_t)reflect101(w, w) * c + ch];
            }
        }
        const int64_t n = (int64_t)w * c;
        for (int64_t j = 0; j < n; ++j) acc[j] = 0.0f;
        for (int dy = 0; dy < 3; ++dy)
            for (int dx = 0; dx < 3; ++dx) {
                const float kv = k[dy * 3 + dx], *p = pad + dy * row + dx * c;
                for (int64_t j = 0; j < n; ++j) acc[j] += kv * p[j];
            }
        uint8_t *d = dst + (int64_t)y * n;
        for (int64_t j = 0; j < n; ++j) d[j] = to_level(acc[j]);
    }
}

static PyObject *filter3x3(PyObject *self, PyObject *args) {
    Batch b;
    if (open_batch(&b, args, "kernels", 'f', 9, 0) < 0) return close_batch(&b, -1);
    const Views *images = &b.images;
    size_t need = 1; /* one scratch for the batch, of the largest image's size */
    for (Py_ssize_t i = 0; i < images->n; ++i) {
        const size_t w = (size_t)images->v[i].shape[1], c = (size_t)images->v[i].shape[2];
        if ((3 * (w + 2) + w) * c > need) need = (3 * (w + 2) + w) * c;
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    float *pad = malloc(sizeof(float) * need);
    failed = !pad;
    for (Py_ssize_t i = 0; i < images->n && !failed; ++i) {
        const Py_buffer *v = &images->v[i];
        const int h = (int)v->shape[0], w = (int)v->shape[1], c = (int)v->shape[2];
        filter3x3_one(v->buf, b.outs.v[i].buf, h, w, c, (const float *)b.param.buf + 9 * i, pad);
    }
    free(pad);
    Py_END_ALLOW_THREADS
    if (failed) PyErr_NoMemory();
    return close_batch(&b, failed ? -1 : 0);
}

/* Separable blur of one image: rows with kx (into `mid`, float32 h x w x c), then columns
 * with ky, each tap's product added in tap order from 0 (BLUR_SOURCE's order). `line`:
 * scratch of (w + 2 rx) * c floats. Output uint8 (rounded half up, saturated) or float32. */
CLONES static void blur_one(const void *src, int u8, void *dst, int h, int w, int c, const float *ky, int ry,
                     const float *kx, int rx, float *mid, float *line) {
    const int64_t n = (int64_t)w * c;
    if (h == 0 || w == 0) return;
    for (int y = 0; y < h; ++y) {
        const int64_t base = (int64_t)y * n;
        if (u8)
            for (int64_t j = 0; j < n; ++j) line[(int64_t)rx * c + j] = ((const uint8_t *)src)[base + j];
        else
            memcpy(line + (int64_t)rx * c, (const float *)src + base, sizeof(float) * n);
        for (int x = -rx; x < w + rx; ++x) {
            if (x == 0) x = w;  /* the inside is copied */
            const int64_t from = base + (int64_t)reflect101(x, w) * c;
            float *p = line + (int64_t)(x + rx) * c;
            for (int ch = 0; ch < c; ++ch)
                p[ch] = u8 ? (float)((const uint8_t *)src)[from + ch] : ((const float *)src)[from + ch];
        }
        float *acc = mid + y * n;
        for (int64_t j = 0; j < n; ++j) acc[j] = 0.0f;
        for (int k = 0; k <= 2 * rx; ++k) {
            const float kv = kx[k], *p = line + (int64_t)k * c;
            for (int64_t j = 0; j < n; ++j) acc[j] += kv * p[j];
        }
    }
    for (int y = 0; y < h; ++y) {
        float *acc = line;  /* n <= (w + 2 rx) * c floats */
        for (int64_t j = 0; j < n; ++j) acc[j] = 0.0f;
        for (int k = -ry; k <= ry; ++k) {
            const float kv = ky[k + ry], *p = mid + reflect101(y + k, h) * n;
            for (int64_t j = 0; j < n; ++j) acc[j] += kv * p[j];
        }
        if (u8) {
            uint8_t *d = (uint8_t *)dst + y * n;
            for (int64_t j = 0; j < n; ++j) d[j] = to_level(acc[j]);
        } else {
            memcpy((float *)dst + y * n, acc, sizeof(float) * n);
        }
    }
}

static PyObject *blur(PyObject *self, PyObject *args) {
    PyObject *images_obj, *ky_obj, *kx_obj, *outs_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &images_obj, &ky_obj, &kx_obj, &outs_obj)) return NULL;
    Batch b;
    Views ky = {0}, kx = {0};
    int status = -1;
    Py_buffer *weights[2] = {NULL, NULL};
    if (open_views(&b, images_obj, outs_obj, 0, 0) < 0) goto done;
    const Views *images = &b.images;
    if (!PyList_Check(ky_obj) || !PyList_Check(kx_obj) || PyList_GET_SIZE(ky_obj) != images->n
            || PyList_GET_SIZE(kx_obj) != images->n) {
        PyErr_SetString(PyExc_ValueError, "ky and kx must be lists of one float32 kernel per image");
        goto done;
    }
    for (int a = 0; a < 2; ++a) {
        Views *k = a ? &kx : &ky;
        PyObject *list = a ? kx_obj : ky_obj;
        k->n = images->n;
        k->v = calloc(images->n ? images->n : 1, sizeof(Py_buffer));
        if (!k->v) {
            PyErr_NoMemory();
            goto done;
        }
        for (; k->got < k->n; ++k->got) {
            Py_buffer *w = &k->v[k->got];
            if (get_param(PyList_GET_ITEM(list, k->got), a ? "kx" : "ky", 'f', 1, 0, w) < 0) goto done;
            if (w->len / 4 % 2 == 0) {
                ++k->got;
                PyErr_Format(PyExc_ValueError, "%s[%zd]: want an odd number of taps", a ? "kx" : "ky", k->got - 1);
                goto done;
            }
        }
        weights[a] = k->v;
    }
    size_t need = 1; /* one scratch for the batch, of the largest image's size */
    for (Py_ssize_t i = 0; i < images->n; ++i) {
        const Py_buffer *v = &images->v[i];
        const size_t h = (size_t)v->shape[0], w = (size_t)v->shape[1], c = (size_t)v->shape[2];
        const size_t rx = (size_t)(weights[1][i].len / 4 / 2);
        if (h * w * c + (w + 2 * rx) * c > need) need = h * w * c + (w + 2 * rx) * c;
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    float *mid = malloc(sizeof(float) * need);
    failed = !mid;
    for (Py_ssize_t i = 0; i < images->n && !failed; ++i) {
        const Py_buffer *v = &images->v[i];
        const int h = (int)v->shape[0], w = (int)v->shape[1], c = (int)v->shape[2];
        const int ry = (int)(weights[0][i].len / 4 / 2), rx = (int)(weights[1][i].len / 4 / 2);
        blur_one(v->buf, code(v) == 'B', b.outs.v[i].buf, h, w, c, weights[0][i].buf, ry, weights[1][i].buf, rx, mid,
                 mid + (size_t)h * w * c);
    }
    free(mid);
    Py_END_ALLOW_THREADS
    if (failed) PyErr_NoMemory();
    status = failed ? -1 : 0;
done:
    release_views(&ky);
    release_views(&kx);
    return close_batch(&b, status);
}

/* ---- affine warp ---------------------------------------------------------------------- */

static inline float tap(const uint8_t *src, int x, int y, int ch, int ih, int iw, int c, int use_fill,
                        const float *fill) {
    if (x < 0 || y < 0 || x >= iw || y >= ih) {
        if (use_fill) return fill[ch];
        x = x < 0 ? 0 : (x > iw - 1 ? iw - 1 : x);
        y = y < 0 ? 0 : (y > ih - 1 ? ih - 1 : y);
    }
    return (float)src[((int64_t)y * iw + x) * c + ch];
}

/* Output pixel (x, y) samples the source at m @ (x + 0.5, y + 0.5, 1), pixel centres at
 * integers (WARP_SOURCE, term by term). One output row at a time: the source positions
 * and bilinear weights of the whole row (vectorized), then the taps of each pixel gathered
 * into planes (t[tap][channel][x]), then the blend of the planes (vectorized), then the
 * levels interleaved. `scratch`: 23 * ow floats. */
static inline __attribute__((always_inline)) void warp_one(const uint8_t *src, int ih, int iw, int c, uint8_t *dst,
                                                           int oh, int ow, const float *m, const float *fill,
                                                           int interp, int use_fill, float *scratch) {
    float *sx = scratch, *sy = sx + ow, *fx = sy + ow, *fy = fx + ow, *t = fy + ow;  /* t: [tap][4 channels][ow] */
    uint8_t *level = (uint8_t *)(t + (int64_t)16 * ow);  /* [c][ow] */
    int *xs = (int *)(t + (int64_t)17 * ow), *ys = xs + ow;  /* the top-left taps */
    const float xmax = iw + 1.0f, ymax = ih + 1.0f;
    for (int y = 0; y < oh; ++y) {
        const float dy = y + 0.5f;
        uint8_t *d = dst + (int64_t)y * ow * c;
        /* held within 2 pixels of the image: taps beyond read what the nearest one there
           reads, and the int conversions cannot overflow */
        for (int x = 0; x < ow; ++x) {
            const float dx = x + 0.5f;
            sx[x] = hold(m[0] * dx + m[1] * dy + m[2] - 0.5f, -2.0f, xmax);
            sy[x] = hold(m[3] * dx + m[4] * dy + m[5] - 0.5f, -2.0f, ymax);
        }
        if (interp == 1) {
            for (int x = 0; x < ow; ++x) {
                const int xi = floor_int(sx[x] + 0.5f), yi = floor_int(sy[x] + 0.5f);
                if (xi >= 0 && yi >= 0 && xi < iw && yi < ih) {
                    const uint8_t *p = src + ((int64_t)yi * iw + xi) * c;
                    for (int ch = 0; ch < c; ++ch) d[(int64_t)x * c + ch] = p[ch];
                } else {
                    for (int ch = 0; ch < c; ++ch)
                        d[(int64_t)x * c + ch] = to_level(tap(src, xi, yi, ch, ih, iw, c, use_fill, fill));
                }
            }
            continue;
        }
        for (int x = 0; x < ow; ++x) {
            const int x0 = floor_int(sx[x]), y0 = floor_int(sy[x]);
            fx[x] = sx[x] - x0;
            fy[x] = sy[x] - y0;
            xs[x] = x0;
            ys[x] = y0;
        }
        for (int x = 0; x < ow; ++x) {
            const int x0 = xs[x], y0 = ys[x];
            if (x0 >= 0 && y0 >= 0 && x0 + 1 < iw && y0 + 1 < ih) {  /* all four taps inside */
                const uint8_t *p = src + ((int64_t)y0 * iw + x0) * c, *q = p + (int64_t)iw * c;
                for (int ch = 0; ch < c; ++ch) {
                    float *tc = t + (int64_t)ch * ow + x;
                    tc[0] = p[ch];
                    tc[(int64_t)4 * ow] = p[c + ch];
                    tc[(int64_t)8 * ow] = q[ch];
                    tc[(int64_t)12 * ow] = q[c + ch];
                }
            } else {
                for (int ch = 0; ch < c; ++ch) {
                    float *tc = t + (int64_t)ch * ow + x;
                    tc[0] = tap(src, x0, y0, ch, ih, iw, c, use_fill, fill);
                    tc[(int64_t)4 * ow] = tap(src, x0 + 1, y0, ch, ih, iw, c, use_fill, fill);
                    tc[(int64_t)8 * ow] = tap(src, x0, y0 + 1, ch, ih, iw, c, use_fill, fill);
                    tc[(int64_t)12 * ow] = tap(src, x0 + 1, y0 + 1, ch, ih, iw, c, use_fill, fill);
                }
            }
        }
        for (int ch = 0; ch < c; ++ch) {
            const float *t00 = t + (int64_t)ch * ow, *t10 = t00 + (int64_t)4 * ow, *t01 = t00 + (int64_t)8 * ow,
                        *t11 = t00 + (int64_t)12 * ow;
            uint8_t *lc = level + (int64_t)ch * ow;
            for (int x = 0; x < ow; ++x) {
                const float top = t00[x] * (1.0f - fx[x]) + t10[x] * fx[x];
                const float bottom = t01[x] * (1.0f - fx[x]) + t11[x] * fx[x];
                lc[x] = to_level(top * (1.0f - fy[x]) + bottom * fy[x]);
            }
        }
        for (int x = 0; x < ow; ++x)
            for (int ch = 0; ch < c; ++ch) d[(int64_t)x * c + ch] = level[(int64_t)ch * ow + x];
    }
}

CLONES static void warp_image(const uint8_t *src, int ih, int iw, int c, uint8_t *dst, int oh, int ow,
                              const float *m, const float *fill, int interp, int use_fill, float *scratch) {
    if (c == 3)  /* RGB: the channel loops unrolled */
        warp_one(src, ih, iw, 3, dst, oh, ow, m, fill, interp, use_fill, scratch);
    else
        warp_one(src, ih, iw, c, dst, oh, ow, m, fill, interp, use_fill, scratch);
}

static PyObject *warp(PyObject *self, PyObject *args) {
    PyObject *images_obj, *matrices_obj, *fills_obj, *outs_obj;
    int interp, use_fill;
    if (!PyArg_ParseTuple(args, "OOOiiO", &images_obj, &matrices_obj, &fills_obj, &interp, &use_fill, &outs_obj))
        return NULL;
    if (interp != 0 && interp != 1) {
        PyErr_Format(PyExc_ValueError, "interp is 0 (linear) or 1 (nearest), got %d", interp);
        return NULL;
    }
    Batch b;
    Py_buffer fills = {0};
    int status = -1;
    if (open_views(&b, images_obj, outs_obj, 'B', ANY_HW) < 0
            || get_param(matrices_obj, "matrices", 'f', 6 * b.images.n, 0, &b.param) < 0
            || get_param(fills_obj, "fills", 'f', 4 * b.images.n, 0, &fills) < 0
            || up_to_4_channels(&b.images, "warp") < 0)
        goto done;
    size_t need = 1; /* one scratch for the batch, of the widest output's size */
    for (Py_ssize_t i = 0; i < b.images.n; ++i)
        if (23 * (size_t)b.outs.v[i].shape[1] > need) need = 23 * (size_t)b.outs.v[i].shape[1];
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    float *scratch = malloc(sizeof(float) * need);
    failed = !scratch;
    for (Py_ssize_t i = 0; i < b.images.n && !failed; ++i) {
        const Py_buffer *v = &b.images.v[i], *o = &b.outs.v[i];
        if (v->shape[0] == 0 || v->shape[1] == 0 || o->shape[0] == 0 || o->shape[1] == 0) continue;
        warp_image(v->buf, (int)v->shape[0], (int)v->shape[1], (int)v->shape[2], o->buf, (int)o->shape[0],
                   (int)o->shape[1], (const float *)b.param.buf + 6 * i, (const float *)fills.buf + 4 * i, interp,
                   use_fill, scratch);
    }
    free(scratch);
    Py_END_ALLOW_THREADS
    if (failed) PyErr_NoMemory();
    status = failed ? -1 : 0;
done:
    if (fills.obj) PyBuffer_Release(&fills);
    return close_batch(&b, status);
}

static PyMethodDef methods[] = {
    {"color", color, METH_VARARGS, "color(images, table, outs): see ops/_augment.pyi"},
    {"lut", lut, METH_VARARGS, "lut(images, tables, outs): see ops/_augment.pyi"},
    {"histogram", histogram, METH_VARARGS, "histogram(images, counts): see ops/_augment.pyi"},
    {"filter3x3", filter3x3, METH_VARARGS, "filter3x3(images, kernels, outs): see ops/_augment.pyi"},
    {"blur", blur, METH_VARARGS, "blur(images, ky, kx, outs): see ops/_augment.pyi"},
    {"jitter", jitter, METH_VARARGS, "jitter(images, params, outs): see ops/_augment.pyi"},
    {"mix", mix, METH_VARARGS, "mix(images, weights, outs): see ops/_augment.pyi"},
    {"paste", paste, METH_VARARGS, "paste(images, boxes, outs): see ops/_augment.pyi"},
    {"rng_seed", rng_seed, METH_VARARGS, "rng_seed(seeds, salt, state): see ops/_augment.pyi"},
    {"rng_next64", rng_next64, METH_VARARGS, "rng_next64(state, rows, out): see ops/_augment.pyi"},
    {"rng_uniform", rng_uniform, METH_VARARGS, "rng_uniform(state, rows, low, high, out): see ops/_augment.pyi"},
    {"rng_integers", rng_integers, METH_VARARGS, "rng_integers(state, rows, high, out): see ops/_augment.pyi"},
    {"rng_beta", rng_beta, METH_VARARGS, "rng_beta(state, rows, alpha, out): see ops/_augment.pyi"},
    {"rng_permutation", rng_permutation, METH_VARARGS, "rng_permutation(state, rows, k, out): see ops/_augment.pyi"},
    {"rng_boxes", rng_boxes, METH_VARARGS, "rng_boxes(state, rows, hw, scale, ratio, erase, out): see ops/_augment.pyi"},
    {"warp", warp, METH_VARARGS, "warp(images, matrices, fills, interp, use_fill, outs): see ops/_augment.pyi"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio.ops._augment", NULL, -1, methods};

PyMODINIT_FUNC PyInit__augment(void) { return PyModule_Create(&module); }
