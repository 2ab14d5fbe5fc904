/* CPU image ops for gpuio.ops, run with the GIL released.
 *
 * resample(): crop -> resize -> flip -> normalize -> layout -> cast for a whole batch
 * of uint8 HWC images in one call: the math of gpuio.ops.fused.fused_reference (the
 * windows and weights of gpuio.ops.geometry.filter_weights) for filters whose weights
 * are not negative (nearest, linear, area). With such weights the horizontal pass of
 * the reference never leaves 0-255, so the two passes commute: this runs the vertical
 * pass first, over contiguous rows (vectorizable), then the horizontal pass on one
 * float row, and differs from the reference by float rounding only.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { NEAREST = 0, LINEAR = 1, CUBIC = 2, AREA = 3 };

static double filter(int interp, double d, double fscale) {
    if (interp == AREA) {
        const double half = 0.5 * fscale;
        const double w = fmin(d + 0.5, half) - fmax(d - 0.5, -half);
        return w > 0.0 ? w : 0.0;
    }
    const double x = fabs(d / fscale);
    return x < 1.0 ? 1.0 - x : 0.0;
}

/* Windows and normalized weights of `out` output pixels of the box [start, start +
 * length) read from source pixels lo..hi-1: pixel o reads first[o] .. first[o] +
 * count[o] - 1 with weights w[o * taps ..]. Returns taps (0 on no memory). */
static int windows(int interp, int antialias, double start, double length, int out, int lo, int hi,
                   int **first, int **count, float **w) {
    const double scale = length / out;
    const double fscale = (antialias && scale > 1.0) ? scale : 1.0;
    const double support = interp == AREA ? 0.5 * fscale : fscale;
    int taps = interp == NEAREST ? 1 : (int)ceil(2.0 * support) + 2;
    *first = malloc(sizeof(int) * out);
    *count = malloc(sizeof(int) * out);
    *w = calloc((size_t)out * taps, sizeof(float));
    if (!*first || !*count || !*w) return 0;
    for (int o = 0; o < out; ++o) {
        const double c = start + (o + 0.5) * scale;
        int a, b;
        if (interp == NEAREST) {
            a = (int)floor(c);
            a = a < lo ? lo : (a > hi - 1 ? hi - 1 : a);
            b = a + 1;
        } else if (interp == AREA) {
            a = (int)floor(c - 0.5 * fscale);
            b = (int)ceil(c + 0.5 * fscale);
        } else {
            a = (int)floor(c - support + 0.5);
            b = (int)floor(c + support + 0.5);
        }
        if (a < lo) a = lo;
        if (b > hi) b = hi;
        if (b - a > taps) b = a + taps;
        if (b < a) b = a;
        double sum = 0.0, ws[taps];
        for (int j = a; j < b; ++j) {
            ws[j - a] = interp == NEAREST ? 1.0 : filter(interp, j + 0.5 - c, fscale);
            sum += ws[j - a];
        }
        if (sum == 0.0) sum = 1.0;
        for (int j = a; j < b; ++j) (*w)[(size_t)o * taps + j - a] = (float)(ws[j - a] / sum);
        (*first)[o] = a;
        (*count)[o] = b - a;
    }
    return taps;
}

typedef struct {
    const uint8_t *src;
    Py_ssize_t h, w, rs, cs, chs;
    double box[4];
    int64_t clip[4], out_hw[2], offset, flip;
} Sample;

typedef struct {
    int channels, interp, antialias, chw, to_uint8;
    const float *mean, *inv_std;
    char *out;
} Job;

typedef float v4f __attribute__((vector_size(16)));

/* The vertical pass: row[i] = sum_k w[k] * src[k][i] over n packed values, one tap at
 * a time (loops the compiler vectorizes, uint8 to float included). */
static inline __attribute__((always_inline)) void vertical(
        float *restrict row, const uint8_t *const *src, const float *w, int taps, int n) {
    if (taps == 0) {
        memset(row, 0, sizeof(float) * (size_t)n);
        return;
    }
    const uint8_t *restrict p = src[0];
    for (int i = 0; i < n; ++i) row[i] = w[0] * p[i];
    for (int k = 1; k < taps; ++k) {
        const uint8_t *restrict q = src[k];
        const float wk = w[k];
        for (int i = 0; i < n; ++i) row[i] += wk * q[i];
    }
}

/* The horizontal pass of output row oy from the vertical pass's `row`, then clip to
 * 0-255, normalize, cast and store. 3 or 4 channels go as one 4-lane vector: `row`
 * has one float of slack at the end for the 3-channel case. */
