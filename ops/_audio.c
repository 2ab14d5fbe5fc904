/* CPU audio ops for gpuio.ops.audio and gpuio.ops.spectral, one call per batch (or
 * group of rows), run with the GIL released.
 *
 * The rows of a batch lie end to end in one float32 array (gpuio.ops.ragged.pack);
 * `lengths` (int64) says where each ends. preemphasis, nonsilent, frames and power compute
 * exactly what the NumPy code they replace computes for one row at a time (same float32
 * and float64 operations in the same order), only in one pass and without temporaries;
 * sparse_matmul and normalize sum in another order than NumPy (float32 rounding apart).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { BORDER_ZERO = 0, BORDER_CLAMP = 1, BORDER_REFLECT = 2 };

/* A contiguous buffer of exactly `need` bytes; -1 with an exception set otherwise. */
static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t need, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len != need) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, view->len, need);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The rows' lengths and their sum; -1 with an exception set when one is negative. */
static int get_lengths(PyObject *obj, Py_buffer *view, Py_ssize_t *rows, int64_t *total) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % 8) {
        PyErr_SetString(PyExc_ValueError, "lengths: int64 expected");
        PyBuffer_Release(view);
        return -1;
    }
    *rows = view->len / 8;
    *total = 0;
    for (Py_ssize_t i = 0; i < *rows; ++i) {
        const int64_t n = ((const int64_t *)view->buf)[i];
        if (n < 0) {
            PyErr_Format(PyExc_ValueError, "lengths[%zd] = %lld is negative", i, (long long)n);
            PyBuffer_Release(view);
            return -1;
        }
        *total += n;
    }
    return 0;
}

/* Packed float32 rows in and out: their lengths, x, and a writable out of the same size
 * (`width` floats per time step); -1 with an exception set and nothing held otherwise. */
static int get_rows(PyObject *o_lengths, PyObject *o_x, PyObject *o_out, Py_ssize_t width, Py_buffer *lv,
                    Py_buffer *xv, Py_buffer *ov, Py_ssize_t *rows) {
    int64_t total;
    if (get_lengths(o_lengths, lv, rows, &total) < 0) return -1;
    if (get_buf(o_x, xv, total * width * 4, 0, "x") < 0) {
        PyBuffer_Release(lv);
        return -1;
    }
    if (get_buf(o_out, ov, total * width * 4, 1, "out") < 0) {
        PyBuffer_Release(xv);
        PyBuffer_Release(lv);
        return -1;
    }
    return 0;
}

static void preemphasis_rows(const float *x, float *y, const int64_t *lengths, Py_ssize_t rows, float c,
                             int border) {
    for (Py_ssize_t r = 0; r < rows; ++r) {
        const int64_t n = lengths[r];
        if (n > 0) {
            const float prev = border == BORDER_ZERO ? 0.0f : (border == BORDER_REFLECT && n > 1 ? x[1] : x[0]);
            y[0] = border == BORDER_ZERO ? x[0] : x[0] - c * prev;
            for (int64_t t = 1; t < n; ++t) y[t] = x[t] - c * x[t - 1];
        }
        x += n;
        y += n;
    }
}

static PyObject *preemphasis(PyObject *self, PyObject *args) {
    PyObject *o_x, *o_y, *o_lengths;
    float c;
    int border;
    if (!PyArg_ParseTuple(args, "OOOfi", &o_x, &o_y, &o_lengths, &c, &border)) return NULL;
    if (border < BORDER_ZERO || border > BORDER_REFLECT)
        return PyErr_Format(PyExc_ValueError, "border %d: 0 (zero), 1 (clamp) or 2 (reflect)", border);
    Py_buffer lv, xv, yv;
    Py_ssize_t rows;
    if (get_rows(o_lengths, o_x, o_y, 1, &lv, &xv, &yv, &rows) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    preemphasis_rows(xv.buf, yv.buf, lv.buf, rows, c, border);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&yv);
    PyBuffer_Release(&xv);
    PyBuffer_Release(&lv);
    Py_RETURN_NONE;
}

/* One row as DALI's nonsilent_region computes it: power[k], the mean of x*x over the w
 * samples up to sample k (fewer at the row's start; w = min(window, n)), a float32 running
 * sum that adds the square of sample k, gives power[k], then subtracts the square of the
 * window's first sample; at every `reset`-th sample (`reset` < 0: only the first) the sum
 * restarts from the w - 1 samples before it, added in order. Then the first and the last
 * k with power[k] >= the threshold: the row's largest power (NaNs skipped, unless the
 * first is NaN) times `ratio` in float32 when `fixed` is NaN, else `fixed` (a float32
 * value). */
