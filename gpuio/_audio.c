/* CPU audio ops for gpuio.ops.audio, one call per batch, run with the GIL released.
 *
 * The rows of a batch lie end to end in one float32 array (gpuio.ops.ragged.pack);
 * `lengths` (int64) says where each ends. Both functions compute exactly what the
 * NumPy code in gpuio.ops.audio computes for one row at a time (same float32 and
 * float64 operations in the same order), only in one pass and without temporaries.
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
    int64_t total;
    if (get_lengths(o_lengths, &lv, &rows, &total) < 0) return NULL;
    if (get_buf(o_x, &xv, total * 4, 0, "x") < 0) goto fail_x;
    if (get_buf(o_y, &yv, total * 4, 1, "y") < 0) goto fail_y;
    Py_BEGIN_ALLOW_THREADS
    preemphasis_rows(xv.buf, yv.buf, lv.buf, rows, c, border);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&yv);
    PyBuffer_Release(&xv);
    PyBuffer_Release(&lv);
    Py_RETURN_NONE;
fail_y:
    PyBuffer_Release(&xv);
fail_x:
    PyBuffer_Release(&lv);
    return NULL;
}

/* One row: the window sums of x*x (float32 squares summed in float64, as a prefix sum:
 * power[k] = p[k + 1] - p[max(k + 1 - w, 0)], rounded to float32) into `power`, then the
 * first and the last k with power[k] >= the threshold: the row's largest power times
 * `ratio` in float32 when `fixed` is NaN, else `fixed` (float64). `ring` holds w doubles. */
static void region_row(const float *x, int64_t n, int64_t w, double ratio, double fixed, float *power,
                       double *ring, int64_t *first, int64_t *last) {
    memset(ring, 0, sizeof(double) * (size_t)w);
    double p = 0.0;
    float top = -INFINITY;
    int nan = 0;
    int64_t slot = 0;
    for (int64_t k = 0; k < n; ++k) {
        p += (double)(x[k] * x[k]);
        if (++slot == w) slot = 0;
        const float v = (float)(p - ring[slot]);  /* ring[slot] = p[k + 1 - w], 0 before the row */
        ring[slot] = p;
        power[k] = v;
        if (v > top) top = v;
        nan |= v != v;
    }
    *first = *last = -1;
    if (isnan(fixed)) {
        if (nan) return;  /* NumPy's maximum propagates NaN; nothing compares >= NaN */
        const float threshold = top * (float)ratio;
        for (int64_t k = 0; k < n && *first < 0; ++k)
            if (power[k] >= threshold) *first = k;
        for (int64_t k = n - 1; k >= 0 && *last < 0; --k)
            if (power[k] >= threshold) *last = k;
    } else {
        for (int64_t k = 0; k < n && *first < 0; ++k)
            if ((double)power[k] >= fixed) *first = k;
        for (int64_t k = n - 1; k >= 0 && *last < 0; --k)
            if ((double)power[k] >= fixed) *last = k;
    }
}

static PyObject *nonsilent(PyObject *self, PyObject *args) {
    PyObject *o_x, *o_lengths, *o_begin, *o_length;
    Py_ssize_t w;
    double ratio, fixed;
    if (!PyArg_ParseTuple(args, "OOnddOO", &o_x, &o_lengths, &w, &ratio, &fixed, &o_begin, &o_length))
        return NULL;
    if (w < 1) return PyErr_Format(PyExc_ValueError, "window %zd: must be >= 1", w);
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
    double *ring = malloc(sizeof(double) * (size_t)w);
    if (!power || !ring) {
        PyErr_NoMemory();
    } else {
        int64_t *begin = bv.buf, *length = nv.buf;
        Py_BEGIN_ALLOW_THREADS
        const float *x = xv.buf;
        for (Py_ssize_t r = 0; r < rows; ++r) {
            int64_t first, last;
            region_row(x, lengths[r], w, ratio, fixed, power, ring, &first, &last);
            begin[r] = last < 0 ? 0 : (first - (w - 1) > 0 ? first - (w - 1) : 0);
            length[r] = last < 0 ? 0 : last - begin[r] + 1;
            x += lengths[r];
        }
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    free(power);
    free(ring);
    PyBuffer_Release(&nv);
fail_n:
    PyBuffer_Release(&bv);
fail_b:
    PyBuffer_Release(&xv);
fail_x:
    PyBuffer_Release(&lv);
    return result;
}

static PyMethodDef methods[] = {
    {"preemphasis", preemphasis, METH_VARARGS,
     "preemphasis(x, y, lengths, coeff, border): y[t] = x[t] - coeff * x[t-1] per row of packed float32 rows "
     "(border 0 zero, 1 clamp, 2 reflect); see gpuio.ops.audio.PreemphasisFilter"},
    {"nonsilent", nonsilent, METH_VARARGS,
     "nonsilent(x, lengths, window, ratio, reference, begin, length): per row of packed float32 rows, the "
     "nonsilent region into int64 begin and length; reference NaN: the row's largest window power; see "
     "gpuio.ops.audio.NonsilentRegion"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gpuio._audio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__audio(void) { return PyModule_Create(&module); }