static inline __attribute__((always_inline)) void horizontal(
        const Job *job, const Sample *s, const float *restrict row, const int C, int oy, const int *xf,
        const int *xc, const float *xw, int tx) {
    const int ow = (int)s->out_hw[1], cx0 = (int)s->clip[1], chw = job->chw, to_uint8 = job->to_uint8;
    const int64_t plane = s->out_hw[0] * s->out_hw[1];
    float mean[4] = {0}, inv_std[4] = {0};
    memcpy(mean, job->mean, sizeof(float) * C);
    memcpy(inv_std, job->inv_std, sizeof(float) * C);
    for (int ox = 0; ox < ow; ++ox) {
        const int sx = (s->flip & 1) ? ow - 1 - ox : ox;
        const float *wx = xw + (size_t)sx * tx;
        const float *p = row + (size_t)(xf[sx] - cx0) * C;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (C >= 3) {
            v4f sum = {0};
            for (int k = 0; k < xc[sx]; ++k) {
                v4f v;
                memcpy(&v, p + k * C, sizeof v);
                sum += wx[k] * v;
            }
            memcpy(acc, &sum, sizeof acc);
        } else {
            for (int k = 0; k < xc[sx]; ++k)
                for (int c = 0; c < C; ++c) acc[c] += wx[k] * p[k * C + c];
        }
        const int64_t pix = (int64_t)oy * ow + ox;
        for (int c = 0; c < C; ++c) {
            float v = acc[c] < 0.0f ? 0.0f : (acc[c] > 255.0f ? 255.0f : acc[c]);
            v = (v - mean[c]) * inv_std[c];
            const int64_t idx = s->offset + (chw ? c * plane + pix : pix * C + c);
            if (to_uint8) {
                v = floorf(v + 0.5f);
                ((uint8_t *)job->out)[idx] = (uint8_t)(v < 0.0f ? 0.0f : (v > 255.0f ? 255.0f : v));
            } else {
                ((float *)job->out)[idx] = v;
            }
        }
    }
}

/* One sample; 0 on success, -1 when out of memory. */
__attribute__((target_clones("arch=x86-64-v3", "default")))
static int resample_one(const Job *job, const Sample *s) {
    const int C = job->channels, oh = (int)s->out_hw[0], ow = (int)s->out_hw[1];
    const int cy0 = (int)s->clip[0], cx0 = (int)s->clip[1], cy1 = (int)s->clip[2], cx1 = (int)s->clip[3];
    const int width = cx1 - cx0;
    int *yf = NULL, *yc = NULL, *xf = NULL, *xc = NULL;
    float *yw = NULL, *xw = NULL, *row = NULL;
    int ok = -1;
    const int ty = windows(job->interp, job->antialias, s->box[0], s->box[2], oh, cy0, cy1, &yf, &yc, &yw);
    const int tx = windows(job->interp, job->antialias, s->box[1], s->box[3], ow, cx0, cx1, &xf, &xc, &xw);
    row = calloc((size_t)width * C + 1, sizeof(float));
    if (!ty || !tx || !row) goto done;
    const int packed = s->cs == C && s->chs == 1;
    for (int oy = 0; oy < oh; ++oy) {
        const int sy = (s->flip & 2) ? oh - 1 - oy : oy;
        const uint8_t *src[yc[sy] > 0 ? yc[sy] : 1];
        for (int k = 0; k < yc[sy]; ++k)
            src[k] = s->src + (Py_ssize_t)(yf[sy] + k) * s->rs + (Py_ssize_t)cx0 * s->cs;
        const float *wy = yw + (size_t)sy * ty;
        if (packed) {
            vertical(row, src, wy, yc[sy], width * C);
        } else {
            for (int i = 0; i < width; ++i)
                for (int c = 0; c < C; ++c) {
                    float acc = 0.0f;
                    for (int k = 0; k < yc[sy]; ++k) acc += wy[k] * src[k][i * s->cs + c * s->chs];
                    row[i * C + c] = acc;
                }
        }
        if (C == 3) horizontal(job, s, row, 3, oy, xf, xc, xw, tx);
        else if (C == 1) horizontal(job, s, row, 1, oy, xf, xc, xw, tx);
        else horizontal(job, s, row, C, oy, xf, xc, xw, tx);
    }
    ok = 0;
done:
    free(yf); free(yc); free(yw); free(xf); free(xc); free(xw); free(row);
    return ok;
}