static void region_row(const float *x, int64_t n, int64_t window, int64_t reset, double ratio, double fixed,
                       float *power, int64_t *first, int64_t *last) {
    const int64_t w = window < n ? window : n, interval = reset < 0 ? n : reset;
    const float mean = 1.0f / (float)w;
    *first = *last = -1;
    for (int64_t start = 0; start < n; start += interval) {
        float sum = 0.0f;
        for (int64_t j = start - w + 1 > 0 ? start - w + 1 : 0; j < start; ++j) sum += x[j] * x[j];
        const int64_t stop = start + interval < n ? start + interval : n;
        for (int64_t k = start; k < stop; ++k) {
            sum += x[k] * x[k];
            power[k] = sum * mean;
            if (k + 1 >= w) sum -= x[k + 1 - w] * x[k + 1 - w];
        }
    }
    float threshold = (float)fixed;
    if (isnan(fixed) && n > 0) {
        float top = power[0];  /* as std::max from the first: a NaN first stays, later NaNs are skipped */
        for (int64_t k = 1; k < n; ++k)
            if (top < power[k]) top = power[k];
        threshold = top * (float)ratio;
    }
    for (int64_t k = 0; k < n && *first < 0; ++k)
        if (power[k] >= threshold) *first = k;
    for (int64_t k = n - 1; k >= 0 && *last < 0; --k)
        if (power[k] >= threshold) *last = k;
}