/* A contiguous buffer of at least `need` bytes; -1 with an exception set otherwise. */
static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t need, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (view->len < need) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", what, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *resample(PyObject *self, PyObject *args) {
    PyObject *images, *o_boxes, *o_clips, *o_hw, *o_offsets, *o_flips, *o_mean, *o_istd, *o_out;
    Job job;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOiiip", &images, &o_boxes, &o_clips, &o_hw, &o_offsets, &o_flips,
                          &o_mean, &o_istd, &o_out, &job.interp, &job.antialias, &job.chw, &job.to_uint8))
        return NULL;
    if (!PyList_Check(images)) return PyErr_Format(PyExc_TypeError, "images must be a list");
    if (job.interp == CUBIC || job.interp < NEAREST || job.interp > AREA)
        return PyErr_Format(PyExc_ValueError, "interp %d: nearest, linear or area only", job.interp);
    const Py_ssize_t n = PyList_GET_SIZE(images);
    Py_buffer bufs[6], out;
    PyObject *objs[6] = {o_boxes, o_clips, o_hw, o_offsets, o_flips, o_mean};
    const Py_ssize_t needs[6] = {32 * n, 32 * n, 16 * n, 8 * n, 8 * n, 0};
    Py_buffer *views = calloc(n ? n : 1, sizeof(Py_buffer));
    Sample *samples = calloc(n ? n : 1, sizeof(Sample));
    Py_buffer istd;
    int nbuf = 0, nviews = 0, have_istd = 0, have_out = 0, channels = -1;
    PyObject *result = NULL;
    if (!views || !samples) { PyErr_NoMemory(); goto done; }
    for (; nbuf < 6; ++nbuf)
        if (get_buf(objs[nbuf], &bufs[nbuf], needs[nbuf], 0, "parameter array") < 0) goto done;
    if (get_buf(o_istd, &istd, bufs[5].len, 0, "inv_std") < 0) goto done;
    have_istd = 1;
    if (get_buf(o_out, &out, 0, 1, "out") < 0) goto done;
    have_out = 1;
    const double *boxes = bufs[0].buf;
    const int64_t *clips = bufs[1].buf, *hw = bufs[2].buf, *offsets = bufs[3].buf, *flips = bufs[4].buf;
    const Py_ssize_t item = job.to_uint8 ? 1 : 4;
    for (; nviews < n; ++nviews) {
        Py_buffer *v = &views[nviews];
        if (PyObject_GetBuffer(PyList_GET_ITEM(images, nviews), v, PyBUF_STRIDED_RO) < 0) goto done;
        Sample *s = &samples[nviews];
        const int64_t *c = clips + 4 * nviews;
        if (v->ndim != 3 || v->itemsize != 1 || (channels >= 0 && v->shape[2] != channels) || v->shape[2] > 4
                || c[0] < 0 || c[1] < 0 || c[2] > v->shape[0] || c[3] > v->shape[1] || c[0] >= c[2] || c[1] >= c[3]
                || hw[2 * nviews] < 1 || hw[2 * nviews + 1] < 1
                || (offsets[nviews] + hw[2 * nviews] * hw[2 * nviews + 1] * v->shape[2]) * item > out.len) {
            PyErr_Format(PyExc_ValueError, "image %zd: want uint8 HWC with the batch's 1-4 channels, a clip "
                         "inside it and an output inside `out`", nviews);
            ++nviews;
            goto done;
        }
        channels = (int)v->shape[2];
        s->src = v->buf;
        s->h = v->shape[0]; s->w = v->shape[1];
        s->rs = v->strides[0]; s->cs = v->strides[1]; s->chs = v->strides[2];
        memcpy(s->box, boxes + 4 * nviews, sizeof s->box);
        memcpy(s->clip, c, sizeof s->clip);
        memcpy(s->out_hw, hw + 2 * nviews, sizeof s->out_hw);
        s->offset = offsets[nviews];
        s->flip = flips[nviews];
    }
    if (n && bufs[5].len < (Py_ssize_t)sizeof(float) * channels) {
        PyErr_Format(PyExc_ValueError, "mean has fewer than %d values", channels);
        goto done;
    }
    job.channels = channels;
    job.mean = bufs[5].buf;
    job.inv_std = istd.buf;
    job.out = out.buf;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !failed; ++i) failed = resample_one(&job, &samples[i]);
    Py_END_ALLOW_THREADS
    if (failed) { PyErr_NoMemory(); goto done; }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < nviews; ++i) PyBuffer_Release(&views[i]);
    for (int i = 0; i < nbuf; ++i) PyBuffer_Release(&bufs[i]);
    if (have_istd) PyBuffer_Release(&istd);
    if (have_out) PyBuffer_Release(&out);
    free(views);
    free(samples);
    return result;
}

static PyMethodDef methods[] = {
    {"resample", resample, METH_VARARGS,
     "resample(images, boxes, clips, out_hw, offsets, flips, mean, inv_std, out, interp, antialias, chw, "
     "to_uint8): see gpuio.ops.fused"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio._cpuops", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpuops(void) { return PyModule_Create(&module); }