static PyObject *nonsilent(PyObject *self, PyObject *args) {
    PyObject *o_x, *o_lengths, *o_begin, *o_length;
    Py_ssize_t w, reset;
    double ratio, fixed;
    if (!PyArg_ParseTuple(args, "OOnnddOO", &o_x, &o_lengths, &w, &reset, &ratio, &fixed, &o_begin, &o_length))
        return NULL;
    if (w < 1) return PyErr_Format(PyExc_ValueError, "window %zd: must be >= 1", w);
    if (reset == 0 || (reset > 0 && reset % w))
        return PyErr_Format(PyExc_ValueError, "reset interval %zd: must be -1 or a multiple of the window", reset);
    Py_buffer lv, xv, bv, nv;
    Py_ssize_t rows;
    int64_t total, longest = 0;
    PyObject *result = NULL;
    if (get_lengths(o_lengths, &lv, &rows, &total) < 0) return NULL;
    if (get_buf(o_x, &xv, total * 4, 0, "x") < 0) goto fail_x;
    if (get_buf(o_begin, &bv, rows * 8, 1, "begin") < 0) goto fail_b;
    if (get_buf(o_length, &nv, rows * 8, 1, "length") < 0) goto fail_n;
    const int64_t *lengths = lv.buf;
    for (Py_ssize_t r = 0; r < rows; ++r) longest = lengths[r] > longest ? lengths[r] : longest;
    float *power = malloc(sizeof(float) * (size_t)(longest ? longest : 1));
    if (!power) {
        PyErr_NoMemory();
    } else {
        int64_t *begin = bv.buf, *length = nv.buf;
        Py_BEGIN_ALLOW_THREADS
        const float *x = xv.buf;
        for (Py_ssize_t r = 0; r < rows; ++r) {
            int64_t first, last;
            region_row(x, lengths[r], w, reset, ratio, fixed, power, &first, &last);
            /* from the start of the first loud window (w samples, fewer in a shorter row) */
            const int64_t row_w = w < lengths[r] ? w : lengths[r];
            begin[r] = last < 0 ? 0 : (first - (row_w - 1) > 0 ? first - (row_w - 1) : 0);
            length[r] = last < 0 ? 0 : last - begin[r] + 1;
            x += lengths[r];
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    free(power);
    PyBuffer_Release(&nv);
fail_n:
    PyBuffer_Release(&bv);
fail_b:
    PyBuffer_Release(&xv);
fail_x:
    PyBuffer_Release(&lv);
    return result;
}

enum { FRAMES_WHOLE = 0, FRAMES_REFLECT = 1, FRAMES_ZERO = 2 };

/* Sample `i` of a row of `n` samples extended as np.pad's "reflect" mode extends it
 * (mirrored without repeating the edge, periodic beyond one mirror). */
static int64_t reflect(int64_t i, int64_t n) {
    if (n == 1) return 0;
    const int64_t period = 2 * (n - 1);
    i %= period;
    if (i < 0) i += period;
    return i < n ? i : period - i;
}

/* `count` windows of one row, window k from sample k * step - half, times `window`, into
 * the first `win` columns of consecutive rows of `out` (`nfft` floats apart). */
static void frame_row(const char *x, Py_ssize_t stride, int64_t n, int64_t count, const float *window, int64_t win,
                      int64_t step, int64_t half, int mode, float *out, int64_t nfft) {
    for (int64_t k = 0; k < count; ++k, out += nfft) {
        const int64_t s = k * step - half;
        if (s >= 0 && s + win <= n) {
            const char *p = x + s * stride;
            if (stride == 4)
                for (int64_t j = 0; j < win; ++j) out[j] = ((const float *)p)[j] * window[j];
            else
                for (int64_t j = 0; j < win; ++j) out[j] = *(const float *)(p + j * stride) * window[j];
            continue;
        }
        for (int64_t j = 0; j < win; ++j) {
            const int64_t i = s + j;
            float v = 0.0f;
            if (i >= 0 && i < n) v = *(const float *)(x + i * stride);
            else if (mode == FRAMES_REFLECT) v = *(const float *)(x + reflect(i, n) * stride);
            out[j] = v * window[j];
        }
    }
}

static PyObject *frames(PyObject *self, PyObject *args) {
    PyObject *rows, *o_counts, *o_window, *o_out;
    Py_ssize_t step, half, nfft;
    int mode;
    if (!PyArg_ParseTuple(args, "OOOnninO", &rows, &o_counts, &o_window, &step, &half, &mode, &nfft, &o_out))
        return NULL;
    if (!PyList_Check(rows)) return PyErr_Format(PyExc_TypeError, "rows must be a list");
    if (mode < FRAMES_WHOLE || mode > FRAMES_ZERO || step < 1 || half < 0)
        return PyErr_Format(PyExc_ValueError, "mode %d, step %zd, half %zd: want mode 0-2, step >= 1, half >= 0",
                            mode, step, half);
    const Py_ssize_t nrows = PyList_GET_SIZE(rows);
    Py_buffer cv, wv, ov;
    Py_buffer *views = calloc(nrows ? nrows : 1, sizeof(Py_buffer));
    Py_ssize_t nviews = 0;
    int have = 0;
    PyObject *result = NULL;
    if (!views) return PyErr_NoMemory();
    if (get_buf(o_counts, &cv, nrows * 8, 0, "counts") < 0) goto done;
    ++have;
    if (PyObject_GetBuffer(o_window, &wv, PyBUF_C_CONTIGUOUS) < 0) goto done;
    ++have;
    const int64_t win = wv.len / 4, *counts = cv.buf;
    int64_t total = 0;
    for (Py_ssize_t r = 0; r < nrows; ++r) total += counts[r];
    if (PyObject_GetBuffer(o_out, &ov, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto done;
    ++have;
    if (win < 1 || nfft < win || ov.len < total * nfft * 4) {
        PyErr_Format(PyExc_ValueError, "out: %zd bytes for %lld frames of %zd floats (window %lld)", ov.len,
                     (long long)total, nfft, (long long)win);
        goto done;
    }
    for (; nviews < nrows; ++nviews) {
        Py_buffer *v = &views[nviews];
        if (PyObject_GetBuffer(PyList_GET_ITEM(rows, nviews), v, PyBUF_STRIDED_RO | PyBUF_FORMAT) < 0) goto done;
        const int64_t n = v->ndim == 1 ? v->shape[0] : 0;
        const int64_t need = mode == FRAMES_WHOLE ? (counts[nviews] - 1) * step + win : 0;
        const char *format = v->format ? v->format : "B";
        if (v->ndim != 1 || v->itemsize != 4 || format[strlen(format) - 1] != 'f' || n < 1 ||
                counts[nviews] < 0 || need > n) {
            PyErr_Format(PyExc_ValueError, "row %zd: want a float32 [T] row with T >= 1 holding its %lld windows",
                         nviews, (long long)counts[nviews]);
            ++nviews;
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    float *out = ov.buf;
    for (Py_ssize_t r = 0; r < nrows; ++r) {
        frame_row(views[r].buf, views[r].strides[0], views[r].shape[0], counts[r], wv.buf, win, step, half, mode,
                  out, nfft);
        out += counts[r] * nfft;
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < nviews; ++i) PyBuffer_Release(&views[i]);
    if (have > 2) PyBuffer_Release(&ov);
    if (have > 1) PyBuffer_Release(&wv);
    if (have > 0) PyBuffer_Release(&cv);
    free(views);
    return result;
}

/* out[t, f] = sum over k of spec[t, k] * weights[k, f], over the bins where column f of
 * `weights` is not zero (a mel filter bank: a few bins per filter). */
static PyObject *sparse_matmul(PyObject *self, PyObject *args) {
    PyObject *o_spec, *o_weights, *o_out;
    Py_ssize_t bins, nout;
    if (!PyArg_ParseTuple(args, "OOnnO", &o_spec, &o_weights, &bins, &nout, &o_out)) return NULL;
    if (bins < 1 || nout < 1) return PyErr_Format(PyExc_ValueError, "bins %zd, outputs %zd", bins, nout);
    Py_buffer sv, wv, ov;
    PyObject *result = NULL;
    if (get_buf(o_weights, &wv, bins * nout * 4, 0, "weights") < 0) return NULL;
    if (PyObject_GetBuffer(o_spec, &sv, PyBUF_C_CONTIGUOUS) < 0) goto fail_s;
    const Py_ssize_t rows = sv.len / (bins * 4);
    if (sv.len != rows * bins * 4) {
        PyErr_Format(PyExc_ValueError, "spec: %zd bytes is not a whole number of rows of %zd floats", sv.len, bins);
        goto fail_o;
    }
    if (get_buf(o_out, &ov, rows * nout * 4, 1, "out") < 0) goto fail_o;
    const float *w = wv.buf;
    Py_ssize_t *lo = malloc(sizeof(Py_ssize_t) * nout * 2);
    float *packed = malloc(sizeof(float) * bins * nout);  /* column f's nonzero span, contiguous */
    if (!lo || !packed) {
        PyErr_NoMemory();
    } else {
        Py_ssize_t *hi = lo + nout, used = 0;
        for (Py_ssize_t f = 0; f < nout; ++f) {
            lo[f] = bins;
            hi[f] = 0;
            for (Py_ssize_t k = 0; k < bins; ++k)
                if (w[k * nout + f] != 0.0f) {
                    if (lo[f] == bins) lo[f] = k;
                    hi[f] = k + 1;
                }
            if (hi[f] < lo[f]) hi[f] = lo[f];
            for (Py_ssize_t k = lo[f]; k < hi[f]; ++k) packed[used++] = w[k * nout + f];
        }
        Py_BEGIN_ALLOW_THREADS
        const float *s = sv.buf;
        float *o = ov.buf;
        for (Py_ssize_t t = 0; t < rows; ++t, s += bins, o += nout) {
            const float *p = packed;
            for (Py_ssize_t f = 0; f < nout; ++f) {
                float acc = 0.0f;
                for (Py_ssize_t k = lo[f]; k < hi[f]; ++k) acc += s[k] * *p++;
                o[f] = acc;
            }
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    free(lo);
    free(packed);
    PyBuffer_Release(&ov);
fail_o:
    PyBuffer_Release(&sv);
fail_s:
    PyBuffer_Release(&wv);
    return result;
}

/* Per row of `lengths[r]` consecutive [T, F] frames of packed float32 x, per feature f:
 * (x - mean) * scale / sqrt(var + epsilon) + shift into out, the mean and the variance
 * (divided by T - ddof, at least 1) over the row's T frames, summed in float64 and
 * rounded to float32 as gpuio.ops.ragged.NormalizeAxes does; a zero deviation gives 0. */
static void normalize_row(const float *x, int64_t t, int64_t f, int64_t ddof, double epsilon, double scale,
                          float shift, double *sum, float *mean, float *inv, float *out) {
    const double count = (double)(t - ddof > 1 ? t - ddof : 1), n = (double)(t > 1 ? t : 1);
    memset(sum, 0, sizeof(double) * (size_t)f);
    for (int64_t i = 0; i < t; ++i)
        for (int64_t j = 0; j < f; ++j) sum[j] += x[i * f + j];
    for (int64_t j = 0; j < f; ++j) mean[j] = (float)(sum[j] / n);
    memset(sum, 0, sizeof(double) * (size_t)f);
    for (int64_t i = 0; i < t; ++i)
        for (int64_t j = 0; j < f; ++j) {
            const float d = x[i * f + j] - mean[j];
            sum[j] += d * d;
        }
    for (int64_t j = 0; j < f; ++j) {
        const float v = (float)(sum[j] / count) + (float)epsilon;
        inv[j] = v > 0.0f ? (float)scale / sqrtf(v > 1e-30f ? v : 1e-30f) : 0.0f;
    }
    for (int64_t i = 0; i < t; ++i)
        for (int64_t j = 0; j < f; ++j) {
            const float y = (x[i * f + j] - mean[j]) * inv[j];
            out[i * f + j] = shift != 0.0f ? y + shift : y;
        }
}

static PyObject *normalize(PyObject *self, PyObject *args) {
    PyObject *o_x, *o_lengths, *o_out;
    Py_ssize_t features, ddof;
    double epsilon, scale, shift;
    if (!PyArg_ParseTuple(args, "OOnndddO", &o_x, &o_lengths, &features, &ddof, &epsilon, &scale, &shift, &o_out))
        return NULL;
    if (features < 1) return PyErr_Format(PyExc_ValueError, "features %zd: must be >= 1", features);
    Py_buffer lv, xv, ov;
    Py_ssize_t rows;
    PyObject *result = NULL;
    if (get_rows(o_lengths, o_x, o_out, features, &lv, &xv, &ov, &rows) < 0) return NULL;
    double *sum = malloc(sizeof(double) * features);
    float *stats = malloc(sizeof(float) * features * 2);
    if (!sum || !stats) {
        PyErr_NoMemory();
    } else {
        Py_BEGIN_ALLOW_THREADS
        const int64_t *lengths = lv.buf;
        const float *x = xv.buf;
        float *out = ov.buf;
        for (Py_ssize_t r = 0; r < rows; ++r) {
            normalize_row(x, lengths[r], features, ddof, epsilon, scale, (float)shift, sum, stats, stats + features,
                          out);
            x += lengths[r] * features;
            out += lengths[r] * features;
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    free(sum);
    free(stats);
    PyBuffer_Release(&ov);
    PyBuffer_Release(&xv);
    PyBuffer_Release(&lv);
    return result;
}

/* out[i] = re[i]**2 + im[i]**2 of interleaved complex64 values (float32 squares added). */
static PyObject *power(PyObject *self, PyObject *args) {
    PyObject *o_spec, *o_out;
    if (!PyArg_ParseTuple(args, "OO", &o_spec, &o_out)) return NULL;
    Py_buffer sv, ov;
    if (PyObject_GetBuffer(o_out, &ov, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (get_buf(o_spec, &sv, ov.len * 2, 0, "spec") < 0) {
        PyBuffer_Release(&ov);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const float *c = sv.buf;
    float *out = ov.buf;
    for (Py_ssize_t i = 0, n = ov.len / 4; i < n; ++i) out[i] = c[2 * i] * c[2 * i] + c[2 * i + 1] * c[2 * i + 1];
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&sv);
    PyBuffer_Release(&ov);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"preemphasis", preemphasis, METH_VARARGS,
     "preemphasis(x, y, lengths, coeff, border): y[t] = x[t] - coeff * x[t-1] per row of packed float32 rows "
     "(border 0 zero, 1 clamp, 2 reflect); see gpuio.ops.audio.PreemphasisFilter"},
    {"nonsilent", nonsilent, METH_VARARGS,
     "nonsilent(x, lengths, window, reset, ratio, threshold, begin, length): per row of packed float32 rows, "
     "the nonsilent region into int64 begin and length; threshold NaN: the row's largest window power times "
     "ratio; see "
     "gpuio.ops.audio.NonsilentRegion"},
    {"frames", frames, METH_VARARGS,
     "frames(rows, counts, window, step, half, mode, nfft, out): the windowed frames of float32 rows into "
     "out [frames, nfft] (mode 0 whole windows, 1 reflect padding, 2 zero padding); see "
     "gpuio.ops.spectral.Spectrogram.frames"},
    {"sparse_matmul", sparse_matmul, METH_VARARGS,
     "sparse_matmul(spec, weights, bins, outputs, out): out [T, outputs] = spec [T, bins] @ weights "
     "[bins, outputs], float32, summing each column's nonzero span only (mel filter banks)"},
    {"normalize", normalize, METH_VARARGS,
     "normalize(x, lengths, features, ddof, epsilon, scale, shift, out): per row of packed float32 [T, F] "
     "frames, each feature normalized over the row's frames; see gpuio.ops.ragged.NormalizeAxes"},
    {"power", power, METH_VARARGS,
     "power(spec, out): |spec|**2 of complex64 values into float32 out (as NumPy's squares and sum)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio.ops._audio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__audio(void) { return PyModule_Create(&module); }
